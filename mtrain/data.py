"""Parallel data: reading (text pairs, TSV, JSONL, HF `datasets`) with checks, cleaning, the
token-id cache that `mtrain tokenize` writes, and loading it back as token-budget batches."""

from __future__ import annotations

import gzip
import itertools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from mtrain.atomic import atomic_text
from mtrain.config import Config
from mtrain.errors import MtrainError
from mtrain.tokenizer import BOS_ID, EOS_ID, MODEL_TYPES, PAD_ID, SPECIAL_IDS, Tokenizer

DEFAULT_DATA_DIR = Path("data/multi30k")
DEFAULT_HF_DATASET = "bentrevett/multi30k"
FORMAT_VERSION = 1
SIDES = ("src", "tgt")
# Hugging Face split names for mtrain's split names (bentrevett/multi30k: train/validation/test).
HF_SPLIT_ALIASES = {"valid": ("validation", "dev", "val"), "test2016": ("test",), "test": ("test2016",)}
DROP_RULES = ("empty_side", "too_long", "length_ratio", "duplicate")

Pairs = tuple[list[str], list[str]]


# ----------------------------------------------------------------------------------------------
# Reading, with the checks that must pass before any work
# ----------------------------------------------------------------------------------------------
def read_lines(path: str | Path) -> list[str]:
    """Lines of a UTF-8 text file (or .gz), without a BOM, line ends or CR; invalid UTF-8 is a one-line error.

    Lines are split on "\\n" only: str.splitlines() would also split on U+2028, U+0085 and friends,
    which occur inside real sentences and would break the line alignment of the two sides.
    """
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except FileNotFoundError:
        raise MtrainError(f"{path}: file not found; check the path") from None
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        raise MtrainError(f"{path}: cannot read ({err}); check that the file is intact") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise MtrainError(
            f"{path}:{line}: invalid UTF-8 (byte 0x{raw[err.start]:02x}); re-encode the file as UTF-8, "
            f"e.g. iconv -f latin1 -t utf-8"
        ) from None
    if text.startswith("\ufeff"):
        text = text[1:]
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the final newline ends the last line, it does not start a new one
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def _existing(path: Path) -> Optional[Path]:
    """path or path.gz, whichever exists."""
    for candidate in (path, path.with_name(path.name + ".gz")):
        if candidate.is_file():
            return candidate
    return None


def read_text_pair(src_path: Path, tgt_path: Path) -> Pairs:
    src_lines, tgt_lines = read_lines(src_path), read_lines(tgt_path)
    if len(src_lines) != len(tgt_lines):
        raise MtrainError(
            f"{tgt_path}:{min(len(src_lines), len(tgt_lines)) + 1}: {_lines(len(tgt_lines))}, but {src_path} has "
            f"{_lines(len(src_lines))}; line i of each side must translate line i of the other, so fix the alignment"
        )
    return src_lines, tgt_lines


def _lines(n: int) -> str:
    return f"{n} line" if n == 1 else f"{n} lines"


def read_tsv(path: Path, src: str, tgt: str) -> Pairs:
    """Two TAB-separated columns, src then tgt; a header row `src<TAB>tgt` (the language codes) is skipped."""
    src_lines, tgt_lines = [], []
    for number, line in enumerate(read_lines(path), start=1):
        columns = line.split("\t")
        if len(columns) != 2:
            raise MtrainError(
                f"{path}:{number}: expected 2 TAB-separated columns ({src}<TAB>{tgt}), found {len(columns)}; "
                "remove or escape the extra TABs"
            )
        if number == 1 and (columns[0].strip(), columns[1].strip()) == (src, tgt):
            continue
        src_lines.append(columns[0])
        tgt_lines.append(columns[1])
    return src_lines, tgt_lines


def _pair_from_row(row: Any, src: str, tgt: str) -> Optional[tuple[str, str]]:
    """{"de": ..., "en": ...} or {"translation": {"de": ..., "en": ...}} -> (src, tgt), else None."""
    if isinstance(row, dict) and isinstance(row.get("translation"), dict):
        row = row["translation"]
    if isinstance(row, dict) and isinstance(row.get(src), str) and isinstance(row.get(tgt), str):
        return row[src], row[tgt]
    return None


