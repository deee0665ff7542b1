"""Scan: list a store, recognise checkpoints, record them in the catalog.

The decisions (which objects form which checkpoint, committed or not) are the
pure :func:`ckptier.formats.recognise`; this module is the thin I/O
around it. It never deletes anything, and a failed listing records nothing.

**Unchanged local directories are not listed again.** After a local scan,
each ``committed`` checkpoint directory that holds nothing but the
checkpoint's files gets a *stamp* in the catalog
(:meth:`~ckptier.storage.base.DirectoryStamps.take_stamp`): the mtime, link
count and entry count of the directory, and the mtime and link count of
every directory below it. A later scan does not enter a directory whose
stamp is unchanged and whose checkpoint is still ``committed`` or
``verified``, present and free of delete intents; the catalog's rows for it
stand as they are (carried, not compared). What the skip trusts:

* that files are added, removed or renamed, never rewritten in place: any
  of the former changes the mtime of the directory holding the entry (and a
  new subdirectory its parent's link count), which the stamp covers at every
  level; a file rewritten in place (same name, new bytes) changes no
  directory and goes unnoticed until that directory is listed again;
* that nothing sets directory mtimes back (``touch -d``, ``rsync -t`` or
  ``tar -x`` over an existing tree) while keeping every directory's link
  count and the top directory's entry count;
* that the filesystem's clock agrees with this host's within
  :data:`STAMP_SETTLE_SECONDS`: a directory modified later than that before
  the scan started gets no stamp.

A full listing still runs: with ``full=True`` (``ckptier scan --full``); for
every directory whose stamp is older than :data:`FULL_LISTING_EVERY` (so each
checkpoint is listed completely at least that often, which catches files
rewritten in place); for checkpoints not ``committed``/``verified`` (saves in
flight), missing, or with a delete intent; and on S3, which has no
directory mtimes. ``verify --deep`` reads every byte whatever the scan
skipped.
"""

from __future__ import annotations

import os
import posixpath
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Self
from urllib.parse import urlparse

from ckptier.formats import METADATA_NAMES, PatternRule, recognise
from ckptier.storage.base import (
    BucketLocation,
    DirectoryStamps,
    ListingSkips,
    LocalPaths,
    ObjectInfo,
    Store,
    WalkedDirs,
    read_bytes,
)
from ckptier.storage.catalog.api import Catalog, DirStampRecord, ScanSummary
from ckptier.storage.errors import ConfigError
from ckptier.storage.gc_pause import paused_gc
from ckptier.storage.inventory import InventoryReport, open_report
from ckptier.storage.records import Found, Recognition, State, Tier, Unrecognised
from ckptier.storage.url import open_store, parse_url
from ckptier.storage.wrappers import resuming

