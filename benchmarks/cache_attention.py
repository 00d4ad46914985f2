"""Attention over a decoding cache at beam 5's shapes, alone: PyTorch's CPU kernel on float32 keys
and values (what a bfloat16 decoding copy runs without mtrain.cpu.native) against the C kernel on
the bfloat16 cache, in one process, each timed as the best of three rounds.

315 sentences x 4 heads x 5 queries (beam search folds a sentence's beams into one row), d_head 64,
random inputs: over 13 and 30 source keys (cross-attention, every key allowed), and over 10, 60 and
150 slots of a 1280-slot self-attention buffer (the room a search reserves) under a mask that lets
each query see 40 % of them, as beam search's ancestry mask does.

    python benchmarks/cache_attention.py [--threads T] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from mtrain.cpu import mkl  # noqa: E402

if __name__ == "__main__":
    mkl.enable()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ab import best_seconds  # noqa: E402

from mtrain.cpu import native  # noqa: E402
from mtrain.hardware import machine_record  # noqa: E402

ROWS, HEADS, QUERIES, D_HEAD, BUFFER = 315, 4, 5, 64, 1280
CASES = [("source", 13), ("source", 30), ("ancestry", 10), ("ancestry", 60), ("ancestry", 150)]


def best_ms(run, calls: int = 200, rounds: int = 3) -> float:
    return best_seconds(run, calls, rounds) * 1e3


def case(kind: str, n: int, gen: torch.Generator) -> dict:
    q = torch.randn(ROWS, QUERIES, HEADS, D_HEAD, generator=gen).bfloat16().transpose(1, 2)
    capacity = n if kind == "source" else BUFFER
    k, v = (torch.randn(ROWS, HEADS, capacity, D_HEAD, generator=gen).bfloat16()[:, :, :n] for _ in range(2))
    if kind == "source":
        mask = torch.ones(ROWS, 1, 1, n, dtype=torch.bool)
    else:
        mask = torch.rand(ROWS, 1, QUERIES, n, generator=gen) < 0.4
        mask[..., 0] = True  # every beam sees its first slot
    k32, v32, q32 = k.float(), v.float(), q.float()
    torch_ms = best_ms(lambda: F.scaled_dot_product_attention(q32, k32, v32, attn_mask=mask).bfloat16())
    c_ms = best_ms(lambda: native.attend(q, k, v, mask))
    return {"over": f"{n} {kind} {'keys' if kind == 'source' else 'slots'}", "torch_float32_ms": round(torch_ms, 3),
            "c_bfloat16_ms": round(c_ms, 3), "speedup": round(torch_ms / c_ms, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch's default)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if native.library() is None:
        sys.exit(f"mtrain.cpu.native: {native.status}")
    gen = torch.Generator().manual_seed(0)
    table = sys.stderr if args.json else sys.stdout
    rows = []
    for kind, n in CASES:
        rows.append(case(kind, n, gen))
        row = rows[-1]
        print(f"{row['over']:<20} PyTorch float32 {row['torch_float32_ms']:6.2f} ms   C bfloat16 "
              f"{row['c_bfloat16_ms']:6.2f} ms   {row['speedup']:.2f}x", file=table, flush=True)
    if args.json:
        print(json.dumps({"cases": rows, "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "hardware": machine_record()}))


if __name__ == "__main__":
    main()
