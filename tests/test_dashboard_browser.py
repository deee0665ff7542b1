"""The dashboard in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``) driven over the W3C WebDriver protocol, as a person would.

Three ``ckptier dashboard`` processes serve:

* the demo catalog (``ckptier demo --no-prefect``) with ``PREFECT_API_URL``
  pointing at the session's real ``prefect server``, where ``ckptier deploy``
  registered the deployments: overview → job → checkpoint, every download
  link, and the drill button starting a real flow run;
* a catalog whose job directory is named ``<img src=x onerror=alert(1)>``,
  without a Prefect API: the name renders as text (no alert, no img
  element) and the drill button says why it is disabled;
* the demo catalog behind a token: refused without it, open with it;
* a copy of the demo catalog (the same job name, ``demo-run``) plus a job
  with a 100-character name, with the same Prefect API: the drill button
  drills this catalog, not the deployment's; the tables stay inside a
  1,366-pixel window; pagination, tonight's plan and the cost chart.

Every page visited is kept as a PNG in ``$CKPTIER_SCREENSHOTS`` when set
(``docs/screenshots/`` holds the overview, job and checkpoint pages taken
this way), else in the test's temporary directory.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit
from uuid import UUID

import httpx
import pytest

from .fixtures.prefect_server import PrefectServer
from .fixtures.services import free_port, unavailable

pytestmark = [pytest.mark.slow]

XSS = "<img src=x onerror=alert(1)>"
TOKEN = "dashboard-token-for-tests-0123"
W3C_ELEMENT = "element-6066-11e4-a52e-4f735466cecf"
CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--disable-sync", "--disable-background-networking", "--disable-component-update",
                "--disable-default-apps", "--disable-extensions", "--hide-scrollbars", "--force-device-scale-factor=1",
                "--lang=en-US", "--window-size=1400,900"]


# ------------------------------------------------------------------ a small WebDriver client


class WebDriverError(Exception):
    pass


class Browser:
    """One Chromium session behind chromedriver (W3C WebDriver over HTTP)."""

    def __init__(self, driver: str, session: str, downloads: Path, shots: Path) -> None:
        self.base = f"{driver}/session/{session}"
        self.downloads = downloads
        self.shots = shots
        self.http = httpx.Client(timeout=60)

    def cmd(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        r = self.http.request(method, self.base + path, json=body if body is not None or method == "POST" else None)
        value = r.json().get("value")
        if r.status_code >= 400:
            raise WebDriverError(f"{value.get('error')}: {value.get('message', '')[:300]}")
        return value

    def open(self, url: str) -> None:
        self.cmd("POST", "/url", {"url": url})

    @property
    def url(self) -> str:
        return str(self.cmd("GET", "/url"))

    def find_all(self, css: str) -> list[str]:
        return [e[W3C_ELEMENT] for e in self.cmd("POST", "/elements", {"using": "css selector", "value": css})]

    def find(self, css: str, wait: float = 10.0) -> str:
        """The first element matching ``css``, waiting up to ``wait`` seconds for
        it (a click that submits a form returns before the next page is there)."""
        deadline = time.monotonic() + wait
        while not (found := self.find_all(css)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert found, f"no element matches {css!r} on {self.url}: {self.page_text()[:800]}"
        return found[0]

    def click(self, element: str) -> None:
        self.cmd("POST", f"/element/{element}/click", {})

    def text(self, element: str) -> str:
        return str(self.cmd("GET", f"/element/{element}/text"))

    def attr(self, element: str, name: str) -> str | None:
        value = self.cmd("GET", f"/element/{element}/attribute/{name}")
        return None if value is None else str(value)

    def prop(self, element: str, name: str) -> Any:
        return self.cmd("GET", f"/element/{element}/property/{name}")

    def script(self, js: str, *args: Any) -> Any:
        return self.cmd("POST", "/execute/sync", {"script": js, "args": list(args)})

    def page_text(self) -> str:
        return str(self.script("return document.body.innerText"))

    def alert(self) -> str | None:
        """The text of an open alert/confirm dialog, or None."""
        try:
            return str(self.cmd("GET", "/alert/text"))
        except WebDriverError as exc:
            if "no such alert" in str(exc):
                return None
            raise

    def screenshot(self, name: str, max_height: int = 6000, width: int = 1400) -> Path:
        """The page, down to ``max_height`` pixels (the window is stretched to the document's
        height), ``width`` wide (the window stays that wide), as ``<shots>/<name>.png``."""
        height = int(self.script("return document.documentElement.scrollHeight"))
        height = min(height, max_height)
        self.cmd("POST", "/window/rect", {"width": width, "height": max(height, 600)})
        png = base64.b64decode(self.cmd("GET", "/screenshot"))
        self.cmd("POST", "/window/rect", {"width": width, "height": 900})
        path = self.shots / f"{name}.png"
        path.write_bytes(png)
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, f"{name}: no real screenshot"
        return path

    def download(self, link: str) -> Path:
        """Click a download link and wait for the file it saves."""
        before = set(self.downloads.iterdir())
        self.click(link)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            new = [p for p in set(self.downloads.iterdir()) - before if not p.name.endswith(".crdownload")]
            if new:
                return new[0]
            time.sleep(0.1)
        raise AssertionError(f"clicking {self.attr(link, 'href')} saved no file")


def _executable(*names: str) -> str | None:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = os.environ.get("CKPTIER_SCREENSHOTS")
    path = Path(where) if where else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory, shots: Path) -> Iterator[Browser]:
    chromium = _executable("chromium", "chromium-browser")
    driver = _executable("chromedriver")
    if chromium is None or driver is None:
        unavailable("chromium and chromedriver are not installed (CI: apt-get install chromium chromium-driver)")
    assert chromium is not None and driver is not None
    port = free_port()
    root = tmp_path_factory.mktemp("chromium")
    log = open(root / "chromedriver.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([driver, f"--port={port}"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/status", timeout=2).json()["value"]["ready"]:
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                unavailable(f"chromedriver did not start: {(root / 'chromedriver.log').read_text()[-300:]}")
            time.sleep(0.2)
        downloads = root / "downloads"
        downloads.mkdir()
        caps = {"capabilities": {"alwaysMatch": {
            "browserName": "chrome", "unhandledPromptBehavior": "ignore",
            "goog:chromeOptions": {"binary": chromium, "args": [*CHROME_FLAGS, f"--user-data-dir={root / 'profile'}"],
                                   "prefs": {"download.default_directory": str(downloads),
                                             "download.prompt_for_download": False}},
        }}}
        r = httpx.post(url + "/session", json=caps, timeout=120)
        if r.status_code != 200:
            unavailable(f"chromium would not start under chromedriver: {r.text[:300]}")
        session = r.json()["value"]["sessionId"]
        b = Browser(url, session, downloads, shots)
        b.http.post(f"{url}/session/{session}/goog/cdp/execute",
                    json={"cmd": "Browser.setDownloadBehavior", "params": {"behavior": "allow", "downloadPath": str(downloads)}})
        try:
            yield b
        finally:
            b.http.delete(b.base)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
        log.close()


# ------------------------------------------------------------------ catalogs and dashboards


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The README's demo catalog: ``ckptier demo --no-prefect`` (300 steps, archive tier, one drill)."""
    from ckptier.flows.demo import run_demo

    base = tmp_path_factory.mktemp("demo")
    assert run_demo(base, steps=300, use_prefect=False) == 0
    return base


