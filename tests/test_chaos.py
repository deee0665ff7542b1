"""A short run of the chaos bench (``bench/chaos.py``; the full run is the bench itself).

Real ``ckptier apply`` processes are SIGKILLed at random delays and at named
points, with local and S3 archives and a hot tier on S3, two applies run at
once on SQLite and PostgreSQL, and a few hundred generated hostile trees,
archive manifests and S3 key sets go through scan, verify, plan, apply and
fetch; every trial is checked (kept checkpoints fetch bit-exactly, the catalog
agrees with storage after a rescan and re-runs, no half-written archive copy,
no traceback, no lease or delete intent left).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import chaos  # noqa: E402
import chaos_fuzz  # noqa: E402

from tests.fixtures.pg import PgServer  # noqa: E402
from tests.fixtures.s3 import S3Server  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.s3, pytest.mark.postgres]


@pytest.mark.timeout(900)  # about a minute of CPU; far more wall time on a loaded machine
def test_a_short_chaos_run_finds_no_violation_no_crash_and_nothing_stuck(
    s3_server: S3Server, pg_server: PgServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chaos_fuzz, "BATCH", 40)  # two batches: a local tree, then S3 key sets
    opts = chaos.Options(trials=4, concurrent=1, swaps=3, fuzz=80, seed=20261130, workdir=tmp_path, quiet=True)
    findings = chaos.run(opts, chaos.Services(s3_server.endpoint, pg_server))
    report = chaos.render(findings, opts, 0.0)
    assert findings.totals == (0, 0, 0), report
    kill_kinds = [findings.tallies[k] for k in chaos.KINDS]  # every kind was tried
    assert sum(t.kills for t in kill_kinds) >= opts.trials, report
    assert all(t.trials for t in kill_kinds), report
    for kind in ("concurrent-sqlite", "concurrent-pg"):
        assert findings.tallies[kind].trials == 1, report
    assert findings.tallies["swap"].trials == opts.swaps, report
    assert findings.fuzz["cases"] >= opts.fuzz and findings.fuzz["keys"] and findings.fuzz["fetches"], report
