"""A teacher cache built by a tensor-parallel teacher group: ``xtoken cache build`` of a teacher
whose section says ``tensor_parallel: k``, started as ``torchrun --nproc-per-node k -m
services.cli cache build CONFIG --out DIR``.

Every rank runs the sharded forward (``services/teacher/tensor_parallel.py``, the group a run's
teacher is). Rank 0 alone reads the corpus, batches, writes the shards and the manifest: it is a
:class:`~services.cache.build.CacheBuilder` whose worker is the group's rank 0, so resuming,
``--shard i/n`` and the manifest are the one-process build's. Before each forward it sends the
batch to the other ranks with the group's own protocol (``TensorParallelTeacher.send_batch``);
they serve each batch in ``TensorParallelTeacher.follow`` until rank 0 says stop.

Where the top K is computed: each rank encodes its own vocab slice and rank 0 merges. A rank
holds the logits of its columns ``[lo, hi)`` only; the top K over the whole vocab is among the
union of every slice's top K, and the log-partition and the rest mass are log-sum-exps over a
partition of the vocab, so each rank sends, per position, its K largest logits with their ids
and the log-sum-exp of its other logits (its *tail*): ``K + 1`` floats and K ids. Rank 0 takes
the top K of the ``k x K`` candidates; the log-partition is the log-sum-exp of every candidate
and every tail, the rest that of the candidates not taken and the tails; all in fp32 and in log
space, so the targets are the one-process encode's (``xtoken_core.wire.topk.encode_topk``)
within fp32 rounding. Gathering the whole rows to rank 0 instead (what the ``topk`` transport of
a serving group does) would move ``2 W`` bytes a position over the group's links against
``8 K + 4`` here (Qwen's W = 152,064, K = 64: 304 KB against 516 B), hold ``[N, W]`` logits and
their fp32 copy on rank 0, and leave the fp32 work of the whole vocab to one rank while the
others wait; a slice's work is ``1/k`` of it, on every rank at once.

Legend: N positions of a forward (B rows x U tokens), V this rank's vocab columns, K ids kept,
S the group's ranks (one vocab slice each), C the candidates of a position (S x K).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from services.cache.build import BuildSummary, CacheBuilder
from xtoken_core.errors import SettingsError
from xtoken_core.kernels._utils import use_triton
from xtoken_core.kernels.topk_rest import row_lse_rest
from xtoken_core.wire.topk import TopK

logger = logging.getLogger(__name__)

__all__ = [
    "GroupCacheBuilder",
    "build_with_group",
    "check_slices",
    "group_topk",
    "merge_topk",
    "slice_topk",
]

# Elements of one fp32 block of a slice's logits (256 MiB), as encode_topk bounds its own.
_BLOCK_ELEMENTS = 1 << 26


def slice_topk(
    logits_NV: torch.Tensor, k: int, lo: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One vocab slice's part of the top-K targets.

    Args:
        logits_NV: ``[N, V]`` logits of the slice's columns ``[lo, lo + V)``, any float dtype.
        k: ids kept per position (``k <= V``).
        lo: the slice's first vocab id.

    Returns:
        ``(values_NK, ids_NK, tail_N)``: the K largest logits (fp32, decreasing), their vocab
        ids (int32), and the log-sum-exp of the slice's other logits (fp32; ``-inf`` when the
        K are all of them).
    """
    if use_triton(logits_NV):  # one pass over the logits as they are (encode_topk's kernel)
        values_NK, idx_NK = torch.topk(logits_NV, k, dim=-1)
        lse_N, rest_N = row_lse_rest(logits_NV, values_NK)
        return values_NK.float(), (idx_NK + lo).to(torch.int32), rest_N + lse_N
    z_NV = logits_NV.to(torch.float32, copy=True)  # masked in place below
    values_NK, idx_NK = torch.topk(z_NV, k, dim=-1)
    z_NV.scatter_(-1, idx_NK, float("-inf"))
    return values_NK, (idx_NK + lo).to(torch.int32), torch.logsumexp(z_NV, dim=-1)


def merge_topk(
    values_SNK: torch.Tensor, ids_SNK: torch.Tensor, tail_SN: torch.Tensor, k: int
) -> TopK:
    """The top-K targets of the whole vocab from every slice's :func:`slice_topk`.

    Args:
        values_SNK: ``[S, N, K]`` each slice's largest logits (fp32).
        ids_SNK: ``[S, N, K]`` their vocab ids.
        tail_SN: ``[S, N]`` each slice's log-sum-exp of its other logits.
        k: ids kept per position (``k <= S x K``).

    Returns:
        :class:`~xtoken_core.wire.topk.TopK` of the N positions (``[N, K]`` int32 ids and fp32
        log-probs by decreasing log-prob, ``[N]`` fp32 rest and log-partition), as
        ``encode_topk`` of the whole logits gives within fp32 rounding.
    """
    S, N, K = values_SNK.shape
    values_NC = values_SNK.permute(1, 0, 2).reshape(N, S * K).float()
    ids_NC = ids_SNK.permute(1, 0, 2).reshape(N, S * K)
    tail_NS = tail_SN.t().float()
    lse_N = torch.logsumexp(torch.cat([values_NC, tail_NS], dim=-1), dim=-1)
    top_NK, pick_NK = torch.topk(values_NC, k, dim=-1)
    left_NC = values_NC.scatter(-1, pick_NK, float("-inf"))  # the candidates not taken
    rest_N = torch.logsumexp(torch.cat([left_NC, tail_NS], dim=-1), dim=-1) - lse_N
    return TopK(ids_NC.gather(-1, pick_NK).to(torch.int32), top_NK - lse_N[:, None], rest_N, lse_N)


