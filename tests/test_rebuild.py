"""A lost catalog rebuilt from storage: the hot tree, the archive's manifests and the catalog backups.

End to end through the command line, on local and S3 (``moto_server``)
archives and on SQLite and PostgreSQL catalogs: a job is scanned, verified,
drilled and tiered (milestones archived, their hot copies deleted, rolling
checkpoints tombstoned); the catalog is then lost and ``ckptier rebuild``
brings it back from storage.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ckptier.flows.cli import main
from ckptier.tasks.demo import train_demo_run

JOB = "demo-run"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def ok(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code, out, err = run(capsys, *argv)
    assert code == 0, f"ckptier {' '.join(argv)} exited {code}: {err or out}"
    return out


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One demo training run (200 steps, a save every 25, the last in flight), shared read-only."""
    hot = tmp_path_factory.mktemp("rebuild-trained") / "hot"
    train_demo_run(hot, steps=200, every=25)
    return hot


@dataclass
class World:
    hot: Path
    archive_url: str
    catalog_url: str
    config: Path
    tmp: Path
    s3: Any = None  # a boto3 client when the archive is on S3
    bucket: str | None = None

    def archive_keys(self) -> dict[str, int]:
        if self.s3 is not None:
            pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix="archive/")
            return {o["Key"][len("archive/"):]: o["Size"] for p in pages for o in p.get("Contents", [])}
        root = Path(self.archive_url.removeprefix("file://"))
        return {p.relative_to(root).as_posix(): p.stat().st_size for p in root.rglob("*") if p.is_file()}

    def read_archive(self, key: str) -> bytes:
        if self.s3 is not None:
            return bytes(self.s3.get_object(Bucket=self.bucket, Key=f"archive/{key}")["Body"].read())
        return (Path(self.archive_url.removeprefix("file://")) / key).read_bytes()

    def write_archive(self, key: str, data: bytes) -> None:
        if self.s3 is not None:
            self.s3.put_object(Bucket=self.bucket, Key=f"archive/{key}", Body=data)
        else:
            (Path(self.archive_url.removeprefix("file://")) / key).write_bytes(data)

    def delete_archive(self, key: str) -> None:
        if self.s3 is not None:
            self.s3.delete_object(Bucket=self.bucket, Key=f"archive/{key}")
        else:
            (Path(self.archive_url.removeprefix("file://")) / key).unlink()


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def world(request: pytest.FixtureRequest, trained: Path, tmp_path: Path, catalog_url: str,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    """A copy of the trained run, an archive (local or S3), a policy that archives the log
    milestones and deletes their hot copies, and an empty catalog (SQLite or PostgreSQL)."""
    hot = tmp_path / "hot"
    shutil.copytree(trained, hot)
    s3 = bucket = None
    if request.param == "s3":
        request.getfixturevalue("s3_env")
        b = request.getfixturevalue("s3_bucket")
        s3, bucket = b.client, b.name
        archive_url = f"s3://{bucket}/archive"
    else:
        archive_url = (tmp_path / "archive").as_uri()
    config = tmp_path / "ckptier.toml"
    config.write_text(f'[[policy]]\njobs = "*"\nkeep_last = 2\nmilestones = "log"\narchive = "{archive_url}"\n')
    for name in ("CKPTIER_CATALOG_URL", "PREFECT_API_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CKPTIER_CONFIG", str(config))
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    yield World(hot=hot, archive_url=archive_url, catalog_url=catalog_url, config=config, tmp=tmp_path, s3=s3,
                bucket=bucket)


def tier_it(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    """Scan, verify, record two drills, apply: milestones 25, 50, 100 archive-only, 75 and 125 tombstones."""
    from ckptier.storage.catalog.api import Catalog, DrillRecord

    ok(capsys, "scan", "--catalog", world.catalog_url, str(world.hot))
    ok(capsys, "verify", "--catalog", world.catalog_url)
    now = datetime.now(UTC)
    with Catalog.open(world.catalog_url) as cat:
        for step, passed in ((150, False), (175, True), (175, True)):
            rec = cat.get(JOB, step)
            assert rec is not None
            cat.record_drill(DrillRecord(job=JOB, step=step, checkpoint_id=rec.id, started_at=now - timedelta(minutes=5),
                                         finished_at=now - timedelta(minutes=4), ok=passed, device="cpu",
                                         source_tier="hot", error=None if passed else "loss diverged"))
            now += timedelta(seconds=1)
    ok(capsys, "apply", "--catalog", world.catalog_url)


def lose_catalog(world: World) -> None:
    """The catalog's disk died: SQLite files removed, the PostgreSQL database dropped and made anew."""
    if world.catalog_url.startswith("sqlite:///"):
        path = Path(world.catalog_url.removeprefix("sqlite:///"))
        for p in path.parent.glob(path.name + "*"):
            p.unlink()
        return
    from sqlalchemy import create_engine, text

    engine = create_engine(world.catalog_url)
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA public CASCADE"))
        conn.execute(text("CREATE SCHEMA public"))
    engine.dispose()


def test_scanning_an_archive_says_what_it_is_and_catalogs_nothing(world: World,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The reproduction: after the catalog is lost, a scan of the archive must not catalog `.ckz`
    files as incomplete guide checkpoints (nor record the archive as a hot location)."""
    tier_it(world, capsys)
    lose_catalog(world)
    ok(capsys, "scan", "--catalog", world.catalog_url, str(world.hot))
    code, out, err = run(capsys, "scan", "--catalog", world.catalog_url, world.archive_url)
    assert code == 2
    line = err.strip()
    assert "\n" not in line and "ckptier archive" in line and "ckptier rebuild" in line, err
    rows = json.loads(ok(capsys, "ls", "--catalog", world.catalog_url, "--json"))
    assert sorted(r["step"] for r in rows) == [150, 175, 200]  # the hot tree only
    assert all(r["location"].startswith(world.hot.as_uri()) for r in rows)


def snapshot(world: World, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """What ls, latest and plan answer, without what a rebuild may rightly change (ids, proof times of copies)."""
    rows = json.loads(ok(capsys, "ls", "--catalog", world.catalog_url, "--all", "--json"))
    for r in rows:
        for c in r["copies"]:
            c.pop("verified_at")
    latest = json.loads(ok(capsys, "latest", "--catalog", world.catalog_url, "--job", JOB, "--json"))
    for c in latest["copies"]:
        c.pop("verified_at")
    plan = json.loads(ok(capsys, "plan", "--catalog", world.catalog_url, "--json"))
    return {"ls": {r["step"]: r for r in rows}, "latest": latest,
            "plan": {p["step"]: (p["action"], p["scope"]) for p in plan}}


def test_rebuild_brings_back_every_checkpoint_copy_tombstone_and_drill(
        world: World, trained: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tier_it(world, capsys)
    before = snapshot(world, capsys)
    assert {s: r["state"] for s, r in before["ls"].items() if r["tiers"] == ["archive"]} == {
        25: "verified", 50: "verified", 100: "verified"}
    assert {s for s, r in before["ls"].items() if r["state"] == "deleted"} == {75, 125}
    lose_catalog(world)

    code, out, err = run(capsys, "rebuild", "--catalog", world.catalog_url, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["backups"] and all(b["used"] for b in report["backups"])
    after = snapshot(world, capsys)
    assert after == before

    # Every archived milestone fetches bit-exactly.
    for step in (25, 50, 100):
        dest = world.tmp / f"fetched-{step}"
        out = ok(capsys, "fetch", "--catalog", world.catalog_url, "--job", JOB, "--step", str(step), str(dest), "--json")
        assert json.loads(out)["tier"] == "archive"
        original = trained / JOB / f"step-{step:08d}"
        got = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
        assert got == sorted(p.relative_to(original).as_posix() for p in original.rglob("*") if p.is_file())
        for rel in got:
            assert (dest / rel).read_bytes() == (original / rel).read_bytes()

    # A following apply deletes nothing the old catalog kept.
    hot_before = sorted(p.name for p in (world.hot / JOB).iterdir())
    ok(capsys, "apply", "--catalog", world.catalog_url)
    assert sorted(p.name for p in (world.hot / JOB).iterdir()) == hot_before
    assert snapshot(world, capsys)["plan"] == before["plan"]

    # Rebuild again: idempotent, nothing changes.
    again = json.loads(ok(capsys, "rebuild", "--catalog", world.catalog_url, "--json"))
    assert again["changed"] == 0
    assert snapshot(world, capsys) == before
