"""Raw parallel text: reading (text pairs, TSV, JSONL, Hugging Face `datasets`) in bounded chunks,
with the checks every line must pass, naming corpora, and cleaning the training split: the rules,
deduplication across corpora and the overlap with the evaluation splits. No torch, no SentencePiece.

Reading never holds a whole file: a file is read in blocks of whole lines (BLOCK_BYTES), a pair
of text files side by side, a hub dataset row by row (`datasets` streaming). A bad line is an
error naming the file and line the moment the reader reaches it."""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import numpy as np

from mtrain.config import Config
from mtrain.errors import MtrainError

try:  # a fast 64-bit hash; hashlib's blake2b gives hashes as good, about 5x slower
    import xxhash
except ImportError:  # pragma: no cover - xxhash is a dependency, but a bare install still works
    xxhash = None

DEFAULT_DATA_DIR = Path("data/multi30k")
DEFAULT_HF_DATASET = "bentrevett/multi30k"
# Hugging Face split names for mtrain's split names (bentrevett/multi30k: train/validation/test).
HF_SPLIT_ALIASES = {"valid": ("validation", "dev", "val"), "test2016": ("test",), "test": ("test2016",)}
# In the order they are applied: a pair counts under the first rule it breaks.
DROP_RULES = ("empty_side", "too_long", "length_ratio", "overlap", "duplicate")
# Characters per whitespace token beyond which a side counts as too long: far above real words
# (German compounds reach ~40), so it only drops text that has no spaces to split.
MAX_CHARS_PER_TOKEN = 64
BLOCK_BYTES = 1 << 22  # text read per step: ~28k Multi30k-like lines, whatever the file's size
CHUNK_PAIRS = 20_000  # rows per chunk where a reader goes row by row (JSONL objects, hub rows)
CORPUS_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")

Pairs = tuple[list[str], list[str]]
Chunks = Iterator[Pairs]  # aligned (src lines, tgt lines) chunks of one split


# ----------------------------------------------------------------------------------------------
# Reading lines
# ----------------------------------------------------------------------------------------------
def iter_line_blocks(path: str | Path, block_bytes: Optional[int] = None, raw: bool = False) -> Iterator[list[str]]:
    """The lines of a UTF-8 text file (or .gz), a block of whole lines at a time: without a BOM,
    line ends or a CR before them (raw: only split, for mtrain's own files). Invalid UTF-8 is a
    one-line error naming the file and line.

    Lines are split on "\\n" only: str.splitlines() would also split on U+2028, U+0085 and friends,
    which occur inside real sentences and would break the line alignment of the two sides.
    Blocks are cut after a "\\n" byte, which never occurs inside a UTF-8 sequence.
    """
    path, block_bytes = Path(path), block_bytes or BLOCK_BYTES  # looked up now, so tests can lower it
    try:
        handle = gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")
    except FileNotFoundError:
        raise MtrainError(f"{path}: file not found; check the path") from None
    except OSError as err:
        raise MtrainError(f"{path}: cannot read ({err}); check that the file is intact") from None
    with handle:
        first_line, pending, at_start = 1, b"", True
        while data := _read(handle, block_bytes, path):
            pending += data
            cut = pending.rfind(b"\n") + 1
            if cut == 0:
                continue  # one line longer than a block: read on
            lines = _decode(pending[:cut], path, first_line, at_start, raw)
            pending, at_start, first_line = pending[cut:], False, first_line + len(lines)
            yield lines
        if pending or at_start:  # the last line, without a line end (or an empty file)
            lines = _decode(pending, path, first_line, at_start, raw)
            if lines:
                yield lines


def _read(handle: Any, size: int, path: Path) -> bytes:
    try:
        return handle.read(size)
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        raise MtrainError(f"{path}: cannot read ({err}); check that the file is intact") from None


def _decode(block: bytes, path: Path, first_line: int, at_start: bool, raw: bool) -> list[str]:
    try:
        text = block.decode("utf-8")
    except UnicodeDecodeError as err:
        line = first_line + block.count(b"\n", 0, err.start)
        raise MtrainError(
            f"{path}:{line}: invalid UTF-8 (byte 0x{block[err.start]:02x}); re-encode the file as UTF-8, "
            f"e.g. iconv -f latin1 -t utf-8"
        ) from None
    if at_start and not raw and text.startswith("\ufeff"):
        text = text[1:]
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # a final newline ends the last line, it does not start a new one
    if not raw and "\r" in text:
        lines = [line[:-1] if line.endswith("\r") else line for line in lines]
    return lines


