"""The Trainer on a real queue (CE, no teacher): a run trains every sample once and evaluates,
checkpoints and summarizes; a launch that resumes from a checkpoint trains only the rest; a stop
ends at a step boundary with a checkpoint, and one whose queue dies meanwhile ends in seconds,
sending it nothing again; the hidden transport's output layer is the teacher's; the components
take the trainer settings of their parameters' names."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import threading
import time

import pytest
import torch

from services.collator.worker import samples_to_put_fields
from services.protocol import put_eof
from services.queue.client import QueueClient, connect
from services.teacher.config import TeacherConfig
from services.teacher.worker import TeacherWorker
from services.trainer.sections import ComputeConfig, StudentConfig, TeacherLinkConfig
from services.trainer.student import Student
from services.trainer.trainer import Trainer, settings_of, teacher_output_layer
from tests.sections import merged
from tests.services.queue.conftest import ServerProcess, stop_with_queue
from tests.services.trainer import distill_setup as setup

PARTITION = "train"

# single-process DCP (no process group) is what these runs mean
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture
def queue(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("queue"), "--capacity", "64MiB")
    yield server.address
    server.stop()


def _put(address: str, n: int) -> list[str]:
    """The first ``n`` test samples put into the partition, with the end-of-data marker."""
    samples = setup.samples()[:n]
    keys = [f"s{i}" for i in range(n)]
    with QueueClient(address, timeout_s=10) as client:
        client.put(PARTITION, keys, samples_to_put_fields(samples))
        put_eof(client, PARTITION, n)
    return keys


def _run(address: str, run_dir, heldout=(), stop=None, **overrides) -> Trainer:
    config = setup.trainer_config(
        None,
        queue=address,
        partition=PARTITION,
        run_dir=str(run_dir),
        **merged(
            {"schedule": {"export": False, "max_steps": 0}, "feed": {"claim_timeout_s": 0.2}},
            overrides,
        ),
    )
    with QueueClient(address, timeout_s=10) as client:
        trainer = Trainer(config, client, heldout=heldout, stop=stop)
        trainer.train()
    return trainer


def _trained(run_dir) -> list[str]:
    lines = (run_dir / "keys" / "trainer.rank0.jsonl").read_text().splitlines()
    return [k for line in lines for k in json.loads(line)["keys"]]


def test_a_run_trains_every_sample_once_then_evaluates_and_writes_its_summary(queue, tmp_path):
    keys = _put(queue, 5)
    trainer = _run(queue, tmp_path, heldout=setup.TEXTS[:2])
    assert sorted(_trained(tmp_path)) == keys  # micro-batches of 2: steps of 2, 2 and 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["step"] == 3 and not summary["stopped"] and summary["skipped"] == 0
    assert summary["student_after"]["bits_per_byte"] < summary["student_before"]["bits_per_byte"]
    events = [json.loads(line) for line in (tmp_path / "metrics" / "trainer.rank0.jsonl").open()]
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3]
    # each step's start, in order and before its record (written once the next step is queued)
    starts = [e["started"] for e in steps]
    assert starts == sorted(starts) and all(e["started"] <= e["time"] for e in steps)
    assert [e["tag"] for e in events if e["event"] == "eval"] == ["before", "after"]
    assert trainer.student.step == 3 and (tmp_path / "checkpoints" / "latest").exists()


def test_the_eval_after_training_takes_the_last_steps_eval_when_it_ran_on_those_weights(
    queue, tmp_path, monkeypatch
):
    _put(queue, 5)  # steps of 2, 2 and 1: the periodic eval at step 3 is the last step's
    passes = []
    real = Student.evaluate

    def counted(self, texts, ctx):
        passes.append(self.step)
        return real(self, texts, ctx)

    monkeypatch.setattr(Student, "evaluate", counted)
    _run(queue, tmp_path, heldout=setup.TEXTS[:2], schedule={"eval_every": 3})
    assert passes == [0, 3]  # before, at step 3; the eval after reads step 3's
    events = [json.loads(line) for line in (tmp_path / "metrics" / "trainer.rank0.jsonl").open()]
    evals = {e["tag"]: e for e in events if e["event"] == "eval"}
    assert list(evals) == ["before", "step3", "after"]
    assert evals["after"]["step"] == 3
    assert evals["after"]["bits_per_byte"] == evals["step3"]["bits_per_byte"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["student_after"] == summary["student_step3"]


def test_a_resumed_launch_trains_what_its_checkpoint_did_not_hold(queue, tmp_path):
    keys = _put(queue, 6)
    _run(queue, tmp_path, schedule={"max_steps": 1})  # one step, then its checkpoint
    first = _trained(tmp_path)
    assert len(first) == 2
    resumed = _run(queue, tmp_path)
    everything = _trained(tmp_path)
    assert sorted(everything) == keys and len(everything) == len(set(everything))
    assert resumed.summary["resumed_from"] == 1 and resumed.student.step == 3


def test_a_run_without_its_final_checkpoint_writes_none_and_a_later_launch_trains_again(
    queue, tmp_path
):
    """``schedule.final_checkpoint: false`` (a benchmark's run): no checkpoint at the end, so no
    checkpoint holds what it trained; a launch after it in the same folder starts from the
    first weights and trains every sample again, each once."""
    keys = _put(queue, 4)
    first = _run(queue, tmp_path, schedule={"final_checkpoint": False, "checkpoint_every": 10})
    assert first.student.step == 2 and sorted(_trained(tmp_path)) == keys
    assert not (tmp_path / "checkpoints" / "latest").exists()
    (tmp_path / "keys" / "trainer.rank0.jsonl").unlink()  # what the second launch trains
    second = _run(queue, tmp_path)
    assert second.summary["resumed_from"] == 0 and sorted(_trained(tmp_path)) == keys
    assert (tmp_path / "checkpoints" / "latest").exists()


def test_a_stop_ends_at_a_step_boundary_with_a_checkpoint(queue, tmp_path):
    _put(queue, 4)
    stop = threading.Event()
    stop.set()  # asked to stop before the first step
    trainer = _run(queue, tmp_path, stop=stop)
    assert trainer.stopped and trainer.student.step == 0
    assert json.loads((tmp_path / "summary.json").read_text())["stopped"]
    assert (tmp_path / "checkpoints" / "step_00000000").is_dir()
    assert not (tmp_path / "keys" / "trainer.rank0.jsonl").read_text()


def _stopping_trainer(address: str, run_dir, stop: threading.Event, **overrides) -> Trainer:
    """A trainer as the trainer process makes it: its client stops trying once ``stop`` is set."""
    config = setup.trainer_config(
        None,
        queue=address,
        partition=PARTITION,
        run_dir=str(run_dir),
        **merged({"schedule": {"export": False, "max_steps": 0}}, overrides),
    )
    client = connect(address, timeout_s=10.0, name="trainer0", stopping=stop)  # 3 tries: 30 s
    return Trainer(config, client, stop=stop)


def _went_away(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "queue went away" in r.getMessage()]


def test_a_trainer_stopped_while_its_queue_dies_mid_step_acks_nothing_and_ends_at_once(
    tmp_path, caplog
):
    """SIGTERM of the whole run (its launcher died): the queue dies while a step computes. The
    step's ack finds the connection dropped and is not sent (not retried 3 x 10 s, then a
    failure): the trainer ends in a moment, without the stop's checkpoint, its samples leased."""
    server = ServerProcess(tmp_path, "--capacity", "64MiB")
    stop = threading.Event()
    try:
        _put(server.address, 2)
        trainer = _stopping_trainer(
            server.address, tmp_path / "run", stop, schedule={"checkpoint_every": 0}
        )  # acks after each step
        run = trainer.student_step.run
        killed: dict[str, float] = {}

        def step_while_the_run_stops(micro_batches, clock):
            result = run(micro_batches, clock)
            stop.set()
            server.proc.kill()
            server.proc.wait(10)
            time.sleep(0.5)  # the connection's drop is seen before the ack is sent
            killed["t"] = time.monotonic()
            return result

        trainer.student_step.run = step_while_the_run_stops
        with caplog.at_level(logging.INFO, logger="services.trainer.trainer"):
            trainer.train()
        stop_s = time.monotonic() - killed["t"]
        trainer.client.close()
    finally:
        stop.set()
        server.stop()
    assert stop_s < 5.0, stop_s  # one reply's wait is 10 s
    assert trainer.stopped and trainer.queue_gone and trainer.student.step == 1
    (line,) = _went_away(caplog)
    assert "ack to " in line and "not sent (its connection dropped)" in line, line
    assert "no checkpoint at this stop: the next launch resumes from step 0" in line, line
    assert not (tmp_path / "run" / "checkpoints").exists()  # weights without their keys' acks
    assert not (tmp_path / "run" / "keys" / "trainer.rank0.jsonl").read_text()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["stopped"]


