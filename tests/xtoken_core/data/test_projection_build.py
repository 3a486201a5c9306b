"""The projection builder: rules on a hand-made tokenizer pair, invariants on a real pair."""

from __future__ import annotations

import pytest
import torch

from xtoken_core.data import projection as P
from xtoken_core.data.projection_build import (
    build_projection,
    build_projection_with_stats,
    projection_stats,
)


class FakeTokenizer:
    """A tiny tokenizer: a bytes vocabulary, greedy longest-match encoding, roles by id."""

    def __init__(self, name, pieces, roles=None, encode_prefix=(), encode_override=None):
        self.name = name
        self.pieces = pieces  # id -> bytes (b"" for specials / unused ids)
        self.vocab_size = len(pieces)
        self.roles = roles or {}  # id -> role, for special ids
        self.encode_prefix = list(encode_prefix)  # e.g. a SentencePiece dummy-prefix piece
        self.encode_override = encode_override or {}
        self.calls = 0

    def token_bytes(self, token_id):
        return self.pieces[token_id]

    def is_special(self, token_id):
        return token_id in self.roles

    def special_role(self, token_id):
        return self.roles.get(token_id)

    def encode_bytes_to_ids(self, text):
        self.calls += 1
        if text in self.encode_override:
            return list(self.encode_override[text])
        b, out, i = text.encode("utf-8"), [], 0
        while i < len(b):
            for j in range(len(b), i, -1):
                hits = [t for t, p in enumerate(self.pieces) if p == b[i:j] and t not in self.roles]
                if hits:
                    out.append(max(hits))  # prefers the later twin, like a real merge table
                    i = j
                    break
            else:
                return self.encode_prefix + out  # cannot encode the rest: truncated output
        return self.encode_prefix + out


TEACHER_PIECES = [
    b"",  # 0 <s> bos
    b"",  # 1 </s> eos
    b"a",  # 2 byte-fallback twin of id 11
    b"b",  # 3
    b"ab",  # 4
    b" ",  # 5
    b"\xe4",  # 6
    b"\xb8",  # 7
    b"\xad",  # 8
    b"c",  # 9
    b"",  # 10 generic special (chat marker)
    b"a",  # 11 the piece the tokenizer itself produces for "a"
]
TEACHER_ROLES = {0: "bos", 1: "eos", 10: "special"}

STUDENT_PIECES = [
    b"",  # 0 bos -> teacher 0
    b"ab",  # 1 exact -> 4
    b"abc",  # 2 re-tokenized [4, 9]
    "中".encode(),  # 3 re-tokenized [6, 7, 8] (3 pieces)
    b"\xe4\xb8",  # 4 partial UTF-8 -> byte fallback [6, 7]
    b"  ",  # 5 two spaces -> [5, 5], not one-hot
    b"",  # 6 pad: the teacher has no pad -> none
    b"a",  # 7 exact, duplicate teacher bytes -> 11
    b"z",  # 8 no teacher piece -> none
    b"",  # 9 eos -> teacher 1
    b"",  # 10 generic special -> none
    b"",  # 11 unused id (not special, no bytes) -> none
]
STUDENT_ROLES = {0: "bos", 6: "pad", 9: "eos", 10: "special"}


def _pair(**teacher_kwargs):
    student = FakeTokenizer("student", STUDENT_PIECES, STUDENT_ROLES)
    teacher = FakeTokenizer("teacher", TEACHER_PIECES, TEACHER_ROLES, **teacher_kwargs)
    return student, teacher


def _row(result, s):
    ids = result["indices"][s].tolist()
    weights = result["likelihoods"][s].tolist()
    return ids, pytest.approx(weights, abs=1e-6)


def test_builder_rules_on_a_hand_made_pair():
    student, teacher = _pair()
    result, stats = build_projection_with_stats(student, teacher, top_k=4)
    assert result["indices"].shape == (12, 4) and result["indices"].dtype == torch.long
    assert result["likelihoods"].dtype == torch.float32
    assert _row(result, 0) == ([0, -1, -1, -1], [1, 0, 0, 0])  # bos by role
    assert _row(result, 1) == ([4, -1, -1, -1], [1, 0, 0, 0])  # identical bytes
    assert _row(result, 2) == ([4, 9, -1, -1], [2 / 3, 1 / 3, 0, 0])
    assert _row(result, 3) == ([6, 7, 8, -1], [4 / 7, 2 / 7, 1 / 7, 0])
    assert _row(result, 4) == ([6, 7, -1, -1], [2 / 3, 1 / 3, 0, 0])  # invalid UTF-8
    assert _row(result, 5) == ([5, 5, -1, -1], [2 / 3, 1 / 3, 0, 0])
    assert _row(result, 7) == ([11, -1, -1, -1], [1, 0, 0, 0])  # the twin the teacher produces
    assert _row(result, 9) == ([1, -1, -1, -1], [1, 0, 0, 0])  # eos by role
    for s in (6, 8, 10, 11):
        assert _row(result, s) == ([-1] * 4, [0] * 4)
    assert (stats.exact_rows, stats.special_rows) == (2, 2)
    assert (stats.retokenized_rows, stats.byte_fallback_rows, stats.unmapped_rows) == (3, 1, 4)
    assert stats.truncated_rows == 0


