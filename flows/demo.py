"""``ckptier demo``: the whole pipeline end to end on embedded defaults.

Trains a small real model on CPU, writes its checkpoints in the storage
guide's layout into a local hot directory (the newest one still "in
flight"), then scans, verifies, plans and applies retention (milestones
compressed into a local archive tier, rolling checkpoints deleted), prints
bytes before and after, and finishes with a restore drill. Everything lives
in one directory: SQLite catalog, hot tier, archive tier, ckptier.toml.
With Prefect (the default) each stage is a real flow run on Prefect's
temporary local API, or on the server ``PREFECT_API_URL`` names.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from ckptier.storage.errors import CkptierError

from .output import human_bytes, print_checkpoints

#: Seconds the demo gives Prefect's temporary server to start (Prefect's own
#: default, 20 s, is too short for a first start on 2 cores: creating its
#: database there takes about 45 s). ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS``
#: set in the environment wins; one set in a Prefect profile wins when larger.
SERVER_STARTUP_TIMEOUT_S = 300


class PrefectDidNotStart(CkptierError):
    """Prefect's temporary local server did not come up."""

DEMO_CONFIG = """\
# ckptier demo policy: keep the 3 newest verified checkpoints and the
# log-interval milestones (.., 50, 100, 200, 500, ..); milestones go to the
# archive tier, compressed, and their hot copies are then deleted.
[[policy]]
jobs = "*"
keep_last = 3
milestones = "log"
grace = "2h"
archive = "{archive}"
hot_after_archive = "delete"

[[drill]]
jobs = "*"
model = "ckptier.tasks.drill_models:demo_model"
steps = 10
device = "auto"
timeout = "10min"
"""


