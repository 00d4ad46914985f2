"""A corpus recipe's report (scripts/recipe-corpus.sh): RUN/results.json with each test set's scores
and signatures, the training time and steps, the evaluation pairs found in train (and so dropped
from it) and the machine; RUN/bleu_vs_time.csv, the validation BLEU against training time (the train_s that
mtrain train logs, summed over resumed invocations, validation included). Prints a Markdown table.

    python scripts/corpus_report.py --run runs/tatoeba-de-en --data data/tatoeba-tok --tests test flores200-devtest
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mtrain.plot import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))  # recipe_report, beside this script
from recipe_report import hardware, trained_with, write_curve_csv  # noqa: E402


def curve(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per validation that logged its training time."""
    return [{"step": r["step"], "train_min": round(r["train_s"] / 60, 2), "valid_bleu": round(r["bleu"], 2),
             "valid_chrf": round(r["chrf"], 2), "valid_loss": round(r["loss"], 4)}
            for r in records if r.get("event") == "valid" and "train_s" in r]


def results(run: Path, data: Path, tests: list[str]) -> dict[str, Any]:
    from mtrain import checkpoint

    records = read_metrics(run / "metrics.jsonl")
    state = checkpoint.load(run / "last.pt", mmap=True)["train_state"]["state"]
    stats = json.loads((data / "stats.json").read_text())
    scores = {test: json.loads((run / f"{test}.json").read_text()) for test in tests}
    valid = [r for r in records if r.get("event") == "valid"]
    return {
        "run": str(run), "data": str(data),
        "tests": {t: {k: s[k] for k in ("bleu", "chrf", "ter", "n_lines", "signatures")} for t, s in scores.items()},
        "final_valid_bleu_greedy": valid[-1]["bleu"] if valid else None,
        "steps": state["step"], "stopped": state["finished"],
        "train_minutes": round(state.get("train_seconds", 0.0) / 60, 1),
        "train_pairs": stats["cleaning"]["kept_pairs"], "dropped": stats["cleaning"]["dropped"],
        "overlap_pairs": {split: o["pairs"] for split, o in stats.get("overlap", {}).items()},
        "config": _config(run),
        "hardware": hardware(), "trained_with": trained_with(run),
    }


def _config(run: Path) -> dict[str, Any]:
    from mtrain.config import load_config, to_dict

    return to_dict(load_config(run / "config.yaml"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True, help="the tokenized folder (its stats.json)")
    parser.add_argument("--tests", nargs="+", required=True, help="test names: RUN/<name>.json from mtrain eval --json")
    args = parser.parse_args(argv)
    report = results(args.run, args.data, args.tests)
    rows = curve(read_metrics(args.run / "metrics.jsonl"))
    write_curve_csv(rows, args.run / "bleu_vs_time.csv", fields=("step", "train_min", "valid_bleu", "valid_chrf", "valid_loss"))
    (args.run / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"| {args.run.name} | " + " | ".join(f"{args.tests[i]} {s['bleu']:.2f} / {s['chrf']:.2f}"
                                             for i, s in enumerate(report["tests"].values()))
          + f" | {report['train_minutes']} min, {report['steps']} updates |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
