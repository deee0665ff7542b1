"""Scan: list a store, recognise checkpoints, record them in the catalog.

The decisions (which objects form which checkpoint, committed or not) are the
pure :func:`ckptier.storage.formats.recognise`; this module is the thin I/O
around it. It never deletes anything, and a failed listing records nothing.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from urllib.parse import urlparse

from ckptier.storage.base import ObjectInfo, Store, read_bytes
from ckptier.storage.catalog.api import Catalog, ScanSummary
from ckptier.storage.formats import PatternRule, recognise
from ckptier.storage.model import Recognition, Unrecognised
from ckptier.storage.url import open_store

#: Metadata and marker files larger than this are refused, not read.
METADATA_LIMIT = 16 << 20


@dataclass
class ScanReport:
    """What one scan of one URL found and wrote."""

    url: str
    objects: int
    checkpoints: int
    committed: int
    incomplete: int
    unrecognised: list[Unrecognised] = field(default_factory=list)
    summary: ScanSummary | None = None

    @property
    def rows_written(self) -> int:
        return self.summary.rows_written if self.summary is not None else 0


def root_name(url: str) -> str:
    """The last path component of a store URL (the job name of a bare root)."""
    parsed = urlparse(url)
    path = parsed.path if parsed.scheme else url
    name = posixpath.basename(path.rstrip("/"))
    return name or parsed.netloc or "default"


def counted(listing: Iterator[ObjectInfo], tick: Callable[[int], None] | None, every: int = 1000) -> Iterator[ObjectInfo]:
    """Pass ``listing`` through, calling ``tick(n)`` every ``every`` objects and at the end."""
    n = 0
    for info in listing:
        n += 1
        if tick is not None and n % every == 0:
            tick(n)
        yield info
    if tick is not None:
        tick(n)


def recognise_store(
    store: Store,
    *,
    now: float,
    name: str,
    patterns: Sequence[PatternRule] = (),
    tick: Callable[[int], None] | None = None,
) -> Recognition:
    """List ``store`` completely and recognise its checkpoints.

    The listing is consumed before anything is written, so a listing that
    fails half-way raises and leaves the catalog untouched.
    """
    return recognise(
        counted(store.list(""), tick),
        lambda key: read_bytes(store, key, limit=METADATA_LIMIT),
        root_name=name,
        now=now,
        patterns=patterns,
    )


def scan_url(
    url: str,
    catalog: Catalog,
    *,
    now: datetime,
    patterns: Sequence[PatternRule] = (),
    store: Store | None = None,
    tick: Callable[[int], None] | None = None,
) -> ScanReport:
    """Scan ``url`` (a path, ``file://`` or ``s3://`` URL) into ``catalog``.

    Idempotent: scanning unchanged storage writes no catalog rows.
    Checkpoints of this URL that are no longer listed are marked missing,
    never dropped.
    """
    store = store if store is not None else open_store(url)
    recognition = recognise_store(store, now=now.timestamp(), name=root_name(url), patterns=patterns, tick=tick)
    summary = catalog.record_scan(store.url, recognition, now=now)
    committed = sum(1 for c in recognition.checkpoints if c.committed)
    return ScanReport(
        url=store.url,
        objects=recognition.objects,
        checkpoints=len(recognition.checkpoints),
        committed=committed,
        incomplete=len(recognition.checkpoints) - committed,
        unrecognised=list(recognition.unrecognised),
        summary=summary,
    )
