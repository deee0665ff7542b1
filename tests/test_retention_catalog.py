"""Retention over a real catalog: plan warnings on the command line, the drill floor
read from the catalog's drill records, and forgetting rows a trainer rotated away.

Checkpoints are small guide-layout directories on local disk (and objects on
the S3 test server), scanned and verified by the real pipeline; the catalog
is SQLite and PostgreSQL (``catalog_url``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ckptier.flows.cli import main
from ckptier.storage.catalog.api import Catalog, DrillRecord
from ckptier.storage.records import State
from ckptier.tasks.config import parse_config
from ckptier.tasks.pipeline import make_plan, run_scan, run_verify
from ckptier.tasks.run import Run, utcnow


def write_step(root: Path, job: str, step: int, size: int = 256) -> Path:
    """A committed guide-layout checkpoint: one rank file, then ``metadata.json``."""
    d = root / job / f"step-{step:08d}"
    (d / "rank-0000").mkdir(parents=True)
    (d / "rank-0000" / "model.pt").write_bytes(os.urandom(size))
    (d / "metadata.json").write_text(json.dumps({"step": step}))
    return d


@pytest.fixture
def hot(tmp_path: Path) -> Path:
    root = tmp_path / "hot"
    root.mkdir()
    return root


@pytest.fixture
def catalog(catalog_url: str) -> Iterator[Catalog]:
    with Catalog.open(catalog_url) as cat:
        yield cat


def scan_and_verify(catalog: Catalog, hot: Path) -> None:
    run_scan(Run.of(catalog), [str(hot)])
    run_verify(Run.of(catalog))


def test_plan_warns_when_exact_milestones_never_fall_on_a_save(
    hot: Path, catalog: Catalog, catalog_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for i in range(1, 11):
        write_step(hot, "run", 1200 * i)
    scan_and_verify(catalog, hot)
    exact = tmp_path / "exact.toml"
    exact.write_text('[[policy]]\nkeep_last = 2\nmilestones = "log"\nmilestone_match = "exact"\n')
    assert main(["plan", "--catalog", catalog_url, "--config", str(exact), "--json"]) == 0
    out, err = capsys.readouterr()
    assert "ckptier: warning: job 'run': milestones log (1-2-5 series) (exact match): saves come every 1200 steps" in err
    assert not [r for r in json.loads(out) if any(x.startswith("milestones") for x in r["reasons"])]
    # the default matching keeps the first save at or after each milestone, and says so
    default = tmp_path / "default.toml"
    default.write_text('[[policy]]\nkeep_last = 2\nmilestones = "log"\n')
    assert main(["plan", "--catalog", catalog_url, "--config", str(default), "--json"]) == 0
    out, err = capsys.readouterr()
    assert "warning" not in err
    rows = {r["step"]: r for r in json.loads(out)}
    assert "holds milestone 1000: first save at or after it, step 1200" in rows[1200]["reasons"][0]
    assert "holds milestone 5000: first save at or after it, step 6000" in rows[6000]["reasons"][0]
    assert rows[3600]["action"] == "delete"


def test_min_drilled_reads_the_catalogs_drill_records(hot: Path, catalog: Catalog) -> None:
    for i in range(1, 7):
        write_step(hot, "run", 100 * i)
    scan_and_verify(catalog, hot)
    config = parse_config('[[policy]]\nkeep_last = 1\nmin_verified = 0\nmin_drilled = 1\n')
    three = catalog.get("run", 300)
    assert three is not None and three.state == State.VERIFIED

    def drill(ok: bool, at: datetime) -> None:
        catalog.record_drill(DrillRecord(job="run", step=300, checkpoint_id=three.id, started_at=at,
                                         finished_at=at + timedelta(minutes=5), ok=ok, device="cpu", source_tier="hot"))

    def action(step: int) -> str:
        return next(i for i in make_plan(Run.of(catalog, config=config), job="run").items if i.step == step).action

    assert action(300) == "delete"
    drill(True, datetime.now(UTC) - timedelta(hours=3))
    item = next(i for i in make_plan(Run.of(catalog, config=config), job="run").items if i.step == 300)
    assert item.action == "keep" and "newest drill-passed recovery point" in item.reasons[0]
    drill(False, datetime.now(UTC) - timedelta(hours=1))  # its most recent drill failed: no longer a recovery point
    assert action(300) == "delete"



# ------------------------------------------------------------------ forget


def rotate(hot: Path, catalog: Catalog, steps: range, keep: int) -> dict[int, Path]:
    """Save ``steps``, scan and verify them, then rotate as a trainer with ``save_total_limit = keep``
    does (delete all but the newest ``keep``) and rescan: the rest are missing."""
    dirs = {step: write_step(hot, "run", step) for step in steps}
    scan_and_verify(catalog, hot)
    for step in list(dirs)[:-keep]:
        shutil.rmtree(dirs[step])
    run_scan(Run.of(catalog), [str(hot)])
    return dirs


def test_forget_missing_tombstones_rows_gone_from_every_tier_and_lifts_the_suspension(
    hot: Path, catalog: Catalog, catalog_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A trainer keeping its 3 newest checkpoints leaves most rows missing: the shrink guard
    suspends deletion, forever, until ``forget --missing`` tombstones those confirmed gone."""
    rotate(hot, catalog, range(100, 1100, 100), keep=3)
    write_step(hot, "run", 700)  # back after the scan: the catalog says missing, storage has it
    config = tmp_path / "ckptier.toml"
    config.write_text("[[policy]]\nkeep_last = 2\n")
    base = ["--catalog", catalog_url, "--config", str(config)]
    assert main(["plan", *base]) == 0
    out = capsys.readouterr().out
    assert "deletion suspended" in out and "'ckptier forget --job run --missing'" in out
    assert main(["plan", *base]) == 0 and "deletion suspended" in capsys.readouterr().out  # rescanning does not help

    assert main(["forget", *base, "--job", "run", "--missing", "--dry-run"]) == 0
    assert "job run: 6 would be forgotten, 1 still stored, 0 not checked" in capsys.readouterr().out
    assert len(catalog.checkpoints(job="run")) == 10  # a dry run writes nothing

    assert main(["forget", *base, "--job", "run", "--missing", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["forgotten"], report["kept"], report["unchecked"]) == (6, 1, 0)
    seven = next(r for r in report["rows"] if r["step"] == 700)
    assert seven["outcome"] == "kept" and "still stored at" in seven["detail"] and "step-00000700" in seven["detail"]
    assert sorted(c.step for c in catalog.checkpoints(job="run")) == [700, 800, 900, 1000]
    gone = catalog.get("run", 300)
    assert gone is not None and gone.state == State.DELETED
    assert (gone.state_reason or "").startswith("forgotten: missing from hot storage since")
    assert [e.kind for e in catalog.events(job="run", kinds=["forgotten"])] == ["forgotten"] * 6

    # 1 of 4 left missing: deletion resumes
    assert main(["plan", *base, "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert sorted(rows) == [700, 800, 900, 1000]  # tombstones are never planned
    assert rows[800]["action"] == "delete"
    assert not any("suspended" in x for r in rows.values() for x in r["reasons"])
    # idempotent; and the rescan finds 700 again
    assert main(["forget", *base, "--job", "run", "--missing", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["forgotten"] == 0
    run_scan(Run.of(catalog), [str(hot)])
    assert catalog.get("run", 700).missing_since is None  # type: ignore[union-attr]


def test_forget_keeps_rows_with_an_archive_copy_and_honours_older_than(
    hot: Path, catalog: Catalog, tmp_path: Path
) -> None:
    from ckptier.storage.records import Tier

    rotate(hot, catalog, range(100, 600, 100), keep=1)
    archive = tmp_path / "archive"
    (archive / "run" / "step-00000200").mkdir(parents=True)
    (archive / "run" / "step-00000200" / "ckptier-manifest.json").write_text("{}")
    two = catalog.get("run", 200)
    assert two is not None
    catalog.add_copy(two.id, tier=Tier.ARCHIVE, url=f"{archive.as_uri()}/run/step-00000200", stored_bytes=1,
                     codec="ckz1", manifest_key="run/step-00000200/ckptier-manifest.json", verified_at=utcnow(),
                     now=utcnow())
    # the policy's archive tier holds step 300 though the catalog records no copy (a lost acknowledgement)
    (archive / "run" / "step-00000300").mkdir(parents=True)
    (archive / "run" / "step-00000300" / "r.ckz").write_bytes(b"x")
    config = parse_config(f'[[policy]]\nkeep_last = 2\narchive = "{archive}"\n')
    from ckptier.tasks.pipeline import run_forget

    young = run_forget(Run.of(catalog, config=config), job="run", older_than=timedelta(days=1))
    assert young.rows == () and "no checkpoint is missing" in young.lines[-1]
    report = run_forget(Run.of(catalog, config=config), job="run")
    outcome = {r.step: (r.outcome, r.detail) for r in report.rows}
    assert outcome[100][0] == "forgotten" and outcome[400][0] == "forgotten"
    assert outcome[200][0] == "kept" and "archive/run/step-00000200" in outcome[200][1]
    assert outcome[300][0] == "kept" and "archive/run/step-00000300" in outcome[300][1]


def test_forget_is_refused_once_a_scan_saw_the_row_again(hot: Path, catalog: Catalog) -> None:
    rotate(hot, catalog, range(100, 400, 100), keep=1)
    one = catalog.get("run", 100)
    assert one is not None and one.missing_since is not None
    write_step(hot, "run", 100)
    run_scan(Run.of(catalog), [str(hot)])  # reappeared, between our storage check and the write
    assert catalog.forget(one.id, missing_since=one.missing_since, now=utcnow(), reason="test") is False
    assert catalog.get("run", 100).state != State.DELETED  # type: ignore[union-attr]
    # and a lease held by another run wins too
    two = catalog.get("run", 200)
    assert two is not None and two.missing_since is not None
    assert catalog.claim(two.id, "other-run", now=utcnow(), ttl=timedelta(hours=1)) is not None
    assert catalog.forget(two.id, missing_since=two.missing_since, now=utcnow(), reason="test") is False


def test_forget_on_s3_checks_the_bucket_itself(s3_bucket: Any, s3_env: str, tmp_path: Path, catalog: Catalog) -> None:
    from ckptier.tasks.pipeline import run_forget

    client, bucket = s3_bucket.client, s3_bucket.name
    for step in (100, 200, 300):
        client.put_object(Bucket=bucket, Key=f"ck/run/step-{step:08d}/rank-0000/model.pt", Body=os.urandom(64))
        client.put_object(Bucket=bucket, Key=f"ck/run/step-{step:08d}/metadata.json", Body=json.dumps({"step": step}))
    url = f"s3://{bucket}/ck"
    run_scan(Run.of(catalog), [url])
    run_verify(Run.of(catalog))
    for step in (100, 200):
        for key in ("rank-0000/model.pt", "metadata.json"):
            client.delete_object(Bucket=bucket, Key=f"ck/run/step-{step:08d}/{key}")
    run_scan(Run.of(catalog), [url])
    assert {c.step for c in catalog.checkpoints(job="run") if c.missing_since is not None} == {100, 200}
    # a file of 200 is back (a late copy, a restore): storage is asked, not the catalog's flag
    client.put_object(Bucket=bucket, Key="ck/run/step-00000200/rank-0000/model.pt", Body=b"late")
    report = run_forget(Run.of(catalog, config=parse_config("[[policy]]\nkeep_last = 1\n")), job="run")
    assert {r.step: r.outcome for r in report.rows} == {100: "forgotten", 200: "kept"}
