"""`mtrain tokenize`: check and clean the corpus, train SentencePiece on the training split,
encode every split and write the token-id cache that mtrain.data reads back.

The folder holds, per split and side, `{split}.{side}.ids.npy` (int32 ids, concatenated),
`{split}.{side}.offsets.npy` (int64, n + 1) and `{split}.{side}.txt` (the raw lines), plus
spm.model (or spm.src.model and spm.tgt.model), stats.json and meta.json, written last: a folder
without meta.json is an interrupted run. An earlier run's meta.json is deleted before the first
write, and a failed write (a full disk, a file size limit) stops with one line naming the file, so
a failure never leaves a folder that looks complete."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np
from tqdm import tqdm

from mtrain.atomic import atomic_write, describe_write_error
from mtrain.config import Config
from mtrain.corpus import Pairs, clean_pairs, cleaning_report, read_corpus
from mtrain.data import FORMAT_VERSION, SIDES, model_digest, to_ragged_arrays
from mtrain.errors import MtrainError
from mtrain.tokenizer import MODEL_TYPES, SPECIAL_IDS, Tokenizer


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """A failed write of `path` becomes one line: the file, the cause, and that the folder is incomplete."""
    try:
        yield
    except OSError as err:
        cause, remedy = describe_write_error(err)
        raise MtrainError(f"{path}: write failed ({cause}); {path.parent} is incomplete (it has no meta.json); "
                          f"{remedy or 'fix the cause'} and re-run `mtrain tokenize`") from None


class _Writes:
    """A file seen by numpy as a stream (write() only): np.save then writes through Python's file
    object, whose failed write keeps its errno (ENOSPC, EFBIG), instead of through fwrite, whose
    short write numpy reports without one."""

    def __init__(self, handle: Any) -> None:
        self.write = handle.write


def _encode_chunked(encode, lines: list[str], bar, chunk: int = 20_000) -> list[list[int]]:
    ids: list[list[int]] = []
    for start in range(0, len(lines), chunk):
        ids.extend(encode(lines[start : start + chunk]))
        bar.update(min(chunk, len(lines) - start))
    return ids


def _mean_std(values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {"mean": 0.0, "std": 0.0}
    return {"mean": round(float(values.mean()), 4), "std": round(float(values.std()), 4)}


def length_stats(src_lengths: np.ndarray, tgt_lengths: np.ndarray) -> dict[str, Any]:
    """Token-length statistics of one split; the tgt/src ratio skips pairs with an empty source."""
    has_src = src_lengths > 0
    ratio = tgt_lengths[has_src] / src_lengths[has_src]
    return {
        "lines": int(src_lengths.size),
        "src_tokens": {**_mean_std(src_lengths), "max": int(src_lengths.max(initial=0)), "total": int(src_lengths.sum())},
        "tgt_tokens": {**_mean_std(tgt_lengths), "max": int(tgt_lengths.max(initial=0)), "total": int(tgt_lengths.sum())},
        "tgt_src_ratio": _mean_std(ratio),
    }


def write_split(out_dir: Path, split: str, tok: Tokenizer, pairs: Pairs, bar) -> dict[str, Any]:
    """Encode one split and write its ids, offsets and raw text; return its length statistics."""
    lengths = {}
    for side, lines, encode in zip(SIDES, pairs, (tok.src.encode, tok.tgt.encode)):
        ids, offsets = to_ragged_arrays(_encode_chunked(encode, lines, bar))
        for name, array in ((f"{split}.{side}.ids.npy", ids), (f"{split}.{side}.offsets.npy", offsets)):
            with _writing(out_dir / name), open(out_dir / name, "wb") as handle:
                np.save(_Writes(handle), array)
        # Joined with "\n" only, so that a reader splitting on "\n" gets exactly these lines back.
        with _writing(out_dir / f"{split}.{side}.txt"):
            (out_dir / f"{split}.{side}.txt").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        lengths[side] = np.diff(offsets)
    return length_stats(lengths["src"], lengths["tgt"])


def _check_arguments(cfg: Config, splits: Sequence[str]) -> None:
    if not splits or len(set(splits)) != len(splits):
        raise MtrainError(f"--splits {','.join(splits)}: give distinct split names, e.g. train,valid,test2016")
    if cfg.data.src == cfg.data.tgt:
        raise MtrainError(f"--src and --tgt are both {cfg.data.src!r}; give two different language suffixes")
    if cfg.tokenizer.model_type not in MODEL_TYPES:
        raise MtrainError(f"--model-type {cfg.tokenizer.model_type!r}: unknown; use one of {', '.join(MODEL_TYPES)}")


def tokenize_corpus(
    cfg: Config,
    data_dir: Optional[Path],
    out_dir: Path,
    splits: Sequence[str] = ("train", "valid", "test2016"),
    hf_dataset: Optional[str] = None,
) -> dict[str, Any]:
    """`mtrain tokenize`: check, clean the first split, train SentencePiece on it, encode and cache every split.

    meta.json is written last, so a folder without it is an interrupted run. Returns the stats dict.
    """
    started = time.perf_counter()
    splits = [s.strip() for s in splits if s.strip()]
    _check_arguments(cfg, splits)
    corpus, source = read_corpus(data_dir, splits, cfg.data.src, cfg.data.tgt, hf_dataset)

    train_split = splits[0]
    n_in = len(corpus[train_split][0])
    kept_src, kept_tgt, dropped = clean_pairs(*corpus[train_split], cfg.data.max_len, cfg.data.max_ratio, cfg.data.dedup)
    corpus[train_split] = (kept_src, kept_tgt)
    print(cleaning_report(train_split, n_in, len(kept_src), dropped, cfg), file=sys.stderr)

    kind = "joint" if cfg.tokenizer.joint else "separate"
    print(
        f"training SentencePiece ({cfg.tokenizer.model_type}, {kind}, vocab {cfg.tokenizer.vocab_size}) "
        f"on {len(kept_src)} {train_split} pairs",
        file=sys.stderr,
    )
    tok = Tokenizer.train(kept_src, kept_tgt, cfg.tokenizer)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # The folder is incomplete until meta.json is back; stale models of an earlier joint/separate run must go.
    for name in ("meta.json", "spm.model", "spm.src.model", "spm.tgt.model"):
        (out_dir / name).unlink(missing_ok=True)
    with _writing(out_dir / ("spm.model" if tok.joint else "spm.src.model + spm.tgt.model")):
        tok.save(out_dir)
    split_stats = {}
    total = sum(len(pairs[0]) + len(pairs[1]) for pairs in corpus.values())
    with tqdm(total=total, desc="encoding", unit=" lines", file=sys.stderr, leave=False) as bar:
        for split in splits:
            split_stats[split] = write_split(out_dir, split, tok, corpus[split], bar)

    cleaning = {"split": train_split, "input_pairs": n_in, "kept_pairs": len(kept_src), "dropped": dropped}
    stats = _stats(cfg, train_split, cleaning, split_stats)
    _write_json(out_dir / "stats.json", stats)
    _write_json(out_dir / "meta.json", _meta(cfg, tok, splits, source))
    lines = ", ".join(f"{s} {split_stats[s]['lines']}" for s in splits)
    print(f"wrote {out_dir} ({lines} pairs) in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return stats


def _stats(cfg: Config, train_split: str, cleaning: dict, split_stats: dict) -> dict[str, Any]:
    return {
        "src": cfg.data.src,
        "tgt": cfg.data.tgt,
        "train_split": train_split,
        "cleaning": {**cleaning, "max_len": cfg.data.max_len, "max_ratio": cfg.data.max_ratio, "dedup": cfg.data.dedup},
        "splits": split_stats,
        # What the decoder uses for the maximum output length: the training split's ratio.
        "tgt_src_ratio": split_stats[train_split]["tgt_src_ratio"],
    }


def _meta(cfg: Config, tok: Tokenizer, splits: list[str], source: str) -> dict[str, Any]:
    return {
        "format": FORMAT_VERSION,
        "src": cfg.data.src,
        "tgt": cfg.data.tgt,
        "joint": tok.joint,
        "src_vocab_size": tok.src.vocab_size,
        "tgt_vocab_size": tok.tgt.vocab_size,
        "special_ids": dict(SPECIAL_IDS),
        # Which SentencePiece model(s) made the ids: a model copied in from another run is refused.
        "spm_sha256": {"src": model_digest(tok.src.model), "tgt": model_digest(tok.tgt.model)},
        "splits": list(splits),
        "train_split": splits[0],
        "source": source,
        "tokenizer": {
            "model_type": cfg.tokenizer.model_type,
            "vocab_size": cfg.tokenizer.vocab_size,
            "character_coverage": cfg.tokenizer.character_coverage,
            "byte_fallback": True,
        },
    }


def _write_json(path: Path, obj: Any) -> None:
    with _writing(path), atomic_write(path) as handle:
        handle.write(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
