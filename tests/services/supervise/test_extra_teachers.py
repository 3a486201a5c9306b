"""A run of several teachers (``extra_teachers``): an entry's keys not given take the teacher
section's, the refusals name the entry's key in one line, and the plan hands each teacher's groups
their own section, process names (``t<j>.teacher<g>``), GPUs and transport, the collator every
teacher's tokenizer and the trainer every teacher's link; the pre-flight checks or builds one
projection per teacher."""

from __future__ import annotations

import json

import pytest

from services.common import config as cfgmod
from services.common.config import ConfigError, leaf_paths, marks
from services.supervise.config import (
    RunConfig,
    RunExtraTeacherConfig,
    RunTeacherConfig,
    run_config_from_dict,
    run_config_to_dict,
)
from services.supervise.layout import GIB, GpuMemory, Layout, check_layout, plan_layout
from services.supervise.plan import Host, RunPlace, make_plan
from services.supervise.preflight import Inputs, preflight
from services.supervise.projections import projection_cache_path
from services.supervise.resume import fingerprint
from services.teacher.config import TeacherConfig
from services.trainer.config import TrainerConfig
from tests.services.control.conftest import tiny_config
from xtoken_core.errors import SettingsError

SECOND = {"tokenizer": "qwen3", "model": "tiny"}


def _config(extra=(SECOND,), **overrides):
    return run_config_from_dict(tiny_config(extra_teachers=list(extra), **overrides))


def _plan(config, inputs=None, gpus=None):
    inputs = inputs or Inputs("/d/train.jsonl", "/d/heldout.txt", "/p/0.pt", None, ("/p/1.pt",))
    place = RunPlace.of(config, "r1")
    host = Host(gpus=gpus, cores=8)
    return make_plan(config, inputs, place, queue="tcp://127.0.0.1:7", master_port=9, host=host)


# ----------------------------------------------------------------------------- the run config


def test_an_entry_takes_the_teacher_sections_keys_it_does_not_give_but_its_own():
    config = _config(
        [{**SECOND, "top_k": 9}],
        **{"teacher.weight": 0.5, "teacher.model": "tiny", "teacher.checksum": True},
    )
    extra = config.extra_teachers[0]
    assert (extra.tokenizer, extra.model, extra.top_k) == ("qwen3", "tiny", 9)  # its own
    assert (extra.transport, extra.max_batch, extra.max_length, extra.checksum) == (
        "shm", 4, 64, True
    )  # the teacher section's  # fmt: skip
    assert extra.weight == 1.0 and extra.groups is None and extra.projection is None
    assert config.teacher_list()[1].groups == config.teachers  # groups: null -> teachers


def test_an_entry_given_in_code_as_a_mapping_takes_the_teacher_sections_keys_too():
    teacher = TeacherConfig(model="tiny", transport="shm", max_batch=4)
    config = RunConfig(teacher=teacher, extra_teachers=[{"tokenizer": "qwen3", "model": "tiny"}])
    assert isinstance(config.teacher, RunTeacherConfig)
    extra = config.extra_teachers[0]
    assert isinstance(extra, RunExtraTeacherConfig)
    assert (extra.transport, extra.max_batch, extra.weight) == ("shm", 4, 1.0)


def test_a_run_config_with_extra_teachers_reads_back_as_written():
    config = _config([{**SECOND, "weight": 0.25, "groups": 1, "projection": "/p/1.pt"}])
    data = json.loads(json.dumps(run_config_to_dict(config)))
    assert "group" not in data["extra_teachers"][0]  # keys the run sets are no keys of an entry
    again = run_config_from_dict(data)
    assert again.extra_teachers == config.extra_teachers
    assert run_config_to_dict(again) == run_config_to_dict(config)


def test_every_setting_of_an_entry_says_whether_it_changes_what_is_trained():
    trained = marks(RunExtraTeacherConfig, "trained")
    unmarked = [k for k in leaf_paths(RunExtraTeacherConfig) if k not in trained]
    assert not unmarked, f"mark these fields 'trained': True or False: {unmarked}"
    assert trained["tokenizer"] and trained["model"] and trained["weight"]
    assert not trained["projection"] and not trained["groups"]


