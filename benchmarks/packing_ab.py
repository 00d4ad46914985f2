"""The CPU training step on the batch's real positions only (mtrain.cpu.packing) against the same step
on the padded batch, alternated batch by batch in one process, so that load from elsewhere on a
shared machine hits both alike. With --attention, both steps packed: attention from the rows
straight to the heads (mtrain.cpu.switches.heads_from_rows) against attention through the padded grid.
With --masks, both
packed: dropout masks written by mtrain.cpu.native in one pass against masks from numpy's
PCG64DXSM words and three integer passes over them (the masks' cost, not their bits, is compared).
With --loss (with --bf16), both packed: the loss's row sums and gradient over the bfloat16 logits
by mtrain.cpu.native against PyTorch's passes over chunks of rows.

    python benchmarks/packing_ab.py --bf16 --threads 2                 # small shape, bfloat16 autocast
    python benchmarks/packing_ab.py --bf16 --shape base --batches 3    # the paper's base shape
    python benchmarks/packing_ab.py --threads 2 --json                 # float32
    python benchmarks/packing_ab.py --bf16 --attention --threads 2     # rows to heads against the grid
    python benchmarks/packing_ab.py --bf16 --masks --threads 2         # dropout masks in C or from numpy
    python benchmarks/packing_ab.py --bf16 --loss --threads 2          # the loss over bf16 logits in C or not

First one step of each from the same weights without dropout: their losses and the largest
gradient difference relative to the gradient's largest entry (float32: summation order only;
bfloat16: a few of its 2^-8 rounding steps). Then the timed rounds, warm-up excluded; the order of
the two alternates from round to round. The batches and model are benchmarks/train_step.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_step as ts  # noqa: E402  (the same shapes, lengths and batches)
from ab import alternate  # noqa: E402

from mtrain.cpu import ops  # noqa: E402
from mtrain.cpu import native  # noqa: E402
import mtrain.cpu.model as cpu_model  # noqa: E402
from mtrain.cpu import switches  # noqa: E402
from mtrain.loss import Objective  # noqa: E402
from mtrain.memory import reuse_freed_memory  # noqa: E402
from mtrain.model import Transformer  # noqa: E402

PACKED, PADDED = cpu_model.packs, lambda ids: False
HEADS = True


def choose(packs, heads_from_rows: bool):
    """A variant: packing on or off, and whether attention goes from the rows to the heads."""
    def apply() -> None:
        cpu_model.packs, switches.heads_from_rows = packs, heads_from_rows
    return apply


def numpy_lanes(seed: int, n: int, threshold: int, width: int) -> torch.Tensor:
    """Dropout-mask lanes as they were made before the C kernel: numpy's PCG64DXSM words from the
    seed, each 16-bit lane's low 15 bits plus 2^15 - threshold, the lane's top bit spread by an
    arithmetic shift (two in-place passes over the words, one over the lanes)."""
    words = torch.from_numpy(np.random.PCG64DXSM(seed).random_raw((n + 3) // 4).view(np.int64))
    lanes = words.bitwise_and_(ops._LOW_15_BITS).add_(ops._in_lanes(32768 - threshold))
    return lanes.view(torch.int16)[:n].bitwise_right_shift_(15)


def masks(lanes):
    """A variant of the packed step whose dropout masks come from `lanes` (mtrain.cpu.ops.cpu_keep_lanes)."""
    def apply() -> None:
        choose(PACKED, HEADS)()
        ops.cpu_keep_lanes = lanes
    return apply


LOSS_KERNELS = (native.cross_entropy_sums, native.cross_entropy_gradient_)


def loss_kernels(on: bool):
    """A variant of the packed step whose loss over bfloat16 logits runs mtrain.cpu.native or not."""
    def apply() -> None:
        choose(PACKED, HEADS)()
        declined = (lambda *args: False,) * 2
        native.cross_entropy_sums, native.cross_entropy_gradient_ = LOSS_KERNELS if on else declined
    return apply


# Each comparison: {baseline, candidate}, in that order.
COMPARISONS = {
    "packing": {"padded": choose(PADDED, HEADS), "packed": choose(PACKED, HEADS)},
    "attention": {"grid": choose(PACKED, False), "heads": choose(PACKED, HEADS)},
    "masks": {"numpy": masks(numpy_lanes), "c": masks(ops.cpu_keep_lanes)},
    "loss": {"chunks": loss_kernels(False), "c": loss_kernels(True)},
}


def precision(bf16: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def parity(cfg, batch, bf16: bool, variants: dict) -> dict:
    """One step of each variant from the same weights, dropout off: losses, gradient difference."""
    model = cpu_model.accelerate(Transformer(dataclasses.replace(cfg, dropout=0.0))).train()
    objective = Objective(model, ts.LABEL_SMOOTHING)
    out = {}
    for name, apply in variants.items():
        apply()
        model.zero_grad(set_to_none=True)
        with precision(bf16):
            loss, _ = objective(*batch)
        loss.backward()
        out[name] = (loss.item(), [p.grad.float().clone() for p in model.parameters()])
    baseline, candidate = variants
    worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
                for a, b in zip(out[candidate][1], out[baseline][1]))
    return {"loss": {name: out[name][0] for name in out}, "max_relative_gradient_difference": worst}


def timed(cfg, batches, bf16: bool, rounds: int, variants: dict) -> tuple[dict[str, list[float]], list[float]]:
    """Seconds per step of each variant, and baseline / candidate per batch."""
    loss_fn, model = ts.mtrain_step_fn(cfg, False)
    optimizer = ts.mtrain_optimizer(model)

    def step(batch) -> None:
        optimizer.zero_grad(set_to_none=True)
        with precision(bf16):
            loss = loss_fn(batch) / int((batch[2] != ts.PAD).sum())
        loss.backward()
        optimizer.step()

    seconds, ratios, _ = alternate(variants, batches, rounds, step, warmup=2)
    return seconds, ratios


def step_options(doc: str, batches: int, rounds: int) -> argparse.ArgumentParser:
    """The options of a script that times training-step variants on train_step.py's batches."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(ts.SHAPES), default="small")
    parser.add_argument("--bf16", action="store_true", help="under bfloat16 autocast (train.amp=bf16)")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--batches", type=int, default=batches)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return parser


