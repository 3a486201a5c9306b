"""Configs: generated flags, --config files under flags, strict from_dict, to_dict round trips."""

from __future__ import annotations

import argparse
import enum
import json
import pathlib
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import pytest

from services.common.config import (
    ConfigError,
    add_arguments,
    from_args,
    from_dict,
    load_context,
    load_file,
    marks,
    moved_flag,
    section,
    to_dict,
    with_context,
)


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


def _size(text: str) -> int:
    if not text.endswith("KiB"):
        raise ValueError(f"size {text!r}: write e.g. 4KiB")
    return int(text[:-3]) * 1024


@dataclass
class Optim:
    """Optimizer settings."""

    lr: float = field(default=1e-3, metadata={"help": "peak learning rate"})
    betas: tuple[float, float] = (0.9, 0.95)
    schedule: Literal["cosine", "linear"] = "cosine"

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr}: must be > 0 (--optim.lr)")


@dataclass
class Data:
    path: str = field(metadata={"help": "corpus file"})
    limit: int | None = None


@dataclass
class Config:
    data: Data
    steps: int = field(default=100, metadata={"help": "optimizer steps"})
    compile: bool = True
    tags: list[str] = field(default_factory=list)
    shape: tuple[int, ...] = (2, 3)
    color: Color = Color.RED
    out: pathlib.Path = pathlib.Path("runs")
    capacity: int = field(default=8192, metadata={"flag": "cap", "parse": _size})
    optim: Optim = field(default_factory=Optim)
    extra: Optim | None = None
    env: dict[str, str] = field(default_factory=dict)
    blob: Any = field(default=None, metadata={"cli": False})


def _parse(argv: list[str]) -> Config:
    parser = argparse.ArgumentParser(prog="t")
    add_arguments(parser, Config)
    return from_args(Config, parser.parse_args(argv))


def test_flags_are_generated_from_the_fields_with_dataclass_defaults():
    config = _parse(["--data.path", "c.jsonl"])
    assert config == Config(data=Data(path="c.jsonl"))


def test_every_kind_of_flag_parses_into_its_field_type():
    config = _parse(
        [
            "--data.path=x", "--data.limit", "7", "--steps", "5", "--no-compile",
            "--tags", "a", "b", "--shape", "4", "5", "6", "--color", "blue", "--out", "/tmp/o",
            "--cap", "2KiB", "--optim.lr", "0.5", "--optim.betas", "0.8", "0.9",
            "--optim.schedule", "linear", "--extra.lr", "0.1", "--env", '{"A": "1"}',
        ]
    )  # fmt: skip
    assert config.data == Data(path="x", limit=7)
    assert (config.steps, config.compile, config.tags, config.shape) == (
        5,
        False,
        ["a", "b"],
        (4, 5, 6),
    )
    assert (config.color, config.out, config.capacity) == (Color.BLUE, pathlib.Path("/tmp/o"), 2048)
    assert config.optim == Optim(lr=0.5, betas=(0.8, 0.9), schedule="linear")
    assert config.extra == Optim(lr=0.1)
    assert config.env == {"A": "1"}


def test_optional_flag_takes_none():
    assert _parse(["--data.path", "x", "--data.limit", "none"]).data.limit is None


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--optim.schedule", "exp"], "use one of cosine, linear"),
        (["--steps", "many"], "many"),
        (["--cap", "12"], "4KiB"),
        (["--optim.betas", "0.9"], "expected 2 arguments"),
    ],
)
def test_bad_flag_values_are_usage_errors(argv, needle, capsys):
    parser = argparse.ArgumentParser(prog="t")
    add_arguments(parser, Config)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--data.path", "x", *argv])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_help_shows_each_default_once_from_the_dataclass(capsys):
    parser = argparse.ArgumentParser(prog="t")
    add_arguments(parser, Config)
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "optimizer steps (default: 100)" in out
    assert "peak learning rate (default: 0.001)" in out
    assert "corpus file (required)" in out
    assert "--compile, --no-compile" in out
    assert "--optim.lr LR" in out and "--blob" not in out


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_config_file_sets_values_and_command_line_flags_override_it(tmp_path, suffix):
    data = {"data": {"path": "file.jsonl"}, "steps": 9, "optim": {"lr": 0.25}, "blob": [1, 2]}
    path = tmp_path / f"c{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(data))
    else:
        path.write_text("data: {path: file.jsonl}\nsteps: 9\noptim:\n  lr: 2.5e-1\nblob: [1, 2]\n")
    config = _parse(["--config", str(path), "--optim.lr", "0.5", "--data.limit", "3"])
    assert config.steps == 9 and config.blob == [1, 2]
    assert config.optim.lr == 0.5 and config.data == Data(path="file.jsonl", limit=3)


