"""Attention: softmax(q k^T / sqrt(d_head)) v per head (paper 3.2.1), one entry point for the
model and its decoding cache. Masks are SDPA's: a bool mask broadcast to (B, H, T, S), True = may
attend, and is_causal aligns the triangle top-left; a query whose every key is masked gets zeros.
On a GPU, and on a CPU with the stand-ins off (mtrain.cpu.fast), this is PyTorch's
scaled_dot_product_attention; on a CPU the shapes translation has take faster ways, each giving
the same values to rounding (their evidence is in each function's docstring)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mtrain.cpu.ops import batched_attention, dropout, on_fast_cpu, softmax_rows
from mtrain.cpu.packing import Packing


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float,
           is_causal: bool = False) -> Tensor:
    """softmax(q k^T / sqrt(d_head)) v per head. On a CPU in bfloat16 PyTorch's attention kernels
    run ~6x slower than in float32 (forward + backward, measured at Multi30k shapes), so bfloat16
    q, k and v take another way: with bfloat16 keys (training under autocast, and a decoding copy
    without a cache), bfloat16_attention; with float32 keys (a decoding cache keeps them float32,
    mtrain.cache) float32 matmuls on an upcast q for one query per row (cache_attention, greedy
    search) and PyTorch's float32 kernel for more (beam search's folded beams, a prefix). The
    result has q's dtype, as autocast would cast it for the next projection (and a bfloat16
    decoding copy needs)."""
    if on_fast_cpu(q) and q.dtype == torch.bfloat16:
        if k.dtype == torch.bfloat16:
            return bfloat16_attention(q, k, v, mask, dropout_p, is_causal)
        with torch.autocast("cpu", enabled=False):  # autocast would cast them back to bfloat16
            if q.dtype in CACHE_ATTENTION_BY_MATMULS and q.size(-2) <= CACHE_ATTENTION_QUERIES and dropout_p == 0.0:
                return cache_attention(q, k, v, mask, is_causal)
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                  dropout_p=dropout_p, is_causal=is_causal).to(q.dtype)
    if _batched_on_cpu(q, k, dropout_p):
        return batched_attention(q, k, v, mask, is_causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)


# The query dtypes whose attention over a decoding cache's float32 keys runs as cache_attention's
# matmuls rather than PyTorch's CPU kernel (benchmarks/decode_ab.py compares the two).
CACHE_ATTENTION_BY_MATMULS = (torch.bfloat16,)
# The most queries per row (beam search folds a sentence's beams into one row) that take them.
CACHE_ATTENTION_QUERIES = 1


def cache_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
    """attend for a bfloat16 decoding copy's queries over the float32 keys and values of its cache:
    two float32 matmuls around a softmax, the result in q's dtype; a query whose every key is masked
    gets zeros, as PyTorch's CPU kernel gives. With one query per row PyTorch's flash-attention
    kernel is built for the wrong case: at a greedy step's shapes (315 sentences x 4 heads, one
    query over 13 keys) it took 0.53 ms against 0.41, and bfloat16 greedy decoding ran 1.03-1.05x
    as fast with these matmuls (2-core AMX host, docs/benchmarks.md). Beam search's five queries per
    row gained nothing (0.985x), and a float32 model's greedy decoding lost (0.91x): both keep
    PyTorch's kernel."""
    scores = torch.matmul(q.float(), k.transpose(-1, -2)).mul_(q.size(-1) ** -0.5)
    if is_causal:  # the triangle aligned top-left, as SDPA's is_causal
        mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    weights = softmax_rows(scores).nan_to_num_(nan=0.0)
    return torch.matmul(weights, v).to(q.dtype)


def _batched_on_cpu(q: Tensor, k: Tensor, dropout_p: float, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """Whether float32 attention takes ops.batched_attention: a CPU training step (gradients
    wanted, eager) without attention dropout, where it is faster than PyTorch's CPU kernel."""
    return (on_fast_cpu(q) and q.dtype in dtypes and dropout_p == 0.0 and torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad) and not torch.compiler.is_compiling())


# The dtypes whose packed CPU training steps take attention from the rows straight to the heads.
HEADS_FROM_ROWS = (torch.float32, torch.float64, torch.bfloat16)


def heads_from_rows(x: Tensor, packing: Packing | None, dropout_p: float) -> bool:
    """Whether attention takes a packed step's rows straight to its heads and back (Packing.to_heads,
    ops.heads_attention, Packing.from_heads): where batched_attention runs, in float64, and in
    bfloat16 (autocast), where it does bfloat16_attention's arithmetic without the grid. At the
    small shape the copies into and out of the grid cost about twice as long as the one gather
    each way (docs/benchmarks.md)."""
    return packing is not None and _batched_on_cpu(x, x, dropout_p, HEADS_FROM_ROWS)


def bfloat16_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float,
                       is_causal: bool) -> Tensor:
    """attend for bfloat16 q, k, v on a CPU: two bfloat16 matmuls (AMX or AVX512-BF16) around a
    float32 softmax, as eager attention runs under autocast on a GPU; the scores are rounded to
    bfloat16 by their matmul, the weights before they multiply v. Forward and backward at a
    training step's shapes (256 x 4 heads x 16 positions) took 4.8-5.2 ms against 7.1-10.2 for
    upcasting to PyTorch's float32 kernel and back, and a bfloat16 training step ran 1.11x as fast
    (2-core AMX host, docs/benchmarks.md). The masks are SDPA's: True = may attend; is_causal aligns
    the triangle top-left."""
    scores = (q @ k.transpose(-1, -2)).float().mul_(q.size(-1) ** -0.5)
    if is_causal:
        mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = dropout(softmax_rows(scores).nan_to_num(nan=0.0).to(q.dtype), dropout_p)  # a row of -inf: 0
    return weights @ v
