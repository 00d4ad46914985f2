"""Attention: softmax(q k^T / sqrt(d_head)) v per head (paper 3.2.1), one entry point for the
model and its decoding cache. Masks are SDPA's: a bool mask broadcast to (B, H, T, S), True = may
attend, and is_causal aligns the triangle top-left; a query whose every key is masked gets zeros
(on a GPU some kernels give NaN there; mtrain.model.key_mask never builds such a row)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from mtrain.cpu import attention as cpu_attention
from mtrain.cpu.ops import on_fast_cpu


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float,
           is_causal: bool = False) -> Tensor:
    """(B, H, T, d_head) queries over (B, H, S, d_head) keys and values -> (B, H, T, d_head); on a
    CPU the faster way of mtrain.cpu.attention where there is one."""
    if on_fast_cpu(q):
        y = cpu_attention.attend(q, k, v, mask, dropout_p, is_causal)
        if y is not None:
            return y
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
