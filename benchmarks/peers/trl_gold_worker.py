"""One TRL GOLD (cross-tokenizer ULD) training run in its own process: step times, peak memory.

Started by ``bench_trl_gold.py`` as ``python trl_gold_worker.py SPEC.json OUT.json`` so that a
failure (an exception, CUDA out of memory) or its memory peak stays inside this process. SPEC:
``student``, ``teacher`` (local HF model folders), ``student_tokenizer``, ``teacher_tokenizer``
(local HF tokenizer folders), ``data`` (JSONL of ``{"prompt", "completion"}``), ``max_length``,
``steps``, ``warmup``, ``lr``, ``device`` ("cuda" or "cpu"), ``save`` (folder for the trained
student, or null), ``extended_uld`` (byte-offset alignment, TRL's default), optionally ``batch``
(texts per step, default 1), ``lr_warmup_steps`` and ``lr_min_ratio`` (a linear warm-up and a
cosine decay to ``lr_min_ratio x lr``, as xtoken's trainer schedules; default: a constant rate).
OUT gets the result (``first_nonfinite_step``: the first step whose loss or gradient norm was not
finite, or null),
or ``{"error": ..., "error_type": ...}``.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import sys
import time
import traceback

log = logging.getLogger("trl_gold_worker")


def run(spec: dict) -> dict:
    """Train the student with TRL's GOLDTrainer (ULD loss) and time each optimizer step.

    Args:
        spec: the run description (see the module docstring).

    Returns:
        ``step_s`` (median after warm-up), ``tokens_per_s`` (student tokens with attention
        mask 1 per measured step, over the measured time), ``peak_mem_gib`` (torch's peak
        allocation in this process, CUDA only), ``losses``, ``trl_version``.

    Raises:
        Exception: whatever TRL raises (the caller records it as the result).
    """
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl.experimental.gold import GOLDConfig, GOLDTrainer

    cuda = spec["device"] == "cuda"
    rows = [json.loads(line) for line in open(spec["data"], encoding="utf-8") if line.strip()]
    dataset = Dataset.from_list(rows)
    tok = AutoTokenizer.from_pretrained(spec["student_tokenizer"])
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    dtype = torch.bfloat16 if cuda else torch.float32
    student = AutoModelForCausalLM.from_pretrained(spec["student"], dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(spec["teacher"], dtype=dtype)
    n_steps = spec["warmup"] + spec["steps"]
    schedule: dict = {"lr_scheduler_type": "constant", "warmup_steps": 0}
    if spec.get("lr_min_ratio") is not None:  # xtoken's schedule: warm-up, cosine to a floor
        schedule = {
            "lr_scheduler_type": "cosine_with_min_lr",
            "warmup_steps": int(spec.get("lr_warmup_steps", 0)),
            "lr_scheduler_kwargs": {"min_lr_rate": float(spec["lr_min_ratio"])},
        }
    args = GOLDConfig(
        output_dir=spec["output_dir"],
        max_steps=n_steps,
        per_device_train_batch_size=spec.get("batch", 1),
        gradient_accumulation_steps=1,
        learning_rate=spec["lr"],
        **schedule,
        weight_decay=0.01,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        max_length=spec["max_length"],
        max_completion_length=min(128, spec["max_length"] // 2),  # generation only (lmbda=0)
        bf16=cuda,
        use_cpu=not cuda,
        lmbda=0.0,  # off-policy: train on the given tokens, no student generation
        seq_kd=False,
        use_uld_loss=True,
        use_extended_uld=spec.get("extended_uld", True),
        uld_crossentropy_weight=1.0,  # CE + KD, as the xtoken side trains
        uld_distillation_weight=1.0,
        teacher_tokenizer_name_or_path=spec["teacher_tokenizer"],
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        dataloader_num_workers=0,
        seed=0,
    )
    times: list[float] = []
    tokens: list[int] = []
    losses: list[float] = []
    nonfinite: list[int] = []  # the steps whose loss or gradient norm was not finite

    class Timer(TrainerCallback):
        """Wall time of each optimizer step, synchronized with the device."""

        def on_step_begin(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)
            if len(times) == spec["warmup"] and cuda:
                torch.cuda.reset_peak_memory_stats()

        def on_log(self, _args, state, _control, logs=None, **k):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))
                norm = float(logs.get("grad_norm", 0.0))
                if not (math.isfinite(losses[-1]) and math.isfinite(norm)):
                    nonfinite.append(state.global_step)

    trainer = GOLDTrainer(
        model=student,
        teacher_model=teacher,
        args=args,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[Timer()],
    )
    orig = trainer.compute_loss

    def counting_loss(model, inputs, *a, **k):
        tokens.append(int(inputs["attention_mask"].sum()))
        return orig(model, inputs, *a, **k)

    trainer.compute_loss = counting_loss
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    measured = times[spec["warmup"] :]
    measured_tokens = tokens[spec["warmup"] : spec["warmup"] + len(measured)]
    out = {
        "trl_version": trl.__version__,
        "steps_run": len(times),
        "step_s": statistics.median(measured) if measured else None,
        "step_times_s": [round(t, 4) for t in times],
        "tokens_per_step": statistics.mean(measured_tokens) if measured_tokens else None,
        "tokens_per_s": sum(measured_tokens) / sum(measured) if measured else None,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "losses": losses,
        "first_nonfinite_step": nonfinite[0] if nonfinite else None,
        "lr_schedule": schedule["lr_scheduler_type"],
        "wall_s": wall,
        "trained_tokens": sum(tokens),
        "gradient_checkpointing": bool(args.gradient_checkpointing),
    }
    if spec.get("save"):
        trainer.save_model(spec["save"])
    return out


def main() -> int:
    """CLI: ``trl_gold_worker.py SPEC.json OUT.json``; exit 0 also when TRL failed (recorded)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [trl_gold] %(message)s")
    spec = json.loads(open(sys.argv[1], encoding="utf-8").read())
    try:
        result = run(spec)
    except BaseException as exc:  # noqa: BLE001 - any failure of TRL is the measured result
        trace = traceback.format_exc()
        log.error("[trl_gold] failed: %s", trace)
        result = {
            "error": f"{type(exc).__name__}: {str(exc)[:2000]}",
            "error_type": type(exc).__name__,
            "traceback_tail": trace[-3000:],
        }
    with open(sys.argv[2], "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
