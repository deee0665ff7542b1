"""The dashboard and ``ckptier report``: pure judgements, the tables on SQLite and
PostgreSQL, the web app (in-process), and the command line.

The browser walkthrough (Chromium, a real ``prefect server``) lives in
``test_dashboard_browser.py``.
"""

from __future__ import annotations

import re

import csv
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
import pytest
from fastapi.testclient import TestClient

from ckptier.dashboard import alerts as al
from ckptier.dashboard import charts, security
from ckptier.dashboard.app import create_app
from ckptier.dashboard.cli import print_report
from ckptier.dashboard.format import display, records, to_csv
from ckptier.dashboard.history import storage_history
from ckptier.dashboard.prefect_api import PrefectDrills, ui_url
from ckptier.dashboard.source import open_source
from ckptier.dashboard.tables import TABLES, Snapshot, TableError
from ckptier.storage.catalog.api import Catalog, DrillRecord
from ckptier.storage.errors import ConfigError
from ckptier.storage.records import CheckpointRecord, FileCheck, FileRef, Format, Found, Recognition, State, Tier
from ckptier.tasks.config import parse_config
from ckptier.tasks.retention import shrink_guard

T0 = datetime(2026, 1, 1, 0, 0, tzinfo=UTC)
NOW = T0 + timedelta(hours=14)
STORE = "s3://bucket/runs"
ARCHIVE = "s3://cold/archive"
XSS = "<img src=x onerror=alert(1)>"
POLICY = '[[policy]]\njobs = "*"\nkeep_last = 3\nmilestones = [500]\narchive = "s3://cold/archive"\n'


def hours(h: float) -> datetime:
    return T0 + timedelta(hours=h)


# ------------------------------------------------------------------ pure: alerts


def _problem(step: int, problem: str, hot: bool, detail: str | None = None) -> al.Problem:
    return al.Problem(step=step, problem=problem, hot=hot, detail=detail)


@pytest.mark.parametrize(("problems", "expected"), [
    ([], []),
    ([_problem(3, "corrupt", True, "model.pt: sha256 expected aa, got bb")],
     [("corrupt", "error", (3,), "1 corrupt checkpoint (step 3): model.pt: sha256 expected aa, got bb")]),
    ([_problem(3, "corrupt", True), _problem(1, "corrupt", False)], [("corrupt", "error", (1, 3), "2 corrupt checkpoints (steps 1, 3)")]),
    ([_problem(6, "degraded", False)], [("only-copy-at-risk", "critical", (6,), "the only copy of step 6 is a damaged archive copy")]),
    ([_problem(4, "degraded", True)], [("degraded", "warning", (4,), "1 degraded archive copy (step 4); the hot copies are intact")]),
    ([_problem(s, "degraded", True) for s in range(1, 9)], [("degraded", "warning", tuple(range(1, 9)), "steps 1, 2, 3, 4, 5 (+3 more)")]),
])
def test_problem_alerts(problems: list[al.Problem], expected: list[tuple[str, str, tuple[int, ...], str]]) -> None:
    got = al.problem_alerts("j", problems)
    assert [(a.kind, a.severity, a.steps) for a in got] == [e[:3] for e in expected]
    for a, e in zip(got, expected, strict=True):
        assert e[3] in a.message and "\n" not in a.message


def _records(job: str, missing: int, present: int) -> list[CheckpointRecord]:
    out = []
    for i in range(missing + present):
        out.append(CheckpointRecord(id=i, job=job, step=i, format=Format.GUIDE, state=State.VERIFIED, location="", bytes=1,
                                    saved_at=None, first_seen=T0, last_seen=T0, missing_since=T0 if i < missing else None,
                                    verified_at=None, state_reason=None))
    return out


@pytest.mark.parametrize(("missing", "live", "fraction"), [
    (0, 5, 0.5), (2, 5, 0.5), (3, 5, 0.5), (5, 5, 1.0), (1, 10, 0.05), (1, 1, 0.9), (0, 0, 0.5),
])
def test_suspension_alert_is_the_planners_shrink_guard(missing: int, live: int, fraction: float) -> None:
    policy = parse_config(f'[[policy]]\nkeep_last = 2\nmax_missing_fraction = {fraction}\n').policies[0]
    alert = al.suspension_alert("j", live, missing, policy)
    expected = shrink_guard(_records("j", missing, live - missing), fraction)
    assert (alert.message if alert else None) == expected
    assert al.suspension_alert("j", live, missing, None) is None  # no policy: nothing is deleted anyway


def test_usual_interval_and_stale_alert() -> None:
    saves = [hours(h) for h in (0, 1, 2, 3.5, 4.5)]
    assert al.usual_interval(saves) == timedelta(hours=1)
    assert al.usual_interval(saves[:2]) is None  # too few saves to know
    assert al.usual_interval([T0, T0, T0]) is None  # no positive gap
    interval = timedelta(hours=1)
    assert al.stale_alert("j", 9, hours(10), interval, now=hours(12)) is None  # exactly two intervals
    stale = al.stale_alert("j", 9, hours(10), interval, now=hours(12, ) + timedelta(seconds=1))
    assert stale is not None and stale.kind == "stale" and "2h" in stale.message and "usual interval 1h" in stale.message
    # A job saving every minute does not alert on a short pause.
    assert al.stale_alert("j", 9, hours(10), timedelta(minutes=1), now=hours(10) + timedelta(minutes=9)) is None
    assert al.stale_alert("j", 9, hours(10), timedelta(minutes=1), now=hours(10) + timedelta(minutes=11)) is not None
    assert al.stale_alert("j", None, None, None, now=NOW) is None


@pytest.mark.parametrize(("state", "drill", "proof"), [
    ("committed", None, "committed"), ("committed", True, "committed"), ("verified", None, "verified"),
    ("verified", False, "verified"), ("verified", True, "drilled"), ("corrupt", True, ""), ("incomplete", None, ""),
    ("deleted", True, ""),
])
def test_proof_levels(state: str, drill: bool | None, proof: str) -> None:
    assert al.proof_level(state, drill) == proof


def test_drill_alert_and_ordering() -> None:
    assert al.drill_alert("j", 5, True, "ok") is None and al.drill_alert("j", None, None, None) is None
    failed = al.drill_alert("j", 5, False, "load: unknown global x.Y")
    assert failed is not None and failed.severity == "error" and "step 5" in failed.message and "x.Y" in failed.message
    ordered = al.sort_alerts([al.Alert("b", "stale", "warning", ""), al.Alert("a", "corrupt", "error", ""),
                              al.Alert("z", "only-copy-at-risk", "critical", "")])
    assert [a.kind for a in ordered] == ["only-copy-at-risk", "corrupt", "stale"]


@pytest.mark.parametrize(("seconds", "text"), [(0, "0s"), (0.2, "<1s"), (59, "59s"), (61, "1m 1s"), (3600, "1h"),
                                               (90061, "1d 1h"), (-120, "-2m")])
def test_format_age(seconds: float, text: str) -> None:
    assert al.format_age(timedelta(seconds=seconds)) == text


# ------------------------------------------------------------------ pure: storage over time


def _copies(*rows: tuple[int, str, str, int, int, datetime, datetime | None]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["checkpoint_id", "tier", "state", "stored_bytes", "bytes", "created_at", "saved_at"])


def _events(*rows: tuple[datetime, str, int, dict[str, Any] | None]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["at", "kind", "checkpoint_id", "data"])


def _series(df: pd.DataFrame) -> list[tuple[float, int, int, int]]:
    return [((row.at - pd.Timestamp(T0)).total_seconds() / 3600, row.hot_bytes, row.archive_stored_bytes,
             row.archive_logical_bytes) for row in df.itertuples()]


