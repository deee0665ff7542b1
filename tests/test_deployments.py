"""Deployments, schedules, work pools and alerts: the pure decisions, then a real ``prefect server``.

The server tests deploy everything once (module fixture), then check through
the Prefect client what a user would see in the UI; one drill runs end to end
through ``prefect worker start --run-once``; a headless Chromium renders the
UI's deployments page.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptier.deployments import serve as dep
from ckptier.storage.errors import ConfigError

from .fixtures.parameter_form import form_problems
from .fixtures.prefect_server import PrefectServer
from .fixtures.services import free_port, unavailable

SHIPPED = dep.load_specs()
BY_NAME = {s.name: s for s in SHIPPED}


# ------------------------------------------------------------------ the shipped definition


def test_shipped_yaml_defines_the_three_deployments_with_slugged_schedules() -> None:
    assert set(BY_NAME) == {"scan-verify", "tiering", "restore-drill"}
    slugs = [s.slug for d in SHIPPED for s in d.schedules]
    assert len(slugs) == len(set(slugs)) and all(s.startswith(dep.SLUG_PREFIX) for s in slugs)
    scan = {s.slug: s for s in BY_NAME["scan-verify"].schedules}
    assert scan["ckptier-scan-hourly"].cron == "0 * * * *" and not scan["ckptier-scan-hourly"].parameters
    assert dict(scan["ckptier-verify-nightly"].parameters) == {"deep": True, "sample": "auto/7"}
    (tiering,) = BY_NAME["tiering"].schedules
    assert BY_NAME["tiering"].parameters["apply"] is False and tiering.cron == "0 3 * * *"
    (drill,) = BY_NAME["restore-drill"].schedules
    assert (drill.cron, drill.timezone) == ("0 2 * * *", "UTC")
    assert BY_NAME["restore-drill"].work_pool == dep.GPU_POOL
    assert {BY_NAME["scan-verify"].work_pool, BY_NAME["tiering"].work_pool} == {dep.PROCESS_POOL}


def test_entrypoints_load_and_parameters_are_documented_for_the_ui_form() -> None:
    for spec in SHIPPED:
        flow = dep.load_flow(spec)
        assert spec.module.startswith("ckptier.flows.")
        props = flow.parameters.properties
        for name in spec.parameters:
            assert name in props, f"{spec.name}: parameter {name} not in the flow signature"
        for name, schema in props.items():
            assert schema.get("description"), f"{spec.name}: parameter {name} has no description (UI form)"
        assert form_problems(props, flow.parameters.required or []) == [], spec.name
    drill = dep.load_flow(BY_NAME["restore-drill"]).parameters.properties
    assert (drill["device"]["enum"], drill["device"]["default"]) == (["auto", "cpu", "cuda"], "auto")
    assert (drill["steps"]["type"], drill["steps"]["default"]) == ("integer", 10)
    assert drill["runner"]["enum"] == ["config", "threads", "dask"]


def test_only_the_gpu_pool_deployment_tells_its_runs_they_expect_a_gpu() -> None:
    from ckptier.tasks.drill_inputs import GPU_POOL_ENV

    assert dep.job_variables_for(BY_NAME["restore-drill"], "my-gpus") == {"env": {GPU_POOL_ENV: "my-gpus"}}
    assert dep.job_variables_for(BY_NAME["restore-drill"], None) == {}  # served: one host, no pool
    assert dep.job_variables_for(BY_NAME["tiering"], dep.PROCESS_POOL) == {}


def _yaml(schedule: str, *, extra: str = "") -> str:
    return f"""
