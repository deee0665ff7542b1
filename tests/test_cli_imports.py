"""What each command imports: the command line loads only what the chosen command needs.

A training launcher runs ``ckptier latest --job J --json`` at every start, so
the read-only commands must cost little more than Python with SQLAlchemy:
run in a fresh process against a real catalog, ``latest`` and ``ls`` load
none of the heavy libraries (torch, numpy, Prefect, FastAPI, zstandard), nor
SQLAlchemy's ORM, the formats or the archive codec, and nothing that imports
asyncio beyond what ``import sqlalchemy`` itself does. ``--version`` loads no
handler module at all, and ckptier's own imports stay inside a time budget
(measured by ``python -X importtime``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptier.flows.cli import main

#: Never imported by ``ckptier latest`` or ``ckptier ls`` (a name covers its submodules).
HEAVY = ("torch", "numpy", "prefect", "fastapi", "uvicorn", "pandas", "zstandard", "alembic", "boto3",
         "sqlalchemy.orm", "ckptier.formats", "ckptier.storage.codec", "ckptier.storage.codec_planes",
         "ckptier.storage.codec_layout", "ckptier.tasks.pipeline", "ckptier.tasks.fanout")
#: Imported by SQLAlchemy itself in some versions (``sqlalchemy.util.compat``); then allowed, else not.
SQLALCHEMY_MAY_IMPORT = ("asyncio",)

#: Runs the command line's ``main`` with ``sys.argv[2:]`` and writes the sorted module names to ``sys.argv[1]``.
WRAPPER = (
    "import sys, json; from ckptier.flows.cli import main; rc = main(sys.argv[2:]); "
    "open(sys.argv[1], 'w').write(json.dumps(sorted(sys.modules))); sys.exit(rc)"
)


def _clean_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPTIER_", "PREFECT_"))}
    env["HOME"] = str(tmp_path)
    return env


def _modules(argv: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    out = tmp_path / "modules.json"
    proc = subprocess.run([sys.executable, "-c", WRAPPER, str(out), *argv], capture_output=True, text=True,
                          env=_clean_env(tmp_path), timeout=120, check=False)
    return proc, json.loads(out.read_text()) if out.exists() else []


def _heavy(modules: list[str], allowed: set[str]) -> list[str]:
    forbidden = (*HEAVY, *(m for m in SQLALCHEMY_MAY_IMPORT if m not in allowed))
    return [m for m in modules if any(m == h or m.startswith(h + ".") for h in forbidden)]


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A real catalog: two guide-layout checkpoints of job ``imports-run`` scanned and verified."""
    base = tmp_path_factory.mktemp("imports")
    for step in (100, 200):
        d = base / "hot" / "imports-run" / f"step-{step:08d}"
        d.mkdir(parents=True)
        (d / "model.bin").write_bytes(os.urandom(4096))
        (d / "metadata.json").write_text(json.dumps({"step": step}))
    url = f"sqlite:///{base / 'catalog.db'}"
    assert main(["scan", str(base / "hot"), "--catalog", url, "--json", "--no-prefect"]) == 0
    assert main(["verify", "--catalog", url, "--json", "--no-prefect"]) == 0
    return url


