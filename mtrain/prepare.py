"""`mtrain tokenize`: check and clean the corpora, train SentencePiece on a sample of the training
split, encode every split and write the token-id cache that mtrain.data reads back.

The folder holds, per split and side, `{split}.{side}.ids.npy` (int32 ids, concatenated),
`{split}.{side}.offsets.npy` (int64, n + 1) and `{split}.{side}.txt` (the raw lines), plus
spm.model (or spm.src.model and spm.tgt.model), stats.json and meta.json, written last: a folder
without meta.json is an interrupted run.

Memory stays bounded whatever the corpus size. The training split is streamed twice: the first
pass reads each corpus in chunks, cleans it (deduplicating across corpora by 64-bit hashes, 8
bytes a pair), writes the kept lines and keeps a seeded uniform sample of them for SentencePiece
(tokenizer.input_sentence_size sentences); the second reads the kept lines back in chunks,
encodes them with all cores and appends the ids to the .npy files. The evaluation splits are
small and read whole, before any writing, so their problems stop the run before any work.

An earlier run's meta.json is deleted before the first write. A failure (a bad line deep in a
file, a full disk, Ctrl-C) is one line naming the file, and removes what this run wrote (the
folder too, if this run made it), so a failure never leaves a folder that looks complete."""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import math
import multiprocessing
import os
import signal
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
from tqdm import tqdm

from mtrain.atomic import atomic_write, describe_write_error
from mtrain.config import Config, check_corpus_settings
from mtrain.corpus import (
    DROP_RULES,
    Chunks,
    Cleaner,
    Corpus,
    Measured,
    Pairs,
    cleaning_report,
    collect,
    iter_text_pair,
    length_rules,
    overlap_report,
    parse_corpora,
)
from mtrain.data import FORMAT_VERSION, SIDES, model_digest
from mtrain.errors import MtrainError
from mtrain.tokenizer import MODEL_TYPES, SPECIAL_IDS, VOCABULARY_FILES, Tokenizer


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """A failed write of `path` becomes one line: the file, the cause, and that the folder is incomplete."""
    try:
        yield
    except OSError as err:
        cause, remedy = describe_write_error(err)
        raise MtrainError(f"{path}: write failed ({cause}); {path.parent} is incomplete (it has no meta.json); "
                          f"{remedy or 'fix the cause'} and re-run `mtrain tokenize`") from None


# ----------------------------------------------------------------------------------------------
# Writing the folder
# ----------------------------------------------------------------------------------------------
class Output:
    """The output folder while tokenize writes it. Entering deletes an earlier run's meta.json and
    SentencePiece models (the folder is incomplete until meta.json is back); leaving on an error or
    Ctrl-C deletes the files this run wrote, and the folder if this run made it."""

    STALE = ("meta.json", "spm.model", "spm.src.model", "spm.tgt.model", *VOCABULARY_FILES)

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.written: list[Path] = []
        self.made = False

    def __enter__(self) -> "Output":
        self.made = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        for name in self.STALE:
            (self.folder / name).unlink(missing_ok=True)
        return self

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        if kind is None:
            return
        for path in self.written:
            path.unlink(missing_ok=True)
        if self.made:
            with contextlib.suppress(OSError):  # not empty: someone else's files; leave it
                self.folder.rmdir()

    def path(self, name: str) -> Path:
        path = self.folder / name
        self.written.append(path)
        return path


