"""The durable log (no sockets): records written and replayed in order, a torn or corrupt tail
cut off, compaction to a snapshot, and a store rebuilt from its log equal to the original."""

from __future__ import annotations

import os
import time

import pytest
import torch

from services.queue import log_writer
from services.queue.durable import CorruptLogError, DurableLog, log_files, read_records
from services.queue.store import SampleStore
from tests.services.queue.durable_logs import open_log
from xtoken_core.wire.tensors import JaggedColumn


def ids_field(keys, length=4):
    return JaggedColumn.from_rows(
        [torch.full((length,), int(k.split("-")[1]), dtype=torch.int64) for k in keys]
    )


def test_records_replay_in_order_with_their_tensors(tmp_path):
    log, bodies = open_log(tmp_path)
    assert bodies == []
    log.append(
        "put",
        {"partition": "p", "keys": ["k-1", "k-2"], "fields": {"ids": ids_field(["k-1", "k-2"])}},
    )
    seq = log.append("ack", {"partition": "p", "task": "t", "keys": ["k-1"]})
    log.close()
    assert log.written == seq == 2
    _, bodies = open_log(tmp_path)
    assert [b["op"] for b in bodies] == ["put", "ack"]
    ids = bodies[0]["fields"]["ids"]
    assert ids.values.tolist() == [1] * 4 + [2] * 4 and ids.offsets.tolist() == [0, 4, 8]
    assert bodies[1]["keys"] == ["k-1"]


@pytest.mark.parametrize("cut", [1, 7, 16, 40])
def test_a_torn_tail_record_is_cut_off_and_appending_goes_on(tmp_path, cut):
    log, _ = open_log(tmp_path)
    log.append("register", {"partition": "p", "task": "a"})
    log.append("register", {"partition": "p", "task": "b"})
    log.close()
    ((_, path),) = log_files(str(tmp_path))
    size = os.path.getsize(path)
    os.truncate(path, size - cut)  # a SIGKILL in the middle of the second record
    log, bodies = open_log(tmp_path)
    assert [b["task"] for b in bodies] == ["a"]
    log.append("register", {"partition": "p", "task": "c"})
    log.close()
    _, bodies = open_log(tmp_path)
    assert [b["task"] for b in bodies] == ["a", "c"]


def test_a_corrupt_record_in_the_middle_stops_the_replay_unless_salvaged(tmp_path):
    log, _ = open_log(tmp_path)
    for t in "abc":
        log.append("register", {"partition": "p", "task": t})
    log.close()
    ((_, path),) = log_files(str(tmp_path))
    ends = [end for end, _ in read_records(path)]
    with open(path, "r+b") as f:  # flip a byte inside the second record's payload
        f.seek(ends[0] + 20)
        byte = f.read(1)
        f.seek(ends[0] + 20)
        f.write(bytes([byte[0] ^ 0xFF]))
    # valid records follow it: corruption, not a torn tail; nothing is changed on disk
    size = os.path.getsize(path)
    with pytest.raises(CorruptLogError, match=f"at byte {ends[0]}") as err:
        open_log(tmp_path)
    assert err.value.path == path and err.value.offset == ends[0]
    assert os.path.getsize(path) == size
    log, bodies = open_log(tmp_path, salvage=True)  # keeps the records after the bad one
    assert [b["task"] for b in bodies] == ["a", "c"]
    log.close()
    log, bodies = open_log(tmp_path)  # the log was rewritten without the bad bytes
    log.close()
    assert [b["task"] for b in bodies] == ["a", "c"]


def test_a_file_that_is_not_a_log_is_refused_by_name(tmp_path):
    (tmp_path / f"log.{1:016d}").write_bytes(b"not a log at all")
    with pytest.raises(ValueError, match="not a queue log"):
        DurableLog(str(tmp_path)).replay(lambda b: None)


def wait_for(predicate, seconds=10.0):
    """Poll ``predicate`` until it is true (False after ``seconds``)."""
    end = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def reported(log, seq, synced=False):
    """Whether the writer reported record ``seq`` written (fsynced)."""
    log.poll()
    return log.durable(seq, synced)


def test_fsync_always_syncs_every_record(tmp_path):
    log, _ = open_log(tmp_path, fsync="always")
    seq = log.append("register", {"partition": "p", "task": "a"})
    assert wait_for(lambda: reported(log, seq, synced=True))
    assert log.synced == log.written == seq
    log.close()


def test_records_nobody_waits_for_are_reported_and_written_in_order(tmp_path):
    log, _ = open_log(tmp_path)
    seqs = [log.append("register", {"partition": "p", "task": t}, urgent=False) for t in "abc"]
    assert wait_for(lambda: reported(log, seqs[-1]))  # within log_writer.REPORT_S
    assert log.pending_bytes == 0
    log.close()
    _, bodies = open_log(tmp_path)
    assert [b["task"] for b in bodies] == ["a", "b", "c"]


@pytest.mark.parametrize("remote_reads", [True, False])
def test_many_small_records_and_a_large_one_replay_in_order(tmp_path, remote_reads):
    # the large record (2.4 MB) is written in WRITE_CHUNK slices, read from this process's
    # memory by the writer where the OS allows it, else sent through the socket
    log, _ = open_log(tmp_path, remote_reads=remote_reads)
    for i in range(200):
        keys = [f"k-{i}"]
        length = 300_000 if i == 100 else 4
        log.append(
            "put",
            {"partition": "p", "keys": keys, "fields": {"ids": ids_field(keys, length)}},
            urgent=False,
        )
    log.close()
    log, bodies = open_log(tmp_path)
    log.close()
    assert [b["keys"] for b in bodies] == [[f"k-{i}"] for i in range(200)]
    assert bodies[100]["fields"]["ids"].values.tolist() == [100] * 300_000


