"""A run config's section is its process's config, and a value has one owner.

A new key is one field in one dataclass: added to the collator's config class at run time, it is
at once a flag of `xtoken collator`, a key of a run config's YAML, a `--set` key, a key of a
REST submission (confined as the path it is marked to be), part of the resume fingerprint (it is
marked trained) and a value of the collator's section file, with no other edit. Values the run
sets for a process (marked ``context`` or ``derived``) reach it from their one source and are no
keys of a run config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
from dataclasses import field
from pathlib import Path

import pytest

from services.collator import config as collator_config
from services.common import config as cfgmod
from services.common.context import Shared
from services.common.overrides import parse_override
from services.supervise import config as run_config
from services.supervise import plan as plan_module
from services.supervise.config import RunConfig, load_run_config, run_config_from_dict
from services.supervise.plan import Host, RunPlace, make_plan
from services.supervise.preflight import Inputs
from services.supervise.resume import fingerprint

ROOT = Path(__file__).resolve().parents[3]
SPILL = {"help": "a file the collator also reads", "path": "file", "trained": True}


@pytest.fixture
def spill(monkeypatch):
    """The collator's config with one more field, ``spill``, where its class is looked up: the
    collator's CLI, the run config's ``collator`` section, the plan."""
    Extra = dataclasses.make_dataclass(
        "CollatorConfig",
        [("spill", str | None, field(default=None, metadata=SPILL))],
        bases=(collator_config.CollatorConfig,),
    )
    RunExtra = dataclasses.make_dataclass(
        "RunCollatorConfig", [], bases=(run_config.RunCollatorConfig, Extra)
    )
    Run = dataclasses.make_dataclass(
        "RunConfig",
        [("collator", RunExtra, field(default_factory=RunExtra))],
        bases=(RunConfig,),
    )
    monkeypatch.setattr(collator_config, "CollatorConfig", Extra)
    monkeypatch.setattr(plan_module, "CollatorConfig", Extra)
    monkeypatch.setattr(run_config, "RunConfig", Run)
    return Extra


def test_a_new_field_of_a_section_is_a_flag_a_key_a_set_a_rest_key_a_path_and_trained(
    spill, tmp_path, monkeypatch
):
    from services import cli

    # the process's flag
    args = cli.build_parser().parse_args(
        ["collator", "--data", "c.jsonl", "--queue", "tcp://127.0.0.1:1", "--student", "qwen3",
         "--teacher", "smollm2", "--spill", "s.jsonl"]
    )  # fmt: skip
    assert cfgmod.from_args(spill, args).spill == "s.jsonl"

    # the run config's YAML key and --set
    path = tmp_path / "run.yaml"
    path.write_text(f"run_dir: {tmp_path / 'run'}\ncollator:\n  spill: data/s.jsonl\n")
    assert load_run_config(path).collator.spill == "data/s.jsonl"
    config = load_run_config(path, [parse_override("collator.spill=t.jsonl")])
    assert config.collator.spill == "t.jsonl"
    with pytest.raises(cfgmod.ConfigError, match=r"^collator\.spill: expected str"):
        load_run_config(path, [parse_override("collator.spill=[1]")])

    # the resume fingerprint (marked trained) and the collator's section file
    assert fingerprint(config)["collator.spill"] == "t.jsonl"
    inputs = Inputs("/data/train.jsonl", "/data/heldout.jsonl", "/p.pt")
    plan = make_plan(
        config, inputs, RunPlace.of(config), queue="tcp://127.0.0.1:7", master_port=1,
        host=Host(),
    )  # fmt: skip
    section = plan.sections["collator"]
    assert section["spill"] == "t.jsonl"
    built = cfgmod.from_dict(spill, cfgmod.with_context(spill, section, plan.shared))
    assert built.spill == "t.jsonl"
    assert run_config_from_dict(plan.run_section).collator.spill == "t.jsonl"

    # REST: submitted, confined to the data roots, refused outside them, checked like YAML
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "s.jsonl").write_text('{"text": "a text"}\n')
    with _control_plane(tmp_path, monkeypatch) as (client, records):
        r = client.post("/v1/runs", json={"run_dir": "r1", "collator": {"spill": "s.jsonl"}})
        assert r.status_code == 201, r.text
        assert records[-1]["collator"]["spill"] == str((tmp_path / "data" / "s.jsonl").resolve())
        r = client.post("/v1/runs", json={"run_dir": "r2", "collator": {"spill": "/etc/passwd"}})
        assert r.status_code == 403 and r.json()["key"] == "collator.spill", r.text
        r = client.post("/v1/runs", json={"run_dir": "r3", "collator": {"spill": 3}})
        assert r.status_code == 422 and r.json()["key"] == "collator.spill", r.text
        r = client.post("/v1/runs", json={"run_dir": "r4", "queue_capacity": "1GiB"})
        assert r.status_code == 422, r.text
        assert r.json()["error"] == "queue_capacity moved to queue.capacity_bytes"
        r = client.post("/v1/runs", json={"run_dir": "r5", "rollout": {"queue": "tcp://h:1"}})
        assert r.status_code == 403 and r.json()["key"] == "rollout.queue", r.text
        r = client.post("/v1/runs", json={"run_dir": "r6", "trainer": {"micro_batch": 4}})
        assert r.status_code == 422, r.text
        assert r.json()["error"] == "trainer.micro_batch moved to trainer.feed.micro_batch"


@contextlib.contextmanager
def _control_plane(tmp_path: Path, monkeypatch):
    """An in-process app over a supervisor that records each accepted run instead of starting
    it: yields a client and the list of recorded configs."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from services.control.app import create_app
    from services.control.settings import Settings
    from services.control.store import Store
    from services.control.supervisor import Supervisor

    settings = Settings(runs_root=tmp_path / "runs", data_root=[tmp_path / "data"])
    sup = Supervisor(
        Store(tmp_path / "control.db"), runs_root=settings.runs_root,
        data_roots=settings.data_root,
    )  # fmt: skip
    records: list[dict] = []
    monkeypatch.setattr(sup, "_spawn", lambda run_id, config, launch: records.append(config))
    try:
        with TestClient(create_app(settings, supervisor=sup), base_url="http://127.0.0.1") as c:
            yield c, records
    finally:
        sup.shutdown()
        sup.store.close()


