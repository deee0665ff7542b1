"""What the drill history says: recovery success rate, environment drift,
and drills that were not judged (history only: never a checkpoint's most
recent drill, its proof or ``latest``)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from ckptier.storage.catalog.api import NOT_JUDGED, Catalog, DrillRecord
from ckptier.tasks.drill_history import ALL_JOBS, environment_drift, recovery_rate, recovery_rates, stack_changes

NOW = datetime(2026, 6, 30, 12, tzinfo=UTC)
OLD = {"python": "3.11.7", "torch": "2.12.0", "cuda": None, "numpy": "2.4.6"}
NEW = {**OLD, "torch": "2.13.0"}


def _drill(job: str, step: int, days_ago: float, ok: bool, *, outcome: str | None = None, stack: dict | None = None,  # type: ignore[type-arg]
           cid: int | None = None) -> DrillRecord:
    at = NOW - timedelta(days=days_ago)
    return DrillRecord(job=job, step=step, checkpoint_id=cid if cid is not None else step, started_at=at,
                       finished_at=at + timedelta(minutes=1), ok=ok, device="cpu", source_tier="hot",
                       verdict={"summary": "s"}, outcome=outcome, stack=stack or {})


def test_recovery_rate_counts_judged_drills_in_the_window_only() -> None:
    drills = [_drill("a", 1, 1, True), _drill("a", 2, 2, False), _drill("a", 3, 3, False, outcome=NOT_JUDGED),
              _drill("a", 4, 10, True), _drill("a", 5, 40, False), _drill("b", 1, 1, True)]
    week = recovery_rate(drills[:5], job="a", days=7, now=NOW)
    assert (week.passed, week.judged) == (1, 2)  # the not judged one and the older ones do not count
    assert week.text() == "1 of 2 judged drills passed in the last 7 days (50%)"
    month = recovery_rate(drills[:5], job="a", days=30, now=NOW)
    assert (month.passed, month.judged) == (2, 3)
    assert recovery_rate([], job="a", days=7, now=NOW).rate is None
    rates = recovery_rates({"a": drills[:5], "b": drills[5:]}, now=NOW)
    assert [(r.job, r.days, r.passed, r.judged) for r in rates] == [
        ("a", 7, 1, 2), ("a", 30, 2, 3), ("b", 7, 1, 1), ("b", 30, 1, 1), (ALL_JOBS, 7, 2, 3), (ALL_JOBS, 30, 3, 4)]


def test_a_checkpoint_that_passed_under_one_stack_and_fails_under_another_is_drift() -> None:
    drills = [_drill("a", 10, 5, True, stack=OLD), _drill("a", 10, 1, False, stack=NEW),
              _drill("a", 20, 5, True, stack=OLD), _drill("a", 20, 1, False, stack=OLD),  # same stack: the checkpoint
              _drill("a", 30, 5, True, stack=OLD), _drill("a", 30, 2, False, stack=NEW), _drill("a", 30, 1, True, stack=NEW),
              _drill("a", 40, 5, True, stack=OLD), _drill("a", 40, 1, False, outcome=NOT_JUDGED, stack=NEW)]
    (drift,) = environment_drift(drills)
    assert (drift.job, drift.step, dict(drift.changed)) == ("a", 10, {"torch": ("2.12.0", "2.13.0")})
    assert "torch 2.12.0 -> 2.13.0" in drift.text() and "environment drift" in drift.text()
    assert stack_changes({"a": "1", "b": None}, {"a": "2", "b": None, "c": "3"}) == {"a": ("1", "2")}


@pytest.fixture
def catalog(tmp_path: Path):  # type: ignore[no-untyped-def]
    from ckptier.storage.records import Recognition
    from tests.test_dashboard import _found  # a committed guide checkpoint of the dashboard's tests

    with Catalog.open(f"sqlite:///{tmp_path / 'c.db'}", create=True) as cat:
        cat.record_scan("file:///hot", Recognition(tuple(_found("job", s, NOW - timedelta(hours=10 - s))
                                                         for s in (1, 2)), (), 4), now=NOW - timedelta(hours=5))
        yield cat


def test_a_drill_not_judged_is_history_and_leaves_the_proof_and_latest_alone(catalog: Catalog) -> None:
    from tests.test_dashboard import _ok

    for step in (1, 2):
        _ok(catalog, "job", step, NOW - timedelta(hours=4))
    two = catalog.get("job", 2)
    assert two is not None
    catalog.record_drill(DrillRecord(job="job", step=2, checkpoint_id=two.id, started_at=NOW - timedelta(hours=2),
                                     finished_at=NOW - timedelta(hours=2), ok=True, device="cpu", source_tier="hot",
                                     outcome="passed", stack=OLD))
    before = catalog.choose_latest("job", drilled=True)
    catalog.record_drill(DrillRecord(job="job", step=2, checkpoint_id=two.id, started_at=NOW - timedelta(hours=1),
                                     finished_at=NOW - timedelta(hours=1), ok=False, device="cpu", source_tier="hot",
                                     verdict={"summary": "not judged: the factory does not fit this job"},
                                     outcome=NOT_JUDGED, stack=NEW))
    after = catalog.get("job", 2)
    assert after is not None and after.last_drill is not None and after.last_drill.ok  # still the passed one
    assert catalog.choose_latest("job", drilled=True) == before
    assert catalog.choose_latest("job").record.step == 2  # type: ignore[union-attr]
    newest, older = catalog.drills(job="job")
    assert (newest.outcome, newest.judged, newest.verdict_name, dict(newest.stack)) == (NOT_JUDGED, False, NOT_JUDGED, NEW)
    assert (older.verdict_name, older.judged) == ("passed", True)
