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


def backup_keys(world: World) -> list[str]:
    return sorted(k for k in world.archive_keys() if k.startswith(".ckptier/catalog/"))


def test_without_a_backup_the_archive_and_the_hot_tree_still_bring_every_checkpoint_back(
        world: World, trained: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tier_it(world, capsys)
    before = snapshot(world, capsys)
    for key in backup_keys(world):
        world.delete_archive(key)
    lose_catalog(world)

    code, out, err = run(capsys, "rebuild", "--catalog", world.catalog_url, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["backups"] == [] and report["hot"][0]["origin"] == "manifest"
    (archive,) = report["archives"]
    assert (archive["copies"], archive["present"], archive["new"]) == (3, 3, 3)
    assert any("no catalog backup" in line and "tombstones" in line for line in report["not_recovered"])
    rows = {r["step"]: r for r in json.loads(ok(capsys, "ls", "--catalog", world.catalog_url, "--all", "--json"))}
    # Archived milestones: verified, their only copy proven now; the hot ones wait for verify.
    assert {s: (r["state"], r["tiers"]) for s, r in rows.items()} == {
        25: ("verified", ["archive"]), 50: ("verified", ["archive"]), 100: ("verified", ["archive"]),
        150: ("committed", ["hot"]), 175: ("committed", ["hot"]), 200: ("incomplete", ["hot"])}
    for s in (25, 50, 100):
        assert rows[s]["hot_location"] == before["ls"][s]["hot_location"]
        assert rows[s]["bytes"] == before["ls"][s]["bytes"] and rows[s]["files"] == before["ls"][s]["files"]
        (copy,) = [c for c in rows[s]["copies"] if c["tier"] == "archive"]
        assert copy["state"] == "present" and copy["verified_at"] is not None
    ok(capsys, "verify", "--catalog", world.catalog_url)
    after = snapshot(world, capsys)
    assert after["latest"]["step"] == before["latest"]["step"] == 175
    assert after["plan"] == {s: p for s, p in before["plan"].items() if s not in (75, 125)}
    hot_before = sorted(p.name for p in (world.hot / JOB).iterdir())
    ok(capsys, "apply", "--catalog", world.catalog_url)
    assert sorted(p.name for p in (world.hot / JOB).iterdir()) == hot_before  # nothing the old catalog kept
    assert backup_keys(world)  # and the catalog is backed up again
    for step in (25, 100):
        dest = world.tmp / f"fetched-{step}"
        ok(capsys, "fetch", "--catalog", world.catalog_url, "--job", JOB, "--step", str(step), str(dest))
        original = trained / JOB / f"step-{step:08d}"
        for p in original.rglob("*"):
            if p.is_file():
                assert (dest / p.relative_to(original)).read_bytes() == p.read_bytes()


def test_a_corrupt_newest_backup_is_detected_and_the_one_before_restored(
        world: World, capsys: pytest.CaptureFixture[str]) -> None:
    from ckptier.storage.catalog.api import Catalog

    tier_it(world, capsys)
    before = snapshot(world, capsys)
    (first,) = backup_keys(world)
    with Catalog.open(world.catalog_url) as cat:
        cat.log_event("note", "a change after the apply's backup", now=datetime.now(UTC), job=JOB)
    out = ok(capsys, "catalog", "backup", "--catalog", world.catalog_url, "--json")
    assert [b["written"] for b in json.loads(out)["backups"]] == [True]
    newest = [k for k in backup_keys(world) if k != first][0]
    data = bytearray(world.read_archive(newest))
    data[-20] ^= 0x01
    world.write_archive(newest, bytes(data))
    lose_catalog(world)

    code, out, err = run(capsys, "rebuild", "--catalog", world.catalog_url, "--json")
    assert code == 0, err
    (used,) = json.loads(out)["backups"]
    assert used["url"].endswith(first) and [s["url"].rsplit("/", 1)[-1] for s in used["skipped"]] == [
        newest.rsplit("/", 1)[-1]]
    assert "sha256" in used["skipped"][0]["detail"]
    assert snapshot(world, capsys) == before


@pytest.mark.parametrize("damage", ["manifest", "missing-object", "flipped-object"])
def test_a_corrupt_manifest_or_a_missing_archive_object_never_yields_a_present_copy(
        world: World, damage: str, capsys: pytest.CaptureFixture[str]) -> None:
    tier_it(world, capsys)
    adir = f"{JOB}/step-00000050"
    if damage == "manifest":
        key = f"{adir}/ckptier-manifest.json"
        world.write_archive(key, world.read_archive(key)[:-40])  # torn
    elif damage == "missing-object":
        world.delete_archive(f"{adir}/rank-0000/model.pt.ckz")
    else:
        key = f"{adir}/rank-0000/model.pt.ckz"
        data = bytearray(world.read_archive(key))
        data[len(data) // 2] ^= 0x40
        world.write_archive(key, bytes(data))
    keys = backup_keys(world)
    for with_backup in (True, False):
        lose_catalog(world)
        if not with_backup:
            for key in keys:
                world.delete_archive(key)
        code, out, _ = run(capsys, "rebuild", "--catalog", world.catalog_url, "--json")
        report = json.loads(out)
        assert code == 1 and report["problems"] and not report["ok"]
        assert any("step 50" in p for p in report["problems"])
        rows = {r["step"]: r for r in json.loads(ok(capsys, "ls", "--catalog", world.catalog_url, "--all", "--json"))}
        for step in (25, 100):
            assert [c["state"] for c in rows[step]["copies"] if c["tier"] == "archive"] == ["present"]
        fifty = rows.get(50)
        if fifty is None:  # only a manifest that does not read back, and no backup: nothing of it is trusted
            assert damage == "manifest" and not with_backup
            assert any("step 50" in n and "cannot be read back" in n for n in report["not_recovered"])
            continue
        assert "present" not in [c["state"] for c in fifty["copies"]]
        if not with_backup:
            assert fifty["state"] == "corrupt" and "only copy" in fifty["reason"]
        code, _, err = run(capsys, "fetch", "--catalog", world.catalog_url, "--job", JOB, "--step", "50",
                           str(world.tmp / f"out-{with_backup}"))
        assert code == 2 and not (world.tmp / f"out-{with_backup}").exists()
        code, out, _ = run(capsys, "latest", "--catalog", world.catalog_url, "--job", JOB, "--json")
        assert json.loads(out)["step"] == (175 if with_backup else 100)  # never 50; without a backup, none hot is verified


def test_rebuild_refuses_a_catalog_it_did_not_fill_and_an_archive_given_as_hot(
        world: World, capsys: pytest.CaptureFixture[str]) -> None:
    tier_it(world, capsys)
    code, _, err = run(capsys, "rebuild", "--catalog", world.catalog_url)
    assert code == 2 and "already holds" in err and "empty catalog" in err and "\n" not in err.strip()
    lose_catalog(world)
    code, _, err = run(capsys, "rebuild", "--catalog", world.catalog_url, world.archive_url + "/demo-run")
    assert code == 2 and "never scanned as hot" in err


def test_rebuild_brings_back_the_recovery_events(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    """Resumes recorded after the last apply reach the archive with ``catalog backup`` and come
    back with the rebuild: the recovery rate survives losing the catalog."""
    from ckptier.storage.catalog.api import Catalog

    tier_it(world, capsys)
    steps = [json.loads(ok(capsys, "resume", "--catalog", world.catalog_url, "--job", JOB, "--json",
                           *([verify] if verify else [])))["step"] for verify in ("--quick", None)]
    ok(capsys, "catalog", "backup", "--catalog", world.catalog_url)

    def recoveries() -> list[tuple[Any, ...]]:
        with Catalog.open(world.catalog_url) as cat:
            return [(r.started_at, r.outcome, r.verify, r.step, r.source, r.path, r.passed_over,
                     r.checkpoint_id is not None) for r in cat.recoveries(job=JOB)]

    before = recoveries()
    assert [r[1:4] for r in before] == [("resumed", "full", steps[1]), ("resumed", "quick", steps[0])]
    lose_catalog(world)
    ok(capsys, "rebuild", "--catalog", world.catalog_url, "--json")
    assert recoveries() == before
    stats = json.loads(ok(capsys, "resume", "--catalog", world.catalog_url, "--job", JOB, "--stats", "--json"))
    assert [(r["days"], r["attempted"], r["resumed"]) for r in stats] == [(7, 2, 2), (30, 2, 2), (None, 2, 2)]
