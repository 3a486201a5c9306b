"""The lineage of a run's samples: which texts the final student was trained on, and how often,
read from the trainers' keys logs (``RUN_DIR/keys/trainer.rank<r>.jsonl``).

Each trainer rank appends one ``trained`` record per step (``{"step", "epoch", "keys"}``) as soon
as the step is queued, across every launch of the run. A rank restarted from the checkpoint of
step R trains steps R+1, R+2, ... again: what its earlier launch logged past R was rolled back and
is not in the final student. So the final history of a rank is its records read in file order,
each record of step s replacing the rank's steps >= s, cut at the step the run ended on
(``summary.json``: a relaunch may end before it logs a step of its own). For one restart this is
what the recovery tests take: the records up to the checkpoint, then every record after the
relaunch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from services.common.metrics import read_jsonl

# an on-policy sample's key: p<pass>:<corpus key> (services/rollout)
ON_POLICY_KEY = re.compile(r"^p\d+:(.+)$")


def trained_records(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every ``trained`` record of every rank's keys log, rank by rank, in file order per rank
    (every launch of the run: rolled-back steps included)."""
    out = []
    for path in sorted((Path(run_dir) / "keys").glob("trainer.rank*.jsonl")):
        out += [r for r in read_jsonl(path) if r.get("event") == "trained"]
    return out


def final_history(
    records: Iterable[dict[str, Any]], final_step: int | None = None
) -> dict[int, dict[int, list[str]]]:
    """The steps the final student holds, per rank: ``{rank: {step: keys}}``.

    Args:
        records: ``trained`` records (``rank``, ``step``, ``keys``) in file order per rank, as
            :func:`trained_records` reads them.
        final_step: the step the run ended on; steps past it are dropped (None: keep all).
    """
    ranks: dict[int, dict[int, list[str]]] = {}
    for record in records:
        steps = ranks.setdefault(int(record.get("rank", 0)), {})
        step = int(record["step"])
        for later in [s for s in steps if s >= step]:  # a relaunch from an earlier checkpoint
            del steps[later]
        steps[step] = list(record["keys"])
    if final_step is not None:
        for steps in ranks.values():
            for late in [s for s in steps if s > final_step]:
                del steps[late]
    return ranks


def final_step(run_dir: str | os.PathLike) -> int | None:
    """The step rank 0 ended the run on (``summary.json``), or None before a run's end."""
    try:
        return int(json.loads((Path(run_dir) / "summary.json").read_text())["step"])
    except (FileNotFoundError, KeyError, TypeError, ValueError):
        return None


@dataclasses.dataclass
class Tally:
    """How often each key was trained, against the corpus.

    Attributes:
        missing: corpus keys never trained.
        twice: keys trained more than once (corpus and on-policy keys).
        extra: trained keys that are neither a corpus key nor an on-policy sample of one.
        on_policy: on-policy samples trained (each at most once).
    """

    missing: list[str]
    twice: list[str]
    extra: list[str]
    on_policy: int = 0

    @property
    def ok(self) -> bool:
        """Every corpus key once, nothing twice, nothing else."""
        return not (self.missing or self.twice or self.extra)


def tally(trained: Iterable[str], corpus: Iterable[str], on_policy: bool = False) -> Tally:
    """Count ``trained`` (one entry per time a key was trained) against ``corpus``.

    Args:
        trained: the keys, with repeats.
        corpus: every key the collators make of the corpus.
        on_policy: keys ``p<pass>:<corpus key>`` are on-policy samples (at most once each),
            not extras.
    """
    counts = Counter(trained)
    corpus = set(corpus)
    twice = sorted(k for k, n in counts.items() if n > 1)
    missing = sorted(corpus - set(counts))
    rollouts = [k for k in counts if k not in corpus and on_policy and _rollout_of(k) in corpus]
    extra = sorted(set(counts) - corpus - set(rollouts))
    return Tally(missing=missing, twice=twice, extra=extra, on_policy=len(rollouts))


def _rollout_of(key: str) -> str | None:
    m = ON_POLICY_KEY.match(key)
    return m.group(1) if m else None


@dataclasses.dataclass
class Lineage:
    """The final student's samples of a run against its corpus.

    Attributes:
        tally: missing, twice, extra.
        steps: per rank, the steps of the final history.
        rolled_back: records of steps a restart rolled back (trained, then dropped).
        gaps: ``rank:step`` of steps below a rank's last step that the final history lacks.
    """

    tally: Tally
    steps: dict[int, int]
    rolled_back: int
    gaps: list[str]

    @property
    def ok(self) -> bool:
        """Every corpus key once, nothing twice or else, no step missing from a rank."""
        return self.tally.ok and not self.gaps


def check_lineage(
    run_dir: str | os.PathLike, corpus: Iterable[str], on_policy: bool = False
) -> Lineage:
    """The lineage of a finished run: its final history (:func:`final_history`, cut at
    :func:`final_step`) counted against ``corpus`` (:func:`tally`).

    Args:
        run_dir: the run directory.
        corpus: every key of the corpus the run read.
        on_policy: the run trains on-policy samples too (:func:`tally`).
    """
    records = trained_records(run_dir)
    history = final_history(records, final_step(run_dir))
    trained = [k for steps in history.values() for keys in steps.values() for k in keys]
    kept = sum(len(steps) for steps in history.values())
    gaps = [
        f"{rank}:{s}"
        for rank, steps in sorted(history.items())
        for s in range(1, max(steps, default=0) + 1)
        if s not in steps
    ]
    return Lineage(
        tally=tally(trained, corpus, on_policy=on_policy),
        steps={rank: len(steps) for rank, steps in sorted(history.items())},
        rolled_back=len(records) - kept,
        gaps=gaps,
    )
