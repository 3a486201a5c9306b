"""Teacher-cache shards written whole: rows gathered in memory, encoded into one Parquet file in
memory, written to a temporary name, flushed to disk and renamed into place, so a crash or a
full disk never leaves a half-written shard under a shard's name.

A full disk (``ENOSPC``, a quota's ``EDQUOT``, a file-size limit's ``EFBIG``) removes the
temporary file and raises :class:`DiskFullError`; the shards written before stay, and a rerun of
the build writes the rest.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from xtoken_core.cache.format import FORMAT_VERSION, Codec, encode_positions, schema
from xtoken_core.cache.manifest import FULL_ERRNOS, SHARDS_DIR, DiskFullError, fsync_dir

__all__ = ["DiskFullError", "ShardWriter", "entry_of_file", "row_group_ranges", "shard_prefix"]

# the key of the shard's own record in the Parquet file's metadata
META_KEY = b"xtoken.cache"


def shard_prefix(index: int, count: int) -> str:
    """The file-name prefix of builder ``index`` of ``count``'s shards (``b0of4``)."""
    return f"b{index}of{count}"


def row_group_ranges(metadata: Any) -> list[tuple[int, int, int]]:
    """``(offset, length, rows)`` of each row group of a Parquet file's metadata: the bytes of
    its column chunks."""
    out = []
    for i in range(metadata.num_row_groups):
        rg = metadata.row_group(i)
        starts, ends = [], []
        for c in range(rg.num_columns):
            col = rg.column(c)
            start = col.data_page_offset
            if col.has_dictionary_page and col.dictionary_page_offset is not None:
                start = min(start, col.dictionary_page_offset)
            starts.append(start)
            ends.append(start + col.total_compressed_size)
        out.append((min(starts), max(ends) - min(starts), rg.num_rows))
    return out


class ShardWriter:
    """Gathers one builder's rows and writes them as shards.

    Args:
        directory: the cache folder (its ``shards/`` folder receives the files).
        codec: how the top-K payload is stored.
        width: the teacher vocab W.
        k: ids kept per position.
        builder: ``(index, count)`` of this builder.
        row_group_rows: samples per Parquet row group (a reader reads one row group at a time).
        compression: Parquet compression (``zstd``, ``none``...).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        codec: Codec,
        width: int,
        k: int,
        builder: tuple[int, int],
        *,
        row_group_rows: int = 64,
        compression: str = "zstd",
    ) -> None:
        self.directory = Path(directory)
        self.codec, self.width, self.k = codec, width, k
        self.builder = builder
        self.prefix = shard_prefix(*builder)
        self.row_group_rows = row_group_rows
        self.compression = compression
        self.schema = schema(codec, width)
        (self.directory / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
        self._rows: dict[str, list[Any]] = {name: [] for name in self.schema.names}
        self.rows = 0  # rows gathered, not written
        self.tokens = 0
        self.nbytes = 0  # bytes of their payload in memory (a shard is cut by it)
        self.seq = self._next_seq()

    def _next_seq(self) -> int:
        pattern = re.compile(rf"{re.escape(self.prefix)}-(\d+)\.parquet$")
        seqs = [
            int(m.group(1))
            for p in (self.directory / SHARDS_DIR).iterdir()
            if (m := pattern.match(p.name))
        ]
        return max(seqs, default=-1) + 1

    def remove_temporaries(self) -> int:
        """Remove this builder's temporary files a killed build left; returns how many."""
        removed = 0
        for p in (self.directory / SHARDS_DIR).glob(f".{self.prefix}-*.tmp"):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                removed += 1
        return removed

    def add(
        self,
        key: str,
        teacher_ids_U: np.ndarray,
        ids_UK: np.ndarray,
        logprobs_UK: np.ndarray,
        rest_U: np.ndarray,
        lse_U: np.ndarray,
    ) -> None:
        """Gather one sample's targets (numpy arrays; U positions of K ids).

        Raises:
            ValueError: shapes that disagree with U and K, or ids outside the vocab.
        """
        U = int(len(teacher_ids_U))
        if ids_UK.shape != (U, self.k) or rest_U.shape != (U,) or lse_U.shape != (U,):
            raise ValueError(
                f"sample {key!r}: targets {ids_UK.shape}, rest {rest_U.shape}, lse "
                f"{lse_U.shape} for {U} teacher tokens of top-{self.k}"
            )
        cols = encode_positions(ids_UK, logprobs_UK, self.codec, self.width)
        cols.update(
            teacher_ids=np.asarray(teacher_ids_U, dtype=np.int32),
            rest=np.asarray(rest_U, dtype=np.float32),
            lse=np.asarray(lse_U, dtype=np.float32),
        )
        self._rows["key"].append(key)
        self._rows["length"].append(U)
        for name, values in cols.items():
            self.nbytes += values.nbytes
            if name in ("topk_ids", "topk_logprobs"):  # raw little-endian bytes
                values = values.astype(values.dtype.newbyteorder("<"), copy=False).tobytes()
            self._rows[name].append(values)
        self.rows += 1
        self.tokens += U

    def flush(self) -> dict[str, Any] | None:
        """Write the gathered rows as one shard (nothing gathered: None).

        Returns:
            The shard's manifest entry: ``path`` (relative to the cache folder), ``builder``,
            ``samples``, ``teacher_tokens``, ``bytes``, ``sha256``, ``row_groups``,
            ``first_key``, ``last_key``.

        Raises:
            DiskFullError: the disk took no more bytes (the rows stay gathered: a flush may be
                tried again).
        """
        if not self.rows:
            return None
        import pyarrow as pa
        import pyarrow.parquet as pq

        arrays = []
        for f in self.schema:
            values = self._rows[f.name]
            if pa.types.is_list(f.type):
                lengths = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
                offsets = np.zeros(len(values) + 1, dtype=np.int32)
                np.cumsum(lengths, out=offsets[1:])
                flat = np.concatenate(values) if values else np.zeros(0)
                flat = pa.array(flat.astype(f.type.value_type.to_pandas_dtype(), copy=False))
                arrays.append(pa.ListArray.from_arrays(pa.array(offsets), flat))
            else:
                arrays.append(pa.array(values, type=f.type))
        info = {
            "builder": f"{self.builder[0]}/{self.builder[1]}",
            "samples": self.rows,
            "teacher_tokens": self.tokens,
            "format_version": FORMAT_VERSION,
        }
        meta = {META_KEY: json.dumps(info).encode()}
        table = pa.Table.from_arrays(arrays, schema=self.schema.with_metadata(meta))
        sink = pa.BufferOutputStream()
        pq.write_table(
            table,
            sink,
            row_group_size=self.row_group_rows,
            compression=self.compression,
            use_dictionary=["key"],
            write_statistics=["key", "length"],
        )
        data = sink.getvalue().to_pybytes()
        name = f"{self.prefix}-{self.seq:06d}.parquet"
        final = self.directory / SHARDS_DIR / name
        _write_whole(final, data)
        metadata = pq.ParquetFile(pa.BufferReader(data)).metadata
        entry = {
            "path": f"{SHARDS_DIR}/{name}",
            **info,
            **_checksums(data, metadata),
            "first_key": self._rows["key"][0],
            "last_key": self._rows["key"][-1],
        }
        del entry["format_version"]
        self.seq += 1
        self._rows = {n: [] for n in self.schema.names}
        self.rows = self.tokens = self.nbytes = 0
        return entry