def test_the_fingerprint_records_each_teachers_trained_settings():
    one, two = _config([{**SECOND, "weight": 0.5}]), _config([{**SECOND, "weight": 0.7}])
    assert fingerprint(one)["extra_teachers"] == [
        {"model": "tiny", "tokenizer": "qwen3", "vocab_size": None, "top_k": 64, "seed": 0,
         "weight": 0.5}
    ]  # fmt: skip
    assert fingerprint(one) != fingerprint(two)
    moved = _config([{**SECOND, "weight": 0.5, "device": "cpu", "groups": 1}])
    assert fingerprint(moved) == fingerprint(one)  # devices and groups train the same
    assert fingerprint(_config(**{"teacher.weight": 0.5}))["teacher.weight"] == 0.5


def test_a_tokenizer_equal_to_the_students_is_a_teacher_like_any_other():
    config = _config([{"tokenizer": "mistral", "model": "tiny"}])  # the student's tokenizer
    assert config.teacher_list()[1].tokenizer == "mistral"


@pytest.mark.parametrize(
    ("entry", "overrides", "message"),
    [
        ({"model": "tiny"}, {}, r"^extra_teachers\[0\]: tokenizer is required: this teacher's "
         r"tokenizer, a name or a path"),
        ({"tokenizer": "qwen3"}, {}, r"^extra_teachers\[0\]: model is required"),
        ({"tokenizer": "smollm2", "model": "tiny"}, {},
         r"^extra_teachers\[0\]: tokenizer 'smollm2' and model 'tiny' are teacher 0's "
         r"\(teacher_tokenizer, teacher\.model\): one teacher twice adds nothing; drop the entry "
         r"and raise that teacher's weight instead$"),
        ({**SECOND, "pack": True}, {}, r"^extra_teachers\[0\]\.pack is set by the run from pack; "
         r"set pack only$"),
        ({**SECOND, "group": 1}, {}, r"^extra_teachers\[0\]\.group is set by the run"),
        ({**SECOND, "groups": 2}, {}, r"^extra_teachers\[0\]\.groups=2 > trainers=1"),
        ({**SECOND, "max_batch": 2}, {}, r"^extra_teachers\[0\]\.max_batch=2 < "
         r"trainer\.feed\.micro_batch=4: .*raise extra_teachers\[0\]\.max_batch$"),
        ({**SECOND, "max_length": 32}, {}, r"^extra_teachers\[0\]\.max_length=32 < "
         r"ctx_teacher=64"),
        ({**SECOND, "resources": {"node_b": 1}}, {},
         r"^extra_teachers\[0\]\.transport=shm: a ring cannot reach trainer ranks on other "
         r"nodes"),
        ({**SECOND, "weight": -1.0}, {}, r"^extra_teachers\[0\]: weight=-1\.0: must be a finite "
         r"number >= 0$"),
        (SECOND, {"trainer.extra_teachers": []}, r"^trainer\.extra_teachers is set by the run"),
        (SECOND, {"data.on_policy_fraction": 0.5, "trainer.schedule.max_steps": 4},
         r"^data\.on_policy_fraction=0\.5 with 1 extra_teachers: the rollout workers' samples "
         r"carry teacher 0's tokens"),
    ],
    ids=["no-tokenizer", "no-model", "teacher-0-twice", "context-key", "derived-key",
         "groups-past-trainers", "max-batch", "max-length", "ring-apart", "weight",
         "trainer-section", "on-policy"],
)  # fmt: skip
def test_a_bad_entry_is_refused_in_one_line_naming_its_key(entry, overrides, message):
    with pytest.raises(ConfigError, match=message) as refused:
        _config([entry], **overrides)
    assert "\n" not in str(refused.value)


def test_the_same_teacher_twice_among_the_extra_teachers_is_refused():
    with pytest.raises(ConfigError, match=r"^extra_teachers\[1\]: .* are those of "
                       r"extra_teachers\[0\]: one teacher twice"):  # fmt: skip
        _config([SECOND, dict(SECOND)])
    _config([SECOND, {**SECOND, "model": "tiny-2"}])  # another model of that family: a teacher


# ----------------------------------------------------------------------------- the plan


