"""CPU stand-ins for torch ops that cost more than they should on a CPU: a dropout mask from 15
random bits per element, made without bool tensors and applied by clearing bits, dropout folded
into the linear layer around it, a packed step's attention over short sequences by batched
matmuls, and a chunked top-k and argmax. Each gives what the torch op would (the dropout mask in
distribution) and falls back to it where torch is fast already."""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtrain import splitmix
from mtrain.cpu import fast, native
from mtrain.reductions import NEG_INF


def on_fast_cpu(x: Tensor) -> bool:
    """Whether x is on a CPU and the stand-ins may run (mtrain.cpu.fast: MTRAIN_CPU_FAST)."""
    return x.device.type == "cpu" and fast()


class Dropout(nn.Dropout):
    """nn.Dropout, with a cheaper mask on a CPU, where bernoulli_ (one random float per element)
    costs more than the matmul before it (in bfloat16, 5x more): see keep_bits. About 8% of a
    float32 training step on a 2-core CPU. GPUs, other dtypes and torch.compile use F.dropout
    (already fused there)."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training, self.inplace)


def _cpu_masks(x: Tensor, p: float, training: bool) -> bool:
    """Whether dropout of x takes a mask from keep_bits (else F.dropout)."""
    return (training and p > 0.0 and on_fast_cpu(x) and x.is_floating_point()
            and not torch.compiler.is_compiling())


def dropout(x: Tensor, p: float, training: bool = True, inplace: bool = False) -> Tensor:
    """F.dropout(x, p, training, inplace), with keep_bits' mask for float32 and bfloat16 on a CPU
    (never in place there)."""
    if not _cpu_masks(x, p, training) or x.dtype not in (torch.float32, torch.bfloat16):
        return F.dropout(x, p, training, inplace)
    keep, scale = keep_bits(x, p)
    if x.dtype == torch.float32:  # one multiply by a mask of 0 or the scale, forward and backward
        return x * keep.bitwise_and_(_float32_bits(scale)).view(torch.float32)
    # bfloat16 has no exact 1 / (1 - p) (1/0.9 -> 1.109, a 0.2% bias): scale each element in
    # float32 and round it, so the error is each element's own rounding, not one shared bias.
    return _Dropped.apply(x, keep, scale)


def keep_scale(p: float) -> float:
    """1 / (1 - p') for p' = p rounded to a multiple of 2^-15, keep_bits' drop rate."""
    return 32768 / (32768 - round(p * 32768))


def keep_bits(x: Tensor, p: float) -> tuple[Tensor, float]:
    """A mask of x's shape that drops with probability p' = p rounded to a multiple of 2^-15
    (0.1 -> 0.100006), as integers of x's element width: all ones to keep, 0 to drop; and the scale
    keep_scale(p) that makes the mean of the kept values exact. One 64-bit word (splitmix_words)
    gives four 15-bit uniforms; an element is dropped when its uniform is below p' * 2^15.

    PyTorch's CPU kernels for bool tensors are not vectorised: turning a bool mask of 4M elements
    into bfloat16, or multiplying by it, took 5-9 ms against 1.3 ms for these integer ops (one
    core, Zen 4). Clearing the dropped elements by their bits (x & keep) is exact, and on the
    2-core AMX host a bfloat16 multiply over a step's cold activations took 1.6 ms where the
    integer AND took 0.6 (4M elements)."""
    threshold = round(p * 32768)
    n = x.numel()
    width = x.element_size()
    if x.device.type == "cpu":
        keep = cpu_keep_lanes(_mask_seed(), n, threshold, width)
    else:
        bits = torch.empty((n + 3) // 4, dtype=torch.int64, device=x.device).random_()  # uniform on [0, 2^63)
        # The compare runs on whole 64-bit words, four 16-bit lanes at a time: each lane's low 15
        # bits u plus 2^15 - threshold stays below 2^16, so no lane carries into the next, and the
        # lane's top bit is set exactly when u >= threshold. An arithmetic shift spreads that bit
        # over the lane: -1 (all ones) to keep, 0 to drop.
        lanes = bits.bitwise_and_(_LOW_15_BITS).add_(_in_lanes(32768 - threshold)).view(torch.int16)[:n]
        keep = lanes.bitwise_right_shift_(15)
    if keep.element_size() != width:
        keep = keep.to({2: torch.int16, 4: torch.int32, 8: torch.int64}[width])  # sign-extended: -1 stays all ones
    return keep.view(x.shape), keep_scale(p)


_LOW_15_BITS = 0x7FFF_7FFF_7FFF_7FFF  # of each 16-bit lane of an int64 word


def _mask_seed() -> int:
    """One draw from torch's CPU generator (whatever torch's default device), so torch.manual_seed and
    the RNG state a checkpoint saves decide every mask."""
    return int(torch.empty((), dtype=torch.int64, device="cpu").random_())


def cpu_keep_lanes(seed: int, n: int, threshold: int, width: int) -> Tensor:
    """keep_bits' n elements on a CPU, as int16 or (width 4) int32: element i is kept (-1) when the
    low 15 bits of 16-bit lane i % 4 of splitmix_words(seed, .)[i // 4] are >= threshold, else 0.
    mtrain.cpu.native draws and compares them in one pass over the mask, where it is built; the same
    bits come from PyTorch's integer ops elsewhere, so a run's masks do not depend on the C compiler.

    Masks were the largest share of a bfloat16 training step after the matmuls: numpy's PCG64DXSM
    words, then two integer passes over them and one over the lanes, took 2.70 ms for 4M bfloat16
    elements (2-core AMX host, idle) where the C kernel takes 0.52, and the step ran 1.07-1.08x as
    fast (float32 1.04x). PyTorch's ops take 5.2 ms (benchmarks/results/intel-xeon-amx/NOTES.md, "Dropout masks in C")."""
    with torch.profiler.record_function("mtrain::keep_mask"):
        keep = native.keep_mask(seed, n, threshold, 4 if width == 4 else 2)
        if keep is not None:
            return keep
        lanes = splitmix_words(seed, (n + 3) // 4).view(torch.int16)[:n]
        return lanes.bitwise_and(0x7FFF).ge_(threshold).to(torch.int16).neg_()


def splitmix_words(seed: int, n: int) -> Tensor:
    """Words 0..n-1 of the SplitMix64 sequence from `seed` (mtrain.splitmix), as int64 (the bits of
    the uint64 values): the words the C kernel draws."""
    return torch.from_numpy(splitmix.words(seed, n).view(np.int64))


def _in_lanes(value: int) -> int:
    """value (0..2^15) in each of an int64 word's four 16-bit lanes, as a signed int64."""
    word = value * 0x0001_0001_0001_0001
    return word - (1 << 64) if word >= 1 << 63 else word


def _float32_bits(value: float) -> int:
    return int(torch.tensor(value, dtype=torch.float32).view(torch.int32))


def _cleared(x: Tensor, keep: Tensor, scale: float) -> Tensor:
    """x * scale (a new tensor) with the elements whose keep bits are 0 set to +0."""
    if scale == 1.0:
        return x.view(keep.dtype).bitwise_and(keep).view(x.dtype)
    out = x.mul(scale)
    out.view(keep.dtype).bitwise_and_(keep)
    return out


class _Dropped(torch.autograd.Function):
    """y = x * scale, 0 where keep is 0, by bits: one pass forward and one backward (plus the
    scale's multiply when it is not 1), where multiplying by a 0-or-1 mask in x's dtype and
    autograd's backward of it took two passes each way."""

    @staticmethod
    def forward(ctx, x: Tensor, keep: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return _cleared(x, keep, scale)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (keep,) = ctx.saved_tensors
        return _cleared(grad, keep, ctx.scale), None, None


class _ReLUDropped(torch.autograd.Function):
    """max(0, h) with the elements whose keep bits are 0 set to 0, unscaled. The output is 0
    wherever the gradient must be (h <= 0 or dropped), so the backward is one threshold_backward
    over it, where ReLU followed by dropout took two passes each way."""

    @staticmethod
    def forward(ctx, h: Tensor, keep: Tensor) -> Tensor:
        out = h.clamp_min(0)
        out.view(keep.dtype).bitwise_and_(keep)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (out,) = ctx.saved_tensors
        return torch.ops.aten.threshold_backward(grad, out, 0), None


def relu_dropout(h: Tensor, p: float, training: bool) -> tuple[Tensor, float]:
    """(dropout(max(0, h), p) / scale, scale): the hidden layer of a FFN, with the dropout's scale
    left for the next linear layer to take in its weight (dropout_linear's in_scale), where it
    costs a multiply over the (d_model, d_ff) weight instead of one over the activations."""
    if not _cpu_masks(h, p, training):
        return dropout(F.relu(h), p, training), 1.0
    keep, scale = keep_bits(h, p)
    return _ReLUDropped.apply(h, keep), scale


def dropout_linear(layer: nn.Linear, x: Tensor, p: float, training: bool, in_scale: float = 1.0) -> Tensor:
    """dropout(layer(x * in_scale), p): a sublayer's last linear layer and the dropout on its
    output (paper 5.4). On a CPU both scales go into the weight and bias, and the mask clears
    the dropped outputs by their bits (keep_bits): the same values up to rounding, without the
    two passes over the activations that scaling them took forward and backward. A bfloat16
    training step ran 1.08-1.10x as fast with this and relu_dropout (2-core AMX host,
    benchmarks/results/intel-xeon-amx/NOTES.md)."""
    if in_scale == 1.0 and (p == 0.0 or not training):  # evaluation: the layer alone
        return layer(x)
    if not _cpu_masks(x, p, training):
        y = layer(x) if in_scale == 1.0 else F.linear(x, layer.weight * in_scale, layer.bias)
        return dropout(y, p, training)
    scale = keep_scale(p)
    weight = layer.weight * (in_scale * scale)
    bias = None if layer.bias is None else layer.bias * scale
    y = F.linear(x, weight, bias)
    return _Dropped.apply(y, keep_bits(y, p)[0], 1.0)


@functools.cache
def onednn_linear_runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear (torch.ops.mkldnn._linear_pointwise, the kernel torch.compile's CPU
    backend emits; a bfloat16 decoding copy's layers run on it, mtrain.cpu.quantize) runs in dtype here: float32 wherever PyTorch has oneDNN, bfloat16 only where
    its kernels accept the CPU (AVX-512 or AVX-NE-CONVERT). The op is private, so it is also tried
    once, on a small problem, against F.linear: a PyTorch where it is missing, takes other
    arguments or gives other values keeps nn.Linear's path."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        try:
            if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
                return False
        except (AttributeError, RuntimeError):
            return False
    elif dtype != torch.float32:
        return False
    return same_as_linear(lambda x, w, b: torch.ops.mkldnn._linear_pointwise(x, w, b, "relu", [], ""), dtype)


def same_as_linear(linear_relu, dtype: torch.dtype) -> bool:
    """Whether linear_relu(x, W, b) gives max(0, x W^T + b) for a small problem in dtype."""
    generator = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(*shape, generator=generator).to(dtype) for shape in ((5, 64), (24, 64), (24,)))
    try:
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            y = linear_relu(x, weight, bias)
    except (AttributeError, RuntimeError, TypeError):
        return False
    want = F.relu(F.linear(x.double(), weight.double(), bias.double()))
    return y.shape == want.shape and torch.allclose(y.double(), want, rtol=2e-2, atol=2e-2)


def heads_attention(q: Tensor, kv: Tensor | None, mask: Tensor | None, is_causal: bool) -> Tensor:
    """softmax(q k^T / sqrt(d_head) + mask) v by batched matmuls, for a packed CPU training step, on
    heads laid out as mtrain.cpu.packing.Packing.to_heads gives them, heads
    before sentences: q (3, H * B, T, d_head) holding Q, K and V for self-attention (kv None), or
    q (1, H * B, T, d_head) and kv (2, H * B, S, d_head) for cross-attention. mask broadcasts to
    (B, 1, T, S). Returns (H * B, T, d_head). Q, K and V are read where they lie and their
    gradients come back as one tensor per input, so neither direction copies them again."""
    return _HeadsAttention.apply(q, kv, mask, is_causal)


class _HeadsAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(d_head) + mask) v with bmm over the heads, keeping the weights
    P (G x T x S, small at these lengths) for the backward:
        dV = P^T dY,  dP = dY V^T,  dS = P * (dP - rowsum(dP * P)) / sqrt(d_head),
        dQ = dS K,  dK = dS^T Q.
    PyTorch's CPU kernel for these shapes is a flash-attention kernel, built for long sequences: at
    a training step's (250-500 sentences x 4 heads x 8-16 positions) it took 23-36 ms forward and
    backward per layer where batched matmuls took 16-22 (float32, 2-core AVX2 EPYC,
    benchmarks/results/amd-epyc-avx2/NOTES.md). A row with every key masked gets zero weights, as
    SDPA's CPU kernels give."""

    @staticmethod
    def forward(ctx, q: Tensor, kv: Tensor | None, mask: Tensor | None, is_causal: bool) -> Tensor:
        (q_, k, v), T = (q.unbind(0) if kv is None else (q[0], *kv.unbind(0))), q.size(2)
        if mask is not None:
            batch = mask.size(0)
            mask = (mask.transpose(0, 1), (q.size(1) // batch, batch, T, k.size(1)))
        ctx.self_attention = kv is None
        return _attention_forward(ctx, q_, k, v, mask, is_causal)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor | None, None, None]:
        q, k = ctx.saved_tensors[:2]
        grad_q = q.new_empty(3 if ctx.self_attention else 1, *q.shape)
        grad_kv = grad_q[1:] if ctx.self_attention else k.new_empty(2, *k.shape)
        _attention_backward(ctx, grad, grad_q[0], grad_kv[0], grad_kv[1])
        return grad_q, None if ctx.self_attention else grad_kv, None, None


def _attention_forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: tuple[Tensor, tuple[int, ...]] | None,
                       is_causal: bool) -> Tensor:
    """(G, T, D) queries over (G, S, D) keys and values, saving what _attention_backward needs;
    mask: (a bool mask, the 4-d shape of the G heads it broadcasts over). bfloat16 inputs multiply
    in bfloat16 around a float32 softmax (_softmax_dtype); the weights are kept in float32 for the
    softmax's backward and rounded to bfloat16 once, for both of their matmuls."""
    T, S, D = q.size(1), k.size(1), q.size(2)
    scale = D ** -0.5
    scores = torch.bmm(q, k.transpose(1, 2)).to(_softmax_dtype(q)).mul_(scale)
    # Masks are added as 0 / -inf: a broadcast add runs vectorised, where PyTorch's CPU masked_fill_
    # took 6-12x as long on a step's scores (benchmarks/results/amd-epyc-avx2/NOTES.md); the softmax is the same.
    if is_causal:
        scores.add_(torch.full((T, S), NEG_INF, dtype=scores.dtype, device=q.device).triu_(1))
    if mask is not None:
        keep, shape = mask
        scores.view(shape).add_(torch.zeros(keep.shape, dtype=scores.dtype, device=q.device).masked_fill_(~keep, NEG_INF))
    weights = torch.softmax(scores, dim=-1).nan_to_num_(nan=0.0)  # a row of -inf: 0, not NaN
    rounded = weights.to(q.dtype)  # weights itself unless q is bfloat16
    ctx.save_for_backward(q, k, v, weights, rounded)
    ctx.scale = scale
    return torch.bmm(rounded, v)


def _attention_backward(ctx, grad: Tensor, grad_q: Tensor, grad_k: Tensor, grad_v: Tensor) -> None:
    """The gradients of _attention_forward for (G, T, D) grad, written into grad_q, grad_k, grad_v."""
    q, k, v, weights, rounded = ctx.saved_tensors
    grad_weights = torch.bmm(grad, v.transpose(1, 2)).to(weights.dtype)
    grad_scores = softmax_backward(grad_weights, weights)
    grad_scores = grad_scores.mul_(ctx.scale).to(q.dtype)
    torch.bmm(grad_scores, k, out=grad_q)
    torch.bmm(grad_scores.transpose(1, 2), q, out=grad_k)
    torch.bmm(rounded.transpose(1, 2), grad, out=grad_v)


def softmax_backward(grad: Tensor, weights: Tensor) -> Tensor:
    """w * (g - sum(g * w)) over the last dimension: PyTorch's own kernel for it (one pass,
    torch._softmax_backward_data) where that private op takes these arguments, else the formula."""
    if _private_softmax_backward():
        return torch._softmax_backward_data(grad, weights, -1, weights.dtype)
    return weights * (grad - (grad * weights).sum(-1, keepdim=True))


@functools.cache
def _private_softmax_backward() -> bool:
    """Whether torch._softmax_backward_data(grad, weights, dim, dtype) exists and gives the formula."""
    weights = torch.softmax(torch.arange(6.0).view(2, 3), -1)
    grad = torch.ones(2, 3).cumsum(-1)
    try:
        got = torch._softmax_backward_data(grad, weights, -1, weights.dtype)
    except (AttributeError, RuntimeError, TypeError):
        return False
    return torch.allclose(got, weights * (grad - (grad * weights).sum(-1, keepdim=True)))


def _softmax_dtype(q: Tensor) -> torch.dtype:
    """The dtype attention's scores and softmax take: q's own in float32 and float64; float32 for
    bfloat16 q, k and v, whose matmuls run in bfloat16 around a float32 softmax, exactly as
    mtrain.cpu.attention.bfloat16_attention does (and autograd's backward through it)."""
    return torch.float32 if q.dtype == torch.bfloat16 else q.dtype


def topk_rows(x: Tensor, k: int, chunk: int = 64) -> tuple[Tensor, Tensor]:
    """x.topk(k, dim=1) of (N, V) x, in two short passes, ~2.5x faster on a CPU for a large V.

    The k largest values lie in the k chunks (of `chunk` columns) with the largest maxima: a chunk
    holding one of them has a maximum at least as large as the k-th largest value, and any k
    chunks with larger maxima would already supply k values that large. So the chunk maxima (one
    vectorised reduction) pick k * chunk candidate columns, and topk runs over those only. Ties
    may pick other columns of equal value, as topk's order among ties is unspecified anyway."""
    V = x.size(1)
    n = V // chunk
    if not on_fast_cpu(x) or n < 4 * k:  # GPU topk is fast already; small V gains nothing
        return x.topk(k, dim=1)
    maxima = x[:, : n * chunk].unflatten(1, (n, chunk)).amax(dim=2)
    ragged = V > n * chunk  # a last, shorter chunk
    if ragged:
        maxima = torch.cat([maxima, x[:, n * chunk :].amax(dim=1, keepdim=True)], dim=1)
    best = maxima.topk(k, dim=1, sorted=False).indices
    cols = (best.unsqueeze(-1) * chunk + torch.arange(chunk, device=x.device)).flatten(1)  # (N, k * chunk)
    if ragged:
        beyond = cols >= V
        candidates = x.gather(1, cols.clamp_(max=V - 1)).masked_fill_(beyond, NEG_INF)
    else:
        candidates = x.gather(1, cols)
    values, pick = candidates.topk(k, dim=1)
    return values, cols.gather(1, pick)


def argmax_rows(x: Tensor, chunk: int = 64) -> Tensor:
    """x.argmax(dim=1) of (N, V) x, the same index (the first of equal maxima), ~4x faster on a CPU
    for a large V: PyTorch's CPU argmax over rows is not vectorised (1.4 ms for 273 x 8000 float32
    on 2 cores, against 0.16 ms for amax). The chunk maxima (vectorised) pick each row's first chunk
    holding its maximum; argmax runs over that chunk only. Rows with a NaN fall back to torch."""
    V = x.size(1)
    n = V // chunk
    if not on_fast_cpu(x) or n < 4 or V % chunk:
        return x.argmax(dim=1)
    maxima = x.unflatten(1, (n, chunk)).amax(dim=2)  # (N, n)
    if maxima.isnan().any():
        return x.argmax(dim=1)
    cols = maxima.argmax(dim=1, keepdim=True) * chunk + torch.arange(chunk, device=x.device)  # (N, chunk)
    return cols.gather(1, x.gather(1, cols).argmax(dim=1, keepdim=True)).squeeze(1)