def test_yaml_reads_exponent_floats_as_floats(tmp_path):
    path = tmp_path / "c.yml"
    path.write_text("lr: 1e-4\n")
    assert load_file(path) == {"lr": 1e-4}


def test_unknown_key_is_one_short_line_naming_the_close_keys_and_the_file_that_defines_them():
    with pytest.raises(ConfigError) as exc:
        from_dict(Config, {"data": {"path": "x"}, "optim": {"lrr": 0.1}})
    module = Optim.__module__.replace(".", "/")
    assert str(exc.value) == (
        f"unknown key 'optim.lrr': did you mean 'optim.lr'? (optim's keys: {module}.py)"
    )
    with pytest.raises(ConfigError) as exc:
        from_dict(Config, {"data": {"path": "x"}, "cap": 1})  # a part of a key: that key
    assert str(exc.value).startswith("unknown key 'cap': did you mean 'capacity'? (the keys of")


@pytest.mark.parametrize(
    ("data", "needles"),
    [
        ({"steps": "100"}, ["steps", "expected int", "'100' (str)"]),
        ({"steps": True}, ["steps", "expected int", "True (bool)"]),
        ({"compile": 1}, ["compile", "expected bool"]),
        ({"optim": {"schedule": "exp"}}, ["optim.schedule", "one of 'cosine', 'linear'"]),
        ({"optim": {"betas": [0.9]}}, ["optim.betas", "expected 2 values"]),
        ({"tags": ["a", 3]}, ["tags[1]", "expected str"]),
        ({"data": {"path": "x", "limit": 1.5}}, ["data.limit", "int | None", "1.5"]),
        ({"optim": 3}, ["optim", "mapping of Optim settings"]),
        ({"color": "green"}, ["color", "'red', 'blue'"]),
        ({"cap": 1}, ["unknown key 'cap'"]),
        ({"capacity": "3MB"}, ["capacity", "4KiB"]),
    ],
)
def test_wrong_values_name_the_path_the_expected_type_and_the_value(data, needles):
    with pytest.raises(ConfigError) as exc:
        from_dict(Config, {"data": {"path": "x"}, **data})
    for needle in needles:
        assert needle in str(exc.value)


def test_post_init_errors_are_reraised_with_their_path():
    with pytest.raises(ConfigError, match=r"^extra: lr=-1.0: must be > 0"):
        from_dict(Config, {"data": {"path": "x"}, "extra": {"lr": -1}})
    with pytest.raises(ConfigError, match=r"^lr=0.0: must be > 0"):
        from_dict(Optim, {"lr": 0.0})


def test_missing_required_key_names_the_path_and_the_flag():
    with pytest.raises(ConfigError, match=r"missing required key 'data.path'.*--data.path"):
        from_dict(Config, {"data": {}})
    with pytest.raises(ConfigError, match="missing required key 'data.path'"):
        _parse([])  # an absent required section is empty: the message names its missing key


def test_int_values_are_accepted_for_float_fields_and_sizes_parse_from_strings():
    config = from_dict(Config, {"data": {"path": "x"}, "optim": {"lr": 1}, "capacity": "3KiB"})
    assert config.optim.lr == 1.0 and isinstance(config.optim.lr, float)
    assert config.capacity == 3072


def test_to_dict_is_json_and_round_trips_through_from_dict():
    config = Config(
        data=Data(path="c", limit=2),
        tags=["a"],
        shape=(1,),
        color=Color.BLUE,
        out=pathlib.Path("/x"),
        extra=Optim(lr=0.2, betas=(0.1, 0.2)),
        env={"K": "V"},
        blob={"nested": [1, "two"]},
    )
    data = to_dict(config)
    assert json.loads(json.dumps(data)) == data
    assert data["color"] == "blue" and data["shape"] == [1] and data["out"] == "/x"
    assert from_dict(Config, json.loads(json.dumps(data))) == config


def test_to_dict_rejects_values_without_a_json_form():
    with pytest.raises(TypeError, match="blob"):
        to_dict(Config(data=Data(path="x"), blob=object()))


