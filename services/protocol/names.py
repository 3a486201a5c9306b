"""Names both parties of the data plane agree on: partitions, record fields, consumer tasks and
the teacher logits' transports.

Partitions of a run with sample partition ``<partition>``:

* ``<partition>``: the collators' samples, claimed by trainers;
* ``<partition>.meta``: the run's markers (the collators' end of data, :mod:`.end_of_data`);
* ``<partition>.teacher<group>``: trainer requests for teacher group ``group`` and the teacher's
  results written onto them (:mod:`.teacher`); a run's further teachers (teacher ``j >= 1``, of
  tokenizer families of their own) have theirs in ``<partition>.t<j>.teacher<group>``;
* ``<partition>.rollout``: the rollout workers' on-policy samples (:mod:`.rollout`), claimed by
  trainers under task :data:`ROLLOUT_TASK`.

The trainer publishes the student's weights for the rollout workers in :func:`policy_dir` of the
run directory (``xtoken_core.ipc.policy_weights``).
"""

from __future__ import annotations

import os
import secrets

# How the teacher logits reach a trainer: a ring slot in host shared memory, a ring slot in GPU
# memory shared by CUDA IPC, the final hidden states through the queue, or the top-K
# log-probabilities per position through the queue.
TRANSPORTS = ("shm", "cuda_ipc", "hidden", "topk")
# The transports that write through the queue, with no logit ring.
QUEUE_TRANSPORTS = ("hidden", "topk")
# Consumer task of the teachers on a request partition.
TEACHER_TASK = "teacher"
# Consumer task of the trainer ranks on the rollout partition (one task: each sample goes to one
# rank, once; registered, so the queue drops a sample once it is acked).
ROLLOUT_TASK = "trainer"


def meta_partition(partition: str) -> str:
    """Partition of the run's markers (the collators' end of data)."""
    return f"{partition}.meta"


def request_partition(partition: str, group: int, teacher: int = 0) -> str:
    """Partition where trainers put requests for group ``group`` of the run's teacher
    ``teacher`` (0: the first, the one-teacher name)."""
    if teacher < 0:
        raise ValueError(f"teacher={teacher}: teachers count from 0")
    if teacher == 0:
        return f"{partition}.teacher{group}"
    return f"{partition}.t{teacher}.teacher{group}"


def rollout_partition(partition: str) -> str:
    """Partition of the on-policy samples the rollout workers put for a run."""
    return f"{partition}.rollout"


def policy_dir(run_dir: str | os.PathLike) -> str:
    """Where a run's trainer publishes the student's weights for its rollout workers."""
    return os.path.join(os.fspath(run_dir), "policy")


def result_field(rank: int) -> str:
    """Field a teacher writes onto a request of trainer rank ``rank``."""
    return f"result{rank}"


def hidden_field(rank: int) -> str:
    """Field holding the hidden states for trainer rank ``rank`` (``hidden`` transport)."""
    return f"hidden{rank}"


def topk_fields(rank: int) -> tuple[str, str, str, str]:
    """Fields holding the top-K targets for trainer rank ``rank`` (``topk`` transport): the ids,
    their log-probabilities, the log of the rest mass and the log-partition."""
    return (f"topk_ids{rank}", f"topk_logprobs{rank}", f"topk_rest{rank}", f"topk_lse{rank}")


def trainer_task(rank: int, instance: str) -> str:
    """Consumer task of one trainer process (rank ``rank``, ``instance``) on the request
    partition: one per instance, so that a restarted rank also claims the records that its dead
    predecessor held leased (and frees their slots) instead of waiting for the leases to end."""
    return f"trainer{rank}/{instance}"


def new_instance() -> str:
    """A fresh process-instance id: ``<pid>-<8 hex>`` (keys and handles name it)."""
    return f"{os.getpid()}-{secrets.token_hex(4)}"
