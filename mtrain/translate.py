"""Text in, text out: tokenize, sort by length, batch by a source-token budget, search, restore the
input order, detokenize; and `mtrain translate`'s streaming, line-aligned, atomic file handling."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
from pathlib import Path
from typing import IO, Any, Iterator

import torch

from tqdm import tqdm

from mtrain.atomic import atomic_write
from mtrain.checkpoint import load_models
from mtrain.config import DecodeConfig
from mtrain.data import make_batches
from mtrain.errors import MtrainError
from mtrain.hardware import resolve_device
from mtrain.search import Decoder, beam_search, greedy_search
from mtrain.tokenizer import EOS_ID, PAD_ID, Tokenizer

CHUNK_LINES = 2000  # lines read, translated and written at a time: memory stays bounded on big inputs
# Everything str.splitlines() breaks on: a translation must never add a line to the output.
LINE_BREAKS = re.compile("[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")

Hypotheses = list[list[tuple[str, float]]]  # per input line, the n-best (text, score), best first


def check_decode(decode: DecodeConfig) -> None:
    """One-line errors for settings that cannot work (before any model is loaded)."""
    problems = [
        (decode.beam < 1, f"--beam {decode.beam}: must be at least 1"),
        (not 1 <= decode.nbest <= decode.beam, f"--nbest {decode.nbest}: must be between 1 and --beam ({decode.beam})"),
        (decode.max_len_a < 0, f"--max-len-a {decode.max_len_a}: must not be negative"),
        (decode.max_len_b < 0, f"--max-len-b {decode.max_len_b}: must not be negative"),
        (decode.max_tokens < 1, f"--max-tokens {decode.max_tokens}: must be at least 1"),
    ]
    for bad, message in problems:
        if bad:
            raise MtrainError(f"{message}; fix the option (or decode.* in the config)")


def length_slope(decode: DecodeConfig, stats: dict[str, Any] | None) -> float:
    """`a` of the maximum output length a * src_len + b. The training data's tgt/src token ratio
    (stats.json) can only raise it, to mean + 2 std, so a pair whose target side is longer in
    tokens is not cut short."""
    ratio = (stats or {}).get("tgt_src_ratio") or {}
    if "mean" in ratio:
        return max(decode.max_len_a, float(ratio["mean"]) + 2.0 * float(ratio.get("std", 0.0)))
    return decode.max_len_a


def decode_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped by length, longest batch first, so that each batch's padded source
    (sentences x (longest + EOS)) stays within max_tokens; a longer sentence goes alone.
    The training batcher's rule, unshuffled: decoding needs no (seed, epoch) order."""
    batches = make_batches(lengths, lengths, max_tokens, seed=0, epoch=0, shuffle=False, allow_oversize=True)
    return [batch[::-1].tolist() for batch in reversed(batches)]


