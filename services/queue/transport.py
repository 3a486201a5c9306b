"""Multipart send/receive for the queue's sockets: small frames copied, large ones zero-copy."""

from __future__ import annotations

from typing import Any

import zmq

# Frames below this size are sent and received as copies: a zmq.Frame costs more than a memcpy.
COPY_BELOW = 1 << 16
# Request frames a ROUTER receives as bytes (copied): routing id, header, body. Tensor frames after them
# stay zmq.Frame views of the received message (zero copy, kept alive by the store).
SERVER_COPIED_FRAMES = 3


def recv_frames(sock: zmq.Socket, flags: int = 0, copied: int = SERVER_COPIED_FRAMES) -> list[Any]:
    """Receive one multipart message: the first ``copied`` frames as bytes, the rest as zmq.Frame.

    Args:
        sock: the socket.
        flags: recv flags (``zmq.NOBLOCK`` raises ``zmq.Again`` when nothing is queued).
        copied: how many leading (small) frames to copy into bytes.

    Returns:
        The frames.
    """
    frames = [sock.recv(flags, copy=copied > 0)]
    while sock.get(zmq.RCVMORE):
        frames.append(sock.recv(copy=len(frames) < copied))
    return frames


def send_frames(
    sock: zmq.Socket, frames: list[Any], flags: int = 0, *, track: bool = False
) -> zmq.MessageTracker | None:
    """Send one multipart message, copying small frames and passing large ones zero-copy.

    Args:
        sock: the socket.
        frames: bytes or 1-D byte memoryviews (kept referenced by zmq until sent).
        flags: extra send flags (e.g. ``zmq.NOBLOCK``).
        track: return a tracker that is done once zmq let go of the zero-copy frames.

    Returns:
        With ``track``, the tracker (None when every frame was copied); else None.
    """
    last = len(frames) - 1
    more = flags | zmq.SNDMORE
    trackers = []
    for i, frame in enumerate(frames):
        copy = len(frame) < COPY_BELOW
        got = sock.send(frame, more if i < last else flags, copy=copy, track=track and not copy)
        if track and not copy:
            trackers.append(got)
    return zmq.MessageTracker(*trackers) if trackers else None
