"""Catalog backups: the object format (versioned, checksummed, canonical) and their life in the
archive tier (written when a job changed, read back before older ones go, a corrupt one passed over
for the one before it; the janitor never touches them)."""

from __future__ import annotations

import gzip
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from ckptier.storage.catalog.api import Catalog, DrillRecord, RecoveryRecord
from ckptier.storage.catalog.restore import export_job, import_job
from ckptier.storage.catalog_backup import BackupCorrupt, decode_backup, decode_header, encode_backup
from ckptier.storage.local import LocalStore
from ckptier.storage.records import FileRef, Format, Found, Recognition
from ckptier.tasks.archive import janitor
from ckptier.tasks.backup import GENERATIONS, backup_catalog, backup_job, by_job_dir, job_prefix, newest_good

T0 = datetime(2026, 11, 30, 12, tzinfo=UTC)


def body() -> dict[str, object]:
    return {"job": {"name": "llm", "hot_url": "file:///h/llm", "created_at": T0.isoformat()},
            "checkpoints": {"columns": ["step"], "rows": [[1], [2]]}, "note": "ünïcode"}


def test_a_backup_is_one_header_line_then_a_checksummed_gzip_body() -> None:
    data = encode_backup("llm", T0, body())
    head = json.loads(data.split(b"\n", 1)[0])
    assert head["ckptier_catalog_backup"] == 1 and head["job"] == "llm" and head["counts"] == {"checkpoints": 2}
    assert json.loads(gzip.decompress(data.split(b"\n", 1)[1])) == body()
    header, got = decode_backup(data, where="x")
    assert got == body() and header.created_at == T0 and header.bytes == len(data.split(b"\n", 1)[1])
    # Canonical: the same rows give the same bytes, whenever taken (the header's time aside).
    assert decode_header(encode_backup("llm", T0 + timedelta(days=1), body()), where="x").sha256 == header.sha256


