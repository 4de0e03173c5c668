"""``dataflow convert SRC.zarr DEST.zarr --chunks DIM=LEN,...``: a zarr store rewritten with
new chunks, streamed, checksummed, attributes and dimension names kept, a missing source
chunk refused (real stores in tmp_path, read back by the engine's sources)."""

from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pytest
import zarr

import dataflow as dfl
from dataflow.core.errors import ChunkMissingError, ChunkReadError, ConfigError, DataError
from dataflow.io.checksums import checksum_of
from dataflow.tools.cli import main
from dataflow.tools.convert import convert
from dataflow.tools.rechunk import Rechunked, SourceFileError, rechunk_store
from dataflow.tools.slabs import slab_shape


def volume_store(path, zarr_format=3, names=True):
    """A field (30, 20, 10) in odd chunks, a mask (20, 10) and a 1-D axis, with attributes."""
    group = zarr.open_group(str(path), mode="w", zarr_format=zarr_format)
    group.attrs["title"] = "test volume"
    data = np.arange(6000, dtype=np.float32).reshape(30, 20, 10)

    def array(name, values, chunks, dims):
        if names and zarr_format == 3:
            named = {"dimension_names": dims}
        elif names:
            named = {"attributes": {"_ARRAY_DIMENSIONS": list(dims)}}
        else:
            named = {}
        out = group.create_array(
            name,
            shape=values.shape,
            chunks=chunks,
            dtype=values.dtype,
            config={"write_empty_chunks": True},  # every chunk there, zeros too
            **named,
        )
        out[...] = values
        out.attrs["units"] = f"{name} units"
        return out

    array("field", data, (7, 8, 3), ("z", "y", "x"))
    array("mask", (data[0] > 50).astype(np.int8), (5, 10), ("y", "x"))
    array("z", np.arange(30, dtype=np.float64), (30,), ("z",))
    return path, data


def read(path):
    group = zarr.open_group(str(path), mode="r")
    return {name: group[name] for name in ("field", "mask", "z")}


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_store_is_rechunked_by_name_with_values_attributes_names_and_checksums(
    tmp_path, zarr_format
):
    """By dimension name: field's y and x change (x clipped to its 10), its z keeps its 7;
    mask (y, x) follows; the 1-D z array lacks y and x and keeps its chunks. The format is
    the source's; every array carries a checksum; values, attributes and names are kept."""
    src, data = volume_store(tmp_path / "src.zarr", zarr_format)
    done = convert(src, tmp_path / "dest.zarr", chunks="y=16,x=100")
    assert isinstance(done, Rechunked) and done.zarr_format == zarr_format
    assert done.chunks_before["field"] == (7, 8, 3) and done.chunks_after["field"] == (7, 16, 10)
    before, after = read(src), read(tmp_path / "dest.zarr")
    assert after["field"].chunks == (7, 16, 10)
    assert after["mask"].chunks == (16, 10) and after["z"].chunks == (30,)
    assert after["field"].metadata.zarr_format == zarr_format
    for name in before:
        assert np.array_equal(after[name][...], before[name][...]), name
        assert after[name].attrs["units"] == f"{name} units"
        assert checksum_of(after[name]) == "zstd checksum"
    dims = (
        list(after["field"].metadata.dimension_names)
        if zarr_format == 3
        else after["field"].attrs["_ARRAY_DIMENSIONS"]
    )
    assert dims == ["z", "y", "x"]
    assert zarr.open_group(str(tmp_path / "dest.zarr"), mode="r").attrs["title"] == "test volume"
    # the engine reads the same samples from both
    old = dfl.io.ZarrSource(str(src), x="field", y="z", shuffle=False).read(np.arange(30))
    new = dfl.io.ZarrSource(str(tmp_path / "dest.zarr"), x="field", y="z", shuffle=False)
    new = new.read(np.arange(30))
    assert np.array_equal(old.x.numpy(), new.x.numpy()) and np.array_equal(old.y, new.y)
    assert np.array_equal(new.x.numpy(), data)


