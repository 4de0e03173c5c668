"""Reused output buffers never overwrite a batch someone still holds; the concurrent,
ahead-of-time decode still decodes each chunk once, and fails at the right batch."""

import gc
import threading
import time
from collections import Counter

import numpy as np
import pytest
from conftest import ObservedReads

import dataflow as dfl
from dataflow.io import EpochChunkReader, ZarrSource, stream_batches, to_zarr
from dataflow.io.batch_buffers import BatchBuffers


class CountingZarrSource(ObservedReads, ZarrSource):
    """A real ZarrSource that records every decode request."""

    def observe(self, chunks):
        self.requests.append(sorted(chunks))  # list.append: safe from several threads


def _store(tmp_path, n=120, sample=(64, 64), per_chunk=5):
    """Sample ``i`` holds the value ``i`` everywhere: any overwrite shows."""
    values = np.arange(n, dtype=np.float32).reshape(n, *([1] * len(sample)))
    x = np.broadcast_to(values, (n, *sample)).copy()
    y = np.arange(n, dtype=np.int64) * 10
    sample_bytes = int(np.prod(sample)) * 4
    path = to_zarr(tmp_path / "s.zarr", x, y, chunk_mb=per_chunk * sample_bytes / 1e6)
    return path, x, y


def _memory(tensor):
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


def _overlap(a, b):
    return a[0] < b[1] and b[0] < a[1]


@pytest.mark.parametrize("sample", [(64, 64), (3,)], ids=["large-samples", "small-samples"])
def test_a_held_batch_and_its_views_stay_unchanged_while_later_batches_reuse_buffers(
    tmp_path, sample
):
    path, x, y = _store(tmp_path, sample=sample)
    kept, expected, memory, later = [], [], [], []
    for k, batch in enumerate(stream_batches(ZarrSource(path, "x", "y"), 8, prefetch=1)):
        assert np.array_equal(batch.x.numpy(), x[batch.indices])
        if k == 2:  # hold the batch itself
            kept.append(batch)
            expected.append(x[batch.indices])
            memory.append(_memory(batch.x))
        elif k == 4:  # hold only a view of x, and a numpy array made from y
            kept += [batch.x[1:3], batch.y.numpy()[::2]]
            expected += [x[batch.indices][1:3], y[batch.indices][::2]]
            memory.append(_memory(batch.x))
        elif k > 4:
            later.append(_memory(batch.x))
        del batch
    assert len(later) >= 8
    # No later batch was written into memory a held batch or view still lives in.
    assert not any(_overlap(m, other) for m in memory for other in later)
    got = [kept[0].x.numpy(), kept[1].numpy(), kept[2]]
    for value, want in zip(got, expected, strict=True):
        assert np.array_equal(value, want)


def test_keeping_every_batch_keeps_every_batch_intact(tmp_path):
    path, x, y = _store(tmp_path, n=60)
    batches = list(stream_batches(ZarrSource(path, "x", "y"), 7, seed=2))
    for b in batches:
        assert np.array_equal(b.x.numpy(), x[b.indices])
        assert np.array_equal(b.y.numpy(), y[b.indices])
    spans = [_memory(b.x) for b in batches]
    assert not any(_overlap(a, b) for i, a in enumerate(spans) for b in spans[i + 1 :])


def test_a_buffer_is_reused_only_when_nothing_refers_to_it():
    buffers = BatchBuffers(keep=3)
    shape, dtype = (4, 5), np.dtype(np.float32)
    t = buffers.take(10, shape, dtype)[0]
    first = _memory(t)
    del t
    gc.collect()
    t = buffers.take(10, shape, dtype)[0]
    assert _memory(t) == first and buffers.reused == 1  # dropped: reused
    holders = [
        lambda t: t[2:4],  # a view
        lambda t: t.numpy(),  # a numpy array
        lambda t: t.reshape(-1),
        lambda t: t.__dlpack__(),  # a DLPack capsule
        lambda t: t.untyped_storage(),
    ]
    for make in holders:
        held = make(t)
        del t
        t = buffers.take(10, shape, dtype)[0]
        assert not _overlap(_memory(t), first), make  # still referred to: not handed out
        del t, held
        t = buffers.take(10, shape, dtype)[0]
        assert _memory(t) == first  # released: the first buffer again
    # Batches of another size: a buffer holds n to 2n samples of a batch of n.
    del t
    small = buffers.take(4, shape, dtype)[0]
    assert not _overlap(_memory(small), first)  # 10 rows is more than twice 4
    del small
    mid = buffers.take(6, shape, dtype)[0]
    assert _memory(mid)[0] == first[0] and mid.shape == (6, *shape)