@pytest.fixture(scope="module")
def xss_dir(tmp_path_factory: pytest.TempPathFactory, demo_dir: Path) -> Path:
    """A catalog whose only job's directory is named like an HTML tag that runs script."""
    from ckptier.storage.catalog.api import Catalog
    from ckptier.tasks import pipeline
    from ckptier.tasks.run import Run

    base = tmp_path_factory.mktemp("xss")
    for step in ("step-00000225", "step-00000250", "step-00000275"):
        shutil.copytree(demo_dir / "hot" / "demo-run" / step, base / "hot" / XSS / step)
    with Catalog.open(f"sqlite:///{base / 'catalog.db'}") as cat:
        pipeline.run_scan(Run.of(cat), [str(base / "hot")])
        pipeline.run_verify(Run.of(cat))
        assert [c.job for c in cat.checkpoints()] == [XSS] * 3
    return base


@dataclass(frozen=True)
class Dashboard:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path


def _serve(root: Path, name: str, catalog: Path, config: Path | None, env: dict[str, str],
           args: tuple[str, ...] = ()) -> Dashboard:
    port = free_port()
    log = root / f"{name}.log"
    cmd = [sys.executable, "-m", "ckptier.flows.cli", "dashboard", "--catalog", f"sqlite:///{catalog}",
           "--port", str(port), *args]
    if config is not None:
        cmd += ["--config", str(config)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(url + "/static/style.css", timeout=2).raise_for_status()
            return Dashboard(url, proc, log)
        except httpx.HTTPError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"dashboard {name} did not start: {log.read_text()[-1000:]}") from None
            time.sleep(0.2)


