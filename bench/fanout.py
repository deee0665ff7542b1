"""Deep verify of 200 checkpoints: threads vs a local Dask cluster vs worker processes sharing PostgreSQL.

Data: ``--checkpoints`` (200) checkpoints in the storage guide's layout,
``fan/step-NNNNNNNN/rank-0000/model.pt`` (``--mib`` MiB of seeded random
bytes) + ``metadata.json``, built once under ``/tmp/ckptier-bench-fanout``
and reused. The catalog is a throwaway PostgreSQL server this script starts
(``initdb``/``pg_ctl`` on PATH or under /usr/lib/postgresql/*/bin), or
``--catalog URL``. The page cache is warmed before timing, so the figures
compare the fan-out, not the disk.

Contenders (deep verify of every checkpoint, results recorded in the
catalog; best of ``--repeat`` rounds, the contenders taking turns):

* **threads** (the baseline): ``run_verify(deep=True, workers=4)`` in this
  process, today's path;
* **dask, 2 workers**: the same with ``fanout=DaskFanout(workers=2)``, a
  local Dask cluster of 2 worker processes on 127.0.0.1 (started before
  timing; its start-up is printed apart);
* **2 processes, row claims**: 2 worker processes (as 2 Prefect workers
  would run them) each calling ``run_verify`` with ``RowClaims`` on the
  shared PostgreSQL catalog; timed from the first one's start to the last
  one's end, their interpreter start-up excluded.

The point (on a 2-core machine) is no loss against threads: the same flow
spreads over a cluster. Run: ``python bench/fanout.py`` (about a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path("/tmp/ckptier-bench-fanout")
MIB = 1 << 20

#: One claiming worker: imports, says "ready", waits for "go", verifies what it can claim, prints timings.
WORKER = """
import json, sys, time
from datetime import UTC, datetime
from ckptier.storage.catalog.api import Catalog
from ckptier.tasks.pipeline import VerifyOptions, run_verify
from ckptier.tasks.run import RowClaims, Run
url, since, owner = sys.argv[1:4]
cat = Catalog.open(url, create=False)
print("ready", flush=True)
sys.stdin.readline()
t0 = time.time()
report = run_verify(Run.of(cat), VerifyOptions(deep=True, claims=RowClaims(owner=owner, since=datetime.fromisoformat(since),
                                                                         poll=0.05)))
