"""Training from a teacher cache, in process: the collator worker puts each sample's cached top-K
targets beside its fields, the trainer's feed decodes them, and the loss equals the loss of the
live ``topk`` transport on the same samples at the same K; a sample the cache does not hold, or
holds for other teacher tokens, is refused naming its key; with ``teacher_cache_missing:
online`` a sample the cache does not hold is put marked for the live teacher instead."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.cache.build import BuildOptions, CacheBuilder
from services.collator.config import WorkerConfig
from services.collator.worker import CollatorWorker
from services.protocol import teacher as proto
from services.protocol.teacher import Request
from services.supervise.config import run_config_from_dict
from xtoken_core.cache.attach import topk_of_batch
from xtoken_core.cache.format import Codec
from xtoken_core.data.collator import resolve_pad_id
from xtoken_core.data.sample import cached_teachers_of, pad_samples
from xtoken_core.data_plane.codec import columns_to_samples
from xtoken_core.wire import JaggedColumn
from xtoken_core.wire.topk import decode_topk, encode_topk

K = 8
CTX = 32
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Tokenizers disagree: 'unbelievable' may be one token or three.",
    "A short one.",
    "Numbers such as 3.14159 and 2718 split into digits differently.",
    "",
]


def _config(tmp: Path, **data):
    return run_config_from_dict(
        {
            "run_dir": str(tmp / "run"),
            "student_tokenizer": "mistral",
            "teacher_tokenizer": "smollm2",
            "ctx_student": CTX,
            "ctx_teacher": CTX,
            "data": {"train": str(tmp / "corpus.jsonl"), **data},
            "teacher": {"model": "tiny", "max_batch": 4, "max_length": CTX, "top_k": K},
        }
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A corpus, a cache of it with exact (fp32) log-probs, and the builder's teacher worker."""
    tmp = tmp_path_factory.mktemp("cache")
    (tmp / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    options = BuildOptions(out=str(tmp / "cache"), codec=Codec(logprobs="fp32"), progress=False)
    builder = CacheBuilder(_config(tmp), options)
    builder.run()
    return tmp, builder


def _keys(tmp: Path, config) -> list[str]:
    from services.cache.check import corpus_keys

    return corpus_keys(config, str(tmp / "corpus.jsonl"), None)


def _worker(cache: str, missing: str = "error") -> CollatorWorker:
    config = WorkerConfig(
        queue="tcp://127.0.0.1:1",
        student="mistral",
        teacher="smollm2",
        partition="p",
        ctx_student=CTX,
        ctx_teacher=CTX,
        teacher_cache=(cache,),
        teacher_cache_missing=missing,
    )
    return CollatorWorker(config, client=object())


def _live_logits(worker, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """What the trainer's client of the live topk transport decodes for a padded batch: the
    teacher's logits encoded to top-K on the teacher, sent as the four topk fields, decoded."""
    ids_BU = batch["teacher_input_ids"]
    request = Request("r", 0, ids_BU, batch["teacher_input_lengths"])
    with torch.inference_mode():
        sent = proto.topk_columns(encode_topk(worker.logits(request), K))
    targets = proto.topk_from_columns(list(sent), *ids_BU.shape, "r")
    return decode_topk(targets, worker.width)


def test_the_loss_from_a_cache_equals_the_loss_of_the_live_topk_transport(built, tmp_path):
    from services.trainer.trainer import build_step
    from tests.services.trainer import distill_setup as setup

    tmp, builder = built
    keys, fields = _worker(str(tmp / "cache")).collate(list(zip(_keys(tmp, builder.config), TEXTS)))
    assert {"teacher_topk_ids", "teacher_topk_logprobs", "teacher_topk_rest"} <= set(fields)
    assert isinstance(fields["teacher_topk_ids"], JaggedColumn)
    samples = columns_to_samples(fields)  # as a trainer claims them
    assert cached_teachers_of(samples[0]) == (0,)
    student, teacher = setup.tokenizers()
    batch = pad_samples(
        samples, student_pad_id=resolve_pad_id(student), teacher_pad_id=resolve_pad_id(teacher)
    )
    cached_BUW = decode_topk(topk_of_batch(batch), builder.worker.width)
    live_BUW = _live_logits(builder.worker, batch)
    mask_BU = batch["teacher_token_mask"]
    torch.testing.assert_close(cached_BUW[mask_BU], live_BUW[mask_BU], rtol=1e-5, atol=1e-5)

    projection = setup.write_projection(tmp_path / "proj.safetensors")
    step = build_step(setup.trainer_config(projection, loss={"vocab_topk": None}))
    torch.manual_seed(0)
    T = batch["input_ids"].shape[1]
    student_BTV = torch.randn(len(keys), T, step.student.vocab)
    cached_loss, _ = step.loss_fn(student_BTV, cached_BUW, batch)
    live_loss, _ = step.loss_fn(student_BTV, live_BUW, batch)
    assert torch.isfinite(cached_loss)
    torch.testing.assert_close(cached_loss, live_loss, rtol=1e-5, atol=1e-6)


def test_a_sample_the_cache_lacks_is_refused_naming_its_key(built):
    tmp, _ = built
    with pytest.raises(KeyError, match=r"lacks sample 'elsewhere:7'"):
        _worker(str(tmp / "cache")).collate([("elsewhere:7", "some text")])


def test_with_online_a_sample_the_cache_lacks_is_put_marked_not_cached_with_zero_targets(built):
    tmp, builder = built
    keys = _keys(tmp, builder.config)[:2] + ["elsewhere:7"]
    texts = TEXTS[:2] + ["a text the cache never saw"]
    _, fields = _worker(str(tmp / "cache"), "online").collate(list(zip(keys, texts)))
    assert fields["teacher_topk_cached"].tolist() == [True, True, False]
    samples = columns_to_samples(fields)
    U = int(samples[2]["teacher_input_lengths"])
    assert samples[2]["teacher_topk_ids"].shape == (U, K)
    assert not samples[2]["teacher_topk_ids"].any() and not samples[2]["teacher_topk_lse"].any()
    assert samples[0]["teacher_topk_lse"].any()  # the cached ones carry their targets


def test_a_sample_of_other_teacher_tokens_than_the_cached_ones_is_refused(built):
    tmp, builder = built
    key = _keys(tmp, builder.config)[0]
    with pytest.raises(ValueError, match=rf"sample {key!r}: the teacher cache .* differing"):
        _worker(str(tmp / "cache")).collate([(key, "another text than the one cached")])
