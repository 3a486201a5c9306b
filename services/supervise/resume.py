"""Whose checkpoint is in a run directory: a run resumes only its own, unless told otherwise.

A run directory records its run's fingerprint (``fingerprint.json``): the value of every setting
whose field is marked ``trained`` (it changes what is trained: the data and how it is cut,
ordered, packed and batched, the held-out texts kept out of it, the models, tokenizers, loss,
optimizer, seeds, ranks; :mod:`services.common.config`), each by the key a run config sets it
with (a section's field that the run sets is recorded by its source). At start:

* no checkpoint: a fresh run (the fingerprint is written);
* a checkpoint of the same fingerprint: resumed ("resuming step N of M"), or, when its run
  ended (``summary.json`` of an unstopped run at the checkpoint's step) with nothing left to
  train (``max_steps`` reached, or every epoch done: its data ended), "already complete" at once;
* a checkpoint of another fingerprint, or of none: refused before any process starts, naming
  each changed key with its two values, ``--resume`` (take the checkpoint anyway; the trainer
  loads it where the shapes allow) and ``--fresh`` (the old directory is moved aside, never
  deleted, and the run starts over).

What may change between a run and its resume (fields marked ``trained: False``): ``max_steps``
(a run is extended), checkpoint and eval cadence, timeouts, devices, the compute settings
(dtype, compile, kernels), the projection file's path (a cache).

A fingerprint written by an earlier version records fewer keys (and the optimizer as one
mapping), some by a name that has moved since (``trainer.micro_batch``, now
``trainer.feed.micro_batch``): it is compared on the keys both record, each under its current
name, and a resume records the whole one.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import time
from pathlib import Path
from typing import Any

from services.common.config import marks, moved_keys

__all__ = ["FINGERPRINT_FILE", "StartPlan", "fingerprint", "plan_start"]

FINGERPRINT_FILE = "fingerprint.json"


def fingerprint(config: Any) -> dict[str, Any]:
    """The settings of a run config that decide what is trained, as a flat JSON-able dict: every
    field marked ``trained: True``, by its dotted key.

    Args:
        config: a RunConfig.

    Returns:
        ``{"trainer.student.model": ..., "trainer.optim.lr": ..., "pack": ..., ...}``.
    """
    return json.loads(json.dumps(_trained(config), default=_jsonable))


def _trained(config: Any) -> dict[str, Any]:
    """The trained settings of a config tree by dotted key; a list of sections (a run's
    ``extra_teachers``) as a list of each entry's trained settings."""
    cls = type(config)
    # a field the run sets (marked context or derived) is recorded once, by its source's key
    run_set = (*marks(cls, "context"), *marks(cls, "derived"))
    out: dict[str, Any] = {}
    for key, trained in marks(cls, "trained").items():
        if trained is True and not any(key == k or key.startswith(f"{k}.") for k in run_set):
            value: Any = config
            for part in key.split("."):
                value = getattr(value, part, None)
            if isinstance(value, list) and value and all(map(dataclasses.is_dataclass, value)):
                value = [_trained(v) for v in value]
            out[key] = value
    return out


def _jsonable(value: Any) -> Any:
    """An enum by its value; anything else JSON has no form for (a path) as text."""
    return value.value if isinstance(value, enum.Enum) else str(value)


@dataclasses.dataclass
class StartPlan:
    """What a run does with its directory.

    Attributes:
        action: ``fresh``, ``resume`` or ``complete``.
        message: the line to show (empty for a plain fresh start).
        moved_to: where ``--fresh`` moved the old directory, or None.
    """

    action: str
    message: str = ""
    moved_to: Path | None = None


