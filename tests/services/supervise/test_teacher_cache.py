"""A run that trains from a teacher cache (``data.teacher_cache``): the keys that do not fit the
run are refused in one line naming the key, and the plan starts no process for a cached teacher
(but with ``data.teacher_cache_missing: online``, its groups for the samples the cache lacks),
hands the collator each teacher's cache and the trainer each teacher's link to it."""

from __future__ import annotations

import pytest

from services.common import config as cfgmod
from services.common.config import ConfigError
from services.supervise.config import run_config_from_dict
from services.supervise.plan import Host, RunPlace, make_plan
from services.supervise.preflight import Inputs
from services.trainer.config import TrainerConfig
from tests.services.control.conftest import tiny_config

SECOND = {"tokenizer": "qwen3", "model": "tiny"}


def _config(**overrides):
    return run_config_from_dict(tiny_config(**overrides))


def _plan(config):
    extra = tuple(f"/p/{j + 1}.pt" for j in range(len(config.extra_teachers)))
    inputs = Inputs("/d/train.jsonl", "/d/heldout.txt", "/p/0.pt", None, extra)
    place = RunPlace.of(config, "r1")
    host = Host(gpus=None, cores=8)
    return make_plan(config, inputs, place, queue="tcp://127.0.0.1:7", master_port=9, host=host)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"data.teacher_cache": ["/c/0", "/c/1"]},
            r"data.teacher_cache has 2 entries for 1 teacher\(s\) .* give one per teacher",
        ),
        (
            {"data.teacher_cache": "/c/0", "pack": True},
            r"data.teacher_cache serves teacher: .* set pack: false",
        ),
        (
            {"data.teacher_cache": "/c/0", "trainer.loss.mode": "ce"},
            r"trainer.loss.mode=ce reads no teacher: remove data.teacher_cache",
        ),
        (
            {"data.teacher_cache": "/c/0", "data.on_policy_fraction": 0.5},
            r"on-policy samples .* need a live teacher",
        ),
    ],
)
def test_a_teacher_cache_that_does_not_fit_the_run_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        _config(**overrides)
    assert "\n" not in str(e.value)


def test_a_cached_teacher_starts_no_process_and_the_collator_and_trainer_get_its_cache():
    config = _config(**{"data.teacher_cache": "/c/0"})
    assert [v.live for v in config.teacher_list()] == [False]
    plan = _plan(config)
    names = [s.name for s in plan.specs]
    assert not [n for n in names if "teacher" in n], names
    assert "teacher0" not in plan.sections
    assert config.process_count == len(plan.specs)
    assert plan.sections["collator"]["worker"]["teacher_cache"] == ["/c/0"]
    trainer = cfgmod.from_dict(
        TrainerConfig, cfgmod.with_context(TrainerConfig, plan.sections["trainer"], plan.shared)
    )
    assert trainer.teacher.cache == "/c/0"
    live = _plan(_config())
    assert "teacher0" in [s.name for s in live.specs]
    assert live.sections["collator"]["worker"]["teacher_cache"] == []


def test_one_teacher_of_two_served_by_a_cache_leaves_the_other_live():
    config = _config(extra_teachers=[SECOND], **{"data.teacher_cache": [None, "/c/1"]})
    plan = _plan(config)
    names = [s.name for s in plan.specs]
    assert "teacher0" in names and not [n for n in names if n.startswith("t1.")], names
    assert plan.sections["collator"]["worker"]["teacher_cache"] == [None, "/c/1"]
    trainer = cfgmod.from_dict(
        TrainerConfig, cfgmod.with_context(TrainerConfig, plan.sections["trainer"], plan.shared)
    )
    assert trainer.teacher.cache is None
    assert trainer.extra_teachers[0].cache == "/c/1"


def _trainer(plan) -> TrainerConfig:
    return cfgmod.from_dict(
        TrainerConfig, cfgmod.with_context(TrainerConfig, plan.sections["trainer"], plan.shared)
    )


def test_online_starts_the_cached_teachers_groups_and_tells_the_collator_and_trainer():
    config = _config(**{"data.teacher_cache": "/c/0", "data.teacher_cache_missing": "online"})
    assert [(v.cache, v.online, v.live) for v in config.teacher_list()] == [("/c/0", True, True)]
    plan = _plan(config)
    assert "teacher0" in [s.name for s in plan.specs]
    assert "teacher0" in plan.sections
    assert config.process_count == len(plan.specs)
    worker = plan.sections["collator"]["worker"]
    assert worker["teacher_cache"] == ["/c/0"] and worker["teacher_cache_missing"] == "online"
    trainer = _trainer(plan)
    assert (trainer.teacher.cache, trainer.teacher.cache_missing) == ("/c/0", "online")
    # the default refuses a sample the cache lacks: no teacher process, the collator and the
    # trainer told so
    plan = _plan(_config(**{"data.teacher_cache": "/c/0"}))
    assert "teacher0" not in plan.sections
    assert plan.sections["collator"]["worker"]["teacher_cache_missing"] == "error"
    assert _trainer(plan).teacher.cache_missing == "error"


def test_online_starts_only_the_cached_teacher_of_two_that_is_not_live_already():
    config = _config(
        extra_teachers=[SECOND],
        **{"data.teacher_cache": [None, "/c/1"], "data.teacher_cache_missing": "online"},
    )
    assert [(v.online, v.live) for v in config.teacher_list()] == [(False, True), (True, True)]
    plan = _plan(config)
    names = [s.name for s in plan.specs]
    assert "teacher0" in names and "t1.teacher0" in names, names
    trainer = _trainer(plan)
    assert trainer.teacher.cache is None
    assert (trainer.extra_teachers[0].cache, trainer.extra_teachers[0].cache_missing) == (
        "/c/1",
        "online",
    )


def test_the_run_sets_the_trainers_and_the_collators_cache_from_data_teacher_cache():
    with pytest.raises(ConfigError, match=r"trainer.teacher.cache is set by the run"):
        _config(**{"trainer.teacher.cache": "/c/0"})
    with pytest.raises(ConfigError, match=r"set data.teacher_cache_missing only"):
        _config(**{"trainer.teacher.cache_missing": "online"})
