"""A run's teacher caches (``data.teacher_cache``) checked before any process starts: each cache
was built for its teacher (the fingerprint keys the teacher decides) and holds every sample of
the run's corpus, or, with ``data.teacher_cache_missing: online``, the samples it lacks are
counted (its live teacher serves them).
"""

from __future__ import annotations

import logging
from typing import Any

from xtoken_core.cache.manifest import RUN_KEYS, fingerprint_changes, read_manifest
from xtoken_core.errors import SettingsError

logger = logging.getLogger(__name__)

__all__ = ["CACHE_RUN_KEYS", "check_teacher_caches", "corpus_keys", "run_fingerprint"]

# The keys a run's teacher must match: the teacher's (``RUN_KEYS``) and K. The logits' width is
# left out: the weights hash decides it, and reading it would load the teacher.
CACHE_RUN_KEYS = tuple(k for k in RUN_KEYS if k != "teacher.width") + ("k",)


def run_fingerprint(config: Any, view: Any) -> dict[str, Any]:
    """The fingerprint keys of one teacher of a run (all but the logits' width and the corpus).

    Args:
        config: the run config.
        view: the teacher (a :class:`services.supervise.teachers.RunTeacher`).
    """
    from services.cache.fingerprint import preset_draw, teacher_fingerprint
    from xtoken_core.tokenizers import load_tokenizer

    section = view.section
    return teacher_fingerprint(
        section.model,
        load_tokenizer(view.tokenizer),
        view.tokenizer,
        width=0,
        vocab_size=section.vocab_size,
        seed=section.seed,
        ctx_teacher=config.ctx_teacher,
        k=section.top_k,
        draw=preset_draw(section.tensor_parallel, section.device),
    )


def corpus_keys(config: Any, train: str, limit: int | None) -> list[str]:
    """The sample keys of the texts a run's collator reads: the files of ``train``, keyed as the
    collator and the cache builder key them (``data.text_field``, ``data.txt_split``,
    ``collator.key_root``), the first ``limit``.

    Raises:
        DataError: a bad corpus line (unless ``data.skip_bad_lines``).
    """
    from xtoken_core.data.corpus import corpus_files, iter_texts

    data = config.data
    keys: list[str] = []
    for path in corpus_files(train):
        for key, _ in iter_texts(
            path,
            text_field=data.text_field,
            txt_split=data.txt_split,
            key_root=config.collator.key_root,
            on_bad=(lambda e: None) if data.skip_bad_lines else None,
        ):
            if limit is not None and len(keys) >= limit:
                return keys
            keys.append(key)
    return keys


def check_teacher_caches(config: Any, train: str | None, limit: int | None) -> None:
    """Refuse a teacher cache that does not serve its teacher of the run, or lacks a sample of
    the corpus (with ``data.teacher_cache_missing: online``, log how many its live teacher
    serves instead).

    Args:
        config: the run config.
        train: the corpus the collator reads (the preflight's: the demo's when unset).
        limit: texts of it the collator reads (None: all).

    Raises:
        SettingsError: one line: a folder holding no cache; the first fingerprint key whose
            value differs (``key: cached -> run``); how many samples the cache lacks, a few of
            their keys and their builder shards (``xtoken_core.cache.reader.missing_line``),
            unless its teacher is online.
    """
    views = [v for v in config.teacher_list() if v.cache is not None]
    if not views or train is None:
        return
    from xtoken_core.cache.reader import CacheReader, missing_line

    keys: list[str] | None = None
    for view in views:
        directory = view.cache
        where = f"data.teacher_cache {directory} ({view.key})"
        try:
            manifest = read_manifest(directory)
        except ValueError as e:
            raise SettingsError(f"{where}: {e}") from None
        if manifest is None:
            raise SettingsError(
                f"{where} holds no teacher cache (no manifest.json): build one with `xtoken "
                "cache build CONFIG --out DIR`"
            )
        changes = fingerprint_changes(
            manifest.get("fingerprint", {}), run_fingerprint(config, view), CACHE_RUN_KEYS
        )
        if changes:
            raise SettingsError(
                f"{where} was built for another teacher: {changes[0]}"
                + (f" (and {len(changes) - 1} more key(s))" if len(changes) > 1 else "")
                + f"; build a cache of this teacher (`xtoken cache build`) or fix {view.key}"
            )
        warn_column_pick(config, view.key, int(manifest["k"]), manifest.get("width"))
        if keys is None:
            keys = corpus_keys(config, train, limit)
        missing = CacheReader(directory).missing(keys)
        if view.online:
            logger.info(
                "[run] %s is served by the teacher cache %s (top-%d) for %d of the %d samples of "
                "the corpus, by its live groups for the %d it lacks "
                "(data.teacher_cache_missing: online)",
                view.key,
                directory,
                int(manifest["k"]),
                len(keys) - len(missing),
                len(keys),
                len(missing),
            )
            continue
        if missing:
            builders = {int(b.split("/")[1]) for b in manifest.get("builders", {})} or {1}
            raise SettingsError(missing_line(directory, missing, max(builders)))
        logger.info(
            "[run] %s is served by the teacher cache %s (%d samples of the corpus, top-%d): no "
            "teacher process for it",
            view.key,
            directory,
            len(keys),
            int(manifest["k"]),
        )


def warn_column_pick(config: Any, key: str, k: int, width: int | None) -> None:
    """Warn in one line when P-KL keeps a column subset (``trainer.loss.vocab_topk``) of a
    cache's top-K targets: it picks the columns by their largest logit, which the targets hold
    only at their ids, so the gradient moves by ~40% against the full logits (1.8% over every
    column: ``benchmarks/results/teachers_topk.md``), as for the ``topk`` transport.

    Args:
        config: the run config.
        key: the teacher's section (``teacher``, ``extra_teachers[0]``).
        k: the cache's K.
        width: its teacher vocab W (None: unknown, no warning).
    """
    loss = config.trainer.loss
    if width is None or loss.mode != "pkl" or loss.vocab_topk is None:
        return
    if loss.vocab_topk < int(width) and k < int(width):
        logger.warning(
            "[run] %s reads a teacher cache (top_k=%d) with P-KL over trainer.loss.vocab_topk=%d "
            "columns: the column pick sees only the cached ids, which moves the loss's gradient "
            "(38%% at K = 64 against 1.8%% over every column); set trainer.loss.vocab_topk: null",
            key,
            k,
            loss.vocab_topk,
        )
