"""The transfer-queue sample store: partitions, keys, fields, task leases, capacity (no sockets).

Legend: N samples in a request, R rows of a stored block, L tokens in one sample, S the total
tokens of a jagged field over its rows (its ``values`` leading dimension).

A put of N samples keeps each field as ONE block: a jagged ``values[S, ...] + offsets[N+1]``
pair or a dense ``tensor[N, ...]``, usually views into the received wire buffers (zero-copy). A
sample is a small dict ``field -> (block, row)``; reads of consecutive rows of one block are
slices (zero-copy), other reads gather run by run, never one tensor op per sample when rows are
contiguous. Memory is accounted per underlying storage (what is really kept alive), not per
view, so ``bytes_used`` is honest when a block is shared or partly cleared; blocks that fall
below half live are compacted.

Retention: a task registered for a partition (``register``, or ``claim(..., register=True)``)
holds its samples; once every registered task acked a sample, the sample is dropped as by a
``clear`` and its key becomes a tombstone (tombstones.py): a later put of that key is refused
as ``consumed``, not stored again. A partition without registered tasks keeps every sample until
it is cleared (a trainer reads it once per epoch).

The store is single-threaded by design: the server's event loop owns it. Time comes from an
injectable ``clock`` so that lease expiry is testable without sleeping.
"""

from __future__ import annotations

import collections
import heapq
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from services.queue.blocks import (
    COMPACT_BELOW,
    Block,
    Check,
    FieldValue,
    Locate,
    WireValue,
    as_field,
    assemble,
    assemble_shm,
    assemble_wire,
    check_cells,
    copy_rows,
    gather_rows,
    schema_of,
)
from services.queue.config import format_size
from services.queue.errors import StoreError
from services.queue.tombstones import DEFAULT_MAX_KEYS, KeyTombstones
from xtoken_core.wire.tensors import JaggedColumn

logger = logging.getLogger(__name__)

# Tombstones in a partition's insertion order list before it is rebuilt.
ORDER_COMPACT_MIN = 1024


@dataclass
class _Task:
    consumed: set[str] = field(default_factory=set)
    leased: dict[str, int] = field(default_factory=dict)  # key -> lease id
    watermark: int = 0  # every order position below it is consumed or cleared


@dataclass
class _Lease:
    lease_id: str
    partition: str
    task: str
    keys: set[str]
    deadline: float
    owner: str | None = None  # the claiming client instance; None: anyone may ack


@dataclass
class _Partition:
    samples: dict[str, dict[str, tuple[Block, int]]] = field(default_factory=dict)
    order: list[str | None] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)
    tombstones: int = 0
    blocks: set[Block] = field(default_factory=set)
    schema: dict[str, tuple[bool, torch.dtype, tuple[int, ...]]] = field(default_factory=dict)
    tasks: dict[str, _Task] = field(default_factory=dict)
    registered: set[str] = field(default_factory=set)  # tasks that hold samples (retention)
    retired: KeyTombstones | None = None  # keys dropped after every registered task consumed
    dropped: int = 0  # samples dropped by retention


def too_large_message(nbytes: int, samples: int, capacity_bytes: int) -> str:
    """Why a put of ``samples`` samples and ``nbytes`` bytes can never fit, and the fix, in
    human sizes: ``--capacity`` of the queue server, or fewer samples per put when one would do.
    """
    size, capacity = format_size(nbytes), format_size(capacity_bytes)
    per_sample = nbytes / max(samples, 1)
    if samples == 1:
        what = f"a sample of {size}"
    else:
        what = f"a put of {samples} samples ({size}, {format_size(per_sample)} a sample on average)"
    if samples > 1 and per_sample <= capacity_bytes:
        fix = (
            "put fewer samples at a time, or restart the queue server with a larger --capacity "
            f"(more than {size})"
        )
    else:
        fix = (
            "restart the queue server with a larger --capacity "
            f"(more than {format_size(per_sample)} a sample)"
        )
    return f"{what} is larger than the whole queue capacity ({capacity}): {fix}"


def _main_storage(block: Block) -> tuple[int, int]:
    """The largest buffer a block views (its values; a shared-memory put's segment)."""
    return max(block.storages, key=lambda sid: sid[1])


@dataclass(frozen=True)
class PutResult:
    """Outcome of a put.

    Attributes:
        blocked: the put does not fit in the free capacity now; nothing was stored.
        stored: new (key, field) cells written.
        duplicates: (key, field) cells that already existed and were left as they were.
        new_samples: keys that did not exist before.
        nbytes: bytes this put added to ``bytes_used`` (or would add, when blocked).
        consumed: keys refused because every registered task already consumed them (and the
            partition dropped them): a producer counts them as done, not as an error.
    """

    blocked: bool
    stored: int = 0
    duplicates: int = 0
    new_samples: int = 0
    nbytes: int = 0
    consumed: int = 0


