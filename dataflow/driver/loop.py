"""One fit on the driver: ``for event in executor.events(): apply(machine.handle(event))``.

The loop owns no decision: the state machine makes them. It routes each command
to whoever carries it out: the executor (the cluster), the planner (phases and
splits), the recorder (the history) or the checkpoint writer (the disk), and
queues what they answer as the machine's next events.
"""

from __future__ import annotations

import functools
import time
import typing
from typing import Any

from dataflow.checkpoint import ledger_from_state
from dataflow.checkpoint.progress import PhaseProgress
from dataflow.core.errors import CollectiveError, WorkerLostError
from dataflow.core.phase import PhaseMeasurement
from dataflow.core.rng import restore_rng
from dataflow.core.step import PhaseContext
from dataflow.driver import commands as cmd
from dataflow.driver import events as ev
from dataflow.driver.best_weights import BestWeights
from dataflow.driver.checkpoints import CheckpointWriter, ResumePoint
from dataflow.driver.epoch_callbacks import EpochCallbacks
from dataflow.driver.executor import Executor
from dataflow.driver.failure_lines import failure_line, lost_workers_message
from dataflow.driver.group_forming import SetupRefused
from dataflow.driver.machine import FitMachine
from dataflow.driver.recorder import Recorder
from dataflow.driver.segments import Planner
from dataflow.driver.stop_signals import StopSignals, stopped_error
from dataflow.driver.worker_notes import record_workers
from dataflow.history.result import History
from dataflow.io.ledger import SampleLedger
from dataflow.planning.plan import phase_line
from dataflow.runtime.replica import ReplicaState
from dataflow.schedule.noise_scale import NoiseScaleTracker


