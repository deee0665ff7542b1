"""What an operator sees in the Prefect UI, against a real ``prefect server``.

One module, one server (the session's in-process Prefect API, the one every
flow run of the session uses): the deployments' Custom run forms (every parameter with a
default is typed with it; choices are selects), the task runs of a drill
flow run (named after the checkpoint, their states the verdict: one drill
passing, one failing), and the artifacts of runs over hostile job names
(no HTML element, tables intact).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

import pytest
from markdown_it import MarkdownIt

from .fixtures.parameter_form import form_problems

# Slow: the server's start (shared by the session), a scan-verify and two drill flow runs (~35 s here).
pytestmark = [pytest.mark.prefect_server, pytest.mark.slow]

#: Job directories named to break the page: markup (the directory nests at each '/'), a pipe and backticks.
IMG_JOB = "<img src=https:/example.invalid/x>"
PIPE_JOB = "a|b`c``d"
RENDER = MarkdownIt("commonmark", {"html": True}).enable("table")


@pytest.fixture(scope="module")
def server(prefect_harness: None) -> Iterator[str]:
    """The session's in-process Prefect API (a ``prefect server`` of its own, see
    ``tests/fixtures/prefect_server.py``): the flows run here talk to it, so their task runs and
    artifacts are read back from it. Yields its API URL."""
    from prefect.events.worker import EventsWorker
    from prefect.settings import PREFECT_API_URL

    # Task runs reach the API as events, through one events worker per process, bound to the API
    # it first met (an earlier test's server): drained, the next one is this API's.
    EventsWorker.drain_all()
    old = os.environ.get("CKPTIER_DASHBOARD_URL")
    os.environ["CKPTIER_DASHBOARD_URL"] = "http://dash.example:8765/"
    try:
        yield str(PREFECT_API_URL.value())
    finally:
        EventsWorker.drain_all()
        if old is None:
            os.environ.pop("CKPTIER_DASHBOARD_URL", None)
        else:
            os.environ["CKPTIER_DASHBOARD_URL"] = old


@pytest.fixture(scope="module")
def tree(server: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two demo runs under hostile job names, scanned and verified by a scan-verify flow run."""
    from ckptier.flows.scan_verify import scan_verify_flow
    from ckptier.tasks.demo import train_demo_run

    base = tmp_path_factory.mktemp("ui")
    hot = base / "hot"
    for job in (IMG_JOB, PIPE_JOB):
        train_demo_run(hot, job=job, steps=50, every=25, leave_last_in_flight=False)
    config = base / "ckptier.toml"
    config.write_text('[[drill]]\njobs = "*"\nmodel = "ckptier.tasks.drill_models:demo_model"\n')
    url = f"sqlite:///{base / 'catalog.db'}"
    state = scan_verify_flow(urls=[str(hot)], catalog_url=url, config_path=str(config), return_state=True)
    assert state.is_completed(), state
    return {"base": base, "hot": hot, "catalog_url": url, "config": str(config), "scan_run": state}


def _task_runs(flow_run_id: Any) -> dict[str, Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {r.name: r for r in runs}


def _artifacts(flow_run_id: Any) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        return list(client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))))


def _elements(markdown: str) -> set[str]:
    return set(re.findall(r"<([a-zA-Z][a-zA-Z0-9]*)", RENDER.render(markdown)))


def _assert_inert(artifacts: list[Any]) -> None:
    """No artifact the UI renders as markdown (markdown and link artifacts, every description)
    makes an HTML element other than text formatting; every table row as wide as its header."""
    allowed = {"h1", "h2", "h3", "p", "code", "strong", "ul", "li", "br", "a",
               "table", "thead", "tbody", "tr", "th", "td"}
    for a in artifacts:
        rendered = [a.description or ""] + ([str(a.data)] if a.type in ("markdown", "link") else [])
        for md in rendered:
            assert _elements(md) <= allowed, (a.key, a.type, md)
            for table in re.findall(r"<table>.*?</table>", RENDER.render(md), re.S):
                widths = {len(re.findall(r"<t[dh]", tr)) for tr in re.findall(r"<tr>.*?</tr>", table, re.S)}
                assert len(widths) == 1, (a.key, table)
        if a.type == "table":  # data, which the UI shows as text: the names as they are
            assert isinstance(json.loads(a.data), list)


