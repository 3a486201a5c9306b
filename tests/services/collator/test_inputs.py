"""`xtoken collator --data` as a folder or glob, and --skip-bad-lines, against a real queue."""

from __future__ import annotations

from services.queue.client import QueueClient
from tests.services.collator.conftest import run_collator
from xtoken_core.data.corpus import iter_texts


def _keys(address: str, partition: str) -> list[str]:
    with QueueClient(address, timeout_s=10) as client:
        return sorted(client.list(partition)["keys"])


def test_a_folder_puts_every_file_with_the_keys_a_single_file_run_makes(queue_server, tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.jsonl").write_text('{"text": "a one"}\n{"text": "a two"}\n', encoding="utf-8")
    (root / "sub" / "b.txt").write_text("b one\n\nb two\n", encoding="utf-8")
    (root / "notes.md").write_text("ignored\n", encoding="utf-8")
    # one file first: the folder run then skips its keys as already queued
    proc, summary = run_collator(queue_server.address, root / "a.jsonl", "folder")
    assert proc.returncode == 0, proc.stderr
    proc, summary = run_collator(queue_server.address, root, "folder")
    assert proc.returncode == 0, proc.stderr
    assert summary["read"] == 4 and summary["skipped"] == 2 and summary["written"] == 2
    want = [k for f in (root / "a.jsonl", root / "sub" / "b.txt") for k, _ in iter_texts(f)]
    assert _keys(queue_server.address, "folder") == sorted(want)
    proc, summary = run_collator(queue_server.address, f"{root}/sub/*.txt", "folder-glob")
    assert proc.returncode == 0, proc.stderr
    assert summary["written"] == 2
    assert _keys(queue_server.address, "folder-glob") == sorted(want[2:])


def test_a_bad_line_fails_naming_file_line_and_the_skip_flag(queue_server, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b'{"text": "one"}\n{"text": nope}\n{"text": "t\xffo"}\n{"text": "four"}\n')
    proc, summary = run_collator(queue_server.address, data, "bad-lines")
    assert proc.returncode == 3 and summary is None  # a data error: a restart meets it again
    assert "bad.jsonl: line 2: invalid JSON" in proc.stderr, proc.stderr
    assert "--skip-bad-lines" in proc.stderr and "Traceback" not in proc.stderr
    proc, summary = run_collator(queue_server.address, data, "bad-lines", "--skip-bad-lines")
    assert proc.returncode == 0, proc.stderr
    assert summary["bad_lines"] == 2 and summary["written"] == 2, summary
    assert "line 3: invalid UTF-8" in proc.stderr and "2 bad lines skipped" in proc.stdout


def test_a_missing_text_field_names_the_flag_not_the_python_argument(queue_server, tmp_path):
    data = tmp_path / "body.jsonl"
    data.write_text('{"body": "one"}\n', encoding="utf-8")
    proc, _ = run_collator(queue_server.address, data, "text-field")
    assert proc.returncode == 3  # a record without the field: a data error
    assert "--text-field" in proc.stderr and "text_field=" not in proc.stderr, proc.stderr


def test_a_shuffle_seed_puts_the_first_limit_texts_in_the_seeds_order(queue_server, tmp_path):
    from xtoken_core.data.corpus import shuffled_texts

    data = tmp_path / "ten.jsonl"
    data.write_text("".join(f'{{"text": "text {i}"}}\n' for i in range(10)), encoding="utf-8")
    proc, summary = run_collator(
        queue_server.address, data, "shuffled", "--shuffle-seed", "5", "--limit", "8",
        "--batch", "3", "--workers", "1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert summary["written"] == 8
    with QueueClient(queue_server.address, timeout_s=10) as client:
        put_order = client.list("shuffled")["keys"]  # insertion order
    want = [k for k, _ in shuffled_texts(iter_texts(data), 5, 8)]
    assert put_order == want
    assert sorted(want) == sorted(k for k, _ in list(iter_texts(data))[:8]) and want != sorted(want)
