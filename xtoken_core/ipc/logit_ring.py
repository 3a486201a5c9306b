"""The teacher's logit ring: slots written by one teacher process, read in place by a trainer.

Legend: S slots, B rows (sequences) of a slot, U teacher tokens of a row, W teacher vocab.

A teacher allocates S slots ``[B, U, W]`` once (``LogitRingWriter``), exports them once (the
``descriptor``), and per micro-batch ``acquire`` s a free slot, writes its logits into
``buffer(slot)``, and ``publish`` es it: the returned handle (a few ints) travels on the request
record. A trainer (``LogitRingReader``) maps each ring once, ``view`` s the slot in place (zero
copy), trains, and ``release`` s it after its backward; only then does the teacher reuse it.

Transports:
  * ``shm``: the slots are one /dev/shm segment that both processes map (CPU).
  * ``cuda_ipc``: the slots are one CUDA buffer exported with ``CudaIpcHandle``; each slot has
    an interprocess CUDA event that ``publish`` records on the teacher's current stream and that
    ``view`` makes the trainer's current stream wait on (no host sync). The trainer may be on
    another GPU of the node: the view then lives on the teacher's GPU (``.to`` copies it over
    NVLink/PCIe); only a stream of that GPU waits on the IPC event (a wait from another GPU's
    stream crashes the driver), and the trainer's stream waits on a local event behind it.
    ``release`` records an event on the trainer's current stream(s) and a helper thread frees
    the slot once it completed, so the teacher never overwrites logits that queued trainer
    kernels still read.

The control header is a small /dev/shm segment whose layout ``ring_format`` documents: the
teacher writes ``published_gen``, the trainer ``released_gen``, one writer per word.

A handle ``{instance, slot, generation, rows, length, width[, checksum]}`` is valid iff its
instance is the ring's, the ring is not closed, the heartbeat is younger than ``dead_after_s``,
and ``generation == published_gen[slot] > released_gen[slot]`` (``SlotTable``). Anything else
raises ``StaleHandleError``: the batch is recomputed, never trained on.

A tensor-parallel teacher group writes one ring from several processes: its rank 0 owns the
``LogitRingWriter`` (acquire, publish, the header), and every other rank opens the same slots
from the descriptor with a ``LogitRingSliceWriter`` and writes its own vocab columns
``[:, :, lo:hi]`` of the slot rank 0 acquired; rank 0 publishes once every slice is written
(the group's barrier orders the writes before the publish).

Lifetime: the teacher unlinks both segments on ``close`` (also at interpreter exit). The trainer
maps with ``unlink=False`` so that a restarted trainer maps the same ring again. A SIGKILLed
teacher leaves its two ``xtk_<pid>_*`` files; ``sweep_orphans`` removes them.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import secrets
import threading
import time
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch

from xtoken_core.ipc import cuda as cuda_ipc
from xtoken_core.ipc.cuda import CudaIpcHandle
from xtoken_core.ipc.ring_format import (
    HEADER_WORDS,
    MAX_DIM,
    MAX_SLOTS,
    TRANSPORTS,
    VERSION,
    W_CLOSED,
    W_HEARTBEAT,
    RingDescriptor,
    check_int,
    checksum_of,
    cuda_device_key,
    data_bytes,
    header_bytes,
    identity_words,
    local_cuda_index,
    parse_descriptor,
    parse_handle,
    segment_size,
)
from xtoken_core.ipc.shm import SHM_DIR, ShmReader, ShmSegment
from xtoken_core.ipc.slots import SlotTable, StaleHandleError
from xtoken_core.jagged import DTYPE_NAMES, WIRE_DTYPES

__all__ = [
    "LogitRingReader",
    "LogitRingSliceWriter",
    "LogitRingWriter",
    "StaleHandleError",
    "checksum_of",
]

logger = logging.getLogger(__name__)

# A reader keeps at most this many rings mapped (a teacher restart makes a new ring).
MAX_RINGS = 8
# instance -> the interprocess events of a cuda ring written by this process: CUDA does not open
# an IPC handle in the process that made it, so a reader in the same process uses these.
_LOCAL_EVENTS: dict[int, list] = {}


def _beat(heartbeat_H: torch.Tensor, stop: threading.Event, period_s: float) -> None:
    """Heartbeat thread: stamp the header's heartbeat word every ``period_s`` until ``stop``."""
    while not stop.wait(period_s):
        heartbeat_H[W_HEARTBEAT] = time.time()


