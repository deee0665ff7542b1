"""The dashboard's web application (FastAPI, Jinja2 templates, no JavaScript).

Routes:

==============================  ===============================================
``GET /``                       overview: every job, alerts
``GET /jobs/{job}``             a job: step chart, storage over time, costs,
                                plan, drills, verifications, events
``GET /costs``                  every job's costs (read from every checkpoint
                                row, so not on the overview, which stays an
                                aggregate)
``GET /checkpoint?job=&step=``  a checkpoint: files, copies, drills, events,
                                the ``ckptier fetch`` command
``GET /data/{table}.{csv|json}``  any table of :data:`tables.TABLES`
                                (``?job=``, ``?step=`` as the table needs)
``POST /drill``                 start the ``restore-drill`` deployment
                                (CSRF-protected form) and go to the job page
``GET /static/style.css``       the stylesheet
==============================  ===============================================

Every response carries a strict Content-Security-Policy (no scripts at
all, styles only from ``/static``). With a token, every route but
``/static`` needs it: an ``Authorization: Bearer`` header, or the
``ckptier_token`` cookie set by opening any page once with ``?token=…``.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import shlex
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode

import pandas as pd
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, select_autoescape

from ckptier import __version__
from ckptier.storage.errors import CkptierError
from ckptier.storage.records import HELD_COPY_STATES, CopyState

from . import background, charts, params, security
from .alerts import format_age
from .params import BadParam
from .format import display, human_bytes, missing, python_rows, to_csv, to_json
from .prefect_api import DrillError, PrefectDrills
from .source import Source
from .tables import TABLES, Snapshot, TableError
from .views import TableView, checkpoint_url, data_url, job_url, page_href, table_view

log = logging.getLogger("ckptier.dashboard")

HERE = Path(__file__).resolve().parent
#: The paginated tables of a job page and the query parameter of each one's page.
JOB_PAGERS = {"checkpoints": "page", "plan": "plan_page", "drills": "drills_page",
              "verifications": "verifications_page", "events": "events_page"}
#: Rows of the recent drills and events drawn on the overview.
OVERVIEW_ROWS = 12
CSP = ("default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; "
       "frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # "no-referrer" makes browsers send "Origin: null" on our own form posts
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


def _templates() -> Environment:
    env = Environment(loader=FileSystemLoader(str(HERE / "templates")),
                      autoescape=select_autoescape(default=True, default_for_string=True), trim_blocks=True,
                      lstrip_blocks=True)
    env.globals.update(job_url=job_url, checkpoint_url=checkpoint_url, data_url=data_url, human_bytes=human_bytes,
                       display=display, version=__version__)
    return env


def create_app(source: Source, *, token: str | None = None, prefect: PrefectDrills | None = None,
               clock: Callable[[], datetime] = utcnow, background_wait: float = background.WAIT_S) -> FastAPI:
    """The dashboard over ``source``. ``token``: required of every request
    when set; ``prefect``: the drill button's API link (None: disabled);
    ``clock``: aware UTC now; ``background_wait``: seconds a page waits for
    the background tables (tonight's plan, cost over time) being built
    (``app.state.background``, a :class:`~.background.Background`)."""
    app = FastAPI(title="ckptier dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    slow = background.Background(source, clock)
    app.state.background = slow
    env = _templates()
    drills = prefect or PrefectDrills(None)
    css = (HERE / "static" / "style.css").read_bytes()
    env.globals["css_version"] = hashlib.sha256(css).hexdigest()[:12]  # a new stylesheet is never served from cache
    on_screen = drill_target(source)
    env.globals["drill_target"] = on_screen

    def page(request: Request, template: str, status: int = 200, **ctx: Any) -> HTMLResponse:
        csrf = request.cookies.get(security.CSRF_COOKIE) or security.new_csrf()
        body = env.get_template(template).render(
            catalog_url=source.url, now=ctx.pop("now", None) or clock(), csrf=csrf, nonce=secrets.token_urlsafe(12),
            format_age=format_age, **ctx)
        response = HTMLResponse(body, status_code=status)
        if request.cookies.get(security.CSRF_COOKIE) != csrf:
            response.set_cookie(security.CSRF_COOKIE, csrf, httponly=True, samesite="strict", path="/")
        return response

    def error(request: Request, status: int, title: str, message: str) -> HTMLResponse:
        return page(request, "error.html", status=status, title=title, message=message)

    @app.exception_handler(BadParam)
    def bad_param(request: Request, exc: BadParam) -> Response:
        if request.url.path.startswith("/data/"):
            return PlainTextResponse(str(exc), status_code=400)
        return error(request, 400, "Bad request", str(exc))

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if token is not None and not request.url.path.startswith("/static/"):
            given = request.query_params.get("token")
            if given is not None and request.method == "GET":
                if not security.token_ok(given, token):
                    return _refused()
                rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
                target = request.url.path + ("?" + urlencode(rest) if rest else "")
                response: Response = RedirectResponse(target, status_code=303)
                response.set_cookie(security.TOKEN_COOKIE, token, httponly=True, samesite="strict", path="/")
                return _secure(response)
            auth = request.headers.get("authorization", "")
            bearer = auth[len("Bearer "):] if auth.startswith("Bearer ") else None
            if not (security.token_ok(bearer, token) or security.token_ok(request.cookies.get(security.TOKEN_COOKIE), token)):
                return _refused()
        try:
            response = await call_next(request)
        except Exception:  # noqa: BLE001 - one line to the log, a plain page to the browser
            log.exception("dashboard request %s failed", request.url.path)
            response = PlainTextResponse("internal error: see the dashboard's log", status_code=500)
        return _secure(response)

    @app.get("/static/style.css")
    def stylesheet() -> Response:
        return Response(css, media_type="text/css", headers={"Cache-Control": "max-age=300"})

    @app.get("/", response_class=HTMLResponse)
    def overview(request: Request) -> Response:
        now = clock()
        snap = Snapshot(source, now=now)
        try:
            jobs = snap.table("jobs")
            alerts = snap.table("alerts")
        except CkptierError as exc:
            return error(request, 500, "Cannot read the catalog", str(exc))
        totals = _totals(jobs)
        return page(request, "overview.html", now=now, jobs=python_rows(jobs), totals=totals,
                    **_background(slow.get(background_wait)),
                    jobs_view=table_view(TABLES["jobs"], jobs),
                    alerts=table_view(TABLES["alerts"], alerts, columns=["severity", "job", "kind", "steps", "message"]),
                    drills=table_view(TABLES["drills"], snap.table("drills"), limit=OVERVIEW_ROWS,
                                      columns=["started_at", "job", "step", "ok", "seconds", "tier", "summary"]),
                    events=table_view(TABLES["events"], snap.table("events"), limit=OVERVIEW_ROWS,
                                      columns=["at", "job", "step", "kind", "message"]))

    @app.get("/costs", response_class=HTMLResponse)
    def costs_page(request: Request) -> Response:
        now = clock()
        return page(request, "costs.html", now=now, **_costs(Snapshot(source, now=now)),
                    **_background(slow.get(background_wait)))

    @app.get("/jobs/{job:path}", response_class=HTMLResponse)
    def job_page(request: Request, job: str, run: str | None = None) -> Response:
        query = dict(request.query_params)
        per = params.int_param("per", query.get("per"), params.PER, default=params.PAGE_SIZE)
        assert per is not None
        pages = {name: params.int_param(param, query.get(param), params.PAGE, default=1)
                 for name, param in JOB_PAGERS.items()}
        now = clock()
        snap = Snapshot(source, now=now, job=job)
        try:
            row = python_rows(snap.table("jobs"))[0]
        except TableError as exc:
            return error(request, 404, "No such job", str(exc))
        cks = snap.table("checkpoints")
        storage = snap.table("storage")
        policy = source.config.policy_for(job)
        plan = snap.plan
        recovery = row.get("recovery_step")
        milestones = [int(s) for s in cks.loc[cks["milestone"].astype(bool), "step"]]  # the policy's, per row
        step_svg = charts.step_chart(_marks(cks, job), milestones=milestones, recovery_step=recovery)
        # Columns handed over whole (times as one index, values as Python ints): no Timestamp per point.
        storage_svg = charts.time_chart(pd.DatetimeIndex(storage["at"]), [
            charts.Series("tier-hot", "hot", storage["hot_bytes"].tolist()),
            charts.Series("tier-archive", "archive stored", storage["archive_stored_bytes"].tolist(), fill=True),
            charts.Series("tier-archive-logical", "archive logical", storage["archive_logical_bytes"].tolist()),
        ])
        newest_first = cks.sort_values("step", ascending=False)

        def paged(name: str, df: pd.DataFrame, columns: list[str]) -> TableView:
            param = JOB_PAGERS[name]
            page_no = pages[name] or 1
            return table_view(TABLES[name], df, job=job, columns=columns, param=param,
                              paging=(page_no, per, page_href(job_url(job), query, param, name)))

        return page(
            request, "job.html", now=now, job=job, row=row, hot_url=security.redact(_hot_url(snap)),
            policy=str(policy) if policy is not None else None, refused=(plan.refused_jobs.get(job) if plan else None),
            alerts=table_view(TABLES["alerts"], snap.table("alerts"), job=job, columns=["severity", "kind", "steps", "message"]),
            step_svg=step_svg, storage_svg=storage_svg, storage_now=python_rows(storage.tail(1))[-1] if len(storage) else None,
            checkpoints=paged("checkpoints", newest_first, ["step", "state", "proof", "last_drill", "bytes", "hot", "archive",
                                                            "archive_stored_bytes", "milestone", "saved_at", "verified_at",
                                                            "reason"]),
            plan=paged("plan", snap.table("plan"), ["step", "state", "action", "bytes", "reasons"]),
            drills=paged("drills", snap.table("drills"),
                         ["started_at", "step", "ok", "seconds", "device", "tier", "first_loss", "summary"]),
            verifications=paged("verifications", snap.table("verifications"), ["at", "step", "kind", "message"]),
            events=paged("events", snap.table("events"), ["at", "step", "kind", "message"]),
            drill=drills.status(), run=drills.flow_run(run) if run else None, run_id=run, drill_step=None,
            storage_view=table_view(TABLES["storage"], storage, job=job, limit=0), **_costs(snap, job=job),
        )

    @app.get("/checkpoint", response_class=HTMLResponse)
    def checkpoint_page(request: Request, job: str | None = None, step: str | None = None,
                        run: str | None = None) -> Response:
        if not job:
            raise BadParam("job is missing: open a checkpoint as /checkpoint?job=J&step=N")
        step = params.required_int("step", step, params.STEP)
        now = clock()
        snap = Snapshot(source, now=now, job=job, step=step)
        try:
            record = snap.record
            row = python_rows(snap.table("checkpoints"))[0]
        except TableError as exc:
            return error(request, 404, "No such checkpoint", str(exc))
        return page(
            request, "checkpoint.html", now=now, job=job, step=step, row=row, record=record,
            location=security.redact(record.location), fetch=_fetch_command(source, job, step),
            files=table_view(TABLES["files"], snap.table("files"), job=job, step=step),
            copies=table_view(TABLES["copies"], snap.table("copies"), job=job, step=step),
            drills=table_view(TABLES["drills"], snap.table("drills"), job=job, step=step,
                              columns=["started_at", "ok", "seconds", "device", "tier", "first_loss", "summary"]),
            events=table_view(TABLES["events"], snap.table("events"), job=job, step=step,
                              columns=["at", "kind", "message"]),
            plan=table_view(TABLES["plan"], snap.table("plan"), job=job, step=step, columns=["action", "reasons"]),
            drill=drills.status(), run=drills.flow_run(run) if run else None, run_id=run, drill_step=step,
        )

    @app.get("/data/{name}.{fmt}")
    def download(request: Request, name: str, fmt: str, job: str | None = None, step: str | None = None) -> Response:
        step = params.int_param("step", step, params.STEP)
        if fmt not in ("csv", "json"):
            return PlainTextResponse(f"format {fmt!r} is not offered: use .csv or .json", status_code=404)
        snap = Snapshot(source, now=clock(), job=job, step=step)
        try:
            df = snap.table(name)
        except TableError as exc:
            return PlainTextResponse(str(exc), status_code=404)
        stem = "-".join(["ckptier", name, *([_slug(job)] if job else []), *([str(step)] if step is not None else [])])
        if fmt == "csv":
            return Response(to_csv(df), media_type="text/csv; charset=utf-8",
                            headers={"Content-Disposition": f'attachment; filename="{stem}.csv"'})
        return Response(to_json(df), media_type="application/json",
                        headers={"Content-Disposition": f'attachment; filename="{stem}.json"'})

    @app.post("/drill")
    async def start_drill(request: Request) -> Response:
        form = {k: v[0] for k, v in parse_qs((await request.body()).decode("utf-8", "replace")).items()}
        why = security.csrf_ok(request.cookies.get(security.CSRF_COOKIE), form.get(security.CSRF_FIELD),
                               origin=request.headers.get("origin"), host=request.headers.get("host"),
                               fetch_site=request.headers.get("sec-fetch-site"))
        if why is not None:
            return error(request, 403, "Drill refused", f"refused to start a drill: {why}")
        job = form.get("job", "")
        if not job:
            return error(request, 400, "Drill refused", "the drill form needs a job")
        try:
            step = params.int_param("step", form.get("step"), params.STEP)
        except BadParam as exc:
            return error(request, 400, "Drill refused", f"refused to start a drill: {exc}")
        try:
            run = drills.start(job=job, step=step, catalog_url=on_screen.catalog_url,
                               config_path=on_screen.config_path,
                               idempotency_key=form.get("nonce") or None)
        except DrillError as exc:
            return error(request, 503, "Drill not started", str(exc))
        target = checkpoint_url(job, step) + "&" if step is not None else job_url(job) + "?"
        return RedirectResponse(target + urlencode({"run": run.id}) + "#drill", status_code=303)

    return app


_REFUSED = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Token required · ckptier</title>
<link rel="stylesheet" href="/static/style.css"></head>
<body><header class="top"><span class="brand">ckptier</span><nav class="crumbs"><span>token required</span></nav></header>
<main><section class="error"><h1>Token required</h1>
<p>This dashboard needs its access token. Open it once with <code>?token=…</code> added to the address
(the token given to <code>ckptier dashboard --token</code> or <code>CKPTIER_DASHBOARD_TOKEN</code>): the browser then
keeps it in a cookie. Scripts send <code>Authorization: Bearer …</code>.</p></section></main></body></html>"""


def _refused() -> Response:
    """The answer without a valid token: says how to get in, tells nothing about the catalog."""
    return _secure(HTMLResponse(_REFUSED, status_code=401, headers={"WWW-Authenticate": "Bearer"}))


def _secure(response: Response) -> Response:
    for k, v in SECURITY_HEADERS.items():
        response.headers.setdefault(k, v)
    return response


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:80]


