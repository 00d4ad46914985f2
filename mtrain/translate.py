"""Text in, text out: tokenize, sort by length, batch by a source-token budget, search, restore the
input order, detokenize; and `mtrain translate`'s streaming, line-aligned, atomic file handling."""

from __future__ import annotations

import codecs
import contextlib
import copy
import dataclasses
import itertools
import re
import sys
from collections import Counter
from pathlib import Path
from typing import IO, Any, Iterator, Protocol, runtime_checkable

import torch
from torch import nn

from tqdm import tqdm

from mtrain.atomic import atomic_write
from mtrain.checkpoint import checkpoint_paths, checkpoint_tokenizer, load_models, read_ensemble
from mtrain.config import DecodeConfig, config_from_dict
from mtrain.data import make_batches
from mtrain.errors import MtrainError
from mtrain.hardware import decode_autocast, resolve_amp, resolve_device
from mtrain.cpu.quantize import bfloat16_weights, check_quantize, quantize_int8
from mtrain.search import Decoder, Sampling, beam_search, greedy_search, sample, stream_key, weights_dtype
from mtrain.tokenizer import EOS_ID, PAD_ID, Side, Tokenizer
from mtrain.cpu import cache as cpu_cache
from mtrain.cpu.workers import DecodingPool

CHUNK_LINES = 2000  # lines read, translated and written at a time: memory stays bounded on big inputs
# Characters of one line that reach SentencePiece, per token of the model's max_len. A piece is at
# most 16 characters (SentencePiece's max_sentencepiece_length, which mtrain's tokenizer training
# keeps), so the max_len - 1 tokens that survive the cut cover at most 16 * (max_len - 1)
# characters of normalized text, and pieces never span a space, so cutting a later word cannot
# change the pieces of earlier ones. Normalization shrinks text only by collapsing runs of
# whitespace and dropping invisible characters (zero-width spaces, direction marks); 64 leaves
# room for 48 of those per token before the cut could reach a surviving token, far more than
# text has. A 10 MB line then costs what a long sentence costs.
CHARS_PER_TOKEN = 64
READ_BLOCK = 1 << 20  # bytes read at a time from the dropped rest of an overlong line
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
        (decode.workers < 1, f"--workers {decode.workers}: must be at least 1"),
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


@runtime_checkable
class Engine(Protocol):
    """A model that runs its own search (an exported CTranslate2 folder: mtrain.export.runtime)."""

    def search(self, src: torch.Tensor, max_len: torch.Tensor, decode: DecodeConfig,
               prefixes: list[list[int]] | None) -> list[list[tuple[list[int], float]]]: ...


def load_for_decoding(paths: str | Path | list[str | Path], device: torch.device, decode: DecodeConfig | None = None):
    """(model, tokenizer, checkpoint dict) for checkpoints (several: an ensemble), or for one folder
    written by `mtrain export --format ctranslate2`. With decode.quantize=int8 the checkpoints'
    linear layers are made int8 (mtrain.cpu.quantize)."""
    paths = checkpoint_paths(paths)
    decode = decode or DecodeConfig()
    if _exported(paths, decode, device):
        from mtrain.export.runtime import SATURATION_NOTE, CTranslate2Model, int8_saturates, is_int8

        engine = CTranslate2Model(paths[0], device)
        if device.type == "cpu" and is_int8(engine.meta.get("quantization")) and int8_saturates():
            print(f"note: {SATURATION_NOTE}", file=sys.stderr)  # the export's own report says it too
        return engine, engine.tokenizer, {"stats": engine.meta.get("stats") or {}}
    model, tokenizer, ckpt = load_models(paths, device)
    return decoding_model(model, decode, device), tokenizer, ckpt


def _exported(paths: list[str | Path], decode: DecodeConfig, device: torch.device) -> bool:
    """Whether paths name an exported folder (checked: alone, without decode.quantize), rather than
    checkpoint files; decode.quantize and decode.amp checked against the device."""
    check_quantize(decode.quantize, decode.amp, device)
    if not any(Path(p).is_dir() for p in paths):
        return False
    if len(paths) > 1:
        raise MtrainError(f"{next(p for p in paths if Path(p).is_dir())}: an exported folder decodes alone; "
                          "an ensemble needs mtrain checkpoint files")
    if decode.quantize != "off":
        raise MtrainError(f"{paths[0]}: an exported folder keeps the quantization it was exported with; "
                          "drop decode.quantize (or re-export with --quantization)")
    return True


