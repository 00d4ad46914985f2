"""The one atomic file writer: write to a temp file beside the target, rename over it only on
success, so a crash, a kill or a full disk never leaves a half-written output (no torch here).

Every file mtrain writes whole (checkpoints, metrics, plots, config.yaml, translations, the
tokenized folder's JSON) goes through `atomic_write`. The temp name is unique per call
(mkstemp), so two processes writing the same target never rename each other's temp file.

`os_error_in` and `describe_write_error` put a failed write (a full disk, a file size limit, a
failing device) into words, the same everywhere: the CLI's error line and training's stop line."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator

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
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, _new_file_mode(path))
        handle = os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8", newline="\n")
        with handle:
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


def _new_file_mode(path: Path) -> int:
    """The permissions the target gets: an existing target keeps its own; a new one gets what
    open() would give it under the umask (0644 under the usual 022). mkstemp's temp file is 0600,
    which would leave checkpoints and translations unreadable to the rest of a shared group."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        return 0o666 & ~_umask()


def _umask() -> int:
    # Linux shows the umask in /proc; os.umask can only be read by setting it, which races with
    # threads that create files meanwhile, so that is the fallback and happens at import.
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return _UMASK_AT_IMPORT


def _read_umask_by_setting() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK_AT_IMPORT = _read_umask_by_setting()


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
