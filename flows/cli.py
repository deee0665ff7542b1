"""The ``ckptier`` command line (the contract in DESIGN.md).

Commands that only read the catalog (``ls``, ``latest``, ``plan``) never
import Prefect or torch, so they answer at once. Commands that act (``scan``,
``verify``, ``apply``, ``drill``) run the same task code directly, or as a
Prefect flow run when ``PREFECT_API_URL`` is set (so the run shows in the
UI). Every user error exits non-zero with one line on stderr, never a
traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ckptier import __version__
from ckptier.storage.errors import CkptierError, ConfigError

from .output import checkpoint_json, human_bytes, iso, print_checkpoints, print_json, table

EXIT_USER_ERROR = 2
EXIT_NOT_FOUND = 1
#: ``apply`` skipped work because another live run holds it (sysexits' EX_TEMPFAIL: try again later).
EXIT_BUSY = 75



# ------------------------------------------------------------------ helpers


def _config(args: argparse.Namespace) -> Any:
    from ckptier.tasks.config import load_config

    return load_config(args.config)


def _catalog_url(args: argparse.Namespace) -> str | None:
    """``--catalog``, else the config file's ``[catalog] url``, else the default."""
    if args.catalog:
        return str(args.catalog)
    if os.environ.get("CKPTIER_CATALOG_URL"):
        return os.environ["CKPTIER_CATALOG_URL"]
    try:
        cfg = _config(args)
    except ConfigError:
        if args.config:
            raise
        return None
    return cfg.catalog_url


def _open_catalog(args: argparse.Namespace) -> Any:
    from ckptier.storage.catalog.api import Catalog

    return Catalog.open(_catalog_url(args))


def _use_prefect(args: argparse.Namespace) -> bool:
    """Go through a Prefect flow run when an API is configured (or forced)."""
    if getattr(args, "no_prefect", False):
        return False
    from .runner import configured_api_url

    return configured_api_url() is not None


# ------------------------------------------------------------------ read-only


def cmd_ls(args: argparse.Namespace) -> int:
    with _open_catalog(args) as cat:
        records = cat.checkpoints(job=args.job, include_deleted=args.all)
    if args.job and not records:
        from ckptier.tasks.pipeline import unknown_job

        raise unknown_job(args.job)
    if args.json:
        print_json([checkpoint_json(c) for c in records])
    else:
        print_checkpoints(records)
    return 0


