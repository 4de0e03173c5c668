"""The executor's side of workers arriving: the client's workers the fit may use (not
the ones the machine excluded), the new ones since it last looked (``WorkersJoined``),
excluded ones back and idle (``WorkersRecovered``),
waiting for restarted workers when every replica was lost (``AwaitRestart``), and
asking the cluster for more (``ScaleCluster``). Which of them the fit takes is the
machine's decision; this only looks and waits.

A part of :class:`~dataflow.driver.executor.Executor` (its base class), using its
client, ``known`` workers and ``unreachable`` set."""

from __future__ import annotations

import contextlib
from typing import Any

from dataflow.driver import events as ev
from dataflow.driver.membership import idle_workers
from dataflow.runtime.cluster import available_workers


class WorkerArrivals:
    # the executor's, used here
    client: Any
    known: set[str]
    unreachable: set[str]
    may_return: set[str]

    def available(self) -> list[str]:
        """The client's workers, in a stable order, but those the machine excluded."""
        return [a for a in available_workers(self.client) if a not in self.unreachable]

    def arrivals(self) -> list[ev.WorkersRecovered | ev.WorkersJoined]:
        """At a phase's choice: excluded workers back and idle, then new workers."""
        return [e for e in (self.recovered_event(), self.joined_event()) if e is not None]

    def recovered_event(self) -> ev.WorkersRecovered | None:
        """Workers excluded as silent or hung (not for good) that the scheduler still
        lists and that answer now with no task running: their hang ended (the task that
        hung returned, or failed on its broken group), or their link is back."""
        if not self.may_return:  # (the usual case: nothing asked, no round trip)
            return None
        listed = set(available_workers(self.client))
        asked = sorted(w for w in self.may_return if w in listed)
        back = idle_workers(self.client, asked)
        return ev.WorkersRecovered(tuple(back)) if back else None

    def readmit(self, workers: tuple[str, ...]) -> None:
        """``cmd.ReadmitWorkers``: ``workers`` may be taken again (they stay known: the
        machine put them in its pool, they are not reported as joined)."""
        self.unreachable.difference_update(workers)
        self.may_return.difference_update(workers)

    def joined_event(self) -> ev.WorkersJoined | None:
        new = [a for a in self.available() if a not in self.known]
        self.known.update(new)
        return ev.WorkersJoined(tuple(new)) if new else None

    def await_restart(
        self, at_least: int, gather: int, wait_s: float, gather_s: float
    ) -> list[str] | None:
        """Every replica lost: wait for ``at_least`` workers, then a little for ``gather``
        (``cmd.AwaitRestart``); every worker there (the machine takes the fit's share
        and pools the rest), or None if too few came."""
        try:
            self.client.wait_for_workers(at_least, timeout=wait_s)
        except TimeoutError:
            return None
        with contextlib.suppress(TimeoutError):
            self.client.wait_for_workers(gather, timeout=gather_s)
        workers = self.available()
        self.known.update(workers)
        return workers

    def scale_cluster(self, wanted: int, timeout_s: float) -> str | None:
        """Ask the client's cluster for ``wanted`` workers and wait for them; the reason
        when it could not (None: they are here)."""
        cluster = getattr(self.client, "cluster", None)
        if cluster is None or not hasattr(cluster, "scale"):
            return (
                "the client has no cluster object to scale (connected by address?); start "
                "more workers yourself, they join at the next phase"
            )
        cluster.scale(wanted)
        try:
            self.client.wait_for_workers(wanted, timeout=timeout_s)
        except TimeoutError:
            return f"only some workers arrived in {timeout_s} s"
        return None
