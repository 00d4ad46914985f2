"""Throughput and latency of `mtrain serve` under concurrent clients, against `mtrain translate`'s
batch throughput on the same lines, in one run on one machine.

    python benchmarks/serve.py --checkpoint runs/quickstart/averaged.pt \\
        --lines data/multi30k-tok/test2016.src.txt [--n 400] [--clients 1,8,32] [--beam 5] [--json]

Baseline: the lines translated as one file, in this process (the model loaded and warmed up first,
so only decoding is timed), with the server's thread count. Then the server runs in its own process
(`mtrain serve`, same checkpoint and options), and for each client count C, C threads each send one
line per request, one request at a time, until every line is answered. Reported per row: lines per
second, the ratio to the baseline, latency p50 and p99 of a request, and how many answers differ
from the baseline's translation of the line (0 expected: a line's translation does not depend on
its batch beyond float rounding). The client threads share the machine with the server: on a
2-core CPU they take a little of its time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch

from mtrain.config import DecodeConfig
from mtrain.translate import load_for_decoding, translate_nbest


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def baseline(checkpoint: Path, lines: list[str], decode: DecodeConfig) -> tuple[list[str], float]:
    """(translations, seconds) of the lines as one file, after a warm-up batch."""
    model, tokenizer, ckpt = load_for_decoding([checkpoint], torch.device("cpu"), decode)
    stats = ckpt.get("stats")
    translate_nbest(model, tokenizer, lines[:16], decode, "cpu", stats)
    start = time.perf_counter()
    results, _ = translate_nbest(model, tokenizer, lines, decode, "cpu", stats)
    return [hyps[0][0] for hyps in results], time.perf_counter() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(checkpoint: Path, beam: int, wait_ms: float):
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "mtrain.cli", "serve", "--checkpoint", str(checkpoint),
                                "--port", str(port), "--device", "cpu", "--beam", str(beam),
                                "--batch-wait-ms", str(wait_ms), "--max-queue-lines", "1000000"])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            if process.poll() is not None:
                raise SystemExit("the server did not start")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=120)


def load(url: str, lines: list[str], clients: int) -> tuple[list[str], list[float], float]:
    """(answers in line order, per-request latencies, wall seconds) with `clients` threads."""
    answers: list[str | None] = [None] * len(lines)
    latencies: list[float] = []
    next_line = iter(range(len(lines)))
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            while True:
                with lock:
                    i = next(next_line, None)
                if i is None:
                    return
                start = time.perf_counter()
                reply = http.post("/translate", json={"text": [lines[i]]})
                reply.raise_for_status()
                answers[i] = reply.json()["translations"][0]
                with lock:
                    latencies.append(time.perf_counter() - start)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers, latencies, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--lines", type=Path, required=True, help="raw source text, one sentence a line")
    parser.add_argument("--n", type=int, default=400, help="lines sent at each client count")
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--batch-wait-ms", type=float, default=5.0)
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON object")
    args = parser.parse_args()
    lines = [line for line in args.lines.read_text(encoding="utf-8").splitlines() if line.strip()][: args.n]
    decode = DecodeConfig(beam=args.beam)
    want, seconds = baseline(args.checkpoint, lines, decode)
    rows = [{"setting": "translate (one file)", "lines_per_s": len(lines) / seconds, "ratio": 1.0}]
    with server(args.checkpoint, args.beam, args.batch_wait_ms) as url:
        load(url, lines[:16], 4)  # warm-up
        for clients in map(int, args.clients.split(",")):
            answers, latencies, wall = load(url, lines, clients)
            rows.append({"setting": f"serve, {clients} client{'s' if clients > 1 else ''}",
                         "lines_per_s": len(lines) / wall, "ratio": seconds / wall,
                         "p50_ms": 1000 * percentile(latencies, 50), "p99_ms": 1000 * percentile(latencies, 99),
                         "differ": sum(a != b for a, b in zip(answers, want))})
    machine = f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    if args.json:
        print(json.dumps({"machine": machine, "lines": len(lines), "beam": args.beam, "rows": rows}))
        return
    print(f"{len(lines)} lines, beam {args.beam}, {machine}")
    print("| setting | lines/s | vs translate | p50 ms | p99 ms | lines differing from translate |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        extra = (f"{row['p50_ms']:.0f} | {row['p99_ms']:.0f} | {row['differ']}" if "p50_ms" in row else "| |")
        print(f"| {row['setting']} | {row['lines_per_s']:.1f} | {row['ratio']:.2f}x | {extra} |")


if __name__ == "__main__":
    main()
