"""Atomic text files: write to a temp file beside the target, rename over it only on success, so
a crash, a kill or a full disk never leaves a half-written output (no torch here)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO, Iterator


@contextlib.contextmanager
def atomic_text(path: str | Path) -> Iterator[IO[str]]:
    """Yield a UTF-8 text handle (LF newlines); the target appears, whole, when the block ends."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
            yield handle
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
