"""Opening the catalog the dashboard and ``report`` read.

Unlike :meth:`Catalog.open`, :func:`open_source` never creates a catalog: a
SQLite file that does not exist, or a database without ckptier's schema, is
a one-line :class:`ConfigError` and nothing is written (not even a
directory). An existing catalog at an older schema is migrated, as every
command does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from sqlalchemy import Engine, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from ckptier.storage.catalog import db
from ckptier.storage.catalog.api import Catalog
from ckptier.storage.errors import ConfigError
from ckptier.tasks.config import Config

_FIX = "run 'ckptier scan URL' to create it, or point --catalog / CKPTIER_CATALOG_URL at an existing one"


@dataclass
class Source:
    """An open catalog plus the configuration the dashboard reads policies from.

    ``engine`` is the catalog's own engine (this package's queries run on
    it, read only); ``url`` is the catalog URL with its password masked.
    """

    engine: Engine
    catalog: Catalog
    config: Config
    url: str

    @property
    def run_url(self) -> str:
        """The catalog URL to hand a flow run (the drill button's): a SQLite
        path made absolute, so a worker started elsewhere opens the same
        file; no password (a flow run's parameters are stored and shown by
        Prefect: the worker supplies it, e.g. PostgreSQL's ``PGPASSWORD`` or
        ``~/.pgpass``)."""
        return flow_run_url(self.engine.url)

    def close(self) -> None:
        self.catalog.close()

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def flow_run_url(url: URL) -> str:
    """``url`` as a flow run's parameter: see :attr:`Source.run_url`."""
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        url = url.set(database=str(Path(url.database).expanduser().resolve()))
    return url._replace(password=None).render_as_string(hide_password=False)  # URL.set ignores None


def default_url() -> str:
    """The catalog URL used when none is given: the default SQLite file
    under :func:`db.data_dir` (the directory is not created)."""
    return f"sqlite:///{db.data_dir() / 'catalog.db'}"


def _sqlite_path(url: str) -> Path | None:
    """The database file of a SQLite URL, None for other databases."""
    try:
        u = make_url(url)
    except ArgumentError as exc:
        raise ConfigError(f"catalog URL {db.mask_url(url)!r} is not a database URL; {_FIX}") from exc
    if u.get_backend_name() != "sqlite":
        return None
    if u.database in (None, "", ":memory:"):
        raise ConfigError(f"catalog URL {db.mask_url(url)!r} is an in-memory database, which holds no catalog; {_FIX}")
    return Path(u.database).expanduser()


def _has_schema(engine: Engine) -> bool:
    with db.read_transaction(engine) as conn:
        try:
            with conn.begin_nested():
                return conn.execute(text("SELECT version_num FROM alembic_version")).first() is not None
        except SQLAlchemyError:
            return False


def open_source(url: str | None, config: Config) -> Source:
    """Open the existing catalog at ``url`` (None: the default SQLite file).

    Raises :class:`ConfigError` (one line, password masked) when there is
    no catalog there or it cannot be opened.
    """
    url = url or default_url()
    path = _sqlite_path(url)
    if path is not None and not path.is_file():
        raise ConfigError(f"no catalog at {path}: {_FIX}")
    if path is not None:  # absolute, so that the file stays the same one whatever the working directory becomes
        url = make_url(url).set(database=str(path.resolve())).render_as_string(hide_password=False)
    engine = db.make_engine(url)
    try:
        if not _has_schema(engine):
            raise ConfigError(f"{db.mask_url(engine.url)} holds no ckptier catalog (no schema revision); {_FIX}")
        db.migrate(engine)
    except ConfigError:
        engine.dispose()
        raise
    except (SQLAlchemyError, OSError) as exc:
        engine.dispose()
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if engine.url.password:
            reason = reason.replace(str(engine.url.password), "***")
        raise ConfigError(f"cannot open catalog {db.mask_url(engine.url)}: {reason}; check the URL and the server") from exc
    if config.source is not None:  # absolute too: the drill button hands it to a flow run started elsewhere
        config = replace(config, source=Path(config.source).resolve())
    return Source(engine=engine, catalog=Catalog(engine), config=config, url=db.mask_url(engine.url))