def _stop(d: Dashboard) -> None:
    os.killpg(d.proc.pid, signal.SIGTERM)
    d.proc.wait(timeout=20)


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "CKPTIER_"))}
    env.update(PREFECT_HOME=str(home), DO_NOT_TRACK="1", **extra)
    return env


@pytest.fixture(scope="module")
def deployed(prefect_server: PrefectServer, demo_dir: Path) -> Iterator[dict[str, Any]]:
    """The deployments registered by ``ckptier deploy`` on the session's server, with the demo's Variables.

    Afterwards the Variables and every flow run the dashboard started are
    deleted (no worker may pick them up later in the session).
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import VariableCreate
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from ckptier.deployments import serve as dep

    old = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = prefect_server.api_url
    created: list[str] = []
    names = {"ckptier_scan_urls": [str(demo_dir / "hot")], "ckptier_catalog_url": f"sqlite:///{demo_dir / 'catalog.db'}",
             "ckptier_config_path": str(demo_dir / "ckptier.toml")}
    try:
        with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
            with get_client(sync_client=True) as client:
                for name, value in names.items():
                    if client.read_variable_by_name(name) is None:
                        client.create_variable(VariableCreate(name=name, value=value))
                        created.append(name)
            assert dep.deploy_all(automations=None, quiet=True) == 0
            with get_client(sync_client=True) as client:
                deployment = client.read_deployment_by_name("restore-drill/restore-drill")
            runs: list[str] = []
            yield {"server": prefect_server, "deployment_id": str(deployment.id), "runs": runs}
            with get_client(sync_client=True) as client:
                # Every run the dashboard started, also one a failed test did not get to record.
                started = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["ckptier-dashboard"])))
                for run in {*runs, *(str(r.id) for r in started)}:
                    client.delete_flow_run(UUID(run))
                for name in created:
                    client.delete_variable_by_name(name)
    finally:
        if old is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = old


@pytest.fixture(scope="module")
def demo_dashboard(tmp_path_factory: pytest.TempPathFactory, demo_dir: Path, deployed: dict[str, Any]) -> Iterator[Dashboard]:
    root = tmp_path_factory.mktemp("dash-demo")
    d = _serve(root, "demo", demo_dir / "catalog.db", demo_dir / "ckptier.toml",
               _env(root, PREFECT_API_URL=deployed["server"].api_url))
    yield d
    _stop(d)


# ------------------------------------------------------------------ the walkthrough


def _report(demo_dir: Path, table: str, fmt: str, job: str | None = None, step: str | None = None) -> str:
    args = ["report", "--catalog", f"sqlite:///{demo_dir / 'catalog.db'}", "--config", str(demo_dir / "ckptier.toml"),
            "--table", table, "--format", fmt]
    if job:
        args += ["--job", job]
    if step:
        args += ["--step", step]
    proc = subprocess.run([sys.executable, "-m", "ckptier.flows.cli", *args], capture_output=True, text=True, timeout=120,
                          env=_env(demo_dir))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _without_ages(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows minus what depends on the moment of the request (ages, and a stale alert's age)."""
    return [{k: v for k, v in r.items() if not k.endswith("_age_s") and k not in ("message", "reasons")} for r in rows]