def read_jsonl(path: Path, src: str, tgt: str) -> Pairs:
    src_lines, tgt_lines = [], []
    for number, line in enumerate(read_lines(path), start=1):
        if not line.strip():
            continue  # each object is self-contained, so a blank line cannot shift the alignment
        try:
            pair = _pair_from_row(json.loads(line), src, tgt)
        except json.JSONDecodeError as err:
            raise MtrainError(f"{path}:{number}: invalid JSON ({err.msg}); write one JSON object per line") from None
        if pair is None:
            raise MtrainError(
                f"{path}:{number}: expected an object with string fields {src!r} and {tgt!r} "
                f"(or {{\"translation\": {{...}}}}); check --src/--tgt or the file"
            )
        src_lines.append(pair[0])
        tgt_lines.append(pair[1])
    return src_lines, tgt_lines


def read_split(data_dir: Path, split: str, src: str, tgt: str) -> Pairs:
    """One split from DIR/{split}.{src}+{split}.{tgt}, else DIR/{split}.tsv, else DIR/{split}.jsonl (.gz allowed)."""
    src_path, tgt_path = _existing(data_dir / f"{split}.{src}"), _existing(data_dir / f"{split}.{tgt}")
    if src_path and tgt_path:
        return read_text_pair(src_path, tgt_path)
    if src_path or tgt_path:
        missing = data_dir / f"{split}.{tgt if src_path else src}"
        present = src_path or tgt_path
        raise MtrainError(f"{missing}: file not found (but {present} exists); add the other side of the {split} split")
    if tsv := _existing(data_dir / f"{split}.tsv"):
        return read_tsv(tsv, src, tgt)
    if jsonl := _existing(data_dir / f"{split}.jsonl"):
        return read_jsonl(jsonl, src, tgt)
    raise MtrainError(
        f"{data_dir / f'{split}.{src}'}: file not found; put {split}.{src} + {split}.{tgt} "
        f"(or {split}.tsv / {split}.jsonl) in {data_dir}, or choose splits with --splits"
    )


def read_hf_dataset(name: str, splits: Sequence[str], src: str, tgt: str) -> dict[str, Pairs]:
    """Read splits through Hugging Face `datasets` (downloads on first use; needs internet)."""
    try:
        import datasets

        dataset = datasets.load_dataset(name)
    except Exception as err:  # network, auth, unknown name: all one line for the user
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise MtrainError(
            f"--hf-dataset {name}: could not load it ({first}); check the name and your internet connection, "
            f"or copy the files to a folder and pass --data"
        ) from None
    result = {}
    for split in splits:
        hf_split = next((s for s in (split, *HF_SPLIT_ALIASES.get(split, ())) if s in dataset), None)
        if hf_split is None:
            raise MtrainError(
                f"--hf-dataset {name}: no split {split!r} (it has {', '.join(dataset)}); choose splits with --splits"
            )
        src_lines, tgt_lines = [], []
        for number, row in enumerate(dataset[hf_split], start=1):
            pair = _pair_from_row(row, src, tgt)
            if pair is None:
                raise MtrainError(
                    f"--hf-dataset {name} [{hf_split}] row {number}: no string fields {src!r} and {tgt!r} "
                    f"(columns: {', '.join(row)}); check --src/--tgt"
                )
            src_lines.append(pair[0])
            tgt_lines.append(pair[1])
        result[split] = (src_lines, tgt_lines)
    return result


def read_corpus(
    data_dir: Optional[Path], splits: Sequence[str], src: str, tgt: str, hf_dataset: Optional[str] = None
) -> tuple[dict[str, Pairs], str]:
    """Every split, fully checked, before any work starts. Returns (splits, a description of the source)."""
    if hf_dataset and data_dir is not None:
        raise MtrainError(f"--data {data_dir} and --hf-dataset {hf_dataset}: pass only one of them")
    if hf_dataset:
        return read_hf_dataset(hf_dataset, splits, src, tgt), f"hf:{hf_dataset}"
    if data_dir is None:
        data_dir = DEFAULT_DATA_DIR
        if not data_dir.is_dir():
            raise MtrainError(
                f"{data_dir}: not found and no --data given; copy Multi30k's {{train,valid,test2016}}.{{{src},{tgt}}} "
                f"files to {data_dir}/ or pass --hf-dataset {DEFAULT_HF_DATASET} (needs internet)"
            )
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise MtrainError(f"{data_dir}: folder not found; pass --data with the folder holding the corpus files")
    return {split: read_split(data_dir, split, src, tgt) for split in splits}, str(data_dir)


