"""The healing experiment at scale, with a fair grid: every arm tuned the same way on the
validation split, then its chosen setting trained on every seed and scored once on the held-out
and fresh splits; rows to ``<out>/quality_scale.jsonl``, the report to ``quality_scale.md``.

The task is ``heal.py``'s: SmolLM2-135M without decoder layers 10-19 (``smollm2:drop=10-19``)
healed by KD from its parent (``pkl@smollm2``, same tokenizer: the upper reference),
Qwen2.5-Coder-0.5B and Gemma-3-270M (other tokenizers), against CE only. The arms
(``scale_arms.SCALE_ARMS``): CE; P-KL, gold and relaxed gold from each teacher; both teachers in
one run (``extra_teachers``); the teacher cache against the same teacher online (top-K, the same
K); top-K targets K = 32 and 64 against full logits; on-policy at fractions 0.25 and 0.5 after an
off-policy start (half the budget, in the same run: one optimizer and one schedule); TRL's GOLD
trainer on the same student, teacher, texts and budget, or on ``--peer-tokens`` (a budget of its
own, grid and final: it trains far slower) (``trl-gold@qwen2.5-coder-0.5b``, tuned on the same
rate grid, run under ``--trl-python`` or ``.venv-bench``; left out with one line where
trl is not installed; a reference point in the table, judged by no bar). Every off-policy xtoken
run is bitwise reproducible (``trainer.compute.deterministic`` with ``data.ordered``; the row says
``deterministic: true``); an on-policy run cannot be (its samples come in no fixed order), nor
can TRL's, and their rows say false.

* **Budget**: ``--tokens`` student tokens per run (default 20 M), as steps of ``--batch`` samples
  of at most ``--ctx`` tokens (the mean sample's tokens measured on the training split).
  ``--grid-tokens`` (default ``--tokens``) gives the grid's runs a smaller budget: every arm's
  settings are then chosen alike on shorter runs, and the final runs train ``--tokens`` in
  folders of their own (with one budget a final run of the grid's seed reuses its grid run).
  Rows carry their run's budget; a later call counts only the rows of its own budgets.
* **Grid** (``scale_grid``): the KL weight and temperature of each KD family on a small grid at
  the middle learning rate, then the learning-rate grid (the same for every arm) extended one
  ``--lr-factor`` step at a time until each arm's best is interior (at most ``--max-extend``
  steps a side), all on seed ``--grid-seed`` and the validation split only
  (``scale_score.score_validation``); then the chosen setting on every seed, scored on held-out
  and fresh (``scale_final``, the only reader of those splits): bits/byte, next-line exact
  match, and greedy completion of held-out functions rated by a teacher (``heal_complete``).
  Each row carries its validation curve (one point per ``--eval-every`` steps), so the report
  shows whether CE converged. One arm's seed (``--rerun-arm``) is trained and scored again: its
  row must come out bitwise equal.
* **Lanes** (``scale_lanes``): one run per GPU at a time (``--gpus``, ``CUDA_VISIBLE_DEVICES``
  per run; ``--runs-per-gpu N`` for N at a time, as small students and teachers leave a GPU
  idle; ``--lanes N`` on the CPU), each run (training, then scoring on the same GPU) stopped
  past ``--run-timeout-s``. ``--stagger-s S`` starts at most one run on a GPU every S seconds,
  so that the runs' start-ups (host work, the GPU idle) fall beside other runs' steps. A run
  that runs out of GPU memory beside others (its log says so) runs again in the same call with
  a GPU to itself (no run starts beside it; its row says ``gpu_alone``), so a number of runs
  per GPU too high for the largest arms costs time, not rows; ``--slots 'pkl@gemma3*=3'`` lets
  the runs of arms known to be large take three of a GPU's slots from the start (their rows say
  ``slots``): the rows' ``peak_memory_mib`` and ``peak_reserved_mib`` (what PyTorch allocated and
  what its allocator held, trainer and teacher; the report's memory per arm) say how large, and
  ``alloc_conf`` the allocator settings the runs inherited (``PYTORCH_ALLOC_CONF``). Top-K
  targets do not make P-KL small: over every teacher column (``vocab_topk: null``) it holds
  the same fp32 tensors of the teacher's vocab as full logits do. A row is appended as soon as
  its run ends, and a later call skips every run that has a scored row (a run trained but not
  scored is scored without training).
  With ``--checkpoint-every N`` each run checkpoints every N steps and at a stop, and a run
  stopped before its end (its timeout, or the end of a call on a machine that keeps its work
  folder) goes on from its last checkpoint when a later call asks for it with the same config;
  its row says ``resumed`` (on the CPU a run SIGTERMed at step 16 of 40 and resumed ends
  with the weights of one trained in one go: ``test_scale.py``, marker ``slow``). Final rows
  scored on another fresh split (``fresh_commit``) are not counted as done: every call of one
  experiment builds its split with the same ``--fresh-rev``. Each row also has its commands'
  wall seconds (``command_s``: the training stages, then the scoring) beside ``train_s``, the
  steps' own, ``compile_s`` (the start-up step's compile) and ``first_step_s`` (the first step,
  which waits for the first logits); ``--compile off`` trains the students eagerly, without
  that compile, for slower steps; ``--length-multiple`` (fewer distinct micro-batch lengths,
  fewer CUDA graphs recorded) and ``--warm-shortest`` (fewer start-up rungs) shorten it, each
  measured against the defaults by ``scale_ab.py`` (two calls side by side, rows paired by
  setting). A SIGTERM or Ctrl-C stops the running jobs with it.

Budget (estimates from ``quality_heal.jsonl``, not measured here): the healing split's samples
hold ~325 student tokens (16 x 512 steps trained 780 k tokens in 150 steps), so 20 M tokens are
~3,850 steps, ~8 passes over its 7,395 training texts. Those runs summed 0.08-0.12 s a step for
CE and 0.12-0.23 s for P-KL from Qwen2.5-Coder with two runs sharing one GPU; alone on an H100,
~0.05-0.08 and ~0.08-0.15 s: one 20 M-token run takes ~3-5 min (CE) or ~5-10 min (KD), plus
~1-1.5 min of start-up and ~1-2 min of final scoring, before the unmeasured cost of
deterministic mode; on-policy runs are bound by sampling and slower. The default grid is ~125
trainings (8 KD families x 6 KL weight / temperature pairs, 14 arms x 3-4 rates, 14 x 2 final
seeds beyond the grid's), ~5 h on four H100s; ``--deadline-s`` ends a call early and the next
call goes on from the rows (``--kl-weights 0.5 1 --temperatures 1`` makes it ~3 h). With
``--grid-tokens 2000000`` the ~97 grid trainings take ~0.2 G student tokens and the 42 final runs
0.84 G, against 2.5 G with one budget (measured since: 12 runs of 2 M tokens on four H200s, three
a GPU, trained in ~61 s each and took ~340 s with start-up and scoring,
``benchmarks/results/teacher_cache_quality.jsonl``; on one H200, three a GPU, a grid run's
training command took ~200 s: a ~74 s start-up step, ~47 s of steps, the rest process start-up
and evaluations; ``benchmarks/results/quality_scale.md``). ``--phase grid`` starts grid runs alone:
for calls too short for a final run, which then waits for a longer one.

Commands (``runs/`` is git-ignored, so ``--work runs/scale`` stays on a warm machine)::

    python benchmarks/quality/run_kd_quality.py --split-only benchmarks/quality/heal_split \\
        --fresh-rev COMMIT    # one commit for every call of an experiment: the same fresh texts
    python benchmarks/quality/scale.py --gpus 0 1 2 3 --corpus benchmarks/quality/heal_split \\
        --work runs/scale --out $OUT --tokens 20000000 --grid-tokens 2000000 \\
        --model-alias qwen2.5-coder-0.5b=gguf:/PATH/qwen.gguf gemma3-270m=gguf:/PATH/gemma.gguf
    python benchmarks/quality/scale.py --report --out $OUT
    python benchmarks/quality/scale.py --plan ...  # the same options as a call: what it would
        # start, in order, with each run's slots and the memory its arm's runs took (so far,
        # or its family's), and the settings chosen so far (no training)

CPU smoke (heal.py's tiny stand-ins; arms ce and pkl@smollm2, 2 seeds, learning rates 5e-4 and
1e-3 with no extension, 4 steps; ``tests/benchmarks/quality/test_scale.py``, marker ``slow``)::

    python benchmarks/quality/scale.py --smoke --work /tmp/scale_smoke

A rehearsal of every arm with the real models on the CPU, before GPU time is spent on them (the
15 default arms, the teacher cache and the rerun: all exit 0 in ~30 min on two cores)::

    python benchmarks/quality/scale.py --lanes 1 --work /tmp/rehearsal/work \\
        --out /tmp/rehearsal/out --tokens 800 --batch 2 --ctx 128 --lrs 1e-3 --max-extend 0 \\
        --kl-weights 0.5 --temperatures 1 --seeds 0 --warmup 1 --eval-every 2 --eval-texts 4 \\
        --val-limit 4 --eval-limit 4 --nextline-lines 2 --nextline-new-tokens 8 --functions 1 \\
        --completion-new-tokens 8 --limit 64 --rollouts 1 --rollout-batch 2

The rerun of the smoke runs on the CPU; whether a GPU run's rerun is bitwise equal is the GPU
run's own check (its rerun row).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import fnmatch
import json
import logging
import math
import os
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.quality import heal, heal_peer, scale_arms, scale_final, scale_grid  # noqa: E402
from benchmarks.quality import run_kd_quality as kd  # noqa: E402
from benchmarks.quality.scale_grid import RunKey  # noqa: E402
from benchmarks.quality.scale_lanes import TIMED_OUT, Job, Lanes, ran_out_of_gpu_memory  # noqa: E402
from services.trainer.checkpoint import latest_checkpoint  # noqa: E402

logger = logging.getLogger("kd_quality.scale")

ROWS_FILE = "quality_scale.jsonl"
#: in a run's folder: its training went on from a checkpoint of an earlier call
RESUMED_MARK = "scale_resumed"
SMOKE_LRS = (5e-4, 1e-3)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", nargs="+", default=None, help="arm specs (scale_arms.SCALE_ARMS)")
    p.add_argument("--tokens", type=int, default=20_000_000, help="student tokens per run")
    p.add_argument(
        "--grid-tokens",
        type=int,
        default=None,
        help="student tokens per grid run (default --tokens; the final runs train --tokens)",
    )
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="seeds of final runs (0 1 2)")
    p.add_argument("--grid-seed", type=int, default=0, help="the seed every choice is made on")
    p.add_argument(
        "--lrs", nargs="+", type=float, default=None, help="learning-rate grid (2.5e-4 5e-4 1e-3)"
    )
    p.add_argument("--lr-factor", type=float, default=2.0, help="one extension step of the rate")
    p.add_argument("--max-extend", type=int, default=3, help="most extension steps on each side")
    p.add_argument("--kl-weights", nargs="+", type=float, default=[0.25, 0.5, 1.0])
    p.add_argument("--temperatures", nargs="+", type=float, default=[1.0, 2.0])
    p.add_argument(
        "--rerun-arm", default=None, help="the arm trained twice (default: the first KD arm; none)"
    )
    p.add_argument(
        "--gpus", nargs="+", default=None, help="one lane per GPU: indices, 0 1 2 3 or 0,1,2,3"
    )
    p.add_argument(
        "--runs-per-gpu", type=int, default=1, help="runs sharing each GPU of --gpus at a time"
    )
    p.add_argument("--lanes", type=int, default=1, help="lanes without --gpus (CPU runs)")
    p.add_argument(
        "--slots",
        nargs="+",
        default=[],
        metavar="ARM=N",
        help="runs of the arms matching ARM (a shell pattern: 'pkl@gemma3*') take N of a GPU's "
        "--runs-per-gpu slots, so a large run shares its GPU with fewer others (the first "
        "pattern that matches counts; other runs take 1)",
    )
    p.add_argument(
        "--stagger-s",
        type=float,
        default=0.0,
        help="start at most one run on a GPU in this many seconds: runs sharing it then reach "
        "their start-up (host work, the GPU idle) at different times, each beside the others' "
        "steps (0: free lanes fill at once)",
    )
    p.add_argument("--run-timeout-s", type=float, default=5400.0, help="most seconds per run")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="steps between a run's checkpoints (0: none); with them a run stopped before its "
        "end (--run-timeout-s, a call's end) resumes from its last one when a later call asks "
        "for it with the same config, and its row says resumed",
    )
    p.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="the students' torch.compile (trainer.compute.compile; auto: on for a GPU): off "
        "saves each run its start-up compile (the rows' compile_s) for slower steps",
    )
    p.add_argument(
        "--peer-tokens",
        type=int,
        default=None,
        help="student tokens of every TRL GOLD run, grid and final (default: the others' "
        "budgets): TRL's trainer is far slower, so the budget it can run in the time there is; "
        "its rows and the table say how many tokens it trained",
    )
    p.add_argument(
        "--length-multiple",
        type=int,
        default=1,
        help="pad the students' micro-batch lengths up to a multiple of this "
        "(trainer.compute.length_multiple; it must divide --ctx): fewer distinct lengths, "
        "fewer CUDA graphs recorded per run, for a little padding",
    )
    p.add_argument(
        "--warm-shortest",
        type=int,
        default=None,
        help="the students' start-up ladder stops at this length (trainer.compute."
        "warm_shortest; default the trainer's 64): a micro-batch of --batch samples is as long "
        "as its longest, so the short rungs may never serve a step",
    )
    p.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="start no run after this many seconds (a later call goes on from the rows)",
    )
    p.add_argument(
        "--phase",
        choices=("all", "grid"),
        default="all",
        help="grid: start grid runs alone (each arm's final runs wait for a later call): for a "
        "call too short for a final run",
    )
    p.add_argument("--batch", type=int, default=16, help="samples per step")
    p.add_argument("--ctx", type=int, default=512, help="tokens per sample, both sides")
    p.add_argument("--warmup", type=int, default=100, help="warm-up steps")
    p.add_argument("--eval-every", type=int, default=100, help="validation curve period (steps)")
    p.add_argument("--eval-texts", type=int, default=64, help="validation texts per curve point")
    p.add_argument("--val-limit", type=int, default=None, help="validation texts scored (all)")
    p.add_argument("--eval-limit", type=int, default=None, help="held-out / fresh texts (all)")
    p.add_argument("--nextline-lines", type=int, default=300, help="next-line items per split")
    p.add_argument("--nextline-new-tokens", type=int, default=64)
    p.add_argument("--functions", type=int, default=200, help="held-out functions to complete")
    p.add_argument("--completion-new-tokens", type=int, default=128)
    p.add_argument("--scorer", default=None, help="teacher rating completions (qwen2.5-coder)")
    p.add_argument("--student", default="smollm2:drop=10-19")
    p.add_argument("--student-tokenizer", default=None)
    p.add_argument("--model-alias", nargs="+", default=None, help="NAME=SPEC (gguf:PATH)")
    p.add_argument("--corpus", default=None, help="the split (default: built into --work)")
    p.add_argument("--limit", type=int, default=None, help="train on the first N texts only")
    p.add_argument("--top-k", type=int, default=8, help="projection slots per row")
    p.add_argument("--rollouts", type=int, default=None)
    p.add_argument("--rollout-batch", type=int, default=None)
    p.add_argument("--max-staleness", type=int, default=None)
    p.add_argument("--kv-cache", choices=("dynamic", "static"), default=None)
    p.add_argument("--work", default="runs/scale")
    p.add_argument(
        "--trl-python",
        default=None,
        help="the python that imports trl for trl-gold arms (default .venv-bench/bin/python)",
    )
    p.add_argument(
        "--caches",
        default=None,
        help="teacher caches' folder (default WORK/caches); another call's, to reuse its caches",
    )
    p.add_argument("--out", default=None, help="rows and report (default benchmarks/results)")
    p.add_argument("--report", action="store_true", help="write the report from the rows")
    p.add_argument(
        "--plan",
        action="store_true",
        help="print the runs this call would start, in order, with their slots and the GPU "
        "memory their arm's runs took so far, and the settings chosen so far (from the rows "
        "and the split's budget; nothing trains)",
    )
    p.add_argument("--smoke", action="store_true", help="CPU smoke with tiny stand-in models")
    args = p.parse_args(argv)
    if args.gpus:
        try:
            args.gpus = [int(g) for item in args.gpus for g in item.split(",") if g]
        except ValueError:
            p.error(f"--gpus {' '.join(args.gpus)}: give GPU indices, e.g. 0 1 2 3 or 0,1,2,3")
    if args.runs_per_gpu < 1:
        p.error(f"--runs-per-gpu {args.runs_per_gpu}: give 1 or more")
    if not args.stagger_s >= 0:
        p.error(f"--stagger-s {args.stagger_s}: give 0 or more seconds")
    try:
        args.slots = parse_slots(args.slots)
    except ValueError as e:
        p.error(str(e))
    if args.warm_shortest is not None and args.warm_shortest < 1:
        p.error(f"--warm-shortest {args.warm_shortest}: give a length >= 1 token")
    if args.peer_tokens is not None and args.peer_tokens < 1:
        p.error(f"--peer-tokens {args.peer_tokens}: give a budget > 0 student tokens")
    if args.length_multiple < 1 or args.ctx % args.length_multiple:
        p.error(f"--length-multiple {args.length_multiple}: give a divisor of --ctx ({args.ctx})")
    if args.checkpoint_every < 0:
        p.error(f"--checkpoint-every {args.checkpoint_every}: give 0 (none) or more steps")
    if args.grid_tokens is not None and not 0 < args.grid_tokens <= args.tokens:
        p.error(
            f"--grid-tokens {args.grid_tokens}: give a budget > 0 and at most --tokens "
            f"({args.tokens}); the grid's runs choose the final runs' setting"
        )
    return args


def parse_slots(items: list[str]) -> list[tuple[str, int]]:
    """``--slots ARM=N ...`` as ``(pattern, N)`` in the order given.

    Raises:
        ValueError: an item without ``=``, an empty pattern, or N not a whole number >= 1.
    """
    out = []
    for item in items:
        pattern, _, n = item.rpartition("=")
        if not pattern or not n.isdigit() or int(n) < 1:
            raise ValueError(
                f"--slots {item}: give ARM=N, a shell pattern of arms and a whole number of "
                "slots >= 1, e.g. 'pkl@gemma3*=2'"
            )
        out.append((pattern, int(n)))
    return out


def slots_of(arm: str, slots: list[tuple[str, int]]) -> int:
    """The slots a run of ``arm`` takes: the first ``--slots`` pattern that matches, else 1."""
    return next((n for pattern, n in slots if fnmatch.fnmatchcase(arm, pattern)), 1)


def gpu_lanes(gpus: list[int], runs_per_gpu: int, visible: str | None) -> list[str]:
    """One lane (a ``CUDA_VISIBLE_DEVICES`` value) per run that may run at a time: each GPU
    ``runs_per_gpu`` times, the GPUs taken in turn, so the first runs spread over every GPU.

    Raises:
        ValueError: as ``run_kd_quality.gpu_names`` (an index not seen or given twice).
    """
    return kd.gpu_names(gpus, visible) * runs_per_gpu


def smoke_setup(args: argparse.Namespace) -> None:
    """The CPU smoke's settings (``heal._smoke_setup``'s tiny models and sizes, two seeds, two
    learning rates, one KL weight and temperature, no extension)."""
    args.arms = args.arms or list(scale_arms.SMOKE_ARMS)
    args.eval_limit, args.limit, args.continuations, args.parallel = None, None, 0, 2
    seeds, lrs = args.seeds, args.lrs  # what the command line gave (heal's smoke sets [0])
    heal._smoke_setup(args)
    args.seeds, args.lrs = seeds or [0, 1], lrs or list(SMOKE_LRS)
    args.max_extend = 0
    args.kl_weights, args.temperatures = [0.5], [1.0]
    args.gpus, args.lanes = None, 2
    args.functions, args.completion_new_tokens, args.val_limit = 4, 16, 6
    args.rerun_arm = args.rerun_arm or "ce"


def check_installed(name: str, aliases: dict[str, str]) -> None:
    """A teacher can be loaded here: its tokenizer is loaded, its model only located.

    Raises:
        ValueError: names the teacher and what to install or pass.
    """
    from xtoken_core.tokenizers import load_tokenizer

    spec = heal.resolve(name, aliases)
    if spec.startswith("gguf:") and not Path(spec[5:]).is_file():
        raise ValueError(f"teacher {name}: {spec[5:]} is no file; fix --model-alias")
    try:
        load_tokenizer(heal.teacher_tokenizer(name))
    except ValueError as e:
        raise ValueError(f"teacher {name}: {e}") from None
    if spec.startswith("gguf:"):
        return
    if name in aliases:
        return  # a folder or a preset by alias: load_model says what is wrong with it
    if name == "smollm2":
        from xtoken_core.models.smollm2 import smollm2_gguf_path

        smollm2_gguf_path()
        return
    from xtoken_core.models.gguf import GGUF_PRESETS
    from xtoken_core.tokenizers.gguf_parts import get_split_gguf, locate_parts

    try:
        locate_parts(get_split_gguf(GGUF_PRESETS[name].split))
    except ValueError as e:
        raise ValueError(
            f"teacher {name} is not installed: {e}; or pass --model-alias {name}=gguf:PATH"
        ) from None


def resolve_trl(args: argparse.Namespace, defaulted: bool) -> None:
    """``args.trl``: the python TRL's arms run under (None without such an arm). Where trl is
    not importable, default arms leave TRL's arm out (one log line); named ones are refused.

    Raises:
        ValueError: a trl-gold arm named, and no python that imports trl.
    """
    args.trl = None
    peers = [s for s in args.arms if scale_arms.parse_scale_arm(s).peer]
    if not peers:
        return
    args.trl = heal_peer.trl_python(args.trl_python, what=f"arm {peers[0]}")
    if args.trl is not None:
        return
    if not defaulted:
        raise ValueError(
            f"arm {peers[0]} needs trl: ./scripts/setup.sh test peers, or --trl-python PY (a "
            "python that imports trl and datasets), or leave the arm out"
        )
    args.arms = [s for s in args.arms if s not in peers]


class Experiment:
    """One call: the arms, the grid, the prepared student and teachers, and the rows."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t_start = time.monotonic()
        self.work = Path(args.work).resolve()
        args.work = self.work  # the run configs (heal.run_config) join paths to it
        self.out = Path(args.out).resolve()
        self.rows_path = self.out / ROWS_FILE
        self.specs = list(args.arms)
        self.arms = [scale_arms.parse_scale_arm(s) for s in self.specs]
        self.grid = scale_grid.GridSpec(
            tuple(args.lrs),
            tuple(args.kl_weights),
            tuple(args.temperatures),
            args.lr_factor,
            args.max_extend,
            args.grid_seed,
            tuple(args.seeds),
        )
        kd_arms = [a.spec for a in self.arms if a.tunes_kd]
        rerun = args.rerun_arm or (kd_arms[0] if kd_arms else self.specs[0])
        if rerun != "none" and rerun not in self.specs:
            raise ValueError(f"--rerun-arm {rerun}: not one of the arms {self.specs}; or none")
        self.rerun = None if rerun == "none" else rerun
        self.teachers = sorted({t for a in self.arms for t in a.teachers} | self._families())
        self.scorer = args.scorer or heal.default_scorer([a.heal for a in self.arms])
        for name in self.teachers + ([self.scorer] if self.scorer else []):
            check_installed(name, args.aliases)
        self.results: dict[RunKey, float | None] = {}
        self.in_flight: set = set()
        self.busy: dict[RunKey, set[Path]] = {}  # the run folders of the jobs running
        self.alone: set = set()  # jobs that ran out of GPU memory beside others: run alone
        self.caches_ready: set[tuple[str, int]] = set()

    def _families(self) -> set[str]:
        fams = [scale_arms.parse_scale_arm(a.family) for a in self.arms if a.tunes_kd]
        return {t for f in fams for t in f.teachers}

    # ----------------------------------------------------------------- preparation

    def prepare(self) -> None:
        """The split, the budget in steps, the student folder, projections and teachers."""
        from xtoken_core.models import export_hf
        from xtoken_core.tokenizers import load_tokenizer

        a = self.args
        self.work.mkdir(parents=True, exist_ok=True)
        if a.corpus is None:
            a.corpus = self.work / "corpus"
            if not (a.corpus / "split.json").is_file():
                kd.build_split(a.corpus)
        a.corpus = Path(a.corpus).resolve()
        scale_final.check_final_splits(a.corpus)
        train = kd.read_jsonl_texts(a.corpus / "train.jsonl", a.limit)
        s_tok = load_tokenizer(a.student_tokenizer)
        self.sample_tokens = scale_arms.mean_sample_tokens(train[:2000], s_tok, a.ctx)
        if a.smoke:  # a few steps, whatever --tokens says; --grid-tokens: fewer for the grid
            per_step = a.batch * self.sample_tokens
            a.tokens = round(a.steps * per_step)
            a.grid_steps = a.steps
            if a.grid_tokens is not None:
                a.grid_steps = min(a.steps, max(1, math.ceil(a.grid_tokens / per_step)))
            a.grid_tokens = round(a.grid_steps * per_step)
        else:
            a.steps = scale_arms.steps_for(a.tokens, a.batch, self.sample_tokens)
            a.grid_tokens = a.grid_tokens or a.tokens
            a.grid_steps = scale_arms.steps_for(a.grid_tokens, a.batch, self.sample_tokens)
        a.peer_steps = None
        if a.peer_tokens is not None:  # TRL's runs: a budget of their own
            a.peer_steps = scale_arms.steps_for(a.peer_tokens, a.batch, self.sample_tokens)
        a.epochs = math.ceil(a.steps * a.batch / max(1, len(train))) + 1
        if a.plan:  # the rows of this budget and split are all a plan needs
            split = json.loads((a.corpus / "split.json").read_text())
            self.meta = {
                "fresh_commit": split.get("fresh", {}).get("commit"),
                "split_sha256": kd.split_digest(a.corpus),
            }
            self.load_results()
            return
        self.student_dir = self.work / "student" / heal.slug(heal.resolve(a.student, a.aliases))
        if not (self.student_dir / "config.json").is_file():
            model = heal.student_model(heal.resolve(a.student, a.aliases), s_tok.vocab_size)
            export_hf(model, self.student_dir, tokenizer=a.student_tokenizer)
        self.projections: dict[str, Path] = {}
        for name in self.teachers:
            t_tok = heal.teacher_tokenizer(name)
            path = self.work / f"projection_{a.student_tokenizer}_{t_tok}_k{a.top_k}.pt"
            if not path.is_file():
                kd.build_projection_file(path, t_tok, a.top_k, a.student_tokenizer)
            self.projections[t_tok] = path
        for name in self.teachers:  # dequantize a GGUF once, before the lanes read its cache
            heal.load_teacher(name, a.aliases)
        self.peer_teachers: dict[str, Path] = {}
        for name in sorted({arm.teachers[0] for arm in self.arms if arm.peer}):
            folder = self.work / "trl" / f"teacher_{heal.slug(heal.resolve(name, a.aliases))}"
            if not (folder / "config.json").is_file():  # TRL reads an HF folder
                teacher = heal.load_teacher(name, a.aliases)
                export_hf(teacher, folder, tokenizer=heal.teacher_tokenizer(name))
            self.peer_teachers[name] = folder
        # teacher caches hold the teacher's targets alone: any student (tokenizer) reuses them
        caches = Path(a.caches).resolve() if a.caches else self.work / "caches"
        self.caches = {
            (arm.teachers[0], arm.cache): caches / f"{arm.teachers[0]}_k{arm.cache}"
            for arm in self.arms
            if arm.cache
        }
        self.caches_ready = {k for k, p in self.caches.items() if p.with_suffix(".done").exists()}
        split = json.loads((a.corpus / "split.json").read_text())
        self.meta = {
            "mode": "scale",
            "command": getattr(a, "command", None),
            "commit": kd.commit(),
            "device": kd.device_name("cuda" if a.gpus else "cpu"),
            "date": time.strftime("%Y-%m-%d"),
            "student": a.student,
            "student_tokenizer": a.student_tokenizer,
            "batch": a.batch,
            "ctx": a.ctx,
            "sample_tokens": round(self.sample_tokens, 1),
            "epochs_allowed": a.epochs,
            "fresh_commit": split.get("fresh", {}).get("commit"),
            "split_sha256": kd.split_digest(a.corpus),
            # the students' start-up ladder and micro-batch padding (trainer.compute)
            "length_multiple": a.length_multiple,
            "warm_shortest": a.warm_shortest,
            # PyTorch's allocator settings the runs inherit (expandable segments hold less
            # memory beside the allocation; the figures do not depend on them)
            "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF")
            or os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "smoke": bool(a.smoke),
        }
        other = self.load_results()
        logger.info(
            "[scale] %d arms, %d steps of %d x %d (%.0f tokens a sample; grid runs %d steps), "
            "%d scored runs before, %d rows of another budget or split left out",
            len(self.arms), a.steps, a.batch, a.ctx, self.sample_tokens, a.grid_steps,
            len(self.results), other,
        )  # fmt: skip

    def load_results(self) -> int:
        """The runs done before, from the rows of this budget (a grid run's of the grid's, a
        final run's of ``--tokens``), trained on this split's texts (``split_sha256``, where a
        row has one) and, for the final runs, scored on this fresh split (the grid reads the
        validation split alone); returns how many rows were left out."""
        other = 0
        for row in heal.read_rows([self.rows_path]):
            if row.get("mode") == "scale" and row.get("validation_bpb") is not None:
                key = scale_grid.row_key(row)
                fresh = row.get("fresh_commit") == self.meta["fresh_commit"]
                split = row.get("split_sha256") in (None, self.meta.get("split_sha256"))
                if (
                    row.get("steps_budget") != self.budget(key)["steps_budget"]
                    or not split
                    or (key.phase != "grid" and not fresh)
                ):
                    other += 1
                    continue
                self.results[key] = row["validation_bpb"]
        return other

    def budget(self, key: RunKey) -> dict:
        """A run's budget: the grid's for a grid run, ``--tokens`` for the final runs;
        ``--peer-tokens`` for both of TRL's arm where it is given."""
        a = self.args
        if getattr(a, "peer_steps", None) and scale_arms.parse_scale_arm(key.arm).peer:
            return {"steps_budget": a.peer_steps, "tokens_budget": a.peer_tokens}
        if key.phase == "grid":
            return {"steps_budget": a.grid_steps, "tokens_budget": a.grid_tokens}
        return {"steps_budget": a.steps, "tokens_budget": a.tokens}

    def args_of(self, key: RunKey) -> argparse.Namespace:
        """The run settings of one run: the budget's steps for its phase."""
        a = copy.copy(self.args)
        a.steps = self.budget(key)["steps_budget"]
        return a

    def short_grid(self, key: RunKey) -> str:
        """A grid run's folder suffix where the grid trains fewer steps than the final runs
        (they then train apart; with one budget a final run reuses its grid run's folder)."""
        a = self.args
        return f"_grid{a.grid_steps}" if key.phase == "grid" and a.grid_steps != a.steps else ""

    # ----------------------------------------------------------------- jobs

    def plan(self) -> scale_grid.Plan:
        """The grid's plan from the runs done so far."""
        return scale_grid.plan(self.arms, self.results, self.grid, self.rerun)

    def plan_lines(self) -> list[str]:
        """What a call would start, in order (the runs ``--phase`` lets start, each with its
        slots), the setting chosen for each arm so far and the arms whose grid stalled."""
        p = self.plan()
        runs = [k for k in p.pending if self.args.phase != "grid" or k.phase == "grid"]
        phases = {ph: sum(1 for k in runs if k.phase == ph) for ph in ("grid", "final", "rerun")}
        held = len(p.pending) - len(runs)
        lines = [
            f"{len(runs)} run{'' if len(runs) == 1 else 's'} to start ("
            + ", ".join(f"{n} {ph}" for ph, n in phases.items() if n)
            + (
                f"; {held} final run{'' if held == 1 else 's'} wait for a call without --phase grid"
                if held
                else ""
            )
            + "), in order:"
        ]
        memory = self.arm_memory()
        for k in runs:
            kd_w = "-" if k.kl_weight is None else f"{k.kl_weight:g}"
            temp = "-" if k.temperature is None else f"{k.temperature:g}"
            family = scale_arms.parse_scale_arm(k.arm).family
            mem = memory.get(k.arm) or memory.get(family)
            lines.append(
                f"  {k.phase:<6} {k.arm:<40} seed {k.seed}  lr {k.lr:g}  KL w {kd_w}  T {temp}  "
                f"slots {slots_of(k.arm, self.args.slots)}"
                + (f"  ({mem}{'' if k.arm in memory else f' of {family}'})" if mem else "")
            )
        for arm, setting in p.chosen.items():
            if setting is not None:
                where = {True: "interior", False: "at an edge", None: "pinned"}[p.interior[arm]]
                lines.append(f"chosen: {arm} lr {setting.lr:g} ({where})")
        lines += [f"stalled: {arm} (a failed grid run; see its log)" for arm in p.stalled]
        return lines

    def arm_memory(self) -> dict[str, str]:
        """Per arm with rows, the most GPU memory its runs took, as the plan shows it: GiB the
        trainer and the teacher had PyTorch allocate, and reserve where the rows say."""
        from benchmarks.quality.scale_report import arm_peaks

        def brief(peaks: dict[str, float]) -> str:  # "trainer allocated" -> "trainer alloc"
            return "GiB " + ", ".join(
                f"{k.replace('allocated', 'alloc')} {v / 1024:.1f}"
                for k, v in sorted(peaks.items())
            )

        return {arm: brief(m) for arm, m in arm_peaks(heal.read_rows([self.rows_path])).items()}

    def next_jobs(self, n: int) -> list[Job]:
        """At most ``n`` jobs ready now: cache builds first, then the plan's runs."""
        jobs: list[Job] = []
        for key in self.plan().pending:
            if len(jobs) >= n:
                break
            if key in self.in_flight or (self.args.phase == "grid" and key.phase != "grid"):
                continue
            arm = scale_arms.parse_scale_arm(key.arm)
            if arm.cache and (arm.teachers[0], arm.cache) not in self.caches_ready:
                ckey = ("cache", arm.teachers[0], arm.cache)
                if ckey not in self.in_flight:
                    self.in_flight.add(ckey)
                    jobs.append(self.cache_job(arm, ckey))
                continue
            cfgs = self.configs(key, arm)
            dirs = {Path(c["run_dir"]) for c in cfgs} or {self.run_dir(key)}
            if dirs & set().union(*self.busy.values()):
                continue  # its folder trains in another lane (a final run of a grid run's
                # setting and seed): reused once it is done
            self.in_flight.add(key)
            self.busy[key] = dirs
            jobs.append(self.run_job(key, cfgs))
        for job in jobs:
            job.exclusive = job.key in self.alone
            if isinstance(job.key, RunKey):
                job.slots = slots_of(job.key.arm, self.args.slots)
        return jobs

    def run_dir(self, key: RunKey) -> Path:
        """Where a run trains (a final run of a grid run's setting and seed shares its folder:
        the same config, trained once)."""
        kl = "-" if key.kl_weight is None else f"{key.kl_weight:g}"
        t = "-" if key.temperature is None else f"{key.temperature:g}"
        name = f"{heal.slug(key.arm)}_s{key.seed}_lr{key.lr:g}_kl{kl}_t{t}" + self.short_grid(key)
        return self.work / "runs" / (name + ("_rerun" if key.phase == "rerun" else ""))

    def configs(self, key: RunKey, arm: scale_arms.ScaleArm) -> list[dict]:
        """The run configs of one run (none for TRL's arm: its worker trains it)."""
        if arm.peer:
            return []
        return scale_arms.run_configs(
            arm, key.seed, key.setting, self.args_of(key), self.student_dir, self.projections,
            self.run_dir(key), self.caches,
        )  # fmt: skip

    def run_job(self, key: RunKey, cfgs: list[dict]) -> Job:
        """Train each stage not trained before with the same config (and every stage after one
        that trains), then score."""
        commands = self.peer_commands(key) if not cfgs else []
        for cfg in cfgs:
            run_dir = Path(cfg["run_dir"])
            path = self.work / "configs" / f"{run_dir.name}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            text = json.dumps(cfg, indent=1)
            same = path.is_file() and path.read_text() == text
            if not commands and same and (run_dir / "final").is_dir():
                continue
            path.write_text(text)
            # a stage stopped before its end goes on from its last checkpoint (xtoken run
            # resumes a checkpoint of the same config); any other starts over
            if not commands and same and latest_checkpoint(run_dir) is not None:
                (run_dir / RESUMED_MARK).write_text("trained on from a checkpoint\n")
            else:
                shutil.rmtree(run_dir, ignore_errors=True)
            commands.append(
                [sys.executable, "-m", "services.cli", "run", str(path), "--no-progress"]
            )
        a = self.args
        score = self.work / "scores" / f"{key.phase}_{self.run_dir(key).name}.json"
        score.parent.mkdir(parents=True, exist_ok=True)
        result = score.with_suffix(".result.json")
        result.unlink(missing_ok=True)
        spec = {
            "phase": key.phase,
            "model": str(self.run_dir(key) / "final"),  # TRL's worker saves there too
            "student_tokenizer": a.student_tokenizer,
            "corpus": str(a.corpus),
            "ctx": a.ctx,
            "device": "cuda" if a.gpus else "cpu",
            "val_limit": a.val_limit,
            "eval_limit": a.eval_limit,
            "nextline_lines": a.nextline_lines,
            "nextline_new_tokens": a.nextline_new_tokens,
            "functions": a.functions,
            "completion_new_tokens": a.completion_new_tokens,
            "scorer": self.scorer,
            "aliases": a.aliases,
            "result": str(result),
        }
        score.write_text(json.dumps(spec, indent=1))
        commands.append([sys.executable, "-m", "benchmarks.quality.scale_score", str(score)])
        return Job(key, commands, self.work / "logs" / f"{score.stem}.log")

    def peer_commands(self, key: RunKey) -> list[list[str]]:
        """TRL's GOLD worker for one run (``heal_peer``): the same student, teacher, texts of the
        seed, steps and learning-rate schedule; it saves the student in the run's ``final``."""
        teacher = scale_arms.parse_scale_arm(key.arm).teachers[0]
        return [
            heal_peer.peer_job(
                self.args_of(key), key.seed, self.student_dir, self.peer_teachers[teacher],
                heal.teacher_tokenizer(teacher), self.args.trl, work=self.run_dir(key),
                lr=key.lr, device="cuda" if self.args.gpus else "cpu",
            )
        ]  # fmt: skip

    def cache_job(self, arm: scale_arms.ScaleArm, ckey: tuple) -> Job:
        """``xtoken cache build`` of a cache arm's teacher over the training data."""
        cfg = scale_arms.cache_build_config(arm, self.args, self.student_dir, self.projections)
        path = self.work / "configs" / f"cache_{arm.teachers[0]}_k{arm.cache}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cfg, indent=1))
        out = self.caches[(arm.teachers[0], arm.cache)]
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, "-m", "services.cli", "cache", "build", str(path), "--out", str(out)]
        return Job(
            ckey, [cmd + ["--top-k", str(arm.cache)]], self.work / "logs" / f"{path.stem}.log"
        )

    # ----------------------------------------------------------------- rows

    def on_done(self, job: Job, code: int, wall: float, lane: str | None) -> bool:
        """Record a finished job: a cache as ready, a run as its row; a job that ran out of GPU
        memory beside other runs is given again, with a GPU of its own (returns True)."""
        self.in_flight.discard(job.key)
        self.busy.pop(job.key, None)
        shared = bool(self.args.gpus) and job.slots < self.args.runs_per_gpu
        if code not in (0, TIMED_OUT) and shared and not job.exclusive:
            if ran_out_of_gpu_memory(job):
                logger.warning(
                    "[scale] %s ran out of GPU memory beside other runs: it runs again with "
                    "a GPU of its own",
                    job.key,
                )
                self.alone.add(job.key)
                return True
        if job.key[0] == "cache":
            cache = self.caches[job.key[1:]]
            if code == 0:
                cache.with_suffix(".done").write_text("built\n")
                self.caches_ready.add(job.key[1:])
            else:  # its arms' runs fail at once: no row waits for a cache that never comes
                for key in self.plan().pending:
                    arm = scale_arms.parse_scale_arm(key.arm)
                    if (arm.teachers[:1], arm.cache) == (job.key[1:2], job.key[2]):
                        self.results[key] = None
            return False
        row = self.row(job.key, code, wall, lane)
        # each command's wall seconds (the training stages, then the scoring): with train_s,
        # where a run's time goes besides its steps (start-up, scoring)
        row["command_s"] = list(job.command_s)
        self.results[job.key] = row["validation_bpb"]
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.rows_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        print(_line(row), flush=True)
        return False

    def row(self, key: RunKey, code: int, wall: float, lane: str | None) -> dict:
        """The row of a finished run."""
        arm = scale_arms.parse_scale_arm(key.arm)
        cfgs = self.configs(key, arm)
        result_path = self.work / "scores" / f"{key.phase}_{self.run_dir(key).name}.result.json"
        res = json.loads(result_path.read_text()) if code == 0 and result_path.is_file() else {}
        stages = [
            kd.collect(key.arm, key.seed, Path(c["run_dir"]))
            for c in cfgs
            if (Path(c["run_dir"]) / "metrics").is_dir()
        ]
        curve, offset = [], 0
        for st in stages:  # a run's stages (one each now), one curve
            curve += [
                {"step": p["step"] + offset, "bits_per_byte": p["bits_per_byte"]}
                for p in st["val_curve"]
            ]
            offset += st["steps"]
        peer = (
            heal_peer.peer_result(self.args_of(key), key.seed, self.run_dir(key), key.lr)[0]
            if arm.peer
            else {}
        )
        final = res.get("final", {})
        heldout, fresh = final.get("heldout", {}), final.get("fresh", {})
        completion = heldout.get("completion") or {}
        row = {
            **self.meta,
            **self.budget(key),  # the run's own: the grid's for a grid run
            "phase": key.phase,
            "arm": key.arm,
            "family": arm.family,
            "teachers": list(arm.teachers),
            "seed": key.seed,
            "lr": key.lr,
            "kl_weight": key.kl_weight,
            "temperature": key.temperature,
            "tokens": peer.get("trained_tokens")
            if arm.peer
            else sum(st["tokens"] for st in stages),
            "steps": peer.get("steps_run") if arm.peer else sum(st["steps"] for st in stages),
            # TRL's worker makes no promise of bitwise-equal runs
            "deterministic": bool(cfgs)
            and all(c["trainer"]["compute"]["deterministic"] for c in cfgs),
            "exit": code,
            "wall_s": round(wall, 1),
            "lane": lane,
            "validation_bpb": res.get("validation", {}).get("bits_per_byte"),
            "heldout_bpb": heldout.get("bits_per_byte"),
            "fresh_bpb": fresh.get("bits_per_byte"),
            "next_line_em": fresh.get("nextline", {}).get("exact_match"),
            "next_line_em_heldout": heldout.get("nextline", {}).get("exact_match"),
            "completion_teacher_bpb": completion.get("bits_per_byte"),
            "completion": completion or None,
            "scorer": self.scorer if completion else None,
            "on_policy": arm.on_policy,
            "twin": scale_arms.twin_of(arm, self.specs),
            "lr_interior": self.plan().interior.get(key.arm),
            "weights_sha256": res.get("weights_sha256"),
            # trained on from a checkpoint of an earlier call (bitwise equality is shown for
            # runs trained in one go: the rerun check); a final run that reuses a grid run's
            # training says so too
            "resumed": any((Path(c["run_dir"]) / RESUMED_MARK).exists() for c in cfgs),
            # ran out of GPU memory beside other runs, then trained with the GPU to itself
            "gpu_alone": key in self.alone,
            "slots": slots_of(key.arm, self.args.slots),
            "val_curve": curve,
            "train_s": peer.get("wall_s")
            if arm.peer
            else round(sum(st["train_s"] for st in stages), 2),
            # of the stages' start-up: compile (None: eager) and the first step's wait for logits
            "compile_s": _stage_sum(stages, "compile_s"),
            "first_step_s": _stage_sum(stages, "first_step_s"),
            # each stage's start-up step: its calls' seconds and Inductor's cache lookups
            "start_up": [st.get("start_up") for st in stages] or None,
            **{
                field: {
                    k: max(
                        (v for st in stages if (v := (st.get(field) or {}).get(k)) is not None),
                        default=None,
                    )
                    for k in ("trainer", "teacher")
                }
                for field in ("peak_memory_mib", "peak_reserved_mib")
            },
            "scores": {s: _brief(v) for s, v in final.items()} or None,
        }
        if arm.peer:
            row["peer"] = peer  # TRL's version, its tokens/s, a non-finite step or an error
        if key.phase == "rerun":
            first = next(
                (r for r in heal.read_rows([self.rows_path]) if r.get("mode") == "scale"
                 and r["phase"] == "final" and scale_grid.row_key(r) == key._replace(phase="final")),
                None,
            )  # fmt: skip
            row["bitwise_equal"] = first is not None and all(
                first.get(k) == row[k] and row[k] is not None
                for k in ("weights_sha256", "validation_bpb", "heldout_bpb", "fresh_bpb")
            )
        return row

    def run(self) -> int:
        """Run the grid and the final runs; returns 1 if a run failed or an arm stalled."""
        a = self.args
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        lanes = gpu_lanes(a.gpus, a.runs_per_gpu, visible) if a.gpus else None
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        deadline = None if a.deadline_s is None else self.t_start + a.deadline_s
        Lanes(lanes or [None] * a.lanes, a.run_timeout_s, ROOT, env, stagger_s=a.stagger_s).run(
            self.next_jobs, self.on_done, deadline=deadline
        )
        p = self.plan()
        status = {
            "chosen": {k: v and dataclasses.asdict(v) for k, v in p.chosen.items()},
            "interior": p.interior,
            "stalled": p.stalled,
        }
        (self.out / "quality_scale_plan.json").write_text(json.dumps(status, indent=1))
        if p.pending:
            logger.warning("[scale] %d runs left for a later call (--deadline-s)", len(p.pending))
        failed = [k for k, v in self.results.items() if v is None]
        for arm in p.stalled:
            logger.error("[scale] %s: every run of a grid step failed; see %s/logs", arm, self.work)
        return 1 if failed or p.stalled else 0