deployments:
  - name: d
    entrypoint: flows/drill.py:restore_drill_flow
    work_pool: {{name: ckptier-gpu}}
    schedules:
{schedule}
{extra}
"""


@pytest.mark.parametrize(("schedule", "needle"), [
    ("      - cron: '0 2 * * *'", "slug=None"),
    ("      - {slug: my-drill, cron: '0 2 * * *'}", "slug='my-drill'"),
    ("      - {slug: ckptier-a, cron: '0 2 * * *', interval: 60}", "exactly one of cron or interval"),
    ("      - {slug: ckptier-a, cron: '61 2 * * *'}", "cron='61 2 * * *'"),
    ("      - {slug: ckptier-a, cron: '0 2 * * *', timezone: Mars/Olympus}", "timezone='Mars/Olympus'"),
    ("      - {slug: ckptier-a, interval: -5}", "interval=-5"),
    ("      - {slug: ckptier-a, cron: '0 2 * * *'}\n      - {slug: ckptier-a, cron: '0 3 * * *'}", "used twice"),
    ("      - {slug: ckptier-a, cron: '0 2 * * *', when: never}", "unknown key(s) ['when']"),
])
def test_bad_schedules_are_rejected_in_one_line_naming_the_value(schedule: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        dep.parse_prefect_yaml(_yaml(schedule))
    message = str(info.value)
    assert needle in message and "\n" not in message


def test_bad_deployment_fields_are_rejected() -> None:
    with pytest.raises(ConfigError, match="entrypoint='drill'"):
        dep.parse_prefect_yaml("deployments:\n  - {name: d, entrypoint: drill, work_pool: {name: p}}")
    with pytest.raises(ConfigError, match="needs work_pool.name"):
        dep.parse_prefect_yaml("deployments:\n  - {name: d, entrypoint: flows/drill.py:f}")
    with pytest.raises(ConfigError, match="concurrency_limit=0"):
        dep.parse_prefect_yaml("deployments:\n  - {name: d, entrypoint: flows/drill.py:f, work_pool: {name: p}, concurrency_limit: 0}")
    with pytest.raises(ConfigError, match="not valid YAML"):
        dep.parse_prefect_yaml("deployments: [")


# ------------------------------------------------------------------ pure decisions


def test_schedule_plan_updates_by_slug_and_never_touches_user_schedules() -> None:
    wanted = [dep.ScheduleSpec(slug="ckptier-a", cron="0 * * * *"), dep.ScheduleSpec(slug="ckptier-b", cron="0 2 * * *")]
    existing = [
        dep.ExistingSchedule(id=1, slug="ckptier-a"),      # ours, still wanted: update in place
        dep.ExistingSchedule(id=2, slug=None),             # made in the UI: keep
        dep.ExistingSchedule(id=3, slug="team-weekly"),    # another owner's slug: keep
        dep.ExistingSchedule(id=4, slug="ckptier-old"),    # ours, dropped from the YAML: delete
    ]
    changes = dep.plan_schedule_changes(existing, wanted)
    assert [w.slug for w in changes.create] == ["ckptier-b"]
    assert [(i, w.slug) for i, w in changes.update] == [(1, "ckptier-a")]
    assert changes.delete == (4,)
    # Applying the plan and planning again changes nothing but in-place updates.
    after = [e for e in existing if e.id not in changes.delete] + [dep.ExistingSchedule(id=5, slug="ckptier-b")]
    again = dep.plan_schedule_changes(after, wanted)
    assert not again.create and not again.delete and len(again.update) == 2


def test_variables_resolve_or_drop_the_parameter() -> None:
    params = {"urls": "{{ prefect.variables.ckptier_scan_urls }}", "catalog_url": "{{prefect.variables.ckptier_catalog_url}}",
              "apply": False, "note": "see {{ prefect.variables.x }} inline"}
    assert dep.variable_names(params) == {"urls": "ckptier_scan_urls", "catalog_url": "ckptier_catalog_url"}
    resolved = dep.resolve_parameters(params, {"ckptier_scan_urls": ["s3://b/ckpt"], "ckptier_catalog_url": ""})
    assert resolved == {"urls": ["s3://b/ckpt"], "apply": False, "note": "see {{ prefect.variables.x }} inline"}
    assert set(dep.VARIABLES) == {v for s in SHIPPED for v in dep.variable_names(s.parameters).values()}


def test_pools_map_and_the_gpu_pool_runs_one_drill_at_a_time() -> None:
    assert dep.pool_for(BY_NAME["restore-drill"], work_pool="cpu", gpu_pool="a100") == "a100"
    assert dep.pool_for(BY_NAME["tiering"], work_pool="cpu", gpu_pool="a100") == "cpu"
    assert dep.pool_limits("cpu", "a100") == {"cpu": None, "a100": 1}
    assert dep.pool_limits("one", "one") == {"one": 1}


def test_a_missing_required_parameter_names_its_variable() -> None:
    with pytest.raises(ConfigError, match=r"urls \(set the Prefect Variable 'ckptier_scan_urls'"):
        dep.build_deployment(BY_NAME["scan-verify"], {}, work_pool="p")


def test_built_deployment_update_never_carries_schedules() -> None:
    built = dep.build_deployment(BY_NAME["restore-drill"], {"device": "cpu"}, work_pool="p")
    payload = built.model_dump(mode="json", exclude_unset=True)
    assert "schedules" not in payload
    assert built.entrypoint == "ckptier.flows.drill.restore_drill_flow"
    assert payload["parameters"] == {"device": "cpu"} and payload["enforce_parameter_schema"] is True


def test_aws_block_values_go_to_the_environment_only_where_unset() -> None:
    class Secret:
        def __init__(self, v: str) -> None:
            self.v = v

        def get_secret_value(self) -> str:
            return self.v

    env = {"AWS_DEFAULT_REGION": "eu-west-1"}
    names = dep.export_aws_env({"aws_access_key_id": "AKIAEXAMPLE", "aws_secret_access_key": Secret("s3cr3t"),
                                "region_name": "us-east-1", "aws_client_parameters": {"endpoint_url": "http://127.0.0.1:9000"}}, env)
    assert names == ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"]
    assert env == {"AWS_DEFAULT_REGION": "eu-west-1", "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": "s3cr3t",
                   "AWS_ENDPOINT_URL": "http://127.0.0.1:9000"}
    assert "s3cr3t" not in repr(names)


def test_automation_definitions_are_valid_prefect_automations() -> None:
    from prefect.events.schemas.automations import AutomationCore

    autos = dep.load_automations()
    expected = {"ckptier-drill-failed": "ckptier.drill.failed", "ckptier-corruption-found": "ckptier.corruption.found",
                "ckptier-drill-not-judged": "ckptier.drill.not-judged", "ckptier-environment-drift": "ckptier.drill.drift"}
    assert {a["name"] for a in autos} == set(expected)
    for raw in autos:
        core = AutomationCore.model_validate(dep.with_block(raw, "9f0c2a52-3c1e-4a6b-8d8e-0f5b3c7d2a11"))
        assert core.trigger.expect == {expected[raw["name"]]}  # type: ignore[union-attr]
        assert str(core.actions[0].block_document_id) == "9f0c2a52-3c1e-4a6b-8d8e-0f5b3c7d2a11"  # type: ignore[union-attr]


def test_unreachable_api_is_one_line_naming_prefect_api_url(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_API_URL=f"http://127.0.0.1:{free_port()}/api", PREFECT_HOME=str(tmp_path))
    for command in ("deploy", "serve"):
        proc = subprocess.run([sys.executable, "-m", "ckptier.flows.cli", command], env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "PREFECT_API_URL=" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
        # Only options the command has: deploy and serve cannot run without Prefect.
        assert "--no-prefect" not in lines[0] and "prefect server start" in lines[0], lines[0]


# ------------------------------------------------------------------ against a real prefect server


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A demo catalog with verified checkpoints (the demo's own direct run, no Prefect)."""
    from ckptier.flows.demo import run_demo

    base = tmp_path_factory.mktemp("demo")
    assert run_demo(base, steps=60, use_prefect=False) == 0
    return base


