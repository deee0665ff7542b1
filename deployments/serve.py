"""Register ckptier's deployments, schedules, work pools and alerts with Prefect.

``deployments/prefect.yaml`` is the one definition; ``ckptier deploy``
(:func:`deploy_all`) registers it to work pools, ``ckptier serve``
(:func:`serve_all`) serves it from this process under names of its own
(``<name>-served``), so the two never replace or pause each other's. Both are
idempotent: running them again updates everything in place.

Schedules are reconciled by slug, never replaced wholesale: Prefect's own
redeploy drops *every* schedule of a deployment when one of them has no slug
(as schedules made in the UI do not), so the deployment update here never
sends schedules, and :func:`plan_schedule_changes` decides which ``ckptier-``
slugged schedules to create, update or delete. A schedule without that slug
prefix is the user's and is never touched.

Decisions (parsing the YAML, resolving Variables, planning schedule
changes, naming concurrency limits) are pure functions; the functions that
talk to the API are thin.
"""

from __future__ import annotations

import importlib
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml

from ckptier.storage.errors import ConfigError

PREFECT_YAML = Path(__file__).with_name("prefect.yaml")
AUTOMATIONS_YAML = Path(__file__).with_name("automations.yaml")

#: Work pool names as written in prefect.yaml; ``deploy_all`` maps them to the pools it is given.
PROCESS_POOL = "ckptier-process"
GPU_POOL = "ckptier-gpu"
#: Runs at a time per pool (None: unlimited). One drill per GPU pool.
POOL_CONCURRENCY: dict[str, int | None] = {PROCESS_POOL: None, GPU_POOL: 1}
#: ``ckptier serve`` registers each deployment under its own name plus this suffix, so that
#: serving never replaces (and, when it stops, never pauses) what ``ckptier deploy`` registered.
SERVED_SUFFIX = "-served"
#: Schedules whose slug starts with this belong to prefect.yaml; all others belong to users.
SLUG_PREFIX = "ckptier-"
#: Prefect Variables named in prefect.yaml (documentation and tests).
VARIABLES = ("ckptier_scan_urls", "ckptier_catalog_url", "ckptier_config_path")
#: The optional prefect-aws ``aws-credentials`` block read by :func:`aws_credentials_from_block`.
AWS_BLOCK_ENV = "CKPTIER_AWS_CREDENTIALS_BLOCK"
DEFAULT_AWS_BLOCK = "ckptier"

#: What a worker's flow-run process does before loading the flow: nothing but the optional credentials.
PULL_STEPS: list[dict[str, Any]] = [{"ckptier.deployments.serve.aws_credentials_from_block": {}}]

_VARIABLE = re.compile(r"^\{\{\s*prefect\.variables\.([A-Za-z0-9_\-]+)\s*\}\}$")
_SLUG = re.compile(r"^[a-z0-9][a-z0-9\-]*$")


# ------------------------------------------------------------------ definitions (pure)


@dataclass(frozen=True)
class ScheduleSpec:
    """One YAML-owned schedule: exactly one of ``cron`` / ``interval_seconds``."""

    slug: str
    cron: str | None = None
    interval_seconds: float | None = None
    timezone: str = "UTC"
    active: bool = True
    parameters: Mapping[str, Any] = field(default_factory=dict)

    def to_prefect(self) -> Any:
        """The Prefect schedule object (``CronSchedule`` or ``IntervalSchedule``)."""
        from prefect.client.schemas.schedules import CronSchedule, IntervalSchedule

        if self.cron is not None:
            return CronSchedule(cron=self.cron, timezone=self.timezone)
        assert self.interval_seconds is not None
        return IntervalSchedule(interval=timedelta(seconds=self.interval_seconds), timezone=self.timezone)


@dataclass(frozen=True)
class DeploymentSpec:
    """One deployment of prefect.yaml. ``parameters`` may hold ``{{ prefect.variables.X }}`` placeholders."""

    name: str
    entrypoint: str
    work_pool: str
    description: str = ""
    tags: tuple[str, ...] = ()
    parameters: Mapping[str, Any] = field(default_factory=dict)
    schedules: tuple[ScheduleSpec, ...] = ()
    concurrency_limit: int | None = None

    @property
    def module(self) -> str:
        """``flows/drill.py:restore_drill_flow`` → ``ckptier.flows.drill``."""
        path = self.entrypoint.split(":", 1)[0]
        return "ckptier." + path.removesuffix(".py").replace("/", ".")

    @property
    def attribute(self) -> str:
        return self.entrypoint.split(":", 1)[1]


