"""Scan: list a store, recognise checkpoints, record them in the catalog.

The decisions (which objects form which checkpoint, committed or not) are the
pure :func:`ckptier.formats.recognise`; this module is the thin I/O
around it. It never deletes anything, and a failed listing records nothing.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Self
from urllib.parse import urlparse

from ckptier.storage.base import ListingSkips, ObjectInfo, Store, read_bytes
from ckptier.storage.catalog.api import Catalog, ScanSummary
from ckptier.formats import METADATA_NAMES, PatternRule, recognise
from ckptier.storage.errors import ConfigError
from ckptier.storage.model import Recognition, Unrecognised
from ckptier.storage.url import open_store, parse_url
from ckptier.storage.wrappers import resuming

#: Metadata and marker files larger than this are refused, not read.
METADATA_LIMIT = 16 << 20
#: Threads that fetch metadata files while the listing is still running.
#: On S3 each GET is a round trip (~10 ms to moto here, 10-30 ms to AWS), so
#: 1,000 checkpoints read one by one would add 10-30 s to a scan.
PREFETCH_WORKERS = 16
#: Bytes of prefetched metadata held at once at most; beyond it, files are
#: read when recognition asks for them, as without prefetching.
PREFETCH_BYTES = 256 << 20


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


class Prefetcher:
    """Reads the files recognition may need (:data:`METADATA_NAMES`) in
    background threads as the listing streams past, so their round trips
    overlap the listing instead of following it one by one.

    :meth:`read` returns exactly what ``read_bytes(store, key, limit)`` would
    (or raises what it would raise), whether the file was prefetched or not.
    Files over ``limit`` or empty are left to :meth:`read` (which refuses or
    returns them as before). At most ``max_bytes`` of listed sizes are in
    flight or held; the rest is read on demand. Use as a context manager:
    leaving it cancels reads not yet started and waits for running ones.
    """

    def __init__(self, store: Store, *, workers: int, limit: int, max_bytes: int = PREFETCH_BYTES) -> None:
        self.store = store
        self.limit = limit
        self.budget = max_bytes
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="ckptier-prefetch") if workers > 0 else None
        self._pending: dict[str, Future[bytes]] = {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()

    def watch(self, listing: Iterable[ObjectInfo]) -> Iterator[ObjectInfo]:
        """Pass ``listing`` through, starting a read of each metadata file in it."""
        pool = self._pool
        for info in listing:
            if pool is not None:
                key = info.key
                if (
                    key[key.rfind("/") + 1 :] in METADATA_NAMES
                    and 0 < info.size <= self.limit
                    and info.size <= self.budget
                    and key not in self._pending
                ):
                    self.budget -= info.size
                    self._pending[key] = pool.submit(read_bytes, self.store, key, limit=self.limit)
            yield info

    def read(self, key: str) -> bytes:
        """The whole object ``key`` (at most ``limit`` bytes); each prefetch is used once."""
        future = self._pending.pop(key, None)
        if future is None:
            return read_bytes(self.store, key, limit=self.limit)
        return future.result()


def recognise_store(
    store: Store,
    *,
    now: float,
    name: str,
    patterns: Sequence[PatternRule] = (),
    tick: Callable[[int], None] | None = None,
    prefetch: int = PREFETCH_WORKERS,
) -> Recognition:
    """List ``store`` completely and recognise its checkpoints.

    The listing is consumed before anything is written, so a listing that
    fails half-way raises and leaves the catalog untouched. Metadata files
    are read by ``prefetch`` threads while the listing runs (0: read one by
    one afterwards); ``store`` must then allow concurrent reads, which every
    store in :mod:`ckptier.storage` does. The result does not depend on
    ``prefetch``. Entries a local listing skipped (symlink loops, dangling
    or directory symlinks) are reported as not recognised, with the reason.
    """
    skipped: list[Unrecognised] = []
    if isinstance(store, ListingSkips):
        listing = store.list_with_skips("", lambda key, why: skipped.append(Unrecognised(key, why)))
    else:
        listing = store.list("")
    with Prefetcher(store, workers=prefetch, limit=METADATA_LIMIT) as fetcher:
        found = recognise(
            fetcher.watch(counted(listing, tick)),
            fetcher.read,
            root_name=name,
            now=now,
            patterns=patterns,
        )
    if not skipped:
        return found
    return replace(found, unrecognised=tuple(sorted(found.unrecognised + tuple(skipped), key=lambda u: u.key)))


def _refuse_a_file(url: str) -> None:
    """A local URL naming a file (not a directory of checkpoints) is one line, not a listing error."""
    import os

    parsed = parse_url(url)
    if parsed.scheme == "file" and os.path.isfile(parsed.path):
        parent = os.path.dirname(parsed.path.rstrip("/")) or "/"
        raise ConfigError(f"{url}: is a file, not a directory; scan the directory that holds your checkpoints "
                          f"(e.g. {parent})")


def scan_url(
    url: str,
    catalog: Catalog,
    *,
    now: datetime,
    patterns: Sequence[PatternRule] = (),
    store: Store | None = None,
    tick: Callable[[int], None] | None = None,
    grace_for: Callable[[str], timedelta] | None = None,
) -> ScanReport:
    """Scan ``url`` (a path, ``file://`` or ``s3://`` URL) into ``catalog``.

    ``store`` defaults to ``url``'s store through
    :func:`~ckptier.storage.wrappers.resuming` (a listing that fails part-way
    is started again). Idempotent: scanning unchanged storage writes no
    catalog rows.
    Checkpoints of this URL that are no longer listed are marked missing,
    never dropped. ``grace_for(job)`` is how long a save whose manifest
    lists absent files may still be in flight (default 2 h).
    """
    if store is None:
        _refuse_a_file(url)
    store = store if store is not None else resuming(open_store(url))
    recognition = recognise_store(store, now=now.timestamp(), name=root_name(url), patterns=patterns, tick=tick)
    summary = catalog.record_scan(store.url, recognition, now=now, grace_for=grace_for)
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
