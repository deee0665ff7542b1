"""Deprecated: the old name of :mod:`ckptier.tasks.drill_models`.

A model factory written with ``from ckptier.tasks.models import DrillSpec``
keeps working for one release: every name read from this module is the very
object ``ckptier`` exports, and each read emits a :class:`DeprecationWarning`
naming the import to write instead (``from ckptier import DrillSpec``).
Nothing is imported until a name is read.
"""

from __future__ import annotations

import warnings
from typing import Any

#: The names this module used to hold; all are exported by ``ckptier`` now.
_MOVED = ("DrillSpec", "demo_batch", "demo_loss", "demo_model", "hf_spec", "train_step", "trainer_optimizer")

__all__ = list(_MOVED)


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module 'ckptier.tasks.models' has no attribute {name!r}: it is deprecated; "
                             f"import from 'ckptier' (see ckptier.__all__)")
    warnings.warn(f"ckptier.tasks.models is deprecated and will be removed in the next release: "
                  f"write 'from ckptier import {name}'", DeprecationWarning, stacklevel=2)
    from ckptier.tasks import drill_models

    return getattr(drill_models, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MOVED))
