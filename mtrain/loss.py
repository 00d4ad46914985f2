"""Label-smoothed cross-entropy (Szegedy et al. 2016), the paper's training loss, plus the
plain NLL for logging. Only real target positions are passed in, so no pad masking here.

Convention: the smoothed target puts 1 - eps on the reference token and spreads eps uniformly
over ALL V classes (the reference and pad included), i.e. q = (1 - eps) * onehot + eps / V.
This is `torch.nn.functional.cross_entropy(..., label_smoothing=eps)`'s convention:
    loss = (1 - eps) * (-log p[y]) + eps * mean_k(-log p[k]).
With lse = log sum_k exp(x_k), -log p[k] = lse - x_k, so per position
    loss = lse - (1 - eps) * x_y - eps * mean_k(x_k),   d loss / d x = softmax(x) - q.
"""

from __future__ import annotations

import torch
from torch import Tensor


def label_smoothed_loss(logits: Tensor, target: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Summed label-smoothed loss and summed NLL over N positions.

    logits: (N, V) at real (non-pad) target positions; target: (N,) reference ids.
    Returns (loss_sum, nll_sum), float32 scalars; divide by the token count for per-token values.
    Only loss_sum carries a gradient (nll_sum is for logging)."""
    return _SmoothedCrossEntropy.apply(logits, target, eps)


class _SmoothedCrossEntropy(torch.autograd.Function):
    """The loss in closed form (module docstring), with a hand-written backward.

    Autograd through log_softmax, gather and mean makes ~6 passes over the (N, V) logits in the
    backward alone (an expanded mean gradient, a zero-filled gather gradient, their sum, the
    log_softmax backward); the closed form needs one exp pass and two in-place ones. At V = 8000
    the logits are the largest activation of a small model, so this is a few % of a CPU step."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        x = logits if logits.dtype == torch.float64 else logits.float()  # float32 even under autocast
        lse = torch.logsumexp(x, dim=-1)  # (N,)
        nll = lse - x.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (N,) -log p[y]
        nll_sum = nll.sum()
        if eps == 0.0:
            loss_sum = nll_sum.clone()  # a separate output: nll_sum is marked non-differentiable
        else:
            loss_sum = (1.0 - eps) * nll_sum + eps * (lse - x.mean(dim=-1)).sum()
        ctx.save_for_backward(x, lse, target)
        ctx.eps, ctx.dtype = eps, logits.dtype
        ctx.mark_non_differentiable(nll_sum)
        return loss_sum, nll_sum

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor) -> tuple[Tensor, None, None]:
        x, lse, target = ctx.saved_tensors
        eps = ctx.eps
        grad = torch.sub(x, lse.unsqueeze(-1)).exp_()  # softmax(x)
        if eps:
            grad.sub_(eps / x.size(-1))
        rows = torch.arange(x.size(0), device=x.device)
        grad[rows, target] -= 1.0 - eps
        return grad.mul_(grad_loss).to(ctx.dtype), None, None