#: Metadata and marker files larger than this are refused, not read.
METADATA_LIMIT = 16 << 20
#: Threads that fetch metadata files while the listing is still running.
#: On S3 each GET is a round trip (~10 ms to moto here, 10-30 ms to AWS), so
#: 1,000 checkpoints read one by one would add 10-30 s to a scan. A store of
#: local files (:class:`~ckptier.storage.base.LocalPaths`) gets none: its
#: reads take microseconds, and the threads' share of the GIL cost a first
#: scan of a million files 0.4 s of CPU in the process that recognises.
PREFETCH_WORKERS = 16
#: Bytes of prefetched metadata held at once at most; beyond it, files are
#: read when recognition asks for them, as without prefetching.
PREFETCH_BYTES = 256 << 20
#: Metadata files up to this size are read by a local listing's walk as it
#: lists them (in its helper processes, for a big tree), not one by one by
#: recognition afterwards; bigger ones are read when recognition asks.
READ_AHEAD_LIMIT = 64 << 10
#: A local directory stamp older than this is not trusted: the directory is
#: listed again (and stamped anew), so every checkpoint is listed completely
#: at least this often.
FULL_LISTING_EVERY = timedelta(days=7)
#: A directory modified less than this before a scan started gets no stamp
#: (a coarse or slightly skewed filesystem clock could hide a change made
#: while the scan listed it).
STAMP_SETTLE_SECONDS = 2.0


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
    #: Checkpoint directories a local rescan did not enter (unchanged since
    #: their stamp); their objects and checkpoints are counted above.
    unchanged_dirs: int = 0
    #: Objects actually listed (``objects`` less the files of unchanged directories).
    listed: int | None = None
    #: For a scan from an S3 Inventory report: the manifest's URL, when S3
    #: took the report, its age at the scan, and how many checkpoints it
    #: showed that were left as the catalog has them (see :func:`scan_inventory`).
    inventory: str | None = None
    inventory_created_at: datetime | None = None
    inventory_age_s: float | None = None
    left_as_cataloged: int = 0

    @property
    def rows_written(self) -> int:
        return self.summary.rows_written if self.summary is not None else 0

    def to_json(self) -> dict[str, Any]:
        """The report as ``scan --json`` prints it: the counts above, the scan's changes
        (``new``, ``changed``, ``vanished``, ``corrupt`` and each ``corrupt_found``),
        the ``jobs`` seen, and the inventory the scan read (None: it listed)."""
        s = self.summary
        return {
            "url": self.url,
            "objects": self.objects,
            "checkpoints": self.checkpoints,
            "committed": self.committed,
            "incomplete": self.incomplete,
            "rows_written": self.rows_written,
            "new": s.new if s else 0,
            "changed": s.changed if s else 0,
            "vanished": s.vanished if s else 0,
            "corrupt": s.corrupt if s else 0,
            "corrupt_found": [{"job": j, "step": step, "detail": why} for j, step, why in (s.corrupt_found if s else ())],
            "jobs": list(s.jobs) if s else [],
            "unrecognised": [{"key": u.key, "reason": u.reason} for u in self.unrecognised],
            "listed": self.objects if self.listed is None else self.listed,
            "unchanged_dirs": self.unchanged_dirs,
            "inventory": None if self.inventory is None else {
                "url": self.inventory,
                "created_at": self.inventory_created_at.isoformat() if self.inventory_created_at else None,
                "age_s": self.inventory_age_s,
                "left_as_cataloged": self.left_as_cataloged,
            },
        }


def root_name(url: str) -> str:
    """The last path component of a store URL (the job name of a bare root)."""
    parsed = urlparse(url)
    path = parsed.path if parsed.scheme else url
    name = posixpath.basename(path.rstrip("/"))
    return name or parsed.netloc or "default"


def counted(listing: Iterable[ObjectInfo], tick: Callable[[int], None] | None, every: int = 1000) -> Iterator[ObjectInfo]:
    """Pass ``listing`` through, calling ``tick(n)`` every ``every`` objects and at the end
    (``listing`` itself without ``tick``: no step per object)."""
    if tick is None:
        return iter(listing)
    return _counting(listing, tick, every)


def _counting(listing: Iterable[ObjectInfo], tick: Callable[[int], None], every: int) -> Iterator[ObjectInfo]:
    n = 0
    for info in listing:
        n += 1
        if n % every == 0:
            tick(n)
        yield info
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
        self._given: dict[str, bytes] = {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()
        self._given.clear()

    def watch(self, listing: Iterable[ObjectInfo], tick: Callable[[int], None] | None = None,
              every: int = 1000) -> Iterator[ObjectInfo]:
        """Pass ``listing`` through, starting a read of each metadata file in it
        and calling ``tick(n)`` every ``every`` objects and at the end (as
        :func:`counted`, in the same step: a first scan passes a million)."""
        pool = self._pool
        if pool is None:
            yield from counted(listing, tick, every)
            return
        n = 0
        for info in listing:
            n += 1
            if tick is not None and n % every == 0:
                tick(n)
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
        if tick is not None:
            tick(n)

    def give(self, key: str, data: bytes) -> None:
        """Hold ``data``, the bytes of ``key`` that its listing read as it listed
        it (at most ``limit``), for :meth:`read`: what ``read_bytes`` would
        have returned at that moment. Beyond the byte budget it is dropped
        (:meth:`read` then reads the file)."""
        if len(data) <= self.limit and len(data) <= self.budget and key not in self._given:
            self.budget -= len(data)
            self._given[key] = data

    def read(self, key: str) -> bytes:
        """The whole object ``key`` (at most ``limit`` bytes); each prefetch is used once."""
        given = self._given.pop(key, None)
        if given is not None:
            return given
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
    prefetch: int | None = None,
    skip_dir: Callable[[str], bool] | None = None,
    on_link: Callable[[str], None] | None = None,
    listing: Iterable[ObjectInfo] | None = None,
    walked: WalkedDirs | None = None,
) -> Recognition:
    """List ``store`` completely and recognise its checkpoints.

    The listing is consumed before anything is written, so a listing that
    fails half-way raises and leaves the catalog untouched. Metadata files
    are read by ``prefetch`` threads while the listing runs (0: read one by
    one afterwards; None: :data:`PREFETCH_WORKERS`, or 0 for a store of
    local files); ``store`` must then allow concurrent reads, which every
    store in :mod:`ckptier.storage` does. The result does not depend on
    ``prefetch``. Entries a local listing skipped (symlink loops, dangling
    or directory symlinks) are reported as not recognised, with the reason.
    ``skip_dir`` and ``on_link`` go to
    :meth:`~ckptier.storage.base.DirectoryStamps.list_pruned` (ignored for
    stores without it), and so does ``walked``, where the listing notes each
    directory it reads. ``listing`` replaces the store's own listing (an
    inventory's objects); metadata files are still read from ``store``.
    """
    skipped: list[Unrecognised] = []

    def on_skip(key: str, why: str) -> None:
        skipped.append(Unrecognised(key, why))

    if prefetch is None:
        prefetch = 0 if isinstance(store, LocalPaths) else PREFETCH_WORKERS
    with Prefetcher(store, workers=prefetch, limit=METADATA_LIMIT) as fetcher:
        if listing is not None:
            pass
        elif isinstance(store, DirectoryStamps) and (skip_dir is not None or on_link is not None or walked is not None):
            listing = store.list_pruned("", _ReadingAhead(skip_dir, fetcher), on_skip, on_link or _ignore, walked)
        elif isinstance(store, ListingSkips):
            listing = store.list_with_skips("", on_skip)
        else:
            listing = store.list("")
        found = recognise(
            fetcher.watch(listing, tick),
            fetcher.read,
            root_name=name,
            now=now,
            patterns=patterns,
        )
    if not skipped:
        return found
    return replace(found, unrecognised=tuple(sorted(found.unrecognised + tuple(skipped), key=lambda u: u.key)))


