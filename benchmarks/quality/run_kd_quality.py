"""Does cross-tokenizer KD make a small student better, per loss mode?

A random-init ~27 M student (Llama shape, Mistral v3 SentencePiece tokenizer, 32,768 ids) is
trained on the demo corpus by ``xtoken run`` (queue, collator, teacher and trainer as real
processes; ``cuda_ipc`` logit hand-off on a GPU) with the real SmolLM2-135M teacher (``smollm2``,
byte-level BPE, 49,152 ids), in four arms at equal steps, batch and context: ``ce`` (student CE
only, no teacher), ``pkl`` (CE + projected KL), ``gold`` (CE + gold) and ``xtoken`` (CE + relaxed
gold); each arm with every seed. One seed = one student initialisation shared by all arms (a
paired comparison) and the trainer's seed.

Why Mistral and not Qwen3 for the student: with Qwen3's 151,669 ids a 256-wide student spends
39 M of its 45 M parameters on the (tied) embedding, and its output softmax over 151 k ids costs
more than its 6 transformer layers; at ~25 M parameters it would be mostly a lookup table.
Mistral's 32,768 ids at width 384 are 12.6 M of 26.7 M, leaving 14.2 M for 8 layers, and
SentencePiece (Mistral) vs byte-level BPE (SmolLM2) is a genuinely cross-family pair.

Data: the demo corpus (``build_demo_corpus``: paragraphs of Python's own stdlib sources, chunked
into 1-4 kB texts) re-split BY SOURCE FILE (the SHA-1 of the file's path decides): held-out
(~6% of files; the final numbers), validation (~6%; the trainer's curves and anything one may
tune) and train (the rest). The split is built once on the machine that runs the script here and
carried to the GPU with ``--corpus`` (the GPU has another stdlib), so both see the same texts.

Byte categories of the held-out report (every UTF-8 byte of a text gets exactly one, first
match wins):

* ``whitespace``: space, tab, newline, CR, FF, VT;
* ``digits``: ASCII 0-9;
* ``prose``: any other byte inside a comment (``#`` to the end of the line) or a string literal
  (docstrings included), found by a small lexer (triple quotes span lines; single quotes end at
  the matching quote or the end of the line). It is lexical, not a parser: a text that starts
  inside a multi-line string is read as code until the next quote;
* ``code``: every other byte (identifiers, keywords, operators, brackets).

A token's bits (-log2 p of the token) are spread evenly over the bytes of its span; a token with
an empty span gives its bits to the byte where it starts. Bits/byte of a category = its bits over
its bytes; the categories add up to the overall figure (= ``xtoken_core.models.eval``'s).
Next-token accuracy = share of held-out tokens that are the student's argmax.

Usage (GPU, what produced ``benchmarks/results/quality.md``)::

    python benchmarks/quality/run_kd_quality.py --device cuda --corpus DIR --out $OUT \\
        --arms ce pkl gold xtoken --seeds 0 1 2 --parallel 6 --teacher-eval
    python benchmarks/quality/run_kd_quality.py --report ROWS.jsonl [ROWS.jsonl ...]

Ablations (the "find out why" of a missed bar): an arm may carry loss overrides,
``ARM:key=value[,key=value]`` (keys of ``CrossTokenizerLossConfig``), e.g. ``gold:uncommon_topk=1``
or ``pkl:kl_weight=0.3,temperature=2``. Choices are made on the validation split only:
``--score-split val`` scores every finished student on the whole validation split (rows carry
``validation`` instead of ``heldout``) and the report gives them their own table::

    python benchmarks/quality/run_kd_quality.py --device cuda --corpus DIR --out $OUT \
        --arms ce pkl gold gold:uncommon_topk=1 pkl:kl_weight=0.3 --seeds 0 --score-split val

CPU smoke (tiny student, tiny random teacher, 6 steps, one seed; ~4 min on 2 busy cores;
``tests/benchmarks/test_run_kd_quality.py``, marker ``slow``)::

    python benchmarks/quality/run_kd_quality.py --smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks._common import RESULTS_DIR, commit, device_name  # noqa: E402

logger = logging.getLogger("kd_quality")

ARMS = ("ce", "pkl", "gold", "xtoken")
ARM_LABEL = {
    "ce": "CE only",
    "pkl": "CE + P-KL",
    "gold": "CE + gold",
    "xtoken": "CE + relaxed gold (xtoken)",
}
CATEGORIES = ("prose", "code", "digits", "whitespace")
#: what a finished student is scored on (``--score-split``): the row key and the corpus file
SCORE_SPLITS = {"heldout": "heldout.jsonl", "val": "val.jsonl"}
SPLITS = ("train", "val", "heldout")
STUDENT_TOKENIZER = "mistral"


def parse_arm(spec: str) -> tuple[str, dict[str, Any]]:
    """An arm spec ``ARM`` or ``ARM:key=value[,key=value]`` as (base arm, loss overrides).

    Values are read as JSON where they parse (numbers, true/false, null), else kept as text.

    Raises:
        ValueError: an unknown base arm, a CE arm with overrides, a malformed pair, or a key
            that is no field of ``CrossTokenizerLossConfig``.
    """
    from xtoken_core.losses import CrossTokenizerLossConfig

    base, _, rest = spec.partition(":")
    if base not in ARMS:
        raise ValueError(f"arm {spec!r}: {base!r} is not one of {ARMS}")
    overrides: dict[str, Any] = {}
    if rest:
        if base == "ce":
            raise ValueError(f"arm {spec!r}: the CE arm has no KD loss to override")
        fields = {f.name for f in dataclasses.fields(CrossTokenizerLossConfig) if f.init}
        for pair in rest.split(","):
            key, eq, value = pair.partition("=")
            if not eq or key not in fields or key in ("mode", "projection"):
                raise ValueError(
                    f"arm {spec!r}: {pair!r} must be key=value with a key of "
                    f"CrossTokenizerLossConfig other than mode/projection"
                )
            try:
                overrides[key] = json.loads(value)
            except json.JSONDecodeError:
                overrides[key] = value
    return base, overrides


def arm_slug(spec: str) -> str:
    """A file-name-safe form of an arm spec (run dirs, configs, logs)."""
    return re.sub(r"[^A-Za-z0-9_.=-]+", "-", spec.replace(":", "@"))


def arm_label(spec: str) -> str:
    """The table label of an arm spec."""
    base, overrides = parse_arm(spec)
    extra = ", ".join(f"{k}={v}" for k, v in overrides.items())
    return ARM_LABEL[base] + (f" ({extra})" if extra else "")


# --------------------------------------------------------------------------- corpus split


def split_of(source: str, heldout: float, val: float) -> str:
    """The split of a source file: the SHA-1 of its path as a number in [0, 1).

    Args:
        source: the file's path as recorded in the demo corpus.
        heldout: share of files held out.
        val: share of files for validation.

    Returns:
        ``heldout``, ``val`` or ``train``.
    """
    h = int.from_bytes(hashlib.sha1(source.encode("utf-8")).digest()[:8], "big") / 2**64
    if h < heldout:
        return "heldout"
    if h < heldout + val:
        return "val"
    return "train"


def split_digest(corpus: Path) -> str:
    """A fingerprint of a split's training and validation texts (SHA-256 of ``train.jsonl`` and
    ``val.jsonl``, 16 hex digits): rows of one experiment name it, so that runs on a split built
    from other texts (another stdlib, another corpus builder) are never counted with them. The
    held-out texts are the rest of the same source files, and the fresh split has its commit.

    Args:
        corpus: the split's folder.

    Returns:
        The fingerprint.
    """
    digest = hashlib.sha256()
    for name in ("train.jsonl", "val.jsonl"):
        digest.update(name.encode() + b"\0")
        with open(corpus / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def build_split(
    out_dir: Path, heldout: float = 0.06, val: float = 0.06, fresh_rev: str = "HEAD"
) -> dict[str, Any]:
    """Re-split the demo corpus by source file into train / val / heldout JSONL files, and write
    the fresh split (``heal_eval.build_fresh``: this repository's sources at ``fresh_rev``).

    Args:
        out_dir: where ``train.jsonl``, ``val.jsonl``, ``heldout.jsonl``, ``fresh.jsonl`` and
            ``split.json`` (the manifest, the fresh split's commit included) go.
        heldout: share of files held out (final report).
        val: share of files for validation (curves, tuning).
        fresh_rev: the commit whose sources are the fresh split (an experiment spread over
            several checkouts names one, so that every call scores the same texts).

    Returns:
        The split's manifest (texts, files and characters per split).
    """
    from benchmarks.quality.heal_eval import build_fresh
    from xtoken_core.data.corpus import build_demo_corpus

    out_dir.mkdir(parents=True, exist_ok=True)
    fresh = build_fresh(out_dir / "fresh.jsonl", ROOT, fresh_rev)  # a wrong commit fails first
    demo = build_demo_corpus()
    files = {s: open(out_dir / f"{s}.jsonl", "w", encoding="utf-8") for s in SPLITS}
    stats = {s: {"texts": 0, "chars": 0, "files": set()} for s in SPLITS}
    try:
        for path in (demo.train_path, demo.heldout_path):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    rec = json.loads(line)
                    s = split_of(rec["source"], heldout, val)
                    files[s].write(line)
                    stats[s]["texts"] += 1
                    stats[s]["chars"] += len(rec["text"])
                    stats[s]["files"].add(rec["source"])
    finally:
        for f in files.values():
            f.close()
    manifest = {
        "python": sys.version.split()[0],
        "heldout_fraction": heldout,
        "val_fraction": val,
        **{
            s: {k: (len(v) if k == "files" else v) for k, v in st.items()}
            for s, st in stats.items()
        },
    }
    manifest["fresh"] = fresh
    (out_dir / "split.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def read_jsonl_texts(path: Path, limit: int | None = None) -> list[str]:
    """Texts of a JSONL corpus file (field ``text``), the first ``limit`` of them."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line)["text"])
                if limit and len(out) >= limit:
                    break
    return out


# --------------------------------------------------------------------------- byte categories


def byte_categories(text: str):
    """The category (index into :data:`CATEGORIES`) of every UTF-8 byte of ``text``.

    Args:
        text: a text.

    Returns:
        uint8 numpy array, one entry per byte of ``text.encode("utf-8")``.
    """
    import numpy as np

    PROSE, CODE, DIGITS, WS = range(4)
    n = len(text)
    cat = [CODE] * n
    i = 0
    while i < n:
        c = text[i]
        if c == "#":
            j = text.find("\n", i)
            j = n if j < 0 else j
            cat[i:j] = [PROSE] * (j - i)
            i = j
        elif c in "\"'":
            if text.startswith(c * 3, i):
                j = text.find(c * 3, i + 3)
                j = n if j < 0 else j + 3
            else:
                j = i + 1
                while j < n and text[j] != c and text[j] != "\n":
                    j += 2 if text[j] == "\\" else 1
                j = min(n, j + 1)
            cat[i:j] = [PROSE] * (j - i)
            i = j
        else:
            i += 1
    for k, ch in enumerate(text):
        if ch in " \t\n\r\f\v":
            cat[k] = WS
        elif "0" <= ch <= "9":
            cat[k] = DIGITS
    widths = [len(ch.encode("utf-8")) for ch in text]
    return np.repeat(np.asarray(cat, dtype=np.uint8), widths)


# --------------------------------------------------------------------------- held-out scoring


def score(
    model,
    tokenizer,
    texts: list[str],
    *,
    ctx: int,
    device,
    batch: int = 16,
    sources: list[str] | None = None,
) -> dict:
    """Held-out bits/byte overall and per byte category, and next-token accuracy.

    Windows as ``xtoken_core.models.eval.bits_per_byte``: each text tokenized without special
    tokens, cut into windows of ``ctx`` tokens, each fed as ``[BOS] + window[:-1]``.

    Args:
        model: a causal LM on ``device``.
        tokenizer: its XTokenizer.
        texts: held-out texts.
        ctx: window length in tokens.
        device: the model's device.
        batch: windows per forward.
        sources: the texts' source files: the categories are then ``heal_eval.HEAL_CATEGORIES``
            (``codec_tables`` first); None: :data:`CATEGORIES`.

    Returns:
        ``{"bits_per_byte", "accuracy", "tokens", "bytes", "per_category": {cat: {"bits_per_byte",
        "bytes"}}}``.
    """
    import numpy as np
    import torch

    from xtoken_core.models.heads import split_lm_head

    start = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
    encs = tokenizer.encode_batch(texts, add_special_tokens=False)
    windows = []  # (text index, first token index, inputs, targets)
    for t, enc in enumerate(encs):
        ids = enc.ids.tolist()
        for a in range(0, len(ids), ctx):
            tgt = ids[a : a + ctx]
            windows.append((t, a, [start] + tgt[:-1], tgt))
    windows.sort(key=lambda w: -len(w[2]))
    nats = [np.zeros(len(e.ids), dtype=np.float64) for e in encs]
    hits = [np.zeros(len(e.ids), dtype=bool) for e in encs]
    backbone, head = split_lm_head(model)
    was = model.training
    model.eval()
    dev = torch.device(device)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if dev.type == "cuda"
        else torch.autocast("cpu", enabled=False)
    )
    try:
        with torch.inference_mode(), autocast:
            for b in range(0, len(windows), batch):
                chunk = windows[b : b + batch]
                L = len(chunk[0][2])
                inp = torch.zeros(len(chunk), L, dtype=torch.long)
                tgt = torch.zeros(len(chunk), L, dtype=torch.long)
                mask = torch.zeros(len(chunk), L, dtype=torch.long)
                for i, (_, _, x, y) in enumerate(chunk):
                    inp[i, : len(x)] = torch.tensor(x)
                    tgt[i, : len(y)] = torch.tensor(y)
                    mask[i, : len(x)] = 1
                hidden = backbone(inp.to(dev), mask.to(dev))
                logits = head(hidden).float()
                lse = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(-1, tgt.to(dev)[..., None])[..., 0]
                nll = (lse - picked).cpu().double().numpy()
                hit = (logits.argmax(-1).cpu() == tgt).numpy()
                for i, (t, a, x, _) in enumerate(chunk):
                    nats[t][a : a + len(x)] = nll[i, : len(x)]
                    hits[t][a : a + len(x)] = hit[i, : len(x)]
    finally:
        model.train(was)
    names = CATEGORIES
    if sources is not None:
        from benchmarks.quality.heal_eval import HEAL_CATEGORIES, heal_categories

        names = HEAL_CATEGORIES
    cat_bits = np.zeros(len(names))
    cat_bytes = np.zeros(len(names), dtype=np.int64)
    total_bits, covered, tokens, correct = 0.0, 0, 0, 0
    for k, (enc, text, nat, hit) in enumerate(zip(encs, texts, nats, hits)):
        if not len(enc.ids):
            continue
        cats = byte_categories(text) if sources is None else heal_categories(text, sources[k])
        bits = nat / math.log(2)
        per_byte = np.zeros(len(cats))
        covered_mask = np.zeros(len(cats), dtype=bool)
        for (a, e), b in zip(enc.spans.tolist(), bits):
            if e > a:
                per_byte[a:e] += b / (e - a)
                covered_mask[a:e] = True
            elif len(cats):
                per_byte[min(a, len(cats) - 1)] += b
        for c in range(len(names)):
            sel = cats == c
            cat_bits[c] += per_byte[sel].sum()
            cat_bytes[c] += int((sel & covered_mask).sum())
        total_bits += float(bits.sum())
        covered += int(covered_mask.sum())
        tokens += len(enc.ids)
        correct += int(hit.sum())
    return {
        "bits_per_byte": total_bits / max(1, covered),
        "accuracy": correct / max(1, tokens),
        "tokens": tokens,
        "bytes": covered,
        "per_category": {
            name: {
                "bits_per_byte": float(cat_bits[c] / cat_bytes[c]) if cat_bytes[c] else None,
                "bytes": int(cat_bytes[c]),
            }
            for c, name in enumerate(names)
        },
    }


# --------------------------------------------------------------------------- models


def student_config(vocab: int, smoke: bool):
    """The student's shape: Llama, 8 layers x 384 (6 heads), MLP 1024, tied embeddings
    (26.7 M parameters at 32,768 ids); ``smoke``: 2 layers x 64."""
    from transformers import LlamaConfig

    if smoke:
        return LlamaConfig(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        )
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=6,
        num_key_value_heads=6,
        max_position_embeddings=4096,
        rope_theta=10_000.0,
        tie_word_embeddings=True,
    )


