"""Starting the ``restore-drill`` deployment through the Prefect REST API.

Plain HTTP (httpx), so the dashboard never imports Prefect. The API URL is
given by the command line (``PREFECT_API_URL`` or the active Prefect
profile); ``PREFECT_API_KEY`` (Prefect Cloud) or ``PREFECT_API_AUTH_STRING``
(a self-hosted server behind basic auth) are sent when set.
"""

from __future__ import annotations

import base64
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx

from .security import redact

#: The deployment the drill button starts (``flow name/deployment name``), as ``ckptier deploy`` registers it.
DRILL_DEPLOYMENT = "restore-drill/restore-drill"
#: Seconds an availability answer is reused (pages render without waiting on the API each time).
STATUS_TTL_S = 15.0
TIMEOUT_S = 5.0


class DrillError(Exception):
    """The drill could not be started; the message says why, in one line."""


@dataclass(frozen=True)
class DrillStatus:
    """Whether the drill button works, and if not, why."""

    enabled: bool
    reason: str
    deployment_id: str | None = None


@dataclass(frozen=True)
class FlowRun:
    """A flow run as the dashboard links to it."""

    id: str
    name: str
    state: str
    url: str


def ui_url(api_url: str, environ: Mapping[str, str] | None = None) -> str:
    """The Prefect UI's base URL for an API URL: ``PREFECT_UI_URL`` when set;
    Prefect Cloud's ``api.prefect.cloud/api/accounts/A/workspaces/W`` →
    ``app.prefect.cloud/account/A/workspace/W``; otherwise the API URL
    without its trailing ``/api``."""
    env = os.environ if environ is None else environ
    if env.get("PREFECT_UI_URL"):
        return env["PREFECT_UI_URL"].rstrip("/")
    url = api_url.rstrip("/")
    if "api.prefect.cloud/api/accounts/" in url:
        return url.replace("api.prefect.cloud/api/accounts/", "app.prefect.cloud/account/").replace(
            "/workspaces/", "/workspace/")
    return url.removesuffix("/api")


def _headers(environ: Mapping[str, str]) -> dict[str, str]:
    if environ.get("PREFECT_API_KEY"):
        return {"Authorization": f"Bearer {environ['PREFECT_API_KEY']}"}
    if environ.get("PREFECT_API_AUTH_STRING"):
        return {"Authorization": "Basic " + base64.b64encode(environ["PREFECT_API_AUTH_STRING"].encode()).decode()}
    return {}