class _ReadingAhead:
    """The ``skip_dir`` a local listing is given: ``skip_dir``'s decisions
    (none: every directory is entered), its stamps for the walk to check
    (see :class:`_Skipper`), and the files recognition reads
    (:data:`METADATA_NAMES` of at most :data:`READ_AHEAD_LIMIT` bytes), which
    the walk reads as it lists them and hands to ``fetcher``
    (:meth:`Prefetcher.give`), in the helper processes for a big tree."""

    def __init__(self, skip_dir: Callable[[str], bool] | None, fetcher: Prefetcher) -> None:
        self.skip_dir = skip_dir
        self.candidates = _enter.candidates if skip_dir is None else getattr(skip_dir, "candidates", None)
        # The skipper's stamps and what the walk tells it (LocalStore.list reads both, or neither).
        self.stamps = getattr(skip_dir, "stamps", None)
        self.stamp_unchanged = getattr(skip_dir, "stamp_unchanged", None)
        self.reads = (METADATA_NAMES, READ_AHEAD_LIMIT)
        self.read_ahead = fetcher.give

    def __call__(self, key: str) -> bool:
        return self.skip_dir is not None and self.skip_dir(key)


class _EnterAll:
    """Skip no directory (and say so: ``candidates`` is empty, which lets a
    local listing hand a big tree to its helper process)."""

    candidates: frozenset[str] = frozenset()

    def __call__(self, key: str) -> bool:
        return False


_enter = _EnterAll()


def _ignore(key: str) -> None:
    """Nothing to note about a link."""


class _Skipper:
    """Decides, directory by directory during a local listing, which
    checkpoint directories are unchanged since their stamp (see the module
    docstring), and remembers them."""

    def __init__(self, store: DirectoryStamps, url: str, stamps: dict[str, DirStampRecord], now: datetime) -> None:
        self.store = store
        base = url.rstrip("/") + "/"
        self.by_key = {
            loc[len(base):]: rec for loc, rec in stamps.items()
            if loc.startswith(base) and now - rec.taken_at < FULL_LISTING_EVERY
        }
        self.unchanged: dict[str, DirStampRecord] = {}
        #: The only directories this may skip (see :meth:`LocalStore.list`).
        self.candidates = self.by_key.keys()
        #: The stamps a local listing checks itself as it meets each directory
        #: (relative to its open parent), telling :meth:`stamp_unchanged`
        #: about the unchanged ones instead of calling this for each.
        self.stamps = {key: (rec.stamp, rec.dirs) for key, rec in self.by_key.items()}

    def __call__(self, key: str) -> bool:
        rec = self.by_key.get(key)
        if rec is None or self.store.check_stamp(key, rec.dirs) != rec.stamp:
            return False
        self.unchanged[rec.location] = rec
        return True

    def stamp_unchanged(self, key: str) -> None:
        """The listing found ``key``'s stamp unchanged and did not enter it."""
        rec = self.by_key[key]
        self.unchanged[rec.location] = rec


