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
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.d_model=32", "model.d_ff=64", "model.n_heads=2", "model.n_encoder_layers=1",
        "model.n_decoder_layers=1", "train.max_tokens=512", "train.warmup_steps=10", "train.log_every=1",
        "train.eval_max_sentences=4", "train.num_threads=1", "train.save_every=2", "train.eval_every=3"]
from mtrain.plot import (
    TIME_FIELDS,  # the only metrics that may differ between two identical runs
)

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


@pytest.fixture(scope="module")
def reference(tokenized_slice, tmp_path_factory) -> Path:
    """An uninterrupted 6-step run: what every faulty run must end identical to."""
    run_dir = tmp_path_factory.mktemp("reference")
    reference_run(tokenized_slice, run_dir, 6)
    return run_dir


def test_kill9_mid_write_and_mid_validation_then_resume_is_bit_identical(tokenized_slice, tmp_path, request):
    """Two kill points drawn with a fixed seed, in two runs killed side by side: one halfway
    through a checkpoint write, one in a validation. Re-running the same command ends with every
    bit equal to an uninterrupted run, and no temp file of the killed write is left."""
    rng = random.Random(8)
    write = KillPoint(rng.choice(["step-N.pt", "last.pt"]), rng.choice([2, 4]), round(rng.uniform(0.05, 0.95), 3))
    validation = KillPoint("validate", rng.choice([3, 6]))
    runs = {tmp_path / point.phase: point for point in (write, validation)}
    procs = {run_dir: start(train_args(tokenized_slice, run_dir, 6), point) for run_dir, point in runs.items()}
    reference = request.getfixturevalue("reference")  # computed while the children run
    for run_dir, proc in procs.items():
        code, err = finish(proc)
        assert code == -signal.SIGKILL, f"{runs[run_dir]} was not reached (exit {code}):\n{err}"
        if runs[run_dir].phase != "validate":
            assert list(run_dir.glob(".*.pt.*.tmp")), "the kill did not leave a half-written checkpoint"
        output = resume_in_process(train_args(tokenized_slice, run_dir, 6))
        assert "resuming from" in output or runs[run_dir].step < 2
        assert_identical_runs(reference, run_dir)
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


# ---------------------------------------------------------------- failing checkpoint writes

def cli(*args: str, env: dict[str, str] | None = None):
    from typer.testing import CliRunner

    from mtrain.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def assert_one_line_error(result, *needles: str) -> str:
    """Exit 1, no exception escaped, and stderr is one `error: ...` line holding every needle."""
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("name, step", [("last.pt", 4), ("step-4.pt", 4), ("best.pt", 3)])
def test_disk_full_keeps_previous_checkpoints_and_the_rerun_ends_identical(tokenized_slice, reference, tmp_path,
                                                                           monkeypatch, name, step):
    """ENOSPC halfway through one checkpoint write: the run stops with one line naming the file,
    the previous last.pt (and best.pt) still load, no temp file stays, and once there is space
    again the same command resumes and ends identical to an uninterrupted run."""
    from mtrain import checkpoint

    save_atomic, real_save = checkpoint.save_atomic, torch.save
    armed: list[bool] = []

    def full_disk_save(obj, handle, *args, **kwargs):
        if not armed:
            return real_save(obj, handle, *args, **kwargs)
        handle.write(b"PK\x03\x04 the first bytes of a zip")
        raise OSError(28, "No space left on device")

    def watching_save_atomic(obj, path):
        if Path(path).name == name and obj["step"] == step:
            armed.append(True)
        try:
            return save_atomic(obj, path)
        finally:
            armed.clear()

    monkeypatch.setattr(checkpoint.torch, "save", full_disk_save)
    monkeypatch.setattr(checkpoint, "save_atomic", watching_save_atomic)
    args = train_args(tokenized_slice, tmp_path, 6)
    assert_one_line_error(cli(*args), f"{tmp_path / name}: checkpoint write failed", "No space left on device",
                          "re-run the same command")
    monkeypatch.undo()
    assert checkpoint.load(tmp_path / "last.pt")["step"] == 2
    if step > 3:
        assert checkpoint.load(tmp_path / "best.pt")["step"] == 3
    for path in tmp_path.glob("*.pt"):
        checkpoint.load(path)  # every checkpoint left is complete
    assert not list(tmp_path.glob(".*.tmp"))
    result = cli(*args)
    assert result.exit_code == 0 and "resuming from" in result.output, result.output
    assert_identical_runs(reference, tmp_path)


