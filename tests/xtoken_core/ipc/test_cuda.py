"""CUDA IPC handles: checks on CPU; a spawned child reading a slot of the parent's GPU buffer."""

from __future__ import annotations

import os
import subprocess
import sys

import msgpack
import pytest
import torch

from xtoken_core.ipc import CudaIpcHandle

CHILD = r"""
import sys, msgpack, torch
from xtoken_core.ipc import CudaIpcHandle
d = msgpack.unpackb(bytes.fromhex(sys.stdin.readline().strip()), raw=False)
h = CudaIpcHandle.from_dict(d)
slot = h.open()
again = CudaIpcHandle.from_dict(d).open()  # second open: cached, same memory
assert slot.data_ptr() == again.data_ptr()
print(f"{slot.double().sum().item()!r} {list(slot.shape)} {slot.device}", flush=True)
slot[0] = -1.0  # the parent sees this write: same memory
torch.cuda.synchronize()
"""


def _fake(**over):
    d = {
        "kind": "cuda",
        "pid": 1,
        "device": 0,
        "handle": b"h" * 64,
        "storage_size": 4 * 8 * 16,
        "storage_offset": 0,
        "ref_counter_handle": b"/torch_1",
        "ref_counter_offset": 0,
        "event_handle": b"e" * 64,
        "event_sync_required": True,
        "dtype": "float32",
        "shape": [8, 16],
        "stride": [16, 1],
        "offset": 0,
        "index": None,
    }
    d.update(over)
    return d


def test_handle_dict_round_trips_through_msgpack_and_slots_narrow_it():
    h = CudaIpcHandle.from_dict(msgpack.unpackb(msgpack.packb(_fake()), raw=False))
    assert h.shape == (8, 16) and h.dtype == torch.float32 and h.index is None
    s = h.slot(3)
    assert s.index == 3 and CudaIpcHandle.from_dict(s.to_dict()) == s


@pytest.mark.parametrize(
    "over, match",
    [
        ({"kind": "shm"}, "not a CUDA IPC handle"),
        ({"handle": "str"}, "bytes"),
        ({"storage_size": -1}, "non-negative"),
        ({"dtype": "complex64"}, "wire dtype"),
        ({"shape": [8, 16], "stride": [1]}, "do not match"),
        ({"offset": 1}, "reaches past"),
        ({"shape": [9, 16]}, "reaches past"),
        ({"index": 8}, "outside"),
        ({"index": "0"}, "outside"),
    ],
)
def test_bad_cuda_handles_raise_value_error(over, match):
    with pytest.raises(ValueError, match=match):
        CudaIpcHandle.from_dict(_fake(**over))


def test_export_refuses_cpu_tensors():
    with pytest.raises(ValueError, match="CUDA tensors only"):
        CudaIpcHandle.export(torch.zeros(3))


@pytest.mark.gpu
def test_spawned_child_reads_a_slot_of_the_parents_buffer_zero_copy():
    buffer = torch.arange(8 * 16, dtype=torch.float32, device="cuda").view(8, 16)
    torch.cuda.synchronize()  # writes must be done before a handle is published
    handle = CudaIpcHandle.export(buffer).slot(5)
    assert handle.open().data_ptr() == buffer[5].data_ptr()  # same process: the original
    expected = buffer[5].double().sum().item()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD],
        input=msgpack.packb(handle.to_dict()).hex() + "\n",
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert proc.returncode == 0, proc.stderr
    total, shape, device = proc.stdout.split(maxsplit=2)
    assert float(total) == expected
    assert shape == "[16]" and device.startswith("cuda")
    torch.cuda.synchronize()
    assert buffer[5, 0].item() == -1.0 and buffer[4, 0].item() == 64.0
