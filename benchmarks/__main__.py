"""Run every benchmark (training step, decoding, end to end), write benchmarks/results/<name>.json
and print one readable table.

    python -m benchmarks [--quick] [--only train_step,decode] [--main-job] [--smoke]

--quick: the scripts' own quick modes (under 10 minutes in all on 2 cores). --smoke: the smallest
sizes that still run every code path (a check of this runner, not a measurement).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"

# name -> (script, extra args for --quick, extra args for --smoke)
BENCHMARKS: dict[str, tuple[str, list[str], list[str]]] = {
    "train_step": ("train_step.py", ["--quick"], ["--quick", "--batches", "1", "--no-hf"]),
    "decode": ("decode.py", ["--quick"], ["--sentences", "16", "--skip-hf"]),
    "e2e": ("e2e.py", ["--quick"], []),
}

# The headline numbers of each benchmark for the table: key -> label.
HEADLINES: dict[str, dict[str, str]] = {
    "train_step": {
        "mtrain_tok_s": "mtrain training, target tok/s",
        "nn_transformer_tok_s": "nn.Transformer, target tok/s",
        "hf_marian_tok_s": "HF Marian, target tok/s",
        "speedup_vs_nn_transformer": "mtrain / nn.Transformer",
        "mtrain_gflops": "mtrain GFLOP/s",
        "matmul_peak_gflops": "fp32 matmul peak GFLOP/s",
        "mtrain_peak_fraction": "mtrain fraction of peak",
    },
    "decode": {
        "mtrain_greedy_sent_s": "mtrain greedy, sent/s",
        "mtrain_beam5_sent_s": "mtrain beam 5, sent/s",
        "hf_beam5_sent_s": "HF Marian beam 5, sent/s",
        "ct2_beam5_sent_s": "CTranslate2 beam 5, sent/s",
        "mtrain_beam5_vs_hf_beam5": "mtrain / HF (beam 5)",
        "mtrain_beam5_vs_ct2_beam5": "mtrain / CTranslate2 (beam 5)",
        "mtrain_beam5_vs_ct2_int8_beam5": "mtrain / CTranslate2 int8 (beam 5)",
        "mtrain_greedy_vs_hf_greedy": "mtrain / HF (greedy)",
        "mtrain_int8_beam5_vs_ct2_int8_beam5": "mtrain int8 / CTranslate2 int8 (beam 5)",
        "mtrain_int8_greedy_vs_hf_greedy": "mtrain int8 / HF (greedy)",
    },
    "e2e": {
        "tokenize_wall_s": "mtrain tokenize Multi30k, s",
        "main_job_wall_s": "README main job (quickstart.sh), s",
    },
}


def last_json_object(stdout: str) -> dict[str, Any] | None:
    """The benchmark's result: the last stdout line that is a JSON object."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def run_one(name: str, args: list[str], timeout: float) -> dict[str, Any]:
    """Run benchmarks/<script> --json; its table (stderr) streams through to ours."""
    script = BENCHMARKS[name][0]
    command = [sys.executable, str(HERE / script), *args, "--json"]
    print(f"\n== {name}: {' '.join([Path(command[0]).name, *command[1:]])}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    record: dict[str, Any] = {"name": name, "command": " ".join(["python", f"benchmarks/{script}", *args, "--json"])}
    try:
        proc = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True, timeout=timeout)
        record["returncode"] = proc.returncode
        record["result"] = last_json_object(proc.stdout)
        if proc.returncode != 0 or record["result"] is None:
            record["error"] = f"exit status {proc.returncode}" + ("" if record["result"] else ", no JSON on stdout")
    except subprocess.TimeoutExpired:
        record.update(returncode=None, result=None, error=f"timed out after {timeout:.0f} s")
    record["wall_s"] = round(time.perf_counter() - start, 1)
    return record


def environment() -> dict[str, Any]:
    import torch

    from mtrain.hardware import machine_record

    info: dict[str, Any] = {**machine_record(), "threads": torch.get_num_threads()}
    try:
        info["load_avg_1min"] = round(os.getloadavg()[0], 2)  # other processes skew the numbers
    except OSError:
        pass
    return info


def save(record: dict[str, Any], folder: Path = RESULTS) -> Path:
    from mtrain.atomic import atomic_write

    path = folder / f"{record['name']}.json"
    with atomic_write(path) as handle:
        handle.write(json.dumps(record, indent=2) + "\n")
    return path


def format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:,.1f}"
    return "-" if value is None else str(value)


def table(records: list[dict[str, Any]]) -> str:
    """benchmark | metric | value, headline numbers only (the JSON files hold everything)."""
    lines = [f"{'benchmark':<12} {'metric':<38} {'value':>12}", "-" * 64]
    for record in records:
        result = record.get("result") or {}
        if record.get("error"):
            lines.append(f"{record['name']:<12} {'FAILED: ' + record['error']:<38}")
            continue
        for key, label in HEADLINES.get(record["name"], {}).items():
            if result.get(key) is not None:
                lines.append(f"{record['name']:<12} {label:<38} {format_value(result[key]):>12}")
        lines.append(f"{record['name']:<12} {'(benchmark wall time, s)':<38} {format_value(record['wall_s']):>12}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="quick modes (under 10 minutes in all)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the runner, measures nothing")
    parser.add_argument("--only", default=",".join(BENCHMARKS), help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    parser.add_argument("--main-job", action="store_true", help="e2e also times scripts/quickstart.sh (about 5 min on 2 cores)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads for train_step and decode (0 = default)")
    parser.add_argument("--timeout", type=float, default=0, help="seconds per benchmark (default 900, 480 with --quick/--smoke)")
    parser.add_argument("--out", type=Path, help="folder for <name>.json (default benchmarks/results; a temp folder with --smoke)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    timeout = args.timeout or (480 if args.quick or args.smoke else 900) + (1800 if args.main_job else 0)
    out = args.out or (Path(tempfile.gettempdir()) / "mtrain-bench-smoke" if args.smoke else RESULTS)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    records = []
    for name in names:
        _, quick, smoke = BENCHMARKS[name]
        extra = smoke if args.smoke else quick if args.quick else []
        if args.threads and name != "e2e":
            extra = [*extra, "--threads", str(args.threads)]
        if args.main_job and name == "e2e":
            extra = [*extra, "--main-job"]
        before = environment()  # the load average before the run: others' processes skew the numbers
        record = run_one(name, extra, timeout)
        record.update(mode="smoke" if args.smoke else "quick" if args.quick else "full", started=started,
                      environment=before, load_avg_1min_after=environment().get("load_avg_1min"))
        path = save(record, out)
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}", file=sys.stderr)
        records.append(record)
    print(table(records))
    return 1 if any(r.get("error") for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
