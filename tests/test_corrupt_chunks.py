"""A chunk whose bytes changed on disk is never trained on.

The damage every test makes: 64 bytes overwritten at offset 100 of one chunk file.
Without a checksum such a chunk may still decode (to values like 8e37); the stores the
library writes carry checksums, so reading it raises ``ChunkReadError`` naming the
chunk, and ``dataflow info --verify`` finds it in stores written elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from conftest import make_data, tiny_pipeline
from distributed import Client

import dataflow as dfl
from dataflow.driver import executor
from dataflow.io.checksums import checksum_of
from dataflow.tools.cli import main

FORMATS = [2, 3]
COMPRESSORS = ["zstd", "blosc", "lz4", "gzip", None]


def damage(chunk: Path) -> None:
    """Overwrite 64 bytes at offset 100 with bytes that are not what was there."""
    data = bytearray(chunk.read_bytes())
    assert len(data) >= 164, f"{chunk} has {len(data)} bytes; the test needs 164"
    data[100:164] = bytes((b + 0x5A) % 256 for b in data[100:164])
    chunk.write_bytes(bytes(data))


def chunk_file(store: Path, array: str, index: int, zarr_format: int) -> Path:
    """The file of chunk ``index`` along the first axis (0 on the others)."""
    ndim = len(zarr.open_array(str(store / array), mode="r").shape)
    if zarr_format == 2:
        return store / array / ".".join([str(index)] + ["0"] * (ndim - 1))
    return store / array / "c" / str(index) / Path(*(["0"] * (ndim - 1)))


def written_store(tmp_path: Path, zarr_format: int, compressor: Any = "zstd") -> Path:
    """make_data(64) in 8 chunks of 8 samples (2 KiB of x each)."""
    x, y = make_data(64)
    path = tmp_path / f"v{zarr_format}.zarr"
    dfl.io.to_zarr(path, x, y, chunk_mb=0.0021, zarr_format=zarr_format, compressor=compressor)
    return path


@pytest.mark.parametrize("compressor", COMPRESSORS)
@pytest.mark.parametrize("zarr_format", FORMATS)
def test_a_damaged_chunk_of_a_written_store_fails_its_read(tmp_path, zarr_format, compressor):
    path = written_store(tmp_path, zarr_format, compressor)
    victim = chunk_file(path, "x", 3, zarr_format)
    key = victim.relative_to(path).as_posix()
    damage(victim)
    source = dfl.io.ZarrSource(path, "x", "y", shuffle=False)
    with pytest.raises(dfl.ChunkReadError) as info:
        list(dfl.io.stream_batches(source, 16))
    message = str(info.value)
    assert f"chunk {key!r} of array 'x'" in message
    assert str(path) in message  # the store
    assert "Re-write" in message and "restore that chunk file" in message
    if compressor != "gzip":  # gzip may fail its inflate before its CRC-32
        assert "checksum does not match" in message
    # the other chunks still read
    x, _ = make_data(64)
    np.testing.assert_array_equal(source.read(np.arange(8, 24)).x.numpy(), x[8:24])


@pytest.mark.parametrize("zarr_format", FORMATS)
def test_the_decode_threads_verify_the_checksum_too(tmp_path, zarr_format):
    path = written_store(tmp_path, zarr_format)
    damage(chunk_file(path, "x", 5, zarr_format))
    reader = dfl.io.EpochChunkReader(
        dfl.io.ZarrSource(path, "x", "y"), [np.arange(64)], decode_threads=3
    )
    assert all(r.decoder is not None for r in reader.source._open())  # io.zarr_decode's path
    with pytest.raises(dfl.ChunkReadError, match=r"chunk 'x/.*5.*checksum does not match"):
        list(reader)


@pytest.mark.parametrize("compressor", COMPRESSORS)
@pytest.mark.parametrize("zarr_format", FORMATS)
def test_every_store_the_writer_makes_carries_checksums(tmp_path, zarr_format, compressor):
    path = written_store(tmp_path, zarr_format, compressor)
    group = zarr.open_group(str(path), mode="r")
    assert checksum_of(group["x"]) is not None and checksum_of(group["y"]) is not None


class _NoCluster(Client):
    """A stand-in client: any use means the fit got past the dry run on the driver."""

    def __init__(self) -> None:
        pass

    def __getattribute__(self, name: str) -> Any:
        raise AssertionError(f"fit() reached the cluster (client.{name})")

    def __del__(self) -> None:
        pass


def test_the_dry_run_stops_at_a_damaged_chunk(tmp_path):
    x, y = make_data(64)
    path = tmp_path / "one.zarr"
    dfl.io.to_zarr(path, x, y)  # one chunk: the dry run's batch reads it
    damage(chunk_file(path, "x", 0, 3))
    pipe = tiny_pipeline(x, y, source=dfl.io.ZarrSource(path, "x", "y"))
    with pytest.raises(dfl.ChunkReadError, match=r"chunk 'x/c/0/0/0/0'.*checksum does not match"):
        pipe.fit(1, client=_NoCluster())


@pytest.mark.slow
def test_a_worker_meeting_a_damaged_chunk_stops_the_fit(client, tmp_path, monkeypatch):
    """The fit stops with the ChunkReadError of the replica that read the damaged chunk,
    naming the chunk. The driver's grace for the other replicas' errors is cut to 1 s:
    the first error is the root cause here, and the default 5 s were pure wait."""
    monkeypatch.setattr(executor, "FAILURE_GRACE_S", 1.0)
    path = written_store(tmp_path, 3)
    damage(chunk_file(path, "x", 6, 3))
    x, y = make_data(64)
    pipe = tiny_pipeline(x, y, source=dfl.io.ZarrSource(path, "x", "y"), dry_run=False)
    with pytest.raises(dfl.ChunkReadError, match=r"chunk 'x/c/6/0/0/0'.*checksum does not match"):
        pipe.fit(epochs=1, client=client)


@pytest.mark.parametrize("zarr_format", FORMATS)
def test_convert_writes_checksums(tmp_path, zarr_format):
    x, y = make_data(64)
    np.savez(tmp_path / "xy.npz", x=x, y=y)
    dest = tmp_path / "out.zarr"
    args = ["convert", str(tmp_path / "xy.npz"), str(dest), "--format", str(zarr_format)]
    assert main([*args, "--chunk-mb", "0.0021"]) == 0
    group = zarr.open_group(str(dest), mode="r")
    assert checksum_of(group["x"]) == "zstd checksum" == checksum_of(group["y"])
    damage(chunk_file(dest, "x", 2, zarr_format))
    with pytest.raises(dfl.ChunkReadError, match="checksum does not match"):
        dfl.io.ZarrSource(dest, "x", "y").read(np.arange(64))


# -- dataflow info --verify: stores written elsewhere, without checksums ------------------


def xarray_store(tmp_path: Path, zarr_format: int, x: np.ndarray | None = None) -> Path:
    """make_data(64) written by xarray in 8 chunks, zstd without a checksum (its v3
    default; v2 asks for it, xarray's v2 default being blosc)."""
    import numcodecs
    import xarray as xr

    data, y = make_data(64)
    x = data if x is None else x
    dataset = xr.Dataset({"x": (("n", "c", "h", "w"), x), "y": (("n",), y)})
    path = tmp_path / f"xr{zarr_format}.zarr"
    encoding = {} if zarr_format == 3 else {"x": {"compressors": [numcodecs.Zstd()]}}
    dataset.chunk({"n": 8}).to_zarr(
        path, zarr_format=zarr_format, consolidated=False, encoding=encoding
    )
    assert checksum_of(zarr.open_group(str(path), mode="r")["x"]) is None
    return path


@pytest.mark.parametrize("zarr_format", FORMATS)
def test_verify_finds_a_damaged_chunk_that_still_decodes(tmp_path, zarr_format, capsys):
    path = xarray_store(tmp_path, zarr_format)
    victim = chunk_file(path, "x", 3, zarr_format)
    damage(victim)
    source = dfl.io.ZarrSource(path, "x", "y")
    assert np.abs(source.read(np.arange(24, 32)).x.numpy()).max() > 1e30  # decodes: garbage
    assert main(["info", str(path), "--verify", "--no-decode"]) == 1
    out = capsys.readouterr().out
    key = victim.relative_to(path).as_posix()
    assert f"PROBLEM: chunk {key!r} of array 'x': its largest magnitude" in out
    assert "no checksums in ['x', 'y']" in out
    assert f"FAILED: 1 problem(s) in {path}" in out
    assert "restore the named chunk files" in out


@pytest.mark.parametrize("zarr_format", FORMATS)
def test_verify_of_a_clean_store_says_ok_with_the_ranges(tmp_path, zarr_format, capsys):
    path = written_store(tmp_path, zarr_format)
    assert main(["info", str(path), "--verify", "--no-decode", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["verify"]
    x, y = make_data(64)
    arrays = {a["name"]: a for a in report["arrays"]}
    assert report["ok"] and report["problems"] == []
    assert arrays["x"]["chunks"] == 8 and arrays["x"]["checksum"] == "zstd checksum"
    assert arrays["x"]["min"] == float(x.min()) and arrays["x"]["max"] == float(x.max())
    assert arrays["x"]["mean"] == pytest.approx(float(x.mean(dtype=np.float64)), rel=1e-12)
    assert (arrays["y"]["min"], arrays["y"]["max"]) == (float(y.min()), float(y.max()))
    assert main(["info", str(path), "--verify", "--no-decode"]) == 0
    out = capsys.readouterr().out
    assert "OK: every chunk present and decoded, every value finite" in out
    assert "no checksums" not in out


def test_verify_names_non_finite_values_and_undecodable_chunks(tmp_path, capsys):
    x, _ = make_data(64)
    x[42, 0, 1, 1] = np.nan  # chunk 5
    path = xarray_store(tmp_path, 3, x)
    truncated = chunk_file(path, "x", 1, 3)
    truncated.write_bytes(truncated.read_bytes()[:50])
    check = dfl.io.verify_store(path)
    assert not check.ok and len(check.problems) == 2
    assert main(["info", str(path), "--verify", "--no-decode"]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM: chunk 'x/c/5/0/0/0' of array 'x': 1 of 512 values are NaN or infinite" in out
    assert "PROBLEM: ZarrSource: chunk 'x/c/1/0/0/0' of array 'x' in store" in out
    assert "could not be read or decoded" in out


def test_verify_reports_a_failed_checksum(tmp_path):
    path = written_store(tmp_path, 3)
    damage(chunk_file(path, "x", 7, 3))
    check = dfl.io.verify_store(path, arrays=["x"])
    assert [a.name for a in check.arrays] == ["x"]
    assert len(check.problems) == 1 and "'x/c/7/0/0/0'" in check.problems[0]
    assert "checksum does not match" in check.problems[0]


def test_a_damaged_chunk_under_a_window_is_named_by_patch_source(tmp_path):
    """A volume read as windows (PatchSource), one storage chunk damaged: its windows
    fail naming the chunk and the store, the source's own name on the message."""
    rng = np.random.default_rng(0)
    volume = rng.normal(size=(32, 32, 32)).astype(np.float32)
    path = tmp_path / "volume.zarr"
    array = zarr.create_array(
        str(path),
        shape=volume.shape,
        chunks=(16, 16, 16),
        dtype=np.float32,
        compressors=zarr.codecs.ZstdCodec(checksum=True),
    )
    array[...] = volume
    damage(path / "c" / "1" / "0" / "1")
    source = dfl.io.PatchSource(path, patch={0: 8, 1: 8, 2: 8}, shuffle=False)
    with pytest.raises(dfl.ChunkReadError) as info:
        list(dfl.io.stream_batches(source, 8, decode_threads=2))
    message = str(info.value)
    assert message.startswith(f"PatchSource: chunk 'c/1/0/1' of array '{path}'"), message
    assert str(path) in message and "checksum does not match" in message