class FullDisk:
    """A text file handle that takes `room` characters, then raises ENOSPC."""

    def __init__(self, handle, room: int) -> None:
        self.handle, self.room = handle, room

    def write(self, text: str) -> int:
        if len(text) > self.room:
            self.handle.write(text[: self.room])
            raise OSError(28, "No space left on device")
        self.room -= len(text)
        return self.handle.write(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.close()


@pytest.mark.parametrize("command", ["translate", "eval"])
def test_disk_full_while_writing_translations_keeps_the_previous_file(reference, tmp_path, monkeypatch, command):
    """`translate --output` and `eval --output-hyp` write a temp file and rename it: a full disk
    leaves the previous file as it was, no temp file, and one line on stderr."""
    real_fdopen = os.fdopen

    def fdopen(fd, mode="r", *args, **kwargs):
        handle = real_fdopen(fd, mode, *args, **kwargs)
        return FullDisk(handle, room=1) if mode == "w" else handle

    src = tmp_path / "in.de"
    src.write_text("Ein Mann schläft.\nZwei Hunde.\nEine Frau.\n", encoding="utf-8")
    ref = tmp_path / "ref.en"
    ref.write_text("A man sleeps.\nTwo dogs.\nA woman.\n", encoding="utf-8")
    out = tmp_path / "out.en"
    out.write_text("yesterday's translations\n", encoding="utf-8")
    args = {"translate": ["translate", "--checkpoint", reference / "best.pt", "--input", src, "--output", out],
            "eval": ["eval", "--checkpoint", reference / "best.pt", "--src", src, "--ref", ref, "--output-hyp", out]}
    monkeypatch.setattr(os, "fdopen", fdopen)
    line = assert_one_line_error(cli(*args[command], "--device", "cpu"), "No space left on device", "disk space")
    assert "None" not in line, line
    monkeypatch.undo()
    assert out.read_text(encoding="utf-8") == "yesterday's translations\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


# ---------------------------------------------------------------- damaged and hostile checkpoints

class WritesMarker:
    """Unpickling this calls open(marker, "w"): the file appears if any loader runs pickled code."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        import builtins

        return builtins.open, (self.marker, "w")


def hostile_files(folder: Path, marker: Path, good: dict) -> dict[str, Path]:
    """The same code-running object packed three ways: torch zip, torch legacy, bare pickle."""
    import io
    import pickle

    crafted = {**good, "model": {**good["model"], "payload": WritesMarker(marker)}}
    files = {}
    for kind in ("zip", "legacy", "pickle"):
        path = folder / f"hostile-{kind}.pt"
        if kind == "pickle":
            path.write_bytes(pickle.dumps(crafted))
        else:
            buffer = io.BytesIO()
            torch.save(crafted, buffer, _use_new_zipfile_serialization=kind == "zip")
            path.write_bytes(buffer.getvalue())
        files[kind] = path
    return files


def readers(ckpt: Path, data_dir: Path, folder: Path) -> dict[str, tuple[list[str], Path]]:
    """Every command that reads a checkpoint, reading `ckpt` (train: a copy as RUN/last.pt, to
    resume): {command: (arguments, the file its error must name)}."""
    src = folder / "src.de"
    src.write_text("Ein Mann schläft.\nZwei Hunde.\n", encoding="utf-8")
    ref = folder / "ref.en"
    ref.write_text("A man sleeps.\nTwo dogs.\n", encoding="utf-8")
    run_dir = folder / f"run-{ckpt.stem}"
    run_dir.mkdir(exist_ok=True)
    (run_dir / "last.pt").write_bytes(ckpt.read_bytes())
    return {
        "translate": (["translate", "--checkpoint", str(ckpt), "--input", str(src), "--output", str(folder / "out.en"),
                       "--device", "cpu"], ckpt),
        "eval": (["eval", "--checkpoint", str(ckpt), "--src", str(src), "--ref", str(ref), "--device", "cpu",
                  "--output-hyp", str(folder / "hyp.en")], ckpt),
        "average": (["average", str(ckpt), str(ckpt), "--out", str(folder / "avg.pt")], ckpt),
        "train": (train_args(data_dir, run_dir, 6), run_dir / "last.pt"),
    }


def test_every_checkpoint_read_is_weights_only():
    """Static check: each torch.load in mtrain passes weights_only=True; nothing unpickles otherwise."""
    import ast

    calls = []
    for path in sorted((ROOT / "mtrain").glob("**/*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
            where = f"{path.name}:{node.lineno}"
            if name.endswith(("torch.load", "serialization.load")):
                calls.append(where)
                assert keywords.get("weights_only") == "True", f"{where}: torch.load without weights_only=True"
            assert not name.endswith(("pickle.load", "pickle.loads", "Unpickler", "dill.load")), where
            if name.endswith(("np.load", "numpy.load")):
                assert keywords.get("allow_pickle", "False") == "False", f"{where}: np.load(allow_pickle=True)"
    assert calls, "no torch.load found: the check is looking in the wrong place"


def test_hostile_pickle_is_refused_by_every_reader_and_runs_nothing(tokenized_slice, reference, tmp_path):
    from mtrain import checkpoint

    marker = tmp_path / "MARKER"
    good = checkpoint.load(reference / "last.pt")
    for kind, path in hostile_files(tmp_path, marker, good).items():
        for command, (args, named) in readers(path, tokenized_slice, tmp_path).items():
            line = assert_one_line_error(cli(*args), str(named))
            if kind != "pickle":  # a bare pickle is not a torch file at all; either way it is refused
                assert "refused for safety" in line and "io.open" in line, line
            assert not marker.exists(), f"{command} ran the pickled code of {path}"
    for name in ("out.en", "hyp.en", "avg.pt"):
        assert not (tmp_path / name).exists(), f"{name} was written from a refused checkpoint"


def damaged(good_bytes: bytes, kind: str) -> bytes:
    """Damage a checkpoint file the way disks and copies do."""
    import io
    import zipfile

    if kind == "truncated":
        return good_bytes[: len(good_bytes) // 2]
    if kind == "cut to 10 bytes":
        return good_bytes[:10]
    if kind == "empty":
        return b""
    if kind == "random bytes":
        return random.Random(0).randbytes(4096)
    if kind == "text":
        return b"this is not a checkpoint\n"
    # "bits flipped in the weights": 8 bytes inside the largest tensor record, the zip intact.
    archive = zipfile.ZipFile(io.BytesIO(good_bytes))
    record = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    extra = int.from_bytes(good_bytes[record.header_offset + 28: record.header_offset + 30], "little")
    start = record.header_offset + 30 + len(record.filename.encode()) + extra + record.file_size // 2
    flipped = bytearray(good_bytes)
    flipped[start: start + 8] = bytes(b ^ 0xFF for b in flipped[start: start + 8])
    return bytes(flipped)


DAMAGE = ["truncated", "cut to 10 bytes", "empty", "random bytes", "text", "bits flipped in the weights"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_checkpoint_is_a_one_line_error_naming_the_file(tokenized_slice, reference, tmp_path, kind):
    path = tmp_path / "best.pt"
    path.write_bytes(damaged((reference / "last.pt").read_bytes(), kind))
    for command, (args, named) in readers(path, tokenized_slice, tmp_path).items():
        line = assert_one_line_error(cli(*args), str(named))
        assert "checkpoint" in line, line
    for name in ("out.en", "hyp.en", "avg.pt"):
        assert not (tmp_path / name).exists(), f"{name} was written from a damaged checkpoint"


@pytest.mark.parametrize("change, needle", [
    (lambda c: c.pop("model"), "missing or malformed: model"),
    (lambda c: c.update(step="12"), "missing or malformed: step"),
    (lambda c: c["tokenizer"].update(src_model=b"not a SentencePiece model"), "tokenizer cannot be loaded"),
    (lambda c: c["model"].pop(next(iter(c["model"]))), "weights do not fit"),
    (lambda c: c.update(format="other"), "not an mtrain checkpoint"),
    (lambda c: c.update(version=99), "newer than this mtrain reads"),
])
def test_inconsistent_checkpoint_is_a_one_line_error(reference, tmp_path, change, needle):
    """Well-formed torch files whose content is wrong (crafted, or written by something else)."""
    from mtrain import checkpoint

    ckpt = checkpoint.load(reference / "best.pt")
    change(ckpt)
    path = tmp_path / "odd.pt"
    torch.save(ckpt, path)
    src = tmp_path / "in.de"
    src.write_text("Ein Hund.\n", encoding="utf-8")
    assert_one_line_error(cli("translate", "--checkpoint", path, "--input", src, "--device", "cpu"), str(path), needle)


# ---------------------------------------------------------------- non-finite losses

def test_nan_losses_are_skipped_and_counted_and_a_run_of_them_stops(tokenized_slice, tmp_path, nan_losses):
    args = train_args(tokenized_slice, tmp_path / "one", 4)
    nan_losses({3})
    result = cli(*args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert (summary["step"], summary["nonfinite"]) == (4, 1)
    assert "step 3: non-finite loss, update skipped" in result.stderr

    args = train_args(tokenized_slice, tmp_path / "many", 6) + ["--set", "train.max_nonfinite=3"]
    nan_losses(range(3, 101))
    result = cli(*args)
    assert_one_line_error(result, "step 3: 3 non-finite losses in a row", "last.pt")
    from mtrain import checkpoint

    last = checkpoint.load(tmp_path / "many" / "last.pt")
    assert last["step"] == 2 and all(torch.isfinite(w).all() for w in last["model"].values())


if __name__ == "__main__":  # `python tests/test_faults.py PHASE,STEP,FRACTION train ...`
    install(KillPoint.decode(sys.argv[1]))
    from mtrain.cli import app

    app(args=sys.argv[2:], prog_name="mtrain")
