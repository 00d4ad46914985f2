"""A CPU decoding copy's caches: keys and values kept as a CPU attends over them fastest.

Where mtrain.cpu.native loads, a bfloat16 model's keys and values stay bfloat16, as its attention
kernel reads them, and the cache attends with that kernel (more than 8 queries a row, or a causal
prefix, go to mtrain.attention). Elsewhere a bfloat16 model's keys are upcast to float32 once, when
stored: attention on a CPU runs in float32 anyway (mtrain.cpu.attention), and in a bfloat16 beam-5
profile upcasting them at every step that read them was a quarter of the time. Float32 models keep
theirs as they come. `for_decoding(model)` makes a model's caches of these layers, and gives it the
CPU's row reductions for search (mtrain.cpu.reductions)."""

from __future__ import annotations

import torch
from torch import Tensor

from mtrain.attention import attend
from mtrain.cache import BeamLayerCache, CacheLayers, LayerCache
from mtrain.cpu import native
from mtrain.cpu.ops import on_fast_cpu
from mtrain.cpu.reductions import CPU as CPU_REDUCTIONS


class _CPUKeys:
    """What the CPU layer caches add to mtrain.cache's: the dtype keys are kept in and the kernel."""

    native: bool | None = None  # keys kept bfloat16 for the kernel (decided by the first keys stored)

    def kept_dtype(self, k: Tensor) -> torch.dtype:
        if self.native is None:
            self.native = native.wanted(k)
        if self.native:
            return k.dtype
        return torch.float32 if on_fast_cpu(k) and k.dtype == torch.bfloat16 else k.dtype

    def inherit(self, old: LayerCache) -> None:
        self.native = getattr(old, "native", None)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor | None:
        if not self.native:
            return None
        y = None if is_causal else native.attend(q, k, v, mask)
        return attend(q, k, v, mask, 0.0, is_causal) if y is None else y


class CPULayerCache(_CPUKeys, LayerCache):
    """mtrain.cache.LayerCache, its keys kept as the CPU attends over them fastest."""


class CPUBeamLayerCache(_CPUKeys, BeamLayerCache):
    """mtrain.cache.BeamLayerCache, its keys kept as the CPU attends over them fastest."""


CPU = CacheLayers(CPULayerCache, CPUBeamLayerCache)


def for_decoding(model):
    """`model` (each member of an ensemble) with caches of the CPU layer caches, and the model with
    the CPU's reductions, where the stand-ins run (MTRAIN_CPU_FAST); returns it."""
    members = getattr(model, "models", None) or [model]
    for member in members:
        if hasattr(member, "cache_layers") and fast_on(member):
            member.cache_layers = CPU
    if any(fast_on(member) for member in members):
        model.reductions = CPU_REDUCTIONS
    return model


def fast_on(model) -> bool:
    """Whether the model's weights are on a CPU where the stand-ins run."""
    weight = next(model.parameters(), None)
    return weight is not None and on_fast_cpu(weight)
