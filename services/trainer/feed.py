"""The trainer's data feed: claims samples, asks its teacher group for their logits, hands over
micro-batches whose teacher logits are a zero-copy view of a ring slot.

Per rank (records and names: services/protocol/):

1. claim ``micro_batch * grad_accum`` samples from the partition (task ``trainer/e<epoch>/s<start>``),
   skip the keys the checkpoint says were trained (acked at once), sort by teacher length and
   split into micro-batches;
2. put one request per micro-batch into ``<partition>.teacher<group>``; up to one step of
   requests is kept ahead, so the teacher computes step k+1 while this rank trains on step k;
3. when a micro-batch is trained, wait for its record (``result<rank>``; records that already
   arrived are taken after each backward is queued, off the step's critical path), open the
   slot (``LogitRingReader.view``: the stream waits on the teacher's event) or apply the teacher's
   output layer to the hidden states; a stale handle (dead teacher, overwritten slot) or a
   checksum mismatch is never trained on: the micro-batch is requested again;
4. after its backward: release the slot (once the GPU finished reading it), ack and clear the
   record; after the optimizer step: ack the samples.

Retention (a run that reads its partition once, ``register``): the task is registered with every
claim, so the queue drops each sample once acked and a corpus larger than its ``--capacity``
streams through it. A dropped sample cannot come again, so its ack waits for a checkpoint that
holds it (:meth:`TeacherFeed.commit`): after a crash, the samples trained since the checkpoint
are trained again under the resumed launch's fresh task, as without retention. A registration
cannot be undone, so the resumed launch also consumes for the tasks of earlier launches
(``replaces``) what they still hold; samples a dead launch held leased are released that way
once their lease lapses (``lease_s``).

A record of another instance of this rank (left by a trainer that died) is released and
cleared. A teacher that does not answer within ``teacher_timeout_s`` is asked again. A request
asked again (or redelivered after its teacher died) may come after requests of later
micro-batches; when their results hold every slot of the ring, they give their slots back and are
asked again once the waiting micro-batch has its result (the teacher has a slot for it).

Legend: B samples of a micro-batch, U teacher tokens, W teacher vocab, d teacher hidden size.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from typing import Any

import torch

from services import protocol as proto
from services.protocol.end_of_data import EOF_KEY, eof_samples, put_eof
from services.protocol.names import meta_partition
from services.queue.errors import QueueError
from services.trainer.config import TrainerConfig
from services.trainer.worker import MicroBatch
from xtoken_core.data import sample as schema
from xtoken_core.wire import JaggedColumn

logger = logging.getLogger(__name__)

# Samples claimed at once when consuming for a replaced task (keys only: no fields travel).
_CONSUME_BATCH = 4096
# The end-of-data marker is importable from here too (its former home).
__all__ = ["EOF_KEY", "TeacherFeed", "meta_partition", "put_eof"]


@dataclasses.dataclass
class _Pending:
    """A micro-batch claimed and requested, waiting for (or holding) its teacher record."""

    keys: list[str]
    samples: list[dict[str, torch.Tensor]]
    leases: dict[str, Any]  # sample key -> lease id
    batch: dict[str, torch.Tensor]
    request_key: str = ""
    asked_at: float = 0.0
    record: Any = None  # (Result, fields, lease_id) once the teacher answered
    attempts: int = 0


class TeacherFeed:
    """Micro-batches of one rank with their teacher logits.

    Args:
        client: a QueueClient (this thread's).
        config: the trainer settings.
        rank: this trainer rank.
        worker: the TrainerWorker (pad ids, device, rank).
        task: consumer task name on the sample partition (epoch + resume generation).
        trained: keys trained in this epoch (the checkpoint's); skipped when claimed again.
        reader: a LogitRingReader (ring transports), or None.
        output_layer: the teacher's output layer (hidden transport), or None.
        stop: a threading.Event; set = stop waiting for data.
        register: register ``task`` for the partition (retention, PROTOCOL.md): the queue
            drops each sample once acked. Only for a partition read once (one epoch). With
            ``checkpoint_every``, acks wait for :meth:`commit`.
        replaces: name prefix of the registered tasks of earlier launches this one takes over
            (``trainer/e<epoch>/``); :meth:`commit` consumes what they hold.
    """

    def __init__(
        self,
        client: Any,
        config: TrainerConfig,
        rank: int,
        worker: Any,
        task: str,
        trained: set[str],
        *,
        reader: Any = None,
        output_layer: Any = None,
        stop: Any = None,
        register: bool = False,
        replaces: str = "",
    ) -> None:
        self.client = client
        self.config = config
        self.rank = rank
        self.worker = worker
        self.task = task
        self.trained = trained
        self.reader = reader
        self.output_layer = output_layer
        self.stop = stop
        self.register = register
        self.replaces = replaces
        # acks wait for a checkpoint that holds their samples (a registered task's are final)
        self._defer = register and config.checkpoint_every > 0
        self._unacked: list[tuple[Any, list[str]]] = []  # (lease id, keys) trained, not acked
        self._uncheckpointed: set[str] = set()  # keys trained since the last commit
        self.instance = proto.new_instance()
        self.group = rank % config.teacher_groups
        self.req_partition = proto.request_partition(config.partition, self.group)
        self.result_field = proto.result_field(rank)
        self.hidden_field = proto.hidden_field(rank)
        self.trainer_task = proto.trainer_task(rank, self.instance)
        self._seq = 0
        self._want = 0  # micro-batches kept claimed and requested ahead (set by next_step)
        self._pending: deque[_Pending] = deque()
        self._by_request: dict[str, _Pending] = {}
        self._held: dict[str, _Pending] = {}  # request key -> micro-batch holding its record
        self._deferred: list[_Pending] = []  # gave their slot back: asked again later
        self._ended = False
        self._idle_since: float | None = None
        self.counters = {"stale": 0, "checksum_mismatch": 0, "orphans": 0, "re_requests": 0}

    # ------------------------------------------------------------------ public

    def next_step(self, n: int) -> list[MicroBatch]:
        """The oldest ``n`` micro-batches (fewer at the end of the data; [] when it ended).

        Also asks for the next step's teacher logits ahead.
        """
        self._want = want = 2 * n if self.config.loss.uses_teacher else n
        while len(self._pending) < want and not self._ended and not self._stopping():
            if not self._claim(want - len(self._pending), block=len(self._pending) < n):
                break
        take = [self._pending.popleft() for _ in range(min(n, len(self._pending)))]
        return [self._micro_batch(p) for p in take]

    def _top_up(self) -> None:
        """Claim and ask ahead without waiting: called while the GPU runs a backward, so that the
        next :meth:`next_step` finds its micro-batches claimed, padded and requested."""
        while len(self._pending) < self._want and not self._ended and not self._stopping():
            if not self._claim(self._want - len(self._pending), block=False):
                break

    def ack(self, micro_batches: list[MicroBatch]) -> None:
        """Mark the samples of trained micro-batches consumed (after the optimizer step); a
        registered feed with checkpoints keeps the acks for :meth:`commit`."""
        by_lease: dict[Any, list[str]] = {}
        for mb in micro_batches:
            for key in mb.keys:
                by_lease.setdefault(mb.context.leases[key], []).append(key)
        if self._defer:
            self._unacked.extend(by_lease.items())
            self._uncheckpointed.update(k for mb in micro_batches for k in mb.keys)
        else:
            for lease_id, keys in by_lease.items():
                self.client.ack(self.config.partition, self.task, lease_id, keys)
        self.trained.update(k for mb in micro_batches for k in mb.keys)

    def commit(self) -> None:
        """After a checkpoint that holds every trained key was saved (each rank, its own):
        ack the samples trained since the previous one, and consume for the registered tasks
        of earlier launches (``replaces``) what they hold, so that the queue drops them. A
        no-op for a feed that does not register.
        """
        if not self.register:
            return
        self._consume_for_replaced()
        unacked, self._unacked = self._unacked, []
        self._uncheckpointed.clear()
        lapsed = 0
        for lease_id, keys in unacked:
            try:
                self.client.ack(self.config.partition, self.task, lease_id, keys)
            except QueueError as e:
                if e.code not in ("unknown_lease", "stale_epoch"):
                    raise
                lapsed += len(keys)  # redelivered (or gone with the queue): acked when seen
        if lapsed:
            logger.warning(
                "[trainer] the leases of %d trained samples lapsed before the checkpoint: they "
                "come again and are acked then; raise lease_s (now %gs) above the time of "
                "checkpoint_every (%d) steps",
                lapsed,
                self.config.lease_s,
                self.config.checkpoint_every,
            )

    def _consume_for_replaced(self) -> None:
        """Claim and ack, for each registered task of an earlier launch, every sample it has
        not consumed (no fields travel): this task alone holds them then."""
        if not self.replaces:
            return
        part = self.client.stats()["partitions"].get(self.config.partition, {})
        for task in part.get("registered", []):
            if task == self.task or not task.startswith(self.replaces):
                continue
            while True:
                got = self.client.claim(
                    self.config.partition,
                    task,
                    [],
                    _CONSUME_BATCH,
                    fields=[],
                    timeout_s=0.001,
                    lease_s=self.config.lease_s,
                )
                if not got["keys"]:
                    break
                self.client.ack(self.config.partition, task, got["lease_id"])

    def give_back(self, micro_batches: list[MicroBatch] = ()) -> None:
        """Stop: return every sample claimed but not trained, release held slots."""
        pend = list(self._pending) + [mb.context for mb in micro_batches]
        self._pending.clear()
        self._deferred.clear()
        for p in pend:
            if p.record is not None:
                self._drop_record(p)
            for lease_id, keys in _group(p.leases).items():
                try:
                    self.client.nack(self.config.partition, self.task, lease_id, keys)
                except QueueError as e:
                    logger.warning("[trainer] could not give back lease %s: %s", lease_id, e)

    @property
    def ended(self) -> bool:
        """The data of this epoch ended for this rank (nothing left to claim)."""
        return self._ended and not self._pending

    # ------------------------------------------------------------------ samples

    def _stopping(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    def _claim(self, micro_batches: int, block: bool) -> bool:
        """Claim up to ``micro_batches`` micro-batches of samples; False when none came."""
        cfg = self.config
        got = self.client.claim(
            cfg.partition,
            self.task,
            schema.FIELD_NAMES,
            micro_batches * cfg.micro_batch,
            timeout_s=cfg.claim_timeout_s if block else 0.001,
            lease_s=cfg.lease_s,
            register=self.register,  # with every claim: a restarted queue forgot it
        )
        keys = list(got["keys"])
        if not keys:
            if block:
                self._check_end()
            return False
        self._idle_since = None
        lease_id = got["lease_id"]
        rows = _rows(got["fields"], len(keys))
        fresh = [(k, r) for k, r in zip(keys, rows) if k not in self.trained]
        seen = [k for k in keys if k in self.trained]
        if seen:  # trained before (the checkpoint we resumed from, or a lease that lapsed)
            later = [k for k in seen if k in self._uncheckpointed]
            if later:  # in no checkpoint yet: acked by the next commit
                self._unacked.append((lease_id, later))
            if len(later) < len(seen):
                done = [k for k in seen if k not in self._uncheckpointed]
                self.client.ack(cfg.partition, self.task, lease_id, done)
        fresh.sort(key=lambda kr: -int(kr[1]["teacher_input_lengths"]))
        for i in range(0, len(fresh), cfg.micro_batch):
            group = fresh[i : i + cfg.micro_batch]
            p = _Pending(
                keys=[k for k, _ in group],
                samples=[r for _, r in group],
                leases={k: lease_id for k, _ in group},
                batch=self._pad([r for _, r in group]),
            )
            if cfg.loss.uses_teacher:
                self._request(p)
            self._pending.append(p)
        return bool(fresh) or bool(seen)

    def _pad(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return schema.pad_samples(
            samples,
            student_pad_id=self.worker.student_pad_id,
            teacher_pad_id=self.worker.teacher_pad_id,
        )

    def _check_end(self) -> None:
        """Decide whether this epoch's data ended for this rank."""
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        idle = self.config.idle_timeout_s
        if idle is not None and now - self._idle_since >= idle:
            logger.info("[trainer] no data for %.0fs (idle_timeout_s): epoch ends", idle)
            self._ended = True
            return
        try:
            marker = self.client.get(meta_partition(self.config.partition), [EOF_KEY])
        except QueueError as e:
            if e.code in ("not_found", "missing_field"):
                return  # the collators are not done
            raise
        total = eof_samples(marker["fields"])
        status = self.client.status(self.config.partition, self.task)
        # samples retention dropped (acked by every registered task) were put too
        put = status["samples"] + status.get("dropped", 0)
        if status["pending"] == 0 and put >= total:
            self._ended = True

    # ------------------------------------------------------------------ teacher

    def _request(self, p: _Pending) -> None:
        self._seq += 1
        p.request_key = f"{self.instance}:{self._seq}"
        p.asked_at = time.monotonic()
        p.attempts += 1
        rows = [s["teacher_input_ids"] for s in p.samples]
        self.client.put(self.req_partition, [p.request_key], proto.request_fields(rows, self.rank))
        self._by_request[p.request_key] = p

    def _micro_batch(self, p: _Pending) -> MicroBatch:
        mb = MicroBatch(keys=p.keys, batch=p.batch, context=p)
        if self.config.loss.uses_teacher:
            mb.teacher_logits = lambda: self._logits(p)
            mb.done = lambda: self._done(p)
        return mb

    def _logits(self, p: _Pending) -> torch.Tensor:
        """Block until the teacher logits of ``p`` are valid; returns ``[B, U, W]``."""
        while True:
            while p.record is None:
                self._poll_records(p)
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
                self._drop_record(p)
                self._request(p)

    def _open(self, p: _Pending, result: proto.Result, fields: dict) -> torch.Tensor:
        B, U = p.batch["teacher_input_ids"].shape
        if result.rows != B or result.length != U:
            raise ValueError(
                f"teacher result {p.request_key!r} is {result.rows} x {result.length}, the "
                f"micro-batch is {B} x {U}"
            )
        device = self.worker.device
        if result.transport == "hidden":
            hidden_BUd = proto.hidden_from_column(
                fields[self.hidden_field], B, U, p.request_key
            ).to(device, non_blocking=True)
            with torch.no_grad():
                return self.output_layer(hidden_BUd.to(self.output_layer.weight.dtype))
        logits_BUW = self.reader.view(result.descriptor, result.handle)
        if self.config.verify_logits and not self.reader.verify(logits_BUW, result.handle):
            raise _ChecksumError(f"slot of {p.request_key!r} does not match its checksum")
        if logits_BUW.device != device:  # a teacher on another GPU of the node: one P2P copy
            logits_BUW = logits_BUW.to(device, non_blocking=True)
        return logits_BUW

    def _poll_records(self, waiting: _Pending) -> None:
        self._claim_records(self.config.claim_timeout_s)
        if waiting.record is None:
            self._free_ring_for(waiting)
        if (
            waiting.record is None
            and time.monotonic() - waiting.asked_at > self.config.teacher_timeout_s
        ):
            self.counters["re_requests"] += 1
            logger.warning(
                "[trainer] no teacher result for %s in %.0fs (teacher_timeout_s): asking again",
                waiting.request_key,
                self.config.teacher_timeout_s,
            )
            self._by_request.pop(waiting.request_key, None)
            self._request(waiting)

    def _claim_records(self, timeout_s: float) -> None:
        """Take the teacher's result records that arrived (the server waits up to ``timeout_s``
        for the first) and attach each to its micro-batch."""
        got = self.client.claim(
            self.req_partition,
            self.trainer_task,
            [self.result_field],
            4,
            fields=[self.result_field]
            + ([self.hidden_field] if self.output_layer is not None else []),
            timeout_s=timeout_s,
            lease_s=self.config.lease_s,
        )
        keys = list(got["keys"])
        for i, key in enumerate(keys):
            result = proto.Result.from_blob(_row_column(got["fields"][self.result_field], i), key)
            fields = {}
            if self.hidden_field in got["fields"]:
                fields[self.hidden_field] = _row_column(got["fields"][self.hidden_field], i)
            p = self._by_request.pop(key, None)
            record = (result, fields, got["lease_id"])
            if p is None:  # another instance's, or a request we asked again
                self._drop(key, record)
                continue
            p.record = record
            self._held[key] = p

    def _free_ring_for(self, waiting: _Pending) -> None:
        """Give back the slots of later micro-batches when their results fill a ring.

        The teacher computes a request only into a free slot of this rank's ring, and this rank
        frees slots in micro-batch order, so later results holding every slot while ``waiting``
        has none would wait for each other forever.
        """
        by_ring: dict[Any, list[_Pending]] = {}
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
                self._drop_record(p)
                self._deferred.append(p)

    def _ask_deferred(self) -> None:
        """Ask again for the micro-batches that gave their slots back."""
        while self._deferred:
            self.counters["re_requests"] += 1
            self._request(self._deferred.pop(0))

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

    def _drop_record(self, p: _Pending) -> None:
        self._drop(p.request_key, p.record)
        self.counters["orphans"] -= 1
        self._held.pop(p.request_key, None)
        p.record = None

    def _done(self, p: _Pending) -> None:
        """After the backward of ``p`` was queued: release its slot (the reader frees it once the
        GPU work that reads it completed), ack and clear the record."""
        result, _, lease_id = p.record
        self._held.pop(p.request_key, None)
        if result.handle is not None:
            self.reader.release(result.descriptor, result.handle)
        self.client.ack(self.req_partition, self.trainer_task, lease_id, [p.request_key])
        self.client.clear(self.req_partition, [p.request_key])
        self._top_up()
        if self._by_request:
            # while the device runs this backward: take the results that already arrived, so
            # the next micro-batch opens its slot without a queue round trip in its step
            self._claim_records(0.0)


class _ChecksumError(RuntimeError):
    """A slot's contents differ from the checksum its teacher published."""


def _group(leases: dict[str, Any]) -> dict[Any, list[str]]:
    out: dict[Any, list[str]] = {}
    for key, lease_id in leases.items():
        out.setdefault(lease_id, []).append(key)
    return out


def _row_column(column: JaggedColumn, i: int) -> JaggedColumn:
    row = column.row(i)
    return JaggedColumn(row, torch.tensor([0, row.shape[0]], dtype=torch.int64))


def _rows(fields: dict[str, Any], n: int) -> list[dict[str, torch.Tensor]]:
    """Split claimed fields of N samples into N jagged samples (1-d / 0-d tensors)."""
    rows: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
    for name, value in fields.items():
        if isinstance(value, JaggedColumn):
            for i in range(n):
                rows[i][name] = value.row(i)
        else:
            for i in range(n):
                rows[i][name] = value[i]
    return rows
