"""`xtoken projection build|info` end to end on a small --limit run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from services import cli
from xtoken_core.data import projection as P


def test_build_then_info_end_to_end(tmp_path, capsys):
    out = tmp_path / "qwen3_deepseek.pt"
    stats_json = tmp_path / "stats.json"
    proc = subprocess.run(
        [
            sys.executable, "-m", "services.cli", "--log-level", "WARNING", "projection", "build",
            "--student", "qwen3", "--teacher", "deepseek", "--top-k", "4", "--limit", "300",
            "-o", str(out), "--stats-json", str(stats_json),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "exact_rows" in proc.stdout and "unmapped_rows" in proc.stdout
    stats = json.loads(stats_json.read_text())
    assert stats["rows_built"] == 300 and stats["top_k"] == 4
    saved = torch.load(out, weights_only=True)
    assert set(saved) == {"indices", "likelihoods", "meta"}  # meta: the tokenizers it was built for
    assert saved["meta"]["student"] == "qwen3" and saved["meta"]["teacher"] == "deepseek"
    assert saved["meta"]["student_vocab_size"] == "151669"
    assert saved["indices"].shape == (151669, 4) and saved["indices"].dtype == torch.long
    assert (saved["indices"][300:] == -1).all()  # rows past --limit are not built
    assert (saved["indices"][:300, 0] >= 0).all()  # the first 300 qwen3 ids all exist in deepseek

    P.clear_projection_caches()
    capsys.readouterr()
    assert cli.main(["projection", "info", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "dense top-k" in stdout
    lines = dict(line.split(None, 1) for line in stdout.splitlines() if line.strip())
    assert int(lines["student_rows"]) == 151669
    assert int(lines["empty_rows"]) == 151669 - 300
    assert float(lines["coverage"]) == pytest.approx(300 / 151669, rel=0.02)  # printed rounded
    assert lines["teacher"] == "deepseek"


def test_info_on_a_sparse_file(tmp_path, capsys):
    path = tmp_path / "sparse.pt"
    torch.save({(0, 3): 1.0, (1, -1): 0.0}, path)
    assert cli.main(["projection", "info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "sparse" in out and "minus_one_entries" in out


def test_info_on_a_missing_or_bad_file_fails_with_a_message(tmp_path, capsys):
    assert cli.main(["projection", "info", str(tmp_path / "missing.pt")]) == 2
    assert "not found" in capsys.readouterr().err
    bad = tmp_path / "bad.pt"
    torch.save({"indices": torch.zeros(2, 2, dtype=torch.long)}, bad)
    assert cli.main(["projection", "info", str(bad)]) == 2
    assert "unknown layout" in capsys.readouterr().err


def test_build_rejects_a_bad_limit(tmp_path, capsys):
    args = ["projection", "build", "--student", "qwen3", "--teacher", "mistral"]
    assert cli.main(args + ["--limit", "0", "-o", str(tmp_path / "x.pt")]) == 2
    assert "--limit" in capsys.readouterr().err


def test_projection_without_action_prints_usage(capsys):
    assert cli.main(["projection"]) == 2
    assert "build" in capsys.readouterr().err


def test_build_writes_safetensors_that_the_loaders_read(tmp_path):
    out = tmp_path / "proj.safetensors"
    args = ["projection", "build", "--student", "qwen3", "--teacher", "deepseek"]
    assert cli.main(args + ["--top-k", "2", "--limit", "50", "-o", str(out)]) == 0
    P.clear_projection_caches()
    indices, likelihoods = P.get_topk_projection(out, "cpu")
    assert indices.shape == (151669, 2) and likelihoods.dtype == torch.float32
    assert (likelihoods[:50].sum(dim=1) - 1).abs().max() < 1e-6
    P.clear_projection_caches()