def _fail(where: str, message: str) -> ConfigError:
    return ConfigError(f"{where}: {message}")


def parse_schedule(raw: Any, where: str) -> ScheduleSpec:
    """One entry of a deployment's ``schedules`` list; raises a one-line ConfigError."""
    if not isinstance(raw, dict):
        raise _fail(where, f"expected a table, got {raw!r}")
    unknown = set(raw) - {"slug", "cron", "interval", "timezone", "active", "parameters"}
    if unknown:
        raise _fail(where, f"unknown key(s) {sorted(unknown)}; allowed: slug, cron, interval, timezone, active, parameters")
    slug = raw.get("slug")
    if not isinstance(slug, str) or not slug.startswith(SLUG_PREFIX) or not _SLUG.match(slug):
        raise _fail(where, f"slug={slug!r}: every YAML schedule needs a slug starting with {SLUG_PREFIX!r} "
                           "(lowercase letters, digits, '-') so redeploys update it in place")
    cron, interval = raw.get("cron"), raw.get("interval")
    if (cron is None) == (interval is None):
        raise _fail(where, f"schedule {slug!r} needs exactly one of cron or interval (seconds)")
    if cron is not None:
        from prefect._internal.schemas.validators import validate_cron_string

        try:
            validate_cron_string(str(cron))
        except ValueError as exc:
            raise _fail(where, f"schedule {slug!r}: cron={cron!r} is not valid ({exc}); e.g. '0 2 * * *'") from None
    if interval is not None and (not isinstance(interval, int | float) or isinstance(interval, bool) or interval <= 0):
        raise _fail(where, f"schedule {slug!r}: interval={interval!r} must be a positive number of seconds")
    timezone = raw.get("timezone", "UTC")
    try:
        from zoneinfo import ZoneInfo

        ZoneInfo(str(timezone))
    except Exception:  # noqa: BLE001 - any failure means "not a zone"
        raise _fail(where, f"schedule {slug!r}: timezone={timezone!r} is not an IANA zone; e.g. 'UTC', 'Europe/Berlin'") from None
    params = raw.get("parameters") or {}
    if not isinstance(params, dict):
        raise _fail(where, f"schedule {slug!r}: parameters must be a table, got {params!r}")
    return ScheduleSpec(slug=slug, cron=None if cron is None else str(cron),
                        interval_seconds=None if interval is None else float(interval), timezone=str(timezone),
                        active=bool(raw.get("active", True)), parameters=dict(params))


def parse_prefect_yaml(text: str, source: str = "prefect.yaml") -> list[DeploymentSpec]:
    """The deployments of a prefect.yaml document, validated; one-line ConfigError on bad input.

    Slugs must be unique across the file (one owner per schedule)."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise _fail(source, f"not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("deployments"), list) or not doc["deployments"]:
        raise _fail(source, "needs a non-empty 'deployments' list")
    specs: list[DeploymentSpec] = []
    seen_slugs: set[str] = set()
    for i, raw in enumerate(doc["deployments"]):
        where = f"{source}: deployments[{i}]"
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not raw["name"]:
            raise _fail(where, "needs a 'name'")
        where = f"{source}: deployment {raw['name']!r}"
        entrypoint = raw.get("entrypoint")
        if not isinstance(entrypoint, str) or not re.match(r"^[\w/]+\.py:\w+$", entrypoint):
            raise _fail(where, f"entrypoint={entrypoint!r}: expected 'flows/<module>.py:<flow function>'")
        pool = (raw.get("work_pool") or {}).get("name")
        if not isinstance(pool, str) or not pool:
            raise _fail(where, "needs work_pool.name (ckptier-process or ckptier-gpu)")
        params = raw.get("parameters") or {}
        if not isinstance(params, dict):
            raise _fail(where, f"parameters must be a table, got {params!r}")
        schedules = tuple(parse_schedule(s, f"{where}: schedules[{j}]") for j, s in enumerate(raw.get("schedules") or []))
        for s in schedules:
            if s.slug in seen_slugs:
                raise _fail(where, f"schedule slug {s.slug!r} is used twice; slugs must be unique in the file")
            seen_slugs.add(s.slug)
        limit = raw.get("concurrency_limit")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise _fail(where, f"concurrency_limit={limit!r} must be a positive integer")
        specs.append(DeploymentSpec(
            name=raw["name"], entrypoint=entrypoint, work_pool=pool, description=" ".join(str(raw.get("description") or "").split()),
            tags=tuple(str(t) for t in raw.get("tags") or ()), parameters=dict(params), schedules=schedules,
            concurrency_limit=limit,
        ))
    return specs


def load_specs(path: Path = PREFECT_YAML) -> list[DeploymentSpec]:
    """Read and validate prefect.yaml (default: the one shipped in ``ckptier.deployments``)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror}); reinstall ckptier or pass an existing prefect.yaml") from None
    return parse_prefect_yaml(text, str(path.name))