def read_lines(path: str | Path) -> list[str]:
    """Every line of a UTF-8 text file (or .gz), as iter_line_blocks gives them."""
    return list(itertools.chain.from_iterable(iter_line_blocks(path)))


def _lines(n: int) -> str:
    return f"{n} line" if n == 1 else f"{n} lines"


def iter_text_pair(src_path: Path, tgt_path: Path, block_bytes: Optional[int] = None, raw: bool = False) -> Chunks:
    """Aligned chunks of two line-aligned files read side by side. A side that ends first is an
    error naming its first missing line and both line counts (the longer side is counted then)."""
    readers = {path: iter_line_blocks(path, block_bytes, raw) for path in (src_path, tgt_path)}
    buffers: dict[Path, list[str]] = {src_path: [], tgt_path: []}
    pairs = 0
    while True:
        for path, reader in readers.items():
            if not buffers[path]:
                buffers[path] = next(reader, [])
        n = min(len(buffers[src_path]), len(buffers[tgt_path]))
        if n == 0:
            break
        yield buffers[src_path][:n], buffers[tgt_path][:n]
        pairs += n
        buffers = {path: lines[n:] for path, lines in buffers.items()}
    longer = next((path for path, lines in buffers.items() if lines), None)
    if longer is not None:
        shorter = tgt_path if longer == src_path else src_path
        total = pairs + len(buffers[longer]) + sum(map(len, readers[longer]))
        raise MtrainError(
            f"{shorter}:{pairs + 1}: {_lines(pairs)}, but {longer} has {_lines(total)}; line i of each side "
            f"must translate line i of the other, so fix the alignment"
        )


def iter_tsv(path: Path, src: str, tgt: str, block_bytes: Optional[int] = None) -> Chunks:
    """Two TAB-separated columns, src then tgt; a header row `src<TAB>tgt` (the language codes) is skipped."""
    number = 0
    for block in iter_line_blocks(path, block_bytes):
        src_lines, tgt_lines = [], []
        for line in block:
            number += 1
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
        yield src_lines, tgt_lines


def _pair_from_row(row: Any, src: str, tgt: str) -> Optional[tuple[str, str]]:
    """{"de": ..., "en": ...} or {"translation": {"de": ..., "en": ...}} -> (src, tgt), else None."""
    if isinstance(row, dict) and isinstance(row.get("translation"), dict):
        row = row["translation"]
    if isinstance(row, dict) and isinstance(row.get(src), str) and isinstance(row.get(tgt), str):
        return row[src], row[tgt]
    return None


def iter_jsonl(path: Path, src: str, tgt: str, block_bytes: Optional[int] = None) -> Chunks:
    number = 0
    for block in iter_line_blocks(path, block_bytes):
        src_lines, tgt_lines = [], []
        for line in block:
            number += 1
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
        yield src_lines, tgt_lines


def collect(chunks: Iterable[Pairs]) -> Pairs:
    """All chunks of a split in memory (the small evaluation splits)."""
    src_lines, tgt_lines = [], []
    for src_chunk, tgt_chunk in chunks:
        src_lines.extend(src_chunk)
        tgt_lines.extend(tgt_chunk)
    return src_lines, tgt_lines


def _existing(path: Path) -> Optional[Path]:
    """path or path.gz, whichever exists."""
    for candidate in (path, path.with_name(path.name + ".gz")):
        if candidate.is_file():
            return candidate
    return None


def split_file_names(split: str, src: str, tgt: str) -> tuple[str, str, str, str]:
    """The files a split may be held in, in the order they are looked for: the two sides of a
    parallel pair, then a TSV, then JSON lines (each may also end in .gz)."""
    return f"{split}.{src}", f"{split}.{tgt}", f"{split}.tsv", f"{split}.jsonl"


