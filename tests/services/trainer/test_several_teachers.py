"""A trainer of two teachers of different tokenizer families (student mistral, teachers smollm2
and qwen3), each served by a real TeacherWorker on a real queue: every micro-batch asks each
teacher for the logits of its own rows, on its own request partition, and gets them back in
order (packed rows with each teacher's own positions); every sample trains once; the step records
hold each teacher's figures beside the totals (in the JSONL file and the trackers alike); the
hidden transport of a further teacher applies its own output layer; each teacher's projection
is checked against its own tokenizer."""

from __future__ import annotations

import contextlib
import json
import threading
import types

import pytest
import torch

from services import protocol as proto
from services.protocol import put_eof
from services.queue.client import QueueClient
from services.teacher import main as teacher_main
from services.teacher.config import TeacherConfig
from services.teacher.worker import TeacherWorker
from services.trainer import tracking
from services.trainer.trainer import Trainer, build_step
from tests.services.queue.conftest import ServerProcess
from tests.services.trainer import distill_setup as setup
from xtoken_core.data.sample import pad_samples
from xtoken_core.ipc.logit_ring import LogitRingReader

PARTITION = "train"
# each teacher's own figures in a step record of a loss of several teachers
FIGURES = ("kl_loss", "kl_common", "l1_uncommon", "proj_accuracy", "num_valid_chunks")
WEIGHTS = (0.25, 0.75)

# single-process DCP (no process group) is what these runs mean
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture
def queue(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("queue"), "--capacity", "256MiB")
    yield server.address
    server.stop()


def _teacher_config(queue: str, teacher: int, pack: bool = False) -> TeacherConfig:
    """Teacher 0: the tiny preset of the first teacher tokenizer (seed 1,
    ``setup.teacher_model``); teacher 1: of the second's (seed 2, ``setup.second_teacher_model``).
    """
    tokenizer = setup.TEACHER_TOKENIZER if teacher == 0 else setup.SECOND_TEACHER_TOKENIZER
    return TeacherConfig(
        queue=queue, partition=PARTITION, model="tiny", tokenizer=tokenizer, slots=2,
        max_batch=2, max_length=2 * setup.CTX if pack else setup.CTX, seed=1 + teacher,
        checksum=True, claim_timeout_s=0.1, pack=pack,
    )  # fmt: skip


@contextlib.contextmanager
def _serving(queue: str, pack: bool = False):
    """Both teachers, each serving group 0 of its own request partition from a thread."""
    served = []
    try:
        for teacher in (0, 1):
            config = _teacher_config(queue, teacher, pack)
            worker = TeacherWorker(config)
            client = QueueClient(queue, timeout_s=10, name=f"teacher-{teacher}")
            lc = types.SimpleNamespace(stop=threading.Event())
            partition = proto.request_partition(PARTITION, 0, teacher)
            thread = threading.Thread(
                target=teacher_main._loop,
                args=(client, worker, partition, config, lc, None),
                daemon=True,
            )
            thread.start()
            served.append((worker, client, lc, thread))
        yield [worker for worker, *_ in served]
    finally:
        for worker, client, lc, thread in served:
            lc.stop.set()
            thread.join(timeout=20)
            client.close()
            worker.close()


@pytest.fixture
def teachers(queue):
    with _serving(queue) as workers:
        yield workers


def _put(address: str, n: int, pack: bool = False) -> list[str]:
    """The first ``n`` samples (or packed rows) of two teachers put into the partition, with the
    end-of-data marker."""
    samples = setup.two_teacher_samples(pack)[:n]
    keys = [f"s{i}" for i in range(n)]
    with QueueClient(address, timeout_s=10) as client:
        client.put(PARTITION, keys, setup.put_fields(samples))
        put_eof(client, PARTITION, n)
    return keys


