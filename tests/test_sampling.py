"""Sampling, forced prefixes and no-repeat n-grams (mtrain.search): the sample distribution is the
model's (hand-made table, chi-square at a fixed seed), top-k / top-p / temperature reshape it as
stated, top-k 1 is greedy, a row's samples do not depend on its batch; prefixes are honoured by
greedy, beam and sampling; no n-gram repeats. Then the same through `mtrain translate`."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from test_search import A, B_, C, D, TABLE, ScriptedModel, random_batch, random_model, src_of
from test_translate import checkpoint, tokenizer  # noqa: F401 (fixtures)
from typer.testing import CliRunner

from mtrain import translate as translate_module
from mtrain.cli import app
from mtrain.ensemble import Ensemble
from mtrain.search import Sampling, beam_search, greedy_search, sample, stream_key
from mtrain.tokenizer import BOS_ID, EOS_ID

N_DRAWS = 4000
CHI2_P001 = {1: 10.83, 2: 13.82, 5: 20.52}  # chi-square quantiles at p = 0.001 by degrees of freedom


def draws(model, sampling: Sampling, n: int = N_DRAWS, seed: int = 7, key: int = A) -> list[tuple[list[int], float]]:
    src = src_of(*[key] * n)
    return sample(model, src, torch.full((n,), 6), sampling, [stream_key(seed, i, 0) for i in range(n)])


def chi_square(counts: collections.Counter, expected: dict, n: int) -> float:
    assert set(counts) <= set(expected), f"drew outcomes of probability 0: {set(counts) - set(expected)}"
    return sum((counts[k] - n * p) ** 2 / (n * p) for k, p in expected.items())


def test_samples_follow_the_model_distribution_and_scores_are_their_log_probabilities():
    # Whole outputs of TABLE's sentence A, with their probabilities derived by hand from the table.
    expected = {(): 0.2, (A,): 0.5 * 0.6, (A, C): 0.5 * 0.4 * 0.6, (A, C, D): 0.5 * 0.4 * 0.4,
                (B_,): 0.3 * 0.1, (B_, C): 0.3 * 0.9}
    assert sum(expected.values()) == pytest.approx(1.0)
    out = draws(ScriptedModel(TABLE), Sampling())
    counts = collections.Counter(tuple(ids) for ids, _ in out)
    assert chi_square(counts, expected, N_DRAWS) < CHI2_P001[5]
    for ids, score in out[:50]:
        assert score == pytest.approx(math.log(expected[tuple(ids)]))


@pytest.mark.parametrize("sampling, first", [
    (Sampling(topk=2), {A: 0.5 / 0.8, B_: 0.3 / 0.8}),
    (Sampling(topp=0.6), {A: 0.5 / 0.8, B_: 0.3 / 0.8}),  # A alone (0.5) is short of 0.6; A + B reach it
    (Sampling(topp=0.5), {A: 1.0}),  # A alone reaches 0.5
    (Sampling(temperature=2.0), {t: p ** 0.5 / (0.5 ** 0.5 + 0.3 ** 0.5 + 0.2 ** 0.5)
                                 for t, p in ((A, 0.5), (B_, 0.3), (EOS_ID, 0.2))}),
], ids=["topk2", "topp0.6", "topp0.5", "temperature2"])
def test_topk_topp_and_temperature_reshape_the_first_token_distribution(sampling, first):
    out = draws(ScriptedModel(TABLE), sampling)
    counts = collections.Counter(ids[0] if ids else EOS_ID for ids, _ in out)
    if len(first) == 1:
        assert set(counts) == set(first)
    else:
        assert chi_square(counts, first, N_DRAWS) < CHI2_P001[len(first) - 1]


def test_topk_1_is_greedy_for_a_model_and_an_ensemble():
    model = random_model(1)
    src, max_len = random_batch(5, n=8)
    streams = [stream_key(3, i, 0) for i in range(8)]
    for decoder in (model, Ensemble([model, random_model(2)])):
        assert [ids for ids, _ in sample(decoder, src, max_len, Sampling(topk=1), streams)] == greedy_search(decoder, src, max_len)


def test_a_rows_sample_does_not_depend_on_its_batch():
    model = random_model(3)
    src, max_len = random_batch(9, n=7)
    streams = [stream_key(11, i, 0) for i in range(7)]
    together = sample(model, src, max_len, Sampling(topp=0.9), streams)
    order = [6, 2, 0, 5, 1, 4, 3]
    shuffled = sample(model, src[order], max_len[order], Sampling(topp=0.9), [streams[i] for i in order])
    assert [shuffled[order.index(i)][0] for i in range(7)] == [ids for ids, _ in together]
    for i in range(7):
        alone = src[i : i + 1, : int((src[i] != 0).sum())]
        assert sample(model, alone, max_len[i : i + 1], Sampling(topp=0.9), streams[i : i + 1])[0][0] == together[i][0]
    other_seed = sample(model, src, max_len, Sampling(topp=0.9), [stream_key(12, i, 0) for i in range(7)])
    assert [ids for ids, _ in other_seed] != [ids for ids, _ in together]


def greedy_with_prefix_uncached(model, src, max_len, prefix) -> list[int]:
    """Reference: the prefix fed as given, then argmax continuation, recomputing everything per step."""
    memory, out = model.encode(src), list(prefix)
    while len(out) < max(int(max_len), len(prefix)):
        logits = model.decode(torch.tensor([[BOS_ID, *out]]), memory, src)[0, -1].float()
        logits[[0, BOS_ID]] = float("-inf")
        token = int(logits.argmax())
        if token == EOS_ID:
            break
        out.append(token)
    return out


@torch.inference_mode()
def test_prefixes_are_honoured_by_greedy_beam_and_sampling():
    model = random_model(4)
    src, max_len = random_batch(2, n=4)
    prefixes = [[5, 6], [], [7, 7, 7], [9] * 20]  # the last is longer than its max_len: it is the whole output
    greedy = greedy_search(model, src, max_len, prefixes)
    for i, prefix in enumerate(prefixes):
        row = src[i : i + 1, : int((src[i] != 0).sum())]
        assert greedy[i] == greedy_with_prefix_uncached(model, row, max_len[i], prefix)
    assert greedy[3] == [9] * 20
    beams = beam_search(model, src, 4, 0.6, max_len, nbest=4, prefixes=prefixes)
    drawn = sample(model, src, max_len, Sampling(), [stream_key(0, i, 0) for i in range(4)], prefixes)
    for i, prefix in enumerate(prefixes):
        assert all(ids[: len(prefix)] == prefix for ids, score in beams[i] if score > float("-inf"))
        assert drawn[i][0][: len(prefix)] == prefix
    assert beams[3] == [([9] * 20, beams[3][0][1])] + [([], float("-inf"))] * 3  # the only possible output
    # A beam hypothesis's score counts the forced tokens: it is its full log-probability / lp(len).
    ids, score = beams[0][0]
    logits = model.decode(torch.tensor([[BOS_ID, *ids]]), model.encode(src[:1]), src[:1])[0].float()
    logp = torch.log_softmax(logits, -1).gather(1, torch.tensor([*ids, EOS_ID]).unsqueeze(1)).sum()
    assert score == pytest.approx(float(logp) / ((5 + len(ids) + 1) / 6) ** 0.6, abs=1e-4)


def ngrams(ids: list[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]


@torch.inference_mode()
@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_repeat_ngram_never_repeats(n):
    model = random_model(5)
    src, _ = random_batch(3, n=6)
    max_len = torch.full((6,), 30)
    streams = [stream_key(1, i, 0) for i in range(6)]
    free = greedy_search(model, src, max_len)
    assert any(len(set(ngrams(ids, n))) < len(ngrams(ids, n)) for ids in free), "the test needs repetitions to stop"
    outputs = greedy_search(model, src, max_len, no_repeat_ngram=n)
    outputs += [ids for nbest in beam_search(model, src, 3, 0.6, max_len, nbest=3, no_repeat_ngram=n) for ids, _ in nbest]
    outputs += [ids for ids, _ in sample(model, src, max_len, Sampling(), streams, no_repeat_ngram=n)]
    for ids in outputs:
        assert len(set(ngrams(ids, n))) == len(ngrams(ids, n)), ids


# ---------------------------------------------------------------- through `mtrain translate`

def translate(*args, input: str | None = None):
    return CliRunner().invoke(app, ["translate", *map(str, args)], input=input)


@pytest.fixture(scope="module")
def sources(multi30k_slice, tmp_path_factory):
    path = tmp_path_factory.mktemp("sampling") / "in.de"
    lines = (multi30k_slice / "test2016.de").read_text(encoding="utf-8").splitlines()[:12]
    path.write_text("\n".join(lines[:5] + [""] + lines[5:]) + "\n", encoding="utf-8")
    return path


def assert_same_samples(got: str, want: str) -> None:
    rows = [(line.split("\t", 2), other.split("\t", 2)) for line, other in zip(got.splitlines(), want.splitlines())]
    assert len(rows) == len(want.splitlines()) == len(got.splitlines())
    for (index, score, text), (index2, score2, text2) in rows:
        assert (index, text) == (index2, text2) and float(score) == pytest.approx(float(score2), abs=1e-3)


def test_sampling_is_reproducible_whatever_the_batching(checkpoint, sources, monkeypatch):  # noqa: F811
    args = ["--checkpoint", checkpoint, "--input", sources, "--sample", "--nbest", "3", "--seed", "5", "--device", "cpu"]
    first = translate(*args)
    assert first.exit_code == 0, first.output
    assert translate(*args).stdout == first.stdout
    # Other batches: the same samples; their scores may differ in float32's last bits.
    assert_same_samples(translate(*args, "--max-tokens", "12").stdout, first.stdout)
    monkeypatch.setattr(translate_module, "CHUNK_LINES", 4)
    assert_same_samples(translate(*args).stdout, first.stdout)  # chunks of 4 lines: sampling goes by line number
    lines = first.stdout.splitlines()
    assert len(lines) == 13 * 3 and [int(line.split("\t")[0]) for line in lines] == [i for i in range(13) for _ in range(3)]
    assert translate(*args[:-4], "--seed", "6", "--device", "cpu").stdout != first.stdout
    greedy = translate("--checkpoint", checkpoint, "--input", sources, "--greedy", "--device", "cpu").stdout
    top1 = translate("--checkpoint", checkpoint, "--input", sources, "--sample", "--topk", "1", "--device", "cpu").stdout
    assert top1 == greedy


def test_prefix_file_starts_each_translation(checkpoint, sources, tokenizer, tmp_path):  # noqa: F811
    n = len(sources.read_text(encoding="utf-8").splitlines())
    prefixes = ["A man", "", "Two  dogs"] + ["The"] * (n - 3)
    path = tmp_path / "prefix.en"
    path.write_text("\n".join(prefixes) + "\n", encoding="utf-8")
    for mode in (["--greedy"], ["--beam", "3"], ["--sample", "--seed", "1"]):
        result = translate("--checkpoint", checkpoint, "--input", sources, "--prefix", path, "--device", "cpu", *mode)
        assert result.exit_code == 0, result.output
        out = result.stdout.splitlines()
        assert len(out) == n
        for line, prefix in zip(out, tokenizer.tgt.normalize(prefixes)):
            assert line.startswith(prefix)
        assert out[5] == "The"  # an empty source line gets its prefix alone


@pytest.mark.parametrize("extra, needle", [
    (["--sample", "--topp", "0"], "--topp 0.0: must be in (0, 1]"),
    (["--sample", "--topp", "1.5"], "--topp 1.5: must be in (0, 1]"),
    (["--sample", "--temperature", "0"], "--temperature 0.0: must be above 0"),
    (["--sample", "--topk", "0"], "--topk 0: must be at least 1"),
    (["--topk", "3"], "--topk applies only to sampling"),
    (["--temperature", "0.5"], "--temperature applies only to sampling"),
    (["--seed", "2"], "--seed applies only to sampling"),
    (["--no-repeat-ngram", "-1"], "--no-repeat-ngram -1: must be 0"),
])
def test_bad_sampling_options_are_one_line_errors(checkpoint, sources, tmp_path, extra, needle):  # noqa: F811
    out = tmp_path / "out.en"
    result = translate("--checkpoint", checkpoint, "--input", sources, "--output", out, "--device", "cpu", *extra)
    assert result.exit_code == 1 and "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], result.stderr
    assert not out.exists()


def test_a_prefix_file_of_another_length_is_refused_before_any_output(checkpoint, sources, tmp_path):  # noqa: F811
    short = tmp_path / "short.en"
    short.write_text("A\nB\n", encoding="utf-8")
    out = tmp_path / "out.en"
    result = translate("--checkpoint", checkpoint, "--input", sources, "--prefix", short, "--output", out, "--device", "cpu")
    assert result.exit_code == 1 and f"{short}: 2 lines but {sources} has 13" in result.stderr
    assert not out.exists()
    # From stdin the count is only known at the end: still one line, and no output file.
    text = sources.read_text(encoding="utf-8")
    result = translate("--checkpoint", checkpoint, "--prefix", short, "--output", out, "--device", "cpu", input=text)
    assert result.exit_code == 1 and "fewer lines than <stdin>" in result.stderr
    assert not out.exists()
