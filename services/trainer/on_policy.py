"""The trainer's mixed feed: each step's samples, ``on_policy.fraction`` of them from the rollout
workers (on-policy) and the rest from the collators (off-policy), through the same teacher and
the same loss.

:class:`OnPolicyFeed` is a :class:`~services.trainer.samples.SampleFeed` (the off-policy part
keeps its claims, acks, checkpoint-held retention and end of data: exactly once per epoch) that
adds the rollout partition (``<partition>.rollout``, task ``trainer``, registered, so the queue
drops a sample once it is acked: each on-policy sample is consumed once):

* **Mixing.** Claims are whole steps (``micro_batch x grad_accum`` samples, as in ordered
  mode): ``round(fraction x step)`` on-policy (at least one) and the rest off-policy, and
  nothing is handed out until both shares are there; the samples of both kinds are sorted
  together into the step's micro-batches. Once the off-policy data ended, the last step keeps the
  mix on what is left. With fraction 1 nothing is read from the collators (the run ends at
  ``max_steps``).
* **Off-policy start.** The steps before ``on_policy.start_step`` take no on-policy share: the
  whole step comes from the collators (one optimizer and one schedule across both parts of the
  run). The feed counts the steps it claims from the trainer's step when it opened.
* **Staleness.** A sample sampled with the weights of version ``v`` (the trainer's step when it
  published them) while the trainer holds the weights of step ``t`` is ``(t - v) / sync_every``
  publications old. One more than ``max_staleness`` (or newer than the trainer's weights: from
  before a restart) and it is dropped, never trained: at its claim (acked at once), and again
  when its step starts, since a claim runs up to two steps ahead (its row's ``sample_mask`` is
  set to 0: no loss, no gradient; acked with the step; its key is left out of the trained keys).
  Dropped samples are counted.
* **CE.** Off by default on the tokens the student sampled (``on_policy.ce``): their targets are
  masked out of the CE (``token_mask``); the prompt's tokens (text of the corpus) and the KD term
  count as for any sample.
* **Acks.** On-policy samples are acked after the optimizer step (never held for a checkpoint:
  after a crash they would be stale anyway); given back (nack) when the trainer stops.

Per step (:meth:`OnPolicyFeed.step_stats`): on-policy samples trained, their mean staleness,
samples dropped as stale (so far), seconds the step waited for rollouts, and the teacher's mean
log-prob per byte of the continuations trained (nats; :meth:`OnPolicyFeed.score`, from the
teacher logits the loss reads anyway).

Legend: B rows of a micro-batch, U teacher tokens, W teacher vocab.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from services.protocol.names import ROLLOUT_TASK, rollout_partition
from services.protocol.rollout import ROLLOUT_FIELDS, is_rollout_sample
from services.queue.errors import QueueError
from services.trainer.samples import Claimed, SampleFeed
from services.trainer.sections import OnPolicyConfig
from xtoken_core.data import sample as schema
from xtoken_core.data_plane.codec import columns_to_samples

logger = logging.getLogger(__name__)

# On-policy keys remembered as trained (a sample redelivered after its lease lapsed is not
# trained twice); the oldest are forgotten beyond this many.
REMEMBERED_KEYS = 1 << 20
# Teacher positions per block of the log-prob metric ([block, W] fp32 at a time).
SCORE_BLOCK = 256


@dataclasses.dataclass
class _Stats:
    """On-policy counts of the step being trained (reset by ``step_stats``)."""

    samples: int = 0
    staleness: float = 0.0
    wait_s: float = 0.0
    logprob: torch.Tensor | float = 0.0
    scored_bytes: int = 0


class OnPolicyFeed(SampleFeed):
    """A :class:`SampleFeed` that mixes in the rollout workers' samples (module docstring).

    Args: as :class:`~services.trainer.samples.SampleFeed`, and
        on_policy: the trainer's on-policy section.
        version: the trainer's step now (the version of the weights it trains).
        teacher_vocab: the teacher's vocab (the logits' columns scored), or None: every column.
    """

    def __init__(
        self,
        *args: Any,
        on_policy: OnPolicyConfig,
        version: Callable[[], int],
        teacher_vocab: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.version = version
        self.teacher_vocab = teacher_vocab
        self.on_policy = op = on_policy
        self.fraction = op.fraction
        self.window = op.max_staleness * op.sync_every  # steps a sample's weights may lag
        self._next_step = version()  # the step the next claim is for (claims run ahead)
        self.rollouts = rollout_partition(self.partition)
        self._off: list[tuple[str, dict[str, torch.Tensor], Any]] = []  # waiting for a mix
        self._on: list[tuple[str, dict[str, torch.Tensor], Any]] = []
        self._leases: dict[str, Any] = {}  # on-policy key -> lease id, claimed and not acked
        self._dropped: set[str] = set()  # dropped when their step started: acked with it
        self._trained_on: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.dropped_stale = 0
        self._stats = _Stats()

    # ------------------------------------------------------------------ claims

    @property
    def ended(self) -> bool:
        """The off-policy data of this epoch ended and nothing of it waits for a mix."""
        return super().ended and not self._off

    def claim(self, micro_batches: int, block: bool) -> list[Claimed] | None:
        """Claim one whole step of the mix (both shares of ``micro_batch x grad_accum``
        samples), so that every step holds its on-policy share whatever the claim's size.

        Args:
            micro_batches: ignored (a step is ``grad_accum`` micro-batches), as in ordered mode.
            block: wait up to ``claim_timeout_s`` for each kind.

        Returns:
            The step's micro-batches, longest teacher rows first; None while a share is missing
            (what came waits for the next call) or when the data ended.
        """
        size = self.config.step_samples
        n_on = self.on_policy.share(size, self._next_step)  # 0 before the off-policy start ends
        n_off = size - n_on
        while len(self._off) < n_off and not self._ended:
            fresh = self._claim_fresh(n_off - len(self._off), block)
            if fresh is None:
                break
            _merge(self._off, fresh)
        if len(self._off) < n_off:
            if not self._ended or not self._off:
                return None
            n_off = len(self._off)  # the last step of the data: the same mix on what is left
            if n_on:  # past the off-policy start
                n_on = round(n_off * self.fraction / (1.0 - self.fraction))
        if len(self._on) < n_on:
            started = time.monotonic()
            self._claim_rollouts(n_on - len(self._on), block)
            if block:
                self._stats.wait_s += time.monotonic() - started
            if len(self._on) < n_on:
                return None
        off, self._off = self._off[:n_off], self._off[n_off:]
        on, self._on = self._on[:n_on], self._on[n_on:]
        self._next_step += 1
        return self._micro_batches(off + on)

    def _claim_rollouts(self, samples: int, block: bool) -> None:
        """Claim up to ``samples`` on-policy samples; drop (ack) the stale ones at once."""
        cfg = self.config
        got = self.client.claim(
            self.rollouts,
            ROLLOUT_TASK,
            (*schema.FIELD_NAMES, *ROLLOUT_FIELDS),
            samples,
            timeout_s=cfg.claim_timeout_s if block else 0.001,
            lease_s=cfg.lease_s,
            register=True,  # the queue drops each one once acked
        )
        if not got["keys"]:
            return
        lease_id, stale = got["lease_id"], []
        for key, row in zip(got["keys"], columns_to_samples(got["fields"])):
            if key in self._trained_on or self._is_stale(row):
                stale.append(key)  # trained (a lapsed lease brought it again) or too old
                self.dropped_stale += key not in self._trained_on
            else:
                self._leases[key] = lease_id
                _merge(self._on, [(key, row, lease_id)])
        if stale:
            self._ack_rollouts({lease_id: stale})

    def _is_stale(self, sample: dict[str, torch.Tensor]) -> bool:
        behind = self.version() - int(sample["policy_version"])
        return behind < 0 or behind > self.window

    def _pad(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = super()._pad(samples)
        if not self.on_policy.ce:  # no CE on the tokens the student sampled
            for b, sample in enumerate(samples):
                if is_rollout_sample(sample):
                    batch["token_mask"][b, int(sample["prompt_lengths"]) :] = False
        return batch

    # ------------------------------------------------------------------ steps

    def start_step(self, step: Iterable[Claimed]) -> None:
        """Before a step trains its micro-batches: drop the on-policy rows that are stale for
        the weights that train them now (sample_mask 0), count the others."""
        for c in step:
            for b, (key, sample) in enumerate(zip(c.keys, c.samples)):
                if key not in self._leases:
                    continue
                if self._is_stale(sample):
                    c.batch["sample_mask"][b] = 0.0
                    self._dropped.add(key)
                    self.dropped_stale += 1
                else:
                    behind = self.version() - int(sample["policy_version"])
                    self._stats.samples += 1
                    self._stats.staleness += behind / self.on_policy.sync_every

    def trained_keys(self, claimed: Claimed) -> list[str]:
        """The keys of a micro-batch that its step trains (without those dropped as stale)."""
        return [k for k in claimed.keys if k not in self._dropped]

    def score(self, claimed: Claimed, logits_BUW: torch.Tensor) -> torch.Tensor:
        """Add the teacher's log-probs of the continuations of a micro-batch's on-policy rows
        to this step's metric; returns the logits unchanged (the loss reads them next).

        Args:
            claimed: the micro-batch.
            logits_BUW: its teacher logits (a view of the ring slot).
        """
        width = self.teacher_vocab
        ids_BU = claimed.batch["teacher_input_ids"]
        total = torch.zeros((), dtype=torch.float32, device=logits_BUW.device)
        scored = 0
        with torch.no_grad():
            for b, (key, sample) in enumerate(zip(claimed.keys, claimed.samples)):
                if key not in self._leases or key in self._dropped:
                    continue
                first, end = (
                    int(sample["teacher_prompt_lengths"]),
                    int(sample["teacher_input_lengths"]),
                )
                for u0 in range(first, end, SCORE_BLOCK):
                    u1 = min(end, u0 + SCORE_BLOCK)
                    z = logits_BUW[b, u0 - 1 : u1 - 1, :width].float()
                    target = ids_BU[b, u0:u1].to(z.device)
                    total += (z.gather(1, target[:, None]).squeeze(1) - z.logsumexp(1)).sum()
                scored += int(sample["scored_bytes"])
        if scored:
            self._stats.logprob = self._stats.logprob + total
            self._stats.scored_bytes += scored
        return logits_BUW

    def step_stats(self) -> dict[str, Any]:
        """The on-policy figures of the step just trained (then reset for the next).

        Returns:
            ``{"samples", "mean_staleness", "dropped_stale" (so far), "wait_s",
            "teacher_logprob_per_byte"}`` (None where nothing was measured).
        """
        s, self._stats = self._stats, _Stats()
        logprob = float(s.logprob) / s.scored_bytes if s.scored_bytes else None
        return {
            "samples": s.samples,
            "mean_staleness": round(s.staleness / s.samples, 4) if s.samples else None,
            "dropped_stale": self.dropped_stale,
            "wait_s": round(s.wait_s, 6),
            "teacher_logprob_per_byte": None if logprob is None else round(logprob, 6),
        }

    # ------------------------------------------------------------------ acks

    def ack(self, trained: Iterable[Claimed]) -> None:
        """Ack a step's samples: the off-policy ones as :meth:`SampleFeed.ack` does, the
        on-policy ones (trained or dropped) on the rollout partition at once."""
        off, on = self._split(trained)
        super().ack(off)
        for key in (k for keys in on.values() for k in keys):
            if key not in self._dropped:
                self._trained_on[key] = None
            self._dropped.discard(key)
        while len(self._trained_on) > REMEMBERED_KEYS:
            self._trained_on.popitem(last=False)
        self._ack_rollouts(on)

    def give_back(self, untrained: Iterable[Claimed]) -> None:
        """Return what was claimed and not trained: off-policy samples as
        :meth:`SampleFeed.give_back` does (with those waiting for a mix), on-policy ones by a
        nack on the rollout partition."""
        untrained = list(untrained)
        waiting = Claimed(
            keys=[k for k, _, _ in self._off + self._on],
            samples=[],
            leases={k: lease for k, _, lease in self._off + self._on},
            batch={},
        )
        self._off, self._on = [], []
        off, on = self._split([*untrained, waiting])
        super().give_back(off)
        self._dropped.clear()
        for lease_id, keys in on.items():
            self._nack(self.rollouts, ROLLOUT_TASK, lease_id, keys, "on-policy lease")

    def _split(self, claimed: Iterable[Claimed]) -> tuple[list[Claimed], dict[Any, list[str]]]:
        """The off-policy part of micro-batches (as Claimed) and their on-policy keys by lease
        (forgotten as claimed)."""
        off: list[Claimed] = []
        on: dict[Any, list[str]] = {}
        for c in claimed:
            keys = [k for k in c.keys if k not in self._leases]
            off.append(dataclasses.replace(c, keys=keys, leases={k: c.leases[k] for k in keys}))
            for key in c.keys:
                if key in self._leases:
                    on.setdefault(self._leases.pop(key), []).append(key)
        return off, on

    def _ack_rollouts(self, by_lease: dict[Any, list[str]]) -> None:
        for lease_id, keys in by_lease.items():
            try:
                self.client.ack(self.rollouts, ROLLOUT_TASK, lease_id, keys)
            except QueueError as e:
                if e.code not in ("unknown_lease", "stale_epoch"):
                    raise
                logger.warning(
                    "[trainer] %d on-policy samples were redelivered before their ack (%s): "
                    "they are not trained again; raise lease_s (now %gs)",
                    len(keys),
                    e.code,
                    self.config.lease_s,
                )


def _merge(held: list[tuple[str, Any, Any]], fresh: list[tuple[str, Any, Any]]) -> None:
    """Add claimed samples to a waiting list; one whose lease lapsed while it waited comes again:
    it keeps its place and takes the new lease."""
    where = {k: i for i, (k, _, _) in enumerate(held)}
    for item in fresh:
        if item[0] in where:
            held[where[item[0]]] = item
        else:
            where[item[0]] = len(held)
            held.append(item)
