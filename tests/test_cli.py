import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr

import dataflow as dfl
from dataflow.tools.cli import build_parser, main
from dataflow.tools.convert import convert
from dataflow.tools.info import store_info

COMMANDS = ("demo", "convert", "info", "report")


@pytest.mark.slow
def test_demo_trains_and_writes_history_and_report(tmp_path, capsys):
    out = tmp_path / "demo"
    code = main(
        [
            "demo",
            "--samples",
            "256",
            "--eval-samples",
            "64",
            "--epochs",
            "2",
            "--batch",
            "32",
            "--workers",
            "2",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "held-out accuracy" in printed and "trained 2 epoch(s)" in printed
    assert str(out / "report" / "report.md") in printed
    history = json.loads((out / "history.json").read_text())
    assert [e["epoch"] for e in history["epochs"]] == [0, 1]
    assert history["info"]["replicas"] == 2
    assert [p["global_batch"] for p in history["phases"]] == [32, 64]  # a growing batch
    assert (out / "model.pt").exists()
    for name in ("training.png", "schedule.png", "replicas.png", "step_time.png", "steps.csv"):
        assert (out / "report" / name).stat().st_size > 0


def test_help_lists_every_command():
    text = build_parser().format_help()
    assert all(command in text for command in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: dataflow {command}" in capsys.readouterr().out


@pytest.mark.parametrize("command", [[], *([c] for c in COMMANDS)])
def test_help_from_a_fresh_process(command):
    """``python -m dataflow.tools.cli [COMMAND] --help`` in a new interpreter: the module imports
    and parses on its own (each launch imports torch and dask: a few seconds)."""
    done = subprocess.run(
        [sys.executable, "-m", "dataflow.tools.cli", *command, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"usage: dataflow {' '.join(command)}".strip() in done.stdout


def test_the_installed_script_runs():
    script = shutil.which("dataflow")
    if script is None:
        pytest.skip("the dataflow console script is not on PATH (pip install -e . installs it)")
    done = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert all(command in done.stdout for command in COMMANDS)


def fields(n: int = 30, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 2, 6, 5)).astype(np.float32), rng.integers(0, 4, size=n)


def read_all(source) -> tuple[np.ndarray, np.ndarray | None]:
    batch = source.read(np.arange(source.num_samples))
    return batch.x.numpy(), None if batch.y is None else batch.y.numpy()


def test_convert_round_trips_a_netcdf_file(tmp_path, capsys):
    xarray = pytest.importorskip("xarray")
    x, _ = fields()
    params = np.random.default_rng(1).normal(size=(30, 2))
    dataset = xarray.Dataset(
        {
            "density": (("time", "channel", "lat", "lon"), x),
            "params": (("time", "param"), params),
            "mask": (("lat", "lon"), np.ones((6, 5), np.float32)),  # no sample dimension
        },
        coords={"time": np.arange("2000-01-01", 30, dtype="datetime64[D]")},
        attrs={"title": "a simulation"},
    )
    dataset["density"].attrs.update(units="g cm-3", long_name="density")
    src = tmp_path / "sim.nc"
    try:
        dataset.to_netcdf(src)
    except ValueError:
        pytest.skip("no netCDF writer for xarray (netCDF4, h5netcdf or scipy)")
    dest = tmp_path / "sim.zarr"
    args = ["convert", str(src), str(dest), "--x", "density", "--y", "params"]
    assert main([*args, "--sample-dim", "time", "--chunk-mb", "0.002"]) == 0
    printed = capsys.readouterr().out
    assert "sample_dim='time'" in printed and "dataflow info" in printed
    group = zarr.open_group(str(dest), mode="r")
    assert sorted(group.array_keys()) == ["density", "params", "time"]  # time: a coordinate
    density = group["density"]
    assert density.metadata.dimension_names == ("time", "channel", "lat", "lon")
    assert density.chunks[1:] == (2, 6, 5) and density.chunks[0] < 30  # whole samples
    source = dfl.io.ZarrSource(str(dest), x="density", y="params", sample_dim="time")
    got_x, got_y = read_all(source)
    np.testing.assert_array_equal(got_x, x)
    np.testing.assert_allclose(got_y, params)
    reopened = xarray.open_zarr(dest, consolidated=False)
    np.testing.assert_array_equal(reopened["density"].values, x)
    # coordinates and attributes kept: a split by date, as on the netCDF file
    split = reopened.sel(time=slice("2000-01-11", "2000-01-20"))
    np.testing.assert_array_equal(split["density"].values, x[10:20])
    assert reopened["density"].attrs == {"units": "g cm-3", "long_name": "density"}
    assert reopened.attrs == {"title": "a simulation"}
    assert main(["info", str(dest)]) == 0
    assert "30 samples along axis 0" in capsys.readouterr().out  # (time: a coordinate)


def test_convert_finds_the_sample_dimension_and_every_variable(tmp_path):
    xarray = pytest.importorskip("xarray")
    x, y = fields()
    dataset = xarray.Dataset({"a": (("n", "h", "w"), x[:, 0]), "b": (("n",), y)})
    src = tmp_path / "small.nc"
    try:
        dataset.to_netcdf(src)
    except ValueError:
        pytest.skip("no netCDF writer for xarray (netCDF4, h5netcdf or scipy)")
    done = convert(src, tmp_path / "small.zarr", chunk_mb=0.001)
    assert done.sample_dim == "n" and done.x == ("a", "b") and done.y is None
    assert done.shapes == {"a": (30, 6, 5), "b": (30,)}


def test_convert_round_trips_npy_and_npz(tmp_path, capsys):
    x, y = fields()
    np.save(tmp_path / "x.npy", x)
    assert main(["convert", str(tmp_path / "x.npy"), str(tmp_path / "a.zarr")]) == 0
    np.testing.assert_array_equal(
        read_all(dfl.io.ZarrSource(str(tmp_path / "a.zarr"), x="x"))[0], x
    )

    np.savez(tmp_path / "xy.npz", images=x, labels=y, other=x[:, 0])
    dest = tmp_path / "b.zarr"
    args = ["convert", str(tmp_path / "xy.npz"), str(dest), "--x", "images", "--y", "labels"]
    assert main([*args, "--chunk-mb", "0.001"]) == 0
    assert "ZarrSource(" in capsys.readouterr().out
    got_x, got_y = read_all(dfl.io.ZarrSource(str(dest), x="images", y="labels"))
    np.testing.assert_array_equal(got_x, x)
    np.testing.assert_array_equal(got_y, y)
    assert zarr.open_array(str(dest / "images"), mode="r").chunks[1:] == (2, 6, 5)


def test_convert_writes_the_codec_asked_for_from_a_file_and_from_a_store(tmp_path):
    """--compressor lz4 (to feed a GPU from large fields): the file's arrays and a zarr
    store's rewrite both carry blosc's lz4 with its crc32c, and read back the same."""
    x, y = fields()
    np.savez(tmp_path / "f.npz", x=x, y=y)
    argv = ["convert", str(tmp_path / "f.npz"), str(tmp_path / "f.zarr"), "--compressor", "lz4"]
    assert main(argv) == 0
    argv = ["convert", str(tmp_path / "f.zarr"), str(tmp_path / "g.zarr"), "--compressor", "lz4"]
    assert main(argv) == 0
    for store in ("f.zarr", "g.zarr"):
        array = zarr.open_group(str(tmp_path / store), mode="r")["x"]
        names = [type(c).__name__ for c in array.compressors]
        assert names == ["BloscCodec", "Crc32cCodec"], (store, names)
        assert array.compressors[0].cname.value == "lz4"
        np.testing.assert_array_equal(array[:], x)
    with pytest.raises(dfl.ConfigError, match=r"convert\(compressor='lz9'\): use one of"):
        convert(tmp_path / "f.npz", tmp_path / "h.zarr", compressor="lz9")
    assert not (tmp_path / "h.zarr").exists()


def test_convert_moves_a_sample_axis_that_is_not_first(tmp_path):
    x, _ = fields()
    np.save(tmp_path / "last.npy", np.moveaxis(x, 0, -1))  # samples along the last axis
    convert(tmp_path / "last.npy", tmp_path / "m.zarr", sample_dim="3")
    np.testing.assert_array_equal(
        read_all(dfl.io.ZarrSource(str(tmp_path / "m.zarr"), x="x"))[0], x
    )


def test_convert_reads_hdf5_datasets_by_path(tmp_path):
    h5py = pytest.importorskip("h5py")
    x, y = fields()
    with h5py.File(tmp_path / "data.h5", "w") as f:
        f["inputs/fields"] = x
        f["labels"] = y
    done = convert(tmp_path / "data.h5", tmp_path / "h.zarr", x=["inputs/fields"], y="labels")
    assert done.x == ("fields",) and done.y == "labels"
    source = dfl.io.ZarrSource(
        str(tmp_path / "h.zarr"), x="fields", y="labels", sample_dim="sample"
    )
    got_x, got_y = read_all(source)
    np.testing.assert_array_equal(got_x, x)
    np.testing.assert_array_equal(got_y, y)


@pytest.mark.parametrize(
    ("name", "options", "expected"),
    [
        ("missing.npz", [], "no file"),
        ("data.txt", [], "unknown extension '.txt'; supported: .cdf, .h5"),
        ("xy.npz", ["--x", "nope"], "no variable 'nope'; it holds ['images', 'labels', 'other']"),
        ("xy.npz", [], "name the input variable(s) with --x"),
        ("xy.npz", ["--x", "images", "--sample-dim", "time"], "must be an axis number"),
        ("xy.npz", ["--x", "images", "--sample-dim", "7"], "out of range for 'images'"),
        ("x.npy", ["--y", "labels"], "holds one array"),
    ],
)
def test_convert_errors_name_the_problem_and_the_fix(tmp_path, capsys, name, options, expected):
    x, y = fields()
    np.save(tmp_path / "x.npy", x)
    np.savez(tmp_path / "xy.npz", images=x, labels=y, other=x[:, 0])
    (tmp_path / "data.txt").write_text("1 2 3")
    code = main(["convert", str(tmp_path / name), str(tmp_path / "out.zarr"), *options])
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("dataflow: error: convert") and expected in err
    assert not (tmp_path / "out.zarr").exists()


def test_convert_refuses_to_overwrite_unless_asked(tmp_path):
    x, _ = fields()
    np.save(tmp_path / "x.npy", x)
    convert(tmp_path / "x.npy", tmp_path / "a.zarr")
    with pytest.raises(dfl.errors.ConfigError, match=r"already exists.*--overwrite"):
        convert(tmp_path / "x.npy", tmp_path / "a.zarr")
    convert(tmp_path / "x.npy", tmp_path / "a.zarr", overwrite=True)
    (tmp_path / "notes").mkdir()
    with pytest.raises(dfl.errors.ConfigError, match="not a zarr store"):
        convert(tmp_path / "x.npy", tmp_path / "notes", overwrite=True)


def test_convert_names_the_package_a_missing_reader_needs(tmp_path, monkeypatch):
    xarray = pytest.importorskip("xarray")
    src = tmp_path / "sim.nc"
    try:
        xarray.Dataset({"a": (("n",), np.arange(4.0))}).to_netcdf(src)
    except ValueError:
        pytest.skip("no netCDF writer for xarray (netCDF4, h5netcdf or scipy)")
    monkeypatch.setitem(sys.modules, "xarray", None)  # as if it were not installed
    with pytest.raises(ImportError, match="pip install xarray"):
        convert(src, tmp_path / "a.zarr")


def write_store(path: Path, n: int = 100) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 1, 8, 8)).astype(np.float32)
    dfl.io.to_zarr(path, x, rng.integers(0, 3, size=n), chunk_mb=0.003)


def test_info_reports_the_store(tmp_path, capsys):
    store = tmp_path / "s.zarr"
    write_store(store)
    assert main(["info", str(store), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    arrays = {a["name"]: a for a in info["arrays"]}
    assert arrays["x"]["shape"] == [100, 1, 8, 8] and arrays["y"]["shape"] == [100]
    assert arrays["x"]["dtype"] == "float32" and arrays["y"]["dtype"] == "int64"
    assert arrays["x"]["chunks"] == [11, 1, 8, 8]  # 0.003 MB of 256-byte samples
    assert arrays["x"]["chunks_total"] == 10 and arrays["x"]["chunks_missing"] == 0
    assert arrays["x"]["codecs"] == ["zstd(level=3)"]
    assert arrays["x"]["bytes_in_memory"] == 100 * 64 * 4
    assert 0 < arrays["x"]["bytes_stored"] < 2 * 100 * 64 * 4
    assert info["samples"] == 100 and info["chunks_missing"] == 0
    assert info["decode_samples_per_second"] > 0

    assert main(["info", str(store)]) == 0
    text = capsys.readouterr().out
    assert "100 samples along axis 0" in text and "(11, 1, 8, 8)" in text
    assert "samples/s" in text and "WARNING" not in text


def test_info_counts_a_deleted_chunk_as_missing(tmp_path, capsys):
    store = tmp_path / "s.zarr"
    write_store(store)
    (store / "x" / "c" / "3" / "0" / "0" / "0").unlink()
    info = store_info(store, decode_budget_s=0.05)
    x = next(a for a in info.arrays if a.name == "x")
    assert x.chunks_missing == 1 and x.missing_examples == ["x/c/3/0/0/0"]
    assert main(["info", str(store), "--no-decode"]) == 0
    assert "WARNING: 1 chunk(s) are missing (e.g. ['x/c/3/0/0/0'])" in capsys.readouterr().out


def test_info_by_dimension_name_and_its_errors(tmp_path, capsys):
    xarray = pytest.importorskip("xarray")
    dataset = xarray.Dataset(
        {"v": (("time", "k"), np.ones((12, 3))), "static": (("k",), np.arange(3.0))}
    )
    dfl.io.to_zarr(tmp_path / "d.zarr", dataset, sample_dim="time", chunk_mb=0.0001)
    info = store_info(tmp_path / "d.zarr", sample_dim="time", decode_budget_s=0)
    assert info.samples == 12 and [a.name for a in info.arrays] == ["v"]
    assert main(["info", str(tmp_path / "d.zarr"), "--sample-dim", "depth"]) == 1
    assert "no array of" in capsys.readouterr().err
    assert main(["info", str(tmp_path / "nowhere.zarr")]) == 1
    assert "no zarr store at" in capsys.readouterr().err


def test_report_writes_the_report_beside_the_history(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from test_report import adaptive_history

    path = adaptive_history().to_json(tmp_path / "run" / "history.json")
    assert main(["report", str(path)]) == 0
    assert str(tmp_path / "run" / "report" / "report.md") in capsys.readouterr().out
    for name in ("report.md", "training.png", "schedule.png", "replicas.png", "steps.csv"):
        assert (tmp_path / "run" / "report" / name).stat().st_size > 0
    assert main(["report", str(tmp_path / "none.json"), "--out", str(tmp_path)]) == 1
    assert "no history file" in capsys.readouterr().err


def test_plot_is_still_the_report(tmp_path, capsys):
    """``plot``, the command's first name, still works: older instructions use it."""
    pytest.importorskip("matplotlib")
    from test_report import adaptive_history

    path = adaptive_history().to_json(tmp_path / "history.json")
    assert main(["plot", str(path), "--out", str(tmp_path / "old")]) == 0
    assert (tmp_path / "old" / "report.md").stat().st_size > 0
    assert "report (plot)" in build_parser().format_help()


UNGUARDED_SCRIPT = """
import numpy as np, torch, torch.nn.functional as F
import dataflow as dfl
x = np.zeros((8, 1, 4, 4), np.float32); y = np.zeros(8, np.int64)
dfl.Pipeline(model=lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 2)),
             loss=F.cross_entropy, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
             source=dfl.io.ArraySource(x, y), schedule=dfl.schedule.Fixed(4)).fit(epochs=1)
"""


@pytest.mark.slow
def test_script_without_main_guard_gets_a_clear_error(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(UNGUARDED_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert done.returncode != 0
    # named before any worker process starts (it took the nanny's 13-23 s timeout before)
    assert f"ConfigError: {script}, line 7: this starts an embedded LocalCluster" in done.stderr
    assert 'if __name__ == "__main__":' in done.stderr
    assert "Nanny failed to start" not in done.stderr
