"""The teacher cache's manifest: what the cache holds (fingerprint, codec, counts, bytes) and each
shard's checksums, updated atomically under a lock so that several builders share one folder.

``manifest.json`` (docs/design.md, "The teacher cache"):

* ``format`` (``xtoken-teacher-cache``) and ``format_version``;
* ``fingerprint``: what the targets depend on: ``teacher`` (``model`` spec, ``weights_hash``,
  ``width``: the logits' width W), ``tokenizer`` (``name``, ``vocab_size``, ``vocab_hash``),
  ``ctx_teacher``, ``k``, ``temperature`` (null: log-probs at temperature 1, the loss applies
  its own), ``add_special_tokens``, ``format_version``, and ``corpus`` (its files' names, sizes
  and sha256, and the corpus settings);
* ``codec`` (:class:`xtoken_core.cache.format.Codec`), ``k``, ``width``;
* ``builders``: per ``--shard i/n``, whether it finished and what it wrote;
* ``shards``: per shard file its ``path`` (relative), ``builder``, ``samples``,
  ``teacher_tokens``, ``bytes``, ``sha256`` and its ``row_groups`` (``offset``, ``length``,
  ``rows``, ``sha256``): a damaged byte is named by the row group that holds it;
* ``samples``, ``teacher_tokens``, ``bytes``, ``bytes_per_teacher_token``, ``complete``.

A sample belongs to builder ``i`` of ``n`` when :func:`key_shard` of its key is ``i``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from xtoken_core.errors import DataError

__all__ = [
    "FORMAT_NAME",
    "DiskFullError",
    "LOCK_FILE",
    "MANIFEST_FILE",
    "SHARDS_DIR",
    "fingerprint_changes",
    "key_shard",
    "locked",
    "parse_shard",
    "read_manifest",
    "totals",
    "update_manifest",
    "write_json_atomic",
]

FORMAT_NAME = "xtoken-teacher-cache"
MANIFEST_FILE = "manifest.json"
LOCK_FILE = ".lock"
SHARDS_DIR = "shards"
# the fingerprint keys a run's teacher must match (the corpus may differ: a sample the cache
# lacks is reported by key)
RUN_KEYS = (
    "format_version",
    "teacher.model",
    "teacher.weights_hash",
    "teacher.width",
    "tokenizer.name",
    "tokenizer.vocab_size",
    "tokenizer.vocab_hash",
    "ctx_teacher",
    "add_special_tokens",
    "temperature",
)


# errnos of a disk that cannot take more bytes (a quota's, a file-size limit's)
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})


class DiskFullError(OSError):
    """The disk (or a quota, or a file-size limit) took no more bytes; the file being written was
    removed, every shard written before is kept (a shard not yet in the manifest is recorded by
    the next build)."""


def key_shard(key: str, n: int) -> int:
    """The builder (of ``n``) that owns sample ``key``: a hash of the key modulo ``n``, the same
    on every machine and every run."""
    digest = hashlib.sha1(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") % n


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` as ``(i, n)``.

    Raises:
        ValueError: not two integers with ``0 <= i < n`` (names the value and the form).
    """
    i, sep, n = str(text).partition("/")
    if not (sep and i.strip().isdigit() and n.strip().isdigit()) or not 0 <= int(i) < int(n):
        raise ValueError(f"--shard {text!r}: give I/N with 0 <= I < N, e.g. 0/4")
    return int(i), int(n)


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """Write JSON to a temporary file, flush it to disk and rename it over ``path`` (a reader sees
    the old file or the new one, never a part)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
            raise DiskFullError(
                e.errno, f"no space for {path.name}: {os.strerror(e.errno)}"
            ) from None
        raise
    fsync_dir(path.parent)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a folder's entries (a rename in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest of a cache folder (None: the folder holds none).

    Raises:
        DataError: a manifest that is no JSON object of this format (names the file).
    """
    path = Path(directory) / MANIFEST_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise DataError(f"{path}: not a JSON manifest ({e}); the cache is damaged") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise DataError(f"{path}: not a teacher-cache manifest (format {FORMAT_NAME!r})")
    return data


@contextlib.contextmanager
def locked(directory: str | os.PathLike) -> Iterator[None]:
    """Hold the cache folder's lock (``.lock``, ``flock``): one builder at a time updates the
    manifest."""
    fd = os.open(Path(directory) / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def totals(manifest: dict[str, Any]) -> None:
    """Recount ``samples``, ``teacher_tokens``, ``bytes``, ``bytes_per_teacher_token`` and
    ``complete`` of a manifest from its shards and builders (in place)."""
    shards = manifest.get("shards", [])
    manifest["samples"] = sum(s["samples"] for s in shards)
    manifest["teacher_tokens"] = sum(s["teacher_tokens"] for s in shards)
    manifest["bytes"] = sum(s["bytes"] for s in shards)
    tokens = manifest["teacher_tokens"]
    manifest["bytes_per_teacher_token"] = manifest["bytes"] / tokens if tokens else None
    builders = manifest.get("builders", {})
    n = {int(b.split("/")[1]) for b in builders}
    manifest["complete"] = (
        bool(builders)
        and all(len([b for b in builders if int(b.split("/")[1]) == m]) == m for m in n)
        and all(b.get("done") for b in builders.values())
    )


def update_manifest(
    directory: str | os.PathLike, change: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """Read the manifest under the folder's lock, apply ``change`` to it, recount
    (:func:`totals`) and write it back atomically.

    Returns:
        The manifest as written.

    Raises:
        FileNotFoundError: the folder has no manifest yet.
    """
    with locked(directory):
        manifest = read_manifest(directory)
        if manifest is None:
            raise FileNotFoundError(f"{Path(directory) / MANIFEST_FILE} does not exist")
        change(manifest)
        totals(manifest)
        write_json_atomic(Path(directory) / MANIFEST_FILE, manifest)
        return manifest


def _at(data: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        if not isinstance(data, dict):
            return None
        data = data.get(part)
    return data


def fingerprint_changes(
    cached: dict[str, Any], wanted: dict[str, Any], keys: tuple[str, ...] = RUN_KEYS
) -> list[str]:
    """The fingerprint keys whose values differ, each as ``key: cached -> wanted``."""
    return [
        f"{key}: {_at(cached, key)!r} -> {_at(wanted, key)!r}"
        for key in keys
        if _at(cached, key) != _at(wanted, key)
    ]
