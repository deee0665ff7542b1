"""Orbax (JAX) checkpoints: recognised, saves in flight, verified, drilled where JAX is (ckptier.formats.orbax).

The real checkpoints come from ``orbax.checkpoint.CheckpointManager``
(``orbax_run``; skipped without JAX/Orbax). The layout tests follow
orbax-checkpoint 0.12.8's own names (``_CHECKPOINT_METADATA`` and
``commit_success.txt`` in ``step_lib``/``atomicity``, the
``.orbax-checkpoint-tmp-`` suffix of ``atomicity.TMP_DIR_SUFFIX``) and
always run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from ckptier.storage.records import Format
from ckptier.tasks.drill import DrillRequest, judge
from ckptier.tasks.drill_worker import run_request

from tests.fixtures.checkpoints import CheckpointRun, copy_run
from tests.fixtures.listing import only, reasons, recognise_listing, scan

REPO = Path(__file__).resolve().parents[1]
FACTORY = "tests.fixtures.checkpoints:tiny_mlp_drill_spec"
META = json.dumps({"item_handlers": {"default": "StandardCheckpointHandler"}, "metrics": {"loss": 0.5},
                   "init_timestamp_nsecs": 1, "commit_timestamp_nsecs": 2}).encode()


def _step(root: str, name: str, *, meta: bytes | None = META, success: bool = True) -> dict[str, bytes | int]:
    keys: dict[str, bytes | int] = {f"{root}/{name}/default/_METADATA": 300, f"{root}/{name}/default/manifest.ocdbt": 40,
                                    f"{root}/{name}/default/ocdbt.process_0/d/0a1b2c": 900,
                                    f"{root}/{name}/default/commit_success.txt": 40}
    if meta is not None:
        keys[f"{root}/{name}/_CHECKPOINT_METADATA"] = meta
    if success:
        keys[f"{root}/{name}/commit_success.txt"] = 40
    return keys


def test_step_directories_with_item_subdirectories_are_one_checkpoint_each() -> None:
    rec = recognise_listing({**_step("j", "100"), **_step("j", "ckpt_200", success=False)})
    assert rec.unrecognised == ()
    assert [(c.job, c.step, c.format, c.committed, len(c.files), c.recorded_loss) for c in rec.checkpoints] == [
        ("j", 100, Format.ORBAX, True, 6, 0.5), ("j", 200, Format.ORBAX, True, 5, 0.5)]


def test_a_save_in_flight_is_incomplete_and_kept_through_the_grace() -> None:
    from ckptier.storage.records import CheckpointRecord, State
    from ckptier.tasks.retention import KeepLast, Policy, plan_retention

    tmp = "300.orbax-checkpoint-tmp-1730000000000"
    keys = {**_step("j", "200"), **{k.replace("j/200", f"j/{tmp}"): v for k, v in _step("j", "200", meta=None).items()}}
    keys[f"j/{tmp}/default.orbax-checkpoint-tmp-1730000000001/_METADATA"] = 10
    rec = recognise_listing(keys)
    assert rec.unrecognised == ()
    flight = only(rec.checkpoints, 300)
    assert (flight.prefix, flight.committed) == (f"j/{tmp}", False) and "Orbax save in flight" in flight.reason
    now = datetime(2026, 11, 30, tzinfo=UTC)
    records = [CheckpointRecord(id=i, job="j", step=c.step, format=c.format,
                                state=State.VERIFIED if c.committed else State.INCOMPLETE, location=c.prefix,
                                bytes=c.bytes, saved_at=now - timedelta(minutes=5), first_seen=now, last_seen=now,
                                missing_since=None, verified_at=now if c.committed else None, state_reason=c.reason)
               for i, c in enumerate(rec.checkpoints)]
    plan = plan_retention(records, Policy(rules=(KeepLast(1),)), now=now)
    flight_item = next(item for item in plan.items if item.step == 300)
    assert flight_item.action == "keep" and "in flight" in " ".join(flight_item.reasons)


def test_no_marker_means_in_flight_and_no_step_is_not_guessed() -> None:
    rec = recognise_listing({**_step("j", "5", meta=b'{"commit_timestamp_nsecs": null}', success=False),
                             **_step("j", "final")})
    (c,) = rec.checkpoints
    assert (c.step, c.committed) == (5, False)
    assert "no step in the path" in reasons(rec)["j/final/"]


# --- written by Orbax ------------------------------------------------------------------


def test_real_orbax_checkpoints_are_recognised(orbax_run: CheckpointRun) -> None:
    rec = scan(orbax_run.root)
    assert rec.unrecognised == ()
    assert [(c.job, c.step, c.format, c.prefix) for c in rec.checkpoints] == [
        (orbax_run.job, s, Format.ORBAX, orbax_run.steps[s].prefix) for s in sorted(orbax_run.steps)]
    for c in rec.checkpoints:
        assert c.committed, c.reason
        assert tuple(f.relpath for f in c.files) == orbax_run.steps[c.step].files
        assert c.recorded_loss == pytest.approx(orbax_run.steps[c.step].loss)


def test_real_orbax_save_renamed_back_to_in_flight(orbax_run: CheckpointRun, tmp_path: Path) -> None:
    run = copy_run(orbax_run, tmp_path / "copy")
    run.path(6).rename(run.root / run.job / "6.orbax-checkpoint-tmp-1796050348643")
    rec = scan(run.root)
    assert [(c.step, c.committed) for c in rec.checkpoints] == [(2, True), (4, True), (6, False)]


def test_real_orbax_checkpoint_drills_with_jax(orbax_run: CheckpointRun, tmp_path: Path) -> None:
    step = max(orbax_run.steps)
    result = run_request(DrillRequest(str(orbax_run.path(step)), "orbax", FACTORY, 3, "cpu", str(tmp_path / "r.json")))
    verdict = judge([result])
    assert verdict.ok, verdict.summary
    assert not result.optimizer_loaded and result.checkpoint_step == step


@pytest.mark.slow
def test_without_jax_the_drill_says_so_in_one_line(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow"
    (shadow / "orbax").mkdir(parents=True)
    (shadow / "orbax" / "__init__.py").write_text("raise ImportError('orbax is not installed here')\n")
    step = tmp_path / "j" / "4"
    (step / "default").mkdir(parents=True)
    (step / "default" / "_METADATA").write_text("{}")
    code = ("import json; from ckptier.tasks.drill import DrillRequest; from ckptier.tasks.drill_worker import run_request\n"
            f"r = run_request(DrillRequest({str(step)!r}, 'orbax', {FACTORY!r}, 2, 'cpu', 'x.json'))\n"
            "print(json.dumps([r.error_stage, r.error]))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), str(REPO)])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, check=False)
    stage, error = json.loads(done.stdout.strip().splitlines()[-1])
    assert stage == "load" and "needs JAX to drill" in error and "pip install 'ckptier[orbax]'" in error
    assert "\n" not in error


def test_cli_lists_orbax_checkpoints_with_their_states(
    orbax_run: CheckpointRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckptier.flows.cli import main

    hot = tmp_path / "hot"
    shutil.copytree(orbax_run.root, hot)
    (hot / orbax_run.job / "6").rename(hot / orbax_run.job / "6.orbax-checkpoint-tmp-1796050348643")
    monkeypatch.setenv("CKPTIER_CATALOG_URL", f"sqlite:///{tmp_path / 'catalog.db'}")
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["scan", str(hot)]) == 0
    assert main(["verify"]) == 0
    capsys.readouterr()
    assert main(["ls", "--json", "--all"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted((r["step"], r["format"], r["state"]) for r in rows) == [
        (2, "orbax", "verified"), (4, "orbax", "verified"), (6, "orbax", "incomplete")]


@pytest.mark.slow
def test_orbax_checkpoints_are_tiered_and_a_save_in_flight_is_never_deleted(
    orbax_run: CheckpointRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import filecmp

    from ckptier.flows.cli import main

    hot, archive = tmp_path / "hot", tmp_path / "archive"
    shutil.copytree(orbax_run.root, hot)
    job_dir = hot / orbax_run.job
    flight = "8.orbax-checkpoint-tmp-1796050348643"
    shutil.copytree(job_dir / "6", job_dir / flight)
    (tmp_path / "ckptier.toml").write_text(
        f'[[policy]]\njobs = "*"\nkeep_last = 1\nmin_verified = 1\nmilestones = [2]\narchive = "{archive}"\n')
    monkeypatch.setenv("CKPTIER_CATALOG_URL", f"sqlite:///{tmp_path / 'catalog.db'}")
    monkeypatch.setenv("CKPTIER_CONFIG", str(tmp_path / "ckptier.toml"))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["scan", str(hot)]) == 0
    assert main(["verify"]) == 0
    assert main(["apply", "--no-prefect"]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in job_dir.iterdir()) == ["6", flight]  # 2 archived, 4 deleted, the save in flight kept
    assert main(["ls", "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert (rows[2]["tiers"], rows[6]["tiers"], rows[8]["state"]) == (["archive"], ["hot"], "incomplete")
    dest = tmp_path / "restored"
    assert main(["fetch", "--job", orbax_run.job, "--step", "2", str(dest)]) == 0
    for rel in orbax_run.steps[2].files:
        assert filecmp.cmp(dest / rel, orbax_run.path(2) / rel, shallow=False), rel


def test_orbax_0_12_names_a_save_in_flight_without_a_timestamp() -> None:
    tmp = "6.orbax-checkpoint-tmp"  # orbax-checkpoint 0.12's temporary_paths: no -{T}
    keys = {**_step("j", "4"), **{k.replace("j/4", f"j/{tmp}"): v for k, v in _step("j", "4", meta=None).items()}}
    rec = recognise_listing(keys)
    assert rec.unrecognised == ()
    flight = only(rec.checkpoints, 6)
    assert (flight.prefix, flight.committed) == (f"j/{tmp}", False) and "Orbax save in flight" in flight.reason
    assert only(rec.checkpoints, 4).committed
    # a name that merely contains the suffix's letters is not a save in flight
    rec = recognise_listing(_step("j", "7.orbax-checkpoint-tmpfoo"))
    assert not [c for c in rec.checkpoints if "in flight" in c.reason]


WITH_OPTIMIZER = r"""
import json, sys
from pathlib import Path
import orbax.checkpoint as ocp
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from tests.fixtures.checkpoints import LR, tiny_batch, tiny_loss, tiny_mlp
from tests.fixtures.library_checkpoints import orbax_tree

