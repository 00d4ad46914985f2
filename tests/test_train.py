"""`mtrain train` end to end on tiny models: accumulation, exact resume, failed saves, NaN
guard, early stopping, config mismatch, a copy task it must learn, and the CLI on real data."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch

from mtrain import checkpoint
from mtrain.config import load_config
from mtrain.errors import MtrainError

TINY = ["model.d_model=32", "model.d_ff=64", "model.n_heads=2", "model.n_encoder_layers=1",
        "model.n_decoder_layers=1", "train.max_tokens=256", "train.warmup_steps=10", "train.lr_scale=0.5",
        "train.log_every=2", "train.eval_max_sentences=8", "train.num_threads=1"]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def copy_task(tmp_path_factory, seed: int, sizes: tuple[int, int], vocab_size: int) -> Path:
    """A copy task (target = source) over the 12 words, `sizes` train and valid lines drawn with
    `seed`, tokenized like any corpus with a SentencePiece model of `vocab_size` pieces."""
    from mtrain.prepare import tokenize_corpus

    raw = tmp_path_factory.mktemp("copy-raw")
    rng = random.Random(seed)
    for split, n in zip(("train", "valid"), sizes):
        lines = "".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8))) + "\n" for _ in range(n))
        (raw / f"{split}.de").write_text(lines)
        (raw / f"{split}.en").write_text(lines)
    out = tmp_path_factory.mktemp("copy-tok")
    tokenize_corpus(load_config(None, [f"tokenizer.vocab_size={vocab_size}"]), data_dir=raw, out_dir=out,
                    splits=["train", "valid"])
    return out


@pytest.fixture(scope="session")
def copy_data(tmp_path_factory) -> Path:
    """A copy task (target = source) over 12 words, tokenized like any corpus."""
    return copy_task(tmp_path_factory, seed=0, sizes=(400, 20), vocab_size=290)


def run(data_dir: Path, run_dir: Path, *overrides: str) -> dict:
    from mtrain.train import train

    return train(load_config(None, TINY + list(overrides)), data_dir, run_dir, device="cpu")


def weights(path: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load(path)["model"]


# ---------------------------------------------------------------- the objective

def test_accumulation_equals_one_big_batch(copy_data):
    """Two micro-batches normalised by the update's tokens give the gradient of one batch of both."""
    from mtrain.data import TokenizedData, collate, target_tokens
    from mtrain.loss import Objective, forward_backward
    from mtrain.model import Transformer
    from mtrain.trainer import model_config_for_data

    cfg = model_config_for_data(load_config(None, TINY + ["model.dropout=0"]), TokenizedData(copy_data).tokenizer)
    split = TokenizedData(copy_data).split("train")
    torch.manual_seed(0)
    objective = Objective(Transformer(cfg.model), label_smoothing=0.1)
    a, b = np.arange(0, 5), np.arange(5, 12)
    total = target_tokens(split.tgt.lengths, [a, b])

    def grads(batches):
        objective.zero_grad()
        loss, _ = forward_backward(objective, [collate(split, x) for x in batches], total)
        return loss, [p.grad.clone() for p in objective.parameters()]

    loss_two, two = grads([a, b])
    loss_one, one = grads([np.concatenate([a, b])])
    assert loss_two == pytest.approx(loss_one, rel=1e-5)
    for g2, g1 in zip(two, one):
        torch.testing.assert_close(g2, g1, rtol=1e-4, atol=1e-6)


