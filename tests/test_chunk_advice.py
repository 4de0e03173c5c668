"""``dataflow info STORE --patch DIM=LEN,...``: chunks and bytes a window reads, a chunking
that suits the patch, and a rewrite command that produces it (run here, on real stores)."""

from __future__ import annotations

import json
import shlex

import numpy as np
import pytest
import zarr

from dataflow.io.checksums import checksum_of
from dataflow.tools.chunk_advice import suggest_chunks
from dataflow.tools.cli import main


def volume(path, chunks, dimension_names=("z", "y", "x")):
    group = zarr.open_group(str(path), mode="w")
    array = group.create_array(
        "field", shape=(64, 64, 64), chunks=chunks, dtype="float32", dimension_names=dimension_names
    )
    array[...] = np.arange(64**3, dtype=np.float32).reshape(64, 64, 64)
    return path


def advice_of(capsys, *args) -> dict:
    assert main(["info", *map(str, args), "--no-decode", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["patch"]


def run_rewrite(command: str, capsys) -> None:
    """The printed ``dataflow convert ... --chunks ...`` command, run as the CLI runs it."""
    argv = shlex.split(command)
    assert argv[:2] == ["dataflow", "convert"] and "--chunks" in argv, command
    assert main(argv[1:]) == 0
    assert "wrote " in capsys.readouterr().out


def test_small_chunks_are_counted_per_window_and_the_rewrite_gives_chunks_that_suit(
    tmp_path, capsys
):
    """8^3 chunks under 16^3 windows: (1 + 15/8)^3 = 23.8 chunks a window on average, 27
    at most; suggested 64^3 (1 MB), which the printed `dataflow convert` command writes
    (by dimension name), keeping the dimension names, and which info then calls
    suitable."""
    store = volume(tmp_path / "v.zarr", (8, 8, 8))
    advice = advice_of(capsys, store, "--patch", "z=16,y=16,x=16")
    (field,) = advice["arrays"]
    assert field["chunks_per_window_max"] == 27
    assert field["chunks_per_window_mean"] == pytest.approx((1 + 15 / 8) ** 3)
    assert field["bytes_read_per_window"] == pytest.approx((1 + 15 / 8) ** 3 * 8**3 * 4)
    assert field["window_bytes"] == 16**3 * 4 and not field["good"]
    assert field["suggested_chunks"] == [64, 64, 64]
    assert "dimension_names" in field and advice["skipped"] == []
    assert advice["rewrite"] == (
        f"dataflow convert {store} {tmp_path / 'v-rechunked.zarr'} --chunks z=64,y=64,x=64"
    )
    run_rewrite(advice["rewrite"], capsys)
    rewritten = zarr.open_group(str(tmp_path / "v-rechunked.zarr"), mode="r")["field"]
    assert rewritten.chunks == (64, 64, 64)
    assert list(rewritten.metadata.dimension_names) == ["z", "y", "x"]
    assert np.array_equal(rewritten[:2, :3, :4], np.arange(64**3).reshape(64, 64, 64)[:2, :3, :4])
    again = advice_of(capsys, tmp_path / "v-rechunked.zarr", "--patch", "z=16,y=16,x=16")
    assert again["arrays"][0]["good"] and again["rewrite"] is None
    assert (
        main(
            ["info", str(tmp_path / "v-rechunked.zarr"), "--no-decode", "--patch", "z=16,y=16,x=16"]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "field: chunks suit this patch (at most 1 chunk(s) a window" in printed


def test_axes_without_dimension_names_get_a_rewrite_by_axis_and_verify_still_runs(tmp_path, capsys):
    """Dims taken whole should be whole in a chunk: 64 x 8 x 8 chunks under 0=32,1=32
    windows (whole along axis 2: 40 chunks at most) are suggested 64^3 (the patch, doubled
    to 1 MB); the `dataflow convert --chunks 0=64,1=64,2=64` command writes them (with
    checksums); --verify and --patch together give both reports."""
    store = volume(tmp_path / "a.zarr", (64, 8, 8), dimension_names=None)
    advice = advice_of(capsys, store, "--patch", "0=32,1=32")
    (field,) = advice["arrays"]
    assert field["window"] == [32, 32, 64] and field["chunks_per_window_max"] == 1 * 5 * 8
    assert field["suggested_chunks"] == [64, 64, 64] and not field["good"]
    assert advice["rewrite"].endswith("a-rechunked.zarr --chunks 0=64,1=64,2=64")
    run_rewrite(advice["rewrite"], capsys)
    rewritten = zarr.open_group(str(tmp_path / "a-rechunked.zarr"), mode="r")["field"]
    assert rewritten.chunks == (64, 64, 64) and checksum_of(rewritten) == "zstd checksum"
    assert np.array_equal(rewritten[...], zarr.open_group(str(store), mode="r")["field"][...])
    assert main(["info", str(store), "--no-decode", "--verify", "--patch", "0=32,1=32"]) == 0
    printed = capsys.readouterr().out
    assert "suggested for field: chunks (64, 64, 64)" in printed
    assert f"rewrite the store with them:\n  dataflow convert {store} " in printed


def test_patch_mistakes_say_what_to_pass(tmp_path, capsys):
    store = volume(tmp_path / "v.zarr", (32, 32, 32))
    assert main(["info", str(store), "--no-decode", "--patch", "z16"]) == 1
    assert "give DIM=LEN pairs separated by commas" in capsys.readouterr().err
    assert main(["info", str(store), "--no-decode", "--patch", "time=2"]) == 1
    assert "its dimension names are ['x', 'y', 'z']" in capsys.readouterr().err


def test_suggested_chunks_grow_the_shortest_patch_dim_to_a_megabyte_and_stay_under_16():
    # time x lat x lon, windows of 2 x 64 x 64 float32: time grows first
    assert suggest_chunks((1000, 721, 1440), {0: 2, 1: 64, 2: 64}, 4) == [64, 64, 64]
    # a window already over 16 MB is split along its longest patch dim
    assert suggest_chunks((4096, 4096), {0: 4096, 1: 4096}, 4) == [1024, 2048]
    # dims taken whole stay whole
    assert suggest_chunks((10, 512, 512), {1: 256, 2: 256}, 4) == [10, 256, 256]
