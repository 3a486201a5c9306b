"""Dropping decoder layers: the spec suffix, the renumbered layers and config, and the logits of a
model built without those layers by hand (full forward and step by step through the KV cache)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

from xtoken_core.models import drop_layers, export_hf, load_model
from xtoken_core.models.layer_drop import parse_drop, split_spec


def _llama(layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def _gemma3(layers: int) -> Gemma3TextConfig:
    return Gemma3TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=4,
        layer_types=[
            "full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(layers)
        ],
        max_position_embeddings=64,
    )


def _by_hand(model, keep: list[int], make_config):
    """A fresh model of len(keep) layers holding the weights of ``model``'s layers ``keep``."""
    config = make_config(len(keep))
    if hasattr(model.config, "layer_types"):
        config.layer_types = [model.config.layer_types[i] for i in keep]
    torch.manual_seed(123)  # other weights than the source: every weight must be copied
    small = AutoModelForCausalLM.from_config(config).eval()
    state = {}
    for name, value in model.state_dict().items():
        if name.startswith("model.layers."):
            old = int(name.split(".")[2])
            if old not in keep:
                continue
            rest = name.split(".", 3)[3]
            name = f"model.layers.{keep.index(old)}.{rest}"
        state[name] = value
    small.load_state_dict(state)
    return small


@pytest.mark.parametrize(
    ("text", "indices"),
    [("10-19", tuple(range(10, 20))), ("3", (3,)), ("1,4-5", (1, 4, 5)), ("2-2,2", (2,))],
)
def test_parse_drop_reads_indices_and_inclusive_ranges(text, indices):
    assert parse_drop(text) == indices


@pytest.mark.parametrize("text", ["", "a", "3-1", "-2", "1-x"])
def test_parse_drop_refuses_what_is_no_layer_range_naming_it(text):
    with pytest.raises(ValueError, match="drop="):
        parse_drop(text)


def test_split_spec_takes_the_suffix_off_any_spec_a_gguf_path_included():
    assert split_spec("smollm2:drop=10-19") == ("smollm2", tuple(range(10, 20)))
    assert split_spec("gguf:/m/a:b.gguf:drop=0") == ("gguf:/m/a:b.gguf", (0,))
    assert split_spec("student-25m") == ("student-25m", ())
    with pytest.raises(ValueError, match="name the model before"):
        split_spec(":drop=1")


@pytest.mark.parametrize("make_config", [_llama, _gemma3], ids=["llama", "gemma3"])
def test_a_dropped_model_gives_the_logits_of_one_built_without_those_layers(make_config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(6)).eval()
    keep = [0, 3, 5]
    by_hand = _by_hand(model, keep, make_config)
    drop_layers(model, [1, 2, 4])
    assert len(model.model.layers) == model.config.num_hidden_layers == 3
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == [0, 1, 2]
    assert getattr(model.config, "layer_types", None) == getattr(
        by_hand.config, "layer_types", None
    )
    ids = torch.randint(0, 64, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, by_hand(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("make_config", [_llama, _gemma3], ids=["llama", "gemma3"])
def test_decoding_through_the_kv_cache_after_a_drop_matches_the_full_forward(make_config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(5)).eval()
    drop_layers(model, [1, 2])
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :5], use_cache=True)
        steps = [out.logits]
        cache = out.past_key_values
        for t in range(5, 9):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-5)


def test_load_model_drops_layers_of_a_spec_and_the_export_reloads_as_the_pruned_model(tmp_path):
    full = load_model("student-25m", vocab_size=100, seed=3).eval()
    pruned = load_model("student-25m:drop=1-3", vocab_size=100, seed=3).eval()
    assert (len(full.model.layers), len(pruned.model.layers)) == (6, 3)
    for kept, old in zip(pruned.model.layers, [0, 4, 5]):
        for a, b in zip(kept.parameters(), full.model.layers[old].parameters()):
            assert torch.equal(a, b)
    export_hf(pruned, tmp_path / "pruned", tokenizer="qwen3")
    again = load_model(str(tmp_path / "pruned")).eval()
    assert again.config.num_hidden_layers == 3
    ids = torch.randint(0, 100, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, pruned(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        ("tiny:drop=2", r"model 'tiny:drop=2': .*has 2 decoder layers \(0-1\)"),
        ("tiny:drop=0-1", r"removes all 2 decoder layers"),
        ("tiny:drop=x", r"model 'tiny:drop=x': drop='x'"),
    ],
)
def test_a_drop_that_does_not_fit_the_model_is_refused_naming_the_spec(spec, pattern):
    with pytest.raises(ValueError, match=pattern):
        load_model(spec, vocab_size=50)
