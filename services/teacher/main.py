"""Teacher process shell: queue client, claim loop, results written back, lifecycle.

Claims requests of its group (``<partition>.teacher<group>``, or
``<partition>.t<j>.teacher<group>`` for the run's teacher j >= 1; task ``teacher``) into a small
backlog, serves the oldest one whose trainer rank has a free ring slot with
:class:`~services.teacher.worker.TeacherWorker`, together with the other waiting requests that
share its forward (:meth:`~services.teacher.worker.TeacherWorker.fits`: same length, up to
``forward_rows`` rows, each with a free slot of its own rank), each rank's requests in the order
they were claimed (:func:`_next_batch`), writes each one's result fields onto its record and
acks it. A request is acked only after its result is stored, so a teacher
killed mid-request leaves it leased: it is redelivered to a restarted teacher when the lease ends.
A malformed request gets an error result (the trainer raises it) and the loop goes on.

A tensor-parallel group (``teacher.tensor_parallel`` > 1, started by torchrun) serves the same
way from its rank 0; the other ranks follow it (services/teacher/tensor_parallel.py).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from services import protocol as proto
from services.common import lifecycle
from services.common.lifecycle import Lifecycle
from services.common.metrics import JsonlWriter, device_memory_mb, device_reserved_mb
from services.queue.client import connect
from services.queue.errors import QueueError
from services.teacher.config import TeacherConfig, teacher_name
from services.teacher.worker import TeacherWorker
from xtoken_core.data.corpus import read_texts
from xtoken_core.wire.topk import check_top_k

logger = logging.getLogger(__name__)


def serve(config: TeacherConfig, lc: Lifecycle) -> int:
    """Serve requests until stopped (metrics under ``config.run_dir``, if set); returns 0.

    With ``teacher.tensor_parallel`` > 1 (or under torchrun) this process is one rank of a
    tensor-parallel group (:func:`_serve_group`).
    """
    # bad input first: a held-out file without text fails before the queue and the model
    texts = (  # eval_texts 0: no held-out eval
        read_texts(config.heldout, config.eval_texts)
        if config.heldout and config.eval_texts
        else []
    )
    if config.tensor_parallel > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return _serve_group(config, lc, texts)
    return _serve_queue(config, lc, texts, TeacherWorker)


def _serve_group(config: TeacherConfig, lc: Lifecycle, texts: list[str]) -> int:
    """One rank of a tensor-parallel group: rank 0 serves the queue as one teacher does, the
    others serve what it sends them; the settings are checked against torchrun's group and the
    model's shapes before any weight is loaded."""
    from services.teacher import tensor_parallel as tp

    tp.check_world_size(config)
    shapes, _ = tp.model_config(config.model, config.vocab_size)
    group = tp.TeacherGroup.start(config, shapes)
    try:
        if group.rank == 0:
            return _serve_queue(config, lc, texts, lambda c: tp.TensorParallelTeacher(c, group))
        with tp.TensorParallelTeacher(config, group) as worker:
            if texts:
                worker.evaluate(texts)
            lc.ready(rank=group.rank, tensor_parallel=group.size)
            worker.follow()
        return 0
    finally:
        group.close()


def _serve_queue(config: TeacherConfig, lc: Lifecycle, texts: list[str], make_worker) -> int:
    """Serve the queue with ``make_worker(config)`` until stopped; returns 0."""
    name = teacher_name(config.teacher, config.group)
    # stopping, it tries nothing twice: a queue that went away costs no retries
    client = connect(config.queue, timeout_s=config.queue_timeout_s, name=name, stopping=lc.stop)
    partition = proto.request_partition(config.partition, config.group, config.teacher)
    with make_worker(config) as worker:
        if config.transport == "topk":  # bad settings, before serving: exit 2 with one line
            check_top_k(config.top_k, worker.width)
        metrics = None
        if config.run_dir:
            metrics = JsonlWriter(
                Path(config.run_dir) / "metrics" / metrics_name(config),
                group=config.group,
                instance=worker.instance,
            )
        if texts:
            result = worker.evaluate(texts)
            logger.info("[teacher] held-out %.4f bits/byte", result["bits_per_byte"])
            if metrics is not None:
                metrics.write("eval", who="teacher", **result)
        lc.ready(instance=worker.instance, transport=config.transport, width=worker.width)
        # the trainers ask this teacher again for what a dead predecessor held leased
        proto.announce_teacher(
            client, config.partition, config.group, worker.instance, config.teacher
        )
        logger.info(
            "[teacher] %s serving %s (%s, %s on %s)",
            worker.instance,
            partition,
            config.model,
            config.transport,
            config.device,
        )
        try:
            _loop(client, worker, partition, config, lc, metrics)
        except QueueError as e:
            if not lc.stop.is_set():
                raise
            # the run stops its queue last, but a queue may go first (a shared one, or all of a
            # run's processes told at once when its launcher died): a stop, not a failure
            logger.info("[teacher] the queue went away while stopping: %s", e)
        finally:
            if metrics is not None:
                metrics.close()
            client.close()
    return 0