@pytest.fixture(scope="module")
def sqlalchemy_modules(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """What ``import sqlalchemy`` alone loads in a fresh interpreter (the floor of a catalog read)."""
    code = "import sys, json, sqlalchemy; print(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(json.loads(proc.stdout))


@pytest.mark.parametrize("argv", [
    ["latest", "--job", "imports-run", "--json"],
    ["latest", "--job", "imports-run"],
    ["ls", "--job", "imports-run", "--json"],
    ["ls"],
    ["resume", "--job", "imports-run", "--quick", "--json"],  # a stat of each file: no read path, no config
], ids=" ".join)
def test_read_only_commands_import_no_heavy_module(argv: list[str], catalog: str, sqlalchemy_modules: set[str],
                                                   tmp_path: Path) -> None:
    proc, modules = _modules([*argv, "--catalog", catalog], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "200" in proc.stdout  # it answered from the catalog (the newest step)
    assert "sqlalchemy" in modules  # the catalog was read: the check below is not vacuous
    assert _heavy(modules, sqlalchemy_modules) == []


#: The catalog's writing concerns and the record types only they build: ``ls`` and ``latest`` open the
#: read-only composition (:class:`~ckptier.storage.catalog.reads.ReadCatalog`) and load none of them.
WRITE_SIDE = ("ckptier.storage.catalog.api", "ckptier.storage.catalog.scans", "ckptier.storage.catalog.copies",
              "ckptier.storage.catalog.leases", "ckptier.storage.catalog.deletes",
              "ckptier.storage.catalog.history", "ckptier.storage.catalog.entries")


@pytest.mark.parametrize("argv", [
    ["latest", "--job", "imports-run", "--json"],
    ["latest", "--job", "imports-run"],
    ["ls", "--job", "imports-run", "--json"],
    ["ls"],
], ids=" ".join)
def test_read_only_commands_open_the_read_catalog_only(argv: list[str], catalog: str, tmp_path: Path) -> None:
    proc, modules = _modules([*argv, "--catalog", catalog], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "200" in proc.stdout
    assert "ckptier.storage.catalog.reads" in modules and "ckptier.storage.catalog.queries" in modules
    assert [m for m in modules if m in WRITE_SIDE] == []


def test_the_read_catalog_check_sees_the_write_side(catalog: str, tmp_path: Path) -> None:
    """``verify`` writes through the whole :class:`~ckptier.storage.catalog.api.Catalog`: the check above
    would see it."""
    proc, modules = _modules(["verify", "--json", "--no-prefect", "--catalog", catalog], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert set(WRITE_SIDE) <= set(modules)


def test_the_check_sees_a_heavy_import(catalog: str, sqlalchemy_modules: set[str], tmp_path: Path) -> None:
    """The same check fails for a command that does load the formats (``plan``'s pipeline)."""
    proc, modules = _modules(["plan", "--json", "--catalog", catalog], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _heavy(modules, sqlalchemy_modules) != []


#: Runs ``main()`` as the console script does (``sys.argv``), printing at exit, after ``SystemExit``
#: and before the interpreter's teardown: how many objects are frozen, and whether the collector is on.
AS_PROGRAM = (
    "import atexit, gc, sys; from ckptier.flows.cli import main; "
    "atexit.register(lambda: print('gc', gc.get_freeze_count() > 0, gc.isenabled(), file=sys.stderr)); "
    "sys.argv[1:] = sys.argv[2:]; sys.exit(main())"
)


@pytest.mark.parametrize(("argv", "frozen"), [
    (["latest", "--job", "imports-run", "--json"], True),
    (["ls", "--json"], True),
    (["resume", "--job", "imports-run", "--quick", "--json"], False),  # it writes: left as it was
], ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_the_program_freezes_before_exit_after_a_short_read(argv: list[str], frozen: bool, catalog: str,
                                                            tmp_path: Path) -> None:
    """Run as the program, ``ls`` and ``latest`` leave what they imported out of the exit's last
    collection (``gc.freeze``), with the collector on again; a caller of ``main(ARGV)`` is left alone."""
    proc = subprocess.run([sys.executable, "-c", AS_PROGRAM, "ckptier", *argv, "--catalog", catalog],
                          capture_output=True, text=True, env=_clean_env(tmp_path), timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "200" in proc.stdout  # it answered from the catalog
    assert f"gc {frozen} True" in proc.stderr.splitlines()


def test_main_with_argv_leaves_the_collector_as_it_was(catalog: str, capsys: pytest.CaptureFixture[str]) -> None:
    import gc

    before = gc.get_freeze_count()
    assert main(["latest", "--job", "imports-run", "--json", "--catalog", catalog]) == 0
    assert '"step": 200' in capsys.readouterr().out
    assert gc.get_freeze_count() == before and gc.isenabled()


#: ckptier's own imports for ``--version`` (cumulative, microseconds, as ``-X importtime`` counts them):
#: about 20 ms on a loaded 2-core machine; the handlers, SQLAlchemy and the formats cost over 100 ms more.
VERSION_IMPORT_BUDGET_US = 120_000
#: Never imported by ``ckptier --version`` (nor ``--help``): the handlers and everything below them.
NOT_FOR_VERSION = ("sqlalchemy", "asyncio", "numpy", "torch", "prefect", "ckptier.flows.commands",
                   "ckptier.flows.output", "ckptier.storage.records",
                   "ckptier.storage.catalog", "ckptier.tasks.advise", "ckptier.tasks.settings")


def _importtime(argv: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, int]]:
    """``ckptier ARGV`` as the console script runs it, under ``python -X importtime``: the process,
    and each import's cumulative µs by its name as printed (indented: imported by the one above)."""
    code = "import sys; from ckptier.flows.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code, *argv], capture_output=True,
                          text=True, env=_clean_env(tmp_path), timeout=120, check=False)
    imported: dict[str, int] = {}
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, cumulative, name = line.removeprefix("import time:").split("|")
            if cumulative.strip().isdigit():
                imported[name.rstrip()] = int(cumulative)  # indented names are nested imports
    return proc, imported


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["ls", "--bogus"]], ids=" ".join)
def test_version_and_help_import_no_handler_and_stay_in_budget(argv: list[str], tmp_path: Path) -> None:
    proc, imported = _importtime(argv, tmp_path)
    assert proc.returncode == (2 if "--bogus" in argv else 0), proc.stderr[-2000:]
    names = {n.strip() for n in imported}
    assert "ckptier.flows.cli" in names and "ckptier.flows.arguments" in names  # the parse really ran
    loaded = sorted(n for n in names if any(n == h or n.startswith(h + ".") for h in NOT_FOR_VERSION))
    assert loaded == []
    own = sum(us for name, us in imported.items() if name.startswith(" ckptier"))  # " " follows the "|"
    assert 0 < own <= VERSION_IMPORT_BUDGET_US, f"ckptier's own imports took {own} µs"


def test_verify_imports_the_codec_only_when_it_needs_it(catalog: str, tmp_path: Path) -> None:
    """``verify --deep`` of checkpoints with no archive copy and no torch file hashes them without the
    archive codec (numpy, zstandard), torch, Prefect or the other operations' modules."""
    proc, modules = _modules(["verify", "--deep", "--json", "--no-prefect", "--catalog", catalog], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["totals"]["verified"] == 2  # it read both checkpoints
    assert "ckptier.tasks.verify_run" in modules  # the acting path really ran
    # Nor the other operations: promotion and its read-back, deletion, the catalog's backup.
    codec = ("numpy", "zstandard", "torch", "prefect", "ckptier.storage.codec", "ckptier.storage.codec_planes",
             "ckptier.tasks.pipeline", "ckptier.tasks.apply", "ckptier.tasks.archive", "ckptier.tasks.backup")
    assert [m for m in modules if any(m == h or m.startswith(h + ".") for h in codec)] == []
