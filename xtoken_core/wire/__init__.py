"""The xtoken wire: msgpack messages over ZMQ frames with zero-copy tensors (see proto/), and the
sparse top-K teacher targets that travel in them (``topk.py``).

The names load on first use (``xtoken_core.lazy``): a config that reads the wire's limits
(``errors.py``) imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xtoken_core.lazy import lazy_names

if TYPE_CHECKING:
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
    from xtoken_core.wire.topk import (
        LOG_FLOOR,
        TopK,
        check_top_k,
        decode_dtype,
        decode_topk,
        encode_topk,
        topk_bytes_per_token,
    )

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
    "LOG_FLOOR",
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
    "TopK",
    "WireError",
    "WireLimits",
    "check_top_k",
    "decode_dtype",
    "decode_message",
    "decode_topk",
    "encode_message",
    "encode_topk",
    "is_jagged",
    "json_schema",
    "topk_bytes_per_token",
    "validate_body",
]

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "BAD_BODY": "xtoken_core.wire.errors",
        "BAD_FRAMES": "xtoken_core.wire.errors",
        "BAD_HEADER": "xtoken_core.wire.errors",
        "BAD_VERSION": "xtoken_core.wire.errors",
        "BODY_SPECS": "xtoken_core.wire.schema",
        "DEFAULT_LIMITS": "xtoken_core.wire.errors",
        "EXT_JAGGED": "xtoken_core.wire.message",
        "EXT_TENSOR": "xtoken_core.wire.message",
        "HEADER_SIZE": "xtoken_core.wire.header",
        "INLINE_MAX_BYTES": "xtoken_core.wire.message",
        "LOG_FLOOR": "xtoken_core.wire.topk",
        "MESSAGE_TYPES": "xtoken_core.wire.header",
        "PROTOCOL_VERSION": "xtoken_core.wire.header",
        "TOO_LARGE": "xtoken_core.wire.errors",
        "UNKNOWN_TYPE": "xtoken_core.wire.errors",
        "WIRE_DTYPES": "xtoken_core.wire.tensors",
        "WIRE_ERROR_CODES": "xtoken_core.wire.errors",
        "JaggedColumn": "xtoken_core.wire.tensors",
        "Message": "xtoken_core.wire.message",
        "RawJagged": "xtoken_core.wire.tensors",
        "RawTensor": "xtoken_core.wire.tensors",
        "TopK": "xtoken_core.wire.topk",
        "WireError": "xtoken_core.wire.errors",
        "WireLimits": "xtoken_core.wire.errors",
        "check_top_k": "xtoken_core.wire.topk",
        "decode_dtype": "xtoken_core.wire.topk",
        "decode_message": "xtoken_core.wire.message",
        "decode_topk": "xtoken_core.wire.topk",
        "encode_message": "xtoken_core.wire.message",
        "encode_topk": "xtoken_core.wire.topk",
        "is_jagged": "xtoken_core.wire.tensors",
        "json_schema": "xtoken_core.wire.schema",
        "topk_bytes_per_token": "xtoken_core.wire.topk",
        "validate_body": "xtoken_core.wire.schema",
    },
)
