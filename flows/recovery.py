"""The recovery commands: ``ckptier rebuild`` and ``ckptier catalog backup``.

Thin: parse, open the run, call :func:`ckptier.tasks.rebuild.rebuild` or
:func:`ckptier.tasks.backup.backup_catalog`, print (``--json``: the typed
report's ``to_json()``). Neither starts Prefect or imports torch.

``rebuild`` is a command of its own rather than ``scan --rebuild``: it fills
an empty catalog (or resumes one a killed rebuild started) and refuses any
other, reads the archive and its backups (which ``scan`` never treats as
checkpoints), and reports what came from where and what could not be
recovered; ``scan`` brings an existing catalog up to date with one listing.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


from .arguments import WORKERS
from .command import announce, settings_of


def cmd_rebuild(args: argparse.Namespace) -> int:
    from ckptier.tasks.rebuild import rebuild  # lazy: --version and --help stay light
    from ckptier.tasks.run import open_run  # lazy: likewise

    settings = settings_of(args, config=True)
    announce(args, settings.location)
    with open_run(settings, owner="ckptier-rebuild", create=True) as run:
        report = rebuild(run.catalog, run.config, store=run.stores.store, now=run.now, hot_urls=args.urls,
                         archive_urls=args.archive or (), **({"workers": args.workers} if args.workers else {}))
    return _printed(args, report)


def cmd_catalog(args: argparse.Namespace) -> int:
    from ckptier.tasks.backup import backup_catalog, policy_archives  # lazy: --version and --help stay light
    from ckptier.tasks.run import open_run, unknown_job  # lazy: likewise

    settings = settings_of(args, config=True)
    announce(args, settings.location)
    with open_run(settings, owner="ckptier-backup") as run:
        jobs = run.catalog.jobs()
        if args.job is not None and args.job not in jobs:
            raise unknown_job(args.job)
        report = backup_catalog(run.catalog, policy_archives(run.config, run.stores.store), now=run.now(),
                                jobs=[args.job] if args.job else jobs)
    return _printed(args, report)


def _printed(args: argparse.Namespace, report: Any) -> int:
    """Print ``report`` (``--json``: its ``to_json()``, else its lines); exit 0 when it is ok, else 1."""
    from .output import print_json  # lazy: every command builds this parser; output's imports only to print

    if args.json:
        print_json(report.to_json())
    else:
        for line in report.lines():
            print(line)
    return 0 if report.ok else 1


def add_commands(add: Callable[..., argparse.ArgumentParser]) -> None:
    """Register ``rebuild`` and ``catalog`` with the CLI's ``add`` helper (importing nothing
    more: every command builds this parser)."""
    sp = add("rebuild", cmd_rebuild, "rebuild a lost catalog from storage: the catalog backups and manifests in the "
             "archive, and the hot checkpoints (into an empty catalog; never deletes anything)")
    sp.add_argument("urls", nargs="*", metavar="HOT_URL",
                    help="hot locations to scan (default: those the backups record, else the manifests' sources)")
    sp.add_argument("--archive", action="append", metavar="URL",
                    help="archive location to read (repeatable; default: every [[policy]] archive)")
    sp.add_argument("--workers", type=WORKERS, default=None, help="manifests read and copies proven at once (default 8)")
    sp.add_argument("--json", action="store_true")

    sp = add("catalog", cmd_catalog, "catalog maintenance: 'backup' writes each job's catalog backup to its archive "
             "tier now (apply does after every run)")
    sp.add_argument("action", choices=("backup",))
    sp.add_argument("--job", help="only this job (default: every job whose policy names an archive)")
    sp.add_argument("--json", action="store_true")
