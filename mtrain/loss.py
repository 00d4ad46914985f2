"""Label-smoothed cross-entropy (Szegedy et al. 2016), the paper's training loss, plus the
plain NLL for logging, the symmetric KL divergence of R-Drop, and the training objective built
from them (`Objective`, and `forward_backward` for gradient accumulation). The two losses get
only real target positions, so no pad masking there.

Convention: the smoothed target puts 1 - eps on the reference token and spreads eps uniformly
over ALL V classes (the reference and pad included), i.e. q = (1 - eps) * onehot + eps / V.
This is `torch.nn.functional.cross_entropy(..., label_smoothing=eps)`'s convention:
    loss = (1 - eps) * (-log p[y]) + eps * mean_k(-log p[k]).
With lse = log sum_k exp(x_k), -log p[k] = lse - x_k, so per position
    loss = lse - (1 - eps) * x_y - eps * mean_k(x_k),   d loss / d x = softmax(x) - q.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from mtrain.reductions import PLAIN, Reductions, logsumexp_, reductions_of


def _float32_or_wider(logits: Tensor) -> Tensor:
    """float32 even under autocast (bf16/fp16 logits lose too much in exp and sums over V);
    float64 stays float64 (gradcheck)."""
    return logits if logits.dtype == torch.float64 else logits.float()


def label_smoothed_loss(logits: Tensor, target: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Summed label-smoothed loss and summed NLL over N positions.

    logits: (N, V) at real (non-pad) target positions; target: (N,) reference ids.
    Returns (loss_sum, nll_sum), float32 scalars; divide by the token count for per-token values.
    Only loss_sum carries a gradient (nll_sum is for logging)."""
    return _SmoothedCrossEntropy.apply(logits, target, eps)


class _SmoothedCrossEntropy(torch.autograd.Function):
    """The loss in closed form (module docstring), with a hand-written backward.

    Autograd through log_softmax, gather and mean makes ~9 passes and 2 allocations of (N, V)
    tensors; here the forward keeps exp(x - max) (the one (N, V) allocation) and its row sums, and
    the backward turns that tensor into the gradient in place: 7 passes. At V = 8000 the logits
    are the largest activation of a small model, so this is a few % of a CPU training step."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        x = _float32_or_wider(logits)
        peak = x.amax(dim=-1, keepdim=True)
        exp = torch.sub(x, peak).exp_()  # (N, V), becomes the gradient in backward
        total = exp.sum(dim=-1, keepdim=True)
        lse = (total.log() + peak).squeeze(-1)  # (N,) log sum_k exp(x_k)
        nll = lse - x.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (N,) -log p[y]
        nll_sum = nll.sum()
        if eps == 0.0:
            loss_sum = nll_sum.clone()  # a separate output: nll_sum is marked non-differentiable
        else:
            loss_sum = (1.0 - eps) * nll_sum + eps * (lse - x.mean(dim=-1)).sum()
        ctx.save_for_backward(exp, total, target)
        ctx.eps, ctx.dtype, ctx.spent = eps, logits.dtype, False
        ctx.mark_non_differentiable(nll_sum)
        return loss_sum, nll_sum

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor) -> tuple[Tensor, None, None]:
        if ctx.spent:  # the saved tensor was turned into the gradient by the first backward
            raise RuntimeError("label_smoothed_loss supports one backward per forward (no retain_graph)")
        ctx.spent = True
        exp, total, target = ctx.saved_tensors
        eps = ctx.eps
        grad = exp.mul_(grad_loss / total)  # g * softmax(x), in place
        if eps:
            grad.sub_(grad_loss * (eps / exp.size(-1)))
        rows = torch.arange(exp.size(0), device=exp.device)
        grad[rows, target] -= grad_loss * (1.0 - eps)
        return grad.to(ctx.dtype), None, None


def projected_label_smoothed_loss(states: Tensor, weight: Tensor, target: Tensor, eps: float,
                                  reductions: Reductions = PLAIN) -> tuple[Tensor, Tensor]:
    """label_smoothed_loss(states @ weight.T, target, eps), the vocabulary projection and the loss
    in one: (N, d) decoder states at real target positions, (V, d) projection weight. The same
    values; the gradient the same up to rounding (see _ProjectedSmoothedCrossEntropy). The row
    sums and the gradient take the model's reductions (mtrain.reductions)."""
    dtype = states.dtype
    if torch.is_autocast_enabled(states.device.type) and states.dtype in (torch.float32, torch.float16, torch.bfloat16):
        dtype = torch.get_autocast_dtype(states.device.type)  # the matmul runs in autocast's dtype
    return _ProjectedSmoothedCrossEntropy.apply(states, weight, target, eps, dtype, reductions)