def tree_bytes(path: Path) -> int:
    """Total size of the regular files below ``path`` (0 when it does not exist)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                continue
    return total



def _pipeline_direct(hot: Path, catalog_url: str, config_path: Path) -> dict[str, Any]:
    from ckptier.tasks import pipeline  # lazy: the demo's imports, only when it runs
    from ckptier.tasks.retention import render_plan_table  # lazy: likewise
    from ckptier.tasks.run import open_run  # lazy: likewise
    from ckptier.tasks.settings import Settings  # lazy: likewise

    with open_run(Settings(catalog_url, config_path), owner="ckptier-demo", create=True) as run:
        scan = pipeline.run_scan(run, [str(hot)])
        listing = run.catalog.checkpoints()
        verify = pipeline.run_verify(run)
        plan = pipeline.make_plan(run)
        apply = pipeline.run_apply(run)
        drill = pipeline.run_drill(run, pipeline.DrillOptions())
    return {"scan": scan, "listing": listing, "verify": verify, "plan": render_plan_table(plan), "apply": apply,
            "drill": drill}


def start_prefect() -> None:
    """Make sure the demo's flow runs have a Prefect API, saying what happens on stderr.

    With a Prefect API URL configured (environment, profile or settings
    context), that server must answer. Otherwise Prefect's temporary local
    server is started here, up front, with the time a first start needs
    (:data:`SERVER_STARTUP_TIMEOUT_S`) and without its telemetry heartbeat,
    which on an offline machine only logs an ERROR that is not one (set
    ``PREFECT_SERVER_ANALYTICS_ENABLED`` to choose). Raises
    :class:`PrefectDidNotStart` (one line, suggesting ``--no-prefect``).
    """
    from ckptier.tasks.prefect_api import check_prefect_api  # lazy: the demo's imports, only when it runs

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.settings import (  # lazy: Prefect only on the demo's Prefect path
        PREFECT_API_URL,
        PREFECT_SERVER_EPHEMERAL_ENABLED,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    )

    configured = PREFECT_API_URL.value()
    if configured:
        check_prefect_api(configured)
        return
    if not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        raise PrefectDidNotStart(
            "no Prefect API: PREFECT_API_URL is unset and Prefect's temporary server is disabled "
            "(PREFECT_SERVER_EPHEMERAL_ENABLED); set one of them, or run 'ckptier demo --no-prefect'"
        )
    from prefect.server.api.server import SubprocessASGIServer  # lazy: likewise

    server = SubprocessASGIServer()
    if server.running:
        return
    print("ckptier demo: starting Prefect's temporary local server for the flow runs (a first start creates "
          "its database and can take a minute; --no-prefect runs the demo without Prefect)", file=sys.stderr, flush=True)
    setting = int(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
    chosen = os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "").strip()
    timeout = setting if chosen else max(SERVER_STARTUP_TIMEOUT_S, setting)  # the user's own choice wins
    try:
        server.start(timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - any failure to start is reported as one line
        first = " ".join(str(exc).split(" stdout:")[0].split())[:200] or type(exc).__name__
        raise PrefectDidNotStart(
            f"Prefect's temporary server did not start within {timeout} s ({first}); "
            "run 'ckptier demo --no-prefect' for the same demo without Prefect"
        ) from None


def _pipeline_prefect(hot: Path, catalog_url: str, config_path: Path) -> dict[str, Any]:
    start_prefect()
    from prefect import flow  # lazy: Prefect only on the demo's Prefect path

    from ckptier.storage.catalog.api import Catalog  # lazy: likewise

    from .drill import restore_drill_flow  # lazy: likewise
    from .scan_verify import scan_flow, verify_flow  # lazy: likewise
    from .tiering import tiering_flow  # lazy: likewise

    @flow(name="demo")
    def demo_flow() -> dict[str, Any]:
        scan = scan_flow(urls=[str(hot)], catalog_url=catalog_url)
        with Catalog.open(catalog_url) as cat:
            listing = cat.checkpoints()
        verify = verify_flow(catalog_url=catalog_url)
        tiering = tiering_flow(apply=True, config_path=str(config_path), catalog_url=catalog_url)
        drill = restore_drill_flow(config_path=str(config_path), catalog_url=catalog_url)
        return {"scan": scan, "listing": listing, "verify": verify, "plan": tiering.plan, "apply": tiering.apply,
                "drill": drill}

    return demo_flow()


#: The demo's log, in its directory: Prefect's flow and task run logs and ckptier's own.
LOG_FILE = "demo.log"


@contextmanager
def logs_to(path: Path, *, prefect: bool) -> Iterator[None]:
    """While open, what ckptier's loggers and (with ``prefect``) Prefect's console handlers would
    print on stderr goes to ``path`` instead: the demo's quiet default (``-v`` keeps them on
    stderr). Everything is put back on exit."""
    import logging  # lazy: only the quiet demo redirects logs

    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s | %(levelname)-7s | %(name)s - %(message)s"))
    moved: list[tuple[logging.Logger, logging.Handler]] = []
    if prefect:
        import prefect.main  # noqa: F401 - sets up Prefect's logging, whose console handlers are swapped here
        from prefect.logging.handlers import PrefectConsoleHandler  # lazy: likewise

        for logger in [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]:
            for h in list(logger.handlers):
                if isinstance(h, PrefectConsoleHandler):
                    logger.removeHandler(h)
                    logger.addHandler(handler)
                    moved.append((logger, h))
    ckptier = logging.getLogger("ckptier")
    propagate = ckptier.propagate
    ckptier.addHandler(handler)
    ckptier.propagate = False
    try:
        yield
    finally:
        ckptier.removeHandler(handler)
        ckptier.propagate = propagate
        for logger, h in moved:
            logger.removeHandler(handler)
            logger.addHandler(h)
        handler.close()


def next_steps(base: Path, catalog_url: str) -> list[str]:
    """What the demo prints last: where its files are and how to run ckptier on one's own checkpoints."""
    return [
        f"the demo's files (catalog, hot and archive tiers, ckptier.toml, {LOG_FILE}) are in {base}; "
        f"look around with 'ckptier ls --catalog {catalog_url}', then remove them: rm -r {base}",
        "next, your own checkpoints: catalog them, prove them, and write a policy in ./ckptier.toml:",
        "  ckptier scan /path/to/checkpoints && ckptier verify",
        "  [[policy]]",
        '  jobs = "*"',
        "  keep_last = 5",
        '  milestones = "log"',
        '  archive = "file:///path/to/archive"',
        "then 'ckptier plan' shows what would be kept, promoted and deleted, and 'ckptier apply' does it",
    ]


