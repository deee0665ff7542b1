"""Which settings are in force, and where they came from.

* The catalog: :func:`catalog_location` applies the one precedence every
  command and flow uses (``--catalog`` or a flow's ``catalog_url``, then
  ``CKPTIER_CATALOG_URL``, then ``[catalog] url`` in ``ckptier.toml``, then
  the default); the decision itself is
  :func:`ckptier.storage.catalog.db.resolve_catalog_url`.
* The retention policy: ``plan`` may preview under the built-in default, but
  ``apply`` deletes only under a ``[[policy]]`` the user wrote
  (:func:`require_written_policy`).
* A run: :func:`open_run` is the one place that puts together what an
  operation works with (:class:`Run`: the open catalog, the config, the
  store cache, the clock, the owner, dry-run) and hands it down.

No Prefect, no torch; the config file is read only when it is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from ckptier.storage.catalog.db import CatalogLocation, resolve_catalog_url
from ckptier.storage.errors import ConfigError

if TYPE_CHECKING:
    from ckptier.storage.catalog.api import Catalog

    from .config import Config
    from .pipeline import StoreCache

#: What to write when there is no policy to apply (shown in one line).
POLICY_EXAMPLE = '[[policy]] with jobs = "*" and keep_last = 5 (plus milestones = "log" and archive = "..." to keep milestones)'


def catalog_location(
    explicit: str | None, config_path: str | Path | None = None, *, config: Config | None = None
) -> CatalogLocation:
    """The catalog to open and why (see the module docstring).

    ``config`` is an already-loaded ``ckptier.toml``; otherwise the file at
    ``config_path`` (default ``$CKPTIER_CONFIG``, else ``./ckptier.toml``) is
    read only when neither ``explicit`` nor ``CKPTIER_CATALOG_URL`` is set.
    Raises :class:`ConfigError` when that file is needed and is broken.
    """

    def from_file() -> tuple[str | None, str | None]:
        from .config import load_config  # only when the file decides: ls and latest stay light

        cfg = config if config is not None else load_config(config_path)
        return cfg.catalog_url, str(cfg.source) if cfg.source is not None else None

    return resolve_catalog_url(explicit, config_url=from_file)


def catalog_url(explicit: str | None, config_path: str | Path | None = None, *, config: Config | None = None) -> str:
    """:func:`catalog_location`'s URL."""
    return catalog_location(explicit, config_path, config=config).url


def config_file_name(config: Config, config_path: str | Path | None = None) -> str:
    """The file a config came from, or (when there is none) where one was looked for, in words."""
    from .config import DEFAULT_FILE, ENV_VAR

    if config.source is not None:
        return str(config.source)
    return str(config_path) if config_path else f"./{DEFAULT_FILE} (and ${ENV_VAR} is unset)"


def policy_origin(config: Config, index: int, config_path: str | Path | None = None) -> str:
    """Where ``config.policies[index]`` comes from, in words, for ``plan``'s header."""
    policy = config.policies[index]
    if config.source is None:
        return f"built-in default, preview only (no {config_file_name(config, config_path)}): {policy}"
    if index in config.unwritten:
        return f"built-in default, preview only ({_why_unwritten(config, index)}): {policy}"
    return f"policy[{index}] (jobs = {policy.jobs!r}) in {config.source}: {policy}"


def _why_unwritten(config: Config, index: int) -> str:
    if config.source is None:
        return "there is no ckptier.toml"
    if len(config.unwritten) == len(config.policies):
        return f"{config.source} has no [[policy]] with a retention rule"
    return f"policy[{index}] (jobs = {config.policies[index].jobs!r}) in {config.source} sets no retention rule"


def unwritten_policy_problem(config: Config, jobs: Iterable[str], config_path: str | Path | None = None) -> str | None:
    """Why ``apply`` must not delete for ``jobs``, or None; pure.

    A job whose first matching policy is one of ``config.unwritten`` (the
    built-in default, or a table with no rule) stops the run; a job no
    policy matches is kept whole and needs nothing.
    """
    names = sorted(set(jobs))
    blocked = [j for j in names if (i := _policy_index(config, j)) is not None and i in config.unwritten]
    if not blocked:
        return None
    what = ", ".join(repr(j) for j in blocked[:3]) + (f" and {len(blocked) - 3} more" if len(blocked) > 3 else "")
    index = _policy_index(config, blocked[0])
    assert index is not None
    where = (f"there is no {config_file_name(config, config_path)}" if config.source is None
             else _why_unwritten(config, index))
    return (f"apply deletes only under a retention policy you wrote, and {where} (job {what}); "
            f"add {POLICY_EXAMPLE} to ckptier.toml, preview it with 'ckptier plan', then apply")


def _policy_index(config: Config, job: str) -> int | None:
    policy = config.policy_for(job)
    if policy is None:
        return None
    for i, p in enumerate(config.policies):
        if p is policy:
            return i
    return None  # pragma: no cover - policy_for returns one of config.policies


class NoPolicyWritten(ConfigError):
    """``apply`` was asked to delete under a policy nobody wrote."""


def require_written_policy(config: Config, jobs: Iterable[str], config_path: str | Path | None = None) -> None:
    """Raise :class:`NoPolicyWritten` (one line, with how to write one) when
    :func:`unwritten_policy_problem` finds a reason."""
    problem = unwritten_policy_problem(config, jobs, config_path)
    if problem is not None:
        raise NoPolicyWritten(problem)


@dataclass(frozen=True)
class Run:
    """What one run of an operation works with, put together once by
    :func:`open_run` (or by an operation called with its parts) and handed
    down: the open ``catalog``, the ``config``, ``stores`` (each store
    opened once per run), the clock ``now`` (aware UTC), the ``owner``
    named in leases and events, and ``dry_run`` (nothing written)."""

    catalog: Catalog
    config: Config
    stores: StoreCache
    now: Callable[[], datetime]
    owner: str
    dry_run: bool = False


@contextmanager
def open_run(catalog_url: str | None, config_path: str | Path | None = None, *, owner: str = "ckptier",
             dry_run: bool = False, create: bool = False,
             now: Callable[[], datetime] | None = None) -> Iterator[Run]:
    """The composition root of a run: reads ``ckptier.toml`` once (``config_path``,
    default ``$CKPTIER_CONFIG`` or ``./ckptier.toml``), opens the catalog that
    :func:`catalog_location` chooses for ``catalog_url`` (creating it only with
    ``create``), a fresh store cache, the UTC clock unless ``now`` is given, and
    an owner unique to this process (:func:`ckptier.tasks.pipeline.run_owner`
    with ``owner`` as its prefix). Closes the catalog on exit."""
    from ckptier.storage.catalog.api import Catalog

    from .config import load_config
    from .pipeline import StoreCache, run_owner, utcnow

    config = load_config(config_path)
    location = catalog_location(catalog_url, config_path, config=config)
    with Catalog.open(location.url, create=create) as catalog:
        yield Run(catalog=catalog, config=config, stores=StoreCache(roots=catalog.hot_locations), now=now or utcnow,
                  owner=run_owner(owner), dry_run=dry_run)
