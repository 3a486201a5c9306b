"""Tensor handles across processes: POSIX shared memory (CPU) and CUDA IPC (GPU)."""

from xtoken_core.ipc.cuda import CudaIpcHandle, release_cache
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

__all__ = [
    "ALIGN",
    "SHM_DIR",
    "SHM_PREFIX",
    "CudaIpcHandle",
    "ShmReader",
    "ShmSegment",
    "ShmTensorHandle",
    "open_handle",
    "release_cache",
    "sweep_orphans",
    "write_tensors",
]
