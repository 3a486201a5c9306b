"""Experiment trackers (``trainer.observe.report_to``): TensorBoard and Weights & Biases receive
the trainer's metric records, with the run config as hyperparameters. Only rank 0 writes.

A JSONL record ``{"event": "step", "step": 7, "loss": 2.1, "times": {"forward": 0.03}}`` becomes
the scalars ``step/loss`` and ``step/times/forward`` at step 7: the record's event, then its
field path, joined by ``/``. Numbers and booleans are logged; strings, lists and None are not;
``step``, ``time`` and ``rank`` are not metrics. Eval records give ``eval/bits_per_byte``, the
compile record ``compile/seconds``.

* ``tensorboard``: event files in ``RUN_DIR/tensorboard`` (``tensorboard --logdir RUN_DIR``);
  the run config as hparams (flattened keys, ``trainer.optim.lr``) and as a text summary. A
  resumed trainer purges the events past its checkpoint's step, so a curve has no doubled tail.
* ``wandb``: an offline run under ``RUN_DIR/wandb`` (no network; ``wandb sync
  RUN_DIR/wandb/offline-run-*`` uploads it later), the run config as its config. ``WANDB_MODE``
  (e.g. ``online``) and ``WANDB_PROJECT`` (default ``xtoken``) are honoured. Every launch of the
  run (restarts, resumes) logs to the same run id, kept in ``RUN_DIR/wandb/xtoken_run_id``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any, Protocol

from services.trainer.sections import TRACKERS

logger = logging.getLogger(__name__)

# the module each tracker imports, and the pip extra that installs them all
MODULES = {"tensorboard": "tensorboard", "wandb": "wandb"}
EXTRA_INSTALL = "pip install 'xtoken[tracking]' (in a checkout: pip install -e '.[tracking]')"
# record fields that place a record rather than measure something
_NOT_METRICS = frozenset({"event", "step", "time", "rank"})


class Tracker(Protocol):
    """One experiment tracker."""

    def log(self, scalars: dict[str, float], step: int) -> None:
        """Log named scalars at an optimizer step."""

    def close(self) -> None:
        """Flush and close."""


def check_installed(names: list[str]) -> None:
    """Every tracker in ``names`` can be imported here.

    Args:
        names: tracker names (``trainer.observe.report_to``).

    Raises:
        ValueError: one line naming the first missing package and the pip extra that installs it.
    """
    for name in names:
        module = MODULES[name]
        if importlib.util.find_spec(module) is None:
            raise ValueError(
                f"trainer.observe.report_to: {name} needs the {module!r} package, which is not "
                f"installed; install the tracking extra: {EXTRA_INSTALL}"
            )


def scalars(event: str, fields: dict[str, Any]) -> dict[str, float]:
    """The scalars of one metric record (see the module docstring for the names).

    Args:
        event: the record's event (``step``, ``eval``, ``compile``).
        fields: its fields.

    Returns:
        ``{"<event>/<field path>": value}`` for every number or boolean.
    """
    out: dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}/{key}", inner)
        elif isinstance(value, bool | int | float):
            out[prefix] = float(value)

    for key, value in fields.items():
        if key not in _NOT_METRICS:
            walk(f"{event}/{key}", value)
    return out


def flat_hparams(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{"trainer.optim.lr": 0.001}`` with values TensorBoard's hparams take
    (bool, int, float, str; anything else as its JSON text)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_hparams(value, f"{name}."))
        elif isinstance(value, bool | int | float | str):
            out[name] = value
        else:
            out[name] = json.dumps(value)
    return out


def run_hparams(trainer_config: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The run config to log: ``RUN_DIR/config/run.json`` (the whole run, written by ``xtoken
    run``), else the trainer's own section under ``trainer``.

    Args:
        trainer_config: the trainer's config as a mapping.
        run_dir: the run directory.

    Returns:
        A nested mapping.
    """
    path = run_dir / "config" / "run.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return {"trainer": trainer_config}


