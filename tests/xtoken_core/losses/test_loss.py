"""CrossTokenizerLoss end to end against an independent float64 loop computation."""

from __future__ import annotations

import math

import pytest
import torch

from xtoken_core.losses import METRIC_KEYS, CrossTokenizerLoss, CrossTokenizerLossConfig
from xtoken_core.losses.loss import combine_losses

B, T, U, V, W, C, K = 3, 12, 11, 13, 11, 7, 3


# ----------------------------------------------------------------------------- test data


def make_projection(V=V, W=W):
    """Rows 0-3 one-hot (strict common), row 4 collides with row 0, rows 5/6 relaxed-only."""
    g = torch.Generator().manual_seed(1)
    indices = torch.full((V, K), -1, dtype=torch.long)
    likelihoods = torch.zeros(V, K)
    for s in range(4):
        indices[s, 0], likelihoods[s, 0] = s, 1.0
    indices[4, 0], likelihoods[4, 0] = 0, 1.0
    indices[5, :2], likelihoods[5, :2] = torch.tensor([5, 6]), torch.tensor([0.7, 0.3])
    indices[6, :2], likelihoods[6, :2] = torch.tensor([6, 5]), torch.tensor([0.2, 0.8])
    for s in range(7, V):
        ids = torch.randperm(W, generator=g)[:K]
        w = torch.rand(K, generator=g) + 0.1
        indices[s], likelihoods[s] = ids, w / w.sum()
    return indices, likelihoods


def make_alignment(seed, Bn=B, Tn=T, Un=U, Cn=C):
    g = torch.Generator().manual_seed(seed)
    s_ids = torch.full((Bn, Tn), -1, dtype=torch.long)
    t_ids = torch.full((Bn, Un), -1, dtype=torch.long)
    pair_valid = torch.zeros(Bn, Cn, dtype=torch.bool)
    num = torch.zeros(Bn, dtype=torch.long)
    for b in range(Bn):
        ps = pt = 0
        for c in range(Cn):
            ls, lt = (int(x) for x in torch.randint(1, 4, (2,), generator=g))
            if ps + ls > Tn or pt + lt > Un:
                break
            s_ids[b, ps : ps + ls] = c
            t_ids[b, pt : pt + lt] = c
            ps, pt = ps + ls, pt + lt
            pair_valid[b, c] = bool(torch.rand((), generator=g) > 0.15)
            num[b] = c + 1
    return {
        "alignment_pair_valid": pair_valid,
        "alignment_pair_is_correct": pair_valid & (torch.rand(Bn, Cn, generator=g) > 0.4),
        "alignment_student_chunk_id": s_ids,
        "alignment_teacher_chunk_id": t_ids,
        "alignment_num_chunks": num,
    }


def make_batch(seed=0, Bn=B):
    g = torch.Generator().manual_seed(100 + seed)
    batch = make_alignment(seed, Bn=Bn)
    batch["input_ids"] = torch.randint(0, V, (Bn, T), generator=g)
    batch["token_mask"] = torch.rand(Bn, T, generator=g) > 0.2
    batch["sample_mask"] = torch.ones(Bn, dtype=torch.bool)
    return batch


def make_logits(seed=0, Bn=B, Wn=W, Un=U):
    g = torch.Generator().manual_seed(200 + seed)
    zs = (2 * torch.randn(Bn, T, V, generator=g, dtype=torch.float64)).requires_grad_()
    zt = 2 * torch.randn(Bn, Un, Wn, generator=g, dtype=torch.float64)
    return zs, zt


# ----------------------------------------------------------------------------- naive version


def naive_exact_map(indices, likelihoods, relaxed, Vn, Wn):
    best = {}  # teacher id -> (weight, student id)
    for s in range(indices.shape[0]):
        row = [(float(likelihoods[s, j]), int(indices[s, j])) for j in range(K)]
        row = [(w if t >= 0 else 0.0, t) for w, t in row]
        top_w, top_t = max(row, key=lambda wt: wt[0])  # first of equal maxima
        if not 0 <= top_t < Wn:
            continue
        ok = top_w >= 0.6 if relaxed else (top_w == 1.0 and int(indices[s, 1]) == -1)
        if not ok:
            continue
        if top_t not in best:
            best[top_t] = (top_w, s)
        elif relaxed and top_w > best[top_t][0]:
            best[top_t] = (top_w, s)
    pairs = sorted((s, t) for t, (_, s) in best.items())
    common_s = [s for s, _ in pairs]
    common_t = [t for _, t in pairs]
    return (
        pairs,
        [s for s in range(Vn) if s not in common_s],
        [t for t in range(Wn) if t not in common_t],
    )


