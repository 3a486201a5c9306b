"""A run config with trainer.compute.deterministic: refused in one line (exit 2) without
data.ordered, which fixes the micro-batches; with it, the trainer's section carries the switch
and the order."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from services.common import config as cfgmod
from services.common.config import ConfigError
from services.supervise.config import run_config_from_dict
from services.supervise.plan import RunPlace, make_context, make_sections
from services.supervise.preflight import Inputs
from services.trainer.config import TrainerConfig

ROOT = Path(__file__).resolve().parents[3]

REFUSAL = (
    "trainer.compute.deterministic needs data.ordered: true and collator.workers: 1 (otherwise "
    "which samples share a micro-batch depends on timing); set both, or "
    "trainer.compute.deterministic: false"
)


def test_xtoken_run_refuses_deterministic_without_data_ordered_in_one_line_exit_2(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  compute:\n    deterministic: true\n")
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "run", str(path), "--check"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr == f"xtoken run: {REFUSAL}\n"


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        ({"trainer": {"compute": {"deterministic": True}}}, f"^{re.escape(REFUSAL)}$"),
        (
            {
                "trainer": {"compute": {"deterministic": True}},
                "data": {"ordered": True},
                "collator": {"workers": 2},
            },
            r"data\.ordered needs one collator worker \(collator\.workers=2\)",
        ),
    ],
    ids=["unordered", "ordered-with-two-collator-workers"],
)
def test_a_deterministic_run_needs_data_ordered_with_one_collator_worker(data, pattern):
    with pytest.raises(ConfigError, match=pattern):
        run_config_from_dict(data)


def test_the_trainer_section_of_an_ordered_deterministic_run_carries_the_switch_and_order():
    config = run_config_from_dict(
        {
            "trainer": {"compute": {"deterministic": True}, "loss": {"projection": "/p"}},
            "data": {"ordered": True},
        }
    )
    shared = make_context(config, RunPlace.of(config), queue="tcp://127.0.0.1:1")
    section = make_sections(config, Inputs.given(config), shared)["trainer"]
    assert section["compute"]["deterministic"] is True and section["feed"]["ordered"] is True
    trainer = cfgmod.from_dict(TrainerConfig, section)  # as the trainer process builds it
    assert trainer.compute.deterministic and trainer.feed.ordered