print(json.dumps({"start": t0, "end": time.time(), "checked": report.totals.checked}), flush=True)
"""


def build(root: Path, n: int, mib: int) -> int:
    """Write the checkpoints unless an identical build is there; return their total bytes."""
    import numpy as np

    marker = root / f"built-{n}x{mib}"
    if not marker.exists():
        shutil.rmtree(root, ignore_errors=True)
        rng = np.random.default_rng(7)
        for step in range(1, n + 1):
            d = root / "hot" / "fan" / f"step-{step:08d}"
            (d / "rank-0000").mkdir(parents=True)
            (d / "rank-0000" / "model.pt").write_bytes(rng.bytes(mib * MIB))
            (d / "metadata.json").write_text(json.dumps({"step": step}))
        marker.touch()
    return sum(p.stat().st_size for p in (root / "hot").rglob("*") if p.is_file())


def warm(root: Path) -> None:
    for p in (root / "hot").rglob("*"):
        if p.is_file():
            with open(p, "rb") as fh:
                while fh.read(8 * MIB):
                    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pg_tool(tool: str) -> str:
    import glob

    found = shutil.which(tool) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{tool}"), reverse=True)), None)
    if found is None:
        sys.exit(f"bench/fanout.py: PostgreSQL's {tool} not found; install postgresql or pass --catalog URL")
    return found


def start_postgres() -> tuple[str, Callable[[], None]]:
    """A throwaway PostgreSQL server on 127.0.0.1 (as user postgres when run as root); its URL and a stopper."""
    root = Path(tempfile.mkdtemp(prefix="ckptier-bench-pg-"))
    as_pg: list[str] = []
    if os.geteuid() == 0:
        import pwd

        pw = pwd.getpwnam("postgres")
        os.chown(root, pw.pw_uid, pw.pw_gid)
        as_pg = ["runuser", "-u", "postgres", "--"]
    port = _free_port()
    subprocess.run([*as_pg, _pg_tool("initdb"), "-D", str(root / "data"), "-U", "postgres", "--auth=trust",
                    "--no-sync", "--no-instructions"], check=True, capture_output=True)
    opts = f"-p {port} -c listen_addresses=127.0.0.1 -k {root} -c fsync=off -c synchronous_commit=off"
    subprocess.run([*as_pg, _pg_tool("pg_ctl"), "-D", str(root / "data"), "-o", opts, "-l", str(root / "log"),
                    "-w", "start"], check=True, capture_output=True)

    def stop() -> None:
        if sys.exc_info()[0] is not None and (root / "log").exists():  # failing: show why the server went
            print((root / "log").read_text(errors="replace")[-2000:], file=sys.stderr)
        subprocess.run([*as_pg, _pg_tool("pg_ctl"), "-D", str(root / "data"), "-m", "immediate", "stop"],
                       capture_output=True, check=False)
        shutil.rmtree(root, ignore_errors=True)

    return f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres", stop


def timed_threads(url: str, n: int) -> float:
    from ckptier.storage.catalog.api import Catalog
    from ckptier.tasks.pipeline import VerifyOptions, run_verify
    from ckptier.tasks.run import Run

    with Catalog.open(url, create=False) as cat:
        t = time.perf_counter()
        report = run_verify(Run.of(cat), VerifyOptions(deep=True, workers=4))
        elapsed = time.perf_counter() - t
    assert report.totals.verified == n, report.totals
    return elapsed


def timed_dask(url: str, n: int, fanout: object) -> float:
    from ckptier.storage.catalog.api import Catalog
    from ckptier.tasks.pipeline import VerifyOptions, run_verify
    from ckptier.tasks.run import Run

    with Catalog.open(url, create=False) as cat:
        t = time.perf_counter()
        report = run_verify(Run.of(cat), VerifyOptions(deep=True), fanout=fanout)
        elapsed = time.perf_counter() - t
    assert report.totals.verified == n, report.totals
    return elapsed


def timed_claims(url: str, n: int, procs: int) -> float:
    since = datetime.now(UTC).isoformat()
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, url, since, f"bench-{i}"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True) for i in range(procs)]
    for w in workers:
        assert w.stdout is not None and w.stdout.readline().strip() == "ready"
    for w in workers:
        assert w.stdin is not None
        w.stdin.write("go\n")
        w.stdin.flush()
    results = []
    for w in workers:
        out, _ = w.communicate(timeout=600)
        assert w.returncode == 0, f"worker failed with {w.returncode}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(r["checked"] for r in results) == n, results  # each checkpoint once, none lost
    return max(r["end"] for r in results) - min(r["start"] for r in results)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", type=int, default=200)
    ap.add_argument("--mib", type=int, default=4, help="MiB per checkpoint (default 4)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--catalog", help="PostgreSQL catalog URL (default: a throwaway server started here)")
    args = ap.parse_args(argv)

    from ckptier.storage.catalog.api import Catalog
    from ckptier.tasks.fanout import DaskFanout
    from ckptier.tasks.pipeline import run_scan
    from ckptier.tasks.run import Run

    total = build(ROOT, args.checkpoints, args.mib)
    url, stop = (args.catalog, lambda: None) if args.catalog else start_postgres()
    try:
        with Catalog.open(url) as cat:
            run_scan(Run.of(cat), [str(ROOT / "hot")])
        warm(ROOT)
        n = args.checkpoints
        print(f"deep verify of {n} checkpoints, {total / 1e6:.0f} MB, catalog PostgreSQL, "
              f"{os.cpu_count()} cores, best of {args.repeat}")
        t = time.perf_counter()
        fanout = DaskFanout(workers=2)
        started = time.perf_counter() - t
        contenders: dict[str, Callable[[], float]] = {
            "threads (4 threads, baseline)": lambda: timed_threads(url, n),
            "dask local cluster, 2 workers": lambda: timed_dask(url, n, fanout),
            "2 processes, PostgreSQL row claims": lambda: timed_claims(url, n, 2),
        }
        runs: dict[str, list[float]] = {name: [] for name in contenders}
        try:
            timed_dask(url, n, fanout)  # the workers import ckptier on their first item
            for _ in range(args.repeat):  # round-robin: a change in the machine's load hits every contender
                for name, run in contenders.items():
                    runs[name].append(run())
        finally:
            fanout.close()
        figures = {name: min(times) for name, times in runs.items()}
        base = figures["threads (4 threads, baseline)"]
        print(f"{'contender':<38} {'seconds':>8} {'MB/s':>8} {'ckpt/s':>8} {'vs threads':>10}")
        for name, secs in figures.items():
            print(f"{name:<38} {secs:>8.2f} {total / 1e6 / secs:>8.0f} {n / secs:>8.1f} {base / secs:>9.2f}x")
        print(f"(dask local cluster start-up, not timed above: {started:.1f} s)")
    finally:
        stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
