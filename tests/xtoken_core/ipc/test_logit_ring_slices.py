"""LogitRingSliceWriter: another process writes its vocab columns of a slot the owner acquired;
after the owner publishes, the reader sees every process's columns; bad columns and closed rings
are refused."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from xtoken_core.ipc.logit_ring import LogitRingReader, LogitRingSliceWriter, LogitRingWriter

B, U, W = 2, 5, 11


def _pattern(slot: int) -> torch.Tensor:
    return torch.arange(B * U * W, dtype=torch.float32).reshape(B, U, W) / 7 + slot


def _write_columns(descriptor: dict, columns: tuple[int, int], slot: int) -> None:
    """Another process: write the pattern's ``columns`` of ``slot``."""
    lo, hi = columns
    with LogitRingSliceWriter(descriptor, columns=columns) as writer:
        buffer_BUC = writer.buffer(slot)
        assert buffer_BUC.shape == (B, U, hi - lo)
        buffer_BUC.copy_(_pattern(slot)[:, :, lo:hi].to(buffer_BUC.dtype))


def test_each_process_writes_its_columns_and_the_reader_sees_the_whole_slot():
    ctx = mp.get_context("spawn")
    with (
        LogitRingWriter(
            transport="shm", num_slots=2, slot_shape=(B, U, W), dtype=torch.float32
        ) as ring,
        LogitRingReader() as reader,
    ):
        for _ in range(2):  # a slot written twice, through both of the ring's slots
            slot = ring.acquire()
            ring.buffer(slot)[:, :, :6].copy_(_pattern(slot)[:, :, :6])  # the owner's columns
            child = ctx.Process(target=_write_columns, args=(ring.descriptor, (6, W), slot))
            child.start()
            child.join(timeout=60)
            assert child.exitcode == 0
            handle = ring.publish(slot, rows=B, length=U)
            view = reader.view(ring.descriptor, handle)
            assert torch.equal(view, _pattern(slot))
            reader.release(ring.descriptor, handle)


@pytest.mark.parametrize("columns", [(0, 0), (3, 2), (-1, 4), (0, W + 1), (0.0, 4), [1]])
def test_columns_outside_the_vocab_are_refused_naming_the_width(columns):
    with LogitRingWriter(
        transport="shm", num_slots=2, slot_shape=(B, U, W), dtype=torch.float32
    ) as ring:
        with pytest.raises(ValueError, match=rf"columns=.*0 <= lo < hi <= {W}, the ring's vocab"):
            LogitRingSliceWriter(ring.descriptor, columns=columns)


def test_a_closed_ring_is_refused_and_its_slices_stop_writing():
    ring = LogitRingWriter(transport="shm", num_slots=2, slot_shape=(B, U, W), dtype=torch.float32)
    writer = LogitRingSliceWriter(ring.descriptor, columns=(0, 4))
    ring.close()
    with pytest.raises(Exception, match="is gone"):  # the owner unlinked its segments
        LogitRingSliceWriter(ring.descriptor, columns=(0, 4))
    with pytest.raises(ValueError, match=f"logit ring {ring.instance:#x} is closed"):
        writer.buffer(0)
    writer.close()
