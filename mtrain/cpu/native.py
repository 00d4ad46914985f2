"""CPU kernels in C (native.c), which mtrain builds with the C compiler once per machine, into
the user's cache folder, and calls through ctypes. For a bfloat16 model's decoding: attention over
the cache, the logits' top-k with log-sum-exp, and, on CPUs with AMX, the linear layers of each
step (amx_linear). For training: dropout masks (keep_mask), and the
label-smoothed loss's row sums and gradient over bfloat16 logits (cross_entropy_sums,
cross_entropy_gradient_); each has a PyTorch path where the file is not built, the masks bit for bit.

**Attention over the cache** (`attend`). At a decoding step each (sentence, head) has one query
(greedy) or a few (beam search folds a sentence's beams into one row) over a few dozen keys.
PyTorch's CPU attention is a flash-attention kernel built for long sequences: it spends about
0.85 us per (sentence, head) before it reads a key, and it reads float32 keys, so a bfloat16 model's
cache had to be kept in float32, twice the bytes. The kernel reads the cache's bfloat16 keys and
values in the rows the cache appends them as, takes each key's products with a query by AVX-512 BF16
dot products (exact products, float32 sums) and sums 16 keys' partial sums into their scores at
once, then runs the softmax and the weighted sum without leaving the (sentence, head). At beam 5's
shapes (315 sentences x 4 heads x 5 queries, 2-core AMX host, the search's 1280-slot buffers) it
took 0.46 ms against PyTorch's 1.26 over 13 source keys and 2.49 against 7.34 over 150 cache slots
(benchmarks/cache_attention.py).
(Keys kept in transposed tiles of 16 slots score 16 keys by plain multiply-adds, but each step's key
then became 32 scattered writes per (sentence, head), and short caches were read in whole blocks
of 16: greedy decoding ran 1.09x as fast on rows, beam 5 1.04x.)

**Linear layers on the AMX tiles** (`amx_linear`). A decoding step multiplies a few hundred rows
at most, where oneDNN's linear spends about 20 us per call before it multiplies and may run on one
thread of two (1024 -> 256 at 315 rows). On a CPU with AMX-BF16 the kernel multiplies 16 x 32 blocks
of the rows by 32 x 16 blocks of a weight packed once into the tiles' layout (amx_pack), four
float32 accumulator tiles per 32 x 32 block of the output, and adds the bias (and the ReLU) before
it rounds each value to bfloat16 once, as oneDNN does; the two gave equal outputs at every decoding
shape measured. At 64 rows a 256 -> 256 layer took 12 us against oneDNN's 24, and 315 x 1024 -> 256
104 against 195 (benchmarks/amx_linear.py). Above AMX_MAX_ROWS rows (the encoder's batches, beam
search's largest) oneDNN's blocking does as well or better, and keeps them.

**Top-k and log-sum-exp of the logits** (`topk_logsumexp`). Beam search needs each row's few best
tokens and its log-normaliser. From bfloat16 logits that took an upcast to float32, a chunked top-k
and two passes for the logsumexp; the kernel reads the bfloat16 row once (1575 x 8000: 3.8 ms
against 18.5).

The file is built with -march=native (the library's name carries a hash of the source, the flags,
the compiler's version, what -march=native means on this CPU and the OpenMP runtime; mtrain.cpu.build
builds it once, under a lock) and OpenMP, linked by path to the runtime torch runs
on (openmp_runtime: sentencepiece and CTranslate2 bundle libgomps of their own), and never with
-ffast-math (which would set flush-to-zero for the whole process). Without a C compiler, where the
build fails, or with MTRAIN_CPU_KERNELS=0, nothing is built and decoding and training run on
PyTorch's ops; `status` says which. benchmarks/results/intel-xeon-amx/NOTES.md has the measurements."""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
from pathlib import Path

import torch
from torch import Tensor

from mtrain.cpu import build, fast, switched_off
from mtrain.cpu.build import compiler