def locate_split(data_dir: Path, split: str, src: str, tgt: str) -> Callable[[], Chunks]:
    """The reader of one split: DIR/{split}.{src}+{split}.{tgt}, else DIR/{split}.tsv, else
    DIR/{split}.jsonl (.gz allowed). A missing file is an error now, before any reading."""
    src_name, tgt_name, tsv_name, jsonl_name = split_file_names(split, src, tgt)
    src_path, tgt_path = _existing(data_dir / src_name), _existing(data_dir / tgt_name)
    if src_path and tgt_path:
        return lambda: iter_text_pair(src_path, tgt_path)
    if src_path or tgt_path:
        missing = data_dir / (tgt_name if src_path else src_name)
        present = src_path or tgt_path
        raise MtrainError(f"{missing}: file not found (but {present} exists); add the other side of the {split} split")
    if tsv := _existing(data_dir / tsv_name):
        return lambda: iter_tsv(tsv, src, tgt)
    if jsonl := _existing(data_dir / jsonl_name):
        return lambda: iter_jsonl(jsonl, src, tgt)
    raise MtrainError(
        f"{data_dir / src_name}: file not found; put {src_name} + {tgt_name} "
        f"(or {tsv_name} / {jsonl_name}) in {data_dir}, or choose splits with --splits"
    )


def read_split(data_dir: Path, split: str, src: str, tgt: str) -> Pairs:
    """One whole split of a folder, checked."""
    return collect(locate_split(data_dir, split, src, tgt)())


# ----------------------------------------------------------------------------------------------
# Hugging Face datasets, streamed
# ----------------------------------------------------------------------------------------------
def open_hf_dataset(name: str) -> Any:
    """A dataset's splits as `datasets` streams (nothing is downloaded whole; needs internet for
    a hub name, not for a local folder of data files)."""
    try:
        import datasets

        return datasets.load_dataset(name, streaming=True)
    except Exception as err:  # network, auth, unknown name: all one line for the user
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise MtrainError(
            f"--hf-dataset {name}: could not load it ({first}); check the name and your internet connection, "
            f"or copy the files to a folder and pass --data"
        ) from None


def locate_hf_split(dataset: Any, name: str, split: str, src: str, tgt: str) -> Callable[[], Chunks]:
    hf_split = next((s for s in (split, *HF_SPLIT_ALIASES.get(split, ())) if s in dataset), None)
    if hf_split is None:
        raise MtrainError(
            f"--hf-dataset {name}: no split {split!r} (it has {', '.join(dataset)}); choose splits with --splits"
        )
    return lambda: _iter_hf_rows(dataset[hf_split], f"--hf-dataset {name} [{hf_split}]", src, tgt)


def _iter_hf_rows(rows: Iterable[Any], where: str, src: str, tgt: str) -> Chunks:
    src_lines: list[str] = []
    tgt_lines: list[str] = []
    number = 0
    iterator = iter(rows)
    while True:
        try:
            row = next(iterator)
        except StopIteration:
            break
        except Exception as err:  # a dropped connection or a broken shard, mid-stream
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise MtrainError(f"{where} row {number + 1}: reading failed ({first}); check your internet "
                              "connection and re-run") from None
        number += 1
        pair = _pair_from_row(row, src, tgt)
        if pair is None:
            columns = ", ".join(row) if isinstance(row, dict) else type(row).__name__
            raise MtrainError(f"{where} row {number}: no string fields {src!r} and {tgt!r} (columns: {columns}); "
                              "check --src/--tgt")
        src_lines.append(pair[0])
        tgt_lines.append(pair[1])
        if len(src_lines) == CHUNK_PAIRS:
            yield src_lines, tgt_lines
            src_lines, tgt_lines = [], []
    if src_lines:
        yield src_lines, tgt_lines


def read_hf_dataset(name: str, splits: Sequence[str], src: str, tgt: str) -> dict[str, Pairs]:
    """Whole splits of a Hugging Face dataset, in memory."""
    dataset = open_hf_dataset(name)
    readers = {split: locate_hf_split(dataset, name, split, src, tgt) for split in splits}
    return {split: collect(reader()) for split, reader in readers.items()}


# ----------------------------------------------------------------------------------------------
# Corpora: `--data DIR`, `--data NAME=DIR`, `--hf-dataset NAME`
# ----------------------------------------------------------------------------------------------
@dataclass
class Corpus:
    """One named parallel corpus: a folder of split files, or a Hugging Face dataset."""

    name: str
    folder: Optional[Path] = None
    hf_dataset: Optional[str] = None
    _dataset: Any = None

    @property
    def source(self) -> str:
        return f"hf:{self.hf_dataset}" if self.hf_dataset else str(self.folder)

    def has(self, split: str, src: str, tgt: str) -> bool:
        """Whether the corpus holds any file of this split (a hub dataset is the only corpus)."""
        if self.hf_dataset is not None:
            return True
        return any(_existing(self.folder / name) for name in split_file_names(split, src, tgt))

    def locate(self, split: str, src: str, tgt: str) -> Callable[[], Chunks]:
        """The reader of one split; what is missing is an error now."""
        if self.hf_dataset is None:
            return locate_split(self.folder, split, src, tgt)
        if self._dataset is None:
            self._dataset = open_hf_dataset(self.hf_dataset)
        return locate_hf_split(self._dataset, self.hf_dataset, split, src, tgt)


