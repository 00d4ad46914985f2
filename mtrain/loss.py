"""Label-smoothed cross-entropy (Szegedy et al. 2016), the paper's training loss, plus the
plain NLL for logging. Only real target positions are passed in, so no pad masking here.

Convention: the smoothed target puts 1 - eps on the reference token and spreads eps uniformly
over ALL V classes (the reference and pad included), i.e. q = (1 - eps) * onehot + eps / V.
This is `torch.nn.functional.cross_entropy(..., label_smoothing=eps)`'s convention:
    loss = (1 - eps) * (-log p[y]) + eps * mean_k(-log p[k]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def label_smoothed_loss(logits: torch.Tensor, target: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed label-smoothed loss and summed NLL over N positions.

    logits: (N, V) at real (non-pad) target positions; target: (N,) reference ids.
    Returns (loss_sum, nll_sum), float32 scalars; divide by the token count for per-token values."""
    log_probs = F.log_softmax(logits.float(), dim=-1)  # (N, V); float32 even under autocast
    nll = -log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (N,)
    nll_sum = nll.sum()
    if eps == 0.0:
        return nll_sum, nll_sum
    uniform = -log_probs.mean(dim=-1)  # (N,) cross-entropy against the uniform distribution
    loss_sum = (1.0 - eps) * nll_sum + eps * uniform.sum()
    return loss_sum, nll_sum
