"""Restore drills on real checkpoints (guide, DCP, HF Trainer, Lightning), the
isolated subprocess, and the pure candidate choice and verdict."""

from __future__ import annotations

import json
import os
import pickle
import textwrap
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch

from ckptier.storage.errors import ConfigError
from ckptier.storage.records import CheckpointRecord, CopyRecord, Format, State, Tier
from ckptier.tasks.drill import (
    DrillRequest,
    WorkerResult,
    choose_candidates,
    judge,
    worker_env,
)
from ckptier.tasks.drill_launch import run_drill_subprocess
from ckptier.tasks.drill_worker import run_request, state_dict_problems
from ckptier.tasks.drill_models import DrillSpec, build_spec, demo_model, demo_train, parse_factory_spec, resolve_factory

DEMO = "ckptier.tasks.drill_models:demo_model"
TRAINED_STEPS = 60

# Factories the drill subprocess imports by file path (it cannot import tests/).
FACTORIES = textwrap.dedent(
    '''
    import json, os, time
    from pathlib import Path
    import torch
    from torch import nn
    from ckptier.tasks.drill_models import DrillSpec, demo_model


    def frozen_first_layer():
        spec = demo_model()
        for p in spec.model.net[0].parameters():
            p.requires_grad_(False)
        spec.optimizer = torch.optim.AdamW([p for p in spec.model.parameters() if p.requires_grad], lr=1e-3)
        return spec


    class WithUnusedHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = demo_model().model
            self.unused = nn.Linear(4, 4)

        def forward(self, x):
            return self.body(x)


    def unused_head():
        spec = demo_model()
        model = WithUnusedHead()
        return DrillSpec(model, torch.optim.AdamW(model.parameters(), lr=1e-3), spec.batch, spec.loss)


    def report_env(metadata):
        Path("env.json").write_text(json.dumps({"keys": sorted(os.environ), "cwd": os.getcwd(),
                                                 "home": os.environ.get("HOME"), "metadata": metadata}))
        return demo_model()


    def sleeps():
        Path("pid").write_text(str(os.getpid()))
        time.sleep(600)


    def no_optimizer():
        return demo_model().model


    def _attempt(action):
        try:
            action()
            return "written"
        except OSError as exc:
            return type(exc).__name__


    def writes_outside(metadata):
        # A model factory gone bad: it tries to change files outside its scratch directory.
        outside = Path(metadata["outside"])
        attempts = {
            "create": _attempt(lambda: (outside / "escaped.txt").write_text("x")),
            "overwrite": _attempt(lambda: (outside / "precious.txt").write_text("gone")),
            "delete": _attempt(lambda: (outside / "precious.txt").unlink()),
            "checkpoint": _attempt(lambda: open(metadata["model_file"], "r+b").close()),
            "own module": _attempt(lambda: open(__file__, "a").close()),
            "shell": os.system(f"touch {outside / 'shell.txt'} 2>/dev/null"),
            "scratch": _attempt(lambda: Path("inside.txt").write_text("ok")),
        }
        Path("attempts.json").write_text(json.dumps(attempts))
        return demo_model()


    def loads_unsafely(metadata):
        # A factory that unpickles a file from the checkpoint without the safe loader:
        # the checkpoint's own code runs, and tries to write outside.
        import pickle
        pickle.loads(Path(metadata["payload"]).read_bytes())
        return demo_model()
    '''
)


@pytest.fixture(scope="module")
def factories(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("factories") / "drill_factories.py"
    path.write_text(FACTORIES)
    return path


def _trained(make: str = "plain") -> tuple[DrillSpec, float]:
    spec = demo_model()
    if make == "frozen":
        for p in spec.model.net[0].parameters():
            p.requires_grad_(False)
        spec.optimizer = torch.optim.AdamW([p for p in spec.model.parameters() if p.requires_grad], lr=1e-3)
    losses = demo_train(spec, range(1, TRAINED_STEPS + 1))
    return spec, losses[-1]


@pytest.fixture(scope="module")
def trained() -> tuple[DrillSpec, float]:
    return _trained()


def write_guide(root: Path, spec: DrillSpec, loss: float | None, *, optimizer: bool = True) -> Path:
    step_dir = root / "job" / f"step-{TRAINED_STEPS:08d}"
    (step_dir / "rank-0000").mkdir(parents=True)
    torch.save(spec.model.state_dict(), step_dir / "rank-0000" / "model.pt")
    if optimizer:
        torch.save(spec.optimizer.state_dict(), step_dir / "rank-0000" / "optimizer.pt")
    meta = {"job": "job", "step": TRAINED_STEPS} | ({"loss": loss} if loss is not None else {})
    (step_dir / "metadata.json").write_text(json.dumps(meta))
    return step_dir


def write_dcp(root: Path, spec: DrillSpec) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    step_dir = root / "job" / f"step-{TRAINED_STEPS}"
    optim = get_optimizer_state_dict(spec.model, spec.optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({"model": spec.model.state_dict(), "optimizer": optim, "train_state": {"step": TRAINED_STEPS}}, checkpoint_id=str(step_dir))
    return step_dir


def write_hf(root: Path, spec: DrillSpec, loss: float) -> Path:
    import random

    import numpy as np
    from safetensors.torch import save_file

    step_dir = root / "out" / f"checkpoint-{TRAINED_STEPS}"
    step_dir.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in spec.model.state_dict().items()}, str(step_dir / "model.safetensors"))
    torch.save(spec.optimizer.state_dict(), step_dir / "optimizer.pt")
    sched = torch.optim.lr_scheduler.LambdaLR(spec.optimizer, lambda s: 1.0)
    torch.save(sched.state_dict(), step_dir / "scheduler.pt")
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}, step_dir / "rng_state.pth")
    state = {
        "global_step": TRAINED_STEPS,
        "log_history": [{"loss": 9.9, "step": 10}, {"loss": loss, "step": TRAINED_STEPS}, {"eval_loss": 1.0, "step": TRAINED_STEPS}],
    }
    (step_dir / "trainer_state.json").write_text(json.dumps(state))
    return step_dir


