"""A run is assembled once: each command and each flow run reads ``ckptier.toml``
once and opens the catalog once (:func:`ckptier.tasks.run.open_run`).

Counted on the real code paths: every read of the config file (a Python audit
hook sees each ``open`` of it) and every catalog engine opened
(:func:`ckptier.storage.catalog.db.open_engine`, which every
:meth:`Catalog.open` goes through, wrapped to count and call through).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ckptier.flows.cli import main
from ckptier.storage.catalog import db
from ckptier.tasks.demo import train_demo_run


@dataclass
class Counter:
    """Config-file reads and catalog opens since :meth:`take`."""

    config: str
    reads: int = 0
    opens: int = 0
    active: bool = True
    seen: dict[str, tuple[int, int]] = field(default_factory=dict)

    def take(self, name: str) -> tuple[int, int]:
        got = self.seen[name] = (self.reads, self.opens)
        self.reads = self.opens = 0
        return got


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    hot = tmp_path_factory.mktemp("assembled") / "hot"
    train_demo_run(hot, steps=75, every=25)
    return hot


@pytest.fixture
def counter(trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter]:
    """A hot tier, an archive, and a ``ckptier.toml`` that names the catalog (so every
    command must read the file to find it); counting starts at once."""
    hot = tmp_path / "hot"
    shutil.copytree(trained, hot)
    config = tmp_path / "ckptier.toml"
    config.write_text(
        f'[catalog]\nurl = "sqlite:///{tmp_path / "catalog.db"}"\n'
        f'[[policy]]\njobs = "*"\nkeep_last = 1\nmilestones = [25]\narchive = "{(tmp_path / "archive").as_uri()}"\n'
        '[[drill]]\njobs = "*"\nmodel = "ckptier.tasks.drill_models:demo_model"\nsteps = 2\n'
    )
    monkeypatch.delenv("CKPTIER_CATALOG_URL", raising=False)
    monkeypatch.setenv("CKPTIER_CONFIG", str(config))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    counts = Counter(config=os.path.realpath(config))

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open" and counts.active and isinstance(args[0], str | os.PathLike) \
                and os.path.realpath(args[0]) == counts.config:
            counts.reads += 1

    sys.addaudithook(hook)  # an audit hook stays for the process: ``active`` turns this one off
    real_open_engine = db.open_engine

    def open_engine(*args: Any, **kwargs: Any) -> Any:
        counts.opens += 1
        return real_open_engine(*args, **kwargs)

    monkeypatch.setattr(db, "open_engine", open_engine)
    try:
        yield counts
    finally:
        counts.active = False


def _ok(capsys: pytest.CaptureFixture[str], *argv: str, code: int = 0) -> str:
    got = main(list(argv))
    out, err = capsys.readouterr()
    assert got == code, (argv, out, err)
    return out


def test_each_command_reads_the_config_once_and_opens_the_catalog_once(
        counter: Counter, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hot = str(tmp_path / "hot")
    commands = {
        "scan": ("scan", hot),
        "verify": ("verify",),
        "verify (nothing left to verify)": ("verify",),
        "plan": ("plan",),
        "ls": ("ls",),
        "latest": ("latest", "--job", "demo-run"),
        "resume": ("resume", "--job", "demo-run", "--quick"),
        "apply --dry-run": ("apply", "--dry-run"),
        "apply": ("apply",),
        "fetch": ("fetch", "--job", "demo-run", "--step", "25", str(tmp_path / "restored")),
        "drill": ("drill", "--job", "demo-run", "--step", "50"),
        "janitor": ("janitor",),
        "forget": ("forget", "--job", "demo-run", "--missing", "--dry-run"),
        "advise": ("advise", "--job", "demo-run"),
    }
    for name, argv in commands.items():
        _ok(capsys, *argv)
        counter.take(name)
    print("config reads, catalog opens:", counter.seen)
    assert counter.seen == {name: (1, 1) for name in commands}


def test_read_only_commands_given_the_catalog_never_read_the_config(
        counter: Counter, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _ok(capsys, "scan", str(tmp_path / "hot"))
    counter.take("scan")
    catalog = f"sqlite:///{tmp_path / 'catalog.db'}"
    _ok(capsys, "ls", "--catalog", catalog)
    assert counter.take("ls") == (0, 1)
    _ok(capsys, "latest", "--job", "demo-run", "--catalog", catalog, code=1)  # nothing verified yet
    assert counter.take("latest") == (0, 1)
    # A quick resume that fetches nothing never uses the config; a full one reads it (the job's grace).
    _ok(capsys, "resume", "--job", "demo-run", "--quick", "--catalog", catalog, code=1)
    assert counter.take("resume --quick") == (0, 1)
    _ok(capsys, "resume", "--job", "demo-run", "--catalog", catalog, code=1)
    assert counter.take("resume") == (1, 1)


def test_a_run_given_a_config_reader_reads_it_on_first_use_only(tmp_path: Path) -> None:
    from ckptier.storage.catalog.api import Catalog
    from ckptier.tasks.config import default_config
    from ckptier.tasks.run import Run

    reads: list[int] = []

    def read() -> Any:
        reads.append(1)
        return default_config()

    with Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
        run = Run.of(cat, config=read)
        assert reads == []
        first = run.config
        assert run.config is first and reads == [1]


def test_a_run_stays_in_its_process(tmp_path: Path) -> None:
    """Prefect pickles a task's parameters (the flow's Run among them) with the context of
    the task runs it fans out to Dask: a pickled Run becomes a DetachedRun that refuses use."""
    import pickle

    from ckptier.storage.catalog.api import Catalog
    from ckptier.tasks.run import DetachedRun, Run

    with Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
        run = Run.of(cat, owner="flow-run-7")
        with pytest.raises(AttributeError, match="immutable"):
            run.owner = "another"  # type: ignore[misc]
        there = pickle.loads(pickle.dumps(run))
    assert isinstance(there, DetachedRun) and there.owner == "flow-run-7"
    assert not hasattr(there, "catalog")
    with pytest.raises(AttributeError, match="the run of flow-run-7 was opened in another process"):
        there.catalog.checkpoints()
    again = pickle.loads(pickle.dumps(there))  # through a Dask scheduler and on to a worker
    assert isinstance(again, DetachedRun) and again.owner == "flow-run-7"


# ------------------------------------------------------------------ flow runs


@pytest.fixture
def harness(prefect_harness: None) -> None:
    """The session's one in-process Prefect API (see ``tests/fixtures/prefect_server.py``)."""


