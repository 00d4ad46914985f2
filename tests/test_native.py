"""mtrain.cpu.native: the C kernel against attention in float64, its refusals, the cache's
bfloat16 cache, and the switch and the fallbacks when it cannot be built."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from mtrain.cpu import native
from mtrain.cache import KVCache
from mtrain.config import ModelConfig
from mtrain.model import Transformer
from mtrain.cpu.quantize import bfloat16_weights
from mtrain.search import beam_search, greedy_search

needs_kernel = pytest.mark.skipif(native.library() is None, reason=f"kernel not built: {native.status}")


def reference(q, k, v, mask):
    """softmax(q k^T / sqrt(d)) v in float64 from the same bfloat16 inputs; zeros where no key is allowed."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-1, -2) * q.size(-1) ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights @ v


def inputs(B, H, G, N, D, capacity=None, seed=0):
    """q (B, H, G, D); k and v (B, H, N, D), views of longer buffers: the cache's layout, whose slots
    after N hold whatever they held (here NaN, which the kernel must not read)."""
    gen = torch.Generator().manual_seed(seed)
    capacity = capacity or N + 16
    q = torch.randn(B, H, G, D, generator=gen).bfloat16()
    k, v = (torch.full((B, H, capacity, D), float("nan"), dtype=torch.bfloat16) for _ in range(2))
    k[:, :, :N] = torch.randn(B, H, N, D, generator=gen)
    v[:, :, :N] = torch.randn(B, H, N, D, generator=gen)
    return q, k[:, :, :N], v[:, :, :N]


@needs_kernel
@pytest.mark.parametrize("G", [1, 5, 8])
@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("N", [1, 13, 16, 17, 150])
def test_kernel_equals_attention_in_float64(G, D, N):
    """Every query, any key count (inside one block of 16, on its edge, across blocks), no mask:
    within the float32 arithmetic and the result's one bfloat16 rounding of the exact value."""
    q, k, v = inputs(3, 2, G, N, D)
    got = native.attend(q, k, v, None)
    want = reference(q, k, v, None)
    assert got.shape == (3, 2, G, D) and got.dtype == torch.bfloat16
    assert torch.allclose(got.double(), want, rtol=2 ** -8, atol=1e-5)


@needs_kernel
def test_kernel_honours_key_masks_and_per_query_masks():
    """A source mask (one row for all queries, as cross-attention's) and an ancestry-like mask
    (one row per query, as beam search's): masked keys take no weight; a query that may attend to
    nothing gets zeros, as PyTorch's CPU kernel gives."""
    B, H, G, N, D = 4, 3, 5, 37, 64
    q, k, v = inputs(B, H, G, N, D)
    gen = torch.Generator().manual_seed(1)
    keys = torch.rand(B, 1, 1, N, generator=gen) > 0.3
    keys[:, :, :, 0] = True
    per_query = torch.rand(B, 1, G, N, generator=gen) > 0.6
    per_query[0, 0, 2] = False  # nothing allowed
    for mask in (keys, per_query):
        got = native.attend(q, k, v, mask)
        assert torch.allclose(got.double(), reference(q, k, v, mask), rtol=2 ** -8, atol=1e-5)
    assert torch.equal(native.attend(q, k, v, per_query)[0, :, 2], torch.zeros(H, D, dtype=torch.bfloat16))


@needs_kernel
def test_result_is_laid_out_for_the_heads_concatenation():
    """(B, H, G, D) as a view of (B, G, H, D): concatenating the heads needs no copy."""
    q, k, v = inputs(2, 4, 5, 20, 64)
    out = native.attend(q, k, v, None)
    assert out.transpose(1, 2).is_contiguous()


@needs_kernel
def test_kernel_declines_what_it_was_not_built_for():
    q, k, v = inputs(2, 2, 9, 20, 64)
    assert native.attend(q, k, v, None) is None  # more than 8 queries
    q, k, v = inputs(2, 2, 1, 20, 48)
    assert native.attend(q, k, v, None) is None  # a d_head it has no build for
    q, k, v = inputs(2, 2, 1, 20, 64)
    assert native.attend(q.float(), k, v, None) is None  # float32 queries
    assert native.attend(q, k, v, torch.ones(20, 20, dtype=torch.bool)) is None  # not (B, 1, G, N)
    assert native.attend(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, None) is None  # keys by column
    assert native.attend(q, k[:, :, :19], v, None) is None  # fewer keys than values


@pytest.fixture
def bf16_model():
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=64, d_ff=128, n_heads=2, n_encoder_layers=2, n_decoder_layers=2, vocab_size=40,
                      dropout=0.0, max_len=64)
    return bfloat16_weights(Transformer(cfg).eval())


