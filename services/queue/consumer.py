"""Trainer-side consumer: a background thread claims ahead and yields padded batches with leases.

Legend: B samples in a batch, T the longest row of a jagged field in the batch, S the total rows
of a jagged field (its ``values`` leading dim), D trailing dims.

Usage::

    with BatchConsumer(address, "train", "trainer", ["input_ids"], batch_size=8,
                       pad_values={"input_ids": 0}) as consumer:
        for batch, lease in consumer:
            step(batch)
            consumer.ack(lease)

The thread owns its own DEALER socket (zmq sockets are not thread-safe); acks go through a
second client owned by the iterating thread. Leases that were claimed ahead but never yielded
are given back (nack) when the consumer stops.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from services.queue.client import QueueClient
from services.queue.errors import QueueError
from xtoken_core.wire import JaggedColumn

logger = logging.getLogger(__name__)

_END = object()


@dataclass(frozen=True)
class Lease:
    """The lease of one yielded batch: ack it after the step (or nack it to give it back).

    Attributes:
        partition, task: where it was claimed.
        lease_id: the server's lease id.
        keys: the B sample keys, in batch order.
    """

    partition: str
    task: str
    lease_id: int | str
    keys: list[str]


def pad_jagged(
    column: JaggedColumn, pad_value: float | int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad a jagged column to a dense tensor (vectorized, one scatter).

    Args:
        column: B rows, values [S, *D], offsets [B+1].
        pad_value: value of the padding positions.

    Returns:
        ``(padded_BTD [B, T, *D], lengths_B [B] int64)`` with T the longest row (0 if none).
    """
    offsets_B1 = column.offsets
    lengths_B = offsets_B1[1:] - offsets_B1[:-1]
    b = int(lengths_B.numel())
    t = int(lengths_B.max()) if b else 0
    values_SD = column.values
    padded_BTD = torch.full((b, t, *values_SD.shape[1:]), pad_value, dtype=values_SD.dtype)
    s = int(values_SD.shape[0])
    if s:
        row_S = torch.repeat_interleave(torch.arange(b), lengths_B, output_size=s)
        pos_S = torch.arange(s) - offsets_B1[:-1][row_S]
        padded_BTD[row_S, pos_S] = values_SD
    return padded_BTD, lengths_B


def pad_fields(
    fields: Mapping[str, Any], pad_values: Mapping[str, float | int] | None = None
) -> dict[str, torch.Tensor]:
    """Materialize a claimed batch: jagged fields padded, dense fields as they are.

    Args:
        fields: name -> JaggedColumn of B rows or dense tensor [B, ...].
        pad_values: name -> pad value of a jagged field (default 0).

    Returns:
        name -> tensor; each jagged field ``f`` also adds ``f + "_lengths"`` [B] int64 unless
        the batch already has a field of that name.
    """
    pad_values = pad_values or {}
    out: dict[str, torch.Tensor] = {}
    for name, value in fields.items():
        if isinstance(value, JaggedColumn):
            padded, lengths = pad_jagged(value, pad_values.get(name, 0))
            out[name] = padded
            if f"{name}_lengths" not in fields:
                out[f"{name}_lengths"] = lengths
        else:
            out[name] = value
    return out


