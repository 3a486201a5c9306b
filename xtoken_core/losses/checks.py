"""Input checks of the loss queued as device reductions and read back with one host sync."""

from __future__ import annotations

import math
from typing import Any

import torch

from xtoken_core.kernels._utils import read_later
from xtoken_core.losses.sparse_teacher import SparseTeacher

__all__ = ["DeferredChecks", "check_target_range", "counted_targets"]


def counted_targets(
    shape_BT: tuple[int, int], token_mask_BT, sample_mask_B, device=None
) -> torch.Tensor:
    """``[B, T]`` bool on ``device``: the positions whose id is a CE target (the token mask's
    and the sample mask's, never the first token)."""
    counted_BT = torch.ones(shape_BT, dtype=torch.bool, device=device)
    if token_mask_BT is not None:
        counted_BT = counted_BT & token_mask_BT.bool().to(counted_BT.device)
    if sample_mask_B is not None:
        counted_BT = counted_BT & sample_mask_B.bool().view(-1, 1).to(counted_BT.device)
    counted_BT[:, :1] = False  # the first token is never a target
    return counted_BT


def check_target_range(lo: int, hi: int, V: int) -> None:
    """Raise when the counted CE targets' ``[lo, hi]`` leaves the student vocab ``[0, V)``."""
    if lo < 0 or hi >= V:
        bad = hi if hi >= V else lo
        raise ValueError(
            f"input_ids hold {bad} at a counted position but the student vocab is "
            f"{V}; mask it out with token_mask or fix the tokenizer/model pairing"
        )


