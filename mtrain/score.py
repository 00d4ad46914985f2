"""`mtrain score`: the model's teacher-forced log-probability of given translations, log p(y | x)
with y's EOS, one line per sentence pair (to filter a noisy corpus, or rerank n-best lists). For
an ensemble it is the log of the mean of the members' probabilities, token by token, the
distribution ensemble decoding searches. Batched and streamed like `mtrain translate`."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from mtrain import search
from mtrain.checkpoint import load_models
from mtrain.data import Ragged, Split, collate, to_ragged_arrays
from mtrain.hardware import resolve_device
from mtrain.search import Decoder
from mtrain.tokenizer import PAD_ID, Tokenizer
from mtrain.translate import (CHUNK_LINES, atomic_output, char_cap, check_parallel, decode_batches, encode_capped,
                              open_input, paired_chunks, read_chunks, warn_cut)


def pairs_split(src_ids: list[list[int]], tgt_ids: list[list[int]]) -> Split:
    """Encoded pairs as a Split with no text behind it, so that mtrain.data.collate lays them out
    exactly as training does (src + EOS, BOS + tgt, tgt + EOS): score is the training NLL."""
    return Split("pairs", Ragged(*to_ragged_arrays(src_ids)), Ragged(*to_ragged_arrays(tgt_ids)), Path())


@torch.inference_mode()
def score_batch(model: Decoder, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> list[float]:
    """Summed log-probabilities of each row's target tokens (PAD positions excluded), float64 sums."""
    real = (tgt_out != PAD_ID).nonzero(as_tuple=True)  # (rows, positions) of the real target tokens
    logp = torch.cat([block.gather(1, target[:, None]).squeeze(1) - torch.logsumexp(block, dim=1)
                      for block, target in real_logits(model, src, tgt_in, tgt_out[real], real)])
    sums = torch.zeros(len(tgt_out), dtype=torch.float64, device=tgt_out.device)
    return sums.index_add_(0, real[0], logp.double()).tolist()


def real_logits(model: Decoder, src: torch.Tensor, tgt_in: torch.Tensor, target: torch.Tensor,
                real: tuple[torch.Tensor, torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(float32 logits, targets) of the real positions, a block of rows at a time. A model with
    decode_states and project (Transformer, Ensemble) runs its decoder once and projects only the real
    positions, a few MB at a time (search.BLOCK_BYTES), as searches do; any other, all of decode's
    logits. One tall projection of a whole batch (4096 x 8000 float32 logits) wrote 131 MB that the
    log-softmax then read back from memory, and MKL ran that tall matmul at half the speed of the same
    rows in blocks (AVX2 EPYC, benchmarks/results/NOTES.md)."""
    if not search.projects_in_blocks(model):
        yield model.decode(tgt_in, model.encode(src), src)[real].float(), target
        return
    states = model.decode_states(tgt_in, model.encode(src), src)[real]  # (N, d_model), or one per member
    for first, logits in search.projected_blocks(model, states):
        yield logits.float(), target[first : first + len(logits)]


def encode_pairs(tokenizer: Tokenizer, sources: list[str], targets: list[str],
                 max_len: int) -> tuple[list[list[int]], list[list[int]], Counter[str]]:
    """Source and target ids, both sides cut to max_len - 1 tokens as translate cuts its input (a
    longer target would cost attention over all of it), and the lines cut per side."""
    src_ids, src_cut = encode_capped(tokenizer.src, sources, max_len)
    tgt_ids, tgt_cut = encode_capped(tokenizer.tgt, targets, max_len)
    return src_ids, tgt_ids, Counter(source=src_cut, target=tgt_cut)


def score_pairs(model: Decoder, tokenizer: Tokenizer, sources: list[str], targets: list[str], max_tokens: int,
                device: torch.device | str, bar=None) -> tuple[list[tuple[float, int]], int]:
    """(log p(target | source), scored tokens with EOS) per pair, in input order, and the number of
    lines (sources and targets) cut to the model's max_len. An empty target scores its EOS."""
    src_ids, tgt_ids, cuts = encode_pairs(tokenizer, sources, targets, model.cfg.max_len)
    return score_ids(model, src_ids, tgt_ids, max_tokens, device, bar), sum(cuts.values())


def score_ids(model: Decoder, src_ids: list[list[int]], tgt_ids: list[list[int]], max_tokens: int,
              device: torch.device | str, bar=None) -> list[tuple[float, int]]:
    """score_pairs on encoded pairs."""
    device, split = torch.device(device), pairs_split(src_ids, tgt_ids)
    results: list[tuple[float, int]] = [(0.0, 0)] * len(src_ids)
    for rows in decode_batches([max(len(s), len(t)) for s, t in zip(src_ids, tgt_ids)], max_tokens):
        src, tgt_in, tgt_out = collate(split, rows, device=device)
        for i, total in zip(rows, score_batch(model, src, tgt_in, tgt_out)):
            results[i] = (total, len(tgt_ids[i]) + 1)
        if bar is not None:
            bar.update(len(rows))
    return results


def format_scores(results: list[tuple[float, int]], as_json: bool) -> str:
    """`total<TAB>tokens<TAB>mean` lines, or one JSON object a line."""
    if as_json:
        return "".join(json.dumps({"logprob": total, "tokens": n, "mean_logprob": total / n}) + "\n"
                       for total, n in results)
    return "".join(f"{total:.6f}\t{n}\t{total / n:.6f}\n" for total, n in results)


def score_file(checkpoints: str | Path | list[str | Path], src: str, tgt: str, output: str, max_tokens: int,
               as_json: bool = False, device: str = "auto") -> None:
    """`mtrain score`: stream the two files in chunks, one output line per pair; a named output is
    written atomically (an error leaves no half file)."""
    check_parallel("target", tgt, src)
    resolved = resolve_device(device)
    with open_input(src) as (handle, name, _), open(tgt, "rb") as targets:
        model, tokenizer, _ = load_models(checkpoints, resolved)
        max_len = model.cfg.max_len
        cuts: Counter[str] = Counter()
        with atomic_output(output) as sink, tqdm(unit=" pairs", file=sys.stderr, leave=False) as bar:
            pairs = paired_chunks(read_chunks(handle, name, CHUNK_LINES, char_cap(max_len)),
                                  read_chunks(targets, tgt, CHUNK_LINES, char_cap(max_len)), tgt, name)
            for sources, lines in pairs:
                src_ids, tgt_ids, cut = encode_pairs(tokenizer, sources, lines, max_len)
                sink.write(format_scores(score_ids(model, src_ids, tgt_ids, max_tokens, resolved, bar), as_json))
                sink.flush()
                cuts += cut
        warn_cut(cuts, max_len)
