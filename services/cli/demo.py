"""`xtoken demo`: the embedded default: SmolLM2-135M teaches a tiny Qwen3-tokenizer student on CPU.

A real distillation run through queue, collator, teacher and trainer processes (``xtoken run`` with
the config below): the demo corpus (Python's own sources and docs), the relaxed gold loss
(``mode: xtoken``: the KL over the tokens the two vocabularies share, over an exact byte
alignment), the teacher's logits over a /dev/shm ring. Beside it, the same run with the student's
CE alone (``mode: ce``, no teacher; ``xtoken run`` in the background): the ordered data mode
(``data.ordered``, ``data.seed``) gives both the same micro-batches in the same steps from the same
initial student. It ends with the held-out bits/byte of the teacher, of the student before, after
KD and after CE alone, and the difference KD minus CE.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

DEMO_CONFIG = {
    "run_dir": "runs/demo",
    "student_tokenizer": "qwen3",
    "teacher_tokenizer": "smollm2",
    "ctx_student": 128,
    "ctx_teacher": 128,
    # ordered: the KD run and the CE-only run train the same micro-batches in the same steps
    "data": {"limit": 240, "seed": 0, "ordered": True},
    "collator": {"workers": 1, "batch": 16},
    "teacher": {
        "model": "smollm2",
        "dtype": "bfloat16",  # the CPU's bf16 matmuls: a teacher forward in about 2/3 the time
        "transport": "shm",
        "max_batch": 4,
        "max_length": 128,
        "slots": 2,
    },
    "trainer": {
        "student": {"model": "tiny"},
        "compute": {"param_dtype": "bfloat16"},  # bf16 compute, fp32 master weights
        # 36 steps of 2 x 128 tokens: the tokens xtoken's CPU loss (the reference) fits in the
        # demo's two minutes, in more, smaller steps
        "feed": {"micro_batch": 2, "grad_accum": 1},
        "schedule": {
            "max_steps": 36,
            "checkpoint_every": 0,  # the demo starts fresh every time: no checkpoint to resume
            "eval_every": 0,
        },
        "eval": {"texts": 6, "ctx": 256},
        # lr: the CE-only run's sweep (benchmarks/results/demo.md)
        "optim": {"lr": 1e-2, "warmup_steps": 4, "weight_decay": 0.0},
        # xtoken: the KL over the tokens both vocabularies share (P-KL's projection lets a teacher
        # token's mass be matched by student tokens whose spelling merely holds it: a smaller gain
        # over CE alone here). uncommon_topk: the CPU runs the gold reference, whose sorted L1
        # over 64 probabilities costs less than over 8,192; vocab_topk: for --mode pkl
        "loss": {"mode": "xtoken", "uncommon_topk": 64, "vocab_topk": 4096},
    },
}

#: the CE-only run's directory, inside the demo's run directory
BASELINE_DIR = "ce-only"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the demo run."""
    from services.common.flags import add_set_flag

    parser.add_argument("--run-dir", default=None, help="run directory (default runs/demo)")
    parser.add_argument(
        "--steps",
        type=_step_count,
        default=None,
        help="optimizer steps (default 36; 0: until the demo's data ends, as "
        "trainer.schedule.max_steps)",
    )
    parser.add_argument("--mode", default=None, help="loss mode: pkl, gold, xtoken, ce")
    add_set_flag(
        parser,
        "override one setting of the demo's run config (repeatable; as xtoken run --set), "
        "e.g. --set trainer.optim.lr=1e-3",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (or progress lines)"
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the CE-only run (the student trained on the same data without the teacher)",
    )


def _step_count(text: str) -> int:
    """``--steps``: a count of optimizer steps, 0 or more."""
    try:
        steps = int(text)
    except ValueError:
        steps = -1
    if steps < 0:
        raise argparse.ArgumentTypeError(
            f"{text} is not a step count; give 0 or more (0: until the data ends)"
        )
    return steps


def demo_data(args: argparse.Namespace | None = None) -> dict:
    """The demo's run config as a dict (with the options and ``--set`` overrides applied)."""
    import copy

    from services.common.overrides import apply_overrides

    data = copy.deepcopy(DEMO_CONFIG)
    if args is not None:
        if args.run_dir:
            data["run_dir"] = args.run_dir
        if args.steps is not None:
            data["trainer"]["schedule"]["max_steps"] = args.steps
        if args.mode:
            data["trainer"]["loss"]["mode"] = args.mode
        data = apply_overrides(data, getattr(args, "overrides", ()))
    return data


def demo_config(args: argparse.Namespace | None = None):
    """The demo's RunConfig (with the options applied)."""
    from services.supervise.config import run_config_from_dict

    return run_config_from_dict(demo_data(args))


def baseline_data(args: argparse.Namespace | None = None) -> dict:
    """The CE-only run of the demo: the same run config with the student's CE alone (no
    teacher), in :data:`BASELINE_DIR` of the demo's run directory, not exported.

    Args:
        args: the demo's options.

    Returns:
        The run config as a dict, validated.

    Raises:
        ConfigError: the config does not make a CE-only run (names ``--no-baseline``).
    """
    from services.common.config import ConfigError
    from services.supervise.config import run_config_from_dict

    data = demo_data(args)
    data["run_dir"] = str(Path(data["run_dir"]) / BASELINE_DIR)
    loss = data["trainer"].setdefault("loss", {})
    loss["mode"] = "ce"
    loss.pop("projection", None)
    data["trainer"].setdefault("schedule", {})["export"] = False
    try:
        run_config_from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"the CE-only run: {e}; or pass --no-baseline") from e
    return data


#: glibc malloc settings of the demo's processes (inherited): large blocks from the heap, which
#: is never trimmed, so that a freed [B, T, V] tensor's pages are reused by the next one
CPU_MALLOC = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"

