"""The SentencePiece wrapper: trains one joint model (or one per side) with fixed special ids,
encodes and decodes batches of lines, and round-trips through plain bytes so checkpoints carry it."""

from __future__ import annotations

import io
import itertools
import json
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

    def id_pieces(self) -> list[str]:
        """The piece of each id, in id order (what an exported vocabulary lists)."""
        return [self._proc.id_to_piece(i) for i in range(self.vocab_size)]

    def control_id(self, symbol: str) -> int:
        """The id of a reserved (control) piece such as a corpus tag."""
        piece = self._proc.piece_to_id(symbol)
        if piece == UNK_ID or not self._proc.is_control(piece):
            raise MtrainError(f"SentencePiece model has no reserved piece {symbol!r}; re-run `mtrain tokenize`")
        return piece


SPECIAL_PIECES = ("<pad>", "<unk>", "<s>", "</s>")  # ids 0-3 of a vocabulary list (MappedSide)
VOCABULARY_FILES = ("spm.vocab.json", "spm.tgt.vocab.json")  # MappedSide's lists, in a folder


class MappedSide(Side):
    """A SentencePiece model that cuts text into pieces, with ids from a vocabulary list of its own,
    as Marian models have them (mtrain.hub imports them): the list holds both sides' pieces, so
    the two sides' SentencePiece models share one id space. Ids 0-3 are <pad>, <unk>, <s>, </s>; a
    piece outside the list is <unk>. A leading language code such as >>fra<< (multilingual models)
    is one piece of its own, as MarianTokenizer reads it."""

    def __init__(self, model: bytes, vocabulary: Sequence[str]) -> None:
        self.model = model
        self._proc = spm.SentencePieceProcessor(model_proto=model)
        self.vocabulary = list(vocabulary)
        if tuple(self.vocabulary[:4]) != SPECIAL_PIECES:
            raise MtrainError(f"a vocabulary list must start with {', '.join(SPECIAL_PIECES)}; "
                              f"it starts with {', '.join(self.vocabulary[:4])}")
        self.ids = {piece: i for i, piece in enumerate(self.vocabulary)}
        self.vocab_size = len(self.vocabulary)

    def _ids(self, lines: list[str], **options: Any) -> list[list[int]]:
        out = []
        for line in lines:
            code = []
            if line.startswith(">>") and (end := line.find("<<")) != -1:
                code, line = [line[: end + 2]], line[end + 2 :]
            pieces = code + self._proc.encode(line, out_type=str, **options)
            out.append([self.ids.get(piece, UNK_ID) for piece in pieces])
        return out

    def encode(self, lines: list[str]) -> list[list[int]]:
        return self._ids(list(lines))

    def sample(self, lines: list[str], alpha: float, seed: int) -> list[list[int]]:
        spm.set_random_generator_seed(seed)
        return self._ids(list(lines), enable_sampling=True, alpha=alpha, nbest_size=-1)

    def decode(self, ids: list[list[int]]) -> list[str]:
        size = self.vocab_size
        texts = [self._proc.decode_pieces([self.vocabulary[int(i)] for i in seq
                                           if int(i) not in _SKIP and 0 <= int(i) < size]) for seq in ids]
        return [text.replace("\u2581", " ").strip() for text in texts]  # as MarianTokenizer decodes

    def id_pieces(self) -> list[str]:
        return list(self.vocabulary)

    def control_id(self, symbol: str) -> int:
        raise MtrainError(f"corpus tag {symbol!r}: an imported vocabulary has no reserved pieces for tags; drop --tag")


