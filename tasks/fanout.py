"""Fan the per-checkpoint work out: to a Dask cluster, or to Prefect task runs.

A :class:`Fanout` runs a work function over many work items and yields the
results in input order. The operations bring their own work functions
(module-level, so a Dask worker imports them by name):
:func:`ckptier.tasks.verify.verify_work`, :func:`ckptier.tasks.archive.promote_work`
and :func:`ckptier.tasks.archive.fetch_work`; this module knows none of
them. Work items are plain data (catalog records and settings, picklable)
and results are typed values (:class:`~ckptier.tasks.verify.VerifyOutcome`,
:class:`~ckptier.tasks.archive.ArchiveCopy`): the workers read and write
storage, never the catalog, so the process that fanned out stays the one
writer of the results (unless rows are claimed: see
:func:`ckptier.tasks.pipeline.run_verify`). A worker opens its stores
through :func:`worker_stores`.

Executors (:func:`open_fanout` picks one from ``[runner]``):

- ``[runner] kind = "threads"`` (the default) has none: :func:`open_fanout`
  gives None and each operation does its work in this process, without work
  items: verification reads on :func:`ckptier.tasks.verify.verify_many`'s
  pool of ``workers`` threads, shared by the files of every checkpoint;
  promotions and a drill's file fetches run one after another.
- :class:`DaskFanout`: a Dask cluster through ``distributed`` directly (the
  command line, which runs without Prefect): a local cluster of
  ``workers`` processes on 127.0.0.1, or the one at ``address``.
- ``PrefectFanout`` (in :mod:`ckptier.tasks.prefect_tasks`): each item a
  Prefect task run on the flow's task runner (``ThreadPoolTaskRunner`` or
  ``prefect_dask.DaskTaskRunner``).

A work item that fails with a transient storage error
(:func:`ckptier.storage.errors.is_transient`) is tried again, up to
:data:`ATTEMPTS` times; any other error fails at once and is raised from
``map`` when its result is reached.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ckptier.storage.errors import ConfigError, is_transient

if TYPE_CHECKING:
    from .config import RunnerSettings
    from .run import StoreCache

T = TypeVar("T")
R = TypeVar("R")

#: Tries of a work item whose failure is transient (the first one included).
ATTEMPTS = 3
#: Seconds before the second try; doubled for each later one.
RETRY_DELAY_S = 1.0


class Fanout(Protocol):
    """Runs ``fn`` over ``items`` somewhere; results in input order."""

    #: ``dask`` or ``prefect-threads``/``prefect-dask``: for reports.
    name: str
    #: How many items run at once (a batching hint).
    parallelism: int

    def map(self, fn: Callable[[T], R], items: Sequence[T], *, errors: bool = False) -> Iterator[Any]:
        """Submit every item, then yield each result in order; an item that failed raises its
        error there, or (``errors``) is yielded as the exception and the rest go on."""
        ...

    def close(self) -> None:
        """Release the threads or the cluster. Idempotent."""
        ...


def settle(result: Callable[[], R], errors: bool) -> R | Exception:
    """``result()``; with ``errors``, the exception it raises instead of raising it."""
    if not errors:
        return result()
    try:
        return result()
    except Exception as exc:  # noqa: BLE001 - handed to the caller as the item's outcome
        return exc


def retrying(fn: Callable[[T], R], item: T, *, attempts: int = ATTEMPTS, delay: float = RETRY_DELAY_S) -> R:
    """``fn(item)``, tried again after a transient error (``attempts`` in all, delay doubling)."""
    for n in range(1, attempts + 1):
        try:
            return fn(item)
        except Exception as exc:
            if n == attempts or not is_transient(exc):
                raise
            time.sleep(delay * 2 ** (n - 1))
    raise AssertionError("unreachable")  # pragma: no cover


class DaskFanout:
    """A Dask cluster, through ``distributed``: the one at ``address``, else a
    local cluster of ``workers`` processes (one thread each) listening on
    127.0.0.1 only and stopped by :meth:`close`. Raises ``ConfigError`` (one
    line) when ``distributed`` is not installed or the scheduler cannot be
    reached."""

    name = "dask"

    def __init__(self, *, workers: int | None = None, address: str | None = None, timeout_s: float = 30.0) -> None:
        try:
            from distributed import Client, LocalCluster  # optional: pip install 'ckptier[dask]'
        except ImportError:
            raise ConfigError("runner kind 'dask' needs Dask: pip install 'ckptier[dask]' "
                              "(or use kind = \"threads\")") from None
        self._cluster: Any = None
        self._client: Any = None
        try:
            if address is not None:
                self._client = Client(address, timeout=timeout_s)  # type: ignore[no-untyped-call]
            else:
                self._cluster = LocalCluster(  # type: ignore[no-untyped-call]
                    n_workers=workers or default_workers(), threads_per_worker=1,
                    processes=True, host="127.0.0.1", dashboard_address=None)
                self._client = Client(self._cluster, timeout=timeout_s)  # type: ignore[no-untyped-call]
        except OSError as exc:
            if self._cluster is not None:
                self._cluster.close()
            where = address or "a local cluster"
            raise ConfigError(f"Dask scheduler {where}: cannot connect ({exc}); check [runner] address "
                              "and that the scheduler runs") from None
        self.parallelism = max(1, sum(w.get("nthreads", 1) for w in
                                      self._client.scheduler_info().get("workers", {}).values()))

    @property
    def address(self) -> str:
        """The scheduler's address (``tcp://127.0.0.1:PORT`` for a local cluster)."""
        return str(self._client.scheduler.address)

    def map(self, fn: Callable[[T], R], items: Sequence[T], *, errors: bool = False) -> Iterator[Any]:
        futures = [self._client.submit(retrying, fn, item, pure=False) for item in items]
        try:
            for f in futures:
                yield settle(f.result, errors)
        finally:
            for f in futures:
                f.cancel()

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()
        cluster, self._cluster = self._cluster, None
        if cluster is not None:
            cluster.close()


