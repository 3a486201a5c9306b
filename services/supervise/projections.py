"""Each teacher's projection for a run (student tokenizer -> that teacher's tokenizer): a given
file checked against the pair, or one built once into xtoken's cache and reused; and the cache's
place and file names."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.supervise.config import RunConfig
from services.supervise.teachers import RunTeacher

logger = logging.getLogger(__name__)


def settle_projections(config: RunConfig, s_tok: Any, t_toks: Sequence[Any]) -> list[str | None]:
    """The projection file of each teacher of the run, in the loss's order: the one its config
    names, checked (:func:`check_projection`), or the cached one, built when missing
    (:func:`build_cached_projection`); None for every teacher when the loss uses none.

    Args:
        config: the run config.
        s_tok: the student tokenizer.
        t_toks: each teacher's tokenizer, in the order of ``config.teacher_list()``.

    Raises:
        ValueError: a given file that does not fit its teacher (names its key).
    """
    projections: list[str | None] = []
    for view, t_tok in zip(config.teacher_list(), t_toks, strict=True):
        projection = view.projection
        if config.trainer.loss.uses_teacher and not projection:
            projection = str(build_cached_projection(config, s_tok, t_tok, view.tokenizer))
        elif config.trainer.loss.uses_teacher:
            check_projection(config, projection, s_tok, t_tok, view)
        projections.append(projection)
    return projections


def check_projection(
    config: RunConfig, path: str, s_tok: Any, t_tok: Any, view: RunTeacher | None = None
) -> None:
    """A given projection file must fit the run's tokenizers (rows: the student's, columns: its
    teacher's), be built for them (the tokenizers it records; a file without that record is
    accepted with a warning) and have usable rows; its coverage is logged.

    Args:
        config: the run config.
        path: the file.
        s_tok: the student tokenizer.
        t_tok: its teacher's tokenizer.
        view: the teacher it is for (default: teacher 0, ``trainer.loss.projection``).

    Raises:
        ValueError: a missing or unreadable file, one built for other vocabularies or
            tokenizers, or one without a usable row (names the key).
    """
    from xtoken_core.data.projection import check_projection_tokenizers, parse_projection_file

    view = view or config.teacher_list()[0]
    key = view.projection_key
    student_vocab, teacher_vocab = s_tok.vocab_size, t_tok.vocab_size
    try:
        _, _, rows, cols = parse_projection_file(path)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"{key}: {e}") from None
    if rows > student_vocab or cols > teacher_vocab:
        raise ValueError(
            f"{key}={path!r} is {rows} x {cols} (student x teacher ids) but the run's "
            f"tokenizers have {student_vocab} and {teacher_vocab} ids: build one for "
            f"{config.student_tokenizer} -> {view.tokenizer} with `xtoken projection build`, or "
            "leave it empty and xtoken run builds it"
        )
    try:
        check_projection_tokenizers(path, s_tok, t_tok)
    except ValueError as e:
        raise ValueError(f"{key}: {e}") from None


def projection_cache_path(config: RunConfig, teacher_tokenizer: str | None = None) -> Path:
    """Where the projection of the run's student tokenizer to ``teacher_tokenizer`` (default:
    ``teacher_tokenizer``, teacher 0's) with ``projection_top_k`` slots is cached
    (``$XTOKEN_CACHE``, default ``~/.cache/xtoken``): one file per pair of tokenizers."""
    cache = cache_dir()
    k = config.projection_top_k
    teacher = teacher_tokenizer or config.teacher_tokenizer
    name = f"{slug(config.student_tokenizer)}_{slug(teacher)}_k{k}.pt"
    return cache / "projections" / name


def build_cached_projection(
    config: RunConfig, s_tok: Any, t_tok: Any, teacher_tokenizer: str | None = None
) -> Path:
    """The projection of the run's student tokenizer to ``teacher_tokenizer`` (default: teacher
    0's; ``t_tok`` is its tokenizer) from the cache, built there first when missing or built for
    other tokenizers (written to a temporary name and renamed: a concurrent run never reads half
    a file)."""
    from xtoken_core.data.projection_build import (
        build_projection,
        projection_metadata,
        save_projection,
    )

    path = projection_cache_path(config, teacher_tokenizer)
    if path.is_file() and _built_for(path, s_tok, t_tok):
        return path
    logger.info("[run] building projection %s", path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    k = config.projection_top_k
    save_projection(build_projection(s_tok, t_tok, k), tmp, projection_metadata(s_tok, t_tok))
    os.replace(tmp, path)
    return path


def _built_for(path: Path, s_tok: Any, t_tok: Any) -> bool:
    """A cached projection was built for these tokenizers (a file without the record is taken:
    the cache names it by the tokenizers; another tokenizer of the same name, a path's last part,
    is told apart by its record)."""
    from xtoken_core.data.projection import read_projection_metadata
    from xtoken_core.data.projection_build import vocab_hash

    meta = read_projection_metadata(path) or {}
    for side, tok in (("student", s_tok), ("teacher", t_tok)):
        recorded = meta.get(f"{side}_vocab_hash")
        if recorded is not None and recorded != vocab_hash(tok):
            return False
    return True


def cache_dir() -> Path:
    """xtoken's cache: ``$XTOKEN_CACHE``, default ``~/.cache/xtoken`` (projections, held-out
    files)."""
    return Path(os.environ.get("XTOKEN_CACHE", Path.home() / ".cache" / "xtoken"))


def slug(name: str) -> str:
    """A file-name-safe form of the last part of ``name``."""
    return "".join(c if c.isalnum() else "_" for c in Path(name).name or name)
