"""From tables to what the templates draw: cells with text, links and classes.

Templates stay dumb (loops and blocks); every decision about how a value
reads lives here, next to the table registry. Jinja2 autoescapes every
string these produce.
"""

from __future__ import annotations

from collections.abc import Sequence
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
class TableView:
    """A table ready to draw: headers, rows of cells, its downloads, and how many rows were left out."""

    name: str
    title: str
    headers: list[Header]
    rows: list[list[Cell]]
    csv: str
    json: str
    total: int
    description: str

    @property
    def hidden(self) -> int:
        return self.total - len(self.rows)


def cell(value: Any, kind: str, *, row: dict[str, Any], job: str | None) -> Cell:
    """One table cell: text, a link for jobs and steps, a class for states and verdicts."""
    text = display(value, kind)
    if missing(value):
        return Cell(text, cls="muted")
    if kind == "job":
        return Cell(text, href=job_url(str(value)), cls="job")
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
               columns: Sequence[str] | None = None, limit: int | None = None) -> TableView:
    """``df`` (a table of ``spec``) as cells; ``columns`` picks and orders columns, ``limit`` caps the rows shown."""
    chosen = [c for c in spec.columns if columns is None or c.name in columns]
    if columns is not None:
        order = {name: i for i, name in enumerate(columns)}
        chosen.sort(key=lambda c: order[c.name])
    shown = df if limit is None else df.head(limit)
    rows = []
    for rec in python_rows(shown):
        rows.append([cell(rec[c.name], c.kind, row=rec, job=job) for c in chosen])
    return TableView(
        name=spec.name, title=spec.title,
        headers=[Header(c.name, c.title, c.help, c.kind in NUMERIC) for c in chosen],
        rows=rows, csv=data_url(spec.name, "csv", job=job, step=step), json=data_url(spec.name, "json", job=job, step=step),
        total=len(df), description=spec.description,
    )
