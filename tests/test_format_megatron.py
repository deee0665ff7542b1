"""Megatron-LM checkpoints: recognised, complete, verified and drilled (ckptier.formats.megatron).

Megatron-LM's legacy writer is its training code (not a package), so the
checkpoints here are built following Megatron-LM's own source
(``megatron/training/checkpointing.py`` of NVIDIA/Megatron-LM at commit
0032978f: ``get_checkpoint_name``, ``generate_state_dict``,
``get_rng_state``, the tracker ``save_checkpoint`` writes last; and
``megatron/core/dist_checkpointing/serialization.py``'s ``save_config`` for
``torch_dist``'s ``metadata.json``) by ``megatron_run`` and the listings
below. The DCP shards of the ``torch_dist`` case are written by torch;
``tests/test_drill_megatron.py`` drills ``torch_dist`` saves that
megatron-core itself wrote on CPU.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from ckptier.formats.megatron import LIBRARY_GLOBALS, TRACKER, legacy_shortfalls, megatron_rng
from ckptier.formats.safe_load import (
    UnsafeCheckpoint,
    load_checkpoint_dir,
    safe_torch_load,
)
from ckptier.storage.records import Format
from ckptier.tasks.drill import DrillRequest, judge
from ckptier.tasks.drill_worker import run_request

from tests.fixtures.checkpoints import (
    CheckpointRun,
    copy_run,
    tiny_batch,
    tiny_loss,
    tiny_mlp,
)
from tests.fixtures.listing import dcp_meta, only, reasons, recognise_listing, scan

REPO = Path(__file__).resolve().parents[1]
FACTORY = "tests.fixtures.checkpoints:tiny_mlp_drill_spec"
TORCH_DIST_CONFIG = b'{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}'


# --- layout (always runs) ------------------------------------------------------


def test_legacy_iterations_up_to_the_tracker_are_committed() -> None:
    keys: dict[str, bytes | int] = {f"m/iter_{n:07d}/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt": 50
                                    for n in (100, 200, 300) for tp in range(2) for pp in range(2)}
    keys[f"m/{TRACKER}"] = b"200"
    rec = recognise_listing(keys)
    assert rec.unrecognised == ()
    assert [(c.job, c.step, c.format, c.committed, len(c.files)) for c in rec.checkpoints] == [
        ("m", 100, Format.MEGATRON, True, 4), ("m", 200, Format.MEGATRON, True, 4), ("m", 300, Format.MEGATRON, False, 4)]
    assert f"{TRACKER} (200) was written after it" in only(rec.checkpoints, 200).reason
    assert f"newer than {TRACKER} (200)" in only(rec.checkpoints, 300).reason


def test_a_missing_tensor_or_pipeline_rank_is_a_shortfall() -> None:
    rels = ["mp_rank_00_000/model_optim_rng.pt", "mp_rank_00_001/model_optim_rng.pt",
            "mp_rank_01_001/model_optim_rng.pt", "mp_rank_01_001/distrib_optim.pt"]
    assert [str(s) for s in legacy_shortfalls(rels)] == [
        "mp_rank_00_000/distrib_optim.pt (absent, listed in Megatron's rank directories)",
        "mp_rank_00_001/distrib_optim.pt (absent, listed in Megatron's rank directories)",
        "mp_rank_01_000/distrib_optim.pt (absent, listed in Megatron's rank directories)",
        "mp_rank_01_000/model_optim_rng.pt (absent, listed in Megatron's rank directories)",
    ]
    keys: dict[str, bytes | int] = {f"m/iter_0000005/{r}": 9 for r in rels}
    keys[f"m/{TRACKER}"] = b"5"
    (c,) = recognise_listing(keys).checkpoints
    assert c.committed and len(c.shortfalls) == 4 and "rank file(s) missing" in c.reason


def test_torch_dist_needs_dcp_evidence_and_megatrons_metadata_json() -> None:
    base = {"m/iter_0000010/__0_0.distcp": 64, "m/iter_0000010/common.pt": 20,
            "m/iter_0000010/.metadata": dcp_meta({"__0_0.distcp": 64}), f"m/{TRACKER}": b"10"}
    (c,) = recognise_listing(base).checkpoints
    assert (c.format, c.committed) == (Format.MEGATRON, False) and "metadata.json (written last)" in c.reason
    (c,) = recognise_listing({**base, "m/iter_0000010/metadata.json": TORCH_DIST_CONFIG}).checkpoints
    assert c.committed and "torch_dist" in c.reason and len(c.files) == 4
    short = {**base, "m/iter_0000010/metadata.json": TORCH_DIST_CONFIG, "m/iter_0000010/__0_0.distcp": 10}
    (c,) = recognise_listing(short).checkpoints
    assert [s.relpath for s in c.shortfalls] == ["__0_0.distcp"]


def test_release_tracker_and_unnumbered_dirs_are_not_guessed() -> None:
    rec = recognise_listing({"m/iter_0000001/mp_rank_00/model_optim_rng.pt": 5, f"m/{TRACKER}": b"release",
                             "m/iter_best/mp_rank_00/model_optim_rng.pt": 5})
    (c,) = rec.checkpoints
    assert not c.committed and "not an iteration" in c.reason
    assert "expected iter_<digits>" in reasons(rec)["m/iter_best/"]


# --- built as Megatron-LM builds them ------------------------------------------------


def test_megatron_checkpoints_are_recognised(megatron_run: CheckpointRun) -> None:
    rec = scan(megatron_run.root)
    assert rec.unrecognised == ()
    assert [(c.job, c.step, c.format, c.prefix, c.committed) for c in rec.checkpoints] == [
        (megatron_run.job, s, Format.MEGATRON, megatron_run.steps[s].prefix, True) for s in sorted(megatron_run.steps)]
    assert all(c.files[0].relpath == "mp_rank_00/model_optim_rng.pt" for c in rec.checkpoints)


def test_megatron_save_in_flight_is_incomplete(megatron_run: CheckpointRun, tmp_path: Path) -> None:
    run = copy_run(megatron_run, tmp_path / "copy")
    (run.root / run.job / TRACKER).write_text("4")
    assert [(c.step, c.committed) for c in scan(run.root).checkpoints] == [(2, True), (4, True), (6, False)]


def test_args_namespace_and_enums_load_as_plain_data_never_megatron_code(megatron_run: CheckpointRun) -> None:
    file = megatron_run.path(6) / "mp_rank_00" / "model_optim_rng.pt"
    with pytest.raises(UnsafeCheckpoint, match="argparse.Namespace"):
        safe_torch_load(file)  # not allowed by default: the format allows it
    loaded = load_checkpoint_dir(megatron_run.path(6), Format.MEGATRON)
    assert loaded.step == 6 and set(loaded.model_state) == set(tiny_mlp().state_dict())
    assert loaded.extra["args"]["hidden_size"] == 16 and "attention_backend" not in loaded.extra["args"]
    assert loaded.optimizer_state is not None and len(loaded.optimizer_state["state"]) == 4
    assert "megatron.core.transformer.enums.AttnBackend" in LIBRARY_GLOBALS
    import sys

    assert not [m for m in sys.modules if m.split(".")[0] == "megatron"]


@pytest.mark.parametrize(("saved", "rank", "want"), [
    ([{"random_rng_state": 1, "np_rng_state": 2, "torch_rng_state": 3, "cuda_rng_state": 4, "rng_tracker_states": {}}], 0,
     {"python": 1, "numpy": 2, "cpu": 3}),  # CUDA generator and tracker forks: not on a CPU drill
    ([{"torch_rng_state": "a"}, {"torch_rng_state": "b"}], 1, {"cpu": "b"}),  # the data-parallel rank's own
    ({"random_rng_state": 1}, 0, {"python": 1}),  # one rank's, not in a list
    ([{"torch_rng_state": "a"}], 1, None),  # no such rank
    ([{"cuda_rng_state": 4}], 0, None),
    (None, 0, None), ("x", 0, None), ([7], 0, None),
])
def test_megatron_rng_streams_a_cpu_drill_continues(saved: object, rank: int, want: object) -> None:
    assert megatron_rng(saved, rank) == want


def test_a_megatron_drill_continues_the_runs_cpu_random_streams(megatron_run: CheckpointRun) -> None:
    import random

    from ckptier.tasks.drill_worker import resume_rng

    file = megatron_run.path(6) / "mp_rank_00" / "model_optim_rng.pt"
    from ckptier.formats.stubs import stub_allowlist

    saved = safe_torch_load(file, extra_allowlist=["argparse.Namespace", *stub_allowlist(LIBRARY_GLOBALS)])["rng_state"][0]
    loaded = load_checkpoint_dir(megatron_run.path(6), Format.MEGATRON)
    assert loaded.rng_state is not None and sorted(loaded.rng_state) == ["cpu", "numpy", "python"]
    torch.manual_seed(0)
    random.seed(0)
    assert resume_rng(loaded.rng_state) == ["python", "numpy", "cpu"]
    drawn = (torch.rand(3), random.random())
    torch.set_rng_state(saved["torch_rng_state"])
    random.setstate(saved["random_rng_state"])
    assert torch.equal(drawn[0], torch.rand(3)) and drawn[1] == random.random()
    import sys

    assert not [m for m in sys.modules if m.split(".")[0] == "megatron"]


def test_megatron_checkpoint_drills_and_resumes_exactly(megatron_run: CheckpointRun, tmp_path: Path) -> None:
    step = max(megatron_run.steps)
    result = run_request(DrillRequest(str(megatron_run.path(step)), "megatron", FACTORY, 3, "cpu", str(tmp_path / "r.json")))
    verdict = judge([result])
    assert verdict.ok, verdict.summary
    assert result.optimizer_step_before == step and result.optimizer_step_after == step + 3
    assert result.rng_saved == ("cpu", "numpy", "python") and result.rng_resumed == ("python", "numpy", "cpu")
    streams = next(c for c in verdict.checks if c.name == "random_streams")
    assert streams.ok and streams.detail == "continued the run's python, numpy, cpu random streams"
    model = tiny_mlp()
    model.load_state_dict(load_checkpoint_dir(megatron_run.path(step), Format.MEGATRON).model_state)
    with torch.no_grad():
        assert result.losses[0] == pytest.approx(float(tiny_loss(model, tiny_batch(step + 1))), rel=1e-6)


def test_two_tensor_ranks_are_refused_until_multi_rank_drills(megatron_run: CheckpointRun, tmp_path: Path) -> None:
    run = copy_run(megatron_run, tmp_path / "copy")
    shutil.copytree(run.path(2) / "mp_rank_00", run.path(2) / "mp_rank_01")
    result = run_request(DrillRequest(str(run.path(2)), "megatron", FACTORY, 2, "cpu", str(tmp_path / "r.json")))
    assert result.error_stage == "unsupported" and "not supported yet: 2 model-parallel ranks" in (result.error or "")
    from ckptier.formats.registry import plugin

    rels = sorted(str(f.relative_to(run.path(2))) for f in run.path(2).rglob("*") if f.is_file())
    plan = plugin(Format.MEGATRON).rank_files(rels, lambda rel: (run.path(2) / rel).read_bytes())
    assert (plan.saved_world, plan.layout) == (2, "partitioned")
    assert [list(n) for n in plan.needs] == [["mp_rank_00/model_optim_rng.pt"], ["mp_rank_01/model_optim_rng.pt"]]


def test_torch_dist_iteration_restores_its_model_tensors(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model = tiny_mlp()
    it = tmp_path / "m" / "iter_0000003"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.save({k: v.detach().clone() for k, v in model.state_dict().items()}, checkpoint_id=str(it))
    torch.save({"iteration": 3, "checkpoint_version": 3.0}, it / "common.pt")
    (it / "metadata.json").write_bytes(TORCH_DIST_CONFIG)
    (tmp_path / "m" / TRACKER).write_text("3")
    (c,) = scan(tmp_path).checkpoints
    assert (c.format, c.step, c.committed) == (Format.MEGATRON, 3, True), c.reason
    loaded = load_checkpoint_dir(it, Format.MEGATRON)
    assert loaded.optimizer_state is None and set(loaded.model_state) == set(model.state_dict())
    assert loaded.optimizer_left is None  # the save holds no optimizer state


def test_torch_dist_optimizer_shards_not_restored_are_named(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model = tiny_mlp()
    it = tmp_path / "m" / "iter_0000003"
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state |= {f"optimizer.state.exp_avg.{k}": torch.zeros_like(v) for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.save(state, checkpoint_id=str(it))
    loaded = load_checkpoint_dir(it, Format.MEGATRON)
    assert set(loaded.model_state) == set(model.state_dict()) and loaded.optimizer_state is None
    assert loaded.optimizer_left == f"its torch_dist optimizer state ({len(model.state_dict())} tensors) is not restored yet"


@pytest.mark.slow
def test_cli_scan_ls_and_drill_a_megatron_job(
    megatron_run: CheckpointRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckptier.flows.cli import main

    hot = tmp_path / "hot"
    shutil.copytree(megatron_run.root, hot)
    monkeypatch.setenv("CKPTIER_CATALOG_URL", f"sqlite:///{tmp_path / 'catalog.db'}")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["scan", str(hot)]) == 0
    assert main(["verify"]) == 0
    capsys.readouterr()
    assert main(["ls", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted((r["job"], r["step"], r["format"], r["state"]) for r in rows) == [
        ("mega/gpt", s, "megatron", "verified") for s in (2, 4, 6)]
    assert main(["drill", "--job", "mega/gpt", "--device", "cpu", "--steps", "2", "--model", FACTORY, "--json",
                 "--no-prefect"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["step"] == 6, report["summary"]
