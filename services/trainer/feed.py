"""The trainer's data feed: micro-batches of claimed samples with their teacher logits, a
zero-copy view of a ring slot.

``TeacherFeed`` composes the sample feed (services/trainer/samples.py: claim, ack after the
step or the checkpoint, end of data, give back) and the teacher client
(services/trainer/teacher_client.py: request, result, slot release). Up to one step of
micro-batches is kept claimed and requested ahead, so the teacher computes step k+1 while this
rank trains on step k; the next ones are claimed and requested while each backward runs.
With ``on_policy.fraction`` above 0 the sample feed is the mixed one
(services/trainer/on_policy.py): part of each step comes from the rollout workers.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from services.trainer.on_policy import OnPolicyFeed
from services.trainer.samples import Claimed, SampleFeed
from services.trainer.sections import FeedConfig, OnPolicyConfig, TeacherLinkConfig
from services.trainer.step import MicroBatch
from services.trainer.teacher_client import Asked, TeacherClient

__all__ = ["TeacherFeed"]


@dataclasses.dataclass(eq=False)
class _Pending(Asked, Claimed):
    """A micro-batch claimed (:class:`Claimed`) and requested (:class:`Asked`)."""


class TeacherFeed:
    """Micro-batches of one rank with their teacher logits.

    Args:
        client: a QueueClient (this thread's).
        config: the trainer's feed section.
        teacher: the trainer's teacher section (the teacher client's).
        rank: this trainer rank.
        task, trained, partition, pack, pads, stop, register, checkpoint_every, replaces: as
            :class:`services.trainer.samples.SampleFeed`.
        uses_teacher: the loss reads teacher logits (False: none are asked for).
        on_policy: the trainer's on-policy section (None, or a fraction of 0: off-policy only).
        device, reader, output_layer: as :class:`services.trainer.teacher_client.TeacherClient`.
        ranks: the data-parallel size.
        version, teacher_vocab: as :class:`services.trainer.on_policy.OnPolicyFeed` (read with
            ``on_policy.fraction`` above 0).
    """

    def __init__(
        self,
        client: Any,
        config: FeedConfig,
        teacher: TeacherLinkConfig,
        rank: int,
        task: str,
        trained: set[str],
        *,
        partition: str,
        pack: bool = False,
        uses_teacher: bool = True,
        on_policy: OnPolicyConfig | None = None,
        pads: dict[str, int],
        device: torch.device | None = None,
        ranks: int = 1,
        version: Callable[[], int] | None = None,
        teacher_vocab: int | None = None,
        reader: Any = None,
        output_layer: Any = None,
        stop: Any = None,
        register: bool = False,
        checkpoint_every: int = 0,
        replaces: str = "",
    ) -> None:
        self.config = config
        self.pack, self.uses_teacher = pack, uses_teacher
        common = dict(
            partition=partition, pack=pack, stop=stop, register=register,
            checkpoint_every=checkpoint_every, replaces=replaces, rank=rank, ranks=ranks,
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
            self.samples = SampleFeed(client, config, pads, task, trained, **common)
        # the mixed feed (on-policy samples), or None
        self.on_policy = self.samples if isinstance(self.samples, OnPolicyFeed) else None
        self.teacher = TeacherClient(
            client,
            teacher,
            partition,
            rank,
            device or torch.device("cpu"),
            lease_s=config.lease_s,
            claim_timeout_s=config.claim_timeout_s,
            reader=reader,
            output_layer=output_layer,
        )
        self._want = 0  # micro-batches kept claimed and requested ahead (set by next_step)
        self._pending: deque[_Pending] = deque()

    @property
    def counters(self) -> dict[str, int]:
        """The teacher client's counts: stale, checksum_mismatch, orphans, re_requests."""
        return self.teacher.counters

    @property
    def trainer_task(self) -> str:
        """This process's consumer task on the request partition."""
        return self.teacher.trainer_task

    @property
    def ended(self) -> bool:
        """The data of this epoch ended for this rank (nothing left to claim)."""
        return self.samples.ended and not self._pending

    def next_step(self, n: int) -> list[MicroBatch]:
        """The oldest ``n`` micro-batches (fewer at the end of the data; [] when it ended).

        Also asks for the next step's teacher logits ahead.
        """
        self._want = want = 2 * n if self.uses_teacher else n
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

    def commit(self) -> None:
        """After a checkpoint that holds every trained key was saved: see
        :meth:`SampleFeed.commit`."""
        self.samples.commit()

    def give_back(self, micro_batches: list[MicroBatch] = ()) -> None:
        """Stop: return every sample claimed but not trained, release held slots."""
        pend = list(self._pending) + [mb.context for mb in micro_batches]
        self._pending.clear()
        self.teacher.deferred.clear()
        for p in pend:
            if p.record is not None:
                self.teacher.drop_record(p)
        self.samples.give_back(pend)

    def _ending(self) -> bool:
        return self.samples.ended or self.samples.stopping()

    def _claim(self, micro_batches: int, block: bool) -> bool:
        """Claim up to ``micro_batches`` micro-batches and ask for their logits; False when no
        sample came."""
        claimed = self.samples.claim(micro_batches, block)
        if claimed is None:
            return False
        for c in claimed:
            p = _Pending(
                **{f.name: getattr(c, f.name) for f in dataclasses.fields(Claimed)},
                rows=[s["teacher_input_ids"] for s in c.samples],
                positions=[s["teacher_position_ids"] for s in c.samples] if self.pack else None,
                shape=tuple(c.batch["teacher_input_ids"].shape),
            )
            if self.uses_teacher:
                self.teacher.ask(p)
            self._pending.append(p)
        return True

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
            if on_policy is None:
                mb.teacher_logits = lambda: self.teacher.logits(p)
            else:  # the teacher's log-probs of the student's continuations: a metric
                mb.teacher_logits = lambda: on_policy.score(p, self.teacher.logits(p))
            mb.done = lambda: self._done(p)
            mb.prefetch = lambda: self.teacher.prefetch(p)
        return mb

    def _done(self, p: _Pending) -> None:
        """After the backward of ``p`` was queued: release its slot, ack and clear its record;
        claim ahead, and take the results that already arrived, so that the next micro-batch
        opens its slot without a queue round trip in its step."""
        self.teacher.done(p)
        self._top_up()
        if self.teacher.waiting:
            self.teacher.claim_records(0.0)