def variable_names(params: Mapping[str, Any]) -> dict[str, str]:
    """Parameter name → Prefect Variable name, for values that are exactly ``{{ prefect.variables.X }}``."""
    out: dict[str, str] = {}
    for key, value in params.items():
        m = _VARIABLE.match(value.strip()) if isinstance(value, str) else None
        if m:
            out[key] = m.group(1)
    return out


def resolve_parameters(params: Mapping[str, Any], variables: Mapping[str, Any]) -> dict[str, Any]:
    """Replace each ``{{ prefect.variables.X }}`` value with Variable X's value.

    A Variable that is unset (absent, None or "") drops the parameter, so the
    flow's own default applies. Other values pass through unchanged."""
    refs = variable_names(params)
    out: dict[str, Any] = {}
    for key, value in params.items():
        if key in refs:
            resolved = variables.get(refs[key])
            if resolved is None or resolved == "":
                continue
            out[key] = resolved
        else:
            out[key] = value
    return out


@dataclass(frozen=True)
class ExistingSchedule:
    """A schedule as the API returns it (only what reconciliation needs)."""

    id: Any
    slug: str | None


@dataclass(frozen=True)
class ScheduleChanges:
    """What to do to a deployment's schedules: create and update by slug, delete by id."""

    create: tuple[ScheduleSpec, ...]
    update: tuple[tuple[Any, ScheduleSpec], ...]
    delete: tuple[Any, ...]


def plan_schedule_changes(existing: Sequence[ExistingSchedule], wanted: Sequence[ScheduleSpec]) -> ScheduleChanges:
    """Bring the YAML-owned schedules in line with ``wanted``; never touch the user's.

    Existing schedules whose slug is in ``wanted`` are updated in place; wanted
    slugs not present are created; existing schedules with a ``ckptier-`` slug
    that is no longer wanted are deleted. Schedules with no slug or another
    prefix (made in the UI or by hand) are left alone. Idempotent."""
    by_slug = {s.slug: s for s in existing if s.slug}
    wanted_slugs = {w.slug for w in wanted}
    return ScheduleChanges(
        create=tuple(w for w in wanted if w.slug not in by_slug),
        update=tuple((by_slug[w.slug].id, w) for w in wanted if w.slug in by_slug),
        delete=tuple(s.id for s in existing if s.slug and s.slug.startswith(SLUG_PREFIX) and s.slug not in wanted_slugs),
    )


def served_name(spec: DeploymentSpec) -> str:
    """The name ``ckptier serve`` gives ``spec``'s deployment: ``scan-verify`` → ``scan-verify-served``."""
    return spec.name + SERVED_SUFFIX


def pool_for(spec: DeploymentSpec, *, work_pool: str, gpu_pool: str) -> str:
    """The pool this deployment goes to once the YAML's pool names are replaced by the chosen ones."""
    return {PROCESS_POOL: work_pool, GPU_POOL: gpu_pool}.get(spec.work_pool, spec.work_pool)


def pool_limits(work_pool: str, gpu_pool: str) -> dict[str, int | None]:
    """Concurrency limit of each pool to create or update (the GPU pool: 1 drill at a time)."""
    limits = {work_pool: POOL_CONCURRENCY[PROCESS_POOL]}
    limits[gpu_pool] = POOL_CONCURRENCY[GPU_POOL]  # a shared pool gets the stricter limit
    return limits


# ------------------------------------------------------------------ talking to the API (thin)


def check_api() -> str:
    """The Prefect API URL from Prefect's own settings, or a one-line ConfigError naming ``PREFECT_API_URL``."""
    from prefect.settings import PREFECT_API_URL

    from ckptier.tasks.prefect_api import check_prefect_api

    return check_prefect_api(PREFECT_API_URL.value() or "", direct=None)  # deploy and serve need the API


def read_variables(client: Any, names: Sequence[str]) -> dict[str, Any]:
    """Values of the named Prefect Variables that exist."""
    out: dict[str, Any] = {}
    for name in names:
        var = client.read_variable_by_name(name)
        if var is not None:
            out[name] = var.value
    return out