# ----------------------------------------------------------------------------------------------
# Cleaning (training split only)
# ----------------------------------------------------------------------------------------------
def clean_pairs(src_lines: list[str], tgt_lines: list[str], max_len: int, max_ratio: float, dedup: bool = True):
    """Drop training pairs by the first rule they break, in DROP_RULES order; lengths are whitespace tokens.

    Returns (kept src, kept tgt, {rule: number dropped}).
    """
    dropped = dict.fromkeys(DROP_RULES, 0)
    seen: set[tuple[str, str]] = set()
    kept_src, kept_tgt = [], []
    for s, t in zip(src_lines, tgt_lines):
        n_src, n_tgt = len(s.split()), len(t.split())
        if n_src == 0 or n_tgt == 0:
            rule = "empty_side"
        elif n_src > max_len or n_tgt > max_len:
            rule = "too_long"
        elif max(n_src, n_tgt) > max_ratio * min(n_src, n_tgt):
            rule = "length_ratio"
        elif dedup and (s, t) in seen:
            rule = "duplicate"
        else:
            seen.add((s, t))
            kept_src.append(s)
            kept_tgt.append(t)
            continue
        dropped[rule] += 1
    return kept_src, kept_tgt, dropped


def cleaning_report(split: str, n_in: int, n_kept: int, dropped: dict[str, int], cfg: Config) -> str:
    rules = {
        "empty_side": "empty side",
        "too_long": f"longer than {cfg.data.max_len} tokens",
        "length_ratio": f"length ratio > {cfg.data.max_ratio:g}",
        "duplicate": "exact duplicate",
    }
    parts = ", ".join(f"{label} {dropped[rule]}" for rule, label in rules.items())
    return f"cleaned {split}: {n_in} pairs -> {n_kept} kept, {n_in - n_kept} dropped ({parts})"


# ----------------------------------------------------------------------------------------------
# The token-id cache
# ----------------------------------------------------------------------------------------------
def _encode_chunked(encode, lines: list[str], bar, chunk: int = 20_000) -> list[list[int]]:
    ids: list[list[int]] = []
    for start in range(0, len(lines), chunk):
        ids.extend(encode(lines[start : start + chunk]))
        bar.update(min(chunk, len(lines) - start))
    return ids


