"""The healing experiment's report: tables per split (per-arm means over seeds, per-category
bits/byte, next-token accuracy, next-line exact match, paired differences against CE with their
95% t-intervals, share of the gap closed), the bars, and a plot of the differences."""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path

from benchmarks.quality import heal, heal_eval, heal_peer, heal_stats

logger = logging.getLogger("kd_quality.heal")

#: what makes rows comparable: rows that differ here belong to different experiments (an arm
#: that names its own learning rate, ``ce:lr=X`` or ``...,lr=X``, carries it in its name)
SETUP = ("student", "steps", "batch", "ctx", "lr", "smoke")


def experiments(rows: list[dict]) -> set[tuple]:
    """The distinct :data:`SETUP` values of ``rows``; a row whose arm names its own learning
    rate matches an experiment of any rate."""
    i = SETUP.index("lr")
    fixed, loose = set(), set()
    for r in rows:
        own_lr = r.get("kind") == "student" and any(
            p.startswith("lr=") for p in heal_stats.split_settings(r.get("arm", ""))[1]
        )
        setup = tuple(r.get(k) for k in SETUP)
        if own_lr:
            loose.add(setup[:i] + (None,) + setup[i + 1 :])
        else:
            fixed.add(setup)
    rest = {s[:i] + s[i + 1 :] for s in fixed}
    return fixed | {s for s in loose if s[:i] + s[i + 1 :] not in rest}


def report_heal(rows: list[dict], out: Path) -> str:
    """The healing report's tables (printed and written to ``<out>/heal.md``, with
    ``heal_summary.json`` and, where matplotlib exists, ``heal_diff.png``).

    Args:
        rows: every row of the experiment (students, ``before``, teachers, TRL GOLD peers).
        out: the folder.

    Returns:
        The markdown.

    Raises:
        ValueError: rows of different experiments (:data:`SETUP`).
    """
    rows = [r for r in rows if r.get("mode") == "heal"]
    setups = experiments(rows)
    if len(setups) > 1:
        raise ValueError(
            f"the row files mix {len(setups)} experiments ({', '.join(SETUP)}: "
            f"{sorted(setups, key=str)}); report each experiment's rows on their own"
        )
    parent = next((r["parent_arm"] for r in rows if r.get("parent_arm")), None)
    s = heal_stats.summarize_heal(rows, parent)
    order = {a: i for i, a in enumerate(heal.HEAL_ARMS)}
    arms = sorted(s["arms"], key=lambda a: (order.get(a, len(order)), a))
    cats = heal_eval.HEAL_CATEGORIES
    md = []
    for split in heal_stats.SPLITS:
        md += [
            f"### {split}",
            "",
            "| arm | seeds | bits/byte (mean ± sd) | " + " | ".join(cats) + " | next-token acc | "
            "next-line EM | arm - CE (95% CI) | gap closed |",
            "|---|---|---|" + "---|" * len(cats) + "---|---|---|---|",
        ]
        for r in rows:
            if r.get("kind") in ("before", "teacher", "peer") and r.get(split):
                h = r[split]
                c = " | ".join(
                    f"{h['per_category'][n]['bits_per_byte']:.3f}"
                    if h["per_category"].get(n, {}).get("bits_per_byte") is not None
                    else "-"
                    for n in cats
                )
                label = {
                    "before": "pruned student, before training",
                    "teacher": f"teacher {r['arm']}",
                    "peer": f"{r['arm']} (TRL GOLD) s{r.get('seed')}",
                }
                md.append(
                    f"| {label.get(r['kind'], r['arm'])} | - | {h['bits_per_byte']:.4f} | {c} | "
                    f"{h['accuracy']:.4f} | {h['nextline']['exact_match']:.3f} | - | - |"
                )
        for arm in arms:
            a = s["arms"][arm].get(split)
            if not a:
                continue
            c = " | ".join(
                f"{a['cat'][n]:.3f}" if a["cat"].get(n) is not None else "-" for n in cats
            )
            d = a.get("diff")
            diff = "-"
            if d:
                ci = f" [{d['lo']:+.4f}, {d['hi']:+.4f}]" if d["lo"] is not None else ""
                diff = f"{d['mean']:+.4f}{ci}"
            gap = a.get("gap_closed")
            nl = f"{a['nextline']:.3f}" if a["nextline"] is not None else "-"
            md.append(
                f"| {arm} | {len(a['seeds'])} | {a['mean']:.4f} ± {a['sd']:.4f} | {c} | "
                f"{a['accuracy']:.4f} | {nl} | {diff} | "
                f"{'-' if gap is None else f'{gap:.0%}'} |"
            )
        md.append("")
    rated = [
        a for a in arms for sp in heal_stats.SPLITS if s["arms"][a].get(sp, {}).get("continuation")
    ]
    if rated:
        scorers: dict[str, set] = {}  # each arm's rows may name another scorer (its teacher)
        for r in rows:
            for sp in heal_stats.SPLITS:
                c = (r.get(sp) or {}).get("continuation")
                if c and c.get("scorer"):
                    scorers.setdefault(r["arm"], set()).add(c["scorer"])
        md += [
            "### the students' own continuations, rated by a teacher",
            "",
            "Each student continues the first quarter-context of the split's first texts "
            "greedily; the scorer's bits/byte of what it wrote (lower: the scorer finds it more "
            "likely; what on-policy distillation optimizes). Compare rows of one scorer only.",
            "",
            "| arm | scorer | "
            + " | ".join(f"{sp} (mean ± sd) | {sp}: arm - CE (95% CI)" for sp in heal_stats.SPLITS)
            + " |",
            "|---|---|" + "---|---|" * len(heal_stats.SPLITS),
        ]
        before = next((r for r in rows if r.get("kind") == "before"), None)
        if before is not None and any(
            heal_stats.continuation_bpb(before, sp) is not None for sp in heal_stats.SPLITS
        ):
            cells = []
            for sp in heal_stats.SPLITS:
                v = heal_stats.continuation_bpb(before, sp)
                cells += ["-" if v is None else f"{v:.4f}", "-"]
            who = ", ".join(sorted(scorers.get("before", []))) or "-"
            md.append(f"| pruned student, before training | {who} | " + " | ".join(cells) + " |")
        for arm in dict.fromkeys(rated):
            cells = []
            for sp in heal_stats.SPLITS:
                c = s["arms"][arm].get(sp, {}).get("continuation")
                if not c:
                    cells += ["-", "-"]
                    continue
                d = c.get("diff")
                diff = "-"
                if d:
                    ci = f" [{d['lo']:+.4f}, {d['hi']:+.4f}]" if d["lo"] is not None else ""
                    diff = f"{d['mean']:+.4f}{ci}"
                cells += [f"{c['mean']:.4f} ± {c['sd']:.4f}", diff]
            who = ", ".join(sorted(scorers.get(arm, []))) or "-"
            md.append(f"| {arm} | {who} | " + " | ".join(cells) + " |")
        md.append("")
    # CE at another learning rate (``ce:lr=...``, a validation sweep) is a row, not a KD arm
    kd_arms = [a for a in arms if heal.parse_heal_arm(a).base != "ce"]
    s_tok = next((r["student_tokenizer"] for r in rows if r.get("student_tokenizer")), None)
    cross = [a for a in kd_arms if heal.teacher_tokenizer(heal.parse_heal_arm(a).teacher) != s_tok]
    trl = [r for r in rows if r.get("kind") == "peer" and r.get("heldout")]
    gold = None
    if trl:  # the mean over the seeds TRL ran
        gold = {
            "xtoken": trl[0].get("compare_to", heal_peer.COMPARE_TO),
            "trl": {
                sp: statistics.fmean(r[sp]["bits_per_byte"] for r in trl)
                for sp in heal_stats.SPLITS
                if all(r.get(sp) for r in trl)
            },
        }
    md += on_policy_section(rows, arms)
    md += validation_section(rows, arms)
    md += ["### bars", "", "| bar | figures | met |", "|---|---|---|"]
    for name, figs, met in heal_stats.bars(s, cross, kd_arms, gold):
        md.append(
            f"| {name} | {figs} | {'-' if met is None else ('met' if met else '**missed**')} |"
        )
    if not trl:
        md.append("| xtoken gold vs TRL GOLD | no TRL GOLD row given | - |")
    text = "\n".join(md) + "\n"
    (out / "heal.md").write_text(text)
    (out / "heal_summary.json").write_text(json.dumps(s, indent=1, default=str))
    _plot(s, arms, out)
    return text


def validation_section(rows: list[dict], arms: list[str]) -> list[str]:
    """The validation split at each run's last step, per arm, beside CE on the same seeds:
    where settings (temperature, KL weight, learning rate) are chosen, never on held-out. A KD
    arm is paired with CE at its learning rate; a CE arm at another rate with ``ce``."""
    last = {
        (r["arm"], r.get("seed")): r["val_curve"][-1]["bits_per_byte"]
        for r in rows
        if r.get("kind") == "student" and r.get("val_curve")
    }
    if not last:
        return []
    refs = heal_stats.references(arms, None)
    md = [
        "### validation split (what settings are chosen on)",
        "",
        "| arm | seeds | bits/byte at the last step, per seed | arm - CE, same seeds (mean) |",
        "|---|---|---|---|",
    ]
    for arm in arms:
        seeds = sorted(s for a, s in last if a == arm)
        if not seeds:
            continue
        ce = refs[arm]["ce"] if refs[arm]["ce"] != arm else "ce"
        vals = [last[(arm, s)] for s in seeds]
        paired = [last[(arm, s)] - last[(ce, s)] for s in seeds if (ce, s) in last]
        diff = "-" if not paired or arm == ce else f"{statistics.fmean(paired):+.4f}"
        if paired and ce not in ("ce", arm):
            diff += f" (vs {ce})"
        per = ", ".join(f"s{s} {v:.4f}" for s, v in zip(seeds, vals))
        md.append(f"| {arm} | {len(seeds)} | {per} | {diff} |")
    return md + [""]


def off_policy_arm(spec: str) -> str | None:
    """The arm an on-policy arm is measured against: its spec without ``on_policy=`` (None: the
    arm is off-policy)."""
    head, colon, extra = spec.partition(":")
    pairs = [p for p in extra.split(",") if p] if colon else []
    kept = [p for p in pairs if not p.startswith("on_policy=")]
    if len(kept) == len(pairs):
        return None
    return head + (":" + ",".join(kept) if kept else "")


def on_policy_section(rows: list[dict], arms: list[str]) -> list[str]:
    """Markdown lines: every on-policy arm against its off-policy arm, paired by seed (held-out
    bits/byte and the scorer's bits/byte of the students' continuations, per split), with what
    its rollouts gave (rows' ``rollout`` totals). Empty without a pair."""
    by = {(r["arm"], r.get("seed")): r for r in rows if r.get("kind") == "student"}
    pairs = [(a, off_policy_arm(a)) for a in arms]
    pairs = [(a, o) for a, o in pairs if o is not None and o in arms]
    if not pairs:
        return []
    md = [
        "### on-policy arms against their off-policy arm",
        "",
        "Paired by seed (same seed: same initial order of the texts): arm - off-policy arm, "
        "mean [95% CI]; lower is better everywhere. `bits/byte`: the split's texts; "
        "`continuations`: the scorer's bits/byte of the student's own greedy continuations. "
        "Rollouts: on-policy samples trained over the seeds, their mean staleness (weight "
        "versions), samples dropped as too stale, generated tokens/s per worker while sampling.",
        "",
        "| arm | against | seeds | "
        + " | ".join(f"{sp} bits/byte | {sp} continuations" for sp in heal_stats.SPLITS)
        + " | rollouts |",
        "|---|---|---|" + "---|---|" * len(heal_stats.SPLITS) + "---|",
    ]
    for arm, off in pairs:
        seeds = sorted(s for (a, s) in by if a == arm and (off, s) in by)
        if not seeds:
            continue
        cells = []
        for sp in heal_stats.SPLITS:
            for value in (heal_stats.bpb, heal_stats.continuation_bpb):
                d = [value(by[(arm, s)], sp) for s in seeds]
                o = [value(by[(off, s)], sp) for s in seeds]
                if None in d or None in o:
                    cells.append("-")
                    continue
                t = heal_stats.t_interval([x - y for x, y in zip(d, o)])
                ci = f" [{t['lo']:+.4f}, {t['hi']:+.4f}]" if t["lo"] is not None else ""
                cells.append(f"{t['mean']:+.4f}{ci}")
        tot = [by[(arm, s)].get("rollout") for s in seeds]
        if all(tot):
            n = sum(t["samples"] for t in tot)
            stale = sum((t["mean_staleness"] or 0) * t["samples"] for t in tot) / n if n else 0
            rates = [t["tokens_per_s_per_worker"] for t in tot if t["tokens_per_s_per_worker"]]
            rate = f", {statistics.fmean(rates):,.0f} tok/s" if rates else ""
            dropped = sum(t["dropped_stale"] for t in tot)
            cells.append(f"{n:,} samples, staleness {stale:.2f}, {dropped:,} dropped{rate}")
        else:
            cells.append("-")
        md.append(f"| {arm} | {off} | {len(seeds)} | " + " | ".join(cells) + " |")
    return md + [""]


def _plot(summary: dict, arms: list[str], out: Path) -> None:
    """Paired differences against CE (at each arm's learning rate) with their 95% intervals, one
    panel per split."""
    try:
        import matplotlib
    except ImportError:
        logger.warning(
            "[heal] no plot: matplotlib is not installed (./scripts/setup.sh test bench)"
        )
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=120, sharey=True)
    for ax, split in zip(axes, heal_stats.SPLITS):
        names, means, errs = [], [], []
        for arm in arms:
            d = summary["arms"][arm].get(split, {}).get("diff")
            if d:
                names.append(arm)
                means.append(d["mean"])
                errs.append(0.0 if d["lo"] is None else d["hi"] - d["mean"])
        ax.barh(names, means, xerr=errs, color="tab:blue", alpha=0.7)
        ax.axvline(0, color="black", lw=0.8)
        ax.set_title(f"{split}: arm - CE at its rate, bits/byte (95% CI)", fontsize=10)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "heal_diff.png")
    plt.close(fig)