# ----------------------------------------------------------------------------- one owner


def test_the_shared_settings_are_top_level_keys_and_what_the_processes_take_from_the_context():
    shared = {f.name for f in dataclasses.fields(Shared)}
    assert shared <= {f.name for f in dataclasses.fields(RunConfig)}
    # every shared setting is read by some process, and a process reads nothing else from it
    assert set(cfgmod.marks(RunConfig, "context").values()) == shared | {"queue"}


def test_every_key_a_section_copies_reaches_its_process_from_its_source(tmp_path):
    """Each field marked ``derived`` with a key of the run config holds that key's value in the
    process's section, and the run config's own field keeps its default (nothing written
    back)."""
    config = run_config_from_dict(
        {
            "run_dir": str(tmp_path / "run"), "teachers": 2, "trainers": 2, "rollouts": 1,
            "data": {"on_policy_fraction": 0.5},
            "teacher": {"seed": 3, "vocab_size": 300, "model": "tiny"},
            "trainer": {"student": {"model": "tiny", "seed": 5, "vocab_size": 200},
                        "eval": {"texts": 7, "ctx": 99}, "schedule": {"max_steps": 3},
                        "loss": {"projection": "/p.pt"}},
        }
    )  # fmt: skip
    plan = make_plan(
        config, Inputs.given(config), RunPlace.of(config), queue="tcp://127.0.0.1:7",
        master_port=1, host=Host(gpus=0),
    )  # fmt: skip
    sections = {"trainer": "trainer", "teacher": "teacher0", "rollout": "rollout0"}
    checked = 0
    for key, source in cfgmod.marks(RunConfig, "derived").items():
        name, *path = key.split(".")
        if name not in sections or not run_config.is_run_key(source):
            continue
        node = plan.sections[sections[name]]
        for part in path:
            node = node[part]
        assert node == run_config.value_at(config, source), key
        default = run_config.value_at(type(config)(), key)
        assert run_config.value_at(config, key) == default, f"{key} written back"
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        ({"trainer": {"queue": "tcp://h:1"}}, r"^trainer\.queue is set by the run: its queue"),
        ({"teacher": {"tokenizer": "x"}}, r"^teacher\.tokenizer is set by the run from "
         r"teacher_tokenizer; set teacher_tokenizer only$"),
        ({"queue": {"bind": "tcp://127.0.0.1:1"}}, r"^queue\.bind is set by the run"),
        ({"queue": {"auth_token": "s"}}, r"^queue\.auth_token is set by the run \(the token"),
        ({"collator": {"data": {"limit": 3}}}, r"^collator\.data is set by the run from data; "
         r"set data only$"),
        ({"teacher": {"group": 1}}, r"^teacher\.group is set by the run \(each teacher group"),
        ({"teacher": {"eval_ctx": 64}}, r"^teacher\.eval_ctx=64 but trainer\.eval\.ctx=512; set "
         r"trainer\.eval\.ctx only"),
        ({"trainer": {"feed": {"ordered": True}}}, r"^trainer\.feed\.ordered=True but "
         r"data\.ordered=False"),
        ({"trainer": {"teacher": {"groups": 2}}}, r"^trainer\.teacher\.groups=2 but teachers=1"),
        ({"trainer": {"eval": {"heldout": "h.jsonl"}}}, r"^trainer\.eval\.heldout='h\.jsonl' "
         r"but data\.heldout=None; set data\.heldout only"),
        ({"teacher": {"heldout": "h.jsonl"}}, r"^teacher\.heldout='h\.jsonl' but "
         r"data\.heldout=None; set data\.heldout only"),
        ({"trainer": {"dead_after_s": 2}}, r"^trainer\.dead_after_s moved to "
         r"trainer\.teacher\.dead_after_s$"),
        ({"trainer": {"micro_batch": 2}}, r"^trainer\.micro_batch moved to "
         r"trainer\.feed\.micro_batch$"),
        ({"trainer": {"student": "tiny"}}, r"^trainer\.student moved to trainer\.student\.model$"),
        ({"trainer": {"ordered": True}}, r"^trainer\.ordered moved to trainer\.feed\.ordered$"),
        ({"teacher": {"heartbeat_s": 2}}, r"^teacher\.heartbeat_s moved to "
         r"teacher\.ring_heartbeat_s$"),
    ],
)  # fmt: skip
def test_a_key_the_run_sets_is_refused_naming_the_one_to_set(data, pattern):
    with pytest.raises(cfgmod.ConfigError, match=pattern):
        run_config_from_dict(data)


