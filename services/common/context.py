"""The run-wide values every process of a run shares: one small section (``--context FILE``).

``xtoken run`` writes it once per launch (``RUN_DIR/config/context.json``) beside each process's
own section; a config field marked ``metadata={"context": KEY}`` takes the context's ``KEY``
unless the process's config file or a flag sets it (:func:`services.common.config.from_args`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import field

__all__ = ["CONTEXT_FILE", "Context"]

CONTEXT_FILE = "context.json"
"""The context's file name in a run's section folder (``RUN_DIR/config/``)."""


@dataclasses.dataclass(frozen=True)
class Context:
    """What the processes of one run must agree on (each process checks the values it uses)."""

    queue: str = field(metadata={"help": "the queue's address (the queue binds it)"})
    partition: str = field(metadata={"help": "the samples' partition"})
    student_tokenizer: str = field(metadata={"help": "student tokenizer name or path"})
    teacher_tokenizer: str = field(metadata={"help": "teacher tokenizer name or path"})
    run_dir: str = field(metadata={"help": "the run directory (metrics, checkpoints, export)"})
