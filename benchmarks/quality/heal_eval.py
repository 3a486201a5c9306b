"""What the healing experiment scores a model on: the fresh split, byte categories with codec
tables, and greedy next-line exact match.

* **fresh**: this repository's own ``xtoken_core/**/*.py`` and ``services/**/*.py`` at a commit,
  read with ``git show COMMIT:PATH`` (the working tree does not matter), chunked like the demo
  corpus (``chunk_text``: paragraphs packed into 1-4 kB texts, cut at line boundaries). No model
  can have seen it in pretraining.
* **categories**: those of ``run_kd_quality.byte_categories`` (prose, code, digits, whitespace)
  plus ``codec_tables`` first: every byte of a text whose source file lies under ``encodings/``
  (the stdlib codec modules, mostly tables of hex literals that would otherwise dominate
  ``digits``). The category applies to the whole text, so the categories still partition the
  bytes and add up to the overall figure.
* **next line**: a fixed set of lines (the smallest SHA-1 of text index, offset and line, so no
  seed and no model changes the choice) with at least 8 non-space characters and some text before
  them. The prompt is the text before the line up to its last non-space character (at most
  ``ctx`` tokens: BOS and the last ``ctx - 1``); the model decodes greedily (at most 64 new
  tokens) until it has gone to a new line and finished that one; the line counts when what it
  wrote after its leading line break(s), up to the next newline, equals the line (indentation
  included), trailing whitespace stripped on both. The prompt stops before the line break rather
  than after it because byte-level BPE tokenizers merge a newline with the next line's
  indentation (``"\n   "``): a prompt ending in a bare ``"\n"`` would ask every model to go on
  from a token boundary it never saw in training.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("kd_quality.heal")

HEAL_CATEGORIES = ("codec_tables", "prose", "code", "digits", "whitespace")
FRESH_GLOBS = ("xtoken_core/*.py", "services/*.py")
CODEC_DIR = "encodings/"
MIN_LINE_CHARS = 8  # non-space characters of a next-line target


# --------------------------------------------------------------------------- fresh split


def build_fresh(
    out_path: Path, root: Path, rev: str = "HEAD", min_chars: int = 1024, max_chars: int = 4096
) -> dict[str, Any]:
    """Write the fresh split: this repository's library and service sources at ``rev``, chunked.

    Args:
        out_path: the JSONL file (records ``{"text", "source", "line"}``).
        root: the repository (a git work tree or its ``.git``).
        rev: the commit to read (``git show REV:PATH``).
        min_chars: see ``xtoken_core.data.corpus.chunk_text``.
        max_chars: see ``chunk_text``.

    Returns:
        ``{"commit", "texts", "files", "chars"}``.

    Raises:
        ValueError: ``root`` is no git repository or ``rev`` no commit of it.
    """
    from xtoken_core.data.corpus import chunk_text

    def git(*argv: str) -> str:
        proc = subprocess.run(
            ["git", "-C", str(root), *argv], capture_output=True, text=True, check=False
        )
        if proc.returncode:
            raise ValueError(
                f"fresh split: `git {' '.join(argv)}` failed in {root} ({proc.stderr.strip()}); "
                "build the split in a git checkout of the repository (--split-only DIR)"
            )
        return proc.stdout

    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}").strip()
    paths = sorted(
        git("ls-tree", "-r", "--name-only", sha, "--", "xtoken_core", "services").split()
    )
    paths = [p for p in paths if p.endswith(".py")]
    texts = chars = 0
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
        for path in paths:
            for line, chunk in chunk_text(
                git("show", f"{sha}:{path}"), min_chars=min_chars, max_chars=max_chars
            ):
                f.write(json.dumps({"text": chunk, "source": path, "line": line}) + "\n")
                texts += 1
                chars += len(chunk)
    return {"commit": sha, "texts": texts, "files": len(paths), "chars": chars}


def read_records(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The records (``text``, ``source``) of a JSONL split file, the first ``limit`` of them."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                out.append({"text": rec["text"], "source": rec.get("source", "")})
                if limit and len(out) >= limit:
                    break
    return out


# --------------------------------------------------------------------------- categories


def is_codec_table(source: str) -> bool:
    """Whether a text's source file lies under a directory ``encodings/``."""
    return source.startswith(CODEC_DIR) or f"/{CODEC_DIR}" in source


