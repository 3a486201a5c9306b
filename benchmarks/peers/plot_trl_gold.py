"""Plot of the TRL GOLD comparison: xtoken vs TRL GOLD with a byte-level (Llama 3) teacher tokenizer.

Draws ``benchmarks/results/peers_trl_gold.png`` from committed results only (no measurement):
two panels, student tokens/s (log scale) and peak device GiB, grouped by T (2048, 4096), one bar
per system and setting, the x-TRL ratio above xtoken's bars, and the bars as lines: 20x
(T=2048) / 50x (T=4096) TRL's tokens/s and a third of TRL's device memory.

Sources, both read by this script:

* ``benchmarks/results/peers_trl_gold.jsonl``: the rows of the section "Earlier: a
  byte-level teacher tokenizer" of ``peers_trl_gold.md`` (``part == "speed"``, ``teacher_tokenizer ==
  "llama3"``, the commit that section's table names for its rows: TRL GOLD and xtoken with
  activation checkpointing);
* ``benchmarks/results/peers_trl_gold.md``, that section's table: the figures of the first call
  (xtoken without activation checkpointing and its TRL run), which were only printed (the call
  timed out before writing rows). Its TRL row holds both calls (``375 / 379``); the figure that
  is not the JSONL row's is the printed call's.

Usage::

    python benchmarks/peers/plot_trl_gold.py [--out-dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import NamedTuple

RESULTS = Path(__file__).resolve().parents[1] / "results"
SECTION = "## Earlier: a byte-level teacher tokenizer"
PNG = "peers_trl_gold.png"
SHAPES = (2048, 4096)
SPEED_BAR = {2048: 20, 4096: 50}  # the bars: xtoken tok/s over TRL's


class Bar(NamedTuple):
    """One bar of both panels: a system and setting at one T, from one call."""

    T: int
    series: str  # key of SERIES
    tokens_per_s: float
    device_gib: float
    x_trl: float | None  # xtoken tok/s over the same call's TRL tok/s (None for TRL)
    x_trl_memory: float | None
    commit: str
    printed: bool  # from the md table (printed figures), not a JSONL row


# Order of the bars within a T group: the printed call (no activation checkpointing on xtoken's
# side), then the call with rows (activation checkpointing, TRL's default); each call's xtoken
# figures are compared with that call's own TRL run, as in the md.
SERIES = {
    "trl_printed": ("TRL GOLD, ULD byte offsets (call 1)", "0.55", None),
    "gold": ("xtoken gold, no act. ckpt (call 1)", "tab:orange", None),
    "pkl": ("xtoken P-KL, no act. ckpt (call 1)", "tab:blue", None),
    "trl_rows": ("TRL GOLD, ULD byte offsets (call 2)", "0.35", None),
    "gold_ac": ("xtoken gold, act. ckpt (call 2)", "tab:orange", "//"),
    "pkl_ac": ("xtoken P-KL, act. ckpt (call 2)", "tab:blue", "//"),
}
CALLS = (("trl_printed", "gold", "pkl"), ("trl_rows", "gold_ac", "pkl_ac"))


def _number(cell: str) -> float:
    """``'**29.6x**'`` / ``'6,287 (median step 6,857)'`` / ``'27.2'`` -> the first number."""
    m = re.search(r"\d[\d,]*(?:\.\d+)?", cell)
    if m is None:
        raise ValueError(f"no number in table cell {cell!r}")
    return float(m.group(0).replace(",", ""))


def _pair(cell: str) -> tuple[float, float]:
    """``'375 / 379'`` -> (375.0, 379.0): the TRL row holds one figure per call."""
    a, b = cell.split("/")
    return _number(a), _number(b)


def md_table(md_text: str) -> list[dict]:
    """The rows of the table in the md's byte-level-teacher section, as dicts by header."""
    start = md_text.find(SECTION)
    if start < 0:
        raise ValueError(f"section {SECTION!r} not found in peers_trl_gold.md")
    lines = md_text[start:].splitlines()
    table = lines[next(i for i, ln in enumerate(lines) if ln.startswith("|")) :]
    table = table[: next((i for i, ln in enumerate(table) if not ln.startswith("|")), len(table))]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in table[2:]]


