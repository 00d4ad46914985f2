"""The one atomic file writer: write to a temp file beside the target, rename over it only on
success, so a crash, a kill or a full disk never leaves a half-written output (no torch here).

Every file mtrain writes whole (checkpoints, metrics, plots, config.yaml, translations, the
tokenized folder's JSON) goes through `atomic_write`. The temp name is unique per call
(created exclusively), so two processes writing the same target never rename each other's temp
file. Temp files and folders are created as open() and mkdir() create any other, so the umask sets
their permissions (mkstemp and mkdtemp would make every output private to its owner).

`os_error_in` and `describe_write_error` put a failed write (a full disk, a file size limit, a
failing device) into words, the same everywhere: the CLI's error line and training's stop line."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from pathlib import Path
from typing import IO, Any, Callable, Iterator, TypeVar

# Errors that only a write can raise: a failed atomic write names its target when the OS did not.
WRITE_ERRNOS = frozenset(code for code in (errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", None)) if code)

# errno -> (what happened, what to do before re-running), for the failures a user can fix.
_WRITE_FAILURES = {
    errno.ENOSPC: ("No space left on device", "free disk space"),
    errno.EFBIG: ("File too large for this filesystem or ulimit -f",
                  "raise the file size limit (ulimit -f) or write to a filesystem that allows larger files"),
    errno.EIO: ("Input/output error: the disk or network filesystem failed", "check the device"),
    errno.EROFS: ("Read-only file system", "write to a writable folder"),
    errno.EACCES: ("Permission denied", "check the folder's permissions"),
    errno.EPERM: ("Operation not permitted", "check the folder's permissions"),
}
if hasattr(errno, "EDQUOT"):
    _WRITE_FAILURES[errno.EDQUOT] = ("Disk quota exceeded", "free space within your disk quota")


@contextlib.contextmanager
def atomic_write(path: str | Path, binary: bool = False, durable: bool = False) -> Iterator[IO[Any]]:
    """Yield a handle (UTF-8 text with LF newlines, or bytes); the target appears, whole, when the
    block ends. durable: fsync the file before the rename and the folder after it, so the new
    file survives a power cut too (checkpoints; the commit point of resume)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, fd = _create_beside(path, lambda name: os.open(name, _NEW_FILE_FLAGS, 0o666))
    try:
        handle = os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8", newline="\n")
        with handle:
            if path.exists():
                os.chmod(tmp, path.stat().st_mode & 0o7777)  # a replaced file keeps its permissions
            yield handle
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError) and err.errno in WRITE_ERRNOS and not err.filename:
            err.filename = str(path)  # a buffered write's error does not say which file it was
        raise
    if durable:
        _fsync_dir(path.parent)


# Exclusive creation (never an existing file, never through a link), closed in child processes.
_NEW_FILE_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
                   | getattr(os, "O_BINARY", 0))

_Made = TypeVar("_Made")


def _create_beside(path: Path, create: Callable[[Path], _Made]) -> tuple[Path, _Made]:
    """create(name) for a fresh hidden name .{path.name}.XXXXXXXX.tmp beside path; a name already
    taken (by another writer of the same target) is drawn again."""
    while True:
        name = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        try:
            return name, create(name)
        except FileExistsError:
            continue


def make_temp_folder(path: Path) -> Path:
    """An empty folder beside path to build it in before renaming it over path (see atomic_write)."""
    return _create_beside(path, lambda name: os.mkdir(name, 0o777))[0]


def _fsync_dir(folder: Path) -> None:
    # Make the rename itself durable; not every platform/filesystem allows opening a directory.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def os_error_in(err: BaseException) -> OSError | None:
    """The OSError behind err: err itself, or one it was raised from or during (torch.save turns
    a failed write into a RuntimeError whose context is the OSError)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def describe_write_error(err: BaseException) -> tuple[str, str | None]:
    """(the cause in words, the remedy or None) of a failed write: 'ENOSPC: No space left on
    device' and 'free disk space' for a full disk; the first line of any other error."""
    os_err = os_error_in(err)
    if os_err is not None and os_err.errno is not None:
        name = errno.errorcode.get(os_err.errno, str(os_err.errno))
        if os_err.errno in _WRITE_FAILURES:
            cause, remedy = _WRITE_FAILURES[os_err.errno]
            return f"{name}: {cause}", remedy
        return f"{name}: {os_err.strerror or os_err}", None
    text = str(os_err or err).strip().splitlines()
    return (f"{type(err).__name__}: {text[0]}" if text else type(err).__name__), None
