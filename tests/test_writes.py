"""Failed writes: every file a training run writes (config.yaml, metrics.jsonl, plot.png, the
checkpoints, averaged.pt, deleting old step files, TensorBoard and W&B) is made to fail in turn
(a full disk, injected), and the run stops with one line naming the file, last.pt still loads,
and the same command, once the fault is gone, ends bit-identical to an uninterrupted run. Then
real file size limits (RLIMIT_FSIZE, so writes fail with EFBIG): `train` (the same checks),
`tokenize` (no folder that looks complete), `translate --output` and `average` (no output file)."""

from __future__ import annotations

import errno
import os
import pathlib
import random
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_faults import (
    TINY,
    FullDisk,
    assert_identical_runs,
    assert_one_line_error,
    child_env,
    cli,
    metrics,
    train_args,
)
from test_train import copy_data  # noqa: F401 (a fixture: the copy task's tokenized data)

from mtrain import checkpoint
from mtrain.config import load_config
from mtrain.errors import MtrainError

ROOT = Path(__file__).resolve().parents[1]
MAX_STEPS = 6  # last.pt at 2, 4, 6; validations at 3, 6; step-2.pt pruned at 6; averaged.pt at the end
EXTRA = ["train.average_last=2", "train.keep_last=1"]


def args_for(data_dir: Path, run_dir: Path, *extra: str, max_steps: int = MAX_STEPS) -> list[str]:
    args = train_args(data_dir, run_dir, max_steps)
    for item in (*EXTRA, *extra):
        args += ["--set", item]
    return args


@pytest.fixture(scope="module")
def reference(copy_data, tmp_path_factory) -> Path:  # noqa: F811
    """The uninterrupted run every faulty one must end identical to."""
    from mtrain.train import train

    run_dir = tmp_path_factory.mktemp("reference")
    train(load_config(None, TINY + [f"train.max_steps={MAX_STEPS}", *EXTRA]), copy_data, run_dir, device="cpu")
    return run_dir


# ---------------------------------------------------------------- injected full disks

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class Disk:
    """Fails the `occurrence`-th write of one file of the run (counted from 1 in this process):
    `name` is the file's name for a whole-file (atomic) write, 'metrics.jsonl+' for an append to
    metrics.jsonl, 'tensorboard' for an append to an event file. `room` bytes reach the file
    first, as on a disk that fills up mid-write. disarm() lets every later write through."""

    def __init__(self, monkeypatch, name: str, occurrence: int, room: int = 10) -> None:
        from mtrain import atomic, plot

        self.name, self.occurrence, self.room = name, occurrence, room
        self.counts: dict[str, int] = {}
        self.armed, self.failed = True, False
        temp_names: dict[int, str] = {}
        real_create_beside, real_fdopen, real_open = atomic._create_beside, os.fdopen, open

        def create_beside(path, create):
            name, made = real_create_beside(path, create)
            if isinstance(made, int):
                temp_names[made] = path.name  # atomic_write's temp file (a descriptor) for this target
            return name, made

        def fdopen(fd, *args, **kwargs):
            return self.wrap(temp_names.pop(fd, ""), real_fdopen(fd, *args, **kwargs))

        def plot_open(file, mode="r", *args, **kwargs):
            handle = real_open(file, mode, *args, **kwargs)
            return self.wrap(Path(file).name + "+", handle) if "a" in mode else handle

        monkeypatch.setattr(atomic, "_create_beside", create_beside)
        monkeypatch.setattr(os, "fdopen", fdopen)
        monkeypatch.setattr(plot, "open", plot_open, raising=False)
        try:
            from tensorboard.compat.tensorflow_stub.io.gfile import LocalFileSystem
        except ImportError:
            return
        real_append = LocalFileSystem.append

        def append(fs, filename, file_content, binary_mode=False):
            if self.hit("tensorboard"):
                raise OSError(ENOSPC.errno, ENOSPC.strerror)
            return real_append(fs, filename, file_content, binary_mode)

        monkeypatch.setattr(LocalFileSystem, "append", append)

    def hit(self, name: str) -> bool:
        if not self.armed or name != self.name:
            return False
        self.counts[name] = self.counts.get(name, 0) + 1
        if self.counts[name] != self.occurrence:
            return False
        self.failed = True
        return True

    def wrap(self, name: str, handle):
        return FullDisk(handle, self.room) if self.hit(name) else handle

    def disarm(self) -> None:
        self.armed = False


