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
