"""Presets: documented parameter counts, seeded random weights, vocab from the caller, errors."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from xtoken_core.models import PRESETS, load_model, model_vocab_size

# Millions of parameters (tied embeddings counted once; non-embedding: without the embedding and
# the output layer), as in the presets module docstring.
COUNTS = {
    "tiny": {"non_embedding": 0.07, 32_768: 2.17, 49_152: 3.22, 151_669: 9.78},
    "student-25m": {"non_embedding": 6.29, 32_768: 14.68, 49_152: 18.88, 151_669: 45.12},
    "qwen3-0.6b": {"non_embedding": 440.47, 32_768: 474.02, 49_152: 490.80, 151_669: 595.78},
    "teacher-1.5b": {
        "non_embedding": 1310.34,
        32_768: 1360.67,
        49_152: 1385.84,
        151_669: 1543.30,
    },
    "qwen3-1.7b": {"non_embedding": 1409.41, 32_768: 1476.52, 49_152: 1510.07, 151_669: 1720.03},
    "qwen3-4b": {"non_embedding": 3633.51, 32_768: 3717.40, 49_152: 3759.34, 151_669: 4021.78},
    "qwen2.5-7b": {"non_embedding": 6525.62, 32_768: 6760.50, 49_152: 6877.94, 151_669: 7612.79},
    "qwen2.5-14b": {
        "non_embedding": 13212.90,
        32_768: 13548.44,
        49_152: 13716.21,
        151_669: 14765.99,
    },
    "qwen2.5-32b": {
        "non_embedding": 31206.74,
        32_768: 31542.29,
        49_152: 31710.06,
        151_669: 32759.83,
    },
}


def _meta_model(name, vocab):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(PRESETS[name].config(vocab))


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_preset_parameter_counts_match_the_documented_table(name):
    assert set(PRESETS) >= set(COUNTS)
    for vocab in (32_768, 49_152, 151_669):
        model = _meta_model(name, vocab)
        total = sum(p.numel() for p in model.parameters())
        embedding = model.get_input_embeddings().weight.numel()
        if not model.config.tie_word_embeddings:
            embedding += model.get_output_embeddings().weight.numel()
        assert round(total / 1e6, 2) == COUNTS[name][vocab]
        assert round((total - embedding) / 1e6, 2) == COUNTS[name]["non_embedding"]
        assert model_vocab_size(model) == vocab


def test_big_presets_have_the_reference_shapes():
    qwen3 = PRESETS["qwen3-0.6b"].config(151_936)
    assert (qwen3.model_type, qwen3.num_hidden_layers, qwen3.hidden_size) == ("qwen3", 28, 1024)
    assert (qwen3.num_key_value_heads, qwen3.head_dim) == (8, 128)
    teacher = PRESETS["teacher-1.5b"].config(151_936)
    assert (teacher.model_type, teacher.num_hidden_layers, teacher.hidden_size) == (
        "qwen2",
        28,
        1536,
    )


# The real models' config.json values: (type, layers, hidden, heads, KV heads, head dim,
# intermediate, rope theta, RMS-norm epsilon, tied output layer).
SHAPES = {
    "qwen3-1.7b": ("qwen3", 28, 2048, 16, 8, 128, 6144, 1e6, 1e-6, True),
    "qwen3-4b": ("qwen3", 36, 2560, 32, 8, 128, 9728, 1e6, 1e-6, True),
    "qwen2.5-7b": ("qwen2", 28, 3584, 28, 4, 128, 18_944, 1e6, 1e-6, False),
    "qwen2.5-14b": ("qwen2", 48, 5120, 40, 8, 128, 13_824, 1e6, 1e-5, False),
    "qwen2.5-32b": ("qwen2", 64, 5120, 40, 8, 128, 27_648, 1e6, 1e-5, False),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_large_teacher_presets_have_the_real_models_shapes(name):
    c = PRESETS[name].config(152_064)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope_theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta") or c.rope_theta
    got = (
        c.model_type, c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
        c.num_key_value_heads, head_dim, c.intermediate_size, rope_theta, c.rms_norm_eps,
        c.tie_word_embeddings,
    )  # fmt: skip
    assert got == SHAPES[name]
    assert c.vocab_size == 152_064


def test_tiny_preset_takes_the_vocab_from_the_caller():
    model = load_model("tiny", vocab_size=1000)
    assert model_vocab_size(model) == 1000
    assert model.get_input_embeddings().weight.shape == (1000, 64)
    assert model.config.num_hidden_layers == 2 and model.config.num_attention_heads == 4


def test_same_seed_gives_the_same_weights_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = load_model("tiny", vocab_size=300, seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    b = load_model("tiny", vocab_size=300, seed=7)
    c = load_model("tiny", vocab_size=300, seed=8)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_dtype_is_applied_after_the_float32_draw():
    full = load_model("tiny", vocab_size=300, seed=3)
    half = load_model("tiny", vocab_size=300, seed=3, dtype=torch.bfloat16)
    assert half.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(half.lm_head.weight, full.lm_head.weight.to(torch.bfloat16))


def test_preset_without_vocab_size_says_to_pass_it():
    with pytest.raises(ValueError, match="vocab_size"):
        load_model("tiny")
    with pytest.raises(ValueError, match="positive int"):
        load_model("tiny", vocab_size=0)


def test_unknown_spec_lists_the_presets():
    with pytest.raises(ValueError, match="student-25m") as info:
        load_model("gpt-17", vocab_size=10)
    assert "smollm2" in str(info.value) and "directory" in str(info.value)