@dataclasses.dataclass(frozen=True)
class Outline:
    """What the calling process of decoding workers keeps of a model: `cfg.max_len`, the input cut,
    read as from a model. The weights are the workers' alone."""

    cfg: Any


def load_outline(paths: str | Path | list[str | Path], device: torch.device, decode: DecodeConfig | None = None):
    """load_for_decoding's (model, tokenizer, checkpoint dict) for the calling process of decoding
    workers, with an Outline for the model: the files are read and checked as there (an ensemble's
    members against each other), but the weights are left in the files (memory-mapped, never read),
    no model is built, and a CTranslate2 folder is not loaded. With 2 workers the machine then holds
    two copies of the model, not three, and the workers' start does not wait for a third load."""
    from mtrain.export.runtime import Shape, ctranslate2_meta, read_tokenizer

    paths = checkpoint_paths(paths)
    decode = decode or DecodeConfig()
    if _exported(paths, decode, device):
        folder = Path(paths[0])
        meta = ctranslate2_meta(folder)
        return Outline(Shape(max_len=meta["max_len"])), read_tokenizer(folder, meta), {"stats": meta.get("stats") or {}}
    first = read_ensemble(paths, mmap=True)[0]
    config = config_from_dict(first["config"], where=str(paths[0]))
    ckpt = {key: value for key, value in first.items() if key not in ("model", "train_state")}  # no tensors kept
    return Outline(Shape(max_len=config.model.max_len)), checkpoint_tokenizer(paths[0], first), ckpt


def decoding_model(model: nn.Module, decode: DecodeConfig, device: torch.device,
                   keep_original: bool = False) -> nn.Module:
    """`model` in the precision decode.quantize and decode.amp ask for: int8 linear layers, bfloat16
    weights where that resolves to bfloat16, float32 otherwise; on a CPU, with the CPU's decoding
    caches (mtrain.cpu.cache). Changed in place, or with
    keep_original in a copy when it needs a change (validation goes on training its model)."""
    int8 = decode.quantize == "int8"
    bfloat16 = resolve_amp(decode.amp, device, key="decode.amp") == torch.bfloat16
    if keep_original and (int8 or bfloat16):
        model = copy.deepcopy(model)
    if int8:
        model = quantize_int8(model)
    if bfloat16:
        model = bfloat16_weights(model)
    return cpu_cache.for_decoding(model)


@dataclasses.dataclass
class BatchJob:
    """One batch to search: its sources' ids, the slope of their length limits, forced prefixes
    (or None) and line numbers (which pick sampling streams). Plain data, so a worker process
    (mtrain.cpu.workers) can be sent it."""

    sources: list[list[int]]
    slope: float
    prefixes: list[list[int]] | None
    lines: list[int]
    decode: DecodeConfig


def search_batch(model: Decoder | Engine, job: BatchJob, device: torch.device) -> list[list[tuple[list[int], float]]]:
    """decode.nbest (ids, score) per source of the job (_search), each with at most
    slope * its length + decode.max_len_b tokens."""
    decode = job.decode
    src = pad_sources(job.sources, device)
    src_len = torch.tensor([len(seq) for seq in job.sources], dtype=torch.float64)
    max_len = (job.slope * src_len + decode.max_len_b).floor().long()
    # decode.amp over float32 weights: autocast. Weights that decoding_model made bfloat16 need none.
    # Either way a caller's autocast (a training loop's) is switched off: the precision is decode's.
    bf16_weights = not isinstance(model, Engine) and weights_dtype(model) == torch.bfloat16
    with decode_autocast("off" if bf16_weights else decode.amp, device):
        return _search(model, src, max_len, decode, job.prefixes, job.lines)


def worker_model(checkpoints: list[str | Path], decode: DecodeConfig) -> Decoder | Engine:
    """A decoding process's model (mtrain.cpu.workers): what load_for_decoding gives on the CPU."""
    return load_for_decoding(checkpoints, torch.device("cpu"), decode)[0]


def worker_search(model: Decoder | Engine, job: BatchJob) -> list[list[tuple[list[int], float]]]:
    return search_batch(model, job, torch.device("cpu"))


