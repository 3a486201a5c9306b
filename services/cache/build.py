"""The cache builder: one teacher of a run config over its corpus, the top-K targets of every
text written into teacher-cache shards (``xtoken cache build``).

``CacheBuilder`` reads the corpus as the run's collators do (same files, same keys, the texts
cut at the teacher context by the teacher's tokenizer), runs the teacher's forward through the
teacher service's own worker (``services/teacher/worker.py``: the same model loading, compile
and output layer as the ``topk`` transport), encodes the top K
(``xtoken_core.wire.topk.encode_topk``) and writes the rows through
``xtoken_core.cache.writer``. Texts of similar length share a forward (a window of texts is
sorted by length and cut into batches of at most ``batch_tokens`` padded tokens).

Resuming: a shard is recorded in the manifest once it is whole on disk; a rerun skips the keys
of every recorded shard (and records a shard a killed build wrote but did not record), so every
sample is written exactly once. Several builders share a corpus by key (``--shard i/n``: the
keys whose :func:`~xtoken_core.cache.manifest.key_shard` is ``i``), each writing its own shards
into the same folder; the manifest is updated under a lock.

A teacher whose section says ``tensor_parallel: k`` builds as a group of k processes under
torchrun (:func:`build_cache`, ``services/cache/group.py``): rank 0 is this builder, its
forwards run on every rank.

Legend: B texts of a forward, U their longest teacher row, K ids kept, W teacher vocab.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from xtoken_core.cache.format import FORMAT_VERSION, Codec
from xtoken_core.cache.manifest import (
    FORMAT_NAME,
    MANIFEST_FILE,
    RUN_KEYS,
    SHARDS_DIR,
    fingerprint_changes,
    key_shard,
    locked,
    read_manifest,
    update_manifest,
    write_json_atomic,
)
from xtoken_core.errors import SettingsError

logger = logging.getLogger(__name__)

__all__ = ["BuildOptions", "BuildSummary", "CacheBuilder", "build_cache"]

# the fingerprint keys a build into an existing cache must match (RUN_KEYS, K and the corpus)
BUILD_KEYS = (*RUN_KEYS, "k", "corpus")


@dataclasses.dataclass
class BuildOptions:
    """How ``xtoken cache build`` runs.

    Attributes:
        out: the cache folder.
        shard: ``(i, n)``: this builder writes the keys of shard ``i`` of ``n``.
        teacher: which teacher of the run (0: the ``teacher`` section, j: ``extra_teachers[j-1]``).
        k: ids kept per position (None: the teacher's ``top_k``).
        codec: how the top-K payload is stored.
        device: the teacher's device (None: the teacher section's).
        batch_tokens: padded teacher tokens per forward (None: ``max_batch x ctx_teacher``).
        shard_mb: MiB of encoded rows per shard file (before compression).
        row_group_rows: samples per Parquet row group.
        window: texts sorted by length together before they are cut into forwards.
        progress: draw a progress bar (tqdm) on stderr.
    """

    out: str
    shard: tuple[int, int] = (0, 1)
    teacher: int = 0
    k: int | None = None
    codec: Codec = dataclasses.field(default_factory=Codec)
    device: str | None = None
    batch_tokens: int | None = None
    shard_mb: float = 256.0
    row_group_rows: int = 64
    window: int = 256
    progress: bool = True


WARM_BATCHES = 2  # batches whose forwards compile the teacher, kept out of the steady rate


@dataclasses.dataclass
class BuildSummary:
    """What a build did.

    Attributes:
        written: samples this builder wrote now.
        skipped: samples of its shard already in the cache.
        teacher_tokens: teacher positions written now.
        shards: shard files written now.
        seconds: seconds of the build loop (the model load excluded).
        forward_s: seconds of the teacher forward and the top-K encode.
        steady_tokens: teacher positions written after the first ``WARM_BATCHES`` batches
            (whose forwards compile the teacher for their lengths).
        steady_s: seconds of the build loop after those batches.
        complete: every builder of the cache finished.
    """

    written: int = 0
    skipped: int = 0
    teacher_tokens: int = 0
    shards: int = 0
    seconds: float = 0.0
    forward_s: float = 0.0
    steady_tokens: int = 0
    steady_s: float = 0.0
    complete: bool = False

    @property
    def tokens_per_s(self) -> float:
        """Teacher tokens written per second of the build loop."""
        return self.teacher_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def steady_tokens_per_s(self) -> float | None:
        """Teacher tokens per second after the warm-up batches (None: no batch after them)."""
        return self.steady_tokens / self.steady_s if self.steady_s > 0 else None


class CacheBuilder:
    """One builder of a teacher cache.

    Args:
        config: the run config (its ``data`` and the chosen teacher).
        options: :class:`BuildOptions`.
        worker: a teacher worker already built (tests); default: built from the config.

    Raises:
        SettingsError: a teacher index the run does not have, a folder that is not empty and
            holds no cache, or a cache of another fingerprint.
    """

    def __init__(self, config: Any, options: BuildOptions, worker: Any = None) -> None:
        self.config, self.options = config, options
        views = config.teacher_list()
        if not 0 <= options.teacher < len(views):
            raise SettingsError(
                f"--teacher {options.teacher}: the run has teachers 0..{len(views) - 1}"
            )
        self.view = views[options.teacher]
        section = self.view.section
        self.k = options.k if options.k is not None else section.top_k
        self.out = Path(options.out)
        check_folder(self.out)
        self._worker = worker
        self.files: list[Path] = []

    # ---------------------------------------------------------------- set-up

    @property
    def worker(self) -> Any:
        """The teacher worker (built on first use: loads the model)."""
        if self._worker is None:
            from services.teacher.worker import TeacherWorker

            self._worker = TeacherWorker(self.teacher_config())
        return self._worker

    def teacher_config(self) -> Any:
        """The teacher section as a worker of the ``topk`` transport runs it."""
        section = self.view.section
        return dataclasses.replace(
            section,
            tokenizer=self.view.tokenizer,
            transport="topk",
            top_k=self.k,
            device=self.options.device or section.device,
            pack=False,
            max_length=max(section.max_length, self.config.ctx_teacher),
        )

    def corpus(self) -> tuple[list[Path], Any]:
        """The corpus files and the data section (the demo corpus when ``data.train`` is unset)."""
        from xtoken_core.data.corpus import corpus_files

        data = self.config.data
        if data.train is None:
            from xtoken_core.data.corpus import build_demo_corpus

            data = dataclasses.replace(data, train=str(build_demo_corpus().train_path))
        return corpus_files(data.train), data

    def fingerprint(self) -> dict[str, Any]:
        """The fingerprint of this build (the teacher's and the corpus's)."""
        from services.cache.fingerprint import (
            corpus_fingerprint,
            preset_draw,
            teacher_fingerprint,
        )
        from xtoken_core.tokenizers import load_tokenizer

        section = self.view.section
        teacher = self.teacher_config()
        files, data = self.corpus()
        fp = teacher_fingerprint(
            section.model,
            load_tokenizer(self.view.tokenizer),
            self.view.tokenizer,
            width=self.worker.width,
            vocab_size=section.vocab_size,
            seed=section.seed,
            ctx_teacher=self.config.ctx_teacher,
            k=self.k,
            draw=preset_draw(teacher.tensor_parallel, teacher.device),
        )
        fp["corpus"] = corpus_fingerprint(files, data)
        return fp

    def open(self) -> set[str]:
        """Create the cache folder's manifest, or check the one there against this build, record
        shards a killed build left unrecorded, and return the keys the cache holds.

        Raises:
            SettingsError: a cache of another fingerprint (names each changed key).
        """
        from xtoken_core.cache.writer import entry_of_file

        fp = self.fingerprint()
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / SHARDS_DIR).mkdir(exist_ok=True)
        tag = f"{self.options.shard[0]}/{self.options.shard[1]}"
        with locked(self.out):
            manifest = read_manifest(self.out)
            if manifest is None:
                manifest = {
                    "format": FORMAT_NAME,
                    "format_version": FORMAT_VERSION,
                    "fingerprint": fp,
                    "codec": self.options.codec.as_dict(),
                    "k": self.k,
                    "width": self.worker.width,
                    "builders": {},
                    "shards": [],
                }
                write_json_atomic(self.out / MANIFEST_FILE, manifest)
            changes = fingerprint_changes(manifest["fingerprint"], fp, BUILD_KEYS)
            if manifest["codec"] != self.options.codec.as_dict():
                changes.append(f"codec: {manifest['codec']} -> {self.options.codec.as_dict()}")
            if changes:
                raise SettingsError(
                    f"{self.out} holds a teacher cache of another build ("
                    + "; ".join(c if len(c) < 200 else c[:200] + "..." for c in changes)
                    + "): build into another folder"
                )
            builders = {b.split("/")[1] for b in manifest["builders"]}
            n = str(self.options.shard[1])
            if builders and builders != {n}:
                raise SettingsError(
                    f"{self.out} is built by {'/'.join(sorted(builders))} builder(s), not {n}: "
                    f"pass --shard I/{next(iter(builders))}"
                )
        listed = {s["path"] for s in manifest["shards"]}
        found = []
        for p in sorted((self.out / SHARDS_DIR).glob("*.parquet")):
            if f"{SHARDS_DIR}/{p.name}" not in listed:
                try:
                    found.append(entry_of_file(self.out, p))
                except (OSError, ValueError) as e:
                    logger.warning("[cache] %s is no whole shard (%s): set aside", p, e)
                    p.rename(p.with_name(p.name + ".bad"))

        def record(m: dict[str, Any]) -> None:
            have = {s["path"] for s in m["shards"]}
            m["shards"].extend(e for e in found if e["path"] not in have)
            m["builders"].setdefault(tag, {"done": False})["done"] = False

        manifest = update_manifest(self.out, record)
        if found:
            logger.info("[cache] recorded %d shard(s) a stopped build wrote", len(found))
        return self._keys(manifest)

    def _keys(self, manifest: dict[str, Any]) -> set[str]:
        import pyarrow.parquet as pq

        keys: set[str] = set()
        for s in manifest["shards"]:
            keys.update(pq.read_table(self.out / s["path"], columns=["key"])["key"].to_pylist())
        return keys

    def texts(self, done: set[str]) -> Iterator[tuple[str, str]]:
        """The ``(key, text)`` pairs of this builder's shard that the cache lacks, in corpus
        order (the first ``data.limit`` texts of the corpus)."""
        from xtoken_core.data.corpus import iter_texts

        files, data = self.corpus()
        i, n = self.options.shard
        seen = 0
        for path in files:
            for key, text in iter_texts(
                path,
                text_field=data.text_field,
                txt_split=data.txt_split,
                key_root=self.config.collator.key_root,
                on_bad=(lambda e: None) if data.skip_bad_lines else None,
            ):
                if data.limit is not None and seen >= data.limit:
                    return
                seen += 1
                if key in done or key_shard(key, n) != i:
                    continue
                yield key, text

    # ---------------------------------------------------------------- the build

    def run(self) -> BuildSummary:
        """Build this builder's share of the cache.

        Returns:
            The :class:`BuildSummary`.

        Raises:
            DiskFullError: the disk took no more bytes (what was recorded stays; run again).
        """
        from xtoken_core.cache.writer import ShardWriter
        from xtoken_core.tokenizers import load_tokenizer

        opts = self.options
        done = self.open()
        worker = self.worker
        i, n = opts.shard
        tag = f"{i}/{n}"
        summary = BuildSummary()
        total = sum(1 for _ in self.texts(done))
        summary.skipped = sum(1 for k in done if key_shard(k, n) == i)
        logger.info(
            "[cache] builder %s: %d texts to write, %d already in %s (teacher %s, top-%d, %s)",
            tag,
            total,
            summary.skipped,
            self.out,
            self.view.section.model,
            self.k,
            worker.device,
        )
        writer = ShardWriter(
            self.out,
            opts.codec,
            worker.width,
            self.k,
            opts.shard,
            row_group_rows=opts.row_group_rows,
        )
        writer.remove_temporaries()
        tokenizer = load_tokenizer(self.view.tokenizer)
        ctx = self.config.ctx_teacher
        budget = opts.batch_tokens or max(1, self.view.section.max_batch) * ctx
        bar = _bar(total, opts.progress)
        started = time.monotonic()
        batches, steady_from = 0, None
        try:
            for window in _windows(self.texts(done), opts.window):
                encoded = tokenizer.encode_batch([t for _, t in window], True)
                rows = sorted(
                    ((key, x.truncated(ctx).ids) for (key, _), x in zip(window, encoded)),
                    key=lambda r: -len(r[1]),
                )
                for batch in _batches(rows, budget):
                    t0 = time.monotonic()
                    targets = self._forward(batch)
                    summary.forward_s += time.monotonic() - t0
                    batches += 1
                    for (key, ids), t in zip(batch, targets):
                        writer.add(key, ids, *t)
                        summary.written += 1
                        summary.teacher_tokens += len(ids)
                        if steady_from is not None:
                            summary.steady_tokens += len(ids)
                    if batches == WARM_BATCHES:
                        steady_from = time.monotonic()
                    if writer.nbytes >= opts.shard_mb * (1 << 20):
                        summary.shards += self._commit(writer, tag)
                    if bar is not None:
                        bar.update(len(batch))
                        elapsed = time.monotonic() - started
                        bar.set_postfix_str(f"{summary.teacher_tokens / elapsed:,.0f} tok/s")
            summary.shards += self._commit(writer, tag)
        finally:
            if bar is not None:
                bar.close()
        summary.seconds = time.monotonic() - started
        if steady_from is not None and summary.steady_tokens:
            summary.steady_s = time.monotonic() - steady_from

        def finish(m: dict[str, Any]) -> None:
            m["builders"][tag]["done"] = True

        summary.complete = bool(update_manifest(self.out, finish)["complete"])
        return summary

    def _forward(self, batch: list[tuple[str, list[int]]]) -> list[tuple]:
        """The top-K targets of a batch of teacher-id rows: per row ``(ids_UK, logprobs_UK,
        rest_U, lse_U)`` as numpy arrays of its own length."""
        import numpy as np
        import torch

        from services.protocol.teacher import Request

        worker = self.worker
        lengths = [len(ids) for _, ids in batch]
        U = max(lengths)
        k = self.k
        if U == 0:  # empty texts: no position, nothing to compute
            empty = (
                np.zeros((0, k), np.int32),
                np.zeros((0, k), np.float32),
                np.zeros(0, np.float32),
                np.zeros(0, np.float32),
            )
            return [empty for _ in batch]
        ids_BU = torch.full((len(batch), U), worker.pad_id, dtype=torch.int64)
        for b, (_, ids) in enumerate(batch):
            ids_BU[b, : len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
        request = Request("cache", 0, ids_BU, torch.tensor(lengths, dtype=torch.int64))
        with torch.inference_mode():
            targets = self.targets(request)
        ids, lps, rest, lse = (t.cpu().numpy() for t in targets)
        return [(ids[b, :L], lps[b, :L], rest[b, :L], lse[b, :L]) for b, L in enumerate(lengths)]

    def targets(self, request: Any) -> Any:
        """The top-K targets (``xtoken_core.wire.topk.TopK``, ``[B, U, K]``) of a request of
        teacher-id rows: its whole logits' top K."""
        from xtoken_core.wire.topk import encode_topk

        return encode_topk(self.worker.logits(request), self.k)

    def _commit(self, writer: Any, tag: str) -> int:
        """Write the gathered rows as a shard and record it; 1 if a shard was written."""
        entry = writer.flush()
        if entry is None:
            return 0

        def record(m: dict[str, Any]) -> None:
            if entry["path"] not in {s["path"] for s in m["shards"]}:
                m["shards"].append(entry)

        update_manifest(self.out, record)
        logger.debug("[cache] wrote %s (%d samples)", entry["path"], entry["samples"])
        return 1


