"""Trainer-side consumer: a background thread claims ahead and yields padded batches with leases.

Batches are padded by ``xtoken_core.data.batch.pad_batch``: fields of the sample schema with the
schema's pad values (chunk ids -1, masks False, ids the given pad ids), other jagged fields with
0 unless ``pad_values`` says otherwise.

Usage::

    with BatchConsumer(address, "train", "trainer", ["input_ids"], batch_size=8,
                       student_pad_id=tokenizer.pad_id) as consumer:
        for batch, lease in consumer:
            step(batch)
            consumer.ack(lease)

With ``as_tensordict=True`` (as the clients' claim and get) a batch is a TensorDict ``[B]``: the
same padded tensors and ``_lengths``, and non-tensor fields of a TensorDict put (NonTensorStack,
NonTensorData) as they were put, not as bytes.

The thread owns its own DEALER socket (zmq sockets are not thread-safe); acks go through a
second client owned by the iterating thread. Leases that were claimed ahead but never yielded
are given back (nack) when the consumer stops.

Server restarts: every lease carries the server instance (``epoch``) that issued it. When a claim
reply shows a new instance, batches claimed ahead from the old one are dropped, not yielded
(``dropped_leases``): their leases died with that instance, and the producers re-put what the
new instance lacks. A batch yielded before the restart cannot be acked: ``ack`` raises
``StaleEpochError`` (its samples may come again).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from services.queue import errors as codes
from services.queue.client import QueueClient
from services.queue.errors import QueueError
from xtoken_core.data.batch import pad_batch
from xtoken_core.wire import JaggedColumn

logger = logging.getLogger(__name__)

_END = object()
# Seconds a batch give-back (nack) may take while stopping.
_GIVE_BACK_S = 1.0
# Most seconds stop() waits for the thread's claim in flight before abandoning it.
_ABANDON_AFTER_S = 3.0


@dataclass(frozen=True)
class Lease:
    """The lease of one yielded batch: ack it after the step (or nack it to give it back).

    Attributes:
        partition, task: where it was claimed.
        lease_id: the server's lease id.
        keys: the B sample keys, in batch order.
        epoch: the server instance that issued the lease (None: unknown).
    """

    partition: str
    task: str
    lease_id: int | str
    keys: list[str]
    epoch: str | None = None


def _with_lengths(fields: Mapping[str, Any], batch: dict[str, torch.Tensor]) -> None:
    """Add ``f + "_lengths"`` [B] int64 for each jagged field ``f`` unless the claim has one."""
    for name, value in fields.items():
        if isinstance(value, JaggedColumn) and f"{name}_lengths" not in fields:
            batch[f"{name}_lengths"] = value.lengths()


class BatchConsumer:
    """Iterate padded batches claimed from a queue, ``prefetch`` claims ahead.

    Args:
        queue: server address, or a QueueClient (used for acks; the thread opens its own socket
            to the same address with the same timeout).
        partition: partition to claim from.
        task: consumer task name (consumption is tracked per task).
        required_fields: a sample is claimable once it has all of these.
        batch_size: most samples per batch.
        pad_values: pad values that replace the schema's (fields of the sample schema) or the
            0 of other jagged fields, by field name. Each jagged field ``f`` also yields
            ``f + "_lengths"`` [B] int64 unless the batch has a field of that name.
        prefetch: batches claimed ahead of the one being consumed (>= 1).
        fields: fields to return (default ``required_fields``).
        lease_s: lease length; a batch not acked by then is redelivered.
        claim_timeout_s: how long one claim waits on the server for data.
        idle_timeout_s: stop iterating after this long without data (None: run until ``stop``).
        shm: claim through the server's shared-memory pool when it is on this host: fields
            stored there arrive as views (no bytes through the socket) and are copied once,
            into the padded batch. Assumes no one clears samples while they are leased (the
            views contract, services/queue/shm_transport.py).
        student_pad_id: pad id of ``input_ids`` (the student tokenizer's).
        teacher_pad_id: pad id of ``teacher_input_ids`` (the teacher tokenizer's).
        register: register ``task`` for the partition on the first claim (retention): the
            server drops each sample once every registered task acked it. For a partition
            read once; never for one read again (epochs).
        as_tensordict: yield each batch as a TensorDict ``[B]`` (padded tensors, ``_lengths``,
            non-tensor fields as NonTensorStack / NonTensorData), not a dict.

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
        student_pad_id: int = 0,
        teacher_pad_id: int = 0,
        register: bool = False,
        as_tensordict: bool = False,
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
        self.student_pad_id = int(student_pad_id)
        self.teacher_pad_id = int(teacher_pad_id)
        self.lease_s = lease_s
        self.claim_timeout_s = claim_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.shm = shm
        self.register = register
        self.as_tensordict = as_tensordict
        self._ready: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._gave_up = False  # a give-back failed while stopping: try no more
        self._abandon = threading.Event()  # set by stop() when the queue does not answer
        self._thread = threading.Thread(target=self._run, name=f"consumer-{task}", daemon=True)
        self._last: Lease | None = None
        self._epoch: str | None = None  # the server instance of the latest claim reply
        self.dropped_leases = 0  # batches claimed ahead from an instance that restarted
        self._started = False
        self._finished = False

    # ---------------------------------------------------------------- iteration

    def __iter__(self) -> BatchConsumer:
        if not self._started:
            self._started = True
            self._thread.start()
        return self

    def __next__(self) -> tuple[Any, Lease]:
        if self._finished:
            raise StopIteration
        while True:
            item = self._ready.get()
            if item is _END:
                self._finished = True
                raise StopIteration
            if isinstance(item, BaseException):
                self._finished = True
                raise item
            batch, lease = item
            if lease.epoch is not None and self._epoch is not None and lease.epoch != self._epoch:
                self.dropped_leases += 1
                logger.warning(
                    "[consumer] dropped a batch of %d samples claimed from queue instance %s "
                    "(now %s): its lease died with the restart",
                    len(lease.keys),
                    lease.epoch,
                    self._epoch,
                )
                continue
            self._last = lease
            return batch, lease

    def ack(self, lease: Lease | None = None) -> int:
        """Mark a yielded batch consumed (default: the last one yielded).

        Returns:
            Number of samples acked.

        Raises:
            QueueError: ``unknown_lease`` when the lease expired first (its samples are
                redelivered: raise ``lease_s``).
            StaleEpochError: the server restarted since the claim (the samples were not acked).
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
        """Stop the thread, give back batches claimed but not yielded, close owned sockets.

        Returns within ~4 s whatever the queue does (a dead queue included): the thread's
        claim in flight is answered by a live queue within its ``claim_timeout_s`` (and its
        batch given back), and abandoned after at most 3 s; giving batches back (a courtesy:
        their leases lapse anyway) is tried with a 1 s timeout and given up after the first
        failure.
        """
        self._stop.set()
        abandon_at = time.monotonic() + min(self.claim_timeout_s + 0.5, _ABANDON_AFTER_S)
        give_back = QueueClient(
            self._client.address, timeout_s=_GIVE_BACK_S, retries=0, name="consumer-stop"
        )
        try:
            while self._thread.is_alive():
                self._drain_and_nack(give_back)
                self._thread.join(0.05)
                if time.monotonic() >= abandon_at:
                    self._abandon.set()
            self._drain_and_nack(give_back)
        finally:
            give_back.close()
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> BatchConsumer:
        return iter(self)

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- thread

    def _drain_and_nack(self, client: QueueClient) -> None:
        while True:
            try:
                item = self._ready.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple) and not self._gave_up:
                lease = item[1]
                try:
                    client.nack(lease.partition, lease.task, lease.lease_id)
                except QueueError as e:
                    self._gave_up = True  # the queue is gone or slow: the leases lapse anyway
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

    def _batch(self, fields: Any, client: QueueClient) -> Any:
        """The padded batch of a claim's fields (a TensorDict [B] from an ``as_tensordict``
        claim), private copies where the claim viewed the shared-memory pool."""
        if self.as_tensordict:
            return self._tensordict_batch(fields, client)
        batch = pad_batch(
            fields,
            student_pad_id=self.student_pad_id,
            teacher_pad_id=self.teacher_pad_id,
            pad_values=self.pad_values,
        )
        _with_lengths(fields, batch)
        if self.shm:  # padded fields are new tensors; dense ones may view the pool
            batch = client._shm.private(batch)
        return batch

    def _tensordict_batch(self, td: Any, client: QueueClient) -> Any:
        from tensordict import NonTensorData, NonTensorStack, TensorDict

        from xtoken_core.data_plane.tensordict_io import materialize

        objects = {
            name: td.get(name)
            for name in td.keys()
            if isinstance(td.get(name), NonTensorData | NonTensorStack)
        }
        padded = materialize(
            td,
            "padded",
            student_pad_id=self.student_pad_id,
            teacher_pad_id=self.teacher_pad_id,
            pad_values=self.pad_values,
        )
        tensors = {name: value for name, value in padded.items() if name not in objects}
        for name in list(tensors):
            value = td.get(name)
            if value.is_nested and f"{name}_lengths" not in td.keys():
                tensors[f"{name}_lengths"] = value.offsets().diff()
        if self.shm:  # as in _batch
            tensors = client._shm.private(tensors)
        batch = TensorDict(tensors, batch_size=td.batch_size)
        for name, value in objects.items():
            batch.set(name, value)
        return batch

    def _run(self) -> None:
        client = QueueClient(
            self._client.address,
            timeout_s=self._client.timeout_s,
            retries=self._client.retries,
            limits=self._client.limits,
            name=f"{self._client.name}-prefetch",
            shm=self._client._shm.mode,
            stop=self._abandon,  # stop() abandons a claim the queue does not answer
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
                    register=self.register,
                    as_tensordict=self.as_tensordict,
                )
                self._epoch = client.epoch
                if not got["keys"]:
                    idle += self.claim_timeout_s
                    if self.idle_timeout_s is not None and idle >= self.idle_timeout_s:
                        break
                    continue
                idle = 0.0
                lease = Lease(
                    self.partition, self.task, got["lease_id"], list(got["keys"]), got.get("epoch")
                )
                batch = self._batch(got["fields"], client)
                if not self._put((batch, lease)):
                    client.nack(lease.partition, lease.task, lease.lease_id)
                    break
        except QueueError as e:
            if e.code != codes.STOPPED:
                logger.exception("consumer thread failed")
                self._put(e)
        except BaseException as e:  # surfaced to the iterating thread
            logger.exception("consumer thread failed")
            self._put(e)
        finally:
            client.close()
        self._put(_END)
