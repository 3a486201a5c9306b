"""The trainer's sample feed: claims samples into micro-batches, acks them once trained (or once a
checkpoint holds them), tells when the data ended, gives back what was not trained.

Per rank: claim ``micro_batch * grad_accum`` samples from the partition (task
``trainer/e<epoch>/s<start>``), skip the keys the checkpoint says were trained (acked at once),
sort by teacher length and split into padded micro-batches; after the optimizer step: ack the
samples. A claim takes what is ready, so which samples share a micro-batch depends on timing;
with several ranks, once the collators' marker gives the total, a rank claims ahead at most its
share of the epoch's untrained samples (:meth:`SampleFeed._share_left`), so no rank's step is
empty while another holds two steps.

Ordered (``FeedConfig.ordered``): the feed gathers exactly ``micro_batch * grad_accum`` fresh
samples in the queue's order (claims are in put order) before it hands out a step, and sorts only
within that step; the last step of the data may be short. With one collator worker (puts in
corpus order) every run of one config trains the same micro-batches in the same steps, with a
teacher or without (whose claims ahead then cannot change a step's samples). With N ranks each
rank reads the whole partition under its own task (``<task>/r<rank>``), cuts the same global
steps of ``N * micro_batch * grad_accum`` samples and keeps the r-th share of each (acking the
others' shares for its task with its own, after the step): the assignment of samples to (step, rank) is fixed, so N
ranks and one rank with N times the accumulation train the same samples in every step.

Retention (a run that reads its partition once, ``register``): the task is registered with every
claim, so the queue drops each sample once acked and a corpus larger than its ``--capacity``
streams through it. A dropped sample cannot come again, so its ack waits for a checkpoint that
holds it (:meth:`SampleFeed.commit`): after a crash, the samples trained since the checkpoint
are trained again under the resumed launch's fresh task, as without retention. A registration
cannot be undone, so the resumed launch also consumes for the tasks of earlier launches
(``replaces``) what they still hold; samples a dead launch held leased are released that way
once their lease lapses (``lease_s``).

The end of the data: the collators' marker (services/protocol/end_of_data.py) is there and every
sample put was consumed, or nothing came for ``idle_timeout_s``.

Legend: B samples of a micro-batch.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any

import torch

from services.protocol.end_of_data import EOF_KEY, eof_samples
from services.protocol.names import meta_partition
from services.queue import errors as codes
from services.queue.errors import QueueError
from services.trainer.sections import FeedConfig
from xtoken_core.data import sample as schema
from xtoken_core.data_plane.codec import columns_to_samples

logger = logging.getLogger(__name__)

# Samples claimed at once when consuming for a replaced task (keys only: no fields travel).
_CONSUME_BATCH = 4096
# Seconds between two reads of the end-of-data marker while its total is not known.
MARKER_EVERY_S = 1.0


@dataclasses.dataclass(eq=False)
class Claimed:
    """A micro-batch of claimed samples.

    Attributes:
        keys: the B sample keys, in row order.
        samples: the B jagged samples (1-d / 0-d tensors).
        leases: sample key -> lease id.
        batch: the padded fields of the B samples (``xtoken_core.data.sample.pad_samples``).
    """

    keys: list[str]
    samples: list[dict[str, torch.Tensor]]
    leases: dict[str, Any]
    batch: dict[str, torch.Tensor]


class SampleFeed:
    """The samples of one rank, claimed a micro-batch at a time.

    Args:
        client: a QueueClient (this thread's).
        config: the trainer's feed section.
        pads: the pad ids of the padded fields: ``student_pad_id``, and ``teacher_pad_id``
            (one per teacher with several: ``xtoken_core.data.sample.pad_samples``).
        task: consumer task name on the sample partition (epoch + resume generation).
        trained: keys trained in this epoch (the checkpoint's); skipped when claimed again.
        partition: the run's sample partition.
        pack: the samples are packed rows (their document fields are claimed too).
        stop: a threading.Event; set = stop waiting for data.
        register: register ``task`` for the partition (retention, PROTOCOL.md): the queue
            drops each sample once acked. Only for a partition read once (one epoch). With
            ``checkpoint_every``, acks wait for :meth:`commit`.
        checkpoint_every: steps between the trainer's checkpoints (0: none).
        replaces: name prefix of the registered tasks of earlier launches this one takes over
            (``trainer/e<epoch>/``); :meth:`commit` consumes what they hold.
        rank, ranks: this rank and the data-parallel size; in ordered mode with several ranks
            the consumer task is ``<task>/r<rank>`` and the rank keeps its share of each step.
        teachers: the teachers of the loss: a claim takes every teacher's fields
            (``xtoken_core.data.sample.field_names``).
        cached: the teachers a teacher cache serves: a claim also takes their top-K targets.
    """

    def __init__(
        self,
        client: Any,
        config: FeedConfig,
        pads: dict[str, int],
        task: str,
        trained: set[str],
        *,
        partition: str,
        pack: bool = False,
        stop: Any = None,
        register: bool = False,
        checkpoint_every: int = 0,
        replaces: str = "",
        rank: int = 0,
        ranks: int = 1,
        teachers: int = 1,
        cached: tuple[int, ...] | list[int] = (),
    ) -> None:
        self.client = client
        self.config = config
        self.partition, self.pack = partition, pack
        self.fields = schema.field_names(teachers, packed=pack, cached=cached)
        self.pads = pads
        # ordered over several ranks: every rank reads every sample (its own task) and keeps
        # its share, so the tasks of this launch are <task>/r<rank>
        self._shared = config.ordered and ranks > 1
        self.launch_task = task
        self.task = f"{task}/r{rank}" if self._shared else task
        self.rank, self.ranks = rank, ranks
        self.trained = trained
        self.stop = stop
        self.register = register
        self.replaces = replaces
        # acks wait for a checkpoint that holds their samples (a registered task's are final)
        self.checkpoint_every = checkpoint_every
        self._defer = register and checkpoint_every > 0
        self._unacked: list[tuple[Any, list[str]]] = []  # (lease id, keys) trained, not acked
        self._uncheckpointed: set[str] = set()  # keys trained since the last commit
        self._ended = False
        self._idle_since: float | None = None
        # ordered mode: fresh samples claimed in queue order, not yet a whole step
        self._step: list[tuple[str, dict[str, torch.Tensor], Any]] = []
        self._others: dict[str, Any] = {}  # ordered over ranks: others' shares, key -> lease
        # several ranks, not ordered: this rank's fair share of the epoch (_share_left)
        self._trained_at_start = len(trained)
        self._total: int | None = None
        self._marker_read_at = -MARKER_EVERY_S
        self._claimed: set[str] = set()  # fresh keys this rank claimed in this epoch

    @property
    def ended(self) -> bool:
        """Nothing is left to claim in this epoch for this rank."""
        return self._ended and not self._step

    def stopping(self) -> bool:
        """The process was told to stop: wait for no more data."""
        return self.stop is not None and self.stop.is_set()

    def claim(self, micro_batches: int, block: bool) -> list[Claimed] | None:
        """Claim up to ``micro_batches`` micro-batches of samples (ordered: one whole step).

        Args:
            micro_batches: most micro-batches to claim (ordered mode: ignored; a step is
                ``grad_accum`` micro-batches).
            block: wait up to ``claim_timeout_s`` for samples (and see whether the data ended
                when none came); else return at once.

        Returns:
            The micro-batches, longest teacher rows first ([] when every sample that came was
            trained before); None when no sample came (ordered: no whole step is ready yet).
        """
        if self.config.ordered:
            return self._claim_step(block)
        want = micro_batches * self.config.micro_batch
        left = self._share_left()
        # a claim ahead stops at the share; a rank with no data for its step claims on past it
        # (a sample whose lease lapsed comes again, and some rank must take it)
        if left is not None and (left > 0 or not block):
            if left == 0:
                return None
            want = min(want, left)
        fresh = self._claim_fresh(want, block)
        if fresh is not None and self.ranks > 1:  # counted before the total is known too
            self._claimed.update(k for k, _, _ in fresh)
        return None if fresh is None else self._micro_batches(fresh)

    def _share_left(self) -> int | None:
        """Samples this rank may still claim in this epoch: several ranks claim from one task,
        and a rank that claimed ahead could take what another needs for the same step, which
        would then train an empty step; so once the collators' marker tells the total, each rank
        claims at most its share of what the launch found untrained (``total - trained``,
        split evenly over the ranks, the first ones taking the remainder). None: no cap (one
        rank, the ordered mode, or the total is not known yet)."""
        if self.ranks == 1 or self.config.ordered:
            return None
        if self._total is None:
            now = time.monotonic()
            if now - self._marker_read_at < MARKER_EVERY_S:
                return None
            self._marker_read_at = now
            self._total = self._marker_total()
            if self._total is None:
                return None
        untrained = max(0, self._total - self._trained_at_start)
        share = untrained // self.ranks + (1 if self.rank < untrained % self.ranks else 0)
        return max(0, share - len(self._claimed))

    def _marker_total(self) -> int | None:
        """The sample count of the collators' end-of-data marker (None before they are done)."""
        try:
            marker = self.client.get(meta_partition(self.partition), [EOF_KEY])
        except QueueError as e:
            if e.code in ("not_found", "missing_field"):
                return None
            raise
        return eof_samples(marker["fields"])

    def _claim_step(self, block: bool) -> list[Claimed] | None:
        """Ordered mode: gather fresh samples in queue order until a whole step (of all ranks) is
        claimed, then hand out this rank's share of it (of the samples gathered so far at the end
        of the data)."""
        share = self.config.step_samples
        size = share * self.ranks
        while len(self._step) < size and not self._ended:
            fresh = self._claim_fresh(size - len(self._step), block)
            if fresh is None:
                break
            # a sample whose lease lapsed while the step was gathered comes again: keep its
            # place and take the new lease
            held = {k: i for i, (k, _, _) in enumerate(self._step)}
            for item in fresh:
                if item[0] in held:
                    self._step[held[item[0]]] = item
                else:
                    self._step.append(item)
        if not self._step or (len(self._step) < size and not self._ended):
            return None
        step, self._step = self._step[:size], self._step[size:]
        if self._shared:
            # the last step of the data may be short: its shares are cut in rank order
            lo, hi = self.rank * share, (self.rank + 1) * share
            # the other ranks train them: consumed for this task with the next ack, after the
            # step's collectives, when every rank's task is registered (retention drops a
            # sample once every registered task acked it)
            self._others.update({k: lease for k, _, lease in step[:lo] + step[hi:]})
            step = step[lo:hi]
        return self._micro_batches(step)

    def _claim_fresh(
        self, samples: int, block: bool
    ) -> list[tuple[str, dict[str, torch.Tensor], Any]] | None:
        """Claim up to ``samples`` samples; ack those trained before.

        Returns:
            ``(key, sample, lease id)`` of the fresh ones in claim order; None when none came.
        """
        fresh: list[tuple[str, dict[str, torch.Tensor], Any]] = []
        # samples trained before take no place: claim again until ``samples`` fresh ones came
        # or the queue has no more now, so a resumed epoch cuts the steps of an uninterrupted one
        while len(fresh) < samples:
            got = self._claim_once(samples - len(fresh), block and not fresh)
            if got is None:
                break
            fresh += got[0]
            if not got[1]:  # nothing trained before came: the queue gave what it had
                break
        return fresh or None

    def _claim_once(
        self, samples: int, block: bool
    ) -> tuple[list[tuple[str, dict[str, torch.Tensor], Any]], int] | None:
        """One claim of up to ``samples`` samples; acks those trained before.

        Returns:
            The fresh ``(key, sample, lease id)`` in claim order and the count of samples
            trained before; None when none came.
        """
        cfg = self.config
        got = self.client.claim(
            self.partition,
            self.task,
            self.fields,
            samples,
            timeout_s=cfg.claim_timeout_s if block else 0.001,
            lease_s=cfg.lease_s,
            register=self.register,  # with every claim: a restarted queue forgot it
        )
        keys = list(got["keys"])
        if not keys:
            if block:
                self._check_end()
            return None
        self._idle_since = None
        lease_id = got["lease_id"]
        rows = columns_to_samples(got["fields"])
        fresh = [(k, r, lease_id) for k, r in zip(keys, rows) if k not in self.trained]
        seen = [k for k in keys if k in self.trained]
        if seen:  # trained before (the checkpoint we resumed from, or a lease that lapsed)
            later = [k for k in seen if k in self._uncheckpointed]
            if later:  # in no checkpoint yet: acked by the next commit
                self._unacked.append((lease_id, later))
            if len(later) < len(seen):
                done = [k for k in seen if k not in self._uncheckpointed]
                self.client.ack(self.partition, self.task, lease_id, done)
        return fresh, len(seen)

    def _micro_batches(
        self, fresh: list[tuple[str, dict[str, torch.Tensor], Any]]
    ) -> list[Claimed]:
        """Sort by teacher length (stable: ties keep the claim order) and split into padded
        micro-batches."""
        fresh = sorted(fresh, key=lambda kr: -int(kr[1]["teacher_input_lengths"]))
        out = []
        for i in range(0, len(fresh), self.config.micro_batch):
            group = fresh[i : i + self.config.micro_batch]
            out.append(
                Claimed(
                    keys=[k for k, _, _ in group],
                    samples=[r for _, r, _ in group],
                    leases={k: lease for k, _, lease in group},
                    batch=self._pad([r for _, r, _ in group]),
                )
            )
        return out

    def ack(self, trained: Iterable[Claimed]) -> None:
        """Mark the samples of trained micro-batches consumed (after the optimizer step); a
        registered feed with checkpoints keeps the acks for :meth:`commit`."""
        trained = list(trained)
        by_lease: dict[Any, list[str]] = {}
        for c in trained:
            for key in c.keys:
                by_lease.setdefault(c.leases[key], []).append(key)
        if self._defer:
            self._unacked.extend(by_lease.items())
            self._uncheckpointed.update(k for c in trained for k in c.keys)
        else:
            for lease_id, keys in by_lease.items():
                self.client.ack(self.partition, self.task, lease_id, keys)
        self.trained.update(k for c in trained for k in c.keys)
        others, self._others = self._others, {}
        for lease_id, keys in _group(others).items():
            self.client.ack(self.partition, self.task, lease_id, keys)

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
                self.client.ack(self.partition, self.task, lease_id, keys)
            except QueueError as e:
                if e.code not in ("unknown_lease", "stale_epoch"):
                    raise
                lapsed += len(keys)  # redelivered (or gone with the queue): acked when seen
        if lapsed:
            logger.warning(
                "[trainer] the leases of %d trained samples lapsed before the checkpoint: they "
                "come again and are acked then; raise trainer.feed.lease_s (now %gs) above the "
                "time of trainer.schedule.checkpoint_every (%d) steps",
                lapsed,
                self.config.lease_s,
                self.checkpoint_every,
            )

    def give_back(self, untrained: Iterable[Claimed]) -> None:
        """Return the samples of micro-batches claimed but not trained (nack), and those of a
        step still being gathered (ordered mode).

        Raises:
            QueueError: ``stopped``: the queue went away while the trainer stops (its client's
                ``stopping``); what is left leased is served again once its lease runs out.
        """
        leases = [c.leases for c in untrained]
        if self._step:
            leases.append({k: lease for k, _, lease in self._step})
            self._step = []
        if self._others:
            leases.append(self._others)
            self._others = {}
        for held in leases:
            for lease_id, keys in _group(held).items():
                self._nack(self.partition, self.task, lease_id, keys, "lease")

    def _nack(self, partition: str, task: str, lease_id: Any, keys: list[str], what: str) -> None:
        """Give back one lease's ``keys``, best effort: a failure is logged (the lease runs
        out), except ``stopped``, raised (the queue went away while the rank stops: nothing more
        is sent)."""
        try:
            self.client.nack(partition, task, lease_id, keys)
        except QueueError as e:
            if e.code == codes.STOPPED:
                raise
            logger.warning("[trainer] could not give back %s %s: %s", what, lease_id, e)

    def _consume_for_replaced(self) -> None:
        """Claim and ack, for each registered task of an earlier launch, every sample it has
        not consumed (no fields travel): this task alone holds them then."""
        if not self.replaces:
            return
        part = self.client.stats()["partitions"].get(self.partition, {})
        for task in part.get("registered", []):
            if not task.startswith(self.replaces) or self._of_this_launch(task):
                continue
            while True:
                got = self.client.claim(
                    self.partition,
                    task,
                    [],
                    _CONSUME_BATCH,
                    fields=[],
                    timeout_s=0.001,
                    lease_s=self.config.lease_s,
                )
                if not got["keys"]:
                    break
                self.client.ack(self.partition, task, got["lease_id"])

    def _of_this_launch(self, task: str) -> bool:
        """``task`` is this launch's consumer task (or, ordered over ranks, another rank's)."""
        return task == self.task or task.startswith(self.launch_task + "/r")

    def _pad(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return schema.pad_samples(samples, **self.pads)

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
        total = self._marker_total()
        if total is None:
            return  # the collators are not done
        status = self.client.status(self.partition, self.task)
        # samples retention dropped (acked by every registered task) were put too
        put = status["samples"] + status.get("dropped", 0)
        if status["pending"] == 0 and put >= total:
            self._ended = True


def _group(leases: dict[str, Any]) -> dict[Any, list[str]]:
    out: dict[Any, list[str]] = {}
    for key, lease_id in leases.items():
        out.setdefault(lease_id, []).append(key)
    return out
