"""``trainer.observe.report_to``: the real TensorBoard event files and W&B offline run files hold
the trainer's metric records under the same names and values as its JSONL, and the run config as
hyperparameters; unknown or missing trackers are refused in one line."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.config import to_dict
from services.common.metrics import JsonlWriter, read_jsonl
from services.trainer import tracking
from services.trainer.config import TrainerConfig
from services.trainer.sections import ObserveConfig
from xtoken_core.losses import CrossTokenizerLossConfig

ROOT = Path(__file__).resolve().parents[3]
# the records the trainer shell writes (services/trainer/main.py), in its order
RECORDS = [
    ("compile", {"state": "done", "seconds": 1.25, "compiled": False}),
    ("eval", {"step": 0, "tag": "before", "who": "student", "bits_per_byte": 4.5, "bytes": 900,
              "tokens": 300, "accuracy": 0.01}),
    *[
        ("step", {"step": s, "epoch": 0, "skipped": False, "step_s": 0.5, "tokens_per_s": 256.0 * s,
                  "times": {"data_wait": 0.001, "teacher_wait": 0.002, "forward": 0.2, "loss": 0.05,
                            "backward": 0.2, "optimizer": 0.047},
                  "memory_mb": 512.5, "recompiles": None, "feed": {"claimed": 4 * s},
                  "loss": 3.0 / s, "kl_loss": 2.0 / s, "ce_loss": 1.0 / s, "tokens": 128.0,
                  "micro_batches": 2.0, "grad_norm": 1.5, "lr": 1e-3 * s})
        for s in (1, 2, 3)
    ],
    ("eval", {"step": 3, "tag": "after", "who": "student", "bits_per_byte": 3.5, "bytes": 900,
              "tokens": 300, "accuracy": 0.02}),
]  # fmt: skip
HPARAMS = {
    "run_dir": "runs/x",
    "trainer": {
        "optim": {"lr": 0.001},
        "observe": {"report_to": ["tensorboard"]},
        "eval": {"heldout": None},
        "loss": {"mode": "pkl"},
    },
}


def _write(run_dir: Path, names: list[str], start_step: int = 0, records=RECORDS) -> Path:
    """Feed the records through the trainer's tracked metrics writer; returns the JSONL path."""
    path = run_dir / "metrics" / "trainer.rank0.jsonl"
    trackers = tracking.open_trackers(names, run_dir, HPARAMS, start_step)
    metrics = tracking.TrackedMetrics(JsonlWriter(path, rank=0), trackers, start_step)
    for event, fields in records:
        metrics.write(event, **fields)
    metrics.close()
    return path


def _expected(jsonl: Path) -> dict[str, list[tuple[int, float]]]:
    """Per scalar name, the (step, value) points the JSONL records stand for."""
    out: dict[str, list[tuple[int, float]]] = {}
    step = 0
    for record in read_jsonl(jsonl):
        step = record.get("step", step)
        for name, value in tracking.scalars(record["event"], record).items():
            out.setdefault(name, []).append((step, value))
    return out


def test_a_record_becomes_scalars_named_by_event_and_field_path():
    event, fields = RECORDS[2]
    got = tracking.scalars(event, {**fields, "time": 1.0, "rank": 0})
    assert got["step/loss"] == 3.0 and got["step/lr"] == 1e-3 and got["step/grad_norm"] == 1.5
    assert got["step/tokens_per_s"] == 256.0 and got["step/memory_mb"] == 512.5
    assert got["step/times/forward"] == 0.2 and got["step/feed/claimed"] == 4.0
    assert got["step/skipped"] == 0.0
    assert not {"step/step", "step/time", "step/rank", "step/recompiles"} & set(got)
    assert tracking.scalars(*RECORDS[0]) == {"compile/seconds": 1.25, "compile/compiled": 0.0}
    assert "eval/tag" not in tracking.scalars(*RECORDS[1])


