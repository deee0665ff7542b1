"""Rebuild a lost catalog from storage: catalog backups, the hot tree and the archive's manifests.

Storage is the truth. ``ckptier rebuild`` fills an empty catalog (or resumes
one a killed rebuild started) in four steps, each idempotent, so a run killed
anywhere is finished by the next and ends where an uninterrupted one would:

1. **Backups.** Each archive location is listed once. For every job with
   catalog backups there (:mod:`ckptier.tasks.backup`), the newest that reads
   back intact (size, sha256, decoding) is restored whole, in one transaction
   (tombstones, files with their verification history, copies, drills,
   events); a corrupt one is passed over, named, for the one before. A job
   already in the catalog is never restored again.
2. **The hot tree.** Every hot location is scanned by the same code as
   ``ckptier scan`` (a full listing): new checkpoints are cataloged as a scan
   finds them, restored ones are reconciled with what is there now (changed
   files lose their verification, vanished checkpoints are marked missing, a
   milestone whose hot copy ckptier deleted stays archive-only). The hot
   locations are those given, else those the backups record, else those the
   manifests' sources imply; one overlapping an archive location is never
   scanned.
3. **The archive.** Every committed copy (a step directory with its
   ``ckptier-manifest.json``) is judged from its manifest and the listing
   (:func:`ckptier.storage.archive_copies.judge_copy`: a manifest that does
   not read back is never trusted; a missing object or one of another size
   makes the copy ``degraded``), and an intact one is proven by the
   verifier's own code (:func:`ckptier.tasks.archive.check_archive_copy`:
   the store's full-object CRC64NVME against the manifest's, else every
   object decoded and compared with the manifest and the catalog's files).
   Only a proven copy is ``present`` with a proof time; a copy whose bytes
   disagree is ``degraded``, never ``present``. :func:`link_copy` (pure)
   decides what each one means for the catalog: the copy of a checkpoint the
   catalog holds (restored, or found in the hot tree), or a checkpoint known
   only from its manifest, cataloged ``verified`` when its copy was proven
   (its hot copy recorded deleted). Cataloged archive copies that storage no
   longer shows become ``missing`` (or ``degraded`` when objects without a
   manifest remain).
4. **The report** (:class:`RebuildReport`): what came from which backup,
   hot location and archive, what was damaged, and what could not be
   recovered (history newer than the newest backup, jobs without one,
   manifests that do not read back).

It never deletes anything and never writes to a store.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from typing import Any, Literal

from ckptier.storage.archive_copies import (
    ArchiveListing,
    CopyVerdict,
    copy_dir,
    group_listing,
    judge_copy,
)
from ckptier.storage.base import LocalPaths, Store, read_bytes
from ckptier.storage.catalog.api import Catalog
from ckptier.storage.catalog.restore import (
    MAX_EVENTS,
    REBUILD_STARTED,
    NewCheckpoint,
    NewFile,
    RebuiltCopy,
    Restored,
    import_job,
    rebuild_started,
    record_rebuilt_copies,
)
from ckptier.storage.codec import CODEC_ID
from ckptier.storage.errors import CkptierError, ConfigError, NotFound, StoreError
from ckptier.storage.manifest import MANIFEST_NAME, Manifest, ManifestError
from ckptier.storage.records import CheckpointRecord, CopyRecord, CopyState, State, Tier

from .archive import MANIFEST_LIMIT, ArchiveCheck, check_archive_copy
from .backup import ReadBackup, by_job_dir, newest_good
from .config import Config, location_overlap

#: Threads reading manifests and proving copies (each proof reads or HEADs objects).
WORKERS = 8

Outcome = Literal["present", "degraded", "unchecked", "not recovered"]


# ------------------------------------------------------------------------------ pure decisions


@dataclass(frozen=True)
class Linked:
    """What one archive copy means for the catalog (:func:`link_copy`): the copy to record
    (None: nothing), the outcome, and a line for the report when there is something to say."""

    copy: RebuiltCopy | None
    outcome: Outcome
    line: str | None = None


def link_copy(verdict: CopyVerdict, record: CheckpointRecord | None, proof: ArchiveCheck | str | None, *,
              url: str, now: datetime) -> Linked:
    """Decide what the copy ``verdict`` judged at ``url`` means for ``record`` (the catalog's
    checkpoint of the same job and step after the backup and the hot scan; None: none). Pure.

    ``proof`` is the verifier's read-back of an intact copy
    (:class:`~ckptier.tasks.archive.ArchiveCheck`), or why it could not be
    made (a store that did not answer: nothing is decided), or None for a
    copy not proven (not intact). The table (tests/test_rebuild_decisions.py):

    ============  ==========  ==============  =============================================
    verdict       record      proof           outcome
    ============  ==========  ==============  =============================================
    unreadable    none        -               not recovered: nothing of the manifest is trusted
    unreadable    held        -               degraded copy of that checkpoint
    damaged       none        -               a checkpoint made from the manifest, ``corrupt``,
                                              with a degraded copy (kept as evidence); none
                                              when the manifest names another job or step
    damaged       held        -               degraded copy
    intact        any         error           unchecked: nothing recorded (rebuild again)
    intact        none        ok              a checkpoint made from the manifest, ``verified``,
                                              its copy present and proven now
    intact        none        failed          a checkpoint made from the manifest, ``corrupt``,
                                              its copy degraded
    intact        held        ok              present copy, proven now
    intact        held        failed          degraded copy
    ============  ==========  ==============  =============================================
    """
    where = f"{verdict.job} step {verdict.step}: archive copy {url}"
    m = verdict.manifest
    mkey = f"{verdict.directory}/{MANIFEST_NAME}"
    codec = (m.codec if m is not None else None) or CODEC_ID

    def copy(state: CopyState, proven: bool, detail: str | None, new: NewCheckpoint | None = None) -> RebuiltCopy:
        return RebuiltCopy(step=verdict.step, url=url, state=state, stored_bytes=verdict.stored_bytes or None,
                           codec=codec, manifest_key=mkey, verified_at=now if proven else None,
                           storage_class=verdict.storage_class, detail=detail, new=new)

    if verdict.state == "intact" and isinstance(proof, str):
        return Linked(None, "unchecked", f"{where}: could not be proven ({proof}); nothing recorded: rebuild again "
                                         f"once the archive answers")
    check = proof if isinstance(proof, ArchiveCheck) else None
    if verdict.state == "intact" and check is not None and check.ok:
        if record is not None:
            return Linked(copy(CopyState.PRESENT, True, None), "present")
        assert m is not None
        return Linked(copy(CopyState.PRESENT, True, None, _from_manifest(m, url, now, proven=True)), "present")
    problems = verdict.problems if verdict.state != "intact" else (check.problems if check is not None else ())
    detail = "; ".join(problems[:3]) or "damaged"
    if record is not None:
        return Linked(copy(CopyState.DEGRADED, False, detail), "degraded", f"{where} is damaged: {detail}")
    if m is None:
        return Linked(None, "not recovered", f"{where}: its manifest cannot be read back ({detail}); nothing of it "
                                             f"is trusted: not recovered")
    if copy_dir(m.job, m.step) != verdict.directory:
        return Linked(None, "not recovered", f"{where}: {detail}; not recovered")
    bad = set(verdict.bad_files) | set(check.bad_files if check is not None else ())
    new = _from_manifest(m, url, now, proven=False, bad=bad,
                         reason=f"its only copy, the archive copy {url}, is damaged: {detail}")
    return Linked(copy(CopyState.DEGRADED, False, detail, new), "degraded",
                  f"{where} is damaged and is the only copy: {detail}")


def _from_manifest(m: Manifest, url: str, now: datetime, *, proven: bool, bad: Iterable[str] = (),
                   reason: str | None = None) -> NewCheckpoint:
    """The checkpoint a manifest describes: ``verified`` when its copy was proven now, else ``corrupt``."""
    bad = set(bad)
    files = tuple(NewFile(f.relpath, f.size, f.crc64nvme, f.sha256,
                          "ok" if proven else ("corrupt" if f.relpath in bad else None)) for f in m.files)
    location = m.source or url
    return NewCheckpoint(
        format=m.format.value, location=location, state=State.VERIFIED if proven else State.CORRUPT,
        state_reason=(f"rebuilt from its archive manifest: every file proven in the archive copy {url}; "
                      f"no hot copy is listed") if proven else reason,
        files=files, first_seen=min(m.created_at, now), verified_at=now if proven else None,
        recorded_loss=m.recorded_loss, hot_url=posixpath.dirname(location.rstrip("/")) or location,
    )


def infer_hot_root(source: str, job: str) -> str | None:
    """The URL a checkpoint written at ``source`` was scanned under as job ``job``: ``source``
    is ``{root}/{job}/{name}`` (a checkpoint at the root itself is ``{root}/{name}``, the
    job being the root's last name). None when ``source`` is neither. Pure."""
    parent = source.rstrip("/").rpartition("/")[0]
    if parent.endswith("/" + job) and len(parent) > len(job) + 1:
        root = parent[: -len(job) - 1]
        return root if "://" not in root or root.split("://", 1)[1] else None
    if parent.rpartition("/")[2] == job:
        return parent
    return None


@dataclass(frozen=True)
class HotLocation:
    """A hot location a rebuild scans, and where it came from: ``given`` (the command line),
    ``backup`` (scanned URLs a catalog backup records) or ``manifest`` (an archive manifest's
    source)."""

    url: str
    origin: Literal["given", "backup", "manifest"]


def choose_hot_locations(given: Sequence[str], from_backups: Iterable[str], manifests: Iterable[Manifest],
                         archives: Sequence[str]) -> tuple[list[HotLocation], list[str]]:
    """The hot locations to scan and, one line each, those left out because they overlap an
    archive location (never scanned as hot). Given ones win; without them, the backups' and the
    manifests' (sources' roots). Pure."""
    chosen: dict[str, HotLocation] = {}
    if given:
        for url in given:
            chosen.setdefault(url.rstrip("/"), HotLocation(url, "given"))
    else:
        for url in sorted(set(from_backups)):
            chosen.setdefault(url.rstrip("/"), HotLocation(url, "backup"))
        roots = {r for m in manifests if m.source and (r := infer_hot_root(m.source, m.job)) is not None}
        for url in sorted(roots):
            chosen.setdefault(url.rstrip("/"), HotLocation(url, "manifest"))
    kept: list[HotLocation] = []
    left: list[str] = []
    for loc in chosen.values():
        overlap = next(((a, how) for a in archives if (how := _overlap(a, loc.url)) is not None), None)
        if overlap is not None:
            left.append(f"hot location {loc.url} ({loc.origin}) {overlap[1]} the archive location {overlap[0]}: "
                        f"never scanned as hot storage")
        else:
            kept.append(loc)
    return sorted(kept, key=lambda h: h.url), left


def _overlap(archive: str, hot: str) -> str | None:
    try:
        how = location_overlap(archive, hot)
    except ConfigError:
        return None
    return {"equals": "equals", "contains": "lies inside", "lies inside": "contains"}.get(how) if how else None


# ------------------------------------------------------------------------------ the report


@dataclass(frozen=True)
class BackupUsed:
    """One job's catalog backup: the one restored (``url``; None: no intact one), when it was
    taken, the newer ones passed over (url, why), and what was restored from it
    (``restored.already``: an earlier run had restored it)."""

    job: str
    url: str | None
    created_at: datetime | None
    skipped: tuple[tuple[str, str], ...] = ()
    restored: Restored | None = None

    @property
    def used(self) -> bool:
        return self.url is not None


@dataclass(frozen=True)
class HotScanned:
    """A hot location as the rebuild scanned it: where it came from, and the scan's figures
    (``error``: it could not be listed, its checkpoints were not reconciled)."""

    url: str
    origin: str
    checkpoints: int = 0
    new: int = 0
    vanished: int = 0
    rows_written: int = 0
    error: str | None = None


@dataclass(frozen=True)
class ArchiveRead:
    """An archive location as the rebuild read it: committed copies found, and what they became:
    ``present`` (proven now), ``degraded``, ``unchecked`` (could not be proven now),
    ``not_recovered``; ``new``: checkpoints cataloged from their manifests alone; ``linked``:
    copies of a checkpoint the hot tree holds; ``uncommitted``: step directories without a
    commit marker (left to the janitor); ``gone``: cataloged copies storage no longer shows;
    ``backups``: backup objects seen."""

    url: str
    copies: int = 0
    present: int = 0
    degraded: int = 0
    unchecked: int = 0
    not_recovered: int = 0
    new: int = 0
    linked: int = 0
    uncommitted: int = 0
    gone: int = 0
    backups: int = 0
    error: str | None = None


@dataclass(frozen=True)
class RebuildReport:
    """What ``ckptier rebuild`` did (:func:`rebuild`): the backups, hot locations and archive
    locations read, ``problems`` (damaged copies, copies that could not be proven, locations
    that could not be read: one line each), ``not_recovered`` (what neither storage nor a
    backup could bring back, one line each), and ``changed``: catalog rows and copies written
    (0: the catalog already was what storage shows)."""

    catalog: str
    backups: tuple[BackupUsed, ...]
    hot: tuple[HotScanned, ...]
    archives: tuple[ArchiveRead, ...]
    problems: tuple[str, ...] = ()
    not_recovered: tuple[str, ...] = ()
    changed: int = 0

    @property
    def ok(self) -> bool:
        """True when every copy found was proven and every location read."""
        return not self.problems

    def lines(self) -> list[str]:
        out: list[str] = []
        for b in self.backups:
            if b.url is None:
                out.append(f"{b.job}: no intact catalog backup" + (f" ({len(b.skipped)} corrupt)" if b.skipped else ""))
                continue
            r = b.restored
            what = ("already restored by an earlier run" if r is None or r.already else
                    f"{r.checkpoints} checkpoints ({r.tombstones} tombstones), {r.drills} drills, {r.events} events")
            out.append(f"{b.job}: restored the catalog backup {b.url} taken "
                       f"{b.created_at.isoformat(timespec='seconds') if b.created_at else '?'}: {what}")
            out.extend(f"  passed over the newer backup {u}: {why}" for u, why in b.skipped)
        for h in self.hot:
            if h.error is not None:
                out.append(f"hot {h.url} ({h.origin}): NOT LISTED: {h.error}")
            else:
                out.append(f"hot {h.url} ({h.origin}): {h.checkpoints} checkpoints, {h.new} new, {h.vanished} "
                           f"vanished since the backup, {h.rows_written} rows written")
        for a in self.archives:
            if a.error is not None:
                out.append(f"archive {a.url}: NOT LISTED: {a.error}")
                continue
            out.append(f"archive {a.url}: {a.copies} copies: {a.present} present (proven now), {a.degraded} degraded, "
                       f"{a.unchecked} not proven, {a.not_recovered} not recovered; {a.new} cataloged from their "
                       f"manifests, {a.linked} linked to their hot checkpoint; {a.gone} cataloged copies gone; "
                       f"{a.uncommitted} uncommitted directories (ckptier janitor)")
        out.extend(f"problem: {p}" for p in self.problems)
        out.extend(f"not recovered: {n}" for n in self.not_recovered)
        out.append(f"rebuild: {self.changed} catalog changes; "
                   + ("every copy found was proven" if self.ok else f"{len(self.problems)} problem(s), see above"))
        return out

    def to_json(self) -> dict[str, Any]:
        def iso(t: datetime | None) -> str | None:
            return t.isoformat() if t is not None else None

        return {
            "catalog": self.catalog,
            "backups": [{"job": b.job, "used": b.used, "url": b.url, "created_at": iso(b.created_at),
                         "skipped": [{"url": u, "detail": why} for u, why in b.skipped],
                         "restored": None if b.restored is None else {
                             k: getattr(b.restored, k) for k in ("checkpoints", "tombstones", "files", "copies",
                                                                  "drills", "events", "already")}}
                        for b in self.backups],
            "hot": [asdict(h) for h in self.hot],
            "archives": [asdict(a) for a in self.archives],
            "problems": list(self.problems),
            "not_recovered": list(self.not_recovered),
            "changed": self.changed,
            "ok": self.ok,
        }


# ------------------------------------------------------------------------------ the I/O


@dataclass
class _Archive:
    """One archive location while a rebuild reads it."""

    url: str
    store: Store
    listing: ArchiveListing | None = None
    manifests: dict[str, Manifest | str] = field(default_factory=dict)
    error: str | None = None


def _read_manifest(store: Store, directory: str) -> Manifest | str:
    """The copy's manifest, or why it cannot be read back (a store that does not answer raises)."""
    key = f"{directory}/{MANIFEST_NAME}"
    try:
        return Manifest.from_json(read_bytes(store, key, limit=MANIFEST_LIMIT), where=key)
    except NotFound:
        return "vanished while the archive was read"
    except (ManifestError, ValueError) as exc:
        return str(exc)


def _list_archive(a: _Archive, workers: int) -> None:
    try:
        a.listing = group_listing(a.store.list(""))
    except NotFound:
        a.listing = group_listing(())  # no archive yet: nothing was ever promoted there
        return
    threads = 1 if isinstance(a.store, LocalPaths) else workers
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="ckptier-manifests") as pool:
        for d, m in zip(a.listing.copies, pool.map(lambda d: _read_manifest(a.store, d), a.listing.copies)):
            a.manifests[d] = m


