"""CrossTokenizerLossConfig validation: every bad value names itself and the fix."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch

from xtoken_core.losses import CrossTokenizerLoss, CrossTokenizerLossConfig
from xtoken_core.losses.config import KD_MODES, MODE_NAMES
from xtoken_core.losses.modes import MODES

PROJ = (torch.tensor([[0, -1], [1, 0]]), torch.tensor([[1.0, 0.0], [0.5, 0.5]]))


def test_mode_picks_its_class_from_the_registry():
    for name, cls in MODES.items():
        loss_fn = CrossTokenizerLoss(CrossTokenizerLossConfig(projection=PROJ, mode=name))
        assert type(loss_fn.mode) is cls
    assert CrossTokenizerLossConfig(projection=PROJ).mode == "pkl"
    assert issubclass(MODES["xtoken"], MODES["gold"]) and MODES["xtoken"].relaxed


def test_the_config_names_every_mode_of_the_registry_in_its_order():
    assert KD_MODES == tuple(MODES)
    assert MODE_NAMES == (*MODES, "ce")


def test_the_config_imports_neither_torch_nor_triton():
    code = (
        "import sys\n"
        "from xtoken_core.losses.config import CrossTokenizerLossConfig\n"
        "CrossTokenizerLossConfig()\n"
        "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))\n"
    )
    root = pathlib.Path(__file__).resolve().parents[3]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_mode_ce_needs_no_projection_and_has_no_kd_loss():
    cfg = CrossTokenizerLossConfig(mode="ce")
    assert not cfg.uses_teacher and cfg.projections == ()
    with pytest.raises(ValueError, match="mode='ce' has no KD term"):
        CrossTokenizerLoss(cfg)


def test_a_kd_mode_without_a_projection_is_refused_by_the_loss():
    cfg = CrossTokenizerLossConfig(mode="gold")  # a run config may leave it for the run to build
    assert cfg.uses_teacher and cfg.projections == ()
    with pytest.raises(ValueError, match="projection is required"):
        CrossTokenizerLoss(cfg)


def test_defaults_give_one_teacher_with_weight_one():
    cfg = CrossTokenizerLossConfig(projection="proj.pt")
    assert cfg.teacher_weights == (1.0,) and cfg.num_teachers == 1
    assert cfg.projections == ("proj.pt",) and cfg.teacher_vocab_size == (None,)


def test_one_projection_is_shared_by_every_teacher():
    cfg = CrossTokenizerLossConfig(
        projection=PROJ, teacher_weights=[0.5, 0.5], teacher_vocab_size=7
    )
    assert len(cfg.projections) == 2 and cfg.teacher_vocab_size == (7, 7)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "kl"}, "mode='kl' is unknown"),
        ({"mode": "ce", "ce_weight": 0.0}, "mode=ce with ce_weight=0 trains nothing"),
        ({"backend": "triton"}, "backend='triton' is unknown"),
        ({"temperature": -1.0}, "temperature=-1.0 must be > 0"),
        ({"temperature": 0}, "temperature=0 must be > 0"),
        ({"temperature": float("nan")}, "temperature=nan"),
        ({"vocab_topk": 0}, "vocab_topk=0"),
        ({"uncommon_topk": 0}, "uncommon_topk=0"),
        ({"topk_columns": "padded"}, r"topk_columns='padded' is unknown.*'valid', 'all'"),
        ({"kl_weight": -0.1}, "kl_weight=-0.1"),
        ({"ce_weight": float("inf")}, "ce_weight=inf"),
        ({"projection": 3}, "projection of type int"),
        ({"projection": [PROJ, 3]}, r"projection\[1\] is int"),
        ({"projection": (PROJ[0], PROJ[1][:1])}, "must both be"),
        ({"projection": (PROJ[0].float(), PROJ[1])}, "indices must be an integer tensor"),
        ({"projection": (PROJ[0] - 2, PROJ[1])}, "use -1 for 'no entry'"),
        ({"teacher_weights": []}, "empty"),
        ({"teacher_weights": [1.0, -1.0]}, "must be finite and >= 0"),
        ({"projection": [PROJ, PROJ], "teacher_weights": [1, 1, 1]}, "2 projections for 3"),
        ({"teacher_weights": [1, 1], "teacher_vocab_size": [5, 6, 7]}, "3 entries for 2 teachers"),
        ({"teacher_vocab_size": 0}, "teacher_vocab_size entry 0"),
    ],
)
def test_bad_settings_raise_value_error_naming_the_value(kwargs, message):
    kwargs.setdefault("projection", PROJ)
    with pytest.raises(ValueError, match=message):
        CrossTokenizerLossConfig(**kwargs)