root = Path(sys.argv[1])
model = tiny_mlp()
optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
manager = ocp.CheckpointManager(root / "jax" / "opt", options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False))
losses = {}
for step in range(1, 10):
    optimizer.zero_grad()
    loss = tiny_loss(model, tiny_batch(step))
    loss.backward()
    optimizer.step()
    losses[step] = loss.item()
    if step == 6:
        flat = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
        opt = {}
        for key, value in flat.items():
            if key.startswith("state."):
                fqn, name = key[len("state."):].rsplit(".", 1)
                opt.setdefault(fqn, {})[name] = value.detach().numpy().copy()
        manager.save(step, args=ocp.args.Composite(model=ocp.args.StandardSave(orbax_tree(model)),
                                                   optimizer=ocp.args.StandardSave(opt)))
manager.wait_until_finished()
(root / "jax" / "opt" / "losses.jsonl").write_text("".join(json.dumps({"step": k, "loss": v}) + "\n" for k, v in losses.items()))
"""


@pytest.mark.slow
def test_orbax_optimizer_state_restores_as_optimizer_state_and_retraces_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("orbax.checkpoint", reason="JAX/Orbax are not installed; pip install -e '.[test]'")
    from ckptier.flows.cli import main

    hot = tmp_path / "hot"
    subprocess.run([sys.executable, "-c", WITH_OPTIMIZER, str(hot)], cwd=REPO, check=True, capture_output=True,
                   timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert sorted(p.name for p in (hot / "jax" / "opt" / "6").iterdir() if p.is_dir()) == ["model", "optimizer"]
    monkeypatch.setenv("CKPTIER_CATALOG_URL", f"sqlite:///{tmp_path / 'catalog.db'}")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert main(["scan", str(hot)]) == 0 and main(["verify"]) == 0
    capsys.readouterr()
    code = main(["drill", "--job", "jax/opt", "--device", "cpu", "--steps", "3", "--model", FACTORY, "--json",
                 "--no-prefect"])
    (report,) = json.loads(capsys.readouterr().out)
    assert code == 0 and report["verdict"] == "passed", report["summary"]
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["optimizer_continues"]["detail"] == "step counter 6 -> 9", checks  # restored as optimizer state
    assert checks["trajectory"]["ok"] and checks["trajectory"]["detail"].startswith("3 recorded losses of steps 7..9")
    assert report["trained_steps"] == [7, 9] and report["stack"]["orbax-checkpoint"]
