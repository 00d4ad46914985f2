"""The SentencePiece wrapper: trains one joint model (or one per side) with fixed special ids,
encodes and decodes batches of lines, and round-trips through plain bytes so checkpoints carry it."""

from __future__ import annotations

import io
import itertools
import os
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

import sentencepiece as spm

from mtrain.config import TokenizerConfig
from mtrain.errors import MtrainError

# Fixed for every mtrain model, so PAD can be masked and BOS/EOS added without asking the tokenizer.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
SPECIAL_IDS = {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID}
MODEL_TYPES = ("unigram", "bpe")
STATE_VERSION = 1


def _train_model(lines: Iterable[str], cfg: TokenizerConfig, side: str, control_symbols: Sequence[str] = ()) -> bytes:
    """Train one SentencePiece model in memory and return its serialized proto. control_symbols:
    reserved pieces (ids from 4 on) that no text encodes to and decoding drops: corpus tags."""
    if cfg.model_type not in MODEL_TYPES:
        raise MtrainError(f"--model-type {cfg.model_type!r}: unknown; use one of {', '.join(MODEL_TYPES)}")
    spm.set_random_generator_seed(cfg.seed)  # sentence sampling and EM are then repeatable
    buffer = io.BytesIO()
    # Only when there are some: the model records its options, so none keeps untagged models as they were.
    extra = {"control_symbols": list(control_symbols)} if control_symbols else {}
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=buffer,
            vocab_size=cfg.vocab_size,
            model_type=cfg.model_type,
            character_coverage=cfg.character_coverage,
            input_sentence_size=cfg.input_sentence_size,
            shuffle_input_sentence=True,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            # Unseen characters (emoji, rare scripts) become UTF-8 byte pieces instead of <unk>,
            # so decode(encode(s)) gives back s for any input.
            byte_fallback=True,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,  # SentencePiece logs pages of INFO lines otherwise
            **extra,
        )
    except RuntimeError as err:
        raise _friendly_training_error(str(err), cfg, side) from None
    return buffer.getvalue()


def _friendly_training_error(message: str, cfg: TokenizerConfig, side: str) -> MtrainError:
    """Turn SentencePiece's INTERNAL check failures into one actionable line."""
    too_high = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", message)
    if too_high:
        return MtrainError(
            f"--vocab-size {too_high.group(1)} is too large for this {side} training text "
            f"(SentencePiece can make at most {too_high.group(2)} pieces); "
            f"pass a smaller --vocab-size, e.g. --vocab-size {int(too_high.group(2)) // 1000 * 1000 or too_high.group(2)}"
        )
    too_small = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", message)
    if too_small:
        return MtrainError(
            f"--vocab-size {too_small.group(1)} is too small: the {side} training text has "
            f"{too_small.group(2)} distinct characters plus special pieces; pass --vocab-size of at least "
            f"{int(too_small.group(2)) + 256} (256 byte-fallback pieces are added too)"
        )
    if "sentences_.empty()" in message:
        return MtrainError(f"the {side} training text is empty after cleaning; check the training split")
    first = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return MtrainError(f"SentencePiece training failed on the {side} text: {first}")


