"""A bfloat16 decoding copy's linear layers alone: oneDNN's kernel on its packed weight (what
mtrain.cpu.quantize.OneDNNLinear runs without the tiles) against mtrain.cpu.native.amx_linear on
the AMX tiles, in one process, each timed as the best of three rounds, with the share of output
values the two give equal.

The layers of benchmarks/decode.py's model (d_model 256, d_ff 1024, vocabulary 8000; the fused
Q/K/V projection, an attention output, the FFN's two layers, the output projection; every one with
a bias but the last) at the row counts a decoding step sees: one sentence, the benchmark's
batches of greedy search (60 to 315 sentences), beam 5's (300 to 1575 rows), and an encoder
batch (4096 tokens).

    python benchmarks/amx_linear.py [--threads T] [--json]
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

from ab import best_seconds  # noqa: E402

from mtrain.cpu import native  # noqa: E402
from mtrain.hardware import machine_record  # noqa: E402

LAYERS = [("Q/K/V", 256, 768, True), ("attention out", 256, 256, True), ("FFN 1 + ReLU", 256, 1024, True),
          ("FFN 2", 1024, 256, True), ("projection", 256, 8000, False)]
ROWS = [1, 64, 315, 1024, 1575, 4096]


def best_us(run) -> float:
    return best_seconds(run, calls=100, warm=5) * 1e6


def case(name: str, K: int, N: int, bias: bool, M: int, gen: torch.Generator) -> dict:
    x = torch.randn(M, K, generator=gen).bfloat16()
    w = torch.randn(N, K, generator=gen).bfloat16()
    b = torch.randn(N, generator=gen).bfloat16() if bias else None
    relu = name.endswith("ReLU")
    onednn_weight, tiles = torch.ops.mkldnn._reorder_linear_weight(w, None), native.amx_pack(w)
    activation = "relu" if relu else "none"
    with torch.inference_mode():
        onednn = torch.ops.mkldnn._linear_pointwise(x, onednn_weight, b, activation, [], "")
        amx = native.amx_linear(x, tiles, b, relu, N)
        onednn_us = best_us(lambda: torch.ops.mkldnn._linear_pointwise(x, onednn_weight, b, activation, [], ""))
        amx_us = best_us(lambda: native.amx_linear(x, tiles, b, relu, N))
    return {"layer": name, "rows": M, "in": K, "out": N, "onednn_us": round(onednn_us, 1), "amx_us": round(amx_us, 1),
            "speedup": round(onednn_us / amx_us, 2), "equal_values": round((onednn == amx).float().mean().item(), 5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch's default)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not native.amx_ready():
        sys.exit(f"no AMX tiles to compare on this machine (mtrain.cpu.native: {native.status})")
    gen = torch.Generator().manual_seed(0)
    table = sys.stderr if args.json else sys.stdout
    rows = []
    for name, K, N, bias in LAYERS:
        for M in ROWS:
            rows.append(case(name, K, N, bias, M, gen))
            row = rows[-1]
            print(f"{name:<14} {M:>5} x {K:>4} -> {N:<5} oneDNN {row['onednn_us']:8.1f} us   tiles "
                  f"{row['amx_us']:8.1f} us   {row['speedup']:.2f}x   equal {row['equal_values']:.4f}",
                  file=table, flush=True)
    if args.json:
        print(json.dumps({"cases": rows, "threads": torch.get_num_threads(), "max_rows": native.AMX_MAX_ROWS,
                          "torch": torch.__version__, "hardware": machine_record()}))


if __name__ == "__main__":
    main()
