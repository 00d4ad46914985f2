"""train.compile: the objective under torch.compile computes what the eager one does. Without dropout
the two agree on the loss, the NLL and every gradient, on batches of different shapes (one graph with
dynamic shapes serves them all); a compiled `mtrain train` run learns a copy task and saves; and
benchmarks/gpu_step.py --compile times the compiled step beside the others. Slow: the first call
compiles with a C++ compiler, which these tests need."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mtrain import checkpoint
from mtrain.config import ModelConfig
from mtrain.data import Ragged, Split, collate, to_ragged_arrays
from mtrain.loss import Objective
from mtrain.model import Transformer
from test_train import copy_data, run  # noqa: F401 (copy_data: a fixture, the copy task's tokenized data)

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                 reason="torch.compile on a CPU needs a C++ compiler")]


def batch(lengths: list[tuple[int, int]], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ids at these (source, target) lengths, padded as training pads them (mtrain.data.collate)."""
    rng = np.random.default_rng(seed)
    src, tgt = ([rng.integers(4, 50, n).tolist() for n in side] for side in zip(*lengths))
    split = Split("random", Ragged(*to_ragged_arrays(src)), Ragged(*to_ragged_arrays(tgt)), Path("."))
    return collate(split, range(len(lengths)))


def losses_and_grads(objective, model, b):
    model.zero_grad(set_to_none=True)
    loss, nll = objective(*b)
    loss.backward()
    return loss.detach(), nll.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_compiled_objective_equals_the_eager_one_without_dropout():
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, d_ff=64, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, vocab_size=50,
                      dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    model = Transformer(cfg).train()
    eager = Objective(model, 0.1)
    compiled = torch.compile(Objective(model, 0.1), dynamic=True)  # as trainer.py does for train.compile
    shapes = [[(6, 5), (2, 5), (4, 1)], [(10, 8), (3, 2), (7, 8), (1, 4)], [(4, 11), (4, 3)]]  # ragged, padded both sides
    for seed, lengths in enumerate(shapes):
        b = batch(lengths, seed)
        want_loss, want_nll, want_grads = losses_and_grads(eager, model, b)
        got_loss, got_nll, got_grads = losses_and_grads(compiled, model, b)
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(got_nll, want_nll, rtol=1e-5, atol=1e-4)
        assert got_grads.keys() == want_grads.keys()
        for name in want_grads:
            torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_compiled_training_run_learns_the_copy_task(copy_data, tmp_path):
    """`mtrain train` with train.compile on: the copy task's NLL falls as it does eagerly, and the
    run saves a checkpoint that loads."""
    result = run(copy_data, tmp_path, "train.compile=true", "train.max_steps=150", "train.eval_every=150",
                 "train.save_every=150", "train.log_every=25", "train.label_smoothing=0", "model.dropout=0",
                 "train.warmup_steps=50", "train.lr_scale=0.3", "train.eval_max_sentences=0")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    nll = [r["nll"] for r in records if r["event"] == "train"]
    assert result["step"] == 150 and nll[0] > 2.0 and nll[-1] < 0.5 * nll[0], nll
    saved = checkpoint.load(tmp_path / "last.pt")
    assert saved["step"] == 150 and "train_state" in saved and not any(k.startswith("_orig_mod") for k in saved["model"])


def test_gpu_step_benchmark_times_the_compiled_step():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_step.py"), "--device", "cpu", "--quick",
                           "--json", "--compile"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    [row] = json.loads(done.stdout)["rows"]
    assert row["mtrain compiled"]["tok_s"] > 0 and row["mtrain_compiled_vs_nn_transformer"] > 0
