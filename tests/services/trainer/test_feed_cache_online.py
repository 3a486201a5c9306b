"""An online cached teacher (``teacher.cache_missing: online``) in the trainer's feed, in process:
the collator puts the samples the teacher cache lacks marked not cached, the feed asks the live
teacher (the ``topk`` transport at the cache's K, a TeacherWorker serving a real queue from a
thread) for those rows alone and never for a micro-batch the cache holds whole, and each
micro-batch's logits and loss equal those of the whole cache (fp32 log-probs) on the same
samples; every sample is trained once."""

from __future__ import annotations

import dataclasses
import json
import threading
import types

import pytest
import torch

from services import protocol as proto
from services.cache.build import BuildOptions, CacheBuilder
from services.cache.check import corpus_keys
from services.collator.config import WorkerConfig
from services.collator.worker import CollatorWorker
from services.protocol import put_eof
from services.queue.client import QueueClient
from services.supervise.config import run_config_from_dict
from services.teacher import main as teacher_main
from services.teacher.worker import TeacherWorker
from services.trainer.trainer import build_step
from tests.services.queue.conftest import ServerProcess
from tests.services.trainer import distill_setup as setup
from xtoken_core.cache.attach import topk_of_batch
from xtoken_core.cache.format import Codec
from xtoken_core.data.sample import pad_samples
from xtoken_core.data_plane.codec import columns_to_samples
from xtoken_core.losses.sparse_teacher import SparseTeacher, dense_teacher_logits
from xtoken_core.wire.topk import decode_topk

PARTITION = "train"
K = 8
# the corpus lines the cache is made to lack: micro-batches of 2 in put order are then
# (0, 1) half cached, (2, 3) not cached, (4, 5) and (6, 7) cached
LACKING = (1, 2, 3)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A cache of :data:`setup.TEXTS` with exact (fp32) log-probs, its builder and the keys."""
    tmp = tmp_path_factory.mktemp("online")
    corpus = tmp / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in setup.TEXTS))
    config = run_config_from_dict(
        {
            "run_dir": str(tmp / "run"),
            "student_tokenizer": setup.STUDENT_TOKENIZER,
            "teacher_tokenizer": setup.TEACHER_TOKENIZER,
            "ctx_student": setup.CTX,
            "ctx_teacher": setup.CTX,
            "data": {"train": str(corpus)},
            "teacher": {"model": "tiny", "max_batch": 4, "max_length": setup.CTX, "top_k": K},
        }
    )
    options = BuildOptions(out=str(tmp / "cache"), codec=Codec(logprobs="fp32"), progress=False)
    builder = CacheBuilder(config, options)
    builder.run()
    return str(tmp / "cache"), builder, corpus_keys(config, str(corpus), None)


@pytest.fixture
def queue(tmp_path):
    server = ServerProcess(tmp_path, "--capacity", "64MiB")
    yield server.address
    server.stop()


class _Lacking:
    """A cache reader that lacks ``keys`` (the others as ``reader`` holds them)."""

    def __init__(self, reader, keys: set[str]) -> None:
        self.reader, self.keys = reader, keys
        self.directory, self.k = reader.directory, reader.k

    def get(self, key: str):
        if key in self.keys:
            raise KeyError(key)
        return self.reader.get(key)


def _collate(cache: str, keys: list[str], lacking: set[str] = frozenset()):
    """The collator's put of :data:`setup.TEXTS` with the cache made to lack ``lacking``."""
    config = WorkerConfig(
        queue="tcp://127.0.0.1:1", student=setup.STUDENT_TOKENIZER,
        teacher=setup.TEACHER_TOKENIZER, partition=PARTITION, ctx_student=setup.CTX,
        ctx_teacher=setup.CTX, teacher_cache=(cache,), teacher_cache_missing="online",
    )  # fmt: skip
    worker = CollatorWorker(config, client=object())
    worker.caches[0] = _Lacking(worker.caches[0], set(lacking))
    return worker.collate(list(zip(keys, setup.TEXTS, strict=True)))


class _Rows:
    """The teacher's metrics: the rows of each request it served."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def write(self, event: str, **record) -> None:
        if event == "request":
            self.rows.append(record["rows"])


@pytest.fixture
def live_teacher(queue, built):
    """The cache's teacher serving ``queue`` with the topk transport at K, from a thread."""
    _, builder, _ = built
    config = dataclasses.replace(
        builder.teacher_config(), queue=queue, partition=PARTITION, claim_timeout_s=0.1
    )
    worker = TeacherWorker(config)
    client = QueueClient(queue, timeout_s=10, name="teacher-test")
    lc, served = types.SimpleNamespace(stop=threading.Event()), _Rows()
    thread = threading.Thread(
        target=teacher_main._loop,
        args=(client, worker, proto.request_partition(PARTITION, 0), config, lc, served),
        daemon=True,
    )
    thread.start()
    yield served
    lc.stop.set()
    thread.join(timeout=20)
    client.close()
    worker.close()


