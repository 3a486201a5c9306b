"""The TRL GOLD row of the healing experiment: the same pruned student and teacher trained by
TRL's ``GOLDTrainer`` (cross-tokenizer ULD, byte-offset alignment, CE + KD, off-policy) in
``benchmarks/peers/trl_gold_worker.py``, then scored like every other student.

Equal tokens: the same texts as xtoken's runs of the seed (the first ``steps x batch`` of the
train split in the seed's shuffled order, ``shuffled_texts``, which is what ``data.seed`` puts),
``batch`` texts per step for ``steps`` steps, one pass, each cut after ``ctx`` tokens of both
tokenizers (what xtoken's runs train); TRL orders them with its own sampler. Each text is a completion after TRL's prompt
``"Continue the text.\\n"`` (GOLD trains on prompt/completion pairs; the loss is on the
completion). The learning rate follows xtoken's schedule (the same warm-up steps, a cosine decay
to a tenth); TRL orders the texts with its own sampler, so the row is a reference point, not a
paired arm. A run whose loss or gradient norm turns non-finite is not scored: its row names the
step.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from pathlib import Path

logger = logging.getLogger("kd_quality.heal")

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "benchmarks" / "peers" / "trl_gold_worker.py"
PROMPT = "Continue the text.\n"
TRL_ARM = "trl-gold@qwen2.5-coder-0.5b"
LR_MIN_RATIO = 0.1  # the trainer's default floor of the cosine (OptimConfig.min_lr_ratio)
COMPARE_TO = "gold@qwen2.5-coder-0.5b"


def trl_python(given: str | None, what: str = "--peer-gold") -> str | None:
    """The python that imports trl and datasets: ``given`` (a path, or a command found on
    ``PATH`` such as ``python3``), else ``.venv-bench/bin/python`` where it exists; None (and one
    log line saying that ``what`` is skipped, naming the install and why the probe failed) where
    none does."""
    candidates = [given] if given else [str(ROOT / ".venv-bench" / "bin" / "python")]
    why = "not found"
    for name in candidates:
        py = shutil.which(name)  # a path is checked as given, a bare name looked up on PATH
        if py is None:
            continue
        probe = subprocess.run(
            [py, "-c", "import trl, datasets"], capture_output=True, text=True, check=False
        )
        if probe.returncode == 0:
            return py
        lines = probe.stderr.strip().splitlines()
        why = lines[-1] if lines else f"exit {probe.returncode}"
    logger.warning(
        "[heal] %s skipped: trl is not importable by %s (%s; ./scripts/setup.sh test "
        "peers, or --trl-python PY)",
        what,
        candidates[0],
        why,
    )
    return None


def cut_to_tokens(text: str, tokenizers, ctx: int) -> str:
    """``text`` cut after its first ``ctx`` tokens on every side (at a token's byte end), so
    that TRL truncates nothing and trains the tokens xtoken's ``ctx_student`` / ``ctx_teacher``
    keep."""
    raw = text.encode("utf-8")
    end = len(raw)
    for tok in tokenizers:
        spans = tok.encode(text, add_special_tokens=False).spans
        if len(spans) > ctx:
            end = min(end, int(spans[ctx - 1][1]))
    return raw[:end].decode("utf-8", errors="ignore")


def peer_job(
    args,
    seed: int,
    student_dir: Path,
    teacher_dir: Path,
    teacher_tokenizer: str,
    python: str,
    *,
    work: Path | None = None,
    lr: float | None = None,
    device: str | None = None,
) -> list[str]:
    """Write the worker's data and spec for one seed; returns its command line.

    Args:
        args: the run's settings (``corpus``, ``limit``, ``steps``, ``batch``, ``ctx``,
            ``warmup``, ``student_tokenizer``; ``lr``, ``device`` and ``work`` unless given).
        seed: the data order.
        student_dir: the pruned student's folder (an HF model and tokenizer).
        teacher_dir: the teacher's folder (an HF model and tokenizer, ``export_hf``).
        teacher_tokenizer: its xtoken tokenizer (the texts are cut to ``ctx`` tokens of both).
        python: the python that imports trl.
        work: the run's folder (default ``args.work / "trl" / "s<seed>"``).
        lr: the peak learning rate (default ``args.lr``).
        device: ``cuda`` or ``cpu`` (default from ``args.device``).

    Returns:
        ``[python, worker, spec, result]``.
    """
    from xtoken_core.data.corpus import iter_texts, shuffled_texts
    from xtoken_core.tokenizers import load_tokenizer

    work = peer_dir(args, seed) if work is None else work
    work.mkdir(parents=True, exist_ok=True)
    texts = shuffled_texts(iter_texts(args.corpus / "train.jsonl"), seed, args.limit)
    n = args.steps * args.batch
    toks = [load_tokenizer(args.student_tokenizer), load_tokenizer(teacher_tokenizer)]
    with open(work / "data.jsonl", "w", encoding="utf-8") as f:
        for _, text in texts[:n]:
            completion = cut_to_tokens(text, toks, args.ctx)
            f.write(json.dumps({"prompt": PROMPT, "completion": completion}) + "\n")
    spec = {
        "student": str(student_dir),
        "teacher": str(teacher_dir),
        "student_tokenizer": str(student_dir),
        "teacher_tokenizer": str(teacher_dir),
        "data": str(work / "data.jsonl"),
        "max_length": args.ctx + 16,
        "steps": args.steps,
        "warmup": 0,
        "batch": args.batch,
        "lr": args.lr if lr is None else lr,
        "lr_warmup_steps": args.warmup,
        "lr_min_ratio": LR_MIN_RATIO,
        "device": device or ("cuda" if args.device.startswith("cuda") else "cpu"),
        "save": str(work / "final"),
        "output_dir": str(work / "trl_out"),
        "extended_uld": True,
    }
    (work / "spec.json").write_text(json.dumps(spec, indent=1))
    (work / "result.json").unlink(missing_ok=True)
    return [python, str(WORKER), str(work / "spec.json"), str(work / "result.json")]


def peer_dir(args, seed: int) -> Path:
    """The healing experiment's folder of a seed's TRL run."""
    return args.work / "trl" / f"s{seed}"


def peer_result(
    args, seed: int, work: Path | None = None, lr: float | None = None
) -> tuple[dict, Path | None]:
    """The worker's result for a seed and the trained student's folder (None on an error);
    ``work`` and ``lr`` as :func:`peer_job` took them."""
    work = peer_dir(args, seed) if work is None else work
    lr = args.lr if lr is None else lr
    path = work / "result.json"
    if not path.is_file():
        return {"error": "the worker wrote no result (see its log)"}, None
    res = json.loads(path.read_text())
    keep = ("trl_version", "steps_run", "step_s", "tokens_per_s", "trained_tokens", "wall_s",
            "lr_schedule", "first_nonfinite_step")  # fmt: skip
    out = {k: res.get(k) for k in keep if k in res}
    if res.get("error"):
        return {**out, "error": res["error"]}, None
    bad = res.get("first_nonfinite_step")
    if bad is not None:
        return {
            **out,
            "error": f"TRL GOLD's loss or gradient norm was not finite from step {bad} of "
            f"{res.get('steps_run')} (lr {lr}): its weights are not scored",
        }, None
    return out, work / "final"
