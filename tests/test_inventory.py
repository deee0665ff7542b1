"""Scanning from an S3 Inventory report (CSV, Parquet, ORC) written into a real
moto_server bucket: the same catalog as a listing, the report's age recorded,
and nothing a live listing must decide (missing, tombstones, delete intents,
deletion itself) ever decided on the strength of a report."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from ckptier.flows.cli import main
from ckptier.storage.base import Store
from ckptier.storage.catalog.api import Catalog
from ckptier.storage.errors import ConfigError, IntegrityError
from ckptier.storage.s3 import S3Store
from ckptier.storage.wrappers import resuming
from ckptier.tasks.apply import live_keys
from ckptier.tasks.config import parse_config
from ckptier.tasks.scan import scan_url

from tests.fixtures.inventory import Row, live_rows, write_report
from tests.fixtures.s3 import S3Bucket

pytestmark = pytest.mark.s3

STEPS = {"job-a": (100, 200, 300), "job-b": (100, 200)}


def put_step(client: Any, bucket: str, job: str, step: int) -> None:
    base = f"runs/{job}/step-{step:08d}"
    for r in range(2):
        client.put_object(Bucket=bucket, Key=f"{base}/rank-{r:04d}/model.pt", Body=b"w" * (r + 2))
    client.put_object(Bucket=bucket, Key=f"{base}/metadata.json", Body=json.dumps({"step": step}).encode())


@pytest.fixture
def source(s3_bucket: S3Bucket) -> Iterator[tuple[S3Bucket, str]]:
    """The source bucket filled under runs/, and an empty inventory bucket."""
    c, b = s3_bucket.client, s3_bucket.name
    for job, steps in STEPS.items():
        for step in steps:
            put_step(c, b, job, step)
    c.put_object(Bucket=b, Key="runs/job-a/notes with space+plus%.txt", Body=b"n")
    c.put_object(Bucket=b, Key="other/outside", Body=b"o")
    inv = f"ckptier-inv-{uuid.uuid4().hex[:12]}"
    c.create_bucket(Bucket=inv)
    yield s3_bucket, inv


def report_rows(client: Any, bucket: str) -> list[Row]:
    """The live objects, plus a delete marker and a noncurrent version (both to be left out)."""
    rows = live_rows(client, bucket)
    t = rows[0].modified
    rows.append(Row("runs/job-a/step-00000400/metadata.json", 0, t, "", is_delete_marker=True))
    rows.append(Row("runs/job-b/step-00000900/metadata.json", 12, t, "abc", is_latest=False))
    return rows


def store(b: S3Bucket) -> Store:
    """The bucket's store as production uses it: wrapped by ``resuming`` (the report's
    bucket is reached through the wrapper's ``in_bucket``)."""
    return resuming(S3Store(b.name, "runs", client=b.client))


def catalog_at(path: Path) -> Catalog:
    return Catalog.open(f"sqlite:///{path}")


def snapshot(cat: Catalog) -> list[tuple[Any, ...]]:
    return [
        (c.job, c.step, c.state.value, c.bytes, c.missing_since,
         sorted((f.relpath, f.size, f.mtime, f.etag, f.status) for f in c.files))
        for c in cat.checkpoints(include_deleted=True)
    ]


