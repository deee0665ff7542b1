"""The handlers of the ``ckptier`` commands that :mod:`ckptier.flows.cli` registers.

:mod:`ckptier.flows.cli` builds the parser without importing this module; it
is imported once a command of it was chosen (the command table's lazy
handlers), so ``--version``, ``--help`` and a usage error never pay for it.
Each handler imports what only it needs inside itself: ``ls`` and ``latest``
read the catalog through SQLAlchemy Core and import neither the ORM, the
formats, the archive codec, numpy, torch nor Prefect.
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from pathlib import Path

from ckptier.storage.errors import ConfigError

from .arguments import UsageError, verbosity
from .command import announce, open_existing, open_reading, settings_of
from .exits import EXIT_BUSY, EXIT_NOT_FOUND
from .exits import one_line as _one_line
from .output import checkpoint_json, current_location, human_bytes, iso, print_checkpoints, print_json, table

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
    with open_reading(args, settings_of(args)) as cat:
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

    with open_reading(args, settings_of(args)) as cat:
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
            raise UsageError(f"resume: --stats counts recorded resumes; it takes no {', '.join(extra)} "
                         "(see 'ckptier resume --help')")
        return _resume_stats(args)
    from ckptier.tasks.resume import ResumeError, ResumeOptions, run_resume  # lazy: --help stays light
    from ckptier.tasks.run import open_run  # lazy: likewise

    dest = Path(args.dest) if args.dest else None
    if dest is not None and dest.exists() and not dest.is_dir():
        raise UsageError(f"resume: --dest {args.dest}: is a file; give a directory that fetched checkpoints go under")
    options = ResumeOptions(job=args.job, dest=dest, verify="quick" if args.quick else "full", drilled=args.drilled)
    # The config is read first when the resume will use it (a broken one is reported before anything
    # else); a --quick one that fetches nothing never does, and costs what `latest` costs.
    settings = settings_of(args, config=options.needs_config)
    announce(args, settings.location)
    with open_run(settings, owner="ckptier-resume", config_on_use=True) as run:
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
    from ckptier.storage.records import State  # lazy: likewise

    settings = settings_of(args, config=True)
    config = settings.config
    announce(args, settings.location)
    with open_run(settings) as run:
        cat = run.catalog
        # Read once and without files (the planner needs none): 100,000 checkpoints, not their 300,000 file rows.
        records = cat.checkpoints(job=args.job, include_deleted=True, with_files=False)
        # The checkpoints the deletions rest on are looked at now (a stat each, their files read for it): one
        # whose files changed since its verdict is no longer trusted, and the plan rests on others.
        proven = prove_keepers(cat, run.stores.for_record, [r for r in records if r.state != State.DELETED],
                               config.policy_for, now=run.now, files_of=lambda r: cat.get(r.job, r.step))
        if any(p.verdict == "changed" for p in proven):  # settled: their states moved, so read them again
            records = cat.checkpoints(job=args.job, include_deleted=True, with_files=False)
        by_policy = plans_by_policy(run, job=args.job, records=records)
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
    from ckptier.tasks.verify_run import VerifyOptions  # lazy: the acting commands' imports, only when one runs

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
    from ckptier.tasks.archive import limit_malloc_arenas  # lazy: likewise

    limit_malloc_arenas()  # a promotion's many short-lived threads would each get an arena (docs/benchmarks.md)
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
        raise UsageError(f"--steps {args.steps}: the demo saves every {DEMO_SAVE_EVERY} steps and needs at least two "
                     f"saves; give --steps {2 * DEMO_SAVE_EVERY} or more (default 300)")
    base = Path(args.dir) if args.dir else None
    if base is not None and base.exists() and not base.is_dir():
        raise UsageError(f"--dir {args.dir}: is a file, not a directory; give a new or empty directory")
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