def decoding_pool(checkpoints: str | Path | list[str | Path], decode: DecodeConfig,
                  device: torch.device) -> contextlib.AbstractContextManager:
    """decode.workers processes that search batches (mtrain.cpu.workers), or, for 1, nullcontext(None)."""
    if decode.workers == 1:
        return contextlib.nullcontext(None)
    if device.type != "cpu":
        raise MtrainError(f"decode.workers={decode.workers}: decoding processes share a CPU; on {device} use "
                          "decode.workers=1 (one process keeps the GPU busy)")
    return DecodingPool("mtrain.translate:worker_model", (checkpoint_paths(checkpoints), decode),
                        "mtrain.translate:worker_search",
                        decode.workers, torch.get_num_threads())


def open_decoding(checkpoints: str | Path | list[str | Path], decode: DecodeConfig, device: torch.device,
                  stack: contextlib.ExitStack) -> tuple[Decoder | Engine | Outline, Tokenizer, dict[str, Any], DecodingPool | None]:
    """(model, tokenizer, checkpoint dict, pool) to translate with: in one process the model
    (load_for_decoding) and no pool; with decode.workers > 1 an Outline (load_outline) and the
    workers' pool, closed with `stack`."""
    if decode.workers == 1:
        return (*load_for_decoding(checkpoints, device, decode), None)
    model, tokenizer, ckpt = load_outline(checkpoints, device, decode)
    return model, tokenizer, ckpt, stack.enter_context(decoding_pool(checkpoints, decode, device))


def _search(model: Decoder | Engine, src: torch.Tensor, max_len: torch.Tensor, decode: DecodeConfig,
            prefixes: list[list[int]] | None, lines: list[int]) -> list[list[tuple[list[int], float]]]:
    """decode.nbest (ids, score) per row: beam search, sampling, or greedy search (score 0.0).
    lines: each row's line number in the whole input, which picks its sampling streams."""
    if isinstance(model, Engine):
        return model.search(src, max_len, decode, prefixes)
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


def char_cap(max_len: int) -> int:
    """Characters of one line handed to SentencePiece for a model of this max_len (see CHARS_PER_TOKEN)."""
    return CHARS_PER_TOKEN * max_len


def encode_capped(side: Side, lines: list[str], max_len: int) -> tuple[list[list[int]], int]:
    """Ids of each line cut to max_len - 1 tokens (room for EOS), and the number of lines cut.
    Only the first char_cap(max_len) characters of a line are encoded (a longer line counts as
    cut); a line that is empty or whitespace there encodes as []."""
    cap, limit = char_cap(max_len), max_len - 1
    heads = [line[:cap] for line in lines]
    ids = side.encode([head if head.strip() else "" for head in heads])
    n_cut = sum(len(line) > cap or len(seq) > limit for line, seq in zip(lines, ids))
    return [seq[:limit] for seq in ids], n_cut


def translate_nbest(model: Decoder, tokenizer: Tokenizer, lines: list[str], decode: DecodeConfig, device: torch.device | str,
                    stats: dict[str, Any] | None = None, bar=None, prefixes: list[str] | None = None,
                    first_line: int = 0, pool: DecodingPool | None = None,
                    numbers: list[int] | None = None) -> tuple[Hypotheses, Counter[str]]:
    """The n-best (text, score) of each line in input order, and the number of lines cut to the
    model's max_len: {"input": n, "prefix": m}. prefixes[i] (raw target text; "" = none) starts
    line i's translation. first_line: the number of lines[0] in the whole input (sampling draws by
    line number, so samples do not depend on how the input is cut into chunks and batches). Empty
    and whitespace-only lines get `decode.nbest` translations that are just their prefix (score
    0.0) without running the model. pool: the batches are searched in its processes (decode.workers),
    each as `model` would search it here. numbers: each line's own number instead (lines gathered
    from several inputs, as a server's batches are)."""
    return start_translation(model, tokenizer, lines, decode, device, stats, bar, prefixes, first_line, pool,
                             numbers).finish()