def build_cache(config: Any, options: BuildOptions) -> BuildSummary | None:
    """Build a cache as ``xtoken cache build`` does: with one process, or, for a teacher whose
    section says ``tensor_parallel: k`` (or under torchrun), as this rank of a tensor-parallel
    group (``services/cache/group.py``).

    Args:
        config: the run config.
        options: :class:`BuildOptions`.

    Returns:
        The :class:`BuildSummary`; None on a rank of a group other than 0 (rank 0 reports).

    Raises:
        SettingsError: as :class:`CacheBuilder`.
        ValueError: a group's size other than torchrun's (one line: how to start it).
    """
    builder = CacheBuilder(config, options)
    if builder.view.section.tensor_parallel > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from services.cache.group import build_with_group

        return build_with_group(builder)
    return builder.run()


def check_folder(out: Path) -> None:
    """Refuse a folder that is not empty and holds no teacher cache (another tool's files).

    Raises:
        SettingsError: names the folder and the fix.
    """
    if not out.exists():
        return
    if not out.is_dir():
        raise SettingsError(f"--out {out} is a file: give a folder for the cache")
    if any(out.iterdir()) and not (out / MANIFEST_FILE).is_file():
        raise SettingsError(
            f"--out {out} is not empty and holds no teacher cache (no {MANIFEST_FILE}): build "
            "into an empty or new folder"
        )


