"""The xtoken wire: msgpack messages over ZMQ frames with zero-copy tensors (see proto/)."""

from xtoken_core.wire.errors import (
    BAD_BODY,
    BAD_FRAMES,
    BAD_HEADER,
    BAD_VERSION,
    DEFAULT_LIMITS,
    TOO_LARGE,
    UNKNOWN_TYPE,
    WIRE_ERROR_CODES,
    WireError,
    WireLimits,
)
from xtoken_core.wire.header import HEADER_SIZE, MESSAGE_TYPES, PROTOCOL_VERSION
from xtoken_core.wire.message import (
    EXT_JAGGED,
    EXT_TENSOR,
    INLINE_MAX_BYTES,
    Message,
    decode_message,
    encode_message,
)
from xtoken_core.wire.schema import BODY_SPECS, json_schema, validate_body
from xtoken_core.wire.tensors import WIRE_DTYPES, JaggedColumn, RawJagged, RawTensor, is_jagged

__all__ = [
    "BAD_BODY",
    "BAD_FRAMES",
    "BAD_HEADER",
    "BAD_VERSION",
    "BODY_SPECS",
    "DEFAULT_LIMITS",
    "EXT_JAGGED",
    "EXT_TENSOR",
    "HEADER_SIZE",
    "INLINE_MAX_BYTES",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "TOO_LARGE",
    "UNKNOWN_TYPE",
    "WIRE_DTYPES",
    "WIRE_ERROR_CODES",
    "JaggedColumn",
    "Message",
    "RawJagged",
    "RawTensor",
    "WireError",
    "WireLimits",
    "decode_message",
    "encode_message",
    "is_jagged",
    "json_schema",
    "validate_body",
]
