"""Shared-memory tensor handles: cross-process round trips, zero copy, adoption, validation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from xtoken_core.ipc import SHM_DIR, ShmReader, ShmSegment, ShmTensorHandle, write_tensors
from xtoken_core.ipc.shm import ShmRegion, open_handle, sweep_orphans
from xtoken_core.wire import JaggedColumn
from xtoken_core.wire.tensors import WIRE_DTYPES

# Child process: reads JSON handles on stdin, opens them, prints each tensor's bytes in hex
# (values, then offsets for jagged), whether it is a view of the mapping, and whether the
# segment name is gone; then, with "hold", waits to be killed.
CHILD = r"""
import json, os, sys, time
from xtoken_core.ipc import ShmReader
from xtoken_core.wire import JaggedColumn
req = json.loads(sys.stdin.readline())
reader = ShmReader()
out = []
for h in req["handles"]:
    t = reader.open(h)
    base = reader.segment(h["name"], h["size"])
    lo, hi = base.data_ptr(), base.data_ptr() + base.numel()
    parts = [t.values, t.offsets] if isinstance(t, JaggedColumn) else [t]
    out.append({
        "hex": [p.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes().hex()
                if p.numel() else "" for p in parts],
        "shape": list(parts[0].shape),
        "in_map": all(p.numel() == 0 or lo <= p.data_ptr() < hi for p in parts),
        "unlinked": not os.path.exists(os.path.join("/dev/shm", h["name"])),
    })
print(json.dumps(out), flush=True)
if req.get("hold"):
    time.sleep(60)
