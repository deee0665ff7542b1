"""The ``ckptier`` command line (the contract README.md documents).

Commands that only read the catalog (``ls``, ``latest``, ``plan``) never
import Prefect or torch, so they answer at once, and they never create a
catalog: pointed at one that does not exist they say which one they looked
for. Commands that act (``scan``, ``verify``, ``apply``, ``drill``) run the
same task code directly, or as a Prefect flow run when ``PREFECT_API_URL``
is set (so the run shows in the UI); only ``scan`` and ``rebuild`` create a catalog.

The catalog is chosen by one precedence (``--catalog``, ``CKPTIER_CATALOG_URL``,
``[catalog] url`` in ``ckptier.toml``, the default), and every command that
reads it names it (password masked) in the first line of its human output,
never in ``--json``. Every user error exits non-zero with one line on
stderr, never a traceback; input is checked before anything slow starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

from ckptier import __version__
from ckptier.storage.errors import CkptierError, ConfigError, EnvironmentFault

from .arguments import (
    STEP,
    WORKERS,
    Parser,
    UsageError,
    add_globals,
    apply_verbosity,
    check_globals,
    duration,
    finish,
    number,
    verbosity,
    whole,
)
from .command import announce, open_existing, settings_of
from .output import checkpoint_json, current_location, human_bytes, iso, print_checkpoints, print_json, table

EXIT_USER_ERROR = 2
EXIT_NOT_FOUND = 1
#: The machine refused (no space, a read-only filesystem, permissions...): one line with the path and the fix.
EXIT_ENVIRONMENT = 1
#: ``apply`` skipped work because another live run holds it (sysexits' EX_TEMPFAIL: try again later).
EXIT_BUSY = 75
#: Exit status of an error ckptier did not expect (a bug): one line, no traceback.
EXIT_INTERNAL = 70
#: Ctrl-C.
EXIT_INTERRUPTED = 130
#: Every exit status and what it means: docs/cli.md's table, which a test keeps equal to this.
EXIT_CODES: dict[int, str] = {
    0: "success",
    EXIT_NOT_FOUND: "the command ran and has a finding: no checkpoint to answer with (`latest`), damage found "
                    "(`verify`), a failed drill or apply step; or the machine refused (a full disk, a read-only "
                    "filesystem, no permission), said in one line with the path and the fix",
    EXIT_USER_ERROR: "bad input, refused before anything changed: a usage error, a value out of range, a broken "
                     "`ckptier.toml`, a catalog that does not exist or is in memory, an unknown job",
    EXIT_INTERNAL: "a bug (sysexits' EX_SOFTWARE): an error ckptier did not expect, in one line; rerun with "
                   "`CKPTIER_TRACEBACK=1` for the traceback and report it",
    EXIT_BUSY: "try again later (sysexits' EX_TEMPFAIL): `apply` skipped work another live run holds",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}
#: Set to print the traceback of an unexpected error (for a bug report).
TRACEBACK_ENV = "CKPTIER_TRACEBACK"
#: ``--runner`` choices (``ckptier.tasks.config.RUNNER_KINDS``, not imported: help answers at once).
RUNNERS = ("threads", "dask")
#: The demo saves every this many steps and needs two saves (one committed, one in flight).
DEMO_SAVE_EVERY = 25


# ------------------------------------------------------------------ helpers


def _use_prefect(args: argparse.Namespace) -> bool:
    """Go through a Prefect flow run when an API is configured (or forced)."""
    if getattr(args, "no_prefect", False):
        return False
    from ckptier.tasks.prefect_api import configured_api_url  # lazy: read-only commands never ask

    return configured_api_url() is not None


# ------------------------------------------------------------------ read-only


def cmd_ls(args: argparse.Namespace) -> int:
    with open_existing(args, settings_of(args)) as cat:
        # Files are counted, not loaded: a listing of 100,000 checkpoints needs no 300,000 file rows.
        records = cat.checkpoints(job=args.job, include_deleted=args.all, with_files=False)
        counts = cat.file_counts(job=args.job) if records else {}
    if args.job and not records:
        from ckptier.tasks.run import unknown_job  # lazy: ls answers without the kernel's imports

        raise unknown_job(args.job)
    if args.json:
        print_json([checkpoint_json(c, files=counts.get(c.id, 0)) for c in records])
    elif not records:
        print("no checkpoints cataloged yet; run 'ckptier scan URL' to catalog a checkpoint directory or prefix")
    else:
        print_checkpoints(records, file_counts=counts)
    return 0


def cmd_latest(args: argparse.Namespace) -> int:
    from ckptier.tasks.prove import latest_proven  # lazy: likewise
    from ckptier.tasks.run import StoreCache, utcnow  # lazy: likewise

    with open_existing(args, settings_of(args)) as cat:
        # The verdict is trusted only once each file was looked at now (a stat, never a read).
        latest = latest_proven(cat, StoreCache(roots=cat.hot_locations).for_record, args.job,
                               drilled=args.drilled, now=utcnow)
        record = latest.record
        others = cat.checkpoints(job=args.job, with_files=False) if record is None else []
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
        print(f"{record.job} step {record.step}: {current_location(record)} ({record.format.value}, "
              f"{human_bytes(record.bytes)}, {proof} {iso(latest.proven_at)})")
        for p in passed:
            print(f"  passed over step {p['step']}: {p['reason']}")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    if args.stats:
        extra = [name for name, given in (("--dest", args.dest), ("--quick", args.quick), ("--drilled", args.drilled))
                 if given]
        if extra:
            raise _usage(f"resume: --stats counts recorded resumes; it takes no {', '.join(extra)} "
                         "(see 'ckptier resume --help')")
        return _resume_stats(args)
    from ckptier.tasks.resume import ResumeError, ResumeOptions, run_resume  # lazy: --help stays light
    from ckptier.tasks.run import open_run  # lazy: likewise

    dest = Path(args.dest) if args.dest else None
    if dest is not None and dest.exists() and not dest.is_dir():
        raise _usage(f"resume: --dest {args.dest}: is a file; give a directory that fetched checkpoints go under")
    options = ResumeOptions(job=args.job, dest=dest, verify="quick" if args.quick else "full", drilled=args.drilled)
    settings = settings_of(args, config=True)
    announce(args, settings.location)
    with open_run(settings, owner="ckptier-resume") as run:
        try:
            answer = run_resume(run, options)
        except ResumeError as exc:
            if args.json:
                print_json({"job": args.job, "resume": None, "reason": _one_line(str(exc)),
                            "passed_over": [{"step": s, "reason": r} for s, r in exc.passed_over]})
            print(f"ckptier: {_one_line(str(exc))}", file=sys.stderr)
            return EXIT_NOT_FOUND
    if args.json:
        print_json(answer.to_json())
        return 0
    how = "every byte read now" if answer.verify == "full" else "each file looked at now"
    print(f"{answer.job} step {answer.step}: {answer.path}")
    print(f"  {answer.proof}, {how}; from the {answer.source} {'copy' if answer.source != 'fetched' else 'tier'}"
          f", {answer.seconds:.3f} s")
    for step, why in answer.passed_over:
        print(f"  passed over step {step}: {why}")
    return 0


def _resume_stats(args: argparse.Namespace) -> int:
    from ckptier.tasks.resume import recovery_rates  # lazy: likewise
    from ckptier.tasks.run import utcnow  # lazy: likewise

    with open_existing(args, settings_of(args)) as cat:
        rates = recovery_rates(cat.recoveries(job=args.job), cat.drills(job=args.job, limit=100_000), now=utcnow())
    if args.json:
        print_json([r.to_json() for r in rates])
        return 0
    if not rates:
        print(f"job {args.job!r}: no resumes or drills recorded yet")
        return 0

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.0f}%"

    table([(r.job, "all" if r.days is None else f"{r.days}d", f"{r.resumed}/{r.attempted}", pct(r.rate),
            f"{r.drills_passed}/{r.drills}", pct(r.drill_rate)) for r in rates],
          ("JOB", "WINDOW", "RESUMED", "RATE", "DRILLS PASSED", "RATE"))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from ckptier.tasks.pipeline import merge_plans, plans_by_policy  # lazy: --version and --help stay light
    from ckptier.tasks.prove import prove_keepers  # lazy: likewise
    from ckptier.tasks.retention import floors, render_plan_table  # lazy: likewise
    from ckptier.tasks.run import open_run  # lazy: likewise
    from ckptier.tasks.settings import policy_origin, unwritten_policy_problem  # lazy: likewise

    settings = settings_of(args, config=True)
    config = settings.config
    announce(args, settings.location)
    with open_run(settings) as run:
        # The checkpoints the deletions rest on are looked at now (a stat each): one whose files
        # changed since its verdict is no longer trusted, and the plan rests on others.
        prove_keepers(run.catalog, run.stores.for_record, run.catalog.checkpoints(job=args.job), config.policy_for,
                      now=run.now)
        by_policy = plans_by_policy(run, job=args.job)
    plan = merge_plans([p for _, p in by_policy])
    rows = render_plan_table(plan)
    for warning in plan.warnings:
        print(f"ckptier: warning: {warning}", file=sys.stderr)
    if args.json:
        print_json(rows)
        return 0
    for policy, _ in by_policy:
        if policy is not None:
            index = next(i for i, p in enumerate(config.policies) if p is policy)
            print(f"policy: {policy_origin(config, index, args.config)}")
            print(f"  floors: {'; '.join(str(f) for f in floors(policy))}")
    if not rows:
        print("no checkpoints cataloged yet; run 'ckptier scan URL' first")
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
    problem = unwritten_policy_problem(config, {r["job"] for r in rows}, args.config)
    if problem is not None:
        print(f"preview only: {problem}")
    return 0


# ------------------------------------------------------------------ acting


def cmd_scan(args: argparse.Namespace) -> int:
    from ckptier.flows import runner  # lazy: the acting commands' imports, only when one runs

    settings = settings_of(args)
    announce(args, settings.location)
    reports = runner.scan(args.urls, settings=settings, use_prefect=_use_prefect(args), progress=not args.json,
                          inventory=args.inventory, full=args.full)
    if args.json:
        print_json([r.to_json() for r in reports])
        return 0
    for r in reports:
        print(f"{r.url}: {r.objects:,} objects, {r.checkpoints} checkpoints "
              f"({r.committed} committed, {r.incomplete} incomplete), {r.rows_written} catalog rows written")
        if r.unchanged_dirs:
            print(f"  {r.unchanged_dirs:,} checkpoint directories unchanged since the last scan were not listed "
                  "(--full lists everything)")
        if r.inventory is not None:
            taken = r.inventory_created_at.isoformat() if r.inventory_created_at else None
            print(f"  from the S3 Inventory report {r.inventory} taken {taken} "
                  f"({(r.inventory_age_s or 0) / 3600:.1f} h ago); {r.left_as_cataloged} checkpoints left as the catalog "
                  "has them; nothing marked missing")
        for u in r.unrecognised[:20]:
            print(f"  not recognised: {u.key}: {u.reason}")
        if len(r.unrecognised) > 20:
            print(f"  … and {len(r.unrecognised) - 20} more not recognised (see --json)")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from ckptier.flows import runner  # lazy: the acting commands' imports, only when one runs

    sample = runner.resolve_sample(args.sample) if args.sample else None
    settings = settings_of(args)
    announce(args, settings.location)
    from ckptier.tasks.pipeline import VerifyOptions  # lazy: the acting commands' imports, only when one runs

    options = VerifyOptions(job=args.job, deep=args.deep, sample=sample, workers=args.workers)
    report = runner.verify(options, settings=settings, use_prefect=_use_prefect(args), progress=not args.json,
                           runner=args.runner, claim_rows=args.claim_rows, since=args.since)
    if args.json:
        print_json(report.to_json())
    elif not report.checkpoints:
        print(f"nothing to verify: {report.nothing_checked}")
    else:
        table([(r.job, r.step, r.tier, r.state, human_bytes(r.bytes_read), human_bytes(r.bytes_skipped), r.detail or "")
               for r in report.checkpoints], ("JOB", "STEP", "TIER", "STATE", "READ", "SKIPPED", "DETAIL"))
        t = report.totals
        archived = (f"; {t.archive_checked} archive copies read back, {t.archive_degraded} degraded"
                    if t.archive_checked else "")
        print(f"\n{t.verified} verified, {t.corrupt} corrupt, {t.errors} with errors{archived}; "
              f"read {human_bytes(t.bytes_read)}, skipped {human_bytes(t.bytes_skipped)} (native checksums)")
    return 1 if report.totals.found_damage else 0


def cmd_apply(args: argparse.Namespace) -> int:
    from ckptier.flows import runner  # lazy: the acting commands' imports, only when one runs

    settings = settings_of(args, config=True)
    announce(args, settings.location)
    report = runner.apply(job=args.job, dry_run=args.dry_run, settings=settings, use_prefect=_use_prefect(args),
                          runner=args.runner)
    if args.json:
        print_json(report.to_json())
    else:
        for line in report.lines:
            print(line)
    if report.failed:
        return 1
    if report.held:
        print(f"ckptier: {len(report.held)} item(s) skipped, held by another live run: {report.held[0]}",
              file=sys.stderr)
        return EXIT_BUSY
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    from ckptier.flows import runner  # lazy: the acting commands' imports, only when one runs
    from ckptier.tasks.archive import check_fetch_dest  # lazy: likewise

    dest = Path(args.dest)
    check_fetch_dest(dest)  # before the catalog is even opened
    settings = settings_of(args, config=True)
    announce(args, settings.location)
    report = runner.fetch(job=args.job, step=args.step, dest=dest, settings=settings)
    if args.json:
        print_json(report.to_json())
    else:
        print(f"{report.job} step {report.step}: {report.files} files, {human_bytes(report.bytes)} "
              f"from the {report.tier} tier into {report.dest} (hashes verified)")
    return 0


def cmd_drill(args: argparse.Namespace) -> int:
    from ckptier.flows import runner  # lazy: the acting commands' imports, only when one runs
    from ckptier.tasks.drill_inputs import check_drill_inputs, normalise_factory  # lazy: likewise

    model = normalise_factory(args.model) if args.model and ":" in args.model else args.model
    check_drill_inputs(model=model, device=args.device, steps=args.steps, timeout=args.timeout)
    settings = settings_of(args, config=True)
    announce(args, settings.location)
    from ckptier.tasks.pipeline import DrillOptions  # lazy: the acting commands' imports, only when one runs

    options = DrillOptions(job=args.job, step=args.step, steps=args.steps, device=args.device, model=model,
                                  timeout=args.timeout, allow_globals=tuple(args.allow_global or ()),
                                  world_size=args.world_size)
    reports = runner.drill(options, settings=settings, use_prefect=_use_prefect(args), runner=args.runner)
    if args.json:
        print_json([r.to_json() for r in reports])
    else:
        for r in reports:
            print(r.summary)
            for c in r.checks:
                if c.ok or c.detail not in r.summary:
                    print(f"  [{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}")
    return 0 if reports and all(r.ok for r in reports) else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from ckptier.flows.demo import run_demo  # lazy: the demo's imports (torch), only when it runs

    if args.steps < 2 * DEMO_SAVE_EVERY:
        raise _usage(f"--steps {args.steps}: the demo saves every {DEMO_SAVE_EVERY} steps and needs at least two "
                     f"saves; give --steps {2 * DEMO_SAVE_EVERY} or more (default 300)")
    base = Path(args.dir) if args.dir else None
    if base is not None and base.exists() and not base.is_dir():
        raise _usage(f"--dir {args.dir}: is a file, not a directory; give a new or empty directory")
    return run_demo(base, steps=args.steps, use_prefect=not args.no_prefect, verbosity=verbosity(args))


def cmd_janitor(args: argparse.Namespace) -> int:
    from ckptier.flows import runner  # lazy: the acting commands' imports, only when one runs
    older_than: timedelta = args.older_than  # a duration of at least 1s (the parser's type)
    settings = settings_of(args, config=True)
    announce(args, settings.location)
    report = runner.janitor(older_than=older_than, settings=settings)
    if args.json:
        print_json(report.to_json())
    else:
        for line in report.lines:
            print(line)
    return 0


def cmd_forget(args: argparse.Namespace) -> int:
    from ckptier.tasks.pipeline import run_forget  # lazy: --version and --help stay light
    from ckptier.tasks.run import open_run  # lazy: likewise

    if not args.missing:
        raise ConfigError("forget: say what to forget: --missing (rows whose files are gone from every tier)")
    older: timedelta | None = args.older_than  # the parser's type
    settings = settings_of(args, config=True)
    announce(args, settings.location)
    with open_run(settings, dry_run=args.dry_run) as run:
        report = run_forget(run, job=args.job, older_than=older)
    print_json(report.to_json()) if args.json else [print(line) for line in report.lines]
    return 1 if report.unchecked else 0


def cmd_serve(args: argparse.Namespace) -> int:
    from ckptier.deployments.serve import serve_all  # lazy: Prefect, only when serving

    return serve_all()


def cmd_deploy(args: argparse.Namespace) -> int:
    from ckptier.deployments.serve import deploy_all  # lazy: Prefect, only when deploying

    return deploy_all(work_pool=args.work_pool, gpu_pool=args.gpu_pool)


def cmd_dashboard(args: argparse.Namespace) -> int:
    from ckptier.dashboard.cli import serve_dashboard  # lazy: the web server's imports, only when serving
    from ckptier.tasks.prefect_api import configured_api_url  # lazy: likewise

    return serve_dashboard(catalog_url=settings_of(args).location.url, config_path=args.config, host=args.host, port=args.port,
                           token=args.token, prefect_api_url=configured_api_url())


def cmd_report(args: argparse.Namespace) -> int:
    from ckptier.dashboard.cli import print_report  # lazy: pandas, only for a report

    location = settings_of(args).location
    if args.format == "table":
        announce(args, location)
    return print_report(catalog_url=location.url, config_path=args.config, job=args.job, step=args.step,
                        fmt=args.format, tables=args.table, costs=args.costs)


def cmd_completion(args: argparse.Namespace) -> int:
    from .completion import script  # lazy: only when asked

    print(script(build_parser(), args.shell), end="")
    return 0


# ------------------------------------------------------------------ parser


def _usage(message: str) -> UsageError:
    return UsageError(message)


#: ``--timeout`` of a drill: seconds, up to 30 days.
_SECONDS = number(0, 30 * 86400, what="a number of seconds")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="ckptier", description="Keep training checkpoints safe and cheap.",
               epilog="Global options (--catalog, --config, -v, -q, --json) go before or after the command. "
                      "Exit codes: docs/cli.md.")
    p.add_argument("--version", action="version", version=f"ckptier {__version__}")
    add_globals(p, before_command=True)
    common = Parser(add_help=False)
    add_globals(common, before_command=False)
    flowopts = Parser(add_help=False)
    flowopts.add_argument("--no-prefect", action="store_true", help="run directly even when PREFECT_API_URL is set")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)

    def add(name: str, func: Callable[[argparse.Namespace], int], help: str, *parents: Parser) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help, parents=[common, *parents])
        sp.set_defaults(func=func)
        return sp

    sp = add("scan", cmd_scan, "catalog every checkpoint under URL (a path, file:///path or s3://bucket/prefix)", flowopts)
    sp.add_argument("urls", nargs="+", metavar="URL")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--inventory", metavar="MANIFEST",
                    help="read this S3 Inventory report (s3://.../manifest.json, or the inventory configuration's "
                         "folder for its newest report) instead of listing the bucket")
    sp.add_argument("--full", action="store_true",
                    help="list every local directory, even those unchanged since the last scan")

    sp = add("ls", cmd_ls, "list cataloged checkpoints")
    sp.add_argument("--job")
    sp.add_argument("--all", action="store_true", help="include deleted checkpoints (tombstones)")
    sp.add_argument("--json", action="store_true")

    sp = add("verify", cmd_verify, "prove checkpoint bytes intact (CRC64NVME, plus sha256 where the format records one)", flowopts)
    sp.add_argument("--job")
    sp.add_argument("--deep", action="store_true", help="read every byte even when the store keeps a checksum")
    sp.add_argument("--sample", metavar="K/N", help="verify only the K-th of N disjoint slices of the catalog (auto/N: today's slice)")
    sp.add_argument("--workers", type=WORKERS, default=4, help="files read in parallel (default 4)")
    sp.add_argument("--runner", choices=RUNNERS, help="where files are read: threads here, or dask "
                    "(default: [runner] kind in ckptier.toml, else threads)")
    sp.add_argument("--claim-rows", action="store_true", help="share the work with other ckptier processes on "
                    "this catalog: claim rows under a lease (default: [runner] claim_rows)")
    sp.add_argument("--since", metavar="TIME", help="with --claim-rows: ISO 8601 start of the sweep the processes "
                    "share; rows checked since are done (default: now)")
    sp.add_argument("--json", action="store_true")

    sp = add("latest", cmd_latest, "newest verified checkpoint of a job whose last drill did not fail (exit 1 if none)")
    sp.add_argument("--job", required=True)
    sp.add_argument("--drilled", action="store_true", help="only a checkpoint whose most recent restore drill passed")
    sp.add_argument("--json", action="store_true")

    sp = add("resume", cmd_resume, "newest checkpoint of a job proven now, fetched into --dest when only archived: "
             "the path to load from and the step (exit 1 if none can be proven)")
    sp.add_argument("--job", required=True)
    sp.add_argument("--dest", metavar="DIR", help="where a checkpoint with no hot copy is fetched "
                    "(into DIR/JOB/step-NNNNNNNN)")
    sp.add_argument("--drilled", action="store_true", help="only a checkpoint whose most recent restore drill passed")
    sp.add_argument("--quick", action="store_true", help="prove by a stat (or HEAD) of each file, not a full read")
    sp.add_argument("--stats", action="store_true", help="the job's recovery rate: resumes succeeded / attempted and "
                    "drills passed / judged, over 7 and 30 days and all time")
    sp.add_argument("--json", action="store_true")

    sp = add("plan", cmd_plan, "dry run of retention: keep / promote / delete, with reasons")
    sp.add_argument("--job")
    sp.add_argument("--json", action="store_true")

    sp = add("apply", cmd_apply, "carry out the retention plan: promote milestones, then delete what the policy lets go", flowopts)
    sp.add_argument("--job")
    sp.add_argument("--dry-run", action="store_true", help="say what would happen, change nothing")
    sp.add_argument("--runner", choices=RUNNERS, help="where archive copies are made: threads here, or dask "
                    "(default: [runner] kind in ckptier.toml, else threads)")
    sp.add_argument("--json", action="store_true")

    sp = add("fetch", cmd_fetch, "restore a checkpoint's original files from any tier, verified, into a new directory DEST")
    sp.add_argument("--job", required=True)
    sp.add_argument("--step", type=STEP, required=True)
    sp.add_argument("dest", metavar="DEST")
    sp.add_argument("--json", action="store_true")

    sp = add("drill", cmd_drill, "restore a checkpoint, train a few steps, record whether recovery works", flowopts)
    sp.add_argument("--job")
    sp.add_argument("--step", type=STEP)
    sp.add_argument("--steps", type=whole(1, 1_000_000, what="a number of training steps"), default=None, help="training steps (default 10, or the job's [[drill]] steps)")
    sp.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None)
    sp.add_argument("--model", metavar="MODULE:FUNCTION", help="model factory (see README: restore drills)")
    sp.add_argument("--timeout", type=_SECONDS, default=None, help="seconds before the drill is killed")
    sp.add_argument("--allow-global", action="append", metavar="MODULE.NAME",
                    help="a class the safe loader may unpickle from this checkpoint (repeatable; adds to [[drill]] allow_globals)")
    sp.add_argument("--world-size", type=whole(1, 65_536, what="a number of ranks"), default=None, metavar="M",
                    help="restore into M ranks (default: as many as saved the checkpoint) and say whether the run resumes on M")
    sp.add_argument("--runner", choices=RUNNERS, help="where the checkpoint's files are fetched: threads here, or dask "
                    "(default: [runner] kind in ckptier.toml, else threads)")
    sp.add_argument("--json", action="store_true")

    sp = add("janitor", cmd_janitor, "abort abandoned multipart uploads and remove what interrupted promotions left (only ckptier's own files)")
    sp.add_argument("--older-than", metavar="D", default="24h",
                    type=duration(why="uploads still being written would be removed"),
                    help="only uploads and leftovers older than D (default 24h)")
    sp.add_argument("--json", action="store_true")

    sp = add("forget", cmd_forget, "tombstone checkpoints a scan found missing once storage confirms them gone from every tier")
    sp.add_argument("--job", required=True)
    sp.add_argument("--missing", action="store_true", help="forget rows missing from hot storage (e.g. rotated away by the trainer)")
    sp.add_argument("--older-than", metavar="D", type=duration(timedelta(0)),
                    help="only checkpoints saved more than D ago (e.g. 7d)")
    sp.add_argument("--dry-run", action="store_true", help="look, but tombstone nothing")
    sp.add_argument("--json", action="store_true")

    sp = add("demo", cmd_demo, "the whole pipeline end to end on embedded defaults")
    sp.add_argument("--dir", help="where the demo's hot and archive tiers and catalog live (default: a new temp dir)")
    sp.add_argument("--steps", type=whole(0, 100_000, what="a number of training steps"), default=300,
                    help="training steps of the demo run")
    sp.add_argument("--no-prefect", action="store_true", help="run the demo's steps directly, without Prefect flow runs")

    add("serve", cmd_serve, "serve every deployment with its schedule from this process (single host)")
    from .planning import add_commands  # here: planning registers its commands with add(), defined just above
    from .recovery import add_commands as add_recovery_commands  # likewise

    add_commands(add)
    add_recovery_commands(add)
    sp = add("deploy", cmd_deploy, "register every deployment to its work pool")
    sp.add_argument("--work-pool", default="ckptier-process")
    sp.add_argument("--gpu-pool", default="ckptier-gpu")

    sp = add("dashboard", cmd_dashboard, "serve the web dashboard over the catalog (http://127.0.0.1:8765/)")
    sp.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; any other needs a token)")
    sp.add_argument("--port", type=whole(1, 65_535, what="a TCP port"), default=8765)
    sp.add_argument("--token", help="access token every request must present (default: $CKPTIER_DASHBOARD_TOKEN)")

    sp = add("completion", cmd_completion, "print a shell completion script made from this command line "
             "(e.g. ckptier completion bash > ~/.local/share/bash-completion/completions/ckptier)")
    sp.add_argument("shell", choices=("bash", "zsh", "fish"))

    sp = add("report", cmd_report, "print the dashboard's tables: jobs and alerts, or one job's with --job")
    sp.add_argument("--job")
    sp.add_argument("--step", type=STEP, help="with --job: one checkpoint's tables")
    sp.add_argument("--costs", action="store_true", help="bytes and monthly cost per tier and class, savings "
                    "against keep-all, recovery point, expected restore time")
    sp.add_argument("--format", choices=("table", "csv", "json"), default="table")
    sp.add_argument("--table", action="append", metavar="NAME", help="a table to print (repeatable): jobs, alerts, "
                    "checkpoints, plan, drills, verifications, events, storage, files, copies, costs, cost_tiers")
    return finish(p)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def environment_error(exc: BaseException) -> EnvironmentFault | None:
    """The machine's own refusal behind ``exc`` (it, or an exception it was raised
    from): an :class:`EnvironmentFault` a layer already named, an ``OSError``
    such as ENOSPC, EROFS, EACCES or ENOENT on a parent (named by its path),
    or a database's "disk is full"; None when ``exc`` is none of those (a bug)."""
    from ckptier.storage.errors import environment_fault

    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, EnvironmentFault):
            return cause
        if isinstance(cause, OSError):
            path = cause.filename if cause.filename is not None else "a file"
            fault = environment_fault(cause, os.fsdecode(path) if not isinstance(path, str) else path)
            if fault is not None:
                return fault
        if type(cause).__module__.startswith("sqlalchemy"):
            from ckptier.storage.catalog.db import catalog_fault

            fault = catalog_fault("(this command's catalog)", cause)
            if fault is not None:
                return fault
        cause = cause.__cause__ or cause.__context__
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status. Bad input and what ckptier refuses are one
    line and 2 (1, 75 as each command documents); what the machine refused (a full
    disk, a read-only filesystem, no permission...) is one line naming the path
    and the fix, and 1; anything else is a bug: one line, 70."""
    try:
        args = build_parser().parse_args(argv)
        check_globals(args)
        undo = apply_verbosity(verbosity(args))
        try:
            return int(args.func(args))
        finally:
            undo()
    except EnvironmentFault as exc:
        print(f"ckptier: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    except CkptierError as exc:  # already one line, said on purpose (whatever it was raised from)
        print(f"ckptier: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("ckptier: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (``ckptier ls | head``): not an error of ours.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except Exception as exc:  # noqa: BLE001 - the last line of defence: never a traceback
        fault = environment_error(exc)
        if fault is not None:
            print(f"ckptier: {_one_line(str(fault))}", file=sys.stderr)
            return EXIT_ENVIRONMENT
        if os.environ.get(TRACEBACK_ENV):
            raise
        print(f"ckptier: unexpected error {type(exc).__name__}: {_one_line(str(exc))[:300]} "
              f"(a bug: please report it with the output of {TRACEBACK_ENV}=1 ckptier ...)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
