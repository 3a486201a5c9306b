"""xtoken vs TRL's GOLD trainer (cross-tokenizer ULD): tokens/s, peak GPU memory, held-out bits/byte.

One script, one machine, the same teacher and student folders, the same texts:

* the models are the presets of ``benchmarks/e2e/bench_pipeline.py`` (a Qwen3-0.6B-shaped student
  with the Qwen3 tokenizer, a 1.5B-shaped teacher with the Mistral tokenizer, random weights) saved
  once as local HF folders; the tokenizers are saved as local HF tokenizer folders from the files
  xtoken loads offline (no hub anywhere);
* the texts are demo-corpus texts cut so that each fits ``T - 16`` tokens on both sides (no
  truncation on either side, in either trainer), one text per step (1 x T);
* **TRL**: ``trl.experimental.gold.GOLDTrainer`` with ``use_uld_loss=True`` (byte-offset
  alignment, TRL's default), off-policy (``lmbda=0``), CE + ULD, in its own process
  (``trl_gold_worker.py``) so that a failure or out-of-memory is recorded as the result;
* **xtoken**: ``xtoken run`` (queue, collators, teacher and trainer processes, ``cuda_ipc``)
  through ``bench_pipeline.pipeline``;
* tokens/s = student tokens per second after the warm-up steps; peak GPU memory = the device's
  used memory (nvidia-smi, every process of the run, CUDA contexts included) over the baseline,
  and torch's peak allocation of the training process;
* quality: the same number of training steps (texts) for each, the same constant learning rate,
  then held-out bits/byte of each exported student by ``xtoken_core.models.eval.bits_per_byte``.

Usage (GPU; TRL and ``datasets`` importable by ``--trl-python``)::

    python benchmarks/peers/bench_trl_gold.py --parts speed quality

CPU smoke test (tiny models, TRL from ``.venv-bench``)::

    python benchmarks/peers/bench_trl_gold.py --device cpu --student tiny --teacher tiny \\
        --shapes 64 --steps 2 --warmup 1 --quality-steps 3 --quality-T 64 \\
        --trl-python .venv-bench/bin/python --results /tmp/peers_smoke.jsonl

A byte-level teacher tokenizer (TRL's default, byte-offset ULD then runs):
``--teacher-tokenizer llama3 --teacher-vocab 0``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "e2e"))

import bench_pipeline  # noqa: E402

from benchmarks._common import RESULTS_DIR, append_rows, commit, device_name  # noqa: E402

WORKER = Path(__file__).resolve().parent / "trl_gold_worker.py"
PROMPT = "Continue the text.\n"
NEMO_RL = {
    "source": "NeMo RL x-token distillation guide (published, not run here)",
    "step_s": 6.65,
    "global_batch": "96 x 2048",
    "tokens_per_s": 96 * 2048 / 6.65,
}


def visible_gpu(cuda_visible_devices: str | None) -> str:
    """The nvidia-smi id (index or UUID) of the GPU the run's ``cuda:0`` is.

    nvidia-smi numbers every GPU of the host and ignores ``CUDA_VISIBLE_DEVICES``, so a run
    limited to one GPU of several would otherwise sample GPU 0, whatever runs there.
    """
    first = (cuda_visible_devices or "").split(",")[0].strip()
    return first or "0"


class GpuMemorySampler:
    """Peak of the device's used memory (nvidia-smi) while a block runs, over its baseline."""

    def __init__(self, enabled: bool, period_s: float = 0.2) -> None:
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.period_s = period_s
        self.peak_mib = 0
        self.base_mib = 0

    @staticmethod
    def _used_mib() -> int:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=memory.used",
                "--format=csv,noheader,nounits",
                "-i",
                visible_gpu(os.environ.get("CUDA_VISIBLE_DEVICES")),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        try:
            return int(out.stdout.strip().splitlines()[0])
        except (ValueError, IndexError):
            return 0

    def __enter__(self) -> GpuMemorySampler:
        if self.enabled:
            self.base_mib = self._used_mib()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak_mib = max(self.peak_mib, self._used_mib())
            self._stop.wait(self.period_s)

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._stop.set()
            self._thread.join()

    @property
    def peak_gib(self) -> float | None:
        """Peak used memory over the baseline in GiB (None without nvidia-smi)."""
        if not self.enabled:
            return None
        return max(0, self.peak_mib - self.base_mib) / 1024