def step_batches(args: argparse.Namespace) -> tuple:
    """Threads, allocator and seed set as the options say; the shape's config, its bucketed
    batches, and where their lengths come from."""
    if args.threads:
        torch.set_num_threads(args.threads)
    reuse_freed_memory()  # as mtrain train does
    torch.manual_seed(args.seed)
    cfg = ts.SHAPES[args.shape]
    src, tgt, lengths = ts.sample_lengths(8000, args.seed)
    return cfg, ts.bucketed_batches(src, tgt, args.max_tokens, args.batches, cfg.vocab_size, args.seed), lengths


def main(argv: list[str] | None = None) -> dict:
    parser = step_options(__doc__, batches=6, rounds=3)
    parser.add_argument("--attention", action="store_true",
                        help="both packed: attention from the rows to the heads against through the grid")
    parser.add_argument("--masks", action="store_true",
                        help="both packed: dropout masks by mtrain.cpu.native against from numpy's words")
    parser.add_argument("--loss", action="store_true",
                        help="both packed: the loss over bfloat16 logits by mtrain.cpu.native against by chunks")
    args = parser.parse_args(argv)
    cfg, batches, lengths = step_batches(args)
    variants = COMPARISONS["loss" if args.loss else "masks" if args.masks
                           else "attention" if args.attention else "packing"]
    baseline, candidate = variants
    check = parity(cfg, batches[0], args.bf16, variants)
    print(f"one step, no dropout: loss {baseline} {check['loss'][baseline]:.6f}, {candidate} "
          f"{check['loss'][candidate]:.6f}; largest gradient difference "
          f"{check['max_relative_gradient_difference']:.3g} of the largest entry", file=sys.stderr)
    seconds, ratios = timed(cfg, batches, args.bf16, args.rounds, variants)
    tokens = sum(int((b[2] != ts.PAD).sum()) for b in batches) * args.rounds
    result = {
        "shape": args.shape, "precision": "bfloat16 autocast" if args.bf16 else "float32",
        "threads": torch.get_num_threads(), "batches": len(batches), "rounds": args.rounds, "lengths": lengths,
        "tok_s": {name: round(tokens / sum(s), 1) for name, s in seconds.items()},
        f"{candidate}_speedup_median": round(statistics.median(ratios), 3),
        f"{candidate}_speedup_mean": round(statistics.mean(ratios), 3),
        "parity": check, "torch": torch.__version__,
    }
    print(f"{args.shape}, {result['precision']}, {result['threads']} threads: target tok/s {baseline} "
          f"{result['tok_s'][baseline]}, {candidate} {result['tok_s'][candidate]}; {candidate} / {baseline} per "
          f"batch: median {result[f'{candidate}_speedup_median']}x, mean {result[f'{candidate}_speedup_mean']}x",
          file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
