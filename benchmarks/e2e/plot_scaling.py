"""Plot of the scaling run: 1 vs 2 trainer ranks on two GPUs at the same global batch.

Draws ``benchmarks/results/scaling_2gpu.png`` from the committed rows of
``benchmarks/results/e2e_pipeline.jsonl`` (no measurement): the rows tagged ``two-gpu-curves``
(``data.ordered``: both set-ups train the same samples in every step) and, where the same commit
has it, the ``two-gpu`` row of one rank fed by a teacher on the other GPU. Three panels,

* the per-step loss, 1 rank x 2 micro-batches vs 2 ranks x 1 micro-batch (the rows'
  ``pipeline.losses``), with the largest relative difference;
* tokens/s of all ranks: 1 rank, 2 ranks, 1 rank with its teacher on the other GPU, against
  twice the 1-rank figure (linear scaling);
* the step time of one rank split into data wait, teacher wait, forward, loss, backward and
  optimizer (``pipeline.split_s``), stacked.

and, from the rows of the collector A/B (tags ``two-gpu-gc50`` / ``two-gpu-gc0``), a second PNG
(``scaling_2gpu_gc.png``): each rank's per-step time with the trainer's scheduled collector and
with Python's automatic one, the steps with a full collection marked.

Where the tag has rows from more than one commit, the newest commit's are drawn.

Usage::

    python benchmarks/e2e/plot_scaling.py [--out-dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
TAG = "two-gpu-curves"
TEACHER_TAG = "two-gpu"  # the rows of the teacher on the other GPU
PNG = "scaling_2gpu.png"
MODES = {"pkl": "P-KL", "gold": "gold", "xtoken": "relaxed gold"}
# the step split, bottom to top, as the trainer reports it (pipeline.split_s)
PHASES = (
    ("data_wait", "data wait", "tab:gray"),
    ("sync", "rank sync", "tab:brown"),
    ("teacher_wait", "teacher wait", "tab:purple"),
    ("forward", "forward", "tab:blue"),
    ("loss", "loss", "tab:orange"),
    ("backward", "backward", "tab:green"),
    ("optimizer", "optimizer", "tab:red"),
)


def _save(fig, path: Path, top: float) -> Path:
    """Lay out ``fig`` under its title (the top ``1 - top`` of the figure), write it, close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout(rect=(0, 0, 1, top))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


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


def own_gpu_teacher(rows: list[dict], like: dict) -> dict | None:
    """The newest row of one rank fed over CUDA IPC by a teacher on another GPU, of ``like``'s
    commit, shape and mode (None if there is none)."""
    found = [
        r
        for r in rows
        if r.get("tag") == TEACHER_TAG
        and r.get("trainers") == 1
        and r.get("teacher_device", "same GPU") != "same GPU"
        and r.get("transport") == "cuda_ipc"
        and "pipeline" in r
        and all(r.get(k) == like.get(k) for k in ("commit", "shape", "mode"))
    ]
    return max(found, key=lambda r: r.get("time", "")) if found else None


def _label(r: dict) -> str:
    n, accum = r["trainers"], r.get("grad_accum", 1)
    return (
        f"{n} rank{'s' if n > 1 else ''} x {accum} micro-batch{'es' if accum > 1 else ''}"
        f" of {r['shape']}"
    )


