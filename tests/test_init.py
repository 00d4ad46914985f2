"""`mtrain train --init-from CKPT`: a new run from a trained model's weights and model section,
with its own optimizer and schedule, resumable bit for bit; data in another vocabulary, or a model
key that contradicts CKPT, stop it in one line before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mtrain import checkpoint
from mtrain.cli import app
from mtrain.config import load_config
from test_train import TINY, copy_data, copy_task  # noqa: F401  (copy_data: the copy-task corpus fixture)

GENERAL = ["train.max_steps=6", "train.save_every=3", "train.eval_every=6", "train.eval_max_sentences=2"]
NEW = ["train.max_steps=8", "train.save_every=4", "train.eval_every=8", "train.eval_max_sentences=2",
       "train.warmup_steps=3", "train.lr_scale=0.25"]


def cli_train(data: Path, out: Path, *options: str, settings: list[str] = ()) -> object:
    args = ["train", "--data", str(data), "--out", str(out), "--device", "cpu", *options]
    for item in settings:
        args += ["--set", item]
    return CliRunner().invoke(app, args)


@pytest.fixture(scope="module")
def general(copy_data, tmp_path_factory) -> Path:
    """A trained model to start from: 6 updates of the tiny copy-task model."""
    from mtrain.train import train

    out = tmp_path_factory.mktemp("general")
    train(load_config(None, TINY + GENERAL), copy_data, out, device="cpu")
    return out / "last.pt"


def start_config(general: Path, *overrides: str):
    from mtrain.config import set_keys
    from mtrain.init import config_for, read_start

    start = read_start(general)
    settings = list(overrides)
    return config_for(load_config(None, settings), start, set_keys(None, settings)["model"]), start


def test_a_new_run_starts_from_exactly_the_checkpoints_weights_with_a_fresh_optimizer(general, copy_data, tmp_path):
    from mtrain import distributed
    from mtrain.trainer import Trainer

    cfg, start = start_config(general, *[s for s in TINY if s.startswith("train.")], *NEW)
    trainer = Trainer(cfg, copy_data, tmp_path / "new", torch.device("cpu"), distributed.from_env(), start)
    state = trainer.model.state_dict()
    assert state.keys() == start.weights.keys()
    assert all(torch.equal(state[key], start.weights[key]) for key in state)
    assert trainer.state.step == 0 and not trainer.optimizer.state  # no Adam moments carried over
    assert cfg.model == load_config(None, TINY).model.__class__(**checkpoint.load(general)["config"]["model"])


def test_the_new_run_has_its_own_schedule_and_records_where_it_started(general, copy_data, tmp_path):
    """Its steps and lr count from 0 under its own warmup; init_from.json names CKPT and its
    SHA-256; its weights move away from CKPT's."""
    from mtrain.init import sha256_of
    from mtrain.schedule import lr_at

    out = tmp_path / "new"
    result = cli_train(copy_data, out, "--init-from", str(general), settings=TINY + NEW)
    assert result.exit_code == 0, result.output
    assert "starting from" in result.output
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in logged if "lr" in row]
    cfg = load_config(None, TINY + NEW).train
    assert steps[0]["step"] == 2 and [row["lr"] for row in steps] == pytest.approx(
        [lr_at(row["step"], 32, cfg.warmup_steps, cfg.lr_scale, cfg.max_steps, cfg.cooldown_steps) for row in steps])
    record = json.loads((out / "init_from.json").read_text())
    assert record == {"path": str(general.resolve()), "sha256": sha256_of(general)}
    last, before = checkpoint.load(out / "last.pt"), checkpoint.load(general)
    assert last["train_state"]["state"]["step"] == 8
    assert any(not torch.equal(last["model"][k], before["model"][k]) for k in last["model"])


def test_a_stopped_new_run_resumes_bit_for_bit(general, copy_data, tmp_path, stop_at_step):
    from mtrain.train import train

    cfg, start = start_config(general, *[s for s in TINY if s.startswith("train.")], *NEW)
    full = train(cfg, copy_data, tmp_path / "full", device="cpu", start=start)
    stop_at_step(4)
    assert train(cfg, copy_data, tmp_path / "split", device="cpu", start=start)["stopped"] == "interrupted"
    stop_at_step(None)
    resumed = train(cfg, copy_data, tmp_path / "split", device="cpu", start=start)
    assert resumed["step"] == full["step"] == 8
    a, b = checkpoint.load(tmp_path / "full" / "last.pt"), checkpoint.load(tmp_path / "split" / "last.pt")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    moments_a, moments_b = a["train_state"]["optimizer"]["state"], b["train_state"]["optimizer"]["state"]
    assert all(torch.equal(moments_a[i]["exp_avg"], moments_b[i]["exp_avg"]) for i in moments_a)


@pytest.fixture(scope="module")
def other_vocabulary(tmp_path_factory) -> Path:
    """The copy task's words tokenized with a SentencePiece model of its own."""
    return copy_task(tmp_path_factory, seed=1, sizes=(300, 10), vocab_size=280)


def test_data_in_another_vocabulary_is_one_line_and_nothing_is_written(general, other_vocabulary, tmp_path):
    out = tmp_path / "new"
    result = cli_train(other_vocabulary, out, "--init-from", str(general), settings=TINY + NEW)
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "another SentencePiece model" in lines[0] and f"--spm-from {general}" in lines[0]
    assert not out.exists()


def test_model_keys_come_from_the_checkpoint_and_only_dropout_may_change(general, copy_data, tmp_path):
    clash = cli_train(copy_data, tmp_path / "clash", "--init-from", str(general),
                      settings=TINY + NEW + ["model.d_model=64"])
    assert clash.exit_code == 1 and not (tmp_path / "clash").exists()
    assert clash.output.strip().splitlines() == [clash.output.strip()] and "model.d_model=64 differs" in clash.output
    # the model keys TINY sets agree with CKPT's; dropout changes; max_len, set nowhere, is CKPT's
    out = tmp_path / "dropout"
    result = cli_train(copy_data, out, "--init-from", str(general), settings=TINY + NEW + ["model.dropout=0.3"])
    assert result.exit_code == 0, result.output
    model = checkpoint.load(out / "last.pt")["config"]["model"]
    stored = checkpoint.load(general)["config"]["model"]
    assert model == {**stored, "dropout": 0.3}
    # without TINY's model keys at all: the shape is CKPT's, not the paper's defaults
    bare = cli_train(copy_data, tmp_path / "bare", "--init-from", str(general),
                     settings=[s for s in TINY if s.startswith("train.")] + NEW + ["train.max_steps=1"])
    assert bare.exit_code == 0, bare.output
    assert checkpoint.load(tmp_path / "bare" / "last.pt")["config"]["model"] == stored


def test_a_run_continues_only_from_the_checkpoint_it_started_from(general, copy_data, tmp_path):
    out = tmp_path / "new"
    assert cli_train(copy_data, out, "--init-from", str(general), settings=TINY + NEW).exit_code == 0
    other = general.parent / "step-3.pt"
    refused = cli_train(copy_data, out, "--init-from", str(other), settings=TINY + NEW + ["train.max_steps=10"])
    assert refused.exit_code == 1 and "this run started from" in refused.output
    # a run from scratch is not continued with --init-from either
    scratch = tmp_path / "scratch"
    assert cli_train(copy_data, scratch, settings=TINY + ["train.max_steps=2", "train.eval_every=2"]).exit_code == 0
    refused = cli_train(copy_data, scratch, "--init-from", str(general), settings=TINY + NEW)
    assert refused.exit_code == 1 and "did not start from a checkpoint" in refused.output
