"""The fair grid of the scaled healing experiment: which runs to do next, from the validation
figures of the runs done so far (a pure function of them, so a resumed call plans the same).

Per arm, in order, every choice on the validation split of one seed (``grid_seed``):

1. **KL weight x temperature** (KD arms whose spec fixes neither): the small grid on the arm's
   family (its plain arm, :func:`scale_arms.family_of`) at the middle learning rate of the grid;
   the family's best setting is every arm of the family's.
2. **Learning rate** (every arm, CE included, unless its spec fixes it): the same grid for all,
   at the arm's KL weight and temperature; while the best is the lowest (highest) rate of the
   grid, the rate one ``factor`` below (above) is run too, at most ``max_extend`` times on each
   side, so the chosen rate is interior (or the plan says it is not).
3. **Final**: the chosen setting on every seed. Only these runs are scored on the held-out and
   fresh splits (``scale_final``); one arm's seed is trained and scored once more (``rerun``) to
   check that its row comes out bitwise equal.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from benchmarks.quality.scale_arms import ScaleArm, Setting, parse_scale_arm

PHASES = ("grid", "final", "rerun")


def rounded(x: float | None) -> float | None:
    """``x`` to 6 significant digits (grid rates made by multiplying compare equal)."""
    return None if x is None else float(f"{x:.6g}")


class RunKey(NamedTuple):
    """One run: phase, arm spec, seed and setting (KL weight and temperature None for CE)."""

    phase: str
    arm: str
    seed: int
    lr: float
    kl_weight: float | None
    temperature: float | None

    @property
    def setting(self) -> Setting:
        """The run's lr, KL weight and temperature."""
        return Setting(self.lr, self.kl_weight, self.temperature)


def row_key(row: dict) -> RunKey:
    """The :class:`RunKey` of a result row."""
    return RunKey(
        row["phase"],
        row["arm"],
        row["seed"],
        rounded(row["lr"]),
        rounded(row.get("kl_weight")),
        rounded(row.get("temperature")),
    )


