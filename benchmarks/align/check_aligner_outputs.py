"""Regression check: dump TokenAligner outputs for ~3,000 varied inputs, or compare against a dump.

Used when optimizing the aligner: outputs must stay bit-identical (values, dtypes, shapes, and
the messages of rejected inputs). Inputs (seeded, deterministic): demo-corpus texts whole, sliced
at character and byte cuts and joined into ~16k-character texts, for every ordered tokenizer pair
and the identity pairs, with and without the tokenizers' specials and at random truncations;
synthetic span tilings with gaps, empty spans, zero-width specials of every role, masks and far
byte offsets; right-padded batches through ``TokenAligner.align``.

    python benchmarks/align/check_aligner_outputs.py --dump /tmp/align_golden.pkl
    python benchmarks/align/check_aligner_outputs.py --compare /tmp/align_golden.pkl
    git show HEAD~3:xtoken_core/align/aligner.py > /tmp/ref_aligner.py   # dump an older one
    python benchmarks/align/check_aligner_outputs.py --dump /tmp/ref.pkl --aligner-file /tmp/ref_aligner.py
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import pickle
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from xtoken_core.align import ALIGNMENT_FIELDS, TokenAligner  # noqa: E402
from xtoken_core.data.corpus import build_demo_corpus, iter_texts  # noqa: E402
from xtoken_core.tokenizers import load_tokenizer  # noqa: E402

NAMES = ["qwen3", "deepseek", "mistral", "llama3"]
PAIRS = list(itertools.permutations(NAMES, 2)) + [(n, n) for n in NAMES]


def _text_pool(rng: random.Random) -> list[str]:
    corpus = build_demo_corpus()
    texts = [t for _, t in iter_texts(corpus.train_path)]
    non_ascii = [t for t in texts if not t.isascii()]
    ascii_ = rng.sample([t for t in texts if t.isascii()], 80)
    pool = non_ascii[:60] + ascii_
    longs = []
    for _ in range(6):
        parts = rng.sample(texts, 40)
        longs.append("\n\n".join(parts)[:17_000])
    return pool, longs


def _slice(rng: random.Random, text: str) -> str:
    mode = rng.choice(["whole", "chars", "bytes"])
    if mode == "whole":
        return text
    if mode == "chars":
        a = rng.randint(0, len(text))
        return text[a : rng.randint(a, len(text))]
    raw = text.encode("utf-8")
    a = rng.randint(0, len(raw))
    return raw[a : rng.randint(a, len(raw))].decode("utf-8", errors="replace")


def _cap(rng: random.Random, n: int):
    r = rng.random()
    if r < 0.5:
        return None
    if r < 0.6:
        return 0
    return rng.randint(0, max(1, n + 2))


def text_cases(rng: random.Random):
    """(name, kwargs for align_sample) from real tokenizers."""
    pool, longs = _text_pool(rng)
    toks = {n: load_tokenizer(n) for n in NAMES}
    for s_name, t_name in PAIRS:
        for k in range(140):
            if k < 4:
                text = longs[(k + PAIRS.index((s_name, t_name))) % len(longs)]
            elif k < 8:
                text = rng.choice(["", " ", "\n", "a", " a", "▁x", "<s>", "  \t\n"])
            else:
                text = _slice(rng, rng.choice(pool))
            s_spec, t_spec = rng.random() < 0.8, rng.random() < 0.8
            s = toks[s_name].encode(text, add_special_tokens=s_spec)
            t = toks[t_name].encode(text, add_special_tokens=t_spec)
            s = s.truncated(4096 if k < 4 else _cap(rng, len(s)))
            t = t.truncated(4096 if k < 4 else _cap(rng, len(t)))
            yield (
                f"{s_name}:{t_name}:{k}",
                dict(
                    student_spans=s.spans_N2,
                    teacher_spans=t.spans_N2,
                    student_roles=s.roles_N,
                    teacher_roles=t.roles_N,
                ),
            )


def _synthetic_side(rng: random.Random, length: int):
    cuts = sorted({0, length} | {rng.randint(0, length) for _ in range(rng.randint(0, 30))})
    spans = [[a, b] for a, b in zip(cuts[:-1], cuts[1:])]
    roles = [0] * len(spans)
    out_s, out_r = [], []
    for sp, r in zip(spans, roles):
        x = rng.random()
        if x < 0.08:
            continue  # a gap: bytes this side does not cover
        if x < 0.16:
            out_s.append([sp[0], sp[0]])  # an empty content span
            out_r.append(0)
        if x > 0.9:
            out_s.append([sp[0], sp[0]])  # a zero-width special
            out_r.append(rng.choice([1, 2, 3, 4]))
        out_s.append(sp)
        out_r.append(r)
    if rng.random() < 0.5:
        out_s.insert(0, [out_s[0][0] if out_s else 0] * 2)
        out_r.insert(0, rng.choice([1, 1, 1, 0, 4]))
    if rng.random() < 0.3:
        end = out_s[-1][1] if out_s else 0
        out_s.append([end, end])
        out_r.append(rng.choice([2, 3, 0]))
    if rng.random() < 0.1 and len(out_s) > 1:
        out_s[1], out_s[0] = out_s[0], out_s[1]  # maybe out of order (rejected or not)
    spans_n2 = np.array(out_s, dtype=np.int64).reshape(-1, 2)
    trunc = rng.randint(0, len(spans_n2)) if rng.random() < 0.3 else len(spans_n2)
    return spans_n2[:trunc], np.array(out_r, dtype=np.int8)[:trunc]


def synthetic_cases(rng: random.Random):
    """(name, kwargs for align_sample) from random tilings, gaps, specials, masks, offsets."""
    for k in range(900):
        length = rng.choice([0, 1, 2, 5, 20, 60, 200])
        s_spans, s_roles = _synthetic_side(rng, length)
        t_spans, t_roles = _synthetic_side(rng, length if rng.random() < 0.8 else length // 2)
        kw = dict(student_spans=s_spans, teacher_spans=t_spans)
        if rng.random() < 0.85:
            kw.update(student_roles=s_roles, teacher_roles=t_roles)
        if rng.random() < 0.3:
            kw["student_mask"] = np.array([rng.random() < 0.85 for _ in s_spans], dtype=bool)
            kw["teacher_mask"] = np.array([rng.random() < 0.85 for _ in t_spans], dtype=bool)
        if rng.random() < 0.15:
            off = rng.choice([10**6, 10**12])
            kw["student_spans"] = kw["student_spans"] + off
            kw["teacher_spans"] = kw["teacher_spans"] + off
        yield f"syn:{k}", kw


def _tiled_side(rng: random.Random, length: int, first: int):
    """Spans tiling [first, length) with zero-width tokens of any role anywhere (fast path)."""
    inner = range(first + 1, max(first + 1, length))
    cuts = sorted({first, length} | {rng.choice(inner) for _ in range(rng.randint(0, 30)) if inner})
    spans, roles = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        while rng.random() < 0.12:
            spans.append([a, a])
            roles.append(rng.choice([0, 0, 1, 2, 3, 4]))
        spans.append([a, b])
        roles.append(0)
    while rng.random() < 0.25:
        end = cuts[-1]
        spans.append([end, end])
        roles.append(rng.choice([0, 1, 2, 3, 4]))
    return np.array(spans, dtype=np.int64).reshape(-1, 2), np.array(roles, dtype=np.int8)


def tiled_cases(rng: random.Random):
    """(name, kwargs) of gap-free tilings: shared or different first bytes, truncations, padding."""
    for k in range(900):
        length = rng.choice([1, 2, 3, 8, 30, 120])
        first = 0 if rng.random() < 0.85 else rng.randint(0, 2)
        s_spans, s_roles = _tiled_side(rng, length, min(first, length - 1))
        t_len = length if rng.random() < 0.5 else rng.randint(1, length)
        t_spans, t_roles = _tiled_side(
            rng, t_len, min(0 if rng.random() < 0.9 else first, t_len - 1)
        )
        if rng.random() < 0.3:
            s_spans, s_roles = s_spans[: rng.randint(0, len(s_spans))], s_roles[: len(s_spans)]
            s_roles = s_roles[: len(s_spans)]
        kw = dict(student_spans=s_spans, teacher_spans=t_spans)
        if rng.random() < 0.8:
            kw.update(student_roles=s_roles, teacher_roles=t_roles)
        if rng.random() < 0.3:  # right padding (a mask prefix) or holes
            for side, n in (("student", len(s_spans)), ("teacher", len(t_spans))):
                keep = rng.randint(0, n)
                mask = np.arange(n) < keep
                if rng.random() < 0.2 and n:
                    mask[rng.randrange(n)] ^= True
                kw[f"{side}_mask"] = mask
        yield f"tiled:{k}", kw


def _record(fn, *args, **kwargs):
    try:
        out = fn(*args, **kwargs)
    except ValueError as e:
        return ("ValueError", str(e))
    if hasattr(out, "num_chunks") and not hasattr(out, "batch_size"):
        return tuple(
            (name, type(v).__name__, getattr(v, "dtype", None), np.asarray(v).tolist())
            for name in ALIGNMENT_FIELDS
            for v in [getattr(out, name)]
        )
    return tuple(
        (name, str(getattr(out, name).dtype), getattr(out, name).tolist())
        for name in ALIGNMENT_FIELDS
    )


def run_all(aligner_cls=TokenAligner) -> dict[str, object]:
    """Every case name -> its recorded output (or error message).

    Args:
        aligner_cls: the TokenAligner class to run (default: this checkout's).

    Returns:
        dict case name -> recorded outputs.
    """
    rng = random.Random(1234)
    aligner = aligner_cls()
    out: dict[str, object] = {}
    batch_inputs = []
    for name, kw in itertools.chain(text_cases(rng), synthetic_cases(rng), tiled_cases(rng)):
        out[name] = _record(aligner.align_sample, **kw)
        if name.startswith("deepseek:mistral:") and len(batch_inputs) < 40:
            batch_inputs.append(kw)
    # Right-padded batches through align().
    for i in range(0, len(batch_inputs), 8):
        group = batch_inputs[i : i + 8]
        t_w = max(len(kw["student_spans"]) for kw in group) + 3
        u_w = max(len(kw["teacher_spans"]) for kw in group) + 1
        arrs = {}
        for side, w in (("student", t_w), ("teacher", u_w)):
            spans = np.zeros((len(group), w, 2), np.int64)
            mask = np.zeros((len(group), w), bool)
            roles = np.zeros((len(group), w), np.int8)
            for j, kw in enumerate(group):
                n = len(kw[f"{side}_spans"])
                spans[j, :n], mask[j, :n] = kw[f"{side}_spans"], True
                roles[j, :n] = kw[f"{side}_roles"]
            arrs[side] = (np.zeros((len(group), w), np.int64), spans, mask, roles)
        s, t = arrs["student"], arrs["teacher"]
        out[f"batch:{i}"] = _record(aligner.align, s[0], t[0], s[1], t[1], s[2], t[2], s[3], t[3])
    return out


def main() -> int:
    """Dump or compare; returns the exit code (1 on any difference)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--dump", type=Path, help="write the outputs here")
    group.add_argument("--compare", type=Path, help="compare against this dump")
    parser.add_argument(
        "--aligner-file",
        type=Path,
        help="run the TokenAligner of this aligner.py instead (e.g. one from git show)",
    )
    args = parser.parse_args()
    aligner_cls = TokenAligner
    if args.aligner_file:
        spec = importlib.util.spec_from_file_location("_reference_aligner", args.aligner_file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        aligner_cls = module.TokenAligner
    t0 = time.perf_counter()
    got = run_all(aligner_cls)
    print(f"{len(got)} cases in {time.perf_counter() - t0:.1f} s")
    if args.dump:
        args.dump.write_bytes(pickle.dumps(got))
        errors = sum(1 for v in got.values() if v and v[0] == "ValueError")
        print(f"dumped to {args.dump} ({errors} rejected inputs)")
        return 0
    want = pickle.loads(args.compare.read_bytes())
    bad = [k for k in want if got.get(k) != want[k]]
    if set(got) != set(want):
        print(f"case sets differ: {sorted(set(got) ^ set(want))[:10]}")
        return 1
    for k in bad[:10]:
        print(f"DIFF {k}:\n  want {str(want[k])[:400]}\n  got  {str(got[k])[:400]}")
    print(f"{len(bad)} of {len(want)} cases differ")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