@dataclass(frozen=True)
class Batch:
    """Samples read from the store: ``fields[name]`` has one row per key, in ``keys`` order.

    Attributes:
        keys: N keys.
        fields: name -> dense tensor [N, ...] or JaggedColumn of N rows (RawTensor / RawJagged
            bytes for ``wire=True`` reads).
        lease_id: set for claims, None for gets.
        nbytes: bytes of the rows returned.
    """

    keys: list[str]
    fields: dict[str, FieldValue | WireValue]
    lease_id: str | None = None
    nbytes: int = 0


class _Rate:
    """Samples and bytes per second over a sliding window."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.events: collections.deque[tuple[float, int, int]] = collections.deque()

    def add(self, now: float, samples: int, nbytes: int) -> None:
        self.events.append((now, samples, nbytes))
        self._prune(now)

    def _prune(self, now: float) -> None:
        while self.events and self.events[0][0] < now - self.window_s:
            self.events.popleft()

    def rates(self, now: float, started: float) -> tuple[float, float]:
        self._prune(now)
        span = max(min(self.window_s, now - started), 1e-3)
        return (sum(e[1] for e in self.events) / span, sum(e[2] for e in self.events) / span)


class SampleStore:
    """Partitions of keyed samples with per-task leases and byte capacity.

    Args:
        capacity_bytes: limit on ``bytes_used`` plus ``held()``; puts beyond it are blocked
            (back-pressure).
        clock: monotonic seconds; injectable for tests.
        rate_window_s: window of the put/claim rates in ``stats``.
        held: bytes held for the queue outside the store (a shared-memory pool's reserved and
            free segments), counted against the capacity.
        trim: give back up to n held bytes that are only a cache (free pool segments) when a
            put needs room; returns the bytes given back.
        on_release: called with a storage's data pointer when the store drops its last view
            of it (a pool takes its segment back).
        tombstone_max_keys: most consumed keys remembered per partition (8 bytes each).
        check: called with ``(storage data pointer, first byte, end byte)`` before rows are
            read from that storage (a get, a claim, a compaction's copy); raises a StoreError
            to refuse the read (a pool whose file was changed: ``TamperedError``).

    Raises:
        ValueError: capacity_bytes is not positive.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        rate_window_s: float = 10.0,
        held: Callable[[], int] | None = None,
        trim: Callable[[int], int] | None = None,
        on_release: Callable[[int], None] | None = None,
        tombstone_max_keys: int = DEFAULT_MAX_KEYS,
        check: Check | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes={capacity_bytes} must be > 0; pass e.g. 8GiB")
        self.capacity_bytes = int(capacity_bytes)
        self.clock = clock
        self._parts: dict[str, _Partition] = {}
        self._storages: dict[tuple[int, int], int] = {}  # storage id -> blocks referencing it
        self._live: dict[tuple[int, int], int] = {}  # storage id -> live row bytes viewing it
        self.bytes_used = 0
        self._leases: dict[int, _Lease] = {}
        self._lease_heap: list[tuple[float, str]] = []
        self._started = clock()
        self._put_rate = _Rate(rate_window_s)
        self._claim_rate = _Rate(rate_window_s)
        self._held = held or (lambda: 0)
        self._trim = trim
        self._on_release = on_release
        self._check = check
        self.tombstone_max_keys = int(tombstone_max_keys)

    def room(self) -> int:
        """Capacity bytes neither stored nor held outside the store."""
        return self.capacity_bytes - self.bytes_used - self._held()

    def _fits(self, added: int) -> bool:
        short = added - self.room()
        if short > 0 and self._trim is not None:
            self._trim(short)
            short = added - self.room()
        return short <= 0

    def holds_storage(self, ptr: int, nbytes: int) -> bool:
        """Whether a stored block still views the storage of ``nbytes`` at data pointer ``ptr``."""
        return (ptr, nbytes) in self._storages

    # ---------------------------------------------------------------- KV calls

    def put(
        self,
        partition: str,
        keys: Sequence[str],
        fields: Mapping[str, object],
        *,
        prepaid: int = 0,
    ) -> PutResult:
        """Store fields of N samples; existing (key, field) cells are kept (idempotent).

        Args:
            partition: partition name (created on first put).
            keys: N unique keys.
            fields: name -> dense tensor [N, ...] or jagged (nested tensor or JaggedColumn) of N rows.
            prepaid: bytes of this put already counted in ``held()`` (its shared-memory
                segment, reserved before the put): not counted twice when checking room.

        Returns:
            PutResult; ``blocked`` means it does not fit now and nothing was stored.

        Raises:
            StoreError: ``bad_request`` for malformed input; ``queue_full`` (not retryable) when
                the put alone is larger than the whole capacity.
        """
        keys = list(keys)
        n = len(keys)
        if not partition or not isinstance(partition, str):
            raise StoreError("bad_request", f"partition={partition!r} must be a non-empty string")
        if len(set(keys)) != n:
            dup = [k for k, c in collections.Counter(keys).items() if c > 1][:3]
            raise StoreError("bad_request", f"put has duplicate keys {dup}; keys must be unique")
        if not fields:
            raise StoreError("bad_request", "put has no fields; send at least one field")
        norm = {name: as_field(name, value, n) for name, value in fields.items()}
        part = self._parts.get(partition)
        consumed = 0
        if part is not None and part.retired is not None:
            gone = part.retired.contains(keys)
            consumed = sum(gone)
            if consumed == n:
                return PutResult(blocked=False, consumed=consumed)
            if consumed:
                rows = [i for i, g in enumerate(gone) if not g]
                keys = [keys[i] for i in rows]
                n = len(keys)
                norm = {name: gather_rows(value, rows) for name, value in norm.items()}
        samples = part.samples if part is not None else {}
        if part is not None:
            self._check_schema(part, norm)
        # Which cells are new: field -> rows to keep. Fast path: none of the keys exist yet.
        all_new = samples.keys().isdisjoint(keys)
        new_rows: dict[str, list[int] | None] = {}
        duplicates = 0
        for name in norm:
            if all_new:
                new_rows[name] = None  # every row
                continue
            rows = []
            for i, k in enumerate(keys):
                s = samples.get(k)
                if s is not None and name in s:
                    duplicates += 1
                else:
                    rows.append(i)
            if rows:
                new_rows[name] = rows if len(rows) != n else None
        blocks: list[Block] = []
        for name, rows in new_rows.items():
            value = norm[name]
            if rows is not None:
                value = gather_rows(value, rows)
                bkeys = [keys[i] for i in rows]
            else:
                bkeys = keys
            blocks.append(Block(partition, name, value, bkeys))
        # The fields of one shared-memory put share one segment: judge how much of a buffer is
        # live over all the blocks that view it.
        live: collections.Counter[tuple[int, int]] = collections.Counter()
        for block in blocks:
            for sid in block.storages:
                live[sid] += block.live_bytes
        for i, block in enumerate(blocks):
            sid = _main_storage(block)
            if self._live.get(sid, 0) + live[sid] < COMPACT_BELOW * sid[1]:
                # A small slice of a big buffer: keep a copy, not the whole buffer.
                value = JaggedColumn(block.values, block.offsets) if block.jagged else block.values
                blocks[i] = Block(partition, block.field, copy_rows(value), block.keys)
        added = self._added_bytes(blocks)
        if added > self.capacity_bytes:
            raise StoreError(
                "queue_full", too_large_message(added, n, self.capacity_bytes), retryable=False
            )
        if added and not self._fits(added - prepaid):
            return PutResult(blocked=True, nbytes=added, consumed=consumed)
        if part is None:
            part = self._parts[partition] = _Partition()
            self._check_schema(part, norm)
        for name, value in norm.items():
            part.schema.setdefault(name, schema_of(value))
        fresh = keys if all_new else [k for k in keys if k not in part.samples]
        if fresh:
            start = len(part.order)
            part.samples.update({k: {} for k in fresh})
            part.index.update(zip(fresh, range(start, start + len(fresh))))
            part.order.extend(fresh)
        new_samples = len(fresh)
        stored = 0
        samples = part.samples
        for block in blocks:
            self._add_block(part, block)
            name = block.field
            for r, k in enumerate(block.keys):
                samples[k][name] = (block, r)
            stored += len(block.keys)
        self._put_rate.add(self.clock(), new_samples, added)
        return PutResult(
            blocked=False,
            stored=stored,
            duplicates=duplicates,
            new_samples=new_samples,
            nbytes=added,
            consumed=consumed,
        )

    def get(
        self,
        partition: str,
        keys: Sequence[str],
        fields: Sequence[str] | None = None,
        *,
        wire: bool = False,
        shm: Locate | None = None,
    ) -> Batch:
        """Read fields of samples by key.

        Args:
            partition: partition name.
            keys: N keys, each must exist.
            fields: names to read; None reads the fields every one of the samples has.
            wire: return fields as RawJagged / RawTensor bytes (what a reply encodes without
                touching torch) instead of tensors.
            shm: with ``wire``, fields stored in shared memory (where ``shm`` locates them)
                are returned as ``ShmField`` references when their rows are one run.

        Returns:
            Batch with one row per key for every field.

        Raises:
            StoreError: ``not_found`` for a missing partition or key, ``missing_field`` when a
                sample lacks a requested field.
        """
        part = self._part(partition)
        keys = list(keys)
        missing = [k for k in keys if k not in part.samples]
        if missing:
            gone = sum(part.retired.contains(missing)) if part.retired is not None else 0
            why = (
                f"; {gone} of them were consumed by every registered task and dropped"
                if gone
                else ""
            )
            raise StoreError(
                "not_found",
                f"keys {missing[:5]} are not in partition {partition!r} "
                f"({len(missing)} missing{why})",
            )
        return self._read(part, partition, keys, fields, wire, shm)

    def clear(self, partition: str, keys: Sequence[str] | None = None) -> int:
        """Remove samples (all of the partition when ``keys`` is None); frees their bytes.

        Clearing a whole partition also forgets its registered tasks and its tombstones; a
        clear of keys leaves no tombstone (the keys may be put again).

        Args:
            partition: partition name; a missing partition clears nothing.
            keys: keys to remove; unknown keys are ignored (clear is idempotent).

        Returns:
            Number of samples removed.
        """
        part = self._parts.get(partition)
        if part is None:
            return 0
        if keys is None:
            removed = len(part.samples)
            for block in list(part.blocks):
                self._drop_block(part, block)
            for lease in [le for le in self._leases.values() if le.partition == partition]:
                del self._leases[lease.lease_id]
            del self._parts[partition]
            return removed
        removed = 0
        touched: set[Block] = set()
        for k in keys:
            sample = part.samples.pop(k, None)
            if sample is None:
                continue
            removed += 1
            pos = part.index.pop(k)
            part.order[pos] = None
            part.tombstones += 1
            for block, r in sample.values():
                block.keys[r] = None
                block.live -= 1
                block.live_bytes -= block.row_nbytes[r]
                for sid in block.storages:
                    self._live[sid] -= block.row_nbytes[r]
                touched.add(block)
            for task in part.tasks.values():
                task.consumed.discard(k)
                lease_id = task.leased.pop(k, None)
                if lease_id is not None and lease_id in self._leases:
                    self._leases[lease_id].keys.discard(k)
        for block in touched:
            if block.live == 0:
                self._drop_block(part, block)
        for block in touched:
            if block.live and block in part.blocks and self._sparse(block):
                self._compact_block(part, block)
        if part.tombstones >= ORDER_COMPACT_MIN and part.tombstones * 2 > len(part.order):
            part.order = [k for k in part.order if k is not None]
            part.index = {k: i for i, k in enumerate(part.order)}
            part.tombstones = 0
            for task in part.tasks.values():
                task.watermark = 0
        return removed

    def list(self, partition: str | None = None) -> dict:
        """List partitions (``partition`` None) or the keys of one partition.

        Args:
            partition: partition name or None.

        Returns:
            ``{"partitions": {name: samples}}`` or ``{"partition", "keys", "fields"}`` with keys
            in insertion order and the field names present in any sample.
        """
        if partition is None:
            return {"partitions": {p: len(part.samples) for p, part in self._parts.items()}}
        part = self._parts.get(partition)
        if part is None:
            return {"partition": partition, "keys": [], "fields": []}
        return {
            "partition": partition,
            "keys": [k for k in part.order if k is not None],
            "fields": sorted(part.schema),
        }

    # ---------------------------------------------------------------- task calls

    def claim(
        self,
        partition: str,
        task: str,
        required_fields: Sequence[str],
        batch_size: int,
        lease_s: float,
        fields: Sequence[str] | None = None,
        *,
        wire: bool = False,
        shm: Locate | None = None,
        register: bool = False,
        owner: str | None = None,
    ) -> Batch | None:
        """Lease up to ``batch_size`` samples that have every required field and that ``task``
        has neither consumed nor leased, in insertion order.

        Args:
            partition: partition name (a missing one has nothing ready).
            task: consumer task name; tasks consume independently.
            required_fields: fields a sample must have to be claimable.
            batch_size: most samples to return (>= 1).
            lease_s: seconds before unacked samples become claimable again.
            fields: fields to return; None returns ``required_fields``.
            wire: return fields as wire bytes, as for ``get``.
            shm: shared-memory references, as for ``get``.
            register: register ``task`` for the partition first (``register``).
            owner: the claiming client's instance: an ``ack``/``nack`` that names another
                owner is refused (``not_owner``); None binds the lease to nobody.

        Returns:
            A Batch with a ``lease_id`` (32 random hex digits), or None when nothing is ready.

        Raises:
            StoreError: ``bad_request`` for a bad batch size or lease.
        """
        if batch_size < 1:
            raise StoreError("bad_request", f"batch_size={batch_size} must be >= 1")
        if not lease_s > 0:
            raise StoreError("bad_request", f"lease={lease_s}s must be > 0")
        self.expire_leases()
        if register:
            self.register(partition, task)
        part = self._parts.get(partition)
        if part is None:
            return None
        state = part.tasks.get(task)
        if state is None:
            state = part.tasks[task] = _Task()
        order, consumed, leased, samples = part.order, state.consumed, state.leased, part.samples
        i, end = state.watermark, len(order)
        while i < end and (order[i] is None or order[i] in consumed):
            i += 1
        state.watermark = i
        required = tuple(required_fields)
        picked: list[str] = []
        for j in range(i, end):
            k = order[j]
            if k is None or k in consumed or k in leased:
                continue
            s = samples[k]
            if all(f in s for f in required):
                picked.append(k)
                if len(picked) == batch_size:
                    break
        if not picked:
            return None
        batch = self._read(
            part,
            partition,
            picked,
            list(fields) if fields is not None else list(required),
            wire,
            shm,
        )
        lease_id = secrets.token_hex(16)  # unguessable: a stranger cannot name someone's lease
        deadline = self.clock() + lease_s
        self._leases[lease_id] = _Lease(lease_id, partition, task, set(picked), deadline, owner)
        heapq.heappush(self._lease_heap, (deadline, lease_id))
        for k in picked:
            leased[k] = lease_id
        self._claim_rate.add(self.clock(), len(picked), batch.nbytes)
        return Batch(batch.keys, batch.fields, lease_id, batch.nbytes)

    def register(self, partition: str, task: str) -> bool:
        """Register ``task`` as a consumer that holds the samples of ``partition`` (retention).

        From then on a sample of the partition is dropped, and its key remembered as consumed,
        once every registered task acked it. A task registered after samples were dropped
        never sees those. Registrations last until the whole partition is cleared. Creates the
        partition when it does not exist yet (a consumer may start before its producers).

        Args:
            partition: partition name.
            task: consumer task name.

        Returns:
            True when the task was not registered before.

        Raises:
            StoreError: ``bad_request`` for an empty partition or task name.
        """
        if not partition or not isinstance(partition, str) or not task:
            raise StoreError(
                "bad_request",
                f"register needs a partition and a task name, got {partition!r}, {task!r}",
            )
        part = self._parts.get(partition)
        if part is None:
            part = self._parts[partition] = _Partition()
        if task in part.registered:
            return False
        part.registered.add(task)
        part.tasks.setdefault(task, _Task())
        logger.info("[queue] task %r registered for partition %r (retention)", task, partition)
        return True

    def ack(
        self,
        partition: str,
        task: str,
        lease_id: str,
        keys: Sequence[str] | None = None,
        owner: str | None = None,
    ) -> int:
        """Mark leased samples consumed by ``task``; drop those every registered task consumed.

        Args:
            partition, task: as claimed.
            lease_id: from the claim.
            keys: subset of the lease; None acks the whole lease.
            owner: the acking client's instance (None: not checked).

        Returns:
            Number of samples marked consumed.

        Raises:
            StoreError: ``unknown_lease`` when the lease expired or never existed (its samples
                are redelivered); ``not_owner`` when another instance claimed it;
                ``bad_request`` when a key is not in the lease. Nothing changes then.
        """
        lease, state = self._lease(partition, task, lease_id, owner)
        todo = set(lease.keys) if keys is None else set(keys)
        bad = todo - lease.keys
        if bad:
            raise StoreError("bad_request", f"keys {sorted(bad)[:5]} are not in lease {lease_id}")
        for k in todo:
            state.leased.pop(k, None)
            state.consumed.add(k)
        lease.keys -= todo
        if not lease.keys:
            del self._leases[lease_id]
        part = self._parts[partition]
        if task in part.registered:
            self._retire(partition, part, todo)
        return len(todo)

    def lease_keys(self, lease_id: str) -> list[str]:
        """The keys a live lease still holds (empty for an unknown lease)."""
        lease = self._leases.get(lease_id)
        return sorted(lease.keys) if lease is not None else []

    def is_registered(self, partition: str, task: str) -> bool:
        """Whether ``task`` is registered for ``partition`` (retention)."""
        part = self._parts.get(partition)
        return part is not None and task in part.registered

    def consume(self, partition: str, task: str, keys: Sequence[str]) -> int:
        """Mark samples consumed by ``task`` without a lease, as an ack does (the durable log's
        replay); drops those every registered task consumed. Unknown keys are ignored.

        Returns:
            Number of samples marked consumed.
        """
        part = self._parts.get(partition)
        if part is None:
            return 0
        state = part.tasks.setdefault(task, _Task())
        held = [k for k in keys if k in part.samples]
        for k in held:
            lease_id = state.leased.pop(k, None)
            if lease_id is not None and lease_id in self._leases:
                self._leases[lease_id].keys.discard(k)
            state.consumed.add(k)
        if task in part.registered:
            self._retire(partition, part, held)
        return len(held)

    def consumed_count(self, partition: str, task: str, keys: Sequence[str]) -> int:
        """How many of ``keys`` ``task`` consumed: held as consumed, or dropped by retention
        once every registered task consumed them (a tombstone)."""
        part = self._parts.get(partition)
        if part is None:
            return 0
        state = part.tasks.get(task)
        consumed = state.consumed if state is not None else set()
        rest = [k for k in keys if k not in consumed]
        gone = sum(part.retired.contains(rest)) if part.retired is not None and rest else 0
        return len(keys) - len(rest) + gone

    def restore_tombstones(self, partition: str, hashes: torch.Tensor, dropped: int) -> None:
        """Remember consumed-and-dropped keys by hash (the durable log's snapshot)."""
        part = self._parts.get(partition)
        if part is None:
            part = self._parts[partition] = _Partition()
        if part.retired is None:
            part.retired = KeyTombstones(self.tombstone_max_keys)
        part.retired.restore(hashes)
        part.dropped += int(dropped)

    def export_state(self) -> Iterable[tuple[str, dict]]:
        """The whole state but the leases as ``(op, body)`` records that rebuild it when applied
        in order (``register``, ``tombstones``, ``put`` per live block, ``consumed`` per task).

        Tensors are views of the stored blocks (a sparse block's live rows are gathered).
        """
        for name, part in self._parts.items():
            for task in sorted(part.registered):
                yield "register", {"partition": name, "task": task}
            if part.retired is not None or part.dropped:
                hashes = part.retired.export() if part.retired is not None else torch.empty(0)
                yield (
                    "tombstones",
                    {"partition": name, "hashes": hashes.to(torch.int64), "dropped": part.dropped},
                )
            blocks = []
            for block in part.blocks:
                rows = [r for r, k in enumerate(block.keys) if k is not None]
                if rows:
                    blocks.append((min(part.index[block.keys[r]] for r in rows), block, rows))
            blocks.sort(key=lambda t: t[0])
            for _, block, rows in blocks:
                value = JaggedColumn(block.values, block.offsets) if block.jagged else block.values
                if len(rows) != len(block.keys):
                    value = gather_rows(value, rows)
                keys = [block.keys[r] for r in rows]
                yield "put", {"partition": name, "keys": keys, "fields": {block.field: value}}
            for task, state in sorted(part.tasks.items()):
                if state.consumed:
                    keys = sorted(state.consumed)
                    yield "consumed", {"partition": name, "task": task, "keys": keys}

    def _retire(self, partition: str, part: _Partition, keys: Iterable[str]) -> None:
        """Drop the samples every registered task consumed; remember their keys."""
        holders = [part.tasks[t].consumed for t in part.registered]
        done = [k for k in keys if all(k in c for c in holders)]
        if not done:
            return
        if part.retired is None:
            part.retired = KeyTombstones(self.tombstone_max_keys)
        part.retired.add(done)
        part.dropped += len(done)
        self.clear(partition, done)

    def nack(
        self,
        partition: str,
        task: str,
        lease_id: str,
        keys: Sequence[str] | None = None,
        owner: str | None = None,
    ) -> int:
        """Give leased samples back: claimable again at once.

        Args:
            partition, task, lease_id, keys: as for ``ack``.

        Returns:
            Number of samples released.

        Raises:
            StoreError: as for ``ack``.
        """
        lease, state = self._lease(partition, task, lease_id, owner)
        todo = set(lease.keys) if keys is None else set(keys)
        bad = todo - lease.keys
        if bad:
            raise StoreError("bad_request", f"keys {sorted(bad)[:5]} are not in lease {lease_id}")
        self._release(lease, state, todo)
        return len(todo)

    def release_lease(self, lease_id: str) -> str | None:
        """Give a whole lease back at once (its claim reply could not be delivered).

        Returns:
            The lease's partition, or None when the lease is unknown.
        """
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return None
        part = self._parts.get(lease.partition)
        if part is not None and lease.keys:
            self._release(lease, part.tasks[lease.task], set(lease.keys))
        return lease.partition

    def status(self, partition: str, task: str) -> dict:
        """Consumption status of one task on one partition.

        Returns:
            ``{"samples", "consumed", "leased", "pending", "leases", "dropped", "registered"}``
            where pending samples are neither consumed nor leased by the task (whatever fields
            they have), ``consumed`` counts samples still held (dropped ones are not), and
            ``dropped`` the samples retention dropped from the partition.
        """
        self.expire_leases()
        part = self._parts.get(partition)
        if part is None:
            return {
                "samples": 0,
                "consumed": 0,
                "leased": 0,
                "pending": 0,
                "leases": 0,
                "dropped": 0,
                "registered": False,
            }
        state = part.tasks.get(task) or _Task()
        n_leases = sum(
            1 for le in self._leases.values() if le.partition == partition and le.task == task
        )
        samples = len(part.samples)
        return {
            "samples": samples,
            "consumed": len(state.consumed),
            "leased": len(state.leased),
            "pending": samples - len(state.consumed) - len(state.leased),
            "leases": n_leases,
            "dropped": part.dropped,
            "registered": task in part.registered,
        }

    def stats(self) -> dict:
        """Samples and bytes per partition, per-task counts, put/claim rates.

        Returns:
            A msgpack-able dict. A partition's ``bytes`` are the buffers it keeps alive (what it
            counts in ``bytes_used``), ``sample_bytes`` the bytes of its samples' rows (less
            when a buffer also holds cleared rows or message overhead).
        """
        self.expire_leases()
        now = self.clock()
        put_sps, put_bps = self._put_rate.rates(now, self._started)
        claim_sps, claim_bps = self._claim_rate.rates(now, self._started)
        parts = {}
        for name, part in self._parts.items():
            parts[name] = {
                "samples": len(part.samples),
                "bytes": self._held_by(part),
                "sample_bytes": sum(b.live_bytes for b in part.blocks),
                "tasks": {
                    t: {"consumed": len(s.consumed), "leased": len(s.leased)}
                    for t, s in part.tasks.items()
                },
                "registered": sorted(part.registered),
                "dropped": part.dropped,
                "tombstones": len(part.retired) if part.retired is not None else 0,
                "tombstone_bytes": part.retired.nbytes if part.retired is not None else 0,
            }
        return {
            "capacity_bytes": self.capacity_bytes,
            "bytes_used": self.bytes_used,
            "samples": sum(len(p.samples) for p in self._parts.values()),
            "partitions": parts,
            "leases": len(self._leases),
            "rates": {
                "window_s": self._put_rate.window_s,
                "put_samples_per_s": put_sps,
                "put_bytes_per_s": put_bps,
                "claim_samples_per_s": claim_sps,
                "claim_bytes_per_s": claim_bps,
            },
        }

    def expire_leases(self, now: float | None = None) -> set[str]:
        """Release every lease whose deadline has passed.

        Returns:
            Partitions that got samples back (parked claims there may now succeed).
        """
        now = self.clock() if now is None else now
        touched: set[str] = set()
        heap = self._lease_heap
        while heap and heap[0][0] <= now:
            _, lease_id = heapq.heappop(heap)
            lease = self._leases.get(lease_id)
            if lease is None:
                continue
            part = self._parts.get(lease.partition)
            if part is not None and lease.keys:
                logger.debug(
                    "[queue] lease %d of task %r expired: %d samples redelivered",
                    lease_id,
                    lease.task,
                    len(lease.keys),
                )
                self._release(lease, part.tasks[lease.task], set(lease.keys))
                touched.add(lease.partition)
            self._leases.pop(lease_id, None)
        return touched

    def _held_by(self, part: _Partition) -> int:
        """Bytes of the buffers the partition's blocks keep alive, each counted once: the fields
        of one put view one received message or shared-memory segment, so a per-block sum
        counts that buffer once per field (`tests/services/queue/test_stats_bytes.py`)."""
        storages: set[tuple[int, int]] = set()
        for block in part.blocks:
            storages |= block.storages
        return sum(size for _, size in storages)

    def next_lease_deadline(self) -> float | None:
        """Earliest live lease deadline (clock seconds), or None."""
        heap = self._lease_heap
        while heap and heap[0][1] not in self._leases:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    # ---------------------------------------------------------------- internals

    def _part(self, partition: str) -> _Partition:
        part = self._parts.get(partition)
        if part is None:
            raise StoreError(
                "not_found",
                f"partition {partition!r} does not exist; known: {sorted(self._parts)[:10]}",
            )
        return part

    def _lease(
        self, partition: str, task: str, lease_id: str, owner: str | None = None
    ) -> tuple[_Lease, _Task]:
        self.expire_leases()
        lease = self._leases.get(lease_id)
        if lease is None or lease.partition != partition or lease.task != task:
            raise StoreError(
                "unknown_lease",
                f"lease {lease_id} of task {task!r} on partition "
                f"{partition!r} is unknown or expired; its samples are redelivered "
                "(if steps take longer, raise the claimer's lease: trainer lease_s, or the "
                "lease_s of its claim calls)",
            )
        if owner is not None and lease.owner is not None and owner != lease.owner:
            raise StoreError(
                "not_owner",
                f"lease {lease_id} was claimed by another client instance; only the claiming "
                "process (any of its clients) may ack or nack it. Nothing was changed",
            )
        return lease, self._parts[partition].tasks[task]

    def _release(self, lease: _Lease, state: _Task, keys: set[str]) -> None:
        part = self._parts[lease.partition]
        for k in keys:
            if state.leased.get(k) == lease.lease_id:
                del state.leased[k]
                pos = part.index.get(k)
                if pos is not None and pos < state.watermark:
                    state.watermark = pos
        lease.keys -= keys
        if not lease.keys:
            self._leases.pop(lease.lease_id, None)

    def _check_schema(self, part: _Partition, norm: Mapping[str, FieldValue]) -> None:
        for name, value in norm.items():
            want = part.schema.get(name)
            got = schema_of(value)
            if want is not None and want != got:
                raise StoreError(
                    "bad_request",
                    f"field {name!r}: got (jagged={got[0]}, "
                    f"dtype={got[1]}, row dims={got[2]}) but the partition stores "
                    f"(jagged={want[0]}, dtype={want[1]}, row dims={want[2]}); "
                    "send the same layout, dtype and trailing shape",
                )

    def _added_bytes(self, blocks: Iterable[Block]) -> int:
        seen: set[tuple[int, int]] = set()
        added = 0
        for block in blocks:
            for sid in block.storages:
                if sid not in self._storages and sid not in seen:
                    seen.add(sid)
                    added += sid[1]
        return added

    def _sparse(self, block: Block) -> bool:
        """Whether the live rows of every block viewing the block's main buffer hold less than
        ``COMPACT_BELOW`` of it (then the block is copied down)."""
        sid = _main_storage(block)
        return self._live.get(sid, 0) < COMPACT_BELOW * sid[1]

    def _add_block(self, part: _Partition, block: Block) -> None:
        part.blocks.add(block)
        for sid in block.storages:
            self._live[sid] = self._live.get(sid, 0) + block.live_bytes
            count = self._storages.get(sid, 0)
            if count == 0:
                self.bytes_used += sid[1]
            self._storages[sid] = count + 1

    def _drop_block(self, part: _Partition, block: Block) -> None:
        part.blocks.discard(block)
        for sid in block.storages:
            self._live[sid] -= block.live_bytes
            count = self._storages[sid] - 1
            if count == 0:
                del self._storages[sid]
                del self._live[sid]
                self.bytes_used -= sid[1]
                if self._on_release is not None:
                    self._on_release(sid[0])
            else:
                self._storages[sid] = count

    def keys_viewing(self, ptr: int) -> dict[str, list[str]]:
        """Partition -> keys of the samples with a field stored in the storage at ``ptr``."""
        out: dict[str, list[str]] = {}
        for name, part in self._parts.items():
            keys = {
                k
                for block in part.blocks
                if any(sid[0] == ptr for sid in block.storages)
                for k in block.keys
                if k is not None
            }
            if keys:
                out[name] = sorted(keys, key=part.index.__getitem__)
        return out

    def _compact_block(self, part: _Partition, block: Block) -> None:
        rows = [r for r, k in enumerate(block.keys) if k is not None]
        keys = [block.keys[r] for r in rows]
        if self._check is not None:
            try:
                check_cells([(block, r) for r in rows], self._check)
            except StoreError:
                return  # changed bytes are not copied: the next read of these rows refuses them
        value = JaggedColumn(block.values, block.offsets) if block.jagged else block.values
        fresh = Block(block.partition, block.field, copy_rows(gather_rows(value, rows)), keys)
        self._drop_block(part, block)
        self._add_block(part, fresh)
        for r, k in enumerate(keys):
            part.samples[k][block.field] = (fresh, r)

    def _read(
        self,
        part: _Partition,
        partition: str,
        keys: list[str],
        fields: Sequence[str] | None,
        wire: bool = False,
        shm: Locate | None = None,
    ) -> Batch:
        samples = [part.samples[k] for k in keys]
        if fields is None:
            names = set(samples[0]) if samples else set()
            for s in samples[1:]:
                names &= set(s)
            fields = sorted(names)
        out: dict[str, FieldValue] = {}
        nbytes = 0
        for name in fields:
            cells = []
            for k, s in zip(keys, samples):
                cell = s.get(name)
                if cell is None:
                    raise StoreError(
                        "missing_field",
                        f"sample {k!r} of partition {partition!r} "
                        f"has no field {name!r}; has {sorted(s)}",
                    )
                cells.append(cell)
                nbytes += cell[0].row_nbytes[cell[1]]
            if self._check is not None:
                check_cells(cells, self._check)
            if not wire:
                out[name] = assemble(cells)
            elif shm is not None:
                out[name] = assemble_shm(cells, shm)
            else:
                out[name] = assemble_wire(cells)
        return Batch(keys, out, None, nbytes)