class FitLoop:
    """Runs ``machine`` with ``executor``; ``epochs`` to train, ``writer`` the checkpoints
    (None without a folder), ``resumed`` the checkpoint a resumed fit starts from."""

    def __init__(
        self,
        *,
        machine: FitMachine,
        executor: Executor,
        planner: Planner,
        recorder: Recorder,
        writer: CheckpointWriter | None,
        epochs: int,
        measures_noise: bool,
        min_workers: int,
        progress: bool,
        on_epoch: tuple[Any, ...] = (),
        best: BestWeights | None = None,
    ) -> None:
        self.machine, self.executor, self.planner = machine, executor, planner
        self.recorder, self.writer, self.epochs = recorder, writer, epochs
        self.measures_noise, self.min_workers = measures_noise, min_workers
        self.progress = progress
        self.epoch_callbacks = EpochCallbacks(on_epoch)
        self.best = best  # fit(keep_best=...): the best epoch's weights
        self.start = ResumePoint()
        self.checkpoint: Any = None  # the checkpoint the replicas load at the next restore
        self.resume_in_phase: PhaseProgress | None = None
        self.open_failure: Any = None  # the FailureRecord a recovery still completes
        self.refused = False  # the recorder refused a commit in the command list running
        self.saved_path: Any = None  # the survivors' checkpoint before WorkerLostError
        self.members: tuple[str, ...] = ()  # whose totals the recorder holds, in rank order
        self.final_state: Any = None
        self.training = False  # set once the first group is formed
        self.stop_signals = StopSignals(())  # run_fit's, with the fit's stop_signals

    # -- where a fit starts -----------------------------------------------------------
    def restore_driver(self, checkpoint: Any) -> None:
        """The driver's state back to ``checkpoint``: position, noise, ledger, history."""
        rec = self.recorder
        rec.ledger = ledger_from_state(checkpoint.ledger) if checkpoint.ledger else rec.ledger
        rec.noise = NoiseScaleTracker()
        rec.reset_counts()
        self.start = ResumePoint.of(checkpoint)
        self.resume_in_phase = self.start.progress
        if self.resume_in_phase is not None:
            rec.epoch_loss_sum, rec.epoch_samples = self.resume_in_phase.epoch_loss
        noise = checkpoint.schedule_state.get("noise")
        if noise is not None:
            rec.noise.load_state_dict(noise)
        saved = History.from_dict(checkpoint.history)  # typed rows, as a fresh fit's
        if not self.training:  # a resume (not a restart in this fit): after the saved runs
            rec.clock.resumed(checkpoint.history, checkpoint.step)
        info = rec.history.info
        rec.history = History(steps=saved.steps, epochs=saved.epochs, phases=saved.phases)
        rec.history.info = info
        rec.samples_seen = sum(s["samples"] for s in saved.steps)
        if self.writer is not None:  # the steps file holds these; later ones are appended
            self.writer.saved_steps = len(saved.steps)
        restore_rng(checkpoint.rng)
        self.checkpoint = checkpoint
        self.measurement = self.start.measurement

    def run(self, workers: list[str]) -> dict[str, Any]:
        """Train on ``workers`` first; the client's others are the machine's spares.
        Returns rank 0's final weights."""
        if self.checkpoint is None:
            self.measurement = None
        epochs = self.recorder.history.epochs  # a resumed fit's are reported already
        self.epoch_callbacks.reported = int(epochs[-1]["epoch"]) if epochs else -1
        available = self.executor.available()
        self.executor.known.update(available)
        start = self.start  # (a fresh fit: the start of it)
        started = ev.Started(
            tuple(workers),
            self.checkpoint is not None,
            memory_cap=start.memory_cap,
            epoch=start.epoch,
            step=start.step,
            previous=start.previous,
            in_phase=self.resume_in_phase is not None,
            spares=tuple(w for w in available if w not in workers),
        )
        self._decide(started)
        told: str | None = None
        for event in self.executor.events():
            self._decide(event)
            if self.final_state is not None:
                return self.final_state
            if self.stop_signals.received != told:  # a stop signal came since: once
                told = self.stop_signals.received
                self._decide(ev.StopRequested(told))
        raise AssertionError("unreachable: events() ends only by raising")

    def _decide(self, event: ev.Event) -> None:
        """The machine decides on ``event``; its commands are carried out, and the log
        learns how many were."""
        commands = self.machine.handle(event)
        self.machine.log.carried_out(self.apply(commands))

    def apply(self, commands: list[Any]) -> int:
        """Carry out ``commands`` in order; returns how many were. A member lost on the
        way is an event the executor queues (WorkersLost): the rest of the list is not
        carried out, and the machine decides anew from that event."""
        self.refused = False
        for i, command in enumerate(commands):
            handler = COMMAND_HANDLERS[type(command)]
            if not self.executor.carry_out(functools.partial(handler, self, command)):
                return i  # (a Fail further on is the machine's again, from that event)
            if self.refused:  # the recorder refused a commit: the machine decides next
                return i + 1
        return len(commands)

    # -- membership -----------------------------------------------------------------------
    def _FormGroup(self, c: cmd.FormGroup) -> None:
        try:
            infos = self.executor.form_group(c)
        except Exception as error:
            if self.executor.is_loss(error):  # a member lost: the executor queues it
                raise
            if isinstance(error, SetupRefused):  # a joiner's own setup failed
                refused = ev.SetupFailed(c.generation, error.workers, error.error)
                self.executor.queue.append(refused)
                return
            # No member was lost (the executor checked): the machine decides whether
            # to form the group again (a peer restarted or stalled in the rendezvous)
            # or to stop (the user's own error: a model factory's, a source's)
            failed = ev.GroupFailed(c.generation, error, _is_rendezvous_error(error))
            self.executor.queue.append(failed)
            return
        info = self.recorder.history.info
        spec = getattr(self.executor, "spec", None)  # (a simulated executor has none)
        record_workers(info, infos, capture=bool(getattr(spec, "capture", False)))
        info["replicas"] = len(c.members)
        info["process_groups"] = info.get("process_groups", 0) + 1  # formed in this fit
        if c.fresh:
            self.recorder.totals = []
        else:
            kept = [self.members.index(a) for a in c.members if a not in c.joining]
            self.recorder.regrouped(kept, len(c.joining), self.members)
        self.members = c.members
        if c.restore:
            checkpoint = self.checkpoint
            state = ReplicaState(
                model=checkpoint.model_state,
                optimizer=checkpoint.optimizer_state or None,
                stages=checkpoint.stage_state,
            )
            self.executor.restore(state, checkpoint.replica_rng, checkpoint.replica_buffers)
        if c.joining and not c.fresh:
            info.setdefault("regroups", []).append(
                {
                    "phase": c.phase,
                    "replicas": len(c.members),
                    "joined": list(c.joining),
                }
            )
            if self.progress:
                print(
                    f"dataflow: {len(c.joining)} worker(s) joined; phase "
                    f"{'?' if c.phase is None else c.phase} runs {len(c.members)} replicas"
                )
        if self.open_failure is not None:
            self.open_failure.update(resumed_at=time.time(), replicas_after=len(c.members))
            self.open_failure = None
        if not self.training:  # the clock of the history starts once the replicas are up
            self.training = True
            self.recorder.clock.start()
        self.executor.queue.append(ev.GroupFormed(c.generation))

    def _AwaitRestart(self, c: cmd.AwaitRestart) -> None:
        step, workers, checkpoint = None, (), None
        found = self.executor.await_restart(c.at_least, c.gather, c.wait_s, c.gather_s)
        if found:  # (no checkpoint, or no folder: the machine starts from step 0)
            workers = tuple(found)
            if self.writer is not None and self.writer.store.latest() is not None:
                checkpoint = self.checkpoint = self.writer.load_latest()
                step = checkpoint.step
        if checkpoint is None:
            self.executor.queue.append(ev.RestartPoint(None, workers))
            return
        point = ResumePoint.of(self.checkpoint)
        in_phase = point.progress is not None
        restart = ev.RestartPoint(step, workers, point.epoch, point.previous, in_phase=in_phase)
        self.executor.queue.append(restart)

    def _Restart(self, c: cmd.Restart) -> None:
        if self.progress:
            print(
                "dataflow: every replica was lost before the first checkpoint; starting "
                "again from step 0"
                if c.from_start
                else "dataflow: every replica was lost; starting again from the checkpoint "
                f"of step {c.step}"
            )
        self.saved_path = None  # a survivors' checkpoint was the restart's
        if c.from_start:
            self.restart_driver()
        else:
            self.restore_driver(self.checkpoint)

    def restart_driver(self) -> None:
        """The driver's state back to the fit's start (every replica lost before the
        first checkpoint): nothing committed, the failures kept."""
        rec = self.recorder
        rec.ledger = SampleLedger(rec.load.source.num_samples)
        rec.noise = NoiseScaleTracker()
        rec.reset_counts()
        info = rec.history.info
        rec.history = History()
        rec.history.info = info
        self.start, self.resume_in_phase = ResumePoint(), None
        self.checkpoint = self.measurement = None

    # -- phases ---------------------------------------------------------------------------
    def _ChoosePhase(self, c: cmd.ChoosePhase) -> None:
        phase = self.planner.next_phase(c.epoch, self.epochs, c.previous, self.measurement)
        self.executor.queue.extend(self.executor.arrivals())
        self.executor.queue.append(ev.PhaseChosen(phase))

    def _ScaleCluster(self, c: cmd.ScaleCluster) -> None:
        error = self.executor.scale_cluster(c.wanted, c.timeout_s)
        scaling: dict[str, Any] = {"phase": c.phase.index, **c.why.to_dict()}
        if error is not None:
            scaling["error"] = error
        scaling["workers"] = len(self.executor.available())
        self.recorder.history.info.setdefault("scaling", []).append(scaling)
        self.executor.queue.extend(self.executor.arrivals())
        self.executor.queue.append(ev.PhaseChosen(c.phase))

    def _PlanSegment(self, c: cmd.PlanSegment) -> None:
        if c.memory_cap is not None:  # learned (out of memory) or measured (CUDA)
            self.recorder.history.info["micro_batch_cap"] = c.memory_cap
        if c.kind == cmd.SegmentKind.RESUMED:
            self._plan_resumed(c.replicas)
            return
        if c.kind == cmd.SegmentKind.PHASE:
            measured = self.recorder.measured_speeds()
            steps = self.planner.phase_steps(
                c.phase, c.replicas, c.commit_step, measured, memory_cap=c.memory_cap
            )
            self._announce(c.phase, steps, steps)
            self.recorder.begin_phase(c.phase, steps, steps)
            self.executor.queue.append(ev.SegmentPlanned(c.phase, steps, steps))
            return
        todo = self.planner.rest(
            c.segment, c.commit_step, c.replicas, c.memory_cap, len(c.phase_steps)
        )
        self.executor.queue.append(ev.SegmentPlanned(c.phase, c.phase_steps, todo, continued=True))

    def _plan_resumed(self, replicas: int) -> None:
        """The rest of the checkpoint's phase (a mid-phase checkpoint: a resume or a
        restart), on ``replicas``, with the totals and LR cut it saved."""
        progress, self.resume_in_phase = self.resume_in_phase, None
        if progress is None:
            raise RuntimeError("the machine resumed inside a phase with no checkpoint (a bug)")
        todo = self.planner.resumed(progress.segment, self.start.step, replicas)
        carried, earlier = progress.carried_to(replicas, self.start.step)
        self._announce(progress.phase, progress.steps, todo)
        self.recorder.begin_phase(
            progress.phase,
            progress.steps,
            todo,
            carried=carried,
            elapsed=progress.seconds,
            lost=earlier,
        )
        self.recorder.phase_pairs = list(progress.norm_pairs)  # committed before the save
        planned = ev.SegmentPlanned(
            progress.phase,
            progress.steps,
            todo,
            continued=True,
            lr_factor=progress.lr_factor,
            rollbacks=progress.rollbacks,
        )
        self.executor.queue.append(planned)

    def _announce(self, phase: Any, steps: tuple, todo: tuple) -> None:
        """The phase's plan, one line, before its progress bar opens: as many steps as
        the bar counts (the calibration steps included)."""
        if self.progress and todo:
            self.recorder.close_bar()
            print(phase_line(phase, steps, todo, self.machine.config), flush=True)

    def _BeginPhase(self, c: cmd.BeginPhase) -> None:
        phase = c.phase
        context = PhaseContext(
            index=phase.index,
            steps=c.steps,
            lr=phase.lr,
            lr_scale=phase.lr_scale,
            warmup_steps=phase.warmup_steps,
            measure_noise=self.measures_noise,
            measure_every=self.planner.measure_every(c.phase_length),
            continued=c.continued,
            lr_factor=c.lr_factor,
        )
        self.executor.begin_phase(c, context)

    def _SubmitWindows(self, c: cmd.SubmitWindows) -> None:
        self.executor.submit_windows(c)

    def _CommitWindow(self, c: cmd.CommitWindow) -> None:
        before = len(self.recorder.history.epochs)
        refused = self.recorder.commit_window(c.plan, c.window, c.results, c.segment)
        if refused is not None:  # the machine decides; the rest of the list waits
            self.executor.queue.append(ev.CommitRefused(refused))
            self.refused = True
            return
        history = self.recorder.history  # the epochs the commit completed, to the callbacks
        for event in self.epoch_callbacks.after_commit(history, history.epochs[before:]):
            self.executor.queue.append(event)
            self.refused = self.refused or isinstance(event, ev.CommitRefused)

    def _KeepIfBest(self, c: cmd.KeepIfBest) -> None:
        if self.best is None:
            return
        epochs = self.recorder.history.epochs
        record = next((e for e in reversed(epochs) if e["epoch"] == c.epoch), None)
        if record is not None and self.best.offer(record, c.step, c.states):
            self.recorder.history.info["best"] = self.best.info()

    def _EndPhase(self, c: cmd.EndPhase) -> None:
        self.executor.end_phase(c)

    def _RecordPhase(self, c: cmd.RecordPhase) -> None:
        rec = self.recorder
        rec.end_phase(c.phase, c.phase_steps, c.segment, c.ends)
        self.measurement = PhaseMeasurement(
            noise_scale=rec.noise.noise_scale,
            gradient_sq=rec.noise.gradient_sq,
            trace_cov=rec.noise.trace_cov,
            samples_per_second=sum(rec.history.phases[-1]["samples_per_second"]),
            steps=len(c.phase_steps),
            measured_steps=rec.noise.steps,
        )

    # -- failures -------------------------------------------------------------------------
    def _RecordFailure(self, c: cmd.RecordFailure) -> None:
        self.open_failure = self.recorder.failure(c.record, self.open_failure if c.update else None)
        line = failure_line(c.record)
        if self.progress and line is not None:
            print(line)

    def _ReleaseReplicas(self, c: cmd.ReleaseReplicas) -> None:
        self.executor.release(c)
        if self.progress:
            print(
                f"dataflow: lost worker(s) {', '.join(c.workers)}; the other replicas finish "
                f"the window in flight without them (up to step {c.stop_step})"
            )

    def _HoldWindows(self, c: cmd.HoldWindows) -> None:
        self.executor.hold(c)

    def _StopWindows(self, c: cmd.StopWindows) -> None:
        self.executor.stop(c)

    def _ExcludeWorkers(self, c: cmd.ExcludeWorkers) -> None:
        self.executor.exclude(c.workers, c.for_good)

    def _ReadmitWorkers(self, c: cmd.ReadmitWorkers) -> None:
        self.executor.readmit(c.workers)
        readmitted = {"workers": list(c.workers), "epoch": c.epoch}
        self.recorder.history.info.setdefault("readmitted", []).append(readmitted)

    def _RollBack(self, c: cmd.RollBack) -> None:
        self.executor.roll_back(c)

    def _WriteCheckpoint(self, c: cmd.WriteCheckpoint) -> None:
        writer, position = self.writer, c.position
        if c.kind == cmd.CheckpointKind.PHASE:
            states = self.executor.replica_states(f"p{c.phase.index}")
            writer.save_boundary(
                states, c.phase, c.step, self.measurement, self.recorder, position.memory_cap
            )
            return
        if c.kind == cmd.CheckpointKind.SURVIVORS:  # (a survivor lost meanwhile: an event)
            states = self.executor.replica_states("lost")
        else:  # each replica's state, or its group's workers' (a spatial layout)
            states = [
                s for part in c.states for s in (part if isinstance(part, tuple) else (part,))
            ]
        path = writer.save_mid_phase(states, c.phase, position, c.step, self.recorder)
        if c.kind == cmd.CheckpointKind.SURVIVORS:
            self.saved_path = path

    def _Fail(self, c: cmd.Fail) -> None:
        if c.error is not None:
            raise c.error
        if c.stopped_by is not None:
            store = None if self.writer is None else self.writer.store
            raise stopped_error(c.stopped_by, c.commit_step, self.saved_path, store)
        store = None if self.writer is None else self.writer.store
        message = lost_workers_message(
            c,
            min_workers=self.min_workers,
            config=self.machine.config,
            saved_path=self.saved_path,
            newest=None if store is None or self.saved_path else store.latest(),
            folder=None if store is None else store.directory,
        )
        if not c.remain:  # what the fit's clean-up talks to: the live ones (partners)
            alive = set(self.executor.available())
            self.executor.members = tuple(w for w in self.executor.members if w in alive)
        raise WorkerLostError(message)

    def _Finish(self, c: cmd.Finish) -> None:
        # the wall time training ended (every replica's last phase end in): a worker
        # lost after it costs the fit nothing, and is not one of its failures
        self.recorder.history.info["finished_at"] = time.time()
        self.final_state = self.executor.final_weights()


def _is_rendezvous_error(error: BaseException) -> bool:
    """An error of forming the process group (worth forming it again): the engine's
    :class:`CollectiveError`, or torch.distributed's store and network errors
    (``DistError`` and its subclasses, named here so the driver need not import torch)."""
    if isinstance(error, CollectiveError):
        return True
    return any(kind.__name__ == "DistError" for kind in type(error).__mro__)


# Every command's handler, looked up once at import: a Command type without a
# ``FitLoop._<Name>`` method fails the import, not a fit.
COMMAND_HANDLERS = {
    kind: getattr(FitLoop, f"_{kind.__name__}") for kind in typing.get_args(cmd.Command)
}
