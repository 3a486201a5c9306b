"""The plan of a run: pure (it writes nothing), and it carries the settled projection into the
trainer's section, so no placeholder ever reaches a section file; the structured failure."""

from __future__ import annotations

import json

import pytest

from services.collator.config import CollatorConfig
from services.common import config as cfgmod
from services.queue.config import ServerConfig
from services.supervise.config import run_config_from_dict
from services.supervise.driver import Driver, write_sections
from services.supervise.events import Failed, Failure
from services.supervise.plan import Host, RunPlace, make_plan
from services.supervise.preflight import Inputs
from services.teacher.config import TeacherConfig
from services.trainer.config import TrainerConfig


def _config(tmp_path, **loss):
    return run_config_from_dict(
        {
            "run_dir": str(tmp_path / "run"),
            "teachers": 1,
            "trainers": 2,
            "trainer": {"student": {"model": "tiny"}, "loss": loss},
            "teacher": {"model": "tiny"},
        }
    )


def test_a_config_that_leaves_the_projection_to_the_run_names_none(tmp_path):
    config = _config(tmp_path)
    assert config.trainer.loss.projection is None and config.trainer.projection_to_build
    given = _config(tmp_path, projection="/p.pt")
    assert not given.trainer.projection_to_build
    assert not _config(tmp_path, mode="ce").trainer.projection_to_build


def test_a_trainer_section_still_checks_everything_but_the_projection(tmp_path):
    with pytest.raises(cfgmod.ConfigError, match=r"^trainer\.feed: micro_batch=0: must be >= 1$"):
        run_config_from_dict({"trainer": {"feed": {"micro_batch": 0}}})


def test_the_plan_writes_nothing_and_carries_the_settled_projection(tmp_path):
    config = _config(tmp_path)
    context = RunPlace.of(config, "r1")
    inputs = Inputs("/data/train.jsonl", "/data/heldout.txt", "/cache/proj.pt")
    plan = make_plan(config, inputs, context, queue="tcp://127.0.0.1:7", master_port=9, host=Host())
    assert not context.run_dir.exists()  # nothing written
    trainer = cfgmod.from_dict(TrainerConfig, plan.sections["trainer"])
    assert trainer.loss.projection == "/cache/proj.pt"
    assert plan.run_section["trainer"]["loss"]["projection"] == "/cache/proj.pt"
    assert plan.run_section["data"]["train"] == "/data/train.jsonl"
    assert plan.sections["collator"]["data"]["train"] == "/data/train.jsonl"
    assert config.trainer.loss.projection is None  # the config is left as it was
    write_sections(plan)
    written = json.loads((context.run_dir / "config" / "trainer.json").read_text())
    assert written == plan.sections["trainer"]


def test_each_process_is_handed_its_section_and_the_shared_context_and_nothing_else(tmp_path):
    config = _config(tmp_path)
    context = RunPlace.of(config, "r1")
    inputs = Inputs("/data/train.jsonl", "/data/heldout.txt", "/cache/proj.pt")
    plan = make_plan(config, inputs, context, queue="tcp://127.0.0.1:7", master_port=9, host=Host())
    write_sections(plan)
    config_dir = context.run_dir / "config"
    shared = json.loads((config_dir / "context.json").read_text())
    assert shared == {
        "queue": "tcp://127.0.0.1:7",
        "partition": "train",
        "student_tokenizer": "qwen3",
        "teacher_tokenizer": "smollm2",
        "ctx_student": 512,
        "ctx_teacher": 512,
        "pack": False,
        "kd_where_agrees": None,
        "run_dir": str(context.run_dir),
    }
    classes = {
        "queue": ServerConfig,
        "collator": CollatorConfig,
        "teacher": TeacherConfig,
        "trainer": TrainerConfig,
    }
    for spec in plan.specs:
        section = spec.name if spec.role != "trainer" else "trainer"
        flags = [
            "--config",
            str(config_dir / f"{section}.json"),
            "--context",
            str(config_dir / "context.json"),
        ]
        assert spec.argv[-4:] == flags and not any(a.startswith("--") for a in spec.argv[:-4])
        own = json.loads((config_dir / f"{section}.json").read_text())
        assert not set(own) & set(cfgmod.marks(classes[spec.role], "context"))  # not copied
        built = cfgmod.from_dict(
            classes[spec.role], cfgmod.with_context(classes[spec.role], own, shared)
        )
        if spec.role == "collator":
            assert (built.worker.queue, built.worker.partition) == (shared["queue"], "train")
            assert (built.worker.student, built.data.train) == ("qwen3", "/data/train.jsonl")
        elif spec.role == "queue":
            assert built.bind == shared["queue"] and built.capacity_bytes == 4 << 30
        else:
            assert (built.queue, built.partition) == (shared["queue"], "train")
            assert built.run_dir == str(context.run_dir)


