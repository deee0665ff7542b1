"""Artifacts every flow publishes: the catalog summary and links to the dashboard.

Rendering only: the figures come from the tasks' typed results
(:mod:`ckptier.tasks.reports`); bytes are shown in decimal units, as
storage bills them.

Everything an artifact shows that comes from storage or the catalog (job
names, paths, error text, reasons) goes through :func:`md_text` or
:func:`md_code` first: the Prefect UI renders markdown with HTML, so a job
directory named ``<img src=https://...>`` would otherwise put an element in
every viewer's page (and make their browser fetch that URL), and a ``|``
would break a table.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from prefect.artifacts import create_link_artifact, create_table_artifact

from ckptier.tasks.prefect_tasks import catalog_summary_task
from ckptier.tasks.reports import dashboard_job_url, dashboard_url
from ckptier.tasks.run import Run

from .output import human_bytes

#: Markdown punctuation that makes inline structure anywhere in a line (emphasis, code, links, tables,
#: strikethrough); ``_`` only where it could open or close emphasis (not inside a word: snake_case stays as is).
_MD_INLINE = re.compile(r"([\\`*\[\]|~!]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")
#: What makes a block (a heading, list, quote, rule, setext underline) at the start of a line.
_MD_BLOCK_START = re.compile(r"^(#|[-+=]|\d+[.)])")


def md_text(value: object) -> str:
    """``value`` as inert markdown text that renders as itself: on one line, ``&``, ``<`` and
    ``>`` as HTML entities (no element can form), markdown punctuation backslash-escaped
    (no emphasis, link, image, code span or table cell boundary), nothing that starts a
    block. ``-`` for None or empty. Use it for every storage-derived value outside a code span."""
    text = " ".join(str("" if value is None else value).split())
    if not text:
        return "-"
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = _MD_INLINE.sub(r"\\\1", text)
    return _MD_BLOCK_START.sub(lambda m: m.group(1)[:-1] + "\\" + m.group(1)[-1], text, count=1)


def md_code(value: object) -> str:
    """``value`` as a markdown code span that shows it verbatim, safe inside a table cell: one
    line, a backtick fence longer than any run of backticks in it (so none ends the span
    early), ``|`` escaped (GFM removes the backslash inside a cell). HTML inside a code
    span is text, never an element. ``-`` for None or empty."""
    text = " ".join(str("" if value is None else value).split())
    if not text:
        return "-"
    text = text.replace("|", "\\|")
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if "`" in text else ""
    return f"{fence}{pad}{text}{pad}{fence}"


#: Dashboard links published per run at most; a run over more jobs links the overview too.
MAX_DASHBOARD_LINKS = 20

#: The states a catalog-summary row counts, in lifecycle order.
SUMMARY_STATES = ("committed", "verified", "incomplete", "corrupt")


def summary_rows(jobs: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One table row per job (``JobSummary`` as a dict): counts by state, bytes per tier in human units."""
    rows = []
    for j in jobs:
        degraded = f", {j['archive_degraded']} degraded" if j["archive_degraded"] else ""
        rows.append({
            "job": j["job"], "checkpoints": j["checkpoints"],
            **{s: j["states"].get(s, 0) for s in SUMMARY_STATES}, "deleted": j["deleted"],
            "newest verified step": j["newest_verified_step"],
            "hot": f"{human_bytes(j['hot_bytes'])} ({j['hot_checkpoints']} checkpoints)",
            "archive stored": f"{human_bytes(j['archive_stored_bytes'])}{degraded}",
            "archive logical": f"{human_bytes(j['archive_logical_bytes'])} ({j['archive_checkpoints']} checkpoints)",
        })
    return rows


def publish_catalog_summary(run: Run) -> list[dict[str, Any]]:
    """Table artifact ``catalog-summary``: a row per job, checkpoints by state and bytes per tier.

    Every flow that changes the catalog publishes it at its end, from the
    flow run's own ``run``, so the latest one is the catalog as it is now.
    Returns the jobs' summaries."""
    jobs = catalog_summary_task(run)
    create_table_artifact(summary_rows(jobs) or [{"job": "-", "checkpoints": 0}], key="catalog-summary",
                          description="Checkpoints per job: counts by state; hot bytes, and archive bytes as stored "
                                      "(compressed) and logical (what they hold)")
    return jobs


def publish_dashboard_links(jobs: Iterable[str]) -> list[str]:
    """A link artifact to each job's dashboard page (at most :data:`MAX_DASHBOARD_LINKS`, then
    one to the overview), when ``CKPTIER_DASHBOARD_URL`` is set; returns the URLs linked."""
    names = sorted(set(jobs))
    urls = [(job, url) for job in names[:MAX_DASHBOARD_LINKS] if (url := dashboard_job_url(job, os.environ))]
    if not urls:
        return []
    for job, url in urls:
        create_link_artifact(url, link_text=f"{md_text(job)} on the ckptier dashboard",
                             description=f"Job {md_text(job)}: checkpoints, tiers, drills and verifications")
    out = [url for _, url in urls]
    if len(names) > MAX_DASHBOARD_LINKS:
        overview = dashboard_url(os.environ) or ""
        create_link_artifact(overview, link_text="every job on the ckptier dashboard",
                             description=f"{len(names)} jobs; the first {MAX_DASHBOARD_LINKS} are linked one by one")
        out.append(overview)
    return out
