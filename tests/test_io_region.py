"""Region reads for spatial decomposition: each rank reads only its part of every sample."""

import itertools
import pickle

import numpy as np
import pytest
import torch
import zarr
from zarr.storage import LocalStore, WrapperStore

import dataflow as dfl
from dataflow.core.errors import ConfigError, DataError
from dataflow.io import ArraySource, EpochChunkReader, ZarrSource, to_zarr
from dataflow.tools.cli import main as cli_main
from dataflow.tools.convert import convert


class CountingStore(WrapperStore):
    """Records every key read (with its bytes) and every existence check."""

    def __init__(self, store, log=None):
        super().__init__(store)
        self.log = {"get": [], "exists": []} if log is None else log

    def _with_store(self, store):
        return type(self)(store, self.log)

    async def get(self, key, prototype, byte_range=None):
        buffer = await self._store.get(key, prototype, byte_range)
        self.log["get"].append((key, 0 if buffer is None else len(buffer)))
        return buffer

    async def get_partial_values(self, prototype, key_ranges):
        key_ranges = list(key_ranges)
        buffers = await self._store.get_partial_values(prototype, key_ranges)
        for (key, _), buffer in zip(key_ranges, buffers, strict=True):
            self.log["get"].append((key, 0 if buffer is None else len(buffer)))
        return buffers

    async def exists(self, key):
        self.log["exists"].append(key)
        return await self._store.exists(key)

    def chunk_bytes(self, array="x"):
        """Bytes of ``array``'s chunk objects read (metadata files left out)."""
        return sum(n for key, n in self.log["get"] if _is_chunk(key, array))

    def chunk_keys(self, kind="get", array="x"):
        keys = self.log[kind] if kind == "exists" else [k for k, _ in self.log["get"]]
        return {k for k in keys if _is_chunk(k, array)}

    def reset(self):
        self.log["get"].clear()
        self.log["exists"].clear()


def _is_chunk(key, array):
    name = key.rsplit("/", 1)[-1]
    return key.startswith(f"{array}/") and name not in (
        "zarr.json",
        ".zarray",
        ".zattrs",
        ".zgroup",
        ".zmetadata",
    )


def _store(tmp_path, x, y=None, zarr_format=3, **kwargs):
    kwargs.setdefault("compressor", None)  # raw chunks: bytes read are exact
    return to_zarr(tmp_path / "s.zarr", x, y, zarr_format=zarr_format, **kwargs)


def _counted(path, node=zarr.open_group):
    store = CountingStore(LocalStore(str(path), read_only=True))
    return store, node(store=store, mode="r")


def _split(extent, parts):
    edges = np.linspace(0, extent, parts + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in itertools.pairwise(edges)]


RNG = np.random.default_rng(0)
SHAPES = {1: (12, 2, 16), 2: (12, 2, 16, 6), 3: (12, 1, 16, 4, 4)}  # (N, C, *spatial)


# -- a region read is the slice of the whole read ----------------------------------------


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_region_read_is_the_slice_of_the_whole_read(tmp_path, zarr_format, dims):
    x = RNG.random(SHAPES[dims], dtype=np.float32)
    y = np.arange(len(x))
    path = _store(tmp_path, x, y, zarr_format, spatial_chunks={1: 4}, chunk_mb=1e-3)
    source = ZarrSource(path, "x", "y", shuffle=False)
    assert source.sample_shape == x.shape[1:]
    region = {1: (3, 11), dims: (1, x.shape[dims + 1] - 1)} if dims > 1 else {1: (3, 11)}
    view = source.region(region)
    cut = (slice(None), *(slice(*view.region_bounds[k]) for k in range(dims + 1)))
    assert view.region_shape == x[0][cut[1:]].shape
    assert view.sample_shape == source.sample_shape  # whole, before the region
    indices = np.array([7, 0, 11, 3, 3])
    batch = view.read(indices)
    assert np.array_equal(batch.x.numpy(), x[indices][cut])
    assert np.array_equal(batch.y.numpy(), y[indices])  # targets are never cut
    bounds = view.chunk_bounds
    wanted = sorted({0, len(bounds) - 2})
    chunks = view.read_chunks(wanted)
    for chunk in wanted:
        want = x[bounds[chunk] : bounds[chunk + 1]][cut]
        assert np.array_equal(np.asarray(chunks[chunk].x), want)
    assert view.read(np.array([], dtype=np.int64)).x.shape == (0, *view.region_shape)


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_regions_covering_a_sample_reassemble_it(tmp_path, parts):
    x = RNG.random(SHAPES[3], dtype=np.float32)
    source = ZarrSource(_store(tmp_path, x, spatial_chunks={1: 4}, chunk_mb=1e-3), shuffle=False)
    memory = ArraySource(x)
    indices = np.arange(len(x))
    for axis in (1, 2):
        spans = _split(x.shape[axis + 1], parts)
        for whole in (source, memory):
            pieces = [whole.region({axis: span}).read(indices).x for span in spans]
            assert torch.equal(torch.cat(pieces, dim=axis + 1), torch.from_numpy(x))


