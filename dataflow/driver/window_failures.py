"""What the fit machine decides when a window fails with no worker lost: a non-finite
step rolled back in place (``on_non_finite="rollback"``), an out-of-memory error redone
from the commit with a halved micro-batch cap, a collective that timed out on a live
(slow) peer redone from the commit, or the fit stopped with the root cause. A mixin of
:class:`~dataflow.driver.machine.FitMachine` (its ``state`` and ``config``); pure, like
the machine.
"""

from __future__ import annotations

from typing import Any

from dataflow.driver import commands as cmd
from dataflow.driver import events as ev
from dataflow.driver.memory import halved_cap, largest_micro_batch, out_of_memory_error
from dataflow.driver.root_cause import acted_on, is_wait_timeout, stalled_error
from dataflow.driver.state import AfterGroup, Status


class WindowFailures:
    """The machine's handlers for a window that failed with every worker alive."""

    state: Any
    config: Any
    members: Any
    _failure: Any  # LostWorkers': a history.info["failures"] entry
    _form: Any  # FitMachine's: form a group over a layout
    _plan: Any  # WindowPlanning's
    _abandon_release: Any  # LostWorkers'
    _exclude: Any  # LostWorkers'
    _workers_lost: Any  # LostWorkers'
    _phase_index: Any

    def _window_failed(self, event: ev.WindowFailed) -> list[Any]:
        s, config = self.state, self.config
        if event.generation != s.generation or event.window not in s.windows:
            return []
        if s.releasing:  # the survivors could not finish the released window
            return self._abandon_release(())
        event = acted_on(event)  # the root cause among the failures the executor saw
        if event.out_of_memory:
            return self._out_of_memory(event)
        if is_wait_timeout(event.error):
            return self._stalled(event)
        if not (
            event.non_finite and config.roll_back_non_finite and s.rollbacks < config.max_rollbacks
        ):
            s.status = Status.FAILED
            return [cmd.Fail(error=event.error)]
        # Every replica saw the same reduced gradient and stopped before the update:
        # the group is intact, so the replicas roll back in place, with a lower LR.
        s.rollbacks += 1
        s.lr_factor *= config.lr_cut
        record = self._failure("non-finite", (), error=str(event.error), lr_factor=s.lr_factor)
        s.windows.clear()
        s.pending.clear()
        return [
            cmd.RecordFailure(record),
            cmd.StopWindows(self.members, leave_group=False),
            cmd.RollBack(self.members, s.committed_step, leave_group=False),
            *self._plan(AfterGroup.REST),
        ]

    def _out_of_memory(self, event: ev.WindowFailed) -> list[Any]:
        """Replica ``event.rank`` ran out of device memory: halve the micro-batch cap and
        redo the rest of the phase from the commit, as more, smaller micro-batches
        (gradient accumulation: the same steps). The cap is every replica's: they run
        one model on near-equal shares, mostly on alike devices, so a micro-batch one
        could not hold the others would fail on next; one cap also survives regroups
        (ranks renumber) and stays for the fit's later phases. The failed replica broke
        the collective its peers waited in, so the group is formed again, as after a
        lost worker, with no member lost. Past ``max_memory_halvings`` in a phase, or
        when one sample did not fit, the fit fails naming the cap."""
        s, config = self.state, self.config
        plan, window, _ = s.windows[event.window]
        ran = largest_micro_batch(plan, window, event.rank)
        cap = halved_cap(ran, s.memory_cap)
        if cap < 1 or s.memory_halvings >= config.max_memory_halvings:
            s.status = Status.FAILED
            error = out_of_memory_error(
                event.error,
                rank=event.rank,
                ran=ran,
                halvings=s.memory_halvings,
                budget=config.max_memory_halvings,
                phase=self._phase_index(),
            )
            return [cmd.Fail(error=error)]
        s.memory_halvings += 1
        s.memory_cap = cap
        record = self._failure(
            "out-of-memory",
            (),
            error=str(event.error),
            rank=event.rank,
            micro_batch=ran,
            micro_batch_cap=cap,
        )
        return self._again_from_the_commit(record)

    def _stalled(self, event: ev.WindowFailed) -> list[Any]:
        """Replica ``event.rank`` waited in a collective past the timeout while every
        worker stayed alive: a peer's step was slow, not lost (a store riding out
        failures, a slow file system, a long pause). The rest of the phase is redone from
        the commit, the group formed again, as after an out-of-memory error; past
        ``max_stalls`` in a phase the fit fails saying which timeout to raise."""
        s = self.state
        if s.stalls >= self.config.max_stalls:
            if event.slow and len(event.slow) < s.layout.replicas:
                return self._drop_slow(event)
            s.status = Status.FAILED
            return [cmd.Fail(error=stalled_error(event.error, event.rank, s.stalls))]
        s.stalls += 1
        record = self._failure(
            "stalled", (), error=str(event.error), rank=event.rank, slow_replicas=list(event.slow)
        )
        return self._again_from_the_commit(record)

    def _drop_slow(self, event: ev.WindowFailed) -> list[Any]:
        """The phase stalled past ``max_stalls``, and the executor named the replicas
        still in their step each time the others' wait ended (``event.slow``: one riding
        out a store outage, a node much slower than the rest). They go as a lost worker
        would, excluded from the fit, and the others go on (or the fit stops below
        ``min_workers``, as for any loss), where a fit would stop for one bad node."""
        s = self.state
        workers = tuple(w for r in event.slow for w in s.layout.groups[r])
        # (no release: the survivors' window failed, there is nothing left to finish; the
        # fit is running, where the rule for a loss is _workers_lost)
        lost = self._workers_lost(ev.WorkersLost(workers), release=False)
        out = [*self._exclude(workers), *lost]
        for command in out:
            if isinstance(command, cmd.RecordFailure):
                command.record.update(
                    reason="slow replica dropped",
                    error=str(event.error),
                    rank=event.rank,
                    slow_replicas=list(event.slow),
                )
        return out

    def _again_from_the_commit(self, record: Any) -> list[Any]:
        """No member lost: stop, roll every replica back to the commit, form the group
        again and plan the rest of the phase."""
        s = self.state
        s.windows.clear()
        s.pending.clear()
        out: list[Any] = [
            cmd.RecordFailure(record),
            cmd.StopWindows(self.members),
            cmd.RollBack(self.members, s.committed_step),
        ]
        return out + self._form(s.layout, after=AfterGroup.REST)