def bars(rows: list[dict], md_text: str) -> list[Bar]:
    """Every bar of the plot, from the JSONL rows and the md table.

    Args:
        rows: the rows of ``peers_trl_gold.jsonl`` (all of them; picked here by their fields).
        md_text: the text of ``peers_trl_gold.md``.

    Returns:
        The bars, the printed call's from the md table, the other call's from the JSONL rows.

    Raises:
        ValueError: the md table or the rows do not hold what the section describes.
    """
    table = md_table(md_text)
    runs = {r["run"].split()[0] for r in table if re.match(r"[0-9a-f]{7}\b", r["run"])}
    printed = {r["run"].split()[0] for r in table if "printed" in r["run"]}
    if len(printed) != 1 or len(runs - printed) != 1:
        raise ValueError(f"expected one printed call and one with rows, got runs {sorted(runs)}")
    (printed_commit,) = printed
    (rows_commit,) = runs - printed

    picked = [
        r
        for r in rows
        if r.get("part") == "speed"
        and r.get("teacher_tokenizer") == "llama3"
        and r.get("commit") == rows_commit
        and r.get("error") is None
    ]
    out: list[Bar] = []
    trl_rows: dict[int, dict] = {}
    for r in picked:
        if r["system"] == "TRL GOLD":
            trl_rows[r["T"]] = r
            out.append(
                Bar(
                    r["T"],
                    "trl_rows",
                    r["tokens_per_s"],
                    r["device_peak_gib"],
                    None,
                    None,
                    rows_commit,
                    False,
                )
            )
        else:
            series = {"gold": "gold_ac", "pkl": "pkl_ac"}[r["mode"]]
            assert r.get("activation_checkpointing"), r
            out.append(
                Bar(
                    r["T"],
                    series,
                    r["tokens_per_s"],
                    r["device_peak_gib"],
                    r["speedup"],
                    r["mem_ratio"],
                    rows_commit,
                    False,
                )
            )
    if set(trl_rows) != set(SHAPES):
        raise ValueError(f"TRL rows at {rows_commit} for T={sorted(trl_rows)}, want {SHAPES}")

    for t in table:
        T = int(t["T"])
        if t["system"].startswith("TRL") and t["run"] == "both calls":
            # the call with rows is the figure closest to its JSONL row; the other was printed
            row = trl_rows[T]
            tok = _pair(t["tok/s"])
            gib = _pair(t["device GiB"])
            tok_p = max(tok, key=lambda v: abs(v - row["tokens_per_s"]))
            gib_p = max(gib, key=lambda v: abs(v - row["device_peak_gib"]))
            out.append(Bar(T, "trl_printed", tok_p, gib_p, None, None, printed_commit, True))
        elif t["run"].split()[0] == printed_commit:
            series = {"xtoken gold": "gold", "xtoken P-KL": "pkl"}[t["system"]]
            out.append(
                Bar(
                    T,
                    series,
                    _number(t["tok/s"]),
                    _number(t["device GiB"]),
                    _number(t["x TRL"]),
                    _number(t["x TRL memory"]),
                    printed_commit,
                    True,
                )
            )
    return out


