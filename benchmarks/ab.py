"""Two variants of one path, alternated item by item in one process, so that load from elsewhere
on a shared machine hits both alike: what benchmarks/packing_ab.py (training steps) and
benchmarks/decode_ab.py (decoding) time. Also the timer of the kernel benchmarks that time one
call again and again (best_seconds)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any


def best_seconds(run: Callable[[], Any], calls: int, rounds: int = 3, warm: int = 10) -> float:
    """Seconds per call of `run`: the best of `rounds` rounds of `calls` calls, after `warm` calls."""
    for _ in range(warm):
        run()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        times.append((time.perf_counter() - start) / calls)
    return min(times)


def alternate(variants: dict[str, Callable[[], None]], items: Sequence, rounds: int, run: Callable[[Any], Any],
              warmup: int) -> tuple[dict[str, list[float]], list[float], dict[str, list]]:
    """variants = {baseline: apply, candidate: apply}, each apply setting its variant up. After
    `warmup` items of each, every item of every round runs under both, in an order that alternates
    from round to round. Returns each variant's seconds per run, baseline / candidate seconds per
    item, and what `run` returned in the first round. The candidate is left applied."""
    for apply in variants.values():  # warm-up: the allocator, oneDNN's kernels for these shapes
        apply()
        for item in items[:warmup]:
            run(item)
    baseline, candidate = variants
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    outputs: dict[str, list] = {name: [] for name in variants}
    ratios = []
    for r in range(rounds):
        for item in items:
            took = {}
            for name in list(variants) if r % 2 == 0 else list(variants)[::-1]:
                variants[name]()
                start = time.perf_counter()
                out = run(item)
                took[name] = time.perf_counter() - start
                seconds[name].append(took[name])
                if r == 0:
                    outputs[name].append(out)
            ratios.append(took[baseline] / took[candidate])
    variants[candidate]()
    return seconds, ratios, outputs