def test_a_value_equal_to_its_source_is_accepted_and_the_run_configs_record_reads_back():
    config = run_config_from_dict(
        {"teachers": 2, "trainers": 2, "trainer": {"teacher": {"groups": 2}}}
    )
    record = run_config.run_config_to_dict(config)
    assert "groups" not in record["trainer"]["teacher"] and "queue" not in record["trainer"]
    again = run_config_from_dict(json.loads(json.dumps(record)))
    assert run_config.run_config_to_dict(again) == record


@pytest.mark.parametrize(
    ("text", "sets", "line"),
    [
        ("queue_capacity: 1GiB\n", [], "queue_capacity moved to queue.capacity_bytes"),
        ("trainer:\n  teacher_timeout_s: 5\n", [],
         "trainer.teacher_timeout_s moved to trainer.teacher.timeout_s"),
        ("", ["--set", "trainer.micro_batch=4"],
         "trainer.micro_batch moved to trainer.feed.micro_batch"),
        ("", ["--set", "trainer.student=tiny"], "trainer.student moved to trainer.student.model"),
    ],
    ids=["run-key", "yaml", "set", "set-section-name"],
)  # fmt: skip
def test_xtoken_run_refuses_a_moved_key_in_one_line_exit_2(tmp_path, text, sets, line):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "run", str(path), "--check", *sets],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr == f"xtoken run: {line}\n"


def test_every_example_config_loads():
    examples = sorted((ROOT / "examples").glob("*.yaml"))
    assert examples
    for path in examples:
        load_run_config(path)
