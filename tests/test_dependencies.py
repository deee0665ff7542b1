"""Declared dependencies match what the package imports.

Every third-party module the package's own files import (``import x`` or
``from x import y``, at any depth, guarded or not; tests excluded) must come
from a distribution that ``pyproject.toml`` declares: in ``dependencies``,
or in an extra other than ``test`` for an optional feature (the import is
then guarded and its error names the extra). And every entry of
``dependencies`` must be imported somewhere, so that nothing is installed
for nothing. Pure: reads the source and the installed distributions'
metadata, imports nothing of the package.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections.abc import Iterator
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: Extras that exist for running the tests, not for a feature of the package.
TEST_EXTRAS = {"test"}


def canonical(name: str) -> str:
    """A distribution name as PEP 503 normalises it (``PyYAML`` -> ``pyyaml``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    """The distribution a requirement names (``boto3[crt]>=1.36`` -> ``boto3``)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
    assert match is not None, f"pyproject requirement {spec!r} has no distribution name"
    return canonical(match.group(1))


def package_dirs() -> list[Path]:
    """The source folders of the installed package (setuptools' ``package-dir``)."""
    dirs = PYPROJECT["tool"]["setuptools"]["package-dir"]
    return sorted({ROOT / d for d in dirs.values()})


def top_level_imports(path: Path) -> Iterator[tuple[str, int]]:
    """``(top-level module, line)`` of every absolute import in the file at ``path``."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.partition(".")[0], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.partition(".")[0], node.lineno


def third_party_imports() -> dict[str, list[str]]:
    """Third-party top-level module -> the places (``file:line``) that import it."""
    found: dict[str, list[str]] = {}
    for folder in package_dirs():
        for path in sorted(folder.rglob("*.py")):
            for module, line in top_level_imports(path):
                if module in sys.stdlib_module_names or module in ("ckptier", "__future__"):
                    continue
                found.setdefault(module, []).append(f"{path.relative_to(ROOT)}:{line}")
    return found


def test_the_scan_sees_the_imports_it_must_judge() -> None:
    """Guard: the walk finds the package's files and their third-party imports."""
    found = third_party_imports()
    assert {"sqlalchemy", "boto3", "torch", "prefect", "yaml"} <= set(found)
    assert any(p.startswith("deployments/serve.py:") for p in found["yaml"])
    assert "os" not in found and "ckptier" not in found


def test_every_third_party_import_is_declared() -> None:
    declared = {requirement_name(r) for r in PYPROJECT["project"]["dependencies"]}
    for extra, reqs in PYPROJECT["project"].get("optional-dependencies", {}).items():
        if extra not in TEST_EXTRAS:
            declared |= {requirement_name(r) for r in reqs}
    providers = packages_distributions()
    problems = []
    for module, places in sorted(third_party_imports().items()):
        dists = {canonical(d) for d in providers.get(module, ())}
        if not dists:
            problems.append(f"{module} (imported at {places[0]}): no installed distribution provides it; "
                            "install it, then declare it in pyproject.toml")
        elif not dists & declared:
            problems.append(f"{module} (imported at {', '.join(places[:3])}): distribution "
                            f"{' or '.join(sorted(dists))} is not in pyproject's dependencies or a feature extra")
    assert not problems, "undeclared imports:\n" + "\n".join(problems)


def test_every_dependency_is_imported() -> None:
    providers = packages_distributions()
    imported = {canonical(d) for module in third_party_imports() for d in providers.get(module, ())}
    unused = sorted(r for r in PYPROJECT["project"]["dependencies"] if requirement_name(r) not in imported)
    assert not unused, f"declared in pyproject's dependencies but never imported by the package: {unused}"