def write_lightning(root: Path, spec: DrillSpec) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"epoch=0-step={TRAINED_STEPS}.ckpt"
    torch.save(
        {
            "epoch": 0,
            "global_step": TRAINED_STEPS,
            "pytorch-lightning_version": "2.5.0",
            "state_dict": spec.model.state_dict(),
            "optimizer_states": [spec.optimizer.state_dict()],
            "lr_schedulers": [],
            "loops": {"fit_loop": {"epoch_loop.state_dict": {"_batches_that_stepped": TRAINED_STEPS}}},
            "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": None, "dirpath": Path(root)}},
            "hparams_name": "kwargs",
            "hyper_parameters": {"lr": 1e-3, "data": Path("/data/train")},
        },
        path,
    )
    return path


def drill_in_process(path: Path, fmt: str, factory: str | None = DEMO, steps: int = 3) -> WorkerResult:
    return run_request(DrillRequest(str(path), fmt, factory, steps, "cpu", str(path.parent / "unused.json")))


# --- drills on real checkpoints -------------------------------------------------


def test_guide_drill_in_subprocess_is_ok_isolated_and_deterministic(
    tmp_path: Path, trained: tuple[DrillSpec, float], factories: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec, loss = trained
    step_dir = write_guide(tmp_path / "hot", spec, loss)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "PREFECT_API_KEY", "HF_TOKEN", "CKPTIER_CATALOG_URL"):
        monkeypatch.setenv(name, "secret-value")
    scratch = tmp_path / "scratch"
    result = run_drill_subprocess(step_dir, Format.GUIDE, factory=f"{factories}:report_env", scratch=scratch, steps=4, timeout=120)
    verdict = judge([result])
    assert verdict.ok, verdict.summary
    assert result.recorded_loss == pytest.approx(loss)
    assert result.losses == result.losses_repeat and len(result.losses) == 4
    assert result.optimizer_step_before == TRAINED_STEPS and result.optimizer_step_after == TRAINED_STEPS + 4
    assert result.timings["first_step_s"] > 0 and result.peak_memory_bytes and result.memory_kind == "rss"
    seen = json.loads((scratch / "env.json").read_text())
    for keys in (seen["keys"], list(result.env_keys)):
        assert not [k for k in keys if k.startswith(("AWS_", "PREFECT_", "CKPTIER_")) or "TOKEN" in k]
    assert Path(seen["cwd"]) == scratch.resolve() and Path(seen["home"]) == scratch.resolve()
    assert seen["metadata"]["loss"] == pytest.approx(loss)  # factories may take the parsed metadata


def test_first_restored_loss_matches_recorded_and_random_weights_do_not(tmp_path: Path, trained: tuple[DrillSpec, float]) -> None:
    spec, loss = trained
    ok = drill_in_process(write_guide(tmp_path / "a", spec, loss), "guide")
    assert judge([ok]).ok
    assert ok.optimizer_keeps_state and ok.optimizer_left is None  # AdamW's moments, restored
    # Weights that did not really restore (a fresh init) miss the recorded loss by far.
    fresh = demo_model()
    with torch.no_grad():
        for p in fresh.model.parameters():
            p.mul_(5.0)
    bad = drill_in_process(write_guide(tmp_path / "b", DrillSpec(fresh.model, spec.optimizer), loss), "guide")
    verdict = judge([bad])
    assert not verdict.ok
    assert [c.name for c in verdict.checks if not c.ok] == ["recorded_loss"]


def test_dcp_drill_ok(tmp_path: Path, trained: tuple[DrillSpec, float]) -> None:
    spec, _ = trained
    result = drill_in_process(write_dcp(tmp_path, spec), "dcp")
    verdict = judge([result])
    assert verdict.ok, verdict.summary
    assert result.optimizer_loaded and result.optimizer_step_before == TRAINED_STEPS
    assert result.optimizer_step_after == TRAINED_STEPS + 3
    # The restored state equals what was saved: the first loss is what the live model gives.
    with torch.no_grad():
        live = float(spec.loss(spec.model, spec.batch(TRAINED_STEPS + 1, torch.device("cpu"))))
    assert result.losses[0] == pytest.approx(live, rel=1e-6)


def test_hf_trainer_drill_ok(tmp_path: Path, trained: tuple[DrillSpec, float]) -> None:
    spec, loss = trained
    result = drill_in_process(write_hf(tmp_path, spec, loss), "hf-trainer")
    assert judge([result]).ok, judge([result]).summary
    assert result.recorded_loss == pytest.approx(loss)  # the last logged training loss, not eval_loss
    assert set(result.also_loaded) == {"rng_state.pth", "scheduler.pt"}


def test_lightning_drill_ok(tmp_path: Path, trained: tuple[DrillSpec, float]) -> None:
    spec, _ = trained
    result = drill_in_process(write_lightning(tmp_path / "ckpts", spec), "lightning")
    assert judge([result]).ok, judge([result]).summary
    assert result.checkpoint_step == TRAINED_STEPS and result.recorded_loss is None