class _WriterState:
    """What a writer owns and ``close`` frees (kept apart from the writer so that a finalizer
    can free it at interpreter exit without keeping the writer alive)."""

    def __init__(self) -> None:
        self.segments: list[ShmSegment] = []
        self.header_H: torch.Tensor | None = None
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.export: CudaIpcHandle | None = None
        self.instance = 0
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.header_H is not None:
            self.header_H[W_CLOSED] = 1  # before the unlink: mapped readers see it
        self.stop.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=5.0)
        _LOCAL_EVENTS.pop(self.instance, None)
        if self.export is not None:
            cuda_ipc.forget(self.export)
        self.header_H = None
        for segment in self.segments:
            segment.unlink()
            try:
                segment.close()
            except BufferError:
                pass  # views handed out keep the mapping; it goes with them


class LogitRingWriter:
    """Teacher side: a ring of ``num_slots`` logit slots ``[B, U, W]``, exported once.

    Use ``slot = acquire()``, write ``buffer(slot)[:rows, :length]``, then
    ``handle = publish(slot, rows=rows, length=length)`` and send the handle (with the
    ``descriptor``, once) to the trainer. ``close()`` when done (also a context manager).

    Args:
        transport: ``"shm"`` (CPU, /dev/shm) or ``"cuda_ipc"`` (a CUDA buffer, same node).
        num_slots: S >= 2 (the teacher writes one slot while the trainer reads another).
        slot_shape: ``(B, U, W)``: rows, teacher tokens per row, teacher vocab.
        dtype: the logits dtype (a wire dtype, e.g. ``torch.bfloat16``).
        device: ``"cpu"`` for shm; a CUDA device for cuda_ipc (``"cuda"`` = the current one).
        heartbeat_s: the heartbeat period; readers call the ring dead after ``dead_after_s``
            without a beat, so keep it well below that (default 0.5 s vs 5 s).

    Attributes:
        descriptor: the msgpack-able dict a reader needs: ``{kind: "logit_ring", version,
            transport, instance, pid, header, data, events, device, num_slots, slot_shape,
            dtype, heartbeat_s}`` (``data`` is the shm segment name or
            ``CudaIpcHandle.to_dict()``; ``events`` and ``device`` are set for cuda_ipc).
        instance: the ring's random id (in every handle).

    Raises:
        ValueError: a bad argument (named, with the fix).
        OSError: /dev/shm is missing or too small for the ring (nothing is left behind).
    """

    def __init__(
        self,
        *,
        transport: str,
        num_slots: int,
        slot_shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        heartbeat_s: float = 0.5,
    ) -> None:
        where = "LogitRingWriter"
        if transport not in TRANSPORTS:
            raise ValueError(f"{where} transport={transport!r}: use one of {TRANSPORTS}")
        if type(num_slots) is not int or not 2 <= num_slots <= MAX_SLOTS:
            raise ValueError(
                f"{where} num_slots={num_slots!r}: use an int in [2, {MAX_SLOTS}] (two or more, "
                "so the teacher writes one slot while the trainer reads another)"
            )
        if (
            not isinstance(slot_shape, tuple | list)
            or len(slot_shape) != 3
            or not all(type(s) is int and 1 <= s <= MAX_DIM for s in slot_shape)
        ):
            raise ValueError(
                f"{where} slot_shape={slot_shape!r}: use (B, U, W), three positive ints"
            )
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"{where} dtype={dtype!r}: use one of {sorted(WIRE_DTYPES)}")
        if (
            isinstance(heartbeat_s, bool)
            or not isinstance(heartbeat_s, int | float)
            or not (0 < heartbeat_s < 3600)
        ):
            raise ValueError(f"{where} heartbeat_s={heartbeat_s!r}: use seconds > 0 (e.g. 0.5)")
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"{where} device={device!r} is not a torch device") from None
        if transport == "shm" and dev.type != "cpu":
            raise ValueError(
                f"{where} device={device!r}: the shm transport keeps logits in /dev/shm on the "
                "CPU; use device='cpu', or transport='cuda_ipc' for GPU logits"
            )
        if transport == "cuda_ipc":
            if dev.type != "cuda" or not torch.cuda.is_available():
                raise ValueError(
                    f"{where} device={device!r}: the cuda_ipc transport needs a CUDA device "
                    f"(CUDA available: {torch.cuda.is_available()}); use transport='shm' on CPU"
                )
            dev = torch.device(
                "cuda", torch.cuda.current_device() if dev.index is None else dev.index
            )
        self.transport = transport
        self.num_slots = num_slots
        self.slot_shape = (int(slot_shape[0]), int(slot_shape[1]), int(slot_shape[2]))
        self.dtype = dtype
        self.device = dev
        self.heartbeat_s = float(heartbeat_s)
        self.instance = secrets.randbelow(2**63 - 1) + 1
        self._lock = threading.Lock()
        self._events: list = []
        state = self._state = _WriterState()
        state.instance = self.instance
        try:
            data, device_key, event_handles = self._allocate(state)
        except BaseException:
            state.close()
            raise
        self.descriptor: dict[str, Any] = {
            "kind": "logit_ring",
            "version": VERSION,
            "transport": transport,
            "instance": self.instance,
            "pid": os.getpid(),
            "header": state.segments[0].name,
            "data": data,
            "events": event_handles,
            "device": device_key,
            "num_slots": num_slots,
            "slot_shape": list(self.slot_shape),
            "dtype": DTYPE_NAMES[dtype],
            "heartbeat_s": self.heartbeat_s,
        }
        state.thread = threading.Thread(
            target=_beat,
            args=(state.header_H.view(torch.float64), state.stop, self.heartbeat_s),
            name=f"logit-ring-heartbeat-{self.instance:x}",
            daemon=True,
        )
        state.thread.start()
        self._finalizer = weakref.finalize(self, state.close)
        nbytes = data_bytes(num_slots, self.slot_shape, dtype)
        logger.info(
            "[logit_ring] writer ready: transport=%s device=%s slots=%d x %s %s (%.1f MiB) "
            "header=%s instance=%#x",
            transport, dev, num_slots, list(self.slot_shape), DTYPE_NAMES[dtype],
            nbytes / 2**20, state.segments[0].name, self.instance,
        )  # fmt: skip

    def _allocate(self, state: _WriterState) -> tuple[str | dict[str, Any], str, list[bytes]]:
        """Create the header and the slots; returns the descriptor's ``data``, ``device`` and
        ``events``."""
        S = self.num_slots
        header = ShmSegment.create(header_bytes(S))
        state.segments.append(header)
        header_H = header.view(0, torch.int64, (HEADER_WORDS + 2 * S,))
        header_H.zero_()
        header_H.view(torch.float64)[W_HEARTBEAT] = time.time()
        state.header_H = header_H
        self._table = SlotTable(header_H[HEADER_WORDS:].view(2, S))
        shape_SBUW = (S, *self.slot_shape)
        if self.transport == "shm":
            segment = ShmSegment.create(data_bytes(S, self.slot_shape, self.dtype))
            state.segments.append(segment)
            self._buffer_SBUW = segment.view(0, self.dtype, shape_SBUW)
            data: str | CudaIpcHandle = segment.name
            device_key, event_handles = "", []
        else:
            with torch.cuda.device(self.device):
                self._buffer_SBUW = torch.empty(shape_SBUW, dtype=self.dtype, device=self.device)
                stream = torch.cuda.current_stream(self.device)
                self._events = [torch.cuda.Event(interprocess=True) for _ in range(S)]
                for ev in self._events:
                    ev.record(stream)  # creates each event on this device
                event_handles = [bytes(ev.ipc_handle()) for ev in self._events]
                data = state.export = CudaIpcHandle.export(self._buffer_SBUW)
            _LOCAL_EVENTS[self.instance] = self._events
            device_key = cuda_device_key(self.device.index)
        identity = identity_words(
            self.transport, self.instance, os.getpid(), S, self.slot_shape, self.dtype, data
        )
        for word, value in identity.values():
            header_H[word] = value
        return (data if isinstance(data, str) else data.to_dict()), device_key, event_handles

    def _check_open(self) -> None:
        if self._state.closed:
            raise ValueError(f"logit ring {self.instance:#x} is closed; make a new LogitRingWriter")

    def acquire(self, timeout_s: float | None = None, stop: threading.Event | None = None) -> int:
        """Take a free slot, waiting until the trainer releases one if all are in flight.

        Args:
            timeout_s: give up after this many seconds (None: wait forever).
            stop: give up as soon as this event is set (the process is shutting down).

        Returns:
            The slot, held by this writer until ``publish`` (or ``abandon``).

        Raises:
            TimeoutError: no slot was released within ``timeout_s`` (names the setting).
            InterruptedError: ``stop`` was set while waiting.
            ValueError: the ring is closed, or ``timeout_s`` is negative.
        """
        if timeout_s is not None and (
            isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s < 0
        ):
            raise ValueError(f"acquire timeout_s={timeout_s!r}: use seconds >= 0 or None")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        delay = 1e-4
        while True:
            self._check_open()
            with self._lock:
                slot = self._table.acquire()
            if slot is not None:
                return slot
            if stop is not None and stop.is_set():
                raise InterruptedError(
                    f"logit ring {self.instance:#x}: stop was set while waiting for a free slot"
                )
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(
                    f"no free logit ring slot within acquire timeout_s={timeout_s}: all "
                    f"{self.num_slots} slots are published and not released (in flight: "
                    f"{self._table.in_flight()}, held: {self._table.held()}); the trainer "
                    "releases a slot after its backward: check that it is alive, or raise "
                    "timeout_s / num_slots"
                )
            wait = delay if deadline is None else min(delay, deadline - now)
            if stop is not None:
                stop.wait(wait)
            else:
                time.sleep(wait)
            delay = min(delay * 2, 0.005)

    def buffer(self, slot: int) -> torch.Tensor:
        """The slot's memory to write logits into.

        Args:
            slot: a slot from ``acquire`` (not yet published).

        Returns:
            ``[B, U, W]`` on the ring's device, contiguous; rows ``[:rows, :length]`` are what
            ``publish`` exposes.

        Raises:
            ValueError: the slot is not held (never write a published slot: a trainer reads it).
        """
        self._check_open()
        return self._buffer_SBUW[self._table.check_held(slot)]

    def publish(self, slot: int, *, rows: int, length: int, checksum: bool = False) -> dict:
        """Publish a written slot; the returned handle is what the trainer views.

        For cuda_ipc the slot's interprocess event is recorded on the current stream of the
        ring's device, so write the logits on that stream (the trainer's stream waits on it).

        Args:
            slot: a held slot whose ``buffer(slot)[:rows, :length]`` is written.
            rows: rows written, ``1 <= rows <= B``.
            length: tokens written per row, ``1 <= length <= U``.
            checksum: add ``checksum`` (exact, see ``checksum_of``) for ``LogitRingReader.verify``
                (costs a pass over the logits and, on CUDA, a host sync).

        Returns:
            ``{instance, slot, generation, rows, length, width[, checksum]}`` (msgpack-able).

        Raises:
            ValueError: the slot is not held, or ``rows`` / ``length`` out of range.
        """
        self._check_open()
        batch, tokens, width = self.slot_shape
        slot = self._table.check_held(slot)
        check_int("publish", "rows", rows, 1, batch)
        check_int("publish", "length", length, 1, tokens)
        handle: dict[str, Any] = {
            "instance": self.instance,
            "slot": slot,
            "generation": 0,
            "rows": rows,
            "length": length,
            "width": width,
        }
        if checksum:
            handle["checksum"] = checksum_of(self._buffer_SBUW[slot, :rows, :length])
        if self._events:
            self._events[slot].record(torch.cuda.current_stream(self.device))
        with self._lock:
            handle["generation"] = self._table.publish(slot)
        return handle

    def abandon(self, slot: int) -> None:
        """Give back a held slot without publishing it (e.g. the teacher's forward failed).

        Raises:
            ValueError: the slot is not held.
        """
        with self._lock:
            self._table.abandon(slot)

    def in_flight(self) -> list[int]:
        """The slots published and not yet released by the trainer."""
        return self._table.in_flight()

    @property
    def closed(self) -> bool:
        """True once ``close`` ran."""
        return self._state.closed

    def close(self) -> None:
        """Mark the ring closed (its handles turn stale), stop the heartbeat, unlink the
        segments. Idempotent; tensors already handed out stay valid."""
        if self._state.closed:
            return
        in_flight = self._table.in_flight()
        self._finalizer()
        # Drop this object's views so the data mapping (or CUDA buffer) goes now, unless the
        # caller still holds a buffer() view: then it goes with that view.
        self._buffer_SBUW = None
        self._events = []
        for segment in self._state.segments[1:]:
            try:
                segment.close()
            except BufferError:
                pass
        logger.info(
            "[logit_ring] writer closed: instance=%#x in flight=%s", self.instance, in_flight
        )

    def __enter__(self) -> LogitRingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"LogitRingWriter({self.transport}, instance={self.instance:#x}, "
            f"slots={self.num_slots}x{list(self.slot_shape)}, {DTYPE_NAMES[self.dtype]}, "
            f"{self.device}, closed={self.closed})"
        )


