"""`mtrain translate` in one process against several side by side (--workers N), end to end: each
run is a fresh `mtrain translate` process (start-up, model loading and the workers' start included)
on the same input, the two settings taken in turn round after round, so that load from elsewhere on
a shared machine falls on both alike. Reports lines/s and whether the outputs are identical.

    python benchmarks/translate_workers.py --checkpoint RUN/averaged.pt [--workers 2] [--repeat 8]
        [--rounds 2] [--set decode.amp=bf16] [--json]

The input is Multi30k test2016's source side (the checkpoint's source language), repeated --repeat
times; greedy search and beam 5."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CORPUS = [ROOT / "data" / "multi30k", ROOT.parent / "shared" / "corpora" / "multi30k"]


def source_file(checkpoint: Path) -> Path:
    """test2016 in the checkpoint's source language (its tokenizer's `src` side)."""
    import torch

    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True)
    lang = ckpt["config"]["data"]["src"]
    for folder in CORPUS:
        if (folder / f"test2016.{lang}").is_file():
            return folder / f"test2016.{lang}"
    raise SystemExit(f"no Multi30k test2016.{lang} in {', '.join(map(str, CORPUS))}")


def translate(checkpoint: Path, src: Path, out: Path, workers: int, beam: int, overrides: list[str]) -> float:
    """Seconds of one `mtrain translate` process."""
    command = [sys.executable, "-m", "mtrain", "translate", "--checkpoint", str(checkpoint), "-i", str(src),
               "-o", str(out), "--workers", str(workers), "--beam", str(beam)]
    for setting in overrides:
        command += ["--set", setting]
    start = time.perf_counter()
    subprocess.run(command, check=True, stderr=subprocess.DEVNULL, cwd=ROOT)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=8, help="copies of test2016 in the input")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="a decode.* setting for both")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from mtrain.hardware import machine_record

    lines = source_file(args.checkpoint).read_text(encoding="utf-8").splitlines() * args.repeat
    result = {"checkpoint": str(args.checkpoint), "lines": len(lines), "workers": args.workers, "rounds": args.rounds,
              "overrides": args.overrides, "hardware": machine_record(), "searches": {}}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "input.txt"
        src.write_text("\n".join(lines) + "\n", encoding="utf-8")
        for beam in (1, 5):
            settings = (1, args.workers)
            seconds: dict[int, list[float]] = {w: [] for w in settings}
            for r in range(args.rounds):
                for w in settings if r % 2 == 0 else settings[::-1]:
                    seconds[w].append(translate(args.checkpoint, src, Path(tmp) / f"out{w}.txt", w, beam, args.overrides))
            same = (Path(tmp) / "out1.txt").read_bytes() == (Path(tmp) / f"out{args.workers}.txt").read_bytes()
            rate = {w: round(len(lines) / statistics.median(s), 1) for w, s in seconds.items()}
            name = "greedy" if beam == 1 else f"beam {beam}"
            result["searches"][name] = {"seconds": seconds, "lines_s": rate,
                                        "speedup": round(rate[args.workers] / rate[1], 3), "identical_output": same}
            print(f"{name}: {len(lines)} lines, 1 process {rate[1]} lines/s, {args.workers} workers "
                  f"{rate[args.workers]} lines/s ({rate[args.workers] / rate[1]:.2f}x); identical output: {same}",
                  file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
