"""The kernel of ``ckptier.tasks``: what every operation is handed, built once per run.

* :class:`Run`: the open catalog, the config, the store cache, the clock,
  the owner named in leases and events, dry-run. :func:`open_run` is the
  composition root that reads ``ckptier.toml`` once and opens the catalog
  once, for a command or a flow run; :meth:`Run.of` builds one around a
  catalog the caller already holds.
* :class:`StoreCache`: each store opened once per run.
* The clock: :data:`Clock`, :func:`utcnow` (pure cores are given the time,
  they never read it).
* :func:`run_owner`: the lease owner name of this process.
* Row claims (:class:`RowClaims`, :func:`row_claims`): how runs share the
  verification of one catalog.

Below every operation (``scan``, ``verify``, ``apply``, ``archive``, the
drills): it imports none of them. No Prefect, no torch.
"""

from __future__ import annotations

import os
import posixpath
import socket
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from ckptier.storage.base import Store
from ckptier.storage.catalog.db import refuse_in_memory
from ckptier.storage.errors import ConfigError
from ckptier.storage.records import CheckpointRecord
from ckptier.storage.url import canonical_url, open_store, parse_location
from ckptier.storage.wrappers import resuming

from .leases import DEFAULT_TTL as DEFAULT_LEASE_TTL
from .settings import Settings

if TYPE_CHECKING:  # the config's imports (formats, S3) only when a run reads it: `ckptier latest` stays light
    from ckptier.storage.catalog.api import Catalog  # likewise: `latest` opens the read-only catalog

    from .config import Config, RunnerSettings

#: What the operations are given to tell the time: aware UTC.
Clock = Callable[[], datetime]


def utcnow() -> datetime:
    """The clock the operations are given: aware UTC (pure cores never read it themselves)."""
    return datetime.now(UTC)


def run_owner(prefix: str = "ckptier") -> str:
    """A lease owner name unique to this process: host, pid and, inside a Prefect flow run, its id.

    Prefect is consulted only when it is already loaded, so the direct
    command-line path never pays for importing it.
    """
    run_id = ""
    if "prefect" in sys.modules:
        try:
            from prefect.runtime import flow_run  # loaded already: costs nothing

            run_id = str(flow_run.id or "")
        except Exception:  # noqa: BLE001 - outside a flow run
            run_id = ""
    return f"{prefix}:{socket.gethostname()}:{os.getpid()}:{run_id}"[:200]


def unknown_job(job: str) -> ConfigError:
    """The one-line error for a job the catalog has never seen."""
    return ConfigError(f"job {job!r}: no checkpoints in the catalog; run 'ckptier scan URL' first or check the name")


class StoreCache:
    """Opens each store once and maps a catalog location URL to ``(store, prefix)``.

    S3 locations share one store per bucket (``prefix`` is the key within
    the bucket); a local location is served by a store rooted at the
    outermost of ``roots`` it lies below (the scanned directory: every
    directory from there down is opened without following a link), else at
    its parent directory; ``prefix`` is the rest of the path, which works
    for checkpoint directories and single-file checkpoints alike. Every store
    ``opener`` gives is used through :func:`~ckptier.storage.wrappers.resuming`
    (a listing, a read or a batch delete that breaks off part-way goes on).
    Thread-safe.

    A location is split by :func:`~ckptier.storage.url.parse_location`,
    never URL-decoded past its store's URL (a key may hold ``%``, ``#``,
    ``?``...); ``roots`` gives the store URLs it may lie below (the
    catalog's :meth:`~ckptier.storage.catalog.api.Catalog.hot_locations`),
    asked once, on the first local location.
    """

    def __init__(self, opener: Callable[[str], Store] = open_store, *,
                 roots: Callable[[], Iterable[str]] | None = None) -> None:
        self._opener = opener
        self._stores: dict[str, Store] = {}
        self._lock = threading.Lock()
        self._roots_of = roots
        self._roots: tuple[str, ...] | None = None

    def roots(self) -> tuple[str, ...]:
        """The store URLs locations may lie below (asked of ``roots`` once)."""
        with self._lock:
            if self._roots is None:
                self._roots = tuple(self._roots_of()) if self._roots_of is not None else ()
            return self._roots

    def store(self, url: str) -> Store:
        with self._lock:
            if url not in self._stores:
                self._stores[url] = resuming(self._opener(url))
            return self._stores[url]

    def locate(self, location: str) -> tuple[Store, str]:
        if location.startswith("s3://"):
            parsed = parse_location(location)
            return self.store(f"s3://{parsed.bucket}"), parsed.prefix
        roots = self.roots()
        parsed = parse_location(location, roots)
        for root in sorted(roots, key=len):  # the outermost first: nothing below it is followed
            base = root.rstrip("/")
            if base.startswith("file://") and location.startswith(base + "/") and canonical_url(base) == base:
                return self.store(base), location[len(base) + 1:].strip("/")
        parent, name = posixpath.split(parsed.path.rstrip("/"))
        return self.store(Path(parent or "/").as_uri()), name

    def for_record(self, record: CheckpointRecord) -> tuple[Store, str]:
        return self.locate(record.location)