def test_by_axis_without_dimension_names_into_another_format_from_a_url(tmp_path):
    """Axis numbers, lengths clipped to each array's length; arrays with fewer axes keep
    theirs; a file:// URL source; zarr format 2 into 3. PatchSource cuts the same windows."""
    src, data = volume_store(tmp_path / "src.zarr", 2, names=False)
    url = (tmp_path / "src.zarr").as_uri()
    done = rechunk_store(url, tmp_path / "v3.zarr", {0: 1000, 2: 5}, zarr_format=3)
    after = read(tmp_path / "v3.zarr")
    assert done.chunks_after == {"field": (30, 8, 5), "mask": (20, 10), "z": (30,)}
    assert after["field"].chunks == (30, 8, 5) and after["field"].metadata.zarr_format == 3
    assert after["mask"].chunks == (20, 10) and after["z"].chunks == (30,)
    assert np.array_equal(after["field"][...], data)

    def windows(path):
        source = dfl.io.PatchSource(str(path), "field", patch={1: 8, 2: 4}, shuffle=False)
        return source.read(np.arange(source.num_samples)).x.numpy()

    assert np.array_equal(windows(src), windows(tmp_path / "v3.zarr"))
    # no chunks given: the same chunks, now with checksums
    same = rechunk_store(src, tmp_path / "same.zarr")
    assert same.chunks_after == same.chunks_before and same.zarr_format == 2
    assert checksum_of(read(src)["field"]) is None
    assert checksum_of(read(tmp_path / "same.zarr")["field"]) == "zstd checksum"


def test_an_xarray_store_keeps_its_dataset_and_dimension_names(tmp_path):
    xarray = pytest.importorskip("xarray")
    rng = np.random.default_rng(0)
    dataset = xarray.Dataset(
        {
            "t2m": (("time", "lat", "lon"), rng.normal(size=(12, 16, 24)).astype(np.float32)),
            "land": (("lat", "lon"), (rng.random((16, 24)) > 0.5).astype(np.int8)),
        },
        coords={"time": np.arange(12), "lat": np.linspace(-60, 60, 16), "lon": np.arange(24.0)},
        attrs={"source": "test"},
    )
    dataset["t2m"].attrs["units"] = "K"
    for fmt, consolidated in ((2, True), (3, False)):
        src, dest = tmp_path / f"era{fmt}.zarr", tmp_path / f"era{fmt}-rechunked.zarr"
        dataset.chunk({"time": 1}).to_zarr(src, zarr_format=fmt, consolidated=consolidated)
        convert(src, dest, chunks={"time": 6, "lat": 8, "lon": 24})
        back = xarray.open_zarr(dest, consolidated=consolidated)
        assert back.identical(dataset) and back["t2m"].encoding["chunks"] == (6, 8, 24)
        assert back["land"].encoding["chunks"] == (8, 24)
        old = dfl.io.PatchSource(str(src), "t2m", patch={"lat": 8, "lon": 8}, shuffle=False)
        new = dfl.io.PatchSource(str(dest), "t2m", patch={"lat": 8, "lon": 8}, shuffle=False)
        every = np.arange(old.num_samples)
        assert np.array_equal(old.read(every).x.numpy(), new.read(every).x.numpy())


def test_slabs_are_aligned_to_both_chunk_grids_within_the_memory_budget():
    # source chunks 7 and destination 14 along axis 0: slabs of multiples of 14
    assert slab_shape((100, 20), (7, 20), (14, 20), 4, 14 * 20 * 4) == (14, 20)
    assert slab_shape((100, 20), (7, 20), (14, 20), 4, 3 * 14 * 20 * 4) == (42, 20)
    # both grids along every axis when it fits: lcm(3, 5) = 15
    assert slab_shape((60, 60), (3, 60), (5, 60), 1, 30 * 60) == (30, 60)
    # over budget: the destination's grid only, at least one destination chunk
    assert slab_shape((60, 60), (60, 3), (60, 5), 1, 1) == (60, 5)
    # time x lat x lon stored a time step a chunk, into 8^3 chunks, the aligned box (8,
    # 50, 60) just over the budget: lat cut to 40 (each source chunk decoded twice), not
    # to 8 (7 times)
    assert slab_shape((100, 50, 60), (1, 50, 60), (8, 8, 8), 1, 20_000) == (8, 40, 60)
    # a whole array that fits is one slab
    assert slab_shape((8, 8), (3, 3), (5, 5), 1, 10**6) == (8, 8)


