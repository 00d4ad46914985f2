"""Faults during training, proven by injecting them: kill -9 at random moments (then the same
command again ends bit-identical to an uninterrupted run), failing checkpoint writes, truncated,
corrupted and hostile checkpoints (a pickle that would run code), and non-finite losses.

Run as a script, this file is `python -m mtrain` with a kill point installed (see KillPoint): the
process SIGKILLs itself at an exact place (mid-step, mid-validation, halfway through writing a
checkpoint), which no timer can hit reliably. Timer kills from outside add truly random moments.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.d_model=32", "model.d_ff=64", "model.n_heads=2", "model.n_encoder_layers=1",
        "model.n_decoder_layers=1", "train.max_tokens=512", "train.warmup_steps=10", "train.log_every=1",
        "train.eval_max_sentences=4", "train.num_threads=1", "train.save_every=2", "train.eval_every=3"]
TIME_FIELDS = {"tokens_per_s"}  # the only metrics that may differ between two identical runs


# ---------------------------------------------------------------- kill points (run in the child)

# Execution order of the places a kill point can hit within one step.
PHASES = ("step", "validate", "best.pt", "step-N.pt", "last.pt")


@dataclass(frozen=True)
class KillPoint:
    """SIGKILL the training process at `phase` of optimizer update `step`. For the checkpoint
    phases, `fraction` of the checkpoint's bytes reach the temp file first (then fsync, then
    death), exactly what a kill during the write leaves on disk."""

    phase: str
    step: int
    fraction: float = 0.5

    def order(self) -> tuple[int, int]:
        return self.step, PHASES.index(self.phase)

    def encode(self) -> str:
        return f"{self.phase},{self.step},{self.fraction}"

    @staticmethod
    def decode(text: str) -> "KillPoint":
        phase, step, fraction = text.split(",")
        return KillPoint(phase, int(step), float(fraction))


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install(point: KillPoint) -> None:
    """Patch the trainer so that this process kills itself at `point` (nothing else changes)."""
    import io

    from mtrain import checkpoint
    from mtrain import train as train_mod

    if point.phase == "step":  # gradients computed, the optimizer update in progress
        clip_and_step = train_mod.Trainer._clip_and_step

        def killing_clip_and_step(self):
            if self.state.step + 1 == point.step:
                _die()
            return clip_and_step(self)

        train_mod.Trainer._clip_and_step = killing_clip_and_step
    elif point.phase == "validate":  # valid loss done, translations not yet
        valid_loss = train_mod.Trainer._valid_loss

        def killing_valid_loss(self):
            result = valid_loss(self)
            if self.state.step == point.step:
                _die()
            return result

        train_mod.Trainer._valid_loss = killing_valid_loss
    else:
        save_atomic, real_save = checkpoint.save_atomic, torch.save
        armed = []
        wanted = f"step-{point.step}.pt" if point.phase == "step-N.pt" else point.phase

        def partial_save(obj, handle, *args, **kwargs):
            if not armed:
                return real_save(obj, handle, *args, **kwargs)
            buffer = io.BytesIO()
            real_save(obj, buffer)
            data = buffer.getvalue()
            handle.write(data[: int(len(data) * point.fraction)])
            handle.flush()
            os.fsync(handle.fileno())
            _die()

        def watching_save_atomic(obj, path):
            if Path(path).name == wanted and obj["step"] == point.step:
                armed.append(True)
            return save_atomic(obj, path)

        checkpoint.torch.save = partial_save
        checkpoint.save_atomic = watching_save_atomic


# ---------------------------------------------------------------- helpers (run in the test)

def train_args(data_dir: Path, run_dir: Path, max_steps: int) -> list[str]:
    args = ["train", "--data", str(data_dir), "--out", str(run_dir), "--device", "cpu", "--max-steps", str(max_steps)]
    for item in TINY:
        args += ["--set", item]
    return args


def child_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}


def start(args: list[str], point: KillPoint | None = None) -> subprocess.Popen:
    """`python -m mtrain ARGS`, or this file as the same CLI with a kill point installed."""
    if point is None:
        command = [sys.executable, "-m", "mtrain", *args]
    else:
        command = [sys.executable, __file__, point.encode(), *args]
    return subprocess.Popen(command, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen, kill_after: float | None = None) -> tuple[int, str]:
    """Wait for the process (SIGKILL it after `kill_after` seconds); (exit code, stderr)."""
    try:
        _, err = proc.communicate(timeout=kill_after if kill_after is not None else 300)
    except subprocess.TimeoutExpired:
        if kill_after is None:
            proc.kill()
            raise
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
    return proc.returncode, err.decode("utf-8", "replace")


def reference_run(data_dir: Path, run_dir: Path, max_steps: int) -> None:
    """The uninterrupted run, in this process (no interpreter start-up): same config, one thread."""
    from mtrain.config import load_config
    from mtrain.train import train

    train(load_config(None, TINY + [f"train.max_steps={max_steps}"]), data_dir, run_dir, device="cpu")


def metrics(run_dir: Path) -> list[dict]:
    from mtrain.plot import read_metrics

    return [{k: v for k, v in r.items() if k not in TIME_FIELDS} for r in read_metrics(run_dir / "metrics.jsonl")]


def assert_identical_runs(reference: Path, resumed: Path) -> None:
    """Every weight, Adam moment, step file, the best model, the loop state and the metrics log."""
    from mtrain import checkpoint

    names = sorted(p.name for p in reference.glob("*.pt"))
    assert names == sorted(p.name for p in resumed.glob("*.pt"))
    for name in names:
        a, b = checkpoint.load(reference / name), checkpoint.load(resumed / name)
        assert a["step"] == b["step"], name
        assert a["model"].keys() == b["model"].keys()
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]), name
    a, b = checkpoint.load(reference / "last.pt")["train_state"], checkpoint.load(resumed / "last.pt")["train_state"]
    moments_a, moments_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert moments_a.keys() == moments_b.keys()
    for i in moments_a:
        assert all(torch.equal(moments_a[i][key], moments_b[i][key]) for key in ("exp_avg", "exp_avg_sq", "step"))
    assert a["state"] == b["state"]
    assert metrics(reference) == metrics(resumed)


def kill_and_resume(data_dir: Path, run_dir: Path, max_steps: int, kills: list[KillPoint | float]) -> list[str]:
    """Run the training command once per kill (a KillPoint, or seconds for a timer SIGKILL from
    outside), then again until it finishes. Returns what each attempt hit, for failure messages."""
    args = train_args(data_dir, run_dir, max_steps)
    history = []
    for kill in kills:
        if isinstance(kill, KillPoint):
            code, err = finish(start(args, kill))
        else:
            code, err = finish(start(args), kill_after=kill)
        history.append(f"{kill}: exit {code}")
        # A kill point is always reached; a timer may fire after the run has finished.
        assert code == -signal.SIGKILL or (code == 0 and not isinstance(kill, KillPoint)), f"{history}\n{err}"
        assert "Traceback" not in err, err
        if code == 0:
            return history
    code, err = finish(start(args))
    history.append(f"to the end: exit {code}")
    assert code == 0, f"{history}\n{err}"
    return history


def random_kill_points(rng: random.Random, n: int, max_steps: int) -> list[KillPoint]:
    """n kill points in execution order, each reachable after the previous one's resume: every
    candidate (phase, step) the run surely passes, drawn without replacement."""
    saves, evals = range(2, max_steps + 1, 2), range(3, max_steps + 1, 3)
    candidates = [KillPoint("step", s) for s in range(1, max_steps + 1)]
    candidates += [KillPoint("validate", s) for s in evals] + [KillPoint("best.pt", 3)]
    candidates += [KillPoint(phase, s) for s in saves for phase in ("step-N.pt", "last.pt")]
    chosen = sorted(rng.sample(candidates, n), key=KillPoint.order)
    return [KillPoint(p.phase, p.step, round(rng.uniform(0.05, 0.95), 3)) for p in chosen]


# ---------------------------------------------------------------- kill -9

def resume_in_process(args: list[str]) -> str:
    """The same command again, through the CLI in this process (saves an interpreter start-up)."""
    from typer.testing import CliRunner

    from mtrain.cli import app

    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0 and result.exception is None, result.output
    return result.output


def test_kill9_mid_write_and_mid_validation_then_resume_is_bit_identical(tokenized_slice, tmp_path):
    """Two kill points drawn with a fixed seed, in two runs killed side by side: one halfway
    through a checkpoint write, one in a validation. Re-running the same command ends with every
    bit equal to an uninterrupted run, and no temp file of the killed write is left."""
    rng = random.Random(8)
    write = KillPoint(rng.choice(["step-N.pt", "last.pt"]), rng.choice([2, 4]), round(rng.uniform(0.05, 0.95), 3))
    validation = KillPoint("validate", rng.choice([3, 6]))
    runs = {tmp_path / point.phase: point for point in (write, validation)}
    procs = {run_dir: start(train_args(tokenized_slice, run_dir, 6), point) for run_dir, point in runs.items()}
    reference_run(tokenized_slice, tmp_path / "reference", 6)  # while the children run
    for run_dir, proc in procs.items():
        code, err = finish(proc)
        assert code == -signal.SIGKILL, f"{runs[run_dir]} was not reached (exit {code}):\n{err}"
        if runs[run_dir].phase != "validate":
            assert list(run_dir.glob(".*.pt.*.tmp")), "the kill did not leave a half-written checkpoint"
        output = resume_in_process(train_args(tokenized_slice, run_dir, 6))
        assert "resuming from" in output or runs[run_dir].step < 2
        assert_identical_runs(tmp_path / "reference", run_dir)
        assert not list(run_dir.glob(".*.tmp")), "a killed write's temp file was left behind"


@pytest.mark.slow
def test_kill9_at_many_random_moments_then_resume_is_bit_identical(tokenized_slice, tmp_path):
    """Ten kill points at exact places (a step, a validation, the middle of each kind of
    checkpoint write, before the first checkpoint) and three timer kills at random moments."""
    max_steps = 12
    rng = random.Random(2017)
    points = [KillPoint("step", 1)] + random_kill_points(rng, 9, max_steps)
    points = sorted(set(points), key=KillPoint.order)
    assert len(points) >= 10
    timers = [round(rng.uniform(1.0, 15.0), 2) for _ in range(3)]
    reference_run(tokenized_slice, tmp_path / "reference", max_steps)
    # Timer kills last: they land anywhere (start-up, a step, a write) of what is left.
    history = kill_and_resume(tokenized_slice, tmp_path / "killed", max_steps, points + timers)
    assert len(history) >= len(points) + 1, history
    assert_identical_runs(tmp_path / "reference", tmp_path / "killed")
    assert not list((tmp_path / "killed").glob(".*.tmp")), history


if __name__ == "__main__":  # `python tests/test_faults.py PHASE,STEP,FRACTION train ...`
    install(KillPoint.decode(sys.argv[1]))
    from mtrain.cli import app

    app(args=sys.argv[2:], prog_name="mtrain")