@dataclasses.dataclass
class Translation:
    """Lines whose batches are being searched (start_translation); finish() collects them."""

    results: Hypotheses
    cuts: Counter[str]
    batches: list[list[int]]
    searched: Iterator[list[list[tuple[list[int], float]]]]  # each batch's hypotheses, in order
    tokenizer: Tokenizer
    nbest: int
    bar: Any
    untranslated: int  # empty lines, which need no search

    def finish(self) -> tuple[Hypotheses, Counter[str]]:
        """translate_nbest's (results, cuts), once every batch is searched."""
        for rows, hyps in zip(self.batches, self.searched):
            texts = self.tokenizer.tgt.decode([h for nbest in hyps for h, _ in nbest])
            for k, i in enumerate(rows):
                chunk = texts[k * self.nbest : (k + 1) * self.nbest]
                self.results[i] = [(LINE_BREAKS.sub(" ", text), score) for text, (_, score) in zip(chunk, hyps[k])]
            if self.bar is not None:
                self.bar.update(len(rows))
        if self.bar is not None:
            self.bar.update(self.untranslated)
        return self.results, self.cuts


def start_translation(model: Decoder | Engine | Outline, tokenizer: Tokenizer, lines: list[str], decode: DecodeConfig,
                      device: torch.device | str, stats: dict[str, Any] | None = None, bar=None,
                      prefixes: list[str] | None = None, first_line: int = 0,
                      pool: DecodingPool | None = None, numbers: list[int] | None = None) -> Translation:
    """translate_nbest up to the search: tokenized, batched, and with a pool its batches handed to
    the workers already (in this process they are searched when finish() asks for them). With a
    pool, `model` is read for its cfg.max_len only, so an Outline will do."""
    check_decode(decode)
    device = torch.device(device)
    ids, n_cut = encode_capped(tokenizer.src, lines, model.cfg.max_len)
    forced, n_forced_cut = (None, 0) if prefixes is None else encode_capped(tokenizer.tgt, prefixes, model.cfg.max_len)
    cuts = Counter(input=n_cut, prefix=n_forced_cut)
    bare = tokenizer.tgt.decode(forced) if forced is not None else [""] * len(lines)
    results: Hypotheses = [[(LINE_BREAKS.sub(" ", text), 0.0)] * decode.nbest for text in bare]
    todo = [i for i, seq in enumerate(ids) if seq]
    slope = length_slope(decode, stats)
    batches = [[todo[j] for j in batch] for batch in decode_batches([len(ids[i]) for i in todo], decode.max_tokens)]
    numbers = numbers if numbers is not None else range(first_line, first_line + len(lines))
    jobs = [BatchJob([ids[i] for i in rows], slope, None if forced is None else [forced[i] for i in rows],
                     [numbers[i] for i in rows], decode) for rows in batches]
    searched = pool.results(pool.submit(jobs)) if pool is not None else (search_batch(model, job, device) for job in jobs)
    return Translation(results, cuts, batches, searched, tokenizer, decode.nbest, bar, len(lines) - len(todo))


def warn_cut(cuts: Counter[str], max_len: int) -> None:
    """One warning line for all the lines cut, by kind: '3 input line(s) and 1 prefix line(s) ...'."""
    counts = [f"{n} {kind} line(s)" for kind, n in cuts.items() if n]
    if counts:
        print(f"warning: {' and '.join(counts)} longer than the model's max_len ({max_len} tokens) were cut to fit",
              file=sys.stderr)


def translate_lines(model: Decoder, tokenizer: Tokenizer, lines: list[str], decode: DecodeConfig, device: torch.device | str,
                    stats: dict[str, Any] | None = None, progress: bool = False,
                    pool: DecodingPool | None = None) -> list[str]:
    """Detokenized best translations, one per input line, in input order (empty lines stay empty).
    `stats` is the checkpoint's stats.json (see length_slope); `progress` shows tqdm on stderr;
    `pool` searches the batches in its processes."""
    one_best = dataclasses.replace(decode, nbest=1)
    with tqdm(total=len(lines), unit=" lines", file=sys.stderr, disable=not progress, leave=False) as bar:
        results, cuts = translate_nbest(model, tokenizer, lines, one_best, device, stats, bar, pool=pool)
    warn_cut(cuts, model.cfg.max_len)
    return [nbest[0][0] for nbest in results]


def translate_checkpoints(checkpoints: str | Path | list[str | Path], lines: list[str], decode: DecodeConfig,
                          device: str = "auto") -> list[str]:
    """The best translation of each line by a checkpoint (several: an ensemble), with a progress bar."""
    check_decode(decode)
    resolved = resolve_device(device)
    with contextlib.ExitStack() as stack:
        model, tokenizer, ckpt, pool = open_decoding(checkpoints, decode, resolved, stack)
        return translate_lines(model, tokenizer, lines, decode, resolved, stats=ckpt.get("stats") or None,
                               progress=True, pool=pool)


