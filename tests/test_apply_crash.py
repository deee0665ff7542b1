"""Runs that die leave nothing stuck.

Real ``ckptier apply`` processes are killed with SIGKILL at the worst
moment (after a rolling checkpoint's files were deleted, before the
tombstone), or stall inside a delete while another run starts. The fault is
injected inside the child process, around the real store's ``delete_many``;
the catalog, stores and command line are the real ones.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from ckptier.flows.cli import EXIT_BUSY, main
from ckptier.storage.base import DeleteResult, ObjectInfo
from ckptier.storage.catalog.api import DeleteIntent, LeaseHolder, ProcessId
from ckptier.storage.local import LocalStore
from ckptier.storage.records import State
from ckptier.tasks.apply import ApplyContext, apply_plan, intent_progress
from ckptier.tasks.archive import prefix_from_location
from ckptier.tasks.leases import holder_gone, process_start, this_process
from ckptier.tasks.retention import Plan
from tests.test_apply import DELETED_STEPS, JOB, STEPS, World, build_world
from tests.test_apply_faults import s3_world  # noqa: F401 - the fixture

REPO = Path(__file__).resolve().parents[1]
VICTIM = 300  # a rolling checkpoint the plan deletes

# Runs ``ckptier apply`` in this child process; around the real store's delete_many:
# "kill"  - SIGKILL itself right after the victim's files were deleted (before the tombstone);
# "stall" - print "stalled" and sleep inside the victim's delete, holding its lease, until killed.
_CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    from ckptier.flows.cli import main
    from ckptier.storage.local import LocalStore
    from ckptier.storage.s3 import S3Store

    mode, victim = sys.argv[1], "step-%08d/" % int(sys.argv[2])
    for cls in (LocalStore, S3Store):
        def wrap(real):
            def delete_proven(self, proven):
                keys = [i.key for i in proven]
                if mode == "stall" and any(victim in k for k in keys):
                    print("stalled", flush=True)
                    time.sleep(120)
                result = real(self, proven)
                if mode == "kill" and any(victim in k for k in keys):
                    os.kill(os.getpid(), signal.SIGKILL)
                return result
            return delete_proven
        cls.delete_proven = wrap(cls.delete_proven)
    sys.exit(main(["apply", "--no-prefect"]))
    """
)


