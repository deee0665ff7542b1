"""Drills train the catalog's steps and retrace the run's own losses.

FSDP2 DCP checkpoints of 2 and 4 ranks saved at step 9 as torchtitan saves
them (no ``metadata.json``, so nothing in the files names the step; the
4-rank one with ``dcp.async_save``), next to the run's ``losses.jsonl``:
the drill must train steps 10..12 on every rank (it used to train 1..3),
say so (``trained_steps``), and its ``trajectory`` check must pass against
the logged losses, while a factory whose batches are off by the step fails
it. A save killed before its ``.metadata`` was written is never drilled.

Slow: each drill starts one Python process per rank.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest

from tests.fixtures.dist_checkpoints import DIST_TIMEOUT_S, TITAN_LAST, TITAN_STEP, DistRuns

pytestmark = [pytest.mark.slow, pytest.mark.timeout(DIST_TIMEOUT_S)]  # the runs may be written twice

REPO = Path(__file__).resolve().parents[1]
FACTORY = "tests.fixtures.checkpoints:tiny_mlp_drill_spec"

def batches_from_one(module: str, spec: str, batch: str) -> str:
    """The source of a factory ``batches_from_one`` that builds ``module.spec`` and trains
    on the run's batches 1, 2, 3... (``module.batch``) whatever the step: what every drill
    of a DCP save did before the catalog's step reached the ranks."""
    return textwrap.dedent(
        f'''
        from {module} import {batch}, {spec}


        def batches_from_one(metadata):
            """Trains on the run's batches 1, 2, 3... whatever the step."""
            spec = {spec}(metadata)
            start = metadata["step"]
            spec.batch = lambda step, device: {batch}(step - start, device)
            return spec
        '''
    )


OFF_BY_THE_STEP = batches_from_one("tests.fixtures.checkpoints", "tiny_mlp_drill_spec", "tiny_batch")


@pytest.fixture()
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):  # type: ignore[no-untyped-def]
    from ckptier.flows.cli import main

    monkeypatch.setenv("CKPTIER_CATALOG_URL", f"sqlite:///{tmp_path / 'catalog.db'}")
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the ranks import the factories from tests/
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.chdir(tmp_path)

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def _check(report: dict, name: str) -> dict:  # type: ignore[type-arg]
    return next(c for c in report["checks"] if c["name"] == name)


@pytest.mark.parametrize("world", [2, 4])
def test_a_dcp_save_without_metadata_trains_the_steps_after_its_own_on_every_rank(
    dist_runs: DistRuns, tmp_path: Path, cli, world: int  # type: ignore[no-untyped-def]
) -> None:
    hot = tmp_path / "hot"
    shutil.copytree(dist_runs.root / f"fsdp{world}" / "titan", hot / "titan")
    assert not (hot / "titan" / f"step-{TITAN_STEP}" / "metadata.json").exists()  # the step is the catalog's alone
    assert cli("scan", str(hot))[0] == 0 and cli("verify")[0] == 0
    steps = TITAN_LAST - TITAN_STEP
    code, out, err = cli("drill", "--job", "titan", "--device", "cpu", "--steps", str(steps), "--model", FACTORY,
                         "--json", "--no-prefect")
    (report,) = json.loads(out)
    assert code == 0 and report["verdict"] == "passed", (report["summary"], err)
    assert report["trained_steps"] == [TITAN_STEP + 1, TITAN_LAST] and report["world_size"] == world
    trajectory = _check(report, "trajectory")
    assert trajectory["ok"] and trajectory["detail"].startswith(f"{steps} recorded losses of steps 10..12 retraced"), trajectory
    assert "losses.jsonl" in trajectory["detail"]
    rows = [json.loads(line) for line in (hot / "titan" / "losses.jsonl").read_text().splitlines()]
    logged = [r["loss"] for r in rows if TITAN_STEP < r["step"] <= TITAN_LAST]
    assert report["losses"] == pytest.approx(logged, rel=1e-5)  # the run's own losses, retraced
    assert report["stack"]["torch"] and "python" in report["stack"]

    factories = tmp_path / "off_by_the_step.py"
    factories.write_text(OFF_BY_THE_STEP)
    code, out, _ = cli("drill", "--job", "titan", "--device", "cpu", "--steps", str(steps), "--model",
                       f"{factories}:batches_from_one", "--json", "--no-prefect")
    (wrong,) = json.loads(out)
    assert code == 1 and wrong["verdict"] == "failed" and wrong["trained_steps"] == [10, 12]
    failed = [c["name"] for c in wrong["checks"] if not c["ok"]]
    assert failed == ["trajectory"], wrong["checks"]
    detail = _check(wrong, "trajectory")["detail"]
    assert detail.startswith("the drill does not retrace the run: at step ") and "the run recorded" in detail, detail


def test_a_dcp_save_killed_before_its_metadata_is_in_flight_and_never_drilled(
    dist_runs: DistRuns, tmp_path: Path, cli  # type: ignore[no-untyped-def]
) -> None:
    hot = tmp_path / "hot" / "titan"
    shutil.copytree(dist_runs.root / "fsdp2" / "titan", hot)
    (hot / f"step-{TITAN_STEP}" / ".metadata").unlink()  # DCP writes .metadata last: killed before it
    assert cli("scan", str(tmp_path / "hot"))[0] == 0
    code, out, err = cli("drill", "--job", "titan", "--step", str(TITAN_STEP), "--model", FACTORY, "--no-prefect")
    assert code == 2 and "is incomplete (a save in flight, or torn)" in err, (out, err)
