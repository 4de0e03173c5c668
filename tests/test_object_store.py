"""ZarrSource over a real S3-compatible server (moto), behind a proxy that adds latency.

The server and the proxy are real (``tests/object_store.py``): s3fs talks HTTP to
the proxy, which holds each request and forwards it to moto. What is checked: the
batches are exactly the local store's, the chunk GETs are in flight together (a
count the proxy observed), and the credentials never show.
"""

from __future__ import annotations

import functools
import logging
import pickle
import time

import numpy as np
import pytest
import torch
import zarr
from conftest import make_data, tiny_pipeline
from object_store import KEY, SECRET

import dataflow as dfl
from dataflow.io import EpochChunkReader


@pytest.fixture
def proxy(s3):
    s3.proxy.delay, s3.proxy.rendezvous = 0.0, 1
    s3.proxy.reset_counts()
    yield s3.proxy
    s3.proxy.delay, s3.proxy.rendezvous = 0.0, 1


def batches(source, **options):
    return [
        (b.indices.copy(), b.x.clone(), b.y.clone())
        for b in dfl.io.stream_batches(source, 32, seed=3, **options)
    ]


def test_an_s3_store_streams_the_local_batches_with_chunk_requests_in_flight_together(
    s3, s3_stores, proxy
):
    local, url = s3_stores
    remote = dfl.io.ZarrSource(url, x="x", y="y", storage_options=s3.storage_options)
    assert len(remote.chunk_bounds) > 4  # several chunks, so several GETs to overlap
    proxy.delay, proxy.rendezvous = 0.01, 2  # the first chunk GET waits for a second
    proxy.reset_counts()
    got = batches(remote, decode_threads=1)  # one decode thread: fetches overlap anyway
    want = batches(dfl.io.ZarrSource(local, x="x", y="y"), decode_threads=1)
    assert len(got) == len(want) == 8
    for (gi, gx, gy), (wi, wx, wy) in zip(got, want, strict=True):
        assert np.array_equal(gi, wi)
        assert torch.equal(gx, wx) and torch.equal(gy, wy)
    # The epoch's chunks were fetched ahead, several GETs in flight at once
    assert proxy.peak_chunk_gets >= 2, proxy.methods
    # A chunk missing from the bucket is named before any batch (zarr would read zeros)
    x, y = make_data(128)
    local = dfl.io.to_zarr(local.parent / "holes.zarr", x, y, chunk_mb=0.01)
    url = s3.upload(local, "holes.zarr")
    s3.delete("holes.zarr/x/c/2/0/0/0")
    remote = dfl.io.ZarrSource(url, x="x", y="y", storage_options=s3.storage_options)
    with pytest.raises(dfl.ChunkMissingError, match=r"x/c/2/0/0/0"):
        batches(remote, decode_threads=2)


def stored_objects(local, *arrays):
    """How many chunk objects the arrays of the local store ``local`` hold."""
    return sum(sum(1 for p in (local / a / "c").rglob("*") if p.is_file()) for a in arrays)


def two_epochs(source):
    return [batches_of(source, epoch) for epoch in range(2)]


def batches_of(source, epoch):
    return [
        (b.indices.copy(), b.x.clone(), b.y.clone())
        for b in dfl.io.stream_batches(source, 32, seed=3, epoch=epoch, decode_threads=2)
    ]


def field_store(path, holes=()):
    """A 2-D field (64 x 96, chunks 16 x 32) and a label field beside it, minus ``holes``."""
    rng = np.random.default_rng(1)
    group = zarr.open_group(path, mode="w")
    for name, values in (
        ("f", rng.normal(size=(64, 96)).astype(np.float32)),
        ("lab", rng.integers(0, 3, size=(64, 96)).astype(np.int64)),
    ):
        array = group.create_array(name, shape=values.shape, dtype=values.dtype, chunks=(16, 32))
        array[...] = values
    for key in holes:
        (path / key).unlink()
    return path


def tiles(store, **options):
    patch = {0: 8, 1: 8}
    return dfl.io.PatchSource(store, "f", "lab", patch=patch, y_patch={0: 1, 1: 1}, **options)


def test_an_epoch_from_s3_sends_no_head_its_gets_are_the_existence_check(
    s3, s3_stores, proxy, tmp_path
):
    """Each object of an epoch is asked for once (a GET) and never HEAD-ed: the GET
    is the existence check; a resident array read is not checked again."""
    local, url = s3_stores
    remote = dfl.io.ZarrSource(url, x="x", y="y", storage_options=s3.storage_options)
    proxy.reset_counts()
    got = two_epochs(remote)
    assert proxy.methods.get("HEAD", 0) == 0, proxy.methods
    # x's objects once per epoch; y's (resident: read whole, kept) once in all
    objects = 2 * stored_objects(local, "x") + stored_objects(local, "y")
    assert proxy.methods.get("GET", 0) == objects, proxy.methods
    assert len(got[1]) == 8
    # PatchSource alike: its units' objects, x's and the labels', GET once each (no
    # decoded-chunk cache: the second epoch reads the store again)
    path = field_store(tmp_path / "field.zarr")
    url = s3.upload(path, "field.zarr")
    patches = tiles(url, storage_options=s3.storage_options, chunk_cache_mb=0)
    proxy.reset_counts()
    got = two_epochs(patches)
    assert proxy.methods.get("HEAD", 0) == 0, proxy.methods
    assert proxy.methods.get("GET", 0) == 2 * stored_objects(path, "f", "lab"), proxy.methods
    want = two_epochs(tiles(path))
    for epoch in range(2):
        for (gi, gx, gy), (wi, wx, wy) in zip(got[epoch], want[epoch], strict=True):
            assert np.array_equal(gi, wi) and torch.equal(gx, wx) and torch.equal(gy, wy)


def test_the_next_epoch_is_fetched_while_this_one_ends_each_object_once(s3, s3_stores, proxy):
    """A reader whose plan has asked for all its objects starts the next epoch's plan
    (``EpochChunkReader.then``, as ``Load`` chains a phase's epochs), sharing its budget:
    the next epoch's GETs are out before it starts, each object still GET once."""
    local, url = s3_stores
    here = dfl.io.ZarrSource(local, x="x", y="y")
    orders = [
        [b.indices.copy() for b in dfl.io.stream_batches(here, 32, seed=3, epoch=e)] for e in (0, 1)
    ]
    remote = dfl.io.ZarrSource(url, x="x", y="y", storage_options=s3.storage_options)
    first, second = (EpochChunkReader(remote, order) for order in orders)
    first.then = second
    proxy.reset_counts()
    batches = iter(first)
    got = [next(batches) for _ in range(len(orders[0]) - 1)]
    deadline = time.monotonic() + 60
    while not first.fetching.launched_all:  # what the step before the last waits for
        assert time.monotonic() < deadline, "the first epoch's plan never asked for all"
        time.sleep(0.01)
    got.append(next(batches))  # the last batch: the next epoch's plan starts here
    assert second.fetching is not None and second._fetch_started
    assert second.fetching._after is first.fetching
    assert next(batches, None) is None
    got += list(second)
    want = [b for e in (0, 1) for b in dfl.io.stream_batches(here, 32, seed=3, epoch=e)]
    assert len(got) == len(want) == 16
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g.indices, w.indices) and torch.equal(g.x, w.x)
        assert torch.equal(g.y, w.y)
    # x's objects once per epoch, y's (resident) once in all: none asked for twice
    objects = 2 * stored_objects(local, "x") + stored_objects(local, "y")
    assert proxy.methods.get("GET", 0) == objects, proxy.methods
    assert proxy.methods.get("HEAD", 0) == 0, proxy.methods


@pytest.mark.parametrize("kind", ["zarr", "patch"])
def test_an_object_missing_from_s3_is_named_and_never_read_as_fill_values(
    s3, proxy, tmp_path, kind
):
    """The GET that finds no object stops the epoch naming it; every batch handed out
    before that is the local store's (no fill value trained on)."""
    if kind == "zarr":
        x, y = make_data(128)
        path = dfl.io.to_zarr(tmp_path / "holes.zarr", x, y, chunk_mb=0.01)
        hole = "x/c/2/0/0/0"
        make = functools.partial(dfl.io.ZarrSource, x="x", y="y")
    else:
        path = field_store(tmp_path / "holes.zarr")
        hole = "f/c/2/1"
        make = tiles
    url = s3.upload(path, f"{kind}-holes.zarr")
    s3.delete(f"{kind}-holes.zarr/{hole}")
    want = batches_of(make(path), 0)
    remote = make(url, storage_options=s3.storage_options)
    name = "ZarrSource" if kind == "zarr" else "PatchSource"
    got = []
    with pytest.raises(dfl.ChunkMissingError, match=rf"{name}: .*{hole}"):
        for b in dfl.io.stream_batches(remote, 32, seed=3, decode_threads=2):
            got.append((b.indices.copy(), b.x.clone(), b.y.clone()))
    assert len(got) < len(want)
    for (gi, gx, gy), (wi, wx, wy) in zip(got, want, strict=False):
        assert np.array_equal(gi, wi) and torch.equal(gx, wx) and torch.equal(gy, wy)


def test_credentials_never_print_and_also_come_from_the_environment(
    s3, s3_stores, proxy, monkeypatch
):
    _, url = s3_stores
    source = dfl.io.ZarrSource(url, x="x", y="y", storage_options=s3.storage_options)
    shown = [
        repr(source),
        str(source.storage_options),
        repr(source.storage_options),
        repr(source.__getstate__()),
        f"{source.storage_options}",
    ]
    assert not [text for text in shown if SECRET in text or KEY in text]
    assert s3.endpoint_url in str(source.storage_options)  # what is not a credential shows
    again = pickle.loads(pickle.dumps(source))  # a worker's copy opens the store
    assert again.read(np.arange(4)).size == 4
    # No credentials in the options: s3fs (botocore) reads them from the environment
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    bare = {"endpoint_url": s3.endpoint_url}
    from_env = dfl.io.ZarrSource(url, x="x", y="y", storage_options=bare)
    assert from_env.read(np.arange(4)).size == 4


def test_bad_fetch_ahead_is_refused_naming_the_field(s3_stores):
    local, _ = s3_stores
    with pytest.raises(dfl.ConfigError, match=r"fetch_ahead_mb=0.*number > 0"):
        dfl.io.ZarrSource(local, x="x", y="y", fetch_ahead_mb=0)


@pytest.mark.slow
def test_a_fit_from_s3_has_an_exact_ledger_and_leaves_no_credentials_behind(
    client, s3, s3_stores, proxy, tmp_path, caplog
):
    caplog.set_level(logging.DEBUG)
    _, url = s3_stores
    proxy.delay = 0.005
    proxy.rendezvous = 3  # more than one GET per worker: each fetches its epoch ahead
    source = dfl.io.ZarrSource(url, x="x", y="y", storage_options=s3.storage_options)
    pipe = tiny_pipeline(None, None, source=source, batch=32)
    checkpoints = tmp_path / "checkpoints"
    result = pipe.fit(epochs=2, client=client, checkpoint_dir=checkpoints, checkpoint_every=1)
    for epoch in range(2):
        assert result.ledger.consumed(epoch).tolist() == list(range(256))
    assert proxy.peak_chunk_gets >= 3, proxy.methods
    history = result.history.to_json(tmp_path / "history.json")
    written = [history, *(p for p in checkpoints.rglob("*") if p.is_file())]
    assert len(written) > 1
    logs = [
        caplog.text,
        repr(client.get_worker_logs()),
        repr(client.get_scheduler_logs()),
    ]
    for text in [repr(source), *logs]:
        assert SECRET not in text
    for path in written:
        assert SECRET.encode() not in path.read_bytes(), path


def test_a_dataset_opened_from_s3_with_its_options_is_read_raw_from_that_store(s3, proxy, tmp_path):
    """``xr.open_zarr(url, storage_options=...)``: its path alone does not open the store,
    so the arrays behind its variables name the group, on the store xarray opened. Read
    raw (fetched ahead, each object's GET its existence check), it equals the local
    store, also where the source travels; an object deleted is named, not read as 0."""
    xr = pytest.importorskip("xarray")
    x, y = make_data(128)
    local = tmp_path / "fields.zarr"
    dataset = xr.Dataset({"x": (("s", "c", "h", "w"), x), "y": (("s",), y)})
    dataset.to_zarr(local, encoding={"x": {"chunks": (16, 1, 8, 8)}}, consolidated=False)
    url = s3.upload(local, "xarray-fields.zarr")
    opened = xr.open_zarr(url, storage_options=s3.storage_options, consolidated=False)
    remote = dfl.io.ZarrSource(opened, x="x", y="y", sample_dim="s", shuffle=False)
    assert isinstance(remote.store, zarr.Group)  # raw, not through xarray
    assert SECRET not in repr(remote) and KEY not in repr(remote)
    here = dfl.io.ZarrSource(xr.open_zarr(local, consolidated=False), x="x", y="y", sample_dim="s")
    assert here.store == str(local)
    every = np.arange(128)
    for source in (remote, pickle.loads(pickle.dumps(remote))):
        batch, want = source.read(every), here.read(every)
        assert torch.equal(batch.x, want.x) and torch.equal(batch.y, want.y)
    s3.delete("xarray-fields.zarr/x/c/2/0/0/0")
    gone = dfl.io.ZarrSource(opened, x="x", y="y", sample_dim="s", shuffle=False)
    with pytest.raises(dfl.ChunkMissingError, match="x/c/2/0/0/0"):
        gone.read(every)
    # A split of it (xarray's slice) reads its box raw from the same store, fetched
    # ahead; the object deleted (samples 32..47) is outside this split: nothing refused
    split = dfl.io.ZarrSource(opened.isel(s=slice(48, 120)), x="x", y="y", sample_dim="s")
    assert "x[s 48:120]" in repr(split) and SECRET not in repr(split) and KEY not in repr(split)
    for source in (split, pickle.loads(pickle.dumps(split))):
        main = max(source._open(), key=lambda r: r.nbytes)
        assert main.fetches_ahead  # (a remote zarr array, decoded here)
        batch = source.read(np.arange(72))
        assert torch.equal(batch.x, torch.from_numpy(x[48:120]))
        assert torch.equal(batch.y, torch.from_numpy(y[48:120]))
    # PatchSource alike: windows of the split cut from its stored chunks, fetched ahead
    tiles = dfl.io.PatchSource(opened.isel(s=slice(48, 120)), "x", patch={"h": 4, "w": 4})
    for source in (tiles, pickle.loads(pickle.dumps(tiles))):
        (array,) = source._open()
        assert array.fetches_ahead and array.origin == (48, 0, 0, 0)
        fetching = source.fetch_ahead([range(len(source.chunk_members))])
        assert fetching is not None
        fetching.close()
        batch = source.read(np.arange(source.num_samples))
        for k in range(source.num_samples):
            h, w = source.corner(k)
            assert torch.equal(batch.x[k, 0], torch.from_numpy(x[48:120, :, h : h + 4, w : w + 4]))


def test_an_object_missing_while_the_next_epoch_is_fetched_ahead_is_named_as_missing(
    s3, proxy, tmp_path
):
    """The 404 of an epoch whose next epoch is already fetched ahead (its plan GETs the
    same objects): the error says the object is missing, with the fix, and not that the
    store changed underneath (the next plan no longer stands in for the check)."""
    x, y = make_data(512)
    path = dfl.io.to_zarr(tmp_path / "late.zarr", x, y, chunk_mb=0.01)
    here = dfl.io.ZarrSource(path, x="x", y="y")
    orders = [
        [b.indices.copy() for b in dfl.io.stream_batches(here, 32, seed=3, epoch=e)] for e in (0, 1)
    ]
    jobs = EpochChunkReader(here, orders[0]).jobs
    assert len(jobs) >= 3  # the first batch decodes without it (one thread: inline)
    late = jobs[-1][0]  # first decoded in a later batch
    hole = f"x/c/{late}/0/0/0"
    url = s3.upload(path, "late.zarr")
    s3.delete(f"late.zarr/{hole}")
    remote = dfl.io.ZarrSource(url, x="x", y="y", storage_options=s3.storage_options)
    first, second = (EpochChunkReader(remote, order, decode_threads=1) for order in orders)
    first.then = second
    first.start_fetching()
    second.start_fetching(after=first.fetching)  # as once the first has asked for all
    deadline = time.monotonic() + 60
    while not first.fetching.missing:  # the 404 is in before the first batch
        assert time.monotonic() < deadline, "the GET of the deleted object never answered"
        time.sleep(0.01)
    with pytest.raises(dfl.ChunkMissingError, match=rf"{hole}") as raised:
        list(first)
    assert "changing underneath" not in str(raised.value)
    assert second.fetching._closed


def test_a_cf_packed_store_on_s3_read_by_its_url_gives_xarray_s_values(s3, proxy, tmp_path):
    """ERA5's packing in an object store, given by its URL and storage options: read
    decoded (masked cell NaN), as xarray reads the local copy; no credential printed."""
    xr = pytest.importorskip("xarray")
    field = 0.1 + np.random.default_rng(2).random((12, 8, 8))
    field[5, 1, 1] = np.nan
    encoding = {"t": {"dtype": "int16", "scale_factor": 0.001, "_FillValue": -1}}
    local = tmp_path / "packed.zarr"
    xr.Dataset({"t": (("time", "lat", "lon"), field)}).to_zarr(
        local,
        encoding={**encoding, "t": {**encoding["t"], "chunks": (4, 8, 8)}},
        consolidated=False,
    )
    url = s3.upload(local, "packed.zarr")
    source = dfl.io.ZarrSource(
        url, x="t", sample_dim="time", shuffle=False, storage_options=s3.storage_options
    )
    want = xr.open_dataset(local, engine="zarr", chunks=None, consolidated=False)["t"].values
    np.testing.assert_array_equal(source.read(np.arange(12)).x.numpy(), want)
    assert np.isnan(want[5, 1, 1]) and "(CF-decoded)" in repr(source)
    assert SECRET not in repr(source) and SECRET not in str(source.storage_options)
