"""Settings of a collator and of its workers (the `xtoken collator` flags come from here; a run
config's ``collator`` section is :class:`CollatorConfig`, its ``data`` section a
:class:`CorpusConfig`).

No heavy imports: the CLI builds its parser from these dataclasses (``services.common.config``),
so each default is written once, here. The corpus and worker settings are flattened into the
collator's flags (``--data``, ``--limit``, ``--queue``, ``--ctx-student``...) and nested in its
config file (``data``, ``worker``); the queue, partition, tokenizers, context lengths and
packing come from a run's shared context (``--context FILE``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from services.common.context import shared_field


@dataclass(frozen=True)
class WorkerConfig:
    """What one worker process needs to build its collator and reach the queue (the fields a
    run shares with its other processes come from its context).

    Raises:
        ValueError: a context length < 1 or a non-positive timeout.
    """

    queue: str | None = shared_field(
        "queue",
        default=None,
        help="queue endpoint, e.g. tcp://host:5555",
        required=True,
        trained=False,
    )
    student: str | None = shared_field("student_tokenizer", default=None, required=True)
    teacher: str | None = shared_field("teacher_tokenizer", default=None, required=True)
    extra_teachers: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "tokenizer names or paths of the run's further teachers (teacher 1, 2, ...): "
            "each sample also carries their tokens and alignment, as teacher<i>_ fields; a text "
            "is tokenized once per distinct tokenizer",
            "path": "tokenizer",
            "derived": "the tokenizer of each entry of extra_teachers",
            "trained": True,
        },
    )
    teacher_cache: tuple[str | None, ...] = field(
        default=(),
        metadata={
            "help": "one teacher cache folder (xtoken cache build) per teacher (teacher, then "
            "extra_teachers), none for a live one: each sample also carries that teacher's "
            "cached top-K targets, as teacher_topk_ / teacher<i>_topk_ fields (default: none)",
            "path": "file",
            "derived": "data.teacher_cache, one entry per teacher",
            "trained": True,
        },
    )
    teacher_cache_missing: Literal["error", "online"] = field(
        default="error",
        metadata={
            "help": "a sample a teacher cache lacks: error (the worker stops, naming its key); "
            "online (it carries zero targets, marked teacher_topk_cached false: the trainer "
            "asks that teacher's live groups for it)",
            "derived": "data.teacher_cache_missing",
            "trained": True,
        },
    )
    partition: str = shared_field("partition", help="queue partition")
    ctx_student: int = shared_field("ctx_student", default=2048)
    ctx_teacher: int = shared_field("ctx_teacher", default=2048)
    queue_timeout_s: float = field(
        default=10.0,
        metadata={"help": "seconds to wait for a reply from the queue", "trained": False},
    )
    put_timeout_s: float = field(
        default=300.0,
        metadata={"help": "seconds a put may wait for queue capacity", "trained": False},
    )
    pack: bool = shared_field(
        "pack",
        help="pack the texts of each put (--batch) into rows of the context lengths: several "
        "whole documents per sample, positions restarting per document (a row's key joins its "
        "documents' keys with |); the trainers and teachers must pack too (xtoken run: pack)",
    )
    kd_where_agrees: str | None = shared_field(
        "kd_where_agrees",
        help="a third tokenizer name or path: KD terms only on chunks whose student tokens are "
        "each also one token of it, covering the same bytes (None: every chunk)",
    )

    def __post_init__(self) -> None:
        if any(not isinstance(t, str) or not t for t in self.extra_teachers):
            raise ValueError(
                f"extra_teachers={list(self.extra_teachers)}: give each further teacher's "
                "tokenizer name or path (--extra-teachers)"
            )
        for name in ("ctx_student", "ctx_teacher"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"{name}={getattr(self, name)}: must be >= 1 (--{name.replace('_', '-')})"
                )
        teachers = 1 + len(self.extra_teachers)
        if self.teacher_cache and len(self.teacher_cache) != teachers:
            raise ValueError(
                f"teacher_cache names {len(self.teacher_cache)} folder(s) for {teachers} "
                "teacher(s): give one per teacher, none for a live one (--teacher-cache)"
            )
        if self.teacher_cache_missing not in ("error", "online"):
            raise ValueError(
                f"teacher_cache_missing={self.teacher_cache_missing!r}: use error or online "
                "(--teacher-cache-missing)"
            )
        if any(self.teacher_cache) and self.pack:
            raise ValueError(
                "teacher_cache with pack: a cache holds the targets of each text, and packed "
                "rows join texts; pass --no-pack"
            )
        for name in ("queue_timeout_s", "put_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"{name}={getattr(self, name)}: must be > 0 seconds "
                    f"(--{name.replace('_', '-')})"
                )


@dataclass
class CorpusConfig:
    """The training corpus and how it is read: which texts, cut how, in what order."""

    # the flag keeps the collator's --data; a run config's key is data.train
    train: str | None = field(
        default=None,
        metadata={
            "flag": "data",
            "help": "corpus: a .jsonl, .txt or .parquet file, a folder of them (read sorted, "
            "recursively) or a quoted glob ('data/*.jsonl'); each file keeps its own keys "
            "(xtoken run: None reads the demo corpus)",
            "path": "file",
            "required": True,
            "trained": True,
        },
    )
    limit: int | None = field(
        default=None, metadata={"help": "use only the first N texts", "trained": True}
    )
    text_field: str = field(
        default="text",
        metadata={
            "help": "JSON field / parquet or Hugging Face dataset column holding the text",
            "trained": True,
        },
    )
    txt_split: Literal["blank_line", "line"] = field(
        default="blank_line",
        metadata={
            "help": "how a .txt file is cut into texts: blank_line (a text is a run of non-blank "
            "lines; blank lines separate texts) or line (every non-blank line is a text)",
            "trained": True,
        },
    )
    skip_bad_lines: bool = field(
        default=False,
        metadata={
            "help": "skip lines without usable text (invalid JSON or UTF-8, no text field), log "
            "and count them; default: the first one fails the run naming file and line",
            "trained": True,
        },
    )
    seed: int | None = field(
        default=None,
        metadata={
            "flag": "shuffle-seed",
            "help": "put the texts (the first limit) in an order shuffled with this seed; they "
            "are read into memory first; default: corpus order",
            "trained": True,
        },
    )

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit={self.limit}: must be >= 1, or null for the whole corpus")


@dataclass
class CollatorConfig:
    """One collator: N worker processes that collate a corpus into the queue.

    Raises:
        ValueError: ``workers`` or ``batch`` below 1, ``log_every_s`` <= 0, a queue address that
            is no ``tcp://``/``ipc://`` endpoint, or a corpus outside ``key_root``.
    """

    # flag "": the corpus's and the worker's flags carry no prefix (--data, --queue, ...)
    data: CorpusConfig = field(
        default_factory=CorpusConfig, metadata={"flag": "", "derived": "data"}
    )
    worker: WorkerConfig = field(default_factory=WorkerConfig, metadata={"flag": ""})
    workers: int = field(default=1, metadata={"help": "worker processes", "trained": False})
    batch: int = field(
        default=64,
        metadata={
            "help": "texts per put (with pack: the texts packed together; hundreds)",
            "trained": True,
        },
    )
    log_every_s: float = field(
        default=10.0, metadata={"help": "seconds between progress lines", "trained": False}
    )
    skip_queued: bool = field(
        default=True,
        metadata={
            "help": "ask the queue which keys it holds and skip them (--no-skip-queued re-puts "
            "everything; puts stay idempotent)",
            "trained": False,
        },
    )
    key_root: str | None = field(
        default=None,
        metadata={
            "path": "dir",
            "help": "key samples by the corpus path relative to DIR (a/data.jsonl:<line>): the "
            "same keys wherever the corpus is mounted; default: <12 hex of the file's absolute "
            "path>/<name>:<line>, stable while the file stays where it is",
            "trained": False,
        },
    )

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers={self.workers}: must be >= 1 (--workers)")
        if self.batch < 1:
            raise ValueError(f"batch={self.batch}: must be >= 1 (--batch)")
        if self.batch > 1 << 20:
            raise ValueError(f"batch={self.batch}: at most {1 << 20} texts per put")
        if self.log_every_s <= 0:
            raise ValueError(f"log_every_s={self.log_every_s}: must be > 0 (--log-every-s)")
        if self.worker.queue is not None:
            from services.common.endpoint import check_endpoint

            check_endpoint(self.worker.queue, "--queue")
        corpus = self.data.train
        if self.key_root is not None and corpus is not None:
            from xtoken_core.data.corpus import corpus_files, corpus_key_prefix

            try:
                files = corpus_files(corpus)
            except (OSError, ValueError):
                files = [corpus]  # the run names what is missing
            try:
                for path in files:
                    corpus_key_prefix(path, self.key_root)
            except ValueError:
                raise ValueError(
                    f"--data {corpus} is not under --key-root {self.key_root}: pass a "
                    "--key-root folder that holds the corpus file"
                ) from None
