"""`xtoken collator` end to end: real queue server, real collator processes, demo corpus slice."""

from __future__ import annotations

import signal
import socket
import subprocess
import time

import pytest
import torch

from services.collator.cli import EXIT_DATA, EXIT_EMPTY, EXIT_STOPPED
from services.collator.worker import CollatorWorker, WorkerConfig
from services.queue.client import QueueClient
from tests.services.collator.conftest import (
    CTX,
    ROOT,
    STUDENT,
    TEACHER,
    collator_cmd,
    run_collator,
)
from xtoken_core.data import sample as schema
from xtoken_core.data.corpus import iter_texts
from xtoken_core.data_plane.codec import columns_to_samples


def _expected(path) -> dict[str, dict[str, torch.Tensor]]:
    """key -> sample, collated in-process with the settings the CLI runs use."""
    items = list(iter_texts(path))
    config = WorkerConfig(
        queue="unused", partition="unused", student=STUDENT, teacher=TEACHER,
        ctx_student=CTX, ctx_teacher=CTX,
    )  # fmt: skip
    collator = CollatorWorker(config).collator
    samples = collator.collate_samples([t for _, t in items])
    return {k: s for (k, _), s in zip(items, samples)}


@pytest.fixture(scope="module")
def expected(corpus_slice):
    return _expected(corpus_slice)


def _queued(address: str, partition: str) -> dict[str, dict[str, torch.Tensor]]:
    """Every sample of a partition, by key (fails on duplicate keys)."""
    with QueueClient(address, timeout_s=10) as client:
        keys = client.list(partition)["keys"]
        assert len(keys) == len(set(keys)), "duplicate keys in the queue"
        if not keys:
            return {}
        reply = client.get(partition, keys)
    samples = columns_to_samples(reply["fields"])
    return dict(zip(reply["keys"], samples))


def _assert_samples_equal(got: dict, want: dict) -> None:
    for key, sample in got.items():
        assert set(sample) == set(schema.FIELD_NAMES), key
        for name in schema.FIELD_NAMES:
            assert sample[name].dtype == want[key][name].dtype, (key, name)
            assert torch.equal(sample[name], want[key][name]), (key, name)


