"""Catalog backups in the archive tier: written after each ``apply`` and on ``ckptier catalog backup``,
read back by ``ckptier rebuild``.

What storage cannot tell about a job (its tombstones, verification history,
copies' states, drills, events and recovery events) is exported (:func:`ckptier.storage.catalog.restore.export_job`)
into one object per job and backup (:mod:`ckptier.storage.catalog_backup`), written to the archive
tier of the job's ``[[policy]]``, in the bucket's default storage class
(readable without a restore)::

    .ckptier/catalog/{job-slug}-{hash}/{YYYYmmddTHHMMSSffffff}Z.ckb

Each job keeps its :data:`GENERATIONS` newest backups: a new one is written
only when the job's rows changed since the newest intact one, read back and
checked (size, sha256, decoding) before older ones are removed, so a backup
that went bad in storage always leaves an older good one to restore from.
Only objects of that name under that prefix are ever removed. Backups of one
job are independent of the others'; a job whose policy names no archive has
none (``BackupReport.no_archive``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ckptier.storage.archive_copies import BACKUP_PREFIX
from ckptier.storage.base import Store, read_bytes
from ckptier.storage.catalog.api import Catalog
from ckptier.storage.catalog.restore import export_job
from ckptier.storage.catalog_backup import (
    MAX_HEADER,
    BackupCorrupt,
    BackupHeader,
    decode_backup,
    decode_header,
    encode_backup,
)
from ckptier.storage.errors import CkptierError, NotFound

from .config import Config

#: Backups kept per job (the newest).
GENERATIONS = 5
#: Suffix of a backup object.
BACKUP_SUFFIX = ".ckb"
_NAME = re.compile(r"^\d{8}T\d{12}Z\.ckb$")
_SLUG = re.compile(r"[^A-Za-z0-9._-]+")


def job_prefix(job: str) -> str:
    """The key prefix (ending ``/``) of ``job``'s backups: a readable slug of the name and a hash
    of it (names may hold any character, and one job's name may be another's directory)."""
    slug = _SLUG.sub("_", job).strip("._")[:48] or "job"
    return f"{BACKUP_PREFIX}{slug}-{hashlib.sha256(job.encode('utf-8', 'surrogateescape')).hexdigest()[:16]}/"


def backup_key(job: str, created_at: datetime) -> str:
    """The key of ``job``'s backup taken at ``created_at`` (keys sort by time)."""
    return job_prefix(job) + created_at.astimezone(UTC).strftime("%Y%m%dT%H%M%S%fZ") + BACKUP_SUFFIX


def is_backup_name(key: str) -> bool:
    """True for a key this module writes (``.ckptier/catalog/<job dir>/<time>Z.ckb``)."""
    if not key.startswith(BACKUP_PREFIX):
        return False
    rest = key[len(BACKUP_PREFIX):]
    head, sep, name = rest.partition("/")
    return bool(sep) and "/" not in name and bool(head) and bool(_NAME.match(name))


# ------------------------------------------------------------------------------ reading


@dataclass(frozen=True)
class ReadBackup:
    """A backup read back whole and intact: where it is, its header and its body."""

    url: str
    header: BackupHeader
    body: dict[str, Any]


def read_backup(store: Store, key: str) -> ReadBackup:
    """Read and check one backup object (:class:`BackupCorrupt` when it is not whole and intact)."""
    url = f"{store.url.rstrip('/')}/{key}"
    header, body = decode_backup(read_bytes(store, key), where=url)
    return ReadBackup(url, header, body)


def read_header(store: Store, key: str) -> BackupHeader:
    """Only the header line of a backup object (the body is not checked)."""
    with store.open_read(key) as fh:
        start = fh.read(MAX_HEADER)
    return decode_header(start, where=f"{store.url.rstrip('/')}/{key}")


