"""Text corpora: the bundled demo corpus (built from Python's own stdlib) and the text readers.

Readers. :func:`iter_texts` yields ``(key, text)`` pairs from one file, chosen by suffix:

* ``.jsonl``: one JSON object per line with a string field ``"text"``; blank lines are skipped.
* ``.txt``: documents separated by blank lines (``txt_split="blank_line"``, the default) or one
  document per line (``txt_split="line"``).
* ``.parquet``: a string column ``"text"`` (read with pyarrow, one record batch at a time).
* ``.arrow``: an Arrow IPC stream or file with a string column ``"text"``: the data files of a
  Hugging Face ``datasets`` folder (``Dataset.save_to_disk``).

:func:`iter_corpus` reads a file, a folder or a glob of them (:func:`corpus_files`: sorted), each
file with its own keys; a folder written by ``Dataset.save_to_disk`` is read as that dataset (its
``state.json`` lists its data files, in order), without the ``datasets`` package. A bad line
raises :class:`BadCorpusLine` unless ``on_bad`` takes it. :func:`shuffled_texts` fixes another
order of the pairs by a seed (experiments compare runs on the same order).

Keys name the corpus file and the 1-based line on which the text starts (for parquet: the
1-based row), ``"<file id>:<line>"``, so that texts of different files never share a key, and a
restart of a run on the same file makes the same keys (the collator's skip of queued keys relies
on it). The file id (:func:`corpus_key_prefix`) is:

* with a key root: the file's path relative to it, ``"a/data.jsonl:3"``: readable, and the same
  on every machine that mounts the corpus under another root;
* without: ``"<12 hex>/<file name>"``, the hex being the start of the SHA-256 of the file's
  resolved absolute path, ``"3f2a9c1b7d4e/data.jsonl:3"``: the same for every spelling of the
  path (relative, ``..``, symlink), different for ``a/data.jsonl`` and ``b/data.jsonl``; moving
  or renaming the file changes it (pass a key root for keys that survive a move). Bad input raises ``ValueError``
naming the file and the line: invalid UTF-8 (with the absolute byte offset), invalid JSON, a
missing or non-string ``"text"``.

Demo corpus. :func:`build_demo_corpus` walks the stdlib directory of the running interpreter
(``sysconfig.get_paths()["stdlib"]``; no download), splits every ``.py`` file into paragraphs on
blank lines, packs consecutive paragraphs into texts of ``min_chars``..``max_chars`` characters,
drops exact duplicates, and writes ``train.jsonl`` and ``heldout.jsonl`` (records
``{"text", "source", "line"}``) plus ``manifest.json``. The split is hash-based (a text's SHA-1
decides), so it does not depend on the order or number of files. A build whose manifest matches
the parameters is reused (the cache); a build writes temporary files and renames them, so
concurrent builders never expose a half-written corpus.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import pathlib
import random
import sys
import sysconfig
from collections.abc import Callable, Iterable, Iterator

from xtoken_core.errors import DataError

logger = logging.getLogger(__name__)

# Bump when the chunking or record format changes: old caches are then rebuilt.
CORPUS_FORMAT_VERSION = 1
TRAIN_FILE = "train.jsonl"
HELDOUT_FILE = "heldout.jsonl"
MANIFEST_FILE = "manifest.json"

# Stdlib sub-trees that are not prose-like library code (tests are huge and repetitive).
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}
)
_SUFFIXES = (".jsonl", ".txt", ".parquet")
# a Hugging Face ``datasets`` folder: ``state.json`` lists the Arrow data files of one Dataset;
# a DatasetDict's root holds ``dataset_dict.json`` and a folder per split
_HF_STATE = "state.json"
_HF_DICT = "dataset_dict.json"


def default_demo_dir() -> pathlib.Path:
    """Return the default location of the built demo corpus.

    Returns:
        ``demo`` under the xtoken cache (``$XTOKEN_CACHE``, default ``~/.cache/xtoken``), beside
        the models, tokenizers and projections derived once.
    """
    from xtoken_core.tokenizers.cache import cache_root

    return cache_root() / "demo"


@dataclasses.dataclass(frozen=True)
class DemoCorpus:
    """A built demo corpus on disk.

    Attributes:
        directory: folder holding the files.
        train_path: JSONL file of training texts.
        heldout_path: JSONL file of held-out texts (for bits per byte).
        num_train: number of records in ``train_path``.
        num_heldout: number of records in ``heldout_path``.
        reused: True when an existing build was reused instead of rebuilt.
    """

    directory: pathlib.Path
    train_path: pathlib.Path
    heldout_path: pathlib.Path
    num_train: int
    num_heldout: int
    reused: bool


def _stdlib_sources(stdlib_dir: pathlib.Path) -> list[pathlib.Path]:
    """All ``.py`` files under ``stdlib_dir``, skipping tests and site-packages, sorted by path."""
    found: list[pathlib.Path] = []
    for root, dirs, files in os.walk(stdlib_dir):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(files):
            if name.endswith(".py"):
                found.append(pathlib.Path(root) / name)
    return sorted(found, key=lambda p: p.relative_to(stdlib_dir).as_posix())


def _paragraphs(text: str) -> Iterator[tuple[int, str]]:
    """Split ``text`` on blank lines; yield (1-based start line, paragraph without trailing \\n)."""
    start = 0
    current: list[str] = []
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            if not current:
                start = number
            current.append(line)
        elif current:
            yield start, "\n".join(current)
            current = []
    if current:
        yield start, "\n".join(current)


def chunk_text(text: str, *, min_chars: int = 1024, max_chars: int = 4096) -> list[tuple[int, str]]:
    """Pack the paragraphs of ``text`` into chunks of about ``min_chars``..``max_chars`` characters.

    Consecutive paragraphs are joined with a blank line until the chunk reaches ``min_chars``; a
    paragraph that would push a non-empty chunk past ``max_chars`` starts a new chunk; a single
    paragraph longer than ``max_chars`` is cut on line boundaries (a single line longer than
    ``max_chars`` is kept whole). The last chunk of a file may be shorter than ``min_chars``.

    Args:
        text: the document.
        min_chars: a chunk is closed once it has at least this many characters.
        max_chars: soft upper bound on the characters of a chunk.

    Returns:
        ``[(start_line, chunk_text), ...]`` in document order, ``start_line`` 1-based.

    Raises:
        ValueError: if ``min_chars < 1`` or ``max_chars < min_chars``.
    """
    if min_chars < 1 or max_chars < min_chars:
        raise ValueError(
            f"chunk sizes must satisfy 1 <= min_chars <= max_chars, got min_chars={min_chars}, "
            f"max_chars={max_chars}; pass e.g. min_chars=1024, max_chars=4096"
        )
    pieces: list[tuple[int, str]] = []
    for start, para in _paragraphs(text):
        if len(para) <= max_chars:
            pieces.append((start, para))
            continue
        # An oversized paragraph (long literal, table): cut on line boundaries.
        lines = para.split("\n")
        block: list[str] = []
        block_start, size = start, 0
        for offset, line in enumerate(lines):
            if block and size + len(line) + 1 > max_chars:
                pieces.append((block_start, "\n".join(block)))
                block, block_start, size = [], start + offset, 0
            block.append(line)
            size += len(line) + 1
        if block:
            pieces.append((block_start, "\n".join(block)))

    chunks: list[tuple[int, str]] = []
    current: list[str] = []
    current_start, size = 0, 0
    for start, piece in pieces:
        if current and size + 2 + len(piece) > max_chars:
            chunks.append((current_start, "\n\n".join(current)))
            current, size = [], 0
        if not current:
            current_start = start
            size = len(piece)
        else:
            size += 2 + len(piece)
        current.append(piece)
        if size >= min_chars:
            chunks.append((current_start, "\n\n".join(current)))
            current, size = [], 0
    if current:
        chunks.append((current_start, "\n\n".join(current)))
    return chunks


def _is_heldout(text: str, heldout_fraction: float) -> bool:
    """Hash-based split: stable across runs, file orders and machines."""
    digest = hashlib.sha1(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < heldout_fraction


def _read_manifest(directory: pathlib.Path) -> dict | None:
    try:
        return json.loads((directory / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def build_demo_corpus(
    directory: str | os.PathLike | None = None,
    *,
    heldout_fraction: float = 0.02,
    min_chars: int = 1024,
    max_chars: int = 4096,
    max_files: int | None = None,
    stdlib_dir: str | os.PathLike | None = None,
    force: bool = False,
) -> DemoCorpus:
    """Build (or reuse) the demo corpus from the text that ships with Python itself.

    Args:
        directory: output folder; default :func:`default_demo_dir`.
        heldout_fraction: share of texts put in ``heldout.jsonl``, in [0, 1).
        min_chars: see :func:`chunk_text`.
        max_chars: see :func:`chunk_text`.
        max_files: use only the first N source files (sorted by path); None = all.
        stdlib_dir: folder to walk; default the running interpreter's stdlib.
        force: rebuild even when a matching build exists.

    Returns:
        The :class:`DemoCorpus` (paths and counts).

    Raises:
        ValueError: on a bad ``heldout_fraction``, chunk sizes or ``max_files``, or if the
            source folder holds no ``.py`` files.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction!r}")
    if max_files is not None and max_files < 1:
        raise ValueError(f"max_files must be >= 1 or None, got {max_files!r}")
    if min_chars < 1 or max_chars < min_chars:
        raise ValueError(
            f"chunk sizes must satisfy 1 <= min_chars <= max_chars, got min_chars={min_chars}, "
            f"max_chars={max_chars}"
        )
    out_dir = pathlib.Path(directory) if directory is not None else default_demo_dir()
    src_dir = pathlib.Path(stdlib_dir or sysconfig.get_paths()["stdlib"]).resolve()
    params = {
        "format_version": CORPUS_FORMAT_VERSION,
        "python": sys.version.split()[0],
        "stdlib_dir": str(src_dir),
        "heldout_fraction": heldout_fraction,
        "min_chars": min_chars,
        "max_chars": max_chars,
        "max_files": max_files,
    }
    manifest = _read_manifest(out_dir)
    if (
        not force
        and manifest is not None
        and manifest.get("params") == params
        and (out_dir / TRAIN_FILE).is_file()
        and (out_dir / HELDOUT_FILE).is_file()
    ):
        logger.info("[corpus] reusing demo corpus in %s", out_dir)
        return DemoCorpus(
            out_dir,
            out_dir / TRAIN_FILE,
            out_dir / HELDOUT_FILE,
            int(manifest["num_train"]),
            int(manifest["num_heldout"]),
            reused=True,
        )

    sources = _stdlib_sources(src_dir)
    if max_files is not None:
        sources = sources[:max_files]
    if not sources:
        raise ValueError(
            f"no .py files found under {src_dir}; pass stdlib_dir= a Python source tree"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = f".tmp{os.getpid()}"
    tmp_train = out_dir / (TRAIN_FILE + suffix)
    tmp_heldout = out_dir / (HELDOUT_FILE + suffix)
    seen: set[bytes] = set()
    counts = {"train": 0, "heldout": 0, "duplicates": 0, "undecodable_files": 0}
    try:
        with (
            open(tmp_train, "w", encoding="utf-8", newline="\n") as f_train,
            open(tmp_heldout, "w", encoding="utf-8", newline="\n") as f_heldout,
        ):
            for path in sources:
                try:
                    text = path.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    counts["undecodable_files"] += 1
                    continue
                rel = path.relative_to(src_dir).as_posix()
                for line, chunk in chunk_text(text, min_chars=min_chars, max_chars=max_chars):
                    digest = hashlib.sha1(chunk.encode("utf-8")).digest()
                    if digest in seen:
                        counts["duplicates"] += 1
                        continue
                    seen.add(digest)
                    record = json.dumps(
                        {"text": chunk, "source": rel, "line": line}, ensure_ascii=False
                    )
                    if _is_heldout(chunk, heldout_fraction):
                        f_heldout.write(record + "\n")
                        counts["heldout"] += 1
                    else:
                        f_train.write(record + "\n")
                        counts["train"] += 1
        os.replace(tmp_train, out_dir / TRAIN_FILE)
        os.replace(tmp_heldout, out_dir / HELDOUT_FILE)
    finally:
        for tmp in (tmp_train, tmp_heldout):
            if tmp.exists():
                tmp.unlink()
    manifest = {
        "params": params,
        "num_train": counts["train"],
        "num_heldout": counts["heldout"],
        "duplicates_dropped": counts["duplicates"],
        "files": len(sources),
        "undecodable_files": counts["undecodable_files"],
    }
    tmp_manifest = out_dir / (MANIFEST_FILE + suffix)
    tmp_manifest.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp_manifest, out_dir / MANIFEST_FILE)
    logger.info(
        "[corpus] built demo corpus in %s: %d train, %d held-out texts from %d files",
        out_dir,
        counts["train"],
        counts["heldout"],
        len(sources),
    )
    return DemoCorpus(
        out_dir,
        out_dir / TRAIN_FILE,
        out_dir / HELDOUT_FILE,
        counts["train"],
        counts["heldout"],
        reused=False,
    )