def test_a_store_larger_than_the_budget_is_copied_slab_by_slab(tmp_path):
    """A 4 MB array copied with a 0.25 MB budget never holds it whole: the traced peak
    stays a fraction of it."""
    group = zarr.open_group(str(tmp_path / "big.zarr"), mode="w")
    big = group.create_array("v", shape=(256, 4096), chunks=(16, 512), dtype=np.float32)
    big[...] = np.random.default_rng(0).normal(size=(256, 4096)).astype(np.float32)
    tracemalloc.start()
    try:
        rechunk_store(tmp_path / "big.zarr", tmp_path / "out.zarr", {1: 4096}, memory_mb=0.25)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    out = zarr.open_group(str(tmp_path / "out.zarr"), mode="r")["v"]
    assert out.chunks == (16, 4096) and np.array_equal(out[...], big[...])
    assert peak < 2 * 2**20, peak  # the array is 4 MiB


def test_a_missing_source_chunk_is_refused_naming_it_and_nothing_is_written(tmp_path):
    src, _ = volume_store(tmp_path / "src.zarr", 3)
    os.remove(tmp_path / "src.zarr" / "field" / "c" / "1" / "0" / "0")
    dest = tmp_path / "dest.zarr"
    with pytest.raises(ChunkMissingError, match=r"chunk 'field/c/1/0/0' of array 'field'"):
        convert(src, dest, chunks="y=20")
    assert not dest.exists() and sorted(os.listdir(tmp_path)) == ["src.zarr"]
    # an existing destination survives a failed --overwrite
    convert(src, dest, chunks="x=10", x=["mask"])
    with pytest.raises(ChunkMissingError, match="--fill-missing"):
        convert(src, dest, chunks="y=20", overwrite=True)
    assert list(zarr.open_group(str(dest), mode="r").array_keys()) == ["mask"]
    # on purpose: the chunk written as the fill value
    convert(src, dest, chunks="y=20", overwrite=True, fill_missing=True)
    field = zarr.open_group(str(dest), mode="r")["field"]
    assert (field[7:14, :8, :3] == 0).all() and field[7:14, 8:, :].any()
    # sharded sources (read by zarr itself) are checked object by object
    group = zarr.open_group(str(tmp_path / "sharded.zarr"), mode="w")
    sharded = group.create_array("v", shape=(40, 12), chunks=(5, 4), shards=(10, 12), dtype="i4")
    sharded[...] = np.arange(480).reshape(40, 12)
    os.remove(tmp_path / "sharded.zarr" / "v" / "c" / "1" / "0")
    with pytest.raises(ChunkMissingError, match=r"chunk 'v/c/1/0' of array 'v'"):
        convert(tmp_path / "sharded.zarr", tmp_path / "s.zarr", chunks="0=20")


def test_a_corrupt_source_chunk_is_named(tmp_path):
    dfl.io.to_zarr(tmp_path / "src.zarr", np.ones((64, 4, 4), np.float32), chunk_mb=0.001)
    chunk = tmp_path / "src.zarr" / "x" / "c" / "1" / "0" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[-8:] = b"\x00" * 8
    chunk.write_bytes(bytes(raw))
    with pytest.raises(ChunkReadError, match=r"convert: chunk 'x/c/1/0/0' of array 'x'"):
        convert(tmp_path / "src.zarr", tmp_path / "dest.zarr", chunks="0=32")