class TextOut:
    """Lines appended to a UTF-8 file, each followed by "\\n" only (a reader splitting on "\\n" gets
    exactly these lines back)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with _writing(path):
            self.handle: IO[str] = open(path, "w", encoding="utf-8", newline="\n")

    def write(self, lines: list[str], where: str) -> None:
        with _writing(self.path):
            try:
                self.handle.write("".join(line + "\n" for line in lines))
            except UnicodeEncodeError:  # a lone surrogate, from JSON "\ud800" or a hub dataset
                raise MtrainError(f"{where}: a line holds a lone surrogate (text that is not valid Unicode); "
                                  "fix or drop that line") from None

    def close(self) -> None:
        with _writing(self.path):
            self.handle.close()


class NpyOut:
    """A 1-D .npy file appended to in pieces: a header for length 0 first, the pieces, then the
    header rewritten with the final length. numpy pads a header so that its length does not
    depend on the shape (to let a file grow in place), so the bytes are np.save's."""

    def __init__(self, path: Path, dtype: Any) -> None:
        self.path, self.dtype, self.size = path, np.dtype(dtype), 0
        with _writing(path):
            self.handle: IO[bytes] = open(path, "wb")
            self.header_size = self._header()

    def _header(self) -> int:
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (self.size,)}
        np.lib.format.write_array_header_1_0(self.handle, header)
        return self.handle.tell()

    def append(self, values: np.ndarray) -> None:
        # Through the Python file object: a failed write keeps its errno (ENOSPC, EFBIG).
        with _writing(self.path):
            self.handle.write(np.ascontiguousarray(values, dtype=self.dtype).tobytes())
        self.size += int(values.size)

    def close(self) -> None:
        with _writing(self.path):
            self.handle.seek(0)
            if self._header() != self.header_size:  # cannot happen with numpy's padding; never write a bad file
                raise OSError(f"{self.path}: the .npy header changed size")
            self.handle.close()


# ----------------------------------------------------------------------------------------------
# The SentencePiece sample
# ----------------------------------------------------------------------------------------------
class Reservoir:
    """A seeded uniform random sample of at most `size` pairs of a stream (algorithm R; None: all).
    While the stream fits, it holds every pair in arrival order, so a corpus smaller than the
    sample trains SentencePiece exactly as reading it whole did."""

    def __init__(self, size: Optional[int], seed: int) -> None:
        self.size, self.seen = size, 0
        self.src: list[Optional[str]] = []
        self.tgt: list[Optional[str]] = []
        self.rng = np.random.default_rng(seed)

    def add(self, src: list[str], tgt: list[str]) -> None:
        n = len(src)
        room = n if self.size is None else max(0, min(n, self.size - len(self.src)))
        self.src.extend(src[:room])
        self.tgt.extend(tgt[:room])
        if room < n:
            # Pair number j of the stream (from 0) takes a random slot of j + 1, if it is a slot of the sample.
            slots = self.rng.integers(0, self.seen + np.arange(room, n) + 1)
            for k in np.flatnonzero(slots < self.size).tolist():
                slot = int(slots[k])
                self.src[slot], self.tgt[slot] = src[room + k], tgt[room + k]
        self.seen += n

    def __len__(self) -> int:
        return len(self.src)

    def drain(self) -> tuple[Iterator[str], Iterator[str]]:
        """The sampled source and target lines, each released as SentencePiece takes its copy."""
        return _drain(self.src), _drain(self.tgt)


def _drain(items: list[Optional[str]]) -> Iterator[str]:
    for i in range(len(items)):
        line, items[i] = items[i], None
        yield line


def sample_pairs(cfg: Config) -> Optional[int]:
    """Pairs in the SentencePiece sample: input_sentence_size sentences, two per pair with a joint
    vocabulary (both sides train one model); 0 means all."""
    size = cfg.tokenizer.input_sentence_size
    if size == 0:
        return None
    return size // 2 if cfg.tokenizer.joint else size


