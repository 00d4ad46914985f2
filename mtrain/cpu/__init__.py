"""Everything mtrain does to run faster on a CPU, in one place.

The paper's model (mtrain.model), its decoding cache, search and loss run on PyTorch's ops on any
device. On a CPU, where several of those ops cost more than they should at translation's small
shapes, this package supplies stand-ins that give the same values (to float rounding, and the same
dropout masks in distribution; tests/test_acceleration.py holds the two sides to that):

| module | what it speeds up | off with |
|---|---|---|
| `model` | the training step's layers, subclasses of mtrain.model's that `accelerate(model)` swaps in: dropout folded into linear layers, the step on the rows of a batch without its padding (`packing`) | `MTRAIN_CPU_FAST=0` |
| `attention` | attention's faster ways on a CPU, behind mtrain.attention.attend: bfloat16 matmuls around a float32 softmax | `MTRAIN_CPU_FAST=0` |
| `ops` | the pieces those use: dropout masks by bits, a packed step's attention by batched matmuls; search's chunked top-k and argmax | `MTRAIN_CPU_FAST=0` |
| `reductions` | search's top-k with log-sum-exp and argmax, the loss's row sums and gradient, in fewer passes over the logits (a model's `reductions`: `accelerate` and `cache.for_decoding` set them) | `MTRAIN_CPU_FAST=0` |
| `cache` | a decoding copy's caches: bfloat16 keys for the C kernel, or float32 where it does not load (`decoding_model` and `bfloat16_weights` choose them) | `MTRAIN_CPU_FAST=0` |
| `native` (+ `native.c`) | C kernels: dropout masks, the bfloat16 loss's sums and gradient and search's top-k with log-sum-exp (through `reductions`), attention over a bfloat16 decoding cache, AMX linear layers | `MTRAIN_CPU_KERNELS=0` (or `MTRAIN_CPU_FAST=0`) |
| `quantize` | decoding copies: int8 linear layers (`decode.quantize=int8`), bfloat16 weights through oneDNN (`decode.amp=bf16`) | the decode setting |
| `workers` | decoding in several processes (`decode.workers`) | the decode setting |
| `mkl` | MKL's fast kernels on AMD CPUs | opt-in: `MTRAIN_MKL_INTEL_PATH=1` |
| `build` | building the C code once per machine and compiler, under a lock | |

`switches` holds the choices inside them that benchmarks flip. `acceleration()` says which are on; `mtrain train` logs it in one line, records it in every
checkpoint and in results.json, and a resume where it differs says so (the sums then round
differently, so the run cannot match an uninterrupted one bit for bit). `prepare()` builds the C
kernels before work starts, so that no training step or decoding batch waits for a compiler.

This module imports no torch: `mkl` must load its stub before torch is imported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

FAST_ENV = "MTRAIN_CPU_FAST"  # 0 (or off, false, no): every CPU stand-in off, PyTorch's ops only


@dataclass
class Switches:
    """The choices inside the fast paths, each on by default and measured against its other side
    by a benchmark that flips it (benchmarks/attention_layout.py, packing_ab.py, decode_ab.py)."""

    heads_from_rows: bool = True  # a packed training step's attention straight from its rows to the heads (cpu.model)
    amx_linear: bool = True  # a bfloat16 decoding copy's linear layers on AMX tiles, where there are (cpu.quantize)


switches = Switches()


def switched_off(setting: str | None) -> bool:
    """Whether an environment switch reads 0, off, false or no (any case, spaces around)."""
    return (setting or "").strip().lower() in ("0", "off", "false", "no")


def fast() -> bool:
    """Whether the CPU stand-ins of mtrain.cpu may run (MTRAIN_CPU_FAST, on unless 0/off/false/no)."""
    return not switched_off(os.environ.get(FAST_ENV))


def prepare() -> str:
    """Build (or load) the C kernels now, before work starts, where they may be used; returns
    their status line. Processes that start together take turns on one build (mtrain.cpu.build)."""
    from mtrain.cpu import native

    native.library()
    return native.status


def acceleration() -> dict[str, Any]:
    """Which CPU fast paths this process runs: the record a checkpoint and results.json keep."""
    from mtrain.cpu import mkl, native

    lib = fast() and native.built.cache_info().currsize and native.built()  # never builds: only what is loaded
    return {"fast": fast(), "native": bool(lib), "amx": bool(lib) and native.amx_ready(),
            "mkl_intel_path": mkl.loaded()}


def describe(record: dict[str, Any]) -> str:
    """One line for the log."""
    from mtrain.cpu import mkl, native

    parts = [f"stand-ins {'on' if record['fast'] else f'off ({FAST_ENV}=0)'}",
             f"C kernels {native.status if record['fast'] else f'off ({FAST_ENV}=0)'}",
             f"AMX linear layers {'on' if record['amx'] else 'off'}",
             f"MKL {mkl.current()}"]
    return "cpu: " + "; ".join(parts)


def differences(before: dict[str, Any] | None, now: dict[str, Any]) -> list[str]:
    """The fast paths that differ between a checkpoint's record and this process ([] where the
    checkpoint has none)."""
    if not before:
        return []
    return [f"{key} {before.get(key)} -> {value}" for key, value in now.items() if key in before and before[key] != value]
