"""Frame 0 of every message: magic, protocol version, flags, message type code, request id."""

from __future__ import annotations

import struct

from xtoken_core.wire.errors import BAD_HEADER, BAD_VERSION, UNKNOWN_TYPE, WireError

PROTOCOL_VERSION = 1
MAGIC = b"XTKW"
# little-endian: magic[4] | version u8 | flags u8 | type code u16 | request id u64  = 16 bytes
HEADER_STRUCT = struct.Struct("<4sBBHQ")
HEADER_SIZE = HEADER_STRUCT.size
MAX_REQUEST_ID = 2**64 - 1

# The registry of message types. Codes are part of the protocol: never reuse or renumber one;
# a new type needs a PROTOCOL_VERSION bump, unless clients send it only after the server's
# hello advertised it (``reserve``: ``shm_pool: true``), see proto/PROTOCOL.md.
MESSAGE_TYPES: dict[str, int] = {
    "hello": 1,
    "reply": 2,
    "error": 3,
    "put": 4,
    "get": 5,
    "clear": 6,
    "list": 7,
    "claim": 8,
    "ack": 9,
    "nack": 10,
    "status": 11,
    "stats": 12,
    "reserve": 13,
}
TYPE_NAMES: dict[int, str] = {code: name for name, code in MESSAGE_TYPES.items()}


def type_code(msg_type: str) -> int:
    """Return the wire code of a message type.

    Args:
        msg_type: a name from ``MESSAGE_TYPES``.

    Returns:
        The 16-bit type code.

    Raises:
        WireError: ``unknown_type`` if the name is not registered.
    """
    try:
        return MESSAGE_TYPES[msg_type]
    except (KeyError, TypeError):
        raise WireError(
            UNKNOWN_TYPE,
            f"message type {msg_type!r} is not registered; use one of {sorted(MESSAGE_TYPES)}",
        ) from None


def pack_header(msg_type: str, request_id: int) -> bytes:
    """Build frame 0.

    Args:
        msg_type: a name from ``MESSAGE_TYPES``.
        request_id: 0 <= id < 2**64, echoed by the reply.

    Returns:
        ``HEADER_SIZE`` bytes.

    Raises:
        WireError: ``unknown_type`` for an unregistered type, ``bad_header`` for a bad id.
    """
    code = type_code(msg_type)
    if not isinstance(request_id, int) or isinstance(request_id, bool):
        raise WireError(BAD_HEADER, f"request_id={request_id!r}: must be an int")
    if not 0 <= request_id <= MAX_REQUEST_ID:
        raise WireError(BAD_HEADER, f"request_id={request_id}: must be in [0, 2**64)")
    return HEADER_STRUCT.pack(MAGIC, PROTOCOL_VERSION, 0, code, request_id)


def unpack_header(frame: memoryview) -> tuple[str, int]:
    """Parse frame 0.

    Args:
        frame: a 1-D byte memoryview.

    Returns:
        ``(msg_type, request_id)``.

    Raises:
        WireError: ``bad_header`` (size, magic, flags), ``bad_version``, ``unknown_type``.
    """
    if frame.nbytes != HEADER_SIZE:
        raise WireError(BAD_HEADER, f"header frame is {frame.nbytes} bytes, expected {HEADER_SIZE}")
    magic, version, flags, code, request_id = HEADER_STRUCT.unpack(frame)
    if magic != MAGIC:
        raise WireError(BAD_HEADER, f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise WireError(
            BAD_VERSION,
            f"protocol version {version}, this side speaks {PROTOCOL_VERSION}; "
            "upgrade the older side",
        )
    if flags != 0:
        raise WireError(BAD_HEADER, f"flags=0x{flags:02x}: reserved bits must be zero")
    name = TYPE_NAMES.get(code)
    if name is None:
        raise WireError(UNKNOWN_TYPE, f"message type code {code} is not registered")
    return name, request_id