@needs_kernel
def test_bfloat16_cache_stays_bfloat16_and_decodes_as_without_it(bf16_model):
    """Step by step with the cache (the kernel, bfloat16 keys and values) gives the logits of the
    full prefix decoded without a cache (PyTorch's attention), to bfloat16 rounding."""
    gen = torch.Generator().manual_seed(2)
    src = torch.randint(4, 40, (3, 9), generator=gen)
    src[1, 6:] = 0  # padding
    tgt = torch.randint(4, 40, (3, 7), generator=gen)
    with torch.inference_mode():
        memory = bf16_model.encode(src)
        full = bf16_model.decode(tgt, memory, src).float()
        cache = bf16_model.new_cache()
        steps = [bf16_model.decode(tgt[:, t : t + 1], memory, src, cache).float() for t in range(tgt.size(1))]
    assert all(layer.native for layer in cache.layers)
    assert all(t.dtype == torch.bfloat16 for t in (cache.layers[0].self_k, cache.layers[0].cross_v))
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=0.1, rtol=0.05)


@needs_kernel
def test_searches_agree_with_and_without_the_kernel(bf16_model, monkeypatch):
    """Greedy and beam search over the bfloat16 cache and over the float32 one reach the same
    outputs for nearly every sentence (bfloat16 rounding may settle a near-tie otherwise)."""
    gen = torch.Generator().manual_seed(3)
    src = torch.randint(4, 40, (12, 10), generator=gen)
    max_len = torch.full((12,), 12)
    with_kernel = (greedy_search(bf16_model, src, max_len), beam_search(bf16_model, src, 4, 0.6, max_len))
    monkeypatch.setattr(native, "wanted", lambda x: False)
    without = (greedy_search(bf16_model, src, max_len), beam_search(bf16_model, src, 4, 0.6, max_len))
    assert sum(a == b for a, b in zip(with_kernel[0], without[0])) >= 11
    assert sum(a[0][0] == b[0][0] for a, b in zip(with_kernel[1], without[1])) >= 11


@pytest.mark.parametrize("for_decoding", [False, True])
def test_float32_models_keep_the_float32_layout(for_decoding):
    """A float32 model's caches keep float32 keys, with the plain layer caches and with the CPU's."""
    from mtrain.cpu import cache as cpu_cache

    torch.manual_seed(0)
    model = Transformer(ModelConfig(d_model=32, d_ff=64, n_heads=2, n_encoder_layers=1, n_decoder_layers=1,
                                    vocab_size=20, dropout=0.0)).eval()
    if for_decoding:
        model = cpu_cache.for_decoding(model)
    src = torch.randint(4, 20, (2, 5))
    cache = model.new_cache()
    with torch.inference_mode():
        model.decode(torch.full((2, 1), 1), model.encode(src), src, cache)
    assert not getattr(cache.layers[0], "native", False) and cache.layers[0].self_k.size(2) >= 1
    assert cache.layers[0].self_k.dtype == torch.float32


@pytest.mark.fast_paths
def test_the_papers_cache_keeps_keys_as_they_come_and_the_cpus_upcasts_bfloat16_without_the_kernel(monkeypatch):
    """mtrain.cache keeps a bfloat16 model's keys in bfloat16; the CPU decoding caches keep them
    bfloat16 for the kernel, or float32 where it does not load (attention runs in float32 there)."""
    from mtrain.cpu import cache as cpu_cache

    torch.manual_seed(0)
    cfg = ModelConfig(d_model=64, d_ff=128, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, vocab_size=20, dropout=0.0)
    plain = Transformer(cfg).eval().to(torch.bfloat16)
    src = torch.randint(4, 20, (2, 5))

    def first_keys(model):
        cache = model.new_cache()
        with torch.inference_mode():
            model.decode(torch.full((2, 1), 1), model.encode(src), src, cache)
        return cache.layers[0].self_k.dtype

    assert first_keys(plain) == torch.bfloat16
    monkeypatch.setattr(native, "wanted", lambda x: False)
    assert first_keys(cpu_cache.for_decoding(plain)) == torch.float32


