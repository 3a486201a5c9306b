"""The trainer's loss section is the library's loss config: its keys are validated and reach the
loss as they are (the teacher vocab added by the trainer); removed keys are refused."""

import re

import pytest
import torch

from services.common.config import ConfigError, from_dict, leaf_paths
from services.trainer.config import TrainerConfig
from services.trainer.sections import StudentConfig
from services.trainer.step import build_loss
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
    return build_loss(
        config.loss,
        student_vocab=3,
        teacher_vocab=teacher_vocab,
        teacher_tokenizer=config.teacher_tokenizer,
    )


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


def test_the_teacher_vocab_is_the_trainers_and_one_teacher_is_distilled():
    with pytest.raises(ConfigError, match=r"loss.teacher_vocab_size=5: the trainer sets it"):
        from_dict(TrainerConfig, {"loss": {"mode": "ce", "teacher_vocab_size": 5}})
    for listed in (["a.pt", "b.pt"], ["a.pt"]):  # one file, never a list of them
        with pytest.raises(ConfigError, match="a trainer distills one teacher"):
            from_dict(TrainerConfig, {"loss": {"projection": listed}})


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
        ({"teacher": {"groups": 0}}, r"^trainer\.teacher: groups=0: must be >= 1$"),
        ({"schedule": {"epochs": 0}}, r"^trainer\.schedule: epochs=0: must be >= 1$"),
        ({"eval": {"ctx": 1}}, r"^trainer\.eval: ctx=1: must be >= 2 tokens$"),
        ({"observe": {"report_to": ["mlflow"]}}, r"^trainer\.observe: report_to: unknown"),
        ({"compute": {"gc_every": -1}}, r"^trainer\.compute: gc_every=-1: must be >= 0$"),
        ({"student": {"max_length": -1}}, r"^trainer\.student: max_length=-1: must be >= 0"),
    ],
)
def test_a_section_checks_its_own_settings_naming_the_section(section, pattern):
    with pytest.raises(ConfigError, match=pattern):
        from_dict(TrainerConfig, {"loss": {"mode": "ce"}, **section}, path="trainer")


def test_a_check_across_sections_names_the_keys_of_both():
    config = {"loss": {"mode": "pkl", "projection": "p.pt"}, "on_policy": {"fraction": 0.5}}
    with pytest.raises(ConfigError, match=r"^on_policy\.fraction=0\.5 with feed\.ordered: "):
        from_dict(TrainerConfig, {**config, "feed": {"ordered": True}})
    with pytest.raises(ConfigError, match=r"^on_policy\.fraction=1 with schedule\.max_steps=0: "):
        from_dict(
            TrainerConfig, {**config, "on_policy": {"fraction": 1.0}, "schedule": {"max_steps": 0}}
        )
