"""Search properties: exact beams and scores on a scripted model, beam 1 == greedy, cached ==
uncached decoding, batching invariance and maximum lengths on a small random Transformer."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import DEVICES
from mtrain import search
from mtrain.cache import KVCache
from mtrain.config import ModelConfig
from mtrain.hardware import cpu_has_native_bf16
from mtrain.cpu.ops import argmax_rows, topk_rows
from mtrain.reductions import logsumexp_
from mtrain.model import Transformer
from mtrain.search import (
    Sampling,
    beam_search,
    greedy_search,
    kept_rows,
    length_penalty,
    next_token_topk,
    sample,
    stream_key,
    topk_step,
)
from mtrain.tokenizer import BOS_ID, EOS_ID, PAD_ID

A, B_, C, D = 4, 5, 6, 7  # word ids of the scripted model
VOCAB = 8


class ScriptedCache:
    """The prefix generated so far per row; reorder is an index_select, as in the real cache.
    With group G, target row r belongs to source row r // G (as in mtrain.cache.BeamCache)."""

    def __init__(self, group: int) -> None:
        self.prefix: torch.Tensor | None = None
        self.length = 0
        self.group = group

    def reorder(self, index: torch.Tensor, cross: bool = True) -> None:
        self.prefix = self.prefix.index_select(0, index)

    def expand_beams(self, group: int) -> ScriptedCache:
        assert self.group == 1 and self.length == 1, "beam search expands after its one-row first step"
        self.prefix, self.group = self.prefix.repeat_interleave(group, 0), group
        return self


