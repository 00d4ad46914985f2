"""mtrain.cpu.build: a library is built once, under a lock, and a failure is remembered; whatever
goes wrong is one line of why, never a traceback or a hang."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path

import pytest

from mtrain.cpu import build

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock")


def _slow_compile(into: Path) -> str | None:
    """A 'compiler' that takes a while and counts its runs in a file beside the cache."""
    counter = into.parents[3] / "compiles"  # XDG_CACHE_HOME/mtrain/tmp.../name.so
    with counter.open("a") as out:
        out.write("1")
    time.sleep(0.5)
    into.write_bytes(b"library")
    return None


def _build_in_process(cache: str, queue) -> None:
    os.environ["XDG_CACHE_HOME"] = cache
    queue.put(build.build_once("demo", ["key"], _slow_compile))


def test_processes_that_start_together_build_once(tmp_path):
    """As torchrun's ranks or decoding workers do: one builds, the others wait and load it."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_build_in_process, args=(str(tmp_path / "cache"), queue)) for _ in range(3)]
    for process in processes:
        process.start()
    results = [queue.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(timeout=60)
    assert (tmp_path / "compiles").read_text() == "1"
    paths = {path for path, why in results}
    assert len(paths) == 1 and all(why == "" for _, why in results)
    (path,) = paths
    assert path.read_bytes() == b"library"


def test_a_failure_is_remembered_until_its_note_is_deleted(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def failing(into: Path) -> str:
        calls.append(into)
        return "cc could not build it (CalledProcessError: error: unknown type name)"

    assert build.build_once("demo", ["k"], failing) == (None, "cc could not build it (CalledProcessError: error: unknown type name)")
    path, why = build.build_once("demo", ["k"], failing)
    note = tmp_path / "mtrain" / build.library_name("demo", ["k"])
    assert path is None and len(calls) == 1
    assert why == f"cc could not build it (CalledProcessError: error: unknown type name) (an earlier build; delete {note.with_suffix('.failed')} to try again)"
    note.with_suffix(".failed").unlink()
    assert build.build_once("demo", ["k"], lambda into: into.write_bytes(b"x") and None)[0] == note
    assert not list((tmp_path / "mtrain").glob("tmp*"))


def test_a_read_only_cache_folder_is_one_line(tmp_path, monkeypatch):
    if os.geteuid() == 0:  # root writes anywhere: a file where the folder should be blocks it instead
        (tmp_path / "ro").write_text("")
    else:
        (tmp_path / "ro").mkdir(mode=0o500)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "ro"))
    path, why = build.build_once("demo", ["k"], lambda into: pytest.fail("compiled"))
    assert path is None and why.startswith(f"cannot write {tmp_path / 'ro' / 'mtrain'} (")


def test_a_lock_held_too_long_gives_up_in_one_line(tmp_path, monkeypatch):
    import fcntl

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(build, "LOCK_WAIT_S", 0.3)
    folder = tmp_path / "mtrain"
    folder.mkdir()
    lock = (folder / build.library_name("demo", ["k"])).with_suffix(".lock")
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another open file description: flock sees a second holder
        path, why = build.build_once("demo", ["k"], lambda into: pytest.fail("compiled"))
    assert path is None and why == f"another process has held {lock} for 0.3 s"


def test_a_full_disk_while_compiling_is_remembered_as_its_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def full(into: Path) -> str:
        raise OSError(28, "No space left on device")

    path, why = build.build_once("demo", ["k"], full)
    assert path is None and why.startswith(f"cannot write {tmp_path / 'mtrain'} (No space left on device")


def test_the_compiler_says_what_this_cpu_is():
    cc = build.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    target = build.native_target(cc)
    identity = build.compiler_identity(cc)
    assert identity.strip()
    if "gcc" in identity.lower() or "GCC" in identity:
        assert "-march=" in target