def _config(projection: str, second_projection: str, extra=None, **overrides):
    """A P-KL trainer of both teachers, weighted 0.25 and 0.75 (``extra``: more keys of teacher
    1's entry of extra_teachers; ``overrides``: as ``setup.trainer_config``'s)."""
    extra = {
        "tokenizer": setup.SECOND_TEACHER_TOKENIZER,
        "projection": second_projection,
        "weight": WEIGHTS[1],
        "verify_logits": True,
        **(extra or {}),
    }
    return setup.trainer_config(
        projection,
        partition=PARTITION,
        feed={"claim_timeout_s": 0.2},
        teacher={"verify_logits": True, "weight": WEIGHTS[0]},
        extra_teachers=[extra],
        **overrides,
    )


@pytest.mark.timeout(300)
def test_each_micro_batch_gets_each_teachers_logits_of_its_own_rows_and_every_sample_trains_once(
    queue, teachers, projection, second_projection
):
    keys = _put(queue, 5)  # micro-batches of 2: the last one has a single row
    config = _config(projection, second_projection, queue=queue)
    step = build_step(config)
    assert step.loss_fn.config.teacher_weights == WEIGHTS
    widths = (setup.tokenizers()[1].vocab_size, setup.second_tokenizer().vocab_size)
    assert step.loss_fn.config.teacher_vocab_size == widths
    trained: set[str] = set()
    with QueueClient(queue, timeout_s=10) as client, LogitRingReader() as reader:
        feed = setup.teacher_feed(
            client, config, trained, pads=setup.two_teacher_pads(), reader=reader
        )
        seen, records = [], []
        while not feed.ended:
            mbs = feed.next_step(1)
            if not mbs:
                continue
            (mb,) = mbs
            logits = mb.teacher_logits()
            assert isinstance(logits, list) and len(logits) == 2
            for teacher, got in enumerate(logits):
                want = setup.teacher_logits(mb.batch, teacher).to(got.dtype)
                assert torch.equal(got, want), (teacher, mb.keys)  # its own forward of its rows
            result = step.run(mbs)
            assert not result.skipped
            feed.ack(mbs)
            seen += mb.keys
            records.append(result.metrics)
        feed.give_back()
    assert sorted(seen) == keys and trained == set(keys)
    assert [worker.computed for worker in teachers] == [3, 3]  # one request per micro-batch
    assert all(r.in_flight() == [] for worker in teachers for r in worker.rings.values())
    assert feed.counters["re_requests"] == 0 and feed.counters["teacher1_re_requests"] == 0
    for metrics in records:
        for teacher in (0, 1):
            assert {f"teacher{teacher}_{f}" for f in FIGURES} <= set(metrics)
        total = sum(w * metrics[f"teacher{i}_kl_loss"] for i, w in enumerate(WEIGHTS))
        assert metrics["kl_loss"] == pytest.approx(total, rel=1e-4, abs=1e-6)


@pytest.mark.timeout(300)
def test_a_run_of_two_teachers_writes_each_teachers_figures_into_its_step_records(
    queue, teachers, projection, second_projection, tmp_path
):
    keys = _put(queue, 4)
    config = _config(
        projection, second_projection, queue=queue, run_dir=str(tmp_path),
        schedule={"export": False, "max_steps": 0, "eval_every": 0},
    )  # fmt: skip
    with QueueClient(queue, timeout_s=10) as client:
        trainer = Trainer(config, client)
        trainer.train()
    assert trainer.student.step == 2 and not trainer.stopped
    lines = (tmp_path / "keys" / "trainer.rank0.jsonl").read_text().splitlines()
    assert sorted(k for line in lines for k in json.loads(line)["keys"]) == keys
    events = [json.loads(line) for line in (tmp_path / "metrics" / "trainer.rank0.jsonl").open()]
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 2]
    chunks = [0.0, 0.0]
    for record in steps:
        for teacher in (0, 1):
            assert {f"teacher{teacher}_{f}" for f in FIGURES} <= set(record), sorted(record)
            chunks[teacher] += record[f"teacher{teacher}_num_valid_chunks"]
        total = sum(w * record[f"teacher{i}_kl_loss"] for i, w in enumerate(WEIGHTS))
        assert record["kl_loss"] == pytest.approx(total, rel=1e-4, abs=1e-5)
        assert record["feed"]["teacher1_re_requests"] == 0
        # the trackers get them as they get the totals
        scalars = tracking.scalars("step", record)
        assert {"step/kl_loss", "step/teacher0_kl_loss", "step/teacher1_proj_accuracy"} <= set(
            scalars
        )
    # each teacher's chunk counts, summed over the micro-batches: its valid chunks of the samples
    batch = pad_samples(setup.two_teacher_samples()[:4], **setup.two_teacher_pads())
    counted = trainer.student_step.loss_fn.count_valid([batch])["global_valid_chunks"]
    assert chunks == counted.tolist() and min(chunks) > 0


