"""Logit ring over shm: a writer and a reader in real processes, stale handles, bad input."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import queue
import signal
import struct
import threading
import time

import msgpack
import pytest
import torch

from xtoken_core.ipc import (
    LogitRingReader,
    LogitRingWriter,
    StaleHandleError,
    checksum_of,
    ring_format,
)
from xtoken_core.ipc.shm import NAME_RE, SHM_DIR

SHAPE = (3, 7, 11)  # B, U, W
DTYPE = torch.bfloat16


def _logits(i: int, rows: int, length: int, width: int = SHAPE[2], dtype=DTYPE) -> torch.Tensor:
    """Batch ``i``'s logits ``[rows, length, width]``: the same bits in every process."""
    g = torch.Generator().manual_seed(1000 + i)
    return (torch.randn(rows, length, width, generator=g) * 10).to(dtype)


def _rows_length(i: int) -> tuple[int, int]:
    return 1 + i % SHAPE[0], 2 + i % (SHAPE[1] - 1)


def _writer_main(out, ctrl, batches: int, num_slots: int, heartbeat_s: float) -> None:
    """Child: a teacher writing ``batches`` batches; then waits for "close" (or a SIGKILL)."""
    ring = LogitRingWriter(
        transport="shm",
        num_slots=num_slots,
        slot_shape=SHAPE,
        dtype=DTYPE,
        heartbeat_s=heartbeat_s,
    )
    out.put(("descriptor", msgpack.packb(ring.descriptor)))
    for i in range(batches):
        slot = ring.acquire(timeout_s=60)
        rows, length = _rows_length(i)
        ring.buffer(slot)[:rows, :length] = _logits(i, rows, length)
        handle = ring.publish(slot, rows=rows, length=length, checksum=True)
        out.put(("handle", msgpack.packb(handle)))
    assert ctrl.get(timeout=120) == "close"
    ring.close()
    out.put(("closed", None))


def _start_writer(batches: int, *, num_slots: int = 2, heartbeat_s: float = 0.5):
    ctx = mp.get_context("spawn")
    out, ctrl = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_writer_main, args=(out, ctrl, batches, num_slots, heartbeat_s))
    proc.start()
    kind, payload = out.get(timeout=120)
    assert kind == "descriptor"
    return proc, out, ctrl, msgpack.unpackb(payload, raw=False)


def _next_handle(out, timeout: float = 30.0) -> dict:
    kind, payload = out.get(timeout=timeout)
    assert kind == "handle"
    return msgpack.unpackb(payload, raw=False)


def _exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


@pytest.fixture
def ring():
    writer = LogitRingWriter(
        transport="shm", num_slots=2, slot_shape=SHAPE, dtype=DTYPE, heartbeat_s=0.05
    )
    yield writer
    writer.close()


def _publish(writer: LogitRingWriter, i: int, **kw) -> dict:
    slot = writer.acquire(timeout_s=5)
    rows, length = _rows_length(i)
    writer.buffer(slot)[:rows, :length] = _logits(i, rows, length)
    return writer.publish(slot, rows=rows, length=length, **kw)


def test_reader_process_sees_every_batch_bitwise_and_the_writer_waits_for_releases():
    batches = 5
    proc, out, ctrl, desc = _start_writer(batches, num_slots=2)
    reader = LogitRingReader()
    try:
        first = [_next_handle(out), _next_handle(out)]
        # both slots are published and unreleased: the writer must be blocked in acquire
        with pytest.raises(queue.Empty):
            out.get(timeout=0.5)
        views = [reader.view(desc, h) for h in first]
        for i, (h, v) in enumerate(zip(first, views)):
            rows, length = _rows_length(i)
            assert v.shape == (rows, length, SHAPE[2]) and v.dtype == DTYPE
            assert torch.equal(v.view(torch.int16), _logits(i, rows, length).view(torch.int16))
            assert reader.verify(v, h)
        # zero copy: the same slot viewed again is the same memory
        assert reader.view(desc, first[1]).data_ptr() == views[1].data_ptr()
        reader.release(desc, first[0])
        third = _next_handle(out)  # the writer resumed on the release
        assert third["slot"] == first[0]["slot"] and third["generation"] == 2
        with pytest.raises(StaleHandleError, match="overwritten"):
            reader.view(desc, first[0])
        reader.release(desc, first[1])
        pending = [third]
        for i in range(2, batches):
            h = pending.pop(0)
            v = reader.view(desc, h)
            rows, length = _rows_length(i)
            assert torch.equal(v.view(torch.int16), _logits(i, rows, length).view(torch.int16))
            assert reader.verify(v, h)
            reader.release(desc, h)
            if i + 1 < batches:
                pending.append(_next_handle(out))
        ctrl.put("close")
        assert out.get(timeout=30) == ("closed", None)
        proc.join(timeout=30)
        assert proc.exitcode == 0
        assert not _exists(desc["header"]) and not _exists(desc["data"])
    finally:
        reader.close()
        if proc.is_alive():
            proc.kill()
            proc.join()


