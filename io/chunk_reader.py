"""Turn one replica's epoch of batches into chunk reads: each chunk decoded once.

A chunked source (zarr, dask) decodes whole chunks whatever a read asks for, so
reading batch by batch would decode a chunk once for every batch that touches
it. The whole epoch's batches are known in advance (``io.sharding``), so this
reader knows each chunk's first and last use: it decodes a chunk for the first
batch that needs it, keeps it while later batches still need it, and drops it
after its last use. Memory is the chunks live at once, which the shuffle buffer
bounds (about ``buffer_chunks`` chunks plus the ones the current batch spans),
plus the chunks decoded ahead (``decode_ahead`` batches' new chunks: one with one
decode thread, two with several, so the threads never wait for the assembly to take
a batch), whatever the dataset size.

Speed: the new chunks of a batch are decoded on a pool of ``decode_threads``
threads, one chunk per call to the source (``ZarrSource`` decodes on the calling
thread, ``io.zarr_decode``; zstd and blosc release the GIL, so the decode rate
grows with the threads), ahead of the assembly, so decoding overlaps the gather
and the consumer. With one thread, each batch's new chunks go to the source in one
request. The gather copies each sample once, straight from its decoded chunk
into the batch, one Numba call per chunk with the GIL released (``io.row_copy``: the
replica's step runs beside it and needs the GIL; one thread: more would compete with
the decode for the cores), into an output buffer reused from
:class:`BatchBuffers` (fresh memory costs a page fault per 4 KiB on first touch,
about as much as the copy itself). The batches are the same whatever the thread
count: each chunk decodes to the same values, and the assembly is in batch order.

The next epoch's reader (``then``) starts its reads once this epoch's chunks are all
decoded (``start_decoding``): its first chunks decode on the idle threads while this
epoch's last batches are assembled, so an epoch's first batch does not wait for a whole
round of decodes (on 2 threads, 8-14% of a short epoch's time went to that wait).

Before the first batch, every chunk of the epoch is checked to exist, so a
missing chunk fails the epoch before any step trains on it. A remote store's objects
fetched ahead (``io.fetch``) are checked by their GETs instead of a HEAD each: the
first batch waits on one round trip, not two, and a 404 stops the epoch at the next
batch, naming the object (a decode taking it would too): no step trains on a fill value.

A chunk is a run of consecutive samples (``chunk_bounds``) or any set of them
(``chunk_members``, a ``PatchSource``'s blocks of windows); ``io.chunk_index`` finds
which chunk holds a sample.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from dataflow.core.batch import Batch
from dataflow.core.errors import ChunkMissingError, ConfigError
from dataflow.core.protocols import ChunkedSource
from dataflow.io.batch_buffers import BatchBuffers
from dataflow.io.chunk_index import chunk_index, last_uses
from dataflow.io.direct_batches import DirectBatches, whole_chunk_spans
from dataflow.io.row_copy import copy_rows
from dataflow.io.store_retry import abandoned_when

# -- gather -----------------------------------------------------------------------------


def _numpy(value: Any) -> np.ndarray:
    return value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


def _gather(
    values: list[Any],
    rows: list[np.ndarray],
    positions: list[np.ndarray],
    n: int,
    buffers: BatchBuffers,
) -> Any:
    """Rows ``rows[i]`` of chunk value ``values[i]`` placed at ``positions[i]`` of a batch:
    each sample copied once, straight into the batch, with the GIL released
    (``io.row_copy``: the step running beside the assembly needs the GIL)."""
    first = values[0]
    if first is None:
        return None
    if isinstance(first, tuple):
        return tuple(
            _gather([v[k] for v in values], rows, positions, n, buffers) for k in range(len(first))
        )
    sources = [_numpy(v) for v in values]
    shape, dtype = sources[0].shape[1:], sources[0].dtype
    tensor, out = buffers.take(n, shape, dtype)
    for source, local, where in zip(sources, rows, positions, strict=True):
        copy_rows(out, source, local, where)
    return tensor


# -- decode ahead -----------------------------------------------------------------------

DEFAULT_DECODE_AHEAD = 1  # batches' new chunks decoded ahead of the assembly: one thread
THREADED_DECODE_AHEAD = 2  # several threads: the next batch's chunks fill a batch's tail
AUTO_DECODE_THREADS = 4  # decode_threads="auto" on the CPU: at most this many
# ... and on a GPU, whose replica leaves the host's other cores idle: a 4 x 128^3 sample is
# 32 MB, and a fit from memory steps through ~12 GB of it a second on an H200 (one zstd
# thread decodes ~1 GB/s)
AUTO_DECODE_THREADS_GPU = 16


def auto_decode_threads(device: torch.device | str | None = None) -> int:
    """``decode_threads="auto"``: on the CPU, ``min(4, cores for this reader)``, the
    cores being the thread budget torch has here (a replica's: ``threads_per_replica``,
    else its worker's threads; 1 per worker on the default LocalCluster, where the decode
    shares the core with the compute). On a GPU, where the host cores are otherwise idle,
    ``min(16, this process's cores per GPU it sees, less the one the replica's own thread
    keeps busy)``, and at least the torch threads."""
    cores = torch.get_num_threads()
    if device is None or torch.device(device).type != "cuda":
        return max(1, min(AUTO_DECODE_THREADS, cores))
    try:
        host = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        host = os.cpu_count() or 1
    per_gpu = host // max(1, torch.cuda.device_count()) - 1
    return max(1, min(AUTO_DECODE_THREADS_GPU, max(cores, per_gpu)))


def check_decode_threads(where: str, value: Any) -> None:
    """``decode_threads`` is ``"auto"`` or an int >= 1 (ConfigError naming ``where``)."""
    if value == "auto" and isinstance(value, str):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{where}(decode_threads={value!r}): the threads that decode a chunked source's "
            "chunks; use an int >= 1, or 'auto' (min(4, the cores this reader has); on a GPU, "
            "up to 16: the host's idle cores)"
        )


class _InlineDecoder:
    """Decodes on the caller's thread, when there is nothing to overlap."""

    def __init__(self, read: Callable[[list[int]], dict[int, Batch]], jobs: list[list[int]]):
        self._read = read
        self._jobs = iter(jobs)

    def get(self) -> dict[int, Batch]:
        return self._read(next(self._jobs))

    @property
    def drained(self) -> bool:
        return False  # nothing runs ahead of the caller: the epoch after gains nothing

    def close(self) -> None:
        pass