@pytest.mark.parametrize(
    "options, error, expected",
    [
        ({"chunks": "time=4"}, ConfigError, "has a dimension 'time'; its dimension names are"),
        ({"chunks": "5=4"}, ConfigError, "has axis 5; its arrays have at most 3 axes (0..2)"),
        ({"chunks": "y=0"}, ConfigError, "give DIM=LEN pairs separated by commas"),
        ({"chunks": "y"}, ConfigError, "give DIM=LEN pairs separated by commas"),
        ({"chunks": {"y": 2.5}}, ConfigError, "LEN an integer >= 1"),
        ({"chunks": "y=4", "x": ["nope"]}, dfl.io.VariableNotFoundError, "has no array 'nope'"),
        ({"chunks": "y=4", "sample_dim": 0}, ConfigError, "--sample-dim"),
        ({"chunks": "y=4", "chunk_mb": 4}, ConfigError, "give the new chunks with --chunks"),
    ],
)
def test_mistakes_name_the_field_and_the_fix(tmp_path, options, error, expected):
    src, _ = volume_store(tmp_path / "src.zarr", 3)
    with pytest.raises(error) as caught:
        convert(src, tmp_path / "dest.zarr", **options)
    assert expected in str(caught.value)
    assert not (tmp_path / "dest.zarr").exists()


def test_an_unknown_compressor_is_refused_before_anything_is_written(tmp_path):
    """It was taken for blosc without a word (checksummed_codecs' last branch)."""
    from dataflow.tools.rechunk import rechunk_store

    src, _ = volume_store(tmp_path / "src.zarr", 3)
    with pytest.raises(ConfigError, match=r"rechunk_store\(compressor='lz9'\): use one of"):
        rechunk_store(src, tmp_path / "dest.zarr", "y=4", compressor="lz9")
    assert not (tmp_path / "dest.zarr").exists()


def test_paths_that_are_not_a_store_or_not_free_are_refused(tmp_path):
    src, _ = volume_store(tmp_path / "src.zarr", 3)
    with pytest.raises(SourceFileError, match=r"no zarr store .*nothing.zarr'; check the path"):
        convert(tmp_path / "nothing.zarr", tmp_path / "dest.zarr", chunks="y=4")
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="is a directory but not a zarr store"):
        convert(tmp_path / "plain", tmp_path / "dest.zarr", chunks="y=4")
    (tmp_path / "fake.zarr").mkdir()
    with pytest.raises(DataError, match=r"'.*fake.zarr' is not a zarr store"):
        convert(tmp_path / "fake.zarr", tmp_path / "dest.zarr")
    with pytest.raises(ConfigError, match=r"is SRC .* or inside it"):
        convert(src, src, chunks="y=4", overwrite=True)
    convert(src, tmp_path / "dest.zarr", chunks="y=4")
    with pytest.raises(ConfigError, match=r"already exists; .* pass --overwrite"):
        convert(src, tmp_path / "dest.zarr", chunks="y=4")
    np.save(tmp_path / "a.npy", np.ones((4, 2)))
    with pytest.raises(ConfigError, match=r"rewrite a zarr store, and .* is not one"):
        convert(tmp_path / "a.npy", tmp_path / "b.zarr", chunks="0=2")


def test_the_command_line_rechunks_and_says_how(tmp_path, capsys):
    src, _ = volume_store(tmp_path / "src.zarr", 3)
    dest = tmp_path / "dest.zarr"
    argv = ["convert", str(src), str(dest), "--chunks", "z=30,y=20", "--x", "field"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"wrote {dest} (zarr format 3, checksummed) in" in out
    assert "  field (30, 20, 10): chunks (7, 8, 3) -> (30, 20, 3)" in out
    assert f"check it with: dataflow info {dest}" in out
    assert list(zarr.open_group(str(dest), mode="r").array_keys()) == ["field"]
    assert main(argv) == 1
    assert "already exists; choose another destination, or pass --overwrite" in (
        capsys.readouterr().err
    )
    assert main([*argv, "--overwrite", "--format", "2"]) == 0
    assert zarr.open_group(str(dest), mode="r")["field"].metadata.zarr_format == 2
    assert main(["convert", str(src), str(tmp_path / "e.zarr"), "--chunks", "lat=4"]) == 1
    err = capsys.readouterr().err
    assert "no array of" in err and "dimension 'lat'; its dimension names are" in err
