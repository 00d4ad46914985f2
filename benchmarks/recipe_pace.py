"""Wall time per update of the de->en recipe, an older checkout against this one, back to back.

Each round runs `mtrain train` on configs/multi30k-de-en.yaml for --steps updates from scratch, once
with the code of --old (its own defaults: before bfloat16 became the default, float32) and once with
this checkout (its defaults), alternating, so load from other processes falls on both alike. The
recipe validates every 250 updates, so a run of a multiple of 250 updates pays for validation in
the same proportion as the full 5500-update recipe. Each checkout tokenizes Multi30k itself, so a
change of the tokenized format cannot favour either.

    python benchmarks/recipe_pace.py --old REV [--steps 500] [--rounds 2] [--threads 2] [--json]

Prints, per checkout, seconds per update (the median over rounds) and the 5500-update wall time it
implies, and the ratio new / old. Runs from a git checkout (the older code comes from `git archive`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mtrain.hardware import machine_record  # noqa: E402

CONFIG = "configs/multi30k-de-en.yaml"
RECIPE_STEPS = 5500  # the recipe's max_steps
CORPORA = [ROOT / "data" / "multi30k", ROOT.parent / "shared" / "corpora" / "multi30k"]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def export_revision(rev: str, into: Path) -> Path:
    """The tree of `rev`, unpacked into `into` (no worktree, so the repository is left as it is)."""
    archive = into / "old.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "-C", str(ROOT), "archive", rev], stdout=out, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "old", filter="data")
    return into / "old"


def mtrain(checkout: Path, args: list[str], threads: int) -> float:
    """Wall seconds of `python -m mtrain ARGS` with `checkout`'s code; a failure raises."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "mtrain", *args], cwd=checkout, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"{checkout}: mtrain {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="git revision of the older code")
    parser.add_argument("--steps", type=int, default=500, help="updates per run (a multiple of 250 keeps validation's share)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    corpus = next((p for p in CORPORA if (p / "train.de").is_file()), None)
    if corpus is None:
        sys.exit("no Multi30k copy in data/multi30k or ../shared/corpora/multi30k")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        checkouts = {"old": export_revision(args.old, tmp), "new": ROOT}
        for name, checkout in checkouts.items():
            log(f"{name}: tokenizing Multi30k de-en")
            mtrain(checkout, ["tokenize", "--config", CONFIG, "--data", str(corpus), "--src", "de", "--tgt", "en",
                              "--out", str(tmp / f"tok-{name}")], args.threads)
        seconds = {name: [] for name in checkouts}
        for round_ in range(args.rounds):
            for name, checkout in checkouts.items():
                out = tmp / f"run-{name}-{round_}"
                wall = mtrain(checkout, ["train", "--config", CONFIG, "--data", str(tmp / f"tok-{name}"),
                                         "--out", str(out), "--set", f"train.max_steps={args.steps}",
                                         "--set", f"train.num_threads={args.threads}"], args.threads)
                seconds[name].append(wall / args.steps)
                log(f"round {round_ + 1} {name}: {args.steps} updates in {wall:.1f} s ({wall / args.steps:.3f} s/update)")
    per_update = {name: statistics.median(values) for name, values in seconds.items()}
    result = {
        "old": args.old, "steps": args.steps, "rounds": args.rounds, "threads": args.threads,
        "s_per_update": {name: [round(v, 4) for v in values] for name, values in seconds.items()},
        "recipe_minutes": {name: round(v * RECIPE_STEPS / 60, 1) for name, v in per_update.items()},
        "new_over_old": round(per_update["new"] / per_update["old"], 3),
        "hardware": machine_record(),
    }
    for name, value in per_update.items():
        log(f"{name}: {value:.3f} s/update -> {RECIPE_STEPS} updates in {result['recipe_minutes'][name]} min")
    log(f"new / old wall time per update: {result['new_over_old']:.3f}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
