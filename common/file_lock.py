"""An exclusive advisory lock on a file, shared by processes on one machine: the kernel releases it when its holder
dies, so a process killed midway never leaves it held (replica/model_loader.py's conversions, replica/cpu_kernels.py's
builds, replica/compile.py's stored forwards)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

try:  # POSIX only; without it concurrent processes may do the locked work twice (each caller stays safe without it).
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


@contextlib.contextmanager
def exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``lock_path`` (created if needed) for the duration of the block."""
    if fcntl is None:  # pragma: no cover - Windows
        yield
        return
    with open(lock_path, "a") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)
