"""The training step's fused pieces give what the plain ones give: the vocabulary projection and
label-smoothed loss in one (values and gradients of label_smoothed_loss(states @ W.T)), chunked
any way; and the CPU dropout mask, made without bool tensors, drops exactly the elements the
15-bit rule drops, scaled as before."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICES
from mtrain import loss as loss_module
from mtrain.cpu import native
from mtrain.cpu.ops import Dropout, keep_bits, splitmix_words
from mtrain.cpu.reductions import CPU
from mtrain.loss import label_smoothed_loss, projected_label_smoothed_loss
from mtrain.reductions import PLAIN, Reductions


def problem(n: int, d: int, vocab: int, dtype=torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    states = torch.randn(n, d, generator=gen, dtype=dtype)
    weight = torch.randn(vocab, d, generator=gen, dtype=dtype) * d ** -0.5
    target = torch.randint(0, vocab, (n,), generator=gen)
    return states, weight, target


class Rounded(Reductions):
    """PyTorch's reductions, with the loss's rows rounded up to `row_multiple` and its sums of exp
    taken without the row maxima where `unshifted` says so."""

    def __init__(self, row_multiple: int = 1, unshifted: bool = False) -> None:
        self.row_multiple, self.unshifted = row_multiple, unshifted

    def unshifted_sums(self, device):
        return self.unshifted


def both(states, weight, target, eps, fused: bool, autocast: bool = False, scale: float = 0.37,
         reductions: Reductions = PLAIN):
    h, w = states.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast(states.device.type, dtype=torch.bfloat16, enabled=autocast):
        if fused:
            loss, nll = projected_label_smoothed_loss(h, w, target, eps, reductions)
        else:
            loss, nll = label_smoothed_loss(h @ w.t(), target, eps)
    (loss * scale).backward()  # a gradient scale other than 1, as forward_backward's 1/tokens
    return loss.detach(), nll.detach(), h.grad, w.grad


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("chunk_bytes", [4 * 13 * 3, 1 << 21], ids=["3-row-chunks", "one-chunk"])
@pytest.mark.parametrize("row_multiple", [1, 7, 64], ids=["unpadded", "pad-to-21", "pad-to-64"])
@pytest.mark.parametrize("unshifted", [False, True], ids=["maxima-first", "unshifted-sums"])
@pytest.mark.parametrize("scale", [0.37, -0.37, 0.0], ids=["grad>0", "grad<0", "grad=0"])
def test_fused_projection_and_loss_equal_the_plain_ones(monkeypatch, eps, chunk_bytes, row_multiple, unshifted, scale):
    monkeypatch.setattr(loss_module, "CHUNK_BYTES", chunk_bytes)
    states, weight, target = problem(n=20, d=6, vocab=13)  # 20 rows: 3-row chunks leave a ragged last one
    fused = both(states, weight, target, eps, True, scale=scale, reductions=Rounded(row_multiple, unshifted))
    plain = both(states, weight, target, eps, False, scale=scale)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_loss_chunks_fit_a_cpu_cache_and_stay_few_on_a_gpu():
    """On a CPU a chunk of float32 logits is CHUNK_BYTES (a core's L2 cache); on a GPU, where each
    chunk is a dozen kernel launches, 25k target tokens at a 32k vocabulary take 48 chunks, not 1563."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert loss_module._chunk_rows(32000, cpu) == loss_module.CHUNK_BYTES // (4 * 32000) == 16
    assert len(loss_module._row_chunks(25000, 32000, cpu)) == 1563
    chunks = loss_module._row_chunks(25000, 32000, gpu)
    assert len(chunks) == 48 and chunks[0] == slice(0, 524) and chunks[-1] == slice(47 * 524, 25000)
    assert loss_module._chunk_rows(10**9, gpu) == 1  # a vocabulary larger than a chunk: one row at a time


@pytest.mark.parametrize("rows_per_chunk", [1, 2])
@pytest.mark.parametrize("plain_sums", [True, False], ids=["cpu-sums", "maxima-first"])
@pytest.mark.parametrize("shift", [300.0, 85.0, -70.0, -100.0, -300.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_loss_holds_where_plain_sums_of_exp_would_not(monkeypatch, dtype, shift, plain_sums, rows_per_chunk):
    """The forward sums exp(logits) without the row maximum taken out. Rows moved by `shift` (every
    logit of the row) out of PLAIN_LSE_RANGE are summed again with it: at +300 float32's exp
    overflows and at -300 it is 0 (without the second sum both give inf or NaN), at -100 its terms
    are subnormal and the plain sum is finite but off by ~1e-3, at +85 and -70 the plain sum would
    still hold. Loss, NLL and gradients are the plain (log_softmax) loss's, in every row, with the
    rows redone one or two at a time. PyTorch's reductions take the maxima first in every row
    (maxima-first runs that path)."""
    monkeypatch.setattr(loss_module, "CHUNK_BYTES", 4 * 9 * rows_per_chunk)
    states, weight, target = problem(n=6, d=5, vocab=9, dtype=dtype)
    weight[:, -1] = 1.0  # the last feature adds the same amount to every logit of a row
    states[2, -1], states[4, -1] = shift, -0.5 * shift
    fused = both(states, weight, target, 0.1, True, reductions=CPU if plain_sums else PLAIN)
    plain = both(states, weight, target, 0.1, False)
    # float32's exp(x - lse) loses |x| * 2^-24 in the subtraction, with or without the shifted sum
    tol = 1e-5 * max(1.0, abs(shift) / 8) if dtype == torch.float32 else 1e-12
    for a, b in zip(fused, plain):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())


needs_native = pytest.mark.skipif(native.library() is None, reason=f"kernel not built: {native.status}")


@needs_native
@pytest.mark.parametrize("vocab", [16, 1003])
def test_cross_entropy_kernels_equal_the_formulas_in_float64(vocab):
    """Row sums of exp and means of bfloat16 logits to float32 rounding; the gradient written over
    them, g softmax(x) - g eps / V with g (1 - eps) more off the target, to bfloat16 rounding of the
    float64 value (and float32's of the terms that cancel in it), over a vocabulary inside and across
    the kernel's blocks of 16."""
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(37, vocab, generator=gen) * 3).bfloat16()
    target = torch.randint(0, vocab, (37,), generator=gen)
    sums, means = torch.empty(37), torch.empty(37)
    assert native.cross_entropy_sums(logits, sums, means)
    x = logits.double()
    torch.testing.assert_close(sums.double(), x.exp().sum(1), rtol=1e-5, atol=0)
    torch.testing.assert_close(means.double(), x.mean(1), rtol=1e-5, atol=1e-6)
    lse, g, eps = x.logsumexp(1), -0.37, 0.1
    want = g * (x - lse[:, None]).exp() - g * eps / vocab
    want[torch.arange(37), target] -= g * (1 - eps)
    assert native.cross_entropy_gradient_(logits, lse.float(), target, g, eps)
    terms = abs(g) * ((x - lse[:, None]).exp() + eps / vocab)  # float32 rounds these before they cancel
    assert ((logits.double() - want).abs() <= want.abs() * 2 ** -8 + terms * 2 ** -20).all()


def test_kernels_are_never_built_for_other_devices_or_dtypes(monkeypatch):
    """The CPU's reductions ask mtrain.cpu.native for their passes whatever the device (a GPU's
    bfloat16 logits too): for anything but bfloat16 rows on a CPU the answer is no, before the
    library is loaded or built."""
    from mtrain.search import _float_unless_kept

    def no_build():
        raise AssertionError("library() called")

    monkeypatch.setattr(native, "library", no_build)
    lse, target = torch.zeros(3), torch.zeros(3, dtype=torch.int64)
    for logits in (torch.empty(3, 16, dtype=torch.bfloat16, device="meta"), torch.zeros(3, 16)):
        assert not native.cross_entropy_sums(logits, torch.zeros(3), None)
        assert not native.cross_entropy_gradient_(logits, lse, target, 1.0, 0.1)
        assert native.topk_logsumexp(logits, 2) is None  # beam search's, on a GPU's bfloat16 logits
        assert _float_unless_kept(torch.Tensor.float, CPU)(logits).dtype == torch.float32  # the search's blocks


@needs_native
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("shift", [0.0, 85.0, 300.0, -300.0])
def test_bfloat16_loss_by_the_kernels_equals_pytorchs_chunks(monkeypatch, eps, shift):
    """Under bfloat16 autocast the fused loss's row sums and gradient come from mtrain.cpu.native:
    the loss and NLL of PyTorch's chunked passes to float32 rounding, the gradients to bfloat16's,
    also with a row moved out of the range where sums without the maximum hold (summed again)."""
    states, weight, target = problem(n=70, d=16, vocab=1003, dtype=torch.float32)
    weight[:, -1] = 1.0
    states[5, -1] = shift
    kernel = both(states, weight, target, eps, True, autocast=True, reductions=CPU)
    monkeypatch.setattr(native, "cross_entropy_sums", lambda *args: False)
    monkeypatch.setattr(native, "cross_entropy_gradient_", lambda *args: False)
    chunks = both(states, weight, target, eps, True, autocast=True, reductions=CPU)
    for a, b in zip(kernel[:2], chunks[:2]):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
    for a, b in zip(kernel[2:], chunks[2:]):
        assert ((a - b).norm() / b.norm()).item() < 1e-2


@pytest.mark.parametrize("reductions", [CPU, PLAIN], ids=["cpu", "plain"])
def test_projection_matmuls_see_row_counts_rounded_up(reductions):
    """Every matmul of the fused loss, forward and backward, has a multiple of the reductions'
    row_multiple rows in the token dimension (a CPU's: 64), whatever the token count: so a run meets
    a bounded set of shapes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class MatmulShapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.default):
                self.shapes.append((tuple(args[-2].shape), tuple(args[-1].shape)))
            return func(*args, **(kwargs or {}))

    for n in (1, 63, 64, 65, 130):
        states, weight, target = problem(n=n, d=8, vocab=11, dtype=torch.float32)
        with MatmulShapes() as mode:
            both(states, weight, target, 0.1, True, reductions=reductions)
        tokens = -(-n // reductions.row_multiple) * reductions.row_multiple
        # forward h @ W.T, backward grad @ W and grad.T @ h: the token dimension is outer, outer, inner
        assert mode.shapes == [((tokens, 8), (8, 11)), ((tokens, 11), (11, 8)), ((11, tokens), (tokens, 8))], n


def test_fused_gradient_matches_finite_differences(monkeypatch):
    """Central differences of the loss by every state and weight entry (float64; gradcheck itself
    would run the backward twice, which the in-place backward refuses)."""
    monkeypatch.setattr(loss_module, "CHUNK_BYTES", 4 * 7 * 2)
    states, weight, target = problem(n=5, d=4, vocab=7)
    _, _, grad_h, grad_w = both(states, weight, target, 0.1, True)

    def value(h, w):
        return projected_label_smoothed_loss(h, w, target, 0.1)[0].item() * 0.37

    for tensor, grad, other in ((states, grad_h, "h"), (weight, grad_w, "w")):
        numeric = torch.zeros_like(tensor)
        for i in range(tensor.numel()):
            step = torch.zeros_like(tensor).view(-1)
            step[i] = 1e-6
            step = step.view_as(tensor)
            args = ((states + step, weight), (states - step, weight)) if other == "h" else \
                ((states, weight + step), (states, weight - step))
            numeric.view(-1)[i] = (value(*args[0]) - value(*args[1])) / 2e-6
        torch.testing.assert_close(grad, numeric, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("device", DEVICES)
def test_fused_loss_on_each_device_is_the_plain_loss(device, dtype):
    """Each device's own path (on a CPU sums without row maxima in cache-sized chunks, on a GPU
    maxima first in a few large chunks; 1500 rows are three CPU chunks): the plain loss's values
    and gradients."""
    states, weight, target = (t.to(device) for t in problem(n=1500, d=16, vocab=700, dtype=dtype))
    fused, plain = both(states, weight, target, 0.1, True), both(states, weight, target, 0.1, False)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for a, b in zip(fused, plain):
        assert a.device == b.device == states.device
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
def test_fused_under_bf16_autocast_matches_the_plain_autocast_path(device):
    """Both run the projection in bf16; the loss agrees to float32 rounding, the gradients to bf16's."""
    states, weight, target = (t.to(device) for t in problem(n=300, d=32, vocab=500, dtype=torch.float32))
    fused = both(states, weight, target, 0.1, True, autocast=True)
    plain = both(states, weight, target, 0.1, False, autocast=True)
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(fused[1], plain[1], rtol=1e-5, atol=0)
    for a, b in zip(fused[2:], plain[2:]):
        assert a.dtype == b.dtype == torch.float32
        assert ((a - b).norm() / b.norm()).item() < 1e-2


