"""send_frames / recv_frames: small frames travel as copies, large ones as zero-copy zmq.Frame."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import zmq

from services.queue.transport import COPY_BELOW, recv_frames, send_frames


@pytest.fixture
def pair():
    ctx = zmq.Context.instance()
    addr = f"inproc://transport-{uuid.uuid4().hex}"
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind(addr)
    dealer.connect(addr)
    yield router, dealer
    router.close(linger=0)
    dealer.close(linger=0)


def test_router_gets_routing_id_header_body_as_bytes_and_tensor_frames_as_views(pair):
    router, dealer = pair
    big = np.arange(COPY_BELOW, dtype=np.int64)
    small = memoryview(np.arange(4, dtype=np.int64)).cast("B")
    send_frames(dealer, [b"header", b"body", small, memoryview(big).cast("B")])
    assert router.poll(5000)
    frames = recv_frames(router, zmq.NOBLOCK)
    assert len(frames) == 5
    assert all(type(f) is bytes for f in frames[:3]) and frames[1:3] == [b"header", b"body"]
    assert all(isinstance(f, zmq.Frame) for f in frames[3:])
    assert bytes(frames[3].buffer) == bytes(small)
    assert np.array_equal(np.frombuffer(frames[4].buffer, np.int64), big)


def test_a_reply_reaches_the_dealer_with_copied_leading_frames(pair):
    router, dealer = pair
    send_frames(dealer, [b"h", b"b"])
    assert router.poll(5000)
    ident = recv_frames(router)[0]
    send_frames(router, [ident, b"h2", b"b2", b"x" * 10], zmq.NOBLOCK)
    assert dealer.poll(5000)
    got = recv_frames(dealer, copied=2)
    assert got[:2] == [b"h2", b"b2"] and bytes(got[2].buffer) == b"x" * 10


def test_recv_frames_without_a_message_raises_again(pair):
    router, _ = pair
    with pytest.raises(zmq.Again):
        recv_frames(router, zmq.NOBLOCK)
