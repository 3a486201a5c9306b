"""Rollout worker logic without processes or sockets: the trainer's published weights, batched
sampling, samples made as a collator makes them, their on-policy fields."""

from __future__ import annotations

import json

import pytest
import torch

from services.protocol.rollout import ROLLOUT_FIELDS
from services.rollout.config import RolloutConfig
from services.rollout.prompts import Prompt, PromptSource
from services.rollout.worker import (
    RolloutWorker,
    continuation_bounds,
    samples_to_fields,
    stopping_criteria,
    use_expandable_segments,
)
from tests.extras import require_tokenizers
from xtoken_core.data import sample as schema
from xtoken_core.data_plane.codec import columns_to_samples
from xtoken_core.errors import DataError, SettingsError
from xtoken_core.ipc.policy_weights import WeightPublisher
from xtoken_core.models import load_model
from xtoken_core.tokenizers import load_tokenizer

STUDENT, TEACHER = "mistral", "smollm2"
TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "",
    "Ünïcödé text \U0001f600 with an emoji",
    "x = [i * i for i in range(10)]",
]


def config(tmp_path, **overrides) -> RolloutConfig:
    values = dict(
        student="tiny",
        student_tokenizer=STUDENT,
        teacher_tokenizer=TEACHER,
        ctx_student=48,
        ctx_teacher=64,
        weights=str(tmp_path / "policy"),
        prompt_tokens=8,
        max_new_tokens=12,
        batch=3,
    )
    return RolloutConfig(**{**values, **overrides})


@pytest.fixture(scope="module")
def trained():
    """The trainer's student (another seed than the rollout's own init)."""
    require_tokenizers(STUDENT)
    vocab = load_tokenizer(STUDENT).vocab_size
    return load_model("tiny", vocab_size=vocab, seed=7)


@pytest.fixture
def published(tmp_path, trained):
    with WeightPublisher(tmp_path / "policy", trained.named_parameters(), transport="shm") as pub:
        pub.publish(trained.named_parameters(), version=5)
        yield pub


def prompts_of(worker: RolloutWorker, texts: list[str]) -> list[Prompt]:
    out = []
    for i, text in enumerate(texts):
        ids = worker.tokenizer.encode(text).ids[: worker.config.prompt_tokens].tolist()
        out.append(Prompt(f"p0:t:{i}", (0, i), ids))
    return out


def test_no_batch_is_sampled_before_the_trainer_published_weights(tmp_path):
    worker = RolloutWorker(config(tmp_path))
    assert worker.refresh() is None and worker.version is None
    with pytest.raises(ValueError, match="no trainer weights loaded yet"):
        worker.rollout(prompts_of(worker, TEXTS[:1]))


def test_the_rollout_samples_with_the_trainers_weights(tmp_path, trained, published):
    worker = RolloutWorker(config(tmp_path))
    assert worker.refresh() == 5 and worker.version == 5
    for name, p in worker.model.named_parameters():
        assert torch.equal(p, dict(trained.named_parameters())[name]), name
    assert worker.refresh() is None  # nothing newer


def test_a_batch_becomes_collated_samples_with_their_on_policy_fields(tmp_path, published):
    worker = RolloutWorker(config(tmp_path))
    worker.refresh()
    prompts = prompts_of(worker, [t for t in TEXTS if t][:3])
    keys, fields, counts = worker.rollout(prompts)
    assert keys == [p.key for p in prompts]
    assert set(fields) == set(schema.FIELD_NAMES) | set(ROLLOUT_FIELDS)
    samples = columns_to_samples(fields)
    assert counts["samples"] == len(samples) == 3 and counts["version"] == 5
    assert 0 < counts["generated_tokens"] <= 3 * 12
    rows = worker.sample([p.ids for p in prompts], seed=worker._seed(prompts[0]))
    remade = worker.collator.collate_sampled(rows)  # the same seed samples the same tokens
    for prompt, sample, again in zip(prompts, samples, remade):
        schema.validate_sample(sample)
        for name in schema.FIELD_NAMES:
            assert torch.equal(sample[name], again[name]), name
        ids = sample["input_ids"].tolist()
        n = int(sample["prompt_lengths"])
        assert ids[:n] == prompt.ids[:n] and int(sample["policy_version"]) == 5
        assert worker.eos_id not in ids[n:]  # the continuation ends before an EOS
        assert 1 <= int(sample["teacher_prompt_lengths"]) <= int(sample["teacher_input_lengths"])


def test_sampling_at_temperature_zero_is_greedy_and_batched_rows_do_not_mix(tmp_path, published):
    worker = RolloutWorker(config(tmp_path, temperature=0.0))
    worker.refresh()
    prompts = prompts_of(worker, [t for t in TEXTS if t])
    together = worker.sample([p.ids for p in prompts], seed=1)
    alone = [worker.sample([p.ids], seed=2)[0] for p in prompts]
    assert together == alone  # left padding: each row continues its own prompt