def _brief(scores: dict) -> dict:
    """A split's scores without the bulky parts."""
    return {k: v for k, v in scores.items() if k not in ("completion",)}


def _stage_sum(stages: list[dict], key: str) -> float | None:
    """The stages' sum of ``key`` (None when no stage has it)."""
    values = [st[key] for st in stages if st.get(key) is not None]
    return round(sum(values), 2) if values else None


def _line(row: dict) -> str:
    keys = ("validation_bpb", "heldout_bpb", "fresh_bpb")
    figs = " ".join(f"{k} {row[k]:.4f}" for k in keys if row[k] is not None)
    head = f"{row['phase']:>6} {row['arm']:>36} s{row['seed']} lr {row['lr']:g}"
    return f"{head}: {figs or 'exit ' + str(row['exit'])}"


def main(argv: list[str] | None = None) -> int:
    """CLI: run the experiment, or ``--report`` its rows; bad settings: one line, exit 2."""
    args = parse_args(argv)
    # the rows say how they were made
    args.command = shlex.join(
        ["python", "benchmarks/quality/scale.py", *(sys.argv[1:] if argv is None else argv)]
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.out = args.out or (
        str(Path(args.work) / "out") if args.smoke else str(ROOT / "benchmarks" / "results")
    )
    if args.report:
        from benchmarks.quality import scale_report

        rows = heal.read_rows([Path(args.out) / ROWS_FILE])
        print(scale_report.write_report(rows, Path(args.out)))
        return 0
    try:
        args.aliases = heal.parse_aliases(args.model_alias)
        defaulted = not args.arms
        args.arms = args.arms or list(
            scale_arms.SMOKE_ARMS if args.smoke else scale_arms.SCALE_ARMS
        )
        for spec in args.arms:  # refused before anything loads
            scale_arms.parse_scale_arm(spec)
        resolve_trl(args, defaulted)
        if args.smoke:
            args.work = Path(args.work).resolve()
            smoke_setup(args)
        args.seeds = args.seeds or [0, 1, 2]
        args.lrs = args.lrs or [2.5e-4, 5e-4, 1e-3]
        args.student_tokenizer = heal.student_tokenizer(args.student, args.student_tokenizer)
        args.kl_weight, args.temperature, args.lr = args.kl_weights[0], args.temperatures[0], None
        if args.gpus:
            kd.gpu_names(args.gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
            args.device = "cuda"
        elif not args.smoke:
            args.device = "cpu"
        exp = Experiment(args)
        exp.prepare()
    except ValueError as e:
        print(f"scale: {e}", file=sys.stderr)
        return 2
    if args.plan:
        print("\n".join(exp.plan_lines()))
        return 0
    # a SIGTERM (a call's time limit, `timeout`) stops the running jobs as Ctrl-C does: each
    # gets SIGTERM (a run with checkpoints writes one) and no job outlives this process
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    return exp.run()


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
