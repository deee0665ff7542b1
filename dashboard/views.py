"""From tables to what the templates draw: cells with text, links and classes.

Templates stay dumb (loops and blocks); every decision about how a value
reads lives here, next to the table registry. Jinja2 autoescapes every
string these produce.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import pandas as pd

from .format import display, missing, python_rows
from .tables import TableSpec

NUMERIC = frozenset({"int", "bytes", "age", "ratio", "float", "step", "money", "rate"})


def job_url(job: str) -> str:
    """The job page. Job names may hold ``/`` (a nested prefix): every character is percent-encoded."""
    return "/jobs/" + quote(job, safe="")


def checkpoint_url(job: str, step: int) -> str:
    return "/checkpoint?" + urlencode({"job": job, "step": int(step)})


def data_url(table: str, fmt: str, *, job: str | None = None, step: int | None = None) -> str:
    params = {k: v for k, v in (("job", job), ("step", step)) if v is not None}
    return f"/data/{table}.{fmt}" + ("?" + urlencode(params) if params else "")


@dataclass(frozen=True)
class Cell:
    """A table cell: ``cls`` styles the cell, ``badge`` (a class) wraps the text in a label."""

    text: str
    href: str | None = None
    cls: str = ""
    title: str | None = None
    badge: str | None = None


@dataclass(frozen=True)
class Header:
    name: str
    title: str
    help: str
    numeric: bool


@dataclass(frozen=True)
class PageLink:
    """One link of a pager: its text, where it goes (None: not a link, e.g. the current page), its class."""

    text: str
    href: str | None
    cls: str = ""


@dataclass(frozen=True)
class Pager:
    """Where one page of a long table lies: page ``page`` of ``pages``, rows ``first``-``last`` of ``total``."""

    param: str
    page: int
    pages: int
    per: int
    total: int
    links: tuple[PageLink, ...]

    @property
    def first(self) -> int:
        return (self.page - 1) * self.per + 1 if self.total else 0

    @property
    def last(self) -> int:
        return min(self.page * self.per, self.total)


def pager(total: int, *, page: int, per: int, href: Callable[[int], str], param: str = "page") -> Pager:
    """Page ``page`` (1-based; past the end: the last page) of ``total`` rows, ``per`` a page.

    ``href(n)`` is the address of page ``n``. The links: first, previous,
    up to two pages either side of this one, next, last.
    """
    pages = max(1, math.ceil(total / per))
    page = min(max(page, 1), pages)
    links: list[PageLink] = []
    if pages > 1:
        links.append(PageLink("« newest" if param == "page" else "« first", href(1) if page > 1 else None, "page-first"))
        links.append(PageLink("‹ previous", href(page - 1) if page > 1 else None, "page-prev"))
        for n in range(max(1, page - 2), min(pages, page + 2) + 1):
            links.append(PageLink(f"{n:,}", None if n == page else href(n), "page-current" if n == page else "page-n"))
        links.append(PageLink("next ›", href(page + 1) if page < pages else None, "page-next"))
        links.append(PageLink("oldest »" if param == "page" else "last »", href(pages) if page < pages else None,
                              "page-last"))
    return Pager(param=param, page=page, pages=pages, per=per, total=total, links=tuple(links))


def page_href(path: str, query: Mapping[str, str], param: str, anchor: str) -> Callable[[int], str]:
    """Addresses of the pages of one table: ``path`` with ``query`` (the request's other
    parameters, kept) and ``param=n``, at ``#anchor``."""
    rest = {k: v for k, v in query.items() if k not in (param, "run")}

    def href(n: int) -> str:
        return path + "?" + urlencode({**rest, param: n}) + "#" + anchor

    return href


@dataclass(frozen=True)
class TableView:
    """A table ready to draw: headers, rows of cells, its downloads, and how many rows were left out
    (``pager``: the table is one page of a longer one, with links to the others)."""

    name: str
    title: str
    headers: list[Header]
    rows: list[list[Cell]]
    csv: str
    json: str
    total: int
    description: str
    pager: Pager | None = None

    @property
    def hidden(self) -> int:
        """Rows left out and reachable only through the downloads (none for a paginated table)."""
        return 0 if self.pager is not None else self.total - len(self.rows)


def cell(value: Any, kind: str, *, row: dict[str, Any], job: str | None) -> Cell:
    """One table cell: text, a link for jobs and steps, a class for states and verdicts."""
    text = display(value, kind)
    if missing(value):
        return Cell(text, cls="muted")
    if kind == "job":
        return Cell(text, href=job_url(str(value)), cls="job", title=text)  # the stylesheet truncates long names
    if kind == "step":
        owner = row.get("job") if isinstance(row.get("job"), str) and row.get("job") else job
        return Cell(text, href=checkpoint_url(owner, int(value)) if owner else None, cls="num")
    if kind in ("state", "proof", "severity"):
        return Cell(text, badge=f"st-{text}" if text else None)
    if kind == "verdict":
        return Cell(text, badge="st-passed" if bool(value) else "st-failed")
    if kind == "time":
        return Cell(text, cls="time", title=pd.Timestamp(value).isoformat())
    if kind in NUMERIC:
        return Cell(text, cls="num", title=str(value) if kind in ("bytes", "age") else None)
    if kind == "mono":
        return Cell(text, cls="mono")
    return Cell(text)


def table_view(spec: TableSpec, df: pd.DataFrame, *, job: str | None = None, step: int | None = None,
               columns: Sequence[str] | None = None, limit: int | None = None,
               paging: tuple[int, int, Callable[[int], str]] | None = None, param: str = "page") -> TableView:
    """``df`` (a table of ``spec``) as cells; ``columns`` picks and orders columns, ``limit`` caps the rows shown.

    ``paging`` = (page, per, href): draw only that page of ``per`` rows, with
    a :class:`Pager` (``param`` names its query parameter) instead of a cap.
    """
    chosen = [c for c in spec.columns if columns is None or c.name in columns]
    if columns is not None:
        order = {name: i for i, name in enumerate(columns)}
        chosen.sort(key=lambda c: order[c.name])
    pages = None
    if paging is not None:
        pages = pager(len(df), page=paging[0], per=paging[1], href=paging[2], param=param)
        shown = df.iloc[pages.first - 1:pages.last] if pages.total else df
    else:
        shown = df if limit is None else df.head(limit)
    rows = []
    for rec in python_rows(shown):
        rows.append([cell(rec[c.name], c.kind, row=rec, job=job) for c in chosen])
    return TableView(
        name=spec.name, title=spec.title,
        headers=[Header(c.name, c.title, c.help, c.kind in NUMERIC) for c in chosen],
        rows=rows, csv=data_url(spec.name, "csv", job=job, step=step), json=data_url(spec.name, "json", job=job, step=step),
        total=len(df), description=spec.description, pager=pages,
    )
