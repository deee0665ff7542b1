"""Quantities for people: one spelling of a byte count in every table, page and report; the sizes of
dtypes and optimizer states, and the longest run, that advice and the command line's choices share."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta

#: Bytes per element of each dtype a checkpoint may hold.
DTYPE_BYTES: Mapping[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
#: Per-parameter state buffers each optimizer keeps (0 for adafactor: its
#: factored second moments are O(rows + cols) per matrix, under 0.1% of the
#: parameters for matrices of 2,048 or more rows and columns).
OPTIMIZER_STATES: Mapping[str, int] = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0, "adafactor": 0}
#: The longest run advice is given for (ten years: far past any training run, well inside the calendar).
MAX_RUN_LENGTH = timedelta(days=3650)


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