def naive_kd(
    zs,
    zt,
    batch,
    proj,
    *,
    mode,
    temp=1.0,
    reverse=False,
    vocab_topk=None,
    uncommon_topk=8192,
    exact_only=False,
    prefix="alignment_",
    topk_columns="valid",
):
    """Sum over valid chunks of the per-chunk loss times temp**2, and the number of valid chunks.

    The defaults are the config's (``vocab_topk=None``: every column, what the default 8192
    keeps of these small vocabularies).
    """
    zs, zt = zs.detach().double(), zt.detach().double()
    Bn, Tn, Vn = zs.shape
    Un, Wn = zt.shape[1], zt.shape[2]
    s_ids, t_ids = batch[prefix + "student_chunk_id"], batch[prefix + "teacher_chunk_id"]
    pv, pc = batch[prefix + "pair_valid"], batch[prefix + "pair_is_correct"]
    smask = batch.get("sample_mask")
    indices, likelihoods = proj
    M = torch.zeros(Vn, Wn, dtype=torch.float64)
    for s in range(indices.shape[0]):
        for j in range(K):
            if indices[s, j] >= 0:
                M[s, indices[s, j]] += float(likelihoods[s, j])
    if mode == "pkl":
        best = torch.full((Wn,), -math.inf, dtype=torch.float64)
        for b in range(Bn):
            for p in range(Un):
                # "all" (NeMo RL): every position, padding and the last one included
                if topk_columns == "all" or (p < Un - 1 and t_ids[b, p + 1] >= 0):
                    best = torch.maximum(best, zt[b, p])
        k = Wn if vocab_topk is None else min(vocab_topk, Wn)
        cols = sorted(torch.argsort(best, descending=True)[:k].tolist())
    else:
        pairs, unc_s, unc_t = naive_exact_map(indices, likelihoods, mode == "xtoken", Vn, Wn)
    total, n_valid = 0.0, 0
    for b in range(Bn):
        if smask is not None and not bool(smask[b]):
            continue
        for c in range(pv.shape[1]):
            if not pv[b, c] or (exact_only and not pc[b, c]):
                continue
            s_pos = [p for p in range(Tn - 1) if s_ids[b, p + 1] == c]
            t_pos = [p for p in range(Un - 1) if t_ids[b, p + 1] == c]
            if not s_pos or not t_pos:
                continue
            n_valid += 1
            if mode == "pkl":
                L = sum(torch.log_softmax(zt[b, p, cols] / temp, 0) for p in t_pos) / len(t_pos)
                q = sum(torch.softmax(zs[b, p] / temp, 0) @ M[:, cols] for p in s_pos) / len(s_pos)
                P = q / q.sum()
                logP = [math.log(max(float(x), 1e-10)) for x in P]  # documented floor
                if reverse:
                    kl = sum(P[i] * (logP[i] - L[i]) for i in range(len(cols)))
                else:
                    kl = sum(math.exp(L[i]) * (L[i] - logP[i]) for i in range(len(cols)))
                total += float(kl) * temp**2
            else:
                S = sum(torch.log_softmax(zs[b, p] / temp, 0) for p in s_pos) / len(s_pos)
                Uc = sum(torch.log_softmax(zt[b, p] / temp, 0) for p in t_pos) / len(t_pos)
                kl = 0.0
                for s, t in pairs:
                    a, d = float(Uc[t]), float(S[s])
                    kl += math.exp(d) * (d - a) if reverse else math.exp(a) * (a - d)
                m = min(len(unc_s), len(unc_t), uncommon_topk)
                ps = sorted((math.exp(float(S[s])) for s in unc_s), reverse=True)[:m]
                pt = sorted((math.exp(float(Uc[t])) for t in unc_t), reverse=True)[:m]
                l1 = sum(abs(x - y) for x, y in zip(ps, pt))
                total += (kl + l1) * temp**2
    return total, n_valid


def naive_ce(zs, batch):
    zs = zs.detach().double()
    nll, n = 0.0, 0
    for b in range(zs.shape[0]):
        if not bool(batch["sample_mask"][b]):
            continue
        for p in range(T - 1):
            if batch["token_mask"][b, p + 1]:
                nll -= float(torch.log_softmax(zs[b, p], 0)[batch["input_ids"][b, p + 1]])
                n += 1
    return nll, n


