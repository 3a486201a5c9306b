"""Logit ring over cuda_ipc: teacher and trainer in separate processes, on one GPU and on two."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import struct
import time

import msgpack
import pytest
import torch

from xtoken_core.ipc import LogitRingReader, LogitRingWriter, checksum_of
from xtoken_core.ipc.shm import SHM_DIR

pytestmark = pytest.mark.gpu

SHAPE = (2, 64, 1000)  # B, U, W
DTYPE = torch.bfloat16
# ~0.5 s of GPU time queued before each write, so the write lands long after publish returns:
# a reader that did not wait on the slot's event would read the slot's old bytes.
SLEEP_CYCLES = 1_000_000_000


def _expected(i: int, rows: int, length: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + i)
    return (torch.randn(rows, length, SHAPE[2], generator=g) * 10).to(DTYPE)


def _rows_length(i: int) -> tuple[int, int]:
    return 1 + i % SHAPE[0], SHAPE[1] - 3 * i


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().view(torch.int16)


def _cuda_writer(out, ctrl, device: int, batches: int, num_slots: int) -> None:
    """Child: a teacher on cuda:<device> that publishes without any host sync."""
    torch.cuda.set_device(device)
    ring = LogitRingWriter(
        transport="cuda_ipc",
        num_slots=num_slots,
        slot_shape=SHAPE,
        dtype=DTYPE,
        device=f"cuda:{device}",
        heartbeat_s=0.1,
    )
    # sources on the GPU up front: a blocking host-to-device copy in the loop would sync the
    # stream and hide a missing event wait
    sources = [_expected(i, *_rows_length(i)).to(f"cuda:{device}") for i in range(batches)]
    torch.cuda.synchronize()
    out.put(("descriptor", msgpack.packb(ring.descriptor)))
    for i, src in enumerate(sources):
        slot = ring.acquire(timeout_s=120)
        rows, length = _rows_length(i)
        torch.cuda._sleep(SLEEP_CYCLES)
        ring.buffer(slot)[:rows, :length].copy_(src)
        handle = ring.publish(slot, rows=rows, length=length, checksum=i == batches - 1)
        out.put(("handle", msgpack.packb(handle)))
    assert ctrl.get(timeout=300) == "close"
    ring.close()
    out.put(("closed", None))


def _cuda_reader(out, desc_bytes: bytes, handle_bytes: bytes) -> None:
    """Child: a trainer on its cuda:0 that views a slot, copies it to its GPU, releases it."""
    desc = msgpack.unpackb(desc_bytes, raw=False)
    handle = msgpack.unpackb(handle_bytes, raw=False)
    reader = LogitRingReader(device="cuda:0")
    view = reader.view(desc, handle)
    mine = view.to("cuda:0")
    reader.release(desc, handle)
    reader.close()
    out.put(
        {
            "view_device": str(view.device),
            "uuid": str(torch.cuda.get_device_properties(view.device).uuid),
            "bits": _bits(mine).numpy().tobytes(),
        }
    )


def _start_writer(device: int, batches: int, num_slots: int = 2):
    ctx = mp.get_context("spawn")
    out, ctrl = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_cuda_writer, args=(out, ctrl, device, batches, num_slots))
    proc.start()
    kind, payload = out.get(timeout=180)
    assert kind == "descriptor"
    return proc, out, ctrl, payload


def _next_handle(out) -> tuple[dict, bytes]:
    kind, payload = out.get(timeout=120)
    assert kind == "handle"
    return msgpack.unpackb(payload, raw=False), payload


def _stop_writer(proc, out, ctrl) -> None:
    ctrl.put("close")
    assert out.get(timeout=60) == ("closed", None)
    proc.join(timeout=60)
    assert proc.exitcode == 0


def _released(desc: dict, slot: int) -> int:
    """released_gen[slot], read from the header segment (layout: logit_ring module doc)."""
    with open(os.path.join(SHM_DIR, desc["header"]), "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        return struct.unpack_from("=q", mm, 8 * (16 + desc["num_slots"] + slot))[0]
    finally:
        mm.close()


def test_cuda_ring_in_one_process_views_the_written_buffer():
    with LogitRingWriter(
        transport="cuda_ipc", num_slots=2, slot_shape=SHAPE, dtype=DTYPE, device="cuda"
    ) as ring:
        slot = ring.acquire()
        rows, length = _rows_length(1)
        buffer = ring.buffer(slot)
        buffer[:rows, :length] = _expected(1, rows, length).cuda()
        handle = ring.publish(slot, rows=rows, length=length, checksum=True)
        with LogitRingReader() as reader:
            view = reader.view(ring.descriptor, handle)
            assert view.data_ptr() == buffer.data_ptr()  # the same memory, not a copy
            assert torch.equal(_bits(view), _bits(_expected(1, rows, length)))
            assert reader.verify(view, handle)
            reader.release(ring.descriptor, handle)
            deadline = time.monotonic() + 10
            while ring.in_flight() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert ring.in_flight() == []


def test_cuda_ring_across_processes_on_one_gpu_is_bitwise_equal_without_host_syncs():
    batches = 4
    proc, out, ctrl, desc_bytes = _start_writer(0, batches)
    desc = msgpack.unpackb(desc_bytes, raw=False)
    reader = LogitRingReader(device="cuda:0")
    try:
        for i in range(batches):
            handle, _ = _next_handle(out)
            view = reader.view(desc, handle)
            rows, length = _rows_length(i)
            assert view.shape == (rows, length, SHAPE[2]) and view.device == torch.device("cuda:0")
            got = view.clone()  # queued behind the wait on the teacher's event
            if i == 1:
                # release is deferred until the work queued on our stream is done
                torch.cuda._sleep(SLEEP_CYCLES)
                late = view.clone()
                reader.release(desc, handle)
                assert _released(desc, handle["slot"]) < handle["generation"]
                torch.cuda.synchronize()
                assert torch.equal(_bits(late), _bits(_expected(i, rows, length)))
                deadline = time.monotonic() + 10
                while _released(desc, handle["slot"]) != handle["generation"]:
                    assert time.monotonic() < deadline, "release never landed"
                    time.sleep(0.01)
            else:
                reader.release(desc, handle)
            assert torch.equal(_bits(got), _bits(_expected(i, rows, length)))
            if "checksum" in handle:
                assert reader.verify(got, handle)
        reader.close()
        _stop_writer(proc, out, ctrl)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_ring_across_two_gpus_is_bitwise_equal_whatever_the_device_numbering():
    proc, out, ctrl, desc_bytes = _start_writer(1, batches=2)
    desc = msgpack.unpackb(desc_bytes, raw=False)
    ctx = mp.get_context("spawn")
    try:
        # the trainer here: the slot lives on cuda:1, the trainer computes on cuda:0
        reader = LogitRingReader(device="cuda:0")
        handle, _ = _next_handle(out)
        view = reader.view(desc, handle)
        assert view.device == torch.device("cuda:1")
        mine = view.to("cuda:0")
        reader.release(desc, handle)
        rows, length = _rows_length(0)
        assert torch.equal(_bits(mine), _bits(_expected(0, rows, length)))
        reader.close()
        # a trainer that sees the GPUs the other way round (CUDA_VISIBLE_DEVICES=1,0): the
        # teacher's GPU is its cuda:0, found by uuid
        handle, handle_bytes = _next_handle(out)
        results = ctx.Queue()
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = "1,0"
        try:
            child = ctx.Process(target=_cuda_reader, args=(results, desc_bytes, handle_bytes))
            child.start()
        finally:
            if saved is None:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
        got = results.get(timeout=180)
        child.join(timeout=60)
        assert child.exitcode == 0
        assert got["view_device"] == "cuda:0"
        assert got["uuid"] == str(torch.cuda.get_device_properties(1).uuid)
        rows, length = _rows_length(1)
        expected = _expected(1, rows, length)
        assert got["bits"] == _bits(expected).numpy().tobytes()
        assert checksum_of(expected) == handle["checksum"]
        _stop_writer(proc, out, ctrl)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