def build_student(out: Path, seed: int, smoke: bool) -> int:
    """Save a random-init student for ``seed`` as a HF folder (every arm of the seed starts from
    it). Returns its parameter count."""
    import torch
    from transformers import LlamaForCausalLM

    from xtoken_core.models import export_hf
    from xtoken_core.tokenizers import load_tokenizer

    vocab = load_tokenizer(STUDENT_TOKENIZER).vocab_size
    torch.manual_seed(seed)
    model = LlamaForCausalLM(student_config(vocab, smoke))
    if not (out / "config.json").is_file():
        export_hf(model, out, tokenizer=STUDENT_TOKENIZER)
    return sum(p.numel() for p in model.parameters())


def build_projection_file(
    out: Path, teacher_tokenizer: str, top_k: int, student_tokenizer: str = STUDENT_TOKENIZER
) -> dict[str, Any]:
    """Build the student -> teacher projection once (all KD arms of a teacher read the same file),
    with the tokenizers it was built for recorded.

    Returns:
        Its coverage stats (exact rows, strict / relaxed common vocab).
    """
    from xtoken_core.data.projection_build import (
        build_projection_with_stats,
        projection_metadata,
        save_projection,
    )
    from xtoken_core.tokenizers import load_tokenizer

    s_tok, t_tok = load_tokenizer(student_tokenizer), load_tokenizer(teacher_tokenizer)
    proj, stats = build_projection_with_stats(s_tok, t_tok, top_k)
    # the tokenizers recorded: the run checks the file against its own
    save_projection(proj, out, projection_metadata(s_tok, t_tok))
    try:
        return dataclasses.asdict(stats)
    except TypeError:
        return {k: v for k, v in vars(stats).items() if isinstance(v, int | float | str)}


