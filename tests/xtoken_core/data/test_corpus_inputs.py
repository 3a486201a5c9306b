"""Corpus input as a folder or glob of files, and bad lines skipped and reported on request."""

from __future__ import annotations

import pytest

from xtoken_core.data.corpus import BadCorpusLine, corpus_files, iter_corpus, iter_texts


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "b.jsonl").write_text('{"text": "b1"}\n{"text": "b2"}\n', encoding="utf-8")
    (root / "a.txt").write_text("a1\n\na2\n", encoding="utf-8")
    (root / "sub" / "c.jsonl").write_text('{"text": "c1"}\n', encoding="utf-8")
    (root / "README.md").write_text("not a corpus file\n", encoding="utf-8")
    return root


def test_a_folder_expands_to_its_corpus_files_sorted(folder):
    assert [p.relative_to(folder).as_posix() for p in corpus_files(folder)] == [
        "a.txt",
        "b.jsonl",
        "sub/c.jsonl",
    ]


def test_a_folder_keeps_the_keys_each_file_has_alone(folder):
    want = []
    for name in ("a.txt", "b.jsonl", "sub/c.jsonl"):
        want += list(iter_texts(folder / name))
    assert list(iter_corpus(folder)) == want
    assert list(iter_corpus(folder, key_root=folder))[-1] == ("sub/c.jsonl:1", "c1")


def test_a_glob_reads_the_files_it_matches_sorted(folder):
    got = [k.split("/")[-1] for k, _ in iter_corpus(f"{folder}/**/*.jsonl")]
    assert got == ["b.jsonl:1", "b.jsonl:2", "c.jsonl:1"]


def test_nothing_to_read_names_the_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="no corpus file matches"):
        corpus_files(f"{tmp_path}/*.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no corpus files in it"):
        corpus_files(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no such corpus file or folder"):
        corpus_files(tmp_path / "missing")


def test_a_bad_line_raises_naming_file_and_line_by_default(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_bytes(b'{"text": "a"}\n{"text": oops}\n{"text": "x\xff"}\n{"body": 1}\n')
    with pytest.raises(BadCorpusLine, match=r"c\.jsonl: line 2: invalid JSON") as err:
        list(iter_corpus(path))
    assert (err.value.path, err.value.line) == (path, 2)


def test_bad_lines_are_reported_and_skipped_on_request_keeping_the_other_keys(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_bytes(
        b'{"text": "a"}\n{"text": oops}\n{"text": "x\xff"}\n{"body": 1}\n{"text": "e"}\n'
    )
    bad: list[BadCorpusLine] = []
    got = list(iter_corpus(path, key_root=tmp_path, on_bad=bad.append))
    assert got == [("c.jsonl:1", "a"), ("c.jsonl:5", "e")]
    assert [e.line for e in bad] == [2, 3, 4]
    assert "UTF-8" in str(bad[1]) and "string field" in str(bad[2])


def _hf_dataset(tmp_path, texts, name="ds", **columns):
    datasets = pytest.importorskip("datasets")  # the dev extra installs it
    ds = datasets.Dataset.from_dict({"text": texts, **columns})
    ds.save_to_disk(str(tmp_path / name), max_shard_size=200)  # several shards: their order
    return tmp_path / name


def test_a_hugging_face_dataset_folder_reads_its_rows_in_order(tmp_path):
    texts = [f"document {i} " + "x" * 40 for i in range(30)]
    folder = _hf_dataset(tmp_path, texts)
    files = corpus_files(folder)
    assert len(files) > 1 and all(f.suffix == ".arrow" for f in files)
    got = list(iter_corpus(folder))
    assert [t for _, t in got] == texts
    assert len({k for k, _ in got}) == len(texts)


def test_a_hugging_face_dataset_reads_the_named_text_field(tmp_path):
    folder = _hf_dataset(tmp_path, ["a", "b"], content=["first text", "second text"])
    assert [t for _, t in iter_corpus(folder, text_field="content")] == [
        "first text",
        "second text",
    ]
    with pytest.raises(ValueError, match="no column 'body'.*text_field"):
        list(iter_corpus(folder, text_field="body"))


def test_a_hugging_face_dataset_dict_root_names_its_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": ["a"]}),
            "test": datasets.Dataset.from_dict({"text": ["b"]}),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"DatasetDict \(splits .*train.*name one split's folder"):
        corpus_files(tmp_path / "dd")
    assert [t for _, t in iter_corpus(tmp_path / "dd" / "train")] == ["a"]
