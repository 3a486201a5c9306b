"""A run's teacher cache checked before any process starts: one built for the run's teacher and
corpus passes; one of another teacher (weights, tokenizer, context, K) is refused in one line
naming the first key that differs; one that lacks samples of the corpus names how many and their
builder shards, or with ``data.teacher_cache_missing: online`` counts them in one line; a folder
that holds no cache says how to build one; P-KL over a column subset of the cached ids is warned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cache.build import BuildOptions, CacheBuilder
from services.cache.check import check_teacher_caches
from services.supervise.config import run_config_from_dict
from xtoken_core.errors import SettingsError

TEXTS = [f"text number {i}: " + "word " * (i % 5) for i in range(10)]


def _config(tmp: Path, corpus: str = "corpus.jsonl", teacher=None, data=None, **top):
    return run_config_from_dict(
        {
            "run_dir": str(tmp / "run"),
            "student_tokenizer": "mistral",
            "teacher_tokenizer": "smollm2",
            "ctx_student": 32,
            "ctx_teacher": 32,
            "data": {"train": str(tmp / corpus), "teacher_cache": str(tmp / "cache")}
            | (data or {}),
            "teacher": {"model": "tiny", "max_batch": 4, "max_length": 32, "top_k": 8}
            | (teacher or {}),
            **top,
        }
    )


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("check")
    (tmp / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    options = BuildOptions(out=str(tmp / "cache"), shard=(0, 2), progress=False)
    CacheBuilder(_config(tmp), options).run()
    options = BuildOptions(out=str(tmp / "cache"), shard=(1, 2), progress=False)
    CacheBuilder(_config(tmp), options).run()
    return tmp


def _check(config) -> None:
    check_teacher_caches(config, config.data.train, config.data.limit)


def test_a_cache_of_the_runs_teacher_and_corpus_passes(tmp):
    _check(_config(tmp))
    _check(_config(tmp, **{"ctx_student": 16}))  # the student's side is made at train time


@pytest.mark.parametrize(
    "teacher, top, key",
    [
        ({"seed": 3}, {}, "teacher.weights_hash"),
        ({"top_k": 4}, {}, "k: 8 -> 4"),
        ({"max_length": 48}, {"ctx_teacher": 48}, "ctx_teacher: 32 -> 48"),
        ({}, {"teacher_tokenizer": "qwen3"}, "tokenizer.name: 'smollm2' -> 'qwen3'"),
    ],
)
def test_a_cache_of_another_teacher_is_refused_in_one_line_naming_the_key(tmp, teacher, top, key):
    with pytest.raises(SettingsError, match="was built for another teacher") as e:
        _check(_config(tmp, teacher=teacher, **top))
    assert key in str(e.value) and "\n" not in str(e.value)


def test_a_corpus_sample_the_cache_lacks_is_named_with_its_count_and_builder_shards(tmp):
    more = TEXTS + ["a text the cache never saw", "nor this one"]
    (tmp / "more.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in more))
    with pytest.raises(SettingsError, match=r"lacks 12 sample\(s\) of the corpus .* builder"):
        _check(_config(tmp, corpus="more.jsonl"))


def test_with_online_the_samples_the_cache_lacks_are_counted_in_one_line_not_refused(
    tmp, tmp_path, caplog
):
    from xtoken_core.cache.reader import CacheReader

    half = tmp_path / "half"  # builder 0 of 2 alone: about half the corpus
    CacheBuilder(_config(tmp), BuildOptions(out=str(half), shard=(0, 2), progress=False)).run()
    held = len(CacheReader(half))
    assert 0 < held < len(TEXTS)
    data = {"teacher_cache": str(half), "teacher_cache_missing": "online"}
    with caplog.at_level("INFO", logger="services.cache.check"):
        _check(_config(tmp, data=data))
    (line,) = [r.getMessage() for r in caplog.records if "live groups" in r.getMessage()]
    assert f"for {held} of the {len(TEXTS)} samples" in line, line
    assert f"for the {len(TEXTS) - held} it lacks" in line, line
    with pytest.raises(SettingsError, match=r"lacks .* sample\(s\) of the corpus"):
        _check(_config(tmp, data={"teacher_cache": str(half)}))
    with pytest.raises(SettingsError, match="was built for another teacher"):  # still checked
        _check(_config(tmp, teacher={"seed": 3}, data=data))


def test_a_folder_without_a_cache_is_refused_naming_the_build_command(tmp, tmp_path):
    config = _config(tmp)
    config.data.teacher_cache = str(tmp_path)
    with pytest.raises(SettingsError, match=r"holds no teacher cache .* `xtoken cache build"):
        _check(config)


@pytest.mark.parametrize(
    "loss, warned",
    [
        ({"mode": "pkl"}, True),
        ({"mode": "pkl", "vocab_topk": None}, False),
        ({"mode": "gold"}, False),
    ],
)
def test_pkl_over_a_column_subset_of_cached_targets_is_warned_in_one_line(
    tmp, caplog, loss, warned
):
    with caplog.at_level("WARNING", logger="services.cache.check"):
        _check(_config(tmp, trainer={"loss": loss}))
    lines = [r.getMessage() for r in caplog.records if "column pick" in r.getMessage()]
    assert len(lines) == warned
    if warned:
        assert "top_k=8" in lines[0] and lines[0].endswith("set trainer.loss.vocab_topk: null")
