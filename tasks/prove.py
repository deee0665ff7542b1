"""Prove now: is each file of a checkpoint still the file its verdict is about?

A verdict in the catalog (``verified``, ``corrupt``) is about bytes that were
read at some point; a file rewritten in place since (a job that re-saved the
same step and died, a save that completed after it was caught half-way)
changes no directory, so no rescan notices it. Before an answer that matters
trusts a verdict — ``latest``, ``fetch``, ``drill``, ``plan`` and ``apply``
for the checkpoints they rest on, and every delete — :func:`prove_now` looks
at each file with one ``stat`` (local: an ``fstatat`` below the scanned root
that follows no link) or one HEAD (S3), never a read, and compares size,
mtime, ETag and what the file is (a plain file, a link to the same key) with
the catalog (:func:`ckptier.storage.transitions.file_change`).

What a mismatch does to the checkpoint is one pure rule,
:func:`ckptier.storage.transitions.on_files_changed` (verified or corrupt ->
committed: verify again, in both directions); :func:`settle` records it.
:func:`prove_now` takes a record and returns a typed :class:`ProvenNow`:
the same function serves any command that must not resume from, restore,
drill or delete on a stale verdict.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Literal, Protocol

from ckptier.storage.base import LocalPaths, ObjectInfo, Store, file_key
from ckptier.storage.catalog.protocols import LatestChoice, SettleCatalog
from ckptier.storage.errors import CkptierError, NotFollowed, NotFound, StoreError
from ckptier.storage.records import CheckpointRecord, CopyState, State, Tier
from ckptier.storage.transitions import Change, Latest, file_change


__all__ = ["FileNow", "ProvenNow", "Verdict", "prove_now", "prove_record", "settle"]

#: ``intact``: every file is what the catalog holds; ``changed``: some file is
#: not (see :attr:`ProvenNow.changes`); ``vanished``: none of its files is there
#: at all (a copy deleted or moved away, an unmounted filesystem): not a change
#: of bytes, what a rescan settles (it marks the copy missing); ``unknown``: the
#: files could not be looked at (an unreachable store): nothing was learnt.
Verdict = Literal["intact", "changed", "vanished", "unknown"]

#: HEAD requests in flight at once for the files of one checkpoint on a remote store.
HEAD_WORKERS = 8


@dataclass(frozen=True)
class FileNow:
    """One cataloged file as it is now: its key, what a ``stat`` found there
    (``None``: nothing) and why that is not what the catalog holds (``None``:
    it is the same file)."""

    relpath: str
    key: str
    info: ObjectInfo | None
    change: str | None


@dataclass(frozen=True)
class ProvenNow:
    """:func:`prove_now`'s answer for ``record``: each file now, and the verdict."""

    record: CheckpointRecord
    files: tuple[FileNow, ...]
    verdict: Verdict
    #: Why the files could not be looked at (``verdict == "unknown"``).
    error: str | None = None

    @property
    def changes(self) -> list[Change]:
        """The files that are not what the catalog holds, as the transition rule takes them."""
        return [Change(f.relpath, f.change, f.info) for f in self.files if f.change is not None]

    @property
    def proven(self) -> list[ObjectInfo]:
        """What is there now of every file that is the one the catalog holds (with
        its identity: what :meth:`~ckptier.storage.base.ProvenDeletes.delete_proven` binds a delete to)."""
        return [f.info for f in self.files if f.change is None and f.info is not None]

    def describe(self) -> str:
        """One line: what changed, or why nothing could be told."""
        if self.verdict == "unknown":
            return f"could not look at its files: {self.error}"
        if self.verdict == "vanished":
            return "none of its files is there now (a rescan settles it)"
        changed = [c.why for c in self.changes]
        if not changed:
            return "every file is as cataloged"
        more = f" (+{len(changed) - 3} more)" if len(changed) > 3 else ""
        return "changed since its verdict: " + ", ".join(changed[:3]) + more


def prove_now(store: Store, prefix: str, record: CheckpointRecord) -> ProvenNow:
    """Look at every cataloged file of ``record`` under ``prefix`` in ``store``
    now — one ``stat`` each (HEADs a few at once on a remote store), never a
    read — and say whether each is the file the catalog holds.

    Never raises a storage error: a file that is gone is a change (unless the
    catalog already holds it as missing), but when none is there at all the
    verdict is ``vanished``; any other error makes it ``unknown`` with the
    error, since nothing was learnt.
    """

    def look(rel: str) -> tuple[str, ObjectInfo | None]:
        key = file_key(prefix, record, rel)
        try:
            return key, store.stat(key)
        except NotFollowed:
            raise  # a directory on the way is a link: nothing can be told
        except NotFound:
            return key, None

    rels = [f.relpath for f in record.files]
    try:
        if isinstance(store, LocalPaths) or len(rels) < 2:
            seen = [look(r) for r in rels]
        else:
            with ThreadPoolExecutor(max_workers=min(HEAD_WORKERS, len(rels))) as pool:
                seen = list(pool.map(look, rels))
    except (StoreError, OSError) as exc:
        return ProvenNow(record, (), "unknown", error=_one_line(exc))
    files = tuple(FileNow(f.relpath, key, info, file_change(f, info))
                  for f, (key, info) in zip(record.files, seen, strict=True))
    if files and all(f.info is None for f in files) and any(f.change is not None for f in files):
        return ProvenNow(record, files, "vanished")
    changed = any(f.change is not None for f in files)
    return ProvenNow(record, files, "changed" if changed else "intact")


