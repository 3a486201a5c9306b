"""The healing experiment's report: per-arm means over seeds, paired differences against CE with
95% t-intervals, the share of the gap to the parent's KD closed, and the bars.

Paired differences: ``d_s = arm_s - CE_s`` for every seed ``s`` both have (same data order, same
init), mean ``d``, 95% interval ``d +- t(0.975, n-1) * sd(d) / sqrt(n)``. The t quantile comes
from scipy where it is installed; without it a table for df 1..10 (more than 11 seeds do not fit
the GPU budget, so a report never needs more; beyond it the report asks for scipy).

Share of gap closed (bits/byte, per split): ``(CE - arm) / (CE - parent KD)`` on the means over
seeds, where "parent KD" is the same-tokenizer P-KL arm from the unpruned parent. 1 = as good as
the parent's KD, 0 = no better than CE.

Bars: (1) every KD arm beats CE on both splits on every seed by more than twice the seed spread
(the standard deviation of CE's bits/byte over seeds on that split); (2) the best
cross-tokenizer arm closes at least 50% of the gap on both splits; (3) where a TRL GOLD row is
given, xtoken's gold arm on the same teacher against it.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

SPLITS = ("heldout", "fresh")

# two-sided 95%: t(0.975, df) for df 1..10
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def t_critical(df: int) -> float:
    """The two-sided 95% quantile t(0.975, df).

    Args:
        df: degrees of freedom (>= 1).

    Returns:
        scipy's value where scipy is installed, else the table's.

    Raises:
        ValueError: df < 1, or df > 10 without scipy (names the install).
    """
    if df < 1:
        raise ValueError(f"df={df}: a t-interval needs at least two seeds")
    try:
        from scipy import stats
    except ImportError:
        if df > len(T_975):
            raise ValueError(
                f"df={df}: the built-in t table stops at df {len(T_975)}; install scipy "
                "(pip install scipy) for more seeds"
            ) from None
        return T_975[df - 1]
    return float(stats.t.ppf(0.975, df))


def t_interval(values: list[float]) -> dict[str, Any]:
    """Mean and 95% t-interval of paired differences.

    Args:
        values: one difference per seed.

    Returns:
        ``{"mean", "lo", "hi", "n", "values"}``; with one value lo = hi = None.
    """
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return {"mean": mean, "lo": None, "hi": None, "n": n, "values": values}
    half = t_critical(n - 1) * statistics.stdev(values) / math.sqrt(n)
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": n, "values": values}


def gap_closed(ce: float, arm: float, parent: float) -> float | None:
    """``(ce - arm) / (ce - parent)``: the share of CE's gap to the parent's KD an arm closes.

    Args:
        ce: CE-only bits/byte.
        arm: the arm's bits/byte.
        parent: the parent-KD arm's bits/byte.

    Returns:
        The share, or None where the parent's KD is no better than CE (no gap to close).
    """
    if not ce > parent:
        return None
    return (ce - arm) / (ce - parent)


def bpb(row: dict, split: str) -> float | None:
    """A row's bits/byte on a split, or None."""
    scores = row.get(split)
    return scores["bits_per_byte"] if scores else None


def continuation_bpb(row: dict, split: str) -> float | None:
    """The scorer's bits/byte of a row's continuations on ``split`` (None: not rated)."""
    return (row.get(split) or {}).get("continuation", {}).get("bits_per_byte")


def summarize_heal(rows: list[dict], parent_arm: str | None) -> dict[str, Any]:
    """Everything the report prints, from the rows of finished students.

    Args:
        rows: heal rows (``arm``, ``seed``, ``heldout`` / ``fresh`` scores); rows of ``before``,
            teachers and failed runs are ignored here.
        parent_arm: the parent-KD arm spec (the gap's far end), or None.

    Returns:
        ``{"arms": {arm: {split: {"mean", "sd", "seeds", "per_seed", "diff", "gap_closed",
        "nextline", "accuracy", "cat", "continuation"}}}, "ce_sd": {split: sd}}``
        (``continuation``: ``{"mean", "sd", "seeds", "diff"}`` of the scorer's bits/byte of the
        students' own continuations, where the rows have them).
    """
    by_arm: dict[str, dict[int, dict]] = {}
    for r in rows:
        if r.get("kind") == "student" and r.get("heldout"):
            by_arm.setdefault(r["arm"], {})[r["seed"]] = r
    out: dict[str, Any] = {"arms": {}, "ce_sd": {}}
    ce = by_arm.get("ce", {})
    for split in SPLITS:
        vals = [bpb(r, split) for r in ce.values() if bpb(r, split) is not None]
        out["ce_sd"][split] = statistics.stdev(vals) if len(vals) > 1 else 0.0
    for arm, seeds in by_arm.items():
        a: dict[str, Any] = {}
        for split in SPLITS:
            per_seed = {s: bpb(r, split) for s, r in seeds.items() if bpb(r, split) is not None}
            if not per_seed:
                continue
            v = list(per_seed.values())
            cats = {}
            for name in next(iter(seeds.values()))[split]["per_category"]:
                cv = [r[split]["per_category"][name]["bits_per_byte"] for r in seeds.values()]
                cv = [c for c in cv if c is not None]
                cats[name] = statistics.fmean(cv) if cv else None
            s = {
                "mean": statistics.fmean(v),
                "sd": statistics.stdev(v) if len(v) > 1 else 0.0,
                "seeds": sorted(per_seed),
                "per_seed": per_seed,
                "accuracy": statistics.fmean(r[split]["accuracy"] for r in seeds.values()),
                "cat": cats,
            }
            nl = [r[split].get("nextline", {}).get("exact_match") for r in seeds.values()]
            s["nextline"] = statistics.fmean(nl) if nl and None not in nl else None
            rated = {k: continuation_bpb(r, split) for k, r in seeds.items()}
            rated = {k: v for k, v in rated.items() if v is not None}
            if rated:  # the scorer's bits/byte of the student's own continuations
                s["continuation"] = {
                    "mean": statistics.fmean(rated.values()),
                    "sd": statistics.stdev(rated.values()) if len(rated) > 1 else 0.0,
                    "seeds": sorted(rated),
                }
                ce_rated = {k: continuation_bpb(r, split) for k, r in ce.items()}
                d = [rated[k] - ce_rated[k] for k in sorted(rated) if ce_rated.get(k) is not None]
                if arm != "ce" and d:
                    s["continuation"]["diff"] = t_interval(d)
            ce_seed = {k: bpb(r, split) for k, r in ce.items()}
            diffs = [per_seed[k] - ce_seed[k] for k in sorted(per_seed) if ce_seed.get(k)]
            if arm != "ce" and diffs:
                s["diff"] = t_interval(diffs)
            a[split] = s
        out["arms"][arm] = a
    for split in SPLITS:
        ce_mean = out["arms"].get("ce", {}).get(split, {}).get("mean")
        par = out["arms"].get(parent_arm or "", {}).get(split, {}).get("mean")
        for arm, a in out["arms"].items():
            if split in a and ce_mean is not None and par is not None and arm != "ce":
                a[split]["gap_closed"] = gap_closed(ce_mean, a[split]["mean"], par)
    return out


def bars(
    summary: dict[str, Any], cross_arms: list[str], kd_arms: list[str], gold: dict | None = None
) -> list[tuple[str, str, bool | None]]:
    """The bars as ``(bar, figures, met)`` rows (met None: not decidable from the rows).

    Args:
        summary: :func:`summarize_heal`'s result.
        cross_arms: the KD arms whose teacher has another tokenizer than the student.
        kd_arms: every KD arm.
        gold: ``{"xtoken": arm spec, "trl": {split: bits/byte}}`` for the GOLD comparison, or None.

    Returns:
        The rows of the bar table.
    """
    arms, out = summary["arms"], []
    ce_seeds = len(arms.get("ce", {}).get("heldout", {}).get("seeds", []))
    for arm in kd_arms:
        a = arms.get(arm)
        if not a or "diff" not in a.get("heldout", {}):
            out.append((f"{arm} beats CE by > 2 seed sd, every seed, both splits", "no rows", None))
            continue
        seeds = len(a["heldout"]["seeds"])
        if seeds < ce_seeds:  # a sweep on one seed: "every seed" cannot be judged
            d = a["heldout"]["diff"]["values"]
            out.append(
                (
                    f"{arm} beats CE by > 2 seed sd, every seed, both splits",
                    f"{seeds} of CE's {ce_seeds} seeds (a sweep row, not judged); heldout "
                    + ", ".join(f"{v:+.4f}" for v in d),
                    None,
                )
            )
            continue
        worst, ok = [], True
        for split in SPLITS:
            if split not in a or "diff" not in a[split]:
                ok = False
                continue
            margin = 2 * summary["ce_sd"][split]
            d = max(a[split]["diff"]["values"])  # the worst seed (closest to CE)
            worst.append(f"{split} worst {d:+.4f} vs -{margin:.4f}")
            ok = ok and d < -margin
        out.append(
            (f"{arm} beats CE by > 2 seed sd, every seed, both splits", "; ".join(worst), ok)
        )
    # the share of the parent's gap closed, judged on the splits where the parent's KD beats CE
    # (elsewhere there is no gap); sweep rows on fewer seeds than CE are not candidates
    candidates = [
        arm
        for arm in cross_arms
        if len(arms.get(arm, {}).get("heldout", {}).get("seeds", [])) >= ce_seeds
    ]
    gap_splits = [
        s
        for s in SPLITS
        if any(arms[a].get(s, {}).get("gap_closed") is not None for a in candidates)
    ]
    bar = "best cross-tokenizer arm closes >= 50% of the gap"
    closed = {a: [arms[a].get(s, {}).get("gap_closed") for s in gap_splits] for a in candidates}
    closed = {a: v for a, v in closed.items() if v and None not in v}
    if closed:
        best = max(closed, key=lambda k: min(closed[k]))
        figs = ", ".join(f"{s} {g:.0%}" for s, g in zip(gap_splits, closed[best]))
        none = [s for s in SPLITS if s not in gap_splits]
        if none:
            figs += f" ({', '.join(none)}: the parent's KD is no better than CE, no gap)"
        out.append((bar, f"{best}: {figs}", min(closed[best]) >= 0.5))
    else:
        scored = any(arms.get(a, {}).get("heldout") for a in cross_arms)
        why = "the parent's KD is no better than CE on a split: no gap" if scored else "no rows"
        out.append((bar, why, None))
    if gold:
        a = arms.get(gold["xtoken"], {})
        figs, ok = [], True
        for s in SPLITS:
            mine, theirs = a.get(s, {}).get("mean"), gold["trl"].get(s)
            if mine is None or theirs is None:
                ok = None
                continue
            figs.append(f"{s} xtoken {mine:.4f} vs TRL {theirs:.4f}")
            ok = ok and mine <= theirs if ok is not None else None
        out.append((f"{gold['xtoken']} at least as good as TRL GOLD", "; ".join(figs), ok))
    return out
