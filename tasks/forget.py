"""Forget checkpoints that are gone for good: tombstones for rows whose files left every tier.

A trainer that rotates its own checkpoints (Hugging Face ``save_total_limit``,
Lightning ``save_top_k``) deletes most of a job behind ckptier's back. Scans
mark those rows missing, and the shrink guard then suspends every deletion
of the job, rightly: from the catalog alone a rotated checkpoint looks just
like a listing gone wrong. :func:`forget_candidates` picks the rows to look
at (pure); :func:`still_stored` looks at storage *now*, never trusting the
catalog's missing flag, and a row is tombstoned only when every place that
could hold its bytes (its hot location, each archive copy the catalog
records, the archive tier of its policy) answered that nothing is there.
An error while looking proves nothing, and the row stays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from datetime import datetime, timedelta

from ckptier.storage.base import Store, file_key, is_single_file
from ckptier.storage.errors import NotFound, StoreError
from ckptier.storage.records import CheckpointRecord, CopyState, State, Tier


def forget_candidates(
    records: Sequence[CheckpointRecord], *, now: datetime, older_than: timedelta | None = None
) -> list[CheckpointRecord]:
    """Live checkpoints a scan found missing from hot storage (``missing_since`` set),
    saved more than ``older_than`` before ``now`` when given; ordered by (job, step).

    Pure. Being a candidate proves nothing: storage is checked next.
    """
    cutoff = now - older_than if older_than is not None else None
    out = [
        c
        for c in records
        if c.state != State.DELETED
        and c.missing_since is not None
        and (cutoff is None or (c.saved_at or c.first_seen) <= cutoff)
    ]
    return sorted(out, key=lambda c: (c.job, c.step, c.id))


@dataclass(frozen=True)
class Lookup:
    """What storage holds of one checkpoint right now.

    ``present``: places (URLs) where some of its bytes still are;
    ``unknown``: places that could not be checked, with the error. Gone from
    every tier only when both are empty.
    """

    present: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()

    @property
    def gone(self) -> bool:
        return not self.present and not self.unknown


def _any_under(store: Store, prefix: str) -> str | None:
    """The first key below ``prefix/`` (a directory), or None; a missing root holds nothing."""
    try:
        for info in store.list(prefix.rstrip("/") + "/"):
            return info.key
    except NotFound:
        return None
    return None


def _exists(store: Store, key: str) -> bool:
    try:
        store.stat(key)
    except NotFound:
        return False
    return True


def still_stored(
    record: CheckpointRecord,
    *,
    hot: Callable[[CheckpointRecord], tuple[Store, str]],
    archives: Sequence[tuple[Store, str]],
) -> Lookup:
    """Look for ``record``'s bytes in every tier, now.

    ``hot(record)`` gives the hot store and the checkpoint's key prefix in it
    (its directory, or its file for a single-file checkpoint); ``archives``
    are ``(store, step directory key)`` pairs where an archive copy could be.
    A directory counts as present when anything at all is listed under it
    (a partial copy is not "gone"); a single file when ``stat`` finds it.
    Store errors other than :class:`NotFound` become ``unknown``.
    """
    present: list[str] = []
    unknown: list[str] = []

    def look(url: str, probe: Callable[[], bool | str | None]) -> None:
        try:
            if probe():
                present.append(url)
        except StoreError as exc:
            unknown.append(f"{url}: {exc}")

    try:
        store, prefix = hot(record)
    except StoreError as exc:
        unknown.append(f"{record.location}: {exc}")
    else:
        if record.files and is_single_file(prefix, record):
            look(record.location, lambda: _exists(store, file_key(prefix, record, record.files[0].relpath)))
        else:
            look(record.location, lambda: _any_under(store, prefix))
    for astore, adir in archives:
        look(f"{astore.url.rstrip('/')}/{adir}" if adir else astore.url, partial(_any_under, astore, adir))
    return Lookup(tuple(present), tuple(unknown))


def archive_places(record: CheckpointRecord) -> list[str]:
    """URLs of the archive copies the catalog records for ``record`` (any state but ``deleted``)."""
    return [c.url for c in record.copies if c.tier == Tier.ARCHIVE and c.state != CopyState.DELETED]
