"""The decoded-chunk cache's policy (``io.chunk_cache``): with an epoch's plan, each chunk
is kept only while a later read needs it and the one needed furthest ahead goes first
(Belady); counted, never timed."""

from __future__ import annotations

import threading

import numpy as np
import zarr

import dataflow as dfl
from dataflow.io.chunk_cache import ChunkCache, Decoding


def _epoch(cache: ChunkCache, reads: list[list[str]], planned: bool = True) -> list[str]:
    """Each read (one unit per job, in order) through the cache; the keys decoded."""
    jobs = [[u] for u in range(len(reads))]
    plan = cache.plan(jobs, dict(enumerate(reads))) if planned else None
    decoded = []
    for unit, keys in enumerate(reads):
        if plan is not None:
            with plan.reading([unit]):
                decoded += _read(cache, keys)
        else:
            decoded += _read(cache, keys)
        assert cache.nbytes <= cache.max_bytes
    if plan is not None:
        plan.close()
    return decoded


def _read(cache: ChunkCache, keys: list[str]) -> list[str]:
    decoded = []
    for key in keys:
        if cache.acquire(key) is None:
            decoded.append(key)
            cache.put(key, np.zeros(1, np.uint8))  # one byte a chunk
    return decoded


def test_a_planned_epoch_evicts_the_chunk_needed_furthest_ahead():
    reads = [["a"], ["b"], ["c"], ["a"], ["b"], ["c"]]
    # two bytes: c is needed after a and b again, so c is not kept (Belady)
    assert _epoch(ChunkCache(2), reads) == ["a", "b", "c", "c"]
    # least recently used (no plan): every read misses
    assert _epoch(ChunkCache(2), reads, planned=False) == ["a", "b", "c", "a", "b", "c"]
    # the budget allows: each chunk decoded once
    assert _epoch(ChunkCache(3), reads) == ["a", "b", "c"]
    # a kept chunk whose next use is further than the new one's makes room for it
    reads = [["a"], ["b"], ["c"], ["c"], ["b"], ["a"]]
    assert _epoch(ChunkCache(2), reads) == ["a", "b", "c", "a"]


def test_a_planned_chunk_is_dropped_at_its_last_use_and_one_never_read_again_is_not_kept():
    cache = ChunkCache(100)
    reads = [["a", "b"], ["a", "c"], ["c"], ["d"]]
    plan = cache.plan([[0], [1], [2], [3]], dict(enumerate(reads)))
    held = []
    for unit, keys in enumerate(reads):
        with plan.reading([unit]):
            _read(cache, keys)
        held.append(sorted(cache._chunks))
    plan.close()
    assert held == [["a"], ["c"], [], []]
    assert cache.peak_bytes == 1 and cache.decodes_saved == 2  # one chunk at a time


def test_an_epoch_abandoned_midway_leaves_nothing_held_and_reads_without_a_plan_are_lru():
    cache = ChunkCache(100)
    reads = [["a"], ["b"], ["a"], ["b"]]
    plan = cache.plan([[0], [1], [2], [3]], dict(enumerate(reads)))
    for unit in (0, 1):
        with plan.reading([unit]):
            _read(cache, reads[unit])
    assert len(cache) == 2
    plan.close()  # the reader stopped early
    assert len(cache) == 0 and cache.nbytes == 0
    assert _epoch(ChunkCache(2), [["a"], ["b"], ["a"], ["c"], ["b"]], planned=False) == [
        "a",
        "b",
        "c",
        "b",
    ]


def test_a_chunk_another_thread_is_decoding_is_waited_for_not_decoded_again():
    cache = ChunkCache(100)
    assert cache.acquire("k") is None  # this caller decodes it
    waiting = cache.acquire("k")
    assert isinstance(waiting, Decoding)
    got = []
    thread = threading.Thread(target=lambda: got.append(waiting.wait()))
    thread.start()
    chunk = np.arange(3)
    cache.put("k", chunk)
    thread.join()
    assert got[0] is chunk and not chunk.flags.writeable
    # a failed decode: the waiter decodes it itself
    assert cache.acquire("bad") is None
    waiting = cache.acquire("bad")
    cache.abandon("bad")
    assert waiting.wait() is None
    assert cache.acquire("bad") is None  # nobody is decoding it now


def _volume(tmp_path) -> tuple[str, np.ndarray]:
    """A 64^3 float32 volume (1 MiB) chunked 16^3 (16 KiB each, 64 chunks)."""
    volume = np.random.default_rng(0).normal(size=(64, 64, 64)).astype(np.float32)
    path = str(tmp_path / "v.zarr")
    group = zarr.open_group(path, mode="w")
    group.create_array("v", shape=volume.shape, chunks=(16, 16, 16), dtype=np.float32)[...] = volume
    return path, volume


def test_random_crops_decode_each_chunk_once_per_epoch_and_hold_only_what_later_units_need(
    tmp_path,
):
    path, volume = _volume(tmp_path)
    corners = np.unique(np.random.default_rng(1).integers(0, 64 - 8 + 1, size=(800, 3)), axis=0)
    chunk = 16**3 * 4
    budget = 40 * chunk  # under the array's 64 chunks: the epoch is planned
    source = dfl.io.PatchSource(
        path, "v", patch={0: 8, 1: 8, 2: 8}, windows=corners, chunk_cache_mb=budget / 2**20
    )
    decoder = source._open()[0].reader.decoder
    for threads in (1, 2):
        for epoch in (0, 1):
            decoder.decoded.clear()
            seen = 0
            for batch in dfl.io.stream_batches(
                source, 16, seed=3, epoch=epoch, decode_threads=threads
            ):
                for k, x in zip(batch.indices.tolist(), batch.x, strict=True):
                    a, b, c = source.corner(k)
                    assert np.array_equal(x[0].numpy(), volume[a : a + 8, b : b + 8, c : c + 8])
                seen += len(batch.indices)
            assert seen == len(corners)
            assert len(decoder.decoded) == 64  # each stored chunk once
            assert decoder.cache.peak_bytes <= budget
            assert len(decoder.cache) == 0  # each dropped after its last use


def test_a_small_budget_decodes_fewer_chunks_than_least_recently_used_would(tmp_path):
    path, _ = _volume(tmp_path)
    corners = np.unique(np.random.default_rng(2).integers(0, 64 - 8 + 1, size=(800, 3)), axis=0)
    budget = 8 * 16**3 * 4  # 8 chunks
    source = dfl.io.PatchSource(
        path, "v", patch={0: 8, 1: 8, 2: 8}, windows=corners, chunk_cache_mb=budget / 2**20
    )
    decoder = source._open()[0].reader.decoder
    list(dfl.io.stream_batches(source, 16, seed=3, decode_threads=1))
    planned = len(decoder.decoded)
    assert decoder.cache.peak_bytes <= budget
    # the same reads in the same order, least recently used (no plan)
    lru = dfl.io.PatchSource(
        path, "v", patch={0: 8, 1: 8, 2: 8}, windows=corners, chunk_cache_mb=budget / 2**20
    )
    lru.plan_reads = None  # the chunk reader then plans nothing
    list(dfl.io.stream_batches(lru, 16, seed=3, decode_threads=1))
    assert 64 <= planned < len(lru._open()[0].reader.decoder.decoded)
