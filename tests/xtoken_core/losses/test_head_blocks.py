"""Row blocks of the fused head: every row that reaches the loss once, no chunk split between
blocks, and each block's re-based alignment naming the same chunks, targets and validity as the
micro-batch (property tests over random alignments)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.xtoken_core.losses.test_loss import make_projection
from xtoken_core.losses import CrossTokenizerLossConfig
from xtoken_core.losses.alignment import alignment_from_batch, shift_chunk_ids, valid_chunks
from xtoken_core.losses.head_blocks import (
    block_ends,
    cut_allowed,
    live_rows,
    plan_blocks,
    row_targets,
)


def random_batch(seed: int, num_teachers: int = 1) -> dict[str, torch.Tensor]:
    """A padded micro-batch with random chunks (lengths 1-5 on both sides, gaps of unchunked
    tokens, chunk ids in a random order, invalid pairs, a masked sample, a padded tail)."""
    g = torch.Generator().manual_seed(seed)

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (), generator=g))

    B, T = randint(1, 3), randint(2, 24)
    batch = {
        "input_ids": torch.randint(0, 50, (B, T), generator=g),
        "token_mask": torch.rand(B, T, generator=g) > 0.2,
        "sample_mask": torch.rand(B, generator=g) > 0.2,
    }
    for i in range(num_teachers):
        U, C = randint(2, 24), randint(1, 9)
        s_ids = torch.full((B, T), -1, dtype=torch.long)
        t_ids = torch.full((B, U), -1, dtype=torch.long)
        for b in range(B):
            order = torch.randperm(C, generator=g)
            ps, pt = randint(0, 2), randint(0, 2)
            for c in order.tolist():
                ls, lt = randint(1, 5), randint(1, 5)
                if ps + ls > T or pt + lt > U:
                    break
                s_ids[b, ps : ps + ls] = c
                t_ids[b, pt : pt + lt] = c
                ps, pt = ps + ls + randint(0, 1), pt + lt + randint(0, 1)
        pair_valid = torch.rand(B, C, generator=g) > 0.2
        prefix = f"teacher{i}_alignment_"
        batch[prefix + "student_chunk_id"] = s_ids
        batch[prefix + "teacher_chunk_id"] = t_ids
        batch[prefix + "pair_valid"] = pair_valid
        batch[prefix + "pair_is_correct"] = pair_valid & (torch.rand(B, C, generator=g) > 0.3)
    return batch


def _chunk_rows(batch, i):
    """{(b, c): flat rows} of teacher i's chunks on the student side (shifted ids)."""
    s = shift_chunk_ids(alignment_from_batch(batch, i).student_chunk_id)
    T = s.shape[1]
    out: dict[tuple[int, int], set[int]] = {}
    for b, p in (s >= 0).nonzero().tolist():
        out.setdefault((b, int(s[b, p])), set()).add(b * T + p)
    return out


