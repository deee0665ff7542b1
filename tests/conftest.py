"""Shared test set-up.

Server fixtures (moto_server, PostgreSQL, prefect server) live in
``tests/fixtures/`` and are loaded as plugins. When ``CKPTIER_REQUIRE_SERVICES``
is set (CI sets it), a service that cannot be started fails the test
instead of skipping it.

The code under test must be this checkout's (:func:`checkout_problem`):
otherwise the run stops at once with one line saying how to fix it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Never let anything phone home; only 127.0.0.1 is reachable in tests.
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_CLOUD_ENABLE_ORCHESTRATION_TELEMETRY", "false")
os.environ.setdefault("PREFECT_API_ENABLE_METRICS", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Property tests draw the same examples on every run (a CI run is reproducible and never
# fails by chance); CKPTIER_HYPOTHESIS=explore draws fresh ones, for hunting new cases.
from hypothesis import settings as _hypothesis_settings  # noqa: E402 - after the environment above

_hypothesis_settings.register_profile("ckptier", derandomize=True, print_blob=True)
_hypothesis_settings.register_profile("explore", derandomize=False, print_blob=True)
_hypothesis_settings.load_profile("explore" if os.environ.get("CKPTIER_HYPOTHESIS") == "explore" else "ckptier")

#: The checkout these tests belong to: the code they test must be its own.
ROOT = Path(__file__).resolve().parent.parent


def checkout_problem(root: Path = ROOT) -> str | None:
    """Why the ``ckptier`` these tests would import is not the checkout at ``root``
    (one line, with the fix), or None. An editable install maps ``ckptier.storage``
    and the other packages to the folders of whichever checkout ran ``pip install -e``
    last: without this check a second checkout's tests run the first one's code."""
    try:
        import ckptier.storage
    except ImportError as exc:
        return f"ckptier is not importable ({exc}); fix: cd {root} && pip install -e ."
    where = Path(ckptier.storage.__file__).resolve().parent
    if where.is_relative_to(root):
        return None
    return (f"ckptier.storage is imported from {where}, not from this checkout ({root}), so these tests would "
            f"test another checkout's code; fix: cd {root} && pip install -e . (or activate this checkout's venv)")


#: Checked before the fixtures below import any ckptier code.
CHECKOUT_PROBLEM = checkout_problem()


def pytest_configure(config: pytest.Config) -> None:
    if CHECKOUT_PROBLEM is not None:
        raise pytest.UsageError(CHECKOUT_PROBLEM)


pytest_plugins = [] if CHECKOUT_PROBLEM is not None else [
    "tests.fixtures.services",
    "tests.fixtures.pg",
    "tests.fixtures.s3",
    "tests.fixtures.rgw",
    "tests.fixtures.checkpoints",
    "tests.fixtures.dist_checkpoints",
    "tests.fixtures.library_checkpoints",
    "tests.fixtures.prefect_server",
]
