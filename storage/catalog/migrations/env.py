"""Alembic environment of the catalog.

Used two ways:

* by :func:`ckptier.storage.catalog.db.migrate`, which builds the Alembic
  ``Config`` in code and hands over an open connection, already inside a
  transaction, in ``config.attributes["connection"]``; migrations then run in
  that transaction (all or nothing on both SQLite and PostgreSQL);
* by the ``alembic`` command line with ``-x url=...`` or
  ``sqlalchemy.url`` set, for developers writing a new revision.

SQLite cannot ``ALTER`` most things, so migrations run in batch mode there.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from ckptier.storage.catalog.tables import Base

config = context.config
target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    from ckptier.storage.catalog.db import default_catalog_url, make_engine

    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option(
        "sqlalchemy.url"
    ) or default_catalog_url()
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            _run(conn)
            conn.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("ckptier's catalog migrations run online only; give a database URL")
run_migrations_online()
