"""train.max_tokens=auto: the largest token budget per batch whose training step fits in the
device's memory with a margin, found at start-up by running forward, backward and an optimizer
step on the two most demanding batches of each budget tried. At a given token budget the longest
training pairs need the most memory for attention, which grows with the square of their length.
The pairs with the longest targets need the most for the output layer and the loss, which grow
with the real target tokens (a batch padded to a long source holds fewer). A run that resumes
keeps the budget its last.pt was trained with, so its batches, and resume, stay exact.

Only a GPU has memory worth probing: on a CPU, auto means the default budget."""

from __future__ import annotations

import math
from typing import Callable, Protocol

import numpy as np
import torch

from mtrain.errors import MtrainError, is_out_of_memory
from mtrain.hardware import cuda_index

MARGIN = 0.10  # of the device's memory left free: allocator fragmentation, validation, other batches' shapes
GRAIN = 64  # budgets are multiples of this
CEILING = 65536  # never more per batch: beyond it a GPU gains little, and the optimisation changes a lot
CPU_DEFAULT = 4096  # what auto means on a CPU (TrainConfig's default budget)
GiB = 2 ** 30


class MemoryGauge(Protocol):
    """What the probe asks of a device: how much memory it may use, and the peak of one step."""

    def capacity(self) -> int: ...

    def reset(self) -> None: ...

    def peak(self) -> int: ...


class CudaMemory:
    """A CUDA device's memory as torch's caching allocator holds it. The peak counts reserved
    memory (allocated plus the allocator's cached blocks), which is what another allocation can
    run out of."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device("cuda", cuda_index(device))  # the cap query wants an index

    def capacity(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)  # other processes on the GPU count
        return int(min(free + torch.cuda.memory_reserved(self.device), process_cap(self.device) * total))

    def reset(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_reserved(self.device)


def process_cap(device: torch.device) -> float:
    """The share of the GPU this process may allocate. A process sharing its GPU with another job,
    capped by PYTORCH_CUDA_ALLOC_CONF=per_process_memory_fraction:F or by
    torch.cuda.set_per_process_memory_fraction, runs out of memory at its cap however much of the
    GPU is free. A torch too old to report the cap gets the whole GPU."""
    query = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return 1.0 if query is None else float(query(device))


def memory_gauge(device: torch.device) -> MemoryGauge | None:
    """The device's gauge, or None where memory is not what limits a batch (a CPU)."""
    return CudaMemory(device) if device.type == "cuda" else None