def by_job_dir(keys: Iterable[str]) -> dict[str, list[str]]:
    """Backup keys grouped by their job directory, each group newest first; other keys are left out."""
    out: dict[str, list[str]] = {}
    for key in keys:
        if is_backup_name(key):
            out.setdefault(key.rsplit("/", 1)[0] + "/", []).append(key)
    return {d: sorted(ks, reverse=True) for d, ks in sorted(out.items())}


def newest_good(store: Store, keys: Sequence[str]) -> tuple[ReadBackup | None, list[tuple[str, str]]]:
    """The newest of ``keys`` (newest first) that reads back whole and intact, and each newer one
    skipped with why (a corrupt backup is passed over for the one before it). Store errors other
    than a vanished object propagate."""
    skipped: list[tuple[str, str]] = []
    for key in keys:
        url = f"{store.url.rstrip('/')}/{key}"
        try:
            return read_backup(store, key), skipped
        except NotFound:
            skipped.append((url, "vanished while reading"))
        except (BackupCorrupt, ValueError) as exc:
            skipped.append((url, str(exc)))
    return None, skipped


# ------------------------------------------------------------------------------ writing


@dataclass(frozen=True)
class BackupWritten:
    """One job's backup: ``url`` of the newest intact object, its header, whether it was written
    now (False: the newest backup already held the same rows), and the old ones removed."""

    job: str
    url: str
    header: BackupHeader
    written: bool
    pruned: tuple[str, ...] = ()
    replaced_corrupt: tuple[str, ...] = ()


@dataclass(frozen=True)
class BackupReport:
    """What a backup run did, per job: ``backups`` written or found current, ``failed`` (job, why),
    ``no_archive``: jobs whose policy names no archive tier (nowhere to back them up)."""

    backups: tuple[BackupWritten, ...] = ()
    failed: tuple[tuple[str, str], ...] = ()
    no_archive: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.failed

    def lines(self) -> list[str]:
        """The run in words, one line per job that needs saying and a total."""
        out = [f"catalog backup of {b.job}: {'written' if b.written else 'unchanged'} {b.url} "
               f"({b.header.bytes:,} bytes: " + ", ".join(f"{n} {t}" for t, n in sorted(b.header.counts.items())) + ")"
               for b in self.backups if b.written]
        out += [f"catalog backup of {job} FAILED: {why}; run 'ckptier catalog backup' once the archive answers"
                for job, why in self.failed]
        if self.no_archive:
            out.append(f"catalog backup: {len(self.no_archive)} job(s) have no archive tier to back up to "
                       f"(e.g. {self.no_archive[0]!r}): give their [[policy]] an archive")
        written = sum(b.written for b in self.backups)
        out.append(f"catalog backup: {written} written, {len(self.backups) - written} unchanged, "
                   f"{len(self.failed)} failed")
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "backups": [{"job": b.job, "url": b.url, "written": b.written, "created_at": b.header.created_at.isoformat(),
                         "bytes": b.header.bytes, "sha256": b.header.sha256, "counts": dict(b.header.counts),
                         "pruned": list(b.pruned), "replaced_corrupt": list(b.replaced_corrupt)}
                        for b in self.backups],
            "failed": [{"job": j, "detail": why} for j, why in self.failed],
            "no_archive": list(self.no_archive),
            "ok": self.ok,
        }