def test_pack_packs_the_collator_and_tells_the_trainers_and_teachers(tmp_path):
    data = {"run_dir": str(tmp_path / "run"), "pack": True}
    config = run_config_from_dict(data)
    assert not config.trainer.pack and not config.teacher.pack  # the run's, not copied
    inputs = Inputs("/data/train.jsonl", "/data/heldout.txt", "/cache/proj.pt")
    queue = "tcp://127.0.0.1:7"
    plan = make_plan(config, inputs, RunPlace.of(config), queue=queue, master_port=9, host=Host())
    assert plan.shared["pack"] is True
    # the context's, once
    assert "pack" not in plan.sections["trainer"] and "pack" not in plan.sections["teacher0"]
    assert "pack" not in plan.sections["collator"]["worker"]
    built = {
        name: cfgmod.from_dict(cls, cfgmod.with_context(cls, plan.sections[name], plan.shared))
        for name, cls in (
            ("collator", CollatorConfig),
            ("trainer", TrainerConfig),
            ("teacher0", TeacherConfig),
        )
    }
    assert built["collator"].worker.pack and built["trainer"].pack and built["teacher0"].pack
    assert run_config_from_dict(plan.run_section).pack  # a re-read run stays packed
    unpacked = make_plan(
        run_config_from_dict({"run_dir": str(tmp_path / "run")}),
        inputs,
        RunPlace.of(config),
        queue=queue,
        master_port=9,
        host=Host(),
    )
    assert unpacked.shared["pack"] is False


@pytest.mark.parametrize("section", ["trainer", "teacher", "collator.worker"])
def test_a_section_that_packs_on_its_own_is_refused_naming_the_runs_key(section):
    data: dict = {}
    node = data
    for part in section.split("."):
        node = node.setdefault(part, {})
    node["pack"] = True
    with pytest.raises(cfgmod.ConfigError, match=rf"^{section}.pack is set by the run from pack"):
        run_config_from_dict(data)
    with pytest.raises(cfgmod.ConfigError, match=r"^collator\.pack moved to pack$"):
        run_config_from_dict({"collator": {"pack": True}})


def test_a_plan_without_the_projection_it_needs_is_refused(tmp_path):
    config = _config(tmp_path)
    with pytest.raises(ValueError, match=r"loss\.mode=pkl needs loss\.projection"):
        make_plan(
            config,
            Inputs.given(config),
            RunPlace.of(config),
            queue="tcp://127.0.0.1:7",
            master_port=1,
            host=Host(),
        )


def test_a_restored_driver_plans_the_sections_of_the_launch_it_rebuilds(tmp_path):
    config = _config(tmp_path)
    inputs = Inputs("/data/train.jsonl", "/data/heldout.txt", "/cache/proj.pt")
    launched = Driver(config, run_id="r1", inputs=inputs)
    state = {"queue": "tcp://127.0.0.1:7", "master_port": 9, "inputs": inputs.to_dict()}
    restored = Driver(_config(tmp_path), run_id="r1")  # as a new control plane builds it
    restored.restore(json.loads(json.dumps(state)))
    assert restored.plan.sections == launched.make_plan("tcp://127.0.0.1:7", 9).sections
    assert not (tmp_path / "run" / "config").exists()  # a restore writes no section


def test_a_failure_keeps_its_fields_and_prints_the_log_tail():
    failure = Failure("teacher0", "teacher", 3, "teacher0 exited with code 3", "/l.log", "boom")
    assert failure.message() == ("teacher0 exited with code 3; last log lines (/l.log):\nboom")
    assert Failure("queue", "queue", None, "queue lost").message() == "queue lost"
    assert Failed(failure).data() == {
        "process": "teacher0",
        "role": "teacher",
        "code": 3,
        "reason": "teacher0 exited with code 3",
    }