def run_api(zs, zt, batch, **cfg):
    cfg.setdefault("projection", make_projection())
    loss_fn = CrossTokenizerLoss(CrossTokenizerLossConfig(**cfg))
    return loss_fn(zs, zt, batch)


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("mode", ["pkl", "gold", "xtoken"])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("temp", [1.0, 2.5])
def test_loss_matches_loop_computation_in_every_mode(mode, reverse, temp):
    zs, zt = make_logits(0)
    batch = make_batch(0)
    loss, metrics = run_api(
        zs,
        zt,
        batch,
        mode=mode,
        reverse_kl=reverse,
        temperature=temp,
        vocab_topk=6,
        uncommon_topk=4,
        kl_weight=0.7,
        ce_weight=0.3,
        backend="reference",
    )
    kd_sum, n = naive_kd(
        zs,
        zt,
        batch,
        make_projection(),
        mode=mode,
        temp=temp,
        reverse=reverse,
        vocab_topk=6,
        uncommon_topk=4,
    )
    nll, n_tok = naive_ce(zs, batch)
    assert n > 0
    assert metrics["kl_loss"].item() == pytest.approx(kd_sum / n, rel=1e-9)
    assert metrics["ce_loss"].item() == pytest.approx(nll / n_tok, rel=1e-9)
    assert loss.item() == pytest.approx(0.7 * kd_sum / n + 0.3 * nll / n_tok, rel=1e-9)
    assert metrics["num_valid_chunks"].item() == n
    assert set(metrics) == set(METRIC_KEYS)
    if mode == "pkl":
        assert metrics["l1_uncommon"].item() == 0.0
    else:
        assert metrics["l1_uncommon"].item() > 0.0
        total = metrics["kl_common"] + metrics["l1_uncommon"]
        assert total.item() == pytest.approx(metrics["kl_loss"].item(), rel=1e-9)


def test_pkl_with_all_teacher_columns_matches_loop_computation():
    zs, zt = make_logits(1)
    batch = make_batch(1)
    _, metrics = run_api(zs, zt, batch, mode="pkl", vocab_topk=None, backend="reference")
    kd_sum, n = naive_kd(zs, zt, batch, make_projection(), mode="pkl")
    assert metrics["kl_loss"].item() == pytest.approx(kd_sum / n, rel=1e-9)


def test_identical_distributions_through_identity_projection_give_zero_kd():
    indices = torch.cat([torch.arange(W).view(-1, 1), torch.full((W, K - 1), -1)], 1)
    likelihoods = torch.zeros(W, K)
    likelihoods[:, 0] = 1.0
    g = torch.Generator().manual_seed(3)
    zs = torch.randn(B, T, W, generator=g, dtype=torch.float64)
    # Teacher sequence == student sequence, one token per chunk (with several tokens per chunk
    # P-KL compares a geometric with an arithmetic mean, which differ).
    ids_BT = torch.arange(T).repeat(B, 1)
    batch = {
        "alignment_pair_valid": torch.ones(B, T, dtype=torch.bool),
        "alignment_pair_is_correct": torch.ones(B, T, dtype=torch.bool),
        "alignment_student_chunk_id": ids_BT,
        "alignment_teacher_chunk_id": ids_BT,
    }
    for mode in ("pkl", "gold"):
        _, metrics = run_api(
            zs,
            zs.clone(),
            batch,
            projection=(indices, likelihoods),
            mode=mode,
            vocab_topk=None,
            ce_weight=0.0,
            backend="reference",
        )
        assert metrics["num_valid_chunks"].item() == B * (T - 1)
        assert metrics["kl_loss"].item() == pytest.approx(0.0, abs=1e-12)
        # Every student token is common (V == W): the uncommon sets are empty.
        assert metrics["l1_uncommon"].item() == 0.0
        assert metrics["proj_accuracy"].item() == pytest.approx(1.0)


def test_masked_samples_count_neither_in_kd_nor_in_ce():
    zs, zt = make_logits(4)
    batch = make_batch(4)
    batch["sample_mask"] = torch.tensor([True, False, True])
    loss, metrics = run_api(zs, zt, batch, mode="gold", backend="reference")
    kd_sum, n = naive_kd(zs, zt, batch, make_projection(), mode="gold")
    nll, n_tok = naive_ce(zs, batch)
    assert loss.item() == pytest.approx(kd_sum / n + nll / n_tok, rel=1e-9)
    loss.backward()
    assert torch.all(zs.grad[1] == 0)
    assert torch.any(zs.grad[0] != 0)


@pytest.mark.parametrize("mode", ["pkl", "gold", "xtoken"])
@pytest.mark.parametrize("backend", ["reference", "kernel"])
def test_all_chunks_invalid_gives_zero_loss_and_zero_finite_gradient(mode, backend):
    zs, zt = make_logits(5)
    batch = make_batch(5)
    batch["alignment_pair_valid"] = torch.zeros_like(batch["alignment_pair_valid"])
    loss, metrics = run_api(zs, zt, batch, mode=mode, ce_weight=0.0, backend=backend)
    assert loss.item() == 0.0
    assert metrics["num_valid_chunks"].item() == 0
    assert all(torch.isfinite(v) for v in metrics.values())
    loss.backward()
    assert torch.isfinite(zs.grad).all() and torch.all(zs.grad == 0)


def test_gold_with_empty_common_vocab_has_only_the_uncommon_term():
    g = torch.Generator().manual_seed(6)
    indices = torch.stack([torch.randperm(W, generator=g)[:K] for _ in range(V)])
    likelihoods = torch.full((V, K), 1.0 / K)
    zs, zt = make_logits(6)
    batch = make_batch(6)
    _, metrics = run_api(
        zs, zt, batch, projection=(indices, likelihoods), mode="xtoken", backend="reference"
    )
    assert metrics["kl_common"].item() == 0.0
    assert metrics["proj_accuracy"].item() == 0.0
    kd_sum, n = naive_kd(zs, zt, batch, (indices, likelihoods), mode="xtoken")
    assert metrics["l1_uncommon"].item() == pytest.approx(kd_sum / n, rel=1e-9)