class BatchConsumer:
    """Iterate padded batches claimed from a queue, ``prefetch`` claims ahead.

    Args:
        queue: server address, or a QueueClient (used for acks; the thread opens its own socket
            to the same address with the same timeout).
        partition: partition to claim from.
        task: consumer task name (consumption is tracked per task).
        required_fields: a sample is claimable once it has all of these.
        batch_size: most samples per batch.
        pad_values: pad value per jagged field (default 0).
        prefetch: batches claimed ahead of the one being consumed (>= 1).
        fields: fields to return (default ``required_fields``).
        lease_s: lease length; a batch not acked by then is redelivered.
        claim_timeout_s: how long one claim waits on the server for data.
        idle_timeout_s: stop iterating after this long without data (None: run until ``stop``).
        shm: claim through the server's shared-memory pool when it is on this host: fields
            stored there arrive as views (no bytes through the socket) and are copied once,
            into the padded batch. Assumes no one clears samples while they are leased (the
            views contract, services/queue/shm_transport.py).

    Raises:
        ValueError: a bad batch size, prefetch or claim timeout.
    """

    def __init__(
        self,
        queue_or_address: QueueClient | str,
        partition: str,
        task: str,
        required_fields: Sequence[str],
        batch_size: int,
        pad_values: Mapping[str, float | int] | None = None,
        prefetch: int = 2,
        *,
        fields: Sequence[str] | None = None,
        lease_s: float = 60.0,
        claim_timeout_s: float = 1.0,
        idle_timeout_s: float | None = None,
        shm: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be >= 1")
        if prefetch < 1:
            raise ValueError(f"prefetch={prefetch}: must be >= 1 (batches claimed ahead)")
        if claim_timeout_s <= 0:
            raise ValueError(f"claim_timeout_s={claim_timeout_s}: must be > 0 (server-side wait)")
        if isinstance(queue_or_address, QueueClient):
            self._client = queue_or_address
            self._owns_client = False
        else:
            self._client = QueueClient(queue_or_address)
            self._owns_client = True
        self.partition = partition
        self.task = task
        self.required_fields = list(required_fields)
        self.fields = list(fields) if fields is not None else None
        self.batch_size = batch_size
        self.pad_values = dict(pad_values or {})
        self.lease_s = lease_s
        self.claim_timeout_s = claim_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.shm = shm
        self._ready: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"consumer-{task}", daemon=True)
        self._last: Lease | None = None
        self._started = False
        self._finished = False

    # ---------------------------------------------------------------- iteration

    def __iter__(self) -> BatchConsumer:
        if not self._started:
            self._started = True
            self._thread.start()
        return self

    def __next__(self) -> tuple[dict[str, torch.Tensor], Lease]:
        if self._finished:
            raise StopIteration
        item = self._ready.get()
        if item is _END:
            self._finished = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._finished = True
            raise item
        batch, lease = item
        self._last = lease
        return batch, lease

    def ack(self, lease: Lease | None = None) -> int:
        """Mark a yielded batch consumed (default: the last one yielded).

        Returns:
            Number of samples acked.

        Raises:
            QueueError: ``unknown_lease`` when the lease expired first (its samples are
                redelivered: raise ``lease_s``).
        """
        lease = lease or self._last
        if lease is None:
            raise ValueError("ack() before any batch was yielded; pass the lease to ack")
        return int(self._client.ack(lease.partition, lease.task, lease.lease_id)["count"])

    def nack(self, lease: Lease | None = None) -> int:
        """Give a yielded batch back for redelivery (default: the last one yielded)."""
        lease = lease or self._last
        if lease is None:
            raise ValueError("nack() before any batch was yielded; pass the lease to nack")
        return int(self._client.nack(lease.partition, lease.task, lease.lease_id)["count"])

    def stop(self) -> None:
        """Stop the thread, give back batches claimed but not yielded, close owned sockets."""
        self._stop.set()
        while self._thread.is_alive():
            self._drain_and_nack()
            self._thread.join(0.05)
        self._drain_and_nack()
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> BatchConsumer:
        return iter(self)

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- thread

    def _drain_and_nack(self) -> None:
        while True:
            try:
                item = self._ready.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple):
                lease = item[1]
                try:
                    self._client.nack(lease.partition, lease.task, lease.lease_id)
                except QueueError as e:
                    logger.warning("could not give back lease %s: %s", lease.lease_id, e)

    def _put(self, item: Any) -> bool:
        """Hand an item to the iterator, unless stopping (returns False then)."""
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        client = QueueClient(
            self._client.address,
            timeout_s=self._client.timeout_s,
            retries=self._client.retries,
            limits=self._client.limits,
            name=f"{self._client.name}-prefetch",
            shm=self._client._shm.mode,
        )
        idle = 0.0
        try:
            while not self._stop.is_set():
                got = client.claim(
                    self.partition,
                    self.task,
                    self.required_fields,
                    self.batch_size,
                    fields=self.fields,
                    timeout_s=self.claim_timeout_s,
                    lease_s=self.lease_s,
                    shm=self.shm,
                )
                if not got["keys"]:
                    idle += self.claim_timeout_s
                    if self.idle_timeout_s is not None and idle >= self.idle_timeout_s:
                        break
                    continue
                idle = 0.0
                lease = Lease(self.partition, self.task, got["lease_id"], list(got["keys"]))
                batch = pad_fields(got["fields"], self.pad_values)
                if self.shm:  # padded fields are new tensors; dense ones may view the pool
                    batch = client._shm.private(batch)
                if not self._put((batch, lease)):
                    client.nack(lease.partition, lease.task, lease.lease_id)
                    break
        except BaseException as e:  # surfaced to the iterating thread
            logger.exception("consumer thread failed")
            self._put(e)
        finally:
            client.close()
        self._put(_END)
