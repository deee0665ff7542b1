"""The pure parts of a drill's verdict: its outcome, the run's recorded
losses (each source's parser, where to look) and the ``trajectory`` check."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from ckptier.storage.records import CheckpointRecord, FileRecord, Format, State
from ckptier.tasks.drill import Expected, WorkerResult, factory_needed, judge, random_streams_text
from ckptier.tasks.reports import NOT_JUDGED, drill_outcome
from ckptier.tasks.drill_trajectory import (
    RecordedLoss,
    Trajectory,
    compare_trajectory,
    parse_loss_history,
    parse_losses_jsonl,
    parse_metrics_csv,
    parse_trainer_state,
    recorded_trajectory,
    trajectory_sources,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    "ok, stage, outcome, words",
    [
        (True, None, "passed", "every check passed"),
        (False, None, "failed", "a check of the verdict failed"),
        (False, "judge", "failed", "a check of the verdict failed"),
        (False, "fetch", "failed", "could not be fetched"),
        (False, "load", "failed", "does not load"),
        (False, "restore", "failed", "does not restore"),
        (False, "train", "failed", "does not train"),
        (False, "timeout", "failed", "ran out of time"),
        (False, "crash", "failed", "crashed"),
        (False, "fit", NOT_JUDGED, "the factory does not fit this job"),
        (False, "no-model", NOT_JUDGED, "no drill model was given"),
        (False, "factory", NOT_JUDGED, "does not load"),
        (False, "not-started", NOT_JUDGED, "does not load"),
        (False, "build", NOT_JUDGED, "could not be built"),
        (False, "unsupported", NOT_JUDGED, "cannot be drilled yet"),
        (False, "setup", NOT_JUDGED, "no device"),
        (False, "rendezvous", NOT_JUDGED, "could not meet"),
    ],
)
def test_drill_outcome_table(ok: bool, stage: str | None, outcome: str, words: str) -> None:
    got, reason = drill_outcome(ok, stage)
    assert got == outcome and words in reason


def _record(fmt: Format, files: tuple[str, ...], *, step: int = 20, location: str = "/hot/job/step-20") -> CheckpointRecord:
    return CheckpointRecord(id=step, job="job", step=step, format=fmt, state=State.VERIFIED, location=location,
                            bytes=1, saved_at=T0, first_seen=T0, last_seen=T0, missing_since=None, verified_at=T0,
                            state_reason=None, files=tuple(FileRecord(r, 1, None, None, None, None, "ok", None) for r in files))


def test_a_model_factory_is_needed_except_for_hugging_face_checkpoints_with_their_config() -> None:
    assert factory_needed(_record(Format.HF, ("config.json", "model.safetensors", "trainer_state.json"))) is None
    assert factory_needed(_record(Format.HF_WEIGHTS, ("config.json", "model.safetensors"))) is None
    assert "no config.json" in (factory_needed(_record(Format.HF, ("model.safetensors",))) or "")
    assert "tensors only" in (factory_needed(_record(Format.DCP, (".metadata", "__0_0.distcp"))) or "")


def test_recorded_losses_parse_from_every_source() -> None:
    jsonl = b'{"step": 21, "loss": 0.5}\nnot json\n{"step": 22, "loss": "x"}\n{"step": 23, "loss": 0.25}\n'
    assert parse_losses_jsonl(jsonl) == [RecordedLoss(21, 0.5), RecordedLoss(23, 0.25)]
    meta = json.dumps({"step": 30, "loss_history": {"21": 0.5, "22": 0.4, "x": 1.0}}).encode()
    assert parse_loss_history(meta) == [RecordedLoss(21, 0.5), RecordedLoss(22, 0.4)]
    # HF logs the mean since the previous logged loss: windows of logging_steps (eval rows ignored)
    state = json.dumps({"logging_steps": 2, "log_history": [
        {"loss": 1.0, "step": 2}, {"eval_loss": 9.0, "step": 2}, {"loss": 0.8, "step": 4}, {"train_loss": 0.9, "step": 4}]})
    assert parse_trainer_state(state.encode()) == [RecordedLoss(2, 1.0, 2), RecordedLoss(4, 0.8, 2)]
    # Lightning logs training step N's loss at global step N - 1
    csv = b"epoch,step,train_loss\n0,0,1.5\n0,1,1.25\n0,2,\n"
    assert parse_metrics_csv(csv) == [RecordedLoss(1, 1.5), RecordedLoss(2, 1.25)]
    assert parse_losses_jsonl(b"\xff\xfe") == [] and parse_trainer_state(b"[]") == [] and parse_loss_history(b"{") == []


def test_sources_are_the_job_log_the_format_logs_and_later_checkpoints_nearest_first() -> None:
    record = _record(Format.HF, ("trainer_state.json",))
    later = [_record(Format.HF, ("trainer_state.json",), step=s, location=f"/hot/job/step-{s}") for s in (40, 30, 10)]
    assert trajectory_sources(record, later) == [
        ("losses.jsonl", "/hot/job/losses.jsonl"),
        ("trainer_state.json", "/hot/job/step-30/trainer_state.json"),
        ("trainer_state.json", "/hot/job/step-40/trainer_state.json"),
    ]
    lightning = _record(Format.LIGHTNING, ("e.ckpt",), location="/hot/logs/v0/checkpoints/e.ckpt")
    assert [loc for _, loc in trajectory_sources(lightning, [])] == [
        "/hot/logs/v0/checkpoints/losses.jsonl", "/hot/logs/v0/checkpoints/metrics.csv", "/hot/logs/v0/metrics.csv"]

    files = {"/hot/job/step-30/trainer_state.json": json.dumps({"log_history": [
        {"loss": 0.5, "step": 21}, {"loss": 0.4, "step": 22}]}).encode()}
    got = recorded_trajectory(record, later, files.get, steps=3)
    assert got == Trajectory("/hot/job/step-30/trainer_state.json", (RecordedLoss(21, 0.5), RecordedLoss(22, 0.4)))
    assert recorded_trajectory(record, [], files.get, steps=3) is None


TRAJ = Trajectory("losses.jsonl", (RecordedLoss(21, 1.0), RecordedLoss(22, 0.8), RecordedLoss(23, 0.6)))


@pytest.mark.parametrize(
    "losses, trajectory, rtol, status, words",
    [
        ([1.0, 0.8, 0.6], TRAJ, 0.02, "ok", "3 recorded losses of steps 21..23 retraced (rtol 0.02, largest deviation 0"),
        ([1.001, 0.8, 0.6], TRAJ, 0.02, "ok", "largest deviation 0.001"),
        ([1.0, 0.8, 0.6], TRAJ, 0.0, "ok", "bit-exact"),
        ([1.0, 0.8, 0.6000001], TRAJ, 0.0, "failed", "at step 23 the loss is 0.6"),
        ([2.5, 0.8, 0.6], TRAJ, 0.02, "failed", "at step 21 the loss is 2.5, the run recorded 1 (relative 1.5, rtol 0.02"),
        ([1.0, 0.8], TRAJ, 0.02, "ok", "2 recorded losses of steps 21..22"),
        ([1.0, 0.8, 0.6], Trajectory("s", (RecordedLoss(22, 0.9, 2),)), 0.02, "ok", "1 recorded loss of steps"),
        ([1.0, 0.8, 0.6], Trajectory("s", (RecordedLoss(22, 0.9, 3),)), 0.02, "skipped", "records no loss for steps 21..23"),
        ([1.0, 0.8, 0.6], None, 0.02, "skipped", "the run recorded no loss for steps 21..23"),
    ],
)
def test_compare_trajectory_table(losses: list[float], trajectory: Trajectory | None, rtol: float, status: str,
                                  words: str) -> None:
    got = compare_trajectory(losses, 21, trajectory, rtol=rtol)
    assert got.status == status and words in got.detail, got


def _result(**changes: object) -> WorkerResult:
    base = WorkerResult(checkpoint="/x", format="dcp", steps=3, device="cpu", losses=(1.0, 0.8, 0.6),
                        losses_repeat=(1.0, 0.8, 0.6), trainable_params=4, first_step=20)
    return replace(base, **changes)  # type: ignore[arg-type]


def test_judge_checks_the_trajectory_with_the_policy_or_the_factory_tolerance() -> None:
    assert [c.name for c in judge([_result()]).checks][-1] != "trajectory"  # not asked: no check
    ok = judge([_result()], trajectory=Expected(TRAJ))
    assert ok.ok and ok.checks[-1].name == "trajectory"
    off = judge([_result(losses=(1.0, 0.8, 0.62), losses_repeat=(1.0, 0.8, 0.62))], trajectory=Expected(TRAJ))
    assert not off.ok and off.summary.startswith("drill failed: trajectory: the drill does not retrace the run: at step 23")
    assert judge([_result(losses=(1.0, 0.8, 0.62), losses_repeat=(1.0, 0.8, 0.62))], trajectory=Expected(TRAJ, 0.05)).ok
    exact = judge([_result(losses=(1.0, 0.8, 0.6000001), losses_repeat=(1.0, 0.8, 0.6000001), trajectory_rtol=0.0)],
                  trajectory=Expected(TRAJ, 0.05))
    assert not exact.ok and "bit-exact" in exact.summary  # a deterministic factory asked for bit-exact
    synthetic = judge([_result(losses=(9.0, 9.0, 9.0), losses_repeat=(9.0, 9.0, 9.0), synthetic_batches=True)],
                      trajectory=Expected(TRAJ))
    assert synthetic.ok and "skipped: the drill trained on batches of its own" in synthetic.checks[-1].detail
    assert _result().trained_steps == (21, 23) and _result(losses=()).trained_steps is None


@pytest.mark.parametrize(("left", "keeps_state", "ok", "trajectory", "optimizer"), [
    # the checkpoint's optimizer state was not restored and the fresh optimizer keeps state (Adam):
    # the losses cannot retrace the run, which is no fault of the checkpoint
    ("its torch_dist optimizer state (6 tensors) is not restored yet", True, True,
     "skipped: its torch_dist optimizer state (6 tensors) is not restored yet, and the drill's fresh optimizer",
     "skipped: its torch_dist optimizer state (6 tensors) is not restored yet; the drill's optimizer starts fresh"),
    # a stateless optimizer (plain SGD) continues the run exactly from fresh: the trajectory still judges
    ("its torch_dist optimizer state (6 tensors) is not restored yet", False, False,
     "the drill does not retrace the run", "skipped: its torch_dist optimizer state"),
    # a checkpoint without optimizer state, whose drill departs from the run: judged, as before
    (None, True, False, "the drill does not retrace the run", "skipped: the checkpoint has no optimizer state"),
])
def test_optimizer_state_the_drill_did_not_restore_skips_the_trajectory_only_where_it_matters(
        left: str | None, keeps_state: bool, ok: bool, trajectory: str, optimizer: str) -> None:
    off = (1.0, 0.8, 0.62)  # 3% off the run at step 23
    got = judge([_result(losses=off, losses_repeat=off, optimizer_left=left, optimizer_keeps_state=keeps_state)],
                trajectory=Expected(TRAJ))
    checks = {c.name: c for c in got.checks}
    assert got.ok is ok, got.summary
    assert trajectory in checks["trajectory"].detail
    assert checks["optimizer_continues"].detail.startswith(optimizer) and checks["optimizer_continues"].ok


@pytest.mark.parametrize(("saved", "resumed", "text"), [
    ((), (), "skipped: the checkpoint saved no random state; dropout draws the drill's own masks"),
    (("cpu", "numpy", "python"), ("python", "numpy", "cpu"), "continued the run's python, numpy, cpu random streams"),
    (("cpu", "cuda", "numpy", "python"), ("python", "numpy", "cpu"),
     "continued the run's python, numpy, cpu random streams; not cuda (left at the drill's seed)"),
    (("cpu",), (), "skipped: none of the saved streams (cpu) fits this drill's generators"),
])
def test_random_streams_say_what_the_drill_continued(saved: tuple[str, ...], resumed: tuple[str, ...], text: str) -> None:
    assert random_streams_text(saved, resumed) == text
    verdict = judge([_result(rng_saved=saved, rng_resumed=resumed)])
    assert verdict.ok and [c.detail for c in verdict.checks if c.name == "random_streams"] == [text]