def cmd_latest(args: argparse.Namespace) -> int:
    with _open_catalog(args) as cat:
        latest = cat.choose_latest(args.job, drilled=args.drilled)
        record = latest.record
        others = cat.checkpoints(job=args.job) if record is None else []
    passed = [{"step": step, "reason": why} for step, why in latest.passed_over]
    if record is None:
        if not others:
            reason = f"job {args.job!r} has no checkpoints in the catalog (scan it first, or check the name)"
        elif args.drilled:
            reason = (f"job {args.job!r} has no verified checkpoint whose most recent drill passed; "
                      f"run 'ckptier drill --job {args.job}'")
        else:
            states = sorted({c.state.value for c in others})
            reason = (
                f"job {args.job!r} has no verified checkpoint to resume from "
                f"({len(others)} checkpoints, states: {', '.join(states)}); run 'ckptier verify --job {args.job}'"
            )
        if passed:
            reason += "; passed over: " + "; ".join(f"step {p['step']}: {p['reason']}" for p in passed)
        if args.json:
            print_json({"job": args.job, "latest": None, "reason": reason, "passed_over": passed})
        print(f"ckptier: {reason}", file=sys.stderr)
        return EXIT_NOT_FOUND
    if args.json:
        print_json({**checkpoint_json(record), "passed_over": passed})
    else:
        proof = latest.proof.value if latest.proof is not None else "-"
        print(f"{record.job} step {record.step}: {record.location} ({record.format.value}, {human_bytes(record.bytes)}, "
              f"{proof} {iso(latest.proven_at)})")
        for p in passed:
            print(f"  passed over step {p['step']}: {p['reason']}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from ckptier.tasks.pipeline import make_plan, utcnow
    from ckptier.tasks.retention import render_plan_table

    config = _config(args)
    with _open_catalog(args) as cat:
        plan = make_plan(cat, config, job=args.job, now=utcnow())
    rows = render_plan_table(plan)
    for warning in plan.warnings:
        print(f"ckptier: warning: {warning}", file=sys.stderr)
    if args.json:
        print_json(rows)
        return 0
    table(
        [(r["job"], r["step"], r["state"], r["action"] + (" hot copy" if r["scope"] == "hot-copy" and r["action"] == "delete" else ""),
          human_bytes(r["bytes"]), "; ".join(r["reasons"])) for r in rows],
        ("JOB", "STEP", "STATE", "ACTION", "SIZE", "REASONS"),
    )
    s = plan.summary()
    print(f"\nkeep {s['keep']} ({human_bytes(s['bytes_kept'])}), promote {s['promote']} "
          f"({human_bytes(s['bytes_promoted'])}), delete {s['delete']} ({human_bytes(s['bytes_deleted'])})")
    if plan.refused:
        print(f"deletion suspended: {plan.refused}")
    return 0


# ------------------------------------------------------------------ acting


def cmd_scan(args: argparse.Namespace) -> int:
    from ckptier.flows import runner

    reports = runner.scan(args.urls, catalog_url=_catalog_url(args), use_prefect=_use_prefect(args), progress=not args.json,
                          config_path=args.config)
    if args.json:
        print_json(reports)
        return 0
    for r in reports:
        print(f"{r['url']}: {r['objects']:,} objects, {r['checkpoints']} checkpoints "
              f"({r['committed']} committed, {r['incomplete']} incomplete), {r['rows_written']} catalog rows written")
        for u in r["unrecognised"][:20]:
            print(f"  not recognised: {u['key']}: {u['reason']}")
        if len(r["unrecognised"]) > 20:
            print(f"  … and {len(r['unrecognised']) - 20} more not recognised (see --json)")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from ckptier.flows import runner
    from ckptier.tasks.verify import parse_sample

    sample = parse_sample(args.sample) if args.sample else None
    report = runner.verify(job=args.job, deep=args.deep, sample=sample, workers=args.workers,
                           catalog_url=_catalog_url(args), use_prefect=_use_prefect(args), progress=not args.json)
    if args.json:
        print_json(report)
    else:
        table([(r["job"], r["step"], r.get("tier", "hot"), r["state"], human_bytes(r["bytes_read"]),
                human_bytes(r["bytes_skipped"]), r["detail"] or "")
               for r in report["checkpoints"]], ("JOB", "STEP", "TIER", "STATE", "READ", "SKIPPED", "DETAIL"))
        t = report["totals"]
        archived = (f"; {t.get('archive_checked', 0)} archive copies read back, {t.get('archive_degraded', 0)} degraded"
                    if t.get("archive_checked") else "")
        print(f"\n{t['verified']} verified, {t['corrupt']} corrupt, {t['errors']} with errors{archived}; "
              f"read {human_bytes(t['bytes_read'])}, skipped {human_bytes(t['bytes_skipped'])} (native checksums)")
    return 1 if report["totals"]["corrupt"] or report["totals"].get("archive_degraded") else 0


def cmd_apply(args: argparse.Namespace) -> int:
    from ckptier.flows import runner

    report = runner.apply(job=args.job, dry_run=args.dry_run, config_path=args.config,
                          catalog_url=_catalog_url(args), use_prefect=_use_prefect(args))
    if args.json:
        print_json(report)
    else:
        for line in report["lines"]:
            print(line)
    if report.get("failed"):
        return 1
    if report.get("held"):
        print(f"ckptier: {len(report['held'])} item(s) skipped, held by another live run: {report['held'][0]}",
              file=sys.stderr)
        return EXIT_BUSY
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    from ckptier.flows import runner

    report = runner.fetch(job=args.job, step=args.step, dest=Path(args.dest), catalog_url=_catalog_url(args),
                          config_path=args.config)
    if args.json:
        print_json(report)
    else:
        print(f"{report['job']} step {report['step']}: {report['files']} files, {human_bytes(report['bytes'])} "
              f"from the {report['tier']} tier into {report['dest']} (hashes verified)")
    return 0


def cmd_drill(args: argparse.Namespace) -> int:
    from ckptier.flows import runner

    reports = runner.drill(job=args.job, step=args.step, steps=args.steps, device=args.device, model=args.model,
                           timeout=args.timeout, config_path=args.config, catalog_url=_catalog_url(args),
                           use_prefect=_use_prefect(args), allow_globals=args.allow_global or [])
    if args.json:
        print_json(reports)
    else:
        for r in reports:
            print(r["summary"])
            for c in r.get("checks", []):
                print(f"  [{'ok' if c['ok'] else 'FAIL'}] {c['name']}: {c['detail']}")
    return 0 if reports and all(r["ok"] for r in reports) else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from ckptier.flows.demo import run_demo

    return run_demo(Path(args.dir) if args.dir else None, steps=args.steps, use_prefect=not args.no_prefect)


def cmd_janitor(args: argparse.Namespace) -> int:
    from ckptier.flows import runner

    report = runner.janitor(config_path=args.config, older_than=args.older_than, catalog_url=_catalog_url(args))
    print_json(report) if args.json else [print(line) for line in report["lines"]]
    return 0


def cmd_forget(args: argparse.Namespace) -> int:
    from ckptier.tasks.pipeline import run_forget, utcnow
    from ckptier.tasks.retention import parse_duration

    if not args.missing:
        raise ConfigError("forget: say what to forget: --missing (rows whose files are gone from every tier)")
    older = parse_duration(args.older_than) if args.older_than else None
    config = _config(args)
    with _open_catalog(args) as cat:
        report = run_forget(cat, config, job=args.job, now=utcnow, older_than=older, dry_run=args.dry_run)
    print_json(report) if args.json else [print(line) for line in report["lines"]]
    return 1 if report["unchecked"] else 0


def cmd_serve(args: argparse.Namespace) -> int:
    from ckptier.deployments.serve import serve_all

    return serve_all()


def cmd_deploy(args: argparse.Namespace) -> int:
    from ckptier.deployments.serve import deploy_all

    return deploy_all(work_pool=args.work_pool, gpu_pool=args.gpu_pool)


def cmd_dashboard(args: argparse.Namespace) -> int:
    from ckptier.dashboard.cli import serve_dashboard

    from .runner import configured_api_url

    return serve_dashboard(catalog_url=_catalog_url(args), config_path=args.config, host=args.host, port=args.port,
                           token=args.token, prefect_api_url=configured_api_url())


def cmd_report(args: argparse.Namespace) -> int:
    from ckptier.dashboard.cli import print_report

    return print_report(catalog_url=_catalog_url(args), config_path=args.config, job=args.job, step=args.step,
                        fmt=args.format, tables=args.table)


# ------------------------------------------------------------------ parser


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptier", description="Keep training checkpoints safe and cheap.")
    p.add_argument("--version", action="version", version=f"ckptier {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--catalog", metavar="URL", help="catalog SQLAlchemy URL (default: $CKPTIER_CATALOG_URL, else SQLite in the user data dir)")
    common.add_argument("--config", metavar="PATH", help="ckptier.toml with [[policy]] and [[drill]] tables (default: $CKPTIER_CONFIG or ./ckptier.toml)")
    flowopts = argparse.ArgumentParser(add_help=False)
    flowopts.add_argument("--no-prefect", action="store_true", help="run directly even when PREFECT_API_URL is set")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func: Callable[[argparse.Namespace], int], help: str, *parents: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help, parents=[common, *parents])
        sp.set_defaults(func=func)
        return sp

    sp = add("scan", cmd_scan, "catalog every checkpoint under URL (a path, file:///path or s3://bucket/prefix)", flowopts)
    sp.add_argument("urls", nargs="+", metavar="URL")
    sp.add_argument("--json", action="store_true")

    sp = add("ls", cmd_ls, "list cataloged checkpoints")
    sp.add_argument("--job")
    sp.add_argument("--all", action="store_true", help="include deleted checkpoints (tombstones)")
    sp.add_argument("--json", action="store_true")

    sp = add("verify", cmd_verify, "prove checkpoint bytes intact (CRC64NVME, plus sha256 where the format records one)", flowopts)
    sp.add_argument("--job")
    sp.add_argument("--deep", action="store_true", help="read every byte even when the store keeps a checksum")
    sp.add_argument("--sample", metavar="K/N", help="verify only the K-th of N disjoint slices of the catalog")
    sp.add_argument("--workers", type=int, default=4, help="files read in parallel (default 4)")
    sp.add_argument("--json", action="store_true")

    sp = add("latest", cmd_latest, "newest verified checkpoint of a job whose last drill did not fail (exit 1 if none)")
    sp.add_argument("--job", required=True)
    sp.add_argument("--drilled", action="store_true", help="only a checkpoint whose most recent restore drill passed")
    sp.add_argument("--json", action="store_true")

    sp = add("plan", cmd_plan, "dry run of retention: keep / promote / delete, with reasons")
    sp.add_argument("--job")
    sp.add_argument("--json", action="store_true")

    sp = add("apply", cmd_apply, "carry out the retention plan: promote milestones, then delete what the policy lets go", flowopts)
    sp.add_argument("--job")
    sp.add_argument("--dry-run", action="store_true", help="say what would happen, change nothing")
    sp.add_argument("--json", action="store_true")

    sp = add("fetch", cmd_fetch, "restore a checkpoint's original files from any tier, verified")
    sp.add_argument("--job", required=True)
    sp.add_argument("--step", type=int, required=True)
    sp.add_argument("dest", metavar="DEST")
    sp.add_argument("--json", action="store_true")

    sp = add("drill", cmd_drill, "restore a checkpoint, train a few steps, record whether recovery works", flowopts)
    sp.add_argument("--job")
    sp.add_argument("--step", type=int)
    sp.add_argument("--steps", type=int, default=None, help="training steps (default 10, or the job's [[drill]] steps)")
    sp.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None)
    sp.add_argument("--model", metavar="MODULE:FUNCTION", help="model factory (see README: restore drills)")
    sp.add_argument("--timeout", type=float, default=None, help="seconds before the drill is killed")
    sp.add_argument("--allow-global", action="append", metavar="MODULE.NAME",
                    help="a class the safe loader may unpickle from this checkpoint (repeatable; adds to [[drill]] allow_globals)")
    sp.add_argument("--json", action="store_true")

    sp = add("janitor", cmd_janitor, "abort abandoned multipart uploads and remove what interrupted promotions left (only ckptier's own files)")
    sp.add_argument("--older-than", default="24h")
    sp.add_argument("--json", action="store_true")

    sp = add("forget", cmd_forget, "tombstone checkpoints a scan found missing once storage confirms them gone from every tier")
    sp.add_argument("--job", required=True)
    sp.add_argument("--missing", action="store_true", help="forget rows missing from hot storage (e.g. rotated away by the trainer)")
    sp.add_argument("--older-than", metavar="D", help="only checkpoints saved more than D ago (e.g. 7d)")
    sp.add_argument("--dry-run", action="store_true", help="look, but tombstone nothing")
    sp.add_argument("--json", action="store_true")

    sp = add("demo", cmd_demo, "the whole pipeline end to end on embedded defaults")
    sp.add_argument("--dir", help="where the demo's hot and archive tiers and catalog live (default: a new temp dir)")
    sp.add_argument("--steps", type=int, default=300, help="training steps of the demo run")
    sp.add_argument("--no-prefect", action="store_true", help="run the demo's steps directly, without Prefect flow runs")

    add("serve", cmd_serve, "serve every deployment with its schedule from this process (single host)")
    from .planning import add_commands

    add_commands(add)
    sp = add("deploy", cmd_deploy, "register every deployment to its work pool")
    sp.add_argument("--work-pool", default="ckptier-process")
    sp.add_argument("--gpu-pool", default="ckptier-gpu")

    sp = add("dashboard", cmd_dashboard, "serve the web dashboard over the catalog (http://127.0.0.1:8765/)")
    sp.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; any other needs a token)")
    sp.add_argument("--port", type=int, default=8765)
    sp.add_argument("--token", help="access token every request must present (default: $CKPTIER_DASHBOARD_TOKEN)")

    sp = add("report", cmd_report, "print the dashboard's tables: jobs and alerts, or one job's with --job")
    sp.add_argument("--job")
    sp.add_argument("--step", type=int, help="with --job: one checkpoint's tables")
    sp.add_argument("--format", choices=("table", "csv", "json"), default="table")
    sp.add_argument("--table", action="append", metavar="NAME", help="a table to print (repeatable): jobs, alerts, "
                    "checkpoints, plan, drills, verifications, events, storage, files, copies")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except CkptierError as exc:
        print(f"ckptier: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("ckptier: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (``ckptier ls | head``): not an error of ours.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
