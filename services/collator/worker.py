"""Collator worker: collate batches of (key, text) into jagged samples and put them on the queue.

Two layers, as for every service:

* ``CollatorWorker`` (logic, no process): owns the tokenizers and the collator (the student's,
  teacher 0's and any further teachers'), turns a batch of ``(key, text)`` pairs into one ``put``
  (keys + fields of every teacher, and the cached top-K targets of each teacher a teacher cache
  serves, looked up by the sample key; with ``teacher_cache_missing: online`` a sample the cache
  lacks is marked for the live teacher) and sends it through a queue client.
* ``worker_main`` (process shell): the loop of one ``multiprocessing`` worker: loads the
  tokenizers once, takes batches from a task queue, reports counts to a result queue, stops on a
  ``None`` task, on the shared stop event, on SIGTERM/SIGINT or when the collator parent dies
  (``services.common.lifecycle``), after its in-flight put: a put is one message, so a sample is
  either stored whole or not at all.

Shape legend: N samples in a put, R total rows of a jagged field (sum of the N lengths).
"""

from __future__ import annotations

import logging
import os
import queue as queue_mod
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from services.collator.config import WorkerConfig
from services.common.lifecycle import Lifecycle, configure_logging
from services.queue import errors as codes
from services.queue.errors import QueueError
from xtoken_core.data import sample as schema
from xtoken_core.wire import JaggedColumn

logger = logging.getLogger(__name__)

# How long a worker waits on the task queue before it looks at the stop flags again.
_TASK_POLL_S = 0.2