def fail_and_rerun(reference: Path, run_dir: Path, args: list[str], fault, needles: tuple[str, ...],
                   last_step: int | None) -> None:
    """The run stops with one line holding every needle; last.pt is the one of `last_step` (None:
    there is none yet) and loads; no temp file stays; without the fault the same command resumes
    and ends identical to the reference."""
    assert_one_line_error(cli(*args), *needles, "re-run the same command")
    assert fault.failed
    fault.disarm()
    if last_step is None:
        assert not (run_dir / "last.pt").exists()
    else:
        assert checkpoint.load(run_dir / "last.pt")["step"] == last_step
    for path in run_dir.glob("*.pt"):
        checkpoint.load(path)
    assert not list(run_dir.glob(".*.tmp"))
    result = cli(*args)
    assert result.exit_code == 0, result.output
    assert_identical_runs(reference, run_dir)


SITES = [  # (name, occurrence, what the line says, last.pt on disk after the failure)
    ("config.yaml", 1, "config write failed", None),
    ("metrics.jsonl+", 6, "metrics write failed", 4),  # update 5's (1 2 3, valid 3, 4, 5)
    ("plot.png", 1, "plot write failed", 2),  # at the validation of update 3
    ("best.pt", 1, "checkpoint write failed", 2),
    ("last.pt", 2, "checkpoint write failed", 2),  # update 4's, through torch.save's own writer
    ("step-6.pt", 1, "checkpoint write failed", 4),
    ("averaged.pt", 1, "checkpoint write failed", 6),  # the run's last write before the final last.pt
]


@pytest.mark.parametrize("name, occurrence, what, last_step", SITES, ids=[s[0] + f"#{s[1]}" for s in SITES])
def test_a_full_disk_stops_the_run_in_one_line_and_the_rerun_ends_identical(copy_data, reference, tmp_path,  # noqa: F811
                                                                            monkeypatch, name, occurrence, what,
                                                                            last_step):
    disk = Disk(monkeypatch, name, occurrence)
    target = tmp_path / ("metrics.jsonl" if name == "metrics.jsonl+" else name)
    fail_and_rerun(reference, tmp_path, args_for(copy_data, tmp_path), disk,
                   (f"{target}: {what} (ENOSPC: No space left on device)", "free disk space"), last_step)
    if name == "averaged.pt":  # the finished last.pt comes after averaged.pt
        assert checkpoint.load(tmp_path / "last.pt")["train_state"]["state"]["finished"] == "max_steps"


def test_a_failure_at_the_end_of_a_run_logs_its_last_validation_once(copy_data, tmp_path, monkeypatch):  # noqa: F811
    """A 4-update run: last.pt at 2 and 4, validations at 3 and at the end (4, off the eval grid).
    averaged.pt fails: the re-run redoes the end from update 4's last.pt, and metrics.jsonl holds
    the end's validation once, as an uninterrupted run's does."""
    from mtrain.train import train

    train(load_config(None, TINY + ["train.max_steps=4", *EXTRA]), copy_data, tmp_path / "reference", device="cpu")
    disk = Disk(monkeypatch, "averaged.pt", 1)
    run_dir = tmp_path / "run"
    fail_and_rerun(tmp_path / "reference", run_dir, args_for(copy_data, run_dir, max_steps=4), disk,
                   (f"{run_dir / 'averaged.pt'}: checkpoint write failed",), 4)
    assert [(r["event"], r["step"]) for r in metrics(run_dir) if r["event"] == "valid"] == [("valid", 3), ("valid", 4)]