def test_nan_weights_fail_the_verdict(tmp_path: Path, trained: tuple[DrillSpec, float]) -> None:
    spec, loss = trained
    model = demo_model().model
    model.load_state_dict(spec.model.state_dict())
    with torch.no_grad():
        model.net[2].weight[0, 0] = float("nan")
    result = drill_in_process(write_guide(tmp_path, DrillSpec(model, spec.optimizer), loss), "guide")
    verdict = judge([result])
    assert not verdict.ok
    failed = {c.name for c in verdict.checks if not c.ok}
    assert "losses_finite" in failed and "gradients" in failed
    assert all(v is None for v in WorkerResult.from_dict(json.loads(json.dumps(result.to_dict()))).losses)


def test_missing_optimizer_state_entries_fail_clearly(tmp_path: Path, trained: tuple[DrillSpec, float]) -> None:
    spec, loss = trained
    state = spec.optimizer.state_dict()
    broken = {"state": {k: dict(v) for k, v in state["state"].items()}, "param_groups": state["param_groups"]}
    del broken["state"][2]["exp_avg_sq"]
    step_dir = write_guide(tmp_path / "a", spec, loss, optimizer=False)
    torch.save(broken, step_dir / "rank-0000" / "optimizer.pt")
    result = drill_in_process(step_dir, "guide")
    assert result.error_stage == "restore" and "exp_avg_sq" in (result.error or ""), result.error
    assert "net.2.weight" in (result.error or "")

    dropped = {"state": {k: v for k, v in state["state"].items() if k != 0}, "param_groups": state["param_groups"]}
    step_dir = write_guide(tmp_path / "b", spec, loss, optimizer=False)
    torch.save(dropped, step_dir / "rank-0000" / "optimizer.pt")
    result = drill_in_process(step_dir, "guide")
    assert result.error_stage == "restore" and "net.0.weight" in (result.error or ""), result.error


def test_missing_model_key_fails_naming_it(tmp_path: Path, trained: tuple[DrillSpec, float]) -> None:
    spec, loss = trained
    state = {k: v for k, v in spec.model.state_dict().items() if k != "net.4.bias"}
    step_dir = write_guide(tmp_path, DrillSpec(spec.model, spec.optimizer), loss)
    torch.save(state, step_dir / "rank-0000" / "model.pt")
    result = drill_in_process(step_dir, "guide")
    assert result.error_stage == "fit" and "missing key net.4.bias" in (result.error or "")  # the factory does not fit
    assert not judge([result]).ok


def test_optimizer_state_without_an_optimizer_in_the_factory_fails(tmp_path: Path, trained: tuple[DrillSpec, float], factories: Path) -> None:
    spec, loss = trained
    result = drill_in_process(write_guide(tmp_path, spec, loss), "guide", factory=f"{factories}:no_optimizer")
    assert result.error_stage == "build" and "optimizer" in (result.error or "")


def test_frozen_parameters_need_no_gradient_but_unused_trainable_ones_do(tmp_path: Path, factories: Path) -> None:
    spec, loss = _trained("frozen")
    result = drill_in_process(write_guide(tmp_path / "frozen", spec, loss), "guide", factory=f"{factories}:frozen_first_layer")
    verdict = judge([result])
    assert verdict.ok, verdict.summary
    assert result.frozen_params == 2 and result.trainable_params == 4

    plain, plain_loss = _trained()
    from torch import nn

    class WithUnusedHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = plain.model
            self.unused = nn.Linear(4, 4)

    model = WithUnusedHead()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step_dir = tmp_path / "unused" / "job" / f"step-{TRAINED_STEPS:08d}"
    (step_dir / "rank-0000").mkdir(parents=True)
    torch.save(model.state_dict(), step_dir / "rank-0000" / "model.pt")
    result = drill_in_process(step_dir, "guide", factory=f"{factories}:unused_head")
    verdict = judge([result])
    assert not verdict.ok
    assert [c.name for c in verdict.checks if not c.ok] == ["gradients"]
    assert any("unused.weight" in p for p in result.grad_problems)
    assert optimizer is not None


def test_timeout_kills_a_hanging_worker(tmp_path: Path, trained: tuple[DrillSpec, float], factories: Path) -> None:
    spec, loss = trained
    scratch = tmp_path / "scratch"
    started = time.monotonic()
    result = run_drill_subprocess(
        write_guide(tmp_path / "hot", spec, loss), "guide", factory=f"{factories}:sleeps", scratch=scratch, steps=2, timeout=12
    )
    assert time.monotonic() - started < 40
    assert result.timed_out and result.error_stage == "timeout"
    assert not judge([result]).ok and "time limit" in judge([result]).summary
    pid = int((scratch / "pid").read_text())  # the factory really ran and hung
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


# --- pure parts ---------------------------------------------------------------


def _result(**changes: object) -> WorkerResult:
    base = WorkerResult(
        checkpoint="/x", format="guide", steps=3, device="cpu",
        losses=(0.5, 0.4, 0.3), losses_repeat=(0.5, 0.4, 0.3), recorded_loss=0.45,
        optimizer_loaded=True, optimizer_step_before=100.0, optimizer_step_after=103.0,
        trainable_params=6, timings={"load_s": 0.1, "first_step_s": 0.01},
    )
    return replace(base, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "changes, failing",
    [
        ({}, []),
        ({"timed_out": True, "error": "killed", "error_stage": "timeout"}, ["completed"]),
        ({"error": "bad", "error_stage": "load", "unsafe": True}, ["completed"]),
        ({"losses": (0.5, None, 0.3), "losses_repeat": (0.5, None, 0.3)}, ["losses_finite"]),
        ({"losses": (0.5, 0.4)}, ["losses_finite", "deterministic"]),
        ({"grad_problems": ("fc.weight: no gradient",)}, ["gradients"]),
        ({"trainable_params": 0}, ["gradients"]),
        ({"optimizer_step_after": 101.0}, ["optimizer_continues"]),
        ({"optimizer_step_before": 0.0, "optimizer_step_after": 3.0}, ["optimizer_continues"]),
        ({"optimizer_loaded": False, "optimizer_step_before": None, "optimizer_step_after": None}, []),
        ({"losses_repeat": (0.5, 0.4, 0.30000001)}, ["deterministic"]),
        ({"device": "cuda:0", "losses_repeat": (0.5, 0.4, 0.30000001)}, []),
        ({"device": "cuda:0", "losses_repeat": (0.5, 0.4, 0.31)}, ["deterministic"]),
        ({"recorded_loss": 5.0}, ["recorded_loss"]),
        ({"recorded_loss": None}, []),
    ],
)
def test_judge_table(changes: dict[str, object], failing: list[str]) -> None:
    verdict = judge([_result(**changes)])
    assert [c.name for c in verdict.checks if not c.ok] == failing
    assert verdict.ok == (not failing)
    assert "\n" not in verdict.summary
    if not failing:
        assert verdict.summary.startswith("drill ok")
    elif failing != ["completed"]:
        assert verdict.summary.startswith(f"drill failed: {failing[0]}")
    else:
        assert verdict.summary.startswith("drill failed: ") and verdict.checks[0].detail in verdict.summary


