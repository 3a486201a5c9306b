"""A GGUF file's metadata and tensor shapes, read without parsing its long arrays.

Why our own reader: ``gguf.GGUFReader`` builds a numpy view for every element of every array
when it opens a file (6-8 s for the 150-260 k token lists and merges of Qwen2.5 or Gemma-3 on
one core), and a run's pre-flight only wants a few numbers (the vocab, one string). This reader
walks the same layout (llama.cpp's ``gguf.md``: magic, version, tensor and key counts, the
key/value pairs, the tensor infos), stepping over an array's items with their lengths alone,
and decodes an array only when it is asked for (:meth:`GgufHeader.array`). Byte order follows
the version word, as the ``gguf`` package decides it.

Legend: a value type is GGUF's code (0 uint8 ... 12 float64; 8 string, 9 array).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

__all__ = ["GgufArray", "GgufHeader", "read_gguf_header"]

_STRING, _ARRAY = 8, 9
#: struct codes of the fixed-size value types
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}


@dataclass(frozen=True)
class GgufArray:
    """An array value, not decoded: its item type, item count and where its items start."""

    item_type: int
    count: int
    offset: int


@dataclass(frozen=True)
class GgufHeader:
    """What a GGUF file says about itself.

    Attributes:
        path: the file.
        version: the format version (2 or 3).
        fields: every key's value: a number, bool or string, or a :class:`GgufArray`.
        tensors: each tensor's dimensions as the file stores them (ggml order: the first is the
            fastest-varying, so a token embedding is ``(hidden, vocab)``).
    """

    path: Path
    version: int
    fields: dict[str, object]
    tensors: dict[str, tuple[int, ...]]
    byte_order: str = "<"

    def value(self, key: str):
        """``key``'s value with arrays decoded (a list), or None where the file lacks it."""
        v = self.fields.get(key)
        return self.array(key) if isinstance(v, GgufArray) else v

    def array(self, key: str) -> list:
        """The items of the array ``key`` (strings decoded as UTF-8, nested arrays as lists)."""
        arr = self.fields[key]
        if not isinstance(arr, GgufArray):
            raise TypeError(f"{key!r} is not an array")
        with self.path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            r = _Cursor(buf, self.byte_order, arr.offset, self.path)
            return [r.value(arr.item_type, decode=True) for _ in range(arr.count)]


class _Cursor:
    """Reads little- or big-endian GGUF values from a buffer, one offset moving forward."""

    def __init__(self, buf, order: str, offset: int, path: Path) -> None:
        self.buf, self.order, self.at, self.path = buf, order, offset, path

    def unpack(self, code: str):
        fmt = self.order + code
        try:
            (v,) = struct.unpack_from(fmt, self.buf, self.at)
        except struct.error:
            raise ValueError(f"{str(self.path)!r}: the file ends inside its GGUF header") from None
        self.at += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.unpack("Q")
        end = self.at + n
        if end > len(self.buf):
            raise ValueError(f"{str(self.path)!r}: the file ends inside its GGUF header")
        s = bytes(self.buf[self.at : end]).decode("utf-8", errors="replace")
        self.at = end
        return s

    def value(self, vtype: int, decode: bool = False):
        """The next value: an array as a :class:`GgufArray` stepped over, or its items as a
        list where ``decode``."""
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item, count = self.unpack("I"), self.unpack("Q")
            if decode:
                return [self.value(item, decode=True) for _ in range(count)]
            arr = GgufArray(item, count, self.at)
            self.skip_items(item, count)
            return arr
        code = _SCALARS.get(vtype)
        if code is None:
            raise ValueError(f"{str(self.path)!r}: unknown GGUF value type {vtype}")
        return self.unpack(code)

    def skip_items(self, item: int, count: int) -> None:
        """Step over ``count`` items of type ``item``: one jump for fixed-size items, a hop per
        item (its length alone) for strings, a walk for nested arrays."""
        code = _SCALARS.get(item)
        if code is not None:
            self.at += struct.calcsize(self.order + code) * count
            if self.at > len(self.buf):
                raise ValueError(f"{str(self.path)!r}: the file ends inside its GGUF header")
        elif item == _STRING:
            unpack, q, buf, at = struct.unpack_from, self.order + "Q", self.buf, self.at
            try:
                for _ in range(count):
                    at += 8 + unpack(q, buf, at)[0]
            except struct.error:
                raise ValueError(
                    f"{str(self.path)!r}: the file ends inside its GGUF header"
                ) from None
            self.at = at
        elif item == _ARRAY:
            for _ in range(count):
                self.skip_items(self.unpack("I"), self.unpack("Q"))
        else:
            raise ValueError(f"{str(self.path)!r}: unknown GGUF value type {item}")


def read_gguf_header(path: str | Path) -> GgufHeader:
    """The metadata and tensor shapes of a GGUF file (versions 2 and 3, either byte order).

    Raises:
        ValueError: no such file, not a GGUF file, a version this reader does not know, or a
            file that ends inside its header (each names the file).
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"{str(path)!r}: no such file; pass the path of a .gguf file")
    with path.open("rb") as f:
        if path.stat().st_size < 24:
            raise ValueError(f"{str(path)!r} is not a GGUF file (too short)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if bytes(buf[:4]) != b"GGUF":
                raise ValueError(f"{str(path)!r} is not a GGUF file (no GGUF magic)")
            (version,) = struct.unpack_from("<I", buf, 4)
            order = "<"
            if version & 0xFFFF == 0:  # written on a big-endian machine: the word is swapped
                order, version = ">", struct.unpack_from(">I", buf, 4)[0]
            if version not in (2, 3):
                raise ValueError(
                    f"{str(path)!r}: GGUF version {version}; this reader knows versions 2 and 3"
                )
            r = _Cursor(buf, order, 8, path)
            n_tensors, n_fields = r.unpack("Q"), r.unpack("Q")
            fields: dict[str, object] = {}
            for _ in range(n_fields):
                key = r.string()
                fields[key] = r.value(r.unpack("I"))
            tensors: dict[str, tuple[int, ...]] = {}
            for _ in range(n_tensors):
                name = r.string()
                dims = tuple(r.unpack("Q") for _ in range(r.unpack("I")))
                r.unpack("I")  # the tensor's ggml type
                r.unpack("Q")  # its offset in the data section
                tensors[name] = dims
    return GgufHeader(path, version, fields, tensors, order)
