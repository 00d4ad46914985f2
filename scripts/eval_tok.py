"""Lowercase + Moses-tokenize detokenized hypotheses the way Multi30k's task1-tokenize.sh made its
`tok/*.lc.norm.tok.*` files (lowercase.perl | normalize-punctuation.perl -l L | tokenizer.perl -l L),
so `mtrain eval --lowercase --tokenize none` compares with papers that report tokenized BLEU.

    python scripts/eval_tok.py --lang en < test2016.hyp > test2016.hyp.lc.tok
"""

from __future__ import annotations

import argparse
import sys
from typing import Iterable


def moses_lc_tokenize(lines: Iterable[str], lang: str) -> list[str]:
    """Each line lowercased, punctuation-normalized and Moses-tokenized (with tokenizer.perl's
    default XML escaping, e.g. ' -> &apos;, as in the reference files). Needs sacremoses."""
    try:
        from sacremoses import MosesPunctNormalizer, MosesTokenizer
    except ImportError:
        sys.exit("eval_tok.py: sacremoses is not installed; pip install sacremoses (see benchmarks/requirements.txt)")
    normalizer, tokenizer = MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)
    # Lowercase first, as task1-tokenize.sh does: normalization and tokenization see lowercased text.
    return [tokenizer.tokenize(normalizer.normalize(line.lower()), return_str=True, escape=True).strip()
            for line in lines]


def split_lines(text: str) -> list[str]:
    """Lines split on \n only (str.splitlines would also split at U+2028 and friends and so change
    the line count); a final newline ends the last line, CRLF endings lose their \r."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lang", required=True, help="language code of the text (en, de, ...)")
    parser.add_argument("--input", default="-", help="detokenized text, one sentence a line (- = stdin)")
    parser.add_argument("--output", default="-", help="where the tokenized lines go (- = stdout)")
    args = parser.parse_args(argv)
    if args.input == "-":
        lines = split_lines(sys.stdin.read())
    else:
        with open(args.input, encoding="utf-8") as handle:
            lines = split_lines(handle.read())
    text = "".join(line + "\n" for line in moses_lc_tokenize(lines, args.lang))
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(text)


if __name__ == "__main__":
    main()
