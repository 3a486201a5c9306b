"""Teacher worker logic: requests (B teacher-id rows each) in, full-vocab logits in ring slots out.

``TeacherWorker`` owns the teacher model and its logit rings and knows nothing of sockets: the
process shell (main.py) claims requests from the queue, calls :meth:`TeacherWorker.compute_many`
(or :meth:`TeacherWorker.compute` for one) and writes the returned fields back onto each
request record.

Requests of one length that wait together share one forward (:meth:`TeacherWorker.fits`); each
still gets its own slot and its own result, bitwise what a forward of its own would give
wherever the kernels' rows do not depend on how many rows run together (see ``fits``). The
decoder layers are compiled (``teacher.compile``, services/teacher/compile.py).

Transports (DESIGN.md, "Teacher logits"):
* ``shm`` / ``cuda_ipc``: the logits go into a slot of a ring allocated and exported once per
  trainer rank served; the result names the slot (a handle with a generation). The trainer
  reads the slot in place and releases it after its backward; the shell serves a request only
  when its rank's ring has a free slot (:meth:`try_acquire`).
* ``hidden``: the final (post-norm) hidden states travel through the queue; the trainer applies
  the teacher's output layer itself. About W/d fewer bytes than logits.

Legend: B rows of a request, U its longest row, R rows of one forward (the B of every request
it serves), W the teacher vocab (logits width), d hidden size.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import field
from typing import Any, Literal

import torch

from services.protocol.names import TRANSPORTS, hidden_field, new_instance, result_field
from services.protocol.teacher import Request, Result, hidden_column
from services.teacher.compile import RegionalCompile, resolve_compile, resolve_cuda_graphs
from xtoken_core.models.dtypes import resolve_dtype
from xtoken_core.models.heads import head_into

logger = logging.getLogger(__name__)

# ``resolve_dtype`` and ``TRANSPORTS`` are importable from here too (their former home).
__all__ = ["TRANSPORTS", "TeacherConfig", "TeacherWorker", "resolve_dtype"]


@dataclasses.dataclass
class TeacherConfig:
    """Settings of one teacher process (the ``teacher`` section of a run config)."""

    queue: str = field(
        default="tcp://127.0.0.1:5555",
        metadata={"help": "queue server address", "context": "queue", "trained": False},
    )
    partition: str = field(
        default="train",
        metadata={"help": "sample partition of the run", "context": "partition", "trained": False},
    )
    group: int = field(
        default=0,
        metadata={
            "help": "teacher group served: requests of <partition>.teacher<group>",
            "trained": False,
        },
    )
    model: str = field(
        default="smollm2",
        metadata={
            "help": "teacher model: a local HF directory, a preset name, or smollm2",
            "path": "model",
            "trained": True,
        },
    )
    tokenizer: str = field(
        default="smollm2",
        metadata={
            "help": "teacher tokenizer name or path",
            "context": "teacher_tokenizer",
            "path": "tokenizer",
            "trained": True,
        },
    )
    vocab_size: int | None = field(
        default=None,
        metadata={
            "help": "model vocab of a preset model (default: the tokenizer's vocab)",
            "trained": True,
        },
    )
    device: str = field(default="cpu", metadata={"help": "cpu, cuda or cuda:N", "trained": False})
    dtype: str = field(
        default="auto",
        metadata={"help": "model dtype: auto (bfloat16 on cuda, else float32)", "trained": False},
    )
    transport: Literal["shm", "cuda_ipc", "hidden"] = field(
        default="shm",
        metadata={"help": "how logits reach the trainer: shm, cuda_ipc, hidden", "trained": False},
    )
    slots: int = field(
        default=2, metadata={"help": "slots of the logit ring (>= 2)", "trained": False}
    )
    max_batch: int = field(
        default=8, metadata={"help": "most rows of one request (slot rows)", "trained": False}
    )
    forward_rows: int = field(
        default=8,
        metadata={
            "help": "most rows of one forward: requests of one length that wait together share "
            "a forward up to this many rows (1: a forward per request; a larger request still "
            "gets one of its own)",
            "trained": False,
        },
    )
    max_length: int = field(
        default=2048,
        metadata={"help": "longest teacher row (the teacher context length)", "trained": False},
    )
    logits_dtype: str = field(
        default="bfloat16",
        metadata={"help": "dtype of the logits in the ring / hidden states", "trained": False},
    )
    compile: bool | None = field(
        default=None,
        metadata={
            "help": "torch.compile each decoder layer (dynamic shapes, so no recompile per "
            "length); unset: on for cuda, off on cpu; a failed compile falls back to eager",
            "trained": False,
        },
    )
    cuda_graphs: bool = field(
        default=False,
        metadata={
            "help": "replay each compiled decoder layer as CUDA graphs, one per row count and "
            "length: the host launches one graph per layer instead of one kernel at a time "
            "(needs compiled layers on a cuda device; measured: no change to the pipeline's "
            "tokens/s at 1x4096 or 4x2048, so it is off by default)",
            "trained": False,
        },
    )
    pack: bool = field(
        default=False,
        metadata={
            "help": "requests hold packed rows of several documents (collator.pack; xtoken run "
            "sets it): the model runs packed_attention",
            "trained": True,
        },
    )
    packed_attention: Literal["auto", "flex_attention", "sdpa"] = field(
        default="auto",
        metadata={
            "help": "attention of packed rows: flex_attention (a document BlockMask), sdpa (a "
            "[B, 1, T, T] mask) or auto (flex_attention on cuda, sdpa elsewhere)",
            "trained": False,
        },
    )
    checksum: bool = field(
        default=False,
        metadata={
            "help": "put a checksum of each slot (int64 sum of its bits) in its handle",
            "trained": False,
        },
    )
    lease_s: float = field(
        default=120.0,
        metadata={"help": "lease of a claimed request (redelivered if we die)", "trained": False},
    )
    claim_timeout_s: float = field(
        default=1.0, metadata={"help": "server-side wait of a claim", "trained": False}
    )
    queue_timeout_s: float = field(
        default=10.0,
        metadata={"help": "seconds to wait for a queue reply before failing", "trained": False},
    )
    ring_heartbeat_s: float = field(
        default=0.5,
        metadata={
            "help": "seconds between two heartbeats in each logit ring (trainers call a teacher "
            "whose ring beat is older than their teacher_dead_after_s dead)",
            "deprecated_keys": ("heartbeat_s",),
            "trained": False,
        },
    )
    seed: int = field(
        default=0, metadata={"help": "seed of a preset model's random weights", "trained": True}
    )
    max_rings: int = field(
        default=64,
        metadata={
            "help": "most trainer ranks served (one logit ring each); others are refused",
            "trained": False,
        },
    )
    heldout: str | None = field(
        default=None,
        metadata={
            "help": "held-out corpus: report the teacher's bits/byte once at start",
            "path": "file",
            "trained": False,
        },
    )
    eval_texts: int = field(
        default=32, metadata={"help": "held-out texts of that eval", "trained": False}
    )
    eval_ctx: int = field(
        default=512, metadata={"help": "tokens per eval window", "trained": False}
    )
    run_dir: str | None = field(
        default=None,
        metadata={
            "help": "write metrics under RUN_DIR/metrics",
            "default_text": "no metrics file",
            "context": "run_dir",
            "path": "run",
            "trained": False,
        },
    )

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r}: use one of {', '.join(TRANSPORTS)}")
        if self.transport == "cuda_ipc" and not str(self.device).startswith("cuda"):
            raise ValueError(
                f"transport=cuda_ipc needs a CUDA device, got device={self.device!r}; use "
                "transport=shm on CPU"
            )
        if self.slots < 2:
            raise ValueError(
                f"slots={self.slots}: the ring needs >= 2 slots so that the teacher computes "
                "batch k+1 while the trainer trains on batch k"
            )
        for name in ("max_batch", "max_length", "forward_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.group < 0:
            raise ValueError(f"group={self.group}: must be >= 0")
        for name in ("lease_s", "claim_timeout_s", "queue_timeout_s", "ring_heartbeat_s"):
            value = getattr(self, name)
            if not 0 < value < math.inf:  # nan and 1e999 (inf) too
                raise ValueError(f"{name}={value}: must be a finite number of seconds > 0")
        if self.max_length > 1 << 20 or self.eval_ctx > 1 << 20:
            raise ValueError(
                f"max_length={self.max_length}, eval_ctx={self.eval_ctx}: at most {1 << 20} tokens"
            )
        resolve_dtype(self.dtype, self.device)
        resolve_dtype(self.logits_dtype, self.device)
        resolve_cuda_graphs(
            self.cuda_graphs, resolve_compile(self.compile, self.device), self.device
        )
        if self.packed_attention not in ("auto", "flex_attention", "sdpa"):
            raise ValueError(
                f"packed_attention={self.packed_attention!r}: use auto, flex_attention or sdpa"
            )


class TeacherWorker:
    """The teacher model, its output layer and its logit ring.

    Args:
        config: the teacher settings.
        model: an already loaded causal LM (tests); default: ``load_model(config.model)``.

    Raises:
        ValueError: a model whose vocab is smaller than its tokenizer's, a bad config.
    """

    def __init__(self, config: TeacherConfig, model: torch.nn.Module | None = None) -> None:
        from xtoken_core.data.collator import resolve_pad_id
        from xtoken_core.models import check_vocab, load_model, model_vocab_size, split_lm_head
        from xtoken_core.tokenizers import load_tokenizer

        self.config = config
        self.instance = new_instance()
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, config.device)
        self.logits_dtype = resolve_dtype(config.logits_dtype, config.device)
        tokenizer = load_tokenizer(config.tokenizer)
        self.pad_id = resolve_pad_id(tokenizer)
        self.tokenizer_vocab = int(tokenizer.vocab_size)
        if model is None:
            model = load_model(
                config.model,
                vocab_size=config.vocab_size or self.tokenizer_vocab,
                dtype=self.dtype,
                device=self.device,
                seed=config.seed,
            )
        self.model = model.eval().requires_grad_(False)
        self.width = model_vocab_size(self.model)
        check_vocab(f"teacher model {config.model!r}", self.width, self.tokenizer_vocab)
        if config.pack:  # packed rows: document-boundary attention (compiled as such below)
            from xtoken_core.models.documents import packed_attention, use_packed_attention

            use_packed_attention(self.model, packed_attention(config.packed_attention, self.device))
        self.backbone, self.lm_head = split_lm_head(self.model)
        self.hidden_size = int(self.lm_head.weight.shape[1])  # d: the output layer's input
        compiled = resolve_compile(config.compile, config.device)
        self.compiled = RegionalCompile(
            self.model, compiled, resolve_cuda_graphs(config.cuda_graphs, compiled, config.device)
        )
        # One ring per trainer rank served: a rank that holds its slots (e.g. waiting in a
        # collective for another rank) never keeps the teacher from serving the other ranks.
        self.rings: dict[int, Any] = {}
        self.computed = 0  # requests served
        self.forwards = 0  # teacher forwards run (one may serve several requests)

    def ring(self, rank: int) -> Any:
        """The logit ring of trainer ``rank`` (allocated and exported on its first request)."""
        ring = self.rings.get(rank)
        if ring is None:
            from xtoken_core.ipc.logit_ring import LogitRingWriter

            cfg = self.config
            ring = self.rings[rank] = LogitRingWriter(
                transport=cfg.transport,
                num_slots=cfg.slots,
                slot_shape=(cfg.max_batch, cfg.max_length, self.width),
                dtype=self.logits_dtype,
                device=self.device,
                heartbeat_s=cfg.ring_heartbeat_s,
            )
        return ring

    def try_acquire(self, rank: int) -> int | None:
        """A free slot of ``rank``'s ring, or None while its trainer holds every slot
        (always 0 for the hidden transport, which has no ring)."""
        if self.config.transport == "hidden":
            return 0
        try:
            return self.ring(rank).acquire(timeout_s=0)
        except TimeoutError:
            return None

    # ------------------------------------------------------------------ requests

    def check(self, request: Request) -> str | None:
        """Why a request cannot be served (a message for the trainer), or None."""
        cfg = self.config
        B, U = request.ids_BU.shape
        if B < 1:
            return f"request {request.key!r} has no rows"
        if (
            cfg.transport != "hidden"
            and request.rank not in self.rings
            and len(self.rings) >= cfg.max_rings
        ):
            return (
                f"request {request.key!r} is from trainer rank {request.rank}, but this teacher "
                f"already serves {len(self.rings)} ranks (max_rings): raise teacher max_rings or "
                "start more teacher groups"
            )
        if B > cfg.max_batch or U > cfg.max_length:
            return (
                f"request {request.key!r} is {B} x {U} tokens, over the teacher's slot of "
                f"{cfg.max_batch} x {cfg.max_length}: raise teacher max_batch / max_length or "
                "lower the trainer's micro_batch / teacher context"
            )
        top = int(request.ids_BU.max()) if request.ids_BU.numel() else 0
        if int(request.ids_BU.min()) < 0 or top >= self.width:
            return (
                f"request {request.key!r} has teacher ids outside [0, {self.width}): collate "
                f"with the teacher's tokenizer ({self.config.tokenizer!r})"
            )
        return None

    def error_fields(self, request_key: str, rank: int, message: str) -> dict[str, Any]:
        """The result fields that tell trainer ``rank`` why its request was refused."""
        result = Result(self.config.transport, self.instance, None, None, self.width, 0, 0, message)
        fields = {result_field(rank): result.blob()}
        if self.config.transport == "hidden":  # a hidden-transport trainer claims both fields
            empty = torch.zeros((0, 0, self.hidden_size), dtype=self.logits_dtype)
            fields[hidden_field(rank)] = hidden_column(empty)
        return fields

    def fits(self, group: list[Request], request: Request) -> bool:
        """Whether ``request`` may share the forward of ``group`` (requests that passed
        :meth:`check`).

        It may when it has the group's length U, is packed as the group is (positions or
        none), and the rows stay within ``forward_rows``. A
        shared forward pads no row further than its own request did: padding would cost
        compute, and it would change the numerics (on CPU the attention's reductions group
        their terms by the padded length), where an equal length keeps each row's result
        bitwise that of a forward of its own request. What remains is the matmul's choice of
        kernel by the number of rows: fp32 on CPU (MKL), rows of requests of 12 tokens or
        more (B x U) come out bitwise; on GPU a forward of more rows may pick another kernel
        and differ within rounding.
        """
        if not group:
            return True
        rows = sum(int(r.ids_BU.shape[0]) for r in group) + int(request.ids_BU.shape[0])
        return (
            request.ids_BU.shape[1] == group[0].ids_BU.shape[1]
            and (request.positions_BU is None) == (group[0].positions_BU is None)
            and rows <= self.config.forward_rows
        )

    def _hidden(
        self,
        ids_RU: torch.Tensor,
        lengths_R: torch.Tensor,
        positions_RU: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final (post-norm) hidden states ``[R, U, d]`` (an inference tensor) of padded rows;
        packed rows (``positions_RU``) attend within their documents only."""
        ids_RU = ids_RU.to(self.device, non_blocking=True)
        if positions_RU is None:
            pos_U = torch.arange(ids_RU.shape[1], device=self.device)
            mask_RU = (pos_U[None, :] < lengths_R.to(self.device)[:, None]).to(torch.int64)
            hidden_RUd = self.compiled.run(lambda: self.backbone(ids_RU, mask_RU))
        else:
            from xtoken_core.models.documents import document_attention_mask

            positions_RU = positions_RU.to(self.device, non_blocking=True)
            mask = document_attention_mask(self.model.config, positions_RU, self.dtype)
            hidden_RUd = self.compiled.run(lambda: self.backbone(ids_RU, mask, positions_RU))
        self.forwards += 1
        return hidden_RUd

    def hidden_states(self, request: Request) -> torch.Tensor:
        """Final (post-norm) hidden states ``[B, U, d]`` of a request (an inference tensor)."""
        return self._hidden(request.ids_BU, request.lengths_B, request.positions_BU)

    def logits(self, request: Request) -> torch.Tensor:
        """Full-vocab logits ``[B, U, W]`` (the model dtype) of a request, no ring."""
        hidden_BUd = self.hidden_states(request)
        with torch.inference_mode():
            return self.lm_head(hidden_BUd)

    def compute(self, request: Request, slot: int | None = None) -> dict[str, Any]:
        """Serve one request (:meth:`compute_many` of one).

        Args:
            request: a decoded request (see services/protocol/teacher.py).
            slot: a slot of ``ring(request.rank)`` from :meth:`try_acquire` (ring transports);
                None: wait for one.

        Returns:
            The fields to write onto the request record (``result<rank>``, and ``hidden<rank>``
            for the hidden transport); an error result when the request is malformed.
        """
        return self.compute_many([request], [slot])[0]

    def compute_many(
        self, requests: list[Request], slots: list[int | None] | None = None
    ) -> list[dict[str, Any]]:
        """Serve requests, those that :meth:`fits` together in one forward.

        Args:
            requests: decoded requests (see services/protocol/teacher.py), of any ranks and lengths.
            slots: per request, a slot of ``ring(request.rank)`` from :meth:`try_acquire` (ring
                transports), or None: wait for one. Default: None for every request.

        Returns:
            Per request, the fields to write onto its record (``result<rank>``, and
            ``hidden<rank>`` for the hidden transport); an error result for a malformed
            request, which never keeps the others from being served.

        Raises:
            Whatever a forward of a single request raises (e.g. out of memory); its slot is
            free again. A shared forward that fails is retried one request at a time.
        """
        slots = list(slots) if slots is not None else [None] * len(requests)
        assert len(slots) == len(requests), (len(slots), len(requests))
        out: list[dict[str, Any] | None] = [None] * len(requests)
        groups: list[list[int]] = []
        for i, request in enumerate(requests):
            problem = self.check(request)
            if problem is not None:
                if slots[i] is not None and self.config.transport != "hidden":
                    self.ring(request.rank).abandon(slots[i])
                logger.warning("[teacher] refusing %s", problem)
                out[i] = self.error_fields(request.key, request.rank, problem)
                continue
            for group in groups:
                if self.fits([requests[j] for j in group], request):
                    group.append(i)
                    break
            else:
                groups.append([i])
        for group in groups:
            served = self._serve([requests[j] for j in group], [slots[j] for j in group])
            for j, fields in zip(group, served, strict=True):
                out[j] = fields
        assert all(fields is not None for fields in out)
        return out  # type: ignore[return-value]

    def _serve(self, requests: list[Request], slots: list[int | None]) -> list[dict[str, Any]]:
        """One forward for ``requests`` (checked, one length U), each result written on its own."""
        cfg = self.config
        if cfg.transport != "hidden":  # every request holds its slot before the forward
            slots = [
                self.ring(r.rank).acquire() if s is None else s for r, s in zip(requests, slots)
            ]
        ids_RU = torch.cat([r.ids_BU for r in requests])
        lengths_R = torch.cat([r.lengths_B for r in requests])
        positions_RU = None  # the requests of one forward are all packed, or none (fits)
        if requests[0].positions_BU is not None:
            positions_RU = torch.cat([r.positions_BU for r in requests])
        try:
            hidden_RUd = self._hidden(ids_RU, lengths_R, positions_RU)
        except Exception:
            if len(requests) == 1:
                self._abandon(requests, slots)
                raise
            logger.warning(
                "[teacher] a forward of %d requests (%d rows) failed; serving them one at a time",
                len(requests),
                ids_RU.shape[0],
                exc_info=True,
            )
            out = []
            for k in range(len(requests)):
                try:
                    out += self._serve(requests[k : k + 1], slots[k : k + 1])
                except BaseException:  # the requests not yet served hold no slot
                    self._abandon(requests[k + 1 :], slots[k + 1 :])
                    raise
            return out
        except BaseException:
            self._abandon(requests, slots)
            raise
        out = []
        row = 0
        for i, request in enumerate(requests):
            B, U = request.ids_BU.shape
            hidden_BUd = hidden_RUd[row : row + B]
            row += B
            if cfg.transport == "hidden":
                result = Result("hidden", self.instance, None, None, self.width, B, U)
                sent_BUd = hidden_BUd.to(self.logits_dtype).cpu()
                fields = {hidden_field(request.rank): hidden_column(sent_BUd)}
            else:
                ring = self.ring(request.rank)
                try:
                    # the slot is a normal tensor: written from inference tensors, it stays one
                    with torch.inference_mode():
                        head_into(self.lm_head, hidden_BUd, ring.buffer(slots[i])[:B, :U])
                    handle = ring.publish(slots[i], rows=B, length=U, checksum=cfg.checksum)
                except BaseException:  # the slots not yet published are free again
                    self._abandon(requests[i:], slots[i:])
                    raise
                result = Result(
                    cfg.transport, self.instance, ring.descriptor, handle, self.width, B, U
                )
                fields = {}
            fields[result_field(request.rank)] = result.blob()
            out.append(fields)
            self.computed += 1
        return out

    def _abandon(self, requests: list[Request], slots: list[int | None]) -> None:
        if self.config.transport == "hidden":
            return
        for request, slot in zip(requests, slots, strict=True):
            if slot is not None:
                self.ring(request.rank).abandon(slot)

    def evaluate(self, texts: list[str]) -> dict[str, float]:
        """Held-out bits per byte of the teacher (``xtoken_core.models.eval``)."""
        from xtoken_core.models.eval import bits_per_byte
        from xtoken_core.tokenizers import load_tokenizer

        tokenizer = load_tokenizer(self.config.tokenizer)
        return self.compiled.run(
            lambda: bits_per_byte(
                self.model, tokenizer, texts, ctx=self.config.eval_ctx, device=self.device
            )
        )

    def close(self) -> None:
        """Mark the rings closed (their handles become stale) and free them."""
        for ring in self.rings.values():
            ring.close()
        self.rings.clear()

    def __enter__(self) -> TeacherWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
