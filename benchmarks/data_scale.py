"""Corpus scale: `mtrain tokenize` and training start-up on synthetic corpora of millions of pairs.

Each synthetic pair joins two random Multi30k training pairs (source to source, target to
target), so the corpus keeps Multi30k's vocabulary with WMT-like lengths (~26 words a side); the
draw is seeded. The evaluation splits are Multi30k's valid and test2016. Per size it measures:

- tokenize wall time and peak RSS (the process's maximum resident set, from wait4), with the
  time of each phase (cleaning, SentencePiece, encoding) from tokenize's last line;
- training start-up: `mtrain train` (configs/quickstart.yaml's model) from the command to its
  first update, which logs a metrics line; the training process's peak RSS (VmHWM) and anonymous
  resident memory (RssAnon: without pages of the memory-mapped ids, which the kernel can drop) then.

A table goes to stderr; `--json` prints one JSON object; `--out FILE` writes it with the command,
the CPU and the load average. `--sample-sizes` also tokenizes the smallest corpus once per
tokenizer.input_sentence_size given, and `--bleu-samples` runs the README main job on Multi30k
once per sample size, to show what the SentencePiece sample costs and what it saves.

    python benchmarks/data_scale.py [--quick] [--sizes 1000000,3000000,5000000] [--json] [--out FILE]
    python benchmarks/data_scale.py --sizes 0 --bleu-samples 10000,30000,0
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CORPORA = [ROOT / "data" / "multi30k", ROOT.parent / "shared" / "corpora" / "multi30k"]
FULL_SIZES = (1_000_000, 3_000_000, 5_000_000)
QUICK_SIZES = (200_000, 600_000)
WRITE_PAIRS = 100_000  # synthetic pairs generated and written per step


def multi30k() -> Path:
    for path in CORPORA:
        if (path / "train.de").is_file():
            return path
    sys.exit("no local Multi30k copy (data/multi30k or ../shared/corpora/multi30k)")


def make_corpus(source: Path, pairs: int, out: Path, seed: int = 0) -> Path:
    """out/train.{de,en}: `pairs` pairs, each two random Multi30k training pairs joined; the
    Multi30k valid and test2016 splits beside them."""
    out.mkdir(parents=True, exist_ok=True)
    src = np.array((source / "train.de").read_text(encoding="utf-8").split("\n")[:-1], dtype=object)
    tgt = np.array((source / "train.en").read_text(encoding="utf-8").split("\n")[:-1], dtype=object)
    rng = np.random.default_rng(seed)
    with open(out / "train.de", "w", encoding="utf-8") as src_out, open(out / "train.en", "w", encoding="utf-8") as tgt_out:
        for start in range(0, pairs, WRITE_PAIRS):
            first, second = (rng.integers(0, src.size, min(WRITE_PAIRS, pairs - start)) for _ in range(2))
            src_out.write("".join(f"{a} {b}\n" for a, b in zip(src[first], src[second])))
            tgt_out.write("".join(f"{a} {b}\n" for a, b in zip(tgt[first], tgt[second])))
    for split in ("valid", "test2016"):
        for lang in ("de", "en"):
            shutil.copy(source / f"{split}.{lang}", out / f"{split}.{lang}")
    return out


def run_measured(command: list[str], log: Path) -> tuple[float, float, float, int]:
    """(wall seconds, CPU seconds, peak RSS in MB, exit code) of a command; its output goes to `log`.
    CPU seconds (user + system, its worker processes included) depend less on other load than wall
    time does, though in a virtual machine a busy host inflates them too."""
    start = time.perf_counter()
    before = os.times()
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    after = os.times()  # children's times include the command's own children once they are reaped
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return seconds, cpu, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status)


PHASES = re.compile(r"\(cleaning ([\d.]+)s, SentencePiece ([\d.]+)s, encoding ([\d.]+)s\)")


def bench_tokenize(corpus: Path, out: Path, log: Path, extra: list[str] = ()) -> dict[str, Any]:
    command = [sys.executable, "-m", "mtrain", "tokenize", "--data", str(corpus), "--out", str(out), *extra]
    seconds, cpu, rss_mb, code = run_measured(command, log)
    text = log.read_text(encoding="utf-8", errors="replace")
    if code != 0:
        sys.exit(f"tokenize failed (exit {code}); see {log}:\n{text[-2000:]}")
    phases = PHASES.search(text)
    stats = json.loads((out / "stats.json").read_text(encoding="utf-8"))
    result = {"tokenize_wall_s": round(seconds, 1), "tokenize_cpu_s": round(cpu, 1), "tokenize_peak_rss_mb": round(rss_mb),
              "kept_pairs": stats["cleaning"]["kept_pairs"], "sample_pairs": stats["tokenizer_sample"]["pairs"]}
    if phases:
        result.update(zip(("cleaning_s", "sentencepiece_s", "encoding_s"), map(float, phases.groups())))
    return result


def bench_bleu(source: Path, sample: int, work: Path, threads: int = 0) -> dict[str, Any]:
    """The README main job (configs/quickstart.yaml: tokenize, train 800 updates, translate
    test2016 with averaged.pt, eval) with tokenizer.input_sentence_size=sample: what a smaller
    SentencePiece sample costs in BLEU."""
    tok, run = work / f"bleu-tok-{sample}", work / f"bleu-run-{sample}"
    mtrain = [sys.executable, "-m", "mtrain"]
    steps = [
        [*mtrain, "tokenize", "--config", "configs/quickstart.yaml", "--data", str(source), "--out", str(tok),
         "--set", f"tokenizer.input_sentence_size={sample}"],
        [*mtrain, "train", "--config", "configs/quickstart.yaml", "--data", str(tok), "--out", str(run), "--device", "cpu",
         "--set", f"train.num_threads={threads}"],
        [*mtrain, "translate", "--checkpoint", str(run / "averaged.pt"), "--input", str(tok / "test2016.src.txt"),
         "--output", str(run / "test2016.hyp"), "--device", "cpu"],
    ]
    start = time.perf_counter()
    for i, command in enumerate(steps):
        seconds, _, _, code = run_measured(command, work / f"bleu-{sample}-{i}.log")
        if code != 0:
            sys.exit(f"{' '.join(command[2:4])} failed (exit {code}); see {work / f'bleu-{sample}-{i}.log'}")
    score = subprocess.run([*mtrain, "eval", "--hyp", str(run / "test2016.hyp"), "--ref", str(tok / "test2016.tgt.txt"),
                            "--json"], cwd=ROOT, capture_output=True, text=True, check=True)
    stats = json.loads((tok / "stats.json").read_text(encoding="utf-8"))
    return {"sample_pairs": stats["tokenizer_sample"]["pairs"], "of_pairs": stats["tokenizer_sample"]["of_pairs"],
            "test2016_bleu": json.loads(score.stdout)["bleu"], "wall_s": round(time.perf_counter() - start, 1)}


def proc_status(pid: int) -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon and RssFile of a process, in kB."""
    fields = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0])
    return fields


