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
from mtrain.search import Decoder, Sampling, beam_search, greedy_search, sample, stream_key
from mtrain.tokenizer import EOS_ID, PAD_ID, Tokenizer

CHUNK_LINES = 2000  # lines read, translated and written at a time: memory stays bounded on big inputs
# Everything str.splitlines() breaks on: a translation must never add a line to the output.
LINE_BREAKS = re.compile("[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")

Hypotheses = list[list[tuple[str, float]]]  # per input line, the n-best (text, score), best first


def check_decode(decode: DecodeConfig) -> None:
    """One-line errors for settings that cannot work (before any model is loaded)."""
    problems = [
        (decode.beam < 1, f"--beam {decode.beam}: must be at least 1"),
        (decode.sample and decode.nbest < 1, f"--nbest {decode.nbest}: must be at least 1"),
        (not decode.sample and not 1 <= decode.nbest <= decode.beam,
         f"--nbest {decode.nbest}: must be between 1 and --beam ({decode.beam})"),
        (decode.topk < 0, f"--topk {decode.topk}: must be at least 1 (0 in a config: no limit)"),
        (not 0.0 < decode.topp <= 1.0, f"--topp {decode.topp}: must be in (0, 1]"),
        (decode.temperature <= 0.0, f"--temperature {decode.temperature}: must be above 0"),
        (decode.no_repeat_ngram < 0, f"--no-repeat-ngram {decode.no_repeat_ngram}: must be 0 (off) or more"),
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


def _search(model: Decoder, src: torch.Tensor, max_len: torch.Tensor, decode: DecodeConfig,
            prefixes: list[list[int]] | None, lines: list[int]) -> list[list[tuple[list[int], float]]]:
    """decode.nbest (ids, score) per row: beam search, sampling, or greedy search (score 0.0).
    lines: each row's line number in the whole input, which picks its sampling streams."""
    if decode.sample:
        n = decode.nbest
        streams = [stream_key(decode.seed, line, k) for line in lines for k in range(n)]
        drawn = sample(model, src.repeat_interleave(n, 0), max_len.repeat_interleave(n), _sampling(decode), streams,
                       None if prefixes is None else [p for p in prefixes for _ in range(n)], decode.no_repeat_ngram)
        return [drawn[i * n : (i + 1) * n] for i in range(len(lines))]
    if decode.beam == 1:  # nbest is 1 here (check_decode)
        return [[(ids, 0.0)] for ids in greedy_search(model, src, max_len, prefixes, decode.no_repeat_ngram)]
    return beam_search(model, src, decode.beam, decode.lenpen, max_len, decode.nbest, prefixes, decode.no_repeat_ngram)


def _sampling(decode: DecodeConfig) -> Sampling:
    return Sampling(topk=decode.topk, topp=decode.topp, temperature=decode.temperature)


def translate_nbest(model: Decoder, tokenizer: Tokenizer, lines: list[str], decode: DecodeConfig, device: torch.device | str,
                    stats: dict[str, Any] | None = None, bar=None, prefixes: list[str] | None = None,
                    first_line: int = 0) -> tuple[Hypotheses, int]:
    """The n-best (text, score) of each line in input order, and the number of lines cut to the
    model's max_len. prefixes[i] (raw target text; "" = none) starts line i's translation.
    first_line: the number of lines[0] in the whole input (sampling draws by line number, so
    samples do not depend on how the input is cut into chunks and batches). Empty and
    whitespace-only lines get `decode.nbest` translations that are just their prefix (score 0.0)
    without running the model."""
    check_decode(decode)
    device = torch.device(device)
    ids = tokenizer.src.encode([line if line.strip() else "" for line in lines])
    forced = tokenizer.tgt.encode(prefixes) if prefixes is not None else None
    limit = model.cfg.max_len - 1  # room for EOS
    n_cut = sum(len(seq) > limit for seq in ids)
    ids = [seq[:limit] for seq in ids]
    bare = tokenizer.tgt.decode(forced) if forced is not None else [""] * len(lines)
    results: Hypotheses = [[(LINE_BREAKS.sub(" ", text), 0.0)] * decode.nbest for text in bare]
    todo = [i for i, seq in enumerate(ids) if seq]
    slope = length_slope(decode, stats)
    for batch in decode_batches([len(ids[i]) for i in todo], decode.max_tokens):
        rows = [todo[j] for j in batch]
        src = pad_sources([ids[i] for i in rows], device)
        src_len = torch.tensor([len(ids[i]) for i in rows], dtype=torch.float64)
        max_len = (slope * src_len + decode.max_len_b).floor().long()
        row_prefixes = None if forced is None else [forced[i] for i in rows]
        hyps = _search(model, src, max_len, decode, row_prefixes, [first_line + i for i in rows])
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


def count_lines(path: str | Path) -> int:
    """Lines as read_chunks sees them (a last line without a newline counts), read in blocks."""
    count, last = 0, b"\n"
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            count, last = count + block.count(b"\n"), block[-1:]
    return count + (last != b"\n")


def check_parallel(name: str, path: str, input: str) -> None:
    """A file that must have one line per input line (prefixes, targets) has as many as the input
    (checked before any output when the input is a file; stdin is checked as it streams)."""
    if not Path(path).is_file():
        raise MtrainError(f"{path}: {name} file not found; pass an existing text file")
    if input != "-" and Path(input).is_file() and (n := count_lines(path)) != (m := count_lines(input)):
        raise MtrainError(f"{path}: {n} line{'s' * (n != 1)} but {input} has {m}; give one {name} line per input line "
                          "(an empty line for none)")


def paired_chunks(chunks: Iterator[list[str]], other: Iterator[list[str]] | None, other_name: str,
                  input_name: str) -> Iterator[tuple[list[str], list[str] | None]]:
    """Chunks of the input with the same lines of a parallel file (both read with the same size)."""
    for lines in chunks:
        mate = None if other is None else next(other, [])
        if mate is not None and len(mate) != len(lines):
            raise MtrainError(f"{other_name}: fewer lines than {input_name}; give one line per input line")
        yield lines, mate
    if other is not None and next(other, None) is not None:
        raise MtrainError(f"{other_name}: more lines than {input_name}; give one line per input line")


def translate_file(checkpoints: str | Path | list[str | Path], input: str, output: str, decode: DecodeConfig,
                   device: str = "auto", prefix: str | None = None) -> None:
    """`mtrain translate`: stream `input` (a path or - for stdin) in chunks and write exactly one
    line per input line (nbest lines with --nbest) to `output` (- for stdout). A named output is
    written to a temp file in its folder and renamed at the end: an error leaves no half file.
    Several checkpoints decode as an ensemble (mtrain.ensemble). `prefix`: a file whose line i
    starts line i's translation."""
    check_decode(decode)
    if prefix is not None:
        check_parallel("prefix", prefix, input)
    resolved = resolve_device(device)
    with open_input(input) as (handle, name, interactive), contextlib.ExitStack() as stack:
        model, tokenizer, ckpt = load_models(checkpoints, resolved)
        stats = ckpt.get("stats") or None
        # Typed lines are answered one at a time; files and pipes go in chunks with a progress bar.
        size = 1 if interactive else CHUNK_LINES
        prefixes = None if prefix is None else read_chunks(stack.enter_context(open(prefix, "rb")), prefix, size)
        n_cut = done = 0
        with atomic_output(output) as sink, tqdm(unit=" lines", file=sys.stderr, disable=interactive, leave=False) as bar:
            for lines, starts in paired_chunks(read_chunks(handle, name, size), prefixes, str(prefix), name):
                results, cut = translate_nbest(model, tokenizer, lines, decode, resolved, stats, bar, starts, done)
                sink.write(format_lines(results, done, decode.nbest))
                sink.flush()
                n_cut, done = n_cut + cut, done + len(lines)
        warn_cut(n_cut, model.cfg.max_len)