@pytest.mark.fast_paths
def test_switched_off_and_without_a_compiler_nothing_is_built(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    try:
        monkeypatch.setenv(native.ENV, "0")
        native.library.cache_clear()
        assert native.library() is None and native.status == f"off: {native.ENV}=0"
        monkeypatch.delenv(native.ENV)
        monkeypatch.setattr(native, "compiler", lambda: None)
        native.library.cache_clear()
        assert native.library() is None and "no C compiler" in native.status
        assert not list(tmp_path.rglob("*.so"))
    finally:
        native.library.cache_clear()


@pytest.mark.fast_paths
def test_a_failed_build_leaves_nothing_behind(monkeypatch, tmp_path):
    """A compiler that fails: the reason in one line, no library file, decoding unaffected."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(native.ENV, raising=False)
    monkeypatch.setattr(native, "compiler", lambda: "false")  # /bin/false: exits 1
    try:
        native.library.cache_clear()
        assert native.library() is None
        assert native.status.startswith("off: false could not build native.c")
        assert not list(tmp_path.rglob("*.so"))
        native.library.cache_clear()  # a new process: says why at once, without compiling again
        monkeypatch.setattr(native, "compile_into", lambda *args: pytest.fail("compiled again"))
        assert native.library() is None and "an earlier build; delete" in native.status
    finally:
        native.library.cache_clear()


def test_library_name_follows_source_flags_compiler_cpu_and_openmp_runtime(tmp_path, monkeypatch):
    from mtrain.cpu import build

    gomp = tmp_path / "libgomp.so.1"
    monkeypatch.setattr(build, "compiler_identity", lambda cc: "gcc (Debian 12.2.0-14) 12.2.0 x86_64-linux-gnu")
    monkeypatch.setattr(build, "native_target", lambda cc: "-march=znver4 -mavx512bf16")
    first = native.library_path(tmp_path, "gcc", gomp)
    assert first == native.library_path(tmp_path, "gcc", gomp)
    assert first != native.library_path(tmp_path, "clang", gomp)
    assert first != native.library_path(tmp_path, "gcc", tmp_path / "libiomp5.so")
    monkeypatch.setattr(build, "native_target", lambda cc: "-march=icelake-server")  # another CPU
    assert first != native.library_path(tmp_path, "gcc", gomp)
    monkeypatch.setattr(build, "native_target", lambda cc: "-march=znver4 -mavx512bf16")
    monkeypatch.setattr(build, "compiler_identity", lambda cc: "gcc (Debian 13.1.0) 13.1.0 x86_64-linux-gnu")
    assert first != native.library_path(tmp_path, "gcc", gomp)  # a new compiler version
    monkeypatch.setattr(build, "native_target", lambda cc: "")  # a compiler that does not say: /proc/cpuinfo's flags
    monkeypatch.setattr(native, "cpu_flags", lambda: "fpu sse2")
    other = native.library_path(tmp_path, "gcc", gomp)
    monkeypatch.setattr(native, "cpu_flags", lambda: "fpu sse2 avx2")
    assert other != native.library_path(tmp_path, "gcc", gomp)


@pytest.mark.fast_paths
def test_a_cpu_nobody_can_describe_builds_nothing(monkeypatch, tmp_path):
    from mtrain.cpu import build

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(native.ENV, raising=False)
    monkeypatch.setattr(build, "native_target", lambda cc: "")
    monkeypatch.setattr(native, "cpu_flags", lambda: "")
    try:
        native.library.cache_clear()
        assert native.library() is None and "which instruction sets this CPU has" in native.status
        assert not list(tmp_path.rglob("*.so"))
    finally:
        native.library.cache_clear()


def test_openmp_runtime_is_the_one_mapped_into_the_process(tmp_path):
    maps = tmp_path / "maps"
    """torch's own, where other packages bring theirs (sentencepiece and CTranslate2 bundle libgomp)."""
    torch_dir = Path("/venv/torch")
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
                    "7f01-7f02 r-xp 00000000 08:01 3 /venv/sentencepiece.libs/libgomp-6a29c32d.so.1.0.0\n"
                    "7f02-7f03 r-xp 00000000 08:01 2 /venv/torch/lib/libgomp-a34b3233.so.1\n"
                    "7f04-7f05 rw-p 00000000 00:00 0\n")
    assert native.openmp_runtime(maps, torch_dir) == Path("/venv/torch/lib/libgomp-a34b3233.so.1")
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 3 /venv/sentencepiece.libs/libgomp-6a29c32d.so.1.0.0\n"
                    "7f02-7f03 r-xp 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libgomp.so.1\n")
    assert native.openmp_runtime(maps, torch_dir) == Path("/usr/lib/x86_64-linux-gnu/libgomp.so.1")
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n")
    assert native.openmp_runtime(maps, torch_dir) is None
    assert native.openmp_runtime(tmp_path / "missing", torch_dir) is None


