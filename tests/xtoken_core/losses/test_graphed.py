"""The P-KL KD phase replayed from a CUDA graph: same bits as the eager kernels, safe policy."""

from __future__ import annotations

import pytest
import torch

from tests.xtoken_core.losses.test_loss import make_alignment
from xtoken_core.losses import CrossTokenizerLoss, CrossTokenizerLossConfig, graphed
from xtoken_core.losses.kernel_engine import KernelEngine

Bn, Tn, Un, Vn, Wn, Cn, Kp = 2, 97, 89, 523, 401, 70, 3


def make_projection(V=Vn, W=Wn):
    g = torch.Generator().manual_seed(0)
    indices = torch.randint(0, W, (V, Kp), generator=g)
    likelihoods = torch.rand(V, Kp, generator=g) + 0.1
    n = min(V, W) // 3
    indices[:n, 0], indices[:n, 1:] = torch.arange(n), -1
    likelihoods[:n] = torch.tensor([1.0, 0.0, 0.0])
    return indices, likelihoods


def make_batch(seed, device, bad_ids=False, Tn=Tn, Un=Un, Cn=Cn):
    """test_loss's alignment (runs of 1-3 tokens, ~15% invalid pairs) with a sample mask on
    ``device``; ``bad_ids``: one student id >= C."""
    batch = make_alignment(seed, Bn=Bn, Tn=Tn, Un=Un, Cn=Cn)
    if bad_ids:
        batch["alignment_student_chunk_id"][1, 2] = Cn + 4
    batch["sample_mask"] = torch.tensor([True, seed % 3 != 2])
    return {k: v.to(device) for k, v in batch.items()}


def loss_fn(graphs: bool, **overrides) -> CrossTokenizerLoss:
    options = dict(
        projection=make_projection(),
        mode="pkl",
        temperature=2.0,
        vocab_topk=300,
        ce_weight=0.0,
        backend="kernel",
        cuda_graphs=graphs,
    )
    options.update(overrides)
    return CrossTokenizerLoss(CrossTokenizerLossConfig(**options))


def fwd_bwd(fn, zs, zt, batch, **kw):
    zs.grad = None
    loss, metrics = fn(zs, zt, batch, **kw)
    loss.backward()
    return loss.detach().clone(), {k: v.clone() for k, v in metrics.items()}, zs.grad.clone()


def assert_same(a, b):
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    for key in a[1]:
        assert torch.equal(a[1][key], b[1][key]), key
    assert torch.equal(a[2], b[2])


# ----------------------------------------------------------------------------- CPU: the policy


def test_policy_runs_a_new_key_eagerly_then_captures_then_replays():
    policy = graphed.GraphPolicy(capacity=2)
    assert policy.decide("a") == "eager"
    assert policy.decide("a") == "capture"
    policy.add("a", object())
    assert [policy.decide("a") for _ in range(3)] == ["replay"] * 3
    assert policy.stats == {"eager": 1, "captures": 1, "replays": 3, "evictions": 0}


def test_policy_evicts_the_least_recently_used_graph():
    policy = graphed.GraphPolicy(capacity=2)
    entries = {}
    for key in "abc":
        policy.decide(key)
        assert policy.decide(key) == "capture"
        entries[key] = object()
        evicted = policy.add(key, entries[key])
        if key == "b":
            policy.decide("a")  # a is used again: b becomes the oldest
    assert evicted == [entries["b"]]
    assert list(policy.entries) == ["a", "c"]
    assert policy.decide("b") == "eager"


def test_policy_stops_capturing_when_keys_never_repeat_after_capture():
    policy = graphed.GraphPolicy(capacity=1)
    decisions = []
    for i in range(12):  # each key seen twice, then never again: every capture is wasted
        decisions += [policy.decide(i), policy.decide(i)]
        if decisions[-1] == "capture":
            policy.add(i, object())
    assert policy.disabled_reason is not None and "addresses change" in policy.disabled_reason
    assert decisions[-2:] == ["eager", "eager"]
    assert policy.stats["captures"] == 2 * policy.capacity + 3


