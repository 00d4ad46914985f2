"""`mtrain export`: one checkpoint as a CTranslate2 or Hugging Face (Marian) model folder that
translates like mtrain, checked by a parity report before the folder is put in place.

The folder is built under a temporary name beside DIR and renamed to DIR only once it is complete
and has passed its check: an error, a failed check or Ctrl-C leaves DIR as it was."""

from __future__ import annotations

import importlib.metadata
import json
import math
import shutil
from pathlib import Path
from typing import Any

from mtrain.atomic import make_temp_folder
from mtrain.errors import MtrainError

FORMATS = {"ctranslate2": "ctranslate2", "huggingface": "transformers"}  # format -> package it needs
QUANTIZATIONS = ("int8", "int8_float32", "int16", "float16", "bfloat16")
BUILT_IN_CHECK = "built-in sentences"


def check_request(checkpoints: list[Path], fmt: str, out: Path, quantization: str | None, force: bool) -> None:
    """Every argument problem, before any work: one line each."""
    if len(checkpoints) != 1:
        raise MtrainError(f"export takes one checkpoint, got {len(checkpoints)}; an ensemble cannot be one exported "
                          "model: average checkpoints of one run (`mtrain average`) or export each model")
    if fmt not in FORMATS:
        raise MtrainError(f"--format {fmt!r}: unknown; use ctranslate2 or huggingface")
    if quantization is not None:
        if fmt != "ctranslate2":
            raise MtrainError(f"--quantization applies to --format ctranslate2 only (a {fmt} export is float32)")
        if quantization not in QUANTIZATIONS:
            raise MtrainError(f"--quantization {quantization!r}: unknown; use one of {', '.join(QUANTIZATIONS)}")
    if out.exists() and not out.is_dir():
        raise MtrainError(f"{out}: exists and is a file; --out must be a folder (new, or empty)")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise MtrainError(f"{out}: folder exists and is not empty; choose a new --out or pass --force to replace it")
    package = FORMATS[fmt]
    try:
        importlib.import_module(package)
    except ImportError:
        raise MtrainError(f"--format {fmt} needs the {package} package; pip install 'mtrain[export]'") from None


# The model.* settings the exporters translate into the target formats. A setting outside this
# list (an architecture option added to mtrain later) changes the function the model computes in
# a way no exporter here knows how to write, so such a model is refused rather than exported wrong.
EXPRESSIBLE = frozenset({"d_model", "d_ff", "n_heads", "n_encoder_layers", "n_decoder_layers", "dropout",
                         "attention_dropout", "activation_dropout", "vocab_size", "src_vocab_size", "pad_id",
                         "max_len", "share_embeddings", "activation", "output_bias"})


def check_expressible(model, fmt: str) -> None:
    """A model the target format cannot express is refused before anything is written."""
    import dataclasses

    for field in dataclasses.fields(model.cfg):
        value = getattr(model.cfg, field.name)
        if field.name not in EXPRESSIBLE and value != field.default:
            raise MtrainError(f"model.{field.name}={value!r}: a {fmt} model cannot express this setting; "
                              "export a model trained without it")
    if model.cfg.pad_id != 0:
        raise MtrainError(f"model.pad_id={model.cfg.pad_id}: exports expect mtrain's fixed special ids (pad 0)")


def max_positions(model, stats: dict | None) -> int:
    """Rows of the position table to write: the longest input (max_len, with `</s>`), the longest
    output mtrain's default length rule allows for it (a * (max_len - 1) + b, plus `</s>`), and at
    least 1024 so that a caller using CTranslate2's own defaults (256 output tokens) stays inside."""
    from mtrain.config import DecodeConfig
    from mtrain.translate import length_slope

    decode = DecodeConfig()
    longest_output = math.floor(length_slope(decode, stats) * (model.cfg.max_len - 1) + decode.max_len_b) + 2
    return max(1024, model.cfg.max_len, longest_output)