def _open_overview(b: Browser, base: str) -> None:
    """Open the overview once tonight's plan and the cost chart, built in the background, are on it."""
    deadline = time.monotonic() + 60
    b.open(base + "/")
    while not (b.find_all("#t-tonight") and b.find_all("#cost-history svg")) and time.monotonic() < deadline:
        time.sleep(0.5)
        b.open(base + "/")


def _check_downloads(b: Browser, demo_dir: Path, page: str, checked: set[str]) -> list[str]:
    """Click every download link on the current page not in ``checked`` (which gains them); each
    file must be the table ``ckptier report`` prints."""
    seen = []
    for link in b.find_all("a.dl"):
        href = b.attr(link, "href") or ""
        query = dict(p.split("=", 1) for p in urlsplit(href).query.split("&") if "=" in p)
        job = unquote(query["job"]) if "job" in query else None
        step = query.get("step")
        if href in checked:  # the same table on an earlier page (each costs a 'ckptier report' process)
            continue
        checked.add(href)
        saved = b.download(link)
        table, fmt = Path(urlsplit(href).path).stem, Path(urlsplit(href).path).suffix[1:]
        text = saved.read_text()
        report = _report(demo_dir, table, fmt, job, step)
        if fmt == "json":
            got, want = json.loads(text), json.loads(report)[table]
        else:
            got, want = list(csv.DictReader(io.StringIO(text))), list(csv.DictReader(io.StringIO(report)))
        if table in ("storage", "cost_history"):  # their last row is the moment of the request
            got, want = got[:-1], want[:-1]
        assert got and _without_ages(got) == _without_ages(want), (page, href)
        seen.append(f"{table}.{fmt}")
        saved.unlink()
    return seen


@pytest.mark.prefect_server
def test_walkthrough_overview_job_checkpoint_downloads(browser: Browser, demo_dashboard: Dashboard, demo_dir: Path) -> None:
    b = browser
    _open_overview(b, demo_dashboard.url)
    assert b.alert() is None
    text = b.page_text()
    assert "JOBS" in text.upper() and "demo-run" in text and "SAVED VS KEEP-ALL" in text.upper()
    b.screenshot("overview")
    checked: set[str] = set()
    assert {"jobs.csv", "jobs.json", "tonight.csv", "cost_history.json"} <= set(
        _check_downloads(b, demo_dir, "overview", checked))

    b.click(b.find("#costs-link"))  # every job's costs, then the job's own
    assert b.url.endswith("/costs") and "Expected restore" in b.text(b.find("#t-costs"))
    assert {"costs.csv", "costs.json", "cost_tiers.csv", "cost_tiers.json"} <= set(_check_downloads(b, demo_dir, "costs", checked))
    b.click(b.find('#t-costs a[href="/jobs/demo-run"]'))
    assert b.url.endswith("/jobs/demo-run") and b.find_all("#t-cost_tiers tbody tr")
    costs = b.text(b.find("#costs"))
    assert "Expected restore" in costs and "Saved / month" in costs and "prices: list-price assumption" in costs
    b.open(demo_dashboard.url + "/")
    b.click(b.find('#t-jobs a[href="/jobs/demo-run"]'))
    assert b.url.endswith("/jobs/demo-run")
    assert b.text(b.find("#job-name")) == "demo-run"
    assert b.find_all('svg[aria-label="checkpoints by step"] rect.mark') and b.find_all('svg[aria-label="storage over time"] path.line')
    text = b.page_text()
    for heading in ("CHECKPOINTS BY STEP", "STORAGE OVER TIME", "RETENTION PLAN NOW", "RESTORE DRILLS", "VERIFICATION HISTORY", "EVENTS"):
        assert heading in text.upper()
    assert "recovery point 275" in text and "drill ok" in text
    b.screenshot("job", max_height=1800)
    got = set(_check_downloads(b, demo_dir, "job", checked))
    assert {"checkpoints.csv", "plan.json", "drills.csv", "storage.json", "events.csv", "costs.json", "cost_tiers.csv"} <= got

    b.click(b.find('#t-checkpoints a[href="/checkpoint?job=demo-run&step=275"]'))
    assert "step=275" in b.url
    fetch = b.text(b.find("#fetch-command"))
    assert fetch.startswith("ckptier fetch --catalog sqlite:///") and fetch.endswith("--job demo-run --step 275 ./demo-run-step-275")
    text = b.page_text()
    assert "rank-0000/model.pt" in text and "drilled" in text
    b.screenshot("checkpoint")
    assert {"files.csv", "copies.json"} <= set(_check_downloads(b, demo_dir, "checkpoint", checked))
    b.click(b.find("#job-link"))
    assert b.url.endswith("/jobs/demo-run")