def load_flow(spec: DeploymentSpec) -> Any:
    """The flow object an entrypoint names, imported from the installed ``ckptier`` package."""
    try:
        return getattr(importlib.import_module(spec.module), spec.attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"deployment {spec.name!r}: entrypoint {spec.entrypoint!r} does not load ({exc}); "
                          "fix prefect.yaml or reinstall ckptier") from None


def job_variables_for(spec: DeploymentSpec, pool: str | None) -> dict[str, Any]:
    """The work pool job variables of ``spec``'s deployment on ``pool``: on the GPU pool (the
    YAML's ``ckptier-gpu``, whatever it is named), ``CKPTIER_GPU_POOL`` in the flow-run
    process's environment, so that a drill there expects a GPU; nothing elsewhere. Pure."""
    from ckptier.tasks.drill_inputs import GPU_POOL_ENV

    return {"env": {GPU_POOL_ENV: pool}} if pool is not None and spec.work_pool == GPU_POOL else {}


def build_deployment(spec: DeploymentSpec, parameters: Mapping[str, Any], *, work_pool: str | None,
                     concurrency_limit: int | None = None, name: str | None = None) -> Any:
    """A ``RunnerDeployment`` (named ``name``, default the spec's) whose update leaves
    schedules alone (they are reconciled by slug); on the GPU pool with :func:`job_variables_for`."""
    from prefect.types.entrypoint import EntrypointType

    flow = load_flow(spec)
    required = [k for k, v in flow.parameters.properties.items() if k in (flow.parameters.required or [])]
    missing = [k for k in required if k not in parameters]
    if missing:
        refs = variable_names(spec.parameters)
        hints = ", ".join(f"{k} (set the Prefect Variable {refs[k]!r}, e.g. prefect variable set {refs[k]} "
                          f"'[\"/data/checkpoints\"]')" if k in refs else k for k in missing)
        raise ConfigError(f"deployment {spec.name!r}: required parameter(s) without a value: {hints}")
    dep = flow.to_deployment(
        name=name or spec.name, parameters=dict(parameters), description=spec.description or None, tags=list(spec.tags),
        concurrency_limit=concurrency_limit if concurrency_limit is not None else spec.concurrency_limit,
        paused=False, enforce_parameter_schema=True, work_pool_name=work_pool,
        job_variables=job_variables_for(spec, work_pool) or None, entrypoint_type=EntrypointType.MODULE_PATH,
    )
    # from_flow marks ``schedules=[]`` as set, and an update that carries a schedules list makes
    # the server drop every schedule when any lacks a slug (UI-made ones do). Unset it so the
    # update omits schedules; reconcile_schedules then manages ours by slug.
    dep.__pydantic_fields_set__.discard("schedules")
    return dep


def reconcile_schedules(client: Any, deployment_id: Any, wanted: Sequence[ScheduleSpec]) -> ScheduleChanges:
    """Apply :func:`plan_schedule_changes` to one deployment; returns what was done."""
    from prefect.client.schemas.actions import DeploymentScheduleCreate

    existing = [ExistingSchedule(id=s.id, slug=s.slug) for s in client.read_deployment_schedules(deployment_id)]
    changes = plan_schedule_changes(existing, wanted)
    for schedule_id, w in changes.update:
        client.update_deployment_schedule(deployment_id, schedule_id, active=w.active, schedule=w.to_prefect(),
                                          parameters=dict(w.parameters))
    if changes.create:
        client.create_deployment_schedules(deployment_id, [
            DeploymentScheduleCreate(schedule=w.to_prefect(), active=w.active, parameters=dict(w.parameters), slug=w.slug)
            for w in changes.create])
    for schedule_id in changes.delete:
        client.delete_deployment_schedule(deployment_id, schedule_id)
    return changes


def ensure_work_pools(client: Any, limits: Mapping[str, int | None]) -> None:
    """Create each process work pool that is missing; set its concurrency limit. Idempotent."""
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    for name, limit in limits.items():
        try:
            pool = client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type="process", concurrency_limit=limit,
                                                   description="ckptier: " + ("restore drills" if limit == 1 else "scan, verify, tiering")))
            continue
        if pool.concurrency_limit != limit:
            client.update_work_pool(name, WorkPoolUpdate(concurrency_limit=limit))