def test_a_resume_drops_a_validation_logged_after_its_last_pt(tmp_path):
    """metrics.jsonl holds a validation at last.pt's own step that last.pt does not know of (its
    last_eval_step is earlier): a resumed run redoes it, so the log drops it."""
    import json

    from mtrain.plot import MetricsLog

    path = tmp_path / "metrics.jsonl"
    records = [{"event": "train", "step": 3}, {"event": "valid", "step": 3}, {"event": "train", "step": 4},
               {"event": "valid", "step": 4}, {"event": "train", "step": 5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert MetricsLog(path, resume_step=4, last_eval_step=3).records == records[:3]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert MetricsLog(path, resume_step=4, last_eval_step=4).records == records[:4]


class Fault:
    """A hand-armed fault for fail_and_rerun: `failed` once it fired, disarm() before the rerun."""

    armed, failed = True, False

    def disarm(self):
        self.armed = False


def test_failing_to_delete_an_old_step_file_stops_the_run(copy_data, reference, tmp_path, monkeypatch):  # noqa: F811
    """keep_last pruning at update 6 cannot delete step-2.pt (an I/O error): one line naming it."""
    real_unlink = pathlib.Path.unlink

    fault = Fault()

    def unlink(path, missing_ok=False):
        if fault.armed and path.name == "step-2.pt":
            fault.failed = True
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(pathlib.Path, "unlink", unlink)
    fail_and_rerun(reference, tmp_path, args_for(copy_data, tmp_path), fault,
                   (f"{tmp_path / 'step-2.pt'}: deleting an old step checkpoint failed (EIO: ", "check the device"), 4)


def test_a_failing_tensorboard_write_stops_the_run_and_the_rerun_completes_its_series(copy_data, reference,  # noqa: F811
                                                                                   tmp_path, monkeypatch):
    """An event-file write fails in TensorBoard's writer thread (the 40th event: one of update 4's
    scalars): the run stops at the flush before update 4's last.pt, with one line and no thread
    traceback; the rerun's series equals metrics.jsonl, as an uninterrupted run's does."""
    pytest.importorskip("tensorboard")
    from test_tracking import assert_tensorboard_equals_metrics

    disk = Disk(monkeypatch, "tensorboard", 40)
    fail_and_rerun(reference, tmp_path, args_for(copy_data, tmp_path, "train.log_to=tensorboard"), disk,
                   (f"{tmp_path / 'tensorboard'}: the tensorboard tracker failed (ENOSPC: No space left on device)",
                    "drop tensorboard from train.log_to"), 2)
    assert_tensorboard_equals_metrics(tmp_path, plugin=True)  # the reader that drops a restart's expired text


def test_a_failing_wandb_call_stops_the_run_and_the_rerun_continues_the_same_run(copy_data, reference,  # noqa: F811
                                                                              tmp_path, monkeypatch):
    """wandb's run.log fails for update 5 (a stand-in wandb module): one line, the W&B run marked
    failed; the rerun continues the same W&B run and ends identical to an uninterrupted run."""
    from test_tracking import FakeWandb

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    real_log = fake.Run.log

    fault = Fault()

    def log(run, values, step):
        if fault.armed and step == 5:
            fault.failed = True
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_log(run, values, step)

    monkeypatch.setattr(fake.Run, "log", log)
    fail_and_rerun(reference, tmp_path, args_for(copy_data, tmp_path, "train.log_to=wandb"), fault,
                   (f"{tmp_path / 'wandb'}: the wandb tracker failed (EIO: ",), 4)
    first, second = fake.inits
    assert first["id"] == second["id"]
    assert fake.finishes == [1, 0]  # the failed run is marked failed, once


def test_a_write_failed_on_rank_0_stops_every_rank(tmp_path, monkeypatch):
    """Under DDP a failed write on rank 0 waits for the next point where the ranks meet, then
    stops all of them: rank 0 with its line, the others pointing to it (the collective that
    tells them is faked here: rank 0 has raised the flag)."""
    from types import SimpleNamespace

    import torch

    from mtrain import distributed as dist_utils
    from mtrain import train

    def run_of(rank: int) -> train.Run:
        return train.Run(SimpleNamespace(dist=dist_utils.DistInfo(rank=rank, world_size=2),
                                         device=torch.device("cpu"), run_dir=tmp_path))

    main, other = run_of(0), run_of(1)
    main.fail(MtrainError("metrics.jsonl: metrics write failed"))  # not raised yet
    monkeypatch.setattr(train.dist_utils, "any_rank", lambda flag, info, device: True)
    with pytest.raises(MtrainError, match="metrics write failed"):
        main.check_failure()
    with pytest.raises(MtrainError, match=f"rank 0 failed to write to {tmp_path}"):
        other.check_failure()
    single = train.Run(SimpleNamespace(dist=dist_utils.DistInfo(), device=torch.device("cpu"), run_dir=tmp_path))
    with pytest.raises(MtrainError, match="metrics write failed"):
        single.fail(MtrainError("metrics write failed"))  # one process: at once


# ---------------------------------------------------------------- real file size limits (EFBIG)

def limited(max_bytes: int):
    """preexec_fn: files of this process may not grow past max_bytes; a write past it fails with
    EFBIG instead of killing the process with SIGXFSZ."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))
    return apply


def mtrain_limited(args: list[str], max_bytes: int) -> tuple[int, str]:
    env = {**child_env(), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, "-m", "mtrain", *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                          preexec_fn=limited(max_bytes), timeout=300, check=False)
    return proc.returncode, proc.stderr.decode("utf-8", "replace")


def one_error_line(code: int, stderr: str, *needles: str) -> str:
    assert code == 1, stderr
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_file_size_limit_stops_training_and_the_rerun_ends_identical(copy_data, tmp_path):  # noqa: F811
    """A run ends at update 2; the same command with --max-steps 6 runs under a file size limit
    between a model-only checkpoint's size and last.pt's (which holds Adam's moments too): update
    4's step file is written, its last.pt is not (EFBIG). One line; last.pt of update 2 loads; the
    command without the limit ends identical to an uninterrupted 6-update run."""
    from mtrain.train import train

    extra = ["train.eval_every=2"]  # the 2-update run validates at its end, as the 6-update one does at 2
    train(load_config(None, TINY + ["train.max_steps=6", *extra]), copy_data, tmp_path / "reference", device="cpu")
    run_dir = tmp_path / "run"
    assert cli(*train_args(copy_data, run_dir, 2), "--set", extra[0]).exit_code == 0
    small, large = (run_dir / "step-2.pt").stat().st_size, (run_dir / "last.pt").stat().st_size
    limit = (small + large) // 2
    assert max(p.stat().st_size for p in run_dir.iterdir() if not p.name.endswith(".pt")) < limit
    args = [*train_args(copy_data, run_dir, 6), "--set", extra[0]]
    code, err = mtrain_limited(args, limit)
    one_error_line(code, err, f"{run_dir / 'last.pt'}: checkpoint write failed (EFBIG: File too large",
                   "ulimit -f", "re-run the same command to resume")
    assert (run_dir / "step-4.pt").is_file()
    assert checkpoint.load(run_dir / "last.pt")["step"] == 2
    assert not list(run_dir.glob(".*.tmp"))
    result = cli(*args)
    assert result.exit_code == 0 and "resuming from" in result.output, result.output
    assert_identical_runs(tmp_path / "reference", run_dir)


def test_file_size_limit_during_tokenize_leaves_no_complete_looking_folder(copy_data, tmp_path):  # noqa: F811
    """The output folder holds an earlier, complete tokenization; a new one under a size limit fails
    on the first file it writes past the limit, the training split's cleaned text: one line naming
    that file, and no meta.json, so the folder is refused as incomplete instead of read as the old one."""
    import shutil

    from mtrain.data import TokenizedData

    raw, out = tmp_path / "raw", tmp_path / "tok"
    shutil.copytree(copy_data, out)
    assert TokenizedData(out).meta
    raw.mkdir()
    rng = random.Random(0)
    words = [f"w{i}" for i in range(200)]
    for split, n in (("train", 1500), ("valid", 10)):
        lines = "".join(" ".join(rng.choice(words) for _ in range(80)) + "\n" for _ in range(n))
        (raw / f"{split}.de").write_text(lines)
        (raw / f"{split}.en").write_text(lines)
    code, err = mtrain_limited(["tokenize", "--data", raw, "--out", out, "--splits", "train,valid",
                                "--vocab-size", "300"], 300_000)
    one_error_line(code, err, f"{out / 'train.src.txt'}: write failed (EFBIG: File too large",
                   "has no meta.json", "re-run `mtrain tokenize`")
    assert not (out / "meta.json").exists()
    with pytest.raises(MtrainError, match="meta.json"):
        TokenizedData(out)


def test_file_size_limit_leaves_no_translation_and_no_average(reference, tmp_path):
    """`translate --output` writes a temp file and renames it: past the limit there is no output
    file and no temp file; `average --out` the same."""
    src = tmp_path / "in.de"
    src.write_text("alpha beta gamma\n" * 300, encoding="utf-8")
    out = tmp_path / "out.en"
    code, err = mtrain_limited(["translate", "--checkpoint", reference / "best.pt", "--input", src, "--output", out,
                                "--device", "cpu", "--greedy"], 200)
    one_error_line(code, err, f"{out}: EFBIG: File too large for this filesystem or ulimit -f", "and re-run")
    averaged = tmp_path / "avg.pt"
    code, err = mtrain_limited(["average", reference / "step-4.pt", reference / "step-6.pt", "--out", averaged],
                               100_000)
    one_error_line(code, err, f"{averaged}: EFBIG: File too large")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.de"]  # no output, no temp file


# ---------------------------------------------------------------- torchrun: a failure on rank 0 stops every rank

def _rank(rank: int, port: int, data_dir: str, run_dir: str, site: str, report: str) -> None:
    """One rank of a 2-process gloo job whose rank 0 meets a full disk at `site` in update 3."""
    import json

    import torch

    from mtrain import checkpoint, plot, train

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if rank == 0:
        if site == "metrics.jsonl":
            write = plot.MetricsLog.write
            plot.MetricsLog.write = lambda self, record: full() if record["step"] == 3 else write(self, record)
        elif site == "plot.png":
            train.plot_metrics = full
        else:
            save = checkpoint.save_atomic
            checkpoint.save_atomic = lambda obj, path: full() if Path(path).name == site else save(obj, path)
    settings = TINY + ["train.max_steps=6", "train.save_every=4", "train.eval_every=3"]
    try:
        train.train(load_config(None, settings), data_dir, run_dir, device="cpu")
        outcome = "trained"
    except MtrainError as err:
        outcome = str(err)
    Path(report, f"rank{rank}.json").write_text(json.dumps(outcome))


@pytest.mark.slow  # two spawned processes import torch and train, three times
@pytest.mark.parametrize("site", ["metrics.jsonl", "plot.png", "last.pt"])
def test_under_torchrun_a_failed_write_on_rank_0_stops_every_rank(copy_data, tmp_path, site):  # noqa: F811
    import json
    import socket
    import time

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run_dir = tmp_path / "run"
    context = mp.spawn(_rank, args=(port, str(copy_data), str(run_dir), site, str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + 240
    while not context.join(timeout=5):
        assert time.monotonic() < deadline, "a rank did not end: it waits in a collective"
    main, other = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert main.startswith(f"{run_dir / site}: ") and "(ENOSPC: No space left on device)" in main, main
    assert other == f"rank 0 failed to write to {run_dir}; see its error line, fix the cause and re-run the same " \
                    "command to resume" or (site == "last.pt" and "rank 0 failed to write a checkpoint" in other), other


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_a_new_file_gets_the_umask_permissions_and_an_existing_one_keeps_its_own(tmp_path, mask):
    from mtrain.atomic import atomic_write, make_temp_folder

    previous = os.umask(mask)
    try:
        with atomic_write(tmp_path / "new.txt") as handle:
            handle.write("a\n")
        assert (tmp_path / "new.txt").stat().st_mode & 0o777 == 0o666 & ~mask
        (tmp_path / "kept.bin").write_bytes(b"old")
        os.chmod(tmp_path / "kept.bin", 0o640)
        with atomic_write(tmp_path / "kept.bin", binary=True) as handle:
            handle.write(b"new")
        assert (tmp_path / "kept.bin").stat().st_mode & 0o777 == 0o640
        assert (tmp_path / "kept.bin").read_bytes() == b"new"
        assert make_temp_folder(tmp_path / "folder").stat().st_mode & 0o777 == 0o777 & ~mask
    finally:
        os.umask(previous)
