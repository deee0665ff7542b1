"""Quantities for people: one spelling of a byte count in every table, page and report."""

from __future__ import annotations


def human_bytes(n: int | float | None) -> str:
    """``1234567`` → ``'1.2 MB'`` (decimal units, as storage bills); ``'-'`` for None."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if abs(value) < 1000 or unit == "PB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{n} B"  # pragma: no cover - the loop always returns