def load_automations(path: Path = AUTOMATIONS_YAML) -> list[dict[str, Any]]:
    """The automation definitions (each with ``notify_block``), validated as Prefect automations."""
    from prefect.events.schemas.automations import AutomationCore

    doc = yaml.safe_load(path.read_text())
    out: list[dict[str, Any]] = []
    for raw in doc.get("automations") or []:
        block = raw.get("notify_block")
        if not block:
            raise ConfigError(f"{path.name}: automation {raw.get('name')!r} needs notify_block (a notification block name)")
        body = {k: v for k, v in raw.items() if k != "notify_block"}
        placeholder = "00000000-0000-0000-0000-000000000000"
        AutomationCore.model_validate(with_block(body, placeholder))  # shape check before anything is sent
        out.append(raw)
    return out


def with_block(automation: Mapping[str, Any], block_document_id: str) -> dict[str, Any]:
    """The automation with every send-notification / call-webhook action pointed at the block."""
    body = {k: v for k, v in automation.items() if k != "notify_block"}
    body["actions"] = [dict(a, block_document_id=block_document_id) if a.get("type") in ("send-notification", "call-webhook")
                       else dict(a) for a in automation.get("actions") or []]
    return body


def apply_automations(client: Any, path: Path = AUTOMATIONS_YAML) -> list[str]:
    """Create or update (by name) each automation whose notification block exists.

    Returns one line per automation saying what happened; a missing block is
    reported, not an error (alerts are optional)."""
    from prefect.events.schemas.automations import AutomationCore

    lines: list[str] = []
    for raw in load_automations(path):
        docs = [d for d in client.read_block_documents(include_secrets=False)
                if d.name == raw["notify_block"] and not d.is_anonymous]
        if not docs:
            lines.append(f"automation {raw['name']}: skipped, no notification block named {raw['notify_block']!r} "
                         "(create one: prefect block create slack-webhook)")
            continue
        automation = AutomationCore.model_validate(with_block(raw, str(docs[0].id)))
        existing = client.read_automations_by_name(raw["name"])
        if existing:
            client.update_automation(existing[0].id, automation)
            lines.append(f"automation {raw['name']}: updated")
        else:
            client.create_automation(automation)
            lines.append(f"automation {raw['name']}: created")
    return lines


def _deploy(specs: Sequence[DeploymentSpec], *, work_pool: str | None, gpu_pool: str | None,
            serve: bool) -> list[tuple[Any, Any, DeploymentSpec]]:
    """Build each deployment with resolved parameters; returns (RunnerDeployment, pool, spec)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        variables = read_variables(client, sorted({v for s in specs for v in variable_names(s.parameters).values()}))
    out = []
    for spec in specs:
        pool = None if serve else pool_for(spec, work_pool=work_pool or PROCESS_POOL, gpu_pool=gpu_pool or GPU_POOL)
        # Serving is one host: one drill at a time there too (deployment limit instead of a pool limit).
        limit = 1 if serve and spec.work_pool == GPU_POOL else None
        out.append((build_deployment(spec, resolve_parameters(spec.parameters, variables), work_pool=pool,
                                     concurrency_limit=limit, name=served_name(spec) if serve else spec.name),
                    pool, spec))
    return out


def deploy_all(work_pool: str = PROCESS_POOL, gpu_pool: str = GPU_POOL, *, path: Path = PREFECT_YAML,
               automations: Path | None = AUTOMATIONS_YAML, quiet: bool = False) -> int:
    """Register every deployment of prefect.yaml to its work pool; returns the exit code (0).

    Creates the pools when missing (process type; the GPU pool limited to one
    run at a time), applies each deployment, reconciles its schedules by slug,
    and creates/updates the alert automations. Idempotent."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate

    check_api()
    specs = load_specs(path)
    built = _deploy(specs, work_pool=work_pool, gpu_pool=gpu_pool, serve=False)
    with get_client(sync_client=True) as client:
        ensure_work_pools(client, pool_limits(work_pool, gpu_pool))
    for dep, pool, spec in built:
        deployment_id = dep.apply()
        with get_client(sync_client=True) as client:
            client.update_deployment(deployment_id, DeploymentUpdate(pull_steps=PULL_STEPS))
            changes = reconcile_schedules(client, deployment_id, spec.schedules)
        if not quiet:
            print(f"deployment {dep.flow_name}/{spec.name} -> work pool {pool}: {len(changes.create)} schedule(s) created, "
                  f"{len(changes.update)} updated, {len(changes.delete)} removed")
    if automations is not None:
        with get_client(sync_client=True) as client:
            for line in apply_automations(client, automations):
                quiet or print(line)
    if not quiet:
        print(f"start workers: prefect worker start --pool {work_pool}   and   prefect worker start --pool {gpu_pool}")
    return 0


