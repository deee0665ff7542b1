"""``ckptier dashboard`` and ``ckptier report``.

``report`` reads the catalog and prints tables: it never starts Prefect or
a web server, and never creates a catalog (see :mod:`.source`).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TextIO

from ckptier.storage.errors import ConfigError
from ckptier.tasks.config import load_config

from .format import display, records, text_table, to_csv
from .security import TOKEN_ENV, check_bind
from .source import open_source
from .tables import TABLES, Snapshot
from .views import NUMERIC

FORMATS = ("table", "csv", "json")
#: What ``report`` prints without ``--table``: the catalog's tables, or a job's.
DEFAULT_TABLES = ("jobs", "alerts", "recovery")
DEFAULT_JOB_TABLES = ("jobs", "alerts", "checkpoints", "plan", "drills", "storage")
DEFAULT_CHECKPOINT_TABLES = ("checkpoints", "copies", "files", "drills", "events")
#: What ``report --costs`` prints (CSV: the first).
COST_TABLES = ("costs", "cost_tiers")
#: Columns the terminal shows of the wide tables (CSV and JSON always carry every column).
TERMINAL_COLUMNS: dict[str, tuple[str, ...]] = {
    "jobs": ("job", "checkpoints", "drilled", "verified", "committed", "incomplete", "corrupt", "hot_bytes",
             "archive_stored_bytes", "saved_fraction", "verified_coverage", "last_drill_ok", "last_drill_age_s",
             "drill_success_7d",
             "recovery_step", "recovery_age_s", "newest_save_age_s", "alerts"),
    "alerts": ("severity", "job", "kind", "message"),
    "checkpoints": ("step", "state", "proof", "last_drill", "bytes", "hot", "archive", "archive_stored_bytes",
                    "milestone", "saved_at", "verified_at"),
    "drills": ("started_at", "step", "ok", "seconds", "device", "tier", "first_loss", "summary"),
    "events": ("at", "step", "kind", "message"),
    "verifications": ("at", "step", "kind", "message"),
    "files": ("relpath", "size", "status", "sha256_expected", "verified_at"),
    "costs": ("job", "stored_bytes", "monthly_cost", "keep_all_bytes", "keep_all_monthly_cost", "savings_monthly",
              "savings_fraction", "recovery_step", "recovery_age_s", "restore_tier", "restore_bytes",
              "restore_throughput_bytes_per_s", "restore_seconds"),
    "cost_tiers": ("job", "tier", "storage_class", "checkpoints", "bytes", "monthly_cost"),
}


def resolve_token(given: str | None) -> str | None:
    """``--token``, else ``$CKPTIER_DASHBOARD_TOKEN``, else None."""
    token = given if given is not None else os.environ.get(TOKEN_ENV) or None
    return token.strip() if token is not None else None


def serve_dashboard(*, catalog_url: str | None, config_path: str | None, host: str, port: int, token: str | None,
                    prefect_api_url: str | None) -> int:
    """Serve the dashboard until interrupted. Refuses a non-loopback ``host`` without a token
    (before anything is imported or opened)."""
    token = resolve_token(token)
    check_bind(host, token)
    if not 0 < port < 65536:
        raise ConfigError(f"--port {port} is not a TCP port; use 1-65535, e.g. 8765")
    source = open_source(catalog_url, load_config(config_path))

    import uvicorn

    from .app import create_app
    from .prefect_api import PrefectDrills

    app = create_app(source, token=token, prefect=PrefectDrills(prefect_api_url))
    freeze_startup_heap()
    shown = f"[{host}]" if ":" in host else host
    print(f"ckptier dashboard on http://{shown}:{port}/ over {source.url}"
          + (" (open it once with ?token=<your token>)" if token else ""), flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False, server_header=False)
    except OSError as exc:
        raise ConfigError(f"cannot serve on {host}:{port}: {exc.strerror or exc}; choose another --port or --host") from exc
    finally:
        source.close()
    return 0


def freeze_startup_heap() -> None:
    """Set what the serving process holds from its start (modules, the app: some 150,000 objects)
    aside from the garbage collector (:func:`gc.freeze`, after one collection): each full collection
    a page's allocations set off then walks only what was made since, not that heap again (about
    100 ms a job page of 5,000 checkpoints, a quarter of it, before). Called once, before the first
    request; what pages and the background tables make later is collected as ever."""
    import gc

    gc.collect()
    gc.freeze()


def print_report(*, catalog_url: str | None, config_path: str | None, job: str | None, step: int | None,
                 fmt: str, tables: Sequence[str] | None, out: TextIO | None = None,
                 now: datetime | None = None, costs: bool = False) -> int:
    """Print the dashboard's tables (see :data:`DEFAULT_TABLES`; with
    ``costs``, :data:`COST_TABLES` instead, for ``job`` or every job).

    ``table``: each table under its title, for people. ``json``: one object
    mapping table name to rows. ``csv``: one table only (the first asked
    for, by default the main one), every column.
    """
    out = out or sys.stdout
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    if step is not None and job is None:
        raise ConfigError("--step needs --job")
    if costs and step is not None:
        raise ConfigError("--costs is per job: drop --step (or use --job J alone)")
    names = list(tables) if tables else list(
        COST_TABLES if costs else
        DEFAULT_CHECKPOINT_TABLES if step is not None else DEFAULT_JOB_TABLES if job else DEFAULT_TABLES)
    unknown = [n for n in names if n not in TABLES]
    if unknown:
        raise ConfigError(f"--table {unknown[0]!r} is not a table; choose from {', '.join(TABLES)}")
    if fmt == "csv" and len(names) > 1 and tables:
        raise ConfigError(f"--format csv prints one table; you asked for {len(names)} ({', '.join(names)}): "
                          "pass one --table, or use --format json")
    with open_source(catalog_url, load_config(config_path)) as source:
        snap = Snapshot(source, now=now or datetime.now(UTC), job=job, step=step)
        if fmt == "csv":
            out.write(to_csv(snap.table(names[0])))
            return 0
        frames = {n: snap.table(n) for n in names}
    if fmt == "json":
        json.dump({n: records(df) for n, df in frames.items()}, out, indent=2)
        out.write("\n")
        return 0
    for i, (name, df) in enumerate(frames.items()):
        spec = TABLES[name]
        cols = [c for c in spec.columns if c.name in TERMINAL_COLUMNS.get(name, spec.column_names)]
        title = spec.title + (f" — {job}" if job and spec.scope != "catalog" else "")
        print(("\n" if i else "") + f"{title} ({len(df)})", file=out)
        if df.empty:
            print("  (none)", file=out)
            continue
        rows = [[display(r[c.name], c.kind) for c in cols] for r in df.to_dict("records")]
        numeric = [c.kind in NUMERIC for c in cols]
        print(text_table(rows, [c.title for c in cols], numeric), file=out)
        if name == "costs":
            currencies = sorted(set(df["currency"]))
            print(f"costs per month in {', '.join(currencies)}; expected restore = size over the fetch rate "
                  "the job's drills measured", file=out)
            for note in dict.fromkeys(df["price_note"]):
                print(f"prices: {note}", file=out)
    return 0