def test_a_trainer_stopped_while_its_claim_waits_on_a_dying_queue_ends_in_seconds(tmp_path, caplog):
    """Stopped while its claim waits at the queue (no samples yet), and the queue killed a
    moment later: the drop is noticed within ~2 s and the claim is not sent again; train()
    returns (the process exits 0), it does not fail after retries."""
    server = ServerProcess(tmp_path, "--capacity", "64MiB")
    stop = threading.Event()
    result: dict = {}
    try:
        trainer = _stopping_trainer(
            server.address, tmp_path / "run", stop, feed={"claim_timeout_s": 5.0}
        )

        def train():
            try:
                trainer.train()
            except BaseException as e:  # surfaced by the test
                result["error"] = e

        with caplog.at_level(logging.INFO, logger="services.trainer.trainer"):
            thread = threading.Thread(target=train, daemon=True)
            thread.start()
            with QueueClient(server.address, timeout_s=10) as probe:
                deadline = time.monotonic() + 60
                while not probe.stats().get("parked_claims"):  # its claim waits at the queue
                    assert time.monotonic() < deadline and thread.is_alive(), result
                    time.sleep(0.05)
            stop_s = stop_with_queue(stop, server, thread)  # a SIGTERM with the queue's SIGKILL
        trainer.client.close()
    finally:
        stop.set()
        server.stop()
    assert result == {} and not thread.is_alive(), result
    assert stop_s < 5.0, stop_s
    (line,) = _went_away(caplog)
    assert "claim to " in line and "not sent again (its connection dropped)" in line, line
    assert trainer.stopped and trainer.student.step == 0


