"""Tensor handles across processes: POSIX shared memory (CPU), CUDA IPC (GPU), the logit ring."""

from xtoken_core.ipc.cuda import CudaIpcHandle, release_cache
from xtoken_core.ipc.logit_ring import LogitRingReader, LogitRingWriter, checksum_of
from xtoken_core.ipc.shm import (
    ALIGN,
    SHM_DIR,
    SHM_PREFIX,
    ShmReader,
    ShmSegment,
    ShmTensorHandle,
    open_handle,
    sweep_orphans,
    write_tensors,
)
from xtoken_core.ipc.slots import SlotTable, StaleHandleError

__all__ = [
    "ALIGN",
    "SHM_DIR",
    "SHM_PREFIX",
    "CudaIpcHandle",
    "LogitRingReader",
    "LogitRingWriter",
    "ShmReader",
    "ShmSegment",
    "ShmTensorHandle",
    "SlotTable",
    "StaleHandleError",
    "checksum_of",
    "open_handle",
    "release_cache",
    "sweep_orphans",
    "write_tensors",
]