# written into every run directory the demo makes: only such a directory is the demo's to clear
MARKER = ".xtoken-demo"


def fresh_run_dir(path: str | os.PathLike) -> Path:
    """Empty the demo's run directory for a fresh start, never deleting what the demo did not make.

    A missing or empty directory is made the demo's (the marker is written into it); a directory
    holding the marker is the demo's own, and its contents are cleared; any other non-empty
    directory, or a path that is a file, is refused.

    Args:
        path: the run directory.

    Returns:
        The directory, empty but for the marker.

    Raises:
        ValueError: the path holds files the demo did not make (names the fix).
    """
    run_dir = Path(path)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--run-dir {str(path)!r} is a file; name a new or empty directory")
    if run_dir.is_dir() and any(run_dir.iterdir()):
        if not (run_dir / MARKER).is_file():
            raise ValueError(
                f"--run-dir {str(path)!r} is not empty and was not made by the demo, which clears "
                "its run directory at every start; name a new or empty directory"
            )
        for entry in run_dir.iterdir():
            if entry.name == MARKER:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / MARKER).write_text("made by `xtoken demo`: cleared at its next start\n")
    return run_dir


def format_table(kd: dict, ce: dict | None, config) -> str:
    """The demo's held-out table: teacher, student before, after KD and after CE alone, and KD
    minus CE alone.

    Args:
        kd: :func:`services.cli.run.report` of the KD run.
        ce: the same of the CE-only run, or None.
        config: the demo's RunConfig.

    Returns:
        The table.
    """
    trainer = config.trainer
    mode = trainer.loss.mode
    tokens = f"{trainer.feed.step_samples} x {config.ctx_student} tokens"
    # (name, bits/byte, format): the difference carries its sign, below 0 when KD is ahead
    rows = [
        ("teacher", kd.get("teacher"), ".4f"),
        ("student before", kd.get("student_before"), ".4f"),
        (f"student after {mode}" if mode == "ce" else f"student after KD ({mode})",
         kd.get("student_after"), ".4f"),
    ]  # fmt: skip
    if ce is not None:
        after = (kd.get("student_after"), ce.get("student_after"))
        rows.append(("student after CE only", after[1], ".4f"))
        rows.append(("KD minus CE only", None if None in after else after[0] - after[1], "+.4f"))
    width = max(24, *(len(name) + 1 for name, _, _ in rows))
    lines = [
        f"held-out bits/byte, lower is better (run {config.run_dir}, {kd.get('steps')} steps of "
        f"{tokens})"
    ]
    for name, value, spec in rows:
        lines.append(f"  {name:<{width}} {'-' if value is None else format(value, spec):>7}")
    if ce is not None:
        lines.append(
            f"  (CE only: {Path(config.run_dir) / BASELINE_DIR}, the same micro-batches, steps and "
            "initial student, no teacher)"
        )
    return "\n".join(lines)


def start_baseline(data: dict) -> subprocess.Popen:
    """Start the CE-only run as ``xtoken run`` in the background (one thread: it shares the
    cores with the KD run, whose trainer waits on the teacher), its output in its log file.

    Args:
        data: :func:`baseline_data`.

    Returns:
        The process.
    """
    run_dir = Path(data["run_dir"])
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    config_path = run_dir.parent / f"{run_dir.name}.json"
    config_path.write_text(json.dumps(data, indent=1))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "services.cli", "run", str(config_path), "--no-progress"]
    with open(run_dir.parent / f"{run_dir.name}.log", "wb") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def _warm_caches(config) -> None:
    """Build what both runs read from the caches (the demo corpus, the tokenizer files) before
    they start side by side, so that they never build the same file at once."""
    from xtoken_core.data.corpus import build_demo_corpus
    from xtoken_core.tokenizers import load_tokenizer

    if config.data.train is None:
        build_demo_corpus()
    load_tokenizer(config.student_tokenizer)
    load_tokenizer(config.teacher_tokenizer)


def run(args: argparse.Namespace) -> int:
    """Run the demo distillation and, beside it, its CE-only baseline; print the held-out
    table."""
    from services.cli.run import execute, report
    from services.common.config import ConfigError

    # glibc returns every freed block above 32 MiB to the kernel, so each [B, T, V] tensor of a
    # CPU step costs fresh page faults: the demo's processes keep their freed memory instead
    os.environ.setdefault("GLIBC_TUNABLES", CPU_MALLOC)
    try:
        config = demo_config(args)
        baseline = None
        if not args.no_baseline and config.trainer.loss.mode != "ce":
            baseline = baseline_data(args)
        fresh_run_dir(config.run_dir)  # the demo always starts fresh
    except (ConfigError, ValueError) as e:
        print(f"xtoken demo: {e}", file=sys.stderr)
        return 2
    proc = None
    if baseline is not None:
        _warm_caches(config)
        proc = start_baseline(baseline)
    try:
        code = execute(config, progress=not args.no_progress, show_report=False)
    except BaseException:  # the KD run was killed (a second Ctrl-C): stop the baseline too
        if proc is not None:
            proc.terminate()
        raise
    if proc is not None:
        if code != 0:
            proc.terminate()
        elif proc.poll() is None:
            logger.info("[demo] waiting for the CE-only run (%s)", baseline["run_dir"])
        base_code = proc.wait()
        if code == 0 and base_code != 0:
            print(
                f"xtoken demo: the CE-only run failed (exit {base_code}); its log: "
                f"{baseline['run_dir']}.log",
                file=sys.stderr,
            )
            code = base_code
    if code != 0:
        return code
    ce = None if baseline is None else report(baseline["run_dir"])
    print(format_table(report(config.run_dir), ce, config))
    return 0