def test_cooldown_sets_the_lr_of_every_update(copy_data, tmp_path, capsys):
    """max_steps 12, cooldown 6: the logged lr of update s is 0.5 * 32^-0.5 * s^-0.5 (past warmup 10)
    times (13 - s) / 6 from update 7 on, ending at a sixth of the inverse-sqrt lr, not at 0.
    With early stopping on, the log says it could cut the cooldown (updates 7-12) short."""
    run(copy_data, tmp_path, "train.max_steps=12", "train.cooldown_steps=6", "train.log_every=1",
        "train.eval_every=100", "train.save_every=100", "train.patience=5")
    assert "before its lr cooldown (updates 7-12)" in capsys.readouterr().err
    logged = {r["step"]: r["lr"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
              if r["event"] == "train"}
    assert logged[12] == pytest.approx(0.5 * 32**-0.5 * 12**-0.5 / 6, rel=1e-9)
    assert logged[10] == pytest.approx(0.5 * 32**-0.5 * 10**-0.5 * 3 / 6, rel=1e-9)
    assert logged[6] == pytest.approx(0.5 * 32**-0.5 * 6 * 10**-1.5, rel=1e-9)  # warmup, before the cooldown


def test_cooldown_longer_than_the_run_is_refused():
    with pytest.raises(MtrainError, match="train.cooldown_steps=50 exceeds train.max_steps=40"):
        load_config(None, ["train.max_steps=40", "train.cooldown_steps=50"])


# ---------------------------------------------------------------- resume and faults

@pytest.mark.parametrize("extra", [[], ["train.sampling_alpha=0.3", "train.update_freq=5", "train.cooldown_steps=8",
                                    "train.rdrop_alpha=5"]],
                         ids=["cached-ids", "subword-sampling-cooldown-rdrop"])
def test_exact_resume_is_bit_identical(copy_data, tmp_path, stop_at_step, extra):
    """Stop at a save point (as SIGINT would), re-run the same command: every weight and every
    Adam moment equals an uninterrupted run's, though validation ran in between. With subword
    sampling (12-13 batches an epoch here), 5 batches per update run through 5 epochs, some
    updates mix two epochs' segmentations, and the stop falls inside epoch 3, whose sampling the
    resumed run must redraw identically; it also falls inside the lr cooldown (updates 5-12),
    which the resumed run must continue from the step alone."""
    args = ["train.max_steps=12", "train.save_every=3", "train.eval_every=4", "train.eval_max_sentences=2", *extra]
    full = run(copy_data, tmp_path / "full", *args)
    stop_at_step(6)
    stopped = run(copy_data, tmp_path / "split", *args)
    assert stopped["stopped"] == "interrupted" and stopped["step"] == 6
    stop_at_step(None)
    resumed = run(copy_data, tmp_path / "split", *args)
    assert resumed["step"] == full["step"] == 12
    a, b = checkpoint.load(tmp_path / "full" / "last.pt"), checkpoint.load(tmp_path / "split" / "last.pt")
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    moments_a, moments_b = a["train_state"]["optimizer"]["state"], b["train_state"]["optimizer"]["state"]
    assert all(torch.equal(moments_a[i]["exp_avg_sq"], moments_b[i]["exp_avg_sq"]) for i in moments_a)
    state_a, state_b = a["train_state"]["state"], b["train_state"]["state"]
    window_a, window_b = state_a.pop("window"), state_b.pop("window")
    assert state_a.pop("train_seconds") > 0 and state_b.pop("train_seconds") > 0  # wall time
    assert state_a == state_b
    window_a.pop("seconds"), window_b.pop("seconds")  # wall time, the one thing that may differ
    assert window_a == window_b
    # metrics.jsonl has each event once, and the same losses.
    losses = [[(r["step"], r["loss"]) for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())]
              for d in (tmp_path / "full", tmp_path / "split")]
    assert losses[0] == losses[1]


def test_tokens_per_s_of_a_window_spanning_a_restart():
    """A log window cut by a resume: tokens/s = all its tokens over the update time of both halves
    (200 tokens in 0.5 s + 0.5 s), not over the resumed half only; old checkpoints lack "seconds"."""
    from types import SimpleNamespace

    from mtrain.resume import TrainState
    from mtrain.train import Run

    for restored, expected in (({"loss": 2.0, "nll": 1.0, "tokens": 100, "steps": 1, "seconds": 0.5}, 200.0),
                               ({"loss": 2.0, "nll": 1.0, "tokens": 100, "steps": 1}, 400.0)):
        state = TrainState.from_saved({"step": 2, "window": dict(restored)})  # as resume loads it
        trainer = SimpleNamespace(state=state, tcfg=SimpleNamespace(log_every=2), stream=SimpleNamespace(epoch=1),
                                  device=torch.device("cpu"))
        loop, events = Run(trainer), []
        loop.record = events.append
        loop.log_window({"loss": 2.0, "nll": 1.0, "tokens": 100, "lr": 1e-3, "grad_norm": 1.0}, seconds=0.5)
        assert events[0]["tokens_per_s"] == pytest.approx(expected)
        assert events[0]["loss"] == pytest.approx(4.0 / 200) and state.window["tokens"] == 0
        assert "peak_memory_gib" not in events[0]  # CUDA's allocator alone counts a peak


