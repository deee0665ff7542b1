"""Storage classes and archive tiers by age: names, order, S3's constraints.

Pure and dependency-free (retention, prices, costs and lifecycle rules all
import it). A *storage class* is where bytes are billed: ``"hot"`` for
local/POSIX storage (a training job's hot directory, a local archive) or one
of S3's classes. An :class:`ArchiveTier` says "archive copies older than
``after`` live in ``storage_class``": the policy key ``archive_tiers``
(``ckptier lifecycle`` turns it into S3 transitions; costs price archive
copies by it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from ckptier.storage.errors import ConfigError

if TYPE_CHECKING:  # annotations only: the command line's parser reads ALL_CLASSES without the records' imports
    from ckptier.storage.records import CheckpointRecord

#: Local/POSIX storage (priced as one class: ``[prices] hot``).
HOT = "hot"
#: S3's storage classes that lifecycle rules can move objects between,
#: warmest first: S3 transitions only go to the right (its "waterfall").
S3_CLASSES: tuple[str, ...] = (
    "STANDARD",
    "STANDARD_IA",
    "INTELLIGENT_TIERING",
    "ONEZONE_IA",
    "GLACIER_IR",
    "GLACIER",
    "DEEP_ARCHIVE",
)
#: The classes ckptier knows: local storage, then S3's lifecycle order.
ALL_CLASSES: tuple[str, ...] = (HOT, *S3_CLASSES)
#: Every class a price can be given for: the above and S3's other storage
#: classes (an archive's ``storage_class`` may name one).
PRICEABLE_CLASSES: tuple[str, ...] = (*ALL_CLASSES, "EXPRESS_ONEZONE", "REDUCED_REDUNDANCY", "OUTPOSTS", "SNOW")
#: S3 rejects a lifecycle transition into these classes before this many days
#: (S3 API reference, ``Transition.Days``), and an object must stay this long
#: in them before a later transition of the same rule.
IA_CLASSES = frozenset({"STANDARD_IA", "ONEZONE_IA"})
IA_MIN_DAYS = 30
#: Classes whose objects must be restored (RestoreObject, hours) before a GET.
NEEDS_RESTORE = frozenset({"GLACIER", "DEEP_ARCHIVE"})

_ORDER = {c: i for i, c in enumerate(S3_CLASSES)}


def hot_class_of(record: CheckpointRecord) -> str:
    """``STANDARD`` for a checkpoint on S3, ``hot`` for a local one."""
    return "STANDARD" if record.location.startswith("s3://") else HOT


def class_problem(name: object, *, allowed: Sequence[str] = S3_CLASSES) -> str | None:
    """Why ``name`` is not one of ``allowed`` storage classes, or None."""
    if isinstance(name, str) and name in allowed:
        return None
    return f"must be one of {', '.join(allowed)}"


def class_rank(name: str) -> int:
    """Sort key of a storage class: ``hot`` first, then S3's order, unknown names last."""
    return ALL_CLASSES.index(name) if name in ALL_CLASSES else len(ALL_CLASSES)


def is_colder(a: str, b: str) -> bool:
    """True when S3 class ``a`` comes after ``b`` in S3's transition order."""
    return _ORDER[a] > _ORDER[b]


@dataclass(frozen=True)
class ArchiveTier:
    """Archive copies older than ``after`` (whole days, > 0) live in ``storage_class``.

    Age counts from when the archive object was written (S3 counts lifecycle
    ages from object creation). ``storage_class`` is an S3 class other than
    ``STANDARD`` (nothing transitions *into* STANDARD).
    """

    after: timedelta
    storage_class: str

    def __post_init__(self) -> None:
        if self.after <= timedelta(0) or self.after % timedelta(days=1):
            raise ConfigError(f"archive tier after = {self.after}: must be a whole number of days > 0, e.g. '30d'")
        if (problem := class_problem(self.storage_class, allowed=S3_CLASSES[1:])) is not None:
            raise ConfigError(f"archive tier storage_class = {self.storage_class!r}: {problem}")

    @property
    def days(self) -> int:
        return self.after.days

    def __str__(self) -> str:
        return f"{self.storage_class} after {self.days}d"


def archive_tiers_problem(tiers: Sequence[ArchiveTier], initial: str | None) -> str | None:
    """Why ``tiers`` is not a usable sequence after archive copies written in
    class ``initial`` (None: STANDARD), or None.

    Each tier must come strictly later than the one before and move to a
    strictly colder class (S3 never moves objects back up). S3's own limits
    on *lifecycle* transitions (30 days before Standard-IA) are checked by
    :func:`lifecycle_problem`, not here.
    """
    start = initial or "STANDARD"
    if start not in _ORDER:
        return None  # the storage_class key reports its own problem
    prev_class, prev_after = start, timedelta(0)
    for i, t in enumerate(tiers):
        if t.after <= prev_after:
            return f"entry {i} ({t}) must come later than the one before ({prev_after.days}d)"
        if not is_colder(t.storage_class, prev_class):
            return (
                f"entry {i} ({t}) must move to a colder class than {prev_class} "
                f"(order: {' → '.join(S3_CLASSES)})"
            )
        prev_class, prev_after = t.storage_class, t.after
    return None


def lifecycle_problem(tiers: Sequence[ArchiveTier]) -> str | None:
    """Why S3 would reject ``tiers`` as the transitions of one lifecycle rule, or None.

    S3 refuses a transition into STANDARD_IA or ONEZONE_IA before 30 days,
    and a transition out of them less than 30 days after the one into them.
    """
    prev: ArchiveTier | None = None
    for t in tiers:
        if t.storage_class in IA_CLASSES and t.days < IA_MIN_DAYS:
            return (
                f"S3 lifecycle cannot move objects to {t.storage_class} before {IA_MIN_DAYS} days "
                f"(archive_tiers has {t}): set after = \"{IA_MIN_DAYS}d\" or later, or use GLACIER_IR"
            )
        if prev is not None and prev.storage_class in IA_CLASSES and t.days - prev.days < IA_MIN_DAYS:
            return (
                f"S3 lifecycle keeps objects {IA_MIN_DAYS} days in {prev.storage_class} before the next "
                f"transition (archive_tiers has {prev} then {t}): set the second after ≥ "
                f"\"{prev.days + IA_MIN_DAYS}d\""
            )
        prev = t
    return None


def class_at(age: timedelta, initial: str | None, tiers: Sequence[ArchiveTier]) -> str:
    """The S3 class of an archive object of this ``age`` written in ``initial``
    (None: STANDARD) under ``tiers`` (in order, as validated above)."""
    current = initial or "STANDARD"
    for t in tiers:
        if age >= t.after:
            current = t.storage_class
    return current
