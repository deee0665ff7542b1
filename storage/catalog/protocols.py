"""The catalog's narrow protocols: one per concern, each implemented by the
concern's class (:mod:`.scans`, :mod:`.queries`, ...) and all of them by
:class:`~ckptier.storage.catalog.api.Catalog`.

Some concerns' protocols are compositions of smaller ones where an operation
needs only part of a concern (:class:`LeaseCatalog` of :class:`RowClaimCatalog`,
:class:`CheckpointReads` and :class:`LatestChoice` of :class:`QueryCatalog`,
:class:`SettleCatalog` and :class:`ProofCatalog` of :class:`VerifyCatalog`,
:class:`DeleteCatalog` of :class:`TombstoneCatalog`, :class:`DecisionLog` of
:class:`HistoryCatalog`): code elsewhere types its catalog by the narrowest one
it uses, or composes them (``ckptier.tasks.apply.ApplyCatalog``), so a
method's signature is written here once. The methods' contracts are the
docstrings of their implementations.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol

from .. import transitions
from ..records import CheckpointRecord, CopyState, DrillOutcome, FileCheck, Recognition, State, Tier

if TYPE_CHECKING:  # annotations only: the read-only commands import the protocols without the record types
    from .entries import (
        DeleteIntent,
        DirStampRecord,
        DrillRecord,
        EventRecord,
        LeaseHolder,
        LeaseLost,
        LinkedFile,
        ProcessId,
        ReadBack,
        RecoveryRecord,
        ScanSummary,
    )


class LeaseCatalog(Protocol):
    """A checkpoint's lease: claimed, renewed by a heartbeat, released, and who
    holds it (what :class:`ckptier.tasks.leases.LeaseKeeper` needs)."""

    def claim(self, checkpoint_id: int, owner: str, *, now: datetime, ttl: timedelta,
              process: ProcessId | None = ...,
              take_over: Callable[[LeaseHolder], bool] | None = ...) -> int | None: ...

    def renew(self, checkpoint_id: int, owner: str, generation: int, *, now: datetime,
              ttl: timedelta) -> datetime | None: ...

    def release(self, checkpoint_id: int, owner: str, generation: int) -> bool: ...

    def lease_holder(self, checkpoint_id: int, *, now: datetime) -> LeaseHolder | None: ...


class RowClaimCatalog(LeaseCatalog, Protocol):
    """The leases concern (:class:`~.leases.CatalogLeases`): a
    :class:`LeaseCatalog` that also claims rows in batches (what
    :meth:`ckptier.tasks.leases.LeaseKeeper.claim_rows` needs)."""

    def claim_rows(self, ids: Sequence[int], owner: str, *, now: datetime, ttl: timedelta, since: datetime,
                   limit: int, process: ProcessId | None = ...) -> list[tuple[int, int]]: ...


class CheckpointReads(Protocol):
    """The reads of checkpoints that tiering needs: by id, listed, and the
    symlinked files a delete must leave standing."""

    def get_by_id(self, checkpoint_id: int) -> CheckpointRecord | None: ...

    def checkpoints(self, *, job: str | None = ..., states: Iterable[State] | None = ...,
                    include_deleted: bool = ..., with_files: bool = ...) -> list[CheckpointRecord]: ...

    def links(self, scope: str) -> list[LinkedFile]: ...


class LatestChoice(Protocol):
    """The choice of the checkpoint to resume from."""

    def choose_latest(self, job: str, *, drilled: bool = ...,
                      exclude: Collection[int] = ...) -> transitions.Latest: ...


class QueryCatalog(CheckpointReads, LatestChoice, Protocol):
    """The reads concern (:class:`~.queries.CatalogQueries`): checkpoints,
    jobs, hot locations and the per-job summary."""

    def get(self, job: str, step: int) -> CheckpointRecord | None: ...

    def get_many(self, ids: Iterable[int]) -> list[CheckpointRecord]: ...

    def latest(self, job: str, *, drilled: bool = ...) -> CheckpointRecord | None: ...

    def file_counts(self, *, job: str | None = ...) -> dict[int, int]: ...

    def last_drills(self, *, job: str) -> dict[int, DrillOutcome]: ...

    def jobs(self) -> list[str]: ...

    def hot_locations(self) -> list[str]: ...

    def summary(self) -> list[dict[str, Any]]: ...


class ScanCatalog(Protocol):
    """The scans concern (:class:`~.scans.CatalogScans`): recording a listing
    and the directory stamps of local rescans."""

    def record_scan(self, store_url: str, recognition: Recognition, *, now: datetime, scope_prefix: str = ...,
                    unchanged: Collection[str] = ..., live: bool = ...,
                    grace_for: Callable[[str], timedelta] | None = ...) -> ScanSummary: ...

    def dir_stamps(self, scope: str) -> dict[str, DirStampRecord]: ...

    def put_dir_stamps(self, stamps: Mapping[str, tuple[str, Sequence[str]]], *, now: datetime) -> int: ...

    def drop_dir_stamps(self, locations: Collection[str]) -> None: ...


class SettleCatalog(Protocol):
    """Recording what a look at a checkpoint's files found (what
    :func:`ckptier.tasks.prove.settle` needs)."""

    def record_file_changes(self, checkpoint_id: int, changes: Sequence[transitions.Change], *,
                            now: datetime) -> State: ...


class ProofCatalog(SettleCatalog, Protocol):
    """A :class:`SettleCatalog` that also records one checkpoint's read-back."""

    def record_verification(self, checkpoint_id: int, results: Sequence[FileCheck], *, now: datetime,
                            grace: timedelta = ..., extra: Sequence[str] = ...,
                            claim: tuple[str, int] | None = ...) -> State: ...


