"""train.max_time: the lr cooldown placed in training time, the stop at the budget, the final
validation and averaging, and exact resume. A fake clock makes each update take exactly 10
seconds, so every lr and every stop below is derived by hand."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import yaml

from mtrain import checkpoint
from mtrain.config import load_config
from mtrain.errors import MtrainError
from mtrain.schedule import format_duration, inverse_sqrt_lr, lr_at, parse_duration, time_cooldown_factor
from test_recipe import ROOT, VENV_PATH, load_script
from test_train import copy_data, run  # noqa: F401  (copy_data: the copy-task corpus fixture)

time_budget_report = load_script(ROOT / "scripts" / "time_budget_report.py", "time_budget_report")

UPDATE_SECONDS = 10.0
BUDGET = ["train.max_time=60s", "train.cooldown_fraction=0.5", "train.max_steps=100", "train.log_every=1",
          "train.save_every=2", "train.eval_every=100", "train.average_last=2"]


@pytest.fixture
def fake_clock(monkeypatch):
    """mtrain.train's clock, advanced 10 s by each optimizer update and by nothing else
    (validation, saving and start-up take no fake time); returns the mutable [now]."""
    import mtrain.train as train_module
    from mtrain.trainer import Trainer

    now = [1000.0]
    update = Trainer._update

    def timed_update(self, *args):
        stats = update(self, *args)
        now[0] += UPDATE_SECONDS
        return stats

    monkeypatch.setattr(Trainer, "_update", timed_update)
    monkeypatch.setattr(train_module, "clock", lambda: now[0])
    return now


def metrics(run_dir, event: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["event"] == event]


# ---------------------------------------------------------------- the schedule alone

def test_time_cooldown_is_a_pure_function_of_training_time():
    """Budget 100 s, cooldown 0.25 of it: lr factor 1 until 75 s, then (100 - t) / 25, 0 at the budget."""
    assert [time_cooldown_factor(t, 100, 0.25) for t in (0, 50, 75, 80, 90, 99, 100, 130)] == \
        pytest.approx([1, 1, 1, 0.8, 0.4, 0.04, 0, 0])
    assert time_cooldown_factor(10_000, 0, 0.25) == time_cooldown_factor(99, 100, 0) == 1.0  # no budget / no cooldown
    # lr_at multiplies it into the paper's schedule; the same (step, seconds) always gives the same lr.
    assert lr_at(40, 256, 10, 0.5, seconds=90, max_time=100, cooldown_fraction=0.25) == \
        pytest.approx(inverse_sqrt_lr(40, 256, 10, 0.5) * 0.4, rel=1e-12)
    assert lr_at(40, 256, 10, 0.5, seconds=90) == inverse_sqrt_lr(40, 256, 10, 0.5)


@pytest.mark.parametrize("text,seconds", [("2h", 7200), ("45m", 2700), ("1h30m", 5400), ("1.5h", 5400),
                                          ("90s", 90), (" 1h 5m ", 3900), ("", 0)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["2", "h", "2x", "0m", "-1h", "1h-", "two hours"])
def test_a_bad_duration_is_one_line_with_an_example(text):
    with pytest.raises(MtrainError, match=r"^train\.max_time: .* e\.g\. --set train\.max_time=2h$"):
        load_config(None, [f"train.max_time={text}"])


def test_two_cooldowns_are_refused():
    with pytest.raises(MtrainError, match=r"train\.max_time places the lr cooldown in time.*cooldown_steps=0"):
        load_config(None, ["train.max_time=1h", "train.cooldown_steps=100"])


def test_format_duration():
    assert [format_duration(s) for s in (12, 270, 3907, 7200)] == ["12s", "4m30s", "1h05m07s", "2h00m00s"]


# ---------------------------------------------------------------- a run to a budget

def test_a_run_ends_at_its_budget_with_the_lr_cooled_down_in_time(copy_data, tmp_path, fake_clock):
    """60 s at 10 s an update: 6 updates; update k starts 10(k-1) s in, so the cooldown (the last
    half, from 30 s) scales updates 4, 5 and 6 by 30/30, 20/30 and 10/30. Then the final
    validation and averaged.pt of the last two step files, as at max_steps."""
    result = run(copy_data, tmp_path, *BUDGET)
    assert (result["stopped"], result["step"]) == ("max_time", 6)
    lrs = [r["lr"] for r in metrics(tmp_path, "train")]
    expected = [inverse_sqrt_lr(k, 32, 10, 0.5) * min(1.0, (60 - 10 * (k - 1)) / 30) for k in range(1, 7)]
    assert lrs == pytest.approx(expected, rel=1e-12)
    assert [r["train_s"] for r in metrics(tmp_path, "train")] == [10 * k for k in range(1, 7)]
    assert [r["step"] for r in metrics(tmp_path, "valid")] == [6]
    last = checkpoint.load(tmp_path / "last.pt")
    assert last["train_state"]["state"]["finished"] == "max_time"
    assert last["train_state"]["state"]["train_seconds"] == 60
    assert [p.rsplit("/", 1)[-1] for p in checkpoint.load(tmp_path / "averaged.pt")["averaged_from"]] == \
        ["step-4.pt", "step-6.pt"]


def test_at_a_steady_pace_a_budget_is_the_step_schedule_of_its_length(copy_data, tmp_path, fake_clock):
    """10 s an update and nothing else timed: the 60 s budget cooled down over its last half is the
    6-update schedule cooled down over its last 3 updates. Update k gets (60 - 10(k-1)) / 30 =
    (6 + 1 - k) / 3 of the inverse-sqrt lr, each an exact division of the same two integers, so lrs,
    weights and averaged.pt are bit-identical. scripts/time-budget-vs-steps.sh measures this same
    step-count schedule against a budget on a real clock."""
    timed = run(copy_data, tmp_path / "time", *BUDGET)
    plain = [o for o in BUDGET if o.split("=")[0] not in ("train.max_time", "train.cooldown_fraction", "train.max_steps")]
    counted = run(copy_data, tmp_path / "steps", *plain, "train.max_steps=6", "train.cooldown_steps=3")
    assert (timed["stopped"], timed["step"]) == ("max_time", 6) and counted["step"] == 6
    assert [r["lr"] for r in metrics(tmp_path / "time", "train")] == [r["lr"] for r in metrics(tmp_path / "steps", "train")]
    for name in ("last.pt", "averaged.pt"):
        a, b = (checkpoint.load(tmp_path / d / name)["model"] for d in ("time", "steps"))
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_validation_is_training_time_and_saving_is_not(copy_data, tmp_path, fake_clock, monkeypatch):
    """Validations take 5 s and saves 7 s, every 2 updates. Training time at each update's start:
    0, 10, 25 (update 2 and its validation), 35, 50; update 5 ends at 60 = the budget, and the final
    validation makes 65. Saves never count: last.pt cannot hold the time of its own write."""
    from mtrain.trainer import Trainer

    validate, save_last = Trainer.validate, Trainer.save_last

    def slow(method, seconds):
        def run_it(self, *args, **kwargs):
            result = method(self, *args, **kwargs)
            fake_clock[0] += seconds
            return result
        return run_it

    monkeypatch.setattr(Trainer, "validate", slow(validate, 5.0))
    monkeypatch.setattr(Trainer, "save_last", slow(save_last, 7.0))
    result = run(copy_data, tmp_path, *BUDGET, "train.eval_every=2")
    assert (result["stopped"], result["step"]) == ("max_time", 5)
    started = [0, 10, 25, 35, 50]
    expected = [inverse_sqrt_lr(k, 32, 10, 0.5) * min(1.0, (60 - t) / 30) for k, t in enumerate(started, 1)]
    assert [r["lr"] for r in metrics(tmp_path, "train")] == pytest.approx(expected, rel=1e-12)
    assert [(r["step"], r["train_s"]) for r in metrics(tmp_path, "valid")] == [(2, 25), (4, 50), (5, 65)]
    assert checkpoint.load(tmp_path / "last.pt")["train_state"]["state"]["train_seconds"] == 65


def test_resume_within_a_budget_is_bit_identical(copy_data, tmp_path, fake_clock, stop_at_step):
    """Stopped at update 3 (30 s in, the cooldown's start), restarted after an hour's gap that is
    not training time: every weight, Adam moment, lr and the time spent equal an uninterrupted run's."""
    full = run(copy_data, tmp_path / "full", *BUDGET)
    stop_at_step(3)
    assert run(copy_data, tmp_path / "split", *BUDGET)["stopped"] == "interrupted"
    assert checkpoint.load(tmp_path / "split" / "last.pt")["train_state"]["state"]["train_seconds"] == 30
    stop_at_step(None)
    fake_clock[0] += 3600.0
    resumed = run(copy_data, tmp_path / "split", *BUDGET)
    assert (resumed["stopped"], resumed["step"]) == (full["stopped"], full["step"]) == ("max_time", 6)
    a, b = (checkpoint.load(tmp_path / d / "last.pt") for d in ("full", "split"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    moments_a, moments_b = a["train_state"]["optimizer"]["state"], b["train_state"]["optimizer"]["state"]
    assert all(torch.equal(moments_a[i]["exp_avg_sq"], moments_b[i]["exp_avg_sq"]) for i in moments_a)
    assert a["train_state"]["state"]["train_seconds"] == b["train_state"]["state"]["train_seconds"] == 60
    assert [r["lr"] for r in metrics(tmp_path / "full", "train")] == [r["lr"] for r in metrics(tmp_path / "split", "train")]


def test_a_spent_budget_ends_the_run_at_once_in_one_line(copy_data, tmp_path, fake_clock, stop_at_step, capsys):
    """Stopped 30 s in, resumed with a 20 s budget: no update; one line says the budget is spent,
    and the run finishes (validation, averaged.pt). Re-run again: one line, nothing more."""
    stop_at_step(3)
    run(copy_data, tmp_path, *BUDGET)
    stop_at_step(None)
    capsys.readouterr()
    spent = [*BUDGET, "train.max_time=20s"]
    result = run(copy_data, tmp_path, *spent)
    assert (result["stopped"], result["step"]) == ("max_time", 3)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train.max_time=")]
    assert lines == ["train.max_time=20s is spent (30s trained, to step 3): no more updates; "
                     "the run ends with its final validation and averaged.pt"]
    assert (tmp_path / "averaged.pt").is_file() and [r["step"] for r in metrics(tmp_path, "train")] == [1, 2, 3]
    again = run(copy_data, tmp_path, *spent)
    assert (again["stopped"], again["step"]) == ("done", 3)
    ended = [line for line in capsys.readouterr().err.splitlines() if "already ended" in line]
    assert len(ended) == 1 and "(max_time, 30s of training)" in ended[0] and "train.max_time" in ended[0]


def test_a_larger_budget_trains_on(copy_data, tmp_path, fake_clock):
    """A finished 60 s run re-run with 80 s: two more updates, its cooldown recomputed for 80 s."""
    run(copy_data, tmp_path, *BUDGET)
    result = run(copy_data, tmp_path, *BUDGET, "train.max_time=80s")
    assert (result["stopped"], result["step"]) == ("max_time", 8)
    lrs = {r["step"]: r["lr"] for r in metrics(tmp_path, "train")}
    assert lrs[8] == pytest.approx(inverse_sqrt_lr(8, 32, 10, 0.5) * 10 / 40, rel=1e-12)
    assert math.isclose(checkpoint.load(tmp_path / "last.pt")["train_state"]["state"]["train_seconds"], 80)


def test_cli_max_time_flag():
    """--max-time sets train.max_time; a bad one is one line, no traceback."""
    from typer.testing import CliRunner

    from mtrain.cli import app

    shown = CliRunner().invoke(app, ["train", "--max-time", "1h30m", "--print-config"])
    assert shown.exit_code == 0 and "max_time: 1h30m" in shown.output
    bad = CliRunner().invoke(app, ["train", "--max-time", "90", "--print-config"])
    assert bad.exit_code != 0 and "Traceback" not in bad.output
    assert "train.max_time: '90' is not a duration like 2h, 45m, 1h30m or 90s" in bad.output


# ---------------------------------------------------------------- against step-count schedules

def test_budget_report_pairs_each_budget_with_its_step_schedule_and_the_gap():
    def row(updates, greedy, beam):
        return {"updates": updates, "train_min": 30.0, "wall_min": 30.9, "valid_greedy": greedy,
                "valid_beam5_averaged": beam}

    lines = time_budget_report.rows({"30m": {"time": row(2800, 38.0, 39.5), "steps": row(2800, 38.25, 39.0)}})
    assert lines[2:] == ["| 30m | `--max-time 30m` | 2,800 | 30.0 | 30.9 | 38.00 | 39.50 |",
                         "| 30m | steps, same updates | 2,800 | 30.0 | 30.9 | 38.25 | 39.00 |",
                         "| 30m | time − steps | | | | -0.25 | +0.50 |"]


@pytest.mark.slow  # two 8- and 12-second budgets side by side, the two step schedules, four beam-5 scorings
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the budgets run side by side, one core each")
def test_budget_against_steps_script_end_to_end(tokenized_slice, tmp_path):
    """Each step-count run trains exactly the updates its budget reached, cooled down over the last
    33% of them; each averaged.pt is scored on all of valid; a second call trains nothing."""
    config = yaml.safe_load((ROOT / "configs" / "multi30k-de-en.yaml").read_text())
    config["model"] |= {"d_model": 32, "d_ff": 64, "n_heads": 2, "n_encoder_layers": 1, "n_decoder_layers": 1}
    config["train"] |= {"warmup_steps": 10, "eval_every": 20, "save_every": 10, "average_last": 2, "max_tokens": 512}
    config["tokenizer"] = {"vocab_size": 1000}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "runs"
    env = {**os.environ, "VIRTUAL_ENV": sys.prefix, "PATH": VENV_PATH, "RUN": str(run_dir),
           "TOK": str(tokenized_slice), "CONFIG": str(tmp_path / "config.yaml")}
    script = ["bash", str(ROOT / "scripts" / "time-budget-vs-steps.sh"), "8s", "12s"]
    proc = subprocess.run(script, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())["budgets"]
    for budget in ("8s", "12s"):
        timed, counted = report[budget]["time"], report[budget]["steps"]
        assert timed["stopped"] == "max_time" and counted["stopped"] == "max_steps"
        assert counted["updates"] == timed["updates"] > 0
        cooldown = load_config(run_dir / f"steps-{budget}" / "config.yaml").train.cooldown_steps
        assert cooldown == (timed["updates"] * 33 + 50) // 100  # 33%, rounded half up
        assert json.loads((run_dir / f"time-{budget}" / "valid.beam5.json").read_text())["n_lines"] == 100
        assert (run_dir / f"steps-{budget}.wall_s").is_file()
    assert f"| 8s | `--max-time 8s` | {report['8s']['time']['updates']:,} |" in proc.stdout
    logs = {p.name: p.stat().st_mtime_ns for p in run_dir.glob("*.log")}
    again = subprocess.run(script, capture_output=True, text=True, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert logs == {p.name: p.stat().st_mtime_ns for p in run_dir.glob("*.log")}  # nothing trained again
    assert json.loads((run_dir / "report.json").read_text())["budgets"] == report
