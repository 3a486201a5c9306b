"""Whose checkpoint is in a run directory: a run resumes only its own, unless told otherwise.

A run directory records its run's fingerprint (``fingerprint.json``: the settings that decide
what is trained: models, tokenizers, data, loss, batch, optimizer, seeds, ranks). At start:

* no checkpoint: a fresh run (the fingerprint is written);
* a checkpoint of the same fingerprint: resumed ("resuming step N of M"), or, when its run
  ended (``summary.json`` of an unstopped run at the checkpoint's step, ``max_steps`` reached),
  "already complete" at once;
* a checkpoint of another fingerprint, or of none: refused before any process starts, naming
  what differs, ``--resume`` (take the checkpoint anyway; the trainer loads it where the shapes
  allow) and ``--fresh`` (the old directory is moved aside, never deleted, and the run starts
  over).

What may change between a run and its resume without a new fingerprint: ``max_steps`` (a run is
extended), checkpoint and eval cadence, timeouts, devices, the compute settings (dtype,
compile), the projection file's path (a cache).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

__all__ = ["FINGERPRINT_FILE", "StartPlan", "fingerprint", "plan_start"]

FINGERPRINT_FILE = "fingerprint.json"

# (section, keys) of the run config that decide what is trained
_FINGERPRINT_KEYS: dict[str | None, tuple[str, ...]] = {
    None: (
        "student_tokenizer",
        "teacher_tokenizer",
        "ctx_student",
        "ctx_teacher",
        "projection_top_k",
        "trainers",
    ),
    "data": ("train", "limit", "text_field"),
    "teacher": ("model", "vocab_size", "seed"),
    "trainer": (
        "student",
        "vocab_size",
        "teacher_vocab_size",
        "micro_batch",
        "grad_accum",
        "epochs",
        "seed",
        "parallel",
        "optim",
    ),
}
_LOSS_KEYS = (
    "mode",
    "temperature",
    "kl_weight",
    "ce_weight",
    "vocab_topk",
    "topk_columns",
    "uncommon_topk",
    "reverse_kl",
    "dynamic_scaling",
)


def fingerprint(config: Any) -> dict[str, Any]:
    """The settings of a run config that decide what is trained, as a flat JSON-able dict.

    Args:
        config: a RunConfig.

    Returns:
        ``{"trainer.student": ..., "trainer.loss.mode": ..., ...}``.
    """
    out: dict[str, Any] = {}
    for section, keys in _FINGERPRINT_KEYS.items():
        obj = config if section is None else getattr(config, section)
        for key in keys:
            value = getattr(obj, key)
            if dataclasses.is_dataclass(value):
                value = dataclasses.asdict(value)
            out[key if section is None else f"{section}.{key}"] = value
    for key in _LOSS_KEYS:
        out[f"trainer.loss.{key}"] = getattr(config.trainer.loss, key)
    return json.loads(json.dumps(out, default=str))


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
    fingerprint of a run that starts fresh or resumes with ``--resume``.

    Args:
        config: the RunConfig.
        resume: take a checkpoint of another fingerprint anyway.
        fresh: start over, the old directory moved aside.

    Returns:
        The :class:`StartPlan`.

    Raises:
        ValueError: both flags, or a checkpoint of another run without either (names the
            differences and the two flags).
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
    total = config.trainer.max_steps
    of_total = f" of {total}" if total else ""
    recorded = _read_fingerprint(run_dir)
    if recorded != mine and not resume:
        raise ValueError(
            f"run directory {str(run_dir)!r} holds a checkpoint (step {step}) of another run"
            f"{_differences(recorded, mine)}; pass --resume to train on from it anyway, or "
            "--fresh to start over (the old directory is moved aside)"
        )
    if recorded != mine:
        _write_fingerprint(run_dir, mine)
        return StartPlan("resume", f"resuming step {step}{of_total} with a changed config")
    if _complete(run_dir, step, total):
        return StartPlan("complete", f"already complete: {step} steps in {run_dir}")
    return StartPlan("resume", f"resuming step {step}{of_total}")


def _write_fingerprint(run_dir: Path, values: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / FINGERPRINT_FILE).write_text(json.dumps(values, indent=1, sort_keys=True))


def _read_fingerprint(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / FINGERPRINT_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _checkpoint_step(path: Path) -> int:
    for meta in sorted(path.glob("rank*.json")):
        try:
            return int(json.loads(meta.read_text())["step"])
        except (ValueError, KeyError, json.JSONDecodeError):
            continue
    return int(path.name.rsplit("_", 1)[-1]) if path.name.startswith("step_") else 0


def _complete(run_dir: Path, step: int, max_steps: int) -> bool:
    """The run ended (not stopped) at its last checkpoint, with its steps done."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    ended = not summary.get("stopped", True) and summary.get("step") == step
    return ended and (not max_steps or step >= max_steps)


def _differences(recorded: dict[str, Any] | None, mine: dict[str, Any]) -> str:
    if recorded is None:
        return " (it records no fingerprint)"
    keys = sorted(k for k in set(recorded) | set(mine) if recorded.get(k) != mine.get(k))
    shown = ", ".join(f"{k}: {recorded.get(k)!r} -> {mine.get(k)!r}" for k in keys[:4])
    more = f" and {len(keys) - 4} more" if len(keys) > 4 else ""
    return f" ({shown}{more})"