class _PoolDecoder:
    """Decodes jobs (each one batch's new chunks) on ``threads`` threads, in order: at most
    ``ahead`` jobs decoded or decoding that the assembly has not taken yet, or more while
    those hold fewer chunks than there are threads (at most ``threads`` jobs: each holds a
    chunk), so memory stays bounded and no thread idles for want of a chunk. With several
    threads a job is split into one call per chunk, so its chunks decode at once; the
    pool takes calls first in, first out, so the chunks of the job the assembly needs
    next go first. ``ahead=0``: a job starts when it is asked for."""

    def __init__(
        self,
        read: Callable[[list[int]], dict[int, Batch]],
        jobs: list[list[int]],
        ahead: int,
        threads: int,
    ) -> None:
        self._read = read
        self._jobs = iter(jobs)
        self._ahead = ahead
        self._threads = threads
        self._split = threads > 1
        self._exhausted = False  # every job submitted
        self._pending: collections.deque[list[Future]] = collections.deque()
        self._executor = ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="dataflow-decode"
        )
        self._fill()

    def _fill(self) -> None:
        """Jobs submitted up to ``ahead`` in flight, then while fewer chunks than threads are."""
        while len(self._pending) < self._ahead or (
            self._ahead and sum(map(len, self._pending)) < self._threads
        ):
            if not self._submit():
                return

    def _submit(self) -> bool:
        job = next(self._jobs, None)
        if job is None:
            self._exhausted = True
            return False
        parts = [[chunk] for chunk in job] if self._split else [job]
        self._pending.append([self._executor.submit(self._read, part) for part in parts])
        return True

    def get(self) -> dict[int, Batch]:
        if not self._pending:  # ahead=0: nothing started before the assembly asks
            self._submit()
        decoded: dict[int, Batch] = {}
        for future in self._pending.popleft():  # chunk order: the first failing one raises,
            decoded.update(future.result())  # at its batch
        self._fill()  # ``ahead`` jobs in flight again, or enough chunks for the threads
        return decoded

    @property
    def drained(self) -> bool:
        """Every job decoded and taken: the threads are idle from now on."""
        return self._exhausted and not self._pending

    def close(self) -> None:
        for futures in self._pending:
            for future in futures:
                future.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)


