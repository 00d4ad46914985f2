"""release_free_memory gives freed heap pages back: the resident set shrinks by about what was freed
between live blocks, which glibc keeps mapped otherwise. reuse_freed_memory keeps blocks of up to
32 MiB on the heap, and `mtrain train` sets it."""

from __future__ import annotations

import subprocess
import sys

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


HEAP_BLOCK = """
import sys, torch
from mtrain import memory
if sys.argv[1] == "reuse":
    assert memory.reuse_freed_memory()
def heap():
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            return tuple(int(x, 16) for x in line.split()[0].split("-"))
block = torch.empty(8 << 18).fill_(1.0)  # 8 MiB, every page written
start, end = heap()
inside = start <= block.data_ptr() < end
del block
print(inside, heap()[1] == end)
"""


@pytest.mark.skipif(memory._mallopt() is None, reason="needs glibc's mallopt (Linux)")
def test_with_reuse_an_8_mib_block_comes_from_the_heap_and_stays_there_when_freed():
    # In processes of their own: the setting is process-wide. glibc's defaults give the block a
    # mapping of its own, which its free unmaps; with reuse_freed_memory it sits in the heap, and
    # freeing it leaves the heap as long as it was.
    def run(mode):
        out = subprocess.run([sys.executable, "-c", HEAP_BLOCK, mode], capture_output=True, text=True, check=True)
        return out.stdout.split()

    assert run("reuse") == ["True", "True"]
    assert run("default")[0] == "False"


def test_reuse_is_a_no_op_without_mallopt(monkeypatch):
    monkeypatch.setattr(memory, "_mallopt", lambda: None)
    assert memory.reuse_freed_memory() is False


def test_mtrain_train_sets_it(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    import mtrain.train
    from mtrain.cli import app

    calls = []
    monkeypatch.setattr(memory, "reuse_freed_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(mtrain.train, "train", lambda *a, **k: {})
    result = CliRunner().invoke(app, ["train", "--data", str(tmp_path), "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert calls == [1]
