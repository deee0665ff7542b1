"""The catalog: what ckptier knows about every checkpoint, and the only way to change it.

``Catalog`` returns the plain domain types of :mod:`ckptier.storage.records`
(never ORM objects) and takes the current time as ``now`` (an aware UTC
datetime) wherever it writes a time; it never reads the clock.

Concurrency: every write is one transaction (``BEGIN IMMEDIATE`` on SQLite).
Leases (:meth:`Catalog.claim`) and fenced deletion (:meth:`Catalog.mark_deleted`)
are single conditional ``UPDATE`` statements, so two runs racing for the same
checkpoint see exactly one winner on SQLite and PostgreSQL alike.

This module is the package's public face: :class:`Catalog` is the
composition of one class per concern, each in its own module over
:class:`~ckptier.storage.catalog.core.CatalogCore` (the engine and the
transactions) and each implementing one narrow protocol of
:mod:`ckptier.storage.catalog.protocols`:

=====================  ==========================  ==================================
module                 class                       protocol
=====================  ==========================  ==================================
:mod:`.scans`          ``CatalogScans``            ``ScanCatalog``
:mod:`.queries`        ``CatalogQueries``          ``QueryCatalog``
:mod:`.verification`   ``CatalogVerification``     ``VerifyCatalog``
:mod:`.copies`         ``CatalogCopies``           ``CopyCatalog``
:mod:`.leases`         ``CatalogLeases``           ``RowClaimCatalog``
:mod:`.deletes`        ``CatalogDeletes``          ``TombstoneCatalog``
:mod:`.history`        ``CatalogHistory``          ``HistoryCatalog``
=====================  ==========================  ==================================

The record types (:mod:`.entries`) and constants are re-exported here, so
``from ckptier.storage.catalog.api import Catalog, DrillRecord, ...`` keeps
working (``FileCheck`` too, the :mod:`~ckptier.storage.records` type of a
read-back result); code that needs only one concern types its catalog by that
concern's protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..records import NOT_JUDGED, FileCheck
from .copies import CatalogCopies
from .core import COPY_STATES, DELETE_SCOPES, FILE_STATUSES
from .deletes import CatalogDeletes
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
    UnknownCheckpoint,
)
from .history import CatalogHistory
from .leases import CatalogLeases
from .queries import CatalogQueries
from .scans import FILE_ROWS_PER_INSERT, CatalogScans
from .verification import CatalogVerification

__all__ = [
    "COPY_STATES",
    "DELETE_SCOPES",
    "FILE_ROWS_PER_INSERT",
    "FILE_STATUSES",
    "NOT_JUDGED",
    "Catalog",
    "DeleteIntent",
    "DirStampRecord",
    "DrillRecord",
    "EventRecord",
    "FileCheck",
    "LeaseHolder",
    "LeaseLost",
    "LinkedFile",
    "ProcessId",
    "ReadBack",
    "RecoveryRecord",
    "ScanSummary",
    "UnknownCheckpoint",
]


class Catalog(
    CatalogScans,
    CatalogQueries,
    CatalogVerification,
    CatalogCopies,
    CatalogLeases,
    CatalogDeletes,
    CatalogHistory,
):
    """The catalog of jobs, checkpoints, files, copies, decisions, events and drills.

    Open with :meth:`Catalog.open`; safe to share between threads.
    """


if TYPE_CHECKING:
    from .protocols import (
        CopyCatalog,
        HistoryCatalog,
        QueryCatalog,
        RowClaimCatalog,
        ScanCatalog,
        TombstoneCatalog,
        VerifyCatalog,
    )

    def _implements(
        scans: CatalogScans,
        queries: CatalogQueries,
        verification: CatalogVerification,
        copies: CatalogCopies,
        leases: CatalogLeases,
        deletes: CatalogDeletes,
        history: CatalogHistory,
        catalog: Catalog,
    ) -> None:
        """Never called: mypy's proof that each concern implements its protocol
        and that :class:`Catalog` implements them all."""
        _scans: ScanCatalog = scans
        _queries: QueryCatalog = queries
        _verification: VerifyCatalog = verification
        _copies: CopyCatalog = copies
        _leases: RowClaimCatalog = leases
        _deletes: TombstoneCatalog = deletes
        _history: HistoryCatalog = history
        _all: tuple[ScanCatalog, QueryCatalog, VerifyCatalog, CopyCatalog, RowClaimCatalog, TombstoneCatalog,
                    HistoryCatalog] = (catalog, catalog, catalog, catalog, catalog, catalog, catalog)
