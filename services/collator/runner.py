"""Collator run: read a corpus, skip keys already queued, feed N worker processes, report progress.

The parent process reads the texts (``iter_texts``: keys ``"<file id>:<line>"``, the same on
every restart on the same file, distinct for files of one name in different folders; in corpus
order, or shuffled by ``data.seed``), asks the queue which keys it already holds (``list``)
and skips them, groups the rest into batches of ``batch`` texts and hands them to N
``worker_main`` processes through a bounded queue (one worker puts the batches in that order;
several put them in the order they finish). Workers
put their own samples (the tensors never pass through the parent). Restarting a run therefore
does no duplicate work, and a put that races with another collator is harmless (puts are
idempotent by key).

Queue restarts: the queue keeps samples in memory only, so a restarted queue (a new instance,
``epoch`` in every reply) lacks what this run put before. Each put reports the instance that
stored it and the parent asks the queue again at the end of a pass; when the instance changed
during the pass, it reads the corpus again and re-puts what the new instance lacks: texts
neither held by it (``list``) nor put on it by this run (workers report the instance that stored
each batch; the parent keeps the corpus positions stored on the current instance as runs). It
repeats until a pass ends on the instance it started on. Samples consumed before the restart
are put again (the old instance's consumption state is gone): across a restart, delivery is
at least once.

Stopping: at the end of the data every worker gets ``None`` and exits after its last put; when
the ``stop`` event is set (the process lifecycle's: SIGTERM/SIGINT, a dead parent) or on
``request_stop()``, the parent stops reading, workers finish their in-flight put and abandon
queued batches. Either way ``run()`` returns a summary; a bad input line or a worker error stops
the workers and raises.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue as queue_mod
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.collator.config import CollatorConfig, WorkerConfig
from services.collator.progress import Eta
from services.collator.worker import worker_main
from services.common import lifecycle
from services.queue.config import format_size
from xtoken_core.data.corpus import BadCorpusLine

__all__ = [
    "CollatorConfig",
    "CollatorRun",
    "QueueUnreachableError",
    "RunSummary",
    "WorkerConfig",
    "check_queue",
    "queue_state",
]

logger = logging.getLogger(__name__)

# Seconds between two waits on the task queue while it is full (the parent drains results then).
_SUBMIT_POLL_S = 0.1
# Seconds to wait for a worker to exit after it was told to stop, on top of the put timeout.
_EXIT_GRACE_S = 30.0
# Seconds a progress line waits for the queue's stats (its state: full, unreachable).
_PROBE_TIMEOUT_S = 1.0
# Bad lines logged one by one with --skip-bad-lines (the rest are only counted).
_BAD_LINES_LOGGED = 10


def _as_flags(err: Exception) -> str:
    """A corpus reader's message with the library's argument names as the collator's flags
    (an operator sets flags)."""
    return str(err).replace("pass text_field=", "pass --text-field")


class _Runs:
    """Membership of increasing positions in a set of [start, end) runs (one sweep)."""

    def __init__(self, runs: list[list[int]]) -> None:
        self._runs = sorted(runs)
        self._i = 0

    def holds(self, pos: int) -> bool:
        runs, i = self._runs, self._i
        while i < len(runs) and runs[i][1] <= pos:
            i += 1
        self._i = i
        return i < len(runs) and runs[i][0] <= pos


class QueueUnreachableError(ConnectionError):
    """The queue server did not answer the handshake; the message names address and timeout."""


@dataclass
class RunSummary:
    """What a run did.

    Attributes:
        read: texts read from the file (within ``limit``).
        skipped: texts skipped because the queue already held their key.
        samples: samples put by the workers (packed rows with ``pack``).
        texts: texts in the samples put (more than ``samples`` with ``pack``).
        written: samples that were new to the queue.
        consumed: samples the queue refused because they were already consumed by every
            registered task and dropped (retention): done, not an error. ``samples - written -
            consumed`` were already queued (duplicates).
        nbytes: payload bytes put.
        restarts: queue restarts (new instances) seen during the run.
        replayed: texts put again after a restart, because the new instance lacked them.
        elapsed_s: seconds from the first dispatched batch to the last result.
        stopped: True when the run was stopped before the end of the data.
        bad_lines: corpus lines skipped as bad (``--skip-bad-lines``).
        worker_ready_s: per worker, seconds from the start to its tokenizers being loaded.
        steady_samples_per_s: samples/s from the first worker being ready (tokenizers loaded) to
            the last finished batch: the collation rate without process start-up.
    """

    read: int = 0
    skipped: int = 0
    samples: int = 0
    texts: int = 0
    written: int = 0
    consumed: int = 0
    nbytes: int = 0
    restarts: int = 0
    replayed: int = 0
    elapsed_s: float = 0.0
    stopped: bool = False
    bad_lines: int = 0
    worker_ready_s: list[float] = field(default_factory=list)
    steady_samples_per_s: float = 0.0

    @property
    def samples_per_s(self) -> float:
        """Samples put per second of the run."""
        return self.samples / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def bytes_per_s(self) -> float:
        """Payload bytes put per second of the run."""
        return self.nbytes / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def line(self) -> str:
        """One human-readable line."""
        return (
            f"{self.samples} samples put"
            + (f" (packed rows of {self.texts} texts)" if self.texts != self.samples else "")
            + f" ({self.written} new, {self.skipped} skipped as already "
            f"queued, {self.consumed} already consumed, {self.read} read) in "
            f"{self.elapsed_s:.1f}s: {self.samples_per_s:.1f} samples/s, "
            f"{format_size(self.bytes_per_s)}/s"
            + (
                f"; the queue restarted {self.restarts} time(s): {self.replayed} texts put again"
                if self.restarts
                else ""
            )
            + (f"; {self.bad_lines} bad lines skipped" if self.bad_lines else "")
            + (" [stopped early]" if self.stopped else "")
        )


def check_queue(address: str, timeout_s: float, partition: str | None) -> set[str]:
    """Handshake with the queue and return the keys it already holds in ``partition``.

    Args:
        address: queue endpoint.
        timeout_s: seconds to wait for each reply (``--queue-timeout-s``).
        partition: partition whose keys to list, or None to only check the connection.

    Returns:
        The keys already stored in the partition (empty for None or a new partition).

    Raises:
        QueueUnreachableError: no reply within ``timeout_s`` (names the address and the setting).
        QueueError: any other error reply (e.g. a protocol version mismatch).
    """
    return queue_state(address, timeout_s, partition)[0]


def queue_state(
    address: str, timeout_s: float, partition: str | None, stop: Any = None
) -> tuple[set[str], Any]:
    """As :func:`check_queue`, with the queue instance (``epoch``) that answered.

    Args:
        stop: an event; once set, the request in flight is abandoned at once
            (``QueueError("stopped")``).

    Returns:
        ``(keys, epoch)``; ``epoch`` is None for a server that does not name its instance.
    """
    from services.queue.client import QueueClient
    from services.queue.errors import QueueError

    try:
        with QueueClient(
            address, timeout_s=timeout_s, retries=0, name="collator", stop=stop
        ) as client:
            epoch = client.hello().get("epoch")
            if partition is None:
                return set(), epoch
            return set(client.list(partition).get("keys", [])), epoch
    except QueueError as e:
        if e.code == "timeout":
            raise QueueUnreachableError(
                f"queue {address} is unreachable: no reply within {timeout_s:g}s "
                f"(--queue-timeout-s); start it with `xtoken queue serve --bind {address}` or "
                "check the address"
            ) from None
        raise


class CollatorRun:
    """The parent side of a run: reader, dispatcher, progress, worker lifecycle.

    Args:
        config: the run settings.
        stop: an event that stops the run when set (the process lifecycle's ``stop``); a new
            one by default (see ``request_stop``).
    """

    def __init__(self, config: CollatorConfig, stop: threading.Event | None = None) -> None:
        self.config = config
        self.summary = RunSummary()
        self.stop = stop if stop is not None else threading.Event()
        self._procs: list[Any] = []
        self._exited: set[int] = set()
        self._ready_at: dict[int, float] = {}
        self._error: str | None = None
        self._last_log = 0.0
        self._start = 0.0
        self._last_done = 0.0
        self._submitted = 0  # batches handed to the workers
        self._batches_done = 0  # batches the workers put
        self._epoch: Any = None  # the queue instance the run puts into now
        self._epochs: set[Any] = set()  # every instance seen
        self._runs: dict[int, list[list[int]]] = {}  # batch seq -> corpus positions, in flight
        self._stored: list[list[int]] = []  # position runs the current instance stored
        self._progress: Any = None  # CorpusProgress of the corpus files
        self._eta = Eta()  # from the first worker ready
        self._probe: Any = None  # a QueueClient asking the queue's state for progress lines

    def request_stop(self) -> None:
        """Stop reading; workers finish their in-flight put and exit (from any thread)."""
        self.stop.set()

    # ------------------------------------------------------------------------- run

    def run(self, on_ready: Callable[[], Any] | None = None) -> RunSummary:
        """Collate the corpus into the queue.

        Args:
            on_ready: called once the queue answered the handshake (the process lifecycle's
                ready announcement), before the first text is read.

        Returns:
            The run summary (``stopped`` True when ``request_stop`` ended it early).

        Raises:
            QueueUnreachableError: the queue did not answer.
            ValueError: a bad corpus line (names file and line); the workers are stopped first.
            RuntimeError: a worker failed (its error message) or died.
        """
        cfg = self.config
        listed = cfg.worker.partition if cfg.skip_queued else None
        queued, epoch = queue_state(cfg.worker.queue, cfg.worker.queue_timeout_s, listed)
        queued = self._text_keys(queued)
        self._epoch = epoch
        self._epochs = {epoch}
        texts = self._texts()
        if on_ready is not None:
            on_ready()
        if queued:
            logger.info(
                "[collator] %d keys already in partition %r: skipping them",
                len(queued),
                cfg.worker.partition,
            )
        ctx = multiprocessing.get_context("spawn")  # never fork a process that holds zmq state
        self._ctx = ctx
        self._tasks = ctx.Queue(maxsize=2 * cfg.workers)
        self._results = ctx.Queue()
        self._stop_event = ctx.Event()
        self._start = self._last_log = time.monotonic()
        try:
            finished = self._passes(texts, queued, listed)
            self.summary.stopped = not finished
            self._shutdown(graceful=finished)
        except BadCorpusLine as e:
            self._shutdown(graceful=False)
            raise BadCorpusLine(
                f"{_as_flags(e)}; or pass --skip-bad-lines to skip and count such lines",
                e.path,
                e.line,
            ) from None
        except ValueError as e:
            self._shutdown(graceful=False)
            if "text_field=" not in str(e):
                raise
            raise ValueError(_as_flags(e)) from None
        except BaseException:
            self._shutdown(graceful=False)
            raise
        self.summary.elapsed_s = time.monotonic() - self._start
        self.summary.worker_ready_s = [
            self._ready_at[i] - self._start for i in sorted(self._ready_at)
        ]
        if self._error is not None:
            raise RuntimeError(f"collator worker failed: {self._error}")
        logger.info("[collator] done: %s", self.summary.line())
        return self.summary

    # ------------------------------------------------------------------------- internals

    def _texts(self, replay: bool = False) -> Any:
        """The corpus texts (``iter_corpus`` file by file, so that progress knows the file)."""
        from services.collator.progress import CorpusProgress
        from xtoken_core.data.corpus import corpus_files, iter_texts, shuffled_texts

        cfg = self.config
        on_bad = None
        if cfg.data.skip_bad_lines:
            on_bad = self._skip_bad_replayed if replay else self._skip_bad
        files = corpus_files(cfg.data.train)  # a missing input fails here, before the first batch
        if self._progress is None:
            self._progress = CorpusProgress(files)
        progress = self._progress

        def texts() -> Any:
            for i, path in enumerate(files):
                for key, text in iter_texts(
                    path,
                    text_field=cfg.data.text_field,
                    txt_split=cfg.data.txt_split,
                    key_root=cfg.key_root,
                    on_bad=on_bad,
                ):
                    progress.seen(i, key)
                    yield key, text

        if cfg.data.seed is None:
            return texts()
        # the same order on every pass (a replay after a queue restart reads it again)
        return iter(shuffled_texts(texts(), cfg.data.seed, cfg.data.limit))

    def _skip_bad(self, err: Exception) -> None:
        """--skip-bad-lines: count a bad line, log the first ``_BAD_LINES_LOGGED``."""
        self.summary.bad_lines += 1
        if self.summary.bad_lines <= _BAD_LINES_LOGGED:
            logger.warning("[collator] skipped a bad line: %s", err)
        elif self.summary.bad_lines == _BAD_LINES_LOGGED + 1:
            logger.warning("[collator] more bad lines: counted, not logged (see the summary)")

    def _skip_bad_replayed(self, err: Exception) -> None:
        """A replay pass meets the bad lines of the first again: counted once already."""

    def _passes(self, texts: Any, queued: set[str], listed: str | None) -> bool:
        """A pass over the corpus, and one more each time the queue restarted during the last
        (the new instance lacks what was put before); then tell the workers to exit.

        Returns:
            True when the data ended on the instance the last pass started on, False when
            stopped (or a worker failed).
        """
        cfg = self.config
        replay = False
        while True:
            started_on = self._epoch
            if not self._dispatch(texts, queued, replay) or not self._wait_batches():
                return False
            queued, epoch = self._queue_state_retrying(listed)
            if self._should_stop():
                return False
            self._see_epoch(epoch)
            if self._epoch == started_on:
                break
            logger.warning(
                "[collator] the queue restarted during this pass (instance %s -> %s) and lost "
                "what it held: reading %s again to put what it lacks (%d keys it holds skipped)",
                started_on,
                self._epoch,
                cfg.data.train,
                len(queued),
            )
            texts, replay = self._texts(replay=True), True
        for _ in self._procs:
            if not self._submit(None):
                return False
        return True

    def _queue_state_retrying(self, listed: str | None) -> tuple[set[str], Any]:
        """``queue_state`` at the end of a pass, waiting out a queue that is restarting."""
        from services.queue.errors import QueueError

        cfg = self.config
        for attempt in range(3):
            try:
                queued, epoch = queue_state(
                    cfg.worker.queue, cfg.worker.queue_timeout_s, listed, self.stop
                )
                return self._text_keys(queued), epoch
            except QueueError as e:
                if e.code != "stopped":
                    raise
                return set(), self._epoch  # SIGTERM: the caller sees the stop
            except QueueUnreachableError:
                if attempt == 2 or self._should_stop():
                    raise
                logger.warning("[collator] queue unreachable at the end of a pass: asking again")
        raise AssertionError("unreachable")

    def _text_keys(self, queued: set[str]) -> set[str]:
        """The keys of the texts the queue holds: with ``pack`` a sample's key joins those of
        the texts of its row."""
        if not self.config.worker.pack:
            return queued
        from xtoken_core.data.packing import document_keys

        return {k for key in queued for k in document_keys(key)}

    def _see_epoch(self, epoch: Any) -> None:
        """Note the queue instance of a reply; a new one means the queue restarted."""
        if epoch is None or epoch in self._epochs:
            return  # known (a late report from an instance seen before)
        self._epochs.add(epoch)
        self._stored = []  # what the earlier instances stored is gone
        self.summary.restarts += 1
        logger.warning(
            "[collator] the queue restarted (new instance %s): the end of this pass puts again "
            "what it lacks (nothing, if it is durable: --data-dir keeps its samples)",
            epoch,
        )
        self._epoch = epoch

    def _wait_batches(self) -> bool:
        """Wait until every submitted batch is put; False when stopped or a worker failed."""
        while self._batches_done < self._submitted:
            if self._should_stop():
                return False
            self._drain(wait_s=0.2)
        return not self._should_stop()

    def _dispatch(self, texts: Any, queued: set[str], replay: bool = False) -> bool:
        """Read, skip, batch and submit; True when the data ended, False when stopped.

        A replay pass (after a queue restart) counts the texts it puts in ``replayed`` and
        nothing else."""
        cfg = self.config
        batch: list[tuple[str, str]] = []
        runs: list[list[int]] = []  # corpus positions of the batch, as [start, end) runs
        stored = _Runs(self._stored if replay else [])
        for pos, (key, text) in enumerate(texts):
            if self._should_stop():
                return False
            if not replay:
                self.summary.read += 1
            if key in queued:
                if not replay:
                    self.summary.skipped += 1
            elif not (replay and stored.holds(pos)):  # not yet put on the current instance
                if replay:
                    self.summary.replayed += 1
                batch.append((key, text))
                if runs and runs[-1][1] == pos:
                    runs[-1][1] = pos + 1
                else:
                    runs.append([pos, pos + 1])
                if len(batch) >= cfg.batch:
                    if not self._submit(batch, runs):
                        return False
                    batch, runs = [], []
            if cfg.data.limit is not None and pos + 1 >= cfg.data.limit:
                break
        return not batch or self._submit(batch, runs)

    def _start_workers(self) -> None:
        """Start the worker processes (on the first batch: a run with nothing to do starts none)."""
        cfg = self.config
        level = logging.getLogger().getEffectiveLevel()
        for i in range(cfg.workers):
            p = self._ctx.Process(
                target=worker_main,
                args=(i, cfg.worker, self._tasks, self._results, self._stop_event, level),
                name=f"xtoken-collator-{i}",
                daemon=True,
            )
            p.start()
            self._procs.append(p)
        logger.info(
            "[collator] %d worker(s) collating %s into %s partition %r (%s -> %s)",
            cfg.workers,
            cfg.data.train,
            cfg.worker.queue,
            cfg.worker.partition,
            cfg.worker.student,
            ", ".join(map(str, (cfg.worker.teacher, *cfg.worker.extra_teachers))),
        )

    def _should_stop(self) -> bool:
        return self.stop.is_set() or self._error is not None

    def _submit(self, batch: list[tuple[str, str]] | None, runs: Any = None) -> bool:
        """Put one task, draining results while the task queue is full; False if stopped.

        ``runs``: the corpus positions of the batch, remembered until its put is reported
        with the queue instance that stored it."""
        if not self._procs:
            if batch is None:
                return True  # no worker was started: nobody to tell
            self._start_workers()
        while True:
            self._drain(wait_s=0.0)
            if self._should_stop():
                return False
            try:
                if batch is None:
                    self._tasks.put(None, timeout=_SUBMIT_POLL_S)
                    return True
                self._tasks.put((self._submitted, batch), timeout=_SUBMIT_POLL_S)
                self._runs[self._submitted] = runs or []
                self._submitted += 1
                return True
            except queue_mod.Full:
                continue

    def _drain(self, wait_s: float) -> None:
        """Handle worker messages (waiting up to ``wait_s`` for the first), then log progress."""
        lifecycle.progress()  # the heartbeat shows a loop that moves (a hung one is restarted)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                left = deadline - time.monotonic()
                msg = self._results.get(timeout=left) if left > 0 else self._results.get_nowait()
            except queue_mod.Empty:
                break
            self._handle(msg)
            deadline = 0.0  # got one: take the rest without waiting
        for i, p in enumerate(self._procs):
            if i not in self._exited and not p.is_alive() and p.exitcode not in (None, 0):
                self._exited.add(i)
                self._error = self._error or f"worker {i} died with exit code {p.exitcode}"
        now = time.monotonic()
        if now - self._last_log >= self.config.log_every_s:
            self._last_log = now
            self._log_progress(now)

    def _handle(self, msg: tuple) -> None:
        kind, index = msg[0], msg[1]
        if kind == "done":
            counts, t_done = msg[2], msg[3]
            self._batches_done += 1
            epoch = counts.get("epoch")
            self._see_epoch(epoch)
            runs = self._runs.pop(counts.get("seq"), [])
            if epoch == self._epoch:  # stored on the current instance: no replay needed
                self._stored.extend(runs)
            self.summary.samples += counts["samples"]
            self.summary.texts += counts.get("texts", counts["samples"])
            self.summary.written += counts["written"]
            self.summary.consumed += counts.get("consumed", 0)
            self.summary.nbytes += counts["nbytes"]
            self._last_done = max(self._last_done, t_done)
            if self._ready_at and self._last_done > min(self._ready_at.values()):
                self.summary.steady_samples_per_s = self.summary.samples / (
                    self._last_done - min(self._ready_at.values())
                )
        elif kind == "ready":
            self._ready_at[index] = msg[2]
            self._eta.begin(0.0, now=msg[2])  # tokenizer loading is not collation
        elif kind == "error":
            logger.error("[collator] worker %d failed: %s", index, msg[2])
            self._error = self._error or f"worker {index}: {msg[2]}"
        elif kind == "exit":
            self._exited.add(index)

    def _log_progress(self, now: float) -> None:
        from services.collator.progress import format_duration

        elapsed = max(now - self._start, 1e-9)
        s = self.summary
        fraction = self._progress.fraction() if self._progress is not None else None
        if fraction is not None and s.read:
            # the reader runs ahead of the puts by the batches in flight: scale what was read
            # by the share of it that is done (put, skipped as queued, or bad)
            fraction *= min(1.0, (s.texts + s.skipped + s.bad_lines) / s.read)
        left = self._eta.left_s(fraction, now)
        where = "corpus size being counted" if fraction is None else f"{100 * fraction:.0f}% done"
        eta = f", ETA {format_duration(left)}" if left is not None else ""
        logger.info(
            "[collator] %s%s, %d samples put (%d new, %d skipped, %d already consumed), "
            "%.1f samples/s, %s/s; %s",
            where,
            eta,
            s.samples,
            s.written,
            s.skipped,
            s.consumed,
            s.samples / elapsed,
            format_size(s.nbytes / elapsed),
            self._state(),
        )

    def _state(self) -> str:
        """What the run waits on now: tokenizers, a full queue, an unreachable queue."""
        if self._procs and not self._ready_at:
            return "loading tokenizers"
        if self._batches_done >= self._submitted:
            return "reading the corpus" if not self._procs else "collating"
        from services.queue.errors import QueueError

        cfg = self.config.worker
        timeout_s = min(_PROBE_TIMEOUT_S, cfg.queue_timeout_s)
        try:
            if self._probe is None:
                from services.queue.client import QueueClient

                self._probe = QueueClient(cfg.queue, timeout_s=timeout_s, retries=0, stop=self.stop)
            stats = self._probe.stats()
        except QueueError as e:
            if e.code == "stopped":
                return "stopping"
            return f"queue unreachable ({cfg.queue} did not answer within {timeout_s:g}s)"
        if stats.get("parked_puts", 0) > 0:
            return (
                f"blocked on a full queue ({format_size(stats.get('bytes_used', 0))} of "
                f"{format_size(stats.get('capacity_bytes', 0))} used): consumers must ack, or "
                "raise the queue's --capacity"
            )
        return "collating"

    def _shutdown(self, graceful: bool) -> None:
        """Wait for every worker to exit; on a stop, abandon the batches still queued."""
        if not graceful:
            self._stop_event.set()
            self._abandon_tasks()
        deadline = time.monotonic() + self.config.worker.put_timeout_s + _EXIT_GRACE_S
        while len(self._exited) < len(self._procs) and time.monotonic() < deadline:
            self._drain(wait_s=0.2)
            if all(not p.is_alive() for p in self._procs):
                self._drain(wait_s=0.0)
                break
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        for i, p in enumerate(self._procs):
            p.join(timeout=5.0)
            if p.is_alive():
                logger.warning("[collator] worker %d did not exit: terminating it", i)
                p.terminate()
                p.join(timeout=5.0)
        self._tasks.cancel_join_thread()  # abandoned batches must not block our exit

    def _abandon_tasks(self) -> None:
        dropped = 0
        while True:
            try:
                if self._tasks.get_nowait() is not None:
                    dropped += 1
            except (queue_mod.Empty, OSError, ValueError):
                break
        if dropped:
            logger.info("[collator] stopping: %d queued batch(es) abandoned", dropped)
