"""DeepSpeed checkpoints: recognised, complete, verified and drilled (ckptier.formats.deepspeed).

The real checkpoints come from DeepSpeed itself (``deepspeed_run``: ZeRO
stage 1 on the CPU accelerator); the layout tests build listings following
DeepSpeed 0.19.8's own naming (``DeepSpeedEngine._get_ckpt_name`` and
``_get_zero_ckpt_name``: ``mp_rank_{mp:02d}_model_states.pt``,
``{bf16_}zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt``, and the
``latest`` tag file) and always run, DeepSpeed installed or not.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from ckptier.formats.deepspeed import LIBRARY_GLOBALS, rank_shortfalls, zero3_slices
from ckptier.formats.safe_load import (
    UnsafeCheckpoint,
    load_checkpoint_dir,
    safe_torch_load,
)
from ckptier.storage.local import LocalStore
from ckptier.storage.records import Format
from ckptier.tasks.drill import DrillRequest, judge
from ckptier.tasks.drill_worker import run_request

from tests.fixtures.checkpoints import CheckpointRun, copy_run
from tests.fixtures.listing import LATER, only, reasons, recognise_listing, scan

REPO = Path(__file__).resolve().parents[1]
FACTORY = "tests.fixtures.checkpoints:tiny_mlp_drill_spec"


# --- layout (always runs) ------------------------------------------------------


def _ds_listing(steps: dict[int, list[str]], latest: str | None) -> dict[str, bytes | int]:
    keys: dict[str, bytes | int] = {"out/zero_to_fp32.py": 900}
    for step, names in steps.items():
        keys.update({f"out/global_step{step}/{n}": 100 for n in names})
    if latest is not None:
        keys["out/latest"] = latest.encode()
    return keys


ZERO2 = ["mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
         "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]


def test_steps_up_to_the_latest_tag_are_committed_and_newer_ones_in_flight() -> None:
    rec = recognise_listing(_ds_listing({100: ZERO2, 200: ZERO2, 300: ZERO2[:2]}, "global_step200"))
    assert rec.unrecognised == ()  # latest and zero_to_fp32.py belong to the run
    assert [(c.job, c.step, c.format, c.committed) for c in rec.checkpoints] == [
        ("out", 100, Format.DEEPSPEED, True), ("out", 200, Format.DEEPSPEED, True), ("out", 300, Format.DEEPSPEED, False)]
    assert "latest tag (global_step200)" in only(rec.checkpoints, 200).reason
    assert "newer than the latest tag (global_step200)" in only(rec.checkpoints, 300).reason


def test_a_missing_rank_file_is_a_shortfall_named_by_deepspeeds_numbering() -> None:
    names = ["mp_rank_00_model_states.pt", "mp_rank_02_model_states.pt",
             "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
             "zero_pp_rank_0_mp_rank_01_optim_states.pt", "zero_pp_rank_0_mp_rank_02_optim_states.pt",
             "zero_pp_rank_1_mp_rank_02_optim_states.pt"]
    rec = recognise_listing(_ds_listing({5: names}, "global_step5"))
    (c,) = rec.checkpoints
    assert c.committed
    assert [s.relpath for s in c.shortfalls] == [
        "mp_rank_01_model_states.pt", "zero_pp_rank_1_mp_rank_01_optim_states.pt"]
    assert "rank file(s) missing: mp_rank_01_model_states.pt (absent" in c.reason
    assert rank_shortfalls({n: 1 for n in ZERO2}) == []


def test_a_zero3_rank_with_model_states_but_no_optimizer_states_or_the_reverse_is_a_shortfall() -> None:
    zero3 = [f"zero_pp_rank_{dp}_mp_rank_00_{kind}_states.pt" for dp in range(3) for kind in ("model", "optim")]
    assert rank_shortfalls(dict.fromkeys(zero3)) == []
    torn = [n for n in zero3 if n not in ("zero_pp_rank_2_mp_rank_00_optim_states.pt",
                                          "zero_pp_rank_1_mp_rank_00_model_states.pt")]
    assert [s.relpath for s in rank_shortfalls(dict.fromkeys(torn))] == [
        "zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_2_mp_rank_00_optim_states.pt"]
    rec = recognise_listing(_ds_listing({6: torn}, "global_step6"))
    assert "rank file(s) missing" in only(rec.checkpoints, 6).reason


def test_without_a_latest_tag_a_step_commits_once_settled() -> None:
    keys = _ds_listing({7: ZERO2}, None)
    (c,) = recognise_listing(keys, now=1030.0).checkpoints
    assert not c.committed and "within the 60 s settle time of DeepSpeed checkpoints without a latest tag" in c.reason
    (c,) = recognise_listing(keys, now=LATER).checkpoints
    assert c.committed


def test_a_step_without_model_states_is_in_flight_and_other_tags_are_not_guessed() -> None:
    rec = recognise_listing({"o/global_step9/zero_pp_rank_0_mp_rank_00_optim_states.pt": 5, "o/latest": b"global_step9",
                             "o/global_stepX/mp_rank_00_model_states.pt": 5})
    (c,) = rec.checkpoints
    assert (c.step, c.committed) == (9, False) and "no mp_rank_*_model_states.pt" in c.reason
    assert "'global_stepX' is not global_step<digits>" in reasons(rec)["o/global_stepX/"]


def test_a_stray_latest_file_without_deepspeed_checkpoints_is_reported() -> None:
    rec = recognise_listing({"notes/latest": b"hello"})
    assert rec.checkpoints == () and list(reasons(rec)) == ["notes/"]


# --- written by DeepSpeed ---------------------------------------------------------


def test_real_deepspeed_checkpoints_are_recognised(deepspeed_run: CheckpointRun) -> None:
    rec = scan(deepspeed_run.root)
    assert rec.unrecognised == ()
    assert [(c.job, c.step, c.format, c.prefix) for c in rec.checkpoints] == [
        (deepspeed_run.job, s, Format.DEEPSPEED, deepspeed_run.steps[s].prefix) for s in sorted(deepspeed_run.steps)]
    for c in rec.checkpoints:
        assert c.committed and c.shortfalls == (), c.reason
        assert tuple(f.relpath for f in c.files) == deepspeed_run.steps[c.step].files
        assert "mp_rank_00_model_states.pt" in deepspeed_run.steps[c.step].files


def test_real_deepspeed_save_in_flight_and_torn_rank(deepspeed_run: CheckpointRun, tmp_path: Path) -> None:
    run = copy_run(deepspeed_run, tmp_path / "copy")
    (run.root / run.job / "latest").write_text("global_step4")  # step 6 saved, its tag not yet written
    (run.path(2) / "zero_pp_rank_0_mp_rank_00_optim_states.pt").rename(run.path(2) / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    rec = scan(run.root)
    assert [(c.step, c.committed) for c in rec.checkpoints] == [(2, True), (4, True), (6, False)]
    assert [s.relpath for s in only(rec.checkpoints, 2).shortfalls] == ["zero_pp_rank_0_mp_rank_00_optim_states.pt"]


def test_real_deepspeed_files_verify_as_torch_zips(deepspeed_run: CheckpointRun, tmp_path: Path) -> None:
    from ckptier.formats import checker_for
    from ckptier.storage.hashing import hash_file

    for rel in deepspeed_run.steps[6].files:
        checker = checker_for(rel, Format.DEEPSPEED)
        assert checker is not None and checker.kind == "torch zip"
        hash_file(deepspeed_run.path(6) / rel, observe=checker.feed)
        assert checker.finish().problem is None
    torn = tmp_path / "torn.pt"
    data = (deepspeed_run.path(6) / "mp_rank_00_model_states.pt").read_bytes()
    torn.write_bytes(data[: len(data) // 2])
    checker = checker_for("mp_rank_00_model_states.pt", Format.DEEPSPEED)
    assert checker is not None
    hash_file(torn, observe=checker.feed)
    assert "truncated" in (checker.finish().problem or "")


@pytest.mark.slow
def test_deepspeed_classes_are_never_imported_and_unknown_ones_are_refused(deepspeed_run: CheckpointRun) -> None:
    optim = deepspeed_run.path(6) / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with pytest.raises(UnsafeCheckpoint, match="deepspeed.runtime") as caught:
        safe_torch_load(optim)  # the generic loader knows nothing of DeepSpeed's classes
    assert caught.value.global_name in LIBRARY_GLOBALS
    assert _loaded_in_a_fresh_process(deepspeed_run.path(6)) == ["4", "[0,", "1,", "2,", "3]", "6", "[]"]


def _loaded_in_a_fresh_process(path: Path) -> list[str]:
    """Load the DeepSpeed checkpoint at ``path`` in a new interpreter; what it printed, split:
    model tensors, optimizer state ids, the step, and every ``deepspeed`` module imported."""
    code = (
        "import sys; from pathlib import Path\n"
        "from ckptier.formats.safe_load import load_checkpoint_dir\n"
        f"loaded = load_checkpoint_dir(Path({str(path)!r}), 'deepspeed')\n"
        "print(len(loaded.model_state), sorted(loaded.optimizer_state['state']), loaded.step,"
        " [m for m in sys.modules if m.split('.')[0] == 'deepspeed'])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_zero_optimizer_state_is_cut_back_into_the_torch_optimizers(deepspeed_run: CheckpointRun) -> None:
    import torch

    from tests.fixtures.checkpoints import LR, tiny_mlp

    loaded = load_checkpoint_dir(deepspeed_run.path(4), Format.DEEPSPEED)
    model = tiny_mlp()
    model.load_state_dict(loaded.model_state)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    optimizer.load_state_dict(loaded.optimizer_state)
    for (name, param), state in zip(model.named_parameters(), optimizer.state.values(), strict=True):
        assert state["exp_avg"].shape == param.shape, name
        assert float(state["step"]) == 4
        assert bool(state["exp_avg_sq"].gt(0).any())
    assert loaded.recorded_loss == pytest.approx(deepspeed_run.steps[4].loss)


def test_real_deepspeed_checkpoint_drills(deepspeed_run: CheckpointRun, tmp_path: Path) -> None:
    step = max(deepspeed_run.steps)
    result = run_request(DrillRequest(str(deepspeed_run.path(step)), "deepspeed", FACTORY, 3, "cpu", str(tmp_path / "r.json")))
    verdict = judge([result])
    assert verdict.ok, verdict.summary
    assert result.optimizer_loaded and result.optimizer_step_before == step and result.optimizer_step_after == step + 3
    assert result.recorded_loss == pytest.approx(deepspeed_run.steps[step].loss)


def test_a_deepspeed_drill_without_a_factory_says_what_to_pass(deepspeed_run: CheckpointRun, tmp_path: Path) -> None:
    result = run_request(DrillRequest(str(deepspeed_run.path(2)), "deepspeed", None, 2, "cpu", str(tmp_path / "r.json")))
    assert result.error_stage == "build" and "a DeepSpeed checkpoint holds tensors only" in (result.error or "")
    assert "--model module:function" in (result.error or "")


@pytest.mark.slow
def test_cli_scan_ls_verify_and_drill_a_deepspeed_job(
    deepspeed_run: CheckpointRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckptier.flows.cli import main

    hot = tmp_path / "hot"
    shutil.copytree(deepspeed_run.root, hot)
    monkeypatch.setenv("CKPTIER_CATALOG_URL", f"sqlite:///{tmp_path / 'catalog.db'}")
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the drill worker imports the factory from tests/
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["scan", str(hot)]) == 0
    assert main(["verify"]) == 0
    capsys.readouterr()
    assert main(["ls", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted((r["job"], r["step"], r["format"], r["state"]) for r in rows) == [
        ("ds/run", s, "deepspeed", "verified") for s in (2, 4, 6)]
    assert main(["drill", "--job", "ds/run", "--device", "cpu", "--steps", "2", "--model", FACTORY, "--json",
                 "--no-prefect"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["step"] == 6, report["summary"]
    assert LocalStore(hot).stat("ds/run/latest").size > 0  # the drill read a copy; the hot store is untouched


# --- ZeRO stage 3 ----------------------------------------------------------------


def test_zero3_pieces_are_one_per_parameter_each_padded_to_a_whole_share() -> None:
    shapes = [(16, 8), (16,), (1, 16), (1,)]  # the tiny MLP: 161 values
    assert zero3_slices(shapes, 2) == ([(0, 64, 128), (64, 8, 16), (72, 8, 16), (80, 1, 1)], 81)
    assert zero3_slices(shapes, 3) == ([(0, 43, 128), (43, 6, 16), (49, 6, 16), (55, 1, 1)], 56)
    assert zero3_slices([], 2) == ([], 0)


def _zero3_copy(runs: Path, tmp_path: Path, step: int = 6) -> Path:
    out = tmp_path / f"global_step{step}"
    shutil.copytree(runs / "zero3" / "run" / f"global_step{step}", out)
    return out


@pytest.mark.parametrize("step", [3, 6])
def test_zero3_weights_are_reassembled_bit_exactly_with_the_optimizer_state(
    deepspeed_zero_runs: Path, step: int
) -> None:
    import torch

    from tests.fixtures.checkpoints import LR, tiny_mlp

    loaded = load_checkpoint_dir(deepspeed_zero_runs / "zero3" / "run" / f"global_step{step}", Format.DEEPSPEED)
    reference = torch.load(deepspeed_zero_runs / "reference" / f"zero3_step{step}.pt", weights_only=True)
    assert list(loaded.model_state) == list(reference) == list(tiny_mlp().state_dict())
    for name, weight in reference.items():  # gathered from the ranks at the save
        assert loaded.model_state[name].dtype == weight.dtype and torch.equal(loaded.model_state[name], weight), name
    assert loaded.step == step and loaded.extra["dp_world_size"] == 2
    model = tiny_mlp()
    model.load_state_dict(loaded.model_state)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    optimizer.load_state_dict(loaded.optimizer_state)
    for (name, param), state in zip(model.named_parameters(), optimizer.state.values(), strict=True):
        assert state["exp_avg"].shape == state["exp_avg_sq"].shape == param.shape, name
        assert float(state["step"]) == step and bool(state["exp_avg_sq"].gt(0).all()), name


def test_zero3_loads_without_importing_deepspeed(deepspeed_zero_runs: Path) -> None:
    assert _loaded_in_a_fresh_process(deepspeed_zero_runs / "zero3" / "run" / "global_step6") == [
        "4", "[0,", "1,", "2,", "3]", "6", "[]"]


def test_zero3_optimizer_state_retrains_to_the_runs_own_weights(deepspeed_zero_runs: Path) -> None:
    """Restored at step 3 and trained on steps 4..6 as DeepSpeed trained them (AdamW,
    the gradient norm clipped to 1.0, DeepSpeed's default), the model reaches the
    run's own step-6 weights; with fresh optimizer state it does not."""
    import torch

    from tests.fixtures.checkpoints import LR, tiny_batch, tiny_loss, tiny_mlp

    loaded = load_checkpoint_dir(deepspeed_zero_runs / "zero3" / "run" / "global_step3", Format.DEEPSPEED)
    reference = torch.load(deepspeed_zero_runs / "reference" / "zero3_step6.pt", weights_only=True)

    def distance(restore_optimizer: bool) -> float:
        model = tiny_mlp()
        model.load_state_dict(loaded.model_state)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        if restore_optimizer:
            optimizer.load_state_dict(loaded.optimizer_state)
        for step in (4, 5, 6):
            optimizer.zero_grad()
            tiny_loss(model, tiny_batch(step)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        return max(float((model.state_dict()[k] - w).abs().max()) for k, w in reference.items())

    assert distance(True) < 1e-6
    assert distance(False) > 1e-3  # the Adam moments matter: the check can fail


def _resave(path: Path, change: Callable[[Any], None]) -> None:
    import torch

    obj = torch.load(path, weights_only=False)  # the test's own fixture, re-saved with one thing changed
    change(obj)
    torch.save(obj, path)


def test_zero3_shards_that_cannot_restore_are_named_in_one_line(deepspeed_zero_runs: Path, tmp_path: Path) -> None:
    from ckptier.formats.loaded import CheckpointLoadError, UnsupportedCheckpoint

    missing = _zero3_copy(deepspeed_zero_runs, tmp_path / "missing")
    (missing / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointLoadError) as caught:
        load_checkpoint_dir(missing, Format.DEEPSPEED)
    assert not isinstance(caught.value, UnsupportedCheckpoint)
    assert str(caught.value) == (f"{missing}: ZeRO stage 3 of 2 data-parallel ranks lacks "
                                 "zero_pp_rank_1_mp_rank_00_optim_states.pt; every rank's model and optimizer states "
                                 "are needed: re-fetch or re-verify the checkpoint")

    mixed = _zero3_copy(deepspeed_zero_runs, tmp_path / "mixed")  # rank 1's files from the step-3 save
    for f in ("zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        shutil.copy(deepspeed_zero_runs / "zero3" / "run" / "global_step3" / f, mixed / f)
    with pytest.raises(CheckpointLoadError, match=r"zero_pp_rank_1_mp_rank_00_model_states\.pt: of step 3, but "
                       r"zero_pp_rank_0_mp_rank_00_model_states\.pt of step 6: the ranks' files are of different saves$"):
        load_checkpoint_dir(mixed, Format.DEEPSPEED)

    adam = _zero3_copy(deepspeed_zero_runs, tmp_path / "adam")  # only the optimizer file of rank 1 is older
    shutil.copy(deepspeed_zero_runs / "zero3" / "run" / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                adam / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointLoadError, match="disagree on step of sub-group 0: the ranks saved different steps"):
        load_checkpoint_dir(adam, Format.DEEPSPEED)

    result = run_request(DrillRequest(str(missing), "deepspeed", FACTORY, 2, "cpu", str(tmp_path / "r.json")))
    assert result.error_stage == "load" and "lacks zero_pp_rank_1_mp_rank_00_optim_states.pt" in (result.error or "")
    assert "\n" not in (result.error or "")


def test_zero3_layouts_the_reader_does_not_understand_are_unsupported(deepspeed_zero_runs: Path, tmp_path: Path) -> None:
    import torch
    from ckptier.formats.loaded import UnsupportedCheckpoint

    padded = _zero3_copy(deepspeed_zero_runs, tmp_path / "padded")  # alignment padding after the pieces
    for dp in (0, 1):
        _resave(padded / f"zero_pp_rank_{dp}_mp_rank_00_optim_states.pt", lambda o: o["optimizer_state_dict"].update(
            fp32_flat_groups=[torch.cat([g, torch.zeros(3)]) for g in o["optimizer_state_dict"]["fp32_flat_groups"]]))
    with pytest.raises(UnsupportedCheckpoint, match=r"zero_pp_rank_0_mp_rank_00_optim_states\.pt: not supported yet: "
                       r"fp32 flat group 0 holds 84 values, where param_shapes' pieces over 2 ranks take 81$"):
        load_checkpoint_dir(padded, Format.DEEPSPEED)

    frozen = _zero3_copy(deepspeed_zero_runs, tmp_path / "frozen")
    _resave(frozen / "zero_pp_rank_0_mp_rank_00_model_states.pt",
            lambda o: o.update(frozen_param_shapes={"net.0.weight": torch.Size([16, 8])}))
    with pytest.raises(UnsupportedCheckpoint, match="not supported yet: ZeRO stage 3 with frozen parameters$"):
        load_checkpoint_dir(frozen, Format.DEEPSPEED)

    result = run_request(DrillRequest(str(padded), "deepspeed", FACTORY, 2, "cpu", str(tmp_path / "r.json")))
    assert result.error_stage == "unsupported" and "fp32 flat group 0 holds 84 values" in (result.error or "")