def test_the_epoch_path_reads_regions(tmp_path):
    x = RNG.random(SHAPES[2], dtype=np.float32)
    view = ZarrSource(_store(tmp_path, x, spatial_chunks={1: 8}, chunk_mb=1e-3)).region(
        {1: (8, 16), 2: (0, 3)}
    )
    batches = [np.array([5, 1, 9]), np.array([0, 11]), np.array([], dtype=np.int64)]
    got = list(EpochChunkReader(view, batches))
    for batch, indices in zip(got, batches, strict=True):
        assert np.array_equal(batch.x.numpy(), x[indices][:, :, 8:16, 0:3])


def test_an_array_source_region_is_a_view_that_pickles_small():
    x = RNG.random((6, 2, 32, 8), dtype=np.float32)  # 12 KiB
    source = ArraySource(x, np.arange(6))
    view = source.region({2: (4, 8)})
    assert view.region_bounds == ((0, 2), (0, 32), (4, 8))
    assert view.x.untyped_storage().data_ptr() == source.x.untyped_storage().data_ptr()
    again = pickle.loads(pickle.dumps(view))
    assert len(pickle.dumps(source)) > x.nbytes > len(pickle.dumps(view)) + x.nbytes // 3
    assert np.array_equal(again.read(np.array([4, 1])).x.numpy(), x[[4, 1]][..., 4:8])
    assert again.region_bounds == view.region_bounds and again.sample_shape == (2, 32, 8)


