"""The trainer's loss section is the library's loss config: its keys are validated and reach the
loss as they are (the teachers' vocab, weight and projections added by the trainer); removed keys
are refused; further teachers are entries of extra_teachers, each checked naming its key."""

import re

import pytest
import torch

from services.common.config import ConfigError, from_dict, leaf_paths, to_dict
from services.trainer.config import TrainerConfig
from services.trainer.sections import StudentConfig
from services.trainer.step import LossTeacher, build_loss
from xtoken_core.losses import CrossTokenizerLossConfig


def test_topk_columns_is_validated_naming_the_choices():
    assert CrossTokenizerLossConfig().topk_columns == "valid"
    with pytest.raises(ValueError, match=r"topk_columns='padded'.*valid.*all"):
        CrossTokenizerLossConfig(topk_columns="padded")


def _config(tmp_path, **loss) -> TrainerConfig:
    path = tmp_path / "proj.pt"
    indices = torch.tensor([[0, -1], [1, -1], [2, -1]])
    torch.save({"indices": indices, "likelihoods": (indices >= 0).float()}, path)
    return from_dict(TrainerConfig, {"loss": {"projection": str(path), **loss}})


def _loss(config: TrainerConfig, teacher_vocab: int):
    teacher = LossTeacher(config.loss.projection, teacher_vocab, tokenizer=config.teacher_tokenizer)
    return build_loss(config.loss, student_vocab=3, teachers=[teacher])


def test_topk_columns_reaches_the_loss_config(tmp_path):
    assert _loss(_config(tmp_path, topk_columns="all"), 3).config.topk_columns == "all"


def test_the_run_config_loss_section_reaches_the_loss_as_is_with_the_teacher_vocab(tmp_path):
    section = {"mode": "gold", "temperature": 2.0, "exact_token_match_only": True}
    config = _config(tmp_path, **section)
    loss_fn = _loss(config, 4)
    assert loss_fn.config is not config.loss  # the run config is left as it was
    assert config.loss.teacher_vocab_size == (None,)
    assert loss_fn.config.teacher_vocab_size == (4,)
    for key, value in section.items():
        assert getattr(loss_fn.config, key) == value


def test_the_teacher_vocab_and_weights_are_the_trainers_and_a_further_teacher_is_an_extra_one():
    with pytest.raises(ConfigError, match=r"loss.teacher_vocab_size=5: the trainer sets it"):
        from_dict(TrainerConfig, {"loss": {"mode": "ce", "teacher_vocab_size": 5}})
    for listed in (["a.pt", "b.pt"], ["a.pt"]):  # teacher 0's file, never a list of them
        with pytest.raises(
            ConfigError, match=r"^loss\.projection=\[.*give teacher 0's projection file alone; "
            r"each further teacher is an entry of extra_teachers"
        ):  # fmt: skip
            from_dict(TrainerConfig, {"loss": {"projection": listed}})
    for weights in ([0.5, 0.5], [0.5]):
        with pytest.raises(
            ConfigError, match=r"^loss\.teacher_weights=\[0\.5.*: the trainer sets it from "
            r"teacher\.weight and each extra_teachers\[j\]\.weight; set those"
        ):  # fmt: skip
            from_dict(TrainerConfig, {"loss": {"projection": "a.pt", "teacher_weights": weights}})