def _ancestors(key: str) -> Iterator[str]:
    head = key.rpartition("/")[0]
    while head:
        yield head
        head = head.rpartition("/")[0]


def take_stamps(
    store: DirectoryStamps,
    url: str,
    recognition: Recognition,
    *,
    links: Iterable[str],
    listed_at: float,
    walked: WalkedDirs | None = None,
) -> tuple[dict[str, tuple[str, Sequence[str]]], list[str]]:
    """Stamp each listed ``committed`` checkpoint directory that holds nothing
    else (no file left unrecognised, no other checkpoint, no symlink); forget
    the stamps of the other listed checkpoints. ``url`` is the store's URL;
    ``walked``, what the listing behind ``recognition`` saw of the
    directories. The filesystem half only (no catalog access, so it may run
    beside the catalog's writes): the stamps taken by location, and the
    locations whose stamps are to be forgotten; :func:`save_stamps` records
    them."""
    base = url.rstrip("/")
    busy: set[str] = set()  # directories holding something besides one checkpoint's files
    for u in recognition.unrecognised:
        busy.update(_ancestors(u.key))
    for key in links:
        busy.update(_ancestors(key))
    for f in recognition.checkpoints:
        busy.update(_ancestors(f.prefix))
    stamps: dict[str, tuple[str, Sequence[str]]] = {}
    dropped: list[str] = []
    for f in recognition.checkpoints:
        location = f"{base}/{f.prefix}"
        taken = None
        if f.committed and f.prefix not in busy:
            taken = store.take_stamp(f.prefix, (r.relpath for r in f.files),
                                     changed_before=listed_at - STAMP_SETTLE_SECONDS, walked=walked)
        if taken is None:
            dropped.append(location)
        else:
            stamps[location] = taken
    return stamps, dropped


def save_stamps(catalog: Catalog, stamps: dict[str, tuple[str, Sequence[str]]], dropped: Sequence[str], *,
                now: datetime) -> int:
    """The catalog half of :func:`take_stamps`: forget ``dropped``, store ``stamps``; returns the stamps stored."""
    if dropped:
        catalog.drop_dir_stamps(dropped)
    return catalog.put_dir_stamps(stamps, now=now) if stamps else 0


def _refuse_a_file(url: str) -> None:
    """A local URL naming a file (not a directory of checkpoints) is one line, not a listing error."""
    parsed = parse_url(url)
    if parsed.scheme == "file" and os.path.isfile(parsed.path):
        parent = os.path.dirname(parsed.path.rstrip("/")) or "/"
        raise ConfigError(f"{url}: is a file, not a directory; scan the directory that holds your checkpoints "
                          f"(e.g. {parent})")


def refuse_an_archive(url: str, recognition: Recognition) -> None:
    """A listing holding archive copies' objects (``*.ckz``) is a ckptier archive, never hot
    storage: one line saying so and how to rebuild a catalog from it; nothing is recorded."""
    if recognition.archive_objects:
        raise ConfigError(
            f"{url}: is a ckptier archive ({recognition.archive_objects:,} archived objects, e.g. "
            f"{recognition.archive_example!r}), not hot storage: nothing was cataloged; to rebuild a lost catalog "
            f"from it run 'ckptier rebuild --archive {url} HOT_URL...'")


