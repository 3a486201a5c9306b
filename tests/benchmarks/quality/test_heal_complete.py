"""Greedy completion of held-out functions (benchmarks/quality/heal_complete.py): which functions
are taken, where a written body ends, and the teacher's rating of the completions."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from benchmarks.quality import heal_complete  # noqa: E402

TEXT = '''import os


class Box:
    def area(self, w: int,
             h: int) -> int:
        """The area of a w x h box."""
        a = w * h
        return a

    def no_doc(self):
        return 1

    async def fetch(self):
        \'\'\'Fetch it.

        Twice.
        \'\'\'
        await go()
        await go()

def top():
    """At the top."""
    # a comment

    return os.sep

def cut():
    """Its body runs past the text."""
    x = 1
'''


def test_functions_with_a_docstring_and_a_body_ending_inside_the_text_are_taken():
    items = heal_complete.functions_of(TEXT, 3)
    assert [i.name for i in items] == ["area", "fetch", "top"]  # no_doc: none; cut: unfinished
    area = items[0]
    assert area.text == 3 and area.indent == 4
    assert area.prompt.startswith("    def area(self, w: int,\n             h: int) -> int:")
    assert area.prompt.endswith('"""The area of a w x h box."""')  # no line break after it
    assert area.body == "\n        a = w * h\n        return a"
    assert items[1].prompt.endswith("Twice.\n        '''") and items[1].body.count("await") == 2
    assert items[2].body == "\n    # a comment\n\n    return os.sep"


def test_a_written_body_ends_at_the_first_line_at_the_def_indentation():
    written = "\n        return w * h\n\n    def other(self):\n        pass"
    assert heal_complete.body_of(written, 4) == "\n        return w * h"
    assert heal_complete.body_of("\ndef next_one():", 0) == ""
    assert heal_complete.body_of("\n    x = 1\n  \n    y = 2\n", 0) == "\n    x = 1\n  \n    y = 2"


def test_the_selection_is_fixed_by_content_and_capped():
    texts = [TEXT, TEXT.replace("area", "size")]
    first = heal_complete.select_functions(texts, 4)
    assert first == heal_complete.select_functions(texts, 4) and len(first) == 4
    assert [i.text for i in first] == sorted(i.text for i in first)  # in text order
    assert len(heal_complete.select_functions(texts, 100)) == 6


def test_completions_are_rated_by_the_scorer_in_bits_per_byte(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from xtoken_core.tokenizers import load_tokenizer

    tok = load_tokenizer("smollm2")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
    )
    model = LlamaForCausalLM(cfg)
    items = heal_complete.functions_of(TEXT)
    out = heal_complete.completion_bits_per_byte(
        model, tok, model, tok, items, ctx=64, device="cpu", max_new_tokens=8
    )
    assert out["functions"] == 3 and out["empty"] + (out["bytes"] > 0) >= 1
    if out["bytes"]:
        assert out["bits_per_byte"] > 0 and out["mean_bytes"] > 0
    written = heal_complete.complete_functions(
        model, tok, items, ctx=64, device="cpu", max_new_tokens=8
    )
    assert len(written) == 3 and all(isinstance(w, str) for w in written)
