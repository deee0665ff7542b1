"""Check a drill's inputs in the parent process, before anything slow.

A restore drill fetches a checkpoint and starts a worker that imports torch
and the model factory: tens of seconds before a typo in ``--model`` or a
``--device cuda`` on a machine without a GPU would show. The checks here
answer in milliseconds and import neither torch nor the factory's module:

* the factory spec (``module:function`` or ``/path/file.py:function``): the
  module is located with the import system's finders (its parent packages
  are not imported) and its source is read with :mod:`ast`, never executed;
  a module whose names cannot be known statically (a compiled extension, a
  module ``__getattr__``, ``from x import *``) is accepted and left to the
  worker;
* ``--device cuda``: torch's own ``version.py`` says whether the installed
  build has CUDA (or ROCm), and the kernel whether a GPU driver is loaded;
* ``--steps`` and ``--timeout`` must be positive;
* a GPU where one is expected (:func:`decide_device`): on ckptier's GPU
  work pool, or under ``[[drill]] require_gpu = true``, a drill on device
  ``auto`` with no GPU visible fails instead of quietly running on CPU.

Every problem is a one-line :class:`ConfigError` naming the value and the fix.
"""

from __future__ import annotations

import ast
import difflib
import importlib.machinery
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptier.storage.errors import ConfigError

from .config import DrillSettings, parse_factory_spec

#: Names a factory module lists in an error (the first few it defines).
_NAMES_SHOWN = 6

#: Set (to the pool's name) in the flow-run processes of ckptier's GPU work pool: ``ckptier deploy``
#: puts it in the restore-drill deployment's job variables; a drill there expects a GPU.
GPU_POOL_ENV = "CKPTIER_GPU_POOL"


@dataclass(frozen=True)
class DeviceChoice:
    """Where a drill runs: ``device`` (``auto``, ``cpu``, ``cuda``) and ``fallback``, the
    sentence the report and its summary carry when a GPU was expected but the drill
    runs on CPU (None otherwise)."""

    device: str
    fallback: str | None = None


def _visible(environ: Mapping[str, str]) -> str:
    value = environ.get("CUDA_VISIBLE_DEVICES")
    return "CUDA_VISIBLE_DEVICES unset" if value is None else f"CUDA_VISIBLE_DEVICES={value!r}"


def decide_device(device: str, *, require_gpu: bool | None, gpu_pool: str | None, gpus: int,
                  environ: Mapping[str, str]) -> DeviceChoice:
    """Where a drill asked for ``device`` runs, given the ``[[drill]] require_gpu`` of its job,
    the GPU work pool it runs on (``gpu_pool``, None: none) and the ``gpus`` visible to it; pure.

    ``cpu`` always runs on CPU (the operator asked for it). With a GPU visible, ``auto``
    and ``cuda`` run as asked. With none: ``cuda`` fails; ``auto`` fails when a GPU is
    required (``require_gpu`` true, or None on a GPU pool), and otherwise runs on CPU:
    quietly when nothing expected a GPU (``require_gpu`` None off the GPU pool, a
    laptop), saying so loudly when ``require_gpu`` is false. Raises a one-line
    :class:`ConfigError` naming ``CUDA_VISIBLE_DEVICES`` and the switch."""
    if device == "cpu" or gpus > 0:
        return DeviceChoice(device)
    where = f"no GPU visible on this worker ({_visible(environ)})"
    if device != "auto":
        raise ConfigError(f"drill device {device!r}: {where}; use device auto or cpu, or run the drill where a GPU is")
    required = require_gpu if require_gpu is not None else gpu_pool is not None
    if required:
        why = "[[drill]] require_gpu = true" if require_gpu else f"drills on work pool {gpu_pool!r} need one"
        raise ConfigError(f"{where}, and {why}; set [[drill]] require_gpu = false to drill on CPU")
    if require_gpu is False:
        return DeviceChoice("cpu", f"FELL BACK TO CPU: {where}; [[drill]] require_gpu = false lets it drill on CPU")
    return DeviceChoice(device)


