"""A teacher cache end to end: `xtoken cache build` over a corpus, `xtoken cache info`, and
`xtoken cache verify` passing on the whole cache, then naming a damaged shard's path and byte
offset with exit code 3."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from xtoken_core.cache.manifest import read_manifest

# The default suite keeps one quick end-to-end run (tests/e2e/test_pipeline.py); the cache's
# build and refusals as real processes stay in it through tests/services/cache/test_build.py.
pytestmark = pytest.mark.slow


def _xtoken(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *argv], capture_output=True, text=True, timeout=300
    )


def test_a_built_cache_verifies_and_a_damaged_shard_is_named_with_its_offset(tmp_path):
    texts = [f"def f{i}(x):\n    return x * {i}\n" for i in range(12)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (tmp_path / "run.yaml").write_text(
        f"student_tokenizer: mistral\nteacher_tokenizer: smollm2\nctx_teacher: 32\n"
        f"data: {{train: {tmp_path}/corpus.jsonl}}\n"
        "teacher: {model: tiny, max_batch: 4, max_length: 32, top_k: 16}\n"
    )
    out = tmp_path / "cache"
    built = _xtoken("cache", "build", str(tmp_path / "run.yaml"), "--out", str(out))
    assert built.returncode == 0, built.stderr
    info = _xtoken("cache", "info", str(out), "--json")
    assert json.loads(info.stdout)["samples"] == 12
    assert _xtoken("cache", "verify", str(out)).returncode == 0
    shard = read_manifest(out)["shards"][0]
    path = out / shard["path"]
    data = bytearray(path.read_bytes())
    offset = shard["row_groups"][0]["offset"]
    data[offset + 10] ^= 0xFF
    path.write_bytes(bytes(data))
    verified = _xtoken("cache", "verify", str(out))
    assert verified.returncode == 3
    assert f"{path} at byte offset {offset}" in verified.stderr
