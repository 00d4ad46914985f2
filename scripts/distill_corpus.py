"""The distillation recipe's checks and corpus step (scripts/recipe-multi30k-distill.sh):
  check-lines SRC HYP          the teacher's output has one line per source line
  build --src --hyp --out-src --out-tgt [--scores FILE --min-logprob X] [--references REF]
                               the distilled pairs, without empty translations and, when asked,
                               without pairs whose teacher score (mean log-prob per token) is below X;
                               with --references, after the original pairs (SRC, REF)
  same-vocab TEACHER TOKDIR    the tokenized corpus uses the teacher's SentencePiece model(s)
Each failure is one line on stderr and exit code 2; outputs are written atomically."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mtrain.atomic import atomic_write  # noqa: E402
from mtrain.errors import MtrainError  # noqa: E402
from mtrain.evaluate import read_stripped_lines  # noqa: E402


def check_lines(src: Path, hyp: Path) -> None:
    n, m = len(read_stripped_lines(src)), len(read_stripped_lines(hyp))
    if n != m:
        raise MtrainError(f"{hyp}: {m} lines for {n} sources in {src}; the teacher's output is incomplete or "
                          "not from these sources: delete it and re-run to translate again")


def build(src: Path, hyp: Path, out_src: Path, out_tgt: Path, scores: Path | None, min_logprob: float | None,
          references: Path | None = None) -> None:
    """The kept distilled pairs, after (with references) every original pair with both sides non-empty:
    the student learns from the human translations and the teachers' ones."""
    check_lines(src, hyp)
    sources, targets = read_stripped_lines(src), read_stripped_lines(hyp)
    keep = [bool(s.strip()) and bool(t.strip()) for s, t in zip(sources, targets)]
    if scores is not None:
        values = [json.loads(line)["mean_logprob"] for line in scores.read_text(encoding="utf-8").splitlines()]
        if len(values) != len(sources):
            raise MtrainError(f"{scores}: {len(values)} scores for {len(sources)} pairs; delete it and re-run")
        keep = [k and v >= min_logprob for k, v in zip(keep, values)]
    pairs = [(s, t) for s, t, k in zip(sources, targets, keep) if k]
    originals = _original_pairs(sources, src, references) if references is not None else []
    with atomic_write(out_src) as a:
        a.writelines(s + "\n" for s, _ in originals + pairs)
    with atomic_write(out_tgt) as b:  # written last: its presence means the step is done
        b.writelines(t + "\n" for _, t in originals + pairs)
    also = f", after {len(originals)} original pairs" if references is not None else ""
    print(f"distilled corpus: {sum(keep)} of {len(keep)} pairs kept{also}", file=sys.stderr)


def _original_pairs(sources: list[str], src: Path, references: Path) -> list[tuple[str, str]]:
    """(source, reference) for the lines of src (already read: `sources`) whose sides are both non-empty."""
    refs = read_stripped_lines(references)
    if len(sources) != len(refs):
        raise MtrainError(f"{references}: {len(refs)} lines for {len(sources)} sources in {src}; "
                          "give the references of these sources")
    return [(s, r) for s, r in zip(sources, refs) if s.strip() and r.strip()]


def same_vocab(teacher: Path, tok: Path) -> None:
    from mtrain.checkpoint import load
    from mtrain.data import TokenizedData

    state = load(teacher)["tokenizer"]
    tokenizer = TokenizedData(tok).tokenizer
    theirs = [state["src_model"]] if state.get("joint", True) else [state["src_model"], state["tgt_model"]]
    mine = [tokenizer.src.model] if tokenizer.joint else [tokenizer.src.model, tokenizer.tgt.model]
    if theirs != mine:
        raise MtrainError(f"{tok}: its SentencePiece model is not {teacher}'s, but VOCAB=teacher needs the teacher's "
                          f"vocabulary; delete {tok} and re-run (or use VOCAB=new)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    c = commands.add_parser("check-lines")
    c.add_argument("src", type=Path)
    c.add_argument("hyp", type=Path)
    b = commands.add_parser("build")
    for name in ("--src", "--hyp", "--out-src", "--out-tgt"):
        b.add_argument(name, type=Path, required=True)
    b.add_argument("--scores", type=Path)
    b.add_argument("--min-logprob", type=float)
    b.add_argument("--references", type=Path, help="the sources' human translations: their pairs follow")
    v = commands.add_parser("same-vocab")
    v.add_argument("teacher", type=Path)
    v.add_argument("tok", type=Path)
    args = parser.parse_args()
    try:
        if args.command == "check-lines":
            check_lines(args.src, args.hyp)
        elif args.command == "build":
            build(args.src, args.hyp, args.out_src, args.out_tgt, args.scores, args.min_logprob, args.references)
        else:
            same_vocab(args.teacher, args.tok)
    except MtrainError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