def test_fused_loss_allows_one_backward():
    states, weight, target = problem(n=4, d=3, vocab=5)
    loss, _ = projected_label_smoothed_loss(states.requires_grad_(), weight, target, 0.1)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward"):
        loss.backward()


def test_objective_loss_is_the_plain_loss_of_the_model_logits():
    from mtrain.config import ModelConfig
    from mtrain.loss import Objective
    from mtrain.model import Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(d_model=16, d_ff=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1,
                                    vocab_size=40, dropout=0.0)).double()
    src = torch.randint(4, 40, (3, 7))
    tgt_in, tgt_out = torch.randint(4, 40, (3, 5)), torch.randint(4, 40, (3, 5))
    tgt_out[0, 3:] = 0  # pads: no loss there
    loss, nll = Objective(model, 0.1)(src, tgt_in, tgt_out)
    real = tgt_out != 0
    expected = label_smoothed_loss(model(src, tgt_in)[real], tgt_out[real], 0.1)
    torch.testing.assert_close((loss, nll), expected, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- dropout

def keep_draw(n: int, p: float, seed: int | None = None) -> torch.Tensor:
    """The 15-bit rule's keep decisions for n elements, drawn as keep_bits draws them, as bool: from
    splitmix_words by PyTorch's integer ops, seeded by one draw from torch's generator, seeded with
    `seed` or where it stands when seed is None."""
    if seed is not None:
        torch.manual_seed(seed)
    words = splitmix_words(int(torch.empty((), dtype=torch.int64).random_()), (n + 3) // 4)
    return (words.view(torch.int16)[:n] & 0x7FFF) >= round(p * 32768)


def splitmix64_reference(seed: int, n: int) -> list[int]:
    """splitmix64 as its reference C code states it, in Python's exact integers mod 2^64."""
    out, state, mask = [], seed, (1 << 64) - 1
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        out.append(z ^ (z >> 31))
    return out


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**63 - 1, 2**63 + 5, 2**64 - 1])
def test_splitmix_words_are_splitmix64(seed):
    """PyTorch's wrapping int64 ops give splitmix64's uint64 words bit for bit (seed 0 starts with
    0xE220A8397B1DCDAF, the reference implementation's first output)."""
    got = [w % 2**64 for w in splitmix_words(seed, 1000).tolist()]
    assert got == splitmix64_reference(seed, 1000)
    assert splitmix64_reference(0, 1) == [0xE220A8397B1DCDAF]