def metadata(fmt: str, quantization: str | None, ckpt: dict, checkpoint: Path, model, positions: int,
             extra: dict[str, Any]) -> dict[str, Any]:
    data = ckpt["config"].get("data", {})
    return {
        "format": fmt,
        "mtrain_version": importlib.metadata.version("mtrain"),
        f"{FORMATS[fmt]}_version": importlib.metadata.version(FORMATS[fmt]),
        "quantization": quantization or "float32",
        "source_language": data.get("src"), "target_language": data.get("tgt"),
        "special_tokens": {"pad": "<pad>", "unk": "<unk>", "bos": "<s>", "eos": "</s>"},
        "source_eos": True, "decoder_start_token": "<s>",
        "max_len": model.cfg.max_len, "max_positions": positions,
        "joint_vocabulary": bool(ckpt["tokenizer"].get("joint", True)),
        "decode": ckpt["config"].get("decode", {}),
        "stats": {k: v for k, v in (ckpt.get("stats") or {}).items() if k == "tgt_src_ratio"},
        "checkpoint": {"path": str(checkpoint), "step": ckpt.get("step"), "averaged_from": ckpt.get("averaged_from")},
        "valid_bleu": valid_bleu(ckpt),
        **extra,
    }


def valid_bleu(ckpt: dict) -> float | None:
    """The best validation BLEU the run recorded, when the checkpoint carries its training state."""
    value = (ckpt.get("train_state") or {}).get("state", {}).get("best_bleu")
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def write_folder(fmt: str, folder: Path, model, tokenizer, ckpt: dict, checkpoint: Path,
                 quantization: str | None) -> dict[str, Any]:
    positions = max_positions(model, ckpt.get("stats"))
    if fmt == "ctranslate2":
        from mtrain.export import ctranslate2 as target

        extra = target.write(model, tokenizer, folder, quantization, positions)
    else:
        from mtrain.export import huggingface as target

        beam = int(ckpt["config"].get("decode", {}).get("beam", 5))
        extra = target.write(model, tokenizer, folder, ckpt, positions, beam)
    tokenizer.save(folder)  # spm.model, or spm.src.model + spm.tgt.model
    return metadata(fmt, quantization, ckpt, checkpoint, model, positions, extra)


def load_exported(fmt: str, folder: Path, max_len: int):
    import torch

    if fmt == "ctranslate2":
        from mtrain.export.runtime import CTranslate2Model

        return CTranslate2Model(folder, torch.device("cpu"))
    from mtrain.export.huggingface import MarianModel

    return MarianModel(folder, max_len)


def export_checkpoint(checkpoint: Path, fmt: str, out: Path, quantization: str | None = None, force: bool = False,
                      check=None) -> dict[str, Any]:
    """Write the export to a temporary folder beside `out`, check parity there, then rename it to
    `out`. Returns the parity report; raises ParityError (carrying it) when the check fails."""
    from mtrain.checkpoint import load_model
    from mtrain.export import parity

    check_request([checkpoint], fmt, out, quantization, force)
    model, tokenizer, ckpt = load_model(checkpoint)
    check_expressible(model, fmt)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = make_temp_folder(out)
    try:
        meta = write_folder(fmt, staging, model, tokenizer, ckpt, checkpoint, quantization)
        (staging / "export.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        if check is None:
            check = default_check(ckpt)
        exported = load_exported(fmt, staging, model.cfg.max_len)
        result = parity.report(model, tokenizer, exported, check, ckpt.get("stats") or None, quantization)
        del exported  # release the folder's files before it moves
        meta["parity"] = result
        (staging / "export.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        if fmt == "huggingface":
            from mtrain.export.card import write_card

            write_card(staging, meta, model, ckpt.get("stats"), valid_bleu(ckpt))
        if not result["passed"]:
            raise ParityError(result)
        replace_folder(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return result


def replace_folder(staging: Path, out: Path) -> None:
    """Put the finished folder at `out`; an existing one (allowed by --force) is moved aside first
    and deleted only after the new one is in place."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    staging.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def default_check(ckpt: dict):
    from mtrain.export.checkset import built_in
    from mtrain.export.parity import CheckSet

    language = ckpt["config"].get("data", {}).get("src")
    return CheckSet(built_in(language), None, BUILT_IN_CHECK)


class ParityError(MtrainError):
    def __init__(self, result: dict[str, Any]) -> None:
        super().__init__(f"parity check failed: {result['failure']}; the export was not written")
        self.result = result
