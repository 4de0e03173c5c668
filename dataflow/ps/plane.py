"""The parameter store's data plane: direct TCP connections between worker processes.

Pushes (a gradient out, the new weights back) and window barriers (weights and
optimizer state back) travel here, not over Dask's RPC: one frame each way
(:mod:`dataflow.ps.wire`), written and read by the replica's own thread on a socket it
keeps open to each shard host, with no event-loop hop on the replica's side and
no Dask comm or handler dispatch on either. Dask carries only control (a replica
failing the shards, the driver releasing lost replicas). On this machine's loopback a
round trip costs about a quarter of Dask's RPC for a small push (``bench_data_plane.py``).

A shard host runs a :class:`StoreLoop` (the thread and asyncio loop its shards live on,
so a push waiting for the staleness bound holds no thread and Dask's event loop is not
in the path) and a :class:`PlaneServer` (a listening socket and one thread per
connected replica that reads a frame, runs the handler on the store loop and writes
the reply). A connection starts with the server's token, published with its address
in the fit's rendezvous store: only the fit's replicas know it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from dataflow.ps.wire import PREFIX_BYTES, buffer_sizes, decode, encode, frame_prefix

_UNINITIALISED_FROM = 1 << 16  # bytes


class PlaneError(ConnectionError):
    """The connection to a shard host failed: the host is gone, or it timed out."""


class StoreLoop:
    """An asyncio loop on a thread of its own, where a worker's shards live."""

    def __init__(self, name: str = "dataflow-store") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coroutine: Awaitable[Any]) -> concurrent.futures.Future:
        """Run ``coroutine`` on the store loop, from any thread."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    async def run(self, coroutine: Awaitable[Any]) -> Any:
        """Await ``coroutine`` on the store loop from another running loop (Dask's)."""
        return await asyncio.wrap_future(self.submit(coroutine))

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()


def _recv_exactly(sock: socket.socket, n: int) -> Any:
    """``n`` bytes from ``sock`` in a fresh writable buffer, in one system call when
    they have arrived. A large one is left uninitialised (a tensor's bytes: zero-filling
    25 MB first cost as much as reading them)."""
    buffer = bytearray(n) if n < _UNINITIALISED_FROM else torch.empty(n, dtype=torch.uint8).numpy()
    view = memoryview(buffer).cast("B")
    got = 0
    while got < n:
        count = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if count == 0:
            raise PlaneError("the peer closed the connection")
        got += count
    return buffer


def _read_frame(sock: socket.socket) -> Any:
    header_bytes, count = frame_prefix(_recv_exactly(sock, PREFIX_BYTES))
    block = memoryview(_recv_exactly(sock, 8 * count + header_bytes))
    sizes = buffer_sizes(block, count)
    return decode(block[8 * count :], [_recv_exactly(sock, n) for n in sizes])


def _write_frame(sock: socket.socket, message: Any) -> None:
    """One ``sendmsg`` of every piece; what a full socket buffer left unsent follows."""
    pieces = [memoryview(p).cast("B") for p in encode(message)]
    sent = sock.sendmsg(pieces)
    for piece in pieces:
        if sent >= piece.nbytes:
            sent -= piece.nbytes
            continue
        sock.sendall(piece[sent:])
        sent = 0


def _tuned(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a frame leaves at once
    return sock


class PlaneServer:
    """Listens on ``host`` (the worker's own address: the interface Dask reached it on);
    each request's ``handler(**message)`` runs on ``store``'s loop."""

    def __init__(
        self, host: str, handler: Callable[..., Awaitable[dict]], store: StoreLoop
    ) -> None:
        self.handler, self.store = handler, store
        self.token = secrets.token_hex(16)
        self.requests = 0  # served, all connections: tests read it to see the plane used
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self._listener.listen(64)
        port = self._listener.getsockname()[1]
        self.address = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        self._connections: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, name="dataflow-plane-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:  # closed
                return
            self._connections.add(_tuned(sock))
            threading.Thread(
                target=self._serve, args=(sock,), name="dataflow-plane", daemon=True
            ).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            if bytes(_recv_exactly(sock, len(self.token))) != self.token.encode():
                return  # not one of this fit's replicas
            while True:
                message = _read_frame(sock)
                self.requests += 1
                try:
                    reply = self.store.submit(self.handler(**message)).result()
                except Exception as exc:  # the handler's own errors come back as replies
                    reply = {"status": "error", "message": f"{type(exc).__name__}: {exc}"}
                _write_frame(sock, reply)
        except (OSError, ValueError, EOFError):  # the replica went away, or a stray peer
            pass
        finally:
            self._connections.discard(sock)
            sock.close()

    def close(self) -> None:
        self._closed = True
        try:  # wakes the accept() in progress (a bare close() would leave it listening)
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for sock in list(self._connections):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


# How much longer than the shard's own wait a replica waits for a reply: a shard answers
# a barrier that timed out with its error (which names whom it waited for), and that
# answer should arrive before the replica gives up on the connection.
REPLY_MARGIN_S = 5.0


class PlaneConnection:
    """A replica's connection to one shard host: ``send`` a request now, ``receive`` its
    reply later (a push in flight overlaps the next step). Blocking, on the replica's
    own thread; ``timeout_s`` bounds connecting, and ``timeout_s + REPLY_MARGIN_S`` each
    wait for a reply (the shard's barriers wait ``timeout_s``)."""

    def __init__(self, address: str, token: str, timeout_s: float) -> None:
        self.address = address
        host, _, port = address.rpartition(":")
        try:
            self._sock = socket.create_connection((host.strip("[]"), int(port)), timeout_s)
        except OSError as exc:
            raise PlaneError(f"cannot reach the parameter-store host at {address}: {exc}") from exc
        try:
            self._sock.settimeout(timeout_s + REPLY_MARGIN_S)
            _tuned(self._sock).sendall(token.encode())
        except OSError as exc:
            self._sock.close()
            raise PlaneError(f"parameter-store host {address}: {exc}") from exc

    def send(self, message: dict[str, Any]) -> None:
        try:
            _write_frame(self._sock, message)
        except OSError as exc:
            raise PlaneError(f"parameter-store host {self.address}: {exc}") from exc

    def receive(self) -> dict[str, Any]:
        try:
            return _read_frame(self._sock)
        except (OSError, ValueError) as exc:
            raise PlaneError(f"parameter-store host {self.address}: {exc}") from exc

    def close(self) -> None:
        self._sock.close()
