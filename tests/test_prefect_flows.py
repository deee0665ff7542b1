"""The Prefect flows run for real under one ``prefect_test_harness`` per session.

Checks what the UI shows: the artifacts each flow publishes, that corruption
fails the verify run and emits its event, and that tiering holds its per-job
concurrency limit.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def harness() -> Iterator[None]:
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Any]:
    """A demo run's checkpoints (steps 25 and 50, 50 still in flight), a catalog URL and a policy file."""
    from ckptier.tasks.demo import train_demo_run

    hot = tmp_path / "hot"
    hot.mkdir()
    run = train_demo_run(hot, steps=75, every=25)
    config = tmp_path / "ckptier.toml"
    config.write_text('[[policy]]\njobs = "*"\nkeep_last = 1\nmilestones = [25]\ngrace = "2h"\n')
    return {"hot": hot, "run": run, "catalog_url": f"sqlite:///{tmp_path / 'catalog.db'}", "config": str(config)}


def _artifacts(flow_run_id: Any) -> dict[str, Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return {a.key: a for a in arts}


def test_scan_verify_publishes_summary_and_verification(harness: None, tree: dict[str, Any]) -> None:
    from ckptier.flows.scan_verify import scan_verify_flow

    state = scan_verify_flow(urls=[str(tree["hot"])], catalog_url=tree["catalog_url"], return_state=True)
    assert state.is_completed(), state
    result = state.result()
    assert result["verify"]["totals"]["verified"] == 2 and result["verify"]["totals"]["corrupt"] == 0
    arts = _artifacts(state.state_details.flow_run_id)
    summary = {(r["job"], r["state"]): r["checkpoints"] for r in json.loads(arts["catalog-summary"].data)}
    assert summary == {("demo-run", "verified"): 2, ("demo-run", "incomplete"): 1}  # published once, after verify
    (row,) = json.loads(arts["verification"].data)
    assert (row["job"], row["verified"], row["corrupt"]) == ("demo-run", 2, 0) and row["bytes read"] > 0


def test_verify_progress_artifact_belongs_to_the_run(harness: None, tree: dict[str, Any]) -> None:
    from ckptier.flows.scan_verify import scan_verify_flow

    state = scan_verify_flow(urls=[str(tree["hot"])], catalog_url=tree["catalog_url"], return_state=True)
    arts = _artifacts(state.state_details.flow_run_id)
    assert "verify-progress" in arts and arts["verify-progress"].type == "progress"


def test_corruption_fails_verify_and_emits_the_event(harness: None, tree: dict[str, Any],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptier.flows import events as events_module
    from ckptier.flows.scan_verify import CorruptionFound, scan_flow, verify_flow

    assert scan_flow(urls=[str(tree["hot"])], catalog_url=tree["catalog_url"])
    victim = next(p for p in sorted(tree["hot"].rglob("model.pt")) if "00000025" in str(p))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    events: list[dict[str, Any]] = []
    real_emit = events_module.emit_event
    monkeypatch.setattr(events_module, "emit_event", lambda **kw: events.append(kw) or real_emit(**kw))
    state = verify_flow(catalog_url=tree["catalog_url"], return_state=True)
    assert state.is_failed()
    with pytest.raises(CorruptionFound, match="demo-run step 25"):
        state.result()
    assert [(e["event"], e["payload"]["job"], e["payload"]["step"]) for e in events] == \
        [("ckptier.corruption.found", "demo-run", 25)]
    assert events[0]["resource"]["prefect.resource.id"] == "ckptier.checkpoint.demo-run.25"
    assert "corrupt" in str(_artifacts(state.state_details.flow_run_id)["verification"].data)


def test_tiering_dry_run_publishes_the_plan_under_its_job_lock(harness: None, tree: dict[str, Any]) -> None:
    from prefect.client.orchestration import get_client

    from ckptier.flows.scan_verify import scan_verify_flow
    from ckptier.flows.tiering import tiering_flow, tiering_lock_name

    scan_verify_flow(urls=[str(tree["hot"])], catalog_url=tree["catalog_url"])
    before = sorted(p.relative_to(tree["hot"]) for p in tree["hot"].rglob("*"))
    state = tiering_flow(catalog_url=tree["catalog_url"], config_path=tree["config"], return_state=True)
    assert state.is_completed(), state
    assert sorted(p.relative_to(tree["hot"]) for p in tree["hot"].rglob("*")) == before  # a dry run changes nothing
    plan = _artifacts(state.state_details.flow_run_id)["retention-plan"]
    assert "hot bytes can be freed" in (plan.description or "") and "demo-run" in str(plan.data)
    with get_client(sync_client=True) as client:
        lock = client.read_global_concurrency_limit_by_name(tiering_lock_name("demo-run"))
    assert lock.limit == 1 and lock.active_slots == 0  # held during the run, released after


def test_a_second_tiering_of_the_same_job_waits_for_the_first(harness: None) -> None:
    from prefect.concurrency.sync import concurrency

    from ckptier.flows.tiering import hold_job_locks, tiering_lock_name, tiering_lock_names

    names = tiering_lock_names("job-a", [])
    assert names == ["ckptier-tiering-job-a"]
    assert tiering_lock_names(None, ["b", "a", "b"]) == ["ckptier-tiering-a", "ckptier-tiering-b"]
    assert tiering_lock_name("team/x y") != tiering_lock_name("team_x_y")  # sanitised names stay unique
    with hold_job_locks(names, timeout_seconds=10):
        with pytest.raises(TimeoutError):
            with concurrency(names, occupy=1, timeout_seconds=1, strict=True):
                pass
        with concurrency(tiering_lock_names("job-b", []), occupy=1, timeout_seconds=5, strict=False):
            pass  # another job is not blocked


def test_restore_drill_reports_and_a_failed_drill_fails_the_run_with_its_event(
    harness: None, tree: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptier.flows import events as events_module
    from ckptier.flows.drill import DrillFailed, restore_drill_flow
    from ckptier.flows.scan_verify import scan_verify_flow

    scan_verify_flow(urls=[str(tree["hot"])], catalog_url=tree["catalog_url"])
    state = restore_drill_flow(catalog_url=tree["catalog_url"], config_path=tree["config"], steps=3,
                               model="ckptier.tasks.models:demo_model", return_state=True)
    assert state.is_completed(), state
    (report,) = state.result()
    assert report["ok"] and report["step"] == 50 and report["device"] == "cpu"
    md = _artifacts(state.state_details.flow_run_id)["drill-report"].data
    assert "demo-run step 50: PASSED" in md and "| deterministic | ok |" in md

    # A model whose shapes do not match the checkpoint: every candidate fails to restore.
    events: list[dict[str, Any]] = []
    real_emit = events_module.emit_event
    monkeypatch.setattr(events_module, "emit_event", lambda **kw: events.append(kw) or real_emit(**kw))
    state = restore_drill_flow(catalog_url=tree["catalog_url"], config_path=tree["config"], steps=3,
                               model="tests.fixtures.checkpoints:tiny_mlp", return_state=True)
    assert state.is_failed()
    with pytest.raises(DrillFailed, match="demo-run step"):
        state.result()
    assert {e["event"] for e in events} == {"ckptier.drill.failed"}
    assert "FAILED" in _artifacts(state.state_details.flow_run_id)["drill-report"].data


def test_flows_take_the_catalog_by_the_command_lines_precedence(
    harness: None, tree: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """scan-verify ignored [catalog] url in ckptier.toml while tiering honoured it (and above the
    environment): every flow now takes catalog_url, then CKPTIER_CATALOG_URL, then the file."""
    from ckptier.flows.drill import restore_drill_flow
    from ckptier.flows.scan_verify import scan_flow, scan_verify_flow, verify_flow
    from ckptier.flows.tiering import tiering_flow

    monkeypatch.delenv("CKPTIER_CATALOG_URL", raising=False)
    from_file = tmp_path / "from-config.db"
    config = Path(tree["config"])
    config.write_text(f'[catalog]\nurl = "sqlite:///{from_file}"\n' + config.read_text())
    result = scan_verify_flow(urls=[str(tree["hot"])], config_path=str(config))
    assert from_file.exists() and result["verify"]["totals"]["verified"] == 2
    assert scan_flow(urls=[str(tree["hot"])], config_path=str(config))[0]["rows_written"] == 0
    assert tiering_flow(config_path=str(config))["plan"]
    (drill,) = restore_drill_flow(config_path=str(config), steps=2, model="ckptier.tasks.models:demo_model")
    assert drill["ok"]

    env_url = f"sqlite:///{tmp_path / 'from-env.db'}"  # does not exist: the flows must look there and say so
    monkeypatch.setenv("CKPTIER_CATALOG_URL", env_url)
    for flow, params in ((verify_flow, {}), (tiering_flow, {}), (restore_drill_flow, {"steps": 2})):
        state = flow(config_path=str(config), return_state=True, **params)
        assert state.is_failed()
        with pytest.raises(Exception, match="no catalog at " + env_url):
            state.result()
    assert not (tmp_path / "from-env.db").exists()
    explicit = scan_flow(urls=[str(tree["hot"])], catalog_url=tree["catalog_url"], config_path=str(config))
    assert explicit[0]["rows_written"] > 0 and Path(tree["catalog_url"].removeprefix("sqlite:///")).exists()
