"""Document-boundary attention: in a packed row each document's logits (and its gradients) are
those of the document alone, in fp32 on the CPU, for the mask forms of sdpa, eager, per-layer-type
masks with sliding windows, and FlexAttention (slow: it compiles)."""

from __future__ import annotations

import pytest
import torch

from xtoken_core.models import load_model, split_lm_head
from xtoken_core.models.documents import (
    document_attention_mask,
    document_ids,
    packed_attention,
    use_packed_attention,
)

VOCAB = 300
LENGTHS = [5, 9, 3]  # three documents, then 3 pad tokens


def _packed_row(seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]
    ids = torch.cat(docs + [torch.zeros(3, dtype=torch.long)])[None]
    positions = torch.cat([torch.arange(n) for n in LENGTHS] + [torch.zeros(3, dtype=torch.long)])
    return docs, ids, positions[None]


def _assert_each_document_as_alone(model, atol: float = 1e-5) -> None:
    docs, ids, positions = _packed_row()
    mask = document_attention_mask(model.config, positions)
    with torch.no_grad():
        packed = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[0]
        assert torch.isfinite(packed).all()  # pads attend to themselves: no empty row
        start = 0
        for doc in docs:
            alone = model(input_ids=doc[None]).logits[0]
            torch.testing.assert_close(packed[start : start + len(doc)], alone, rtol=0, atol=atol)
            start += len(doc)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", vocab_size=VOCAB, seed=2).eval()


def test_document_ids_start_a_document_at_each_position_zero():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 0], [0, 1, 2, 3, 4, 5, 0, 1]])
    assert document_ids(positions).tolist() == [[0, 0, 0, 1, 1, 2, 3, 4], [0] * 6 + [1, 1]]


def test_the_sdpa_mask_is_causal_and_never_crosses_a_document(tiny):
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    mask = document_attention_mask(tiny.config, positions)[0, 0]
    assert mask.dtype == torch.bool
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


def test_each_document_of_a_packed_row_has_its_logits_alone(tiny):
    _assert_each_document_as_alone(tiny)


def test_without_the_mask_a_later_document_sees_the_earlier_ones(tiny):
    docs, ids, positions = _packed_row()
    with torch.no_grad():
        leaky = tiny(input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids))
        alone = tiny(input_ids=docs[1][None]).logits[0]
    assert (leaky.logits[0, 5:14] - alone).abs().max() > 1e-3


def test_each_document_gets_the_gradients_it_gets_alone():
    model = load_model("tiny", vocab_size=VOCAB, seed=2)
    docs, ids, positions = _packed_row(seed=1)
    mask = document_attention_mask(model.config, positions)
    # the loss of the second document only: no gradient may come from the others
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    logits[0, 5:14].sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model(input_ids=docs[1][None]).logits[0].sum().backward()
    for name, p in model.named_parameters():  # fp32 rounding, relative to each gradient's size
        scale = float(p.grad.abs().max())
        torch.testing.assert_close(packed[name], p.grad, rtol=1e-5, atol=1e-6 * scale)


def test_the_eager_mask_is_additive_and_gives_the_same_logits():
    model = load_model("tiny", vocab_size=VOCAB, seed=2).eval()
    use_packed_attention(model, "eager")
    mask = document_attention_mask(model.config, torch.tensor([[0, 1, 0]]))
    assert mask.dtype == torch.float32 and mask[0, 0, 2, 0] == torch.finfo(torch.float32).min
    _assert_each_document_as_alone(model)


def test_sliding_window_layers_keep_their_window_within_each_document():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=4,
        use_sliding_window=True,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    masks = document_attention_mask(model.config, torch.tensor([[0, 1, 2, 3, 4, 5]]))
    assert set(masks) == {"full_attention", "sliding_attention"}
    assert masks["full_attention"][0, 0, 5, 0] and not masks["sliding_attention"][0, 0, 5, 0]
    _assert_each_document_as_alone(model)


def test_the_backbone_takes_the_document_mask_and_positions(tiny):
    docs, ids, positions = _packed_row()
    backbone, lm_head = split_lm_head(tiny)
    mask = document_attention_mask(tiny.config, positions)
    with torch.no_grad():
        hidden = backbone(ids, mask, positions)
        full = tiny(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(lm_head(hidden), full)


def test_packed_attention_is_flex_on_cuda_and_sdpa_elsewhere():
    assert packed_attention("auto", "cuda:0") == "flex_attention"
    assert packed_attention("auto", "cpu") == "sdpa"
    assert packed_attention("sdpa", "cuda") == "sdpa"
    with pytest.raises(ValueError, match="packed_attention='dense': use one of auto"):
        packed_attention("dense", "cpu")


def test_an_attention_without_a_document_mask_is_refused_naming_the_fix(tiny):
    config = type("C", (), {"_attn_implementation": "flash_attention_2"})()
    with pytest.raises(ValueError, match="runs 'flash_attention_2'.*set pack: false"):
        document_attention_mask(config, torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.slow
def test_flex_attention_with_the_document_block_mask_gives_the_same_logits():
    from torch.nn.attention.flex_attention import BlockMask

    model = load_model("tiny", vocab_size=VOCAB, seed=2).eval()
    use_packed_attention(model, "flex_attention")
    assert isinstance(document_attention_mask(model.config, _packed_row()[2]), BlockMask)
    _assert_each_document_as_alone(model)