def test_judge_loss_tolerance_is_relative() -> None:
    result = _result(recorded_loss=0.4)  # first loss 0.5: 25% off
    assert judge([result], loss_tolerance=0.3).ok
    assert not judge([result], loss_tolerance=0.2).ok


def _record(job: str, step: int, state: State, *, hours: float = 0, fmt: Format = Format.GUIDE, copies: tuple[CopyRecord, ...] | None = None, missing: bool = False) -> CheckpointRecord:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    saved = t0 + timedelta(hours=hours)
    hot = (CopyRecord(Tier.HOT, f"file:///hot/{job}/{step}", "present", 10, None),)
    return CheckpointRecord(
        id=step, job=job, step=step, format=fmt, state=state, location=f"/hot/{job}/{step}", bytes=10,
        saved_at=saved, first_seen=saved, last_seen=saved, missing_since=saved if missing else None,
        verified_at=saved if state is State.VERIFIED else None, state_reason=None,
        copies=hot if copies is None else copies,
    )


def test_choose_candidates_order_and_exclusions() -> None:
    archive_only = (CopyRecord(Tier.HOT, "h", "deleted", None, None), CopyRecord(Tier.ARCHIVE, "a", "present", 9, datetime(2026, 1, 2, tzinfo=UTC)))
    gone = (CopyRecord(Tier.HOT, "h", "deleted", None, None),)
    records = [
        _record("a", 100, State.VERIFIED, hours=1),
        _record("a", 300, State.COMMITTED, hours=3),
        _record("a", 400, State.INCOMPLETE, hours=4),
        _record("a", 500, State.CORRUPT, hours=5),
        _record("a", 600, State.DELETED, hours=6),
        _record("a", 200, State.VERIFIED, hours=2, copies=archive_only),
        _record("a", 250, State.VERIFIED, hours=2.5, copies=gone),
        _record("a", 260, State.VERIFIED, hours=2.6, fmt=Format.PATTERN),
        _record("a", 270, State.VERIFIED, hours=2.7, copies=(), missing=True),
        _record("b", 50, State.VERIFIED, hours=10),
    ]
    assert [(r.job, r.step) for r in choose_candidates(records)] == [("b", 50), ("a", 200), ("a", 100), ("a", 300)]
    assert [r.step for r in choose_candidates(records, job="a")] == [200, 100, 300]
    assert [r.step for r in choose_candidates(records, job="a", step=100)] == [100]
    assert choose_candidates(records, job="a", step=500) == []
    assert choose_candidates(records, job="nope") == []


def test_worker_env_is_an_allowlist_without_credentials(tmp_path: Path) -> None:
    parent = {
        "PATH": "/bin", "PYTHONPATH": "/src", "CUDA_VISIBLE_DEVICES": "0", "LC_ALL": "C",
        "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_SESSION_TOKEN": "t", "PREFECT_API_KEY": "p",
        "CKPTIER_CATALOG_URL": "postgresql://u:pw@db/x", "GITHUB_TOKEN": "g", "RANDOM_THING": "r", "HOME": "/root",
        "CUDA_SECRET_KEY": "x", "MY_FLAG": "1",
    }
    env = worker_env(parent, tmp_path)
    assert {k for k in env if k in parent} == {"PATH", "PYTHONPATH", "CUDA_VISIBLE_DEVICES", "LC_ALL", "HOME"}
    assert env["HOME"] == str(tmp_path) and env["TMPDIR"].startswith(str(tmp_path))
    assert worker_env(parent, tmp_path, passthrough=["MY_FLAG"])["MY_FLAG"] == "1"
    with pytest.raises(ConfigError, match="AWS_SECRET_ACCESS_KEY"):
        worker_env(parent, tmp_path, passthrough=["AWS_SECRET_ACCESS_KEY"])


def test_worker_result_round_trips_through_json() -> None:
    result = _result(losses=(0.5, float("nan"), float("inf")), grad_problems=("x: no gradient",))
    again = WorkerResult.from_dict(json.loads(json.dumps(result.to_dict(), allow_nan=False)))
    assert again.losses == (0.5, None, None) and again.grad_problems == ("x: no gradient",)
    assert again.optimizer_step_after == 103.0


def test_run_drill_subprocess_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="steps"):
        run_drill_subprocess(tmp_path, "guide", factory=DEMO, scratch=tmp_path, steps=0)
    with pytest.raises(ConfigError, match="device"):
        run_drill_subprocess(tmp_path, "guide", factory=DEMO, scratch=tmp_path, device="tpu")
    with pytest.raises(ConfigError, match="module:function"):
        run_drill_subprocess(tmp_path, "guide", factory="no_colon", scratch=tmp_path)


