"""DDP: two gloo processes, each taking its share of the same bucketed batch list, match one
process accumulating that global batch (update_freq 2)."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from test_train import TINY, copy_data  # noqa: F401  (tests/ is on sys.path under pytest; copy_data is a fixture)

from mtrain.config import load_config

ARGS = TINY + ["model.dropout=0", "train.max_steps=4", "train.log_every=1", "train.eval_every=100",
               "train.save_every=100", "train.eval_max_sentences=2"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, data_dir: str, run_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from mtrain.train import train

    train(load_config(None, ARGS + ["train.update_freq=1"]), data_dir, run_dir, device="cpu")


def _losses(run_dir) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if r["event"] == "train"]


@pytest.mark.slow  # ~30 s on 2 cores: two spawned processes import torch and train
def test_two_process_gloo_matches_one_process(copy_data, tmp_path):  # noqa: F811
    from mtrain.train import train

    train(load_config(None, ARGS + ["train.update_freq=2"]), copy_data, tmp_path / "one", device="cpu")
    mp.spawn(_worker, args=(2, _free_port(), str(copy_data), str(tmp_path / "two")), nprocs=2, join=True)
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert [s for s, _ in one] == [s for s, _ in two] == [1, 2, 3, 4]
    for (_, a), (_, b) in zip(one, two):
        assert a == pytest.approx(b, abs=1e-5)
    w1 = torch.load(tmp_path / "one" / "last.pt", weights_only=True)["model"]
    w2 = torch.load(tmp_path / "two" / "last.pt", weights_only=True)["model"]
    for key in w1:
        torch.testing.assert_close(w1[key], w2[key], rtol=1e-4, atol=1e-5)


# A 2-position sinusoid table, and validations after updates 2 and 4 whose greedy outputs may run to
# 100 tokens: the table grows during training, and again on rank 0 alone, in inference mode.
LONG_VALIDATION = ["model.max_len=2", "train.eval_every=2", "decode.max_len_b=100"]


def _worker_long_validation(rank: int, port: int, data_dir: str, run_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from mtrain.train import train

    train(load_config(None, ARGS + LONG_VALIDATION + ["train.update_freq=1"]), data_dir, run_dir, device="cpu")


@pytest.mark.slow  # a 2-process gloo job and one process, ~20 s on 2 cores
def test_a_validation_that_grows_the_position_table_on_rank_0_does_not_stop_training(copy_data, tmp_path):  # noqa: F811
    """Only rank 0 validates, and a translation longer than the sinusoid table grows the table
    there. Training goes on, on both ranks, to the same result as one process."""
    from mtrain.train import train

    mp.spawn(_worker_long_validation, args=(_free_port(), str(copy_data), str(tmp_path / "two")), nprocs=2, join=True)
    train(load_config(None, ARGS + LONG_VALIDATION + ["train.update_freq=2"]), copy_data, tmp_path / "one", device="cpu")
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert [s for s, _ in two] == [1, 2, 3, 4]
    for (_, a), (_, b) in zip(one, two):
        assert a == pytest.approx(b, abs=1e-5)


@pytest.mark.parametrize("device,backend", [("cpu", "gloo"), ("cuda", "nccl")])
def test_process_group_waits_longer_than_a_validation_on_rank_0(monkeypatch, device, backend):
    """The other ranks wait at a collective while rank 0 validates, averages and saves: the group
    is made with distributed.TIMEOUT (2 h), not NCCL's default of 10 minutes."""
    import datetime

    from mtrain import distributed

    made = []
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kwargs: made.append(kwargs))
    distributed.setup(distributed.DistInfo(rank=1, world_size=2), torch.device(device))
    assert made == [{"backend": backend, "rank": 1, "world_size": 2, "timeout": datetime.timedelta(hours=2)}]
    distributed.setup(distributed.DistInfo(), torch.device(device))  # one process: no group
    assert len(made) == 1


# ---------------------------------------------------------------- one rank runs out of memory

OOM_ARGS = ARGS + ["train.max_steps=6", "train.save_every=2", "train.update_freq=1"]


