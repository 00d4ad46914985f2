"""Throughput and latency of `mtrain serve` under concurrent clients, against `mtrain translate`'s
batch throughput on the same lines, in one run on one machine.

    python benchmarks/serve.py --checkpoint runs/quickstart/averaged.pt \\
        --lines data/multi30k-tok/test2016.src.txt [--n 400] [--clients 1,8,32] [--beam 5] [--json]

Baseline: the lines translated as one file, in this process (the model loaded and warmed up first,
so only decoding is timed), with the server's thread count. Then the server runs in its own process
(`mtrain serve`, same checkpoint and options), and for each client count C, C threads each send one
line per request, one request at a time, until every line is answered. Reported per row: lines per
second, the ratio to the baseline, the ratio to translate handed the lines in pieces of as many as
the clients keep in flight (the largest batches they allow), latency p50 and p99 of a request, the
cores the server and the clients kept busy, and how many answers differ from the baseline's
translation of the line (0 expected: a line's translation does not depend on its batch beyond float
rounding). Each client count runs with one line a request, and again with --per-request lines. The
clients share the machine with the server: on a small CPU their HTTP work takes cores from it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
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


def baseline(checkpoint: Path, lines: list[str], decode: DecodeConfig,
             chunks: list[int]) -> tuple[list[str], float, dict[int, float]]:
    """(translations, seconds) of the lines as one file, after a warm-up batch, and the seconds
    they take in pieces of C lines for each C of `chunks` (the batches C clients can fill)."""
    model, tokenizer, ckpt = load_for_decoding([checkpoint], torch.device("cpu"), decode)
    stats = ckpt.get("stats")
    translate_nbest(model, tokenizer, lines[:16], decode, "cpu", stats)
    start = time.perf_counter()
    results, _ = translate_nbest(model, tokenizer, lines, decode, "cpu", stats)
    whole = time.perf_counter() - start
    pieces = {}
    for size in chunks:
        start = time.perf_counter()
        for first in range(0, len(lines), size):
            translate_nbest(model, tokenizer, lines[first : first + size], decode, "cpu", stats)
        pieces[size] = time.perf_counter() - start
    return [hyps[0][0] for hyps in results], whole, pieces


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
        yield url, process.pid
    finally:
        process.terminate()
        process.wait(timeout=120)


def load(url: str, lines: list[str], clients: int, per_request: int = 1) -> tuple[list[str], list[float], float]:
    """(answers in line order, per-request latencies, wall seconds) with `clients` threads, each
    sending `per_request` lines a request."""
    answers: list[str | None] = [None] * len(lines)
    latencies: list[float] = []
    next_line = iter(range(0, len(lines), per_request))
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            while True:
                with lock:
                    first = next(next_line, None)
                if first is None:
                    return
                start = time.perf_counter()
                reply = http.post("/translate", json={"text": lines[first : first + per_request]})
                reply.raise_for_status()
                answers[first : first + per_request] = reply.json()["translations"]
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
    parser.add_argument("--per-request", type=int, default=8,
                        help="also run each client count with this many lines a request (1: not)")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON object")
    args = parser.parse_args()
    lines = [line for line in args.lines.read_text(encoding="utf-8").splitlines() if line.strip()][: args.n]
    decode = DecodeConfig(beam=args.beam)
    counts = list(map(int, args.clients.split(",")))
    sizes = sorted(set(counts) | {c * args.per_request for c in counts if args.per_request > 1})
    want, seconds, pieces = baseline(args.checkpoint, lines, decode, sizes)
    rows = [{"setting": "translate (one file)", "lines_per_s": len(lines) / seconds, "ratio": 1.0}]
    rows += [{"setting": f"translate in pieces of {size} line{'s' if size > 1 else ''}",
              "lines_per_s": len(lines) / piece, "ratio": seconds / piece} for size, piece in pieces.items()]
    with server(args.checkpoint, args.beam, args.batch_wait_ms) as (url, pid):
        load(url, lines[:16], 4)  # warm-up
        for clients, per_request in [(c, 1) for c in counts] + [(c, args.per_request) for c in counts if args.per_request > 1]:
            server_cpu, client_cpu = cpu_seconds(pid), cpu_seconds(os.getpid())
            answers, latencies, wall = load(url, lines, clients, per_request)
            server_cpu, client_cpu = cpu_seconds(pid) - server_cpu, cpu_seconds(os.getpid()) - client_cpu
            rows.append({"setting": f"serve, {clients} client{'s' if clients > 1 else ''}"
                                    + (f" x {per_request} lines" if per_request > 1 else ""),
                         "lines_per_s": len(lines) / wall, "ratio": seconds / wall,
                         "vs_pieces": pieces.get(clients * per_request, float("nan")) / wall,
                         "server_cores": server_cpu / wall, "client_cores": client_cpu / wall,
                         "p50_ms": 1000 * percentile(latencies, 50), "p99_ms": 1000 * percentile(latencies, 99),
                         "differ": sum(a != b for a, b in zip(answers, want))})
    machine = f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    if args.json:
        print(json.dumps({"machine": machine, "lines": len(lines), "beam": args.beam, "rows": rows}))
        return
    print(f"{len(lines)} lines, beam {args.beam}, {machine}")
    print("| setting | lines/s | vs translate (one file) | vs translate in pieces of the lines in flight | "
          "p50 ms | p99 ms | cores: server, clients | lines differing from translate |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        extra = (f"{row['vs_pieces']:.2f}x | {row['p50_ms']:.0f} | {row['p99_ms']:.0f} | "
                 f"{row['server_cores']:.2f}, {row['client_cores']:.2f} | {row['differ']}"
                 if "p50_ms" in row else " | | | |")
        print(f"| {row['setting']} | {row['lines_per_s']:.1f} | {row['ratio']:.2f}x | {extra} |")


if __name__ == "__main__":
    main()
