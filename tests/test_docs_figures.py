"""Every figure the docs print in a table comes from a committed results JSON.

The rule, for README.md and docs/*.md:

1. Every results JSON the text cites (`benchmarks/results/NAME.json`, or a bare `NAME-cpu.json` /
   `NAME-h200.json`, which names a file there) exists and carries a "header" with the harness's
   schema ("agentrt-bench/1"). "unknown" is accepted as a header value only when the header says
   "retrofitted": true (results recorded before benchmarks/harness.py; scripts/retrofit_headers.py).
2. A *figure table* is a table with a decimal number in a data cell outside its first column,
   ignoring `code spans` (flag values, addresses), or a table with a `JSON:` line above it. The
   paragraph right above it has a line `Command: ...` and a line `JSON: ...` naming the results
   JSON(s) (backquoted paths).
3. In a figure table, every number in a data cell outside the first column (the first column is the
   row's label: a configuration, not a result) and outside `code spans` matches one of the cited
   JSONs: printed with d decimals, it equals some number stored in the JSON rounded to d decimals
   (0.63 matches 0.6312; 1,012 matches 1012.4). Not checked: a number after <=, >=, <, > (a target).
4. A cell written `A / B = C` (units allowed after B) prints a ratio: A and B are checked by rule 3,
   and C must be A / B rounded as printed, for some A and B that print as they do (so the reader
   can redo the division from the table: 178.2 / 383.2 = 0.46 passes, = 0.48 fails).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SCHEMA = "agentrt-bench/1"
HEADER_KEYS = ("schema", "commit", "dirty", "machine", "torch", "kernels")

CITATION = re.compile(r"benchmarks/results/([\w.-]+\.json)|(?<![\w/-])([\w.]+(?:-[\w.]+)*-(?:cpu|h200)\.json)")
CODE_SPAN = re.compile(r"`[^`]*`")
NUMBER = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)(?=x\b|[^\w]|$)")
TARGET = re.compile(r"(?:<=|>=|≤|≥|<|>)\s*$")
RATIO = re.compile(r"^\s*(\S+)\s*/\s*(\S+)(?:\s+[^\s=]+)?\s*=\s*(\S+)\s*$")


@dataclass(frozen=True)
class Table:
    doc: str
    line: int  # 1-based line of the header row
    rows: list[list[str]]  # data rows, cells stripped, the separator row dropped
    above: list[str]  # the paragraph right above the table


def doc_paths() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def cited_results(text: str) -> set[str]:
    """File names under benchmarks/results/ that `text` cites."""
    return {full or bare for full, bare in CITATION.findall(text)}


def split_row(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def tables(doc: str, text: str) -> list[Table]:
    """The Markdown tables of a document with the paragraph above each."""
    lines, found, i = text.split("\n"), [], 0
    while i < len(lines):
        if not lines[i].startswith("|"):
            i += 1
            continue
        end = i
        while end < len(lines) and lines[end].startswith("|"):
            end += 1
        stop = i - 1
        while stop >= 0 and not lines[stop].strip():
            stop -= 1
        start = stop
        while start >= 0 and lines[start].strip():
            start -= 1
        rows = [split_row(row) for row in lines[i + 2 : end]]
        found.append(Table(doc, i + 1, rows, lines[start + 1 : stop + 1]))
        i = end
    return found


def figures(cell: str) -> list[tuple[str, int]]:
    """The numbers of a cell that are results: (printed text, position), targets and code left out."""
    plain = CODE_SPAN.sub(lambda m: " " * len(m.group()), cell.replace("**", "  "))
    return [(m.group(1), m.start()) for m in NUMBER.finditer(plain) if not TARGET.search(plain[: m.start()])]


def is_figure_table(table: Table) -> bool:
    """A table with a decimal figure, or one that names its JSON (then its integers are checked too)."""
    return bool(json_paths(table)) or any("." in text for row in table.rows for cell in row[1:]
                                           for text, _ in figures(cell))


def json_numbers(value) -> list[float]:
    """Every number stored in a JSON document (booleans are not numbers)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return [number for item in items for number in json_numbers(item)]


def decimals(printed: str) -> int:
    return len(printed.split(".")[1]) if "." in printed else 0


def value(printed: str) -> float:
    return float(printed.replace(",", ""))


def matches(printed: str, numbers: list[float]) -> bool:
    """`printed` is one of `numbers` rounded as printed."""
    target, half = value(printed), 0.5 * 10 ** -decimals(printed)
    return any(math.isfinite(n) and abs(n - target) <= half + 1e-9 * max(1.0, abs(n)) for n in numbers)


def ratio_problem(cell: str) -> str | None:
    """For a cell `A / B = C`: why C is not A / B as printed, or None."""
    match = RATIO.match(cell.replace("**", ""))
    if not match or not all(NUMBER.fullmatch(part.rstrip("x")) for part in match.groups()):
        return None
    a, b, c = (part.rstrip("x") for part in match.groups())
    (ha, hb, hc) = (0.5 * 10 ** -decimals(part) for part in (a, b, c))
    if value(b) - hb <= 0:
        return f"{cell!r}: the divisor {b} is not positive"
    low, high = (value(a) - ha) / (value(b) + hb), (value(a) + ha) / (value(b) - hb)
    if high < value(c) - hc - 1e-12 or low > value(c) + hc + 1e-12:
        return f"{cell!r}: {a} / {b} = {value(a) / value(b):.4f}, printed {c}"
    return None


