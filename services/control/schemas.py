"""Pydantic models of the control plane's REST API (request and response bodies)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class StopRequest(BaseModel):
    """Body of POST /v1/runs/{id}/stop (optional)."""

    grace_s: float = Field(300.0, ge=0, le=86400, description="seconds before a kill")


class Checkpoint(BaseModel):
    """The latest complete checkpoint of a run."""

    path: str
    step: int | None


class RunOut(BaseModel):
    """A run as the API shows it."""

    id: str
    name: str
    state: str = Field(
        description="PENDING, STARTING, RUNNING, STOPPING, STOPPED, SUCCEEDED, "
        "FAILED, RECOVERING or INTERRUPTED"
    )
    run_dir: str
    created: float
    updated: float
    step: int | None = None
    latest_metrics: dict[str, Any] | None = None
    checkpoint: Checkpoint | None = None
    reason: str | None = Field(None, description="failure reason, recovery cause or stop note")
    attempt: int = Field(0, description="restart attempt while RECOVERING")
    failed_process: str | None = None
    exit_code: int | None = None
    log_tail: str | None = Field(None, description="last log lines of the failed process")
    queue: str | None = None
    config: dict[str, Any] | None = None


class RunList(BaseModel):
    """GET /v1/runs."""

    runs: list[RunOut]


class ProcessOut(BaseModel):
    """One process of a run."""

    name: str
    role: str
    host: str
    pid: int | None = None
    gpu: str | None = None
    state: str = Field(description="running, exited, failed or gone")
    restarts: int = 0
    started: float | None = None
    last_heartbeat: float | None = None
    exit_code: int | None = None
    log_file: str | None = None


class ProcessList(BaseModel):
    """GET /v1/runs/{id}/processes."""

    run_id: str
    processes: list[ProcessOut]


class MetricsOut(BaseModel):
    """GET /v1/runs/{id}/metrics: step records (loss, kl_loss, ce_loss, tokens_per_s, step_s,
    times by phase, memory_mb, ...) and held-out evals."""

    run_id: str
    steps: list[dict[str, Any]]
    evals: list[dict[str, Any]]


class QueueOut(BaseModel):
    """GET /v1/runs/{id}/queue: the run's queue and its latest stats (``samples``, ``bytes_used``,
    ``capacity_bytes``, ``leases``, ``partitions`` {name: {samples, bytes, tasks}}, ``rates``)."""

    run_id: str
    address: str | None = None
    stats: dict[str, Any] | None = Field(None, description="None before the queue first answers")
    updated: float | None = Field(None, description="when the stats were taken (unix s)")


class ErrorOut(BaseModel):
    """Every error: what was wrong and what to do; ``key`` names the config key when one is."""

    error: str
    key: str | None = None


class Health(BaseModel):
    """GET /healthz."""

    status: str
    runs: int
    active: int
    uptime_s: float