def tokenizer_dirs(work: Path, student: str, teacher: str) -> tuple[str, str]:
    """Save the xtoken tokenizers as local HF tokenizer folders (what TRL loads).

    A ``tokenizer.json`` is wrapped as a fast tokenizer; a SentencePiece ``.model`` is converted
    by transformers (LlamaTokenizer), as a user loading that model's folder would get it.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from xtoken_core.tokenizers import load_tokenizer
    from xtoken_core.tokenizers.registry import bundled_path

    out = []
    for who, name in (("student", student), ("teacher", teacher)):
        d = work / f"tok_{who}_{name}"
        if not (d / "tokenizer_config.json").is_file():
            src = bundled_path(name)
            xt = load_tokenizer(name)
            if src.suffix == ".json":
                tok = PreTrainedTokenizerFast(tokenizer_file=str(src))
            else:
                tmp = work / f"tok_src_{name}"
                tmp.mkdir(parents=True, exist_ok=True)
                shutil.copy(src, tmp / "tokenizer.model")
                (tmp / "tokenizer_config.json").write_text(
                    json.dumps({"tokenizer_class": "LlamaTokenizer", "legacy": False})
                )
                tok = AutoTokenizer.from_pretrained(str(tmp))
            for role, tid in (("eos_token", xt.eos_id), ("bos_token", xt.bos_id)):
                if getattr(tok, role) is None and tid is not None:
                    setattr(tok, role, tok.convert_ids_to_tokens(int(tid)))
            if tok.pad_token is None:
                tok.pad_token = tok.eos_token
            tok.save_pretrained(str(d))
        out.append(str(d))
    return out[0], out[1]


def fitted_texts(
    student: str, teacher: str, T: int, count: int, heldout: bool = False
) -> list[str]:
    """``count`` texts of the demo corpus (train or held-out split), each cut at a student
    token boundary so that it is at most ``T - 16`` tokens for both tokenizers."""
    from xtoken_core.data.corpus import build_demo_corpus, iter_texts
    from xtoken_core.tokenizers import load_tokenizer

    st, tt = load_tokenizer(student), load_tokenizer(teacher)
    demo = build_demo_corpus()
    path = demo.heldout_path if heldout else demo.train_path
    budget = T - 16
    texts, buf = [], ""
    for _, text in iter_texts(str(path)):
        buf = f"{buf}\n\n{text}" if buf else text
        if len(buf) < 6 * T:
            continue
        raw = buf.encode("utf-8")
        s_spans = st.encode(buf, add_special_tokens=False).spans_N2
        t_spans = tt.encode(buf, add_special_tokens=False).spans_N2
        # the byte end that both sides reach within the budget
        end = min(
            int(s_spans[min(budget, len(s_spans)) - 1][1]),
            int(t_spans[min(budget, len(t_spans)) - 1][1]),
        )
        cut = raw[:end].decode("utf-8", errors="ignore")
        while (
            len(st.encode(cut, add_special_tokens=False).ids_N) > budget
            or len(tt.encode(cut, add_special_tokens=False).ids_N) > budget
        ):
            cut = cut[: int(len(cut) * 0.97)]
        texts.append(cut)
        buf = ""
        if len(texts) >= count:
            break
    return texts


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """Write ``rows`` as JSON lines to ``path`` and return it."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def run_trl(args, work: Path, tag: str, spec: dict) -> dict:
    """Run ``trl_gold_worker.py`` as a subprocess; its result, memory and error in one dict."""
    spec_path = work / f"trl_{tag}.spec.json"
    out_path = work / f"trl_{tag}.out.json"
    out_path.unlink(missing_ok=True)
    spec_path.write_text(json.dumps(spec))
    log_path = work / f"trl_{tag}.log"
    with GpuMemorySampler(args.device == "cuda") as mem, log_path.open("w") as log:
        t0 = time.perf_counter()
        proc = subprocess.run(
            [args.trl_python, str(WORKER), str(spec_path), str(out_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=args.trl_timeout,
            check=False,
        )
    wall = time.perf_counter() - t0
    if out_path.is_file():
        res = json.loads(out_path.read_text())
    else:
        tail = log_path.read_text(errors="replace")[-2000:]
        res = {"error": f"worker exited {proc.returncode} without a result: {tail}"}
    res["device_peak_gib"] = mem.peak_gib
    res["wall_s"] = res.get("wall_s", wall)
    res["log"] = str(log_path)
    return res


def run_xtoken(args, work: Path, mode: str, T: int, corpus: Path, dirs: dict) -> dict:
    """``xtoken run`` of the same models on ``corpus`` (bench_pipeline.pipeline), with memory."""
    transport = "cuda_ipc" if args.device == "cuda" else "shm"
    with GpuMemorySampler(args.device == "cuda") as mem:
        try:
            res = bench_pipeline.pipeline(
                args,
                mode,
                1,
                T,
                dirs["student"],
                dirs["teacher"],
                corpus,
                dirs["projection"],
                transport,
                work / f"xt_{mode}_{T}",
                trainer_extra={
                    "compute": {"activation_checkpointing": args.activation_checkpointing}
                },
            )
        except ValueError as exc:  # a refused configuration is a result too
            res = {"error": f"ValueError: {exc}"}
    res["device_peak_gib"] = mem.peak_gib
    res["transport"] = transport
    if "error" not in res:
        import statistics

        from services.common.metrics import read_jsonl

        steps = [
            r
            for r in read_jsonl(work / f"xt_{mode}_{T}" / "metrics" / "trainer.rank0.jsonl")
            if r["event"] == "step" and r["step"] > args.warmup
        ]
        res["median_step_s"] = statistics.median(r["step_s"] for r in steps)
        res["tokens_per_s_median_step"] = (
            statistics.mean(r["tokens"] for r in steps) / res["median_step_s"]
        )
    return res


def xtoken_quality(args, work: Path, mode: str, T: int, corpus: Path, dirs: dict) -> dict:
    """Train ``--quality-steps`` texts with ``xtoken run`` and export the student."""
    from services.supervise.config import run_config_from_dict
    from services.supervise.driver import Driver

    run_dir = work / f"xtq_{mode}"
    shutil.rmtree(run_dir, ignore_errors=True)
    transport = "cuda_ipc" if args.device == "cuda" else "shm"
    config = run_config_from_dict(
        {
            "run_dir": str(run_dir),
            "student_tokenizer": args.student_tokenizer,
            "teacher_tokenizer": args.teacher_tokenizer,
            "ctx_student": T,
            "ctx_teacher": T,
            "data": {"train": str(corpus), "heldout": str(corpus), "limit": args.quality_steps},
            "collator": {"workers": 2, "batch": 1},
            "teacher": {
                "model": dirs["teacher"],
                "device": args.device,
                "transport": transport,
                "max_batch": 1,
                "max_length": T,
                "slots": 2,
            },
            "trainer": {
                "student": {"model": dirs["student"]},
                "compute": {"device": args.device},
                "feed": {"micro_batch": 1},
                "schedule": {
                    "max_steps": args.quality_steps,
                    "checkpoint_every": 0,
                    "final_checkpoint": False,
                    "eval_every": 0,
                    "export": True,
                },
                "optim": {"lr": args.lr, "warmup_steps": 0, "min_lr_ratio": 1.0},
                "loss": {"mode": mode, "projection": dirs["projection"]},
            },
        }
    )
    run = Driver(config, progress=False)
    t0 = time.perf_counter()
    code = run.run()
    if code != 0:
        return {"error": run.failure, "wall_s": time.perf_counter() - t0}
    return {"model": str(run_dir / "final"), "wall_s": time.perf_counter() - t0}


def heldout_bpb(args, model_dir: str, texts: list[str]) -> dict:
    """Held-out bits/byte of a student folder (tokenizer-independent, every token scored)."""
    from xtoken_core.models import load_model
    from xtoken_core.models.eval import bits_per_byte
    from xtoken_core.tokenizers import load_tokenizer

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = load_model(model_dir, dtype=dtype, device=torch.device(args.device))
    out = bits_per_byte(
        model,
        load_tokenizer(args.student_tokenizer),
        texts,
        ctx=args.quality_T,
        batch_size=1,
        device=args.device,
    )
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return {
        "bits_per_byte": out["bits_per_byte"],
        "accuracy": out["accuracy"],
        "heldout_bytes": out["bytes"],
        "heldout_tokens": out["tokens"],
    }


def trl_spec(
    args,
    dirs: dict,
    data: Path,
    T: int,
    steps: int,
    warmup: int,
    save: str | None,
    extended: bool = False,
) -> dict:
    """The worker's spec for one TRL run (``extended``: TRL's byte-offset ULD alignment, its
    default, which refuses a teacher tokenizer that is not byte-level BPE; else positional ULD,
    TRL's documented setting for SentencePiece tokenizers)."""
    return {
        "student": dirs["student"],
        "teacher": dirs["teacher"],
        "student_tokenizer": dirs["student_tok"],
        "teacher_tokenizer": dirs["teacher_tok"],
        "data": str(data),
        "max_length": T,
        "steps": steps,
        "warmup": warmup,
        "lr": args.lr,
        "device": args.device,
        "save": save,
        "output_dir": str(Path(args.work) / "trl_out"),
        "extended_uld": extended,
    }


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def write_markdown(path: Path, stamp: dict, speed: list[dict], quality: list[dict]) -> None:
    """Write the side-by-side table (``peers_trl_gold.md``) from this run's rows."""
    lines = [
        "# xtoken vs TRL GOLD (`benchmarks/peers/bench_trl_gold.py`)",
        "",
        f"Device: {stamp['device']}; commit {stamp['commit']}; {stamp['time']}. Student "
        f"`{stamp['student']}` preset ({stamp.get('student_tokenizer', 'qwen3')} tokenizer), "
        f"teacher `{stamp['teacher']}` preset ({stamp.get('teacher_tokenizer', 'mistral')} "
        "tokenizer), random weights, local HF folders; xtoken's trainer with activation "
        f"checkpointing {'on' if stamp.get('activation_checkpointing') else 'off'}; TRL "
        f"{stamp.get('trl_version', '?')} `GOLDTrainer` (ULD loss; its default byte-offset "
        "alignment, `extended`, is tried first, and where TRL refuses it (a teacher tokenizer "
        "that is not byte-level BPE, as Mistral's SentencePiece) positional ULD, TRL's setting "
        "for SentencePiece tokenizers, is measured; off-policy, CE + ULD, TRL's defaults otherwise: gradient checkpointing on, bf16 "
        "autocast); xtoken `xtoken run` (`cuda_ipc`). Same texts, one per step (1 x T), each "
        "fitting T - 16 tokens on both sides. tok/s = student tokens per second after the "
        "warm-up; `dev GiB` = peak used device memory over the baseline (nvidia-smi, every "
        "process, CUDA contexts included); `torch GiB` = torch's peak allocation of the "
        "training process (xtoken: the trainer only).",
        "",
        "| T | system | mode | tok/s | tok/s (median step) | step s | dev GiB | torch GiB | "
        "xtoken / TRL tok/s | xtoken / TRL memory | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in speed:
        lines.append(
            f"| {r['T']} | {r['system']} | {r.get('mode', '-')} | {_f(r.get('tokens_per_s'), '.0f')} "
            f"| {_f(r.get('tokens_per_s_median_step'), '.0f')} | {_f(r.get('step_s'), '.3f')} | {_f(r.get('device_peak_gib'), '.1f')} "
            f"| {_f(r.get('torch_peak_gib'), '.1f')} | {_f(r.get('speedup'), '.1f')} "
            f"| {_f(r.get('mem_ratio'), '.3f')} | {(r.get('error') or '')[:300]} |"
        )
    lines += [
        "",
        f"NeMo RL (published, not run here): {NEMO_RL['step_s']} s per step at global batch "
        f"{NEMO_RL['global_batch']} tokens for its x-token guide = "
        f"{NEMO_RL['tokens_per_s']:.0f} tokens/s on its cluster (orientation only: other "
        "models and hardware).",
        "",
    ]
    if quality:
        lines += [
            "Held-out bits/byte after the same training steps (texts), same constant learning "
            "rate, evaluated by `xtoken_core.models.eval.bits_per_byte` on the demo corpus's "
            "held-out split (the teacher has random weights: this checks that the same tokens "
            "train each student as well, not that KD helps; benchmarks/quality/run_kd_quality.py does that).",
            "",
            "| system | mode | steps | student tokens trained | held-out bits/byte | wall s | note |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in quality:
            lines.append(
                f"| {r['system']} | {r.get('mode', '-')} | {r.get('steps', '-')} "
                f"| {r.get('tokens', '-')} | {_f(r.get('bits_per_byte'), '.4f')} "
                f"| {_f(r.get('wall_s'), '.0f')} | {(r.get('error') or '')[:300]} |"
            )
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main() -> int:
    """CLI: run the parts, print one table, append rows and write the markdown."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", nargs="+", default=["speed", "quality"], choices=["speed", "quality"])
    p.add_argument("--shapes", nargs="+", type=int, default=[2048, 4096], help="T of 1 x T")
    p.add_argument("--modes", nargs="+", default=["gold", "xtoken"], help="xtoken loss modes")
    p.add_argument("--student", default="qwen3-0.6b")
    p.add_argument("--teacher", default="teacher-1.5b")
    p.add_argument("--student-tokenizer", default="qwen3")
    p.add_argument("--teacher-tokenizer", default="mistral")
    p.add_argument("--student-vocab", type=int, default=151936)
    p.add_argument(
        "--teacher-vocab", type=int, default=32768, help="0: the teacher tokenizer's size"
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=10, help="measured xtoken steps")
    p.add_argument("--warmup", type=int, default=3, help="xtoken warm-up steps")
    p.add_argument("--trl-steps", type=int, default=3, help="measured TRL steps")
    p.add_argument("--trl-warmup", type=int, default=2, help="TRL warm-up steps")
    p.add_argument(
        "--quality-steps", type=int, default=20, help="texts (steps) trained for quality"
    )
    p.add_argument("--quality-T", type=int, default=2048)
    p.add_argument("--heldout-texts", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4, help="constant learning rate (quality)")
    p.add_argument("--trl-python", default=sys.executable, help="python that imports trl")
    p.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="xtoken's trainer recomputes activations in the backward, as TRL does by default",
    )
    p.add_argument("--trl-timeout", type=float, default=900.0)
    p.add_argument(
        "--trl-uld",
        default="auto",
        choices=["auto", "extended", "positional"],
        help="TRL's ULD alignment: extended (byte offsets, TRL's default; byte-level BPE only), "
        "positional, or auto (extended, then positional where TRL refuses it)",
    )
    p.add_argument(
        "--no-xtoken-warm-run",
        dest="xtoken_warm_run",
        action="store_false",
        help="skip the untimed xtoken run that fills Triton's kernel cache first",
    )
    p.add_argument("--work", default="/tmp/xtoken_bench_peers")
    p.add_argument("--results", default=str(RESULTS_DIR / "peers_trl_gold.jsonl"))
    p.add_argument("--markdown", default=None, help="default: the results path with .md")
    p.add_argument(
        "--render",
        default=None,
        metavar="JSONL",
        help="only write the markdown from the rows of this JSONL (no run)",
    )
    args = p.parse_args()
    if args.render:
        rows = [json.loads(line) for line in open(args.render, encoding="utf-8") if line.strip()]
        md = Path(args.markdown) if args.markdown else Path(args.render).with_suffix(".md")
        keys = ("commit", "device", "student", "teacher", "time", "student_tokenizer",
                "teacher_tokenizer", "activation_checkpointing")  # fmt: skip
        stamp = {k: rows[0][k] for k in keys if k in rows[0]}
        stamp["trl_version"] = next(
            (r["trl"]["trl_version"] for r in rows if r.get("trl", {}).get("trl_version")), "?"
        )
        write_markdown(
            md,
            stamp,
            [r for r in rows if r.get("part") == "speed"],
            [r for r in rows if r.get("part") == "quality"],
        )
        print(f"wrote {md}")
        return 0
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("XTOKEN_CACHE", str(work / "cache"))

    student_dir, teacher_dir = bench_pipeline.save_models(args, work)
    student_tok, teacher_tok = tokenizer_dirs(work, args.student_tokenizer, args.teacher_tokenizer)
    from xtoken_core.tokenizers import load_tokenizer

    projection = bench_pipeline.build_projection(args, work)
    dirs = {
        "student": student_dir,
        "teacher": teacher_dir,
        "student_tok": student_tok,
        "teacher_tok": teacher_tok,
        "projection": projection,
    }
    dev = device_name() if args.device == "cuda" else "cpu"
    stamp = {
        "commit": commit(),
        "device": dev,
        "student": args.student,
        "teacher": args.teacher,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "nemo_rl": NEMO_RL,
        "student_tokenizer": args.student_tokenizer,
        "teacher_tokenizer": args.teacher_tokenizer,
        "activation_checkpointing": args.activation_checkpointing,
    }
    speed, quality = [], []
    print(f"device {dev}; student {args.student} teacher {args.teacher}", flush=True)
    trl_ulds = ["extended", "positional"] if args.trl_uld == "auto" else [args.trl_uld]
    if "speed" in args.parts:
        if args.xtoken_warm_run and args.modes:
            # one untimed short run: Triton compiles the loss kernels once into its disk cache,
            # as a user's first run would (later runs, as measured, find them there)
            T0 = args.shapes[0]
            texts = fitted_texts(args.student_tokenizer, args.teacher_tokenizer, T0, 12)
            warm_corpus = write_jsonl(work / "warm.jsonl", [{"text": t} for t in texts])
            for mode in args.modes:
                run_xtoken(args, work, mode, T0, warm_corpus, dirs)
        for T in args.shapes:
            n = max(args.warmup + args.steps, args.trl_warmup + args.trl_steps) + 8
            texts = fitted_texts(args.student_tokenizer, args.teacher_tokenizer, T, n)
            xt_corpus = write_jsonl(work / f"speed_{T}.jsonl", [{"text": t} for t in texts])
            trl_data = write_jsonl(
                work / f"speed_{T}_trl.jsonl", [{"prompt": PROMPT, "completion": t} for t in texts]
            )
            trl_row = None
            for uld in trl_ulds:
                trl = run_trl(
                    args,
                    work,
                    f"speed_{T}_{uld}",
                    trl_spec(
                        args,
                        dirs,
                        trl_data,
                        T,
                        args.trl_steps,
                        args.trl_warmup,
                        None,
                        extended=uld == "extended",
                    ),
                )
                stamp["trl_version"] = trl.get("trl_version", stamp.get("trl_version"))
                trl_row = {
                    "part": "speed",
                    "T": T,
                    "system": "TRL GOLD",
                    "mode": f"uld {uld}",
                    "tokens_per_s": trl.get("tokens_per_s"),
                    "step_s": trl.get("step_s"),
                    "device_peak_gib": trl.get("device_peak_gib"),
                    "torch_peak_gib": trl.get("peak_mem_gib"),
                    "error": trl.get("error"),
                    "trl": trl,
                }
                speed.append(trl_row)
                append_rows(args.results, [{**stamp, **trl_row}])  # a timeout keeps what ran
                print(
                    f"T={T} TRL ULD {uld}: {_f(trl.get('tokens_per_s'), '.0f')} tok/s, dev "
                    f"{_f(trl.get('device_peak_gib'), '.1f')} GiB {trl.get('error') or ''}",
                    flush=True,
                )
                if not trl.get("error"):
                    break
            for mode in args.modes:
                xt = run_xtoken(args, work, mode, T, xt_corpus, dirs)
                row = {
                    "part": "speed",
                    "T": T,
                    "system": "xtoken",
                    "mode": mode,
                    "tokens_per_s": xt.get("tokens_per_s"),
                    "step_s": xt.get("step_s"),
                    "device_peak_gib": xt.get("device_peak_gib"),
                    "torch_peak_gib": (xt["peak_mem_mb"] / 1024) if xt.get("peak_mem_mb") else None,
                    "error": xt.get("error"),
                    "xtoken": {k: v for k, v in xt.items() if k != "losses"},
                }
                row["tokens_per_s_median_step"] = xt.get("tokens_per_s_median_step")
                if row["tokens_per_s"] and trl_row["tokens_per_s"]:
                    row["speedup"] = row["tokens_per_s"] / trl_row["tokens_per_s"]
                if row["device_peak_gib"] and trl_row["device_peak_gib"]:
                    row["mem_ratio"] = row["device_peak_gib"] / trl_row["device_peak_gib"]
                speed.append(row)
                append_rows(args.results, [{**stamp, **row}])
                print(
                    f"T={T} xtoken {mode}: {_f(row['tokens_per_s'], '.0f')} tok/s, "
                    f"dev {_f(row['device_peak_gib'], '.1f')} GiB, x{_f(row.get('speedup'), '.1f')} "
                    f"{row['error'] or ''}",
                    flush=True,
                )
    if "quality" in args.parts:
        T = args.quality_T
        texts = fitted_texts(args.student_tokenizer, args.teacher_tokenizer, T, args.quality_steps)
        held = fitted_texts(
            args.student_tokenizer, args.teacher_tokenizer, T, args.heldout_texts, heldout=True
        )
        s = load_tokenizer(args.student_tokenizer)
        tokens = sum(len(s.encode(t, add_special_tokens=False).ids_N) for t in texts)
        xt_corpus = write_jsonl(work / "quality.jsonl", [{"text": t} for t in texts])
        trl_data = write_jsonl(
            work / "quality_trl.jsonl", [{"prompt": PROMPT, "completion": t} for t in texts]
        )
        base = {"part": "quality", "steps": args.quality_steps, "tokens": tokens, "T": T}
        quality.append(
            {
                **base,
                "system": "student before",
                "steps": 0,
                "tokens": 0,
                **heldout_bpb(args, student_dir, held),
            }
        )
        save = str(work / "trl_quality_student")
        shutil.rmtree(save, ignore_errors=True)
        for uld in trl_ulds:
            trl = run_trl(
                args,
                work,
                f"quality_{uld}",
                trl_spec(args, dirs, trl_data, T, args.quality_steps, 0, save, uld == "extended"),
            )
            row = {
                **base,
                "system": "TRL GOLD",
                "mode": f"uld {uld}",
                "wall_s": trl.get("wall_s"),
                "error": trl.get("error"),
            }
            if not trl.get("error"):
                row.update(heldout_bpb(args, save, held))
                row["trained_tokens"] = trl.get("trained_tokens")
            quality.append(row)
            if not trl.get("error"):
                break
        for mode in args.modes:
            xq = xtoken_quality(args, work, mode, T, xt_corpus, dirs)
            row = {
                **base,
                "system": "xtoken",
                "mode": mode,
                "wall_s": xq.get("wall_s"),
                "error": xq.get("error"),
            }
            if not xq.get("error"):
                row.update(heldout_bpb(args, xq["model"], held))
            quality.append(row)
        for r in quality:
            print(
                f"quality {r['system']:>15} {r.get('mode', '-'):>7} steps {r['steps']:>3} "
                f"bits/byte {_f(r.get('bits_per_byte'), '.4f')} {r.get('error') or ''}",
                flush=True,
            )
    append_rows(args.results, [{**stamp, **r} for r in quality])  # speed rows: written as they ran
    md = Path(args.markdown) if args.markdown else Path(args.results).with_suffix(".md")
    write_markdown(md, stamp, speed, quality)
    print(f"wrote {args.results} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
