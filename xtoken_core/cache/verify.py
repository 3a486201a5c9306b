"""Checking a teacher cache: every shard the manifest lists is there, of its size, its bytes
match their checksums row group by row group, every row decodes, and the counts match the
manifest. A damaged shard is named with its path and the byte offset where the damage starts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Any

from xtoken_core.cache.format import Codec
from xtoken_core.cache.manifest import SHARDS_DIR, read_manifest

__all__ = ["Problem", "VerifyReport", "verify_cache"]


@dataclasses.dataclass(frozen=True)
class Problem:
    """One damaged or missing shard.

    Attributes:
        path: the shard file.
        offset: the byte offset where the damage starts (None: the whole file).
        message: what is wrong.
    """

    path: str
    offset: int | None
    message: str

    def line(self) -> str:
        """One line: path, offset, message."""
        at = f" at byte offset {self.offset}" if self.offset is not None else ""
        return f"{self.path}{at}: {self.message}"


@dataclasses.dataclass
class VerifyReport:
    """What :func:`verify_cache` found.

    Attributes:
        shards: shards checked.
        samples: rows read.
        teacher_tokens: teacher positions read.
        problems: damaged or missing shards, and counts that disagree with the manifest.
        unlisted: shard files the manifest does not list (a build stopped before recording
            them: the next build takes them in).
    """

    shards: int = 0
    samples: int = 0
    teacher_tokens: int = 0
    problems: list[Problem] = dataclasses.field(default_factory=list)
    unlisted: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No problem found."""
        return not self.problems


def verify_cache(directory: str | os.PathLike, *, decode: bool = True) -> VerifyReport:
    """Check every shard of a cache folder against its manifest.

    Args:
        directory: the cache folder.
        decode: also read and decode every row (else checksums and sizes only).

    Returns:
        The :class:`VerifyReport`.

    Raises:
        SettingsError/DataError: no manifest, or one that does not parse (from
            :func:`read_manifest`).
    """
    from xtoken_core.errors import SettingsError

    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest is None:
        raise SettingsError(f"{directory} is no teacher cache (no manifest.json)")
    report = VerifyReport()
    listed = set()
    keys: dict[str, str] = {}
    for entry in manifest.get("shards", []):
        path = directory / entry["path"]
        listed.add(path.name)
        report.shards += 1
        problem = _check_bytes(path, entry)
        if problem is None and decode:
            problem = _check_rows(path, entry, manifest, report, keys)
        if problem is not None:
            report.problems.append(problem)
    shards_dir = directory / SHARDS_DIR
    if shards_dir.is_dir():
        report.unlisted = sorted(
            p.name for p in shards_dir.glob("*.parquet") if p.name not in listed
        )
    if not report.problems and decode and report.samples != manifest.get("samples"):
        report.problems.append(
            Problem(
                str(directory / "manifest.json"),
                None,
                f"the manifest counts {manifest.get('samples')} samples, the shards hold "
                f"{report.samples}",
            )
        )
    return report


def _check_bytes(path: Path, entry: dict[str, Any]) -> Problem | None:
    """Size and checksums of one shard's bytes."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return Problem(str(path), None, "missing (the manifest lists it)")
    except OSError as e:
        return Problem(str(path), None, f"cannot be read: {e}")
    if len(data) < entry["bytes"]:
        return Problem(str(path), len(data), f"truncated: {len(data)} of {entry['bytes']} bytes")
    if len(data) > entry["bytes"]:
        return Problem(
            str(path), entry["bytes"], f"{len(data)} bytes, the manifest says {entry['bytes']}"
        )
    if hashlib.sha256(data).hexdigest() == entry["sha256"]:
        return None
    end = 0
    for i, rg in enumerate(entry["row_groups"]):
        off, length = rg["offset"], rg["length"]
        if hashlib.sha256(data[off : off + length]).hexdigest() != rg["sha256"]:
            return Problem(
                str(path),
                off,
                f"row group {i} ({rg['rows']} samples, bytes {off}-{off + length}) does not "
                "match its checksum",
            )
        end = max(end, off + length)
    return Problem(
        str(path), end, f"the footer (bytes {end}-{len(data)}) does not match the checksum"
    )


def _check_rows(
    path: Path,
    entry: dict[str, Any],
    manifest: dict[str, Any],
    report: VerifyReport,
    keys: dict[str, str],
) -> Problem | None:
    """Decode every row of one shard (bytes already checked)."""
    import pyarrow.parquet as pq

    from xtoken_core.cache.format import decode_positions

    codec = Codec(**manifest["codec"])
    k = int(manifest["k"])
    try:
        f = pq.ParquetFile(path)
    except (OSError, ValueError) as e:
        return Problem(str(path), None, f"no readable Parquet footer ({e})")
    rows = 0
    tokens = 0
    for g in range(f.metadata.num_row_groups):
        offset = entry["row_groups"][g]["offset"] if g < len(entry["row_groups"]) else None
        try:
            table = f.read_row_group(g)
            cols = {name: table.column(name).combine_chunks() for name in table.column_names}
            for i in range(table.num_rows):
                U = int(cols["length"][i].as_py())
                parts = {n: cols[n][i].as_py() for n in ("topk_ids", "topk_logprobs")}
                for name in ("lp_max", "lp_scale"):
                    if name in cols:
                        parts[name] = cols[name][i].values.to_numpy(zero_copy_only=False)
                decode_positions(parts, U, k, codec, int(manifest["width"]))
                for name in ("teacher_ids", "rest", "lse"):
                    if len(cols[name][i].values) != U:
                        raise ValueError(f"{name} has {len(cols[name][i].values)} of {U} values")
                key = cols["key"][i].as_py()
                if key in keys:
                    raise ValueError(f"sample {key!r} is also in {keys[key]}")
                keys[key] = path.name
                tokens += U
            rows += table.num_rows
        except (OSError, ValueError, KeyError) as e:
            return Problem(str(path), offset, f"row group {g} does not decode ({e})")
    if rows != entry["samples"] or tokens != entry["teacher_tokens"]:
        return Problem(
            str(path),
            None,
            f"holds {rows} samples / {tokens} teacher tokens, the manifest says "
            f"{entry['samples']} / {entry['teacher_tokens']}",
        )
    report.samples += rows
    report.teacher_tokens += tokens
    return None
