"""A stop signal to the driver (SIGTERM, SIGUSR1: a batch system's notice before it ends
the job) saves what every replica committed and stops the fit with ``FitStopped``; the
same fit with ``resume=True`` then ends bit-identical to a fit never stopped.

The machine's decisions are scripted (milliseconds); the handlers are set in this
process; the fits that stop are real, on a LocalCluster, signalled by a replica's stage
at a chosen step."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyCNN, make_data, sgd
from test_driver_machine import Driver, W, of

import dataflow as dfl
from dataflow import stages
from dataflow.checkpoint import CheckpointStore
from dataflow.driver import commands as cmd
from dataflow.driver import events as ev
from dataflow.driver.log import loggable
from dataflow.driver.machine import replay
from dataflow.driver.stop_signals import StopSignals
from dataflow.errors import ConfigError, FitStopped
from dataflow.trainer_config import TrainerConfig

STOP = ev.StopRequested("SIGUSR1")


def test_running_windows_are_held_what_finished_is_committed_and_saved():
    """The replicas start no more windows; the windows that finished by then come in
    and commit (nothing new is submitted after them); then the rollback to that commit,
    its checkpoint and the stop."""
    d = Driver(checkpoints=True, epochs=4)
    _, calibration = d.start()
    [train] = of(cmd.SubmitWindows, d.finish_plan(calibration))  # steps 0, 1 committed
    assert d.send(STOP) == [cmd.HoldWindows(("tcp://a", "tcp://b"))]
    out = d.finish_plan(train, upto=1)  # the first training window had finished
    assert [type(c) for c in out] == [cmd.CommitWindow]
    commit = d.state.committed_step
    assert commit > 2
    out = d.send(ev.WindowsHeld())
    assert [type(c) for c in out] == [cmd.StopWindows, cmd.RollBack, cmd.WriteCheckpoint, cmd.Fail]
    stop, back, save, fail = out
    assert stop.members == back.members == save.members == ("tcp://a", "tcp://b")
    assert back.step == save.step == fail.commit_step == commit
    assert save.kind == cmd.CheckpointKind.SURVIVORS  # inside the phase, from the commit
    assert fail.stopped_by == "SIGUSR1" and fail.lost == ()
    assert d.send(ev.Timer()) == [] and d.send(STOP) == []  # stopped: nothing more


def test_held_windows_that_end_a_plan_submit_no_next_one():
    d = Driver(checkpoints=True, epochs=4)
    _, calibration = d.start()
    d.send(STOP)
    out = d.finish_plan(calibration)  # the calibration plan ends: its next is not sent
    assert of(cmd.SubmitWindows, out) == [] and len(of(cmd.CommitWindow, out)) == 2
    assert [type(c) for c in d.send(ev.WindowsHeld())][-1] is cmd.Fail


def test_without_a_checkpoint_folder_the_fit_stops_saving_nothing():
    d = Driver(epochs=4)
    d.start()
    d.send(STOP)
    out = d.send(ev.WindowsHeld())
    assert [type(c) for c in out] == [cmd.StopWindows, cmd.RollBack, cmd.Fail]


def test_a_phase_ending_ends_and_is_saved_first_and_the_last_phase_finishes():
    """Every window committed: the phase ends and writes its own checkpoint, then the
    fit stops; at the end of the fit's last phase there is nothing left to stop. The
    same when the held windows were the phase's last ones."""
    for epochs, last in ((4, cmd.Fail), (2, cmd.Finish)):
        for held in (False, True):
            d = Driver(checkpoints=True, epochs=epochs)
            _, calibration = d.start()
            [train] = of(cmd.SubmitWindows, d.finish_plan(calibration))
            if held:
                d.send(STOP)
            out = d.finish_plan(train)
            assert isinstance(out[-1], cmd.EndPhase)
            assert d.send(ev.WindowsHeld() if held else STOP) == []
            out = d.send(ev.PhaseEnded(0, ({"weights_digest": "x"}, {"weights_digest": "x"})))
            assert [type(c) for c in out] == [cmd.RecordPhase, cmd.WriteCheckpoint, last]
            assert out[1].kind == cmd.CheckpointKind.PHASE
            if last is cmd.Fail:
                assert out[2].stopped_by == "SIGUSR1" and out[2].commit_step == 8


def test_a_loss_while_held_stops_on_the_newest_checkpoint():
    d = Driver(checkpoints=True, epochs=4, min_workers=1)
    _, calibration = d.start(workers=W)
    d.finish_plan(calibration)
    d.send(STOP)
    d.send(ev.WorkersLost(("tcp://c",)))  # the survivors regroup
    [fail] = d.send(ev.WindowsHeld())
    assert isinstance(fail, cmd.Fail) and fail.stopped_by == "SIGUSR1"


def test_between_windows_the_fit_stops_at_once_on_its_newest_checkpoint():
    d = Driver(checkpoints=True)
    d.send(ev.Started(("tcp://a", "tcp://b")))  # forming the first group
    [fail] = d.send(STOP)
    assert isinstance(fail, cmd.Fail) and fail.stopped_by == "SIGUSR1"
    assert d.send(ev.GroupFormed(0)) == []  # the group's answer comes to a stopped fit