# -- only the region's chunks are read: bytes counted at the store -----------------------


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("ranks", [2, 4])
def test_each_rank_reads_its_share_of_the_bytes(tmp_path, zarr_format, ranks):
    # 8 samples of (1, 16, 8, 8) float32, 4 KiB each; chunks (2, 1, 4, 8, 8): 2 KiB,
    # 4 along depth. Raw (uncompressed) chunks, so the bytes read are exact: each 2 KiB
    # and its 4-byte checksum (crc32c, or v2's crc32 filter).
    x = RNG.random((8, 1, 16, 8, 8), dtype=np.float32)
    path = _store(tmp_path, x, np.arange(8), zarr_format, spatial_chunks={1: 4}, chunk_mb=2048e-6)
    store, group = _counted(path)
    assert group["x"].chunks == (2, 1, 4, 8, 8)
    whole = ZarrSource(group, "x", "y", shuffle=False)
    everything = np.arange(8)
    store.reset()
    whole.read(everything)
    total = store.chunk_bytes()
    assert total == x.nbytes + 16 * 4 == 32768 + 64
    for rank, span in enumerate(_split(16, ranks)):
        view = whole.region({1: span})
        for read in (
            lambda v: v.read(everything),  # random access
            lambda v: list(EpochChunkReader(v, [everything[:4], everything[4:]])),  # epochs
        ):
            store.reset()
            read(view)
            assert store.chunk_bytes() == total // ranks, (rank, span)
            keys = store.chunk_keys()
            assert len(keys) == 4 * 4 // ranks  # 4 sample chunks x (4 / ranks) depth chunks
            # the missing check covers those only: this async-only wrapper reads as a
            # remote store, whose epoch GETs are the existence check (io.fetch)
            assert store.chunk_keys("exists") <= keys
            depth = {int(k.replace("/", ".").split(".")[-3]) for k in keys}
            assert depth == set(range(rank * 4 // ranks, (rank + 1) * 4 // ranks))


def test_a_region_across_chunk_edges_reads_the_chunks_it_touches(tmp_path):
    x = RNG.random((4, 1, 16, 8, 8), dtype=np.float32)
    store, group = _counted(_store(tmp_path, x, spatial_chunks={1: 4}, chunk_mb=4096e-6))
    store.reset()
    ZarrSource(group, "x").region({1: (3, 9)}).read(np.arange(4))
    # depth chunks 0, 1 and 2 of 4, each with its 4-byte checksum
    assert store.chunk_bytes() == x.nbytes * 3 // 4 + 3 * 4


def test_a_sharded_store_reads_only_the_region(tmp_path):
    x = RNG.random((4, 16, 8), dtype=np.float32)
    array = zarr.create_array(
        str(tmp_path / "sharded.zarr"), shape=x.shape, dtype=x.dtype, chunks=(2, 4, 8),
        shards=(2, 8, 8), compressors=None, config={"write_empty_chunks": True},
    )  # fmt: skip
    array[:] = x
    store, array = _counted(tmp_path / "sharded.zarr", zarr.open_array)
    view = ZarrSource(array, x=None).region({0: (8, 12)})
    store.reset()
    assert np.array_equal(view.read(np.arange(4)).x.numpy(), x[:, 8:12])
    # one inner chunk of 256 bytes per shard, plus each shard's index (36 bytes)
    assert x.nbytes // 4 < store.chunk_bytes(array="c") < x.nbytes // 4 + 100
    assert sorted(store.chunk_keys("exists", array="c")) == ["c/0/1/0", "c/1/1/0"]


# -- the missing-chunk check follows the region ------------------------------------------


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_missing_chunk_fails_inside_the_region_only(tmp_path, zarr_format):
    x = RNG.random((4, 1, 16, 4), dtype=np.float32)
    path = _store(tmp_path, x, np.arange(4), zarr_format, spatial_chunks={1: 4}, chunk_mb=1e-3)
    source = ZarrSource(path, "x", "y", shuffle=False)
    assert source.chunk_samples == 4
    name = "0.0.3.0" if zarr_format == 2 else "c/0/0/3/0"  # sample chunk 0, depth chunk 3
    (path / "x" / name).unlink()
    inside, outside = source.region({1: (12, 16)}), source.region({1: (0, 12)})
    assert np.array_equal(outside.read(np.arange(4)).x.numpy(), x[:, :, :12])
    assert len(list(EpochChunkReader(outside, [np.arange(4)]))) == 1
    for failing in (source, inside):
        with pytest.raises(dfl.ChunkMissingError, match=rf"no chunk 'x/{name}'"):
            failing.read(np.array([2]))
        with pytest.raises(dfl.ChunkMissingError, match="store is incomplete"):
            list(EpochChunkReader(failing, [np.arange(4)]))


def test_a_corrupt_chunk_is_named_inside_the_region_only(tmp_path):
    x = RNG.random((4, 1, 16, 4), dtype=np.float32)
    path = _store(tmp_path, x, spatial_chunks={1: 8}, chunk_mb=1e-3, compressor="zstd")
    (path / "x" / "c" / "0" / "0" / "1" / "0").write_bytes(b"not zstd")
    source = ZarrSource(path, shuffle=False)
    assert np.array_equal(source.region({1: (0, 8)}).read(np.arange(4)).x.numpy(), x[..., :8, :])
    with pytest.raises(dfl.ChunkReadError, match=r"chunk 'x/c/0/0/1/0'.*corrupt"):
        source.region({1: (4, 12)}).read(np.array([1]))


def test_scalar_samples_have_no_region():
    with pytest.raises(ConfigError, match="each sample is a scalar"):
        ArraySource(np.arange(5.0)).region({0: (0, 1)})


# -- other layouts and readers -----------------------------------------------------------


def test_the_sample_axis_need_not_be_first(tmp_path):
    x = RNG.random((2, 6, 10, 3), dtype=np.float32)  # (C, N, D, H): samples along axis 1
    array = zarr.create_array(
        str(tmp_path / "a.zarr"), shape=x.shape, dtype=x.dtype, chunks=(2, 3, 5, 3),
        dimension_names=("c", "n", "d", "h"),
    )  # fmt: skip
    array[:] = x
    source = ZarrSource(tmp_path / "a.zarr", x=None, sample_dim="n")
    assert source.sample_shape == (2, 10, 3)
    view = source.region({1: (5, 10), 2: (1, 2)})
    want = np.moveaxis(x, 1, 0)[[4, 0]][:, :, 5:10, 1:2]
    assert np.array_equal(view.read(np.array([4, 0])).x.numpy(), want)


def test_dask_and_in_memory_readers_cut_too():
    xarray = pytest.importorskip("xarray")
    da = pytest.importorskip("dask.array")
    x = RNG.random((9, 2, 8, 5), dtype=np.float32)
    dims = ("sample", "c", "d", "h")
    for data in (da.from_array(x, chunks=(3, 2, 4, 5)), x):
        dataset = xarray.Dataset({"x": (dims, data), "y": (("sample",), np.arange(9))})
        view = ZarrSource(dataset, "x", "y", sample_dim="sample").region({1: (4, 8), 2: (0, 2)})
        batch = view.read(np.array([8, 2, 5]))
        assert np.array_equal(batch.x.numpy(), x[[8, 2, 5]][:, :, 4:8, 0:2])
        assert batch.y.tolist() == [8, 2, 5]
    array = da.from_array(x, chunks=(3, 2, 4, 5))
    view = ZarrSource(array, x=None).region({1: (0, 4)})
    assert np.array_equal(view.read(np.arange(9)).x.numpy(), x[:, :, :4])


def test_several_inputs_of_one_shape_are_cut_alike(tmp_path):
    xarray = pytest.importorskip("xarray")
    a, b = RNG.random((2, 4, 2, 8), dtype=np.float32)
    dims = ("sample", "c", "d")
    dataset = xarray.Dataset({"a": (dims, a), "b": (dims, b), "t": (("sample", "k"), a[:, 0])})
    path = to_zarr(tmp_path / "m.zarr", dataset, sample_dim="sample")
    view = ZarrSource(path, ["a", "b"], "t").region({1: (2, 6)})
    batch = view.read(np.array([3, 1]))
    assert np.array_equal(batch.x[0].numpy(), a[[3, 1]][..., 2:6])
    assert np.array_equal(batch.x[1].numpy(), b[[3, 1]][..., 2:6])
    assert batch.y.shape == (2, 8)
    with pytest.raises(DataError, match=r"different sample shapes.*x\[0\] \(2, 8\)"):
        ZarrSource(path, ["a", "t"]).region({1: (0, 1)})


# -- validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "region, message",
    [
        ({3: (0, 2)}, r"axis 3 is not an axis of a sample of shape \(2, 16, 6\); use 0\.\.2"),
        ({-1: (0, 2)}, r"axis -1 is not an axis.*0 is the channels"),
        ({True: (0, 2)}, r"axis True is not an axis"),
        ({"1": (0, 2)}, r"axis '1' is not an axis"),
        ({1: (0, 17)}, r"axis 1 range \[0, 17\) lies outside the sample.*0 <= lo < hi <= 16"),
        ({1: (-2, 4)}, r"range \[-2, 4\) lies outside"),
        ({1: (5, 5)}, r"axis 1 range \[5, 5\) is empty"),
        ({1: (6, 2)}, r"range \[6, 2\) is empty"),
        ({1: 4}, r"axis 1 needs a pair of ints \(lo, hi\)"),
        ({1: (0.0, 4)}, r"needs a pair of ints"),
        ([(1, (0, 4))], r"give a dict \{axis: \(lo, hi\)\}"),
    ],
)
def test_a_bad_region_names_the_axis_and_the_fix(tmp_path, region, message):
    x = RNG.random(SHAPES[2], dtype=np.float32)
    for source in (ZarrSource(_store(tmp_path, x)), ArraySource(x)):
        with pytest.raises(ConfigError, match=message):
            source.region(region)


def test_a_region_of_a_region_narrows_it(tmp_path):
    x = RNG.random(SHAPES[2], dtype=np.float32)
    for source in (ZarrSource(_store(tmp_path, x), shuffle=False), ArraySource(x)):
        view = source.region({1: (4, 12)}).region({1: (6, 10), 2: (2, 4)})
        assert view.region_bounds == ((0, 2), (6, 10), (2, 4))
        assert np.array_equal(view.read(np.array([1])).x.numpy(), x[[1]][:, :, 6:10, 2:4])
        with pytest.raises(ConfigError, match=r"already a region, axis 1 \[4, 12\).*4 <= lo"):
            source.region({1: (4, 12)}).region({1: (0, 8)})
        assert source.region({}).region_bounds == ((0, 2), (0, 16), (0, 6))


def test_a_zarr_region_view_pickles(tmp_path):
    x = RNG.random(SHAPES[3], dtype=np.float32)
    view = ZarrSource(_store(tmp_path, x, spatial_chunks={1: 8}), shuffle=False).region(
        {1: (8, 16)}
    )
    view.read(np.array([0]))  # opened: the handles must stay behind
    again = pickle.loads(pickle.dumps(view))
    assert again.region_bounds == view.region_bounds
    assert "region=((0, 1), (8, 16)" in repr(again)
    assert np.array_equal(again.read(np.array([5, 2])).x.numpy(), x[[5, 2]][:, :, 8:16])


# -- writing stores chunked within samples -----------------------------------------------


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_to_zarr_chunks_along_spatial_axes(tmp_path, zarr_format):
    x = RNG.random((10, 2, 8, 6, 4), dtype=np.float32)
    path = to_zarr(
        tmp_path / "s.zarr", x, np.arange(10), spatial_chunks={1: 4, 2: 3}, chunk_mb=2 * 384e-6,
        zarr_format=zarr_format,
    )  # fmt: skip
    group = zarr.open_group(str(path), mode="r")
    # chunk_mb sizes the chunk as split: 2 samples of (2, 4, 3, 4) float32 = 2 x 384 bytes
    assert group["x"].chunks == (2, 2, 4, 3, 4)
    assert group["y"].chunks == (10,)  # targets are not split
    assert np.array_equal(group["x"][:], x)


def test_to_zarr_splits_a_dataset_by_dimension_name(tmp_path):
    xarray = pytest.importorskip("xarray")
    x = RNG.random((6, 8, 4), dtype=np.float32)
    dataset = xarray.Dataset(
        {"x": (("n", "z", "w"), x), "m": (("n", "z"), x[..., 0]), "y": (("n",), np.arange(6))}
    )
    path = to_zarr(tmp_path / "d.zarr", dataset, sample_dim="n", spatial_chunks={"z": 2})
    group = zarr.open_group(str(path), mode="r")
    assert group["x"].chunks == (6, 2, 4) and group["m"].chunks == (6, 2)
    with pytest.raises(ConfigError, match=r"names from \['w', 'z'\]"):
        to_zarr(tmp_path / "e.zarr", dataset, sample_dim="n", spatial_chunks={1: 2})


@pytest.mark.parametrize(
    "spatial, message",
    [
        ({3: 2}, r"keys are axes of one sample of x, shape \(2, 8, 6\).*use 0\.\.2"),
        ({"d": 2}, r"keys are axes of one sample"),
        ({1: 0}, r"chunk length must be an int in 1\.\.8"),
        ({1: 9}, r"in 1\.\.8 \(the extent of 1\)"),
        ({1: 2.5}, r"must be an int"),
        ([4], r"give a dict \{axis: chunk length\}"),
    ],
)
def test_to_zarr_refuses_bad_spatial_chunks(tmp_path, spatial, message):
    with pytest.raises(ConfigError, match=message):
        to_zarr(tmp_path / "s.zarr", np.zeros((4, 2, 8, 6), np.float32), spatial_chunks=spatial)


def test_convert_and_the_cli_forward_spatial_chunks(tmp_path, capsys):
    x = RNG.random((4, 1, 8, 6), dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    convert(tmp_path / "x.npy", tmp_path / "a.zarr", spatial_chunks={1: 4})
    assert zarr.open_group(str(tmp_path / "a.zarr"), mode="r")["x"].chunks[2] == 4
    np.savez(tmp_path / "xy.npz", a=x, b=x, y=np.arange(4))
    convert(tmp_path / "xy.npz", tmp_path / "b.zarr", x=["a", "b"], spatial_chunks={1: 2})
    group = zarr.open_group(str(tmp_path / "b.zarr"), mode="r")
    assert group["a"].chunks[2] == group["b"].chunks[2] == 2 and group["y"].chunks == (4,)
    assert cli_main(["convert", str(tmp_path / "x.npy"), str(tmp_path / "c.zarr"),
                     "--spatial-chunks", "1=2", "2=3"]) == 0  # fmt: skip
    assert zarr.open_group(str(tmp_path / "c.zarr"), mode="r")["x"].chunks[2:] == (2, 3)
    assert cli_main(["convert", str(tmp_path / "x.npy"), str(tmp_path / "d.zarr"),
                     "--spatial-chunks", "1:2"]) == 1  # fmt: skip
    assert "give AXIS=LEN" in capsys.readouterr().err
