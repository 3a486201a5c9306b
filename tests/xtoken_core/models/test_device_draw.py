"""A preset drawn where it goes, a generator per tensor (xtoken_core.models.device_draw): the same
weights for the same seed, transformers' initialisation, a tied output layer drawn once."""

from __future__ import annotations

import pytest
import torch

from xtoken_core.models import load_model
from xtoken_core.models.device_draw import draw_model, seed_of
from xtoken_core.models.presets import PRESETS


def _tiny(seed: int, device: str = "cpu", dtype=torch.float32) -> torch.nn.Module:
    return draw_model(PRESETS["tiny"].config(512), dtype, device, seed)


def test_one_seed_draws_the_same_weights_and_another_seed_others():
    a, b, c = _tiny(3), _tiny(3), _tiny(4)
    for (name, x), y, z in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(x, y), name
        if x.dim() >= 2:
            assert not torch.equal(x, z), name


def test_matrices_are_normal_at_the_configs_range_norms_one_and_buffers_computed():
    model = _tiny(0)
    std = model.config.initializer_range
    for name, p in model.named_parameters():
        if p.dim() == 1:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert abs(float(p.std()) - std) < 0.1 * std and abs(float(p.mean())) < 0.1 * std
    reference = load_model("tiny", vocab_size=512)  # the CPU build: another draw, same buffers
    for (name, mine), theirs in zip(model.named_buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(mine, theirs, msg=name)
    ids = torch.randint(0, 512, (2, 9))
    assert torch.isfinite(model(ids).logits).all()


def test_a_tied_output_layer_is_the_embedding_and_each_tensor_has_its_own_seed():
    model = _tiny(0)
    assert model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert seed_of(0, "a", None) != seed_of(0, "b", None) != seed_of(0, "a", 1)


def test_a_draw_in_bf16_is_the_float32_draw_rounded():
    model = _tiny(0, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    wide = _tiny(0)
    for x, y in zip(model.parameters(), wide.parameters(), strict=True):
        assert torch.equal(x, y.to(torch.bfloat16))


@pytest.mark.gpu
def test_a_preset_loaded_on_a_gpu_is_drawn_there_the_same_for_one_seed():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    a = load_model("qwen3-0.6b", vocab_size=151_680, device="cuda", seed=1)
    b = load_model("qwen3-0.6b", vocab_size=151_680, device="cuda", seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert next(a.parameters()).device.type == "cuda"


@pytest.mark.parametrize("tied", [True, False])
def test_the_output_layer_drawn_alone_is_the_models_in_any_dtype(tied):
    from xtoken_core.models.device_draw import draw_output_layer

    config = PRESETS["tiny"].config(512)
    config.tie_word_embeddings = tied
    model = draw_model(config, torch.bfloat16, "cpu", 5)
    head = draw_output_layer(config, torch.bfloat16, "cpu", 5)
    assert torch.equal(head.weight, model.get_output_embeddings().weight)
    wide = draw_output_layer(config, torch.float32, "cpu", 5)  # the fp32 draw, not rounded
    assert torch.equal(wide.weight.to(torch.bfloat16), head.weight)
