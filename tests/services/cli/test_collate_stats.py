"""`xtoken collate-stats` end to end: corpus build, two real tokenizers, collation, statistics."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from services import cli


def test_collate_stats_prints_alignment_table_for_16_texts(tmp_path, capsys):
    rc = cli.main(
        ["collate-stats", "--limit", "16", "--batch-size", "5", "--corpus-dir", str(tmp_path)]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert out.startswith("xtoken collate-stats: 16 texts from ")
    rows = dict(line.split(None, 1) for line in out.splitlines()[1:])
    assert rows["student"].strip() == "qwen3" and rows["teacher"].strip() == "deepseek"
    assert int(rows["samples"]) == 16
    assert int(rows["chunks"]) > 16
    assert 0.5 < float(rows["valid_pair_fraction"]) <= 1.0
    assert 1.0 < float(rows["student_bytes_per_token"]) < 10.0
    assert (tmp_path / "train.jsonl").is_file() and (tmp_path / "manifest.json").is_file()


def test_collate_stats_json_via_subprocess_on_a_given_corpus(tmp_path):
    corpus = tmp_path / "mini.jsonl"
    texts = ["Hello, world!", "", "Naïve café 🙂 " * 50, "def f(x):\n    return x\n"]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "--log-level", "WARNING", "collate-stats", "--json"]
        + ["--corpus", str(corpus), "--teacher", "smollm2", "--ctx-teacher", "20"]
        + ["--div-student", "8", "--limit", "16"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    assert stats["teacher"] == "smollm2" and stats["samples"] == len(texts)
    assert stats["empty_samples"] == 1
    assert stats["teacher_samples_at_ctx"] == 1  # only the long text reaches 20 tokens
    assert stats["samples_per_second"] > 0


def test_collate_stats_rejects_bad_options(tmp_path, capsys):
    assert cli.main(["collate-stats", "--limit", "0", "--corpus-dir", str(tmp_path)]) == 2
    assert "--limit" in capsys.readouterr().err
    assert (
        cli.main(
            ["collate-stats", "--limit", "2", "--ctx-student", "0", "--corpus-dir", str(tmp_path)]
        )
        == 2
    )
    assert "ctx_length_student" in capsys.readouterr().err


def test_collate_stats_totals_agree_with_alignment_stats():
    from services.cli.collate_stats import _Totals
    from xtoken_core.align import AlignmentBatch, TokenAligner, alignment_stats
    from xtoken_core.data.collator import CrossTokenizerCollator
    from xtoken_core.tokenizers import load_tokenizer

    collator = CrossTokenizerCollator(
        student_tokenizer=load_tokenizer("qwen3"),
        teacher_tokenizer=load_tokenizer("mistral"),
        aligner=TokenAligner(),
        ctx_length_student=12,
        ctx_length_teacher=9,
    )
    texts = ["Hello, world! How are you today, my friend?", "", "naïve café", "x = [1, 2, 3]"]
    batch = collator(texts)
    totals = _Totals()
    totals.add(texts, batch, (12, 9))
    report = totals.report(1.0)
    reference = alignment_stats(AlignmentBatch.from_flat_dict(batch))
    assert report["chunks"] == reference["chunks"]
    assert report["valid_pair_fraction"] == round(reference["valid_fraction"], 4)
    assert report["student_tokens"] == int(batch["input_lengths"].sum())
    assert report["empty_samples"] == 1
    # Mistral adds a BOS the qwen3 side cannot pair: one one-sided teacher token per sample.
    assert report["teacher_one_sided_tokens"] >= len(texts)
    assert report["student_samples_at_ctx"] == 1 and report["samples_per_second"] == 4.0
