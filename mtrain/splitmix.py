"""SplitMix64 (Steele, Lea and Flood 2014, with Stafford's mixing constants), the one definition
of the counter-based random numbers mtrain draws: sampling's streams (mtrain.search) and the
dropout masks of a CPU training step (mtrain.cpu.ops, and mtrain/cpu/native.c in C, which the
tests hold to these bits). Word j of a sequence is the mix of the counter seed + (j + 1) * GAMMA:
no state but the seed, so any word can be drawn in any order, in any process."""

from __future__ import annotations

import numpy as np

GAMMA, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
MASK = (1 << 64) - 1


def mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer of each uint64 in z (numpy's uint64 arithmetic wraps, as it must)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX2)
    return z ^ (z >> np.uint64(31))


def words(seed: int, n: int) -> np.ndarray:
    """Words 0..n-1 of the sequence from `seed`, as uint64."""
    counters = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(GAMMA) + np.uint64(seed & MASK)
    return mix(counters)


def mix_int(z: int) -> int:
    """mix of one Python int (taken modulo 2^64)."""
    return int(mix(np.array([z & MASK], dtype=np.uint64))[0])
