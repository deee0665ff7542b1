"""A rebuild killed at random points and re-run ends identical to an uninterrupted one: a few trials
of the chaos bench's rebuild scenario (``bench/chaos.py --rebuild N``; the full run is the bench).

Real ``ckptier rebuild`` children are SIGKILLed at crash points (a backup restored, a hot location
scanned, a job's archive copies recorded) and at random delays, on local and S3 archives, SQLite and
PostgreSQL catalogs, with the backup kept, removed or corrupted; the resumed catalog is compared
with an uninterrupted rebuild's, then with storage, and every kept checkpoint is fetched.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import chaos  # noqa: E402

from tests.fixtures.pg import PgServer  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.s3, pytest.mark.postgres]


@pytest.mark.timeout(900)
def test_a_killed_and_rerun_rebuild_ends_identical_to_an_uninterrupted_one(
    moto_endpoint: str, pg_server: PgServer, tmp_path: Path
) -> None:
    opts = chaos.Options(trials=0, concurrent=0, fuzz=0, rebuild=6, seed=20261201, workdir=tmp_path, quiet=True)
    findings = chaos.run(opts, chaos.Services(moto_endpoint, pg_server))
    report = chaos.render(findings, opts, 0.0)
    assert findings.totals == (0, 0, 0), report
    tallies = [t for k, t in findings.tallies.items() if k.startswith("rebuild-")]
    assert sum(t.trials for t in tallies) == 6, report
    assert sum(t.kills for t in tallies) >= 4 and sum(t.hook_kills for t in tallies) >= 1, report