def _config(**kw):
    return CrossTokenizerLossConfig(projection=make_projection(), **kw)


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    target=st.integers(1, 12),
    num_teachers=st.integers(0, 2),
)
def test_blocks_cover_every_live_row_once_and_never_split_a_chunk(seed, target, num_teachers):
    batch = random_batch(seed, num_teachers)
    blocks = plan_blocks(batch, num_teachers, target)
    rows = torch.cat([b.rows_L for b in blocks])
    targets = row_targets(batch, num_teachers)
    assert torch.equal(rows, live_rows(targets))  # each once, in order
    block_of = {int(r): k for k, b in enumerate(blocks) for r in b.rows_L}
    for i in range(num_teachers):
        for chunk, members in _chunk_rows(batch, i).items():
            assert len({block_of[r] for r in members}) == 1, (chunk, members)
    for block in blocks:  # a block past the target holds a chunk no smaller block can end
        L = block.rows_L.numel()
        if L > target:
            keys = [targets.keys[i][block.rows_L] for i in range(num_teachers)]
            for k in range(1, target + 1):
                assert any(
                    bool(torch.isin(key[:k][key[:k] >= 0], key[k:]).any()) for key in keys
                ), f"a cut after {k} rows splits nothing, yet the block has {L} > {target}"


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), target=st.integers(1, 12))
def test_a_block_batch_names_the_chunks_targets_and_validity_of_the_micro_batch(seed, target):
    batch = random_batch(seed, 2)
    B, T = batch["input_ids"].shape
    sample = batch["sample_mask"]
    for block in plan_blocks(batch, 2, target):
        rows, bb = block.rows_L, block.batch
        L = rows.numel()
        b_L, p_L = rows // T, rows % T
        has_next = p_L + 1 < T
        # CE: position j + 1 of the block holds the target of row j
        nxt = torch.where(has_next, p_L + 1, 0)
        want_mask = has_next & batch["token_mask"][b_L, nxt] & sample[b_L]
        assert torch.equal(bb["token_mask"][0, 1:], want_mask)
        ids = bb["input_ids"][0, 1:]
        assert torch.equal(ids[want_mask], batch["input_ids"][b_L, nxt][want_mask])
        assert not bool(bb["token_mask"][0, 0])
        for i in range(2):
            prefix = f"teacher{i}_alignment_"
            glob_s = shift_chunk_ids(batch[prefix + "student_chunk_id"])[b_L, p_L]
            glob_t = shift_chunk_ids(batch[prefix + "teacher_chunk_id"]).reshape(-1)
            U = batch[prefix + "teacher_chunk_id"].shape[1]
            new_s = shift_chunk_ids(bb[prefix + "student_chunk_id"])[0]
            assert new_s.numel() == L + 1 and int(new_s[L]) == -1  # the filler row
            assert torch.equal(new_s[:L] >= 0, glob_s >= 0)
            pv = bb[prefix + "pair_valid"][0]
            K = pv.numel() - 1
            # one block slot per global chunk of the block, and back
            slot_of: dict[int, tuple[int, int]] = {}
            for j in (glob_s >= 0).nonzero().view(-1).tolist():
                key = (int(b_L[j]), int(glob_s[j]))
                assert slot_of.setdefault(int(new_s[j]), key) == key
            assert len(set(slot_of.values())) == len(slot_of) == K
            for slot, (b, c) in slot_of.items():
                assert bool(pv[slot]) == bool(batch[prefix + "pair_valid"][b, c] & sample[b])
                pc = bb[prefix + "pair_is_correct"][0, slot]
                assert bool(pc) == bool(batch[prefix + "pair_is_correct"][b, c])
            assert not bool(pv[K])  # the sentinel slot never counts
            # teacher rows: [fill, the rows of the block's valid chunks, fill]
            t_rows = block.teacher_rows[i]
            new_t = shift_chunk_ids(bb[prefix + "teacher_chunk_id"])[0]
            assert int(t_rows[0]) == int(t_rows[-1]) == -1
            assert int(new_t[0]) == K and int(new_t[-1]) == -1
            inner = t_rows[1:-1]
            want = [
                q
                for q in range(glob_t.numel())
                if int(glob_t[q]) >= 0
                and (q // U, int(glob_t[q])) in slot_of.values()
                and bool(pv[[s for s, k in slot_of.items() if k == (q // U, int(glob_t[q]))][0]])
            ]
            assert inner.tolist() == want
            for pos, q in enumerate(inner.tolist()):
                assert slot_of[int(new_t[pos + 1])] == (q // U, int(glob_t[q]))


@pytest.mark.parametrize("exact_only", [False, True])
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), target=st.integers(1, 12))
def test_valid_chunks_of_the_blocks_add_up_to_the_micro_batch(seed, target, exact_only):
    batch = random_batch(seed, 1)
    config = _config(exact_token_match_only=exact_only)
    glob = valid_chunks(alignment_from_batch(batch, 0), config, batch["sample_mask"])[2]
    parts = [
        valid_chunks(alignment_from_batch(b.batch, 0), config, None)[2].sum()
        for b in plan_blocks(batch, 1, target)
    ]
    assert int(sum(parts)) == int(glob.sum())


def test_a_chunk_longer_than_the_block_grows_the_block_to_its_end():
    B, T = 1, 12
    s_ids = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 2, -1]])
    batch = {
        "input_ids": torch.arange(T)[None],
        "token_mask": torch.ones(B, T, dtype=torch.bool),
        "alignment_student_chunk_id": s_ids,
        "alignment_teacher_chunk_id": torch.tensor([[0, 1, 2, 2, -1]]),
        "alignment_pair_valid": torch.ones(B, 3, dtype=torch.bool),
    }
    blocks = plan_blocks(batch, 1, 3)
    # shifted: row p is in the chunk of token p + 1: rows 0 | 1-7 (chunk 1) | 8-9 | 10
    assert [b.rows_L.tolist() for b in blocks] == [[0], list(range(1, 8)), [8, 9, 10]]


def test_block_ends_stops_at_the_last_cut_within_the_target():
    allowed = torch.tensor([True, False, True, True, False, False, True])
    assert block_ends(allowed, 2) == [(0, 2), (2, 3), (3, 6)]
    assert block_ends(allowed, 10) == [(0, 6)]
    assert block_ends(torch.tensor([True]), 4) == [(0, 0)]
    with pytest.raises(ValueError, match="target_rows=0"):
        block_ends(allowed, 0)


def test_rows_without_a_chunk_or_a_ce_target_are_skipped():
    batch = {
        "input_ids": torch.arange(6)[None].repeat(2, 1),
        "token_mask": torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool),
        "sample_mask": torch.tensor([True, False]),
    }
    targets = row_targets(batch, 0)
    # row p predicts token p + 1: rows 0-2 of the first sample; the second is masked
    assert live_rows(targets).tolist() == [0, 1, 2]
    assert cut_allowed(targets, live_rows(targets)).all()  # CE alone: any cut
