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
    for contract in ("inside tasks: rules < kernel < operations < pipeline < prefect_tasks",
                     "no import cycles in any package"):
        assert f"{contract} KEPT" in result.stdout, result.stdout[-4000:]


def _contracts() -> list[dict[str, object]]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_every_tasks_module_has_its_layer() -> None:
    """A new module of tasks/ must be placed in a layer of the tasks contract; a module
    left out of every layer would be free to import anything."""
    (contract,) = [c for c in _contracts() if c.get("containers") == ["ckptier.tasks"]]
    layered = {name.strip() for layer in contract["layers"] for name in str(layer).split(":")}  # type: ignore[attr-defined]
    modules = {p.stem for p in (ROOT / "tasks").glob("*.py") if p.stem != "__init__"}
    assert modules - layered == set(), "place these tasks/ modules in a layer of pyproject.toml's tasks contract"
    assert layered - modules == set(), "these layered modules do not exist any more"


def test_the_cycle_check_covers_every_package() -> None:
    (contract,) = [c for c in _contracts() if c["type"] == "acyclic_siblings"]
    assert contract["ancestors"] == ["ckptier"] and "skip_descendants" not in contract and "ignore_imports" not in contract
    deepest = max(len(p.relative_to(ROOT / "storage").parts) for p in (ROOT / "storage").rglob("__init__.py"))
    assert int(contract.get("depth", 10)) > deepest  # type: ignore[call-overload]
