"""The examples a launcher copies run: the SLURM ``--requeue`` snippet against a real catalog and
the Hugging Face Trainer line on a tiny model (the torchrun one: tests/test_resume.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckptier.flows.cli import main
from ckptier.tasks.demo import train_demo_run

ROOT = Path(__file__).resolve().parents[1]
SLURM = ROOT / "examples" / "slurm_requeue.sh"
HF = ROOT / "examples" / "hf_trainer_resume.py"
JOB = "demo-run"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    hot = tmp_path_factory.mktemp("examples-trained") / "hot"
    train_demo_run(hot, steps=50, every=25, leave_last_in_flight=False)
    return hot


@pytest.fixture()
def catalog(trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
            capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """The run scanned and verified into a temporary catalog; the environment a batch script sees."""
    hot = tmp_path / "hot"
    shutil.copytree(trained, hot)
    config = tmp_path / "ckptier.toml"
    config.write_text('[[policy]]\njobs = "*"\nkeep_last = 2\n')
    env = {"CKPTIER_CATALOG_URL": f"sqlite:///{tmp_path / 'catalog.db'}", "CKPTIER_CONFIG": str(config),
           "PREFECT_HOME": str(tmp_path / "prefect-home")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert main(["scan", str(hot)]) == 0 and main(["verify"]) == 0
    capsys.readouterr()
    ckptier = Path(sys.executable).parent / "ckptier"
    command = str(ckptier) if ckptier.exists() else f"{sys.executable} -c 'import sys; from ckptier.flows.cli import main; sys.exit(main())'"
    return {**{k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}, **env,
            "CKPTIER": command, "CKPTIER_PYTHON": sys.executable, "CKPTIER_RESUME_DEST": str(tmp_path / "dest"),
            "hot": str(hot)}


def _source(env: dict[str, str], then: str = 'echo "path=$CKPTIER_RESUME_PATH step=$CKPTIER_RESUME_STEP"'
            ) -> subprocess.CompletedProcess[str]:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    return subprocess.run([bash, "-c", f'set -e; source "{SLURM}"; {then}'], capture_output=True, text=True,
                          env={k: v for k, v in env.items() if k != "hot"}, timeout=120)


def test_the_slurm_snippet_exports_the_newest_proven_checkpoint(catalog: dict[str, str]) -> None:
    proc = _source({**catalog, "CKPTIER_JOB": JOB, "SLURM_RESTART_COUNT": "1"},
                   then='echo "path=$CKPTIER_RESUME_PATH step=$CKPTIER_RESUME_STEP"; '
                        'bash -c \'echo "child=$CKPTIER_RESUME_PATH"\'')
    assert proc.returncode == 0, proc.stderr
    expected = Path(catalog["hot"]) / JOB / "step-00000050"
    assert proc.stdout.splitlines() == [f"path={expected} step=50", f"child={expected}"]  # exported to srun's tasks
    assert f"{JOB} resumes from step 50" in proc.stderr and "(restart 1)" in proc.stderr


def test_the_slurm_snippet_passes_over_a_torn_checkpoint(catalog: dict[str, str]) -> None:
    torn = next((Path(catalog["hot"]) / JOB / "step-00000050").rglob("model.pt"))
    torn.write_bytes(torn.read_bytes()[:-7])
    proc = _source({**catalog, "CKPTIER_JOB": JOB})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"path={Path(catalog['hot']) / JOB / 'step-00000025'} step=25"


def test_the_slurm_snippet_starts_from_scratch_when_nothing_is_proven(catalog: dict[str, str]) -> None:
    proc = _source({**catalog, "CKPTIER_JOB": "never-trained", "CKPTIER_RESUME_PATH": "/stale"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "path= step=" and "starting from scratch" in proc.stderr


def test_the_slurm_snippet_stops_the_script_on_an_error(catalog: dict[str, str], tmp_path: Path) -> None:
    proc = _source({**catalog, "CKPTIER_JOB": JOB, "CKPTIER_CATALOG_URL": f"sqlite:///{tmp_path / 'none' / 'x.db'}"},
                   then="echo trained")
    assert proc.returncode >= 2 and "trained" not in proc.stdout and "not starting" in proc.stderr
    proc = _source({k: v for k, v in catalog.items() if k not in ("CKPTIER_JOB", "SLURM_JOB_NAME")}, then="echo trained")
    assert proc.returncode == 2 and "set CKPTIER_JOB" in proc.stderr and "trained" not in proc.stdout


@pytest.mark.slow  # two short Trainer runs on CPU: ~10-30 s on 2 shared cores
def test_the_hf_trainer_example_resumes_from_the_proven_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers", reason="the Hugging Face example needs transformers: pip install 'ckptier[hf]'")
    root, config = tmp_path / "ckpt", tmp_path / "ckptier.toml"
    root.mkdir()
    config.write_text('[[policy]]\njobs = "*"\nkeep_last = 2\n')
    env = {**os.environ, "CKPTIER_CATALOG_URL": f"sqlite:///{tmp_path / 'catalog.db'}", "CKPTIER_CONFIG": str(config),
           "PREFECT_HOME": str(tmp_path / "prefect-home"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("PREFECT_API_URL", None)
    for k in ("CKPTIER_CATALOG_URL", "CKPTIER_CONFIG", "PREFECT_HOME"):
        monkeypatch.setenv(k, env[k])
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert main(["scan", str(root)]) == 0  # an empty catalog: the first launch finds nothing

    def launch(max_steps: int) -> dict[str, object]:
        proc = subprocess.run([sys.executable, str(HF), "--job", "hf-out", "--output-dir", str(root / "hf-out"),
                               "--max-steps", str(max_steps), "--save-steps", "2"],
                              capture_output=True, text=True, env=env, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    first = launch(2)
    assert first == {"resumed_from": None, "trained_steps": [1, 2], "global_step": 2}
    assert main(["scan", str(root)]) == 0 and main(["verify"]) == 0
    capsys.readouterr()
    second = launch(4)
    assert second["resumed_from"] == str(root / "hf-out" / "checkpoint-2")
    assert second["trained_steps"] == [3, 4] and second["global_step"] == 4  # resumed, not retrained
