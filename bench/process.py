"""What timing ``ckptier`` as a process needs: the executable, and its modules byte-compiled.

An installed ckptier starts from byte-compiled modules (``pip install``
compiles them); a checkout run with ``PYTHONDONTWRITEBYTECODE`` set, or whose
sources changed since they were last compiled, would compile every changed
module on every start (~60 ms for the ~40 modules ``ckptier latest`` loads) and
time the compiler instead of the command. :func:`byte_compiled` compiles them
once, the way an install does, before anything is timed.
"""

from __future__ import annotations

import compileall
import importlib.util
import shutil
import sys
from pathlib import Path

#: ckptier's packages: each maps to a folder of the checkout (``[tool.setuptools] package-dir``).
PACKAGES = ("ckptier", "ckptier.storage", "ckptier.formats", "ckptier.tasks", "ckptier.flows",
            "ckptier.dashboard", "ckptier.deployments")


def executable() -> str | None:
    """The ``ckptier`` of this interpreter's environment (not a wrapper on ``PATH``, such as a
    version manager's shim, which adds its own start-up to every run); else the one on ``PATH``."""
    script = Path(sys.executable).parent / "ckptier"
    return str(script) if script.exists() else shutil.which("ckptier")


def byte_compiled() -> int:
    """Byte-compile the modules of every ckptier package (where they are stale or missing);
    the number of folders compiled. The folders are those the import system finds now."""
    folders: set[str] = set()
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None:
            folders.update(spec.submodule_search_locations or ())
    for folder in sorted(folders):
        compileall.compile_dir(folder, quiet=1)
    return len(folders)
