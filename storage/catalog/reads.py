"""The catalog as the read-only commands open it: reading, and settling what a look at the files found.

:class:`ReadCatalog` is the composition of the two concerns ``ckptier ls`` and
``ckptier latest`` use, over the same
:class:`~ckptier.storage.catalog.core.CatalogCore` as
:class:`~ckptier.storage.catalog.api.Catalog`: :class:`~.queries.CatalogQueries`
(:class:`~ckptier.storage.catalog.protocols.QueryCatalog`) and
:class:`~.verification.CatalogVerification`
(:class:`~ckptier.storage.catalog.protocols.VerifyCatalog`, whose
``record_file_changes`` settles a file changed since its verdict, as
:func:`ckptier.tasks.prove.latest_proven` does). The methods are the same
objects as :class:`Catalog`'s, on the same engine and transactions: no second
query path. Importing this module loads neither the scan, copy, lease, delete
nor history concern, nor the catalog's record types (:mod:`.entries`) that
only those build, so a command that only reads starts faster.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .queries import CatalogQueries
from .verification import CatalogVerification

__all__ = ["ReadCatalog"]


class ReadCatalog(CatalogQueries, CatalogVerification):
    """The catalog's reads and its verification concern, nothing else.

    Open with :meth:`ReadCatalog.open` (``create=False`` for an existing
    catalog); safe to share between threads, as :class:`Catalog` is.
    """


if TYPE_CHECKING:
    from .protocols import QueryCatalog, VerifyCatalog

    def _implements(catalog: ReadCatalog) -> None:
        """Never called: mypy's proof that :class:`ReadCatalog` implements both concerns' protocols
        (and so ``ckptier.tasks.prove.LatestCatalog``, a composition of parts of them)."""
        _all: tuple[QueryCatalog, VerifyCatalog] = (catalog, catalog)
