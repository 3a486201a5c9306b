"""The trainer shell's pieces that run without a queue: the teacher output layer of the hidden
transport is the teacher's own."""

from __future__ import annotations

import torch

from services.teacher.worker import TeacherConfig, TeacherWorker
from services.trainer.main import teacher_output_layer
from tests.services.trainer import distill_setup as setup


def test_the_hidden_transport_output_layer_is_the_preset_teachers_own():
    teacher = TeacherWorker(
        TeacherConfig(model="tiny", tokenizer=setup.TEACHER_TOKENIZER, transport="hidden", seed=4)
    )
    config = setup.trainer_config(None, teacher_model="tiny", teacher_seed=4)
    layer = teacher_output_layer(config, torch.device("cpu"))
    assert torch.equal(layer.weight, teacher.lm_head.weight)
    other = teacher_output_layer(
        setup.trainer_config(None, teacher_model="tiny", teacher_seed=5), torch.device("cpu")
    )
    assert not torch.equal(other.weight, teacher.lm_head.weight)