def test_tensorboard_event_files_hold_every_jsonl_metric_and_the_run_config(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    jsonl = _write(tmp_path, ["tensorboard"])
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    expected = _expected(jsonl)
    assert set(events.Tags()["scalars"]) == set(expected)
    for name, points in expected.items():
        got = [(e.step, e.value) for e in events.Scalars(name)]
        assert got == [(s, pytest.approx(v, rel=1e-6)) for s, v in points], name
    assert [e.step for e in events.Scalars("eval/bits_per_byte")] == [0, 3]
    assert [e.step for e in events.Scalars("compile/seconds")] == [0]

    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    assert hparams["trainer.optim.lr"].number_value == pytest.approx(0.001)
    assert hparams["trainer.loss.mode"].string_value == "pkl"
    assert hparams["trainer.observe.report_to"].string_value == '["tensorboard"]'
    assert hparams["trainer.eval.heldout"].string_value == "null"
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(text.removeprefix("```json\n").removesuffix("\n```")) == HPARAMS


def test_a_resumed_trainer_replaces_the_tensorboard_points_past_its_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _write(tmp_path, ["tensorboard"])  # steps 1..3 logged, then a crash; checkpoint at step 1
    again = [("step", {"step": s, "loss": 10.0 * s}) for s in (2, 3, 4)]
    _write(tmp_path, ["tensorboard"], start_step=1, records=again)
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    got = [(e.step, e.value) for e in events.Scalars("step/loss")]
    assert got == [(1, 3.0), (2, 20.0), (3, 30.0), (4, 40.0)]


def _wandb_records(run_file: Path) -> list:
    """The protobuf records of a W&B run file (``run-<id>.wandb``): a 7-byte header (``:W&B``,
    magic, version), then 32 KiB blocks of chunks (crc32, length, type: full, first, middle,
    last), as wandb-core writes them."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full or last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_writes_an_offline_run_with_every_jsonl_metric_and_the_run_config(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    jsonl = _write(tmp_path, ["wandb"])
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1  # offline by default, under the run directory
    run_id = (tmp_path / "wandb" / "xtoken_run_id").read_text().strip()
    records = _wandb_records(runs[0] / f"run-{run_id}.wandb")

    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.run_id, run.project, run.display_name) == (run_id, "xtoken", tmp_path.name)
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert {k: v for k, v in config.items() if k != "_wandb"} == HPARAMS

    got: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        if r.WhichOneof("record_type") != "history":
            continue
        for item in r.history.item:
            name = "/".join(item.nested_key) or item.key
            if not name.startswith("_"):
                got.setdefault(name, []).append((r.history.step.num, json.loads(item.value_json)))
    expected = _expected(jsonl)
    # W&B keeps one row per step: a scalar logged twice at one step keeps its last value
    assert got == {n: list(dict(points).items()) for n, points in expected.items()}


def test_every_wandb_launch_of_a_run_logs_to_one_run_id(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    _write(tmp_path, ["wandb"], records=[("step", {"step": 1, "loss": 1.0})])
    _write(tmp_path, ["wandb"], start_step=1, records=[("step", {"step": 2, "loss": 0.5})])
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    run_id = (tmp_path / "wandb" / "xtoken_run_id").read_text().strip()
    assert len(runs) == 2 and all((r / f"run-{run_id}.wandb").is_file() for r in runs)


def test_the_trainer_logs_its_own_config_when_the_run_wrote_none(tmp_path):
    config = TrainerConfig(
        observe=ObserveConfig(report_to=["tensorboard"]), loss=CrossTokenizerLossConfig(mode="ce")
    )
    assert tracking.run_hparams(to_dict(config), tmp_path) == {"trainer": to_dict(config)}
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "run.json").write_text(json.dumps(HPARAMS))
    assert tracking.run_hparams(to_dict(config), tmp_path) == HPARAMS


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_a_tracker_whose_package_is_missing_names_the_pip_extra(name, monkeypatch):
    monkeypatch.setitem(sys.modules, name, None)  # how Python marks a module as not importable
    with pytest.raises(ValueError) as e:
        tracking.check_installed(["tensorboard", "wandb"])
    message = str(e.value)
    assert "\n" not in message
    assert f"trainer.observe.report_to: {name} needs the '{name}' package" in message
    assert message.endswith("install the tracking extra: " + tracking.EXTRA_INSTALL)


def test_xtoken_run_with_a_missing_tracker_package_exits_2_in_one_line(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(f"run_dir: {tmp_path / 'run'}\ntrainer:\n  observe: {{report_to: [wandb]}}\n")
    code = (
        "import sys; sys.modules['wandb'] = None\n"  # wandb not installed
        "from services.cli import main\n"
        f"sys.exit(main(['run', {str(config)!r}, '--no-progress']))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == (
        "xtoken run: trainer.observe.report_to: wandb needs the 'wandb' package, which is not "
        "installed; install the tracking extra: pip install 'xtoken[tracking]' (in a checkout: "
        "pip install -e '.[tracking]')"
    ), proc.stderr
    assert "Traceback" not in proc.stderr
