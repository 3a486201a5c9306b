"""The model card (``README.md``) of an exported student: teachers, student, tokenizers, loss,
data, steps and held-out bits/byte, as far as the run knows them."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from services.common.metrics import read_jsonl
from services.trainer.config import TrainerConfig

logger = logging.getLogger(__name__)


def card_facts(
    config: TrainerConfig, run_dir: Path, summary: dict[str, Any], *, step: int, world_size: int
) -> dict[str, Any]:
    """What the card says, gathered from the trainer config, the whole run config
    (``RUN_DIR/config/run.json``, when ``xtoken run`` wrote one), the trainer's summary and the
    teacher's eval record.

    Args:
        config: the trainer's config.
        run_dir: the run directory.
        summary: the trainer's summary (``student_before`` / ``student_after`` evals).
        step: optimizer steps trained.
        world_size: trainer ranks.

    Returns:
        A flat mapping of the card's values (None where unknown).
    """
    try:
        run = json.loads((run_dir / "config" / "run.json").read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        run = {}
    data, teacher = run.get("data") or {}, run.get("teacher") or {}
    teacher_bpb = None
    for path in sorted((run_dir / "metrics").glob("teacher.group*.jsonl")):
        for record in read_jsonl(path):
            if record.get("event") == "eval" and "bits_per_byte" in record:
                teacher_bpb = record["bits_per_byte"]
    loss = config.loss
    run_extra = run.get("extra_teachers") or []
    extra_teachers = [
        {
            "model": (run_extra[j] if j < len(run_extra) else {}).get("model") or extra.model,
            "tokenizer": extra.tokenizer,
            "weight": extra.weight,
        }
        for j, extra in enumerate(config.extra_teachers)
    ]
    return {
        "name": run_dir.name,
        "student": config.student.model,
        "student_tokenizer": config.student_tokenizer,
        "teacher": teacher.get("model") or config.teacher.model,
        "teacher_tokenizer": config.teacher_tokenizer,
        "teacher_weight": config.teacher.weight,
        "extra_teachers": extra_teachers,
        "loss_mode": loss.mode,
        "temperature": loss.temperature if loss.uses_teacher else None,
        "kl_weight": loss.kl_weight if loss.uses_teacher else None,
        "ce_weight": loss.ce_weight,
        "train_data": data.get("train"),
        "heldout_data": config.eval.heldout or data.get("heldout"),
        "steps": step,
        "global_batch": config.feed.step_samples * world_size,
        "lr": config.optim.lr,
        "teacher_bpb": teacher_bpb,
        "student_before_bpb": (summary.get("student_before") or {}).get("bits_per_byte"),
        "student_after_bpb": (summary.get("student_after") or {}).get("bits_per_byte"),
    }


def _code(value: Any) -> str:
    return "unknown" if value is None else f"`{value}`"


def render_card(facts: dict[str, Any]) -> str:
    """The card's Markdown, with a Hugging Face metadata header.

    Args:
        facts: as :func:`card_facts` returns.

    Returns:
        The text of README.md.
    """
    mode = facts["loss_mode"]
    if mode == "ce":
        loss = "student cross-entropy only (no teacher)"
    else:
        names = {"pkl": "P-KL (projected KL)", "gold": "gold", "xtoken": "relaxed gold (xtoken)"}
        loss = (
            f"{names.get(mode, mode)}, temperature {facts['temperature']:g}, "
            f"kl_weight {facts['kl_weight']:g}, ce_weight {facts['ce_weight']:g}"
        )
    teacher = f"{_code(facts['teacher'])}, tokenizer {_code(facts['teacher_tokenizer'])}"
    extra = facts.get("extra_teachers") or []
    if extra and mode != "ce":  # several teachers: each one's weight in the loss
        teacher += f", weight {facts['teacher_weight']:g}"
    rows = [
        ("student", f"{_code(facts['student'])}, tokenizer {_code(facts['student_tokenizer'])}"),
        ("teacher", "none" if mode == "ce" else teacher),
        *(
            (
                f"teacher {j + 1}",
                f"{_code(e['model'])}, tokenizer {_code(e['tokenizer'])}, weight {e['weight']:g}",
            )
            for j, e in enumerate(extra if mode != "ce" else [])
        ),
        ("loss", loss),
        ("training data", _code(facts["train_data"])),
        ("held-out data", _code(facts["heldout_data"])),
        (
            "steps",
            f"{facts['steps']} (global batch {facts['global_batch']} texts, lr {facts['lr']:g})",
        ),
    ]
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags:",
        "- knowledge-distillation",
        "- cross-tokenizer",
        "- xtoken",
        "---",
        "",
        f"# {facts['name']}",
        "",
        "A student model distilled with xtoken (cross-tokenizer knowledge distillation): it learned "
        "from a teacher whose tokenizer differs from its own, the two tokenizations aligned on "
        "the bytes of the text.",
        "",
        "| | |",
        "|---|---|",
        *[f"| {key} | {value} |" for key, value in rows],
        "",
    ]
    bpb = [
        ("teacher", facts["teacher_bpb"] if mode != "ce" else None),
        ("student before", facts["student_before_bpb"]),
        ("student after", facts["student_after_bpb"]),
    ]
    known = [(who, value) for who, value in bpb if value is not None]
    if known:
        lines += [
            "## Held-out bits per byte",
            "",
            "Lower is better; bits per byte do not depend on the tokenizer, so teacher and "
            "student compare directly.",
            "",
            "| model | bits/byte |",
            "|---|---|",
            *[f"| {who} | {value:.4f} |" for who, value in known],
            "",
        ]
    lines += [
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")',
        'model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")',
        'ids = tokenizer("The quick brown fox", return_tensors="pt")',
        "print(tokenizer.decode(model.generate(**ids, max_new_tokens=20)[0]))",
        "```",
        "",
        "The tokenizer is the one the student trained with and gives the same ids; special-token "
        "text written literally in the input (e.g. an end-of-text marker) is read as that special "
        "token here, while training read it as plain text.",
        "",
    ]
    return "\n".join(lines)


def write_model_card(out_dir: Path, facts: dict[str, Any]) -> None:
    """Write ``README.md`` into an exported model folder.

    Args:
        out_dir: the exported folder.
        facts: as :func:`card_facts` returns.
    """
    (out_dir / "README.md").write_text(render_card(facts), encoding="utf-8")
    logger.info("[trainer] wrote the model card %s", out_dir / "README.md")
