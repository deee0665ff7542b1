"""The catalog's base: the engine, transactions and helpers its concerns share
(:class:`CatalogCore`); each concern (:mod:`.scans`, :mod:`.queries`, ...)
is a class over it, and :class:`~ckptier.storage.catalog.api.Catalog` is
their composition.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, Self

from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    and_,
    bindparam,
    select,
    update,
)
from sqlalchemy.exc import OperationalError

from .. import transitions
from ..records import (
    CopyState,
    Format,
    State,
    Tier,
)
from . import db
from .tables import checkpoints as ck
from .tables import jobs as jb


COPY_STATES = tuple(s.value for s in CopyState)

DELETE_SCOPES = ("checkpoint", "hot-copy")

FILE_STATUSES = transitions.FILE_STATUSES

#: First key of the PostgreSQL advisory locks that serialise scans of one job.
_SCAN_LOCK_CLASS = 0x636B73  # "cks"

# Stored values to enum members by dictionary: ``Enum(value)`` costs ~1 µs a call,
# a noticeable part of listing 100,000 checkpoints.
_FORMATS = {f.value: f for f in Format}

_STATES = {s.value: s for s in State}

_TIERS = {t.value: t for t in Tier}

_COPY_STATES = {c.value: c for c in CopyState}


def _aware(now: datetime, name: str = "now") -> datetime:
    if now.tzinfo is None or now.utcoffset() is None:
        raise ValueError(
            f"{name}={now.isoformat()} is naive; pass an aware UTC datetime such as "
            "datetime.now(timezone.utc)"
        )
    return now.astimezone(UTC)


def _epoch(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC)


def _parent(prefix: str) -> str:
    prefix = prefix.strip("/")
    return prefix.rsplit("/", 1)[0] if "/" in prefix else ""


def _join_url(base: str, key: str) -> str:
    key = key.strip("/")
    return f"{base}/{key}" if key else base


def _row(old: Any) -> transitions.Row:
    """The rules' view of a checkpoints row (any object with its columns as attributes)."""
    return transitions.Row(
        state=State(old.state), reason=old.state_reason, first_seen=old.first_seen, saved_at=old.saved_at,
        verified_at=old.verified_at, missing_since=old.missing_since,
    )


class CatalogCore:
    """What every concern of the catalog is built on: the engine, the read and
    write transactions (a database fault named in one line) and the private
    helpers several concerns share. Safe to share between threads."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._closed = False
        self._lock = threading.Lock()

    @classmethod
    def open(cls, url: str | None = None, *, create: bool = True) -> Self:
        """Open (creating if needed) the catalog at ``url`` and migrate it to
        the newest schema; ``None`` means :func:`db.resolve_catalog_url`
        without a config file. With ``create=False`` (read-only commands) a
        catalog that does not exist raises :class:`db.CatalogMissing` and
        nothing is created. Raises :class:`~ckptier.storage.errors.ConfigError`
        (one line) when it cannot."""
        return cls(db.open_engine(url if url is not None else db.resolve_catalog_url(None).url, create=create))

    def close(self) -> None:
        """Release the database connections. Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def url(self) -> str:
        """The database URL with its password masked."""
        return db.mask_url(self._engine.url)

    @property
    def dialect(self) -> str:
        """``sqlite`` or ``postgresql``."""
        return self._engine.dialect.name

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        try:
            with db.read_transaction(self._engine) as conn:
                yield conn
        except OperationalError as exc:
            fault = db.catalog_fault(self.url, exc)
            if fault is None:
                raise
            raise fault from exc

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        # A full disk or a read-only filesystem is the machine's, named in one line with the
        # fix (the transaction was rolled back: nothing half-written).
        try:
            with self._engine.begin() as conn:
                yield conn
        except OperationalError as exc:
            fault = db.catalog_fault(self.url, exc)
            if fault is None:
                raise
            raise fault from exc

    def _insert(self, table: Any) -> Any:
        # The dialect's own INSERT (for ON CONFLICT), imported when a write needs it:
        # read-only commands never load the PostgreSQL dialect for a SQLite catalog.
        if self.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as pg_insert

            return pg_insert(table)
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        return sqlite_insert(table)

    def _ensure_job(self, conn: Connection, name: str, hot_url: str | None, now: datetime) -> tuple[int, bool]:
        """(job id, whether it was inserted now). Safe against a concurrent insert."""
        job_id = conn.execute(select(jb.c.id).where(jb.c.name == name)).scalar()
        if job_id is not None:
            return int(job_id), False
        stmt = self._insert(jb).values(name=name, hot_url=hot_url, created_at=now)
        conn.execute(stmt.on_conflict_do_nothing(index_elements=["name"]))
        return int(conn.execute(select(jb.c.id).where(jb.c.name == name)).scalar_one()), True

    @staticmethod
    def _require(conn: Connection, checkpoint_id: int) -> None:
        if conn.execute(select(ck.c.id).where(ck.c.id == checkpoint_id)).first() is None:
            from .entries import UnknownCheckpoint  # lazy: the read path never raises it

            raise UnknownCheckpoint(f"checkpoint id {checkpoint_id} is not in the catalog; rescan first")

    @staticmethod
    def _held(checkpoint_id: int, owner: str, generation: int, now: datetime) -> ColumnElement[bool]:
        """The fence: ``owner`` holds an unexpired lease on the checkpoint at ``generation``."""
        return and_(
            ck.c.id == checkpoint_id,
            ck.c.lease_owner == owner,
            ck.c.generation == generation,
            ck.c.lease_expires > now,
        )


def _bulk_update(conn: Connection, table: Any, rows: list[dict[str, Any]]) -> int:
    """UPDATE ``table`` by primary key ``_id`` with one executemany; every row
    must carry the same columns. Returns the number of rows."""
    cols = [k for k in rows[0] if k != "_id"]
    conn.execute(
        update(table)
        .where(table.c.id == bindparam("b__id"))
        .values({k: bindparam("b_" + k) for k in cols}),
        [{"b_" + k: v for k, v in row.items()} for row in rows],
    )
    return len(rows)


def _check_copy_state(state: CopyState | str) -> CopyState:
    """``state`` as a :class:`CopyState`; a string that names none is a ``ValueError``."""
    if state not in _COPY_STATES:
        raise ValueError(f"copy state {state!r} is unknown; use one of {', '.join(COPY_STATES)}")
    return _COPY_STATES[state]


def _parameter_limit(conn: Connection) -> int:
    """How many parameters one statement may bind: SQLite's compiled-in limit
    as the connection reports it (999 before SQLite 3.32, 32,766 since),
    PostgreSQL's 65,535."""
    if conn.dialect.name != "sqlite":
        return 65_535
    driver = conn.connection.driver_connection
    getlimit = getattr(driver, "getlimit", None)
    if getlimit is None:
        return 999
    return int(getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER))
