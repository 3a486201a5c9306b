"""The progress of ``xtoken run``, drawn by tqdm: the start-up phase, then the step, loss,
tokens/s and ETA; a bar redrawn in place on a terminal, a plain line every ``every_s`` seconds
elsewhere (a log file, CI), so that a log never fills with carriage returns."""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from services.common.series import JsonlTail

# Seconds between two plain lines when the stream is no terminal.
PLAIN_EVERY_S = 30.0
# Step records behind the step rate (the ETA) and tokens/s.
WINDOW = 8

_FORMATS = {
    # (terminal, total known) -> tqdm bar_format
    (True, True): "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} steps "
    "[{elapsed}<{remaining}{postfix}]",
    (True, False): "{desc}: {n_fmt} steps [{elapsed}{postfix}]",
    (False, True): "[run] {desc}: step {n_fmt}/{total_fmt} ({percentage:.0f}%), "
    "elapsed {elapsed}, ETA {remaining}{postfix}",
    (False, False): "[run] {desc}: step {n_fmt}, elapsed {elapsed}{postfix}",
}


class _StepBar(tqdm):
    """tqdm whose rate, and so its ETA, is the trainer's step rate over its recent steps (tqdm
    would time the updates it saw, the first of which comes after the whole start-up)."""

    monitor_interval = 0  # no monitor thread: the run refreshes the bar itself

    step_rate: float | None = None

    @property
    def format_dict(self) -> dict[str, Any]:
        """tqdm's fields, with ``rate`` in steps per second from the step records."""
        fields = super().format_dict
        if self.step_rate is not None:  # 0: not known yet, the ETA shows "?"
            fields["rate"] = self.step_rate
        return fields


class _Discard:
    """A stream that drops what tqdm draws (plain lines are written by :class:`RunProgress`)."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def is_terminal(stream: Any) -> bool:
    """``stream`` is an interactive terminal (a bar may be redrawn in place on it)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


