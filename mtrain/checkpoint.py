"""The only code that knows the checkpoint format: atomic writes, safe loads, averaging, and
rebuilding models (one, or an ensemble of several) from checkpoints for decoding.

A checkpoint is a plain dict that `torch.load(..., weights_only=True)` can read, so loading a
file never runs code:

    {"format": "mtrain", "version": 1,
     "config":    resolved Config as nested dicts (model section holds the vocabulary sizes),
     "model":     state_dict of the un-compiled model,
     "tokenizer": Tokenizer.to_state() (SentencePiece model bytes and the special ids),
     "stats":     stats.json of the tokenized data (length ratios for decoding), may be {},
     "step":      optimizer updates done,
     "train_state": optimizer, RNG states, data position, early-stopping state (last.pt only)}
"""

from __future__ import annotations

import re
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any, Iterable

import torch

from mtrain.atomic import atomic_write, os_error_in
from mtrain.config import config_from_dict
from mtrain.ensemble import Ensemble
from mtrain.errors import MtrainError
from mtrain.model import Transformer
from mtrain.tokenizer import Tokenizer

FORMAT = "mtrain"
VERSION = 1


def save_atomic(obj: dict[str, Any], path: str | Path) -> None:
    """torch.save through the atomic writer, fsynced: a reader (or a crash) never sees a
    half-written checkpoint, and the previous file stays intact if the write fails. A failed
    write raises the OSError (naming the file), not the RuntimeError torch wraps it in."""
    try:
        with atomic_write(path, binary=True, durable=True) as handle:
            torch.save(obj, handle)
    except RuntimeError as err:
        cause = os_error_in(err)
        if cause is None:
            raise
        raise OSError(cause.errno, cause.strerror or str(cause), cause.filename or str(path)) from err


def load(path: str | Path, map_location: str | torch.device = "cpu", mmap: bool = False) -> dict[str, Any]:
    """Read a checkpoint with weights_only=True; any problem becomes a one-line MtrainError. mmap:
    the tensors are mapped from the file, read only when used (a caller that needs the config and
    tokenizer alone reads no weights)."""
    path = Path(path)
    if path.is_dir():
        raise MtrainError(f"{path}: a folder, not a checkpoint file; pass a file written by `mtrain train` (e.g. RUN/best.pt) "
                          "(translate and eval also take a folder written by `mtrain export --format ctranslate2`)")
    if not path.is_file():
        raise MtrainError(f"{path}: checkpoint not found; pass a file written by `mtrain train` (e.g. RUN/best.pt)")
    _check_crc(path)
    try:
        with warnings.catch_warnings():  # a hostile file's pickle-protocol warning is not the user's business
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as err:  # truncated zip, garbage bytes, or a pickle that asks for code
        # The first sentence only: torch's zip errors go on for lines.
        reason = str(err).strip().splitlines()[0].split(". ")[0] if str(err).strip() else ""
        if not any(c.isalpha() for c in reason):
            reason = f"{type(err).__name__}: {reason or 'no details'}"
        code = re.search(r"\bGLOBAL ([\w.]+)", str(err))
        if code:
            reason = f"it pickles a reference to code ({code.group(1)}), refused for safety"
        elif "Weights only load failed" in str(err):
            reason = "not a torch file of tensors and plain data; damaged, or not a checkpoint"
        raise MtrainError(
            f"{path}: not a readable mtrain checkpoint ({reason[:200]}); use a complete file written by `mtrain train`"
        ) from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise MtrainError(f"{path}: not an mtrain checkpoint (no 'format: mtrain' entry); use a file written by `mtrain train`")
    if obj.get("version", 0) > VERSION:
        raise MtrainError(f"{path}: checkpoint format v{obj['version']} is newer than this mtrain reads (v{VERSION}); upgrade mtrain")
    missing = [key for key, kind in REQUIRED.items() if not isinstance(obj.get(key), kind)]
    if missing:
        raise MtrainError(f"{path}: incomplete mtrain checkpoint (missing or malformed: {', '.join(missing)}); "
                          "use a complete file written by `mtrain train`")
    return obj


# Entries every checkpoint has, and their types (a crafted or damaged file may lack them).
REQUIRED = {"config": dict, "model": dict, "tokenizer": dict, "step": int}


def _check_crc(path: Path) -> None:
    """torch.load does not verify the zip's CRC-32s: a flipped bit in the weights would load
    silently. Check them first (no unpickling happens here). A file that is not a zip at all is
    left to torch.load, which names the problem."""
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError):
        return
    try:
        with archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, zlib.error, ValueError) as err:
        bad = f"? ({type(err).__name__})"
    if bad is not None:
        raise MtrainError(f"{path}: corrupted checkpoint (checksum mismatch in record {bad}); "
                          "use an intact copy, or another checkpoint of the run (last.pt, step-N.pt)")


def make(config: dict[str, Any], model_state: dict[str, torch.Tensor], tokenizer: dict[str, Any],
         stats: dict[str, Any], step: int, train_state: dict[str, Any] | None = None) -> dict[str, Any]:
    """Assemble a checkpoint dict (see the module docstring for the layout)."""
    ckpt = {
        "format": FORMAT,
        "version": VERSION,
        "config": config,
        "model": model_state,
        "tokenizer": tokenizer,
        "stats": stats,
        "step": int(step),
    }
    if train_state is not None:
        ckpt["train_state"] = train_state
    return ckpt


