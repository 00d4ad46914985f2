"""decode.quantize=int8: every linear layer becomes int8 and nothing else does, the logits stay close
to float32's, `mtrain translate` stays line-aligned with it, and settings that cannot work fail in one
line before any model is loaded."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mtrain.cpu import quantize
from mtrain.search import weights_dtype
from mtrain.config import DecodeConfig, ModelConfig, load_config
from mtrain.ensemble import Ensemble
from mtrain.errors import MtrainError
from mtrain.model import Transformer
from mtrain.cpu.quantize import check_quantize, quantize_int8

CFG = ModelConfig(d_model=64, d_ff=128, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, vocab_size=300, dropout=0.0)
CPU = torch.device("cpu")


def model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(CFG).eval()


def linears(module: nn.Module) -> list[str]:
    return [name for name, m in module.named_modules() if type(m) is nn.Linear]


def test_every_linear_layer_and_only_those_become_int8():
    from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear  # FullRangeLinear's base too

    float_model, int8_model = model(), quantize_int8(model())
    quantized = [name for name, m in int8_model.named_modules() if isinstance(m, DynamicInt8Linear)]
    assert linears(int8_model) == [] and sorted(quantized) == sorted(linears(float_model))
    assert "proj" in quantized  # the tied output projection: the largest matmul of a decoding step
    # Embeddings and layer norms stay float32 and untouched (the projection got its own int8 copy).
    assert torch.equal(int8_model.tgt_embed.weight, float_model.tgt_embed.weight)
    assert int8_model.tgt_embed.weight.dtype == torch.float32
    assert torch.equal(int8_model.decoder[0].norm1.weight, float_model.decoder[0].norm1.weight)


@pytest.mark.parametrize("full_range", [True, False])
def test_int8_logits_stay_close_to_float32(monkeypatch, full_range):
    # 8-bit weights (one scale per output row) and 8- or 7-bit activations: each product carries a
    # rounding error of about 1/254 (1/127) of its operands' ranges, so the logits move by a few
    # percent of their spread at most; a wrong scale, a transposed weight or a lost bias moves them by 100%.
    if full_range and not quantize._full_range():
        pytest.skip("without VNNI, 8-bit activations saturate the 16-bit sums of u8 x s8 products (a relative "
                    "error of 0.29 on an AVX2-only CPU), which is why mtrain uses them only with VNNI")
    monkeypatch.setattr(quantize, "_full_range", lambda: full_range)
    src = torch.randint(4, CFG.vocab_size, (6, 9))
    tgt = torch.randint(4, CFG.vocab_size, (6, 7))
    with torch.inference_mode():
        expected = model()(src, tgt)
        got = quantize_int8(model())(src, tgt)
    error = (got - expected).norm() / expected.norm()
    assert error < 0.05, f"relative error {error:.3f}"


def test_where_the_full_range_layers_private_op_changes_int8_keeps_pytorchs_layer(monkeypatch):
    """FullRangeLinear calls torch.ops.quantized.linear_dynamic on a private attribute: a PyTorch
    where that fails keeps PyTorch's own dynamic layer, and int8 decoding still runs."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear

    def changed(*args, **kwargs):
        raise RuntimeError("quantized::linear_dynamic: unknown argument")

    monkeypatch.setattr(torch.ops.quantized, "linear_dynamic", changed)
    quantize._full_range_runs.cache_clear()
    try:
        assert not quantize._full_range_runs() and not quantize._full_range()
        int8_model = quantize_int8(model())
        layers = [m for m in int8_model.modules() if isinstance(m, DynamicInt8Linear)]
        assert layers and all(type(m) is DynamicInt8Linear for m in layers)
    finally:
        quantize._full_range_runs.cache_clear()
    monkeypatch.undo()
    src = torch.randint(4, CFG.vocab_size, (2, 5))
    with torch.inference_mode():
        assert int8_model(src, src).isfinite().all()


def test_an_ensemble_quantizes_each_member():
    ensemble = quantize_int8(Ensemble([model(0), model(1)]))
    assert all(linears(member) == [] for member in ensemble.models)


@pytest.mark.parametrize("quantize_mode, amp, device, words", [
    ("int4", "off", "cpu", "use off or int8"),
    ("int8", "bf16", "cpu", "drop decode.amp=bf16"),
    ("int8", "off", "cuda", "runs on a CPU only"),
])
def test_settings_that_cannot_work_fail_in_one_line(quantize_mode, amp, device, words):
    with pytest.raises(MtrainError, match=words) as caught:
        check_quantize(quantize_mode, amp, torch.device(device))
    assert "\n" not in str(caught.value)


def test_training_on_a_gpu_with_int8_validation_fails_before_any_work(tmp_path):
    """Validation decodes with the run's decode settings, and int8 has no GPU kernels: the run
    stops at once in one line, not with a traceback at its first validation."""
    from mtrain.distributed import DistInfo
    from mtrain.trainer import Trainer

    cfg = load_config(None, ["decode.quantize=int8"])
    with pytest.raises(MtrainError, match="decode.quantize=int8 runs on a CPU only; on cuda set decode.quantize=off"):
        Trainer(cfg, tmp_path / "no-data-needed", tmp_path / "run", torch.device("cuda"), DistInfo())
    assert not (tmp_path / "run").exists()


def test_off_is_always_allowed():
    check_quantize("off", "bf16", torch.device("cuda"))  # no error: nothing to quantize


def test_decode_config_has_quantize_off_by_default():
    assert DecodeConfig().quantize == "off"


