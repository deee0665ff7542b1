"""``ckptier report --costs`` and the dashboard's cost tables.

Built on the dashboard's test catalog (job ``alpha``: 10 checkpoints of
1,000 bytes on S3, three archive copies of 400 stored bytes, one deleted,
step 800 the newest drill-passed; job ``beta``: all missing), plus one
drill of step 800 whose fetch took 0.5 s. The tables are
:func:`ckptier.tasks.costs.cost_tables` rendered, never recomputed: each
figure is checked by hand and against it.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ckptier.dashboard.app import create_app
from ckptier.dashboard.cli import print_report
from ckptier.dashboard.format import records, to_csv
from ckptier.dashboard.source import open_source
from ckptier.dashboard.tables import Snapshot
from ckptier.flows.cli import main
from ckptier.storage.catalog.api import Catalog, DrillRecord
from ckptier.storage.errors import ConfigError
from ckptier.tasks.config import parse_config
from ckptier.tasks.costs import cost_tables
from tests.test_dashboard import NOW, POLICY, build_catalog, hours

FETCH_S = 0.5


def build(url: str) -> None:
    build_catalog(url)
    with Catalog.open(url) as cat:
        rec = cat.get("alpha", 800)
        assert rec is not None
        cat.record_drill(DrillRecord(job="alpha", step=800, checkpoint_id=rec.id, started_at=hours(12.5),
                                     finished_at=hours(12.6), ok=True, device="cpu", source_tier="hot",
                                     verdict={"summary": "step 800 ok"}, timings={"fetch_s": FETCH_S, "train_s": 3.0}))


@pytest.fixture
def catalog(tmp_path: Path) -> Iterator[tuple[str, Path, Any]]:
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    build(url)
    config = tmp_path / "ckptier.toml"
    config.write_text(POLICY)
    with open_source(url, parse_config(POLICY)) as source:
        yield url, config, source


def test_costs_table_is_cost_tables_per_job(catalog: tuple[str, Path, Any]) -> None:
    _, _, source = catalog
    snap = Snapshot(source, now=NOW)
    rows = {r["job"]: r for r in records(snap.table("costs"))}
    a = rows["alpha"]
    standard = source.config.prices.monthly
    expected = {
        "hot_bytes": 7000, "archive_bytes": 1200, "stored_bytes": 8200, "keep_all_checkpoints": 10,
        "keep_all_bytes": 10000, "classes": "hot STANDARD, archive STANDARD", "recovery_step": 800,
        "restore_tier": "hot", "restore_bytes": 1000, "restore_drills": 1, "currency": "USD", "prices_assumed": True,
        "restore_throughput_bytes_per_s": 1000 / FETCH_S, "restore_seconds": FETCH_S * 1.0,
    }
    assert {k: a[k] for k in expected} == expected
    assert a["monthly_cost"] == pytest.approx(standard(8200, "STANDARD"), abs=1e-4)
    assert a["keep_all_monthly_cost"] == pytest.approx(standard(10000, "STANDARD"), abs=1e-4)
    assert a["savings_fraction"] == pytest.approx(0.18)
    assert a["recovery_age_s"] == pytest.approx(6 * 3600, abs=1)  # step 800 was saved at 8 h
    assert "list-price assumption" in a["price_note"]
    b = rows["beta"]  # every checkpoint missing: nothing stored, nothing to restore
    assert (b["stored_bytes"], b["recovery_step"], b["restore_note"]) == (0, None, "no drill-passed checkpoint held")
    # the same figures as the pure function, never a second computation
    pure = {c.job: c for c in cost_tables(snap.records, [d for ds in snap.drills.values() for d in ds],
                                          source.config, now=NOW)}
    assert a["monthly_cost"] == round(pure["alpha"].monthly_cost, 4)
    assert a["restore_seconds"] == pure["alpha"].restore.seconds  # type: ignore[union-attr]
    tiers = records(snap.table("cost_tiers"))
    assert [(t["job"], t["tier"], t["storage_class"], t["checkpoints"], t["bytes"]) for t in tiers] == [
        ("alpha", "hot", "STANDARD", 7, 7000), ("alpha", "archive", "STANDARD", 3, 1200)]
    only = records(Snapshot(source, now=NOW, job="alpha").table("costs"))
    assert [r["job"] for r in only] == ["alpha"] and only[0] == a


def test_restore_time_is_unknown_until_a_drill_measured_a_fetch(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    build_catalog(url)  # drills without fetch timings
    with open_source(url, parse_config(POLICY)) as source:
        a = records(Snapshot(source, now=NOW, job="alpha").table("costs"))[0]
    assert (a["recovery_step"], a["restore_seconds"], a["restore_throughput_bytes_per_s"]) == (800, None, None)
    assert a["restore_note"] == "no drill of job alpha has fetched from the hot tier yet"


def test_report_costs_in_every_format(catalog: tuple[str, Path, Any]) -> None:
    url, config, source = catalog

    def run(**kw: Any) -> str:
        out = io.StringIO()
        args = {"catalog_url": url, "config_path": str(config), "job": None, "step": None, "fmt": "table",
                "tables": None, "now": NOW, "out": out, "costs": True, **kw}
        assert print_report(**args) == 0
        return out.getvalue()

    text = run()
    assert "Costs (2)" in text and "Costs per tier and class (2)" in text
    assert "Expected restore" in text and "costs per month in USD" in text and "prices: list-price assumption" in text
    data = json.loads(run(fmt="json"))
    assert set(data) == {"costs", "cost_tiers"}
    assert data["costs"] == records(Snapshot(source, now=NOW).table("costs"))
    rows = list(csv.DictReader(io.StringIO(run(fmt="csv", job="alpha"))))
    assert [r["job"] for r in rows] == ["alpha"] and rows[0]["stored_bytes"] == "8200" and rows[0]["restore_seconds"] == "0.5"
    tiers = list(csv.DictReader(io.StringIO(run(fmt="csv", tables=["cost_tiers"]))))
    assert [r["storage_class"] for r in tiers] == ["STANDARD", "STANDARD"]
    with pytest.raises(ConfigError, match="--costs is per job"):
        run(job="alpha", step=800)


def test_cli_report_costs(catalog: tuple[str, Path, Any], capsys: pytest.CaptureFixture[str]) -> None:
    url, config, _ = catalog
    assert main(["report", "--costs", "--catalog", url, "--config", str(config), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {r["job"] for r in data["costs"]} == {"alpha", "beta"}
    assert main(["report", "--costs", "--job", "alpha", "--step", "800", "--catalog", url, "--config", str(config)]) == 2
    assert "--costs is per job" in capsys.readouterr().err


def test_dashboard_shows_costs_with_downloads(catalog: tuple[str, Path, Any]) -> None:
    _, _, source = catalog
    client = TestClient(create_app(source, clock=lambda: NOW), base_url="http://127.0.0.1:8765")
    home = client.get("/").text
    assert 'id="costs-link" href="/costs"' in home and 'id="t-costs"' not in home  # the overview stays an aggregate
    page = client.get("/costs").text
    assert 'id="t-costs"' in page and 'href="/data/costs.csv"' in page and 'href="/data/costs.json"' in page
    assert 'id="t-cost_tiers"' in page and 'href="/jobs/alpha"' in page and "prices: list-price assumption" in page
    job = client.get("/jobs/alpha").text
    assert 'id="costs"' in job and 'id="t-cost_tiers"' in job and 'href="/data/cost_tiers.csv?job=alpha"' in job
    snap = Snapshot(source, now=NOW, job="alpha")
    r = client.get("/data/costs.csv?job=alpha")
    assert r.status_code == 200 and r.text == to_csv(snap.table("costs"))
    assert client.get("/data/cost_tiers.json").json() == records(Snapshot(source, now=NOW).table("cost_tiers"))


def test_archive_copies_are_priced_in_their_class_by_age(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    build(url)
    policy = POLICY.replace('archive = "s3://cold/archive"\n', 'archive = "s3://cold/archive"\n'
                            'archive_tiers = [{ after = "30d", storage_class = "GLACIER_IR" }]\n')
    with open_source(url, parse_config(policy)) as source:
        rows = records(Snapshot(source, now=NOW + timedelta(days=60)).table("cost_tiers"))
    assert ("alpha", "archive", "GLACIER_IR") in {(r["job"], r["tier"], r["storage_class"]) for r in rows}
