"""What the fit machine decides when workers are lost: salvage what the lost replicas'
partners finished, roll the survivors back to the last commit, regroup them (with
spares and joiners), restart from a checkpoint when no replica is left, or fail with
the layout the remaining workers can run. Under asynchronous updates the survivors
first finish the window in flight without the lost replicas (a *release*), so nothing
but the lost replicas' gradients in flight is trained again. A mixin of
:class:`~dataflow.driver.machine.FitMachine` (its ``state`` and ``config``); pure,
like the machine.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dataflow.core.window import scored_samples
from dataflow.driver import commands as cmd
from dataflow.driver import events as ev
from dataflow.driver.state import AfterGroup, Forming, Status
from dataflow.driver.transitions import Ignored, rule
from dataflow.history.records import FailureRecord
from dataflow.planning.layout import ReplicaGroups


class LostWorkers:
    """The machine's handlers for lost workers and restarts."""

    state: Any
    config: Any
    _position: Any  # FitMachine's: where the running phase stands
    _checkpoint_here: Any  # FitMachine's: a WriteCheckpoint of the commit

    def _failure(self, reason: str, lost: tuple[str, ...], **extra: Any) -> FailureRecord:
        """A ``history.info["failures"]`` entry; at most the window in progress is lost."""
        s = self.state
        in_progress = s.committed_step
        if s.commit_window in s.windows:
            plan, window, _ = s.windows[s.commit_window]
            in_progress = plan.steps[window.stop - 1].index + 1
        return FailureRecord(
            reason=reason,
            phase=self._phase_index(),
            commit_step=s.committed_step,
            lost=list(lost),
            replicas_before=s.layout.replicas,
            window_steps_lost=in_progress - s.committed_step,
            **extra,
        )

    def _lost_while_failing(self, event: ev.WorkersLost) -> list[Any]:
        """The machine chose to stop, and a worker was lost before the Fail was carried
        out (the survivors rolling back or saving their checkpoint): the Fail again, with
        those workers named (a survivors' checkpoint a loss interrupted was not written:
        the newest checkpoint stands)."""
        fail = self.state.failing
        if fail is None:
            return []
        if fail.error is None:
            more = tuple(w for w in event.workers if w not in fail.lost)
            fail = dataclasses.replace(fail, lost=(*fail.lost, *more))
        return [fail]

    def _setup_failed(self, event: ev.SetupFailed) -> list[Any]:
        """Workers whose own setup failed are lost to this fit: excluded (never asked to
        join again) and decided as their loss would be (a joiner's: the members form the
        group again without it; a first group's: the others, and spares, form it again);
        the record says why, with their error.

        Unless another worker already failed with the same error (type and first line):
        then it is the fit's own mistake (code that fails on a rank, whichever worker
        holds it), not a node's, and the fit stops with it rather than shrink by one
        worker per try."""
        error = event.error  # (in a replay, the log's ErrorInfo of it)
        kind = type(error).__name__ if isinstance(error, BaseException) else error.type
        message = (str(error).splitlines() or [""])[0]
        signature = f"{kind}: {message}"
        s = self.state
        if signature in s.setup_errors:
            s.status = Status.FAILED
            return [cmd.Fail(error=error)]
        s.setup_errors = s.setup_errors | {signature}
        out = self._workers_lost(ev.WorkersLost(event.workers))
        for command in out:
            if isinstance(command, cmd.RecordFailure):
                command.record.update(reason="a worker failed to set up", error=signature)
        return [cmd.ExcludeWorkers(event.workers, for_good=True), *out]

    def _workers_silent(self, event: ev.WorkersSilent) -> list[Any]:
        """Members silent to the driver's probe for ``waited_s`` after a collective failed
        (the scheduler named no loss: a cut link or a hung node sends no reset) are lost:
        the executor treats them as gone from now on, and the loss is decided as the
        scheduler's report of it would be, by the status's rule for WorkersLost."""
        lost = ev.WorkersLost(event.workers)
        entry = rule(self.state, lost)
        out = [] if isinstance(entry, Ignored) else getattr(self, entry)(lost)
        return [*self._exclude(event.workers), *out]

    def _exclude(self, workers: tuple[str, ...]) -> list[Any]:
        """Workers dropped alive (silent, hung or slow): excluded, and taken back once if
        they are idle again later (``_workers_recovered``); a second time, for good."""
        s = self.state
        again = tuple(w for w in workers if w in s.readmitted)
        once = tuple(w for w in workers if w not in again)
        s.readmittable = (*s.readmittable, *(w for w in once if w not in s.readmittable))
        excluded = [cmd.ExcludeWorkers(once)] if once else []
        if again:
            excluded.append(cmd.ExcludeWorkers(again, for_good=True))
        return excluded

    def _workers_lost(self, event: ev.WorkersLost, release: bool = True) -> list[Any]:
        """``release=False``: the survivors' window failed (a slow replica dropped after
        their wait timed out), so none is left for them to finish without it."""
        s, config = self.state, self.config
        gone = set(event.workers)
        s.available = tuple(w for w in s.available if w not in gone)
        if s.status == Status.FORMING and s.forming == Forming.REGROUP and s.joining:
            # Joiners (alive or not) go back to the pool; the group is formed again.
            alive = tuple(w for w in s.joining if w not in event.workers)
            dead = tuple(w for w in s.joining if w in event.workers)
            forming = s.layout.replicas
            s.layout = ReplicaGroups(tuple(g for g in s.layout.groups if g[0] not in s.joining))
            s.available, s.joining = (*alive, *s.available), ()
            if not s.layout.lost_replicas(event.workers):
                joiners = self._joinable()
                layout = s.layout.plus(ReplicaGroups.of(joiners, self.config.spatial))
                record = self._failure("lost workers", dead, replicas_after=layout.replicas)
                record.update(replicas_before=forming, window_steps_lost=0, joined=list(joiners))
                out = self._form(layout, joining=joiners, after=s.after_group)
                return [cmd.RecordFailure(record), *out]  # a joiner lost: the forming's cost
        lost_ranks = s.layout.lost_replicas(event.workers)
        if not lost_ranks or s.status in (Status.FAILED, Status.RESTARTING, Status.IDLE):
            return []
        if not config.recover_lost_workers:
            s.status = Status.FAILED
            lost = tuple(w for w in s.layout.workers if w in event.workers)
            remain = s.layout.replicas - len(lost_ranks)
            fail = cmd.Fail(
                lost=lost,
                remain=remain,
                phase=self._phase_index(),
                commit_step=s.committed_step,
                not_recovering=True,
            )
            return [fail]
        if s.status == Status.FORMING and s.forming in (Forming.START, Forming.RESTART):
            return self._lost_while_starting(event, lost_ranks)
        if s.releasing:  # lost again while the survivors finish a window: roll back
            return self._abandon_release(event.workers)
        if release and s.status == Status.RUNNING and self._may_release(lost_ranks):
            return self._release(event, lost_ranks)
        # What to do again once the survivors are regrouped.
        resume = {
            Status.RUNNING: AfterGroup.REST,
            Status.ENDING: AfterGroup.END,
            Status.DONE: AfterGroup.FINISH,
        }.get(s.status)
        if s.status == Status.BOUNDARY:
            resume = AfterGroup.CHECKPOINT if config.checkpoints else AfterGroup.CHOOSE
        return self._regroup_survivors(event, lost_ranks, after=resume or s.after_group)

    # -- salvage: a window its lost replica finished ------------------------------------
    def _survivors_went_past(self) -> bool:
        """Whether a survivor finished a window after the one to commit (asynchronous
        updates run ahead of the driver's commits): its replica no longer holds that
        window's start, so the window cannot be trained again, only salvaged (its
        partial held-out scores are then recorded as partial)."""
        s = self.state
        return any(s.pending.get(w) for w in s.windows if w > s.commit_window)

    def _scored_whole_held_out(self, got: dict[int, Any]) -> bool:
        """Whether a window's evaluations, in the results at hand, scored the whole
        held-out set. A lost replica's scores of its share died with its result: such a
        window is not salvaged but trained again by the survivors, so no epoch's score
        covers part of the held-out set."""
        total = self.config.held_out_samples
        if total is None:
            return True
        by_step: dict[int, list] = {}
        for result in got.values():
            for step, scores in (getattr(result, "evals", None) or {}).items():
                by_step.setdefault(step, []).append(scores)
        return all(scored_samples(evals) >= total for evals in by_step.values())

    # -- asynchronous updates: the survivors keep the window in flight ------------------
    def _may_release(self, lost_ranks: tuple[int, ...]) -> bool:
        return self.config.spatial == 1 and self.config.sync.survives_loss(
            lost_ranks, self.state.layout.replicas
        )

    def _release(self, event: ev.WorkersLost, lost_ranks: tuple[int, ...]) -> list[Any]:
        """Commit what the survivors finished, then let them finish the window in flight
        without the lost replicas (the store stops waiting for them); they regroup once
        it commits (``_end_release``)."""
        s = self.state
        out = self._commit_ready(lost=lost_ranks)
        if s.commit_window not in s.windows or s.commit_window >= s.queued_until:
            # nothing in flight (every queued window committed): regroup now, with nothing
            # rolled back, as when the survivors finish a released window
            kept = {"window_steps_lost": 0, "kept_window": True, "retrained_parts": 0}
            return out + self._regroup_survivors(
                event, lost_ranks, after=AfterGroup.REST, kept=kept
            )
        got = s.pending.get(s.commit_window, {})
        if self._finished_but(got, lost_ranks):
            # The survivors finished it, but it was not salvaged: its held-out scores
            # lack the lost share. Nothing is left to finish: roll back and train it again.
            return out + self._regroup_survivors(event, lost_ranks, after=AfterGroup.REST)
        plan, window, _ = s.windows[s.commit_window]
        record = self._failure(
            "lost workers", tuple(w for w in s.layout.workers if w in event.workers)
        )
        record["kept_window"] = False  # until the survivors commit the window
        s.releasing, s.release_window = lost_ranks, s.commit_window
        s.released_workers = tuple(record["lost"])
        release = cmd.ReleaseReplicas(
            s.generation,
            s.layout.without(lost_ranks).leaders,
            lost_ranks,
            s.released_workers,
            s.commit_window,
            plan.steps[window.stop - 1].index + 1,
        )
        return [*out, cmd.RecordFailure(record), release]

    def _window_done_releasing(self) -> list[Any]:
        """A result while the survivors finish the released window: once it commits,
        they regroup from its end, nothing rolled back."""
        s = self.state
        got = s.pending.get(s.release_window, {})
        retrained = [p for r in got.values() for p in getattr(r, "retrained", ())]
        out = self._commit_ready(lost=s.releasing)
        if s.commit_window <= s.release_window:
            return out
        lost_ranks, workers = s.releasing, s.released_workers
        s.releasing, s.released_workers, s.release_window = (), (), -1
        kept = {"window_steps_lost": 0, "kept_window": True, "retrained_parts": len(retrained)}
        event = ev.WorkersLost(workers)
        return out + self._regroup_survivors(
            event, lost_ranks, after=AfterGroup.REST, kept=kept, update=True
        )

    def _abandon_release(self, more: tuple[str, ...]) -> list[Any]:
        """The released window cannot finish (another worker lost, or it failed): the
        survivors roll back to the commit, as under synchronous training."""
        s = self.state
        workers = (*s.released_workers, *(w for w in more if w not in s.released_workers))
        s.releasing, s.released_workers, s.release_window = (), (), -1
        lost_ranks = s.layout.lost_replicas(workers)
        event = ev.WorkersLost(workers)
        return self._regroup_survivors(event, lost_ranks, after=AfterGroup.REST, update=True)

    # -- regrouping -------------------------------------------------------------------
    def _regroup_survivors(
        self,
        event: ev.WorkersLost,
        lost_ranks: tuple[int, ...],
        *,
        after: AfterGroup,
        kept: dict[str, Any] | None = None,
        update: bool = False,
    ) -> list[Any]:
        """Go on without the lost replicas: commit what their partners finished, stop
        and roll the survivors back to the last commit, then regroup them (with the
        workers that joined meanwhile) or, below ``min_workers``, save and fail.
        ``kept``: what the failure record says when the survivors finished the window
        in flight (a release) and the rollback is to its end; ``update``: the record
        updates the release's."""
        s, config = self.state, self.config
        lost = tuple(w for w in s.layout.workers if w in event.workers)
        out = self._commit_ready(lost=lost_ranks) if s.status == Status.RUNNING else []
        survivors = s.layout.without(lost_ranks)
        partners = self._release_partners(lost_ranks, event.workers)
        if not survivors.replicas and partners:
            return out + self._partners_only(lost, partners, after)
        if not survivors.replicas:
            record = self._failure("every replica lost", lost)
            s.windows.clear()
            s.pending.clear()
            # Wait for workers: start again from the newest checkpoint or, with none (or
            # no checkpoint folder), from step 0, rather than fail a fit they could finish
            self._restarting(record)
            return [*out, self._await_restart(max(s.layout.replicas, s.formed_replicas))]
        record = self._failure("lost workers", lost, replicas_after=survivors.replicas)
        record.update(kept or {})
        in_segment = after == AfterGroup.REST
        s.windows.clear()
        s.pending.clear()
        s.layout = survivors
        out += [
            cmd.RecordFailure(record, update=update),
            cmd.StopWindows(survivors.leaders),
            cmd.RollBack(survivors.leaders, s.committed_step),
        ]
        joiners = self._joinable()
        if survivors.replicas + len(joiners) < config.min_workers:
            s.status = Status.FAILED
            if in_segment and config.checkpoints:
                out.append(
                    self._checkpoint_here(cmd.CheckpointKind.SURVIVORS, members=survivors.leaders)
                )
            fail = cmd.Fail(
                lost=lost,
                remain=survivors.replicas,
                phase=self._phase_index(),
                commit_step=s.committed_step,
                workers_left=len(survivors.workers) + len(s.available),
            )
            return [*out, fail]
        record["joined"] = list(joiners)
        layout = survivors.plus(ReplicaGroups.of(joiners, self.config.spatial))
        return out + self._form(layout, joining=joiners, after=after)

    def _release_partners(
        self, lost_ranks: tuple[int, ...], gone: tuple[str, ...]
    ) -> tuple[str, ...]:
        """The live workers of a lost replica's group go back to the pool (they may form
        a group again with others); returns them."""
        s = self.state
        partners = tuple(
            w
            for r in lost_ranks
            for w in s.layout.groups[r]
            if w not in gone and w not in s.available
        )
        s.available = (*s.available, *partners)
        return partners

    def _partners_only(
        self, lost: tuple[str, ...], partners: tuple[str, ...], after: AfterGroup
    ) -> list[Any]:
        """A spatial layout lost a worker of every group: no group is left, but the lost
        groups' other workers (``partners``) hold the commit. They roll back to it and
        save it; the fit starts again from that checkpoint when the pool's workers form
        enough groups, else it stops, naming the layout the workers left could run."""
        s, config = self.state, self.config
        record = self._failure("every replica lost", lost, replicas_after=0)
        s.windows.clear()
        s.pending.clear()
        s.layout = ReplicaGroups()
        alone = tuple((w,) for w in partners)
        out: list[Any] = [
            cmd.StopWindows(partners, groups=alone),
            cmd.RollBack(partners, s.committed_step, groups=alone),
        ]
        # inside a phase: the commit; at its end: the phase's checkpoint, not written yet
        kind = {
            AfterGroup.REST: cmd.CheckpointKind.SURVIVORS,
            AfterGroup.CHECKPOINT: cmd.CheckpointKind.PHASE,
        }.get(after)
        if config.checkpoints and kind is not None:
            out.append(self._checkpoint_here(kind))
        groups = len(s.available) // config.spatial
        if config.max_replicas is not None:
            groups = min(groups, config.max_replicas)
        if config.checkpoints and config.may_join and groups >= max(1, config.min_workers):
            self._restarting(record)
            return [*out, self._await_restart(groups)]
        s.status = Status.FAILED
        fail = cmd.Fail(
            lost=lost,
            remain=0,
            phase=self._phase_index(),
            commit_step=s.committed_step,
            workers_left=len(s.available),
        )
        return [cmd.RecordFailure(record), *out, fail]

    def _lost_while_starting(self, event: ev.WorkersLost, lost_ranks: tuple[int, ...]) -> list:
        s, config = self.state, self.config
        lost = tuple(w for w in s.layout.workers if w in event.workers)
        survivors = s.layout.without(lost_ranks)
        self._release_partners(lost_ranks, event.workers)
        if not survivors.replicas:
            # every worker lost before any step: wait for workers, start again from the
            # newest checkpoint (a resumed fit's, a restart's) or, with none, from step 0
            self._restarting(self._failure("every replica lost", lost))
            return [self._await_restart(max(s.layout.replicas, s.formed_replicas))]
        before, s.layout = s.layout, survivors
        joiners = self._joinable()  # spares the fit may take (elastic, up to its cap)
        s.layout = before  # (the failure record counts the replicas it had)
        layout = survivors.plus(ReplicaGroups.of(joiners, config.spatial))
        if layout.replicas < config.min_workers:
            s.status, s.layout = Status.FAILED, survivors
            left = len(survivors.workers) + len(s.available)
            return [
                cmd.Fail(lost=lost, remain=survivors.replicas, starting=True, workers_left=left)
            ]
        # Nothing was trained in this group yet: the survivors form it again, with spares
        # in place of the lost; the loss is recorded like any other (it costs the
        # forming, no step).
        record = self._failure("lost workers", lost, replicas_after=layout.replicas)
        record["joined"] = list(joiners)
        s.generation += 1
        s.layout = layout
        s.available = tuple(w for w in s.available if w not in layout.worker_set)
        return [
            cmd.RecordFailure(record),
            cmd.FormGroup(
                s.generation,
                layout.leaders,
                fresh=True,
                restore=s.restoring,
                groups=layout.groups,
            ),
        ]

    def _restarting(self, record: FailureRecord) -> None:
        """Every replica is lost: wait for workers to start again. The lost group's
        generation ends here, so an answer it sent before it died (its phase's end, its
        forming) is stale when it arrives, as any older group's is; the restart forms the
        next one."""
        s = self.state
        s.status, s.lost_everything = Status.RESTARTING, record
        s.generation += 1

    def _await_restart(self, had: int) -> cmd.AwaitRestart:
        """Wait for at least ``min_workers`` replicas' workers, then a little for the
        ``had`` replicas the fit had (``_restart_point`` takes no more than it may have)."""
        config = self.config
        size, most = config.spatial, config.max_replicas
        return cmd.AwaitRestart(
            at_least=max(1, config.min_workers) * size,
            gather=min(had, most or had) * size,
            wait_s=config.restart_wait_s,
            gather_s=config.restart_gather_s,
        )

    def _restart_point(self, event: ev.RestartPoint) -> list[Any]:
        s, config = self.state, self.config
        if s.status != Status.RESTARTING:
            return []
        lost_all = s.lost_everything
        record = (
            lost_all.copy()
            if lost_all is not None
            else FailureRecord(reason="every replica lost", phase=None, commit_step=0)
        )
        # No checkpoint yet (``step`` None) but workers came back: the fit starts again
        # from step 0, from the initial weights (the model factory and the seed).
        step = 0 if event.step is None else event.step
        exhausted = s.restarts.get(step, 0) >= config.max_restarts
        if exhausted or not event.workers:
            s.status = Status.FAILED
            return [
                cmd.Fail(
                    lost=tuple(record.get("lost", ())),
                    remain=0,
                    phase=record.get("phase"),
                    restarts_from=step if exhausted else None,
                    waited_s=None if exhausted else config.restart_wait_s,
                )
            ]
        s.restarts[step] = s.restarts.get(step, 0) + 1
        # the fit starts again on as many as it may have (max_replicas); the rest wait
        # in the pool, as spares and joiners do
        most = config.max_replicas
        back = tuple(dict.fromkeys(event.workers))  # (an address counted once)
        workers = back[: most * config.spatial] if most else back
        record.update(
            restarted_from_step=step,
            window_steps_lost=s.committed_step + (record.window_steps_lost or 0) - step,
            replicas_after=len(workers) // config.spatial,
        )
        arrived = set(back)
        s.available = tuple(w for w in s.available if w not in arrived)
        s.layout = self._groups(tuple(workers))
        s.formed_replicas = s.layout.replicas  # (what the fit has from here on)
        s.available = (*s.available, *back[len(workers) :])
        if not s.layout.replicas:  # too few workers for one group (a spatial layout)
            s.status = Status.FAILED
            return [
                cmd.Fail(
                    lost=tuple(record.get("lost", ())),
                    remain=0,
                    phase=record.get("phase"),
                    workers_left=len(event.workers),
                )
            ]
        restore = event.step is not None  # else the replicas build the initial weights
        s.generation += 1
        s.committed_step, s.step_seconds, s.phase = step, None, None
        s.epoch, s.next_step, s.previous = event.epoch, step, event.previous
        s.resume_in_phase = event.in_phase
        s.status, s.forming, s.after_group, s.restoring = (
            Status.FORMING,
            Forming.RESTART,
            AfterGroup.CHOOSE,
            restore,
        )
        return [
            cmd.RecordFailure(record),
            cmd.Restart(step, from_start=not restore),
            cmd.FormGroup(
                s.generation, self.members, fresh=True, restore=restore, groups=s.layout.groups
            ),
        ]
