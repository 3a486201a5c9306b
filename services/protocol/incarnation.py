"""The teachers' announcements: a teacher process, once it serves, says so on the queue, so that
trainers know a successor serves their group before any result of it (or of its predecessor)
reached them.

A teacher of group ``g`` puts the record ``teacher<g>/<instance>`` into ``<partition>.meta`` (one
field ``pid``, ``[1, 1]`` int64) when it is ready. A group has one teacher at a time, so the
newest announcement (the last in the queue's insertion order) is the incarnation serving the
group, and every older one is gone: a trainer that waits for results lists the announcements and
asks the newest again for what an older one held leased (services/trainer/teacher_client.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from services.protocol.names import meta_partition


def _prefix(group: int) -> str:
    return f"teacher{group}/"


def announce_teacher(client: Any, partition: str, group: int, instance: str) -> None:
    """Tell the trainers that teacher ``instance`` serves ``group`` from now on.

    Args:
        client: a QueueClient.
        partition: the run's sample partition.
        group: the teacher group.
        instance: the teacher's process-instance id (``names.new_instance``).
    """
    client.put(
        meta_partition(partition),
        [_prefix(group) + instance],
        {"pid": torch.tensor([[os.getpid()]], dtype=torch.int64)},
    )


def teacher_incarnations(client: Any, partition: str, group: int) -> list[str]:
    """The teachers that announced themselves for ``group``, oldest first (the last serves).

    Args:
        client: a QueueClient.
        partition: the run's sample partition.
        group: the teacher group.

    Returns:
        Their instance ids in announcement order ([] before the first).
    """
    prefix = _prefix(group)
    keys = client.list(meta_partition(partition)).get("keys", [])
    return [k[len(prefix) :] for k in keys if k.startswith(prefix)]
