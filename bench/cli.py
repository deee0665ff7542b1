"""How fast the commands answer, each against the baseline it is held to, in one run.

A training launcher calls ``ckptier latest --job J --json`` at every start, so
the read-only commands must cost little more than starting Python with the
database library. This script builds (once, then reuses) two SQLite catalogs
under ``/tmp/ckptier-bench-cli``: 100,000 checkpoints in 100 jobs of 1,000
steps, and 100,000 in one job (for ``plan``), 3 files each, all verified, in
the guide's layout. It then times real processes, interpreter start and
imports included, best of ``--repeat``, interleaved so that every contender
sees the same machine load, and prints each one's ratio to its named
baseline, measured in the same run:

* ``ckptier --version`` against ``python -c pass`` (target: at most 2x);
* ``ckptier latest --job J --json``, ``latest --job J``, ``ls --job J --json``
  (1,000 rows) and ``ls --job J`` against ``python -c "import sqlalchemy"``
  (target: at most 1.2x), and ``plan --job J`` (no target);
* ``ckptier ls --json`` and ``ckptier ls`` over all 100,000 checkpoints against
  a Python process that reads the same rows with :mod:`sqlite3` and prints
  them as JSON, one object per line as ``ls --json`` does (the floor for
  printing 100,000 rows from Python; no target);
* ``ckptier plan --json`` on the one job of 100,000 against in-process
  planning: in a process that has already imported everything and opened the
  catalog, the catalog read and the planning ``plan`` does
  (``Catalog.checkpoints`` without files, then ``plans_by_policy``), timed
  inside it (target: at most 2x);
* ``ckptier resume --job J --quick --json`` against ``ckptier latest --job J
  --json`` (target: at most 1.5x): the newest checkpoint proven now by a
  ``stat`` of each of its files and the recovery event recorded. The files
  of that checkpoint (only that one) are written for real under
  ``DIR/runs``, with the sizes and mtimes the catalog holds, so that both
  commands find it intact; the other checkpoints are not on disk.

Building the catalogs takes about half a minute the first time; a run about a minute.

Run: ``python bench/cli.py [--checkpoints 100000] [--jobs 100] [--repeat 5] [--rebuild] [--dir DIR]``
(with the ``ckptier`` of the same environment next to the interpreter, or on ``PATH``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sqlite3
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import process

ROOT = Path("/tmp/ckptier-bench-cli")
FILES = ("rank-0000/model.pt", "rank-0000/optimizer.pt", "metadata.json")
#: The size the catalog records for ``FILES[i]``.
SIZES = tuple(1000 + i for i in range(len(FILES)))

#: Reads every checkpoint row and prints it as JSON: what printing 100,000 rows costs at least.
SQLITE_REFERENCE = r"""
import json, sqlite3, sys
conn = sqlite3.connect(sys.argv[1])
rows = conn.execute(
    "SELECT j.name, c.step, c.format, c.state, c.bytes, c.file_count, c.location, c.saved_at, c.verified_at "
    "FROM checkpoints c JOIN jobs j ON j.id = c.job_id WHERE c.state != 'deleted' ORDER BY j.name, c.step"
).fetchall()
keys = ("job", "step", "format", "state", "bytes", "files", "location", "saved_at", "verified_at")
sys.stdout.write("[\n" + ",\n".join("  " + json.dumps(dict(zip(keys, r))) for r in rows) + "\n]\n")
"""


def mtime_of(step: int) -> float:
    """The mtime the catalog records for the files of ``step``."""
    return 1.7e9 + step


def materialize(runs: Path, job: str, step: int) -> Path:
    """Write the files of ``job`` step ``step`` under ``runs`` as the catalog holds them
    (sizes :data:`SIZES`, mtime :func:`mtime_of`), so that a ``stat`` of each proves it; its directory."""
    where = runs / job / f"step-{step:08d}"
    for rel, size in zip(FILES, SIZES, strict=True):
        path = where / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file() or path.stat().st_size != size:
            path.write_bytes(b"\0" * size)
        os.utime(path, (mtime_of(step), mtime_of(step)))
    return where


def build_catalog(path: Path, checkpoints: int, jobs: int, runs: Path) -> None:
    """A catalog of ``checkpoints`` verified guide-layout checkpoints, written through the catalog API,
    as a scan of ``runs`` records them (the files themselves are not written)."""
    from ckptier.storage.catalog.api import Catalog
    from ckptier.storage.records import FileRef, Format, Found, Recognition

    per_job = checkpoints // jobs
    now = datetime(2026, 1, 1, tzinfo=UTC)
    path.parent.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{path}"
    t0 = time.perf_counter()
    found = []
    for j in range(jobs):
        job = f"job-{j:03d}"
        for s in range(per_job):
            step = (s + 1) * 100
            prefix = f"{job}/step-{step:08d}"
            refs = tuple(FileRef(key=f"{prefix}/{rel}", relpath=rel, size=size, mtime=mtime_of(step))
                         for rel, size in zip(FILES, SIZES, strict=True))
            found.append(Found(job=job, step=step, format=Format.GUIDE, prefix=prefix, files=refs,
                               committed=True, reason="metadata.json present"))
    with Catalog.open(url) as cat:  # one listing of the whole store, as a scan records it
        cat.record_scan(runs.as_uri(), Recognition(tuple(found), (), len(found) * len(FILES)), now=now)
    # Verification results for 100,000 checkpoints: set directly (this is generated data).
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("UPDATE checkpoints SET state = 'verified', verified_at = ?", (now.isoformat(" "),))
        conn.execute("UPDATE files SET status = 'ok', crc64nvme = 'AAAAAAAAAAA='")
    conn.close()
    print(f"built {checkpoints:,} checkpoints in {time.perf_counter() - t0:.1f} s: {path}")


#: Times, in a process that has imported everything and opened the catalog, what ``plan`` computes:
#: the checkpoints read without files and the plans of their policies. Prints the seconds.
IN_PROCESS_PLAN = r"""
import sys, time
from ckptier.tasks.pipeline import merge_plans, plans_by_policy
from ckptier.tasks.retention import render_plan_table
from ckptier.tasks.run import open_run
from ckptier.tasks.settings import Settings
with open_run(Settings()) as run:
    run.catalog.jobs()  # the connection is open and the schema checked before the clock starts
    t0 = time.perf_counter()
    records = run.catalog.checkpoints(include_deleted=True, with_files=False)
    plan = merge_plans([p for _, p in plans_by_policy(run, records=records)])
    rows = render_plan_table(plan)
    elapsed = time.perf_counter() - t0