def test_resume_with_other_model_config_fails(copy_data, tmp_path):
    run(copy_data, tmp_path, "train.max_steps=2", "train.eval_every=2")
    with pytest.raises(MtrainError, match=r"last\.pt: the model config differs .*d_model: 32 -> 64"):
        run(copy_data, tmp_path, "train.max_steps=4", "model.d_model=64")


def test_resume_with_other_tokenizer_fails(copy_data, tmp_path):
    run(copy_data, tmp_path, "train.max_steps=2", "train.eval_every=2")
    last = checkpoint.load(tmp_path / "last.pt")
    last["tokenizer"] = {**last["tokenizer"], "src_model": b"another model"}
    checkpoint.save_atomic(last, tmp_path / "last.pt")
    with pytest.raises(MtrainError, match=r"last\.pt: the run was trained with another SentencePiece model"):
        run(copy_data, tmp_path, "train.max_steps=4")


def test_resume_of_a_gpu_run_on_a_cpu_says_its_dropout_masks_differ(copy_data, tmp_path, capsys):
    """last.pt as a GPU run writes it (its GPU's generator saved beside the CPU one), resumed on a
    CPU: the run goes on, and the log says why it cannot match the GPU run bit for bit."""
    def as_a_gpu_run_writes_it(train_state: dict) -> None:
        train_state["rng"][0]["cuda"] = [torch.zeros(16, dtype=torch.uint8)]

    err = _resume_after_editing_last(copy_data, tmp_path, capsys, as_a_gpu_run_writes_it)
    assert "note: the checkpoint was written by a run on a GPU" in err and "resuming from" in err


def _resume_after_editing_last(copy_data, tmp_path, capsys, edit) -> str:
    """A 2-step run whose last.pt's train state `edit` changes in place, resumed to step 4: the
    resumed run's stderr."""
    run(copy_data, tmp_path, "train.max_steps=2", "train.eval_every=2")
    last = checkpoint.load(tmp_path / "last.pt")
    edit(last["train_state"])
    checkpoint.save_atomic(last, tmp_path / "last.pt")
    capsys.readouterr()
    run(copy_data, tmp_path, "train.max_steps=4", "train.eval_every=2")
    assert checkpoint.load(tmp_path / "last.pt")["train_state"]["state"]["step"] == 4
    return capsys.readouterr().err


def test_resume_after_mkl_changed_kernels_says_it_cannot_match_bit_for_bit(copy_data, tmp_path, capsys):
    """last.pt written before checkpoints recorded every fast path, where MKL ran other kernels
    than now (mtrain.cpu.mkl): the run goes on, and the log says why it cannot match an
    uninterrupted run bit for bit."""
    from mtrain.cpu import mkl

    def as_the_other_kernels_wrote_it_before_the_record(train_state: dict) -> None:
        assert train_state["mkl_intel_path"] == mkl.loaded()
        train_state["mkl_intel_path"] = not mkl.loaded()
        del train_state["acceleration"]

    err = _resume_after_editing_last(copy_data, tmp_path, capsys, as_the_other_kernels_wrote_it_before_the_record)
    assert "note: MKL ran its" in err and "will not match an uninterrupted one bit for bit" in err
    run(copy_data, tmp_path, "train.max_steps=6", "train.eval_every=2")  # saved as it runs now: no note
    assert "note: MKL ran" not in capsys.readouterr().err


@pytest.mark.parametrize("path", ["native", "fast"])
def test_resume_where_the_cpu_fast_paths_differ_says_so_in_one_line(copy_data, tmp_path, capsys, path):
    """last.pt records which CPU fast paths trained it (mtrain.cpu.acceleration); a resume on a
    machine where one differs (no compiler there, MTRAIN_CPU_FAST=0) goes on and says so once."""
    from mtrain import cpu

    def as_another_machine_wrote_it(train_state: dict) -> None:
        assert train_state["acceleration"] == cpu.acceleration()
        train_state["acceleration"][path] = not train_state["acceleration"][path]

    err = _resume_after_editing_last(copy_data, tmp_path, capsys, as_another_machine_wrote_it)
    notes = [line for line in err.splitlines() if "the CPU fast paths differ" in line]
    assert len(notes) == 1 and f"{path} " in notes[0] and "bit for bit" in notes[0]
    assert "cpu: stand-ins" in err  # the one line saying which paths run
    run(copy_data, tmp_path, "train.max_steps=6", "train.eval_every=2")
    assert "the CPU fast paths differ" not in capsys.readouterr().err
    assert checkpoint.load(tmp_path / "last.pt")["train_state"]["acceleration"] == cpu.acceleration()


