"""A drill's inputs are judged in the parent, at once, without running the factory's code."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ckptier.storage.errors import ConfigError
from ckptier.tasks.config import DrillSettings
from ckptier.tasks.drill_inputs import (
    check_drill_inputs,
    cuda_problem,
    factory_problem,
    normalise_factory,
    top_level_names,
    torch_build,
)


@pytest.fixture()
def pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A package whose ``__init__`` must never run, with a models module."""
    root = tmp_path / "site"
    (root / "trainer").mkdir(parents=True)
    (root / "trainer" / "__init__.py").write_text("raise RuntimeError('the package __init__ ran')\n")
    (root / "trainer" / "models.py").write_text(textwrap.dedent("""
        import torch  # never imported by the check
        from .nets import Net as Alias
        try:
            from fast import build_fast
        except ImportError:
            def build_fast():
                return None
        def build():
            return None
        class Factory:
            pass
        made = lambda: None
        raise RuntimeError('the models module ran')
    """))
    (root / "trainer" / "dyn.py").write_text("def __getattr__(name):\n    return None\n")
    (root / "trainer" / "broken.py").write_text("def build(:\n")
    monkeypatch.syspath_prepend(str(root))
    return root


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("trainer.models:build", None),
        ("trainer.models:Factory", None),
        ("trainer.models:Alias", None),
        ("trainer.models:build_fast", None),
        ("trainer.models:made", None),
        ("trainer.dyn:anything", None),  # a module __getattr__: only the worker can tell
        ("trainer.models:buidl", "defines no 'buidl'; did you mean 'build'?"),
        ("trainer.models:zzz", "defines no 'zzz' (it defines build_fast, build, Factory)"),
        ("trainer.nomodule:build", "no module named 'trainer.nomodule' in package trainer"),
        ("notrainer.models:build", "no module named 'notrainer' in the Python path"),
        ("trainer.broken:build", "has a syntax error at line 1"),
        ("trainer.models.deeper:build", "'trainer.models' is a module, not a package"),
        ("math:sqrt", None),  # built in: no source to read, accepted
        ("json:loads", None),
        ("build", "is not of the form module:function"),
        ("trainer.models:", "is not of the form module:function"),
    ],
)
def test_factory_problem(pkg: Path, spec: str, problem: str | None) -> None:
    got = factory_problem(spec)
    if problem is None:
        assert got is None
    else:
        assert got is not None and problem in got and "\n" not in got
    assert "trainer" not in sys.modules and "trainer.models" not in sys.modules  # nothing was imported


def test_file_factories_are_read_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    models = tmp_path / "models.py"
    models.write_text("def build():\n    pass\nraise SystemExit('ran')\n")
    assert factory_problem(f"{models}:build") is None
    assert "defines no 'nope'" in (factory_problem(f"{models}:nope") or "")
    assert "does not exist" in (factory_problem(f"{tmp_path / 'other.py'}:build") or "")
    (tmp_path / "dir.py").mkdir()
    assert "is not a file" in (factory_problem(f"{tmp_path / 'dir.py'}:build") or "")
    monkeypatch.chdir(tmp_path)
    assert normalise_factory("models.py:build") == f"{models}:build"  # the worker runs in its scratch dir
    assert factory_problem("models.py:build") is None
    assert normalise_factory("pkg.models:build") == "pkg.models:build"


def test_top_level_names_cover_what_an_import_binds() -> None:
    tree = ast.parse(textwrap.dedent("""
        import os.path
        import numpy as np
        from a import b, c as d
        x = y = 1
        (p, [q, *r]) = 1, [2, 3]
        z: int = 3
        if True:
            def f(): pass
        with open('x') as fh:
            class C: pass
        for i in range(3):
            pass
    """))
    names, dynamic = top_level_names(tree)
    assert set(names) == {"os", "np", "b", "d", "x", "y", "p", "q", "r", "z", "f", "C", "i"} and not dynamic
    assert top_level_names(ast.parse("from m import *"))[1]


def test_cuda_is_judged_without_importing_torch() -> None:
    code = ("import sys; from ckptier.tasks.drill_inputs import cuda_problem, torch_build; "
            "p = cuda_problem(); print(repr(p)); print(torch_build()); assert 'torch' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    fresh = proc.stdout.splitlines()[0]  # judged in a process that never imported torch
    build = torch_build()
    assert build is not None and build[0].split("+")[0].count(".") == 2
    if build[1] is None and build[2] is None:  # this machine's torch is a CPU build: cuda can never work
        assert "CPU-only build" in fresh
        assert cuda_problem() is not None  # here torch may be imported already: then torch itself says
    elif "torch" not in sys.modules:
        assert "hides every GPU" in (cuda_problem({"CUDA_VISIBLE_DEVICES": ""}) or "")


def test_check_drill_inputs_explicit_values_win_over_the_drill_table(pkg: Path) -> None:
    table = DrillSettings(jobs="llama-*", model="trainer.models:buidl", steps=10, device="cpu")
    with pytest.raises(ConfigError, match=r"\[\[drill\]\] model \(jobs = 'llama-\*'\) 'trainer.models:buidl'"):
        check_drill_inputs(table)
    check_drill_inputs(table, model="trainer.models:build")  # --model replaces the table's
    for kwargs, needle in (({"steps": 0}, "--steps 0"), ({"steps": -1}, "--steps -1"),
                           ({"timeout": 0.0}, "timeout 0 s"), ({"model": "x"}, "--model 'x'")):
        with pytest.raises(ConfigError, match=needle):
            check_drill_inputs(**kwargs)  # type: ignore[arg-type]
    if cuda_problem() is not None:
        with pytest.raises(ConfigError, match=r"\[\[drill\]\] device cuda"):
            check_drill_inputs(DrillSettings(device="cuda"))
        with pytest.raises(ConfigError, match="--device cuda"):
            check_drill_inputs(DrillSettings(device="cpu"), device="cuda")
