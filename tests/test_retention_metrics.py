"""Metrics for ``keep_best``, read at scan time from what the runs themselves wrote.

Checkpoints written by the real libraries (a ``transformers.Trainer`` that
evaluates, Lightning's ``ModelCheckpoint(monitor=...)``, Orbax's
``CheckpointManager.save(metrics=...)``), the guide layout's
``metadata.json`` and a job's ``metrics.jsonl`` beside any format's
checkpoints: recognition reads the numbers, the catalog stores them, ``ls``
shows them and the plan keeps the best by them, with no read at plan time.
"""

from __future__ import annotations

import json
import math
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ckptier.flows.cli import main
from ckptier.formats.metrics import metrics_in_name, parse_metrics_jsonl, step_metrics
from ckptier.storage.catalog.api import Catalog
from ckptier.storage.records import MAX_METRICS, State, clean_metrics
from ckptier.tasks.retention import KeepBest, KeepLast, Policy, plan_retention
from ckptier.tasks.scan import scan_url
from tests.fixtures.checkpoints import CheckpointRun, copy_run
from tests.fixtures.listing import reasons, scan


def _metrics(root: Path) -> dict[int, dict[str, float]]:
    rec = scan(root)
    return {c.step: dict(c.metrics) for c in rec.checkpoints}


# ------------------------------------------------------------------ the libraries' own checkpoints


