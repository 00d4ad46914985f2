"""Single-corpus and mixed models side by side: each model's averaged.pt on Multi30k test2016, the
Tatoeba test, FLORES-200 devtest and newstest2014 (beam 5, its config's length penalty, cased
sacreBLEU and chrF). A score its recipe already wrote (RUN/<test>.json, or the Multi30k recipe's
RUN/test2016.sacrebleu.json) is reused, so each test is scored once per model; the others are scored
here and written beside it. Prints a Markdown table; --json writes every score with its signature.

    python scripts/mixing_table.py --model multi30k=runs/multi30k-de-en --model tatoeba=runs/tatoeba-de-en \\
        --model mixed=runs/mixed-de-en --json docs/results/mixing.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

# (column, split, the corpus folder it is read from as raw text): what each model is scored on.
TESTS = (("test2016", "test2016", "multi30k"), ("Tatoeba test", "test", "tatoeba"),
         ("FLORES-200 devtest", "flores200-devtest", "tatoeba"), ("newstest2014", "newstest2014", "tatoeba"))


def recorded(run: Path, split: str) -> Path | None:
    """The score of averaged.pt on this split that a recipe wrote, if it is newer than averaged.pt."""
    for name in (f"{split}.json", f"{split}.sacrebleu.json"):
        path = run / name
        if path.is_file() and path.stat().st_mtime_ns > (run / "averaged.pt").stat().st_mtime_ns:
            return path
    return None


def score(run: Path, split: str, folder: Path) -> dict[str, Any]:
    """averaged.pt on folder/split.de against split.en, scored once: an earlier score is read back."""
    path = recorded(run, split)
    if path is None:
        from mtrain.config import load_config

        lenpen = load_config(run / "config.yaml").decode.lenpen
        print(f"scoring {run}/averaged.pt on {folder}/{split} (beam 5, lenpen {lenpen})", file=sys.stderr)
        command = [sys.executable, "-m", "mtrain", "eval", "--checkpoint", str(run / "averaged.pt"),
                   "--src", str(folder / f"{split}.de"), "--ref", str(folder / f"{split}.en"), "--beam", "5",
                   "--lenpen", str(lenpen), "--output-hyp", str(run / f"{split}.hyp"), "--json"]
        output = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout
        path = run / f"{split}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(output, encoding="utf-8")
        tmp.replace(path)
    return json.loads(path.read_text(encoding="utf-8"))


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
    models = dict(spec.split("=", 1) for spec in args.model)
    for name, run in models.items():
        if not (Path(run) / "averaged.pt").is_file():
            parser.error(f"--model {name}={run}: no averaged.pt there; finish that run first")
    folders = {"multi30k": args.multi30k, "tatoeba": args.tatoeba}
    scores = {name: {column: score(Path(run), split, folders[corpus]) for column, split, corpus in TESTS}
              for name, run in models.items()}
    print(table(scores))
    if args.json:
        keep = ("bleu", "chrf", "ter", "n_lines", "signatures")
        record = {name: {"run": run, "tests": {c: {k: s[k] for k in keep if k in s} for c, s in scores[name].items()}}
                  for name, run in models.items()}
        args.json.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