def test_the_plan_names_each_teachers_groups_apart_and_hands_each_its_own_section():
    config = _config(
        [{**SECOND, "weight": 0.25, "groups": 2, "top_k": 7}],
        trainers=2,
        **{"teacher.weight": 0.5},
    )
    plan = _plan(config)
    assert [n for n in plan.sections if "teacher" in n] == ["teacher0", "t1.teacher0",
                                                           "t1.teacher1"]  # fmt: skip
    second = plan.sections["t1.teacher1"]
    assert (second["teacher"], second["group"], second["tokenizer"]) == (1, 1, "qwen3")
    assert (second["top_k"], second["heldout"]) == (7, None)  # only teacher 0's group 0 evaluates
    assert "tokenizer" not in plan.sections["teacher0"]  # teacher 0's comes from the context
    built = cfgmod.from_dict(TeacherConfig, cfgmod.with_context(TeacherConfig, second, plan.shared))
    assert built.tokenizer == "qwen3" and built.teacher == 1
    names = [s.name for s in plan.specs]
    assert names == ["queue", "collator", "teacher0", "t1.teacher0", "t1.teacher1", "trainer0",
                     "trainer1"]  # fmt: skip
    spec = next(s for s in plan.specs if s.name == "t1.teacher1")
    assert spec.argv[-3].endswith("config/t1.teacher1.json") and spec.role == "teacher"
    assert spec.ready_file.endswith("ready/t1.teacher1") and spec.log_file.endswith(
        "logs/t1.teacher1.log"
    )
    assert spec.env["OMP_NUM_THREADS"] == "1"  # 8 cores over 3 teacher and 2 trainer processes


def test_the_trainer_gets_every_teachers_link_and_the_collator_every_tokenizer():
    config = _config(
        [{**SECOND, "weight": 0.25}],
        **{"teacher.weight": 0.5, "trainer.teacher.verify_logits": True},
    )
    plan = _plan(config)
    trainer = cfgmod.from_dict(
        TrainerConfig, cfgmod.with_context(TrainerConfig, plan.sections["trainer"], plan.shared)
    )
    assert trainer.teacher.weight == 0.5
    [link] = trainer.extra_teachers
    assert (link.tokenizer, link.weight, link.projection) == ("qwen3", 0.25, "/p/1.pt")
    assert link.groups == 1
    assert link.model is None and link.verify_logits  # a ring: the trainer needs no model
    assert plan.sections["collator"]["worker"]["extra_teachers"] == ["qwen3"]
    assert plan.run_section["extra_teachers"][0]["projection"] == "/p/1.pt"
    one = _plan(_config([]), Inputs("/d/t.jsonl", "/d/h.txt", "/p/0.pt"))
    assert one.sections["trainer"]["extra_teachers"] == []  # one teacher is a list of one
    assert one.sections["collator"]["worker"]["extra_teachers"] == []


def test_a_tensor_parallel_extra_teacher_is_a_unit_of_ranks_named_after_it():
    config = _config(
        [{**SECOND, "tensor_parallel": 2, "gpus": [2, 3], "transport": "cuda_ipc",
          "device": "cuda"}],
        **{"trainer.compute.device": "cuda"},
    )  # fmt: skip
    plan = _plan(config, gpus=4)
    ranks = [s for s in plan.specs if s.name.startswith("t1.")]
    assert [s.name for s in ranks] == ["t1.teacher0", "t1.teacher0.1"]
    assert {s.unit for s in ranks} == {"t1.teacher0"}
    assert [s.env["LOCAL_RANK"] for s in ranks] == ["2", "3"]
    assert ranks[1].ready_file is None  # rank 0 speaks for its group
    assert plan.sections["t1.teacher0"]["device"] == "cuda"


def test_each_teacher_resolves_its_own_transport():
    config = _config(
        [{**SECOND, "transport": "auto", "resources": {"node_b": 1}}], trainers=1
    )  # teacher 1 apart from the trainers: topk; teacher 0 beside them: a ring
    plan = _plan(config)
    assert plan.sections["teacher0"]["transport"] == "shm"
    assert plan.sections["t1.teacher0"]["transport"] == "topk"
    spec = next(s for s in plan.specs if s.name == "t1.teacher0")
    assert spec.group == "t1.teacher0" and spec.resources == {"node_b": 1}


# ----------------------------------------------------------------------------- the layout


def _cuda(extra, **overrides):
    return _config(
        [{**SECOND, **extra}],
        **{"trainer.compute.device": "cuda", "teacher.device": "cuda",
           "teacher.transport": "cuda_ipc", **overrides},
    )  # fmt: skip


def test_each_extra_teacher_places_its_groups_by_its_own_gpus():
    config = _cuda({"gpus": [1]})
    layout = plan_layout(config, 2)
    assert layout == Layout((0,), ((0,),), (((1,),),))
    assert layout.describe() == (
        "trainer ranks on GPU 0; teacher group 0 on GPU 0; teacher 1 group 0 on GPU 1"
    )
    check_layout(config, layout, 2)
    with pytest.raises(SettingsError, match=r"^extra_teachers\[0\]\.gpus names 2 GPU\(s\) for "
                       r"extra_teachers\[0\]\.groups=1 x extra_teachers\[0\]\.tensor_parallel=1; "
                       r"name 1$"):  # fmt: skip
        check_layout(_cuda({"gpus": [0, 1]}), plan_layout(_cuda({"gpus": [0, 1]}), 2), 2)
    with pytest.raises(SettingsError, match=r"^extra_teachers\[0\]\.gpus names GPU 3, but this "
                       r"machine shows 2"):  # fmt: skip
        check_layout(_cuda({"gpus": [3]}), plan_layout(_cuda({"gpus": [3]}), 2), 2)


