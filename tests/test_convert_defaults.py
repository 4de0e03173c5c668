"""``dataflow convert`` never drops arrays of the file without a word."""

from __future__ import annotations

import numpy as np
import pytest
import zarr

import dataflow as dfl
from dataflow.tools.cli import main
from dataflow.tools.convert import convert


def fields(tmp_path, **extra):
    x = np.arange(40 * 4, dtype=np.float32).reshape(40, 4)
    path = tmp_path / "fields.npz"
    np.savez(path, x=x, y=np.arange(40), **extra)
    return path


def test_an_npz_with_more_than_x_and_y_is_refused_listing_its_arrays(tmp_path, capsys):
    src = fields(tmp_path, mask=np.ones((40, 4), dtype=np.float32))
    dest = tmp_path / "out.zarr"
    assert main(["convert", str(src), str(dest)]) == 1
    err = capsys.readouterr().err
    assert "'fields.npz' holds ['x', 'y', 'mask']" in err
    assert "['mask'] dropped" in err and "--x x mask" in err
    assert not dest.exists()  # nothing written in part


def test_naming_the_inputs_converts_them_and_says_what_is_left_out(tmp_path, capsys):
    src = fields(tmp_path, mask=np.ones((40, 4), dtype=np.float32), t=np.arange(40.0))
    dest = tmp_path / "out.zarr"
    assert main(["convert", str(src), str(dest), "--x", "x", "mask"]) == 0
    out = capsys.readouterr().out
    assert "not converted: ['t'] (not named with --x/--y)" in out
    assert sorted(zarr.open_group(str(dest), mode="r").array_keys()) == ["mask", "x", "y"]
    assert convert(src, tmp_path / "b.zarr", x=["x", "mask", "t"]).left_out == ()


def test_an_npz_of_just_x_and_y_still_converts_by_default(tmp_path):
    done = convert(fields(tmp_path), tmp_path / "out.zarr")
    assert done.x == ("x",) and done.y == "y" and done.left_out == ()
    batch = dfl.io.ZarrSource(done.dest, "x", "y").read(np.arange(40))
    np.testing.assert_array_equal(batch.y.numpy(), np.arange(40))


def test_an_x_without_y_and_another_array_is_refused(tmp_path):
    path = tmp_path / "xl.npz"
    np.savez(path, x=np.ones((10, 2)), labels=np.arange(10))
    with pytest.raises(dfl.ConfigError, match=r"\['labels'\] dropped.*--y"):
        convert(path, tmp_path / "out.zarr")
