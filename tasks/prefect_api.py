"""Is a Prefect API configured, and does it answer?

Shared by the command line (``flows/``) and ``deployments/``, which must not
import each other's modules for it. Reads settings without importing Prefect
(about a second), so a command can decide cheaply whether to run as a flow.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path

from ckptier.storage.errors import ConfigError


def configured_api_url(environ: Mapping[str, str] | None = None) -> str | None:
    """The Prefect API URL from ``PREFECT_API_URL``, else from the active Prefect profile.

    Reads ``$PREFECT_HOME/profiles.toml`` (default ``~/.prefect``) directly,
    honouring ``PREFECT_PROFILE``, so that commands need not import Prefect
    (about a second) just to learn whether an API is configured.
    """
    env = os.environ if environ is None else environ
    if env.get("PREFECT_API_URL"):
        return env["PREFECT_API_URL"]
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
    import httpx  # lazy: the command line asks whether an API is configured without loading httpx

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
