"""`mtrain score`: the teacher-forced log-probability equals the training loss's NLL for the same
pairs (label smoothing off), an ensemble scores the log of its members' mean probability, and the
command streams one line per pair with one-line errors for mismatched files."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import DEVICES
from test_search import DecodeOnly, random_model
from test_translate import checkpoint, tokenizer  # noqa: F401 (fixtures)
from typer.testing import CliRunner

from mtrain import search
from mtrain.cli import app
from mtrain.data import TokenizedData, collate, target_tokens
from mtrain.ensemble import Ensemble
from mtrain.loss import Objective
from mtrain.score import pairs_split, score_batch, score_pairs
from mtrain.tokenizer import BOS_ID, EOS_ID


def test_score_equals_the_training_nll_of_the_same_pairs(tokenized_slice):
    from mtrain.config import ModelConfig
    from mtrain.model import Transformer

    data = TokenizedData(tokenized_slice)
    split, tok = data.split("valid"), data.tokenizer
    torch.manual_seed(0)
    model = Transformer(ModelConfig(d_model=32, d_ff=64, n_heads=2, n_encoder_layers=1, n_decoder_layers=1,
                                    vocab_size=tok.tgt.vocab_size, max_len=128)).eval()
    indices = np.arange(40)
    with torch.no_grad():
        _, nll_sum = Objective(model, label_smoothing=0.0)(*collate(split, indices))
    scores, n_cut = score_pairs(model, tok, split.src_text()[:40], split.tgt_text()[:40], 300, "cpu")
    assert n_cut == 0
    assert -sum(total for total, _ in scores) == pytest.approx(float(nll_sum), rel=1e-5)
    assert sum(n for _, n in scores) == target_tokens(split.tgt.lengths, [indices])  # pieces + EOS each
    alone = [score_pairs(model, tok, [s], [t], 300, "cpu")[0][0] for s, t in
             zip(split.src_text()[:5], split.tgt_text()[:5])]
    assert [total for total, _ in alone] == pytest.approx([total for total, _ in scores[:5]], abs=1e-4)


@torch.inference_mode()
def test_an_ensemble_scores_the_log_of_the_mean_probability():
    a, b = random_model(1), random_model(2)
    targets = [[9, 4, 10], [6]]
    src, tgt_in, tgt_out = collate(pairs_split([[5, 6, 7], [8]], targets), [0, 1])
    assert src.tolist() == [[5, 6, 7, EOS_ID], [8, EOS_ID, 0, 0]]
    assert tgt_in.tolist() == [[BOS_ID, 9, 4, 10], [BOS_ID, 6, 0, 0]] and tgt_out.tolist() == [[9, 4, 10, EOS_ID], [6, EOS_ID, 0, 0]]
    got = score_batch(Ensemble([a, b]), src, tgt_in, tgt_out)
    for row, ids in enumerate(targets):
        n = len(ids) + 1
        probs = [torch.softmax(m(src[row : row + 1], tgt_in[row : row + 1, :n]).double(), -1)[0] for m in (a, b)]
        want = sum(math.log((probs[0][t, y] + probs[1][t, y]) / 2) for t, y in enumerate(tgt_out[row, :n].tolist()))
        assert got[row] == pytest.approx(want, abs=1e-4)


class CountingRows:
    """A model whose project records how many rows it was given."""

    def __init__(self, model) -> None:
        self.model, self.cfg, self.rows = model, model.cfg, []

    def encode(self, src):
        return self.model.encode(src)

    def decode_states(self, tgt, memory, src, cache=None):
        return self.model.decode_states(tgt, memory, src, cache)

    def project(self, states):
        self.rows.append(states.size(0))
        return self.model.project(states)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("members", [1, 2])
@torch.inference_mode()
def test_scores_come_from_the_real_positions_a_block_at_a_time(monkeypatch, members, device):
    """Scoring projects only the real target positions, a few rows at a time (search.BLOCK_BYTES),
    and gives what all of decode's logits at once give: for one model and for an ensemble."""
    models = [random_model(seed).to(device) for seed in range(1, members + 1)]
    model = models[0] if members == 1 else Ensemble(models)
    targets = [[9, 4, 10, 5, 6], [6], [], [7, 7]]
    batch = pairs_split([[5, 6, 7], [8], [9, 4], [10, 11, 5, 6]], targets)
    src, tgt_in, tgt_out = collate(batch, [0, 1, 2, 3], device=torch.device(device))
    want = score_batch(DecodeOnly(model), src, tgt_in, tgt_out)
    monkeypatch.setattr(search, "BLOCK_BYTES", 4 * model.cfg.vocab_size * 3)
    counting = CountingRows(model)
    got = score_batch(counting, src, tgt_in, tgt_out)
    assert got == pytest.approx(want, abs=1e-5)
    assert sum(len(t) + 1 for t in targets) == 12  # real positions: the pieces and EOS
    assert counting.rows == [3, 3, 3, 3]  # no padding (the batch is 4 x 6)
    assert tgt_out.numel() == 24


def score(*args):
    return CliRunner().invoke(app, ["score", *map(str, args)])


@pytest.fixture
def pairs(multi30k_slice, tmp_path):
    src, tgt = tmp_path / "in.de", tmp_path / "in.en"
    de = (multi30k_slice / "valid.de").read_text(encoding="utf-8").splitlines()[:30]
    en = (multi30k_slice / "valid.en").read_text(encoding="utf-8").splitlines()[:30]
    en[3] = ""  # an empty target scores just </s>
    src.write_text("\n".join(de) + "\n", encoding="utf-8")
    tgt.write_text("\n".join(en) + "\n", encoding="utf-8")
    return src, tgt


def test_score_command_prints_one_line_per_pair(checkpoint, pairs, tmp_path):  # noqa: F811
    src, tgt = pairs
    result = score("--checkpoint", checkpoint, "--src", src, "--tgt", tgt, "--device", "cpu")
    assert result.exit_code == 0, result.output
    rows = [line.split("\t") for line in result.stdout.splitlines()]
    assert len(rows) == 30 and all(len(row) == 3 for row in rows)
    for total, n, mean in rows:
        assert float(total) < 0 and int(n) >= 1 and float(mean) == pytest.approx(float(total) / int(n), abs=1e-5)
    assert rows[3][1] == "1"
    out = tmp_path / "scores.jsonl"
    result = score("--checkpoint", checkpoint, "--checkpoint", checkpoint, "--src", src, "--tgt", tgt, "--json",
                   "--output", out, "--max-tokens", "16", "--device", "cpu")
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    # An ensemble of a model with itself is that model; other batches change only float32's last bits.
    assert [r["logprob"] for r in records] == pytest.approx([float(total) for total, _, _ in rows], abs=1e-3)
    assert [r["tokens"] for r in records] == [int(n) for _, n, _ in rows]


def test_score_files_of_different_lengths_are_refused_before_any_output(checkpoint, pairs, tmp_path):  # noqa: F811
    src, tgt = pairs
    short = tmp_path / "short.en"
    short.write_text("A dog.\n", encoding="utf-8")
    out = tmp_path / "scores.txt"
    result = score("--checkpoint", checkpoint, "--src", src, "--tgt", short, "--output", out, "--device", "cpu")
    assert result.exit_code == 1 and "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{short}: 1 line but {src} has 30" in errors[0]
    assert not out.exists()
    missing = score("--checkpoint", checkpoint, "--src", src, "--tgt", tmp_path / "nope.en", "--device", "cpu")
    assert missing.exit_code == 1 and "nope.en: target file not found" in missing.stderr
