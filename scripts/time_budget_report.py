"""The table of scripts/time-budget-vs-steps.sh: for each budget, the time-budget run and the
step-count run of the same number of updates, side by side. Prints Markdown; writes RUN/report.json.

    python scripts/time_budget_report.py --run runs/time-budget --budgets 30m 60m
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mtrain.plot import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))  # recipe_report, beside this script
from recipe_report import hardware  # noqa: E402


def summary(run: Path) -> dict[str, Any]:
    """One run: its updates, training and wall minutes, and its valid BLEU (greedy at the end of
    training, and averaged.pt with beam 5)."""
    from mtrain import checkpoint

    state = checkpoint.load(run / "last.pt", mmap=True)["train_state"]["state"]
    valid = [r for r in read_metrics(run / "metrics.jsonl") if r.get("event") == "valid"]
    wall = run.with_name(run.name + ".wall_s")
    return {
        "updates": state["step"], "stopped": state["finished"],
        "train_min": round(state.get("train_seconds", 0.0) / 60, 1),
        "wall_min": round(int(wall.read_text()) / 60, 1) if wall.is_file() else None,
        "valid_greedy": round(valid[-1]["bleu"], 2),
        "valid_beam5_averaged": round(json.loads((run / "valid.beam5.json").read_text())["bleu"], 2),
    }


def rows(results: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    lines = ["| budget | schedule | updates | training min | wall min | valid BLEU, greedy, last | "
             "valid BLEU, beam 5, averaged.pt |", "|---|---|---|---|---|---|---|"]
    for budget, pair in results.items():
        for kind, label in (("time", f"`--max-time {budget}`"), ("steps", "steps, same updates")):
            r = pair[kind]
            lines.append(f"| {budget} | {label} | {r['updates']:,} | {r['train_min']} | {r['wall_min']} | "
                         f"{r['valid_greedy']:.2f} | {r['valid_beam5_averaged']:.2f} |")
        gap = pair["time"]["valid_beam5_averaged"] - pair["steps"]["valid_beam5_averaged"]
        lines.append(f"| {budget} | time − steps | | | | "
                     f"{pair['time']['valid_greedy'] - pair['steps']['valid_greedy']:+.2f} | {gap:+.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--budgets", nargs="+", required=True)
    args = parser.parse_args(argv)
    results = {b: {kind: summary(args.run / f"{kind}-{b}") for kind in ("time", "steps")} for b in args.budgets}
    print("\n".join(rows(results)))
    record = {"budgets": results, "hardware": hardware()}
    (args.run / "report.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
