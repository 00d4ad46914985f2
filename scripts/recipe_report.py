"""The Multi30k recipe's report: RUN/results.json (test2016 scores, training wall time, hardware)
and the validation BLEU-against-wall-time curve (RUN/bleu_vs_time.csv and .png) from RUN/metrics.jsonl.

    python scripts/recipe_report.py --run runs/multi30k-de-en --sacrebleu S.json --tok-bleu T.json
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from mtrain.plot import read_metrics  # the one reader of metrics.jsonl (skips a torn last line)

# The peer this curve is compared with: JoeyNMT 2.3, same shape and data, 2 CPU cores,
# greedy cased sacreBLEU on test2016 after 68 minutes of training.
PEER = {"name": "JoeyNMT 2.3 (test2016, greedy)", "direction": "de-en", "minutes": 68.0, "bleu": 32.5}
# The anchors: published from-scratch test2016 scores in lowercased tokenized BLEU that the recipe is
# compared with, one per direction. Drawn only on curves of that metric (a cased curve is not comparable).
ANCHORS = {"de-en": (36.52, "PyTorch tutorial, 3+3 d256"), "en-de": (41.02, "fairseq transformer_tiny, Wu et al. 2021")}
# The two BLEUs a curve can be in (its y-axis name; the anchors are in the second).
CASED_BLEU, LC_TOK_BLEU = "cased sacreBLEU", "lowercased tokenized BLEU"


def with_wall_time(records: list[dict[str, Any]]) -> list[tuple[float, dict[str, Any]]]:
    """(seconds of training wall time so far, record) for each record, across resumed processes.

    Train records carry elapsed_s, counted from the start of the process that wrote them; a
    smaller value than the previous one means a resumed process, which continues from the sum of
    the earlier processes' last values. Valid records carry only valid_s: they end at the last
    train record's time (logged just before the validation, at the same step) plus valid_s.
    The time between a killed process's last log line and the kill is not in the log, and is lost."""
    out: list[tuple[float, dict[str, Any]]] = []
    offset = last = 0.0
    for record in records:
        elapsed = record.get("elapsed_s")
        if record.get("event") == "train" and isinstance(elapsed, (int, float)):
            if elapsed < last:
                offset += last
            last = float(elapsed)
            out.append((offset + last, record))
        elif record.get("event") == "valid":
            out.append((offset + last + float(record.get("valid_s") or 0.0), record))
    return out


