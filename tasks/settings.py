"""Which settings are in force, and where they came from.

* The catalog: :func:`catalog_location` applies the one precedence every
  command and flow uses (``--catalog`` or a flow's ``catalog_url``, then
  ``CKPTIER_CATALOG_URL``, then ``[catalog] url`` in ``ckptier.toml``, then
  the default); the decision itself is
  :func:`ckptier.storage.catalog.db.resolve_catalog_url`.
* The retention policy: ``plan`` may preview under the built-in default, but
  ``apply`` deletes only under a ``[[policy]]`` the user wrote
  (:func:`require_written_policy`).
* Where they come from: :class:`Settings` (the catalog URL and the config
  path given, the config read once), from which
  :func:`ckptier.tasks.run.open_run` opens a run.

No Prefect, no torch; the config file is read only when it is needed.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from ckptier.storage.catalog.db import CatalogLocation, resolve_catalog_url
from ckptier.storage.errors import ConfigError

if TYPE_CHECKING:
    from .config import Config

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
    return Settings(explicit, config_path, config=config).location


def catalog_url(explicit: str | None, config_path: str | Path | None = None, *, config: Config | None = None) -> str:
    """:func:`catalog_location`'s URL."""
    return catalog_location(explicit, config_path, config=config).url


def config_file_name(config: Config, config_path: str | Path | None = None) -> str:
    """The file a config came from, or (when there is none) where one was looked for, in words."""
    from .config import DEFAULT_FILE, ENV_VAR  # loaded already (the caller holds a Config); ls never gets here

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


class Settings:
    """Where a run's settings come from, each decided once: ``catalog_url``
    (``--catalog`` or a flow's parameter; None: the precedence of
    :func:`catalog_location`) and ``config_path`` (None: ``$CKPTIER_CONFIG``,
    else ``./ckptier.toml``).

    :attr:`config` reads the file on first use only, and only once;
    :attr:`location` is the catalog, read from the file only when neither
    ``catalog_url`` nor ``CKPTIER_CATALOG_URL`` names one (so ``ls`` and
    ``latest`` given a catalog never read it). ``config`` is one already
    read. :func:`ckptier.tasks.run.open_run` opens a run from these."""

    def __init__(self, catalog_url: str | None = None, config_path: str | Path | None = None, *,
                 config: Config | None = None) -> None:
        self.catalog_url = catalog_url
        self.config_path = config_path
        self._config = config
        self._location: CatalogLocation | None = None

    @property
    def config(self) -> Config:
        """``ckptier.toml``, parsed (read on first use). Raises :class:`ConfigError` when it is broken."""
        if self._config is None:
            from .config import load_config  # lazy: ls and latest given a catalog never import the parser

            self._config = load_config(self.config_path)
        return self._config

    @property
    def location(self) -> CatalogLocation:
        """The catalog to open and why (decided on first use)."""
        if self._location is None:
            self._location = resolve_catalog_url(self.catalog_url, config_url=self._config_url)
        return self._location

    def _config_url(self) -> tuple[str | None, str | None]:
        config = self.config
        return config.catalog_url, str(config.source) if config.source is not None else None
