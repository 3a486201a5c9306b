"""Every figure the README and docs/results.md state comes from a committed results file.

The README's "Measured" table and the tables of docs/results.md have a `figure` column and a
`results` column. Each number of a figure (a ratio, tokens/s, GiB, ms, bits/byte, a count) must
appear in a results file its row links: in that file's current figures (the text before its
first `## Earlier` heading), or in a row of a `.jsonl` file that results file links and whose
commit its current text names (every row of a `.jsonl` a claims table links itself), rounded
as the figure is written (2.7440 is any value in [2.74395, 2.74405]; 41,881 any in [41880.5,
41881.5]; a percentage may be a fraction in the rows). Signs are not compared, and numbers
inside lists of a row (curves, per-step times) are not read. Shapes (`1x4096`, `4 x 128`),
numbers glued to letters (`0.6B`, `SmolLM2`, commit ids) and dates are names, not figures.

And every file and folder of benchmarks/results (history/ aside) is linked from docs/results.md
or from a results file that docs/results.md links.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from dataclasses import dataclass
from functools import cache

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
INDEX = ROOT / "docs" / "results.md"
RESULTS = ROOT / "benchmarks" / "results"

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_CODE = re.compile(r"`[^`]*`")
_SHAPE = re.compile(r"(?<![\w.])\d+ ?x ?\d+(?![\w.])")
_DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
# a number: digits in groups of three with commas, or plain digits, then an optional fraction
_NUMBER = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?")
_EARLIER = re.compile(r"^## Earlier", re.MULTILINE)


@dataclass(frozen=True)
class Figure:
    """One number of a figure cell: its value and how many decimals it is written with."""

    text: str
    value: float
    decimals: int


@dataclass(frozen=True)
class Row:
    """A row of a claims table: where it is, its figure cell and the results files it links."""

    where: str
    figure: str
    sources: tuple[pathlib.Path, ...]


def figures(cell: str) -> list[Figure]:
    """The numbers of a figure cell, less shapes, code spans, link targets and names.

    Args:
        cell: the text of a figure cell.

    Returns:
        Its figures in order.
    """
    text = _LINK.sub("]", _CODE.sub(" ", cell))
    text = _SHAPE.sub(" ", _DATE.sub(" ", text))
    out = []
    for m in _NUMBER.finditer(text):
        after = text[m.end() : m.end() + 2]
        # glued to a letter: a name or size (135M, 0.6B, 1e-3), unless an `x` ratio (1.65x)
        if after[:1].isalpha() and not (after[:1] == "x" and not after[1:2].isalnum()):
            continue
        # the tail of a hyphenated name (Gemma-3, Qwen2.5-Coder)
        if m.start() >= 2 and text[m.start() - 1] == "-" and text[m.start() - 2].isalpha():
            continue
        whole, frac = m.group(1), m.group(2) or ""
        value = float(whole.replace(",", "") + ("." + frac if frac else ""))
        out.append(Figure(m.group(0), value, len(frac)))
    return out


def _numbers_in_text(text: str) -> list[tuple[float, int]]:
    return [
        (float(m.group(1).replace(",", "") + ("." + m.group(2) if m.group(2) else "")),
         len(m.group(2) or ""))
        for m in _NUMBER.finditer(text)
    ]  # fmt: skip


def _numbers_in_json(obj) -> list[float]:
    if isinstance(obj, bool) or obj is None:
        return []
    if isinstance(obj, int | float):
        return [float(obj)]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _numbers_in_json(v)]
    if isinstance(obj, str):
        return []
    return []  # lists: curves and per-step series, not figures


def current_part(text: str) -> str:
    """A results file's current figures: its text before the first `## Earlier` heading."""
    m = _EARLIER.search(text)
    return text if m is None else text[: m.start()]


def _links(text: str, base: pathlib.Path) -> list[pathlib.Path]:
    out = []
    for target in _LINK.findall(text):
        target = target.split("#", 1)[0]
        if not target or "://" in target:
            continue
        out.append(pathlib.Path(os.path.normpath(base / target)))
    return out


@cache
def _source_numbers(path: pathlib.Path) -> tuple[tuple[tuple[float, int], ...], tuple[float, ...]]:
    """The numbers a results file offers: those of its current text (with their decimals) and
    those of the rows it names: rows of the .jsonl files it links whose commit its current text
    names (a .jsonl linked straight from a claims table: all its rows)."""
    if path.suffix == ".jsonl":
        text_numbers: list[tuple[float, int]] = []
        row_files = [path]
        named = None
    else:
        text = current_part(path.read_text(encoding="utf-8"))
        text_numbers = _numbers_in_text(text)
        row_files = [p for p in _links(text, path.parent) if p.suffix == ".jsonl" and p.is_file()]
        named = text
    row_numbers: list[float] = []
    for rows in dict.fromkeys(row_files):
        for line in rows.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            commit = str(row.get("commit", "")).split("+")[0]
            if named is None or (commit and commit in named):
                row_numbers.extend(_numbers_in_json(row))
    return tuple(text_numbers), tuple(row_numbers)