def test_several_teachers_are_weighted_with_their_own_alignment_and_vocab():
    zs, zt0 = make_logits(7)
    W1, U1 = 9, 10
    g = torch.Generator().manual_seed(8)
    zt1 = torch.randn(B, U1, W1, generator=g, dtype=torch.float64)
    proj1 = make_projection(W=W1)
    batch = make_batch(7)
    for key, value in make_alignment(9, Un=U1).items():
        batch["teacher1_" + key] = value
    loss, metrics = run_api(
        zs,
        [zt0, zt1],
        batch,
        projection=[make_projection(), proj1],
        teacher_weights=[0.25, 0.75],
        mode="gold",
        ce_weight=0.0,
        backend="reference",
    )
    kd0, n0 = naive_kd(zs, zt0, batch, make_projection(), mode="gold")
    kd1, n1 = naive_kd(zs, zt1, batch, proj1, mode="gold", prefix="teacher1_alignment_")
    assert n0 != n1
    assert loss.item() == pytest.approx(0.25 * kd0 / n0 + 0.75 * kd1 / n1, rel=1e-9)


def test_dynamic_scaling_matches_the_ce_magnitude_and_keeps_both_gradients():
    zs, zt = make_logits(10)
    batch = make_batch(10)
    loss, metrics = run_api(zs, zt, batch, mode="pkl", dynamic_scaling=True, backend="reference")
    kd, ce = metrics["kl_loss"], metrics["ce_loss"]
    assert loss.item() == pytest.approx(2 * ce.item(), rel=1e-12)
    loss.backward()
    grad_dyn = zs.grad.clone()
    scale = (ce / kd).item()
    zs.grad = None
    loss_kd, _ = run_api(zs, zt, batch, mode="pkl", ce_weight=0.0, backend="reference")
    loss_ce, _ = run_api(zs, zt, batch, mode="pkl", kl_weight=0.0, backend="reference")
    expected = torch.autograd.grad(scale * loss_kd + loss_ce, zs)[0]
    torch.testing.assert_close(grad_dyn, expected, rtol=1e-9, atol=1e-12)


def test_combine_losses_static_and_dynamic():
    kd, ce = torch.tensor(4.0), torch.tensor(2.0)
    assert combine_losses(kd, ce, kl_weight=0.5, ce_weight=2.0, dynamic_scaling=False) == 6.0
    dyn = combine_losses(kd, ce, kl_weight=1.0, ce_weight=1.0, dynamic_scaling=True)
    assert dyn.item() == 4.0  # 0.5 * 4 + 2
    zero_kd = combine_losses(
        torch.tensor(0.0), ce, kl_weight=1.0, ce_weight=1.0, dynamic_scaling=True
    )
    assert zero_kd.item() == 2.0


def test_exact_token_match_only_keeps_only_correct_pairs():
    zs, zt = make_logits(11)
    batch = make_batch(11)
    _, metrics = run_api(
        zs, zt, batch, mode="pkl", exact_token_match_only=True, vocab_topk=5, backend="reference"
    )
    kd_sum, n = naive_kd(
        zs, zt, batch, make_projection(), mode="pkl", vocab_topk=5, exact_only=True
    )
    _, all_metrics = run_api(zs, zt, batch, mode="pkl", vocab_topk=5, backend="reference")
    assert 0 < n < all_metrics["num_valid_chunks"].item()
    assert metrics["num_valid_chunks"].item() == n
    assert metrics["kl_loss"].item() == pytest.approx(kd_sum / n, rel=1e-9)


def test_global_denominators_scale_the_terms():
    zs, zt = make_logits(12)
    batch = make_batch(12)
    _, local = run_api(zs, zt, batch, mode="gold", backend="reference")
    n_chunks = local["num_valid_chunks"].item()
    n_tok = naive_ce(zs, batch)[1]
    loss_fn = CrossTokenizerLoss(
        CrossTokenizerLossConfig(projection=make_projection(), mode="gold")
    )
    _, glob = loss_fn(
        zs, zt, batch, global_valid_chunks=4 * n_chunks, global_valid_tokens=2 * n_tok
    )
    assert glob["kl_loss"].item() == pytest.approx(local["kl_loss"].item() / 4, rel=1e-12)
    assert glob["ce_loss"].item() == pytest.approx(local["ce_loss"].item() / 2, rel=1e-12)
    counts = loss_fn.count_valid([batch, batch])
    assert counts["global_valid_chunks"].tolist() == [2 * n_chunks]
    assert counts["global_valid_tokens"].item() == 2 * n_tok