def test_the_pool_keeps_at_most_keep_buffers_and_allocates_beyond():
    buffers = BatchBuffers(keep=2)
    held = [buffers.take(3, (2,), np.dtype(np.int64))[0] for _ in range(5)]
    assert buffers.allocated == 5 and buffers.reused == 0
    del held
    again = [buffers.take(3, (2,), np.dtype(np.int64))[0] for _ in range(3)]
    assert buffers.reused == 2 and buffers.allocated == 6  # 2 kept ones, then a new one
    assert all(t.shape == (3, 2) for t in again)


@pytest.mark.parametrize("threads", [1, 3])
def test_each_batch_decodes_its_new_chunks_in_one_request_each_chunk_once(tmp_path, threads):
    path, x, _ = _store(tmp_path, n=200, per_chunk=4)  # 50 chunks
    source = CountingZarrSource(path, "x", "y")
    source.requests = []
    order = np.random.default_rng(0).permutation(200)  # any order: chunks scattered
    batches = [order[i : i + 24] for i in range(0, 200, 24)]
    reader = EpochChunkReader(source, batches, decode_ahead=2, decode_threads=threads)
    for got, want in zip(reader, batches, strict=True):
        assert np.array_equal(got.x.numpy(), x[want])
        del got
    decodes = Counter(c for request in source.requests for c in request)
    assert sorted(decodes) == list(range(50)) and set(decodes.values()) == {1}
    assert reader.decoded == 50
    # zip's result tuple still holds batch k while batch k+1 is assembled, so x and y
    # alternate between two buffers each; only the short last batch needs a new one.
    assert reader.buffers.reused == 2 * (len(batches) - 3)
    assert reader.buffers.allocated == 2 * 3
    assert len(source.requests) == reader.requests
    if threads == 1:  # one request per batch at most
        assert reader.requests <= len(batches)
        scattered = [r for r in source.requests if len(r) > 1 and np.diff(r).max() > 1]
        assert scattered  # non-consecutive chunks went together into one request
    else:  # one chunk per request, the threads decode a batch's chunks at once
        assert sorted(source.requests) == [[c] for c in range(50)]


def test_stopping_early_stops_the_decode_thread(tmp_path):
    path, _, _ = _store(tmp_path, n=100, per_chunk=2)
    source = ZarrSource(path, "x", "y", shuffle=False)
    batches = [np.arange(i, i + 4) for i in range(0, 100, 4)]
    stream = iter(EpochChunkReader(source, batches, decode_ahead=1))
    next(stream)
    assert any(t.name.startswith("dataflow-decode") for t in threading.enumerate())
    stream.close()
    assert not any(t.name.startswith("dataflow-decode") for t in threading.enumerate())


def test_a_chunk_that_fails_to_decode_ahead_fails_at_its_own_batch(tmp_path):
    path, _, _ = _store(tmp_path, n=40, per_chunk=4)
    (path / "x" / "c" / "5" / "0" / "0").write_bytes(b"garbage" * 10)  # samples 20..23
    source = ZarrSource(path, "x", "y", shuffle=False)
    batches = [np.arange(i, i + 4) for i in range(0, 40, 4)]
    reader = EpochChunkReader(source, batches, decode_ahead=3)
    got = []
    with pytest.raises(dfl.ChunkReadError, match=r"'x/c/5/0/0'"):
        for batch in reader:
            got.append(batch.indices.tolist())
    assert got == [list(range(i, i + 4)) for i in range(0, 20, 4)]  # every batch before it


def test_decoding_ahead_stays_within_its_memory_bound(tmp_path):
    path, _, _ = _store(tmp_path, n=240, per_chunk=6)
    source = ZarrSource(path, "x", "y")
    buffer_chunks, group, chunk = 2, 2 * 6, 6
    [order] = dfl.io.shard_epoch([6] * 40, [240], seed=1, epoch=0, buffer_chunks=buffer_chunks)
    for batch, ahead in [(4, 3), (10, 2), (30, 1)]:
        batches = [order[i : i + batch] for i in range(0, 240, batch)]
        reader = EpochChunkReader(source, batches, decode_ahead=ahead)
        for b in reader:  # a slow consumer: the decoder gets as far ahead as it may
            del b
            time.sleep(0.005)
        live = batch + 2 * group + 2 * chunk  # the shuffle groups a batch spans, cut chunks
        new_per_batch = batch + group + 2 * chunk  # at most, one batch's first-used chunks
        jobs = max(ahead, reader.decode_threads)  # or one per thread with fewer chunks
        assert reader.peak_live_samples <= live + jobs * new_per_batch