def heal_categories(text: str, source: str):
    """The category (index into :data:`HEAL_CATEGORIES`) of every UTF-8 byte of ``text``.

    Args:
        text: a text.
        source: its source file's path (a codec table makes the whole text ``codec_tables``).

    Returns:
        uint8 numpy array, one entry per byte.
    """
    import numpy as np

    from benchmarks.quality.run_kd_quality import byte_categories

    if is_codec_table(source):
        return np.zeros(len(text.encode("utf-8")), dtype=np.uint8)
    return byte_categories(text) + np.uint8(1)


# --------------------------------------------------------------------------- next line


@dataclass(frozen=True)
class NextLine:
    """One next-line item: ``texts[text][start:end]`` is the line, the text before it the prompt."""

    text: int
    start: int
    end: int


def select_next_lines(texts: list[str], n: int) -> list[NextLine]:
    """The ``n`` next-line items of ``texts`` (fewer if there are fewer candidates).

    A candidate is a line that starts after a newline, has some non-space text before it (the
    prompt) and at least :data:`MIN_LINE_CHARS` non-space characters; the ``n`` with the
    smallest SHA-1 of (text index, offset, line) are taken, in text order.

    Args:
        texts: the split's texts, in file order.
        n: how many.

    Returns:
        The items, sorted by (text, start).
    """
    keyed = []
    for t, text in enumerate(texts):
        start = text.find("\n") + 1
        while start and not text[:start].strip():  # no prompt yet
            start = text.find("\n", start) + 1
        while 0 < start < len(text):
            end = text.find("\n", start)
            end = len(text) if end < 0 else end
            line = text[start:end]
            if sum(not c.isspace() for c in line) >= MIN_LINE_CHARS:
                h = hashlib.sha1(f"{t}\0{start}\0{line}".encode()).hexdigest()
                keyed.append((h, NextLine(t, start, end)))
            start = end + 1
    keyed.sort(key=lambda kv: kv[0])
    return sorted((item for _, item in keyed[:n]), key=lambda i: (i.text, i.start))


def prompt_ids(tokenizer, prefix: str, ctx: int) -> list[int]:
    """BOS (or EOS where there is none) and the last ``ctx - 1`` tokens of ``prefix``."""
    start = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
    ids = tokenizer.encode(prefix, add_special_tokens=False).ids.tolist()
    return [start] + ids[len(ids) - (ctx - 1) :] if len(ids) > ctx - 1 else [start] + ids


_LINE_BREAKS = re.compile(r"(?:[ \t\r\f\v]*\n)+")


def written_line(decoded: str) -> str | None:
    """The line a model wrote after the prompt: after its leading line break(s) (blank lines
    included), up to the next newline; None while it has not finished one (or never broke the
    line: it went on with the prompt's last line)."""
    m = _LINE_BREAKS.match(decoded)
    if m is None:
        return None
    rest = decoded[m.end() :]
    return rest.split("\n", 1)[0] if "\n" in rest else None


def line_matches(decoded: str, line: str) -> bool:
    """The model wrote ``line`` (:func:`written_line`; trailing whitespace stripped on both; a
    line cut by the token limit counts as written up to there)."""
    m = _LINE_BREAKS.match(decoded)
    if m is None:
        return False
    return decoded[m.end() :].split("\n", 1)[0].rstrip() == line.rstrip()