def parse_corpora(data: str | Path | Sequence[str | Path] | None, hf_dataset: Optional[str] = None) -> list[Corpus]:
    """The corpora of `--data` (repeatable: DIR or NAME=DIR) or `--hf-dataset`, named and checked:
    folders exist, names are distinct. With neither, data/multi30k."""
    specs = [data] if isinstance(data, (str, Path)) else list(data or [])
    if hf_dataset and specs:
        raise MtrainError(f"--data {specs[0]} and --hf-dataset {hf_dataset}: pass only one of them")
    if hf_dataset:
        return [Corpus(_checked_name(hf_dataset.rstrip("/").rsplit("/", 1)[-1], f"--hf-dataset {hf_dataset}"),
                       hf_dataset=hf_dataset)]
    if not specs:
        if not DEFAULT_DATA_DIR.is_dir():
            raise MtrainError(
                f"{DEFAULT_DATA_DIR}: not found and no --data given; copy Multi30k's {{train,valid,test2016}}.{{de,en}} "
                f"files to {DEFAULT_DATA_DIR}/ or pass --hf-dataset {DEFAULT_HF_DATASET} (needs internet)"
            )
        specs = [DEFAULT_DATA_DIR]
    corpora = [_parse_spec(spec) for spec in specs]
    seen: dict[str, Corpus] = {}
    for corpus in corpora:
        if corpus.name in seen:
            raise MtrainError(f"--data: two corpora named {corpus.name!r} ({seen[corpus.name].folder} and "
                              f"{corpus.folder}); name them apart with --data NAME={corpus.folder}")
        seen[corpus.name] = corpus
    return corpora


def _parse_spec(spec: str | Path) -> Corpus:
    """NAME=DIR when the text before the first "=" is a corpus name; else DIR, named after its folder."""
    text = str(spec)
    name, _, rest = text.partition("=")
    if isinstance(spec, str) and rest and CORPUS_NAME.match(name):
        folder = Path(rest)
    else:
        folder, name = Path(text), Path(text).resolve().name
        name = _checked_name(name, f"--data {text}", f"name it: --data NAME={text}")
    if not folder.is_dir():
        raise MtrainError(f"{folder}: folder not found; pass --data with the folder holding the corpus files")
    return Corpus(name, folder=folder)


def _checked_name(name: str, where: str, fix: str = "") -> str:
    if not CORPUS_NAME.match(name):
        raise MtrainError(f"{where}: {name!r} cannot name a corpus (letters, digits, _ . - only); "
                          f"{fix or 'pass the data as --data NAME=DIR'}")
    return name


# ----------------------------------------------------------------------------------------------
# Normalization and hashing: what deduplication and the overlap check compare
# ----------------------------------------------------------------------------------------------
def normalize(line: str, tokens: Optional[list[str]] = None) -> str:
    """NFKC (the normalization SentencePiece applies), runs of whitespace as one space, none at
    the ends: lines that differ only in these encode to the same pieces, so they count as equal.
    tokens: line.split(), when the caller has it."""
    tokens = line.split() if tokens is None else tokens
    # Most lines are normalized already: printable (so " " is their only whitespace), one space
    # between tokens and NFKC. Checking that is cheaper than rebuilding them.
    if line.isprintable() and len(tokens) == line.count(" ") + 1 and (
            line.isascii() or unicodedata.is_normalized("NFKC", line)):
        return line
    return " ".join(unicodedata.normalize("NFKC", line).split())


def hash64(text: str, seed: int = 0) -> int:
    """A 64-bit hash of text (seed: a hash to chain from). Among 100 million distinct pairs, a
    collision (a pair wrongly dropped as a duplicate) has a probability of about 3e-4."""
    data = text.encode("utf-8", "surrogatepass")
    if xxhash is not None:
        return xxhash.xxh3_64_intdigest(data, seed)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, key=seed.to_bytes(8, "little")).digest(), "little")


def line_hashes(src_norm: str, tgt_norm: str) -> tuple[int, int]:
    """(hash of the source, hash of the pair): the pair's chains the target from the source's."""
    src_hash = hash64(src_norm)
    return src_hash, hash64(tgt_norm, src_hash)