@pytest.fixture(scope="module")
def deployed(prefect_server: PrefectServer, demo_dir: Path) -> Iterator[PrefectServer]:
    """Variables and an alert block set, then ``deploy_all`` run once, with the API pointed at the server."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import VariableCreate
    from prefect.settings import PREFECT_API_URL, temporary_settings

    old = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = prefect_server.api_url
    try:
        with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
            with get_client(sync_client=True) as client:
                for name, value in (("ckptier_scan_urls", [str(demo_dir / "hot")]),
                                    ("ckptier_catalog_url", f"sqlite:///{demo_dir / 'catalog.db'}"),
                                    ("ckptier_config_path", str(demo_dir / "ckptier.toml"))):
                    client.create_variable(VariableCreate(name=name, value=value))
            CustomWebhookNotificationBlock(name="alerts", url=f"http://127.0.0.1:{free_port()}/hook",
                                           json_data={"text": "{{body}}"}).save("ckptier-alerts", overwrite=True)
            assert dep.deploy_all(quiet=True) == 0
            yield prefect_server
    finally:
        if old is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = old


def _deployments(client: Any) -> dict[str, Any]:
    return {d.name: d for d in client.read_deployments()}


@pytest.mark.prefect_server
def test_deployments_schedules_schemas_and_limits_are_as_defined(deployed: PrefectServer, demo_dir: Path) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        deps = _deployments(client)
        assert set(deps) == {"scan-verify", "tiering", "restore-drill"}
        for spec in SHIPPED:
            d = deps[spec.name]
            assert d.entrypoint == f"{spec.module}.{spec.attribute}"
            assert d.work_pool_name == spec.work_pool and d.enforce_parameter_schema and not d.paused
            got = {s.slug: s for s in d.schedules}
            assert set(got) == {s.slug for s in spec.schedules}
            for s in spec.schedules:
                assert got[s.slug].schedule.cron == s.cron and got[s.slug].schedule.timezone == s.timezone
                assert got[s.slug].parameters == dict(s.parameters) and got[s.slug].active
            assert d.pull_steps == dep.PULL_STEPS
            assert set(d.parameter_openapi_schema["properties"]) >= set(spec.parameters)
        assert deps["scan-verify"].parameters == {"urls": [str(demo_dir / "hot")],
                                                  "catalog_url": f"sqlite:///{demo_dir / 'catalog.db'}",
                                                  "config_path": str(demo_dir / "ckptier.toml")}
        assert deps["tiering"].parameters["apply"] is False
        assert deps["tiering"].parameters["config_path"] == str(demo_dir / "ckptier.toml")
        assert deps["restore-drill"].parameter_openapi_schema["properties"]["device"]["enum"] == ["auto", "cpu", "cuda"]
        assert deps["restore-drill"].job_variables == {"env": {"CKPTIER_GPU_POOL": dep.GPU_POOL}}
        pools = {p.name: p for p in client.read_work_pools()}
        assert pools[dep.GPU_POOL].concurrency_limit == 1 and pools[dep.GPU_POOL].type == "process"
        assert pools[dep.PROCESS_POOL].concurrency_limit is None
        autos = {a.name: a for a in client.read_automations()}
        assert autos["ckptier-drill-failed"].trigger.expect == {"ckptier.drill.failed"}
        assert autos["ckptier-corruption-found"].trigger.expect == {"ckptier.corruption.found"}
        block = client.read_block_document_by_name("ckptier-alerts", block_type_slug="custom-webhook")
        assert all(a.actions[0].block_document_id == block.id for a in autos.values() if a.name.startswith("ckptier-"))


@pytest.mark.prefect_server
def test_redeploy_updates_in_place_and_keeps_ui_schedules(deployed: PrefectServer, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.schedules import CronSchedule

    with get_client(sync_client=True) as client:
        d = _deployments(client)["scan-verify"]
        # What the UI sends: a schedule with no slug.
        client.create_deployment_schedules(d.id, [DeploymentScheduleCreate(schedule=CronSchedule(cron="15 4 * * 6"), active=True)])
        ids_before = {s.slug: s.id for s in client.read_deployment_schedules(d.id)}
    # Redeploy a YAML without the nightly verification: only that YAML-owned schedule goes.
    trimmed = dep.PREFECT_YAML.read_text().replace("      - slug: ckptier-verify-nightly", "      - slug: ckptier-verify-nightly-x")
    trimmed = re.sub(r"      - slug: ckptier-verify-nightly-x.*?sample: auto/7\n", "", trimmed, flags=re.S)
    assert "ckptier-verify-nightly" not in trimmed
    (tmp_path / "prefect.yaml").write_text(trimmed)
    assert dep.deploy_all(path=tmp_path / "prefect.yaml", automations=None, quiet=True) == 0
    with get_client(sync_client=True) as client:
        after = {s.slug: s for s in client.read_deployment_schedules(d.id)}
    assert set(after) == {None, "ckptier-scan-hourly"}
    assert after["ckptier-scan-hourly"].id == ids_before["ckptier-scan-hourly"]  # updated in place
    assert after[None].schedule.cron == "15 4 * * 6"
    # And back: the nightly schedule returns, the UI schedule is still there, nothing doubled.
    assert dep.deploy_all(automations=None, quiet=True) == 0
    with get_client(sync_client=True) as client:
        slugs = sorted((s.slug or "") for s in client.read_deployment_schedules(d.id))
    assert slugs == ["", "ckptier-scan-hourly", "ckptier-verify-nightly"]


@pytest.mark.prefect_server
def test_wrong_typed_parameter_is_rejected_naming_it(deployed: PrefectServer) -> None:
    from prefect.deployments import run_deployment

    with pytest.raises(Exception) as info:
        run_deployment("restore-drill/restore-drill", parameters={"steps": "many"}, timeout=0)
    assert "steps" in str(info.value) and "many" in str(info.value)


@pytest.mark.prefect_server
@pytest.mark.slow
def test_drill_deployment_runs_on_a_worker_and_publishes_its_report(deployed: PrefectServer) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.deployments import run_deployment

    run = run_deployment("restore-drill/restore-drill", parameters={"device": "cpu", "steps": 2}, timeout=0)
    env = dict(deployed.env, PREFECT_API_URL=deployed.api_url)
    worker = subprocess.run(["prefect", "worker", "start", "--pool", dep.GPU_POOL, "--run-once"], env=env,
                            capture_output=True, text=True, timeout=240, cwd=deployed.home)
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(run.id).state
        assert state is not None and state.type.value == "COMPLETED", worker.stdout[-3000:] + worker.stderr[-3000:]
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
    report = {a.key: a for a in arts}["drill-report"]
    assert "PASSED" in str(report.data) and "demo-run" in str(report.data)


def _wait_for(predicate: Any, what: str, timeout: float, proc: subprocess.Popen[bytes] | None = None,
              log: Path | None = None) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what`` (with the log) after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{what}: the process exited with {proc.returncode}\n{tail}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:.0f} s\n{tail}")
        time.sleep(0.5)


SERVED = {f"{s.name}{dep.SERVED_SUFFIX}" for s in SHIPPED}


@pytest.mark.prefect_server
@pytest.mark.slow
def test_serve_runs_flows_and_stopping_it_leaves_the_deployed_ones_alone(deployed: PrefectServer, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    env = dict(deployed.env, PREFECT_API_URL=deployed.api_url, PREFECT_RUNNER_POLL_FREQUENCY="2",
               PYTHONUNBUFFERED="1", PREFECT_LOGGING_LEVEL="INFO")
    try:
        for n, stop in enumerate((signal.SIGTERM, signal.SIGINT)):
            log = tmp_path / f"serve-{n}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen([sys.executable, "-m", "ckptier.flows.cli", "serve"], env=env, stdout=out,
                                        stderr=subprocess.STDOUT, cwd=tmp_path)
            try:
                _wait_for(lambda: "waiting for scheduled" in log.read_text(), "ckptier serve to start", 120, proc, log)  # noqa: B023 - called in this iteration
                with get_client(sync_client=True) as client:
                    deps = _deployments(client)
                assert SERVED <= set(deps) and not any(deps[name].paused for name in SERVED)
                assert all(deps[name].work_pool_name is None for name in SERVED)
                if n == 0:  # a served deployment really runs its flow, in a subprocess of serve
                    run = run_deployment("tiering/tiering-served", timeout=0)

                    def finished() -> Any:
                        with get_client(sync_client=True) as client:
                            state = client.read_flow_run(run.id).state  # noqa: B023 - called in this iteration
                        return state if state is not None and state.is_final() else None

                    state = _wait_for(finished, "the served tiering run to finish", 240, proc, log)
                    assert state.type.value == "COMPLETED", log.read_text()[-3000:]
                    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

                    with get_client(sync_client=True) as client:
                        arts = client.read_artifacts(artifact_filter=ArtifactFilter(
                            flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
                    assert {"retention-plan", "catalog-summary"} <= {a.key for a in arts}
                proc.send_signal(stop)
                assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
                assert "stopped serving" in log.read_text()
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
            with get_client(sync_client=True) as client:
                deps = _deployments(client)
                # Stopping pauses what serve served, and nothing that deploy registered for workers.
                assert all(deps[name].paused for name in SERVED), {n: deps[n].paused for n in SERVED}
                for spec in SHIPPED:
                    d = deps[spec.name]
                    assert not d.paused and d.work_pool_name == spec.work_pool, spec.name
                    assert all(s.active for s in client.read_deployment_schedules(d.id))
    finally:
        with get_client(sync_client=True) as client:
            for name, d in _deployments(client).items():
                if name in SERVED:
                    client.delete_deployment(d.id)


class _Hook:
    """A webhook receiver on 127.0.0.1: keeps the body of every POST."""

    def __init__(self) -> None:
        import http.server
        import threading

        bodies: list[str] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                bodies.append(self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode())
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.bodies = bodies
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.prefect_server
@pytest.mark.slow
def test_a_drill_alert_links_the_flow_run_and_the_dashboard(deployed: PrefectServer, demo_dir: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.client.orchestration import get_client
    from prefect.events.worker import EventsWorker

    from ckptier.flows.drill import restore_drill_flow

    hook = _Hook()
    try:
        CustomWebhookNotificationBlock(name="alerts", url=hook.url, json_data={"subject": "{{subject}}",
                                                                               "body": "{{body}}"}
                                       ).save("ckptier-alerts", overwrite=True)
        with get_client(sync_client=True) as client:
            assert dep.apply_automations(client)  # pointed at the block as it is now
        monkeypatch.setenv("CKPTIER_DASHBOARD_URL", "http://dash.example:8765")
        # Events go through one worker per process, bound to the API it first saw (another test's
        # temporary server, in a whole run): start a fresh one for this server.
        EventsWorker.drain_all(timeout=30)
        state = restore_drill_flow(job="no-such-job", catalog_url=f"sqlite:///{demo_dir / 'catalog.db'}",
                                   config_path=str(demo_dir / "ckptier.toml"), return_state=True)
        assert state.is_failed()
        EventsWorker.drain_all(timeout=30)  # the event is sent
        run_id = str(state.state_details.flow_run_id)
        (alert,) = _wait_for(lambda: [json.loads(b) for b in hook.bodies], "the drill alert", 90)
    finally:
        hook.close()
    assert "restore drill FAILED: no-such-job" in alert["subject"], alert
    body = alert["body"]
    assert "job 'no-such-job': no checkpoints in the catalog" in body, body
    assert f"{deployed.ui_url}/runs/flow-run/{run_id}" in body, body
    assert "Dashboard: http://dash.example:8765/jobs/no-such-job" in body, body


def test_prefect_walkthrough_waits_for_the_api_before_setting_variables() -> None:
    guide = (Path(__file__).parents[1] / "docs" / "prefect.md").read_text()
    walk = guide.split("## Walkthrough (one machine)", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in walk.splitlines() if line.split("#", 1)[0].strip()]
    start = next(i for i, c in enumerate(commands) if c.startswith("prefect server start"))
    wait = next(i for i, c in enumerate(commands) if "/api/health" in c)
    first_use = next(i for i, c in enumerate(commands) if c.startswith("prefect variable set"))
    assert start < wait < first_use, commands


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return name
    unavailable("chromium is not installed (CI: apt-get install -y chromium)")
    raise AssertionError  # unreachable


def _page_text(dom: str) -> str:
    import html

    text = re.sub(r"<script.*?</script>|<style.*?</style>", " ", dom, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", text)).split())


@pytest.mark.prefect_server
@pytest.mark.slow
def test_ui_deployments_page_shows_the_three_deployments(deployed: PrefectServer, tmp_path: Path) -> None:
    browser = _chromium()
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-dev-shm-usage",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,900", "--virtual-time-budget=20000"]
    url = deployed.ui_url + "/deployments"
    dom = subprocess.run([browser, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    text = _page_text(dom)
    assert "3 Deployments" in text, text[:2000]
    for name, schedule in (("scan-verify", "Every hour"), ("tiering", "At 03:00 AM every day"),
                           ("restore-drill", "At 02:00 AM every day")):
        assert name in text and schedule in text, text[:2000]
    shot = tmp_path / "deployments.png"
    subprocess.run([browser, *flags, f"--screenshot={shot}", url], capture_output=True, timeout=120)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
