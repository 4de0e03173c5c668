"""How the fit machine cuts the running segment into windows: 1-step calibration
windows until a step is timed, then windows of about ``window_seconds`` (or of a
``Local`` period of samples, adapted to the measured drift with ``max_drift``), and
which of them return the replicas' states for a mid-phase checkpoint or for
``keep_best``. A mixin of
:class:`~dataflow.driver.machine.FitMachine` (its ``state`` and ``config``); pure,
like the machine.
"""

from __future__ import annotations

from typing import Any

from dataflow.core.window import WINDOWS_AHEAD
from dataflow.driver import commands as cmd
from dataflow.planning.plan import Plan, checkpoint_windows


class WindowPlanning:
    """The machine's window plans."""

    state: Any
    config: Any

    def _submit_next(self) -> cmd.SubmitWindows:
        """The segment's next steps as a plan: 1-step windows until a step is timed,
        then windows of about ``window_seconds``."""
        s, config = self.state, self.config
        rest = tuple(spec for spec in s.segment if spec.index >= s.planned_until)
        if config.epoch_review:  # on_epoch callbacks: a plan ends at the epoch's end
            rest = tuple(spec for spec in rest if spec.epoch == rest[0].epoch)
        # Local(period_samples=...): windows of so many samples, not of seconds
        window_samples = config.sync.period_samples
        adapting = config.sync.max_drift is not None
        if adapting:
            window_samples = self._adapted_period(window_samples)
        calibrating = s.step_seconds is None and not (config.window_steps or window_samples)
        steps = rest[: config.calibration_steps] if calibrating else rest
        tag = "calibrate" if calibrating else "train"
        plan = Plan.build(
            config.stage_names,
            s.phase,
            steps,
            s.layout.replicas,
            step_seconds=s.step_seconds,
            window_seconds=config.window_seconds,
            window_steps=config.window_steps,
            window_samples=window_samples,
            # keep_best: the weights at an epoch's end come back with its last window
            epoch_ends_window=config.sync.ends_windows_at_epochs or config.best_every is not None,
            # Local(max_drift=...): one window at a time, the next one's period follows
            # the drift its average measures
            max_windows=1 if adapting else None,
            tag=tag
            + (f"-g{s.generation}" if s.generation else "")
            + (f"-r{s.rollbacks}" if s.rollbacks else "")
            # a task key must be new: plans one window (adapting) or one epoch long
            + (f"-s{steps[0].index}" if adapting or config.epoch_review else ""),
            run=config.run_id,
        )
        marks: frozenset[int] = frozenset()
        if config.checkpoint_every and config.checkpoints:
            marks, s.countdown = checkpoint_windows(
                plan, config.checkpoint_every, s.countdown, s.phase_steps[-1].index + 1
            )
        first = s.next_window
        for window in plan.windows:
            s.windows[first + window.index] = (plan, window, window.index in marks)
        s.next_window += len(plan.windows)
        s.planned_until = plan.steps[-1].index + 1
        s.queued_until = first  # (every window before the plan is committed)
        return self._queue(min(s.next_window, first + WINDOWS_AHEAD))

    def _queue_ahead(self) -> list[cmd.SubmitWindows]:
        """After a commit: queue the plan's next windows, up to ``WINDOWS_AHEAD`` past
        the commit, so a replica never runs further ahead of the driver than the commits
        it keeps reach back (nothing new while a stop holds the windows or the survivors
        of a loss finish the one in flight)."""
        s = self.state
        stop = min(s.next_window, s.commit_window + WINDOWS_AHEAD)
        if s.stop_signal is not None or s.releasing or s.queued_until >= stop:
            return []
        return [self._queue(stop)]

    def _queue(self, stop: int) -> cmd.SubmitWindows:
        """The planned fit windows ``[queued_until, stop)``, all of one plan, queued."""
        s = self.state
        plan, window, _ = s.windows[s.queued_until]
        first = s.queued_until - window.index  # the plan's first window, fit-wide
        # the plan's windows not yet committed that return states for a checkpoint
        marks = frozenset(
            w.index
            for w in plan.windows
            if (first + w.index) in s.windows and s.windows[first + w.index][2]
        )
        best = frozenset(
            w.index
            for w in plan.windows
            if w.index not in marks and self._keeps_best(plan.steps[w.stop - 1])
        )
        queued = (s.queued_until - first, stop - first)
        s.queued_until = stop
        return cmd.SubmitWindows(s.generation, self.members, plan, first, marks, best, queued)

    def _keeps_best(self, step: Any) -> bool:
        """Whether the replicas' states at the end of ``step`` are offered as the best
        weights (``keep_best``): the last step of an epoch whose record has the watched
        metric."""
        every = self.config.best_every
        return every is not None and step.last_in_epoch and (step.epoch + 1) % every == 0

    def _adapted_period(self, longest: int) -> int:
        """Local(max_drift=...): the period for the next window, from the drift the last
        committed window measured (adapted once per measurement; a recovery that plans
        again keeps it)."""
        s = self.state
        current = s.period_samples or longest
        if s.period_set_at != s.commit_window and s.last_results:
            drifts = [r.drift for r in s.last_results if r.drift is not None]
            shortest = s.phase.global_batch if s.phase is not None else 1
            current = self.config.sync.next_period(
                current, max(drifts) if drifts else None, shortest
            )
            s.period_set_at = s.commit_window
        s.period_samples = current
        return current
