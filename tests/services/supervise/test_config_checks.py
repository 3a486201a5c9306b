"""Run-config values no process could use are refused where the config is built, so `xtoken run`
and the control plane refuse them alike: sizes parse, floats are finite, contexts are bounded."""

from __future__ import annotations

import math

import pytest

from services.common.config import ConfigError
from services.supervise.config import MAX_CONTEXT, run_config_from_dict
from services.teacher.config import TeacherConfig
from services.trainer.sections import OptimConfig


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        (
            {"queue": {"capacity_bytes": "lots"}},
            r"queue\.capacity_bytes: size 'lots'.*not understood",
        ),
        (
            {"queue": {"capacity_bytes": "1e999"}},
            r"queue\.capacity_bytes: size '1e999'.*not finite",
        ),
        ({"queue": {"capacity_bytes": "2PiB"}}, r"queue\.capacity_bytes: size '2PiB'"),
        ({"queue": {"capacity_bytes": "2048TiB"}}, r"queue: capacity_bytes=.*at most .* \(1PiB\)"),
        ({"queue_capacity": "4GiB"}, r"^queue_capacity moved to queue\.capacity_bytes$"),
        ({"ctx_student": MAX_CONTEXT + 1}, r"ctx_student=.*at most"),
        ({"ctx_teacher": 1e40}, r"ctx_teacher: expected int"),
        ({"restart_backoff_s": math.inf}, r"restart_backoff_s=inf: must be a finite"),
        ({"hang_after_s": math.nan}, r"hang_after_s=nan"),
        ({"trainer": {"optim": {"lr": math.inf}}}, r"trainer.optim: lr=inf"),
        ({"trainer": {"loss": {"temperature": math.inf}}}, r"temperature=inf"),
        ({"trainer": {"feed": {"lease_s": math.nan}}}, r"trainer.feed.lease_s=nan"),
        ({"teacher": {"queue_timeout_s": math.inf}}, r"queue_timeout_s=inf"),
    ],
    ids=lambda v: str(v)[:40] if isinstance(v, dict) else "",
)
def test_a_value_no_process_could_use_is_refused_naming_its_key(data, pattern):
    with pytest.raises(ConfigError, match=pattern):
        run_config_from_dict(data)


def test_the_component_configs_check_their_own_floats():
    with pytest.raises(ValueError, match="lr=inf"):
        OptimConfig(lr=math.inf)
    with pytest.raises(ValueError, match="eps=nan"):
        OptimConfig(eps=math.nan)
    with pytest.raises(ValueError, match="lease_s=inf"):
        TeacherConfig(lease_s=math.inf)


def test_a_run_counts_its_processes():
    assert run_config_from_dict({}).process_count == 4  # queue, collator, teacher, trainer
    assert run_config_from_dict({"queue": {"address": "tcp://h:1"}}).process_count == 3
    big = run_config_from_dict({"trainers": 8, "teachers": 2, "collator": {"workers": 3}})
    assert big.process_count == 1 + 3 + 2 + 8