def test_teacher_lm_head_padding_columns_are_dropped():
    zs, zt = make_logits(13)
    batch = make_batch(13)
    padded = torch.cat([zt, torch.full((B, U, 5), 50.0, dtype=torch.float64)], dim=-1)
    for mode in ("pkl", "gold"):
        _, ref = run_api(zs, zt, batch, mode=mode, vocab_topk=4, backend="reference")
        _, got = run_api(
            zs, padded, batch, mode=mode, vocab_topk=4, teacher_vocab_size=W, backend="reference"
        )
        assert got["kl_loss"].item() == pytest.approx(ref["kl_loss"].item(), rel=1e-12)


def test_projection_file_gives_the_same_loss_as_tensors(tmp_path):
    indices, likelihoods = make_projection()
    path = tmp_path / "proj.pt"
    torch.save({"indices": indices, "likelihoods": likelihoods}, path)
    zs, zt = make_logits(14)
    batch = make_batch(14)
    for mode in ("pkl", "gold", "xtoken"):
        _, from_tensors = run_api(zs, zt, batch, mode=mode, vocab_topk=6, backend="reference")
        _, from_file = run_api(
            zs, zt, batch, projection=str(path), mode=mode, vocab_topk=6, backend="reference"
        )
        assert from_file["kl_loss"].item() == pytest.approx(
            from_tensors["kl_loss"].item(), rel=1e-12
        )


