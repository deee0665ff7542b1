"""Domain types shared by format recognition, the catalog and the tasks.

Plain frozen dataclasses: no I/O, no ORM. The catalog converts its rows into
:class:`CheckpointRecord`; pure cores (retention, verification planning,
drill choice) take these records as input.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import Any, Literal


def slot_setters(cls: type, names: tuple[str, ...]) -> tuple[Callable[[Any, Any], None], ...]:
    """The slot descriptors' setters of the frozen slots dataclass ``cls``, one
    per field, for a constructor of the few records made once per listed file.

    A frozen dataclass's ``__init__`` sets each field through
    ``object.__setattr__`` (about 0.7 µs for six fields); ``object.__new__``
    and these setters take about 0.4 µs, which a first scan of a million
    files saves twice per file. ``names`` must be exactly the fields of
    ``cls`` in order, or this raises at import time: a field added later
    cannot be left unset by such a constructor.
    """
    fields = tuple(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    if fields != names:
        raise TypeError(f"{cls.__name__} has the fields {fields}, not {names}; update its fast constructor")
    return tuple(cls.__dict__[name].__set__ for name in names)


class State(enum.StrEnum):
    """Lifecycle of a checkpoint in the catalog.

    ``incomplete``: files seen but the format's commit evidence is missing (a
    save in flight, or a torn one). ``committed``: commit evidence present,
    bytes not yet proven. ``verified``: every file's bytes matched.
    ``corrupt``: a file is missing, truncated or has the wrong hash; kept as
    evidence, never auto-deleted. ``deleted``: removed by ckptier on purpose
    (a tombstone).
    """

    INCOMPLETE = "incomplete"
    COMMITTED = "committed"
    VERIFIED = "verified"
    CORRUPT = "corrupt"
    DELETED = "deleted"


class Format(enum.StrEnum):
    """Checkpoint layouts ckptier recognises: each has its plug-in in :mod:`ckptier.formats`."""

    GUIDE = "guide"  # {job}/step-{step:08d}/rank-{rank:04d}/*.pt + metadata.json
    DCP = "dcp"  # torch.distributed.checkpoint: *.distcp + .metadata
    HF = "hf-trainer"  # checkpoint-{N}/ + trainer_state.json
    LIGHTNING = "lightning"  # epoch=E-step=S.ckpt
    PATTERN = "pattern"  # user-configured pattern + settle time
    DEEPSPEED = "deepspeed"  # global_step{N}/mp_rank_*_model_states.pt + the latest tag
    MEGATRON = "megatron"  # iter_{N:07d}/mp_rank_*/model_optim_rng.pt or torch_dist + the tracker
    HF_WEIGHTS = "hf-weights"  # model-0000k-of-0000n.safetensors + model.safetensors.index.json
    ORBAX = "orbax"  # {step}/_CHECKPOINT_METADATA or commit_success.txt (JAX)


class Tier(enum.StrEnum):
    HOT = "hot"
    ARCHIVE = "archive"


class CopyState(enum.StrEnum):
    """Where one copy of a checkpoint (in one tier, at one URL) stands; stored as its value.

    ``present``: its bytes are there, as far as the last scan, promotion or
    proof knows. ``missing``: a scan no longer lists the hot copy (it may
    come back; a forgotten checkpoint's copies end here too). ``deleted``:
    ckptier removed it on purpose. ``degraded``: an archive copy whose
    read-back failed its proof; its bytes are still there (kept as evidence),
    but nothing relies on it.
    """

    PRESENT = "present"
    MISSING = "missing"
    DELETED = "deleted"
    DEGRADED = "degraded"


#: Copy states whose bytes are still stored (a tier "holds" the checkpoint).
HELD_COPY_STATES = frozenset({CopyState.PRESENT, CopyState.DEGRADED})


@dataclass(frozen=True, slots=True)
class FileRef:
    """One file of a checkpoint as storage lists it.

    ``key`` is relative to the store root; ``relpath`` is relative to the
    checkpoint's ``prefix`` (for single-file formats, the file name).
    ``link``: the file is a symlink to the regular file of this key (inside
    the store's root; size and mtime are that file's).
    """

    key: str
    relpath: str
    size: int
    mtime: float | None = None
    etag: str | None = None
    checksum: str | None = None
    link: str | None = None


_REF_KEY, _REF_RELPATH, _REF_SIZE, _REF_MTIME, _REF_ETAG, _REF_CHECKSUM, _REF_LINK = slot_setters(
    FileRef, ("key", "relpath", "size", "mtime", "etag", "checksum", "link"))
_new = object.__new__


def file_ref(key: str, relpath: str, size: int, mtime: float | None, etag: str | None,
             checksum: str | None, link: str | None = None) -> FileRef:
    """``FileRef(key, relpath, size, mtime, etag, checksum, link)``, built without
    the dataclass ``__init__`` (:func:`slot_setters`): recognition makes one
    per file of every checkpoint it finds."""
    ref = _new(FileRef)
    _REF_KEY(ref, key)
    _REF_RELPATH(ref, relpath)
    _REF_SIZE(ref, size)
    _REF_MTIME(ref, mtime)
    _REF_ETAG(ref, etag)
    _REF_CHECKSUM(ref, checksum)
    _REF_LINK(ref, link)
    return ref


@dataclass(frozen=True, slots=True)
class Shortfall:
    """A file that a checkpoint's own manifest requires and storage does not satisfy.

    ``manifest`` names the file that requires it (``metadata.json``,
    ``.metadata``, ``model.safetensors.index.json``...). ``have`` is the
    size found in bytes, ``None`` when the file is absent. ``need`` is the
    size the manifest requires in bytes (``None``: presence only); with
    ``exact`` the manifest records the exact size, otherwise ``need`` is a
    minimum (the largest offset + length it references). A ``relpath``
    ending in ``/`` is a directory that must hold at least one file (a rank
    the manifest's ``world_size`` implies).
    """

    relpath: str
    manifest: str
    have: int | None = None
    need: int | None = None
    exact: bool = False

    def __str__(self) -> str:
        if self.have is None:
            return f"{self.relpath} (absent, listed in {self.manifest})"
        if self.exact:
            return f"{self.relpath} ({self.have} bytes, {self.manifest} says {self.need})"
        return f"{self.relpath} ({self.have} bytes, {self.manifest} needs at least {self.need})"


@dataclass(frozen=True)
class Found:
    """A checkpoint recognised in a listing.

    ``prefix`` is the key prefix (directory) holding the checkpoint, relative
    to the store root; for single-file formats it is the file's key.
    ``committed`` says whether the format's commit evidence is present and
    ``reason`` says what that evidence is, or what is missing.
    ``expected_sha256`` maps relpath to a hex digest when the format records
    expected hashes (the guide's metadata.json). ``recorded_loss`` is the
    training loss the checkpoint's own metadata recorded, if any.
    ``shortfalls`` lists the files the checkpoint's own manifest requires
    that the listing does not satisfy (absent, or fewer bytes than it
    says); a committed checkpoint with shortfalls is not complete.
    ``metrics``: what the run recorded about this checkpoint (name -> finite
    number: ``eval_loss``, ``val_acc``...), from its own files or the job's
    ``metrics.jsonl``, for ``keep_best``.
    """

    job: str
    step: int
    format: Format
    prefix: str
    files: tuple[FileRef, ...]
    committed: bool
    reason: str
    expected_sha256: Mapping[str, str] = field(default_factory=dict)
    recorded_loss: float | None = None
    shortfalls: tuple[Shortfall, ...] = ()
    metrics: Mapping[str, float] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def saved_at(self) -> float | None:
        """Newest mtime among the files (epoch seconds), if known."""
        times = [f.mtime for f in self.files if f.mtime is not None]
        return max(times) if times else None


#: At most this many metrics are kept per checkpoint (the first by name), names at most
#: :data:`MAX_METRIC_NAME` characters: a run's bookkeeping cannot bloat the catalog.
MAX_METRICS = 64
MAX_METRIC_NAME = 128


def clean_metrics(values: Mapping[Any, Any]) -> dict[str, float]:
    """The usable part of ``values``: string names (not empty, at most
    :data:`MAX_METRIC_NAME` characters) with finite numbers (booleans are not
    numbers), at most :data:`MAX_METRICS` of them, the first by name. Pure."""
    out: dict[str, float] = {}
    for name in sorted(k for k in values if isinstance(k, str) and 0 < len(k) <= MAX_METRIC_NAME):
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        number = float(value)
        if number == number and number not in (float("inf"), float("-inf")):
            out[name] = number
        if len(out) == MAX_METRICS:
            break
    return out


def metrics_to_json(values: Mapping[str, float]) -> str | None:
    """The catalog's text of a checkpoint's metrics (sorted by name), or None for none."""
    return json.dumps(dict(sorted(values.items())), separators=(",", ":")) if values else None


def metrics_from_json(text: str | None) -> tuple[tuple[str, float], ...]:
    """:attr:`CheckpointRecord.metrics` from the catalog's text; () for none or unreadable text."""
    if not text:
        return ()
    try:
        data = json.loads(text)
    except ValueError:
        return ()
    return tuple(clean_metrics(data).items()) if isinstance(data, dict) else ()


@dataclass(frozen=True, slots=True)
class Unrecognised:
    """A key (or prefix) that no format claimed, and why."""

    key: str
    reason: str


@dataclass(frozen=True)
class Recognition:
    """Everything format recognition made of one listing.

    ``job_metrics``: job -> step -> metrics, from each job's ``metrics.jsonl``
    (already merged into the found checkpoints' ``metrics``); the catalog also
    applies them to cataloged checkpoints the scan did not list again.
    ``archive_objects`` counts the archive copies' data objects (``*.ckz``) it
    saw and never claimed, ``archive_example`` names one: the listing is of an
    archive.
    """

    checkpoints: tuple[Found, ...]
    unrecognised: tuple[Unrecognised, ...]
    objects: int
    job_metrics: Mapping[str, Mapping[int, Mapping[str, float]]] = field(default_factory=dict)
    archive_objects: int = 0
    archive_example: str | None = None


@dataclass(frozen=True)
class FileRecord:
    """A file of a cataloged checkpoint. ``link``: it is a symlink to the
    regular file of this key, inside the scanned root (its bytes are read
    there, by that key; deleting it removes the link only); ``None`` for a
    plain file."""

    relpath: str
    size: int
    mtime: float | None
    etag: str | None
    crc64nvme: str | None  # base64, recorded by the first verification
    sha256_expected: str | None  # hex, from the format's own metadata
    status: str | None  # None (never verified), "ok", "corrupt", "error"
    detail: str | None
    link: str | None = None


@dataclass(frozen=True)
class CopyRecord:
    """Where a checkpoint's bytes live (see :class:`CopyState`). ``storage_class``:
    the S3 storage class the copy's objects were confirmed in (``None``
    where the store has none, or it was not recorded)."""

    tier: Tier
    url: str
    state: CopyState
    stored_bytes: int | None
    verified_at: datetime | None
    codec: str | None = None
    storage_class: str | None = None


#: The outcome of a drill that could not judge the checkpoint.
NOT_JUDGED = "not judged"


@dataclass(frozen=True)
class DrillOutcome:
    """The most recent restore drill of a checkpoint: whether it passed,
    when it finished (aware UTC; the start time when it never finished), and
    in one line why it failed (``None`` when it passed)."""

    ok: bool
    at: datetime
    detail: str | None = None


@dataclass(frozen=True)
class CheckpointRecord:
    """The catalog's view of one checkpoint (the input of pure decisions).

    Times are timezone-aware UTC. ``saved_at`` is when the save finished as
    far as storage tells (newest file mtime); ``missing_since`` is set when a
    scan no longer found it in the hot store. ``last_drill`` is its most
    recent restore drill, if any. ``metrics``: the numbers the run recorded
    about it (``(name, value)`` pairs sorted by name, finite values only;
    see :meth:`metric`), read at scan time.
    """

    id: int
    job: str
    step: int
    format: Format
    state: State
    location: str  # URL of the checkpoint in the hot store (dir or file)
    bytes: int
    saved_at: datetime | None
    first_seen: datetime
    last_seen: datetime
    missing_since: datetime | None
    verified_at: datetime | None
    state_reason: str | None
    recorded_loss: float | None = None
    generation: int = 0
    files: tuple[FileRecord, ...] = ()
    copies: tuple[CopyRecord, ...] = ()
    last_drill: DrillOutcome | None = None
    metrics: tuple[tuple[str, float], ...] = ()

    def metric(self, name: str) -> float | None:
        """The recorded value of the metric ``name``, or None when the run recorded none."""
        for key, value in self.metrics:
            if key == name:
                return value
        return None

    @cached_property
    def tiers(self) -> tuple[str, ...]:
        """Tiers holding a present (or degraded) copy, hot first (worked out once per record:
        listings and plans ask it several times of each of 100,000 records)."""
        present = {c.tier for c in self.copies if c.state in HELD_COPY_STATES}
        return tuple(t.value for t in (Tier.HOT, Tier.ARCHIVE) if t in present)

    def archive_copy(self) -> CopyRecord | None:
        """The archive copy still held (present or degraded), if any."""
        return next((c for c in self.copies if c.tier == Tier.ARCHIVE and c.state in HELD_COPY_STATES), None)

    def has_verified_archive(self) -> bool:
        return any(
            c.tier == Tier.ARCHIVE and c.state == CopyState.PRESENT and c.verified_at is not None
            for c in self.copies
        )


FileStatus = Literal["ok", "corrupt", "missing", "error"]


@dataclass(frozen=True, slots=True)
class FileCheck:
    """The verification result of one file (what ``Catalog.record_verification`` takes).

    ``status``: ``ok`` (bytes match every expectation, or became the
    baseline), ``corrupt`` (wrong size or hash), ``missing`` (not in the
    store), ``error`` (could not be read: permissions, outage; proves
    nothing either way). ``size``, ``crc64nvme`` (S3's base64) and
    ``sha256`` (hex) are what was observed; on ``ok`` ``crc64nvme`` is the
    baseline to record. ``detail`` is a one-line explanation, expected vs
    actual where it applies. ``shortfall`` is set when the file is
    ``missing`` or ``corrupt`` only because a manifest of the checkpoint
    requires it (absent, or too few bytes): a save may still be in flight,
    so the verdict waits for the job's grace period.
    """

    relpath: str
    status: FileStatus
    size: int | None = None
    crc64nvme: str | None = None
    sha256: str | None = None
    detail: str | None = None
    shortfall: Shortfall | None = None


@dataclass(slots=True)
class DeleteResult:
    """Outcome of :meth:`ckptier.storage.base.Store.delete_many` (and
    :meth:`~ckptier.storage.base.ProvenDeletes.delete_proven`).

    ``deleted`` holds only keys whose deletion the store confirmed (a key that
    was already absent counts as deleted: deletes are idempotent). ``failed``
    maps each key the store refused to its reason. ``markers_only`` lists
    deleted keys for which a versioned bucket only added a delete marker, so
    no space was freed. ``shared`` lists deleted keys whose bytes another
    name still holds (a hard link: the file had more than one link; a
    symlink, whose target stays), so deleting them freed nothing.
    ``changed`` maps each key :meth:`~ckptier.storage.base.ProvenDeletes.delete_proven` did not
    delete because what is there now is not the object that was proven, to
    what it found (a rescan decides again).
    """

    deleted: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    markers_only: list[str] = field(default_factory=list)
    shared: list[str] = field(default_factory=list)
    changed: dict[str, str] = field(default_factory=dict)

    def merge(self, other: DeleteResult) -> None:
        self.deleted.extend(other.deleted)
        self.failed.update(other.failed)
        self.markers_only.extend(other.markers_only)
        self.shared.extend(other.shared)
        self.changed.update(other.changed)