def group_topk(worker: Any, request: Any, k: int) -> TopK | None:
    """Every rank of a group: the forward of a request and this rank's slice of its top K;
    the merged targets on rank 0.

    Args:
        worker: this rank's ``TensorParallelTeacher`` (its ``sharded_head`` computes the
            logits of its columns ``worker.columns``).
        request: the request (``ids_BU``, ``lengths_B``), the same on every rank.
        k: ids kept per position.

    Returns:
        Rank 0: :class:`~xtoken_core.wire.topk.TopK` ``[B, U, K]`` on its device. Another
        rank: None.
    """
    group = worker.group
    lo, hi = worker.columns
    B, U = request.ids_BU.shape
    with torch.inference_mode():
        hidden_Nd = worker.hidden_states(request).reshape(B * U, -1)
        N = hidden_Nd.shape[0]
        sent_NK1 = torch.empty((N, k + 1), dtype=torch.float32, device=hidden_Nd.device)
        ids_NK = torch.empty((N, k), dtype=torch.int32, device=hidden_Nd.device)
        step = max(1, _BLOCK_ELEMENTS // max(hi - lo, 1))
        for start in range(0, N, step):
            stop = min(N, start + step)
            values, ids, tail = slice_topk(worker.sharded_head(hidden_Nd[start:stop]), k, lo)
            sent_NK1[start:stop, :k] = values
            sent_NK1[start:stop, k] = tail
            ids_NK[start:stop] = ids
        sent_S = group.all_gather(sent_NK1)
        ids_S = group.all_gather(ids_NK)
        if group.rank != 0:
            return None
        sent_SNK1 = torch.stack(sent_S)
        targets = merge_topk(sent_SNK1[..., :k], torch.stack(ids_S), sent_SNK1[..., k], k)
    return TopK(*(t.reshape(B, U, *t.shape[1:]) for t in targets))


class GroupCacheBuilder(CacheBuilder):
    """Rank 0's builder of a group: a :class:`CacheBuilder` whose forwards run on every rank.

    Args:
        config: the run config.
        options: the build's options.
        worker: rank 0's ``TensorParallelTeacher`` (the other ranks follow it).
    """

    def __init__(self, config: Any, options: Any, worker: Any) -> None:
        super().__init__(config, options, worker=worker)
        self.forwarding = False  # in a forward: the other ranks are in its collectives

    def targets(self, request: Any) -> TopK:
        """Send the request to the other ranks, run its forward with them, merge the top K."""
        self.worker.send_batch([request])
        self.forwarding = True
        targets = group_topk(self.worker, request, self.k)
        self.forwarding = False
        assert targets is not None
        return targets


def check_slices(k: int, width: int, size: int) -> None:
    """Refuse a K that a rank's vocab slice cannot hold (each slice sends its own top K).

    Raises:
        SettingsError: one line naming K, the slices and the fix.
    """
    from services.teacher.shards import column_bounds
    from xtoken_core.wire.topk import check_top_k

    check_top_k(k, width, "--top-k")
    smallest = min(hi - lo for lo, hi in (column_bounds(width, size, r) for r in range(size)))
    if k > smallest:
        raise SettingsError(
            f"--top-k {k} is over the {smallest} vocab ids of a rank's slice of a group of "
            f"{size} (vocab {width}); keep K <= {smallest} or use fewer ranks"
        )


def build_with_group(builder: CacheBuilder) -> BuildSummary | None:
    """This rank's part of a group's build: rank 0 builds (``builder``'s config and options),
    the others follow its forwards.

    Args:
        builder: the one-process builder of the config and options (its teacher section says
            ``tensor_parallel: k``).

    Returns:
        Rank 0: the :class:`BuildSummary`. Another rank: None.

    Raises:
        ValueError: a world size other than the teacher's ``tensor_parallel`` (one line: start
            the group with torchrun), shapes the size does not divide.
        SettingsError: as :class:`CacheBuilder`; a K over a rank's vocab slice.
    """
    from services.teacher import tensor_parallel as tp

    config = builder.teacher_config()
    tp.check_world_size(config)
    shapes, _ = tp.model_config(config.model, config.vocab_size)
    group = tp.TeacherGroup.start(config, shapes)
    summary: BuildSummary | None = None
    rank0: GroupCacheBuilder | None = None
    followed = False  # rank 0: the other ranks follow it (and wait for its stop)
    try:
        worker = tp.TensorParallelTeacher(config, group)
        check_slices(builder.k, worker.width, group.size)  # alike on every rank
        if group.rank == 0:
            followed = True
            with worker:  # its close tells the other ranks to stop, the build done or failed
                rank0 = GroupCacheBuilder(builder.config, builder.options, worker)
                summary = rank0.run()
        else:
            k = builder.k
            with worker:
                worker.follow(lambda requests: [group_topk(worker, r, k) for r in requests])
        group.barrier()  # every rank is done with the group before any leaves it
    except BaseException:
        # rank 0 failed outside a forward: the other ranks were told to stop and wait here;
        # inside one, they are in its collectives, and torchrun ends them once this rank exits
        if followed and not (rank0 is not None and rank0.forwarding):
            group.barrier()
        raise
    finally:
        group.close()
    return summary