# --------------------------------------------------------------------------- the arms


def arm_config(arm: str, seed: int, work: Path, args, student_dir: Path, proj: Path) -> dict:
    """The ``xtoken run`` config of one arm spec (:func:`parse_arm`) and seed."""
    base, overrides = parse_arm(arm)
    loss: dict[str, Any] = {"mode": base}
    if base != "ce":
        loss.update(
            projection=str(proj),
            temperature=args.temperature,
            kl_weight=args.kl_weight,
            ce_weight=1.0,
        )
        loss.update(overrides)
    return {
        "run_dir": str(work / "runs" / f"{arm_slug(arm)}_s{seed}"),
        "student_tokenizer": STUDENT_TOKENIZER,
        "teacher_tokenizer": args.teacher_tokenizer,
        "data": {
            "train": str(args.corpus / "train.jsonl"),
            "heldout": str(args.corpus / "val.jsonl"),
            "limit": args.limit,
        },
        "collator": {"workers": args.collators, "batch": 32},
        **shared_sections(args, args.teacher, student_dir, seed, loss),
    }


def shared_sections(args, teacher: str, student_dir: Path, seed: int, loss: dict) -> dict:
    """What every arm of both experiments shares: contexts, one trainer and one teacher (no
    restarts), and the ``teacher`` and ``trainer`` sections.

    Args:
        args: the parsed command line (device, batch, ctx, steps, epochs, eval and optimizer).
        teacher: the teacher's model spec.
        student_dir: the initial student's folder.
        seed: the trainer's seed.
        loss: the ``trainer.loss`` section.
    """
    return {
        "ctx_student": args.ctx,
        "ctx_teacher": args.ctx,
        "trainers": 1,
        "teachers": 1,
        "max_restarts": 0,
        "teacher": {
            "model": teacher,
            "device": args.device,
            "transport": "cuda_ipc" if args.device.startswith("cuda") else "shm",
            "max_batch": args.batch,
            "max_length": args.ctx,
            "slots": 2,
        },
        "trainer": {
            "student": {"model": str(student_dir), "seed": seed},
            "compute": {"device": args.device},
            "feed": {"micro_batch": args.batch, "grad_accum": 1},
            "schedule": {
                "max_steps": args.steps,
                "epochs": args.epochs,
                "checkpoint_every": 0,
                "final_checkpoint": False,
                "eval_every": args.eval_every,
                "export": True,
            },
            "eval": {
                "heldout": str(args.corpus / "val.jsonl"),
                "texts": args.eval_texts,
                "ctx": args.ctx,
            },
            "optim": {"lr": args.lr, "warmup_steps": args.warmup, "min_lr_ratio": 0.1},
            "loss": loss,
        },
    }