def greedy_batches(
    model,
    tokenizer,
    prompts: list[list[int]],
    *,
    device,
    max_new_tokens: int,
    batch: int,
    stopping=None,
) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (token ids), longest prompts batched together and
    left-padded, under bf16 autocast on a GPU; the model's train mode is restored after.

    Args:
        model: a transformers causal LM on ``device``.
        tokenizer: its XTokenizer (pad and end ids).
        prompts: one list of ids per prompt.
        device: the model's device.
        max_new_tokens: most tokens written per prompt.
        batch: prompts per ``generate`` call.
        stopping: ``L -> StoppingCriteriaList`` for a batch whose prompts are L wide, or None.

    Returns:
        The written ids of each prompt, in the prompts' order (padding included after an end).
    """
    import torch
    from transformers import GenerationConfig

    pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad,
        eos_token_id=tokenizer.eos_id,
    )
    order = sorted(range(len(prompts)), key=lambda k: -len(prompts[k]))
    out: list[list[int]] = [[] for _ in prompts]
    with inference(model, device=device):
        for b in range(0, len(order), batch):
            ks = order[b : b + batch]
            L = max(len(prompts[k]) for k in ks)
            ids = torch.full((len(ks), L), pad, dtype=torch.long)
            mask = torch.zeros(len(ks), L, dtype=torch.long)
            for r, k in enumerate(ks):
                ids[r, L - len(prompts[k]) :] = torch.tensor(prompts[k])
                mask[r, L - len(prompts[k]) :] = 1
            extra = {} if stopping is None else {"stopping_criteria": stopping(L)}
            gen_ids = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                generation_config=gen,
                **extra,
            )
            for r, k in enumerate(ks):
                out[k] = gen_ids[r, L:].tolist()
    return out


@contextlib.contextmanager
def inference(*models, device) -> Iterator[None]:
    """``models`` in eval mode under ``torch.inference_mode`` and bf16 autocast on a GPU; their
    train modes back after."""
    import torch

    was = [m.training for m in models]
    for m in models:
        m.eval()
    autocast = torch.autocast(
        "cuda", dtype=torch.bfloat16, enabled=torch.device(device).type == "cuda"
    )
    try:
        with torch.inference_mode(), autocast:
            yield
    finally:
        for m, w in zip(models, was, strict=True):
            m.train(w)


def next_line_exact_match(
    model,
    tokenizer,
    texts: list[str],
    items: list[NextLine],
    *,
    ctx: int,
    device,
    max_new_tokens: int = 64,
    batch: int = 64,
) -> dict[str, Any]:
    """Greedy next-line exact match of a model over ``items`` (:func:`select_next_lines`).

    Args:
        model: a transformers causal LM on ``device``.
        tokenizer: its XTokenizer.
        texts: the texts the items index.
        items: the lines to complete.
        ctx: most prompt tokens (BOS included).
        device: the model's device.
        max_new_tokens: decoding stops here or once the model finished a new line.
        batch: prompts per ``generate`` call (left-padded).

    Returns:
        ``{"exact_match", "lines", "matched"}``.
    """
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id

    def decode(ids: list[int]) -> str:
        raw = b"".join(tokenizer.token_bytes(i) for i in ids if i != pad)
        return raw.decode("utf-8", errors="replace")

    class StopAfterLine(StoppingCriteria):
        """A row is done once it has written a whole new line."""

        def __init__(self, prompt_len: int) -> None:
            self.prompt_len = prompt_len

        def __call__(self, input_ids, scores, **kwargs):
            new = input_ids[:, self.prompt_len :].tolist()
            done = [written_line(decode(row)) is not None for row in new]
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    prompts = [prompt_ids(tokenizer, texts[i.text][: i.start].rstrip(), ctx) for i in items]
    written = greedy_batches(
        model, tokenizer, prompts, device=device, max_new_tokens=max_new_tokens, batch=batch,
        stopping=lambda L: StoppingCriteriaList([StopAfterLine(L)]),
    )  # fmt: skip
    matched = 0
    for item, new in zip(items, written, strict=True):
        line = texts[item.text][item.start : item.end]
        matched += line_matches(decode(new), line)
    return {"exact_match": matched / max(1, len(items)), "lines": len(items), "matched": matched}


def continuation_bits_per_byte(
    student,
    student_tok,
    scorer,
    scorer_tok,
    texts: list[str],
    *,
    prompt_tokens: int,
    new_tokens: int,
    device,
    batch: int = 32,
) -> dict[str, Any]:
    """How a scorer model rates the student's own writing: the student continues the first
    ``prompt_tokens`` of each text greedily (up to ``new_tokens`` tokens, or its end of text),
    and the scorer's bits per byte of the continuations given their prompts are pooled over the
    texts (what on-policy distillation optimizes: the teacher's likelihood of what the student
    writes; lower is better).

    Prompt and continuation are cut at the last whole UTF-8 character; a continuation left empty
    (the student ended at once) is counted apart. The scorer reads prompt + continuation as one
    text in its own tokenization; the continuation's tokens are those after the longest run of
    its tokens that lies wholly inside the prompt's bytes (a token across the boundary counts
    for the continuation), over the continuation's bytes.

    Args:
        student: the student, a transformers causal LM on ``device``.
        student_tok: its XTokenizer.
        scorer: the scoring model (a teacher), on ``device``.
        scorer_tok: its XTokenizer.
        texts: one prompt per text (texts with no token are skipped).
        prompt_tokens: student tokens of each prompt, its start token (BOS, or EOS where there
            is none) included.
        new_tokens: most tokens the student writes.
        device: both models' device.
        batch: prompts per ``generate`` call.

    Returns:
        ``{"bits_per_byte", "bytes", "continuations", "empty"}`` (``bits_per_byte`` None when
        every continuation is empty).
    """
    import torch
    from transformers import GenerationConfig

    pad = student_tok.pad_id if student_tok.pad_id is not None else student_tok.eos_id
    ends = {pad, student_tok.eos_id}
    start = student_tok.bos_id if student_tok.bos_id is not None else student_tok.eos_id
    prompts = []
    for text in texts:
        ids = student_tok.encode(text, add_special_tokens=False).ids.tolist()[: prompt_tokens - 1]
        if ids:
            prompts.append([start] + ids)
    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=new_tokens,
        pad_token_id=pad,
        eos_token_id=student_tok.eos_id,
    )

    def text_bytes(tok, ids: list[int]) -> bytes:
        return b"".join(tok.token_bytes(i) for i in ids)

    pairs: list[tuple[bytes, bytes]] = []  # (prompt, continuation), whole characters
    autocast = torch.autocast(
        "cuda", dtype=torch.bfloat16, enabled=torch.device(device).type == "cuda"
    )
    was = (student.training, scorer.training)
    student.eval()
    scorer.eval()
    try:
        with torch.inference_mode(), autocast:
            for b in range(0, len(prompts), batch):
                chunk = prompts[b : b + batch]
                L = max(len(p) for p in chunk)
                ids = torch.full((len(chunk), L), pad, dtype=torch.long)
                mask = torch.zeros(len(chunk), L, dtype=torch.long)
                for r, p in enumerate(chunk):
                    ids[r, L - len(p) :] = torch.tensor(p)
                    mask[r, L - len(p) :] = 1
                out = student.generate(
                    input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen
                )
                for r, p in enumerate(chunk):
                    written = []
                    for i in out[r, L:].tolist():
                        if i in ends:
                            break
                        written.append(i)
                    head = whole_chars(text_bytes(student_tok, p[1:]))
                    full = whole_chars(text_bytes(student_tok, p[1:] + written))
                    pairs.append((head, full[len(head) :]))
            bits, nbytes, empty = 0.0, 0, 0
            for head, tail in pairs:
                if not tail:
                    empty += 1
                    continue
                bits += scorer_bits(scorer, scorer_tok, head, tail, device=device)
                nbytes += len(tail)
    finally:
        student.train(was[0])
        scorer.train(was[1])
    return {
        "bits_per_byte": bits / nbytes if nbytes else None,
        "bytes": nbytes,
        "continuations": len(pairs) - empty,
        "empty": empty,
    }


def scorer_bits(scorer, scorer_tok, head: bytes, tail: bytes, *, device) -> float:
    """A scorer's bits of ``tail`` given ``head``: the scorer reads head + tail as one text in its
    own tokenization (its start token first); the tail's tokens are those after the longest run
    of tokens that lies wholly inside the head's bytes (a token across the boundary counts for the
    tail).

    Args:
        scorer: the scoring model (a transformers causal LM) on ``device``.
        scorer_tok: its XTokenizer.
        head: the prompt, whole UTF-8 characters.
        tail: what follows it, whole UTF-8 characters.
        device: the scorer's device.

    Returns:
        The bits (divide by ``len(tail)`` for bits/byte).
    """
    import math

    import torch

    start = scorer_tok.bos_id if scorer_tok.bos_id is not None else scorer_tok.eos_id
    text = (head + tail).decode("utf-8")
    ids = [start] + scorer_tok.encode(text, add_special_tokens=False).ids.tolist()
    inside, at = 0, 0  # scorer tokens wholly inside the prompt, their bytes
    for i in ids[1:]:
        at += len(scorer_tok.token_bytes(i))
        if at > len(head):
            break
        inside += 1
    with inference(scorer, device=device):
        x = torch.tensor([ids], device=device)
        logp = torch.log_softmax(scorer(input_ids=x, use_cache=False).logits.float()[0], -1)
        token_logp = logp[:-1].gather(1, x[0, 1:, None])[:, 0]  # of ids[1:]
    return float(-token_logp[inside:].sum()) / math.log(2)


def whole_chars(raw: bytes) -> bytes:
    """The longest prefix of ``raw`` that is valid UTF-8 (a cut last character, or anything from
    an invalid byte on, dropped)."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return raw[: e.start]
    return raw
