"""S3 storage classes of the archive tier, against the real ``moto_server``.

``storage_class`` is sent on every archive write (single PutObject and
multipart), confirmed by HEAD in the promotion's read-back, recorded per copy
and shown by ``ls --json``; a copy in a class that must be restored first
(GLACIER, DEEP_ARCHIVE) is archived without a GET (local decode + the store's
checksum), deep-verified by HEAD, and ``fetch`` asks for its restore and says
when to try again.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from ckptier.flows.cli import main
from ckptier.storage.base import Restorable, StorageClasses
from ckptier.storage.catalog.api import Catalog
from ckptier.storage.errors import ConfigError, IntegrityError, NeedsRestore
from ckptier.storage.records import Tier
from ckptier.storage.s3 import S3Store
from ckptier.tasks.archive import manifest_key, promote
from ckptier.tasks.pipeline import VerifyOptions, run_scan, run_verify
from ckptier.tasks.run import Run, StoreCache
from tests.fixtures.s3 import S3Server, make_client

NOW = datetime(2026, 11, 30, 12, tzinfo=UTC)


def head(bucket: Any, key: str) -> dict[str, Any]:
    return dict(bucket.client.head_object(Bucket=bucket.name, Key=key, ChecksumMode="ENABLED"))


def store(bucket: Any, prefix: str = "arch", **kw: Any) -> S3Store:
    return S3Store(bucket.name, prefix, client=kw.pop("client", bucket.client), **kw)


# ------------------------------------------------------------------ the store


def test_storage_class_is_sent_on_single_and_multipart_writes(s3_bucket: Any) -> None:
    s = store(s3_bucket, multipart_threshold=1 << 20, part_size=5 << 20, storage_class="GLACIER_IR")
    # (a class every test server offers: AWS's names, configured on the test RGW as placement classes)
    assert isinstance(s, StorageClasses) and isinstance(s, Restorable)
    s.write("small", b"x" * 100)
    s.write("big", io.BytesIO(os.urandom((5 << 20) + 1234)))  # over the threshold: multipart
    assert head(s3_bucket, "arch/small")["StorageClass"] == "GLACIER_IR"
    assert head(s3_bucket, "arch/big")["StorageClass"] == "GLACIER_IR"
    assert s.stat("big").storage_class == "GLACIER_IR"
    assert {i.key: i.storage_class for i in s.list("")} == {"small": "GLACIER_IR", "big": "GLACIER_IR"}
    # the same store in the default class; S3 leaves the header out for STANDARD, stat says it
    default = s.in_class(None)
    assert default.client is s.client and default.url == s.url and s.storage_class == "GLACIER_IR"
    default.write("marker", b"{}")
    assert "StorageClass" not in head(s3_bucket, "arch/marker")
    assert s.stat("marker").storage_class == "STANDARD"
    with pytest.raises(ConfigError, match="did you mean 'DEEP_ARCHIVE'"):
        s.in_class("deep-archive")


@pytest.mark.s3_needs("restore")
def test_reading_an_archived_object_needs_a_restore(s3_bucket: Any) -> None:
    s = store(s3_bucket, storage_class="GLACIER")
    s.write("cold", b"frozen bytes")
    with pytest.raises(NeedsRestore, match="stored in GLACIER and not restored") as e:
        s.open_read("cold").read()
    assert e.value.storage_class == "GLACIER" and e.value.key == "cold"
    assert s.restore("cold", days=1) == "requested"
    with s.open_read("cold") as fh:  # moto restores at once; S3 takes hours
        assert fh.read() == b"frozen bytes"
    assert s.restore("cold") == "ready"
    s.in_class(None).write("warm", b"x")
    assert s.restore("warm") == "ready"  # nothing to restore


# ------------------------------------------------------------------ promote


def write_step(root: Path, job: str, step: int, size: int = 4096) -> None:
    d = root / job / f"step-{step:08d}"
    (d / "rank-0000").mkdir(parents=True)
    (d / "rank-0000" / "model.pt").write_bytes(os.urandom(size))
    (d / "rank-0000" / "optimizer.pt").write_bytes(bytes(size))
    (d / "metadata.json").write_text(json.dumps({"step": step}))


@pytest.fixture
def catalog(tmp_path: Path) -> Iterator[Catalog]:
    with Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
        yield cat


@pytest.fixture
def hot(tmp_path: Path, catalog: Catalog) -> Path:
    root = tmp_path / "hot"
    for step in (100, 200, 300):
        write_step(root, "run", step)
    run_scan(Run.of(catalog), [str(root)])
    run_verify(Run.of(catalog))
    return root


def _promote(catalog: Catalog, archive: Any, step: int = 100) -> Any:
    record = catalog.get("run", step)
    assert record is not None
    hot, prefix = StoreCache().for_record(record)
    return promote(hot, prefix, record, archive, now=NOW, owner="test")


@pytest.mark.parametrize("cls", ["STANDARD_IA", "GLACIER_IR",
                                 pytest.param("GLACIER", marks=pytest.mark.s3_needs("restore")),
                                 pytest.param("DEEP_ARCHIVE", marks=pytest.mark.s3_needs("restore"))])
def test_promote_confirms_the_class_and_keeps_the_manifest_readable(
    s3_bucket: Any, s3_server: S3Server, hot: Path, catalog: Catalog, cls: str
) -> None:
    copy = _promote(catalog, store(s3_bucket, storage_class=cls))
    assert copy.storage_class == cls and not copy.already_archived
    data = [o["Key"] for o in s3_bucket.client.list_objects_v2(Bucket=s3_bucket.name)["Contents"]]
    assert sorted(data) == ["arch/run/step-00000100/.ckptier/upload.json",
                            "arch/run/step-00000100/ckptier-manifest.json",
                            "arch/run/step-00000100/metadata.json.ckz",
                            "arch/run/step-00000100/rank-0000/model.pt.ckz",
                            "arch/run/step-00000100/rank-0000/optimizer.pt.ckz"]
    for key in data:
        h = head(s3_bucket, key)
        bookkeeping = key.endswith(("manifest.json", "upload.json"))  # readable without a restore
        assert h.get("StorageClass", "STANDARD") == ("STANDARD" if bookkeeping else cls)
    # the manifest (readable without a restore) records the stored bytes' CRC64NVME, as the store does
    manifest = json.loads(s3_bucket.client.get_object(Bucket=s3_bucket.name, Key="arch/" + manifest_key("run", 100))["Body"].read())
    for f in manifest["files"]:
        stored = head(s3_bucket, f"arch/run/step-00000100/{f['stored']['key']}").get("ChecksumCRC64NVME")
        # where the server keeps no checksum (RGW), the manifest's value is ckptier's own, proven by a read
        assert stored == (f["stored"]["crc64nvme"] if s3_server.capabilities.stored_checksums else None)
    # idempotent: a second promotion finds the committed copy and its class
    again = _promote(catalog, store(s3_bucket, storage_class=cls))
    assert again.already_archived and again.storage_class == cls


def _strip_storage_class(params: dict[str, Any], **_: Any) -> None:
    params.pop("StorageClass", None)


def test_a_store_that_ignores_the_class_commits_nothing(s3_bucket: Any, hot: Path, catalog: Catalog) -> None:
    client = make_client(s3_bucket.endpoint)
    client.meta.events.register("provide-client-params.s3.PutObject", _strip_storage_class)
    with pytest.raises(IntegrityError, match="stored in STANDARD, not GLACIER_IR as configured"):
        _promote(catalog, store(s3_bucket, client=client, storage_class="GLACIER_IR"))
    listed = s3_bucket.client.list_objects_v2(Bucket=s3_bucket.name).get("Contents", [])
    assert not [o for o in listed if o["Key"].endswith("ckptier-manifest.json")]


@pytest.mark.s3_needs("restore")
def test_glacier_without_the_stores_checksum_cannot_be_proven(
    s3_bucket: Any, hot: Path, catalog: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTIER_S3_CHECKSUMS", "when_required")
    with pytest.raises(IntegrityError, match="reports no full-object CRC64NVME"):
        _promote(catalog, store(s3_bucket, storage_class="GLACIER"))


# ------------------------------------------------------------------ end to end


@pytest.mark.s3_needs("restore")
def test_apply_ls_verify_and_fetch_with_a_glacier_archive(
    s3_bucket: Any, s3_env: str, hot: Path, catalog: Catalog, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "ckptier.toml"
    config.write_text(
        f'[[policy]]\nkeep_last = 1\nmilestones = [100]\n'
        f'archive = "s3://{s3_bucket.name}/arch"\nstorage_class = "GLACIER"\n'
    )
    base = ["--catalog", f"sqlite:///{tmp_path / 'catalog.db'}", "--config", str(config)]
    assert main(["apply", "--no-prefect", *base]) == 0, capsys.readouterr()
    capsys.readouterr()
    assert not (hot / "run" / "step-00000100").exists()  # milestone: archive only now

    assert main(["ls", *base, "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    (arch,) = [c for c in rows[100]["copies"] if c["tier"] == "archive"]
    assert arch["storage_class"] == "GLACIER" and arch["state"] == "present"
    assert rows[100]["tiers"] == ["archive"]
    assert all(c["storage_class"] is None for c in rows[300]["copies"])  # a hot copy on local disk
    record = catalog.get("run", 100)
    assert record is not None and record.archive_copy() is not None
    assert record.archive_copy().storage_class == "GLACIER"  # type: ignore[union-attr]

    # the nightly deep read cannot GET it: HEAD against the manifest, never "degraded"
    report = run_verify(Run.of(catalog, stores=StoreCache()), VerifyOptions(deep=True))
    (row,) = [r for r in report.checkpoints if r.tier == "archive"]
    assert row.state == "verified" and report.totals.archive_degraded == 0

    dest = tmp_path / "restored"
    code = main(["fetch", *base, "--job", "run", "--step", "100", str(dest)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "the archive copy is in GLACIER, which must be restored before it can be read" in err
    assert "restore requested for 3 of 3 objects (Standard retrieval, readable for 1 day)" in err
    assert "run 'ckptier fetch --job run --step 100' again in about 5 hours" in err
    key = "arch/run/step-00000100/rank-0000/model.pt.ckz"
    assert 'ongoing-request="false"' in head(s3_bucket, key)["Restore"]  # moto restores at once
    # try again: restored, so the fetch decodes and verifies every file
    assert main(["fetch", *base, "--job", "run", "--step", "100", str(dest), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tier"] == "archive"
    assert (dest / "rank-0000" / "optimizer.pt").read_bytes() == bytes(4096)


def test_catalog_at_0001_upgrades_and_keeps_its_copies(catalog_url: str) -> None:
    """The storage_class column arrives by migration 0004; copies written before read back with none."""
    from alembic import command

    from ckptier.storage.catalog import db

    engine = db.make_engine(catalog_url)
    with engine.begin() as conn:
        cfg = db.alembic_config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0001")
        job = conn.exec_driver_sql("INSERT INTO jobs (name, hot_url, created_at) VALUES ('old', NULL, '2026-01-01') RETURNING id").scalar()
        cid = conn.exec_driver_sql(
            "INSERT INTO checkpoints (job_id, step, format, location, state, bytes, file_count, first_seen, last_seen, generation) "
            f"VALUES ({job}, 7, 'guide', 'file:///h/old/step-00000007', 'verified', 1, 0, '2026-01-01', '2026-01-01', 0) RETURNING id"
        ).scalar()
        conn.exec_driver_sql(
            "INSERT INTO copies (checkpoint_id, tier, url, state, stored_bytes, created_at) "
            f"VALUES ({cid}, 'archive', 's3://cold/old/step-00000007', 'present', 1, '2026-01-01')"
        )
    engine.dispose()
    with Catalog.open(catalog_url) as cat:
        record = cat.get("old", 7)
        assert record is not None and [(c.tier, c.storage_class) for c in record.copies] == [(Tier.ARCHIVE, None)]
        cat.add_copy(record.id, tier=Tier.ARCHIVE, url="s3://cold/old/step-00000007", stored_bytes=1, codec="ckz1",
                     manifest_key=None, verified_at=NOW, now=NOW, storage_class="GLACIER_IR")
        assert cat.get("old", 7).archive_copy().storage_class == "GLACIER_IR"  # type: ignore[union-attr]
