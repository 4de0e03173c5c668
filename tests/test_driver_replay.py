"""A real fit's driver log replays: the events a 3-worker fit's state machine handled
(a phase change, mid-phase checkpoints, a worker SIGKILLed mid-window and the nanny's
restart joining again), fed to a fresh machine, give the very commands the live run
gave. The log holds plain copies: a replica's state as a marker, an error as its name
and message, so what the recorder changes afterwards does not change the log."""

from __future__ import annotations

import pytest
from conftest import make_data
from distributed import Client, LocalCluster
from test_lost_worker import N_SAMPLES, _trainer

from dataflow.driver import commands as cmd
from dataflow.driver import events as ev
from dataflow.driver.log import STATE_TAKEN, loggable
from dataflow.driver.machine import replay

pytestmark = pytest.mark.slow  # real worker processes, one really killed


@pytest.mark.timeout(300)
def test_a_real_fits_log_replays_to_the_same_commands(tmp_path):
    x, y = make_data(N_SAMPLES)
    with (
        LocalCluster(n_workers=3, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        marker = tmp_path / "killed"
        # killed at step 27 of phase 0 (steps 0-39); held at step 39 until the nanny has
        # restarted the worker, so that it joins by phase 1 at the latest
        trainer = _trainer(x, y, marker=str(marker), kill_step=27, wait_step=39)
        result = trainer.fit(
            epochs=3, client=client, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2
        )
    assert marker.exists()
    log = result.driver_log
    assert log.dropped == 0 and len(log) > 0
    events, commands = log.events, log.commands

    # what the log saw: the kill, the join, two phases, checkpoints inside a phase
    kinds = {type(e) for e in events}
    assert {ev.WorkersLost, ev.WorkersJoined, ev.WindowDone, ev.PhaseEnded} <= kinds
    phases = {e.phase.index for e in events if isinstance(e, ev.PhaseChosen) and e.phase}
    assert phases == {0, 1}
    inside = [c for c in commands if isinstance(c, cmd.WriteCheckpoint) and c.kind == "window"]
    assert inside and all(set(c.states) == {STATE_TAKEN} for c in inside)

    machine, replayed = replay(log.config, events)
    assert [loggable(c) for out in replayed for c in out] == commands
    assert machine.state.status == "done"