# --- files -------------------------------------------------------------------------------------

def stream_lines(handle: IO[bytes], name: str, max_chars: int | None = None) -> Iterator[str]:
    """Lines without their line end (split on "\\n" only); invalid UTF-8 names the line. With
    max_chars, a longer line keeps only its start, still more than max_chars characters (so it is
    cut, and counted, where it is encoded), and its rest is read in blocks, checked and dropped:
    memory stays bounded however long a line is (a file with CR line ends is one line)."""
    # UTF-8 takes at most 4 bytes a character: 4 * (max_chars + 1) bytes, less the bytes of a
    # character they cut in two, still hold more than max_chars characters.
    limit = -1 if max_chars is None else 4 * (max_chars + 1)
    for number in itertools.count(1):
        raw = handle.readline(limit)
        if not raw:
            return
        if raw.endswith(b"\n"):
            try:
                yield raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as err:
                raise invalid_utf8(name, number, err.start) from None
        else:  # the last line without a newline, or the start of an overlong line
            yield read_rest(handle, raw, name, number).rstrip("\r\n")


def read_rest(handle: IO[bytes], start: bytes, name: str, number: int) -> str:
    """`start` decoded (less a character cut in two at its end), after reading the rest of its line
    block by block through the same decoder, which checks the bytes it then drops."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    block, offset, text = start, 0, None
    while True:
        end = not block or block.endswith(b"\n")
        held = len(decoder.getstate()[0])  # bytes of a character begun in the previous block
        try:
            decoded = decoder.decode(block, final=end)
        except UnicodeDecodeError as err:
            raise invalid_utf8(name, number, offset - held + err.start) from None
        text = decoded if text is None else text
        if end:
            return text
        offset += len(block)
        block = handle.readline(READ_BLOCK)


def invalid_utf8(name: str, number: int, byte: int) -> MtrainError:
    return MtrainError(f"{name}:{number}: invalid UTF-8 (byte {byte + 1} of the line); "
                       "re-encode the input as UTF-8, e.g. iconv -f latin1 -t utf-8")


def read_chunks(handle: IO[bytes], name: str, size: int, max_chars: int | None = None) -> Iterator[list[str]]:
    """stream_lines' lines in lists of `size`."""
    lines = stream_lines(handle, name, max_chars)
    while chunk := list(itertools.islice(lines, size)):
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


def write_translation(sink: IO[str], translation: Translation, first: int, nbest: int) -> Counter[str]:
    """Collect a chunk's translations (numbered from line `first`), write them, return its cuts."""
    results, cuts = translation.finish()
    sink.write(format_lines(results, first, nbest))
    sink.flush()
    return cuts


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
        model, tokenizer, ckpt, pool = open_decoding(checkpoints, decode, resolved, stack)
        stats = ckpt.get("stats") or None
        # Typed lines are answered one at a time; files and pipes go in chunks with a progress bar.
        size = 1 if interactive else CHUNK_LINES
        cap = char_cap(model.cfg.max_len)
        prefixes = None if prefix is None else read_chunks(stack.enter_context(open(prefix, "rb")), prefix, size, cap)
        cuts: Counter[str] = Counter()
        done = 0
        # With workers, the next chunk's batches go to them before this one's are collected, so that
        # no worker waits at the end of a chunk; typed lines are answered before the next is read.
        ahead = pool is not None and not interactive
        with atomic_output(output) as sink, tqdm(unit=" lines", file=sys.stderr, disable=interactive, leave=False) as bar:
            waiting: list[tuple[Translation, int]] = []
            for lines, starts in paired_chunks(read_chunks(handle, name, size, cap), prefixes, str(prefix), name):
                waiting.append((start_translation(model, tokenizer, lines, decode, resolved, stats, bar, starts, done,
                                                  pool), done))
                done += len(lines)
                while len(waiting) > ahead:
                    cuts += write_translation(sink, *waiting.pop(0), decode.nbest)
            for translation, first in waiting:
                cuts += write_translation(sink, translation, first, decode.nbest)
        warn_cut(cuts, model.cfg.max_len)
