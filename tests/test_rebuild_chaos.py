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
from tests.fixtures.s3 import S3Server  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.s3, pytest.mark.postgres]


@pytest.mark.timeout(900)
def test_a_killed_and_rerun_rebuild_ends_identical_to_an_uninterrupted_one(
    s3_server: S3Server, pg_server: PgServer, tmp_path: Path
) -> None:
    opts = chaos.Options(trials=0, concurrent=0, swaps=0, fuzz=0, rebuild=6, seed=20261201, workdir=tmp_path, quiet=True)
    findings = chaos.run(opts, chaos.Services(s3_server.endpoint, pg_server))
    report = chaos.render(findings, opts, 0.0)
    assert findings.totals == (0, 0, 0), report
    tallies = [t for k, t in findings.tallies.items() if k.startswith("rebuild-")]
    assert sum(t.trials for t in tallies) == 6, report
    assert sum(t.kills for t in tallies) >= 4 and sum(t.hook_kills for t in tallies) >= 1, report


def test_the_comparison_sees_any_difference_but_the_rebuilds_own_times(tmp_path: Path) -> None:
    """The identity check has teeth: a copy's state, a tombstone, a drill differ; times the rebuild wrote do not."""
    from datetime import UTC, datetime, timedelta

    from ckptier.storage.catalog.api import Catalog, DrillRecord
    from ckptier.storage.records import CopyState, FileRef, Format, Found, Recognition, Tier

    old = datetime(2026, 1, 1, tzinfo=UTC)
    since = datetime.now(UTC)
    urls = []
    for name in ("a", "b"):
        url = f"sqlite:///{tmp_path / name}.db"
        with Catalog.open(url) as cat:
            files = (FileRef("j/step-00000001/metadata.json", "metadata.json", 5, 1.0),)
            found = Found("j", 1, Format.GUIDE, "j/step-00000001", files, True, "metadata.json")
            cat.record_scan((tmp_path / "hot").as_uri(), Recognition((found,), (), 1),
                            now=since + timedelta(seconds=1 if name == "a" else 2))  # the rebuild's own clock
            rec = cat.get("j", 1)
            assert rec is not None
            cat.record_drill(DrillRecord("j", 1, rec.id, old, old, True, "cpu", "hot"))
        urls.append(url)
    a, b = (chaos.catalog_fingerprint(u, since) for u in urls)
    assert chaos.first_difference(a, b) is None
    with Catalog.open(urls[1]) as cat:
        rec = cat.get("j", 1)
        assert rec is not None
        cat.set_copy_state(rec.id, tier=Tier.HOT, url=rec.location, state=CopyState.DEGRADED, now=since)
    diff = chaos.first_difference(a, chaos.catalog_fingerprint(urls[1], since))
    assert diff is not None and diff.startswith("copies")
