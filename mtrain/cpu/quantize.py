"""Decoding with int8 linear layers (decode.quantize=int8), on a CPU; and with bfloat16 weights
(decode.amp=bf16, bfloat16_weights).

Every nn.Linear of the model (attention projections, feed-forward layers, the output projection)
is replaced by PyTorch's dynamically quantized one: weights are stored as int8 with one scale per
output row, each input batch is quantized on the fly with one range of its own (8 bits on CPUs with
VNNI, 7 elsewhere: see _full_range), the product is accumulated in int32 by PyTorch's x86 (fbgemm)
kernels and scaled back to float32.
Embeddings, layer norms, attention's softmax and the search stay in float32. At decoding's small
batches the linear layers are most of the time, and int8 multiplies them 1.7-3x faster than float32
on the CPUs measured (benchmarks/results/amd-epyc-zen4/NOTES.md). Translations differ from float32's on a share of lines;
the share and the BLEU change on real models are in benchmarks/results/intel-xeon-amx/NOTES.md.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
from torch import nn

from mtrain.cpu import cache as cpu_cache
from mtrain.cpu import native, switches
from mtrain.errors import MtrainError
from mtrain.hardware import cpu_has_vnni
from mtrain.cpu.ops import on_fast_cpu, onednn_linear_runs, same_as_linear

QUANTIZE_MODES = ("off", "int8")


def check_quantize(quantize: str, amp: str, device: torch.device) -> None:
    """One-line errors for decode.quantize settings that cannot work, before any model is loaded."""
    if quantize not in QUANTIZE_MODES:
        raise MtrainError(f"decode.quantize={quantize!r}: unknown value; use off or int8")
    if quantize == "off":
        return
    if device.type != "cpu":
        raise MtrainError(f"decode.quantize=int8 runs on a CPU only; on {device.type} set decode.quantize=off "
                          "(decode.amp=bf16 decodes in bfloat16 there), or use --device cpu")
    if amp != "off":
        raise MtrainError(f"decode.quantize=int8 decodes in float32 around its int8 layers; drop decode.amp={amp} "
                          "(or decode.quantize)")
    engines = torch.backends.quantized.supported_engines
    if not any(engine in engines for engine in ("x86", "fbgemm")):
        raise MtrainError("decode.quantize=int8: this PyTorch build has no x86/fbgemm int8 kernels; "
                          "use decode.quantize=off, or export to CTranslate2 with --quantization int8")


def quantize_int8(model: nn.Module) -> nn.Module:
    """`model` with every nn.Linear replaced by a dynamically quantized int8 one (in place), per-channel
    weight scales. For an ensemble, each member."""
    members = getattr(model, "models", None)
    if members is not None:  # mtrain.ensemble.Ensemble
        for member in members:
            quantize_int8(member)
        return model
    try:
        return _dynamic_int8(model, {nn.Linear: _full_range_linear()} if _full_range() else None)
    except ImportError:
        raise MtrainError("decode.quantize=int8 needs torch.ao.quantization, which this PyTorch lacks; use "
                          "decode.quantize=off, or export to CTranslate2 with --quantization int8") from None


def _dynamic_int8(module: nn.Module, mapping: dict | None) -> nn.Module:
    """`module` (in place) with its nn.Linear layers dynamically quantized, per-channel weight
    scales; mapping: the quantized class to use, None for PyTorch's own."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with _quiet():
        # PyTorch marks torch.ao.quantization for future removal in favour of torchao, whose int8 path
        # is no faster than float32 on a CPU without torch.compile; the warning says nothing to a user.
        quantize_dynamic(module, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True,
                         mapping=mapping)
    return module


def _full_range() -> bool:
    """Whether activations may use all 8 bits. PyTorch quantizes them to 7 (reduce_range) because
    AVX2's u8 x s8 multiply-add saturates a 16-bit sum of two products; VNNI's adds into 32 bits,
    so on CPUs with it the eighth bit is free precision."""
    return cpu_has_vnni() and _full_range_runs()


@functools.cache
def _full_range_runs() -> bool:
    """Whether the full-range layer works in this PyTorch: it calls torch.ops.quantized.linear_dynamic
    on the layer's private _packed_params, so it is tried once on a small layer against float32;
    where either is missing or changed, int8 decoding keeps PyTorch's own dynamic layer (7-bit
    activations, a little less precise, the same speed)."""
    generator = torch.Generator().manual_seed(0)
    layer = nn.Sequential(nn.Linear(32, 16))
    x = torch.randn(4, 32, generator=generator)
    try:
        with torch.no_grad():
            want = layer(x)
            got = _dynamic_int8(layer, {nn.Linear: _full_range_linear()})(x)
    except (AttributeError, ImportError, RuntimeError, TypeError):
        return False
    return got.shape == want.shape and bool(torch.allclose(got, want, atol=0.1, rtol=0.1))


