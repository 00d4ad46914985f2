"""Single-corpus and mixed models side by side: each model's averaged.pt on Multi30k test2016, the
Tatoeba test, FLORES-200 devtest and newstest2014 (beam 5, its config's length penalty, cased
sacreBLEU and chrF). A score its recipe already wrote (RUN/<test>.json, or the Multi30k recipe's
RUN/test2016.sacrebleu.json) is reused, so each test is scored once per model; the others are scored
here and written beside it. Prints a Markdown table; --json writes every score with its signature.

    python scripts/mixing_table.py --model multi30k=runs/multi30k-de-en --model tatoeba=runs/tatoeba-de-en \\
        --model mixed=runs/mixed-de-en --json docs/results/mixing/table.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from mtrain.atomic import atomic_write

# (column, split, the corpus folder it is read from as raw text): what each model is scored on.
TESTS = (("test2016", "test2016", "multi30k"), ("Tatoeba test", "test", "tatoeba"),
         ("FLORES-200 devtest", "flores200-devtest", "tatoeba"), ("newstest2014", "newstest2014", "tatoeba"))


def recorded(run: Path, split: str, n_lines: int) -> dict[str, Any] | None:
    """The score of averaged.pt alone on the whole split that a recipe wrote after averaged.pt was
    made, if there is one. The Multi30k recipe's test2016.sacrebleu.json counts only when its
    results.json says it scored averaged.pt alone, on every line of the original text."""
    model_time = (run / "averaged.pt").stat().st_mtime_ns
    for name in (f"{split}.json", f"{split}.sacrebleu.json"):
        path = run / name
        if not path.is_file() or path.stat().st_mtime_ns <= model_time:
            continue
        if name.endswith(".sacrebleu.json") and not _recipe_scored_averaged_alone(run):
            continue
        try:
            scores = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # an interrupted write: score again
        if isinstance(scores, dict) and {"bleu", "chrf"} <= set(scores) and scores.get("n_lines") == n_lines:
            return scores
    return None


def _recipe_scored_averaged_alone(run: Path) -> bool:
    try:
        meta = json.loads((run / "results.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (str(meta.get("checkpoint", "")).endswith("averaged.pt") and "+" not in str(meta.get("checkpoint"))
            and meta.get("eval_lines") == "all" and meta.get("text") == "raw")


def score(run: Path, split: str, folder: Path) -> dict[str, Any]:
    """averaged.pt on folder/split.de against split.en, scored once: an earlier score is read back."""
    from mtrain.corpus import read_lines  # the line splitting mtrain eval uses

    n_lines = len(read_lines(folder / f"{split}.en"))
    scores = recorded(run, split, n_lines)
    if scores is None:
        from mtrain.config import load_config

        lenpen = load_config(run / "config.yaml").decode.lenpen
        print(f"scoring {run}/averaged.pt on {folder}/{split} (beam 5, lenpen {lenpen})", file=sys.stderr)
        command = [sys.executable, "-m", "mtrain", "eval", "--checkpoint", str(run / "averaged.pt"),
                   "--src", str(folder / f"{split}.de"), "--ref", str(folder / f"{split}.en"), "--beam", "5",
                   "--lenpen", str(lenpen), "--output-hyp", str(run / f"{split}.hyp"), "--json"]
        output = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout
        scores = json.loads(output)
        with atomic_write(run / f"{split}.json") as handle:
            handle.write(output)
    return scores


def table(scores: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Markdown: one row per model, BLEU / chrF per test."""
    lines = ["| model | " + " | ".join(column for column, _, _ in TESTS) + " |",
             "|---|" + "---|" * len(TESTS)]
    for model, by_test in scores.items():
        cells = [f"{by_test[column]['bleu']:.2f} / {by_test[column]['chrf']:.2f}" for column, _, _ in TESTS]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", required=True, metavar="NAME=RUN",
                        help="a run folder with averaged.pt and config.yaml (repeatable)")
    parser.add_argument("--json", type=Path, help="also write the scores and signatures here")
    parser.add_argument("--multi30k", type=Path, default=Path("data/multi30k"), help="holds test2016.{de,en}")
    parser.add_argument("--tatoeba", type=Path, default=Path("data/tatoeba-de-en"),
                        help="holds test, flores200-devtest and newstest2014 .{de,en}")
    args = parser.parse_args(argv)
    models: dict[str, str] = {}
    for spec in args.model:
        name, _, run = spec.partition("=")
        if not name or not run or name in models:
            parser.error(f"--model {spec}: give NAME=RUN, each NAME once")
        for needed in ("averaged.pt", "config.yaml"):
            if not (Path(run) / needed).is_file():
                parser.error(f"--model {spec}: no {needed} in {run}; finish that run first")
        models[name] = run
    folders = {"multi30k": args.multi30k, "tatoeba": args.tatoeba}
    scores = {name: {column: score(Path(run), split, folders[corpus]) for column, split, corpus in TESTS}
              for name, run in models.items()}
    print(table(scores))
    if args.json:
        keep = ("bleu", "chrf", "ter", "n_lines", "signatures")
        record = {name: {"run": run, "tests": {c: {k: s[k] for k in keep if k in s} for c, s in scores[name].items()}}
                  for name, run in models.items()}
        with atomic_write(args.json) as handle:
            handle.write(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