def scan_url(
    url: str,
    catalog: Catalog,
    *,
    now: datetime,
    patterns: Sequence[PatternRule] = (),
    store: Store | None = None,
    tick: Callable[[int], None] | None = None,
    grace_for: Callable[[str], timedelta] | None = None,
    full: bool = False,
    inventory: str | None = None,
) -> ScanReport:
    """Scan ``url`` (a path, ``file://`` or ``s3://`` URL) into ``catalog``.

    ``store`` defaults to ``url``'s store through
    :func:`~ckptier.storage.wrappers.resuming` (a listing that fails part-way
    is started again). Idempotent: scanning unchanged storage writes no
    catalog rows.
    Checkpoints of this URL that are no longer listed are marked missing,
    never dropped. ``grace_for(job)`` is how long a save whose manifest
    lists absent files may still be in flight (default 2 h). A local scan
    does not enter checkpoint directories unchanged since their stamp unless
    ``full`` (see the module docstring). With ``inventory`` (an S3 Inventory
    manifest, see :func:`scan_inventory`) the report is read instead of
    listing.
    """
    if store is None:
        _refuse_a_file(url)
    store = store if store is not None else resuming(open_store(url))
    if inventory is not None:
        return scan_inventory(url, inventory, catalog, now=now, patterns=patterns, store=store, tick=tick,
                              grace_for=grace_for)
    skipper: _Skipper | None = None
    links: list[str] = []
    listed_at = time.time()
    stamps = store if isinstance(store, DirectoryStamps) else None
    walked = WalkedDirs() if stamps is not None else None
    if stamps is not None and not full:
        skipper = _Skipper(stamps, store.url, catalog.dir_stamps(store.url.rstrip("/") + "/"), now)
    # One pause of the cyclic collector from the listing to the last write: the
    # listing, the recognition and the rows are millions of objects and no cycles.
    # They are let go before the collector comes back, else its first pass walks
    # every one of them (0.6 s at a million files).
    with paused_gc():
        recognition = recognise_store(store, now=now.timestamp(), name=root_name(url), patterns=patterns,
                                      tick=tick, skip_dir=skipper,
                                      on_link=links.append if stamps is not None else None, walked=walked)
        refuse_an_archive(url, recognition)
        unchanged = skipper.unchanged if skipper is not None else {}
        summary = _record(catalog, store, recognition, unchanged, links, walked, listed_at, now, grace_for)
        committed = sum(1 for c in recognition.checkpoints if c.committed)
        carried = sum(r.files for r in unchanged.values())
        report = ScanReport(
            url=store.url,
            objects=recognition.objects + carried,
            checkpoints=len(recognition.checkpoints) + len(unchanged),
            committed=committed + len(unchanged),
            incomplete=len(recognition.checkpoints) - committed,
            unrecognised=list(recognition.unrecognised),
            summary=summary,
            unchanged_dirs=len(unchanged),
            listed=recognition.objects,
        )
        del recognition, walked
    return report


def _record(
    catalog: Catalog,
    store: Store,
    recognition: Recognition,
    unchanged: Mapping[str, DirStampRecord],
    links: Iterable[str],
    walked: WalkedDirs | None,
    listed_at: float,
    now: datetime,
    grace_for: Callable[[str], timedelta] | None,
) -> ScanSummary:
    """Record ``recognition`` in ``catalog`` and, for a store with directory
    stamps (``walked`` is then not None), stamp its checkpoints beside those
    writes."""
    if walked is None or not isinstance(store, DirectoryStamps):
        return catalog.record_scan(store.url, recognition, now=now, unchanged=unchanged.keys(), grace_for=grace_for)
    with ThreadPoolExecutor(1, thread_name_prefix="ckptier-stamps") as pool:
        # Made of what the listing saw of each directory (any it did not read is
        # read again, and those lstat calls release the GIL, as the catalog's
        # SQLite writes do): taken beside those writes, not after them.
        taking = pool.submit(take_stamps, store, store.url, recognition, links=links, listed_at=listed_at,
                             walked=walked)
        summary = catalog.record_scan(store.url, recognition, now=now, unchanged=unchanged.keys(),
                                      grace_for=grace_for)
        save_stamps(catalog, *taking.result(), now=now)
    return summary