class HashSet:
    """A set of 64-bit hashes in sorted numpy runs, merged like a binary counter (each run at least
    twice the next, so a lookup searches O(log n) runs and a hash is merged O(log n) times): 8 bytes
    a hash, where a Python set of ints takes about 70."""

    def __init__(self) -> None:
        self.runs: list[np.ndarray] = []

    def __len__(self) -> int:
        return sum(run.size for run in self.runs)

    def contains(self, hashes: np.ndarray) -> np.ndarray:
        found = np.zeros(hashes.size, dtype=bool)
        for run in self.runs:
            at = np.minimum(np.searchsorted(run, hashes), run.size - 1)
            found |= run[at] == hashes
        return found

    def add_new(self, hashes: np.ndarray) -> np.ndarray:
        """Which of `hashes` are new (not in the set, not earlier in `hashes`); adds them."""
        hashes = np.asarray(hashes, dtype=np.uint64)
        new = np.zeros(hashes.size, dtype=bool)
        new[np.unique(hashes, return_index=True)[1]] = True
        new &= ~self.contains(hashes)
        if new.any():
            self.runs.append(np.sort(hashes[new]))
            while len(self.runs) > 1 and self.runs[-2].size <= 2 * self.runs[-1].size:
                last = self.runs.pop()
                # Two sorted runs: the stable sort (timsort) merges them in linear time.
                self.runs[-1] = np.sort(np.concatenate([self.runs[-1], last]), kind="stable")
        return new


# ----------------------------------------------------------------------------------------------
# Cleaning (training split only)
# ----------------------------------------------------------------------------------------------
class Cleaner:
    """The training split's cleaning, chunk by chunk over every corpus in turn. A pair is dropped by
    the first rule it breaks, in DROP_RULES order; lengths are whitespace tokens, and too_long also
    catches a side of more than MAX_CHARS_PER_TOKEN * max_len characters (text without spaces: a
    run-on line, CJK, a base64 blob is one "token" however long it is). A duplicate is a pair
    equal to an earlier kept pair of any corpus after `normalize`, compared by 64-bit hash.

    `evals` (the evaluation splits): each one's source lines and pairs that occur among the
    training pairs passing the length rules are counted (`overlap()`); with drop_overlap, training
    pairs whose source occurs in an evaluation split are dropped (rule "overlap")."""

    def __init__(self, max_len: int, max_ratio: float, dedup: bool = True,
                 evals: Optional[Mapping[str, Pairs]] = None, drop_overlap: bool = False) -> None:
        self.max_len, self.max_ratio, self.dedup, self.drop_overlap = max_len, max_ratio, dedup, drop_overlap
        self.seen = HashSet()
        self.evals = {split: _eval_hashes(*pairs) for split, pairs in (evals or {}).items()}
        self.eval_src = np.unique(np.concatenate([h[0] for h in self.evals.values()] or [np.zeros(0, np.uint64)]))
        self.eval_pairs = np.unique(np.concatenate([h[1] for h in self.evals.values()] or [np.zeros(0, np.uint64)]))
        self.found_src: set[int] = set()
        self.found_pairs: set[int] = set()

    def clean(self, src_lines: list[str], tgt_lines: list[str]) -> tuple[list[str], list[str], dict[str, int]]:
        """(kept src, kept tgt, {rule: number dropped}) of one chunk."""
        return self.finish(src_lines, tgt_lines, self.measure(src_lines, tgt_lines))

    def measure(self, src_lines: list[str], tgt_lines: list[str]) -> "Measured":
        """The stateless, costly part of cleaning a chunk (it may run in another process)."""
        return length_rules(src_lines, tgt_lines, self.max_len, self.max_ratio)

    def finish(self, src_lines: list[str], tgt_lines: list[str],
               measured: "Measured") -> tuple[list[str], list[str], dict[str, int]]:
        """The chunk's overlap and duplicates, against every chunk before it (in order)."""
        rows, pair_hashes, src_hashes, dropped = measured
        keep = np.ones(rows.size, dtype=bool)
        if self.evals:
            hit = np.isin(src_hashes, self.eval_src)
            self.found_src.update(src_hashes[hit].tolist())
            self.found_pairs.update(pair_hashes[np.isin(pair_hashes, self.eval_pairs)].tolist())
            if self.drop_overlap:
                keep &= ~hit
                dropped["overlap"] = int(hit.sum())
        if self.dedup:
            new = np.zeros(rows.size, dtype=bool)
            new[keep] = self.seen.add_new(pair_hashes[keep])
            dropped["duplicate"] = int(keep.sum() - new.sum())
            keep = new
        kept = rows[keep].tolist()
        return [src_lines[i] for i in kept], [tgt_lines[i] for i in kept], dropped

    def overlap(self) -> dict[str, dict[str, int]]:
        """Per evaluation split: its source lines, and its pairs, that occur in the training data."""
        found_src = np.fromiter(self.found_src, dtype=np.uint64, count=len(self.found_src))
        found_pairs = np.fromiter(self.found_pairs, dtype=np.uint64, count=len(self.found_pairs))
        return {split: {"src": int(np.isin(src, found_src).sum()), "pairs": int(np.isin(pairs, found_pairs).sum())}
                for split, (src, pairs) in self.evals.items()}