# ------------------------------------------------------------------ row claims

#: A claiming run that finds every remaining row held by others looks again
#: this soon first (see :class:`RowClaims`).
FIRST_POLL = 0.005
#: A claim takes about this share of the rows still unchecked (a quarter:
#: measured best of 2, 4 and 8 for two runs sharing a sweep)...
CLAIM_SHARE = 4
#: ... and at least this many rows.
MIN_CLAIM = 4


@dataclass(frozen=True)
class RowClaims:
    """How a run shares the verification of one catalog with other runs (``[runner] claim_rows``).

    ``owner`` names this run's leases (:func:`run_owner`); ``ttl`` is the
    lease length (a heartbeat renews it every third); ``since`` is the start
    of the sweep the runs share: a row whose verification finished at or
    after it is done (runs of one sweep pass the same ``since``; each run's
    own start is the default). Each claim takes about a
    :data:`CLAIM_SHARE`-th of the rows still unchecked, at least
    :data:`MIN_CLAIM` and at most ``batch`` (guided self-scheduling: big
    batches while much is left, each costing a few statements, and small
    ones at the end, so that no run is left reading a big last batch while
    the others have finished); a run
    that finds every remaining row leased by others looks again until they
    are checked or their leases run out: after :data:`FIRST_POLL` seconds,
    then twice as long each time, at most ``poll`` seconds apart (the last
    rows of a sweep are usually recorded within milliseconds; a run that
    died holds its rows for the lease's length).
    """

    owner: str
    ttl: timedelta = DEFAULT_LEASE_TTL
    since: datetime | None = None
    batch: int = 64
    poll: float = 0.5


def row_claims(settings: RunnerSettings, sweep_since: str | None, *, owner: str) -> RowClaims | None:
    """The :class:`RowClaims` of a run under ``settings`` (None without
    ``claim_rows``), leased as ``owner``. ``sweep_since`` is the ISO 8601
    start of the sweep shared with other runs (default: the run's own start;
    a time without zone is UTC)."""
    if not settings.claim_rows:
        if sweep_since:
            raise ConfigError(f"--since {sweep_since!r}: only means something with row claims; add --claim-rows "
                              "or [runner] claim_rows = true")
        return None
    since = None
    if sweep_since:
        try:
            since = datetime.fromisoformat(sweep_since)
        except ValueError:
            raise ConfigError(f"--since {sweep_since!r}: not an ISO 8601 time; write e.g. 2026-11-30T02:00:00Z") from None
        since = since if since.tzinfo is not None else since.replace(tzinfo=UTC)
    return RowClaims(owner=owner, ttl=settings.lease, since=since)


# ------------------------------------------------------------------ the run