@pytest.fixture(scope="module")
def filled(queue_server, corpus_slice):
    """Two collators (2 and 1 workers) run concurrently over the same slice, one partition."""
    procs = [
        subprocess.Popen(
            collator_cmd(
                queue_server.address, corpus_slice, "both", "--workers", w, "--batch", "8"
            ),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in ("2", "1")
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    return [p.returncode for p in procs], outs


def test_two_collators_put_every_line_exactly_once(queue_server, filled, expected):
    codes, outs = filled
    assert codes == [0, 0], outs
    got = _queued(queue_server.address, "both")
    assert sorted(got) == sorted(expected)
    _assert_samples_equal(got, expected)
    with QueueClient(queue_server.address, timeout_s=10) as client:
        stats = client.stats()
    assert stats["partitions"]["both"]["samples"] == len(expected)


def test_restart_skips_queued_keys_and_adds_nothing(queue_server, filled, corpus_slice, expected):
    assert filled[0] == [0, 0]
    proc, summary = run_collator(queue_server.address, corpus_slice, "both", "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    assert summary["skipped"] == len(expected)
    assert summary["samples"] == 0
    assert sorted(_queued(queue_server.address, "both")) == sorted(expected)


def test_sigterm_mid_run_exits_with_the_stopped_code_and_a_rerun_completes(
    queue_server, corpus_slice, expected
):
    address, partition = queue_server.address, "sigterm"
    proc = subprocess.Popen(
        collator_cmd(address, corpus_slice, partition, "--workers", "1", "--batch", "1"),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        with QueueClient(address, timeout_s=10) as client:
            while not client.list(partition)["keys"]:
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "collator put nothing in 90 s"
                time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == EXIT_STOPPED, err
    assert "stopped early" in out
    partial = _queued(address, partition)
    assert 0 < len(partial) < len(expected)
    _assert_samples_equal(partial, expected)  # whole samples only

    rerun, summary = run_collator(address, corpus_slice, partition, "--workers", "1")
    assert rerun.returncode == 0, rerun.stderr
    assert summary["skipped"] == len(partial)
    assert summary["written"] == len(expected) - len(partial)
    final = _queued(address, partition)
    assert sorted(final) == sorted(expected)
    _assert_samples_equal(final, expected)


def test_a_bad_line_is_a_data_error_naming_file_line_and_the_key_that_skips_it(
    queue_server, tmp_path
):
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b'{"text": "fine"}\n{"text": "also fine"}\n{"text": "bro\xffken"}\n')
    proc, summary = run_collator(queue_server.address, data, "bad-utf8")
    assert proc.returncode == EXIT_DATA
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{data}:3" in errors[0] and "UTF-8" in errors[0], errors
    assert "data.skip_bad_lines" in errors[0] and "--skip-bad-lines" in errors[0], errors
    assert summary is None


def test_unreachable_queue_names_the_address_and_the_timeout_setting(corpus_slice):
    with socket.socket() as s:  # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    proc, _ = run_collator(address, corpus_slice, "p", "--queue-timeout-s", "0.5", timeout=60)
    assert proc.returncode == 1
    assert address in proc.stderr and "--queue-timeout-s" in proc.stderr, proc.stderr


def test_a_config_file_with_a_worker_section_and_flags_over_it_build_the_run_config(tmp_path):
    from services import cli
    from services.collator.config import CollatorConfig, CorpusConfig
    from services.common.config import from_args

    path = tmp_path / "collator.yaml"
    path.write_text(
        "data:\n  train: c.jsonl\nbatch: 8\nworker:\n  queue: tcp://q:1\n  student: qwen3\n"
        "  teacher: mistral\n  ctx_student: 128\n"
    )
    args = cli.build_parser().parse_args(
        ["collator", "--config", str(path), "--workers", "3", "--ctx-teacher", "64"]
    )
    worker = WorkerConfig(
        queue="tcp://q:1", student="qwen3", teacher="mistral", ctx_student=128, ctx_teacher=64
    )
    assert from_args(CollatorConfig, args) == CollatorConfig(
        data=CorpusConfig("c.jsonl"), worker=worker, workers=3, batch=8
    )


def test_a_missing_setting_exits_two_naming_its_flag(tmp_path):
    cmd = collator_cmd("tcp://127.0.0.1:1", tmp_path / "x.jsonl", "p")
    cmd = cmd[: cmd.index("--queue")] + cmd[cmd.index("--queue") + 2 :]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "[collator] error: missing required key 'worker.queue'" in proc.stderr
    assert "--queue" in proc.stderr and "Traceback" not in proc.stderr


def test_files_of_one_name_in_two_folders_both_reach_one_partition(queue_server, tmp_path):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "data.jsonl").write_text(
            "".join(f'{{"text": "{folder} text {i}"}}\n' for i in range(3)), encoding="utf-8"
        )
    for folder in ("a", "b"):
        proc, summary = run_collator(
            queue_server.address, tmp_path / folder / "data.jsonl", "two-folders"
        )
        assert proc.returncode == 0, proc.stderr
        assert summary["written"] == 3 and summary["skipped"] == 0, summary
    assert len(_queued(queue_server.address, "two-folders")) == 6


def test_key_root_keys_samples_by_their_path_under_it(queue_server, tmp_path):
    (tmp_path / "a").mkdir()
    data = tmp_path / "a" / "data.jsonl"
    data.write_text('{"text": "one"}\n{"text": "two"}\n', encoding="utf-8")
    proc, _ = run_collator(queue_server.address, data, "key-root", "--key-root", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert sorted(_queued(queue_server.address, "key-root")) == ["a/data.jsonl:1", "a/data.jsonl:2"]
    proc, _ = run_collator(
        queue_server.address, data, "key-root", "--key-root", str(data.parent / "x")
    )
    assert proc.returncode == 2 and "--key-root" in proc.stderr, proc.stderr


def test_an_empty_corpus_exits_with_its_own_code(queue_server, tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("\n\n", encoding="utf-8")
    proc, summary = run_collator(queue_server.address, data, "empty")
    assert proc.returncode == EXIT_EMPTY, proc.stderr
    assert "no text in --data" in proc.stderr and str(data) in proc.stderr, proc.stderr
    assert summary is not None and summary["read"] == 0


def test_exit_codes_are_distinct_and_documented_in_the_help():
    from services import cli

    assert len({0, 1, 2, EXIT_EMPTY, EXIT_STOPPED}) == 5
    parser = cli.build_parser()
    collator = parser._subparsers._group_actions[0].choices["collator"]
    help_text = collator.format_help()
    for code in (EXIT_EMPTY, EXIT_STOPPED):
        assert f"  {code}  " in help_text, help_text


def test_a_queue_address_without_scheme_exits_two_naming_the_flag(corpus_slice):
    proc, _ = run_collator("127.0.0.1:5555", corpus_slice, "p", timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "--queue" in proc.stderr and "tcp://127.0.0.1:5555" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_packed_run_puts_rows_of_every_text_and_a_rerun_skips_them(
    queue_server, corpus_slice, expected
):
    from xtoken_core.data.packing import document_keys

    address, partition = queue_server.address, "packed"
    proc, summary = run_collator(address, corpus_slice, partition, "--pack", "--batch", "40")
    assert proc.returncode == 0, proc.stderr
    assert summary["texts"] == len(expected) and 0 < summary["samples"] < len(expected)
    assert "packed rows of" in proc.stdout
    rows = _queued(address, partition)
    assert sorted(k for key in rows for k in document_keys(key)) == sorted(expected)
    for key, row in rows.items():
        schema.validate_sample(row)
        assert int(row["input_lengths"]) <= CTX and int(row["teacher_input_lengths"]) <= CTX
        assert int(row["alignment_num_chunks"]) == sum(
            int(expected[k]["alignment_num_chunks"])
            for k in document_keys(key)
            if float(expected[k]["sample_mask"]) != 0.0
        )

    rerun, summary = run_collator(address, corpus_slice, partition, "--pack", "--batch", "40")
    assert rerun.returncode == 0, rerun.stderr
    assert summary["skipped"] == len(expected) and summary["samples"] == 0