# ----------------------------------------------------------------------------------------------
# Length statistics, accumulated chunk by chunk
# ----------------------------------------------------------------------------------------------
@dataclass
class LengthStats:
    """Token-length statistics of one split from per-chunk lengths: exact integer sums for the
    lengths; the tgt/src ratio skips pairs with an empty source."""

    lines: int = 0
    sides: dict[str, list[int]] = field(default_factory=lambda: {side: [0, 0, 0] for side in SIDES})  # sum, sum of squares, max
    ratio_n: int = 0
    ratio_sums: list[float] = field(default_factory=list)
    ratio_squares: list[float] = field(default_factory=list)

    def add(self, src_lengths: np.ndarray, tgt_lengths: np.ndarray) -> None:
        self.lines += int(src_lengths.size)
        for side, lengths in zip(SIDES, (src_lengths, tgt_lengths)):
            lengths = lengths.astype(np.int64)
            acc = self.sides[side]
            acc[0] += int(lengths.sum())
            acc[1] += int((lengths * lengths).sum())
            acc[2] = max(acc[2], int(lengths.max(initial=0)))
        has_src = src_lengths > 0
        ratio = tgt_lengths[has_src] / src_lengths[has_src]
        self.ratio_n += int(ratio.size)
        self.ratio_sums.append(float(ratio.sum()))
        self.ratio_squares.append(float((ratio * ratio).sum()))

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {"lines": self.lines}
        for side in SIDES:
            total, squares, longest = self.sides[side]
            out[f"{side}_tokens"] = {**_mean_std(self.lines, total, squares), "max": longest, "total": total}
        n = self.ratio_n
        mean = math.fsum(self.ratio_sums) / n if n else 0.0
        var = max(0.0, math.fsum(self.ratio_squares) / n - mean * mean) if n else 0.0
        out["tgt_src_ratio"] = {"mean": round(mean, 4), "std": round(math.sqrt(var), 4)}
        return out


def _mean_std(n: int, total: int, squares: int) -> dict[str, float]:
    if n == 0:
        return {"mean": 0.0, "std": 0.0}
    variance = (n * squares - total * total) / (n * n)  # exact in integers up to the one division
    return {"mean": round(total / n, 4), "std": round(math.sqrt(max(0.0, variance)), 4)}


# ----------------------------------------------------------------------------------------------
# The passes
# ----------------------------------------------------------------------------------------------
@dataclass
class Cleaned:
    """What the cleaning pass found: per-corpus counts (in file order), the overlap with the
    evaluation splits, the SentencePiece sample."""

    corpora: list[dict[str, Any]]
    overlap: dict[str, dict[str, int]]
    sample: Reservoir

    @property
    def input_pairs(self) -> int:
        return sum(c["input_pairs"] for c in self.corpora)

    @property
    def kept_pairs(self) -> int:
        return sum(c["kept_pairs"] for c in self.corpora)


def clean_training_split(cfg: Config, corpora: list[Corpus], readers: dict[str, Any], evals: dict[str, Pairs],
                         out: Output, split: str) -> Cleaned:
    """Pass 1: every corpus in turn, chunk by chunk: clean, write the kept lines, sample them."""
    cleaner = Cleaner(cfg.data.max_len, cfg.data.max_ratio, cfg.data.dedup, evals, cfg.data.drop_overlap)
    sample = Reservoir(sample_pairs(cfg), cfg.tokenizer.seed)
    records = []
    files = [TextOut(out.path(f"{split}.{side}.txt")) for side in SIDES]
    with chunk_measurer(cleaner) as measure, tqdm(desc=f"cleaning {split}", unit=" pairs", file=sys.stderr,
                                                  leave=False) as bar:
        for corpus in corpora:
            record = {"name": corpus.name, "source": corpus.source, "input_pairs": 0, "kept_pairs": 0,
                      "dropped": dict.fromkeys(DROP_RULES, 0)}
            for src_lines, tgt_lines, measured in measure(readers[corpus.name]()):
                kept_src, kept_tgt, dropped = cleaner.finish(src_lines, tgt_lines, measured)
                for handle, lines in zip(files, (kept_src, kept_tgt)):
                    handle.write(lines, f"{corpus.source} [{split}] pairs {record['input_pairs'] + 1}-"
                                        f"{record['input_pairs'] + len(src_lines)}")
                sample.add(kept_src, kept_tgt)
                record["input_pairs"] += len(src_lines)
                record["kept_pairs"] += len(kept_src)
                for rule, n in dropped.items():
                    record["dropped"][rule] += n
                bar.update(len(src_lines))
            records.append(record)
            named = corpus.name if len(corpora) > 1 else None
            tqdm.write(cleaning_report(split, record["input_pairs"], record["kept_pairs"], record["dropped"], cfg,
                                       named), file=sys.stderr)
    for handle in files:
        handle.close()
    cleaned = Cleaned(records, cleaner.overlap(), sample)
    if len(corpora) > 1:
        total = {rule: sum(r["dropped"][rule] for r in records) for rule in DROP_RULES}
        print(cleaning_report(split, cleaned.input_pairs, cleaned.kept_pairs, total, cfg), file=sys.stderr)
    if evals:
        print(overlap_report(split, cleaned.overlap, {name: len(pairs[0]) for name, pairs in evals.items()},
                             cfg.data.drop_overlap), file=sys.stderr)
    if cleaned.kept_pairs == 0:
        raise MtrainError(f"the {split} split is empty after cleaning ({cleaned.input_pairs} pairs read, none kept); "
                          "check the training files and data.max_len / data.max_ratio")
    return cleaned


