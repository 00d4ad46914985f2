"""Greedy test2016 BLEU of a run's step checkpoints against training wall time: the like-for-like
comparison with the JoeyNMT peer (greedy cased sacreBLEU on test2016 after 68 minutes).

    python scripts/test_curve.py --run RUN --src TOK/test2016.src.txt --ref TOK/test2016.tgt.txt [--checkpoints DIR]

Scores every DIR/step-N.pt (default: RUN, where the recipe configs keep one per epoch through
train.keep_every; without it train keeps only the last train.keep_last, so copy them aside while the
run goes on to keep the early ones) with `mtrain eval --beam 1`, reads
each step's wall time from RUN/metrics.jsonl (the validation at that step, as in bleu_vs_time.csv),
writes RUN/test_vs_time.csv, redraws RUN/bleu_vs_time.png with these points, and prints the first
checkpoint at or above the peer's BLEU. Progress goes to stderr; one JSON object to stdout.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

from mtrain.checkpoint import step_checkpoints

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipe_report import PEER, plot_curve, read_metrics, validation_curve  # noqa: E402


def greedy_bleu(checkpoint: Path, src: Path, ref: Path) -> float:
    out = subprocess.run([sys.executable, "-m", "mtrain", "eval", "--checkpoint", str(checkpoint), "--src", str(src), "--ref", str(ref),
                          "--beam", "1", "--json"], check=True, capture_output=True, text=True)
    return float(json.loads(out.stdout)["bleu"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--src", type=Path, required=True)
    parser.add_argument("--ref", type=Path, required=True)
    parser.add_argument("--checkpoints", type=Path, help="folder of step-N.pt (default: the run folder)")
    args = parser.parse_args(argv)
    curve = validation_curve(read_metrics(args.run / "metrics.jsonl"))
    wall = {row["step"]: row for row in curve}
    rows = []
    for step, path in step_checkpoints(args.checkpoints or args.run):
        if step not in wall:
            continue
        bleu = greedy_bleu(path, args.src, args.ref)
        rows.append({"step": step, "wall_min": wall[step]["wall_min"], "valid_bleu": wall[step]["valid_bleu"],
                     "test_bleu_greedy": round(bleu, 2)})
        print(f"step {step:>5}  {wall[step]['wall_min']:6.1f} min  test2016 greedy BLEU {bleu:.2f}", file=sys.stderr)
    with open(args.run / "test_vs_time.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=["step", "wall_min", "valid_bleu", "test_bleu_greedy"])
        writer.writeheader()
        writer.writerows(rows)
    first = next((r for r in rows if r["test_bleu_greedy"] >= PEER["bleu"]), None)
    results_file = args.run / "results.json"
    final = json.loads(results_file.read_text(encoding="utf-8")) if results_file.is_file() else {}
    plot_curve(curve, args.run / "bleu_vs_time.png", final.get("direction", ""), final.get("bleu"),
               [(r["wall_min"], r["test_bleu_greedy"]) for r in rows])
    print(json.dumps({"peer": PEER, "first_at_or_above_peer": first, "points": rows}))


if __name__ == "__main__":
    main()