def _restore_backups(catalog: Catalog, archives: Sequence[_Archive]) -> tuple[list[BackupUsed], dict[str, ReadBackup]]:
    """Restore each job's newest intact backup (across every archive location)."""
    candidates: dict[str, list[tuple[_Archive, list[str]]]] = {}
    for a in archives:
        if a.listing is None:
            continue
        for d, keys in by_job_dir(a.listing.backups).items():
            candidates.setdefault(d, []).append((a, keys))
    used: list[BackupUsed] = []
    bodies: dict[str, ReadBackup] = {}
    for d, places in sorted(candidates.items()):
        best: ReadBackup | None = None
        skipped: list[tuple[str, str]] = []
        for a, keys in places:
            got, passed = newest_good(a.store, keys)
            skipped.extend(passed)
            if got is not None and (best is None or got.header.created_at > best.header.created_at):
                best = got
        if best is None:
            used.append(BackupUsed(job=d.rstrip("/").rsplit("/", 1)[-1], url=None, created_at=None,
                                   skipped=tuple(skipped)))
            continue
        job = best.header.job
        newer = tuple((u, why) for u, why in skipped if u.rsplit("/", 1)[-1] > best.url.rsplit("/", 1)[-1])
        try:
            restored = import_job(catalog, best.body)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{best.url}: the catalog backup of job {job!r} does not restore ({exc}); "
                              f"move it aside to restore the one before it") from None
        used.append(BackupUsed(job, best.url, best.header.created_at, newer, restored))
        bodies[job] = best
    return used, bodies