def default_workers() -> int:
    """Worker processes of a local Dask cluster when ``workers`` is not given: one per core, at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


def runner_settings(base: RunnerSettings, override: str | None) -> RunnerSettings:
    """``[runner]`` with the command line's ``--runner`` (``threads`` or ``dask``) applied (pure).

    Switching to ``dask`` keeps the file's ``workers`` or ``address``
    (neither: a local cluster); switching to ``threads`` drops them."""
    if override is None or override == base.kind:
        return base
    if override == "threads":
        return replace(base, kind="threads", workers=None, address=None)
    if override == "dask":
        return replace(base, kind="dask")
    raise ConfigError(f"--runner {override!r}: must be threads or dask")


def open_fanout(settings: RunnerSettings) -> Fanout | None:
    """The executor ``settings`` names, outside Prefect: None for ``threads``
    (each operation does its work in this process: see the module
    docstring), a :class:`DaskFanout` for ``dask``."""
    if settings.kind == "dask":
        return DaskFanout(workers=settings.workers, address=settings.address)
    return None




_stores_lock = threading.Lock()
_stores: StoreCache | None = None


def worker_stores() -> StoreCache:
    """This process's :class:`~ckptier.tasks.run.StoreCache` (one per worker process, reused)."""
    global _stores
    from .run import StoreCache  # lazy: only a worker opens stores; tasks.verify stays free of the catalog's imports

    with _stores_lock:
        if _stores is None:
            _stores = StoreCache()
        return _stores


def batches(records: Sequence[T], parallelism: int, *, most: int = 16) -> list[tuple[T, ...]]:
    """``records`` (checkpoints, or a checkpoint's files) cut into consecutive batches (pure):
    about four per worker so that the work evens out, never more than ``most`` in one."""
    if not records:
        return []
    size = max(1, min(most, -(-len(records) // (parallelism * 4))))
    return [tuple(records[i:i + size]) for i in range(0, len(records), size)]
