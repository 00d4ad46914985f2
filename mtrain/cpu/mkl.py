"""MKL's fast matmul kernels on AMD CPUs.

PyTorch's CPU builds multiply float32 matrices with Intel MKL, which picks its kernels by CPU vendor
before it looks at the instruction set: on an AMD CPU its `mkl_serv_intel_cpu_true()` answers 0 and
the matmuls take slower generic code paths, though the CPU has the AVX2 and FMA units the fast ones
use. A one-line shared library whose `mkl_serv_intel_cpu_true` answers 1, loaded into the global
symbol scope before torch, is found first when libtorch binds that symbol (PyTorch's maintainers give
the same stub, as LD_PRELOAD, for AMD CPUs). On a 2-core AVX2 EPYC (Zen 3) the training step's
float32 matmuls then ran at 123-151 GFLOP/s against 112-118, a float32 training step 1.16x as fast
and float32 beam search 1.25x (benchmarks/results/amd-epyc-avx2/NOTES.md, "MKL's kernels on AMD CPUs"). MKL still picks
the instruction set from what the CPU reports, as it does on an Intel CPU.

It is opt-in (MTRAIN_MKL_INTEL_PATH=1): other kernels sum in another order, so a run's numbers then
differ from those of a process without the stub in their last bits (a checkpoint records which
one trained it). `enable()` builds the stub with the C compiler (once, into the user's cache folder)
and loads it; it must run before torch is imported, so the CLI calls it before a command that
multiplies matrices (train, translate, score, export) imports torch, and decoding workers call it
first thing. Unless asked for, without a C compiler, on other CPUs or with a torch built without MKL,
it does nothing and says why (`status`)."""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from pathlib import Path

from mtrain.cpu import build
from mtrain.cpu.build import compiler

ENV = "MTRAIN_MKL_INTEL_PATH"  # 1 (or on, true, yes) loads the stub; unset or anything else keeps MKL's own choice
STUB_SOURCE = "int mkl_serv_intel_cpu_true(void) { return 1; }\n"
VENDORS = ("AuthenticAMD", "HygonGenuine")  # x86-64 CPUs that MKL sends down its generic paths

status = "off: not asked for (mtrain.cpu.mkl.enable() was not called)"
_amd = False  # whether enable() ran on a CPU the stub is for: then `note` reports the outcome


def cpu_vendor(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The first `vendor_id` in /proc/cpuinfo (GenuineIntel, AuthenticAMD, ...); None where unreadable."""
    return build.cpuinfo_fields(str(cpuinfo)).get("vendor_id")


def switched_on(setting: str | None) -> bool:
    """Whether an environment switch reads 1, on, true or yes (any case, spaces around)."""
    return (setting or "").strip().lower() in ("1", "on", "true", "yes")


def reason_to_skip(vendor: str | None, setting: str | None, machine: str, system: str) -> str | None:
    """Why the stub is not wanted here, or None when it is."""
    if not switched_on(setting):
        return f"off: not asked for ({ENV}=1 turns it on)" if not setting else f"off: {ENV}={setting}"
    if system != "Linux" or machine not in ("x86_64", "AMD64"):
        return f"off: {system} {machine} (the stub is for Linux on x86-64)"
    if vendor not in VENDORS:
        return f"off: {vendor or 'unknown'} CPU (MKL's own dispatch already takes its fast kernels)"
    return None


def stub_key(cc: str) -> list[str]:
    """What decides the stub: its source and the compiler that builds it."""
    return [STUB_SOURCE, cc, build.compiler_identity(cc), platform.machine()]


def stub_path(folder: Path, cc: str) -> Path:
    """Where the stub built from STUB_SOURCE by `cc` lives in `folder`."""
    return folder / build.library_name("mkl-intel-path", stub_key(cc))


def compile_stub(path: Path, cc: str) -> str | None:
    """Compile STUB_SOURCE into the shared library `path`; None on success, else why it failed."""
    source = path.with_suffix(".c")
    source.write_text(STUB_SOURCE)
    return build.run_compiler([[cc, "-shared", "-fPIC", "-O2", "-o", str(path), str(source)]])


def enable() -> str:
    """Load the stub (building it first if needed) where MKL would take its generic kernels; the
    outcome, also kept in `status`, as one line for the log."""
    global status, _amd
    if loaded():  # loaded already: a second call (a CLI run in-process) changes nothing
        return status
    vendor = cpu_vendor()
    _amd = vendor in VENDORS
    status = _enable(vendor)
    return status


def loaded() -> bool:
    """Whether this process loaded the stub and its torch has MKL: MKL runs its fast kernels on
    this AMD CPU."""
    return current().startswith("on:")


def note() -> str | None:
    """`status` as a log line where it matters (a CPU the stub is for), else None."""
    return f"mkl: {current()}" if _amd else None


def _enable(vendor: str | None) -> str:
    skip = reason_to_skip(vendor, os.environ.get(ENV), platform.machine(), platform.system())
    if skip:
        return skip
    if "torch" in sys.modules:
        return "off: torch was imported before the stub could be loaded"
    cc = compiler()
    if cc is None:
        return "off: no C compiler (cc, gcc or $CC) to build it"
    path, failed = build.build_once("mkl-intel-path", stub_key(cc), lambda into: compile_stub(into, cc))
    if path is None:
        return f"off: {failed}"
    try:
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as err:
        return f"off: cannot load {path} ({err})"
    return f"on: MKL's AVX2/AVX-512 kernels on this {vendor} CPU ({path}; {ENV}=1 asked for it)"


def current() -> str:
    """`status`, corrected once torch is imported: a stub loaded into a torch without MKL changes
    nothing, so it then reads "off" rather than "on"."""
    global status
    torch = sys.modules.get("torch")
    if status.startswith("on:") and torch is not None and not torch.backends.mkl.is_available():
        status = "off: this torch build has no MKL (the stub was loaded but nothing calls it)"
    return status