def test_top_k_keeps_the_first_pieces_and_renormalizes():
    student, teacher = _pair()
    result, stats = build_projection_with_stats(student, teacher, top_k=2)
    assert _row(result, 3) == ([6, 7], [2 / 3, 1 / 3])
    assert stats.truncated_rows == 1


def test_decay_one_weights_pieces_equally():
    student, teacher = _pair()
    result = build_projection(student, teacher, top_k=4, decay=1.0)
    assert _row(result, 3) == ([6, 7, 8, -1], [1 / 3, 1 / 3, 1 / 3, 0])


def test_failed_round_trip_falls_back_to_teacher_bytes():
    # A lossy encoding (like a normalizer rewriting the text) spells other bytes than the token.
    student, teacher = _pair(encode_override={"abc": [4]})
    result, stats = build_projection_with_stats(student, teacher, top_k=4)
    assert _row(result, 2) == ([4, 9, -1, -1], [2 / 3, 1 / 3, 0, 0])
    assert stats.retokenized_rows == 2 and stats.byte_fallback_rows == 2


def test_teacher_encoding_with_a_prefix_space_fails_the_round_trip():
    # A teacher that puts a dummy " " before the text breaks the encode_bytes_to_ids contract:
    # its pieces spell other bytes, so every re-tokenized row falls back to the greedy split.
    student, teacher = _pair(encode_prefix=[5])
    result, stats = build_projection_with_stats(student, teacher, top_k=4)
    assert _row(result, 2) == ([4, 9, -1, -1], [2 / 3, 1 / 3, 0, 0])
    assert _row(result, 5) == ([5, 5, -1, -1], [2 / 3, 1 / 3, 0, 0])
    assert stats.retokenized_rows == 0 and stats.byte_fallback_rows == 4


def test_duplicate_teacher_bytes_resolve_to_the_piece_the_teacher_produces():
    student = FakeTokenizer("student", STUDENT_PIECES, STUDENT_ROLES)
    teacher = FakeTokenizer("teacher", TEACHER_PIECES, TEACHER_ROLES)
    result = build_projection(student, teacher, top_k=2, student_ids=[7])
    assert _row(result, 7) == ([11, -1], [1, 0])  # "a" encodes to 11, not its byte twin 2
    # A teacher that does not encode "a" to one of the twins: no way to tell, the lowest id.
    unclear = FakeTokenizer("teacher", TEACHER_PIECES, TEACHER_ROLES, encode_override={"a": [5]})
    result = build_projection(student, unclear, top_k=2, student_ids=[7])
    assert _row(result, 7) == ([2, -1], [1, 0])


def test_student_ids_restricts_the_rows_built():
    student, teacher = _pair()
    result, stats = build_projection_with_stats(student, teacher, top_k=3, student_ids=[2, 1])
    assert result["indices"].shape == (12, 3)
    assert (result["indices"][1:3] >= 0).any(dim=1).all()
    others = [s for s in range(12) if s not in (1, 2)]
    assert (result["indices"][others] == -1).all() and (result["likelihoods"][others] == 0).all()
    assert stats.rows_built == 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"top_k": 0}, "top_k"),
        ({"top_k": 2, "decay": 0.0}, "decay"),
        ({"top_k": 2, "student_ids": [12]}, "outside the student vocab"),
    ],
)
def test_builder_rejects_bad_arguments(kwargs, match):
    student, teacher = _pair()
    with pytest.raises(ValueError, match=match):
        build_projection(student, teacher, **kwargs)


def test_built_file_round_trips_through_the_loaders(tmp_path):
    student, teacher = _pair()
    path = tmp_path / "proj.pt"
    torch.save(build_projection(student, teacher, top_k=4), path)
    P.clear_projection_caches()
    strict = P.build_exact_token_map(path, "cpu", xtoken_loss=False, teacher_vocab_size=12)
    # one-hot rows: bos, "ab", "a", eos (never the two-space row)
    assert strict["common_student"].tolist() == [0, 1, 7, 9]
    assert strict["common_teacher"].tolist() == [0, 4, 11, 1]
    relaxed = P.build_exact_token_map(path, "cpu", xtoken_loss=True, teacher_vocab_size=12)
    # Two-piece rows (2/3 >= 0.6) join, three-piece rows (4/7) do not; row 2 ("abc" -> 4) loses
    # teacher id 4 to row 1 ("ab", weight 1).
    assert relaxed["common_student"].tolist() == [0, 1, 4, 5, 7, 9]
    matrix = P.get_sparse_projection_matrix(
        path, "cpu", student_vocab_size=12, teacher_vocab_size=12
    )
    assert matrix.to_dense()[5, 5].item() == pytest.approx(1.0)  # the repeated piece sums
    P.clear_projection_caches()


