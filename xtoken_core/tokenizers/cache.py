"""The xtoken file cache (``XTOKEN_CACHE``): folders derived once from installed packages.

Files that are slow to derive (a tokenizer extracted from a GGUF file, a dequantized model) are
built once into ``<cache>/<kind>/<name>`` and reused. Each folder carries a stamp
(``xtoken_stamp.json``) describing its source; a folder whose stamp differs (a new package
version) is rebuilt. Folders are built in a temporary sibling and renamed into place, so a reader
never sees a half-written folder and two processes building at once both end with a whole one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from xtoken_core import envs

logger = logging.getLogger(__name__)

STAMP_FILE = "xtoken_stamp.json"


def cache_root() -> Path:
    """The root of the xtoken cache: ``$XTOKEN_CACHE``, else ``~/.cache/xtoken`` (read now).

    Returns:
        The folder (not created here).
    """
    env = envs.xtoken_cache()
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "xtoken"


def source_stamp(source: Path, package: str | None, fmt: int) -> dict:
    """What a cached folder is built from: the source file (name, size), the PyPI distribution
    that ships it and its installed version, and the cache format; a change rebuilds the folder.

    Args:
        source: the file the folder is built from.
        package: the distribution that ships it, or None.
        fmt: the format number of the cached folder.

    Returns:
        The stamp (a JSON-able dict) for :func:`cached_folder`.
    """
    import importlib.metadata

    version = None
    if package is not None:
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            version = None
    return {
        "format": fmt,
        "source": source.name,
        "size": source.stat().st_size,
        "package": package,
        "version": version,
    }


def read_stamp(folder: Path) -> dict | None:
    """The stamp of a cached folder, or None if it has none (or an unreadable one)."""
    try:
        return json.loads((Path(folder) / STAMP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def cached_folder(kind: str, name: str, stamp: dict, build: Callable[[Path], None]) -> Path:
    """The cache folder ``<cache>/<kind>/<name>``, built with ``build`` unless its stamp matches.

    Args:
        kind: first level under the cache root ("tokenizers", "models").
        name: the folder name.
        stamp: JSON-able description of the source; a cached folder with another stamp is rebuilt.
        build: writes the folder's files into the (empty, temporary) folder it is given.

    Returns:
        The folder, complete and stamped.

    Raises:
        ValueError: the cache root cannot be written (says to set ``XTOKEN_CACHE``).
    """
    target = cache_root() / kind / name
    if read_stamp(target) == stamp:
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
        # mkdtemp makes the folder private (0700); a cache folder gets the usual permissions.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
    except OSError as exc:
        raise ValueError(
            f"cannot write the xtoken cache at {str(target.parent)!r} ({exc}); set XTOKEN_CACHE "
            "to a writable folder"
        ) from exc
    try:
        build(tmp)
        (tmp / STAMP_FILE).write_text(json.dumps(stamp, sort_keys=True), encoding="utf-8")
        if target.exists():
            # A stale folder (another stamp): move it aside first; a rename onto a non-empty
            # folder fails.
            if read_stamp(target) == stamp:  # another process finished meanwhile
                return target
            trash = Path(tempfile.mkdtemp(prefix=f".{name}.old.", dir=target.parent))
            try:
                os.rename(target, trash / name)
            except OSError:
                pass  # another process moved it already
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if read_stamp(target) != stamp:  # lost a race to a folder of another source
                raise
        logger.info("[cache] built %s", target)
        return target
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
