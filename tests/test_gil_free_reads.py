"""The loader's bulk work runs with the GIL released, and gives the same bytes.

The chunk reader's assembly copies a batch's rows with one Numba call per chunk
(``io.row_copy``) and a zarr v3 ``crc32c`` checksum is verified on the whole stored
``bytes`` object (``io.direct_decode.crc32c_checked``), where zarr's codec holds the GIL.
A host-bound step beside the loader needs the GIL (``benchmarks/bench_loader_gil.py``
measures what it loses). These tests pin the results and the conditions for the GIL-free
paths; none times anything.
"""

from __future__ import annotations

import google_crc32c
import numpy as np
import pytest
from conftest import run_benchmark

import dataflow as dfl
from dataflow.io import direct_decode
from dataflow.io.direct_decode import CRC32C_RESIDUE, crc32c_checked
from dataflow.io.row_copy import SMALL_COPY_BYTES, _kernel, copy_rows

SHAPES = [
    ((3, 64, 64), np.float32),  # small-CNN samples: the kernel, in 8-byte words
    ((), np.int64),  # labels: numpy (too small a copy for a call)
    ((5, 3), np.float16),  # 30-byte rows: 2-byte words
    ((3, 11), np.uint8),  # 33-byte rows: bytes
    ((2, 7), np.complex64),
    ((40, 40), np.bool_),
]


@pytest.mark.parametrize("rows_in_batch", [3, 200])
@pytest.mark.parametrize(("shape", "dtype"), SHAPES, ids=lambda v: str(v))
def test_copy_rows_places_each_row_where_numpy_would(shape, dtype, rows_in_batch):
    rng = np.random.default_rng(0)
    source = (rng.standard_normal((250, *shape)) * 100).astype(dtype)
    rows = rng.integers(0, len(source), rows_in_batch)
    positions = rng.permutation(rows_in_batch)
    out = np.zeros((rows_in_batch, *shape), dtype)
    copy_rows(out, source, rows, positions)
    expected = np.zeros_like(out)
    expected[positions] = source[rows]
    assert np.array_equal(out, expected)


def test_rows_from_several_chunks_fill_a_batch_in_its_order():
    """As the reader uses it: each chunk's rows to their places, the batch whole after."""
    rng = np.random.default_rng(1)
    chunks = [rng.standard_normal((20, 4, 32, 32), dtype=np.float32) for _ in range(3)]
    owner = rng.integers(0, 3, 48)
    rows = rng.integers(0, 20, 48)
    out = np.empty((48, 4, 32, 32), np.float32)
    for c, chunk in enumerate(chunks):
        where = np.flatnonzero(owner == c)
        copy_rows(out, chunk, rows[where], where)
    assert np.array_equal(out, np.stack([chunks[o][r] for o, r in zip(owner, rows, strict=True)]))


def test_views_that_are_not_one_block_or_not_aligned_still_copy_right():
    rng = np.random.default_rng(2)
    base = rng.standard_normal((64, 6, 64), dtype=np.float32)
    strided = base[:, ::2]  # not C-contiguous: numpy's path
    buffer = np.zeros(64 * 3 * 64 * 4 + 1, np.uint8)
    unaligned = buffer[1:].view(np.float32).reshape(64, 3, 64)  # 1 byte off: byte words
    unaligned[...] = strided
    for source in (strided, unaligned):
        out = np.zeros((40, 3, 64), np.float32)
        rows, positions = rng.integers(0, 64, 40), rng.permutation(40)
        copy_rows(out, source, rows, positions)
        assert np.array_equal(out[positions], source[rows])


def test_an_index_out_of_range_raises_and_writes_nothing():
    rng = np.random.default_rng(3)
    source = rng.standard_normal((30, 3, 64, 64), dtype=np.float32)
    assert 8 * source[0].nbytes >= SMALL_COPY_BYTES  # the kernel's path
    out = np.zeros((8, 3, 64, 64), np.float32)
    for rows, positions in [
        ([0, 1, 2, 3, 4, 5, 6, 30], range(8)),  # a row past the chunk
        ([0, 1, 2, 3, 4, 5, 6, -1], range(8)),  # a negative row
        (range(8), [0, 1, 2, 3, 4, 5, 6, 8]),  # a position past the batch
    ]:
        with pytest.raises(IndexError, match="out of range, nothing was copied"):
            copy_rows(out, source, np.array(rows), np.array(positions))
        assert not out.any()
    with pytest.raises(ValueError, match="3 rows but 2 positions"):
        copy_rows(out, source, np.arange(3), np.arange(2))
    with pytest.raises(ValueError, match="cannot go into a batch"):
        copy_rows(out.astype(np.float64), source, np.arange(8), np.arange(8))


