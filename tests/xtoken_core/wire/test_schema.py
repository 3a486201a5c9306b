"""validate_body: required keys, value kinds, put row counts; unknown keys are ignored."""

from __future__ import annotations

import pytest
import torch

from xtoken_core.wire import (
    BODY_SPECS,
    MESSAGE_TYPES,
    JaggedColumn,
    WireError,
    decode_message,
    encode_message,
    validate_body,
)

VALID = {
    "hello": {"protocol_version": 1, "client": "c"},
    "reply": {"anything": 1},
    "error": {"code": "timeout", "message": "m", "retryable": True, "request_type": None},
    "put": {
        "partition": "p",
        "keys": ["a", "b"],
        "fields": {
            "ids": JaggedColumn.from_rows([torch.arange(3), torch.arange(1)]).to_nested(),
            "w": torch.zeros(2, 4),
            "c": JaggedColumn.from_rows([torch.arange(3), torch.arange(1)]),
        },
    },
    "get": {"partition": "p", "keys": ["a"], "fields": None},
    "clear": {"partition": "p"},
    "list": {},
    "claim": {"partition": "p", "task": "t", "required_fields": ["ids"], "batch_size": 4},
    "ack": {"partition": "p", "task": "t", "lease_id": 3},
    "nack": {"partition": "p", "task": "t", "lease_id": "L3", "keys": ["a"]},
    "status": {"partition": "p", "task": "t"},
    "stats": {},
    "reserve": {"nbytes": 1 << 20, "timeout_ms": None},
}


def _code(msg_type, body) -> str:
    with pytest.raises(WireError) as e:
        validate_body(msg_type, body)
    return e.value.code


def test_every_message_type_has_a_valid_example():
    assert set(VALID) == set(MESSAGE_TYPES) == set(BODY_SPECS)


@pytest.mark.parametrize("msg_type", sorted(VALID))
def test_valid_bodies_pass_also_after_a_wire_round_trip(msg_type):
    validate_body(msg_type, VALID[msg_type])
    validate_body(msg_type, decode_message(encode_message(msg_type, VALID[msg_type])).body)


@pytest.mark.parametrize("msg_type", sorted(VALID))
def test_unknown_keys_are_ignored(msg_type):
    validate_body(msg_type, {**VALID[msg_type], "added_in_a_later_minor": [1, 2]})


@pytest.mark.parametrize(
    "msg_type, key",
    [(t, k) for t, spec in sorted(BODY_SPECS.items()) for k, fs in spec.items() if fs.required],
)
def test_a_missing_required_key_is_bad_body_naming_the_key(msg_type, key):
    body = {k: v for k, v in VALID[msg_type].items() if k != key}
    with pytest.raises(WireError, match=repr(key)) as e:
        validate_body(msg_type, body)
    assert e.value.code == "bad_body"


@pytest.mark.parametrize(
    "msg_type, key, value",
    [
        ("hello", "protocol_version", "1"),
        ("hello", "protocol_version", -1),
        ("hello", "client", None),
        ("error", "retryable", 1),
        ("put", "keys", ["a", 2]),
        ("put", "keys", "ab"),
        ("put", "fields", [1]),
        ("put", "timeout_ms", -5),
        ("get", "fields", "ids"),
        ("claim", "batch_size", 0),
        ("claim", "batch_size", True),
        ("claim", "lease_ms", 0),
        ("ack", "lease_id", 1.5),
        ("ack", "lease_id", None),
        ("status", "task", 3),
    ],
)
def test_a_value_of_the_wrong_kind_is_bad_body(msg_type, key, value):
    with pytest.raises(WireError, match=key) as e:
        validate_body(msg_type, {**VALID[msg_type], key: value})
    assert e.value.code == "bad_body"


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"w": torch.zeros(3, 4)}, "3 rows"),
        ({"w": torch.tensor(1.0)}, "tensor"),
        ({"w": [1, 2]}, "tensor"),
        ({"": torch.zeros(2)}, "non-empty"),
        ({"j": JaggedColumn.from_rows([torch.arange(2)]).to_nested()}, "1 rows"),
    ],
)
def test_put_fields_must_be_tensors_with_one_row_per_key(fields, match):
    with pytest.raises(WireError, match=match):
        validate_body("put", {**VALID["put"], "fields": fields})


def test_put_keys_must_be_unique():
    body = {**VALID["put"], "keys": ["a", "a"]}
    assert _code("put", body) == "bad_body"


def test_unknown_type_and_non_dict_body_are_refused():
    assert _code("nope", {}) == "unknown_type"
    assert _code("stats", [1]) == "bad_body"