def test_state_dict_problems_forgive_tied_weights_only() -> None:
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    expected = model.state_dict()
    assert state_dict_problems(expected, {"emb.weight": torch.zeros(10, 4)}) == []
    untied = torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 4), "head": torch.nn.Linear(4, 10, bias=False)}).state_dict()
    assert state_dict_problems(untied, {"emb.weight": torch.zeros(10, 4)}) == ["missing key head.weight (model expects [10, 4])"]
    assert state_dict_problems(expected, {"emb.weight": torch.zeros(10, 4), "extra": torch.zeros(1)}) == ["unexpected key extra [1] in the checkpoint"]
    with_extra = {**untied, "head._extra_state": None}  # megatron-core's modules: non-tensor extra state, no weight
    assert state_dict_problems(with_extra, dict(untied)) == []
    assert state_dict_problems(with_extra, {"emb.weight": torch.zeros(10, 4)}) == ["missing key head.weight (model expects [10, 4])"]


def test_factory_resolution_errors_name_the_spec(factories: Path) -> None:
    with pytest.raises(ConfigError, match="not_a_module_abc"):
        resolve_factory("not_a_module_abc:build")
    with pytest.raises(ConfigError, match="missing_fn"):
        resolve_factory(f"{factories}:missing_fn")
    assert parse_factory_spec("a.b:c") == ("a.b", "c")
    spec = build_spec(resolve_factory(DEMO), {})
    assert isinstance(spec, DrillSpec) and spec.optimizer is not None
    with pytest.raises(ConfigError, match="returned a int"):
        build_spec(lambda: 3, {}, name="x:y")


def test_demo_model_is_deterministic_and_learns() -> None:
    a, b = demo_model(), demo_model()
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values(), strict=True))
    losses = demo_train(a, range(1, 101))
    assert losses[-1] < 0.6 * losses[0]


# --- the shared real-library fixtures (tests/fixtures/checkpoints.py) -------------


@pytest.mark.parametrize("run_name", ["guide_run", "dcp_run", "lightning_run"])
def test_drill_on_shared_fixture_checkpoints(run_name: str, request: pytest.FixtureRequest) -> None:
    run = request.getfixturevalue(run_name)  # lightning_run skips when lightning is not installed
    newest = max(run.steps)
    result = drill_in_process(run.path(newest), run.format.value, factory="tests.fixtures.checkpoints:tiny_mlp_drill_spec")
    verdict = judge([result])
    assert verdict.ok, verdict.summary
    assert result.optimizer_loaded and result.optimizer_step_after == result.optimizer_step_before + 3
    if run.steps[newest].recorded_loss is not None:
        assert result.recorded_loss == pytest.approx(run.steps[newest].recorded_loss)


def test_real_hf_trainer_checkpoint_loads_safely(hf_run) -> None:  # type: ignore[no-untyped-def]
    from ckptier.formats.safe_load import load_checkpoint_dir

    newest = max(hf_run.steps)
    loaded = load_checkpoint_dir(hf_run.path(newest), Format.HF)
    assert loaded.step == newest and loaded.optimizer_state is not None
    assert loaded.recorded_loss == pytest.approx(hf_run.steps[newest].recorded_loss)
    assert any(name.startswith("rng_state") for name in loaded.also_loaded)  # numpy RNG state via the allowlist
    assert "hf_config_dir" in loaded.extra and "transformer.wte.weight" in loaded.model_state
    assert loaded.rng_state is not None and {"python", "numpy", "cpu"} <= set(loaded.rng_state)


def test_resume_rng_continues_the_saved_streams_and_skips_a_state_that_does_not_fit() -> None:
    import random

    import numpy as np

    from ckptier.tasks.drill_worker import resume_rng

    torch.manual_seed(3)
    saved = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    torch.manual_seed(0)
    assert resume_rng(saved) == ["python", "numpy", "cpu"]
    assert (random.random(), float(np.random.rand())) == expected[:2] and torch.equal(torch.rand(3), expected[2])
    torch.manual_seed(0)
    seeded = torch.rand(3)
    torch.manual_seed(0)
    assert resume_rng({"cpu": "not a generator state", "cuda": saved["cpu"]}) == [] and resume_rng(None) == []
    assert torch.equal(torch.rand(3), seeded)  # the seed stays


# --- drills without a factory, end to end through the subprocess, allowlists -------------

REPO_ROOT = Path(__file__).resolve().parents[1]


def _trainer_decay_names(model: torch.nn.Module) -> list[str]:
    """What the installed transformers.Trainer puts in its decay group (the method does not use self)."""
    import transformers

    names = set(transformers.Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
    return [n for n, _ in model.named_parameters() if n in names]


def test_trainer_decay_names_mirror_the_installed_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    from ckptier.tasks.drill_models import trainer_decay_parameter_names

    from tests.fixtures.checkpoints import tiny_gpt2_config

    gpt2 = transformers.GPT2LMHeadModel(tiny_gpt2_config())
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    )
    for model in (gpt2, llama):
        mine = trainer_decay_parameter_names(model)
        assert mine == _trainer_decay_names(model)
        assert mine and not any(n.endswith(".bias") for n in mine)
    assert "transformer.ln_f.weight" not in trainer_decay_parameter_names(gpt2)  # a LayerNorm module
    norms = {n for n, _ in llama.named_parameters() if "norm" in n}
    assert norms and not norms & set(trainer_decay_parameter_names(llama))  # RMSNorm by name
    assert norms <= set(trainer_decay_parameter_names(llama, rule="legacy"))  # older releases decayed them


