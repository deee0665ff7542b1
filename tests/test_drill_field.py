"""Drills of what the field writes, and verdicts that blame only the checkpoint.

* DeepSpeed ZeRO-2 of 2 data-parallel ranks (written by DeepSpeed): the
  optimizer partitions are joined and the checkpoint restores on one rank,
  trains the catalog's steps and retraces the run's losses: ``passed``.
* DeepSpeed ZeRO-3 of 2 data-parallel ranks: the weights are reassembled
  from every rank's fp32 partitions and the optimizer state from every
  rank's Adam partitions; it restores on one rank, trains the catalog's
  steps and retraces the run's losses: ``passed``; a factory whose batches
  are off by the step fails the ``trajectory`` check.
* A ZeRO-3 variant not restored yet (2 model-parallel ranks): ``not
  judged``, once (the drill does not walk back through the job), never
  ``failed``, and ``latest`` is unchanged.
* Hugging Face ``transformers.Trainer`` (real runs of the tiny GPT-2): the
  drill of an earlier checkpoint with a factory that steps as the Trainer
  does on the run's own inputs trains the catalog's steps and retraces the
  losses of the later checkpoints' ``trainer_state.json``; with
  ``logging_steps=2`` each logged loss (a 2-step mean) is compared with the
  mean of the drill's losses over the same 2 steps; the run's batches fed
  from the first again fail ``trajectory`` at the largest deviation.
* A factory that does not fit: one ``not judged`` ("the factory does not
  fit this job"), ``latest`` unchanged; no ``--model`` at all: a usage
  error before anything is fetched, nothing recorded.

Slow: drills start worker processes.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest

from ckptier.storage.catalog.api import Catalog
from tests.fixtures.checkpoints import CheckpointRun
from tests.test_drill_steps import OFF_BY_THE_STEP, cli  # noqa: F401 - the command line in a fresh catalog; a factory off by the step

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
FACTORY = "tests.fixtures.checkpoints:tiny_mlp_drill_spec"

WIDER = textwrap.dedent(
    '''
    import torch
    from torch import nn
    from ckptier.tasks.drill_models import DrillSpec
    from tests.fixtures.checkpoints import tiny_batch, tiny_loss


    def wider():
        """The run's MLP with a wider hidden layer: shape mismatch for net.0.weight."""
        model = nn.Module()
        model.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        model.forward = lambda x: model.net(x)
        return DrillSpec(model, torch.optim.AdamW(model.parameters(), lr=1e-2), tiny_batch, tiny_loss)
    '''
)


def _drills(tmp_path: Path) -> list:  # type: ignore[type-arg]
    with Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
        return cat.drills()


def _checks(report: dict) -> dict[str, dict]:  # type: ignore[type-arg]
    return {c["name"]: c for c in report["checks"]}


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_deepspeed_zero_of_2_ranks_restores_on_one_and_retraces_the_run(
    deepspeed_zero_runs: Path, tmp_path: Path, cli, stage: str  # type: ignore[no-untyped-def]  # noqa: F811
) -> None:
    """ZeRO 2 (optimizer states partitioned) and ZeRO 3 (the weights too) of 2 ranks restore on one."""
    hot = tmp_path / "hot"
    shutil.copytree(deepspeed_zero_runs / stage, hot / stage)
    assert cli("scan", str(hot))[0] == 0 and cli("verify")[0] == 0
    code, out, err = cli("drill", "--job", f"{stage}/run", "--device", "cpu", "--steps", "3", "--model", FACTORY,
                         "--json", "--no-prefect")
    (report,) = json.loads(out)
    assert code == 0 and report["verdict"] == "passed", (report["summary"], err)
    assert report["step"] == 6 and report["trained_steps"] == [7, 9]
    checks = _checks(report)
    assert checks["optimizer_continues"]["detail"] == "step counter 6 -> 9", checks  # both ranks' Adam partitions
    assert checks["trajectory"]["ok"] and checks["trajectory"]["detail"].startswith("3 recorded losses of steps 7..9"), checks
    assert report["stack"]["deepspeed"]  # the format's library is part of the stack the drill ran on
    rows = {r["step"]: r["loss"] for r in map(json.loads, (hot / stage / "run" / "losses.jsonl").read_text().splitlines())}
    assert report["losses"][0] == pytest.approx(rows[7], rel=1e-5)  # the weights, whole: step 7's loss is the run's
    # (steps 8, 9 only within the trajectory's tolerance: DeepSpeed clipped the gradient norm to 1.0, its default,
    # and the factory does not; test_format_deepspeed.py retrains with the clip and reaches the run's weights)

    factories = tmp_path / "off_by_the_step.py"
    factories.write_text(OFF_BY_THE_STEP)
    code, out, _ = cli("drill", "--job", f"{stage}/run", "--device", "cpu", "--steps", "3", "--model",
                       f"{factories}:batches_from_one", "--json", "--no-prefect")
    (wrong,) = json.loads(out)
    assert code == 1 and wrong["verdict"] == "failed" and wrong["trained_steps"] == [7, 9]
    assert [c["name"] for c in wrong["checks"] if not c["ok"]] == ["trajectory"], wrong["checks"]
    assert _checks(wrong)["trajectory"]["detail"].startswith("the drill does not retrace the run: at step ")


def test_a_zero3_variant_not_restored_yet_is_not_judged_once_and_latest_stays(
    deepspeed_zero_runs: Path, tmp_path: Path, cli  # type: ignore[no-untyped-def]  # noqa: F811
) -> None:
    hot = tmp_path / "hot"
    shutil.copytree(deepspeed_zero_runs / "zero3", hot / "zero3")
    step6 = hot / "zero3" / "run" / "global_step6"
    for f in sorted(step6.glob("zero_pp_rank_*_mp_rank_00_*.pt")):  # a second tensor-parallel rank beside the first
        shutil.copy(f, step6 / f.name.replace("_mp_rank_00_", "_mp_rank_01_"))
    assert cli("scan", str(hot))[0] == 0 and cli("verify")[0] == 0
    code, out, _ = cli("drill", "--job", "zero3/run", "--device", "cpu", "--steps", "2", "--model", FACTORY, "--json",
                       "--no-prefect")
    reports = json.loads(out)
    assert code == 1 and [r["verdict"] for r in reports] == ["not judged"], reports  # step 3 was not tried
    assert "not judged: this variant cannot be drilled yet" in reports[0]["summary"]
    assert "not supported yet: ZeRO stage 3 over 2 model-parallel ranks" in reports[0]["summary"], reports[0]["summary"]
    (drill,) = _drills(tmp_path)
    assert (drill.step, drill.outcome, drill.judged) == (6, "not judged", False)
    code, out, _ = cli("latest", "--job", "zero3/run", "--json")
    assert code == 0 and json.loads(out)["step"] == 6 and json.loads(out)["proof"] == "verified"


def test_a_factory_that_does_not_fit_is_one_not_judged_and_no_model_is_a_usage_error(
    guide_run: CheckpointRun, tmp_path: Path, cli  # type: ignore[no-untyped-def]  # noqa: F811
) -> None:
    hot = tmp_path / "hot"
    shutil.copytree(guide_run.root, hot)
    assert cli("scan", str(hot))[0] == 0 and cli("verify")[0] == 0
    code, _, err = cli("drill", "--job", guide_run.job, "--device", "cpu", "--no-prefect")
    assert code == 2 and f"job '{guide_run.job}' step 6: no drill model given" in err and "--model" in err, err
    assert _drills(tmp_path) == []  # nothing fetched, nothing recorded

    factories = tmp_path / "wider.py"
    factories.write_text(WIDER)
    code, out, _ = cli("drill", "--job", guide_run.job, "--device", "cpu", "--steps", "2", "--model",
                       f"{factories}:wider", "--json", "--no-prefect")
    reports = json.loads(out)
    assert code == 1 and len(reports) == 1, reports  # the same mismatch would stop every older step: not tried
    (report,) = reports
    assert report["verdict"] == "not judged" and report["stage"] == "fit"
    assert report["summary"].startswith(f"{guide_run.job} step 6: not judged: the factory does not fit this job: "
                                        "checkpoint does not fit the model: shape mismatch for net.0.weight"), report
    (drill,) = _drills(tmp_path)
    assert drill.outcome == "not judged"
    code, out, _ = cli("latest", "--job", guide_run.job, "--json")
    assert code == 0 and json.loads(out)["step"] == 6 and not json.loads(out).get("passed_over")


LIGHTNING_RUN = textwrap.dedent(
    '''
    import sys
    import torch, lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader
    from tests.fixtures.checkpoints import LR, tiny_batch, tiny_loss, tiny_mlp


    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = tiny_mlp().net

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            loss = tiny_loss(self, batch)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)


    trainer = L.Trainer(max_steps=6, logger=CSVLogger(sys.argv[1]), log_every_n_steps=1, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1,
                        callbacks=[ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)])
    trainer.fit(Tiny(), train_dataloaders=DataLoader([tiny_batch(s) for s in range(1, 7)], batch_size=None))
    '''
)


def test_lightning_drill_retraces_the_csv_logger_losses(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """A real Lightning run with CSVLogger: checkpoints in lightning_logs/version_0/checkpoints/, the losses
    one directory up in metrics.csv, training step N's logged at step N - 1."""
    import os
    import subprocess
    import sys

    pytest.importorskip("lightning")
    hot = tmp_path / "hot"
    subprocess.run([sys.executable, "-c", LIGHTNING_RUN, str(hot)], cwd=REPO, check=True, capture_output=True,
                   timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (hot / "lightning_logs" / "version_0" / "metrics.csv").is_file()
    for ckpt in hot.rglob("*.ckpt"):  # saved an hour ago: past Lightning's settle time, committed
        os.utime(ckpt, (ckpt.stat().st_mtime - 3600,) * 2)
    assert cli("scan", str(hot))[0] == 0 and cli("verify")[0] == 0
    job = "lightning_logs/version_0/checkpoints"
    code, out, err = cli("drill", "--job", job, "--step", "2", "--device", "cpu", "--steps", "3", "--model", FACTORY,
                         "--json", "--no-prefect")
    assert out, err
    (report,) = json.loads(out)
    assert code == 0 and report["verdict"] == "passed", (report["summary"], err)
    assert report["trained_steps"] == [3, 5]
    trajectory = _checks(report)["trajectory"]
    assert trajectory["detail"].startswith("3 recorded losses of steps 3..5 retraced") and "metrics.csv" in trajectory["detail"]


HF_FACTORIES = '''
from tests.fixtures.checkpoints import hf_trainer_drill_spec


