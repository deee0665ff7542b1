"""Fan the per-checkpoint work out: a thread pool here, or a Dask cluster.

A :class:`Fanout` runs a work function over many work items and yields the
results in input order. Work items are plain data (catalog records and
settings, picklable) and results are typed values
(:class:`~ckptier.tasks.verify.VerifyOutcome`,
:class:`~ckptier.tasks.archive.ArchiveCopy`): the workers read and write
storage, never the catalog, so the process that fanned out stays the one
writer of the results (unless rows are claimed: see
:func:`ckptier.tasks.pipeline.run_verify`).

Executors:

- :class:`ThreadFanout`: threads in this process (``[runner] kind = "threads"``).
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

from ckptier.storage.errors import ConfigError, is_transient
from ckptier.storage.model import CheckpointRecord

from .config import RunnerSettings
from .verify import VerifyOutcome

T = TypeVar("T")
R = TypeVar("R")

#: Tries of a work item whose failure is transient (the first one included).
ATTEMPTS = 3
#: Seconds before the second try; doubled for each later one.
RETRY_DELAY_S = 1.0
#: Threads each verify work item reads files with.
BATCH_THREADS = 2


class Fanout(Protocol):
    """Runs ``fn`` over ``items`` somewhere; results in input order."""

    #: ``threads``, ``dask`` or ``prefect-threads``/``prefect-dask``: for reports.
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


class ThreadFanout:
    """A pool of ``workers`` threads in this process."""

    name = "threads"

    def __init__(self, workers: int = 4) -> None:
        if workers < 1:
            raise ConfigError(f"runner workers = {workers}: must be at least 1, e.g. workers = 4")
        self.parallelism = workers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptier-fanout")

    def map(self, fn: Callable[[T], R], items: Sequence[T], *, errors: bool = False) -> Iterator[Any]:
        futures = [self._pool.submit(retrying, fn, item) for item in items]
        for f in futures:
            yield settle(f.result, errors)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class DaskFanout:
    """A Dask cluster, through ``distributed``: the one at ``address``, else a
    local cluster of ``workers`` processes (one thread each) listening on
    127.0.0.1 only and stopped by :meth:`close`. Raises ``ConfigError`` (one
    line) when ``distributed`` is not installed or the scheduler cannot be
    reached."""

    name = "dask"

    def __init__(self, *, workers: int | None = None, address: str | None = None, timeout_s: float = 30.0) -> None:
        try:
            from distributed import Client, LocalCluster
        except ImportError:
            raise ConfigError("runner kind 'dask' needs Dask: pip install 'ckptier[dask]' "
                              "(or use kind = \"threads\")") from None
        self._cluster: Any = None
        self._client: Any = None
        try:
            if address is not None:
                self._client = Client(address, timeout=timeout_s)
            else:
                self._cluster = LocalCluster(n_workers=workers or default_workers(), threads_per_worker=1,
                                             processes=True, host="127.0.0.1", dashboard_address=None)
                self._client = Client(self._cluster, timeout=timeout_s)
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
    from dataclasses import replace

    if override is None or override == base.kind:
        return base
    if override == "threads":
        return replace(base, kind="threads", workers=None, address=None)
    if override == "dask":
        return replace(base, kind="dask")
    raise ConfigError(f"--runner {override!r}: must be threads or dask")


def row_claims(settings: RunnerSettings, sweep_since: str | None, *, owner: str) -> Any:
    """The :class:`~ckptier.tasks.pipeline.RowClaims` of a run under ``settings``
    (None without ``claim_rows``), leased as ``owner``. ``sweep_since`` is the
    ISO 8601 start of the sweep shared with other runs (default: the run's own
    start; a time without zone is UTC)."""
    from .pipeline import RowClaims

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


def open_fanout(settings: RunnerSettings, *, workers: int = 4) -> Fanout | None:
    """The executor ``settings`` names, outside Prefect: None for ``threads``
    (the callers' own thread pools, today's path), a :class:`DaskFanout` for ``dask``."""
    if settings.kind == "dask":
        return DaskFanout(workers=settings.workers, address=settings.address)
    return None


# ----------------------------------------------------------------------- work


@dataclass(frozen=True)
class VerifyWork:
    """Verify these checkpoints' hot copies (``deep``: read every byte)."""

    records: tuple[CheckpointRecord, ...]
    deep: bool
    threads: int = BATCH_THREADS


