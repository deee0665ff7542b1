"""Markdown artifacts show what comes from storage as text: no HTML element, no broken table.

The Prefect UI renders markdown artifacts with HTML enabled, so these render
each artifact builder's output with markdown-it (CommonMark with HTML on, plus
GFM tables, as the UI does) and look at the HTML that comes out.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest
from markdown_it import MarkdownIt

from ckptier.flows.artifacts import md_code, md_text
from ckptier.flows.drill import peak_memory_text, render_not_started, render_report
from ckptier.flows.scan_verify import render_verification
from ckptier.flows.tiering import render_outcome
from ckptier.tasks.reports import (ApplyRunReport, Check, DrillReport, FileProblem, ItemResult, TieringOutcome,
                                   VerifyReport, VerifyRow, VerifyTotals, verification_by_job)

HOSTILE = ["<img src=https://example.invalid/x>", "a|b`c``d|e", "<script>alert(1)</script>", "**bold** _it_ [x](y)",
           "# heading", "- item", "1. first", "![i](https://example.invalid/i.png)", "&lt;img&gt;", "back\\slash|"]
T0 = datetime(2026, 1, 1, tzinfo=UTC)
RENDER = MarkdownIt("commonmark", {"html": True}).enable("table")


def html(md: str) -> str:
    return RENDER.render(md)


def elements(md: str) -> set[str]:
    """The HTML elements the markdown renders to."""
    return set(re.findall(r"<([a-zA-Z][a-zA-Z0-9]*)", html(md)))


def text_of(md: str) -> str:
    """The visible text of rendered markdown (tags stripped, entities decoded)."""
    import html as h

    return h.unescape(re.sub(r"<[^>]+>", "", html(md))).strip()


@pytest.mark.parametrize("value", HOSTILE)
def test_md_text_renders_as_itself_and_makes_no_element(value: str) -> None:
    assert elements(md_text(value)) <= {"p"}
    assert text_of(md_text(value)) == value


@pytest.mark.parametrize("value", HOSTILE)
def test_md_code_renders_verbatim_in_a_code_span(value: str) -> None:
    assert elements(md_code(value)) <= {"p", "code"}
    assert text_of(md_code(value)).replace("\\|", "|") == value  # outside a table the escaped pipe shows


@pytest.mark.parametrize("value", HOSTILE)
def test_a_table_cell_holds_any_value_in_one_cell(value: str) -> None:
    md = "| a | b | c |\n| --- | --- | --- |\n" + f"| {md_text(value)} | {md_code(value)} | end |\n"
    out = html(md)
    assert out.count("<td>") == 3, out
    cells = re.findall(r"<td>(.*?)</td>", out, re.S)
    import html as h

    assert h.unescape(re.sub(r"<[^>]+>", "", cells[0])) == value
    assert h.unescape(re.sub(r"<[^>]+>", "", cells[1])) == value
    assert cells[2] == "end"
    assert set(re.findall(r"<([a-zA-Z][a-zA-Z0-9]*)", out)) <= {"table", "thead", "tbody", "tr", "th", "td", "code"}


def test_nothing_is_a_dash() -> None:
    assert md_text(None) == md_text("") == md_code(None) == md_code("  ") == "-"
    assert md_text("two\nlines") == "two lines"


def _drill(job: str, *, ok: bool, detail: str) -> DrillReport:
    return DrillReport(job=job, step=50, ok=ok, summary=f"{job} step 50: drill failed: {detail}",
                       checks=(Check("completed", ok, detail),), started_at=T0, finished_at=T0,
                       stage=None if ok else "load", error=None if ok else detail, device=detail, tier="hot",
                       confinement=f"writes not confined: {detail}", timings={"fetch_s": 0.1})


TABLE_TAGS = {"table", "thead", "tbody", "tr", "th", "td"}
TEXT_TAGS = {"h1", "h2", "h3", "p", "code", "strong", "ul", "li", "br"}


@pytest.mark.parametrize("job", HOSTILE)
def test_every_artifact_builder_escapes_what_storage_says(job: str) -> None:
    detail = f"cannot read {job}/model.pt"
    drill = render_report([_drill(job, ok=False, detail=detail)])
    not_started = render_not_started(job, 5, f"job {job!r}: no checkpoints in the catalog")
    problem = FileProblem(relpath=f"{job}/x.pt", status="corrupt", expected_size=1, actual_size=2,
                          expected_sha256="ab", actual_sha256="cd", expected_crc64nvme=None, actual_crc64nvme=None,
                          detail=detail)
    row = VerifyRow(job=job, step=7, tier="archive", state="degraded", bytes_read=1, bytes_skipped=0, errors=0,
                    extra=(f"{job}.extra",), detail=detail, files=(problem,), problems=(detail,))
    hot = VerifyRow(job=job, step=8, tier="hot", state="corrupt", bytes_read=1, bytes_skipped=0, errors=0,
                    extra=(f"{job}.extra",), detail=detail, files=(problem,))
    verification = render_verification(VerifyReport(checkpoints=(row, hot), totals=VerifyTotals(checked=1, corrupt=1),
                                                    by_job=tuple(verification_by_job([row, hot]))))
    failed = ItemResult(job=job, step=3, checkpoint_id=1, action="delete", scope="checkpoint", outcome="failed",
                        detail=detail)
    tiering = render_outcome(ApplyRunReport(dry_run=False, items=(failed,), lines=(), bytes_freed=0, failed=True,
                                            held=(), proofs=(), outcome=TieringOutcome(tiers=(), promoted=(), deleted=())))
    for md in (drill, not_started, verification, tiering):
        assert elements(md) <= TABLE_TAGS | TEXT_TAGS, md
        assert "<img" not in html(md) and "<script" not in html(md)
        for table in re.findall(r"<table>.*?</table>", html(md), re.S):
            widths = {len(re.findall(r"<t[dh]", tr)) for tr in re.findall(r"<tr>.*?</tr>", table, re.S)}
            assert len(widths) == 1, table  # every row as wide as the header: no cell split by a '|'
    assert job in text_of(drill) and job in text_of(verification) and job in text_of(tiering)


def test_a_failed_drill_never_reports_zero_bytes_of_peak_memory() -> None:
    failed = _drill("j", ok=False, detail="load failed")
    assert peak_memory_text(failed) == "not measured"
    assert "peak memory not measured" in render_report([failed])
    from dataclasses import replace

    assert peak_memory_text(replace(failed, peak_memory_bytes=0)) == "not measured"
    assert peak_memory_text(replace(failed, peak_memory_bytes=2048)) == "2,048 bytes"
