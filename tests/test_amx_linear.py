"""mtrain.cpu.native.amx_linear: bfloat16 linear layers on the AMX tile units, against float32
sums rounded once, on every shape it takes; what it declines; and the decoding copy's layers that
use it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mtrain.cpu import native, quantize, switches
from mtrain.config import ModelConfig
from mtrain.model import Transformer
from mtrain.cpu.quantize import bfloat16_weights
from mtrain.search import beam_search, greedy_search

needs_amx = pytest.mark.skipif(not native.amx_ready(),
                               reason=f"no AMX-BF16 here, or the kernels are not built ({native.status})")
# One rounding to bfloat16 (8 significant bits) moves a value by at most 2^-8 of itself.
UNIT_ROUNDOFF = 2.0 ** -8


def operands(M, K, N, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).bfloat16()
    w = torch.randn(N, K, generator=gen).bfloat16()
    b = torch.randn(N, generator=gen).bfloat16() if bias else None
    return x, w, b


def assert_rounded_once(got, x, w, b, relu):
    """got is the float32 sum x W^T + b (ReLU where asked) rounded once to bfloat16: within the
    rounding's 2^-8 of the value, plus what float32 summation in another order may move it."""
    exact = x.double() @ w.double().T + (0.0 if b is None else b.double())
    if relu:
        exact = exact.clamp_min(0.0)
    order = 64 * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)  # float32 sums in any order
    error = (got.double() - exact).abs()
    assert got.dtype == torch.bfloat16
    assert bool((error <= UNIT_ROUNDOFF * exact.abs() * (1 + 2.0 ** -7) + order).all()), error.max()


@needs_amx
@pytest.mark.parametrize("M", [1, 15, 32, 33, 100])
@pytest.mark.parametrize("K,N", [(32, 32), (64, 96), (1024, 256), (64, 40), (96, 1000)])
@pytest.mark.parametrize("bias,relu", [(True, False), (True, True), (False, False)])
def test_amx_linear_is_the_float32_sum_rounded_once(M, K, N, bias, relu):
    x, w, b = operands(M, K, N, bias)
    got = native.amx_linear(x, native.amx_pack(w), b, relu, N)
    assert got.shape == (M, N)
    assert_rounded_once(got, x, w, b, relu)
    if relu:
        assert bool((got >= 0).all())


@needs_amx
def test_amx_linear_reads_strided_rows_and_keeps_leading_dimensions():
    """Rows that are a view of a wider tensor, and (B, T, K) inputs, give the contiguous rows' result."""
    x, w, b = operands(70, 64, 64)
    wide = torch.zeros(70, 96, dtype=torch.bfloat16)
    wide[:, 16:80] = x
    packed = native.amx_pack(w)
    plain = native.amx_linear(x, packed, b, False, 64)
    assert torch.equal(native.amx_linear(wide[:, 16:80], packed, b, False, 64), plain)
    assert torch.equal(native.amx_linear(x.view(7, 10, 64), packed, b, False, 64), plain.view(7, 10, 64))


def test_amx_pack_puts_each_weight_where_the_tiles_read_it():
    """Tile (n // 16, k // 32) row (k % 32) // 2, column n % 16, element k % 2 holds W[n, k]; the
    outputs past N, up to a multiple of 32, are zeros."""
    w = torch.arange(1, 1 + 40 * 96, dtype=torch.float32).view(40, 96).bfloat16()
    packed = native.amx_pack(w)
    assert packed.shape == (4, 3, 16, 16, 2)
    for n, k in [(0, 0), (5, 33), (17, 2), (39, 95), (32, 64)]:
        assert packed[n // 16, k // 32, (k % 32) // 2, n % 16, k % 2] == w[n, k]
    assert not packed[2, :, :, 8:].any() and not packed[3].any()


@needs_amx
def test_amx_linear_declines_a_weight_or_bias_not_of_the_layer():
    """A packed weight of another width, dtype or layout, or a bias of another length, dtype or
    layout, is declined (None: the caller's oneDNN kernel then reports the mismatch), never read."""
    x, w, b = operands(8, 64, 96)
    packed = native.amx_pack(w)
    assert native.amx_linear(x, packed, b, False, 96) is not None
    assert native.amx_linear(torch.randn(8, 128).bfloat16(), packed, b, False, 96) is None  # other K
    assert native.amx_linear(x, packed, b, False, 200) is None  # other N
    assert native.amx_linear(x, native.amx_pack(w.float()), b, False, 96) is None  # float32 weight
    assert native.amx_linear(x, packed, b.float(), False, 96) is None
    assert native.amx_linear(x, packed, b[:64], False, 96) is None
    assert native.amx_linear(x, packed, torch.randn(192).bfloat16()[::2], False, 96) is None  # strided


@pytest.mark.skipif(not quantize.onednn_linear_runs(torch.bfloat16), reason="this PyTorch has no oneDNN linear")
@torch.no_grad()
def test_a_decoding_layer_given_the_wrong_input_fails_as_onednn_does():
    """An input of the wrong width, or a layer whose weight is not bfloat16, goes to oneDNN, which
    raises, rather than to the tiles, which would read past the weight."""
    layer = quantize.OneDNNLinear(64, 96).to(torch.bfloat16)
    with pytest.raises(RuntimeError):
        layer(torch.randn(4, 128).bfloat16())
    float32_weight = quantize.OneDNNLinear(64, 96, bias=False)
    with pytest.raises(RuntimeError):
        float32_weight(torch.randn(4, 64).bfloat16())


@pytest.mark.fast_paths
def test_amx_takes_only_what_the_kernel_is_built_for(monkeypatch):
    monkeypatch.setattr(native, "amx_ready", lambda: True)
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert native.amx_takes(x)
    assert not native.amx_takes(x.float())  # float32
    assert not native.amx_takes(torch.zeros(4, 48, dtype=torch.bfloat16))  # K not a multiple of 32
    assert not native.amx_takes(torch.zeros(64, 4, dtype=torch.bfloat16).T)  # columns strided
    assert not native.amx_takes(torch.zeros(native.AMX_MAX_ROWS + 1, 64, dtype=torch.bfloat16))
    assert not native.amx_takes(torch.zeros(4, 64, dtype=torch.bfloat16, device="meta"))
    monkeypatch.setattr(native, "amx_ready", lambda: False)
    assert not native.amx_takes(x)


@pytest.mark.skipif(not quantize.onednn_linear_runs(torch.bfloat16), reason="this PyTorch has no oneDNN linear")
@torch.no_grad()
def test_without_amx_the_decoding_layer_stays_with_onednn(monkeypatch):
    """Where the tiles cannot be used the layer never packs for them, and gives oneDNN's result."""
    monkeypatch.setattr(native, "amx_ready", lambda: False)
    layer = quantize.OneDNNLinear(64, 96).to(torch.bfloat16)
    x = torch.randn(5, 64).bfloat16()
    assert torch.equal(layer(x), torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "none", [], ""))
    assert "amx" not in layer.__dict__.get("_packings", {})


