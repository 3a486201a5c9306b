"""The teacher cache's row schema and the codecs of its top-K payload.

One Parquet row per sample (docs/design.md, "The teacher cache"):

| column | Arrow type | per sample |
|---|---|---|
| ``key`` | string | the corpus key of the text (the collator's sample key) |
| ``length`` | int32 | U, teacher tokens (the text at the teacher context) |
| ``teacher_ids`` | list<int32> | the U teacher token ids |
| ``topk_ids`` | binary | U x K ids, little-endian uint16 or uint32 (codec ``ids``) |
| ``topk_logprobs`` | binary | U x K log-probs: uint8, two 4-bit codes a byte, bf16 bits or float32 (codec ``logprobs``) |
| ``lp_max`` | list<float32> | U top-1 log-probabilities (``u8`` and ``u4`` only) |
| ``lp_scale`` | list<float32> | U nats per code step (``u8`` and ``u4`` only) |
| ``rest`` | list<float32> | U logs of the mass outside the top K |
| ``lse`` | list<float32> | U log-partitions of the logits |

The four per-position float columns are float16 instead under codec ``scalars="fp16"``.

Codecs of the ids: ``delta``: each position's K ids sorted ascending, the first as it is and
each next one as its difference from the one before (small numbers, which Parquet's zstd
compresses well), their log-probs in the same order; ``plain``: by decreasing log-prob, as the
``topk`` transport sends them. Both in the narrowest unsigned type the vocab fits (uint16 up to
65,536 ids). The two payload columns are raw bytes (``numpy.frombuffer(value, dtype)`` reads
one): Parquet has no 8- or 16-bit physical type and would store a list<uint16> in 4 bytes a
value. Codecs of the log-probs: ``fp32`` (exact: the decode is the transport's bit for bit),
``bf16`` (the upper half of the fp32 bits, rounded to nearest even), ``u8``: ``lp_max - code *
lp_scale`` with ``lp_scale = (lp_max - lp_min) / 255`` per position (the top-1 exact, the others
within half a step); ``u4``: the same with 15 steps, two codes a byte (the low nibble first).
Codecs of the per-position floats (``scalars``): ``fp32``; ``fp16`` (half the bytes; ``lse``
within 2**-11 of its value, ``lp_max`` and ``lp_scale`` rounded before the codes are computed, so
the top-1 decodes to the stored ``lp_max`` and the others stay within half a stored step).

Legend: U teacher positions of a sample, K ids kept per position, W the teacher vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = [
    "FORMAT_VERSION",
    "IDS_CODECS",
    "LOGPROB_CODECS",
    "SCALAR_CODECS",
    "Codec",
    "Row",
    "decode_positions",
    "encode_positions",
    "id_dtype",
    "schema",
]

#: The version of the shard format (bumped when a reader of an older version could misread).
FORMAT_VERSION = 1
IDS_CODECS = ("delta", "plain")
LOGPROB_CODECS = ("u8", "u4", "bf16", "fp32")
SCALAR_CODECS = ("fp32", "fp16")
# the code steps of the stepped codecs
_STEPS = {"u8": 255, "u4": 15}


@dataclasses.dataclass(frozen=True)
class Codec:
    """How the top-K payload is stored.

    Attributes:
        ids: ``delta`` (sorted per position, delta-coded) or ``plain``.
        logprobs: ``u8``, ``u4``, ``bf16`` or ``fp32``.
        scalars: ``fp32`` or ``fp16``: the per-position ``lp_max``, ``lp_scale``, ``rest`` and
            ``lse``.

    Raises:
        ValueError: an unknown codec name (names the choices).
    """

    ids: str = "delta"
    logprobs: str = "u8"
    scalars: str = "fp32"

    def __post_init__(self) -> None:
        if self.ids not in IDS_CODECS:
            raise ValueError(f"ids codec {self.ids!r}: use one of {', '.join(IDS_CODECS)}")
        if self.logprobs not in LOGPROB_CODECS:
            raise ValueError(
                f"log-prob codec {self.logprobs!r}: use one of {', '.join(LOGPROB_CODECS)}"
            )
        if self.scalars not in SCALAR_CODECS:
            raise ValueError(
                f"scalars codec {self.scalars!r}: use one of {', '.join(SCALAR_CODECS)}"
            )

    @property
    def stepped(self) -> bool:
        """Whether the log-probs are steps below each position's top-1 (``lp_max``,
        ``lp_scale`` stored)."""
        return self.logprobs in _STEPS

    def scalar_type(self) -> Any:
        """The Arrow type of the per-position floats."""
        import pyarrow as pa

        return pa.float16() if self.scalars == "fp16" else pa.float32()

    def as_dict(self) -> dict[str, str]:
        """The codec as the manifest records it."""
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Row:
    """One sample's targets, decoded.

    Attributes:
        key: the sample key.
        teacher_ids_U: ``[U]`` int32 teacher ids.
        ids_UK: ``[U, K]`` int32 top-K ids.
        logprobs_UK: ``[U, K]`` float32 their log-probabilities.
        rest_U: ``[U]`` float32 log of the mass outside them.
        lse_U: ``[U]`` float32 log-partition.
    """

    key: str
    teacher_ids_U: np.ndarray
    ids_UK: np.ndarray
    logprobs_UK: np.ndarray
    rest_U: np.ndarray
    lse_U: np.ndarray


def id_dtype(width: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id of a vocab of ``width``."""
    return np.dtype(np.uint16) if width <= 1 << 16 else np.dtype(np.uint32)


