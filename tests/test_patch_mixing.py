"""How well shuffled window epochs mix (io.mixing): pure, over the engine's own orders."""

from __future__ import annotations

import numpy as np
import pytest

import dataflow as dfl
from dataflow.core.errors import ConfigError
from dataflow.io.mixing import (
    engine_batches,
    epoch_steps,
    mean_pairwise_distance,
    source_mixing,
    window_mixing,
)
from dataflow.io.windows import block_groups, block_units, grid_corners


def by_order(rows):
    return {r.order: r for r in rows}


# -- exact small cases, by hand ----------------------------------------------------------

LINE = np.arange(8)[:, None]  # 8 windows at corners 0..7 along one dim
PAIRS = [np.array([0, 1]), np.array([2, 3]), np.array([4, 5]), np.array([6, 7])]
SUPER = [0, 0, 1, 1]  # two super-blocks of two blocks


def test_mean_pairwise_distance_is_the_mean_l1_distance_over_distinct_pairs():
    # (0,0)-(1,2): 3, (0,0)-(3,1): 4, (1,2)-(3,1): 3
    assert mean_pairwise_distance(np.array([[0, 0], [1, 2], [3, 1]])) == pytest.approx(10 / 3)
    # 0..7: sum over pairs of j - i is (8^3 - 8) / 6 = 84, over 28 pairs
    assert mean_pairwise_distance(LINE) == pytest.approx(3.0)
    assert mean_pairwise_distance(LINE[:1]) == 0.0


def test_a_batch_of_one_block_or_of_neighbours_in_c_order_by_hand():
    rows = by_order(window_mixing(LINE, PAIRS, SUPER, 2, buffer_chunks=(1,), seed=3))
    c_order, one = rows["shuffle=False"], rows["buffer_chunks=1"]
    # C order: batches [0, 1], [2, 3], ...: one block, one super-block, distance 1 of 3,
    # and the batches' corners 0.5, 2.5, 4.5, 6.5 follow the step exactly
    assert (c_order.units_mean, c_order.units_min, c_order.groups_mean) == (1.0, 1, 1.0)
    assert c_order.spread == pytest.approx(1 / 3) and c_order.trend == pytest.approx(1.0)
    # buffer_chunks=1, a batch of one block's windows: each batch is one block, in any order
    assert (one.units_mean, one.groups_mean, one.batches) == (1.0, 1.0, 4)
    assert one.spread == pytest.approx(1 / 3)


def test_a_batch_of_every_window_mixes_fully_whatever_the_order():
    for row in window_mixing(LINE, PAIRS, SUPER, 8, buffer_chunks=(1, 4)):
        assert (row.units_mean, row.groups_mean, row.batches) == (4.0, 2.0, 1)
        assert row.spread == pytest.approx(1.0) and row.trend == 0.0


def test_replicas_each_bring_their_own_blocks_to_a_global_batch_by_hand():
    # 2 replicas, 2 windows each per step: replica 0 reads one super-block, replica 1 the
    # other, a block per step each (buffer_chunks=1): 2 blocks of 2 super-blocks a batch
    rows = by_order(window_mixing(LINE, PAIRS, SUPER, 4, buffer_chunks=(1,), replicas=2))
    one = rows["buffer_chunks=1"]
    assert (one.units_mean, one.units_min, one.groups_mean, one.batches) == (2.0, 2, 2.0, 2)


# -- a 2-D grid: the knob and the references ---------------------------------------------


def grid_2d():
    """1,024 windows of 8 x 8 (stride 8) over 256 x 256, blocks of 32 x 32 (16 windows)
    in super-blocks of 2 x 2 blocks: 64 blocks, 16 super-blocks."""
    corners = grid_corners([0, 0], [248, 248], [8, 8])
    units = block_units(corners, (32, 32))
    return corners, units, block_groups(corners, units, (32, 32))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_more_buffer_chunks_mix_more_blocks_up_to_the_full_permutation(seed):
    corners, units, groups = grid_2d()
    rows = window_mixing(corners, units, groups, 32, buffer_chunks=(1, 4, 16), seed=seed)
    o = by_order(rows)
    shuffled = [o["buffer_chunks=1"], o["buffer_chunks=4"], o["buffer_chunks=16"]]
    blocks = [r.units_mean for r in shuffled]
    supers = [r.groups_mean for r in shuffled]
    spread = [r.spread for r in shuffled]
    assert blocks == sorted(blocks) and blocks[-1] > 2 * blocks[0]
    assert supers == sorted(supers) and spread == sorted(spread)
    full = o["full permutation"]  # the upper reference
    assert full.units_mean > blocks[-1] and full.groups_mean > supers[-1]
    assert full.spread == pytest.approx(1.0, abs=0.05) and full.spread >= max(spread)
    # the knob's floor: a batch of 32 windows is two blocks of 16 at buffer_chunks=1
    assert o["buffer_chunks=1"].units_min == 2 and o["buffer_chunks=1"].units_mean == 2.0


