"""What machine this is, for choices that depend on it (bf16 autocast) and for the records that
benchmarks and the recipe report keep next to their numbers."""

from __future__ import annotations

import os
import platform

import torch


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (x86 AMX or AVX512-BF16; oneDNN's check
    elsewhere). Without it bf16 matmuls are emulated: 0.9 GFLOP/s against 45 in float32 on one core
    of an AVX2-only AMD EPYC, and a training step took 35 s instead of 1.3 s (docs/recipe.md)."""
    cpu = getattr(torch, "cpu", None)
    x86 = [getattr(cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
    if all(callable(check) for check in x86):
        return any(check() for check in x86)
    try:  # non-x86 builds (aarch64): ask oneDNN
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def cpu_model() -> str | None:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else platform.processor()."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def cpu_summary() -> dict[str, object]:
    """The CPU facts that change speed: model, the vector ISA torch dispatches to, native bf16."""
    return {"cpu_model": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "native_bf16": cpu_has_native_bf16()}


def machine_record() -> dict[str, object]:
    """Everything a stored result says about where it was measured (benchmarks/ and the recipe
    report each add their thread count and what else only they know)."""
    return {"machine": platform.machine(), "processor": platform.processor() or None, "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, **cpu_summary()}