Measured = tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, int]]  # rows, pair hashes, source hashes, drops


def length_rules(src_lines: list[str], tgt_lines: list[str], max_len: int, max_ratio: float) -> Measured:
    """Rows of a chunk passing empty_side, too_long and length_ratio, with their pair and source
    hashes, and what each rule dropped."""
    dropped = dict.fromkeys(DROP_RULES, 0)
    rows, pair_hashes, src_hashes = [], [], []
    max_chars = MAX_CHARS_PER_TOKEN * max_len
    for i, (s, t) in enumerate(zip(src_lines, tgt_lines)):  # tokenize's hot loop: ~4 us a pair
        s_tokens, t_tokens = s.split(), t.split()
        n_src, n_tgt = len(s_tokens), len(t_tokens)
        if n_src == 0 or n_tgt == 0:
            dropped["empty_side"] += 1
        elif n_src > max_len or n_tgt > max_len or max(len(s), len(t)) > max_chars:
            dropped["too_long"] += 1
        elif max(n_src, n_tgt) > max_ratio * min(n_src, n_tgt):
            dropped["length_ratio"] += 1
        else:
            src_hash, pair_hash = line_hashes(normalize(s, s_tokens), normalize(t, t_tokens))
            rows.append(i)
            src_hashes.append(src_hash)
            pair_hashes.append(pair_hash)
    return (np.array(rows, dtype=np.int64), np.array(pair_hashes, dtype=np.uint64),
            np.array(src_hashes, dtype=np.uint64), dropped)


def _eval_hashes(src_lines: list[str], tgt_lines: list[str]) -> tuple[np.ndarray, np.ndarray]:
    hashes = [line_hashes(normalize(s), normalize(t)) for s, t in zip(src_lines, tgt_lines)]
    return (np.array([h[0] for h in hashes], dtype=np.uint64), np.array([h[1] for h in hashes], dtype=np.uint64))


def clean_pairs(src_lines: list[str], tgt_lines: list[str], max_len: int, max_ratio: float, dedup: bool = True):
    """Clean one in-memory corpus (see Cleaner). Returns (kept src, kept tgt, {rule: number dropped})."""
    return Cleaner(max_len, max_ratio, dedup).clean(list(src_lines), list(tgt_lines))


def cleaning_report(split: str, n_in: int, n_kept: int, dropped: dict[str, int], cfg: Config,
                    corpus: Optional[str] = None) -> str:
    rules = {
        "empty_side": "empty side",
        "too_long": f"longer than {cfg.data.max_len} tokens",
        "length_ratio": f"length ratio > {cfg.data.max_ratio:g}",
        "overlap": "source in an evaluation split",
        "duplicate": "duplicate",
    }
    if not cfg.data.drop_overlap:
        rules.pop("overlap")
    parts = ", ".join(f"{label} {dropped[rule]}" for rule, label in rules.items())
    what = f"{split} of {corpus}" if corpus else split
    return f"cleaned {what}: {n_in} pairs -> {n_kept} kept, {n_in - n_kept} dropped ({parts})"


def overlap_report(split: str, overlap: dict[str, dict[str, int]], sizes: Mapping[str, int], dropped: bool) -> str:
    """One line: how much of each evaluation split occurs in the training data."""
    parts = "; ".join(f"{name} {counts['src']} of {sizes[name]} source lines, {counts['pairs']} pairs"
                      for name, counts in overlap.items())
    found = any(counts["src"] for counts in overlap.values())
    after = "; the training pairs with those sources were dropped" if dropped else \
        "; --drop-overlap drops them from training" if found else ""
    return f"evaluation text also in {split} (after normalization): {parts}{after}"