def test_failed_checkpoint_write_keeps_previous_files(copy_data, tmp_path, monkeypatch):
    """Disk full during the second last.pt write: a half-written temp file, then OSError."""
    real_save, calls = torch.save, []

    def flaky_save(obj, handle, *a, **k):
        calls.append(obj["step"])
        if "train_state" in obj and obj["step"] == 4:
            handle.write(b"PK\x03\x04 half a zip")
            raise OSError(28, "No space left on device")
        return real_save(obj, handle, *a, **k)

    monkeypatch.setattr(checkpoint.torch, "save", flaky_save)
    with pytest.raises(MtrainError, match=r"last\.pt: checkpoint write failed .*No space left.*intact"):
        run(copy_data, tmp_path, "train.max_steps=6", "train.save_every=2", "train.eval_every=2")
    assert checkpoint.load(tmp_path / "last.pt")["step"] == 2
    assert checkpoint.load(tmp_path / "best.pt")["step"] in (2, 4)
    assert not list(tmp_path.glob(".*.tmp"))  # no temp file left behind


def test_nonfinite_loss_is_skipped_and_counted(copy_data, tmp_path, nan_losses):
    nan_losses({3})
    result = run(copy_data, tmp_path, "train.max_steps=5", "train.eval_every=5")
    assert (result["step"], result["nonfinite"]) == (5, 1)
    assert all(torch.isfinite(w).all() for w in weights(tmp_path / "last.pt").values())


def test_an_update_the_float16_scaler_skips_is_not_counted(copy_data, tmp_path, monkeypatch):
    """The gradient scaler skips the 3rd update (overflowed float16 gradients): the loop runs one
    more train_step, every step 1..5 is logged once with the lr of its own step, and no non-finite
    loss is counted. The scaler itself is tested in test_train_units; here its verdict is faked."""
    from mtrain.trainer import Trainer

    clip_and_step, calls = Trainer._clip_and_step, []

    def skip_third(self):
        calls.append(1)
        if len(calls) == 3:  # what _clip_and_step returns when the scaler skipped the step
            self.optimizer.zero_grad(set_to_none=True)
            return float("inf")
        return clip_and_step(self)

    monkeypatch.setattr(Trainer, "_clip_and_step", skip_third)
    result = run(copy_data, tmp_path, "train.max_steps=5", "train.log_every=1", "train.eval_every=100")
    assert (len(calls), result["step"], result["nonfinite"]) == (6, 5, 0)
    logged = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
              if r["event"] == "train"]
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5]
    for r in logged:  # warmup 10: lr = 0.5 * 32^-0.5 * step * 10^-1.5, not one step ahead
        assert r["lr"] == pytest.approx(0.5 * 32**-0.5 * r["step"] * 10**-1.5, rel=1e-9)


def test_too_many_nonfinite_losses_stop_naming_the_step(copy_data, tmp_path, nan_losses):
    nan_losses(range(3, 101))
    with pytest.raises(MtrainError, match=r"^step 3: 4 non-finite losses in a row"):
        run(copy_data, tmp_path, "train.max_steps=10", "train.max_nonfinite=4")


def test_early_stopping_and_step_files(copy_data, tmp_path):
    # The stub/real translations of a barely trained model do not improve BLEU every time; with
    # patience 1 training stops at the first validation without a gain, before max_steps.
    result = run(copy_data, tmp_path, "train.max_steps=40", "train.eval_every=1", "train.patience=1",
                 "train.save_every=1", "train.keep_last=2", "train.average_last=2", "train.lr_scale=0")
    assert result["stopped"] == "early_stopping" and result["step"] == 2
    assert sorted(p.name for p in tmp_path.glob("step-*.pt")) == ["step-1.pt", "step-2.pt"]
    assert checkpoint.load(tmp_path / "averaged.pt")["averaged_from"][-1].endswith("step-2.pt")
    again = run(copy_data, tmp_path, "train.max_steps=40", "train.eval_every=1", "train.patience=1",
                "train.save_every=1", "train.keep_last=2", "train.average_last=2", "train.lr_scale=0")
    assert again["stopped"] == "done" and again["step"] == 2


