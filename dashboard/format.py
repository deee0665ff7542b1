"""Turning table cells into text (pages, terminal) and into data (CSV, JSON).

Data keeps full precision: integers for bytes and steps, seconds for ages,
ISO 8601 UTC for times, fractions 0..1 for ratios, ``null``/empty for
missing values. Text is for people: decimal byte units (as storage bills),
ages in two units, percentages.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import numpy as np
import pandas as pd

from ckptier.tasks.units import human_bytes

from .alerts import format_age



def missing(v: Any) -> bool:
    """True for None, NaN, NaT and pandas' NA."""
    if v is None or v is pd.NaT or v is pd.NA:
        return True
    return isinstance(v, float) and math.isnan(v)


def plain(v: Any) -> Any:
    """A JSON-ready Python value: times as ISO 8601 (seconds, UTC), numpy scalars unwrapped."""
    if missing(v):
        return None
    if isinstance(v, pd.Timestamp):
        v = v.to_pydatetime()
    if isinstance(v, datetime):
        return v.isoformat(timespec="seconds")
    if isinstance(v, (np.bool_, bool)):
        return bool(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.floating):
        return float(v)
    return v


def python_rows(df: pd.DataFrame) -> list[dict[str, Any]]:
    """The rows of ``df`` as dicts of Python values (None for every missing value; times stay datetimes)."""
    cols = list(df.columns)

    def py(v: Any) -> Any:
        if missing(v):
            return None
        if isinstance(v, pd.Timestamp):
            return v.to_pydatetime()
        return v.item() if isinstance(v, np.generic) else v

    return [{c: py(v) for c, v in zip(cols, row, strict=True)} for row in df.itertuples(index=False, name=None)]


def records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """The rows of ``df`` as JSON-ready dicts, in column order."""
    cols = list(df.columns)
    return [{c: plain(v) for c, v in zip(cols, row, strict=True)} for row in df.itertuples(index=False, name=None)]


def to_json(df: pd.DataFrame) -> str:
    return json.dumps(records(df), indent=2)


def to_csv(df: pd.DataFrame) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(df.columns)
    for row in records(df):
        writer.writerow(["" if v is None else v for v in row.values()])
    return out.getvalue()


def display(v: Any, kind: str) -> str:
    """A cell as a person reads it ("" when missing, except bytes/ages as "-")."""
    if missing(v):
        return "-" if kind in ("bytes", "age") else ""
    if kind == "bytes":
        return human_bytes(v)
    if kind == "age":
        return format_age(timedelta(seconds=float(v)))
    if kind == "time":
        t = pd.Timestamp(v).to_pydatetime()
        return t.strftime("%Y-%m-%d %H:%M:%S")
    if kind == "ratio":
        return f"{float(v) * 100:.0f}%"
    if kind == "verdict":
        return "passed" if bool(v) else "failed"
    if kind == "bool":
        return "yes" if bool(v) else ""
    if kind == "float":
        f = float(v)
        return f"{f:.4g}" if abs(f) < 1e4 else f"{f:,.0f}"
    if kind == "int":
        return f"{int(v):,}"
    if kind == "money":
        m = float(v)
        return "<0.01" if 0 < m < 0.005 else f"{m:,.2f}"
    if kind == "rate":
        return human_bytes(v) + "/s"
    return str(v)


def text_table(rows: Sequence[Sequence[str]], headers: Sequence[str], numeric: Sequence[bool]) -> str:
    """A plain text table: columns two spaces apart, numbers right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric, strict=True)).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])