class Tokenizer:
    """One SentencePiece model shared by both sides (joint: `src is tgt`) or one per side; or, for
    imported Marian models, one per side with one vocabulary list of ids (MappedSide; joint: the
    sides share that list).

    Encoding never adds BOS/EOS: batching does that (see mtrain.data.collate).
    """

    def __init__(self, src_model: bytes, tgt_model: bytes | None = None,
                 vocabulary: Sequence[str] | None = None, tgt_vocabulary: Sequence[str] | None = None) -> None:
        self.joint: bool = tgt_model is None if vocabulary is None else tgt_vocabulary is None
        self.mapped = vocabulary is not None
        if self.mapped:
            self.src = MappedSide(src_model, vocabulary)
            self.tgt = MappedSide(tgt_model if tgt_model is not None else src_model, tgt_vocabulary or vocabulary)
        else:
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

    def files(self) -> list[str]:
        """The names save() writes."""
        if self.mapped:
            return ["spm.src.model", "spm.tgt.model", *VOCABULARY_FILES[: 1 if self.joint else 2]]
        return ["spm.model"] if self.joint else ["spm.src.model", "spm.tgt.model"]

    def save(self, out_dir: str | Path) -> None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        if self.mapped:
            (out_dir / "spm.src.model").write_bytes(self.src.model)
            (out_dir / "spm.tgt.model").write_bytes(self.tgt.model)
            lists = [self.src.vocabulary] + ([] if self.joint else [self.tgt.vocabulary])
            for name, vocabulary in zip(VOCABULARY_FILES, lists):
                (out_dir / name).write_text(json.dumps(vocabulary, ensure_ascii=False), encoding="utf-8")
        elif self.joint:
            (out_dir / "spm.model").write_bytes(self.src.model)
        else:
            (out_dir / "spm.src.model").write_bytes(self.src.model)
            (out_dir / "spm.tgt.model").write_bytes(self.tgt.model)

    @classmethod
    def load(cls, out_dir: str | Path, joint: bool | None = None) -> "Tokenizer":
        """Read the model file(s) from a tokenized data folder (joint: spm.model if present)."""
        out_dir = Path(out_dir)
        if (out_dir / VOCABULARY_FILES[0]).is_file():
            return cls._load_mapped(out_dir)
        joint_path, src_path, tgt_path = out_dir / "spm.model", out_dir / "spm.src.model", out_dir / "spm.tgt.model"
        if joint is None:
            joint = joint_path.is_file()
        paths = [joint_path] if joint else [src_path, tgt_path]
        for path in paths:
            if not path.is_file():
                raise MtrainError(f"{path}: SentencePiece model not found; run `mtrain tokenize --out {out_dir}` first")
        return cls(*(path.read_bytes() for path in paths))

    @classmethod
    def _load_mapped(cls, out_dir: Path) -> "Tokenizer":
        paths = [out_dir / "spm.src.model", out_dir / "spm.tgt.model"]
        for path in paths:
            if not path.is_file():
                raise MtrainError(f"{path}: SentencePiece model not found beside {VOCABULARY_FILES[0]}; "
                                  "re-run `mtrain tokenize --spm-from CKPT`")
        lists = []
        for name in VOCABULARY_FILES:
            if (out_dir / name).is_file():
                try:
                    lists.append(json.loads((out_dir / name).read_text(encoding="utf-8")))
                except (UnicodeDecodeError, json.JSONDecodeError) as err:
                    raise MtrainError(f"{out_dir / name}: damaged ({err}); re-run `mtrain tokenize`") from None
        return cls(paths[0].read_bytes(), paths[1].read_bytes(), lists[0], lists[1] if len(lists) > 1 else None)

    def to_state(self) -> dict[str, Any]:
        """Plain data + bytes for a checkpoint (torch.load(weights_only=True) accepts it)."""
        state = {
            "version": STATE_VERSION,
            "joint": self.joint,
            "src_model": self.src.model,
            "tgt_model": None if self.joint and not self.mapped else self.tgt.model,
            "special_ids": dict(SPECIAL_IDS),
        }
        if self.mapped:
            state["vocabulary"] = list(self.src.vocabulary)
            state["tgt_vocabulary"] = None if self.joint else list(self.tgt.vocabulary)
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Tokenizer":
        if not isinstance(state, dict) or "src_model" not in state:
            raise MtrainError("checkpoint tokenizer state is missing or malformed; re-save the checkpoint with mtrain")
        if state.get("vocabulary") is not None:
            return cls(state["src_model"], state["tgt_model"], state["vocabulary"], state.get("tgt_vocabulary"))
        return cls(state["src_model"], None if state.get("joint", True) else state["tgt_model"])


_SKIP = frozenset((PAD_ID, BOS_ID, EOS_ID))


def _check_special_ids(proc: spm.SentencePieceProcessor) -> None:
    found = (proc.pad_id(), proc.unk_id(), proc.bos_id(), proc.eos_id())
    if found != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
        raise MtrainError(
            f"SentencePiece model has special ids pad/unk/bos/eos={found}, mtrain needs (0, 1, 2, 3); "
            "retrain it with `mtrain tokenize`"
        )