def _totals(jobs: pd.DataFrame) -> dict[str, Any]:
    keep_all = int(jobs["keep_all_bytes"].sum())
    stored = int(jobs["hot_bytes"].sum() + jobs["archive_stored_bytes"].sum())
    return {
        "jobs": len(jobs),
        "live": int(jobs["checkpoints"].sum()),
        "drilled": int(jobs["drilled"].sum()),
        "verified": int(jobs["verified"].sum()),
        "committed": int(jobs["committed"].sum()),
        "corrupt": int(jobs["corrupt"].sum()),
        "hot_bytes": int(jobs["hot_bytes"].sum()),
        "archive_stored_bytes": int(jobs["archive_stored_bytes"].sum()),
        "archive_logical_bytes": int(jobs["archive_logical_bytes"].sum()),
        "keep_all_bytes": keep_all,
        "saved_bytes": keep_all - stored,
        "saved_fraction": (keep_all - stored) / keep_all if keep_all else None,
        "alerts": int(jobs["alerts"].sum()),
    }


#: Columns of the cost table the pages draw (the downloads carry every column).
COST_COLUMNS = ["job", "stored_bytes", "monthly_cost", "hot_monthly_cost", "archive_monthly_cost", "keep_all_bytes",
                "keep_all_monthly_cost", "savings_monthly", "savings_fraction", "recovery_step", "recovery_age_s",
                "restore_tier", "restore_throughput_bytes_per_s", "restore_seconds", "restore_cost"]