def serve_all(*, path: Path = PREFECT_YAML, automations: Path | None = AUTOMATIONS_YAML) -> int:
    """Serve every deployment with its schedules from this process until SIGTERM or SIGINT (single host).

    The served deployments are named ``<name>-served`` (``tiering/tiering-served``...), apart from
    the ones ``ckptier deploy`` registers for workers, which serving never touches. Runs execute
    as subprocesses of this one; at most one drill at a time. However serving stops (a signal
    while it starts, while it waits, or a second Ctrl-C), the served deployments end up paused:
    their schedules stop until ``ckptier serve`` runs again. Returns 0."""
    import asyncio
    import signal

    from prefect.client.orchestration import get_client
    from prefect.runner import Runner

    check_api()
    specs = load_specs(path)
    built = _deploy(specs, work_pool=None, gpu_pool=None, serve=True)
    runner = Runner(name="ckptier", pause_on_shutdown=True)
    served: list[Any] = []

    def stop(*_: Any) -> None:
        # Once running: stop polling, cancel what runs, pause (and return from start). Before: SystemExit.
        # Ctrl-C goes the same way: as a KeyboardInterrupt it would cancel the runner's pause too.
        runner.handle_sigterm()

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for dep, _pool, spec in built:
            deployment_id = runner.add_deployment(dep)
            served.append(deployment_id)
            with get_client(sync_client=True) as client:
                reconcile_schedules(client, deployment_id, spec.schedules)
            print(f"serving {dep.flow_name}/{dep.name}: " + ", ".join(s.slug for s in spec.schedules), flush=True)
        if automations is not None:
            with get_client(sync_client=True) as client:
                for line in apply_automations(client, automations):
                    print(line, flush=True)
        print("waiting for scheduled and triggered runs; stop with Ctrl-C or SIGTERM", flush=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            asyncio.run(runner.start())
    except (KeyboardInterrupt, SystemExit):
        pass  # stopped before the runner ran, or a second Ctrl-C
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        with get_client(sync_client=True) as client:
            for deployment_id in served:  # idempotent: the runner pauses them too when it got to run
                client.pause_deployment(deployment_id)
    print("stopped serving; the served deployments are paused until 'ckptier serve' runs again", flush=True)
    return 0


# ------------------------------------------------------------------ credentials (pull step)


def aws_credentials_from_block(block: str | None = None) -> dict[str, Any]:
    """Prefect pull step: export an ``aws-credentials`` block's values to this process's environment.

    Optional: S3 credentials normally come from the environment or a boto3
    profile. When the block (``$CKPTIER_AWS_CREDENTIALS_BLOCK``, default
    ``ckptier``) exists, its key id, secret, session token, region and
    endpoint become the standard ``AWS_*`` variables of the flow-run process
    only; values are never logged or returned. Variables already set win.
    Returns ``{"aws_credentials": <names set>}`` (for the pull step's output)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    name = block or os.environ.get(AWS_BLOCK_ENV) or DEFAULT_AWS_BLOCK
    try:
        with get_client(sync_client=True) as client:
            doc = client.read_block_document_by_name(name, block_type_slug="aws-credentials", include_secrets=True)
    except ObjectNotFound:
        return {"aws_credentials": []}
    return {"aws_credentials": export_aws_env(dict(doc.data), os.environ)}


def export_aws_env(data: Mapping[str, Any], environ: Any) -> list[str]:
    """Set ``AWS_*`` variables in ``environ`` from block data; returns the names set (never values)."""
    params = data.get("aws_client_parameters") or {}
    mapping = {
        "AWS_ACCESS_KEY_ID": data.get("aws_access_key_id"),
        "AWS_SECRET_ACCESS_KEY": data.get("aws_secret_access_key"),
        "AWS_SESSION_TOKEN": data.get("aws_session_token"),
        "AWS_DEFAULT_REGION": data.get("region_name"),
        "AWS_PROFILE": data.get("profile_name"),
        "AWS_ENDPOINT_URL": params.get("endpoint_url") if isinstance(params, dict) else None,
    }
    set_names = []
    for key, value in mapping.items():
        if value and not environ.get(key):
            environ[key] = value.get_secret_value() if hasattr(value, "get_secret_value") else str(value)
            set_names.append(key)
    return set_names
