"""release_free_memory gives freed heap pages back: the resident set shrinks by about what was freed
between live blocks, which glibc keeps mapped otherwise."""

from __future__ import annotations

import pytest
import torch

from mtrain import memory


def resident_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.skipif(memory._malloc_trim() is None, reason="needs glibc's malloc_trim (Linux)")
def test_freed_holes_between_live_blocks_go_back_to_the_kernel():
    # 100 kB blocks sit in the heap (under malloc's mmap threshold); keeping every other one alive
    # leaves 400 holes of ~100 kB that no shrinking of the heap's top can return.
    blocks = [torch.ones(25_000) for _ in range(800)]  # 80 MB, every page written
    del blocks[::2]
    before = resident_mb()
    assert memory.release_free_memory()
    after = resident_mb()
    assert before - after > 20, (before, after)  # ~40 MB of holes; most of their pages are whole
    assert all(bool((b == 1).all()) for b in blocks)  # the live blocks are untouched


def test_is_a_no_op_without_malloc_trim(monkeypatch):
    monkeypatch.setattr(memory, "_malloc_trim", lambda: None)
    assert memory.release_free_memory() is False