class LogitRingSliceWriter:
    """Another process's writer of a vocab slice of a ring's slots (a rank of a tensor-parallel
    teacher group; the ring's ``LogitRingWriter`` lives in the group's rank 0).

    It maps the slots of the descriptor (shm: the /dev/shm segment, read-write; cuda_ipc: the
    CUDA buffer, on the ring's GPU, which must be visible here) and never touches the slot
    table: the owner acquires and publishes. Write ``buffer(slot)`` for a slot the owner
    acquired and told this process about, then tell the owner it is written (on CUDA: after the
    writes completed, e.g. a stream sync), and the owner publishes.

    Args:
        descriptor: the ring's ``LogitRingWriter.descriptor`` (after msgpack is fine).
        columns: ``(lo, hi)``, the vocab columns this process writes, ``0 <= lo < hi <= W``.

    Raises:
        ValueError: a malformed descriptor, columns out of range, a header that is not the
            descriptor's ring, a closed ring, or (cuda_ipc) the ring's GPU not visible here.
        StaleHandleError: the ring's segments are gone (its owner closed it or died).
    """

    def __init__(self, descriptor: dict, *, columns: tuple[int, int]) -> None:
        desc = parse_descriptor(descriptor)
        width = desc.slot_shape[2]
        if (
            not isinstance(columns, tuple | list)
            or len(columns) != 2
            or not all(type(c) is int for c in columns)
            or not 0 <= columns[0] < columns[1] <= width
        ):
            raise ValueError(
                f"LogitRingSliceWriter columns={columns!r}: use (lo, hi) with "
                f"0 <= lo < hi <= {width}, the ring's vocab width"
            )
        self.descriptor = descriptor
        self.instance = desc.instance
        self.columns = (int(columns[0]), int(columns[1]))
        self.num_slots = desc.num_slots
        self._export: CudaIpcHandle | None = None
        words = HEADER_WORDS + 2 * desc.num_slots
        base_H = LogitRingReader._segment(desc, "header", desc.header, segment_size(words * 8))
        self._header_H = base_H[: words * 8].view(torch.int64)
        identity = identity_words(
            desc.transport, desc.instance, desc.pid, desc.num_slots, desc.slot_shape, desc.dtype,
            desc.data,
        )  # fmt: skip
        for name, (word, want) in identity.items():
            if int(self._header_H[word]) != want:
                raise ValueError(
                    f"logit ring header {desc.header} has another {name} than the descriptor: "
                    "pass LogitRingWriter.descriptor on unchanged"
                )
        self._check_open()
        shape_SBUW = (desc.num_slots, *desc.slot_shape)
        if desc.transport == "shm":
            nbytes = data_bytes(desc.num_slots, desc.slot_shape, desc.dtype)
            base_D = LogitRingReader._segment(desc, "data", desc.data, segment_size(nbytes))
            self._data_SBUW = base_D[:nbytes].view(desc.dtype).view(shape_SBUW)
            self.device = torch.device("cpu")
        else:
            index = local_cuda_index(desc.device)
            self._export = replace(desc.data, device=index)
            self._data_SBUW = self._export.open()
            self.device = torch.device("cuda", index)

    def _check_open(self) -> None:
        if self._header_H is None or int(self._header_H[W_CLOSED]):
            raise ValueError(
                f"logit ring {self.instance:#x} is closed; open the slice writer of its new ring"
            )

    def buffer(self, slot: int) -> torch.Tensor:
        """This process's columns of a slot: ``[B, U, hi - lo]`` (strided: rows of the slot's
        ``[B, U, W]``) on the ring's device (the CPU for shm, the ring's GPU for cuda_ipc).

        Raises:
            ValueError: ``slot`` out of range, or the ring is closed.
        """
        self._check_open()
        check_int("LogitRingSliceWriter.buffer", "slot", slot, 0, self.num_slots - 1)
        lo, hi = self.columns
        return self._data_SBUW[slot, :, :, lo:hi]

    def close(self) -> None:
        """Drop the mappings (the owner unlinks the segments). Idempotent."""
        if self._export is not None:
            cuda_ipc.forget(self._export)
            self._export = None
        self._data_SBUW = None
        self._header_H = None

    def __enter__(self) -> LogitRingSliceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _MappedRing:
    """One ring as this reader maps it."""

    desc: RingDescriptor
    header_H: torch.Tensor
    table: SlotTable
    data_SBUW: torch.Tensor
    events: list
    slot_device: torch.device | None  # cuda: the teacher GPU's index in this process
    export: CudaIpcHandle | None