def test_the_kernel_is_compiled_to_release_the_gil():
    assert _kernel().targetoptions.get("nogil") is True


def _stored(data: bytes) -> np.ndarray:
    """A stored object as zarr's local store hands it over: a view of its bytes."""
    checksum = np.uint32(google_crc32c.value(data)).tobytes()
    return np.frombuffer(data + checksum, np.uint8)


def test_the_checksum_check_on_whole_bytes_equals_recomputing_the_checksum():
    rng = np.random.default_rng(4)
    data = rng.integers(0, 256, 5000, dtype=np.uint8).tobytes()
    stored = _stored(data)
    inner = crc32c_checked(stored)
    assert inner is not None and inner.tobytes() == data
    for position in (0, 17, 4999, 5000, 5003):  # in the data and in the checksum itself
        damaged = bytearray(stored.tobytes())
        damaged[position] ^= 0x10
        with pytest.raises(ValueError, match="checksum do not match"):
            crc32c_checked(np.frombuffer(bytes(damaged), np.uint8))
    assert crc32c_checked(_stored(b"")) is not None  # (the residue of no data)
    assert CRC32C_RESIDUE == 0x48674BC7


def test_only_a_view_of_a_whole_bytes_object_takes_the_gil_free_check():
    stored = _stored(b"some chunk bytes")
    assert crc32c_checked(stored.copy()) is None  # a numpy array of its own
    assert crc32c_checked(stored[1:]) is None  # part of the bytes
    assert crc32c_checked(np.frombuffer(b"abc", np.uint8)) is None  # too short for a checksum


@pytest.mark.parametrize("compressor", ["lz4", "blosc", None])
def test_a_written_stores_chunks_take_the_gil_free_check(tmp_path, monkeypatch, compressor):
    """Whole chunks (decoded in place) and cut ones (through zarr's codecs) alike. zarr's
    local store hands the decode a view of the object's ``bytes``: if a zarr release
    stops doing so, the check falls back to zarr's codec (holding the GIL), and this test
    says so."""
    x = np.random.default_rng(5).standard_normal((40, 3, 16, 16), dtype=np.float32)
    path = dfl.io.to_zarr(tmp_path / "s.zarr", x, compressor=compressor, chunk_mb=0.05)
    taken = []
    checked = direct_decode.crc32c_checked
    monkeypatch.setattr(
        direct_decode, "crc32c_checked", lambda data: taken.append(checked(data)) or taken[-1]
    )
    source = dfl.io.ZarrSource(path)
    for batch in dfl.io.stream_batches(source, 8, prefetch=1):  # whole chunks, decoded in place
        assert np.array_equal(batch.x.numpy(), x[batch.indices])
    whole = len(taken)
    assert np.array_equal(source.read(np.arange(2, 5)).x, x[2:5])  # a cut chunk: zarr's codecs
    assert whole and len(taken) > whole and all(inner is not None for inner in taken)


@pytest.mark.slow
def test_the_loader_benchmark_runs_every_side_against_the_step_alone(tmp_path):
    """``benchmarks/bench_loader_gil.py --tiny``: each loader and each bulk step beside the
    host-bound step, against the step alone in the same run."""
    run = run_benchmark("bench_loader_gil.py", tmp_path / "gil.json", "--tiny")
    sides = [r["side"] for r in run["results"]]
    assert sides == ["memory", "chunked-memory", "zarr-zstd", "zarr-lz4"]
    assert run["step_alone_per_s"] > 0
    assert all(r["loader_ms_per_batch"] > 0 for r in run["results"])
    assert len(run["primitives_step_kept"]) == 5
