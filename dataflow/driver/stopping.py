"""A stop signal: save what is committed, then stop.

A batch system ends a job at its wall-clock limit, and on preemption, with a signal
first (SLURM: SIGTERM, then SIGKILL after ``KillWait``; ``--signal=USR1@120`` sends
SIGUSR1 two minutes ahead). The driver turns the first stop signal into a
``StopRequested`` event; this mixin of :class:`~dataflow.driver.machine.FitMachine`
decides it:

- **running windows**: the replicas start no more windows (``HoldWindows``), every
  window that finished by then is committed (the executor queues them before
  ``WindowsHeld``), then the running ones stop, the replicas roll back to that commit
  and it is saved as a checkpoint inside the phase (the same command with
  ``resume=True`` goes on from it: at most the windows in flight are trained again).
  Held first, no replica gets more than one window past the commit: each still holds
  it (a replica keeps its last two);
- **ending a phase** (every window committed): the phase ends, its checkpoint is
  written, then the fit stops;
- **anywhere else** (a group forming, the next phase being chosen, a restart awaited):
  nothing runs that is not on disk already, so the fit stops at once and the newest
  checkpoint stands.

Pure, like the machine: the loop raises ``FitStopped`` from the ``Fail`` it gets.
"""

from __future__ import annotations

from typing import Any

from dataflow.driver import commands as cmd
from dataflow.driver import events as ev
from dataflow.driver.state import Status


class StopOnSignal:
    """The machine's stop on a signal (see the module docstring)."""

    state: Any
    config: Any
    _checkpoint_here: Any  # FitMachine's: a WriteCheckpoint of the commit

    def _stop_requested(self, event: ev.StopRequested) -> list[Any]:
        s = self.state
        if s.stop_signal is not None:  # told once already
            return []
        s.stop_signal = event.signal
        if s.status == Status.ENDING:  # the phase's end and its checkpoint come first
            return []
        if s.status == Status.RUNNING:  # no window starts; what finished is committed
            return [cmd.HoldWindows(s.layout.leaders)]
        return [self._stopped()]

    def _windows_held(self, event: ev.WindowsHeld) -> list[Any]:
        """Every window that finished before the hold is committed: the running ones
        stop, the replicas roll back to the commit (none is more than one window past
        it, so each holds it), which is saved inside the phase."""
        s = self.state
        if s.status == Status.ENDING:  # the held windows completed the phase
            return []
        if s.status != Status.RUNNING:  # a loss since: the newest checkpoint stands
            return [self._stopped()]
        s.windows.clear()
        s.pending.clear()
        members = s.layout.leaders
        out: list[Any] = [cmd.StopWindows(members), cmd.RollBack(members, s.committed_step)]
        if self.config.checkpoints:
            out.append(self._checkpoint_here(cmd.CheckpointKind.SURVIVORS, members=members))
        return [*out, self._stopped()]

    def _stopped(self) -> cmd.Fail:
        """The fit's end on the stop signal, where it stands."""
        s = self.state
        s.status = Status.FAILED
        return cmd.Fail(
            phase=None if s.phase is None else s.phase.index,
            commit_step=s.committed_step,
            stopped_by=s.stop_signal,
        )
