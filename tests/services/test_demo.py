"""`xtoken demo` end to end: corpus build, two real tokenizers, collation, statistics."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from services import cli


def test_demo_prints_alignment_table_for_16_texts(tmp_path, capsys):
    rc = cli.main(["demo", "--limit", "16", "--batch-size", "5", "--corpus-dir", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.startswith("xtoken demo: 16 texts from ")
    rows = dict(line.split(None, 1) for line in out.splitlines()[1:])
    assert rows["student"].strip() == "qwen3" and rows["teacher"].strip() == "mistral"
    assert int(rows["samples"]) == 16
    assert int(rows["chunks"]) > 16
    assert 0.5 < float(rows["valid_pair_fraction"]) <= 1.0
    assert 1.0 < float(rows["student_bytes_per_token"]) < 10.0
    assert (tmp_path / "train.jsonl").is_file() and (tmp_path / "manifest.json").is_file()


def test_demo_json_via_subprocess_on_a_given_corpus(tmp_path):
    corpus = tmp_path / "mini.jsonl"
    texts = ["Hello, world!", "", "Naïve café 🙂 " * 50, "def f(x):\n    return x\n"]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "--log-level", "WARNING", "demo", "--json"]
        + ["--corpus", str(corpus), "--teacher", "deepseek", "--ctx-teacher", "20"]
        + ["--div-student", "8", "--limit", "16"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    assert stats["teacher"] == "deepseek" and stats["samples"] == len(texts)
    assert stats["empty_samples"] == 1
    assert stats["teacher_samples_at_ctx"] == 1  # only the long text reaches 20 tokens
    assert stats["samples_per_second"] > 0


def test_demo_rejects_bad_options(tmp_path, capsys):
    assert cli.main(["demo", "--limit", "0", "--corpus-dir", str(tmp_path)]) == 2
    assert "--limit" in capsys.readouterr().err
    assert (
        cli.main(["demo", "--limit", "2", "--ctx-student", "0", "--corpus-dir", str(tmp_path)]) == 2
    )
    assert "ctx_length_student" in capsys.readouterr().err
