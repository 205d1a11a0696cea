"""One writer per output folder: an exclusive lock taken before anything in --out is cleared.

Owns the lock two detllm processes (two CI jobs, a user and a script) take on the same
--out: `fcntl.flock` on a small file under the user's cache folder, keyed by the folder's
absolute path, so nothing is ever written beside or into the run folder (the lock is never
sealed into a pack). The second writer is refused at once with one line, before it clears
or writes anything. The lock dies with its process (a SIGKILL frees it too). POSIX only;
where fcntl is missing (Windows) no lock is taken.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..core.errors import UsageError


def lock_dir() -> Path:
    """$XDG_CACHE_HOME/detllm/locks (default ~/.cache/detllm/locks); the temp folder if that cannot be made."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "detllm" / "locks"
    try:
        base.mkdir(parents=True, exist_ok=True)
        return base
    except OSError:
        fallback = Path(tempfile.gettempdir()) / f"detllm-locks-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
        fallback.mkdir(mode=0o700, exist_ok=True)
        return fallback


def lock_path(folder: Path) -> Path:
    """The lock file of `folder`: one per absolute path (symlinks in existing ancestors resolved)."""
    folder = Path(folder).absolute()
    anc, rest = folder, []
    while not anc.exists() and anc != anc.parent:
        rest.append(anc.name)
        anc = anc.parent
    key = str(anc.resolve().joinpath(*reversed(rest)))
    return lock_dir() / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".lock")


@contextmanager
def exclusive_writer(folder: Path, *, flag: str = "--out") -> Iterator[None]:
    """Hold the exclusive lock of `folder` for the block; UsageError (exit 2) if another process holds it."""
    try:
        import fcntl
    except ImportError:  # no flock on this platform: run unlocked
        yield
        return
    path = lock_path(folder)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise UsageError(f"{flag} {str(folder)!r} is being written by another detllm run ({holder}); "
                             f"refusing to write into it at the same time", hint="wait for it to finish or choose another --out")
        except BaseException:
            os.close(fd)
            raise
        # the holder before us may have removed the file after we opened it: lock the file that is there now
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}".encode(), 0)
        yield
    finally:
        try:
            os.unlink(path)  # while still locked: a waiter re-checks the inode and retries
        except OSError:
            pass
        os.close(fd)


__all__ = ["exclusive_writer", "lock_path"]
