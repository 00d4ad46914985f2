"""mtrain.cpu.workers: the decoding processes' pool, on jobs that need no model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtrain.errors import MtrainError
from mtrain.cpu.workers import DecodingPool, threads_per_worker


def build_offset(offset: int) -> int:
    return offset


def add_offset(model: int, job: int) -> tuple[int, int]:
    """The job plus the worker's model, and the worker's threads (torch.get_num_threads)."""
    import torch

    return model + job, torch.get_num_threads()


def die(model: int, job: int) -> int:
    os._exit(3)  # a worker killed mid-batch, as the kernel's out-of-memory killer would


def test_results_come_in_job_order_from_models_built_once_per_worker():
    with DecodingPool(f"{__name__}:build_offset", (100,), f"{__name__}:add_offset", workers=2, threads=4) as pool:
        results = list(pool.map(range(20)))
    assert [total for total, _ in results] == [100 + job for job in range(20)]
    assert {threads for _, threads in results} == {2}  # 4 threads shared by 2 workers


def sleep_unless_first(model: int, job: int) -> int:
    import time

    if job:
        time.sleep(60)
    return job


def test_a_run_that_stops_early_stops_its_workers_at_once():
    """An error or Ctrl-C in the caller ends the workers mid-batch instead of waiting for batches
    nobody will read."""
    import time

    with pytest.raises(RuntimeError):
        with DecodingPool(f"{__name__}:build_offset", (0,), f"{__name__}:sleep_unless_first", workers=2, threads=2) as pool:
            results = pool.map(range(4))
            assert next(results) == 0
            processes = list(pool.executor._processes.values())
            raise RuntimeError("the caller stops")
    start = time.perf_counter()
    for process in processes:
        process.join(timeout=10)
        assert ended(process)
    assert time.perf_counter() - start < 10


def ended(process) -> bool:
    """Whether a worker process has ended. The pool's own thread may reap it first, and then
    Process.is_alive, whose wait finds no child left, still says True: ask the system too."""
    if not process.is_alive():
        return True
    try:
        os.kill(process.pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_worker_that_dies_ends_the_run_with_one_line():
    with DecodingPool(f"{__name__}:build_offset", (0,), f"{__name__}:die", workers=2, threads=2) as pool:
        with pytest.raises(MtrainError, match=r"decode.workers=2: a decoding process ended .* fewer workers"):
            list(pool.map(range(4)))


def fail_to_build() -> None:
    raise FileNotFoundError("runs/x/best.pt")


def test_a_model_that_fails_to_load_in_a_worker_fails_the_run_in_one_line(capfd):
    with DecodingPool(f"{__name__}:fail_to_build", (), f"{__name__}:add_offset", workers=2, threads=2) as pool:
        with pytest.raises(MtrainError, match="could not load the model: FileNotFoundError: runs/x/best.pt"):
            list(pool.map(range(3)))
    assert "Traceback" not in capfd.readouterr().err


def torch_before_start(model: None, job: int) -> bool:
    from mtrain.cpu.workers import _worker

    return _worker["torch_before_start"]


def build_nothing() -> None:
    return None


def test_workers_set_up_mkl_before_torch():
    """The MKL stub must load before torch (mtrain.cpu.mkl): nothing a worker unpickles before
    its start imports torch."""
    with DecodingPool(f"{__name__}:build_nothing", (), f"{__name__}:torch_before_start", workers=1, threads=1) as pool:
        assert list(pool.map([0])) == [False]


@pytest.mark.parametrize("workers, threads, each", [(1, 8, 8), (2, 8, 4), (3, 8, 2), (4, 2, 1), (2, 1, 1)])
def test_threads_are_shared_and_every_worker_gets_one(workers, threads, each):
    assert threads_per_worker(workers, threads) == each


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_processes_benchmark_times_threads_against_processes(multi30k_dir):
    """benchmarks/decode_processes.py at its smallest: every mtrain row (one process with 2 threads,
    with 1, and two 1-thread processes side by side) holds a positive rate and its ratio."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_processes.py"), "--sentences", "16",
                           "--threads", "2", "--json"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    for search in ("greedy", "beam5"):
        rates = [result[f"mtrain_{search}_{form}"] for form in ("1_process_2_threads", "1_process_1_thread",
                                                                  "2_processes_1_thread")]
        assert all(rate > 0 for rate in rates)
        assert result[f"mtrain_{search}_processes_vs_threads"] == pytest.approx(rates[2] / rates[0], rel=1e-2)


@pytest.mark.slow
def test_the_translate_workers_benchmark_finds_the_same_output(multi30k_dir, tokenized_slice, tmp_path):
    """benchmarks/translate_workers.py end to end on a tiny random checkpoint: one process and two
    workers give identical files for greedy and beam 5."""
    import torch

    from mtrain.checkpoint import make, save_atomic
    from mtrain.config import Config, ModelConfig, to_dict
    from mtrain.data import TokenizedData
    from mtrain.model import Transformer

    data = TokenizedData(tokenized_slice)
    cfg = ModelConfig(d_model=32, d_ff=64, n_heads=2, n_encoder_layers=1, n_decoder_layers=1,
                      vocab_size=data.tokenizer.tgt.vocab_size, max_len=48)
    torch.manual_seed(0)
    path = tmp_path / "best.pt"
    save_atomic(make(to_dict(Config(model=cfg)), Transformer(cfg).state_dict(), data.tokenizer.to_state(), data.stats,
                     0), path)
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "translate_workers.py"), "--checkpoint", str(path),
                           "--repeat", "1", "--rounds", "1", "--json"], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    searches = json.loads(done.stdout)["searches"]
    assert set(searches) == {"greedy", "beam 5"} and all(s["identical_output"] for s in searches.values())
