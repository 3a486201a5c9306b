"""AdamW's update of fp32 masters with the write of their bf16 copy (xtoken_core.kernels.adamw),
against torch.optim.AdamW (fused) followed by the copy, on small shapes; interpreted on a CPU."""

import pytest
import torch

from tests.xtoken_core.kernels.conftest import DEVICE
from xtoken_core.kernels.adamw import ADAMW_BLOCK, adamw_publish_

pytest.importorskip("triton")

SHAPES = [(3, 5), (ADAMW_BLOCK + 7,), (64, 33)]  # a ragged last block, several programs


def _params(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(DEVICE) for s in SHAPES]


def _grads(params, seed: int, dtype=torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(p.shape, generator=gen) * 0.1).to(dtype).to(DEVICE) for p in params]


def _torch_steps(params, grads_per_step, scales, infs, *, weight_decay):
    masters = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW(masters, lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=weight_decay, fused=True)  # fmt: skip
    for grads, scale, inf in zip(grads_per_step, scales, infs, strict=True):
        for m, g in zip(masters, grads, strict=True):
            m.grad = g.float().clone()
        opt.grad_scale, opt.found_inf = scale, inf
        opt.step()
    state = [opt.state[m] for m in masters]
    return [m.detach() for m in masters], state


def _fused_steps(params, grads_per_step, scales, infs, *, weight_decay):
    masters = [p.clone() for p in params]
    computes = [p.to(torch.bfloat16) for p in params]
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    steps = [torch.zeros((), dtype=torch.float32, device=DEVICE) for _ in params]
    for grads, scale, inf in zip(grads_per_step, scales, infs, strict=True):
        torch._foreach_add_(steps, 1)
        adamw_publish_(masters, grads, ms, vs, steps, computes, lr=1e-2, beta1=0.9, beta2=0.95,
                       eps=1e-8, weight_decay=weight_decay, grad_scale=scale,
                       found_inf=inf)  # fmt: skip
        if inf is not None:
            torch._foreach_sub_(steps, [inf] * len(steps))
    return masters, ms, vs, steps, computes


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_update_equals_torchs_fused_adamw_and_the_copy_is_the_master_rounded(weight_decay):
    params = _params(0)
    grads = [_grads(params, s) for s in range(3)]
    scale = [torch.tensor(2.5, device=DEVICE)] * 3  # the clip: gradients divided by 2.5
    inf = [torch.tensor(0.0, device=DEVICE)] * 3
    want, state = _torch_steps(params, grads, scale, inf, weight_decay=weight_decay)
    got, ms, vs, steps, computes = _fused_steps(params, grads, scale, inf,
                                                weight_decay=weight_decay)  # fmt: skip
    for w, g, s, m, v, t, c in zip(want, got, state, ms, vs, steps, computes, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m, s["exp_avg"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(v, s["exp_avg_sq"], rtol=1e-5, atol=1e-9)
        assert float(t) == float(s["step"]) == 3.0
        assert c.dtype == torch.bfloat16 and torch.equal(c, g.to(torch.bfloat16))
    assert not torch.equal(got[0], params[0])  # it moved


def test_a_step_with_a_nonfinite_gradient_writes_nothing_and_is_not_counted():
    params = _params(1)
    grads = [_grads(params, s) for s in range(3)]
    scale = [None] * 3
    inf = [torch.tensor(v, device=DEVICE) for v in (0.0, 1.0, 0.0)]  # the second step skipped
    want, state = _torch_steps(params, grads, scale, inf, weight_decay=0.1)
    got, ms, vs, steps, computes = _fused_steps(params, grads, scale, inf, weight_decay=0.1)
    for w, g, s, t in zip(want, got, state, steps, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        assert float(t) == float(s["step"]) == 2.0
    # a skipped step alone: masters, moments and the compute copies as they were
    before = [p.clone() for p in got], [c.clone() for c in computes], [m.clone() for m in ms]
    adamw_publish_(got, grads[0], ms, vs, steps, computes, lr=1.0, beta1=0.9, beta2=0.95,
                   eps=1e-8, weight_decay=0.1,
                   found_inf=torch.tensor(1.0, device=DEVICE))  # fmt: skip
    for old, new in zip(before, (got, computes, ms), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(old, new, strict=True))


def test_bf16_gradients_are_read_as_they_are():
    params = _params(2)
    grads = [_grads(params, 5, torch.bfloat16)]
    want, _ = _torch_steps(params, grads, [None], [None], weight_decay=0.0)
    got, *_ = _fused_steps(params, grads, [None], [None], weight_decay=0.0)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def _one_step_matches_torch(params, grads, weight_decay: float) -> None:
    """One fused step equals torch's fused AdamW, and each copy is its master rounded."""
    want, _ = _torch_steps(params, [grads], [None], [None], weight_decay=weight_decay)
    got, *_, computes = _fused_steps(params, [grads], [None], [None], weight_decay=weight_decay)
    for w, g, c in zip(want, got, computes, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        assert torch.equal(c, g.to(torch.bfloat16))


def test_one_call_takes_gradients_of_two_dtypes_and_an_empty_parameter():
    params = _params(4) + [torch.zeros(0, device=DEVICE)]
    grads = _grads(params, 6)
    grads[1] = grads[1].to(torch.bfloat16)  # a launch per gradient dtype
    _one_step_matches_torch(params, grads, weight_decay=0.1)


def test_each_call_reads_the_gradients_it_is_given_not_those_of_an_earlier_call():
    params = _params(5)
    grads = [_grads(params, s) for s in range(3)]  # new tensors (new addresses) every step
    grads.append(grads[0])  # and a step on tensors seen before
    n = len(grads)
    want, _ = _torch_steps(params, grads, [None] * n, [None] * n, weight_decay=0.0)
    got, *_ = _fused_steps(params, grads, [None] * n, [None] * n, weight_decay=0.0)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_sizes_that_are_all_multiples_of_sixteen_update_as_well():
    gen = torch.Generator().manual_seed(7)
    params = [torch.randn(s, generator=gen).to(DEVICE) for s in ((16,), (ADAMW_BLOCK + 16,))]
    _one_step_matches_torch(params, _grads(params, 8), weight_decay=0.1)


def test_tensors_that_start_off_sixteen_bytes_update_as_well():
    # views one element into their storage: no wide loads may be assumed (on a GPU a misaligned
    # wide load is an error)
    params = [torch.randn(n + 1, device=DEVICE)[1:] for n in (33, 4100)]
    grads = [(torch.randn(n + 1, device=DEVICE) * 0.1)[1:] for n in (33, 4100)]
    assert all(p.data_ptr() % 16 for p in params)
    want, _ = _torch_steps(params, [grads], [None], [None], weight_decay=0.0)
    masters = [torch.empty(p.numel() + 1, device=DEVICE)[1:].copy_(p) for p in params]
    computes = [torch.empty(p.numel() + 1, device=DEVICE, dtype=torch.bfloat16)[1:] for p in params]
    ms = [torch.zeros(p.numel() + 1, device=DEVICE)[1:] for p in params]
    vs = [torch.zeros(p.numel() + 1, device=DEVICE)[1:] for p in params]
    steps = [torch.ones((), device=DEVICE) for _ in params]
    adamw_publish_(masters, grads, ms, vs, steps, computes, lr=1e-2, beta1=0.9, beta2=0.95,
                   eps=1e-8, weight_decay=0.0)  # fmt: skip
    for w, g, c in zip(want, masters, computes, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        assert torch.equal(c, g.to(torch.bfloat16))


def test_lists_that_do_not_pair_up_are_refused():
    p = torch.zeros(4, device=DEVICE)
    one = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="one gradient, moment pair, step and compute copy"):
        adamw_publish_([p], [p], [p], [p], [], [p.bfloat16()], **one)
    with pytest.raises(ValueError, match="must be float32"):
        adamw_publish_([p.double()], [p], [p], [p], [p[0]], [p.bfloat16()], **one)
    with pytest.raises(ValueError, match="shapes"):
        adamw_publish_([p], [p[:2]], [p], [p], [p[0]], [p.bfloat16()], **one)
    with pytest.raises(ValueError, match="not a float32 scalar"):
        adamw_publish_([p], [p], [p], [p], [p[:1].long()], [p.bfloat16()], **one)


@pytest.mark.usefixtures("no_interpreter")
def test_the_cpu_reference_path_matches_torch_too():
    params = _params(3)
    grads = [_grads(params, s) for s in range(2)]
    scale = [torch.tensor(0.5)] * 2
    inf = [torch.tensor(0.0)] * 2
    want, _ = _torch_steps(params, grads, scale, inf, weight_decay=0.1)
    got, *_ = _fused_steps(params, grads, scale, inf, weight_decay=0.1)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_full_size_parameters_update_as_torchs_fused_adamw_on_a_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(151_680, 2048), (6144, 2048), (2048,)]  # an output layer, an MLP matrix, a norm
    params = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
    grads = [torch.randn(s, device="cuda", generator=gen) * 1e-3 for s in shapes]
    scale, inf = torch.tensor(1.7, device="cuda"), torch.tensor(0.0, device="cuda")
    want, state = _torch_steps(params, [grads], [scale], [inf], weight_decay=0.1)
    masters = [p.clone() for p in params]
    computes = [p.to(torch.bfloat16) for p in params]
    ms, vs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    steps = [torch.ones((), device="cuda") for _ in params]
    adamw_publish_(masters, grads, ms, vs, steps, computes, lr=1e-2, beta1=0.9, beta2=0.95,
                   eps=1e-8, weight_decay=0.1, grad_scale=scale, found_inf=inf)  # fmt: skip
    for w, g, s, m, c in zip(want, masters, state, ms, computes, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m, s["exp_avg"], rtol=1e-5, atol=1e-9)
        assert torch.equal(c, g.to(torch.bfloat16))
