"""Fixtures for collator tests: a real queue server, a small demo-corpus slice, collator runs."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from tests.services.queue.conftest import ROOT, ServerProcess

STUDENT = "qwen3"
TEACHER = "mistral"
CTX = 512  # short contexts keep the tests fast; truncation is exercised too


@pytest.fixture(scope="package")
def queue_server(tmp_path_factory):
    """One `xtoken queue serve` subprocess for the collator tests (one partition per test)."""
    srv = ServerProcess(tmp_path_factory.mktemp("collator-queue"), "--capacity", "256MiB")
    yield srv
    srv.stop()


@pytest.fixture(scope="package")
def corpus_slice(tmp_path_factory) -> pathlib.Path:
    """The first 40 texts of a demo corpus built from a few stdlib files (JSONL)."""
    from xtoken_core.data.corpus import build_demo_corpus

    tmp = tmp_path_factory.mktemp("collator-corpus")
    corpus = build_demo_corpus(tmp / "demo", max_files=12)
    lines = corpus.train_path.read_text(encoding="utf-8").splitlines()[:40]
    assert len(lines) >= 30, f"demo slice too small: {len(lines)} texts"
    path = tmp / "slice.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def collator_cmd(address: str, data: pathlib.Path, partition: str, *extra: str) -> list[str]:
    """Command line of an `xtoken collator` run with the test tokenizers and contexts."""
    return [
        sys.executable,
        "-m",
        "services.cli",
        "collator",
        "--queue",
        address,
        "--data",
        str(data),
        "--student",
        STUDENT,
        "--teacher",
        TEACHER,
        "--partition",
        partition,
        "--ctx-student",
        str(CTX),
        "--ctx-teacher",
        str(CTX),
        "--log-every-s",
        "1",
        *extra,
    ]


def run_collator(
    address: str, data: pathlib.Path, partition: str, *extra: str, timeout: float = 120
) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Run a collator to completion; returns the process result and its JSON summary."""
    summary = pathlib.Path(data).parent / f"summary-{partition}-{len(extra)}.json"
    summary.unlink(missing_ok=True)
    proc = subprocess.run(
        collator_cmd(address, data, partition, "--summary-json", str(summary), *extra),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, (json.loads(summary.read_text()) if summary.exists() else None)