def backup_job(catalog: Catalog, job: str, store: Store, *, now: datetime,
               generations: int = GENERATIONS) -> BackupWritten:
    """Back ``job`` up into ``store`` (its archive tier): export its rows, and unless the newest
    intact backup holds the same, write a new object (never over an existing one), read it back
    and check it, then remove the oldest beyond ``generations``. Raises ``ValueError`` for an
    unknown job and store errors unchanged (nothing removed then)."""
    if generations < 1:
        raise ValueError(f"generations={generations}: keep at least 1 backup")
    body = export_job(catalog, job)
    if body is None:
        raise ValueError(f"job {job!r} is not in the catalog")
    data = encode_backup(job, now, body)
    mine = decode_header(data, where="new backup")
    prefix = job_prefix(job)
    try:
        keys = by_job_dir(i.key for i in store.list(prefix)).get(prefix, [])
    except NotFound:  # the archive's root does not exist yet: nothing promoted, nothing backed up
        keys = []
    current, corrupt = newest_good(store, keys)
    if current is not None and current.header.sha256 == mine.sha256 and current.header.job == job:
        return BackupWritten(job, current.url, current.header, written=False,
                             replaced_corrupt=tuple(u for u, _ in corrupt))
    key = backup_key(job, now)
    store.write(key, data, if_absent=True)
    back = read_backup(store, key)  # proven before anything older goes
    if back.header.sha256 != mine.sha256:
        raise BackupCorrupt(f"{back.url}: read back with sha256 {back.header.sha256}, wrote {mine.sha256}")
    older = [k for k in sorted({*keys, key}, reverse=True) if k != key]
    keep = generations - 1
    # Corrupt ones never count toward the generations kept, and go first.
    bad = {u.rsplit("/", 1)[-1] for u, _ in corrupt}
    good = [k for k in older if k.rsplit("/", 1)[-1] not in bad]
    victims = [k for k in older if k.rsplit("/", 1)[-1] in bad] + good[keep:]
    pruned: list[str] = []
    if victims:
        result = store.delete_many(victims)
        pruned = sorted(result.deleted)
    return BackupWritten(job, back.url, back.header, written=True, pruned=tuple(pruned),
                         replaced_corrupt=tuple(u for u, _ in corrupt))


def backup_catalog(catalog: Catalog, archive_for: Callable[[str], Store | None], *, now: datetime,
                   jobs: Iterable[str] | None = None) -> BackupReport:
    """Back up every job of the catalog (or ``jobs``) into its archive tier (``archive_for(job)``;
    None: the job has none). A job whose backup fails is reported and the others go on."""
    written: list[BackupWritten] = []
    failed: list[tuple[str, str]] = []
    none: list[str] = []
    for job in sorted(set(jobs) if jobs is not None else catalog.jobs()):
        try:
            store = archive_for(job)
            if store is None:
                none.append(job)
                continue
            written.append(backup_job(catalog, job, store, now=now))
        except (CkptierError, ValueError, OSError) as exc:
            failed.append((job, str(exc).splitlines()[0] if str(exc) else type(exc).__name__))
    return BackupReport(tuple(written), tuple(failed), tuple(none))



def policy_archives(config: Config, store: Callable[[str], Store]) -> Callable[[str], Store | None]:
    """``archive_for(job)`` for :func:`backup_catalog`: the store of the archive tier the job's
    ``[[policy]]`` names (in the store's default storage class: a backup must stay readable
    without a restore), or None."""

    def archive_for(job: str) -> Store | None:
        policy = config.policy_for(job)
        return store(policy.archive) if policy is not None and policy.archive else None

    return archive_for


def backup_after_apply(catalog: Catalog, config: Config, store: Callable[[str], Store], *, now: datetime,
                       job: str | None = None) -> list[str]:
    """Back up, after an ``apply``, every job (or ``job``) whose policy names an archive; the lines
    to add to the apply's report (none when every backup was current). A failure is logged as a
    ``catalog.backup_failed`` event; it never undoes or fails the apply."""
    archive_for = policy_archives(config, store)
    jobs = [j for j in ([job] if job else catalog.jobs()) if archive_for(j) is not None]
    report = backup_catalog(catalog, archive_for, now=now, jobs=jobs)
    for failed_job, why in report.failed:
        catalog.log_event("catalog.backup_failed", f"catalog backup of {failed_job} failed: {why}", now=now,
                          job=failed_job)
    if not report.failed and not any(b.written for b in report.backups):
        return []
    return [line for line in report.lines() if "no archive tier" not in line]
