"""The report of the scaled healing experiment: the table of final runs (mean ± sd over seeds per
split, paired differences against the tuned CE with 95% t-intervals, ``heal_stats``), the bars,
CE's validation curve, the grid's choices and a plot of the validation curves per arm.

Bars (each row of the bar table says met, missed, or not decidable from the rows):

1. every cross-tokenizer KD arm beats the tuned CE on held-out and fresh by more than 3x CE's
   seed standard deviation (mean paired difference);
2. the best cross-tokenizer arm closes >= 50% of the parent's gain on each split
   (``heal_stats.gap_closed``);
3. two teachers in one run are at least as good as the better of the two alone (same loss);
4. a teacher cache is within 2x its online twin's seed sd of that twin on each split;
5. on-policy after an off-policy start rates better (teacher bits/byte of its completions) than
   its off-policy twin by more than the seed spread, losing <= 0.01 held-out bits/byte;
6. the rerun of one arm's seed gives a bitwise-equal row (weights and every figure);
7. CE has converged: its validation bits/byte fell by less than 3x its seed sd over the last
   quarter of its steps (else the comparison is about the speed of early learning).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import statistics
from pathlib import Path
from typing import Any

from benchmarks.quality import heal, heal_stats
from benchmarks.quality.scale_arms import PEER_BASE
from benchmarks.quality.scale_grid import row_key

logger = logging.getLogger("kd_quality.scale")

SPLITS = ("heldout", "fresh")
FIGURES = {"validation": "validation_bpb", "heldout": "heldout_bpb", "fresh": "fresh_bpb"}
ONPOLICY_HELDOUT_LOSS = 0.01


def _stats(values: dict[int, float]) -> dict[str, Any]:
    v = list(values.values())
    return {
        "mean": statistics.fmean(v),
        "sd": statistics.stdev(v) if len(v) > 1 else 0.0,
        "n": len(v),
        "per_seed": values,
    }


def summarize(rows: list[dict]) -> dict[str, Any]:
    """Per-arm figures of the final rows.

    Args:
        rows: scale rows (grid, final, rerun; failed ones are left out).

    Returns:
        ``{"arms": {arm: {"row": a final row, split: stats, "completion": stats, "next_line_em":
        mean, "diff": {split: t-interval vs CE}}}, "ce": the CE arm or None, "parent": the
        parent's arm or None, "cross": cross-tokenizer KD arms}``.
    """
    final: dict[str, dict[int, dict]] = {}
    for r in rows:
        if r.get("phase") == "final" and r.get("heldout_bpb") is not None:
            final.setdefault(r["arm"], {})[r["seed"]] = r
    ce = next((a for a, s in final.items() if not next(iter(s.values()))["teachers"]), None)
    parent = cross = None
    cross = []
    for arm, seeds in final.items():
        r = next(iter(seeds.values()))
        toks = [heal.teacher_tokenizer(t) for t in r["teachers"]]
        if not toks:
            continue
        same = r["student_tokenizer"] in toks
        if r["family"].partition("@")[0] == PEER_BASE:
            continue  # TRL's trainer: a reference point, not one of the arms the bars judge
        if same and len(toks) == 1 and arm == r["family"] and parent is None:
            parent = arm
        elif not same:
            cross.append(arm)
    out: dict[str, Any] = {"arms": {}, "ce": ce, "parent": parent, "cross": cross}
    for arm, seeds in final.items():
        a: dict[str, Any] = {
            "row": next(iter(seeds.values())),
            "rows": [seeds[k] for k in sorted(seeds)],
            "seeds": sorted(seeds),
        }
        for split, key in FIGURES.items():
            vals = {s: r[key] for s, r in seeds.items() if r.get(key) is not None}
            if vals:
                a[split] = _stats(vals)
        rated = {s: r["completion_teacher_bpb"] for s, r in seeds.items()}
        rated = {s: v for s, v in rated.items() if v is not None}
        if rated:
            a["completion"] = _stats(rated)
        em = [r["next_line_em"] for r in seeds.values() if r.get("next_line_em") is not None]
        a["next_line_em"] = statistics.fmean(em) if em else None
        out["arms"][arm] = a
    for arm, a in out["arms"].items():
        a["diff"] = {}
        if ce is None or arm == ce:
            continue
        for split in SPLITS:
            d = paired(a.get(split), out["arms"][ce].get(split))
            if d:
                a["diff"][split] = heal_stats.t_interval(d)
    return out


def paired(arm: dict | None, ref: dict | None) -> list[float]:
    """Paired differences.

    Args:
        arm: an arm's stats on a split (:func:`summarize`), or None.
        ref: the reference's stats on the same split, or None.

    Returns:
        ``arm - ref`` for every seed both have, in seed order (empty if either is None).
    """
    if not arm or not ref:
        return []
    return [
        arm["per_seed"][s] - ref["per_seed"][s]
        for s in sorted(arm["per_seed"])
        if s in ref["per_seed"]
    ]


def bars(summary: dict[str, Any], rows: list[dict]) -> list[tuple[str, str, bool | None]]:
    """The bars as ``(bar, figures, met)`` (met None: not decidable from the rows).

    Args:
        summary: :func:`summarize`'s result.
        rows: every row (the rerun's and CE's curves are read from them).

    Returns:
        The rows of the bar table.
    """
    arms, ce, out = summary["arms"], summary["ce"], []
    ce_sd = {s: arms[ce][s]["sd"] for s in SPLITS if ce and s in arms[ce]}
    for arm in summary["cross"]:
        name = f"{arm} beats tuned CE by > 3 CE seed sd on both splits"
        d = arms[arm]["diff"]
        if ce is None or len(d) < len(SPLITS) or arms[ce]["heldout"]["n"] < 2:
            out.append((name, "no CE rows on 2 seeds or more (no spread)", None))
            continue
        figs = [f"{s} {d[s]['mean']:+.4f} vs -{3 * ce_sd[s]:.4f}" for s in SPLITS]
        out.append((name, "; ".join(figs), all(d[s]["mean"] < -3 * ce_sd[s] for s in SPLITS)))
    out.append(_gap_bar(summary))
    for arm, a in arms.items():
        teachers = a["row"]["teachers"]
        if len(teachers) < 2:
            continue
        base = arm.partition("@")[0]
        singles = [
            s
            for s, b in arms.items()
            if b["row"]["teachers"] in [[t] for t in teachers]
            and s.partition("@")[0] == base
            and s == b["row"]["family"]
        ]
        name = f"{arm} at least as good as the better single teacher"
        if len(singles) < len(teachers):
            out.append((name, f"single-teacher arms missing (have {singles})", None))
            continue
        figs, ok = [], True
        for s in SPLITS:
            best = min(singles, key=lambda x: arms[x][s]["mean"])
            figs.append(f"{s} {a[s]['mean']:.4f} vs {best} {arms[best][s]['mean']:.4f}")
            ok = ok and a[s]["mean"] <= arms[best][s]["mean"]
        out.append((name, "; ".join(figs), ok))
    for arm, a in arms.items():
        twin = a["row"].get("twin")
        if not twin:
            continue
        if a["row"].get("on_policy"):
            out.append(_on_policy_bar(arm, twin, arms))
            continue
        if ":cache" not in arm and ",cache" not in arm:
            continue
        name = f"{arm} within 2 seed sd of {twin}"
        if twin not in arms or arms[twin]["heldout"]["n"] < 2:
            out.append((name, "its twin has fewer than 2 seeds: no spread", None))
            continue
        figs, ok = [], True
        for s in SPLITS:
            gap, sd = abs(a[s]["mean"] - arms[twin][s]["mean"]), arms[twin][s]["sd"]
            figs.append(f"{s} |{gap:.4f}| vs {2 * sd:.4f}")
            ok = ok and gap <= 2 * sd
        out.append((name, "; ".join(figs), ok))
    out.append(_rerun_bar(rows))
    out.append(_convergence_bar(summary))
    return out


def _gap_bar(summary: dict) -> tuple[str, str, bool | None]:
    arms, ce, parent = summary["arms"], summary["ce"], summary["parent"]
    name = "best cross-tokenizer arm closes >= 50% of the parent's gain on each split"
    if not (ce and parent and summary["cross"]):
        return name, "needs CE, the parent and a cross-tokenizer arm", None
    closed = {}
    for arm in summary["cross"]:
        g = {
            s: heal_stats.gap_closed(
                arms[ce][s]["mean"], arms[arm][s]["mean"], arms[parent][s]["mean"]
            )
            for s in SPLITS
        }
        if None in g.values():
            return name, "the parent is no better than CE on a split: no gain to close", None
        closed[arm] = g
    best = max(closed, key=lambda a: min(closed[a].values()))
    figs = ", ".join(f"{s} {g:.0%}" for s, g in closed[best].items())
    return name, f"{best}: {figs}", min(closed[best].values()) >= 0.5


def _on_policy_bar(arm: str, twin: str, arms: dict) -> tuple[str, str, bool | None]:
    name = f"{arm} rates better than {twin} beyond the seed spread, held-out loss <= {ONPOLICY_HELDOUT_LOSS}"
    a, b = arms[arm], arms.get(twin)
    if not b or "completion" not in a or "completion" not in b:
        return name, "no rated completions of it or its twin", None
    if min(a["completion"]["n"], b["completion"]["n"]) < 2:
        return name, "fewer than 2 seeds: no spread", None
    rated = paired(a["completion"], b["completion"])
    held = paired(a["heldout"], b["heldout"])
    spread = max(a["completion"]["sd"], b["completion"]["sd"])
    d_rated, d_held = statistics.fmean(rated), statistics.fmean(held)
    figs = f"completions {d_rated:+.4f} vs -{spread:.4f}; held-out {d_held:+.4f}"
    return name, figs, d_rated < -spread and d_held <= ONPOLICY_HELDOUT_LOSS


def _rerun_bar(rows: list[dict]) -> tuple[str, str, bool | None]:
    reruns = [r for r in rows if r.get("phase") == "rerun" and r.get("exit") == 0]
    name = "a rerun of one arm's config gives a bitwise-equal row"
    if not reruns:
        return name, "no rerun row", None
    figs = ", ".join(
        f"{r['arm']} s{r['seed']}: {'equal' if r.get('bitwise_equal') else 'differs'}"
        for r in reruns
    )
    return name, figs, all(r.get("bitwise_equal") for r in reruns)


def convergence(curve: list[dict]) -> float | None:
    """How much a validation curve fell over the last quarter of its steps (bits/byte; None
    with fewer than two points)."""
    if len(curve) < 2:
        return None
    last = curve[-1]["step"]
    at = min(curve, key=lambda p: abs(p["step"] - 0.75 * last))
    return at["bits_per_byte"] - curve[-1]["bits_per_byte"]


def _convergence_bar(summary: dict) -> tuple[str, str, bool | None]:
    name = "CE converged: validation fell < 3 CE seed sd over its last quarter"
    ce = summary["ce"]
    if ce is None:
        return name, "no CE rows", None
    falls = [convergence(r.get("val_curve") or []) for r in summary["arms"][ce]["rows"]]
    falls = [f for f in falls if f is not None]
    if not falls or "validation" not in summary["arms"][ce]:
        return name, "CE's curves have fewer than two points", None
    fall, sd = statistics.fmean(falls), summary["arms"][ce]["validation"]["sd"]
    return name, f"fell {fall:.4f} vs {3 * sd:.4f}", fall < 3 * sd


def _fmt(stats: dict | None) -> str:
    return f"{stats['mean']:.4f} ± {stats['sd']:.4f}" if stats else "-"


def _ci(d: dict | None) -> str:
    if not d:
        return "-"
    if d["lo"] is None:
        return f"{d['mean']:+.4f}"
    return f"{d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}]"


def markdown(rows: list[dict]) -> str:
    """The report's markdown: the table of final runs first, then the bars, the runs' time and
    resumes, CE's validation curve and the grid.

    Args:
        rows: the experiment's rows (rows of other experiments are left out).

    Returns:
        The markdown.
    """
    rows = [r for r in rows if r.get("mode") == "scale"]
    s = summarize(rows)
    n_seeds = max((len(a["seeds"]) for a in s["arms"].values()), default=0)
    devices = sorted({r["device"] for r in rows})
    commits = sorted({r["commit"] for r in rows})
    splits = sorted({r["split_sha256"] for r in rows if r.get("split_sha256")})
    finals = [r for r in rows if r.get("phase") != "grid"]
    head = finals[0] if finals else rows[0] if rows else {}
    grid = next((r for r in rows if r.get("phase") == "grid"), {})
    grid_note = (
        f" (the grid's runs {grid['tokens_budget']:,} tokens, {grid['steps_budget']} steps)"
        if grid and grid.get("steps_budget") != head.get("steps_budget")
        else ""
    )
    title = f"then {n_seeds} seed{'s' * (n_seeds != 1)}" if n_seeds else "the grid under way"
    command = next((r["command"] for r in finals + rows if r.get("command")), None)
    md = [
        f"# Healing a pruned SmolLM2 at scale: every arm tuned alike, {title}",
        "",
        headline(s, rows),
        "",
        f"Devices: {', '.join(devices) or '-'}; commits {', '.join(commits) or '-'}; "
        + (f"split {', '.join(splits)} (its train and val texts' SHA-256); " if splits else "")
        + f"{head.get('tokens_budget', 0):,} student tokens per run ({head.get('steps_budget')} "
        f"steps of {head.get('batch')} x {head.get('ctx')}){grid_note}; the settings chosen on "
        "validation "
        "(seed 0), then scored once on held-out and fresh. Command: "
        + (f"`{command}`." if command else "`python benchmarks/quality/scale.py --gpus ...`.")
        + " Rows: [quality_scale.jsonl](quality_scale.jsonl); per-arm figures: "
        "[quality_scale_summary.json](quality_scale_summary.json).",
        "",
    ]
    if not n_seeds:
        grid = first_rows([r for r in rows if r.get("phase") == "grid"])
        grid_runs = sum(1 for r in grid if r.get("validation_bpb") is not None)
        md += [
            f"No final run is scored yet ({grid_runs} grid settings scored so far): this table "
            "fills as the "
            "final runs are scored; the grid's validation figures (seed 0) are at the end.",
            "",
        ]
    md += [
        "| arm | seeds | lr | KL w | T | tokens | det. | validation | held-out | fresh "
        "| held-out - CE (95% CI) | fresh - CE (95% CI) | next-line EM | completion b/B |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, a in s["arms"].items():
        r = a["row"]
        interior = "" if r.get("lr_interior") in (True, None) else " (edge)"
        md.append(
            f"| {arm} | {len(a['seeds'])} | {r['lr']:g}{interior} | {r.get('kl_weight') or '-'} "
            f"| {r.get('temperature') or '-'} | {r['tokens']:,} | {'yes' if r['deterministic'] else 'no'} "
            f"| {_fmt(a.get('validation'))} | {_fmt(a.get('heldout'))} | {_fmt(a.get('fresh'))} "
            f"| {_ci(a['diff'].get('heldout'))} | {_ci(a['diff'].get('fresh'))} "
            f"| {a['next_line_em'] if a['next_line_em'] is None else format(a['next_line_em'], '.3f')} "
            f"| {_fmt(a.get('completion'))} |"
        )
    md += ["", "## Bars", "", "| bar | figures | met |", "|---|---|---|"]
    for name, figs, met in bars(s, rows):
        md.append(f"| {name} | {figs} | {'-' if met is None else 'yes' if met else 'no'} |")
    md += runs_table(rows)
    md += repeats(rows)
    if s["ce"]:
        md += [
            "",
            f"## CE's validation curve ({s['ce']}, mean over seeds)",
            "",
            "| step | bits/byte |",
            "|---|---|",
        ]
        md += [f"| {step} | {bpb:.4f} |" for step, bpb in mean_curve(s["arms"][s["ce"]]["rows"])]
    md += [
        "",
        "## Grid (seed 0, validation bits/byte; * chosen)",
        "",
        "| arm | lr | KL w | T | validation |",
        "|---|---|---|---|---|",
    ]
    chosen = {
        (r["arm"], r["lr"], r.get("kl_weight"), r.get("temperature"))
        for r in rows
        if r["phase"] == "final"
    }
    for r in sorted(
        first_rows([r for r in rows if r["phase"] == "grid"]),
        key=lambda r: (r["arm"], r["lr"], str(r.get("kl_weight")), str(r.get("temperature"))),
    ):
        mark = (
            "*" if (r["arm"], r["lr"], r.get("kl_weight"), r.get("temperature")) in chosen else ""
        )
        v = "failed" if r.get("validation_bpb") is None else f"{r['validation_bpb']:.4f}{mark}"
        md.append(
            f"| {r['arm']} | {r['lr']:g} | {r.get('kl_weight') or '-'} | {r.get('temperature') or '-'} | {v} |"
        )
    return "\n".join(md) + "\n"


def headline(summary: dict[str, Any], rows: list[dict]) -> str:
    """The current figures in one bold line: the best cross-tokenizer arm against the tuned CE
    on both splits once final runs exist; before them, the best validation figure of the grid's
    CE and of its KD arms (seed 0).

    Args:
        summary: :func:`summarize`'s result.
        rows: the experiment's rows.

    Returns:
        The line (markdown).
    """
    arms, ce = summary["arms"], summary["ce"]
    scored = [a for a in summary["cross"] if all(s in arms[a]["diff"] for s in SPLITS)]
    if ce and scored:
        best = min(scored, key=lambda a: arms[a]["diff"]["heldout"]["mean"])
        d = arms[best]["diff"]
        return (
            f"**Current figures: the best cross-tokenizer arm, {best}, minus the tuned CE: "
            f"held-out {_ci(d['heldout'])}, fresh {_ci(d['fresh'])} bits/byte "
            f"({len(arms[best]['seeds'])} seeds).**"
        )
    grid = [r for r in rows if r.get("phase") == "grid" and r.get("validation_bpb") is not None]
    if not grid:
        return "**Current figures: none yet (no run is scored).**"
    parts = []
    for name, pick in (("CE", lambda r: not r["teachers"]), ("KD", lambda r: bool(r["teachers"]))):
        rs = [r for r in grid if pick(r)]
        if rs:
            r = min(rs, key=lambda r: r["validation_bpb"])
            parts.append(f"{name} {r['validation_bpb']:.4f} ({r['arm']}, lr {r['lr']:g})")
    return (
        "**Current figures (the grid so far, seed 0, validation bits/byte, best of each): "
        + "; ".join(parts)
        + ".**"
    )


def first_rows(rows: list[dict]) -> list[dict]:
    """One row per run setting: its first scored row, else its first row (a failure)."""
    by: dict[tuple, dict] = {}
    for r in rows:
        k = row_key(r)
        if k not in by or (by[k].get("exit") != 0 and r.get("exit") == 0):
            by[k] = r
    return list(by.values())


def repeats(rows: list[dict]) -> list[str]:
    """Markdown lines on the settings trained more than once (deterministic runs, in other
    calls or on other machines, as when a call's rows were not carried to the next): whether
    every training of each gave the same weights and validation figure."""
    by: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("exit") == 0 and r.get("deterministic") and r.get("weights_sha256"):
            by.setdefault(row_key(r), []).append(r)
    twice = {k: rs for k, rs in by.items() if len(rs) > 1}
    if not twice:
        return []
    equal = [
        k
        for k, rs in twice.items()
        if len({(r["weights_sha256"], r.get("validation_bpb")) for r in rs}) == 1
    ]
    return [
        "",
        f"Trained more than once: {len(twice)} settings "
        f"({', '.join(sorted({k[1] for k in twice}))}), {sum(map(len, twice.values()))} "
        f"trainings; bitwise-equal weights and validation figure for {len(equal)} of "
        f"{len(twice)}.",
    ]


def runs_table(rows: list[dict]) -> list[str]:
    """Markdown lines: per phase, its runs, how many went on from a checkpoint of an earlier
    call, the median seconds of a run (training and scoring) and of its steps alone, of the
    runs trained in one call the median seconds of the training command, of its start-up step
    and of the scoring command, and the most GPU memory a trainer and a teacher allocated."""

    def median(xs: list[float]) -> str:
        return f"{statistics.median(xs):.0f}" if xs else "-"

    md = [
        "",
        "## Runs",
        "",
        "Where a run's time goes (medians; a run trained in one call): its training command, of "
        "which the start-up step (the student's compile and CUDA graph recording) and the steps; "
        "then its scoring command.",
        "",
        "| phase | runs | resumed from a checkpoint | median s a run (training, scoring) "
        "| median s of its steps | training command s | start-up step s | scoring command s "
        "| peak GiB, trainer / teacher (most) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for phase in ("grid", "final", "rerun"):
        every = [r for r in rows if r.get("phase") == phase]
        ps = [r for r in every if r.get("exit", 0) == 0]  # the times of the runs that ended well
        if every:
            failed = len(every) - len(ps)
            walls = [r["wall_s"] for r in ps if r.get("wall_s") is not None]
            steps = [r["train_s"] for r in ps if r.get("train_s") is not None]
            resumed = sum(1 for r in ps if r.get("resumed"))
            # command_s: each training stage's command, then the scoring's; one entry alone is
            # a scoring of a run trained by an earlier call
            whole = [r for r in ps if len(r.get("command_s") or []) > 1 and not r.get("resumed")]
            train_cmd = [sum(r["command_s"][:-1]) for r in whole]
            score_cmd = [r["command_s"][-1] for r in whole]
            start_up = [r["compile_s"] for r in whole if r.get("compile_s") is not None]
            # the most GPU memory any run's trainer / teacher allocated (MiB in the rows)
            most = [
                max(((r.get("peak_memory_mib") or {}).get(k) or 0 for r in ps), default=0)
                for k in ("trainer", "teacher")
            ]
            peaks = " / ".join(f"{m / 1024:.1f}" if m else "-" for m in most)
            md.append(
                f"| {phase} | {len(every)}{f' ({failed} failed)' if failed else ''} | {resumed} "
                f"| {median(walls)} | {median(steps)} "
                f"| {median(train_cmd)} | {median(start_up)} | {median(score_cmd)} | {peaks} |"
            )
    md += [line for phase in ("grid", "final", "rerun") if (line := start_up_line(rows, phase))]
    return md + memory_table(rows)


#: the rows' peak memory fields, as the report and ``scale.py --plan`` name them
PEAKS = (("peak_memory_mib", "allocated"), ("peak_reserved_mib", "reserved"))


def _says_memory(r: dict) -> bool:
    """A run that ended well and says its trainer's memory."""
    return r.get("exit", 0) == 0 and bool((r.get("peak_memory_mib") or {}).get("trainer"))


def arm_peaks(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per arm whose runs ended well and say their memory, the most GPU memory in MiB any of its
    runs took: ``{"trainer allocated": ..., "teacher reserved": ...}`` for the figures its rows
    give (allocated by PyTorch, reserved by its allocator)."""
    most: dict[str, dict[str, float]] = {}
    for r in rows:
        if not _says_memory(r):
            continue
        m = most.setdefault(r["arm"], {})
        for field, tag in PEAKS:
            for who, v in (r.get(field) or {}).items():
                if v:
                    m[f"{who} {tag}"] = max(m.get(f"{who} {tag}", 0.0), v)
    return most


def memory_table(rows: list[dict]) -> list[str]:
    """Markdown lines: per arm, the most GPU memory any of its runs' trainers and teachers had
    PyTorch allocate and (rows that say) its allocator reserve, in GiB: what a run takes of a
    GPU it shares (``scale.py --slots``); [] when no row says."""
    arms = arm_peaks(rows)
    if not arms:
        return []
    md = [
        "",
        "Memory per arm (GiB, the most of its runs; reserved: what PyTorch's allocator held, its "
        "cache and CUDA graphs' pools included; a process adds its CUDA context):",
        "",
        "| arm | runs | trainer allocated | trainer reserved | teacher allocated "
        "| teacher reserved |",
        "|---|---|---|---|---|---|",
    ]
    for arm in sorted(arms):
        runs = sum(1 for r in rows if r["arm"] == arm and _says_memory(r))
        cells = [
            f"{m / 1024:.1f}" if (m := arms[arm].get(f"{who} {tag}")) else "-"
            for who in ("trainer", "teacher")
            for _, tag in PEAKS
        ]
        md.append(f"| {arm} | {runs} | " + " | ".join(cells) + " |")
    return md


def start_up_line(rows: list[dict], phase: str) -> str:
    """Where the start-up steps of a phase's runs went, from the rows that say (``start_up``: per
    training stage, its calls' ``[length, seconds]`` and Inductor's cache lookups): the median
    seconds of the first call (the compile) and of the others (the ladder's other graphs, the
    recordings), and the cache lookups of them all; "" when no row says."""
    reports = [
        rep
        for r in rows
        if r.get("phase") == phase and r.get("exit", 0) == 0
        for rep in (r.get("start_up") or [])
        if rep and rep.get("calls")
    ]
    if not reports:
        return ""
    first = statistics.median(rep["calls"][0][1] for rep in reports)
    rest = statistics.median(sum(t for _, t in rep["calls"][1:]) for rep in reports)
    text = (
        f"\nStart-up steps of the {phase} runs ({len(reports)} that say): the first call (the "
        f"compile) {first:.0f} s, the other calls (other lengths' graphs, CUDA graph recordings) "
        f"{rest:.0f} s (medians)"
    )
    caches = [rep["caches"] for rep in reports if rep.get("caches")]
    if caches:
        total = {
            k: sum(c[k] for rep in caches for c in rep.values()) for k in ("hit", "miss", "bypass")
        }
        text += (
            f"; Inductor's on-disk caches: {total['hit']} hits, {total['miss']} misses, "
            f"{total['bypass']} bypassed"
        )
    phased = [rep["phases"] for rep in reports if rep.get("phases")]
    if phased:  # the compiler's own timers (nested phases: they overlap)
        names = {k for ph in phased for k in ph}
        med = {k: statistics.median(ph.get(k, 0.0) for ph in phased) for k in names}
        top = sorted(med.items(), key=lambda kv: -kv[1])[:5]
        text += "; the compiler's largest phases (medians, nested): " + ", ".join(
            f"`{k}` {v:.1f} s" for k, v in top
        )
    return text + "."


def mean_curve(rows: list[dict]) -> list[tuple[int, float]]:
    """The mean validation curve of rows.

    Args:
        rows: rows with ``val_curve`` (``[{"step", "bits_per_byte"}]``).

    Returns:
        ``(step, mean bits/byte)`` for every step all the rows have, in step order.
    """
    by_step: dict[int, list[float]] = {}
    for r in rows:
        for p in r.get("val_curve") or []:
            by_step.setdefault(p["step"], []).append(p["bits_per_byte"])
    return [(k, statistics.fmean(v)) for k, v in sorted(by_step.items()) if len(v) == len(rows)]


def write_report(rows: list[dict], out: Path) -> str:
    """Write ``quality_scale.md`` (and ``quality_scale.png`` where matplotlib is installed).

    Args:
        rows: the experiment's rows.
        out: the folder.

    Returns:
        The markdown.
    """
    md = markdown(rows)
    if importlib.util.find_spec("matplotlib") is None:
        md += "\nNo plot: matplotlib is not installed (pip install matplotlib).\n"
        logger.warning("[scale] no plot: matplotlib is not installed")
    else:
        _plot(rows, out / "quality_scale.png")
        md += "\n![validation curves per arm](quality_scale.png)\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality_scale.md").write_text(md)
    summary = summarize([r for r in rows if r.get("mode") == "scale"])
    for a in summary["arms"].values():
        del a["rows"], a["row"]
    (out / "quality_scale_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return md


def plotted_curves(rows: list[dict]) -> dict[str, list[dict]]:
    """The rows whose validation curves the plot draws, per arm: the final runs' (every seed);
    before any final run, each arm's grid run of the lowest validation bits/byte.

    Args:
        rows: the experiment's rows.

    Returns:
        ``{arm: [rows]}``.
    """
    rows = [r for r in rows if r.get("mode") == "scale" and r.get("val_curve")]
    finals: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("phase") == "final":
            finals.setdefault(r["arm"], []).append(r)
    if finals:
        return finals
    best: dict[str, dict] = {}
    for r in rows:
        if r.get("phase") == "grid" and r.get("validation_bpb") is not None:
            if r["arm"] not in best or r["validation_bpb"] < best[r["arm"]]["validation_bpb"]:
                best[r["arm"]] = r
    return {arm: [r] for arm, r in best.items()}


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for arm, rs in plotted_curves(rows).items():
        curve = mean_curve(rs)
        ax.plot([c[0] for c in curve], [c[1] for c in curve], label=arm, lw=1.2)
    finals = any(r.get("phase") == "final" for r in rows)
    ax.set_xlabel("step")
    ax.set_ylabel(
        "validation bits/byte (mean over seeds)"
        if finals
        else "validation bits/byte (grid, seed 0, each arm's best setting)"
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
