"""The trainer's teacher client: asks its teacher group for the logits of a micro-batch, opens
the result (a zero-copy view of a ring slot, the teacher's output layer applied to hidden
states, or dense teacher logits decoded from top-K targets), releases the slot once the
backward read it.

Per rank and teacher of the loss (records and names: services/protocol/); a loss of several
teachers has one client per teacher, each asking its own teacher's groups:

1. put one request per micro-batch into ``<partition>.teacher<group>`` (a further teacher ``j``:
   ``<partition>.t<j>.teacher<group>``);
2. wait for its record (``result<rank>``; records that already arrived are taken after each
   backward is queued, off the step's critical path), open the slot (``LogitRingReader.view``:
   the stream waits on the teacher's event), apply the teacher's output layer to the hidden
   states, or decode the top-K targets (``xtoken_core.wire.topk``: the rest mass spread evenly
   over the other ids, the log-partition added back); a stale handle (dead teacher, overwritten
   slot) or a checksum mismatch is never trained on: the micro-batch is requested again;
3. after its backward: release the slot (once the GPU finished reading it), ack and clear the
   record.

A record of another instance of this rank (left by a trainer that died) is released and
cleared. A request the teacher claimed is leased to it for its ``lease_s``: should it die, the
request would reach its successor only then. So every request remembers the teacher incarnation
that served the group when it was put (``Result.teacher`` of the results seen so far), and once
that incarnation is gone, the requests put under it (or before any result) that have no result
are put again at once, for the successor. An incarnation is gone when

* the heartbeat of its ring (the ring of this rank it wrote results into), watched while the
  rank waits, is older than ``teacher.dead_after_s``, or the ring closed;
* a result of another incarnation arrives: a group has one teacher at a time, so a successor
  serves now. A successor that is ready before the death shows in the heartbeat (and serves
  requests the dead one had not claimed) reveals it at once; for the hidden and topk
  transports, which have no ring, this is the only sign.

The old records stay in the queue (the successor may already have written a result on one, whose
ring slot a clear would lose); their results, when they come, are dropped, their slots released,
never trained on (one the dead teacher held is computed once more when its lease ends). A teacher
that does not answer within ``teacher.timeout_s`` is asked again (the fallback for a teacher that
died before this rank saw a result of it: no incarnation of the group is known to have gone). A
request asked again (or redelivered after its teacher died) may come after requests of later
micro-batches; when their results hold every slot of the ring, they give their slots back and are
asked again once the waiting micro-batch has its result (the teacher has a slot for it).

The fields a record's result needs beyond ``result<rank>`` are claimed with it: ``hidden<rank>``
when the trainer has the teacher's output layer; the four ``topk`` fields once a topk result
was seen (the first topk records of a run have theirs fetched by key, one ``get`` per claim).

Legend: B rows of a micro-batch, U teacher tokens, W teacher vocab, d teacher hidden size.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from services import protocol as proto
from services.common import lifecycle
from services.trainer.sections import TeacherLinkConfig
from xtoken_core.ops import transfer
from xtoken_core.wire import JaggedColumn

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Asked:
    """What this rank asked its teacher group for one micro-batch, and the answer.

    Attributes:
        rows: the B teacher-id rows of the request.
        positions: packed rows: their B position rows (restarting per document), else None.
        shape: ``(B, U)`` of the micro-batch's padded teacher ids (the result must match).
        request_key: the key of the latest request record (``<instance>:<seq>``).
        asked_at: when it was put (``time.monotonic``).
        record: ``(Result, fields, lease id)`` once the teacher answered, else None.
        attempts: requests put so far.
        teacher: the teacher incarnation that served the group when it was put (None: none
            was known).
    """

    rows: list[torch.Tensor] = dataclasses.field(default_factory=list)
    positions: list[torch.Tensor] | None = None
    shape: tuple[int, int] = (0, 0)
    request_key: str = ""
    asked_at: float = 0.0
    record: Any = None
    attempts: int = 0
    teacher: str | None = None
    prefetched: Any = None  # (record, logits on the trainer's GPU, their copy's event)


# Seconds between two reads of the teacher announcements while a rank waits for a result.
ANNOUNCEMENTS_EVERY_S = 1.0


class TeacherClient:
    """One rank's requests to its teacher group and their results.

    Args:
        client: a QueueClient (this thread's).
        config: the trainer's teacher section.
        partition: the run's sample partition (its teacher groups' request partitions are
            named after it).
        rank: this trainer rank (its group is ``rank % config.groups``).
        device: this rank's device (the logits' destination).
        lease_s: lease of the claimed result records (the feed's ``lease_s``).
        claim_timeout_s: server-side wait of a claim of results (the feed's).
        reader: a LogitRingReader (ring transports), or None.
        output_layer: the teacher's output layer (hidden transport), or None.
        index: the teacher's place in the loss's list (0: the first): its groups' request
            partitions and announcements are its own.
    """

    def __init__(
        self,
        client: Any,
        config: TeacherLinkConfig,
        partition: str,
        rank: int,
        device: torch.device,
        *,
        lease_s: float,
        claim_timeout_s: float,
        reader: Any = None,
        output_layer: Any = None,
        index: int = 0,
    ) -> None:
        self.client = client
        self.config = config
        self.partition = partition
        self.index = index
        self.lease_s, self.claim_timeout_s = lease_s, claim_timeout_s
        self.rank = rank
        self.device = device
        self.reader = reader
        self.output_layer = output_layer
        self.instance = proto.new_instance()
        self.group = rank % config.groups
        self.req_partition = proto.request_partition(partition, self.group, index)
        self.result_field = proto.result_field(rank)
        self.hidden_field = proto.hidden_field(rank)
        self.topk_fields = proto.topk_fields(rank)
        # claimed with each result: the hidden states when we hold the teacher's output layer;
        # the topk fields join once a topk result was seen (claim_records)
        self.claimed_fields = [self.result_field]
        if output_layer is not None:
            self.claimed_fields.append(self.hidden_field)
        self.trainer_task = proto.trainer_task(rank, self.instance)
        self._seq = 0
        self._by_request: dict[str, Asked] = {}
        self._held: dict[str, Asked] = {}  # request key -> micro-batch holding its record
        self.deferred: list[Asked] = []  # gave their slot back: asked again later
        self.teacher: str | None = None  # the incarnation serving the group (None: none known)
        self._ring: dict | None = None  # the descriptor of its ring of this rank (None: none yet)
        self._gone: set[str] = set()  # incarnations found dead or replaced
        self.counters = {"stale": 0, "checksum_mismatch": 0, "orphans": 0, "re_requests": 0}
        self._copy_stream: torch.cuda.Stream | None = None  # peer copies beside the forward
        self._slot_devices: dict[str | None, torch.device] = {}  # ring device per incarnation
        # the teacher serving the group now, if one announced itself: the requests are stamped
        # with it from the first (its predecessors are gone)
        announced = proto.teacher_incarnations(client, partition, self.group, index)
        if announced:
            self.teacher = announced[-1]
            self._gone.update(announced[:-1])
        self._announcements_at = time.monotonic()  # when they were last read

    @property
    def waiting(self) -> bool:
        """Some request has no result yet."""
        return bool(self._by_request)

    def ask(self, p: Asked) -> None:
        """Put a (new) request record for ``p``."""
        self._seq += 1
        p.request_key = f"{self.instance}:{self._seq}"
        p.asked_at = time.monotonic()
        p.attempts += 1
        p.teacher = self.teacher
        self.client.put(
            self.req_partition,
            [p.request_key],
            proto.request_fields(p.rows, self.rank, positions=p.positions),
        )
        self._by_request[p.request_key] = p

    def logits(self, p: Asked) -> Any:
        """Block until the teacher logits of ``p`` are valid.

        Returns:
            ``[B, U, W]`` on this rank's device; the ``topk`` transport's targets as a
            :class:`~xtoken_core.losses.sparse_teacher.SparseTeacher` there.

        Raises:
            RuntimeError: the teacher refused the request.
            ValueError: the result does not match the micro-batch's shape.
        """
        if p.prefetched is not None:
            record, logits_BUW, copied = p.prefetched
            p.prefetched = None
            if record is p.record:
                stream = torch.cuda.current_stream(logits_BUW.device)
                stream.wait_event(copied)
                logits_BUW.record_stream(stream)  # allocated on the copy stream, read here
                return logits_BUW
        while True:
            while p.record is None:
                self.poll(p)
            self._ask_deferred()
            result, fields, _ = p.record
            if result.error:
                raise RuntimeError(f"the teacher refused a request: {result.error}")
            try:
                return self._open(p, result, fields)
            except Exception as e:
                from xtoken_core.ipc.logit_ring import StaleHandleError

                if not isinstance(e, StaleHandleError | _ChecksumError):
                    raise
                self.counters[
                    "stale" if isinstance(e, StaleHandleError) else "checksum_mismatch"
                ] += 1
                logger.warning("[trainer] %s: asking the teacher again", e)
                self._watch(result.teacher, result.descriptor)  # a dead ring: its teacher is gone
                self.drop_record(p)
                self.ask(p)

    def prefetch(self, p: Asked) -> None:
        """Start the peer copy of ``p``'s logits to the trainer's GPU now, when its result
        already arrived from a teacher on another GPU: called before the micro-batch's forward,
        the copy (on a stream of its own) runs beside the forward instead of after it, and
        :meth:`logits` only makes the step's stream wait for it. Anything else (no result yet,
        the teacher on this GPU, the hidden transport, a stale handle) is left to
        :meth:`logits`."""
        device = self.device
        if p.record is None or p.prefetched is not None or device.type != "cuda":
            return
        result, fields, _ = p.record
        if result.error or result.handle is None or self.config.verify_logits:
            return
        try:
            where = self._slot_devices.get(result.teacher)
            if where is None:  # one ring per incarnation: its device is looked up once
                where = self._slot_devices[result.teacher] = self.reader.slot_device(
                    result.descriptor
                )
            if where.type != "cuda" or where == device:
                return
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(device)
            with torch.cuda.stream(self._copy_stream):
                # the copy runs on the teacher GPU's stream once that waited for the slot, and
                # this stream waits for the copy; the forward on the step's stream is not behind
                logits_BUW = self._open(p, result, fields)
                copied = torch.cuda.Event()
                copied.record(self._copy_stream)
        except Exception:  # a stale handle, a dead ring, a bad shape: logits() meets it again
            return
        p.prefetched = (p.record, logits_BUW, copied)

    def done(self, p: Asked) -> None:
        """After the backward of ``p`` was queued: release its slot (the reader frees it once the
        GPU work that reads it completed), ack and clear the record."""
        result, _, lease_id = p.record
        self._held.pop(p.request_key, None)
        if result.handle is not None:
            self.reader.release(result.descriptor, result.handle)
        self.client.ack(self.req_partition, self.trainer_task, lease_id, [p.request_key])
        self.client.clear(self.req_partition, [p.request_key])

    def check_successor(self) -> None:
        """Read the group's teacher announcements (``services/protocol/incarnation.py``), at
        most every :data:`ANNOUNCEMENTS_EVERY_S`: a teacher newer than the serving one replaced
        it (a group has one teacher at a time), so the requests put under the old one (or before
        any teacher was known) are asked again now, not when their lease ends. This is how a
        teacher that died before this rank saw a result of it is noticed."""
        now = time.monotonic()
        if now - self._announcements_at < ANNOUNCEMENTS_EVERY_S:
            return
        self._announcements_at = now
        announced = proto.teacher_incarnations(self.client, self.partition, self.group, self.index)
        if not announced or announced[-1] in self._gone:
            return
        newest, replaced = announced[-1], [t for t in announced[:-1] if t not in self._gone]
        if newest != self.teacher:  # requests asked again from here on are stamped with it
            self.teacher, self._ring = newest, None
        for old in replaced:
            self._gone_teacher(old, f"teacher {old} was replaced by teacher {newest}")

    def poll(self, waiting: Asked) -> None:
        """One round of the wait for ``waiting``'s result: take the records that arrived, free
        the ring for it when later results fill it, ask again after ``teacher.timeout_s``.

        Each round tells the heartbeat the main loop is alive (a teacher's start-up may take
        longer than ``hang_after_s``; a round that never returns is still a hang)."""
        lifecycle.waiting()
        self.claim_records(self.claim_timeout_s)
        if waiting.record is None:
            self.check_successor()
        if waiting.record is None:
            self._free_ring_for(waiting)
        if waiting.record is None and self.teacher is not None:
            self._watch(self.teacher, self._ring)
        if waiting.record is None and time.monotonic() - waiting.asked_at > self.config.timeout_s:
            self.counters["re_requests"] += 1
            logger.warning(
                "[trainer] no teacher result for %s in %.0fs (trainer.%s.timeout_s): asking again",
                waiting.request_key,
                self.config.timeout_s,
                "teacher" if self.index == 0 else f"extra_teachers[{self.index - 1}]",
            )
            self._by_request.pop(waiting.request_key, None)
            self.ask(waiting)

    def claim_records(self, timeout_s: float) -> None:
        """Take the teacher's result records that arrived (the server waits up to ``timeout_s``
        for the first) and attach each to its micro-batch."""
        got = self.client.claim(
            self.req_partition,
            self.trainer_task,
            [self.result_field],
            4,
            fields=list(self.claimed_fields),
            timeout_s=timeout_s,
            lease_s=self.lease_s,
        )
        keys = list(got["keys"])
        results = [
            proto.Result.from_blob(_row_column(got["fields"][self.result_field], i), key)
            for i, key in enumerate(keys)
        ]
        extra = [f for f in self.claimed_fields if f != self.result_field]
        by_key = [
            {name: _row_column(got["fields"][name], i) for name in extra} for i in range(len(keys))
        ]
        self._fetch_topk(keys, results, by_key)
        teachers: list[tuple[str, dict | None]] = []
        for key, result, fields in zip(keys, results, by_key, strict=True):
            p = self._by_request.pop(key, None)
            record = (result, fields, got["lease_id"])
            if p is None:  # another instance's, or a request we asked again
                self._drop(key, record)
                continue
            p.record = record
            self._held[key] = p
            teachers.append((result.teacher, result.descriptor if result.handle else None))
        for teacher, descriptor in teachers:  # after every record of the round is attached
            self._seen(teacher, descriptor)

    def _fetch_topk(
        self, keys: list[str], results: list[proto.Result], by_key: list[dict[str, Any]]
    ) -> None:
        """Add the topk fields to the claimed records of topk results that lack them (the first
        topk records this rank meets): one ``get`` by key; later claims take them along."""
        missing = [
            i
            for i, result in enumerate(results)
            if result.transport == "topk" and self.topk_fields[0] not in by_key[i]
        ]
        if not missing:
            return
        got = self.client.get(
            self.req_partition, [keys[i] for i in missing], fields=list(self.topk_fields)
        )
        row = {key: j for j, key in enumerate(got["keys"])}
        for i in missing:
            for name in self.topk_fields:
                by_key[i][name] = _row_column(got["fields"][name], row[keys[i]])
        self.claimed_fields += [f for f in self.topk_fields if f not in self.claimed_fields]

    def _seen(self, teacher: str, descriptor: dict | None) -> None:
        """A result of incarnation ``teacher`` (its ring's ``descriptor``, None for the hidden
        transport) arrived: watch its ring; another incarnation than the serving one replaced
        it (a group has one teacher at a time), whose requests are asked again now."""
        if teacher in self._gone:  # a late result of a dead teacher
            return
        if teacher != self.teacher:
            before, self.teacher, self._ring = self.teacher, teacher, None
            if before is not None:
                self._gone_teacher(before, f"teacher {before} was replaced by teacher {teacher}")
        if descriptor is not None and self._ring is None:
            self._ring = descriptor

    def _watch(self, teacher: str, descriptor: dict | None) -> None:
        """Check the ring ``descriptor`` of incarnation ``teacher``: dead or closed, the teacher
        is gone (a cheap read of the ring's header)."""
        if descriptor is None or self.reader is None or teacher in self._gone:
            return
        why = self.reader.why_dead(descriptor)
        if why is not None:
            self._gone_teacher(teacher, why)

    def _gone_teacher(self, teacher: str, why: str) -> None:
        """Incarnation ``teacher`` serves no more: put again, at once, the requests put under it
        (or before any result) that have no result.

        Its request lease would keep them from its successor for the teacher's ``lease_s``. The
        old records stay: the successor may already have written a result on one (it claimed
        the requests the dead one had not), and clearing that record would lose the ring slot
        its result holds. A result of an old record is dropped when it comes, its slot released,
        never trained on; one the dead teacher held is computed once more when its lease ends.
        """
        self._gone.add(teacher)
        if self.teacher == teacher:
            self.teacher = self._ring = None
        again = [p for p in self._by_request.values() if p.teacher in (teacher, None)]
        logger.warning(
            "[trainer] %s: asking its successor again for %d request(s)", why, len(again)
        )
        for p in again:
            self._by_request.pop(p.request_key, None)
            self.counters["re_requests"] += 1
            self.ask(p)

    def drop_record(self, p: Asked) -> None:
        """Release and clear the record ``p`` holds (it is not trained on)."""
        self._drop(p.request_key, p.record)
        self.counters["orphans"] -= 1
        self._held.pop(p.request_key, None)
        p.record = None
        p.prefetched = None

    def _open(self, p: Asked, result: proto.Result, fields: dict) -> Any:
        B, U = p.shape
        if result.rows != B or result.length != U:
            raise ValueError(
                f"teacher result {p.request_key!r} is {result.rows} x {result.length}, the "
                f"micro-batch is {B} x {U}"
            )
        device = self.device
        if result.transport == "hidden":
            hidden_BUd = transfer.to_device(
                proto.hidden_from_column(fields[self.hidden_field], B, U, p.request_key), device
            )
            with torch.no_grad():
                return self.output_layer(hidden_BUd.to(self.output_layer.weight.dtype))
        if result.transport == "topk":
            from xtoken_core.losses.sparse_teacher import SparseTeacher

            columns = [fields[name] for name in self.topk_fields]
            targets = proto.topk_from_columns(columns, B, U, p.request_key)
            try:  # the loss decodes them where its mode reads whole rows
                return SparseTeacher.from_targets(targets, result.width, device=device)
            except ValueError as e:
                raise ValueError(f"top-k targets of request {p.request_key!r}: {e}") from None
        logits_BUW = self.reader.view(result.descriptor, result.handle)
        if self.config.verify_logits and not self.reader.verify(logits_BUW, result.handle):
            raise _ChecksumError(f"slot of {p.request_key!r} does not match its checksum")
        if logits_BUW.device != device:  # a teacher on another GPU of the node: one P2P copy
            logits_BUW = logits_BUW.to(device, non_blocking=True)
        return logits_BUW

    def _free_ring_for(self, waiting: Asked) -> None:
        """Give back the slots of later micro-batches when their results fill a ring.

        The teacher computes a request only into a free slot of this rank's ring, and this rank
        frees slots in micro-batch order, so later results holding every slot while ``waiting``
        has none would wait for each other forever.
        """
        by_ring: dict[Any, list[Asked]] = {}
        for p in self._held.values():
            result = p.record[0]
            if p is not waiting and result.handle is not None:
                by_ring.setdefault(result.descriptor.get("instance"), []).append(p)
        for held in by_ring.values():
            if len(held) < int(held[0].record[0].descriptor.get("num_slots", 0)):
                continue
            logger.warning(
                "[trainer] results of %d later micro-batches hold every slot of their ring while "
                "%s waits: giving them back, asking again after it",
                len(held),
                waiting.request_key,
            )
            for p in held:
                self.drop_record(p)
                self.deferred.append(p)

    def _ask_deferred(self) -> None:
        """Ask again for the micro-batches that gave their slots back."""
        while self.deferred:
            self.counters["re_requests"] += 1
            self.ask(self.deferred.pop(0))

    def _drop(self, key: str, record: tuple) -> None:
        """Release and clear a record nobody will train on."""
        self.counters["orphans"] += 1
        result, _, lease_id = record
        if result.handle is not None and self.reader is not None:
            try:
                self.reader.release(result.descriptor, result.handle)
            except Exception as e:  # a dead teacher's ring: nothing to release
                logger.debug("release of orphan %s: %s", key, e)
        self.client.ack(self.req_partition, self.trainer_task, lease_id, [key])
        self.client.clear(self.req_partition, [key])


class _ChecksumError(RuntimeError):
    """A slot's contents differ from the checksum its teacher published."""


def _row_column(column: JaggedColumn, i: int) -> JaggedColumn:
    row = column.row(i)
    return JaggedColumn(row, torch.tensor([0, row.shape[0]], dtype=torch.int64))