def _costs(snap: Snapshot, *, job: str | None = None) -> dict[str, Any]:
    """The cost tables as the templates draw them: ``costs`` and ``cost_tiers`` views, the
    price notes, or ``costs_error`` (one line) when they cannot be priced."""
    try:
        costs, tiers = snap.table("costs"), snap.table("cost_tiers")
    except CkptierError as exc:
        return {"costs": None, "cost_tiers": None, "price_notes": [], "currency": "", "costs_error": str(exc)}
    columns = COST_COLUMNS[1:] if job else COST_COLUMNS
    return {
        "costs": table_view(TABLES["costs"], costs, job=job, columns=columns),
        "cost_tiers": table_view(TABLES["cost_tiers"], tiers, job=job,
                                 columns=["tier", "storage_class", "checkpoints", "bytes", "monthly_cost"] if job else
                                 ["job", "tier", "storage_class", "checkpoints", "bytes", "monthly_cost"]),
        "price_notes": list(dict.fromkeys(costs["price_note"])),
        "currency": ", ".join(sorted(set(costs["currency"]))),
        "costs_error": None,
    }


@dataclass(frozen=True)
class DrillTarget:
    """What the drill button hands the flow run, so that it drills the catalog on screen.

    ``catalog_url``: :attr:`Source.run_url` (absolute SQLite path, no
    password); ``config_path``: the dashboard's ``ckptier.toml``, absolute
    (None: the worker's own); ``password_withheld``: the catalog URL had a
    password, which the worker must supply itself.
    """

    catalog_url: str
    config_path: str | None
    password_withheld: bool


