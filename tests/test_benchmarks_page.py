"""docs/benchmarks.md's tables are what ``python -m benchmarks render`` makes of the latest records (no benchmark runs).

A table typed or edited by hand, or a results file changed without rendering the page again, fails here; the fix is
``python -m benchmarks render``.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import records, render
from benchmarks.engines import ENGINES
from benchmarks.problems import PROBLEMS
from benchmarks.studies.peers_at_scale import register
from benchmarks.suites import SUITES

register()  # the BlackJAX control-variate engines of the peers records at N = 10⁶

PAGE = render.PAGE.read_text(encoding="utf-8")
TABLES = render.tables_on(PAGE)


def test_the_page_has_a_table_for_every_suite():
    shown = {suite for suite, _, _ in TABLES}
    assert set(SUITES) <= shown, f"suites without a table on docs/benchmarks.md: {set(SUITES) - shown}"


@pytest.mark.parametrize("suite, filters, on_page", TABLES, ids=[f"{s} {f}".strip() for s, f, _ in TABLES])
def test_table_agrees_with_its_results_file(suite, filters, on_page):
    expected = render.table(suite, dict(item.split("=", 1) for item in filters.split()))
    assert on_page == expected, f"the {suite} table is stale: run `python -m benchmarks render`"
    assert expected.count("\n") > 2, f"the {suite} table has no rows: run `python -m benchmarks run {suite}`"


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_every_record_is_complete(suite):
    """Each record names a known cell, its status, its commit and machine, and where a figure came from."""
    found = records.load(suite)
    assert found, f"no records in {records.path(suite)}"
    for record in found:
        assert record["status"] in {"ok", "skipped", "failed"}, record
        assert record["status"] == "ok" or record.get("reason"), f"a {record['status']} cell says why: {record}"
        assert record.get("commit") and record.get("machine", {}).get("threads"), record
        provenance = record.get("provenance", "")
        assert provenance == "measured" or provenance.startswith("transcribed from benchmarks/results/"), record
        if provenance == "measured":
            assert record["engine"] in ENGINES and (record["problem"] is None or record["problem"] in PROBLEMS)
            assert {"start", "end"} <= set(record["load"]) and "date" in record, record


def test_render_is_deterministic_and_idempotent():
    once = render.render_page(PAGE)
    assert render.render_page(once) == once


def test_a_changed_record_makes_the_page_stale(tmp_path, monkeypatch):
    """The check is live: editing a figure in a results file changes the rendered table."""
    suite = "peers"
    lines = records.path(suite).read_text(encoding="utf-8").splitlines()
    last = json.loads(lines[-1])
    last["metrics"]["seconds"] = 12345.6
    (tmp_path / suite).mkdir()
    (tmp_path / suite / "cells.jsonl").write_text("\n".join([*lines[:-1], json.dumps(last)]) + "\n")
    monkeypatch.setattr(records, "RESULTS", tmp_path)
    assert render.render_page(PAGE) != PAGE


def test_a_missing_peer_is_a_skipped_cell_not_a_silent_one():
    from benchmarks.__main__ import _run_cell
    from benchmarks.engines import Cell, Engine

    engine = Engine("absent-peer", "sgmcmc", lambda cell: {}, needs=("no_such_package_here",))
    record = _run_cell(engine, Cell(PROBLEMS["logistic"], 100, 0, 1.0), {"commit": "x"})
    assert record["status"] == "skipped" and "no_such_package_here" in record["reason"], record


def test_a_failing_engine_is_a_failed_cell_with_its_reason():
    from benchmarks.__main__ import _run_cell
    from benchmarks.engines import Cell, Engine

    def broken(cell):
        raise RuntimeError("the peer broke")

    record = _run_cell(Engine("broken", "sgmcmc", broken), Cell(None, 0, 0, 1.0), {"commit": "x"})
    assert record["status"] == "failed" and "the peer broke" in record["reason"], record
    assert {"start", "end"} <= set(record["load"])


def test_the_readme_nuts_table_quotes_the_records():
    """The README's "when to use NUTS instead" table holds the latest peers records' seconds (logistic, d = 10), so it
    cannot drift from the benchmarks page again."""
    import re

    readme = (records.ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("**When to use NUTS instead**", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\| 10[⁰¹²³⁴⁵⁶⁷⁸⁹]+ \|", line)]
    assert len(rows) >= 3, section
    latest = {
        (r["n"], r["machine"]["device"], r["engine"]): r for r in records.latest("peers") if r["problem"] == "logistic"
    }
    exponents = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹", "0123456789")
    for row in rows:
        n, machine, ours, nuts = (cell.strip() for cell in row.strip("|").split("|"))
        n = 10 ** int(n[2:].translate(exponents))
        device = "H200" if "H200" in machine else "cpu"

        quoted = [ours, *(part.strip().rstrip("*") for part in nuts.split("/"))]
        engines = ("ours-sghmc", "numpyro-nuts", "numpyro-nuts (compiled)")
        recorded = [f"{latest[n, device, engine]['metrics']['seconds']:,.1f}" for engine in engines]
        assert quoted == recorded, row
