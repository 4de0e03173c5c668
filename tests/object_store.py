"""A real S3-compatible server for tests and benchmarks, behind a proxy that adds latency.

:func:`s3_server` starts moto's server (``moto.server.ThreadedMotoServer``) on
127.0.0.1 at a port the OS picks, and :class:`DelayProxy` in front of it: a threaded
HTTP/1.1 proxy that holds every request ``delay`` seconds before forwarding it, as a
far-away object store would, and counts how many requests it had in flight at once
(the test of concurrency: a count the proxy observed, never a measured time), and
can fail chunk GETs as a struggling store does (``DelayProxy.fail_chunk_gets``: S3's
503 ``SlowDown``, a 500 ``InternalError``, or a connection dropped without an answer;
``DelayProxy.throttle``: a share of them answered ``SlowDown``).
Clients talk to the proxy: ``S3Server.storage_options`` are what ``ZarrSource`` and
s3fs take. Used by ``tests/test_object_store.py`` and
``benchmarks/bench_object_store.py``.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

KEY = "testing-key-id"
SECRET = "s3cr3t-not-for-logs-4f9a1c"  # tests look for this string where it must not be
RENDEZVOUS_S = 5.0  # how long a held chunk GET waits for company before going on alone
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}
# What S3 answers when it throttles a reader, or fails inside
S3_ERRORS = {
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "internal": (500, "InternalError", "We encountered an internal error. Please try again."),
}


class QuietServer(ThreadingHTTPServer):
    """No traceback for a client that hung up (a read cancelled, a fetch plan closed)."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class DelayProxy:
    """Forwards every request to ``upstream`` after ``delay`` seconds (settable at any
    time); ``peak_in_flight``: the most requests it held at once, ``requests``: how many
    it forwarded, ``methods``: how many per HTTP method."""

    def __init__(self, upstream: tuple[str, int], delay: float = 0.0) -> None:
        self.upstream = upstream
        self.delay = delay
        self.requests = 0
        self.methods: dict[str, int] = {}
        self.peak_in_flight = 0
        self.peak_chunk_gets = 0  # GETs of chunk objects (zarr v3 keys .../c/...) at once
        self.failed_chunk_gets = 0  # chunk GETs answered with a failure (fail_chunk_gets)
        self._fail_objects = 0  # objects still to fail, of those not asked for yet
        self._fail_each = 1
        self._failing: dict[str, int] = {}  # object -> failures it has left
        self._fail_metadata = False  # metadata files' GETs fail too
        self._fail_how = "internal"
        # Besides: each chunk GET answered with S3's 503 SlowDown at this probability (a
        # throttling store; a retried GET may be throttled again), from a seeded draw
        self.throttle = 0.0
        self._draw = random.Random(0).random
        # Hold the first chunk GETs until this many are held at once (or RENDEZVOUS_S
        # pass): "requests in flight together" is then a count, not a race with the delay
        self.rendezvous = 1
        self._met = False
        self._in_flight = 0
        self._chunk_gets = 0
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients expect

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def _forward(self) -> None:
                body = self._body()
                chunk = self.command == "GET" and "/c/" in self.path
                failure = proxy._failure(self.path, chunk) if self.command == "GET" else None
                if failure == "reset":  # no answer: the client sees the connection close
                    self.close_connection = True
                    return
                if failure is not None:
                    status, code, message = S3_ERRORS[failure]
                    payload = (
                        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                        f"<Message>{message}</Message></Error>"
                    ).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                proxy._enter(self.command, chunk)
                try:
                    if proxy.delay:
                        time.sleep(proxy.delay)  # the latency being simulated
                    status, headers, payload = proxy._send(
                        self.command, self.path, self.headers, body
                    )
                finally:
                    proxy._leave(chunk)
                self.send_response(status)
                for name, value in headers:
                    if name.lower() not in HOP_HEADERS and name.lower() != "content-length":
                        self.send_header(name, value)
                length = dict((k.lower(), v) for k, v in headers).get("content-length")
                if self.command == "HEAD" and length is not None:
                    self.send_header("Content-Length", length)
                else:
                    self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    parts = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            self.rfile.readline()
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        self.server = QuietServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def fail_chunk_gets(
        self, objects: int, how: str = "internal", each: int = 1, metadata: bool = False
    ) -> None:
        """Answer the GETs of the next ``objects`` chunk objects asked for with a failure,
        ``each`` times in a row for each object (then forward them): ``how`` is
        ``"slowdown"`` (503), ``"internal"`` (500) or ``"reset"`` (the connection closed
        without an answer); ``metadata``: the metadata files' GETs too. s3fs itself sends
        a GET 5 times on a 503 or a dropped connection, once on a 500. ``objects=0``
        stops failing."""
        assert how in (*S3_ERRORS, "reset"), how
        with self._lock:
            self._fail_objects, self._fail_each, self._fail_how = objects, each, how
            self._failing, self._fail_metadata = {}, metadata

    def _failure(self, path: str, chunk: bool) -> str | None:
        with self._lock:
            if not (chunk or self._fail_metadata):
                return None
            if chunk and self.throttle and self._draw() < self.throttle:
                self.failed_chunk_gets += 1
                return "slowdown"
            if path not in self._failing:
                if self._fail_objects <= 0:
                    return None
                self._fail_objects -= 1
                self._failing[path] = self._fail_each
            if self._failing[path] <= 0:
                return None
            self._failing[path] -= 1
            self.failed_chunk_gets += 1
            return self._fail_how

    def _enter(self, method: str, chunk: bool) -> None:
        with self._lock:
            self.requests += 1
            self.methods[method] = self.methods.get(method, 0) + 1
            self._in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
            if chunk:
                self._chunk_gets += 1
                self.peak_chunk_gets = max(self.peak_chunk_gets, self._chunk_gets)
                if self._chunk_gets >= self.rendezvous:
                    self._met = True  # once: the rest of the epoch goes through unheld
                self._arrived.notify_all()
                self._arrived.wait_for(lambda: self._met, timeout=RENDEZVOUS_S)

    def _leave(self, chunk: bool) -> None:
        with self._lock:
            self._in_flight -= 1
            self._chunk_gets -= chunk

    def reset_counts(self) -> None:
        with self._lock:
            self.requests, self.methods, self._met = 0, {}, False
            self.failed_chunk_gets, self._fail_objects, self._failing = 0, 0, {}
            self.peak_in_flight, self.peak_chunk_gets = self._in_flight, self._chunk_gets

    def _send(
        self, method: str, path: str, headers: Any, body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        connection = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            forward = {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}
            forward["Content-Length"] = str(len(body))
            connection.request(method, path, body=body or None, headers=forward)
            response = connection.getresponse()
            payload = response.read()
            return response.status, response.getheaders(), payload
        finally:
            connection.close()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class S3Server:
    """A running moto server and the proxy clients reach it through."""

    proxy: DelayProxy
    bucket: str = "data"

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """What s3fs (and ``ZarrSource(storage_options=...)``) takes for this server."""
        return {"key": KEY, "secret": SECRET, "endpoint_url": self.endpoint_url}

    def url(self, name: str) -> str:
        return f"s3://{self.bucket}/{name}"

    def client(self) -> Any:
        """A boto3 client (synchronous: no event loop left behind) for the tests' setup."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=KEY,
            aws_secret_access_key=SECRET,
            region_name="us-east-1",
        )

    def upload(self, local: str | Path, name: str) -> str:
        """Copy the local directory ``local`` (a zarr store) to the bucket; its URL."""
        client, root = self.client(), Path(local)
        delay, self.proxy.delay = self.proxy.delay, 0.0  # the setup is not what is measured
        try:
            for path in sorted(p for p in root.rglob("*") if p.is_file()):
                key = f"{name}/{path.relative_to(root).as_posix()}"
                client.put_object(Bucket=self.bucket, Key=key, Body=path.read_bytes())
        finally:
            self.proxy.delay = delay
        return self.url(name)

    def delete(self, key: str) -> None:
        self.client().delete_object(Bucket=self.bucket, Key=key)


@contextlib.contextmanager
def s3_server(delay: float = 0.0, bucket: str = "data") -> Iterator[S3Server]:
    """moto's S3 server on 127.0.0.1 (a free port), a bucket, and the delaying proxy."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)  # the OS picks
    moto.start()
    proxy = DelayProxy(moto.get_host_and_port(), delay)
    try:
        server = S3Server(proxy, bucket)
        server.client().create_bucket(Bucket=bucket)
        yield server
    finally:
        close_sessions()
        proxy.close()
        moto.stop()


def close_sessions() -> None:
    """Close the HTTP sessions of s3fs's cached filesystems (zarr's are asynchronous, on
    zarr's loop, and s3fs closes those only when they are garbage: a ResourceWarning)."""
    import s3fs
    from zarr.core.sync import sync

    for fs in list(s3fs.S3FileSystem._cache.values()):
        creator = getattr(fs, "_s3creator", None)
        if creator is not None and getattr(fs, "asynchronous", False):
            with contextlib.suppress(Exception):
                sync(creator.__aexit__(None, None, None))
    s3fs.S3FileSystem.clear_instance_cache()