def plot(all_bars: list[Bar], path: Path) -> Path:
    """Write the two-panel PNG of ``all_bars`` to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    by = {(b.T, b.series): b for b in all_bars}
    commits = {b.series: b.commit for b in all_bars}
    width, gap = 0.12, 0.06
    slots = []  # (series, offset from the group centre)
    x = 0.0
    for i, call in enumerate(CALLS):
        for s in call:
            slots.append((s, x))
            x += width
        if i < len(CALLS) - 1:
            x += gap
    centre = (x - width) / 2
    slots = [(s, o - centre) for s, o in slots]

    fig, (ax_tok, ax_mem) = plt.subplots(2, 1, figsize=(10, 8.6), dpi=120, sharex=True)
    for gi, T in enumerate(SHAPES):
        for s, off in slots:
            _, color, hatch = SERIES[s]
            b = by.get((T, s))
            xpos = gi + off
            if b is None:
                for ax in (ax_tok, ax_mem):
                    ax.text(
                        xpos,
                        0.02,
                        "not run",
                        transform=ax.get_xaxis_transform(),
                        rotation=90,
                        ha="center",
                        va="bottom",
                        fontsize=7,
                        color="0.4",
                    )
                continue
            style = dict(
                width=width * 0.92,
                color=color,
                hatch=hatch,
                edgecolor="black",
                linewidth=0.6,
                linestyle="--" if b.printed else "-",
            )
            ax_tok.bar(xpos, b.tokens_per_s, **style)
            ax_mem.bar(xpos, b.device_gib, **style)
            if b.x_trl is None:
                tok_note, mem_note = f"{b.tokens_per_s:,.0f}", f"{b.device_gib:.1f}"
            else:
                tok_note, mem_note = f"{b.x_trl:.1f}x", f"{b.x_trl_memory:.2f}x"
            for ax, y, note in (
                (ax_tok, b.tokens_per_s, tok_note),
                (ax_mem, b.device_gib, mem_note),
            ):
                ax.annotate(
                    note,
                    (xpos, y),
                    xytext=(0, 2),
                    textcoords="offset points",
                    ha="center",
                    va="bottom",
                    fontsize=7.5,
                    zorder=5,
                    fontweight="normal" if b.x_trl is None else "bold",
                    bbox=dict(facecolor="white", edgecolor="none", pad=0.6, alpha=0.85),
                )
        # the bars, over each call's own bars: SPEED_BAR x that call's TRL tok/s and a third
        # of its TRL device peak
        for call in CALLS:
            trl = by.get((T, call[0]))
            if trl is None:
                continue
            xs = [gi + o for s, o in slots if s in call]
            lo, hi = xs[0] - width / 2, xs[-1] + width / 2
            ax_tok.hlines(
                SPEED_BAR[T] * trl.tokens_per_s,
                lo,
                hi,
                colors="tab:green",
                linestyles=":",
                linewidth=1.6,
            )
            ax_mem.hlines(
                trl.device_gib / 3, lo, hi, colors="tab:red", linestyles="--", linewidth=1.4
            )

    ax_tok.set_yscale("log")
    ax_tok.set_ylim(100, 40_000)
    ax_tok.set_ylabel("student tokens/s (log scale)")
    ax_tok.set_title(
        "Student tokens/s  (labels: TRL's tok/s; xtoken's = x TRL's tok/s, same call)", fontsize=10
    )
    ax_mem.set_ylabel("peak device memory (GiB)")
    ax_mem.set_ylim(0, 72)
    ax_mem.set_title(
        "Peak device memory over the baseline, all processes  "
        "(labels: TRL's GiB; xtoken's = x TRL's GiB, same call)",
        fontsize=10,
    )
    ax_mem.set_xticks(range(len(SHAPES)))
    ax_mem.set_xticklabels([f"T = {T}  (1 x {T} per step)" for T in SHAPES])
    for ax in (ax_tok, ax_mem):
        ax.grid(axis="y", alpha=0.3, which="both")
        ax.set_axisbelow(True)

    handles = []  # the legend fills column by column: call 1, then call 2
    for call, line in zip(
        CALLS,
        (
            Line2D(
                [],
                [],
                color="tab:red",
                linestyle="--",
                label="bar: 1/3 of the same call's TRL device memory",
            ),
            Line2D(
                [],
                [],
                color="tab:green",
                linestyle=":",
                linewidth=1.6,
                label="bar: 20x (T=2048) / 50x (T=4096) the same call's TRL tok/s",
            ),
        ),
    ):
        for s in call:
            label, color, hatch = SERIES[s]
            printed = any(b.printed for b in all_bars if b.series == s)
            note = f"{commits.get(s, '?')}, {'printed (md table)' if printed else 'JSONL rows'}"
            handles.append(
                Patch(
                    facecolor=color,
                    hatch=hatch,
                    edgecolor="black",
                    linewidth=0.6,
                    linestyle="--" if printed else "-",
                    label=f"{label}: {note}",
                )
            )
        handles.append(line)
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(
        "xtoken vs TRL GOLD, Qwen3-0.6B student, 1.5B teacher with the "
        "Llama 3 tokenizer, one H100",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.12, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> Path:
    """Read the committed results, write the PNG, return its path."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS / "peers_trl_gold.jsonl")
    p.add_argument("--md", type=Path, default=RESULTS / "peers_trl_gold.md")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    rows = [json.loads(ln) for ln in args.results.read_text().splitlines() if ln.strip()]
    path = plot(bars(rows, args.md.read_text()), args.out_dir / PNG)
    print(path)
    return path


if __name__ == "__main__":
    main()