def run_demo(base: Path | None, *, steps: int = 300, use_prefect: bool = True, verbosity: int = 0) -> int:
    """Run the demo in ``base`` (a new temporary directory when None); returns the exit code.

    Quiet by default: Prefect's run logs and ckptier's own go to ``demo.log`` in
    ``base`` (its path printed first); with ``verbosity`` above 0 (``-v``) they stay on stderr.
    """
    if use_prefect:
        start_prefect()  # first: a Prefect that cannot start is said before anything is written
    temporary = base is None
    base = (base or Path(tempfile.mkdtemp(prefix="ckptier-demo-"))).absolute()
    hot, archive = base / "hot", base / "archive"
    hot.mkdir(parents=True, exist_ok=True)
    config_path = base / "ckptier.toml"
    config_path.write_text(DEMO_CONFIG.format(archive=archive.as_uri()))
    catalog_url = f"sqlite:///{base / 'catalog.db'}"

    print(f"catalog: {catalog_url} (the demo's own)")
    print(f"ckptier demo in {base}{' (a new temporary directory)' if temporary else ''}")
    quiet = verbosity <= 0
    if quiet:
        logs = "Prefect's flow and task run logs and ckptier's warnings" if use_prefect else "ckptier's warnings"
        print(f"log: {base / LOG_FILE} ({logs}; -v shows them here)")
    with logs_to(base / LOG_FILE, prefect=use_prefect) if quiet else nullcontext():
        return _run(base, hot, archive, catalog_url, config_path, steps=steps, use_prefect=use_prefect)


def _run(base: Path, hot: Path, archive: Path, catalog_url: str, config_path: Path, *, steps: int,
         use_prefect: bool) -> int:
    from ckptier.tasks.demo import train_demo_run  # lazy: torch, only when the demo runs

    run = train_demo_run(hot, steps=steps)
    print(f"1. trained {steps} steps on CPU; {len(run.steps)} checkpoints in {run.job_dir} "
          f"(step {run.in_flight} still in flight: no metadata.json yet)")
    hot_before = tree_bytes(hot)

    result = (_pipeline_prefect if use_prefect else _pipeline_direct)(hot, catalog_url, config_path)

    scan = result["scan"][0]
    print(f"2. scanned: {scan.objects} objects, {scan.checkpoints} checkpoints "
          f"({scan.committed} committed, {scan.incomplete} incomplete)")
    print_checkpoints(result["listing"])
    t = result["verify"].totals
    print(f"3. verified {t.verified} checkpoints ({t.corrupt} corrupt), read {human_bytes(t.bytes_read)}")
    actions: dict[str, int] = {}
    for row in result["plan"]:
        actions[row["action"]] = actions.get(row["action"], 0) + 1
    print("4. retention plan: " + ", ".join(f"{n} {a}" for a, n in sorted(actions.items())))
    for line in result["apply"].lines:
        print(f"   {line}")
    hot_after, archive_after = tree_bytes(hot), tree_bytes(archive)
    print(f"5. bytes before: {human_bytes(hot_before)} hot; after: {human_bytes(hot_after)} hot + "
          f"{human_bytes(archive_after)} archive = {human_bytes(hot_after + archive_after)} "
          f"({(hot_after + archive_after) / hot_before:.0%} of before)")
    ok = True
    for d in result["drill"]:
        print(f"6. restore drill: {d.summary}")
        ok = ok and d.ok
    print()
    for line in next_steps(base, catalog_url):
        print(line)
    return 0 if ok and not result["apply"].failed else 1