def drill_target(source: Source) -> DrillTarget:
    cfg = source.config.source
    return DrillTarget(catalog_url=source.run_url, config_path=str(cfg) if cfg is not None else None,
                       password_withheld=bool(source.engine.url.password))


def _background(built: background.Built | None) -> dict[str, Any]:
    """What the overview and costs pages draw from the background tables: ``tonight`` (a table
    view), ``tonight_totals``, ``cost_svg``, ``background`` (the build, None while the first runs)
    and ``background_errors``."""
    out: dict[str, Any] = {"background": built, "tonight": None, "tonight_totals": None, "cost_svg": None,
                           "cost_view": None, "cost_now": None, "background_errors": dict(built.errors) if built else {}}
    if built is None:
        return out
    tonight = built.tables.get("tonight")
    if tonight is not None:
        out["tonight"] = table_view(TABLES["tonight"], tonight, columns=[
            "job", "promote", "promote_bytes", "delete", "delete_bytes", "freed_bytes", "hot_bytes", "hot_bytes_after",
            "note"])
        out["tonight_totals"] = {k: int(tonight[k].sum()) for k in
                                 ("promote", "promote_bytes", "delete", "delete_bytes", "freed_bytes", "hot_bytes")}
    history = built.tables.get("cost_history")
    if history is not None:
        out["cost_view"] = table_view(TABLES["cost_history"], history, limit=0)
        out["cost_now"] = float(history["monthly_cost"].iloc[-1]) if len(history) else None
        out["cost_svg"] = charts.time_chart(list(history["at"]), [
            charts.Series("tier-hot", "hot", list(history["hot_monthly_cost"])),
            charts.Series("tier-archive", "archive", list(history["archive_monthly_cost"]), fill=True),
            charts.Series("cost-total", "total", list(history["monthly_cost"])),
        ], fmt=lambda v: display(v, "money"), label="cost over time", height=180)
    return out