@needs_amx
@pytest.mark.parametrize("activation", ["none", "relu"])
@torch.no_grad()
def test_the_decoding_layer_uses_the_tiles_and_follows_its_weight(activation):
    """Up to AMX_MAX_ROWS rows the layer is amx_linear on its weight, packed once while the weight
    stays the same and again after an in-place change or a new weight; more rows go to oneDNN."""
    torch.manual_seed(0)
    layer = quantize.OneDNNLinear(64, 96).to(torch.bfloat16)
    layer.activation = activation
    relu = activation == "relu"
    x = torch.randn(40, 64).bfloat16()
    assert torch.equal(layer(x), native.amx_linear(x, native.amx_pack(layer.weight), layer.bias, relu, 96))
    packed = layer.packed_weight("amx")
    assert layer.packed_weight("amx") is packed
    layer.weight.mul_(-2.0)
    assert_rounded_once(layer(x), x, layer.weight, layer.bias, relu)
    layer.weight = nn.Parameter(torch.randn(96, 64).bfloat16())
    assert_rounded_once(layer(x), x, layer.weight, layer.bias, relu)
    assert layer.packed_weight("amx") is not packed
    copied = copy.deepcopy(layer)  # copies leave every packed weight out and pack their own
    assert torch.equal(copied(x), layer(x)) and "_packings" not in copy.copy(layer).__getstate__()
    many = torch.randn(native.AMX_MAX_ROWS + 1, 64).bfloat16()
    assert torch.equal(layer(many), torch.ops.mkldnn._linear_pointwise(many, layer.weight, layer.bias, activation,
                                                                      [], ""))


@needs_amx
def test_searches_agree_with_and_without_the_tiles(monkeypatch):
    """A bfloat16 model whose every decoder layer takes the tiles decodes, greedy and beam, to the same
    outputs as with oneDNN's layers for nearly every sentence (a different summation order may settle
    a near-tie otherwise)."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=64, d_ff=128, n_heads=2, n_encoder_layers=2, n_decoder_layers=2, vocab_size=50,
                      dropout=0.0, max_len=64)
    model = bfloat16_weights(Transformer(cfg).eval())
    gen = torch.Generator().manual_seed(3)
    src = torch.randint(4, 50, (12, 10), generator=gen)
    max_len = torch.full((12,), 12)
    calls = []
    tiles = native.amx_linear
    monkeypatch.setattr(native, "amx_linear", lambda *args: calls.append(1) or tiles(*args))
    with_tiles = (greedy_search(model, src, max_len), beam_search(model, src, 4, 0.6, max_len))
    assert calls  # the decoder's layers went to the tiles
    monkeypatch.setattr(switches, "amx_linear", False)
    without = (greedy_search(model, src, max_len), beam_search(model, src, 4, 0.6, max_len))
    assert sum(a == b for a, b in zip(with_tiles[0], without[0])) >= 11
    assert sum(a[0][0] == b[0][0] for a, b in zip(with_tiles[1], without[1])) >= 11


@needs_amx
def test_stepwise_logits_with_the_tiles_are_onednns(monkeypatch):
    """Teacher-forced step by step through the cache, each step's logits with the decoder's layers on
    the tiles are oneDNN's to float32 summation order (a random model's searches repeat one token,
    so the logits say more than their outputs)."""
    torch.manual_seed(1)
    cfg = ModelConfig(d_model=64, d_ff=128, n_heads=2, n_encoder_layers=2, n_decoder_layers=2, vocab_size=50,
                      dropout=0.0, max_len=64)
    model = bfloat16_weights(Transformer(cfg).eval())
    gen = torch.Generator().manual_seed(4)
    src, tgt = torch.randint(4, 50, (6, 9), generator=gen), torch.randint(4, 50, (6, 8), generator=gen)

    def stepwise():
        with torch.inference_mode():
            memory, cache = model.encode(src), model.new_cache()
            return torch.cat([model.decode(tgt[:, t : t + 1], memory, src, cache).float() for t in range(8)], 1)

    tiles = stepwise()
    monkeypatch.setattr(switches, "amx_linear", False)
    onednn = stepwise()
    assert (tiles - onednn).abs().max() <= 0.01 * onednn.abs().max()
