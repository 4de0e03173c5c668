"""PatchSource beyond its windows: the gather that cuts them, object stores, resume,
NaN, normalisation."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from test_patch_source import seg_pipeline, tiles, write_2d

import dataflow as dfl
from dataflow.checkpoint import CheckpointStore
from dataflow.io.windows import box_chunks, cut_windows


def sliced(region, lo, corners, extent, axes) -> np.ndarray:
    """The windows cut one by one with slicing (what ``cut_windows`` must equal)."""
    out = []
    for corner in corners:
        index = [slice(None)] * region.ndim
        for c, e, axis in zip(corner, extent, axes, strict=True):
            index[axis] = slice(c - lo[axis], c - lo[axis] + e)
        out.append(region[tuple(index)])
    return np.stack(out)


@pytest.mark.parametrize(
    ("shape", "extent", "axes"),
    [
        ((30, 20), (4, 5), (0, 1)),
        ((3, 30, 20), (4, 5), (1, 2)),  # a whole leading axis (levels)
        ((30, 3, 20, 2), (6, 5), (0, 2)),  # whole axes between and after the cut ones
        ((12, 10, 9), (3, 3, 3), (0, 1, 2)),
        ((50,), (1,), (0,)),
    ],
)
def test_windows_are_cut_in_one_gather_exactly_as_slicing_cuts_them(shape, extent, axes):
    rng = np.random.default_rng(len(shape))
    region = rng.normal(size=shape).astype(np.float32)
    lo = [0] * len(shape)
    for axis in axes:
        lo[axis] = 7  # the box was read from corner 7 of the array
    high = [shape[a] - e + 7 for a, e in zip(axes, extent, strict=True)]
    corners = np.stack([rng.integers(7, h + 1, 40) for h in high], axis=1)
    got = cut_windows(region, lo, corners, extent, axes)
    assert got.flags.c_contiguous and got.flags.writeable
    assert np.array_equal(got, sliced(region, lo, corners, extent, axes))
    # a strided region (a numpy or dask array's box may not be contiguous)
    odd = np.asfortranarray(region)
    assert np.array_equal(cut_windows(odd, lo, corners, extent, axes), got)


# -- object stores -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3():
    from object_store import s3_server

    pytest.importorskip("moto")
    with s3_server() as server:
        yield server


def streamed(source, **options) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    return [
        (b.indices.copy(), b.x.numpy().copy(), b.y.numpy().copy())
        for b in dfl.io.stream_batches(source, 9, seed=5, **options)
    ]


def test_windows_of_an_s3_store_are_the_local_windows_with_chunk_gets_in_flight_together(
    s3, tmp_path
):
    from object_store import KEY, SECRET

    path, _ = write_2d(tmp_path)
    url = s3.upload(path, "field.zarr")
    grid = dict(patch={"lat": 8, "lon": 8}, stride={"lat": 5, "lon": 6})
    remote = dfl.io.PatchSource(
        url, ["a", "b"], "lab", storage_options=s3.storage_options, block=2, **grid
    )
    local = dfl.io.PatchSource(path, ["a", "b"], "lab", block=2, **grid)
    assert len(remote.chunk_members) > 4  # several units, so several GETs to overlap
    # A box's read fetches its objects together; more at once means the epoch's objects
    # were fetched ahead: the first chunk GET waits (at the proxy) for that many more
    per_box = max(
        len(box_chunks(lo, hi, (16, 16)))
        for unit in remote.chunk_members
        for lo, hi in remote._boxes(unit)
    )
    s3.proxy.reset_counts()
    s3.proxy.delay, s3.proxy.rendezvous = 0.01, per_box + 1
    try:
        got = streamed(remote, decode_threads=1)  # one decode thread: fetches overlap anyway
    finally:
        s3.proxy.delay, s3.proxy.rendezvous = 0.0, 1
    want = streamed(local, decode_threads=1)
    assert len(got) == len(want) > 4
    for (gi, gx, gy), (wi, wx, wy) in zip(got, want, strict=True):
        assert np.array_equal(gi, wi) and np.array_equal(gx, wx) and np.array_equal(gy, wy)
    assert s3.proxy.peak_chunk_gets > per_box, s3.proxy.methods  # the epoch was fetched ahead
    # a worker's copy reads the arrays opened here; no credential shows anywhere
    again = pickle.loads(pickle.dumps(remote))
    assert np.array_equal(again.read(np.arange(3)).x.numpy(), local.read(np.arange(3)).x.numpy())
    shown = [repr(remote), repr(remote.storage_options), repr(remote.__getstate__())]
    assert not [text for text in shown if SECRET in text or KEY in text]
    with pytest.raises(dfl.ConfigError, match=r"fetch_ahead_mb=0.*number > 0"):
        dfl.io.PatchSource(path, "a", patch={"lat": 8}, fetch_ahead_mb=0)


# -- resume ------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_shuffled_fit_resumed_from_a_mid_epoch_checkpoint_ends_bit_identical(client, tmp_path):
    path, _ = write_2d(tmp_path)
    source = tiles(path, block=2)
    run = tmp_path / "run"
    options = dict(checkpoint_dir=run, keep_checkpoints=100)
    full = seg_pipeline(source, window_steps=2).fit(2, client=client, checkpoint_every=1, **options)
    mid = [c for c in full.history.info["checkpoints"] if c["mid_phase"]]
    steps_per_epoch = len(full.history.steps) // 2
    point = next(c for c in mid if steps_per_epoch < c["step"] < 2 * steps_per_epoch - 1)
    store = CheckpointStore(run, keep=100)
    for newer in [p for p in store.checkpoints() if p.name > store.path(point["step"]).name]:
        newer.unlink()  # as if the run died just after that checkpoint
        CheckpointStore.manifest_path(newer).unlink()
    resumed = seg_pipeline(source, window_steps=2).fit(2, client=client, resume=True, **options)
    assert resumed.history.info["resumed_from"]["step"] == point["step"]
    for name, tensor in full.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name
    assert [s["loss"] for s in resumed.history.steps] == [s["loss"] for s in full.history.steps]
    for epoch in range(2):
        assert resumed.ledger.consumed(epoch).tolist() == list(range(source.num_samples))