@pytest.mark.skipif(native.library() is None, reason=f"kernel not built: {native.status}")
@pytest.mark.parametrize("threshold", [0, 1, 3277, 16384, 32767])
@pytest.mark.parametrize("n", [1, 31, 32, 33, 4 * 1001 + 3])
def test_c_masks_equal_the_pytorch_masks_for_any_thread_count(n, threshold):
    """The C kernel's int16 and int32 masks are PyTorch's splitmix_words rule element by element, with
    one thread or two, at the thresholds where a lane's compare could go wrong, for lengths around
    its blocks of 32."""
    for seed in (7, 2**63 + 11):
        lanes = splitmix_words(seed, (n + 3) // 4).view(torch.int16)[:n]
        expected = ((lanes & 0x7FFF) >= threshold).to(torch.int16).neg_()
        for threads in (1, 2):
            previous = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                assert torch.equal(native.keep_mask(seed, n, threshold, 2), expected)
                assert torch.equal(native.keep_mask(seed, n, threshold, 4), expected.int())
            finally:
                torch.set_num_threads(previous)


def test_masks_follow_torchs_generator_and_every_lane_bit_is_fair(monkeypatch):
    """Each mask is seeded by one draw from torch's default generator: torch.manual_seed and a restored
    RNG state (what a checkpoint resumes from) give the same mask, another seed another; with and
    without the C kernel the same bits. Each of a lane's 15 bits is set in half of 2^18 lanes, to
    within 6 standard deviations of a fair coin."""
    x = torch.empty(1 << 18, dtype=torch.bfloat16)
    torch.manual_seed(21)
    first = keep_bits(x, 0.5)[0]
    state = torch.get_rng_state()
    second = keep_bits(x, 0.5)[0]
    torch.set_rng_state(state)
    assert torch.equal(keep_bits(x, 0.5)[0], second) and not torch.equal(first, second)
    monkeypatch.setattr(native, "keep_mask", lambda *args: None)  # PyTorch's integer ops
    torch.set_rng_state(state)
    assert torch.equal(keep_bits(x, 0.5)[0], second)
    torch.manual_seed(21)
    lanes = splitmix_words(int(torch.empty((), dtype=torch.int64).random_()), 1 << 16).view(torch.int16)
    bits = (lanes[:, None].int() >> torch.arange(15)) & 1
    assert ((bits.double().mean(0) - 0.5).abs() < 6 * 0.5 / (1 << 18) ** 0.5).all()


@pytest.mark.fast_paths
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_mask_is_the_15_bit_rule_without_bool_tensors(dtype):
    """The same draw as the bool version of the rule (keep when the 15-bit uniform is at least
    p * 2^15), the same outputs bit for bit: float32 x times the float32 scale, bfloat16 x scaled
    in float32 and rounded."""
    x = (torch.rand(10_001) + 0.5).to(dtype)
    torch.manual_seed(3)
    y = Dropout(0.1).train()(x)
    keep, threshold = keep_draw(x.numel(), 0.1, seed=3), round(0.1 * 32768)
    scale = 32768 / (32768 - threshold)
    if dtype == torch.float32:
        expected = x * keep.to(dtype).mul_(scale)
    else:
        expected = x.mul(scale).mul_(keep)
    assert y.dtype == dtype and torch.equal(y, expected)


@pytest.mark.parametrize("p", [0.0, 1 / 32768, 0.1, 0.5, 32766 / 32768, 32767 / 32768])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_keep_bits_compares_every_lane_on_its_own(dtype, p):
    """keep_bits compares four 15-bit uniforms per 64-bit word at once; at the thresholds where a
    carry between lanes would show (0, 1 and 2^15 - 1), its mask is the rule's, element by element,
    with all ones (-1) to keep and 0 to drop, in integers of x's width."""
    x = torch.empty(4 * 1001 + 3, dtype=dtype)  # a last, partly used word
    torch.manual_seed(13)
    keep, scale = keep_bits(x, p)
    expected = keep_draw(x.numel(), p, seed=13)
    assert keep.dtype == {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    assert torch.equal(keep, expected.to(keep.dtype).neg_())
    assert scale == 32768 / (32768 - round(p * 32768))


@pytest.mark.fast_paths
@pytest.mark.parametrize("in_scale", [1.0, 1.25])
def test_dropout_linear_is_dropout_of_the_layer(in_scale):
    """dropout_linear(layer, x, p, in_scale) = dropout(layer(x * in_scale)) with the same draw: the
    scales folded into the weight change values by rounding only (float64 here), and the
    gradients by x, the weight and the bias are those of the plain composition."""
    from mtrain.cpu.ops import dropout_linear, keep_scale

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    layer = torch.nn.Linear(8, 6).double()
    grad_out = torch.randn(3, 5, 6, generator=gen, dtype=torch.float64)
    torch.manual_seed(7)
    y = dropout_linear(layer, x, 0.3, True, in_scale)
    (y * grad_out).sum().backward()
    folded = y.detach(), x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone()
    x.grad = layer.weight.grad = layer.bias.grad = None

    keep = keep_draw(x.numel() // 8 * 6, 0.3, seed=7).view(3, 5, 6)
    plain = layer(x * in_scale) * keep * keep_scale(0.3)
    (plain * grad_out).sum().backward()
    expected = plain.detach(), x.grad, layer.weight.grad, layer.bias.grad
    for a, b in zip(folded, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert (folded[0] == 0).sum() == (~keep).sum()  # dropped outputs are exactly 0


def test_dropout_linear_in_evaluation_is_the_layer():
    from mtrain.cpu.ops import dropout_linear

    layer, x = torch.nn.Linear(8, 6), torch.randn(4, 8)
    assert torch.equal(dropout_linear(layer, x, 0.3, False), layer(x))
    assert torch.equal(dropout_linear(layer, x, 0.0, True), layer(x))


@pytest.mark.fast_paths
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_relu_dropout_clears_dropped_and_negative_elements_unscaled(dtype):
    """relu_dropout gives max(0, h) where kept and 0 where dropped, unscaled, with the scale for
    the next layer; its gradient passes exactly where the output is positive."""
    from mtrain.cpu.ops import keep_scale, relu_dropout

    h = torch.randn(50, 40, generator=torch.Generator().manual_seed(2)).to(dtype).requires_grad_()
    torch.manual_seed(11)
    out, scale = relu_dropout(h, 0.25, True)
    keep = keep_draw(h.numel(), 0.25, seed=11).view(50, 40)
    assert scale == keep_scale(0.25)
    assert out.dtype == dtype and torch.equal(out, torch.where(keep, h.detach().clamp_min(0), 0).to(dtype))
    grad = torch.randn(50, 40).to(dtype)
    out.backward(grad)
    assert torch.equal(h.grad, torch.where(keep & (h.detach() > 0), grad, 0).to(dtype))
    evaluated, scale = relu_dropout(h, 0.25, False)
    assert torch.equal(evaluated, torch.relu(h)) and scale == 1.0


@pytest.mark.fast_paths
def test_feed_forward_in_training_is_relu_dropout_linear_dropout():
    """The FFN's training path (ReLU and dropout in one, both scales in W2) equals the module
    sequence ReLU, Dropout, Linear, then the residual dropout, with the same two draws."""
    from mtrain.cpu.model import accelerate
    from mtrain.cpu.ops import keep_scale
    from mtrain.model import FeedForward

    torch.manual_seed(0)
    ffn = accelerate(FeedForward(8, 16, dropout=0.2)).double().train()
    x = torch.randn(4, 3, 8, dtype=torch.float64)
    torch.manual_seed(5)
    y = ffn(x, dropout_p=0.1)
    hidden_keep = keep_draw(4 * 3 * 16, 0.2, seed=5).view(4, 3, 16)
    out_keep = keep_draw(4 * 3 * 8, 0.1).view(4, 3, 8)  # the second draw follows the first
    hidden = torch.relu(ffn[0](x)) * hidden_keep * keep_scale(0.2)
    expected = ffn[3](hidden) * out_keep * keep_scale(0.1)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(ffn.eval()(x), ffn[3](torch.relu(ffn[0](x))))


# --- private PyTorch ops: each is tried once, and a PyTorch where it is missing or changed keeps a public path


def test_softmax_backward_falls_back_to_the_formula_where_the_private_op_changes(monkeypatch):
    from mtrain.cpu import ops

    weights = torch.softmax(torch.randn(4, 7, 11, dtype=torch.float64), -1)
    grad = torch.randn(4, 7, 11, dtype=torch.float64)
    want = weights * (grad - (grad * weights).sum(-1, keepdim=True))
    assert torch.allclose(ops.softmax_backward(grad, weights), want)

    def changed(*args):
        raise TypeError("_softmax_backward_data() takes 3 positional arguments but 4 were given")

    monkeypatch.setattr(torch, "_softmax_backward_data", changed)
    ops._private_softmax_backward.cache_clear()
    try:
        assert torch.allclose(ops.softmax_backward(grad, weights), want)
    finally:
        ops._private_softmax_backward.cache_clear()


def test_decoding_copies_keep_nn_linear_where_onednns_private_op_changes(monkeypatch):
    from mtrain.config import ModelConfig
    from mtrain.cpu import ops
    from mtrain.cpu.quantize import OneDNNLinear, bfloat16_weights
    from mtrain.model import Transformer

    def changed(x, weight, bias, attr, scalars, algorithm):
        raise RuntimeError("mkldnn::_linear_pointwise: unknown argument")

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", changed)
    ops.onednn_linear_runs.cache_clear()
    try:
        assert not ops.onednn_linear_runs(torch.float32) and not ops.onednn_linear_runs(torch.bfloat16)
        model = bfloat16_weights(Transformer(ModelConfig(d_model=32, d_ff=64, n_heads=2, n_encoder_layers=1,
                                                         n_decoder_layers=1, vocab_size=40)).eval())
        assert not any(isinstance(m, OneDNNLinear) for m in model.modules())
        with torch.inference_mode():
            src = torch.randint(4, 40, (2, 5))
            assert model.encode(src).isfinite().all()
    finally:
        ops.onednn_linear_runs.cache_clear()