@needs_kernel
def test_the_kernels_share_torchs_openmp_runtime():
    """The kernels' library binds the GOMP_ calls to torch's runtime, not to a second copy."""
    import shutil
    import subprocess

    if shutil.which("ldd") is None:
        pytest.skip("no ldd to ask")

    runtime = native.openmp_runtime()
    assert runtime is not None and Path(torch.__file__).resolve().parent in runtime.parents
    linked = subprocess.run(["ldd", str(native.library()._name)], capture_output=True, text=True).stdout
    gomp = [line.split("=>")[1].split()[0] for line in linked.splitlines() if "gomp" in line or "iomp5" in line]
    assert [Path(path).resolve() for path in gomp] == [runtime.resolve()]


def check_topk(logits, k):
    """topk_logsumexp against torch on the float32 upcast (exact for bfloat16): the same values, ids
    that hold them (the first column of equal values first), and a float32-accurate normaliser."""
    top, ids, lse = native.topk_logsumexp(logits, k)
    x = logits.float()
    want_top = x.topk(k, dim=1).values
    assert torch.equal(top, want_top)
    assert torch.equal(x.gather(1, ids), top)
    for row in range(x.size(0)):  # among equal values, the first columns
        for value in top[row].unique():
            if value > float("-inf"):
                columns = (x[row] == value).nonzero().squeeze(1)
                taken = ids[row][top[row] == value]
                assert torch.equal(taken, columns[: taken.numel()])
    want_lse = torch.logsumexp(x.double(), dim=1, keepdim=True)
    finite = want_lse.isfinite()
    assert torch.allclose(lse.double()[finite], want_lse[finite], rtol=1e-6, atol=1e-6)
    assert torch.equal(lse[~finite], want_lse[~finite].float())


@needs_kernel
@pytest.mark.parametrize("V", [16, 37, 8000])
@pytest.mark.parametrize("k", [1, 7, 32])
def test_topk_logsumexp_equals_torch(V, k):
    if k > V:
        pytest.skip("k > V")
    gen = torch.Generator().manual_seed(V + k)
    logits = (torch.randn(9, V, generator=gen) * 4).bfloat16()  # bfloat16: many ties
    logits[1, :: 3] = float("-inf")  # banned or suppressed tokens
    logits[2] += 70  # a maximum past 88 - ln V: the shifted sum
    logits[3] -= 80  # a maximum below -60: the shifted sum
    check_topk(logits, k)


@needs_kernel
def test_topk_logsumexp_rows_with_fewer_finite_values_than_k():
    """A row with 2 finite values and k = 5 gets them, then -inf; an all -inf row gets -inf everywhere."""
    logits = torch.full((2, 40), float("-inf"), dtype=torch.bfloat16)
    logits[0, 7], logits[0, 30] = 1.5, 2.5
    top, ids, lse = native.topk_logsumexp(logits, 5)
    assert top[0, :2].tolist() == [2.5, 1.5] and ids[0, :2].tolist() == [30, 7]
    assert top[0, 2:].isneginf().all() and top[1].isneginf().all()
    assert lse[0, 0].item() == pytest.approx(torch.tensor([1.5, 2.5]).logsumexp(0).item(), rel=1e-6)
    assert lse[1, 0].item() == float("-inf")


@needs_kernel
def test_topk_logsumexp_reads_a_block_of_rows_with_a_stride():
    logits = (torch.randn(6, 100) * 3).bfloat16()
    block = logits[:, :64]  # rows 100 apart
    check_topk(block, 4)


def test_topk_logsumexp_declines_float32_and_large_k():
    logits = torch.randn(3, 50)
    assert native.topk_logsumexp(logits, 4) is None
    assert native.topk_logsumexp(logits.bfloat16(), 33) is None


@needs_kernel
def test_beam_search_on_bfloat16_blocks_equals_the_float32_logits_path(bf16_model, monkeypatch):
    """Beam search with the top-k kernel on bfloat16 blocks of logits (several blocks a step) gives
    the ids of the float32 path over the same logits, and scores equal to float32 rounding: only
    the log-normaliser's summation order differs."""
    import mtrain.search as search

    gen = torch.Generator().manual_seed(4)
    src = torch.randint(4, 40, (6, 8), generator=gen)
    max_len = torch.full((6,), 10)
    monkeypatch.setattr(search, "BLOCK_BYTES", 4 * 40 * 4)  # 4 rows a block
    fused = beam_search(bf16_model, src, 3, 0.6, max_len, nbest=3, no_repeat_ngram=2)
    monkeypatch.setattr(native, "topk_logsumexp", lambda *args: None)
    plain = beam_search(bf16_model, src, 3, 0.6, max_len, nbest=3, no_repeat_ngram=2)
    for got, want in zip(fused, plain):
        assert [ids for ids, _ in got] == [ids for ids, _ in want]
        assert [score for _, score in got] == pytest.approx([score for _, score in want], rel=1e-5, abs=1e-6)