def launch_all(
    jobs: list[tuple[str, int, Path]],
    work: Path,
    parallel: int,
    deadline: float,
    *,
    on_done=None,
    side_tasks=None,
    finish_by_deadline: bool = False,
    gpus: list[int] | None = None,
):
    """Run ``xtoken run`` for every job, ``parallel`` at a time (per GPU with ``gpus``); none is
    started past ``deadline`` (monotonic).

    Args:
        jobs: ``(arm, seed, config path)``, or ``(arm, seed, argv)`` for another command.
        work: the work dir (``logs/`` goes there).
        parallel: runs at once, on each GPU of ``gpus``.
        deadline: monotonic time after which no run starts.
        on_done: called as ``on_done(arm, seed, exit code, wall seconds)`` as each run ends (a
            run not started past the deadline: code -1).
        side_tasks: callables run one at a time in the main process while runs train.
        finish_by_deadline: also start no run that would end past ``deadline`` at the longest
            wall time of the runs finished so far.
        gpus: indices of the GPUs this process sees to spread the runs over (each run sees
            its GPU alone, as ``cuda``: ``CUDA_VISIBLE_DEVICES``); a new run goes to the GPU
            with the fewest running. None: every run sees what this process sees.

    Returns:
        {(arm, seed): (exit code, wall seconds)}.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    visible = gpu_names(gpus, os.environ.get("CUDA_VISIBLE_DEVICES")) if gpus else [None]
    pending = list(jobs)
    side = list(side_tasks or [])
    running: dict[tuple[str, int], tuple[subprocess.Popen, float, Any, str | None]] = {}
    done: dict[tuple[str, int], tuple[int, float]] = {}
    (work / "logs").mkdir(parents=True, exist_ok=True)

    def finish(key, code, wall):
        done[key] = (code, wall)
        if on_done is not None:
            on_done(*key, code, wall)

    while pending or running or side:
        while pending:
            on = [g for *_, g in running.values()]
            gpu = min(visible, key=on.count)  # the least busy GPU (None: no --gpus)
            if on.count(gpu) >= parallel:
                break
            arm, seed, cfg = pending.pop(0)
            walls = [w for c, w in done.values() if c == 0] if finish_by_deadline else []
            if time.monotonic() + max(walls, default=0.0) > deadline:
                logger.warning("[quality] deadline: %s seed %d not started", arm, seed)
                finish((arm, seed), -1, 0.0)
                continue
            log = open(work / "logs" / f"{arm_slug(arm)}_s{seed}.log", "w")
            cmd = (
                cfg
                if isinstance(cfg, list)
                else [sys.executable, "-m", "services.cli", "run", str(cfg), "--no-progress"]
            )
            run_env = env if gpu is None else {**env, "CUDA_VISIBLE_DEVICES": gpu}
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=run_env, stdout=log, stderr=subprocess.STDOUT
            )
            running[(arm, seed)] = (proc, time.monotonic(), log, gpu)
            where = "" if gpu is None else f" on GPU {gpu}"
            logger.info("[quality] started %s seed %d%s (pid %d)", arm, seed, where, proc.pid)
        if side:
            side.pop(0)()
        for key, (proc, t0, log, _) in list(running.items()):
            code = proc.poll()
            if code is None:
                continue
            log.close()
            del running[key]
            wall = time.monotonic() - t0
            logger.info("[quality] %s seed %d exited %d after %.0fs", *key, code, wall)
            finish(key, code, wall)
        time.sleep(0.5)
    return done


def gpu_names(gpus: list[int], visible: str | None) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` value of each of ``gpus`` (indices of the GPUs this process
    sees: the entries of ``visible`` where it is set).

    Raises:
        ValueError: an index this process does not see, or one given twice.
    """
    seen = [d.strip() for d in visible.split(",") if d.strip()] if visible else None
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus {gpus}: an index given twice")
    out = []
    for i in gpus:
        if i < 0 or (seen is not None and i >= len(seen)):
            raise ValueError(
                f"--gpus: GPU {i} is not one this process sees (CUDA_VISIBLE_DEVICES={visible}); "
                "give indices from 0"
            )
        out.append(seen[i] if seen is not None else str(i))
    return out


