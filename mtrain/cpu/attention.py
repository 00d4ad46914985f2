"""Attention's faster ways on a CPU, for mtrain.attention.attend: each gives what PyTorch's
scaled_dot_product_attention gives, to rounding, with its masks (True = may attend; is_causal
aligns the triangle top-left; a query whose every key is masked gets zeros)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mtrain.cpu.ops import dropout


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float, is_causal: bool) -> Tensor | None:
    """softmax(q k^T / sqrt(d_head)) v for CPU tensors, or None where PyTorch's kernel is the fast
    way. In bfloat16 PyTorch's CPU attention kernels run ~6x slower than in float32 (forward +
    backward, measured at Multi30k shapes), so bfloat16 q, k and v take another way: with
    bfloat16 keys (training under autocast, a decoding copy without a cache) bfloat16_attention;
    with float32 keys (a CPU decoding cache keeps them float32 where the C kernel does not load,
    mtrain.cpu.cache) PyTorch's float32 kernel
    on an upcast q. The result has q's dtype, as autocast would cast it for the next projection
    (and a bfloat16 decoding copy needs). Other dtypes keep PyTorch's kernel (a packed training
    step's attention takes ops.heads_attention before it gets here, mtrain.cpu.model)."""
    if q.dtype == torch.bfloat16:
        if k.dtype == torch.bfloat16:
            return bfloat16_attention(q, k, v, mask, dropout_p, is_causal)
        with torch.autocast("cpu", enabled=False):  # autocast would cast them back to bfloat16
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                  dropout_p=dropout_p, is_causal=is_causal).to(q.dtype)
    return None


def bfloat16_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float,
                       is_causal: bool) -> Tensor:
    """attend for bfloat16 q, k, v on a CPU: two bfloat16 matmuls (AMX or AVX512-BF16) around a
    float32 softmax, as eager attention runs under autocast on a GPU; the scores are rounded to
    bfloat16 by their matmul, the weights before they multiply v. Forward and backward at a
    training step's shapes (256 x 4 heads x 16 positions) took 4.8-5.2 ms against 7.1-10.2 for
    upcasting to PyTorch's float32 kernel and back, and a bfloat16 training step ran 1.11x as fast
    (2-core AMX host, benchmarks/results/intel-xeon-amx/NOTES.md). The masks are SDPA's: True = may attend; is_causal aligns
    the triangle top-left."""
    scores = (q @ k.transpose(-1, -2)).float().mul_(q.size(-1) ** -0.5)
    if is_causal:
        mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = dropout(torch.softmax(scores, dim=-1).nan_to_num(nan=0.0).to(q.dtype), dropout_p)  # a row of -inf: 0
    return weights @ v
