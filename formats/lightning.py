"""``lightning``: PyTorch Lightning ``.ckpt`` files.

``{dir}/*.ckpt`` whose name holds ``step=S`` (``epoch=E-step=S``,
``model-epoch=E-step=S-v1``, ``global_step=S``...); also a DeepSpeed-style
directory of that name. ``last.ckpt`` and ``last-*.ckpt`` are aliases of
the newest checkpoint and are skipped quietly (neither checkpoints nor
unrecognised). Lightning does not write atomically, so a checkpoint is
committed once it is non-empty and its newest file is at least
``lightning_settle_seconds`` (default 60 s) old. The job is the directory.
The ``metric=value`` parts of the name (``epoch=2-step=300-val_loss=0.2300``,
as ``ModelCheckpoint(filename="{epoch}-{step}-{val_loss:.4f}")`` writes it) are
the checkpoint's metrics; the pickle is never opened for them
(:mod:`ckptier.formats.metrics` says why).

A drill loads the one ``.ckpt`` with the safe torch loader (``state_dict``
and at most one of ``optimizer_states``); the LightningModule's code is
needed, so a factory is always needed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptier.formats.base import FormatPlugin, Group, Scan
from ckptier.formats.metrics import metrics_in_name
from ckptier.storage.records import Format

if TYPE_CHECKING:
    from ckptier.formats.safe_load import LoadedCheckpoint

__all__ = ["PLUGIN"]

_LIGHTNING_STEP = re.compile(r"(?:^|[^0-9A-Za-z])step=([^-_.=]*)")


class LightningFormat(FormatPlugin):
    format = Format.LIGHTNING
    anchor_suffixes = (".ckpt",)
    why_factory = "a Lightning .ckpt holds tensors only and the LightningModule's code is needed"

    def anchor(self, key: str, slash: int, up: int) -> str | None:
        at = key.find(".ckpt/")
        if at >= 0:
            return key[: at + 5]
        if key.endswith(".ckpt"):
            return key
        return None

    def recognise(self, group: Group, scan: Scan) -> None:
        """One ``*.ckpt`` (a file, or a directory when ``group.single`` is False)."""
        prefix, files, single = group.prefix, group.files, group.single
        name = prefix[prefix.rfind("/") + 1 :]
        stem = name[: -len(".ckpt")]
        if stem == "last" or stem.startswith("last-"):
            return  # an alias of the newest checkpoint, never a step of its own
        values = set(_LIGHTNING_STEP.findall(stem))
        if not values:
            for f in files:
                scan.unclaimed(f)
            return
        if len(values) != 1 or not all(v.isascii() and v.isdigit() for v in values):
            scan.refuse(
                prefix if single else prefix + "/",
                f"{name!r}: step {', '.join(sorted(values))!r} is not a step number; expected step=<digits>",
            )
            return
        committed, reason = scan.settled(files, scan.lightning_settle, "Lightning checkpoints")
        scan.emit(
            job=scan.job_of(prefix), step=int(values.pop()), fmt=Format.LIGHTNING, prefix=prefix, files=files,
            committed=committed, reason=reason, single=single, metrics=metrics_in_name(name),
        )

    def load(self, path: Path, allow: Sequence[Any]) -> LoadedCheckpoint:
        return _load_lightning(path, allow)


PLUGIN = LightningFormat()


def _load_lightning(path: Path, allow: Sequence[Any]) -> LoadedCheckpoint:
    from ckptier.formats.safe_load import CheckpointLoadError, LoadedCheckpoint, safe_torch_load, step_from_name  # lazy: torch, for drills only

    if path.is_dir():
        files = sorted(path.glob("*.ckpt"))
        if len(files) != 1:
            raise CheckpointLoadError(f"{path}: expected one .ckpt file, found {len(files)}; pass the .ckpt file itself")
        path = files[0]
    obj = safe_torch_load(path, extra_allowlist=allow)
    if not isinstance(obj, Mapping) or not isinstance(obj.get("state_dict"), Mapping):
        raise CheckpointLoadError(f"{path}: no 'state_dict' entry; not a Lightning checkpoint")
    states = obj.get("optimizer_states") or []
    if len(states) > 1:
        raise CheckpointLoadError(f"{path}: not supported yet: {len(states)} optimizers; drills restore one optimizer")
    extra = {k: v for k, v in obj.items() if isinstance(v, (int, float, str, bool)) or k == "hyper_parameters"}
    step = obj.get("global_step") if isinstance(obj.get("global_step"), int) else step_from_name(path)
    return LoadedCheckpoint(dict(obj["state_dict"]), states[0] if states else None, extra, "torch", step, None)