class PrefectDrills:
    """The drill button's link to Prefect. Thread-safe; availability is cached for :data:`STATUS_TTL_S`."""

    def __init__(self, api_url: str | None, *, environ: Mapping[str, str] | None = None,
                 deployment: str = DRILL_DEPLOYMENT, transport: httpx.BaseTransport | None = None) -> None:
        """``transport``: how requests travel (None: the network; tests hand an
        :class:`httpx.MockTransport` that plays a Prefect API)."""
        env = dict(os.environ if environ is None else environ)
        self.api_url = api_url.rstrip("/") if api_url else None
        self.ui_url = ui_url(self.api_url, env) if self.api_url else None
        self.deployment = deployment
        self._headers = _headers(env)
        self._transport = transport
        self._lock = threading.Lock()
        self._cached: tuple[float, DrillStatus] | None = None

    def _client(self) -> httpx.Client:
        assert self.api_url is not None
        return httpx.Client(base_url=self.api_url, headers=self._headers, timeout=TIMEOUT_S, transport=self._transport)

    def status(self, *, fresh: bool = False) -> DrillStatus:
        """Can a drill be started now? Never raises."""
        if self.api_url is None:
            return DrillStatus(False, "no Prefect API is configured: set PREFECT_API_URL (or 'prefect config set "
                                      "PREFECT_API_URL=…') and run 'ckptier deploy', then restart the dashboard")
        with self._lock:
            if not fresh and self._cached and time.monotonic() - self._cached[0] < STATUS_TTL_S:
                return self._cached[1]
        status = self._probe()
        with self._lock:
            self._cached = (time.monotonic(), status)
        return status

    def _probe(self) -> DrillStatus:
        shown = redact(self.api_url)
        flow, _, name = self.deployment.partition("/")
        try:
            with self._client() as client:
                r = client.get(f"/deployments/name/{quote(flow, safe='')}/{quote(name, safe='')}")
        except httpx.HTTPError as exc:
            return DrillStatus(False, f"the Prefect API at {shown} does not answer ({type(exc).__name__}): start "
                                      "'prefect server start' or fix PREFECT_API_URL")
        if r.status_code == 404:
            return DrillStatus(False, f"deployment {self.deployment} is not registered at {shown}: run 'ckptier deploy'")
        if r.status_code in (401, 403):
            return DrillStatus(False, f"the Prefect API at {shown} refused the request ({r.status_code}): "
                                      "check PREFECT_API_KEY / PREFECT_API_AUTH_STRING")
        if r.status_code != 200:
            return DrillStatus(False, f"the Prefect API at {shown} answered {r.status_code} for deployment "
                                      f"{self.deployment}")
        data = r.json()
        if data.get("paused"):
            return DrillStatus(False, f"deployment {self.deployment} is paused: resume it in the Prefect UI",
                               str(data.get("id")))
        return DrillStatus(True, f"starts deployment {self.deployment} on {shown}", str(data["id"]))

    def start(self, *, job: str, step: int | None, catalog_url: str | None = None, config_path: str | None = None,
              idempotency_key: str | None = None) -> FlowRun:
        """Create a flow run of the drill deployment for ``job`` (and ``step``); raises :class:`DrillError`.

        ``catalog_url`` and ``config_path``, when given, become the run's
        ``catalog_url`` / ``config_path`` parameters, which outrank the
        deployment's own (its Variables): the drill reads and records in
        that catalog, not in whichever one the deployment names.
        """
        status = self.status(fresh=True)
        if not status.enabled or status.deployment_id is None:
            raise DrillError(status.reason)
        parameters: dict[str, Any] = {"job": job}
        if step is not None:
            parameters["step"] = step
        if catalog_url is not None:
            parameters["catalog_url"] = catalog_url
        if config_path is not None:
            parameters["config_path"] = config_path
        body: dict[str, Any] = {"parameters": parameters, "state": {"type": "SCHEDULED", "name": "Scheduled"},
                                "tags": ["ckptier-dashboard"]}
        if idempotency_key:
            body["idempotency_key"] = idempotency_key
        try:
            with self._client() as client:
                r = client.post(f"/deployments/{status.deployment_id}/create_flow_run", json=body)
        except httpx.HTTPError as exc:
            raise DrillError(f"the Prefect API at {redact(self.api_url)} does not answer ({type(exc).__name__})") from exc
        if r.status_code not in (200, 201):
            detail = r.text.strip().replace("\n", " ")[:300]
            raise DrillError(f"the Prefect API refused the drill run ({r.status_code}): {detail}")
        return self._flow_run(r.json())

    def flow_run(self, run_id: str) -> FlowRun | None:
        """The flow run ``run_id``, or None when it cannot be read."""
        if self.api_url is None:
            return None
        try:
            with self._client() as client:
                r = client.get(f"/flow_runs/{quote(run_id, safe='')}")
        except httpx.HTTPError:
            return None
        return self._flow_run(r.json()) if r.status_code == 200 else None

    def _flow_run(self, data: Mapping[str, Any]) -> FlowRun:
        run_id = str(data["id"])
        state = data.get("state") or {}
        return FlowRun(id=run_id, name=str(data.get("name") or run_id), state=str(state.get("name") or "?"),
                       url=f"{self.ui_url}/runs/flow-run/{run_id}")