def test_storage_history_from_copies_and_events() -> None:
    copies = _copies(
        (1, "hot", "deleted", 100, 100, hours(2), hours(1)),  # saved at 1h, scanned at 2h, deleted at 3h
        (2, "hot", "deleted", 100, 100, hours(2), hours(1.5)),  # milestone: archived at 2.5h, hot copy deleted at 4h
        (2, "archive", "present", 40, 100, hours(2.5), None),
        (3, "hot", "present", 100, 100, hours(2), None),  # vanished at 5h, listed again at 6h
    )
    events = _events(
        (hours(3), "deleted", 1, {"reasons": ["rolling"]}),
        (hours(4), "copy-deleted", 2, {"tier": "hot", "from": "present", "to": "deleted"}),
        (hours(5), "vanished", 3, {"state": "verified"}),
        (hours(6), "reappeared", 3, None),
        (hours(6.5), "verified", 3, None),  # not a storage event
    )
    got = _series(storage_history(copies, events, now=hours(10)))
    assert got == [
        (1.0, 100, 0, 0), (1.5, 200, 0, 0), (2.0, 300, 0, 0), (2.5, 300, 40, 100), (3.0, 200, 40, 100),
        (4.0, 100, 40, 100), (5.0, 0, 40, 100), (6.0, 100, 40, 100), (10.0, 100, 40, 100),
    ]


def test_storage_history_ends_at_what_the_catalog_holds_even_without_events() -> None:
    # A hot copy marked deleted with no event, and a degraded archive copy (still stored).
    copies = _copies((1, "hot", "deleted", 100, 100, hours(1), None), (1, "archive", "degraded", 30, 100, hours(2), None))
    got = _series(storage_history(copies, _events(), now=hours(5)))
    assert got[-1] == (5.0, 0, 30, 100)
    assert max(g[1] for g in got) == 100
    empty = storage_history(_copies(), _events(), now=hours(5))
    assert empty.empty and list(empty.columns) == ["at", "hot_bytes", "archive_stored_bytes", "archive_logical_bytes"]


# ------------------------------------------------------------------ pure: security, format, charts


@pytest.mark.parametrize(("text", "shown"), [
    ("postgresql://ckptier:s3cret@db:5432/c", "postgresql://ckptier:***@db:5432/c"),
    ("s3://AKIAX:wJalr/K7MDENG@bucket/k", "s3://AKIAX:***@bucket/k"),
    ("see https://u:p%40ss@h/x and https://h/y?X-Amz-Signature=abc123&X-Amz-Date=1", "see https://u:***@h/x and https://h/y?X-Amz-Signature=***&X-Amz-Date=1"),
    ("https://h/o?token=t0k&a=1&api_key=zz", "https://h/o?token=***&a=1&api_key=***"),
    ("file:///data/run/step-1", "file:///data/run/step-1"),
    ("user@host:/path is fine", "user@host:/path is fine"),
    (None, None),
])
def test_redact_hides_credentials(text: str | None, shown: str | None) -> None:
    assert security.redact(text) == shown


def test_bind_rules_and_token_comparison() -> None:
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.53"):
        security.check_bind(host, None)
    for host in ("0.0.0.0", "::", "10.1.2.3", "dash.example.com"):
        with pytest.raises(ConfigError, match="not a loopback address, without a token"):
            security.check_bind(host, None)
        security.check_bind(host, "x" * 24)
    with pytest.raises(ConfigError, match="use at least 16"):
        security.check_bind("127.0.0.1", "short")
    assert security.token_ok("a" * 20, "a" * 20) and not security.token_ok("a" * 19 + "b", "a" * 20)
    assert not security.token_ok(None, "a" * 20) and not security.token_ok("", "a" * 20)


@pytest.mark.parametrize(("cookie", "field", "origin", "site", "refused"), [
    ("t", "t", None, None, None),
    ("t", "t", "http://127.0.0.1:8765", "same-origin", None),
    ("t", "u", None, None, "does not match"),
    (None, "t", None, None, "missing CSRF token"),
    ("t", None, None, None, "missing CSRF token"),
    ("t", "t", "http://evil.example", None, "another origin"),
    ("t", "t", "null", None, "opaque origin"),
    ("t", "t", None, "cross-site", "cross-site"),
])
def test_csrf_rules(cookie: str | None, field: str | None, origin: str | None, site: str | None, refused: str | None) -> None:
    why = security.csrf_ok(cookie, field, origin=origin, host="127.0.0.1:8765", fetch_site=site)
    assert (why is None) if refused is None else (why is not None and refused in why)


def test_display_and_data_formats() -> None:
    assert display(1234567, "bytes") == "1.2 MB" and display(None, "bytes") == "-" and display(0.875, "ratio") == "88%"
    assert display(3700, "age") == "1h 1m" and display(True, "verdict") == "passed" and display(pd.NA, "step") == ""
    df = pd.DataFrame({"at": [pd.Timestamp(T0)], "n": pd.array([None], dtype="Int64"), "x": [1.5], "s": ["a,b"]})
    assert records(df) == [{"at": "2026-01-01T00:00:00+00:00", "n": None, "x": 1.5, "s": "a,b"}]
    assert to_csv(df) == 'at,n,x,s\n2026-01-01T00:00:00+00:00,,1.5,"a,b"\n'


def test_charts_escape_and_scale() -> None:
    assert charts.nice_ticks(0, 1000, 5) == [0, 200, 400, 600, 800, 1000]
    mark = charts.Mark(5, "hot", "verified", f"step 5 of {XSS}", "/checkpoint?job=%3C&step=5")
    svg = str(charts.step_chart([mark], milestones=[5], recovery_step=5))
    assert "<img" not in svg and "&lt;img src=x onerror=alert(1)&gt;" in svg
    assert "recovery point 5" in svg and "milestone: step 5" in svg
    t = str(charts.time_chart([T0, hours(1), hours(100)], [charts.Series("tier-hot", "hot", [1, 2, 2])]))
    assert "unchanged since 2026-01-01 01:00:00" in t


def test_ui_url_for_server_and_cloud() -> None:
    assert ui_url("http://127.0.0.1:4200/api", {}) == "http://127.0.0.1:4200"
    assert ui_url("https://api.prefect.cloud/api/accounts/A/workspaces/W", {}) == "https://app.prefect.cloud/account/A/workspace/W"
    assert ui_url("http://x/api", {"PREFECT_UI_URL": "http://ui/"}) == "http://ui"


# ------------------------------------------------------------------ a catalog with known facts


def _found(job: str, step: int, saved: datetime, *, committed: bool = True) -> Found:
    prefix = f"{job}/step-{step:08d}"
    files = {"rank-0000/model.pt": 900, "metadata.json": 100}
    return Found(job=job, step=step, format=Format.GUIDE, prefix=prefix,
                 files=tuple(FileRef(key=f"{prefix}/{rel}", relpath=rel, size=size, mtime=saved.timestamp(), etag=f"e{size}")
                             for rel, size in sorted(files.items())),
                 committed=committed, reason="metadata.json present", expected_sha256={"rank-0000/model.pt": "ab" * 32})


def _ok(cat: Catalog, job: str, step: int, now: datetime) -> None:
    rec = cat.get(job, step)
    assert rec is not None
    cat.record_verification(rec.id, [FileCheck(f.relpath, "ok", f.size, f"crc-{f.relpath}", "ab" * 32 if f.relpath.endswith(".pt") else None)
                                      for f in rec.files], now=now)


def _id(cat: Catalog, job: str, step: int) -> int:
    rec = cat.get(job, step)
    assert rec is not None
    return rec.id


