"""Prometheus text exposition of the control plane's runs (names and labels by its conventions)."""

from __future__ import annotations

import math
from typing import Any

# step phases as the trainer names them (label values of xtoken_step_seconds)
PHASES = ("data_wait", "sync", "teacher_wait", "forward", "loss", "backward", "optimizer")
LOSS_PARTS = {"total": "loss", "kd": "kl_loss", "ce": "ce_loss"}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, Any]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class _Family:
    def __init__(self, name: str, kind: str, help_text: str) -> None:
        self.name, self.kind, self.help = name, kind, help_text
        self.samples: list[tuple[dict[str, Any], float]] = []

    def add(self, value: float | None, **labels: Any) -> None:
        if value is not None:
            self.samples.append((labels, float(value)))

    def render(self) -> str:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        suffix = "_total" if self.kind == "counter" else ""
        for labels, value in self.samples:
            lines.append(f"{self.name}{suffix}{_labels(labels)} {_number(value)}")
        return "\n".join(lines)


def render(snapshot: dict[str, Any], *, states: tuple[str, ...], now: float) -> str:
    """The text exposition of a :meth:`Supervisor.snapshot`.

    Labels: ``run`` (the run id), ``state``, ``phase``, ``part``, ``partition``, ``role``,
    ``teacher``, ``rank``, ``memory``, ``process``: a handful of values each (no step numbers,
    no keys).

    Args:
        snapshot: the supervisor's snapshot.
        states: every run state (each gets a sample, 0 when no run is in it).
        now: the current time (uptime).

    Returns:
        Prometheus text format 0.0.4.
    """
    f = {
        "runs": _Family("xtoken_runs", "gauge", "Runs by state."),
        "up": _Family("xtoken_control_uptime_seconds", "gauge", "Seconds since the start."),
        "tokens": _Family("xtoken_tokens", "counter", "Student tokens trained."),
        "steps": _Family("xtoken_steps", "counter", "Optimizer steps recorded."),
        "step": _Family("xtoken_step", "gauge", "Latest optimizer step."),
        "step_s": _Family(
            "xtoken_step_seconds", "gauge", "Seconds of the latest step by phase ('total': all)."
        ),
        "tps": _Family("xtoken_tokens_per_second", "gauge", "Student tokens/s of the latest step."),
        "loss": _Family("xtoken_loss", "gauge", "Latest loss by part (total, kd, ce)."),
        "bpb": _Family("xtoken_heldout_bits_per_byte", "gauge", "Latest held-out bits per byte."),
        "mem": _Family(
            "xtoken_process_memory_bytes",
            "gauge",
            "Peak memory of each trainer rank, teacher group and rollout worker (rank: the "
            "trainer rank, teacher group or rollout worker; teacher: the teacher of the run a "
            "group is of, 0 for the teacher section; memory=gpu: allocated on its CUDA device; "
            "memory=host: its RSS, on a CPU).",
        ),
        "q_samples": _Family("xtoken_queue_samples", "gauge", "Samples held by the queue."),
        "q_bytes": _Family("xtoken_queue_bytes", "gauge", "Bytes held by the queue."),
        "q_cap": _Family("xtoken_queue_capacity_bytes", "gauge", "Capacity of the queue."),
        "q_leases": _Family("xtoken_queue_leases", "gauge", "Samples claimed and not yet acked."),
        "q_waiting": _Family(
            "xtoken_queue_claims_waiting", "gauge", "Claims parked until samples arrive."
        ),
        "gen_tps": _Family(
            "xtoken_rollout_tokens_per_second",
            "gauge",
            "Tokens a rollout worker generated per second in its latest batch (rank: the worker).",
        ),
        "staleness": _Family(
            "xtoken_on_policy_staleness",
            "gauge",
            "Mean staleness (weight publications) of the on-policy samples of the latest step.",
        ),
        "dropped": _Family(
            "xtoken_on_policy_dropped_stale",
            "counter",
            "On-policy samples dropped as stale (never trained) by trainer rank 0.",
        ),
        "worker_up": _Family("xtoken_worker_up", "gauge", "1 while a process of a run runs."),
        "restarts": _Family("xtoken_worker_restarts", "counter", "Restarts of a run's processes."),
    }
    counts = dict.fromkeys(states, 0)
    for run in snapshot["runs"]:
        counts[run["state"]] = counts.get(run["state"], 0) + 1
    for state, n in counts.items():
        f["runs"].add(n, state=state)
    f["up"].add(now - snapshot["started"])
    for run in snapshot["runs"]:
        rid = run["id"]
        if run["steps_total"]:
            f["tokens"].add(run["tokens_total"], run=rid)
            f["steps"].add(run["steps_total"], run=rid)
        latest = run.get("latest")
        if latest:
            f["step"].add(latest.get("step"), run=rid)
            f["step_s"].add(latest.get("step_s"), run=rid, phase="total")
            for phase, seconds in sorted((latest.get("times") or {}).items()):
                f["step_s"].add(seconds, run=rid, phase=phase)
            f["tps"].add(latest.get("tokens_per_s"), run=rid)
            for part, key in LOSS_PARTS.items():
                f["loss"].add(latest.get(key), run=rid, part=part)
            on_policy = latest.get("on_policy")
            if on_policy:
                f["staleness"].add(on_policy.get("mean_staleness"), run=rid)
                f["dropped"].add(on_policy.get("dropped_stale"), run=rid)
        for r in run.get("rollouts") or []:
            f["gen_tps"].add(r.get("tokens_per_s"), run=rid, rank=r["worker"])
        for ev in run.get("evals") or []:
            if ev.get("bits_per_byte") is not None:
                f["bpb"].add(ev["bits_per_byte"], run=rid)
        q = run.get("queue")
        if q:
            f["q_cap"].add(q.get("capacity_bytes"), run=rid)
            f["q_leases"].add(q.get("leases"), run=rid)
            f["q_waiting"].add(q.get("parked_claims"), run=rid)
            for part, stats in sorted((q.get("partitions") or {}).items()):
                f["q_samples"].add(stats.get("samples"), run=rid, partition=part)
                f["q_bytes"].add(stats.get("bytes"), run=rid, partition=part)
        for m in run.get("memory") or []:
            who = {"role": m["role"]}
            if "teacher" in m:  # a teacher group: of which teacher of the run
                who["teacher"] = m["teacher"]
            f["mem"].add(round(m["mb"] * 2**20), run=rid, **who, rank=m["rank"], memory=m["memory"])
        restarts: dict[str, int] = {}
        for p in run.get("processes") or []:
            f["worker_up"].add(1 if p["state"] == "running" else 0, run=rid, process=p["name"])
            n = p.get("restarts") or 0
            # a trainer group restarts together: each rank's row holds the group's count
            restarts[p["role"]] = (
                max(restarts.get(p["role"], 0), n)
                if p["role"] == "trainer"
                else restarts.get(p["role"], 0) + n
            )
        for role, n in sorted(restarts.items()):
            f["restarts"].add(n, run=rid, role=role)
    return "\n".join(fam.render() for fam in f.values()) + "\n"
