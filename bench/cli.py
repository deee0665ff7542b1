"""How fast the read-only commands answer, against ``python -c "import sqlalchemy"``.

A training launcher calls ``ckptier latest --job J --json`` at every start, so
the read-only commands must cost little more than starting Python with the
database library. This script builds (once, then reuses) a SQLite catalog of
100,000 checkpoints (100 jobs x 1,000 steps, 3 files each, all verified, in
the guide's layout) under ``/tmp/ckptier-bench-cli``, then times real
processes, interpreter start and imports included, best of ``--repeat``,
interleaved so that every contender sees the same machine load:

* baseline ``python -c "import sqlalchemy"``;
* ``ckptier latest --job J --json`` and ``ckptier latest --job J``;
* ``ckptier ls --job J --json`` (1,000 rows) and ``ckptier ls --job J``;
* ``ckptier ls --json`` and ``ckptier ls`` over all 100,000 checkpoints,
  with a second reference for them: a Python process that reads the same
  rows with :mod:`sqlite3` and prints them as JSON, one object per line as
  ``ls --json`` does (the floor for printing 100,000 rows from Python);
* ``ckptier plan --job J``.

Prints seconds and the ratio to the baseline (target: at most 1.5x for
``latest`` and ``ls``) and, for the whole-catalog listings, the ratio to the
row-printing reference. Building the catalog takes about a minute the first
time; a run takes about 30 s.

Run: ``python bench/cli.py [--checkpoints 100000] [--jobs 100] [--repeat 5] [--rebuild]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path("/tmp/ckptier-bench-cli")
FILES = ("rank-0000/model.pt", "rank-0000/optimizer.pt", "metadata.json")

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


def build_catalog(path: Path, checkpoints: int, jobs: int) -> None:
    """A catalog of ``checkpoints`` verified guide-layout checkpoints, written through the catalog API."""
    from ckptier.storage.catalog.api import Catalog
    from ckptier.storage.model import FileRef, Format, Found, Recognition

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
            refs = tuple(FileRef(key=f"{prefix}/{rel}", relpath=rel, size=1000 + i, mtime=1.7e9 + step)
                         for i, rel in enumerate(FILES))
            found.append(Found(job=job, step=step, format=Format.GUIDE, prefix=prefix, files=refs,
                               committed=True, reason="metadata.json present"))
    with Catalog.open(url) as cat:  # one listing of the whole store, as a scan records it
        cat.record_scan("file:///data/runs", Recognition(tuple(found), (), len(found) * len(FILES)), now=now)
    # Verification results for 100,000 checkpoints: set directly (this is generated data).
    import sqlite3

    conn = sqlite3.connect(path)
    with conn:
        conn.execute("UPDATE checkpoints SET state = 'verified', verified_at = ?", (now.isoformat(" "),))
        conn.execute("UPDATE files SET status = 'ok', crc64nvme = 'AAAAAAAAAAA='")
    conn.close()
    print(f"built {checkpoints:,} checkpoints in {time.perf_counter() - t0:.1f} s: {path}")


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoints", type=int, default=100_000)
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rebuild", action="store_true")
    args = ap.parse_args()

    catalog = ROOT / f"catalog-{args.checkpoints}x{args.jobs}.db"
    if args.rebuild or not catalog.exists():
        for p in ROOT.glob(f"{catalog.name}*"):
            p.unlink()
        build_catalog(catalog, args.checkpoints, args.jobs)
    script = Path(sys.executable).parent / "ckptier"
    ckptier = str(script) if script.exists() else shutil.which("ckptier") or "ckptier"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPTIER_", "PREFECT_"))}
    env.update(CKPTIER_CATALOG_URL=f"sqlite:///{catalog}", HOME=str(ROOT))
    job = f"job-{args.jobs // 2:03d}"
    per_job = args.checkpoints // args.jobs
    contenders: list[tuple[str, list[str], str]] = [
        ('python -c "import sqlalchemy"', [sys.executable, "-c", "import sqlalchemy"], "baseline"),
        (f"ckptier latest --job {job} --json", [ckptier, "latest", "--job", job, "--json"], "base"),
        (f"ckptier latest --job {job}", [ckptier, "latest", "--job", job], "base"),
        (f"ckptier ls --job {job} --json ({per_job:,} rows)", [ckptier, "ls", "--job", job, "--json"], "base"),
        (f"ckptier ls --job {job}", [ckptier, "ls", "--job", job], "base"),
        (f"ckptier plan --job {job}", [ckptier, "plan", "--job", job], "base"),
        (f"sqlite3 rows as JSON ({args.checkpoints:,} rows)", [sys.executable, "-c", SQLITE_REFERENCE, str(catalog)],
         "rows"),
        (f"ckptier ls --json ({args.checkpoints:,} rows)", [ckptier, "ls", "--json"], "rows"),
        (f"ckptier ls ({args.checkpoints:,} rows)", [ckptier, "ls"], "rows"),
    ]
    wall = {name: float("inf") for name, _, _ in contenders}
    cpu = dict(wall)
    for argv in (c[1] for c in contenders):  # warm the page cache and the bytecode caches
        timed(argv, env)
    for _ in range(args.repeat):
        for name, argv, _ in contenders:
            w, c = timed(argv, env)
            wall[name], cpu[name] = min(wall[name], w), min(cpu[name], c)
    base, rows_ref = contenders[0][0], contenders[6][0]
    print(f"catalog: {args.checkpoints:,} checkpoints in {args.jobs} jobs ({catalog})")
    print(f"best of {args.repeat}, interleaved; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} "
          "(wall time suffers from other load; CPU time = user + system of the process, much less)")
    print(f"{'command':<50} {'wall s':>7} {'ratio':>6} {'CPU s':>7} {'ratio':>6} {'CPU vs sqlite3 rows':>20}")
    for name, _, kind in contenders:
        vs_rows = f"{cpu[name] / cpu[rows_ref]:.2f}x" if kind == "rows" else ""
        print(f"{name:<50} {wall[name]:>7.3f} {wall[name] / wall[base]:>5.2f}x {cpu[name]:>7.3f} "
              f"{cpu[name] / cpu[base]:>5.2f}x {vs_rows:>20}")
    print("ratio: against python -c \"import sqlalchemy\"; target for latest and ls of a job: at most 1.5x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
