"""The catalog, run against SQLite and a real PostgreSQL server (``catalog_url``)."""

from __future__ import annotations

from dataclasses import replace
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from ckptier.storage.catalog import scans as catalog_scans
from ckptier.storage.catalog.api import Catalog, DrillRecord, FileCheck, UnknownCheckpoint
from ckptier.storage.catalog.db import (
    default_catalog_url,
    filesystem_type,
    make_engine,
    mask_url,
)
from ckptier.storage.catalog.tables import Base
from ckptier.storage.errors import ConfigError
from ckptier.storage.records import FileRef, Format, Found, Recognition, State, Tier
from tests.fixtures.services import free_port

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
STORE = "s3://bucket/runs"
TABLES = ("jobs", "checkpoints", "files", "copies", "decisions", "events", "drills", "scans", "recoveries")


def found(
    job: str,
    step: int,
    *,
    committed: bool = True,
    files: dict[str, int] | None = None,
    mtime: float = 1_700_000_000.0,
    expected: dict[str, str] | None = None,
    loss: float | None = None,
) -> Found:
    files = files if files is not None else {"rank-0000/model.pt": 100, "metadata.json": 10}
    prefix = f"{job}/step-{step:08d}"
    return Found(
        job=job,
        step=step,
        format=Format.GUIDE,
        prefix=prefix,
        files=tuple(
            FileRef(key=f"{prefix}/{rel}", relpath=rel, size=size, mtime=mtime, etag=f"e{size}")
            for rel, size in sorted(files.items())
        ),
        committed=committed,
        reason="metadata.json present" if committed else "metadata.json missing",
        expected_sha256=expected or {},
        recorded_loss=loss,
    )


def recog(*items: Found) -> Recognition:
    return Recognition(checkpoints=tuple(items), unrecognised=(), objects=sum(len(f.files) for f in items))


@pytest.fixture
def cat(catalog_url: str) -> Iterator[Catalog]:
    with Catalog.open(catalog_url) as c:
        yield c


def table_counts(c: Catalog) -> dict[str, int]:
    with c._engine.connect() as conn:
        return {t: conn.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar_one() for t in TABLES}


