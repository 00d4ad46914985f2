"""Score translations with sacreBLEU (BLEU, chrF, TER, each with its signature): `evaluate` serves
`mtrain eval` and `score` validation during training, on the same metric objects, so the two
never disagree. Text only: no torch, no model (`mtrain eval --checkpoint` translates first, in
the CLI, then scores here); sacrebleu itself is imported on first use."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from mtrain.corpus import read_lines
from mtrain.errors import MtrainError

# Leftovers of a missing detokenization: the SentencePiece word marker, its rendering of <unk>
# (U+2047), and the special-token spellings. Any of them in a hypothesis costs BLEU silently.
MARKERS = re.compile(r"▁|⁇|<unk>|<s>|</s>|<pad>")


def read_stripped_lines(path: str | Path) -> list[str]:
    """Read a UTF-8 text file as lines, with trailing whitespace removed exactly as sacrebleu's
    CLI does (so file-based scores match it). Invalid UTF-8 names the file and line."""
    return [line.rstrip() for line in read_lines(path)]


def check_line_counts(hyps: Sequence[str], refs: Sequence[Sequence[str]], hyp_name: str = "hypotheses",
                      ref_names: Sequence[str] | None = None) -> None:
    """Every reference stream must have one line per hypothesis (sacrebleu would not check)."""
    if not refs:
        raise MtrainError("no references given; pass at least one --ref file")
    ref_names = list(ref_names) if ref_names else [f"reference {i + 1}" for i in range(len(refs))]
    for name, stream in zip(ref_names, refs):
        if len(stream) != len(hyps):
            raise MtrainError(
                f"{hyp_name} has {len(hyps)} lines but {name} has {len(stream)}; score files of the same test set, one sentence a line"
            )
    if not hyps:
        raise MtrainError(f"{hyp_name}: no lines to score; pass a non-empty file")


def warn_markers(hyps: Sequence[str], name: str = "hypotheses") -> int:
    """Warn on stderr when hypotheses look undetokenized; return how many lines do."""
    found: set[str] = set()
    bad = []
    for number, line in enumerate(hyps, 1):
        hits = MARKERS.findall(line)
        if hits:
            found.update(hits)
            bad.append(number)
    if bad:
        if found == {"⁇"}:  # decode_tgt renders a generated <unk> as ⁇: the text is detokenized
            hint = "the model generated <unk> (SentencePiece shows it as ⁇)"
        else:
            hint = "score detokenized text (what `mtrain translate` writes), not SentencePiece pieces"
        print(f"warning: {name}: {len(bad)} of {len(hyps)} lines contain {' '.join(sorted(found))}"
              f" (first at line {bad[0]}); {hint}", file=sys.stderr)
    return len(bad)


def _metrics(lowercase: bool, tokenize: str | None, sentence: bool = False):
    """The three sacrebleu metric objects. TER keeps sacrebleu's default (case-insensitive, as
    TERCOM), so without --lowercase all three match `sacrebleu -m bleu chrf ter` exactly."""
    from sacrebleu.metrics import BLEU, CHRF, TER

    if tokenize is not None and tokenize not in BLEU.TOKENIZERS:
        raise MtrainError(f"--tokenize {tokenize}: unknown sacrebleu tokenizer; use one of {', '.join(BLEU.TOKENIZERS)}")
    try:
        # Sentence-level BLEU needs effective order, or one missing 4-gram zeroes a short sentence.
        # `--tokenize none` says the text is tokenized on purpose (papers' tokenized BLEU), so
        # sacrebleu's "forgot to detokenize" warning (force=False) would only be noise.
        bleu = BLEU(lowercase=lowercase, tokenize=tokenize, effective_order=sentence, force=tokenize == "none")
    except (ImportError, RuntimeError) as err:  # ja-mecab, ko-mecab, spm need extra packages
        hint = next((line.strip() for line in str(err).splitlines() if "pip install" in line), "install its extra packages")
        raise MtrainError(f"--tokenize {tokenize}: sacrebleu cannot load this tokenizer; {hint}") from None
    return bleu, CHRF(lowercase=lowercase), TER(case_sensitive=False)


def _corpus_scores(hyps: Sequence[str], refs: Sequence[Sequence[str]], lowercase: bool, tokenize: str | None):
    """[(key, sacrebleu Score, signature string)] for bleu, chrf, ter."""
    check_line_counts(hyps, refs)
    hyps, refs = list(hyps), [list(stream) for stream in refs]
    results = []
    for key, metric in zip(("bleu", "chrf", "ter"), _metrics(lowercase, tokenize)):
        result = metric.corpus_score(hyps, refs)
        results.append((key, result, str(metric.get_signature())))
    return results


def _as_dict(results, n_lines: int) -> dict[str, Any]:
    out: dict[str, Any] = {key: float(result.score) for key, result, _ in results}
    # The brevity penalty tells a too-short output (tune decode.lenpen) from a wrong one.
    out["bleu_bp"] = next(float(result.bp) for key, result, _ in results if key == "bleu")
    out["signatures"] = {key: signature for key, _, signature in results}
    out["n_lines"] = n_lines
    return out


def score(hyps: Sequence[str], refs: Sequence[Sequence[str]], lowercase: bool = False,
          tokenize: str | None = None, warn: bool = True) -> dict[str, Any]:
    """Corpus BLEU, chrF and TER of detokenized `hyps` against raw references.

    refs holds one list of lines per reference stream. Returns {"bleu", "chrf", "ter" (floats at
    full precision), "bleu_bp" (BLEU's brevity penalty), "signatures": {"bleu", "chrf", "ter"},
    "n_lines"}. `lowercase` makes BLEU and chrF case-insensitive (TER always is); `tokenize` is
    BLEU's tokenizer (default 13a).
    """
    if warn:
        warn_markers(hyps)
    return _as_dict(_corpus_scores(hyps, refs, lowercase, tokenize), len(hyps))


def worst_sentences(hyps: Sequence[str], refs: Sequence[Sequence[str]], n: int, lowercase: bool = False,
                    tokenize: str | None = None) -> list[dict[str, Any]]:
    """The n lines with the lowest sentence-BLEU (ties: earlier line first), as
    {"line" (1-based), "bleu", "hyp", "refs"}."""
    check_line_counts(hyps, refs)
    bleu = _metrics(lowercase, tokenize, sentence=True)[0]
    rows = []
    for i, hyp in enumerate(hyps):
        line_refs = [stream[i] for stream in refs]
        rows.append({"line": i + 1, "bleu": float(bleu.sentence_score(hyp, line_refs).score), "hyp": hyp, "refs": line_refs})
    rows.sort(key=lambda row: (row["bleu"], row["line"]))
    return rows[:n]


@dataclass
class Evaluation:
    """What `evaluate` found: sacrebleu's results with their signatures, and the worst lines."""

    results: list[tuple[str, Any, str]]  # (key, sacrebleu Score, signature) for bleu, chrf, ter
    n_lines: int
    n_refs: int
    worst: list[dict[str, Any]]

    def as_dict(self) -> dict[str, Any]:
        """score()'s dict, plus "worst" when worst lines were asked for (the --json output)."""
        summary = _as_dict(self.results, self.n_lines)
        if self.worst:
            summary["worst"] = self.worst
        return summary

    def report(self) -> str:
        """sacrebleu's own one-line format per metric (signature, score, BLEU details), then the worst lines."""
        out = [result.format(width=2, signature=signature) for _, result, signature in self.results]
        out.append(f"({self.n_lines} lines, {self.n_refs} reference{'s' if self.n_refs > 1 else ''})")
        if self.worst:
            out.append(f"\n{len(self.worst)} lowest sentence-BLEU:")
            for row in self.worst:
                out.append(f"line {row['line']}  sentence-BLEU {row['bleu']:.2f}")
                out.append(f"  hyp: {row['hyp']}")
                for k, ref in enumerate(row["refs"]):
                    out.append(f"  ref{'' if len(row['refs']) == 1 else k + 1}: {ref}")
        return "\n".join(out)


def check_metric_options(lowercase: bool, tokenize: str | None) -> None:
    """Fail on an unknown or unusable --tokenize now, before any translation runs."""
    _metrics(lowercase, tokenize)


def evaluate(hyps: Sequence[str], refs: Sequence[Sequence[str]], hyp_name: str = "hypotheses",
             ref_names: Sequence[str] | None = None, lowercase: bool = False, tokenize: str | None = None,
             worst: int = 0) -> Evaluation:
    """`mtrain eval`'s scoring: line counts checked (names in the messages), a warning for
    undetokenized text, corpus BLEU/chrF/TER, and the `worst` lines by sentence-BLEU."""
    check_line_counts(hyps, refs, hyp_name, ref_names)
    warn_markers(hyps, hyp_name)
    results = _corpus_scores(hyps, refs, lowercase, tokenize)
    rows = worst_sentences(hyps, refs, worst, lowercase, tokenize) if worst else []
    return Evaluation(results, len(hyps), len(refs), rows)
