"""The dashboard overview on a large catalog, against the raw SQL it needs.

Builds (once, reused) a SQLite catalog of ``--checkpoints`` checkpoints
(100,000) in ``--jobs`` jobs (20) with ``--files`` files each (10: a million
file rows), shaped like months of real runs: a save every 30 minutes,
rolling checkpoints deleted (tombstones), milestones promoted to an archive
tier (a few degraded), some corrupt, the newest ones committed or still in
flight, one restore drill per job per night (some failed), and the events
all of that logs.

Baseline: **raw SQL** — every statement the overview executes, captured
while it renders once, replayed on a plain DBAPI connection with
``fetchall()`` (no SQLAlchemy result processing, no pandas, no HTML).
Measured: **overview** — ``GET /`` through the FastAPI app in process
(queries, pandas tables, alerts, Jinja2 rendering, HTTP handling).
Interleaved rounds, best of ``--repeat``; prints both and the ratio
(target: ≤ 2×). Also prints a job page's time, for information.

Run: ``python bench/dashboard.py [--dir /tmp/ckptier-bench-dashboard] [--repeat 5] [--rebuild]``.
Building takes about a minute; a run, a few seconds more.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from fastapi.testclient import TestClient

from ckptier.dashboard.app import create_app
from ckptier.dashboard.cli import freeze_startup_heap
from ckptier.dashboard.source import open_source
from ckptier.storage.catalog.api import Catalog, DrillRecord
from ckptier.tasks.config import parse_config
from ckptier.tasks.retention import is_log_milestone

START = datetime(2026, 6, 1, tzinfo=UTC)
INTERVAL = timedelta(minutes=30)
STEPS_PER_SAVE = 1000
FILE_BYTES = 200_000_000  # per file: a 10-file checkpoint is 2 GB
POLICY = '[[policy]]\njobs = "*"\nkeep_last = 5\nmilestones = "log"\narchive = "s3://bench-cold/archive"\n'
SHAPE_KEY = "bench-dashboard-v1"


def _ts(t: datetime) -> str:
    """How the catalog stores a time on SQLite (naive UTC text)."""
    return t.astimezone(UTC).replace(tzinfo=None).strftime("%Y-%m-%d %H:%M:%S.%f")


def build(path: Path, *, jobs: int, checkpoints: int, files: int, seed: int = 7) -> datetime:
    """Write the catalog at ``path``; returns the simulated 'now'."""
    rng = random.Random(seed)
    path.unlink(missing_ok=True)
    url = f"sqlite:///{path}"
    per_job = checkpoints // jobs
    now = START + INTERVAL * (per_job + 1)
    with Catalog.open(url) as cat:
        engine = cat._engine  # noqa: SLF001 - a benchmark's bulk loader, not product code
        with engine.begin() as conn:
            ck_rows: list[tuple[Any, ...]] = []
            for j in range(jobs):
                name = f"llama-{j:02d}"
                conn.exec_driver_sql("INSERT INTO jobs (id, name, hot_url, created_at) VALUES (?, ?, ?, ?)",
                                     (j + 1, name, f"s3://bench-hot/runs/{name}", _ts(START)))
                for i in range(per_job):
                    step = (i + 1) * STEPS_PER_SAVE
                    saved = START + INTERVAL * (i + 1)
                    age = per_job - i
                    milestone = is_log_milestone(step)
                    if age == 1:
                        state = "incomplete"
                    elif age <= 3:
                        state = "committed"
                    elif age > 5 and not milestone:
                        state = "deleted"
                    else:
                        state = "verified"
                    if state in ("verified", "committed") and rng.random() < 0.004:
                        state = "corrupt"
                    cid = j * per_job + i + 1
                    verified = _ts(saved + timedelta(hours=1)) if state in ("verified", "deleted", "corrupt") else None
                    ck_rows.append((cid, j + 1, step, "guide", f"s3://bench-hot/runs/{name}/step-{step:08d}", state,
                                    "metadata.json present", files * FILE_BYTES, files, _ts(saved), _ts(saved),
                                    _ts(saved), None, verified, None, 0))
            conn.exec_driver_sql(
                "INSERT INTO checkpoints (id, job_id, step, format, location, state, state_reason, bytes, file_count, "
                "saved_at, first_seen, last_seen, missing_since, verified_at, recorded_loss, generation) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", ck_rows)
            file_rows = [(row[0], f"rank-{r:04d}/model.pt", FILE_BYTES, 0.0, f"etag-{row[0]}-{r}", "crc", "ab" * 32,
                          None if row[5] == "incomplete" else "ok")
                         for row in ck_rows for r in range(files)]
            conn.exec_driver_sql(
                "INSERT INTO files (checkpoint_id, relpath, size, mtime, etag, crc64nvme, sha256_expected, status) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", file_rows)
            copies, events = [], []
            for cid, job_id, step, _f, loc, state, _r, size, _n, saved, *_ in ck_rows:
                milestone = is_log_milestone(step)
                archived = milestone and state == "verified"
                hot_state = "deleted" if state == "deleted" or (archived and rng.random() < 0.8) else "present"
                copies.append((cid, "hot", loc, hot_state, size, None, None, saved, None))
                events.append((saved, "verified" if state != "incomplete" else "discovered",
                               f"step {step}: committed -> verified", job_id, cid))
                if archived:
                    arch = "degraded" if rng.random() < 0.05 else "present"
                    copies.append((cid, "archive", loc.replace("bench-hot/runs", "bench-cold/archive"), arch,
                                   int(size / 1.24), "ckz1", "m", saved, saved))
                if hot_state == "deleted":
                    events.append((saved, "deleted", f"step {step}: deleted {loc}: rolling", job_id, cid))
            conn.exec_driver_sql(
                "INSERT INTO copies (checkpoint_id, tier, url, state, stored_bytes, codec, manifest_key, created_at, "
                "verified_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", copies)
            conn.exec_driver_sql("INSERT INTO events (at, kind, message, job_id, checkpoint_id) VALUES (?, ?, ?, ?, ?)",
                                 events)
            conn.exec_driver_sql("ANALYZE")
        # One drill per job per night, of the newest verified checkpoint then.
        nights = int((now - START) / timedelta(days=1))
        verified = {(job_id, step): cid for cid, job_id, step, _f, _l, state, *_ in ck_rows if state == "verified"}
        for j in range(jobs):
            for night in range(1, nights + 1):
                t = START + timedelta(days=night)
                i = int((t - START) / INTERVAL) - 2
                candidates = [verified[(j + 1, (k + 1) * STEPS_PER_SAVE)] for k in range(min(i, per_job - 1), 0, -1)
                              if (j + 1, (k + 1) * STEPS_PER_SAVE) in verified][:1]
                if not candidates:
                    continue
                ok = rng.random() > 0.05
                cat.record_drill(DrillRecord(job=f"llama-{j:02d}", step=None, checkpoint_id=candidates[0], started_at=t,
                                             finished_at=t + timedelta(minutes=4), ok=ok, device="cuda", source_tier="hot",
                                             verdict={"summary": "drill ok" if ok else "drill failed: loss is nan",
                                                      "losses": [2.5, 2.4, 2.3]}))
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS bench_shape (key TEXT, checkpoints INT, files INT, now TEXT)")
            conn.exec_driver_sql("INSERT INTO bench_shape VALUES (?, ?, ?, ?)", (SHAPE_KEY, checkpoints, files, _ts(now)))
    return now


def existing_now(path: Path, *, checkpoints: int, files: int) -> datetime | None:
    """The 'now' of a catalog this script built with the same shape, else None."""
    if not path.is_file():
        return None
    engine = sa.create_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            row = conn.exec_driver_sql("SELECT checkpoints, files, now FROM bench_shape WHERE key = ?", (SHAPE_KEY,)).first()
    except sa.exc.OperationalError:
        return None
    finally:
        engine.dispose()
    if row is None or (row[0], row[1]) != (checkpoints, files):
        return None
    return datetime.strptime(row[2], "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=UTC)


class Capture:
    """Every (statement, parameters) an engine executes while listening."""

    def __init__(self) -> None:
        self.statements: list[tuple[str, Any]] = []

    def __call__(self, conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        self.statements.append((statement, parameters))


def replay(raw: Any, statements: Sequence[tuple[str, Any]]) -> tuple[float, list[float]]:
    """Run each statement on a raw DBAPI connection and fetch all rows; total and per-statement seconds."""
    each = []
    cur = raw.cursor()
    t0 = time.perf_counter()
    for sql, params in statements:
        s = time.perf_counter()
        cur.execute(sql, params)
        if cur.description is not None:
            cur.fetchall()
        each.append(time.perf_counter() - s)
    total = time.perf_counter() - t0
    cur.close()
    return total, each


def capture(engine: Any, client: TestClient, path: str) -> list[tuple[str, Any]]:
    """The statements one ``GET path`` executes (transaction control left out)."""
    cap = Capture()
    sa.event.listen(engine, "before_cursor_execute", cap)
    try:
        assert client.get(path).status_code == 200, path
    finally:
        sa.event.remove(engine, "before_cursor_execute", cap)
    return [(s, p) for s, p in cap.statements if not s.lstrip().upper().startswith(("BEGIN", "COMMIT", "ROLLBACK", "PRAGMA"))]


class Chromium:
    """Headless Chromium behind chromedriver (W3C WebDriver), for navigation timing."""

    def __init__(self) -> None:
        import shutil
        import subprocess
        import tempfile

        import httpx

        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        driver = shutil.which("chromedriver")
        if chromium is None or driver is None:
            raise RuntimeError("chromium and chromedriver are not installed")
        self.http = httpx.Client(timeout=120)
        self.port = _free_port()
        self.proc = subprocess.Popen([driver, f"--port={self.port}"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        _wait(lambda: self.http.get(self.url + "/status", timeout=2).json()["value"]["ready"])
        self.profile = tempfile.mkdtemp(prefix="ckptier-bench-chromium-")
        args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--disable-extensions", "--hide-scrollbars", "--window-size=1366,900", f"--user-data-dir={self.profile}"]
        r = self.http.post(self.url + "/session", json={"capabilities": {"alwaysMatch": {
            "browserName": "chrome", "goog:chromeOptions": {"binary": chromium, "args": args}}}})
        r.raise_for_status()
        self.base = f"{self.url}/session/{r.json()['value']['sessionId']}"

    def navigate(self, url: str) -> dict[str, float]:
        """Open ``url``; the navigation's timing in ms since it started: response end, DOM complete, load end."""
        self.http.post(self.base + "/url", json={"url": url}).raise_for_status()
        got = self.http.post(self.base + "/execute/sync", json={"args": [], "script": (
            "const n = performance.getEntriesByType('navigation')[0];"
            "return [n.responseStart, n.responseEnd, n.domComplete, n.loadEventEnd, n.transferSize];")}).json()["value"]
        return dict(zip(("ttfb", "response", "dom", "load", "bytes"), got, strict=True))

    def close(self) -> None:
        import os
        import shutil
        import signal

        try:
            self.http.delete(self.base)
        finally:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
            shutil.rmtree(self.profile, ignore_errors=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(ready: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if ready():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("did not start in time")
        time.sleep(0.2)


def serve(app: Any) -> tuple[str, Any]:
    """``app`` served by uvicorn on a free loopback port in a thread; its URL and the server."""
    import threading

    import httpx
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    _wait(lambda: httpx.get(url + "/static/style.css", timeout=2).status_code == 200)
    return url, server


#: The pages measured: path, name, target ratio to its raw SQL.
PAGES = (("/", "overview", 2.0), ("/jobs/llama-07", "job page", 3.0))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/ckptier-bench-dashboard")
    ap.add_argument("--checkpoints", type=int, default=100_000)
    ap.add_argument("--jobs", type=int, default=20)
    ap.add_argument("--files", type=int, default=10, help="files per checkpoint")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rebuild", action="store_true")
    ap.add_argument("--no-browser", action="store_true", help="measure in process only (no Chromium)")
    args = ap.parse_args(argv)

    path = Path(args.dir) / "catalog.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    now = None if args.rebuild else existing_now(path, checkpoints=args.checkpoints, files=args.files)
    if now is None:
        t = time.perf_counter()
        now = build(path, jobs=args.jobs, checkpoints=args.checkpoints, files=args.files)
        print(f"built {path} in {time.perf_counter() - t:.1f} s")
    url = f"sqlite:///{path}"
    source = open_source(url, parse_config(POLICY))
    engine = source.engine
    with engine.connect() as conn:
        counts = {t: conn.exec_driver_sql(f"SELECT count(*) FROM {t}").scalar()  # noqa: S608 - fixed names
                  for t in ("jobs", "checkpoints", "files", "copies", "events", "drills")}
    print("catalog: " + ", ".join(f"{v:,} {k}" for k, v in counts.items()))

    app = create_app(source, clock=lambda: now)
    freeze_startup_heap()  # as `ckptier dashboard` does before it serves (the background tables are made after)
    # Tonight's plan and the cost history are built in the background (seconds here): built once,
    # before anything is measured, and not again during the run, as between a dashboard's rebuilds.
    app.state.background.ttl = float("inf")
    t = time.perf_counter()
    built = app.state.background.get(wait=600)
    assert built is not None and not built.errors, built
    print(f"background tables (tonight's plan, cost over time) built in {time.perf_counter() - t:.1f} s")
    client = TestClient(app, base_url="http://127.0.0.1:8765")
    first = {p: client.get(p) for p, _, _ in PAGES}
    assert all(r.status_code == 200 for r in first.values()) and "llama-00" in first["/"].text
    statements = {p: capture(engine, client, p) for p, _, _ in PAGES}

    browser: Chromium | None = None
    served = ""
    server: Any = None
    if not args.no_browser:
        try:
            browser = Chromium()
            served, server = serve(app)
            for p, _, _ in PAGES:
                browser.navigate(served + p)  # warm: the stylesheet cached, the first-page costs paid
        except (RuntimeError, OSError) as exc:
            print(f"browser timing skipped: {exc}")
            browser = None

    raw = engine.raw_connection()
    times: dict[str, dict[str, list[float]]] = {p: {"raw": [], "page": [], "browser": []} for p, _, _ in PAGES}
    per_statement: dict[str, list[list[float]]] = {p: [] for p, _, _ in PAGES}
    for _ in range(args.repeat):
        for p, _, _ in PAGES:
            total, each = replay(raw, statements[p])
            times[p]["raw"].append(total)
            per_statement[p].append(each)
            t = time.perf_counter()
            assert client.get(p).status_code == 200
            times[p]["page"].append(time.perf_counter() - t)
            if browser is not None:
                times[p]["browser"].append(browser.navigate(served + p)["load"] / 1000)
    raw.close()

    ok = True
    for p, name, target in PAGES:
        t = times[p]
        best_raw, best_page = min(t["raw"]), min(t["page"])
        print(f"{name} {p}: {len(statements[p])} statements, {len(first[p].content):,} bytes of HTML")
        slowest = sorted(range(len(statements[p])), key=lambda i: -statistics.median(e[i] for e in per_statement[p]))[:3]
        for i in slowest:
            sql = " ".join(statements[p][i][0].split())
            print(f"  {statistics.median(e[i] for e in per_statement[p]) * 1000:7.1f} ms  {sql[:100]}…")
        print(f"  raw SQL (baseline), best of {args.repeat}:     {best_raw * 1000:8.1f} ms")
        print(f"  in process GET, best of {args.repeat}:         {best_page * 1000:8.1f} ms  "
              f"{best_page / best_raw:5.2f}x   (target <= {target:g}x)")
        ratio = best_page / best_raw
        if t["browser"]:
            best_browser = min(t["browser"])
            ratio = best_browser / best_raw
            print(f"  Chromium navigation to load end, best of {args.repeat}: {best_browser * 1000:8.1f} ms  "
                  f"{ratio:5.2f}x   (target <= {target:g}x)")
        ok = ok and ratio <= target
    print(f"({math.floor(args.checkpoints / args.jobs):,} checkpoints in the job measured)")
    if browser is not None:
        browser.close()
        server.should_exit = True
    source.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
