"""Opening the catalog database: URL rules, engine set-up, migrations.

One SQLAlchemy URL chooses the database. :func:`resolve_catalog_url` is
the one place that decides which: ``--catalog``, then
``CKPTIER_CATALOG_URL``, then ``[catalog] url`` in ``ckptier.toml``, then the
default below.

* ``sqlite:///path/catalog.db`` (the default, under the user's data dir):
  WAL journal, a 30 s busy timeout, foreign keys on, and every write
  transaction opened with ``BEGIN IMMEDIATE`` so that two writers queue on the
  busy timeout instead of failing with "database is locked" half-way. Read
  transactions use ``BEGIN DEFERRED`` (execution option ``sqlite_begin``).
  A path on a network filesystem (NFS, CIFS, sshfs, ...) is refused: SQLite's
  locking is unreliable there.
* ``postgresql://`` (or ``postgres://``, ``postgresql+psycopg://``) for a
  shared catalog, always driven by psycopg 3.

:func:`open_engine` makes the engine and migrates the schema to the newest
revision; every failure to do so is a one-line :class:`ConfigError` naming the
URL with its password masked. With ``create=False`` (the read-only commands)
a catalog that does not exist yet is never created: no directory, no file,
no schema; :class:`CatalogMissing` says which catalog was looked for.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, SQLAlchemyError
from sqlalchemy.pool import StaticPool

from ..errors import ConfigError, EnvironmentFault

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

#: The newest migration revision. Opening a catalog already at this revision
#: only reads ``alembic_version`` and never imports Alembic (it costs ~0.2 s
#: per command); ``tests/test_catalog.py`` checks it equals Alembic's head.
HEAD_REVISION = "resume_0001"

#: Seconds a SQLite writer waits for another writer's lock before failing.
SQLITE_BUSY_TIMEOUT_S = 30.0

#: Page size of a new SQLite catalog (SQLite's default is 4096).
SQLITE_PAGE_SIZE = 16384
#: Seconds to wait for a PostgreSQL server to accept a connection.
PG_CONNECT_TIMEOUT_S = 10
#: Filesystem types (from /proc/mounts) on which SQLite locking is unsafe.
NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "fuse.sshfs",
        "afs",
        "ceph",
        "glusterfs",
        "fuse.glusterfs",
        "lustre",
        "fuse.s3fs",
        "fuse.rclone",
        "fuse.gcsfuse",
    }
)
#: Key of the PostgreSQL advisory lock that serialises concurrent migrations.
_MIGRATION_LOCK_KEY = 0x636B7074  # "ckpt"
_FIX = "set a valid URL with --catalog, CKPTIER_CATALOG_URL or [catalog] url in ckptier.toml"
_MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


def data_dir() -> Path:
    """ckptier's data directory: ``$CKPTIER_HOME``, else ``$XDG_DATA_HOME/ckptier``,
    else ``~/.local/share/ckptier``. Not created here."""
    return _data_dir(os.environ)


def default_catalog_url() -> str:
    """``$CKPTIER_CATALOG_URL`` when set, else a SQLite file ``catalog.db`` in
    :func:`data_dir` (see :func:`resolve_catalog_url`). Creates nothing: the
    directory is made when a catalog is first opened for writing."""
    return resolve_catalog_url(None).url


#: Environment variable naming the catalog (second in precedence, after ``--catalog``).
CATALOG_URL_ENV = "CKPTIER_CATALOG_URL"


@dataclass(frozen=True)
class CatalogLocation:
    """Which catalog a command uses and why: ``url`` and ``source``, one of
    ``--catalog``, ``CKPTIER_CATALOG_URL``, ``[catalog] url in PATH`` or
    ``default``."""

    url: str
    source: str

    @property
    def masked(self) -> str:
        """The URL with its password masked (safe to print)."""
        return mask_url(self.url)

    def __str__(self) -> str:
        return f"{self.masked} ({self.source})"


#: What a config-file reader returns: the ``[catalog] url`` (or None) and the file it came from.
ConfigURL = tuple[str | None, str | None]


def resolve_catalog_url(
    explicit: str | None,
    *,
    config_url: ConfigURL | Callable[[], ConfigURL] | None = None,
    environ: Mapping[str, str] | None = None,
) -> CatalogLocation:
    """The catalog to use: ``explicit`` (``--catalog``, or a flow's
    ``catalog_url`` parameter), else ``$CKPTIER_CATALOG_URL``, else the
    ``[catalog] url`` of ``ckptier.toml``, else SQLite ``catalog.db`` in
    :func:`data_dir`. Empty strings count as unset.

    ``config_url`` is ``(url, file)`` or a callable returning it, called only
    when the first two are unset (so a command given ``--catalog`` never
    reads the config file for it). Pure apart from reading ``environ`` (the
    process environment by default); creates nothing.
    """
    if explicit is not None and str(explicit).strip():
        return CatalogLocation(str(explicit).strip(), "--catalog")
    env = os.environ if environ is None else environ
    from_env = env.get(CATALOG_URL_ENV, "").strip()
    if from_env:
        return CatalogLocation(from_env, CATALOG_URL_ENV)
    if config_url is not None:
        url, where = config_url() if callable(config_url) else config_url
        if url is not None and url.strip():
            return CatalogLocation(url.strip(), f"[catalog] url in {where or 'ckptier.toml'}")
    path = _data_dir(env) / "catalog.db"
    return CatalogLocation(f"sqlite:///{path.absolute()}", "default")


def _data_dir(env: Mapping[str, str]) -> Path:
    home = env.get("CKPTIER_HOME")
    if home:
        return Path(home).expanduser()
    xdg = env.get("XDG_DATA_HOME")
    if xdg:
        return Path(xdg).expanduser() / "ckptier"
    return Path(env.get("HOME") or Path.home()).expanduser() / ".local" / "share" / "ckptier"


class CatalogMissing(ConfigError):
    """A read-only command was pointed at a catalog that does not exist (yet)."""


def mask_url(url: str | URL) -> str:
    """The URL with its password replaced by ``***`` (also for unparsable URLs)."""
    if isinstance(url, URL):
        return url.render_as_string(hide_password=True)
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


def filesystem_type(path: str, mounts: str) -> str | None:
    """The filesystem type of the mount holding absolute ``path``, given the
    text of ``/proc/mounts`` (the longest matching mount point wins; a later
    line wins over an earlier one for the same mount point)."""
    best: tuple[int, str] | None = None
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[1])
        root = mount.rstrip("/")
        if path == mount or path == root or path.startswith(root + "/"):
            if best is None or len(mount) >= best[0]:
                best = (len(mount), parts[2])
    return best[1] if best else None


def _check_local_filesystem(directory: Path, url: str) -> None:
    try:
        mounts = Path("/proc/mounts").read_text()
    except OSError:
        return  # not Linux, or no /proc: cannot tell cheaply
    fstype = filesystem_type(str(directory.resolve()), mounts)
    if fstype in NETWORK_FILESYSTEMS:
        raise ConfigError(
            f"catalog {mask_url(url)} is on a {fstype} network filesystem, where SQLite locking "
            f"is unsafe; put the SQLite file on a local disk or use PostgreSQL ({_FIX})"
        )


def _normalise(url: str) -> URL:
    try:
        u = make_url(url)
    except ArgumentError as exc:
        raise ConfigError(f"catalog URL {mask_url(url)!r} is not a database URL; {_FIX}") from exc
    backend = u.get_backend_name()
    if backend in ("postgresql", "postgres"):
        return u.set(drivername="postgresql+psycopg")
    if backend == "sqlite":
        if u.get_driver_name() not in ("pysqlite", ""):
            raise ConfigError(
                f"catalog URL {mask_url(u)!r} uses SQLite driver {u.get_driver_name()!r}; "
                f"use plain sqlite:///PATH ({_FIX})"
            )
        if u.host or u.port or u.username:
            # sqlite://name.db parses as host "name.db" and an in-memory database.
            raise ConfigError(
                f"catalog URL {mask_url(u)!r} has {u.host!r} where a SQLite URL has no host; "
                f"write sqlite:///{(u.host or '') + ('/' + u.database if u.database else '')} for a path relative "
                "to the working directory or sqlite:////absolute/path.db"
            )
        return u
    raise ConfigError(
        f"catalog URL {mask_url(u)!r} has unsupported database {backend!r}; "
        f"use sqlite:///PATH or postgresql://HOST/DB ({_FIX})"
    )


POSTGRES_EXTRA_HINT = "pip install 'ckptier[postgres]'"


def in_memory(url: str) -> bool:
    """Whether ``url`` names an in-memory SQLite database (``sqlite://``, ``sqlite:///:memory:``,
    ``mode=memory``): one that vanishes with the process. Pure; False for a URL that is not valid."""
    try:
        u = make_url(url)
    except ArgumentError:
        return False
    if u.get_backend_name() != "sqlite":
        return False
    return (u.database or "") in ("", ":memory:") or u.query.get("mode") == "memory" or ":memory:" in (u.database or "")


def refuse_in_memory(url: str) -> None:
    """Raise :class:`ConfigError` when ``url`` is :func:`in_memory`: for a command that writes
    a catalog, which would vanish when the command ends (and report success)."""
    if in_memory(url):
        raise ConfigError(
            f"catalog {mask_url(url)} is an in-memory database: what this command writes would be gone when it "
            "ends; give a file, e.g. --catalog sqlite:////path/catalog.db (or leave --catalog out for the default)"
        )


def make_engine(url: str, *, create: bool = True) -> Engine:
    """An engine for ``url`` set up as the module docstring describes (no I/O
    on PostgreSQL; on SQLite the file's directory is created and checked).

    With ``create=False`` nothing is created: a SQLite file that does not
    exist, is empty, or is in memory raises :class:`CatalogMissing`.

    Raises :class:`ConfigError` for an unsupported or malformed URL, a
    ``postgresql://`` URL without the psycopg driver installed, an SQLite
    directory that cannot be created or written, or a network filesystem.
    """
    u = _normalise(url)
    if u.get_backend_name() == "postgresql":
        connect_args: dict[str, Any] = {}
        if "connect_timeout" not in u.query:
            connect_args["connect_timeout"] = PG_CONNECT_TIMEOUT_S
        try:
            return create_engine(u, connect_args=connect_args, pool_pre_ping=True)
        except ImportError as exc:
            raise ConfigError(
                f"catalog {mask_url(u)} is PostgreSQL, but its driver psycopg is not installed "
                f"({exc.name or 'psycopg'}); run {POSTGRES_EXTRA_HINT}"
            ) from None

    database = u.database or ""
    if database in ("", ":memory:"):
        if not create:
            raise CatalogMissing(f"catalog {mask_url(u)} is an in-memory database: it holds no catalog to read; "
                                 "give the file a scan wrote to, e.g. sqlite:////path/catalog.db")
        engine = create_engine(
            u, poolclass=StaticPool, connect_args={"check_same_thread": False}
        )
    else:
        path = Path(database).expanduser()
        directory = path.parent
        if not create:
            _check_existing_sqlite(path, u)
        else:
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(
                    f"cannot create directory {directory} for catalog {mask_url(u)}: "
                    f"{exc.strerror or exc}; {_FIX}"
                ) from exc
            if not os.access(directory, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
                raise ConfigError(f"catalog {mask_url(u)} is not writable; {_FIX}")
            if path.is_dir():
                raise ConfigError(f"catalog {mask_url(u)} is a directory, not a file; {_FIX}")
        _check_local_filesystem(directory, url)
        engine = create_engine(
            u.set(database=str(path)),
            connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False},
        )
    _configure_sqlite(engine)
    return engine


_SQLITE_HEADER = b"SQLite format 3\x00"


def _check_existing_sqlite(path: Path, u: URL) -> None:
    """Raise unless ``path`` is an existing, non-empty SQLite file (reads 16 bytes, writes nothing)."""
    try:
        with path.open("rb") as f:
            header = f.read(len(_SQLITE_HEADER))
    except FileNotFoundError:
        raise _missing(mask_url(u), "does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"catalog {mask_url(u)} is a directory, not a file; {_FIX}") from None
    except OSError as exc:
        raise ConfigError(f"catalog {mask_url(u)} cannot be read: {exc.strerror or exc}; {_FIX}") from None
    if not header:
        raise _missing(mask_url(u), "is an empty file")
    if header != _SQLITE_HEADER:
        raise ConfigError(f"catalog {mask_url(u)} is not a SQLite database file; {_FIX}")


def _missing(masked: str, what: str) -> CatalogMissing:
    return CatalogMissing(
        f"no catalog at {masked}: it {what}; run 'ckptier scan URL' to create it, "
        "or point --catalog, CKPTIER_CATALOG_URL or [catalog] url at the one you meant"
    )


def _configure_sqlite(engine: Engine) -> None:
    """SQLAlchemy's documented pysqlite recipe: stop the driver from emitting
    its own (deferred) BEGIN, then emit ours in the ``begin`` event."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cur = dbapi_connection.cursor()
        try:
            # Larger pages for a catalog created now (a no-op on one that exists):
            # a million file rows insert ~8% faster and the file index is shallower.
            cur.execute(f"PRAGMA page_size={SQLITE_PAGE_SIZE}")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
        finally:
            cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        mode = conn.get_execution_options().get("sqlite_begin", "IMMEDIATE")
        if mode not in ("IMMEDIATE", "DEFERRED", "EXCLUSIVE"):
            raise ValueError(f"sqlite_begin={mode!r}; use IMMEDIATE, DEFERRED or EXCLUSIVE")
        conn.exec_driver_sql(f"BEGIN {mode}")


@contextmanager
def read_transaction(engine: Engine) -> Iterator[Connection]:
    """A read-only transaction: a consistent snapshot, not holding the SQLite write lock."""
    with engine.connect() as conn:
        conn.execution_options(sqlite_begin="DEFERRED")
        with conn.begin():
            yield conn


def alembic_config() -> Config:
    """An Alembic config pointing at the migrations shipped inside the package."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS_DIR))
    cfg.set_main_option("path_separator", "os")
    return cfg


@functools.cache
def _script() -> ScriptDirectory:
    """The shipped migration scripts, read once per process."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config())


def _heads() -> frozenset[str]:
    return frozenset(_script().get_heads())


def _known_revisions() -> frozenset[str]:
    return frozenset(rev.revision for rev in _script().walk_revisions())


def migrate(engine: Engine, *, create: bool = True) -> bool:
    """Bring the schema to the newest revision; True when anything was run.

    Idempotent and safe to race: when the schema is already current only a
    read transaction runs (one version query, Alembic is not imported);
    otherwise the upgrade runs in one write transaction (``BEGIN IMMEDIATE``
    on SQLite, an advisory lock on PostgreSQL) that re-checks the revision
    first. A database whose revision this version of ckptier does not know
    (written by a newer ckptier) is refused. With ``create=False`` a database
    without a catalog schema raises :class:`CatalogMissing` instead of
    getting one; an existing catalog at an older revision is still upgraded.
    """
    current = _current_revisions(engine)
    if current == {HEAD_REVISION}:
        return False
    if not current and not create:
        raise _missing(mask_url(engine.url), "holds no ckptier catalog (no schema)")
    from alembic import command
    from alembic.runtime.migration import MigrationContext

    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _MIGRATION_LOCK_KEY})
        current = set(MigrationContext.configure(conn).get_current_heads())
        if current == _heads():
            return False
        unknown = current - _known_revisions()
        if unknown:
            raise ConfigError(
                f"catalog {mask_url(engine.url)} has schema revision {', '.join(sorted(unknown))}, "
                "newer than this ckptier knows; upgrade ckptier or point --catalog elsewhere"
            )
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "heads")
    return True


