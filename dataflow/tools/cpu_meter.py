"""How busy the machine is, and who keeps it busy: this process and its children, or
other programs.

On a shared node (a login node, a laptop, a cloud VM with noisy neighbours) a timing
taken while something else ran is not comparable. :class:`CpuMeter` measures, over a
``with`` block, the CPU seconds the whole machine used (``/proc/stat``), the part this
process and its descendants used, and so what other programs used meanwhile
(``foreign_cpu_seconds``); it also samples each thread's CPU time so that
:meth:`CpuMeter.threads_between` can say which process and thread was busy when. The
benchmarks use it to refuse a disturbed side; a user can wrap a fit in it the same way.
Linux only for the machine-wide counters (elsewhere they read 0); needs ``psutil``
(installed with ``distributed``).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["CpuMeter", "busy_seconds", "cores_per_process"]


class CpuMeter:
    """CPU seconds used on the whole machine vs by this process and its descendants.

    ``foreign_cpu_seconds`` is what other programs used meanwhile: on a shared machine a
    side measured while something else ran is not comparable (rerun it). Descendants
    are sampled every ``interval`` seconds, so up to that much of a child's CPU just
    before it exits counts as foreign (the estimate errs towards "disturbed").
    Each sample also records every thread's CPU time (see :meth:`threads_between`).
    """

    interval = 0.25

    def __enter__(self) -> CpuMeter:
        import psutil

        self._me = psutil.Process()
        self._seen: dict[tuple[int, float], float] = {}
        self.timeline: list[tuple[float, dict[tuple[int, int], float]]] = []
        self._sample()
        self._baseline = dict(self._seen)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)
        self._thread.start()
        self._wall, self._own = time.perf_counter(), _own()
        self._busy, self._steal = busy_seconds()
        return self

    def _sample(self) -> None:
        import psutil

        threads: dict[tuple[int, int], float] = {}
        for process in [self._me, *self._me.children(recursive=True)]:
            try:
                with process.oneshot():
                    if process.pid != self._me.pid:
                        t = process.cpu_times()
                        self._seen[(process.pid, process.create_time())] = t.user + t.system
                    for thread in process.threads():
                        threads[(process.pid, thread.id)] = thread.user_time + thread.system_time
            except psutil.Error:
                pass
        self.timeline.append((time.perf_counter(), threads))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __exit__(self, *exc: Any) -> None:
        busy, steal = busy_seconds()
        self.wall_seconds = time.perf_counter() - self._wall
        self._stop.set()
        self._thread.join()
        self._sample()
        children = sum(v - self._baseline.get(k, 0.0) for k, v in self._seen.items())
        self.busy_cpu_seconds = busy - self._busy
        self.steal_cpu_seconds = steal - self._steal
        self.our_cpu_seconds = _own() - self._own + children
        self.foreign_cpu_seconds = max(0.0, self.busy_cpu_seconds - self.our_cpu_seconds)

    def threads_between(self, start: float, stop: float) -> list[dict[str, Any]]:
        """Cores used per process from ``start`` to ``stop`` (fractions of the wall time).

        One row per process that used >= 0.01 cores: ``driver`` (this process) or
        ``child`` (by pid), its busiest thread (the compute thread of a worker or rank)
        and the sum of all its other threads (event loop, profiler, gloo, prefetch ...).
        """
        t0 = self._wall + start * self.wall_seconds
        t1 = self._wall + stop * self.wall_seconds
        a = min(self.timeline, key=lambda e: abs(e[0] - t0))
        b = min(self.timeline, key=lambda e: abs(e[0] - t1))
        return cores_per_process(a, b, self._me.pid)

    def as_dict(self) -> dict[str, float]:
        keys = (
            "wall_seconds",
            "busy_cpu_seconds",
            "our_cpu_seconds",
            "foreign_cpu_seconds",
            "steal_cpu_seconds",
        )
        return {k: getattr(self, k) for k in keys}


def cores_per_process(
    a: tuple[float, dict[tuple[int, int], float]],
    b: tuple[float, dict[tuple[int, int], float]],
    me: int,
) -> list[dict[str, Any]]:
    """Cores each process used between two samples ``(time, {(pid, tid): cpu seconds})``:
    one row per process that used >= 0.01 cores, ``driver`` (pid ``me``) or ``child
    <pid>``, with its busiest thread and the sum of its others (pure)."""
    seconds = b[0] - a[0]
    if seconds <= 0:
        return []
    per_process: dict[int, list[float]] = {}
    for (pid, tid), value in b[1].items():
        per_process.setdefault(pid, []).append((value - a[1].get((pid, tid), 0.0)) / seconds)
    rows = []
    for pid, values in sorted(per_process.items()):
        total = sum(values)
        if total < 0.01:
            continue
        top = max(values)
        rows.append(
            {
                "process": "driver" if pid == me else f"child {pid}",
                "cores": total,
                "busiest_thread": top,
                "other_threads": total - top,
                "threads": len(values),
            }
        )
    return rows


def busy_seconds(stat: str | None = None) -> tuple[float, float]:
    """(busy, steal) CPU seconds of the machine since boot, from ``/proc/stat`` (or its
    text ``stat``); (0, 0) where there is none."""
    if stat is None:
        try:
            stat = Path("/proc/stat").read_text()
        except OSError:
            return 0.0, 0.0
    fields = [int(v) for v in stat.split("\n", 1)[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) / tick, steal / tick


def _own() -> float:
    t = os.times()
    return t.user + t.system
