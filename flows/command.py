"""What every ``ckptier`` command does first: decide its settings and open its catalog.

Shared by the command line (:mod:`ckptier.flows.cli`) and the command
modules it registers (:mod:`ckptier.flows.planning`): the settings in force
(:class:`~ckptier.tasks.settings.Settings`, from ``--catalog`` and
``--config``: the file read at most once per command), the first line of
human output that names the catalog, and the existing catalog opened
without creating it: the whole catalog, or (:func:`open_reading`, for the
commands that only read it) its reads and verification alone.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from ckptier.storage.catalog.api import Catalog
    from ckptier.storage.catalog.core import CatalogCore
    from ckptier.storage.catalog.db import CatalogLocation
    from ckptier.storage.catalog.reads import ReadCatalog
    from ckptier.tasks.settings import Settings


def settings_of(args: argparse.Namespace, *, config: bool = False) -> Settings:
    """The settings of this command: ``--catalog`` and ``--config``; ``ckptier.toml`` is read
    on first use, or now with ``config`` (a command that needs it reports a broken file
    before anything else, the catalog's name included)."""
    from ckptier.tasks.settings import Settings  # lazy: --version and --help answer without the catalog's imports

    settings = Settings(args.catalog, args.config)
    if config:
        settings.config  # noqa: B018 - read now, for the error's sake
    return settings


def announce(args: argparse.Namespace, location: CatalogLocation) -> None:
    """The first line of human output: which catalog (password masked) and why."""
    if not getattr(args, "json", False):
        print(f"catalog: {location}", flush=True)


def open_existing(args: argparse.Namespace, settings: Settings) -> Catalog:
    """The existing catalog ``settings`` name, announced first in human output (never created)."""
    from ckptier.storage.catalog.api import Catalog  # lazy: --version and --help answer without SQLAlchemy

    return _announced(args, settings, Catalog)


def open_reading(args: argparse.Namespace, settings: Settings) -> ReadCatalog:
    """The existing catalog ``settings`` name, as :func:`open_existing` opens it (announced, never
    created), composed of the reads and the verification concern only
    (:class:`~ckptier.storage.catalog.reads.ReadCatalog`): for ``ls`` and ``latest``, which import
    none of the writing concerns."""
    from ckptier.storage.catalog.reads import ReadCatalog  # lazy: as above; and not the whole Catalog

    return _announced(args, settings, ReadCatalog)


_C = TypeVar("_C", bound="CatalogCore")


def _announced(args: argparse.Namespace, settings: Settings, kind: type[_C]) -> _C:
    """The existing catalog ``settings`` name, opened as ``kind`` (never created), once
    :func:`announce` named it."""
    location = settings.location
    announce(args, location)
    return kind.open(location.url, create=False)