def test_the_teachers_are_teacher_0_then_each_extra_teacher_with_its_own_keys():
    config = from_dict(
        TrainerConfig,
        {
            "teacher_tokenizer": "smollm2",
            "teacher": {"weight": 0.25, "groups": 2},
            "loss": {"projection": "p0.pt"},
            "extra_teachers": [
                {"tokenizer": "qwen3", "projection": "p1.pt", "weight": 0.75, "vocab_size": 300},
                {"tokenizer": "deepseek", "projection": "p2.pt", "timeout_s": 9.0},
            ],
        },
    )
    teachers = config.teachers()
    assert [(t.index, t.tokenizer, t.projection) for t in teachers] == [
        (0, "smollm2", "p0.pt"), (1, "qwen3", "p1.pt"), (2, "deepseek", "p2.pt"),
    ]  # fmt: skip
    assert [t.link.weight for t in teachers] == [0.25, 0.75, 1.0]
    assert [t.link.groups for t in teachers] == [2, 1, 1]  # each teacher's groups its own
    assert teachers[1].link.vocab_size == 300 and teachers[2].link.timeout_s == 9.0
    assert [t.projection_key for t in teachers] == [
        "loss.projection", "extra_teachers[0].projection", "extra_teachers[1].projection",
    ]  # fmt: skip
    assert teachers[2].tokenizer_key == "extra_teachers[1].tokenizer"
    again = from_dict(TrainerConfig, to_dict(config))  # the section file reads back
    assert again.extra_teachers == config.extra_teachers and again.teacher == config.teacher


@pytest.mark.parametrize(
    ("config", "pattern"),
    [
        (
            {"loss": {"projection": "p.pt"}, "extra_teachers": [{"tokenizer": "qwen3"}]},
            r"^loss\.mode=pkl needs extra_teachers\[0\]\.projection \(a file from `xtoken "
            r"projection build` for extra_teachers\[0\]\.tokenizer='qwen3'\); `xtoken run` builds",
        ),
        (
            {"loss": {"mode": "ce"}, "extra_teachers": [{"projection": "p.pt"}]},
            r"^extra_teachers\[0\]: tokenizer is required: this teacher's tokenizer",
        ),
        (
            {"loss": {"mode": "ce"}, "extra_teachers": [{"tokenizer": "qwen3", "weight": -1}]},
            r"^extra_teachers\[0\]: weight=-1\.0: must be a finite number >= 0$",
        ),
        (
            {"loss": {"mode": "ce"}, "teacher": {"weight": float("nan")}},
            r"^teacher: weight=nan: must be a finite number >= 0$",
        ),
        (
            {"loss": {"mode": "ce"}, "extra_teachers": [{"tokenizer": "qwen3", "groupz": 2}]},
            r"^unknown key 'extra_teachers\[0\]\.groupz': did you mean "
            r"'extra_teachers\[0\]\.groups'\?",
        ),
        (
            {
                "loss": {"projection": "p.pt"},
                "on_policy": {"fraction": 0.5},
                "extra_teachers": [{"tokenizer": "qwen3", "projection": "q.pt"}],
            },
            r"^on_policy\.fraction=0\.5 with 1 extra_teachers: the rollout workers' samples "
            r"carry teacher 0's tokens and alignment alone; distill one teacher on-policy, or set "
            r"the fraction to 0$",
        ),
    ],
    ids=["no-projection", "no-tokenizer", "negative-weight", "nan-weight", "unknown-key",
         "on-policy"],
)  # fmt: skip
def test_a_bad_extra_teacher_is_refused_in_one_line_naming_its_key(config, pattern):
    with pytest.raises(ConfigError, match=pattern):
        from_dict(TrainerConfig, config)


def test_a_ce_trainer_takes_extra_teachers_without_projections():
    config = from_dict(
        TrainerConfig, {"loss": {"mode": "ce"}, "extra_teachers": [{"tokenizer": "qwen3"}]}
    )
    assert len(config.teachers()) == 2


def test_a_config_with_the_removed_cuda_graphs_key_is_refused_naming_it():
    # the CUDA-graph replay of the P-KL phase was removed: old run configs fail loudly
    with pytest.raises(ConfigError, match=r"key 'loss\.cuda_graphs' was removed: .*delete the key"):
        from_dict(TrainerConfig, {"loss": {"mode": "pkl", "cuda_graphs": True}})


def test_the_former_teacher_death_keys_are_refused_naming_the_new_key():
    with pytest.raises(ConfigError, match=r"^dead_after_s moved to teacher\.dead_after_s$"):
        from_dict(TrainerConfig, {"loss": {"mode": "ce"}, "dead_after_s": 2.5})
    for old in ("dead_after_s", "teacher_dead_after_s"):
        with pytest.raises(ConfigError, match=rf"^trainer\.{old} moved to trainer\.teacher\."):
            from_dict(TrainerConfig, {old: 2.5}, path="trainer")