class _Releaser:
    """Frees cuda slots once the trainer's work queued before ``release`` is done."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="logit-ring-release", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            events, table, slot, generation = item
            try:
                for ev in events:
                    ev.synchronize()
            except Exception:  # a broken CUDA context: never free a slot that may be in use
                logger.exception("[logit_ring] release of slot %d failed", slot)
                continue
            table.release(slot, generation)

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()


class LogitRingReader:
    """Trainer side: views published slots of any number of rings in place.

    Each ring is mapped (shm) or imported (cuda_ipc) on first use and cached by its instance;
    a ring found closed or dead is dropped from the cache (views already returned stay valid).

    Args:
        device: the trainer's CUDA device; with cuda_ipc its current stream waits on the slot's
            event in ``view`` and is what ``release`` waits for (None: the current device).
            Ignored for shm.
        dead_after_s: a ring whose heartbeat is older than this is dead (its handles stale);
            keep it several times the teacher's ``heartbeat_s``.

    Raises:
        ValueError: ``dead_after_s`` not a positive number, or ``device`` not a torch device.
    """

    def __init__(self, *, device: str | torch.device | None = None, dead_after_s: float = 5.0):
        if (
            isinstance(dead_after_s, bool)
            or not isinstance(dead_after_s, int | float)
            or not (dead_after_s > 0)
        ):
            raise ValueError(f"LogitRingReader dead_after_s={dead_after_s!r}: use seconds > 0")
        try:
            self.device = None if device is None else torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"LogitRingReader device={device!r} is not a torch device") from None
        self.dead_after_s = float(dead_after_s)
        self._rings: collections.OrderedDict[int, _MappedRing] = collections.OrderedDict()
        self._lock = threading.RLock()
        self._releaser: _Releaser | None = None
        self._dead: set[int] = set()  # instances already logged as dead
        self._closed = False

    # -- mapping --------------------------------------------------------------------------------

    def _ring(self, desc: RingDescriptor) -> _MappedRing:
        ring = self._rings.get(desc.instance)
        if ring is not None:
            if ring.desc != desc:
                raise ValueError(
                    f"logit ring descriptor of instance {desc.instance:#x} differs from the one "
                    f"this reader mapped (header {ring.desc.header} vs {desc.header}); pass "
                    "LogitRingWriter.descriptor on unchanged"
                )
            self._rings.move_to_end(desc.instance)
            return ring
        if self._closed:
            raise ValueError("LogitRingReader is closed; make a new one")
        ring = self._map(desc)
        self._rings[desc.instance] = ring
        self._evict(keep=desc.instance)
        return ring

    def _map(self, desc: RingDescriptor) -> _MappedRing:
        words = HEADER_WORDS + 2 * desc.num_slots
        base_H = self._segment(desc, "header", desc.header, segment_size(words * 8))
        header_H = base_H[: words * 8].view(torch.int64)
        identity = identity_words(
            desc.transport, desc.instance, desc.pid, desc.num_slots, desc.slot_shape, desc.dtype,
            desc.data,
        )  # fmt: skip
        for name, (word, want) in identity.items():
            got = int(header_H[word])
            if got != want:
                raise ValueError(
                    f"logit ring header {desc.header} has {name}={got:#x}, the descriptor says "
                    f"{want:#x}: the descriptor does not describe this ring (pass "
                    "LogitRingWriter.descriptor on unchanged)"
                )
        table = SlotTable(header_H[HEADER_WORDS:].view(2, desc.num_slots))
        self._check_alive(desc, header_H)  # a dead teacher's CUDA memory cannot be imported
        shape_SBUW = (desc.num_slots, *desc.slot_shape)
        if desc.transport == "shm":
            nbytes = data_bytes(desc.num_slots, desc.slot_shape, desc.dtype)
            base_D = self._segment(desc, "data", desc.data, segment_size(nbytes))
            data_SBUW = base_D[:nbytes].view(desc.dtype).view(shape_SBUW)
            ring = _MappedRing(desc, header_H, table, data_SBUW, [], None, None)
        else:
            index = local_cuda_index(desc.device)
            export = replace(desc.data, device=index)
            slot_device = torch.device("cuda", index)
            local = _LOCAL_EVENTS.get(desc.instance)
            if local is not None:
                events = list(local)
            else:
                events = [torch.cuda.Event.from_ipc_handle(slot_device, e) for e in desc.events]
            ring = _MappedRing(desc, header_H, table, export.open(), events, slot_device, export)
        logger.info(
            "[logit_ring] reader mapped ring %#x of teacher pid %d: %s %d x %s %s",
            desc.instance, desc.pid, desc.transport, desc.num_slots, list(desc.slot_shape),
            DTYPE_NAMES[desc.dtype],
        )  # fmt: skip
        return ring

    @staticmethod
    def _segment(desc: RingDescriptor, field: str, name: str, size: int) -> torch.Tensor:
        """Map one of the ring's segments (never unlinking it: a restarted trainer maps it
        again)."""
        try:
            return ShmReader(unlink=False).segment(name, size)
        except ValueError as e:
            if not os.path.exists(os.path.join(SHM_DIR, name)):
                raise StaleHandleError(
                    f"logit ring segment {name} of teacher pid {desc.pid} is gone: the teacher "
                    "closed the ring (or it was swept after the teacher died); recompute the batch"
                ) from None
            raise ValueError(f"logit ring descriptor field {field!r}: {e}") from None

    def _drop(self, instance: int) -> None:
        ring = self._rings.pop(instance, None)
        if ring is not None and ring.export is not None:
            cuda_ipc.forget(ring.export)

    def _evict(self, keep: int) -> None:
        """Drop rings that are closed or dead, and the least recently used beyond MAX_RINGS."""
        for instance, ring in list(self._rings.items()):
            if instance != keep and self._why_dead(ring.desc, ring.header_H) is not None:
                self._drop(instance)
        while len(self._rings) > MAX_RINGS:
            self._drop(next(iter(self._rings)))

    def _why_dead(self, desc: RingDescriptor, header_H: torch.Tensor) -> str | None:
        if int(header_H[W_CLOSED]):
            return f"teacher pid {desc.pid} closed logit ring {desc.instance:#x}"
        age = time.time() - float(header_H.view(torch.float64)[W_HEARTBEAT])
        if age > self.dead_after_s:
            return (
                f"teacher pid {desc.pid} of logit ring {desc.instance:#x} is dead or hung: its "
                f"heartbeat is {age:.1f} s old > dead_after_s={self.dead_after_s}"
            )
        return None

    def _check_alive(self, desc: RingDescriptor, header_H: torch.Tensor) -> None:
        why = self._why_dead(desc, header_H)
        if why is not None:
            if desc.instance not in self._dead:
                self._dead.add(desc.instance)
                logger.warning("[logit_ring] %s; its handles are stale", why)
            self._drop(desc.instance)
            raise StaleHandleError(f"{why}; recompute the batch")

    def _wait_devices(self, ring: _MappedRing) -> list[torch.device]:
        """The slot's GPU, then the trainer's GPU if it is another one."""
        assert ring.slot_device is not None
        mine = self.device if self.device is not None and self.device.type == "cuda" else None
        if mine is None:
            mine = torch.device("cuda", torch.cuda.current_device())
        elif mine.index is None:
            mine = torch.device("cuda", torch.cuda.current_device())
        return [ring.slot_device] if mine == ring.slot_device else [ring.slot_device, mine]

    # -- public ---------------------------------------------------------------------------------

    def check(self, descriptor: dict, handle: dict) -> None:
        """Check that a handle may be read (without viewing it).

        Raises:
            StaleHandleError: the teacher closed the ring or died (heartbeat older than
                ``dead_after_s``), the slot was released or overwritten, or the handle is of
                another ring instance: recompute the batch.
            ValueError: a malformed descriptor or handle (naming the field), or a header that
                is not this ring's.
        """
        desc = parse_descriptor(descriptor)
        h = parse_handle(handle, desc)
        with self._lock:
            ring = self._ring(desc)
            self._check_alive(desc, ring.header_H)
            ring.table.validate(h.slot, h.generation)

    def why_dead(self, descriptor: dict) -> str | None:
        """Why the ring's teacher is gone, or None while it lives (a cheap read of the header's
        closed and heartbeat words: a trainer calls it while it waits for a result).

        Args:
            descriptor: the ring's ``LogitRingWriter.descriptor``.

        Returns:
            None if the ring is open and its heartbeat younger than ``dead_after_s``; else one
            line naming the teacher pid and the cause (closed, heartbeat age, segment gone).

        Raises:
            ValueError: a malformed descriptor, or a header that is not this ring's.
        """
        desc = parse_descriptor(descriptor)
        with self._lock:
            try:
                ring = self._ring(desc)
                self._check_alive(desc, ring.header_H)
            except StaleHandleError as e:
                return str(e)
        return None

    def slot_device(self, descriptor: dict) -> torch.device:
        """Where the ring's slots are, as this process numbers devices: the CPU (shm) or the
        teacher's GPU (cuda_ipc); maps the ring if it is not mapped yet.

        Raises:
            StaleHandleError, ValueError: as :meth:`view`, for the ring itself.
        """
        desc = parse_descriptor(descriptor)
        with self._lock:
            ring = self._ring(desc)
        return ring.slot_device if ring.slot_device is not None else torch.device("cpu")

    def view(self, descriptor: dict, handle: dict) -> torch.Tensor:
        """The published logits of a handle, in place.

        Args:
            descriptor: the ring's ``LogitRingWriter.descriptor`` (after msgpack is fine).
            handle: what ``LogitRingWriter.publish`` returned.

        Returns:
            ``[rows, length, width]``, a zero-copy view of the slot (strided: rows of the slot's
            ``[B, U, W]``): on the CPU for shm, on the teacher's GPU for cuda_ipc, where the
            current stream of the teacher's GPU waits on the slot's event and, if ``device`` is
            another GPU, its current stream waits behind that (no host sync). Valid until
            ``release``.

        Raises:
            StaleHandleError: as ``check``.
            ValueError: as ``check``; or, for cuda_ipc, the teacher's GPU is not visible here.
        """
        desc = parse_descriptor(descriptor)
        h = parse_handle(handle, desc)
        with self._lock:
            ring = self._ring(desc)
            self._check_alive(desc, ring.header_H)
            ring.table.validate(h.slot, h.generation)
            logits = ring.data_SBUW[h.slot, : h.rows, : h.length, : h.width]
            if ring.events:
                # Only a stream of the event's own GPU waits on an IPC event: a wait from
                # another GPU's stream crashes the driver (seen on H200, CUDA 13, torch 2.11).
                # The trainer's GPU waits on a local event recorded behind that wait.
                slot_stream = torch.cuda.current_stream(ring.slot_device)
                ring.events[h.slot].wait(slot_stream)
                for dev in self._wait_devices(ring)[1:]:
                    bridge = torch.cuda.Event()
                    bridge.record(slot_stream)
                    bridge.wait(torch.cuda.current_stream(dev))
        return logits

    def release(self, descriptor: dict, handle: dict) -> None:
        """Hand a slot back to the teacher (``released_gen[slot] = generation``).

        Call it after the last use of the view (after the backward). Releasing a stale handle,
        a handle of a closed or dead ring, or the same handle twice does nothing. For cuda_ipc
        the slot is freed once the work queued so far on the current stream of ``device`` (and
        of the teacher's GPU) is done, without blocking the caller.

        Raises:
            ValueError: a malformed descriptor or handle, or the reader is closed.
        """
        desc = parse_descriptor(descriptor)
        try:
            h = parse_handle(handle, desc)
            with self._lock:
                ring = self._ring(desc)
                if not ring.events:
                    ring.table.release(h.slot, h.generation)
                    return
                events = []
                for dev in self._wait_devices(ring):
                    ev = torch.cuda.Event(blocking=True)  # the helper thread sleeps, not spins
                    ev.record(torch.cuda.current_stream(dev))
                    events.append(ev)
                if self._releaser is None:
                    self._releaser = _Releaser()
                self._releaser.queue.put((events, ring.table, h.slot, h.generation))
        except StaleHandleError as e:
            logger.debug("[logit_ring] release of a stale handle ignored: %s", e)

    def verify(self, tensor: torch.Tensor, handle: dict) -> bool:
        """Whether ``tensor`` (a view, or a copy of one) holds exactly the published logits.

        Args:
            tensor: ``[rows, length, width]``.
            handle: a handle published with ``checksum=True``.

        Returns:
            True iff the shape matches the handle and the checksum matches bit for bit.

        Raises:
            ValueError: the handle carries no checksum (publish with ``checksum=True``).
        """
        expected = handle.get("checksum") if isinstance(handle, dict) else None
        if type(expected) is not int:
            raise ValueError(
                f"logit ring handle has no checksum (got {expected!r}); publish with "
                "checksum=True to verify"
            )
        shape = [handle.get("rows"), handle.get("length"), handle.get("width")]
        if list(tensor.shape) != shape:
            return False
        return checksum_of(tensor) == expected

    def close(self) -> None:
        """Wait for pending releases, then drop every mapping (views already returned stay
        valid). Idempotent."""
        with self._lock:
            self._closed = True
            releaser, self._releaser = self._releaser, None
        if releaser is not None:
            releaser.close()
        with self._lock:
            for instance in list(self._rings):
                self._drop(instance)

    def __enter__(self) -> LogitRingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
