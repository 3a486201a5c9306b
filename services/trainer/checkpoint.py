"""Trainer checkpoints: model + optimizer with torch.distributed.checkpoint, and per rank the
schedule, RNG and the sample keys trained in the current epoch (the truth of what was trained).

Layout under ``<run_dir>/checkpoints/``::

    step_00000040/            one DCP checkpoint (sharded by rank under FSDP)
        .metadata, __0_0.distcp, ...
        rank0.json            {step, epoch, task_start, trained: [keys], scheduler, skipped_steps}
        rng.rank0.pt          CPU (and CUDA) RNG state, tensors only (loaded weights_only)
    latest                    "step_00000040", written last (a crash mid-save keeps the old one)

On resume every rank reads every ``rank*.json`` of the checkpoint: the union of their keys is what
the epoch already trained, whatever the new world size.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

logger = logging.getLogger(__name__)

KEEP = 2  # checkpoints kept (the latest and one before it)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def checkpoint_root(run_dir: str | os.PathLike) -> Path:
    """``<run_dir>/checkpoints``."""
    return Path(run_dir) / "checkpoints"


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The latest complete checkpoint directory, or None."""
    root = checkpoint_root(run_dir)
    try:
        name = (root / "latest").read_text().strip()
    except FileNotFoundError:
        return None
    path = root / name
    return path if path.is_dir() else None


def save(
    student: Any,
    run_dir: str | os.PathLike,
    *,
    epoch: int,
    task_start: int,
    trained: set[str],
    skipped_steps: int = 0,
    before: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint of ``student`` (collective: every rank calls it).

    Args:
        student: the Student (model, optimizer, scheduler, step, rank, device).
        run_dir: the run directory.
        epoch: current epoch.
        task_start: step at which this epoch's consumer task started (names the task).
        trained: keys this rank trained in the epoch.
        skipped_steps: steps whose update was skipped for a non-finite gradient so far.
        before: the student's held-out figures before training (the run summary's
            ``student_before``), kept for the summary of a resumed run; None: not evaluated.

    Returns:
        The checkpoint directory.
    """
    root = checkpoint_root(run_dir)
    path = root / f"step_{student.step:08d}"
    model_sd, optim_sd = get_state_dict(student.state_model, student.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    meta = {
        "step": student.step,
        "epoch": epoch,
        "task_start": task_start,
        "trained": sorted(trained),
        "scheduler": _jsonable(student.scheduler.state_dict()),
        "skipped_steps": skipped_steps,
        "world_size": student.world_size,
        "student_before": before,
    }
    _atomic_write(path / f"rank{student.rank}.json", json.dumps(meta))
    rng = {"cpu": torch.get_rng_state()}
    if student.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(student.device)
    torch.save(rng, path / f"rng.rank{student.rank}.pt")
    _barrier()
    if student.rank == 0:
        _atomic_write(root / "latest", path.name)
        for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
        logger.info(
            "[trainer] checkpoint %s (%d keys trained this epoch on rank 0)", path, len(trained)
        )
    _barrier()
    return path


def load(student: Any, path: Path) -> dict[str, Any]:
    """Restore ``student`` from a checkpoint (collective): weights, optimizer, schedule, step and
    this rank's RNG.

    Returns:
        ``{"step", "epoch", "task_start", "trained", "skipped_steps", "student_before"}`` with
        the union of every rank's keys of the checkpoint's epoch (``skipped_steps``,
        ``student_before``: as given to :func:`save`).

    Raises:
        ValueError: the checkpoint lacks its rank files (names the directory).
    """
    metas = {f.name: json.loads(f.read_text()) for f in sorted(path.glob("rank*.json"))}
    if not metas:
        raise ValueError(f"checkpoint {path} has no rank*.json: it is incomplete; delete it")
    # a rank new to this checkpoint (a larger world) takes the schedule of another rank
    mine = metas.get(f"rank{student.rank}.json") or next(iter(metas.values()))
    model_sd, optim_sd = get_state_dict(student.state_model, student.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        student.state_model,
        student.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )
    student.publish()  # bf16 compute copy from the fp32 masters just loaded
    student.scheduler.load_state_dict(mine["scheduler"])
    student.step = int(mine["step"])
    rng_file = path / f"rng.rank{student.rank}.pt"
    if rng_file.exists():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and student.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], student.device)
    trained: set[str] = set()
    for m in metas.values():
        if m["epoch"] == mine["epoch"]:
            trained.update(m["trained"])
    logger.info(
        "[trainer] resumed from %s: step %d, epoch %d, %d keys already trained",
        path,
        student.step,
        mine["epoch"],
        len(trained),
    )
    return {
        "step": student.step,
        "epoch": int(mine["epoch"]),
        "task_start": int(mine["task_start"]),
        "trained": trained,
        "skipped_steps": int(mine.get("skipped_steps", 0)),
        "student_before": mine.get("student_before"),
    }


def _jsonable(state: dict) -> dict:
    return {k: v for k, v in state.items() if _is_json(v)}


def _is_json(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except TypeError:
        return False


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
