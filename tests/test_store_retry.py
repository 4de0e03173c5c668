"""A store that fails for a while (throttling, server errors, dropped connections) is
ridden out for a source's ``retry_s``, then named (``io.store_retry``).

The decisions (which failure passes, how long to wait, when to give up) are pure and
tested in milliseconds; the reads are tested against moto's S3 server behind the tests'
proxy, which answers chunk GETs with S3's own 503 ``SlowDown`` and 500 ``InternalError``
or drops the connection (``tests/object_store.py``). The client's own retries are
turned off there (``NO_CLIENT_RETRIES``), so each failure the proxy serves reaches the
source: what is counted is the proxy's failures and the source's retries, never a time.
"""

from __future__ import annotations

import errno
import logging
import pickle
import re
import threading
import time

import numpy as np
import pytest
import torch
from conftest import TinyCNN, make_data, tiny_pipeline

import dataflow as dfl
from dataflow.io.chunk_reader import EpochChunkReader
from dataflow.io.store_access import DENIED, RETRIED, UNAVAILABLE, access_failure
from dataflow.io.store_retry import (
    MAX_BACKOFF_S,
    StoreRetry,
    backoff_s,
    gives_up,
    retry_seconds,
)

# botocore sends each request once, and s3fs does not retry a 500: the failures the
# proxy serves are the source's to ride out
NO_CLIENT_RETRIES = {"config_kwargs": {"retries": {"total_max_attempts": 1}}}


