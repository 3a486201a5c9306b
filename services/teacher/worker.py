"""Teacher worker logic: requests (B teacher-id rows each) in, full-vocab logits in ring slots out.

``TeacherWorker`` owns the teacher model and its logit rings and knows nothing of sockets: the
process shell (main.py) claims requests from the queue, calls :meth:`TeacherWorker.compute_many`
(or :meth:`TeacherWorker.compute` for one) and writes the returned fields back onto each
request record.

Requests of one length that wait together share one forward (:meth:`TeacherWorker.fits`); each
still gets its own slot and its own result, bitwise what a forward of its own would give
wherever the kernels' rows do not depend on how many rows run together (see ``fits``). The
decoder layers are compiled (``teacher.compile``, services/teacher/compile.py).

Transports (docs/design.md, "The teacher-to-trainer logit ring"):
* ``shm`` / ``cuda_ipc``: the logits go into a slot of a ring allocated and exported once per
  trainer rank served; the result names the slot (a handle with a generation). The trainer
  reads the slot in place and releases it after its backward; the shell serves a request only
  when its rank's ring has a free slot (:meth:`try_acquire`).
* ``hidden``: the final (post-norm) hidden states travel through the queue; the trainer applies
  the teacher's output layer itself. About W/d fewer bytes than logits.
* ``topk``: per position the ``teacher.top_k`` largest log-probabilities, their ids, the log of
  the rest mass and the log-partition travel through the queue (``xtoken_core.wire.topk``); the
  trainer spreads the rest evenly over the other ids and adds the log-partition back (the
  teacher's logits at the top K ids). ``8 K + 8`` bytes per token.

Legend: B rows of a request, U its longest row, R rows of one forward (the B of every request
it serves), W the teacher vocab (logits width), d hidden size.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from services.protocol.names import (
    QUEUE_TRANSPORTS,
    hidden_field,
    new_instance,
    result_field,
    topk_fields,
)
from services.protocol.teacher import Request, Result, hidden_column, topk_columns
from services.teacher.compile import RegionalCompile
from services.teacher.config import TeacherConfig, resolve_compile, resolve_cuda_graphs
from xtoken_core.models.dtypes import resolve_dtype
from xtoken_core.models.heads import head_into

logger = logging.getLogger(__name__)

__all__ = ["TeacherWorker"]


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

    def idle(self) -> None:
        """Called by the serving loop on each round that served nothing (a tensor-parallel
        group's rank 0 tells its other ranks that it lives); nothing for one process."""

    def try_acquire(self, rank: int) -> int | None:
        """A free slot of ``rank``'s ring, or None while its trainer holds every slot
        (always 0 for the hidden and topk transports, which have no ring)."""
        if self.config.transport in QUEUE_TRANSPORTS:
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
        if cfg.transport == "topk" and cfg.top_k > self.width:
            return (
                f"teacher.top_k={cfg.top_k} is over the teacher's vocab of {self.width}: set "
                f"teacher.top_k <= {self.width}"
            )
        if (
            cfg.transport not in QUEUE_TRANSPORTS
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
        elif self.config.transport == "topk":  # a topk trainer claims the topk fields too
            from xtoken_core.wire.topk import TopK

            K = self.config.top_k
            empty = TopK(
                torch.zeros((0, 0, K), dtype=torch.int32),
                torch.zeros((0, 0, K), dtype=torch.float32),
                torch.zeros((0, 0), dtype=torch.float32),
                torch.zeros((0, 0), dtype=torch.float32),
            )
            fields.update(zip(topk_fields(rank), topk_columns(empty), strict=True))
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
                if slots[i] is not None and self.config.transport not in QUEUE_TRANSPORTS:
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
        if cfg.transport not in QUEUE_TRANSPORTS:  # each request holds its slot before the forward
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
            if len(requests) == 1 or self.config.tensor_parallel > 1:  # a group fails together
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
            elif cfg.transport == "topk":
                from xtoken_core.wire.topk import TopK, encode_topk

                result = Result("topk", self.instance, None, None, self.width, B, U)
                with torch.inference_mode():  # log_softmax in fp32 inside encode_topk
                    targets = encode_topk(self.lm_head(hidden_BUd), cfg.top_k)
                sent = TopK(*(t.cpu() for t in targets))
                fields = dict(zip(topk_fields(request.rank), topk_columns(sent), strict=True))
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
        if self.config.transport in QUEUE_TRANSPORTS:
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