def collect(arm: str, seed: int, run_dir: Path) -> dict[str, Any]:
    """Curves and totals of a finished run from its metrics."""
    from services.common.metrics import read_jsonl

    steps, evals, teacher, teacher_mib, teacher_res = [], [], None, [], []
    for r in read_jsonl(run_dir / "metrics" / "trainer.rank0.jsonl"):
        if r.get("event") == "step":
            steps.append(r)
        elif r.get("event") == "eval":
            evals.append({"step": r["step"], "bits_per_byte": r["bits_per_byte"]})
    for path in sorted((run_dir / "metrics").glob("teacher.group*.jsonl")):
        for r in read_jsonl(path):
            if r.get("event") == "eval":
                teacher = r["bits_per_byte"]
            if isinstance(r.get("memory_mb"), int | float):
                teacher_mib.append(r["memory_mb"])
            if isinstance(r.get("memory_reserved_mb"), int | float):
                teacher_res.append(r["memory_reserved_mb"])
    trainer_mib = [r["memory_mb"] for r in steps if isinstance(r.get("memory_mb"), int | float)]
    trainer_res = [
        r["memory_reserved_mb"]
        for r in steps
        if isinstance(r.get("memory_reserved_mb"), int | float)
    ]
    every = max(1, len(steps) // 200)
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        summary = {}
    out = {
        "steps": len(steps),
        "tokens": int(sum(r.get("tokens", 0) for r in steps)),
        "train_s": round(sum(r.get("step_s", 0.0) for r in steps), 2),
        # where a run's time goes besides its steps: the start-up step's compile (None: eager),
        # and the first step, which waits for the teachers' first logits
        "compile_s": summary.get("compile_s"),
        # where the start-up step's seconds went: each call's, Inductor's cache lookups
        "start_up": summary.get("start_up"),
        "first_step_s": round(steps[0].get("step_s", 0.0), 2) if steps else None,
        # the most GPU memory PyTorch allocated in the trainer and in any teacher process (MiB;
        # its allocator reserves more): what decides how many runs share a GPU
        "peak_memory_mib": {
            "trainer": max(trainer_mib, default=None),
            "teacher": max(teacher_mib, default=None),
        },
        # what PyTorch's allocator held at most (its cached blocks and CUDA graphs' pools too;
        # None off CUDA): with the CUDA context, what a process takes of a shared GPU
        "peak_reserved_mib": {
            "trainer": max(trainer_res, default=None),
            "teacher": max(teacher_res, default=None),
        },
        "val_curve": evals,
        "loss_curve": [
            {
                "step": r["step"],
                "loss": r.get("loss"),
                "ce_loss": r.get("ce_loss"),
                "kl_loss": r.get("kl_loss"),
            }
            for r in steps[::every]
        ],
        "teacher_val_bits_per_byte": teacher,
        "skipped_steps": sum(1 for r in steps if r.get("skipped")),
    }
    if any(r.get("on_policy") for r in steps):
        out["rollout"] = on_policy_totals(steps, run_dir)
    return out


def on_policy_totals(steps: list[dict], run_dir: Path) -> dict[str, Any]:
    """What the rollouts gave a run: on-policy samples trained, their mean staleness (weight
    versions), the samples dropped as too stale, the trainer's wait for them, and what the
    rollout workers generated (``rollout*.jsonl``)."""
    from services.common.metrics import read_jsonl

    ons = [r["on_policy"] for r in steps if r.get("on_policy")]
    samples = sum(o.get("samples") or 0 for o in ons)
    stale = sum((o.get("mean_staleness") or 0.0) * (o.get("samples") or 0) for o in ons)
    batches = [
        r
        for path in sorted((run_dir / "metrics").glob("rollout*.jsonl"))
        for r in read_jsonl(path)
        if r.get("event") == "rollout"
    ]
    busy = sum(r.get("sample_s", 0.0) + r.get("collate_s", 0.0) for r in batches)
    generated = sum(r.get("generated_tokens", 0) for r in batches)
    return {
        "samples": samples,
        "mean_staleness": round(stale / samples, 3) if samples else None,
        "dropped_stale": max((o.get("dropped_stale") or 0 for o in ons), default=0),
        "wait_s": round(sum(o.get("wait_s") or 0.0 for o in ons), 2),
        "generated_tokens": generated,
        "tokens_per_s_per_worker": round(generated / busy, 1) if busy else None,
    }


# --------------------------------------------------------------------------- main (train + eval)


def train_and_eval(args) -> int:
    """Prepare corpus, students and projection, run the arms, score the students; rows go to
    ``<out>/quality_rows.jsonl``."""
    import torch

    from xtoken_core.models import load_model
    from xtoken_core.tokenizers import load_tokenizer

    work = Path(args.work).resolve()
    if args.fresh:
        shutil.rmtree(work / "runs", ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    deadline = t_start + args.deadline_s
    if args.corpus is None:
        args.corpus = work / "corpus"
        manifest = build_split(args.corpus)
    else:
        args.corpus = Path(args.corpus).resolve()
        manifest = json.loads((args.corpus / "split.json").read_text())
    logger.info("[quality] corpus %s: %s", args.corpus, manifest)
    for arm in args.arms:
        parse_arm(arm)  # refuse a bad spec before anything is built
    kd_arms = [a for a in args.arms if a != "ce"]
    proj = work / f"projection_{STUDENT_TOKENIZER}_k{args.top_k}.pt"
    proj_stats = None
    if kd_arms:
        proj_stats = build_projection_file(proj, args.teacher_tokenizer, args.top_k)
        logger.info("[quality] projection %s: %s", proj, proj_stats)
        if args.teacher == "smollm2":  # dequantize the GGUF once, before parallel runs read it
            load_model("smollm2", dtype=torch.float32)
    params = {}
    jobs = []
    for seed in args.seeds:
        sdir = work / "students" / f"s{seed}"
        params[seed] = build_student(sdir, seed, args.smoke)
    for seed in args.seeds:  # seed-major: a deadline leaves whole seeds, not whole arms, out
        for arm in args.arms:
            cfg = arm_config(arm, seed, work, args, work / "students" / f"s{seed}", proj)
            path = work / "configs" / f"{arm_slug(arm)}_s{seed}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(cfg, indent=1))
            shutil.rmtree(cfg["run_dir"], ignore_errors=True)
            jobs.append((arm, seed, path))
    logger.info("[quality] students: %s parameters; %d runs", params, len(jobs))
    codes = launch_all(jobs, work, args.parallel, deadline, gpus=args.gpus)
    device = torch.device(args.device if args.device != "cuda" else "cuda:0")
    tok = load_tokenizer(STUDENT_TOKENIZER)
    split = args.score_split  # the key of the scores in the rows, too
    scored = read_jsonl_texts(args.corpus / SCORE_SPLITS[split], args.eval_limit)
    rows = []
    meta = {
        "commit": commit(),
        "device": device_name(device.type),
        "date": time.strftime("%Y-%m-%d"),
        "score_split": split,
        "steps": args.steps,
        "batch": args.batch,
        "ctx": args.ctx,
        "lr": args.lr,
        "temperature": args.temperature,
        "kl_weight": args.kl_weight,
        "teacher": args.teacher,
        "student_tokenizer": STUDENT_TOKENIZER,
        "teacher_tokenizer": args.teacher_tokenizer,
        "parallel": args.parallel,
        "smoke": args.smoke,
    }
    for (arm, seed), (code, wall) in sorted(codes.items()):
        run_dir = work / "runs" / f"{arm_slug(arm)}_s{seed}"
        row = {**meta, "arm": arm, "seed": seed, "exit": code, "wall_s": round(wall, 1)}
        row["student_params"] = params[seed]
        if code == 0 and (run_dir / "final" / "config.json").is_file():
            row.update(collect(arm, seed, run_dir))
            model = load_model(str(run_dir / "final"), dtype=torch.float32, device=device)
            row[split] = score(model, tok, scored, ctx=args.ctx, device=device)
            del model
        else:
            log = work / "logs" / f"{arm_slug(arm)}_s{seed}.log"
            row["error_tail"] = log.read_text()[-2000:] if log.is_file() else "not started"
        rows.append(row)
        print(_row_line(row), flush=True)
    if args.teacher_eval and args.teacher == "smollm2":
        model = load_model("smollm2", dtype=torch.float32, device=device)
        t_tok = load_tokenizer(args.teacher_tokenizer)
        rows.append(
            {
                **meta,
                "arm": "teacher",
                "seed": None,
                split: score(model, t_tok, scored, ctx=args.ctx, device=device),
                "projection": proj_stats,
                "corpus": manifest,
            }
        )
        print(_row_line(rows[-1]), flush=True)
    with open(out / "quality_rows.jsonl", "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    logger.info("[quality] %d rows -> %s (%.0fs)", len(rows), out, time.monotonic() - t_start)
    failed = [r for r in rows if r.get("exit") not in (0, None)]
    return 1 if failed else 0


def _row_line(row: dict) -> str:
    split = "heldout" if row.get("heldout") else "val"
    h = row.get(split)
    if not h:
        return f"{row['arm']:>8} s{row['seed']}: exit {row.get('exit')}"
    cats = " ".join(
        f"{c}={h['per_category'][c]['bits_per_byte']:.3f}"
        for c in CATEGORIES
        if h["per_category"][c]["bits_per_byte"] is not None
    )
    return (
        f"{row['arm']:>8} s{row['seed']}: {split} {h['bits_per_byte']:.4f} bits/byte, acc "
        f"{h['accuracy']:.4f} ({cats}); steps {row.get('steps')}, tokens {row.get('tokens')}, "
        f"wall {row.get('wall_s')}s"
    )


# --------------------------------------------------------------------------- report


def _stats(values: list[float]) -> dict[str, float]:
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": mean, "sd": sd, "min": min(values), "max": max(values), "n": len(values)}


def _arm_order(spec: str) -> tuple:
    """CE first, then the base arms in their order, each followed by its variants."""
    base = spec.partition(":")[0]
    return (ARMS.index(base) if base in ARMS else len(ARMS), spec != base, spec)


def summarize(rows: list[dict]) -> dict[str, Any]:
    """Mean and spread over seeds per arm, and the bar (every KD arm below CE only by more than
    the seed spread: CE's worst-minus-best range and both arms' standard deviations)."""
    by_arm: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("arm") not in (None, "teacher") and r.get("heldout"):
            by_arm.setdefault(r["arm"], []).append(r)
    out: dict[str, Any] = {"arms": {}}
    for arm in sorted(by_arm, key=_arm_order):
        rs = by_arm[arm]
        a = {
            "bpb": _stats([r["heldout"]["bits_per_byte"] for r in rs]),
            "acc": _stats([r["heldout"]["accuracy"] for r in rs]),
            "seeds": sorted(r["seed"] for r in rs),
            "tokens": _stats([r["tokens"] for r in rs]),
            "steps": _stats([r["steps"] for r in rs]),
            "wall_s": _stats([r["wall_s"] for r in rs]),
            "cat": {
                c: _stats([r["heldout"]["per_category"][c]["bits_per_byte"] for r in rs])
                for c in CATEGORIES
            },
        }
        out["arms"][arm] = a
    ce = out["arms"].get("ce")
    if ce:
        paired = {r["seed"]: r["heldout"]["bits_per_byte"] for r in by_arm["ce"]}
        for arm, a in out["arms"].items():
            if arm == "ce":
                continue
            spread = max(ce["bpb"]["max"] - ce["bpb"]["min"], ce["bpb"]["sd"] + a["bpb"]["sd"])
            gain = ce["bpb"]["mean"] - a["bpb"]["mean"]
            deltas = [
                paired[r["seed"]] - r["heldout"]["bits_per_byte"]
                for r in by_arm[arm]
                if r["seed"] in paired
            ]
            a["gain"] = gain
            a["spread"] = spread
            a["paired_gains"] = deltas
            a["bar_met"] = gain > spread and a["bpb"]["max"] < ce["bpb"]["min"]
    teacher = [r for r in rows if r.get("arm") == "teacher" and r.get("heldout")]
    if teacher:
        out["teacher"] = teacher[-1]
    return out


def ablation_table(rows: list[dict]) -> str:
    """The validation-split table of every arm spec scored with ``--score-split val``: mean
    over seeds, and the paired gain over CE only (same seed, positive = KD better)."""
    by_arm: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("val") and r.get("arm") != "teacher":
            by_arm.setdefault(r["arm"], []).append(r)
    ce = {r["seed"]: r["val"]["bits_per_byte"] for r in by_arm.get("ce", [])}
    lines = [
        "| arm | seeds | validation bits/byte (mean) | per seed | prose | code | digits | "
        "whitespace | next-token acc | paired gain vs CE (per seed) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, rs in sorted(by_arm.items(), key=lambda kv: _arm_order(kv[0])):
        rs = sorted(rs, key=lambda r: r["seed"])
        bpb = [r["val"]["bits_per_byte"] for r in rs]
        cats = " | ".join(
            f"{statistics.fmean(r['val']['per_category'][c]['bits_per_byte'] for r in rs):.3f}"
            for c in CATEGORIES
        )
        gains = [ce[r["seed"]] - r["val"]["bits_per_byte"] for r in rs if r["seed"] in ce]
        gain = (
            "-"
            if arm == "ce" or not gains
            else (f"{statistics.fmean(gains):+.4f} ({', '.join(f'{g:+.3f}' for g in gains)})")
        )
        lines.append(
            f"| {arm_label(arm)} | {','.join(str(r['seed']) for r in rs)} | "
            f"{statistics.fmean(bpb):.4f} | {', '.join(f'{b:.4f}' for b in bpb)} | {cats} | "
            f"{statistics.fmean(r['val']['accuracy'] for r in rs):.4f} | {gain} |"
        )
    return "\n".join(lines) if len(lines) > 2 else ""


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    """PNG curves: validation bits/byte vs step and training CE vs step, mean over seeds with the
    min-max band, one line per arm (none without matplotlib: a log line names its install)."""
    try:
        import matplotlib
    except ImportError:
        logger.warning(
            "[quality] no plots: matplotlib is not installed (./scripts/setup.sh test bench)"
        )
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"ce": "black", "pkl": "tab:blue", "gold": "tab:orange", "xtoken": "tab:green"}
    paths = []
    for name, key, field, ylabel in (
        ("quality_val_bpb.png", "val_curve", "bits_per_byte", "validation bits/byte"),
        ("quality_train_ce.png", "loss_curve", "ce_loss", "training CE (nats/token)"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
        specs = sorted({r["arm"] for r in rows if r.get(key) and r.get("arm") != "teacher"})
        others = iter(plt.get_cmap("tab10").colors[4:])  # ablation arms: colours of their own
        for arm in sorted(specs, key=_arm_order):
            rs = [r for r in rows if r.get("arm") == arm and r.get(key)]
            if not rs:
                continue
            steps = sorted(set.intersection(*[{p["step"] for p in r[key]} for r in rs]))
            if key == "val_curve":
                steps = [s for s in steps if s > 0]
            vals = [[next(p[field] for p in r[key] if p["step"] == s) for r in rs] for s in steps]
            if key == "loss_curve" and len(steps) > 20:  # smooth the per-step noise
                k = max(1, len(steps) // 40)
                steps = steps[k - 1 :]
                vals = [
                    [statistics.fmean(col) for col in zip(*vals[i - k + 1 : i + 1])]
                    for i in range(k - 1, len(vals))
                ]
            mean = [statistics.fmean(v) for v in vals]
            color = colors.get(arm) or next(others, None)
            ax.plot(steps, mean, color=color, label=f"{arm_label(arm)} (n={len(rs)})")
            ax.fill_between(
                steps, [min(v) for v in vals], [max(v) for v in vals], color=color, alpha=0.2
            )
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def report(args) -> int:
    """Merge row files, print the table, write ``quality.md``, ``quality.jsonl`` and the PNGs."""
    rows = []
    for p in args.report:
        rows += [json.loads(line) for line in Path(p).read_text().splitlines() if line.strip()]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if any(r.get("mode") == "heal" for r in rows):
        from benchmarks.quality.heal_report import report_heal

        try:
            print(report_heal(rows, out))
        except ValueError as e:
            logger.error("[quality] %s", e)
            return 2
        return 0
    s = summarize(rows)
    lines = [
        "| arm | seeds | held-out bits/byte (mean ± sd) | min-max | prose | code | digits | "
        "whitespace | next-token acc | gain vs CE | bar |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, a in s["arms"].items():
        bar = "-" if arm == "ce" else ("met" if a.get("bar_met") else "**missed**")
        gain = "-" if arm == "ce" else f"{a['gain']:+.4f} (spread {a['spread']:.4f})"
        cats = " | ".join(
            f"{a['cat'][c]['mean']:.3f} ± {a['cat'][c]['sd']:.3f}" for c in CATEGORIES
        )
        lines.append(
            f"| {arm_label(arm)} | {len(a['seeds'])} | {a['bpb']['mean']:.4f} ± {a['bpb']['sd']:.4f} "
            f"| {a['bpb']['min']:.4f}-{a['bpb']['max']:.4f} | {cats} | "
            f"{a['acc']['mean']:.4f} ± {a['acc']['sd']:.4f} | {gain} | {bar} |"
        )
    if "teacher" in s:
        h = s["teacher"]["heldout"]
        cats = " | ".join(f"{h['per_category'][c]['bits_per_byte']:.3f}" for c in CATEGORIES)
        lines.append(
            f"| teacher SmolLM2-135M (reference) | - | {h['bits_per_byte']:.4f} | - | {cats} | "
            f"{h['accuracy']:.4f} | - | - |"
        )
    table = "\n".join(lines)
    print(table)
    with open(out / "quality.jsonl", "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    plots = plot(rows, out)
    (out / "quality_table.md").write_text(table + "\n")
    ablations = ablation_table(rows)
    if ablations:
        print(ablations)
        (out / "quality_ablations.md").write_text(ablations + "\n")
    (out / "quality_summary.json").write_text(json.dumps(s, indent=1, default=str))
    logger.info("[quality] wrote %s, %s", out / "quality.jsonl", ", ".join(map(str, plots)))
    return 0


def main(argv: list[str] | None = None) -> int:
    """CLI: train and score the arms, or ``--report`` rows into tables and plots."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--arms",
        nargs="+",
        default=None,
        help=f"arms {ARMS}, each optionally ARM:key=value[,key=value] (loss overrides); heal "
        "mode: ce or BASE@TEACHER[:key=value,...] (default: heal.HEAL_ARMS)",
    )
    p.add_argument(
        "--score-split",
        default="heldout",
        choices=tuple(SCORE_SPLITS),
        help="split the finished students are scored on (val: ablations, choices)",
    )
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--device", default="cuda", help="cuda or cpu")
    p.add_argument("--teacher", default="smollm2", help="teacher model spec (smollm2 or a preset)")
    p.add_argument("--teacher-tokenizer", default="smollm2")
    p.add_argument(
        "--steps", type=int, default=None, help="optimizer steps of every arm (400; heal 150)"
    )
    p.add_argument(
        "--epochs", type=int, default=3, help="passes allowed over train (max_steps ends first)"
    )
    p.add_argument("--batch", type=int, default=16, help="texts per step (micro-batch)")
    p.add_argument("--ctx", type=int, default=512, help="tokens per text, both sides")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (2e-3; heal 5e-4)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (40; heal 20)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--kl-weight", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=8, help="projection slots per row")
    p.add_argument("--eval-every", type=int, default=50, help="validation curve period (steps)")
    p.add_argument("--eval-texts", type=int, default=64, help="validation texts per eval")
    p.add_argument("--eval-limit", type=int, default=None, help="held-out texts (default: all)")
    p.add_argument("--limit", type=int, default=None, help="train on the first N texts only")
    p.add_argument("--collators", type=int, default=2, help="collator workers per run")
    p.add_argument(
        "--rollouts",
        type=int,
        default=None,
        help="rollout workers per on-policy run (heal; default: 3 x its on-policy share, rounded "
        "up: 2 at 0.5, 3 at 1)",
    )
    p.add_argument(
        "--rollout-batch",
        type=int,
        default=None,
        help="prompts a rollout worker samples together (heal; default: --batch)",
    )
    p.add_argument(
        "--max-staleness",
        type=int,
        default=None,
        help="on-policy samples more than this many weight versions old are dropped (heal; "
        "the weights are published every step; default 4)",
    )
    p.add_argument(
        "--kv-cache",
        choices=("dynamic", "static"),
        default=None,
        help="the rollout workers' KV cache (heal; default dynamic)",
    )
    p.add_argument("--parallel", type=int, default=3, help="runs at once (per GPU with --gpus)")
    p.add_argument(
        "--gpus",
        nargs="+",
        type=int,
        default=None,
        help="spread the runs over these GPUs (indices), --parallel on each; scoring uses --device",
    )
    p.add_argument(
        "--deadline-s",
        type=float,
        default=480.0,
        help="start no run after this (heal: none that would end after it)",
    )
    p.add_argument("--teacher-eval", action="store_true", help="also score the teacher")
    p.add_argument("--corpus", default=None, help="a split built before (train/val/heldout.jsonl)")
    p.add_argument("--split-only", default=None, help="build the by-file split into DIR and exit")
    p.add_argument(
        "--fresh-rev",
        default="HEAD",
        help="with --split-only: the commit whose sources are the fresh split (default HEAD)",
    )
    p.add_argument("--work", default="/tmp/xtoken_kd_quality")
    p.add_argument("--out", default=str(RESULTS_DIR), help="rows, tables and plots go here")
    p.add_argument("--fresh", action="store_true", help="delete earlier runs in --work")
    p.add_argument("--report", nargs="+", default=None, help="row files to merge (no training)")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU smoke: tiny student and random tiny teacher, 6 steps, seed 0, ctx 64",
    )
    heal = p.add_argument_group("heal a pruned pretrained student (benchmarks/quality/heal.py)")
    heal.add_argument("--preset", choices=("heal",), default=None, help="the healing experiment")
    heal.add_argument("--student", default=None, help="pruned student spec (smollm2:drop=10-19)")
    heal.add_argument("--student-tokenizer", default=None, help="default: the spec's preset's")
    heal.add_argument(
        "--model-alias",
        nargs="+",
        default=None,
        help="NAME=SPEC: the model of a preset name comes from SPEC (gguf:PATH)",
    )
    heal.add_argument("--resume", nargs="+", default=None, help="row files of earlier calls")
    heal.add_argument("--nextline-lines", type=int, default=300, help="next-line items per split")
    heal.add_argument(
        "--continuations",
        type=int,
        default=None,
        help="texts per split whose first ctx/4 tokens each student continues greedily (up to "
        "ctx/4 tokens), rated by --continuation-scorer in bits/byte (heal: 100; 0: off)",
    )
    heal.add_argument(
        "--continuation-scorer",
        default=None,
        help="teacher preset that rates the students' continuations (default: the teacher of "
        "the first on-policy arm, else of the first arm with a teacher)",
    )
    heal.add_argument("--nextline-new-tokens", type=int, default=64)
    heal.add_argument(
        "--smoke-heal", action="store_true", help="CPU smoke of the healing experiment"
    )
    heal.add_argument(
        "--peer-gold",
        action="store_true",
        help="also train the student from qwen2.5-coder-0.5b with TRL's GOLD trainer (heal_peer)",
    )
    heal.add_argument(
        "--trl-python",
        default=None,
        help="python that imports trl: a path or a command on PATH (default .venv-bench's)",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for flag, value, default in (
        ("--rollouts", args.rollouts, "3 x the run's on-policy share"),
        ("--rollout-batch", args.rollout_batch, "--batch"),
        ("--max-staleness", args.max_staleness, "4"),
    ):
        if value is not None and value < 1:
            print(
                f"run_kd_quality: {flag} {value}: must be >= 1 (leave it out for {default})",
                file=sys.stderr,
            )
            return 2
    if args.gpus:
        try:  # refused before anything loads
            gpu_names(args.gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
        except ValueError as e:
            print(f"run_kd_quality: {e}", file=sys.stderr)
            return 2
    if args.split_only:
        try:
            manifest = build_split(Path(args.split_only), fresh_rev=args.fresh_rev)
        except ValueError as e:  # a commit the checkout does not have
            print(f"run_kd_quality: {e}", file=sys.stderr)
            return 2
        print(json.dumps(manifest, indent=1))
        return 0
    if args.report:
        return report(args)
    if args.preset or args.student or args.smoke_heal:
        from benchmarks.quality.heal import run_heal

        try:
            return run_heal(args)
        except ValueError as e:
            logger.error("[quality] %s", e)
            return 2
    for key, value in (("arms", list(ARMS)), ("steps", 400), ("lr", 2e-3), ("warmup", 40)):
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.smoke:
        args.device, args.teacher, args.steps, args.seeds = "cpu", "tiny", 6, [0]
        args.ctx, args.batch, args.eval_every, args.eval_texts = 64, 4, 3, 4
        args.warmup, args.collators, args.epochs = 2, 1, 1
        args.eval_limit = args.eval_limit or 8
        args.limit = args.limit or 48
        args.parallel = min(args.parallel, 2)
    return train_and_eval(args)


if __name__ == "__main__":
    sys.exit(main())
