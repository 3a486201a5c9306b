"""Bits per byte of a causal LM on texts: a quality metric that does not depend on the tokenizer.

Every token of every text is scored. A text is tokenized without special tokens and cut into
windows of at most ``ctx`` tokens; each window is fed as ``[c] + window[:-1]`` where ``c`` is the
tokenizer's BOS (EOS when it has no BOS), so the first token of each window is predicted from
that context token alone. bits = sum over tokens of -log2 p(token); bytes = the UTF-8 bytes the
scored tokens cover (their byte spans). The output layer runs over the real positions only, in
row chunks, so [B, L, V] logits are never materialized.

Shape legend: B windows in a batch, L window length, d hidden size, V vocab (logits), M scored
positions of a batch, R rows of one output-layer chunk.
"""

from __future__ import annotations

import logging
import math

import torch

from xtoken_core.models.heads import split_lm_head

logger = logging.getLogger(__name__)

# Output-layer rows per chunk: R * V float32 logits stay around 256 MB.
_CHUNK_ELEMENTS = 1 << 26


def _context_id(tokenizer) -> int:
    """The context token every window starts with: BOS, else EOS."""
    for tid in (tokenizer.bos_id, tokenizer.eos_id):
        if tid is not None:
            return int(tid)
    raise ValueError(
        f"tokenizer {tokenizer.name!r} has neither a BOS nor an EOS id, so a window has no "
        "context token to start from; pass a tokenizer with one of them"
    )


def _windows(tokenizer, texts: list[str], ctx: int) -> tuple[list[tuple[list, list]], int]:
    """Cut the tokenized texts into scored windows.

    Returns:
        ([(inputs, targets)] with len(inputs) == len(targets) <= ctx, covered bytes).
    """
    context = _context_id(tokenizer)
    windows: list[tuple[list, list]] = []
    covered = 0
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids = enc.ids.tolist()
        covered += int((enc.spans[:, 1] - enc.spans[:, 0]).sum()) if len(ids) else 0
        for a in range(0, len(ids), ctx):
            targets = ids[a : a + ctx]
            windows.append(([context] + targets[:-1], targets))
    return windows, covered


def bits_per_byte(
    model: torch.nn.Module,
    tokenizer,
    texts: list[str],
    *,
    ctx: int,
    batch_size: int = 8,
    device: str | torch.device = "cpu",
) -> dict:
    """Bits per byte (and per-token accuracy) of a causal LM on texts, every token scored.

    Args:
        model: a transformers causal LM (see ``split_lm_head``), already on ``device``; it is
            run in eval mode and left in the mode it had.
        tokenizer: the model's XTokenizer (``load_tokenizer``); its ids must be < the model's
            vocab.
        texts: the texts (empty ones are skipped).
        ctx: window length in tokens (>= 1): longer texts are split into windows, each starting
            from the context token.
        batch_size: windows per forward pass (>= 1).
        device: where the inputs go (the model's device).

    Returns:
        {"bits_per_byte": float, "bytes": int, "tokens": int, "accuracy": float}: accuracy is
        the fraction of tokens that are the model's argmax prediction.

    Raises:
        ValueError: ``ctx`` or ``batch_size`` < 1, ``texts`` not a list of strings or covering
            no byte, or a tokenizer without BOS/EOS.
    """
    for name, value in (("ctx", ctx), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"bits_per_byte: {name} must be an int >= 1, got {value!r}")
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise ValueError("bits_per_byte: texts must be a list of strings (not one string)")
    windows, covered = _windows(tokenizer, list(texts), ctx)
    if covered == 0:
        raise ValueError(
            f"bits_per_byte: the {len(texts)} texts cover no byte; pass non-empty texts"
        )
    # Longest first: windows of similar length share a batch, so little is padded.
    windows.sort(key=lambda w: -len(w[0]))
    backbone, lm_head = split_lm_head(model)
    nats = 0.0
    tokens = 0
    correct = 0
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for b in range(0, len(windows), batch_size):
                batch = windows[b : b + batch_size]
                length = len(batch[0][0])
                inputs_BL = torch.zeros(len(batch), length, dtype=torch.long)
                targets_BL = torch.zeros(len(batch), length, dtype=torch.long)
                mask_BL = torch.zeros(len(batch), length, dtype=torch.long)
                for i, (inp, tgt) in enumerate(batch):
                    inputs_BL[i, : len(inp)] = torch.tensor(inp)
                    targets_BL[i, : len(tgt)] = torch.tensor(tgt)
                    mask_BL[i, : len(inp)] = 1
                inputs_BL, mask_BL = inputs_BL.to(device), mask_BL.to(device)
                hidden_BLd = backbone(inputs_BL, mask_BL)
                keep_BL = mask_BL.bool()
                hidden_Md = hidden_BLd[keep_BL]
                targets_M = targets_BL.to(device)[keep_BL]
                rows = max(1, _CHUNK_ELEMENTS // max(1, int(lm_head.weight.shape[0])))
                for r in range(0, hidden_Md.shape[0], rows):
                    logits_RV = lm_head(hidden_Md[r : r + rows]).float()
                    target_R = targets_M[r : r + rows]
                    picked_R = logits_RV.gather(1, target_R[:, None])[:, 0]
                    nats += float((torch.logsumexp(logits_RV, dim=1) - picked_R).sum())
                    correct += int((logits_RV.argmax(dim=1) == target_R).sum())
                tokens += int(targets_M.shape[0])
    finally:
        model.train(was_training)
    bits = nats / math.log(2)
    result = {
        "bits_per_byte": bits / covered,
        "bytes": covered,
        "tokens": tokens,
        "accuracy": correct / tokens,
    }
    logger.info(
        "[eval] %.4f bits/byte over %d bytes, %d tokens (accuracy %.3f)",
        result["bits_per_byte"],
        covered,
        tokens,
        result["accuracy"],
    )
    return result
