"""What a logit ring puts in /dev/shm and on the wire: the control header's layout, the
descriptor and slot handle (parsed and checked), and the exact slot checksum.

Legend: S slots, B rows of a slot, U teacher tokens of a row, W teacher vocab.

The control header is always a small /dev/shm segment (native byte order, 8-byte words; each
word has one writer, every access is one aligned 8-byte load or store, so no atomics):

    word 0      magic       int64    0x58544B52494E4731 ("XTKRING1")
    word 1      version     int64    1
    word 2      instance    int64    random in [1, 2**63): names this ring, goes in every handle
    word 3      pid         int64    the teacher process
    word 4      heartbeat   float64  time.time() of the teacher's last beat (every heartbeat_s)
    word 5      closed      int64    1 once the teacher closed the ring
    word 6      num_slots   int64    S
    word 7      words       int64    16 + 2 S, the header length in words
    word 8      transport   int64    0 shm, 1 cuda_ipc
    word 9      dtype       int64    the wire dtype name, ASCII, zero-padded to 8 bytes
    word 10-12  B, U, W     int64    the slot shape
    word 13     data tag    int64    names the slots' memory: the shm segment name's 16 hex
                                     digits, or 8 bytes of blake2b of the CUDA IPC handle
    word 14-15  reserved    int64    0
    word 16+s   published_gen[s]     written by the teacher only
    word 16+S+s released_gen[s]      written by the trainer only

Words 0-3 and 6-13 are written once before the descriptor exists; a reader checks every one of
them against the descriptor, so a descriptor can only name its own header and its own slots.

The descriptor (``LogitRingWriter.descriptor``) and the handle (``LogitRingWriter.publish``) are
plain dicts of str/int/float/bytes/list (msgpack-able); ``parse_descriptor`` / ``parse_handle``
check everything in them before any file or GPU is touched and name the bad field.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from xtoken_core import envs
from xtoken_core.ipc.cuda import CudaIpcHandle
from xtoken_core.ipc.shm import align_up, check_name
from xtoken_core.ipc.slots import StaleHandleError
from xtoken_core.jagged import DTYPE_NAMES, WIRE_DTYPES

__all__ = [
    "HEADER_WORDS",
    "MAGIC",
    "TRANSPORTS",
    "VERSION",
    "RingDescriptor",
    "SlotHandle",
    "checksum_of",
    "header_bytes",
    "parse_descriptor",
    "parse_handle",
]

MAGIC = 0x58544B52494E4731  # b"XTKRING1" read as a big-endian int
VERSION = 1
TRANSPORTS = ("shm", "cuda_ipc")
HEADER_WORDS = 16  # fixed words before published_gen
W_MAGIC, W_VERSION, W_INSTANCE, W_PID, W_HEARTBEAT, W_CLOSED, W_SLOTS, W_WORDS = range(8)
W_TRANSPORT, W_DTYPE, W_B, W_U, W_W, W_DATA_TAG = range(8, 14)
MAX_SLOTS = 4096
MAX_DIM = 1 << 31  # bound on each of B, U, W (a sanity check on received descriptors)
HANDLE_KEYS = ("instance", "slot", "generation", "rows", "length", "width")
# Checksums upcast at most this many elements at a time (the upcast is a copy).
_CHECKSUM_CHUNK = 1 << 24
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def header_bytes(num_slots: int) -> int:
    """Bytes of the control header of a ring of ``num_slots`` slots (before alignment)."""
    return (HEADER_WORDS + 2 * num_slots) * 8


def data_bytes(num_slots: int, slot_shape: tuple[int, int, int], dtype: torch.dtype) -> int:
    """Bytes of the slots ``[S, B, U, W]`` of ``dtype``."""
    return num_slots * math.prod(slot_shape) * dtype.itemsize


def data_tag(data: str | CudaIpcHandle) -> int:
    """The header's ``data tag`` word of the slots' memory (see the module doc)."""
    if isinstance(data, str):
        raw = bytes.fromhex(data[-16:])
    else:
        key = data.handle + data.storage_offset.to_bytes(8, "little")
        raw = hashlib.blake2b(key + data.offset.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def identity_words(
    transport: str,
    instance: int,
    pid: int,
    num_slots: int,
    slot_shape: tuple[int, int, int],
    dtype: torch.dtype,
    data: str | CudaIpcHandle,
) -> dict[str, tuple[int, int]]:
    """name -> (word, value) of the header words a ring writes once and a reader checks."""
    dtype_word = int.from_bytes(DTYPE_NAMES[dtype].encode().ljust(8, b"\0"), "little", signed=True)
    return {
        "magic": (W_MAGIC, MAGIC),
        "version": (W_VERSION, VERSION),
        "instance": (W_INSTANCE, instance),
        "pid": (W_PID, pid),
        "num_slots": (W_SLOTS, num_slots),
        "words": (W_WORDS, HEADER_WORDS + 2 * num_slots),
        "transport": (W_TRANSPORT, TRANSPORTS.index(transport)),
        "dtype": (W_DTYPE, dtype_word),
        "B": (W_B, slot_shape[0]),
        "U": (W_U, slot_shape[1]),
        "W": (W_W, slot_shape[2]),
        "data tag": (W_DATA_TAG, data_tag(data)),
    }


def segment_size(nbytes: int) -> int:
    """The size ``ShmSegment.create(nbytes)`` gives a segment."""
    return max(64, align_up(nbytes))


def checksum_of(tensor: torch.Tensor) -> int:
    """Exact checksum of a tensor: the int64 sum (wrapping) of its elements' bit patterns.

    Integer addition is exact and order-free, so the same bits give the same checksum on any
    device, thread count or memory layout (a float sum would not); changing any one element
    changes it.

    Args:
        tensor: any strided tensor (CPU or CUDA) of a wire dtype, ``[rows, length, width]`` for
            a slot (a view or a copy: the layout does not matter).

    Returns:
        The checksum (a Python int; syncs the device once).
    """
    if tensor.dtype == torch.bool:
        bits = tensor.view(torch.uint8)
    elif tensor.dtype.is_floating_point:
        bits = tensor.view(_BITS[tensor.element_size()])  # same itemsize: any strides work
    else:
        bits = tensor
    total = torch.zeros((), dtype=torch.int64, device=bits.device)
    _add_bits(bits.reshape(1) if bits.dim() == 0 else bits, total)
    return int(total.item())


def _add_bits(bits: torch.Tensor, total: torch.Tensor) -> None:
    """``total += sum(bits)`` in int64, upcasting at most ``_CHECKSUM_CHUNK`` elements at once
    (the upcast is a copy: a whole slot of logits would need 4-8x its size)."""
    if bits.numel() <= _CHECKSUM_CHUNK:
        total += torch.sum(bits, dtype=torch.int64)
        return
    per_index = bits.numel() // bits.shape[0]
    step = max(1, _CHECKSUM_CHUNK // max(1, per_index))
    for start in range(0, bits.shape[0], step):
        part = bits[start : start + step]
        if step == 1 and part.dim() > 1:
            _add_bits(part[0], total)
        else:
            total += torch.sum(part, dtype=torch.int64)


def check_int(where: str, name: str, value: Any, lo: int, hi: int) -> int:
    """``value`` if it is an int (not a bool) in ``[lo, hi]``, else a ValueError naming it."""
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(f"{where} field {name!r}={value!r}: expected an int in [{lo}, {hi}]")
    return value


def cuda_device_key(index: int) -> str:
    """A name of a GPU that is the same in every process (CUDA_VISIBLE_DEVICES renumbers)."""
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return str(uuid)
    return f"index:{index}"  # pragma: no cover - torch builds without uuid


def local_cuda_index(key: str) -> int:
    """This process's index of the GPU named ``key``.

    Raises:
        ValueError: CUDA unavailable, or that GPU is not visible here.
    """
    if not torch.cuda.is_available():
        raise ValueError(
            "a cuda_ipc logit ring needs CUDA in the reading process; this process has none "
            "(run the trainer on the teacher's node with a GPU, or use the shm transport)"
        )
    for index in range(torch.cuda.device_count()):
        if cuda_device_key(index) == key:
            return index
    raise ValueError(
        f"the teacher's GPU {key} is not visible in this process (CUDA_VISIBLE_DEVICES="
        f"{envs.cuda_visible_devices()}); make it visible to the trainer "
        "(CUDA IPC maps memory of a GPU the process can see)"
    )


@dataclass(frozen=True)
class RingDescriptor:
    """A checked ring descriptor (``parse_descriptor``); fields as in
    ``LogitRingWriter.descriptor``, with ``data`` the shm segment name or a ``CudaIpcHandle``."""

    transport: str
    instance: int
    pid: int
    header: str
    num_slots: int
    slot_shape: tuple[int, int, int]
    dtype: torch.dtype
    data: str | CudaIpcHandle
    events: tuple[bytes, ...]
    device: str
    heartbeat_s: float


@dataclass(frozen=True)
class SlotHandle:
    """A checked slot handle (``parse_handle``): ``view`` reads
    ``slots[slot, :rows, :length, :width]`` if ``generation`` is still current."""

    instance: int
    slot: int
    generation: int
    rows: int
    length: int
    width: int
    checksum: int | None


def parse_descriptor(d: Any) -> RingDescriptor:
    """Check a descriptor received from another process (touches no file or GPU).

    Args:
        d: ``LogitRingWriter.descriptor``, possibly after a msgpack round trip.

    Returns:
        The checked descriptor.

    Raises:
        ValueError: naming the missing or bad field.
    """
    where = "logit ring descriptor"
    if not isinstance(d, dict):
        raise ValueError(
            f"{where} must be a dict (LogitRingWriter.descriptor), got {type(d).__name__}"
        )
    required = (
        "kind", "version", "transport", "instance", "pid", "header", "data", "num_slots",
        "slot_shape", "dtype",
    )  # fmt: skip
    missing = [k for k in required if k not in d]
    if missing:
        raise ValueError(
            f"{where} misses field(s) {missing} (has {sorted(map(str, d))}); pass "
            "LogitRingWriter.descriptor on unchanged"
        )
    if d["kind"] != "logit_ring":
        raise ValueError(f"{where} field 'kind'={d['kind']!r}: expected 'logit_ring'")
    if d["version"] != VERSION:
        raise ValueError(
            f"{where} field 'version'={d['version']!r}: this reader speaks version {VERSION}; "
            "run the same xtoken version in the teacher and the trainer"
        )
    transport = d["transport"]
    if transport not in TRANSPORTS:
        raise ValueError(f"{where} field 'transport'={transport!r}: expected one of {TRANSPORTS}")
    instance = check_int(where, "instance", d["instance"], 1, 2**63 - 1)
    pid = check_int(where, "pid", d["pid"], 1, 2**32 - 1)
    try:
        header = check_name(d["header"])
    except ValueError as e:
        raise ValueError(f"{where} field 'header': {e}") from None
    num_slots = check_int(where, "num_slots", d["num_slots"], 2, MAX_SLOTS)
    shape = d["slot_shape"]
    if not isinstance(shape, list | tuple) or len(shape) != 3:
        raise ValueError(f"{where} field 'slot_shape'={shape!r}: expected [B, U, W]")
    slot_shape = tuple(check_int(where, "slot_shape", s, 1, MAX_DIM) for s in shape)
    dtype = WIRE_DTYPES.get(d["dtype"]) if isinstance(d["dtype"], str) else None
    if dtype is None:
        raise ValueError(
            f"{where} field 'dtype'={d['dtype']!r}: expected one of {sorted(WIRE_DTYPES)}"
        )
    heartbeat_s = d.get("heartbeat_s", 0.5)
    if (
        not isinstance(heartbeat_s, int | float)
        or isinstance(heartbeat_s, bool)
        or not (0 < heartbeat_s < 3600)
    ):
        raise ValueError(f"{where} field 'heartbeat_s'={heartbeat_s!r}: expected seconds > 0")
    events: tuple[bytes, ...] = ()
    device = ""
    if transport == "shm":
        try:
            data: str | CudaIpcHandle = check_name(d["data"])
        except ValueError as e:
            raise ValueError(f"{where} field 'data': {e}") from None
    else:
        try:
            data = CudaIpcHandle.from_dict(d["data"])
        except ValueError as e:
            raise ValueError(f"{where} field 'data': {e}") from None
        expected = [num_slots, *slot_shape]
        contiguous = [math.prod(expected[i + 1 :]) for i in range(4)]
        if (
            list(data.shape) != expected
            or list(data.stride) != contiguous
            or data.dtype != dtype
            or data.index is not None
        ):
            raise ValueError(
                f"{where} field 'data' exports a {DTYPE_NAMES[data.dtype]} view "
                f"{list(data.shape)} (stride {list(data.stride)}, index {data.index}); the ring "
                f"is a contiguous {d['dtype']} {expected}"
            )
        raw = d.get("events")
        if (
            not isinstance(raw, list | tuple)
            or len(raw) != num_slots
            or not all(isinstance(e, bytes) and e for e in raw)
        ):
            raise ValueError(
                f"{where} field 'events': expected {num_slots} CUDA IPC event handles (bytes), "
                f"got {str(raw)[:100]}"
            )
        events = tuple(raw)
        device = d.get("device")
        if not isinstance(device, str) or not device:
            raise ValueError(f"{where} field 'device'={device!r}: expected the teacher GPU's uuid")
    return RingDescriptor(
        transport, instance, pid, header, num_slots, slot_shape, dtype, data, events, device,
        float(heartbeat_s),
    )  # fmt: skip


def parse_handle(h: Any, desc: RingDescriptor) -> SlotHandle:
    """Check a slot handle against its ring's descriptor (touches no file).

    Args:
        h: what ``LogitRingWriter.publish`` returned.
        desc: the ring's checked descriptor.

    Returns:
        The checked handle.

    Raises:
        ValueError: a missing or bad field (naming it).
        StaleHandleError: a well-formed handle of another ring instance (an earlier teacher).
    """
    where = "logit ring handle"
    if not isinstance(h, dict):
        raise ValueError(f"{where} must be a dict (from LogitRingWriter.publish), got {type(h)}")
    missing = [k for k in HANDLE_KEYS if k not in h]
    if missing:
        raise ValueError(f"{where} misses field(s) {missing} (has {sorted(map(str, h))})")
    batch, length, width = desc.slot_shape
    out = SlotHandle(
        instance=check_int(where, "instance", h["instance"], 1, 2**63 - 1),
        slot=check_int(where, "slot", h["slot"], 0, desc.num_slots - 1),
        generation=check_int(where, "generation", h["generation"], 1, 2**62),
        rows=check_int(where, "rows", h["rows"], 1, batch),
        length=check_int(where, "length", h["length"], 1, length),
        width=check_int(where, "width", h["width"], 1, width),
        checksum=h.get("checksum"),
    )
    if out.checksum is not None and type(out.checksum) is not int:
        raise ValueError(f"{where} field 'checksum'={out.checksum!r}: expected an int or None")
    if out.instance != desc.instance:
        raise StaleHandleError(
            f"logit ring handle of ring instance {out.instance:#x}, the descriptor is of "
            f"instance {desc.instance:#x} (teacher pid {desc.pid}): the handle is from an earlier "
            "teacher; recompute the batch"
        )
    return out
