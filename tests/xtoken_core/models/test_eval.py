"""bits_per_byte: uniform model, windows, every token scored, batching, context token, errors."""

import math

import pytest
import torch

from xtoken_core.models import bits_per_byte, load_model
from xtoken_core.models.eval import _windows
from xtoken_core.tokenizers import load_tokenizer

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "Bits per byte do not depend on the tokenizer. Ünïcödé: 你好 🇺🇸",
    "",
    "x = [i * i for i in range(10)]  # squares",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("mistral")


@pytest.fixture(scope="module")
def model(tok):
    return load_model("tiny", vocab_size=tok.vocab_size, seed=5).eval()


def _reference_bits(model, tok, texts, ctx):
    """-log2 p of every token, window by window, one window per forward (obviously correct)."""
    context = tok.bos_id if tok.bos_id is not None else tok.eos_id
    bits = 0.0
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids.tolist()
        for a in range(0, len(ids), ctx):
            targets = ids[a : a + ctx]
            inputs = torch.tensor([[context] + targets[:-1]])
            with torch.no_grad():
                logp = torch.log_softmax(model(inputs).logits[0].double(), dim=-1)
            bits -= float(logp[torch.arange(len(targets)), torch.tensor(targets)].sum()) / math.log(
                2
            )
    return bits


def test_a_uniform_model_gives_log2_vocab_bits_per_token(tok):
    uniform = load_model("tiny", vocab_size=tok.vocab_size)
    uniform.lm_head = torch.nn.Linear(64, tok.vocab_size, bias=False)
    torch.nn.init.zeros_(uniform.lm_head.weight)
    result = bits_per_byte(uniform, tok, TEXTS, ctx=8)
    expected = math.log2(tok.vocab_size) * result["tokens"] / result["bytes"]
    assert result["bits_per_byte"] == pytest.approx(expected, rel=1e-6)
    assert set(result) == {"bits_per_byte", "bytes", "tokens", "accuracy"}


def test_every_token_is_scored_and_bytes_are_the_covered_text(tok, model):
    result = bits_per_byte(model, tok, TEXTS, ctx=1024)
    encs = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    assert result["tokens"] == sum(len(e) for e in encs)
    assert result["bytes"] == sum(len(t.encode("utf-8")) for t in TEXTS)
    assert 0.0 <= result["accuracy"] <= 1.0


@pytest.mark.parametrize("ctx", [1, 5, 1024])
def test_bits_match_a_window_by_window_reference(tok, model, ctx):
    result = bits_per_byte(model, tok, TEXTS, ctx=ctx, batch_size=3)
    reference = _reference_bits(model, tok, TEXTS, ctx)
    assert result["bits_per_byte"] * result["bytes"] == pytest.approx(reference, rel=1e-4)


def test_short_windows_cover_the_same_tokens_and_bytes_as_one_long_window(tok, model):
    short = bits_per_byte(model, tok, TEXTS, ctx=4)
    long = bits_per_byte(model, tok, TEXTS, ctx=4096)
    assert (short["tokens"], short["bytes"]) == (long["tokens"], long["bytes"])


def test_batch_size_does_not_change_the_result(tok, model):
    one = bits_per_byte(model, tok, TEXTS, ctx=6, batch_size=1)
    many = bits_per_byte(model, tok, TEXTS, ctx=6, batch_size=16)
    assert many["bits_per_byte"] == pytest.approx(one["bits_per_byte"], rel=1e-5)
    assert many["accuracy"] == one["accuracy"]


def test_windows_start_with_bos_or_with_eos_when_there_is_no_bos(tok):
    windows, _ = _windows(tok, ["one two three four five"], ctx=2)
    assert all(inputs[0] == tok.bos_id for inputs, _ in windows)
    assert all(len(inputs) == len(targets) <= 2 for inputs, targets in windows)
    qwen = load_tokenizer("qwen3")
    assert qwen.bos_id is None
    windows, covered = _windows(qwen, ["hello world"], ctx=16)
    assert windows[0][0][0] == qwen.eos_id and covered == len("hello world")


def test_the_models_training_mode_is_restored(tok):
    model = load_model("tiny", vocab_size=tok.vocab_size).train()
    bits_per_byte(model, tok, ["abc"], ctx=4)
    assert model.training


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"ctx": 0}, "ctx must be an int >= 1"),
        ({"ctx": 4, "batch_size": 0}, "batch_size must be an int >= 1"),
        ({"ctx": 4, "texts": ["", ""]}, "cover no byte"),
        ({"ctx": 4, "texts": "one string"}, "list of strings"),
    ],
)
def test_bad_arguments_raise_value_errors(tok, model, kwargs, match):
    kwargs = {"texts": TEXTS, **kwargs}
    with pytest.raises(ValueError, match=match):
        bits_per_byte(model, tok, kwargs.pop("texts"), **kwargs)