def pad_sources(seqs: list[list[int]], device: torch.device) -> torch.Tensor:
    src = torch.full((len(seqs), max(map(len, seqs)) + 1), PAD_ID, dtype=torch.long)
    for row, ids in enumerate(seqs):
        src[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        src[row, len(ids)] = EOS_ID
    return src.to(device)


def _search(model: Decoder, src: torch.Tensor, max_len: torch.Tensor, decode: DecodeConfig) -> list[list[tuple[list[int], float]]]:
    if decode.beam == 1:  # greedy has no scores; nbest is 1 here (check_decode)
        return [[(ids, 0.0)] for ids in greedy_search(model, src, max_len)]
    return beam_search(model, src, decode.beam, decode.lenpen, max_len, nbest=decode.nbest)


def translate_nbest(model: Decoder, tokenizer: Tokenizer, lines: list[str], decode: DecodeConfig, device: torch.device | str,
                    stats: dict[str, Any] | None = None, bar=None) -> tuple[Hypotheses, int]:
    """The n-best (text, score) of each line in input order, and the number of lines cut to the
    model's max_len. Empty and whitespace-only lines get `decode.nbest` empty translations (score
    0.0) without running the model."""
    check_decode(decode)
    device = torch.device(device)
    ids = tokenizer.src.encode([line if line.strip() else "" for line in lines])
    limit = model.cfg.max_len - 1  # room for EOS
    n_cut = sum(len(seq) > limit for seq in ids)
    ids = [seq[:limit] for seq in ids]
    results: Hypotheses = [[("", 0.0)] * decode.nbest for _ in lines]
    todo = [i for i, seq in enumerate(ids) if seq]
    slope = length_slope(decode, stats)
    for batch in decode_batches([len(ids[i]) for i in todo], decode.max_tokens):
        rows = [todo[j] for j in batch]
        src = pad_sources([ids[i] for i in rows], device)
        src_len = torch.tensor([len(ids[i]) for i in rows], dtype=torch.float64)
        max_len = (slope * src_len + decode.max_len_b).floor().long()
        hyps = _search(model, src, max_len, decode)
        texts = tokenizer.tgt.decode([h for nbest in hyps for h, _ in nbest])
        for k, i in enumerate(rows):
            chunk = texts[k * decode.nbest : (k + 1) * decode.nbest]
            results[i] = [(LINE_BREAKS.sub(" ", text), score) for text, (_, score) in zip(chunk, hyps[k])]
        if bar is not None:
            bar.update(len(rows))
    if bar is not None:
        bar.update(len(lines) - len(todo))
    return results, n_cut


def warn_cut(n_cut: int, max_len: int) -> None:
    if n_cut:
        print(f"warning: {n_cut} input line(s) longer than the model's max_len ({max_len} tokens) were cut to fit",
              file=sys.stderr)


def translate_lines(model: Decoder, tokenizer: Tokenizer, lines: list[str], decode: DecodeConfig, device: torch.device | str,
                    stats: dict[str, Any] | None = None, progress: bool = False) -> list[str]:
    """Detokenized best translations, one per input line, in input order (empty lines stay empty).
    `stats` is the checkpoint's stats.json (see length_slope); `progress` shows tqdm on stderr."""
    one_best = dataclasses.replace(decode, nbest=1)
    with tqdm(total=len(lines), unit=" lines", file=sys.stderr, disable=not progress, leave=False) as bar:
        results, n_cut = translate_nbest(model, tokenizer, lines, one_best, device, stats, bar)
    warn_cut(n_cut, model.cfg.max_len)
    return [nbest[0][0] for nbest in results]


def translate_checkpoints(checkpoints: str | Path | list[str | Path], lines: list[str], decode: DecodeConfig,
                          device: str = "auto") -> list[str]:
    """The best translation of each line by a checkpoint (several: an ensemble), with a progress bar."""
    check_decode(decode)
    resolved = resolve_device(device)
    model, tokenizer, ckpt = load_models(checkpoints, resolved)
    return translate_lines(model, tokenizer, lines, decode, resolved, stats=ckpt.get("stats") or None, progress=True)


# --- files -------------------------------------------------------------------------------------

def read_chunks(handle: IO[bytes], name: str, size: int) -> Iterator[list[str]]:
    """Lines (without their newline) in lists of `size`; invalid UTF-8 names the line."""
    chunk: list[str] = []
    for number, raw in enumerate(handle, 1):
        try:
            chunk.append(raw.decode("utf-8").rstrip("\r\n"))
        except UnicodeDecodeError as err:
            raise MtrainError(f"{name}:{number}: invalid UTF-8 (byte {err.start + 1} of the line); "
                              "re-encode the input as UTF-8, e.g. iconv -f latin1 -t utf-8") from None
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def format_lines(results: Hypotheses, first_index: int, nbest: int) -> str:
    """One line per input, or with nbest > 1, `index<TAB>score<TAB>translation` lines (index from 0)."""
    if nbest == 1:
        return "".join(f"{hyps[0][0]}\n" for hyps in results)
    return "".join(f"{first_index + k}\t{score:.4f}\t{text}\n"
                   for k, hyps in enumerate(results) for text, score in hyps)


@contextlib.contextmanager
def open_input(input: str) -> Iterator[tuple[IO[bytes], str, bool]]:
    """(binary handle, name for messages, interactive?) for a path or - (stdin)."""
    if input == "-":
        yield sys.stdin.buffer, "<stdin>", sys.stdin.isatty()
        return
    path = Path(input)
    if not path.is_file():
        raise MtrainError(f"{path}: input file not found; pass an existing text file or - for stdin")
    with open(path, "rb") as handle:
        yield handle, str(path), False


@contextlib.contextmanager
def atomic_output(output: str) -> Iterator[IO[str]]:
    """stdout for -, else a temp file in the target's folder renamed over it only on success."""
    if output == "-":
        yield sys.stdout
        return
    with atomic_write(output) as sink:
        yield sink


def translate_file(checkpoints: str | Path | list[str | Path], input: str, output: str, decode: DecodeConfig,
                   device: str = "auto") -> None:
    """`mtrain translate`: stream `input` (a path or - for stdin) in chunks and write exactly one
    line per input line (nbest lines with --nbest) to `output` (- for stdout). A named output is
    written to a temp file in its folder and renamed at the end: an error leaves no half file.
    Several checkpoints decode as an ensemble (mtrain.ensemble)."""
    check_decode(decode)
    resolved = resolve_device(device)
    with open_input(input) as (handle, name, interactive):
        model, tokenizer, ckpt = load_models(checkpoints, resolved)
        stats = ckpt.get("stats") or None
        # Typed lines are answered one at a time; files and pipes go in chunks with a progress bar.
        size = 1 if interactive else CHUNK_LINES
        n_cut = done = 0
        with atomic_output(output) as sink, tqdm(unit=" lines", file=sys.stderr, disable=interactive, leave=False) as bar:
            for lines in read_chunks(handle, name, size):
                results, cut = translate_nbest(model, tokenizer, lines, decode, resolved, stats, bar)
                sink.write(format_lines(results, done, decode.nbest))
                sink.flush()
                n_cut, done = n_cut + cut, done + len(lines)
        warn_cut(n_cut, model.cfg.max_len)
