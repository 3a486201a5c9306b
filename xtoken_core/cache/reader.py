"""Reading the teacher cache: a sample's targets by its key.

The reader indexes the keys of every shard the manifest lists (the ``key`` column alone) and
reads a shard one row group at a time, keeping the last :data:`HELD_ROW_GROUPS` it read: the
builder writes a window of texts sorted by length, so samples asked for in corpus order visit a
few row groups back and forth, each read once.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from xtoken_core.cache.format import FORMAT_VERSION, Codec, Row, decode_positions
from xtoken_core.cache.manifest import key_shard, read_manifest
from xtoken_core.errors import DataError, SettingsError

__all__ = ["HELD_ROW_GROUPS", "CacheReader", "missing_line"]

#: Row groups a reader keeps decoded (the last ones read).
HELD_ROW_GROUPS = 16


class CacheReader:
    """The targets of a cache folder, by sample key.

    Args:
        directory: the cache folder.

    Raises:
        SettingsError: no cache there (no manifest), or one of another format version.
        DataError: a shard that cannot be read (names it).
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        import pyarrow.parquet as pq

        self.directory = Path(directory)
        manifest = read_manifest(self.directory)
        if manifest is None:
            raise SettingsError(
                f"{self.directory} is no teacher cache (no manifest.json): build one with "
                "`xtoken cache build CONFIG --out DIR`"
            )
        if manifest.get("format_version") != FORMAT_VERSION:
            raise SettingsError(
                f"{self.directory}: cache format version {manifest.get('format_version')}, this "
                f"xtoken reads version {FORMAT_VERSION}: build the cache again"
            )
        self.manifest = manifest
        self.codec = Codec(**manifest["codec"])
        self.k, self.width = int(manifest["k"]), int(manifest["width"])
        self.shards = [s["path"] for s in manifest["shards"]]
        self._index: dict[str, tuple[int, int]] = {}
        self._starts: list[list[int]] = []  # per shard, the first row of each row group
        for i, entry in enumerate(manifest["shards"]):
            path = self.directory / entry["path"]
            try:
                keys = pq.read_table(path, columns=["key"]).column("key").to_pylist()
            except (OSError, ValueError) as e:
                raise DataError(
                    f"teacher cache shard {path} cannot be read ({e}); run `xtoken cache verify "
                    f"{self.directory}`"
                ) from None
            self._index.update((key, (i, row)) for row, key in enumerate(keys))
            starts = np.cumsum([0] + [rg["rows"] for rg in entry["row_groups"]]).tolist()
            self._starts.append(starts)
        self._files: dict[int, Any] = {}
        self._held: OrderedDict[tuple[int, int], Any] = OrderedDict()  # (shard, group) -> table

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def keys(self) -> list[str]:
        """Every key the cache holds."""
        return list(self._index)

    def missing(self, keys: list[str]) -> list[str]:
        """The keys of ``keys`` the cache does not hold."""
        return [k for k in keys if k not in self._index]

    def get(self, key: str) -> Row:
        """The targets of sample ``key``.

        Raises:
            KeyError: the cache does not hold it.
            DataError: its shard cannot be read, or its targets not decoded (ids outside the
                vocab: names the shard and the key).
        """
        shard, row = self._index[key]
        starts = self._starts[shard]
        group = int(np.searchsorted(starts, row, side="right")) - 1
        table = self._row_group(shard, group)
        i = row - starts[group]
        try:
            return self._decode(table, i)
        except ValueError as e:
            raise DataError(
                f"teacher cache shard {self.directory / self.shards[shard]} sample {key!r}: {e}; "
                f"run `xtoken cache verify {self.directory}`"
            ) from None

    def _row_group(self, shard: int, group: int) -> Any:
        table = self._held.get((shard, group))
        if table is not None:
            self._held.move_to_end((shard, group))
            return table
        import pyarrow.parquet as pq

        path = self.directory / self.shards[shard]
        try:
            f = self._files.get(shard)
            if f is None:
                f = self._files[shard] = pq.ParquetFile(path)
            table = f.read_row_group(group)
        except (OSError, ValueError) as e:
            raise DataError(
                f"teacher cache shard {path} row group {group} cannot be read ({e}); run "
                f"`xtoken cache verify {self.directory}`"
            ) from None
        self._held[shard, group] = table
        if len(self._held) > HELD_ROW_GROUPS:
            self._held.popitem(last=False)
        return table

    def _decode(self, table: Any, i: int) -> Row:
        def values(name: str) -> np.ndarray:
            col = table.column(name).chunk(0) if table.column(name).num_chunks == 1 else None
            if col is None:
                col = table.column(name).combine_chunks()
            lo, hi = col.offsets[i].as_py(), col.offsets[i + 1].as_py()
            return col.values.slice(lo, hi - lo).to_numpy(zero_copy_only=False)

        key = table.column("key")[i].as_py()
        U = int(table.column("length")[i].as_py())
        columns = {n: table.column(n)[i].as_py() for n in ("topk_ids", "topk_logprobs")}
        if self.codec.stepped:
            columns.update(lp_max=values("lp_max"), lp_scale=values("lp_scale"))
        ids_UK, logprobs_UK = decode_positions(columns, U, self.k, self.codec, self.width)
        return Row(
            key=key,
            teacher_ids_U=values("teacher_ids").astype(np.int32),
            ids_UK=ids_UK,
            logprobs_UK=logprobs_UK,
            rest_U=values("rest").astype(np.float32),
            lse_U=values("lse").astype(np.float32),
        )


def missing_line(directory: str | os.PathLike, missing: list[str], builders: int) -> str:
    """One line naming how many samples a cache lacks, a few of their keys, and which builder
    shards (``--shard i/n``) own them."""
    owners = sorted({key_shard(k, builders) for k in missing})
    shown = ", ".join(repr(k) for k in missing[:3]) + (", ..." if len(missing) > 3 else "")
    where = ", ".join(f"{i}/{builders}" for i in owners[:8]) + (" ..." if len(owners) > 8 else "")
    return (
        f"the teacher cache {directory} lacks {len(missing)} sample(s) of the corpus ({shown}) "
        f"of builder shard(s) {where}: run `xtoken cache build` over this corpus into it (it "
        "writes only what is missing)"
    )