class RunProgress:
    """The progress of one run, from trainer rank 0's metrics file and the ready files of the
    teachers and the student.

    Before the first step it names the start-up phase the run is in (loading the teacher, the
    GGUF dequantized on the first run only; loading the student; compiling it; waiting for the
    first step), then the step, loss (KD and CE), tokens/s and ETA. The total is
    ``trainer.schedule.max_steps``, or for a run that ends with its data the steps its corpus makes
    (:func:`estimated_steps`; :meth:`set_total` once known).

    Args:
        metrics: rank 0's metrics file (``RUN_DIR/metrics/trainer.rank0.jsonl``).
        total: the run's optimizer steps; None: unknown yet (no bar, no ETA).
        stream: where it is drawn (default stderr): a bar on a terminal, else plain lines.
        every_s: seconds between plain lines (a line also comes at each change of phase).
        teacher_ready: the teachers' ready files (empty: the run has no teacher).
        student_ready: rank 0's ready file (None: not watched).
        dequantizes: the teacher is dequantized from its GGUF while it loads (first run only).
        total_is_exact: ``total`` is ``max_steps`` (the run ends there): the phase after the last
            step is named (checkpoint, held-out score, export).
        clock: monotonic seconds (plain lines are timed by it).
        since: wall time this launch started (default: now): the step records of an earlier
            launch (a resumed run) give the step, not the rate.
    """

    def __init__(
        self,
        metrics: str | os.PathLike,
        total: int | None = None,
        *,
        stream: TextIO | None = None,
        every_s: float = PLAIN_EVERY_S,
        teacher_ready: Sequence[str | os.PathLike] = (),
        student_ready: str | os.PathLike | None = None,
        dequantizes: bool = False,
        total_is_exact: bool = False,
        clock: Callable[[], float] = time.monotonic,
        since: float | None = None,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = is_terminal(self.stream)
        self.every_s = every_s
        self.teacher_ready = [Path(p) for p in teacher_ready]
        self.student_ready = Path(student_ready) if student_ready is not None else None
        self.dequantizes = dequantizes
        self.total_is_exact = total_is_exact
        self.clock = clock
        self.since = time.time() if since is None else since
        self._tail = JsonlTail(metrics)
        self._recent: list[dict[str, Any]] = []  # the last WINDOW step records
        self._compiling = False
        self._note: str | None = None
        self._pending_total: int | None = None
        self._total_final = False
        self._lock = threading.Lock()
        self._last_line: float | None = None
        self._last_desc = ""
        self._closed = False
        self._exit = contextlib.ExitStack()
        self.bar = _StepBar(
            total=total,
            file=self.stream if self.terminal else _Discard(),
            desc="starting",
            bar_format=_FORMATS[(self.terminal, bool(total))],
            dynamic_ncols=self.terminal,
            mininterval=0.0,
            leave=True,
        )
        if self.terminal:
            # log lines go above the bar instead of through it
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._exit.enter_context(logging_redirect_tqdm(tqdm_class=_StepBar))

    # ------------------------------------------------------------------ inputs

    def set_total(self, total: int, *, final: bool = False) -> None:
        """The run's total steps, once known (from any thread; drawn at the next update).

        Args:
            total: optimizer steps.
            final: counted from what the collator put (an estimate never replaces it).
        """
        with self._lock:
            if self._total_final and not final:
                return
            self._pending_total = total
            self._total_final = self._total_final or final

    def note(self, text: str | None) -> None:
        """Name what the run does now (``stopping: the trainers checkpoint``) in place of the
        phase it would show; None goes back to it. Drawn at once."""
        self._note = text
        self.update()

    def phase(self) -> str:
        """What the run is doing, in words, from what is known now."""
        if self._note:
            return self._note
        if self._recent:
            last = self._recent[-1]["step"]
            if self.total_is_exact and self.bar.total and last >= self.bar.total:
                return "finishing (checkpoint, held-out score, export)"
            return "training"
        if not all(p.exists() for p in self.teacher_ready):
            if self.dequantizes:
                return "loading the teacher (dequantizing the GGUF, first run only)"
            return "loading the teacher"
        if self.student_ready is not None and not self.student_ready.exists():
            return "loading the student"
        if self._compiling:
            return "compiling the student..."
        return "waiting for the first step"

    # ------------------------------------------------------------------ drawing

    def update(self) -> None:
        """Read what rank 0 appended and redraw (a terminal), or write a plain line when
        ``every_s`` passed or the phase changed (elsewhere)."""
        if self._closed:
            return
        desc = self._refresh()
        if self.terminal:
            self.bar.refresh()
            return
        now = self.clock()
        due = self._last_line is None or now - self._last_line >= self.every_s
        if due or desc != self._last_desc:
            self._write_line()
            self._last_line = now
        self._last_desc = desc

    def close(self) -> None:
        """The last state, drawn once more; the next output starts on a fresh line."""
        if self._closed:
            return
        self._refresh()
        if not self.terminal:
            self._write_line()
        self._closed = True
        self.bar.close()
        self._exit.close()

    def _refresh(self) -> str:
        """Read what rank 0 appended and set the bar's fields; returns the phase."""
        self._read()
        bar = self.bar
        with self._lock:
            total, self._pending_total = self._pending_total, None
        if total is not None and total != bar.total:
            bar.total = total
            bar.bar_format = _FORMATS[(self.terminal, True)]
        desc = self.phase()
        bar.set_description_str(desc, refresh=False)
        if self._recent:
            last = self._recent[-1]
            bar.n = last["step"]
            new = [r for r in self._recent if (r.get("time") or 0) >= self.since] or [last]
            bar.step_rate = _step_rate(new)
            bar.set_postfix_str(_figures(new), refresh=False)
        return desc

    def _read(self) -> None:
        for record in self._tail.poll():
            event = record.get("event")
            if event == "compile":
                self._compiling = record.get("state") == "start"
            elif event == "step" and isinstance(record.get("step"), int):
                self._recent = (self._recent + [record])[-WINDOW:]

    def _write_line(self) -> None:
        self.stream.write(str(self.bar) + "\n")
        self.stream.flush()


def _step_rate(records: list[dict[str, Any]]) -> float:
    """Steps per second over the records' wall times (evaluations and checkpoints included); 0
    (ETA unknown) before two steps: the first one's time holds the start-up (compile, warm-up)."""
    first, last = records[0], records[-1]
    steps = last["step"] - first["step"]
    seconds = (last.get("time") or 0) - (first.get("time") or 0)
    return steps / seconds if steps > 0 and seconds > 0 else 0.0


def _figures(records: list[dict[str, Any]]) -> str:
    """``loss 4.1234 (kd 3.1000 ce 4.5000), 812 tok/s`` of the last step (tokens/s: the median
    of the records, so that the start-up step does not drag it)."""
    last = records[-1]
    rates = [r["tokens_per_s"] for r in records if r.get("tokens_per_s")]
    tok_s = statistics.median(rates) if rates else 0.0
    return (
        f"loss {last.get('loss', math.nan):.4f} (kd {last.get('kl_loss', 0.0):.4f} "
        f"ce {last.get('ce_loss', 0.0):.4f}), {tok_s:.0f} tok/s"
    )


def estimated_steps(
    texts: int, micro_batch: int, grad_accum: int, ranks: int, epochs: int, on_policy: int = 0
) -> int:
    """The optimizer steps of a run that ends with its data (``max_steps: 0``): each step takes
    ``micro_batch x grad_accum`` texts on every trainer rank (less its ``on_policy`` samples),
    the last one of an epoch fewer.

    Args:
        texts: the texts the collator puts (one sample each).
        micro_batch, grad_accum: the trainer's.
        ranks: trainer ranks.
        epochs: passes over the data.
        on_policy: on-policy samples of a rank's step (``trainer.on_policy.share``).

    Returns:
        ``ceil(texts / global batch) * epochs`` (at least 1).
    """
    global_batch = max(1, micro_batch * grad_accum - on_policy) * ranks
    return max(1, math.ceil(texts / global_batch)) * epochs


def count_texts(
    train: str | os.PathLike,
    *,
    text_field: str = "text",
    txt_split: str = "blank_line",
    limit: int | None = None,
) -> int:
    """The texts the collator reads from ``train`` (a file, folder or glob): what
    :func:`~xtoken_core.data.corpus.iter_corpus` yields (a ``.txt`` file cut by ``txt_split``,
    as the collator cuts it), bad lines skipped, at most ``limit``.

    Raises:
        FileNotFoundError, ValueError: as :func:`~xtoken_core.data.corpus.iter_corpus`.
    """
    from xtoken_core.data.corpus import iter_corpus

    n = 0
    for _ in iter_corpus(
        train, text_field=text_field, txt_split=txt_split, on_bad=lambda err: None
    ):
        n += 1
        if limit is not None and n >= limit:
            break
    return n