def _hot_url(snap: Snapshot) -> str | None:
    urls = snap.jobs["hot_url"].dropna()
    return str(urls.iloc[0]) if len(urls) else None


def _marks(cks: pd.DataFrame, job: str) -> list[charts.Mark]:
    """The step-chart marks of a job's checkpoints table: one per tier holding a checkpoint, or a tombstone."""
    base = checkpoint_url(job, 0).removesuffix("0")  # every step's link is this plus the step
    out = []
    for step, state, proof, hot, archive, missing_since in zip(
            *(cks[c].tolist() for c in ("step", "state", "proof", "hot", "archive", "missing_since")), strict=True):
        step, state = int(step), str(state)
        cls = proof if proof == "drilled" else state
        href = f"{base}{step}"
        text = f"step {step:,}: {state}" + (f", {proof}" if proof and proof != state else "")
        held = False
        for t, copy in (("hot", hot), ("archive", archive)):
            if copy not in HELD_COPY_STATES:
                continue
            held = True
            gone = t == "hot" and not missing(missing_since)
            copy_cls = "degraded" if copy == CopyState.DEGRADED else ("missing" if gone else cls)
            out.append(charts.Mark(step, t, copy_cls, f"{text}; {t} copy {copy}", href))
        if not held:
            out.append(charts.Mark(step, "deleted" if state == "deleted" else "hot",
                                   "deleted" if state == "deleted" else "missing", f"{text}; no copy holds it", href))
    return out


def _fetch_command(source: Source, job: str, step: int) -> str:
    """The exact ``ckptier fetch`` command that restores this checkpoint (no password in it)."""
    parts = ["ckptier", "fetch"]
    if source.engine.url.password:
        note = "  # set CKPTIER_CATALOG_URL to this catalog (its password is not shown here)"
    else:
        parts += ["--catalog", source.url]
        note = ""
    cfg = getattr(source.config, "source", None)
    if cfg is not None:
        parts += ["--config", str(Path(cfg).resolve())]
    dest = f"./{_slug(job)}-step-{step}"
    return shlex.join([*parts, "--job", job, "--step", str(step), dest]) + note