def test_hf_trainer_checkpoint_drills_without_a_factory(hf_run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    step = sorted(hf_run.steps)[-2]  # mid-run: the restored learning rate is not yet zero
    result = run_drill_subprocess(hf_run.path(step), Format.HF, factory=None, scratch=tmp_path / "scratch",
                                  steps=3, device="cpu", timeout=240)
    verdict = judge([result])
    assert verdict.ok, (verdict.summary, result.stderr_tail)
    assert result.optimizer_loaded and result.optimizer_step_before == step
    assert result.optimizer_step_after == step + 3
    assert result.recorded_loss == pytest.approx(hf_run.steps[step].recorded_loss)
    assert {c.name: c.ok for c in verdict.checks}["recorded_loss"] and "recorded" in verdict.summary
    assert result.trainable_params > 0 and result.losses == result.losses_repeat


def test_trainer_optimizer_rebuilds_the_saved_groups_exactly(hf_run) -> None:  # type: ignore[no-untyped-def]
    from ckptier.tasks.drill_models import hf_spec, trainer_optimizer
    from ckptier.formats.safe_load import load_checkpoint_dir

    step = max(hf_run.steps)
    loaded = load_checkpoint_dir(hf_run.path(step), Format.HF)
    spec = hf_spec(loaded.extra["hf_config_dir"])
    optimizer = trainer_optimizer(spec.model, loaded.optimizer_state)
    saved = loaded.optimizer_state["param_groups"]
    names = {id(p): n for n, p in spec.model.named_parameters()}
    groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    assert groups[0] == _trainer_decay_names(spec.model)  # decay group first, as Trainer builds it
    assert [len(g) for g in groups] == [len(g["params"]) for g in saved]
    for mine, theirs in zip(optimizer.param_groups, saved, strict=True):
        assert (mine["lr"], tuple(mine["betas"]), mine["eps"], mine["weight_decay"]) == (
            theirs["lr"], tuple(theirs["betas"]), theirs["eps"], theirs["weight_decay"])
    optimizer.load_state_dict(loaded.optimizer_state)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, state in loaded.optimizer_state["state"].items():
        assert torch.equal(optimizer.state[params[i]]["exp_avg"], state["exp_avg"])


def test_hf_checkpoint_with_a_custom_optimizer_asks_for_a_factory(hf_run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import shutil

    step = max(hf_run.steps)
    ckpt = tmp_path / f"checkpoint-{step}"
    shutil.copytree(hf_run.path(step), ckpt)
    saved = torch.load(ckpt / "optimizer.pt", weights_only=True)
    merged = dict(saved["param_groups"][0], params=[i for g in saved["param_groups"] for i in g["params"]])
    torch.save({"state": saved["state"], "param_groups": [merged]}, ckpt / "optimizer.pt")
    result = drill_in_process(ckpt, "hf-trainer", factory=None)
    assert result.error_stage == "build", result.error
    assert "1 param groups" in (result.error or "") and "--model module:function" in (result.error or "")


def test_hf_sequence_classifier_is_built_from_its_architecture(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from ckptier.tasks.drill_models import hf_head

    assert hf_head(["BertForSequenceClassification"]) == ("AutoModelForSequenceClassification", "classes")
    assert hf_head(["GPT2LMHeadModel"]) == ("AutoModelForCausalLM", "tokens")
    assert hf_head(["RobertaForMaskedLM"]) == ("AutoModelForMaskedLM", "tokens")
    assert hf_head(None) == ("AutoModelForCausalLM", "tokens")
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=12, num_labels=3)
    ckpt = tmp_path / "out" / "checkpoint-5"
    transformers.BertForSequenceClassification(config).save_pretrained(ckpt)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 5, "log_history": []}))
    result = drill_in_process(ckpt, "hf-trainer", factory=None)
    verdict = judge([result])
    assert verdict.ok, verdict.summary  # classifier head and 12 positions: a causal-LM build would not fit
    assert not result.optimizer_loaded


def test_lightning_without_a_factory_says_what_to_pass(lightning_run) -> None:  # type: ignore[no-untyped-def]
    result = drill_in_process(lightning_run.path(max(lightning_run.steps)), "lightning", factory=None)
    assert result.error_stage == "build" and not judge([result]).ok
    error = result.error or ""
    assert "LightningModule" in error and "--model module:function" in error and "[[drill]]" in error
    assert "\n" not in error


@pytest.mark.parametrize("run_name", ["guide_run", "dcp_run", "lightning_run"])
def test_fixture_checkpoints_drill_through_the_subprocess(
    run_name: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = request.getfixturevalue(run_name)  # lightning_run skips when lightning is not installed
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))  # the worker imports the factory from tests/
    step = max(run.steps)
    result = run_drill_subprocess(run.path(step), run.format, factory="tests.fixtures.checkpoints:tiny_mlp_drill_spec",
                                  scratch=tmp_path / "scratch", steps=3, device="cpu", timeout=120)
    verdict = judge([result])
    assert verdict.ok, (verdict.summary, result.stderr_tail)
    assert result.checkpoint_step == step and result.optimizer_step_before == step
    assert result.optimizer_step_after == step + 3
    # Restored exactly: the first drill loss is the saved model's loss on the next batch.
    from tests.fixtures.checkpoints import tiny_batch, tiny_loss, tiny_mlp

    model = tiny_mlp()
    model.load_state_dict(_model_state(run.path(step), run.format))
    with torch.no_grad():
        assert result.losses[0] == pytest.approx(float(tiny_loss(model, tiny_batch(step + 1))), rel=1e-6)


def _model_state(path: Path, fmt: Format) -> dict[str, torch.Tensor]:
    from ckptier.formats.safe_load import load_checkpoint_dir

    return load_checkpoint_dir(path, fmt).model_state