def _write_whole(final: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``final``, flush it and rename it into place.

    Raises:
        DiskFullError: no space (the temporary file removed).
    """
    tmp = final.with_name(f".{final.stem}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if e.errno in FULL_ERRNOS:
            raise DiskFullError(
                e.errno,
                f"no space for shard {final.name} ({len(data)} bytes): {os.strerror(e.errno)}",
            ) from None
        raise
    fsync_dir(final.parent)


def entry_of_file(directory: str | os.PathLike, path: str | os.PathLike) -> dict[str, Any]:
    """The manifest entry of a shard file already on disk (one a killed build wrote but did not
    record), read from its bytes and its Parquet metadata.

    Raises:
        ValueError: not a shard of this format (no record of its builder in its metadata).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    data = path.read_bytes()
    f = pq.ParquetFile(pa.BufferReader(data))
    raw = (f.schema_arrow.metadata or {}).get(META_KEY)
    if raw is None:
        raise ValueError(f"{path} is no teacher-cache shard (no {META_KEY.decode()} metadata)")
    info = json.loads(raw)
    keys = f.read(columns=["key"]).column("key")
    return {
        "path": f"{SHARDS_DIR}/{path.name}",
        "builder": info["builder"],
        "samples": info["samples"],
        "teacher_tokens": info["teacher_tokens"],
        **_checksums(data, f.metadata),
        "first_key": keys[0].as_py() if len(keys) else None,
        "last_key": keys[-1].as_py() if len(keys) else None,
    }


def _checksums(data: bytes, metadata: Any) -> dict[str, Any]:
    """A shard's size, sha256 and its row groups' byte ranges, rows and sha256 (what
    ``xtoken cache verify`` checks), from its bytes and Parquet metadata."""
    return {
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "row_groups": [
            {
                "offset": off,
                "length": length,
                "rows": rows,
                "sha256": hashlib.sha256(data[off : off + length]).hexdigest(),
            }
            for off, length, rows in row_group_ranges(metadata)
        ],
    }