class Statements:
    """Records the SQL statements every engine executes while active."""

    def __init__(self) -> None:
        self.sql: list[str] = []

    def __call__(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        self.sql.append(statement.strip())

    def writes(self) -> list[str]:
        verbs = ("INSERT", "UPDATE", "DELETE", "CREATE", "ALTER", "DROP")
        return [s for s in self.sql if s.upper().startswith(verbs)]


@pytest.fixture
def statements() -> Iterator[Statements]:
    rec = Statements()
    sa.event.listen(sa.engine.Engine, "before_cursor_execute", rec)
    try:
        yield rec
    finally:
        sa.event.remove(sa.engine.Engine, "before_cursor_execute", rec)


def ok_checks(c: Catalog, job: str, step: int) -> list[FileCheck]:
    rec = c.get(job, step)
    assert rec is not None
    return [FileCheck(f.relpath, "ok", f.size, f"crc-{f.relpath}", None, None) for f in rec.files]


# -- schema and opening --------------------------------------------------------------


def test_migrations_create_schema_and_reopen_is_a_noop(catalog_url: str, statements: Statements) -> None:
    from ckptier.storage.catalog import db

    with Catalog.open(catalog_url) as c:
        engine = c._engine
        assert set(TABLES) <= set(sa.inspect(engine).get_table_names())
        with engine.connect() as conn:
            # The migrated schema is exactly what the models describe.
            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
            assert MigrationContext.configure(conn).get_current_revision() == db.HEAD_REVISION
    assert any(s.upper().startswith("CREATE TABLE") for s in statements.writes())
    statements.sql.clear()
    with Catalog.open(catalog_url) as c:
        assert c.jobs() == []
    assert statements.writes() == []


def test_times_come_back_aware_utc_and_naive_times_are_refused(cat: Catalog) -> None:
    plus2 = T0.astimezone(__import__("datetime").timezone(timedelta(hours=2)))
    cat.record_scan(STORE, recog(found("a", 1)), now=plus2)
    rec = cat.get("a", 1)
    assert rec is not None
    assert rec.first_seen == T0 and rec.first_seen.utcoffset() == timedelta(0)
    assert rec.saved_at == datetime.fromtimestamp(1_700_000_000.0, UTC)
    with pytest.raises(ValueError, match="naive"):
        cat.record_scan(STORE, recog(found("a", 2)), now=datetime(2026, 1, 1))



@pytest.mark.parametrize(("stored", "micro"), [("2026-06-01 10:30:00.250000", 250_000), ("2026-06-01 10:30:00", 0),
                                               ("2026-06-01T10:30:00.25", 250_000),
                                               ("2026-06-01 12:30:00.250000+02:00", 250_000),
                                               ("2026-06-01 10:30:00.25Z", 250_000)])
def test_sqlite_time_text_of_any_iso_form_reads_as_the_same_aware_utc_moment(stored: str, micro: int) -> None:
    from ckptier.storage.catalog.tables import UTCDateTime

    process = UTCDateTime().result_processor(sa.create_engine("sqlite://").dialect, None)
    got = process(stored)
    want = datetime(2026, 6, 1, 10, 30, 0, micro, tzinfo=UTC)
    assert got == want and got is not None and got.utcoffset() == timedelta(0) and got.tzinfo is UTC
    assert process(None) is None

# -- scanning ------------------------------------------------------------------------


def test_first_scan_records_jobs_checkpoints_files_and_hot_copies(cat: Catalog) -> None:
    s = cat.record_scan(
        STORE,
        recog(found("a", 1, loss=2.5), found("a", 2, committed=False), found("b", 7)),
        now=T0,
    )
    # 2 jobs + 3 checkpoints + 6 files + 3 copies
    assert (s.rows_written, s.new, s.checkpoints) == (14, 3, 3)
    assert cat.jobs() == ["a", "b"]
    recs = cat.checkpoints()
    assert [(r.job, r.step, r.state) for r in recs] == [
        ("a", 1, State.COMMITTED),
        ("a", 2, State.INCOMPLETE),
        ("b", 7, State.COMMITTED),
    ]
    a1 = recs[0]
    assert a1.location == f"{STORE}/a/step-00000001"
    assert a1.bytes == 110 and a1.recorded_loss == 2.5
    assert [f.relpath for f in a1.files] == ["metadata.json", "rank-0000/model.pt"]
    assert [(c.tier, c.url, c.state) for c in a1.copies] == [(Tier.HOT, a1.location, "present")]
    assert a1.tiers == ("hot",)
    with cat._engine.connect() as conn:
        assert conn.execute(sa.text("SELECT hot_url FROM jobs WHERE name='a'")).scalar_one() == f"{STORE}/a"


def test_unchanged_rescan_writes_nothing(cat: Catalog, statements: Statements) -> None:
    listing = recog(found("a", 1), found("a", 2, committed=False), found("b", 3, loss=1.0))
    assert cat.record_scan(STORE, listing, now=T0).rows_written > 0
    cat.record_scan(STORE, recog(found("a", 1), found("b", 3, loss=1.0)), now=T0 + timedelta(hours=1))
    cat.record_scan(STORE, listing, now=T0 + timedelta(hours=2))  # a/2 reappears
    before_counts = table_counts(cat)
    before = {(r.job, r.step): r for r in cat.checkpoints()}
    statements.sql.clear()

    s = cat.record_scan(STORE, listing, now=T0 + timedelta(days=1))

    assert s.rows_written == 0
    assert (s.new, s.changed, s.vanished, s.reappeared) == (0, 0, 0, 0)
    assert statements.writes() == []
    assert table_counts(cat) == before_counts
    after = {(r.job, r.step): r for r in cat.checkpoints()}
    assert after == before  # last_seen included


def test_incomplete_becomes_committed_when_evidence_appears(cat: Catalog) -> None:
    cat.record_scan(STORE, recog(found("a", 5, committed=False, files={"rank-0000/model.pt": 100})), now=T0)
    assert cat.get("a", 5).state == State.INCOMPLETE  # type: ignore[union-attr]
    s = cat.record_scan(STORE, recog(found("a", 5)), now=T0 + timedelta(minutes=5))
    rec = cat.get("a", 5)
    assert rec is not None and rec.state == State.COMMITTED
    assert rec.state_reason == "metadata.json present"
    assert rec.last_seen == T0 + timedelta(minutes=5) and rec.first_seen == T0
    assert s.committed == 1 and s.rows_written == 3  # checkpoint, metadata.json, hot copy size
    assert [e.kind for e in cat.events(job="a", kinds=["committed"])] == ["committed"]


def test_vanished_gets_missing_since_and_reappearing_clears_it(cat: Catalog) -> None:
    cat.record_scan(STORE, recog(found("a", 1), found("a", 2)), now=T0)
    cid = cat.get("a", 1).id  # type: ignore[union-attr]
    t1 = T0 + timedelta(hours=3)
    s = cat.record_scan(STORE, recog(found("a", 2)), now=t1)
    assert s.vanished == 1 and s.rows_written == 2  # checkpoint + hot copy
    rec = cat.get_by_id(cid)
    assert rec is not None
    assert rec.missing_since == t1 and rec.state == State.COMMITTED  # state kept
    assert [c.state for c in rec.copies] == ["missing"] and rec.tiers == ()
    # Still missing: nothing more is written and missing_since keeps its first time.
    assert cat.record_scan(STORE, recog(found("a", 2)), now=t1 + timedelta(hours=1)).rows_written == 0
    assert cat.get_by_id(cid).missing_since == t1  # type: ignore[union-attr]

    s = cat.record_scan(STORE, recog(found("a", 1), found("a", 2)), now=t1 + timedelta(hours=2))
    assert s.reappeared == 1
    rec = cat.get_by_id(cid)
    assert rec is not None and rec.missing_since is None
    assert [c.state for c in rec.copies] == ["present"]
    kinds = [e.kind for e in cat.events(job="a")]
    assert kinds[:2] == ["reappeared", "vanished"]


def test_a_whole_job_vanishing_is_noticed(cat: Catalog) -> None:
    cat.record_scan(STORE, recog(found("a", 1), found("b", 1)), now=T0)
    s = cat.record_scan(STORE, recog(found("a", 1)), now=T0 + timedelta(hours=1))
    assert s.vanished == 1
    assert cat.get("b", 1).missing_since == T0 + timedelta(hours=1)  # type: ignore[union-attr]


def test_vanishing_is_judged_only_inside_the_scanned_store_and_scope(cat: Catalog) -> None:
    cat.record_scan(STORE, recog(found("a", 1), found("b", 1)), now=T0)
    cat.record_scan("file:///elsewhere", recog(found("c", 1)), now=T0)
    # A scan limited to prefix "a/" that lists nothing only affects a's checkpoints.
    s = cat.record_scan(STORE, recog(), now=T0 + timedelta(hours=1), scope_prefix="a/")
    assert s.vanished == 1
    assert cat.get("a", 1).missing_since is not None  # type: ignore[union-attr]
    assert cat.get("b", 1).missing_since is None  # type: ignore[union-attr]
    assert cat.get("c", 1).missing_since is None  # type: ignore[union-attr]


def test_changed_file_sends_verified_back_to_committed(cat: Catalog) -> None:
    cat.record_scan(STORE, recog(found("a", 1)), now=T0)
    cid = cat.get("a", 1).id  # type: ignore[union-attr]
    assert cat.record_verification(cid, ok_checks(cat, "a", 1), now=T0) == State.VERIFIED

    grown = found("a", 1, files={"rank-0000/model.pt": 101, "metadata.json": 10})
    t1 = T0 + timedelta(hours=1)
    s = cat.record_scan(STORE, recog(grown), now=t1)
    assert s.changed == 1
    rec = cat.get_by_id(cid)
    assert rec is not None
    assert rec.state == State.COMMITTED and rec.verified_at is None
    assert "rank-0000/model.pt" in (rec.state_reason or "")
    files = {f.relpath: f for f in rec.files}
    assert files["rank-0000/model.pt"].size == 101
    # The verified baseline survives the change: a replaced object must not become the new truth.
    assert files["rank-0000/model.pt"].status is None
    assert files["rank-0000/model.pt"].crc64nvme == "crc-rank-0000/model.pt"
    assert files["metadata.json"].status == "ok"  # untouched file keeps its verification
    assert cat.events(job="a", kinds=["changed"])[0].at == t1
    replaced = [FileCheck("rank-0000/model.pt", "ok", 101, "crc-other", None, None),
                FileCheck("metadata.json", "ok", 10, "crc-metadata.json", None, None)]
    assert cat.record_verification(cid, replaced, now=t1) == State.CORRUPT


def test_file_vanishing_from_a_complete_checkpoint_is_kept_as_missing(cat: Catalog) -> None:
    two = {"rank-0000/model.pt": 100, "rank-0001/model.pt": 100, "metadata.json": 10}
    cat.record_scan(STORE, recog(found("a", 1, files=two)), now=T0)
    cid = cat.get("a", 1).id  # type: ignore[union-attr]
    cat.record_verification(cid, ok_checks(cat, "a", 1), now=T0)
    one = {"rank-0000/model.pt": 100, "metadata.json": 10}
    cat.record_scan(STORE, recog(found("a", 1, files=one)), now=T0 + timedelta(hours=1))
    rec = cat.get_by_id(cid)
    assert rec is not None and rec.state == State.COMMITTED
    assert {f.relpath: f.status for f in rec.files}["rank-0001/model.pt"] == "missing"
    # Re-verifying cannot make it verified while the shard is gone.
    checks = ok_checks(cat, "a", 1)
    checks = [c if c.relpath != "rank-0001/model.pt" else FileCheck(c.relpath, "missing") for c in checks]
    assert cat.record_verification(cid, checks, now=T0 + timedelta(hours=2)) == State.CORRUPT
    # An unchanged rescan after that writes nothing.
    assert cat.record_scan(STORE, recog(found("a", 1, files=one)), now=T0 + timedelta(hours=3)).rows_written == 0


def test_deleted_checkpoint_reappearing_is_revived_with_an_event(cat: Catalog) -> None:
    cat.record_scan(STORE, recog(found("a", 1)), now=T0)
    cid = cat.get("a", 1).id  # type: ignore[union-attr]
    gen = cat.claim(cid, "run-1", now=T0, ttl=timedelta(minutes=10))
    assert gen is not None
    assert cat.mark_deleted(cid, owner="run-1", generation=gen, now=T0, reasons=["rolling, beyond keep_last=2"])
    # The files were deleted: the listing no longer shows it, and that writes nothing.
    assert cat.record_scan(STORE, recog(), now=T0 + timedelta(hours=1)).rows_written == 0
    assert cat.checkpoints() == [] and cat.get("a", 1).state == State.DELETED  # type: ignore[union-attr]
    # Someone copies it back: not silently resurrected.
    s = cat.record_scan(STORE, recog(found("a", 1)), now=T0 + timedelta(hours=2))
    assert s.resurrected == 1
    rec = cat.get("a", 1)
    assert rec is not None and rec.state == State.COMMITTED
    assert [c.state for c in rec.copies] == ["present"]
    assert cat.events(job="a", kinds=["resurrected"])[0].checkpoint_id == cid


def test_failure_mid_job_leaves_that_job_untouched_and_earlier_jobs_written(
    cat: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = catalog_scans._insert_files

    def failing(conn: Any, columns: tuple[str, ...], rows: list[tuple[Any, ...]]) -> int:
        if any(row[1] == "boom.pt" for row in rows):
            raise RuntimeError("injected failure")
        return real(conn, columns, rows)

    monkeypatch.setattr(catalog_scans, "_insert_files", failing)
    listing = recog(found("a", 1), found("b", 1, files={"ok.pt": 1, "boom.pt": 2}), found("c", 1))
    with pytest.raises(RuntimeError, match="injected"):
        cat.record_scan(STORE, listing, now=T0)
    assert cat.jobs() == ["a"]  # job b rolled back entirely (its job row too); c never started
    counts = table_counts(cat)
    assert (counts["checkpoints"], counts["files"], counts["copies"]) == (1, 2, 1)
    monkeypatch.undo()
    cat.record_scan(STORE, listing, now=T0)
    assert [r.job for r in cat.checkpoints()] == ["a", "b", "c"]


def test_rescan_of_many_checkpoints_is_bulk_and_fast(cat: Catalog, statements: Statements) -> None:
    files = {f"rank-{r:04d}/model.pt": 1000 + r for r in range(100)}
    listing = recog(*(found("big", step, files=files) for step in range(1000)))
    t = time.perf_counter()
    cat.record_scan(STORE, listing, now=T0)
    first = time.perf_counter() - t
    statements.sql.clear()
    t = time.perf_counter()
    s = cat.record_scan(STORE, listing, now=T0 + timedelta(hours=1))
    rescan = time.perf_counter() - t
    assert s.rows_written == 0
    # A handful of queries for the whole job, not one per checkpoint.
    assert len(statements.sql) < 15, statements.sql[:20]
    # Target ~1 s on this machine; generous bound against noisy neighbours.
    assert rescan < 10.0, f"rescan of 1,000 x 100 files took {rescan:.2f}s (first scan {first:.2f}s)"


# -- queries -------------------------------------------------------------------------


def test_latest_skips_corrupt_incomplete_and_missing(cat: Catalog) -> None:
    cat.record_scan(STORE, recog(*(found("a", s) for s in (1, 2, 3, 4)), found("a", 5, committed=False)), now=T0)
    ids = {s: cat.get("a", s).id for s in (1, 2, 3, 4, 5)}  # type: ignore[union-attr]
    assert cat.latest("a") is None  # nothing verified yet
    for s in (1, 2, 3):
        cat.record_verification(ids[s], ok_checks(cat, "a", s), now=T0)
    assert cat.latest("a").step == 3  # type: ignore[union-attr]
    # 3 gone from the hot store with no other copy: not safe to resume from.
    cat.record_scan(STORE, recog(*(found("a", s) for s in (1, 2, 4)), found("a", 5, committed=False)),
                    now=T0 + timedelta(hours=1))
    assert cat.latest("a").step == 2  # type: ignore[union-attr]
    # ... unless an archive copy is present.
    cat.add_copy(ids[3], tier=Tier.ARCHIVE, url="s3://archive/a/3", stored_bytes=90, codec="zstd",
                 manifest_key="a/3/manifest.json", verified_at=T0, now=T0)
    assert cat.latest("a").step == 3  # type: ignore[union-attr]
    # 4 corrupt, 5 incomplete: never chosen.
    bad = [FileCheck("rank-0000/model.pt", "corrupt", 100, None, "ff", "sha256 expected aa, got ff")]
    cat.record_verification(ids[4], bad, now=T0)
    assert cat.latest("a").step == 3  # type: ignore[union-attr]
    assert cat.latest("nope") is None


def test_checkpoint_filters_and_ordering(cat: Catalog) -> None:
    cat.record_scan(STORE, recog(found("b", 2), found("b", 10), found("a", 7, committed=False)), now=T0)
    assert [(r.job, r.step) for r in cat.checkpoints()] == [("a", 7), ("b", 2), ("b", 10)]
    assert [r.step for r in cat.checkpoints(job="b")] == [2, 10]
    assert [r.step for r in cat.checkpoints(states=[State.INCOMPLETE])] == [7]
    assert all(r.files == () for r in cat.checkpoints(with_files=False))
    assert cat.get("b", 99) is None and cat.get_by_id(10_000) is None


# -- verification --------------------------------------------------------------------


def test_record_verification(cat: Catalog) -> None:
    sha = "a" * 64
    cat.record_scan(STORE, recog(found("a", 1, expected={"rank-0000/model.pt": sha})), now=T0)
    cid = cat.get("a", 1).id  # type: ignore[union-attr]

    # Unreadable only: state unchanged, recorded per file.
    err = [FileCheck("rank-0000/model.pt", "error", None, None, None, "read timed out")]
    assert cat.record_verification(cid, err, now=T0) == State.COMMITTED
    f = {x.relpath: x for x in cat.get_by_id(cid).files}["rank-0000/model.pt"]  # type: ignore[union-attr]
    assert (f.status, f.detail) == ("error", "read timed out")

    # All ok: verified, crc64nvme recorded on first verification.
    t1 = T0 + timedelta(minutes=1)
    checks = [
        FileCheck("rank-0000/model.pt", "ok", 100, "crcA", sha, None),
        FileCheck("metadata.json", "ok", 10, "crcM", None, None),
    ]
    assert cat.record_verification(cid, checks, now=t1) == State.VERIFIED
    rec = cat.get_by_id(cid)
    assert rec is not None and rec.verified_at == t1
    model = {f.relpath: f for f in rec.files}["rank-0000/model.pt"]
    assert (model.size, model.mtime, model.etag, model.sha256_expected, model.status, model.detail) == (
        100, 1_700_000_000.0, "e100", sha, "ok", None)
    assert {f.relpath: f.crc64nvme for f in rec.files} == {"rank-0000/model.pt": "crcA", "metadata.json": "crcM"}
    assert rec.copies[0].verified_at == t1

    # A later read with a different crc64nvme contradicts the recorded one: corrupt.
    later = [checks[0], FileCheck("metadata.json", "ok", 10, "crcX", None, None)]
    assert cat.record_verification(cid, later, now=t1 + timedelta(days=1)) == State.CORRUPT
    rec = cat.get_by_id(cid)
    assert rec is not None
    assert rec.state_reason == "metadata.json: crc64nvme expected crcM, got crcX"
    assert {f.relpath: f.crc64nvme for f in rec.files}["metadata.json"] == "crcM"  # first value kept
    assert [e.kind for e in cat.events(job="a", kinds=["verified", "corrupt"])] == ["corrupt", "verified"]


def test_verification_checks_expected_sha256_and_names_the_file(cat: Catalog) -> None:
    cat.record_scan(STORE, recog(found("a", 1, expected={"rank-0000/model.pt": "a" * 64})), now=T0)
    cid = cat.get("a", 1).id  # type: ignore[union-attr]
    checks = [
        FileCheck("rank-0000/model.pt", "ok", 100, "c1", "b" * 64, None),
        FileCheck("metadata.json", "ok", 10, "c2", None, None),
    ]
    assert cat.record_verification(cid, checks, now=T0) == State.CORRUPT
    reason = cat.get_by_id(cid).state_reason  # type: ignore[union-attr]
    assert reason == f"rank-0000/model.pt: sha256 expected {'a' * 64}, got {'b' * 64}"
    # A partial set of ok results does not verify the checkpoint.
    cat.record_scan(STORE, recog(found("a", 2)), now=T0)
    c2 = cat.get("a", 2).id  # type: ignore[union-attr]
    assert cat.record_verification(c2, [FileCheck("metadata.json", "ok", 10)], now=T0) == State.COMMITTED
    with pytest.raises(ValueError, match="no file 'nope.pt'"):
        cat.record_verification(c2, [FileCheck("nope.pt", "ok", 1)], now=T0)
    with pytest.raises(UnknownCheckpoint):
        cat.record_verification(10_000, [], now=T0)


# -- leases and fencing --------------------------------------------------------------


def test_claim_release_and_generations(cat: Catalog) -> None:
    cat.record_scan(STORE, recog(found("a", 1)), now=T0)
    cid = cat.get("a", 1).id  # type: ignore[union-attr]
    ttl = timedelta(minutes=5)
    g1 = cat.claim(cid, "run-1", now=T0, ttl=ttl)
    assert g1 == 1
    assert cat.claim(cid, "run-2", now=T0 + timedelta(minutes=1), ttl=ttl) is None
    assert cat.claim(cid, "run-1", now=T0 + timedelta(minutes=1), ttl=ttl) is None  # no re-entry
    assert not cat.release(cid, "run-2", g1)
    assert cat.release(cid, "run-1", g1)
    g2 = cat.claim(cid, "run-2", now=T0 + timedelta(minutes=2), ttl=ttl)
    assert g2 == 2
    # Expired lease: anyone may take it, and the generation moves on.
    g3 = cat.claim(cid, "run-3", now=T0 + timedelta(minutes=8), ttl=ttl)
    assert g3 == 3
    assert not cat.release(cid, "run-2", g2)
    assert cat.get_by_id(cid).generation == 3  # type: ignore[union-attr]
    with pytest.raises(UnknownCheckpoint):
        cat.claim(10_000, "run-1", now=T0, ttl=ttl)


def test_two_owners_racing_exactly_one_wins(catalog_url: str) -> None:
    with Catalog.open(catalog_url) as setup:
        setup.record_scan(STORE, recog(*(found("a", s) for s in range(5))), now=T0)
        ids = [r.id for r in setup.checkpoints()]
    cats = [Catalog.open(catalog_url) for _ in range(2)]
    try:
        for cid in ids:
            barrier = threading.Barrier(2)
            results: list[int | None] = [None, None]

            def contend(i: int, cid: int = cid, barrier: threading.Barrier = barrier,
                        results: list[int | None] = results) -> None:
                barrier.wait()
                results[i] = cats[i].claim(cid, f"owner-{i}", now=T0, ttl=timedelta(minutes=1))

            threads = [threading.Thread(target=contend, args=(i,)) for i in range(2)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(30)
            assert [g for g in results if g is not None] == [1], results
    finally:
        for c in cats:
            c.close()


def test_zombie_whose_lease_was_taken_over_cannot_delete(cat: Catalog) -> None:
    cat.record_scan(STORE, recog(found("a", 1)), now=T0)
    cid = cat.get("a", 1).id  # type: ignore[union-attr]
    ttl = timedelta(minutes=5)
    zombie = cat.claim(cid, "zombie", now=T0, ttl=ttl)
    assert zombie is not None
    t_late = T0 + timedelta(minutes=10)
    # Lease expired: refused even before anyone else claims it.
    assert not cat.mark_deleted(cid, owner="zombie", generation=zombie, now=t_late, reasons=["old"])
    fresh = cat.claim(cid, "fresh", now=t_late, ttl=ttl)
    assert fresh == zombie + 1
    # The zombie's clock lags: its lease looks alive to it, but the generation fences it.
    assert not cat.mark_deleted(cid, owner="zombie", generation=zombie, now=T0 + timedelta(minutes=1),
                                reasons=["old"])
    rec = cat.get_by_id(cid)
    assert rec is not None and rec.state == State.COMMITTED
    assert cat.events(kinds=["deleted"]) == []
    assert cat.mark_deleted(cid, owner="fresh", generation=fresh, now=t_late, reasons=["rolling", "beyond keep 2"])
    rec = cat.get_by_id(cid)
    assert rec is not None and rec.state == State.DELETED and [c.state for c in rec.copies] == ["deleted"]
    tomb = cat.events(kinds=["deleted"])[0]
    assert tomb.data is not None and tomb.data["reasons"] == ["rolling", "beyond keep 2"]


# -- copies, decisions, events, drills, summary ---------------------------------------


def test_copies_upsert_and_state(cat: Catalog) -> None:
    cat.record_scan(STORE, recog(found("a", 1)), now=T0)
    cid = cat.get("a", 1).id  # type: ignore[union-attr]
    kw: dict[str, Any] = dict(tier=Tier.ARCHIVE, url="s3://arch/a/1", codec="zstd", manifest_key="m.json")
    cat.add_copy(cid, stored_bytes=90, verified_at=None, now=T0, **kw)
    cat.add_copy(cid, stored_bytes=80, verified_at=T0 + timedelta(hours=1), now=T0 + timedelta(hours=1), **kw)
    rec = cat.get_by_id(cid)
    assert rec is not None
    arch = [c for c in rec.copies if c.tier == Tier.ARCHIVE]
    assert len(arch) == 1 and arch[0].stored_bytes == 80 and arch[0].verified_at == T0 + timedelta(hours=1)
    assert rec.has_verified_archive() and rec.tiers == ("hot", "archive")
    cat.set_copy_state(cid, tier=Tier.ARCHIVE, url="s3://arch/a/1", state="degraded", now=T0)
    assert not cat.get_by_id(cid).has_verified_archive()  # type: ignore[union-attr]
    with pytest.raises(UnknownCheckpoint):
        cat.set_copy_state(cid, tier=Tier.ARCHIVE, url="s3://other", state="missing", now=T0)
    with pytest.raises(ValueError, match="copy state 'gone'"):
        cat.set_copy_state(cid, tier=Tier.ARCHIVE, url="s3://arch/a/1", state="gone", now=T0)


def test_copy_states_are_an_enum_stored_as_the_same_strings(cat: Catalog) -> None:
    """Records carry :class:`CopyState` members; the table keeps the plain strings (no migration)."""
    from sqlalchemy import select

    from ckptier.storage.catalog.tables import copies as cp
    from ckptier.storage.records import CopyState

    assert [s.value for s in CopyState] == ["present", "missing", "deleted", "degraded"]
    cat.record_scan(STORE, recog(found("a", 1)), now=T0)
    cid = cat.get("a", 1).id  # type: ignore[union-attr]
    cat.add_copy(cid, tier=Tier.ARCHIVE, url="s3://arch/a/1", codec="zstd", manifest_key="m.json", stored_bytes=1,
                 verified_at=T0, now=T0)
    cat.set_copy_state(cid, tier=Tier.ARCHIVE, url="s3://arch/a/1", state=CopyState.DEGRADED, now=T0)
    rec = cat.get_by_id(cid)
    assert rec is not None
    assert {c.tier: c.state for c in rec.copies} == {Tier.HOT: CopyState.PRESENT, Tier.ARCHIVE: CopyState.DEGRADED}
    assert all(type(c.state) is CopyState for c in rec.copies)
    with cat._engine.connect() as conn:
        stored = sorted(conn.execute(select(cp.c.state).where(cp.c.checkpoint_id == cid)).scalars())
    assert stored == ["degraded", "present"] and all(type(s) is str for s in stored)
    event = cat.events(kinds=["copy-degraded"])[0]
    assert event.data is not None and event.data["to"] == "degraded" and type(event.data["to"]) is str


def test_decisions_events_drills_and_summary(cat: Catalog) -> None:
    cat.record_scan(STORE, recog(found("a", 1), found("a", 2), found("b", 1, committed=False)), now=T0)
    a1, a2 = (cat.get("a", s).id for s in (1, 2))  # type: ignore[union-attr]
    cat.record_verification(a2, ok_checks(cat, "a", 2), now=T0)
    cat.record_decisions([(a1, "delete", ["rolling"]), (a2, "keep", ["newest verified"])],
                         policy="keep_last=1", now=T0)
    with cat._engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT action, reasons, policy FROM decisions ORDER BY id")).all()
    assert [r[0] for r in rows] == ["delete", "keep"] and rows[1][2] == "keep_last=1"

    cat.log_event("note", "hello", now=T0 + timedelta(seconds=1), job="a", data={"x": 1})
    cat.log_event("note", "orphan job", now=T0 + timedelta(seconds=2), job="z")
    evs = cat.events(kinds=["note"])
    assert [(e.job, e.message) for e in evs] == [("z", "orphan job"), ("a", "hello")]
    assert evs[1].data == {"x": 1} and len(cat.events(limit=1)) == 1

    drill = DrillRecord(job="a", step=2, checkpoint_id=a2, started_at=T0, finished_at=T0 + timedelta(seconds=9),
                        ok=True, device="cpu", source_tier="archive", verdict={"finite": True},
                        timings={"fetch": 1.5, "load": 0.5}, peak_memory_bytes=1 << 20)
    did = cat.record_drill(drill)
    got = cat.drills(job="a")
    assert len(got) == 1 and got[0].id == did
    assert got[0] == DrillRecord(**{**drill.__dict__, "id": did})

    summary = {(r["job"], r["state"]): r for r in cat.summary()}
    assert summary[("a", "committed")]["count"] == 1 and summary[("a", "verified")]["bytes"] == 110
    assert summary[("a", "verified")]["newest_verified_step"] == 2
    assert summary[("b", "incomplete")]["newest_verified_step"] is None
    assert summary[("a", "committed")]["tiers"] == ["hot"]


# -- bad URLs and defaults -----------------------------------------------------------


def _one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert "\n" not in msg
    assert "CKPTIER_CATALOG_URL" in msg
    return msg


def test_bad_catalog_urls_are_one_line_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        Catalog.open("mysql://u:pw@127.0.0.1/db")
    assert "unsupported database 'mysql'" in _one_line(e.value) and "pw" not in str(e.value)

    with pytest.raises(ConfigError) as e:
        Catalog.open("not a url")
    _one_line(e.value)

    port = free_port()
    with pytest.raises(ConfigError) as e:
        Catalog.open(f"postgresql://me:secret@127.0.0.1:{port}/cat")
    msg = _one_line(e.value)
    assert f"127.0.0.1:{port}" in msg and "secret" not in msg and "***" in msg

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ConfigError) as e:
        Catalog.open(f"sqlite:///{blocker}/sub/catalog.db")
    assert str(blocker) in _one_line(e.value)

    with pytest.raises(ConfigError) as e:
        Catalog.open(f"sqlite:///{tmp_path}")
    _one_line(e.value)


@pytest.mark.postgres
def test_wrong_postgres_database_is_a_config_error(pg_server: Any) -> None:
    with pytest.raises(ConfigError) as e:
        Catalog.open(f"postgresql://postgres:pw@127.0.0.1:{pg_server.port}/no_such_db")
    assert "no_such_db" in _one_line(e.value)


def test_network_filesystems_are_detected_from_mounts() -> None:
    mounts = (
        "/dev/vda / ext4 rw 0 0\n"
        "srv:/export /mnt/nfs nfs4 rw 0 0\n"
        "//srv/share /mnt/smb\\040share cifs rw 0 0\n"
        "/dev/vdb /mnt/nfs/local ext4 rw 0 0\n"
    )
    assert filesystem_type("/home/u/cat.db", mounts) == "ext4"
    assert filesystem_type("/mnt/nfs/x/cat.db", mounts) == "nfs4"
    assert filesystem_type("/mnt/nfsother/cat.db", mounts) == "ext4"
    assert filesystem_type("/mnt/smb share/cat.db", mounts) == "cifs"
    assert filesystem_type("/mnt/nfs/local/cat.db", mounts) == "ext4"


def test_sqlite_on_a_network_filesystem_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_read = Path.read_text

    def fake_read(self: Path, *a: Any, **k: Any) -> str:
        if str(self) == "/proc/mounts":
            return f"/dev/vda / ext4 rw 0 0\nsrv:/x {tmp_path} nfs rw 0 0\n"
        return real_read(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", fake_read)
    with pytest.raises(ConfigError, match="nfs network filesystem"):
        make_engine(f"sqlite:///{tmp_path}/cat.db")


def test_sqlite_engine_settings(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path}/c.db")
    try:
        with engine.begin() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30_000
            # Inside a write transaction the write lock is already held (BEGIN IMMEDIATE):
            # a second connection cannot start one.
            import sqlite3

            other = sqlite3.connect(tmp_path / "c.db", timeout=0, isolation_level=None)
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                other.execute("BEGIN IMMEDIATE")
            other.close()
    finally:
        engine.dispose()


def test_default_catalog_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTIER_CATALOG_URL", "postgresql://h/db")
    assert default_catalog_url() == "postgresql://h/db"
    monkeypatch.delenv("CKPTIER_CATALOG_URL")
    monkeypatch.setenv("CKPTIER_HOME", str(tmp_path / "home"))
    assert default_catalog_url() == f"sqlite:///{tmp_path}/home/catalog.db"
    assert not (tmp_path / "home").exists()  # naming the default creates nothing; opening it for writing does
    monkeypatch.delenv("CKPTIER_HOME")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_catalog_url() == f"sqlite:///{tmp_path}/xdg/ckptier/catalog.db"
    assert mask_url("postgresql://u:secret@h/db") == "postgresql://u:***@h/db"
    for scheme in ("postgresql", "postgres", "postgresql+psycopg"):
        engine = make_engine(f"{scheme}://u@127.0.0.1/db")  # no connection yet
        assert engine.url.drivername == "postgresql+psycopg"
        engine.dispose()


def test_catalog_does_not_import_prefect() -> None:
    code = "import sys, ckptier.storage.catalog.api; sys.exit('prefect' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_concurrent_scans_of_the_same_listing_both_succeed(
    catalog_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    listing = recog(*(found("a", s) for s in range(20)), *(found("b", s) for s in range(20)))
    cats = [Catalog.open(catalog_url) for _ in range(2)]
    cats[0].record_scan(STORE, recog(found("a", 0), found("b", 0)), now=T0)  # jobs exist
    errors: list[BaseException] = []
    # Hold each scan inside its first job transaction until the other one gets
    # there too (or 1 s passes, when the catalog serialises them as it should):
    # without per-job serialisation both insert the same checkpoints.
    meet = threading.Barrier(2)
    real = Catalog._ensure_job

    def ensure_then_meet(self: Catalog, *args: Any) -> tuple[int, bool]:
        result = real(self, *args)
        try:
            meet.wait(timeout=1)
        except threading.BrokenBarrierError:
            pass
        return result

    monkeypatch.setattr(Catalog, "_ensure_job", ensure_then_meet)

    def scan(c: Catalog) -> None:
        try:
            c.record_scan(STORE, listing, now=T0)
        except BaseException as exc:  # reported below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=scan, args=(c,)) for c in cats]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert errors == []
        counts = table_counts(cats[0])
        assert (counts["jobs"], counts["checkpoints"], counts["files"], counts["copies"]) == (2, 40, 80, 40)
    finally:
        for c in cats:
            c.close()


def test_head_revision_constant_matches_alembic() -> None:
    """The fast path that skips Alembic on open must know the real head."""
    from ckptier.storage.catalog import db

    assert db._heads() == frozenset({db.HEAD_REVISION})


def test_new_file_rows_leave_out_only_columns_that_are_empty_for_every_file(cat: Catalog) -> None:
    """A first scan writes each checkpoint's files with only the columns some
    file fills; what comes back is exactly what was listed, NULLs included."""
    def ck(step: int, refs: list[tuple[str, float | None, str | None]], hashes: dict[str, str]) -> Found:
        prefix = f"shapes/step-{step:08d}"
        return replace(
            found("shapes", step),
            files=tuple(FileRef(key=f"{prefix}/{rel}", relpath=rel, size=7, mtime=mtime, etag=etag)
                        for rel, mtime, etag in refs),
            expected_sha256=hashes,
        )

    cases = {
        1: ([("a.pt", 1.5, None), ("b.pt", 2.5, None)], {}),  # a local listing: no etags, no hashes
        2: ([("a.pt", 1.5, "e1"), ("b.pt", 2.5, "e2")], {}),  # S3: every etag
        3: ([("a.pt", None, None), ("b.pt", 2.5, "e2")], {"b.pt": "ab" * 32}),  # mixed
        4: ([("a.pt", None, None)], {"a.pt": "cd" * 32}),  # one column of NULLs, one filled
        5: ([("metadata.json", 3.0, "")], {}),  # an empty etag is a value, not NULL
    }
    cat.record_scan(STORE, recog(*(ck(step, refs, hashes) for step, (refs, hashes) in cases.items())), now=T0)
    for step, (refs, hashes) in cases.items():
        rec = cat.get("shapes", step)
        assert rec is not None
        got = [(f.relpath, f.size, f.mtime, f.etag, f.sha256_expected) for f in rec.files]
        assert got == [(rel, 7, mtime, etag, hashes.get(rel)) for rel, mtime, etag in refs], step


def test_new_file_rows_refuse_a_column_that_new_rows_do_not_have(cat: Catalog) -> None:
    with cat._engine.begin() as conn, pytest.raises(ValueError, match=r"\['crc64nvme'\].*use some of checkpoint_id"):
        catalog_scans._insert_files(conn, ("checkpoint_id", "relpath", "size", "crc64nvme"), [(1, "a", 1, "x")])


@pytest.mark.parametrize("per", [1, 3, 500])
def test_new_file_rows_go_many_to_a_statement_and_each_lands_once(
    cat: Catalog, statements: Statements, monkeypatch: pytest.MonkeyPatch, per: int
) -> None:
    monkeypatch.setattr(catalog_scans, "FILE_ROWS_PER_INSERT", per)
    files = {f"rank-{r:04d}/model.pt": 1000 + r for r in range(7)}
    cat.record_scan(STORE, recog(found("many", 1, files=files), found("many", 2, files=files)), now=T0)
    inserts = [s for s in statements.writes() if s.upper().startswith("INSERT INTO FILES")]
    assert len(inserts) == -(-14 // per)  # 14 rows, ``per`` to a statement, the rest in the last
    for step in (1, 2):
        rec = cat.get("many", step)
        assert rec is not None
        assert {f.relpath: f.size for f in rec.files} == files
        assert all(f.mtime == 1_700_000_000.0 and f.etag == f"e{f.size}" for f in rec.files)


def test_new_file_rows_stay_within_the_drivers_parameter_limit(
    cat: Catalog, statements: Statements, monkeypatch: pytest.MonkeyPatch
) -> None:
    with cat._engine.connect() as conn:
        assert catalog_scans._parameter_limit(conn) >= (999 if conn.dialect.name == "sqlite" else 65_535)
    monkeypatch.setattr(catalog_scans, "_parameter_limit", lambda conn: 10)  # two rows of 5 columns at most
    files = {f"f{i}.pt": i + 1 for i in range(5)}
    cat.record_scan(STORE, recog(found("tight", 1, files=files)), now=T0)
    inserts = [s for s in statements.writes() if s.upper().startswith("INSERT INTO FILES")]
    assert [s.count("?") + s.count("%s") for s in inserts] == [10, 10, 5]
    rec = cat.get("tight", 1)
    assert rec is not None and {f.relpath: f.size for f in rec.files} == files