_stores_lock = threading.Lock()
_stores: Any = None


def worker_stores() -> Any:
    """This process's :class:`~ckptier.tasks.pipeline.StoreCache` (one per worker process, reused)."""
    global _stores
    from .pipeline import StoreCache

    with _stores_lock:
        if _stores is None:
            _stores = StoreCache()
        return _stores


def verify_work(work: VerifyWork) -> list[VerifyOutcome]:
    """One outcome per record of ``work``, in order; reads storage only (see
    :func:`ckptier.tasks.verify.verify_many`)."""
    from .verify import verify_many

    stores = worker_stores()
    return [outcome for _, outcome in verify_many(stores.for_record, work.records, deep=work.deep,
                                                  workers=work.threads)]


def batches(records: Sequence[CheckpointRecord], parallelism: int, *, most: int = 16) -> list[tuple[CheckpointRecord, ...]]:
    """``records`` cut into consecutive batches (pure): about four per worker so
    that the work evens out, never more than ``most`` checkpoints in one."""
    if not records:
        return []
    size = max(1, min(most, -(-len(records) // (parallelism * 4))))
    return [tuple(records[i:i + size]) for i in range(0, len(records), size)]


def verify_fanned(fanout: Fanout, records: Sequence[CheckpointRecord], *, deep: bool,
                  progress: Callable[[int, int], None] | None = None
                  ) -> Iterator[tuple[CheckpointRecord, VerifyOutcome]]:
    """:func:`~ckptier.tasks.verify.verify_many` on ``fanout``: yields each record with its outcome,
    in input order; ``progress(done_bytes, total_bytes)`` after each batch."""
    work = [VerifyWork(b, deep) for b in batches(records, fanout.parallelism)]
    total = sum(f.size for r in records for f in r.files)
    done = 0
    for w, outcomes in zip(work, fanout.map(verify_work, work), strict=True):
        yield from zip(w.records, outcomes, strict=True)
        done += sum(f.size for r in w.records for f in r.files)
        if progress is not None:
            progress(done, total)


@dataclass(frozen=True)
class PromoteWork:
    """Copy one checkpoint's hot copy into the archive tier at ``archive_url``
    (in ``storage_class`` when set), proven bit-exact (:func:`ckptier.tasks.archive.promote`)."""

    record: CheckpointRecord
    archive_url: str
    storage_class: str | None
    now: datetime
    owner: str


def promoter(fanout: Fanout, *, archive_url: str, storage_class: str | None, now: Callable[[], datetime],
             owner: str) -> Callable[[Sequence[CheckpointRecord]], Iterator[Any]]:
    """``promote_many`` for :func:`ckptier.tasks.apply.apply_plan`: one :class:`PromoteWork`
    per record on ``fanout``, each outcome (copy or exception) in order."""

    def promote_many(records: Sequence[CheckpointRecord]) -> Iterator[Any]:
        work = [PromoteWork(r, archive_url, storage_class, now(), owner) for r in records]
        return fanout.map(promote_work, work, errors=True)

    return promote_many


def promote_work(work: PromoteWork) -> Any:
    """The :class:`~ckptier.tasks.archive.ArchiveCopy` made; raises the
    :class:`~ckptier.storage.errors.CkptierError` that stopped it."""
    from .archive import promote

    stores = worker_stores()
    hot, prefix = stores.for_record(work.record)
    archive = stores.store(work.archive_url)
    if work.storage_class is not None:
        archive = archive.in_class(work.storage_class)
    return promote(hot, prefix, work.record, archive, now=work.now, owner=work.owner)