def test_projection_stats_reads_back_the_arrays():
    student, teacher = _pair()
    result = build_projection(student, teacher, top_k=4)
    stats = projection_stats(result["indices"], result["likelihoods"])
    assert stats["student_rows"] == 12 and stats["top_k"] == 4
    assert stats["one_hot_rows"] == 4 and stats["empty_rows"] == 4
    assert stats["max_row_sum_error"] < 1e-6
    assert stats["mean_entries_per_nonempty_row"] == pytest.approx((4 * 1 + 3 * 2 + 3) / 8)


# ---------------------------------------------------------------- a real pair


@pytest.fixture(scope="module", params=["qwen3:deepseek", "qwen3:mistral", "mistral:qwen3"])
def real_pair(request):
    from xtoken_core.tokenizers import load_tokenizer

    student_name, teacher_name = request.param.split(":")
    return load_tokenizer(student_name), load_tokenizer(teacher_name)


def _check_real_rows(student, teacher, result, rows, top_k):
    indices, likelihoods = result["indices"], result["likelihoods"]
    teacher_by_bytes = {}
    for t in range(teacher.vocab_size):
        if not teacher.is_special(t) and teacher.token_bytes(t):
            teacher_by_bytes.setdefault(teacher.token_bytes(t), []).append(t)
    for s in rows:
        ids = [t for t in indices[s].tolist() if t >= 0]
        n = len(ids)
        # -1 padding is a suffix with zero weights
        assert indices[s, n:].eq(-1).all() and likelihoods[s, n:].eq(0).all()
        if n:
            assert likelihoods[s, :n].sum().item() == pytest.approx(1.0, abs=1e-5)
            assert (likelihoods[s, :n].diff() <= 0).all()  # heaviest first
        if student.is_special(s):
            continue
        b = student.token_bytes(s)
        if b in teacher_by_bytes:
            assert n == 1 and ids[0] in teacher_by_bytes[b] and likelihoods[s, 0].item() == 1.0
        elif n and n < top_k:
            assert b"".join(teacher.token_bytes(t) for t in ids) == b
            assert n > 1
        elif n:
            assert b.startswith(b"".join(teacher.token_bytes(t) for t in ids))


def test_real_pair_rows_are_one_hot_for_identical_tokens_and_normalized(real_pair):
    student, teacher = real_pair
    # The first content ids (single bytes, byte-fallback pieces), a spread of merged tokens
    # (including partial-UTF-8 ones), the end of the vocab (Qwen3's specials) and EOS.
    content = [s for s in range(2000) if not student.is_special(s)][:300]
    rows = content + list(range(2000, student.vocab_size, student.vocab_size // 80))
    rows += list(range(student.vocab_size - 40, student.vocab_size)) + [student.eos_id]
    top_k = 4
    result, stats = build_projection_with_stats(student, teacher, top_k, student_ids=rows)
    assert result["indices"].shape == (student.vocab_size, top_k)
    _check_real_rows(student, teacher, result, rows, top_k)
    assert stats.exact_rows > 200  # single bytes and short tokens exist on both sides
    assert stats.unmapped_rows < 60  # only specials without a role counterpart
    assert stats.retokenized_rows > 0
    eos = [s for s in rows if student.special_role(s) == "eos"]
    teacher_eos = [t for t in range(teacher.vocab_size) if teacher.special_role(t) == "eos"]
    if eos and teacher_eos:
        assert result["indices"][eos[0], 0].item() == min(teacher_eos)


def test_sentencepiece_teacher_rows_are_its_own_running_text_encoding():
    # "olor" (a Qwen3 piece with no Mistral twin) maps to what Mistral produces for "olor"
    # inside a word, with no dummy "▁" to strip: ["ol", "or"], not a re-spelled " olor".
    from xtoken_core.tokenizers import load_tokenizer

    student, teacher = load_tokenizer("qwen3"), load_tokenizer("mistral")
    words = ["olor", "ected", "iversity", " contextual", "\tfor", "->"]
    rows = [student.encode_bytes_to_ids(w)[0] for w in words]
    assert all(len(student.encode_bytes_to_ids(w)) == 1 for w in words)
    result, stats = build_projection_with_stats(student, teacher, top_k=8, student_ids=rows)
    for s in rows:
        b = student.token_bytes(s)
        ids = [t for t in result["indices"][s].tolist() if t >= 0]
        assert ids == teacher.encode_bytes_to_ids(b.decode("utf-8"))
        assert b"".join(teacher.token_bytes(t) for t in ids) == b
    assert stats.retokenized_rows == len(rows) - stats.exact_rows
