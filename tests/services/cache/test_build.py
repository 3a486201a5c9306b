"""`xtoken cache build` as a real process: every text of the corpus written exactly once (a rerun
writes nothing, two builders of one corpus split it by key), a killed build and a build on a
full disk continue where they stopped, and a folder of something else or a cache of another
build is refused in one line."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from xtoken_core.cache.manifest import read_manifest

CONFIG = """\
run_dir: {tmp}/run
student_tokenizer: mistral
teacher_tokenizer: smollm2
ctx_student: 32
ctx_teacher: 32
data: {{train: {tmp}/corpus.jsonl}}
teacher: {{model: tiny, max_batch: 4, max_length: 32, top_k: 8}}
"""


@pytest.fixture
def setup(tmp_path):
    texts = [f"text number {i}: " + "word " * (i % 7) for i in range(24)] + [""]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (tmp_path / "run.yaml").write_text(CONFIG.format(tmp=tmp_path))
    return tmp_path, len(texts)


def _build(tmp: Path, out: str, *flags: str, limit_bytes: int | None = None, wait: bool = True):
    argv = [sys.executable, "-m", "services.cli", "cache", "build", str(tmp / "run.yaml")]
    argv += ["--out", str(tmp / out), "--no-progress", *flags]

    def limit() -> None:  # a file-size limit: what a full disk looks like to the writer
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    kwargs = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if limit_bytes is not None:
        kwargs["preexec_fn"] = limit
    proc = subprocess.Popen(argv, **kwargs)
    if not wait:
        return proc
    out_text, err = proc.communicate(timeout=300)
    return proc.returncode, out_text, err


def _keys(out: Path) -> list[str]:
    manifest = read_manifest(out)
    return [
        k for s in manifest["shards"] for k in pq.read_table(out / s["path"])["key"].to_pylist()
    ]


def _verify(out: Path) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "services.cli", "cache", "verify", str(out)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_a_build_writes_every_text_once_and_a_rerun_writes_nothing(setup):
    tmp, n = setup
    code, out, err = _build(tmp, "cache")
    assert code == 0, err
    keys = _keys(tmp / "cache")
    assert len(keys) == len(set(keys)) == n
    assert "complete" in out
    code, out, err = _build(tmp, "cache")
    assert code == 0, err
    assert "wrote 0 samples (0 teacher tokens) in 0 shard(s)" in out and f"{n} already there" in out
    assert len(_keys(tmp / "cache")) == n
    assert _verify(tmp / "cache").returncode == 0


@pytest.mark.slow
def test_two_builders_split_the_corpus_by_key_into_one_cache(setup):
    tmp, n = setup
    code, out, err = _build(tmp, "cache", "--shard", "1/2")
    assert code == 0, err
    assert "incomplete" in out
    first = set(_keys(tmp / "cache"))
    code, out, err = _build(tmp, "cache", "--shard", "0/2")
    assert code == 0, err
    keys = _keys(tmp / "cache")
    assert len(keys) == len(set(keys)) == n and first < set(keys)
    assert read_manifest(tmp / "cache")["complete"]


def test_a_folder_of_something_else_is_refused_in_one_line(setup):
    tmp, _ = setup
    (tmp / "other").mkdir()
    (tmp / "other" / "notes.txt").write_text("mine")
    code, _, err = _build(tmp, "other")
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.startswith("xtoken cache build:")]
    assert len(lines) == 1 and "not empty and holds no teacher cache" in lines[0]
    assert (tmp / "other" / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_a_cache_of_another_k_is_refused_naming_the_key(setup):
    tmp, _ = setup
    assert _build(tmp, "cache")[0] == 0
    code, _, err = _build(tmp, "cache", "--top-k", "4")
    assert code == 2 and "k: 8 -> 4" in err


@pytest.mark.slow
def test_a_killed_build_continues_and_writes_every_sample_exactly_once(setup):
    tmp, n = setup
    # one text per forward and per shard: the build is killed between two shards
    flags = ("--batch-tokens", "1", "--shard-mb", "0.000001")
    proc = _build(tmp, "cache", *flags, wait=False)
    shards = tmp / "cache" / "shards"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(shards.glob("*.parquet"))) < 3:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    written = len(list(shards.glob("*.parquet")))
    assert 3 <= written < n, "the build should have been killed mid-way"
    code, out, err = _build(tmp, "cache", *flags)
    assert code == 0, err
    keys = _keys(tmp / "cache")
    assert len(keys) == len(set(keys)) == n
    assert _verify(tmp / "cache").returncode == 0


@pytest.mark.slow
def test_a_full_disk_keeps_what_was_written_and_the_rerun_completes(setup):
    tmp, n = setup
    flags = ("--batch-tokens", "1", "--shard-mb", "0.000001")
    code, _, err = _build(tmp, "cache", *flags, limit_bytes=12_000)
    assert code == 1, err
    assert "the shards written before are kept" in err and "Traceback" not in err
    kept = _keys(tmp / "cache")
    assert 0 < len(kept) < n
    code, out, err = _build(tmp, "cache", *flags)
    assert code == 0, err
    keys = _keys(tmp / "cache")
    assert len(keys) == len(set(keys)) == n and set(kept) < set(keys)
    assert _verify(tmp / "cache").returncode == 0
