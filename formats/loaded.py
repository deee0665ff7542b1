"""What loading a checkpoint for a drill yields and how it fails: torch-free.

:class:`LoadedCheckpoint` (what a format's loader returns), the two ways a
load fails (:class:`UnsafeCheckpoint`, :class:`CheckpointLoadError` and
:class:`UnsupportedCheckpoint`) and the
small readers every loader shares. The loaders themselves are in
:mod:`ckptier.formats.safe_load` (which imports torch); the format plug-ins'
base class (:mod:`ckptier.formats.base`) names these without loading torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptier.storage.errors import CkptierError

if TYPE_CHECKING:
    import torch


class UnsafeCheckpoint(CkptierError):
    """A checkpoint needs something the safe loader will not do.

    ``global_name`` is the ``module.Name`` the unpickler refused, when known.
    """

    def __init__(self, message: str, *, global_name: str | None = None) -> None:
        super().__init__(message)
        self.global_name = global_name


class CheckpointLoadError(CkptierError):
    """A checkpoint's files are missing, malformed or in a layout not supported."""


class UnsupportedCheckpoint(CheckpointLoadError):
    """A checkpoint in a variant the drill cannot restore yet (model-parallel
    ranks, ZeRO stage 3 with frozen parameters...): nothing is known to be
    wrong with it, so a drill that meets one is ``not judged``, never ``failed``."""


@dataclass
class LoadedCheckpoint:
    """What a drill restores from one checkpoint, on CPU.

    ``model_state`` maps parameter/buffer names to tensors. ``optimizer_state``
    is ``None`` when the checkpoint has none; its layout is
    ``optimizer_layout``: ``"torch"`` (``Optimizer.state_dict()``, integer
    param ids) or ``"fqn-flat"`` (DCP/torchtitan: flattened keys
    ``state.<param fqn>.<name>``, tensors only). ``extra`` is the parsed
    metadata of the format (metadata.json, trainer_state.json, Lightning's
    top-level scalars and hyper_parameters); ``step`` and ``recorded_loss`` are
    taken from it when present. ``also_loaded`` lists side files that were
    safely loaded to prove they restore (scheduler, RNG states).
    ``rng_state``: the run's random-number states at the save, where the
    format keeps them for one process (Hugging Face Trainer's
    ``rng_state.pth``: ``python``, ``numpy``, ``cpu``...; a legacy Megatron
    file's ``rng_state``, :func:`ckptier.formats.megatron.megatron_rng`), for the drill to
    continue the run's random stream (dropout masks); None elsewhere.
    ``optimizer_left``: optimizer state the checkpoint holds that this loader
    does not restore, and why (a Megatron ``torch_dist`` save's optimizer
    shards); the drill's optimizer then starts fresh, and the drill says so
    rather than blame the checkpoint for what a fresh optimizer changes.
    """

    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any] | None
    extra: dict[str, Any] = field(default_factory=dict)
    optimizer_layout: str = "torch"
    step: int | None = None
    recorded_loss: float | None = None
    also_loaded: list[str] = field(default_factory=list)
    rng_state: dict[str, Any] | None = None
    optimizer_left: str | None = None


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointLoadError(f"{path}: unreadable JSON ({exc}); re-fetch or re-verify the checkpoint") from None
    if not isinstance(data, dict):
        raise CheckpointLoadError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def step_from_name(path: Path) -> int | None:
    match = re.search(r"(?:step|checkpoint)[-=_]?(\d+)", path.name)
    return int(match.group(1)) if match else None


def float_or_none(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