@dataclasses.dataclass(frozen=True)
class GridSpec:
    """What the grid tries: learning rates (every arm), KL weights and temperatures (KD
    families), the extension factor and most extensions per side, the seed choices are made on
    and the seeds of the final runs."""

    lrs: tuple[float, ...] = (2.5e-4, 5e-4, 1e-3)
    kl_weights: tuple[float, ...] = (0.25, 0.5, 1.0)
    temperatures: tuple[float, ...] = (1.0, 2.0)
    factor: float = 2.0
    max_extend: int = 3
    grid_seed: int = 0
    seeds: tuple[int, ...] = (0, 1, 2)

    def __post_init__(self) -> None:
        if not self.lrs or any(not (0 < x < math.inf) for x in self.lrs):
            raise ValueError(f"--lrs {list(self.lrs)}: give learning rates > 0")
        if not self.factor > 1:
            raise ValueError(f"--lr-factor {self.factor}: must be > 1, e.g. 2")
        if self.max_extend < 0:
            raise ValueError(f"--max-extend {self.max_extend}: must be >= 0")
        if not self.seeds:
            raise ValueError("--seeds: give at least one seed")

    @property
    def middle_lr(self) -> float:
        """The rate the KL weight and temperature are chosen at."""
        lrs = sorted(self.lrs)
        return lrs[(len(lrs) - 1) // 2]


class LrChoice(NamedTuple):
    """Where an arm's learning-rate search stands: rates still to run, the chosen rate (None
    until every rate run so far has a figure) and whether it is interior."""

    pending: list[float]
    chosen: float | None
    interior: bool | None


def choose_lr(results: dict[float, float | None], spec: GridSpec) -> LrChoice:
    """The next learning rates of one arm, or its choice.

    Args:
        results: validation bits/byte of each rate run so far (None: the run failed, never
            chosen).
        spec: the grid.

    Returns:
        Rates of the grid not run yet; else one step past an end the best sits on (while
        extensions are left); else the best rate, interior or not.
    """
    base = sorted({rounded(x) for x in spec.lrs})
    grid = sorted(set(base) | {rounded(x) for x in results})
    missing = [x for x in grid if x not in results]
    if missing:
        return LrChoice(missing, None, None)
    scored = {x: v for x, v in results.items() if v is not None and math.isfinite(v)}
    if not scored:
        return LrChoice([], None, None)
    best = min(sorted(scored), key=lambda x: scored[x])
    below = sum(x < base[0] for x in grid)
    above = sum(x > base[-1] for x in grid)
    if best == grid[0] and below < spec.max_extend:
        return LrChoice([rounded(best / spec.factor)], None, None)
    if best == grid[-1] and above < spec.max_extend:
        return LrChoice([rounded(best * spec.factor)], None, None)
    return LrChoice([], best, grid[0] < best < grid[-1])


def choose_kd(
    results: dict[tuple[float, float], float | None], pairs: list[tuple[float, float]]
) -> tuple[list[tuple[float, float]], tuple[float, float] | None]:
    """The KL weight and temperature pairs still to run, or the best pair.

    Args:
        results: validation bits/byte of each pair run so far (None: failed).
        pairs: the grid's pairs.

    Returns:
        ``(pending pairs, None)`` until every pair has run, then ``([], best)`` (None when
        every pair failed).
    """
    missing = [p for p in pairs if p not in results]
    if missing:
        return missing, None
    scored = {p: v for p, v in results.items() if v is not None and math.isfinite(v)}
    if not scored:
        return [], None
    return [], min(pairs, key=lambda p: scored.get(p, math.inf))


@dataclasses.dataclass
class Plan:
    """The runs to do now (their inputs are known), each arm's chosen setting (None while its
    search goes on), whether its rate is interior, and the arms that cannot go on (every run of
    a step failed)."""

    pending: list[RunKey]
    chosen: dict[str, Setting | None]
    interior: dict[str, bool | None]
    stalled: list[str]


def plan(
    arms: list[ScaleArm],
    results: dict[RunKey, float | None],
    spec: GridSpec,
    rerun_arm: str | None = None,
) -> Plan:
    """What to run next, from the runs done so far.

    Args:
        arms: the arms.
        results: every run done (grid runs: their validation bits/byte, None if failed; final
            and rerun runs: any value, None if failed).
        spec: the grid.
        rerun_arm: the arm whose ``grid_seed`` run is trained and scored a second time after
            its final run (None: no rerun).

    Returns:
        The plan.
    """
    pending: list[RunKey] = []
    chosen: dict[str, Setting | None] = {}
    interior: dict[str, bool | None] = {}
    stalled: list[str] = []
    g = spec.grid_seed

    def want(key: RunKey) -> None:
        if key not in results and key not in pending:
            pending.append(key)

    families: dict[str, tuple[float, float] | None] = {}
    for arm in arms:
        kd_setting: tuple[float | None, float | None] = (None, None)
        if arm.tunes_kd:
            pin = arm.pinned
            if "kl_weight" in pin and "temperature" in pin:
                kd_setting = (rounded(pin["kl_weight"]), rounded(pin["temperature"]))
            else:
                if arm.family not in families:
                    families[arm.family] = _family_choice(arm, results, spec, want, stalled)
                pair = families[arm.family]
                if pair is None:
                    chosen[arm.spec], interior[arm.spec] = None, None
                    continue
                kd_setting = (
                    rounded(pin.get("kl_weight", pair[0])),
                    rounded(pin.get("temperature", pair[1])),
                )
        if "lr" in arm.pinned:
            lr, inside = rounded(arm.pinned["lr"]), None
        else:
            runs = {
                k.lr: v
                for k, v in results.items()
                if k.phase == "grid"
                and k.arm == arm.spec
                and k.seed == g
                and (k.kl_weight, k.temperature) == kd_setting
            }
            choice = choose_lr(runs, spec)
            for x in choice.pending:
                want(RunKey("grid", arm.spec, g, x, *kd_setting))
            if choice.chosen is None:
                if not choice.pending:
                    stalled.append(arm.spec)
                chosen[arm.spec], interior[arm.spec] = None, None
                continue
            lr, inside = choice.chosen, choice.interior
        chosen[arm.spec], interior[arm.spec] = Setting(lr, *kd_setting), inside
        for seed in spec.seeds:
            want(RunKey("final", arm.spec, seed, lr, *kd_setting))
        if arm.spec == rerun_arm and RunKey("final", arm.spec, g, lr, *kd_setting) in results:
            want(RunKey("rerun", arm.spec, g, lr, *kd_setting))
    return Plan(pending, chosen, interior, stalled)


def _family_choice(arm: ScaleArm, results, spec: GridSpec, want, stalled):
    """The family's KL weight and temperature (queueing its grid while it is not chosen)."""
    family = parse_scale_arm(arm.family)
    lr = rounded(family.pinned.get("lr", spec.middle_lr))
    pairs = [(rounded(k), rounded(t)) for k in spec.kl_weights for t in spec.temperatures]
    runs = {
        (k.kl_weight, k.temperature): v
        for k, v in results.items()
        if k.phase == "grid" and k.arm == family.spec and k.seed == spec.grid_seed and k.lr == lr
    }
    missing, best = choose_kd({p: runs[p] for p in pairs if p in runs}, pairs)
    for p in missing:
        want(RunKey("grid", family.spec, spec.grid_seed, lr, *p))
    if best is None and not missing:
        stalled.append(family.spec)
    return best
