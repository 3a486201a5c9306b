"""What a teacher cache's targets depend on, computed from a run config: the teacher model and a
hash of its weights, its tokenizer, the teacher context, K and the format, and the corpus.

A run may read a cache only when the fingerprint keys its teacher decides
(``xtoken_core.cache.manifest.RUN_KEYS``) agree; the corpus may differ (a sample the cache
lacks is reported by key).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from xtoken_core.cache.format import FORMAT_VERSION

__all__ = ["corpus_fingerprint", "preset_draw", "teacher_fingerprint", "weights_hash"]

# file suffixes of a model folder whose bytes make its weights (and the config that reads them)
_WEIGHT_FILES = (".safetensors", ".bin", ".gguf", "config.json")
# a chunk of a file read for its hash
_CHUNK = 1 << 22


def _memo_path() -> Path:
    from xtoken_core.envs import xtoken_cache

    root = xtoken_cache() or os.path.join(os.path.expanduser("~"), ".cache", "xtoken")
    return Path(root) / "file_hashes.json"


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes, remembered by its path, size and modification time (a
    teacher's weights are hashed once, not at every run)."""
    path = Path(path).resolve()
    st = path.stat()
    stamp = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    memo_file = _memo_path()
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    if stamp in memo:
        return memo[stamp]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    memo[stamp] = digest.hexdigest()
    try:
        from xtoken_core.cache.manifest import write_json_atomic

        memo_file.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(memo_file, memo)
    except OSError:  # a read-only cache folder: hashed again next time
        pass
    return memo[stamp]


def weights_hash(spec: str, vocab_size: int | None, seed: int, draw: str | None = None) -> str:
    """A hash of the weights a model spec loads.

    A local folder: its weight and config files' bytes; ``gguf:PATH``: the file's bytes; a
    preset or a packaged model (``smollm2``, ``qwen2.5-coder-0.5b``): its name, vocab and seed
    (a preset's weights are drawn from the seed; a packaged model's files are pinned by their
    package). A ``:drop=`` suffix is part of the spec hashed.

    Args:
        spec: the model spec.
        vocab_size: a preset's vocab.
        seed: a preset's seed.
        draw: how a preset's weights were drawn, when not as one process draws them (a
            tensor-parallel group's shard-wise draw: :func:`preset_draw`); hashed for a
            preset only, since a checkpoint's weights do not depend on who reads them.
    """
    from xtoken_core.models.layer_drop import split_spec
    from xtoken_core.models.presets import PRESETS

    base, _ = split_spec(spec)
    digest = hashlib.sha256()
    if os.path.isdir(base):
        files = sorted(
            p for p in Path(base).rglob("*") if p.is_file() and p.name.endswith(_WEIGHT_FILES)
        )
        for p in files:
            digest.update(f"{p.relative_to(base)}={file_sha256(p)}\n".encode())
        digest.update(f"spec={Path(spec).name}".encode())
    elif base.startswith("gguf:"):
        digest.update(f"gguf={file_sha256(base[5:])}|spec={spec.split(':drop=')[-1]}".encode())
    else:
        digest.update(f"named={spec}|vocab={vocab_size}|seed={seed}".encode())
        if draw is not None and base in PRESETS:
            digest.update(f"|draw={draw}".encode())
    return "sha256:" + digest.hexdigest()[:32]


def preset_draw(tensor_parallel: int, device: str) -> str | None:
    """How a teacher's preset weights are drawn: None as one process on a CPU draws them (one
    stream); on a GPU, or in a tensor-parallel group, each tensor (each rank's shard) is drawn on
    its device by a generator of its own (``xtoken_core.models.device_draw``), so the weights
    depend on the group's size and the device type (``tensor_parallel=2/cuda``).

    Args:
        tensor_parallel: the teacher's ``tensor_parallel``.
        device: its device (``cpu``, ``cuda``).
    """
    kind = str(device).split(":")[0]
    if tensor_parallel <= 1 and kind == "cpu":
        return None
    return f"tensor_parallel={max(1, int(tensor_parallel))}/{kind}"


def teacher_fingerprint(
    model: str,
    tokenizer: Any,
    tokenizer_name: str,
    *,
    width: int,
    vocab_size: int | None,
    seed: int,
    ctx_teacher: int,
    k: int,
    draw: str | None = None,
) -> dict[str, Any]:
    """The fingerprint keys a teacher decides (everything but the corpus). A checkpoint's are
    the same whether one process or a tensor-parallel group reads it (the group's size is no
    key); a preset's weights hash names a group's draw (:func:`preset_draw`).

    Args:
        model: the teacher's model spec.
        tokenizer: its loaded tokenizer.
        tokenizer_name: the name or path the config gives it.
        width: the logits' width W (the model's vocab, maybe padded past the tokenizer's).
        vocab_size: the config's ``vocab_size`` of a preset (None: the tokenizer's).
        seed: the config's seed of a preset.
        ctx_teacher: teacher tokens kept per text.
        k: ids kept per position.
        draw: a preset's draw when not one process's (:func:`preset_draw`).
    """
    from xtoken_core.data.projection_build import vocab_hash

    return {
        "format_version": FORMAT_VERSION,
        "teacher": {
            "model": model,
            "weights_hash": weights_hash(model, vocab_size, seed, draw),
            "width": int(width),
        },
        "tokenizer": {
            "name": tokenizer_name,
            "vocab_size": int(tokenizer.vocab_size),
            "vocab_hash": vocab_hash(tokenizer),
        },
        "ctx_teacher": int(ctx_teacher),
        "k": int(k),
        "temperature": None,
        "add_special_tokens": True,
    }


def corpus_fingerprint(files: list[Path], data: Any) -> dict[str, Any]:
    """The corpus a cache was built from: each file's name, size and sha256, and the settings
    that cut it into texts (``text_field``, ``txt_split``, ``limit``, ``skip_bad_lines``)."""
    return {
        "files": [
            {"name": p.name, "bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in files
        ],
        "text_field": data.text_field,
        "txt_split": data.txt_split,
        "limit": data.limit,
        "skip_bad_lines": data.skip_bad_lines,
    }
