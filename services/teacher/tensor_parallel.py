"""A tensor-parallel teacher group: k processes (torchrun) that split one teacher model.

Engine: torch DTensor's ``parallelize_module`` (docs/design.md, "A teacher larger than one
GPU"); the model's split and each rank's shards are ``services/teacher/shards.py``: rank r
computes the logits of its vocab columns ``[lo_r, hi_r)`` only.

Serving (``TensorParallelTeacher``, a :class:`~services.teacher.worker.TeacherWorker`): rank 0
alone talks to the queue; it sends each batch of requests (ids, slots, ring descriptors) to the
other ranks over the group's host (gloo) group, and every rank runs the forward on its shards.
Ring transports: rank 0 owns each ring; the other ranks open it (``LogitRingSliceWriter``) and
each writes its own vocab columns of the slot; after a barrier rank 0 publishes. ``hidden``:
the hidden states are replicated, rank 0 sends them. ``topk``: the ranks all-gather whole logit
rows and rank 0 sends their top-K (a gather of ``[R, U, W]`` per forward). A teacher cache's
build (``services/cache/group.py``) sends its batches with :meth:`TensorParallelTeacher.send_batch`
and the other ranks serve them with its own step (``follow(serve)``).

Legend: B rows, U tokens, R rows of one forward, W vocab, d hidden size, k the group's ranks.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from services.common import lifecycle
from services.protocol.names import QUEUE_TRANSPORTS
from services.protocol.teacher import Request
from services.teacher.config import TeacherConfig, check_tensor_parallel
from services.teacher.shards import build_sharded_model, column_bounds, model_config, shard_model
from services.teacher.worker import TeacherWorker

logger = logging.getLogger(__name__)

__all__ = [
    "TeacherGroup",
    "TensorParallelTeacher",
    "check_world_size",
    "group_env",
    "model_config",
]

# Seconds a rank waits in one collective (a forward, a message from rank 0) before it fails:
# rank 0 sends a keep-alive every KEEP_ALIVE_S while idle, so only a hung group waits this long.
GROUP_TIMEOUT_S = 1800.0
KEEP_ALIVE_S = 10.0


def group_env() -> tuple[int, int, int]:
    """``(rank, world size, local rank)`` from torchrun's environment (0, 1, 0 without it).

    Raises:
        ValueError: ``RANK`` outside ``[0, WORLD_SIZE)`` or not an int.
    """
    try:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError as e:
        raise ValueError(f"torchrun's RANK / WORLD_SIZE / LOCAL_RANK are not ints: {e}") from None
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside [0, WORLD_SIZE={world})")
    return rank, world, local


def check_world_size(config: TeacherConfig) -> tuple[int, int, int]:
    """torchrun's ``(rank, world size, local rank)``, checked against ``teacher.tensor_parallel``.

    Raises:
        ValueError: a world size other than ``teacher.tensor_parallel`` (one line: how to start
            the group, or the setting that would match).
    """
    rank, world, local = group_env()
    size = config.tensor_parallel
    if world != size:
        raise ValueError(
            f"teacher.tensor_parallel={size} but this teacher group has WORLD_SIZE={world} "
            f"processes; start it with torchrun --nproc-per-node {size}, or set "
            f"teacher.tensor_parallel: {world}"
        )
    return rank, world, local


# ----------------------------------------------------------------------------- the group


@dataclasses.dataclass
class TeacherGroup:
    """This process's place in a tensor-parallel teacher group.

    Attributes:
        rank: this rank (0 talks to the queue).
        size: the group's ranks (``teacher.tensor_parallel``).
        device: this rank's device (``cuda:LOCAL_RANK`` on CUDA).
        mesh: the 1-D device mesh the model is split over (NCCL on CUDA, gloo on the CPU).
        host: the gloo group of the messages from rank 0 and the slice barrier.
    """

    rank: int
    size: int
    device: torch.device
    mesh: DeviceMesh
    host: Any

    @classmethod
    def start(cls, config: TeacherConfig, model_config: Any = None) -> TeacherGroup:
        """Join the group torchrun started (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
        ``MASTER_ADDR``, ``MASTER_PORT``), after checking the settings against it.

        Args:
            config: the teacher settings (``tensor_parallel``, ``device``).
            model_config: the model's transformers config, checked with
                ``check_tensor_parallel`` before the rendezvous (None: not checked here).

        Returns:
            The group (its process group initialised).

        Raises:
            ValueError: a world size other than ``teacher.tensor_parallel``, a device with an
                index, shapes the size does not divide (each one line naming the setting).
        """
        rank, _, local = check_world_size(config)
        size = config.tensor_parallel
        device = torch.device(config.device)
        if device.type == "cuda":
            if device.index is not None:
                raise ValueError(
                    f"teacher.device={config.device} with teacher.tensor_parallel={size}: each "
                    "rank takes cuda:LOCAL_RANK; set teacher.device: cuda (CUDA_VISIBLE_DEVICES "
                    "picks the group's GPUs)"
                )
            device = torch.device("cuda", local)
            torch.cuda.set_device(device)
        if model_config is not None:
            check_tensor_parallel(size, model_config, repr(config.model))
        timeout = datetime.timedelta(seconds=max(GROUP_TIMEOUT_S, 2 * config.lease_s))
        if not dist.is_initialized():
            dist.init_process_group(
                "nccl" if device.type == "cuda" else "gloo", timeout=timeout, device_id=(
                    device if device.type == "cuda" else None
                ),
            )  # fmt: skip
        mesh = init_device_mesh(device.type, (size,))
        host = dist.new_group(backend="gloo", timeout=timeout) if device.type == "cuda" else None
        logger.info("[teacher] rank %d of a tensor-parallel group of %d on %s", rank, size, device)
        return cls(rank, size, device, mesh, host)

    def send(self, message: dict[str, Any]) -> None:
        """Rank 0: send ``message`` (msgpack-able) to every other rank."""
        assert self.rank == 0
        payload = msgpack.packb(message, use_bin_type=True)
        size_1 = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size_1, src=0, group=self.host)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0, self.host)

    def receive(self) -> dict[str, Any]:
        """Another rank: the next message of rank 0 (waits for it)."""
        assert self.rank != 0
        size_1 = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size_1, src=0, group=self.host)
        payload_N = torch.empty(int(size_1[0]), dtype=torch.uint8)
        dist.broadcast(payload_N, src=0, group=self.host)
        return msgpack.unpackb(payload_N.numpy().tobytes(), raw=False, strict_map_key=False)

    def written(self, device: torch.device | None = None) -> None:
        """Every rank: this rank's slice writes are done; returns once every rank's are.

        On CUDA the writes are waited for first (this rank's stream, and ``device``'s, the
        ring's GPU), so that rank 0's publish, which follows, covers them.
        """
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
            if device is not None and device.type == "cuda" and device != self.device:
                torch.cuda.current_stream(device).synchronize()
        dist.barrier(group=self.host)

    def gather_columns(self, local_RW: torch.Tensor, width: int) -> torch.Tensor:
        """The whole ``[..., W]`` of every rank's columns ``[..., hi - lo]`` (an all-gather)."""
        chunk = -(-width // self.size)
        pad = chunk - local_RW.shape[-1]
        if pad:
            local_RW = torch.nn.functional.pad(local_RW, (0, pad))
        parts = [torch.empty_like(local_RW) for _ in range(self.size)]
        dist.all_gather(parts, local_RW.contiguous(), group=self.mesh.get_group())
        return torch.cat(parts, dim=-1)[..., :width]

    def all_gather(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``local`` (one shape and dtype on every rank), in rank order."""
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.mesh.get_group())
        return parts

    def barrier(self) -> None:
        """Every rank: returns once every rank of the group has called it."""
        dist.barrier(group=self.host)

    def close(self) -> None:
        """Leave the group (destroys the process group)."""
        if dist.is_initialized():
            dist.destroy_process_group()


class _GatheredHead(torch.nn.Module):
    """An output layer that returns the whole vocab: the local columns, all-gathered (the
    held-out eval reads whole rows)."""

    def __init__(self, head: torch.nn.Module, group: TeacherGroup, width: int) -> None:
        super().__init__()
        self.head, self.group, self.width = head, group, width

    @property
    def weight(self) -> torch.Tensor:
        """The sharded output layer's weight (its global shape is ``[W, d]``)."""
        return self.head.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.gather_columns(self.head(hidden), self.width)


class _GroupRing:
    """One trainer rank's logit ring as a rank of the group sees it: rank 0 holds the
    ``LogitRingWriter`` (acquire, publish), the others a ``LogitRingSliceWriter``; every rank's
    ``buffer`` is its own vocab columns of the slot, and ``publish`` waits for every rank's."""

    def __init__(self, ring: Any, group: TeacherGroup, columns: tuple[int, int]) -> None:
        self.ring, self.group, self.columns = ring, group, columns
        self.descriptor = ring.descriptor

    def acquire(self, timeout_s: float | None = None) -> int:
        assert self.group.rank == 0, "only rank 0 of a group acquires slots"
        return self.ring.acquire(timeout_s=timeout_s)

    def buffer(self, slot: int) -> torch.Tensor:
        if self.group.rank != 0:
            return self.ring.buffer(slot)
        lo, hi = self.columns
        return self.ring.buffer(slot)[:, :, lo:hi]

    def publish(self, slot: int, *, rows: int, length: int, checksum: bool = False) -> dict | None:
        self.group.written(self.ring.device)
        if self.group.rank != 0:
            return None
        return self.ring.publish(slot, rows=rows, length=length, checksum=checksum)

    def abandon(self, slot: int) -> None:
        if self.group.rank == 0:
            self.ring.abandon(slot)

    def in_flight(self) -> list[int]:
        return self.ring.in_flight() if self.group.rank == 0 else []

    def close(self) -> None:
        self.ring.close()


def _encode(request: Request) -> dict[str, Any]:
    def raw(t: torch.Tensor | None) -> bytes | None:
        return None if t is None else t.to(torch.int64).contiguous().numpy().tobytes()

    return {
        "key": request.key,
        "rank": request.rank,
        "shape": list(request.ids_BU.shape),
        "ids": raw(request.ids_BU),
        "lengths": raw(request.lengths_B),
        "positions": raw(request.positions_BU),
    }


def _decode(d: dict[str, Any]) -> Request:
    def tensor(raw: bytes | None, shape: list[int]) -> torch.Tensor | None:
        if raw is None:
            return None
        return torch.from_numpy(np.frombuffer(raw, dtype=np.int64).copy()).reshape(shape)

    B, U = d["shape"]
    return Request(
        d["key"], d["rank"], tensor(d["ids"], [B, U]), tensor(d["lengths"], [B]),
        tensor(d["positions"], [B, U]),
    )  # fmt: skip


class TensorParallelTeacher(TeacherWorker):
    """A teacher worker that is one rank of a tensor-parallel group.

    Rank 0 serves as a :class:`TeacherWorker` does, and each :meth:`compute_many` first sends
    its requests, their slots and any ring not sent yet to the other ranks; the other ranks run
    :meth:`follow`, which serves what rank 0 sends until it says stop. The results (rank 0's)
    are those of a one-process teacher of the same weights, within rounding.

    Args:
        config: the teacher settings (``tensor_parallel`` > 1).
        group: this process's place in the group (:meth:`TeacherGroup.start`).
        model: a model loaded whole on every rank, to shard (tests); default: each rank builds
            its shards (``build_sharded_model``).

    Raises:
        ValueError: as ``build_sharded_model``; a preset with the ``hidden`` transport.
    """

    def __init__(
        self, config: TeacherConfig, group: TeacherGroup, model: torch.nn.Module | None = None
    ) -> None:
        from xtoken_core.models.dtypes import resolve_dtype
        from xtoken_core.models.presets import PRESETS
        from xtoken_core.tokenizers import load_tokenizer

        config = dataclasses.replace(config, device=str(group.device))
        self.group = group
        if model is None:
            if config.transport == "hidden" and config.model in PRESETS:
                raise ValueError(
                    f"teacher.transport=hidden with teacher.tensor_parallel={group.size} and "
                    f"preset {config.model!r}: the trainer builds a preset's output layer as one "
                    "process draws it, which the group's shard-wise draw does not match; use "
                    "transport shm or cuda_ipc, or a checkpoint folder"
                )
            vocab = config.vocab_size or int(load_tokenizer(config.tokenizer).vocab_size)
            model = build_sharded_model(
                config.model, group.mesh, vocab_size=vocab, seed=config.seed, device=group.device,
                dtype=resolve_dtype(config.dtype, config.device),
            )  # fmt: skip
        elif not any(isinstance(p, DTensor) for p in model.parameters()):
            model = shard_model(model, group.mesh, group.device)
        super().__init__(config, model=model)
        self.columns = column_bounds(self.width, group.size, group.rank)
        self.sharded_head = self.lm_head  # each rank's vocab columns
        if config.transport == "topk":  # the top-K of whole rows: the columns all-gathered
            self.lm_head = _GatheredHead(self.sharded_head, group, self.width)
        self._sent: set[int] = set()  # ring instances the other ranks have
        self._last_sent = time.monotonic()

    # ------------------------------------------------------------------ rings

    def ring(self, rank: int) -> Any:
        """The ring of trainer ``rank``: rank 0 allocates it on first use; another rank has it
        from rank 0's message."""
        ring = self.rings.get(rank)
        if ring is None:
            if self.group.rank != 0:
                raise KeyError(f"trainer rank {rank}'s ring was not sent by rank 0 of the group")
            ring = super().ring(rank)  # stores the writer in self.rings; wrapped below
            ring = self.rings[rank] = _GroupRing(ring, self.group, self.columns)
        return ring

    def _attach(self, rank: int, descriptor: dict) -> None:
        """Another rank: open the slice of trainer ``rank``'s ring that rank 0 made."""
        from xtoken_core.ipc.logit_ring import LogitRingSliceWriter

        old = self.rings.get(rank)
        if old is not None and old.descriptor["instance"] == descriptor["instance"]:
            return
        if old is not None:
            old.close()
        writer = LogitRingSliceWriter(descriptor, columns=self.columns)
        self.rings[rank] = _GroupRing(writer, self.group, self.columns)

    # ------------------------------------------------------------------ serving

    def compute_many(
        self, requests: list[Request], slots: list[int | None] | None = None
    ) -> list[dict[str, Any]]:
        """Rank 0: take each request's slot, send the batch to the other ranks, serve it
        together (:meth:`TeacherWorker.compute_many`). Another rank: serve what rank 0 sent."""
        slots = list(slots) if slots is not None else [None] * len(requests)
        if self.group.rank == 0:
            rings = []
            if self.config.transport not in QUEUE_TRANSPORTS:  # a ring slot per request
                for i, request in enumerate(requests):
                    if self.check(request) is not None:
                        continue  # refused alike on every rank, without a slot
                    ring = self.ring(request.rank)
                    if slots[i] is None:
                        slots[i] = ring.acquire()
                    if ring.descriptor["instance"] not in self._sent:
                        rings.append([request.rank, ring.descriptor])
                        self._sent.add(ring.descriptor["instance"])
            self.send_batch(requests, slots, rings)
        return super().compute_many(requests, slots)

    def send_batch(
        self,
        requests: list[Request],
        slots: list[int | None] | None = None,
        rings: list[list[Any]] | None = None,
    ) -> None:
        """Rank 0: send a batch of requests to the other ranks, which serve it in :meth:`follow`.

        Args:
            requests: the batch (every rank runs its forward).
            slots: per request, its slot of its trainer's ring (None: none, or no ring).
            rings: ``[trainer rank, descriptor]`` of each ring the other ranks have not seen.
        """
        assert self.group.rank == 0
        self.group.send(
            {"op": "batch", "rings": rings or [],
             "slots": slots if slots is not None else [None] * len(requests),
             "requests": [_encode(r) for r in requests]}
        )  # fmt: skip
        self._last_sent = time.monotonic()

    def idle(self) -> None:
        """Rank 0, between requests: tell the other ranks the group lives (every
        ``KEEP_ALIVE_S``), so that their wait for the next batch does not time out."""
        if self.group.rank == 0 and time.monotonic() - self._last_sent > KEEP_ALIVE_S:
            self.group.send({"op": "alive"})
            self._last_sent = time.monotonic()

    def follow(self, serve: Callable[[list[Request]], object] | None = None) -> None:
        """Another rank: serve the batches rank 0 sends until it says stop.

        Args:
            serve: what this rank runs for each batch, as rank 0 runs it after
                :meth:`send_batch` (default: :meth:`TeacherWorker.compute_many` with rank 0's
                slots, the serving loop's).
        """
        assert self.group.rank != 0
        while True:
            message = self.group.receive()
            lifecycle.progress()
            op = message["op"]
            if op == "stop":
                return
            if op == "batch":
                for rank, descriptor in message["rings"]:
                    self._attach(rank, descriptor)
                requests = [_decode(d) for d in message["requests"]]
                if serve is None:
                    super().compute_many(requests, message["slots"])
                else:
                    serve(requests)

    # ------------------------------------------------------------------ whole logits

    def logits(self, request: Request) -> torch.Tensor:
        """Full-vocab logits ``[B, U, W]`` of a request on every rank (an all-gather of the
        ranks' columns), no ring. Every rank of the group must call it."""
        hidden_BUd = self.hidden_states(request)
        with torch.inference_mode():
            return self.group.gather_columns(self.sharded_head(hidden_BUd), self.width)

    def evaluate(self, texts: list[str]) -> dict[str, float]:
        """Held-out bits per byte (every rank of the group calls it; whole rows gathered)."""
        head = _GatheredHead(self.sharded_head, self.group, self.width)
        self.model.set_output_embeddings(head)
        try:
            return super().evaluate(texts)
        finally:
            self.model.set_output_embeddings(self.sharded_head)

    def close(self) -> None:
        """Rank 0: tell the other ranks to stop (best effort); then close the rings."""
        if self.group.rank == 0 and not getattr(self, "_stopped", False):
            self._stopped = True
            try:
                self.group.send({"op": "stop"})
            except Exception as e:  # a rank already gone: torchrun ends the group anyway
                logger.warning("[teacher] could not tell the group to stop: %s", e)
        super().close()
