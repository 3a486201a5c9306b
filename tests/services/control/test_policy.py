"""The restart policy (shared by `xtoken run` and the supervisor), path confinement of submitted
configs, and the Prometheus exposition: pure logic, no processes."""

from __future__ import annotations

import pytest

from services.control import prometheus
from services.control.paths import PathNotAllowed, confine
from services.control.supervisor import STATES
from services.supervise.policy import RestartPolicy


def test_collators_and_teachers_restart_in_place_with_doubling_backoff_until_the_budget():
    p = RestartPolicy(max_restarts=3, backoff_s=1.0, max_backoff_s=3.0)
    d = [p.decide("teacher0", "teacher", 1) for _ in range(4)]
    assert [x.action for x in d] == ["restart", "restart", "restart", "fail"]
    assert [x.delay_s for x in d[:3]] == [1.0, 2.0, 3.0]
    assert [x.attempt for x in d[:3]] == [1, 2, 3]
    assert {x.scope for x in d[:3]} == {"process"}
    assert "restart budget of teacher0 spent (3 of 3)" in d[3].reason
    # another process has its own budget
    assert p.decide("teacher1", "teacher", -9).action == "restart"
    assert p.decide("collator", "collator", 1).scope == "process"


def test_any_trainer_rank_spends_the_budget_of_the_whole_group():
    p = RestartPolicy(max_restarts=1, backoff_s=0.0)
    first = p.decide("trainer1", "trainer", -9)
    assert (first.action, first.scope, first.key) == ("restart", "group", "trainers")
    assert p.decide("trainer0", "trainer", 1).action == "fail"
    assert p.restarts() == {"trainers": 1}


def test_a_lost_queue_restarts_the_run_and_normal_ends_restart_nothing():
    p = RestartPolicy(max_restarts=2)
    assert p.decide("queue", "queue", -9).scope == "run"
    assert p.decide("trainer0", "trainer", 0, finished_ok=True).action == "done"
    assert p.decide("x", "unknown-role", 1).action == "fail"
    assert RestartPolicy(max_restarts=0).decide("teacher0", "teacher", 1).action == "fail"


def test_a_lost_data_plane_without_an_exit_spends_the_budget_of_its_scope():
    # a shared queue restarted without its data: no process of the run exited, the run restarts
    p = RestartPolicy(max_restarts=1, backoff_s=0.5)
    lost = p.decide_lost("queue", "queue", "queue restarted: epoch a -> b")
    assert (lost.action, lost.scope, lost.key, lost.attempt) == ("restart", "run", "run", 1)
    assert lost.reason == "queue restarted: epoch a -> b: restart 1 of 1 (run) in 0.5s"
    again = p.decide("queue", "queue", -9)  # one budget with the exits of the run's own queue
    assert again.action == "fail" and "restart budget of run spent (1 of 1)" in again.reason
    assert p.decide_lost("queue", "queue", "x").action == "fail"
    with pytest.raises(ValueError, match="none may be negative"):
        RestartPolicy(max_restarts=-1)


def test_confine_makes_relative_paths_absolute_under_their_roots(tmp_path):
    runs, data = tmp_path / "runs", tmp_path / "data"
    out = confine(
        {
            "data": {"train": "c/train.jsonl"},
            "trainer": {"student": "tiny"},
            "teacher": {"model": "models/t"},
            "student_tokenizer": "qwen3",
        },
        run_dir="r1",
        runs_root=runs,
        data_roots=[data, tmp_path / "models"],
    )
    assert out["run_dir"] == str(runs.resolve() / "r1")
    assert out["data"]["train"] == str(data.resolve() / "c" / "train.jsonl")
    assert out["teacher"]["model"] == str(data.resolve() / "models" / "t")
    assert out["trainer"]["student"] == "tiny" and out["student_tokenizer"] == "qwen3"
    second_root = confine(
        {"teacher": {"model": str(tmp_path / "models" / "m")}},
        run_dir="r",
        runs_root=runs,
        data_roots=[data, tmp_path / "models"],
    )
    assert second_root["teacher"]["model"] == str((tmp_path / "models" / "m").resolve())


def test_confine_follows_symlinks_out_of_the_root_and_refuses_them(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "link").symlink_to("/etc")
    with pytest.raises(PathNotAllowed, match="outside the data roots") as e:
        confine(
            {"data": {"heldout": "link/passwd"}},
            run_dir="r",
            runs_root=tmp_path / "runs",
            data_roots=[data],
        )
    assert e.value.key == "data.heldout"
    with pytest.raises(PathNotAllowed) as e:
        confine({}, run_dir=".", runs_root=tmp_path / "runs", data_roots=[data])
    assert e.value.key == "run_dir"


def test_the_exposition_has_help_type_and_escaped_low_cardinality_labels():
    snapshot = {
        "started": 100.0,
        "runs": [
            {
                "id": 'r"1',
                "state": "RUNNING",
                "tokens_total": 512.0,
                "steps_total": 2,
                "latest": {
                    "step": 2,
                    "step_s": 0.5,
                    "times": {"forward": 0.1, "backward": 0.2},
                    "tokens_per_s": 1024.0,
                    "loss": 3.5,
                    "kl_loss": 1.5,
                    "ce_loss": 2.0,
                    "memory_mb": 1.5,
                },
                "evals": [{"bits_per_byte": 2.25}],
                "queue": {
                    "capacity_bytes": 10,
                    "leases": 1,
                    "parked_claims": 2,
                    "partitions": {"train": {"samples": 3, "bytes": 7}},
                },
                "memory": [
                    {"role": "teacher", "rank": 0, "mb": 3.0, "memory": "gpu"},
                    {"role": "trainer", "rank": 0, "mb": 1.5, "memory": "gpu"},
                    {"role": "trainer", "rank": 1, "mb": 2.0, "memory": "gpu"},
                ],
                "processes": [
                    {"name": "trainer0", "role": "trainer", "state": "running", "restarts": 1},
                    {"name": "trainer1", "role": "trainer", "state": "running", "restarts": 1},
                    {"name": "teacher0", "role": "teacher", "state": "failed", "restarts": 2},
                ],
            }
        ],
    }
    text = prometheus.render(snapshot, states=STATES, now=110.0)
    assert "# TYPE xtoken_tokens counter" in text
    assert 'xtoken_tokens_total{run="r\\"1"} 512' in text
    assert 'xtoken_step_seconds{run="r\\"1",phase="backward"} 0.2' in text
    assert 'xtoken_loss{run="r\\"1",part="kd"} 1.5' in text
    assert 'xtoken_queue_samples{run="r\\"1",partition="train"} 3' in text
    assert 'xtoken_queue_claims_waiting{run="r\\"1"} 2' in text
    assert 'xtoken_worker_up{run="r\\"1",process="teacher0"} 0' in text
    assert 'xtoken_worker_restarts_total{run="r\\"1",role="trainer"} 1' in text  # one group
    mem = 'xtoken_process_memory_bytes{run="r\\"1",role="%s",rank="%d",memory="gpu"} %d'
    assert mem % ("trainer", 0, 1572864) in text and mem % ("trainer", 1, 2097152) in text
    assert mem % ("teacher", 0, 3145728) in text
    assert "xtoken_trainer_memory_bytes" not in text
    assert 'xtoken_runs{state="RUNNING"} 1' in text and 'xtoken_runs{state="FAILED"} 0' in text
    assert "xtoken_control_uptime_seconds 10" in text
    for line in text.splitlines():
        assert line.startswith("#") or line.startswith("xtoken_"), line