def _windows(items: Iterator[Any], size: int) -> Iterator[list[Any]]:
    window: list[Any] = []
    for item in items:
        window.append(item)
        if len(window) >= size:
            yield window
            window = []
    if window:
        yield window


def _batches(rows: list[tuple[str, list[int]]], budget: int) -> Iterator[list[tuple]]:
    """Rows sorted longest first, cut so that each batch's rows x its longest row stays within
    ``budget`` padded tokens (a row longer than the budget goes alone)."""
    batch: list[tuple] = []
    for row in rows:
        longest = len(batch[0][1]) if batch else len(row[1])
        if batch and (len(batch) + 1) * max(longest, 1) > budget:
            yield batch
            batch = []
        batch.append(row)
    if batch:
        yield batch


def _bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    import sys

    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="text",
        desc="[cache] build",
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.5 if sys.stderr.isatty() else 30.0,
    )


def summary_line(summary: BuildSummary, out: str | os.PathLike) -> str:
    """One line of what a build did."""
    return (
        f"[cache] wrote {summary.written} samples ({summary.teacher_tokens} teacher tokens) in "
        f"{summary.shards} shard(s) in {summary.seconds:.1f}s ({summary.tokens_per_s:,.0f} "
        f"teacher tok/s), {summary.skipped} already there; cache {out} "
        + ("complete" if summary.complete else "incomplete (other builders still to finish)")
    )
