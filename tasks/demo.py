"""The demo's training run: a small real model trained on CPU, checkpointed
in the storage guide's layout exactly as a training job would write it.

``{job}/step-{step:08d}/rank-0000/model.pt`` and ``optimizer.pt`` with
``torch.save``, then ``metadata.json`` last (the commit marker) listing every
file's size and sha256 and the training loss. The newest save can be left
without its ``metadata.json``, as if it were still being written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckptier.storage.hashing import hash_file

from .drill_models import demo_model, demo_train


@dataclass(frozen=True)
class DemoRun:
    """What :func:`train_demo_run` wrote."""

    job_dir: Path
    steps: tuple[int, ...]
    in_flight: int | None
    losses: Mapping[int, float]


def write_guide_checkpoint(
    step_dir: Path, files: Mapping[str, Any], *, step: int, loss: float | None, commit: bool = True,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Write ``files`` (relpath → object for ``torch.save``) under ``step_dir``,
    then, if ``commit``, ``metadata.json`` listing each file's size and sha256.

    Each file is fsynced before the metadata is written, so a present
    ``metadata.json`` means every listed file is complete.
    """
    step_dir.mkdir(parents=True, exist_ok=True)
    listed: dict[str, dict[str, Any]] = {}
    for rel, obj in files.items():
        path = step_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        digests = hash_file(path, sha256=True)
        listed[rel] = {"size": digests.size, "sha256": digests.sha256}
    if not commit:
        return
    meta = {"step": step, "files": listed, **({"loss": loss} if loss is not None else {}), **(extra or {})}
    tmp = step_dir / ".metadata.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True))
    os.replace(tmp, step_dir / "metadata.json")


def train_demo_run(
    hot: Path, *, job: str = "demo-run", steps: int = 300, every: int = 25, leave_last_in_flight: bool = True,
) -> DemoRun:
    """Train the demo model for ``steps`` steps on CPU, saving every ``every`` steps.

    The optimizer state is saved with the model, so a restore can continue
    training exactly. With ``leave_last_in_flight``, the newest save has no
    ``metadata.json`` yet (a save still in flight).
    """
    if steps < every:
        raise ValueError(f"demo steps {steps} must be at least the checkpoint interval {every}")
    spec = demo_model()
    job_dir = hot / job
    saved: list[int] = []
    losses: dict[int, float] = {}
    last = 0
    for step in range(every, steps + 1, every):
        step_losses = demo_train(spec, range(last + 1, step + 1))
        last = step
        # Like a training logger: the loss recorded is the mean of a window, not one noisy batch.
        window = step_losses[-10:]
        recorded = sum(window) / len(window)
        assert spec.optimizer is not None
        commit = not (leave_last_in_flight and step + every > steps)
        write_guide_checkpoint(
            job_dir / f"step-{step:08d}",
            {"rank-0000/model.pt": spec.model.state_dict(), "rank-0000/optimizer.pt": spec.optimizer.state_dict()},
            step=step, loss=recorded, commit=commit,
        )
        saved.append(step)
        losses[step] = recorded
    return DemoRun(job_dir=job_dir, steps=tuple(saved), in_flight=saved[-1] if leave_last_in_flight else None,
                   losses=losses)
