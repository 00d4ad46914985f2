"""mtrain.workers: the decoding processes' pool, on jobs that need no model."""

from __future__ import annotations

import os

import pytest

from mtrain.errors import MtrainError
from mtrain.workers import DecodingPool, threads_per_worker


def build_offset(offset: int) -> int:
    return offset


def add_offset(model: int, job: int) -> tuple[int, int]:
    """The job plus the worker's model, and the worker's threads (torch.get_num_threads)."""
    import torch

    return model + job, torch.get_num_threads()


def die(model: int, job: int) -> int:
    os._exit(3)  # a worker killed mid-batch, as the kernel's out-of-memory killer would


def test_results_come_in_job_order_from_models_built_once_per_worker():
    with DecodingPool(build_offset, (100,), add_offset, workers=2, threads=4) as pool:
        results = list(pool.map(range(20)))
    assert [total for total, _ in results] == [100 + job for job in range(20)]
    assert {threads for _, threads in results} == {2}  # 4 threads shared by 2 workers


def test_a_worker_that_dies_ends_the_run_with_one_line():
    with DecodingPool(build_offset, (0,), die, workers=2, threads=2) as pool:
        with pytest.raises(MtrainError, match=r"decode.workers=2: a decoding process ended .* fewer workers"):
            list(pool.map(range(4)))


@pytest.mark.parametrize("workers, threads, each", [(1, 8, 8), (2, 8, 4), (3, 8, 2), (4, 2, 1), (2, 1, 1)])
def test_threads_are_shared_and_every_worker_gets_one(workers, threads, each):
    assert threads_per_worker(workers, threads) == each