def plan_start(config: Any, *, resume: bool = False, fresh: bool = False) -> StartPlan:
    """Decide how a run starts in its directory (see the module docstring); writes the
    fingerprint of a run that starts fresh, resumes with ``--resume``, or resumes a record of
    an earlier version (then recorded whole).

    Args:
        config: the RunConfig.
        resume: take a checkpoint of another fingerprint anyway.
        fresh: start over, the old directory moved aside.

    Returns:
        The :class:`StartPlan`.

    Raises:
        ValueError: both flags, or a checkpoint of another run without either (names each
            changed key with its two values, and the two flags).
    """
    from services.trainer.checkpoint import latest_checkpoint

    if resume and fresh:
        raise ValueError("--resume and --fresh exclude each other; pass one")
    run_dir = Path(config.run_dir)
    mine = fingerprint(config)
    latest = latest_checkpoint(run_dir)
    moved = None
    if latest is not None and fresh:
        moved = run_dir.with_name(f"{run_dir.name}.{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(moved)
        latest = None
    if latest is None:
        _write_fingerprint(run_dir, mine)
        note = f"started over; the old run is in {moved}" if moved else ""
        return StartPlan("fresh", note, moved)
    step = _checkpoint_step(latest)
    total = config.trainer.schedule.max_steps
    of_total = f" of {total}" if total else ""
    recorded = _read_fingerprint(run_dir)
    changes = _changes(recorded, mine, moved_keys(type(config)))
    if changes and not resume:
        raise ValueError(
            f"run directory {str(run_dir)!r} holds a checkpoint (step {step}) of another run "
            f"({changes}); pass --resume to train on from it anyway, or --fresh to start over "
            "(the old directory is moved aside)"
        )
    if recorded != mine:  # changed (--resume), or recorded by an earlier version: whole now
        _write_fingerprint(run_dir, mine)
    if changes:
        return StartPlan("resume", f"resuming step {step}{of_total} with a changed config")
    if _complete(run_dir, latest, step, config):
        return StartPlan("complete", f"already complete: {step} steps in {run_dir}")
    return StartPlan("resume", f"resuming step {step}{of_total}")


def _write_fingerprint(run_dir: Path, values: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / FINGERPRINT_FILE).write_text(json.dumps(values, indent=1, sort_keys=True))


def _read_fingerprint(run_dir: Path) -> dict[str, Any] | None:
    try:
        recorded = json.loads((run_dir / FINGERPRINT_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return recorded if isinstance(recorded, dict) and recorded else None


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Mappings as dotted keys (an earlier version recorded ``trainer.optim`` as one mapping)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _changes(recorded: dict[str, Any] | None, mine: dict[str, Any], moved: dict[str, str]) -> str:
    """Each key recorded with another value, ``key: old -> new``, comma-separated; empty when
    none. A key an earlier version recorded by a name that has moved (``moved``: old key -> new
    key) is compared under its new name; a key only one side records is not compared."""
    if recorded is None:
        return "it records no fingerprint"
    old = {moved.get(k, k): v for k, v in _flat(recorded).items()}
    new = _flat(mine)
    keys = sorted(k for k in old.keys() & new.keys() if old[k] != new[k])
    return ", ".join(f"{k}: {old[k]!r} -> {new[k]!r}" for k in keys)


def _checkpoint_meta(path: Path) -> dict[str, Any]:
    """The checkpoint's record of rank 0 (or the first rank that has one): step, epoch, ..."""
    for meta in sorted(path.glob("rank*.json")):
        try:
            record = json.loads(meta.read_text())
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record:
            return record
    return {}


def _checkpoint_step(path: Path) -> int:
    try:
        return int(_checkpoint_meta(path)["step"])
    except (KeyError, TypeError, ValueError):
        return int(path.name.rsplit("_", 1)[-1]) if path.name.startswith("step_") else 0


def _complete(run_dir: Path, checkpoint: Path, step: int, config: Any) -> bool:
    """The run ended (not stopped) at its last checkpoint with nothing left to train: its
    ``max_steps`` reached, or every epoch done (its data ended)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    if summary.get("stopped", True) or summary.get("step") != step:
        return False
    max_steps = config.trainer.schedule.max_steps
    epoch = _checkpoint_meta(checkpoint).get("epoch", summary.get("epoch", 0))
    return bool(max_steps and step >= max_steps) or int(epoch) >= config.trainer.schedule.epochs