def test_every_deployment_form_types_its_defaults_and_shows_selects(server: str,
                                                                    tree: dict[str, Any]) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import VariableCreate

    from ckptier.deployments import serve as dep

    created: list[str] = []
    with get_client(sync_client=True) as client:
        for name, value in (("ckptier_scan_urls", [str(tree["hot"])]), ("ckptier_catalog_url", tree["catalog_url"]),
                            ("ckptier_config_path", tree["config"])):
            if client.read_variable_by_name(name) is None:
                client.create_variable(VariableCreate(name=name, value=value))
                created.append(name)
    try:
        assert dep.deploy_all(automations=None, quiet=True) == 0
        with get_client(sync_client=True) as client:
            deployments = {d.name: d for d in client.read_deployments()}
    finally:  # the API is the session's: later flow runs must not find this module's Variables
        with get_client(sync_client=True) as client:
            for name in created:
                client.delete_variable_by_name(name)
    for spec in dep.load_specs():  # the deployments the README has users create
        schema = deployments[spec.name].parameter_openapi_schema
        assert form_problems(schema["properties"], schema.get("required") or []) == [], spec.name
    drill = deployments["restore-drill"].parameter_openapi_schema["properties"]
    assert (drill["steps"]["default"], drill["device"]["default"], drill["device"]["enum"]) == \
        (10, "auto", ["auto", "cpu", "cuda"])
    assert deployments["restore-drill"].job_variables == {"env": {"CKPTIER_GPU_POOL": dep.GPU_POOL}}


def test_a_passing_drill_names_its_task_runs_after_the_checkpoint_and_ends_completed(
        server: str, tree: dict[str, Any]) -> None:
    from ckptier.flows.drill import restore_drill_flow

    state = restore_drill_flow(job=IMG_JOB, step=50, steps=2, catalog_url=tree["catalog_url"],
                               config_path=tree["config"], return_state=True)
    assert state.is_completed(), state
    runs = _task_runs(state.state_details.flow_run_id)
    drill = runs[f"drill {IMG_JOB}@50"]
    assert drill.state.type.value == "COMPLETED" and "drill ok" in (drill.state.message or ""), drill.state
    fetches = [n for n in runs if n.startswith("fetch ")]
    assert fetches and all(n.startswith(f"fetch {IMG_JOB}@50 (") for n in fetches), list(runs)
    assert not [n for n in runs if re.search(r"-[0-9a-f]{3}$", n)], list(runs)  # no generated names
    arts = _artifacts(state.state_details.flow_run_id) + _artifacts(tree["scan_run"].state_details.flow_run_id)
    assert {a.key for a in arts} >= {"drill-report", "verification", "catalog-summary"}
    links = [a for a in arts if a.key is None and "dash.example" in str(a.data)]  # link artifacts are markdown
    assert links and all("on the ckptier dashboard" in str(a.data) for a in links)
    _assert_inert(arts)
    report = next(a for a in arts if a.key == "drill-report")
    assert "PASSED" in report.data and "&lt;img src" in report.data


def test_a_failing_drill_fails_its_task_run_with_the_verdict_and_the_flow_run(
        server: str, tree: dict[str, Any]) -> None:
    from ckptier.flows.drill import DrillFailed, restore_drill_flow

    factory = tree["base"] / "nan_model.py"
    factory.write_text("import dataclasses\nfrom ckptier.tasks.drill_models import demo_loss, demo_model\n\n\n"
                       "def nan_loss(metadata=None):  # restores and trains, but every loss is NaN\n"
                       "    return dataclasses.replace(demo_model(metadata),\n"
                       "                               loss=lambda model, batch: demo_loss(model, batch) * float('nan'))\n")
    state = restore_drill_flow(job=PIPE_JOB, steps=2, model=f"{factory}:nan_loss", catalog_url=tree["catalog_url"],
                               config_path=tree["config"], return_state=True)
    assert state.is_failed(), state
    with pytest.raises(DrillFailed):
        state.result()
    runs = _task_runs(state.state_details.flow_run_id)
    drill = runs[f"drill {PIPE_JOB}@newest"]
    assert (drill.state.type.value, drill.state.name) == ("FAILED", "Failed"), drill.state
    assert f"{PIPE_JOB} step 50" in (drill.state.message or "") and "drill failed" in drill.state.message
    arts = _artifacts(state.state_details.flow_run_id)
    _assert_inert(arts)
    report = next(a for a in arts if a.key == "drill-report").data
    assert "FAILED" in report and "peak memory 0 bytes" not in report