class ProbeBatches:
    """The batches a budget is probed on, for every budget the search tries: the longest pairs (by
    max(src, tgt) + 1, make_batches' cost), as many as the budget holds, and, when it is another
    batch, the one with the most real target tokens. The corpus is sorted once, here."""

    def __init__(self, src_lengths: np.ndarray, tgt_lengths: np.ndarray) -> None:
        tgt = np.asarray(tgt_lengths).astype(np.int64)
        self.cost = np.maximum(np.asarray(src_lengths).astype(np.int64), tgt) + 1
        self.by_cost = np.argsort(-self.cost, kind="stable")
        self.by_target = np.argsort(-tgt, kind="stable")
        self.cost_by_target = self.cost[self.by_target]
        top_t, top_c = int(tgt.max()), int(self.cost.max()) + 1
        classes, self.counts = np.unique((top_t - tgt) * top_c + self.cost, return_counts=True)  # longest targets first
        self.class_tgt, self.class_cost = top_t - classes // top_c, classes % top_c
        self.costs = np.unique(self.cost)

    def longest(self, budget: int) -> np.ndarray:
        """The longest pairs, as many as the budget holds (at least one)."""
        return self.by_cost[:max(1, budget // int(self.cost[self.by_cost[0]]))]

    def fullest(self, budget: int) -> np.ndarray:
        """The batch with the most real target tokens. A batch whose widest pair costs c holds
        budget // c pairs, all costing at most c; the most targets it can hold are the budget // c
        longest targets among those pairs. So every cost c present is tried, on the (target length,
        cost) classes of the pairs rather than the pairs, and the best c's batch is returned."""
        best, widest = -1, 0
        for c in self.costs:
            k = budget // int(c)
            if k == 0:
                continue
            inside = self.class_cost <= c
            n, t = self.counts[inside], self.class_tgt[inside]
            taken = np.clip(k - (np.cumsum(n) - n), 0, n)  # of each class, in order, until k pairs
            total = int((taken * t).sum())
            if total > best:
                best, widest = total, int(c)
        if not widest:  # no pair fits the budget: the longest target alone
            return self.by_target[:1]
        return self.by_target[self.cost_by_target <= widest][:budget // widest]

    def __call__(self, budget: int) -> list[np.ndarray]:
        longest, fullest = self.longest(budget), self.fullest(budget)
        same = len(longest) == len(fullest) and set(longest.tolist()) == set(fullest.tolist())
        return [longest] if same else [longest, fullest]


def longest_cost(src_lengths: np.ndarray, tgt_lengths: np.ndarray) -> int:
    return int(np.maximum(src_lengths, tgt_lengths).max()) + 1


def round_down(tokens: float) -> int:
    return int(tokens) // GRAIN * GRAIN


class Probe:
    """Measures the peak memory of a budget's training steps; None when one ran out of memory."""

    def __init__(self, step: Callable[[int], None], gauge: MemoryGauge, log: Callable[[str], None]) -> None:
        self.step, self.gauge, self.log = step, gauge, log
        self.peaks: dict[int, int | None] = {}

    def __call__(self, budget: int) -> int | None:
        self.gauge.reset()
        try:
            self.step(budget)
            peak: int | None = self.gauge.peak()
        except RuntimeError as err:
            if not is_out_of_memory(err):
                raise
            peak = None
        self.peaks[budget] = peak
        self.log(f"max_tokens probe: {budget} tokens: " + ("out of memory" if peak is None else f"peak {peak / GiB:.2f} GiB"))
        return peak


def search(measure: Callable[[int], int | None], capacity: int, floor: int, ceiling: int = CEILING,
           margin: float = MARGIN) -> int:
    """The largest budget (a multiple of GRAIN, from floor up to ceiling) whose measured peak stays
    under (1 - margin) of capacity. Memory grows about linearly with the budget: the line through
    the last two budgets that fitted gives the next to try, until a try fails or gains less than
    1/16; a failed try is settled by bisection between the largest budget that fitted and it."""
    limit = capacity * (1 - margin)
    fits = _fits(measure, limit)
    floor = max(GRAIN, math.ceil(floor / GRAIN) * GRAIN)
    ceiling = max(floor, round_down(ceiling))
    start = min(ceiling, max(floor, START))
    first = measure(start)
    if first is None or first > limit:
        if start == floor or not fits(floor):
            raise _too_small(floor, capacity, margin)
        return bisect(fits, floor, start)
    points = [(start, first)]
    budget = min(ceiling, 2 * start)
    for _ in range(8):
        if budget <= points[-1][0]:
            break
        peak = measure(budget)
        if peak is None or peak > limit:
            return bisect(fits, points[-1][0], budget)
        points.append((budget, peak))
        (b0, p0), (b1, p1) = points[-2:]
        slope = (p1 - p0) / (b1 - b0)
        guess = ceiling if slope <= 0 else min(ceiling, round_down(b1 + (limit - p1) / slope))
        budget = guess if guess > b1 + max(GRAIN, b1 // 16) else b1
    return points[-1][0]


START = 1024  # the first budget tried (or the longest pair's cost, when larger)


def _fits(measure: Callable[[int], int | None], limit: float) -> Callable[[int], bool]:
    def fits(budget: int) -> bool:
        peak = measure(budget)
        return peak is not None and peak <= limit
    return fits


def _too_small(floor: int, capacity: int, margin: float) -> MtrainError:
    return MtrainError(f"train.max_tokens=auto: even {floor} tokens (a batch of the longest training pair) needs "
                       f"more than {1 - margin:.0%} of the device's {capacity / GiB:.1f} GiB; use a smaller model, "
                       "lower data.max_len and re-tokenize, or train on a larger device")


def bisect(fits: Callable[[int], bool], good: int, bad: int) -> int:
    """The largest budget in [good, bad) that fits, to within 1/16 of it (or GRAIN)."""
    while bad - good > max(GRAIN, good // 16):
        middle = round_down((good + bad) / 2)
        if middle <= good:
            break
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good