@contextlib.contextmanager
def chunk_measurer(cleaner: Cleaner) -> Iterator[Callable[[Chunks], Iterator[tuple[list[str], list[str], Measured]]]]:
    """A function that gives each chunk with its length rules and hashes (Cleaner.measure, the
    costly part of cleaning), in order. With 2 or more cores, one worker process per core measures
    while this process reads, deduplicates and writes, so the pass uses every core.

    The workers are forked here, before the caller's progress bar starts its monitor thread: a
    fork copies only the forking thread, and a lock another thread held would stay held. Fork
    also spares the workers re-importing the program (spawn, where fork is missing, needs it)."""
    workers = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    if workers < 2:
        yield lambda chunks: ((src, tgt, cleaner.measure(src, tgt)) for src, tgt in chunks)
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method), initializer=_ignore_sigint)
    pool.submit(int).result()  # starts every worker now
    try:
        yield lambda chunks: _measured(pool, 2 * workers, cleaner, chunks)
    finally:
        # Waiting on an error too (for the chunks already being measured, a few ms each): left
        # running, the pool's manager thread could close its wake-up pipe while the interpreter's
        # exit hook wrote to it, which printed an "Exception ignored ... Bad file descriptor"
        # traceback after the error line in about one failed run in seven (Python 3.11).
        pool.shutdown(wait=True, cancel_futures=True)


def _measured(pool: ProcessPoolExecutor, depth: int, cleaner: Cleaner,
              chunks: Chunks) -> Iterator[tuple[list[str], list[str], Measured]]:
    """Chunks measured by the pool, in order, at most `depth` in flight (memory stays bounded)."""
    pending: collections.deque[tuple[list[str], list[str], Future]] = collections.deque()
    for src_lines, tgt_lines in chunks:
        pending.append((src_lines, tgt_lines, pool.submit(length_rules, src_lines, tgt_lines, cleaner.max_len,
                                                          cleaner.max_ratio)))
        if len(pending) > depth:
            src_done, tgt_done, future = pending.popleft()
            yield src_done, tgt_done, future.result()
    while pending:
        src_done, tgt_done, future = pending.popleft()
        yield src_done, tgt_done, future.result()


