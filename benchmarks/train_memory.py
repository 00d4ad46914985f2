"""A training process's memory and speed epoch by epoch: mtrain's training step (bfloat16 autocast
where the CPU has it natively) on the real batches of a tokenized folder, a new epoch's batches
each round, as `mtrain train` draws them. After each epoch it prints target tokens/s, the resident
set and glibc's heap: bytes in use, and bytes free but still mapped. A heap that keeps growing
while the live data does not is what makes a long run's trainer grow by gigabytes.

    python benchmarks/train_memory.py --epochs 3 --json
    PYTHONPATH=/path/to/other/checkout python benchmarks/train_memory.py   # the same, other code

Linux only (it reads /proc/self/status and glibc's mallinfo2)."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import sys
import time
from pathlib import Path

import torch

from mtrain.config import ModelConfig
from mtrain.data import TokenizedData, collate, make_batches
from mtrain.hardware import cpu_has_native_bf16, machine_record
from mtrain.loss import Objective
from mtrain.model import Transformer

from data_scale import proc_status  # the sibling benchmarks (this script's folder is on sys.path)
from train_step import mtrain_optimizer

ROOT = Path(__file__).resolve().parents[1]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def memory_mb() -> dict[str, int]:
    """Resident set, and glibc's heap (all arenas): in use, and free but mapped; in MB."""
    rss = proc_status(os.getpid())["VmRSS"] // 1024
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return {"rss_mb": rss, "heap_in_use_mb": info.uordblks >> 20, "heap_free_mb": info.fordblks >> 20}


def default_data() -> Path:
    found = sorted(p.parent for p in (ROOT / "data").glob("*/meta.json"))
    if not found:
        sys.exit("no tokenized folder under data/; run `mtrain tokenize` first or pass --data")
    return found[0]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=None, help="a `mtrain tokenize` folder (default: the first in data/)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batches", type=int, default=250, help="batches per epoch (the Multi30k recipe's epoch is ~250)")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fp32", action="store_true", help="float32 even where bfloat16 is native")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = TokenizedData(args.data or default_data())
    split = data.split("train")
    vocab = data.tokenizer.tgt.vocab_size
    cfg = ModelConfig(d_model=256, d_ff=1024, n_heads=4, n_encoder_layers=3, n_decoder_layers=3,
                      vocab_size=vocab, dropout=0.2)
    torch.manual_seed(1)
    model = Transformer(cfg).train()
    objective = Objective(model, 0.1)
    optimizer = mtrain_optimizer(model)  # the Adam `mtrain train` makes (the default one for an older checkout)
    bf16 = cpu_has_native_bf16() and not args.fp32
    precision = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    rows = [{"epoch": 0, **memory_mb()}]
    for epoch in range(1, args.epochs + 1):
        tokens, start = 0, time.perf_counter()
        for indices in make_batches(split.src.lengths, split.tgt.lengths, args.max_tokens, seed=1, epoch=epoch)[:args.batches]:
            src, tgt_in, tgt_out = collate(split, indices)
            optimizer.zero_grad(set_to_none=True)
            with precision():
                loss, _ = objective(src, tgt_in, tgt_out)
            n = int((tgt_out != 0).sum())
            (loss / n).backward()
            optimizer.step()
            tokens += n
        rows.append({"epoch": epoch, "tok_s": round(tokens / (time.perf_counter() - start)), **memory_mb()})
        print(" ".join(f"{k} {v}" for k, v in rows[-1].items()), file=sys.stderr, flush=True)
    result = {"precision": "bfloat16" if bf16 else "float32", "data": str(data.path), "batches": args.batches,
              "max_tokens": args.max_tokens, "threads": args.threads, "epochs": rows, "machine": machine_record()}
    if args.json:
        print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
