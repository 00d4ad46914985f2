"""Translating with an exported CTranslate2 folder through mtrain's own text handling: the same
line-aligned raw-text input and output, the same input cut (max_len - 1 tokens + `</s>`), the same
per-sentence length limit (a * src_len + b), the same banned tokens. CTranslate2 runs the search."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mtrain.config import DecodeConfig
from mtrain.errors import MtrainError
from mtrain.hardware import X86, cpu_has_vnni, cpuinfo_fields
from mtrain.tokenizer import PAD_ID, VOCABULARY_FILES, Tokenizer

META = "export.json"
# What int8 costs where its products saturate, measured on an AVX2-only AMD EPYC (Zen 3) with the
# quickstart model (docs/export.md).
SATURATION_NOTE = (
    "CTranslate2 runs int8 on this CPU through oneDNN without VNNI, whose 16-bit sums of 8-bit products "
    "saturate: on an AVX2-only AMD EPYC it changed 40% of greedy test lines where CT2_USE_MKL=1 changed 8% "
    "(BLEU -0.07 against -0.01), but ran int8 3x slower there (docs/export.md)")


def int8_saturates(env: Mapping[str, str] | None = None, fields: Mapping[str, str] | None = None,
                   vnni: bool | None = None, machine: str | None = None) -> bool:
    """Whether CTranslate2's int8 matmuls on this CPU add pairs of u8 x s8 products in 16 bits, which
    saturate: an x86 CPU without VNNI (VNNI adds them into 32 bits) with CTranslate2 on oneDNN, its
    int8 backend on every CPU not made by Intel unless CT2_USE_MKL=1 (or true) picks Intel MKL.
    MKL's kernels showed no such loss (docs/export.md). The arguments stand in for os.environ, /proc/cpuinfo,
    torch's VNNI check and platform.machine() (tests)."""
    machine = platform.machine() if machine is None else machine
    if machine.lower() not in X86:
        return False
    if cpu_has_vnni() if vnni is None else vnni:
        return False
    env = os.environ if env is None else env
    choice = env.get("CT2_USE_MKL", "")
    if choice:  # CTranslate2 reads "1", "true" and "TRUE" as yes, anything else as no
        return choice not in ("1", "true", "TRUE")
    fields = cpuinfo_fields() if fields is None else fields
    return fields.get("vendor_id") != "GenuineIntel"


def is_int8(quantization: str | None) -> bool:
    """Whether a CTranslate2 quantization multiplies in int8 (int8, int8_float32, int8_float16, ...)."""
    return bool(quantization) and quantization.startswith("int8")


def read_meta(folder: Path) -> dict[str, Any]:
    path = folder / META
    if not path.is_file():
        raise MtrainError(f"{folder}: a folder, but not one written by `mtrain export` (no {META}); "
                          "pass a checkpoint file (RUN/best.pt) or an exported CTranslate2 folder")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise MtrainError(f"{path}: not valid JSON ({err}); re-run `mtrain export`") from None
    if not isinstance(meta, dict) or "format" not in meta:
        raise MtrainError(f"{path}: no 'format' entry; re-run `mtrain export`")
    return meta


def read_tokenizer(folder: Path, meta: dict[str, Any]) -> Tokenizer:
    if (folder / VOCABULARY_FILES[0]).is_file():  # an imported model's SentencePiece models and id list
        return Tokenizer.load(folder)
    names = ["spm.model"] if meta.get("joint_vocabulary", True) else ["spm.src.model", "spm.tgt.model"]
    paths = [folder / name for name in names]
    for path in paths:
        if not path.is_file():
            raise MtrainError(f"{path}: missing from the exported folder; re-run `mtrain export`")
    return Tokenizer(*(path.read_bytes() for path in paths))


def ctranslate2_meta(folder: Path) -> dict[str, Any]:
    """export.json of a folder `mtrain translate` can run: a CTranslate2 export with its lengths."""
    meta = read_meta(folder)
    if meta["format"] != "ctranslate2":
        raise MtrainError(f"{folder}: a {meta['format']} export; `mtrain translate` runs CTranslate2 "
                          "exports (load a huggingface export with transformers)")
    for key in ("max_len", "max_positions"):
        if not isinstance(meta.get(key), int):
            raise MtrainError(f"{folder / META}: no integer '{key}' entry; re-run `mtrain export`")
    return meta


