"""Device and precision choices (`--device auto`, train.amp), and what machine this is, for the
records that benchmarks and the recipe report keep next to their numbers."""

from __future__ import annotations

import contextlib
import os
import platform

import torch

from mtrain.cpu.build import cpuinfo_fields
from mtrain.errors import MtrainError


X86 = ("x86_64", "amd64", "i386", "i686")


def cpu_bf16_isa() -> str | None:
    """How this CPU multiplies bfloat16 in hardware: "AMX", "AVX512-BF16" (x86), "oneDNN" (what
    oneDNN reports elsewhere, e.g. aarch64 with the BF16 extension), or None when bf16 matmuls would
    be emulated: 0.9 GFLOP/s against 45 in float32 on one core of an AVX2-only AMD EPYC, and a
    training step took 35 s instead of 1.3 s (docs/recipe.md). torch defines its x86 checks on every
    architecture (False off x86), so the machine decides which question is asked."""
    if platform.machine().lower() not in X86:
        return "oneDNN" if onednn_has_bf16() else None
    cpu = torch.cpu
    checks = {"AMX": getattr(cpu, "_is_amx_tile_supported", None),
              "AVX512-BF16": getattr(cpu, "_is_avx512_bf16_supported", None)}
    return next((name for name, check in checks.items() if callable(check) and check()), None)


def onednn_has_bf16() -> bool:
    """oneDNN's own check for native bfloat16 (on aarch64: the BF16 extension)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (x86 AMX or AVX512-BF16; oneDNN's check
    elsewhere); see cpu_bf16_isa."""
    return cpu_bf16_isa() is not None


def cpu_has_vnni() -> bool:
    """Whether this CPU has AVX-512 VNNI, whose int8 dot products add u8 x s8 products into 32 bits.
    Without it (AVX2), pairs of products are added in 16 bits first, which saturate at full 8-bit
    range (mtrain.cpu.quantize, mtrain.export.runtime.int8_saturates)."""
    check = getattr(torch.cpu, "_is_vnni_supported", None)
    return bool(callable(check) and check())


def cpu_model(fields: dict[str, str] | None = None) -> str | None:
    """The CPU's marketing name from /proc/cpuinfo (Linux; or `fields` read from it), else
    platform.processor()."""
    name = (cpuinfo_fields() if fields is None else fields).get("model name")
    return name if name is not None else platform.processor() or None


def cpu_signature(fields: dict[str, str] | None = None) -> str | None:
    """The CPU's "family F model M stepping S" from /proc/cpuinfo (Linux x86; or `fields` read from
    it), else None. Under a hypervisor the marketing name is often generic ("Intel(R) Xeon(R)
    Processor"); the signature still tells two CPU generations apart, so results taken on them are
    not compared as one host's."""
    fields = cpuinfo_fields() if fields is None else fields
    if not all(key in fields for key in ("cpu family", "model", "stepping")):
        return None
    return f"family {fields['cpu family']} model {fields['model']} stepping {fields['stepping']}"


