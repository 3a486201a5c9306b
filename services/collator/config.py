"""Settings of a collator run and of its workers (the `xtoken collator` flags come from here).

No heavy imports: the CLI builds its parser from these dataclasses (``services.common.config``),
so each default is written once, here. The worker settings are flattened into the run's flags
(``--queue``, ``--ctx-student``...) and into the run's config file as its ``worker`` section;
the queue, partition and tokenizers come from a run's shared context (``--context FILE``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class WorkerConfig:
    """What one worker process needs to build its collator and reach the queue.

    Args:
        queue: queue server endpoint, e.g. ``tcp://127.0.0.1:5555``.
        student: student tokenizer name or path (``load_tokenizer``).
        teacher: teacher tokenizer name or path.
        partition: partition the samples are put into.
        ctx_student: student context length (tokens kept per text), >= 1.
        ctx_teacher: teacher context length, >= 1.
        queue_timeout_s: seconds to wait for a reply from the queue (``--queue-timeout-s``).
        put_timeout_s: seconds the server may hold a put while the queue is full.
        pack: pack the texts of each put into rows of ``ctx_student`` / ``ctx_teacher`` tokens,
            several whole documents per sample (``xtoken_core.data.packing``); a row's key
            joins its documents' keys with ``|``.

    Raises:
        ValueError: a context length < 1 or a non-positive timeout.
    """

    queue: str = field(
        metadata={"help": "queue endpoint, e.g. tcp://host:5555", "context": "queue"}
    )
    student: str = field(
        metadata={
            "help": "student tokenizer name or path",
            "context": "student_tokenizer",
            "path": "tokenizer",
        }
    )
    teacher: str = field(
        metadata={
            "help": "teacher tokenizer name or path",
            "context": "teacher_tokenizer",
            "path": "tokenizer",
        }
    )
    partition: str = field(
        default="train", metadata={"help": "queue partition", "context": "partition"}
    )
    ctx_student: int = field(default=2048, metadata={"help": "student tokens kept per text"})
    ctx_teacher: int = field(default=2048, metadata={"help": "teacher tokens kept per text"})
    queue_timeout_s: float = field(
        default=10.0,
        metadata={
            "help": "seconds to wait for a reply from the queue",
            "deprecated_flags": ("queue-timeout",),
        },
    )
    put_timeout_s: float = field(
        default=300.0,
        metadata={
            "help": "seconds a put may wait for queue capacity",
            "deprecated_flags": ("put-timeout",),
        },
    )
    pack: bool = field(
        default=False,
        metadata={
            "help": "pack the texts of each put (--batch) into rows of the context lengths: "
            "several whole documents per sample, positions restarting per document; the "
            "trainers and teachers must pack too (xtoken run: collator.pack)"
        },
    )
    kd_where_agrees: str | None = field(
        default=None,
        metadata={
            "help": "a third tokenizer name or path: KD terms only on chunks whose student "
            "tokens are each also one token of it, covering the same bytes (None: every chunk)",
            "path": "tokenizer",
        },
    )

    def __post_init__(self) -> None:
        for name in ("ctx_student", "ctx_teacher"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"{name}={getattr(self, name)}: must be >= 1 (--{name.replace('_', '-')})"
                )
        for name, flag in (("queue_timeout_s", "queue-timeout"), ("put_timeout_s", "put-timeout")):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0 seconds (--{flag})")


@dataclass
class RunConfig:
    """One collator run.

    Args:
        data: corpus file (``.jsonl``, ``.txt`` or ``.parquet``), a folder of them or a glob
            (``xtoken_core.data.corpus.corpus_files``).
        worker: settings shared by every worker (queue address, partition, tokenizers).
        workers: number of worker processes, >= 1.
        batch: texts per put, >= 1.
        limit: use only the first ``limit`` texts of the file (None = all).
        text_field: JSON field / parquet column with the text.
        txt_split: ``.txt`` documents: ``"blank_line"`` or ``"line"``.
        log_every_s: seconds between progress log lines.
        skip_queued: ask the queue for the keys it holds and skip them.
        skip_bad_lines: skip, log and count bad corpus lines instead of failing on the first.
        key_root: key samples by the corpus file's path relative to this folder
            (``a/data.jsonl:<line>``); None: by a hash of its absolute path
            (``<12 hex>/data.jsonl:<line>``). See ``xtoken_core.data.corpus.corpus_key_prefix``.
        shuffle_seed: put the texts (the first ``limit``) in an order shuffled with this seed
            (``xtoken_core.data.corpus.shuffled_texts``; read into memory first); None: corpus
            order.

    Raises:
        ValueError: ``workers``, ``batch`` or ``limit`` below 1, ``log_every_s`` <= 0, a queue
            address that is no ``tcp://``/``ipc://`` endpoint, or a ``data`` file outside
            ``key_root``.
    """

    data: str = field(
        metadata={
            "path": "file",
            "help": "corpus: a .jsonl, .txt or .parquet file, a folder of them (read sorted, "
            "recursively) or a quoted glob ('data/*.jsonl'); each file keeps its own keys",
        }
    )
    # flag "": the worker's flags carry no "worker." prefix (--queue, --ctx-student, ...)
    worker: WorkerConfig = field(metadata={"flag": ""})
    workers: int = field(default=1, metadata={"help": "worker processes"})
    batch: int = field(default=64, metadata={"help": "texts per put"})
    limit: int | None = field(default=None, metadata={"help": "use only the first N texts"})
    text_field: str = field(
        default="text", metadata={"help": "JSON field / parquet column holding the text"}
    )
    txt_split: Literal["blank_line", "line"] = field(
        default="blank_line",
        metadata={"help": ".txt files: documents separated by blank lines, or one per line"},
    )
    log_every_s: float = field(
        default=10.0,
        metadata={"help": "seconds between progress lines", "deprecated_flags": ("log-every",)},
    )
    skip_queued: bool = field(
        default=True,
        metadata={
            "help": "ask the queue which keys it holds and skip them (--no-skip-queued re-puts "
            "everything; puts stay idempotent)"
        },
    )
    skip_bad_lines: bool = field(
        default=False,
        metadata={
            "help": "skip lines without usable text (invalid JSON or UTF-8, no text field), "
            "log and count them; default: the first one fails the run naming file and line"
        },
    )
    key_root: str | None = field(
        default=None,
        metadata={
            "path": "file",
            "help": "key samples by the corpus path relative to DIR (a/data.jsonl:<line>): the "
            "same keys wherever the corpus is mounted; default: <12 hex of the file's absolute "
            "path>/<name>:<line>, stable while the file stays where it is",
        },
    )

    shuffle_seed: int | None = field(
        default=None,
        metadata={
            "help": "put the texts (the first --limit) in an order shuffled with this seed; they "
            "are read into memory first; default: corpus order"
        },
    )

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers={self.workers}: must be >= 1 (--workers)")
        if self.batch < 1:
            raise ValueError(f"batch={self.batch}: must be >= 1 (--batch)")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit={self.limit}: must be >= 1, or omitted for the whole file")
        if self.log_every_s <= 0:
            raise ValueError(f"log_every_s={self.log_every_s}: must be > 0 (--log-every-s)")
        from services.common.endpoint import check_endpoint

        check_endpoint(self.worker.queue, "--queue")
        if self.key_root is not None:
            from xtoken_core.data.corpus import corpus_files, corpus_key_prefix

            try:
                files = corpus_files(self.data)
            except (OSError, ValueError):
                files = [self.data]  # the run names what is missing
            try:
                for path in files:
                    corpus_key_prefix(path, self.key_root)
            except ValueError:
                raise ValueError(
                    f"--data {self.data} is not under --key-root {self.key_root}: pass a "
                    "--key-root folder that holds the corpus file"
                ) from None
