"""Run an operation directly, or as a Prefect flow run when an API is configured.

Starting Prefect's temporary local API costs ~10 s per process,
so the command line runs the task code directly unless ``PREFECT_API_URL``
is set; then it goes through the flow so the run shows in the UI. Both paths
return the same JSON-ready report.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from ckptier.storage.errors import CkptierError, ConfigError

from .output import Progress



def configured_api_url(environ: Mapping[str, str] | None = None) -> str | None:
    """The Prefect API URL from ``PREFECT_API_URL``, else from the active Prefect profile.

    Reads ``$PREFECT_HOME/profiles.toml`` (default ``~/.prefect``) directly,
    honouring ``PREFECT_PROFILE``, so that commands need not import Prefect
    (about a second) just to learn whether an API is configured.
    """
    env = os.environ if environ is None else environ
    if env.get("PREFECT_API_URL"):
        return env["PREFECT_API_URL"]
    import tomllib

    home = Path(env.get("PREFECT_HOME") or Path(env.get("HOME", "~")).expanduser() / ".prefect")
    profiles_path = Path(env.get("PREFECT_PROFILES_PATH") or home / "profiles.toml")
    try:
        data = tomllib.loads(profiles_path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return None
    active = env.get("PREFECT_PROFILE") or data.get("active")
    profile = data.get("profiles", {}).get(active, {}) if isinstance(active, str) else {}
    url = profile.get("PREFECT_API_URL") if isinstance(profile, dict) else None
    return url if isinstance(url, str) and url else None


def check_prefect_api(url: str | None = None, *, direct: str | None = "pass --no-prefect to run directly") -> str:
    """``url`` (default: the configured Prefect API URL) if it answers; otherwise
    a one-line error naming ``PREFECT_API_URL`` and, when the command has a
    way to run without Prefect, ``direct`` (None: it has none)."""
    import httpx

    url = url or configured_api_url()
    if not url:
        raise ConfigError("PREFECT_API_URL is not set; start 'prefect server start' and run "
                          "'prefect config set PREFECT_API_URL=http://127.0.0.1:4200/api'")
    try:
        response = httpx.get(url.rstrip("/") + "/health", timeout=5.0)
        response.raise_for_status()
    except (httpx.HTTPError, ValueError) as exc:
        fixes = ["start 'prefect server start' (and wait until it answers)",
                 "fix PREFECT_API_URL (environment or 'prefect config set')", *([direct] if direct else [])]
        raise ConfigError(f"PREFECT_API_URL={url!r} does not answer ({type(exc).__name__}); "
                          + ", ".join(fixes[:-1]) + ", or " + fixes[-1]) from None
    return url


def run_flow(flow: Any, **params: Any) -> Any:
    """Call a Prefect flow and unwrap its result; a failed run raises a one-line error."""
    check_prefect_api()
    state = flow(**params, return_state=True)
    if state.is_completed():
        return state.result()
    try:
        state.result()
    except CkptierError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported as one line
        raise FlowFailed(f"flow run {flow.name!r} ended {state.name}: {exc}") from exc
    raise FlowFailed(f"flow run {flow.name!r} ended {state.name}")


class FlowFailed(CkptierError):
    """A Prefect flow run did not complete."""


def _open(catalog_url: str | None, *, create: bool = False) -> Any:
    """The catalog at ``catalog_url`` (None: the default); only ``scan`` creates one."""
    from ckptier.storage.catalog.api import Catalog

    return Catalog.open(catalog_url, create=create)


def resolve_sample(sample: str | None, now: datetime | None = None) -> tuple[int, int] | None:
    """``"K/N"`` → (K, N); ``"auto/N"`` → the slice of N for ``now``'s UTC date
    (every byte re-read every N nights); None → None. One-line
    :class:`ConfigError` otherwise."""
    from ckptier.tasks.verify import parse_sample, rotating_slice

    if not sample:
        return None
    head, sep, tail = sample.strip().partition("/")
    if sep and head.strip().lower() == "auto":
        if not tail.strip().isdigit() or int(tail) < 1:
            raise ConfigError(f"--sample {sample!r}: N must be a whole number ≥ 1, e.g. auto/7")
        n = int(tail)
        return rotating_slice((now or datetime.now(UTC)).date(), n), n
    return parse_sample(sample)


def why_nothing_to_verify(catalog_url: str, *, job: str | None, deep: bool, sample: tuple[int, int] | None) -> str:
    """Words for a verify run that checked nothing (the catalog is only read)."""
    with _open(catalog_url) as cat:
        records = cat.checkpoints(job=job, with_files=False)
    if not records:
        return "the catalog holds no checkpoints yet; run 'ckptier scan URL' first"
    if sample is not None:
        return f"slice {sample[0]}/{sample[1]} holds none of the {len(records)} cataloged checkpoints"
    if deep:
        return f"none of the {len(records)} cataloged checkpoints has a copy to read (states: " + \
            ", ".join(sorted({c.state.value for c in records})) + ")"
    waiting = sum(1 for c in records if c.state.value == "incomplete")
    return (f"every one of the {len(records)} cataloged checkpoints is already verified or still being written"
            + (f" ({waiting} incomplete)" if waiting else "") + "; --deep re-reads every byte")


def scan(urls: list[str], *, catalog_url: str | None, use_prefect: bool, progress: bool = True,
         config_path: str | None = None, inventory: str | None = None, full: bool = False) -> list[dict[str, Any]]:
    if inventory is not None and len(urls) != 1:
        from ckptier.storage.errors import ConfigError

        raise ConfigError(f"--inventory {inventory} names the report of one bucket; scan one s3:// URL with it, "
                          f"not {len(urls)}")
    if use_prefect:
        from .scan_verify import scan_flow

        return list(run_flow(scan_flow, urls=urls, catalog_url=catalog_url, config_path=config_path,
                             inventory=inventory, full=full))
    from ckptier.tasks.config import load_config
    from ckptier.tasks.pipeline import run_scan, utcnow

    config = load_config(config_path)
    bar = Progress("listing", unit="objects", enabled=None if progress else False)
    try:
        with _open(catalog_url, create=True) as cat:
            return run_scan(urls, cat, now=utcnow, tick=bar.update, patterns=config.patterns, config=config,
                            inventories=[(urls[0], inventory)] if inventory else (), full=full)
    finally:
        bar.close()


def verify(*, job: str | None, deep: bool, sample: tuple[int, int] | None, workers: int,
           catalog_url: str | None, use_prefect: bool, progress: bool = True, config_path: str | None = None,
           runner: str | None = None, claim_rows: bool = False, since: str | None = None) -> dict[str, Any]:
    if use_prefect:
        from .scan_verify import CorruptionFound, verify_flow

        fanned = {"config_path": config_path, "runner": runner, "sweep_since": since} if config_path or runner or since else {}
        try:
            return dict(run_flow(verify_flow, job=job, deep=deep, sample=f"{sample[0]}/{sample[1]}" if sample else None,
                                 workers=workers, catalog_url=catalog_url, **fanned))
        except CorruptionFound:
            # The run failed because corruption was found: report it like the direct path.
            with _open(catalog_url) as cat:
                from ckptier.storage.model import State

                corrupt = cat.checkpoints(job=job, states=[State.CORRUPT])
            return {"checkpoints": [{"job": c.job, "step": c.step, "state": "corrupt", "bytes_read": 0,
                                     "bytes_skipped": 0, "errors": 0, "extra": [], "detail": c.state_reason}
                                    for c in corrupt],
                    "totals": {"checked": len(corrupt), "verified": 0, "corrupt": len(corrupt), "errors": 0,
                               "bytes_read": 0, "bytes_skipped": 0}, "sample": None}
    from ckptier.tasks.pipeline import run_verify, utcnow

    fanout, claims = _fanout(config_path, runner, claim_rows, since)
    bar = Progress("verifying", unit="bytes", enabled=None if progress else False)
    try:
        with _open(catalog_url) as cat:
            return run_verify(cat, now=utcnow, job=job, deep=deep, sample=sample, workers=workers,
                              progress=lambda done, total: bar.update(done, total), fanout=fanout, claims=claims)
    finally:
        bar.close()
        if fanout is not None:
            fanout.close()


def _fanout(config_path: str | None, runner: str | None, claim_rows: bool = False, since: str | None = None) -> Any:
    """The Dask executor (None: threads here) and the row claims for a direct run, from
    ``[runner]`` and the command line (``--runner``, ``--claim-rows``, ``--since``)."""
    from dataclasses import replace

    from ckptier.tasks.config import load_config
    from ckptier.tasks.fanout import open_fanout, row_claims, runner_settings
    from ckptier.tasks.pipeline import run_owner

    settings = runner_settings(load_config(config_path).runner, runner)
    if claim_rows:
        settings = replace(settings, claim_rows=True)
    claims = row_claims(settings, since, owner=run_owner("ckptier-cli"))
    return open_fanout(settings), claims


def apply(*, job: str | None, dry_run: bool, config_path: str | None, catalog_url: str | None,
          use_prefect: bool, runner: str | None = None) -> dict[str, Any]:
    if not dry_run:  # deletes only under a [[policy]] someone wrote; a dry run may preview the default
        _check_policy_written(job, config_path, catalog_url)
    if use_prefect:
        from .tiering import tiering_flow

        fanned = {"runner": runner} if runner else {}
        result = run_flow(tiering_flow, apply=not dry_run, job=job, config_path=config_path, catalog_url=catalog_url,
                          **fanned)
        return dict(result["apply"])
    from ckptier.tasks.config import load_config
    from ckptier.tasks.pipeline import run_apply, run_owner, utcnow

    fanout, _ = _fanout(config_path, runner)
    try:
        with _open(catalog_url) as cat:
            return run_apply(cat, load_config(config_path), now=utcnow, owner=run_owner("ckptier-cli"), job=job,
                             dry_run=dry_run, fanout=fanout)
    finally:
        if fanout is not None:
            fanout.close()


def _check_policy_written(job: str | None, config_path: str | None, catalog_url: str | None) -> None:
    """Raise ``NoPolicyWritten`` when a job to act on has no ``[[policy]]`` the user wrote."""
    from ckptier.tasks.config import load_config
    from ckptier.tasks.settings import require_written_policy

    config = load_config(config_path)
    with _open(catalog_url) as cat:
        require_written_policy(config, [job] if job else cat.jobs(), config_path)


def fetch(*, job: str, step: int, dest: Path, catalog_url: str | None, config_path: str | None) -> dict[str, Any]:
    from ckptier.tasks.config import load_config
    from ckptier.tasks.pipeline import run_fetch

    with _open(catalog_url) as cat:
        return run_fetch(cat, load_config(config_path), job=job, step=step, dest=dest)


def janitor(*, config_path: str | None, older_than: timedelta, catalog_url: str | None) -> dict[str, Any]:
    from ckptier.tasks.config import load_config
    from ckptier.tasks.pipeline import run_janitor, utcnow

    with _open(catalog_url) as cat:
        return run_janitor(cat, load_config(config_path), now=utcnow(), older_than=older_than)


def drill(*, job: str | None, step: int | None, steps: int | None, device: str | None, model: str | None,
          timeout: float | None, config_path: str | None, catalog_url: str | None, use_prefect: bool,
          allow_globals: list[str] | None = None) -> list[dict[str, Any]]:
    """Restore drills (``pipeline.run_drill``); ``allow_globals`` are extra
    ``module.Name`` classes the safe loader may unpickle."""
    if use_prefect:
        from .drill import DrillFailed, restore_drill_flow

        params: dict[str, Any] = {"job": job, "step": step, "model": model, "timeout_seconds": timeout,
                                  "config_path": config_path, "catalog_url": catalog_url}
        if allow_globals:
            params["allow_globals"] = list(allow_globals)
        if steps is not None:
            params["steps"] = steps
        if device is not None:
            params["device"] = device
        try:
            return list(run_flow(restore_drill_flow, **params))
        except DrillFailed as exc:
            raise FlowFailed(str(exc)) from None
    from ckptier.tasks.config import load_config
    from ckptier.tasks.pipeline import run_drill, utcnow

    with _open(catalog_url) as cat:
        return run_drill(cat, load_config(config_path), now=utcnow, job=job, step=step, steps=steps, device=device,
                         model=model, timeout=timeout, allow_globals=allow_globals or ())