def _ignore_sigint() -> None:
    """Workers leave Ctrl-C to the main process, which stops them (and prints the one line)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def train_tokenizer(cfg: Config, cleaned: Cleaned, split: str, tags: Sequence[str]) -> Tokenizer:
    kind = "joint" if cfg.tokenizer.joint else "separate"
    of = "" if len(cleaned.sample) == cleaned.kept_pairs else f" (a seeded sample of the {cleaned.kept_pairs})"
    print(f"training SentencePiece ({cfg.tokenizer.model_type}, {kind}, vocab {cfg.tokenizer.vocab_size}) "
          f"on {len(cleaned.sample)} {split} pairs{of}", file=sys.stderr)
    src_lines, tgt_lines = cleaned.sample.drain()
    return Tokenizer.train(src_lines, tgt_lines, cfg.tokenizer, control_symbols=list(tags))


def encode_split(out: Output, split: str, tok: Tokenizer, chunks: Iterable[Pairs], bar: Any,
                 tag_of_row: Optional[np.ndarray] = None) -> dict[str, Any]:
    """Encode a split chunk by chunk and append its ids and offsets; return its length statistics.
    tag_of_row: per pair, the id prepended to its source ids (0: none)."""
    stats, row = LengthStats(), 0
    files = {side: (NpyOut(out.path(f"{split}.{side}.ids.npy"), np.int32),
                    NpyOut(out.path(f"{split}.{side}.offsets.npy"), np.int64)) for side in SIDES}
    ends = dict.fromkeys(SIDES, 0)
    for _, offsets in files.values():
        offsets.append(np.zeros(1, dtype=np.int64))
    for src_lines, tgt_lines in chunks:
        lengths = {}
        for side, lines, encode in zip(SIDES, (src_lines, tgt_lines), (tok.src.encode, tok.tgt.encode)):
            ids, lengths[side] = _flatten(encode(lines))
            if side == "src" and tag_of_row is not None:
                ids, lengths[side] = _prepend(ids, lengths[side], tag_of_row[row:row + len(lines)])
            ids_out, offsets_out = files[side]
            ids_out.append(ids)
            offsets_out.append(ends[side] + np.cumsum(lengths[side]))
            ends[side] += int(ids.size)
            bar.update(len(lines))
        stats.add(lengths["src"], lengths["tgt"])
        row += len(src_lines)
    for pair in files.values():
        for handle in pair:
            handle.close()
    return stats.result()


def _flatten(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    ids = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int32, count=int(lengths.sum()))
    return ids, lengths


def _prepend(ids: np.ndarray, lengths: np.ndarray, tags: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Put tags[i] before row i's ids where tags[i] > 0."""
    tagged = tags > 0
    starts = (np.cumsum(lengths) - lengths)[tagged]
    return np.insert(ids, starts, tags[tagged].astype(np.int32)), lengths + tagged


def _tag_of_row(corpora: list[dict[str, Any]], kept: int) -> Optional[np.ndarray]:
    """Per kept training pair, its corpus's tag id (0: none); None when no corpus is tagged. 4 bytes
    a pair, only for tagged runs."""
    if not any(c.get("tag_id") for c in corpora):
        return None
    rows = np.zeros(kept, dtype=np.int32)
    start = 0
    for corpus in corpora:
        rows[start:start + corpus["kept_pairs"]] = corpus.get("tag_id") or 0
        start += corpus["kept_pairs"]
    return rows


# ----------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------
def _check_arguments(cfg: Config, splits: Sequence[str]) -> None:
    if not splits or len(set(splits)) != len(splits):
        raise MtrainError(f"--splits {','.join(splits)}: give distinct split names, e.g. train,valid,test2016")
    if cfg.data.src == cfg.data.tgt:
        raise MtrainError(f"--src and --tgt are both {cfg.data.src!r}; give two different language suffixes")
    if cfg.tokenizer.model_type not in MODEL_TYPES:
        raise MtrainError(f"--model-type {cfg.tokenizer.model_type!r}: unknown; use one of {', '.join(MODEL_TYPES)}")


def tag_symbol(name: str) -> str:
    """The reserved SentencePiece piece that tags a corpus's source lines."""
    return f"<{name}>"