@pytest.mark.prefect_server
def test_drill_button_starts_the_deployment_on_the_prefect_server(browser: Browser, demo_dashboard: Dashboard,
                                                                  deployed: dict[str, Any]) -> None:
    b = browser
    b.open(demo_dashboard.url + "/jobs/demo-run")
    button = b.find("#drill-button")
    assert b.prop(button, "disabled") is False, b.text(b.find("#drill-reason"))
    assert "starts deployment restore-drill/restore-drill" in b.text(b.find("#drill-reason"))
    b.click(button)
    banner = b.find("#drill-started")
    link = b.attr(b.find("#drill-started a"), "href") or ""
    run_id = link.rsplit("/", 1)[-1]
    deployed["runs"].append(run_id)
    assert "/jobs/demo-run?run=" in b.url and "Drill started: flow run" in b.text(banner)
    assert link == deployed["server"].ui_url + f"/runs/flow-run/{run_id}"
    run = httpx.get(f"{deployed['server'].api_url}/flow_runs/{run_id}", timeout=10).json()
    assert run["deployment_id"] == deployed["deployment_id"] and run["parameters"]["job"] == "demo-run"
    assert "step" not in run["parameters"] and "ckptier-dashboard" in run["tags"]
    assert run["state"]["type"] in ("SCHEDULED", "PENDING")
    b.screenshot("drill-started")
    # Reloading the result page starts nothing more; only the form does.
    b.open(b.url)
    listed = httpx.post(f"{deployed['server'].api_url}/flow_runs/filter", timeout=10,
                        json={"deployments": {"id": {"any_": [deployed["deployment_id"]]}},
                              "flow_runs": {"tags": {"all_": ["ckptier-dashboard"]}}}).json()
    assert run_id in [r["id"] for r in listed] and len(listed) == len(deployed["runs"])


@pytest.mark.prefect_server
def test_drill_button_of_a_checkpoint_drills_that_step(browser: Browser, demo_dashboard: Dashboard,
                                                       deployed: dict[str, Any]) -> None:
    b = browser
    b.open(demo_dashboard.url + "/checkpoint?job=demo-run&step=250")
    button = b.find("#drill-button")
    assert b.text(button) == "Run a drill now of step 250" and b.prop(button, "disabled") is False
    b.click(button)
    link = b.attr(b.find("#drill-started a"), "href") or ""
    run_id = link.rsplit("/", 1)[-1]
    deployed["runs"].append(run_id)
    assert "/checkpoint?job=demo-run&step=250&run=" in b.url
    run = httpx.get(f"{deployed['server'].api_url}/flow_runs/{run_id}", timeout=10).json()
    assert run["deployment_id"] == deployed["deployment_id"]
    assert (run["parameters"]["job"], run["parameters"]["step"]) == ("demo-run", 250)