def client_error(code: str, status: int = 500) -> Exception:
    from botocore.exceptions import ClientError

    response = {
        "Error": {"Code": code, "Message": "m"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, "GetObject")


# -- the decisions -------------------------------------------------------------------
def test_throttling_server_errors_and_dropped_connections_pass_and_refusals_do_not():
    import aiohttp
    from s3fs.errors import translate_boto_error

    assert access_failure(client_error("SlowDown", 503)) == UNAVAILABLE
    assert access_failure(client_error("InternalError")) == UNAVAILABLE
    # s3fs's own translation keeps the client's error as its cause
    slow = translate_boto_error(client_error("SlowDown", 503))
    assert isinstance(slow, OSError) and slow.errno == errno.EBUSY
    assert access_failure(slow) == UNAVAILABLE
    assert access_failure(aiohttp.ServerDisconnectedError()) == UNAVAILABLE
    assert access_failure(ConnectionResetError("peer")) == UNAVAILABLE
    info = aiohttp.RequestInfo("http://h/x", "GET", {}, "http://h/x")  # fsspec's HTTP
    assert access_failure(aiohttp.ClientResponseError(info, (), status=503)) == UNAVAILABLE
    assert access_failure(aiohttp.ClientResponseError(info, (), status=404)) is None
    # no retry mends these
    assert access_failure(client_error("AccessDenied", 403)) == DENIED
    assert access_failure(FileNotFoundError("x/c/0/0")) is None
    assert access_failure(ValueError("corrupt")) is None


def test_the_backoff_doubles_to_a_cap_and_gives_up_past_the_budget():
    assert [backoff_s(a, 1.0) for a in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert backoff_s(50, 1.0) == MAX_BACKOFF_S
    assert backoff_s(3, 0.0) == 0.0  # full jitter: anywhere below the cap
    assert not gives_up(UNAVAILABLE, 10.0, 5.0, 120.0)
    assert gives_up(UNAVAILABLE, 118.0, 5.0, 120.0)
    assert gives_up(UNAVAILABLE, 0.0, 0.1, 0.0)  # retry_s=0: the first failure stands
    assert gives_up(DENIED, 0.0, 0.0, 120.0) and gives_up(None, 0.0, 0.0, 120.0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.waits: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds


def test_a_read_is_sent_again_until_it_succeeds_or_the_budget_is_spent(caplog):
    clock = FakeClock()
    retry = StoreRetry(30.0, clock=lambda: clock.now, sleep=clock.sleep)
    answers = iter([client_error("SlowDown", 503)] * 3 + ["bytes"])

    def read() -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    with caplog.at_level(logging.WARNING, logger="dataflow.io.store_retry"):
        assert retry.run(read) == "bytes"
    assert retry.retries == 3 and len(clock.waits) == 3
    # the log says so at once, and once per WARN_EVERY_S, not per retry
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "SlowDown" in warned[0] and "retry_s=30" in warned[0]
    assert all(0 <= w <= cap for w, cap in zip(clock.waits, [0.5, 1.0, 2.0], strict=True))

    def down() -> str:
        raise client_error("InternalError")

    with pytest.raises(Exception) as failed:
        retry.run(down)
    assert clock.now - 30.0 <= sum(clock.waits) and sum(clock.waits[3:]) <= 30.0
    assert getattr(failed.value, RETRIED)[0] >= 1  # the retries, for the error's message

    def refused() -> str:
        raise PermissionError("denied")

    before = retry.retries
    with pytest.raises(PermissionError):
        retry.run(refused)
    assert retry.retries == before  # not retried
    copy = pickle.loads(pickle.dumps(retry))
    assert copy.retry_s == 30.0 and copy.retries == 0


@pytest.mark.parametrize("value", [-1, "60", None, True, float("nan")])
def test_retry_s_is_validated_where_the_source_is_built(tmp_path, value):
    with pytest.raises(dfl.ConfigError, match=r"retry_s=.*>= 0 of seconds"):
        retry_seconds("ZarrSource", value)
    local = dfl.io.to_zarr(tmp_path / "d.zarr", *make_data(64), chunk_mb=0.01)
    with pytest.raises(dfl.ConfigError, match=r"ZarrSource\(retry_s="):
        dfl.io.ZarrSource(local, x="x", y="y", retry_s=value)
    with pytest.raises(dfl.ConfigError, match=r"PatchSource\(retry_s="):
        dfl.io.PatchSource(local, x="x", patch={1: 4}, retry_s=value)


# -- the reads, on a real S3 server ----------------------------------------------------
@pytest.fixture
def proxy(s3):
    s3.proxy.reset_counts()
    yield s3.proxy
    s3.proxy.fail_chunk_gets(0)
    s3.proxy.reset_counts()


def options(s3):
    return {**s3.storage_options, **NO_CLIENT_RETRIES}


def epoch(source):
    return [
        (b.indices.copy(), b.x.clone(), b.y.clone())
        for b in dfl.io.stream_batches(source, 32, seed=3, decode_threads=2)
    ]


# s3fs tries a GET 5 times on a 503, once on a 500 (with botocore's retries off): each
# object fails that many times, so s3fs gives up on it and the source's retry follows.
# (A dropped connection s3fs, botocore and aiohttp retry ~200 times over ~45 s.)
CLIENT_ATTEMPTS = {"slowdown": 5, "internal": 1}


@pytest.mark.parametrize("how", [pytest.param("slowdown", marks=pytest.mark.slow), "internal"])
def test_a_store_failing_for_a_while_is_ridden_out_with_the_same_batches(s3, s3_stores, proxy, how):
    local, url = s3_stores
    want = epoch(dfl.io.ZarrSource(local, x="x", y="y"))
    source = dfl.io.ZarrSource(url, x="x", y="y", storage_options=options(s3))
    proxy.fail_chunk_gets(3, how, each=CLIENT_ATTEMPTS[how])
    got = epoch(source)
    assert proxy.failed_chunk_gets == 3 * CLIENT_ATTEMPTS[how]
    assert source.store_retries >= 1
    assert len(got) == len(want) == 8
    for (gi, gx, gy), (wi, wx, wy) in zip(got, want, strict=True):
        assert np.array_equal(gi, wi) and torch.equal(gx, wx) and torch.equal(gy, wy)


def test_a_store_failing_past_retry_s_is_named_with_the_object_and_the_fix(s3, s3_stores, proxy):
    _, url = s3_stores
    source = dfl.io.ZarrSource(url, x="x", y="y", storage_options=options(s3), retry_s=1.0)
    proxy.fail_chunk_gets(10**6, "internal", each=10**6)
    with pytest.raises(dfl.StoreUnavailableError) as failed:
        epoch(source)
    message = str(failed.value)
    assert isinstance(failed.value, dfl.StoreAccessError) and isinstance(failed.value, OSError)
    assert "s3://data/train.zarr" in message and "/c/" in message
    assert "after " in message and re.search(r"retr(y|ies) over \d+\.\d s", message)
    assert "in a way that passes" in message and "resume=True" in message
    assert source.store_retries >= 1
    # retry_s=0: the first failure stands, with no retry
    proxy.reset_counts()
    proxy.fail_chunk_gets(10**6, "internal", each=10**6)
    source = dfl.io.ZarrSource(url, x="x", y="y", storage_options=options(s3), retry_s=0)
    with pytest.raises(dfl.StoreUnavailableError) as failed:
        epoch(source)
    assert not re.search(r"retr(y|ies) over", str(failed.value)) and source.store_retries == 0


@pytest.fixture
def http_store(tmp_path):
    """The tests' sample-major store served over plain HTTP (``http.server``, a port the
    OS picks), read with fsspec's HTTP client, which retries nothing itself; the first
    ``fail["left"]`` chunk GETs are answered 503."""
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    local = dfl.io.to_zarr(tmp_path / "train.zarr", *make_data(256), chunk_mb=0.01)
    fail = {"left": 0, "served": 0}

    class Handler(SimpleHTTPRequestHandler):
        def log_message(self, format, *args):  # quiet
            pass

        def do_GET(self):
            if "/c/" in self.path and fail["left"] > 0:
                fail["left"] -= 1
                fail["served"] += 1
                self.send_response(503)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            super().do_GET()

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=tmp_path))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield local, f"http://127.0.0.1:{server.server_address[1]}/train.zarr", fail
    finally:
        server.shutdown()
        server.server_close()


def test_an_http_store_whose_client_retries_nothing_rides_out_503s(http_store):
    local, url, fail = http_store
    source = dfl.io.ZarrSource(url, x="x", y="y")
    fail["left"] = 4
    got = epoch(source)
    assert fail["served"] == 4 and source.store_retries >= 1
    want = epoch(dfl.io.ZarrSource(local, x="x", y="y"))
    assert len(got) == len(want) == 8
    for (gi, gx, gy), (wi, wx, wy) in zip(got, want, strict=True):
        assert np.array_equal(gi, wi) and torch.equal(gx, wx) and torch.equal(gy, wy)
    fail["left"] = 10**6  # down for good: named after retry_s
    source = dfl.io.ZarrSource(url, x="x", y="y", retry_s=0.5)
    with pytest.raises(dfl.StoreUnavailableError, match=r"store 'http://127\.0\.0\.1.* over"):
        epoch(source)


def test_opening_a_store_failing_for_a_while_is_tried_again(s3, s3_stores, proxy):
    """The driver's open (the metadata's GETs) rides out the failure too; the tools
    (``dataflow info``) fail at once, with the store's message."""
    _, url = s3_stores
    proxy.fail_chunk_gets(2, "internal", metadata=True)
    source = dfl.io.ZarrSource(url, x="x", y="y", storage_options=options(s3))
    assert proxy.failed_chunk_gets == 2 and source.num_samples == 256
    proxy.reset_counts()
    proxy.fail_chunk_gets(10**6, "internal", each=10**6, metadata=True)
    with pytest.raises(dfl.StoreUnavailableError, match=r"opening store .*after \d+ retr"):
        dfl.io.ZarrSource(url, x="x", y="y", storage_options=options(s3), retry_s=0.5)
    from dataflow.io.store_open import open_zarr

    with pytest.raises(dfl.DataError, match=r"info: cannot open .*throttling or failing for now"):
        open_zarr("info", url, options(s3))


def test_a_patch_source_rides_out_a_failing_store_with_the_same_windows(s3, tmp_path, proxy):
    field = np.random.default_rng(0).standard_normal((24, 24)).astype(np.float32)
    local = tmp_path / "field.zarr"
    import zarr

    array = zarr.open_array(local, mode="w", shape=field.shape, chunks=(8, 8), dtype=field.dtype)
    array[...] = field
    url = s3.upload(local, "retried_field.zarr")  # moto keeps a bucket across modules

    def windows(store, **kw):
        source = dfl.io.PatchSource(store, x=None, patch={0: 6, 1: 6}, shuffle=False, **kw)
        return source, [b.x.clone() for b in dfl.io.stream_batches(source, 16, seed=0)]

    _, want = windows(local)
    proxy.fail_chunk_gets(3, "internal")
    source, got = windows(url, storage_options=options(s3))
    assert proxy.failed_chunk_gets == 3 and source.store_retries >= 1
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.slow
def test_a_fit_through_a_failing_store_equals_the_fit_from_the_local_copy(
    client, s3, s3_stores, proxy
):
    """Features meet: a fit on worker processes, two replicas, evaluation, checkpoints,
    each worker's reads failing for a while: the same weights as the local copy's fit,
    every sample once, and the retries in the phase's record."""
    local, url = s3_stores
    held_out = dfl.io.ZarrSource(local, x="x", y="y")

    def fit(source):
        pipe = tiny_pipeline(None, None, source=source, batch=32, eval_source=held_out)
        return pipe.fit(epochs=2, client=client)

    want = fit(dfl.io.ZarrSource(local, x="x", y="y"))
    proxy.fail_chunk_gets(6, "internal", each=2)  # each object twice: two retries
    got = fit(dfl.io.ZarrSource(url, x="x", y="y", storage_options=options(s3)))
    assert proxy.failed_chunk_gets == 12
    assert sum(sum(p.store_retries) for p in got.history.phases) >= 1
    assert "store reads retried per replica" in got.summary()
    assert "store reads retried" not in want.summary()
    for e in range(2):
        assert got.ledger.consumed(e).tolist() == list(range(256))
    weights, reference = got.model.state_dict(), want.model.state_dict()
    assert all(torch.equal(weights[k], reference[k]) for k in reference)


def _wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s:g} s for {what}"
        time.sleep(0.05)


