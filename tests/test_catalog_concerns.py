"""``Catalog`` is the composition of one class per concern, each exactly its
narrow protocol (:mod:`ckptier.storage.catalog.protocols`); the protocols the
operations type their catalog by are compositions of those, never a method
written twice. (mypy checks the signatures: ``storage/catalog/api.py``.)"""

from __future__ import annotations

import inspect
from typing import Protocol

import pytest

from ckptier.storage.catalog import protocols
from ckptier.storage.catalog.api import Catalog
from ckptier.storage.catalog.copies import CatalogCopies
from ckptier.storage.catalog.core import CatalogCore
from ckptier.storage.catalog.deletes import CatalogDeletes
from ckptier.storage.catalog.history import CatalogHistory
from ckptier.storage.catalog.leases import CatalogLeases
from ckptier.storage.catalog.queries import CatalogQueries
from ckptier.storage.catalog.scans import CatalogScans
from ckptier.storage.catalog.verification import CatalogVerification

CONCERNS = [
    (CatalogScans, protocols.ScanCatalog),
    (CatalogQueries, protocols.QueryCatalog),
    (CatalogVerification, protocols.VerifyCatalog),
    (CatalogCopies, protocols.CopyCatalog),
    (CatalogLeases, protocols.RowClaimCatalog),
    (CatalogDeletes, protocols.TombstoneCatalog),
    (CatalogHistory, protocols.HistoryCatalog),
]


def _public(cls: type) -> set[str]:
    return {name for name in vars(cls) if not name.startswith("_")}


def _members(proto: type) -> set[str]:
    return set().union(*(_public(k) for k in proto.__mro__ if k not in (Protocol, object) and Protocol in k.__mro__))


@pytest.mark.parametrize(("concern", "proto"), CONCERNS, ids=lambda c: c.__name__)
def test_each_concern_is_exactly_its_protocol(concern: type, proto: type) -> None:
    assert concern.__bases__ == (CatalogCore,)
    assert _public(concern) == _members(proto)
    for name in _members(proto):
        assert list(inspect.signature(getattr(proto, name)).parameters) == \
            list(inspect.signature(getattr(concern, name)).parameters), name


def test_the_catalog_is_the_concerns_and_no_method_is_in_two() -> None:
    seen: dict[str, str] = {}
    for concern, _ in CONCERNS:
        for name in vars(concern):
            if callable(vars(concern)[name]) or isinstance(vars(concern)[name], (staticmethod, property)):
                assert name not in seen, f"{name} in {seen.get(name)} and {concern.__name__}"
                seen[name] = concern.__name__
    assert Catalog.__bases__ == tuple(c for c, _ in CONCERNS)
    public_of_catalog = {n for n in dir(Catalog) if not n.startswith("_")}
    assert public_of_catalog == set().union(*(_public(c) for c, _ in CONCERNS)) | _public(CatalogCore)


def test_the_read_catalog_is_the_read_and_verification_concerns() -> None:
    """What ``ls`` and ``latest`` open: the same methods as :class:`Catalog`'s, of two concerns only."""
    from ckptier.storage.catalog.reads import ReadCatalog

    assert ReadCatalog.__bases__ == (CatalogQueries, CatalogVerification)
    for name in _public(CatalogQueries) | _public(CatalogVerification):
        assert getattr(ReadCatalog, name) is getattr(Catalog, name), name
    assert {n for n in dir(ReadCatalog) if not n.startswith("_")} == \
        _public(CatalogQueries) | _public(CatalogVerification) | _public(CatalogCore)


def test_no_protocol_method_is_declared_twice() -> None:
    declared: dict[str, str] = {}
    for name, proto in vars(protocols).items():
        if isinstance(proto, type) and Protocol in proto.__mro__ and proto is not Protocol \
                and proto.__module__ == protocols.__name__:
            for method in _public(proto):
                assert method not in declared, f"{method} in {declared.get(method)} and {name}"
                declared[method] = name


def test_the_operations_protocols_are_compositions_of_the_catalogs() -> None:
    from ckptier.tasks import apply, leases, prove

    assert leases.LeaseCatalog is protocols.LeaseCatalog and leases.RowClaimCatalog is protocols.RowClaimCatalog
    assert prove.SettleCatalog is protocols.SettleCatalog
    for composed in (apply.ApplyCatalog, prove.LatestCatalog):
        assert _public(composed) == set(), composed.__name__
        assert all(base.__module__ == protocols.__name__ for base in composed.__bases__ if base is not Protocol)
    assert _members(apply.ApplyCatalog) == {
        "claim", "renew", "release", "lease_holder", "get_by_id", "checkpoints", "links", "add_copy",
        "set_copy_state", "record_decisions", "log_event", "record_verification", "record_file_changes",
        "record_delete_intent", "clear_delete_intent", "delete_intents", "mark_deleted", "mark_hot_copy_deleted",
    }
