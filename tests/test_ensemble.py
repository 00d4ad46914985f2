"""Ensembles (mtrain.ensemble): the step distribution is the mean of the members' probabilities,
cached decoding equals uncached, test_search's search properties (cached = uncached greedy, beam 1 =
greedy, batch = each sentence alone, beam = the textbook reference) hold for the ensemble, and an
ensemble of a model with itself is that model."""

from __future__ import annotations

import dataclasses

import pytest
import test_search as search_tests
import torch
from test_search import random_batch, random_model

from mtrain import search
from mtrain.ensemble import Ensemble
from mtrain.search import beam_search, greedy_search, step_logits
from mtrain.tokenizer import BOS_ID


@pytest.fixture(scope="module")
def pair() -> Ensemble:
    return Ensemble([random_model(1), random_model(2)])


@torch.inference_mode()
def test_step_distribution_is_the_mean_of_the_members(pair):
    src, _ = random_batch(3, n=2)
    tgt = torch.tensor([[BOS_ID, 5, 7, 4], [BOS_ID, 9, 6, 8]])
    probs = [torch.softmax(model(src, tgt).double(), dim=-1) for model in pair.models]
    expected = ((probs[0] + probs[1]) / 2).log()
    got = pair.decode(tgt, pair.encode(src), src)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.exp().sum(-1), torch.ones(2, 4), atol=1e-5, rtol=0)  # a distribution


@torch.inference_mode()
def test_cached_decoding_equals_uncached(pair):
    src, _ = random_batch(4, n=3)
    tgt = torch.tensor([[BOS_ID, 5, 7, 4, 6], [BOS_ID, 9, 6, 8, 8], [BOS_ID, 4, 4, 10, 5]])
    whole = pair.decode(tgt, pair.encode(src), src)
    memory, cache = pair.encode(src), pair.new_cache()
    steps = [pair.decode(tgt[:, t : t + 1], memory, src, cache) for t in range(tgt.size(1))]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-5, rtol=0)


@pytest.mark.parametrize("check, args", [
    (search_tests.test_cached_greedy_equals_uncached, ()),
    (search_tests.test_beam_one_equals_greedy, ()),
    (search_tests.test_batch_equals_each_sentence_alone, (3,)),
    # Beam reordering, the one-row first step, sentences leaving the batch: every member's cache and
    # memory must follow, or the cached search would drift from the textbook reference.
    (search_tests.test_beam_search_equals_textbook_reference, (2,)),
    (search_tests.test_beam_search_equals_textbook_reference, (4,)),
], ids=["cached-greedy=uncached", "beam1=greedy", "batch=alone", "beam2=textbook", "beam4=textbook"])
def test_search_properties_hold_for_an_ensemble(pair, check, args):
    """test_search's properties, run on the ensemble instead of one model (on the CPU)."""
    check((pair, torch.device("cpu")), *args)


@torch.inference_mode()
def test_a_search_step_projects_the_ensemble_in_blocks_of_rows(pair, monkeypatch):
    """Like one model, an ensemble runs its decoders once a step and mixes the members' distributions
    block by block of rows (search.BLOCK_BYTES): each block is those rows of decode's mixture."""
    monkeypatch.setattr(search, "BLOCK_BYTES", 4 * pair.cfg.vocab_size * 2)
    src, _ = random_batch(5, n=5)
    tokens = torch.full((src.size(0),), BOS_ID)
    whole = pair.decode(tokens[:, None], pair.encode(src), src, pair.new_cache())[:, -1]
    blocks = list(step_logits(pair, tokens, pair.encode(src), src, pair.new_cache()))
    assert [(first, len(block)) for first, block in blocks] == [(0, 2), (2, 2), (4, 1)]
    torch.testing.assert_close(torch.cat([block for _, block in blocks]), whole, atol=1e-6, rtol=0)


@pytest.mark.parametrize("rows", [1, 4])
def test_projecting_in_blocks_of_rows_changes_no_result(pair, monkeypatch, rows):
    search_tests.check_blocks_change_nothing(pair, monkeypatch, rows)


def test_members_disagree_so_the_ensemble_is_not_one_of_them(pair):
    # Guards the tests above against a degenerate pair whose members always agree.
    src, max_len = random_batch(11)
    first, second = (greedy_search(model, src, max_len) for model in pair.models)
    assert first != second


def test_ensemble_of_a_model_with_itself_is_the_model():
    model = random_model(1)
    twice = Ensemble([model, model])
    src, max_len = random_batch(5)
    alone = beam_search(model, src, beam=3, lenpen=0.6, max_len=max_len, nbest=3)
    both = beam_search(twice, src, beam=3, lenpen=0.6, max_len=max_len, nbest=3)
    assert [[ids for ids, _ in h] for h in both] == [[ids for ids, _ in h] for h in alone]
    assert [s for h in both for _, s in h] == pytest.approx([s for h in alone for _, s in h], abs=1e-4)
    assert greedy_search(twice, src, max_len) == greedy_search(model, src, max_len)


def test_members_must_share_the_vocabulary():
    with pytest.raises(ValueError, match="vocabulary"):
        Ensemble([random_model(1, vocab=12), random_model(2, vocab=13)])
    shorter = random_model(3)
    shorter.cfg = dataclasses.replace(shorter.cfg, max_len=32)
    assert Ensemble([random_model(1), shorter]).cfg.max_len == 32  # inputs are cut for the tightest member
