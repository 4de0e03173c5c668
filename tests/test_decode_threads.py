"""Chunks decoded on a pool of threads: the same batches whatever the thread count, the
same errors for missing or corrupt chunks, and the option checked where it is given."""

import threading

import numcodecs
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import zarr
from conftest import ObservedReads, TinyCNN, make_data, max_abs_diff, sgd
from zarr.codecs import BytesCodec, GzipCodec, TransposeCodec

import dataflow as dfl
from dataflow import stages
from dataflow.io import EpochChunkReader, ZarrSource, stream_batches, to_zarr
from dataflow.io import chunk_reader as chunk_reader_module


def _store(tmp_path, compressor="zstd", n=90, per_chunk=4, sample=(3, 5, 5)):
    """Random floats (every bit counts) in chunks of ``per_chunk`` samples."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(n, *sample)).astype(np.float32)
    y = rng.integers(0, 10, size=n)
    sample_bytes = int(np.prod(sample)) * 4
    path = to_zarr(
        tmp_path / f"{compressor}.zarr",
        x,
        y,
        chunk_mb=per_chunk * sample_bytes / 1e6,
        compressor=compressor,
    )
    return path, x, y


def _epoch(source, threads, **options):
    return [
        (b.indices.copy(), b.x.numpy().copy(), b.y.numpy().copy())
        for b in stream_batches(source, 8, seed=3, decode_threads=threads, **options)
    ]


@pytest.mark.parametrize("compressor", ["zstd", "blosc"])
def test_batches_are_bit_identical_with_one_and_three_threads(tmp_path, compressor):
    path, x, y = _store(tmp_path, compressor)
    source = ZarrSource(path, "x", "y")
    assert len(source.chunk_bounds) - 1 == 23  # several chunks: 90 samples, 4 a chunk
    one, three = _epoch(source, 1), _epoch(source, 3)
    assert len(one) == len(three) == 12
    for (i1, x1, y1), (i3, x3, y3) in zip(one, three, strict=True):
        assert np.array_equal(i1, i3)  # the same samples in the same order
        assert x1.tobytes() == x3.tobytes() and y1.tobytes() == y3.tobytes()  # bit for bit
        assert x1.tobytes() == x[i1].tobytes() and np.array_equal(y1, y[i1])
    order = np.concatenate([i for i, _, _ in three])
    assert sorted(order.tolist()) == list(range(90))


def _layouts(tmp_path):
    """Stores the thread-side decoder reads beside zarr's (v2, a transpose, big-endian,
    a chunked sample axis, a sample axis that is not first) and one zarr reads itself
    (sharded). Each: (path, x as stored, sample axis)."""
    x = np.random.default_rng(1).normal(size=(30, 4, 6)).astype(np.float32)
    group = zarr.open_group(tmp_path / "v3.zarr", mode="w")
    arrays = {
        "transposed": dict(
            chunks=(4, 3, 6),
            dtype=">f4",
            serializer=BytesCodec(endian="big"),
            filters=[TransposeCodec(order=(2, 0, 1))],
            compressors=[GzipCodec()],
        ),
        "split": dict(chunks=(7, 2, 4), dtype="f4"),
        "sharded": dict(chunks=(2, 4, 6), shards=(6, 4, 6), dtype="f4"),
    }
    for name, options in arrays.items():
        group.create_array(name, shape=x.shape, **options)[:] = x
    moved = np.ascontiguousarray(np.moveaxis(x, 0, 1))  # samples along axis 1
    group.create_array("axis1", shape=moved.shape, chunks=(4, 5, 6), dtype="f4")[:] = moved
    v2 = zarr.open_array(
        tmp_path / "v2.zarr",
        mode="w",
        shape=x.shape,
        chunks=(5, 4, 6),
        dtype=">f4",
        zarr_format=2,
        order="F",
        compressor=numcodecs.Blosc(),
    )
    v2[:] = x
    return x, {
        "v2": (ZarrSource(tmp_path / "v2.zarr", x=None), True),
        **{name: (ZarrSource(tmp_path / "v3.zarr", name), name != "sharded") for name in arrays},
        "axis1": (ZarrSource(tmp_path / "v3.zarr", "axis1", sample_dim=1), True),
    }


def test_every_layout_reads_the_same_with_threads_as_zarr_does(tmp_path):
    x, sources = _layouts(tmp_path)
    for name, (source, on_threads) in sources.items():
        [reader] = source._open()
        assert (reader.decoder is not None) == on_threads, name
        for threads in (1, 3):
            batches = list(stream_batches(source, 7, seed=1, decode_threads=threads))
            for b in batches:
                assert b.x.numpy().tobytes() == x[b.indices].tobytes(), (name, threads)
            assert sum(b.size for b in batches) == 30
        cut = source.region({0: (1, 3), 1: (2, 5)})  # a region of every sample
        got = cut.read(np.array([29, 0, 13, 14]))
        assert np.array_equal(got.x.numpy(), x[[29, 0, 13, 14], 1:3, 2:5]), name


def test_a_missing_chunk_raises_before_the_first_batch_with_threads(tmp_path):
    x = np.ones((40, 3), dtype=np.float32)
    path = to_zarr(tmp_path / "s.zarr", x, chunk_mb=4 * 12 / 1e6)  # 4 per chunk
    (path / "x" / "c" / "7" / "0").unlink()  # samples 28..31
    source = ZarrSource(path, "x", shuffle=False)
    with pytest.raises(dfl.ChunkMissingError, match=r"'x/c/7/0'.*store is incomplete"):
        next(stream_batches(source, 12, decode_threads=3))


def test_a_chunk_gone_after_the_check_raises_instead_of_fill_values(tmp_path):
    path, x, _ = _store(tmp_path, n=40, per_chunk=4)
    source = ZarrSource(path, "x", "y", shuffle=False)
    batches = [np.arange(i, i + 8) for i in range(0, 40, 8)]
    reader = iter(EpochChunkReader(source, batches, decode_ahead=0, decode_threads=3))
    first = next(reader)  # every chunk checked to exist; chunks 0 and 1 decoded
    assert np.array_equal(first.x.numpy(), x[:8])
    (path / "x" / "c" / "5" / "0" / "0" / "0").unlink()  # samples 20..23: batch 2
    assert np.array_equal(next(reader).x.numpy(), x[8:16])
    with pytest.raises(dfl.ChunkMissingError, match=r"'x/c/5/0/0/0'.*store is incomplete"):
        next(reader)


def test_a_corrupt_chunk_fails_at_its_own_batch_with_threads(tmp_path):
    path, _, _ = _store(tmp_path, n=40, per_chunk=4)
    (path / "x" / "c" / "5" / "0" / "0" / "0").write_bytes(b"garbage" * 10)  # samples 20..23
    source = ZarrSource(path, "x", "y", shuffle=False)
    batches = [np.arange(i, i + 8) for i in range(0, 40, 8)]
    got = []
    with pytest.raises(dfl.ChunkReadError, match=r"'x/c/5/0/0/0'.*corrupt"):
        for batch in EpochChunkReader(source, batches, decode_ahead=3, decode_threads=3):
            got.append(batch.indices.tolist())
    assert got == [list(range(0, 8)), list(range(8, 16))]  # every batch before it


class MeetingSource(ObservedReads, ZarrSource):
    """Its first ``parties`` chunk reads wait for each other: they pass only if that many
    run at once (a barrier, not a clock: a serial decoder breaks it)."""

    def observe(self, chunks):
        if self.barrier.n_waiting < self.barrier.parties and not self.met.is_set():
            self.barrier.wait()
            self.met.set()


def test_three_threads_decode_three_chunks_of_a_batch_at_once(tmp_path):
    path, x, _ = _store(tmp_path, n=40, per_chunk=4)
    source = MeetingSource(path, "x", "y", shuffle=False)
    source.barrier, source.met = threading.Barrier(3, timeout=60), threading.Event()
    batches = [np.arange(0, 12), np.arange(12, 40)]  # 3 new chunks, then 7
    got = list(EpochChunkReader(source, batches, decode_threads=3))
    assert source.met.is_set()
    assert [b.x.numpy().tobytes() for b in got] == [x[:12].tobytes(), x[12:].tobytes()]


def test_decode_threads_is_checked_where_it_is_given(tmp_path):
    path, _, _ = _store(tmp_path, n=8)
    source = ZarrSource(path, "x", "y")
    for bad in (0, -1, True, 2.5, "many", None):
        with pytest.raises(dfl.ConfigError, match=r"Load\(decode_threads=.*int >= 1, or 'auto'"):
            stages.Load(source, decode_threads=bad)
        with pytest.raises(dfl.ConfigError, match=r"EpochChunkReader\(decode_threads="):
            EpochChunkReader(source, [np.arange(4)], decode_threads=bad)
        with pytest.raises(dfl.ConfigError, match=r"stream_batches\(decode_threads="):
            next(stream_batches(source, 4, decode_threads=bad))
    with pytest.raises(dfl.ConfigError, match=r"decode_threads=0"):
        dfl.Pipeline(
            model=TinyCNN,
            loss=F.cross_entropy,
            optimizer=sgd,
            source=source,
            schedule=dfl.schedule.Fixed(4),
            decode_threads=0,
        )
    assert EpochChunkReader(source, [], decode_threads=2).decode_threads == 2


def test_auto_is_at_most_four_of_the_threads_torch_has_here_and_on_a_gpu_the_idle_cores(
    monkeypatch,
):
    before = torch.get_num_threads()
    try:
        for threads, expected in [(1, 1), (3, 3), (8, 4)]:
            torch.set_num_threads(threads)
            assert chunk_reader_module.auto_decode_threads() == expected
            assert chunk_reader_module.auto_decode_threads("cpu") == expected
        # On a GPU the host's cores are shared among the GPUs, less the replica's own
        # thread, up to 16, and at least the torch threads
        torch.set_num_threads(1)
        monkeypatch.setattr(chunk_reader_module.os, "sched_getaffinity", lambda pid: range(16))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
        assert chunk_reader_module.auto_decode_threads("cuda") == 1
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
        assert chunk_reader_module.auto_decode_threads("cuda") == 3
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        assert chunk_reader_module.auto_decode_threads("cuda:0") == 15
        monkeypatch.setattr(chunk_reader_module.os, "sched_getaffinity", lambda pid: range(64))
        assert chunk_reader_module.auto_decode_threads("cuda:0") == 16
        torch.set_num_threads(3)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 32)
        assert chunk_reader_module.auto_decode_threads("cuda:0") == 3
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_training_is_bit_identical_with_one_and_three_decode_threads(client, tmp_path):
    x, y = make_data(64)
    path = to_zarr(tmp_path / "train.zarr", x, y, chunk_mb=0.001)  # many chunks
    models = []
    for threads in (1, 3):
        pipe = dfl.Pipeline(
            model=TinyCNN,
            device="cpu",
            loss=F.cross_entropy,
            optimizer=sgd,
            source=ZarrSource(path, x="x", y="y"),
            schedule=dfl.schedule.Fixed(16),
            progress=False,
            decode_threads=threads,
        )
        result = pipe.fit(epochs=2, client=client)
        assert result.ledger.consumed(1).tolist() == list(range(64))
        models.append(result.model)
    assert max_abs_diff(*models) == 0


@pytest.mark.slow
def test_training_on_whole_chunk_batches_equals_training_on_gathered_ones(client, tmp_path):
    """One sample a chunk: every batch is decoded straight into its buffers on the
    workers (io.direct_batches), against the same samples in chunks of three, gathered.
    Unshuffled, both fits see the same batches: the same model, bit for bit."""
    x, y = make_data(48)
    sample = x[0].nbytes
    models = []
    for per_chunk in (3, 1):
        path = to_zarr(tmp_path / f"{per_chunk}.zarr", x, y, chunk_mb=per_chunk * sample / 1e6)
        source = ZarrSource(path, x="x", y="y", shuffle=False)
        assert np.diff(source.chunk_bounds).max() == per_chunk
        pipe = dfl.Pipeline(
            model=TinyCNN,
            device="cpu",
            loss=F.cross_entropy,
            optimizer=sgd,
            source=source,
            schedule=dfl.schedule.Fixed(12),
            progress=False,
            decode_threads=2,
        )
        result = pipe.fit(epochs=2, client=client)
        assert result.ledger.consumed(1).tolist() == list(range(48))
        models.append(result.model)
    assert max_abs_diff(*models) == 0