def tokenize_corpus(
    cfg: Config,
    data_dir: str | Path | Sequence[str | Path] | None,
    out_dir: Path,
    splits: Sequence[str] = ("train", "valid", "test2016"),
    hf_dataset: Optional[str] = None,
    spm_from: Optional[Path] = None,
) -> dict[str, Any]:
    """`mtrain tokenize`: check, clean the first split of every corpus (`data_dir`: a folder, or
    several `DIR` / `NAME=DIR`), train SentencePiece on a sample of it, encode and cache every split
    (each evaluation split comes from the first corpus that has it). meta.json is written last, so a folder
    without it is an interrupted run. `spm_from`: encode with that checkpoint's or tokenized
    folder's SentencePiece model(s) instead of training one (a distilled student keeps its
    teacher's vocabulary). Returns the stats dict."""
    started = time.perf_counter()
    splits = [s.strip() for s in splits if s.strip()]
    _check_arguments(cfg, splits)
    corpora = parse_corpora(data_dir, hf_dataset)
    check_corpus_settings(cfg.data, [corpus.name for corpus in corpora])
    src, tgt = cfg.data.src, cfg.data.tgt
    train_split, eval_splits = splits[0], splits[1:]
    # Everything that can be checked before the long pass: each corpus's training files exist, and
    # the (small) evaluation splits are read and checked whole.
    readers = {corpus.name: corpus.locate(train_split, src, tgt) for corpus in corpora}
    sources = {split: eval_corpus(corpora, split, src, tgt) for split in eval_splits}
    evals = {split: collect(corpus.locate(split, src, tgt)()) for split, corpus in sources.items()}
    tags = [tag_symbol(name) for name in cfg.data.tags]
    given = None if spm_from is None else existing_tokenizer(Path(spm_from), tags)

    phases = {"cleaning": time.perf_counter()}  # phase -> start, then seconds
    with Output(Path(out_dir)) as out:
        cleaned = clean_training_split(cfg, corpora, readers, evals, out, train_split)
        phases["SentencePiece"] = time.perf_counter()
        tok = given or train_tokenizer(cfg, cleaned, train_split, tags)
        phases["encoding"] = time.perf_counter()
        with _writing(out.folder / " + ".join(tok.files())):
            for name in tok.files():
                out.path(name)
            tok.save(out.folder)
        for record in cleaned.corpora:
            record["tag"] = tag_symbol(record["name"]) if record["name"] in cfg.data.tags else None
            record["tag_id"] = tok.src.control_id(record["tag"]) if record["tag"] else None
        total = 2 * cleaned.kept_pairs + sum(2 * len(pairs[0]) for pairs in evals.values())
        with tqdm(total=total, desc="encoding", unit=" lines", file=sys.stderr, leave=False) as bar:
            text = [out.folder / f"{train_split}.{side}.txt" for side in SIDES]
            split_stats = {train_split: encode_split(out, train_split, tok, iter_text_pair(*text, raw=True), bar,
                                                     _tag_of_row(cleaned.corpora, cleaned.kept_pairs))}
            for split, pairs in evals.items():
                for side, lines in zip(SIDES, pairs):
                    handle = TextOut(out.path(f"{split}.{side}.txt"))
                    handle.write(lines, f"{sources[split].source} [{split}]")
                    handle.close()
                split_stats[split] = encode_split(out, split, tok, [pairs], bar)

        stats = _stats(cfg, train_split, cleaned, split_stats)
        _write_json(out.path("stats.json"), stats)
        meta = _meta(cfg, tok, splits, corpora, cleaned)
        meta["eval_sources"] = {split: corpus.name for split, corpus in sources.items()}
        if given is not None:  # not trained here: the settings above did not make it
            meta["tokenizer"] = {"from": str(spm_from), "vocab_size": tok.tgt.vocab_size}
        _write_json(out.path("meta.json"), meta)
    ends = [*list(phases.values())[1:], time.perf_counter()]
    took = ", ".join(f"{name} {end - start:.1f}s" for (name, start), end in zip(phases.items(), ends))
    lines = ", ".join(f"{s} {split_stats[s]['lines']}" for s in splits)
    print(f"wrote {out_dir} ({lines} pairs) in {time.perf_counter() - started:.1f}s ({took})", file=sys.stderr)
    return stats