def samples_to_put_fields(
    samples: Sequence[Mapping[str, torch.Tensor]],
    num_teachers: int = 1,
    cached: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Pack N jagged samples (``collate_samples`` output) into the fields of one ``put``: each
    sample's schema fields, in schema order and dtype, packed by the data-plane codec
    (:func:`xtoken_core.data_plane.codec.samples_to_columns`, the one place samples become put
    columns; the rollout workers pack theirs there too).

    Per-sample (0-d) fields are stacked to ``[N]``; per-token and per-chunk fields always become a
    ``JaggedColumn`` (one values ``[R]`` + one offsets ``[N+1]`` buffer), even when every row
    happens to have the same length, so that a field's layout never changes between puts.

    Args:
        samples: N >= 1 dicts with the fields of
            ``xtoken_core.data.sample.sample_fields(num_teachers, packed)`` (packed rows judged by
            the first sample).
        num_teachers: the teachers the samples carry fields of (teacher 0's under the
            one-teacher names, teacher i's as ``teacher{i}_...``).
        cached: the teachers whose cached top-K targets the samples carry (None: those the
            first sample carries, ``xtoken_core.data.sample.cached_teachers_of``).

    Returns:
        field name -> ``[N]`` tensor or ``JaggedColumn`` of N rows.

    Raises:
        ValueError: no samples, or a sample misses a schema field.
    """
    from xtoken_core.data_plane.codec import samples_to_columns

    if not samples:
        raise ValueError("samples_to_put_fields needs at least one sample, got none")
    if cached is None:
        cached = schema.cached_teachers_of(samples[0])
    specs = schema.sample_fields(num_teachers, packed=schema.is_packed(samples[0]), cached=cached)
    try:
        rows = [{spec.name: s[spec.name].to(spec.dtype) for spec in specs} for s in samples]
    except KeyError as e:
        raise ValueError(
            f"a sample misses field {e.args[0]!r}; samples must come from "
            "CrossTokenizerCollator.collate_samples"
        ) from None
    return samples_to_columns(rows)


def put_nbytes(fields: Mapping[str, Any]) -> int:
    """Payload bytes of put fields (tensor data, offsets included).

    Args:
        fields: output of :func:`samples_to_put_fields`.

    Returns:
        Total bytes of the buffers that travel.
    """
    total = 0
    for value in fields.values():
        tensors = (value.values, value.offsets) if isinstance(value, JaggedColumn) else (value,)
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


class CollatorWorker:
    """Tokenizers + collator + a queue client: one batch of texts in, one put out.

    Args:
        config: the worker settings.
        client: a queue client with ``put(partition, keys, fields, timeout_s=)`` (a
            ``QueueClient`` by default, opened lazily).
        stop: an event (``is_set()``) given to the default client: once set, a put in flight
            raises ``QueueError("stopped")`` at once.

    Raises:
        ValueError: unknown tokenizer names (from ``load_tokenizer``).
    """

    def __init__(self, config: WorkerConfig, client: Any | None = None, stop: Any = None) -> None:
        from xtoken_core.align import TokenAligner
        from xtoken_core.data.collator import CrossTokenizerCollator
        from xtoken_core.tokenizers import load_tokenizer

        self.config = config
        # one tokenizer object per distinct name: teachers of one tokenizer share a tokenization
        loaded = {name: load_tokenizer(name) for name in (config.teacher, *config.extra_teachers)}
        self.collator = CrossTokenizerCollator(
            student_tokenizer=load_tokenizer(config.student),
            teacher_tokenizers=[loaded[t] for t in (config.teacher, *config.extra_teachers)],
            aligner=TokenAligner(),
            ctx_length_student=config.ctx_student,
            ctx_length_teacher=config.ctx_teacher,
            pack=config.pack,
            kd_where_agrees=(
                load_tokenizer(config.kd_where_agrees) if config.kd_where_agrees else None
            ),
        )
        # a reader per cached teacher (data.teacher_cache), None for a live one
        self.caches = [_open_cache(d) if d else None for d in config.teacher_cache]
        self._client = client
        self._stop = stop  # abandons a put in flight when set (SIGTERM, whatever the queue does)

    @property
    def client(self) -> Any:
        """The queue client (created on first use)."""
        if self._client is None:
            from services.queue.client import QueueClient

            self._client = QueueClient(
                self.config.queue,
                timeout_s=self.config.queue_timeout_s,
                retries=2,
                name=f"collator-{os.getpid()}",
                stop=self._stop,
            )
        return self._client

    def collate(self, items: Sequence[tuple[str, str]]) -> tuple[list[str], dict[str, Any]]:
        """Collate a batch without sending it.

        Args:
            items: N ``(key, text)`` pairs with unique keys.

        Returns:
            ``(keys, fields)`` ready for ``client.put``: one sample per text, or with ``pack``
            one per packed row, keyed by its documents' keys joined (``packing.row_key``).
        """
        texts = [t for _, t in items]
        n = self.collator.num_teachers
        if not self.collator.pack:
            keys = [k for k, _ in items]
            samples = self.collator.collate_samples(texts)
            cached = [j for j, reader in enumerate(self.caches) if reader is not None]
            if cached:
                from xtoken_core.cache.attach import attach_targets

                online = self.config.teacher_cache_missing == "online"
                for key, sample in zip(keys, samples, strict=True):
                    for j in cached:
                        attach_targets(sample, key, self.caches[j], j, online=online)
            return keys, samples_to_put_fields(samples, n, cached)
        from xtoken_core.data.packing import row_key

        rows = self.collator.pack_samples(texts)
        keys = [row_key([items[i][0] for i in indices]) for indices, _ in rows]
        return keys, samples_to_put_fields([row for _, row in rows], n)

    def process(self, items: Sequence[tuple[str, str]]) -> dict[str, int]:
        """Collate a batch and put it (one message; idempotent by key).

        Args:
            items: N ``(key, text)`` pairs with unique keys.

        Returns:
            ``{"samples": samples put (N, or the packed rows), "texts": N, "written": new
            samples, "consumed": samples the queue refused as already consumed (retention
            dropped them), "nbytes": payload bytes, "epoch": the queue instance that stored
            them}``.

        Raises:
            QueueError: the queue refused the put or did not answer (names the address).
        """
        from services.queue.errors import QueueError

        keys, fields = self.collate(items)
        try:
            reply = self.client.put(
                self.config.partition, keys, fields, timeout_s=self.config.put_timeout_s
            )
        except QueueError as e:
            if e.code != "timeout":
                raise
            # the client's message names its Python arguments; an operator sets flags
            raise QueueError(
                e.code,
                f"no reply to a put from {self.config.queue} within --queue-timeout-s "
                f"{self.config.queue_timeout_s:g}s + --put-timeout-s {self.config.put_timeout_s:g}s "
                "(3 attempts); is the queue up? raise --put-timeout-s if it is full and slow to "
                "drain",
                retryable=e.retryable,
                request_type=e.request_type,
            ) from None
        return {
            "samples": len(keys),
            "texts": len(items),
            "written": int(reply.get("new_samples", reply.get("written", len(keys)))),
            "consumed": int(reply.get("consumed", 0)),
            "nbytes": put_nbytes(fields),
            "epoch": reply.get("epoch"),
        }

    def close(self) -> None:
        """Close the queue client."""
        if self._client is not None and hasattr(self._client, "close"):
            self._client.close()


def _open_cache(directory: str) -> Any:
    """A reader of a teacher cache folder (``xtoken_core.cache.reader.CacheReader``)."""
    from xtoken_core.cache.reader import CacheReader

    return CacheReader(directory)


class _AnySet:
    """Set when any of the events is (the lifecycle's signal event, the run's stop event)."""

    def __init__(self, *events: Any) -> None:
        self.events = events

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)


def worker_main(
    index: int,
    config: WorkerConfig,
    tasks: Any,
    results: Any,
    stop: Any,
    log_level: int = logging.INFO,
) -> None:
    """Body of one worker process (a ``multiprocessing`` target).

    Args:
        index: worker number (for logs).
        config: the worker settings.
        tasks: multiprocessing queue of ``(seq, [(key, text), ...])`` batches; ``None`` = no
            more. ``seq`` comes back in the batch's ``done`` counts.
        results: multiprocessing queue receiving ``("ready", index, t)``, ``("done", index,
            counts, t)`` per batch (``t``: ``time.monotonic()``, one clock for all processes on
            Linux), ``("error", index, message)``, ``("exit", index)``.
        stop: multiprocessing Event; set = abandon queued batches and exit.
        log_level: logging level of this process.
    """
    configure_logging("collator", log_level)
    # SIGTERM/SIGINT or the parent's death: finish the in-flight batch, then exit
    lifecycle = Lifecycle(f"collator-w{index}", parent_pid=os.getppid()).install()
    torch.set_num_threads(1)  # N workers share the cores; one thread each
    worker = None
    try:
        started = time.monotonic()
        worker = CollatorWorker(config, stop=_AnySet(lifecycle.stop, stop))
        logger.debug("[collator] worker %d ready in %.1fs", index, time.monotonic() - started)
        results.put(("ready", index, time.monotonic()))
        while not (lifecycle.stop.is_set() or stop.is_set()):
            try:
                batch = tasks.get(timeout=_TASK_POLL_S)
            except queue_mod.Empty:
                continue
            if batch is None:
                break
            seq, items = batch
            counts = worker.process(items)
            counts["seq"] = seq
            results.put(("done", index, counts, time.monotonic()))
    except QueueError as e:
        if e.code != codes.STOPPED:  # a stop abandons the put in flight: not an error
            results.put(("error", index, f"{type(e).__name__}: {e}"))
    except Exception as e:  # reported to the parent, which stops the run
        results.put(("error", index, f"{type(e).__name__}: {e}"))
    finally:
        if worker is not None:
            worker.close()
        results.put(("exit", index))
        lifecycle.close()
