"""How a training process's C heap treats freed memory: kept for the next steps' tensors while the
run goes on (reuse_freed_memory), given back to the operating system at each validation or
checkpoint (release_free_memory). Both act on glibc's malloc, which PyTorch's CPU tensors come
from; on other C libraries (macOS, musl) both are no-ops.

A training step frees hundreds of megabytes of activations, and the next step's tensors, of other
shapes, do not fit the holes exactly. glibc's malloc keeps the freed pages mapped, so a trainer's
resident memory grows with every new batch shape long after its live data stops growing: a
3+3-layer model's trainer went from 4.9 GB at update 5400 to 6.6 GB at update 19300 (benchmarks/
results/intel-xeon-amx/NOTES.md, "Memory over a long run"). `malloc_trim(0)` returns every free page of every arena
to the kernel; called once per validation or checkpoint, it halved the resident memory of a
training loop at no measurable cost in speed."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys


# mallopt parameters (glibc's malloc.h) and the values reuse_freed_memory sets.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on a 64-bit system
TRIM_THRESHOLD = 256 << 20


def _glibc_function(name: str, argtypes: list):
    """The C library's function `name` (returning int), or None off Linux or where the C library
    has no such function."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = argtypes, ctypes.c_int
    return function


@functools.cache
def _mallopt():
    return _glibc_function("mallopt", [ctypes.c_int, ctypes.c_int])


def reuse_freed_memory() -> bool:
    """Serve blocks of up to 32 MiB from the heap and keep up to 256 MiB of freed memory at its top,
    for the tensors of the next steps; True when glibc took both settings.

    glibc serves a block above a threshold that adapts (128 kB at first) with a fresh mapping and
    unmaps free memory at the heap's top once it passes twice that threshold, so a training step's
    tensors kept landing on pages the kernel had to map and zero again, one fault per 4 kB page:
    19k faults in a bfloat16 step at the small benchmark shape, 0-4k with these settings. 400
    updates of `mtrain train` with the en->de config took 123.3 and 121.3 s against 130.8 and 122.9
    with glibc's defaults, 1200 updates 381.7 s against 406.8, the resident set peaking within 0.2 %
    (2-core AMX host, benchmarks/results/intel-xeon-amx/NOTES.md). release_free_memory still gives free pages back at each
    validation. Decoding showed no such gain, so `mtrain train` alone sets it; a program that
    imports mtrain chooses for its own process."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) & bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


@functools.cache
def _malloc_trim():
    return _glibc_function("malloc_trim", [ctypes.c_size_t])


def release_free_memory() -> bool:
    """Return the C heap's free pages to the kernel; True when some memory was given back."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
