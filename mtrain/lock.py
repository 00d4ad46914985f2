"""One trainer per run folder: `mtrain train` holds an OS file lock on RUN/.lock for the whole run.

The lock belongs to an open file, so the kernel drops it when the holding process ends, however it
ends (a normal exit, an error, kill -9, a crash, a reboot): a lock is never stale and nothing needs
cleaning up by hand. POSIX systems use flock(2), Windows msvcrt.locking on one byte past the text
(a locked range cannot be read there, and the text must stay readable). On a network filesystem
flock excludes other hosts where the filesystem supports it (NFS with a lock service does; a
`local_lock=flock` mount excludes only processes of the same host). A filesystem with no file
locks at all gets a note on stderr, and training goes on unlocked.

While the lock is held, the file holds the holder's host, PID and start time (one JSON line), which
a second trainer reads for its message; the holder empties it when it lets go. The file itself is
never deleted: a trainer could otherwise lock a new RUN/.lock while another still holds the old,
unlinked one. Readers (translate, eval, score, average) never take the lock: checkpoints are
replaced atomically, so reading a folder that is being trained in is safe.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import socket
import sys
import time
from pathlib import Path
from types import TracebackType

from mtrain.atomic import describe_write_error
from mtrain.errors import MtrainError

LOCK_NAME = ".lock"

# flock's answers on a filesystem that has no locks: train unlocked (with a note) rather than not at all.
_UNSUPPORTED = frozenset(code for code in (errno.ENOLCK, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", None),
                                           errno.ENOSYS, errno.EINVAL) if code)

if os.name == "nt":  # pragma: no cover - not exercised on the POSIX test machines
    import msvcrt

    _WINDOWS_BYTE = 1 << 20  # beyond any holder text

    def _try_lock(fd: int) -> bool:
        os.lseek(fd, _WINDOWS_BYTE, os.SEEK_SET)
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError as err:
            if err.errno in (errno.EACCES, errno.EDEADLK):
                return False
            raise
        return True

    def _unlock(fd: int) -> None:
        os.lseek(fd, _WINDOWS_BYTE, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
else:
    import fcntl

    def _try_lock(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        return True

    def _unlock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)


def holder_text() -> str:
    """This process as the lock file records it: host, PID, start time (local, with its UTC offset)."""
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": started}) + "\n"


def describe_holder(text: str) -> str | None:
    """'host H, PID P, started T' from the lock file's text; None if it is empty or torn."""
    try:
        info = json.loads(text)
        return f"host {info['host']}, PID {int(info['pid'])}, started {info['started']}"
    except (ValueError, KeyError, TypeError):
        return None


class RunLock:
    """`with RunLock(run_dir):` holds RUN/.lock, or raises MtrainError naming the holder at once
    (it never waits). Creates the run folder if needed, and writes nothing else in it."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None
        self.locked = False

    def __enter__(self) -> RunLock:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise MtrainError(f"{err.filename or self.run_dir}: cannot create the run folder ({err.strerror or err}); "
                              "pass a folder you can write to as --out") from None
        try:
            # Non-inheritable (O_CLOEXEC): a program the trainer starts never keeps the lock alive.
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise MtrainError(f"{self.path}: cannot open the run folder's lock file ({err.strerror or err}); "
                              "pass a folder you can write to as --out") from None
        try:
            self.locked = _try_lock(self._fd)
        except OSError as err:
            if err.errno not in _UNSUPPORTED:
                self._close()
                raise MtrainError(f"{self.path}: cannot lock the run folder ({describe_write_error(err)[0]})") from None
            print(f"note: {self.path}: this filesystem has no file locks ({err.strerror}); nothing stops a second "
                  "trainer from writing to this run folder at the same time", file=sys.stderr)
            return self
        if not self.locked:
            holder = self._read_holder()
            self._close()
            raise MtrainError(f"{self.run_dir}: another trainer is using this run folder ({holder}); wait for it to "
                              "end or stop it, or pass another --out")
        try:
            os.ftruncate(self._fd, 0)
            os.lseek(self._fd, 0, os.SEEK_SET)
            os.write(self._fd, holder_text().encode("utf-8"))
        except OSError as err:
            self.__exit__(None, None, None)
            cause, remedy = describe_write_error(err)
            raise MtrainError(f"{self.path}: write failed ({cause}); {remedy or 'check the folder'} and re-run") from None
        return self

    def _read_holder(self) -> str:
        """The holder's text; it may be a moment from being written (the lock comes first), so wait up to a second."""
        assert self._fd is not None
        for _ in range(20):
            os.lseek(self._fd, 0, os.SEEK_SET)
            holder = describe_holder(os.read(self._fd, 4096).decode("utf-8", "replace"))
            if holder is not None:
                return holder
            time.sleep(0.05)
        return f"holder unknown: {self.path} names none"

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._fd is None:
            return
        if self.locked:
            try:
                os.ftruncate(self._fd, 0)  # emptied while still held: no reader sees a finished holder
            except OSError:
                pass
            try:
                _unlock(self._fd)
            except OSError:
                pass  # closing the file below drops the lock anyway
            self.locked = False
        self._close()

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
