"""The token-id cache that `mtrain tokenize` writes, read back: `TokenizedData` opens a folder
once (meta.json, SentencePiece, stats.json, memory-mapped splits); subword sampling; mixing
several corpora by weight; and the training batches: token-budget buckets as a pure function of
(seed, epoch), the endless `BatchStream` whose (epoch, index) position makes resume exact, and
collation into tensors."""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import numpy as np
import torch

from mtrain.config import DataConfig, check_corpus_settings, corpus_weights
from mtrain.corpus import read_lines
from mtrain.errors import MtrainError
from mtrain.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer

FORMAT_VERSION = 1
SIDES = ("src", "tgt")
CHECK_CHUNK = 1 << 22  # ids read per step when checking a split's ids


# ----------------------------------------------------------------------------------------------
# The cache read back
# ----------------------------------------------------------------------------------------------
def model_digest(model: bytes) -> str:
    """The SHA-256 of a serialized SentencePiece model, as meta.json records it."""
    return hashlib.sha256(model).hexdigest()


def to_ragged_arrays(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated int32 ids and int64 offsets (n + 1 of them): sentence i is ids[off[i]:off[i+1]]."""
    lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int32, count=int(offsets[-1]))
    return ids, offsets


class Ragged:
    """Variable-length id sequences stored as one flat array + offsets (memory-mapped by default)."""

    def __init__(self, ids: np.ndarray, offsets: np.ndarray, lengths: Optional[np.ndarray] = None) -> None:
        self.ids = ids
        self.offsets = np.asarray(offsets, dtype=np.int64)
        # int32: the 4 bytes a sentence and side that training holds in memory for the whole run
        self.lengths: np.ndarray = np.diff(self.offsets).astype(np.int32) if lengths is None else lengths

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


class TokenizedData:
    """A folder written by `mtrain tokenize`, opened once. meta.json is read and checked here;
    the tokenizer, stats.json and each split load on first use (splits memory-mapped, so opening
    is instant for any corpus size). Every problem is a one-line error naming the file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.meta: dict[str, Any] = self._read_meta()

    def _read_meta(self) -> dict[str, Any]:
        path = self.path / "meta.json"
        if not path.is_file():
            raise MtrainError(
                f"{path}: not found; {self.path} is not a finished `mtrain tokenize` output — run "
                f"`mtrain tokenize --out {self.path}` (again, if it was interrupted)"
            )
        meta = self._read_json(path)
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
            found = meta.get("format") if isinstance(meta, dict) else None
            raise MtrainError(f"{path}: cache format {found} is not {FORMAT_VERSION}; re-run mtrain tokenize")
        return meta

    def _read_json(self, path: Path) -> Any:
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise MtrainError(f"{path}: damaged ({err}); re-run `mtrain tokenize --out {self.path}`") from None

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The folder's SentencePiece model(s), checked against what meta.json says made the ids."""
        tokenizer = Tokenizer.load(self.path, joint=self.meta["joint"])
        digests = self.meta.get("spm_sha256") or {}
        for side, name in zip(SIDES, ("spm.model",) * 2 if tokenizer.joint else ("spm.src.model", "spm.tgt.model")):
            model = getattr(tokenizer, side)
            if digests.get(side, model_digest(model.model)) != model_digest(model.model):
                raise MtrainError(f"{self.path / name}: not the SentencePiece model this folder was tokenized with "
                                  f"(its checksum differs from meta.json's); re-run `mtrain tokenize --out {self.path}`")
            if self.meta.get(f"{side}_vocab_size", model.vocab_size) != model.vocab_size:
                raise MtrainError(f"{self.path / 'meta.json'}: {side}_vocab_size {self.meta[f'{side}_vocab_size']} but "
                                  f"{name} has {model.vocab_size} pieces; re-run `mtrain tokenize --out {self.path}`")
        return tokenizer

    @functools.cached_property
    def stats(self) -> dict[str, Any]:
        """stats.json: cleaning counts and length statistics (the decoder's length ratio)."""
        path = self.path / "stats.json"
        if not path.is_file():
            raise MtrainError(f"{path}: not found; re-run mtrain tokenize --out {self.path}")
        return self._read_json(path)

    def split(self, name: str, mmap: bool = True) -> Split:
        """One tokenized split; ids are memory-mapped unless mmap is False."""
        if name not in self.meta["splits"]:
            raise MtrainError(
                f"{self.path}: no tokenized split {name!r} (it has {', '.join(self.meta['splits'])}); "
                f"re-run mtrain tokenize with --splits including {name}"
            )
        sides = []
        for side in SIDES:
            ids_path, off_path = self.path / f"{name}.{side}.ids.npy", self.path / f"{name}.{side}.offsets.npy"
            for path in (ids_path, off_path):
                if not path.is_file():
                    raise MtrainError(f"{path}: not found; re-run mtrain tokenize --out {self.path}")
            offsets = self._load_array(off_path, "r" if mmap else None)
            sides.append(Ragged(self._load_array(ids_path, "r" if mmap else None), offsets,
                                self._lengths(off_path, offsets)))
        if len(sides[0]) != len(sides[1]):
            raise MtrainError(f"{self.path}: {name} has {len(sides[0])} src but {len(sides[1])} tgt lines; "
                              "re-run mtrain tokenize")
        for side, ragged in zip(SIDES, sides):
            self._check_ragged(f"{name}.{side}", ragged)
        return Split(name, sides[0], sides[1], self.path)

    def _lengths(self, path: Path, offsets: np.ndarray) -> np.ndarray:
        """Sentence lengths (int32) from an offsets array, read through a file handle when it is
        memory-mapped (so its pages do not stay counted in the process's memory)."""
        pieces, last = [], None
        for chunk in _chunks(offsets):
            pieces.append(np.diff(chunk.astype(np.int64), prepend=[] if last is None else [last]))
            last = int(chunk[-1])
        lengths = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        if lengths.size and not (0 <= int(lengths.min()) and int(lengths.max()) < 2**31):
            raise MtrainError(f"{path}: does not index {path.name.replace('offsets', 'ids')} (a negative or huge "
                              f"length); the cache is damaged, re-run `mtrain tokenize --out {self.path}`")
        return lengths.astype(np.int32)

    def _check_ragged(self, stem: str, ragged: Ragged) -> None:
        """Offsets that index the ids array, ids within the vocabulary, and counts that agree with
        stats.json: a damaged or mismatched cache fails here, at start-up, not mid-run. One pass
        over the (memory-mapped) ids."""
        offsets, ids = ragged.offsets, ragged.ids
        fix = f"re-run `mtrain tokenize --out {self.path}`"
        if offsets.size == 0 or offsets[0] != 0 or offsets[-1] != ids.size or (ragged.lengths < 0).any():
            raise MtrainError(f"{self.path / f'{stem}.offsets.npy'}: does not index {stem}.ids.npy "
                              f"({ids.size} ids); the cache is damaged, {fix}")
        vocab = self.meta.get(f"{stem.rsplit('.', 1)[1]}_vocab_size")
        low, high = _min_max(ids) if ids.size and vocab is not None else (0, 0)
        if vocab is not None and not (0 <= low and high < vocab):
            raise MtrainError(f"{self.path / f'{stem}.ids.npy'}: ids outside the vocabulary of {vocab} pieces; "
                              f"the cache is damaged or mixed with another run's, {fix}")
        split, side = stem.rsplit(".", 1)
        entry = (self._stats_or_none() or {}).get("splits", {}).get(split)
        if entry is not None and (entry.get("lines"), entry.get(f"{side}_tokens", {}).get("total")) != (len(ragged), ids.size):
            raise MtrainError(f"{self.path / 'stats.json'}: says {split} has {entry.get('lines')} lines and "
                              f"{entry.get(f'{side}_tokens', {}).get('total')} {side} tokens, the cache "
                              f"{len(ragged)} and {ids.size}; {fix}")

    @property
    def corpora(self) -> list[dict[str, Any]]:
        """The training split's corpora in file order ({"name", "pairs", "tag", ...}); empty for a
        folder tokenized before corpora were recorded."""
        return list(self.meta.get("corpora") or [])

    def mixer(self, data: DataConfig, seed: int, split: Split) -> Optional["CorpusMixer"]:
        """The epoch mixer of data.weights for the training split, or None (no weights: every pair
        once an epoch). Weights that do not fit this folder's corpora are one line, before any work."""
        weights = self.check_weights(data, split.name)
        if not weights:
            return None
        names, sizes = [c["name"] for c in self.corpora], [int(c["pairs"]) for c in self.corpora]
        fix = f"re-run `mtrain tokenize --out {self.path}`"
        if sum(sizes) != len(split):
            raise MtrainError(f"{self.path / 'meta.json'}: its corpora hold {sum(sizes)} pairs but {split.name} has "
                              f"{len(split)}; {fix}")
        return CorpusMixer(sizes, [weights[name] for name in names], seed, names)

    def check_weights(self, data: DataConfig, split: str) -> dict[str, float]:
        """data.weights ({name: weight}), checked against the corpora this folder records for
        `split`: one line for a name it does not know, a corpus without a weight, a weight <= 0."""
        weights = corpus_weights(data)
        if weights and (not self.corpora or split != self.meta.get("train_split")):
            raise MtrainError(f"{self.path}: data.weights mixes the corpora of the training split, and this folder "
                              f"records none for {split!r}; re-run `mtrain tokenize --out {self.path}` with one "
                              "--data NAME=DIR per corpus")
        if weights:
            check_corpus_settings(data, [corpus["name"] for corpus in self.corpora])
        return weights

    def _stats_or_none(self) -> dict[str, Any] | None:
        return self.stats if (self.path / "stats.json").is_file() else None

    def _load_array(self, path: Path, mmap_mode: Optional[str] = None) -> np.ndarray:
        """np.load (never unpickling: allow_pickle stays False) with one-line errors for damaged files."""
        try:
            return np.load(path, mmap_mode=mmap_mode)
        except (ValueError, OSError, EOFError) as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise MtrainError(f"{path}: damaged ({first[:160]}); re-run `mtrain tokenize --out {self.path}`") from None


def _chunks(array: np.ndarray) -> Iterator[np.ndarray]:
    """A 1-D array in pieces; a memory-mapped one read through a file handle: touching the map
    itself would leave every page of it counted in the process's resident memory."""
    if not isinstance(array, np.memmap) or array.filename is None:
        yield from (array[start:start + CHECK_CHUNK] for start in range(0, array.size, CHECK_CHUNK))
        return
    with open(array.filename, "rb") as handle:
        handle.seek(array.offset)
        for start in range(0, array.size, CHECK_CHUNK):
            yield np.fromfile(handle, dtype=array.dtype, count=min(CHECK_CHUNK, array.size - start))


def _min_max(ids: np.ndarray) -> tuple[int, int]:
    """The smallest and largest id of an array (see _chunks)."""
    if ids.dtype.kind not in "iu":  # a damaged file: its values are checked as numbers
        return int(np.floor(ids.min())), int(np.ceil(ids.max()))
    low, high = np.iinfo(ids.dtype).max, np.iinfo(ids.dtype).min
    for chunk in _chunks(ids):
        low, high = min(low, int(chunk.min())), max(high, int(chunk.max()))
    return low, high


# ----------------------------------------------------------------------------------------------
# Mixing corpora
# ----------------------------------------------------------------------------------------------
def quotas(sizes: Sequence[int], weights: Sequence[float]) -> list[int]:
    """Pairs drawn from each corpus per epoch: the epoch keeps the corpus's total size, and corpus
    i's share is weights[i] / sum(weights), rounded by largest remainder (ties to the earlier
    corpus), so the quotas sum to the total and each is within 1 of its exact share."""
    total, weight_sum = int(sum(sizes)), float(sum(weights))
    exact = [total * w / weight_sum for w in weights]
    floors = [int(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (-(exact[i] - floors[i]), i))
    for i in by_remainder[: total - sum(floors)]:
        floors[i] += 1
    return floors


class CorpusMixer:
    """Epoch e of a training split made of several corpora laid end to end: corpus i contributes
    quotas[i] pairs: each of its pairs quota // size times, plus quota % size more taken in turn
    from an endless sequence of random permutations of the corpus (permutation k drawn from
    (seed, i, k)), epoch e taking the e-th slice. So no pair comes twice more than another in an
    epoch, and a down-weighted corpus shows every pair within its first size / (quota % size)
    epochs, rounded up. A pure function of (seed, epoch): a resumed run redraws the epoch it
    stopped in exactly."""

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], seed: int, names: Sequence[str] = ()) -> None:
        names = list(names) or [str(i) for i in range(len(sizes))]
        for name, size in zip(names, sizes):
            if size == 0:
                raise MtrainError(f"corpus {name!r} kept no training pairs, so data.weights cannot mix it in; "
                                  "tokenize without it")
        self.sizes, self.seed = [int(n) for n in sizes], seed
        self.starts = np.cumsum([0, *self.sizes])[:-1]
        self.quotas = quotas(self.sizes, weights)

    def __call__(self, epoch: int) -> np.ndarray:
        """The indices (into the whole split, sorted, repeats allowed) that make up epoch `epoch`."""
        parts = []
        for i, (start, size, quota) in enumerate(zip(self.starts, self.sizes, self.quotas)):
            repeats, extra = divmod(quota, size)
            parts.append(np.repeat(np.arange(size, dtype=np.int64), repeats) + start)
            parts.append(self._turn(i, size, (epoch - 1) * extra, extra) + start)
        return np.sort(np.concatenate(parts), kind="stable")

    def _turn(self, corpus: int, size: int, first: int, count: int) -> np.ndarray:
        """Items first .. first + count - 1 (count < size) of the corpus's endless sequence of
        permutations. A slice that runs past the end of permutation k goes on with the pairs of
        permutation k + 1 that the slice does not hold yet, so no pair comes twice in an epoch."""
        k, at = divmod(first, size)
        head = self._permutation(corpus, size, k)[at:at + count]
        if head.size == count:
            return head
        rest = self._permutation(corpus, size, k + 1)
        return np.concatenate([head, rest[~np.isin(rest, head)][:count - head.size]])

    def _permutation(self, corpus: int, size: int, k: int) -> np.ndarray:
        return np.random.default_rng([self.seed, corpus, k]).permutation(size)


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
        src = self.tokenizer.src.sample(self.text[0], self.alpha, src_seed)
        tgt = self.tokenizer.tgt.sample(self.text[1], self.alpha, tgt_seed)
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

    sorted_cost = cost[order]
    if not allow_oversize and sorted_cost.size and sorted_cost[-1] > max_tokens:
        first = int(np.searchsorted(sorted_cost, max_tokens, side="right"))
        index, too_many = int(order[first]), int(sorted_cost[first])
        raise MtrainError(
            f"sentence {index} has {too_many} tokens with EOS, more than max_tokens={max_tokens}; "
            f"raise train.max_tokens to at least {too_many} or lower data.max_len and re-tokenize"
        )
    batches = [order[start:end] for start, end in _cuts(sorted_cost, max_tokens)]
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def _cuts(sorted_cost: np.ndarray, max_tokens: int) -> Iterator[tuple[int, int]]:
    """Greedy batches over ascending costs: a batch from `start` ends before the first i where
    (i + 1 - start) * cost[i] > max_tokens (the newest sentence is the longest, so that is the
    batch's padded size). Since cost[i] >= cost[start], that i is at most start + max(1,
    max_tokens // cost[start]): each batch searches that window only, so a corpus of millions
    takes one small numpy step per batch instead of a Python step per sentence. A sentence over
    the budget gets a batch of its own."""
    n, start = sorted_cost.size, 0
    while start < n:
        stop = min(n, start + max(1, max_tokens // int(sorted_cost[start])) + 1)
        candidates = np.arange(start + 1, stop)
        over = np.flatnonzero((candidates + 1 - start) * sorted_cost[start + 1 : stop] > max_tokens)
        end = int(candidates[over[0]]) if over.size else stop
        yield start, end
        start = end


def _gather(ragged: Ragged, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The concatenated ids of the chosen sentences and their lengths, in one fancy-index read
    (slicing a memory map sentence by sentence is ~100x slower)."""
    lengths = ragged.lengths[indices]
    row_start = np.cumsum(lengths) - lengths  # where each sentence starts in the gathered array
    positions = np.repeat(ragged.offsets[indices] - row_start, lengths) + np.arange(int(lengths.sum()))
    return np.asarray(ragged.ids[positions], dtype=np.int64), lengths


def _pad_rows(values: np.ndarray, lengths: np.ndarray, width: int, shift: int) -> np.ndarray:
    """Rows of PAD with sentence i's ids in columns shift .. shift + lengths[i] - 1."""
    out = np.full((lengths.size, width), PAD_ID, dtype=np.int64)
    columns = np.arange(width)
    out[(columns >= shift) & (columns < lengths[:, None] + shift)] = values  # row-major = concatenation order
    return out


def collate(split: Split, indices: Sequence[int], device: Any = None,
            max_len: int | None = None) -> tuple[torch.Tensor, ...]:
    """Padded LongTensors (src, tgt_in, tgt_out): src = ids + EOS, tgt_in = BOS + ids, tgt_out = ids + EOS.
    max_len: at most that many positions per side, a cut sequence still ending in EOS (validation of
    uncleaned text, where one huge line would otherwise need attention over all of it)."""
    indices = np.asarray(indices, dtype=np.int64)
    rows = np.arange(indices.size)
    src_ids, src_len = _gather(split.src, indices)
    tgt_ids, tgt_len = _gather(split.tgt, indices)
    src = _pad_rows(src_ids, src_len, int(src_len.max(initial=0)) + 1, 0)
    src[rows, src_len] = EOS_ID
    tgt_width = int(tgt_len.max(initial=0)) + 1
    tgt_in = _pad_rows(tgt_ids, tgt_len, tgt_width, 1)
    tgt_in[:, 0] = BOS_ID
    tgt_out = _pad_rows(tgt_ids, tgt_len, tgt_width, 0)
    tgt_out[rows, tgt_len] = EOS_ID
    if max_len is not None:
        src, tgt_in, tgt_out = _cut(src, src_len, max_len), tgt_in[:, :max_len], _cut(tgt_out, tgt_len, max_len)
    tensors = tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in (src, tgt_in, tgt_out))
    if device is not None:
        tensors = tuple(t.to(device, non_blocking=True) for t in tensors)
    return tensors


def _cut(padded: np.ndarray, lengths: np.ndarray, width: int) -> np.ndarray:
    """The first `width` columns of ids + EOS rows; a row cut short ends in EOS."""
    if padded.shape[1] <= width:
        return padded
    out = padded[:, :width].copy()
    out[lengths >= width, width - 1] = EOS_ID
    return out


# ----------------------------------------------------------------------------------------------
# The training stream
# ----------------------------------------------------------------------------------------------


def target_tokens(tgt_lengths: np.ndarray, batches: list[np.ndarray], max_len: int | None = None) -> int:
    """Loss-bearing target tokens of some batches: each sentence's pieces plus its EOS (at most
    max_len of them, as collate(max_len=...) cuts)."""
    if max_len is not None:
        tgt_lengths = np.minimum(tgt_lengths, max_len - 1)
    return int(sum(int(tgt_lengths[b].sum()) + len(b) for b in batches))


def stream_target_tokens(batches: list["Batch"]) -> int:
    """target_tokens of stream batches, each counted in the split of its own epoch."""
    return sum(target_tokens(b.split.tgt.lengths, [b.indices]) for b in batches)


class Batch(NamedTuple):
    """A training batch: sentence indices into the split of the epoch it was drawn from."""

    split: Split
    indices: np.ndarray


class BatchStream:
    """The endless sequence of training batches: epoch e's bucketed batch list (shuffled from
    (seed, e)), then epoch e+1's. (epoch, index) is the whole position, so resume is exact.
    With a sampler (subword sampling), epoch e's batches index the split sampler(e) returns;
    with a mixer (corpora mixed by weight), they hold the pairs mixer(e) chose."""

    def __init__(self, split: Split, max_tokens: int, seed: int, epoch: int = 1, index: int = 0,
                 sampler: Callable[[int], Split] | None = None,
                 mixer: Callable[[int], np.ndarray] | None = None) -> None:
        self.split, self.max_tokens, self.seed, self.sampler, self.mixer = split, max_tokens, seed, sampler, mixer
        self.epoch, self.index = epoch, index
        self._cached: tuple[int, Split, list[np.ndarray]] | None = None

    def _load(self, epoch: int) -> tuple[Split, list[np.ndarray]]:
        if self._cached is None or self._cached[0] != epoch:
            split = self.split if self.sampler is None else self.sampler(epoch)
            src_lengths, tgt_lengths = split.src.lengths, split.tgt.lengths
            chosen = None if self.mixer is None else self.mixer(epoch)
            if chosen is not None:
                src_lengths, tgt_lengths = src_lengths[chosen], tgt_lengths[chosen]
            batches = make_batches(src_lengths, tgt_lengths, self.max_tokens, seed=self.seed, epoch=epoch, shuffle=True)
            if chosen is not None:
                batches = [chosen[batch] for batch in batches]
            if not batches:
                raise MtrainError("training split is empty; check the tokenized data folder (mtrain tokenize)")
            self._cached = (epoch, split, batches)
        return self._cached[1], self._cached[2]

    def batches(self, epoch: int) -> list[np.ndarray]:
        return self._load(epoch)[1]

    def split_of(self, epoch: int) -> Split:
        return self._load(epoch)[0]

    def take(self, n: int) -> list[Batch]:
        out = []
        while len(out) < n:
            split, batches = self._load(self.epoch)
            if self.index >= len(batches):
                self.epoch, self.index = self.epoch + 1, 0
                continue
            out.append(Batch(split, batches[self.index]))
            self.index += 1
        return out