def test_sigkilled_writer_makes_its_handles_stale_within_dead_after_s():
    dead_after_s = 1.0
    proc, out, ctrl, desc = _start_writer(1, heartbeat_s=0.05)
    reader = LogitRingReader(dead_after_s=dead_after_s)
    try:
        handle = _next_handle(out)
        view = reader.view(desc, handle)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=30)
        killed = time.monotonic()
        while True:
            try:
                reader.check(desc, handle)
            except StaleHandleError as e:
                assert "heartbeat" in str(e) and "dead_after_s" in str(e)
                break
            assert time.monotonic() - killed < dead_after_s + 1.0, "handle still valid"
            time.sleep(0.02)
        assert time.monotonic() - killed <= dead_after_s + 0.5
        with pytest.raises(StaleHandleError):
            reader.view(desc, handle)
        with pytest.raises(StaleHandleError):  # a restarted trainer: the same answer
            LogitRingReader(dead_after_s=dead_after_s).view(desc, handle)
        reader.release(desc, handle)  # a stale release is a no-op, never an error
        rows, length = _rows_length(0)  # a view taken before the kill stays readable
        assert torch.equal(view.view(torch.int16), _logits(0, rows, length).view(torch.int16))
        # the dead teacher's segments are named for its pid: sweep_orphans removes them
        for name in (desc["header"], desc["data"]):
            assert NAME_RE.fullmatch(name).group(1) == str(proc.pid)
            assert _exists(name)
    finally:
        reader.close()
        for name in (desc["header"], desc["data"]):
            if _exists(name):
                os.unlink(os.path.join(SHM_DIR, name))
        if proc.is_alive():
            proc.kill()
            proc.join()


def test_a_restarted_reader_maps_the_ring_again(ring):
    desc = msgpack.unpackb(msgpack.packb(ring.descriptor), raw=False)
    handle = _publish(ring, 0)
    first = LogitRingReader()
    before = first.view(desc, handle).clone()
    first.close()  # the trainer died before releasing: the ring must stay mappable
    assert _exists(desc["header"]) and _exists(desc["data"])
    second = LogitRingReader()
    assert torch.equal(second.view(desc, handle).view(torch.int16), before.view(torch.int16))
    second.release(desc, handle)
    assert ring.in_flight() == []
    second.close()


def test_a_handle_is_stale_after_release_and_when_its_generation_is_not_current(ring):
    desc = ring.descriptor
    reader = LogitRingReader()
    handle = _publish(ring, 0)
    with pytest.raises(StaleHandleError, match="never published"):
        reader.view(desc, {**handle, "generation": handle["generation"] + 1})
    reader.view(desc, handle)
    reader.release(desc, handle)
    reader.release(desc, handle)  # twice: a no-op
    with pytest.raises(StaleHandleError, match="already released"):
        reader.view(desc, handle)
    for i in (1, 2):  # slot 1, then slot 0 again
        _publish(ring, i)
    with pytest.raises(StaleHandleError, match="overwritten"):
        reader.check(desc, handle)
    reader.close()


def test_a_handle_of_another_ring_instance_is_stale(ring):
    with LogitRingWriter(transport="shm", num_slots=2, slot_shape=SHAPE, dtype=DTYPE) as other:
        handle = _publish(other, 0)
        with LogitRingReader() as reader:
            with pytest.raises(StaleHandleError, match="earlier teacher"):
                reader.view(ring.descriptor, handle)


def test_closing_the_writer_makes_handles_stale_and_unlinks_its_segments():
    writer = LogitRingWriter(transport="shm", num_slots=2, slot_shape=SHAPE, dtype=DTYPE)
    desc = writer.descriptor
    handle = _publish(writer, 0)
    mapped = LogitRingReader()
    view = mapped.view(desc, handle)
    writer.close()
    writer.close()  # idempotent
    assert not _exists(desc["header"]) and not _exists(desc["data"])
    with pytest.raises(StaleHandleError, match="closed"):
        mapped.view(desc, handle)  # mapped before: sees the closed flag
    with pytest.raises(StaleHandleError, match="gone"):
        LogitRingReader().view(desc, handle)  # never mapped: the header is gone
    rows, length = _rows_length(0)
    assert torch.equal(view.view(torch.int16), _logits(0, rows, length).view(torch.int16))
    with pytest.raises(ValueError, match="closed"):
        writer.acquire()
    mapped.close()