def found(figure: Figure, sources: tuple[pathlib.Path, ...]) -> bool:
    """Whether a results file states the figure, rounded as the figure is written."""
    tolerance = 0.5 * 10**-figure.decimals + 1e-9
    for path in sources:
        text_numbers, row_numbers = _source_numbers(path)
        for value, decimals in text_numbers:
            if decimals >= figure.decimals and abs(value - figure.value) <= tolerance:
                return True
        for value in row_numbers:
            for scaled in (abs(value), abs(value) * 100):  # a percentage kept as a fraction
                if abs(scaled - figure.value) <= tolerance:
                    return True
    return False


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def claim_rows(path: pathlib.Path, heading: str | None = None) -> list[Row]:
    """The rows of the claims tables of a doc (those with `figure` and `results` columns).

    Args:
        path: README.md or docs/results.md.
        heading: read only the section under this `## ` heading.

    Returns:
        Its rows.
    """
    text = path.read_text(encoding="utf-8")
    if heading is not None:
        start = text.index(f"\n## {heading}\n")
        end = text.find("\n## ", start + 1)
        text = text[start : None if end < 0 else end]
    rows: list[Row] = []
    header: list[str] | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = _cells(line)
        if header is None:
            header = [c.lower() for c in cells]
            continue
        if set("".join(cells)) <= set("-: "):
            continue
        if "figure" not in header or "results" not in header:
            continue
        row = dict(zip(header, cells))
        sources = tuple(
            p
            for p in _links(row["results"], path.parent)
            if RESULTS in p.parents and p.is_file() and p.suffix in (".md", ".jsonl")
        )
        rows.append(Row(f"{path.name}: {row.get('claim', line)[:70]}", row["figure"], sources))
    return rows


README_ROWS = claim_rows(README, "Measured")
INDEX_ROWS = claim_rows(INDEX)


def test_the_readme_has_a_measured_table():
    assert len(README_ROWS) >= 5


@pytest.mark.parametrize("row", README_ROWS, ids=lambda r: r.where)
def test_a_readme_figure_cell_holds_one_figure(row):
    """The README states one figure per claim; ranges, other shapes and caveats live in the
    results file the row links."""
    assert len(figures(row.figure)) == 1, f"{row.where}: {row.figure!r} is not one figure"


@pytest.mark.parametrize("row", README_ROWS + INDEX_ROWS, ids=lambda r: r.where)
def test_every_figure_is_in_the_results_file_its_row_links(row):
    assert row.sources, f"{row.where}: the row links no results file in benchmarks/results"
    figs = figures(row.figure)
    assert figs, f"{row.where}: the figure cell holds no figure: {row.figure!r}"
    missing = [f.text for f in figs if not found(f, row.sources)]
    names = ", ".join(str(p.relative_to(ROOT)) for p in row.sources)
    assert not missing, f"{row.where}: {missing} not in {names} (current figures or rows)"


def test_a_figure_without_a_source_fails(tmp_path):
    results = tmp_path / "r.md"
    rows = tmp_path / "r.jsonl"
    rows.write_text(
        json.dumps({"commit": "abc1234", "tok_s": 41881.39, "wait": 0.00373, "curve": [9.87]})
        + "\n"
        + json.dumps({"commit": "def5678", "speedup": 29.6})
        + "\n"
    )
    results.write_text(
        "# r\n\nCurrent (abc1234): **1.65x** at 1x4096, 0.341 MFU; rows [r.jsonl](r.jsonl).\n\n"
        "## Earlier\n\n27.9x (def5678)\n"
    )
    src = (results,)
    fig = {
        f.text: f
        for f in figures("1.65x (41,881 tok/s), 0.37%, MFU 0.34, 27.9x, 29.6x, 9.87, 1.8x")
    }
    assert found(fig["1.65"], src) and found(fig["41,881"], src)
    assert found(fig["0.37"], src) and found(fig["0.34"], src)  # a fraction; a rounding
    assert not found(fig["27.9"], src)  # only under "## Earlier"
    assert not found(fig["29.6"], src)  # a row of a commit the current text does not name
    assert not found(fig["9.87"], src)  # only inside a list of the row
    assert not found(fig["1.8"], src)  # no source rounds to it
    assert [
        f.text for f in figures("SmolLM2-135M, Gemma-3, 1x4096, `--steps 40`, 0.6B, 2.5 s")
    ] == ["2.5"]


def _top_level_results() -> list[pathlib.Path]:
    return sorted(p for p in RESULTS.iterdir() if p.name != "history")


def _linked_from_index() -> set[pathlib.Path]:
    linked = set(_links(INDEX.read_text(encoding="utf-8"), INDEX.parent))
    for md in [p for p in linked if RESULTS in p.parents and p.suffix == ".md" and p.is_file()]:
        linked.update(_links(md.read_text(encoding="utf-8"), md.parent))
    return linked


@pytest.mark.parametrize("path", _top_level_results(), ids=lambda p: p.name)
def test_every_results_file_is_linked_from_the_index(path):
    linked = _linked_from_index()
    hit = path in linked or (path.is_dir() and any(path in p.parents for p in linked))
    assert hit, (
        f"benchmarks/results/{path.name} is linked neither from docs/results.md nor from a "
        "results file it links (or move it to benchmarks/results/history/)"
    )


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.md")), ids=lambda p: p.name)
def test_every_results_file_opens_with_its_current_figures_and_command(path):
    lines = path.read_text(encoding="utf-8").splitlines()
    head = "\n".join(lines[:30]).lower()
    # "Current figures", or a script's bold summary line of figures right under the title
    summary = re.search(r"\*\*[^*]*\d[^*]*\*\*", "\n".join(lines[:5]))
    assert "current figure" in head or summary, (
        f"{path.name}: no current figures in its first 30 lines"
    )
    assert re.search(r"python |\./scripts/|xtoken ", head), (
        f"{path.name}: no command in its first 30 lines"
    )