def build_catalog(url: str, *, alpha: str = "alpha") -> None:
    """Job ``alpha`` (10 checkpoints, every fact the overview judges) and job ``beta`` (all missing)."""
    with Catalog.open(url) as cat:
        steps = range(100, 1001, 100)
        cat.record_scan(STORE, Recognition(tuple(_found(alpha, s, hours(s / 100)) for s in steps), (), 20),
                        now=hours(11), scope_prefix=alpha)
        for s in steps[:-1]:
            _ok(cat, alpha, s, hours(11))
        # 300: corrupt
        rec = cat.get(alpha, 300)
        assert rec is not None
        cat.record_verification(rec.id, [FileCheck("rank-0000/model.pt", "corrupt", 900, None, "cd" * 32,
                                                   "sha256 expected abab…, got cdcd…")], now=hours(11.1))
        # 400, 500, 600: archived; 500 and 600 lose their hot copies; 400 and 600 archive copies degrade.
        for s in (400, 500, 600):
            cat.add_copy(_id(cat, alpha, s), tier=Tier.ARCHIVE, url=f"{ARCHIVE}/{alpha}/step-{s:08d}", stored_bytes=400,
                         codec="ckz1", manifest_key="m", verified_at=hours(11.15), now=hours(11.15))
        for s in (500, 600):
            cat.set_copy_state(_id(cat, alpha, s), tier=Tier.HOT, url=f"{STORE}/{alpha}/step-{s:08d}", state="deleted",
                               now=hours(11.3))
        for s in (400, 600):
            cat.set_copy_state(_id(cat, alpha, s), tier=Tier.ARCHIVE, url=f"{ARCHIVE}/{alpha}/step-{s:08d}",
                               state="degraded", now=hours(11.4))
        # 200: deleted by retention.
        cid = _id(cat, alpha, 200)
        gen = cat.claim(cid, "test", now=hours(11.5), ttl=timedelta(hours=1))
        assert gen is not None and cat.mark_deleted(cid, owner="test", generation=gen, now=hours(11.5), reasons=["rolling"])
        # Drills: 700 failed, 800 passed, 900 passed then failed (its most recent drill).
        for step, ok, at in ((700, False, 11.6), (800, True, 11.8), (900, True, 12.0), (900, False, 12.2)):
            cat.record_drill(DrillRecord(job=alpha, step=step, checkpoint_id=_id(cat, alpha, step), started_at=hours(at),
                                         finished_at=hours(at + 0.05), ok=ok, device="cpu", source_tier="hot",
                                         verdict={"summary": f"step {step} {'ok' if ok else 'failed: loss is nan'}",
                                                  "losses": [0.5, 0.4]}))
        # beta: three saves an hour apart, then a listing that finds none of them.
        cat.record_scan(STORE, Recognition(tuple(_found("beta", s, hours(10 + s)) for s in (1, 2, 3)), (), 6),
                        now=hours(13.5), scope_prefix="beta")
        cat.record_scan(STORE, Recognition((), (), 0), now=hours(13.6), scope_prefix="beta")


@pytest.fixture
def facts(catalog_url: str) -> Iterator[Any]:
    build_catalog(catalog_url)
    with open_source(catalog_url, parse_config(POLICY)) as source:
        yield source


def test_jobs_table_counts_every_fact(facts: Any) -> None:
    jobs = Snapshot(facts, now=NOW).table("jobs").set_index("job")
    a = jobs.loc["alpha"]
    expected = {
        "checkpoints": 9, "incomplete": 0, "committed": 1, "verified": 6, "drilled": 1, "corrupt": 1, "deleted": 1,
        "hot_only": 6, "hot_and_archive": 1, "archive_only": 2, "no_copy": 0,
        "hot_bytes": 7000, "archive_stored_bytes": 1200, "archive_logical_bytes": 3000, "keep_all_bytes": 10000,
        "saved_bytes": 1800, "saved_fraction": 0.18, "verified_coverage": 0.875,
        "last_drill_step": 900, "last_drill_ok": False, "recovery_step": 800, "newest_step": 1000,
        "usual_interval_s": 3600.0, "alerts": 6, "worst_alert": "critical",
        "drill_success_7d": 0.5, "drill_success_30d": 0.5,  # 2 of the 4 judged drills passed
    }
    assert {k: a[k] for k in expected} == expected
    assert a["oldest_verification_age_s"] == pytest.approx(3 * 3600, abs=1)
    assert a["recovery_age_s"] == pytest.approx(6 * 3600, abs=1)  # step 800 was saved at 8h
    assert a["newest_save_age_s"] == pytest.approx(4 * 3600, abs=1)
    assert a["last_drill_age_s"] == pytest.approx((14 - 12.25) * 3600, abs=1)
    b = jobs.loc["beta"]
    assert (b["checkpoints"], b["no_copy"], b["hot_bytes"], b["alerts"]) == (3, 3, 0, 1)
    assert pd.isna(b["recovery_step"]) and b["last_drill_ok"] is None


def test_alerts_table(facts: Any) -> None:
    rows = records(Snapshot(facts, now=NOW).table("alerts"))
    assert [(r["job"], r["kind"], r["severity"], r["steps"]) for r in rows] == [
        ("alpha", "only-copy-at-risk", "critical", "600"),
        ("alpha", "corrupt", "error", "300"),
        ("alpha", "drill-failed", "error", "900"),
        ("alpha", "degraded", "warning", "400"),
        ("alpha", "recovery-rate", "warning", ""),
        ("alpha", "stale", "warning", "1000"),
        ("beta", "deletion-suspended", "warning", ""),
    ]
    assert rows[4]["message"].startswith("2 of 4 judged drills passed in the last 7 days (50%): below 80%")
    assert "3 of 3 checkpoints missing from hot storage" in rows[-1]["message"]
    assert "sha256 expected abab…, got cdcd…" in rows[1]["message"]
    only_alpha = Snapshot(facts, now=NOW, job="alpha").table("alerts")
    assert set(only_alpha["job"]) == {"alpha"} and len(only_alpha) == 6


def test_job_tables(facts: Any) -> None:
    snap = Snapshot(facts, now=NOW, job="alpha")
    cks = snap.table("checkpoints").set_index("step")
    assert list(cks.index) == list(range(100, 1001, 100))
    assert cks.loc[800, "proof"] == "drilled" and cks.loc[900, "proof"] == "verified" and cks.loc[900, "last_drill"] == "failed"
    assert cks.loc[1000, "proof"] == "committed" and cks.loc[300, "proof"] == "" and cks.loc[200, "state"] == "deleted"
    assert (cks.loc[600, "hot"], cks.loc[600, "archive"], cks.loc[600, "archive_stored_bytes"]) == ("deleted", "degraded", 400)
    assert bool(cks.loc[500, "milestone"]) and not bool(cks.loc[400, "milestone"])
    plan = snap.table("plan").set_index("step")
    assert 200 not in plan.index and plan.loc[300, "action"] == "keep" and "corrupt" in plan.loc[300, "reasons"]
    drills = snap.table("drills")
    assert list(drills["step"]) == [900, 900, 800, 700] and list(drills["ok"]) == [False, True, True, False]
    assert drills.iloc[0]["first_loss"] == 0.5 and drills.iloc[0]["seconds"] == pytest.approx(180)
    ver = snap.table("verifications")
    assert {"verified", "corrupt", "copy-degraded"} <= set(ver["kind"])
    assert set(snap.table("events")["kind"]) >= {"discovered", "deleted", "copy-deleted", "copy-degraded"}
    storage = snap.table("storage")
    last = storage.iloc[-1]
    assert (last["hot_bytes"], last["archive_stored_bytes"], last["archive_logical_bytes"]) == (7000, 1200, 3000)
    assert storage["hot_bytes"].max() == 10000 and storage.iloc[-1]["at"] == pd.Timestamp(NOW)