def check_drill_inputs(
    settings: DrillSettings | None = None,
    *,
    model: str | None = None,
    device: str | None = None,
    steps: int | None = None,
    timeout: float | None = None,
) -> None:
    """Raise :class:`ConfigError` for the first bad drill input, else return.

    The explicit arguments (the command line's, or a flow's parameters) win
    over ``settings`` (the job's ``[[drill]]`` table), as in the drill itself.
    """
    if steps is not None:
        check_steps(steps)
    if timeout is not None and not timeout > 0:
        raise ConfigError(f"drill timeout {timeout:g} s must be more than zero seconds, e.g. --timeout 900")
    spec = model or (settings.model if settings is not None and settings.model else None)
    if spec:
        origin = "--model" if model else f"[[drill]] model (jobs = {settings.jobs!r})" if settings else "--model"
        problem = factory_problem(spec)
        if problem is not None:
            raise ConfigError(f"{origin} {spec!r}: {problem}")
    dev = device if device not in (None, "auto") else (settings.device if settings is not None else device)
    if dev is not None and dev.startswith("cuda"):
        problem = cuda_problem()
        if problem is not None:
            origin = "--device" if device not in (None, "auto") else "[[drill]] device"
            raise ConfigError(f"{origin} {dev}: {problem}; use --device cpu or auto")


def check_steps(steps: int, name: str = "--steps") -> None:
    """Refuse a step count below 1 (``0`` used to mean "the default", silently)."""
    if steps < 1:
        raise ConfigError(f"{name} {steps}: a drill trains at least 1 step; give e.g. {name} 10")


def normalise_factory(spec: str, cwd: Path | None = None) -> str:
    """``spec`` with a relative ``file.py`` made absolute against ``cwd`` (the
    drill's worker runs in its scratch directory); module specs unchanged."""
    module, func = parse_factory_spec(spec)
    if not module.endswith(".py"):
        return spec
    path = Path(module).expanduser()
    if not path.is_absolute():
        path = (cwd or Path.cwd()) / path
    return f"{path}:{func}"


# ------------------------------------------------------------------ factory


def factory_problem(spec: str, *, path: Sequence[str] | None = None) -> str | None:
    """Why ``spec`` cannot name a model factory, or None when it may.

    ``path`` is the module search path (default ``sys.path``). Reads files,
    imports nothing beyond what is already imported.
    """
    try:
        module, func = parse_factory_spec(spec)
    except ConfigError:
        return "is not of the form module:function; give e.g. mypkg.models:build_model or /path/to/models.py:build_model"
    if module.endswith(".py"):
        file = Path(normalise_factory(spec).rpartition(":")[0])
        if not file.exists():
            return f"file {file} does not exist; fix the path"
        if not file.is_file():
            return f"{file} is not a file; give /path/to/models.py:function"
        return _source_problem(file, func, f"file {file}")
    found = find_module_source(module, path=path)
    if isinstance(found, str):
        return found
    if found is None:
        return None  # compiled or built in: the worker will tell
    return _source_problem(found, func, f"module {module} ({found})")


def find_module_source(name: str, *, path: Sequence[str] | None = None) -> Path | str | None:
    """The ``.py`` file that defines module ``name``, a one-line reason it
    cannot be found, or None when it exists without Python source.

    Parent packages are located, not imported: their ``__init__`` never runs.
    """
    spec: Any = None
    parts = name.split(".")
    for i in range(len(parts)):
        full = ".".join(parts[: i + 1])
        loaded = sys.modules.get(full)
        if loaded is not None and getattr(loaded, "__spec__", None) is not None:
            spec = loaded.__spec__
            continue
        if i == 0:
            spec = _find_spec(full, path)
        else:
            search = list(spec.submodule_search_locations or [])
            if not search:
                return f"{'.'.join(parts[:i])!r} is a module, not a package, so it has no {parts[i]!r}; check the name"
            spec = _find_spec(full, search)
        if spec is None:
            where = "the Python path (sys.path)" if i == 0 else f"package {'.'.join(parts[:i])}"
            return (f"no module named {full!r} in {where}; check the name, install the package that defines "
                    "the model, or give /path/to/models.py:function")
    origin = getattr(spec, "origin", None)
    if not origin or not str(origin).endswith(".py"):
        return None
    return Path(origin)


def _find_spec(fullname: str, search: Sequence[str] | None) -> Any:
    if search is not None and "." not in fullname:
        return importlib.machinery.PathFinder.find_spec(fullname, list(search))
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(fullname, list(search) if search is not None else None)
        except (ImportError, ValueError, AttributeError, TypeError):
            continue
        if spec is not None:
            return spec
    return None


