"""A TransferQueue-style client over the xtoken queue: code written against TransferQueue's
``TransferQueueClient`` runs against an xtoken server with an import change.

    from services.queue.tq_client import TransferQueueClient   # was: from transfer_queue import
    client = TransferQueueClient("trainer", "tcp://127.0.0.1:5555")
    client.put(data=td, partition_id="train")                  # td: TensorDict [N]
    meta = client.get_meta(data_fields=["input_ids"], batch_size=8, partition_id="train",
                           task_name="actor")                  # samples now consumed by "actor"
    batch = client.get_data(meta)                              # TensorDict [meta.size]
    client.put(data=TensorDict({"logp": ...}, [meta.size]), metadata=meta)  # write-back
    client.clear_partition("train")

How the calls map onto the queue: a put without metadata stores N new samples under fresh keys
(the ``global_indexes`` of the returned ``BatchMeta``); a put with metadata adds fields to those
samples. ``get_meta`` is a claim of samples that carry every data field and the task has not
consumed, acked at once (TransferQueue marks them consumed when it hands out their metadata);
``get_data`` reads their fields by key. One server stores and serves, so there is no storage
manager to set up (``initialize_storage_manager`` is accepted and does nothing). Not carried
over: custom samplers (``sampling_config``), ``force_fetch``, the asyncio client.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.queue.client import QueueClient

DEFAULT_TASK = "default"


@dataclass
class BatchMeta:
    """Which samples of a partition a batch holds, and which of their fields.

    Attributes:
        partition_id: the partition.
        keys: the samples' keys, in batch order.
        fields: the data fields of the batch.
        task_name: the task that consumed them (``get_meta``), None after a put.
    """

    partition_id: str
    keys: list[str]
    fields: list[str] = field(default_factory=list)
    task_name: str | None = None

    @property
    def size(self) -> int:
        """Samples in the batch."""
        return len(self.keys)

    @property
    def global_indexes(self) -> list[str]:
        """The samples' keys (TransferQueue's global indexes)."""
        return list(self.keys)

    @property
    def field_names(self) -> list[str]:
        """The data fields of the batch."""
        return list(self.fields)

    @property
    def partition_ids(self) -> list[str]:
        """The partition of every sample."""
        return [self.partition_id] * len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)


class TransferQueueClient:
    """TransferQueue's client calls over one ``QueueClient`` (not thread-safe: one per thread).

    Args:
        client_id: this client's name (in the server's log, and the prefix of its new keys).
        controller_info: the queue's address (``tcp://host:port``, ``ipc://...``).
        get_timeout_s: how long ``get_meta`` waits for a ready sample before it returns an
            empty batch.
        **client_kwargs: passed to ``QueueClient`` (``timeout_s``, ``token``, ``shm``, ...).
    """

    def __init__(
        self,
        client_id: str,
        controller_info: str,
        *,
        get_timeout_s: float = 1.0,
        **client_kwargs: Any,
    ) -> None:
        if not isinstance(controller_info, str):
            raise TypeError(
                f"controller_info is a {type(controller_info).__name__}; give the xtoken queue's "
                "address, e.g. 'tcp://127.0.0.1:5555'"
            )
        self.client_id = client_id
        self.get_timeout_s = get_timeout_s
        self.client = QueueClient(controller_info, name=client_id, **client_kwargs)
        self._prefix = f"{client_id}-{os.urandom(4).hex()}-"
        self._ids = itertools.count()

    def initialize_storage_manager(self, manager_type: str = "", config: Any = None) -> None:
        """Accepted for TransferQueue code; the xtoken server stores the data itself."""

    def put(self, data: Any, metadata: BatchMeta | None = None, partition_id: str | None = None):
        """Write a TensorDict ``[N]``: new samples, or new fields of the samples of ``metadata``.

        Args:
            data: ``TensorDict`` with ``batch_size=[N]`` (dense, torch.jagged nested and
                non-tensor leaves).
            metadata: the batch the rows belong to, in order (from ``get_meta``); None stores
                N new samples in ``partition_id``.
            partition_id: the partition of new samples (needed without ``metadata``).

        Returns:
            ``BatchMeta`` of the written samples, its fields including the new ones.

        Raises:
            ValueError: no partition, or a batch size that is not ``metadata.size``.
            QueueError: the server refused the put (``queue_full`` after its wait, ...).
        """
        fields = list(data.keys())
        if metadata is None:
            if partition_id is None:
                raise ValueError("put needs partition_id when no metadata is given")
            n = int(data.batch_size[0]) if len(data.batch_size) else 0
            keys = [f"{self._prefix}{next(self._ids)}" for _ in range(n)]
            self.client.put(partition_id, keys, data)
            return BatchMeta(partition_id, keys, fields)
        self.client.put(metadata.partition_id, metadata.keys, data)
        merged = list(dict.fromkeys([*metadata.fields, *fields]))
        return BatchMeta(metadata.partition_id, list(metadata.keys), merged, metadata.task_name)

    def get_meta(
        self,
        data_fields: Sequence[str],
        batch_size: int,
        partition_id: str,
        mode: str = "fetch",
        task_name: str | None = None,
        sampling_config: dict[str, Any] | None = None,
    ) -> BatchMeta:
        """Take up to ``batch_size`` samples that carry every data field and that ``task_name``
        has not consumed, and mark them consumed by it.

        Args:
            data_fields: fields every sample must carry (and that ``get_data`` reads).
            batch_size: most samples.
            partition_id: the partition.
            mode: ``"fetch"`` (the only one).
            task_name: the consuming task (tasks consume independently; None: ``"default"``).
            sampling_config: must be None (no custom samplers).

        Returns:
            ``BatchMeta``; empty (size 0) when nothing was ready within ``get_timeout_s``.

        Raises:
            ValueError: another mode or a sampling config.
        """
        if mode != "fetch":
            raise ValueError(f"mode={mode!r}: this client fetches ready samples only ('fetch')")
        if sampling_config is not None:
            raise ValueError("sampling_config is not supported: samples come in put order")
        task = task_name or DEFAULT_TASK
        got = self.client.claim(
            partition_id,
            task,
            list(data_fields),
            batch_size,
            fields=[],
            timeout_s=self.get_timeout_s,
        )
        keys = list(got["keys"])
        if keys:
            self.client.ack(partition_id, task, got["lease_id"])
        return BatchMeta(partition_id, keys, list(data_fields), task)

    def get_data(self, metadata: BatchMeta) -> Any:
        """Read the fields of a batch: a ``TensorDict [metadata.size]`` in batch order, its jagged
        leaves viewing the received buffers."""
        if not metadata.keys or not metadata.fields:
            from tensordict import TensorDict

            return TensorDict({}, batch_size=[0])
        reply = self.client.get(
            metadata.partition_id, metadata.keys, metadata.fields, as_tensordict=True
        )
        return reply["fields"]

    def clear_partition(self, partition_id: str) -> None:
        """Remove every sample of a partition."""
        self.client.clear(partition_id)

    def clear_samples(self, metadata: BatchMeta) -> None:
        """Remove the samples of a batch."""
        if metadata.keys:
            self.client.clear(metadata.partition_id, metadata.keys)

    def check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        """Whether ``task_name`` consumed every sample the partition holds (and it holds any)."""
        status = self.client.status(partition_id, task_name)
        return status["samples"] > 0 and status["consumed"] >= status["samples"]

    def get_partition_list(self) -> list[str]:
        """The partitions the server holds."""
        return list(self.client.list()["partitions"])

    def close(self) -> None:
        """Close the connection."""
        self.client.close()

    def __enter__(self) -> TransferQueueClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
