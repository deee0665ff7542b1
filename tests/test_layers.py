"""The import layers of pyproject.toml's ``[tool.importlinter]`` hold.

storage < formats < tasks < deployments | dashboard < flows: a module imports
only from layers below its own, storage and formats never import Prefect.
Runs import-linter over ``build/package-view`` (``.ci/package-view``), where
every ``ckptier.*`` module resolves to this checkout's files.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_are_kept() -> None:
    view = subprocess.run([sys.executable, str(ROOT / ".ci" / "package-view")], check=True,
                          capture_output=True, text=True).stdout.strip()
    lint_imports = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    result = subprocess.run([lint_imports, "--no-cache", str(ROOT / "pyproject.toml")], cwd=view,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout
