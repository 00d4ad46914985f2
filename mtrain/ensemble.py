"""Several checkpoints decoding as one model (an ensemble).

At each step the ensemble's next-token distribution is the mean of its models' distributions,
p(y | x, prefix) = (1/M) sum_m p_m(y | x, prefix), the usual NMT ensemble (fairseq and Marian
average probabilities too). `Ensemble` is a `mtrain.search.Decoder` (encode, new_cache,
decode, cfg), so greedy and beam search run unchanged; decode returns log-probabilities, which they
treat as logits (a log_softmax of log-probabilities changes nothing). Like a Transformer it also
splits decode into decode_states and project, so searches mix the members' distributions block by
block of rows. Each model keeps its own encoder output and KV cache; the ensemble indexes and
reorders them together.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable

import torch
from torch import Tensor

from mtrain.cache import KVCache
from mtrain.reductions import PLAIN, Reductions


class PerModel:
    """One tensor per model: the encoder outputs, or the decoder states. Indexing applies to every
    model's alike: a search dropping finished sentences (`memory[rows]`), step_logits taking the
    last position and then a block of rows."""

    def __init__(self, parts: Iterable[Tensor]) -> None:
        self.parts = list(parts)

    def __getitem__(self, index) -> PerModel:
        return PerModel(part[index] for part in self.parts)

    def size(self, dim: int) -> int:
        return self.parts[0].size(dim)


class EnsembleCache:
    """One KV cache per model, expanded to beams and reordered in step."""

    def __init__(self, caches: list[KVCache]) -> None:
        self.caches = caches

    def expand_beams(self, group: int) -> EnsembleCache:
        return EnsembleCache([cache.expand_beams(group) for cache in self.caches])

    def reorder(self, index: Tensor, cross: bool = True) -> None:
        for cache in self.caches:
            cache.reorder(index, cross=cross)

    def reserve(self, length: int) -> None:
        for cache in self.caches:
            if hasattr(cache, "reserve"):
                cache.reserve(length)


class Ensemble:
    """Models that share one target vocabulary, decoding as one (see the module docstring)."""

    reductions: Reductions = PLAIN  # search's, over the mean's log-probs (mtrain.reductions)

    def __init__(self, models: list) -> None:
        if not models:
            raise ValueError("an ensemble needs at least one model")
        sizes = {model.cfg.vocab_size for model in models}
        if len(sizes) > 1:
            raise ValueError(f"ensemble members have different target vocabulary sizes: {sorted(sizes)}")
        self.models = list(models)
        # translate cuts inputs to cfg.max_len - 1 tokens: the tightest member's limit holds for all.
        self.cfg = dataclasses.replace(models[0].cfg, max_len=min(model.cfg.max_len for model in models))

    def encode(self, src: Tensor) -> PerModel:
        return PerModel(model.encode(src) for model in self.models)

    def new_cache(self, group: int = 1) -> EnsembleCache:
        return EnsembleCache([model.new_cache(group) for model in self.models])

    def decode_states(self, tgt: Tensor, memory: PerModel, src: Tensor, cache: EnsembleCache | None = None) -> PerModel:
        """(B, t) target ids -> each model's final decoder states (B, t, d_model)."""
        caches = cache.caches if cache is not None else [None] * len(self.models)
        return PerModel(model.decode_states(tgt, part, src, c) for model, part, c in zip(self.models, memory.parts, caches))

    def project(self, states: PerModel) -> Tensor:
        """Each model's states (..., d_model) -> float32 log of the mean of the members'
        probabilities (..., V). Searches call it block by block of rows (mtrain.search.step_logits), as
        for one model: each member's logits and log-probs then stay a few MB, where for all rows at
        once (beam 5 on a 4096-token batch: 1365 x 8000) every pass went to memory, and one float32
        matmul that tall ran 1.6x slower than the same rows in blocks (AVX2 EPYC, benchmarks/results/NOTES.md)."""
        mixture = None
        for model, part in zip(self.models, states.parts):
            log_probs = torch.log_softmax(model.project(part).float(), dim=-1)
            # log(p + q) = logaddexp(log p, log q): one fused elementwise pass that keeps tiny
            # probabilities finite. A logsumexp over the stacked members took ~15x as long in a
            # beam-5 CPU profile (1.9 s with the stacking, against 0.13 s).
            mixture = log_probs if mixture is None else torch.logaddexp(mixture, log_probs, out=mixture)
        return mixture.sub_(math.log(len(self.models)))

    def decode(self, tgt: Tensor, memory: PerModel, src: Tensor, cache: EnsembleCache | None = None) -> Tensor:
        """(B, t) target ids -> float32 log of the mean of the members' probabilities (B, t, V)."""
        return self.project(self.decode_states(tgt, memory, src, cache))
