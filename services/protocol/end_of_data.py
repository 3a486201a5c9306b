"""The end-of-data marker: the collators tell trainers how many samples a partition holds in all.

The marker is the record ``eof`` of ``<partition>.meta`` with one field ``samples`` (``[1, 1]``
int64). A trainer's epoch ends once the marker is there and every sample put was consumed.
"""

from __future__ import annotations

from typing import Any

import torch

from services.protocol.names import meta_partition

EOF_KEY = "eof"


def put_eof(client: Any, partition: str, samples: int) -> None:
    """Tell trainers the data of ``partition`` is complete: ``samples`` samples in all.

    Args:
        client: a QueueClient.
        partition: the sample partition.
        samples: how many samples were put into it.
    """
    client.put(meta_partition(partition), [EOF_KEY], eof_fields(samples))


def eof_fields(samples: int) -> dict[str, torch.Tensor]:
    """The fields of the marker record for ``samples`` samples."""
    return {"samples": torch.tensor([[int(samples)]], dtype=torch.int64)}


def eof_samples(fields: dict[str, Any]) -> int:
    """The sample count of a marker record's fields (a get of :data:`EOF_KEY`)."""
    return int(fields["samples"].reshape(-1)[0])
