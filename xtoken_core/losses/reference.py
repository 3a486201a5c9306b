"""The shared PyTorch reference of the losses: chunk averages, chunk validity, the student CE
and the combination of the KD and CE terms. Each mode's own reference is in its module of
:mod:`xtoken_core.losses.modes`; together they are the ground truth for the kernels and tests.

Everything here favours being obviously correct over being fast: chunk averages are one-hot
``[B, C, T]`` matrices times ``[B, T, V]`` (O(C*T*V)), and every intermediate is materialized in
the compute dtype (float32 for bf16/fp16/fp32 inputs, float64 for float64 inputs, so that
``torch.autograd.gradcheck`` runs on these functions).

Conventions, chosen where the loss math (docs/design.md) leaves a choice, and followed by the
modes and the kernel path:

* Chunk ids given to the KD functions are already shifted to next-token targets
  (:func:`xtoken_core.losses.utils.shift_chunk_ids`).
* A chunk average is the plain mean over the chunk's positions: of log-probabilities for
  ``S_c``/``U_c``/``L_c`` (so ``exp`` of it is an unnormalized geometric mean), and of projected
  *probabilities* for the P-KL student ``q_c``, which is then renormalized to sum to 1.
* The KD functions return *sums* over valid chunks (already times ``T**2``); the caller divides
  by the global valid-chunk count (all micro-batches, all DP ranks).
* ``correct`` counts valid chunks whose student and teacher argmax agree (:func:`argmax_agree`):
  over the top-k columns (P-KL) or over the common vocabulary (gold; 0 when it is empty).

Legend (shape suffixes in this file):
    B batch, T student tokens, U teacher tokens, V student vocab, W teacher vocab,
    C chunk slots, N valid chunks (flattened over B, C), X the compared columns.
"""

from __future__ import annotations

import logging

import torch

from xtoken_core.losses.utils import chunk_sizes

logger = logging.getLogger(__name__)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 for float64 inputs, else float32 (bf16/fp16 logits are upcast)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------- chunk helpers