class ScriptedModel:
    """Next-token probabilities from a hand-written table keyed by (first source id, prefix).
    Unknown prefixes end the sentence (EOS with probability 1)."""

    def __init__(self, table: dict[tuple[int, tuple[int, ...]], dict[int, float]]) -> None:
        self.table = table

    def new_cache(self, group: int = 1) -> ScriptedCache:
        return ScriptedCache(group)

    def encode(self, src: torch.Tensor) -> torch.Tensor:
        return src.float().unsqueeze(-1)  # memory (B, S, 1): carries the sentence key

    def decode(self, tgt, memory, src, cache):
        assert tgt.shape[1] == 1, "search must feed only the newest token"
        assert memory.shape[0] == src.shape[0] == tgt.shape[0] // cache.group
        cache.prefix = tgt if cache.prefix is None else torch.cat([cache.prefix, tgt], dim=1)
        cache.length += 1
        logits = torch.full((tgt.shape[0], 1, VOCAB), float("-inf"))
        for row, prefix in enumerate(cache.prefix.tolist()):
            assert prefix[0] == BOS_ID
            probs = self.table.get((int(src[row // cache.group, 0]), tuple(prefix[1:])), {EOS_ID: 1.0})
            for token, p in probs.items():
                logits[row, 0, token] = math.log(p)
        return logits


# Sentence 4: "a" is the most probable first word, but "b c" wins once lengths are normalised.
TABLE = {
    (A, ()): {A: 0.5, B_: 0.3, EOS_ID: 0.2},
    (A, (A,)): {EOS_ID: 0.6, C: 0.4},
    (A, (B_,)): {C: 0.9, EOS_ID: 0.1},
    (A, (B_, C)): {EOS_ID: 1.0},
    (A, (A, C)): {EOS_ID: 0.6, D: 0.4},
    # Sentence 5: never wants to stop (EOS 0.1 each step), so only max_len ends it.
    **{(B_, (A,) * n): {A: 0.9, EOS_ID: 0.1} for n in range(20)},
}


def src_of(*keys: int) -> torch.Tensor:
    return torch.tensor([[key, EOS_ID] for key in keys])


def lp(length: int, alpha: float) -> float:
    return ((5 + length) / 6) ** alpha


def test_length_penalty_is_gnmt():
    assert length_penalty(1, 0.6).item() == pytest.approx(1.0)
    assert length_penalty(7, 1.0).item() == pytest.approx(2.0)
    assert length_penalty(torch.tensor([3, 13]), 0.5).tolist() == pytest.approx([(8 / 6) ** 0.5, 3 ** 0.5])
    assert length_penalty(9, 0.0).item() == 1.0


def test_topk_step_matches_brute_force():
    torch.manual_seed(0)
    scores, logprobs = torch.randn(3, 2), torch.randn(3, 2, 5)
    top, ids = logprobs.topk(4, dim=-1)  # each beam's 4 best of 5: enough for the best 3 overall
    values, parent, token = topk_step(scores, top, ids, 3)
    for b in range(3):
        every = sorted(((scores[b, k] + logprobs[b, k, v]).item(), k, v) for k in range(2) for v in range(5))[::-1]
        assert values[b].tolist() == pytest.approx([s for s, _, _ in every[:3]])
        assert list(zip(parent[b].tolist(), token[b].tolist())) == [(k, v) for _, k, v in every[:3]]


def awkward_rows(vocab: int) -> torch.Tensor:
    """(40, vocab) random logits with a row of -inf but one value, a maximum in the last column and
    a row of one value tied everywhere."""
    torch.manual_seed(vocab)
    x = torch.randn(40, vocab)
    x[1] = float("-inf")
    x[1, 3] = 0.5
    x[2, -1] = 100.0
    x[3, :] = x[3, 0]  # every value tied: any k columns are right, values must match
    return x


@pytest.mark.parametrize("vocab", [8000, 8001, 8063, 700, 30])
def test_topk_rows_equals_topk(vocab):
    # Chunked top-k against torch.topk: full chunks, a ragged last chunk, one-chunk-per-k and
    # plain-fallback sizes; rows with one finite value (EOS only), ties of -inf, and a maximum in
    # the ragged tail.
    x = awkward_rows(vocab)
    for k in (1, 6, 10):
        values, cols = topk_rows(x, k)
        ref_values, ref_cols = x.topk(k, dim=1)
        assert torch.equal(values, ref_values)
        assert torch.equal(x.gather(1, cols), values)  # the columns hold those values
        finite = ref_values.isfinite()
        assert torch.equal(cols[finite & (torch.arange(40) != 3)[:, None]], ref_cols[finite & (torch.arange(40) != 3)[:, None]])
        assert all(len(set(row)) == k for row in cols[[0, 2, 3]].tolist())  # no column twice


@pytest.mark.parametrize("vocab", [8000, 8001, 700, 30])
def test_argmax_rows_equals_argmax(vocab):
    # The first of equal maxima, as torch.argmax: ties within a chunk and across chunks, rows of -inf
    # but one value, a maximum in the last column; ragged and small vocabularies fall back to torch.
    x = awkward_rows(vocab)
    x[4, [5, 6, 300 % vocab]] = 50.0
    x[5] = torch.randint(0, 3, (vocab,)).float()
    assert torch.equal(argmax_rows(x), x.argmax(dim=1))


def test_logsumexp_in_place():
    x = torch.tensor([[0.0, math.log(3.0)], [1000.0, 1000.0], [float("-inf"), float("-inf")]])
    out = logsumexp_(x.clone(), peak=x.amax(dim=1, keepdim=True))
    assert out[:, 0].tolist()[:2] == pytest.approx([math.log(4.0), 1000.0 + math.log(2.0)])
    assert out[2, 0] == float("-inf")  # nothing to normalise: -inf, not NaN


def test_next_token_topk_never_pad_or_bos_and_forces_eos_at_max():
    model = ScriptedModel(TABLE)
    src = src_of(A, A)
    forced = torch.tensor([-1, EOS_ID])  # the second row is at its maximum length
    top, ids = next_token_topk(model, torch.full((2,), BOS_ID), model.encode(src), src, model.new_cache(), forced, 3)
    assert ids[0].tolist() == [A, B_, EOS_ID]
    assert top[0].tolist() == pytest.approx([math.log(0.5), math.log(0.3), math.log(0.2)])
    assert ids[1, 0] == EOS_ID and top[1, 0].item() == pytest.approx(math.log(0.2))  # EOS keeps its own log-prob
    assert top[1, 1:].eq(float("-inf")).all()
    assert not {PAD_ID, BOS_ID} & set(ids[top.isfinite()].tolist())


def test_scripted_beams_scores_and_nbest_order():
    alpha = 1.0
    [hyps] = beam_search(ScriptedModel(TABLE), src_of(A), beam=2, lenpen=alpha, max_len=torch.tensor([10]), nbest=2)
    # "b c" (p = .3 * .9 * 1, len 3 with EOS) beats "a" (p = .5 * .6, len 2) only after normalising.
    assert [ids for ids, _ in hyps] == [[B_, C], [A]]
    assert hyps[0][1] == pytest.approx(math.log(0.3 * 0.9) / lp(3, alpha))
    assert hyps[1][1] == pytest.approx(math.log(0.5 * 0.6) / lp(2, alpha))
    [raw] = beam_search(ScriptedModel(TABLE), src_of(A), beam=2, lenpen=0.0, max_len=torch.tensor([10]), nbest=2)
    assert raw == [([A], pytest.approx(math.log(0.3))), ([B_, C], pytest.approx(math.log(0.27)))]


def test_eos_outside_the_top_beam_is_not_finished():
    # Step 0's EOS (p .2) ranks third of the 2*beam candidates: with beam 2 it is not a hypothesis.
    [hyps] = beam_search(ScriptedModel(TABLE), src_of(A), beam=2, lenpen=0.0, max_len=torch.tensor([10]), nbest=2)
    assert [] not in [ids for ids, _ in hyps]
    [wide] = beam_search(ScriptedModel(TABLE), src_of(A), beam=3, lenpen=0.0, max_len=torch.tensor([10]), nbest=3)
    assert ([], pytest.approx(math.log(0.2))) in wide


def test_finished_hypotheses_keep_their_score():
    # "a" finishes at step 1; the search goes on (the "a c d" branch can still win under alpha=1)
    # and must report the score frozen at step 1, not one re-normalised at a later length.
    [hyps] = beam_search(ScriptedModel(TABLE), src_of(A), beam=2, lenpen=1.0, max_len=torch.tensor([10]), nbest=2)
    assert hyps[1] == ([A], pytest.approx(math.log(0.3) / lp(2, 1.0)))


def test_max_len_per_sentence_is_respected():
    model = ScriptedModel(TABLE)
    src, max_len = src_of(B_, B_, B_), torch.tensor([3, 0, 1])
    assert greedy_search(model, src, max_len) == [[A] * 3, [], [A]]
    results = beam_search(model, src, beam=2, lenpen=0.6, max_len=max_len, nbest=1)
    assert [r[0][0] for r in results] == [[A] * 3, [], [A]]
    assert results[0][0][1] == pytest.approx(math.log(0.9 ** 3 * 0.1) / lp(4, 0.6))


def test_scripted_batch_mixes_sentences():
    model = ScriptedModel(TABLE)
    both = beam_search(model, src_of(A, B_), beam=2, lenpen=1.0, max_len=torch.tensor([10, 2]), nbest=2)
    assert both[0] == beam_search(model, src_of(A), beam=2, lenpen=1.0, max_len=torch.tensor([10]), nbest=2)[0]
    assert both[1] == beam_search(model, src_of(B_), beam=2, lenpen=1.0, max_len=torch.tensor([2]), nbest=2)[0]


# --- a small random Transformer -------------------------------------------------------------------

def random_model(seed: int, vocab: int = 12) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=32, d_ff=64, n_heads=4, n_encoder_layers=2, n_decoder_layers=2,
                      vocab_size=vocab, dropout=0.0, max_len=64)
    model = Transformer(cfg).eval()
    # A random model with tied embeddings only repeats one token. An untied random projection with
    # a raised EOS bias gives outputs that depend on source and position and end at varied lengths.
    model.proj = torch.nn.Linear(cfg.d_model, cfg.vocab_size)
    torch.nn.init.normal_(model.proj.weight, std=0.4)
    torch.nn.init.zeros_(model.proj.bias)
    model.proj.bias.data[EOS_ID] = 1.0
    return model


@pytest.fixture(scope="module")
def model() -> Transformer:
    return random_model(1)


@pytest.fixture(scope="module", params=DEVICES)
def on_device(request, model) -> tuple[Transformer, torch.device]:
    """The random model on each device of DEVICES, and that device."""
    device = torch.device(request.param)
    return copy.deepcopy(model).to(device), device


def random_batch(seed: int, n: int = 6, vocab: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded sources ending in EOS, of different lengths; max_len varies too."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (n,), generator=g)
    src = torch.full((n, int(lengths.max()) + 1), PAD_ID)
    for i, n_tok in enumerate(lengths.tolist()):
        src[i, :n_tok] = torch.randint(4, vocab, (n_tok,), generator=g)
        src[i, n_tok] = EOS_ID
    return src, lengths + 3


def greedy_uncached(model, src, max_len) -> list[list[int]]:
    """Reference greedy search: recompute the whole prefix every step, one sentence at a time."""
    out = []
    for i in range(src.size(0)):
        row = src[i : i + 1, : int((src[i] != PAD_ID).sum())]
        memory, prefix = model.encode(row), [BOS_ID]
        while True:
            logits = model.decode(torch.tensor([prefix], device=row.device), memory, row)[0, -1].float()
            logits[[PAD_ID, BOS_ID]] = float("-inf")
            token = EOS_ID if len(prefix) - 1 >= max_len[i] else int(logits.argmax())
            if token == EOS_ID:
                break
            prefix.append(token)
        out.append(prefix[1:])
    return out


@torch.inference_mode()
def test_cached_greedy_equals_uncached(on_device):
    model, device = on_device
    for seed in range(3):
        src, max_len = random_batch(seed)
        src = src.to(device)
        assert greedy_search(model, src, max_len) == greedy_uncached(model, src, max_len)


def test_beam_one_equals_greedy(on_device):
    # With alpha = 0 a beam of one can never prefer anything but the argmax path. (With alpha > 0
    # it may legitimately keep searching for a longer hypothesis whose normalised score wins.)
    model, device = on_device
    for seed in range(3):
        src, max_len = random_batch(seed)
        src = src.to(device)
        beams = beam_search(model, src, beam=1, lenpen=0.0, max_len=max_len)
        assert [hyps[0][0] for hyps in beams] == greedy_search(model, src, max_len)


def test_random_model_outputs_are_well_formed(model):
    src, max_len = random_batch(7)
    for hyps, limit in zip(beam_search(model, src, beam=4, lenpen=0.6, max_len=max_len, nbest=4), max_len.tolist()):
        scores = [score for _, score in hyps]
        assert len(hyps) == 4 and scores == sorted(scores, reverse=True)
        assert all(len(ids) <= limit and not {PAD_ID, BOS_ID, EOS_ID} & set(ids) for ids, _ in hyps)
        assert len({tuple(ids) for ids, _ in hyps}) == 4  # n-best entries are distinct hypotheses


@pytest.mark.parametrize("beam", [1, 3])
def test_batch_equals_each_sentence_alone(on_device, beam):
    model, device = on_device
    src, max_len = random_batch(11)
    src = src.to(device)
    together = beam_search(model, src, beam=beam, lenpen=0.6, max_len=max_len, nbest=beam)
    greedy = greedy_search(model, src, max_len)
    for i in range(src.size(0)):
        alone_src = src[i : i + 1, : int((src[i] != PAD_ID).sum())]
        alone = beam_search(model, alone_src, beam=beam, lenpen=0.6, max_len=max_len[i : i + 1], nbest=beam)[0]
        assert [ids for ids, _ in together[i]] == [ids for ids, _ in alone]
        assert [s for _, s in together[i]] == pytest.approx([s for _, s in alone], abs=1e-4)
        assert greedy[i] == greedy_search(model, alone_src, max_len[i : i + 1])[0]


def test_kept_rows_rounds_up_by_at_most_an_eighth_to_8_sizes_per_doubling():
    assert [kept_rows(n) for n in range(1, 16)] == list(range(1, 16))
    for n in range(1, 5000):
        assert n <= kept_rows(n) <= n + n / 8 and kept_rows(kept_rows(n)) == kept_rows(n)
    sizes = {kept_rows(n) for n in range(1, 2 ** 12)}
    for k in range(4, 12):
        assert len([size for size in sizes if 2 ** k <= size < 2 ** (k + 1)]) == 8


def test_rows_are_kept_for_bfloat16_matmuls_on_a_cpu_only(model):
    from mtrain.cpu.quantize import bfloat16_weights

    cpu = torch.device("cpu")
    assert search.row_sizes(model, cpu) is search.exact_rows
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert search.row_sizes(model, cpu) is kept_rows
    assert search.row_sizes(bfloat16_weights(copy.deepcopy(model)), cpu) is kept_rows
    assert search.row_sizes(bfloat16_weights(copy.deepcopy(model)), torch.device("cuda")) is search.exact_rows
    assert search.row_sizes(object(), cpu) is search.exact_rows  # a decoder that is no nn.Module


@pytest.mark.parametrize("method", ["greedy", "beam", "sample"])
def test_rows_kept_after_their_sentence_ends_change_no_result(model, method, monkeypatch):
    """40 sentences ending at many different steps: the search drops finished ones only down to
    kept_rows sizes, so it runs on rows whose sentence has ended; every sentence's output (and
    score) is still what it gets alone, and the decoder only ever sees kept_rows sizes."""
    padded: list[int] = []  # finished rows kept, each time the batch shrank

    def keep(n: int) -> int:
        padded.append(kept_rows(n) - n)
        return kept_rows(n)

    monkeypatch.setattr(search, "row_sizes", lambda model, device: keep)  # as for bfloat16 on a CPU
    src, max_len = random_batch(5, n=40)
    streams = [stream_key(3, i, 0) for i in range(40)]

    def run(rows: slice) -> list:
        s, m = src[rows], max_len[rows]
        if method == "greedy":
            return greedy_search(model, s, m)
        if method == "beam":
            return beam_search(model, s, beam=3, lenpen=0.6, max_len=m, nbest=2)
        return sample(model, s, m, Sampling(topk=5), streams[rows])

    sizes: list[int] = []
    decode_states = model.decode_states
    monkeypatch.setattr(model, "decode_states", lambda tgt, *a, **k: sizes.append(tgt.size(0)) or decode_states(tgt, *a, **k))
    together = run(slice(None))
    sentences = [n // 3 for n in sizes[1:]] if method == "beam" else sizes  # beam: 3 rows a sentence after step 0
    assert len(set(sentences)) > 3 and all(kept_rows(n) == n for n in sentences) and max(padded) > 0
    for i in range(40):
        alone = run(slice(i, i + 1))[0]
        if method == "greedy":
            assert together[i] == alone
        elif method == "beam":
            assert [ids for ids, _ in together[i]] == [ids for ids, _ in alone]
            assert [s for _, s in together[i]] == pytest.approx([s for _, s in alone], abs=1e-4)
        else:
            assert together[i][0] == alone[0] and together[i][1] == pytest.approx(alone[1], abs=1e-4)


class RowCache(KVCache):
    """A plain cache whose expand_beams repeats every row (self- and cross-attention K/V alike)
    instead of building the grouped beam layout: the reference for mtrain's grouped beam cache."""

    rows_per_source = 1

    def expand_beams(self, group: int) -> KVCache:
        index = torch.arange(self.layers[0].self_k.size(0)).repeat_interleave(group)
        self.reorder(index)
        self.rows_per_source = group
        return self


class Ungrouped:
    """The same model with cross-attention K/V per beam row (memory and src repeated per row),
    as a reference for the per-sentence K/V that beam search normally gets."""

    def __init__(self, model: Transformer) -> None:
        self.model, self.cfg, self.reductions = model, model.cfg, model.reductions

    def encode(self, src):
        return self.model.encode(src)

    def new_cache(self, group: int = 1):
        assert group == 1, "beam search starts from a plain cache"
        return RowCache(len(self.model.decoder))

    def decode(self, tgt, memory, src, cache):
        repeat = cache.rows_per_source
        return self.model.decode(tgt, memory.repeat_interleave(repeat, 0), src.repeat_interleave(repeat, 0), cache)


def beam_reference(model, src, beam: int, alpha: float, max_len: int) -> list[tuple[list[int], float]]:
    """Textbook beam search for one sentence: no cache (every prefix decoded from scratch), every
    (beam, token) pair scored, no early stop. Each step: of the 2*beam best extensions, EOS among
    the best `beam` finishes with score logp / lp(len); the best `beam` non-EOS stay alive."""
    memory = model.encode(src)
    alive, finished = [([], 0.0)], []
    for t in range(max_len + 1):
        candidates = []
        for prefix, score in alive:
            logits = model.decode(torch.tensor([[BOS_ID, *prefix]], device=src.device), memory, src)[0, -1].double()
            logp = torch.log_softmax(logits, dim=-1).tolist()
            for token, lp_token in enumerate(logp):
                if token not in (PAD_ID, BOS_ID) and (t < max_len or token == EOS_ID):
                    candidates.append((score + lp_token, prefix, token))
        candidates.sort(key=lambda c: -c[0])
        best = candidates[: 2 * beam]
        finished += [(s / lp(t + 1, alpha), prefix) for s, prefix, token in best[:beam] if token == EOS_ID]
        alive = [(prefix + [token], s) for s, prefix, token in best if token != EOS_ID][:beam]
    return [(prefix, s) for s, prefix in sorted(finished, key=lambda f: -f[0])[:beam]]


@pytest.mark.parametrize("beam", [1, 3, 5])
def test_beam_search_equals_textbook_reference(on_device, beam):
    # Per-beam top-(beam+1) candidates, the one-row first step, the grouped in-place cache and the
    # early stop together must give exactly what scoring every (beam, token) pair gives.
    model, device = on_device
    with torch.inference_mode():
        src, max_len = random_batch(21)
        src = src.to(device)
        out = beam_search(model, src, beam=beam, lenpen=0.6, max_len=max_len, nbest=beam)
        for i in range(src.size(0)):
            row = src[i : i + 1, : int((src[i] != PAD_ID).sum())]
            ref = beam_reference(model, row, beam, 0.6, int(max_len[i]))
            assert [ids for ids, _ in out[i]] == [ids for ids, _ in ref]
            assert [s for _, s in out[i]] == pytest.approx([s for _, s in ref], abs=1e-4)


@pytest.mark.parametrize("beam", [2, 4])
def test_per_sentence_cross_attention_equals_per_row(model, beam):
    src, max_len = random_batch(5)  # sentences end at different steps: the batch shrinks as it goes
    grouped = beam_search(model, src, beam=beam, lenpen=0.6, max_len=max_len, nbest=beam)
    per_row = beam_search(Ungrouped(model), src, beam=beam, lenpen=0.6, max_len=max_len, nbest=beam)
    assert [[ids for ids, _ in hyps] for hyps in grouped] == [[ids for ids, _ in hyps] for hyps in per_row]
    assert [s for hyps in grouped for _, s in hyps] == pytest.approx([s for hyps in per_row for _, s in hyps], abs=1e-4)


def test_nbest_must_not_exceed_beam(model):
    src, max_len = random_batch(0)
    with pytest.raises(ValueError):
        beam_search(model, src, beam=2, lenpen=0.6, max_len=max_len, nbest=3)


def test_every_decoder_states_the_search_interface():
    """The models and caches the searches run on all have the Decoder / DecoderCache members
    (mtrain.search's protocols): the model, an ensemble, and this file's scripted stand-ins."""
    from mtrain.ensemble import Ensemble
    from mtrain.search import Decoder, DecoderCache

    model = random_model(1)
    decoders = [model, Ensemble([model, random_model(2)]), Ungrouped(model)]
    assert all(isinstance(decoder, Decoder) for decoder in decoders)
    caches = [decoder.new_cache() for decoder in decoders] + [model.new_cache(group=3)]
    assert all(isinstance(cache, DecoderCache) for cache in caches)


class DecodeOnly:
    """A Transformer behind decode alone: searches get one block of every row's logits a step."""

    def __init__(self, model: Transformer) -> None:
        self.model, self.cfg, self.reductions = model, model.cfg, model.reductions

    def encode(self, src):
        return self.model.encode(src)

    def new_cache(self, group: int = 1):
        return self.model.new_cache(group)

    def decode(self, tgt, memory, src, cache=None):
        return self.model.decode(tgt, memory, src, cache)


@pytest.mark.parametrize("rows", [1, 4])
def test_projecting_in_blocks_of_rows_changes_no_result(model, monkeypatch, rows):
    """Searches project the vocabulary a few rows at a time (search.BLOCK_BYTES); every row's choice
    and score is what one block of all rows gives, forced prefixes and n-gram bans included."""
    check_blocks_change_nothing(model, monkeypatch, rows)


def check_blocks_change_nothing(model, monkeypatch, rows: int) -> None:
    """Greedy and beam search of `model` projecting `rows` rows at a time equal its searches behind
    decode alone (one block of every row), forced prefixes and n-gram bans included."""
    monkeypatch.setattr(search, "BLOCK_BYTES", 4 * model.cfg.vocab_size * rows)
    whole = DecodeOnly(model)
    for seed in range(3):
        src, max_len = random_batch(seed)
        prefixes = [[5, 6], [], [7], [], [8, 9, 10], []]
        for args in ((), (prefixes, 2)):
            assert greedy_search(model, src, max_len, *args) == greedy_search(whole, src, max_len, *args)
        got = beam_search(model, src, beam=3, lenpen=0.6, max_len=max_len, nbest=3, no_repeat_ngram=2)
        want = beam_search(whole, src, beam=3, lenpen=0.6, max_len=max_len, nbest=3, no_repeat_ngram=2)
        assert [[ids for ids, _ in hyps] for hyps in got] == [[ids for ids, _ in hyps] for hyps in want]
        assert [s for hyps in got for _, s in hyps] == pytest.approx([s for hyps in want for _, s in hyps], abs=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_beam_one_equals_greedy(device):
    """A bfloat16 decoding copy (decode.amp=bf16) searches the same way: beam 1 is greedy."""
    from mtrain.cpu.quantize import bfloat16_weights

    bf16 = bfloat16_weights(random_model(1).to(device))
    for seed in range(3):
        src, max_len = random_batch(seed)
        src = src.to(device)
        beams = beam_search(bf16, src, beam=1, lenpen=0.0, max_len=max_len)
        greedy = greedy_search(bf16, src, max_len)
        for row, (hyps, ids) in enumerate(zip(beams, greedy)):
            assert_same_up_to_a_near_tie(bf16, src[row : row + 1], hyps[0][0], ids)


def assert_same_up_to_a_near_tie(model, src, got: list[int], want: list[int], rel: float = 2 ** -5) -> None:
    """got == want, or they part where the two tokens' logits lie within bfloat16 rounding of each
    other. Beam 1 and greedy run different kernels (a masked attention, other row counts), and on a
    GPU bfloat16 attention rounds its output, so a near-tie may fall either way there; on a CPU the
    paths agree to float32 rounding. A search bug parts them where one token clearly wins."""
    if got == want:
        return
    ended_got, ended_want = got + [EOS_ID], want + [EOS_ID]  # a shorter output parts at its EOS
    t = next(i for i, (a, b) in enumerate(zip(ended_got, ended_want)) if a != b)
    a, b = ended_got[t], ended_want[t]
    with torch.inference_mode():
        prefix = torch.tensor([[BOS_ID] + want[:t]], device=src.device)
        logits = model.decode(prefix, model.encode(src), src)[0, -1].float()
    gap, scale = abs(float(logits[a] - logits[b])), float(logits.abs().max())
    assert gap <= rel * scale, f"step {t}: {a} against {b}, logits {gap:.4f} apart (scale {scale:.2f}): {got} != {want}"


@pytest.mark.parametrize("rows", [1, 4])
def test_bfloat16_blocks_upcast_into_one_buffer_change_no_result(monkeypatch, rows):
    """A bfloat16 model's logits are upcast block after block into one reused float32 buffer
    (search.Float32Blocks); with several blocks per step every choice and score is still exactly what
    one fresh float32 block of all rows gives (the upcast is exact). mtrain.cpu.native's top-k, which
    reads the bfloat16 blocks instead, is off here (tests/test_native.py checks it)."""
    from types import SimpleNamespace

    from mtrain.cpu import reductions as cpu_reductions
    from mtrain.cpu.quantize import bfloat16_weights

    monkeypatch.setattr(cpu_reductions, "native", SimpleNamespace(library=lambda: None, topk_logsumexp=lambda *a: None))
    bf16 = bfloat16_weights(random_model(1))
    monkeypatch.setattr(search, "BLOCK_BYTES", 4 * bf16.cfg.vocab_size * rows)
    whole = DecodeOnly(bf16)
    for seed in range(3):
        src, max_len = random_batch(seed)
        assert greedy_search(bf16, src, max_len) == greedy_search(whole, src, max_len)
        got = beam_search(bf16, src, beam=3, lenpen=0.6, max_len=max_len, nbest=3, no_repeat_ngram=2)
        want = beam_search(whole, src, beam=3, lenpen=0.6, max_len=max_len, nbest=3, no_repeat_ngram=2)
        assert got == want


def test_float32_blocks_reuse_one_buffer_and_pass_float32_through():
    blocks = search.Float32Blocks()
    first = blocks.upcast(torch.tensor([[1.5, -2.0], [3.0, 0.25]], dtype=torch.bfloat16))
    assert first.dtype == torch.float32 and first.tolist() == [[1.5, -2.0], [3.0, 0.25]]
    second = blocks.upcast(torch.tensor([[7.0, 8.0]], dtype=torch.bfloat16))  # a smaller block: same storage
    assert second.tolist() == [[7.0, 8.0]] and second.data_ptr() == first.data_ptr()
    already = torch.ones(2, 3)
    assert blocks.upcast(already) is already


@pytest.mark.parametrize("group", [1, 3])
@torch.inference_mode()
def test_a_reserved_cache_makes_its_buffers_once_and_decodes_the_same(model, group):
    """After reserve(40), every layer's self-attention buffers hold 40 positions (40 slots per beam)
    from the first step on and are never made again, where a cache without it grows past 32; the
    logits of every step are bit for bit those of the growing cache."""
    src, _ = random_batch(3, n=4)
    memory = model.encode(src)
    caches = [model.new_cache(), model.new_cache()]
    caches[0].reserve(40)
    buffers = [set(), set()]
    tokens = torch.full((src.size(0),), BOS_ID)
    for step in range(40):
        logits = [model.decode(tokens.unsqueeze(1), memory, src, cache) for cache in caches]
        assert torch.equal(logits[0], logits[1])
        if step == 0 and group > 1:
            caches = [cache.expand_beams(group) for cache in caches]
        for made, cache in zip(buffers, caches):
            made.update(layer.self_k.data_ptr() for layer in cache.layers)
        tokens = logits[0][:, -1].argmax(-1).repeat_interleave(group if step == 0 else 1)
    assert len(buffers[0]) == len(model.decoder)  # one buffer per layer, all along
    assert all(layer.self_k.size(2) == 40 * group for layer in caches[0].layers)
    assert len(buffers[1]) > len(model.decoder)  # the unreserved cache grew


def test_searches_reserve_their_longest_output_up_to_a_bound(model, monkeypatch):
    """Greedy search and beam search reserve max_len + 1 steps (the last can only add EOS), at most
    search.MAX_RESERVED; reserving changes no output or score."""
    reserved = []
    real_reserve = KVCache.reserve
    monkeypatch.setattr(KVCache, "reserve", lambda self, n: reserved.append(n) or real_reserve(self, n))
    src, max_len = random_batch(5)
    greedy = greedy_search(model, src, max_len)
    beams = beam_search(model, src, beam=3, lenpen=0.6, max_len=max_len, nbest=3)
    assert reserved == [int(max_len.max()) + 1] * 3  # greedy's cache; beam's first one, and its beams'
    greedy_search(model, src, torch.full_like(max_len, 1000))
    assert reserved[-1] == search.MAX_RESERVED
    monkeypatch.setattr(search, "reserve", lambda cache, steps: None)
    assert greedy_search(model, src, max_len) == greedy
    unreserved = beam_search(model, src, beam=3, lenpen=0.6, max_len=max_len, nbest=3)
    assert [[ids for ids, _ in hyps] for hyps in unreserved] == [[ids for ids, _ in hyps] for hyps in beams]
    assert [s for hyps in unreserved for _, s in hyps] == [s for hyps in beams for _, s in hyps]


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="needs native bfloat16 (emulated, the bfloat16 copy decodes ~30x slower)")
def test_the_decoding_ab_benchmark_compares_decoding_with_and_without_the_c_kernels(multi30k_dir):
    """benchmarks/decode_ab.py end to end at its smallest (it reads the local Multi30k copy that
    multi30k_dir finds): both forms decode the same sentences, and
    greedy search gives the same outputs with either (they differ by float32 rounding only)."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "decode_ab.py"), "--sentences", "24",
                           "--rounds", "1", "--threads", "1", "--json"],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result["sent_s"]) == {"torch", "c"} and result["search"] == "greedy"
    assert result["same_outputs"] >= 0.9