def test_the_writer_reads_large_frames_from_the_server_and_they_are_held_until_written(tmp_path):
    log, _ = open_log(tmp_path)
    if not log._remote:
        log.close()
        pytest.skip("process_vm_readv is not allowed here: frames go through the socket")
    keys = ["k-1"]
    seq = log.append(
        "put", {"partition": "p", "keys": keys, "fields": {"ids": ids_field(keys, 10**5)}}
    )
    assert len(log._held) == 1
    assert wait_for(lambda: reported(log, seq))
    assert not log._held
    log.close()
    log, bodies = open_log(tmp_path)
    log.close()
    assert bodies[0]["fields"]["ids"].values.tolist() == [1] * 10**5


def test_a_record_whose_head_was_not_written_yet_is_torn(tmp_path):
    # a large record's payload is written before its head: a crash in between leaves zeros
    log, _ = open_log(tmp_path)
    log.append("register", {"partition": "p", "task": "a"})
    keys = ["k-2"]
    log.append("put", {"partition": "p", "keys": keys, "fields": {"ids": ids_field(keys, 10**5)}})
    log.close()
    ((_, path),) = log_files(str(tmp_path))
    (first, _), (second, _) = list(read_records(path))
    with open(path, "r+b") as f:
        f.seek(first)
        f.write(bytes(16))
    log, bodies = open_log(tmp_path)
    log.close()
    assert [b["op"] for b in bodies] == ["register"]
    assert os.path.getsize(path) == first


def test_writev_all_slices_large_buffers_and_resumes_short_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(log_writer, "WRITE_CHUNK", 4096)
    calls = []
    real = os.writev

    def short_writev(fd, buffers):
        calls.append(sum(memoryview(b).nbytes for b in buffers))
        return real(fd, buffers[:1]) if len(buffers) > 1 else real(fd, buffers)

    monkeypatch.setattr(os, "writev", short_writev)
    data = [bytes(range(256)) * 40, b"x" * 10, os.urandom(9000)]
    path = tmp_path / "out"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    log_writer.writev_all(fd, data)
    os.close(fd)
    assert path.read_bytes() == b"".join(data)
    assert max(calls) <= 4096


def build_store(records):
    store = SampleStore(1 << 24)

    def apply(body):
        op = body["op"]
        if op == "put":
            store.put(body["partition"], body["keys"], body["fields"])
        elif op in ("ack", "consumed"):
            store.consume(body["partition"], body["task"], body["keys"])
        elif op == "register":
            store.register(body["partition"], body["task"])
        elif op == "clear":
            store.clear(body["partition"], body.get("keys"))
        elif op == "tombstones":
            store.restore_tombstones(body["partition"], body["hashes"], body["dropped"])

    for body in records:
        apply(body)
    return store, apply


def state_of(store):
    out = {}
    for name in store.list()["partitions"]:
        keys = store.list(name)["keys"]
        got = store.get(name, keys) if keys else None
        out[name] = {
            "keys": keys,
            "ids": got.fields["ids"].values.tolist() if got else [],
            "status": {t: store.status(name, t) for t in ("a", "b")},
        }
    return out


@pytest.mark.parametrize("remote_reads", [True, False])
def test_compaction_writes_a_snapshot_that_rebuilds_the_same_store(tmp_path, remote_reads):
    store = SampleStore(1 << 26)
    log, _ = open_log(tmp_path, remote_reads=remote_reads)
    store.register("p", "a")
    log.append("register", {"partition": "p", "task": "a"})
    keys = [f"k-{i}" for i in range(10)]  # 400 KB: the snapshot has a large frame
    store.put("p", keys, {"ids": ids_field(keys, 5000)})
    log.append("put", {"partition": "p", "keys": keys, "fields": {"ids": ids_field(keys, 5000)}})
    batch = store.claim("p", "a", ["ids"], 4, lease_s=10)
    store.ack("p", "a", batch.lease_id)  # retention drops k-0..k-3
    log.append("ack", {"partition": "p", "task": "a", "keys": batch.keys})
    store.consume("q", "b", [])
    store.put("q", ["k-20"], {"ids": ids_field(["k-20"])})
    store.consume("q", "b", ["k-20"])  # q has no registered task: kept, consumed by b
    log.append("put", {"partition": "q", "keys": ["k-20"], "fields": {"ids": ids_field(["k-20"])}})
    log.append("consumed", {"partition": "q", "task": "b", "keys": ["k-20"]})
    store.clear("p", ["k-9"])
    log.append("clear", {"partition": "p", "keys": ["k-9"]})
    before = state_of(store)

    from services.queue.durable import encode_record

    log.compact([encode_record(op, body) for op, body in store.export_state()])
    log.append("register", {"partition": "p", "task": "b"})
    store.register("p", "b")
    log.close()
    assert log.compactions == 1 and [g for g, _ in log_files(str(tmp_path))] == [2]

    log2, bodies = open_log(tmp_path)
    log2.close()
    rebuilt, _ = build_store(bodies)
    assert state_of(rebuilt) == state_of(store)
    assert before["p"]["keys"] == [f"k-{i}" for i in range(4, 9)]
    # the dropped keys are still refused as consumed after the snapshot
    again = rebuilt.put("p", ["k-0", "k-9"], {"ids": ids_field(["k-0", "k-9"])})
    assert again.consumed == 1 and again.new_samples == 1
