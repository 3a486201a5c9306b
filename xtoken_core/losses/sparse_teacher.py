"""Teacher logits given as top-K targets (the ``topk`` transport, a teacher cache), read by P-KL's
teacher side without the dense ``[B, U, W]`` tensor.

P-KL keeps ``vocab_topk`` (X) teacher columns, picked by their largest logit over the used rows,
and takes each row's log-softmax over those columns alone. Both steps need only the dense
tensor's values at a few places: a decoded row (``xtoken_core.wire.topk.decode_topk``) holds its K
ids' logits (log-prob + log-partition) and one fill value (the rest mass spread evenly, plus the
log-partition) everywhere else. So:

* the column maxima are the maxima of the K ids' logits over the used rows, raised to the
  largest fill of a used row ``F`` where that is larger. Exact: a row's fill is at most each of
  its K logits (the decode keeps it so), so a column holding a logit of the row of the largest
  fill is at least ``F`` already, and a column that row lacks gets ``F`` from it;
* the selected columns of every row, ``[B, U, X]``, are the row's fill with its K logits written
  at the positions of its ids among the X columns.

Both are computed from the same fp32 values a dense fp32 decode holds, so the loss (the maxima,
hence the columns ``torch.topk`` picks, ties included, and the ``[B, U, X]`` values) is the one of
the dense fp32 decode, bit for bit, with X / W of its memory (8,192 of 129,280 columns: 6%).

Legend: B batch, U teacher tokens, W teacher vocab, K ids per position, X selected columns,
R flat rows (B * U).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from xtoken_core.ops.transfer import to_device
from xtoken_core.wire.topk import LOG_FLOOR, TopK, check_targets, decode_topk

__all__ = ["FILL_LOG_PROB_FLOOR", "SparseTeacher", "dense_teacher_logits"]

#: The least log-prob a row's fill gets in :meth:`SparseTeacher.chunk_mean_log_softmax`: ``exp``
#: of it is 0 in fp32 (below its least subnormal, e^-103), as of the decode's floor, while the
#: sums that add and take it away keep fp32's precision of the log-probs.
FILL_LOG_PROB_FLOOR = -200.0


@dataclass(frozen=True)
class SparseTeacher:
    """One teacher's logits of a micro-batch as top-K targets, on the loss's device.

    Attributes:
        targets: :class:`~xtoken_core.wire.topk.TopK` of ``[B, U]`` positions (ids, log-probs,
            rest, log-partition), on the device.
        width: W, the teacher vocab.
    """

    targets: TopK
    width: int

    @classmethod
    def from_targets(
        cls,
        targets: TopK,
        width: int,
        device: torch.device | str | None = None,
        *,
        checked: bool = False,
    ) -> SparseTeacher:
        """Targets moved to ``device`` (the ids as int64), checked as ``decode_topk`` checks them
        unless ``checked`` (the caller checked them, or a copy of them on the host: the id check
        reads GPU ids back, a sync).

        Raises:
            ValueError: what :func:`~xtoken_core.wire.topk.check_targets` refuses (shapes,
                dtypes, K, ids outside the vocab).
        """
        if not checked:
            check_targets(targets, width)
        ids, logprobs, rest, lse = targets
        device = torch.device(device) if device is not None else ids.device
        # host targets (the topk transport's) go through pinned memory: no host wait mid-step
        moved = TopK(
            to_device(ids, device, torch.int64),
            to_device(logprobs, device),
            to_device(rest, device, torch.float32),
            to_device(lse, device, torch.float32),
        )
        return cls(moved, int(width))

    # ------------------------------------------------------------------ tensor-like facts

    @property
    def shape(self) -> torch.Size:
        """``[B, U, W]``, the dense tensor's shape."""
        return torch.Size((*self.targets.ids_NK.shape[:-1], self.width))

    def dim(self) -> int:
        """3, as the dense tensor's."""
        return len(self.shape)

    @property
    def device(self) -> torch.device:
        """Where the targets are."""
        return self.targets.ids_NK.device

    @property
    def dtype(self) -> torch.dtype:
        """fp32: the dtype of the values it yields (the backends' dtype checks read it)."""
        return torch.float32

    def detach(self) -> SparseTeacher:
        """Itself: the targets are constants."""
        return self

    @property
    def k(self) -> int:
        """K, the ids kept per position."""
        return self.targets.k

    # ------------------------------------------------------------------ values

    def top_logits(self) -> torch.Tensor:
        """``[B, U, K]`` fp32 logits of the K ids (log-prob + log-partition), as decoded."""
        ids, logprobs, _, lse = self.targets
        return logprobs.to(torch.float32) + lse[..., None]

    def fill(self) -> torch.Tensor:
        """``[B, U]`` fp32 value of every other id, as decoded (``decode_topk``'s)."""
        _, _, rest, lse = self.targets
        W, K = self.width, self.k
        if W > K:
            fill = (rest.to(torch.float32) - math.log(W - K)).clamp_min(LOG_FLOOR)
        else:
            fill = torch.full_like(lse, LOG_FLOOR)
        return torch.minimum(fill + lse, self.top_logits().amin(-1))  # decode_topk's

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[B, U, W]`` logits (``decode_topk``)."""
        return decode_topk(self.targets, self.width, device=self.device, dtype=dtype)

    def column_max(self, rows_R: torch.Tensor) -> torch.Tensor:
        """``[W]`` fp32 largest logit of each column over the used rows (``rows_R >= 0``; -inf
        where no row is used): the dense tensor's masked ``amax``, exactly (module docstring)."""
        W, K = self.width, self.k
        used_R = (rows_R.reshape(-1) >= 0).to(self.device)
        z_RK = self.top_logits().reshape(-1, K)
        ids_RK = self.targets.ids_NK.reshape(-1, K)
        z_RK = z_RK.masked_fill(~used_R[:, None], float("-inf"))
        max_W = torch.full((W,), float("-inf"), dtype=torch.float32, device=self.device)
        max_W.scatter_reduce_(0, ids_RK.reshape(-1), z_RK.reshape(-1), "amax")
        if W > K:  # ids outside a row's K hold its fill
            fill_R = self.fill().reshape(-1).masked_fill(~used_R, float("-inf"))
            top_fill = fill_R.max() if fill_R.numel() else max_W.new_tensor(float("-inf"))
            max_W = torch.maximum(max_W, top_fill)
        return max_W

    def columns(self, idx_X: torch.Tensor) -> torch.Tensor:
        """``[B, U, X]`` fp32 logits of columns ``idx_X`` (distinct ids): the dense tensor's
        ``[..., idx_X]``, exactly."""
        lead = tuple(self.targets.ids_NK.shape[:-1])
        K, X = self.k, int(idx_X.numel())
        pos_W = torch.full((self.width,), -1, dtype=torch.int64, device=self.device)
        pos_W[idx_X.to(self.device)] = torch.arange(X, device=self.device)
        pos_RK = pos_W[self.targets.ids_NK.reshape(-1, K)]
        # an id outside the columns goes to a spare column of its own (X + its rank): every
        # index of a row distinct, so the scatter is deterministic
        spare_K = torch.arange(X, X + K, device=self.device)
        pos_RK = torch.where(pos_RK >= 0, pos_RK, spare_K)
        out_RXK = self.fill().reshape(-1, 1).expand(-1, X + K).contiguous()
        out_RXK.scatter_(1, pos_RK, self.top_logits().reshape(-1, K))
        return out_RXK[:, :X].reshape(*lead, X).contiguous()

    def chunk_mean_log_softmax(
        self,
        nidx_R: torch.Tensor,
        sizes_N: torch.Tensor,
        temperature: float,
        idx_X: torch.Tensor,
    ) -> torch.Tensor:
        """``[N, X]`` fp32 chunk means of ``log_softmax(z[r, idx_X] / T)`` over each chunk's rows,
        ``z`` the dense logits, made without any ``[B, U, X]`` tensor (P-KL's teacher side; X may
        be the whole vocab). A row's log-softmax is its fill less its log-partition over the
        columns everywhere, plus its logit less its fill at its ids among the columns: the chunk
        means are a per-chunk base and those corrections, added at their places. Equal to the
        dense tensor's within fp32 rounding (another order of the same sums), except that a
        fill's log-prob is at least :data:`FILL_LOG_PROB_FLOOR` (a fill at the decode's floor,
        ~-1e4 when no rest is left, would leave ~1e-3 of its cancellation in every column; both
        are probability 0 in fp32).

        Args:
            nidx_R: ``[B * U]`` int64 chunk of each row (-1: none).
            sizes_N: ``[N]`` rows per chunk (a chunk without rows gives a row of zeros).
            temperature: T.
            idx_X: ``[X]`` distinct column ids.
        """
        K, X, N = self.k, int(idx_X.numel()), int(sizes_N.numel())
        device = self.device
        pos_W = torch.full((self.width,), -1, dtype=torch.int64, device=device)
        pos_W[idx_X.to(device)] = torch.arange(X, device=device)
        pos_RK = pos_W[self.targets.ids_NK.reshape(-1, K)]
        in_RK = pos_RK >= 0
        z_RK = self.top_logits().reshape(-1, K) / temperature
        f_R = self.fill().reshape(-1) / temperature
        others_R = (X - in_RK.sum(-1)).to(torch.float32)  # kept columns holding the fill
        terms_RK1 = torch.cat(
            [z_RK.masked_fill(~in_RK, float("-inf")), (others_R.log() + f_R)[:, None]], dim=-1
        )
        lse_R = torch.logsumexp(terms_RK1, dim=-1)
        nidx_R = nidx_R.reshape(-1).to(device)
        n_R = nidx_R.clamp_min(0)
        inv_R = (nidx_R >= 0).to(torch.float32) / sizes_N.to(device, torch.float32).clamp_min(1)[
            n_R
        ]
        fill_lp_R = (f_R - lse_R).clamp_min(FILL_LOG_PROB_FLOOR)
        base_N = torch.zeros(N, dtype=torch.float32, device=device)
        base_N.index_add_(0, n_R, fill_lp_R * inv_R)
        out_NX = base_N[:, None].expand(N, X).contiguous()
        lp_RK = z_RK - lse_R[:, None]
        corr_RK = ((lp_RK - fill_lp_R[:, None]) * inv_R[:, None]).masked_fill(~in_RK, 0.0)
        flat_RK = n_R[:, None] * X + pos_RK.clamp_min(0)
        out_NX.view(-1).index_add_(0, flat_RK.reshape(-1), corr_RK.reshape(-1))
        return out_NX

    def finite_values(self) -> torch.Tensor:
        """``[B, U, K]`` the values an input check reads (the K logits: a NaN or an infinite
        log-prob or log-partition shows in them)."""
        return self.top_logits()


def dense_teacher_logits(
    logits: torch.Tensor | SparseTeacher, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``logits`` as a dense ``[B, U, W]`` tensor (targets decoded into ``dtype``)."""
    return logits.dense(dtype) if isinstance(logits, SparseTeacher) else logits