def step_checkpoints(folder: str | Path) -> list[tuple[int, Path]]:
    """(N, path) of every folder/step-N.pt, in step order (numeric: step-250 before step-1000)."""
    found = [(int(m.group(1)), p) for p in Path(folder).glob("step-*.pt") if (m := re.fullmatch(r"step-(\d+)\.pt", p.name))]
    return sorted(found)


def average_checkpoints(paths: Iterable[str | Path], out: str | Path) -> dict[str, Any]:
    """Average the model weights of checkpoints of one model (the paper averaged the last 5 or 20).

    The result keeps the config and tokenizer of the last input and drops training state."""
    paths = [Path(p) for p in paths]
    if not paths:
        raise MtrainError("average: no checkpoints given; pass e.g. RUN/step-*.pt")
    total: dict[str, torch.Tensor] | None = None
    last: dict[str, Any] = {}
    for path in paths:
        ckpt = load(path)
        state = ckpt["model"]
        if total is None:
            total = {k: v.detach().to(torch.float64).clone() if v.is_floating_point() else v.clone() for k, v in state.items()}
        else:
            if state.keys() != total.keys() or any(state[k].shape != total[k].shape for k in state):
                raise MtrainError(f"{path}: its model differs from {paths[0]}; average checkpoints of one run only")
            for k, v in state.items():
                if v.is_floating_point():
                    total[k] += v.to(torch.float64)
        last = ckpt
    assert total is not None
    reference = last["model"]
    averaged = {k: (v / len(paths)).to(reference[k].dtype) if v.is_floating_point() else v for k, v in total.items()}
    result = make(last["config"], averaged, last["tokenizer"], last.get("stats", {}), last["step"])
    result["averaged_from"] = [str(p) for p in paths]
    save_atomic(result, out)
    return result


def load_model(path: str | Path, device: str | torch.device = "cpu",
               ckpt: dict[str, Any] | None = None) -> tuple[Transformer, Tokenizer, dict[str, Any]]:
    """Rebuild the model and tokenizer from a checkpoint alone: (model in eval mode, tokenizer, ckpt).
    ckpt: the file's contents, when the caller has read them already."""
    ckpt = load(path) if ckpt is None else ckpt
    config = config_from_dict(ckpt["config"], where=str(path))
    model = Transformer(config.model)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as err:
        first = str(err).strip().splitlines()
        raise MtrainError(f"{path}: weights do not fit its model config ({first[1].strip() if len(first) > 1 else first[0]}); the file is inconsistent") from None
    model.to(device).eval()
    return model, checkpoint_tokenizer(path, ckpt), ckpt


def checkpoint_tokenizer(path: str | Path, ckpt: dict[str, Any]) -> Tokenizer:
    """The SentencePiece models a checkpoint carries, loaded."""
    try:
        return Tokenizer.from_state(ckpt["tokenizer"])
    except (MtrainError, RuntimeError, TypeError, KeyError) as err:  # damaged SentencePiece bytes
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise MtrainError(f"{path}: its tokenizer cannot be loaded ({first[:200]}); the file is damaged, "
                          "use another checkpoint of the run") from None


def checkpoint_paths(paths: str | Path | list[str | Path]) -> list[str | Path]:
    """One checkpoint path or several, as a list."""
    return [paths] if isinstance(paths, (str, Path)) else list(paths)


def read_ensemble(paths: list[str | Path], mmap: bool = False) -> list[dict[str, Any]]:
    """The contents of one checkpoint, or of several that can decode as one ensemble: trained on
    the same tokenized data (same SentencePiece model, same languages). mmap: as load's."""
    if not paths:
        raise MtrainError("no checkpoint given; pass --checkpoint FILE (repeat it for an ensemble)")
    ckpts = [load(path, mmap=mmap) for path in paths]
    first_path, first = paths[0], ckpts[0]
    for path, ckpt in zip(paths[1:], ckpts[1:]):
        if ckpt["tokenizer"] != first["tokenizer"]:
            raise MtrainError(f"{path}: its vocabulary differs from {first_path}'s; an ensemble needs checkpoints "
                              "trained on the same `mtrain tokenize` output")
        pair, first_pair = _languages(ckpt), _languages(first)
        if pair != first_pair:
            raise MtrainError(f"{path}: translates {pair[0]}->{pair[1]}, but {first_path} translates "
                              f"{first_pair[0]}->{first_pair[1]}; ensemble checkpoints of one direction")
    return ckpts


def load_models(paths: str | Path | list[str | Path], device: str | torch.device = "cpu"):
    """(model, tokenizer, first checkpoint) for one checkpoint, or an Ensemble of several
    (read_ensemble)."""
    paths = checkpoint_paths(paths)
    loaded = [load_model(path, device, ckpt) for path, ckpt in zip(paths, read_ensemble(paths))]
    if len(loaded) == 1:
        return loaded[0]
    _, tokenizer, first = loaded[0]
    return Ensemble([model for model, _, _ in loaded]), tokenizer, first


def _languages(ckpt: dict) -> tuple[str, str]:
    data = ckpt["config"].get("data", {})
    return data.get("src", "?"), data.get("tgt", "?")
