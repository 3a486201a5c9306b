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
    updated: float = Field(
        description="time of the run's last step record; before its first step, of its last "
        "state change (unix s)"
    )
    state_changed: float | None = Field(None, description="time of its last state change")
    step: int | None = None
    latest_metrics: dict[str, Any] | None = None
    rollouts: list[dict[str, Any]] = Field(
        default_factory=list,
        description="each rollout worker's latest batch (on-policy runs): worker, time, version "
        "(of the weights), tokens_per_s and samples_per_s generated, pending, wait_s",
    )
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


class QueueHistoryOut(BaseModel):
    """GET /v1/runs/{id}/queue/history: the run's queue stats as sampled while it ran, oldest
    first, at most ``max_points`` (past that every second sample is dropped and ``stride``
    doubles: one answer in ``stride`` is kept); kept in ``RUN_DIR/metrics/queue_depth.json``."""

    run_id: str
    fields: list[str] = Field(
        description="the columns of each point: time, samples, bytes_used, leases, "
        "parked_claims, parked_puts"
    )
    points: list[list[float]] = Field(description="empty: no sample was recorded")
    max_points: int
    stride: int


class StepColumns(BaseModel):
    """A compared run's steps, one column per figure (None where a step lacks it)."""

    step: list[int]
    tokens_seen: list[float | None] = Field(description="tokens trained up to the step")
    elapsed_s: list[float | None] = Field(description="seconds since the run's first record")
    loss: list[float | None]
    kl_loss: list[float | None]
    ce_loss: list[float | None]
    tokens_per_s: list[float | None]
    memory_mb: list[float | None]


class EvalColumns(BaseModel):
    """A compared run's held-out evals, one column per figure."""

    step: list[int]
    tokens_seen: list[float | None]
    elapsed_s: list[float | None]
    bits_per_byte: list[float | None]
    tag: list[str]


class CompareRun(BaseModel):
    """One run of a comparison."""

    id: str
    name: str
    state: str
    origin: float | None = Field(description="unix time of elapsed_s 0 (its first record)")
    steps: StepColumns
    evals: EvalColumns


class ConfigDiff(BaseModel):
    """A config key whose value is not the same in every compared run."""

    key: str = Field(description="dotted, e.g. trainer.optim.lr")
    values: dict[str, Any] = Field(description="run id -> value; a run without the key is absent")


class CompareOut(BaseModel):
    """GET /v1/compare: the runs' curves on three x axes and their config differences."""

    runs: list[CompareRun]
    config_diff: list[ConfigDiff]


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
