"""Plot of the teacher layouts: ``benchmarks/results/teachers.png`` from the committed rows of
``benchmarks/results/teachers.jsonl`` only (no measurement).

Three panels, one per bar of the teachers' results file, from the rows counted between step
starts (``rate: step_starts``); the record-time rows read up to 1.19x high and appear only in the
first panel, hatched:

1. the 32B-shaped teacher with its 1.7B student: end-to-end MFU per layout and GPU count, the
   0.35 bar as a line;
2. the 7B-shaped teacher with its 1.7B student on one, two and four GPUs: tokens/s over the
   one-GPU mean at the same grad_accum, per layout, with the linear line and the 3.6x bar at
   four GPUs;
3. ``topk`` against the ring on one GPU: each topk run's tokens/s over the ring's of the same
   same commit and host load (the rows of one commit and ``tag``, grad_accum 1), per K and steps
   asked ahead, the 0.95x bar as a line.

Usage::

    python benchmarks/teachers/plot_teachers.py [--rows benchmarks/results/teachers.jsonl]
        [--out benchmarks/results/teachers.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
MFU_BAR, SCALE_BAR, TOPK_BAR = 0.35, 3.6, 0.95


def read_rows(path: Path) -> list[dict]:
    """The rows without an error."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if not r.get("error")]


def timed(rows: list[dict]) -> list[dict]:
    """The rows counted between step starts."""
    return [r for r in rows if r.get("rate") == "step_starts"]


def big_teacher(rows: list[dict]) -> list[tuple[str, float, bool]]:
    """``(label, MFU, record-time rate)`` of each 32B layout run at grad_accum 4 (``forward_rows``
    left at its default), by GPU count."""
    out = []
    for r in rows:
        if "32b" in r["teacher"] and r.get("forward_rows") is None and r["grad_accum"] == 4:
            late = r.get("rate") != "step_starts"
            label = f"{r['layout']}\n{r['gpus']} GPUs" + ("\n(record-time)" if late else "")
            out.append((label, r["mfu_e2e"], late))
    return sorted(out, key=lambda x: (x[0].split("\n")[1], x[0]))


def scaling(rows: list[dict]) -> tuple[dict[int, float], list[tuple[int, str, int, float]]]:
    """The one-GPU mean tokens/s of the 7B teacher (ring) per grad_accum, and ``(GPUs, layout,
    grad_accum, ratio to the one-GPU mean of its grad_accum)`` of every multi-GPU run that has
    one."""
    seven = [
        r for r in rows
        if "7b" in r["teacher"] and r["transport"] != "topk" and r.get("teachers") is not None
    ]  # fmt: skip
    one: dict[int, list[float]] = defaultdict(list)
    for r in seven:
        if r["gpus"] == 1 and r["layout"] == "coloc":
            one[r["grad_accum"]].append(r["tokens_per_s"])
    if not one:
        raise ValueError("no one-GPU 7B rows between step starts to scale against")
    base = {ga: statistics.mean(v) for ga, v in sorted(one.items())}
    more = [
        (r["gpus"], r["layout"], r["grad_accum"], r["tokens_per_s"] / base[r["grad_accum"]])
        for r in seven
        if r["gpus"] > 1 and r["grad_accum"] in base
    ]
    return base, sorted(more)


def topk_ratios(rows: list[dict]) -> dict[tuple[int, int], list[float]]:
    """``{(K, ahead steps): [topk tokens/s over the mean ring of the same call]}`` (one GPU,
    grad_accum 1, the rows of one commit and tag are one call)."""
    calls: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["gpus"] == 1 and r["grad_accum"] == 1 and "7b" in r["teacher"]:
            kind = "topk" if r["transport"] == "topk" else "ring"
            calls[(r["commit"], r.get("tag", ""))][kind].append(r)
    out: dict[tuple[int, int], list[float]] = defaultdict(list)
    for call in calls.values():
        if not call["ring"] or not call["topk"]:
            continue
        ring = statistics.mean(r["tokens_per_s"] for r in call["ring"])
        for r in call["topk"]:
            out[(r["top_k"], r.get("ahead_steps") or 1)].append(r["tokens_per_s"] / ring)
    return dict(sorted(out.items()))


def plot(rows: list[dict], path: Path) -> Path:
    """Draw the three panels into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 5.2))
    big = big_teacher(rows)
    a.bar(
        range(len(big)), [m for _, m, _ in big], color="tab:blue",
        hatch=[("//" if late else "") for _, _, late in big], edgecolor="white",
    )  # fmt: skip
    a.set_xticks(range(len(big)), [label for label, _, _ in big])
    for i, (_, m, _) in enumerate(big):
        a.annotate(f"{m:.3f}", (i, m), ha="center", va="bottom")
    a.axhline(MFU_BAR, color="tab:red", ls="--", label=f"bar {MFU_BAR} (four GPUs)")
    a.set_ylabel("end-to-end MFU")
    a.set_title("32B-shaped teacher + 1.7B student, grad_accum 4", fontsize=10)
    a.legend(loc="upper right")

    base, more = scaling(timed(rows))
    gpus = [1] + [g for g, _, _, _ in more]
    b.plot([1, 4], [1, 4], color="0.6", ls=":", label="linear")
    one = ", ".join(f"{v:,.0f} at ga {ga}" for ga, v in base.items())
    b.scatter([1], [1.0], color="black", label=f"one GPU ({one} tok/s)")
    colors = {"coloc": "tab:blue", "dedicated": "tab:green", "coloc-tp2": "tab:orange"}
    runs: dict[tuple[int, str, int], list[float]] = defaultdict(list)
    for g, layout, ga, x in more:
        runs[(g, layout, ga)].append(x)
    for (g, layout, ga), xs in runs.items():
        b.scatter(
            [g] * len(xs), xs, color=colors.get(layout, "tab:purple"),
            marker="o" if ga == 1 else "s", label=f"{layout}, grad_accum {ga}", zorder=3,
        )  # fmt: skip
        text = "-".join(sorted({f"{x:.2f}" for x in xs}))
        b.annotate(f"{text}x", (g, max(xs)), textcoords="offset points", xytext=(-58, -4))
    b.scatter([4], [SCALE_BAR], marker="_", s=400, color="tab:red", label=f"bar {SCALE_BAR}x")
    handles, labels = b.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    b.legend(unique.values(), unique.keys(), loc="upper left", fontsize=8)
    b.set_xticks(sorted(set(gpus)))
    b.set_xlabel("GPUs")
    b.set_ylabel("tokens/s over one GPU")
    b.set_title(
        "7B-shaped teacher + 1.7B student\n(over one GPU at the same grad_accum)", fontsize=10
    )

    ratios = topk_ratios(timed(rows))
    keys = list(ratios)
    for i, key in enumerate(keys):
        c.scatter([i] * len(ratios[key]), ratios[key], color="tab:blue", zorder=3)
        c.annotate(
            f"{statistics.mean(ratios[key]):.3f}", (i, max(ratios[key])),
            textcoords="offset points", xytext=(8, 0),
        )  # fmt: skip
    c.set_xticks(range(len(keys)), [f"K={k}\n{a} step(s) ahead" for k, a in keys])
    c.axhline(TOPK_BAR, color="tab:red", ls="--", label=f"bar {TOPK_BAR}x")
    c.axhline(1.0, color="0.6", ls=":")
    c.set_ylabel("topk tokens/s over the ring's (same commit, host load)")
    c.set_title("top-K targets vs the ring, one GPU", fontsize=10)
    c.legend(loc="lower right")
    fig.suptitle("Teachers at any size and place (NVIDIA H200; tokens between step starts)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=Path, default=RESULTS / "teachers.jsonl")
    p.add_argument("--out", type=Path, default=RESULTS / "teachers.png")
    args = p.parse_args(argv)
    print(plot(read_rows(args.rows), args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