def test_an_exported_folder_keeps_its_own_quantization(tmp_path):
    from mtrain.translate import load_for_decoding

    with pytest.raises(MtrainError, match="exported folder keeps the quantization"):
        load_for_decoding(tmp_path, CPU, DecodeConfig(quantize="int8"))


def test_bfloat16_weights_cast_every_weight_but_the_sinusoids():
    """decode.amp=bf16 decodes a bfloat16 copy: every parameter bfloat16, the sinusoid table float32
    (each position's embedding is rounded once), each member of an ensemble alike."""
    bf16 = quantize.bfloat16_weights(model())
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert bf16.pe.dtype == torch.float32 and weights_dtype(bf16) == torch.bfloat16
    pair = quantize.bfloat16_weights(Ensemble([model(1), model(2)]))
    assert [weights_dtype(member) for member in pair.models] == [torch.bfloat16] * 2
    assert weights_dtype(model()) == torch.float32


@torch.inference_mode()
def test_bfloat16_logits_stay_close_to_float32():
    """Teacher-forced logits of the bfloat16 copy are float32's to within bfloat16's rounding through
    the layers: 5% of the largest logit (a bfloat16 value carries 8 significant bits, 0.4%)."""
    torch.manual_seed(0)
    src, tgt = torch.randint(4, CFG.vocab_size, (8, 12)), torch.randint(4, CFG.vocab_size, (8, 9))
    reference = model()(src, tgt)
    got = quantize.bfloat16_weights(model())(src, tgt)
    assert got.dtype == torch.bfloat16
    assert (got.float() - reference).abs().max() <= 0.05 * reference.abs().max()


@pytest.mark.fast_paths
@pytest.mark.skipif(not quantize.onednn_linear_runs(torch.bfloat16), reason="this PyTorch has no oneDNN linear")
def test_a_bfloat16_copy_runs_its_linear_layers_through_onednn_with_the_relu_fused():
    """Every linear layer of the bfloat16 copy is a OneDNNLinear on the same parameters (the output
    projection stays tied to the embeddings), each FFN's ReLU is its first layer's, and the logits
    are those of the same bfloat16 weights through nn.Linear and nn.ReLU, with and without gradients."""
    from mtrain.model import FeedForward

    fast = quantize.bfloat16_weights(model())
    assert all(type(m) is quantize.OneDNNLinear for m in fast.modules() if isinstance(m, nn.Linear))
    assert fast.proj.weight is fast.tgt_embed.weight
    ffns = [m for m in fast.modules() if isinstance(m, FeedForward)]
    assert ffns and all(m[0].activation == "relu" and isinstance(m[1], nn.Identity) for m in ffns)
    plain = model().to(torch.bfloat16)
    plain.pe = plain.pe.float()
    torch.manual_seed(1)
    src, tgt = torch.randint(4, CFG.vocab_size, (8, 12)), torch.randint(4, CFG.vocab_size, (8, 9))
    with torch.inference_mode():
        reference = plain(src, tgt).float()
        got = fast(src, tgt).float()
    assert (got - reference).abs().max() <= 0.01 * reference.abs().max()
    assert (fast(src, tgt).float() - reference).abs().max() <= 0.01 * reference.abs().max()  # gradients on


@pytest.mark.skipif(not quantize.onednn_linear_runs(torch.bfloat16), reason="this PyTorch has no oneDNN linear")
@pytest.mark.parametrize("activation,bias", [("none", True), ("relu", True), ("none", False)])
@torch.no_grad()
def test_a_packed_weight_gives_the_unpacked_kernels_result_and_follows_the_weight(activation, bias):
    """The weight packed once into oneDNN's layout gives exactly what the same kernel gives on the
    plain weight, at row counts from 1 to many; after the weight is changed in place, or replaced,
    the layer uses the new one."""
    torch.manual_seed(0)
    layer = quantize.OneDNNLinear(48, 80, bias=bias).to(torch.bfloat16)
    layer.activation = activation

    def unpacked(x):
        return torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, activation, [], "")

    for rows in (1, 7, 64, 300):
        x = torch.randn(rows, 1, 48).to(torch.bfloat16)
        assert torch.equal(layer(x), unpacked(x))
    packed = layer.packed_weight()
    assert layer.packed_weight() is packed  # packed once while the weight stays the same
    x = torch.randn(5, 48).to(torch.bfloat16)
    layer.weight.mul_(-2.0)  # in place
    assert torch.equal(layer(x), unpacked(x))
    layer.weight = nn.Parameter(torch.randn(80, 48).to(torch.bfloat16))  # a new tensor
    assert torch.equal(layer(x), unpacked(x))
    assert layer.packed_weight() is not packed
    copied = copy.deepcopy(layer)  # oneDNN's packed tensor cannot be copied: the copy packs its own
    assert torch.equal(copied(x), layer(x)) and copied.packed_weight() is not layer.packed_weight()
    with torch.inference_mode():  # weights without a version counter: packed at every call
        made_here = quantize.OneDNNLinear(48, 80, bias=bias).to(torch.bfloat16)
        made_here.weight.mul_(3.0)
        assert torch.equal(made_here(x), torch.ops.mkldnn._linear_pointwise(x, made_here.weight, made_here.bias,
                                                                            "none", [], ""))


def test_without_onednn_the_bfloat16_copy_keeps_plain_linear_layers(monkeypatch):
    monkeypatch.setattr(quantize, "onednn_linear_runs", lambda dtype: False)
    bf16 = quantize.bfloat16_weights(model())
    assert linears(bf16) == linears(model()) and not any(isinstance(m, quantize.OneDNNLinear) for m in bf16.modules())