def _descriptor_cases():
    cases = [
        ("kind", "x", "'kind'"),
        ("version", 2, "'version'"),
        ("transport", "nccl", "'transport'"),
        ("instance", -1, "'instance'"),
        ("instance", "7", "'instance'"),
        ("pid", 0, "'pid'"),
        ("header", "../../etc/passwd", "'header'"),
        ("num_slots", 1, "'num_slots'"),
        ("num_slots", 3, "num_slots"),  # disagrees with the header
        ("slot_shape", [3, 7], "'slot_shape'"),
        ("slot_shape", [3, 0, 11], "'slot_shape'"),
        ("dtype", "complex64", "'dtype'"),
        ("data", "not-a-segment", "'data'"),
        ("heartbeat_s", 0, "'heartbeat_s'"),
    ]
    return pytest.mark.parametrize("field, value, match", cases)


@_descriptor_cases()
def test_a_garbage_descriptor_raises_value_error_naming_the_field(ring, field, value, match):
    handle = _publish(ring, 0)
    with LogitRingReader() as reader:
        with pytest.raises(ValueError, match=match):
            reader.view({**ring.descriptor, field: value}, handle)


def test_a_descriptor_that_is_not_a_dict_or_misses_fields_raises_value_error(ring):
    handle = _publish(ring, 0)
    desc = dict(ring.descriptor)
    del desc["header"]
    with LogitRingReader() as reader:
        with pytest.raises(ValueError, match="misses field.*header"):
            reader.view(desc, handle)
        with pytest.raises(ValueError, match="must be a dict"):
            reader.check([1, 2], handle)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("header", None, "instance"),
        ("data", None, "data tag"),
        ("slot_shape", [3, 7, 12], "W="),
        ("dtype", "float16", "dtype="),
        ("pid", 1, "pid="),
    ],
)
def test_a_descriptor_that_disagrees_with_the_header_raises_value_error(ring, field, value, match):
    with LogitRingWriter(transport="shm", num_slots=2, slot_shape=SHAPE, dtype=DTYPE) as other:
        handle = _publish(ring, 0)
        forged = {**ring.descriptor, field: other.descriptor[field] if value is None else value}
        with LogitRingReader() as reader:
            with pytest.raises(ValueError, match=match):
                reader.view(forged, handle)


@pytest.mark.parametrize(
    "field, value",
    [
        ("slot", 2),
        ("slot", -1),
        ("generation", 0),
        ("generation", "1"),
        ("rows", 0),
        ("rows", SHAPE[0] + 1),
        ("rows", True),
        ("length", SHAPE[1] + 1),
        ("width", SHAPE[2] + 1),
        ("instance", None),
        ("checksum", 1.5),
    ],
)
def test_a_garbage_handle_raises_value_error_naming_the_field(ring, field, value):
    handle = _publish(ring, 0)
    with LogitRingReader() as reader:
        with pytest.raises(ValueError, match=f"'{field}'"):
            reader.view(ring.descriptor, {**handle, field: value})
        with pytest.raises(ValueError, match=f"'{field}'"):
            reader.release(ring.descriptor, {**handle, field: value})
        reader.view(ring.descriptor, handle)  # the good handle still works


def test_a_handle_missing_a_field_raises_value_error(ring):
    handle = _publish(ring, 0)
    del handle["generation"]
    with LogitRingReader() as reader, pytest.raises(ValueError, match="generation"):
        reader.view(ring.descriptor, handle)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"transport": "tcp"}, "transport"),
        ({"num_slots": 1}, "num_slots"),
        ({"slot_shape": (3, 0, 11)}, "slot_shape"),
        ({"slot_shape": (3, 7)}, "slot_shape"),
        ({"dtype": torch.complex64}, "dtype"),
        ({"device": "cuda"}, "shm transport keeps logits"),
        ({"heartbeat_s": 0}, "heartbeat_s"),
    ],
)
def test_bad_writer_arguments_raise_value_error(kwargs, match):
    args = {"transport": "shm", "num_slots": 2, "slot_shape": SHAPE, "dtype": DTYPE, **kwargs}
    with pytest.raises(ValueError, match=match):
        LogitRingWriter(**args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_ipc_without_cuda_raises_value_error():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        LogitRingWriter(
            transport="cuda_ipc", num_slots=2, slot_shape=SHAPE, dtype=DTYPE, device="cuda"
        )


def test_acquire_times_out_naming_the_setting_and_stops_on_the_stop_event(ring):
    _publish(ring, 0)
    _publish(ring, 1)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="timeout_s=0.2"):
        ring.acquire(timeout_s=0.2)
    assert 0.2 <= time.monotonic() - start < 2.0
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    with pytest.raises(InterruptedError, match="stop"):
        ring.acquire(stop=stop)