@pytest.mark.parametrize("fmt", ["CSV", "Parquet", "ORC"])
def test_an_inventory_scan_catalogs_what_a_listing_does(source: tuple[S3Bucket, str], tmp_path: Path, fmt: str) -> None:
    b, inv = source
    now = datetime.now(UTC)
    created = now - timedelta(hours=3)
    manifest = write_report(b.client, source=b.name, dest=inv, rows=report_rows(b.client, b.name),
                            file_format=fmt, created=created)
    with catalog_at(tmp_path / "listed.db") as listed, catalog_at(tmp_path / "inv.db") as from_inv:
        by_listing = scan_url(f"s3://{b.name}/runs", listed, now=now, store=store(b))
        by_report = scan_url(f"s3://{b.name}/runs", from_inv, now=now, store=store(b), inventory=manifest)
        assert snapshot(from_inv) == snapshot(listed)
        assert len(snapshot(listed)) == 5
        assert (by_report.objects, by_report.checkpoints, by_report.committed) == (
            by_listing.objects, by_listing.checkpoints, by_listing.committed)
        # Keys decoded as S3 encodes them in CSV (spaces, '+', '%', '/'): every object is found.
        assert by_report.objects == by_listing.objects == 16
        assert [u.key for u in by_report.unrecognised] == [u.key for u in by_listing.unrecognised]
        # The report's age is in the scan's report and in the catalog.
        assert by_report.inventory == manifest
        assert by_report.inventory_created_at == created.replace(microsecond=created.microsecond // 1000 * 1000)
        assert by_report.inventory_age_s == pytest.approx(3 * 3600, abs=1)
        (event,) = from_inv.events(kinds=["scan.inventory"])
        assert event.data["inventory"] == manifest and event.data["age_s"] == pytest.approx(3 * 3600, abs=1)
        assert "3.0 h old" in event.message


def test_the_newest_report_of_a_configuration_folder_is_used(source: tuple[S3Bucket, str], tmp_path: Path) -> None:
    b, inv = source
    now = datetime.now(UTC)
    rows = report_rows(b.client, b.name)
    write_report(b.client, source=b.name, dest=inv, rows=rows[:3], created=now - timedelta(days=2))
    newest = write_report(b.client, source=b.name, dest=inv, rows=rows, created=now - timedelta(days=1))
    with catalog_at(tmp_path / "c.db") as cat:
        report = scan_url(f"s3://{b.name}/runs", cat, now=now, store=store(b), inventory=f"s3://{inv}/inv/{b.name}/daily/")
        assert report.inventory == newest and report.checkpoints == 5


def test_a_report_decides_nothing_a_live_listing_must(source: tuple[S3Bucket, str], tmp_path: Path) -> None:
    """Taken at t0, scanned at t2 after the bucket changed: nothing absent from it is marked
    missing, no tombstone is revived, no delete intent is settled, and what the catalog
    learned after t0 stands."""
    b, inv = source
    c = b.client
    t0 = datetime.now(UTC) - timedelta(hours=2)
    with catalog_at(tmp_path / "c.db") as cat:
        scan_url(f"s3://{b.name}/runs", cat, now=t0 - timedelta(hours=1), store=store(b))
        manifest = write_report(c, source=b.name, dest=inv, rows=report_rows(c, b.name), created=t0)
        # After the report: a new save, a file replaced; a listing scan records both at t1.
        put_step(c, b.name, "job-a", 400)
        c.put_object(Bucket=b.name, Key="runs/job-b/step-00000200/rank-0000/model.pt", Body=b"replaced!")
        t1 = t0 + timedelta(hours=1)
        scan_url(f"s3://{b.name}/runs", cat, now=t1, store=store(b))
        by_step = {(r.job, r.step): r for r in cat.checkpoints()}
        # A tombstone (apply deleted job-b step 100's files) and an interrupted delete (job-a step 100).
        gen = cat.claim(by_step["job-b", 100].id, "t", now=t1, ttl=timedelta(minutes=5))
        assert gen is not None and cat.mark_deleted(by_step["job-b", 100].id, owner="t", generation=gen, now=t1,
                                                    reasons=["test"])
        gen = cat.claim(by_step["job-a", 100].id, "t", now=t1, ttl=timedelta(minutes=5))
        assert gen is not None and cat.record_delete_intent(by_step["job-a", 100].id, owner="t", generation=gen,
                                                            scope="checkpoint", files=3, now=t1)
        cat.release(by_step["job-a", 100].id, "t", gen)
        for k in ("rank-0000/model.pt", "rank-0001/model.pt", "metadata.json"):
            c.delete_object(Bucket=b.name, Key=f"runs/job-a/step-00000100/{k}")
        before = snapshot(cat)

        t2 = t1 + timedelta(minutes=5)
        report = scan_url(f"s3://{b.name}/runs", cat, now=t2, store=store(b), inventory=manifest)
        assert report.summary is not None and report.summary.vanished == 0
        assert report.left_as_cataloged == 3  # the tombstone, the replaced file, the one whose files went
        assert snapshot(cat) == before
        assert [i.checkpoint_id for i in cat.delete_intents()] == [by_step["job-a", 100].id]
        # A live listing does settle what the report could not.
        live = scan_url(f"s3://{b.name}/runs", cat, now=t2 + timedelta(minutes=1), store=store(b))
        assert cat.delete_intents() == [] and live.summary is not None


def test_apply_deletes_only_keys_a_live_listing_shows(source: tuple[S3Bucket, str], tmp_path: Path) -> None:
    """A checkpoint cataloged from a report: apply lists its keys live before deleting and
    refuses when the listing shows files the report did not (written after it), or none."""
    b, inv = source
    c = b.client
    manifest = write_report(c, source=b.name, dest=inv, rows=report_rows(c, b.name),
                            created=datetime.now(UTC) - timedelta(hours=1))
    st = store(b)
    with catalog_at(tmp_path / "c.db") as cat:
        scan_url(f"s3://{b.name}/runs", cat, now=datetime.now(UTC), store=st, inventory=manifest)
        (record,) = [r for r in cat.checkpoints(job="job-a") if r.step == 300]
        prefix = "job-a/step-00000300"
        keys = [f"{prefix}/{f.relpath}" for f in record.files]
        assert live_keys(st, prefix, record, keys) == (keys, None)
        c.put_object(Bucket=b.name, Key=f"runs/{prefix}/rank-0002/model.pt", Body=b"late")
        got, why = live_keys(st, prefix, record, keys)
        assert got == [] and why is not None and "not in the catalog" in why and "rank-0002/model.pt" in why
        for k in [*keys, f"{prefix}/rank-0002/model.pt"]:
            c.delete_object(Bucket=b.name, Key=f"runs/{k}")
        got, why = live_keys(st, prefix, record, keys)
        assert got == [] and why is not None and "none of its files is listed" in why


def test_bad_reports_are_one_line_errors(source: tuple[S3Bucket, str], tmp_path: Path) -> None:
    b, inv = source
    c = b.client
    rows = report_rows(c, b.name)
    now = datetime.now(UTC)
    url = f"s3://{b.name}/runs"
    with catalog_at(tmp_path / "c.db") as cat:
        other = write_report(c, source="someone-elses-bucket", dest=inv, rows=rows, created=now, config_id="x")
        with pytest.raises(ConfigError, match="report of bucket 'someone-elses-bucket'"):
            scan_url(url, cat, now=now, store=store(b), inventory=other)
        with pytest.raises(ConfigError, match="does not exist"):
            scan_url(url, cat, now=now, store=store(b), inventory=f"s3://{inv}/nope/manifest.json")
        with pytest.raises(ConfigError, match="no YYYY-MM-DDTHH-MMZ/manifest.json"):
            scan_url(url, cat, now=now, store=store(b), inventory=f"s3://{inv}/nope/")
        c.put_object(Bucket=inv, Key="junk/manifest.json", Body=b"[1, 2]")
        with pytest.raises(ConfigError, match="not a JSON object"):
            scan_url(url, cat, now=now, store=store(b), inventory=f"s3://{inv}/junk/manifest.json")
        with pytest.raises(ConfigError, match="only s3:// URLs"):
            scan_url(str(tmp_path), cat, now=now, inventory=f"s3://{inv}/junk/manifest.json")
        good = write_report(c, source=b.name, dest=inv, rows=rows, created=now, config_id="y")
        key = good.removeprefix(f"s3://{inv}/")
        manifest = json.loads(c.get_object(Bucket=inv, Key=key)["Body"].read())
        c.put_object(Bucket=inv, Key=manifest["files"][0]["key"], Body=b"damaged")
        with pytest.raises(IntegrityError, match="does not match its MD5"):
            scan_url(url, cat, now=now, store=store(b), inventory=good)
        c.put_object(Bucket=inv, Key=key, Body=b"{}")
        with pytest.raises(IntegrityError, match="does not match manifest.checksum"):
            scan_url(url, cat, now=now, store=store(b), inventory=good)
        assert cat.checkpoints() == []


def test_inventory_tables_in_the_config() -> None:
    config = parse_config('[[inventory]]\nurl = "s3://ckpts/runs/"\nreport = "s3://inv/ckpts/daily/"\n')
    assert config.inventories == (("s3://ckpts/runs", "s3://inv/ckpts/daily/"),)
    with pytest.raises(ConfigError, match=r"inventory\[0\]\.url = .*must be an s3:// URL"):
        parse_config('[[inventory]]\nurl = "/data/ckpts"\nreport = "s3://inv/x/"\n')
    with pytest.raises(ConfigError, match=r"inventory\[0\]\.report"):
        parse_config('[[inventory]]\nurl = "s3://ckpts/runs"\n')


def test_the_cli_scans_from_a_report(source: tuple[S3Bucket, str], s3_env: str, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    b, inv = source
    manifest = write_report(b.client, source=b.name, dest=inv, rows=report_rows(b.client, b.name),
                            created=datetime.now(UTC) - timedelta(hours=5))
    monkeypatch.setenv("CKPTIER_CATALOG_URL", f"sqlite:///{tmp_path / 'cli.db'}")
    monkeypatch.setenv("CKPTIER_CONFIG", str(tmp_path / "none.toml"))
    (tmp_path / "none.toml").write_text("")
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    assert main(["scan", f"s3://{b.name}/runs", "--inventory", manifest, "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["checkpoints"] == 5 and report["inventory"]["url"] == manifest
    assert report["inventory"]["age_s"] == pytest.approx(5 * 3600, abs=60)
    assert main(["scan", f"s3://{b.name}/runs", "--inventory", manifest]) == 0
    assert "from the S3 Inventory report" in capsys.readouterr().out
    assert main(["scan", f"s3://{b.name}/runs", "/tmp", "--inventory", manifest]) == 2
    assert "one s3:// URL" in capsys.readouterr().err
