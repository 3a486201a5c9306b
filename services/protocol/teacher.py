"""The trainer <-> teacher records on the queue: a request, its result, encode, decode.

A trainer rank asks for the teacher logits of one micro-batch by putting a *request record* into
the teacher group's partition ``<partition>.teacher<group>``, keyed ``<trainer instance>:<seq>``:

* ``teacher_input_ids``: the B rows of teacher ids, concatenated (a 1-row jagged column);
* ``teacher_lengths``: the B row lengths (a 1-row jagged int64 column);
* ``rank``: ``[1]`` int64, the trainer rank that asked;
* ``teacher_position_ids`` (packed rows only): the rows' positions, restarting at 0 per
  document, concatenated like the ids (a 1-row jagged int32 column); the teacher masks attention
  across documents.

A partition keeps one trailing shape per field, and B and U change from request to request (the
last micro-batch of the data is smaller, a claim may return fewer samples), so every field whose
size depends on them is a 1-row jagged column.

A teacher of the group claims requests (task ``teacher``), runs its forward and writes the result
onto the same record, field by field: ``result<rank>`` (a msgpack blob, see :class:`Result`) and,
for the ``hidden`` transport, ``hidden<rank>``: the final hidden states ``[B, U, d]`` as one
jagged row of ``B * U`` vectors of size d (see :func:`hidden_column`); for the ``topk``
transport, ``topk_ids<rank>``, ``topk_logprobs<rank>``, ``topk_rest<rank>`` and
``topk_lse<rank>``: per teacher position its K largest log-probabilities (int32 ids, fp32
log-probs: one jagged row of ``B * U`` vectors of size K each), the log of the rest mass and the
log-partition of the logits (fp32 each, one jagged row of ``B * U`` scalars; see
:func:`topk_columns` and ``xtoken_core.wire.topk``). Trainer
rank r claims the records that carry ``result<r>`` (task ``trainer<r>/<instance>``), so a rank
never sees another rank's records, and clears each record once it released the slot.

Partition, field and task names: :mod:`services.protocol.names`.

Blobs are msgpack of plain values (str, int, float, bytes, lists, maps); nothing is unpickled.

Legend: B rows of a micro-batch, U the longest teacher row, d the teacher's hidden size, K the
top-K ids per teacher position.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import torch

from services.protocol.names import QUEUE_TRANSPORTS, TRANSPORTS
from xtoken_core.wire import JaggedColumn, TopK

REQUEST_FIELDS = ("teacher_input_ids", "teacher_lengths", "rank")
# Sent with the requests of packed rows only.
POSITIONS_FIELD = "teacher_position_ids"
# Largest blob accepted from the queue (a descriptor with CUDA IPC handles is ~1 KiB).
MAX_BLOB_BYTES = 1 << 20


def _one_row(values: torch.Tensor) -> JaggedColumn:
    """``values[R, ...]`` as a 1-row jagged column."""
    return JaggedColumn(values, torch.tensor([0, values.shape[0]], dtype=torch.int64))


def pack_blob(obj: Any) -> JaggedColumn:
    """Encode plain values as a 1-row uint8 jagged column (one queue field of one record)."""
    data = msgpack.packb(obj, use_bin_type=True)
    return _one_row(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def unpack_blob(column: Any, what: str) -> Any:
    """Decode a blob written by :func:`pack_blob` (row 0).

    Raises:
        ValueError: not a 1-row uint8 column, too large, or not msgpack; names ``what``.
    """
    if not isinstance(column, JaggedColumn) or column.values.dtype != torch.uint8:
        raise ValueError(
            f"{what}: expected a 1-row uint8 jagged field, got {type(column).__name__}"
        )
    row = column.row(0)
    if row.numel() > MAX_BLOB_BYTES:
        raise ValueError(f"{what}: {row.numel()} bytes is over the {MAX_BLOB_BYTES}-byte limit")
    try:
        return msgpack.unpackb(row.numpy().tobytes(), raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as e:
        raise ValueError(f"{what}: not a msgpack blob ({e})") from None


def request_fields(
    rows: list[torch.Tensor], rank: int, positions: list[torch.Tensor] | None = None
) -> dict[str, Any]:
    """Fields of one request record: B teacher-id rows of trainer ``rank`` (and, for packed
    rows, their positions: one row of each length per id row)."""
    lengths_B = torch.tensor([int(r.numel()) for r in rows], dtype=torch.int64)
    ids = (
        torch.cat([r.to(torch.int64) for r in rows]) if rows else torch.zeros(0, dtype=torch.int64)
    )
    fields = {
        "teacher_input_ids": _one_row(ids),
        "teacher_lengths": _one_row(lengths_B),
        "rank": torch.tensor([rank], dtype=torch.int64),
    }
    if positions is not None:
        flat = [p.to(torch.int32) for p in positions]
        fields[POSITIONS_FIELD] = _one_row(
            torch.cat(flat) if flat else torch.zeros(0, dtype=torch.int32)
        )
    return fields


def hidden_column(hidden_BUd: torch.Tensor) -> JaggedColumn:
    """The ``hidden<rank>`` field: ``[B, U, d]`` as one jagged row of ``B * U`` vectors
    (B and U travel in the :class:`Result`; the field's trailing shape is d alone)."""
    B, U, d = hidden_BUd.shape
    return _one_row(hidden_BUd.reshape(B * U, d))


def hidden_from_column(column: Any, rows: int, length: int, key: str) -> torch.Tensor:
    """The ``[B, U, d]`` hidden states of a ``hidden<rank>`` field (row 0), B = ``rows``,
    U = ``length``.

    Raises:
        ValueError: not a jagged field of float vectors of ``rows * length`` entries (names the
            record key).
    """
    what = f"hidden states of request {key!r}"
    if not isinstance(column, JaggedColumn) or column.values.dim() != 2:
        raise ValueError(f"{what}: expected a 1-row jagged field of [B * U, d] vectors")
    if not column.values.is_floating_point():
        raise ValueError(f"{what}: dtype {column.values.dtype} is not a float dtype")
    row = column.row(0)
    if row.shape[0] != rows * length:
        raise ValueError(
            f"{what}: {row.shape[0]} vectors, but the result says {rows} rows x {length} tokens"
        )
    return row.reshape(rows, length, row.shape[1])


def topk_columns(targets: TopK) -> tuple[JaggedColumn, JaggedColumn, JaggedColumn, JaggedColumn]:
    """The ``topk_ids<rank>``, ``topk_logprobs<rank>``, ``topk_rest<rank>`` and
    ``topk_lse<rank>`` fields (in the order of :func:`~services.protocol.names.topk_fields`):
    ``[B, U, K]``, ``[B, U, K]``, ``[B, U]`` and ``[B, U]`` as one jagged row of ``B * U`` entries
    each (B and U travel in the :class:`Result`; the fields' trailing shapes are K, K, none and
    none)."""
    ids_BUK, logprobs_BUK, rest_BU, lse_BU = targets
    K = int(ids_BUK.shape[-1])
    return (
        _one_row(ids_BUK.reshape(-1, K)),
        _one_row(logprobs_BUK.reshape(-1, K)),
        _one_row(rest_BU.reshape(-1)),
        _one_row(lse_BU.reshape(-1)),
    )


def topk_from_columns(columns: Any, rows: int, length: int, key: str) -> TopK:
    """The top-K targets ``[B, U, K]``, ``[B, U, K]``, ``[B, U]``, ``[B, U]`` of the four ``topk``
    fields (row 0 of each, in the order of :func:`~services.protocol.names.topk_fields`), B =
    ``rows``, U = ``length``.

    Raises:
        ValueError: not four jagged fields of int32 ids, float log-probs of the same ``[B * U,
            K]`` shape, ``B * U`` fp32 rests and ``B * U`` fp32 log-partitions (names the record
            key).
    """
    what = f"top-k targets of request {key!r}"
    if len(columns) != 4 or not all(isinstance(c, JaggedColumn) for c in columns):
        raise ValueError(f"{what}: expected four 1-row jagged fields (ids, logprobs, rest, lse)")
    ids, logprobs, rest, lse = (c.row(0) for c in columns)
    if ids.dtype != torch.int32 or ids.dim() != 2:
        raise ValueError(f"{what}: ids are {ids.dtype} {tuple(ids.shape)}, not int32 [B * U, K]")
    if not logprobs.is_floating_point() or logprobs.shape != ids.shape:
        raise ValueError(
            f"{what}: logprobs are {logprobs.dtype} {tuple(logprobs.shape)}, not float "
            f"{tuple(ids.shape)} like the ids"
        )
    for name, scalars in (("rest", rest), ("lse", lse)):
        if scalars.dtype != torch.float32 or tuple(scalars.shape) != (ids.shape[0],):
            raise ValueError(
                f"{what}: {name} is {scalars.dtype} {tuple(scalars.shape)}, not float32 "
                f"({ids.shape[0]},)"
            )
    if ids.shape[0] != rows * length:
        raise ValueError(
            f"{what}: {ids.shape[0]} positions, but the result says {rows} rows x {length} tokens"
        )
    K = int(ids.shape[1])
    return TopK(
        ids.reshape(rows, length, K),
        logprobs.reshape(rows, length, K),
        rest.reshape(rows, length),
        lse.reshape(rows, length),
    )


@dataclasses.dataclass(frozen=True)
class Request:
    """A decoded request record.

    Attributes:
        key: the record key.
        rank: trainer rank that asked.
        ids_BU: ``[B, U]`` int64 teacher ids, right-padded with ``pad_id``.
        lengths_B: ``[B]`` int64 row lengths.
        positions_BU: packed rows: ``[B, U]`` int64 positions restarting per document, padded
            with 0; None for rows of one text each.
    """

    key: str
    rank: int
    ids_BU: torch.Tensor
    lengths_B: torch.Tensor
    positions_BU: torch.Tensor | None = None


def _integer(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def decode_request(key: str, fields: dict[str, Any], index: int, pad_id: int) -> Request:
    """Decode row ``index`` of claimed request fields.

    Raises:
        ValueError: a field is missing, malformed or inconsistent (names the record key).
    """
    missing = [f for f in REQUEST_FIELDS if f not in fields]
    if missing:
        raise ValueError(f"request {key!r} lacks fields {missing}")
    ids, lengths = fields["teacher_input_ids"], fields["teacher_lengths"]
    if not isinstance(ids, JaggedColumn):
        raise ValueError(f"request {key!r}: teacher_input_ids must be a jagged field")
    try:
        flat = ids.row(index)
        lengths_B = lengths.row(index) if isinstance(lengths, JaggedColumn) else lengths[index]
        rank_t = fields["rank"].reshape(-1)[index]
    except (IndexError, TypeError, AttributeError, RuntimeError) as e:
        raise ValueError(
            f"request {key!r}: malformed fields ({type(e).__name__}: {e}); send "
            "request_fields(rows, rank)"
        ) from None
    for name, t in (("teacher_input_ids", flat), ("teacher_lengths", lengths_B), ("rank", rank_t)):
        if not (isinstance(t, torch.Tensor) and _integer(t)):
            what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"request {key!r}: {name} is {what}, not an integer tensor")
    lengths_B, rank = lengths_B.to(torch.int64), int(rank_t)
    if (
        flat.dim() != 1
        or lengths_B.dim() != 1
        or (lengths_B < 0).any()
        or int(lengths_B.sum()) != flat.numel()
    ):
        raise ValueError(
            f"request {key!r}: teacher_lengths {lengths_B.tolist()} do not add up to the "
            f"{flat.numel()} ids sent"
        )
    if rank < 0:
        raise ValueError(f"request {key!r}: rank {rank} must be >= 0")
    B = int(lengths_B.numel())
    U = max(1, int(lengths_B.max())) if B else 1
    ids_BU = torch.full((B, U), pad_id, dtype=torch.int64)
    for b, row in enumerate(torch.split(flat.to(torch.int64), lengths_B.tolist())):
        ids_BU[b, : row.numel()] = row
    positions_BU = None
    if POSITIONS_FIELD in fields:
        positions_BU = _positions(key, fields[POSITIONS_FIELD], index, lengths_B, U)
    return Request(
        key=key, rank=rank, ids_BU=ids_BU, lengths_B=lengths_B, positions_BU=positions_BU
    )


def _positions(key: str, column: Any, index: int, lengths_B: torch.Tensor, U: int) -> torch.Tensor:
    """The ``[B, U]`` positions of a packed request (0 in the padding).

    Raises:
        ValueError: not a jagged integer field of one position per id (names the record key).
    """
    flat = column.row(index) if isinstance(column, JaggedColumn) else None
    if flat is None or not _integer(flat) or flat.dim() != 1:
        raise ValueError(f"request {key!r}: {POSITIONS_FIELD} must be a jagged integer field")
    if flat.numel() != int(lengths_B.sum()) or (flat.numel() and int(flat.min()) < 0):
        raise ValueError(
            f"request {key!r}: {flat.numel()} {POSITIONS_FIELD} (each >= 0) for "
            f"{int(lengths_B.sum())} ids"
        )
    positions_BU = torch.zeros((int(lengths_B.numel()), U), dtype=torch.int64)
    for b, row in enumerate(torch.split(flat.to(torch.int64), lengths_B.tolist())):
        positions_BU[b, : row.numel()] = row
    return positions_BU


@dataclasses.dataclass(frozen=True)
class Result:
    """What a teacher wrote for one request.

    Attributes:
        transport: ``shm``, ``cuda_ipc``, ``hidden`` or ``topk``.
        teacher: the teacher instance that computed it.
        descriptor: the logit ring's descriptor (ring transports), else None.
        handle: the slot handle (ring transports), else None.
        width: logits width W (the teacher model's vocab).
        rows, length: B and U of the result.
        error: why the teacher refused the request (then nothing else is set), or None.
    """

    transport: str
    teacher: str
    descriptor: dict | None
    handle: dict | None
    width: int
    rows: int
    length: int
    error: str | None = None

    def blob(self) -> JaggedColumn:
        """The ``result<rank>`` field value."""
        return pack_blob(dataclasses.asdict(self))

    @classmethod
    def from_blob(cls, column: Any, key: str) -> Result:
        """Decode a ``result<rank>`` field.

        Raises:
            ValueError: malformed (names the record key and what is wrong).
        """
        what = f"result of request {key!r}"
        d = unpack_blob(column, what)
        names = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(d, dict) or set(d) != set(names):
            got = sorted(map(str, d)) if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"{what}: expected keys {names}, got {got}")
        if not isinstance(d["transport"], str) or d["transport"] not in TRANSPORTS:
            raise ValueError(f"{what}: unknown transport {d['transport']!r}")
        for name in ("width", "rows", "length"):
            if type(d[name]) is not int or d[name] < 0:
                raise ValueError(f"{what}: {name}={d[name]!r} must be an int >= 0")
        for name, kind in (
            ("teacher", str),
            ("error", str),
            ("descriptor", dict),
            ("handle", dict),
        ):
            if not isinstance(d[name], kind) and (d[name] is not None or name == "teacher"):
                raise ValueError(
                    f"{what}: {name} is a {type(d[name]).__name__}, not a {kind.__name__}"
                )
        ring = d["transport"] not in QUEUE_TRANSPORTS and d["error"] is None
        if ring and (d["descriptor"] is None or d["handle"] is None):
            raise ValueError(f"{what}: a {d['transport']} result needs a descriptor and a handle")
        return cls(**d)