def schema(codec: Codec, width: int) -> Any:
    """The Arrow schema of a shard of ``codec`` for a teacher vocab of ``width``."""
    import pyarrow as pa

    fields = [
        pa.field("key", pa.string(), nullable=False),
        pa.field("length", pa.int32(), nullable=False),
        pa.field("teacher_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("topk_ids", pa.binary(), nullable=False),
        pa.field("topk_logprobs", pa.binary(), nullable=False),
    ]
    f = codec.scalar_type()
    if codec.stepped:
        fields += [
            pa.field("lp_max", pa.list_(f), nullable=False),
            pa.field("lp_scale", pa.list_(f), nullable=False),
        ]
    fields += [
        pa.field("rest", pa.list_(f), nullable=False),
        pa.field("lse", pa.list_(f), nullable=False),
    ]
    return pa.schema(fields)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """The bf16 bits (as uint16) of float32 values, rounded to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def encode_positions(
    ids_UK: np.ndarray, logprobs_UK: np.ndarray, codec: Codec, width: int
) -> dict[str, np.ndarray]:
    """The stored columns of U positions' top-K ids and log-probs.

    Args:
        ids_UK: ``[U, K]`` integer ids in ``[0, width)``, distinct per position.
        logprobs_UK: ``[U, K]`` float log-probabilities.
        codec: how to store them.
        width: the teacher vocab W.

    Returns:
        ``topk_ids`` and ``topk_logprobs`` flat (``U * K``; ``u4``: ``ceil(U * K / 2)`` bytes),
        and for ``u8`` and ``u4`` ``lp_max`` and ``lp_scale`` (``U``, float16 under
        ``scalars="fp16"``).

    Raises:
        ValueError: shapes that disagree or ids outside ``[0, width)``.
    """
    ids_UK = np.asarray(ids_UK)
    logprobs_UK = np.asarray(logprobs_UK, dtype=np.float32)
    if ids_UK.ndim != 2 or ids_UK.shape != logprobs_UK.shape:
        raise ValueError(
            f"top-k ids {ids_UK.shape} and log-probs {logprobs_UK.shape}: expected [U, K] both"
        )
    if ids_UK.size and (int(ids_UK.min()) < 0 or int(ids_UK.max()) >= width):
        raise ValueError(f"top-k ids outside [0, {width}): targets of another teacher vocab?")
    ids_UK = ids_UK.astype(np.int64)
    if codec.ids == "delta":
        order_UK = np.argsort(ids_UK, axis=1, kind="stable")
        ids_UK = np.take_along_axis(ids_UK, order_UK, axis=1)
        logprobs_UK = np.take_along_axis(logprobs_UK, order_UK, axis=1)
        stored_UK = ids_UK.copy()
        stored_UK[:, 1:] = np.diff(ids_UK, axis=1)
    else:
        stored_UK = ids_UK
    out = {"topk_ids": stored_UK.astype(id_dtype(width)).reshape(-1)}
    if codec.logprobs == "fp32":
        out["topk_logprobs"] = logprobs_UK.reshape(-1)
    elif codec.logprobs == "bf16":
        out["topk_logprobs"] = _bf16_bits(logprobs_UK).reshape(-1)
    else:
        steps = _STEPS[codec.logprobs]
        U = logprobs_UK.shape[0]
        if logprobs_UK.shape[1] == 0:
            lp_max_U = lp_min_U = np.zeros(U, dtype=np.float32)
        else:
            lp_max_U = logprobs_UK.max(axis=1)
            lp_min_U = logprobs_UK.min(axis=1)
        scale_U = ((lp_max_U - lp_min_U) / np.float32(steps)).astype(np.float32)
        if codec.scalars == "fp16":  # the codes against the values as stored
            lp_max_U = lp_max_U.astype(np.float16)
            scale16_U = scale_U.astype(np.float16)
            low_U = scale16_U.astype(np.float32) < scale_U  # rounded down: one step up
            scale16_U[low_U] = np.nextafter(scale16_U[low_U], np.float16(np.inf))
            scale_U = scale16_U
        lp_max32_U = lp_max_U.astype(np.float32)
        scale32_U = scale_U.astype(np.float32)
        safe_U = np.where(scale32_U > 0, scale32_U, np.float32(1))
        codes_UK = np.rint((lp_max32_U[:, None] - logprobs_UK) / safe_U[:, None])
        codes = np.clip(codes_UK, 0, steps).astype(np.uint8).reshape(-1)
        if codec.logprobs == "u4":
            codes = np.concatenate([codes, np.zeros(codes.size % 2, np.uint8)])
            codes = codes[0::2] | (codes[1::2] << np.uint8(4))
        out["topk_logprobs"] = codes
        out["lp_max"] = lp_max_U
        out["lp_scale"] = scale_U
    return out


def logprob_dtype(codec: Codec) -> np.dtype:
    """The stored dtype of the log-prob codes of ``codec``."""
    return np.dtype(
        {"u8": np.uint8, "u4": np.uint8, "bf16": np.uint16, "fp32": np.float32}[codec.logprobs]
    )


def decode_positions(
    columns: dict[str, Any], length: int, k: int, codec: Codec, width: int
) -> tuple[np.ndarray, np.ndarray]:
    """The ``[U, K]`` int32 ids and float32 log-probs of one sample's stored columns.

    Args:
        columns: ``topk_ids``, ``topk_logprobs`` (bytes, or flat arrays) and for ``u8`` and
            ``u4`` ``lp_max``, ``lp_scale`` of the sample.
        length: U.
        k: K.
        codec: how they were stored.
        width: the teacher vocab W (the ids' stored width).

    Raises:
        ValueError: columns whose sizes are not ``U * K`` (and ``U``), ids outside ``[0, W)``
            (checked here, where a collator reads them, so that the trainer need not scan them
            on its critical path).
    """
    stored = _array(columns["topk_ids"], id_dtype(width))
    codes = _array(columns["topk_logprobs"], logprob_dtype(codec))
    if codec.logprobs == "u4":
        if codes.size != (length * k + 1) // 2:
            raise ValueError(f"{codes.size} bytes of 4-bit codes for {length} positions of top-{k}")
        codes = np.stack([codes & np.uint8(15), codes >> np.uint8(4)], axis=1).reshape(-1)
        codes = codes[: length * k]
    if stored.size != length * k or codes.size != length * k:
        raise ValueError(
            f"{stored.size} ids and {codes.size} log-probs for {length} positions of top-{k}"
        )
    ids_UK = stored.reshape(length, k).astype(np.int64)
    if codec.ids == "delta":
        ids_UK = np.cumsum(ids_UK, axis=1)
    if ids_UK.size and (int(ids_UK.min()) < 0 or int(ids_UK.max()) >= width):
        raise ValueError(f"top-k ids outside [0, {width}): a damaged shard or another teacher's")
    if codec.logprobs == "fp32":
        logprobs_UK = codes.astype(np.float32).reshape(length, k)
    elif codec.logprobs == "bf16":
        bits = codes.astype(np.uint32) << np.uint32(16)
        logprobs_UK = bits.view(np.float32).reshape(length, k)
    else:
        lp_max_U = np.asarray(columns["lp_max"], dtype=np.float32)
        scale_U = np.asarray(columns["lp_scale"], dtype=np.float32)
        if lp_max_U.size != length or scale_U.size != length:
            raise ValueError(f"{lp_max_U.size} lp_max / {scale_U.size} lp_scale for {length}")
        logprobs_UK = (
            lp_max_U[:, None] - codes.reshape(length, k).astype(np.float32) * (scale_U[:, None])
        )
    return ids_UK.astype(np.int32), np.ascontiguousarray(logprobs_UK, dtype=np.float32)


def _array(value: Any, dtype: np.dtype) -> np.ndarray:
    if isinstance(value, bytes | bytearray | memoryview):
        return np.frombuffer(value, dtype=dtype.newbyteorder("<"))
    return np.asarray(value, dtype=dtype)
