"""Kernel tests: without CUDA, run Triton kernels in the interpreter, for these tests only.

The interpreter is switched on per test (``monkeypatch.setenv``), not for the whole pytest
process, so that other tests that happen to call a kernel on CPU tensors keep the fast PyTorch
fallback. Kernels must therefore pick the mode at launch time: wrap them with
``xtoken_core.kernels._utils.lazy_jit`` instead of ``triton.jit`` (a module-level ``@triton.jit``
is pinned to whatever ``TRITON_INTERPRET`` was when it was imported).
"""

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _triton_interpreter_without_cuda(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture
def no_interpreter(monkeypatch):
    """Run the test on the plain CPU path (no CUDA, no interpreter): the reference fallback."""
    if torch.cuda.is_available():
        pytest.skip("the CPU fallback path is only taken without CUDA")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    yield


# --------------------------------------------------------------------------- fused KD kernel cases


def kd_logits(B, T, V, dtype, seed, pad=0):
    """Random ``[B, T, V]`` logits on DEVICE; a vocab-sliced view (row stride != V) when pad > 0."""
    gen = torch.Generator().manual_seed(seed)
    z = (torch.randn(B, T, V + pad, generator=gen) * 3).to(dtype).to(DEVICE)
    return z[..., :V]


def kd_rows(B, T, N, seed):
    """nidx [B*T] with runs of 1-3 rows per chunk, some rows in no chunk, and the order/offsets."""
    gen = torch.Generator().manual_seed(seed)
    nidx = torch.randint(0, N, (B * T,), generator=gen)
    nidx[torch.rand(B * T, generator=gen) < 0.2] = -1
    key = torch.where(nidx >= 0, nidx, N)
    sorted_key, order = torch.sort(key, stable=True)
    offsets = torch.searchsorted(sorted_key, torch.arange(N + 1))
    return nidx.to(DEVICE), order.to(DEVICE), offsets.to(DEVICE)


def compile_for_hopper(lazy, types, constexprs):
    """Compile a :class:`LazyJit` kernel for sm_90 (an H100) with the ptxas Triton ships, no GPU
    needed, and return cuobjdump's resource line (``REG:.. STACK:.. LOCAL:..``). Arguments not in
    ``types`` are ``i32``; ``constexprs`` are the compile-time ones. Skips without that ptxas;
    the caller switches the interpreter off (``monkeypatch.delenv("TRITON_INTERPRET")``)."""
    import os
    import subprocess
    import tempfile

    triton = pytest.importorskip("triton")
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not os.path.exists(os.path.join(tools, "ptxas")):
        pytest.skip("this Triton ships no ptxas")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = triton.jit(lazy.fn, **lazy.jit_kwargs)  # compiled: the interpreter is off here
    signature = {name: types.get(name, "i32") for name in fn.arg_names}
    signature.update({name: "constexpr" for name in constexprs})
    kernel = triton.compile(
        ASTSource(fn, signature, constexprs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 4},
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as fh:
            fh.write(kernel.asm["cubin"])
        out = subprocess.run(
            [os.path.join(tools, "cuobjdump"), "--dump-resource-usage", path],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    return next(line for line in out.splitlines() if "REG:" in line)