class TensorBoardTracker:
    """Scalars into TensorBoard event files (``torch.utils.tensorboard``).

    Args:
        log_dir: the event file folder.
        hparams: the run config (nested).
        start_step: the step the trainer starts from (> 0: resumed; later events are purged).
    """

    def __init__(self, log_dir: Path, hparams: dict[str, Any], start_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        self.writer = SummaryWriter(
            log_dir=str(log_dir), purge_step=start_step + 1 if start_step else None
        )
        flat = flat_hparams(hparams)
        experiment, start, self._end = hparams_summary(
            flat, {"eval/bits_per_byte": 0.0, "step/loss": 0.0}
        )
        self.writer.file_writer.add_summary(experiment)
        self.writer.file_writer.add_summary(start)
        text = "```json\n" + json.dumps(hparams, indent=1, sort_keys=True) + "\n```"
        self.writer.add_text("config", text, global_step=start_step)
        self.writer.flush()

    def log(self, scalars: dict[str, float], step: int) -> None:
        """Add each scalar at ``step``; flushed at once (a killed trainer loses no step)."""
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        """Mark the hparams session ended and close the event file."""
        self.writer.file_writer.add_summary(self._end)
        self.writer.close()


class WandbTracker:
    """Scalars into a Weights & Biases run, offline unless ``WANDB_MODE`` says otherwise.

    Args:
        run_dir: the run directory (the W&B files go under ``run_dir/wandb``).
        hparams: the run config (nested), logged as the W&B config.
    """

    def __init__(self, run_dir: Path, hparams: dict[str, Any]) -> None:
        import wandb

        folder = run_dir / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / "xtoken_run_id"
        if not id_file.is_file():
            id_file.write_text(secrets.token_hex(4) + "\n", encoding="utf-8")
        self.run = wandb.init(
            dir=str(run_dir),
            project=os.environ.get("WANDB_PROJECT") or "xtoken",
            mode=os.environ.get("WANDB_MODE") or "offline",
            id=id_file.read_text(encoding="utf-8").strip(),
            name=run_dir.name,
            resume="allow",
            config=hparams,
            # the trainer's stdout and stderr already go to RUN_DIR/logs: W&B leaves them alone
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(self, scalars: dict[str, float], step: int) -> None:
        """Log the scalars at ``step`` (W&B steps only move forward)."""
        self.run.log(scalars, step=step)

    def close(self) -> None:
        """Finish the run and stop W&B's service process: ``finish`` alone may return before
        the service wrote the run file; after the teardown it is complete on disk."""
        import wandb

        self.run.finish()
        wandb.teardown()


def open_trackers(
    names: list[str], run_dir: Path, hparams: dict[str, Any], start_step: int = 0
) -> list[Tracker]:
    """Start the trackers named in ``names``.

    Args:
        names: ``trainer.observe.report_to``.
        run_dir: the run directory.
        hparams: the run config (nested).
        start_step: the optimizer step the trainer starts from.

    Returns:
        One tracker per name, in order.

    Raises:
        ValueError: an unknown name, or a tracker whose package is not installed (one line
            naming the pip extra).
    """
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"report_to: unknown tracker {unknown[0]!r}; use {', '.join(TRACKERS)}")
    check_installed(names)
    trackers: list[Tracker] = []
    for name in dict.fromkeys(names):
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(run_dir / "tensorboard", hparams, start_step))
        else:
            trackers.append(WandbTracker(run_dir, hparams))
        logger.info("[trainer] reporting metrics to %s", name)
    return trackers


def tracked_metrics(
    jsonl: Any, observe: Any, run_dir: Path, hparams: dict[str, Any], start_step: int = 0
) -> TrackedMetrics:
    """The trainer's metrics writer, teeing into the trackers of ``observe.report_to``.

    Args:
        jsonl: the ``JsonlWriter`` of the trainer's metrics.
        observe: the trainer's ``observe`` section.
        run_dir: the run directory.
        hparams: the run config the trackers log (:func:`run_hparams`).
        start_step: the optimizer step the trainer starts from.

    Returns:
        A writer with ``write`` and ``close`` as ``JsonlWriter``'s.

    Raises:
        ValueError: as :func:`open_trackers`.
    """
    trackers = open_trackers(observe.report_to, run_dir, hparams, start_step)
    return TrackedMetrics(jsonl, trackers, start_step)


class TrackedMetrics:
    """A metrics JSONL writer that also feeds every record to trackers (rank 0's).

    Args:
        jsonl: the ``JsonlWriter`` of the trainer's metrics.
        trackers: the trackers.
        start_step: the step a record without one is logged at (the compile record).
    """

    def __init__(self, jsonl: Any, trackers: list[Tracker], start_step: int = 0) -> None:
        self.jsonl = jsonl
        self.trackers = trackers
        self.step = start_step

    def write(self, event: str, **fields: Any) -> None:
        """Write the record to the JSONL file, then its scalars to every tracker."""
        self.jsonl.write(event, **fields)
        if isinstance(fields.get("step"), int):
            self.step = fields["step"]
        values = scalars(event, fields)
        if values:
            for tracker in self.trackers:
                tracker.log(values, self.step)

    def close(self) -> None:
        """Close the trackers and the JSONL file."""
        for tracker in self.trackers:
            tracker.close()
        self.jsonl.close()
