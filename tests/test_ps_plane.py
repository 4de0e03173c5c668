"""The parameter store's data plane: frames, a real server and connection on loopback."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from dataflow.ps.plane import PlaneConnection, PlaneError, PlaneServer, StoreLoop
from dataflow.ps.wire import PREFIX_BYTES, buffer_sizes, decode, encode, frame_prefix


def _round_trip(message):
    pieces = encode(message)
    blob = b"".join(bytes(p) for p in pieces)
    position = 0

    def read(n):
        nonlocal position
        position += n
        return blob[position - n : position]

    header_bytes, count = frame_prefix(read(PREFIX_BYTES))
    sizes = buffer_sizes(read(8 * count), count)
    header = read(header_bytes)
    return decode(header, [bytearray(read(n)) for n in sizes]), len(sizes)


def test_a_frame_carries_nested_tensors_out_of_band_and_back_exactly():
    message = {
        "grad": torch.randn(1000),
        "state": {"momentum_buffer": torch.randn(3, 4).t(), "step": torch.tensor(7.0)},
        "ints": torch.arange(10, dtype=torch.int64)[::3],
        "flags": torch.tensor([True, False]),
        "half": torch.ones(3, dtype=torch.bfloat16),  # numpy has no bfloat16: in band
        "part": (12, 1),
        "lrs": [0.1, 0.01],
        "empty": torch.empty(0),
    }
    back, buffers = _round_trip(message)
    assert buffers == 6  # every strided CPU tensor numpy holds went out of band
    assert back["part"] == (12, 1) and back["lrs"] == [0.1, 0.01]
    for key in ("grad", "ints", "flags", "half", "empty"):
        assert back[key].dtype == message[key].dtype
        assert torch.equal(back[key], message[key]), key
    assert torch.equal(back["state"]["momentum_buffer"], message["state"]["momentum_buffer"])
    assert back["state"]["step"].item() == 7.0
    back["grad"].add_(1)  # received tensors are writable (fresh buffers, no warning)


def test_a_stray_frame_is_refused_by_its_lengths():
    with pytest.raises(ValueError, match="not a parameter-store frame"):
        frame_prefix(b"\xff" * PREFIX_BYTES)


@pytest.fixture
def plane():
    store = StoreLoop()
    release = asyncio.Event()  # made here, used on the store loop: waits until set

    async def handler(**message):
        if message.get("op") == "fail":
            raise RuntimeError("the shard broke")
        if message.get("op") == "hang":
            await release.wait()
        return {"status": "ok", "payload": message.get("payload"), "got": sorted(message)}

    server = PlaneServer("127.0.0.1", handler, store)
    yield server
    server.close()
    store.close()


def test_a_request_and_its_reply_cross_the_plane(plane):
    connection = PlaneConnection(plane.address, plane.token, timeout_s=30)
    for size in (1, 1 << 18):
        payload = torch.randn(size)
        connection.send({"op": "echo", "payload": payload, "part": [3, 0]})
        reply = connection.receive()
        assert torch.equal(reply["payload"], payload)
        assert reply["got"] == ["op", "part", "payload"]
    assert plane.requests == 2
    connection.close()


def test_a_handler_error_comes_back_as_a_reply_and_the_connection_goes_on(plane):
    connection = PlaneConnection(plane.address, plane.token, timeout_s=30)
    connection.send({"op": "fail"})
    reply = connection.receive()
    assert reply["status"] == "error" and "the shard broke" in reply["message"]
    connection.send({"op": "echo", "payload": torch.ones(2)})
    assert connection.receive()["status"] == "ok"
    connection.close()


def test_a_connection_without_the_token_is_closed_unserved(plane):
    connection = PlaneConnection(plane.address, "0" * len(plane.token), timeout_s=30)
    connection.send({"op": "echo"})
    with pytest.raises(PlaneError, match=plane.address):
        connection.receive()
    connection.close()
    assert plane.requests == 0


def test_a_closed_host_fails_the_waiting_replica_at_once_not_at_the_timeout(plane):
    """A replica waiting for a reply learns that the host went away (its connection is
    shut down), as when a SIGKILLed host's kernel closes its sockets."""
    connection = PlaneConnection(plane.address, plane.token, timeout_s=600)
    connection.send({"op": "hang"})
    errors = []
    waiter = threading.Thread(target=lambda: errors.append(_receive_error(connection)))
    waiter.start()
    while plane.requests == 0:  # the request is being served (and hangs)
        threading.Event().wait(0.01)
    plane.close()
    waiter.join(timeout=60)
    assert not waiter.is_alive()
    connection.close()
    assert isinstance(errors[0], PlaneError) and "closed" in str(errors[0]), errors


def _receive_error(connection):
    try:
        connection.receive()
    except Exception as exc:  # the error itself is the result
        return exc
    return None


def test_an_unreachable_host_is_named():
    store = StoreLoop()
    server = PlaneServer("127.0.0.1", lambda **m: None, store)
    address = server.address
    server.close()
    store.close()
    with pytest.raises(PlaneError, match=f"cannot reach the parameter-store host at {address}"):
        PlaneConnection(address, server.token, timeout_s=5)