def plot(by_ranks: dict[int, dict], path: Path, own_gpu: dict | None = None) -> Path:
    """Write the three-panel PNG of the 1- and 2-rank rows (and the row of the teacher on its
    own GPU, when given) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    one = by_ranks[1]
    micro, T = (int(v) for v in one["shape"].split("x"))
    global_batch = micro * one["trainers"] * one.get("grad_accum", 1)
    colors = {1: "tab:blue", 2: "tab:orange"}
    fig, (ax_loss, ax_tok, ax_split) = plt.subplots(
        1, 3, figsize=(17, 5.2), dpi=120, gridspec_kw={"width_ratios": [1.5, 1, 0.9]}
    )

    for n, r in by_ranks.items():
        losses = r["pipeline"]["losses"]
        ax_loss.plot(
            range(len(losses)), losses, marker="o", markersize=3, color=colors[n], label=_label(r)
        )
    pairs = list(zip(by_ranks[1]["pipeline"]["losses"], by_ranks[2]["pipeline"]["losses"]))
    worst = max(abs(a - b) / abs(a) for a, b in pairs)
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("loss of the step (rank 0's record)")
    ax_loss.set_title(
        f"Per-step loss, same samples per step: largest difference {100 * worst:.2f}%",
        fontsize=10,
    )
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(fontsize=8)

    ranks = [1, 2]
    cols = {n: by_ranks[n] for n in ranks}
    names = {1: "1 rank", 2: "2 ranks"}
    if own_gpu is not None:  # 1 rank, its teacher on the other GPU
        cols[3], colors[3], names[3] = own_gpu, "tab:green", "1 rank,\nteacher on GPU 1"
    ranks = list(cols)
    tok = [cols[n]["pipeline"]["tokens_per_s"] for n in ranks]
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
    if one.get("bare"):
        ax_tok.axhline(
            one["bare"]["tokens_per_s"],
            color="tab:gray",
            linestyle="--",
            label="bare compute, 1 process, 1 GPU",
        )
    ax_tok.set_xticks(ranks)
    ax_tok.set_xticklabels([names[n] for n in ranks], fontsize=8)
    ax_tok.set_ylabel("student tokens/s (all ranks)")
    ax_tok.set_ylim(0, 2 * tok[0] * 1.2)
    ax_tok.set_title("Throughput", fontsize=10)
    ax_tok.grid(axis="y", alpha=0.3)
    ax_tok.set_axisbelow(True)
    ax_tok.legend(fontsize=8, loc="upper left")

    for n in ranks:
        split = cols[n]["pipeline"]["split_s"]
        bottom = 0.0
        for key, label, color in PHASES:
            ms = 1000 * split.get(key, 0.0)
            both_ms = " / ".join(
                f"{1000 * cols[m]['pipeline']['split_s'].get(key, 0.0):.1f}" for m in ranks
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
        step_ms = 1000 * cols[n]["pipeline"]["step_s"]
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
        [f"{names[n]}\n(x{cols[n].get('grad_accum', 1)} accum.)" for n in ranks], fontsize=7
    )
    ax_split.set_xlim(0.4, len(ranks) + 0.6)
    ax_split.set_ylabel("time per optimizer step, one rank (ms)")
    ax_split.set_title("Step-time split per rank", fontsize=10)
    handles, labels = ax_split.get_legend_handles_labels()
    ax_split.legend(
        handles[::-1],
        labels[::-1],
        fontsize=8,
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),  # beside the bars
        title=" / ".join(names[n].replace("\n", " ") for n in ranks),
        title_fontsize=7,
    )
    ax_split.grid(axis="y", alpha=0.3)
    ax_split.set_axisbelow(True)

    fig.suptitle(
        f"1 vs 2 trainer ranks on 2 x {one['device']}, {MODES.get(one['mode'], one['mode'])} loss,"
        f" global batch {global_batch} x {T} tokens per step (commit {one['commit']})\n"
        "blue, orange: a teacher colocated with each rank"
        + ("; green: 1 rank, its teacher on the other GPU" if own_gpu is not None else ""),
        fontsize=10,
    )
    return _save(fig, path, top=0.95)


GC_TAGS = {"two-gpu-gc50": "gc_every 50", "two-gpu-gc0": "Python's collector"}
GC_PNG = "scaling_2gpu_gc.png"


def gc_rows(rows: list[dict]) -> list[dict]:
    """The rows of the collector A/B (``GC_TAGS``) of the newest commit that has them, each with
    its per-step series (``stalls_by_rank[rank]["step_ms"]``); [] where there are none."""

    def drawable(r: dict) -> bool:
        ranks = r["pipeline"].get("stalls_by_rank") or {}
        return bool(ranks) and all("step_ms" in v for v in ranks.values())

    tagged = [r for r in rows if r.get("tag") in GC_TAGS and drawable(r)]
    if not tagged:
        return []
    newest = max(tagged, key=lambda r: r.get("time", ""))["commit"]
    return [r for r in tagged if r["commit"] == newest]


def plot_gc(rows: list[dict], path: Path) -> Path:
    """Write the per-step time of every rank, one panel per mode: 1 rank and 2 ranks with the
    trainer's scheduled collector (``gc_every`` 50) against 2 ranks with Python's automatic one;
    a step in which a rank spent > 100 ms in a collection is marked and labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r["mode"] for r in rows}, key=lambda m: list(MODES).index(m))
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.4), dpi=120, squeeze=False)
    style = {  # (tag, ranks) -> colour per rank, line style
        ("two-gpu-gc50", 1): (("tab:gray",), "-"),
        ("two-gpu-gc50", 2): (("tab:blue", "tab:cyan"), "-"),
        ("two-gpu-gc0", 2): (("tab:red", "tab:orange"), "--"),
    }
    for ax, mode in zip(axes[0], modes):
        for r in (x for x in rows if x["mode"] == mode):
            colors, ls = style.get((r["tag"], r["trainers"]), (("black", "black"), ":"))
            for rank, st in sorted(r["pipeline"]["stalls_by_rank"].items()):
                c = colors[int(rank) % len(colors)]
                label = (
                    f"{r['trainers']} rank{'s' if r['trainers'] > 1 else ''}, "
                    f"{GC_TAGS[r['tag']]}: rank {rank} ({r['pipeline']['tokens_per_s']:,.0f} tok/s)"
                )
                ax.plot(st["steps"], st["step_ms"], ls, color=c, marker=".", label=label)
                for step, ms, gc in zip(st["steps"], st["step_ms"], st["gc_ms"]):
                    if gc > 100:
                        ax.plot([step], [ms], "X", color=c, markersize=10)
                        ax.annotate(
                            f"rank {rank}: full collection {gc:.0f} ms",
                            (step, ms),
                            textcoords="offset points",
                            xytext=(6, -4),
                            fontsize=7,
                        )
        ax.set_title(f"{MODES.get(mode, mode)}, {rows[0]['shape']}")
        ax.set_xlabel("step (after the warm-up)")
        ax.set_ylabel("step time, ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="center right")
    fig.suptitle(
        f"Per-step time of each trainer rank on 2 x {rows[0]['device']} (commit "
        f"{rows[0]['commit']}): a full collection of Python's collector stalls one rank, the "
        "other waits for it",
        fontsize=9,
    )
    return _save(fig, path, top=0.94)


def main(argv: list[str] | None = None) -> Path:
    """Read the committed rows, write the PNG, return its path."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS / "e2e_pipeline.jsonl")
    p.add_argument("--tag", default=TAG)
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    rows = [json.loads(ln) for ln in args.results.read_text().splitlines() if ln.strip()]
    by_ranks = pick(rows, args.tag)
    path = plot(by_ranks, args.out_dir / PNG, own_gpu_teacher(rows, by_ranks[1]))
    print(path)
    gc = gc_rows(rows)
    if gc:
        print(plot_gc(gc, args.out_dir / GC_PNG))
    return path


if __name__ == "__main__":
    main()