def cli_env(world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Point the command line (in this process and in children) at the world's catalog and a policy."""
    config = tmp_path / "ckptier.toml"
    config.write_text(f'[[policy]]\njobs = "*"\nkeep_last = 2\nmilestones = [100, 500]\narchive = "{tmp_path / "archive"}"\n')
    monkeypatch.setenv("CKPTIER_CATALOG_URL", world.url)
    monkeypatch.setenv("CKPTIER_CONFIG", str(config))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    return {**os.environ, "PYTHONPATH": str(REPO)}


def child(mode: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _CHILD, mode, str(VICTIM)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def killed_mid_delete(env: dict[str, str]) -> None:
    proc = child("kill", env)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = build_world(tmp_path, f"sqlite:///{tmp_path / 'catalog.db'}")
    yield w
    w.catalog.close()


def gone_but_not_recorded(world: World) -> None:
    """The state a SIGKILL between deleting files and recording it leaves."""
    rec = world.catalog.get(JOB, VICTIM)
    assert rec is not None and rec.state == State.VERIFIED
    assert not world.on_disk(VICTIM)
    assert [i.step for i in world.catalog.delete_intents(job=JOB)] == [VICTIM]


# ---------------------------------------------------------------- killed after deleting, before recording


def test_a_rescan_tombstones_a_checkpoint_whose_delete_was_killed(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env = cli_env(world, tmp_path, monkeypatch)
    killed_mid_delete(env)
    gone_but_not_recorded(world)

    assert main(["scan", str(world.hot.root)]) == 0
    rec = world.catalog.get(JOB, VICTIM)
    assert rec is not None
    assert rec.state == State.DELETED, f"stuck as {rec.state.value}, missing since {rec.missing_since}"
    assert rec.missing_since is None and rec.tiers == ()
    assert world.catalog.delete_intents() == []
    settled = [e for e in world.catalog.events(job=JOB, limit=1000) if e.kind == "deleted" and e.checkpoint_id == rec.id]
    assert settled and "interrupted delete" in settled[0].message
    # Nothing else was tombstoned by the scan: the rest are as the killed run left them.
    assert all(world.state(s) == State.VERIFIED for s in STEPS if s > VICTIM)


@pytest.mark.parametrize("tier", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_rerun_finishes_a_killed_delete_and_takes_over_the_dead_runs_lease(
    tier: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
) -> None:
    w: World = request.getfixturevalue("s3_world") if tier == "s3" else request.getfixturevalue("world")
    if tier == "s3":
        w.url = f"sqlite:///{tmp_path / 'catalog.db'}"
    env = cli_env(w, tmp_path, monkeypatch)
    killed_mid_delete(env)
    gone_but_not_recorded(w)
    rec = w.catalog.get(JOB, VICTIM)
    assert rec is not None
    holder = w.catalog.lease_holder(rec.id, now=datetime.now(UTC))
    assert holder is not None and holder.pid is not None  # the dead run's lease, not yet expired

    started = time.monotonic()
    code = main(["apply", "--no-prefect"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert time.monotonic() - started < 60  # taken over at once, not after the lease ran out
    assert w.state(VICTIM) == State.DELETED
    assert w.catalog.delete_intents() == []
    for step in DELETED_STEPS:
        assert w.state(step) == State.DELETED and not w.on_disk(step)
    kinds = [e.kind for e in w.catalog.events(job=JOB, limit=1000) if e.checkpoint_id == rec.id]
    assert "lease.taken_over" in kinds and "deleted" in kinds


# ------------------------------------------------------------------------- a live run holds the work


def test_a_run_that_skips_work_held_by_a_live_run_names_it_and_exits_75(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env = cli_env(world, tmp_path, monkeypatch)
    proc = child("stall", env)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("catalog: ")  # every command names its catalog first
        assert proc.stdout.readline().strip() == "stalled"
        code = main(["apply", "--no-prefect"])
        out, err = capsys.readouterr()
        assert code == EXIT_BUSY == 75, out + err
        line = next(x for x in out.splitlines() if f"step {VICTIM}" in x)
        assert "held by another live run" in line and f"pid {proc.pid}" in line
        assert f"pid {proc.pid}" in err
        assert world.on_disk(VICTIM)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    # The holder is gone now: the next run takes its lease over at once and finishes.
    code = main(["apply", "--no-prefect"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert world.state(VICTIM) == State.DELETED and not world.on_disk(VICTIM)


def test_a_live_runs_lease_is_kept_alive_by_its_heartbeat(world: World) -> None:
    ttl = timedelta(seconds=1)
    target = world.catalog.get(JOB, 200)
    assert target is not None
    rival: list[int | None] = []

    class SlowHot(LocalStore):
        """A delete that takes longer than three leases: only the heartbeat keeps ours."""

        def delete_proven(self, proven: Sequence[ObjectInfo]) -> DeleteResult:
            time.sleep(3 * ttl.total_seconds())
            rival.append(world.catalog.claim(target.id, "rival", now=datetime.now(UTC), ttl=ttl))
            return super().delete_proven(proven)

    slow = SlowHot(world.hot.root)
    only_200 = Plan(items=[i for i in world.plan().items if i.step == 200])
    report = apply_plan(only_200, ApplyContext(catalog=world.catalog, archive_for=world.archive_for, owner="slow-run",
                                              hot_for=lambda r: (slow, prefix_from_location(world.hot, r.location)),
                                              now=lambda: datetime.now(UTC), lease_ttl=ttl))
    assert rival == [None]  # the lease was still ours when the rival tried
    [item] = [i for i in report.items if i.step == 200]
    assert item.outcome == "done", item
    assert world.state(200) == State.DELETED


# ------------------------------------------------------------------------------- pure decisions


def test_a_holder_is_gone_only_when_its_process_provably_is() -> None:
    def holder(host: str = "h1", pid: int = 42, started: str | None = "boot:100") -> LeaseHolder:
        return LeaseHolder("run", 7, datetime(2026, 1, 1, tzinfo=UTC), ProcessId(host, pid, started))

    assert holder_gone(holder(), host="h1", start_now=None)  # no process with that pid
    assert holder_gone(holder(), host="h1", start_now="boot:555")  # the pid was reused
    assert not holder_gone(holder(), host="h1", start_now="boot:100")  # alive
    assert not holder_gone(holder(host="h2"), host="h1", start_now=None)  # another host: wait for expiry
    assert not holder_gone(holder(started=None), host="h1", start_now="boot:555")  # cannot compare
    assert not holder_gone(holder(), host="h1", start_now="")  # runs, start unknown
    assert not holder_gone(LeaseHolder("old", 1, None), host="h1", start_now=None)  # no process recorded
    me = this_process()
    assert process_start(me.pid) == me.started and me.started
    assert process_start(2**22 + 12345) is None


def test_an_interrupted_delete_had_started_when_any_file_it_listed_is_gone() -> None:
    intent = DeleteIntent(1, JOB, VICTIM, "checkpoint", None, files=3)
    assert intent_progress(intent, listed=3, present=3) == "not-started"
    assert intent_progress(intent, listed=3, present=2) == "started"
    assert intent_progress(intent, listed=3, present=0) == "started"
    assert intent_progress(intent, listed=2, present=2) == "started"  # a rescan dropped a vanished file's row
