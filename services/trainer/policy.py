"""The trainer publishes the student's weights for the rollout workers: once before its first
step (a resumed trainer: the checkpoint's) and after every ``on_policy.sync_every`` optimizer
steps, under the version of its step count (``xtoken_core.ipc.policy_weights``).

Rank 0 publishes (data-parallel ranks hold the same weights); the parameters published are the
ones the forward runs on (the bf16 copy of the fp32 masters on CUDA), in the directory
``services.protocol.names.policy_dir(run_dir)``. The publisher never waits for a reader.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from services.protocol.names import policy_dir
from services.trainer.sections import OnPolicyConfig

logger = logging.getLogger(__name__)


class PolicyPublisher:
    """Publishes a trainer's student for its rollout workers.

    Args:
        student: the student (its ``compute`` model, ``device`` and ``step``).
        on_policy: the trainer's on-policy settings (``sync_every``, ``weights``).
        run_dir: the run directory.

    Raises:
        ValueError: a transport that cannot serve this trainer (cuda_ipc on the CPU).
    """

    def __init__(self, student: Any, on_policy: OnPolicyConfig, run_dir: str | Path) -> None:
        from xtoken_core.ipc.policy_weights import WeightPublisher

        self.student = student
        self.sync_every = on_policy.sync_every
        self.first_step = on_policy.first_publication  # none before: an off-policy start
        self.version: int | None = None  # of the last publication
        transport = on_policy.weights
        if transport == "auto":
            transport = "cuda_ipc" if student.device.type == "cuda" else "shm"
        self.publisher = WeightPublisher(
            policy_dir(run_dir), student.compute.named_parameters(), transport=transport
        )
        self.seconds = 0.0  # of the last publication

    @classmethod
    def create(
        cls, student: Any, on_policy: OnPolicyConfig, run_dir: str | Path
    ) -> PolicyPublisher | None:
        """The publisher of rank 0 of a run with on-policy samples; None elsewhere.

        Raises:
            ValueError: on-policy samples under FSDP (each rank holds a shard of the weights).
        """
        if not on_policy.enabled:
            return None
        if student.sharded:
            raise ValueError(
                "on_policy.fraction > 0 with parallel fsdp: the rollout workers need the whole "
                "student, which no FSDP rank holds; use parallel ddp, or fraction 0"
            )
        return cls(student, on_policy, run_dir) if student.rank == 0 else None

    def publish(self) -> None:
        """Publish the weights now, as the version of the trainer's step."""
        started = time.perf_counter()
        self.publisher.publish(self.student.compute.named_parameters(), version=self.student.step)
        self.version = self.student.step
        self.seconds = time.perf_counter() - started
        logger.debug("[trainer] published the weights of step %d", self.student.step)

    def start(self) -> None:
        """Before the first step: publish, unless an off-policy start comes first."""
        if self.student.step >= self.first_step:
            self.publish()

    def after_step(self) -> None:
        """Publish when the step count is a multiple of ``sync_every``, from the first step to
        publish on (at it whatever the multiple)."""
        step = self.student.step
        if step >= self.first_step and (step % self.sync_every == 0 or self.version is None):
            self.publish()

    def close(self) -> None:
        """Close the publication (rollout workers keep the weights they have)."""
        self.publisher.close()
