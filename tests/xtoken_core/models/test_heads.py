"""split_lm_head: backbone + output layer give the logits; models it cannot split are refused."""

import pytest
import torch

from xtoken_core.models import load_model, split_lm_head

VOCAB = 300


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", vocab_size=VOCAB, seed=2).eval()


def test_output_layer_of_backbone_hidden_states_equals_the_logits(tiny):
    ids_BU = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(1))
    backbone, lm_head = split_lm_head(tiny)
    with torch.no_grad():
        hidden_BUd = backbone(ids_BU)
        assert hidden_BUd.shape == (3, 11, 64)
        torch.testing.assert_close(lm_head(hidden_BUd), tiny(ids_BU).logits)


def test_split_honours_the_attention_mask_of_right_padded_rows(tiny):
    ids_BU = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    mask_BU = torch.ones(2, 8, dtype=torch.long)
    mask_BU[1, 5:] = 0
    backbone, lm_head = split_lm_head(tiny)
    with torch.no_grad():
        split = lm_head(backbone(ids_BU, mask_BU))
        full = tiny(ids_BU, attention_mask=mask_BU).logits
        alone = tiny(ids_BU[1:, :5]).logits
    torch.testing.assert_close(split[mask_BU.bool()], full[mask_BU.bool()])
    torch.testing.assert_close(split[1, :5], alone[0])


def test_the_parts_share_the_models_parameters(tiny):
    _, lm_head = split_lm_head(tiny)
    assert lm_head.weight is tiny.get_output_embeddings().weight


def test_a_bare_backbone_is_refused(tiny):
    with pytest.raises(ValueError, match="output layer"):
        split_lm_head(tiny.model)


def test_logit_soft_capping_is_refused():
    model = load_model("tiny", vocab_size=VOCAB)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        split_lm_head(model)


@pytest.mark.parametrize("bias", [False, True])
def test_head_into_writes_each_row_of_a_ring_slot_as_the_head_would(bias):
    from xtoken_core.models.heads import head_into

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=bias)
    hidden = torch.randn(2, 5, 8)
    ring = torch.full((3, 7, 11), float("nan"))  # a slot: max_batch 3 x max_length 7
    out = ring[:2, :5]  # rows are contiguous, the view is not
    head_into(head, hidden, out)
    torch.testing.assert_close(out, head(hidden).detach(), rtol=1e-6, atol=1e-6)
    assert torch.isnan(ring[:2, 5:]).all() and torch.isnan(ring[2]).all()  # nothing else written


def test_head_into_of_another_head_or_dtype_copies_its_output():
    from xtoken_core.models.heads import head_into

    torch.manual_seed(1)
    head = torch.nn.Sequential(torch.nn.Linear(8, 11))  # not a plain Linear
    hidden = torch.randn(1, 4, 8)
    out = torch.empty(1, 4, 11, dtype=torch.float64)
    head_into(head, hidden, out)
    torch.testing.assert_close(out, head(hidden).detach().double())