def _source_problem(file: Path, func: str, what: str) -> str | None:
    try:
        tree = ast.parse(file.read_bytes(), filename=str(file))
    except OSError as exc:
        return f"{what} cannot be read ({exc.strerror or exc})"
    except (SyntaxError, ValueError) as exc:
        line = getattr(exc, "lineno", None)
        return f"{what} has a syntax error{f' at line {line}' if line else ''}; fix it"
    names, dynamic = top_level_names(tree)
    if func in names or dynamic:
        return None
    close = difflib.get_close_matches(func, [n for n in names if not n.startswith("_")], n=1)
    if close:
        return f"{what} defines no {func!r}; did you mean {close[0]!r}?"
    defined = [n for n, kind in names.items() if kind == "def" and not n.startswith("_")]
    shown = ", ".join(defined[:_NAMES_SHOWN]) + (", ..." if len(defined) > _NAMES_SHOWN else "")
    return f"{what} defines no {func!r}" + (f" (it defines {shown})" if shown else "") + "; fix the function name"


def top_level_names(tree: ast.Module) -> tuple[dict[str, str], bool]:
    """Names a module binds at import time (``def``, ``class``, assignments,
    imports; inside top-level ``if``/``try``/``with`` too) mapped to ``"def"``
    for functions and classes, ``"name"`` otherwise; and whether it may bind
    others dynamically (``from x import *``, a module ``__getattr__``)."""
    names: dict[str, str] = {}
    dynamic = False

    def bind(target: ast.AST) -> None:
        if isinstance(target, ast.Name):
            names.setdefault(target.id, "name")
        elif isinstance(target, (ast.Tuple, ast.List)):
            for elt in target.elts:
                bind(elt)
        elif isinstance(target, ast.Starred):
            bind(target.value)

    def visit(body: Sequence[ast.stmt]) -> None:
        nonlocal dynamic
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[node.name] = "def"
                dynamic |= node.name == "__getattr__"
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    bind(t)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                bind(node.target)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    names.setdefault(alias.asname or alias.name.split(".")[0], "name")
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name == "*":
                        dynamic = True
                    else:
                        names.setdefault(alias.asname or alias.name, "name")
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, (ast.Try, ast.TryStar)):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                visit(node.body)
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
                if isinstance(node, (ast.For, ast.AsyncFor)):
                    bind(node.target)
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.NamedExpr):
                bind(node.value.target)

    visit(tree.body)
    return names, dynamic


# ------------------------------------------------------------------ device


def cuda_problem(environ: dict[str, str] | None = None) -> str | None:
    """Why ``--device cuda`` cannot work here, or None when it may.

    Decided without importing torch (unless it is already imported): the
    installed torch's ``version.py`` says whether the build has CUDA or ROCm;
    ``CUDA_VISIBLE_DEVICES`` may hide every GPU; on Linux the kernel lists
    the NVIDIA driver's GPUs in ``/proc/driver/nvidia/gpus`` (ROCm exposes
    ``/dev/kfd``). When unsure, None: the worker decides.
    """
    env = os.environ if environ is None else environ
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            return None if torch.cuda.is_available() else "torch finds no CUDA GPU on this machine"
        except Exception:  # noqa: BLE001 - a broken CUDA setup: let the worker report it
            return None
    build = torch_build()
    if build is not None:
        version, cuda, hip = build
        if cuda is None and hip is None:
            return f"the installed torch {version} is a CPU-only build (no CUDA)"
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    if sys.platform == "darwin":
        return "macOS has no CUDA"
    if sys.platform.startswith("linux"):
        gpus = Path("/proc/driver/nvidia/gpus")
        nvidia = gpus.is_dir() and any(gpus.iterdir())
        rocm = build is not None and build[2] is not None and Path("/dev/kfd").exists()
        if not nvidia and not rocm:
            return "no GPU driver is loaded on this machine (/proc/driver/nvidia/gpus is absent)"
    return None


def torch_build() -> tuple[str, str | None, str | None] | None:
    """(version, cuda, hip) of the installed torch, read from ``torch/version.py``
    without importing torch; None when torch or that file cannot be found."""
    found = find_module_source("torch")
    if not isinstance(found, Path):
        return None
    try:
        tree = ast.parse((found.parent / "version.py").read_bytes())
    except (OSError, SyntaxError, ValueError):
        return None
    values: dict[str, Any] = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else (
            node.target if isinstance(node, ast.AnnAssign) else None)
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            values[target.id] = value.value
    if "__version__" not in values:
        return None
    return str(values["__version__"]), values.get("cuda"), values.get("hip")