def test_a_static_kv_cache_samples_the_same_greedy_continuations(tmp_path, published):
    rows = {}
    for kind in ("dynamic", "static"):
        worker = RolloutWorker(config(tmp_path, temperature=0.0, kv_cache=kind))
        worker.refresh()
        prompts = prompts_of(worker, [t for t in TEXTS if t])
        rows[kind] = worker.sample([p.ids for p in prompts], seed=1)
    assert rows["static"] == rows["dynamic"]


def test_a_static_kv_cache_samples_every_batch_in_one_shape_and_returns_only_the_given_rows(
    tmp_path, published
):
    worker = RolloutWorker(config(tmp_path, temperature=0.0, kv_cache="static"))
    worker.refresh()
    shapes, generate = [], worker.model.generate

    def recording(**kw):  # the real generate; its input shape is what a compiled step sees
        shapes.append(tuple(kw["input_ids"].shape))
        return generate(**kw)

    worker.model.generate = recording
    prompts = prompts_of(worker, [t for t in TEXTS if t])
    short = [p.ids[:3] for p in prompts[:2]]  # fewer prompts than a batch, shorter than 8
    rows = worker.sample(short, seed=1)
    full = worker.sample([p.ids for p in prompts[:3]], seed=1)
    assert shapes == [(3, 8), (3, 8)]  # batch 3 x prompt_tokens 8 both times
    assert len(rows) == 2 and [r[:3] for r in rows] == short
    dynamic = RolloutWorker(config(tmp_path, temperature=0.0))
    dynamic.refresh()
    assert rows == dynamic.sample(short, seed=1)  # the filling changes no given row
    assert full == dynamic.sample([p.ids for p in prompts[:3]], seed=1)


def test_an_unknown_kv_cache_is_refused_naming_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"kv_cache='paged': use one of dynamic, static"):
        config(tmp_path, kv_cache="paged")


def test_ids_past_the_tokenizer_in_a_wider_output_layer_are_never_sampled(tmp_path):
    vocab = load_tokenizer(STUDENT).vocab_size
    wide = load_model("tiny", vocab_size=vocab + 64, seed=7)
    with torch.no_grad():  # the 64 ids the tokenizer lacks get by far the largest logits
        wide.lm_head.weight[vocab:] = 50.0 * wide.lm_head.weight[:64].sign()
        wide.model.norm.weight.fill_(1.0)
    worker = RolloutWorker(config(tmp_path, temperature=1.0), model=wide)
    assert worker.beyond_vocab == list(range(vocab, vocab + 64))
    prompts = [p.ids for p in prompts_of(worker, [t for t in TEXTS if t])]
    rows = worker.sample(prompts, seed=3)
    new = [i for r, p in zip(rows, prompts, strict=True) for i in r[len(p) :]]
    assert new and max(new) < vocab


@pytest.mark.parametrize("stopping", [True, False])
def test_the_stop_flags_lie_on_the_device_generate_runs_on(stopping):
    # generate ORs the criteria's flags with its own, made on the input_ids' device; "meta"
    # stands in for a GPU: a flag on the CPU raises here as it does on one
    input_ids = torch.zeros((3, 5), dtype=torch.int64, device="meta")
    done = stopping_criteria(lambda: stopping)(input_ids, None)
    assert done.device == input_ids.device and done.shape == (3,)


def test_a_stop_ends_the_generation_after_one_token(tmp_path, published):
    worker = RolloutWorker(config(tmp_path, temperature=0.0))
    worker.refresh()
    prompts = [p.ids for p in prompts_of(worker, [t for t in TEXTS if t])]
    rows = worker.sample(prompts, seed=1, stop=lambda: True)
    assert all(len(r) - len(p) <= 1 for r, p in zip(rows, prompts, strict=True))
    assert [r[: len(p)] for r, p in zip(rows, prompts, strict=True)] == prompts


def test_the_continuations_teacher_tokens_start_after_the_prompts_bytes():
    student, teacher = load_tokenizer(STUDENT), load_tokenizer(TEACHER)
    text = "hello world, how are you"
    s, t = student.encode(text), teacher.encode(text)
    prompt = student.encode("hello world").ids.shape[0]
    first, scored = continuation_bounds(s, t, prompt)
    prompt_end = int(s.spans[prompt - 1, 1])
    assert int(t.spans[first - 1, 1]) <= prompt_end < int(t.spans[first, 1])
    assert scored == len(text.encode()) - int(t.spans[first, 0])


