"""The trainer's loss section: the P-KL column rule is validated and reaches the loss; removed
keys are refused."""

import pytest
import torch

from services.common.config import ConfigError, from_dict
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


def test_a_config_with_the_removed_cuda_graphs_key_is_refused_naming_it():
    # the CUDA-graph replay of the P-KL phase was removed: old run configs fail loudly
    with pytest.raises(ConfigError, match=r"key 'loss\.cuda_graphs' was removed: .*delete the key"):
        from_dict(TrainerConfig, {"loss": {"mode": "pkl", "cuda_graphs": True}})
