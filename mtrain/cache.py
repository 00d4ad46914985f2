"""Decoding state for `Transformer.decode`: per decoder layer, the self-attention keys and values
of the tokens fed so far and the cross-attention keys and values of the source (computed once).

Two layouts. `KVCache` (one target row per source row: greedy search, the first step of beam
search) appends each call's K/V along the time axis and applies row reorders lazily. `BeamCache`
(G target rows per source row: beam search) stores cross-attention K/V once per source and never
moves self-attention K/V: the key of beam g at step s sits in slot s * G + g of its source's row,
and each beam attends through an ancestry mask to its own ancestors' slots, so a beam reorder
rewrites a small table instead of copying every layer's K/V. The attention modules see neither
layout: they hand their queries, keys and values to the layer cache and attend with what it
returns, or take the cache's own attention (`LayerCache.attention`) where it has one.

Keys and values are kept as they come, and the modules attend with mtrain.attention. A model's
`cache_layers` names the layer caches its caches are made of: a CPU decoding copy takes
mtrain.cpu.cache's, which keep them as the CPU attends fastest.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor


class LayerCache:
    """One decoder layer's K/V. Self-attention ones sit in (B, H, capacity, d_head) buffers whose
    first `filled` positions hold the tokens fed so far; each call writes its new positions in place
    and the buffers grow by doubling, so a step copies one position, not the whole history (a
    torch.cat per step would copy all of it). Cross-attention ones are (B, H, S, d_head)."""

    def __init__(self) -> None:
        self.self_k: Tensor | None = None
        self.self_v: Tensor | None = None
        self.filled = 0
        self.reserved = 0  # positions the first buffers hold at least (KVCache.reserve)
        self.cross_k: Tensor | None = None
        self.cross_v: Tensor | None = None
        # A row reorder of self_k/self_v not applied yet: the next append applies it while it
        # copies into a new buffer (rows only change when search drops finished sentences).
        self.order: Tensor | None = None

    def fold(self, x: Tensor) -> Tensor:
        """(B, H, t, d_head) per-row heads -> the layout attention runs in (here: unchanged)."""
        return x

    def self_attention(self, q: Tensor, k: Tensor, v: Tensor,
                       mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """This call's (B, H, t, d_head) q, k, v -> (queries, every key and value so far, mask)."""
        keys, values = self.append(k, v)
        return q, keys, values, mask

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write (rows, H, t, d_head) k and v after the filled positions (applying a pending row
        reorder first); return the keys and values of every position so far: (rows, H, positions,
        d_head) views."""
        start, end = self.filled, self.filled + k.size(2)
        grow = self.self_k is None or self.capacity() < end
        if grow or self.order is not None:
            capacity = max(32, 2 * end, self.reserved) if grow else self.capacity()
            dtype = self.kept_dtype(k)
            self.self_k = _regrow(self.self_k, k, capacity, start, self.order, dtype)
            self.self_v = _regrow(self.self_v, v, capacity, start, self.order, dtype)
            self.order = None
        self.self_k[:, :, start:end] = k
        self.self_v[:, :, start:end] = v
        self.filled = end
        return self.self_k[:, :, :end], self.self_v[:, :, :end]

    def kept_dtype(self, k: Tensor) -> torch.dtype:
        """The dtype keys and values like k are kept in: theirs."""
        return k.dtype

    def inherit(self, old: LayerCache) -> None:
        """Take what `old` (the plain cache of beam search's first step) decided about its keys."""

    def capacity(self) -> int:
        """The positions the self-attention buffers hold."""
        return self.self_v.size(2)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor | None:
        """The cache's own attention of q over the keys k and values v it returned, or None: the
        caller attends (mtrain.attention)."""
        return None

    def cross_attention(self, q: Tensor, memory: Tensor,
                        memory_kv: Callable[[Tensor], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
        """(queries, keys, values) over the source; memory_kv runs on the first call only."""
        if self.cross_k is None:
            k, v = memory_kv(memory)
            dtype = self.kept_dtype(k)
            self.cross_k, self.cross_v = stored(k, dtype), stored(v, dtype)
        return self.fold(q), self.cross_k, self.cross_v

    def reorder(self, index: Tensor, source: Tensor | None) -> None:
        """Target row i becomes old row index[i]; source rows follow `source` when given."""
        self.order = index if self.order is None else self.order.index_select(0, index)
        if source is not None and self.cross_k is not None:
            self.cross_k, self.cross_v = self.cross_k.index_select(0, source), self.cross_v.index_select(0, source)


class BeamLayerCache(LayerCache):
    """One decoder layer's K/V in the beam layout (module docstring): self_k/self_v are
    (B / G, H, G * capacity, d_head) and grow by doubling; `beam_mask` is set by BeamCache."""

    def __init__(self, group: int) -> None:
        super().__init__()
        self.group = group
        self.beam_mask: Tensor | None = None  # (B / G, 1, G, G * steps)

    def fold(self, x: Tensor) -> Tensor:
        """(B, H, 1, d_head) -> (B / G, H, G, d_head): one source's G beams side by side (a view)."""
        return x.unflatten(0, (-1, self.group)).transpose(1, 2).flatten(2, 3)

    def self_attention(self, q: Tensor, k: Tensor, v: Tensor,
                       mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        # This step's (B / G, H, G, d_head) keys and values take the next G slots: s * G + g.
        keys, values = self.append(self.fold(k), self.fold(v))
        return self.fold(q), keys, values, self.beam_mask

    def reorder(self, index: Tensor, source: Tensor | None) -> None:
        """Self-attention K/V stay in their slots (BeamCache moves the ancestry); only dropping
        sources touches them."""
        if source is None:
            return
        for name in ("self_k", "self_v", "cross_k", "cross_v"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).index_select(0, source))


def stored(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x in dtype, contiguous: the cross-attention K/V come as views of one fused projection, which
    every step's matmul would otherwise copy."""
    return x.to(dtype=dtype, memory_format=torch.contiguous_format)


def _regrow(old: Tensor | None, like: Tensor, capacity: int, filled: int, order: Tensor | None,
            dtype: torch.dtype) -> Tensor:
    """A (rows, H, capacity, d_head) buffer in dtype holding the first `filled` positions of old, its
    rows in `order` when given (index_select writes straight into the new buffer)."""
    rows, heads, _, width = like.shape
    out = like.new_empty(rows, heads, capacity, width, dtype=dtype)
    if old is not None and filled:
        if order is None:
            out[:, :, :filled].copy_(old[:, :, :filled])
        else:
            torch.index_select(old[:, :, :filled], 0, order, out=out[:, :, :filled])
    return out


class CacheLayers(NamedTuple):
    """The layer caches a model's caches are made of, one per layout."""

    plain: type[LayerCache]
    beam: type[BeamLayerCache]


class KVCache:
    """The plain layout: one target row per source row; `length` = target tokens seen."""

    group = 1

    def __init__(self, n_layers: int, kinds: CacheLayers | None = None) -> None:
        self.kinds = kinds or PLAIN
        self.layers: list[LayerCache] = [self.kinds.plain() for _ in range(n_layers)]
        self.length = 0
        self.reserved = 0
        self.src_mask: Tensor | None = None  # (B, 1, 1, S) key mask, fixed on the first call

    def begin(self, tokens: Tensor) -> None:
        """Called by the decoder before it reads `tokens` (B, t), the new tokens of each row."""

    def reserve(self, length: int) -> None:
        """Room for `length` target tokens per row from the first call on: a search that knows its
        longest output makes the self-attention buffers that long at once instead of doubling
        them, each doubling a copy of every layer's keys and values into fresh memory (in bfloat16
        beam 5 at the decoding benchmark's shapes, 5.5 ms for one layer's 256 x 4 x 70 x 64 keys
        and values; reserving decoded bfloat16 beam 5 1.03-1.10x as fast, benchmarks/results/intel-xeon-amx/NOTES.md)."""
        self.reserved = length
        for layer in self.layers:
            layer.reserved = length * self.group

    def source_rows(self, index: Tensor) -> Tensor:
        """The source row each new target row reads, for a target reorder `index`."""
        return index

    def reorder(self, index: Tensor, cross: bool = True) -> None:
        """Keep/duplicate/permute target rows (search): row i becomes old row index[i].

        Per-source state (cross-attention K/V, source mask) follows source_rows(index), which
        assumes each new group of rows comes from one old group. cross=False leaves it as it is:
        exact when index only moves rows among rows of one source (beams of one sentence), and it
        saves copying it at every beam-search step."""
        source = self.source_rows(index) if cross else None
        for layer in self.layers:
            layer.reorder(index, source)
        if source is not None and self.src_mask is not None:
            self.src_mask = self.src_mask.index_select(0, source)

    def expand_beams(self, group: int) -> KVCache:
        """This plain cache after one step with one row per source -> a beam cache in which each
        source has `group` identical beams (rows r * group .. r * group + group - 1). Beam search
        runs its first step, where every beam is the same BOS prefix, once per sentence instead of
        once per beam. Cross-attention K/V and the source mask are shared."""
        if self.length != 1:
            raise ValueError(f"expand_beams needs a plain cache after one step, got length={self.length}")
        if group == 1:  # one beam per source is the plain layout
            return self
        out = BeamCache(len(self.layers), group, self.kinds)
        out.reserve(self.reserved)
        out.src_mask = self.src_mask
        for old, new in zip(self.layers, out.layers):
            new.cross_k, new.cross_v = old.cross_k, old.cross_v
            new.inherit(old)
            # step 0's (sources, H, 1, d_head) keys and values, broadcast to the slots of all G beams
            new.append(old.self_k[:, :, :1].expand(-1, -1, group, -1), old.self_v[:, :, :1].expand(-1, -1, group, -1))
        out.record_step(old.self_v.shape[0] * group, old.self_v.device)  # each beam its own step-0 ancestor
        out.length = 1
        return out


class BeamCache(KVCache):
    """The beam layout (module docstring): target row r belongs to source row r // group, and
    decode is given memory/src with one row per source."""

    def __init__(self, n_layers: int, group: int, kinds: CacheLayers | None = None) -> None:
        super().__init__(0, kinds)
        self.group = group
        self.layers: list[BeamLayerCache] = [self.kinds.beam(group) for _ in range(n_layers)]
        # ancestry[r, s] = the beam (0..G-1) within its source of row r's ancestor at step s
        self.ancestry: Tensor | None = None

    def begin(self, tokens: Tensor) -> None:
        if tokens.shape[1] != 1:
            raise ValueError(f"a beam-search cache (group={self.group}) takes one token per call, got {tokens.shape[1]}")
        self.record_step(tokens.shape[0], tokens.device)

    def record_step(self, rows: int, device: torch.device) -> None:
        """Before one new token per row: record each row as its own ancestor at this step and give
        every layer the mask (rows / G, 1, G, G * steps) of its ancestors' slots."""
        G, t = self.group, self.length
        if self.ancestry is None or self.ancestry.size(1) == t:
            grown = torch.empty(rows, max(32, 2 * t), dtype=torch.long, device=device)
            if self.ancestry is not None:
                grown[:, :t] = self.ancestry
            self.ancestry = grown
        beams = torch.arange(G, device=device)
        self.ancestry[:, t] = beams.repeat(rows // G)
        mask = (self.ancestry[:, : t + 1, None] == beams).view(rows // G, 1, G, (t + 1) * G)
        for layer in self.layers:
            layer.beam_mask = mask

    def source_rows(self, index: Tensor) -> Tensor:
        return index[:: self.group] // self.group

    def reorder(self, index: Tensor, cross: bool = True) -> None:
        if self.ancestry is not None:
            self.ancestry = self.ancestry.index_select(0, index)
        super().reorder(index, cross)

    def expand_beams(self, group: int) -> KVCache:
        raise ValueError(f"expand_beams needs a plain cache after one step, got group={self.group}")


PLAIN = CacheLayers(LayerCache, BeamLayerCache)