def metrics_name(config: TeacherConfig) -> str:
    """The metrics file of a teacher group: ``teacher.group<g>.jsonl``; the run's teacher j >= 1
    writes ``t<j>.teacher.group<g>.jsonl``."""
    prefix = f"t{config.teacher}." if config.teacher else ""
    return f"{prefix}teacher.group{config.group}.jsonl"


# Most requests held claimed at once (waiting for their rank's ring to free a slot).
BACKLOG = 16
# Server-side wait of a claim while the backlog has requests none of whose rings has a slot.
BUSY_CLAIM_S = 0.02


def _loop(
    client, worker: TeacherWorker, partition: str, config: TeacherConfig, lc, metrics
) -> None:
    """Claim requests into a backlog; serve the oldest one whose rank's ring has a free slot,
    with the waiting requests that share its forward (:func:`_next_batch`).

    A rank whose slots are all held (its trainer is busy, or waits in a collective for another
    rank) never blocks the requests of the other ranks (no head-of-line blocking).
    """
    backlog: dict[str, tuple[Any, Any]] = {}  # key -> (request | error, lease id), oldest first
    while not lc.stop.is_set():
        lifecycle.progress()  # the heartbeat shows a loop that moves (a hung one is restarted)
        batch = _next_batch(worker, backlog)
        if batch:
            _serve_batch(client, worker, partition, batch, metrics)
            continue
        worker.idle()
        if len(backlog) < BACKLOG:
            got = client.claim(
                partition,
                proto.TEACHER_TASK,
                ["teacher_input_ids"],
                min(4, BACKLOG - len(backlog)),
                fields=list(proto.REQUEST_FIELDS)
                + ([proto.POSITIONS_FIELD] if config.pack else []),
                timeout_s=BUSY_CLAIM_S if backlog else config.claim_timeout_s,
                lease_s=config.lease_s,
            )
            for i, key in enumerate(got["keys"]):
                if key not in backlog:
                    backlog[key] = (_decode(got["fields"], key, i, worker), got["lease_id"])
        else:
            lc.stop.wait(BUSY_CLAIM_S)
    _give_back(client, partition, backlog)


def _next_batch(worker: TeacherWorker, backlog: dict[str, tuple[Any, Any]]) -> list[tuple]:
    """Take from ``backlog`` what the next forward serves: ``[(key, request, lease id, slot)]``.

    The oldest request whose rank has a free slot, and after it every other waiting request that
    :meth:`TeacherWorker.fits` with it and whose rank has a free slot too (each holds its slot
    from here). A malformed or refused request is taken alone (slot None): it gets its error
    reply in its own turn. Empty: nothing can be served now.

    A rank's requests are served in the order they were claimed: once one of a rank is passed
    over (its ring has no free slot, it does not fit the forward, or it waits for its own turn),
    no later request of that rank is taken in this pass. Its trainer frees its slots in
    micro-batch order and waits for its oldest request, so a later request must never take a
    slot the earlier one could not (a slot freed while this pass runs, or a second free slot
    taken by a later request of the forward's length): later results holding every slot of the
    ring while the earlier request waits would stall the trainer until it gives them back. The
    requests of other ranks are still served (no head-of-line blocking across ranks).
    """
    batch: list[tuple] = []
    passed: set[int | None] = set()  # ranks with a request passed over in this pass
    for key, (request, lease_id) in list(backlog.items()):
        # a malformed request is (message, rank) (_decode)
        rank = request.rank if isinstance(request, proto.Request) else request[1]
        if rank in passed:
            continue
        if not isinstance(request, proto.Request) or worker.check(request) is not None:
            if batch:
                passed.add(rank)
                continue
            del backlog[key]
            return [(key, request, lease_id, None)]
        if not worker.fits([b[1] for b in batch], request):
            passed.add(rank)
            continue
        slot = worker.try_acquire(rank)
        if slot is None:
            passed.add(rank)
            continue
        del backlog[key]
        batch.append((key, request, lease_id, slot))
    return batch


