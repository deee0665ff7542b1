"""Retention over a real catalog: plan warnings on the command line and the drill
floor read from the catalog's drill records.

Checkpoints are small guide-layout directories on local disk, scanned and
verified by the real pipeline; the catalog is SQLite in a temporary directory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from ckptier.flows.cli import main
from ckptier.storage.catalog.api import Catalog, DrillRecord
from ckptier.storage.model import State
from ckptier.tasks.config import parse_config
from ckptier.tasks.pipeline import make_plan, run_scan, run_verify, utcnow


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
def catalog_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'catalog.db'}"


@pytest.fixture
def catalog(catalog_url: str) -> Iterator[Catalog]:
    with Catalog.open(catalog_url) as cat:
        yield cat


def scan_and_verify(catalog: Catalog, hot: Path) -> None:
    run_scan([str(hot)], catalog, now=utcnow)
    run_verify(catalog, now=utcnow)


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
        return next(i for i in make_plan(catalog, config, job="run", now=utcnow()).items if i.step == step).action

    assert action(300) == "delete"
    drill(True, datetime.now(UTC) - timedelta(hours=3))
    item = next(i for i in make_plan(catalog, config, job="run", now=utcnow()).items if i.step == 300)
    assert item.action == "keep" and "newest drill-passed recovery point" in item.reasons[0]
    drill(False, datetime.now(UTC) - timedelta(hours=1))  # its most recent drill failed: no longer a recovery point
    assert action(300) == "delete"