assert rows
print(elapsed)
"""


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + system) of one run of ``argv``."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, check=False)
    elapsed = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"bench/cli: {' '.join(argv)} failed ({proc.returncode}): {proc.stderr.decode()[-500:]}")
    return elapsed, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def in_process(code: str, env: dict[str, str]) -> float:
    """The seconds ``code`` (run in a fresh interpreter) prints: a time measured inside the process."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        sys.exit(f"bench/cli: the in-process reference failed ({proc.returncode}): {proc.stderr[-500:]}")
    return float(proc.stdout.split()[-1])


def check_resume(ckptier: str, env: dict[str, str], job: str, newest: Path) -> None:
    """Exit unless ``resume --quick`` answers ``newest`` from its hot copy with nothing passed over (what
    the row times), and unless that answer rests on its files: with one of them gone it must pass over it."""
    argv = [ckptier, "resume", "--job", job, "--quick", "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    answer = json.loads(proc.stdout) if proc.returncode == 0 else {}
    if (answer.get("path"), answer.get("source"), answer.get("passed_over")) != (str(newest), "hot", []):
        sys.exit(f"bench/cli: {' '.join(argv)} did not answer {newest} from its hot copy: {proc.stdout[-500:]}")
    # With a file gone the newest must be passed over; that is recorded (no longer verified), so this
    # asks a copy of the catalog and leaves the bench's own as it was.
    catalog = Path(env["CKPTIER_CATALOG_URL"].removeprefix("sqlite:///"))
    scratch = catalog.with_name(catalog.stem + "-scratch.db")
    probe = newest / FILES[-1]
    src, dst = sqlite3.connect(catalog), sqlite3.connect(scratch)
    with src, dst:
        src.backup(dst)
    src.close()
    dst.close()
    probe.rename(probe.with_suffix(".away"))
    try:
        gone = subprocess.run(argv, capture_output=True, text=True, check=False,
                              env={**env, "CKPTIER_CATALOG_URL": f"sqlite:///{scratch}"})
    finally:
        probe.with_suffix(".away").rename(probe)
        for p in scratch.parent.glob(scratch.name + "*"):
            p.unlink()
    if gone.returncode == 0 and json.loads(gone.stdout).get("path") == str(newest):
        sys.exit(f"bench/cli: resume --quick answered {newest} with {probe.name} gone: it did not look at the files")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoints", type=int, default=100_000)
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rebuild", action="store_true")
    ap.add_argument("--dir", type=Path, default=ROOT, help=f"where the catalogs are built and kept (default {ROOT})")
    args = ap.parse_args()

    root: Path = args.dir
    runs = root / "runs"  # the store the catalogs were scanned from ("-runs": catalogs that name it)
    catalogs = {jobs: root / f"catalog-{args.checkpoints}x{jobs}-runs.db" for jobs in (args.jobs, 1)}
    for jobs, catalog in catalogs.items():
        if args.rebuild or not catalog.exists():
            for p in root.glob(f"{catalog.name}*"):
                p.unlink()
            build_catalog(catalog, args.checkpoints, jobs, runs)
    catalog, one_job = catalogs[args.jobs], catalogs[1]
    ckptier = process.executable() or "ckptier"
    process.byte_compiled()  # as an install leaves them: the runs time the commands, not the compiler
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPTIER_", "PREFECT_"))}
    env.update(CKPTIER_CATALOG_URL=f"sqlite:///{catalog}", HOME=str(root))
    plan_env = {**env, "CKPTIER_CATALOG_URL": f"sqlite:///{one_job}"}
    job = f"job-{args.jobs // 2:03d}"
    per_job = args.checkpoints // args.jobs
    newest = materialize(runs, job, per_job * 100)  # the job's newest checkpoint, on disk for both to prove
    latest_json = f"ckptier latest --job {job} --json"
    sqlalchemy_base = 'python -c "import sqlalchemy"'
    rows_base = f"sqlite3 rows as JSON ({args.checkpoints:,} rows)"
    plan_base = f"in-process planning (one job of {args.checkpoints:,})"
    # (name, argv, environment, the baseline it is compared with, target ratio or None)
    contenders: list[tuple[str, list[str], dict[str, str], str | None, float | None]] = [
        ("python -c pass", [sys.executable, "-c", "pass"], env, None, None),
        ("ckptier --version", [ckptier, "--version"], env, "python -c pass", 2.0),
        (sqlalchemy_base, [sys.executable, "-c", "import sqlalchemy"], env, None, None),
        (latest_json, [ckptier, "latest", "--job", job, "--json"], env, sqlalchemy_base, 1.2),
        (f"ckptier latest --job {job}", [ckptier, "latest", "--job", job], env, sqlalchemy_base, 1.2),
        (f"ckptier ls --job {job} --json ({per_job:,} rows)", [ckptier, "ls", "--job", job, "--json"], env,
         sqlalchemy_base, 1.2),
        (f"ckptier ls --job {job}", [ckptier, "ls", "--job", job], env, sqlalchemy_base, 1.2),
        (f"ckptier plan --job {job}", [ckptier, "plan", "--job", job], env, sqlalchemy_base, None),
        (f"ckptier resume --job {job} --quick --json", [ckptier, "resume", "--job", job, "--quick", "--json"], env,
         latest_json, 1.5),
        (rows_base, [sys.executable, "-c", SQLITE_REFERENCE, str(catalog)], env, None, None),
        (f"ckptier ls --json ({args.checkpoints:,} rows)", [ckptier, "ls", "--json"], env, rows_base, None),
        (f"ckptier ls ({args.checkpoints:,} rows)", [ckptier, "ls"], env, rows_base, None),
        (f"ckptier plan --json (one job of {args.checkpoints:,})", [ckptier, "plan", "--json"], plan_env, plan_base,
         2.0),
    ]
    wall = {name: float("inf") for name, *_ in contenders}
    cpu = dict(wall)
    for _, argv, e, _, _ in contenders:  # warm the page cache and the bytecode caches
        timed(argv, e)
    check_resume(ckptier, env, job, newest)
    planning = float("inf")
    for _ in range(args.repeat):
        for name, argv, e, _, _ in contenders:
            w, c = timed(argv, e)
            wall[name], cpu[name] = min(wall[name], w), min(cpu[name], c)
        planning = min(planning, in_process(IN_PROCESS_PLAN, plan_env))
    wall[plan_base] = cpu[plan_base] = planning  # measured inside the process: its wall time is its CPU time
    print(f"catalogs: {args.checkpoints:,} checkpoints in {args.jobs} jobs ({catalog}); "
          f"{args.checkpoints:,} in one job ({one_job})")
    print(f"best of {args.repeat}, interleaved; {os.cpu_count()} cores, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} (wall time suffers from other load; "
          "CPU time = user + system of the process)")
    print(f"{'command':<52} {'wall s':>7} {'CPU s':>7}  {'vs':<40} {'wall':>6} {'CPU':>6} {'target':>7}")
    print(f"{plan_base:<52} {planning:>7.3f} {'':>7}  (timed inside a warm process)")
    for name, _, _, base, target in contenders:
        if base is None:
            print(f"{name:<52} {wall[name]:>7.3f} {cpu[name]:>7.3f}  (baseline)")
            continue
        ratio = wall[name] / wall[base]
        verdict = "" if target is None else (f"<={target:g}x " + ("met" if ratio <= target else
                                                                   f"MISSED by {ratio / target - 1:.0%}"))
        print(f"{name:<52} {wall[name]:>7.3f} {cpu[name]:>7.3f}  {base:<40} {ratio:>5.2f}x "
              f"{cpu[name] / cpu[base]:>5.2f}x {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