def eval_corpus(corpora: Sequence[Corpus], split: str, src: str, tgt: str) -> Corpus:
    """The corpus an evaluation split is read from: the first one that has it, so corpora mixed for
    training keep each one's own test sets. None has it: the first, whose reader names the file."""
    return next((corpus for corpus in corpora if corpus.has(split, src, tgt)), corpora[0])


def existing_tokenizer(path: Path, tags: Sequence[str]) -> Tokenizer:
    """The SentencePiece model(s) of a checkpoint file, a tokenized data folder, or one spm.model."""
    if tags:
        raise MtrainError(f"--spm-from {path}: corpus tags need their own reserved symbols, which only a newly "
                          "trained SentencePiece model has; drop --tag or --spm-from")
    if path.is_dir():
        return Tokenizer.load(path)
    if not path.is_file():
        raise MtrainError(f"--spm-from {path}: not found; pass a checkpoint, a tokenized data folder or an spm.model")
    if path.suffix == ".pt":
        from mtrain.checkpoint import load

        return Tokenizer.from_state(load(path)["tokenizer"])
    try:
        return Tokenizer(path.read_bytes())
    except (RuntimeError, OSError) as err:
        raise MtrainError(f"--spm-from {path}: not a SentencePiece model ({str(err).splitlines()[0][:120]}); "
                          "pass a checkpoint, a tokenized data folder or an spm.model") from None


def _stats(cfg: Config, train_split: str, cleaned: Cleaned, split_stats: dict) -> dict[str, Any]:
    dropped = {rule: sum(c["dropped"][rule] for c in cleaned.corpora) for rule in DROP_RULES}
    cleaning = {"split": train_split, "input_pairs": cleaned.input_pairs, "kept_pairs": cleaned.kept_pairs,
                "dropped": dropped, "max_len": cfg.data.max_len, "max_ratio": cfg.data.max_ratio,
                "dedup": cfg.data.dedup, "drop_overlap": cfg.data.drop_overlap,
                "corpora": {c["name"]: {key: c[key] for key in ("source", "input_pairs", "kept_pairs", "dropped")}
                            for c in cleaned.corpora}}
    return {
        "src": cfg.data.src,
        "tgt": cfg.data.tgt,
        "train_split": train_split,
        "cleaning": cleaning,
        # Evaluation lines (and pairs) that occur in the training data after normalization.
        "overlap": cleaned.overlap,
        "tokenizer_sample": {"pairs": len(cleaned.sample), "of_pairs": cleaned.kept_pairs,
                             "input_sentence_size": cfg.tokenizer.input_sentence_size},
        "splits": split_stats,
        # What the decoder uses for the maximum output length: the training split's ratio.
        "tgt_src_ratio": split_stats[train_split]["tgt_src_ratio"],
    }


def _meta(cfg: Config, tok: Tokenizer, splits: list[str], corpora: list[Corpus], cleaned: Cleaned) -> dict[str, Any]:
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
        "source": corpora[0].source if len(corpora) == 1 else [c.source for c in corpora],
        # The training split holds these corpora one after the other, in this order.
        "corpora": [{"name": c["name"], "source": c["source"], "pairs": c["kept_pairs"], "tag": c["tag"],
                     "tag_id": c["tag_id"]} for c in cleaned.corpora],
        "tokenizer": {
            "model_type": cfg.tokenizer.model_type,
            "vocab_size": cfg.tokenizer.vocab_size,
            "character_coverage": cfg.tokenizer.character_coverage,
            "input_sentence_size": cfg.tokenizer.input_sentence_size,
            "byte_fallback": True,
        },
    }


def _write_json(path: Path, obj: Any) -> None:
    with _writing(path), atomic_write(path) as handle:
        handle.write(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
