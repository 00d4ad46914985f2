"""One trainer per run folder: while a process holds RUN/.lock, a second `mtrain train` on the
folder exits 1 with one line naming the holder (host, PID, start time) and changes nothing there;
translate, average and a dry run keep working; once the holder dies (SIGKILL) the kernel has
dropped its lock and a new trainer starts at once. A training process holds the lock itself
until it ends; under torchrun only rank 0 takes it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_faults import TINY, child_env, cli, train_args
from test_train import copy_data  # noqa: F401 (a fixture: the copy task's tokenized data)

from mtrain.config import load_config
from mtrain.errors import MtrainError
from mtrain.lock import LOCK_NAME, RunLock

ROOT = Path(__file__).resolve().parents[1]

# A process that takes the lock through mtrain.lock, says so, and holds it until it is killed.
HOLDER = "import sys, time\nfrom mtrain.lock import RunLock\nwith RunLock(sys.argv[1]):\n" \
         "    print('locked', flush=True)\n    time.sleep(600)\n"


def hold(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], cwd=ROOT, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = proc.stdout.readline()
    assert line == b"locked\n", (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under the folder, hidden ones included, by relative path."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def holder_needles(pid: int) -> tuple[str, str, str]:
    return f"host {socket.gethostname()}", f"PID {pid}", "started 20"


def test_the_lock_names_its_holder_and_is_emptied_on_release(tmp_path):
    run_dir = tmp_path / "run"
    with RunLock(run_dir):
        info = json.loads((run_dir / LOCK_NAME).read_text())
        assert info["pid"] == os.getpid() and info["host"] == socket.gethostname()
        assert time.strptime(info["started"][:19], "%Y-%m-%dT%H:%M:%S")
        with pytest.raises(MtrainError) as caught:  # another open of the file: refused, even in this process
            with RunLock(run_dir):
                pass
        message = str(caught.value)
        assert message.startswith(f"{run_dir}: another trainer is using this run folder")
        assert all(needle in message for needle in holder_needles(os.getpid())), message
        assert "\n" not in message
    assert (run_dir / LOCK_NAME).read_bytes() == b""
    with RunLock(run_dir):  # free again
        pass


def test_a_second_trainer_is_refused_and_changes_nothing(copy_data, tmp_path):  # noqa: F811
    """A finished 2-update run; another process holds its lock. `mtrain train` to 4 updates (a
    real process) exits 1 with one line naming the holder, and every file of the folder is as it
    was; translate, average and a dry run read the folder meanwhile. After a SIGKILL of the
    holder the same command trains at once."""
    run_dir = tmp_path / "run"
    assert cli(*train_args(copy_data, run_dir, 2)).exit_code == 0
    holder = hold(run_dir)
    try:
        before = snapshot(run_dir)
        assert LOCK_NAME in before and "last.pt" in before
        args = train_args(copy_data, run_dir, 4)
        proc = subprocess.run([sys.executable, "-m", "mtrain", *args], cwd=ROOT, env=child_env(),
                              capture_output=True, timeout=120, check=False)
        err = proc.stderr.decode()
        assert proc.returncode == 1 and proc.stdout == b"", err
        assert len(err.splitlines()) == 1 and err.startswith(f"error: {run_dir}: another trainer is using this "
                                                             "run folder"), err
        assert all(needle in err for needle in holder_needles(holder.pid)), err
        assert snapshot(run_dir) == before
        # Readers never lock: they work on a folder in use.
        src = tmp_path / "in.de"
        src.write_text("alpha beta\ngamma delta epsilon\n", encoding="utf-8")
        out = tmp_path / "out.en"
        result = cli("translate", "--checkpoint", run_dir / "best.pt", "--input", src, "--output", out,
                     "--device", "cpu", "--greedy")
        assert result.exit_code == 0, result.output
        assert len(out.read_text(encoding="utf-8").splitlines()) == 2
        result = cli("average", run_dir / "step-2.pt", run_dir / "best.pt", "--out", tmp_path / "avg.pt")
        assert result.exit_code == 0, result.output
        result = cli(*args, "--dry-run")  # a dry run writes nothing, so it takes no lock
        assert result.exit_code == 0 and '"parameters"' in result.stdout, result.output
        assert snapshot(run_dir) == before
    finally:
        holder.kill()
        holder.wait()
    assert holder.returncode == -signal.SIGKILL
    started = time.perf_counter()
    result = cli(*args)
    assert result.exit_code == 0 and "resuming from" in result.output, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["step"] == 4
    assert time.perf_counter() - started < 60
    assert (run_dir / LOCK_NAME).read_bytes() == b""


def test_a_training_process_holds_the_lock_until_it_ends(copy_data, tmp_path):  # noqa: F811
    """A real `mtrain train` holds RUN/.lock (its PID in it) while it trains; a trainer started
    meanwhile is refused naming it; Ctrl-C ends the run, and the lock with it."""
    from mtrain.train import train

    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "mtrain", *train_args(copy_data, run_dir, 100_000),
                             "--set", "train.save_every=100000", "--set", "train.eval_every=100000"],
                            cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").is_file():  # its holder line is written before metrics.jsonl
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
            time.sleep(0.1)
        assert json.loads((run_dir / LOCK_NAME).read_text())["pid"] == proc.pid
        with pytest.raises(MtrainError, match=f"another trainer is using this run folder .*PID {proc.pid}, started"):
            train(load_config(None, TINY + ["train.max_steps=2"]), copy_data, run_dir, device="cpu")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err.decode()
    assert (run_dir / LOCK_NAME).read_bytes() == b""
    with RunLock(run_dir):
        pass


# ---------------------------------------------------------------- torchrun: rank 0 alone locks

def _rank(rank: int, port: int, data_dir: str, run_dir: str, report: str) -> None:
    """One rank of a 2-process gloo job: records whether it took the lock, and how training ended."""
    import torch

    from mtrain import lock, train

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    took = []

    class Recording(lock.RunLock):
        def __enter__(self):
            took.append(rank)
            return super().__enter__()

    train.RunLock = Recording
    try:
        train.train(load_config(None, TINY + ["train.max_steps=2"]), data_dir, run_dir, device="cpu")
        outcome = "trained"
    except MtrainError as err:
        outcome = f"error: {err}"
    Path(report, f"rank{rank}.json").write_text(json.dumps({"locked": bool(took), "outcome": outcome}))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn(data_dir: Path, run_dir: Path, report: Path) -> list[dict]:
    import torch.multiprocessing as mp

    report.mkdir(exist_ok=True)
    context = mp.spawn(_rank, args=(_free_port(), str(data_dir), str(run_dir), str(report)), nprocs=2, join=False)
    deadline = time.monotonic() + 240
    while not context.join(timeout=5):
        assert time.monotonic() < deadline, "a rank did not end: it waits in a collective"
    return [json.loads((report / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow  # two spawned processes import torch and train
def test_under_torchrun_only_rank_0_locks_and_every_rank_stops_on_a_busy_folder(copy_data, tmp_path):  # noqa: F811
    ranks = _spawn(copy_data, tmp_path / "run", tmp_path / "free")
    assert [r["locked"] for r in ranks] == [True, False]
    assert [r["outcome"] for r in ranks] == ["trained", "trained"]
    holder = hold(tmp_path / "busy")
    try:
        ranks = _spawn(copy_data, tmp_path / "busy", tmp_path / "busy-report")
    finally:
        holder.kill()
        holder.wait()
    assert [r["locked"] for r in ranks] == [True, False]
    assert ranks[0]["outcome"].startswith(f"error: {tmp_path / 'busy'}: another trainer is using this run folder")
    assert f"PID {holder.pid}" in ranks[0]["outcome"]
    assert ranks[1]["outcome"] == f"error: {tmp_path / 'busy'}: rank 0 could not lock the run folder; see its error line"
