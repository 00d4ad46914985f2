"""Several corpora mixed by weight in training: the per-epoch quotas and draws (property-tested),
the token-budget batching they feed, one-line errors for weights that do not fit the data, and
kill -9 mid-epoch with two weighted corpora, after which the same command ends bit-identical."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from mtrain import checkpoint
from mtrain.cli import app
from mtrain.config import load_config
from mtrain.data import BatchStream, CorpusMixer, TokenizedData, make_batches, quotas
from mtrain.errors import MtrainError

SIZES = st.lists(st.integers(1, 400), min_size=1, max_size=5)
WEIGHT = st.floats(0.01, 100.0, allow_nan=False, allow_infinity=False)


# ---------------------------------------------------------------- quotas and draws

@settings(max_examples=200, deadline=None)
@given(data=st.data(), sizes=SIZES)
def test_quotas_keep_the_epoch_size_and_each_corpus_within_one_pair_of_its_share(data, sizes):
    weights = data.draw(st.lists(WEIGHT, min_size=len(sizes), max_size=len(sizes)))
    got, total = quotas(sizes, weights), sum(sizes)
    assert sum(got) == total
    for quota, weight in zip(got, weights):
        assert abs(quota - total * weight / sum(weights)) < 1


@settings(max_examples=100, deadline=None)
@given(data=st.data(), sizes=SIZES, seed=st.integers(0, 2**32 - 1), epoch=st.integers(1, 10**6))
def test_an_epoch_is_a_pure_function_of_seed_and_epoch_with_every_pair_drawn_evenly(data, sizes, seed, epoch):
    weights = data.draw(st.lists(WEIGHT, min_size=len(sizes), max_size=len(sizes)))
    chosen = CorpusMixer(sizes, weights, seed)(epoch)
    assert np.array_equal(chosen, CorpusMixer(sizes, weights, seed)(epoch))  # a new mixer: the same epoch
    counts = np.bincount(chosen, minlength=sum(sizes))
    assert counts.size == sum(sizes) and chosen.size == sum(sizes)
    start = 0
    for size, quota in zip(sizes, quotas(sizes, weights)):
        mine = counts[start:start + size]
        assert mine.sum() == quota  # this corpus's share of the epoch
        assert set(np.unique(mine).tolist()) <= {quota // size, -(-quota // size)}  # each pair as often as any other, +-1
        start += size


def test_epochs_and_seeds_draw_different_pairs_and_repeat_exactly():
    mixer = CorpusMixer([1000, 300], [1.0, 1.0], seed=7)  # the big corpus is cut to 650 of its 1000 pairs
    epochs = [mixer(e) for e in range(1, 5)]
    assert len({e.tobytes() for e in epochs}) == 4
    assert np.array_equal(CorpusMixer([1000, 300], [1.0, 1.0], seed=7)(3), epochs[2])
    assert not np.array_equal(CorpusMixer([1000, 300], [1.0, 1.0], seed=8)(3), epochs[2])
    # 650 of 1000 pairs an epoch: epochs 1 and 2 show every pair of the big corpus, none three times.
    big = np.concatenate(epochs[:2])
    counts = np.bincount(big[big < 1000], minlength=1000)
    assert counts.min() == 1 and counts.max() == 2 and len(np.unique(epochs[0])) == 950


# ---------------------------------------------------------------- batching

def reference_batches(src_lengths, tgt_lengths, max_tokens, seed, epoch, shuffle, allow_oversize):
    """make_batches as a Python loop over every sentence (how it was first written)."""
    cost = np.maximum(np.asarray(src_lengths), np.asarray(tgt_lengths)).astype(np.int64) + 1
    rng = np.random.default_rng([seed, epoch])
    if shuffle:
        tie_break = rng.permutation(cost.size)
        order = tie_break[np.argsort(cost[tie_break], kind="stable")]
    else:
        order = np.argsort(cost, kind="stable")
    batches, start = [], 0
    for i, index in enumerate(order):
        if (i + 1 - start) * cost[index] > max_tokens and i > start:
            batches.append(order[start:i])
            start = i
        if cost[index] > max_tokens and not allow_oversize:
            raise MtrainError(f"sentence {int(index)} too long")
    if start < cost.size:
        batches.append(order[start:])
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


@settings(max_examples=300, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 70)), max_size=150),
       max_tokens=st.integers(1, 300), seed=st.integers(0, 1000), shuffle=st.booleans(), oversize=st.booleans())
def test_batches_are_the_sentence_by_sentence_greedy_cut(pairs, max_tokens, seed, shuffle, oversize):
    src, tgt = np.array([p[0] for p in pairs], dtype=np.int64), np.array([p[1] for p in pairs], dtype=np.int64)
    try:
        expected = reference_batches(src, tgt, max_tokens, seed, 3, shuffle, oversize)
    except MtrainError:
        with pytest.raises(MtrainError, match="raise train.max_tokens"):
            make_batches(src, tgt, max_tokens, seed, 3, shuffle, oversize)
        return
    got = make_batches(src, tgt, max_tokens, seed, 3, shuffle, oversize)
    assert [b.tolist() for b in got] == [b.tolist() for b in expected]


def test_a_mixed_stream_batches_exactly_the_pairs_of_each_epoch(tmp_path):
    from mtrain.data import Ragged, Split

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 30, 500)
    ragged = Ragged(np.ones(int(lengths.sum()), dtype=np.int32), np.concatenate([[0], np.cumsum(lengths)]))
    split = Split("train", ragged, ragged, tmp_path)
    mixer = CorpusMixer([350, 150], [1.0, 2.0], seed=1)
    stream = BatchStream(split, 256, seed=1, mixer=mixer)
    for epoch in (1, 2):
        drawn = np.sort(np.concatenate(stream.batches(epoch)))
        assert np.array_equal(drawn, mixer(epoch))
        assert all(len(b) * (lengths[b].max() + 1) <= 256 for b in stream.batches(epoch))


# ---------------------------------------------------------------- two corpora on disk

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def copy_corpus(folder: Path, seed: int, sizes: dict[str, int]) -> Path:
    """A copy task (target = source) over 12 words."""
    folder.mkdir(parents=True)
    rng = random.Random(seed)
    for split, n in sizes.items():
        lines = "".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8))) + "\n" for _ in range(n))
        (folder / f"{split}.de").write_text(lines)
        (folder / f"{split}.en").write_text(lines)
    return folder


@pytest.fixture(scope="module")
def two_corpora(tmp_path_factory) -> Path:
    """main (200 pairs, with valid) and bt (120 pairs, tagged <bt>), tokenized together (a few
    duplicates dropped)."""
    from mtrain.prepare import tokenize_corpus

    raw = tmp_path_factory.mktemp("raw")
    main = copy_corpus(raw / "main", 0, {"train": 200, "valid": 20})
    bt = copy_corpus(raw / "bt", 1, {"train": 120})
    out = tmp_path_factory.mktemp("two-tok")
    tokenize_corpus(load_config(None, ["tokenizer.vocab_size=290", "data.tags=bt"]), [str(main), str(bt)], out,
                    ["train", "valid"])
    return out


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("weights, needles", [
    ("main=1,web=2", ("data.weights: no corpus named 'web'", "main, bt")),
    ("main=1", ("data.weights: no weight for corpus 'bt'",)),
    ("main=1,bt=0", ("bt=0: a weight must be above 0",)),
    ("main=1,main=2,bt=1", ("'main' is given twice",)),
], ids=["unknown corpus", "missing corpus", "zero weight", "a corpus twice"])
def test_weights_that_do_not_fit_the_data_fail_before_any_work(two_corpora, tmp_path, weights, needles):
    result = cli("train", "--data", str(two_corpora), "--out", str(tmp_path / "run"), "--device", "cpu",
                 "--set", f"data.weights={weights}")
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    last = result.output.strip().splitlines()[-1]
    assert all(needle in last for needle in needles), last
    assert not (tmp_path / "run").exists()


def test_weights_need_a_folder_that_records_its_corpora(two_corpora, tmp_path):
    import json
    import shutil

    old = tmp_path / "old"
    shutil.copytree(two_corpora, old)
    meta = json.loads((old / "meta.json").read_text())
    del meta["corpora"]
    (old / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(MtrainError, match="records none for 'train'.*--data NAME=DIR"):
        data = TokenizedData(old)
        data.mixer(load_config(None, ["data.weights=main=1,bt=1"]).data, 1, data.split("train"))


def test_weights_mix_the_corpora_of_a_run(two_corpora):
    """With weights main=1, bt=3, a quarter of each epoch comes from main, the rest from bt."""
    data = TokenizedData(two_corpora)
    split = data.split("train")
    main = data.corpora[0]["pairs"]
    chosen = data.mixer(load_config(None, ["data.weights=main=1,bt=3"]).data, 1, split)(1)
    assert chosen.size == len(split) and abs((chosen < main).sum() - len(split) / 4) < 1
    assert data.mixer(load_config(None, []).data, 1, split) is None  # no weights: every pair once an epoch


# ---------------------------------------------------------------- kill -9 mid-epoch, then resume

def test_kill9_mid_epoch_with_two_weighted_corpora_resumes_bit_identically(two_corpora, tmp_path):
    """Weights main=1, bt=3 (bt upsampled about 2x, main cut to about 80 of its pairs, drawn anew each epoch).
    Epochs of 4 batches here; a SIGKILL inside update 7 of 8: the resumed run starts from update 6's
    last.pt, in the middle of epoch 2, whose draw it must make again, and the same command then ends
    with every file as an uninterrupted run's."""
    from test_faults import TINY, KillPoint, differences, kill_and_resume, reference_run, resume_in_process, train_args

    settings = TINY + ["train.max_tokens=1024", "data.weights=main=1,bt=3"]
    run_dir = tmp_path / "killed"
    with ThreadPoolExecutor(1) as pool:
        killed = pool.submit(kill_and_resume, two_corpora, run_dir, 8, [KillPoint("step", 7)], settings, False)
        reference_run(two_corpora, tmp_path / "reference", 8, settings)
        history = killed.result()
    state = checkpoint.load(run_dir / "last.pt")["train_state"]["state"]
    data = TokenizedData(two_corpora)
    stream = BatchStream(data.split("train"), 1024, seed=1,
                         mixer=CorpusMixer([c["pairs"] for c in data.corpora], [1.0, 3.0], seed=1))
    assert state["step"] == 6 and state["epoch"] >= 2 and 0 < state["batch_index"] < len(stream.batches(state["epoch"]))
    assert "resuming from" in resume_in_process(train_args(two_corpora, run_dir, 8, settings))
    found = differences(tmp_path / "reference", run_dir)
    assert not found, f"{history}\n{found}"
