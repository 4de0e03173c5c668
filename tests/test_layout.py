"""Layouts as pure data, and the fit machine forming replicas of P workers (issue 16,
items 1 and 7): no cluster, milliseconds."""

from __future__ import annotations

import pytest
from test_driver_machine import PHASE0, Driver, of, planned

import dataflow as dfl
from dataflow.driver import commands as cmd
from dataflow.driver import events as ev
from dataflow.planning.layout import ReplicaGroups, fewer_workers_hint
from dataflow.spatial.geometry import Window, exchange, grid_shape, split_extent

FIVE = tuple(f"tcp://w{i}" for i in range(5))


def test_layout_defaults_and_grids():
    assert dfl.Layout().spatial == 1 and dfl.Layout().dims == (0,)
    assert dfl.Layout(spatial=4, dims=(0, 1)).grid == (2, 2)
    assert dfl.Layout(spatial=8, dims=(0, 1)).grid == (4, 2)
    assert dfl.Layout(spatial=2, dims=1).tensor_dims == (3,)
    assert dfl.Layout(spatial=2).sample_axes == (1,)
    assert grid_shape(6, 3) == (3, 2, 1)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"spatial": 0}, "spatial=0"),
        ({"spatial": 2, "dims": (0, 0)}, "named twice"),
        ({"spatial": 2, "dims": (-1,)}, "dims=(-1,)"),
        ({"spatial": 4, "dims": (0, 1), "grid": (4, 2)}, "multiplying to spatial=4"),
    ],
)
def test_a_bad_layout_names_the_field(kwargs, says):
    with pytest.raises(dfl.ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        dfl.Layout(**kwargs)


def test_regions_tile_the_sample():
    layout = dfl.Layout(spatial=4, dims=(0, 1))
    regions = [layout.region((3, 10, 7, 5), r) for r in range(4)]
    cells = {(d, h) for r in regions for d in range(*r[1]) for h in range(*r[2])}
    assert len(cells) == 10 * 7 == sum((r[1][1] - r[1][0]) * (r[2][1] - r[2][0]) for r in regions)
    with pytest.raises(dfl.ConfigError, match="cannot be split 4 ways"):
        dfl.Layout(spatial=4).region((1, 3, 8), 3)
    with pytest.raises(dfl.ConfigError, match="1 spatial dimension"):
        dfl.Layout(spatial=2, dims=(1,)).region((1, 8), 0)


def test_halo_traffic_is_what_each_window_reads_beyond_its_region():
    conv = Window(3, 1, 1, 1, 1)  # a 'same' 3-wide convolution
    owned = split_extent(16, 2)
    needs = [(max(0, a), min(16, b)) for a, b in (conv.needed(o) for o in owned)]
    assert exchange(0, owned, needs).recvs == ((1, (8, 9)),)
    assert exchange(1, owned, needs).sends == ((0, (8, 9)),)
    assert split_extent(10, 3) == ((0, 3), (3, 7), (7, 10))
    assert split_extent(9, 2, (2.0, 1.0)) == ((0, 6), (6, 9))


def test_replica_groups_of_p_workers():
    groups = ReplicaGroups.of(FIVE, 2)
    assert groups.groups == ((FIVE[0], FIVE[1]), (FIVE[2], FIVE[3]))
    assert groups.leaders == (FIVE[0], FIVE[2]) and groups.lost_replicas([FIVE[3]]) == (1,)


def test_the_machine_forms_groups_of_p_and_keeps_the_spare():
    d = Driver(spatial=2)
    [form] = d.send(ev.Started(FIVE))
    assert form.members == (FIVE[0], FIVE[2]) and form.groups == ((FIVE[0], FIVE[1]), FIVE[2:4])
    assert d.state.available == (FIVE[4],)  # the fifth worker waits for a partner


def test_a_lost_worker_takes_its_group_and_its_partner_forms_a_new_one_with_the_spare():
    d = Driver(spatial=2)
    d.send(ev.Started(FIVE))
    assert d.send(ev.GroupFormed(0)) == [cmd.ChoosePhase()]
    d.send(ev.PhaseChosen(PHASE0))
    steps = planned(PHASE0, 2)
    d.send(ev.SegmentPlanned(PHASE0, steps, steps))
    out = d.send(ev.WorkersLost((FIVE[1],)))
    [rollback] = of(cmd.RollBack, out)
    assert rollback.members == (FIVE[2],)  # the surviving replica, by its leader
    [form] = of(cmd.FormGroup, out)
    # w0 (the lost worker's partner) and w4 (the spare) form a new replica
    assert form.groups == (FIVE[2:4], (FIVE[4], FIVE[0]))
    assert form.joining == (FIVE[4], FIVE[0])


def _running(d: Driver, workers: tuple[str, ...], replicas: int) -> list:
    d.send(ev.Started(workers))
    d.send(ev.GroupFormed(0))
    d.send(ev.PhaseChosen(PHASE0))
    steps = planned(PHASE0, replicas)
    return d.send(ev.SegmentPlanned(PHASE0, steps, steps))


@pytest.mark.parametrize("checkpoints", [True, False])
def test_no_group_left_the_partner_saves_the_commit_and_the_fit_fails_naming_the_layout(
    checkpoints,
):
    d = Driver(spatial=2, checkpoints=checkpoints)
    _running(d, FIVE[:2], 1)
    out = d.send(ev.WorkersLost((FIVE[0],)))  # the group's leader: w1 is left alone
    alone = ((FIVE[1],),)
    assert of(cmd.StopWindows, out) == [cmd.StopWindows((FIVE[1],), groups=alone)]
    assert of(cmd.RollBack, out) == [cmd.RollBack((FIVE[1],), 0, groups=alone)]
    saves = [(c.kind, c.step) for c in of(cmd.WriteCheckpoint, out)]
    assert saves == ([("survivors", 0)] if checkpoints else [])
    [failure] = of(cmd.RecordFailure, out)
    assert failure.record["replicas_after"] == 0 and failure.record["lost"] == [FIVE[0]]
    [fail] = of(cmd.Fail, out)
    assert out[-1] is fail and fail.remain == 0 and fail.workers_left == 1
    assert not of(cmd.AwaitRestart, out) and d.state.status == "failed"


def test_no_group_left_but_the_pool_forms_one_the_fit_restarts_from_the_partners_save():
    d = Driver(spatial=2, checkpoints=True)
    _running(d, FIVE[:3], 1)  # (w0, w1) and the spare w2
    out = d.send(ev.WorkersLost((FIVE[1],)))
    assert [c.kind for c in of(cmd.WriteCheckpoint, out)] == ["survivors"]
    assert out[-1] == cmd.AwaitRestart(2, 2, 60.0, 10.0) and not of(cmd.Fail, out)
    out = d.send(ev.RestartPoint(step=0, workers=(FIVE[0], FIVE[2])))
    [record] = of(cmd.RecordFailure, out)
    assert record.record["restarted_from_step"] == 0 and record.record["replicas_after"] == 1
    [form] = of(cmd.FormGroup, out)
    assert form.fresh and form.restore and form.groups == ((FIVE[0], FIVE[2]),)
    assert d.state.available == ()


def test_a_restart_with_too_few_workers_for_a_group_fails_naming_them():
    d = Driver(spatial=2, checkpoints=True)
    _running(d, FIVE[:2], 1)
    d.send(ev.WorkersLost(FIVE[:2]))  # both: nobody holds the commit, wait for workers
    [fail] = d.send(ev.RestartPoint(step=0, workers=(FIVE[3],)))
    assert isinstance(fail, cmd.Fail) and fail.workers_left == 1


def test_too_few_groups_for_min_workers_fails_with_the_workers_left():
    d = Driver(spatial=2, min_workers=2)
    _running(d, FIVE[:4], 2)
    out = d.send(ev.WorkersLost((FIVE[3],)))
    [fail] = of(cmd.Fail, out)
    assert fail.remain == 1 and fail.workers_left == 3  # group 0, and the partner w2


def test_the_hint_names_the_smallest_layout_the_workers_left_run():
    assert fewer_workers_hint(2, 1) == (
        "1 worker(s) left; spatial=2 needs 2 per replica: restart with >= 2 workers, or "
        "resume with layout=dfl.Layout(spatial=1)"
    )
    assert fewer_workers_hint(4, 3).endswith("layout=dfl.Layout(spatial=3)")
    assert fewer_workers_hint(2, 3, replicas=2) == (
        "3 worker(s) left; spatial=2 needs 2 per replica and min_workers=2 replicas: "
        "restart with >= 4 workers, or resume with layout=dfl.Layout(spatial=1)"
    )
    assert fewer_workers_hint(2, 0).endswith("restart with >= 2 workers")
