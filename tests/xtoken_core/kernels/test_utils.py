"""Kernel helpers: lazy per-mode JIT, its unspecialized arguments, and the deferred host reads."""

import pytest
import torch

from xtoken_core.kernels import _utils

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _lazy_kernels():
    import importlib
    import pkgutil

    import xtoken_core.kernels as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"xtoken_core.kernels.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, _utils.LazyJit):
                yield f"{info.name}.{name}", obj


def test_unspecialized_arguments_name_parameters_of_their_kernel():
    # Triton ignores a do_not_specialize name that is no parameter: a typo would silently bring
    # back a compile per batch shape (a new chunk count meets the step as a 0.1-5 s compile)
    import inspect

    checked = 0
    for name, kernel in _lazy_kernels():
        params = set(inspect.signature(kernel.fn).parameters)
        for key in ("do_not_specialize", "do_not_specialize_on_alignment"):
            unknown = set(kernel.jit_kwargs.get(key, ())) - params
            assert not unknown, f"{name} {key} names no parameter: {sorted(unknown)}"
            checked += bool(kernel.jit_kwargs.get(key))
    assert checked >= 19  # the loss kernels declare their batch-dependent arguments


def test_read_later_gives_the_values_the_tensor_had_when_queued():
    x = torch.arange(5, device=DEVICE)
    read = _utils.read_later(x * 2)
    x.add_(100)  # work queued after the read does not change what it gives
    assert read() == [0, 2, 4, 6, 8]
    assert read() == [0, 2, 4, 6, 8]  # may be asked again


def test_read_later_joins_several_tensors_flat_in_one_dtype():
    ids = torch.tensor([[-1, 2**40]], device=DEVICE)  # int64 beyond fp32's exact range
    total = torch.tensor(2.5, device=DEVICE)
    read = _utils.read_later(ids, total, ids[0, 1:] + 1, dtype=torch.float64)
    del total  # a piece freed after the read is queued is still read as it was
    assert read() == [-1.0, float(2**40), 2.5, float(2**40 + 1)]
    assert _utils.read_later(ids[0], torch.tensor([7], device=DEVICE))() == [-1, 2**40, 7]


def test_read_later_can_give_one_host_tensor_instead_of_a_list():
    x = torch.arange(3, device=DEVICE)
    read = _utils.read_later(
        x, torch.tensor([0.5], device=DEVICE), dtype=torch.float64, as_list=False
    )
    alone = _utils.read_later(x, as_list=False)
    x.add_(100)  # not an alias of the queued tensor
    assert torch.equal(read(), torch.tensor([0.0, 1.0, 2.0, 0.5], dtype=torch.float64))
    assert alone().device.type == "cpu" and alone().tolist() == [0, 1, 2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_read_later_joins_pieces_after_a_mark_without_waiting_for_later_work():
    pieces = [torch.full((2,), 4.0, device="cuda"), torch.arange(3, device="cuda")]
    # the process's first pinned host blocks are allocated by a call that waits for the whole
    # device: take them (and the side stream) before the timed part, as any step before it does
    _utils.read_later(*pieces, dtype=torch.float64)()
    mark = _utils.queue_mark(pieces[0].device)
    torch.cuda._sleep(200_000_000)  # ~0.1 s queued between the mark and the read
    done = torch.cuda.Event()
    done.record()
    read = _utils.read_later(*pieces, after=mark, dtype=torch.float64)
    pieces.clear()  # their memory may go back to the allocator: the copy still reads them
    assert read() == [4.0, 4.0, 0.0, 1.0, 2.0]
    assert not done.query()
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_read_later_waits_only_for_the_work_queued_before_it():
    x = torch.full((3,), 7, device="cuda")
    read = _utils.read_later(x)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU work queued after the copy
    done = torch.cuda.Event()
    done.record()
    assert read() == [7, 7, 7]
    assert not done.query()  # the host got the values while the later work was still running
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_read_later_copies_after_the_work_queued_before_it():
    # the copy runs on its own stream, behind what the current stream had queued
    x = torch.zeros(3, device="cuda")
    torch.cuda._sleep(50_000_000)
    x.fill_(5.0)
    read = _utils.read_later(x)
    assert read() == [5.0, 5.0, 5.0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_read_later_after_a_mark_waits_only_for_the_work_before_the_mark():
    x = torch.full((2,), 3, device="cuda")
    mark = _utils.queue_mark(x.device)
    torch.cuda._sleep(200_000_000)  # ~0.1 s queued between the mark and the read
    done = torch.cuda.Event()
    done.record()
    read = _utils.read_later(x, after=mark)
    assert read() == [3, 3]
    assert not done.query()
    torch.cuda.synchronize()
