"""Projection files: both layouts, every error case, cached matrices and the exact-token map."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from xtoken_core.data import projection as P


@pytest.fixture(autouse=True)
def _fresh_caches():
    P.clear_projection_caches()
    yield
    P.clear_projection_caches()


def _save(tmp_path, obj, name="proj.pt"):
    path = tmp_path / name
    torch.save(obj, path)
    return path


def _dense(indices, likelihoods):
    return {
        "indices": torch.tensor(indices, dtype=torch.long),
        "likelihoods": torch.tensor(likelihoods, dtype=torch.float32),
    }


DENSE = _dense([[2, -1], [0, 3], [-1, -1]], [[1.0, 0.0], [0.7, 0.3], [0.0, 0.0]])


# ---------------------------------------------------------------- parse: dense and sparse


def test_dense_file_parses_to_row_major_coo_keeping_minus_one(tmp_path):
    indices, values, v_s, v_t = P.parse_projection_file(_save(tmp_path, DENSE))
    assert indices.dtype == torch.long and values.dtype == torch.float32
    assert indices.tolist() == [[0, 0, 1, 1, 2, 2], [2, -1, 0, 3, -1, -1]]
    assert values.tolist() == pytest.approx([1.0, 0.0, 0.7, 0.3, 0.0, 0.0])
    assert (v_s, v_t) == (3, 4)


def test_dense_file_with_only_minus_one_infers_zero_teacher_vocab(tmp_path):
    _, _, v_s, v_t = P.parse_projection_file(_save(tmp_path, _dense([[-1], [-1]], [[0.0], [0.0]])))
    assert (v_s, v_t) == (2, 0)


def test_dense_file_with_narrow_dtypes_is_upcast(tmp_path):
    obj = {
        "indices": torch.tensor([[1, -1]], dtype=torch.int32),
        "likelihoods": torch.tensor([[1.0, 0.0]], dtype=torch.bfloat16),
        "meta": {"student": "a", "teacher": "b"},
    }
    indices, values, _, _ = P.parse_projection_file(_save(tmp_path, obj))
    assert indices.dtype == torch.long and values.dtype == torch.float32


def test_safetensors_dense_file_parses_like_torch_save(tmp_path):
    path = tmp_path / "proj.safetensors"
    save_file(DENSE, str(path))
    got = P.parse_projection_file(path)
    want = P.parse_projection_file(_save(tmp_path, DENSE))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2:] == want[2:]


def test_safetensors_is_detected_by_content_without_suffix(tmp_path):
    path = tmp_path / "proj.bin"
    save_file(DENSE, str(path))
    assert P.parse_projection_file(path)[2] == 3


def test_sparse_file_with_tuple_keys_loads_under_weights_only(tmp_path):
    obj = {(0, 5): 2.0, (3, 1): 0.5, (1, -1): 1.0, (2, 2): torch.tensor(0.25)}
    path = _save(tmp_path, obj)
    assert torch.load(path, weights_only=True).keys() == obj.keys()
    indices, values, v_s, v_t = P.parse_projection_file(path)
    assert indices.tolist() == [[0, 3, 1, 2], [5, 1, -1, 2]]
    assert values.tolist() == pytest.approx([2.0, 0.5, 1.0, 0.25])
    assert (v_s, v_t) == (4, 6)


def test_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        P.parse_projection_file(tmp_path / "nope.pt")
    with pytest.raises(FileNotFoundError):
        P.get_sparse_projection_matrix(
            tmp_path / "nope.pt", "cpu", student_vocab_size=1, teacher_vocab_size=1
        )


@pytest.mark.parametrize(
    "obj, match",
    [
        ({"indices": torch.zeros(2, 2, dtype=torch.long)}, "unknown layout"),
        ({"weights": torch.zeros(2)}, "unknown layout"),
        (torch.zeros(3, 3), "unknown layout"),
        ([1, 2, 3], "unknown layout"),
        ({}, "empty dict"),
        ({(0, 1, 2): 1.0}, "unknown layout"),
        (
            {"indices": torch.zeros(2, 2, dtype=torch.long), "likelihoods": torch.zeros(2, 3)},
            "shape mismatch",
        ),
        ({"indices": torch.zeros(2, dtype=torch.long), "likelihoods": torch.zeros(2)}, "2-D"),
        (
            {"indices": torch.zeros(0, 2, dtype=torch.long), "likelihoods": torch.zeros(0, 2)},
            "empty",
        ),
        (_dense([[1, -2]], [[1.0, 0.0]]), "-2 is negative"),
        ({(0, -3): 1.0}, "-3 is negative"),
        ({(-1, 2): 1.0}, "student id -1 is negative"),
        (_dense([[1, 2]], [[float("nan"), 0.0]]), "not finite"),
        (_dense([[1, 2]], [[0.5, float("inf")]]), "not finite"),
        ({(0, 1): float("nan")}, "not finite"),
        ({"indices": torch.zeros(1, 2), "likelihoods": torch.zeros(1, 2)}, "integer"),
        ({(0.5, 1): 1.0}, "non-integer"),
        ({("a", 1): 1.0}, "non-integer"),
        ({(True, 1): 1.0}, "non-integer"),
        ({(0, 1): "heavy"}, "not a number"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_invalid_files_raise_value_error_naming_the_problem(tmp_path, obj, match):
    with pytest.raises(ValueError, match=match):
        P.parse_projection_file(_save(tmp_path, obj))


def test_file_that_needs_code_to_load_is_refused(tmp_path):
    path = _save(tmp_path, {(np.int64(0), 1): 1.0})
    with pytest.raises(ValueError, match="without running code"):
        P.parse_projection_file(path)


def test_garbage_file_raises_value_error(tmp_path):
    path = tmp_path / "junk.pt"
    path.write_bytes(b"this is not a checkpoint at all")
    with pytest.raises(ValueError, match="not a torch.save file"):
        P.parse_projection_file(path)


# ---------------------------------------------------------------- sparse matrix and caches


def test_sparse_matrix_drops_minus_one_and_sizes_by_config_or_observation(tmp_path):
    path = _save(tmp_path, DENSE)
    m = P.get_sparse_projection_matrix(path, "cpu", student_vocab_size=10, teacher_vocab_size=2)
    assert m.is_sparse and m.is_coalesced() and m.dtype == torch.float32
    assert tuple(m.shape) == (10, 4)  # student from config, teacher from the observed id 3
    dense = m.to_dense()
    assert dense[0].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert dense[1].tolist() == pytest.approx([0.7, 0.0, 0.0, 0.3])
    assert m._nnz() == 3


def test_sparse_matrix_sums_duplicate_entries(tmp_path):
    path = _save(tmp_path, _dense([[1, 1]], [[0.25, 0.5]]))
    m = P.get_sparse_projection_matrix(path, "cpu", student_vocab_size=0, teacher_vocab_size=0)
    assert tuple(m.shape) == (1, 2) and m._nnz() == 1
    assert m.to_dense()[0, 1].item() == pytest.approx(0.75)


def test_sparse_matrix_is_cached_per_file_device_and_sizes(tmp_path):
    path = _save(tmp_path, DENSE)
    a = P.get_sparse_projection_matrix(path, "cpu", student_vocab_size=3, teacher_vocab_size=4)
    same_file_other_spelling = os.path.join(str(tmp_path), ".", "proj.pt")
    b = P.get_sparse_projection_matrix(
        same_file_other_spelling, torch.device("cpu"), student_vocab_size=3, teacher_vocab_size=4
    )
    c = P.get_sparse_projection_matrix(path, "cpu", student_vocab_size=5, teacher_vocab_size=4)
    assert a is b
    assert c is not a and tuple(c.shape) == (5, 4)
    P.clear_projection_caches()
    d = P.get_sparse_projection_matrix(path, "cpu", student_vocab_size=3, teacher_vocab_size=4)
    assert d is not a and torch.equal(d.to_dense(), a.to_dense())


def test_rewritten_file_is_reloaded_and_old_entry_evicted(tmp_path):
    path = _save(tmp_path, DENSE)
    a = P.get_sparse_projection_matrix(path, "cpu", student_vocab_size=3, teacher_vocab_size=4)
    torch.save(_dense([[0, -1], [1, -1], [2, -1], [3, -1]], [[1.0, 0.0]] * 4), path)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10_000_000))
    b = P.get_sparse_projection_matrix(path, "cpu", student_vocab_size=3, teacher_vocab_size=4)
    assert b is not a and tuple(b.shape) == (4, 4)
    assert len(P._OPEN) == 1


def test_sparse_matrix_rejects_bad_sizes(tmp_path):
    path = _save(tmp_path, DENSE)
    with pytest.raises(ValueError, match="student_vocab_size"):
        P.get_sparse_projection_matrix(path, "cpu", student_vocab_size=-1, teacher_vocab_size=4)
    with pytest.raises(ValueError, match="teacher_vocab_size"):
        P.get_sparse_projection_matrix(path, "cpu", student_vocab_size=1, teacher_vocab_size=2.0)


def test_sparse_matrix_from_sparse_layout(tmp_path):
    path = _save(tmp_path, {(0, 5): 2.0, (3, 1): 0.5, (1, -1): 1.0})
    m = P.get_sparse_projection_matrix(path, "cpu", student_vocab_size=2, teacher_vocab_size=2)
    assert tuple(m.shape) == (4, 6) and m._nnz() == 2


def test_topk_projection_is_cached_and_rejects_sparse_layout(tmp_path):
    path = _save(tmp_path, DENSE)
    indices, likelihoods = P.get_topk_projection(path, "cpu")
    assert torch.equal(indices, DENSE["indices"]) and torch.equal(likelihoods, DENSE["likelihoods"])
    assert P.get_topk_projection(path, "cpu")[0] is indices
    sparse = _save(tmp_path, {(0, 1): 1.0}, name="sparse.pt")
    with pytest.raises(ValueError, match="sparse"):
        P.get_topk_projection(sparse, "cpu")
    with pytest.raises(ValueError, match="sparse"):
        P.build_exact_token_map(sparse, "cpu", xtoken_loss=False, teacher_vocab_size=4)


# ---------------------------------------------------------------- exact-token map

# Student rows (teacher vocab 6):
#  0: one-hot -> 2            strict yes, relaxed yes (1.0)
#  1: one-hot -> 2            collides with 0 on teacher 2: loses in both modes (student 0 lower)
#  2: weight 1.0 but slot 1 holds teacher 4 with weight 0 -> strict no; relaxed yes (1.0) -> 3
#  3: [0.7 -> 4, 0.3 -> 5]    strict no; relaxed candidate for 4 (0.7)
#  4: [0.2 -> 5, 0.8 -> 4]    unsorted: top is slot 1; relaxed candidate for 4 (0.8) -> wins over 3
#  5: [0.6 -> 1, 0.4 -> 0]    relaxed yes (exactly at threshold)
#  6: [0.6 -> 1, 0.4 -> 3]    ties with 5 on teacher 1: student 5 (lower) wins
#  7: [0.5 -> 0, 0.5 -> 5]    no mapping in either mode
#  8: one-hot -> 9            outside the teacher vocab: never maps
#  9: [-1, -1]                no entry
EXACT = _dense(
    [[2, -1], [2, -1], [3, 4], [4, 5], [5, 4], [1, 0], [1, 3], [0, 5], [9, -1], [-1, -1]],
    [
        [1.0, 0.0],
        [1.0, 0.0],
        [1.0, 0.0],
        [0.7, 0.3],
        [0.2, 0.8],
        [0.6, 0.4],
        [0.6, 0.4],
        [0.5, 0.5],
        [1.0, 0.0],
        [0.0, 0.0],
    ],
)


def test_strict_exact_map_needs_one_hot_rows_and_lowest_student_wins(tmp_path):
    out = P.build_exact_token_map(
        _save(tmp_path, EXACT), "cpu", xtoken_loss=False, teacher_vocab_size=6
    )
    assert out["common_student"].tolist() == [0]
    assert out["common_teacher"].tolist() == [2]
    assert out["uncommon_student"].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert out["uncommon_teacher"].tolist() == [0, 1, 3, 4, 5]
    assert all(t.dtype == torch.long for t in out.values())


def test_relaxed_exact_map_highest_weight_wins_ties_to_lowest_student(tmp_path):
    out = P.build_exact_token_map(
        _save(tmp_path, EXACT), "cpu", xtoken_loss=True, teacher_vocab_size=6
    )
    assert out["common_student"].tolist() == [0, 2, 4, 5]
    assert out["common_teacher"].tolist() == [2, 3, 4, 1]
    assert out["uncommon_student"].tolist() == [1, 3, 6, 7, 8, 9]
    assert out["uncommon_teacher"].tolist() == [0, 5]


def test_exact_map_teacher_vocab_bounds_the_partition(tmp_path):
    out = P.build_exact_token_map(
        _save(tmp_path, EXACT), "cpu", xtoken_loss=False, teacher_vocab_size=12
    )
    assert out["common_student"].tolist() == [0, 8]
    assert out["common_teacher"].tolist() == [2, 9]
    assert out["uncommon_teacher"].numel() == 12 - 2


def test_exact_map_with_single_slot_rows_uses_weight_only(tmp_path):
    path = _save(tmp_path, _dense([[1], [0], [1]], [[1.0], [0.9], [1.0]]))
    strict = P.build_exact_token_map(path, "cpu", xtoken_loss=False, teacher_vocab_size=2)
    assert strict["common_student"].tolist() == [0]
    relaxed = P.build_exact_token_map(path, "cpu", xtoken_loss=True, teacher_vocab_size=2)
    assert relaxed["common_student"].tolist() == [0, 1]
    assert relaxed["common_teacher"].tolist() == [1, 0]


def test_exact_map_partition_covers_each_vocab_exactly_once(tmp_path):
    gen = torch.Generator().manual_seed(0)
    num_s, num_t, k = 300, 50, 4
    indices = torch.randint(-1, num_t, (num_s, k), generator=gen)
    likelihoods = torch.rand(num_s, k, generator=gen)
    likelihoods[: num_s // 3, 0] = 1.0
    likelihoods[: num_s // 3, 1:] = 0.0
    indices[: num_s // 3, 1:] = -1
    path = _save(tmp_path, {"indices": indices, "likelihoods": likelihoods})
    for relaxed in (False, True):
        out = P.build_exact_token_map(path, "cpu", xtoken_loss=relaxed, teacher_vocab_size=num_t)
        cs, ct = out["common_student"], out["common_teacher"]
        assert torch.equal(
            torch.sort(torch.cat([cs, out["uncommon_student"]]))[0], torch.arange(num_s)
        )
        assert torch.equal(
            torch.sort(torch.cat([ct, out["uncommon_teacher"]]))[0], torch.arange(num_t)
        )
        assert ct.unique().numel() == ct.numel()  # one student per teacher id
        assert torch.all(cs[1:] > cs[:-1])
        assert cs.numel() > 0


def test_exact_map_is_cached_per_mode_and_teacher_vocab(tmp_path):
    path = _save(tmp_path, EXACT)
    a = P.build_exact_token_map(path, "cpu", xtoken_loss=False, teacher_vocab_size=6)
    assert P.build_exact_token_map(path, "cpu", xtoken_loss=False, teacher_vocab_size=6) is a
    assert P.build_exact_token_map(path, "cpu", xtoken_loss=True, teacher_vocab_size=6) is not a
    assert P.build_exact_token_map(path, "cpu", xtoken_loss=False, teacher_vocab_size=7) is not a
    with pytest.raises(ValueError, match="teacher_vocab_size"):
        P.build_exact_token_map(path, "cpu", xtoken_loss=False, teacher_vocab_size=0)


def test_exact_map_in_int32_holds_the_same_ids_and_is_cached(tmp_path):
    # the gold kernels read their column tables in int32
    projection = P.open_projection(_save(tmp_path, EXACT), "cpu")
    wide = projection.exact_map(6, xtoken_loss=False, student_vocab_size=9)
    narrow = projection.exact_map(
        6, xtoken_loss=False, student_vocab_size=9, index_dtype=torch.int32
    )
    assert narrow.keys() == wide.keys()
    for name, ids in narrow.items():
        assert ids.dtype == torch.int32 and torch.equal(ids.long(), wide[name]), name
    again = projection.exact_map(
        6, xtoken_loss=False, student_vocab_size=9, index_dtype=torch.int32
    )
    assert again is narrow


def test_exact_map_on_a_large_vocab_is_vectorized(tmp_path):
    # 150k rows: a per-row Python loop would take seconds; this guards against regressions in
    # shape handling at full-vocab size rather than timing anything.
    num_s = 150_000
    indices = torch.full((num_s, 4), -1, dtype=torch.long)
    indices[:, 0] = torch.arange(num_s) % 32_000
    likelihoods = torch.zeros(num_s, 4)
    likelihoods[:, 0] = 1.0
    path = _save(tmp_path, {"indices": indices, "likelihoods": likelihoods})
    out = P.build_exact_token_map(path, "cpu", xtoken_loss=False, teacher_vocab_size=32_000)
    assert out["common_student"].tolist() == list(range(32_000))
    assert out["uncommon_teacher"].numel() == 0


def test_timestamps_are_part_of_the_cache_key(tmp_path):
    path = _save(tmp_path, EXACT)
    key = P._file_key(path)
    assert key[0] == os.path.realpath(path) and key[1] == os.stat(path).st_mtime_ns


@pytest.mark.gpu
def test_cuda_copies_match_cpu_and_share_one_entry_per_device(tmp_path):
    path = _save(tmp_path, EXACT)
    sizes = {"student_vocab_size": 10, "teacher_vocab_size": 12}
    cpu = P.get_sparse_projection_matrix(path, "cpu", **sizes)
    gpu = P.get_sparse_projection_matrix(path, "cuda", **sizes)
    assert gpu.device.type == "cuda" and gpu.is_coalesced()
    assert P.get_sparse_projection_matrix(path, f"cuda:{gpu.device.index}", **sizes) is gpu
    assert torch.equal(gpu.to_dense().cpu(), cpu.to_dense())
    for relaxed in (False, True):
        on_cpu = P.build_exact_token_map(path, "cpu", xtoken_loss=relaxed, teacher_vocab_size=12)
        on_gpu = P.build_exact_token_map(path, "cuda", xtoken_loss=relaxed, teacher_vocab_size=12)
        for name, tensor in on_gpu.items():
            assert tensor.device.type == "cuda"
            assert torch.equal(tensor.cpu(), on_cpu[name]), name


# ----------------------------------------------------------------------------- tokenizer record


@pytest.fixture(scope="module")
def qwen_deepseek_rows():
    from xtoken_core.data.projection_build import build_projection
    from xtoken_core.tokenizers import load_tokenizer

    s_tok, t_tok = load_tokenizer("qwen3"), load_tokenizer("deepseek")
    return s_tok, t_tok, build_projection(s_tok, t_tok, 2, student_ids=range(64))


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_built_file_records_its_tokenizers_and_is_checked_against_them(
    qwen_deepseek_rows, tmp_path, suffix
):
    from xtoken_core.data.projection import (
        check_projection_tokenizers,
        read_projection_metadata,
    )
    from xtoken_core.data.projection_build import projection_metadata, save_projection
    from xtoken_core.tokenizers import load_tokenizer

    s_tok, t_tok, result = qwen_deepseek_rows
    path = tmp_path / f"proj{suffix}"
    save_projection(result, path, projection_metadata(s_tok, t_tok))
    meta = read_projection_metadata(path)
    assert meta["student"] == s_tok.name and meta["teacher_vocab_size"] == str(t_tok.vocab_size)
    report = check_projection_tokenizers(path, s_tok, t_tok)
    assert report["checked"] and report["usable_rows"] == 64
    assert report["coverage"] == pytest.approx(64 / s_tok.vocab_size)
    other = load_tokenizer("llama3")
    with pytest.raises(ValueError, match=r"built for teacher tokenizer .*deepseek.*llama3"):
        check_projection_tokenizers(path, s_tok, other)
    with pytest.raises(ValueError, match=r"built for student tokenizer"):
        check_projection_tokenizers(path, other, t_tok)


def test_an_older_file_without_the_record_loads_with_a_warning(
    qwen_deepseek_rows, tmp_path, caplog
):
    from xtoken_core.data.projection import check_projection_tokenizers

    s_tok, t_tok, result = qwen_deepseek_rows
    path = tmp_path / "old.pt"
    torch.save(result, path)
    with caplog.at_level("WARNING"):
        report = check_projection_tokenizers(path, s_tok, t_tok)
    assert not report["checked"] and report["usable_rows"] == 64
    assert "cannot be checked" in caplog.text


def test_a_file_without_a_usable_row_is_refused(qwen_deepseek_rows, tmp_path):
    from xtoken_core.data.projection import check_projection_tokenizers
    from xtoken_core.data.projection_build import projection_metadata, save_projection

    s_tok, t_tok, result = qwen_deepseek_rows
    empty = {
        "indices": torch.full_like(result["indices"], -1),
        "likelihoods": 0 * result["likelihoods"],
    }
    path = tmp_path / "empty.pt"
    save_projection(empty, path, projection_metadata(s_tok, t_tok))
    with pytest.raises(ValueError, match="no usable row"):
        check_projection_tokenizers(path, s_tok, t_tok)


def test_gold_places_point_each_student_id_at_its_compact_column_once_per_vocab():
    # common ids at their place among the common ones, uncommon at -2 - place, ids past the
    # projection's rows (V > rows) among the uncommon; one tensor kept per vocab pair
    projection = P.Projection.from_topk(
        torch.tensor([[1], [0], [-1]]), torch.tensor([[1.0], [0.9], [0.0]]), "cpu"
    )
    places = projection.gold_places(5, 2, xtoken_loss=False)
    exact = projection.exact_map(2, xtoken_loss=False, student_vocab_size=5)
    assert exact["common_student"].tolist() == [0]
    assert places.dtype == torch.int32
    assert places.tolist() == [0, -2, -3, -4, -5]
    assert projection.gold_places(5, 2, xtoken_loss=False) is places
    assert projection.gold_places(5, 2, xtoken_loss=True).tolist() == [0, 1, -2, -3, -4]
