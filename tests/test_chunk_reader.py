"""Each chunk decoded once per epoch, every sample exactly once, bounded memory."""

from collections import Counter

import dask.array as da
import numpy as np
import pytest
from conftest import ObservedReads, run_benchmark
from hypothesis import given, settings
from hypothesis import strategies as st

import dataflow as dfl
from dataflow.io import EpochChunkReader, SampleLedger, ZarrSource, replica_epochs
from dataflow.planning.plan import phase_steps
from dataflow.schedule import PhaseSpec
from dataflow.schedule.balance import proportional_split


class CountingZarrSource(ObservedReads, ZarrSource):
    """A real ZarrSource that counts how often each chunk is decoded."""

    def observe(self, chunks):
        self.decodes = getattr(self, "decodes", Counter())
        self.decodes.update(chunks)


def _steps(n, batch, weights, epochs=1, drop_last=False):
    phase = PhaseSpec(index=0, start_epoch=0, end_epoch=epochs, global_batch=batch)
    return phase_steps(
        num_samples=n,
        phase=phase,
        split=lambda size: proportional_split(size, weights),
        drop_last=drop_last,
    )


@settings(max_examples=60, deadline=None)
@given(
    chunks=st.lists(st.integers(1, 12), min_size=1, max_size=25),  # irregular dask chunks
    width=st.integers(1, 3),
    weights=st.lists(st.integers(0, 4), min_size=1, max_size=4).filter(lambda w: sum(w) > 0),
    batch_fraction=st.floats(0.05, 1.0),
    buffer_chunks=st.integers(1, 4),
    drop_last=st.booleans(),
    seed=st.integers(0, 3),
)
def test_every_sample_once_each_chunk_decoded_once_and_batches_as_planned(
    chunks, width, weights, batch_fraction, buffer_chunks, drop_last, seed
):
    n = sum(chunks)
    data = np.arange(n * width, dtype=np.float32).reshape(n, width)
    source = CountingZarrSource(da.from_array(data, chunks=(tuple(chunks), width)))
    assert np.diff(source.chunk_bounds).tolist() == chunks
    batch = max(1, int(n * batch_fraction))
    steps = _steps(n, batch, weights, epochs=2, drop_last=drop_last)
    ledger = SampleLedger(n)
    for epoch, epoch_steps, parts in replica_epochs(
        steps, sizes=chunks, seed=seed, buffer_chunks=buffer_chunks
    ):
        for rank in range(len(weights)):
            source.decodes = Counter()
            mine = [step_parts[rank] for step_parts in parts]
            reader = EpochChunkReader(source, mine)
            for spec, got in zip(epoch_steps, reader, strict=True):
                assert got.size == spec.local_batches[rank]  # exactly the planned size
                assert np.array_equal(got.x.numpy(), data[got.indices])
                ledger.record(epoch, rank, got.indices)  # refuses any repeat
            assert set(source.decodes.values()) <= {1}  # each chunk decoded at most once
            # Memory: the batch, plus the shuffle groups it spans, plus two cut chunks; and
            # the chunks decoded ahead: at most one batch's first-used chunks per job ahead
            # (decode_ahead jobs, or up to one per thread while they hold fewer chunks).
            group = buffer_chunks * max(chunks)
            biggest = max(spec.local_batches[rank] for spec in epoch_steps)
            live = biggest + 2 * group + 2 * max(chunks)
            jobs = max(reader.decode_ahead, reader.decode_threads)
            ahead = jobs * (biggest + group + 2 * max(chunks))
            assert reader.peak_live_samples <= live + ahead
        planned = sum(spec.global_batch for spec in epoch_steps)
        assert len(ledger.consumed(epoch)) == planned
        if not drop_last:
            assert len(ledger.unused(epoch)) == 0
        else:
            assert len(ledger.unused(epoch)) < batch


def test_a_zarr_store_streams_each_chunk_once_and_matches_random_access(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(103, 2, 4)).astype(np.float32)
    y = rng.integers(0, 5, size=103)
    path = dfl.io.to_zarr(tmp_path / "s.zarr", x, y, chunk_mb=10 * 32 / 1e6)  # 10 per chunk
    source = CountingZarrSource(path, "x", "y")
    batches = list(dfl.io.stream_batches(source, 16, seed=3, buffer_chunks=2))
    assert [b.size for b in batches] == [16] * 6 + [7]
    assert sorted(source.decodes) == list(range(11)) and set(source.decodes.values()) == {1}
    order = np.concatenate([b.indices for b in batches])
    assert sorted(order.tolist()) == list(range(103))
    for b in batches:
        assert np.array_equal(b.x.numpy(), x[b.indices])
        assert np.array_equal(b.y.numpy(), y[b.indices])
        again = source.read(b.indices)
        assert np.array_equal(again.x.numpy(), b.x.numpy())

    def order_of(**options):
        batches = dfl.io.stream_batches(source, 16, buffer_chunks=2, **options)
        return np.concatenate([b.indices for b in batches])

    same_epoch, other_epoch = order_of(seed=3), order_of(seed=3, epoch=1)
    assert np.array_equal(same_epoch, order) and not np.array_equal(other_epoch, order)


def test_a_missing_chunk_raises_before_the_first_batch(tmp_path):
    x = np.ones((40, 3), dtype=np.float32)
    path = dfl.io.to_zarr(tmp_path / "s.zarr", x, chunk_mb=4 * 12 / 1e6)  # 4 per chunk
    (path / "x" / "c" / "7" / "0").unlink()  # samples 28..31
    source = ZarrSource(path, "x", shuffle=False)  # in store order chunk 7 comes late
    stream = dfl.io.stream_batches(source, 4)
    with pytest.raises(dfl.ChunkMissingError, match=r"'x/c/7/0'"):
        next(stream)


