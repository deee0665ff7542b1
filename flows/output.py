"""Rendering for the command line: tables, sizes, JSON, progress.

Nothing here imports Prefect, torch or the catalog, so read-only commands
start fast.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, TextIO

from ckptier.storage.records import CheckpointRecord
from ckptier.storage.transitions import proof_of
from ckptier.tasks.units import human_bytes



def iso(t: datetime | None) -> str | None:
    return t.isoformat(timespec="seconds") if t is not None else None


def current_location(c: CheckpointRecord) -> str:
    """Where the checkpoint can be had now: its hot location while the hot
    copy is held, else its archive copy's URL (never a deleted hot path)."""
    if "hot" in c.tiers:
        return c.location
    copy = c.archive_copy()
    return copy.url if copy is not None else c.location


def checkpoint_json(c: CheckpointRecord, *, files: int | None = None) -> dict[str, Any]:
    """The JSON object of ``ckptier ls --json`` (the documented contract fields first).

    ``location`` is :func:`current_location`; ``hot_location`` is where the
    checkpoint was written (scanned), whether or not that copy still exists.
    ``files`` is the file count when ``c`` was loaded without its files.
    """
    return {
        "job": c.job,
        "step": c.step,
        "format": c.format.value,
        "state": c.state.value,
        "bytes": c.bytes,
        "files": len(c.files) if files is None else files,
        "tiers": list(c.tiers),
        "location": current_location(c),
        "hot_location": c.location,
        "saved_at": iso(c.saved_at),
        "verified_at": iso(c.verified_at),
        "missing_since": iso(c.missing_since),
        "reason": c.state_reason,
        "metrics": dict(c.metrics),
        "copies": [
            {"tier": x.tier.value, "url": x.url, "state": x.state, "stored_bytes": x.stored_bytes,
             "storage_class": x.storage_class, "verified_at": iso(x.verified_at)}
            for x in c.copies
        ],
        **proof_json(c),
    }


def proof_json(c: CheckpointRecord) -> dict[str, Any]:
    """``proof`` (committed < verified < drilled, or None), when it was obtained,
    and the most recent drill (``ok``, ``at``, ``detail``) or None."""
    proof, at = proof_of(c)
    drill = c.last_drill
    return {
        "proof": proof.value if proof is not None else None,
        "proven_at": iso(at),
        "last_drill": None if drill is None else {"ok": drill.ok, "at": iso(drill.at), "detail": drill.detail},
    }


def proof_cell(c: CheckpointRecord) -> str:
    """The PROOF column: the level, and a failed last drill."""
    proof, _ = proof_of(c)
    text = proof.value if proof is not None else "-"
    return text + (" (drill failed)" if c.last_drill is not None and not c.last_drill.ok else "")


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str], *, out: TextIO | None = None) -> None:
    """Print a plain left-aligned text table (numbers right-aligned)."""
    out = out or sys.stdout
    cells = [[("" if v is None else str(v)) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(v)) for w, v in zip(widths, row, strict=True)]
    numeric = [all(_is_number(r[i]) for r in cells) and bool(cells) for i in range(len(headers))]

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(
            (v.rjust(w) if num else v.ljust(w)) for v, w, num in zip(row, widths, numeric, strict=True)
        ).rstrip()

    print(fmt(list(headers)), file=out)
    for row in cells:
        print(fmt(row), file=out)


def _is_number(v: str) -> bool:
    try:
        float(v)
    except ValueError:
        return False
    return True


def print_json(obj: Any, *, out: TextIO | None = None) -> None:
    """``obj`` as JSON on ``out``. A list of objects (``ls --json``, say) is printed one
    object per line, which Python's C encoder writes several times faster than an
    indented document; anything else is indented."""
    out = out or sys.stdout
    if isinstance(obj, list) and obj and all(isinstance(x, dict) for x in obj):
        out.write("[\n" + ",\n".join("  " + json.dumps(x, default=str) for x in obj) + "\n]\n")
        return
    json.dump(obj, out, indent=2, sort_keys=False, default=str)
    out.write("\n")


def print_checkpoints(records: Iterable[CheckpointRecord], *, out: TextIO | None = None,
                      file_counts: Mapping[int, int] | None = None) -> None:
    """The ``ls`` table; ``file_counts`` (id → files) when the records were loaded without files.
    A METRICS column (the first three, by name) shows when some checkpoint recorded metrics."""
    records = list(records)
    with_metrics = any(c.metrics for c in records)
    rows = [
        (
            c.job,
            c.step,
            c.format.value,
            c.state.value + (" (missing)" if c.missing_since else ""),
            human_bytes(c.bytes),
            len(c.files) if file_counts is None else file_counts.get(c.id, 0),
            ",".join(c.tiers) or "-",
            iso(c.saved_at) or "-",
            proof_cell(c),
            *((metrics_cell(c),) if with_metrics else ()),
            current_location(c),
        )
        for c in records
    ]
    headers = ("JOB", "STEP", "FORMAT", "STATE", "SIZE", "FILES", "TIERS", "SAVED", "PROOF",
               *(("METRICS",) if with_metrics else ()), "LOCATION")
    table(rows, headers, out=out)


def metrics_cell(c: CheckpointRecord) -> str:
    """``eval_loss=0.412 loss=0.51`` (the first three by name, ``+N`` for more), or ``-``."""
    shown = " ".join(f"{k}={v:.6g}" for k, v in c.metrics[:3])
    return (shown + (f" +{len(c.metrics) - 3}" if len(c.metrics) > 3 else "")) or "-"


class Progress:
    """A one-line progress indicator on stderr, shown only on a terminal.

    ``update(done, total)``: counts or bytes; ``total`` may be None when
    unknown (a listing). Cheap when stderr is not a TTY (does nothing).
    """

    def __init__(self, label: str, *, unit: str = "", stream: TextIO | None = None, enabled: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.label = label
        self.unit = unit
        self._last = ""

    def update(self, done: int, total: int | None = None) -> None:
        if not self.enabled:
            return
        shown = human_bytes(done) if self.unit == "bytes" else f"{done:,}"
        if total:
            frac = min(1.0, done / total)
            bar = "#" * int(frac * 30)
            shown_total = human_bytes(total) if self.unit == "bytes" else f"{total:,}"
            line = f"{self.label} [{bar:<30}] {shown}/{shown_total} ({frac:.0%})"
        else:
            line = f"{self.label} {shown} {self.unit if self.unit != 'bytes' else ''}".rstrip()
        if line != self._last:
            self.stream.write("\r" + line.ljust(len(self._last)))
            self.stream.flush()
            self._last = line

    def close(self) -> None:
        if self.enabled and self._last:
            self.stream.write("\n")
            self.stream.flush()

