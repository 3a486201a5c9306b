"""Greedy completion of held-out functions, rated by a teacher: the downstream measure of the
healing experiment beside bits/byte and next-line exact match.

* **items**: functions of a split's texts (``def`` or ``async def`` at any indentation) that have
  a docstring and a body that ends inside the text (a later non-blank line at the ``def``'s
  indentation or less). The prompt is the text from the start of the ``def`` line through the
  docstring's closing quotes (no line break after them: byte-level BPE tokenizers merge a newline
  with the next line's indentation, see ``heal_eval``); the reference body is what follows, up to
  the function's end. A fixed set is taken (the smallest SHA-1 of text index, offset and name),
  so no seed and no model changes the choice.
* **completion**: the student continues the prompt greedily (BOS or EOS first, at most ``ctx``
  tokens of prompt, up to ``max_new_tokens`` new ones, stopping at its end of text); what it wrote
  is cut where the function ends (:func:`body_of`).
* **rating**: the teacher's bits per byte of each completion given its prompt
  (``heal_eval.scorer_bits``), pooled over the functions (lower is better: code the teacher finds
  likely). A completion left empty is counted apart; the mean completion length is reported so
  that a student that learned to write little is seen as such.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from benchmarks.quality import heal_eval

_DEF = re.compile(r"^([ \t]*)(?:async[ \t]+)?def[ \t]+(\w+)[ \t]*\(")
_DOC_OPEN = re.compile(r"^[ \t]*[rRuUbB]{0,2}(\"\"\"|''')")


@dataclass(frozen=True)
class FunctionItem:
    """One function to complete: ``prompt`` (signature and docstring), the reference ``body``
    (from the line break after the docstring to the function's end), the ``def``'s indentation
    width, the function's name and the index of its text."""

    text: int
    name: str
    indent: int
    prompt: str
    body: str


def _width(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def _signature_end(lines: list[str], first: int) -> int | None:
    """The index of the line that ends the signature starting at ``lines[first]`` (the line whose
    ``:`` closes it at bracket depth 0), or None if the text ends first."""
    depth = 0
    for k in range(first, len(lines)):
        code = lines[k].split("#", 1)[0]
        depth += sum(code.count(c) for c in "([{") - sum(code.count(c) for c in ")]}")
        if depth <= 0 and code.rstrip().endswith(":"):
            return k
    return None


def _docstring_end(lines: list[str], first: int) -> int | None:
    """The index of the line that closes the docstring opening on ``lines[first]``, or None."""
    m = _DOC_OPEN.match(lines[first])
    if m is None:
        return None
    quote = m.group(1)
    rest = lines[first][m.end() :]
    if quote in rest:
        return first
    for k in range(first + 1, len(lines)):
        if quote in lines[k]:
            return k
    return None


def functions_of(text: str, t: int = 0) -> list[FunctionItem]:
    """Every function of ``text`` with a docstring and a body that ends inside the text.

    Args:
        text: a split's text (a chunk of a source file).
        t: its index (recorded in the items).

    Returns:
        The items in text order.
    """
    lines = text.split("\n")
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line) + 1)
    out = []
    for i, line in enumerate(lines):
        m = _DEF.match(line)
        if m is None:
            continue
        indent = _width(line)
        sig = _signature_end(lines, i)
        if sig is None or sig + 1 >= len(lines):
            continue
        doc = _docstring_end(lines, sig + 1)
        if doc is None or _width(lines[sig + 1]) <= indent:
            continue
        end = None  # the first non-blank line at the def's indentation or less
        for k in range(doc + 1, len(lines)):
            if lines[k].strip() and _width(lines[k]) <= indent:
                end = k
                break
        if end is None:
            continue
        body_lines = lines[doc + 1 : end]
        if not any(b.strip() for b in body_lines):
            continue
        prompt = text[starts[i] : starts[doc] + len(lines[doc])]
        body = "\n" + "\n".join(body_lines).rstrip()
        out.append(FunctionItem(t, m.group(2), indent, prompt, body))
    return out


