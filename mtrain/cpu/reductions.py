"""mtrain.reductions on a CPU, in fewer passes over the logits.

float32 logits: top-k and argmax by chunk maxima first (ops.topk_rows, ops.argmax_rows), and the
loss's sums of exp without the row maxima. bfloat16 logits, where mtrain.cpu.native loads: its C
kernels read each row once, with no float32 copy, for search's top-k with log-sum-exp and argmax, and
for the loss's sums and gradient. A training model on a CPU takes these (mtrain.cpu.model), and so
does a CPU decoding copy (mtrain.cpu.cache.for_decoding)."""

from __future__ import annotations

import torch
from torch import Tensor

from mtrain.cpu import native
from mtrain.cpu.ops import argmax_rows, topk_rows
from mtrain.cpu.packing import ROW_MULTIPLE
from mtrain.reductions import Reductions, logsumexp_


class CPUReductions(Reductions):
    """mtrain.reductions.Reductions with the CPU's faster ways (the module docstring)."""

    row_multiple = ROW_MULTIPLE  # mtrain.cpu.packing: oneDNN's bfloat16 kernels at 64-row shapes

    def unshifted_sums(self, device: torch.device) -> bool:
        return device.type == "cpu"  # two passes fewer per chunk; rare out-of-range rows are redone

    def keeps_bfloat16(self, block: Tensor) -> bool:
        return block.device.type == "cpu" and native.library() is not None

    def topk_logsumexp(self, logits: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
        fused = native.topk_logsumexp(logits, k) if logits.dtype == torch.bfloat16 else None
        if fused is not None:
            return fused
        logits = logits.float()
        top, ids = topk_rows(logits, k)
        return top, ids, logsumexp_(logits, peak=top[:, :1].clone())

    def argmax(self, scores: Tensor) -> Tensor:
        if scores.dtype == torch.bfloat16:
            fused = native.topk_logsumexp(scores, 1, normaliser=False)
            return fused[1].squeeze(1) if fused is not None else argmax_rows(scores.float())
        return argmax_rows(scores)

    def cross_entropy_sums(self, logits: Tensor, sums: Tensor, means: Tensor | None) -> bool:
        return native.cross_entropy_sums(logits, sums, means)

    def cross_entropy_gradient_(self, logits: Tensor, lse: Tensor, target: Tensor, g: float, eps: float) -> bool:
        return native.cross_entropy_gradient_(logits, lse, target, g, eps)


CPU = CPUReductions()
