"""ckptier: keep training checkpoints safe and cheap.

The names a training script writes are exported here and kept across
internal moves: :func:`resume` and :func:`resume_distributed` (the newest
checkpoint proven now, and where to load it from), their answer
:class:`Resume` and their error :class:`ResumeError`. They are loaded on
first use, so ``import ckptier`` costs nothing and imports neither torch
nor Prefect.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["Resume", "ResumeError", "__version__", "resume", "resume_distributed"]

if TYPE_CHECKING:
    from ckptier.launch import resume, resume_distributed
    from ckptier.tasks.resume import Resume, ResumeError

#: Public name -> the module that holds it.
_EXPORTS = {
    "resume": "ckptier.launch",
    "resume_distributed": "ckptier.launch",
    "Resume": "ckptier.tasks.resume",
    "ResumeError": "ckptier.tasks.resume",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptier' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
