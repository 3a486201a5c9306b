"""``--set KEY=VALUE``: dotted keys, YAML values, applied to a copy of the file's mapping."""

from __future__ import annotations

import argparse

import pytest

from services.common.config import ConfigError
from services.common.overrides import apply_overrides, parse_override


@pytest.mark.parametrize(
    ("text", "key", "value"),
    [
        ("trainer.optim.lr=1e-4", "trainer.optim.lr", 1e-4),
        ("trainer.schedule.max_steps=100", "trainer.schedule.max_steps", 100),
        ("trainer.loss.mode=gold", "trainer.loss.mode", "gold"),
        ("data.heldout=null", "data.heldout", None),
        ("data.skip_bad_lines=true", "data.skip_bad_lines", True),
        ("data.train=a=b.jsonl", "data.train", "a=b.jsonl"),
        ("sizes=[1, 2]", "sizes", [1, 2]),
        ("run_dir='007'", "run_dir", "007"),
    ],
)
def test_a_value_is_read_as_yaml(text, key, value):
    override = parse_override(text)
    assert (override.key, override.value) == (key, value)
    assert type(override.value) is type(value)


@pytest.mark.parametrize(
    "text", ["trainer.schedule.max_steps", "=3", "trainer..lr=1", "a b=1", "1x=2"]
)
def test_a_malformed_override_shows_the_form(text):
    with pytest.raises(argparse.ArgumentTypeError, match=r"write KEY=VALUE .*--set trainer"):
        parse_override(text)


def test_a_value_that_is_not_yaml_says_to_quote_it():
    with pytest.raises(argparse.ArgumentTypeError, match="the value is not YAML.*quote it"):
        parse_override("data.train=[1, 2")


def test_overrides_apply_in_order_to_a_copy_and_make_missing_sections():
    data = {"trainer": {"optim": {"lr": 0.1, "eps": 1e-8}}, "run_dir": "r"}
    out = apply_overrides(
        data,
        [
            parse_override("trainer.optim.lr=0.2"),
            parse_override("queue.address=tcp://127.0.0.1:5555"),
            parse_override("trainer.optim.lr=0.3"),
        ],
    )
    assert out == {
        "trainer": {"optim": {"lr": 0.3, "eps": 1e-8}},
        "run_dir": "r",
        "queue": {"address": "tcp://127.0.0.1:5555"},
    }
    assert data["trainer"]["optim"]["lr"] == 0.1  # the file's mapping is left alone


def test_an_override_through_a_value_that_is_no_section_names_it():
    with pytest.raises(ConfigError, match=r"--set run_dir\.x=1: run_dir is 'r', not a section"):
        apply_overrides({"run_dir": "r"}, [parse_override("run_dir.x=1")])