class Run:
    """What one run of an operation works with, put together once by
    :func:`open_run` (or :meth:`Run.of`) and handed down: the open
    ``catalog``, the ``config``, ``stores`` (each store opened once per
    run), the clock ``now`` (aware UTC), the ``owner`` named in leases and
    events, and ``dry_run`` (nothing written). Immutable. ``config`` may be
    given as a function that reads it: it is then called on the first use
    of :attr:`config` only, once (a run that never looks at the config
    never imports its parser, nor the formats and S3 that it checks).

    A run holds an open catalog and stays in its process: pickled (Prefect
    pickles a task's parameters with the context of the task runs it fans
    out to Dask), it becomes a :class:`DetachedRun`, which says so when
    anything uses it. Deliberately not a dataclass: Prefect (through
    pydantic) would copy a dataclass field by field into such a context.
    """

    __slots__ = ("catalog", "_config", "stores", "now", "owner", "dry_run")

    catalog: Catalog
    _config: Config | Callable[[], Config]
    stores: StoreCache
    now: Clock
    owner: str
    dry_run: bool

    def __init__(self, *, catalog: Catalog, config: Config | Callable[[], Config], stores: StoreCache, now: Clock,
                 owner: str, dry_run: bool = False) -> None:
        for name, value in (("catalog", catalog), ("_config", config), ("stores", stores), ("now", now),
                            ("owner", owner), ("dry_run", dry_run)):
            object.__setattr__(self, name, value)

    @property
    def config(self) -> Config:
        """The run's ``ckptier.toml``, read now when the run was given a function that reads it
        (raising its :class:`~ckptier.storage.errors.ConfigError` when it is broken), then kept."""
        config = self._config
        if callable(config):
            config = config()
            object.__setattr__(self, "_config", config)
        return config

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(f"a Run is immutable ({name})")

    def __repr__(self) -> str:
        return f"Run(owner={self.owner!r}, catalog={self.catalog.url!r}, dry_run={self.dry_run})"

    def __reduce__(self) -> tuple[type[DetachedRun], tuple[str]]:
        return DetachedRun, (self.owner,)

    @classmethod
    def of(cls, catalog: Catalog, *, config: Config | Callable[[], Config] | None = None, now: Clock = utcnow,
           owner: str = "ckptier", dry_run: bool = False, stores: StoreCache | None = None) -> Run:
        """A run around ``catalog``, already open (the caller closes it): ``config``
        (or the function that reads it on first use) default the built-in
        defaults, a fresh store cache unless ``stores``, ``owner`` used as it is."""
        if config is None:
            from .config import default_config  # lazy: the config's imports only for a run (see the imports)

            config = default_config()
        return cls(catalog=catalog, config=config,
                   stores=stores if stores is not None else StoreCache(roots=catalog.hot_locations), now=now,
                   owner=owner, dry_run=dry_run)


class DetachedRun:
    """What a pickled :class:`Run` becomes in another process: it names the run's
    owner and refuses every use (a run's catalog, stores and clock do not travel)."""

    def __init__(self, owner: str) -> None:
        self.owner = owner

    def __getattr__(self, name: str) -> NoReturn:
        # An AttributeError: hasattr() and the introspection of pickle and pydantic
        # must see a plain object with nothing of a run's.
        owner = self.__dict__.get("owner", "?")
        raise AttributeError(f"the run of {owner} was opened in another process and cannot be used here "
                             f"(its {name}); open a run where the work is done (open_run)")

    def __reduce__(self) -> tuple[type[DetachedRun], tuple[str]]:
        return DetachedRun, (self.owner,)

    def __repr__(self) -> str:
        return f"DetachedRun({self.owner!r})"


@contextmanager
def open_run(settings: Settings | None = None, *, owner: str = "ckptier", dry_run: bool = False,
             create: bool = False, now: Clock | None = None, config_on_use: bool = False) -> Iterator[Run]:
    """The composition root of a run: the config ``settings`` read (at most
    once, :class:`~ckptier.tasks.settings.Settings`; default: ``$CKPTIER_CONFIG``
    or ``./ckptier.toml`` and the catalog they choose), the catalog opened once
    (created only with ``create``), a fresh store cache, the UTC clock unless
    ``now`` is given, and an owner unique to this process (:func:`run_owner`
    with ``owner`` as its prefix). Closes the catalog on exit. A run that may
    create its catalog refuses an in-memory one (``sqlite://``): it would
    vanish with the process. ``config_on_use``: the config is read when the
    run first uses it (never, for one that does not), not before the catalog
    is opened; for a command that reads it only on some paths (``resume
    --quick``), and that reads it itself first when it is sure to need it."""
    settings = settings if settings is not None else Settings()
    config: Config | Callable[[], Config] = (lambda: settings.config) if config_on_use else settings.config
    if create:
        refuse_in_memory(settings.location.url)  # a catalog a run creates outlives the run
    from ckptier.storage.catalog.api import Catalog  # lazy: `ckptier latest` uses StoreCache without it

    with Catalog.open(settings.location.url, create=create) as catalog:
        yield Run.of(catalog, config=config, now=now or utcnow, owner=run_owner(owner), dry_run=dry_run)
