"""The README gets a newcomer started in one screen; the manual in docs/ cannot drift from the code.

- README.md stays short (≤150 lines), keeps the two set-up commands CI and
  users run verbatim, and every relative link in it points at a file;
- its "Your first real run" block runs as written on a fresh home (scan,
  verify, the five-line policy, plan, apply, latest) against a real run's
  checkpoints;
- docs/reference/commands.md is exactly what the parser generates, and
  names every command and option.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path


from ckptier.flows.arguments import subparsers
from ckptier.flows.cli import build_parser
from ckptier.flows.reference import PAGE, markdown
from tests.fixtures.checkpoints import CheckpointRun

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SETUP = "pip install torch==2.13.0 && pip install -e . && ckptier demo"
TEST_COMMAND = "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest -n 2 --dist loadfile"


def _block(text: str, heading: str) -> str:
    """The first fenced block after ``heading``."""
    after = text.split(heading, 1)[1]
    return after.split("```sh\n", 1)[1].split("\n```", 1)[0]


def test_readme_is_one_screen_and_keeps_the_set_up_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 150, len(text.splitlines())
    lines = text.splitlines()
    assert SETUP in lines and TEST_COMMAND in lines
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text()  # CI runs the README's command


def test_readme_links_point_at_files() -> None:
    text = README.read_text()
    targets = re.findall(r"\]\((?!https?://)([^)#]+)(?:#[^)]*)?\)", text)
    assert len(targets) > 10, targets
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, missing


def test_readme_command_table_names_every_command() -> None:
    text = README.read_text()
    table = text.split("## Commands", 1)[1].split("\n## ", 1)[0]
    absent = [name for name in subparsers(build_parser()) if not re.search(rf"\b{re.escape(name)}\b", table)]
    assert not absent, absent


def test_command_reference_is_generated_from_the_parser() -> None:
    parser = build_parser()
    page = (ROOT / "docs" / PAGE).read_text()
    assert page == markdown(parser), "stale: python -m ckptier.flows.reference > docs/reference/commands.md"
    for name, sp in subparsers(parser).items():
        assert f"\n## {name}\n" in page, name
        section = page.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
        for action in sp._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert option in section, (name, option)


def test_command_reference_fails_when_an_option_is_added() -> None:
    parser = build_parser()
    before = markdown(parser)
    subparsers(parser)["ls"].add_argument("--brand-new-option", help="added after the page was made")
    after = markdown(parser)
    assert before != after and "--brand-new-option" in after.split("\n## ls\n", 1)[1].split("\n## ", 1)[0]


def test_first_real_run_works_as_written(guide_run: CheckpointRun, tmp_path: Path) -> None:
    data, archive, home = tmp_path / "data" / "checkpoints", tmp_path / "archive" / "checkpoints", tmp_path / "home"
    job_dir = guide_run.root / guide_run.job
    shutil.copytree(job_dir if job_dir.is_dir() else guide_run.root, data / "llama-7b", symlinks=True)
    home.mkdir()
    script = (_block(README.read_text(), "## Your first real run")
              .replace("/data/checkpoints", str(data)).replace("/archive/checkpoints", str(archive)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPTIER_", "PREFECT_API"))}
    env |= {"HOME": str(home), "XDG_DATA_HOME": str(home / ".local" / "share"),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"}
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (home / ".local" / "share" / "ckptier" / "catalog.db").is_file()  # the default catalog the README names
    newest = max(guide_run.steps)
    assert f"step {newest}" in run.stdout or f"step-{newest:08d}" in run.stdout, run.stdout
    assert any(archive.rglob("ckptier-manifest.json")), "apply promoted no milestone into the archive"
