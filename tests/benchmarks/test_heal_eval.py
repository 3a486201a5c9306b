"""The healing experiment's scoring inputs (benchmarks/quality/heal_eval.py): the fresh split,
codec-table bytes, next-line items and their match."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.quality import heal_eval  # noqa: E402
from benchmarks.quality.run_kd_quality import CATEGORIES  # noqa: E402


def _git(repo: Path, *argv: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *argv], check=True, capture_output=True, text=True
    ).stdout


def test_fresh_split_reads_library_and_service_sources_at_the_commit_not_the_work_tree(tmp_path):
    repo = tmp_path / "repo"
    for path, text in {
        "xtoken_core/a.py": "\n\n".join(f"def f{i}():\n    return {i}" for i in range(300)),
        "xtoken_core/sub/b.py": "x = 1\n",
        "services/c.py": "y = 2\n",
        "tests/d.py": "z = 3\n",
        "services/notes.md": "text\n",
    }.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    _git(repo.parent, "init", "-q", str(repo))
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    sha = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "services" / "c.py").write_text("changed in the work tree\n")
    (repo / "services" / "untracked.py").write_text("u = 0\n")

    meta = heal_eval.build_fresh(tmp_path / "fresh.jsonl", repo)

    recs = [json.loads(ln) for ln in (tmp_path / "fresh.jsonl").read_text().splitlines()]
    assert meta["commit"] == sha and meta["files"] == 3 and meta["texts"] == len(recs)
    assert {r["source"] for r in recs} == {
        "xtoken_core/a.py",
        "xtoken_core/sub/b.py",
        "services/c.py",
    }
    assert next(r["text"] for r in recs if r["source"] == "services/c.py") == "y = 2"
    big = [r["text"] for r in recs if r["source"] == "xtoken_core/a.py"]
    assert len(big) > 1 and all(len(t) <= 4096 for t in big)
    assert all(len(t) >= 1024 for t in big[:-1])  # 1-4 kB, the last chunk of a file shorter
    assert all(t.startswith("def f") and t.endswith(tuple("0123456789")) for t in big)


def test_codec_table_texts_are_one_category_and_others_keep_theirs():
    text = "x = 0x41  # A\n"
    codec = heal_eval.heal_categories(text, "Lib/encodings/cp1252.py")
    assert set(codec.tolist()) == {heal_eval.HEAL_CATEGORIES.index("codec_tables")}
    other = heal_eval.heal_categories(text, "Lib/json/encoder.py")
    names = [heal_eval.HEAL_CATEGORIES[c] for c in other]
    assert "codec_tables" not in names and len(names) == len(text.encode())
    assert names[0] == "code" and names[4] == "digits" and names[-2] == "prose"
    assert heal_eval.HEAL_CATEGORIES[1:] == CATEGORIES
    assert not heal_eval.is_codec_table("Lib/myencodings/x.py")


def test_next_lines_are_fixed_long_enough_and_after_some_text():
    texts = [
        "\n  \n    not_after_any_text()\nimport x\n    return value_of(x)  \nshort\n\n"
        "class Thing(Base):\n",
        "first line is long enough\nsecond line is long enough too",
    ]
    items = heal_eval.select_next_lines(texts, 10)
    lines = [texts[i.text][i.start : i.end] for i in items]
    assert lines == [
        "    return value_of(x)  ",
        "class Thing(Base):",
        "second line is long enough too",
    ]
    assert all(texts[i.text][i.start - 1] == "\n" for i in items)
    two = heal_eval.select_next_lines(texts, 2)
    assert len(two) == 2 and set(two) <= set(items)
    assert heal_eval.select_next_lines(texts, 2) == two  # no seed, no state


def test_the_written_line_follows_the_line_break_and_keeps_its_indentation():
    assert heal_eval.line_matches("\n    return x   \n    more", "    return x")
    assert heal_eval.line_matches("\n\n  \nreturn x", "return x  ")  # blank lines, then cut
    assert not heal_eval.line_matches("\n  return x\n", "    return x")
    assert not heal_eval.line_matches("\nreturn\n", "return x")
    assert not heal_eval.line_matches("return x\n", "return x")  # never left the prompt's line
    assert heal_eval.written_line("\n    return x") is None  # not finished: decoding goes on
    assert heal_eval.written_line("\n\n    return x\n") == "    return x"
    assert heal_eval.written_line(" and more\n") is None


def test_prompt_keeps_bos_and_the_last_ctx_minus_one_tokens():
    from xtoken_core.tokenizers import load_tokenizer

    tok = load_tokenizer("smollm2")
    prefix = "def f(x):\n    return x + 1\n" * 20
    ids = tok.encode(prefix, add_special_tokens=False).ids.tolist()
    p = heal_eval.prompt_ids(tok, prefix, ctx=16)
    assert p == [tok.bos_id] + ids[-15:]
    assert (
        heal_eval.prompt_ids(tok, "a b", ctx=16)
        == [tok.bos_id] + tok.encode("a b", add_special_tokens=False).ids.tolist()
    )


def test_whole_chars_cuts_a_split_character_and_what_follows_an_invalid_byte():
    assert heal_eval.whole_chars("café".encode()[:-1]) == b"caf"
    assert heal_eval.whole_chars(b"ab\xffcd") == b"ab"
    assert heal_eval.whole_chars("ok é".encode()) == "ok é".encode()


def test_a_scorer_rates_continuations_it_would_write_better_than_another_models():
    # tiny random models: the scorer's own greedy continuations cost it fewer bits per byte than
    # those of another model, rated the same way; pooled over prompts, deterministic
    import torch

    from xtoken_core.models import load_model
    from xtoken_core.tokenizers import load_tokenizer

    tok = load_tokenizer("mistral")
    torch.manual_seed(0)
    scorer = load_model("tiny", vocab_size=tok.vocab_size, seed=1)
    other = load_model("tiny", vocab_size=tok.vocab_size, seed=2)
    texts = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps.", "x = [1, 2, 3]"]
    kw = dict(prompt_tokens=6, new_tokens=8, device="cpu")
    own = heal_eval.continuation_bits_per_byte(scorer, tok, scorer, tok, texts, **kw)
    theirs = heal_eval.continuation_bits_per_byte(other, tok, scorer, tok, texts, **kw)
    again = heal_eval.continuation_bits_per_byte(other, tok, scorer, tok, texts, **kw)
    assert own["continuations"] + own["empty"] == len(texts) and own["bytes"] > 0
    assert theirs == again
    assert own["bits_per_byte"] < theirs["bits_per_byte"]


def test_a_fresh_split_of_a_commit_the_checkout_lacks_is_refused_in_one_line_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/quality/run_kd_quality.py", "--split-only",
         str(tmp_path / "split"), "--fresh-rev", "no-such-commit"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.startswith("run_kd_quality: fresh split: `git rev-parse --verify no-such")
    assert proc.stderr.count("\n") == 1
    assert not (tmp_path / "split" / "train.jsonl").exists()