@pytest.mark.parametrize("interpret", [False, True], ids=["torch-fallback", "triton-interpret"])
@pytest.mark.parametrize("mode", ["pkl", "gold", "xtoken"])
def test_kernel_backend_matches_reference_values_and_gradients(mode, interpret, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1" if interpret else "0")
    zs, zt = make_logits(15)
    batch = make_batch(15)
    results = {}
    for backend in ("reference", "kernel"):
        zs.grad = None
        loss, metrics = run_api(zs, zt, batch, mode=mode, vocab_topk=6, backend=backend)
        loss.backward()
        results[backend] = (loss.detach(), zs.grad.clone(), metrics)
    torch.testing.assert_close(results["kernel"][0], results["reference"][0], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(results["kernel"][1], results["reference"][1], rtol=1e-5, atol=1e-9)
    for key in METRIC_KEYS:
        torch.testing.assert_close(
            results["kernel"][2][key], results["reference"][2][key], rtol=1e-6, atol=1e-9
        )


def test_kernel_gold_takes_logits_whose_vocab_dim_is_strided(monkeypatch):
    # [B, T, V] views of [B, V, T] storage: the backend copies them once, and the gradient
    # reaches the strided leaf as the reference's does
    device = _kernel_device(monkeypatch)
    zs, zt = make_logits(17)
    zs_st = zs.detach().float().transpose(1, 2).contiguous().transpose(1, 2).to(device)
    zt_st = zt.float().transpose(1, 2).contiguous().transpose(1, 2).to(device)
    assert zs_st.stride(-1) != 1 and zt_st.stride(-1) != 1
    batch = _on(device, make_batch(17))
    got = {}
    for backend in ("reference", "kernel"):
        leaf = zs_st.clone().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
        loss, _ = run_api(leaf, zt_st, batch, mode="gold", backend=backend)
        loss.backward()
        got[backend] = (loss.detach(), leaf.grad)
    torch.testing.assert_close(got["kernel"][0], got["reference"][0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got["kernel"][1], got["reference"][1], rtol=1e-4, atol=1e-7)


def test_bf16_logits_are_computed_in_fp32_close_to_the_fp64_result():
    zs, zt = make_logits(16)
    batch = make_batch(16)
    _, ref = run_api(zs, zt, batch, mode="gold", backend="reference")
    zs16 = zs.detach().to(torch.bfloat16).requires_grad_()
    loss16, got = run_api(zs16, zt.to(torch.bfloat16), batch, mode="gold", backend="reference")
    assert loss16.dtype == torch.float32
    assert got["kl_loss"].item() == pytest.approx(ref["kl_loss"].item(), rel=3e-2)
    loss16.backward()
    assert zs16.grad.dtype == torch.bfloat16 and torch.isfinite(zs16.grad.float()).all()


# ----------------------------------------------------------------------------- bad input


def _kernel_device(monkeypatch) -> str:
    """Where the kernel backend's tests run: CUDA when there is one, else the CPU with the Triton
    interpreter switched on for this test (interpreted kernels on CPU tensors only)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return "cuda"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return "cpu"


def _on(device, batch):
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def _call(zs=None, zt=None, batch=None, **cfg):
    zs_, zt_ = make_logits(20)
    return run_api(
        zs if zs is not None else zs_,
        zt if zt is not None else zt_,
        batch if batch is not None else make_batch(20),
        **cfg,
    )


def test_student_logits_of_the_wrong_length_are_rejected_naming_the_alignment():
    zs, _ = make_logits(20)
    with pytest.raises(ValueError, match="alignment_student_chunk_id"):
        _call(zs=zs[:, :-1])


def test_teacher_logits_of_the_wrong_length_are_rejected_naming_the_alignment():
    _, zt = make_logits(20)
    with pytest.raises(ValueError, match="alignment_teacher_chunk_id"):
        _call(zt=zt[:, :-2])


def test_chunk_ids_out_of_range_are_rejected():
    batch = make_batch(20)
    batch["alignment_teacher_chunk_id"][0, 0] = C
    with pytest.raises(ValueError, match=r"alignment_teacher_chunk_id has ids in \[-1, 7\]"):
        _call(batch=batch)


def test_projection_wider_than_the_student_vocab_is_rejected():
    indices, likelihoods = make_projection(V=V + 2)
    for mode in ("pkl", "gold"):
        with pytest.raises(ValueError, match="student rows"):
            _call(projection=(indices, likelihoods), mode=mode)


def test_projection_wider_than_the_teacher_vocab_is_rejected():
    indices, likelihoods = make_projection()
    indices[7, 0] = W + 3
    with pytest.raises(ValueError, match=f"teacher id {W + 3}"):
        _call(projection=(indices, likelihoods), mode="pkl")


@pytest.mark.parametrize("which", ["student_logits", "teacher_logits"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_are_rejected_naming_the_tensor(which, bad):
    zs, zt = make_logits(20)
    zs = zs.detach().clone()
    (zs if which == "student_logits" else zt)[1, 2, 3] = bad
    with pytest.raises(ValueError, match=f"{which} holds NaN or inf"):
        _call(zs=zs, zt=zt)


def test_wrong_number_of_teacher_logits_is_rejected():
    _, zt = make_logits(20)
    with pytest.raises(ValueError, match="2 teacher logits for 1 teachers"):
        _call(zt=[zt, zt])


def test_teacher_logits_that_are_not_tensors_are_rejected_naming_the_teacher():
    with pytest.raises(ValueError, match="teacher logits 0 is a list, not a tensor"):
        _call(zt=[[1.0, 2.0]])


def test_teacher_logits_narrower_than_the_teacher_vocab_are_rejected():
    with pytest.raises(ValueError, match="teacher_vocab_size is 20"):
        _call(teacher_vocab_size=20)


def test_missing_input_ids_with_ce_weight_is_rejected_but_allowed_without():
    batch = make_batch(20)
    del batch["input_ids"]
    with pytest.raises(ValueError, match="no input_ids"):
        _call(batch=batch)
    loss, metrics = _call(batch=batch, ce_weight=0.0)
    assert metrics["ce_loss"].item() == 0.0 and torch.isfinite(loss)


def test_ce_targets_outside_the_student_vocab_are_rejected():
    batch = make_batch(20)
    batch["input_ids"][0, 5] = V
    batch["token_mask"][0, 5] = True
    with pytest.raises(ValueError, match=f"input_ids hold {V}"):
        _call(batch=batch)


@pytest.mark.parametrize("mode", ["pkl", "gold"])
def test_kernel_backend_rejects_bad_values_after_its_single_readback(mode, monkeypatch):
    device = _kernel_device(monkeypatch)
    zs, zt = make_logits(20)  # fp32: the fused path
    zs, zt = zs.detach().float().to(device).requires_grad_(), zt.float().to(device)
    batch = make_batch(20)
    batch["alignment_student_chunk_id"][1, 3] = -2
    with pytest.raises(ValueError, match=r"alignment_student_chunk_id has ids in \[-2, "):
        _call(zs=zs, zt=zt, batch=_on(device, batch), mode=mode, backend="kernel")
    batch = make_batch(20)
    batch["input_ids"][1, 4] = -1
    batch["token_mask"][1, 4] = True
    with pytest.raises(ValueError, match="input_ids hold -1"):
        _call(zs=zs, zt=zt, batch=_on(device, batch), mode=mode, backend="kernel")
    zt[0, 1, 2] = float("nan")
    with pytest.raises(ValueError, match="teacher_logits holds NaN or inf"):
        _call(zs=zs, zt=zt, batch=_on(device, make_batch(20)), mode=mode, backend="kernel")


@pytest.mark.parametrize("which", ["student_logits", "teacher_logits"])
def test_kernel_backend_gold_rejects_inf_in_a_row_outside_every_chunk(which, monkeypatch):
    # gold takes its finite checks from the row logsumexps' row sums: rows of no chunk count too
    device = _kernel_device(monkeypatch)
    zs, zt = make_logits(20)
    zs, zt = zs.detach().float().clone(), zt.float().clone()
    batch = make_batch(20)
    ids = batch[
        "alignment_student_chunk_id" if which == "student_logits" else "alignment_teacher_chunk_id"
    ]
    ids[0, -1] = -1  # the last position: never a target either
    (zs if which == "student_logits" else zt)[0, -1, 2] = float("inf")
    zs, zt = zs.to(device).requires_grad_(), zt.to(device)
    with pytest.raises(ValueError, match=f"{which} holds NaN or inf"):
        _call(zs=zs, zt=zt, batch=_on(device, batch), mode="gold", backend="kernel")


@pytest.mark.parametrize("mode", ["pkl", "gold"])
def test_kernel_backend_gives_the_same_loss_with_and_without_input_checks(mode, monkeypatch):
    device = _kernel_device(monkeypatch)
    zs, zt = make_logits(21)  # fp32: the fused path (fp64 takes the reference backend)
    zs, zt = zs.detach().float().to(device).requires_grad_(), zt.float().to(device)
    batch = _on(device, make_batch(21))
    got = {}
    for check in (True, False):
        zs.grad = None
        loss, metrics = run_api(
            zs, zt, batch, mode=mode, vocab_topk=6, backend="kernel", check_inputs=check
        )
        loss.backward()
        got[check] = (loss.detach(), zs.grad.clone(), metrics["num_valid_chunks"])
    assert got[True][2].item() > 0
    for a, b in zip(got[True], got[False], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_missing_alignment_keys_are_rejected():
    batch = make_batch(20)
    del batch["alignment_pair_valid"]
    with pytest.raises(ValueError, match="alignment_pair_valid"):
        _call(batch=batch)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["pkl", "gold", "xtoken"])
def test_kernel_backend_matches_reference_on_cuda_with_bf16_logits(mode):
    g = torch.Generator().manual_seed(30)
    Bn, Tn, Vn, Wn = 2, 257, 1031, 997
    batch = make_alignment(31, Bn=Bn, Tn=Tn, Un=Tn, Cn=200)
    batch = {k: v.cuda() for k, v in batch.items()}
    indices = torch.randint(0, Wn, (Vn, K), generator=g)
    likelihoods = torch.rand(Vn, K, generator=g) + 0.1
    indices[:300, 0], indices[:300, 1:], likelihoods[:300] = (
        torch.arange(300).view(-1, 1)[:, 0],
        -1,
        torch.tensor([1.0, 0, 0]),
    )
    zs = (3 * torch.randn(Bn, Tn, Vn, generator=g)).to(torch.bfloat16).cuda().requires_grad_()
    zt = (3 * torch.randn(Bn, Tn, Wn, generator=g)).to(torch.bfloat16).cuda()
    out = {}
    for backend in ("reference", "kernel"):
        zs.grad = None
        loss, _ = run_api(
            zs,
            zt,
            batch,
            projection=(indices, likelihoods),
            mode=mode,
            vocab_topk=500,
            ce_weight=0.0,
            temperature=2.0,
            backend=backend,
        )
        loss.backward()
        out[backend] = (loss.detach().float(), zs.grad.float().clone())
    torch.testing.assert_close(out["kernel"][0], out["reference"][0], rtol=1e-4, atol=1e-6)
    # bf16 gradients: a few entries near zero differ by ~0.2% of the largest entry (the L1
    # subgradient flips sign where |s - u| rounds across 0 in one path and not the other).
    scale = out["reference"][1].abs().max().item()
    torch.testing.assert_close(out["kernel"][1], out["reference"][1], rtol=2e-2, atol=5e-3 * scale)


# ----------------------------------------------------------------------------- input checks and edge cases


@pytest.mark.parametrize("mode", ["pkl", "gold", "xtoken"])
@pytest.mark.parametrize("source", ["tensors", "file"])
def test_teacher_logits_narrower_than_the_projection_teacher_ids_are_rejected(
    mode, source, tmp_path
):
    indices, likelihoods = make_projection()  # teacher ids up to W - 1
    projection = (indices, likelihoods)
    if source == "file":
        projection = str(tmp_path / "proj.pt")
        torch.save({"indices": indices, "likelihoods": likelihoods}, projection)
    zs, zt = make_logits(21)
    narrow = zt[..., : W - 3]
    with pytest.raises(ValueError, match=rf"teacher id {W - 1}.*{W - 3}"):
        _call(zs=zs, zt=narrow, projection=projection, mode=mode, backend="reference")


@pytest.mark.parametrize("mode", ["pkl", "gold", "xtoken"])
@pytest.mark.parametrize("vocab_topk", [None, 4])
def test_empty_batch_gives_a_zero_loss_with_a_gradient(mode, vocab_topk):
    zs, zt = make_logits(22, Bn=0)
    batch = make_batch(22, Bn=0)
    loss, metrics = run_api(zs, zt, batch, mode=mode, vocab_topk=vocab_topk, backend="reference")
    assert loss.item() == 0.0 and metrics["num_valid_chunks"].item() == 0
    loss.backward()
    assert zs.grad.shape == zs.shape


@pytest.mark.parametrize("backend", ["reference", "kernel"])
@pytest.mark.parametrize(
    "value,match",
    [
        (float("nan"), "global_valid_chunks.*nan.*finite"),
        (float("inf"), "global_valid_chunks.*inf.*finite"),
        (-1.0, r"global_valid_chunks.*-1.*at least"),
        (1.0, r"global_valid_chunks.*1.*at least.*valid chunks"),
    ],
)
def test_global_valid_chunks_not_finite_or_below_the_local_count_is_rejected(backend, value, match):
    zs, zt = make_logits(23)
    batch = make_batch(23)
    _, metrics = run_api(zs, zt, batch, backend="reference")
    assert metrics["num_valid_chunks"].item() > 1
    loss_fn = CrossTokenizerLoss(
        CrossTokenizerLossConfig(projection=make_projection(), backend=backend)
    )
    with pytest.raises(ValueError, match=match):
        loss_fn(zs, zt, batch, global_valid_chunks=value)
    with pytest.raises(ValueError, match=match):
        loss_fn(zs, zt, batch, global_valid_chunks=torch.tensor([value]))


def test_global_valid_chunks_at_or_above_the_local_count_is_used():
    zs, zt = make_logits(23)
    batch = make_batch(23)
    loss_fn = CrossTokenizerLoss(
        CrossTokenizerLossConfig(projection=make_projection(), backend="reference")
    )
    _, local = loss_fn(zs, zt, batch)
    n = local["num_valid_chunks"].item()
    _, glob = loss_fn(zs, zt, batch, global_valid_chunks=n)
    assert glob["kl_loss"].item() == pytest.approx(local["kl_loss"].item(), rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.bool])
@pytest.mark.parametrize("field", ["student_chunk_id", "teacher_chunk_id"])
def test_chunk_ids_of_a_non_integer_dtype_are_refused_naming_the_dtype(dtype, field):
    batch = make_batch(24)
    batch[f"alignment_{field}"] = batch[f"alignment_{field}"].to(dtype)
    loss_fn = CrossTokenizerLoss(CrossTokenizerLossConfig(projection=make_projection()))
    for call in (lambda: _call(batch=batch), lambda: loss_fn.count_valid([batch])):
        with pytest.raises(ValueError, match=rf"alignment_{field}.*{dtype}"):
            call()


def _topk_columns_case():
    """Teacher logits whose largest values sit where no chunk reads them (the last position and
    a padded tail), so that the two column rules pick different columns."""
    zs, zt = make_logits(25)
    batch = make_batch(25)
    zt = zt.clone()
    zt[:, -1, :3] = 40.0  # the last position never belongs to a (shifted) chunk
    batch["alignment_teacher_chunk_id"][0, -3:] = -1  # a padded tail
    zt[0, -4:, 3] = 40.0
    return zs, zt, batch


@pytest.mark.parametrize("reverse", [False, True])
def test_topk_columns_all_matches_the_nemo_rule_and_differs_from_valid(reverse):
    zs, zt, batch = _topk_columns_case()
    got = {}
    for rule in ("valid", "all"):
        _, metrics = run_api(
            zs,
            zt,
            batch,
            vocab_topk=4,
            topk_columns=rule,
            reverse_kl=reverse,
            ce_weight=0.0,
            backend="reference",
        )
        kd_sum, n = naive_kd(
            zs,
            zt,
            batch,
            make_projection(),
            mode="pkl",
            vocab_topk=4,
            topk_columns=rule,
            reverse=reverse,
        )
        assert metrics["kl_loss"].item() == pytest.approx(kd_sum / n, rel=1e-9)
        got[rule] = metrics["kl_loss"].item()
    assert got["all"] != pytest.approx(got["valid"], rel=1e-3)
    _, every = run_api(zs, zt, batch, vocab_topk=None, topk_columns="valid", backend="reference")
    _, every_all = run_api(zs, zt, batch, vocab_topk=None, topk_columns="all", backend="reference")
    assert every["kl_loss"].item() == every_all["kl_loss"].item()  # k >= W: the same columns


@pytest.mark.parametrize("rule", ["valid", "all"])
@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.float32], ids=["reference-fallback", "kernels"]
)
def test_topk_columns_rule_is_the_same_in_the_kernel_backend(rule, dtype, monkeypatch):
    device = _kernel_device(monkeypatch)
    zs, zt, batch = _topk_columns_case()
    zs, zt, batch = (
        zs.detach().to(device, dtype).requires_grad_(),
        zt.to(device),
        _on(device, batch),
    )
    results = {}
    for backend in ("reference", "kernel"):
        zs.grad = None
        loss, _ = run_api(
            zs,
            zt.to(dtype),
            batch,
            vocab_topk=4,
            topk_columns=rule,
            ce_weight=0.0,
            backend=backend,
        )
        loss.backward()
        results[backend] = (loss.detach(), zs.grad.clone())
    tol = dict(rtol=1e-5, atol=1e-7)  # the kernels project in fp32 (as the existing check)
    torch.testing.assert_close(results["kernel"][0], results["reference"][0], **tol)
    torch.testing.assert_close(results["kernel"][1], results["reference"][1], **tol)