def settle(catalog: SettleCatalog, proven: ProvenNow, *, now: datetime) -> State:
    """Record what :func:`prove_now` found (nothing when every file is as
    cataloged, or nothing could be told): the changed files' new size, mtime
    and link, and the checkpoint's move (verified or corrupt -> committed,
    :func:`~ckptier.storage.transitions.on_files_changed`). Returns the state."""
    if proven.verdict != "changed":
        return proven.record.state
    return catalog.record_file_changes(proven.record.id, proven.changes, now=now)


def _hot_present(record: CheckpointRecord) -> bool:
    return any(c.tier == Tier.HOT and c.state == CopyState.PRESENT and c.url == record.location
               for c in record.copies) or not record.copies


def prove_record(catalog: SettleCatalog, store_for: Callable[[CheckpointRecord], tuple[Store, str]],
                 record: CheckpointRecord, *, now: datetime) -> ProvenNow | None:
    """:func:`prove_now` on ``record``'s hot copy, settled in ``catalog``; None when
    it has no hot copy to look at (an archive copy is proven when it is read)
    or its store cannot be opened."""
    if not _hot_present(record) or not record.files:
        return None
    try:
        store, prefix = store_for(record)
    except CkptierError:
        return None
    proven = prove_now(store, prefix, record)
    settle(catalog, proven, now=now)
    return proven


class LatestCatalog(SettleCatalog, LatestChoice, Protocol):
    """What :func:`latest_proven` needs of the catalog: the choice of the latest
    checkpoint, and settling what a look at its files found."""


def latest_proven(catalog: LatestCatalog, store_for: Callable[[CheckpointRecord], tuple[Store, str]], job: str, *,
                  drilled: bool = False, now: Callable[[], datetime]) -> Latest:
    """The checkpoint of ``job`` to resume from
    (:meth:`~ckptier.storage.catalog.api.Catalog.choose_latest`), once its files
    were looked at now: one whose files changed since its verdict is settled
    (no longer verified) and passed over, naming what changed, and the next
    one is looked at."""
    passed: list[tuple[int, str]] = []
    while True:
        latest = catalog.choose_latest(job, drilled=drilled)
        if latest.record is None:
            return Latest(None, passed_over=tuple(passed) + latest.passed_over)
        proven = prove_record(catalog, store_for, latest.record, now=now())
        if proven is None or proven.verdict != "changed":
            return Latest(latest.record, latest.proof, latest.proven_at, tuple(passed) + latest.passed_over)
        passed.append((latest.record.step, f"{proven.describe()}; verify it again"))


def prove_all(catalog: SettleCatalog, store_for: Callable[[CheckpointRecord], tuple[Store, str]],
              records: Iterable[CheckpointRecord], *, now: Callable[[], datetime]) -> list[ProvenNow]:
    """:func:`prove_record` for each of ``records`` (those with a hot copy); what each found."""
    out: list[ProvenNow] = []
    for record in records:
        proven = prove_record(catalog, store_for, record, now=now())
        if proven is not None:
            out.append(proven)
    return out


def prove_keepers(catalog: SettleCatalog, store_for: Callable[[CheckpointRecord], tuple[Store, str]],
                  records: Sequence[CheckpointRecord], policy_for: Callable[[str], object | None], *,
                  now: Callable[[], datetime],
                  files_of: Callable[[CheckpointRecord], CheckpointRecord | None] | None = None) -> list[ProvenNow]:
    """Look now at the checkpoints a plan's deletions of each job rest on (the
    newest verified, the ``keep_last`` newest, the ``min_verified`` floor:
    :func:`ckptier.tasks.retention.keepers`), settling each whose files changed
    (it is then no longer verified, and the plan keeps the next ones instead).
    ``files_of``: ``records`` were read without their files; each chosen one is
    read again with them (a few rows, not every file of 100,000 checkpoints);
    None when it is gone."""

    from .retention import Policy, keepers  # lazy: `ckptier latest` proves without the retention rules (~10 ms)

    by_job: dict[str, list[CheckpointRecord]] = {}
    for r in records:
        by_job.setdefault(r.job, []).append(r)
    chosen: list[CheckpointRecord] = []
    for job, rs in sorted(by_job.items()):
        policy = policy_for(job)
        if isinstance(policy, Policy):
            chosen.extend(keepers(rs, policy, ()))
    if files_of is not None:
        chosen = [full for full in map(files_of, chosen) if full is not None]
    return prove_all(catalog, store_for, chosen, now=now)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
