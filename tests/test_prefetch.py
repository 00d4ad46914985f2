"""The prefetching batch stream (mtrain.prefetch): the same batches as BatchStream.take in the same
order, with or without the background thread, across epochs and subword sampling; the stream
position stays that of the last update handed out; moving it (a resume) is obeyed; errors of
the thread reach the caller; and a training run through it resumes bit-identically."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtrain import checkpoint
from mtrain.config import load_config
from mtrain.data import BatchStream, SubwordSampler, TokenizedData, collate
from mtrain.errors import MtrainError
from mtrain.prefetch import Prefetcher


def contents(batches) -> list[tuple[torch.Tensor, ...]]:
    """What a batch means: its collated tensors (the ids, so sampled segmentations count)."""
    return [collate(b.split, b.indices) for b in batches]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for ta, tb in zip(a, b) for x, y in zip(ta, tb))


@pytest.fixture(scope="module")
def data(tokenized_slice):
    return TokenizedData(tokenized_slice)


def streams(data, sampling: bool, max_tokens: int = 2048) -> tuple[BatchStream, BatchStream]:
    def make() -> BatchStream:
        split = data.split("train")
        sampler = SubwordSampler(split, data.tokenizer, 0.3, 7, max_tokens) if sampling else None
        return BatchStream(split, max_tokens, seed=7, sampler=sampler)
    return make(), make()


@pytest.mark.parametrize("sampling", [False, True], ids=["cached-ids", "subword-sampling"])
@pytest.mark.parametrize("enabled", [True, False], ids=["thread", "inline"])
def test_the_same_batches_in_the_same_order_across_epochs(data, sampling, enabled):
    plain, wrapped = streams(data, sampling)
    n = 3  # batches per update: some updates straddle an epoch boundary
    prefetch = Prefetcher(wrapped, n, contents, enabled=enabled)
    epochs = len(plain.batches(1))
    for _ in range(2 * epochs // n + 2):  # into epoch 3
        expected = plain.take(n)
        got = prefetch.next()
        assert [b.indices.tolist() for b in got.batches] == [b.indices.tolist() for b in expected]
        assert same(got.prepared, contents(expected))
        # The position a checkpoint stores: after this update, never after the one prepared ahead.
        assert (wrapped.epoch, wrapped.index) == (plain.epoch, plain.index) == got.end
    assert plain.epoch == 3
    prefetch.close()


def test_moving_the_position_restarts_from_there(data):
    """A resume sets the stream's (epoch, index): what was prepared for the old position is dropped."""
    plain, wrapped = streams(data, sampling=False)
    prefetch = Prefetcher(wrapped, 2, contents)
    for _ in range(5):
        prefetch.next()
    saved = (wrapped.epoch, wrapped.index)
    for _ in range(4):
        prefetch.next()  # the run goes on after the save, then is killed
    wrapped.epoch, wrapped.index = saved  # the resumed run's position
    plain.epoch, plain.index = saved
    for _ in range(30):
        assert same(prefetch.next().prepared, contents(plain.take(2)))
    prefetch.close()


def test_an_error_in_the_thread_reaches_the_caller(data):
    _, wrapped = streams(data, sampling=False)
    calls = []

    def prepare(batches):
        calls.append(len(batches))
        if len(calls) == 2:
            raise MtrainError("disk gone")
        return len(batches)

    prefetch = Prefetcher(wrapped, 1, prepare)
    assert prefetch.next().prepared == 1
    with pytest.raises(MtrainError, match="disk gone"):
        prefetch.next()


def test_collated_tensors_match_plain_collation(data):
    """What the trainer prepares in the thread: the update's target tokens over all batches and
    each micro-batch collated, exactly as collate gives them."""
    from mtrain.data import stream_target_tokens

    plain, wrapped = streams(data, sampling=False)
    prefetch = Prefetcher(wrapped, 4, lambda batches: (stream_target_tokens(batches), contents(batches)))
    for _ in range(10):
        batches = plain.take(4)
        total, host = prefetch.next().prepared
        assert total == stream_target_tokens(batches) and same(host, contents(batches))
    prefetch.close()


# ---------------------------------------------------------------- through training

TINY = ["model.d_model=32", "model.d_ff=64", "model.n_heads=2", "model.n_encoder_layers=1",
        "model.n_decoder_layers=1", "train.max_tokens=512", "train.warmup_steps=10", "train.num_threads=1",
        "train.max_steps=10", "train.save_every=4", "train.eval_every=5", "train.eval_max_sentences=2",
        "train.log_every=1", "train.update_freq=3"]


def run(data_dir, run_dir, *extra):
    from mtrain.train import train

    return train(load_config(None, TINY + list(extra)), data_dir, run_dir, device="cpu")


def final_state(run_dir):
    ckpt = checkpoint.load(run_dir / "last.pt")
    return ckpt["model"], ckpt["train_state"]["optimizer"]["state"], ckpt["train_state"]["state"]


def test_training_with_and_without_the_thread_and_across_a_stop_is_bit_identical(tokenized_slice, tmp_path,
                                                                                  stop_at_step, monkeypatch):
    """Three runs of one config: prefetching in the thread, prefetching inline (no thread), and
    prefetching stopped by a SIGINT after update 6 (last.pt is written while update 7 is already
    prepared) and resumed. All end with the same weights, Adam moments and stream position."""
    import mtrain.trainer

    whole = tmp_path / "whole"
    run(tokenized_slice, whole)
    inline = tmp_path / "inline"
    with monkeypatch.context() as patch:
        patch.setattr(mtrain.trainer, "Prefetcher", lambda *a, **k: Prefetcher(*a, **{**k, "enabled": False}))
        run(tokenized_slice, inline)
    cut = tmp_path / "cut"
    stop_at_step(6)
    assert run(tokenized_slice, cut)["stopped"] == "interrupted"
    stop_at_step(None)
    assert run(tokenized_slice, cut)["step"] == 10
    reference = final_state(whole)
    for other in (inline, cut):
        model, moments, state = final_state(other)
        assert all(torch.equal(reference[0][k], model[k]) for k in model)
        assert all(torch.equal(reference[1][i]["exp_avg_sq"], moments[i]["exp_avg_sq"]) for i in moments)
        assert (state["epoch"], state["batch_index"]) == (reference[2]["epoch"], reference[2]["batch_index"])
    assert np.isfinite([v.float().sum().item() for v in reference[0].values()]).all()