def _current_revisions(engine: Engine) -> set[str]:
    """Revisions recorded in ``alembic_version`` (empty for a new database), by plain SQL."""
    with read_transaction(engine) as conn:
        try:
            with conn.begin_nested():
                return {str(r) for r in conn.execute(text("SELECT version_num FROM alembic_version")).scalars()}
        except SQLAlchemyError:
            return set()


def _reason(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) if isinstance(exc, DBAPIError) else None
    text_ = str(orig if orig is not None else exc).strip()
    first = text_.splitlines()[0].strip() if text_ else type(exc).__name__
    return first.rstrip(".")


#: What the database said (lowercase, a fragment) -> what the machine refused and the fix.
_CATALOG_FAULTS = (
    ("database or disk is full", "the disk holding it is full", "free space there and re-run"),
    ("no space left on device", "the disk holding it is full", "free space there and re-run"),
    ("disk quota exceeded", "its disk quota is exceeded", "free space under the quota and re-run"),
    ("attempt to write a readonly database", "it is read-only (its file, directory or filesystem)",
     "make it writable or point --catalog at a writable one"),
    ("read-only file system", "its filesystem is read-only", "remount it read-write or use another catalog"),
    ("disk i/o error", "the disk holding it failed a read or a write", "check the disk and the mount, then re-run"),
    ("unable to open database file", "its file cannot be opened (a missing directory, or permissions)",
     "check the path and its permissions"),
)


