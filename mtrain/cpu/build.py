"""Building mtrain's C code on the user's machine without ever being in the way.

A library is built once per machine and compiler, into the user's cache folder, under a name that
carries a hash of everything that decides what it does: its source, the flags, the compiler's
version and the instruction sets `-march=native` means on this CPU (asked of the compiler itself,
so it holds where /proc/cpuinfo is unreadable). Processes that start together (torchrun's ranks,
decoding workers) take a lock on that name: one builds, the others wait and load what it built. A
build that fails leaves a note beside the library's name, so later processes say why at once
instead of compiling again; deleting the note retries. Whatever goes wrong (no compiler, a failing
compile, a read-only or full cache folder, a lock held too long) comes back as one line of why,
and the caller keeps PyTorch's path."""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

COMPILE_TIMEOUT_S = 120
LOCK_WAIT_S = 600  # a build takes seconds; a lock held this long belongs to a process that hangs


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/mtrain, or ~/.cache/mtrain (RuntimeError where there is no home folder)."""
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "mtrain"


def compiler() -> str | None:
    """$CC, else cc or gcc on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _ask(command: list[str]) -> str:
    """What a quick compiler query prints ('' where it fails)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout if done.returncode == 0 else ""


@functools.cache
def compiler_identity(cc: str) -> str:
    """The compiler's version and target, as it prints them: part of every library's key, so that
    a new compiler builds anew."""
    return _ask([cc, "--version"]).split("\n", 1)[0] + " " + _ask([cc, "-dumpmachine"]).strip()


@functools.cache
def native_target(cc: str) -> str:
    """The instruction sets `-march=native` turns on here, as the compiler reports them: the
    CPU's part of a library's key."""
    enabled = [line.split()[0] for line in _ask([cc, "-march=native", "-Q", "--help=target"]).splitlines()
               if "[enabled]" in line or line.strip().startswith("-march=")]
    return " ".join(enabled)


def library_name(stem: str, key: list[str]) -> str:
    return f"{stem}-{hashlib.sha256(chr(0).join(key).encode()).hexdigest()[:16]}.so"


def build_once(stem: str, key: list[str], compile_into: Callable[[Path], str | None]) -> tuple[Path | None, str]:
    """(path, '') of the library named by stem and key in the cache folder, built by
    compile_into(path) if it is not there yet; (None, why) where it cannot be had. compile_into
    writes the library to the path it is given (a temporary name: a half-written library is never
    loaded) and returns None, or why it failed."""
    try:
        folder = cache_dir()
    except RuntimeError:
        return None, "no home folder to keep it in (set XDG_CACHE_HOME)"
    path = folder / library_name(stem, key)
    if path.exists():
        return path, ""
    note = path.with_suffix(".failed")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with _locked(path.with_suffix(".lock")):
            if path.exists():  # another process built it while this one waited
                return path, ""
            if note.exists():
                return None, f"{_read(note)} (an earlier build; delete {note} to try again)"
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                built = Path(tmp) / path.name
                failed = compile_into(built)
                if failed is None:
                    os.replace(built, path)
                    return path, ""
            _remember(note, failed)
            return None, failed
    except TimeoutError:
        return None, f"another process has held {path.with_suffix('.lock')} for {LOCK_WAIT_S} s"
    except OSError as err:
        return None, f"cannot write {folder} ({err.strerror or err})"


class _locked:
    """An exclusive flock on `path` for the with-block, waiting up to LOCK_WAIT_S for it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as err:
                held = err.errno in (errno.EAGAIN, errno.EACCES)
                if not held or time.monotonic() > deadline:
                    os.close(self.fd)
                    raise TimeoutError(str(self.path)) if held else err
            time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _remember(note: Path, failed: str) -> None:
    """Keep why a build failed (best effort: a full disk may not take even that)."""
    try:
        tmp = note.with_suffix(".failed.tmp")
        tmp.write_text(failed + "\n", encoding="utf-8")
        os.replace(tmp, note)
    except OSError:
        pass


def _read(note: Path) -> str:
    try:
        return note.read_text(encoding="utf-8").strip() or "failed"
    except OSError:
        return "failed"


def run_compiler(steps: list[list[str]]) -> str | None:
    """Run the compile and link commands in order; None, or why the first that failed did."""
    for step in steps:
        try:
            subprocess.run(step, check=True, capture_output=True, timeout=COMPILE_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as err:
            said = (getattr(err, "stderr", None) or b"").decode(errors="replace")
            first = next((line.strip() for line in said.splitlines() if "error" in line), "")
            return f"{step[0]} could not build it ({type(err).__name__}{': ' + first if first else ''})"
    return None


def cpuinfo_fields(path: str = "/proc/cpuinfo") -> dict[str, str]:
    """Each key of /proc/cpuinfo with its first value (the first processor's); empty where the
    file is missing (not Linux)."""
    fields: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                key, colon, value = line.partition(":")
                if colon:
                    fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields
