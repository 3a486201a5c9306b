"""Plot of the scaling run: 1 vs 2 trainer ranks on two GPUs at the same global batch.

Draws ``benchmarks/results/scaling_2gpu.png`` from the committed rows of
``benchmarks/results/e2e_pipeline.jsonl`` tagged ``exp3-same-global-batch`` (the run that
``scaling_2gpu.md`` describes; no measurement): three panels,

* the per-step loss of rank 0's records, 1 rank x 2 micro-batches vs 2 ranks x 1 micro-batch
  (the rows' ``pipeline.losses``);
* tokens/s of all ranks, 1 vs 2 ranks, with twice the 1-rank figure (linear scaling) and the bare
  compute of the same step in one process on one GPU (``bare.tokens_per_s``);
* the step time of one rank split into data wait, teacher wait, forward, loss, backward and
  optimizer (``pipeline.split_s``), stacked.

Where the tag has rows from more than one commit, the newest commit's are drawn.

Usage::

    python benchmarks/e2e/plot_scaling.py [--out-dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
TAG = "exp3-same-global-batch"
PNG = "scaling_2gpu.png"
MODES = {"pkl": "P-KL", "gold": "gold", "xtoken": "relaxed gold"}
# the step split, bottom to top, as the trainer reports it (pipeline.split_s)
PHASES = (
    ("data_wait", "data wait", "tab:gray"),
    ("teacher_wait", "teacher wait", "tab:purple"),
    ("forward", "forward", "tab:blue"),
    ("loss", "loss", "tab:orange"),
    ("backward", "backward", "tab:green"),
    ("optimizer", "optimizer", "tab:red"),
)


def pick(rows: list[dict], tag: str = TAG) -> dict[int, dict]:
    """The rows of ``tag`` by trainer ranks (1, 2), from the newest commit that has both.

    Raises:
        ValueError: no commit has a row of ``tag`` for both 1 and 2 ranks.
    """
    tagged = [r for r in rows if r.get("tag") == tag]
    for r in sorted(tagged, key=lambda r: r.get("time", ""), reverse=True):
        by_ranks = {x["trainers"]: x for x in tagged if x["commit"] == r["commit"]}
        if {1, 2} <= set(by_ranks):
            return {n: by_ranks[n] for n in (1, 2)}
    raise ValueError(f"no commit with rows tagged {tag!r} for 1 and 2 trainer ranks")


def _label(r: dict) -> str:
    n, accum = r["trainers"], r.get("grad_accum", 1)
    return (
        f"{n} rank{'s' if n > 1 else ''} x {accum} micro-batch{'es' if accum > 1 else ''}"
        f" of {r['shape']}"
    )


def plot(by_ranks: dict[int, dict], path: Path) -> Path:
    """Write the three-panel PNG of the 1- and 2-rank rows to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    one = by_ranks[1]
    micro, T = (int(v) for v in one["shape"].split("x"))
    global_batch = micro * one["trainers"] * one.get("grad_accum", 1)
    colors = {1: "tab:blue", 2: "tab:orange"}
    fig, (ax_loss, ax_tok, ax_split) = plt.subplots(
        1, 3, figsize=(14, 4.8), dpi=120, gridspec_kw={"width_ratios": [1.5, 1, 1]}
    )

    for n, r in by_ranks.items():
        losses = r["pipeline"]["losses"]
        ax_loss.plot(range(len(losses)), losses, marker="o", color=colors[n], label=_label(r))
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("loss of the step (rank 0's record)")
    ax_loss.set_title("Per-step loss, same global batch and seeds", fontsize=10)
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(fontsize=8)

    ranks = [1, 2]
    tok = [by_ranks[n]["pipeline"]["tokens_per_s"] for n in ranks]
    ax_tok.bar(ranks, tok, width=0.6, color=[colors[n] for n in ranks], edgecolor="black")
    for n, v in zip(ranks, tok):
        ax_tok.annotate(
            f"{v:,.0f}\n{v / tok[0]:.3f}x",
            (n, v),
            xytext=(0, -6),  # inside the bar: the reference lines run at its top
            textcoords="offset points",
            ha="center",
            va="top",
            fontsize=9,
            color="white",
            fontweight="bold",
        )
    ax_tok.axhline(2 * tok[0], color="black", linestyle=":", label="2x the 1-rank figure")
    ax_tok.axhline(
        one["bare"]["tokens_per_s"],
        color="tab:gray",
        linestyle="--",
        label="bare compute, 1 process, 1 GPU",
    )
    ax_tok.set_xticks(ranks)
    ax_tok.set_xticklabels([f"{n} rank{'s' if n > 1 else ''}" for n in ranks])
    ax_tok.set_ylabel("student tokens/s (all ranks)")
    ax_tok.set_ylim(0, 2 * tok[0] * 1.2)
    ax_tok.set_title("Throughput", fontsize=10)
    ax_tok.grid(axis="y", alpha=0.3)
    ax_tok.set_axisbelow(True)
    ax_tok.legend(fontsize=8, loc="upper left")

    for n in ranks:
        split = by_ranks[n]["pipeline"]["split_s"]
        bottom = 0.0
        for key, label, color in PHASES:
            ms = 1000 * split[key]
            both_ms = " / ".join(
                f"{1000 * by_ranks[m]['pipeline']['split_s'][key]:.1f}" for m in ranks
            )
            ax_split.bar(
                n,
                ms,
                bottom=bottom,
                width=0.6,
                color=color,
                edgecolor="black",
                linewidth=0.5,
                label=f"{label} ({both_ms} ms)" if n == ranks[0] else None,
            )
            if ms > 15:  # only segments tall enough to hold their figure
                ax_split.text(n, bottom + ms / 2, f"{ms:.0f}", ha="center", va="center", fontsize=8)
            bottom += ms
        step_ms = 1000 * by_ranks[n]["pipeline"]["step_s"]
        ax_split.annotate(
            f"step {step_ms:.0f} ms",
            (n, bottom),
            xytext=(0, 2),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax_split.set_xticks(ranks)
    ax_split.set_xticklabels(
        [
            f"{n} rank{'s' if n > 1 else ''}\n(x{by_ranks[n].get('grad_accum', 1)} accum.)"
            for n in ranks
        ]
    )
    ax_split.set_xlim(0.4, 4.0)  # room for the legend on the right
    ax_split.set_ylabel("time per optimizer step, one rank (ms)")
    ax_split.set_title("Step-time split per rank", fontsize=10)
    handles, labels = ax_split.get_legend_handles_labels()
    ax_split.legend(
        handles[::-1],
        labels[::-1],
        fontsize=8,
        loc="upper right",
        title="1 / 2 ranks",
        title_fontsize=8,
    )
    ax_split.grid(axis="y", alpha=0.3)
    ax_split.set_axisbelow(True)

    fig.suptitle(
        f"1 vs 2 trainer ranks on 2 x {one['device']}, {MODES.get(one['mode'], one['mode'])} loss,"
        f" global batch {global_batch} x {T} tokens per step, teacher colocated with each rank"
        f" (commit {one['commit']})",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> Path:
    """Read the committed rows, write the PNG, return its path."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS / "e2e_pipeline.jsonl")
    p.add_argument("--tag", default=TAG)
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    rows = [json.loads(ln) for ln in args.results.read_text().splitlines() if ln.strip()]
    path = plot(pick(rows, args.tag), args.out_dir / PNG)
    print(path)
    return path


if __name__ == "__main__":
    main()
