"""The run-wide values every process of a run shares: one small section (``--context FILE``).

:class:`Shared` holds the settings several processes read; a run config takes them as its
top-level keys (it derives from it), so each is written once, here. :class:`Context` is what
one launch of the run hands every process: those values as the launch settles them, and the
queue's address. ``xtoken run`` writes it once per launch (``RUN_DIR/config/context.json``)
beside each process's own section; a config field marked ``metadata={"context": KEY}`` takes
the context's ``KEY`` unless the process's config file or a flag sets it
(:func:`services.common.config.from_args`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

__all__ = ["CONTEXT_FILE", "Context", "Shared", "shared_field"]

CONTEXT_FILE = "context.json"
"""The context's file name in a run's section folder (``RUN_DIR/config/``)."""


@dataclasses.dataclass(kw_only=True)
class Shared:
    """The settings of a run that several of its processes read (the run config's top-level keys
    of these names; each process takes them through its fields marked ``context``)."""

    run_dir: str = field(
        default="runs/default",
        metadata={
            "help": "run directory: metrics, checkpoints, export (the demo has its own, runs/demo)",
            "path": "run",
            "trained": False,
        },
    )
    partition: str = field(
        default="train",
        metadata={
            "help": "queue partition of the samples (on an external queue prefixed with the run "
            "id)",
            "trained": False,
        },
    )
    student_tokenizer: str = field(
        default="qwen3",
        metadata={"help": "student tokenizer name or path", "path": "tokenizer", "trained": True},
    )
    teacher_tokenizer: str = field(
        default="smollm2",
        metadata={"help": "teacher tokenizer name or path", "path": "tokenizer", "trained": True},
    )
    ctx_student: int = field(
        default=512, metadata={"help": "student tokens per text", "trained": True}
    )
    ctx_teacher: int = field(
        default=512, metadata={"help": "teacher tokens per text", "trained": True}
    )
    pack: bool = field(
        default=False,
        metadata={
            "help": "pack whole documents into rows of ctx_student / ctx_teacher tokens instead "
            "of one text per sample: positions restart per document, attention, chunks and "
            "next-token targets stay within a document (docs/design.md, Packing); the "
            "collators pack, the trainers and teachers read packed rows",
            "trained": True,
        },
    )
    kd_where_agrees: str | None = field(
        default=None,
        metadata={
            "help": "a third tokenizer name or path: the KD loss only on chunks whose student "
            "tokens are each also one token of it, covering the same bytes (e.g. KD from a "
            "same-tokenizer parent where another teacher's tokenizer would also align 1:1); "
            "the collators' and the rollouts' samples alike. None: every chunk",
            "path": "tokenizer",
            "trained": True,
        },
    )


@dataclasses.dataclass(kw_only=True)
class Context(Shared):
    """What the processes of one launch must agree on (each process checks the values it uses):
    the run's shared settings as the launch settles them (the run directory absolute, the
    partition with the run id on an external queue) and the queue's address."""

    queue: str = field(metadata={"help": "the queue's address (the queue binds it)"})


def shared_field(key: str, **metadata: Any) -> Any:
    """A process's config field that takes the context's ``key``: the setting's default and
    marks (help, path, trained), with ``metadata`` over them (``default``, the process's own
    ``help``, ``required``...) and the ``context`` mark.

    Args:
        key: a field of :class:`Context`.
        metadata: field metadata; ``default`` is the field's default instead.
    """
    f = {f.name: f for f in dataclasses.fields(Context)}[key]
    default = metadata.pop("default", f.default)
    return field(default=default, metadata={**f.metadata, **metadata, "context": key})
