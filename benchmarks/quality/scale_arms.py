"""The arms of the scaled healing experiment: their specs, families and twins, the token budget
as steps, and the ``xtoken run`` configs of one arm at one setting and seed.

An arm spec is ``ce`` or ``BASE@TEACHER[+TEACHER2][:key=value,...]``: the healing experiment's
spec (``heal.parse_heal_arm``: loss keys, ``on_policy``, ``agree``, ``lr``) with a second teacher
of another tokenizer family after ``+`` (``extra_teachers``, the two weighted 1/2 each) and these
keys of its own:

* ``topk=K``: the teacher sends its top-K log-probs per token (``teacher.transport: topk``);
* ``cache`` or ``cache=K``: the teacher's top-K targets come from a teacher cache built once
  (``xtoken cache build``, K = 64 when not given) and no teacher process runs;
* ``start=S`` (on-policy arms): the share of the budget trained off-policy first (default 0.5),
  in the same run (``trainer.on_policy.start_step``): one optimizer and one warm-up and cosine
  schedule over the whole budget, the on-policy share taken from that step on.

``trl-gold@TEACHER[:lr=X]`` is TRL's ``GOLDTrainer`` (``heal_peer``: its worker in its own
venv) distilling the same student from the same teacher over the same texts, tuned on the same
learning-rate grid (its loss settings are TRL's); its twin is ``gold@TEACHER``.

An arm's **family** is its spec without the keys of a variant (``topk``, ``cache``,
``on_policy``, ``start``) or of a tuned setting (``lr``, ``kl_weight``, ``temperature``): the
KL weight and temperature are chosen once per family, on its plain arm. An arm's **twin** is the
arm it is judged against: a cache arm's is the online top-K arm of the same K (else the plain
arm), a top-K or on-policy arm's the plain arm of its family.

Every P-KL arm runs over every teacher column (``trainer.loss.vocab_topk: null``, unless its spec
sets it): top-K targets need it (a column subset picked by the largest logit sees only the sent
ids, which moves P-KL's gradient by ~40% against the full logits, 1.8% over every column:
``benchmarks/results/teachers_topk.md``), and the plain arms take it too, so that a top-K or cache
arm differs from its twin in the targets alone.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
from pathlib import Path
from typing import Any

from benchmarks.quality import heal

SCALE_ARMS = (
    "ce",
    "pkl@smollm2",  # the parent: same tokenizer, the upper reference
    "pkl@qwen2.5-coder-0.5b",
    "gold@qwen2.5-coder-0.5b",
    "xtoken@qwen2.5-coder-0.5b",
    "pkl@gemma3-270m",
    "gold@gemma3-270m",
    "xtoken@gemma3-270m",
    "pkl@qwen2.5-coder-0.5b+gemma3-270m",
    "pkl@qwen2.5-coder-0.5b:topk=64",
    "pkl@qwen2.5-coder-0.5b:topk=32",
    "pkl@qwen2.5-coder-0.5b:cache=64",
    "pkl@qwen2.5-coder-0.5b:on_policy=0.25",
    "pkl@qwen2.5-coder-0.5b:on_policy=0.5",
    "trl-gold@qwen2.5-coder-0.5b",  # left out, with one line, where trl is not installed
)
SMOKE_ARMS = ("ce", "pkl@smollm2")
VARIANT_KEYS = ("topk", "cache", "start", "on_policy")
SETTING_KEYS = ("lr", "kl_weight", "temperature")
DEFAULT_CACHE_K = 64


@dataclasses.dataclass(frozen=True)
class ScaleArm:
    """One arm: its spec, the healing arm of its first teacher (loss, overrides, on-policy share,
    learning rate), all its teachers, its variant keys and its family."""

    spec: str
    heal: heal.HealArm
    teachers: tuple[str, ...]
    topk: int | None = None
    cache: int | None = None
    start: float = 0.5
    family: str = "ce"
    peer: bool = False

    @property
    def is_ce(self) -> bool:
        """No teacher: CE only."""
        return not self.teachers

    @property
    def tunes_kd(self) -> bool:
        """Its KL weight and temperature are chosen on the grid (an xtoken KD arm)."""
        return not self.is_ce and not self.peer

    @property
    def on_policy(self) -> float:
        """The share of each on-policy step the student writes (0: off-policy)."""
        return self.heal.on_policy

    @property
    def pinned(self) -> dict[str, float]:
        """The settings the spec fixes (``lr``, ``kl_weight``, ``temperature``): not tuned."""
        out = {k: self.heal.overrides[k] for k in SETTING_KEYS[1:] if k in self.heal.overrides}
        if self.heal.lr is not None:
            out["lr"] = self.heal.lr
        return out


def parse_scale_arm(spec: str) -> ScaleArm:
    """An arm spec (see the module docstring) as a :class:`ScaleArm`.

    Args:
        spec: e.g. ``"ce"``, ``"gold@qwen2.5-coder-0.5b"``, ``"pkl@qwen2.5-coder-0.5b+gemma3-270m"``,
            ``"pkl@qwen2.5-coder-0.5b:topk=32"``, ``"pkl@qwen2.5-coder-0.5b:cache"``,
            ``"pkl@qwen2.5-coder-0.5b:on_policy=0.25,start=0.5"``.

    Returns:
        The arm.

    Raises:
        ValueError: an unknown base or teacher, two teachers of one tokenizer, a bad value, or a
            combination no run accepts (names the spec and the fix).
    """
    head, colon, extra = spec.partition(":")
    pairs = [p for p in extra.split(",") if p] if colon else []
    if head.partition("@")[0] == PEER_BASE:
        return _parse_peer_arm(spec, head, pairs)
    own = {p.partition("=")[0]: p.partition("=")[2] for p in pairs if _key(p) in VARIANT_KEYS[:3]}
    rest = [p for p in pairs if _key(p) not in VARIANT_KEYS[:3]]
    base, at, names = head.partition("@")
    teachers = tuple(names.split("+")) if at else ()
    if any(not t for t in teachers):
        raise ValueError(f"arm {spec!r}: an empty teacher name; write BASE@T1+T2")
    heal_spec = f"{base}@{teachers[0]}" if teachers else base
    heal_arm = heal.parse_heal_arm(heal_spec + (":" + ",".join(rest) if rest else ""))
    if heal_arm.base == "ce":
        if own:
            raise ValueError(f"arm {spec!r}: the CE arm has no teacher to take {sorted(own)} from")
        return ScaleArm(spec, heal_arm, (), family="ce")
    tokenizers = [heal.teacher_tokenizer(t) for t in teachers]
    if len(set(tokenizers)) < len(tokenizers):
        raise ValueError(
            f"arm {spec!r}: teachers {list(teachers)} share a tokenizer ({tokenizers}); each "
            "further teacher must be of a tokenizer family of its own"
        )
    topk = _positive_int(spec, "topk", own["topk"]) if "topk" in own else None
    cache = None
    if "cache" in own:
        cache = _positive_int(spec, "cache", own["cache"]) if own["cache"] else DEFAULT_CACHE_K
    start = 0.5
    if "start" in own:
        try:
            start = float(own["start"])
        except ValueError:
            start = math.nan
        if not 0.0 < start < 1.0:
            raise ValueError(f"arm {spec!r}: start={own['start']} must be a share in (0, 1)")
        if not heal_arm.on_policy:
            raise ValueError(f"arm {spec!r}: start= is the off-policy start of an on_policy arm")
    if topk and cache:
        raise ValueError(f"arm {spec!r}: a cache carries its own K; give topk= or cache=, not both")
    if cache and (heal_arm.on_policy or len(teachers) > 1):
        raise ValueError(
            f"arm {spec!r}: a teacher cache serves one teacher off-policy; drop cache= or "
            "the on_policy / second teacher"
        )
    if heal_arm.on_policy == 1.0:
        raise ValueError(
            f"arm {spec!r}: on_policy=1 runs no collator, so no off-policy start; use a share "
            "below 1"
        )
    if heal_arm.on_policy and len(teachers) > 1:
        raise ValueError(
            f"arm {spec!r}: on-policy samples are scored by one teacher; drop on_policy or the "
            "second teacher"
        )
    return ScaleArm(spec, heal_arm, teachers, topk, cache, start, family_of(spec))


#: the arm of TRL's GOLD trainer (``heal_peer``)
PEER_BASE = "trl-gold"


def _parse_peer_arm(spec: str, head: str, pairs: list[str]) -> ScaleArm:
    """``trl-gold@TEACHER[:lr=X]``: one teacher, no key but ``lr``."""
    teacher = head.partition("@")[2]
    if not teacher or "+" in teacher:
        raise ValueError(f"arm {spec!r}: TRL's GOLD trainer takes one teacher: trl-gold@TEACHER")
    heal.teacher_tokenizer(teacher)  # a known teacher (names them)
    bad = [p for p in pairs if _key(p) != "lr"]
    if bad:
        raise ValueError(
            f"arm {spec!r}: TRL's GOLD arm takes only lr=VALUE (its loss settings are TRL's), "
            f"not {bad}"
        )
    lr = heal._arm_lr(spec, pairs[-1]) if pairs else None
    heal_arm = heal.HealArm(spec, PEER_BASE, teacher, {}, lr=lr)
    return ScaleArm(spec, heal_arm, (teacher,), family=head, peer=True)


def _key(pair: str) -> str:
    return pair.partition("=")[0]


def _positive_int(spec: str, key: str, value: str) -> int:
    try:
        k = int(value)
    except ValueError:
        k = 0
    if k < 1:
        raise ValueError(f"arm {spec!r}: {key}={value} must be a whole number >= 1, e.g. {key}=64")
    return k


def family_of(spec: str) -> str:
    """An arm spec without its variant and tuned-setting keys (``ce`` for CE arms)."""
    head, _, extra = spec.partition(":")
    if head.partition("@")[0] == "ce":
        return "ce"
    keep = [p for p in extra.split(",") if p and _key(p) not in VARIANT_KEYS + SETTING_KEYS]
    return head + (":" + ",".join(sorted(keep)) if keep else "")


def twin_of(arm: ScaleArm, specs: list[str]) -> str | None:
    """The arm ``arm`` is judged against, among ``specs`` (None: it has none there)."""
    if arm.peer:
        gold = f"gold@{arm.teachers[0]}"
        for s in specs:
            other = parse_scale_arm(s)
            if other.family == gold and not (other.topk or other.cache or other.on_policy):
                return s
        return None
    if arm.is_ce or not (arm.topk or arm.cache or arm.on_policy):
        return None
    if arm.cache:
        for s in specs:
            other = parse_scale_arm(s)
            if other.family == arm.family and other.topk == arm.cache and not other.on_policy:
                return s
    for s in specs:
        other = parse_scale_arm(s)
        plain = not (other.topk or other.cache or other.on_policy)
        if other.family == arm.family and plain and other.spec != arm.spec:
            return s
    return None


# --------------------------------------------------------------------------- budget


def mean_sample_tokens(texts: list[str], tokenizer, ctx: int) -> float:
    """The mean student tokens of one sample: each text's tokens, at most ``ctx``.

    Args:
        texts: training texts (a sample of them is enough).
        tokenizer: the student's XTokenizer.
        ctx: the context (tokens per sample at most).

    Returns:
        The mean (>= 1).
    """
    if not texts:
        return float(ctx)
    lengths = [min(ctx, len(e.ids)) for e in tokenizer.encode_batch(texts)]
    return max(1.0, sum(lengths) / len(lengths))


def steps_for(tokens: int, batch: int, sample_tokens: float) -> int:
    """Optimizer steps that train ``tokens`` student tokens at ``batch`` samples a step.

    Args:
        tokens: the budget (student tokens, padding not counted).
        batch: samples per step (the micro-batch; one micro-batch a step).
        sample_tokens: mean tokens of one sample (:func:`mean_sample_tokens`).

    Returns:
        ``ceil(tokens / (batch * sample_tokens))``.

    Raises:
        ValueError: the budget is below one step (names the least budget).
    """
    per_step = batch * sample_tokens
    if tokens < per_step:
        raise ValueError(
            f"--tokens {tokens}: below one step ({batch} samples x {sample_tokens:.0f} tokens = "
            f"{per_step:.0f} tokens); give --tokens {math.ceil(per_step)} or more"
        )
    return math.ceil(tokens / per_step)


# --------------------------------------------------------------------------- run configs


@dataclasses.dataclass(frozen=True)
class Setting:
    """The tuned values of one run: peak learning rate, KL weight and temperature (None for a
    CE arm's KL weight and temperature)."""

    lr: float
    kl_weight: float | None = None
    temperature: float | None = None


def run_configs(
    arm: ScaleArm,
    seed: int,
    setting: Setting,
    args: argparse.Namespace,
    student_dir: Path,
    projections: dict[str, Path],
    run_dir: Path,
    caches: dict[tuple[str, int], Path],
) -> list[dict[str, Any]]:
    """The ``xtoken run`` configs of one arm, setting and seed, in the order they run (one: an
    on-policy arm's off-policy start is the first ``trainer.on_policy.start_step`` steps of its
    run).

    Every off-policy run is bitwise-reproducible (``trainer.compute.deterministic``, with
    ``data.ordered`` and one collator worker); an on-policy run cannot be (the rollout workers'
    samples come in no fixed order; the trainer refuses the pair).

    Args:
        arm: the arm.
        seed: data order and trainer seed.
        setting: lr, KL weight, temperature.
        args: the healing run's values (``heal.run_config``'s, with ``steps`` the budget's).
        student_dir: the pruned student's folder.
        projections: the projection file of each teacher tokenizer.
        run_dir: where the run goes.
        caches: the teacher cache folder of each (teacher, K).

    Returns:
        The configs.
    """
    a = copy.copy(args)
    a.lr = setting.lr
    if setting.kl_weight is not None:
        a.kl_weight = setting.kl_weight
    if setting.temperature is not None:
        a.temperature = setting.temperature
    first = arm.teachers[0] if arm.teachers else None
    proj = projections.get(heal.teacher_tokenizer(first)) if first else None
    cfg = _stage(arm, arm.heal, seed, a, student_dir, proj, run_dir, projections, caches)
    if arm.on_policy:
        start_step = max(1, round(args.steps * arm.start))
        cfg["trainer"].setdefault("on_policy", {})["start_step"] = start_step
    return [cfg]


def _stage(arm, heal_arm, seed, args, student_dir, proj, run_dir, projections, caches) -> dict:
    cfg = heal.run_config(heal_arm, seed, args, student_dir, proj)
    cfg["run_dir"] = str(run_dir)
    trainer = cfg["trainer"]
    if heal_arm.base == "pkl" and "vocab_topk" not in heal_arm.overrides:
        trainer["loss"]["vocab_topk"] = None  # every column in every P-KL arm (module docstring)
    trainer["compute"]["deterministic"] = not heal_arm.on_policy
    trainer["schedule"]["epochs"] = args.epochs
    if getattr(args, "compile", "auto") != "auto":  # scale.py --compile
        trainer["compute"]["compile"] = args.compile == "on"
    if getattr(args, "length_multiple", 1) > 1:  # scale.py --length-multiple
        trainer["compute"]["length_multiple"] = args.length_multiple
    if getattr(args, "warm_shortest", None):  # scale.py --warm-shortest
        trainer["compute"]["warm_shortest"] = args.warm_shortest
    if getattr(args, "checkpoint_every", 0):  # a run a later call can go on with (scale.py)
        trainer["schedule"].update(checkpoint_every=args.checkpoint_every, final_checkpoint=True)
    if len(arm.teachers) > 1:
        weight = 1.0 / len(arm.teachers)
        cfg["teacher"]["weight"] = weight
        cfg["extra_teachers"] = [
            {
                "model": heal.resolve(t, args.aliases),
                "tokenizer": heal.teacher_tokenizer(t),
                "projection": str(projections[heal.teacher_tokenizer(t)]),
                "weight": weight,
            }
            for t in arm.teachers[1:]
        ]
    if arm.topk:
        cfg["teacher"].update(transport="topk", top_k=arm.topk)
    if arm.cache:
        cfg["teacher"].update(transport="topk", top_k=arm.cache)
        cfg["data"]["teacher_cache"] = str(caches[(arm.teachers[0], arm.cache)])
    return cfg


def cache_build_config(
    arm: ScaleArm, args: argparse.Namespace, student_dir: Path, projections: dict[str, Path]
) -> dict[str, Any]:
    """The run config a teacher cache of a cache arm is built from (``xtoken cache build``): the
    arm's own, so that the cache matches the teacher, tokenizer, context and K its runs ask for.

    Args:
        arm: a cache arm.
        args: as for :func:`run_configs`.
        student_dir: the student's folder.
        projections: the projection file of each teacher tokenizer.

    Returns:
        The config.
    """
    plain = dataclasses.replace(arm, cache=None, topk=arm.cache)
    proj = projections.get(heal.teacher_tokenizer(arm.teachers[0]))
    run_dir = Path(args.work) / "cache_build_run"
    cfg = _stage(plain, plain.heal, 0, args, student_dir, proj, run_dir, projections, {})
    cfg["trainer"]["compute"]["deterministic"] = False
    del cfg["trainer"]["optim"]  # nothing is trained: no learning rate to name
    return cfg