def test_ledger_refuses_a_repeat_and_reports_what_was_used():
    ledger = SampleLedger(10)
    ledger.record(0, 0, [3, 1, 2])
    ledger.record(0, 1, [7])
    with pytest.raises(dfl.DataError, match="sample 2 consumed twice in epoch 0"):
        ledger.record(0, 1, [2, 8])
    with pytest.raises(dfl.DataError, match="sample 4 consumed twice"):
        ledger.record(1, 0, [4, 4])
    with pytest.raises(dfl.DataError, match="outside"):
        ledger.record(0, 0, [10])
    assert ledger.consumed(0, 0).tolist() == [1, 2, 3]
    assert ledger.consumed(0).tolist() == [1, 2, 3, 7]
    assert ledger.unused(0).tolist() == [0, 4, 5, 6, 8, 9]
    assert ledger.replicas(0) == [0, 1]
    assert ledger.summary()[0] == {"consumed": 4, "unused": 6}


def test_a_corrupt_chunk_in_the_stream_is_named(tmp_path):
    x = np.ones((40, 3), dtype=np.float32)
    path = dfl.io.to_zarr(tmp_path / "s.zarr", x, chunk_mb=4 * 12 / 1e6)
    (path / "x" / "c" / "3" / "0").write_bytes(b"garbage" * 10)
    with pytest.raises(dfl.ChunkReadError, match=r"'x/c/3/0'.*corrupt"):
        list(dfl.io.stream_batches(ZarrSource(path, "x"), 4))


def _two_epochs(tmp_path, name="s.zarr"):
    """A 103-sample store of 10-sample chunks, and two epochs of its batches of 16."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(103, 2, 4)).astype(np.float32)
    path = dfl.io.to_zarr(tmp_path / name, x, rng.integers(0, 5, 103), chunk_mb=320 / 1e6)
    source = ZarrSource(path, "x", "y")
    orders = [
        [b.indices.copy() for b in dfl.io.stream_batches(source, 16, seed=3, epoch=e)]
        for e in (0, 1)
    ]
    return path, x, orders


def test_the_next_epoch_decodes_its_first_chunks_before_this_one_ends(tmp_path):
    """``then`` (as ``Load`` chains a phase's epochs): once this epoch's chunks are all
    decoded, the next epoch's reads start (its first batch then waits for no round of
    decodes); both epochs' batches are the same as read apart, each chunk decoded once."""
    path, x, orders = _two_epochs(tmp_path)
    first = EpochChunkReader(CountingZarrSource(path, "x", "y"), orders[0], decode_threads=2)
    second_source = CountingZarrSource(path, "x", "y")
    second = EpochChunkReader(second_source, orders[1], decode_threads=2)
    first.then = second
    batches = iter(first)
    got = [next(batches) for _ in orders[0]]  # the whole first epoch taken, not yet ended
    assert second._early is not None and not isinstance(second._early, Exception)
    assert next(batches, None) is None
    got += list(second)
    assert second._early is None  # the early reads were the ones iterated
    assert sorted(second_source.decodes) == list(range(11))
    assert set(second_source.decodes.values()) == {1}
    assert second.decoded == 11
    for batch, indices in zip(got, orders[0] + orders[1], strict=True):
        assert np.array_equal(batch.indices, indices)
        assert np.array_equal(batch.x.numpy(), x[indices])


def test_a_chunk_missing_from_the_next_epoch_fails_it_at_its_start_not_this_one(tmp_path):
    """The next epoch's check runs early, but what it finds is raised where it was
    before: at the next epoch's start, after every batch of this one."""
    path, _, orders = _two_epochs(tmp_path)
    broken, _, _ = _two_epochs(tmp_path, "broken.zarr")
    (broken / "x" / "c" / "4" / "0" / "0").unlink()
    first = EpochChunkReader(ZarrSource(path, "x", "y"), orders[0], decode_threads=2)
    second = EpochChunkReader(ZarrSource(broken, "x", "y"), orders[1], decode_threads=2)
    first.then = second
    assert len(list(first)) == len(orders[0])
    assert isinstance(second._early, dfl.ChunkMissingError)  # found while the first ended
    with pytest.raises(dfl.ChunkMissingError, match=r"'x/c/4/0/0'"):
        next(iter(second))


def test_an_epoch_started_early_and_never_read_stops_its_reads(tmp_path):
    """``close_unread`` (a window aborted before the next epoch): its decode threads end."""
    import threading

    path, _, orders = _two_epochs(tmp_path)
    first = EpochChunkReader(ZarrSource(path, "x", "y"), orders[0], decode_threads=2)
    second = EpochChunkReader(ZarrSource(path, "x", "y"), orders[1], decode_threads=2)
    first.then = second
    assert len(list(first)) == len(orders[0])
    assert second._early is not None
    second.close_unread()
    assert second._early is None
    assert not [t for t in threading.enumerate() if t.name.startswith("dataflow-decode")]


@pytest.mark.slow
def test_the_epoch_chain_benchmark_runs_both_sides(tmp_path):
    """``benchmarks/bench_epoch_chain.py --tiny``: chained and apart epochs per codec,
    each with its first-batch wait and rate against apart's in the same run."""
    run = run_benchmark("bench_epoch_chain.py", tmp_path / "chain.json", "--tiny")
    sides = [(r["codec"], r["side"]) for r in run["results"]]
    assert sides == [("zstd", "apart"), ("zstd", "chained"), ("lz4", "apart"), ("lz4", "chained")]
    for r in run["results"]:
        assert r["first_batch_wait_ms"] >= 0 and r["samples_per_s"] > 0
        assert r["rate_vs_apart"] == 1.0 if r["side"] == "apart" else r["rate_vs_apart"] > 0
