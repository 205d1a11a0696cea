"""Settling the differing pairs of a comparison on two cores: first divergence and drift.

engine.compare hands over the aligned pairs whose payloads differ and are large (read from
disk, compare/trace.py). Each pair is read as arrays (compare/arrays.py), its first divergence
found (divergence.first_divergence) and its drift measured (fast.pair_drift); the arrays are
then dropped. With many such pairs, a second process (this module run as a program, started
by compare/spare.py) settles pairs from the end of the list while this one settles them from
the front, until they meet: the same code on the same bytes, so the report is the same as with
one process (a test holds the two to it). The worker reads the traces through descriptors it
inherits (an unpacked .tar.gz may already be gone from the disk), never writes anything, and
exits when its input closes; a pair it cannot settle (an unreadable record) is settled here,
where the error is raised. Owns no meaning: what a divergence or a drift is stays in
divergence.py and fast.py.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

from . import spare
from .divergence import first_divergence
from .spare import usable_cpus
from .trace import TraceRecord

# a worker pays for itself past this many payload bytes to settle (~0.1 s of work on one core);
# it starts in ~0.15 s on the other core while this process settles pairs from the front
WORKER_MIN_BYTES = 32 << 20
_FRAME = struct.Struct("<Q")  # the length of each pickled frame on the pipes


@dataclass(frozen=True)
class Spec:
    """How each pair is compared: first_divergence's arguments, and whether drift is measured."""

    name: str
    left_label: str
    right_label: str
    check_logprobs: bool
    atol: float
    noise_floor: float | None
    sampled: bool
    drift: bool


# (read as arrays, first divergence or None, fast.pair_drift's result or None). A pair not laid
# out as the runner writes it is compared on the reference path and its drift left to engine.drift.
Settled = tuple[bool, "dict[str, Any] | None", Any]


def settle(a: TraceRecord, b: TraceRecord, spec: Spec) -> Settled:
    """One pair: as arrays when both payloads read as such, else as parsed records."""
    from .arrays import views
    from .fast import pair_drift, same_tokens

    va, vb = views(a, b, tops=spec.drift)  # without drift, a top-k step is read only where a divergence needs it
    viewed = va is not a
    measured = pair_drift(va, vb) if viewed and spec.drift else None
    if measured is not None:  # the KL list as engine.drift folds it in: (count, sum(), max()), here, not there
        p, per, counted, kls = measured
        measured = (p, per, counted, (len(kls), sum(kls), max(kls, default=0.0)))
    if viewed and not spec.check_logprobs and same_tokens(va, vb):
        d = None  # what first_divergence finds without logprobs when the input and every token agree
    else:
        d = first_divergence(va, vb, comparison=spec.name, left_label=spec.left_label, right_label=spec.right_label,
                             check_logprobs=spec.check_logprobs, atol=spec.atol, noise_floor=spec.noise_floor,
                             sampled=spec.sampled)
    return viewed, d, measured


def settle_pairs(pairs: list[tuple[Any, Any]], jobs: list[int], spec: Spec) -> dict[int, Settled]:
    """settle() for pairs[k] of each k in jobs, with a worker process when they are many and large."""
    out: dict[int, Settled] = {}
    worker = _Worker.start(pairs, jobs, spec) if _worth_a_worker(pairs, jobs) else None
    if worker is None:
        spare.drop()
    try:
        front, back = 0, len(jobs)  # this process settles jobs[:front], the worker jobs[back:]
        while front < back:
            if worker is not None:
                back = worker.collect(out, back)
                if front >= back:
                    break
            k = jobs[front]
            out[k] = settle(*pairs[k], spec)
            front += 1
            if worker is not None:
                worker.tell(front)
        for k in jobs:  # what the worker could not settle (or settled only in part): here, raising its error
            if k not in out:
                out[k] = settle(*pairs[k], spec)
    finally:
        if worker is not None:
            worker.stop()
    return out


def _worth_a_worker(pairs: list[tuple[Any, Any]], jobs: list[int]) -> bool:
    if len(jobs) < 8 or usable_cpus() < 2:
        return False
    total = 0
    for k in jobs:
        for rec in pairs[k]:
            if not isinstance(rec, TraceRecord) or rec._file is None:
                return False  # bytes read into memory, not a mapped file the worker can open
            total += rec._end - rec._start
    return total >= WORKER_MIN_BYTES