class VerifyCatalog(ProofCatalog, Protocol):
    """The verification concern (:class:`~.verification.CatalogVerification`):
    read-backs recorded one or a batch at a time, and the claims of a
    verification sweep ended or counted."""

    def record_verifications(self, items: Sequence[ReadBack], *, now: datetime) -> list[State | LeaseLost]: ...

    def finish_claim(self, checkpoint_id: int, owner: str, generation: int, *, now: datetime) -> bool: ...

    def unchecked(self, ids: Sequence[int], *, since: datetime) -> int: ...


class CopyCatalog(Protocol):
    """The copies concern (:class:`~.copies.CatalogCopies`)."""

    def add_copy(self, checkpoint_id: int, *, tier: Tier, url: str, state: CopyState = ...,
                 stored_bytes: int | None, codec: str | None, manifest_key: str | None,
                 verified_at: datetime | None, now: datetime, storage_class: str | None = ...) -> None: ...

    def set_copy_state(self, checkpoint_id: int, *, tier: Tier, url: str, state: CopyState,
                       now: datetime) -> None: ...


class DeleteCatalog(Protocol):
    """Fenced deletion: delete intents and tombstones, each write fenced by a
    lease (what apply needs)."""

    def record_delete_intent(self, checkpoint_id: int, *, owner: str, generation: int, scope: str, files: int,
                             now: datetime) -> bool: ...

    def clear_delete_intent(self, checkpoint_id: int, *, owner: str, generation: int, now: datetime,
                            why: str) -> bool: ...

    def delete_intents(self, *, job: str | None = ...) -> list[DeleteIntent]: ...

    def mark_deleted(self, checkpoint_id: int, *, owner: str, generation: int, now: datetime,
                     reasons: Sequence[str]) -> bool: ...

    def mark_hot_copy_deleted(self, checkpoint_id: int, *, owner: str, generation: int, now: datetime,
                              reasons: Sequence[str]) -> bool: ...


class TombstoneCatalog(DeleteCatalog, Protocol):
    """The deletes concern (:class:`~.deletes.CatalogDeletes`): a
    :class:`DeleteCatalog` that also forgets checkpoints gone from every tier."""

    def forget(self, checkpoint_id: int, *, missing_since: datetime, now: datetime, reason: str) -> bool: ...


class DecisionLog(Protocol):
    """Appending retention decisions and events."""

    def record_decisions(self, rows: Sequence[tuple[int, str, Sequence[str]]], *, policy: str,
                         now: datetime) -> None: ...

    def log_event(self, kind: str, message: str, *, now: datetime, job: str | None = ...,
                  checkpoint_id: int | None = ..., data: Mapping[str, Any] | None = ...) -> None: ...


class HistoryCatalog(DecisionLog, Protocol):
    """The history concern (:class:`~.history.CatalogHistory`): decisions and
    events appended and listed, drills and recoveries recorded and listed."""

    def events(self, *, job: str | None = ..., kinds: Iterable[str] | None = ...,
               limit: int = ...) -> list[EventRecord]: ...

    def record_drill(self, drill: DrillRecord) -> int: ...

    def drills(self, *, job: str | None = ..., limit: int = ...) -> list[DrillRecord]: ...

    def record_recovery(self, recovery: RecoveryRecord) -> int: ...

    def recoveries(self, *, job: str | None = ..., since: datetime | None = ...,
                   limit: int | None = ...) -> list[RecoveryRecord]: ...