def _flip(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0x20
    return bytes(b)


@pytest.mark.parametrize(("case", "damage", "needle"), [
    ("a flipped body byte", lambda d: _flip(d, len(d) - 10), "does not match its sha256"),
    ("truncated", lambda d: d[:-5], "truncated or extended"),
    ("extended", lambda d: d + b"\0", "truncated or extended"),
    ("no header", lambda d: d.split(b"\n", 1)[1][:50], "not a ckptier catalog backup"),
    ("another version", lambda d: d.replace(b'"ckptier_catalog_backup": 1', b'"ckptier_catalog_backup": 9'),
     "version 9"),
    ("a flipped header byte", lambda d: d.replace(b'"job": "llm"', b'"job": 5'), "malformed"),
    ("empty", lambda d: b"", "no header line"),
])
def test_a_damaged_backup_is_named_and_never_used(case: str, damage, needle: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(BackupCorrupt, match=needle) as err:
        decode_backup(damage(encode_backup("llm", T0, body())), where="s3://cold/.ckptier/catalog/x/y.ckb")
    assert "s3://cold/.ckptier/catalog/x/y.ckb" in str(err.value) and "\n" not in str(err.value)


def _catalog(tmp_path: Path, catalog_url: str) -> Catalog:
    cat = Catalog.open(catalog_url)
    files = (FileRef("llm/step-00000010/metadata.json", "metadata.json", 5, 1.0),
             FileRef("llm/step-00000010/model.pt", "model.pt", 50, 1.0))
    rec = Recognition((Found("llm", 10, Format.GUIDE, "llm/step-00000010", files, True, "metadata.json"),), (), 2)
    cat.record_scan((tmp_path / "hot").as_uri(), rec, now=T0)
    return cat


def test_export_and_import_carry_every_row_a_job_has(tmp_path: Path, catalog_url: str) -> None:
    with _catalog(tmp_path, catalog_url) as cat:
        r = cat.get("llm", 10)
        assert r is not None
        cat.record_drill(DrillRecord("llm", 10, r.id, T0, T0 + timedelta(minutes=1), False, "cpu", "hot",
                                     verdict={"summary": "loss diverged"}, timings={"fetch_s": 1.5}, error="boom"))
        cat.log_event("note", "hello", now=T0, checkpoint_id=r.id, data={"x": [1, 2]})
        exported = export_job(cat, "llm")
        assert exported is not None
        assert export_job(cat, "nope") is None
    other = tmp_path / "other.db"
    with Catalog.open(f"sqlite:///{other}") as fresh:
        restored = import_job(fresh, exported)
        assert (restored.checkpoints, restored.files, restored.copies, restored.drills) == (1, 2, 1, 1)
        assert import_job(fresh, exported).already  # never twice
        again = export_job(fresh, "llm")
        got = fresh.get("llm", 10)
    assert again is not None and got is not None
    assert {k: v for k, v in again.items() if k != "scanned"} == {k: v for k, v in exported.items() if k != "scanned"}
    assert got.last_drill is not None and got.last_drill.detail == "boom"


def test_a_backup_is_written_when_the_job_changed_and_older_ones_go(tmp_path: Path, catalog_url: str) -> None:
    store = LocalStore(tmp_path / "archive")
    with _catalog(tmp_path, catalog_url) as cat:
        first = backup_job(cat, "llm", store, now=T0)
        assert first.written and first.url.endswith(".ckb") and first.header.counts["checkpoints"] == 1
        again = backup_job(cat, "llm", store, now=T0 + timedelta(seconds=1))
        assert not again.written and again.url == first.url  # nothing changed: nothing written
        for i in range(GENERATIONS + 2):
            cat.log_event("note", f"change {i}", now=T0, job="llm")
            backup_job(cat, "llm", store, now=T0 + timedelta(minutes=i + 1))
    keys = by_job_dir(i.key for i in store.list(".ckptier/"))[job_prefix("llm")]
    assert len(keys) == GENERATIONS and first.url.rsplit("/", 1)[-1] not in {k.rsplit("/", 1)[-1] for k in keys}


def test_a_corrupt_newest_backup_is_passed_over_for_the_one_before(tmp_path: Path, catalog_url: str) -> None:
    store = LocalStore(tmp_path / "archive")
    with _catalog(tmp_path, catalog_url) as cat:
        old = backup_job(cat, "llm", store, now=T0)
        cat.log_event("note", "later", now=T0, job="llm")
        new = backup_job(cat, "llm", store, now=T0 + timedelta(hours=1))
        path = tmp_path / "archive" / new.url.split("/archive/", 1)[1]
        path.write_bytes(_flip(path.read_bytes(), path.stat().st_size - 3))
        keys = by_job_dir(i.key for i in store.list(""))[job_prefix("llm")]
        good, skipped = newest_good(store, keys)
        assert good is not None and good.url == old.url
        assert [u for u, _ in skipped] == [new.url] and "sha256" in skipped[0][1]
        # The next backup replaces the corrupt one rather than trusting it.
        fresh = backup_job(cat, "llm", store, now=T0 + timedelta(hours=2))
        assert fresh.written and fresh.replaced_corrupt == (new.url,) and not path.exists()


def test_jobs_without_an_archive_are_said_and_a_failing_one_does_not_stop_the_others(tmp_path: Path) -> None:
    with _catalog(tmp_path, f"sqlite:///{tmp_path / 'c.db'}") as cat:
        cat.log_event("note", "x", now=T0, job="other")
        report = backup_catalog(cat, lambda job: LocalStore(tmp_path / "a") if job == "llm" else None, now=T0)
        assert [b.job for b in report.backups] == ["llm"] and report.no_archive == ("other",) and report.ok
        (tmp_path / "file.txt").write_text("not a directory")
        report = backup_catalog(cat, lambda job: LocalStore(tmp_path / "file.txt"), now=T0, jobs=["llm"])
    assert not report.ok and report.failed[0][0] == "llm"
    assert any("FAILED" in line for line in report.lines())


def test_the_janitor_never_touches_catalog_backups(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "archive")
    with _catalog(tmp_path, f"sqlite:///{tmp_path / 'c.db'}") as cat:
        written = backup_job(cat, "llm", store, now=T0)
    rep = janitor(store, now=T0 + timedelta(days=30), older_than=timedelta(hours=1))
    assert rep.not_ours == [] and rep.removed_keys == []
    assert (tmp_path / "archive" / written.url.split("/archive/", 1)[1]).exists()


def test_a_backup_from_before_a_column_existed_restores_and_one_from_a_newer_ckptier_is_refused(
        tmp_path: Path) -> None:
    with _catalog(tmp_path, f"sqlite:///{tmp_path / 'c.db'}") as cat:
        exported = export_job(cat, "llm")
    assert exported is not None
    old = json.loads(json.dumps(exported))
    table = old["checkpoints"]
    i = table["columns"].index("metrics")  # a column added after backups were first written
    table["columns"].pop(i)
    for row in table["rows"]:
        row.pop(i)
    with Catalog.open(f"sqlite:///{tmp_path / 'old.db'}") as fresh:
        assert import_job(fresh, old).checkpoints == 1
        got = fresh.get("llm", 10)
        assert got is not None and not got.metrics
    newer = json.loads(json.dumps(exported))
    newer["files"]["columns"].append("from_the_future")
    for row in newer["files"]["rows"]:
        row.append(1)
    with Catalog.open(f"sqlite:///{tmp_path / 'new.db'}") as fresh, pytest.raises(ValueError, match="newer"):
        import_job(fresh, newer)


def _recoveries(cat: Catalog, job: str) -> list[tuple[object, ...]]:
    return [(r.started_at, r.seconds, r.outcome, r.verify, r.step, r.source, r.path, r.passed_over, r.error,
             r.checkpoint_id is not None) for r in cat.recoveries(job=job)]


def test_recovery_events_are_backed_up_and_restored(tmp_path: Path, catalog_url: str) -> None:
    store = LocalStore(tmp_path / "archive")
    with _catalog(tmp_path, catalog_url) as cat:
        r = cat.get("llm", 10)
        assert r is not None
        first = backup_job(cat, "llm", store, now=T0)
        cat.record_recovery(RecoveryRecord("llm", T0 + timedelta(minutes=1), 0.25, "resumed", "full", step=10,
                                           checkpoint_id=r.id, source="hot", path="/h/llm/step-00000010",
                                           passed_over=((12, "model.pt: size 3, the catalog has 50"),)))
        cat.record_recovery(RecoveryRecord("llm", T0 + timedelta(minutes=2), 0.5, "failed", "quick",
                                           error="no checkpoint of llm can be proven"))
        cat.record_recovery(RecoveryRecord("other", T0, 0.1, "failed", "full", error="unknown job"))
        second = backup_job(cat, "llm", store, now=T0 + timedelta(minutes=3))
        assert second.written and second.header.counts["recoveries"] == 2  # a new recovery is a change
        before = _recoveries(cat, "llm")
    assert len(before) == 2
    body = decode_backup((tmp_path / "archive" / second.url.split("/archive/", 1)[1]).read_bytes(), where="x")[1]
    with Catalog.open(f"sqlite:///{tmp_path / 'restored.db'}") as fresh:
        restored = import_job(fresh, body)
        assert restored.recoveries == 2
        assert _recoveries(fresh, "llm") == before  # the resumed one linked to its checkpoint again
        assert fresh.recoveries(job="other") == []
    assert first.written


def test_a_backup_from_before_recoveries_were_kept_restores_with_none(tmp_path: Path) -> None:
    with _catalog(tmp_path, f"sqlite:///{tmp_path / 'c.db'}") as cat:
        cat.record_recovery(RecoveryRecord("llm", T0, 0.1, "failed", "full", error="x"))
        exported = export_job(cat, "llm")
    assert exported is not None and len(exported["recoveries"]["rows"]) == 1
    old = {k: v for k, v in exported.items() if k != "recoveries"}
    with Catalog.open(f"sqlite:///{tmp_path / 'old.db'}") as fresh:
        restored = import_job(fresh, old)
        assert restored.checkpoints == 1 and restored.recoveries == 0 and fresh.recoveries() == []