def _backup_roots(backups: Mapping[str, ReadBackup]) -> list[str]:
    """The hot URL each restored job was scanned under: of the scanned URLs its backup records, the
    one its hot directory is ``{url}/{job}`` of (the job's name is the path below the scanned URL),
    else its hot directory's root by that rule. A URL that would give the job another name is
    never scanned for it."""
    roots: set[str] = set()
    for job, b in backups.items():
        hot = (b.body.get("job") or {}).get("hot_url")
        if not isinstance(hot, str):
            continue
        scanned = [str(u).rstrip("/") for u in b.body.get("scanned") or ()]
        exact = [u for u in scanned if hot == f"{u}/{job}" or (hot == u and u.rpartition("/")[2] == job)]
        if exact:
            roots.update(exact)
        elif (root := infer_hot_root(hot + "/x", job)) is not None:
            roots.add(root)
    return sorted(roots)


def rebuild(
    catalog: Catalog,
    config: Config,
    *,
    store: Callable[[str], Store],
    now: Callable[[], datetime],
    hot_urls: Sequence[str] = (),
    archive_urls: Sequence[str] = (),
    workers: int = WORKERS,
    scan: Callable[[str], Any] | None = None,
) -> RebuildReport:
    """Rebuild ``catalog`` from storage (see the module docstring); returns the report.

    ``store(url)`` opens a store (the run's cache); ``archive_urls`` default
    to every ``[[policy]] archive`` of ``config``; ``hot_urls`` to what the
    backups and the manifests say. ``scan(url)`` scans one hot location into
    the catalog and returns its :class:`~ckptier.tasks.scan.ScanReport`
    (default: :func:`ckptier.tasks.scan.scan_url` with ``config``'s
    patterns and graces, a full listing). Raises :class:`ConfigError` (one
    line, before anything is written) when there is no archive location,
    a given hot location overlaps an archive, or the catalog holds rows a
    rebuild did not write; store errors while reading backups propagate (a
    rerun resumes).
    """
    from .config import policy_grace
    from .scan import scan_url

    archives_wanted = list(dict.fromkeys(archive_urls or sorted({p.archive for p in config.policies if p.archive})))
    if not archives_wanted:
        raise ConfigError("rebuild: no archive location: give --archive URL, or name one in a [[policy]] archive "
                          "of ckptier.toml (with no archive tier at all, 'ckptier scan HOT_URL' catalogs the hot tree)")
    for h in hot_urls:
        for wanted in archives_wanted:
            if (how := _overlap(wanted, h)) is not None:
                raise ConfigError(f"rebuild: hot location {h} {how} the archive location {wanted}; an archive is "
                                  f"never scanned as hot storage: give the hot locations apart from it")
    rows, started = rebuild_started(catalog)
    if rows and not started:
        raise ConfigError(f"rebuild: the catalog {catalog.url} already holds {rows} rows that no rebuild wrote; "
                          f"rebuild into an empty catalog (--catalog with a new URL, or move this one away)")
    if not started:
        catalog.log_event(REBUILD_STARTED, f"rebuild from {', '.join(archives_wanted)} started", now=now(),
                          data={"archives": archives_wanted, "hot": list(hot_urls)})

    archives = [_Archive(url, store(url)) for url in archives_wanted]
    for a in archives:
        try:
            _list_archive(a, workers)
        except (CkptierError, OSError) as exc:
            raise StoreError(f"rebuild: cannot read the archive {a.url}: {exc}; nothing more was written, "
                             f"rebuild again once it answers") from exc
    problems: list[str] = []
    backups, bodies = _restore_backups(catalog, archives)

    manifests = [m for a in archives for m in a.manifests.values() if isinstance(m, Manifest)]
    hot, left = choose_hot_locations(hot_urls, _backup_roots(bodies), manifests, [a.store.url for a in archives])
    problems.extend(left)
    if scan is None:
        grace = policy_grace(config)

        def scan(url: str) -> Any:
            return scan_url(url, catalog, now=now(), patterns=config.patterns, grace_for=grace, full=True)

    scanned: list[HotScanned] = []
    changed = sum(b.restored.checkpoints + b.restored.drills + b.restored.events
                  for b in backups if b.restored is not None and not b.restored.already)
    for loc in hot:
        try:
            r = scan(loc.url)
        except (CkptierError, OSError) as exc:
            scanned.append(HotScanned(loc.url, loc.origin, error=str(exc)))
            problems.append(f"hot location {loc.url} could not be scanned ({exc}); its checkpoints were not "
                            f"reconciled with storage: rebuild again once it answers")
            continue
        s = r.summary
        scanned.append(HotScanned(loc.url, loc.origin, r.checkpoints, s.new if s else 0, s.vanished if s else 0,
                                  r.rows_written))
        changed += r.rows_written

    results: list[ArchiveRead] = []
    lost: list[str] = []
    for a in archives:
        read, damaged, unrecovered, n = _reconcile_archive(catalog, a, now=now, workers=workers)
        results.append(read)
        problems.extend(damaged)
        lost.extend(unrecovered)
        changed += n

    report = RebuildReport(catalog=catalog.url, backups=tuple(backups), hot=tuple(scanned), archives=tuple(results),
                           problems=tuple(problems + lost),
                           not_recovered=tuple(lost + _not_recovered(catalog, backups, bodies)), changed=changed)
    if changed:
        catalog.log_event("rebuild.finished", report.lines()[-1], now=now(),
                          data={"changed": changed, "problems": len(report.problems)})
    return report