class _Worker:
    """The other process: given the jobs in reverse order, it settles them one by one and sends
    each result back; before each job it reads how far this process got, and stops there."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.buf = b""
        self.deaf = False  # its input is closed (it finished, or died): progress is no longer sent
        self.done = False  # its output reached its end: nothing more will come
        self.ready = threading.Event()  # the setup frame is written: progress may follow it

    @classmethod
    def start(cls, pairs: list[tuple[Any, Any]], jobs: list[int], spec: Spec) -> "_Worker | None":
        files: dict[int, int] = {}  # id(file) -> its descriptor here
        tasks = []  # the jobs from the last to the first
        for k in reversed(jobs):
            task = [k]
            for rec in pairs[k]:
                fd = files.setdefault(id(rec._file), rec._file.fileno())
                task.append((dict.copy(rec), fd, rec._start, rec._end, rec.where))
            tasks.append(task)
        proc = spare.take()
        fds = sorted(set(files.values()))
        # a spare opens each file again through /proc (it was started before they were opened);
        # a worker started now inherits the descriptors themselves
        opened = {fd: f"{spare.PROC_FD}/{fd}" if proc is not None else None for fd in fds}
        if proc is None:
            proc = spare.spawn(fds)
            if proc is None:
                return None
        setup = pickle.dumps((spec, opened, tasks), protocol=pickle.HIGHEST_PROTOCOL)
        self = cls(proc)
        # the setup is written from a thread: the worker reads it only once its imports are done
        def send_setup() -> None:
            self._send(_FRAME.pack(len(setup)) + setup)
            self.ready.set()

        threading.Thread(target=send_setup, daemon=True).start()
        return self

    def _send(self, data: bytes) -> None:
        try:
            _write_all(self.proc.stdin.fileno(), data)  # type: ignore[union-attr]
        except (OSError, ValueError):
            self.deaf = True  # what it already sent is still read (collect)

    def tell(self, front: int) -> None:
        """How many jobs this process has settled from the front (the worker stops there). Only
        the latest count matters, so none is sent until the setup is through (never waits)."""
        if not self.deaf and self.ready.is_set():
            self._send(_FRAME.pack(front))

    def collect(self, out: dict[int, Settled], back: int) -> int:
        """Take the results that have arrived (without waiting); the new lowest position the
        worker has settled, or tried to (a failed job is left out of `out` and settled here)."""
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        while not self.done and select.select([fd], [], [], 0)[0]:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                self.done = True  # exited: what it did not send is settled here
                break
            self.buf += chunk
        while len(self.buf) >= _FRAME.size:
            (n,) = _FRAME.unpack_from(self.buf)
            if len(self.buf) < _FRAME.size + n:
                break
            pos, k, result = pickle.loads(self.buf[_FRAME.size:_FRAME.size + n])
            self.buf = self.buf[_FRAME.size + n:]
            if result is not None:
                out[k] = result
            back = min(back, pos)
        return back

    def stop(self) -> None:
        spare.end(self.proc)


# ------------------------------------------------------------------ the worker process


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> bytes | None:
    """n bytes from the raw descriptor (no buffered reader: it would read ahead and hide
    the parent's progress frames from select)."""
    parts, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _worker_main() -> int:
    import mmap

    from . import fast  # noqa: F401 - numpy and simdjson, imported while the parent reads its traces

    fd_in, fd_out = sys.stdin.fileno(), sys.stdout.fileno()
    if not select.select([fd_in], [], [], spare.WAIT_S)[0]:
        return 0  # a spare nobody took
    head = _read_exact(fd_in, _FRAME.size)
    if head is None:
        return 0
    setup = _read_exact(fd_in, _FRAME.unpack(head)[0])
    if setup is None:
        return 0
    spec, opened, tasks = pickle.loads(setup)
    fds = {fd: (os.open(path, os.O_RDONLY) if path else fd) for fd, path in opened.items()}
    maps: dict[int, Any] = {}
    front = 0  # how many jobs the parent has settled from the front
    pending = b""
    for pos_from_back, task in enumerate(tasks):
        pos = len(tasks) - 1 - pos_from_back
        while select.select([fd_in], [], [], 0)[0]:  # the parent's progress, without waiting
            chunk = os.read(fd_in, 1 << 16)
            if not chunk:
                return 0  # the parent is gone or done
            pending += chunk
        while len(pending) >= _FRAME.size:
            (front,) = _FRAME.unpack_from(pending)
            pending = pending[_FRAME.size:]
        if pos < front:
            return 0  # met: the parent settled this one and every one before it
        k, *sides = task
        recs = []
        for header, fd, start, end, where in sides:
            if fd not in maps:
                # not populated: it reads about half the pages, faulted in as it goes
                maps[fd] = mmap.mmap(fds[fd], 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            rec = TraceRecord(header, maps[fd], start, end, where)
            recs.append(rec)
        try:
            result: Any = settle(recs[0], recs[1], spec)
        except Exception:  # noqa: BLE001 - the parent settles this pair itself and raises the real error
            result = None
        frame = pickle.dumps((pos, k, result), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            _write_all(fd_out, _FRAME.pack(len(frame)) + frame)
        except OSError:
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main())
