"""``dataflow convert SRC.zarr DEST.zarr --dtype x=int16``: a store's arrays copied in a
narrower dtype (counts held as floats: half the bytes to read, decode and copy), each
value checked so that nothing narrowed is silently wrong: a value an integer dtype
cannot hold, or one float16 overflows, stops the copy naming it, with nothing written."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

import dataflow as dfl
from dataflow.core.errors import ConfigError, DataError
from dataflow.io.verify import verify_store
from dataflow.tools.cli import main
from dataflow.tools.convert import convert
from dataflow.tools.info import store_info
from dataflow.tools.narrowing import fill_value_as, narrowed, narrower_integer, parse_dtypes
from dataflow.tools.rechunk import rechunk_store


def counts_store(path, n=12, *, fraction=None):
    """Particle counts held as float32 (as many simulations write them), 2 samples a
    chunk; ``fraction``: one value made non-integral, at sample 7."""
    rng = np.random.default_rng(0)
    x = rng.poisson(4.0, size=(n, 2, 6, 6)).astype(np.float32)
    if fraction is not None:
        x[7, 1, 2, 3] += fraction
    y = rng.normal(size=(n, 3)).astype(np.float32)
    return dfl.io.to_zarr(path, x, y, chunk_mb=2 * x[0].nbytes / 1e6), x, y


def test_the_dtype_flags_parse_and_name_their_array():
    assert parse_dtypes("x=int16, mask=uint8") == {
        "x": np.dtype("int16"),
        "mask": np.dtype("uint8"),
    }
    assert parse_dtypes({"x": "float16"}) == {"x": np.dtype("float16")}
    assert parse_dtypes(None) == {}
    for bad in ("int16", "x=int128", "x=", "=int16", "x=float64"):
        with pytest.raises(ConfigError, match="ARRAY=DTYPE"):
            parse_dtypes(bad)


def test_values_are_cast_only_when_they_fit():
    whole = np.array([[0.0, 3.0], [32767.0, -5.0]], np.float32)
    out, change = narrowed("x", whole, np.dtype("int16"), (10, 0))
    assert out.dtype == np.int16 and out.tolist() == [[0, 3], [32767, -5]] and change == 0.0
    with pytest.raises(DataError, match=r"x\[11, 1\] = .*2\.5.* is not a whole number"):
        narrowed("x", np.array([[0.0, 1.0], [2.0, 2.5]], np.float32), np.dtype("int16"), (10, 0))
    with pytest.raises(DataError, match=r"x\[1\] = .*nan.* not a whole number"):
        narrowed("x", np.array([1.0, np.nan]), np.dtype("int16"), (0,))
    with pytest.raises(DataError, match=r"x\[2\] = .*40000.* outside int16's range"):
        narrowed("x", np.array([1, 2, 40000], np.int32), np.dtype("int16"), (0,))
    with pytest.raises(DataError, match=r"x\[0\] = .*70000.* does not fit in float16"):
        narrowed("x", np.array([7e4, 1.0], np.float32), np.dtype("float16"), (0,))
    out, change = narrowed(
        "x", np.array([1.0, 1.0001, np.inf], np.float32), np.dtype("float16"), (0,)
    )
    assert out.dtype == np.float16 and 0 < change < 1e-3 and np.isinf(out[2])
    assert (
        fill_value_as(np.nan, np.dtype("int16")) == 0 and fill_value_as(0.0, np.dtype("int16")) == 0
    )
    assert fill_value_as(7.0, np.dtype("uint8")) == 7


def test_a_store_of_float_counts_is_copied_as_int16_and_reads_the_same(tmp_path):
    src, x, y = counts_store(tmp_path / "counts.zarr")
    done = rechunk_store(src, tmp_path / "narrow.zarr", dtypes="x=int16", compressor="lz4")
    copy = zarr.open_group(str(done.dest))
    assert copy["x"].dtype == np.int16 and copy["y"].dtype == np.float32
    assert np.array_equal(copy["x"][:], x.astype(np.int16)) and np.array_equal(copy["y"][:], y)
    assert done.narrowed == {"x": ("int16", 0.0)}
    assert "stored as int16 (every value exact)" in done.summary()[0]
    assert verify_store(str(done.dest)).ok  # checksummed like any copy
    source = dfl.io.ZarrSource(str(done.dest), x="x", y="y", shuffle=False)
    batch = source.read(np.arange(5))
    assert batch.x.dtype == torch.int16 and np.array_equal(batch.x.numpy(), x[:5])


def test_a_value_that_does_not_fit_stops_the_copy_naming_it_and_nothing_is_written(tmp_path):
    src, _, _ = counts_store(tmp_path / "counts.zarr", fraction=0.5)
    dest = tmp_path / "narrow.zarr"
    with pytest.raises(DataError, match=r"x\[7, 1, 2, 3\] = .*\.5.* is not a whole number"):
        convert(src, dest, dtypes={"x": "int16"})
    assert not dest.exists() and not any(tmp_path.glob(".narrow.zarr*"))


def test_mistakes_are_refused_before_anything_is_written(tmp_path):
    src, x, _ = counts_store(tmp_path / "counts.zarr")
    with pytest.raises(ConfigError, match="no array 'z' among those copied"):
        convert(src, tmp_path / "a.zarr", dtypes="z=int16")
    np.save(tmp_path / "x.npy", x)
    with pytest.raises(ConfigError, match="convert it first, then the store"):
        convert(tmp_path / "x.npy", tmp_path / "b.zarr", dtypes="x=int16")
    assert not (tmp_path / "a.zarr").exists() and not (tmp_path / "b.zarr").exists()


def test_the_command_line_narrows_and_says_so(tmp_path, capsys):
    src, x, _ = counts_store(tmp_path / "counts.zarr")
    dest = tmp_path / "narrow.zarr"
    assert main(["convert", str(src), str(dest), "--dtype", "x=int16", "--compressor", "lz4"]) == 0
    printed = capsys.readouterr().out
    assert "x (12, 2, 6, 6)" in printed and "stored as int16 (every value exact)" in printed
    assert np.array_equal(zarr.open_group(str(dest))["x"][:], x.astype(np.int16))
    assert main(["convert", str(src), str(tmp_path / "c.zarr"), "--dtype", "int16"]) == 1
    assert "name the array for each dtype" in capsys.readouterr().err


def test_the_smallest_integer_dtype_that_holds_a_range_is_suggested_only_when_narrower():
    assert narrower_integer("float32", 0, 18) == np.dtype("int8")
    assert narrower_integer("float32", 0, 200) == np.dtype("uint8")
    assert narrower_integer("float32", 0, 40000) == np.dtype("uint16")
    assert narrower_integer("float32", -3, 40000) is None  # int32: no fewer bytes
    assert narrower_integer("float32", 0, 70000) is None  # int32 is not narrower
    assert narrower_integer("float64", 0, 70000) == np.dtype("int32")
    assert narrower_integer("float32", 0, 5e9) is None


def test_info_says_when_a_float_array_holds_counts_and_how_to_store_them_narrower(tmp_path):
    src, _, _ = counts_store(tmp_path / "counts.zarr")
    info = store_info(src)
    x, y = info.arrays
    assert x.whole_numbers is not None and x.whole_numbers[0] == "int8" and y.whole_numbers is None
    assert f"`dataflow convert {src} NEW.zarr --dtype x=int8`" in info.format()
    fractional, _, _ = counts_store(tmp_path / "fractional.zarr", fraction=0.5)
    assert store_info(fractional).arrays[0].whole_numbers is None
    narrow = rechunk_store(src, tmp_path / "narrow.zarr", dtypes="x=int8").dest
    assert "--dtype" not in store_info(narrow).format()  # already integers