def test_c_order_sweeps_the_array_across_the_epoch_and_shuffled_orders_do_not():
    corners, units, groups = grid_2d()
    rows = window_mixing(corners, units, groups, 32, epochs=3)
    o = by_order(rows)
    assert o["shuffle=False"].trend == pytest.approx(1.0, abs=0.01)
    assert all(r.trend < 0.9 for r in rows if r.order != "shuffle=False")
    assert o["full permutation"].trend < 0.3


def test_more_replicas_mix_more_blocks_per_global_batch():
    corners, units, groups = grid_2d()
    one = by_order(window_mixing(corners, units, groups, 32, buffer_chunks=(4,)))
    four = by_order(window_mixing(corners, units, groups, 32, buffer_chunks=(4,), replicas=4))
    assert four["buffer_chunks=4"].units_mean > one["buffer_chunks=4"].units_mean


def test_bad_batch_replicas_and_groups_are_named():
    corners, units, groups = grid_2d()
    with pytest.raises(ConfigError, match=r"batch_size=2000.*1\.\.1024"):
        window_mixing(corners, units, groups, 2000)
    with pytest.raises(ConfigError, match=r"replicas=0"):
        window_mixing(corners, units, groups, 32, replicas=0)
    with pytest.raises(ConfigError, match="3 super-block ids for 64 blocks"):
        window_mixing(corners, units, groups[:3], 32)


# -- a real PatchSource: the measured order is the order it streams ----------------------


def write_field(tmp_path):
    import zarr

    data = np.random.default_rng(0).normal(size=(64, 48)).astype(np.float32)
    array = zarr.open_array(
        str(tmp_path / "f.zarr"), mode="w", shape=data.shape, chunks=(16, 16), dtype=np.float32
    )
    array[...] = data
    return tmp_path / "f.zarr"


def test_the_batches_measured_are_the_batches_a_patch_source_streams(tmp_path):
    path = write_field(tmp_path)
    source = dfl.io.PatchSource(path, patch={0: 4, 1: 4})
    n = source.num_samples
    steps = epoch_steps(n, 16, 1, 1)
    [measured] = engine_batches(
        steps,
        sizes=[len(m) for m in source.chunk_members],
        seed=7,
        shuffle=True,
        buffer_chunks=2,
        members=source.chunk_members,
        groups=source.chunk_groups,
    )
    streamed = [b.indices for b in dfl.io.stream_batches(source, 16, seed=7, buffer_chunks=2)]
    assert len(measured) == n // 16
    for a, b in zip(measured, streamed, strict=False):
        assert np.array_equal(a, b)
    rows = by_order(source_mixing(source, 16, buffer_chunks=(1, 2)))
    assert rows["buffer_chunks=1"].units_mean == 1.0  # 16-window blocks, batches of 16


def test_an_unshuffled_source_has_no_blocks_to_measure(tmp_path):
    source = dfl.io.PatchSource(write_field(tmp_path), patch={0: 4, 1: 4}, shuffle=False)
    with pytest.raises(ConfigError, match=r"not a shuffled PatchSource.*shuffle=True"):
        source_mixing(source, 16)


# -- dataflow info --patch: the table a user sees ------------------------------------------


def test_info_patch_prints_the_mixing_and_each_buffers_memory(tmp_path, capsys):
    import json

    import zarr

    from dataflow.tools.cli import main

    zarr.open_array(
        str(tmp_path / "v.zarr"), mode="w", shape=(128, 128, 64), chunks=(64, 64, 64), dtype="f4"
    )[...] = 0.0
    args = ["info", str(tmp_path / "v.zarr"), "--patch", "0=32,1=32,2=32", "--no-decode"]
    assert main([*args, "--json"]) == 0
    mixing = json.loads(capsys.readouterr().out)["patch"]["mixing"]
    # 4 x 4 x 2 = 32 windows of 32^3 in 4 blocks of one 64^3 chunk (8 windows, a 1 MiB
    # box and 1 MiB of windows each), 1 super-block; one batch of 32: every window
    assert (mixing["windows"], mixing["blocks"], mixing["super_blocks"]) == (32, 4, 1)
    assert mixing["block_bytes"] == 2 * 64**3 * 4 and mixing["precut_bytes"] == 32 * 32**3 * 4
    orders = [r["order"] for r in mixing["rows"]]
    assert orders == [
        "shuffle=False",
        "buffer_chunks=1",
        "buffer_chunks=4",
        "buffer_chunks=16",
        "full permutation",
    ]
    assert all(r["units_mean"] == 4.0 and r["spread"] == pytest.approx(1.0) for r in mixing["rows"])
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "32 windows (stride = patch) in 4 blocks (2.1 MB each" in out
    assert "buffer 8.4 MB (the default)" in out and "buffer 33.6 MB" in out
    assert "a pre-cut copy of 4.2 MB" in out
