"""Decoding in several processes on a CPU (decode.workers): each process builds the model once and
decodes whole batches with its share of the threads, as Marian's CPU workers and CTranslate2's
inter_threads do; the results come back in input order.

At decoding's batch sizes much of a step is small ops (attention over a few keys, layer norms, the
search's bookkeeping) that PyTorch runs on one thread, or that pay more in handing work to a second
thread than they gain from it. On a 2-core Intel Xeon with AMX, `mtrain translate` of 12000 lines
with bfloat16 weights ran 1.06-1.12x (greedy) and 1.15-1.17x (beam 5) as fast with two 1-thread
workers as in one 2-thread process, start-up included (about 1.3 s for the workers); in float32,
whose matmuls gain more from a second thread, 0.94-0.97x and 1.10x (benchmarks/results/intel-xeon-amx/NOTES.md).

What is guaranteed: each batch is decoded exactly as one process with the workers' share of the
threads decodes it (threads_per_worker), so the output equals, byte for byte, that of one process
run with that many threads. Against one process with all the threads, matrix products may sum in
another order (a thread count is part of how oneDNN and MKL block them), so scores agree to float32
rounding and the text differs only where two candidates tie within it. Each process holds its own
copy of the model, and the calling process (which reads, tokenizes and writes) none
(translate.load_outline).

This module imports no torch at the top: a worker runs mkl.enable() (which must come
before torch is imported, and follows the same opt-in setting as the calling process) before it
builds its model."""

from __future__ import annotations

import concurrent.futures
import importlib
import multiprocessing
import signal
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from mtrain.errors import MtrainError

_worker: dict[str, Any] = {}  # in a worker process: its model and the function that runs a job


def _function(name: str) -> Any:
    """`package.module:function` -> that function, imported now."""
    module, _, attribute = name.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _start(build: str, build_args: tuple, run: str, threads: int) -> None:
    """A worker's start: MKL's dispatch before torch (build and run are named, not pickled, so that
    nothing imports torch before this runs), its threads, its model. Ctrl-C is the parent's to
    handle: it ends the workers. A model that fails to build fails every job with its one-line
    message, rather than the pool's traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker["torch_before_start"] = "torch" in sys.modules  # what mtrain.cpu.mkl needs to be False
    from mtrain.cpu import mkl

    mkl.enable()
    import torch

    torch.set_num_threads(threads)
    _worker["run"] = _function(run)
    try:
        _worker["model"] = _function(build)(*build_args)
    except Exception as error:  # noqa: BLE001 - handed to the parent by _run
        _worker["error"] = error if isinstance(error, MtrainError) else MtrainError(
            f"decode.workers: a decoding process could not load the model: {type(error).__name__}: {error}")


def _run(job: Any) -> Any:
    if "error" in _worker:
        raise _worker["error"]
    return _worker["run"](_worker["model"], job)


def _ready() -> None:
    """A job that only makes the pool start a process (which builds its model first)."""


def threads_per_worker(workers: int, threads: int) -> int:
    """The intra-op threads each of `workers` processes gets from `threads` in all (at least 1)."""
    return max(1, threads // workers)


class DecodingPool:
    """`workers` processes (spawned: a fresh interpreter, not a fork of one whose OpenMP threads
    have run), each calling build(*build_args) once for its model; map(jobs) runs
    run(model, job) for each job there and yields the results in the order of the jobs. build and
    run name module-level functions as `package.module:function`; build_args and the jobs must be
    picklable."""

    def __init__(self, build: str, build_args: tuple, run: str, workers: int, threads: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.workers = workers
        self.executor = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=context, initializer=_start,
            initargs=(build, build_args, run, threads_per_worker(workers, threads)))
        for _ in range(workers):  # start them all now: they build their models while the caller reads input
            self.executor.submit(_ready)

    def submit(self, jobs: Iterable[Any]) -> list[concurrent.futures.Future]:
        """Hand the jobs to the workers now; results() collects them."""
        return [self.executor.submit(_run, job) for job in jobs]

    def results(self, futures: list[concurrent.futures.Future]) -> Iterator[Any]:
        """The submitted jobs' results, in their order, each as soon as it and those before it are done."""
        try:
            for future in futures:
                yield future.result()
        except concurrent.futures.process.BrokenProcessPool as error:
            raise MtrainError(f"decode.workers={self.workers}: a decoding process ended before its batch was done "
                              f"({error}); out of memory? Run again with fewer workers") from None

    def map(self, jobs: Iterable[Any]) -> Iterator[Any]:
        return self.results(self.submit(jobs))

    def close(self, finished: bool = True) -> None:
        """Wait for the processes to end; when the run did not finish (an error, Ctrl-C), stop them
        at once rather than let them finish batches nobody will read."""
        if finished:
            self.executor.shutdown(wait=True, cancel_futures=True)
            return
        if hasattr(self.executor, "terminate_workers"):  # Python 3.14
            self.executor.terminate_workers()
            return
        processes = list((getattr(self.executor, "_processes", None) or {}).values())  # shutdown forgets them
        self.executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.terminate()

    def __enter__(self) -> "DecodingPool":
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        self.close(finished=exc_type is None)
