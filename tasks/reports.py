"""What the Prefect flows report, as typed results; pure.

The flows only render these (markdown and table artifacts); every figure
they show is computed here, from catalog records and the operations' own
reports, so the command line, the flows and the tests agree on one number.

* :func:`summarize_jobs`: one row per job, checkpoints by state and bytes
  per tier (hot, archive stored and archive logical).
* :func:`forecast_freed`: the hot bytes a retention plan frees when it is
  carried out by ``ckptier apply`` (its deletions, then the hot copies of
  the milestones it promotes, which go in the same run).
* :func:`tiering_outcome`: what a tiering run did, per tier and storage
  class: copies written, hot copies deleted, bytes actually freed.
* :func:`file_problems` / :func:`verification_by_job`: every file a
  verification found bad, with the expected and the actual size and hashes,
  and the totals per job; :class:`VerifyReport`: what ``run_verify``
  returns (:class:`VerifyRow` rows, :class:`VerifyTotals`).
* :func:`dashboard_job_url`: the dashboard page of a job.
* :class:`FetchReport`, :class:`DrillReport`: what ``fetch`` and a restore
  drill did (``to_json()``: what ``--json`` prints).
* The operations' own results, kept here so that every module may hold
  them without importing the operation: :class:`ItemResult` and
  :class:`Proof` (:mod:`ckptier.tasks.apply`), :class:`Check` (a drill's
  verdict), :class:`JanitorReport` (:mod:`ckptier.tasks.archive`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Literal
from urllib.parse import quote

from ckptier.storage.records import CheckpointRecord, CopyRecord, CopyState, FileCheck, FileRecord, State, Tier

from .retention import Plan, hot_present
from .tiers import HOT, hot_class_of

# ------------------------------------------------------------------ results of the operations

#: What happened to a plan item (:class:`ItemResult`).
Outcome = Literal["done", "would", "skipped", "held", "failed", "partial", "fenced", "deferred"]


@dataclass(frozen=True)
class ItemResult:
    """What happened to one plan item.

    ``outcome``: ``done`` (carried out), ``would`` (dry run: would be carried
    out), ``skipped`` (nothing to do or no longer right: already done,
    precondition no longer true), ``held`` (another live run holds the
    checkpoint's lease; ``detail`` names it), ``deferred`` (waits for a later
    run: a promotion of the job failed, the canary failed, a keeper could not
    be proven), ``failed`` (an error), ``partial`` (some files deleted, the
    rest failed), ``fenced`` (the lease was lost: the catalog row was not
    changed). ``bytes`` is the checkpoint's size; ``freed`` the hot bytes
    actually deleted (0 on a versioned bucket that only got delete markers).
    """

    job: str
    step: int
    checkpoint_id: int
    action: str
    scope: str
    outcome: Outcome
    detail: str
    bytes: int = 0
    freed: int = 0


@dataclass(frozen=True)
class Proof:
    """One keeper proven again before deletions: which copy (``tier``),
    whether it held, and what it cost (bytes read; bytes proven by the
    store's own full-object checksum without reading)."""

    job: str
    step: int
    checkpoint_id: int
    tier: str
    ok: bool
    detail: str
    bytes_read: int = 0
    bytes_skipped: int = 0


@dataclass(frozen=True)
class Check:
    """One check of a drill's verdict: its ``name``, whether it passed, and why in words."""

    name: str
    ok: bool
    detail: str

    def to_json(self) -> dict[str, Any]:
        """``{"name", "ok", "detail"}``, as drill reports and the catalog's verdicts hold it."""
        return asdict(self)


PASSED, FAILED, NOT_JUDGED = "passed", "failed", "not judged"
"""The three outcomes of a drill."""

NOT_JUDGED_STAGES: Mapping[str, str] = {
    "no-model": "no drill model was given",
    "not-started": "the drill model does not load",
    "factory": "the drill model does not load",
    "fit": "the factory does not fit this job",
    "build": "the drill model could not be built",
    "unsupported": "this variant cannot be drilled yet",
    "setup": "the drill could not set up (no device, or its own setup failed)",
    "rendezvous": "the drill's ranks could not meet",
}
"""Stages at which a drill stops without judging the checkpoint, and why in words."""


def drill_outcome(ok: bool, stage: str | None) -> tuple[str, str]:
    """``(outcome, reason)`` of a drill that ended at ``stage`` (None: it ran
    to the verdict); pure.

    ``passed`` when every check passed. ``not judged`` when the drill
    stopped for a reason that is not the checkpoint's (:data:`NOT_JUDGED_STAGES`:
    no model given, a factory that does not load, build or fit, an
    unsupported variant, no device, the drill's own setup or rendezvous):
    recorded as history, never as the checkpoint's most recent drill.
    ``failed`` otherwise: the checkpoint did not fetch, load, restore or
    train, or a check of the verdict failed (``judge``), or the drill ran
    out of time or crashed while restoring or training.
    """
    if ok:
        return PASSED, "every check passed"
    if stage is not None and stage in NOT_JUDGED_STAGES:
        return NOT_JUDGED, NOT_JUDGED_STAGES[stage]
    what = {"fetch": "its files could not be fetched and verified", "load": "it does not load",
            "restore": "it does not restore", "train": "it does not train", "timeout": "the drill ran out of time",
            "crash": "the drill worker crashed"}.get(stage or "", "a check of the verdict failed")
    return FAILED, what


@dataclass
class JanitorReport:
    """What :func:`ckptier.tasks.archive.janitor` did to one archive tier.

    ``aborted_uploads``: (key, upload id) of multipart uploads aborted;
    ``removed_dirs``: uncommitted step directories whose every object was
    ckptier's own (named by their upload marker) and was removed;
    ``removed_keys``: the objects removed; ``young_dirs``: uncommitted
    directories left alone because they are newer than the threshold (a
    promotion may be running); ``failed``: key → reason for objects that
    could not be removed; ``unexpected``: directories the catalog records as
    archive copies that have lost their manifest (left alone: damage to look
    at, not debris); ``not_ours``: objects without a commit marker that no
    upload marker names — ckptier did not write them, so they are left
    where they are; ``removed_temp_files``: a local store's own
    ``.ckptier-tmp-*`` files left by interrupted writes.
    """

    aborted_uploads: list[tuple[str, str]] = field(default_factory=list)
    removed_dirs: list[str] = field(default_factory=list)
    removed_keys: list[str] = field(default_factory=list)
    young_dirs: list[str] = field(default_factory=list)
    committed_dirs: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    removed_temp_files: list[str] = field(default_factory=list)
    not_ours: list[str] = field(default_factory=list)


#: The environment variable naming the dashboard's base URL (``ckptier dashboard``).
DASHBOARD_URL_ENV = "CKPTIER_DASHBOARD_URL"


# ------------------------------------------------------------------ catalog summary


@dataclass(frozen=True)
class JobSummary:
    """One job of the catalog.

    ``checkpoints``: live checkpoints (every state but ``deleted``) and
    ``states`` their count per state; ``deleted``: tombstones.
    ``hot_bytes``: the size of the live checkpoints that still have a hot
    copy (``hot_checkpoints`` of them). ``archive_stored_bytes``: what their
    archive copies occupy (compressed, as stored); ``archive_logical_bytes``:
    the size of the checkpoints those copies hold (``archive_checkpoints``).
    Degraded archive copies count (they still take space);
    ``archive_degraded`` says how many there are.
    """

    job: str
    checkpoints: int
    states: Mapping[str, int]
    deleted: int
    newest_verified_step: int | None
    hot_checkpoints: int
    hot_bytes: int
    archive_checkpoints: int
    archive_stored_bytes: int
    archive_logical_bytes: int
    archive_degraded: int


def summarize_jobs(records: Iterable[CheckpointRecord]) -> list[JobSummary]:
    """One :class:`JobSummary` per job of ``records`` (tombstones included or not), sorted by job name."""
    by_job: dict[str, list[CheckpointRecord]] = {}
    for c in records:
        by_job.setdefault(c.job, []).append(c)
    out = []
    for job in sorted(by_job):
        live = [c for c in by_job[job] if c.state != State.DELETED]
        states: dict[str, int] = {}
        for c in live:
            states[c.state.value] = states.get(c.state.value, 0) + 1
        hot = [c for c in live if hot_present(c)]
        archived = [(c, copy) for c in live if (copy := c.archive_copy()) is not None]
        verified = [c.step for c in live if c.state == State.VERIFIED]
        out.append(JobSummary(
            job=job, checkpoints=len(live), states=dict(sorted(states.items())), deleted=len(by_job[job]) - len(live),
            newest_verified_step=max(verified) if verified else None,
            hot_checkpoints=len(hot), hot_bytes=sum(c.bytes for c in hot),
            archive_checkpoints=len(archived),
            archive_stored_bytes=sum(copy.stored_bytes or 0 for _, copy in archived),
            archive_logical_bytes=sum(c.bytes for c, _ in archived),
            archive_degraded=sum(1 for _, copy in archived if copy.state == "degraded"),
        ))
    return out


# ------------------------------------------------------------------ what a plan frees


@dataclass(frozen=True)
class FreedForecast:
    """The hot bytes carrying out a retention plan frees (``ckptier apply``, the tiering flow with ``apply``).

    ``hot_bytes``: the size of the planned checkpoints that have a hot copy
    now. ``deleted_bytes``: what the plan's deletions free.
    ``after_promotion_bytes``: the hot copies of milestones the plan
    promotes that the same run then deletes (once their archive copy is
    verified, the plan made anew lets them go). Only hot bytes: retention
    never deletes archive copies.
    """

    hot_bytes: int
    deleted_bytes: int
    after_promotion_bytes: int

    @property
    def freed_bytes(self) -> int:
        """Hot bytes freed in all: ``deleted_bytes + after_promotion_bytes``."""
        return self.deleted_bytes + self.after_promotion_bytes

    def __add__(self, other: FreedForecast) -> FreedForecast:
        return FreedForecast(self.hot_bytes + other.hot_bytes, self.deleted_bytes + other.deleted_bytes,
                             self.after_promotion_bytes + other.after_promotion_bytes)


NOTHING_FREED = FreedForecast(0, 0, 0)


def hot_bytes(records: Iterable[CheckpointRecord]) -> int:
    """The size of the live checkpoints among ``records`` that have a hot copy."""
    return sum(c.bytes for c in records if c.state != State.DELETED and hot_present(c))


def forecast_freed(records: Sequence[CheckpointRecord], plan: Callable[[Sequence[CheckpointRecord]], Plan], *,
                   now: datetime, first: Plan | None = None) -> FreedForecast:
    """What carrying out ``plan(records)`` frees, as ``ckptier apply`` carries it out.

    ``records``: one policy's checkpoints (tombstones may be among them) and
    ``plan`` that policy's planner. Apply deletes what the plan deletes, and
    when it promoted something, plans again from the catalog and deletes
    what that second plan deletes: here the second plan sees every promoted
    milestone with a verified archive copy (written ``now``) and every
    deleted hot copy gone. Assumes every step succeeds. ``first``:
    ``plan(records)`` when the caller already has it.
    """
    first = plan(records) if first is None else first
    held = hot_bytes(records)
    deleted = {i.checkpoint_id: i for i in first.items if i.action == "delete"}
    promoted = {i.checkpoint_id for i in first.items if i.action == "promote"}
    deleted_bytes = sum(i.bytes for i in deleted.values())
    if not promoted:
        return FreedForecast(held, deleted_bytes, 0)
    after: list[CheckpointRecord] = []
    for c in records:
        if c.id in deleted and deleted[c.id].scope == "checkpoint":
            c = dataclasses.replace(c, state=State.DELETED)
        elif c.id in deleted:
            c = dataclasses.replace(c, copies=c.copies + (CopyRecord(Tier.HOT, c.location, CopyState.DELETED, None, None),))
        elif c.id in promoted:
            copy = CopyRecord(Tier.ARCHIVE, f"forecast:{c.job}/{c.step}", CopyState.PRESENT, None, now)
            c = dataclasses.replace(c, copies=c.copies + (copy,))
        after.append(c)
    then = sum(i.bytes for i in plan(after).items if i.action == "delete" and i.checkpoint_id not in deleted)
    return FreedForecast(held, deleted_bytes, then)


# ------------------------------------------------------------------ what tiering did


def copy_class(copy: CopyRecord) -> str:
    """A copy's storage class as the store confirmed it; ``STANDARD`` for an S3 copy
    with none recorded (S3's default), ``hot`` for one on a local filesystem."""
    if copy.storage_class:
        return copy.storage_class
    return "STANDARD" if copy.url.startswith("s3://") else HOT


@dataclass(frozen=True)
class TierChange:
    """What a tiering run changed in one tier and storage class.

    ``written``: copies written there (promotions), ``written_bytes`` what
    they occupy as stored and ``logical_bytes`` the size of the checkpoints
    they hold; ``deleted``: copies deleted there and ``freed_bytes`` the
    bytes that deleting them actually freed (0 for files a versioned bucket
    kept behind delete markers).
    """

    tier: str
    storage_class: str
    written: int = 0
    written_bytes: int = 0
    logical_bytes: int = 0
    deleted: int = 0
    freed_bytes: int = 0


@dataclass(frozen=True)
class Promoted:
    """A checkpoint promoted by the run: its archive copy, where and in which class."""

    job: str
    step: int
    bytes: int
    stored_bytes: int | None
    storage_class: str
    url: str


@dataclass(frozen=True)
class Deleted:
    """A checkpoint (``scope == "checkpoint"``) or hot copy (``"hot-copy"``) the run deleted."""

    job: str
    step: int
    scope: str
    bytes: int
    freed_bytes: int
    storage_class: str


@dataclass(frozen=True)
class TieringOutcome:
    """What a tiering run did (never what it would do): per tier and class, and per checkpoint."""

    tiers: tuple[TierChange, ...]
    promoted: tuple[Promoted, ...]
    deleted: tuple[Deleted, ...]

    @property
    def hot_freed_bytes(self) -> int:
        return sum(t.freed_bytes for t in self.tiers if t.tier == Tier.HOT.value)


def tiering_outcome(items: Iterable[ItemResult], records: Mapping[int, CheckpointRecord]) -> TieringOutcome:
    """Summarise ``ckptier apply``'s item results that were carried out.

    ``records`` maps checkpoint ids to their catalog records read after the
    run (their archive copies say where a promotion went). Items that were
    not carried out (would, skipped, held, deferred, failed) are left out;
    a ``partial`` deletion counts the bytes it freed.
    """
    promoted: list[Promoted] = []
    deleted: list[Deleted] = []
    for item in items:
        record = records.get(item.checkpoint_id)
        if item.action == "promote" and item.outcome == "done" and record is not None:
            copy = record.archive_copy()
            if copy is not None:
                promoted.append(Promoted(item.job, item.step, record.bytes, copy.stored_bytes, copy_class(copy),
                                         copy.url))
        elif item.action == "delete" and item.outcome in ("done", "partial", "fenced") and item.freed:
            where = hot_class_of(record) if record is not None else HOT
            deleted.append(Deleted(item.job, item.step, item.scope, item.bytes, item.freed, where))
    changes: dict[tuple[str, str], TierChange] = {}
    for p in promoted:
        key = (Tier.ARCHIVE.value, p.storage_class)
        t = changes.get(key, TierChange(*key))
        changes[key] = dataclasses.replace(t, written=t.written + 1, written_bytes=t.written_bytes + (p.stored_bytes or 0),
                                           logical_bytes=t.logical_bytes + p.bytes)
    for d in deleted:
        key = (Tier.HOT.value, d.storage_class)
        t = changes.get(key, TierChange(*key))
        changes[key] = dataclasses.replace(t, deleted=t.deleted + 1, freed_bytes=t.freed_bytes + d.freed_bytes)
    return TieringOutcome(tuple(changes[k] for k in sorted(changes)), tuple(promoted), tuple(deleted))


# ------------------------------------------------------------------ what apply, janitor and forget did


@dataclass(frozen=True)
class ApplyRunReport:
    """What ``ckptier apply`` (:func:`ckptier.tasks.pipeline.run_apply`) did or, in a dry run, would do.

    ``items``: one result per plan item acted on, in the order they were
    handled (``keep`` items skipped are left out); ``lines``: the run in
    words (per item, per policy, canary failures, keepers that failed their
    proof); ``bytes_freed``: hot bytes actually deleted; ``failed``: True
    when any item failed (re-running resumes); ``held``: one line per item
    another live run holds, naming it; ``proofs``: every copy proven again
    before a deletion; ``outcome``: what was carried out, per tier and
    storage class (empty in a dry run).
    """

    dry_run: bool
    items: tuple[ItemResult, ...]
    lines: tuple[str, ...]
    bytes_freed: int
    failed: bool
    held: tuple[str, ...]
    proofs: tuple[Proof, ...]
    outcome: TieringOutcome

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready values (``apply --json``, artifacts); ``outcome`` adds ``hot_freed_bytes``."""
        return {"dry_run": self.dry_run, "items": [dataclasses.asdict(i) for i in self.items], "lines": list(self.lines),
                "bytes_freed": self.bytes_freed, "failed": self.failed, "held": list(self.held),
                "proofs": [dataclasses.asdict(p) for p in self.proofs],
                "outcome": {**dataclasses.asdict(self.outcome), "hot_freed_bytes": self.outcome.hot_freed_bytes}}


@dataclass(frozen=True)
class JanitorRunReport:
    """What ``ckptier janitor`` (:func:`ckptier.tasks.pipeline.run_janitor`) did.

    ``archives``: each archive tier a policy names (its URL, sorted) and
    what was cleaned there (:class:`ckptier.tasks.archive.JanitorReport`);
    ``lines``: the run in words.
    """

    archives: Mapping[str, JanitorReport]
    lines: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready values (``janitor --json``)."""
        return {"archives": {url: dataclasses.asdict(r) for url, r in self.archives.items()}, "lines": list(self.lines)}


ForgetOutcome = Literal["forgotten", "would forget", "kept", "unchecked"]


@dataclass(frozen=True)
class ForgetRow:
    """One row ``ckptier forget`` looked at: ``forgotten`` (tombstoned), ``would forget``
    (dry run), ``kept`` (still stored somewhere, or changed meanwhile) or ``unchecked``
    (a tier could not be checked); ``detail`` says why."""

    job: str
    step: int
    outcome: ForgetOutcome
    detail: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ForgetReport:
    """What ``ckptier forget`` (:func:`ckptier.tasks.pipeline.run_forget`) did for ``job``.

    ``rows``: every candidate in catalog order; ``lines``: the run in words,
    the last one the counts; ``forgotten``, ``kept``, ``unchecked``: rows
    per outcome (a dry run's ``would forget`` rows are in ``rows`` only).
    """

    job: str
    dry_run: bool
    rows: tuple[ForgetRow, ...]
    lines: tuple[str, ...]
    forgotten: int
    kept: int
    unchecked: int

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready values (``forget --json``)."""
        return {"job": self.job, "dry_run": self.dry_run, "rows": [r.to_json() for r in self.rows],
                "lines": list(self.lines), "forgotten": self.forgotten, "kept": self.kept, "unchecked": self.unchecked}


# ------------------------------------------------------------------ verification


@dataclass(frozen=True)
class FileProblem:
    """One file a verification found bad: what the catalog expected and what was read.

    Sizes in bytes; ``sha256`` as hex, ``crc64nvme`` as base64 (S3's
    encoding). ``expected_sha256`` is the checkpoint's own record of it (a
    format's metadata), ``expected_crc64nvme`` the baseline of the first
    verification; ``None`` where nothing was recorded or nothing could be
    read.
    """

    relpath: str
    status: str
    expected_size: int | None
    actual_size: int | None
    expected_sha256: str | None
    actual_sha256: str | None
    expected_crc64nvme: str | None
    actual_crc64nvme: str | None
    detail: str | None


def file_problems(files: Sequence[FileRecord], results: Iterable[FileCheck]) -> list[FileProblem]:
    """The results that are not ``ok``, each with the catalog's expectations for its file, in result order."""
    known = {f.relpath: f for f in files}
    out = []
    for r in results:
        if r.status == "ok":
            continue
        f = known.get(r.relpath)
        out.append(FileProblem(
            relpath=r.relpath, status=r.status, expected_size=f.size if f else None, actual_size=r.size,
            expected_sha256=f.sha256_expected if f else None, actual_sha256=r.sha256,
            expected_crc64nvme=f.crc64nvme if f else None, actual_crc64nvme=r.crc64nvme, detail=r.detail,
        ))
    return out


def archive_file_problems(files: Sequence[FileRecord], bad: Iterable[str]) -> list[FileProblem]:
    """The files of a damaged archive copy, with the catalog's expectations (what was
    decoded is in the copy's problem lines)."""
    known = {f.relpath: f for f in files}
    return [FileProblem(rel, "degraded", known[rel].size if rel in known else None, None,
                        known[rel].sha256_expected if rel in known else None, None,
                        known[rel].crc64nvme if rel in known else None, None, None) for rel in bad]


@dataclass(frozen=True)
class JobVerification:
    """One job's line of a verification run: checkpoints checked and their outcome, bytes read and skipped."""

    job: str
    checked: int
    verified: int
    corrupt: int
    degraded: int
    errors: int
    bytes_read: int
    bytes_skipped: int


def verification_by_job(rows: Iterable[VerifyRow]) -> list[JobVerification]:
    """Totals per job of ``run_verify``'s rows (hot checkpoints and archive copies), sorted by job."""
    acc: dict[str, dict[str, int]] = {}
    for r in rows:
        j = acc.setdefault(r.job, dict.fromkeys(("checked", "verified", "corrupt", "degraded", "errors",
                                                  "bytes_read", "bytes_skipped"), 0))
        j["checked"] += 1
        j["verified"] += r.state == "verified"
        j["corrupt"] += r.state == "corrupt"
        j["degraded"] += r.state == "degraded"
        j["errors"] += r.errors > 0
        j["bytes_read"] += r.bytes_read
        j["bytes_skipped"] += r.bytes_skipped
    return [JobVerification(job, **acc[job]) for job in sorted(acc)]


@dataclass(frozen=True)
class VerifyRow:
    """One row of a verification run: a checkpoint's hot copy (``tier`` ``"hot"``)
    or its archive copy read back (``"archive"``).

    ``state``: for a hot copy, the checkpoint's state the check recorded
    (``verified``, ``corrupt``, ``incomplete``...); for an archive copy,
    ``verified`` or ``degraded``. ``bytes_read``: bytes read; ``bytes_skipped``:
    bytes proven by the store's own checksum instead (0 for an archive copy).
    ``errors``: files that could not be read; ``extra``: files the catalog
    does not know (hot copies only). ``detail``: the first problems in one
    line, None when there are none. ``files``: every file found bad, with the
    expected and the actual size and hashes. ``problems``: an archive copy's
    damaged files, one line each; None for a hot copy (and left out of its JSON).
    """

    job: str
    step: int
    tier: str
    state: str
    bytes_read: int
    bytes_skipped: int
    errors: int
    extra: tuple[str, ...]
    detail: str | None
    files: tuple[FileProblem, ...]
    problems: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        """The row as ``verify --json`` prints it (``problems`` only for an archive copy)."""
        out: dict[str, Any] = {
            "job": self.job, "step": self.step, "tier": self.tier, "state": self.state,
            "bytes_read": self.bytes_read, "bytes_skipped": self.bytes_skipped, "errors": self.errors,
            "extra": list(self.extra), "detail": self.detail, "files": [dataclasses.asdict(f) for f in self.files],
        }
        if self.problems is not None:
            out["problems"] = list(self.problems)
        return out


@dataclass(frozen=True)
class VerifyTotals:
    """The totals of a verification run (:meth:`of` its rows).

    Hot copies: ``checked``, and of those ``verified``, ``corrupt``,
    ``incomplete`` (the states the check recorded) and ``errors`` (with at
    least one file that could not be read). Archive copies:
    ``archive_checked`` read back, ``archive_degraded`` found damaged.
    ``bytes_read``: bytes read from both tiers; ``bytes_skipped``: hot bytes
    proven by the store's own checksum instead of read.
    """

    checked: int = 0
    verified: int = 0
    corrupt: int = 0
    incomplete: int = 0
    errors: int = 0
    bytes_read: int = 0
    bytes_skipped: int = 0
    archive_checked: int = 0
    archive_degraded: int = 0

    @classmethod
    def of(cls, rows: Iterable[VerifyRow]) -> VerifyTotals:
        """The totals of ``rows`` (hot and archive rows, in any order)."""
        every = list(rows)
        hot_rows = [r for r in every if r.tier != Tier.ARCHIVE.value]
        archive_rows = [r for r in every if r.tier == Tier.ARCHIVE.value]
        return cls(
            checked=len(hot_rows),
            verified=sum(r.state == State.VERIFIED.value for r in hot_rows),
            corrupt=sum(r.state == State.CORRUPT.value for r in hot_rows),
            incomplete=sum(r.state == State.INCOMPLETE.value for r in hot_rows),
            errors=sum(r.errors > 0 for r in hot_rows),
            bytes_read=sum(r.bytes_read for r in every),
            bytes_skipped=sum(r.bytes_skipped for r in hot_rows),
            archive_checked=len(archive_rows),
            archive_degraded=sum(r.state == CopyState.DEGRADED.value for r in archive_rows),
        )

    @property
    def found_damage(self) -> bool:
        """Whether the run found a corrupt checkpoint or a degraded archive copy."""
        return bool(self.corrupt or self.archive_degraded)

    def to_json(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class VerifyReport:
    """What a verification run (``pipeline.run_verify``) checked and found.

    ``checkpoints``: one row per hot copy checked, in the order they were
    recorded, then one per archive copy read back; ``totals`` their totals;
    ``sample``: the ``(k, n)`` slice verified, None for a whole run;
    ``by_job``: the totals per job (:func:`verification_by_job`), filled in
    by the Prefect verify task (None: not computed, and left out of the JSON);
    ``nothing_checked``: why the run read no copy at all, in words (None when
    it read one; what ``verify`` prints instead of a table, not in the JSON).
    """

    checkpoints: tuple[VerifyRow, ...]
    totals: VerifyTotals
    sample: tuple[int, int] | None = None
    by_job: tuple[JobVerification, ...] | None = None
    nothing_checked: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The report as ``verify --json`` prints it and the verify flow returned it."""
        out: dict[str, Any] = {
            "checkpoints": [r.to_json() for r in self.checkpoints], "totals": self.totals.to_json(),
            "sample": f"{self.sample[0]}/{self.sample[1]}" if self.sample else None,
        }
        if self.by_job is not None:
            out["by_job"] = [dataclasses.asdict(j) for j in self.by_job]
        return out


# ------------------------------------------------------------------ links


def dashboard_url(environ: Mapping[str, str]) -> str | None:
    """The dashboard's overview, ``{CKPTIER_DASHBOARD_URL}/``, or None when the variable is unset."""
    base = (environ.get(DASHBOARD_URL_ENV) or "").strip()
    return base.rstrip("/") + "/" if base else None


def dashboard_job_url(job: str, environ: Mapping[str, str]) -> str | None:
    """``{CKPTIER_DASHBOARD_URL}/jobs/{job}`` (the job name URL-quoted), or None when the variable is unset."""
    base = dashboard_url(environ)
    return None if base is None else base + "jobs/" + quote(job, safe="")


# ------------------------------------------------------------------ fetch and drill


@dataclass(frozen=True)
class FetchReport:
    """What ``ckptier fetch`` restored: ``job`` step ``step``'s original files,
    read from ``tier`` (``hot`` or ``archive``) at ``source`` and written,
    hashes verified, under ``dest``: ``files`` of them, ``bytes`` in all, in
    ``seconds`` (wall clock, rounded to the millisecond). ``notes``: why a
    preferred tier was skipped (the hot copy failed its hash check, say)."""

    job: str
    step: int
    tier: str
    source: str
    dest: str
    files: int
    bytes: int
    seconds: float
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The report as ``fetch --json`` prints it (notes as a list)."""
        return {"job": self.job, "step": self.step, "tier": self.tier, "source": self.source, "dest": self.dest,
                "files": self.files, "bytes": self.bytes, "seconds": self.seconds, "notes": list(self.notes)}


@dataclass(frozen=True)
class DrillRank:
    """One rank of a multi-rank drill: whether it finished (``ok``; else its
    ``error`` and the ``stage`` it failed at), its ``losses`` (None for a
    non-finite one), the ``files`` its scratch held (``held_bytes`` on disk,
    ``needed_bytes`` the byte ranges it reads), when it finished its first
    training step (``first_step_done_at``, seconds since the epoch), its
    ``peak_memory_bytes`` and whether its writes were ``confined``."""

    rank: int
    ok: bool
    error: str | None
    stage: str | None
    losses: tuple[float | None, ...]
    files: tuple[str, ...]
    held_bytes: int
    needed_bytes: int
    first_step_done_at: float | None
    peak_memory_bytes: int | None
    confined: bool

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "ok": self.ok, "error": self.error, "stage": self.stage, "losses": list(self.losses),
                "files": list(self.files), "held_bytes": self.held_bytes, "needed_bytes": self.needed_bytes,
                "first_step_done_at": self.first_step_done_at, "peak_memory_bytes": self.peak_memory_bytes,
                "confined": self.confined}


@dataclass(frozen=True)
class Reshard:
    """A resharding drill: restored from ``from_world`` saved ranks into
    ``to_world``; whether the run ``resumes`` there (``detail`` says why),
    and the losses of the same-size restore it was compared with
    (``reference_losses``, rank 0's)."""

    from_world: int
    to_world: int
    resumes: bool
    detail: str | None
    reference_losses: tuple[float | None, ...]

    def to_json(self) -> dict[str, Any]:
        return {"from": self.from_world, "to": self.to_world, "resumes": self.resumes, "detail": self.detail,
                "reference_losses": list(self.reference_losses)}


#: The keys of a drill report's JSON, in order, for each kind of report (see :meth:`DrillReport.to_json`).
_DRILL_KEYS = {
    "worker": ("job", "step", "ok", "verdict", "summary", "checks", "trained_steps", "device", "tier", "timings",
               "peak_memory_bytes", "losses", "error", "stage", "confined", "confinement", "stack", "started_at",
               "finished_at"),
    "failure": ("job", "step", "ok", "verdict", "stage", "error", "summary", "checks", "timings", "device", "tier",
                "peak_memory_bytes", "losses", "started_at", "finished_at"),
    "not-started": ("job", "step", "ok", "verdict", "stage", "error", "summary", "recorded", "checks", "timings",
                    "device", "tier", "peak_memory_bytes", "losses", "started_at", "finished_at"),
    "ranked": ("job", "step", "ok", "verdict", "summary", "checks", "trained_steps", "world_size", "saved_world_size",
               "layout", "parallel", "backend", "device", "ranks", "timings", "losses", "peak_memory_bytes", "confined",
               "confinement", "tier", "error", "stage", "reshard", "stack", "started_at", "finished_at"),
}


@dataclass(frozen=True)
class DrillReport:
    """One restore drill of ``job`` step ``step``, whatever its outcome.

    ``ok`` only when every check of the verdict passed; ``summary`` is one
    line, ``checks`` the verdict's checks in order. ``stage``: where it
    failed (``fetch``, ``load``, ``restore``, ``train``, ``judge``...; None
    when it passed), ``unsupported`` for ranks that cannot be drilled yet,
    ``not-started`` when the model factory did not load (the operator's
    error: then ``recorded`` is False, nothing was recorded against the
    checkpoint and no other candidate was tried); ``error`` its message.
    ``device``/``tier``: where it ran and the tier the files came from (None
    when nothing ran); ``timings`` in seconds per phase; ``losses`` the
    training losses from the restored state (None for a non-finite one);
    ``peak_memory_bytes``. ``confined``: whether the worker's writes were
    confined (``confinement`` says how or why not); None when no worker ran.
    ``started_at``/``finished_at``: aware UTC. ``trained_steps``: the first
    and last step trained (``(21, 30)`` for 10 steps from step 20; None
    when none was); ``stack``: the versions the workers ran on (python,
    torch, CUDA, the format's libraries). :attr:`outcome` is ``passed``,
    ``failed`` or ``not judged`` (the JSON's ``verdict``). ``drift``: set
    when the checkpoint passed an earlier drill under another stack (the
    versions that changed, :mod:`ckptier.tasks.drill_history`).
    ``device_note``: set when a GPU was expected and the drill ran on CPU
    instead (``[[drill]] require_gpu = false``); the summary ends with it too.

    A multi-rank drill also has ``world_size`` (the ranks it restored into),
    ``saved_world_size``, ``layout`` (``replicated``, ``sharded``),
    ``parallel`` (``ddp``, ``fsdp2``, ``none``), ``backend``, one
    :class:`DrillRank` per rank, and ``reshard`` when it restored into
    another number of ranks than saved the checkpoint; a single-rank drill
    has None there.
    """

    job: str
    step: int
    ok: bool
    summary: str
    checks: tuple[Check, ...]
    started_at: datetime
    finished_at: datetime
    stage: str | None = None
    error: str | None = None
    device: str | None = None
    tier: str | None = None
    timings: Mapping[str, float] = dataclasses.field(default_factory=dict)
    peak_memory_bytes: int | None = None
    losses: tuple[float | None, ...] = ()
    confined: bool | None = None
    confinement: str | None = None
    recorded: bool = True
    world_size: int | None = None
    saved_world_size: int | None = None
    layout: str | None = None
    parallel: str | None = None
    backend: str | None = None
    ranks: tuple[DrillRank, ...] = ()
    reshard: Reshard | None = None
    trained_steps: tuple[int, int] | None = None
    stack: Mapping[str, str | None] = dataclasses.field(default_factory=dict)
    drift: str | None = None
    device_note: str | None = None

    @property
    def outcome(self) -> str:
        """``passed``, ``failed`` or ``not judged`` (:func:`drill_outcome`)."""
        return drill_outcome(self.ok, self.stage)[0]

    @property
    def judged(self) -> bool:
        """Whether the drill judged the checkpoint (``not judged`` never counts as its most recent drill)."""
        return self.outcome != "not judged"

    @property
    def started(self) -> bool:
        """Whether the drill started (False: ``not-started``, the reason is not the checkpoint's)."""
        return self.stage != "not-started"

    @property
    def multi_rank(self) -> bool:
        """Whether several workers drilled it (its multi-rank fields are set)."""
        return self.world_size is not None

    def to_json(self) -> dict[str, Any]:
        """The report as ``drill --json`` prints it (times as ISO 8601 strings).

        Its keys depend on what happened, as they always have: a drill whose
        worker ran has ``confined`` and ``confinement``; one that failed
        before (a fetch, unsupported ranks) has neither; a drill that did not
        start has ``recorded`` (False); a multi-rank one has its multi-rank
        fields, ``reshard`` only when it resharded.
        """
        kind = ("ranked" if self.multi_rank else "not-started" if not self.recorded
                else "failure" if self.confined is None else "worker")
        values: dict[str, Any] = {
            "job": self.job, "step": self.step, "ok": self.ok, "verdict": self.outcome, "summary": self.summary,
            "trained_steps": list(self.trained_steps) if self.trained_steps is not None else None,
            "stack": dict(self.stack),
            "checks": [c.to_json() for c in self.checks], "device": self.device, "tier": self.tier,
            "timings": dict(self.timings), "peak_memory_bytes": self.peak_memory_bytes, "losses": list(self.losses),
            "error": self.error, "stage": self.stage, "confined": self.confined, "confinement": self.confinement,
            "recorded": self.recorded, "world_size": self.world_size, "saved_world_size": self.saved_world_size,
            "layout": self.layout, "parallel": self.parallel, "backend": self.backend,
            "ranks": [r.to_json() for r in self.ranks],
            "reshard": self.reshard.to_json() if self.reshard is not None else None,
            "started_at": self.started_at.isoformat(), "finished_at": self.finished_at.isoformat(),
        }
        out = {k: values[k] for k in _DRILL_KEYS[kind] if k != "reshard" or self.reshard is not None}
        if self.drift is not None:
            out["drift"] = self.drift
        if self.device_note is not None:
            out["device_note"] = self.device_note
        return out

    def verdict_json(self) -> dict[str, Any]:
        """What the catalog keeps of the verdict (``DrillRecord.verdict``): summary, checks, losses,
        confinement and, for a multi-rank drill, its multi-rank fields but the ranks."""
        out: dict[str, Any] = {"summary": self.summary, "checks": [c.to_json() for c in self.checks],
                               "losses": list(self.losses), "confinement": self.confinement}
        if self.trained_steps is not None:
            out["trained_steps"] = list(self.trained_steps)
        if self.drift is not None:
            out["drift"] = self.drift
        if self.multi_rank:
            out.update(world_size=self.world_size, saved_world_size=self.saved_world_size, layout=self.layout,
                       parallel=self.parallel, backend=self.backend)
            if self.reshard is not None:
                out["reshard"] = self.reshard.to_json()
        return out