@pytest.mark.timeout(120)
def test_the_live_teacher_serves_the_rows_the_cache_lacks_with_the_caches_logits_and_loss(
    queue, built, live_teacher, projection
):
    cache, builder, keys = built
    lacking = {keys[i] for i in LACKING}
    put_keys, fields = _collate(cache, keys, lacking)
    assert fields["teacher_topk_cached"].tolist() == [k not in lacking for k in keys]
    # every target from the cache: what the live teacher's rows must equal
    _, whole = _collate(cache, keys)
    reference = dict(zip(keys, columns_to_samples(whole), strict=True))
    with QueueClient(queue, timeout_s=10) as client:
        client.put(PARTITION, put_keys, fields)
        put_eof(client, PARTITION, len(keys))
    config = setup.trainer_config(
        projection, queue=queue, partition=PARTITION, feed={"claim_timeout_s": 0.2},
        teacher={"cache": cache, "cache_missing": "online"}, loss={"vocab_topk": None},
    )  # fmt: skip
    step = build_step(config)
    W = builder.worker.width
    trained: set[str] = set()
    kinds = []
    with QueueClient(queue, timeout_s=10) as client:
        feed = setup.teacher_feed(client, config, trained, pads=setup.pads(), cached_widths=[W])
        while not feed.ended:
            mbs = feed.next_step(1)
            if not mbs:
                continue
            (mb,) = mbs
            missing = [i for i, key in enumerate(mb.keys) if key in lacking]
            asked_rows = mb.context.missing.get(0, torch.zeros(0, dtype=torch.int64)).tolist()
            assert asked_rows == missing, mb.keys  # those rows alone are asked
            assert (mb.context.asked == [None]) == (not missing)  # none asked: the cache's
            kinds.append(
                "cached" if not missing else "live" if len(missing) == len(mb.keys) else "mixed"
            )
            got = mb.teacher_logits()
            assert isinstance(got, SparseTeacher) or missing  # cached: the targets alone
            logits_BUW = dense_teacher_logits(got)
            want = pad_samples([reference[k] for k in mb.keys], **setup.pads())
            want_BUW = decode_topk(topk_of_batch(want), W)
            mask_BU = mb.batch["teacher_token_mask"]
            torch.testing.assert_close(logits_BUW[mask_BU], want_BUW[mask_BU], rtol=0, atol=1e-4)
            torch.manual_seed(0)
            T = mb.batch["input_ids"].shape[1]
            student_BTV = torch.randn(len(mb.keys), T, step.student.vocab)
            loss, _ = step.loss_fn(student_BTV, got, mb.batch)
            want_loss, _ = step.loss_fn(student_BTV, want_BUW, want)
            assert torch.isfinite(loss)
            torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=1e-5)
            mb.done()
            feed.ack(mbs)
        counters = feed.counters
        feed.give_back()
    assert trained == set(keys)
    assert sorted(kinds) == ["cached", "cached", "live", "mixed"]
    assert sorted(live_teacher.rows) == [1, 2]  # one request per micro-batch that lacks a row
    assert counters["cache_missing"] == len(lacking) and counters["re_requests"] == 0


@pytest.mark.timeout(120)
def test_cached_targets_are_read_from_the_steps_device_copy_and_their_shapes_checked(
    queue, built, projection
):
    from xtoken_core.data.sample import TOPK_FIELDS, teacher_field_name

    cache, builder, keys = built
    put_keys, fields = _collate(cache, keys)
    with QueueClient(queue, timeout_s=10) as client:
        client.put(PARTITION, put_keys, fields)
        put_eof(client, PARTITION, len(keys))
    config = setup.trainer_config(
        projection, queue=queue, partition=PARTITION, feed={"claim_timeout_s": 0.2},
        teacher={"cache": cache}, loss={"vocab_topk": None},
    )  # fmt: skip
    W = builder.worker.width
    ids, logprobs = (teacher_field_name(f.name, 0) for f in TOPK_FIELDS[:2])
    with QueueClient(queue, timeout_s=10) as client:
        feed = setup.teacher_feed(client, config, set(), pads=setup.pads(), cached_widths=[W])
        mbs = []
        while not mbs:
            mbs = feed.next_step(1)
        (mb,) = mbs
        # the step's copy of the batch (here another CPU tensor): the targets come from it
        mb.on_device = {k: v.clone() for k, v in mb.batch.items()}
        mb.on_device[logprobs] -= 1.0
        got = mb.teacher_logits()
        torch.testing.assert_close(
            got.targets.logprobs_NK.float(), mb.on_device[logprobs].float(), rtol=0, atol=0
        )
        # shapes and dtypes are checked on the host copy; the ids' range was checked where the
        # collator read them (xtoken_core.cache.format.decode_positions), not on the step's path
        mb.batch[ids] = mb.batch[ids][..., :-1]
        with pytest.raises(ValueError, match=r"top-k targets of shapes ids"):
            mb.teacher_logits()
        feed.give_back()
