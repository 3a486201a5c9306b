"""The teachers' announcements: a teacher process, once it serves, says so on the queue, so that
trainers know a successor serves their group before any result of it (or of its predecessor)
reached them.

A teacher of group ``g`` puts the record ``teacher<g>/<instance>`` into ``<partition>.meta`` (one
field ``pid``, ``[1, 1]`` int64) when it is ready; a group of a run's further teacher ``j >= 1``
puts ``t<j>.teacher<g>/<instance>`` (its process name), so that each teacher's groups have
announcements of their own. A group has one teacher at a time, so the
newest announcement (the last in the queue's insertion order) is the incarnation serving the
group, and every older one is gone: a trainer that waits for results lists the announcements and
asks the newest again for what an older one held leased (services/trainer/teacher_client.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from services.protocol.names import meta_partition


def _prefix(group: int, teacher: int) -> str:
    if teacher < 0:
        raise ValueError(f"teacher={teacher}: teachers count from 0")
    return f"teacher{group}/" if teacher == 0 else f"t{teacher}.teacher{group}/"


def announce_teacher(
    client: Any, partition: str, group: int, instance: str, teacher: int = 0
) -> None:
    """Tell the trainers that teacher ``instance`` serves ``group`` from now on.

    Args:
        client: a QueueClient.
        partition: the run's sample partition.
        group: the teacher group.
        instance: the teacher's process-instance id (``names.new_instance``).
        teacher: the run's teacher it is a group of (0: the first).
    """
    client.put(
        meta_partition(partition),
        [_prefix(group, teacher) + instance],
        {"pid": torch.tensor([[os.getpid()]], dtype=torch.int64)},
    )


def teacher_incarnations(client: Any, partition: str, group: int, teacher: int = 0) -> list[str]:
    """The teachers that announced themselves for ``group``, oldest first (the last serves).

    Args:
        client: a QueueClient.
        partition: the run's sample partition.
        group: the teacher group.
        teacher: the run's teacher whose group it is (0: the first).

    Returns:
        Their instance ids in announcement order ([] before the first).
    """
    prefix = _prefix(group, teacher)
    keys = client.list(meta_partition(partition)).get("keys", [])
    return [k[len(prefix) :] for k in keys if k.startswith(prefix)]