def corpus_key_prefix(path: str | os.PathLike, key_root: str | os.PathLike | None = None) -> str:
    """The file part of the keys :func:`iter_texts` makes for ``path`` (keys are ``"<it>:<line>"``).

    Args:
        path: the corpus file.
        key_root: a folder holding the file: the prefix is the file's POSIX path relative to
            it; None: ``"<12 hex of sha256(resolved absolute path)>/<file name>"``.

    Returns:
        The prefix, e.g. ``"a/data.jsonl"`` or ``"3f2a9c1b7d4e/data.jsonl"``.

    Raises:
        ValueError: ``path`` is not under ``key_root`` (names both).
    """
    resolved = pathlib.Path(path).resolve()
    if key_root is not None:
        root = pathlib.Path(key_root).resolve()
        if not resolved.is_relative_to(root) or resolved == root:
            raise ValueError(
                f"corpus file {resolved} is not under the key root {root}; pass a key root "
                "that holds the file"
            )
        return resolved.relative_to(root).as_posix()
    digest = hashlib.sha256(str(resolved).encode("utf-8", "surrogateescape")).hexdigest()
    return f"{digest[:12]}/{resolved.name}"


def _decode_line(raw: bytes, path: pathlib.Path, line_number: int, line_offset: int) -> str:
    """Decode one line as strict UTF-8, or raise a ValueError that says where it is broken."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path}: line {line_number}: invalid UTF-8 at byte offset {line_offset + exc.start} "
            f"of the file (byte {exc.start} of the line: {raw[exc.start : exc.start + 4]!r}); "
            f"re-encode the file as UTF-8"
        ) from None


class BadCorpusLine(ValueError):
    """One line (or parquet row) of a corpus file that holds no usable text.

    Attributes:
        path: the file.
        line: its 1-based line (parquet: row).
    """

    def __init__(self, message: str, path: pathlib.Path, line: int) -> None:
        super().__init__(message)
        self.path = path
        self.line = line


OnBad = Callable[[BadCorpusLine], None] | None
"""What a reader does with a bad line: None raises it, a callable is told and the line skipped."""


def _bad(on_bad: OnBad, message: str, path: pathlib.Path, line: int) -> None:
    err = BadCorpusLine(message, path, line)
    if on_bad is None:
        raise err
    on_bad(err)


def _iter_lines(path: pathlib.Path, on_bad: OnBad = None) -> Iterator[tuple[int, str]]:
    """Yield (1-based line number, decoded line without its newline) from a UTF-8 file."""
    offset = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                text = _decode_line(raw, path, number, offset)
            except ValueError as e:
                _bad(on_bad, str(e), path, number)
                offset += len(raw)
                continue
            offset += len(raw)
            if number == 1 and text.startswith("\ufeff"):
                text = text[1:]
            yield number, text.rstrip("\r\n")


def _iter_jsonl(
    path: pathlib.Path, field: str, prefix: str, on_bad: OnBad = None
) -> Iterator[tuple[str, str]]:
    for number, line in _iter_lines(path, on_bad):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            _bad(
                on_bad,
                f"{path}: line {number}: invalid JSON ({exc.msg} at column {exc.colno}); "
                f"each line must be one JSON object with a string field {field!r}",
                path,
                number,
            )
            continue
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            got = type(record.get(field)).__name__ if isinstance(record, dict) else "non-object"
            _bad(
                on_bad,
                f"{path}: line {number}: expected a JSON object with a string field {field!r}, "
                f"got {got}; fix the record or pass text_field=",
                path,
                number,
            )
            continue
        text = record[field]
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            # JSON escapes can spell lone surrogates ("\\ud800") that no tokenizer can encode.
            _bad(
                on_bad,
                f"{path}: line {number}: {field!r} holds a lone surrogate "
                f"U+{ord(text[exc.start]):04X} at character {exc.start}; fix the escape",
                path,
                number,
            )
            continue
        yield f"{prefix}:{number}", text


def _iter_txt(
    path: pathlib.Path, split: str, prefix: str, on_bad: OnBad = None
) -> Iterator[tuple[str, str]]:
    if split == "line":
        for number, line in _iter_lines(path, on_bad):
            if line.strip():
                yield f"{prefix}:{number}", line
        return
    start, block = 0, []
    for number, line in _iter_lines(path, on_bad):
        if line.strip():
            if not block:
                start = number
            block.append(line)
        elif block:
            yield f"{prefix}:{start}", "\n".join(block)
            block = []
    if block:
        yield f"{prefix}:{start}", "\n".join(block)


def _iter_parquet(
    path: pathlib.Path, field: str, prefix: str, on_bad: OnBad = None
) -> Iterator[tuple[str, str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    if field not in parquet.schema_arrow.names:
        raise ValueError(
            f"{path}: no column {field!r} (columns: {parquet.schema_arrow.names}); "
            f"pass text_field= naming the text column"
        )
    column_type = parquet.schema_arrow.field(field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise DataError(f"{path}: column {field!r} has type {column_type}, expected string")
    row = 0
    for batch in parquet.iter_batches(columns=[field], batch_size=1024):
        for value in batch.column(0).to_pylist():
            row += 1
            if value is None:
                msg = f"{path}: row {row}: column {field!r} is null; drop or fill it"
                _bad(on_bad, msg, path, row)
                continue
            yield f"{prefix}:{row}", value


def _iter_arrow(
    path: pathlib.Path, field: str, prefix: str, on_bad: OnBad = None
) -> Iterator[tuple[str, str]]:
    import pyarrow as pa

    source = pa.memory_map(str(path))
    try:  # datasets writes the IPC stream format; the file format is read too
        reader = pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(source)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    else:
        batches = iter(reader)
    schema = reader.schema
    if field not in schema.names:
        raise ValueError(
            f"{path}: no column {field!r} (columns: {schema.names}); "
            f"pass text_field= naming the text column"
        )
    column_type = schema.field(field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise DataError(f"{path}: column {field!r} has type {column_type}, expected string")
    row = 0
    for batch in batches:
        for value in batch.column(field).to_pylist():
            row += 1
            if value is None:
                msg = f"{path}: row {row}: column {field!r} is null; drop or fill it"
                _bad(on_bad, msg, path, row)
                continue
            yield f"{prefix}:{row}", value


def iter_texts(
    path: str | os.PathLike,
    *,
    text_field: str = "text",
    txt_split: str = "blank_line",
    key_root: str | os.PathLike | None = None,
    on_bad: OnBad = None,
) -> Iterator[tuple[str, str]]:
    """Yield ``(key, text)`` from a ``.jsonl``, ``.txt``, ``.parquet`` or ``.arrow`` file, in
    file order.

    Args:
        path: the file; its suffix picks the reader.
        text_field: JSON field / parquet or arrow column holding the text.
        txt_split: for ``.txt``: ``"blank_line"`` (documents separated by blank lines) or
            ``"line"`` (one document per non-empty line).
        key_root: key by the file's path relative to this folder (see
            :func:`corpus_key_prefix`); None: by a hash of its absolute path and its name.
        on_bad: None: a bad line raises :class:`BadCorpusLine`; else it is called with the
            error and the line is skipped (keys of the other lines do not change).

    Returns:
        An iterator of ``(key, text)``; key = ``"<corpus_key_prefix>:<1-based start line or
        row>"``, e.g. ``"3f2a9c1b7d4e/data.jsonl:3"`` or, with a key root, ``"a/data.jsonl:3"``.

    Raises:
        ValueError: unknown suffix or ``txt_split``; invalid UTF-8 (names file, line and byte
            offset); invalid JSON or a record without a string text field (names the line);
            a missing, non-string or null parquet column; a file outside ``key_root``.
        FileNotFoundError: if ``path`` does not exist.
    """
    p = pathlib.Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no such corpus file: {p}")
    prefix = corpus_key_prefix(p, key_root)
    if p.suffix == ".jsonl":
        return _iter_jsonl(p, text_field, prefix, on_bad)
    if p.suffix == ".txt":
        if txt_split not in ("blank_line", "line"):
            raise ValueError(f"txt_split must be 'blank_line' or 'line', got {txt_split!r}")
        return _iter_txt(p, txt_split, prefix, on_bad)
    if p.suffix == ".parquet":
        return _iter_parquet(p, text_field, prefix, on_bad)
    if p.suffix == ".arrow":
        return _iter_arrow(p, text_field, prefix, on_bad)
    raise ValueError(
        f"{p}: unsupported corpus suffix {p.suffix!r}; use one of {(*_SUFFIXES, '.arrow')}"
    )


def _hf_dataset_files(folder: pathlib.Path) -> list[pathlib.Path] | None:
    """The data files of a ``Dataset.save_to_disk`` folder, in the dataset's order; None when
    ``folder`` is not one.

    Raises:
        ValueError: a DatasetDict's root (names its splits), or a ``state.json`` naming no file.
    """
    if (folder / _HF_DICT).is_file():
        splits = json.loads((folder / _HF_DICT).read_text()).get("splits", [])
        raise ValueError(
            f"{folder}: a Hugging Face DatasetDict (splits {splits}); name one split's folder, "
            f"e.g. {folder / (splits[0] if splits else 'train')}"
        )
    state = folder / _HF_STATE
    if not state.is_file():
        return None
    files = [folder / f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
    if not files:
        raise DataError(f"{state}: lists no data files; save the dataset again")
    return files


def _is_glob(text: str) -> bool:
    return any(c in text for c in "*?[")


def corpus_files(data: str | os.PathLike) -> list[pathlib.Path]:
    """The corpus files a ``data`` argument names: a file, a directory or a glob pattern.

    A ``Dataset.save_to_disk`` folder gives its Arrow data files in the dataset's order. Another
    directory expands to every ``.jsonl``/``.txt``/``.parquet`` file under it (recursively),
    a pattern (``*``, ``?``, ``[``; ``**`` crosses folders) to the files it matches; both sorted
    by path, so a rerun reads them in the same order. Each file keeps the keys it has alone
    (:func:`corpus_key_prefix`), so a file read through its folder is skipped as already queued.

    Args:
        data: a corpus file, a folder or a glob pattern.

    Returns:
        The files, sorted (a file: itself, whatever its suffix; ``iter_texts`` checks it).

    Raises:
        FileNotFoundError: nothing exists at ``data`` (a pattern matching nothing included).
        ValueError: a folder or pattern without any corpus file (names the suffixes); the root
            of a Hugging Face DatasetDict (names its splits).
    """
    text = os.fspath(data)
    path = pathlib.Path(text)
    if path.is_file():
        return [path]
    if path.is_dir() and (hf := _hf_dataset_files(path)) is not None:
        return hf  # the dataset's own order, not sorted by name
    if path.is_dir():
        found = [p for p in path.rglob("*") if p.is_file() and p.suffix in _SUFFIXES]
    elif _is_glob(text):
        import glob

        found = [pathlib.Path(p) for p in glob.glob(text, recursive=True)]
        found = [p for p in found if p.is_file() and p.suffix in _SUFFIXES]
        if not found:
            raise FileNotFoundError(
                f"no corpus file matches {text!r} (files ending in {', '.join(_SUFFIXES)})"
            )
    else:
        raise FileNotFoundError(f"no such corpus file or folder: {path}")
    if not found:
        raise ValueError(f"{text}: no corpus files in it (files ending in {', '.join(_SUFFIXES)})")
    return sorted(found, key=lambda p: p.as_posix())


def iter_corpus(
    data: str | os.PathLike,
    *,
    text_field: str = "text",
    txt_split: str = "blank_line",
    key_root: str | os.PathLike | None = None,
    on_bad: OnBad = None,
) -> Iterator[tuple[str, str]]:
    """Yield ``(key, text)`` from every file of :func:`corpus_files` in turn (see iter_texts).

    Raises:
        FileNotFoundError, ValueError: as :func:`corpus_files` (at once) and :func:`iter_texts`.
    """
    files = corpus_files(data)
    return _chain_files(files, text_field, txt_split, key_root, on_bad)


def _chain_files(files, text_field, txt_split, key_root, on_bad) -> Iterator[tuple[str, str]]:
    for path in files:
        yield from iter_texts(
            path, text_field=text_field, txt_split=txt_split, key_root=key_root, on_bad=on_bad
        )


def shuffled_texts(
    texts: Iterable[tuple[str, str]], seed: int, limit: int | None = None
) -> list[tuple[str, str]]:
    """The first ``limit`` ``(key, text)`` pairs in an order fixed by ``seed``.

    The subset does not depend on the seed (the first ``limit`` pairs are taken, then
    shuffled), so runs with different seeds train on the same texts. The pairs are held in
    memory. The same seed gives the same order on every platform (``random.Random``).

    Args:
        texts: the pairs in corpus order (e.g. :func:`iter_corpus`).
        seed: the shuffle seed.
        limit: take only the first ``limit`` pairs (None: all).

    Returns:
        The pairs, shuffled.
    """
    items = list(itertools.islice(texts, limit))
    random.Random(seed).shuffle(items)
    return items


def read_texts(path: str | os.PathLike, limit: int, *, text_field: str = "text") -> list[str]:
    """The first ``limit`` non-empty texts of a corpus file (held-out evaluation).

    Args:
        path: a ``.jsonl`` / ``.txt`` / ``.parquet`` corpus.
        limit: most texts returned.
        text_field: JSON field / parquet column with the text.

    Returns:
        Up to ``limit`` texts, in file order.

    Raises:
        ValueError: the file has no usable text (or as :func:`iter_texts`).
    """
    texts: list[str] = []
    for _, text in iter_texts(path, text_field=text_field):
        if text.strip():
            texts.append(text)
        if len(texts) >= limit:
            break
    if not texts:
        raise DataError(f"held-out corpus {str(path)!r} has no usable text; point it at a corpus")
    return texts
