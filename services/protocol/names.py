"""Names both parties of the data plane agree on: partitions, record fields, consumer tasks and
the teacher logits' transports.

Partitions of a run with sample partition ``<partition>``:

* ``<partition>``: the collators' samples, claimed by trainers;
* ``<partition>.meta``: the run's markers (the collators' end of data, :mod:`.end_of_data`);
* ``<partition>.teacher<group>``: trainer requests for teacher group ``group`` and the teacher's
  results written onto them (:mod:`.teacher`).
"""

from __future__ import annotations

import os
import secrets

# How the teacher logits reach a trainer: a ring slot in host shared memory, a ring slot in GPU
# memory shared by CUDA IPC, or the final hidden states through the queue.
TRANSPORTS = ("shm", "cuda_ipc", "hidden")
# Consumer task of the teachers on a request partition.
TEACHER_TASK = "teacher"


def meta_partition(partition: str) -> str:
    """Partition of the run's markers (the collators' end of data)."""
    return f"{partition}.meta"


def request_partition(partition: str, group: int) -> str:
    """Partition where trainers put requests for teacher group ``group``."""
    return f"{partition}.teacher{group}"


def result_field(rank: int) -> str:
    """Field a teacher writes onto a request of trainer rank ``rank``."""
    return f"result{rank}"


def hidden_field(rank: int) -> str:
    """Field holding the hidden states for trainer rank ``rank`` (``hidden`` transport)."""
    return f"hidden{rank}"


def trainer_task(rank: int, instance: str) -> str:
    """Consumer task of one trainer process (rank ``rank``, ``instance``) on the request
    partition: one per instance, so that a restarted rank also claims the records that its dead
    predecessor held leased (and frees their slots) instead of waiting for the leases to end."""
    return f"trainer{rank}/{instance}"


def new_instance() -> str:
    """A fresh process-instance id: ``<pid>-<8 hex>`` (keys and handles name it)."""
    return f"{os.getpid()}-{secrets.token_hex(4)}"