def to_ragged_arrays(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated int32 ids and int64 offsets (n + 1 of them): sentence i is ids[off[i]:off[i+1]]."""
    lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int32, count=int(offsets[-1]))
    return ids, offsets


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
    for side, lines, encode in zip(SIDES, pairs, (tok.encode_src, tok.encode_tgt)):
        ids, offsets = to_ragged_arrays(_encode_chunked(encode, lines, bar))
        np.save(out_dir / f"{split}.{side}.ids.npy", ids)
        np.save(out_dir / f"{split}.{side}.offsets.npy", offsets)
        # Joined with "\n" only, so that a reader splitting on "\n" gets exactly these lines back.
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
    from tqdm import tqdm

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
        "src_vocab_size": tok.src_vocab_size,
        "tgt_vocab_size": tok.tgt_vocab_size,
        "special_ids": dict(SPECIAL_IDS),
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
    with atomic_text(path) as handle:
        handle.write(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------------------------
# Loading the cache
# ----------------------------------------------------------------------------------------------
class Ragged:
    """Variable-length id sequences stored as one flat array + offsets (memory-mapped by default)."""

    def __init__(self, ids: np.ndarray, offsets: np.ndarray) -> None:
        self.ids = ids
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.lengths: np.ndarray = np.diff(self.offsets)

    def __len__(self) -> int:
        return int(self.lengths.size)

    def __getitem__(self, i: int) -> np.ndarray:
        return np.asarray(self.ids[self.offsets[i] : self.offsets[i + 1]])


@dataclass
class Split:
    """One tokenized split: src/tgt ids (no BOS/EOS) and, on demand, the raw text lines."""

    name: str
    src: Ragged
    tgt: Ragged
    data_dir: Path

    def __len__(self) -> int:
        return len(self.src)

    def src_text(self) -> list[str]:
        return read_lines(self.data_dir / f"{self.name}.src.txt")

    def tgt_text(self) -> list[str]:
        return read_lines(self.data_dir / f"{self.name}.tgt.txt")


def load_meta(data_dir: str | Path) -> dict[str, Any]:
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise MtrainError(
            f"{path}: not found; {data_dir} is not a finished `mtrain tokenize` output — run "
            f"`mtrain tokenize --out {data_dir}` (again, if it was interrupted)"
        )
    meta = _read_json(path, data_dir)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise MtrainError(f"{path}: cache format {found} is not {FORMAT_VERSION}; re-run mtrain tokenize")
    return meta


def _read_json(path: Path, data_dir: str | Path) -> Any:
    """A JSON file of the tokenized folder; a damaged one is a one-line error."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MtrainError(f"{path}: damaged ({err}); re-run `mtrain tokenize --out {data_dir}`") from None


def load_split(data_dir: str | Path, split: str, mmap: bool = True) -> Split:
    """A split of a tokenized folder; ids are memory-mapped, so this is instant for any corpus size."""
    data_dir = Path(data_dir)
    meta = load_meta(data_dir)
    if split not in meta["splits"]:
        raise MtrainError(
            f"{data_dir}: no tokenized split {split!r} (it has {', '.join(meta['splits'])}); "
            f"re-run mtrain tokenize with --splits including {split}"
        )
    sides = []
    for side in SIDES:
        ids_path, off_path = data_dir / f"{split}.{side}.ids.npy", data_dir / f"{split}.{side}.offsets.npy"
        for path in (ids_path, off_path):
            if not path.is_file():
                raise MtrainError(f"{path}: not found; re-run mtrain tokenize --out {data_dir}")
        sides.append(Ragged(_load_array(ids_path, data_dir, "r" if mmap else None), _load_array(off_path, data_dir)))
    if len(sides[0]) != len(sides[1]):
        raise MtrainError(f"{data_dir}: {split} has {len(sides[0])} src but {len(sides[1])} tgt lines; re-run mtrain tokenize")
    return Split(split, sides[0], sides[1], data_dir)


def _load_array(path: Path, data_dir: Path, mmap_mode: Optional[str] = None) -> np.ndarray:
    """np.load (never unpickling: allow_pickle stays False) with one-line errors for damaged files."""
    try:
        return np.load(path, mmap_mode=mmap_mode)
    except (ValueError, OSError, EOFError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise MtrainError(f"{path}: damaged ({first[:160]}); re-run `mtrain tokenize --out {data_dir}`") from None


def load_tokenizer(data_dir: str | Path) -> Tokenizer:
    return Tokenizer.load(data_dir, joint=load_meta(data_dir)["joint"])


def load_stats(data_dir: str | Path) -> dict[str, Any]:
    path = Path(data_dir) / "stats.json"
    if not path.is_file():
        raise MtrainError(f"{path}: not found; re-run mtrain tokenize --out {data_dir}")
    return _read_json(path, data_dir)


# ----------------------------------------------------------------------------------------------
# Subword sampling
# ----------------------------------------------------------------------------------------------
class SubwordSampler:
    """The training split re-segmented for each epoch by SentencePiece sampling (train.sampling_alpha).

    Epoch e's ids are a pure function of (seed, e), so a resumed run sees the same segmentations
    as an uninterrupted one. A line whose sampled pieces could not fit any batch of max_tokens
    keeps its cached (deterministic) ids, so sampling never makes a corpus untrainable.
    """

    def __init__(self, split: Split, tokenizer: Tokenizer, alpha: float, seed: int, max_tokens: int) -> None:
        self.split, self.tokenizer, self.alpha, self.seed, self.max_tokens = split, tokenizer, alpha, seed, max_tokens
        self.text = (split.src_text(), split.tgt_text())
        for side, lines in zip(SIDES, self.text):
            if len(lines) != len(split):
                raise MtrainError(
                    f"{split.data_dir / f'{split.name}.{side}.txt'}: {len(lines)} lines but {len(split)} cached "
                    f"sentences; re-run `mtrain tokenize --out {split.data_dir}`"
                )

    def __call__(self, epoch: int) -> Split:
        src_seed, tgt_seed = (int(s) for s in np.random.default_rng([self.seed, epoch]).integers(1, 2**31, size=2))
        src = self.tokenizer.sample_src(self.text[0], self.alpha, src_seed)
        tgt = self.tokenizer.sample_tgt(self.text[1], self.alpha, tgt_seed)
        for i, (s, t) in enumerate(zip(src, tgt)):
            if max(len(s), len(t)) + 1 > self.max_tokens:  # + 1: EOS/BOS, as in make_batches
                src[i], tgt[i] = self.split.src[i].tolist(), self.split.tgt[i].tolist()
        return Split(self.split.name, Ragged(*to_ragged_arrays(src)), Ragged(*to_ragged_arrays(tgt)), self.split.data_dir)


# ----------------------------------------------------------------------------------------------
# Batching
# ----------------------------------------------------------------------------------------------
def make_batches(
    src_lengths: np.ndarray,
    tgt_lengths: np.ndarray,
    max_tokens: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    allow_oversize: bool = False,
) -> list[np.ndarray]:
    """Length-bucketed batches of indices under a token budget, a pure function of (seed, epoch).

    Every batch satisfies len(batch) * max(max src len + 1, max tgt len + 1) <= max_tokens (the + 1
    is EOS on src/tgt_out and BOS on tgt_in). Sentences are sorted by that cost (ties broken
    randomly when shuffling) and cut greedily, so padding is small; the batch order is shuffled.
    A sentence costing more than max_tokens is an error (it cannot fit any batch), unless
    allow_oversize, which puts it alone in a batch of one (breaking the budget for that batch).
    """
    src_lengths, tgt_lengths = np.asarray(src_lengths), np.asarray(tgt_lengths)
    if src_lengths.shape != tgt_lengths.shape:
        raise ValueError(f"src_lengths {src_lengths.shape} and tgt_lengths {tgt_lengths.shape} differ")
    cost = np.maximum(src_lengths, tgt_lengths).astype(np.int64) + 1
    rng = np.random.default_rng([seed, epoch])
    if shuffle:
        tie_break = rng.permutation(cost.size)
        order = tie_break[np.argsort(cost[tie_break], kind="stable")]
    else:
        order = np.argsort(cost, kind="stable")

    batches: list[np.ndarray] = []
    start = 0
    for i, index in enumerate(order):
        # Sorted ascending, so the newest sentence is the longest: the batch costs (size) * cost[index].
        if (i + 1 - start) * cost[index] > max_tokens and i > start:
            batches.append(order[start:i])
            start = i
        if cost[index] > max_tokens and not allow_oversize:
            raise MtrainError(
                f"sentence {int(index)} has {int(cost[index])} tokens with EOS, more than max_tokens={max_tokens}; "
                f"raise train.max_tokens to at least {int(cost[index])} or lower data.max_len and re-tokenize"
            )
    if start < cost.size:
        batches.append(order[start:])
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def _gather(ragged: Ragged, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The concatenated ids of the chosen sentences and their lengths, in one fancy-index read
    (slicing a memory map sentence by sentence is ~100x slower)."""
    lengths = ragged.lengths[indices]
    row_start = np.cumsum(lengths) - lengths  # where each sentence starts in the gathered array
    positions = np.repeat(ragged.offsets[indices] - row_start, lengths) + np.arange(int(lengths.sum()))
    return np.asarray(ragged.ids[positions], dtype=np.int64), lengths


def _pad(values: np.ndarray, lengths: np.ndarray, width: int, shift: int) -> np.ndarray:
    """Rows of PAD with sentence i's ids in columns shift .. shift + lengths[i] - 1."""
    out = np.full((lengths.size, width), PAD_ID, dtype=np.int64)
    columns = np.arange(width)
    out[(columns >= shift) & (columns < lengths[:, None] + shift)] = values  # row-major = concatenation order
    return out


def collate(split: Split, indices: Sequence[int], device: Any = None):
    """Padded LongTensors (src, tgt_in, tgt_out): src = ids + EOS, tgt_in = BOS + ids, tgt_out = ids + EOS."""
    import torch

    indices = np.asarray(indices, dtype=np.int64)
    rows = np.arange(indices.size)
    src_ids, src_len = _gather(split.src, indices)
    tgt_ids, tgt_len = _gather(split.tgt, indices)
    src = _pad(src_ids, src_len, int(src_len.max(initial=0)) + 1, 0)
    src[rows, src_len] = EOS_ID
    tgt_width = int(tgt_len.max(initial=0)) + 1
    tgt_in = _pad(tgt_ids, tgt_len, tgt_width, 1)
    tgt_in[:, 0] = BOS_ID
    tgt_out = _pad(tgt_ids, tgt_len, tgt_width, 0)
    tgt_out[rows, tgt_len] = EOS_ID
    tensors = tuple(torch.from_numpy(a) for a in (src, tgt_in, tgt_out))
    if device is not None:
        tensors = tuple(t.to(device, non_blocking=True) for t in tensors)
    return tensors
