"""A reference executor with no processes: the driver against a simulated cluster.

It answers the fit loop's cluster calls as perfect workers would, at once, with
window results built from the plan (each replica's samples from the Load stage's
streams, so the ledger is exact) in the order simulated step times finish them,
and injects faults on request: a lost worker (its partners cannot finish a window
past its last one), a worker that joins, a NaN caught before the update. The
property tests drive the real machine, planner and recorder with it, and
``benchmarks/bench_driver_scale.py`` times the driver at 1,024 replicas.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from dataflow.core.digest import sample_digest
from dataflow.core.window import WindowResult
from dataflow.driver import commands as cmd
from dataflow.driver import events as ev
from dataflow.runtime.replica import ReplicaState


class SimulatedExecutor:
    """Plays the executor for a :class:`~dataflow.driver.loop.FitLoop`. ``workers``: the
    cluster's; ``step_seconds(worker)``: a replica's simulated step time; ``load``: the
    Load stage; ``faults(n)``: the fault to inject before the n-th event, or None
    (``("lose", i)``, ``("join", name)``, ``("nan", None)``, every member at once:
    ``("lose_all", None)``, and with a worker back, ``("requeue", None)``); ``misread``: a
    worker whose loader reads other samples than the plan gave it."""

    def __init__(
        self,
        workers: list[str],
        *,
        load: Any,
        seed: int = 0,
        step_seconds: Callable[[str], float] = lambda worker: 0.01,
        faults: Callable[[int], Any] = lambda n: None,
        with_digests: bool = True,
        misread: str | None = None,
    ) -> None:
        self.workers, self.load, self.seed = list(workers), load, seed
        self.step_seconds, self.faults, self.with_digests = step_seconds, faults, with_digests
        self.misread = misread  # a worker whose loader reads other samples than planned
        self.queue: deque[Any] = deque()
        self.known: set[str] = set()
        self.members: tuple[str, ...] = ()
        self.generation = 0
        self.clock = [0.0]  # simulated seconds per rank
        self.finishing: list[tuple[float, int, int, Any]] = []  # (time, window, rank, event)
        self.events_seen = 0
        self.own_seconds = 0.0  # CPU spent here, not in the driver
        self._digests: dict[int, list[int]] = {}

    # -- what the loop asks -------------------------------------------------------------
    def carry_out(self, effects: Callable[[], None]) -> bool:
        """A command's effects; a simulated loss arrives as a queued event, never mid-way."""
        effects()
        return True

    def is_loss(self, error: BaseException) -> bool:
        return False  # a simulated loss is a queued event, never an exception

    def available(self) -> list[str]:
        return list(self.workers)

    def arrivals(self) -> list[ev.WorkersJoined]:
        joined = self.joined_event()  # (a simulated hang never ends: none comes back)
        return [] if joined is None else [joined]

    def readmit(self, workers: tuple[str, ...]) -> None:
        self.workers.extend(w for w in workers if w not in self.workers)

    def joined_event(self) -> ev.WorkersJoined | None:
        new = [w for w in self.workers if w not in self.known]
        self.known.update(new)
        return ev.WorkersJoined(tuple(new)) if new else None

    def queue_lost(self, lost: list[str]) -> None:
        self.queue.append(ev.WorkersLost(tuple(lost)))

    def exclude(self, workers: tuple[str, ...], for_good: bool = False) -> None:
        self.workers = [w for w in self.workers if w not in workers]

    def scale_cluster(self, wanted: int, timeout_s: float) -> str | None:
        """``scale_with_batch``'s request: the simulated cluster starts the workers it
        lacks at once (``tcp://scaled<i>``); they join as arrivals do."""
        while len(self.workers) < wanted:
            self.workers.append(f"tcp://scaled{len(self.workers)}")
        return None

    def events(self) -> Iterator[Any]:
        while True:
            fault = self.faults(self.events_seen)
            self.events_seen += 1
            if fault is not None:
                self._inject(*fault)
            if self.queue:
                yield self.queue.popleft()
            elif self.finishing:
                started = time.process_time()
                event = self._next_finished()
                self.own_seconds += time.process_time() - started
                yield event
            else:
                raise RuntimeError("the fit's driver has no event to wait for (a bug)")

    def _next_finished(self) -> Any:
        """The next result, with every other rank's result of that window that is also
        due (as the real executor batches what one poll finds)."""
        first = heapq.heappop(self.finishing)[3]
        if not isinstance(first, ev.WindowDone):
            return first
        results = dict(first.results)
        while (
            self.finishing
            and self.finishing[0][1] == first.window
            and isinstance(self.finishing[0][3], ev.WindowDone)
        ):
            results.update(heapq.heappop(self.finishing)[3].results)
        return ev.WindowDone(first.generation, first.window, results)

    def _inject(self, kind: str, arg: Any) -> None:
        if kind == "join":
            if arg in self.workers:  # (an address is one worker at a time, as in Dask)
                return
            self.workers.append(arg)
            joined = self.joined_event()
            if joined is not None:
                self.queue.append(joined)
        elif kind == "nan" and self.finishing:
            # The group's next window to finish sees a NaN on every replica (the same
            # reduced gradient); nothing of the group after it runs.
            window = min(item[1] for item in self.finishing)
            generation = next(e.generation for _, w, _, e in self.finishing if w == window)
            failed = [item for item in self.finishing if item[3].generation != generation]
            for t, w, rank, event in self.finishing:
                if w == window and event.generation == generation:
                    error = FloatingPointError(f"non-finite gradient in window {w}")
                    failed.append(
                        (t, w, rank, ev.WindowFailed(event.generation, rank, w, error, True))
                    )
            self.finishing = failed
            heapq.heapify(self.finishing)
        elif kind in ("lose_all", "requeue") and self.members:  # every member (a job's end)
            gone = tuple(w for w in self.members if w in self.workers)
            if not gone:
                return
            self.workers = [w for w in self.workers if w not in gone]
            self.finishing = []
            self.queue.append(ev.WorkersLost(gone))
            if kind == "requeue":  # ... and the job back on a new node: a restart
                self.workers.append(f"tcp://requeued{self.events_seen}")
        elif kind == "lose" and self.members:
            worker = self.members[arg % len(self.members)]
            if worker not in self.workers:  # lost already; the driver has not regrouped yet
                return
            self.workers.remove(worker)
            rank = self.members.index(worker)
            # Its partners finish no window past the last one it finished.
            done = [w for t, w, r, _ in self.finishing if r == rank]
            last = min(done) - 1 if done else float("inf")
            self.finishing = [item for item in self.finishing if item[1] <= last]
            heapq.heapify(self.finishing)
            self.queue.append(ev.WorkersLost((worker,)))

    def form_group(self, c: cmd.FormGroup) -> list[dict[str, Any]]:
        self.members, self.generation = c.members, c.generation
        self.known.update(c.members)
        self.clock = [max(self.clock, default=0.0)] * len(c.members)
        return [{"rank": r, "worker": a} for r, a in enumerate(c.joining or c.members)]

    def restore(self, state: Any, rngs: Any, buffers: Any) -> None:
        pass

    def begin_phase(self, c: cmd.BeginPhase, context: Any) -> None:
        started = time.process_time()
        if self.with_digests:  # each replica's reads follow from the whole segment
            self._digests = {
                spec.index: [sample_digest(part) for part in parts]
                for spec, parts in self.load.streams(c.steps, self.seed)
            }
        self.own_seconds += time.process_time() - started

    def submit_windows(self, c: cmd.SubmitWindows) -> None:
        started = time.process_time()
        if not set(c.members) <= set(self.workers):
            return  # sent to a lost worker (its loss is queued): no member finishes a window
        plan = c.plan
        for window in c.queued_windows():
            specs = plan.steps[window.first : window.stop]
            wid = c.first_window + window.index
            for rank, worker in enumerate(c.members):
                seconds = self.step_seconds(worker)
                self.clock[rank] += seconds * len(specs)
                result = WindowResult(
                    rank=rank,
                    first_step=specs[0].index,
                    samples=[s.local_batches[rank] for s in specs],
                    losses=[1.0] * len(specs),
                    step_seconds=[seconds] * len(specs),
                    stage_seconds={"compute": seconds * len(specs)},
                    task_seconds=seconds * len(specs),
                    samples_read=sum(s.local_batches[rank] for s in specs),
                    sample_digest=(
                        sum(self._digests[s.index][rank] for s in specs) + (worker == self.misread)
                    )
                    % (1 << 64)
                    if self.with_digests
                    else None,
                    checkpoint=ReplicaState(rng={}, buffers={})
                    if window.index in c.checkpoints | c.weights
                    else None,
                )
                event = ev.WindowDone(c.generation, wid, {rank: result})
                heapq.heappush(self.finishing, (self.clock[rank], wid, rank, event))
        self.own_seconds += time.process_time() - started

    def stop(self, c: cmd.StopWindows) -> None:
        self.finishing = []

    def roll_back(self, c: cmd.RollBack) -> None:
        self.members = c.members

    def end_phase(self, c: cmd.EndPhase) -> None:
        ends = tuple({"weights_digest": "same", "lr": None} for _ in c.members)
        self.queue.append(ev.PhaseEnded(c.generation, ends))

    def replica_states(self, tag: str) -> list[ReplicaState]:
        empty = ReplicaState(model={}, optimizer={}, stages={}, rng={}, buffers={})
        return [empty] * len(self.members)

    def final_weights(self, what: str = "weights") -> dict[str, Any] | None:
        return {} if what == "weights" else None

    def await_restart(self, at_least: int, *args: Any) -> list[str] | None:
        return list(self.workers) or None

    def close(self, *, failed: bool) -> None:
        self.finishing = []