# -- the reader -------------------------------------------------------------------------


class EpochChunkReader:
    """Yields the batches of one replica's epoch, decoding each chunk once.

    ``buffers``: where batch outputs come from (a :class:`BatchBuffers`, shared across
    epochs by the caller so buffers are reused from one epoch to the next; its reuse
    rule makes handing batches on safe). ``decode_ahead``: how many batches' new chunks
    may be decoded before the assembly needs them (0: none; with one thread, decoded
    on the iterating thread; None: 1 with one thread, 2 with several, whose threads
    would otherwise wait while a batch's last chunk decodes). ``decode_threads``: the
    threads that decode chunks (``"auto"``: :func:`auto_decode_threads`); the batches
    do not depend on it. ``decode_into_batches``: a batch made of whole chunks is
    decoded straight into its buffers where the source can (``io.direct_batches``; the
    same batches, without the assembly's copy).
    """

    def __init__(
        self,
        source: ChunkedSource,
        batches: Sequence[np.ndarray],
        *,
        buffers: BatchBuffers | None = None,
        decode_ahead: int | None = None,
        decode_threads: int | str = "auto",
        decode_into_batches: bool = True,
    ) -> None:
        if decode_ahead is not None and decode_ahead < 0:
            raise ValueError(f"EpochChunkReader(decode_ahead={decode_ahead}): must be >= 0")
        check_decode_threads("EpochChunkReader", decode_threads)
        self.source = source
        self.batches = [np.asarray(b, dtype=np.int64).reshape(-1) for b in batches]
        self.index = chunk_index(source)
        self.chunks = [self.index.of(indices) for indices in self.batches]
        self.touched = [np.unique(chunks).tolist() for chunks in self.chunks]
        self.last_use = last_uses(self.chunks)
        self.buffers = BatchBuffers() if buffers is None else buffers
        self.decode_threads = (
            auto_decode_threads() if decode_threads == "auto" else int(decode_threads)
        )
        if decode_ahead is None:
            one = self.decode_threads == 1
            decode_ahead = DEFAULT_DECODE_AHEAD if one else THREADED_DECODE_AHEAD
        self.decode_ahead = decode_ahead
        self.decoded = 0  # chunks decoded so far: the test of "once per epoch"
        # read_chunks calls: one per batch that needs new chunks (one thread), else per chunk
        self.requests = 0
        self.peak_live_samples = 0  # most decoded samples held at once: the memory bound
        self._held = 0
        self._lock = threading.Lock()
        self._plan: Any = None  # the source's plan of the epoch's reads (plan_reads)
        self._abandoned = threading.Event()  # abandon(): reads stop retrying
        seen: set[int] = set()
        self.news = []  # per batch, the chunks it is the first to use
        for touched in self.touched:
            self.news.append([c for c in touched if c not in seen])
            seen.update(touched)
        self.jobs = [new for new in self.news if new]  # the reads, in order
        # Batches of whole chunks, decoded straight into their buffers (io.direct_batches)
        self.direct: DirectBatches | None = None
        if decode_into_batches and hasattr(source, "read_chunks_into"):
            spans = [
                whole_chunk_spans(b, c, t, n, self.last_use, p, self.index)
                for p, (b, c, t, n) in enumerate(
                    zip(self.batches, self.chunks, self.touched, self.news, strict=True)
                )
            ]
            if any(s is not None for s in spans):
                sizes = [len(b) for b in self.batches]
                self.direct = DirectBatches(source, self.buffers, sizes, spans)
        # A remote store's objects fetched ahead (io.fetch), from iteration on, or started
        # earlier by the epoch before (``then``: the reader of the epoch after this one)
        self.fetching: Any = None
        self._fetch_started = False
        self.then: EpochChunkReader | None = None
        # start_decoding(): the decoder started before iteration, or what stopped it
        self._early: Any = None

    def _samples(self, chunks: Sequence[int]) -> int:
        return int(sum(self.index.size(c) for c in chunks))

    def _hold(self, samples: int) -> None:
        with self._lock:
            self._held += samples
            self.peak_live_samples = max(self.peak_live_samples, self._held)

    def _read(self, chunks: list[int]) -> dict[int, Batch]:
        self._hold(self._samples(chunks))  # counted before decoding: the memory is coming
        reading = self._plan.reading(chunks) if self._plan is not None else contextlib.nullcontext()
        direct = self.direct
        with reading, abandoned_when(self._abandoned):
            if direct is not None and direct.owns(chunks[0]):  # a job is one batch's chunks
                blocks = {chunk: direct.blocks(chunk) for chunk in chunks}
                decoded = self.source.read_chunks_into(chunks, blocks)
            else:
                decoded = self.source.read_chunks(chunks)
        with self._lock:  # decode threads may finish together
            self.decoded += len(chunks)
            self.requests += 1
        return decoded

    def abandon(self) -> None:
        """Nobody will take this epoch's batches any more (its window was aborted): a
        read retrying a failing store gives up now, with the store's failure, rather
        than for ``retry_s`` (``io.store_retry.abandoned_when``)."""
        self._abandoned.set()

    def start_fetching(self, after: Any = None) -> None:
        """Fetch this epoch's objects of a remote store ahead, in read order, from now on
        (``io.fetch``; once). ``after``: the plan of the epoch before, still being read:
        this one shares its budget, so an epoch's first GETs need not wait for its start."""
        if self._fetch_started:
            return
        self._fetch_started = True
        fetch_ahead = getattr(self.source, "fetch_ahead", None)
        if fetch_ahead is not None:
            options = {} if after is None else {"after": after}
            self.fetching = fetch_ahead(self.jobs, **options)

    def close_fetching(self) -> None:
        """Drop what was fetched ahead and not read (an epoch not read after all)."""
        if self.fetching is not None:
            self.fetching.close()

    def _start_the_next(self, fetching: Any) -> None:
        """Once this epoch's plan has asked for everything, the next epoch's may start."""
        then = self.then
        if then is not None and not then._fetch_started and fetching.launched_all:
            then.start_fetching(after=fetching)

    def _prepare(self) -> Any:
        """The epoch's reads set up: its objects fetched ahead (a remote store), the
        read plan given to a chunk cache, every chunk checked to exist, and its decoder,
        which starts decoding the first batches' chunks at once (several threads)."""
        jobs = self.jobs
        self.start_fetching()  # unless the epoch before started it
        fetching = self.fetching
        # The same order tells a decoded-chunk cache what to keep (io.chunk_cache)
        plan_reads = getattr(self.source, "plan_reads", None)
        self._plan = plan_reads(jobs) if plan_reads is not None else None
        try:
            self.source.check_chunks(sorted(self.last_use))
        except BaseException:
            if fetching is not None:
                fetching.close()
            if self._plan is not None:
                self._plan.close()
            raise
        one_at_a_time = self.decode_threads == 1 or all(len(job) == 1 for job in jobs)
        if one_at_a_time and (self.decode_ahead == 0 or len(jobs) <= 1):
            return _InlineDecoder(self._read, jobs)  # nothing to overlap
        return _PoolDecoder(self._read, jobs, self.decode_ahead, self.decode_threads)

    def start_decoding(self) -> None:
        """Start this epoch's reads now, before it is iterated: the epoch before calls it
        once its own chunks are all decoded, so this epoch's first chunks decode while
        that epoch's last batches are assembled and taken, and this epoch's first batch
        does not wait for a whole round of decodes. What goes wrong now (a missing
        chunk) is raised when this epoch is iterated, before its first batch, as if
        found then. An epoch started and never iterated must be :meth:`close_unread`."""
        if self._early is not None:
            return
        try:
            self._early = self._prepare()
        except Exception as error:  # raised by __iter__, at this epoch's start
            self._early = error

    def close_unread(self) -> None:
        """This epoch will not be read (its window was aborted, or the phase ended): what
        it fetched ahead is dropped, and the reads it started early are stopped."""
        early, self._early = self._early, None
        if isinstance(early, (_InlineDecoder, _PoolDecoder)):
            self.abandon()  # a read retrying a failing store gives up instead of waiting
            early.close()
            if self._plan is not None:
                self._plan.close()
        self.close_fetching()

    def __iter__(self) -> Iterator[Batch]:
        news = self.news
        early, self._early = self._early, None
        if isinstance(early, Exception):
            raise early
        decoder = self._prepare() if early is None else early
        fetching = self.fetching
        live: dict[int, Batch] = {}
        try:
            for position, indices in enumerate(self.batches):
                if news[position]:
                    live.update(decoder.get())
                if fetching is not None and fetching.missing:
                    self._stop_missing(fetching)
                if fetching is not None:
                    self._start_the_next(fetching)
                if news[position] and self.then is not None and decoder.drained:
                    self.then.start_decoding()  # its first chunks, on idle threads
                yield self._assemble(indices, self.chunks[position], position, live)
                done = [c for c in self.touched[position] if self.last_use[c] == position]
                for chunk in done:
                    del live[chunk]
                self._hold(-self._samples(done))
        finally:
            decoder.close()
            if fetching is not None:
                fetching.close()
            if self._plan is not None:
                self._plan.close()

    def _stop_missing(self, fetching: Any) -> None:
        """A GET fetched ahead found an object absent (``io.fetch``): stop the epoch before
        its next batch, with the source's own error naming it (its check, asked again now
        that the plans are closed, sends the HEADs the plans' GETs had stood in for: the
        next epoch's too, started ahead from this one's and never read now that this one
        stops; left open, it would still stand in for the object, and the check find it)."""
        fetching.close()
        if self.then is not None:
            self.then.close_unread()
        self.source.check_chunks(sorted(self.last_use))
        raise ChunkMissingError(
            f"{type(self.source).__name__}: the stored object {fetching.missing[0]!r} was "
            "absent when this epoch fetched it, and is there now: the store is changing "
            "underneath; retry once it is complete"
        )

    def _assemble(
        self, indices: np.ndarray, chunks: np.ndarray, position: int, live: dict[int, Batch]
    ) -> Batch:
        n = len(indices)
        if n == 0:  # a replica with no share this step: the source's own empty batch
            return self.source.read(indices)
        if self.direct is not None and position in self.direct:
            return self.direct.take(position, indices)  # its chunks decoded into it
        rows, positions, parts = [], [], []
        for chunk in self.touched[position]:
            where = np.flatnonzero(chunks == chunk)
            rows.append(self.index.rows(indices[where], chunk))
            positions.append(where)
            parts.append(live[chunk])
        x = _gather([p.x for p in parts], rows, positions, n, self.buffers)
        y = _gather([p.y for p in parts], rows, positions, n, self.buffers)
        return Batch(x=x, y=y, size=n, indices=indices)
