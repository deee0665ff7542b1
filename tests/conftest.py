"""Shared test set-up.

Server fixtures (moto_server, PostgreSQL, prefect server) live in
``tests/fixtures/`` and are loaded as plugins. When ``CKPTIER_REQUIRE_SERVICES``
is set (CI sets it), a service that cannot be started fails the test
instead of skipping it.
"""

from __future__ import annotations

import os

# Never let anything phone home; only 127.0.0.1 is reachable in tests.
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_CLOUD_ENABLE_ORCHESTRATION_TELEMETRY", "false")
os.environ.setdefault("PREFECT_API_ENABLE_METRICS", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

pytest_plugins = [
    "tests.fixtures.services",
    "tests.fixtures.pg",
    "tests.fixtures.s3",
    "tests.fixtures.checkpoints",
    "tests.fixtures.library_checkpoints",
    "tests.fixtures.prefect_server",
]
