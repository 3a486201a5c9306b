"""Body schemas of every message type: cheap validation and their JSON Schema rendering.

The table ``BODY_SPECS`` is the single source of truth; ``proto/schemas/<type>.json`` is
rendered from it (``json_schema``) and a test keeps the committed files equal to the rendering.
Validation checks required keys and value kinds only (O(keys), plus one pass over a put's
fields); unknown keys are ignored (forward compatibility).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from xtoken_core.wire.errors import BAD_BODY, WireError
from xtoken_core.wire.header import MESSAGE_TYPES, PROTOCOL_VERSION
from xtoken_core.wire.tensors import JaggedColumn


@dataclass(frozen=True)
class FieldSpec:
    """One body key.

    Attributes:
        kind: "str", "int", "uint" (>= 0), "posint" (>= 1), "bool", "str_list", "lease_id"
            (str or int), "field_map" (dict of field name -> tensor [N, ...] or jagged [N, j, ...]),
            "dict" (any map).
        required: the key must be present.
        nullable: ``None`` is allowed (means "all" or "server default", see the description).
        description: what it means (rendered into the JSON schema).
    """

    kind: str
    required: bool = True
    nullable: bool = False
    description: str = ""


_PARTITION = FieldSpec("str", description="partition name (a namespace of keys)")
_TASK = FieldSpec("str", description="consumer task name; consumption is tracked per task")
_KEYS_OR_ALL = FieldSpec(
    "str_list", required=False, nullable=True, description="keys; null/absent = all keys"
)

_SHM_REPLY = FieldSpec(
    "bool",
    required=False,
    nullable=True,
    description="same-host clients: fields stored in the server's shared-memory pool come back "
    "as references (ext 3/4) instead of frames; valid until the samples are cleared",
)

BODY_SPECS: dict[str, dict[str, FieldSpec]] = {
    "hello": {
        "protocol_version": FieldSpec("uint", description="PROTOCOL_VERSION of the client"),
        "client": FieldSpec("str", description="client name for logs, e.g. 'collator-3'"),
    },
    "reply": {},
    "error": {
        "code": FieldSpec("str", description="short machine code, see PROTOCOL.md 'Errors'"),
        "message": FieldSpec("str", description="human-readable: the offending value and the fix"),
        "retryable": FieldSpec("bool", description="whether the same request may succeed later"),
        "request_type": FieldSpec(
            "str", nullable=True, description="type of the failed request, null if unknown"
        ),
    },
    "put": {
        "partition": _PARTITION,
        "keys": FieldSpec(
            "str_list", description="N unique sample keys; a put is idempotent per key"
        ),
        "fields": FieldSpec(
            "field_map",
            description="field name -> tensor [N, ...] or jagged [N, j, ...]; row i belongs to keys[i]; "
            "may hold a subset of the fields of existing keys (field-by-field writes)",
        ),
        "timeout_ms": FieldSpec(
            "uint",
            required=False,
            nullable=True,
            description="wait this long for capacity, then fail with 'full'; null = server default",
        ),
        "reservation": FieldSpec(
            "str",
            required=False,
            nullable=True,
            description="token of a reserve reply: the fields reference that region of the "
            "server's shared-memory pool (ext 3/4); one put per reservation",
        ),
    },
    "get": {
        "partition": _PARTITION,
        "keys": FieldSpec("str_list", description="keys to read"),
        "fields": FieldSpec(
            "str_list", required=False, nullable=True, description="field names; null/absent = all"
        ),
        "shm": _SHM_REPLY,
    },
    "clear": {"partition": _PARTITION, "keys": _KEYS_OR_ALL},
    "list": {
        "partition": FieldSpec(
            "str", required=False, nullable=True, description="null/absent = list partitions"
        ),
    },
    "claim": {
        "partition": _PARTITION,
        "task": _TASK,
        "required_fields": FieldSpec(
            "str_list", description="claim only samples that have all of these"
        ),
        "fields": FieldSpec(
            "str_list",
            required=False,
            nullable=True,
            description="fields to return; null = required_fields",
        ),
        "batch_size": FieldSpec("posint", description="at most this many samples"),
        "timeout_ms": FieldSpec(
            "uint",
            required=False,
            nullable=True,
            description="block up to this long for data; null = server default",
        ),
        "lease_ms": FieldSpec(
            "posint",
            required=False,
            nullable=True,
            description="lease length before redelivery; null = server default",
        ),
        "shm": _SHM_REPLY,
        "register": FieldSpec(
            "bool",
            required=False,
            nullable=True,
            description="register the task for the partition first (retention): a sample is "
            "dropped once every registered task acked it, and a re-put of its key is answered "
            "as consumed; absent/false = no change",
        ),
    },
    "ack": {
        "partition": _PARTITION,
        "task": _TASK,
        "lease_id": FieldSpec("lease_id", description="lease id from the claim reply"),
        "keys": FieldSpec(
            "str_list",
            required=False,
            nullable=True,
            description="keys to mark consumed; null = the whole lease",
        ),
    },
    "nack": {
        "partition": _PARTITION,
        "task": _TASK,
        "lease_id": FieldSpec("lease_id", description="lease id from the claim reply"),
        "keys": FieldSpec(
            "str_list",
            required=False,
            nullable=True,
            description="keys to give back for redelivery; null = the whole lease",
        ),
    },
    "status": {"partition": _PARTITION, "task": _TASK},
    "stats": {},
    "reserve": {
        "nbytes": FieldSpec(
            "posint", description="bytes the put needs in the server's shared-memory pool"
        ),
        "timeout_ms": FieldSpec(
            "uint",
            required=False,
            nullable=True,
            description="wait this long for capacity, then fail with 'queue_full'; "
            "null = server default",
        ),
    },
}
assert set(BODY_SPECS) == set(MESSAGE_TYPES), "every message type needs a body spec"


def _kind_ok(kind: str, value: Any) -> bool:
    if kind == "str":
        return isinstance(value, str)
    if kind == "bool":
        return isinstance(value, bool)
    if kind in ("int", "uint", "posint"):
        if not isinstance(value, int) or isinstance(value, bool):
            return False
        return kind == "int" or value >= (1 if kind == "posint" else 0)
    if kind == "str_list":
        return isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
    if kind == "lease_id":
        return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))
    if kind in ("dict", "field_map"):
        return isinstance(value, dict)
    raise AssertionError(f"unknown kind {kind}")


def _rows(value: Any) -> int | None:
    """Return the row count N of a field value, or None if it is not a tensor."""
    if isinstance(value, JaggedColumn):
        return value.num_rows
    if isinstance(value, torch.Tensor):
        return int(value.size(0)) if value.ndim >= 1 else None
    return None


def validate_body(msg_type: str, body: Any) -> None:
    """Check the required keys and value kinds of a body (cheap, no deep copies).

    Args:
        msg_type: a name from ``MESSAGE_TYPES``.
        body: the decoded body.

    Raises:
        WireError: ``unknown_type`` for an unregistered type, ``bad_body`` naming the key, the
            bad value's type and what is expected.
    """
    spec = BODY_SPECS.get(msg_type) if isinstance(msg_type, str) else None
    if spec is None:
        raise WireError("unknown_type", f"message type {msg_type!r} is not registered")
    if not isinstance(body, dict):
        raise WireError(BAD_BODY, f"{msg_type} body must be a dict, got {type(body).__name__}")
    for key, fs in spec.items():
        if key not in body:
            if fs.required:
                raise WireError(
                    BAD_BODY, f"{msg_type} body misses required key {key!r} ({fs.kind})"
                )
            continue
        value = body[key]
        if value is None:
            if not fs.nullable:
                raise WireError(BAD_BODY, f"{msg_type}.{key} is null; expected {fs.kind}")
            continue
        if not _kind_ok(fs.kind, value):
            raise WireError(
                BAD_BODY,
                f"{msg_type}.{key}={_short(value)} ({type(value).__name__}); expected {fs.kind}",
            )
    if msg_type == "put":
        _validate_put(body)


def _validate_put(body: dict[str, Any]) -> None:
    keys = body["keys"]
    if len(set(keys)) != len(keys):
        raise WireError(
            BAD_BODY,
            f"put.keys holds duplicates ({len(keys) - len(set(keys))}); keys must be unique",
        )
    n = len(keys)
    for name, value in body["fields"].items():
        if not isinstance(name, str) or not name:
            raise WireError(BAD_BODY, f"put.fields name {name!r} must be a non-empty str")
        rows = _rows(value)
        if rows is None:
            raise WireError(
                BAD_BODY,
                f"put.fields[{name!r}] is {type(value).__name__}; expected a tensor [N, ...] or "
                "jagged [N, j, ...] with N = len(keys)",
            )
        if rows != n:
            raise WireError(
                BAD_BODY, f"put.fields[{name!r}] has {rows} rows; keys has {n}: they must match"
            )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_JSON_KINDS: dict[str, dict[str, Any]] = {
    "str": {"type": "string"},
    "int": {"type": "integer"},
    "uint": {"type": "integer", "minimum": 0},
    "posint": {"type": "integer", "minimum": 1},
    "bool": {"type": "boolean"},
    "str_list": {"type": "array", "items": {"type": "string"}},
    "lease_id": {"type": ["string", "integer"]},
    "dict": {"type": "object"},
    "field_map": {"type": "object", "additionalProperties": {"$ref": "#/$defs/tensor_or_jagged"}},
}
_TENSOR_DEFS = {
    "tensor_or_jagged": {
        "description": (
            "a msgpack ext value: EXT_TENSOR=1 [dtype, shape, data] or EXT_JAGGED=2 [dtype, "
            "inner_shape, N, R, values_data, offsets_data]; data = frame index or inline bin. "
            "Same host, after hello said shm: EXT_SHM_TENSOR=3 / EXT_SHM_JAGGED=4 reference "
            "a shared-memory segment. See PROTOCOL.md 'Tensors'."
        ),
        "x-msgpack-ext": [1, 2, 3, 4],
    }
}


def json_schema(msg_type: str) -> dict[str, Any]:
    """Render the JSON Schema (draft 2020-12) of one message body.

    Args:
        msg_type: a name from ``MESSAGE_TYPES``.

    Returns:
        The schema as a JSON-ready dict.

    Raises:
        KeyError: for an unregistered type.
    """
    spec = BODY_SPECS[msg_type]
    properties: dict[str, Any] = {}
    for key, fs in spec.items():
        prop = dict(_JSON_KINDS[fs.kind])
        if fs.nullable:
            prop = {"anyOf": [prop, {"type": "null"}]}
        if fs.description:
            prop["description"] = fs.description
        properties[key] = prop
    schema: dict[str, Any] = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"xtoken/proto/schemas/{msg_type}.json",
        "title": f"xtoken {msg_type} body (protocol version {PROTOCOL_VERSION}, type code {MESSAGE_TYPES[msg_type]})",
        "type": "object",
        "properties": properties,
        "required": [k for k, fs in spec.items() if fs.required],
        "additionalProperties": True,
    }
    if any(fs.kind == "field_map" for fs in spec.values()):
        schema["$defs"] = _TENSOR_DEFS
    return schema
