"""The record types the catalog returns and takes besides those of
:mod:`ckptier.storage.records`, and the catalog's own errors.

Only the writing concerns (and the history) import this module at module
level; the read and verification concerns (:mod:`.queries`,
:mod:`.verification`, :mod:`.core`) import it where they build or raise one
of its types, so ``ckptier ls`` and ``ckptier latest`` never pay for its
dataclasses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any


from .. import transitions
from ..errors import CkptierError
from ..records import (
    NOT_JUDGED,
    FileCheck,
)


class UnknownCheckpoint(CkptierError, LookupError):
    """A checkpoint id (or copy) that the catalog does not hold."""


class LeaseLost(CkptierError):
    """A claimed row's lease ran out or was taken over before its result was recorded:
    nothing was written, and the row's new holder records it instead."""


@dataclass(frozen=True)
class ReadBack:
    """One checkpoint's read-back results, to record with :meth:`Catalog.record_verifications`:
    ``results`` per file, the job's ``grace``, ``extra`` files found beside the
    cataloged ones, and the ``claim`` (owner, generation) it is recorded under, if any."""

    checkpoint_id: int
    results: tuple[FileCheck, ...]
    grace: timedelta = transitions.DEFAULT_GRACE
    extra: tuple[str, ...] = ()
    claim: tuple[str, int] | None = None


@dataclass(frozen=True)
class ScanSummary:
    """What :meth:`Catalog.record_scan` found and changed.

    ``rows_written`` counts rows of jobs, checkpoints, files and copies that
    were inserted, updated or deleted (0 on an unchanged rescan). ``new``,
    ``changed``, ``committed``, ``vanished``, ``reappeared``,
    ``resurrected`` and ``corrupt`` (found incomplete past the grace: files
    its manifest lists are missing or short) count checkpoints;
    ``corrupt_found`` names those (job, step, reason).
    """

    store_url: str
    scope_prefix: str
    objects: int
    checkpoints: int
    unrecognised: int
    jobs: tuple[str, ...]
    rows_written: int
    new: int = 0
    changed: int = 0
    committed: int = 0
    vanished: int = 0
    reappeared: int = 0
    resurrected: int = 0
    corrupt: int = 0
    corrupt_found: tuple[tuple[str, int, str], ...] = ()


@dataclass(frozen=True)
class ProcessId:
    """The process holding a lease: ``host`` name, ``pid`` and ``started``, an
    opaque token of the process's start (None when the platform cannot tell),
    so that a pid reused by a later process is not mistaken for the holder."""

    host: str
    pid: int
    started: str | None = None


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds a checkpoint's lease: the run's ``owner`` name, the
    ``generation`` it claimed, when the lease runs out, and the holding
    ``process`` when one was recorded."""

    owner: str
    generation: int
    expires: datetime | None
    process: ProcessId | None = None

    @property
    def host(self) -> str | None:
        return self.process.host if self.process else None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def describe(self) -> str:
        """One phrase naming the holder, e.g. ``run-7 (host gpu1 pid 4242, lease until 2026-...)``."""
        parts = [f"host {self.process.host} pid {self.process.pid}"] if self.process else []
        if self.expires is not None:
            parts.append(f"lease until {self.expires.isoformat(timespec='seconds')}")
        return self.owner + (f" ({', '.join(parts)})" if parts else "")


@dataclass(frozen=True)
class DirStampRecord:
    """A checkpoint directory's stamp (see :meth:`Catalog.dir_stamps`): the
    digest, the subdirectories it covers (relative; ``""`` is the directory
    itself) and when it was taken."""

    checkpoint_id: int
    location: str
    stamp: str
    dirs: tuple[str, ...]
    taken_at: datetime
    files: int = 0


@dataclass(frozen=True)
class DeleteIntent:
    """A delete that a run recorded before deleting files and never recorded
    as finished: ``scope`` is ``"checkpoint"`` or ``"hot-copy"``, ``files``
    how many files it was to delete (fewer listed now: it had started)."""

    checkpoint_id: int
    job: str
    step: int
    scope: str
    at: datetime | None
    files: int | None = None


@dataclass(frozen=True)
class LinkedFile:
    """A file of a standing checkpoint (not deleted, its hot copy present) that is
    a symlink: ``link`` is the key, in the same store, of the file it points at."""

    checkpoint_id: int
    job: str
    step: int
    location: str
    relpath: str
    link: str


@dataclass(frozen=True)
class EventRecord:
    """One line of the catalog's event log (newest first when listed)."""

    id: int
    at: datetime
    kind: str
    message: str
    job: str | None
    checkpoint_id: int | None
    data: Mapping[str, Any] | None


@dataclass(frozen=True)
class DrillRecord:
    """One restore drill. ``timings`` maps phase name to seconds;
    ``peak_memory_bytes`` is the drill process's peak; ``id`` is set on
    records read back from the catalog. ``outcome``: ``passed``,
    ``failed`` or ``not judged`` (None: by ``ok``, as rows written before
    outcomes were recorded); a drill that was not judged is history only,
    never a checkpoint's most recent drill. ``stack``: the versions it ran on."""

    job: str
    step: int | None
    checkpoint_id: int | None
    started_at: datetime
    finished_at: datetime | None
    ok: bool
    device: str | None
    source_tier: str | None
    verdict: Mapping[str, Any] = field(default_factory=dict)
    timings: Mapping[str, float] = field(default_factory=dict)
    peak_memory_bytes: int | None = None
    error: str | None = None
    id: int | None = None
    outcome: str | None = None
    stack: Mapping[str, Any] = field(default_factory=dict)

    @property
    def judged(self) -> bool:
        """Whether the drill judged the checkpoint (passed or failed)."""
        return self.outcome != NOT_JUDGED

    @property
    def verdict_name(self) -> str:
        """``passed``, ``failed`` or ``not judged``."""
        return self.outcome or ("passed" if self.ok else "failed")


@dataclass(frozen=True)
class RecoveryRecord:
    """One ``resume`` call (a recovery event): ``job`` as asked, when it
    started (``started_at``) and its wall-clock ``seconds``, ``outcome``
    (``resumed`` or ``failed``), the ``step`` and ``checkpoint_id`` chosen
    (None when it failed), how it was proven (``verify``: ``full`` or
    ``quick``), where it is loaded from (``source``: ``hot``, ``archive``,
    ``fetched``; ``path``), the newer checkpoints ``passed_over`` as
    ``(step, reason)`` pairs, newest first, and a failed call's ``error``.
    ``id`` is set on records read back."""

    job: str
    started_at: datetime
    seconds: float
    outcome: str
    verify: str
    step: int | None = None
    checkpoint_id: int | None = None
    source: str | None = None
    path: str | None = None
    passed_over: tuple[tuple[int, str], ...] = ()
    error: str | None = None
    id: int | None = None
