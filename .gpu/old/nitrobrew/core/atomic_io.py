"""Atomic file writes shared by the top-k store and the demo's checkpoints."""

from __future__ import annotations

import os
import tempfile


def _umask() -> int:
    mask = os.umask(0)  # reading the umask means setting it; put it back at once
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write `data` to a temporary file beside `path`, flush it to disk, rename it over `path`.

    ``os.replace`` is atomic: a reader (or an interrupted run) sees the old file or the new one,
    never half a file; the temporary file is removed if anything fails. The file gets the mode an
    ordinary ``open`` would give it (0666 less the umask), not mkstemp's private 0600: a store
    written by one user's job must be readable by another's.
    """
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(os.path.abspath(path)))
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str, text: str) -> None:
    atomic_write_bytes(path, text.encode())