def test_teachers_sharing_a_gpu_with_a_trainer_rank_are_added_up_against_its_memory():
    config = _cuda({})  # teacher 0, teacher 1 and trainer rank 0 on GPU 0
    layout = plan_layout(config, 1)
    params = 2 * GIB // 4  # 1 GiB of bf16 weights each
    gpu = [GpuMemory(total=8 * GIB, free=4 * GIB)]
    check_layout(config, layout, 1, gpu, teacher_params=params)  # one teacher: 2 GiB fits
    with pytest.raises(SettingsError) as refused:
        check_layout(
            config, layout, 1, gpu, teacher_params=params, extra_teacher_params=[2 * params]
        )
    assert str(refused.value) == (
        "GPU 0 would hold at least 5.0 GiB (1.0 GiB of teacher group 0's weights + 2.0 GiB of "
        "teacher 1 group 0's weights) but has 4.0 GiB free; set extra_teachers[0]."
        "tensor_parallel: 2 (1.0 GiB of teacher weights per GPU), or put the teacher on GPUs of "
        "its own (extra_teachers[0].gpus)"
    )


# ----------------------------------------------------------------------------- the pre-flight


def _preflight_config(tmp_path, extra, **overrides):
    data = tiny_config(
        run_dir=str(tmp_path / "run"), extra_teachers=[extra],
        **{"trainer.loss.mode": "pkl", "trainer.eval.texts": 2}, **overrides,
    )  # fmt: skip
    return run_config_from_dict(data)


def test_the_preflight_builds_one_projection_per_teacher_named_by_its_tokenizers(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("XTOKEN_CACHE", str(tmp_path / "cache"))
    config = _preflight_config(tmp_path, {"tokenizer": "mistral", "model": "tiny"})
    inputs = preflight(config)
    assert inputs.projection == str(projection_cache_path(config))
    assert inputs.extra_projections == (str(projection_cache_path(config, "mistral")),)
    assert inputs.projection.endswith("mistral_smollm2_k8.pt")
    assert inputs.extra_projections[0].endswith("mistral_mistral_k8.pt")
    assert Inputs.from_dict(json.loads(json.dumps(inputs.to_dict()))) == inputs
    # the built files are checked against each teacher's tokenizer when given
    given = _preflight_config(
        tmp_path,
        {"tokenizer": "mistral", "model": "tiny", "projection": inputs.projection},
        **{"trainer.loss.projection": inputs.projection},
    )
    with pytest.raises(ValueError, match=r"^extra_teachers\[0\]\.projection=.* build one for "
                       r"mistral -> mistral") as refused:  # fmt: skip
        preflight(given)
    assert "\n" not in str(refused.value)


def test_an_unknown_tokenizer_or_a_top_k_past_the_vocab_is_refused_naming_the_entry(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("XTOKEN_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"^extra_teachers\[0\]\.tokenizer: "):
        preflight(_preflight_config(tmp_path, {"tokenizer": "no-such-tok", "model": "tiny"}))
    topk = {"tokenizer": "mistral", "model": "tiny", "transport": "topk", "top_k": 40_000}
    with pytest.raises(ValueError, match=r"^extra_teachers\[0\]\.top_k=40000 must be between 1 "
                       r"and the teacher's vocab of 32768"):  # fmt: skip
        preflight(_preflight_config(tmp_path, topk))


def test_the_two_teacher_example_plans_both_teachers():
    from pathlib import Path

    from services.supervise.config import load_run_config

    example = Path(__file__).resolve().parents[3] / "examples" / "two_teachers.yaml"
    config = load_run_config(example)
    assert config.student_tokenizer == "qwen3"  # every tokenizer of the default install
    assert [(t.tokenizer, t.section.weight) for t in config.teacher_list()] == [
        ("smollm2", 0.5), ("deepseek", 0.5)
    ]  # fmt: skip
    assert config.extra_teachers[0].transport == "shm"  # the teacher section's
    plan = _plan(config, Inputs(None, None, "/p/0.pt", None, ("/p/1.pt",)))
    assert {"teacher0", "t1.teacher0"} <= set(plan.sections)