def test_keep_every_spares_step_files_on_its_grid(copy_data, tmp_path):
    """keep_last 2 keeps the newest two; keep_every 3 also spares step-3 (step-6 is both)."""
    run(copy_data, tmp_path, "train.max_steps=7", "train.eval_every=7", "train.save_every=1",
        "train.keep_last=2", "train.keep_every=3", "train.lr_scale=0")
    steps = sorted(int(p.stem.split("-")[1]) for p in tmp_path.glob("step-*.pt"))
    assert steps == [3, 6, 7]


def test_free_memory_is_released_after_each_validation_or_save(copy_data, tmp_path, monkeypatch):
    import mtrain.train as train_module

    released: list[int] = []
    monkeypatch.setattr(train_module, "release_free_memory", lambda: released.append(step_now()) or True)
    step_now = lambda: json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["step"]  # noqa: E731
    run(copy_data, tmp_path, "train.max_steps=9", "train.eval_every=4", "train.save_every=3", "train.log_every=1",
        "train.lr_scale=0")
    assert released == [3, 4, 6, 8, 9]  # validations at 4, 8 and 9 (the last), saves at 3, 6 and 9


@pytest.mark.parametrize("decode_amp", ["off", "bf16"])
def test_validation_decodes_in_decode_precision_not_the_training_one(copy_data, tmp_path, monkeypatch, decode_amp):
    """Training under bfloat16 autocast, validation translates as `mtrain translate` would: float32
    with decode.amp off, a bfloat16 copy of the model with decode.amp=bf16, never under the training
    loop's autocast, and the trained weights stay float32."""
    import mtrain.hardware as hardware
    import mtrain.translate as translate_module

    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)  # bf16 resolves on any CPU
    seen: list[tuple[bool, torch.dtype]] = []
    search = translate_module._search

    def spy(model, *args, **kwargs):
        seen.append((torch.is_autocast_enabled("cpu"), next(model.parameters()).dtype))
        return search(model, *args, **kwargs)

    monkeypatch.setattr(translate_module, "_search", spy)
    run(copy_data, tmp_path, "train.max_steps=2", "train.eval_every=2", "train.save_every=2", "train.amp=bf16",
        f"decode.amp={decode_amp}")
    want = torch.bfloat16 if decode_amp == "bf16" else torch.float32
    assert seen and all(entry == (False, want) for entry in seen)
    assert all(w.dtype == torch.float32 for w in weights(tmp_path / "last.pt").values() if w.is_floating_point())


def test_kill_during_finish_resumes_into_finish(copy_data, tmp_path):
    """last.pt written at the final step, then a kill before averaging: the re-run finishes the job."""
    args = ["train.max_steps=4", "train.save_every=2", "train.eval_every=2", "train.average_last=2"]
    run(copy_data, tmp_path, *args)
    last = checkpoint.load(tmp_path / "last.pt")
    last["train_state"]["state"]["finished"] = ""  # as saved by the loop at step 4, before finish()
    checkpoint.save_atomic(last, tmp_path / "last.pt")
    (tmp_path / "averaged.pt").unlink()
    result = run(copy_data, tmp_path, *args)
    assert result["stopped"] == "max_steps" and (tmp_path / "averaged.pt").is_file()


# ---------------------------------------------------------------- it learns

@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_tiny_model_learns_copy_task(copy_data, tmp_path, amp):
    """No smoothing, no dropout: the per-token NLL of copying must fall from ~ln(12) to near 0, in
    float32 and under bfloat16 autocast on the CPU (train.amp=bf16) alike. Judged by the median of
    the last six logged values: under bfloat16 the NLL of the last 150 steps jumps between about
    0.005 and 0.18 from one logged step to the next (with PyTorch's loss passes and with the C ones,
    seeds 1-3), so a single logged value lands on either side of 0.05 by chance."""
    result = run(copy_data, tmp_path, "train.max_steps=400", f"train.amp={amp}", "train.eval_every=400", "train.save_every=400",
                 "train.log_every=25", "train.label_smoothing=0", "model.dropout=0", "train.warmup_steps=50",
                 "train.lr_scale=0.3", "model.d_model=64", "model.d_ff=128", "model.n_heads=4",
                 "train.eval_max_sentences=0")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_nll = [r["nll"] for r in records if r["event"] == "train"]
    assert train_nll[0] > 2.0 and statistics.median(train_nll[-6:]) < 0.1, train_nll
    assert result["step"] == 400
    assert result["best_bleu"] > 80  # greedy translations of the valid split copy it