def json_paths(table: Table) -> list[str]:
    lines = [line for line in table.above if line.startswith("JSON:")]
    return [name for line in lines for name in sorted(cited_results(line))]


def table_problems(table: Table) -> list[str]:
    """Why a table's figures cannot be traced to its JSON (empty: they can)."""
    where = f"{table.doc}:{table.line}"
    if not is_figure_table(table):
        return []
    if not any(line.startswith("Command:") for line in table.above):
        return [f"{where}: a figure table with no `Command:` line above it"]
    names = json_paths(table)
    if not names:
        return [f"{where}: a figure table with no `JSON: benchmarks/results/...` line above it"]
    missing = [name for name in names if not (RESULTS / name).is_file()]
    if missing:
        return [f"{where}: cites {missing}, not under benchmarks/results/"]
    numbers = [n for name in names for n in json_numbers(json.loads((RESULTS / name).read_text()))]
    problems = []
    for row in table.rows:
        for cell in row[1:]:
            problem = ratio_problem(cell)
            problems += [f"{where}: {problem}"] if problem else []
            problems += [
                f"{where}: {printed} (row {row[0]!r}, cell {cell!r}) is in none of {names}"
                for printed, _ in figures(cell)
                if not matches(printed, numbers)
            ]
    return problems


def header_problems(name: str) -> list[str]:
    path = RESULTS / name
    if not path.is_file():
        return [f"{name}: cited but not under benchmarks/results/"]
    header = json.loads(path.read_text()).get("header")
    if not isinstance(header, dict):
        return [f"{name}: no header (run scripts/retrofit_headers.py for results before the harness)"]
    problems = [f"{name}: header has no {key!r}" for key in HEADER_KEYS if key not in header]
    if header.get("schema") != SCHEMA:
        problems.append(f"{name}: header schema {header.get('schema')!r}, expected {SCHEMA!r}")
    unknown = [key for key, val in header.items() if val == "unknown"]
    if unknown and header.get("retrofitted") is not True:
        problems.append(f"{name}: {unknown} are 'unknown' in a header that is not retrofitted")
    return problems


def test_every_cited_results_json_exists_and_carries_a_header():
    names = {name for path in doc_paths() for name in cited_results(path.read_text())}
    assert names, "the docs cite no results JSON: the citation pattern is broken"
    problems = [problem for name in sorted(names) for problem in header_problems(name)]
    assert not problems, "\n".join(problems)


def test_every_figure_in_a_doc_table_is_in_the_json_it_cites():
    all_tables = [table for path in doc_paths() for table in tables(path.name, path.read_text())]
    assert sum(map(is_figure_table, all_tables)) >= 10, "found too few figure tables: the parser is broken"
    problems = [problem for table in all_tables for problem in table_problems(table)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("printed", "stored", "ok"),
    [("0.63", 0.6312, True), ("0.63", 0.6351, False), ("1,012", 1012.4, True), ("229.8", 229.848, True),
     ("229.8", 229.7, False), ("4", 4.4, True), ("4", 4.6, False)],
)
def test_a_figure_matches_a_stored_number_rounded_as_printed(printed, stored, ok):
    assert matches(printed, [stored]) is ok


def test_a_made_up_figure_in_a_table_is_reported(tmp_path):
    name = "vs_llamacpp-cpu.json"
    doc = f"Command: `python benchmarks/vs_llamacpp.py`\nJSON: `benchmarks/results/{name}`\n\n"
    row = "| wall | 229.8 s | 343.7 s | 0.669 | <= 0.67 |\n"
    table = "| | agentrt | llama-server | ratio | target |\n|---|---|---|---|---|\n"
    assert table_problems(tables("x.md", doc + table + row)[0]) == []
    planted = tables("x.md", doc + table + row.replace("229.8", "219.8"))[0]
    assert [p for p in table_problems(planted) if "219.8" in p], "a wrong figure went unnoticed"
    unlabelled = tables("x.md", table + row)[0]
    assert "no `Command:` line" in table_problems(unlabelled)[0]
    counts = "| | requests |\n|---|---|\n| agentrt | {} |\n"  # integers only: checked for its JSON: line
    assert table_problems(tables("x.md", doc + counts.format(64))[0]) == []
    assert "977" in table_problems(tables("x.md", doc + counts.format(977))[0])[0]


def test_a_ratio_cell_must_be_its_quotient_as_printed():
    assert ratio_problem("199.7 / 318.4 s = **0.63**") is None
    assert "0.6272" in ratio_problem("199.7 / 318.4 s = **0.66**")
    printed = [text for text, _ in figures("**0.63** <= 0.67 `127.0.0.1` 2.12x / 1.05x, 1,012")]
    assert printed == ["0.63", "2.12", "1.05", "1,012"]
