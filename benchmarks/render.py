"""The page's tables, made from the latest records: ``python -m benchmarks render`` rewrites them in place.

A table sits between ``<!-- table: <suite> -->`` and ``<!-- end table -->`` in ``docs/benchmarks.md``; a filter
such as ``<!-- table: peers problem=logistic -->`` keeps the rows whose field has that value (``where`` is the
record's device). ``tests/test_benchmarks_page.py`` fails when a table on the page is not what this renders.
"""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks import records
from benchmarks.suites import SUITES

__all__ = ["PAGE", "render_page", "table"]

PAGE = records.ROOT / "docs" / "benchmarks.md"
MARK = re.compile(r"(<!-- table: ([\w-]+)((?: [\w-]+=[^\s>]+)*) -->\n)(.*?)(<!-- end table -->)", flags=re.S)


def _matches(record: dict, filters: dict[str, str]) -> bool:
    for key, value in filters.items():
        found = record.get("machine", {}).get("device", "cpu") if key == "where" else record.get(key)
        if str(found) != value:
            return False
    return True


def _order(suite, record: dict) -> tuple:
    engines = list(suite.engines)
    base = record["engine"].removesuffix(" (compiled)")  # a transcribed second run sits under its first
    rank = engines.index(base) + 0.5 * (base != record["engine"]) if base in engines else len(engines)
    device = record.get("machine", {}).get("device", "cpu")
    return str(record["problem"]), record["n"], device != "cpu", device, rank


def posteriordb_totals() -> str:
    """Verdicts per engine and priors over ``python -m benchmarks posteriordb``'s latest cells (its own records)."""
    from benchmarks import posteriordb

    cells = posteriordb.latest(records.path("posteriordb"))
    return "\n".join(posteriordb.totals(cells, list(dict.fromkeys(key[1] for key in cells)))) + "\n"


def _collapsed(column, rows: list[dict]) -> bool:
    """Whether to leave ``column`` out: no row has a figure in it, or (if collapsible) every row shows the same."""
    shown = {column.show(r) for r in rows}
    return bool(rows) and (shown == {"–"} or (column.collapsible and len(rows) > 1 and len(shown) == 1))


def table(name: str, filters: dict[str, str] | None = None) -> str:
    """The Markdown table of suite ``name``'s latest records (those matching ``filters``)."""
    if name == "posteriordb":
        return posteriordb_totals()
    suite = SUITES[name]
    rows = [r for r in records.latest(name) if _matches(r, filters or {})]
    rows.sort(key=lambda r: _order(suite, r))
    columns = [c for c in suite.columns if not _collapsed(c, rows)]
    lines = ["| " + " | ".join(c.title for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(c.show(r).replace("|", "\\|") for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def render_page(text: str) -> str:
    def replace(match: re.Match) -> str:
        filters = dict(item.split("=", 1) for item in match.group(3).split())
        return match.group(1) + table(match.group(2), filters) + match.group(5)

    return MARK.sub(replace, text)


def tables_on(text: str) -> list[tuple[str, str, str]]:
    """(suite, filter text, table as the page has it) for each marked table of ``text``."""
    return [(m.group(2), m.group(3).strip(), m.group(4)) for m in MARK.finditer(text)]


def write(page: Path = PAGE) -> bool:
    """Rewrite the page's tables; whether anything changed."""
    text = page.read_text(encoding="utf-8")
    new = render_page(text)
    if new != text:
        page.write_text(new, encoding="utf-8")
    return new != text