@needs_kernel
def test_bfloat16_cache_holds_every_key_and_value_through_regrowths_and_reorders():
    """Appends of 1-8 positions at a time, with regrowths and row reorders between them: after each
    the views the cache returns hold exactly the keys and values so far, in bfloat16, and the
    kernel over them equals attention in float64."""
    from mtrain.cpu.cache import CPULayerCache

    gen = torch.Generator().manual_seed(3)
    layer = CPULayerCache()
    seen_k = seen_v = torch.empty(4, 2, 0, 32, dtype=torch.bfloat16)
    for step in range(40):
        t = int(torch.randint(1, 9, (1,), generator=gen))
        k, v = (torch.randn(4, 2, t, 32, generator=gen).bfloat16() for _ in range(2))
        if step % 7 == 6:
            order = torch.randperm(4, generator=gen)
            layer.reorder(order, None)
            seen_k, seen_v = seen_k.index_select(0, order), seen_v.index_select(0, order)
        keys, values = layer.append(k, v)
        seen_k, seen_v = torch.cat([seen_k, k], dim=2), torch.cat([seen_v, v], dim=2)
        assert layer.native and torch.equal(keys, seen_k) and torch.equal(values, seen_v), step
    q = torch.randn(4, 2, 1, 32, generator=gen).bfloat16()
    assert torch.allclose(layer.attention(q, keys, values, None, False).double(), reference(q, keys, values, None),
                          rtol=2 ** -8, atol=1e-5)


@needs_kernel
def test_topk_without_normaliser_is_the_first_argmax():
    """normaliser=False (greedy search): the same top values and columns, no log-sum-exp; top-1 is
    argmax's first column of equal maxima (the CPU reductions' argmax, greedy search's)."""
    from mtrain.cpu.ops import argmax_rows
    from mtrain.cpu.reductions import CPU

    logits = (torch.randn(20, 300) * 2).bfloat16()
    logits[3, 10] = logits[3, 250] = 99  # a tie: the first column wins
    top, ids, lse = native.topk_logsumexp(logits, 3, normaliser=False)
    assert lse is None
    assert torch.equal(top, native.topk_logsumexp(logits, 3)[0]) and torch.equal(ids, native.topk_logsumexp(logits, 3)[1])
    assert torch.equal(CPU.argmax(logits), argmax_rows(logits.float())) and CPU.argmax(logits)[3] == 10


def test_float32_decoding_never_builds_the_kernels(monkeypatch):
    """A float32 model (decoding's default) decodes without asking for the kernels at all, so it
    never waits for a build."""
    def refuse():
        raise AssertionError("float32 decoding asked for the C kernels")

    monkeypatch.setattr(native, "library", refuse)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(d_model=32, d_ff=64, n_heads=2, n_encoder_layers=1, n_decoder_layers=1,
                                    vocab_size=20, dropout=0.0)).eval()
    src = torch.randint(4, 20, (3, 6))
    max_len = torch.full((3,), 5)
    assert len(greedy_search(model, src, max_len)) == 3
    assert len(beam_search(model, src, 3, 0.6, max_len)) == 3


@needs_kernel
def test_where_the_kernel_declines_the_cache_is_attended_by_torch(bf16_model, monkeypatch):
    """A prefix fed at once (a causal mask) and beam 9 (more queries a row than the kernel takes)
    attend with PyTorch over the bfloat16 cache: the uncached logits, and beam 9's outputs with and
    without the kernels."""
    gen = torch.Generator().manual_seed(5)
    src = torch.randint(4, 40, (4, 8), generator=gen)
    tgt = torch.randint(4, 40, (4, 6), generator=gen)
    with torch.inference_mode():
        memory = bf16_model.encode(src)
        full = bf16_model.decode(tgt, memory, src).float()
        cache = bf16_model.new_cache()
        prefix = bf16_model.decode(tgt[:, :3], memory, src, cache).float()
        rest = [bf16_model.decode(tgt[:, t : t + 1], memory, src, cache).float() for t in range(3, 6)]
    assert cache.layers[0].native
    assert torch.allclose(torch.cat([prefix, *rest], dim=1), full, atol=0.1, rtol=0.05)
    max_len = torch.full((4,), 8)
    with_kernel = beam_search(bf16_model, src, 9, 0.6, max_len)
    monkeypatch.setattr(native, "wanted", lambda x: False)
    without = beam_search(bf16_model, src, 9, 0.6, max_len)
    assert sum(a[0][0] == b[0][0] for a, b in zip(with_kernel, without)) >= 3
