"""Path confinement of submitted configs and the Prometheus exposition: pure logic, no
processes."""

from __future__ import annotations

import pytest

from services.control import prometheus
from services.control.paths import PathNotAllowed, confine, data_keys
from services.control.states import STATES


def test_confine_makes_relative_paths_absolute_under_their_roots(tmp_path):
    runs, data = tmp_path / "runs", tmp_path / "data"
    out = confine(
        {
            "data": {"train": "c/train.jsonl"},
            "trainer": {"student": {"model": "tiny"}},
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
    assert out["trainer"]["student"]["model"] == "tiny" and out["student_tokenizer"] == "qwen3"
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


def test_confine_checks_the_path_of_a_gguf_spec_and_keeps_names_and_drop_suffixes(tmp_path):
    runs, data = tmp_path / "runs", tmp_path / "data"
    out = confine(
        {
            "trainer": {"student": {"model": "smollm2:drop=10-19"}},
            "teacher": {"model": "gguf:m/teacher.gguf:drop=2"},
        },
        run_dir="r",
        runs_root=runs,
        data_roots=[data],
    )
    assert out["trainer"]["student"]["model"] == "smollm2:drop=10-19"
    assert out["teacher"]["model"] == f"gguf:{data.resolve() / 'm' / 'teacher.gguf'}:drop=2"
    assert (
        confine(
            {"teacher": {"model": "qwen2.5-coder-0.5b"}},
            run_dir="r",
            runs_root=runs,
            data_roots=[data],
        )["teacher"]["model"]
        == "qwen2.5-coder-0.5b"
    )
    with pytest.raises(PathNotAllowed, match="outside the data roots") as e:
        confine(
            {"teacher": {"model": "gguf:/etc/x.gguf"}},
            run_dir="r",
            runs_root=runs,
            data_roots=[data],
        )
    assert e.value.key == "teacher.model"


def test_the_marked_fields_are_confined_and_the_run_wide_ones_refused(tmp_path):
    keys = data_keys()
    assert keys["trainer.loss.projection"] == "file"  # marked in the library's loss config
    assert keys["teacher.model"] == "model" and "run_dir" not in keys
    with pytest.raises(PathNotAllowed, match="outside the data roots") as e:
        confine(
            {"data": {"heldout": "/etc/passwd"}},
            run_dir="r",
            runs_root=tmp_path / "runs",
            data_roots=[tmp_path / "data"],
        )
    assert e.value.key == "data.heldout"
    for key in ("teacher.tokenizer", "trainer.partition", "teacher.run_dir"):
        section, leaf = key.split(".")
        with pytest.raises(PathNotAllowed, match="set by the control plane") as e:
            confine(
                {section: {leaf: "x"}},
                run_dir="r",
                runs_root=tmp_path / "runs",
                data_roots=[tmp_path / "data"],
            )
        assert e.value.key == key


@pytest.mark.parametrize(
    ("leaf", "value"),
    [("model", "/opt/models/t"), ("model", "gguf:/opt/t.gguf"), ("projection", "/opt/p.pt"),
     ("tokenizer", "/opt/tok/tokenizer.json"), ("tokenizer", "../../opt/tok")],
)  # fmt: skip
def test_a_further_teachers_path_outside_the_data_roots_is_refused_as_teacher_0s_is(
    tmp_path, leaf, value
):
    roots = {"run_dir": "r", "runs_root": tmp_path / "runs", "data_roots": [tmp_path / "data"]}
    section = {"tokenizer": "deepseek", "model": "tiny", leaf: value}
    with pytest.raises(PathNotAllowed) as further:
        confine({"extra_teachers": [{"tokenizer": "deepseek", "model": "tiny"}, section]}, **roots)
    assert further.value.key == f"extra_teachers[1].{leaf}"
    teacher_0 = {"model": ("teacher", "model"), "projection": ("trainer", "loss", "projection"),
                 "tokenizer": ("teacher_tokenizer",)}[leaf]  # fmt: skip
    raw: dict = {}
    node = raw
    for part in teacher_0[:-1]:
        node = node.setdefault(part, {})
    node[teacher_0[-1]] = value
    with pytest.raises(PathNotAllowed) as first:
        confine(raw, **roots)
    assert str(further.value) == str(first.value).replace(first.value.key, further.value.key, 1)
    assert "\n" not in str(further.value) and "outside the data roots" in str(further.value)


def test_a_further_teachers_paths_inside_the_roots_are_made_absolute_and_names_kept(tmp_path):
    runs, data = tmp_path / "runs", tmp_path / "data"
    out = confine(
        {"extra_teachers": [
            {"tokenizer": "deepseek", "model": "tiny"},
            {"tokenizer": "tok/t.json", "model": "gguf:m/t.gguf:drop=2", "projection": "p.pt"},
        ]},
        run_dir="r", runs_root=runs, data_roots=[data],
    )  # fmt: skip
    assert out["extra_teachers"][0] == {"tokenizer": "deepseek", "model": "tiny"}
    assert out["extra_teachers"][1] == {
        "tokenizer": str(data.resolve() / "tok" / "t.json"),
        "model": f"gguf:{data.resolve() / 'm' / 't.gguf'}:drop=2",
        "projection": str(data.resolve() / "p.pt"),
    }
    keys = data_keys()
    assert {k: keys[k] for k in keys if k.startswith("extra_teachers")} == {
        "extra_teachers[].model": "model",
        "extra_teachers[].tokenizer": "tokenizer",
        "extra_teachers[].projection": "file",
    }
    assert not [k for k in keys if k.startswith("trainer.extra_teachers")]  # the run writes it
    with pytest.raises(PathNotAllowed, match="set by the control plane") as e:
        confine({"extra_teachers": [{"tokenizer": "deepseek", "model": "tiny", "run_dir": "x"}]},
                run_dir="r", runs_root=runs, data_roots=[data])  # fmt: skip
    assert e.value.key == "extra_teachers[0].run_dir"


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
                    {"role": "teacher", "teacher": 0, "rank": 0, "mb": 3.0, "memory": "gpu"},
                    {"role": "teacher", "teacher": 1, "rank": 0, "mb": 4.0, "memory": "gpu"},
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
    teacher = (
        'xtoken_process_memory_bytes{run="r\\"1",role="teacher",teacher="%d",rank="0",'
        'memory="gpu"} %d'
    )
    assert teacher % (0, 3145728) in text and teacher % (1, 4194304) in text
    assert "xtoken_trainer_memory_bytes" not in text
    assert 'xtoken_runs{state="RUNNING"} 1' in text and 'xtoken_runs{state="FAILED"} 0' in text
    assert "xtoken_control_uptime_seconds 10" in text
    for line in text.splitlines():
        assert line.startswith("#") or line.startswith("xtoken_"), line


def test_each_folder_of_a_teacher_cache_list_is_confined_like_one_folder(tmp_path):
    runs, data = tmp_path / "runs", tmp_path / "data"
    roots = {"run_dir": "r", "runs_root": runs, "data_roots": [data]}
    out = confine({"data": {"teacher_cache": ["caches/a", None]}}, **roots)
    assert out["data"]["teacher_cache"] == [str(data.resolve() / "caches" / "a"), None]
    with pytest.raises(PathNotAllowed, match="outside the data roots") as e:
        confine({"data": {"teacher_cache": ["caches/a", "/etc"]}}, **roots)
    assert e.value.key == "data.teacher_cache[1]"
    with pytest.raises(PathNotAllowed) as one:
        confine({"data": {"teacher_cache": "/etc"}}, **roots)
    assert one.value.key == "data.teacher_cache"
