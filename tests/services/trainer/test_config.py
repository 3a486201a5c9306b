"""The trainer's loss section: the P-KL column rule is validated and reaches the loss."""

import pytest
import torch

from services.trainer.config import LossConfig, TrainerConfig
from services.trainer.worker import TrainerWorker


def test_topk_columns_is_validated_naming_the_choices():
    assert LossConfig().topk_columns == "valid"
    with pytest.raises(ValueError, match=r"topk_columns='padded'.*valid.*all"):
        LossConfig(topk_columns="padded")


def test_topk_columns_reaches_the_loss_config(tmp_path):
    path = tmp_path / "proj.pt"
    indices = torch.tensor([[0, -1], [1, -1], [2, -1]])
    torch.save({"indices": indices, "likelihoods": (indices >= 0).float()}, path)
    worker = TrainerWorker.__new__(TrainerWorker)  # only _build_loss: no model, no queue
    worker.config = TrainerConfig(loss=LossConfig(projection=str(path), topk_columns="all"))
    worker.vocab = 3
    assert worker._build_loss(3).config.topk_columns == "all"