def bench_startup(tok: Path, run: Path, log: Path, timeout: float = 600.0) -> dict[str, Any]:
    """Seconds from `mtrain train` to its first update (its first metrics line), and its memory then."""
    command = [sys.executable, "-m", "mtrain", "train", "--config", "configs/quickstart.yaml", "--data", str(tok),
               "--out", str(run), "--device", "cpu", "--set", "train.log_every=1", "--set", "train.max_steps=50"]
    metrics = run / "metrics.jsonl"
    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            while True:
                if proc.poll() is not None:
                    sys.exit(f"training ended before its first update (exit {proc.returncode}); see {log}")
                if metrics.is_file() and '"event": "train"' in metrics.read_text(encoding="utf-8"):
                    seconds = time.perf_counter() - start
                    memory = proc_status(proc.pid)
                    break
                if time.perf_counter() - start > timeout:
                    sys.exit(f"no update within {timeout:.0f} s; see {log}")
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
    return {"startup_s": round(seconds, 1), "train_peak_rss_mb": round(memory["VmHWM"] / 1024),
            "train_rss_anon_mb": round(memory["RssAnon"] / 1024), "train_rss_file_mb": round(memory["RssFile"] / 1024)}


def machine() -> dict[str, Any]:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu": model, "cpu_count": os.cpu_count(), "python": platform.python_version()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES} instead of {FULL_SIZES}")
    parser.add_argument("--sizes", help="comma-separated pair counts (overrides --quick)")
    parser.add_argument("--sample-sizes", default="", help="also tokenize the smallest corpus with each of these "
                        "tokenizer.input_sentence_size values (comma-separated)")
    parser.add_argument("--bleu-samples", default="", help="run the README main job on Multi30k once per "
                        "tokenizer.input_sentence_size given (comma-separated; 0 = every sentence) and report test2016 BLEU")
    parser.add_argument("--bleu-threads", type=int, default=0, help="train.num_threads of those runs (0: torch's "
                        "default; 1 is faster on a busy machine)")
    parser.add_argument("--no-train", action="store_true", help="skip the training start-up")
    parser.add_argument("--work", type=Path, help="folder for the corpora and caches (default: a temp folder)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--out", type=Path, help="also write the JSON, with the command and machine, to this file")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else list(QUICK_SIZES if args.quick else FULL_SIZES)
    sizes = [] if args.sizes == "0" else sizes  # --sizes 0: only the sample-size runs
    source = multi30k()
    result: dict[str, Any] = {"machine": machine(), "load_before": list(os.getloadavg()), "sizes": {}, "samples": {},
                              "bleu": {}}
    started = time.perf_counter()
    work = args.work or Path(tempfile.mkdtemp(prefix="mtrain-data-scale-"))
    try:
        for pairs in sizes:
            corpus = make_corpus(source, pairs, work / f"corpus-{pairs}")
            row = bench_tokenize(corpus, work / f"tok-{pairs}", work / f"tokenize-{pairs}.log")
            if not args.no_train:
                row.update(bench_startup(work / f"tok-{pairs}", work / f"run-{pairs}", work / f"train-{pairs}.log"))
            row["load_after"] = round(os.getloadavg()[0], 2)
            result["sizes"][pairs] = row
            print(f"{pairs} pairs: {json.dumps(row)}", file=sys.stderr, flush=True)
            if pairs != min(sizes) or not args.sample_sizes:
                shutil.rmtree(corpus)
            shutil.rmtree(work / f"tok-{pairs}")
            shutil.rmtree(work / f"run-{pairs}", ignore_errors=True)
        for sample in filter(None, args.sample_sizes.split(",")):
            smallest = min(sizes)
            out = work / f"tok-{smallest}-sample-{sample}"
            row = bench_tokenize(work / f"corpus-{smallest}", out, work / f"tokenize-sample-{sample}.log",
                                 ["--set", f"tokenizer.input_sentence_size={int(sample)}"])
            result["samples"][int(sample)] = {"pairs": smallest, **row}
            print(f"sample {sample} sentences: {json.dumps(row)}", file=sys.stderr, flush=True)
            shutil.rmtree(out)
        for sample in filter(None, args.bleu_samples.split(",")):
            row = bench_bleu(source, int(sample), work, args.bleu_threads)
            result["bleu"][int(sample)] = row
            print(f"main job, sample {sample} sentences: {json.dumps(row)}", file=sys.stderr, flush=True)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    result["load_after"] = list(os.getloadavg())
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print_table(result)
    if args.out:
        record = {"command": " ".join(["python", "benchmarks/data_scale.py", *(argv if argv is not None else sys.argv[1:])]),
                  "date": datetime.date.today().isoformat(), "result": result}
        args.out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    if args.json:
        print(json.dumps(result))
    return result


def print_table(result: dict[str, Any]) -> None:
    columns = ("tokenize_wall_s", "tokenize_cpu_s", "tokenize_peak_rss_mb", "cleaning_s", "sentencepiece_s", "encoding_s",
               "startup_s", "train_peak_rss_mb", "train_rss_anon_mb")
    print(f"{'pairs':>10} " + " ".join(f"{c:>20}" for c in columns), file=sys.stderr)
    for pairs, row in result["sizes"].items():
        print(f"{pairs:>10} " + " ".join(f"{row.get(c, '-'):>20}" for c in columns), file=sys.stderr)
    for sample, row in result["bleu"].items():
        print(f"main job with a sample of {sample or 'every'} sentences ({row['sample_pairs']} of {row['of_pairs']} "
              f"pairs): test2016 BLEU {row['test2016_bleu']}", file=sys.stderr)
    for sample, row in result["samples"].items():
        print(f"sample {sample}: tokenize {row['tokenize_wall_s']} s, peak {row['tokenize_peak_rss_mb']} MB, "
              f"SentencePiece {row.get('sentencepiece_s')} s", file=sys.stderr)


if __name__ == "__main__":
    main()
