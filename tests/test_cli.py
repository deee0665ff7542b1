"""The command line end to end on local directories: the contract docs/commands.md documents.

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
        '[[drill]]\njobs = "*"\nmodel = "ckptier.tasks.drill_models:demo_model"\nsteps = 3\n'
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


def test_scan_and_verify_json_is_the_reports_to_json(env: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """``--json`` prints the typed reports' ``to_json()``: a rerun of the same deep read in this
    process gives the same keys and values (rows, totals, sample) as the command printed."""
    from datetime import UTC, datetime

    from ckptier.storage.catalog.api import Catalog
    from ckptier.tasks.pipeline import VerifyOptions, run_scan, run_verify
    from ckptier.tasks.run import Run

    victim = env["job_dir"] / "step-00000175" / "rank-0000" / "model.pt"
    code, out, _ = run(capsys, "scan", str(env["hot"]), "--json")
    with Catalog.open(f"sqlite:///{env['catalog']}") as cat:
        (again,) = run_scan(Run.of(cat, now=lambda: datetime.now(UTC)), [str(env["hot"])], full=True)
    (printed,) = json.loads(out)
    assert code == 0 and printed.keys() == again.to_json().keys()
    assert {**printed, "rows_written": 0, "new": 0} == {**again.to_json(), "new": 0}  # a full rescan writes nothing

    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    assert run(capsys, "scan", str(env["hot"]))[0] == 0
    code, out, _ = run(capsys, "verify", "--deep", "--sample", "1/1", "--json")
    printed = json.loads(out)
    with Catalog.open(f"sqlite:///{env['catalog']}") as cat:
        report = run_verify(Run.of(cat, now=lambda: datetime.now(UTC)), VerifyOptions(deep=True, sample=(1, 1)))
    assert code == 1 and report.totals.corrupt == 1 and report.totals.found_damage
    assert printed == report.to_json() and list(printed) == ["checkpoints", "totals", "sample"]
    assert printed["sample"] == "1/1" and [r["step"] for r in printed["checkpoints"] if r["state"] == "corrupt"] == [175]


def test_plan_apply_fetch_rescan_drill(env: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert run(capsys, "scan", str(env["hot"]))[0] == 0
    assert run(capsys, "verify")[0] == 0
    code, out, _ = run(capsys, "plan", "--json")
    plan = {r["step"]: r for r in json.loads(out)}
    assert plan[50]["action"] == "promote" and plan[100]["action"] == "promote"  # log milestones
    assert plan[25]["action"] == "promote" and "holds milestone 20: first save at or after it" in plan[25]["reasons"][0]
    assert plan[75]["action"] == "delete" and plan[125]["action"] == "delete"
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
    assert 75 not in rows  # deleted checkpoints are tombstones, listed only with --all
    code, out, _ = run(capsys, "ls", "--all", "--json")
    assert {r["step"]: r["state"] for r in json.loads(out)}[75] == "deleted"
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
        (["fetch", "--job", "nope", "--step", "1", "/nonexistent/ckptier-fetch-dest"], "nope"),
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
    from ckptier.tasks.prefect_api import configured_api_url

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
    # Milestones (25 holds 1-20, 50, 100) now live in the archive only; a deep verify must not call them corrupt.
    code, out, err = run(capsys, "verify", "--deep", "--json")
    report = json.loads(out)
    assert code == 0, err
    archive_rows = {r["step"]: r for r in report["checkpoints"] if r["tier"] == "archive"}
    assert sorted(archive_rows) == [25, 50, 100] and all(r["state"] == "verified" for r in archive_rows.values())
    assert report["totals"]["corrupt"] == 0 and report["totals"]["archive_checked"] == 3

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
                                      monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """``ckptier demo``: train, leave one save in flight, scan, verify, tier, drill — and say so."""
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    if use_prefect:
        request.getfixturevalue("prefect_harness")  # the session's one in-process Prefect API
        code, out, err = run(capsys, "demo", "--dir", str(tmp_path), "--steps", "200")
    else:
        code, out, err = run(capsys, "demo", "--dir", str(tmp_path), "--steps", "200", "--no-prefect")
    assert code == 0, out + err
    assert "8 checkpoints" in out and "step 200 still in flight" in out
    assert "7 committed, 1 incomplete" in out and "verified 7 checkpoints (0 corrupt)" in out
    assert "promote done" in out and "restore drill: demo-run step 175" in out and "drill ok" in out
    assert (tmp_path / "archive" / "demo-run" / "step-00000050" / "ckptier-manifest.json").exists()
    assert not (tmp_path / "hot" / "demo-run" / "step-00000025").exists()  # rolling checkpoint deleted
    # Quiet by default: the logs go to a file it names; it ends with where its files are and what next.
    assert f"log: {tmp_path / 'demo.log'}" in out and (tmp_path / "demo.log").exists()
    assert "| INFO" not in err and f"rm -r {tmp_path}" in out
    assert "ckptier scan /path/to/checkpoints" in out and "  [[policy]]\n" in out and "keep_last = 5" in out


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
    (orphan / ".ckptier").mkdir()  # the upload marker it wrote first proves they are ckptier's own
    (orphan / ".ckptier" / "upload.json").write_bytes(
        b'{"ckptier": "upload", "job": "demo-run", "step": 999, "owner": "x", "started_at": "2001-09-09T01:46:40+00:00", '
        b'"keys": ["model.pt.ckz"]}')
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


# ------------------------------------------------------------- which catalog


def _first_line(out: str) -> str:
    return out.splitlines()[0] if out else ""


def test_every_command_takes_the_catalog_by_one_precedence_and_names_it_first(
    env: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """--catalog, then CKPTIER_CATALOG_URL, then [catalog] url in ckptier.toml, then the default; the
    first line of human output says which (never in --json)."""
    from_file = f"sqlite:///{tmp_path / 'from-file.db'}"
    from_env = f"sqlite:///{tmp_path / 'from-env.db'}"
    given = f"sqlite:///{tmp_path / 'given.db'}"
    env["config"].write_text(f'[catalog]\nurl = "{from_file}"\n' + env["config"].read_text())
    monkeypatch.delenv("CKPTIER_CATALOG_URL")
    monkeypatch.setenv("CKPTIER_HOME", str(tmp_path / "home"))
    code, out, err = run(capsys, "scan", str(env["hot"]))
    assert code == 0, err
    assert _first_line(out) == f"catalog: {from_file} ([catalog] url in {env['config']})"
    assert (tmp_path / "from-file.db").exists() and not (tmp_path / "home").exists()
    assert run(capsys, "verify")[0] == 0
    assert run(capsys, "apply")[0] == 0

    commands = [["ls"], ["latest", "--job", "demo-run"], ["plan"], ["verify"], ["apply", "--dry-run"], ["janitor"],
                ["fetch", "--job", "demo-run", "--step", "150", str(tmp_path / "out")], ["scan", str(env["hot"])]]
    for argv in commands:
        code, out, err = run(capsys, *argv)
        assert code == 0, (argv, err)
        assert _first_line(out) == f"catalog: {from_file} ([catalog] url in {env['config']})", argv
    code, out, _ = run(capsys, "ls", "--json")
    assert code == 0 and json.loads(out) and "catalog" not in out.split("\n", 1)[0]

    # The environment beats the file, --catalog beats both; each is really used (these two do not exist).
    monkeypatch.setenv("CKPTIER_CATALOG_URL", from_env)
    for argv in (["ls"], ["latest", "--job", "demo-run"], ["plan"], ["verify"], ["apply"], ["janitor"],
                 ["fetch", "--job", "demo-run", "--step", "150", str(tmp_path / "out2")]):
        code, out, err = run(capsys, *argv)
        assert code == 2 and _first_line(out) == f"catalog: {from_env} (CKPTIER_CATALOG_URL)", argv
        assert "no catalog at " + from_env in err and len(err.strip().splitlines()) == 1
        code, out, err = run(capsys, *argv, "--catalog", given)
        assert code == 2 and _first_line(out) == f"catalog: {given} (--catalog)" and given in err, argv
    assert not (tmp_path / "from-env.db").exists() and not (tmp_path / "given.db").exists()
    assert not (tmp_path / "out2").exists()

    # Nothing set at all: the default, in the data directory.
    monkeypatch.delenv("CKPTIER_CATALOG_URL")
    env["config"].write_text('[[policy]]\njobs = "*"\nkeep_last = 2\n')
    code, out, err = run(capsys, "ls")
    default = f"sqlite:///{tmp_path / 'home' / 'catalog.db'}"
    assert code == 2 and _first_line(out) == f"catalog: {default} (default)" and default in err
    assert not (tmp_path / "home").exists()


def test_the_catalog_password_is_masked_on_the_first_line(env: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "ls", "--catalog", "postgresql://u:hunter2@127.0.0.1:1/ckptier")
    assert code == 2 and _first_line(out) == "catalog: postgresql://u:***@127.0.0.1:1/ckptier (--catalog)"
    assert "hunter2" not in out + err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["ls"], ["ls", "--json"], ["latest", "--job", "j"], ["plan"]], ids=lambda a: " ".join(a))
def test_read_only_commands_never_create_a_catalog(catalog_url: str, argv: list[str], capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A typo in --catalog used to create a directory, a database and its schema."""
    import sqlalchemy

    monkeypatch.chdir(tmp_path)  # no ./ckptier.toml
    monkeypatch.delenv("CKPTIER_CATALOG_URL", raising=False)
    monkeypatch.delenv("CKPTIER_CONFIG", raising=False)
    url = catalog_url
    if url.startswith("sqlite"):
        url = f"sqlite:///{tmp_path / 'typo' / 'dir' / 'c.db'}"
    code, out, err = run(capsys, *argv, "--catalog", url)
    assert code == 2 and "no catalog at" in err and "ckptier scan" in err and len(err.strip().splitlines()) == 1
    if url.startswith("sqlite"):
        assert not (tmp_path / "typo").exists()
        empty = tmp_path / "empty.db"
        empty.touch()
        code, _, err = run(capsys, *argv, "--catalog", f"sqlite:///{empty}")
        assert code == 2 and "empty file" in err and empty.stat().st_size == 0
    else:
        engine = sqlalchemy.create_engine(url)
        try:
            assert sqlalchemy.inspect(engine).get_table_names() == []  # no migration ran
        finally:
            engine.dispose()