def _teacher(teacher_seed: int) -> dict:
    """The teacher settings of a trainer of the tiny preset teacher."""
    config = setup.trainer_config(None, teacher={"model": "tiny", "seed": teacher_seed})
    return settings_of(
        teacher_output_layer, config.teacher, tokenizer=config.teacher_tokenizer,
        device=torch.device("cpu"),
    )  # fmt: skip


def test_the_hidden_transport_output_layer_is_the_preset_teachers_own():
    teacher = TeacherWorker(
        TeacherConfig(model="tiny", tokenizer=setup.TEACHER_TOKENIZER, transport="hidden", seed=4)
    )
    layer = teacher_output_layer(**_teacher(teacher_seed=4))
    assert torch.equal(layer.weight, teacher.lm_head.weight)
    other = teacher_output_layer(**_teacher(teacher_seed=5))
    assert not torch.equal(other.weight, teacher.lm_head.weight)


@pytest.mark.parametrize(
    ("component", "sections", "given"),
    [
        (
            Student,
            (StudentConfig, ComputeConfig),
            {"spec", "tokenizer", "device", "rank", "world_size", "module", "pack", "optim",
             "max_steps"},
        ),
        (teacher_output_layer, (TeacherLinkConfig,), {"tokenizer", "device"}),
    ],
    ids=["student", "teacher_output_layer"],
)  # fmt: skip
def test_every_setting_a_component_takes_by_name_is_one_of_its_sections(component, sections, given):
    # settings_of passes the settings of a component's own sections by name: a parameter no
    # setting there is named after (and the trainer does not give) would silently keep its
    # default
    fields = {f.name for section in sections for f in dataclasses.fields(section)}
    missing = set(inspect.signature(component).parameters) - given - fields
    assert not missing, f"{component.__name__} takes {sorted(missing)}: no setting of its sections"