@pytest.mark.timeout(300)
def test_packed_rows_ask_each_teacher_with_its_own_positions(queue, projection, second_projection):
    rows = setup.two_teacher_samples(pack=True)
    assert len(rows) >= 2 and all("teacher1_position_ids" in row for row in rows)
    keys = _put(queue, len(rows), pack=True)
    config = _config(projection, second_projection, queue=queue, pack=True)
    step = build_step(config)
    seen, asked = [], 0
    with (
        _serving(queue, pack=True) as workers,
        QueueClient(queue, timeout_s=10) as client,
        LogitRingReader() as reader,
    ):
        feed = setup.teacher_feed(client, config, pads=setup.two_teacher_pads(), reader=reader)
        while not feed.ended:
            mbs = feed.next_step(1)
            for mb in mbs:
                for teacher, got in enumerate(mb.teacher_logits()):
                    # each document of a row attends within itself, in each teacher's tokens
                    want = setup.teacher_logits(mb.batch, teacher).to(got.dtype)
                    assert torch.equal(got, want), (teacher, mb.keys)
            if mbs:
                assert not step.run(mbs).skipped
                feed.ack(mbs)
                seen += [k for mb in mbs for k in mb.keys]
                asked += len(mbs)  # one request of each teacher per micro-batch
        feed.give_back()
        assert [worker.computed for worker in workers] == [asked, asked]
    assert sorted(seen) == sorted(keys)


def test_the_hidden_transport_of_an_extra_teacher_applies_that_teachers_own_output_layer(
    projection, second_projection, tmp_path
):
    extra = {"model": "tiny", "seed": 4}  # the hidden transport: its output layer here
    config = _config(projection, second_projection, extra, run_dir=str(tmp_path))
    trainer = Trainer(config, client=None)
    assert trainer.output_layers[0] is None  # teacher 0 serves logits through a ring
    teacher = TeacherWorker(
        TeacherConfig(
            model="tiny", tokenizer=setup.SECOND_TEACHER_TOKENIZER, transport="hidden", seed=4
        )
    )
    assert torch.equal(trainer.output_layers[1].weight, teacher.lm_head.weight)
    assert trainer.pads["teacher_pad_id"] == setup.two_teacher_pads()["teacher_pad_id"]


def test_an_extra_teachers_projection_of_another_tokenizer_is_refused_naming_its_key(
    projection, second_projection
):
    # teacher 1's file is teacher 0's (built for the first teacher tokenizer): refused before
    # anything is asked of a teacher, naming teacher 1's key
    config = _config(projection, projection)
    with pytest.raises(ValueError, match=r"^extra_teachers\[0\]\.projection: projection file .* "
                       r"was built for teacher tokenizer"):  # fmt: skip
        build_step(config)
    swapped = _config(second_projection, second_projection)
    with pytest.raises(ValueError, match=r"^projection file .* was built for teacher tokenizer"):
        build_step(swapped)