@pytest.mark.slow
@pytest.mark.prefect_server
def test_each_flow_run_reads_the_config_once_and_opens_the_catalog_once(
        harness: None, counter: Counter, tmp_path: Path) -> None:
    from ckptier.flows.drill import restore_drill_flow
    from ckptier.flows.scan_verify import scan_flow, scan_verify_flow, verify_flow
    from ckptier.flows.tiering import tiering_flow

    config, hot = str(tmp_path / "ckptier.toml"), str(tmp_path / "hot")
    runs = {
        "scan": lambda: scan_flow(urls=[hot], config_path=config),
        "verify": lambda: verify_flow(config_path=config),
        "scan-verify": lambda: scan_verify_flow(urls=[hot], config_path=config),
        "tiering (plan)": lambda: tiering_flow(config_path=config),
        "tiering (apply)": lambda: tiering_flow(apply=True, config_path=config),
        "restore-drill": lambda: restore_drill_flow(job="demo-run", step=50, config_path=config),
    }
    for name, flow_run in runs.items():
        flow_run()
        counter.take(name)
    print("config reads, catalog opens:", counter.seen)
    assert counter.seen == {name: (1, 1) for name in runs}


@pytest.mark.prefect_server
def test_a_scan_flow_scans_with_the_config_it_is_given(harness: None, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The flow's ``config_path`` is the config of its whole run: its ``[[pattern]]`` rules
    recognise the checkpoints, not only its ``[catalog] url`` (the scan used to read
    ``$CKPTIER_CONFIG`` or ``./ckptier.toml`` for its rules instead)."""
    from ckptier.flows.scan_verify import scan_flow

    monkeypatch.chdir(tmp_path)  # no ./ckptier.toml here
    monkeypatch.delenv("CKPTIER_CONFIG", raising=False)
    monkeypatch.delenv("CKPTIER_CATALOG_URL", raising=False)
    save = tmp_path / "hot" / "llm" / "save_100"
    save.mkdir(parents=True)
    (save / "weights.bin").write_bytes(b"w" * 64)
    (save / "COMMITTED").write_text("")
    config = tmp_path / "rules.toml"
    config.write_text(f'[catalog]\nurl = "sqlite:///{tmp_path / "catalog.db"}"\n'
                      '[[pattern]]\nglob = "*/save_*/**"\nstep_regex = \'save_(?P<step>\\d+)\'\n'
                      'commit_marker = "COMMITTED"\n')
    (report,) = scan_flow(urls=[str(tmp_path / "hot")], config_path=str(config))
    assert (report.checkpoints, report.committed, list(report.unrecognised)) == (1, 1, [])