def validation_curve(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per validation: step, wall_s, wall_min, valid BLEU/chrF/loss."""
    rows = []
    for wall, record in with_wall_time(records):
        if record.get("event") == "valid":
            rows.append({"step": record["step"], "wall_s": round(wall, 1), "wall_min": round(wall / 60, 2),
                         "valid_bleu": record.get("bleu"), "valid_chrf": record.get("chrf"),
                         "valid_loss": record.get("loss")})
    return rows


def train_wall_time(records: list[dict[str, Any]]) -> float:
    """Training wall time in seconds (validations included) up to the last logged event."""
    timed = with_wall_time(records)
    return round(max((wall for wall, _ in timed), default=0.0), 1)


CURVE_FIELDS = ("step", "wall_s", "wall_min", "valid_bleu", "valid_chrf", "valid_loss")


def write_curve_csv(rows: list[dict[str, Any]], path: str | Path, fields: Sequence[str] = CURVE_FIELDS) -> None:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def plot_curve(rows: list[dict[str, Any]], path: str | Path, direction: str, test_bleu: float | None = None,
               test_points: list[tuple[float, float]] | None = None, metric: str = CASED_BLEU) -> None:
    """Valid BLEU (greedy) against minutes of training; the final test score; the peer's point
    when it measured this direction; test_points: (minutes, greedy test2016 BLEU) of step
    checkpoints (scripts/test_curve.py). metric names the BLEU on the y axis (see bleu_metric)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([r["wall_min"] for r in rows], [r["valid_bleu"] for r in rows], marker="o", ms=3,
            label="mtrain: valid BLEU (greedy)")
    if test_points:
        ax.plot([m for m, _ in test_points], [b for _, b in test_points], marker="^", ms=4, color="tab:purple",
                label="mtrain: test2016 BLEU (greedy, step checkpoints)")
    if direction == PEER["direction"]:
        ax.scatter([PEER["minutes"]], [PEER["bleu"]], marker="s", color="tab:red", zorder=3, label=PEER["name"])
        ax.scatter([PEER["minutes"] / 2], [PEER["bleu"]], marker="x", color="tab:red", zorder=3,
                   label="target: the peer's BLEU in half its time")
    if metric == LC_TOK_BLEU and direction in ANCHORS:
        bleu, name = ANCHORS[direction]
        ax.axhline(bleu, linestyle="--", color="tab:gray", label=f"anchor: test2016 {bleu} ({name})")
    if test_bleu is not None and rows:
        ax.scatter([rows[-1]["wall_min"]], [test_bleu], marker="*", s=120, color="tab:green", zorder=3,
                   label="mtrain: test2016, beam 5, averaged")
    ax.set_xlabel("training wall time (minutes, validation included)")
    ax.set_ylabel(metric)
    ax.set_title(f"Multi30k {direction}: BLEU vs wall time")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    tmp = Path(str(path) + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


def hardware() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    from mtrain.hardware import machine_record

    return {**machine_record(), "torch_threads": torch.get_num_threads()}


def trained_with(run: Path) -> dict[str, Any] | None:
    """The CPU fast paths that trained the run, as its last.pt records them (mtrain.cpu.acceleration;
    None for a GPU run's or an older checkpoint)."""
    from mtrain import checkpoint

    last = run / "last.pt"
    return checkpoint.load(last, mmap=True).get("train_state", {}).get("acceleration") if last.exists() else None


def build_results(run: Path, sacrebleu: dict[str, Any], tok_bleu: dict[str, Any] | None,
                  records: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    valid = [r for r in records if r.get("event") == "valid"]
    steps = [r["step"] for r in records if "step" in r]
    return {
        **meta,
        "bleu": sacrebleu.get("bleu"), "chrf": sacrebleu.get("chrf"), "ter": sacrebleu.get("ter"),
        "signatures": sacrebleu.get("signatures"),
        "tok_bleu_lc": tok_bleu.get("bleu") if tok_bleu else None,
        "tok_bleu_lc_signature": tok_bleu.get("signatures", {}).get("bleu") if tok_bleu else None,
        "train_wall_s": train_wall_time(records),
        "train_steps": max(steps, default=0),
        "best_valid_bleu": max((r["bleu"] for r in valid), default=None),
        "validations": len(valid),
        "hardware": hardware(),
        "cpu_fast_paths": trained_with(run),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "run_dir": str(run),
    }


def bleu_metric(signature: str) -> str:
    """The y-axis name: a MULTI30K_TEXT=lc-tok run is scored lowercased throughout (case:lc)."""
    return LC_TOK_BLEU if "case:lc" in signature else CASED_BLEU


def read_curve_csv(path: str | Path) -> list[dict[str, Any]]:
    """Rows written by write_curve_csv, numbers parsed (a committed curve can be re-plotted)."""
    with open(path, newline="", encoding="utf-8") as handle:
        return [{key: float(value) if value not in ("", None) else None for key, value in row.items()}
                for row in csv.DictReader(handle)]


def replot(args: argparse.Namespace) -> None:
    rows = read_curve_csv(args.curve_csv)
    metric = LC_TOK_BLEU if args.lowercased else CASED_BLEU
    plot_curve(rows, args.out, args.direction, args.test_bleu, metric=metric)
    print(f"wrote {args.out} ({len(rows)} validations)", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, help="the run folder (holds metrics.jsonl)")
    parser.add_argument("--elapsed", action="store_true", help="only print the training wall seconds so far (0 before a run)")
    parser.add_argument("--sacrebleu", type=Path, help="`mtrain eval --json` output on raw test2016")
    parser.add_argument("--tok-bleu", type=Path, help="`mtrain eval --json --lowercase --tokenize none` output")
    parser.add_argument("--meta", action="append", default=[], help="KEY=VALUE added to results.json (repeatable)")
    replot_group = parser.add_argument_group("re-plot a saved curve (no --run needed)")
    replot_group.add_argument("--curve-csv", type=Path, help="a bleu_vs_time.csv to plot into --out")
    replot_group.add_argument("--out", type=Path, help="the PNG to write")
    replot_group.add_argument("--direction", default="", help="de-en adds the JoeyNMT peer's point")
    replot_group.add_argument("--test-bleu", type=float, help="the final test2016 score (a star at the end)")
    replot_group.add_argument("--lowercased", action="store_true", help="the curve is lowercased tokenized BLEU")
    args = parser.parse_args(argv)
    if args.curve_csv:
        if args.out is None:
            parser.error("--curve-csv needs --out")
        replot(args)
        return
    if args.run is None:
        parser.error("--run is required (unless --curve-csv)")
    metrics = args.run / "metrics.jsonl"
    if args.elapsed:
        print(int(train_wall_time(read_metrics(metrics))) if metrics.is_file() else 0)
        return
    if args.sacrebleu is None:
        parser.error("--sacrebleu is required (unless --elapsed)")
    records = read_metrics(metrics)
    sacrebleu = json.loads(args.sacrebleu.read_text(encoding="utf-8"))
    tok = json.loads(args.tok_bleu.read_text(encoding="utf-8")) if args.tok_bleu and args.tok_bleu.is_file() else None
    meta = dict(item.split("=", 1) for item in args.meta)
    results = build_results(args.run, sacrebleu, tok, records, meta)
    tmp = args.run / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, args.run / "results.json")
    rows = validation_curve(records)
    write_curve_csv(rows, args.run / "bleu_vs_time.csv")
    metric = bleu_metric(str((results.get("signatures") or {}).get("bleu", "")))
    if rows:
        plot_curve(rows, args.run / "bleu_vs_time.png", meta.get("direction", ""), results["bleu"], metric=metric)
    tok_text = f"{results['tok_bleu_lc']:.2f}" if results["tok_bleu_lc"] is not None else "n/a"
    case = "lowercased" if metric == LC_TOK_BLEU else "cased"
    print(f"test2016 {case} sacreBLEU {results['bleu']:.2f}  chrF {results['chrf']:.2f}  TER {results['ter']:.2f}  "
          f"lowercased tokenized BLEU {tok_text}", file=sys.stderr)
    print(f"training: {results['train_steps']} updates in {results['train_wall_s'] / 60:.1f} min "
          f"(best valid BLEU {results['best_valid_bleu']}); wrote {args.run / 'results.json'}, "
          f"{args.run / 'bleu_vs_time.csv'}" + (f", {args.run / 'bleu_vs_time.png'}" if rows else ""), file=sys.stderr)


if __name__ == "__main__":
    main()
