"""Wire errors and limits: WireError (with a short machine code) and WireLimits."""

from __future__ import annotations

from dataclasses import dataclass

# Error codes raised while encoding or decoding one message (wire level).
BAD_HEADER = "bad_header"
BAD_VERSION = "bad_version"
UNKNOWN_TYPE = "unknown_type"
BAD_BODY = "bad_body"
BAD_FRAMES = "bad_frames"
TOO_LARGE = "too_large"

WIRE_ERROR_CODES = (BAD_HEADER, BAD_VERSION, UNKNOWN_TYPE, BAD_BODY, BAD_FRAMES, TOO_LARGE)


class WireError(ValueError):
    """A message could not be encoded or decoded.

    Attributes:
        code: short machine-readable reason, one of ``WIRE_ERROR_CODES`` (``"bad_header"``,
            ``"bad_version"``, ``"unknown_type"``, ``"bad_body"``, ``"bad_frames"``,
            ``"too_large"``). A server sends it back as the ``code`` of an ``error`` reply.
        retryable: whether sending the same message again can succeed (never, for wire errors:
            the message itself is wrong).
    """

    def __init__(self, code: str, message: str, *, retryable: bool = False) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message
        self.retryable = retryable


@dataclass(frozen=True)
class WireLimits:
    """Bounds enforced on both encode and decode.

    Args:
        max_message_bytes: total bytes over all frames of one message.
        max_frames: number of frames of one message (header + body + tensor frames).
        max_body_bytes: bytes of the msgpack body frame (inline tensors included).
        max_ndim: dimensions of one tensor.

    Raises:
        ValueError: if a bound is not a positive integer, or ``max_frames < 2``.
    """

    max_message_bytes: int = 2 * 1024**3
    max_frames: int = 4096
    max_body_bytes: int = 64 * 1024**2
    max_ndim: int = 32

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_frames", "max_body_bytes", "max_ndim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"WireLimits.{name}={value!r}: must be a positive integer")
        if self.max_frames < 2:
            raise ValueError(
                f"WireLimits.max_frames={self.max_frames}: a message has at least 2 frames "
                "(header and body); raise it"
            )


DEFAULT_LIMITS = WireLimits()