CUSTOM_MODULE = "ckptier_drill_test_custom"
CUSTOM_CLASS = f"{CUSTOM_MODULE}.RunNotes"


def test_cli_drill_allow_global_lets_a_harmless_class_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import hashlib
    import importlib

    from ckptier.flows.cli import main

    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / f"{CUSTOM_MODULE}.py").write_text(
        "from dataclasses import dataclass\n\n\n@dataclass\nclass RunNotes:\n    lr: float\n    tag: str\n"
    )
    monkeypatch.syspath_prepend(str(lib))
    monkeypatch.setenv("PYTHONPATH", str(lib))  # the drill worker must import the class too
    notes = importlib.import_module(CUSTOM_MODULE).RunNotes(lr=1e-3, tag="run-1")

    spec = demo_model()
    losses = demo_train(spec, range(1, 11))
    step_dir = tmp_path / "hot" / "notes-job" / "step-00000010"
    (step_dir / "rank-0000").mkdir(parents=True)
    torch.save({"model": spec.model.state_dict(), "notes": notes}, step_dir / "rank-0000" / "model.pt")
    torch.save(spec.optimizer.state_dict(), step_dir / "rank-0000" / "optimizer.pt")
    files = {f"rank-0000/{n}": {"size": (step_dir / "rank-0000" / n).stat().st_size,
                                "sha256": hashlib.sha256((step_dir / "rank-0000" / n).read_bytes()).hexdigest()}
             for n in ("model.pt", "optimizer.pt")}
    (step_dir / "metadata.json").write_text(json.dumps({"step": 10, "loss": losses[-1], "files": files}))
    config = tmp_path / "ckptier.toml"
    config.write_text('[[drill]]\njobs = "*"\nmodel = "ckptier.tasks.drill_models:demo_model"\nsteps = 2\ndevice = "cpu"\n')
    monkeypatch.setenv("CKPTIER_CATALOG_URL", f"sqlite:///{tmp_path / 'catalog.db'}")
    monkeypatch.setenv("CKPTIER_CONFIG", str(config))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)

    assert main(["scan", str(tmp_path / "hot")]) == 0
    assert main(["verify"]) == 0
    capsys.readouterr()

    assert main(["drill", "--json"]) == 1
    (report,) = json.loads(capsys.readouterr().out)
    assert not report["ok"] and report["stage"] == "load"
    assert CUSTOM_CLASS in report["error"] and f"--allow-global {CUSTOM_CLASS}" in report["error"]

    assert main(["drill", "--json", "--allow-global", CUSTOM_CLASS]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["ok"], report["summary"]

    # The same through ckptier.toml; an unsafe entry on the command line is refused before any drill.
    config.write_text(config.read_text() + f'allow_globals = ["{CUSTOM_CLASS}"]\n')
    assert main(["drill", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["ok"]
    assert main(["drill", "--allow-global", "builtins.print"]) == 2
    err = capsys.readouterr().err
    assert "builtins.print" in err and len(err.strip().splitlines()) == 1

    # Classes that are not plain data are refused before anything is fetched, with the
    # reason, whether named on the command line or in ckptier.toml; never suggested.
    module = lib / f"{CUSTOM_MODULE}.py"
    module.write_text(module.read_text() + "\n\nclass Hooked:\n    def __init__(self, path):\n        open(path, 'w').close()\n")
    for name, why in [(f"{CUSTOM_MODULE}.Hooked", "Hooked defines __init__"), ("numpy.memmap", "memmap defines __new__"),
                      ("timeit.Timer", "module 'timeit' can run code")]:
        assert main(["drill", "--allow-global", name]) == 2
        err = capsys.readouterr().err
        assert f"--allow-global {name!r}" in err and why in err and len(err.strip().splitlines()) == 1
    config.write_text(config.read_text().replace(f'allow_globals = ["{CUSTOM_CLASS}"]', f'allow_globals = ["{CUSTOM_MODULE}.Hooked"]'))
    assert main(["drill"]) == 2
    err = capsys.readouterr().err
    assert "[[drill]] allow_globals (job 'notes-job') entry" in err and "Hooked defines __init__" in err


def _guide_step(root: Path, step: int, spec: DrillSpec, loss: float, *, hostile_member: str | None = None) -> Path:
    """A committed guide step (metadata.json with sizes and sha256s, so verify
    passes); ``hostile_member`` adds that member name to model.pt's zip."""
    import hashlib
    import zipfile

    step_dir = root / "zip-job" / f"step-{step:08d}"
    (step_dir / "rank-0000").mkdir(parents=True)
    torch.save(spec.model.state_dict(), step_dir / "rank-0000" / "model.pt")
    torch.save(spec.optimizer.state_dict(), step_dir / "rank-0000" / "optimizer.pt")
    if hostile_member is not None:
        with zipfile.ZipFile(step_dir / "rank-0000" / "model.pt", "a") as archive:
            archive.writestr(hostile_member, b"escape")
    files = {f"rank-0000/{n}": {"size": (step_dir / "rank-0000" / n).stat().st_size,
                                "sha256": hashlib.sha256((step_dir / "rank-0000" / n).read_bytes()).hexdigest()}
             for n in ("model.pt", "optimizer.pt")}
    (step_dir / "metadata.json").write_text(json.dumps({"step": step, "loss": loss, "files": files}))
    return step_dir


@pytest.mark.slow
def test_drill_refuses_a_zip_escaping_its_archive_as_hostile_and_tries_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckptier.flows.cli import main

    spec = demo_model()
    losses = demo_train(spec, range(1, 21))
    _guide_step(tmp_path / "hot", 10, spec, losses[9])
    _guide_step(tmp_path / "hot", 20, spec, losses[19], hostile_member="../../../tmp/escaped.txt")
    config = tmp_path / "ckptier.toml"
    config.write_text('[[drill]]\njobs = "*"\nmodel = "ckptier.tasks.drill_models:demo_model"\nsteps = 2\ndevice = "cpu"\n')
    monkeypatch.setenv("CKPTIER_CATALOG_URL", f"sqlite:///{tmp_path / 'catalog.db'}")
    monkeypatch.setenv("CKPTIER_CONFIG", str(config))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert main(["scan", str(tmp_path / "hot")]) == 0
    assert main(["verify"]) == 0
    capsys.readouterr()

    assert main(["drill", "--json"]) == 1  # an attempt failed, even though an older checkpoint restored
    first, second = json.loads(capsys.readouterr().out)
    assert (first["step"], first["ok"], first["stage"]) == (20, False, "load")
    assert "'../../../tmp/escaped.txt' points outside the archive" in first["error"] and "hostile" in first["error"]
    assert (second["step"], second["ok"]) == (10, True), second["summary"]


class _EscapeToOutside:
    """Pickles to os.system(...) writing a file at ``target``."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.target}",))


def _confinement_expected() -> bool:
    from ckptier.tasks.confine import landlock_abi

    return landlock_abi()[0] is not None


def test_drill_worker_cannot_write_outside_scratch(
    tmp_path: Path, trained: tuple[DrillSpec, float], factories: Path
) -> None:
    spec, loss = trained
    step_dir = write_guide(tmp_path / "hot", spec, loss)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep")
    model_file = step_dir / "rank-0000" / "model.pt"
    before = model_file.read_bytes()
    (step_dir / "payload.pkl").write_bytes(pickle.dumps(_EscapeToOutside(outside / "from-checkpoint.txt")))
    meta = json.loads((step_dir / "metadata.json").read_text())
    meta.update(outside=str(outside), model_file=str(model_file), payload=str(step_dir / "payload.pkl"))
    (step_dir / "metadata.json").write_text(json.dumps(meta))
    factories_before = factories.read_text()

    scratch = tmp_path / "scratch"
    result = run_drill_subprocess(step_dir, Format.GUIDE, factory=f"{factories}:writes_outside", scratch=scratch,
                                  steps=2, timeout=120, device="cpu")
    assert judge([result]).ok, (judge([result]).summary, result.stderr_tail)  # torch, the module and the checkpoint still read
    attempts = json.loads((scratch / "attempts.json").read_text())
    assert attempts["scratch"] == "written" and (scratch / "inside.txt").read_text() == "ok"
    if not _confinement_expected():
        assert not result.confined and result.confinement and result.confinement.startswith("writes not confined:")
        pytest.skip(f"writes were not confined here: {result.confinement}")
    assert result.confined and "Landlock" in (result.confinement or "") and str(scratch.resolve()) in (result.confinement or "")
    assert {k: v for k, v in attempts.items() if k not in ("scratch", "shell")} == dict.fromkeys(
        ("create", "overwrite", "delete", "checkpoint", "own module"), "PermissionError")
    assert attempts["shell"] != 0  # a command it starts is confined too
    assert sorted(p.name for p in outside.iterdir()) == ["precious.txt"] and (outside / "precious.txt").read_text() == "keep"
    assert model_file.read_bytes() == before and factories.read_text() == factories_before

    # The checkpoint's own code, run by a factory that unpickles it unsafely, is confined the same way.
    result = run_drill_subprocess(step_dir, Format.GUIDE, factory=f"{factories}:loads_unsafely", scratch=tmp_path / "scratch2",
                                  steps=2, timeout=120, device="cpu")
    assert result.confined and not (outside / "from-checkpoint.txt").exists()


NESTED_DRILL = textwrap.dedent(
    """
    import json, sys
    from ckptier.tasks.confine import confine_writes
    for _ in range(16):  # the most Landlock domains a process may stack; each allows every write
        assert confine_writes(["/"]).confined
    from ckptier.flows.cli import main
    sys.exit(main(["drill", "--json"]))
    """
)


@pytest.mark.slow
def test_drill_report_says_when_writes_were_not_confined(
    tmp_path: Path, trained: tuple[DrillSpec, float], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import subprocess
    import sys

    from ckptier.flows.cli import main

    if not _confinement_expected():
        pytest.skip("no Landlock here: every drill already reports why its writes are not confined")
    spec, loss = trained
    _guide_step(tmp_path / "hot", TRAINED_STEPS, spec, loss)
    config = tmp_path / "ckptier.toml"
    config.write_text(f'[[drill]]\njobs = "*"\nmodel = "{DEMO}"\nsteps = 2\ndevice = "cpu"\n')
    monkeypatch.setenv("CKPTIER_CATALOG_URL", f"sqlite:///{tmp_path / 'catalog.db'}")
    monkeypatch.setenv("CKPTIER_CONFIG", str(config))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert main(["scan", str(tmp_path / "hot")]) == 0
    assert main(["verify"]) == 0
    capsys.readouterr()
    assert main(["drill", "--json"]) == 0
    (confined,) = json.loads(capsys.readouterr().out)
    assert confined["confined"] and "Landlock" in confined["confinement"] and "not confined" not in confined["summary"]

    # The same drill from a process that already holds the most Landlock domains the
    # kernel allows: the worker cannot be confined, and the report says so and why.
    done = subprocess.run([sys.executable, "-c", NESTED_DRILL], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    (report,) = json.loads(done.stdout)
    assert report["ok"] and not report["confined"]
    assert report["confinement"].startswith("writes not confined:") and "nested Landlock domains" in report["confinement"]
    assert report["confinement"] in report["summary"]