ENV = "MTRAIN_CPU_KERNELS"  # 0 (or off, false, no): decode with PyTorch's kernels only
SOURCE = Path(__file__).with_name("native.c")
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fPIC")  # compiling; linking: -shared
HEAD_SIZES = (32, 64, 128)  # the d_head values the kernel is built for
MAX_QUERIES = 8  # per (row, head)
MAX_KEYS = 4096
MAX_TOP = 32  # the most values topk_logsumexp keeps per row
# The most rows amx_linear multiplies. Above, oneDNN's kernel, which blocks for large problems, kept
# up or won: at 1575 rows the tiles took 1.13x less time for 256 -> 768 but 1.07x more for 1024 ->
# 256; at 4096 rows as much or up to 1.4x more (benchmarks/amx_linear.py, benchmarks/results/intel-xeon-amx/NOTES.md).
AMX_MAX_ROWS = 1024

status = "not tried yet"


def cpu_flags() -> str:
    """The CPU's feature flags from /proc/cpuinfo ('' where unreadable): -march=native builds for them."""
    return build.cpuinfo_fields().get("flags", "")


def openmp_runtime(maps: Path = Path("/proc/self/maps"), torch_dir: Path | None = None) -> Path | None:
    """The OpenMP runtime torch runs on (libgomp, or Intel's libiomp5, which also answers the GOMP_
    calls gcc emits), found among the libraries this process has mapped: the one inside torch's
    package where there is one (other packages bundle their own libgomp: sentencepiece,
    CTranslate2), else the system's libgomp.so.1 or libiomp5.so; None if none is mapped."""
    torch_dir = torch_dir or Path(torch.__file__).resolve().parent
    found = []
    try:
        with maps.open(encoding="utf-8", errors="replace") as lines:
            for line in lines:
                fields = line.split()
                name = Path(fields[-1]).name if len(fields) >= 6 else ""
                if name.startswith(("libgomp", "libiomp5")) and ".so" in name:
                    found.append(Path(fields[-1]))
    except OSError:
        return None
    inside = [path for path in found if torch_dir in path.parents]
    system = [path for path in found if path.name in ("libgomp.so.1", "libiomp5.so")]
    return (inside or system or [None])[0]


def library_key(cc: str, runtime: Path | None = None) -> list[str]:
    """What decides the library built from SOURCE with FLAGS by `cc` for this CPU and OpenMP runtime:
    the source, the flags, the compiler's version and target, the instruction sets -march=native
    means here (asked of the compiler; /proc/cpuinfo's flags where it does not say) and the runtime."""
    return [SOURCE.read_text(encoding="utf-8"), " ".join(FLAGS), cc, build.compiler_identity(cc),
            platform.machine(), build.native_target(cc) or cpu_flags(), str(runtime)]


def library_path(folder: Path, cc: str, runtime: Path | None = None) -> Path:
    """Where the kernels built with `cc` for this CPU and OpenMP runtime live in `folder`."""
    return folder / build.library_name("cpu-kernels", library_key(cc, runtime))


def compile_into(path: Path, cc: str, runtime: Path) -> str | None:
    """Compile SOURCE into `path`, linked to the OpenMP `runtime` torch loaded, by its path: a
    second OpenMP runtime in the process would keep its own threads, which then contend with
    torch's on every parallel region. None on success, else why it failed."""
    objects = path.with_suffix(".o")
    failed = build.run_compiler([[cc, *FLAGS, "-c", "-o", str(objects), str(SOURCE)],
                                 [cc, "-shared", "-o", str(path), str(objects), str(runtime),
                                  f"-Wl,-rpath,{runtime.parent}", "-lm"]])
    return failed and failed.replace("could not build it", f"could not build {SOURCE.name}")


def library() -> ctypes.CDLL | None:
    """The loaded kernel (built first where needed), or None, also while MTRAIN_CPU_FAST=0; the
    outcome goes to `status`."""
    return built() if fast() else None


@functools.cache
def built() -> ctypes.CDLL | None:
    """The kernel, loaded once per process (built first where needed), or None."""
    global status
    lib, status = _load()
    return lib


library.cache_clear = built.cache_clear  # type: ignore[attr-defined]  (tests: a new process, as it were)