@functools.cache
def _full_range_linear():
    from torch.ao.nn.quantized.dynamic import Linear

    class FullRangeLinear(Linear):
        """A dynamically quantized linear layer whose activations use all 8 bits (see _full_range)."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.quantized.linear_dynamic(x, self._packed_params._packed_params,
                                                      reduce_range=False).to(x.dtype)

    return FullRangeLinear


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        yield


def bfloat16_weights(model):
    """`model` (in place; for an ensemble, each member) with its weights in bfloat16, for decode.amp=bf16.

    Decoding then multiplies bfloat16 by bfloat16 directly (AMX or AVX512-BF16 on a CPU) instead
    of under autocast, which casts every layer's input and output and, at decoding's small steps,
    cost a third of what bfloat16 saved. The residual stream and layer norms are bfloat16 too; the
    sinusoid table stays float32, so each position's embedding is rounded once. Attention runs
    in float32 on a CPU (mtrain.attention); searches upcast the logits to float32 block by block."""
    members = getattr(model, "models", None)
    if members is not None:  # mtrain.ensemble.Ensemble
        for member in members:
            bfloat16_weights(member)
        return model
    model.to(torch.bfloat16)
    model.pe = model.pe.float()
    # oneDNN's bfloat16 kernels refuse CPUs without AVX-512 (or AVX-NE-CONVERT): nn.Linear's own path stays there
    if on_fast_cpu(model.pe) and onednn_linear_runs(torch.bfloat16):
        _onednn_linears(model)
    return cpu_cache.for_decoding(model)


class OneDNNLinear(nn.Linear):
    """nn.Linear through oneDNN's linear with a fused activation (torch.ops.mkldnn._linear_pointwise,
    the kernel torch.compile's CPU backend emits), for a bfloat16 decoding copy on a CPU. On the
    2-core AMX host, at decoding's shapes, it took 78 us where F.linear took 121 (273 x 256 x 1024),
    2.17 ms against 3.04 (1365 x 256 x 8000), with the same result; with the FFN's ReLU fused in,
    0.36 ms where linear and a separate bfloat16 ReLU took 2.2 (1365 x 256 x 1024).

    The weight goes in oneDNN's blocked layout once (packed_weight), as torch.compile's frozen
    graphs do, instead of being reordered into it at every call: at 256 rows a 256 x 768 layer then
    took 95 us instead of 142, the 256 x 8000 projection 563 instead of 764, with the same result,
    and bfloat16 greedy decoding ran 1.06x, beam 5 1.03x as fast (benchmarks/results/intel-xeon-amx/NOTES.md). The packed
    copy costs the weight's memory once more (about 120 MB for the paper's base model in bfloat16).

    Where the CPU has AMX and mtrain.cpu.native loads, up to native.AMX_MAX_ROWS rows (every
    decoding step; the encoder's larger batches stay with oneDNN) go to native.amx_linear
    instead, on a second packed copy (the weight's memory once more again). oneDNN spends about
    20 us on each call before it multiplies, and ran 1024 -> 256 at 315 rows on one of two threads:
    the kernel took 12 us where oneDNN took 24 (64 x 256 -> 256) and 104 against 195 (315 x 1024 ->
    256), with outputs equal to oneDNN's (benchmarks/amx_linear.py). Inference only: with gradients
    on, it is an nn.Linear (and its activation)."""

    activation = "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            y = super().forward(x)
            return torch.relu(y) if self.activation == "relu" else y
        if switches.amx_linear and native.amx_takes(x):  # it declines weights not of x's layer
            y = native.amx_linear(x, self.packed_weight("amx"), self.bias, self.activation == "relu",
                                       self.out_features)
            if y is not None:
                return y
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight(), self.bias, self.activation, [], "")

    def __getstate__(self) -> dict:
        """Copies and pickles leave the packed weights out (oneDNN's opaque tensor has no storage to
        copy); they pack their own on first use."""
        return {key: value for key, value in self.__dict__.items() if key != "_packings"}

    def packed_weight(self, kernel: str = "onednn") -> torch.Tensor:
        """The weight in the layout of `kernel` (oneDNN's, or native.amx_pack's for "amx"),
        packed again whenever the weight changed since (a new tensor, or an in-place write, which
        bumps its version). A weight made under torch.inference_mode has no version to tell an
        in-place write by: it is packed at every call."""
        pack = _PACKINGS[kernel]
        weight = self.weight
        if weight.is_inference():
            return pack(weight)
        key = (weight.data_ptr(), weight.dtype, weight.shape, weight._version)
        packings = self.__dict__.setdefault("_packings", {})
        if kernel not in packings or packings[kernel][0] != key:
            packings[kernel] = key, pack(weight.detach())
        return packings[kernel][1]


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight in oneDNN's blocked layout (torch.ops.mkldnn._reorder_linear_weight, private), or
    as it is where that op is missing or gives a layout the linear kernel does not read as the
    plain weight: oneDNN then reorders it at each call, slower but the same."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None) if _onednn_packing_works() else weight


@functools.cache
def _onednn_packing_works() -> bool:
    def packed_linear_relu(x, weight, bias):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "relu", [], "")

    return same_as_linear(packed_linear_relu, torch.bfloat16)


_PACKINGS = {"onednn": _onednn_pack, "amx": native.amx_pack}


def _onednn_linears(model: nn.Module) -> None:
    """Every nn.Linear of `model` becomes a OneDNNLinear in place (same parameters, so the tied output
    projection stays tied); each FFN's ReLU moves into its first layer."""
    from mtrain.model import FeedForward

    for module in list(model.modules()):
        if isinstance(module, FeedForward) and isinstance(module[1], nn.ReLU):
            module[0].__class__ = OneDNNLinear
            module[0].activation = "relu"
            module[1] = nn.Identity()
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDNNLinear
