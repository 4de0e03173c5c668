"""PatchSource: samples that are windows of a large N-D array, and the engine's chunks as
sets of samples (``chunk_members``) that such windows need."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
import zarr

import dataflow as dfl
from dataflow.core.batch import Batch
from dataflow.io.chunk_index import is_chunked
from dataflow.io.chunk_reader import EpochChunkReader
from dataflow.io.sharding import shard_epoch

# -- the engine: chunks as member lists ---------------------------------------------------


class MemberSource:
    """An in-memory chunked source whose chunks are strided sets of samples."""

    def __init__(self, n: int, chunks: int) -> None:
        self.x = np.arange(n, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
        self.chunk_members = [np.arange(c, n, chunks, dtype=np.int64) for c in range(chunks)]
        self.reads: list[int] = []

    @property
    def num_samples(self) -> int:
        return len(self.x)

    def check_chunks(self, chunks: Sequence[int]) -> None:
        pass

    def read_chunks(self, chunks: Sequence[int]) -> dict[int, Batch]:
        self.reads.extend(chunks)
        out = {}
        for c in chunks:
            rows = self.chunk_members[c]
            out[c] = Batch(x=torch.from_numpy(self.x[rows]), y=None, size=len(rows))
        return out

    def read(self, indices: np.ndarray) -> Batch:
        return Batch(x=torch.from_numpy(self.x[indices]), y=None, size=len(indices))


def test_shard_epoch_with_members_reads_each_chunks_members_and_every_sample_once():
    members = [np.array([0, 5, 9]), np.array([1, 2]), np.array([3, 4, 6, 7, 8])]
    sizes = [len(m) for m in members]
    for shuffle in (False, True):
        streams = shard_epoch(
            sizes, [4, 6], seed=3, epoch=1, shuffle=shuffle, buffer_chunks=1, members=members
        )
        assert sorted(np.concatenate(streams).tolist()) == list(range(10))
        # the same positions as the run layout, mapped through the members
        runs = shard_epoch(sizes, [4, 6], seed=3, epoch=1, shuffle=shuffle, buffer_chunks=1)
        flat = np.concatenate(members)
        for got, positions in zip(streams, runs, strict=True):
            assert got.tolist() == flat[positions].tolist()
    [unshuffled] = shard_epoch(sizes, [10], seed=0, epoch=0, shuffle=False, members=members)
    assert unshuffled.tolist() == [0, 5, 9, 1, 2, 3, 4, 6, 7, 8]
    with pytest.raises(dfl.errors.ConfigError, match="member lists do not match"):
        shard_epoch([3, 3], [4], seed=0, epoch=0, members=members)


def test_the_chunk_reader_decodes_each_member_chunk_once_and_places_every_sample():
    source = MemberSource(40, 4)
    assert is_chunked(source)
    [order] = shard_epoch(
        [10] * 4, [40], seed=1, epoch=0, buffer_chunks=2, members=source.chunk_members
    )
    batches = [order[i : i + 7] for i in range(0, 40, 7)]
    got = list(EpochChunkReader(source, batches, decode_threads=1))
    assert sorted(source.reads) == [0, 1, 2, 3]
    for batch, indices in zip(got, batches, strict=True):
        assert batch.x[:, 0].tolist() == indices.astype(np.float32).tolist()


# -- PatchSource: stores written here ------------------------------------------------------


def write_2d(tmp_path, *, levels: bool = False):
    """Two 64 x 48 fields (or one with a level dim) and labels, in 16 x 16 chunks."""
    import zarr

    rng = np.random.default_rng(0)
    group = zarr.open_group(str(tmp_path / "field.zarr"), mode="w")
    a = rng.normal(size=(64, 48)).astype(np.float32)
    b = rng.normal(size=(64, 48)).astype(np.float32)
    lab = ((a + b) > 0).astype(np.int64) + (a > 1).astype(np.int64)
    for name, data in (("a", a), ("b", b), ("lab", lab)):
        array = group.create_array(
            name,
            shape=data.shape,
            chunks=(16, 16),
            dtype=data.dtype,
            dimension_names=("lat", "lon"),
        )
        array[...] = data
    stacked = np.stack([a, b])
    array = group.create_array(
        "ab",
        shape=stacked.shape,
        chunks=(2, 16, 16),
        dtype=np.float32,
        dimension_names=("level", "lat", "lon"),
    )
    array[...] = stacked
    return tmp_path / "field.zarr", {"a": a, "b": b, "lab": lab, "ab": stacked}


def write_3d(tmp_path):
    import zarr

    rng = np.random.default_rng(1)
    vol = rng.normal(size=(40, 36, 28)).astype(np.float32)
    array = zarr.open_array(
        str(tmp_path / "vol.zarr"),
        mode="w",
        shape=vol.shape,
        chunks=(16, 16, 16),
        dtype=np.float32,
    )
    array[...] = vol
    return tmp_path / "vol.zarr", vol


def precut(array: np.ndarray, corners: np.ndarray, patch, axes) -> np.ndarray:
    """The windows at ``corners`` cut by hand (``axes``: the patch axes of ``array``)."""
    out = []
    for corner in corners:
        index = [slice(None)] * array.ndim
        for c, p, axis in zip(corner, patch, axes, strict=True):
            index[axis] = slice(c, c + p)
        out.append(array[tuple(index)])
    return np.stack(out)


def streamed(source, batch: int = 7, **options):
    batches = list(dfl.io.stream_batches(source, batch, **options))
    x = np.concatenate([b.x.numpy() for b in batches])
    y = None if batches[0].y is None else np.concatenate([b.y.numpy() for b in batches])
    return np.concatenate([b.indices for b in batches]), x, y, batches


def test_unshuffled_windows_of_a_2d_field_stream_in_c_order_as_cut_by_hand(tmp_path):
    path, data = write_2d(tmp_path)
    source = dfl.io.PatchSource(
        path,
        ["a", "b"],
        "lab",
        patch={"lat": 8, "lon": 8},
        stride={"lat": 5, "lon": 6},
        shuffle=False,
    )
    # the full grid: corners 0, 5, ..., 55 along lat and 0, 6, ..., 36 along lon, C order
    grid = [(i, j) for i in range(0, 57, 5) for j in range(0, 41, 6)]
    assert source.corners.tolist() == [list(c) for c in grid]
    assert source.num_samples == len(grid) and source.corner(3) == grid[3]
    indices, x, y, _ = streamed(source)
    assert indices.tolist() == list(range(len(grid)))
    expected = np.stack([precut(data[k], source.corners, (8, 8), (0, 1)) for k in "ab"], 1)
    assert source.sample_shape == (2, 8, 8) and np.array_equal(x, expected)
    assert np.array_equal(y, precut(data["lab"], source.corners, (8, 8), (0, 1)))
    # a level dim folded into the channels gives the same samples
    folded = dfl.io.PatchSource(
        path,
        "ab",
        "lab",
        patch={"lat": 8, "lon": 8},
        stride={"lat": 5, "lon": 6},
        channels=("level",),
        shuffle=False,
    )
    assert np.array_equal(streamed(folded)[1], expected)
    unfolded = dfl.io.PatchSource(
        path, "ab", patch={1: 8, 2: 8}, stride={1: 5, 2: 6}, shuffle=False
    )
    assert unfolded.sample_shape == (1, 2, 8, 8)
    assert np.array_equal(streamed(unfolded)[1][:, 0], expected)


def test_unshuffled_windows_of_a_3d_volume_stream_in_c_order_as_cut_by_hand(tmp_path):
    path, vol = write_3d(tmp_path)
    source = dfl.io.PatchSource(
        path, patch={0: 12, 1: 12, 2: 12}, stride={0: 9, 1: 8, 2: 7}, shuffle=False
    )
    indices, x, y, _ = streamed(source, batch=5)
    assert y is None and indices.tolist() == list(range(source.num_samples))
    assert source.corners.tolist() == sorted(source.corners.tolist())  # C order
    assert np.array_equal(x[:, 0], precut(vol, source.corners, (12, 12, 12), (0, 1, 2)))
    # only some dims cut: the rest taken whole
    slab = dfl.io.PatchSource(path, patch={2: 10}, stride={2: 3}, shuffle=False)
    assert slab.sample_shape == (1, 40, 36, 10)
    assert np.array_equal(streamed(slab)[1][:, 0], precut(vol, slab.corners, (10,), (2,)))


def test_a_mask_keeps_windows_by_their_valid_fraction_and_may_be_an_array_of_the_store(tmp_path):
    import zarr

    path, data = write_2d(tmp_path)
    valid = np.ones((64, 48), bool)
    valid[:20, :] = False  # "land"
    valid[30, 30] = False
    group = zarr.open_group(str(path), mode="a")
    group.create_array("valid", shape=valid.shape, chunks=(32, 32), dtype=bool)[...] = valid
    grid = dict(patch={"lat": 8, "lon": 8}, shuffle=False)
    whole = dfl.io.PatchSource(path, "a", **grid)
    strict = dfl.io.PatchSource(path, "a", mask=valid, **grid)
    by_name = dfl.io.PatchSource(path, "a", mask="valid", **grid)
    loose = dfl.io.PatchSource(path, "a", mask=valid, mask_fraction=0.5, **grid)
    expect = [c for c in whole.corners.tolist() if valid[c[0] : c[0] + 8, c[1] : c[1] + 8].all()]
    assert strict.corners.tolist() == expect == by_name.corners.tolist()
    assert [16, 0] in loose.corners.tolist() and [16, 0] not in expect  # half valid
    assert [24, 24] not in expect and [24, 24] in loose.corners.tolist()
    assert np.array_equal(
        streamed(strict)[1][:, 0], precut(data["a"], strict.corners, (8, 8), (0, 1))
    )


def test_explicit_windows_are_sorted_to_c_order(tmp_path):
    path, data = write_2d(tmp_path)
    corners = np.array([[40, 3], [0, 17], [40, 1], [13, 40]])
    source = dfl.io.PatchSource(path, "a", patch={"lat": 8, "lon": 8}, windows=corners)
    assert source.corners.tolist() == [[0, 17], [13, 40], [40, 1], [40, 3]]
    assert np.array_equal(
        source.read(np.arange(4)).x.numpy()[:, 0], precut(data["a"], source.corners, (8, 8), (0, 1))
    )


def test_a_shifted_target_window_forecasts_and_leaves_out_windows_whose_target_is_outside(
    tmp_path,
):
    import zarr

    rng = np.random.default_rng(2)
    field = rng.normal(size=(30, 16, 12)).astype(np.float32)  # time x lat x lon
    group = zarr.open_group(str(tmp_path / "f.zarr"), mode="w")
    group.create_array(
        "t",
        shape=field.shape,
        chunks=(8, 8, 8),
        dtype=np.float32,
        dimension_names=("time", "lat", "lon"),
    )[...] = field
    # inputs: times t, t+1 (folded into channels); target: time t+1+3, same tile
    source = dfl.io.PatchSource(
        tmp_path / "f.zarr",
        "t",
        "t",
        patch={"time": 2, "lat": 8, "lon": 6},
        stride={"time": 1},
        y_shift={"time": 4},
        y_patch={"time": 1},
        channels=("time",),
        shuffle=False,
    )
    times = sorted({c[0] for c in source.corners.tolist()})
    assert times == list(range(0, 30 - 4))  # t + 4 <= 29
    assert source.sample_shape == (2, 8, 6) and source.y_shape == (1, 8, 6)
    _, x, y, _ = streamed(source)
    for k, (t, i, j) in enumerate(source.corners.tolist()):
        assert np.array_equal(x[k], field[t : t + 2, i : i + 8, j : j + 6])
        assert np.array_equal(y[k], field[t + 4 : t + 5, i : i + 8, j : j + 6])
    shuffled = dfl.io.PatchSource(
        tmp_path / "f.zarr",
        "t",
        "t",
        patch={"time": 2, "lat": 8, "lon": 6},
        stride={"time": 1},
        y_shift={"time": 4},
        y_patch={"time": 1},
        channels=("time",),
    )
    indices, xs, ys, _ = streamed(shuffled, epoch=3)
    assert sorted(indices.tolist()) == list(range(shuffled.num_samples))
    assert np.array_equal(xs, x[indices]) and np.array_equal(ys, y[indices])


def config_error(match: str, *args, **kwargs):
    with pytest.raises(dfl.errors.ConfigError, match=match):
        dfl.io.PatchSource(*args, **kwargs)


def test_every_mistake_is_a_config_error_naming_the_argument(tmp_path):
    path, _ = write_2d(tmp_path)
    p = {"lat": 8, "lon": 8}
    config_error(r"'depth' is not a dimension of x .*lat", path, "a", patch={"depth": 4})
    config_error(
        r"patch=.*80 along lat is longer than x there \(64\)", path, "a", patch={"lat": 80}
    )
    config_error(r"stride=\{'lat': 0\}.*int >= 1", path, "a", patch=p, stride={"lat": 0})
    config_error(
        r"mask=.*shape \(4, 4\).*\(64, 48\)", path, "a", patch=p, mask=np.ones((4, 4), bool)
    )
    config_error(r"no window has its mask True", path, "a", patch=p, mask=np.zeros((64, 48), bool))
    config_error(r"y_shift=.*every window", path, "a", "lab", patch=p, y_shift={"lat": 64})
    config_error(r"y_shift=/y_patch=.*need y=", path, "a", patch=p, y_shift={"lat": 1})
    config_error(
        r"y_shift=.*'level' is not a dimension", path, "a", "lab", patch=p, y_shift={"level": 1}
    )
    config_error(r"stride= .* or windows=", path, "a", patch=p, stride=p, windows=[[0, 0]])
    config_error(r"windows=.*corner \[60, 0\].*inside", path, "a", patch=p, windows=[[60, 0]])
    config_error(r"corner \[0, 0\] is given twice", path, "a", patch=p, windows=[[0, 0], [0, 0]])
    config_error(
        r"mask_fraction=0", path, "a", patch=p, mask=np.ones((64, 48), bool), mask_fraction=0
    )
    config_error(r"block=0", path, "a", patch=p, block=0)
    config_error(r"x=.*'ab'.*shape \(2, 64, 48\).*one shape", path, ["a", "ab"], patch={1: 8})
    import zarr

    bad = zarr.open_group(str(path), mode="a")
    bad.create_array(
        "lab3", shape=(64, 40), chunks=(16, 16), dtype=np.int64, dimension_names=("lat", "lon")
    )
    config_error(  # named dims, another length: which dim, and both lengths
        r"y='lab3'.*extent differs from x's along the patch dim\(s\) \(lon: y 40, x 48\)",
        path,
        "a",
        "lab3",
        patch=p,
    )
    bad.create_array(
        "lab_other",
        shape=(64, 48),
        chunks=(16, 16),
        dtype=np.int64,
        dimension_names=("lat", "depth"),
    )
    config_error(
        r"y='lab_other'.*each patch dim \(lat, lon\) as long as x's.*dimension_names",
        path,
        "a",
        "lab_other",
        patch=p,
    )


def test_a_missing_chunk_inside_a_window_is_named_instead_of_read_as_fill_values(tmp_path):
    path, _ = write_2d(tmp_path)
    (path / "a" / "c" / "1" / "2").unlink()  # lat 16..31, lon 32..47
    source = dfl.io.PatchSource(path, "a", patch={"lat": 8, "lon": 8}, stride={"lat": 4, "lon": 4})
    inside = [
        k
        for k, (i, j) in enumerate(source.corners.tolist())
        if i + 7 >= 16 and i < 32 and j + 7 >= 32
    ]
    with pytest.raises(
        dfl.ChunkMissingError, match=r"PatchSource: array 'a' has no chunk 'a/c/1/2'"
    ):
        source.read(np.array(inside[:1]))
    with pytest.raises(dfl.ChunkMissingError, match=r"a/c/1/2"):
        streamed(source)
    # windows whose unit (16 x 16 blocks, plus their overhang) stays clear of it
    clear = [k for k, (i, j) in enumerate(source.corners.tolist()) if j < 16]
    assert source.read(np.array(clear)).size == len(clear)  # other units read fine


def storage_chunks(source, members) -> int:
    """Storage chunks of x that a unit's bounding box touches (what one read fetches)."""
    from dataflow.io.windows import box_chunks

    (array,) = [a for a in source._open() if a.field != "y"]
    lo, hi = source._boxes(members)[0]
    return len(box_chunks(lo, hi, array.unit))


@pytest.mark.parametrize("dims", [2, 3])
def test_shuffled_epochs_read_each_storage_chunk_a_bounded_number_of_times_and_mix_blocks(
    tmp_path, dims
):
    if dims == 2:
        path, _ = write_2d(tmp_path)
        source = dfl.io.PatchSource(
            path, "a", patch={"lat": 8, "lon": 8}, stride={"lat": 3, "lon": 4}
        )
        total_chunks = 4 * 3
    else:
        path, _ = write_3d(tmp_path)
        source = dfl.io.PatchSource(path, patch={0: 12, 1: 12, 2: 12}, stride={0: 4, 1: 4, 2: 4})
        total_chunks = 3 * 3 * 2
    members = source.chunk_members
    n = source.num_samples
    shares = [n // 3, n - n // 3]  # two replicas, uneven
    for epoch in range(2):
        streams = shard_epoch(
            [len(m) for m in members], shares, seed=5, epoch=epoch, buffer_chunks=2, members=members
        )
        assert sorted(np.concatenate(streams).tolist()) == list(range(n))  # every window once
        owner = np.empty(n, np.int64)
        for u, m in enumerate(members):
            owner[m] = u
        reads = sum(
            storage_chunks(source, members[u]) for s in streams for u in np.unique(owner[s])
        )
        biggest = max(storage_chunks(source, m) for m in members)
        assert reads <= 2**dims * total_chunks + biggest  # + one unit at the replicas' cut
    # every batch of a shuffled epoch mixes windows of several blocks
    _, _, _, batches = streamed(source, batch=16, buffer_chunks=4)
    blocks = [len(np.unique(owner[b.indices])) for b in batches]
    print(
        f"\n{dims}-D: {n} windows, {len(members)} blocks, {reads} chunk reads for "
        f"{total_chunks} chunks; blocks per batch of 16: mean {np.mean(blocks):.2f}, "
        f"min {min(blocks)}, max {max(blocks)}"
    )
    assert max(blocks) > 1 and np.mean(blocks) > 1


# -- fits on a real LocalCluster ---------------------------------------------------------


class SegNet(torch.nn.Module):
    """Per-pixel classes of two-channel 8 x 8 tiles."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3, padding=1)
        self.head = torch.nn.Conv2d(4, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)))


def seg_pipeline(source, **options):
    defaults = dict(
        model=SegNet,
        device="cpu",
        loss=torch.nn.functional.cross_entropy,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        source=source,
        schedule=dfl.schedule.Fixed(16),
        progress=False,
    )
    return dfl.Pipeline(**{**defaults, **options})


def tiles(path, **options):
    grid = dict(patch={"lat": 8, "lon": 8}, stride={"lat": 5, "lon": 6})
    return dfl.io.PatchSource(path, ["a", "b"], "lab", **{**grid, **options})


@pytest.mark.slow
def test_a_fit_on_unshuffled_windows_equals_the_fit_on_the_windows_cut_by_hand(client, tmp_path):
    path, data = write_2d(tmp_path)
    source = tiles(path, shuffle=False)
    x = np.stack([precut(data[k], source.corners, (8, 8), (0, 1)) for k in "ab"], 1)
    y = precut(data["lab"], source.corners, (8, 8), (0, 1))
    by_hand = seg_pipeline(dfl.io.ArraySource(x, y, shuffle=False)).fit(epochs=2, client=client)
    windows = seg_pipeline(source).fit(epochs=2, client=client)
    for name, tensor in by_hand.model.state_dict().items():
        assert torch.allclose(windows.model.state_dict()[name], tensor, atol=1e-6), name
    assert windows.ledger.consumed(1).tolist() == list(range(source.num_samples))


@pytest.mark.slow
def test_shuffled_windows_train_each_window_once_per_epoch_and_evaluate_on_windows(
    client, tmp_path
):
    path, _ = write_2d(tmp_path)
    source = tiles(path)
    held_out = tiles(path, shuffle=False, windows=[[0, 0], [16, 8], [40, 32]], stride=None)
    result = seg_pipeline(source, eval_source=held_out).fit(epochs=2, client=client)
    for epoch in range(2):
        assert result.ledger.consumed(epoch).tolist() == list(range(source.num_samples))
        for rank in range(2):  # each replica read its own share
            assert 0 < len(result.ledger.consumed(epoch, rank)) < source.num_samples
    assert all(np.isfinite(e["eval_loss"]) for e in result.history.epochs)


def test_a_zarr_backed_xarray_dataset_and_dataarray_are_read_as_raw_zarr(tmp_path):
    xr = pytest.importorskip("xarray")
    field = np.arange(10 * 16 * 12, dtype=np.float32).reshape(10, 16, 12)
    dataset = xr.Dataset({"t": (("time", "lat", "lon"), field)})
    dataset.to_zarr(tmp_path / "d.zarr", mode="w", consolidated=False)
    ds = xr.open_zarr(tmp_path / "d.zarr", consolidated=False)
    raw = dfl.io.PatchSource(ds, "t", patch={"lat": 8, "lon": 6}, shuffle=False)
    assert raw.store == str(tmp_path / "d.zarr")  # missing chunks are caught
    data = dfl.io.PatchSource(ds["t"], patch={"lat": 8, "lon": 6}, shuffle=False)
    assert isinstance(data.store, zarr.Array) and data.store.path == "t"  # caught too
    expected = precut(field, raw.corners, (8, 6), (1, 2))
    assert raw.sample_shape == data.sample_shape == (1, 10, 8, 6)
    for source in (raw, data):
        assert np.array_equal(source.read(np.arange(4)).x.numpy()[:, 0], expected)


def test_the_member_index_is_built_once_per_source_and_never_pickled(tmp_path):
    """The chunk reader's lookup arrays live on the source that needs them (no module
    cache), are reused by every reader of it, and stay behind when it travels."""
    import pickle

    from dataflow.io.chunk_index import MEMBER_INDEX, chunk_index

    path, _ = write_2d(tmp_path)
    source = dfl.io.PatchSource(path, "a", "lab", patch={"lat": 8, "lon": 8})
    index = chunk_index(source)
    assert chunk_index(source) is index and source.__dict__[MEMBER_INDEX] is index
    travelled = pickle.loads(pickle.dumps(source))
    assert MEMBER_INDEX not in travelled.__dict__
    assert chunk_index(travelled) is not index