def test_job_name_that_is_html_renders_as_text(browser: Browser, xss_dir: Path, tmp_path: Path) -> None:
    d = _serve(tmp_path, "xss", xss_dir / "catalog.db", None, _env(tmp_path))
    try:
        b = browser
        b.open(d.url + "/")
        assert b.alert() is None and b.script("return document.querySelectorAll('img').length") == 0
        link = b.find("#t-jobs td.job a")
        assert b.text(link) == XSS
        b.screenshot("escaping-overview")
        b.click(link)
        assert b.alert() is None and b.script("return document.querySelectorAll('img').length") == 0
        assert b.text(b.find("#job-name")) == XSS and XSS in b.script("return document.title")
        # No Prefect API here: the drill button is disabled and says why.
        assert b.prop(b.find("#drill-button"), "disabled") is True
        assert "disabled: no Prefect API is configured: set PREFECT_API_URL" in b.text(b.find("#drill-reason"))
        b.screenshot("escaping-job")
        b.click(b.find("#t-checkpoints td a"))
        assert b.alert() is None and b.script("return document.querySelectorAll('img').length") == 0
        assert f"--job '{XSS}'" in b.text(b.find("#fetch-command"))
        b.screenshot("escaping-checkpoint")
    finally:
        _stop(d)


def test_token_is_refused_then_accepted(browser: Browser, demo_dir: Path, tmp_path: Path) -> None:
    d = _serve(tmp_path, "token", demo_dir / "catalog.db", demo_dir / "ckptier.toml",
               _env(tmp_path, CKPTIER_DASHBOARD_TOKEN=TOKEN), args=("--host", "127.0.0.1"))
    try:
        b = browser
        b.open(d.url + "/jobs/demo-run")
        assert "Token required" in b.page_text() and "demo-run" not in b.page_text()
        b.screenshot("token-refused")
        b.open(d.url + "/jobs/demo-run?token=" + "x" * len(TOKEN))
        assert "Token required" in b.page_text()
        b.open(d.url + "/jobs/demo-run?token=" + TOKEN)
        assert b.url == d.url + "/jobs/demo-run"  # the token left the address bar
        assert b.text(b.find("#job-name")) == "demo-run"
        b.open(d.url + "/")  # the cookie carries it from now on
        assert "demo-run" in b.page_text()
        assert httpx.get(d.url + "/data/jobs.json", timeout=10).status_code == 401
        assert TOKEN not in d.log.read_text()
    finally:
        _stop(d)


# ------------------------------------------------------------------ a second catalog: the same job name, a long one

LONG = "run-" + "abcdefghij" * 9 + "-wxyz-"  # 100 characters
KEY_COLUMNS = ("Last drill", "Recovery point", "Newest save", "Alerts")


@pytest.fixture(scope="module")
def twin_dir(tmp_path_factory: pytest.TempPathFactory, demo_dir: Path) -> Path:
    """A copy of the demo catalog (its ``demo-run`` rows point at the demo's files) plus job ``LONG``."""
    from ckptier.storage.catalog.api import Catalog
    from ckptier.tasks import pipeline
    from ckptier.tasks.run import Run

    assert len(LONG) == 100
    base = tmp_path_factory.mktemp("twin")
    shutil.copy2(demo_dir / "catalog.db", base / "catalog.db")
    shutil.copy2(demo_dir / "ckptier.toml", base / "ckptier.toml")
    for step in ("step-00000250", "step-00000275"):
        shutil.copytree(demo_dir / "hot" / "demo-run" / step, base / "hot" / LONG / step)
    with Catalog.open(f"sqlite:///{base / 'catalog.db'}") as cat:
        pipeline.run_scan(Run.of(cat), [str(base / "hot")])
        pipeline.run_verify(Run.of(cat))
        assert sorted(cat.jobs()) == sorted(["demo-run", LONG])
    return base


