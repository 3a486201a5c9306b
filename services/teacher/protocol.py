"""The trainer <-> teacher hand-off records on the queue: partition and field names, encode, decode.

A trainer rank asks for the teacher logits of one micro-batch by putting a *request record* into
the teacher group's partition ``<partition>.teacher<group>``, keyed ``<trainer instance>:<seq>``:

* ``teacher_input_ids``: the B rows of teacher ids, concatenated (a 1-row jagged column);
* ``teacher_lengths``: ``[1, B]`` int64, the length of each row;
* ``rank``: ``[1]`` int64, the trainer rank that asked.

A teacher of the group claims requests (task ``teacher``), runs its forward and writes the result
onto the same record, field by field: ``result<rank>`` (a msgpack blob, see :class:`Result`) and,
for the ``hidden`` transport, ``hidden<rank>`` ``[1, B, U, d]`` (the final hidden states). Trainer
rank r claims the records that carry ``result<r>`` (task ``trainer<r>``), so a rank never sees
another rank's records, and clears each record once it released the slot.

Blobs are msgpack of plain values (str, int, float, bytes, lists, maps); nothing is unpickled.

Legend: B rows of a micro-batch, U the longest teacher row, d the teacher's hidden size.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from typing import Any

import msgpack
import torch

from xtoken_core.wire import JaggedColumn

TEACHER_TASK = "teacher"
REQUEST_FIELDS = ("teacher_input_ids", "teacher_lengths", "rank")
# Largest blob accepted from the queue (a descriptor with CUDA IPC handles is ~1 KiB).
MAX_BLOB_BYTES = 1 << 20


def request_partition(partition: str, group: int) -> str:
    """Partition where trainers put requests for teacher group ``group``."""
    return f"{partition}.teacher{group}"


def result_field(rank: int) -> str:
    """Field a teacher writes onto a request of trainer rank ``rank``."""
    return f"result{rank}"


def hidden_field(rank: int) -> str:
    """Field holding the hidden states for trainer rank ``rank`` (``hidden`` transport)."""
    return f"hidden{rank}"


def trainer_task(rank: int) -> str:
    """Consumer task of trainer rank ``rank`` on the request partition."""
    return f"trainer{rank}"


def new_instance() -> str:
    """A fresh process-instance id: ``<pid>-<8 hex>`` (keys and handles name it)."""
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def pack_blob(obj: Any) -> JaggedColumn:
    """Encode plain values as a 1-row uint8 jagged column (one queue field of one record)."""
    data = msgpack.packb(obj, use_bin_type=True)
    values = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return JaggedColumn(values, torch.tensor([0, values.numel()], dtype=torch.int64))


def unpack_blob(column: Any, what: str) -> Any:
    """Decode a blob written by :func:`pack_blob` (row 0).

    Raises:
        ValueError: not a 1-row uint8 column, too large, or not msgpack; names ``what``.
    """
    if not isinstance(column, JaggedColumn) or column.values.dtype != torch.uint8:
        raise ValueError(f"{what}: expected a 1-row uint8 jagged field, got {type(column).__name__}")
    row = column.row(0)
    if row.numel() > MAX_BLOB_BYTES:
        raise ValueError(f"{what}: {row.numel()} bytes is over the {MAX_BLOB_BYTES}-byte limit")
    try:
        return msgpack.unpackb(row.numpy().tobytes(), raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as e:
        raise ValueError(f"{what}: not a msgpack blob ({e})") from None


def request_fields(rows: list[torch.Tensor], rank: int) -> dict[str, Any]:
    """Fields of one request record: B teacher-id rows of trainer ``rank``."""
    lengths = torch.tensor([[int(r.numel()) for r in rows]], dtype=torch.int64)
    ids = torch.cat([r.to(torch.int64) for r in rows]) if rows else torch.zeros(0, dtype=torch.int64)
    return {
        "teacher_input_ids": JaggedColumn(ids, torch.tensor([0, ids.numel()], dtype=torch.int64)),
        "teacher_lengths": lengths,
        "rank": torch.tensor([rank], dtype=torch.int64),
    }


@dataclasses.dataclass(frozen=True)
class Request:
    """A decoded request record.

    Attributes:
        key: the record key.
        rank: trainer rank that asked.
        ids_BU: ``[B, U]`` int64 teacher ids, right-padded with ``pad_id``.
        lengths_B: ``[B]`` int64 row lengths.
    """

    key: str
    rank: int
    ids_BU: torch.Tensor
    lengths_B: torch.Tensor


def decode_request(key: str, fields: dict[str, Any], index: int, pad_id: int) -> Request:
    """Decode row ``index`` of claimed request fields.

    Raises:
        ValueError: a field is missing or inconsistent (names the record key).
    """
    missing = [f for f in REQUEST_FIELDS if f not in fields]
    if missing:
        raise ValueError(f"request {key!r} lacks fields {missing}")
    ids = fields["teacher_input_ids"]
    if not isinstance(ids, JaggedColumn):
        raise ValueError(f"request {key!r}: teacher_input_ids must be a jagged field")
    flat = ids.row(index)
    lengths_B = fields["teacher_lengths"][index].to(torch.int64)
    rank = int(fields["rank"].reshape(-1)[index])
    if lengths_B.dim() != 1 or (lengths_B < 0).any() or int(lengths_B.sum()) != flat.numel():
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
    return Request(key=key, rank=rank, ids_BU=ids_BU, lengths_B=lengths_B)


@dataclasses.dataclass(frozen=True)
class Result:
    """What a teacher wrote for one request.

    Attributes:
        transport: ``shm``, ``cuda_ipc`` or ``hidden``.
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
        d = unpack_blob(column, f"result of request {key!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(d, dict) or sorted(d) != sorted(names):
            got = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"result of request {key!r}: expected keys {names}, got {got}")
        if d["transport"] not in ("shm", "cuda_ipc", "hidden"):
            raise ValueError(f"result of request {key!r}: unknown transport {d['transport']!r}")
        for name in ("width", "rows", "length"):
            if type(d[name]) is not int or d[name] < 0:
                raise ValueError(f"result of request {key!r}: {name}={d[name]!r} must be an int >= 0")
        return cls(**d)