def _load() -> tuple[ctypes.CDLL | None, str]:
    if switched_off(os.environ.get(ENV)):
        return None, f"off: {ENV}={os.environ[ENV]}"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"off: {platform.system()} {platform.machine()} (built for Linux on x86-64)"
    cc = compiler()
    if cc is None:
        return None, "off: no C compiler (cc, gcc or $CC) to build it"
    if not (build.native_target(cc) or cpu_flags()):
        return None, f"off: neither {cc} nor /proc/cpuinfo says which instruction sets this CPU has"
    runtime = openmp_runtime()
    if runtime is None:
        return None, "off: torch has no OpenMP runtime loaded (libgomp or libiomp5) to share"
    key = library_key(cc, runtime)
    path, failed = build.build_once("cpu-kernels", key, lambda into: _announce(into) or compile_into(into, cc, runtime))
    if path is None:
        return None, f"off: {failed}"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as err:
        return None, f"off: cannot load {path} ({err})"
    lib.mtrain_cache_attention.restype = ctypes.c_int
    lib.mtrain_topk_logsumexp.restype = ctypes.c_int
    lib.mtrain_keep_mask.restype = ctypes.c_int
    lib.mtrain_ce_sums.restype = ctypes.c_int
    lib.mtrain_ce_grad.restype = ctypes.c_int
    lib.mtrain_amx_ready.restype = ctypes.c_int
    lib.mtrain_amx_linear.restype = ctypes.c_int
    return lib, f"on: {path}"


def _announce(into: Path) -> None:
    print(f"mtrain: building its CPU kernels into {into.parent.parent} (once per machine and compiler)", file=sys.stderr)


def wanted(x: Tensor) -> bool:
    """Whether a cache of keys like x (rows, H, t, d_head) is kept for the kernel: bfloat16 on a
    CPU, a d_head it is built for, and the kernel loads."""
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.size(-1) in HEAD_SIZES
            and library() is not None)


def _strides(t: Tensor, dims: tuple[int, ...]) -> ctypes.Array:
    return (ctypes.c_int64 * len(dims))(*(t.stride(d) if t.size(d) > 1 else 0 for d in dims))


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor | None:
    """softmax(q k^T / sqrt(d_head)) v for bfloat16 q (B, H, G, d_head) over keys k and values v
    (B, H, N, d_head), bfloat16 with a last stride of 1 (the cache's buffers); mask (B, 1, G or 1, N)
    bool, True = may attend, or None. The result is (B, H, G, d_head) bfloat16, laid out
    (B, G, H, d_head) so that the heads' concatenation is a view. None where the kernel does not take
    these shapes."""
    lib = library()
    B, H, G, D = q.shape
    N = v.size(2)
    if lib is None or G > MAX_QUERIES or N > MAX_KEYS or D not in HEAD_SIZES:
        return None
    if any(t.dtype != torch.bfloat16 for t in (q, k, v)) or k.shape != v.shape or k.stride(-1) != 1 or v.stride(-1) != 1:
        return None
    if mask is not None and (mask.dim() != 4 or mask.size(1) != 1 or mask.size(2) not in (1, G)
                             or mask.size(0) not in (1, B) or mask.size(3) != N or mask.stride(-1) != 1):
        return None
    out = torch.empty(B, G, H, D, dtype=torch.bfloat16).transpose(1, 2)
    mask_ptr, mask_strides = None, (ctypes.c_int64 * 2)(0, 0)
    if mask is not None:
        mask = mask.view(torch.uint8)
        mask_ptr, mask_strides = ctypes.c_void_p(mask.data_ptr()), _strides(mask, (0, 2))
    failed = lib.mtrain_cache_attention(
        ctypes.c_void_p(q.data_ptr()), _strides(q, (0, 1, 2, 3)), ctypes.c_void_p(k.data_ptr()),
        _strides(k, (0, 1, 2)), ctypes.c_void_p(v.data_ptr()), _strides(v, (0, 1, 2)), mask_ptr, mask_strides,
        ctypes.c_void_p(out.data_ptr()), (ctypes.c_int64 * 4)(*out.stride()), ctypes.c_int64(B), ctypes.c_int64(H),
        ctypes.c_int64(G), ctypes.c_int64(N), ctypes.c_int64(D), ctypes.c_float(D ** -0.5),
        ctypes.c_int(torch.get_num_threads()))
    return None if failed else out


