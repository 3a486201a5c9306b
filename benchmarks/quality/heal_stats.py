"""The healing experiment's report: per-arm means over seeds, paired differences against CE with
95% t-intervals, the share of the gap to the parent's KD closed, and the bars.

Paired differences: ``d_s = arm_s - CE_s`` for every seed ``s`` both have (same data order, same
init), mean ``d``, 95% interval ``d +- t(0.975, n-1) * sd(d) / sqrt(n)``. The t quantile comes
from scipy where it is installed; without it a table for df 1..10 (more than 11 seeds do not fit
the GPU budget, so a report never needs more; beyond it the report asks for scipy).

Share of gap closed (bits/byte, per split): ``(CE - arm) / (CE - parent KD)`` on the means over
seeds, where "parent KD" is the same-tokenizer P-KL arm from the unpruned parent. 1 = as good as
the parent's KD, 0 = no better than CE.

An arm is compared at its own settings: its CE is CE at the arm's learning rate (``ce`` or
``ce:lr=X``), its parent the parent's KD at the arm's settings (loss keys and ``lr``; e.g.
``gold@q:kl_weight=0.5`` against ``pkl@smollm2:kl_weight=0.5``). ``on_policy`` and ``agree`` name
the arm itself, not a setting.

Bars: (1) every KD arm beats its CE on both splits on every seed by more than twice the seed
spread (the standard deviation of that CE's bits/byte over seeds on the split); (2) the best
cross-tokenizer arm closes at least 50% of the gap, on the splits where its parent's KD leaves
one; (3) where a TRL GOLD row is given, xtoken's gold arm on the same teacher against it.
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


#: keys of an arm spec that name the arm itself; the others (loss keys, ``lr``) are its settings
IDENTITY_KEYS = ("on_policy", "agree")


def split_settings(spec: str) -> tuple[str, frozenset[str]]:
    """An arm spec as (the arm without its settings, its settings' ``key=value`` pairs).

    ``"gold@q:kl_weight=0.5,lr=0.001"`` -> ``("gold@q", {"kl_weight=0.5", "lr=0.001"})``;
    ``"pkl@q:on_policy=0.5"`` -> ``("pkl@q:on_policy=0.5", {})``; ``"ce:lr=0.001"`` ->
    ``("ce", {"lr=0.001"})``.
    """
    head, _, extra = spec.partition(":")
    pairs = [p for p in extra.split(",") if p]
    own = [p for p in pairs if p.partition("=")[0] in IDENTITY_KEYS]
    return head + (":" + ",".join(own) if own else ""), frozenset(p for p in pairs if p not in own)


def references(arms: list[str], parent_arm: str | None) -> dict[str, dict[str, str | None]]:
    """Each arm's ``{"ce", "parent"}`` among ``arms`` (None where that arm is missing): CE at the
    arm's learning rate and the parent's KD at the arm's settings."""
    by_key = {split_settings(a): a for a in arms}
    out = {}
    for arm in arms:
        _, settings = split_settings(arm)
        lr = frozenset(p for p in settings if p.startswith("lr="))
        parent = by_key.get((parent_arm, settings)) if parent_arm else None
        out[arm] = {"ce": by_key.get(("ce", lr)), "parent": parent}
    return out


def summarize_heal(rows: list[dict], parent_arm: str | None) -> dict[str, Any]:
    """Everything the report prints, from the rows of finished students.

    Args:
        rows: heal rows (``arm``, ``seed``, ``heldout`` / ``fresh`` scores); rows of ``before``,
            teachers and failed runs are ignored here.
        parent_arm: the parent-KD arm spec (the gap's far end), or None.

    Returns:
        ``{"arms": {arm: {split: {"mean", "sd", "seeds", "per_seed", "diff", "gap_closed",
        "nextline", "accuracy", "cat", "continuation"}}}, "refs": {arm: {"ce", "parent"}},
        "ce_sd": {ce arm: {split: sd}}}`` (``diff`` and ``gap_closed`` against the arm's
        references, see :func:`references`; ``continuation``: ``{"mean", "sd", "seeds",
        "diff"}`` of the scorer's bits/byte of the students' own continuations, where the rows
        have them).
    """
    by_arm: dict[str, dict[int, dict]] = {}
    for r in rows:
        if r.get("kind") == "student" and r.get("heldout"):
            by_arm.setdefault(r["arm"], {})[r["seed"]] = r
    refs = references(list(by_arm), parent_arm)
    out: dict[str, Any] = {"arms": {}, "refs": refs, "ce_sd": {}}
    for ce_arm in {r["ce"] for r in refs.values() if r["ce"]}:
        out["ce_sd"][ce_arm] = {}
        for split in SPLITS:
            vals = [bpb(r, split) for r in by_arm[ce_arm].values() if bpb(r, split) is not None]
            out["ce_sd"][ce_arm][split] = statistics.stdev(vals) if len(vals) > 1 else 0.0
    for arm, seeds in by_arm.items():
        ce_arm = refs[arm]["ce"]
        ce = by_arm.get(ce_arm, {}) if ce_arm != arm else {}
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
                if d:
                    s["continuation"]["diff"] = t_interval(d)
            ce_seed = {k: bpb(r, split) for k, r in ce.items()}
            diffs = [per_seed[k] - ce_seed[k] for k in sorted(per_seed) if ce_seed.get(k)]
            if diffs:
                s["diff"] = t_interval(diffs)
            a[split] = s
        out["arms"][arm] = a
    for arm, a in out["arms"].items():
        ce_arm, parent = refs[arm]["ce"], refs[arm]["parent"]
        if ce_arm in (None, arm) or parent is None:
            continue
        for split in a:
            ce_mean = out["arms"][ce_arm].get(split, {}).get("mean")
            par = out["arms"][parent].get(split, {}).get("mean")
            if ce_mean is not None and par is not None:
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
    arms, refs, out = summary["arms"], summary["refs"], []

    def ce_seeds(arm: str) -> int:
        ce_arm = refs.get(arm, {}).get("ce") or ""
        return len(arms.get(ce_arm, {}).get("heldout", {}).get("seeds", []))

    for arm in kd_arms:
        a = arms.get(arm)
        ce_arm = refs.get(arm, {}).get("ce")
        vs = "CE" if ce_arm in (None, "ce") else f"CE at {ce_arm.partition(':')[2]}"
        name = f"{arm} beats {vs} by > 2 seed sd, every seed, both splits"
        if not a or "diff" not in a.get("heldout", {}):
            why = "no rows" if not a else f"no CE rows at its learning rate ({ce_arm or 'none'})"
            out.append((name, why, None))
            continue
        seeds, need = len(a["heldout"]["seeds"]), ce_seeds(arm)
        if seeds < max(need, 2):  # a sweep on one seed: "every seed" and a spread need more
            d = ", ".join(f"{v:+.4f}" for v in a["heldout"]["diff"]["values"])
            why = f"{seeds} seed{'s' * (seeds > 1)}, CE {need} (a sweep row, not judged)"
            out.append((name, f"{why}; heldout {d}", None))
            continue
        worst, ok = [], True
        for split in SPLITS:
            if split not in a or "diff" not in a[split]:
                ok = False
                continue
            margin = 2 * summary["ce_sd"][ce_arm][split]
            d = max(a[split]["diff"]["values"])  # the worst seed (closest to CE)
            worst.append(f"{split} worst {d:+.4f} vs -{margin:.4f}")
            ok = ok and d < -margin
        out.append((name, "; ".join(worst), ok))
    # the share of the parent's gap closed, each arm judged on the splits where its parent's KD
    # (at the arm's settings) beats its CE (elsewhere there is no gap); sweep rows on fewer
    # seeds than their CE (or on one) are not candidates
    bar = "best cross-tokenizer arm closes >= 50% of the gap"
    closed = {}
    for arm in cross_arms:
        n = len(arms.get(arm, {}).get("heldout", {}).get("seeds", []))
        if n < max(ce_seeds(arm), 2):
            continue
        judged = {sp: arms[arm].get(sp, {}).get("gap_closed") for sp in SPLITS}
        judged = {sp: g for sp, g in judged.items() if g is not None}
        if judged:
            closed[arm] = judged
    if closed:  # an arm judged on more splits first, then the least it closes on one
        best = max(closed, key=lambda k: (len(closed[k]), min(closed[k].values())))
        figs = ", ".join(f"{sp} {g:.0%}" for sp, g in closed[best].items())
        none = [sp for sp in SPLITS if sp not in closed[best]]
        if none:
            figs += f" ({', '.join(none)}: the parent's KD is no better than CE, no gap)"
        parent = refs[best]["parent"]
        out.append((bar, f"{best} (parent {parent}): {figs}", min(closed[best].values()) >= 0.5))
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