def test_an_abandoned_reader_stops_retrying_a_failing_store(s3, s3_stores, proxy):
    """Its window was aborted while it rode out an outage: nobody will take the epoch's
    batches, so its reads give up at once (retry_s=600 would keep them sending GETs to
    the failing store for 10 minutes, on threads nobody waits for)."""
    _, url = s3_stores
    source = dfl.io.ZarrSource(url, x="x", y="y", storage_options=options(s3), retry_s=600)
    proxy.fail_chunk_gets(10**6, "internal", each=10**6)
    batches = [np.arange(start, start + 32) for start in range(0, 256, 32)]
    reader = EpochChunkReader(source, batches, decode_threads=2)
    failed: list[BaseException] = []

    def read_the_epoch() -> None:
        try:
            list(reader)
        except Exception as exc:
            failed.append(exc)

    thread = threading.Thread(target=read_the_epoch, daemon=True)
    thread.start()
    _wait_for(lambda: source.store_retries >= 2, "the reads to retry")
    reader.abandon()
    thread.join(timeout=60)
    assert not thread.is_alive() and failed  # every read ended: the decode threads too
    assert access_failure(failed[0]) == UNAVAILABLE, failed[0]  # the store's own failure


def test_an_evaluation_interrupted_in_an_outage_leaves_no_read_retrying(s3, s3_stores, proxy):
    """Evaluate's interrupt (the driver aborted the window) ends the wait for a held-out
    batch and abandons the reader behind it: its reading thread ends too."""
    from test_evaluate_transforms import last_step

    from dataflow.core.errors import CollectiveError

    _, url = s3_stores
    source = dfl.io.ZarrSource(url, x="x", y="y", storage_options=options(s3), retry_s=600)
    evaluate = dfl.stages.Evaluate(
        source, metrics={"loss": torch.nn.functional.cross_entropy}, transforms=()
    )
    before = {t for t in threading.enumerate() if t.name == "dataflow-prefetch"}
    proxy.fail_chunk_gets(10**6, "internal", each=10**6)
    outcome: list[BaseException] = []

    def evaluating() -> None:
        try:
            evaluate.evaluate_shard(last_step(evaluate, TinyCNN()))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=evaluating, daemon=True)
    thread.start()
    _wait_for(lambda: source.store_retries >= 2, "the held-out reads to retry")
    evaluate.interrupt("the window was aborted")
    thread.join(timeout=60)
    assert not thread.is_alive() and isinstance(outcome[0], CollectiveError), outcome
    _wait_for(
        lambda: not {t for t in threading.enumerate() if t.name == "dataflow-prefetch"} - before,
        "the held-out reading thread to end",
    )
