"""The final scoring of the scaled healing experiment: the only code that reads the held-out and
fresh splits (a test keeps it so). It runs for the chosen settings alone, once each, after the
grid has chosen on the validation split.

A student is scored on both splits (``run_kd_quality.score``: bits/byte overall and per
category, next-token accuracy; ``heal_eval.next_line_exact_match``) and, on the held-out split,
by greedy completion of held-out functions rated by a teacher (``heal_complete``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.quality import heal_complete, heal_eval
from benchmarks.quality import run_kd_quality as kd

#: the splits read here and nowhere else: row key -> file of the split folder
FINAL_SPLITS = {"heldout": "heldout.jsonl", "fresh": "fresh.jsonl"}


def check_final_splits(corpus: Path) -> None:
    """Both final splits exist (nothing is read).

    Raises:
        ValueError: one is missing (names it and how to build the split).
    """
    for name in FINAL_SPLITS.values():
        if not (corpus / name).is_file():
            raise ValueError(
                f"--corpus {corpus} has no {name}; build the split with run_kd_quality.py "
                "--split-only DIR (it writes every split)"
            )


def score_final(
    model,
    tokenizer,
    corpus: Path,
    spec: dict[str, Any],
    device,
    scorer=None,
    scorer_tok=None,
) -> dict[str, Any]:
    """A finished student's final scores.

    Args:
        model: the student on ``device``.
        tokenizer: its XTokenizer.
        corpus: the split folder.
        spec: ``ctx``, ``eval_limit`` (texts per split, None: all), ``nextline_lines``,
            ``nextline_new_tokens``, ``functions`` (functions of the whole held-out split to
            complete; 0: none),
            ``completion_new_tokens``.
        device: where it scores.
        scorer: the teacher that rates the completions (None: no completions).
        scorer_tok: its XTokenizer.

    Returns:
        ``{split: scores + {"nextline": ...}}`` with ``"completion"`` (``heal_complete``'s
        figures) in the held-out split's scores when rated.
    """
    out = {}
    for split, name in FINAL_SPLITS.items():
        recs = heal_eval.read_records(corpus / name, spec.get("eval_limit"))
        texts = [r["text"] for r in recs]
        s = kd.score(
            model,
            tokenizer,
            texts,
            ctx=spec["ctx"],
            device=device,
            sources=[r["source"] for r in recs],
        )
        s["nextline"] = heal_eval.next_line_exact_match(
            model,
            tokenizer,
            texts,
            heal_eval.select_next_lines(texts, spec["nextline_lines"]),
            ctx=spec["ctx"],
            device=device,
            max_new_tokens=spec["nextline_new_tokens"],
        )
        if split == "heldout" and scorer is not None and spec.get("functions"):
            # the functions come from the whole split, whatever eval_limit keeps for the rest
            every = [r["text"] for r in heal_eval.read_records(corpus / name)]
            items = heal_complete.select_functions(every, spec["functions"])
            s["completion"] = heal_complete.completion_bits_per_byte(
                model,
                tokenizer,
                scorer,
                scorer_tok,
                items,
                ctx=spec["ctx"],
                device=device,
                max_new_tokens=spec["completion_new_tokens"],
            )
        out[split] = s
    return out
