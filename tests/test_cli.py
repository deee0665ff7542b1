"""The command line end to end on local directories: the DESIGN.md contract.

Runs ``ckptier`` in-process through ``main()`` (and once as a real console
script) against checkpoints a training loop writes with ``torch.save``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckptier.flows.cli import main
from ckptier.tasks.archive import manifest_key
from ckptier.tasks.demo import train_demo_run


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One demo training run for the session (200 steps, a save every 25, the last in flight)."""
    hot = tmp_path_factory.mktemp("trained") / "hot"
    train_demo_run(hot, steps=200, every=25)
    return hot


@pytest.fixture()
def env(trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A hot dir with a copy of the trained run, a catalog, a policy with an archive."""
    hot = tmp_path / "hot"
    shutil.copytree(trained, hot)
    job_dir = hot / "demo-run"
    catalog = tmp_path / "catalog.db"
    archive = tmp_path / "archive"
    config = tmp_path / "ckptier.toml"
    config.write_text(
        f'[[policy]]\njobs = "*"\nkeep_last = 2\nmilestones = "log"\narchive = "{archive.as_uri()}"\n'
        '[[drill]]\njobs = "*"\nmodel = "ckptier.tasks.models:demo_model"\nsteps = 3\n'
    )
    monkeypatch.setenv("CKPTIER_CATALOG_URL", f"sqlite:///{catalog}")
    monkeypatch.setenv("CKPTIER_CONFIG", str(config))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))  # no profile's API either
    return {"hot": hot, "job_dir": job_dir, "archive": archive, "catalog": catalog, "config": config}


def test_scan_ls_json_contract_and_idempotent_rescan(env: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "scan", str(env["hot"]), "--json")
    assert code == 0
    (report,) = json.loads(out)
    assert report["checkpoints"] == 8 and report["committed"] == 7 and report["incomplete"] == 1
    assert report["rows_written"] > 0

    code, out, _ = run(capsys, "scan", env["hot"].as_uri(), "--json")
    assert code == 0 and json.loads(out)[0]["rows_written"] == 0

    code, out, _ = run(capsys, "ls", "--json")
    rows = json.loads(out)
    assert [r["step"] for r in rows] == [25, 50, 75, 100, 125, 150, 175, 200]
    for r in rows:
        assert {"job", "step", "format", "state", "bytes", "files", "tiers"} <= r.keys()
        assert r["job"] == "demo-run" and r["format"] == "guide" and r["tiers"] == ["hot"]
        assert r["files"] == (3 if r["state"] == "committed" else 2)
        assert r["bytes"] > 1000
    assert rows[-1]["state"] == "incomplete"


def test_latest_falls_back_past_corrupt_and_incomplete(env: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    # Newest (200) is in flight; corrupt the one before it (175).
    victim = env["job_dir"] / "step-00000175" / "rank-0000" / "model.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    assert run(capsys, "scan", str(env["hot"]))[0] == 0

    code, out, _ = run(capsys, "latest", "--job", "demo-run")
    assert code == 1  # nothing verified yet
    code, out, err = run(capsys, "verify", "--json")
    report = json.loads(out)
    assert code == 1 and report["totals"]["corrupt"] == 1 and report["totals"]["verified"] == 6
    corrupt = [r for r in report["checkpoints"] if r["state"] == "corrupt"]
    assert corrupt[0]["step"] == 175 and "model.pt" in corrupt[0]["detail"]

    code, out, _ = run(capsys, "latest", "--job", "demo-run", "--json")
    assert code == 0 and json.loads(out)["step"] == 150


def test_plan_apply_fetch_rescan_drill(env: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert run(capsys, "scan", str(env["hot"]))[0] == 0
    assert run(capsys, "verify")[0] == 0
    code, out, _ = run(capsys, "plan", "--json")
    plan = {r["step"]: r for r in json.loads(out)}
    assert plan[50]["action"] == "promote" and plan[100]["action"] == "promote"  # log milestones
    assert plan[25]["action"] == "delete" and plan[75]["action"] == "delete"
    assert plan[200]["action"] == "keep" and any("in flight" in x for x in plan[200]["reasons"])
    assert all(r["reasons"] for r in plan.values())

    before = sorted(p.name for p in env["job_dir"].iterdir())
    assert run(capsys, "apply", "--dry-run")[0] == 0
    assert sorted(p.name for p in env["job_dir"].iterdir()) == before  # a dry run changes nothing

    code, out, err = run(capsys, "apply")
    assert code == 0, out + err
    left = sorted(p.name for p in env["job_dir"].iterdir())
    # kept hot: the 2 newest verified + the save in flight; milestones live in the archive only.
    assert left == ["step-00000150", "step-00000175", "step-00000200"]
    assert (env["archive"] / manifest_key("demo-run", 100)).exists()

    dest = tmp_path / "restored"
    code, out, _ = run(capsys, "fetch", "--job", "demo-run", "--step", "100", str(dest), "--json")
    assert code == 0 and json.loads(out)["tier"] == "archive"
    meta = json.loads((dest / "metadata.json").read_text())
    assert sorted(meta["files"]) == ["rank-0000/model.pt", "rank-0000/optimizer.pt"]
    for rel, expected in meta["files"].items():
        assert hashlib.sha256((dest / rel).read_bytes()).hexdigest() == expected["sha256"]
    assert (dest / "rank-0000" / "model.pt").stat().st_mode & 0o044  # readable like any file the user writes

    # A rescan after deleting hot copies on purpose must not report them missing
    # (which would trip the shrink guard and suspend all deletion).
    code, out, _ = run(capsys, "scan", str(env["hot"]), "--json")
    assert json.loads(out)[0]["vanished"] == 0
    code, out, _ = run(capsys, "ls", "--json")
    rows = {r["step"]: r for r in json.loads(out)}
    assert rows[100]["tiers"] == ["archive"] and rows[100]["missing_since"] is None
    assert 25 not in rows  # deleted checkpoints are tombstones, listed only with --all
    code, out, _ = run(capsys, "ls", "--all", "--json")
    assert {r["step"]: r["state"] for r in json.loads(out)}[25] == "deleted"
    code, out, _ = run(capsys, "plan", "--json")
    assert not [r for r in json.loads(out) if r["action"] != "keep"]

    code, out, err = run(capsys, "drill", "--json")
    (drill,) = json.loads(out)
    assert code == 0, err
    assert drill["ok"] and drill["step"] == 175 and drill["tier"] == "hot"
    assert {c["name"] for c in drill["checks"]} >= {"losses_finite", "gradients", "deterministic"}

    code, out, _ = run(capsys, "drill", "--step", "100", "--job", "demo-run", "--json")
    (drill,) = json.loads(out)
    assert code == 0 and drill["ok"] and drill["tier"] == "archive"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["scan", "s3://"], "no bucket"),
        (["scan", "ftp://host/x"], "unsupported scheme"),
        (["scan", "/definitely/not/here"], "does not exist"),
        (["ls", "--job", "nope"], "nope"),
        (["latest", "--job", "nope"], "nope"),
        (["verify", "--sample", "9/7"], "--sample"),
        (["fetch", "--job", "nope", "--step", "1", "/tmp/x"], "nope"),
        (["ls", "--catalog", "nosuchdialect://x"], "nosuchdialect"),
    ],
)
def test_bad_input_is_one_line_and_non_zero(env: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                            argv: list[str], needle: str) -> None:
    assert run(capsys, "scan", str(env["hot"]))[0] == 0  # the catalog exists; the job does not
    code, out, err = run(capsys, *argv)
    assert code != 0
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err


def test_broken_config_names_table_and_key(env: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    env["config"].write_text('[[policy]]\njobs = "*"\nkeep_lats = 3\n')
    code, _, err = run(capsys, "plan")
    assert code == 2 and "keep_lats" in err and "policy[0]" in err and len(err.strip().splitlines()) == 1


def test_console_script_read_only_commands_do_not_import_prefect(env: dict[str, Path]) -> None:
    """``ls``/``latest``/``plan`` must answer without importing Prefect (it costs seconds)."""
    assert main(["scan", str(env["hot"]), "--json"]) == 0
    code = (
        "import sys; from ckptier.flows.cli import main; rc = main(sys.argv[1:]); "
        "assert 'prefect' not in sys.modules, 'prefect imported'; sys.exit(rc)"
    )
    for argv in (["ls"], ["plan"], ["latest", "--job", "demo-run"]):
        proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                              env={**os.environ}, timeout=120)
        assert "prefect imported" not in proc.stderr, proc.stderr
        assert proc.returncode in (0, 1), proc.stderr


def test_prefect_api_is_found_in_the_environment_or_the_active_profile(tmp_path: Path) -> None:
    from ckptier.flows.runner import configured_api_url

    assert configured_api_url({"PREFECT_API_URL": "http://127.0.0.1:4200/api", "HOME": str(tmp_path)}) == "http://127.0.0.1:4200/api"
    assert configured_api_url({"HOME": str(tmp_path)}) is None
    home = tmp_path / ".prefect"
    home.mkdir()
    (home / "profiles.toml").write_text(
        'active = "local"\n[profiles.local]\nPREFECT_API_URL = "http://127.0.0.1:4200/api"\n[profiles.other]\n'
    )
    assert configured_api_url({"HOME": str(tmp_path)}) == "http://127.0.0.1:4200/api"
    assert configured_api_url({"HOME": str(tmp_path), "PREFECT_PROFILE": "other"}) is None


def test_unreachable_prefect_api_is_one_line_naming_the_variable(env: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.fixtures.services import free_port

    monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{free_port()}/api")
    code, _, err = run(capsys, "scan", str(env["hot"]))
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "PREFECT_API_URL" in lines[0]


def test_deep_verify_reads_archive_copies_and_flags_an_only_copy_at_risk(
    env: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """RELIABILITY 18: a bit flip in an archived file is found by the periodic deep read."""
    from ckptier.storage.catalog.api import Catalog

    for argv in (["scan", str(env["hot"])], ["verify"], ["apply"]):
        assert run(capsys, *argv)[0] == 0
    # Milestones 50 and 100 now live in the archive only; a deep verify must not call them corrupt.
    code, out, err = run(capsys, "verify", "--deep", "--json")
    report = json.loads(out)
    assert code == 0, err
    archive_rows = {r["step"]: r for r in report["checkpoints"] if r["tier"] == "archive"}
    assert sorted(archive_rows) == [50, 100] and all(r["state"] == "verified" for r in archive_rows.values())
    assert report["totals"]["corrupt"] == 0 and report["totals"]["archive_checked"] == 2

    stored = sorted((env["archive"] / "demo-run" / "step-00000100").rglob("model.pt.ckz"))[0]
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0x10
    stored.write_bytes(bytes(data))
    code, out, _ = run(capsys, "verify", "--deep", "--json")
    report = json.loads(out)
    assert code == 1 and report["totals"]["archive_degraded"] == 1
    (bad,) = [r for r in report["checkpoints"] if r["state"] == "degraded"]
    assert bad["step"] == 100 and bad["detail"].startswith("only copy at risk") and "model.pt" in bad["detail"]
    with Catalog.open(f"sqlite:///{env['catalog']}") as cat:
        (event,) = cat.events(job="demo-run", kinds=["archive.degraded"])
        assert event.data is not None and event.data["only_copy"] is True
        record = cat.get("demo-run", 100)
        assert record is not None and [c.state for c in record.copies if c.tier == "archive"] == ["degraded"]
    code, _, err = run(capsys, "fetch", "--job", "demo-run", "--step", "100", str(env["hot"].parent / "out"))
    assert code == 2 and "archive" in err  # never hands out damaged bytes


@pytest.mark.parametrize("use_prefect", [False, True], ids=["direct", "prefect"])
def test_demo_runs_the_whole_pipeline(tmp_path: Path, capsys: pytest.CaptureFixture[str], use_prefect: bool,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``ckptier demo``: train, leave one save in flight, scan, verify, tier, drill — and say so."""
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    if use_prefect:
        from prefect.testing.utilities import prefect_test_harness

        with prefect_test_harness(server_startup_timeout=120):
            code, out, err = run(capsys, "demo", "--dir", str(tmp_path), "--steps", "200")
    else:
        code, out, err = run(capsys, "demo", "--dir", str(tmp_path), "--steps", "200", "--no-prefect")
    assert code == 0, out + err
    assert "8 checkpoints" in out and "step 200 still in flight" in out
    assert "7 committed, 1 incomplete" in out and "verified 7 checkpoints (0 corrupt)" in out
    assert "promote done" in out and "restore drill: demo-run step 175" in out and "drill ok" in out
    assert (tmp_path / "archive" / "demo-run" / "step-00000050" / "ckptier-manifest.json").exists()
    assert not (tmp_path / "hot" / "demo-run" / "step-00000025").exists()  # rolling checkpoint deleted


def test_drill_falls_back_past_a_checkpoint_that_does_not_restore(
    env: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """The newest verified checkpoint's bytes are intact but it no longer fits the model
    (as after a serialization change): the failure is recorded, the next one is drilled."""
    import torch

    from ckptier.storage.catalog.api import Catalog
    from ckptier.tasks.demo import write_guide_checkpoint

    wrong = {"net.0.weight": torch.zeros(3, 3)}
    write_guide_checkpoint(env["job_dir"] / "step-00000180", {"rank-0000/model.pt": wrong,
                                                             "rank-0000/optimizer.pt": {"state": {}, "param_groups": []}},
                           step=180, loss=0.01)
    for argv in (["scan", str(env["hot"])], ["verify"]):
        assert run(capsys, *argv)[0] == 0
    code, out, _ = run(capsys, "drill", "--json")
    reports = json.loads(out)
    assert code == 1  # a checkpoint that does not restore is a failure to hear about
    assert [(r["step"], r["ok"]) for r in reports] == [(180, False), (175, True)]
    assert reports[0]["stage"] == "restore" and "net.0.weight" in reports[0]["summary"]
    with Catalog.open(f"sqlite:///{env['catalog']}") as cat:
        assert [(d.step, d.ok) for d in cat.drills(job="demo-run")] == [(175, True), (180, False)]


def test_janitor_removes_orphans_but_never_a_cataloged_copy(env: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    from ckptier.tasks.archive import manifest_key

    for argv in (["scan", str(env["hot"])], ["verify"], ["apply"]):
        assert run(capsys, *argv)[0] == 0
    old = 1_000_000_000  # 2001: older than any threshold
    orphan = env["archive"] / "demo-run" / "step-00000999"  # an interrupted promotion's leftovers
    orphan.mkdir()
    (orphan / "model.pt.ckz").write_bytes(b"partial")
    temp = env["archive"] / "demo-run" / ".ckptier-tmp-abc123"  # an interrupted local write
    temp.write_bytes(b"half")
    os.utime(temp, (old, old))
    young_temp = env["archive"] / "demo-run" / ".ckptier-tmp-young"  # a write in progress
    young_temp.write_bytes(b"now")
    by_hand = env["archive"] / "notes-copied-by-hand.txt"  # no commit marker, not ours: never touched
    by_hand.write_bytes(b"keep me")
    os.utime(by_hand, (old, old))
    damaged = env["archive"] / manifest_key("demo-run", 100)  # a committed copy that lost its manifest
    damaged.unlink()
    for path in list(orphan.rglob("*")) + list(damaged.parent.rglob("*")):
        os.utime(path, (old, old))

    code, out, _ = run(capsys, "janitor", "--older-than", "1h", "--json")
    assert code == 0
    (report,) = json.loads(out)["archives"].values()
    assert report["removed_dirs"] == ["demo-run/step-00000999"] and not orphan.exists()
    assert report["unexpected"] == ["demo-run/step-00000100"]
    assert (damaged.parent / "rank-0000" / "model.pt.ckz").exists()  # left in place: damage to look at
    assert report["removed_temp_files"] == ["demo-run/.ckptier-tmp-abc123"] and not temp.exists()
    assert young_temp.exists() and by_hand.read_bytes() == b"keep me"
