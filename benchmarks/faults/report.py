"""The random-fault campaign's report (``benchmarks/results/fault_campaign.md``) from its rows."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

FULL_RUNS = 30  # the campaign's size; fewer runs are a trial of the harness

HOW = """\
Each run is a real `xtoken run` of `examples/tiny.yaml` on 64 demo texts (two gloo trainer
ranks, one shm teacher, tiny models, 8 steps, a checkpoint every 2, the run's own in-memory
queue), `examples/on_policy.yaml` on 32 texts (16 steps) when the victim is `rollout0`, or the
tiny run submitted to `xtoken control serve` when the victim is `control`. The run's seed draws
the victim and the moment: after rank 0 logged `step k` (0: as soon as the victim runs), or for
the collator after the queue holds `k samples`, plus a delay below a second. The victim, found
by its heartbeat file (`RUN_DIR/heartbeat/<name>`, the pid checked against the environment its
supervisor gave it), gets a real SIGKILL; the control plane is then started again on its runs
root. A run is **ok** when the kill landed on a live process, the run exited 0 (control plane:
SUCCEEDED), no traceback reached the user (`xtoken run`'s output, the control plane's log), no
process was left, and the final student's history (the keys logs of every launch, less the steps
a restart rolled back: `benchmarks/faults/lineage.py`) holds every corpus text exactly once:
0 missing, 0 twice (on-policy samples: at most once)."""


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return str(value).replace("|", "\\|")


def _table(headers: list[str], rows: Iterable[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return out


def summary(rows: list[dict[str, Any]]) -> str:
    """The campaign's figures in one sentence."""
    landed = sum(bool(r.get("landed")) for r in rows)
    ok = sum(r["outcome"] == "ok" for r in rows)
    lost = [r for r in rows if r.get("missing")]
    twice = [r for r in rows if r.get("twice")]
    text = (
        f"**{len(rows)} runs, {landed} kills landed: {ok} ok; "
        f"texts lost in {len(lost)} runs ({sum(r['missing'] for r in lost)} never trained), "
        f"trained twice in {len(twice)} runs ({sum(r['twice'] for r in twice)} texts).**"
    )
    if len(rows) < FULL_RUNS:
        text += f" A trial: the campaign is {FULL_RUNS} runs or more (`--runs {FULL_RUNS}`)."
    bad = [r for r in rows if r["outcome"] != "ok"]
    if bad:
        per = {
            v: sorted({_why(r) for r in bad if r["victim"] == v})
            for v in sorted({r["victim"] for r in bad})
        }
        text += " Not ok: " + ", ".join(f"{v} ({'; '.join(why)})" for v, why in per.items()) + "."
    return text


def _why(row: dict[str, Any]) -> str:
    at = row.get("checkpoint")
    where = "before the first checkpoint" if at is None else f"after the checkpoint of step {at}"
    return f"{row['moment']}, {where}: {row['outcome']}"


def write_report(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write the report: the figures and the command, what a run checks, per victim, per run.

    Args:
        path: the markdown file.
        rows: the campaign's rows (one per run; the first one's ``commit``, ``tree``,
            ``machine``, ``date``, ``jobs`` and ``command`` describe the campaign).
    """
    info = rows[0]
    tree = "" if info.get("tree", "clean") == "clean" else f" ({info['tree']})"
    victims = sorted({r["victim"] for r in rows})
    lines = [
        "# Random-fault campaign",
        "",
        summary(rows),
        "",
        f"Commit `{info['commit']}`{tree}, {info['machine']}, {info['date']}, {info['jobs']} "
        "run(s) at a time:",
        "",
        "```bash",
        info.get("command", "python benchmarks/faults/campaign.py"),
        "```",
        "",
        HOW,
        "",
        "## Per victim",
        "",
    ]
    per = []
    for v in victims:
        mine = [r for r in rows if r["victim"] == v]
        per.append([
            v,
            len(mine),
            sum(bool(r.get("landed")) for r in mine),
            sum(r["outcome"] == "ok" for r in mine),
            sum(bool(r.get("missing")) for r in mine),
            sum(bool(r.get("twice")) for r in mine),
            sum(str(r.get("exit")) not in ("0", "SUCCEEDED") for r in mine),
            round(sum(r["wall_s"] for r in mine) / len(mine)),
        ])  # fmt: skip
    lines += _table(["victim", "runs", "kill landed", "ok", "lost samples", "trained twice",
                     "run failed", "mean wall s"], per)  # fmt: skip
    lines += ["", "## Runs", "",
              "`at kill`: the steps rank 0 had logged and the latest checkpoint's step when the "
              "signal was sent; `rolled back`: steps trained, then dropped by a restart from an "
              "earlier checkpoint. Replay a run with `--seeds SEED`.", ""]  # fmt: skip
    lines += _table(
        ["run", "seed", "victim", "moment", "at kill", "outcome", "missing", "twice",
         "rolled back", "wall s"],
        [[r["run"], r["seed"], r["victim"], r["moment"],
          f"step {r['at_step']}, ckpt {_cell(r.get('checkpoint'))}" if "at_step" in r else "-",
          r["outcome"], r.get("missing"), r.get("twice"), r.get("rolled_back"), r["wall_s"]]
         for r in rows],
    )  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
