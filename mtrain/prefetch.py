"""The training batches one update ahead: while an update computes, a background thread takes the
next update's batches from the stream and collates them (into pinned memory on a GPU, so the
copy to the device can be non-blocking and overlap the model's work).

The batches are exactly those `BatchStream.take` gives, in the same order: the thread draws them
from its own shallow copy of the stream (the real stream's position is never moved by the
thread), and the real stream's (epoch, index) is set to the position after each update as it is
handed out. So the position a checkpoint stores is that of the last update trained on, never of
the one prepared ahead, and resume stays exact. Whoever moves the real stream's position (a
resume) makes the prefetcher drop what it prepared and start again from there."""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from mtrain.data import Batch, BatchStream


@dataclass
class Update:
    """One update's batches (all ranks'), what `prepare` made of them, and the stream position
    (epoch, index) before and after them."""

    batches: list[Batch]
    prepared: Any
    start: tuple[int, int]
    end: tuple[int, int]


class _Job:
    """Takes n batches from `shadow` at `start` and prepares them, in a daemon thread (one that
    never keeps a finished process alive) or inline; the result, or the exception, waits for the
    main thread to ask."""

    def __init__(self, shadow: BatchStream, start: tuple[int, int], n: int, prepare: Callable[[list[Batch]], Any],
                 background: bool):
        self.shadow, self.begin, self.n, self.prepare = shadow, start, n, prepare
        self.update: Update | None = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        if background:
            self.thread = threading.Thread(target=self._run, daemon=True, name="mtrain-prefetch")
            self.thread.start()
        else:
            self._run()

    def _run(self) -> None:
        try:
            self.shadow.epoch, self.shadow.index = self.begin
            batches = self.shadow.take(self.n)
            self.update = Update(batches, self.prepare(batches), self.begin, (self.shadow.epoch, self.shadow.index))
        except BaseException as err:  # re-raised in the main thread, where it belongs
            self.error = err

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()

    def result(self) -> Update:
        self.join()
        if self.error is not None:
            raise self.error
        assert self.update is not None
        return self.update


class Prefetcher:
    """`next()` returns the stream's next n batches, prepared, and advances the stream past them;
    the batches after them are prepared in the background meanwhile (enabled=False: no thread,
    the same results)."""

    def __init__(self, stream: BatchStream, n: int, prepare: Callable[[list[Batch]], Any], enabled: bool = True):
        self.stream, self.n, self.prepare, self.enabled = stream, n, prepare, enabled
        # A shallow copy shares the split and sampler but keeps its own position and epoch cache.
        self.shadow = copy.copy(stream)
        self.job: _Job | None = None

    def next(self) -> Update:
        position = (self.stream.epoch, self.stream.index)
        job = self.job
        if job is None or job.begin != position:  # first call, or the position was moved (resume)
            if job is not None:
                job.join()  # the shadow is the job's until it ends
            job = self._start(position)
        update = job.result()
        self.stream.epoch, self.stream.index = update.end
        self.job = self._start(update.end) if self.enabled else None
        return update

    def _start(self, position: tuple[int, int]) -> _Job:
        return _Job(self.shadow, position, self.n, self.prepare, background=self.enabled)

    def close(self) -> None:
        """Wait for the job in flight (tests; a process that ends needs nothing: the thread is a daemon)."""
        if self.job is not None:
            self.job.join()
        self.job = None


def to_device(tensors: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Host tensors to the device; from pinned memory the copy is asynchronous, queued before the
    model's kernels on the same stream, so no synchronisation is needed."""
    return tuple(t.to(device, non_blocking=True) for t in tensors)


def pin(tensors: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Page-locked copies for a CUDA device (what makes non_blocking copies asynchronous); the
    tensors themselves elsewhere."""
    if device.type != "cuda":
        return tensors
    return tuple(t.pin_memory() for t in tensors)