def test_policy_does_not_capture_a_key_whose_eager_run_failed():
    policy = graphed.GraphPolicy(capacity=2)
    assert policy.decide("bad") == "eager"
    policy.forget("bad")  # its eager run raised
    assert policy.decide("bad") == "eager"
    assert policy.decide("bad") == "capture"


def test_policy_rejects_a_capacity_below_one():
    with pytest.raises(ValueError, match="capacity=0"):
        graphed.GraphPolicy(capacity=0)


def test_config_rejects_a_graph_cache_below_one():
    with pytest.raises(ValueError, match="cuda_graph_cache=0"):
        CrossTokenizerLossConfig(projection=make_projection(), cuda_graph_cache=0)


def test_environment_switch_turns_graphs_off(monkeypatch):
    monkeypatch.setenv("XTOKEN_CUDA_GRAPHS", "0")
    assert not graphed.graphs_enabled()
    monkeypatch.setenv("XTOKEN_CUDA_GRAPHS", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not graphed.graphs_enabled()


@pytest.mark.parametrize("topk_columns", ["valid", "all"])
@pytest.mark.parametrize("reverse_kl", [False, True])
def test_phase_path_matches_the_fused_path_interpreted_on_cpu(
    monkeypatch, reverse_kl, topk_columns
):
    """kd_phase + its autograd Function (the code a graph captures) against the eager fused
    path, both through the Triton interpreter; a second call tries a capture, which needs CUDA,
    so the phase records why and stays eager."""
    if torch.cuda.is_available():
        pytest.skip("covered by the GPU tests")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(KernelEngine, "_graph_eligible", lambda self, *a: True)
    T, U, V, W, C = 15, 13, 41, 37, 10
    g = torch.Generator().manual_seed(7)
    zs = (3 * torch.randn(Bn, T, V, generator=g)).to(torch.bfloat16).requires_grad_()
    zts = [(3 * torch.randn(Bn, U, W, generator=g)).to(torch.bfloat16) for _ in range(2)]
    options = dict(
        projection=make_projection(V, W),
        vocab_topk=20,
        reverse_kl=reverse_kl,
        teacher_weights=[1.0, 0.5],
        topk_columns=topk_columns,
    )
    phase_fn, fused_fn = loss_fn(True, **options), loss_fn(False, **options)
    monkeypatch.setattr(fused_fn.kernel, "_graph_eligible", lambda *a: False)
    for step in range(2):
        batch = make_batch(30 + step, "cpu", Tn=T, Un=U, Cn=C)
        assert_same(fwd_bwd(phase_fn, zs, zts, batch), fwd_bwd(fused_fn, zs, zts, batch))
    stats = phase_fn.graph_stats
    assert stats["eager"] == 1 and "capture failed" in stats["disabled"], stats
    with pytest.raises(ValueError, match="alignment_student_chunk_id has ids in"):
        phase_fn(zs, zts, make_batch(0, "cpu", bad_ids=True, Tn=T, Un=U, Cn=C))
    short = make_batch(0, "cpu", Tn=T - 1, Un=U, Cn=C)
    with pytest.raises(ValueError, match=r"alignment_student_chunk_id is \(2, 14\)"):
        phase_fn(zs, zts, short)


def test_bad_input_on_the_phase_path_raises_without_a_capture(monkeypatch):
    """exact_token_match_only without pair_is_correct fails in the eager run of a new key; the
    key is not captured next time (a capture must not be what finds bad input, nor turn the
    graphs off for good: on CPU any capture fails, so a capture would show in the stats)."""
    if torch.cuda.is_available():
        pytest.skip("covered by the GPU tests")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(KernelEngine, "_graph_eligible", lambda self, *a: True)
    T, U, V, W, C = 15, 13, 41, 37, 10
    zs = torch.randn(Bn, T, V).requires_grad_()
    zt = torch.randn(Bn, U, W)
    fn = loss_fn(True, projection=make_projection(V, W), vocab_topk=20, mode="pkl")
    fn.config.exact_token_match_only = True
    batch = make_batch(0, "cpu", Tn=T, Un=U, Cn=C)
    del batch["alignment_pair_is_correct"]
    for _ in range(2):
        with pytest.raises(ValueError, match="needs alignment_pair_is_correct"):
            fn(zs, zt, batch)
    assert fn.graph_stats["disabled"] is None and fn.graph_stats["captures"] == 0


# ----------------------------------------------------------------------------- GPU: the graphs


@pytest.mark.gpu
def test_graph_replays_are_bitwise_equal_to_the_eager_kernels_on_new_data():
    g = torch.Generator(device="cuda").manual_seed(0)
    zs = torch.empty(Bn, Tn, Vn, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    zt = torch.empty(Bn, Un, Wn, device="cuda", dtype=torch.bfloat16)
    graph_fn, eager_fn = loss_fn(True), loss_fn(False)
    for step in range(5):  # eager, capture, then replays; new values in the same buffers
        with torch.no_grad():
            zs.copy_(3 * torch.randn(zs.shape, generator=g, device="cuda"))
            zt.copy_(3 * torch.randn(zt.shape, generator=g, device="cuda"))
        batch = make_batch(step, "cuda")  # new small tensors every step
        assert_same(fwd_bwd(graph_fn, zs, zt, batch), fwd_bwd(eager_fn, zs, zt, batch))
    stats = graph_fn.graph_stats
    assert (stats["eager"], stats["captures"], stats["replays"]) == (1, 1, 3), stats
    assert eager_fn.graph_stats is None


@pytest.mark.gpu
def test_graph_takes_small_inputs_from_the_cpu_and_global_denominators():
    g = torch.Generator(device="cuda").manual_seed(1)
    zs = (3 * torch.randn(Bn, Tn, Vn, generator=g, device="cuda")).requires_grad_()
    zts = [3 * torch.randn(Bn, Un, Wn, generator=g, device="cuda") for _ in range(2)]
    fns = [loss_fn(graphs, teacher_weights=[0.7, 0.3], kl_weight=0.5) for graphs in (True, False)]
    for step in range(4):
        batch = make_batch(10 + step, "cpu")
        counts = {"global_valid_chunks": [150.0 + step, 141.0]}
        got, want = (fwd_bwd(fn, zs, zts, batch, **counts) for fn in fns)
        assert_same(got, want)
    assert fns[0].graph_stats["replays"] == 2


@pytest.mark.gpu
def test_backward_after_a_later_forward_recomputes_its_own_tensors():
    g = torch.Generator(device="cuda").manual_seed(2)
    zs = (3 * torch.randn(Bn, Tn, Vn, generator=g, device="cuda")).to(torch.bfloat16)
    zs.requires_grad_()
    zt = (3 * torch.randn(Bn, Un, Wn, generator=g, device="cuda")).to(torch.bfloat16)
    graph_fn, eager_fn = loss_fn(True), loss_fn(False)
    for step in range(2):  # capture the graph
        fwd_bwd(graph_fn, zs, zt, make_batch(step, "cuda"))
    first, second = make_batch(20, "cuda"), make_batch(21, "cuda")
    zs.grad = None
    loss_1, _ = graph_fn(zs, zt, first)
    loss_2, _ = graph_fn(zs, zt, second)  # the replay overwrites the graph's memory
    loss_1.backward()
    grad_1 = zs.grad.clone()
    zs.grad = None
    loss_2.backward()
    grad_2 = zs.grad.clone()
    assert torch.equal(grad_1, fwd_bwd(eager_fn, zs, zt, first)[2])
    assert torch.equal(grad_2, fwd_bwd(eager_fn, zs, zt, second)[2])
    assert not torch.equal(loss_1, loss_2)


@pytest.mark.gpu
def test_graph_path_raises_on_nan_logits_and_bad_ids_and_keeps_serving():
    g = torch.Generator(device="cuda").manual_seed(3)
    zs = (3 * torch.randn(Bn, Tn, Vn, generator=g, device="cuda")).requires_grad_()
    zt = 3 * torch.randn(Bn, Un, Wn, generator=g, device="cuda")
    fn = loss_fn(True)
    batch = make_batch(0, "cuda")
    for _ in range(3):
        fwd_bwd(fn, zs, zt, batch)
    with pytest.raises(ValueError, match="alignment_student_chunk_id has ids in"):
        fn(zs, zt, make_batch(0, "cuda", bad_ids=True))
    with torch.no_grad():
        zt[1, 5, 7] = float("nan")
    with pytest.raises(ValueError, match="teacher_logits holds NaN or inf"):
        fn(zs, zt, batch)
    with torch.no_grad():
        zt[1, 5, 7] = 0.0
        zs[0, 2, 3] = float("inf")
    with pytest.raises(ValueError, match="student_logits holds NaN or inf"):
        fn(zs, zt, batch)
    with torch.no_grad():
        zs[0, 2, 3] = 0.0
    assert_same(fwd_bwd(fn, zs, zt, batch), fwd_bwd(loss_fn(False), zs, zt, batch))
    assert fn.graph_stats["replays"] >= 4


@pytest.mark.gpu
def test_logits_at_new_addresses_every_call_stop_the_capturing():
    g = torch.Generator(device="cuda").manual_seed(4)
    fn, eager_fn = loss_fn(True, cuda_graph_cache=1), loss_fn(False)
    keep = []  # hold every tensor so that no address is reused
    batch = make_batch(0, "cuda")
    for _ in range(8):
        zs = (3 * torch.randn(Bn, Tn, Vn, generator=g, device="cuda")).requires_grad_()
        zt = 3 * torch.randn(Bn, Un, Wn, generator=g, device="cuda")
        keep.append((zs, zt))
        for _ in range(2):  # seen twice: captured, then never used again
            assert_same(fwd_bwd(fn, zs, zt, batch), fwd_bwd(eager_fn, zs, zt, batch))
    stats = fn.graph_stats
    assert stats["disabled"] is not None and stats["captures"] == 5, stats


@pytest.mark.gpu
@pytest.mark.parametrize("padded_vocab", [False, True])
def test_a_training_loop_replays_its_graph(padded_vocab):
    """Fresh logits every step from a model (lm_head output, teacher output): PyTorch's caching
    allocator hands the same addresses back once a step's tensors are freed, so the graph
    replays; the losses and gradients equal the eager kernels' step by step."""
    torch.manual_seed(5)
    V, W = 4099, 3001  # > 1 MB of logits: the allocator's large-block pool, as at real sizes
    pad = 5 if padded_vocab else 0  # lm_head padding columns sliced off: a row-strided view
    heads = [torch.nn.Linear(64, V + pad, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    heads[1].load_state_dict(heads[0].state_dict())
    teacher = torch.nn.Linear(64, W, device="cuda", dtype=torch.bfloat16)
    opts = [torch.optim.SGD(h.parameters(), lr=0.1) for h in heads]
    projection = make_projection(V, W)
    fns = [loss_fn(graphs, projection=projection) for graphs in (True, False)]
    for step in range(8):
        hidden = torch.randn(Bn, Tn, 64, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            zt = teacher(torch.randn(Bn, Un, 64, device="cuda", dtype=torch.bfloat16))
        batch = make_batch(step, "cuda")
        results = []
        for head, opt, fn in zip(heads, opts, fns, strict=True):
            loss, _ = fn(head(hidden)[..., :V], zt, batch)
            loss.backward()
            results.append((loss.detach(), head.weight.grad.clone()))
            opt.step()
            opt.zero_grad(set_to_none=True)
            del loss
        assert torch.equal(results[0][0], results[1][0]), step
        assert torch.equal(results[0][1], results[1][1]), step
    # the two loss objects' steps interleave, so the addresses alternate between two sets:
    # eager, eager, capture, capture, then every step replays one of the two graphs
    stats = fns[0].graph_stats
    assert stats["captures"] <= 2 and stats["replays"] >= 4, stats
