"""Demo corpus build (stdlib text, split, cache) and the jsonl / txt / parquet readers."""

from __future__ import annotations

import json
import re

import pytest

from xtoken_core.data.corpus import build_demo_corpus, chunk_text, corpus_key_prefix, iter_texts


def _fake_stdlib(root, n_files=30):
    for i in range(n_files):
        sub = root / ("pkg" if i % 2 else "")
        sub.mkdir(parents=True, exist_ok=True)
        body = "\n\n".join(
            f'def f{i}_{j}():\n    """Doc {i} {j}."""\n    return {j}' for j in range(40)
        )
        (sub / f"mod{i:02d}.py").write_text(f'"""Module {i}."""\n\n{body}\n', encoding="utf-8")
    (root / "dup_a.py").write_text("x = 1\n", encoding="utf-8")
    (root / "dup_b.py").write_text("x = 1\n", encoding="utf-8")
    (root / "test").mkdir()
    (root / "test" / "test_skipped.py").write_text("SKIPPED = 1\n", encoding="utf-8")
    return root


def _records(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_build_writes_train_and_heldout_records_with_source_and_line(tmp_path):
    src = _fake_stdlib(tmp_path / "lib")
    corpus = build_demo_corpus(tmp_path / "out", stdlib_dir=src, heldout_fraction=0.2)
    train, heldout = _records(corpus.train_path), _records(corpus.heldout_path)
    assert corpus.num_train == len(train) > 0 and corpus.num_heldout == len(heldout) > 0
    for record in train + heldout:
        assert set(record) == {"text", "source", "line"}
        assert record["line"] >= 1
        lines = (src / record["source"]).read_text(encoding="utf-8").split("\n")
        # The record's text starts at the recorded line of the recorded file.
        assert record["text"].split("\n")[0] == lines[record["line"] - 1]
    texts = [r["text"] for r in train + heldout]
    assert len(texts) == len(set(texts)), "exact duplicates must be dropped"
    assert not any("SKIPPED" in t for t in texts), "test folders are skipped"


def test_build_is_deterministic_and_split_is_disjoint(tmp_path):
    src = _fake_stdlib(tmp_path / "lib")
    a = build_demo_corpus(tmp_path / "a", stdlib_dir=src, heldout_fraction=0.2)
    b = build_demo_corpus(tmp_path / "b", stdlib_dir=src, heldout_fraction=0.2)
    assert a.train_path.read_bytes() == b.train_path.read_bytes()
    assert a.heldout_path.read_bytes() == b.heldout_path.read_bytes()
    train = {r["text"] for r in _records(a.train_path)}
    heldout = {r["text"] for r in _records(a.heldout_path)}
    assert not train & heldout


def test_second_build_reuses_cache_and_force_or_new_params_rebuild(tmp_path):
    src = _fake_stdlib(tmp_path / "lib")
    first = build_demo_corpus(tmp_path / "out", stdlib_dir=src)
    assert not first.reused
    again = build_demo_corpus(tmp_path / "out", stdlib_dir=src)
    assert again.reused and again.num_train == first.num_train
    assert not build_demo_corpus(tmp_path / "out", stdlib_dir=src, force=True).reused
    assert not build_demo_corpus(tmp_path / "out", stdlib_dir=src, max_chars=2048).reused
    assert not list((tmp_path / "out").glob("*.tmp*")), "temporary files must not be left behind"


def test_build_from_the_real_stdlib_yields_chunked_texts(tmp_path):
    corpus = build_demo_corpus(tmp_path / "out", max_files=25)
    lengths = [len(t) for _, t in iter_texts(corpus.train_path)]
    assert len(lengths) == corpus.num_train > 10
    assert max(lengths) <= 4096 * 2
    assert sorted(lengths)[len(lengths) // 2] >= 512, "texts should be paragraphs packed to ~1-4 KB"


def test_build_rejects_bad_parameters(tmp_path):
    with pytest.raises(ValueError, match="heldout_fraction"):
        build_demo_corpus(tmp_path, heldout_fraction=1.0)
    with pytest.raises(ValueError, match="max_files"):
        build_demo_corpus(tmp_path, max_files=0)
    with pytest.raises(ValueError, match="no .py files"):
        build_demo_corpus(tmp_path / "out", stdlib_dir=tmp_path / "empty_does_not_exist")


def test_chunk_text_packs_paragraphs_and_cuts_long_ones():
    text = "\n\n".join(f"para {i}\n" + "x" * 300 for i in range(10))
    chunks = chunk_text(text, min_chars=600, max_chars=1000)
    assert all(600 <= len(c) <= 1000 for _, c in chunks[:-1])
    assert "\n\n".join(c for _, c in chunks) == text
    assert [line for line, _ in chunks][0] == 1
    long_para = "\n".join("y" * 50 for _ in range(100))
    pieces = chunk_text(long_para, min_chars=100, max_chars=200)
    assert all(len(c) <= 200 for _, c in pieces)
    assert "".join(c.replace("\n", "") for _, c in pieces) == long_para.replace("\n", "")
    with pytest.raises(ValueError, match="min_chars"):
        chunk_text("x", min_chars=10, max_chars=5)


def test_jsonl_reader_keys_are_path_under_the_key_root_and_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b\\nc", "other": 1}\n', encoding="utf-8")
    assert list(iter_texts(path, key_root=tmp_path)) == [("c.jsonl:1", "a"), ("c.jsonl:3", "b\nc")]


def test_invalid_utf8_names_file_line_and_byte_offset(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "x\xff"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 2: invalid UTF-8 at byte offset 26"):
        list(iter_texts(path, key_root=tmp_path))
    txt = tmp_path / "bad.txt"
    txt.write_bytes(b"fine\n\nalso fine\n\xc3(\n")
    with pytest.raises(ValueError, match=r"bad\.txt: line 4: invalid UTF-8 at byte offset 16"):
        list(iter_texts(txt, key_root=tmp_path))


def test_invalid_json_or_missing_text_names_the_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a"}\n{"text": oops}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"c\.jsonl: line 2: invalid JSON"):
        list(iter_texts(path, key_root=tmp_path))
    path.write_text('{"text": "a"}\n{"body": "b"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 2: expected a JSON object with a string field"):
        list(iter_texts(path, key_root=tmp_path))
    path.write_text('{"body": "b"}\n', encoding="utf-8")
    assert list(iter_texts(path, text_field="body", key_root=tmp_path)) == [("c.jsonl:1", "b")]


def test_txt_reader_splits_on_blank_lines_or_per_line(tmp_path):
    path = tmp_path / "d.txt"
    path.write_text("one\ntwo\n\n\nthree\n  \nfour", encoding="utf-8")
    assert list(iter_texts(path, key_root=tmp_path)) == [
        ("d.txt:1", "one\ntwo"),
        ("d.txt:5", "three"),
        ("d.txt:7", "four"),
    ]
    assert [k for k, _ in iter_texts(path, txt_split="line", key_root=tmp_path)] == [
        "d.txt:1",
        "d.txt:2",
        "d.txt:5",
        "d.txt:7",
    ]
    with pytest.raises(ValueError, match="txt_split"):
        iter_texts(path, txt_split="para")


def test_parquet_reader_yields_text_column_with_row_keys(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "e.parquet"
    pq.write_table(pa.table({"text": ["x", "", "z\u00e9"], "n": [1, 2, 3]}), path)
    assert list(iter_texts(path, key_root=tmp_path)) == [
        ("e.parquet:1", "x"),
        ("e.parquet:2", ""),
        ("e.parquet:3", "z\u00e9"),
    ]
    with pytest.raises(ValueError, match="no column 'body'"):
        list(iter_texts(path, text_field="body", key_root=tmp_path))
    pq.write_table(pa.table({"text": ["x", None]}), path)
    with pytest.raises(ValueError, match="row 2: column 'text' is null"):
        list(iter_texts(path, key_root=tmp_path))


def test_unknown_suffix_and_missing_file_are_rejected(tmp_path):
    path = tmp_path / "f.csv"
    path.write_text("text\n", encoding="utf-8")
    with pytest.raises(ValueError, match="unsupported corpus suffix '.csv'"):
        iter_texts(path)
    with pytest.raises(FileNotFoundError):
        iter_texts(tmp_path / "missing.jsonl")


def test_json_escaped_lone_surrogate_names_the_line(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"text": "a"}\n{"text": "x\\ud800y"}\n', encoding="utf-8")
    with pytest.raises(
        ValueError, match=r"s\.jsonl: line 2: 'text' holds a lone surrogate U\+D800"
    ):
        list(iter_texts(path, key_root=tmp_path))


def test_default_keys_tell_apart_files_of_one_name_in_two_folders(tmp_path):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "data.jsonl").write_text('{"text": "t"}\n', encoding="utf-8")
    key_a = [k for k, _ in iter_texts(tmp_path / "a" / "data.jsonl")]
    key_b = [k for k, _ in iter_texts(tmp_path / "b" / "data.jsonl")]
    assert key_a != key_b
    assert re.fullmatch(r"[0-9a-f]{12}/data\.jsonl:1", key_a[0]), key_a


def test_default_keys_are_stable_across_runs_and_spellings_of_the_path(tmp_path, monkeypatch):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n', encoding="utf-8")
    first = [k for k, _ in iter_texts(path)]
    monkeypatch.chdir(tmp_path)
    assert [k for k, _ in iter_texts("c.jsonl")] == first
    assert [k for k, _ in iter_texts("./../" + tmp_path.name + "/c.jsonl")] == first
    assert corpus_key_prefix(path) == first[0].rsplit(":", 1)[0]


def test_key_root_keys_by_the_relative_path_and_refuses_a_file_outside_it(tmp_path):
    (tmp_path / "a").mkdir()
    path = tmp_path / "a" / "data.jsonl"
    path.write_text('{"text": "t"}\n', encoding="utf-8")
    assert [k for k, _ in iter_texts(path, key_root=tmp_path)] == ["a/data.jsonl:1"]
    assert corpus_key_prefix(path, key_root=tmp_path / "a") == "data.jsonl"
    with pytest.raises(ValueError, match="not under the key root"):
        iter_texts(path, key_root=tmp_path / "elsewhere")


def test_read_texts_takes_the_first_non_empty_texts_and_refuses_a_file_without_text(tmp_path):
    from xtoken_core.data.corpus import read_texts

    path = tmp_path / "held.jsonl"
    path.write_text('{"text": "a"}\n{"text": "  "}\n{"text": "b"}\n{"text": "c"}\n')
    assert read_texts(path, 2) == ["a", "b"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": " "}\n')
    with pytest.raises(ValueError, match="no usable text"):
        read_texts(empty, 4)


def test_shuffled_texts_is_fixed_by_its_seed_and_keeps_the_first_limit_texts():
    from xtoken_core.data.corpus import shuffled_texts

    pairs = [(f"k{i}", f"text {i}") for i in range(50)]
    once = shuffled_texts(iter(pairs), 3, 40)
    assert shuffled_texts(iter(pairs), 3, 40) == once
    assert sorted(once) == sorted(pairs[:40]) and once != pairs[:40]
    other = shuffled_texts(iter(pairs), 4, 40)
    assert sorted(other) == sorted(once) and other != once
    assert len(shuffled_texts(iter(pairs), 3)) == 50