def select_functions(texts: list[str], n: int) -> list[FunctionItem]:
    """The ``n`` functions of ``texts`` with the smallest SHA-1 of (text index, prompt offset,
    name), in text order (fewer if the texts hold fewer).

    Args:
        texts: a split's texts, in file order.
        n: how many.

    Returns:
        The items.
    """
    keyed = []
    for t, text in enumerate(texts):
        for item in functions_of(text, t):
            offset = text.find(item.prompt)
            h = hashlib.sha1(f"{t}\0{offset}\0{item.name}".encode()).hexdigest()
            keyed.append((h, offset, item))
    keyed.sort(key=lambda k: k[0])
    return [item for _, _, item in sorted(keyed[:n], key=lambda k: (k[2].text, k[1]))]


def body_of(written: str, indent: int) -> str:
    """What a model wrote after a prompt, cut where the function ends.

    The function ends before the first non-blank line (after the first line break) whose
    indentation is ``indent`` or less; trailing whitespace is dropped.

    Args:
        written: the decoded continuation of the prompt.
        indent: the ``def`` line's indentation width.

    Returns:
        The body as written (empty when the model wrote none).
    """
    lines = written.split("\n")
    kept = lines[:1]
    for line in lines[1:]:
        if line.strip() and _width(line) <= indent:
            break
        kept.append(line)
    return "\n".join(kept).rstrip()


def complete_functions(
    model,
    tokenizer,
    items: list[FunctionItem],
    *,
    ctx: int,
    device,
    max_new_tokens: int = 128,
    batch: int = 32,
) -> list[str]:
    """Greedy completions of ``items`` by ``model``, each cut by :func:`body_of`.

    Args:
        model: a transformers causal LM on ``device``.
        tokenizer: its XTokenizer.
        items: the functions (:func:`select_functions`).
        ctx: most prompt tokens (the start token included).
        device: the model's device.
        max_new_tokens: most tokens written per function.
        batch: prompts per ``generate`` call (left-padded).

    Returns:
        One completion per item, whole UTF-8 characters only.
    """
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    ends = {pad, tokenizer.eos_id}
    prompts = [heal_eval.prompt_ids(tokenizer, item.prompt, ctx) for item in items]
    written_ids = heal_eval.greedy_batches(
        model, tokenizer, prompts, device=device, max_new_tokens=max_new_tokens, batch=batch
    )
    out: list[str] = []
    for item, new in zip(items, written_ids, strict=True):
        written = []
        for i in new:
            if i in ends:
                break
            written.append(i)
        raw = heal_eval.whole_chars(b"".join(tokenizer.token_bytes(i) for i in written))
        out.append(body_of(raw.decode("utf-8"), item.indent))
    return out


def completion_bits_per_byte(
    student,
    student_tok,
    scorer,
    scorer_tok,
    items: list[FunctionItem],
    *,
    ctx: int,
    device,
    max_new_tokens: int = 128,
) -> dict[str, Any]:
    """The scorer's bits per byte of the student's greedy completions of ``items``.

    Args:
        student: the student, a transformers causal LM on ``device``.
        student_tok: its XTokenizer.
        scorer: the rating model (a teacher) on ``device``.
        scorer_tok: its XTokenizer.
        items: the functions.
        ctx: most prompt tokens.
        device: both models' device.
        max_new_tokens: most tokens the student writes per function.

    Returns:
        ``{"bits_per_byte", "bytes", "functions", "empty", "mean_bytes"}`` (``bits_per_byte``
        None when every completion is empty).
    """
    written = complete_functions(
        student, student_tok, items, ctx=ctx, device=device, max_new_tokens=max_new_tokens
    )
    bits, nbytes, empty = 0.0, 0, 0
    for item, body in zip(items, written):
        tail = body.encode("utf-8")
        if not tail.strip():
            empty += 1
            continue
        bits += heal_eval.scorer_bits(
            scorer, scorer_tok, item.prompt.encode("utf-8"), tail, device=device
        )
        nbytes += len(tail)
    done = len(items) - empty
    return {
        "bits_per_byte": bits / nbytes if nbytes else None,
        "bytes": nbytes,
        "functions": len(items),
        "empty": empty,
        "mean_bytes": nbytes / done if done else 0.0,
    }