def chunk_average_log_probs(
    log_probs_BTV: torch.Tensor, chunk_id_BT: torch.Tensor, max_chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of ``log_probs`` over the positions of every chunk (one-hot bmm).

    Works for any per-position quantity (log-probabilities or probabilities).

    Args:
        log_probs_BTV: ``[B, T, V]`` values.
        chunk_id_BT: ``[B, T]`` int64 in ``[-1, max_chunks)``; -1 belongs to no chunk.
        max_chunks: number of chunk slots C.

    Returns:
        ``([B, C, V] averages, [B, C] sizes)``; an empty chunk averages to 0. Sizes are in the
        values' dtype.
    """
    slots_C = torch.arange(max_chunks, device=chunk_id_BT.device)
    onehot_BCT = (chunk_id_BT.unsqueeze(1) == slots_C.view(1, -1, 1)).to(log_probs_BTV.dtype)
    sizes_BC = onehot_BCT.sum(dim=-1)
    avg_BCV = torch.bmm(onehot_BCT, log_probs_BTV) / sizes_BC.clamp_min(1).unsqueeze(-1)
    return avg_BCV, sizes_BC


def valid_chunk_mask(
    s_sizes_BC: torch.Tensor, t_sizes_BC: torch.Tensor, pair_valid_BC: torch.Tensor
) -> torch.Tensor:
    """Chunks that count: non-empty on both sides and ``pair_valid``.

    Args:
        s_sizes_BC: ``[B, C]`` student chunk sizes.
        t_sizes_BC: ``[B, C]`` teacher chunk sizes.
        pair_valid_BC: ``[B, C]`` bool (fold the sample mask and ``pair_is_correct`` in first).

    Returns:
        ``[B, C]`` bool.
    """
    return (s_sizes_BC > 0) & (t_sizes_BC > 0) & pair_valid_BC.bool()


def chunk_validity(
    student_chunk_id_BT: torch.Tensor,
    teacher_chunk_id_BU: torch.Tensor,
    pair_valid_BC: torch.Tensor,
    *,
    sample_mask_B: torch.Tensor | None = None,
    pair_is_correct_BC: torch.Tensor | None = None,
    exact_token_match_only: bool = False,
) -> torch.Tensor:
    """The full validity gate of the loss math (docs/design.md), from (shifted) chunk ids alone.

    Args:
        student_chunk_id_BT: ``[B, T]`` shifted student chunk ids.
        teacher_chunk_id_BU: ``[B, U]`` shifted teacher chunk ids.
        pair_valid_BC: ``[B, C]`` bool.
        sample_mask_B: ``[B]``; masked samples (0/False) have no valid chunk. None: all count.
        pair_is_correct_BC: ``[B, C]`` bool, needed with ``exact_token_match_only``.
        exact_token_match_only: keep only chunks whose two sides cover identical text.

    Returns:
        ``[B, C]`` bool.

    Raises:
        ValueError: ``exact_token_match_only`` without ``pair_is_correct_BC``.
    """
    C = pair_valid_BC.shape[1]
    mask_BC = pair_valid_BC.bool()
    if sample_mask_B is not None:
        mask_BC = mask_BC & sample_mask_B.bool().view(-1, 1)
    if exact_token_match_only:
        if pair_is_correct_BC is None:
            raise ValueError(
                "exact_token_match_only=True needs alignment_pair_is_correct in the batch"
            )
        mask_BC = mask_BC & pair_is_correct_BC.bool()
    return valid_chunk_mask(
        chunk_sizes(student_chunk_id_BT, C), chunk_sizes(teacher_chunk_id_BU, C), mask_BC
    )


def argmax_agree(a_NX: torch.Tensor, b_NX: torch.Tensor) -> torch.Tensor:
    """Rows whose argmaxes agree (0 when there are no columns).

    Args:
        a_NX: ``[N, X]`` values of one side.
        b_NX: ``[N, X]`` values of the other side.

    Returns:
        Scalar count in ``a_NX``'s dtype.
    """
    if a_NX.shape[-1] == 0:
        return a_NX.new_zeros(())
    return (a_NX.argmax(-1) == b_NX.argmax(-1)).sum().to(a_NX.dtype)


# --------------------------------------------------------------------------- CE and combination


def student_ce_loss(
    student_logits_BTV: torch.Tensor,
    input_ids_BT: torch.Tensor,
    token_mask_BT: torch.Tensor | None = None,
    sample_mask_B: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Student next-token cross-entropy, summed (no temperature).

    The logits at p predict ``input_ids[:, p + 1]``; a target counts when its ``token_mask`` is
    set and its sample is not masked.

    Args:
        student_logits_BTV: ``[B, T, V]`` logits.
        input_ids_BT: ``[B, T]`` student token ids.
        token_mask_BT: ``[B, T]`` (None: every token counts).
        sample_mask_B: ``[B]`` (None: every sample counts).

    Returns:
        ``(nll_sum, correct, num_tokens)`` scalars; only ``nll_sum`` carries gradient.
    """
    B, T, V = student_logits_BTV.shape
    dtype = compute_dtype(student_logits_BTV)
    targets_BT = input_ids_BT[:, 1:].long()
    mask_BT = torch.ones_like(targets_BT, dtype=torch.bool)
    if token_mask_BT is not None:
        mask_BT = mask_BT & token_mask_BT[:, 1:].bool()
    if sample_mask_B is not None:
        mask_BT = mask_BT & sample_mask_B.bool().view(-1, 1)
    safe_targets_BT = torch.where(mask_BT, targets_BT, torch.zeros_like(targets_BT))
    logits_BTV = student_logits_BTV[:, :-1].to(dtype)
    log_probs_BTV = torch.log_softmax(logits_BTV, dim=-1)
    nll_BT = -log_probs_BTV.gather(-1, safe_targets_BT.unsqueeze(-1)).squeeze(-1)
    nll_sum = torch.where(mask_BT, nll_BT, torch.zeros_like(nll_BT)).sum()
    with torch.no_grad():
        correct = ((logits_BTV.argmax(-1) == targets_BT) & mask_BT).sum().to(dtype)
    return nll_sum, correct, mask_BT.sum().to(dtype)


def combine_losses(
    kd: torch.Tensor,
    ce: torch.Tensor,
    *,
    kl_weight: float,
    ce_weight: float,
    dynamic_scaling: bool,
) -> torch.Tensor:
    """Combine the (already normalized) KD and CE terms.

    Static: ``kl_weight * kd + ce_weight * ce``. Dynamic: ``kl_weight * s * kd + ce_weight * ce``
    with ``s = |ce| / |kd|`` detached (0 when ``kd`` is 0), so the KD term has the CE term's
    magnitude while keeping its own gradient direction.

    Args:
        kd: scalar KD term.
        ce: scalar CE term.
        kl_weight: weight of the KD term.
        ce_weight: weight of the CE term.
        dynamic_scaling: use the dynamic scale s.

    Returns:
        Scalar loss.
    """
    if not dynamic_scaling:
        return kl_weight * kd + ce_weight * ce
    kd_abs = kd.detach().abs()
    scale = torch.where(
        kd_abs > 0, ce.detach().abs() / kd_abs.clamp_min(1e-30), torch.zeros_like(kd_abs)
    )
    return kl_weight * scale * kd + ce_weight * ce
