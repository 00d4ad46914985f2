"""A packed CPU training step's attention sublayers alone, forward and backward: attention from the
rows straight to the heads (mtrain.cpu.switches.heads_from_rows: Packing.to_heads, ops.heads_attention,
Packing.from_heads) against attention through the padded grid (Packing.to_grid, the heads' views,
attention, the rows' gather), taking turns call by call in one process.

    python benchmarks/attention_layout.py --threads 2             # float32
    python benchmarks/attention_layout.py --bf16 --threads 2      # bfloat16 autocast

One call runs an encoder self-attention, a decoder's causal self-attention and its cross-attention
(projections included) on the rows of one of benchmarks/train_step.py's batches, then their
backward. Reported: ms per call of each path (median over the calls), and from torch.profiler
each path's ms per call by kind of op: matmuls (the projections and attention's), softmax, layout
(gathers, the grid's fills and copies, the heads' copies, the gradients' stacks), dtype casts
(autocast's and the softmax's, whose copies are counted here and not as layout), the rest. The
layout ops are memory traffic, comparable across CPUs; the matmuls' share is not: a CPU without
native bfloat16 (AMX or AVX512-BF16) runs bfloat16 matmuls emulated, many times slower.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_step as ts  # noqa: E402  (the same shapes, lengths and batches)
from packing_ab import step_batches, step_options  # noqa: E402

from mtrain.cpu import switches  # noqa: E402
from mtrain.cpu.model import accelerate  # noqa: E402
from mtrain.hardware import cpu_has_native_bf16  # noqa: E402
from mtrain.model import CrossAttention, SelfAttention, key_mask  # noqa: E402
from mtrain.cpu.packing import Packing  # noqa: E402

PATHS = {"grid": False, "heads": True}
KINDS = [
    (("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise"), "matmuls"),
    (("aten::_softmax", "aten::_softmax_backward_data", "aten::nan_to_num_", "aten::masked_fill_",
      "aten::add_", "aten::triu_", "aten::mul_", "aten::mul"), "softmax, scale, masks"),
    (("aten::index_select", "aten::index_copy_", "aten::index_fill_", "aten::copy_", "aten::clone",
      "aten::stack", "aten::cat", "aten::fill_", "aten::zero_"), "layout"),
    (("aten::_to_copy",), "dtype casts"),
]


def sublayers(cfg) -> tuple[SelfAttention, SelfAttention, CrossAttention]:
    make = lambda kind: accelerate(kind(cfg.d_model, cfg.n_heads, 0.0)).train()  # noqa: E731
    return make(SelfAttention), make(SelfAttention), make(CrossAttention)


def one_call(layers, batch, bf16: bool):
    """The three sublayers forward on the batch's rows, then backward; returns a callable."""
    src, tgt_in, _ = batch
    src_packing, tgt_packing = Packing.of(src, ts.PAD), Packing.of(tgt_in, ts.PAD)
    gen = torch.Generator().manual_seed(0)
    memory = torch.randn(src_packing.index.numel(), layers[0].qkv.in_features, generator=gen, requires_grad=True)
    states = torch.randn(tgt_packing.index.numel(), memory.size(1), generator=gen, requires_grad=True)
    src_mask = key_mask(src, ts.PAD)
    encoder_self, decoder_self, cross = layers

    def run() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            out = encoder_self(memory, mask=src_mask, packing=src_packing)
            out2 = decoder_self(states, is_causal=True, packing=tgt_packing)
            out3 = cross(states, memory, src_mask, packing=tgt_packing, memory_packing=src_packing)
        (out.float().sum() + out2.float().sum() + out3.float().sum()).backward()
    return run


def by_kind(run, calls: int) -> dict[str, float]:
    """ms per call by kind of op (each op's self time, the calling thread's)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            run()
    parts: dict[str, float] = {}
    main = None
    for event in prof.events():
        if event.cpu_parent is None and main is None:
            main = event.thread
        if event.thread != main:
            continue
        kind = next((label for names, label in KINDS if event.name in names), "other")
        if _inside(event, KINDS[0][0]):  # a matmul's own work (an emulated bfloat16 bmm selects each matrix)
            kind = "matmuls"
        elif kind == "layout" and _inside(event, ("aten::_to_copy",)):  # a cast's copy: .to(), autocast
            kind = "dtype casts"
        parts[kind] = parts.get(kind, 0.0) + event.self_cpu_time_total / 1e3 / calls
    return {kind: round(ms, 3) for kind, ms in sorted(parts.items(), key=lambda kv: -kv[1])}


def seconds_of(path: str, run) -> float:
    """Wall time of one call on that attention path."""
    switches.heads_from_rows = PATHS[path]
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _inside(event, names: tuple[str, ...]) -> bool:
    """Whether one of the ops that called this one is named in names."""
    node = event.cpu_parent
    while node is not None and node.name not in names:
        node = node.cpu_parent
    return node is not None


def main(argv: list[str] | None = None) -> dict:
    args = step_options(__doc__, batches=3, rounds=5).parse_args(argv)
    cfg, batches, lengths = step_batches(args)
    layers = sublayers(cfg)
    runs = [one_call(layers, batch, args.bf16) for batch in batches]

    for path in PATHS:  # warm-up: allocator, oneDNN's kernels for these shapes
        for run in runs:
            seconds_of(path, run)
    seconds: dict[str, list[float]] = {path: [] for path in PATHS}
    for r in range(args.rounds):
        for run in runs:
            for path in (list(PATHS) if r % 2 == 0 else list(PATHS)[::-1]):
                seconds[path].append(seconds_of(path, run))
    kinds = {}
    for path in PATHS:
        switches.heads_from_rows = PATHS[path]
        kinds[path] = {}
        for run in runs:
            for kind, ms in by_kind(run, 2).items():
                kinds[path][kind] = round(kinds[path].get(kind, 0.0) + ms / len(runs), 3)
    switches.heads_from_rows = True
    result = {
        "shape": args.shape, "precision": "bfloat16 autocast" if args.bf16 else "float32",
        "bf16_native": cpu_has_native_bf16(), "threads": torch.get_num_threads(), "batches": len(batches),
        "rounds": args.rounds, "lengths": lengths,
        "ms_per_call_median": {path: round(1e3 * statistics.median(s), 3) for path, s in seconds.items()},
        "profiled_ms_per_call_by_kind": kinds, "torch": torch.__version__,
    }
    log = lambda *a: print(*a, file=sys.stderr)  # noqa: E731
    log(f"{args.shape}, {result['precision']}, {result['threads']} threads, attention sublayers forward + backward, "
        f"ms per call (median): " + ", ".join(f"{p} {ms}" for p, ms in result["ms_per_call_median"].items()))
    for path, parts in kinds.items():
        log(f"  {path}, profiled: " + ", ".join(f"{k} {ms}" for k, ms in parts.items()))
    if args.bf16 and not result["bf16_native"]:
        log("  (no native bfloat16 here: the matmuls are emulated; compare the layout ops)")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
