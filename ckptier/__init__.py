"""ckptier: keep training checkpoints safe and cheap.

The names a training script writes are exported here and kept across
internal moves: :func:`resume` and :func:`resume_distributed` (the newest
checkpoint proven now, and where to load it from), their answer
:class:`Resume` and their error :class:`ResumeError`; and what a drill's
model factory is written with: :class:`DrillSpec` and the helpers
:func:`demo_model`, :func:`demo_batch`, :func:`demo_loss`, :func:`hf_spec`,
:func:`trainer_optimizer` and :func:`train_step`. They are loaded on
first use, so ``import ckptier`` costs nothing and imports neither torch
nor Prefect.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "DrillSpec",
    "Resume",
    "ResumeError",
    "__version__",
    "demo_batch",
    "demo_loss",
    "demo_model",
    "hf_spec",
    "resume",
    "resume_distributed",
    "train_step",
    "trainer_optimizer",
]

if TYPE_CHECKING:
    from ckptier.launch import resume, resume_distributed
    from ckptier.tasks.drill_models import (
        DrillSpec,
        demo_batch,
        demo_loss,
        demo_model,
        hf_spec,
        train_step,
        trainer_optimizer,
    )
    from ckptier.tasks.resume import Resume, ResumeError

#: Public name -> the module that holds it.
_EXPORTS = {
    "resume": "ckptier.launch",
    "resume_distributed": "ckptier.launch",
    "Resume": "ckptier.tasks.resume",
    "ResumeError": "ckptier.tasks.resume",
    **dict.fromkeys(
        ("DrillSpec", "demo_batch", "demo_loss", "demo_model", "hf_spec", "train_step", "trainer_optimizer"),
        "ckptier.tasks.drill_models",
    ),
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
