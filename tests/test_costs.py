"""Cost tables for the report: bytes and cost per tier and class, savings
against keep-all, the drilled recovery point and the expected restore time,
over one fixed catalog."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from ckptier.storage.catalog.api import DrillRecord
from ckptier.storage.errors import ConfigError
from ckptier.storage.records import (
    CheckpointRecord,
    CopyRecord,
    FileRecord,
    Format,
    State,
    Tier,
)
from ckptier.tasks.config import Config, parse_config
from ckptier.tasks.costs import (
    CostedDrill,
    JobCosts,
    cost_tables,
    fetch_throughputs,
    recovery_point,
)
from ckptier.tasks.prices import DEFAULT_PRICES, LIST_PRICE_NOTE
from ckptier.tasks.retention import KeepLast, Policy
from ckptier.tasks.tiers import ArchiveTier

NOW = datetime(2026, 6, 1, 12, tzinfo=UTC)
GiB = 1 << 30
D = timedelta(days=1)
H = timedelta(hours=1)
LLAMA = Policy((KeepLast(3),), jobs="llama", archive="s3://cold/a",
               archive_tiers=(ArchiveTier(30 * D, "STANDARD_IA"), ArchiveTier(90 * D, "GLACIER_IR")))
CONFIG = Config(policies=(LLAMA,))  # gpt has no policy: its archive copies stay in their first class


def ck(id: int, job: str, step: int, *, state: State = State.VERIFIED, hot: str = "file:///hot",
       hot_gone: bool = False, archived_days_ago: float | None = None, stored: int = 8 * GiB) -> CheckpointRecord:
    saved = NOW - timedelta(hours=200 - step / 100)
    copies: tuple[CopyRecord, ...] = ()
    if archived_days_ago is not None:
        copies += (CopyRecord(Tier.ARCHIVE, f"s3://cold/a/{job}/step-{step:08d}", "present", stored,
                              NOW - archived_days_ago * D, "ckz1"),)
    if hot_gone:
        copies += (CopyRecord(Tier.HOT, f"{hot}/{job}/step-{step:08d}", "deleted", None, None),)
    files = tuple(FileRecord(f"rank-{r:04d}/model.pt", 5 * GiB, None, None, None, None, "ok", None) for r in range(2))
    return CheckpointRecord(
        id=id, job=job, step=step, format=Format.GUIDE, state=state, location=f"{hot}/{job}/step-{step:08d}",
        bytes=10 * GiB, saved_at=saved, first_seen=saved, last_seen=NOW, missing_since=None,
        verified_at=saved if state == State.VERIFIED else None, state_reason=None, files=files, copies=copies,
    )


def drill(job: str, cid: int, step: int, ok: bool, hours_ago: float, *, tier: str | None = "hot",
          fetch_s: float | None = None) -> DrillRecord:
    started = NOW - hours_ago * H
    return DrillRecord(job=job, step=step, checkpoint_id=cid, started_at=started, finished_at=started + H, ok=ok,
                       device="cpu", source_tier=tier, timings={"fetch_s": fetch_s} if fetch_s else {})


RECORDS = [
    ck(1, "llama", 1000, state=State.DELETED),
    ck(2, "llama", 2000, hot_gone=True, archived_days_ago=100),  # GLACIER_IR by now
    ck(3, "llama", 3000, archived_days_ago=40),  # STANDARD_IA by now, hot copy kept too
    ck(4, "llama", 4000),  # passed, then failed its latest drill
    ck(5, "llama", 5000),  # the recovery point
    ck(6, "llama", 6000),  # failed its latest drill
    ck(7, "llama", 7000, state=State.COMMITTED),  # never drilled
    ck(20, "gpt", 100, hot="s3://hot-bkt/runs", hot_gone=True, archived_days_ago=1, stored=9 * GiB),
    ck(21, "gpt", 200, hot="s3://hot-bkt/runs", state=State.COMMITTED),
]
DRILLS = [
    drill("llama", 4, 4000, True, 30, fetch_s=5),  # 2 GiB/s
    drill("llama", 4, 4000, False, 20, fetch_s=20),  # 0.5 GiB/s: a failed drill still measured its fetch
    drill("llama", 5, 5000, True, 10, fetch_s=10),  # 1 GiB/s
    drill("llama", 6, 6000, True, 9, fetch_s=4),  # 2.5 GiB/s
    drill("llama", 6, 6000, False, 2, fetch_s=8),  # 1.25 GiB/s
    drill("llama", 7, 7000, False, 1, tier=None),  # fetch failed: nothing measured
    drill("gpt", 20, 100, True, 5, tier="archive"),  # no timings recorded
]


@pytest.fixture(scope="module")
def rows() -> dict[str, JobCosts]:
    out = cost_tables(RECORDS, DRILLS, CONFIG, now=NOW)
    assert [r.job for r in out] == ["gpt", "llama"]
    return {r.job: r for r in out}


def test_bytes_and_cost_per_tier_and_class(rows: dict[str, JobCosts]) -> None:
    llama = rows["llama"]
    got = [(t.tier, t.storage_class, t.checkpoints, t.bytes) for t in llama.tiers]
    assert got == [
        ("hot", "hot", 5, 50 * GiB),  # steps 3000-7000 (the tombstone and the archived-only 2000 are not hot)
        ("archive", "STANDARD_IA", 1, 8 * GiB),  # archived 40 days ago: past 30d
        ("archive", "GLACIER_IR", 1, 8 * GiB),  # archived 100 days ago: past 90d
    ]
    assert [t.monthly_cost for t in llama.tiers] == pytest.approx([50 * 0.145, 8 * 0.0125, 8 * 0.004])
    assert llama.stored_bytes == 66 * GiB
    assert llama.monthly_cost == pytest.approx(50 * 0.145 + 8 * 0.0125 + 8 * 0.004)
    gpt = rows["gpt"]
    assert [(t.tier, t.storage_class, t.bytes) for t in gpt.tiers] == [
        ("hot", "STANDARD", 10 * GiB),  # checkpoints on S3 are billed as STANDARD
        ("archive", "STANDARD", 9 * GiB),  # no archive_tiers known: the archive's first class
    ]


def test_savings_against_keep_all_include_tombstones(rows: dict[str, JobCosts]) -> None:
    llama = rows["llama"]
    assert (llama.keep_all_checkpoints, llama.keep_all_bytes) == (7, 70 * GiB)
    assert llama.keep_all_monthly_cost == pytest.approx(70 * 0.145)
    assert llama.savings_monthly == pytest.approx(llama.keep_all_monthly_cost - llama.monthly_cost)
    assert llama.savings_fraction == pytest.approx(1 - llama.monthly_cost / llama.keep_all_monthly_cost)
    assert rows["gpt"].keep_all_monthly_cost == pytest.approx(20 * 0.023)


def test_every_figure_says_where_its_prices_come_from(rows: dict[str, JobCosts]) -> None:
    for row in rows.values():
        assert row.prices_assumed and row.price_note == LIST_PRICE_NOTE and row.currency == "USD"
        assert all(t.price_source == LIST_PRICE_NOTE for t in row.tiers)
    configured = parse_config('[prices]\nsource = "ours"\nhot = 0.1\nSTANDARD_IA = 0.01\nGLACIER_IR = 0.003\n').prices
    llama = cost_tables(RECORDS, DRILLS, Config(policies=(LLAMA,), prices=configured), now=NOW)[1]
    assert llama.tiers[0].price_source == "ours"
    assert llama.monthly_cost == pytest.approx(50 * 0.1 + 8 * 0.01 + 8 * 0.003)
    assert llama.prices_assumed  # STANDARD_IA and GLACIER_IR request fields are still list prices


def test_recovery_point_is_the_newest_checkpoint_whose_latest_drill_passed(rows: dict[str, JobCosts]) -> None:
    rp = rows["llama"].recovery_point
    assert rp is not None
    assert (rp.checkpoint_id, rp.step, rp.tiers) == (5, 5000, ("hot",))
    assert rp.age_s == (NOW - RECORDS[4].saved_at).total_seconds()  # type: ignore[operator]
    assert rp.drilled_at == NOW - 10 * H + H
    archived = rows["gpt"].recovery_point
    assert archived is not None and (archived.step, archived.tiers) == (100, ("archive",))


def test_recovery_point_needs_a_copy_and_a_pass() -> None:
    gone = [ck(1, "j", 100, state=State.DELETED), ck(2, "j", 200, hot_gone=True)]
    drills = [drill("j", 1, 100, True, 5), drill("j", 2, 200, True, 5)]
    assert recovery_point(gone, drills, NOW) is None  # a tombstone, and a checkpoint with no copy left
    assert recovery_point([ck(3, "j", 300)], [], NOW) is None  # never drilled


def test_expected_restore_time_from_measured_fetches(rows: dict[str, JobCosts]) -> None:
    r = rows["llama"].restore
    assert r is not None and r.tier == "hot" and r.bytes == 10 * GiB and r.drills == 5
    assert r.throughput_bytes_per_s == pytest.approx(1.25 * GiB)  # median of 2, 0.5, 1, 2.5, 1.25 GiB/s
    assert r.seconds == pytest.approx(8.0) and r.reason is None
    assert r.cost == 0  # reading the local hot tier costs nothing
    g = rows["gpt"].restore
    assert g is not None and g.tier == "archive" and g.seconds is None and g.throughput_bytes_per_s is None
    assert g.reason == "no drill of job gpt has fetched from the archive tier yet"
    assert g.cost == pytest.approx(DEFAULT_PRICES.read_back(9 * GiB, 2, "STANDARD"))


def test_fetch_throughputs_by_job_and_tier() -> None:
    got = fetch_throughputs(DRILLS, {r.id: r.bytes for r in RECORDS})
    assert sorted(got) == [("llama", "hot")]
    assert sorted(got[("llama", "hot")]) == pytest.approx([0.5 * GiB, 1 * GiB, 1.25 * GiB, 2 * GiB, 2.5 * GiB])


def test_pure_inputs_and_errors() -> None:
    with pytest.raises(ValueError, match="no timezone"):
        cost_tables(RECORDS, DRILLS, CONFIG, now=NOW.replace(tzinfo=None))
    odd = Policy((KeepLast(1),), archive="s3://cold/a", storage_class="ONEZONE_IA")
    with pytest.raises(ConfigError, match=r"\[prices.ONEZONE_IA\]"):
        cost_tables(RECORDS, [], Config(policies=(odd,)), now=NOW)
    assert cost_tables([], [], CONFIG, now=NOW) == []


@dataclass
class _Drill:
    job: str
    step: int | None
    checkpoint_id: int | None
    started_at: datetime
    finished_at: datetime | None
    ok: bool
    source_tier: str | None
    timings: dict[str, Any] = field(default_factory=dict)
    judged: bool = True


def test_any_drill_shaped_record_will_do() -> None:
    d: CostedDrill = _Drill("llama", 5000, 5, NOW - H, None, True, "hot", {"fetch_s": 2.0})
    rows = cost_tables(RECORDS, [d], CONFIG, now=NOW)
    llama = rows[1]
    assert llama.recovery_point is not None and llama.recovery_point.drilled_at == NOW - H
    assert llama.restore is not None and llama.restore.seconds == pytest.approx(2.0)


def test_from_a_real_catalog(tmp_path: Path) -> None:
    """Records and drills as the SQLite catalog returns them fit the tables."""
    from ckptier.storage.catalog.api import Catalog
    from ckptier.tasks.demo import write_guide_checkpoint
    from ckptier.tasks.scan import scan_url

    for step in (100, 200):
        write_guide_checkpoint(tmp_path / "hot" / "job" / f"step-{step:08d}", {"rank-0000/model.pt": {"w": [1] * 100}},
                               step=step, loss=1.0)
    with Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
        scan_url(str(tmp_path / "hot"), cat, now=NOW)
        first = cat.get("job", 100)
        assert first is not None
        cat.record_drill(DrillRecord(job="job", step=100, checkpoint_id=first.id, started_at=NOW - H,
                                     finished_at=NOW - H / 2, ok=True, device="cpu", source_tier="hot",
                                     timings={"fetch_s": 0.5}))
        rows = cost_tables(cat.checkpoints(include_deleted=True), cat.drills(), Config(), now=NOW)
    (row,) = rows
    assert row.job == "job" and row.tiers[0].checkpoints == 2 and row.keep_all_checkpoints == 2
    assert row.recovery_point is not None and row.recovery_point.step == 100
    assert row.restore is not None and row.restore.seconds == pytest.approx(0.5)