# ------------------------------------------------------------- policy


@pytest.mark.parametrize(
    "config_text",
    [None, "", '[[policy]]\njobs = "*"\n', '[catalog]\nurl = "sqlite:////x.db"\n[[policy]]\njobs = "demo-*"\ngrace = "1h"\n'],
    ids=["no-file", "empty-file", "jobs-only", "rule-less"],
)
def test_apply_deletes_only_under_a_policy_the_user_wrote(
    env: dict[str, Path], capsys: pytest.CaptureFixture[str], config_text: str | None, monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """No ckptier.toml (or an empty one, or a [[policy]] with no rule) used to delete 8 of 11 verified
    checkpoints, milestones included, under a built-in keep_last = 3 nobody wrote."""
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # no ./ckptier.toml here
    if config_text is None:
        monkeypatch.delenv("CKPTIER_CONFIG")
    else:
        env["config"].write_text(config_text.replace("sqlite:////x.db", os.environ["CKPTIER_CATALOG_URL"]))
    assert run(capsys, "scan", str(env["hot"]))[0] == 0
    assert run(capsys, "verify")[0] == 0
    before = sorted(p.name for p in env["job_dir"].iterdir())

    code, out, err = run(capsys, "plan")  # a preview under the default is fine, and says so
    assert code == 0, err
    policy_line = out.splitlines()[1]
    assert policy_line.startswith("policy: built-in default, preview only") and "keep_last 3" in policy_line
    assert ("ckptier.toml" in policy_line) if config_text is None else (str(env["config"]) in policy_line)
    assert "preview only: apply deletes only under a retention policy you wrote" in out
    assert run(capsys, "apply", "--dry-run")[0] == 0

    code, out, err = run(capsys, "apply")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "[[policy]]" in lines[0] and "keep_last" in lines[0]
    assert sorted(p.name for p in env["job_dir"].iterdir()) == before  # nothing deleted

    env["config"].write_text('[[policy]]\njobs = "*"\nkeep_last = 3\n')
    monkeypatch.setenv("CKPTIER_CONFIG", str(env["config"]))
    code, out, _ = run(capsys, "plan")
    assert out.splitlines()[1] == f"policy: policy[0] (jobs = '*') in {env['config']}: keep_last 3, grace 2h, min_verified 2"
    assert "preview only" not in out
    code, out, err = run(capsys, "apply")
    assert code == 0, err
    assert len(list(env["job_dir"].iterdir())) < len(before)


def test_a_policy_for_other_jobs_leaves_a_job_kept_whole(env: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    env["config"].write_text('[[policy]]\njobs = "llama-*"\nkeep_last = 1\n')
    for argv in (["scan", str(env["hot"])], ["verify"]):
        assert run(capsys, *argv)[0] == 0
    before = sorted(p.name for p in env["job_dir"].iterdir())
    code, out, err = run(capsys, "apply")
    assert code == 0, err
    assert "no [[policy]] in ckptier.toml matches this job" in out
    assert sorted(p.name for p in env["job_dir"].iterdir()) == before


# ------------------------------------------------------------- telling the user


def test_verify_with_nothing_to_do_says_so(env: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "scan", str(env["hot"]))[0] == 0
    assert run(capsys, "verify")[0] == 0
    code, out, _ = run(capsys, "verify")
    assert code == 0 and out.splitlines()[1:] == [
        "nothing to verify: every one of the 8 cataloged checkpoints is already verified or still being written "
        "(1 incomplete); --deep re-reads every byte"
    ]
    code, out, _ = run(capsys, "verify", "--json")
    assert code == 0 and json.loads(out)["checkpoints"] == []


def test_verify_takes_the_nightly_auto_sample(env: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """``--sample auto/7`` is what the README's nightly schedule runs; the CLI refused it."""
    from datetime import UTC, datetime

    from ckptier.tasks.verify import rotating_slice

    assert run(capsys, "scan", str(env["hot"]))[0] == 0
    code, out, err = run(capsys, "verify", "--sample", "auto/7", "--json")
    assert code == 0, err
    assert json.loads(out)["sample"] == f"{rotating_slice(datetime.now(UTC).date(), 7)}/7"


def test_ls_and_latest_show_where_a_checkpoint_lives_now(env: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """An archive-only checkpoint is listed at its archive copy, not at the deleted hot path."""
    for argv in (["scan", str(env["hot"])], ["verify"], ["apply"]):
        assert run(capsys, *argv)[0] == 0
    archived = (env["archive"] / "demo-run" / "step-00000100").as_uri()
    code, out, _ = run(capsys, "ls", "--job", "demo-run")
    row = next(ln for ln in out.splitlines() if ln.split()[1:2] == ["100"])
    assert row.split()[-1] == archived and "step-00000100" not in row.replace(archived, "")
    code, out, _ = run(capsys, "ls", "--json")
    rows = {r["step"]: r for r in json.loads(out)}
    assert rows[100]["location"] == archived and rows[100]["hot_location"].startswith(env["hot"].as_uri())
    assert rows[175]["location"] == (env["job_dir"] / "step-00000175").as_uri()


def test_scan_of_a_file_says_it_is_a_file(env: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    target = env["job_dir"] / "step-00000025" / "metadata.json"
    code, _, err = run(capsys, "scan", str(target))
    assert code == 2 and "is a file, not a directory" in err and str(target.parent) in err


# ------------------------------------------------------------- drill input


DRILL_CHECK = """
import sys, time
from ckptier.flows.cli import main
t = time.perf_counter()
rc = main(sys.argv[1:])
elapsed = time.perf_counter() - t
sys.stderr.write(f"\\nELAPSED {elapsed:.3f} TORCH {'torch' in sys.modules}\\n")
sys.exit(rc)
"""


def _drill_rows() -> list[tuple[list[str], str]]:
    from ckptier.tasks.drill_inputs import cuda_problem

    rows = [(["--model", "nosuchmod:f"], "no module named 'nosuchmod'"),
            (["--model", "ckptier.tasks.drill_models:no_such_factory"], "defines no 'no_such_factory'"),
            (["--steps", "0"], "--steps: '0' is out of range"),
            (["--steps", "-2"], "--steps: '-2' is out of range")]
    if cuda_problem() is not None:
        rows.append((["--device", "cuda"], "--device cuda"))
    return rows


@pytest.mark.parametrize(("argv", "needle"), _drill_rows(), ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_drill_input_is_checked_at_once_without_torch(env: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                                      argv: list[str], needle: str) -> None:
    """These took 17-30 s (a fetch, then a worker importing torch) and printed two lines on stdout."""
    for pre in (["scan", str(env["hot"])], ["verify"]):
        assert run(capsys, *pre)[0] == 0
    proc = subprocess.run([sys.executable, "-c", DRILL_CHECK, "drill", *argv], capture_output=True, text=True,
                          env={**os.environ}, timeout=120)
    *message, stats = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    elapsed = float(stats.split()[1])
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(message) == 1 and needle in message[0]
    assert elapsed < 1.0 and stats.endswith("TORCH False"), stats


def test_a_drill_table_with_a_bad_model_is_refused_before_any_fetch(
    env: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from ckptier.storage.catalog.api import Catalog

    env["config"].write_text('[[policy]]\njobs = "*"\nkeep_last = 2\n[[drill]]\njobs = "*"\nmodel = "ckptier.tasks.drill_models:demo_modl"\n')
    for argv in (["scan", str(env["hot"])], ["verify"]):
        assert run(capsys, *argv)[0] == 0
    code, _, err = run(capsys, "drill", "--no-prefect")
    assert code == 2 and "[[drill]] model (jobs = '*') 'ckptier.tasks.drill_models:demo_modl'" in err and "did you mean 'demo_model'" in err
    with Catalog.open(f"sqlite:///{env['catalog']}") as cat:
        assert cat.drills(job="demo-run") == []  # nothing was attempted


# ------------------------------------------------------------- the first command


@pytest.mark.slow
def test_demo_from_a_fresh_home_with_prefect_defaults(tmp_path: Path) -> None:
    """``ckptier demo`` exactly as the README runs it: a new user's empty home, Prefect's own
    default settings (its temporary server must create its database on first start), offline."""
    home = tmp_path / "home"
    home.mkdir()
    env = {
        "PATH": os.environ["PATH"], "LANG": os.environ.get("LANG", "C.UTF-8"), "HOME": str(home),
        "PREFECT_HOME": str(home / ".prefect"), "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_CONFIG_HOME": str(home / ".config"), "XDG_CACHE_HOME": str(home / ".cache"),
        "TMPDIR": str(tmp_path), "PYTHONUNBUFFERED": "1",
    }
    script = Path(sys.executable).parent / "ckptier"
    proc = subprocess.run([str(script) if script.exists() else "ckptier", "demo", "--dir", str(tmp_path / "demo")],
                          capture_output=True, text=True, env=env, cwd=home, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "restore drill: demo-run step 275" in proc.stdout and "drill ok" in proc.stdout
    assert "starting Prefect's temporary local server" in proc.stderr.splitlines()[0]
    assert "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if "| ERROR" in ln or "| CRITICAL" in ln]
    assert errors == []  # no "Failed to send telemetry" or any other ERROR that is not one


@pytest.mark.slow
def test_demo_says_in_one_line_when_prefect_cannot_start(tmp_path: Path) -> None:
    """Instead of a 50-line RuntimeError: one line that suggests --no-prefect, before anything is written."""
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": os.environ["PATH"], "LANG": os.environ.get("LANG", "C.UTF-8"), "HOME": str(home),
           "PREFECT_HOME": str(home / ".prefect"), "TMPDIR": str(tmp_path),
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "0"}  # no time at all: it cannot come up
    script = Path(sys.executable).parent / "ckptier"
    proc = subprocess.run([str(script) if script.exists() else "ckptier", "demo", "--dir", str(tmp_path / "demo")],
                          capture_output=True, text=True, env=env, cwd=home, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[-1].startswith("ckptier: Prefect's temporary server did not start within 0 s")
    assert "ckptier demo --no-prefect" in lines[-1] and len(lines[-1]) < 400
    assert not (tmp_path / "demo").exists()