def cpu_summary() -> dict[str, object]:
    """The CPU facts that change speed: model, the vector ISA torch dispatches to, native bf16."""
    fields = cpuinfo_fields()
    return {"cpu_model": cpu_model(fields), "cpu_signature": cpu_signature(fields),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": cpu_has_native_bf16()}


def machine_record() -> dict[str, object]:
    """Everything a stored result says about where it was measured (benchmarks/ and the recipe
    report each add their thread count and what else only they know)."""
    return {"machine": platform.machine(), "processor": platform.processor() or None, "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "mkl_dispatch": _mkl_status(), **cpu_summary()}


def resolve_device(device: str) -> torch.device:
    """`auto` is cuda when available, else cpu; unusable names fail in one line."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise MtrainError(f"--device {device}: not a device name; use auto, cpu, cuda or cuda:N") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise MtrainError(f"--device {device}: CUDA is not available here; use --device cpu (or auto)")
    count = torch.cuda.device_count() if resolved.type == "cuda" else 0
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= count:
        raise MtrainError(f"--device {device}: {count} GPU(s) are visible here (cuda:0 to cuda:{count - 1}); "
                          "name one of them, or check CUDA_VISIBLE_DEVICES")
    return resolved


def cuda_index(device: torch.device) -> int:
    """The index of the GPU a CUDA device means: plain "cuda" (one process on one GPU) is the
    current device. Some torch.cuda calls (get_per_process_memory_fraction) refuse a device
    without an index."""
    return device.index if device.index is not None else torch.cuda.current_device()


def cuda_has_native_bf16(device: torch.device) -> bool:
    """Whether this GPU multiplies bfloat16 in hardware: compute capability 8.0 on (Ampere and
    later) or ROCm. torch.cuda.is_bf16_supported() also says yes where bfloat16 is only emulated
    (a V100 or T4, capability 7.x, where float16 with a GradScaler is the fast choice), and it
    asks about the current device, which need not be the one `device` names."""
    if torch.version.hip:
        return True
    return torch.cuda.get_device_capability(cuda_index(device))[0] >= 8


def resolve_amp(amp: str, device: torch.device, key: str = "train.amp") -> torch.dtype | None:
    """train.amp -> autocast dtype (None = float32). auto = bfloat16 where the hardware multiplies it
    natively: CPUs with AMX or AVX512-BF16 (1.5-2x the float32 tokens/s, benchmarks/results/NOTES.md) and
    GPUs of compute capability 8.0 on; float16 on older GPUs (with a GradScaler); float32 on other CPUs, where
    bf16 would be emulated (~30x slower). An explicit bf16 on such a CPU also falls back to float32
    (see amp_note). `key` names the setting in errors (decode.amp takes the same values)."""
    if amp == "off":
        return None
    if amp == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if cuda_has_native_bf16(device) else torch.float16
        return torch.bfloat16 if device.type == "cpu" and cpu_has_native_bf16() else None
    if amp == "bf16":
        if device.type == "cpu" and not cpu_has_native_bf16():
            return None
        return torch.bfloat16
    if amp == "fp16":
        if device.type != "cuda":
            raise MtrainError(f"{key}=fp16 needs a CUDA device; use {key}=bf16 or off on CPU")
        return torch.float16
    raise MtrainError(f"{key}={amp!r}: unknown value; use auto, bf16, fp16 or off")


def decode_autocast(amp: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The autocast decoding runs under for decode.amp; off (or bf16 where it is not native): none,
    float32 even inside a caller's autocast."""
    dtype = resolve_amp(amp, device, key="decode.amp")
    if dtype is None:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype)


PRECISION_NAMES = {None: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def precision_name(dtype: torch.dtype | None) -> str:
    """The name --dry-run and the log give the precision a run trains in."""
    return PRECISION_NAMES[dtype]


def amp_note(amp: str, dtype: torch.dtype | None, device: torch.device) -> str:
    """One line for the log and --dry-run: the precision training runs in, and why."""
    name = precision_name(dtype)
    if dtype is None:
        if amp == "bf16":
            return (f"precision: {name} (train.amp=bf16 asked, but this CPU has no native bfloat16: "
                    f"emulated, bf16 would run ~30x slower)")
        if amp == "auto" and device.type == "cpu":
            return f"precision: {name} (train.amp=auto: cpu without native bfloat16)"
        return f"precision: {name} (train.amp={amp}: {device.type})"
    where = device.type
    if device.type == "cpu":
        isa = cpu_bf16_isa()
        where = f"cpu with native bfloat16, {isa}" if isa else "cpu with native bfloat16"
    elif device.type == "cuda":
        where = torch.cuda.get_device_name(device)
        if dtype == torch.bfloat16 and not cuda_has_native_bf16(device):
            where += (", no native bfloat16 below compute capability 8, so emulated and slow; "
                      "train.amp=auto trains in float16 here")
    hint = "; --set train.amp=off for float32" if amp == "auto" else ""
    return f"precision: {name} (train.amp={amp}: {where}; autocast over float32 weights{hint})"


def _mkl_status() -> str:
    from mtrain.cpu import mkl  # the CPU package depends on this module, not the other way round

    return mkl.current()