CHUNK_BYTES = 1 << 21  # float32 logits per chunk: ~1 MiB per thread of 2, a Zen 4 core's L2 cache
# Off a CPU there is no cache to fit, and each chunk costs a dozen kernel launches: at a 32k
# vocabulary 2 MiB is 16 rows, ~1500 chunks and ~20k launches for 25k target tokens. 64 MiB chunks
# (512 rows there) keep the float32 copy of a chunk small next to the logits themselves.
DEVICE_CHUNK_BYTES = 1 << 26


def _chunk_rows(vocab: int, device: torch.device) -> int:
    """Rows of float32 logits per chunk on this device."""
    return max(1, (CHUNK_BYTES if device.type == "cpu" else DEVICE_CHUNK_BYTES) // (4 * vocab))


def _row_chunks(n: int, vocab: int, device: torch.device) -> list[slice]:
    rows = _chunk_rows(vocab, device)
    return [slice(start, min(start + rows, n)) for start in range(0, n, rows)]


def _zero_padded_rows(x: Tensor, rows: int) -> Tensor:
    """x (n, d) followed by rows - n rows of zeros; x itself when rows == n."""
    if rows == x.size(0):
        return x
    return torch.cat([x, x.new_zeros(rows - x.size(0), x.size(1))])


def _project_rows(h: Tensor, w: Tensor, rows: Tensor) -> Tensor:
    """The logits of these rows of h, in h's dtype."""
    with torch.autocast(h.device.type, enabled=False):
        return h[rows] @ w.t()


# A row's log sum exp(x) taken without its maximum subtracted is exact up to rounding while every
# term that matters is a normal float32: float32 exp overflows above 88.7 and leaves the normal range
# below -87.3, and the terms that move a sum of e^-60 by float32's 2^-24 (over a vocabulary of 8000:
# down to e^-86; of 32000: e^-87) are normal. So a row may be summed unshifted from a log sum exp of
# PLAIN_EXP_FLOOR up.
PLAIN_EXP_FLOOR = -60.0
# The log sum exps the loss takes without the row maxima (see PLAIN_EXP_FLOOR); rows outside this
# range (a model's logits rarely are) are summed again shifted.
PLAIN_LSE_RANGE = (PLAIN_EXP_FLOOR, 80.0)


def _shifted_where_out_of_range(lse: Tensor, vocab: int, logits_of: Callable[[Tensor], Tensor],
                                probabilities: Tensor | None) -> Tensor:
    """In place: each row's log-sum-exp outside PLAIN_LSE_RANGE (or not finite) recomputed from
    its logits (logits_of(rows)) with the row maximum subtracted first. Where `probabilities` holds
    the rows' exp(logits) (in place of the logits), those rows get softmax(logits) instead. Returns
    the rows redone."""
    low, high = PLAIN_LSE_RANGE
    redo = (~((lse >= low) & (lse <= high))).nonzero().squeeze(1)
    step = _chunk_rows(vocab, lse.device)  # a chunk's worth at a time, however many rows are out
    for start in range(0, redo.numel(), step):
        rows = redo[start : start + step]
        x = logits_of(rows).to(lse.dtype)
        peak = x.amax(1, keepdim=True)
        lse[rows] = logsumexp_(x.clone() if probabilities is not None else x, peak).squeeze(1)  # a non-finite row stays non-finite
        if probabilities is not None:
            probabilities[rows] = x.sub_(lse[rows, None]).exp_()
    return redo


class _ProjectedSmoothedCrossEntropy(torch.autograd.Function):
    """The vocabulary projection and the loss of _SmoothedCrossEntropy with one (N, V) tensor.

    The logits are the largest activation of a small model (3700 x 8000 at 4k target tokens,
    four times the FFN's hidden layer), and every pass over them in float32 runs at memory speed:
    upcasting bf16 logits, exp, the row sums and the backward's passes each
    read and write ~120 MB, ~1.2 GB a step in all, ~15% of a bf16 step on a 2-core CPU. Here the
    logits are walked in row chunks of about a core's L2 cache (on a CPU): each chunk is upcast,
    reduced and exponentiated while in cache, and the backward writes the gradient over the
    logits, in place, then runs the two matmuls of the projection's backward.

    Logits as wide as the sums (float32) are read and overwritten where they lie: the forward turns
    them into exp(x - c) (c = 0, or the row maximum) and keeps each row's 1 / sum, so the backward's
    softmax is one multiply, with no second exp and subtraction: at 3900 x 256 x 8000 the loss's
    forward and backward took 466 against 495 ms (medians of 20, 2-core AVX2 EPYC); in a profiled
    float32 step its ops took 45 against 58 ms (benchmarks/results/amd-epyc-avx2/NOTES.md). Narrower logits (bfloat16) stay as they are, an upcast copy of each chunk
    is reduced, and the backward recomputes softmax(x) = exp(x - lse) chunk by chunk. The model's
    reductions may take the row sums and the gradient over (a CPU's C kernels read each bfloat16
    row once for each: mtrain.cpu.reductions). Values equal label_smoothed_loss's; the gradient
    differs by rounding only."""

    @staticmethod
    def forward(ctx, states: Tensor, weight: Tensor, target: Tensor, eps: float,
                dtype: torch.dtype, reductions: Reductions) -> tuple[Tensor, Tensor]:
        n, multiple = states.size(0), reductions.row_multiple
        with torch.autocast(states.device.type, enabled=False):  # dtypes are chosen here, explicitly
            h, w = _zero_padded_rows(states.to(dtype), -(-n // multiple) * multiple), weight.to(dtype)
            logits = h @ w.t()  # (N rounded up, V); the rows from n on are zero and stay out of the loss
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        in_place = logits.dtype == wide
        picked = logits[:n].gather(1, target[:, None]).squeeze(1).to(wide)  # before exp overwrites them; exact
        sums = logits.new_empty(n, dtype=wide)
        mean = logits.new_empty(n, dtype=wide) if eps else None
        # Each chunk's reductions go straight into the per-row tensors (out=), and the sums over rows
        # follow the loop: about 60 chunks a step, each of which had cost some 20 small ops. The
        # sums of exp subtract each row's maximum first, unless the reductions sum them without
        # (a CPU's, two passes fewer per chunk): rows where that could over- or underflow are then
        # summed again with it (_shifted_where_out_of_range). On a GPU finding those rows would stop
        # the host until the device catches up.
        peak = None if reductions.unshifted_sums(logits.device) else logits.new_empty(n, 1, dtype=wide)
        chunks = [] if peak is None and reductions.cross_entropy_sums(logits[:n], sums, mean) else \
            _row_chunks(n, logits.size(1), logits.device)
        for rows in chunks:
            x = logits[rows] if in_place else logits[rows].to(wide, copy=True)
            if eps:
                torch.mean(x, 1, out=mean[rows])
            if peak is not None:
                torch.amax(x, 1, keepdim=True, out=peak[rows])
                x.sub_(peak[rows])
            torch.sum(x.exp_(), 1, out=sums[rows])
        lse = sums.log()
        inverse_sums = sums.reciprocal_() if in_place else None  # each row's softmax: exps * 1 / sum
        if peak is None:
            # exp overwrote float32 logits: their out-of-range rows are projected again
            redo = _shifted_where_out_of_range(
                lse, logits.size(1), functools.partial(_project_rows, h, w) if in_place else logits.__getitem__,
                logits if in_place else None)
            if in_place:
                inverse_sums[redo] = 1.0  # those rows hold their softmax already
        else:
            lse.add_(peak.squeeze(1))
        nll_sum = (lse - picked).sum()
        # a separate output (clone): nll_sum is marked non-differentiable
        loss_sum = nll_sum.clone() if mean is None else (1.0 - eps) * nll_sum + eps * (lse - mean).sum()
        ctx.save_for_backward(h, w, logits, lse, inverse_sums, target)
        ctx.eps, ctx.dtypes, ctx.reductions, ctx.spent = eps, (states.dtype, weight.dtype), reductions, False
        ctx.mark_non_differentiable(nll_sum)
        return loss_sum, nll_sum

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor) -> tuple[Tensor, Tensor, None, None, None, None]:
        if ctx.spent:  # the logits were turned into their gradient by the first backward
            raise RuntimeError("projected_label_smoothed_loss supports one backward per forward (no retain_graph)")
        ctx.spent = True
        h, w, logits, lse, inverse_sums, target = ctx.saved_tensors
        eps, g = ctx.eps, grad_loss.to(lse.dtype)
        n, vocab = lse.size(0), logits.size(1)
        logits[n:] = 0  # the padding rows' gradient: zero, so they add nothing to either matmul below
        rows_per_chunk = _chunk_rows(vocab, lse.device)
        # each row's target, as an index into its chunk's flat gradient
        picked = torch.arange(n, device=lse.device).remainder_(rows_per_chunk).mul_(vocab).add_(target)
        minus_picked = (-(1.0 - eps) * g).expand(rows_per_chunk)
        floor = g * (eps / vocab)
        row_scale = None if inverse_sums is None else inverse_sums.mul_(g)[:, None]
        chunks = _row_chunks(n, vocab, lse.device)
        if row_scale is None and ctx.reductions.cross_entropy_gradient_(logits[:n], lse, target, float(g), eps):
            chunks = []  # the reductions wrote the gradient over the logits
        for rows in chunks:
            if row_scale is not None:  # the logits hold exp(x - c): g * softmax(x) is one multiply
                grad = logits[rows].mul_(row_scale[rows])
            else:
                grad = logits[rows].to(lse.dtype, copy=True).sub_(lse[rows, None]).exp_().mul_(g)
            if eps:
                grad.sub_(floor)
            grad.view(-1).index_add_(0, picked[rows], minus_picked[: grad.size(0)])
            if row_scale is None:
                logits[rows] = grad  # rounded to the logits' dtype, in place
        with torch.autocast(h.device.type, enabled=False):
            grad_states = (logits @ w)[:n] if ctx.needs_input_grad[0] else None
            grad_weight = logits.t() @ h if ctx.needs_input_grad[1] else None
        return (None if grad_states is None else grad_states.to(ctx.dtypes[0]),
                None if grad_weight is None else grad_weight.to(ctx.dtypes[1]), None, None, None, None)


def symmetric_kl(logits_a: Tensor, logits_b: Tensor) -> Tensor:
    """Summed symmetric KL divergence 1/2 (KL(p || q) + KL(q || p)) between the rows of two (N, V)
    logit tensors, p = softmax(logits_a), q = softmax(logits_b): R-Drop's consistency term. A
    float32 scalar (float32 even under autocast); zero exactly when the rows agree."""
    return _SymmetricKL.apply(logits_a, logits_b)


class _SymmetricKL(torch.autograd.Function):
    """The term in closed form with a hand-written backward, for the same reason as the loss above.

    Both KL terms share one form: KL(p || q) + KL(q || p) = sum_k (p_k - q_k) d_k, d = log p - log q.
    Its gradient by the logits of p is, per row (softmax calculus, sum_k p_k = sum_k q_k = 1),
        d/da_j = p_j (d_j - <p, d>) + p_j - q_j,
    and by the logits of q the same with p and q swapped (d becomes -d). Autograd through
    log_softmax, exp, sub and mul keeps ~8 (N, V) tensors; this keeps 3 (p, q, d)."""

    @staticmethod
    def forward(ctx, logits_a: Tensor, logits_b: Tensor) -> Tensor:
        log_p = torch.log_softmax(_float32_or_wider(logits_a), dim=-1)
        log_q = torch.log_softmax(_float32_or_wider(logits_b), dim=-1)
        p, q = log_p.exp(), log_q.exp()
        d = log_p.sub_(log_q)  # log p - log q, in place (log p is not needed again)
        ctx.save_for_backward(p, q, d)
        ctx.dtypes = logits_a.dtype, logits_b.dtype
        return 0.5 * torch.sub(p, q).mul_(d).sum()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
        p, q, d = ctx.saved_tensors
        half = 0.5 * grad
        # by a: p (d - <p, d>) + p - q;  by b: q (-d + <q, d>) + q - p
        grad_a = torch.sub(d, (p * d).sum(-1, keepdim=True)).add_(1.0).mul_(p).sub_(q).mul_(half)
        grad_b = torch.sub((q * d).sum(-1, keepdim=True), d).add_(1.0).mul_(q).sub_(p).mul_(half)
        return grad_a.to(ctx.dtypes[0]), grad_b.to(ctx.dtypes[1])


class Objective(nn.Module):
    """Teacher-forced label-smoothed loss as one module, so DDP (which hooks forward) and
    torch.compile see the whole computation. The vocabulary projection, the largest matmul, runs
    only at real target positions (Transformer.target_states; on a CPU the accelerated model runs
    the layers before it on the real positions too, mtrain.cpu.model)."""

    def __init__(self, model: nn.Module, label_smoothing: float, rdrop_alpha: float = 0.0) -> None:
        super().__init__()
        self.model, self.eps, self.rdrop_alpha = model, label_smoothing, rdrop_alpha

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rdrop_alpha > 0 and self.training:
            return self._rdrop(src, tgt_in, tgt_out)
        states, target = self._states(src, tgt_in, tgt_out)
        if torch.compiler.is_compiling() or self.model.proj.bias is not None:
            # the compiler fuses the plain version itself; an output bias (model.output_bias) is
            # outside what the fused projection computes
            return label_smoothed_loss(self.model.project(states), target, self.eps)
        # model.project is the bias-free tied matrix: its weight is all the fused loss needs.
        return projected_label_smoothed_loss(states, self.model.proj.weight, target, self.eps,
                                             reductions_of(self.model))

    def _states(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.target_states(src, tgt_in, tgt_out)  # (N, d_model), N = real target tokens

    def _logits(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        states, target = self._states(src, tgt_in, tgt_out)
        return self.model.project(states), target  # (N, V)

    def _rdrop(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """R-Drop: the batch twice in one forward (stacked, so the two copies get independent
        dropout masks), loss = mean of the two copies' label-smoothed losses + alpha * symmetric KL,
        per real token. That is the paper's loss (sum of both NLLs + alpha * KL) halved, so the
        logged loss and NLL stay comparable with a run without R-Drop."""
        logits, target = self._logits(torch.cat([src, src]), torch.cat([tgt_in, tgt_in]), torch.cat([tgt_out, tgt_out]))
        n = target.size(0) // 2  # boolean indexing is row-major: copy 1's positions, then copy 2's in the same order
        loss_sum, nll_sum = label_smoothed_loss(logits, target, self.eps)
        kl_sum = symmetric_kl(logits[:n], logits[n:])
        return 0.5 * loss_sum + 0.5 * self.rdrop_alpha * kl_sum, 0.5 * nll_sum


def forward_backward(objective: nn.Module, micro_batches: list[tuple[torch.Tensor, ...]], total_tokens: int,
                     world_size: int = 1, autocast: Any = contextlib.nullcontext,
                     scaler: Any = None) -> tuple[float, float]:
    """Accumulate gradients of sum(loss) / total_tokens over micro-batches: dividing by the tokens
    of the whole update (all micro-batches, all ranks) makes accumulation equal one big batch.
    DDP averages gradients over ranks, so each rank's loss is scaled by world_size to get a sum.
    Returns this rank's (loss_sum, nll_sum)."""
    totals = []
    for i, (src, tgt_in, tgt_out) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        sync = contextlib.nullcontext() if last or not hasattr(objective, "no_sync") else objective.no_sync()
        with sync:
            with autocast():
                loss_sum, nll_sum = objective(src, tgt_in, tgt_out)
            scaled = loss_sum * (world_size / total_tokens)
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        totals.append(torch.stack([loss_sum.detach(), nll_sum.detach()]))
    loss_total, nll_total = torch.stack(totals).sum(0).tolist()  # one device sync per update
    return loss_total, nll_total
