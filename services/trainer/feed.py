"""The trainer's data feed: micro-batches of claimed samples with their teacher logits, a
zero-copy view of a ring slot.

``TeacherFeed`` composes the sample feed (services/trainer/samples.py: claim, ack after the
step or the checkpoint, end of data, give back) and one teacher client per teacher of the loss
(services/trainer/teacher_client.py: request, result, slot release): teacher ``j`` is asked
with its own rows of each sample (``teacher{j}_input_ids``; teacher 0's are
``teacher_input_ids``), and a micro-batch's logits are one per teacher. Up to one step of
micro-batches is kept claimed and requested ahead, so the teacher computes step k+1 while this
rank trains on step k; the next ones are claimed and requested while each backward runs
(``feed.ahead_steps`` steps ahead: 1 unless set).
With ``on_policy.fraction`` above 0 the sample feed is the mixed one
(services/trainer/on_policy.py): part of each step comes from the rollout workers.

A teacher a cache serves (its link's ``cache``, a run's ``data.teacher_cache``) has no client:
its samples carry its top-K targets (``teacher_topk_*`` fields, claimed with the others), and
its logits are those targets decoded (``xtoken_core.wire.topk.decode_topk``), as the ``topk``
transport's client decodes a teacher's result. With ``cache_missing: online`` it has a client
too: a sample the cache lacked (``teacher_topk_cached`` False) is asked of the live teacher,
only those rows of the micro-batch (none asked when the cache held every one), and their logits
take the place of the decoded rows.

Legend: B samples of a micro-batch, b the rows of it asked of a live teacher, U teacher tokens,
W teacher vocab.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from services.trainer.on_policy import OnPolicyFeed
from services.trainer.samples import Claimed, SampleFeed
from services.trainer.sections import FeedConfig, OnPolicyConfig, TeacherLinkConfig
from services.trainer.step import MicroBatch
from services.trainer.teacher_client import Asked, TeacherClient
from xtoken_core.data.sample import teacher_field_name
from xtoken_core.losses.sparse_teacher import SparseTeacher

__all__ = ["TeacherFeed"]


@dataclasses.dataclass(eq=False)
class _Pending(Claimed):
    """A micro-batch claimed (:class:`Claimed`) and requested of each teacher.

    Attributes:
        asked: one request per teacher client of the feed, in their order ([] when the loss
            reads no teacher); None for a cached teacher whose cache held every sample.
        missing: per cached teacher asked for the samples its cache lacked, their ``[b]`` rows
            in the micro-batch (the request holds those rows alone).
    """

    asked: list[Asked | None] = dataclasses.field(default_factory=list)
    missing: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)


class TeacherFeed:
    """Micro-batches of one rank with their teacher logits.

    Args:
        client: a QueueClient (this thread's).
        config: the trainer's feed section.
        teachers: the link section of each teacher of the loss, teacher 0 first (``teacher``,
            then the entries of ``extra_teachers``); each has a teacher client of its own.
        rank: this trainer rank.
        task, trained, partition, pack, pads, stop, register, checkpoint_every, replaces: as
            :class:`services.trainer.samples.SampleFeed`.
        uses_teacher: the loss reads teacher logits (False: none are asked for).
        on_policy: the trainer's on-policy section (None, or a fraction of 0: off-policy only).
        device: as :class:`services.trainer.teacher_client.TeacherClient`.
        readers, output_layers: one per teacher, as the teacher client's ``reader`` and
            ``output_layer`` (None: none for any).
        ranks: the data-parallel size.
        cached_widths: per teacher, the logits' width W of the cache that serves it (its
            targets travel with the samples and are decoded here), or None for a live teacher
            (None: every teacher is live). A cached teacher whose link has ``cache_missing:
            online`` has a client too, asked for the samples its cache lacked.
        version, teacher_vocab: as :class:`services.trainer.on_policy.OnPolicyFeed` (read with
            ``on_policy.fraction`` above 0).
    """

    def __init__(
        self,
        client: Any,
        config: FeedConfig,
        teachers: Sequence[TeacherLinkConfig],
        rank: int,
        task: str,
        trained: set[str],
        *,
        partition: str,
        pack: bool = False,
        uses_teacher: bool = True,
        on_policy: OnPolicyConfig | None = None,
        pads: dict[str, Any],
        device: torch.device | None = None,
        ranks: int = 1,
        version: Callable[[], int] | None = None,
        teacher_vocab: int | None = None,
        readers: Sequence[Any] | None = None,
        output_layers: Sequence[Any] | None = None,
        cached_widths: Sequence[int | None] | None = None,
        stop: Any = None,
        register: bool = False,
        checkpoint_every: int = 0,
        replaces: str = "",
    ) -> None:
        self.config = config
        self.pack, self.uses_teacher = pack, uses_teacher
        n = len(teachers)
        widths = list(cached_widths) if cached_widths is not None else [None] * n
        # teacher j -> the width of the cache that serves it (its targets come with the samples)
        self.cached = {j: int(w) for j, w in enumerate(widths) if w is not None}
        # the cached teachers whose live groups serve the samples their cache lacked
        self.online = {j for j in self.cached if teachers[j].cache_missing == "online"}
        self._online_trained = 0  # samples trained on such a teacher's live logits
        self.device = device or torch.device("cpu")
        common = dict(
            partition=partition, pack=pack, stop=stop, register=register,
            checkpoint_every=checkpoint_every, replaces=replaces, rank=rank, ranks=ranks,
            teachers=n,
        )  # fmt: skip
        if on_policy is not None and on_policy.enabled:
            self.samples = OnPolicyFeed(
                client,
                config,
                pads,
                task,
                trained,
                on_policy=on_policy,
                version=version,
                teacher_vocab=teacher_vocab,
                **common,
            )
        else:
            self.samples = SampleFeed(
                client, config, pads, task, trained, cached=sorted(self.cached), **common
            )
        # the mixed feed (on-policy samples), or None
        self.on_policy = self.samples if isinstance(self.samples, OnPolicyFeed) else None
        readers = list(readers) if readers is not None else [None] * n
        output_layers = list(output_layers) if output_layers is not None else [None] * n
        # a client per live teacher (a cached one's logits are decoded from its samples, but
        # for the samples its cache lacked when it is online)
        self.teachers = [
            TeacherClient(
                client,
                link,
                partition,
                rank,
                self.device,
                lease_s=config.lease_s,
                claim_timeout_s=config.claim_timeout_s,
                reader=readers[j],
                output_layer=output_layers[j],
                index=j,
            )
            for j, link in enumerate(teachers)
            if j not in self.cached or j in self.online
        ]
        self._n = n
        # each teacher's fields of a sample: its rows, its positions (packed), its padded ids
        self._ids = [teacher_field_name("teacher_input_ids", j) for j in range(n)]
        self._positions = [teacher_field_name("teacher_position_ids", j) for j in range(n)]
        self._want = 0  # micro-batches kept claimed and requested ahead (set by next_step)
        self._ahead = config.ahead_steps  # steps of them beyond the one training
        self._pending: deque[_Pending] = deque()

    @property
    def counters(self) -> dict[str, int]:
        """The teacher clients' counts: stale, checksum_mismatch, orphans, re_requests, summed
        over the teachers; with several, each teacher's too (``teacher{j}_re_requests``...).
        With an online cached teacher, ``cache_missing``: the samples trained (acked) on its
        live logits because its cache lacked them (summed over such teachers)."""
        out = {name: sum(t.counters[name] for t in self.teachers) for name in _COUNTERS}
        if len(self.teachers) > 1:
            for t in self.teachers:
                out.update({f"teacher{t.index}_{k}": v for k, v in t.counters.items()})
        if self.online:
            out["cache_missing"] = self._online_trained
        return out

    @property
    def ended(self) -> bool:
        """The data of this epoch ended for this rank (nothing left to claim)."""
        return self.samples.ended and not self._pending

    def next_step(self, n: int) -> list[MicroBatch]:
        """The oldest ``n`` micro-batches (fewer at the end of the data; [] when it ended).

        Also asks for the teacher logits of the next ``feed.ahead_steps`` steps ahead.
        """
        self._want = want = (1 + self._ahead) * n if self.uses_teacher else n
        while len(self._pending) < want and not self._ending():
            if not self._claim(want - len(self._pending), block=len(self._pending) < n):
                break
        take = [self._pending.popleft() for _ in range(min(n, len(self._pending)))]
        if self.on_policy is not None:
            self.on_policy.start_step(take)  # drops the rows now too stale to train
        return [self._micro_batch(p) for p in take]

    def on_policy_stats(self) -> dict | None:
        """The on-policy figures of the step just trained (None without on-policy samples)."""
        return None if self.on_policy is None else self.on_policy.step_stats()

    def ack(self, micro_batches: list[MicroBatch]) -> None:
        """Mark the samples of trained micro-batches consumed (after the optimizer step); a
        registered feed with checkpoints keeps the acks for :meth:`commit`."""
        self.samples.ack(mb.context for mb in micro_batches)
        if self.online:
            self._online_trained += sum(
                len(rows_b) for mb in micro_batches for rows_b in mb.context.missing.values()
            )

    def commit(self) -> None:
        """After a checkpoint that holds every trained key was saved: see
        :meth:`SampleFeed.commit`."""
        self.samples.commit()

    def give_back(self, micro_batches: list[MicroBatch] = ()) -> None:
        """Stop: return every sample claimed but not trained, release held slots."""
        pend = list(self._pending) + [mb.context for mb in micro_batches]
        self._pending.clear()
        for teacher in self.teachers:
            teacher.deferred.clear()
        for p in pend:
            for teacher, asked in zip(self.teachers, p.asked):
                if asked is not None and asked.record is not None:
                    teacher.drop_record(asked)
        self.samples.give_back(pend)

    def _ending(self) -> bool:
        return self.samples.ended or self.samples.stopping()

    def _claim(self, micro_batches: int, block: bool) -> bool:
        """Claim up to ``micro_batches`` micro-batches and ask each teacher for their logits;
        False when no sample came."""
        claimed = self.samples.claim(micro_batches, block)
        if claimed is None:
            return False
        for c in claimed:
            p = _Pending(**{f.name: getattr(c, f.name) for f in dataclasses.fields(Claimed)})
            if self.uses_teacher:
                for teacher in self.teachers:
                    asked = self._request(p, teacher.index)
                    p.asked.append(asked)
                    if asked is not None:
                        teacher.ask(asked)
            self._pending.append(p)
        return True

    def _request(self, p: _Pending, j: int) -> Asked | None:
        """What teacher ``j`` is asked for micro-batch ``p``: every row (a live teacher), the
        rows its cache lacked (an online cached teacher: recorded in ``p.missing``), or nothing
        (None: its cache held every row)."""
        ids, positions = self._ids[j], self._positions[j]
        if j not in self.online:
            return Asked(
                rows=[s[ids] for s in p.samples],
                positions=[s[positions] for s in p.samples] if self.pack else None,
                shape=tuple(p.batch[ids].shape),
            )
        from xtoken_core.cache.attach import cached_of_batch

        rows_b = (~cached_of_batch(p.batch, j)).nonzero().flatten()
        if not len(rows_b):
            return None
        p.missing[j] = rows_b
        rows = [p.samples[i][ids] for i in rows_b.tolist()]
        # the teacher pads the rows to the longest of them (the micro-batch's U or less)
        return Asked(rows=rows, shape=(len(rows), max(1, max(int(r.numel()) for r in rows))))

    def _top_up(self) -> None:
        """Claim and ask ahead without waiting: called while the GPU runs a backward, so that the
        next :meth:`next_step` finds its micro-batches claimed, padded and requested."""
        while len(self._pending) < self._want and not self._ending():
            if not self._claim(self._want - len(self._pending), block=False):
                break

    def _micro_batch(self, p: _Pending) -> MicroBatch:
        on_policy = self.on_policy
        keys = p.keys if on_policy is None else on_policy.trained_keys(p)
        mb = MicroBatch(keys=keys, batch=p.batch, context=p)
        if self.uses_teacher:
            if on_policy is not None:  # the teacher's log-probs of the student's continuations
                mb.teacher_logits = lambda: on_policy.score(
                    p, self._dense(self._logits(p, mb.on_device))
                )
            else:
                mb.teacher_logits = lambda: self._logits(p, mb.on_device)
            mb.done = lambda: self._done(p)
            mb.prefetch = lambda: self._prefetch(p)
        return mb

    def _logits(self, p: _Pending, on_device: dict[str, torch.Tensor] | None = None) -> Any:
        """The teacher logits of ``p``: ``[B, U, W]`` of one teacher, or one per teacher (a
        live teacher's from its client, a cached one's the batch's top-K targets as a
        :class:`~xtoken_core.losses.sparse_teacher.SparseTeacher`, decoded with the rows its
        cache lacked from its client when it is online). ``on_device``: ``p``'s fields already
        on the device (the step's copy), where cached targets are read when given."""
        clients = {t.index: (t, asked) for t, asked in zip(self.teachers, p.asked, strict=True)}
        logits = []
        for j in range(self._n):
            teacher, asked = clients.get(j, (None, None))
            if j not in self.cached:
                logits.append(teacher.logits(asked))
            elif asked is None:
                logits.append(self._decode(p, j, on_device))
            else:
                logits.append(self._merge(p, j, teacher.logits(asked), on_device))
        return logits[0] if len(logits) == 1 else logits

    def _merge(
        self,
        p: _Pending,
        j: int,
        live_bUW: torch.Tensor,
        on_device: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Online cached teacher ``j``'s ``[B, U, W]`` logits of ``p``: the live teacher's
        ``[b, U', W]`` (U' <= U) for the rows its cache lacked, the decoded cached targets for
        the others; the live logits alone when no row of ``p`` was cached.

        Raises:
            ValueError: the live teacher's logits are of another width than its cache's.
        """
        rows_b = p.missing[j]
        B, U = p.batch[self._ids[j]].shape
        if len(rows_b) == B and live_bUW.shape[1] == U:
            return live_bUW
        W = self.cached[j]
        if live_bUW.shape[-1] != W:
            raise ValueError(
                f"teacher {j}'s live logits are {live_bUW.shape[-1]} wide and its cache's {W}: "
                "a cache of another teacher; build it again with `xtoken cache build`"
            )
        logits_BUW = self._dense(self._decode(p, j, on_device))
        live_bUW = self._dense(live_bUW)  # the topk transport's targets
        rows_b = rows_b.to(logits_BUW.device)
        logits_BUW[rows_b, : live_bUW.shape[1]] = live_bUW.to(logits_BUW.dtype)
        return logits_BUW

    def _decode(
        self, p: _Pending, j: int, on_device: dict[str, torch.Tensor] | None = None
    ) -> SparseTeacher:
        """Cached teacher ``j``'s logits of ``p``: the top-K targets its samples carry, on the
        device, as the ``topk`` transport's client hands a result to the loss (which decodes
        them into ``[B, U, W]`` where its mode reads whole rows).

        The ids were checked against the cache's vocab where the collator read them
        (``xtoken_core.cache.format.decode_positions``), so the step's host scans none of them
        (a pass over ``[B, U, K]`` on its critical path); the shapes and dtypes are checked here.
        The targets are taken from ``on_device`` when given (the step's copy of the batch: no
        second transfer in the middle of the step), else moved from the host."""
        from xtoken_core.cache.attach import topk_of_batch
        from xtoken_core.wire.topk import check_targets

        try:
            targets = topk_of_batch(p.batch, j)
            check_targets(targets, self.cached[j], ids=False)
            if on_device is not None:
                targets = topk_of_batch(on_device, j)
            return SparseTeacher.from_targets(
                targets, self.cached[j], device=self.device, checked=True
            )
        except ValueError as e:
            raise ValueError(f"cached top-k targets of teacher {j} of {p.keys[:3]}: {e}") from None

    def _dense(self, logits: Any) -> Any:
        """``logits`` (one teacher's or a list) with top-K targets decoded into ``[B, U, W]``
        (bf16 on a GPU: ``xtoken_core.wire.topk.decode_dtype``), for what reads whole rows."""
        from xtoken_core.wire.topk import decode_dtype

        if isinstance(logits, list):
            return [self._dense(z) for z in logits]
        if isinstance(logits, SparseTeacher):
            return logits.dense(decode_dtype(self.device))
        return logits

    def _prefetch(self, p: _Pending) -> None:
        for teacher, asked in zip(self.teachers, p.asked):
            if asked is not None:
                teacher.prefetch(asked)

    def _done(self, p: _Pending) -> None:
        """After the backward of ``p`` was queued: release its slots, ack and clear its records;
        claim ahead, and take the results that already arrived, so that the next micro-batch
        opens its slots without a queue round trip in its step."""
        for teacher, asked in zip(self.teachers, p.asked):
            if asked is not None:
                teacher.done(asked)
        self._top_up()
        for teacher in self.teachers:
            if teacher.waiting:
                teacher.claim_records(0.0)


# the teacher clients' counts
_COUNTERS = ("stale", "checksum_mismatch", "orphans", "re_requests")