def catalog_fault(url: str, exc: BaseException) -> EnvironmentFault | None:
    """``exc`` (raised while using the catalog at ``url``, password masked) as the
    one-line :class:`~ckptier.storage.errors.EnvironmentFault` it is — the
    disk full, a read-only filesystem, no permission — naming the catalog
    and the fix; None for any other error (a bug, a lock held...)."""
    text_ = _reason(exc).lower()
    for fragment, what, fix in _CATALOG_FAULTS:
        if fragment in text_:
            return EnvironmentFault(f"catalog {url}: {what} ({_reason(exc)}); {fix}")
    return None


def open_engine(url: str, *, create: bool = True) -> Engine:
    """Make the engine for ``url`` and migrate it (see :func:`make_engine`,
    :func:`migrate`). Every failure is a one-line :class:`ConfigError` that
    names the URL (password masked) and the fix. With ``create=False`` a
    catalog that does not exist yet raises :class:`CatalogMissing` and
    nothing is created."""
    engine = make_engine(url, create=create)
    try:
        migrate(engine, create=create)
    except ConfigError:
        engine.dispose()
        raise
    except (SQLAlchemyError, OSError) as exc:
        engine.dispose()
        fault = catalog_fault(mask_url(engine.url), exc)
        if fault is not None:
            raise fault from exc
        reason = _reason(exc)
        password = engine.url.password
        if password:
            reason = reason.replace(str(password), "***")
        raise ConfigError(f"cannot open catalog {mask_url(engine.url)}: {reason}; {_FIX}") from exc
    return engine