def the_runs_inputs(metadata):
    return hf_trainer_drill_spec(metadata, {inputs!r})


def inputs_from_one(metadata):
    """The run's inputs, but from its first batch again whatever the step the checkpoint was saved at."""
    spec = hf_trainer_drill_spec(metadata, {inputs!r})
    run_batch, start = spec.batch, metadata["step"]
    spec.batch = lambda step, device: run_batch(step - start, device)
    return spec
'''


def _logged_losses(checkpoint: Path) -> dict[int, float]:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return {e["step"]: e["loss"] for e in state["log_history"] if "loss" in e}


def _hf_drill(cli, run: CheckpointRun, factories: Path, factory: str, *, step: int,  # type: ignore[no-untyped-def]  # noqa: F811
              steps: int) -> tuple[int, dict]:  # type: ignore[type-arg]
    code, out, err = cli("drill", "--job", run.job, "--step", str(step), "--device", "cpu",
                         "--steps", str(steps), "--model", f"{factories}:{factory}", "--json", "--no-prefect")
    assert out, err
    (report,) = json.loads(out)
    return code, report


def _scanned_hf_run(run: CheckpointRun, tmp_path: Path, cli) -> tuple[Path, Path]:  # type: ignore[no-untyped-def]  # noqa: F811
    """``run`` copied to a hot tree, scanned and verified, and the factories module fed its inputs."""
    assert run.inputs is not None
    hot = tmp_path / "hot"
    shutil.copytree(run.root, hot)
    factories = tmp_path / "hf_factories.py"
    factories.write_text(HF_FACTORIES.format(inputs=str(run.inputs)))
    assert cli("scan", str(hot))[0] == 0 and cli("verify")[0] == 0
    return hot, factories


def test_hf_trainer_drill_retraces_the_logged_losses_and_a_wrong_data_order_fails(
    hf_run: CheckpointRun, tmp_path: Path, cli  # type: ignore[no-untyped-def]  # noqa: F811
) -> None:
    """A real ``transformers.Trainer`` run (logging every step): the drill of checkpoint-2 trains steps 3..6
    and retraces the loss each later checkpoint's ``trainer_state.json`` logged for them; a factory that
    feeds the run's batches from the first again fails ``trajectory`` at its largest deviation."""
    hot, factories = _scanned_hf_run(hf_run, tmp_path, cli)

    code, report = _hf_drill(cli, hf_run, factories, "the_runs_inputs", step=2, steps=4)
    assert code == 0 and report["verdict"] == "passed", report["summary"]
    assert report["step"] == 2 and report["trained_steps"] == [3, 6]
    checks = _checks(report)
    assert checks["optimizer_continues"]["detail"] == "step counter 2 -> 6", checks
    trajectory = checks["trajectory"]
    assert trajectory["ok"] and trajectory["detail"].startswith("4 recorded losses of steps 3..6 retraced"), trajectory
    assert "checkpoint-4/trainer_state.json" in trajectory["detail"]  # the nearest later checkpoint first
    logged = _logged_losses(hot / hf_run.job / "checkpoint-6")
    # the run's random stream resumed from rng_state.pth: GPT-2's dropout masks are the run's, the losses its own
    assert report["losses"] == pytest.approx([logged[s] for s in range(3, 7)], rel=1e-5), (report["losses"], logged)

    code, wrong = _hf_drill(cli, hf_run, factories, "inputs_from_one", step=2, steps=4)
    assert code == 1 and wrong["verdict"] == "failed" and wrong["trained_steps"] == [3, 6]
    assert [c["name"] for c in wrong["checks"] if not c["ok"]] == ["trajectory"], wrong["checks"]
    deviation = {s: abs(mine - logged[s]) / logged[s] for s, mine in enumerate(wrong["losses"], start=3)}
    at = max(deviation, key=deviation.__getitem__)
    assert deviation[at] > 0.02
    assert _checks(wrong)["trajectory"]["detail"].startswith(
        f"the drill does not retrace the run: at step {at} the loss is {wrong['losses'][at - 3]:.6g}, "
        f"the run recorded {logged[at]:.6g} (relative {deviation[at]:.2g}, rtol 0.02; "), _checks(wrong)["trajectory"]


def test_hf_trainer_drill_compares_window_means_when_logging_steps_is_2(
    hf_window_run: CheckpointRun, tmp_path: Path, cli  # type: ignore[no-untyped-def]  # noqa: F811
) -> None:
    """``logging_steps=2``, saves every 3: each logged loss is the mean of 2 steps. The drill of checkpoint-3
    trains steps 4..8; the windows 5..6 and 7..8 are compared with the means of its own losses there, and
    3..4 (begun before the checkpoint) not at all."""
    hot, factories = _scanned_hf_run(hf_window_run, tmp_path, cli)
    logged = _logged_losses(hot / hf_window_run.job / "checkpoint-9")
    assert sorted(logged) == [2, 4, 6, 8]

    code, report = _hf_drill(cli, hf_window_run, factories, "the_runs_inputs", step=3, steps=5)
    assert code == 0 and report["verdict"] == "passed", report["summary"]
    assert report["trained_steps"] == [4, 8]
    trajectory = _checks(report)["trajectory"]
    assert trajectory["ok"] and trajectory["detail"].startswith("2 recorded losses of steps 4..8 retraced"), trajectory
    losses = dict(enumerate(report["losses"], start=4))
    means = {6: (losses[5] + losses[6]) / 2, 8: (losses[7] + losses[8]) / 2}
    worst = max(abs(means[s] - logged[s]) / logged[s] for s in means)
    assert f"largest deviation {worst:.2g};" in trajectory["detail"], (trajectory, worst)
    assert worst < 1e-5  # the run's own dropout masks (rng_state.pth): like with like, the same numbers
