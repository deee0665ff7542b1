"""The Prefect flows run for real under one ``prefect_test_harness`` per session.

Checks what the UI shows: the artifacts each flow publishes, that corruption
fails the verify run and emits its event, and that tiering holds its per-job
concurrency limit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ckptier.tasks.reports import VerifyReport


@pytest.fixture
def harness(prefect_harness: None) -> None:
    """The session's one in-process Prefect API (see ``tests/fixtures/prefect_server.py``)."""


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
    assert result["verify"].totals.verified == 2 and result["verify"].totals.corrupt == 0
    arts = _artifacts(state.state_details.flow_run_id)
    row = _summary(arts)["demo-run"]
    assert (row["checkpoints"], row["verified"], row["incomplete"]) == (3, 2, 1)  # published once, after verify
    assert "| demo-run | 2 | 2 | 0 | 0 | 0 |" in arts["verification"].data
    assert "Nothing corrupt or degraded." in arts["verification"].data


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
    from ckptier.storage.catalog.api import Catalog

    scan_verify_flow(urls=[str(tree["hot"])], catalog_url=tree["catalog_url"])
    state = restore_drill_flow(catalog_url=tree["catalog_url"], config_path=tree["config"], steps=3,
                               model="ckptier.tasks.drill_models:demo_model", return_state=True)
    assert state.is_completed(), state
    (report,) = state.result()
    assert report.ok and report.step == 50 and report.device == "cpu"
    md = _artifacts(state.state_details.flow_run_id)["drill-report"].data
    assert "demo-run step 50: PASSED" in md and "| deterministic | ok |" in md

    assert _summary(_artifacts(state.state_details.flow_run_id))["demo-run"]["verified"] == 2

    # A model whose shapes do not match the checkpoint: the factory does not fit the job (step 25 shows the
    # same mismatch), so one drill, not judged, one event; nothing blamed on a checkpoint.
    events: list[dict[str, Any]] = []
    real_emit = events_module.emit_event
    monkeypatch.setattr(events_module, "emit_event", lambda **kw: events.append(kw) or real_emit(**kw))
    factory = tree["hot"].parent / "wrong_model.py"
    factory.write_text("import torch\nfrom ckptier.tasks.drill_models import DrillSpec, demo_batch, demo_loss\n\n\n"
                       "def wrong_shapes():\n    model = torch.nn.Linear(3, 3)\n"
                       "    return DrillSpec(model, torch.optim.AdamW(model.parameters()), demo_batch, demo_loss)\n")
    state = restore_drill_flow(catalog_url=tree["catalog_url"], config_path=tree["config"], steps=3,
                               model=f"{factory}:wrong_shapes", return_state=True)
    assert state.is_failed()
    with pytest.raises(DrillFailed, match="demo-run step"):
        state.result()
    assert [(e["event"], e["payload"]["step"]) for e in events] == [("ckptier.drill.not-judged", 50)]
    assert "the factory does not fit this job" in events[0]["payload"]["summary"]
    assert "demo-run step 50: NOT JUDGED" in _artifacts(state.state_details.flow_run_id)["drill-report"].data
    with Catalog.open(tree["catalog_url"]) as cat:
        assert [(d.step, d.ok, d.verdict_name) for d in cat.drills()] == [(50, False, "not judged"), (50, True, "passed")]


# ------------------------------------------------------------------ runs that tell the truth


def _all_artifacts(flow_run_id: Any) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        return list(client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))))


def _dashboard_links(flow_run_id: Any) -> list[str]:
    """What the run's link artifacts (``create_link_artifact``: markdown ``[text](url)``) link to the dashboard."""
    import re

    return [m for a in _all_artifacts(flow_run_id) if a.key is None
            for m in re.findall(r"\]\((http[^)]*)\)", str(a.data)) if "dashboard" in str(a.data)]


