"""The preflight finds before launch what would fail a run later: a CUDA device the machine lacks,
a data.train the collator would not read, a bad corpus line; and it makes the held-out corpus
explicit: the last texts of data.train (announced, not trained on) when data.heldout is unset."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.supervise.config import run_config_from_dict, value_at
from services.supervise.plan import RunPlace, make_context, make_data_sections
from services.supervise.preflight import (
    Inputs,
    check_devices,
    check_train,
    preflight,
    split_heldout,
)

ROOT = Path(__file__).resolve().parents[3]


def _config(tmp_path, **sections):
    data = {
        "run_dir": str(tmp_path / "run"),
        "student_tokenizer": "mistral",
        "teacher_tokenizer": "smollm2",
        "teacher": {"model": "tiny"},
        "trainer": {"student": {"model": "tiny"}, "loss": {"mode": "ce"}, "eval": {"texts": 4}},
    }
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    return run_config_from_dict(data)


def _data_sections(config, inputs):
    place = RunPlace.of(config)
    return make_data_sections(
        config, inputs, place, make_context(config, place, queue="tcp://127.0.0.1:1")
    )


def _xtoken_run_refused(tmp_path, run: dict) -> str:
    """``xtoken run`` of ``run`` (a run config) must exit 2 without a traceback: its stderr."""
    config = tmp_path / "run.json"
    config.write_text(json.dumps(run))
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "run", str(config), "--no-progress"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


def _corpus(path, n: int, bad_line: int | None = None):
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"text": f"text number {i}."}) for i in range(n)]
    if bad_line is not None:
        lines[bad_line - 1] = "{not json"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("key", ["trainer.compute", "teacher"])
def test_a_cuda_device_on_a_machine_without_cuda_is_refused_naming_the_key(
    tmp_path, monkeypatch, key
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = _config(tmp_path, trainer={"loss": {"mode": "pkl"}})
    value_at(config, key).device = "cuda"
    pattern = rf"{re.escape(key)}\.device='cuda' but this machine has no CUDA"
    with pytest.raises(ValueError, match=pattern):
        check_devices(config)


def test_xtoken_run_with_an_unknown_kd_where_agrees_tokenizer_exits_2_naming_the_key(tmp_path):
    train = _corpus(tmp_path / "train.jsonl", 80)
    stderr = _xtoken_run_refused(tmp_path, {
        "run_dir": str(tmp_path / "run"), "data": {"train": str(train)},
        "student_tokenizer": "mistral", "teacher_tokenizer": "mistral",
        "teacher": {"model": "tiny"},
        "trainer": {"student": {"model": "tiny"}, "loss": {"mode": "pkl"}},
        "kd_where_agrees": "no-such-tokenizer",
    })  # fmt: skip
    lines = [ln for ln in stderr.splitlines() if "kd_where_agrees" in ln]
    assert len(lines) == 1 and "no-such-tokenizer" in lines[0]
    assert not (tmp_path / "run" / "logs").exists()  # refused before any process started


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_xtoken_run_with_teacher_device_cuda_exits_2_with_one_line(tmp_path):
    train = _corpus(tmp_path / "train.jsonl", 8)
    stderr = _xtoken_run_refused(tmp_path, {
        "run_dir": str(tmp_path / "run"), "data": {"train": str(train)},
        "teacher": {"device": "cuda"}, "trainer": {"loss": {"mode": "pkl"}},
    })  # fmt: skip
    assert "teacher.device='cuda' but this machine has no CUDA device" in stderr


def test_data_train_takes_a_folder_or_a_glob_as_the_collator_does(tmp_path):
    _corpus(tmp_path / "corpus" / "a.jsonl", 3)
    _corpus(tmp_path / "corpus" / "b" / "c.jsonl", 3)
    check_train(str(tmp_path / "corpus"), "text")
    check_train(str(tmp_path / "corpus" / "*.jsonl"), "text")
    with pytest.raises(ValueError, match=r"data\.train='.*nope\*\.jsonl' is not a file, a folder"):
        check_train(str(tmp_path / "nope*.jsonl"), "text")


def test_without_data_heldout_the_last_texts_of_data_train_are_held_out_and_announced(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("XTOKEN_CACHE", str(tmp_path / "cache"))
    train = _corpus(tmp_path / "train.jsonl", 20)
    config = _config(tmp_path, data={"train": str(train)})
    with caplog.at_level(logging.INFO):
        inputs = preflight(config)
    assert f"[run] held-out: the last 4 texts of {train}" in caplog.text
    held = [json.loads(line)["text"] for line in open(inputs.heldout)]
    assert held == [f"text number {i}." for i in range(16, 20)]
    assert inputs.train == str(train) and inputs.train_limit == 16
    sections = _data_sections(config, inputs)
    assert sections["collator"]["data"]["limit"] == 16  # held-out texts not read


def test_with_no_eval_texts_nothing_is_held_out_and_a_named_heldout_is_refused(
    tmp_path, monkeypatch
):
    """``trainer.eval.texts: 0`` (a run that only measures speed): no split held out of
    data.train, no held-out corpus for the trainer or the teacher; one that names data.heldout
    too is refused in one line, exit 2."""
    monkeypatch.setenv("XTOKEN_CACHE", str(tmp_path / "cache"))
    train = _corpus(tmp_path / "train.jsonl", 20)
    trainer = {"student": {"model": "tiny"}, "loss": {"mode": "ce"}, "eval": {"texts": 0}}
    inputs = preflight(_config(tmp_path, data={"train": str(train)}, trainer=trainer))
    assert inputs.heldout is None and inputs.train_limit is None
    assert not (tmp_path / "cache" / "heldout").exists()
    heldout = _corpus(tmp_path / "heldout.jsonl", 3)
    stderr = _xtoken_run_refused(tmp_path, {
        "run_dir": str(tmp_path / "run"), "data": {"train": str(train), "heldout": str(heldout)},
        "trainer": {"eval": {"texts": 0}},
    })  # fmt: skip
    assert "trainer.eval.texts: 0 turns the held-out eval off; drop one of them" in stderr
    assert len(stderr.strip().splitlines()) == 1


def test_a_named_heldout_or_the_demo_corpus_is_used_as_given(tmp_path, monkeypatch):
    monkeypatch.setenv("XTOKEN_CACHE", str(tmp_path / "cache"))
    train = _corpus(tmp_path / "train.jsonl", 20)
    heldout = _corpus(tmp_path / "heldout.jsonl", 3)
    inputs = preflight(_config(tmp_path, data={"train": str(train), "heldout": str(heldout)}))
    assert inputs.heldout == str(heldout) and inputs.train_limit is None


def test_a_bad_line_past_the_first_is_found_before_launch_naming_file_line_and_the_key(tmp_path):
    train = _corpus(tmp_path / "train.jsonl", 20, bad_line=7)
    config = _config(tmp_path, data={"train": str(train)})
    with pytest.raises(ValueError, match=rf"{train}: line 7: .*data\.skip_bad_lines: true"):
        split_heldout(config, str(train))
    config = _config(tmp_path, data={"train": str(train), "skip_bad_lines": True})
    _, keep = split_heldout(config, str(train))
    assert keep == 15  # 19 good texts, the last 4 held out


def test_data_txt_split_cuts_txt_files_for_the_held_out_split_and_the_collator(tmp_path):
    train = tmp_path / "train.txt"
    train.write_text("".join(f"line {i}\n" for i in range(6)))  # no blank line
    config = _config(tmp_path, data={"train": str(train), "txt_split": "line"})
    config.trainer.eval.texts = 2
    heldout, keep = split_heldout(config, str(train))
    assert keep == 4 and [json.loads(r)["text"] for r in open(heldout)] == ["line 4", "line 5"]
    check_train(str(train), "text", txt_split="line")
    inputs = Inputs(str(train), heldout, None, keep)
    corpus = _data_sections(config, inputs)["collator"]["data"]
    assert corpus["txt_split"] == "line" and corpus["limit"] == 4
    # the default cuts at blank lines: the whole file is one text, too few to hold any out
    with pytest.raises(ValueError, match=r"has 1 texts: too few"):
        split_heldout(_config(tmp_path, data={"train": str(train)}), str(train))


def test_an_unknown_txt_split_is_refused_naming_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"data\.txt_split: expected one of 'blank_line', 'line'"):
        _config(tmp_path, data={"txt_split": "paragraph"})


@pytest.mark.parametrize("suffix", ["parquet", "jsonl"])
def test_a_corpus_without_its_text_field_names_the_run_setting(tmp_path, suffix):
    path = tmp_path / f"train.{suffix}"
    if suffix == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"body": ["a text"]}), path)
    else:
        path.write_text(json.dumps({"body": "a text"}) + "\n")
    with pytest.raises(ValueError) as refused:
        check_train(str(path), "text")
    assert "set data.text_field" in str(refused.value)
    assert "text_field=" not in str(refused.value)
    with pytest.raises(ValueError, match="set rollout.text_field"):
        check_train(str(path), "text", "rollout.prompts")
