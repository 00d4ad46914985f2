"""Training speed and memory on a GPU: mtrain's model and loss (autocast in the precision
train.amp=auto picks on this device: bfloat16 from compute capability 8.0, float16 with a
gradient scaler before), backward and fused Adam, next to the usual `torch.nn.Transformer` build
on the same batches in the same precision, at several token budgets, each with its peak memory.
Then the budget `train.max_tokens=auto` picks here, by mtrain's own probe. What `mtrain train`
adds to a step is not timed: gradient clipping's norm, the loss's all-reduce and logging.

    python benchmarks/gpu_step.py --json                       # the paper's base shape, 32k vocabulary
    python benchmarks/gpu_step.py --json --compile             # also mtrain under torch.compile (train.compile)
    python benchmarks/gpu_step.py --device cpu --quick         # a check that the script runs (no GPU)

Throughput is real (non-pad) target tokens per second over whole steps (forward, backward, Adam),
the device synchronised before the clock stops. Peak memory is torch's caching allocator's
(max_memory_allocated, and max_memory_reserved: what another allocation can run out of). A budget
that runs out of memory is reported as such, and the next model or budget goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from typing import Callable

import numpy as np
import torch
from torch import nn

from mtrain import probe
from mtrain.config import ModelConfig
from mtrain.errors import first_line, is_out_of_memory
from mtrain.hardware import machine_record, resolve_amp
from train_step import LABEL_SMOOTHING, PAD, SHAPES, Batch, TorchTransformer, bucketed_batches, full_logits_loss, \
    mtrain_optimizer, sample_lengths, to_batch

GiB = 2 ** 30
COMPILED = "mtrain compiled"
QUICK_SHAPE = ModelConfig(d_model=64, d_ff=128, n_heads=2, n_encoder_layers=1, n_decoder_layers=1,
                          vocab_size=1000, dropout=0.1)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Step:
    """One model's training step on a device: forward and loss under autocast, backward (through a
    gradient scaler in float16), fused Adam."""

    def __init__(self, name: str, cfg: ModelConfig, device: torch.device, amp: torch.dtype | None) -> None:
        from mtrain.loss import Objective
        from mtrain.model import Transformer

        self.name, self.device, self.amp = name, device, amp
        if name.startswith("mtrain"):
            model = Transformer(cfg).to(device).train()
            objective = Objective(model, LABEL_SMOOTHING)  # the projection at real positions only, as in training
            if name == COMPILED:  # as train.compile: one graph for all batch shapes, fewer and fused kernels
                objective = torch.compile(objective, dynamic=True)
            self.loss: Callable[[Batch], torch.Tensor] = lambda b: objective(*b)[0]
            self.optimizer = mtrain_optimizer(model, device)
        else:
            model = TorchTransformer(cfg).to(device).train()
            self.loss = lambda b: full_logits_loss(model(b[0], b[1]), b[2])
            self.optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9,
                                              fused=device.type == "cuda")
        self.model = model
        self.scaler = torch.amp.GradScaler(device.type) if amp == torch.float16 else None

    def __call__(self, batch: Batch, tokens: int) -> None:
        """One update on batch, whose real target tokens (counted on the host) normalise the loss."""
        self.optimizer.zero_grad(set_to_none=True)
        autocast = torch.autocast(self.device.type, dtype=self.amp) if self.amp else contextlib.nullcontext()
        with autocast:
            loss = self.loss(batch) / tokens
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peaks(device: torch.device) -> dict[str, float | None]:
    if device.type != "cuda":
        return {"peak_allocated_gib": None, "peak_reserved_gib": None}
    return {"peak_allocated_gib": round(torch.cuda.max_memory_allocated(device) / GiB, 2),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / GiB, 2)}


def measure(name: str, cfg: ModelConfig, batches: list[tuple[Batch, int]], device: torch.device,
            amp: torch.dtype | None, rounds: int) -> dict[str, object]:
    """tokens/s over rounds x batches after one warm-up pass, and the peak memory of it all."""
    step = None
    try:
        reset_peak(device)
        step = Step(name, cfg, device, amp)
        for batch, tokens in batches:  # warm-up: kernels chosen, the allocator's blocks cached, Adam's moments made
            step(batch, tokens)
        synchronize(device)
        start = time.perf_counter()
        for _ in range(rounds):
            for batch, tokens in batches:
                step(batch, tokens)
        synchronize(device)
        seconds = time.perf_counter() - start
        total = rounds * sum(tokens for _, tokens in batches)
        return {"tok_s": round(total / seconds, 1), "step_ms": round(1000 * seconds / (rounds * len(batches)), 1),
                **peaks(device)}
    except RuntimeError as err:
        if not is_out_of_memory(err):
            raise
        return {"tok_s": None, "out_of_memory": first_line(err)[:200], **peaks(device)}
    finally:
        del step
        reset_peak(device)


def auto_budget(cfg: ModelConfig, src: np.ndarray, tgt: np.ndarray, device: torch.device,
                amp: torch.dtype | None) -> int | None:
    """What train.max_tokens=auto picks on this device: mtrain's probe (the longest pairs and the
    longest targets of each budget tried, 10 % of memory left free) with mtrain's step."""
    gauge = probe.memory_gauge(device)
    if gauge is None:
        return None
    generator = torch.Generator().manual_seed(0)
    step = Step("mtrain", cfg, device, amp)
    batches = probe.ProbeBatches(src, tgt)

    def run(budget: int) -> None:
        for rows in batches(budget):
            batch = to_batch(src[rows], tgt[rows], cfg.vocab_size, generator)
            step(tuple(t.to(device) for t in batch), int((batch[2] != PAD).sum()))

    try:
        return probe.search(probe.Probe(run, gauge, log), gauge.capacity(), probe.longest_cost(src, tgt))
    finally:
        del step
        reset_peak(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="base")
    parser.add_argument("--budgets", type=int, nargs="+", default=[4096, 8192, 16384, 25000],
                        help="token budgets per batch (25000: the paper's batches of ~25000 target tokens)")
    parser.add_argument("--batches", type=int, default=6, help="distinct batches per budget")
    parser.add_argument("--rounds", type=int, default=3, help="timed passes over them")
    parser.add_argument("--no-probe", action="store_true", help="skip train.max_tokens=auto's probe")
    parser.add_argument("--quick", action="store_true", help="a tiny model, one small budget: checks the script runs")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--compile", action="store_true",
                        help="also time mtrain under torch.compile (train.compile); its warm-up pass compiles")
    args = parser.parse_args()
    device = torch.device(args.device)
    cfg = SHAPES[args.shape]
    if args.quick:
        cfg, args.budgets, args.batches, args.rounds = QUICK_SHAPE, [512], 2, 1
    amp = resolve_amp("auto", device)
    src, tgt, lengths = sample_lengths(20000, seed=1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log(f"{name}, {args.shape if not args.quick else 'quick'} shape, precision {amp or torch.float32}, {lengths}")
    rows = []
    for budget in args.budgets:
        host = bucketed_batches(src, tgt, budget, args.batches, cfg.vocab_size, seed=1)
        batches = [(tuple(t.to(device) for t in b), int((b[2] != PAD).sum())) for b in host]
        row: dict[str, object] = {"max_tokens": budget,
                                  "padded_tokens_per_batch_max": max(max(b[0].numel(), b[1].numel()) for b in host),
                                  "target_tokens_per_batch": round(float(np.mean([n for _, n in batches])), 1)}
        for model in ("mtrain", "nn.Transformer") + ((COMPILED,) if args.compile else ()):
            row[model] = measure(model, cfg, batches, device, amp, args.rounds)
            log(f"max_tokens {budget}: {model}: {row[model]}")
        theirs = row["nn.Transformer"]["tok_s"]  # type: ignore[index]
        for model, key in (("mtrain", "mtrain_vs_nn_transformer"), (COMPILED, "mtrain_compiled_vs_nn_transformer")):
            if model in row:
                ours = row[model]["tok_s"]  # type: ignore[index]
                row[key] = round(ours / theirs, 2) if ours and theirs else None
        rows.append(row)
        del batches
    chosen = None if args.no_probe else auto_budget(cfg, src, tgt, device, amp)
    result = {"device": name, "shape": "quick" if args.quick else args.shape, "precision": str(amp or torch.float32),
              "lengths": lengths, "rows": rows, "max_tokens_auto": chosen, "torch": torch.__version__,
              **machine_record()}
    if chosen is not None:
        log(f"train.max_tokens=auto picks {chosen} here")
    if args.json:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
