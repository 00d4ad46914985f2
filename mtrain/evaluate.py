"""Score translations with sacreBLEU (BLEU, chrF, TER, each with its signature): one `score`
function serves `mtrain eval` and validation during training, so the two never disagree.
No torch at import time; sacrebleu itself is imported on first use."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from mtrain.atomic import atomic_text
from mtrain.errors import MtrainError

# Leftovers of a missing detokenization: the SentencePiece word marker, its rendering of <unk>
# (U+2047), and the special-token spellings. Any of them in a hypothesis costs BLEU silently.
MARKERS = re.compile(r"▁|⁇|<unk>|<s>|</s>|<pad>")


def read_lines(path: str | Path) -> list[str]:
    """Read a UTF-8 text file as lines, with trailing whitespace removed exactly as sacrebleu's
    CLI does (so file-based scores match it). Invalid UTF-8 names the file and line."""
    from mtrain.data import read_lines as read_text_lines  # BOM, CRLF, UTF-8 errors with line numbers

    return [line.rstrip() for line in read_text_lines(path)]


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


def write_lines_atomic(lines: Sequence[str], path: str | Path) -> None:
    """Write lines to a temp file next to `path`, then rename: no half-written output on a crash."""
    with atomic_text(path) as handle:
        handle.writelines(line + "\n" for line in lines)


def _translate(checkpoints: Path | list[Path], lines: list[str], decode, device: str) -> list[str]:
    from mtrain.ensemble import load_models
    from mtrain.translate import check_decode, resolve_device, translate_lines

    check_decode(decode)
    resolved = resolve_device(device)
    model, tokenizer, ckpt = load_models(checkpoints, resolved)
    return translate_lines(model, tokenizer, lines, decode, resolved, stats=ckpt.get("stats") or None, progress=True)


def format_report(results, n_lines: int, n_refs: int, worst: list[dict[str, Any]]) -> str:
    """sacrebleu's own one-line format per metric (signature, score, BLEU details), then the worst lines."""
    out = [result.format(width=2, signature=signature) for _, result, signature in results]
    out.append(f"({n_lines} lines, {n_refs} reference{'s' if n_refs > 1 else ''})")
    if worst:
        out.append(f"\n{len(worst)} lowest sentence-BLEU:")
        for row in worst:
            out.append(f"line {row['line']}  sentence-BLEU {row['bleu']:.2f}")
            out.append(f"  hyp: {row['hyp']}")
            for k, ref in enumerate(row["refs"]):
                out.append(f"  ref{'' if len(row['refs']) == 1 else k + 1}: {ref}")
    return "\n".join(out)


def _check_options(hyp, checkpoint, src, output_hyp, worst: int) -> None:
    if (hyp is None) == (checkpoint is None):
        raise MtrainError("pass exactly one of --hyp FILE (score it) or --checkpoint FILE --src FILE (translate, then score)")
    if checkpoint is not None and src is None:
        raise MtrainError("--checkpoint needs --src: the source file to translate")
    if hyp is not None and (src is not None or output_hyp is not None):
        raise MtrainError("--src and --output-hyp apply only with --checkpoint; drop them or use --checkpoint")
    if worst < 0:
        raise MtrainError(f"--worst {worst}: must be 0 or a positive number of lines")


def _hypotheses(hyp, checkpoint, src, output_hyp, decode, device, ref_lines, ref_names) -> tuple[list[str], str]:
    """(hypothesis lines, name for messages): read --hyp, or translate --src with the checkpoint."""
    if hyp is not None:
        return read_lines(hyp), str(hyp)
    src_lines = read_lines(src)
    check_line_counts(src_lines, ref_lines, str(src), ref_names)  # fail before a long translation
    hyps = _translate(checkpoint, src_lines, dataclasses.replace(decode, nbest=1), device)
    if output_hyp is not None:
        write_lines_atomic(hyps, output_hyp)  # before scoring: keep the translations whatever happens
    return hyps, f"translations of {src}"


def run_eval(hyp: Path | None, refs: list[Path], checkpoint: Path | list[Path] | None, src: Path | None,
             output_hyp: Path | None, decode, lowercase: bool = False, tokenize: str | None = None,
             worst: int = 0, as_json: bool = False, device: str = "auto") -> dict[str, Any]:
    """`mtrain eval`: score a hypothesis file, or translate --src with a checkpoint (several: an
    ensemble) and score that.

    Prints the metrics with signatures (or one JSON object with --json) on stdout; returns the dict."""
    _check_options(hyp, checkpoint, src, output_hyp, worst)
    ref_lines = [read_lines(path) for path in refs]
    ref_names = [str(path) for path in refs]
    _metrics(lowercase, tokenize)  # an unknown --tokenize fails now, not after translating
    hyps, hyp_name = _hypotheses(hyp, checkpoint, src, output_hyp, decode, device, ref_lines, ref_names)
    check_line_counts(hyps, ref_lines, hyp_name, ref_names)
    warn_markers(hyps, hyp_name)
    results = _corpus_scores(hyps, ref_lines, lowercase, tokenize)
    summary = _as_dict(results, len(hyps))
    rows = worst_sentences(hyps, ref_lines, worst, lowercase, tokenize) if worst else []
    if rows:
        summary["worst"] = rows
    if as_json:
        print(json.dumps(summary, ensure_ascii=False))
    else:
        print(format_report(results, len(hyps), len(ref_lines), rows))
    return summary