def scan_inventory(
    url: str,
    inventory: str,
    catalog: Catalog,
    *,
    now: datetime,
    patterns: Sequence[PatternRule] = (),
    store: Store | None = None,
    tick: Callable[[int], None] | None = None,
    report: InventoryReport | None = None,
    grace_for: Callable[[str], timedelta] | None = None,
) -> ScanReport:
    """Scan the ``s3://`` ``url`` from the S3 Inventory report ``inventory``
    (a ``manifest.json`` URL or the inventory configuration's folder, see
    :func:`ckptier.storage.inventory.open_report`) instead of listing it.

    The report is a past listing, as of its ``created_at``, so the scan
    records only what it can vouch for:

    * checkpoints the catalog does not know are added, and ones it knows are
      brought up to date (e.g. ``incomplete`` -> ``committed``), but only
      when nothing the catalog holds about them is newer than the report: a
      row changed, verified or marked missing after the report was taken, a
      tombstone, a hot copy ckptier deleted, a checkpoint whose cataloged
      files the report lacks, or one the catalog holds complete that the
      report's files no longer prove complete (a report never takes commit
      evidence away), is left as it is (``left_as_cataloged``);
    * nothing is ever marked missing (a checkpoint absent from the report
      may have been written since) and no delete intent is settled: only a
      live listing can show that files are gone;
    * metadata files (``metadata.json``...) are read live from the bucket.

    Nothing is deleted on the strength of a report: ``apply`` lists each
    checkpoint's keys live before deleting them (see
    :mod:`ckptier.tasks.apply`). The report's URL, creation time and age are
    in the returned report and in a ``scan.inventory`` catalog event.
    """
    store = store if store is not None else resuming(open_store(url))
    if not isinstance(store, BucketLocation):
        raise ConfigError(f"--inventory {inventory}: only s3:// URLs have S3 Inventory reports, not {url!r}; "
                          "scan it without --inventory")
    bucket, prefix = store.bucket, store.prefix
    if report is None:
        located = store
        report = open_report(inventory, open_store=lambda u: located.in_bucket(parse_url(u).bucket))
    if report.manifest.source_bucket != bucket:
        raise ConfigError(f"inventory {report.url} is a report of bucket {report.manifest.source_bucket!r}, "
                          f"not {bucket!r}; give the inventory of s3://{bucket}")
    recognition = recognise_store(store, now=now.timestamp(), name=root_name(url), patterns=patterns, tick=tick,
                                  listing=report.objects(prefix))
    refuse_an_archive(url, recognition)
    kept, older = _newer_than_catalog(recognition, catalog, store.url, report.created_at)
    recognition = replace(recognition, checkpoints=kept)
    summary = catalog.record_scan(store.url, recognition, now=now, live=False, grace_for=grace_for)
    age = (now - report.created_at).total_seconds()
    catalog.log_event(
        "scan.inventory",
        f"scanned {store.url} from the S3 Inventory report {report.url} taken {report.created_at.isoformat()} "
        f"({age / 3600:.1f} h old): {recognition.objects:,} objects, {len(kept)} checkpoints, "
        f"{older} left as the catalog has them (it knew newer, or they would lose commit evidence)",
        now=now,
        data={"url": store.url, "inventory": report.url, "created_at": report.created_at.isoformat(),
              "age_s": age, "objects": recognition.objects, "checkpoints": len(kept),
              "left_as_cataloged": older, "rows_written": summary.rows_written},
    )
    committed = sum(1 for c in kept if c.committed)
    return ScanReport(
        url=store.url,
        objects=recognition.objects,
        checkpoints=len(kept),
        committed=committed,
        incomplete=len(kept) - committed,
        unrecognised=list(recognition.unrecognised),
        summary=summary,
        listed=0,
        inventory=report.url,
        inventory_created_at=report.created_at,
        inventory_age_s=age,
        left_as_cataloged=older,
    )


def _newer_than_catalog(
    recognition: Recognition, catalog: Catalog, store_url: str, created_at: datetime
) -> tuple[tuple[Found, ...], int]:
    """The checkpoints of ``recognition`` (from a report taken at ``created_at``)
    the catalog knows nothing newer about, and how many others there were
    (see :func:`scan_inventory`)."""
    base = store_url.rstrip("/")
    kept: list[Found] = []
    older = 0
    for job in sorted({f.job for f in recognition.checkpoints}):
        known = {r.step: r for r in catalog.checkpoints(job=job, include_deleted=True)}
        for f in recognition.checkpoints:
            if f.job != job:
                continue
            row = known.get(f.step)
            if row is None:
                kept.append(f)
                continue
            hot = [c for c in row.copies if c.tier == Tier.HOT and c.url == row.location]
            times = [t for t in (row.last_seen, row.verified_at, row.missing_since) if t is not None]
            if (
                row.state == State.DELETED
                or row.location != f"{base}/{f.prefix}"
                or any(c.state == "deleted" for c in hot)
                or any(t > created_at for t in times)
                or not {x.relpath for x in row.files} <= {x.relpath for x in f.files}
                or (not f.committed and row.state != State.INCOMPLETE)
            ):
                older += 1
            else:
                kept.append(f)
    kept.sort(key=lambda f: (f.job, f.step))
    return tuple(kept), older