def test_hf_trainer_metrics_are_the_log_history_at_the_step(hf_eval_run: tuple[CheckpointRun, Any]) -> None:
    run, logged = hf_eval_run
    got = _metrics(run.root)
    assert sorted(got) == sorted(logged)
    for step, values in logged.items():
        assert "eval_loss" in values and "loss" in values
        assert got[step] == pytest.approx(values)  # eval_loss, loss, grad_norm, learning_rate, eval_runtime...
        assert "epoch" not in got[step] and "step" not in got[step]
    # best_metric (the best so far, of another checkpoint) is not taken as this checkpoint's
    state = json.loads((run.root / run.job / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["best_metric"] == pytest.approx(min(v["eval_loss"] for v in logged.values()))


def test_lightning_metrics_come_from_the_file_name(lightning_monitor_run: tuple[CheckpointRun, Any]) -> None:
    run, scores = lightning_monitor_run
    got = _metrics(run.root)
    assert sorted(got) == sorted(scores) == [2, 4, 6]
    for step, score in scores.items():
        # the name holds the score ModelCheckpoint ranked, to the 4 decimals its template asked for
        assert got[step] == {"val_loss": pytest.approx(score, abs=5e-5)}


def test_orbax_metrics_are_the_managers_metrics_item(orbax_run: CheckpointRun) -> None:
    got = _metrics(orbax_run.root)
    assert sorted(got) == sorted(orbax_run.steps)
    for step, want in orbax_run.steps.items():
        assert got[step] == {"loss": pytest.approx(want.loss, rel=1e-6)}


def test_guide_metrics_are_metadata_jsons_metrics(tmp_path: Path) -> None:
    import torch

    from ckptier.tasks.demo import write_guide_checkpoint

    for step, value in ((100, 0.52), (200, 0.41)):
        write_guide_checkpoint(tmp_path / "runs" / "mlp" / f"step-{step:08d}", {"rank-0000/model.pt": {"w": torch.ones(2)}},
                               step=step, loss=1.0, extra={"metrics": {"eval_loss": value, "note": "x", "bad": float("nan")}})
    assert _metrics(tmp_path) == {100: {"eval_loss": 0.52}, 200: {"eval_loss": 0.41}}


def test_a_jobs_metrics_jsonl_gives_any_format_its_metrics(dcp_run: CheckpointRun, tmp_path: Path) -> None:
    run = copy_run(dcp_run, tmp_path / "copy")
    lines = [{"step": 2, "eval_loss": 0.9}, {"step": 4, "eval_loss": 0.7, "acc": 0.5}, "not json",
             {"step": 4, "eval_loss": 0.65}, {"step": 6, "eval_loss": "n/a"}, {"eval_loss": 0.1}, {"step": 99, "eval_loss": 0.2}]
    (run.root / run.job / "metrics.jsonl").write_text(
        "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    rec = scan(run.root)
    assert {c.step: dict(c.metrics) for c in rec.checkpoints} == {2: {"eval_loss": 0.9}, 4: {"acc": 0.5, "eval_loss": 0.65}, 6: {}}
    key = f"{run.job}/metrics.jsonl"
    assert reasons(rec) == {key: f"{key}: 2 line(s) skipped (line 3: not a JSON object with a whole step, "
                                 f"e.g. {{\"step\": 1000, \"eval_loss\": 0.41}})"}
    assert rec.job_metrics == {run.job: {2: {"eval_loss": 0.9}, 4: {"acc": 0.5, "eval_loss": 0.65}, 99: {"eval_loss": 0.2}}}


def test_a_checkpoints_own_metrics_win_over_the_jobs_metrics_jsonl(orbax_run: CheckpointRun, tmp_path: Path) -> None:
    run = copy_run(orbax_run, tmp_path / "copy")
    (run.root / run.job / "metrics.jsonl").write_text(json.dumps({"step": 4, "loss": 123.0, "eval_acc": 0.5}) + "\n")
    got = _metrics(run.root)
    assert got[4] == {"loss": pytest.approx(run.steps[4].loss, rel=1e-6), "eval_acc": 0.5}
    assert reasons(scan(run.root)) == {}  # the job's file is its own, never stray


# ------------------------------------------------------------------ the pure readers


@pytest.mark.parametrize(("name", "expected"), [
    ("epoch=0-step=300-val_loss=0.2300.ckpt", {"val_loss": 0.23}),
    ("epoch=2-step=300-val_loss=0.23-val_acc=0.91.ckpt", {"val_loss": 0.23, "val_acc": 0.91}),
    ("model-step=10-val_acc=-0.5-v1.ckpt", {"val_acc": -0.5}),
    ("epoch=0-step=300.ckpt", {}),
    ("step=300-loss=1e-03.ckpt", {"loss": 0.001}),
    ("step=300-val_loss=nan.ckpt", {}),
])
def test_metrics_in_a_name(name: str, expected: dict[str, float]) -> None:
    assert metrics_in_name(name) == pytest.approx(expected)


def test_readers_keep_finite_numbers_only_and_are_bounded() -> None:
    assert step_metrics([{"step": 2, "loss": 1.0, "epoch": 0.5}, {"step": 2, "eval_loss": 0.5, "flag": True},
                         {"step": 3, "loss": 9.0}, "junk"], 2) == {"eval_loss": 0.5, "loss": 1.0}
    many = {f"m{i:03d}": float(i) for i in range(MAX_METRICS + 10)} | {"x" * 200: 1.0, "inf": math.inf}
    kept = clean_metrics(many)
    assert len(kept) == MAX_METRICS and max(kept) == f"m{MAX_METRICS - 1:03d}"
    by_step, note = parse_metrics_jsonl(b'{"step": 1, "a": 1}\n\n{"step": "2", "a": 2}\n[1]\n{"step": -1, "a": 3}\n')
    assert by_step == {1: {"a": 1.0}, 2: {"a": 2.0}} and note is not None and "2 line(s) skipped (line 4" in note


# ------------------------------------------------------------------ catalog, ls, plan


def _write_guide(root: Path, step: int, eval_loss: float | None) -> None:
    d = root / "job" / f"step-{step:08d}"
    (d / "rank-0000").mkdir(parents=True)
    (d / "rank-0000" / "model.pt").write_bytes(b"w" * 10)
    meta: dict[str, Any] = {"step": step}
    if eval_loss is not None:
        meta["metrics"] = {"eval_loss": eval_loss}
    (d / "metadata.json").write_text(json.dumps(meta))


def _settle(root: Path) -> None:
    import os
    import time

    t = time.time() - 60
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            os.utime(os.path.join(dirpath, name), (t, t))
        os.utime(dirpath, (t, t))


def test_metrics_reach_the_catalog_ls_and_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "hot"
    for step, loss in ((100, 0.9), (200, 0.3), (300, 0.5), (400, None), (500, 0.7)):
        _write_guide(root, step, loss)
    _settle(root)
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    with Catalog.open(url) as cat:
        scan_url(str(root), cat, now=datetime.now(UTC))
        records = cat.checkpoints(job="job")
    assert {c.step: c.metric("eval_loss") for c in records} == {100: 0.9, 200: 0.3, 300: 0.5, 400: None, 500: 0.7}

    assert main(["ls", "--catalog", url, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [p["metrics"] for p in printed] == [{"eval_loss": 0.9}, {"eval_loss": 0.3}, {"eval_loss": 0.5}, {}, {"eval_loss": 0.7}]
    assert main(["ls", "--catalog", url]) == 0
    table = capsys.readouterr().out
    assert "METRICS" in table and "eval_loss=0.3" in table

    verified = [c.__class__(**{**c.__dict__, "state": State.VERIFIED}) for c in records]
    policy = Policy((KeepLast(1), KeepBest("eval_loss", "min", 2, keep_without_metric=False)), min_verified=0)
    plan = plan_retention(verified, policy, now=datetime.now(UTC))
    assert {i.step: i.action for i in plan.items} == {100: "delete", 200: "keep", 300: "keep", 400: "delete", 500: "keep"}


def test_metrics_jsonl_reaches_checkpoints_a_rescan_does_not_list_again(tmp_path: Path) -> None:
    """An evaluation logged after the save: the checkpoint's directory is unchanged, so a
    local rescan skips it, and the metric still reaches its catalog row."""
    root = tmp_path / "hot"
    for step in (100, 200):
        _write_guide(root, step, None)
    _settle(root)
    with Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
        first = scan_url(str(root), cat, now=datetime.now(UTC))
        assert first.checkpoints == 2
        (root / "job" / "metrics.jsonl").write_text(json.dumps({"step": 200, "eval_loss": 0.25}) + "\n")
        again = scan_url(str(root), cat, now=datetime.now(UTC) + timedelta(minutes=1))
        assert again.unchanged_dirs == 2  # neither checkpoint directory was listed again
        assert {c.step: dict(c.metrics) for c in cat.checkpoints(job="job")} == {100: {}, 200: {"eval_loss": 0.25}}
        # a new save listed beside skipped ones: both get the file's metrics
        _write_guide(root, 300, None)
        _settle(root / "job" / "step-00000300")
        with (root / "job" / "metrics.jsonl").open("a") as fh:
            fh.write(json.dumps({"step": 100, "eval_loss": 0.5}) + "\n" + json.dumps({"step": 300, "eval_loss": 0.3}) + "\n")
        third = scan_url(str(root), cat, now=datetime.now(UTC) + timedelta(minutes=1, seconds=30))
        assert third.unchanged_dirs == 2
        assert {c.step: c.metric("eval_loss") for c in cat.checkpoints(job="job")} == {100: 0.5, 200: 0.25, 300: 0.3}
        # the checkpoint's own metadata wins over the job's file, for a name both give
        shutil.rmtree(root / "job" / "step-00000100")
        _write_guide(root, 100, 0.8)
        (root / "job" / "metrics.jsonl").write_text(
            json.dumps({"step": 100, "eval_loss": 0.1, "acc": 0.9}) + "\n" + json.dumps({"step": 200, "eval_loss": 0.25}) + "\n"
            + json.dumps({"step": 300, "eval_loss": 0.3}) + "\n")
        scan_url(str(root), cat, now=datetime.now(UTC) + timedelta(minutes=2), full=True)
        assert {c.step: dict(c.metrics) for c in cat.checkpoints(job="job")} == {
            100: {"acc": 0.9, "eval_loss": 0.8}, 200: {"eval_loss": 0.25}, 300: {"eval_loss": 0.3}}
