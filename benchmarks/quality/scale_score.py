"""The scoring step of one run of the scaled healing experiment, run on the run's own lane after
training: ``python -m benchmarks.quality.scale_score SPEC.json`` reads the spec, scores the
exported student and writes the result JSON the spec names.

A grid run is scored on the validation split only (its bits/byte is what the grid chooses by);
a final or rerun run also by ``scale_final`` (held-out and fresh). Every result carries the
SHA-256 of the student's weight files, so that a rerun can be checked bitwise.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.quality import heal, heal_eval  # noqa: E402
from benchmarks.quality import run_kd_quality as kd  # noqa: E402

logger = logging.getLogger("kd_quality.scale")

VALIDATION = "val.jsonl"


def weights_sha256(model_dir: Path) -> str:
    """The SHA-256 over the ``*.safetensors`` files of a model folder, in name order."""
    h = hashlib.sha256()
    for path in sorted(model_dir.glob("*.safetensors")):
        h.update(path.name.encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def score_validation(
    model, tokenizer, corpus: Path, ctx: int, device, limit: int | None = None
) -> dict[str, Any]:
    """A student's bits/byte and next-token accuracy on the validation split.

    Args:
        model: the student on ``device``.
        tokenizer: its XTokenizer.
        corpus: the split folder (only its ``val.jsonl`` is read).
        ctx: window length in tokens.
        device: where it scores.
        limit: the first texts only (None: all).

    Returns:
        ``run_kd_quality.score``'s figures.
    """
    recs = heal_eval.read_records(corpus / VALIDATION, limit)
    return kd.score(
        model,
        tokenizer,
        [r["text"] for r in recs],
        ctx=ctx,
        device=device,
        sources=[r["source"] for r in recs],
    )


def score_run(spec: dict[str, Any]) -> dict[str, Any]:
    """Score one finished run as its spec says.

    Args:
        spec: ``phase`` (grid, final, rerun), ``model`` (the exported folder),
            ``student_tokenizer``, ``corpus``, ``ctx``, ``device``, ``val_limit``; for a final
            or rerun run also ``scale_final.score_final``'s keys and ``scorer`` (a teacher
            preset or None) with ``aliases``.

    Returns:
        ``{"validation", "weights_sha256"}``, with ``"final"`` for a final or rerun run.
    """
    import torch

    from xtoken_core.models import load_model
    from xtoken_core.tokenizers import load_tokenizer

    device = torch.device(spec["device"])
    model_dir, corpus = Path(spec["model"]), Path(spec["corpus"])
    tok = load_tokenizer(spec["student_tokenizer"])
    model = load_model(str(model_dir), dtype=torch.float32, device=device)
    out = {
        "weights_sha256": weights_sha256(model_dir),
        "validation": score_validation(
            model, tok, corpus, spec["ctx"], device, spec.get("val_limit")
        ),
    }
    if spec["phase"] != "grid":
        from benchmarks.quality import scale_final

        scorer = scorer_tok = None
        if spec.get("scorer") and spec.get("functions"):
            scorer = heal.load_teacher(spec["scorer"], spec.get("aliases") or {}, device)
            scorer_tok = load_tokenizer(heal.teacher_tokenizer(spec["scorer"]))
        out["final"] = scale_final.score_final(
            model, tok, corpus, spec, device, scorer=scorer, scorer_tok=scorer_tok
        )
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI: ``scale_score SPEC.json`` writes the result to the spec's ``result`` path."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m benchmarks.quality.scale_score SPEC.json", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    spec = json.loads(Path(argv[0]).read_text())
    result = score_run(spec)
    path = Path(spec["result"])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