def _rank_out_of_memory(rank: int, port: int, data_dir: str, run_dir: str, report: str, oom_at: int) -> None:
    """One rank of a 2-process gloo job; rank 1's forward of update `oom_at` runs out of memory
    (0: never). Writes the rank's outcome to report/rank<N>.json."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from mtrain import trainer
    from mtrain.errors import MtrainError
    from mtrain.train import train

    if rank == 1 and oom_at:
        forward_backward, calls = trainer.forward_backward, []

        def out_of_memory(*args, **kwargs):
            calls.append(1)
            if len(calls) == oom_at:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return forward_backward(*args, **kwargs)

        trainer.forward_backward = out_of_memory
    try:
        train(load_config(None, OOM_ARGS), data_dir, run_dir, device="cpu")
        outcome = "trained"
    except MtrainError as err:
        outcome = str(err)
    with open(os.path.join(report, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)


def _job(tmp_path, data_dir, run_dir, oom_at: int) -> list[str]:
    """Both ranks' outcomes; fails if a rank is still waiting in a collective after 2 minutes."""
    import time

    report = tmp_path / f"report-{len(list(tmp_path.glob('report-*')))}"
    report.mkdir()
    context = mp.spawn(_rank_out_of_memory, args=(_free_port(), str(data_dir), str(run_dir), str(report), oom_at),
                       nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("a rank did not end: it waits in a collective")
    return [json.loads((report / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow  # three 2-process gloo jobs, ~30 s on 2 cores
def test_when_one_rank_runs_out_of_memory_every_rank_stops_and_the_run_resumes_exactly(copy_data, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    main, other = _job(tmp_path, copy_data, run_dir, oom_at=3)
    assert other.startswith(f"step 3: out of cpu memory in a batch of "), other
    assert f"{run_dir / 'last.pt'} is intact, and re-running the same command with --set train.max_tokens=" in other
    # Rank 0 waited for rank 1 in the update's gradient all-reduce: one line, not gloo's traceback.
    assert main.startswith("rank 0: another rank of this job stopped (Connection closed by peer"), main
    assert main.endswith(f"its own error line says why. {run_dir / 'last.pt'} holds the last save: fix the cause "
                         "and re-run the same command to resume from it"), main
    assert torch.load(run_dir / "last.pt", weights_only=True)["step"] == 2

    assert _job(tmp_path, copy_data, run_dir, oom_at=0) == ["trained", "trained"]
    assert _job(tmp_path, copy_data, tmp_path / "straight", oom_at=0) == ["trained", "trained"]
    assert _losses(run_dir)[-4:] == _losses(tmp_path / "straight")[-4:]
    resumed = torch.load(run_dir / "last.pt", weights_only=True)["model"]
    straight = torch.load(tmp_path / "straight" / "last.pt", weights_only=True)["model"]
    for key in straight:
        assert torch.equal(resumed[key], straight[key]), key


def test_a_collective_that_lost_its_peer_becomes_one_line(tmp_path):
    from mtrain import distributed
    from mtrain.errors import is_lost_peer
    from mtrain.train import lost_peer_error

    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
                        "by peer [127.0.0.1]:11978. This is typically caused by a remote worker crashing.")
    assert is_lost_peer(gloo)
    assert is_lost_peer(RuntimeError("Connection reset by peer"))
    aborted = torch.distributed.DistBackendError("NCCL communicator was aborted on rank 1.\nLast error: ...")
    assert is_lost_peer(aborted)
    assert is_lost_peer(RuntimeError("NCCL error: remote process exited or there was a network error, "
                                     "NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to ..."))
    # NCCL's own failures are not a lost peer, nor are other errors: they keep their whole message
    assert not is_lost_peer(torch.distributed.DistBackendError("NCCL error: invalid usage ... Duplicate GPU detected"))
    assert not is_lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_lost_peer(OSError("Connection closed by peer"))  # not a collective's error
    line = str(lost_peer_error(gloo, distributed.DistInfo(rank=1, world_size=2), tmp_path))
    assert line == ("rank 1: another rank of this job stopped (Connection closed by peer [127.0.0.1]:11978); its "
                    "own error line says why. nothing was saved yet: fix the cause and re-run the same command")
    (tmp_path / "last.pt").write_bytes(b"")
    line = str(lost_peer_error(aborted, distributed.DistInfo(rank=0, world_size=2), tmp_path))
    assert line == ("rank 0: another rank of this job stopped (NCCL communicator was aborted on rank 1.); its own "
                    f"error line says why. {tmp_path / 'last.pt'} holds the last save: fix the cause and re-run the "
                    "same command to resume from it")