def _reconcile_archive(catalog: Catalog, a: _Archive, *, now: Callable[[], datetime],
                       workers: int) -> tuple[ArchiveRead, list[str], list[str], int]:
    """Judge, prove and record every copy of one archive location: its figures, the problem
    lines, the lines of copies not recovered, and the number of copies changed."""
    assert a.listing is not None
    listing = a.listing
    base = a.store.url.rstrip("/")
    verdicts = [judge_copy(d, a.manifests[d], listing.objects) for d in listing.copies]
    records: dict[tuple[str, int], CheckpointRecord] = {
        (r.job, r.step): r for r in catalog.checkpoints(include_deleted=True, with_files=False)}
    # The files only of the checkpoints a copy is proven against (a proof compares them with the manifest).
    wanted = [r.id for v in verdicts if v.intact and (r := records.get((v.job, v.step))) is not None]
    for start in range(0, len(wanted), 5000):
        for r in catalog.get_many(wanted[start:start + 5000]):
            records[(r.job, r.step)] = r

    def prove(v: CopyVerdict) -> ArchiveCheck | str | None:
        if not v.intact:
            return None
        url = f"{base}/{v.directory}"
        rec = records.get((v.job, v.step))
        assert v.manifest is not None
        probe = _probe_record(rec, v.manifest, url)
        try:
            return check_archive_copy(probe, a.store, store_checksums=True)
        except (CkptierError, OSError) as exc:
            return str(exc).splitlines()[0] if str(exc) else type(exc).__name__

    threads = max(1, workers if not isinstance(a.store, LocalPaths) else min(workers, 4))
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckptier-prove") as pool:
        proofs = list(pool.map(prove, verdicts))

    by_job: dict[str, list[RebuiltCopy]] = {}
    counts: dict[str, int] = {"present": 0, "degraded": 0, "unchecked": 0, "not recovered": 0}
    lines: list[str] = []
    lost: list[str] = []
    new = linked = 0
    t = now()
    for v, proof in zip(verdicts, proofs):
        rec = records.get((v.job, v.step))
        got = link_copy(v, rec, proof, url=f"{base}/{v.directory}", now=t)
        counts[got.outcome] += 1
        if got.line is not None:
            (lost if got.outcome == "not recovered" else lines).append(got.line)
        if got.copy is None:
            continue
        by_job.setdefault(v.job, []).append(got.copy)
        if got.copy.new is not None:
            new += 1
        elif rec is not None and "hot" in rec.tiers:
            linked += 1
    # Cataloged archive copies in this location that storage no longer shows.
    committed = {f"{base}/{d}" for d in listing.copies}
    listed_dirs: set[str] = set()

    def dirs_listed() -> set[str]:
        """Every directory holding a listed object (made once, when a cataloged copy is gone)."""
        if not listed_dirs:
            for key in listing.objects:
                head = key.rpartition("/")[0]
                while head and head not in listed_dirs:
                    listed_dirs.add(head)
                    head = head.rpartition("/")[0]
        return listed_dirs

    gone: dict[str, dict[str, CopyState]] = {}
    for (job, _step), rec in records.items():
        for c in rec.copies:
            if c.tier != Tier.ARCHIVE or c.state not in (CopyState.PRESENT, CopyState.DEGRADED):
                continue
            if not c.url.startswith(base + "/") or c.url in committed:
                continue
            left = c.url[len(base) + 1:] in dirs_listed()
            state = CopyState.DEGRADED if left else CopyState.MISSING
            if state != c.state:
                gone.setdefault(job, {})[c.url] = state
                lines.append(f"{job} step {rec.step}: the cataloged archive copy {c.url} is "
                             + ("damaged: objects without a manifest" if left else "gone from the archive"))
    changes = 0
    for job in sorted(set(by_job) | set(gone)):
        changes += len(record_rebuilt_copies(catalog, job, by_job.get(job, []), now=now(), gone=gone.get(job, {})))
    read = ArchiveRead(url=a.store.url, copies=len(verdicts), present=counts["present"], degraded=counts["degraded"],
                       unchecked=counts["unchecked"], not_recovered=counts["not recovered"], new=new, linked=linked,
                       uncommitted=len(listing.uncommitted), gone=sum(len(g) for g in gone.values()),
                       backups=len(listing.backups))
    return read, lines, lost, changes