# Seconds a stopping teacher spends giving back its backlog: the queue may be gone already, and
# unserved leases expire on a live queue anyway.
GIVE_BACK_TIMEOUT_S = 2.0


def _give_back(client, partition: str, backlog: dict[str, tuple[Any, Any]]) -> None:
    """Nack the requests claimed but not served, one call per lease, best effort."""
    by_lease: dict[Any, list[str]] = {}
    for key, (_, lease_id) in backlog.items():
        by_lease.setdefault(lease_id, []).append(key)
    client.timeout_s, client.retries = min(client.timeout_s, GIVE_BACK_TIMEOUT_S), 0
    for lease_id, keys in by_lease.items():
        try:
            client.nack(partition, proto.TEACHER_TASK, lease_id, keys)
        except QueueError as e:
            logger.warning(
                "[teacher] could not give back %d request(s) (%s); their leases expire instead",
                sum(len(k) for k in by_lease.values()),
                e,
            )
            return


def _decode(fields: dict, key: str, i: int, worker: TeacherWorker) -> Any:
    try:
        return proto.decode_request(key, fields, i, worker.pad_id)
    except ValueError as e:
        logger.warning("[teacher] malformed request %r: %s", key, e)
        return (str(e), _rank_of(fields, i))


def _serve(client, worker, partition, key, request, lease_id, slot, metrics) -> None:
    """Serve one claimed request (``request``: decoded, or a malformed one's ``(message,
    rank)``), holding ``slot`` of its rank's ring (or None): a batch of one."""
    _serve_batch(client, worker, partition, [(key, request, lease_id, slot)], metrics)


def _serve_batch(client, worker, partition, batch: list[tuple], metrics) -> None:
    """Compute ``batch`` (from :func:`_next_batch`), put each result, ack each request."""
    key, request, _, _ = batch[0]
    if isinstance(request, proto.Request):
        all_fields = worker.compute_many([b[1] for b in batch], [b[3] for b in batch])
    else:  # malformed (alone in its batch): tell the trainer when we know which rank asked
        message, rank = request
        all_fields = [None if rank is None else worker.error_fields(key, rank, message)]
    for (key, request, lease_id, _), fields in zip(batch, all_fields, strict=True):
        _reply(client, partition, key, lease_id, fields)
        if metrics is not None and isinstance(request, proto.Request):
            B, U = request.ids_BU.shape
            metrics.write(
                "request",
                key=key,
                rank=request.rank,
                rows=B,
                length=U,
                forward_requests=len(batch),
                memory_mb=device_memory_mb(worker.device),
                memory_reserved_mb=device_reserved_mb(worker.device),
            )


def _reply(client, partition: str, key: str, lease_id: Any, fields: dict | None) -> None:
    """Put a request's result fields onto its record (if any), then ack it."""
    if fields is not None:
        client.put(partition, [key], fields)
    try:
        client.ack(partition, proto.TEACHER_TASK, lease_id, [key])
    except QueueError as e:
        if e.code in ("not_found", "unknown_lease"):  # the trainer was faster and cleared it
            logger.debug("[teacher] %s was consumed before our ack: %s", key, e)
        else:  # the lease ended first: the request may be computed twice
            logger.warning("[teacher] ack of %s failed (%s); raise lease_s", key, e)


def _rank_of(fields: dict, i: int) -> int | None:
    try:
        return int(fields["rank"].reshape(-1)[i])
    except (KeyError, AttributeError, ValueError, IndexError):
        return None
