"""The demo's trainer step on the CPU: where its time goes, with the loss's CPU path or the
reference, fp32 or bf16 parameters.

The demo's shapes (the ``tiny`` student with the Qwen3 vocabulary, 4 x 128 tokens of the demo
corpus collated with the real tokenizers, bf16 teacher logits of SmolLM2's width, P-KL over 4,096
teacher columns + CE) in one process, without the pipeline; median CPU seconds of the process
per phase (CPU time, not wall time: on a shared machine the wall time measures the other jobs).
Run under ``GLIBC_TUNABLES`` as the demo does to see the kept heap, without it to see glibc's
default::

    GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736 \\
        python benchmarks/e2e/bench_cpu_step.py --backend auto --param-dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="auto", choices=["auto", "reference"])
    p.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--steps", type=int, default=7, help="steps (the first is not counted)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the demo: 1)")
    args = p.parse_args()

    from xtoken_core.align.aligner import TokenAligner
    from xtoken_core.data.collator import CrossTokenizerCollator
    from xtoken_core.data.corpus import build_demo_corpus
    from xtoken_core.data.projection_build import build_projection
    from xtoken_core.losses import CrossTokenizerLoss, CrossTokenizerLossConfig
    from xtoken_core.models.loading import load_model
    from xtoken_core.tokenizers import load_tokenizer

    torch.set_num_threads(args.threads)
    student_tok, teacher_tok = load_tokenizer("qwen3"), load_tokenizer("smollm2")
    collate = CrossTokenizerCollator(
        student_tokenizer=student_tok,
        teacher_tokenizer=teacher_tok,
        aligner=TokenAligner(),
        ctx_length_student=128,
        ctx_length_teacher=128,
    )
    corpus = build_demo_corpus()
    with open(corpus.train_path) as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(4 * args.steps), f)]
    dtype = getattr(torch, args.param_dtype)
    model = load_model("tiny", vocab_size=student_tok.vocab_size).to(dtype).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tables = build_projection(student_tok, teacher_tok, 8)  # as the demo's run builds it
    projection = (tables["indices"], tables["likelihoods"])
    loss_fn = CrossTokenizerLoss(
        CrossTokenizerLossConfig(
            projection=projection,
            mode="pkl",
            vocab_topk=4096,
            teacher_vocab_size=teacher_tok.vocab_size,
            backend=args.backend,
        )
    )
    gen = torch.Generator().manual_seed(0)
    phases: dict[str, list[float]] = {"forward": [], "loss": [], "backward": [], "step": []}
    for i in range(args.steps):
        batch = collate(texts[4 * i : 4 * i + 4])
        B, U = batch["teacher_input_ids"].shape
        teacher = (3 * torch.randn(B, U, teacher_tok.vocab_size, generator=gen)).bfloat16()
        t0 = time.process_time()
        logits = model(input_ids=batch["input_ids"]).logits
        t1 = time.process_time()
        loss, _ = loss_fn(logits, teacher, batch)
        t2 = time.process_time()
        loss.backward()
        t3 = time.process_time()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t4 = time.process_time()
        if i:
            for key, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t0), strict=True):
                phases[key].append(seconds)
    medians = {k: round(statistics.median(v), 3) for k, v in phases.items()}
    print(
        json.dumps(
            {
                "backend": args.backend,
                "param_dtype": args.param_dtype,
                "threads": args.threads,
                "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
                "cpu_s_median": medians,
                "load_1min": round(os.getloadavg()[0], 2),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