# ---------------------------------------------------------------- the CLI on real data

def test_cli_train_on_multi30k_slice(tokenized_slice, tmp_path):
    from typer.testing import CliRunner

    from mtrain.cli import app

    out = tmp_path / "run"
    args = ["train", "--data", str(tokenized_slice), "--out", str(out), "--device", "cpu", "--max-steps", "4"]
    for item in TINY + ["train.max_tokens=1024", "train.eval_every=2", "train.save_every=2", "train.eval_max_sentences=5"]:
        args += ["--set", item]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    for name in ("best.pt", "last.pt", "metrics.jsonl", "plot.png", "config.yaml", "step-4.pt"):
        assert (out / name).is_file(), name
    events = [json.loads(line)["event"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert events.count("valid") == 2 and "train" in events
    ckpt = checkpoint.load(out / "best.pt")
    assert ckpt["config"]["model"]["vocab_size"] == 1000 and ckpt["tokenizer"] and ckpt["stats"]
    assert "train_state" not in ckpt
    # Re-running the finished command resumes, sees nothing to do, and says so.
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and "resuming from" in again.output and "already ended at step 4" in again.output


def test_cli_dry_run_and_print_config(tokenized_slice):
    from typer.testing import CliRunner

    from mtrain.cli import app

    printed = CliRunner().invoke(app, ["train", "--print-config", "--set", "train.max_steps=7"])
    assert printed.exit_code == 0 and "max_steps: 7" in printed.output
    missing = CliRunner().invoke(app, ["train", "--out", "x"])
    assert missing.exit_code == 1 and "--data is missing" in missing.output
    dry = CliRunner().invoke(app, ["train", "--data", str(tokenized_slice), "--dry-run", "--device", "cpu",
                                   "--set", "model.d_model=32", "--set", "model.n_heads=2"])
    assert dry.exit_code == 0, dry.output
    summary = json.loads(dry.stdout[dry.stdout.index("{"):])
    assert summary["parameters"] > 0 and summary["batches_per_epoch"] > 0
    assert summary["tokens_per_batch"]["max"] <= 4096 and summary["model"]["vocab_size"] == 1000


@pytest.mark.slow  # two CLI subprocesses (torch import each) plus a reference run: ~30-50 s on 2 busy cores
def test_sigterm_saves_and_resume_matches_uninterrupted(copy_data, tmp_path):
    """SIGTERM mid-run: the step in flight finishes, last.pt is saved, exit code 143; re-running
    the same command ends bit-identical to a run that was never stopped."""
    import os
    import signal
    import subprocess
    import sys
    import time

    args = ["train.max_steps=60", "train.log_every=1", "train.eval_every=1000", "train.save_every=1000"]
    command = [sys.executable, "-m", "mtrain", "train", "--data", str(copy_data), "--out", str(tmp_path / "cut"),
               "--device", "cpu"] + [x for item in TINY + args for x in ("--set", item)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    metrics = tmp_path / "cut" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.02)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "SIGTERM" in err and "re-run the same command to resume" in err
    stopped_at = checkpoint.load(tmp_path / "cut" / "last.pt")["step"]
    assert 3 <= stopped_at < 60
    resumed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert resumed.returncode == 0 and f"resuming from {tmp_path / 'cut' / 'last.pt'}: step {stopped_at}" in resumed.stderr
    whole = [str(tmp_path / "whole") if part == str(tmp_path / "cut") else part for part in command]
    assert subprocess.run(whole, capture_output=True, text=True, env=env, timeout=120).returncode == 0
    a, b = weights(tmp_path / "whole" / "last.pt"), weights(tmp_path / "cut" / "last.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_config_direction_must_match_the_tokenized_data(tokenized_slice, tmp_path):
    """The slice is tokenized de->en; an en->de config must not silently train de->en."""
    from mtrain.config import load_config
    from mtrain.errors import MtrainError
    from mtrain.train import train

    cfg = load_config(None, ["data.src=en", "data.tgt=de", "train.max_steps=1"])
    with pytest.raises(MtrainError, match="tokenized as de->en"):
        train(cfg, tokenized_slice, tmp_path / "run", device="cpu")