def _probe_record(record: CheckpointRecord | None, manifest: Manifest, url: str) -> CheckpointRecord:
    """The record the verifier proves a copy against: the catalog's checkpoint (its files, as
    restored or scanned) with this copy, or one made of the manifest alone."""
    copy = CopyRecord(tier=Tier.ARCHIVE, url=url, state=CopyState.PRESENT, stored_bytes=None, verified_at=None)
    if record is not None:
        return replace(record, copies=(copy,))
    from ckptier.storage.records import FileRecord

    files = tuple(FileRecord(f.relpath, f.size, None, None, f.crc64nvme, f.sha256, None, None) for f in manifest.files)
    return CheckpointRecord(id=0, job=manifest.job, step=manifest.step, format=manifest.format, state=State.COMMITTED,
                            location=manifest.source or url, bytes=manifest.bytes, saved_at=None,
                            first_seen=manifest.created_at, last_seen=manifest.created_at, missing_since=None,
                            verified_at=None, state_reason=None, files=files, copies=(copy,))


def _not_recovered(catalog: Catalog, backups: Sequence[BackupUsed], bodies: Mapping[str, ReadBackup]) -> list[str]:
    """What storage and the backups could not bring back, one line each."""
    out: list[str] = []
    backed = set(bodies)
    for job in catalog.jobs():
        if job not in backed:
            out.append(f"job {job}: no catalog backup: its tombstones, drill history, events and verification "
                       f"history are lost; its hot checkpoints stay committed until 'ckptier verify' proves them")
    for job, b in sorted(bodies.items()):
        events = b.header.counts.get("events", 0)
        out.append(f"job {job}: restored as of {b.header.created_at.isoformat(timespec='seconds')}: drills, "
                   f"tombstones and events recorded after that backup are lost"
                   + (f"; events older than the newest {MAX_EVENTS:,} were never backed up" if events >= MAX_EVENTS
                      else ""))
    for used in backups:
        if used.url is None:
            out.append(f"job dir {used.job}: every catalog backup is corrupt "
                       f"({'; '.join(w for _, w in used.skipped[:2])})")
    out.append("never backed up: retention decisions, delete intents (a delete that was under way is finished by "
               "hand: rescan), leases, events of no job")
    return out