def _bfloat16_rows(x: Tensor) -> bool:
    """Whether x is (n, V) bfloat16 on a CPU with contiguous rows, as the kernels over logits read it."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1


def _per_row(x: Tensor, n: int, dtype: torch.dtype) -> bool:
    """Whether x is a contiguous (n,) tensor of dtype: one value per row of (n, V) logits."""
    return x.dtype == dtype and x.shape == (n,) and x.is_contiguous()


def topk_logsumexp(logits: Tensor, k: int, normaliser: bool = True) -> tuple[Tensor, Tensor, Tensor | None] | None:
    """For (n, V) bfloat16 logits on a CPU (last stride 1): the k largest of each row as float32,
    descending, their columns (int64; of equal values the first column first), and each row's log
    sum exp over all V as (n, 1) float32 (None without `normaliser`: no exponentials are taken).
    None where the kernel is not loaded or k is out of its range."""
    if not _bfloat16_rows(logits):  # before library(): other devices and dtypes never build it
        return None
    n, V = logits.shape
    lib = library()
    if lib is None or not 1 <= k <= min(MAX_TOP, V):
        return None
    top = torch.empty(n, k)
    ids = torch.empty(n, k, dtype=torch.long)
    lse = torch.empty(n, 1) if normaliser else None
    failed = lib.mtrain_topk_logsumexp(
        ctypes.c_void_p(logits.data_ptr()), ctypes.c_int64(n), ctypes.c_int64(V), ctypes.c_int64(logits.stride(0)),
        ctypes.c_int64(k), ctypes.c_void_p(top.data_ptr()), ctypes.c_void_p(ids.data_ptr()),
        None if lse is None else ctypes.c_void_p(lse.data_ptr()), ctypes.c_int(torch.get_num_threads()))
    return None if failed else (top, ids, lse)


def keep_mask(seed: int, n: int, threshold: int, width: int) -> Tensor | None:
    """n dropout-mask elements as int16 (width 2) or int32 (width 4): -1 to keep, 0 to drop, element
    i kept when the low 15 bits of 16-bit lane i % 4 of splitmix64 word i // 4 (the counter
    seed + (i // 4 + 1) * golden gamma, mtrain.cpu.ops.splitmix_words) are >= threshold. None where
    the kernel is not loaded."""
    lib = library()
    if lib is None or width not in (2, 4):
        return None
    out = torch.empty(n, dtype=torch.int16 if width == 2 else torch.int32)
    failed = lib.mtrain_keep_mask(ctypes.c_uint64(seed % 2**64), ctypes.c_int64(n), ctypes.c_int64(threshold),
                                  ctypes.c_int64(width), ctypes.c_void_p(out.data_ptr()),
                                  ctypes.c_int(torch.get_num_threads()))
    return None if failed else out


def _logits_kernel(logits: Tensor, *per_row: tuple[Tensor, torch.dtype]) -> ctypes.CDLL | None:
    """The library, where it loads and the loss's kernels take these tensors: (n, V) bfloat16 logits
    on a CPU and, for each (tensor, dtype) given, one value per row."""
    if not _bfloat16_rows(logits):  # before library(): other devices and dtypes never build it
        return None
    n = logits.size(0)
    if not all(_per_row(x, n, dtype) for x, dtype in per_row):
        return None
    return library()


def cross_entropy_sums(logits: Tensor, sums: Tensor, means: Tensor | None) -> bool:
    """For (n, V) bfloat16 logits on a CPU: each row's sum of exp (no maximum taken out) into the
    float32 (n,) `sums`, and its mean into `means` when given. False (nothing written) where the
    kernel is not loaded or the tensors do not fit it."""
    optional = [] if means is None else [(means, torch.float32)]
    lib = _logits_kernel(logits, (sums, torch.float32), *optional)
    if lib is None:
        return False
    n, V = logits.shape
    lib.mtrain_ce_sums(ctypes.c_void_p(logits.data_ptr()), ctypes.c_int64(n), ctypes.c_int64(V),
                       ctypes.c_int64(logits.stride(0)), ctypes.c_void_p(sums.data_ptr()),
                       None if means is None else ctypes.c_void_p(means.data_ptr()), ctypes.c_int(torch.get_num_threads()))
    return True


def cross_entropy_gradient_(logits: Tensor, lse: Tensor, target: Tensor, g: float, eps: float) -> bool:
    """Overwrite (n, V) bfloat16 logits on a CPU with the label-smoothed loss's gradient,
    g * softmax(x) - g * eps / V, minus g * (1 - eps) more at each row's target, from each row's
    float32 log-sum-exp `lse`. False (nothing written) where the kernel is not loaded or the tensors
    do not fit it."""
    lib = _logits_kernel(logits, (lse, torch.float32), (target, torch.int64))
    if lib is None:
        return False
    n, V = logits.shape
    lib.mtrain_ce_grad(ctypes.c_void_p(logits.data_ptr()), ctypes.c_int64(n), ctypes.c_int64(V),
                       ctypes.c_int64(logits.stride(0)), ctypes.c_void_p(lse.data_ptr()),
                       ctypes.c_void_p(target.data_ptr()), ctypes.c_float(g), ctypes.c_float(g * eps / V),
                       ctypes.c_float(g * (1.0 - eps)), ctypes.c_int(torch.get_num_threads()))
    return True


@functools.cache
def amx_ready() -> bool:
    """Whether amx_linear runs here: the library loads, was built for AMX-BF16, and the kernel lets
    this process use the tile registers."""
    lib = built()
    return lib is not None and lib.mtrain_amx_ready() == 1


def amx_pack(weight: Tensor) -> Tensor:
    """A (N, K) bfloat16 weight (K a multiple of 32) in the layout amx_linear reads: for each 16
    outputs and 32 inputs, a tile of 16 rows, each the 16 outputs' pairs of consecutive inputs;
    zero outputs are added up to a multiple of 32."""
    N, K = weight.shape
    padded = -(-N // 32) * 32
    if padded != N:
        weight = torch.cat([weight, weight.new_zeros(padded - N, K)])
    return weight.detach().view(padded // 16, 16, K // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def amx_takes(x: Tensor) -> bool:
    """Whether amx_linear takes x (..., K): bfloat16 rows on a CPU with a last stride of 1, K a
    multiple of 32, at most AMX_MAX_ROWS rows, and the tiles usable here."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() < 1 or x.stride(-1) != 1:
        return False
    K = x.size(-1)
    return K > 0 and K % 32 == 0 and 0 < x.numel() // K <= AMX_MAX_ROWS and fast() and amx_ready()


def amx_linear(x: Tensor, packed: Tensor, bias: Tensor | None, relu: bool, out_features: int) -> Tensor | None:
    """x W^T + bias (then ReLU where `relu`) for x (..., K) that amx_takes, with the (out_features,
    K) weight W packed by amx_pack and a bfloat16 bias or none; bfloat16 (..., out_features), each
    value rounded once from its float32 sum. None where it declines: x, the packed weight and the
    bias not of one layer (widths, dtypes, device), a bias not contiguous, or no memory for the
    kernel's copy of a last block of rows; the caller's other kernel then says what is wrong."""
    K, N = x.size(-1), out_features
    if packed.dtype != torch.bfloat16 or packed.device.type != "cpu" or not packed.is_contiguous() \
            or packed.shape != (-(-N // 32) * 2, K // 32, 16, 16, 2):
        return None
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.device.type != "cpu" or bias.shape != (N,)
                             or not bias.is_contiguous()):
        return None
    rows = x.reshape(-1, K)  # a view wherever x's rows are evenly strided, else a copy
    out = torch.empty(rows.size(0), N, dtype=torch.bfloat16)
    failed = library().mtrain_amx_linear(
        ctypes.c_void_p(rows.data_ptr()), ctypes.c_int64(rows.stride(0)), ctypes.c_void_p(packed.data_ptr()),
        None if bias is None else ctypes.c_void_p(bias.data_ptr()), ctypes.c_int(relu),
        ctypes.c_void_p(out.data_ptr()), ctypes.c_int64(N), ctypes.c_int64(rows.size(0)), ctypes.c_int64(N),
        ctypes.c_int64(K), ctypes.c_int(torch.get_num_threads()))
    return None if failed else out.view(*x.shape[:-1], N)
