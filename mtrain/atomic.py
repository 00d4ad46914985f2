"""The one atomic file writer: write to a temp file beside the target, rename over it only on
success, so a crash, a kill or a full disk never leaves a half-written output (no torch here).

Every file mtrain writes whole (checkpoints, metrics, plots, config.yaml, translations, the
tokenized folder's JSON) goes through `atomic_write`. The temp name is unique per call
(mkstemp), so two processes writing the same target never rename each other's temp file."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator


@contextlib.contextmanager
def atomic_write(path: str | Path, binary: bool = False, durable: bool = False) -> Iterator[IO[Any]]:
    """Yield a handle (UTF-8 text with LF newlines, or bytes); the target appears, whole, when the
    block ends. durable: fsync the file before the rename and the folder after it, so the new
    file survives a power cut too (checkpoints; the commit point of resume)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        handle = os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8", newline="\n")
        with handle:
            yield handle
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        _fsync_dir(path.parent)


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