def test_load_file_errors_name_the_file_and_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read"):
        load_file(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1,\n "b": }\n')
    with pytest.raises(ConfigError, match="not valid JSON.*line 2"):
        load_file(bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="not a mapping"):
        load_file(listing)


def test_load_file_returns_a_section_or_names_the_sections_it_has(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("queue: {capacity: 1}\ntrainer:\n  optim: {lr: 0.1}\n")
    assert load_file(path, section="trainer.optim") == {"lr": 0.1}
    with pytest.raises(ConfigError, match="no section 'teacher'.*queue, trainer"):
        load_file(path, section="teacher")


@dataclass
class Opaque:
    handle: object = None


def test_a_field_without_a_command_line_form_must_opt_out_of_the_flags():
    with pytest.raises(TypeError, match="Opaque.handle.*cli"):
        add_arguments(argparse.ArgumentParser(), Opaque)


@dataclass
class Source:
    path: str | tuple[object, object] | None = None


@dataclass
class Handles:
    handle: object | tuple[object, object] | None = None


def test_a_union_flag_reads_the_members_that_have_a_command_line_form():
    parser = argparse.ArgumentParser()
    add_arguments(parser, Source)
    assert from_args(Source, parser.parse_args(["--path", "p.pt"])) == Source("p.pt")
    assert from_args(Source, parser.parse_args(["--path", "none"])) == Source(None)
    with pytest.raises(TypeError, match="Handles.handle.*cli"):
        add_arguments(argparse.ArgumentParser(), Handles)


def test_generated_flags_never_clash_with_the_callers_own_arguments():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps-total", dest="steps", default="mine")
    add_arguments(parser, Config)
    args = parser.parse_args(["--data.path", "x", "--steps", "4"])
    assert args.steps == "mine" and from_args(Config, args).steps == 4


@dataclass
class Conn:
    host: str = field(metadata={"help": "server host"})
    port: int = 1


@dataclass
class Flat:
    conn: Conn = field(metadata={"flag": ""})
    verbose: bool = False


def test_a_section_with_an_empty_flag_name_gets_flags_without_its_prefix():
    parser = argparse.ArgumentParser()
    add_arguments(parser, Flat)
    assert from_args(Flat, parser.parse_args(["--host", "h", "--port", "2"])) == Flat(Conn("h", 2))
    with pytest.raises(ConfigError, match=r"missing required key 'conn.host' \(str\).*--host$"):
        from_args(Flat, parser.parse_args(["--verbose"]))


# ----------------------------------------------------------------------------- marks, context


@dataclass
class Link:
    queue: str = field(default="tcp://127.0.0.1:5555", metadata={"context": "queue"})
    corpus: str | None = field(default=None, metadata={"path": "file"})


@dataclass
class Proc:
    MOVED_KEYS: ClassVar[dict[str, str]] = {"beat": "beat_s", "link.address": "link.queue"}

    link: Link = field(default_factory=Link)
    spare: Link | None = None
    run_dir: str = field(default="runs/x", metadata={"context": "run_dir", "path": "run"})
    beat_s: float = field(default=1.0, metadata={"default_text": "one second"})


@dataclass
class Needs:
    host: str | None = field(default=None, metadata={"required": True, "flag": "at"})


CONTEXT = {
    "queue": "tcp://127.0.0.1:7",
    "partition": "p",
    "student_tokenizer": "s",
    "teacher_tokenizer": "t",
    "run_dir": "/runs/r",
}


def _proc(argv: list[str]) -> Proc:
    parser = argparse.ArgumentParser(prog="t")
    add_arguments(parser, Proc)
    return from_args(Proc, parser.parse_args(argv))


def test_marks_name_every_marked_field_of_the_tree_by_its_dotted_path():
    assert marks(Proc, "path") == {"link.corpus": "file", "spare.corpus": "file", "run_dir": "run"}
    assert marks(Proc, "context") == {
        "link.queue": "queue",
        "spare.queue": "queue",
        "run_dir": "run_dir",
    }


def test_the_context_fills_what_the_config_file_and_the_flags_leave_unset(tmp_path):
    context = tmp_path / "context.json"
    context.write_text(json.dumps(CONTEXT))
    config = _proc(["--context", str(context)])
    assert (config.link.queue, config.run_dir) == ("tcp://127.0.0.1:7", "/runs/r")
    own = tmp_path / "own.json"
    own.write_text(json.dumps({"run_dir": "/elsewhere"}))
    config = _proc(["--context", str(context), "--config", str(own), "--link.queue", "ipc://q"])
    assert (config.link.queue, config.run_dir) == ("ipc://q", "/elsewhere")
    assert _proc([]).link.queue == "tcp://127.0.0.1:5555"  # no context: the defaults


def test_a_section_leaves_out_the_context_and_with_context_puts_it_back():
    proc = Proc(link=Link(queue="tcp://h:1", corpus="c.txt"), run_dir="/r")
    own = section(proc)
    assert own == {"link": {"corpus": "c.txt"}, "spare": None, "beat_s": 1.0}
    back = with_context(Proc, own, {**CONTEXT, "queue": "tcp://h:1", "run_dir": "/r"})
    assert from_dict(Proc, back) == proc
    assert own == {"link": {"corpus": "c.txt"}, "spare": None, "beat_s": 1.0}  # not modified


def test_a_bad_context_file_names_the_file_and_the_key(tmp_path):
    context = tmp_path / "context.json"
    context.write_text(json.dumps({**CONTEXT, "queues": "x"}))
    with pytest.raises(ConfigError, match=r"context file '.*context\.json': unknown key 'queues'"):
        load_context(context)
    with pytest.raises(ConfigError, match=r"context file '.*none\.json' cannot be read"):
        load_context(tmp_path / "none.json")


def test_only_a_config_with_context_fields_takes_a_context_flag():
    parser = argparse.ArgumentParser(prog="t")
    add_arguments(parser, Config)
    assert "--context" not in parser._option_string_actions


def test_a_moved_key_is_refused_in_one_line_naming_its_new_key():
    with pytest.raises(ConfigError, match=r"^beat moved to beat_s$"):
        from_dict(Proc, {"beat": 2.0})
    with pytest.raises(ConfigError, match=r"^proc\.link\.address moved to proc\.link\.queue$"):
        from_dict(Proc, {"link": {"address": "tcp://h:1"}}, path="proc")
    assert from_dict(Proc, {"beat_s": 2.0}).beat_s == 2.0


@dataclass
class Renamed:
    """A flat ``link`` string moved into the section of that name; ``beat`` into ``timing``."""

    MOVED_KEYS: ClassVar[dict[str, str]] = {"link": "link.queue", "beat": "timing.beat_s"}

    link: Link = field(default_factory=Link)
    timing: Proc = field(default_factory=Proc)


def test_a_key_moved_into_the_section_of_its_name_is_the_old_key_only_when_no_mapping():
    with pytest.raises(ConfigError, match=r"^link moved to link\.queue$"):
        from_dict(Renamed, {"link": "tcp://h:1"})
    assert from_dict(Renamed, {"link": {"queue": "tcp://h:1"}}).link.queue == "tcp://h:1"
    given = Link(queue="tcp://h:2")
    assert from_dict(Renamed, {"link": given}).link is given


def test_the_flag_of_a_moved_key_is_named_with_its_new_flag():
    parser = argparse.ArgumentParser(prog="t", allow_abbrev=False)  # as xtoken's parsers
    add_arguments(parser, Renamed)
    args, unknown = parser.parse_known_args(["--beat", "2", "--timing.beat-s", "3"])
    assert moved_flag(args, unknown) == "t: --beat moved to --timing.beat-s"
    args, unknown = parser.parse_known_args(["--timing.beat=2"])  # the nested class's own move
    assert moved_flag(args, unknown) == "t: --timing.beat moved to --timing.beat-s"
    args, unknown = parser.parse_known_args(["--link", "tcp://h:1"])
    assert moved_flag(args, unknown) == "t: --link moved to --link.queue"
    assert moved_flag(*parser.parse_known_args(["--other", "1"])) is None


def test_a_required_mark_is_checked_where_the_process_reads_its_flags():
    assert from_dict(Needs, {}).host is None  # a run's section: the run sets it
    parser = argparse.ArgumentParser(prog="t")
    add_arguments(parser, Needs)
    with pytest.raises(ConfigError, match=r"missing required key 'host' \(str\): .* with --at$"):
        from_args(Needs, parser.parse_args([]))
    assert from_args(Needs, parser.parse_args(["--at", "h"])).host == "h"