def test_prompts_are_shared_by_the_workers_and_resume_after_a_position(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    tok = load_tokenizer(STUDENT)

    def take(n, **kw):
        source = PromptSource(str(corpus), tok, 4, **kw)
        return [p for p, _ in zip(source, range(n))]

    alone = take(8)
    # "" has no content token: it gives no prompt; after the last text a new pass begins
    assert [p.position for p in alone] == [(0, 0), (0, 1), (0, 3), (0, 4), (1, 0), (1, 1),
                                            (1, 3), (1, 4)]  # fmt: skip
    assert alone[0].key.startswith("p0:") and alone[4].key.startswith("p1:")
    assert alone[0].key[3:] == alone[4].key[3:]  # the same text in the next pass
    w0, w1 = take(4, worker=0, workers=2), take(4, worker=1, workers=2)
    assert {p.position for p in w0} | {p.position for p in w1} >= {p.position for p in alone[:4]}
    assert not {p.key for p in w0} & {p.key for p in w1}
    assert [p.position for p in take(2, start=(1, 1))] == [(1, 1), (1, 3)]
    assert all(len(p.ids) <= 4 for p in alone)


def test_a_corpus_that_gives_a_worker_no_prompt_is_a_data_error_naming_it(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": TEXTS[1]}) + "\n")
    source = PromptSource(str(corpus), load_tokenizer(STUDENT), 4, worker=1, workers=2)
    with pytest.raises(DataError, match=f"the prompt corpus {corpus} gives rollout worker 1"):
        next(iter(source))


def test_weights_of_another_student_are_a_settings_error(tmp_path, published):
    other = load_model("tiny", vocab_size=load_tokenizer(STUDENT).vocab_size + 8, seed=7)
    worker = RolloutWorker(config(tmp_path), model=other)
    with pytest.raises(SettingsError, match="the rollout's student is not the trainer's"):
        worker.refresh()


def test_a_damaged_descriptor_is_no_weights_yet_and_the_next_publication_is_taken(
    tmp_path, trained, published
):
    (tmp_path / "policy" / "descriptor.msgpack").write_bytes(b"\x82\xa2\xb6\xb6\x01")
    worker = RolloutWorker(config(tmp_path))
    assert worker.refresh() is None and worker.version is None  # waits, as before a publication
    published.publish(trained.named_parameters(), version=6)
    assert worker.refresh() == 6 and worker.version == 6


def test_samples_pack_into_one_put_with_the_on_policy_fields(tmp_path, published):
    worker = RolloutWorker(config(tmp_path))
    worker.refresh()
    samples = worker.make_samples([[1, 100, 200], [1, 300]], [2, 1], version=9)
    fields = samples_to_fields(samples)
    assert list(fields) == [*schema.FIELD_NAMES, *ROLLOUT_FIELDS]
    assert fields["policy_version"].tolist() == [9, 9]
    assert fields["prompt_lengths"].tolist() == [2, 1]
    for sample, row in zip(samples, columns_to_samples(fields), strict=True):
        schema.validate_sample(row)
        for name in fields:
            assert torch.equal(row[name], sample[name]) and row[name].dtype == sample[name].dtype


def test_a_sample_without_an_on_policy_field_is_refused_naming_it(tmp_path, published):
    worker = RolloutWorker(config(tmp_path))
    worker.refresh()
    (sample,) = worker.make_samples([[1, 100, 200]], [2], version=9)
    del sample["scored_bytes"]
    with pytest.raises(ValueError, match="an on-policy sample misses field 'scored_bytes'"):
        samples_to_fields([sample])


def test_the_users_allocator_settings_stand_and_otherwise_segments_expand(monkeypatch):
    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    assert not use_expandable_segments({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128"})
    assert not use_expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})
    assert calls == []
    assert use_expandable_segments({})
    assert calls == ["expandable_segments:True"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_rollout_batch_leaves_no_more_gpu_memory_reserved_than_its_peak(tmp_path, published):
    """The KV cache grows a token per step. With blocks of every size cached, a batch of 64 x 512
    tokens of the Qwen3-0.6B preset held 35.8 GiB for a 4.8 GiB peak on an H100; with expandable
    segments and the cache handed back after each batch it holds 1.2 GiB (the weights)."""
    require_tokenizers(STUDENT, TEACHER)
    worker = RolloutWorker(
        config(tmp_path, device="cuda", max_new_tokens=48, batch=16, ctx_student=64, ctx_teacher=96)
    )
    worker.refresh()
    torch.cuda.reset_peak_memory_stats()
    worker.sample([p.ids for p in prompts_of(worker, TEXTS * 4)[:16] if p.ids] or [[1]], seed=0)
    assert torch.cuda.memory_reserved() <= torch.cuda.max_memory_allocated()