class Side:
    """The SentencePiece model of one side (source or target): encode, sample, decode, normalize."""

    def __init__(self, model: bytes) -> None:
        self.model = model  # the serialized proto, as spm.model holds it
        self._proc = spm.SentencePieceProcessor(model_proto=model)
        _check_special_ids(self._proc)
        self.vocab_size: int = self._proc.get_piece_size()

    def encode(self, lines: list[str]) -> list[list[int]]:
        return self._proc.encode(list(lines), out_type=int, num_threads=os.cpu_count() or 1)

    def sample(self, lines: list[str], alpha: float, seed: int) -> list[list[int]]:
        """One sampled segmentation per line (subword regularization / BPE-dropout), repeatable
        within a process: the same (lines, alpha, seed) give the same ids."""
        # One thread: each SentencePiece thread draws from its own generator, so with more threads
        # the draws depend on how lines are shared out, and the result is not repeatable.
        spm.set_random_generator_seed(seed)
        return self._proc.encode(list(lines), out_type=int, enable_sampling=True, alpha=alpha, nbest_size=-1,
                                 num_threads=1)

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Detokenized text. PAD/BOS/EOS are skipped; UNK shows as ' ⁇ ' (it cannot occur in
        encoded input thanks to byte fallback, only in model output)."""
        size = self.vocab_size
        # Ids from tensors may be numpy/torch ints; out-of-range ids would crash SentencePiece.
        clean = [[int(i) for i in seq if int(i) not in _SKIP and 0 <= int(i) < size] for seq in ids]
        return self._proc.decode(clean) if clean else []  # SentencePiece decodes [] as one empty line: ''

    def normalize(self, lines: list[str]) -> list[str]:
        """The text SentencePiece actually sees (NFKC, whitespace collapsed): decode(encode(s)) == this."""
        # normalize() marks spaces with U+2581 and keeps a leading one; decoded text has plain spaces.
        # Not strip(): it would also eat U+0085.
        return [self._proc.normalize(line).replace("\u2581", " ").strip(" ") for line in lines]

    def pieces(self, line: str) -> list[str]:
        return self._proc.encode(line, out_type=str)

    def control_id(self, symbol: str) -> int:
        """The id of a reserved (control) piece such as a corpus tag."""
        piece = self._proc.piece_to_id(symbol)
        if piece == UNK_ID or not self._proc.is_control(piece):
            raise MtrainError(f"SentencePiece model has no reserved piece {symbol!r}; re-run `mtrain tokenize`")
        return piece


class Tokenizer:
    """One SentencePiece model shared by both sides (joint: `src is tgt`) or one per side.

    Encoding never adds BOS/EOS: batching does that (see mtrain.data.collate).
    """

    def __init__(self, src_model: bytes, tgt_model: bytes | None = None) -> None:
        self.joint: bool = tgt_model is None
        self.src = Side(src_model)
        self.tgt = self.src if tgt_model is None else Side(tgt_model)

    # --- building -------------------------------------------------------------------------
    @classmethod
    def train(
        cls, src_lines: Iterable[str], tgt_lines: Iterable[str], cfg: TokenizerConfig, out_dir: str | Path | None = None,
        control_symbols: Sequence[str] = (),
    ) -> "Tokenizer":
        """Train on lines (the source lines, then the target lines, for a joint model); with out_dir,
        write spm.model (joint) or spm.{src,tgt}.model. control_symbols (corpus tags) are reserved
        in the source model (the joint one)."""
        if cfg.joint:
            tok = cls(_train_model(itertools.chain(src_lines, tgt_lines), cfg, "joint (source + target)", control_symbols))
        else:
            tok = cls(_train_model(src_lines, cfg, "source", control_symbols), _train_model(tgt_lines, cfg, "target"))
        if out_dir is not None:
            tok.save(out_dir)
        return tok

    def save(self, out_dir: str | Path) -> None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        if self.joint:
            (out_dir / "spm.model").write_bytes(self.src.model)
        else:
            (out_dir / "spm.src.model").write_bytes(self.src.model)
            (out_dir / "spm.tgt.model").write_bytes(self.tgt.model)

    @classmethod
    def load(cls, out_dir: str | Path, joint: bool | None = None) -> "Tokenizer":
        """Read the model file(s) from a tokenized data folder (joint: spm.model if present)."""
        out_dir = Path(out_dir)
        joint_path, src_path, tgt_path = out_dir / "spm.model", out_dir / "spm.src.model", out_dir / "spm.tgt.model"
        if joint is None:
            joint = joint_path.is_file()
        paths = [joint_path] if joint else [src_path, tgt_path]
        for path in paths:
            if not path.is_file():
                raise MtrainError(f"{path}: SentencePiece model not found; run `mtrain tokenize --out {out_dir}` first")
        return cls(*(path.read_bytes() for path in paths))

    def to_state(self) -> dict[str, Any]:
        """Plain data + bytes for a checkpoint (torch.load(weights_only=True) accepts it)."""
        return {
            "version": STATE_VERSION,
            "joint": self.joint,
            "src_model": self.src.model,
            "tgt_model": None if self.joint else self.tgt.model,
            "special_ids": dict(SPECIAL_IDS),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Tokenizer":
        if not isinstance(state, dict) or "src_model" not in state:
            raise MtrainError("checkpoint tokenizer state is missing or malformed; re-save the checkpoint with mtrain")
        return cls(state["src_model"], None if state.get("joint", True) else state["tgt_model"])


_SKIP = frozenset((PAD_ID, BOS_ID, EOS_ID))


def _check_special_ids(proc: spm.SentencePieceProcessor) -> None:
    found = (proc.pad_id(), proc.unk_id(), proc.bos_id(), proc.eos_id())
    if found != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
        raise MtrainError(
            f"SentencePiece model has special ids pad/unk/bos/eos={found}, mtrain needs (0, 1, 2, 3); "
            "retrain it with `mtrain tokenize`"
        )
