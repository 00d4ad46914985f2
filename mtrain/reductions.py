"""What search and the training loss reduce over each row of (N, V) logits: the k best values with
the row's log-normaliser, the argmax, and the loss's per-row sums and gradient.

`PLAIN` does each with PyTorch's ops, on any device. A model's `reductions` names the ones search and
the loss use for it (`reductions_of`): the paper model's are PLAIN; a CPU model's may be a subclass
that gives the same values in fewer passes over the logits (mtrain.cpu.reductions, chosen where the
model is prepared for training or decoding)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

NEG_INF = float("-inf")


def logsumexp_(x: Tensor, peak: Tensor) -> Tensor:
    """(N, V) -> (N, 1) log sum exp of each row, computed in place in x (which is overwritten).
    peak (N, 1) = the row maxima: subtracted first, so exp cannot overflow."""
    peak = peak.masked_fill(~peak.isfinite(), 0.0)  # a row of -inf: log 0 = -inf, not NaN
    return x.sub_(peak).exp_().sum(dim=1, keepdim=True).log_().add_(peak)


class Reductions:
    """The row reductions, each as PyTorch's ops compute it. A subclass may return a result
    (or take a case) where it has a faster way; the values stay these to float rounding."""

    # The loss projects its real target rows rounded up to a multiple of this many rows (zero
    # states, whose logits it skips), for matmul kernels that prefer such shapes.
    row_multiple = 1

    def unshifted_sums(self, device: torch.device) -> bool:
        """Whether the loss may sum exp(logits) without the row maxima subtracted first (it then
        redoes the rows where that could over- or underflow; mtrain.loss.PLAIN_LSE_RANGE)."""
        return False

    def keeps_bfloat16(self, block: Tensor) -> bool:
        """Whether search may hand this bfloat16 block of logits to topk_logsumexp and argmax as it
        is, without a float32 copy."""
        return False

    def topk_logsumexp(self, logits: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
        """(n, V) logits -> their k largest values per row (n, k), best first, in float32, those
        values' ids (n, k), and each row's float32 log sum exp (n, 1). Overwrites the logits."""
        logits = logits.float()
        top, ids = logits.topk(k, dim=1)
        return top, ids, logsumexp_(logits, peak=top[:, :1].clone())

    def argmax(self, scores: Tensor) -> Tensor:
        """(n, V) -> (n,) each row's index of its maximum, the first of equal maxima."""
        return scores.argmax(dim=1)

    def cross_entropy_sums(self, logits: Tensor, sums: Tensor, means: Tensor | None) -> bool:
        """Where it has a faster way: each row's sum of exp(logits) into sums, and its mean into
        means (when given); returns whether it did (False: the loss computes them itself)."""
        return False

    def cross_entropy_gradient_(self, logits: Tensor, lse: Tensor, target: Tensor, g: float, eps: float) -> bool:
        """Where it has a faster way: the label-smoothed loss's gradient g * (softmax - q) written
        over the logits; returns whether it did (False: the loss computes it itself)."""
        return False


PLAIN = Reductions()


def reductions_of(model: Any) -> Reductions:
    """The reductions search and the loss use for `model`: its own, or PLAIN."""
    return getattr(model, "reductions", PLAIN)