@dataclass(frozen=True)
class Shape:
    """What translate reads of a model's config: its max_len (the input cut rule)."""

    max_len: int


class CTranslate2Model:
    """An exported folder loaded in ctranslate2.Translator, searched by CTranslate2."""

    def __init__(self, folder: str | Path, device: torch.device) -> None:
        folder = Path(folder)
        self.meta = ctranslate2_meta(folder)
        try:
            import ctranslate2
        except ImportError:
            raise MtrainError(f"{folder}: translating a CTranslate2 export needs ctranslate2; "
                              "pip install 'mtrain[export]'") from None
        self.tokenizer = read_tokenizer(folder, self.meta)
        self.cfg = Shape(max_len=self.meta["max_len"])  # both integers (ctranslate2_meta)
        self.max_positions = self.meta["max_positions"]
        device_index = device.index or 0
        self.translator = ctranslate2.Translator(str(folder), device=device.type, device_index=device_index,
                                                 intra_threads=torch.get_num_threads() if device.type == "cpu" else 0)
        self.src_pieces = self.tokenizer.src.id_pieces()
        self.tgt_pieces = self.tokenizer.tgt.id_pieces()
        self.tgt_ids = {piece: i for i, piece in enumerate(self.tgt_pieces)}
        self.suppress = [[token] for token in self.meta.get("suppress_tokens", [])]

    def tokens(self, src: Tensor) -> list[list[str]]:
        """Padded (B, S) source ids ending in EOS -> CTranslate2's token strings (it adds `</s>`)."""
        rows = []
        for row in src.tolist():
            ids = [i for i in row if i != PAD_ID]
            rows.append([self.src_pieces[i] for i in ids[:-1]])  # ids[-1] is EOS
        return rows

    def search(self, src: Tensor, max_len: Tensor, decode: DecodeConfig,
               prefixes: list[list[int]] | None) -> list[list[tuple[list[int], float]]]:
        """decode.nbest (ids, score) per row, each cut to its own length limit."""
        limits = [min(int(n), self.max_positions - 2) for n in max_len.tolist()]
        options = dict(
            beam_size=1 if decode.sample else decode.beam, num_hypotheses=decode.nbest,
            length_penalty=decode.lenpen, max_decoding_length=max(limits) + 1, max_input_length=0,
            min_decoding_length=0,  # mtrain lets `</s>` come first (an empty translation)
            return_scores=True, suppress_sequences=self.suppress or None,
            no_repeat_ngram_size=decode.no_repeat_ngram,
        )
        if decode.sample:  # CTranslate2's own random stream: seeded, but not mtrain's samples
            import ctranslate2

            ctranslate2.set_random_seed(decode.seed)
            options.update(sampling_topk=decode.topk, sampling_topp=decode.topp,
                           sampling_temperature=decode.temperature)
        if prefixes is not None:
            options["target_prefix"] = [[self.tgt_pieces[i] for i in prefix] or None for prefix in prefixes]
        results = self.translator.translate_batch(self.tokens(src), **options)
        unk = self.tgt_ids.get("<unk>", 1)
        return [[([self.tgt_ids.get(piece, unk) for piece in hypothesis][:limit], float(score))
                 for hypothesis, score in zip(result.hypotheses, result.scores)]
                for result, limit in zip(results, limits)]

    def score_ids(self, src_ids: list[list[int]], tgt_ids: list[list[int]], *_tensors) -> list[list[float]]:
        """Per-token log-probabilities of each target (its tokens and `</s>`) by teacher forcing."""
        src = [[self.src_pieces[i] for i in ids] for ids in src_ids]
        tgt = [[self.tgt_pieces[i] for i in ids] for ids in tgt_ids]
        return [list(r.log_probs) for r in self.translator.score_batch(src, tgt, max_input_length=0)]


def pieces(model: bytes) -> list[str]:
    """A SentencePiece model's pieces in id order: how exported vocabularies map strings to ids."""
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_proto=model)
    return [processor.id_to_piece(i) for i in range(processor.get_piece_size())]

