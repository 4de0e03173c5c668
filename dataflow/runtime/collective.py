"""The process group that joins the replicas of one fit.

It is built directly from c10d classes rather than ``init_process_group``, so it is
not process-global: it lives in the worker plugin's per-run state, several fits can
share a cluster, and a failing fit can abort exactly its own group. Rank 0 opens a
``TCPStore`` on a free port chosen by the OS (never hard-coded) and the others
connect to it at rank 0's worker address.
"""

from __future__ import annotations

import datetime
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dataflow.core.errors import CollectiveError


def open_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store on rank 0's worker, listening on an OS-chosen port."""
    return dist.TCPStore(
        host,
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


CONNECT_ATTEMPT_S = 1.0  # one try to reach rank 0's store; ``aborted()`` is checked between


def connect_store(
    host: str,
    port: int,
    world_size: int,
    timeout_s: float,
    *,
    aborted: Callable[[], bool] = lambda: False,
    prefix: str = "",
) -> dist.TCPStore:
    """A client of rank 0's store, reached first with a plain socket in short tries.

    torch's client retries a refused connection until its whole timeout; but the store
    is open before its address is handed out, so a refusal means it is closed: rank 0
    gave the forming up (the driver aborted it, or a task of an older group ran here
    late) or its worker died. That fails at once, and so does an abort between tries,
    rather than keeping this worker's task thread (and the Setup of the group the
    driver forms next, queued behind it) the whole collective timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        if aborted():
            raise CollectiveError(aborted_message(None, prefix))
        try:
            socket.create_connection((host, port), timeout=CONNECT_ATTEMPT_S).close()
            break
        except ConnectionRefusedError as exc:
            raise CollectiveError(
                f"process group {prefix!r}: its store at {host}:{port} refused the "
                f"connection ({exc}); rank 0 gave that group up or its worker died, and "
                "the driver forms another"
            ) from exc
        except OSError as exc:  # no answer yet: try again until the deadline
            time.sleep(ARRIVAL_POLL_S)
            if time.monotonic() >= deadline:
                raise CollectiveError(
                    f"process group {prefix!r}: its store at {host}:{port} did not answer "
                    f"within {timeout_s:g} s ({exc}). Check that workers can reach each "
                    "other on TCP ports"
                ) from exc
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def aborted_message(rank: int | None, prefix: str) -> str:
    who = "this replica" if rank is None else f"replica {rank}"
    return (
        f"{who}: forming process group {prefix!r} was aborted (a peer was lost meanwhile; "
        "the driver forms another)"
    )


ARRIVAL_POLL_S = 0.05  # how often a rank forming a group checks who has arrived


def await_arrivals(
    store: dist.Store,
    *,
    rank: int,
    world_size: int,
    timeout_s: float,
    aborted: Any,
    prefix: str,
) -> None:
    """Announce ``rank`` at the group's store and wait until every rank has, checking
    ``aborted()`` between looks.

    Gloo's constructor waits for a missing peer the whole collective timeout and
    cannot be interrupted: a peer killed while the group forms would keep the others'
    workers busy that long, and every later task there (the next attempt to form a
    group) queued behind. Arriving first, where the wait can be given up, leaves
    gloo only the peers that are there."""
    arrived = dist.PrefixStore(f"{prefix}/arrived", store)
    arrived.set(str(rank), "1")
    names = [str(r) for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    while not arrived.check(names):
        if aborted():
            raise CollectiveError(aborted_message(rank, prefix))
        if time.monotonic() >= deadline:
            missing = [n for n in names if not arrived.check([n])]
            raise CollectiveError(
                f"replica {rank}: ranks {', '.join(missing)} of process group {prefix!r} "
                f"did not arrive within {timeout_s:g} s"
            )
        time.sleep(ARRIVAL_POLL_S)


# Waiting on a gloo collective: check for its completion (or an abort) every SHORT_NAP_S
# for the first SHORT_WAIT_S (the usual wait), then every LONG_NAP_S (a slower peer).
# No spinning: gloo's own thread in this process, and the peer's, need the cores a spin
# would hold; a 264-byte allreduce between 2 processes on 2 cores took 1.77-2.0 ms with a
# 1 ms spin before 0.2 ms naps, 0.5-0.75 ms with 50 us naps and no spin, 0.42-1.8 ms in
# gloo's own blocking wait (500 each, after 50 to warm up)
SHORT_NAP_S = 50e-6
SHORT_WAIT_S = 0.005
LONG_NAP_S = 0.0005


class Collective:
    """Allreduce and broadcast over one fit's replicas (gloo on CPU, NCCL on CUDA)."""

    def __init__(
        self,
        store: dist.Store,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        host: str,
        timeout_s: float,
        prefix: str,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        timeout = datetime.timedelta(seconds=timeout_s)
        prefixed = dist.PrefixStore(prefix, store)
        self.shared_gpu = False
        try:
            if device.type == "cuda":
                self.shared_gpu = _shares_a_gpu(prefixed, rank, world_size, device, timeout_s)
            if device.type == "cuda" and not self.shared_gpu:
                self.backend = "nccl"
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                self._group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
            else:  # CPU tensors, or CUDA tensors of ranks sharing a GPU (through the host)
                self.backend = "gloo"
                options = dist.ProcessGroupGloo._Options()
                options._timeout = timeout
                options._devices = [_gloo_device(host)]
                self._group = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
        except Exception as exc:  # surfaced with the rank and address that failed
            raise CollectiveError(
                f"replica {rank} of {world_size} could not join the process group at "
                f"{host}: {exc}. Check that workers can reach each other on TCP ports"
            ) from exc

    def allreduce_async(self, tensor: torch.Tensor) -> Any:
        """Start a sum-allreduce in place; returns a work handle with ``wait()``."""
        return self._live_group().allreduce([tensor])

    def allreduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.wait(self.allreduce_async(tensor))
        return tensor

    def broadcast(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Overwrite ``tensors`` on every rank with rank ``src``'s values, in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        for tensor in tensors:
            self.wait(self._live_group().broadcast([tensor], opts))

    def wait(self, work: Any) -> None:
        """Wait for ``work``, but fail at once when this replica's group is aborted.

        Gloo's own wait ends only at the timeout when a peer vanished while it waits
        on a live one; the driver aborts the survivors' groups (from the worker's event
        loop) so that their windows end now and the recovery can start. NCCL work is
        waited for as usual (the wait is asynchronous on the GPU stream).
        """
        if self.backend != "gloo":
            work.wait()
            return
        short_until = time.perf_counter() + SHORT_WAIT_S
        while not work.is_completed():
            if self._group is None:
                raise CollectiveError(
                    f"replica {self.rank}: the process group was aborted while waiting "
                    "(a peer was lost; the driver is recovering)"
                )
            short = time.perf_counter() < short_until
            time.sleep(SHORT_NAP_S if short else LONG_NAP_S)
        work.wait()  # raises the work's error, if any

    def _live_group(self) -> Any:
        if self._group is None:
            raise CollectiveError(
                f"replica {self.rank}: the process group of this fit was aborted because "
                "another replica or the driver failed; see the first error of the fit"
            )
        return self._group

    def abort(self) -> None:
        """Leave the group so that collectives on this replica fail at once.

        A wait in progress on this replica sees the group gone and raises (see
        :meth:`wait`). The gloo group object is kept, not destroyed: its destructor
        joins gloo's threads, which wait out the timeout on a vanished peer while
        holding the GIL, freezing the whole worker (event loop included). The owner
        keeps aborted collectives alive (``ReplicaRuntime.retired``, then the worker
        plugin). NCCL's ``abort()`` is what NCCL needs.
        """
        group, self._group = self._group, None
        if group is None:
            return
        self._aborted_group = group
        if self.backend != "gloo":
            try:
                group.abort()
            except Exception:  # backends without abort: dropping the group is what counts
                pass

    @property
    def closed(self) -> bool:
        return self._group is None


def _shares_a_gpu(
    store: dist.Store, rank: int, world_size: int, device: torch.device, timeout_s: float
) -> bool:
    """Whether any two ranks of the group run on the same GPU (several workers on a
    one-GPU machine, or more workers than GPUs on a node). NCCL refuses that
    ("Duplicate GPU detected"); gloo reduces CUDA tensors through host memory, slower
    but correct. Every rank reaches the same answer from the same keys."""
    if world_size == 1:
        return False
    props = torch.cuda.get_device_properties(device)
    store.set(f"gpu/{rank}", f"{socket.gethostname()}/{props.uuid}")
    store.wait([f"gpu/{r}" for r in range(world_size)], datetime.timedelta(seconds=timeout_s))
    gpus = [store.get(f"gpu/{r}").decode() for r in range(world_size)]
    return len(set(gpus)) < world_size


def _gloo_device(host: str) -> Any:
    """Bind gloo to the interface the worker itself listens on."""
    try:
        return dist.ProcessGroupGloo.create_device(hostname=host)
    except Exception:
        return dist.ProcessGroupGloo.create_default_device()