@pytest.fixture(scope="module")
def twin_dashboard(tmp_path_factory: pytest.TempPathFactory, twin_dir: Path, deployed: dict[str, Any]) -> Iterator[Dashboard]:
    root = tmp_path_factory.mktemp("dash-twin")
    d = _serve(root, "twin", twin_dir / "catalog.db", twin_dir / "ckptier.toml",
               _env(root, PREFECT_API_URL=deployed["server"].api_url))
    yield d
    _stop(d)


def _drills(catalog: Path) -> int:
    from ckptier.storage.catalog.api import Catalog

    with Catalog.open(f"sqlite:///{catalog}") as cat:
        return len(cat.drills(job="demo-run"))


@pytest.mark.prefect_server
def test_drill_button_drills_the_catalog_on_screen(browser: Browser, twin_dashboard: Dashboard, twin_dir: Path,
                                                   demo_dir: Path, deployed: dict[str, Any]) -> None:
    """The deployment's Variables name the demo catalog; this dashboard shows its copy (same job name).
    The flow run gets the copy's catalog and config, and a drill run with them is recorded there."""
    b = browser
    b.open(twin_dashboard.url + "/jobs/demo-run")
    url, config = f"sqlite:///{twin_dir / 'catalog.db'}", str(twin_dir / "ckptier.toml")
    assert b.text(b.find("#drill-catalog")) == url and b.text(b.find("#drill-config")) == config
    assert "The drill reads and records in catalog" in b.text(b.find("#drill-target"))
    b.click(b.find("#drill-button"))
    link = b.attr(b.find("#drill-started a"), "href") or ""
    run_id = link.rsplit("/", 1)[-1]
    deployed["runs"].append(run_id)
    b.screenshot("drill-catalog", max_height=900)
    params = httpx.get(f"{deployed['server'].api_url}/flow_runs/{run_id}", timeout=10).json()["parameters"]
    assert params == {"job": "demo-run", "catalog_url": url, "config_path": config}
    # What a worker does with them (the flow opens the run from the same two settings as the command line):
    before = {"demo": _drills(demo_dir / "catalog.db"), "twin": _drills(twin_dir / "catalog.db")}
    proc = subprocess.run([sys.executable, "-m", "ckptier.flows.cli", "drill", "--catalog", params["catalog_url"],
                           "--config", params["config_path"], "--job", params["job"], "--steps", "2"],
                          capture_output=True, text=True, timeout=300, env=_env(twin_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _drills(twin_dir / "catalog.db") == before["twin"] + 1 and _drills(demo_dir / "catalog.db") == before["demo"]


def _rects(b: Browser, selector: str) -> list[dict[str, Any]]:
    return list(b.script("return Array.from(document.querySelectorAll(arguments[0])).map(e => {"
                         "const r = e.getBoundingClientRect(); return {text: e.innerText.trim(), left: r.left, "
                         "right: r.right, width: r.width, title: e.getAttribute('title')}; })", selector))


@pytest.mark.prefect_server
def test_a_100_character_job_name_pushes_no_column_off_screen(browser: Browser, twin_dashboard: Dashboard) -> None:
    b = browser
    b.cmd("POST", "/window/rect", {"width": 1366, "height": 900})
    try:
        b.open(twin_dashboard.url + "/")
        inner = float(b.script("return window.innerWidth"))
        heads = {h["text"].split("\n")[0]: h for h in _rects(b, "#t-jobs thead th")}
        for name in KEY_COLUMNS:
            assert 0 <= heads[name]["left"] and heads[name]["right"] <= inner, (name, heads[name], inner)
        (cell,) = [c for c in _rects(b, "#t-jobs td.job") if c["title"] == LONG]
        assert cell["right"] <= heads["Checkpoints"]["left"] + 1 and cell["width"] <= 0.2 * inner  # cut, not widened
        assert b.script("return document.documentElement.scrollWidth") <= inner
        wrap = b.script("const w = document.querySelector('#t-jobs').parentElement; return [w.scrollWidth, w.clientWidth]")
        assert wrap[0] <= wrap[1], wrap  # nothing to scroll sideways to
        b.screenshot("long-job-name-overview", max_height=1400, width=1366)
        b.open(twin_dashboard.url + "/costs")
        heads = {" ".join(h["text"].split()): h for h in _rects(b, "#t-costs thead th")}
        off = [(k, h["left"], h["right"]) for k, h in heads.items() if not (0 <= h["left"] and h["right"] <= inner)]
        widths = b.script("return [document.documentElement.scrollWidth, document.querySelector('main').scrollWidth, "
                          "document.querySelector('#t-costs').parentElement.clientWidth]")
        assert "Saved / month" in heads and not off, (off, inner, widths)
        assert any(c["title"] == LONG for c in _rects(b, "#t-costs td.job"))
        b.screenshot("long-job-name-costs", max_height=1400, width=1366)
    finally:
        b.cmd("POST", "/window/rect", {"width": 1400, "height": 900})


@pytest.mark.prefect_server
def test_job_page_pages_through_its_checkpoints(browser: Browser, twin_dashboard: Dashboard) -> None:
    b = browser
    b.open(twin_dashboard.url + "/jobs/demo-run?per=10")
    pager = b.text(b.find("#pager-checkpoints"))
    total = int(pager.split(" of ")[1].split(" ")[0])
    assert total > 10 and pager.startswith(f"rows 1–10 of {total} · page 1 of 2"), pager
    first = [int(b.text(e).replace(",", "")) for e in b.find_all("#t-checkpoints tbody td:first-child")]
    assert len(first) == 10 and first == sorted(first, reverse=True)
    b.click(b.find("#pager-checkpoints a.page-next"))
    assert "page=2" in b.url and "per=10" in b.url and b.url.endswith("#checkpoints")
    second = [int(b.text(e).replace(",", "")) for e in b.find_all("#t-checkpoints tbody td:first-child")]
    assert len(second) == total - 10 and max(second) < min(first)
    assert b.text(b.find("#pager-checkpoints")).startswith(f"rows 11–{total} of {total} · page 2 of 2")
    b.screenshot("job-pagination", max_height=2400)
    b.click(b.find("#pager-checkpoints a.page-first"))
    assert "page=1" in b.url and [int(b.text(e).replace(",", "")) for e in
                                  b.find_all("#t-checkpoints tbody td:first-child")] == first
    assert b.find_all('svg[aria-label="checkpoints by step"] rect.mark')


@pytest.mark.prefect_server
def test_overview_shows_tonights_plan_and_the_cost_chart(browser: Browser, twin_dashboard: Dashboard,
                                                         twin_dir: Path) -> None:
    b = browser
    _open_overview(b, twin_dashboard.url)
    summary = b.text(b.find("#tonight-summary"))
    assert "The next tiering run" in summary and "would promote" in summary and "if it ran now" in summary
    plan = json.loads(_report(twin_dir, "tonight", "json"))["tonight"]  # the table 'ckptier report' prints
    shown = b.script("return Array.from(document.querySelectorAll('#t-tonight tbody tr')).map(r => "
                     "[r.cells[0].title, r.cells[1].innerText, r.cells[3].innerText])")
    assert sorted(shown) == sorted([p["job"], f"{p['promote']:,}", f"{p['delete']:,}"] for p in plan)
    assert {p["job"] for p in plan} == {"demo-run", LONG}
    assert b.find_all('svg[aria-label="cost over time"] path.line')
    b.screenshot("overview-tonight", max_height=1600)
    b.click(b.find("#costs-link"))
    assert b.find_all('#cost-history svg[aria-label="cost over time"] path.line')
    b.screenshot("costs-chart", max_height=1600)