def test_a_checkpoint_drilled_before_the_recent_drills_keeps_its_proof_and_recovery_point(
        facts: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The drills the pages list are the newest few; a checkpoint's most recent drill is the
    catalog's (``latest --drilled``), however many drills came after it."""
    from ckptier.dashboard import tables

    monkeypatch.setattr(tables, "DRILL_WINDOW", 2)  # step 900's two drills; 800's (passed) is older
    snap = Snapshot(facts, now=NOW, job="alpha")
    assert len(snap.drills["alpha"]) == 2
    cks = snap.table("checkpoints").set_index("step")
    assert cks.loc[800, "proof"] == "drilled" and cks.loc[800, "last_drill"] == "passed"
    assert cks.loc[700, "last_drill"] == "failed" and cks.loc[900, "last_drill"] == "failed"
    record = snap.catalog.get("alpha", 800)
    assert record is not None and snap.proof(record) == "drilled"
    jobs = Snapshot(facts, now=NOW).table("jobs").set_index("job")
    assert jobs.loc["alpha", "recovery_step"] == 800 and jobs.loc["alpha", "drilled"] == 1


def test_checkpoints_table_read_as_columns_says_what_the_records_say(facts: Any) -> None:
    """The table is read from the database as columns, not as records: each row still says what the
    catalog's record of that checkpoint says (state, proof, last drill, the copy shown per tier and its
    stored bytes, times, reason, milestone), for every checkpoint of every job, tombstones included
    (and copies that moved: a held copy listed after one that holds nothing is the one shown), and a
    step asked alone gives that row alone."""
    from sqlalchemy import insert, select

    from ckptier.dashboard.alerts import proof_level
    from ckptier.dashboard.format import missing
    from ckptier.storage.catalog.tables import copies as cp

    with facts.engine.begin() as conn:  # a second copy in a tier, listed after one that holds nothing
        for cid, tier, url in conn.execute(select(cp.c.checkpoint_id, cp.c.tier, cp.c.url)
                                           .where(cp.c.state.not_in(["present", "degraded"]))).tuples().all():
            conn.execute(insert(cp), [{"checkpoint_id": cid, "tier": tier, "url": url + "-moved", "state": "present",
                                       "stored_bytes": 123, "created_at": NOW}])

    def shown(record: Any, tier: str) -> Any:
        cs = [c for c in record.copies if c.tier.value == tier]
        return next((c for c in cs if c.state in ("present", "degraded")), cs[0] if cs else None)

    checked = 0
    for job in facts.catalog.jobs():
        snap = Snapshot(facts, now=NOW, job=job)
        policy = facts.config.policy_for(job)
        rows = {int(r["step"]): r for r in snap.table("checkpoints").to_dict("records")}
        records = facts.catalog.checkpoints(job=job, include_deleted=True, with_files=False)
        assert sorted(rows) == [r.step for r in records]
        for r in records:
            row, drill = rows[r.step], r.last_drill
            hot, archive = shown(r, "hot"), shown(r, "archive")
            want = {
                "job": job, "state": r.state.value, "format": r.format.value, "bytes": r.bytes,
                "proof": proof_level(r.state.value, drill.ok if drill else None),
                "last_drill": ("passed" if drill.ok else "failed") if drill else "",
                "hot": hot.state.value if hot else "", "archive": archive.state.value if archive else "",
                "archive_stored_bytes": archive.stored_bytes if archive and archive.state in ("present", "degraded")
                else None,
                "milestone": policy is not None and policy.is_milestone(r.step),
                "reason": security.redact(r.state_reason) or "",
            }
            got = {k: None if missing(row[k]) else row[k] for k in want}
            assert got == want, (job, r.step)
            for name in ("saved_at", "verified_at", "missing_since"):
                value = getattr(r, name)
                assert (missing(row[name]) and value is None) or row[name] == value, (job, r.step, name)
            checked += 1
        one = Snapshot(facts, now=NOW, job=job, step=records[-1].step).table("checkpoints")
        assert list(one["step"]) == [records[-1].step]
    assert checked >= 10


def test_storage_over_time_in_sql_is_storage_history(facts: Any) -> None:
    """The series the pages read (aggregated in the database) is :func:`storage_history`'s, on the facts
    catalog and with what it lacks: a second hot copy of one checkpoint (a moved location: the newest
    size counts), a copy deleted with no event (booked at the newest moment recorded), an archive copy
    that comes back (copy-present), and an event of a tier that holds no copy of it (moves nothing)."""
    from sqlalchemy import insert, select

    from ckptier.dashboard import queries as q
    from ckptier.dashboard.history import from_deltas
    from ckptier.storage.catalog.tables import checkpoints as ck
    from ckptier.storage.catalog.tables import copies as cp
    from ckptier.storage.catalog.tables import events as ev

    engine = facts.engine
    with engine.begin() as conn:
        ids = dict(conn.execute(select(ck.c.step, ck.c.id).where(ck.c.step.in_([700, 800, 900]))).tuples().all())
        conn.execute(insert(cp), [
            {"checkpoint_id": ids[700], "tier": "hot", "url": f"{STORE}/moved/step-700", "state": "present",
             "stored_bytes": 1500, "created_at": hours(12.5)},
            {"checkpoint_id": ids[800], "tier": "archive", "url": f"{ARCHIVE}/alpha/step-800", "state": "deleted",
             "stored_bytes": 300, "created_at": hours(12.6)},
            {"checkpoint_id": ids[700], "tier": "archive", "url": f"{ARCHIVE}/alpha/step-700", "state": "deleted",
             "stored_bytes": 200, "created_at": hours(12.4)},
        ])
        conn.execute(insert(ev), [
            {"at": hours(12.7), "kind": "copy-deleted", "message": "m", "checkpoint_id": ids[900],
             "data": {"tier": "archive"}},
            {"at": hours(12.8), "kind": "copy-missing", "message": "m", "checkpoint_id": ids[800],
             "data": {"tier": "archive"}},
            {"at": hours(12.9), "kind": "copy-present", "message": "m", "checkpoint_id": ids[800],
             "data": {"tier": "archive"}},
        ])
        job_id = conn.execute(select(ck.c.job_id).where(ck.c.id == ids[800])).scalar_one()
        conn.execute(ev.update().where(ev.c.checkpoint_id.in_(list(ids.values())), ev.c.job_id.is_(None))
                     .values(job_id=job_id))
    for job in ("alpha", "beta", None):
        expected = storage_history(q.frame(engine, q.storage_copies(job)), q.frame(engine, q.storage_events(job)), now=NOW)
        got = from_deltas(q.frame(engine, q.storage_series(job)), now=NOW)
        assert len(got) > 1 or job == "beta"
        pd.testing.assert_frame_equal(got, expected, check_dtype=False, check_index_type=False)


def test_drills_and_events_across_the_catalog(facts: Any) -> None:
    snap = Snapshot(facts, now=NOW)
    drills = snap.table("drills")
    assert list(drills["step"]) == [900, 900, 800, 700] and set(drills["job"]) == {"alpha"}
    events = snap.table("events")
    assert {"alpha", "beta"} <= set(events["job"]) and list(events["at"]) == sorted(events["at"], reverse=True)
    assert events[events["kind"] == "vanished"]["step"].tolist() == [3, 2, 1]


def test_checkpoint_tables(facts: Any) -> None:
    snap = Snapshot(facts, now=NOW, job="alpha", step=600)
    copies = snap.table("copies").set_index("tier")
    assert copies.loc["archive", "state"] == "degraded" and copies.loc["archive", "ratio"] == 2.5
    assert copies.loc["hot", "state"] == "deleted" and copies.loc["archive", "codec"] == "ckz1"
    files = snap.table("files").set_index("relpath")
    assert files.loc["rank-0000/model.pt", "sha256_expected"] == "ab" * 32 and files.loc["rank-0000/model.pt", "status"] == "ok"
    assert files.loc["rank-0000/model.pt", "crc64nvme"] == "crc-rank-0000/model.pt"
    assert set(snap.table("events")["kind"]) == {"verified", "copy-deleted", "copy-degraded"}
    assert Snapshot(facts, now=NOW, job="alpha", step=900).table("drills")["ok"].tolist() == [False, True]


def test_tables_refuse_missing_filters_and_unknown_names(facts: Any) -> None:
    with pytest.raises(TableError, match="per job"):
        Snapshot(facts, now=NOW).table("checkpoints")
    with pytest.raises(TableError, match="per checkpoint"):
        Snapshot(facts, now=NOW, job="alpha").table("files")
    with pytest.raises(TableError, match="unknown table 'nope'"):
        Snapshot(facts, now=NOW).table("nope")
    with pytest.raises(TableError, match="job 'gamma' is not in the catalog"):
        Snapshot(facts, now=NOW, job="gamma").table("checkpoints")
    with pytest.raises(TableError, match="a step \\(600\\) needs its job"):
        Snapshot(facts, now=NOW, step=600).table("events")
    with pytest.raises(TableError, match="no step 150"):
        Snapshot(facts, now=NOW, job="alpha", step=150).table("files")


def test_each_table_is_built_once_per_snapshot(facts: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    original = TABLES["alerts"].build
    monkeypatch.setitem(TABLES, "alerts", TABLES["alerts"].__class__(
        **{**TABLES["alerts"].__dict__, "build": lambda s: calls.append("alerts") or original(s)}))
    snap = Snapshot(facts, now=NOW)
    snap.table("jobs")
    snap.table("alerts")
    snap.table("jobs")
    assert calls == ["alerts"]


# ------------------------------------------------------------------ opening: never create a catalog


def test_missing_catalog_is_one_line_and_nothing_is_created(tmp_path: Path) -> None:
    where = tmp_path / "nowhere" / "catalog.db"
    with pytest.raises(ConfigError, match=r"no catalog at .*catalog.db: run 'ckptier scan URL'"):
        open_source(f"sqlite:///{where}", parse_config(""))
    assert not where.parent.exists()
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    with pytest.raises(ConfigError, match="holds no ckptier catalog"):
        open_source(f"sqlite:///{empty}", parse_config(""))
    assert empty.stat().st_size == 0 or "alembic_version" not in empty.read_bytes().decode("latin-1")


def test_postgres_database_without_schema_is_refused_untouched(pg_server: Any) -> None:
    import sqlalchemy as sa

    url = pg_server.create_database("ckptier_dash_empty")
    try:
        with pytest.raises(ConfigError, match="holds no ckptier catalog"):
            open_source(url, parse_config(""))
        engine = sa.create_engine(url)
        with engine.connect() as conn:
            tables = conn.execute(sa.text("SELECT count(*) FROM information_schema.tables WHERE table_schema='public'")).scalar()
        engine.dispose()
        assert tables == 0
    finally:
        pg_server.drop_database("ckptier_dash_empty")


# ------------------------------------------------------------------ the report command


def test_report_formats_share_the_tables(facts: Any, catalog_url: str, tmp_path: Path) -> None:
    config = tmp_path / "ckptier.toml"
    config.write_text(POLICY)

    def run(**kw: Any) -> str:
        out = io.StringIO()
        args = {"catalog_url": catalog_url, "config_path": str(config), "job": None, "step": None, "fmt": "table",
                "tables": None, "now": NOW, "out": out, **kw}
        assert print_report(**args) == 0
        return out.getvalue()

    table = run()
    assert "Jobs (2)" in table and "Alerts (7)" in table and "only-copy-at-risk" in table
    assert "(all jobs)     7       2       4   50%" in table  # the recovery success rate over every job
    assert "the only copy of step 600 is a damaged archive copy" in table
    data = json.loads(run(fmt="json"))
    assert set(data) == {"jobs", "alerts", "recovery"}
    assert data["jobs"] == records(Snapshot(facts, now=NOW).table("jobs"))
    rows = list(csv.DictReader(io.StringIO(run(fmt="csv"))))
    assert [r["job"] for r in rows] == ["alpha", "beta"] and rows[0]["hot_bytes"] == "7000"
    job = json.loads(run(fmt="json", job="alpha"))
    assert set(job) == {"jobs", "alerts", "checkpoints", "plan", "drills", "storage"}
    assert job["checkpoints"] == records(Snapshot(facts, now=NOW, job="alpha").table("checkpoints"))
    one = list(csv.DictReader(io.StringIO(run(fmt="csv", job="alpha", step=600, tables=["copies"]))))
    assert [r["tier"] for r in one] == ["archive", "hot"]
    with pytest.raises(ConfigError, match="csv prints one table"):
        run(fmt="csv", tables=["jobs", "alerts"])


def _ckptier(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    code = ("import sys; from ckptier.flows.cli import main; rc = main(sys.argv[1:]); "
            "bad = [m for m in ('prefect', 'uvicorn', 'fastapi') if m in sys.modules]; "
            "print('IMPORTED', bad, file=sys.stderr) if bad else None; sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_report_command_starts_nothing_and_creates_nothing(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    build_catalog(url)
    proc = _ckptier("report", "--catalog", url, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert "IMPORTED" not in proc.stderr and set(json.loads(proc.stdout)) == {"jobs", "alerts", "recovery"}
    proc = _ckptier("report", "--catalog", url, "--job", "alpha", "--table", "drills", "--format", "csv")
    assert proc.returncode == 0 and proc.stdout.splitlines()[0].startswith("job,step,started_at")
    home = tmp_path / "home"
    proc = _ckptier("report", env={"CKPTIER_HOME": str(home), "CKPTIER_CATALOG_URL": ""})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "no catalog at" in proc.stderr, proc.stderr
    assert not home.exists()
    for bad in (["--job", "nope"], ["--table", "nope"], ["--step", "3"]):
        proc = _ckptier("report", "--catalog", url, *bad)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr


def test_dashboard_command_refuses_an_open_bind_without_token(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    build_catalog(url)
    proc = _ckptier("dashboard", "--catalog", url, "--host", "0.0.0.0", "--port", "1", env={"CKPTIER_DASHBOARD_TOKEN": ""})
    assert proc.returncode == 2 and "not a loopback address, without a token" in proc.stderr
    assert proc.stderr.count("\n") == 1
    proc = _ckptier("dashboard", "--catalog", url, "--token", "short")
    assert proc.returncode == 2 and "at least 16" in proc.stderr


def test_dashboard_imports_only_storage_and_tasks(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    build_catalog(url)
    code = """
import sys
from datetime import UTC, datetime
from ckptier.dashboard import app, cli, source, tables
from ckptier.tasks.config import parse_config
src = source.open_source(sys.argv[1], parse_config(sys.argv[2]))
for job, step in ((None, None), ("alpha", None), ("alpha", 600)):
    snap = tables.Snapshot(src, now=datetime.now(UTC), job=job, step=step)
    for name, spec in tables.TABLES.items():
        if (spec.scope == "job" and job is None) or (spec.scope == "checkpoint" and step is None):
            continue
        snap.table(name)
print(sorted(m for m in sys.modules if m.startswith(("ckptier.flows", "ckptier.deployments", "prefect"))))
"""
    proc = subprocess.run([sys.executable, "-c", code, url, POLICY], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# ------------------------------------------------------------------ the web app, in process


@pytest.fixture
def sqlite_facts(tmp_path: Path) -> Iterator[Any]:
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    build_catalog(url)
    with open_source(url, parse_config(POLICY)) as source:
        yield source


def _client(source: Any, **kw: Any) -> TestClient:
    return TestClient(create_app(source, clock=lambda: NOW, **kw), base_url="http://127.0.0.1:8765")


def test_job_page_reads_no_file_rows_and_a_fixed_number_of_statements(sqlite_facts: Any) -> None:
    """The job page costs what its checkpoints and events cost, never a row per file: no statement reads the
    files table, and the statements it runs are as many with 12 files a checkpoint as with 2."""
    from sqlalchemy import event, insert, select

    from ckptier.storage.catalog.tables import checkpoints as ck
    from ckptier.storage.catalog.tables import files as fl

    def statements() -> list[str]:
        seen: list[str] = []

        def listen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            if not statement.lstrip().upper().startswith(("BEGIN", "COMMIT", "ROLLBACK", "PRAGMA", "SAVEPOINT", "RELEASE")):
                seen.append(" ".join(statement.split()))

        event.listen(sqlite_facts.engine, "before_cursor_execute", listen)
        try:
            assert client.get("/jobs/alpha").status_code == 200
        finally:
            event.remove(sqlite_facts.engine, "before_cursor_execute", listen)
        return seen

    client = _client(sqlite_facts)
    client.get("/jobs/alpha")
    before = statements()
    assert not [sql for sql in before if " files" in sql.lower()], before
    with sqlite_facts.engine.begin() as conn:
        ids = list(conn.execute(select(ck.c.id)).scalars())
        conn.execute(insert(fl), [{"checkpoint_id": cid, "relpath": f"rank-{r:04d}/extra.pt", "size": 1, "mtime": 0.0,
                                   "etag": "e", "status": "ok"} for cid in ids for r in range(10)])
    after = statements()
    assert len(after) == len(before) and not [sql for sql in after if " files" in sql.lower()]


def test_pages_render_with_security_headers(sqlite_facts: Any) -> None:
    client = _client(sqlite_facts)
    for path in ("/", "/jobs/alpha", "/checkpoint?job=alpha&step=600", "/jobs/beta"):
        r = client.get(path)
        assert r.status_code == 200, (path, r.text[:500])
        assert "script-src" not in r.headers["content-security-policy"]
        assert "default-src 'none'" in r.headers["content-security-policy"] and r.headers["x-frame-options"] == "DENY"
        assert "<script" not in r.text
    home = client.get("/").text
    assert "the only copy of step 600 is a damaged archive copy" in home and 'href="/jobs/alpha"' in home
    assert 'id="t-drills"' in home and 'id="t-events"' in home and "step 900 failed: loss is nan" in home
    job = client.get("/jobs/alpha").text
    assert 'aria-label="checkpoints by step"' in job and "recovery point 800" in job and 'aria-label="storage over time"' in job
    ck = client.get("/checkpoint?job=alpha&step=600").text
    assert "ckptier fetch --catalog sqlite:///" in ck and "--job alpha --step 600 ./alpha-step-600" in ck
    assert client.get("/jobs/gamma").status_code == 404 and client.get("/checkpoint?job=alpha&step=150").status_code == 404


def test_downloads_are_the_tables(sqlite_facts: Any) -> None:
    client = _client(sqlite_facts)
    snap = Snapshot(sqlite_facts, now=NOW, job="alpha")
    r = client.get("/data/checkpoints.json?job=alpha")
    assert r.status_code == 200 and 'filename="ckptier-checkpoints-alpha.json"' in r.headers["content-disposition"]
    assert r.json() == records(snap.table("checkpoints"))
    r = client.get("/data/storage.csv?job=alpha")
    assert r.headers["content-type"].startswith("text/csv") and r.text == to_csv(snap.table("storage"))
    assert client.get("/data/files.csv?job=alpha").status_code == 404
    assert client.get("/data/jobs.xml").status_code == 404


def test_job_names_keys_and_messages_are_escaped_and_credentials_hidden(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    build_catalog(url, alpha=XSS)
    with Catalog.open(url) as cat:
        rec = cat.get(XSS, 600)
        assert rec is not None
        cat.add_copy(rec.id, tier=Tier.ARCHIVE, url="s3://AKIAEXAMPLE:wJalrXUtnFEMI@cold/x?X-Amz-Signature=deadbeef",
                     stored_bytes=1, codec=None, manifest_key=None, verified_at=None, now=hours(12))
        cat.log_event("note", f"{XSS} pushed to postgresql://u:hunter2@db/c", now=hours(12), job=XSS)
    with open_source(url, parse_config(POLICY)) as source:
        client = _client(source)
        pages = [client.get("/").text, client.get("/jobs/" + "%3Cimg%20src%3Dx%20onerror%3Dalert(1)%3E").text,
                 client.get("/checkpoint", params={"job": XSS, "step": 600}).text,
                 client.get("/data/events.csv", params={"job": XSS}).text,
                 client.get("/data/copies.json", params={"job": XSS, "step": 600}).text]
    for text in pages[:3]:
        assert "<img" not in text and "&lt;img src=x onerror=alert(1)&gt;" in text
    for text in pages:
        assert "wJalrXUtnFEMI" not in text and "hunter2" not in text and "deadbeef" not in text
    assert "s3://AKIAEXAMPLE:***@cold/x?X-Amz-Signature=***" in pages[4]


def test_catalog_password_is_never_shown(facts: Any, catalog_url: str) -> None:
    if facts.catalog.dialect != "postgresql":
        pytest.skip("only a PostgreSQL URL carries a password here")
    from sqlalchemy.engine import make_url

    # The test server trusts every connection, so any password works and must not appear.
    with_password = make_url(catalog_url).set(password="Sup3rSecret").render_as_string(hide_password=False)
    with open_source(with_password, facts.config) as source:
        client = _client(source)
        for path in ("/", "/jobs/alpha", "/checkpoint?job=alpha&step=800"):
            text = client.get(path).text
            assert "Sup3rSecret" not in text and "***@" in text
        assert "CKPTIER_CATALOG_URL" in client.get("/checkpoint?job=alpha&step=800").text


def test_token_is_required_everywhere_once_set(sqlite_facts: Any) -> None:
    token = "t" * 24
    client = _client(sqlite_facts, token=token)
    for path in ("/", "/jobs/alpha", "/data/jobs.json", "/checkpoint?job=alpha&step=800"):
        r = client.get(path)
        assert r.status_code == 401 and "Token required" in r.text
        assert "alpha" not in r.text and "sqlite" not in r.text  # nothing about the catalog
    assert client.get("/", headers={"Authorization": "Bearer " + "t" * 23 + "x"}).status_code == 401
    assert client.get("/?token=wrong").status_code == 401
    assert client.get("/static/style.css").status_code == 200
    assert client.get("/data/jobs.json", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    r = client.get(f"/jobs/alpha?token={token}&run=x", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/jobs/alpha?run=x" and token not in r.headers["location"]
    assert client.get("/").status_code == 200  # the cookie set by the redirect


def test_drill_button_without_api_is_disabled_with_the_reason(sqlite_facts: Any) -> None:
    client = _client(sqlite_facts)
    page = client.get("/jobs/alpha").text
    assert 'id="drill-button" disabled' in page and "no Prefect API is configured: set PREFECT_API_URL" in page
    csrf = client.cookies.get(security.CSRF_COOKIE)
    r = client.post("/drill", data={"job": "alpha", "csrf": csrf})
    assert r.status_code == 503 and "no Prefect API is configured" in r.text


def test_drill_post_needs_a_matching_csrf_token_and_same_origin(sqlite_facts: Any) -> None:
    client = _client(sqlite_facts)
    client.get("/jobs/alpha")
    csrf = client.cookies.get(security.CSRF_COOKIE)
    assert csrf
    assert client.post("/drill", data={"job": "alpha"}).status_code == 403
    assert client.post("/drill", data={"job": "alpha", "csrf": "forged"}).status_code == 403
    r = client.post("/drill", data={"job": "alpha", "csrf": csrf}, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and "another origin" in r.text
    r = client.post("/drill", data={"job": "alpha", "csrf": csrf}, headers={"Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 403
    # A fresh client (another site's page) has no cookie at all.
    stranger = _client(sqlite_facts)
    assert stranger.post("/drill", data={"job": "alpha", "csrf": csrf}).status_code == 403
    unreachable = PrefectDrills("http://127.0.0.1:9/api")
    assert not unreachable.status().enabled and "does not answer" in unreachable.status().reason


# ------------------------------------------------------------------ the drill button's catalog, bad numbers


class FakePrefectAPI:
    """A Prefect API as the drill button uses it (httpx.MockTransport): the deployment, flow runs by id."""

    def __init__(self) -> None:
        self.created: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "GET" and path == "/api/deployments/name/restore-drill/restore-drill":
            return httpx.Response(200, json={"id": "dep-1", "paused": False})
        if request.method == "POST" and path == "/api/deployments/dep-1/create_flow_run":
            self.created.append(json.loads(request.content))
            return httpx.Response(201, json=self._run(len(self.created)))
        if request.method == "GET" and path.startswith("/api/flow_runs/run-"):
            return httpx.Response(200, json=self._run(int(path.rsplit("-", 1)[1])))
        return httpx.Response(404, json={"detail": "not found"})

    def _run(self, n: int) -> dict[str, Any]:
        return {"id": f"run-{n}", "name": f"drill-{n}", "state": {"name": "Scheduled"}}


def test_drill_button_drills_the_catalog_on_screen_not_the_deployments(tmp_path: Path) -> None:
    """Two catalogs share job ``alpha``; the dashboard over B sends B (and its config) to the flow run,
    whatever catalog the deployment's Variables name, and the page says which catalog that is."""
    from ckptier.tasks.config import load_config

    urls = {}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        urls[name] = f"sqlite:///{tmp_path / name / 'catalog.db'}"
        build_catalog(urls[name])
    config = tmp_path / "b" / "ckptier.toml"
    config.write_text(POLICY)
    api = FakePrefectAPI()
    drills = PrefectDrills("http://prefect.test/api", environ={}, transport=httpx.MockTransport(api))
    here = os.getcwd()
    os.chdir(tmp_path)  # a relative SQLite path and config: the flow run gets them absolute
    try:
        source = open_source("sqlite:///b/catalog.db", load_config("b/ckptier.toml"))
    finally:
        os.chdir(here)
    with source:
        client = _client(source, prefect=drills)
        page = client.get("/jobs/alpha").text
        assert f'id="drill-catalog">{urls["b"]}</code>' in page and f'id="drill-config">{config}</code>' in page
        r = client.post("/drill", data={"job": "alpha", "csrf": client.cookies.get(security.CSRF_COOKIE)},
                        follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/jobs/alpha?run=run-1#drill", r.text
        client.get("/checkpoint?job=alpha&step=800")
        r = client.post("/drill", data={"job": "alpha", "step": "800", "csrf": client.cookies.get(security.CSRF_COOKIE)},
                        follow_redirects=False)
        assert r.status_code == 303
    assert [c["parameters"] for c in api.created] == [
        {"job": "alpha", "catalog_url": urls["b"], "config_path": str(config)},
        {"job": "alpha", "step": 800, "catalog_url": urls["b"], "config_path": str(config)},
    ]
    assert all(c["tags"] == ["ckptier-dashboard"] for c in api.created)


def test_drill_button_withholds_the_catalog_password_and_says_so(facts: Any, catalog_url: str) -> None:
    if facts.catalog.dialect != "postgresql":
        pytest.skip("only a PostgreSQL URL carries a password here")
    from sqlalchemy.engine import make_url

    with_password = make_url(catalog_url).set(password="Sup3rSecret").render_as_string(hide_password=False)
    api = FakePrefectAPI()
    with open_source(with_password, facts.config) as source:
        client = _client(source, prefect=PrefectDrills("http://prefect.test/api", environ={},
                                                      transport=httpx.MockTransport(api)))
        page = client.get("/jobs/alpha").text
        assert "Sup3rSecret" not in page and "its password is not sent to Prefect" in page
        client.post("/drill", data={"job": "alpha", "csrf": client.cookies.get(security.CSRF_COOKIE)})
    (sent,) = api.created
    assert "Sup3rSecret" not in json.dumps(sent)
    assert make_url(sent["parameters"]["catalog_url"]) == make_url(catalog_url)._replace(password=None)
    assert "config_path" not in sent["parameters"]  # this dashboard has no config file: the worker's own


@pytest.mark.parametrize(("path", "fragment"), [
    ("/checkpoint?job=alpha&step=99999999999999999999999", "step=99999999999999999999999 is out of range"),
    ("/checkpoint?job=alpha&step=9223372036854775808", "is out of range; give one from 0 to 9,223,372,036,854,775,807"),
    ("/checkpoint?job=alpha&step=-1", "step=-1 is out of range"),
    ("/checkpoint?job=alpha&step=1e3", "step=1e3 is not a whole number"),
    ("/checkpoint?job=alpha&step=" + "9" * 5000, "is out of range"),
    ("/checkpoint?job=alpha", "step is missing"),
    ("/checkpoint?step=800", "job is missing"),
    ("/data/files.csv?job=alpha&step=99999999999999999999999", "step=99999999999999999999999 is out of range"),
    ("/jobs/alpha?page=0", "page=0 is out of range"),
    ("/jobs/alpha?page=99999999999999999999999", "page=99999999999999999999999 is out of range"),
    ("/jobs/alpha?per=100000", "per=100000 is out of range; give one from 10 to 500"),
    ("/jobs/alpha?per=x", "per=x is not a whole number"),
])
def test_out_of_range_numbers_are_a_400_naming_the_parameter(sqlite_facts: Any, path: str, fragment: str) -> None:
    r = _client(sqlite_facts).get(path)
    assert r.status_code == 400 and fragment in r.text, (path, r.status_code, r.text[:300])
    assert "Traceback" not in r.text and "internal error" not in r.text


def test_drill_form_step_is_bounded_like_the_query(sqlite_facts: Any) -> None:
    client = _client(sqlite_facts)
    client.get("/jobs/alpha")
    r = client.post("/drill", data={"job": "alpha", "step": "99999999999999999999999",
                                    "csrf": client.cookies.get(security.CSRF_COOKIE)})
    assert r.status_code == 400 and "step=99999999999999999999999 is out of range" in r.text


def test_largest_step_the_catalog_holds_is_a_404_not_a_400(sqlite_facts: Any) -> None:
    r = _client(sqlite_facts).get(f"/checkpoint?job=alpha&step={2**63 - 1}")
    assert r.status_code == 404 and "has no step 9223372036854775807" in r.text


# ------------------------------------------------------------------ pagination, compact charts, tonight's plan


def test_job_page_tables_are_paginated_with_links(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    with Catalog.open(url) as cat:
        cat.record_scan(STORE, Recognition(tuple(_found("long", s, hours(s / 100)) for s in range(100, 2501, 100)), (), 50),
                        now=hours(26), scope_prefix="long")
    with open_source(url, parse_config(POLICY)) as source:
        client = _client(source)
        first = client.get("/jobs/long?per=10").text
        assert "rows 1–10 of 25 · page 1 of 3" in first and "more rows in the downloads" not in first
        steps = [int(s) for s in _steps_in(first)]
        assert steps == list(range(2500, 1500, -100))  # newest first
        assert 'href="/jobs/long?per=10&amp;page=2#checkpoints"' in first
        last = client.get("/jobs/long?per=10&page=3").text
        assert "rows 21–25 of 25 · page 3 of 3" in last and _steps_in(last) == ["500", "400", "300", "200", "100"]
        assert client.get("/jobs/long?per=10&page=999").text.count("page 3 of 3") == 1  # past the end: the last page
        assert "page 1 of" not in client.get("/jobs/long").text  # 25 rows fit one default page: no pager


def _steps_in(page: str) -> list[str]:
    """The steps of the checkpoints table on a job page, in order."""
    import re

    table = page[page.index('id="t-checkpoints"'):]
    table = table[:table.index("</table>")]
    return re.findall(r'<td class="num"><a href="/checkpoint\?job=[^&]+&amp;step=(\d+)">', table)


def test_step_chart_is_compact_for_thousands_of_checkpoints() -> None:
    marks = [charts.Mark(s, "deleted" if s % 7 else "hot", "deleted" if s % 7 else "verified", f"step {s}",
                         f"/checkpoint?job=j&step={s}") for s in range(1000, 5_001_000, 1000)]
    marks.append(charts.Mark(2_500_000, "hot", "corrupt", "step 2500000", "/checkpoint?job=j&step=2500000"))
    svg = str(charts.step_chart(marks))
    rects = svg.count('<rect class="mark')
    assert rects <= 2 * charts.MAX_MARK_COLUMNS and len(svg) < 200_000, (rects, len(svg))
    assert svg.count("st-corrupt") == 1  # the worst state of a merged column still shows
    assert "checkpoints, steps" in svg  # a merged column says what it holds


def test_step_chart_draws_a_run_of_one_state_as_a_few_bars() -> None:
    marks = [charts.Mark(s, "deleted", "deleted", f"step {s}", f"/checkpoint?job=j&step={s}") for s in range(1, 5001)]
    marks.append(charts.Mark(2500, "deleted", "corrupt", "step 2500", "/checkpoint?job=j&step=2500"))
    svg = str(charts.step_chart(marks))
    bars = svg.count('<rect class="mark')
    assert bars <= charts.MAX_MARK_COLUMNS // charts.MAX_RUN_COLUMNS + 4, bars
    assert svg.count("st-corrupt") == 1 and "step=2500" in svg and "step=1&" not in svg and 'step=1"' in svg
    covered = sum(int(n.replace(",", "")) for n in re.findall(r"<title>([\d,]+) checkpoints", svg))
    assert covered + svg.count("<title>step ") == 5001  # every checkpoint is in one bar


def test_time_chart_lines_are_decimated_but_keep_their_peaks() -> None:
    n = 20_000
    times = [T0 + timedelta(minutes=i) for i in range(n)]
    values = [1000 + (i % 50) for i in range(n)]
    values[12_345] = 99_999  # one spike
    svg = str(charts.time_chart(times, [charts.Series("tier-hot", "hot", values)]))
    path = svg[svg.index('<path class="line tier-hot" d="') + 31:]
    path = path[:path.index('"')]
    vertices = path.count("L") + 1
    assert vertices <= 6 * charts.MAX_LINE_COLUMNS + 2, vertices
    ys = [float(p.split(",")[1]) for p in path.replace("M", "").split(" L")]
    assert min(ys) < 30  # the spike reaches the top of the plot
    pts = charts.step_points([(0.0, 5.0), (0.2, 1.0), (0.4, 9.0), (0.6, 3.0), (3.0, 4.0)], 1.0)
    assert pts == [(0.0, 5.0), (0.0, 1.0), (0.0, 9.0), (0.0, 3.0), (0.6, 3.0), (3.0, 3.0), (3.0, 4.0)]


def test_overview_shows_tonights_plan_and_a_cost_chart(sqlite_facts: Any) -> None:
    client = _client(sqlite_facts, background_wait=60)
    home = client.get("/").text
    plan = Snapshot(sqlite_facts, now=NOW, job="alpha").table("plan")
    deletes = plan[plan["action"].str.startswith("delete")]
    tonight = Snapshot(sqlite_facts, now=NOW).table("tonight").set_index("job")
    assert int(tonight.loc["alpha", "delete"]) == len(deletes) == 2
    assert int(tonight.loc["alpha", "delete_bytes"]) == int(deletes["bytes"].sum()) == 2000
    assert int(tonight.loc["alpha", "freed_bytes"]) == 2000 and int(tonight.loc["alpha", "hot_bytes_after"]) == 5000
    assert "deletion suspended for job 'beta'" in tonight.loc["beta", "note"]
    assert 'id="t-tonight"' in home and "delete <b>2</b> (2.0 kB) and free <b>2.0 kB</b> of 7.0 kB hot" in home
    assert "planned at 14:00:00 UTC" in home
    assert 'aria-label="cost over time"' in home and 'href="/data/cost_history.csv"' in home
    assert 'aria-label="cost over time"' in client.get("/costs").text
    history = Snapshot(sqlite_facts, now=NOW).table("cost_history")
    costs = Snapshot(sqlite_facts, now=NOW).table("costs")
    assert history["monthly_cost"].iloc[-1] == pytest.approx(costs["monthly_cost"].sum(), rel=1e-6)
    jobs = Snapshot(sqlite_facts, now=NOW).table("jobs")
    assert list(history["at"]) == sorted(history["at"]) and history["at"].iloc[-1] == pd.Timestamp(NOW)
    assert history["hot_bytes"].iloc[-1] == jobs["hot_bytes"].sum() == 7000


def test_overview_does_not_wait_for_a_slow_plan(sqlite_facts: Any) -> None:
    client = _client(sqlite_facts, background_wait=0)
    home = client.get("/").text
    assert 'id="tonight-pending"' in home and "being computed, reload in a moment" in home
    client.app.state.background.get(wait=60)  # type: ignore[attr-defined]
    assert 'id="t-tonight"' in client.get("/").text


# ------------------------------------------------------------------ recovery events


def _recovering_catalog(tmp_path: Path) -> str:
    """The facts, plus recovery events: alpha resumed and failed within 7 days, resumed 10 days
    ago and 40 days ago; a name the catalog does not know failed once."""
    from ckptier.storage.catalog.api import RecoveryRecord

    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    build_catalog(url)
    with Catalog.open(url) as cat:
        for job, at, outcome in (("alpha", hours(10), "resumed"), ("alpha", hours(11), "failed"),
                                 ("alpha", hours(-240), "resumed"), ("alpha", hours(-960), "resumed"),
                                 ("ghost", hours(12), "failed")):
            cat.record_recovery(RecoveryRecord(job, at, 0.5, outcome, "full", step=800 if outcome == "resumed" else None,
                                               error=None if outcome == "resumed" else "no checkpoint can be proven"))
    return url


def test_recoveries_attempted_and_succeeded_per_job_over_7_and_30_days(tmp_path: Path) -> None:
    url = _recovering_catalog(tmp_path)
    with open_source(url, parse_config(POLICY)) as source:
        rows = {(r["job"], r["days"]): (r["resumes"], r["resumed"], r["resume_rate"])
                for r in records(Snapshot(source, now=NOW).table("recovery"))}
        assert rows[("alpha", 7)] == (2, 1, 0.5) and rows[("alpha", 30)] == (3, 2, pytest.approx(0.6667))
        assert rows[("beta", 7)] == (0, 0, None) and rows[("ghost", 30)] == (1, 0, 0.0)
        assert rows[("(all jobs)", 7)] == (3, 1, pytest.approx(0.3333)) and rows[("(all jobs)", 30)][:2] == (4, 2)
        jobs = Snapshot(source, now=NOW).table("jobs").set_index("job")
        assert [int(jobs.at["alpha", c]) for c in ("resumes_7d", "resumed_7d", "resumes_30d", "resumed_30d")] == [2, 1, 3, 2]
        assert int(jobs.at["beta", "resumes_30d"]) == 0
        one = {(r["job"], r["days"]) for r in records(Snapshot(source, now=NOW, job="alpha").table("recovery"))}
        assert ("ghost", 7) not in one and ("alpha", 7) in one

        client = _client(source)
        home = client.get("/").text
        assert "resumed 1/2 (7d), 2/3 (30d)" in home and home.count('class="sub resumes"') == 1  # beta: none
        assert "resumed 1/2 (7d), 2/3 (30d)" in client.get("/jobs/alpha").text
        assert "resumed" not in client.get("/jobs/beta").text.split('class="s"', 1)[-1].split("</div>", 1)[0]

    config = tmp_path / "ckptier.toml"
    config.write_text(POLICY)
    out = io.StringIO()
    assert print_report(catalog_url=url, config_path=str(config), job=None, step=None, fmt="table", tables=None,
                        now=NOW, out=out) == 0
    text = out.getvalue()
    section = text.split("Recovery success rate", 1)[1]
    assert "Resumes" in section and "Resumed" in section and "Resume rate" in section
    assert any(line.split()[:2] == ["alpha", "30"] and line.split()[-3:] == ["3", "2", "67%"]
               for line in section.splitlines()), section
    out = io.StringIO()
    assert print_report(catalog_url=url, config_path=str(config), job=None, step=None, fmt="json", tables=None,
                        now=NOW, out=out) == 0
    data = json.loads(out.getvalue())
    assert {(r["job"], r["days"], r["resumes"], r["resumed"]) for r in data["recovery"]} >= {
        ("alpha", 7, 2, 1), ("alpha", 30, 3, 2), ("ghost", 7, 1, 0)}
    assert {(r["job"], r["resumes_7d"], r["resumed_30d"]) for r in data["jobs"]} == {("alpha", 2, 2), ("beta", 0, 0)}