@pytest.mark.parametrize("old", sorted(TrainerConfig.MOVED_KEYS))
def test_each_flat_key_of_earlier_configs_is_refused_naming_its_section(old):
    new = TrainerConfig.MOVED_KEYS[old]
    assert new in leaf_paths(TrainerConfig)
    value = "tiny" if old == "student" else 1
    with pytest.raises(ConfigError, match=rf"^trainer\.{old} moved to trainer\.{re.escape(new)}$"):
        from_dict(TrainerConfig, {old: value}, path="trainer")


def test_the_student_section_is_a_mapping_and_a_student_string_is_the_old_key():
    config = from_dict(TrainerConfig, {"student": {"model": "tiny"}, "loss": {"mode": "ce"}})
    assert config.student == StudentConfig(model="tiny")
    student = StudentConfig(model="tiny")  # an instance, as code passes it
    assert from_dict(TrainerConfig, {"student": student, "loss": {"mode": "ce"}}).student is student
    with pytest.raises(ConfigError, match=r"^student moved to student\.model$"):
        from_dict(TrainerConfig, {"student": "tiny"})


@pytest.mark.parametrize(
    ("section", "pattern"),
    [
        ({"feed": {"micro_batch": 0}}, r"^trainer\.feed: micro_batch=0: must be >= 1$"),
        ({"feed": {"ahead_steps": 0}}, r"^trainer\.feed: ahead_steps=0: must be >= 1$"),
        ({"teacher": {"groups": 0}}, r"^trainer\.teacher: groups=0: must be >= 1$"),
        ({"schedule": {"epochs": 0}}, r"^trainer\.schedule: epochs=0: must be >= 1$"),
        ({"eval": {"ctx": 1}}, r"^trainer\.eval: ctx=1: must be >= 2 tokens$"),
        ({"eval": {"texts": -1}}, r"^trainer\.eval: texts=-1: must be >= 0 \(0: no held-out"),
        ({"observe": {"report_to": ["mlflow"]}}, r"^trainer\.observe: report_to: unknown"),
        ({"compute": {"gc_every": -1}}, r"^trainer\.compute: gc_every=-1: must be >= 0$"),
        ({"compute": {"warm_shortest": 0}}, r"^trainer\.compute: warm_shortest=0: must be >= 1$"),
        (
            {"compute": {"length_multiple": 0}},
            r"^trainer\.compute: length_multiple=0: must be >= 1$",
        ),
        ({"student": {"max_length": -1}}, r"^trainer\.student: max_length=-1: must be >= 0"),
    ],
)
def test_a_section_checks_its_own_settings_naming_the_section(section, pattern):
    with pytest.raises(ConfigError, match=pattern):
        from_dict(TrainerConfig, {"loss": {"mode": "ce"}, **section}, path="trainer")


def test_a_length_multiple_that_does_not_divide_the_max_length_is_refused_naming_both():
    base = {"loss": {"mode": "ce"}, "student": {"max_length": 512}}
    with pytest.raises(ConfigError, match=r"^compute\.length_multiple=48 does not divide student"):
        from_dict(TrainerConfig, {**base, "compute": {"length_multiple": 48}})
    config = from_dict(TrainerConfig, {**base, "compute": {"length_multiple": 64}})
    assert config.compute.length_multiple == 64


def test_a_check_across_sections_names_the_keys_of_both():
    config = {"loss": {"mode": "pkl", "projection": "p.pt"}, "on_policy": {"fraction": 0.5}}
    with pytest.raises(ConfigError, match=r"^on_policy\.fraction=0\.5 with feed\.ordered: "):
        from_dict(TrainerConfig, {**config, "feed": {"ordered": True}})
    with pytest.raises(ConfigError, match=r"^on_policy\.fraction=1 with schedule\.max_steps=0: "):
        from_dict(
            TrainerConfig, {**config, "on_policy": {"fraction": 1.0}, "schedule": {"max_steps": 0}}
        )