def test_a_stopped_fits_log_replays_to_its_commands():
    d = Driver(checkpoints=True, epochs=4)
    _, calibration = d.start()
    d.finish_plan(calibration)
    d.send(STOP)
    d.send(ev.WindowsHeld())
    assert isinstance(d.machine.log.events[-2], ev.StopRequested)
    _, replayed = replay(d.machine.config, d.machine.log.events)
    assert [loggable(c) for out in replayed for c in out] == [loggable(c) for c in d.out]


def test_the_handlers_record_the_first_signal_and_hand_a_second_one_on():
    """The first signal is only recorded (the loop acts on it); the same one again gets
    the handler that was there before, so a stop that hangs can still be ended; the
    handlers before come back after the fit."""
    seen = []
    before = signal.signal(signal.SIGUSR2, lambda number, frame: seen.append(number))
    try:
        with StopSignals(("SIGUSR2",)) as stops:
            os.kill(os.getpid(), signal.SIGUSR2)
            assert stops.received == "SIGUSR2" and seen == []
            os.kill(os.getpid(), signal.SIGUSR2)
            assert seen == [signal.SIGUSR2]
        os.kill(os.getpid(), signal.SIGUSR2)
        assert seen == [signal.SIGUSR2] * 2
    finally:
        signal.signal(signal.SIGUSR2, before)


@pytest.mark.parametrize(
    ("given", "names"),
    [(("SIGTERM", "USR1"), ("SIGTERM", "SIGUSR1")), ([], ()), ("TERM", ("SIGTERM",))],
)
def test_stop_signals_are_names_of_signals_a_process_can_catch(given, names):
    assert TrainerConfig(stop_signals=given).stop_signals == names
    for bad in (("SIGKILL",), ("SIGINT",), ("SIGNOPE",), (15,)):
        with pytest.raises(ConfigError, match=r"stop_signals=.*not SIGKILL or SIGSTOP"):
            TrainerConfig(stop_signals=bad)


class SignalTheDriver(stages.Stage):
    """After replica 0's update of step ``at``: SIGUSR1 to the driver's process, once
    (a marker file says it was sent: the resumed fit trains that step again). Each step
    after it sleeps ``pause_s`` until the fit stopped (``stopped`` exists), so the fit
    cannot end before the driver, however loaded, acts on the signal."""

    def __init__(self, driver_pid: int, at: int, marker: str, pause_s: float = 0.25) -> None:
        super().__init__("SignalTheDriver")
        self.driver_pid, self.at, self.marker = driver_pid, at, marker
        self.stopped, self.pause_s = marker + ".stopped", pause_s

    def run(self, step, grads):
        mine = step.replica.rank == 0 and step.part is None
        if mine and step.spec.index == self.at and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(self.driver_pid, signal.SIGUSR1)
        elif os.path.exists(self.marker) and not os.path.exists(self.stopped):
            time.sleep(self.pause_s)
        return grads


def signalled_trainer(at: int, marker, **options) -> dfl.Trainer:
    x, y = make_data(192)  # 12 steps of 16 an epoch
    g = dfl.Graph()
    out = g.add(
        stages.Forward(TinyCNN, F.cross_entropy), g.add(stages.Load(dfl.io.ArraySource(x, y)))
    )
    reduced = g.add(stages.AllReduce(), g.add(stages.Backward(), out))
    g.add(SignalTheDriver(os.getpid(), at, str(marker)), g.add(stages.Update(sgd), reduced))
    return dfl.Trainer(
        g,
        schedule=dfl.schedule.Fixed(16),
        device="cpu",
        window_steps=1,  # windows of a step: many finish between a poll and the next
        progress=False,
        **options,
    )


@pytest.mark.slow
@pytest.mark.parametrize("sync", [None, dfl.sync.Async(staleness=0)], ids=["sync", "async"])
def test_a_signalled_fit_saves_its_commit_and_resumes_bit_identical(client, tmp_path, sync):
    """SIGUSR1 while step 15 of 36 runs: the fit stops with FitStopped naming the
    checkpoint of its commit (inside epoch 1), and resumed it equals the fit never
    stopped: weights, every step's loss, every sample once per epoch."""
    options = {} if sync is None else {"sync": sync}
    trainer = signalled_trainer(15, tmp_path / "sent", **options)
    folder = tmp_path / "ckpt"
    with pytest.raises(FitStopped, match=r"stopped on SIGUSR1: a checkpoint of step \d+") as e:
        trainer.fit(3, client=client, checkpoint_dir=folder)
    (tmp_path / "sent.stopped").touch()
    assert (tmp_path / "sent").exists()
    saved = CheckpointStore(folder).load_latest()
    assert e.value.signal == "SIGUSR1" and e.value.step == saved.step
    assert 15 <= saved.step < 36 and saved.in_phase is not None  # stopped after step 15
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the handlers are gone
    # the embedded cluster's workers ignore it (a job's notice reaches them too)
    assert set(client.run(signal.getsignal, signal.SIGUSR1).values()) == {signal.SIG_IGN}

    resumed = trainer.fit(3, client=client, checkpoint_dir=folder, resume=True)
    whole = trainer.fit(3, client=client)
    assert resumed.history.info["resumed_from"]["step"] == saved.step
    for name, tensor in whole.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name
    assert [s["loss"] for s in resumed.history.steps] == [s["loss"] for s in whole.history.steps]
    for epoch in range(3):
        assert sorted(resumed.ledger.consumed(epoch).tolist()) == list(range(192))
