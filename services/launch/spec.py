"""The process spec: all a launcher knows of a process of a run."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class ProcessSpec:
    """One process of a run.

    Attributes:
        name: unique in the run (``queue``, ``collator``, ``teacher0``, ``trainer1``).
        role: ``queue``, ``collator``, ``teacher`` or ``trainer``.
        argv: the command after ``xtoken`` (e.g. ``["teacher", "--config", "t.json"]``).
        env: extra environment variables.
        log_file: where stdout and stderr go.
        ready_file: the process writes it once ready (``--ready-file``), or None.
        resources: ``{"gpu": n, "cpu": n}`` (informative for the local launcher; the Ray
            launcher reserves them as the process's placement-group bundle).
        group: colocation group: processes of one group run on the same node (a teacher and
            the trainer ranks it serves through shared memory or CUDA IPC), or None.
        unit: processes that start, stop and restart together, one rendezvous port among them
            (the ranks of a tensor-parallel teacher group: one cannot go on without the
            others), or None.
    """

    name: str
    role: str
    argv: list[str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    log_file: str = ""
    ready_file: str | None = None
    resources: dict[str, float] = dataclasses.field(default_factory=dict)
    group: str | None = None
    unit: str | None = None