def _summary(arts: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The catalog-summary table by job (one row per job, or the test fails)."""
    rows = json.loads(arts["catalog-summary"].data)
    assert len({r["job"] for r in rows}) == len(rows), rows
    return {r["job"]: r for r in rows}


def _capture_events(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    from ckptier.flows import events as events_module

    events: list[dict[str, Any]] = []
    real_emit = events_module.emit_event
    monkeypatch.setattr(events_module, "emit_event", lambda **kw: events.append(kw) or real_emit(**kw))
    return events


def test_verify_progress_reaches_100_percent_with_nothing_to_verify(harness: None, tree: dict[str, Any]) -> None:
    from ckptier.flows.scan_verify import scan_verify_flow, verify_flow

    scan_verify_flow(urls=[str(tree["hot"])], catalog_url=tree["catalog_url"])  # verifies everything there is
    state = verify_flow(catalog_url=tree["catalog_url"], return_state=True)
    assert state.is_completed() and state.result().totals.checked == 0
    arts = _artifacts(state.state_details.flow_run_id)
    assert float(arts["verify-progress"].data) == 100.0
    assert "Nothing to verify" in arts["verification"].data


def test_verification_names_every_bad_file_with_expected_and_actual_hashes(harness: None, tree: dict[str, Any]) -> None:
    from ckptier.flows.scan_verify import scan_flow, verify_flow
    from ckptier.storage.hashing import hash_file

    assert scan_flow(urls=[str(tree["hot"])], catalog_url=tree["catalog_url"])
    expected = {}
    for name in ("model.pt", "optimizer.pt"):
        victim = next(p for p in sorted(tree["hot"].rglob(name)) if "00000025" in str(p))
        expected[name] = hash_file(victim, sha256=True).sha256
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        expected[name] = (expected[name], hash_file(victim, sha256=True).sha256)
    state = verify_flow(catalog_url=tree["catalog_url"], return_state=True)
    assert state.is_failed()
    md = _artifacts(state.state_details.flow_run_id)["verification"].data
    assert "demo-run step 25: corrupt" in md
    for name, (good, bad) in expected.items():
        line = next(x for x in md.splitlines() if x.startswith(f"| `rank-0000/{name}`"))
        assert good in line and bad in line and "corrupt" in line, line
    assert "demo-run step 50" not in md.split("## Corrupt")[1]  # only what is bad is listed


def test_every_flow_that_changes_the_catalog_republishes_the_summary(harness: None, tree: dict[str, Any]) -> None:
    from ckptier.flows.scan_verify import scan_flow, verify_flow

    state = scan_flow(urls=[str(tree["hot"])], catalog_url=tree["catalog_url"], return_state=True)
    scanned = _summary(_artifacts(state.state_details.flow_run_id))["demo-run"]
    assert (scanned["checkpoints"], scanned["committed"], scanned["incomplete"]) == (3, 2, 1)
    state = verify_flow(catalog_url=tree["catalog_url"], return_state=True)
    row = _summary(_artifacts(state.state_details.flow_run_id))["demo-run"]
    assert (row["checkpoints"], row["verified"], row["incomplete"], row["newest verified step"]) == (3, 2, 1, 50)
    assert row["hot"].endswith("(3 checkpoints)") and row["hot"].split()[1] in ("kB", "MB"), row
    assert row["archive stored"] == "0 B" and row["archive logical"] == "0 B (0 checkpoints)"
    assert "tiers" not in row


def test_tiering_reports_what_it_did_and_the_plan_frees_what_apply_frees(harness: None, tmp_path: Path) -> None:
    from ckptier.flows.scan_verify import scan_verify_flow
    from ckptier.flows.tiering import tiering_flow
    from ckptier.flows.output import human_bytes
    from ckptier.storage.catalog.api import Catalog
    from ckptier.tasks.demo import train_demo_run

    hot, archive = tmp_path / "hot", tmp_path / "archive"
    hot.mkdir()
    train_demo_run(hot, steps=150, every=25)  # 25..125 committed, 150 in flight
    config = tmp_path / "ckptier.toml"
    config.write_text(f'[[policy]]\njobs = "*"\nkeep_last = 1\nmilestones = [50]\nmin_verified = 1\ngrace = "2h"\n'
                      f'archive = "{archive}"\n')
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    scan_verify_flow(urls=[str(hot)], catalog_url=url)
    with Catalog.open(url) as cat:
        size = {c.step: c.bytes for c in cat.checkpoints()}
    hot_before = sum(size.values())

    state = tiering_flow(apply=True, catalog_url=url, config_path=str(config), return_state=True)
    assert state.is_completed(), state
    result = state.result()
    arts = _artifacts(state.state_details.flow_run_id)
    # Freed: 25, 75 and 100 deleted; 50 promoted, then its hot copy deleted in the same run.
    freed = size[25] + size[75] + size[100] + size[50]
    assert result.apply.bytes_freed == freed == result.forecast["freed_bytes"]
    assert result.forecast["hot_bytes"] == hot_before
    plan = arts["retention-plan"]
    assert plan.description.startswith(f"Retention plan: {human_bytes(freed)} of {human_bytes(hot_before)} hot bytes")
    done = arts["tiering-result"]
    assert "1 promoted, 4 deleted" in done.description and human_bytes(freed) in done.description
    assert "| archive | hot | 1 |" in done.data and "| hot | hot | 0 |" in done.data
    assert "## Promoted" in done.data and "## Deleted" in done.data and "hot copy" in done.data
    row = _summary(arts)["demo-run"]
    assert row["hot"].endswith("(2 checkpoints)") and row["archive logical"] == f"{human_bytes(size[50])} (1 checkpoints)"
    assert row["deleted"] == 3
    assert sum(1 for p in hot.rglob("*") if p.is_file()) > 0

    # A dry run publishes the plan only, never a "what was done".
    state = tiering_flow(apply=False, catalog_url=url, config_path=str(config), return_state=True)
    assert "tiering-result" not in _artifacts(state.state_details.flow_run_id)


def test_runner_hands_back_a_failed_applys_report_from_a_flow_run_as_the_direct_path_does(
        harness: None, tree: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiering run whose promotion fails fails the flow run, and runner.apply still returns
    that run's own apply report: the same items and outcomes as the direct path."""
    import os
    import shutil

    from prefect.settings import PREFECT_API_URL

    from ckptier.flows import runner
    from ckptier.tasks.pipeline import VerifyOptions
    from ckptier.tasks.reports import ApplyRunReport
    from ckptier.tasks.settings import Settings

    monkeypatch.setenv("PREFECT_API_URL", str(PREFECT_API_URL.value()))
    twin = tmp_path / "twin"
    shutil.copytree(tree["hot"], twin)
    reports: dict[str, ApplyRunReport] = {}
    for how, hot in (("flow", tree["hot"]), ("direct", twin)):
        url = f"sqlite:///{tmp_path / f'{how}.db'}"
        config = tmp_path / f"{how}.toml"
        config.write_text(f'[[policy]]\njobs = "*"\nkeep_last = 1\nmilestones = [25]\narchive = "{tmp_path / how}"\n')
        settings = Settings(url, str(config))
        runner.scan([str(hot)], settings=settings, use_prefect=False, progress=False)
        runner.verify(VerifyOptions(workers=2), settings=settings, use_prefect=False, progress=False)
        # Milestone 25 rots after it was verified (same size and mtime): its promotion finds out and fails.
        victim = next(p for p in sorted(hot.rglob("model.pt")) if "00000025" in str(p))
        st = victim.stat()
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
        reports[how] = runner.apply(job=None, dry_run=False, settings=settings, use_prefect=how == "flow")

    def shape(report: ApplyRunReport) -> tuple[Any, ...]:
        return [(i.step, i.action, i.scope, i.outcome) for i in report.items], report.failed, report.bytes_freed

    assert all(isinstance(r, ApplyRunReport) for r in reports.values())
    assert shape(reports["flow"]) == shape(reports["direct"])
    assert reports["flow"].failed and any(i.step == 25 and i.action == "promote" and i.outcome == "failed"
                                          for i in reports["flow"].items)


@pytest.mark.parametrize("case", ["unknown job", "nothing drillable", "corrupt step", "bad model"])
def test_a_drill_that_cannot_start_fails_alerts_and_says_why(harness: None, tmp_path: Path, case: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptier.flows.drill import DrillFailed, restore_drill_flow
    from ckptier.flows.scan_verify import scan_verify_flow
    from ckptier.storage.catalog.api import Catalog
    from ckptier.tasks.demo import train_demo_run

    hot = tmp_path / "hot"
    hot.mkdir()
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    params: dict[str, Any] = {"job": "demo-run", "model": "ckptier.tasks.drill_models:demo_model", "steps": 2}
    if case == "nothing drillable":
        train_demo_run(hot, steps=25, every=25)  # its only save is still in flight
        needle = "no verified or committed checkpoint of job 'demo-run'"
    else:
        train_demo_run(hot, steps=75, every=25)
    scan_verify_flow(urls=[str(hot)], catalog_url=url, return_state=True)
    if case == "unknown job":
        params["job"], needle = "no-such-job", "job 'no-such-job': no checkpoints in the catalog"
    elif case == "corrupt step":
        victim = next(p for p in sorted(hot.rglob("model.pt")) if "00000025" in str(p))
        victim.write_bytes(victim.read_bytes()[:-10] + b"0123456789")
        scan_verify_flow(urls=[str(hot)], catalog_url=url, deep=True, return_state=True)
        params["step"], needle = 25, "job 'demo-run' step 25 is corrupt"
    elif case == "bad model":
        params["model"], needle = "no_such_module_for_ckptier:build", "no_such_module_for_ckptier"
    events = _capture_events(monkeypatch)
    (tmp_path / "empty.toml").write_text("")
    state = restore_drill_flow(catalog_url=url, config_path=str(tmp_path / "empty.toml"), return_state=True,
                               **params)
    assert state.is_failed()
    with pytest.raises(DrillFailed, match=needle.split(":")[0]):
        state.result()
    report = _artifacts(state.state_details.flow_run_id)["drill-report"].data
    assert "NOT STARTED" in report and needle in report, report
    assert [e["event"] for e in events] == ["ckptier.drill.failed"]
    assert needle in events[0]["payload"]["summary"]
    assert events[0]["payload"]["flow_run_id"] == str(state.state_details.flow_run_id)
    with Catalog.open(url) as cat:
        assert cat.drills() == []  # nothing is recorded against a checkpoint


def test_events_and_artifacts_link_the_run_and_the_dashboard(harness: None, tree: dict[str, Any],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptier.flows.scan_verify import scan_flow, verify_flow

    monkeypatch.setenv("CKPTIER_DASHBOARD_URL", "http://dash.example:8765/")
    state = scan_flow(urls=[str(tree["hot"])], catalog_url=tree["catalog_url"], return_state=True)
    assert _dashboard_links(state.state_details.flow_run_id) == ["http://dash.example:8765/jobs/demo-run"]
    victim = next(p for p in sorted(tree["hot"].rglob("model.pt")) if "00000050" in str(p))
    victim.write_bytes(victim.read_bytes()[:-4] + b"oops")
    events = _capture_events(monkeypatch)
    state = verify_flow(catalog_url=tree["catalog_url"], return_state=True)
    assert state.is_failed()
    (event,) = events
    run_id = str(state.state_details.flow_run_id)
    assert event["payload"]["flow_run_id"] == run_id
    assert event["payload"]["dashboard_url"] == "http://dash.example:8765/jobs/demo-run"
    assert {"prefect.resource.id": f"prefect.flow-run.{run_id}", "prefect.resource.role": "flow-run"}.items() <= \
        event["related"][0].items()
    assert event["payload"]["files"] == ["rank-0000/model.pt"]
    assert _dashboard_links(state.state_details.flow_run_id) == ["http://dash.example:8765/jobs/demo-run"]


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
    assert from_file.exists() and result["verify"].totals.verified == 2
    assert scan_flow(urls=[str(tree["hot"])], config_path=str(config))[0].rows_written == 0
    assert tiering_flow(config_path=str(config)).plan
    (drill,) = restore_drill_flow(config_path=str(config), steps=2, model="ckptier.tasks.drill_models:demo_model")
    assert drill.ok

    env_url = f"sqlite:///{tmp_path / 'from-env.db'}"  # does not exist: the flows must look there and say so
    monkeypatch.setenv("CKPTIER_CATALOG_URL", env_url)
    for flow, params in ((verify_flow, {}), (tiering_flow, {}), (restore_drill_flow, {"steps": 2})):
        state = flow(config_path=str(config), return_state=True, **params)
        assert state.is_failed()
        with pytest.raises(Exception, match="no catalog at " + env_url):
            state.result()
    assert not (tmp_path / "from-env.db").exists()
    explicit = scan_flow(urls=[str(tree["hot"])], catalog_url=tree["catalog_url"], config_path=str(config))
    assert explicit[0].rows_written > 0 and Path(tree["catalog_url"].removeprefix("sqlite:///")).exists()


def test_runner_reports_corruption_from_a_flow_run_as_the_direct_path_does(
        harness: None, tree: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A verify run that fails because it found corruption still returns the run's own report:
    the same rows and totals (bytes read, archive copies checked) as the direct path."""
    import shutil

    from prefect.settings import PREFECT_API_URL

    from ckptier.flows import runner
    from ckptier.tasks.pipeline import VerifyOptions
    from ckptier.tasks.settings import Settings

    monkeypatch.setenv("PREFECT_API_URL", str(PREFECT_API_URL.value()))
    twin = tmp_path / "twin"
    shutil.copytree(tree["hot"], twin)
    catalogs = {"flow": f"sqlite:///{tmp_path / 'flow.db'}", "direct": f"sqlite:///{tmp_path / 'direct.db'}"}
    for hot, url in ((tree["hot"], catalogs["flow"]), (twin, catalogs["direct"])):
        runner.scan([str(hot)], settings=Settings(url), use_prefect=False, progress=False)
        victim = next(p for p in sorted(hot.rglob("model.pt")) if "00000025" in str(p))
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    reports = {how: runner.verify(VerifyOptions(workers=2), settings=Settings(url), use_prefect=how == "flow",
                                  progress=False) for how, url in catalogs.items()}

    def shape(report: VerifyReport) -> tuple[Any, ...]:
        rows = sorted((r.job, r.step, r.state, r.bytes_read, r.errors) for r in report.checkpoints)
        return report.totals, rows, report.sample

    assert shape(reports["flow"]) == shape(reports["direct"])
    totals = shape(reports["flow"])[0]
    assert totals.corrupt == 1 and totals.verified == 1 and totals.bytes_read > 0
    assert isinstance(reports["flow"], VerifyReport) and "archive_checked" in reports["flow"].to_json()["totals"]
