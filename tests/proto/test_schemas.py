"""proto/schemas/<type>.json are the rendering of BODY_SPECS, one per registered message type."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from xtoken_core.wire import BODY_SPECS, MESSAGE_TYPES, json_schema

SCHEMAS = pathlib.Path(__file__).resolve().parents[2] / "proto" / "schemas"


@pytest.mark.skipif(
    os.environ.get("XTOKEN_REGEN_PROTO") != "1", reason="set XTOKEN_REGEN_PROTO=1 to rewrite"
)
def test_regenerate_schemas():
    SCHEMAS.mkdir(parents=True, exist_ok=True)
    for msg_type in MESSAGE_TYPES:
        (SCHEMAS / f"{msg_type}.json").write_text(
            json.dumps(json_schema(msg_type), indent=2) + "\n"
        )


def test_there_is_one_schema_file_per_message_type():
    assert sorted(p.stem for p in SCHEMAS.glob("*.json")) == sorted(MESSAGE_TYPES)
    assert set(BODY_SPECS) == set(MESSAGE_TYPES)


@pytest.mark.parametrize("msg_type", sorted(MESSAGE_TYPES))
def test_committed_schema_equals_the_rendered_body_spec(msg_type):
    committed = json.loads((SCHEMAS / f"{msg_type}.json").read_text())
    assert committed == json_schema(msg_type), (
        f"proto/schemas/{msg_type}.json is stale: run XTOKEN_REGEN_PROTO=1 pytest tests/proto"
    )


def test_protocol_doc_lists_every_message_type_with_its_code():
    doc = (SCHEMAS.parent / "PROTOCOL.md").read_text()
    for name, code in MESSAGE_TYPES.items():
        assert f"| {name} | {code} |" in doc