class DeferredChecks:
    """Input checks queued as device reductions and read back with one host sync per device.

    Each check adds small device pieces (fp32 sums, an id min/max, a count), read as fp64
    (exact for ids and counts); :meth:`run` reads them all at once and raises the first failure
    in the order the checks were queued.

    Args:
        hold: the checks of several loss calls, read once: :meth:`run` (which each call makes)
            only notes where the pieces end, and the caller reads them all with :meth:`finish`
            (the fused head, whose blocks are loss calls: no host wait per block). A held
            ``finite`` check keeps its sum only, not the tensor, so a block's logits are freed:
            a non-finite sum fails it (NaN or inf, or finite values whose fp32 sum overflows).
    """

    def __init__(self, hold: bool = False) -> None:
        self._items: list[tuple[str, str, Any, tuple[torch.Tensor, ...]]] = []
        self.hold = hold
        self._after: torch.cuda.Event | None = None

    def _add(self, kind: str, name: str, extra: Any, *pieces: torch.Tensor) -> None:
        # checks read values, never gradients (a denominator may be part of the graph)
        self._items.append((kind, name, extra, tuple(p.detach() for p in pieces)))

    def finite(self, name: str, x: torch.Tensor, total: torch.Tensor | None = None) -> None:
        """Queue the NaN/inf check of ``x``; ``total``: its fp32 sums (any shape: the row sums)
        when a kernel that reads ``x`` anyway made them (the row logsumexp's), else summed
        here."""
        # One fp32-accumulated read instead of isfinite(x).all(), which writes a bool [B, T, V]
        # copy: NaN and inf propagate through the sums. A non-finite sum of finite (huge) values
        # is possible, so only then is the exact element-wise check paid.
        if isinstance(x, SparseTeacher):  # its K logits hold every value it yields
            x, total = x.finite_values(), None
        total = x.sum(dtype=torch.float32) if total is None else total
        self._add("finite", name, None if self.hold else x, total)

    def id_range(self, name: str, ids_BT: torch.Tensor, num_chunks: int) -> None:
        if ids_BT.is_floating_point() or ids_BT.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got dtype {ids_BT.dtype}")
        if ids_BT.numel():
            self._add("ids", name, num_chunks, *torch.aminmax(ids_BT))

    def id_bounds(self, name: str, minmax_2: torch.Tensor, num_chunks: int) -> None:
        """Queue an id-range check from a device ``[min, max]`` pair (min > max: no ids)."""
        self._add("ids", name, num_chunks, minmax_2)

    def ce_targets(self, input_ids_BT, token_mask_BT, sample_mask_B, V: int) -> None:
        counted_BT = counted_targets(
            input_ids_BT.shape, token_mask_BT, sample_mask_B, input_ids_BT.device
        )
        if input_ids_BT.numel():  # uncounted positions read as 0, a valid id
            targets_BT = torch.where(counted_BT, input_ids_BT, 0)
            self._add("targets", "input_ids", V, *torch.aminmax(targets_BT))

    def denominator(self, name: str, global_1: torch.Tensor, local_1: torch.Tensor) -> None:
        """Queue the check of a global valid-chunk count: finite and >= the local count
        (``local_1``: this micro-batch's count on the device)."""
        self._add("denominator", name, None, global_1, local_1)

    def run(self, after: torch.cuda.Event | None = None) -> None:
        """Read every queued piece (one copy and one sync per device) and raise the first
        failed check; held checks (``hold``) only note ``after``: :meth:`finish` reads them.

        The pieces are copied to pinned host memory on a side stream
        (:func:`~xtoken_core.kernels._utils.read_later`), behind the work queued so far, or
        behind ``after`` (a :func:`~xtoken_core.kernels._utils.queue_mark` placed once every
        piece was written: work queued since then is not waited for).

        Raises:
            ValueError: NaN/inf logits, chunk ids out of range, CE targets outside the vocab,
                a global valid-chunk count that is not finite or below the local count.
        """
        if self.hold:
            self._after = after  # behind every earlier call's pieces too (one stream)
            return
        self._read(after)

    def finish(self) -> None:
        """Read the held checks of every call since the last :meth:`finish` (one sync per
        device, behind the last call's pieces) and raise the first failed one.

        Raises:
            ValueError: as :meth:`run`.
        """
        after, self._after = self._after, None
        try:
            if self._items:
                self._read(after)
        finally:
            self._items = []

    def _read(self, after: torch.cuda.Event | None) -> None:
        by_device: dict[torch.device, list[int]] = {}
        for i, item in enumerate(self._items):
            by_device.setdefault(item[3][0].device, []).append(i)
        pending = []
        for slots in by_device.values():
            pieces = [piece for i in slots for piece in self._items[i][3]]
            read = read_later(*pieces, after=after, dtype=torch.float64, as_list=False)
            pending.append((slots, read))
        values: list[torch.Tensor] = [torch.empty(0)] * len(self._items)
        for slots, read in pending:
            flat = read()  # a host tensor: the row sums are long
            at = 0
            for i in slots:
                n = sum(piece.numel() for piece in self._items[i][3])
                values[i], at = flat[at : at + n], at + n
        for (kind, name, extra, _), vals in zip(self._items, values, strict=True):
            if kind == "finite" and not bool(torch.isfinite(vals).all()):
                if extra is None or not bool(torch.isfinite(extra).all()):  # held: the sum
                    raise ValueError(
                        f"{name} holds NaN or inf; check the model forward (fp16 overflow?)"
                    )
            elif kind == "ids":
                lo, hi = int(vals[0]), int(vals[1])
                if lo <= hi and (lo < -1 or hi >= extra):
                    raise ValueError(
                        f"{name} has ids in [{lo}, {hi}] but must lie in [-1, {extra}) "
                        f"(num_chunks = alignment_pair_valid.shape[1] = {extra}); "
                        "re-run the aligner or widen alignment_pair_valid"
                    )
            elif kind == "denominator":
                given, local = float(vals[0]), float(vals[1])
                if not math.isfinite(given) or given < local:
                    raise ValueError(
                        f"{name} is {given:g}; it must be finite and at least this micro-batch's "
                        f"{local:g} valid chunks (it sums them over the step's micro-batches and "
                        "the DP ranks): pass count_valid(micro_batches)['global_valid_chunks']"
                    )
            elif kind == "targets":
                check_target_range(int(vals[0]), int(vals[1]), extra)