def test_a_blocked_acquire_resumes_when_another_thread_releases(ring):
    handles = [_publish(ring, 0), _publish(ring, 1)]
    reader = LogitRingReader()
    threading.Timer(0.2, reader.release, args=(ring.descriptor, handles[1])).start()
    start = time.monotonic()
    assert ring.acquire(timeout_s=10) == handles[1]["slot"]
    assert time.monotonic() - start >= 0.15
    reader.close()


def test_buffer_and_publish_refuse_a_slot_the_writer_does_not_hold(ring):
    with pytest.raises(ValueError, match="not held"):
        ring.buffer(0)
    slot = ring.acquire()
    with pytest.raises(ValueError, match="'rows'"):
        ring.publish(slot, rows=SHAPE[0] + 1, length=1)
    handle = ring.publish(slot, rows=1, length=1)
    with pytest.raises(ValueError, match="not held"):
        ring.publish(handle["slot"], rows=1, length=1)
    other = ring.acquire()
    ring.abandon(other)
    assert ring.acquire() == other


def test_header_layout_is_the_documented_words(ring):
    handle = _publish(ring, 0)
    desc = ring.descriptor
    S = desc["num_slots"]
    path = os.path.join(SHM_DIR, desc["header"])
    assert os.path.getsize(path) == 64 * -(-ring_format.header_bytes(S) // 64)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        words = 16 + 2 * S
        fixed = struct.unpack_from("=qqqqdqqqq8sqqqqqq", mm, 0)
        magic, version, instance, pid, beat, closed, slots, nwords, transport, dtype = fixed[:10]
        assert magic == 0x58544B52494E4731 and struct.pack(">q", magic) == b"XTKRING1"
        assert (version, instance, pid, closed, slots, nwords, transport) == (
            1,
            desc["instance"],
            os.getpid(),
            0,
            S,
            words,
            0,
        )
        assert dtype == b"bfloat16" and fixed[10:13] == SHAPE
        assert fixed[13] == int.from_bytes(bytes.fromhex(desc["data"][-16:]), "little", signed=True)
        assert fixed[14:] == (0, 0)
        assert abs(time.time() - beat) < 1.0
        time.sleep(0.3)  # heartbeat_s=0.05: the beat moves
        assert struct.unpack_from("=d", mm, 32)[0] > beat
        published = struct.unpack_from(f"={S}q", mm, 128)
        released = struct.unpack_from(f"={S}q", mm, 128 + 8 * S)
        assert published[handle["slot"]] == handle["generation"] == 1 and released == (0,) * S
        LogitRingReader().release(desc, handle)
        assert struct.unpack_from(f"={S}q", mm, 128 + 8 * S)[handle["slot"]] == 1
        ring.close()
        assert struct.unpack_from("=q", mm, 40)[0] == 1  # closed flag, still mapped here
    finally:
        mm.close()


def test_descriptor_and_handle_are_msgpack_round_trippable(ring):
    handle = _publish(ring, 0, checksum=True)
    for obj in (ring.descriptor, handle):
        assert msgpack.unpackb(msgpack.packb(obj), raw=False) == obj
    assert set(handle) == {"instance", "slot", "generation", "rows", "length", "width", "checksum"}


def test_verify_detects_a_changed_value_and_a_wrong_shape(ring):
    handle = _publish(ring, 0, checksum=True)
    reader = LogitRingReader()
    view = reader.view(ring.descriptor, handle)
    copy = view.clone()
    assert reader.verify(copy, handle)
    copy[0, 0, 0] = copy[0, 0, 0] + 1
    assert not reader.verify(copy, handle)
    assert not reader.verify(view[:, :1], handle)
    with pytest.raises(ValueError, match="checksum=True"):
        reader.verify(view, _publish(ring, 1))
    reader.close()


def test_checksum_is_the_same_for_any_layout_and_chunking(monkeypatch):
    x = _logits(3, 4, 9, width=13, dtype=torch.float32)
    strided = torch.empty(4, 12, 13)[:, :9]
    strided.copy_(x)
    small = checksum_of(x)
    assert checksum_of(strided) == small == checksum_of(x.to(torch.float32).clone())
    for chunk in (1, 5, 20, 200):
        monkeypatch.setattr(ring_format, "_CHECKSUM_CHUNK", chunk)
        assert checksum_of(strided) == small == checksum_of(x.flatten())
    y = x.clone()
    y.view(-1)[17] = torch.nextafter(y.view(-1)[17], torch.tensor(float("inf")))
    assert checksum_of(y) != small