"""


def _child(handles, hold=False):
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    proc.stdin.write(json.dumps({"handles": handles, "hold": hold}) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    assert line, f"child exited with {proc.wait()}"
    return proc, json.loads(line)


def _hex(t: torch.Tensor) -> str:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes().hex() if t.numel() else ""


def _sample(dtype: torch.dtype, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(str(dtype)) % 1000)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=g).to(
        dtype
    )


def test_every_dtype_jagged_and_zero_size_round_trip_to_another_process_and_get_adopted():
    tensors = [_sample(dtype, (3, 5)) for dtype in WIRE_DTYPES.values()]
    tensors += [
        torch.empty(0, 4, dtype=torch.float32),  # zero-size
        torch.tensor(7, dtype=torch.int64),  # 0-d
        JaggedColumn.from_rows([torch.randn(2, 3), torch.randn(0, 3), torch.randn(5, 3)]),
        JaggedColumn.from_rows([], dtype=torch.int32),  # N = 0
    ]
    segment, handles = write_tensors(tensors)
    segment.close()
    proc, out = _child([h.to_dict() for h in handles])
    assert proc.wait(timeout=30) == 0
    assert len(out) == len(tensors)
    for t, got in zip(tensors, out):
        parts = [t.values, t.offsets] if isinstance(t, JaggedColumn) else [t]
        assert got["hex"] == [_hex(p) for p in parts]
        assert got["shape"] == list(parts[0].shape)
        assert got["in_map"] and got["unlinked"]
    assert not os.path.exists(os.path.join(SHM_DIR, segment.name))
    segment.unlink()  # idempotent after the consumer adopted it


def test_no_segment_left_after_the_consumer_is_sigkilled():
    segment, handles = write_tensors([torch.arange(1000)])
    segment.close()
    path = os.path.join(SHM_DIR, segment.name)
    assert os.path.exists(path)
    proc, out = _child([h.to_dict() for h in handles], hold=True)
    assert out[0]["unlinked"]
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert not os.path.exists(path)
    segment.unlink()


def test_open_is_zero_copy_and_shares_writes_with_the_producer():
    segment = ShmSegment.create(ShmSegment.layout_bytes([4 * 8]))
    handle = segment.write(torch.zeros(4, dtype=torch.int64))
    opened = open_handle(handle.to_dict(), unlink=False)
    opened[2] = 42  # the consumer's tensor is the mapping itself
    producer_view = segment.view(handle.offset, torch.int64, (4,))
    assert producer_view.tolist() == [0, 0, 42, 0]
    del producer_view
    segment.close()
    segment.unlink()


def test_tensors_outlive_the_producer_and_the_mapping_goes_with_the_last_view():
    segment, (handle,) = write_tensors([torch.arange(10, dtype=torch.float64)])
    segment.close()
    t = ShmReader().open(handle)
    segment.unlink()
    assert t.tolist() == list(range(10))

    def mapped() -> bool:
        with open("/proc/self/maps") as f:
            return segment.name in f.read()

    assert mapped()
    view = t[3:]
    del t
    assert mapped() and view[0].item() == 3.0
    del view
    assert not mapped()


def test_one_reader_maps_a_segment_once_for_many_handles():
    segment, handles = write_tensors([torch.arange(3), torch.ones(2, 2)])
    segment.close()
    reader = ShmReader()
    a, b = (reader.open(h) for h in handles)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert a.untyped_storage().nbytes() == segment.size  # accounting sees the whole segment


def _valid() -> tuple[ShmSegment, dict]:
    segment = ShmSegment.create(256)
    handle = segment.write(torch.arange(4, dtype=torch.int32))
    return segment, handle.to_dict()


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.update(name="../../etc/passwd"), "not an xtoken segment"),
        (lambda d: d.update(name="xtk_1_zz"), "not an xtoken segment"),
        (lambda d: d.update(name=5), "not an xtoken segment"),
        (lambda d: d.update(kind="pickle"), "not a shm tensor handle"),
        (lambda d: d.pop("offset"), "misses"),
        (lambda d: d.update(size=512), "bytes, the handle says 512"),
        (lambda d: d.update(offset=256), "outside"),
        (lambda d: d.update(offset=2), "outside|multiple"),
        (lambda d: d.update(offset=-8), "outside"),
        (lambda d: d.update(nbytes=12), "nbytes"),
        (lambda d: d.update(dtype="object"), "not a wire dtype"),
        (lambda d: d.update(shape=[-4]), "non-negative"),
        (lambda d: d.update(shape="4"), "list"),
        (lambda d: d.update(shape=[1] * 40), "list"),
        (lambda d: d.update(size=True), "size"),
        (lambda d: d.update(offsets={"offset": 240, "num_rows": 4}), "outside"),
        (lambda d: d.update(offsets={"offset": 64}), "offsets must be"),
        (lambda d: d.update(num_rows=3), None),  # unknown keys are ignored
    ],
)
def test_bad_handles_raise_value_error_naming_the_problem(mutate, match):
    segment, d = _valid()
    segment.close()
    mutate(d)
    try:
        if match is None:
            assert open_handle(d, unlink=False).tolist() == [0, 1, 2, 3]
        else:
            with pytest.raises(ValueError, match=match):
                open_handle(d, unlink=False)
    finally:
        segment.unlink()


@pytest.mark.parametrize("garbage", [None, 3, "shm", [], {"kind": "shm"}, b"\x00" * 8])
def test_garbage_is_refused_before_any_file_is_touched(garbage):
    with pytest.raises(ValueError):
        ShmTensorHandle.from_dict(garbage)


def test_missing_segment_and_symlinks_are_refused(tmp_path):
    segment, d = _valid()
    segment.close()
    segment.unlink()
    with pytest.raises(ValueError, match="does not exist"):
        open_handle(d)
    target = tmp_path / "secret"
    target.write_bytes(b"\x00" * 256)
    os.symlink(target, os.path.join(SHM_DIR, d["name"]))
    try:
        with pytest.raises(ValueError, match="cannot be opened"):
            open_handle(d)
    finally:
        os.unlink(os.path.join(SHM_DIR, d["name"]))


def test_corrupt_jagged_offsets_and_bool_bytes_are_refused():
    col = JaggedColumn.from_rows([torch.arange(3), torch.arange(2)])
    segment, (jag, flags) = write_tensors([col, torch.tensor([True, False])])
    segment.view(jag.offsets_at, torch.int64, (3,))[1] = 9  # 0, 9, 5: decreasing
    segment.view(flags.offset, torch.uint8, (2,))[0] = 2
    segment.close()
    reader = ShmReader(unlink=False)
    with pytest.raises(ValueError, match="jagged offsets"):
        reader.open(jag.to_dict())
    with pytest.raises(ValueError, match="bool"):
        reader.open(flags.to_dict())
    segment.unlink()


def test_a_full_segment_refuses_more_data_and_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="nbytes"):
        ShmSegment.create(-1)
    with ShmSegment.create(64) as segment:
        segment.write(torch.zeros(16, dtype=torch.int32))
        with pytest.raises(ValueError, match="no room"):
            segment.write(torch.zeros(1))
    assert not os.path.exists(os.path.join(SHM_DIR, segment.name))


def test_sweep_removes_old_segments_of_dead_processes_only():
    dead = os.path.join(SHM_DIR, "xtk_4194305_0123456789abcdef")  # above PID_MAX_LIMIT
    mine = os.path.join(SHM_DIR, f"xtk_{os.getpid()}_0123456789abcdef")
    young = os.path.join(SHM_DIR, "xtk_4194305_fedcba9876543210")
    for p in (dead, mine, young):
        with open(p, "wb") as f:
            f.write(b"x")
    old = time.time() - 3600
    os.utime(dead, (old, old))
    os.utime(mine, (old, old))
    try:
        removed = sweep_orphans(min_age_s=60)
        assert os.path.basename(dead) in removed
        assert not os.path.exists(dead)
        assert os.path.exists(mine) and os.path.exists(young)
    finally:
        for p in (dead, mine, young):
            if os.path.exists(p):
                os.unlink(p)


def test_a_caching_reader_maps_each_segment_once_keeps_the_newest_and_never_unlinks():
    segments = [ShmSegment.create(4096) for _ in range(3)]
    try:
        for i, seg in enumerate(segments):
            seg.write(torch.full((4,), i, dtype=torch.int64))
        reader = ShmReader(unlink=False, max_cached=2)
        handles = [ShmTensorHandle(s.name, s.size, 0, 32, torch.int64, (4,)) for s in segments]
        first = reader.open(handles[0])
        assert reader.open(handles[0]).data_ptr() == first.data_ptr()  # one mapping
        reader.open(handles[1])
        reader.open(handles[2])  # evicts segment 0's mapping, not the tensor viewing it
        assert list(reader._maps) == [segments[1].name, segments[2].name]
        assert first.tolist() == [0, 0, 0, 0] and reader.owns(reader.open(handles[2]))
        assert not reader.owns(first) and not reader.owns(torch.zeros(4))
        assert all(os.path.exists(os.path.join(SHM_DIR, s.name)) for s in segments)
        assert reader.refs == []  # only references into known segments are recorded
        with pytest.raises(ValueError, match="max_cached"):
            ShmReader(max_cached=0)
    finally:
        for seg in segments:
            seg.unlink()


def test_a_region_hands_out_aligned_tensors_inside_its_bounds_only():
    seg = ShmSegment.create(4096)
    try:
        base_S = seg.base()
        region = ShmRegion(seg.name, seg.size, base_S, 1024, 1024, "tok")
        a = region.empty((10,), torch.int64)
        b = region.empty((3, 5), torch.bfloat16)
        assert region.locate(a) == 1024 and region.locate(b) == 1024 + 128
        assert region.locate(torch.zeros(3)) is None
        assert region.locate(base_S[0:8]) is None  # in the segment, not in the region
        assert region.locate(b.t()) is None  # not contiguous: copied
        handle = region.write(torch.arange(6, dtype=torch.int32))
        assert handle.offset == 1024 + 192 and handle.offset % 64 == 0
        assert base_S[handle.offset : handle.offset + 24].view(torch.int32).tolist() == list(
            range(6)
        )
        with pytest.raises(ValueError, match="no room"):
            region.empty((1024,), torch.float32)
        with pytest.raises(ValueError, match="outside segment"):
            ShmRegion(seg.name, seg.size, base_S, 4032, 128)
        with pytest.raises(ValueError, match="cannot go into shm"):
            region.empty((2,), torch.complex64)
        del a, b, base_S, region
    finally:
        seg.unlink()


def test_segments_are_created_mode_0600_whatever_the_umask():
    old = os.umask(0)
    try:
        with ShmSegment.create(64) as seg:
            mode = os.stat(os.path.join(SHM_DIR, seg.name)).st_mode & 0o777
    finally:
        os.umask(old)
    assert mode == 0o600


def test_a_known_only_reader_refuses_any_other_segment_without_touching_it():
    with ShmSegment.create(64) as mine, ShmSegment.create(64) as other:
        reader = ShmReader(unlink=True, segments={mine.name: mine.base()}, known_only=True)
        assert reader.open(ShmTensorHandle(mine.name, mine.size, 0, 32, torch.int64, (4,))).numel()
        with pytest.raises(ValueError, match="not lent by this server"):
            reader.open(ShmTensorHandle(other.name, other.size, 0, 32, torch.int64, (4,)))
        assert os.path.exists(os.path.join(SHM_DIR, other.name))
        assert reader.refs == [(mine.name, 0, 32)]
        del reader  # holds a view of ``mine``: drop it before the segment closes


READ_ONLY_CHILD = r"""
import sys, torch
from xtoken_core.ipc import ShmReader, ShmTensorHandle
reader = ShmReader(unlink=False, writable=False)
t = reader.open(ShmTensorHandle(sys.argv[1], int(sys.argv[2]), 0, 32, torch.int64, (4,)))
print(t.tolist(), flush=True)
t.fill_(0)
print("wrote", flush=True)
"""


def test_a_read_only_reader_maps_views_that_cannot_be_written():
    with ShmSegment.create(64) as seg:
        seg.view(0, torch.int64, (4,)).copy_(torch.arange(4))
        proc = subprocess.run(
            [sys.executable, "-W", "error", "-c", READ_ONLY_CHILD, seg.name, str(seg.size)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.stdout.splitlines()[:1] == ["[0, 1, 2, 3]"], proc.stderr  # no warning raised
        assert "wrote" not in proc.stdout and proc.returncode == -signal.SIGSEGV, proc.stderr
        assert seg.view(0, torch.int64, (4,)).tolist() == [0, 1, 2, 3]
        assert os.path.exists(os.path.join(SHM_DIR, seg.name))
