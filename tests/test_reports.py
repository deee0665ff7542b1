"""The typed results the flows publish (tasks/reports.py) and why a drill cannot start: pure, table tests."""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime, timedelta, UTC

import pytest

from ckptier.storage.errors import ConfigError
from ckptier.storage.records import CheckpointRecord, CopyRecord, FileCheck, FileRecord, Format, State, Tier
from ckptier.tasks.reports import ItemResult, Outcome
from ckptier.tasks.pipeline import nothing_to_drill
from ckptier.tasks.reports import (
    FileProblem,
    FreedForecast,
    VerifyReport,
    VerifyRow,
    VerifyTotals,
    dashboard_job_url,
    file_problems,
    forecast_freed,
    summarize_jobs,
    tiering_outcome,
    verification_by_job,
)
from ckptier.tasks.retention import KeepLast, Milestones, Policy, plan_retention

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
H = timedelta(hours=1)


def ckpt(id: int, step: int, *, job: str = "llama", state: State = State.VERIFIED, size: int = 1_000,
         hot: str = "present", archive: str | None = None, stored: int | None = None, storage_class: str | None = None,
         missing: bool = False, archive_url: str | None = None) -> CheckpointRecord:
    """A checkpoint saved ``step`` minutes before NOW; ``hot``/``archive``: the copy's state (None: no copy)."""
    saved = NOW - timedelta(minutes=10_000 - step)
    copies = [CopyRecord(Tier.HOT, f"file:///hot/{job}/step-{step:08d}", hot, size, None)]
    if archive is not None:
        copies.append(CopyRecord(Tier.ARCHIVE, archive_url or f"file:///arch/{job}/step-{step:08d}", archive,
                                 stored if stored is not None else size // 2, saved + H, "ckz1", storage_class))
    return CheckpointRecord(
        id=id, job=job, step=step, format=Format.GUIDE, state=state, location=f"file:///hot/{job}/step-{step:08d}",
        bytes=size, saved_at=saved, first_seen=saved, last_seen=NOW, missing_since=saved + H if missing else None,
        verified_at=saved + H if state == State.VERIFIED else None,
        state_reason="rank-0000/model.pt: sha256 mismatch" if state == State.CORRUPT else None, copies=tuple(copies),
    )


# ------------------------------------------------------------------ catalog summary


def test_summary_is_one_row_per_job_with_bytes_per_tier() -> None:
    records = [
        ckpt(1, 100, size=1_000),                                                   # hot only
        ckpt(2, 200, size=2_000, hot="deleted", archive="present", stored=700,
             storage_class="GLACIER_IR"),                                            # archive only
        ckpt(3, 300, size=4_000, archive="present", stored=1_500),                   # both tiers
        ckpt(4, 400, size=8_000, archive="degraded", stored=3_000),                  # both, copy damaged
        ckpt(5, 500, size=16_000, state=State.INCOMPLETE),
        ckpt(6, 600, size=32_000, state=State.CORRUPT),
        ckpt(7, 50, size=64_000, state=State.DELETED, hot="deleted"),                # tombstone
        ckpt(8, 700, size=128_000, missing=True, hot="missing"),                     # gone from hot storage
        ckpt(9, 10, job="bert", size=5, state=State.COMMITTED),
    ]
    bert, llama = summarize_jobs(records)
    assert (bert.job, bert.checkpoints, bert.states, bert.hot_bytes, bert.archive_checkpoints) == \
        ("bert", 1, {"committed": 1}, 5, 0)
    assert llama.job == "llama" and llama.checkpoints == 7 and llama.deleted == 1
    assert llama.states == {"corrupt": 1, "incomplete": 1, "verified": 5}
    assert llama.newest_verified_step == 700
    assert (llama.hot_checkpoints, llama.hot_bytes) == (5, 1_000 + 4_000 + 8_000 + 16_000 + 32_000)
    assert (llama.archive_checkpoints, llama.archive_stored_bytes, llama.archive_logical_bytes) == \
        (3, 700 + 1_500 + 3_000, 2_000 + 4_000 + 8_000)
    assert llama.archive_degraded == 1


def test_summary_of_an_empty_catalog_is_empty() -> None:
    assert summarize_jobs([]) == []


# ------------------------------------------------------------------ what a plan frees


def _planner(policy: Policy):  # type: ignore[no-untyped-def]
    return lambda rs: plan_retention(rs, policy, now=NOW)


ARCHIVE = "file:///arch"


@pytest.mark.parametrize(("name", "policy", "records", "expected"), [
    # keep the newest; the two older ones go: what the deletions free is all there is
    ("rolling", Policy(rules=(KeepLast(1),), min_verified=1),
     [ckpt(1, 100), ckpt(2, 200), ckpt(3, 300)], FreedForecast(3_000, 2_000, 0)),
    # a milestone promoted in the run: its hot copy goes in the same run, after the archive copy is verified
    ("promote then delete the hot copy", Policy(rules=(KeepLast(1), Milestones(steps=(100,))), min_verified=1,
                                                archive=ARCHIVE),
     [ckpt(1, 100), ckpt(2, 200), ckpt(3, 300)], FreedForecast(3_000, 1_000, 1_000)),
    # ... unless the policy keeps hot copies of what it archives
    ("hot_after_archive keep", Policy(rules=(KeepLast(1), Milestones(steps=(100,))), min_verified=1, archive=ARCHIVE,
                                      hot_after_archive="keep"),
     [ckpt(1, 100), ckpt(2, 200), ckpt(3, 300)], FreedForecast(3_000, 1_000, 0)),
    # ... or the floor of verified hot checkpoints holds it once step 200 is gone
    ("min_verified holds it", Policy(rules=(KeepLast(1), Milestones(steps=(100,))), min_verified=2, archive=ARCHIVE),
     [ckpt(1, 100), ckpt(2, 200), ckpt(3, 300)], FreedForecast(3_000, 1_000, 0)),
    # only hot bytes count: an archive-only milestone and a missing checkpoint free nothing and hold nothing hot
    ("hot bytes only", Policy(rules=(KeepLast(1), Milestones(steps=(100,))), min_verified=1, archive=ARCHIVE),
     [ckpt(1, 100, hot="deleted", archive="present"), ckpt(2, 200, missing=True, hot="missing"), ckpt(3, 300),
      ckpt(4, 400)], FreedForecast(2_000, 1_000, 0)),
    # a milestone already archived: its hot copy is a plain deletion of the first pass
    ("already archived", Policy(rules=(KeepLast(1), Milestones(steps=(100,))), min_verified=1, archive=ARCHIVE),
     [ckpt(1, 100, archive="present"), ckpt(2, 300)], FreedForecast(2_000, 1_000, 0)),
])
def test_forecast_counts_what_apply_frees(name: str, policy: Policy, records: list[CheckpointRecord],
                                          expected: FreedForecast) -> None:
    got = forecast_freed(records, _planner(policy), now=NOW)
    assert got == expected, name
    assert got.freed_bytes == expected.deleted_bytes + expected.after_promotion_bytes


def test_forecast_takes_the_first_plan_it_is_given() -> None:
    policy = Policy(rules=(KeepLast(1),), min_verified=1)
    records = [ckpt(1, 100), ckpt(2, 200)]
    calls: list[int] = []

    def planner(rs):  # type: ignore[no-untyped-def]
        calls.append(len(rs))
        return plan_retention(rs, policy, now=NOW)

    first = planner(records)
    assert forecast_freed(records, planner, now=NOW, first=first).deleted_bytes == 1_000
    assert calls == [2]  # no second planning without promotions


def test_forecasts_add_up() -> None:
    assert FreedForecast(1, 2, 3) + FreedForecast(10, 20, 30) == FreedForecast(11, 22, 33)


# ------------------------------------------------------------------ what tiering did


def _item(cid: int, step: int, action: str, outcome: Outcome, *, scope: str = "checkpoint", size: int = 1_000,
          freed: int = 0) -> ItemResult:
    return ItemResult(job="llama", step=step, checkpoint_id=cid, action=action, scope=scope, outcome=outcome,
                      detail="", bytes=size, freed=freed)


def test_tiering_outcome_counts_only_what_was_done_per_tier_and_class() -> None:
    after = {
        1: ckpt(1, 100, hot="deleted", archive="present", stored=400, storage_class="GLACIER_IR",
                archive_url="s3://cold/llama/step-00000100"),
        2: ckpt(2, 200, archive="present", stored=300, archive_url="s3://cold/llama/step-00000200"),
        3: ckpt(3, 300, archive="present", stored=250),
        4: ckpt(4, 400, hot="deleted"),
    }
    items = [
        _item(1, 100, "promote", "done"), _item(1, 100, "delete", "done", scope="hot-copy", freed=1_000),
        _item(2, 200, "promote", "done"), _item(3, 300, "promote", "done"),
        _item(4, 400, "delete", "done", freed=1_000),
        _item(5, 500, "delete", "partial", freed=600),          # some files went
        _item(6, 600, "delete", "failed"), _item(7, 700, "promote", "failed"), _item(8, 800, "delete", "would",
                                                                                      freed=1_000),
        _item(9, 900, "keep", "skipped"),
    ]
    out = tiering_outcome(items, after)
    assert [(p.step, p.storage_class, p.stored_bytes) for p in out.promoted] == \
        [(100, "GLACIER_IR", 400), (200, "STANDARD", 300), (300, "hot", 250)]
    assert [(d.step, d.scope, d.freed_bytes) for d in out.deleted] == \
        [(100, "hot-copy", 1_000), (400, "checkpoint", 1_000), (500, "checkpoint", 600)]
    tiers = {(t.tier, t.storage_class): t for t in out.tiers}
    assert set(tiers) == {("archive", "GLACIER_IR"), ("archive", "STANDARD"), ("archive", "hot"), ("hot", "hot")}
    assert (tiers["archive", "GLACIER_IR"].written, tiers["archive", "GLACIER_IR"].written_bytes,
            tiers["archive", "GLACIER_IR"].logical_bytes) == (1, 400, 1_000)
    assert (tiers["hot", "hot"].deleted, tiers["hot", "hot"].freed_bytes) == (3, 2_600)
    assert out.hot_freed_bytes == 2_600


def test_a_dry_run_did_nothing() -> None:
    out = tiering_outcome([_item(1, 100, "promote", "would"), _item(2, 200, "delete", "would", freed=1_000)], {})
    assert out.tiers == () and out.promoted == () and out.deleted == () and out.hot_freed_bytes == 0


# ------------------------------------------------------------------ verification


def test_file_problems_pair_expected_and_actual_hashes() -> None:
    files = [FileRecord("a.pt", 10, None, None, "Q1JDYQ==", "aa" * 32, "ok", None),
             FileRecord("b.pt", 20, None, None, "Q1JDYg==", None, "ok", None),
             FileRecord("c.pt", 30, None, None, None, None, None, None)]
    results = [
        FileCheck("a.pt", "corrupt", 10, "eHh4eA==", "bb" * 32, "sha256 mismatch"),
        FileCheck("b.pt", "ok", 20, "Q1JDYg==", None, None),
        FileCheck("c.pt", "missing", None, None, None, "not found"),
    ]
    a, c = file_problems(files, results)
    assert (a.relpath, a.status, a.expected_size, a.actual_size) == ("a.pt", "corrupt", 10, 10)
    assert (a.expected_sha256, a.actual_sha256) == ("aa" * 32, "bb" * 32)
    assert (a.expected_crc64nvme, a.actual_crc64nvme) == ("Q1JDYQ==", "eHh4eA==")
    assert (c.relpath, c.status, c.expected_size, c.actual_size, c.detail) == ("c.pt", "missing", 30, None, "not found")


def vrow(job: str, state: str, *, errors: int = 0, read: int = 0, skipped: int = 0, tier: str = "hot",
         step: int = 1) -> VerifyRow:
    """A verification row; an archive copy's (``tier="archive"``) carries its problem lines."""
    return VerifyRow(job, step, tier, state, read, skipped, errors, (), None, (),
                     problems=() if tier == "archive" else None)


def test_verification_totals_per_job() -> None:
    rows = [
        vrow("b", "verified", read=5),
        vrow("a", "corrupt", read=7, skipped=1),
        vrow("a", "verified", errors=2, skipped=9),
        vrow("a", "degraded", read=3, tier="archive"),
    ]
    a, b = verification_by_job(rows)
    assert dataclasses.astuple(a) == ("a", 3, 1, 1, 1, 1, 10, 10)
    assert dataclasses.astuple(b) == ("b", 1, 1, 0, 0, 0, 5, 0)


@pytest.mark.parametrize(("rows", "totals"), [
    ([], VerifyTotals()),
    # Hot rows count by the state the check recorded; a row with read errors counts once however many.
    ([vrow("a", "verified", read=5, skipped=2), vrow("a", "corrupt", read=3), vrow("a", "incomplete", errors=2)],
     VerifyTotals(checked=3, verified=1, corrupt=1, incomplete=1, errors=1, bytes_read=8, bytes_skipped=2)),
    # Archive copies read back are counted apart: their bytes read add up, their states are not hot states.
    ([vrow("a", "verified", read=5), vrow("a", "verified", read=4, tier="archive"),
      vrow("b", "degraded", read=6, tier="archive")],
     VerifyTotals(checked=1, verified=1, bytes_read=15, archive_checked=2, archive_degraded=1)),
])
def test_verification_totals_of_rows(rows: list[VerifyRow], totals: VerifyTotals) -> None:
    assert VerifyTotals.of(rows) == totals
    assert totals.found_damage == bool(totals.corrupt or totals.archive_degraded)


def test_a_verify_report_is_json_as_verify_printed_it() -> None:
    """Hot rows have no ``problems`` key, archive rows do; ``by_job`` only once it is computed."""
    bad = FileProblem("a.pt", "corrupt", 10, 10, "aa", "bb", None, None, "sha256 differs")
    hot = VerifyRow("a", 1, "hot", "corrupt", 10, 0, 0, ("x.tmp",), "a.pt: sha256 differs", (bad,))
    archived = VerifyRow("a", 1, "archive", "degraded", 4, 0, 0, (), "a.pt: bad frame", (), problems=("a.pt: bad frame",))
    report = VerifyReport((hot, archived), VerifyTotals.of((hot, archived)), (2, 7))
    out = report.to_json()
    assert list(out) == ["checkpoints", "totals", "sample"] and out["sample"] == "2/7"
    assert out["checkpoints"][0] == {"job": "a", "step": 1, "tier": "hot", "state": "corrupt", "bytes_read": 10,
                                     "bytes_skipped": 0, "errors": 0, "extra": ["x.tmp"],
                                     "detail": "a.pt: sha256 differs", "files": [dataclasses.asdict(bad)]}
    assert out["checkpoints"][1]["problems"] == ["a.pt: bad frame"] and "problems" not in out["checkpoints"][0]
    assert out["totals"] == {"checked": 1, "verified": 0, "corrupt": 1, "incomplete": 0, "errors": 0,
                             "bytes_read": 14, "bytes_skipped": 0, "archive_checked": 1, "archive_degraded": 1}
    by_job = dataclasses.replace(report, by_job=tuple(verification_by_job(report.checkpoints))).to_json()["by_job"]
    assert by_job == [{"job": "a", "checked": 2, "verified": 0, "corrupt": 1, "degraded": 1, "errors": 0,
                       "bytes_read": 14, "bytes_skipped": 0}]
    assert json.loads(json.dumps(out)) == out


# ------------------------------------------------------------------ links


@pytest.mark.parametrize(("base", "job", "url"), [
    ("http://dash:8765", "llama-7b", "http://dash:8765/jobs/llama-7b"),
    ("http://dash:8765/", "team/run 1", "http://dash:8765/jobs/team%2Frun%201"),
    ("https://x.example/ckptier/", "<img src=x>", "https://x.example/ckptier/jobs/%3Cimg%20src%3Dx%3E"),
    ("", "llama", None),
    ("  ", "llama", None),
])
def test_dashboard_job_url(base: str, job: str, url: str | None) -> None:
    assert dashboard_job_url(job, {"CKPTIER_DASHBOARD_URL": base}) == url
    assert dashboard_job_url(job, {}) is None


# ------------------------------------------------------------------ why a drill cannot start


@pytest.mark.parametrize(("records", "job", "step", "known", "needle"), [
    ([], "nope", None, False, "job 'nope': no checkpoints in the catalog"),
    ([ckpt(1, 100, state=State.INCOMPLETE)], "llama", None, True, "no verified or committed checkpoint of job 'llama'"),
    ([ckpt(1, 100, state=State.CORRUPT)], "llama", 100, True, "job 'llama' step 100 is corrupt (rank-0000/model.pt: "
                                                              "sha256 mismatch): drills never restore a corrupt"),
    ([ckpt(1, 100, state=State.INCOMPLETE)], "llama", 100, True, "job 'llama' step 100 is incomplete"),
    ([ckpt(1, 100)], "llama", 7, True, "job 'llama' step 7: not in the catalog"),
    ([], None, None, False, "no verified or committed checkpoint of any job"),
])
def test_why_a_drill_cannot_start(records: list[CheckpointRecord], job: str | None, step: int | None, known: bool,
                                  needle: str) -> None:
    error = nothing_to_drill(records, job=job, step=step, known=known)
    assert isinstance(error, ConfigError)
    assert needle in str(error) and "\n" not in str(error)

