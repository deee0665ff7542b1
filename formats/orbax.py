"""``orbax``: JAX checkpoints written by Orbax's ``CheckpointManager``.

Layout (orbax-checkpoint 0.12: ``CheckpointManager.save``, step names from
``step_name_format``: the bare step, or ``{prefix}_{step}``)::

    {job}/{step}/_CHECKPOINT_METADATA     # JSON, written at the commit: commit_timestamp_nsecs, metrics
    {job}/{step}/commit_success.txt       # on stores without atomic rename (and often beside it)
    {job}/{step}/{item}/...               # each item: _METADATA, manifest.ocdbt, ocdbt.process_0/d/...
    {job}/{step}.orbax-checkpoint-tmp-{T}/...   # a save in flight (renamed to {step} at the commit)
    {job}/{step}.orbax-checkpoint-tmp/...       # the same, as 0.12's temporary paths name it (no -{T})

Commit evidence: ``_CHECKPOINT_METADATA`` with a ``commit_timestamp_nsecs``,
or ``commit_success.txt``, directly in the step directory. A directory with
the ``.orbax-checkpoint-tmp`` suffix (with or without ``-{T}``) is a save in flight: ``incomplete``,
so retention never deletes it before the job's grace. A numeric ``loss`` in
the metadata's ``metrics``, or in the ``metrics/metrics`` item the manager
writes when it tracks a best metric, is the recorded loss; all their numbers
are the checkpoint's metrics (``keep_best``). Item directories are part of
their step's checkpoint.

Drills need JAX and ``orbax-checkpoint`` in the drill's environment: the
arrays are restored with Orbax (no pickle) and handed to the factory's torch
model by their flattened tree paths (``params.dense.kernel``). The optimizer
state is restored as optimizer state: an item (or a top-level subtree of the
one item) named ``optimizer``, ``opt_state`` or ``optim``, whose arrays are
the flattened optimizer state by parameter (``net.0.weight.exp_avg``, as
torch's ``get_optimizer_state_dict(flatten_optimizer_state_dict=True)``
names them, less its ``state.`` prefix); the model is the other item or
subtree (``model``, ``params``...). Without JAX the drill says so in one line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptier.formats.base import FormatPlugin, Group, Scan, as_loss, step_in_name
from ckptier.storage.records import Format, clean_metrics

if TYPE_CHECKING:
    from ckptier.formats.safe_load import LoadedCheckpoint

__all__ = ["PLUGIN", "TMP_SUFFIX"]

TMP_SUFFIX = ".orbax-checkpoint-tmp"
"""The suffix of a save in flight: ``6.orbax-checkpoint-tmp-{T}``, or ``6.orbax-checkpoint-tmp`` (orbax 0.12)."""
_OPTIMIZER_ITEMS = ("optimizer", "opt_state", "optim")


def _tmp_at(name: str) -> int:
    """Where ``name`` (a key or a directory name) has an in-flight suffix, else -1."""
    at = name.find(TMP_SUFFIX)
    while at >= 0:
        end = at + len(TMP_SUFFIX)
        if end == len(name) or name[end] in "-/":
            return at
        at = name.find(TMP_SUFFIX, end)
    return -1
_META = "_CHECKPOINT_METADATA"
_SUCCESS = "commit_success.txt"
_METRICS = "metrics/metrics"
_STEP = re.compile(r"^(?:.*_)?(\d+)$")
_NEEDS_JAX = ("an Orbax checkpoint needs JAX to drill, and JAX or orbax-checkpoint is not installed in the drill's "
              "environment; install them there (pip install 'ckptier[orbax]') or drill another format")


def orbax_step(dirname: str) -> int | None:
    """The step of an Orbax step directory name (``1000``, ``ckpt_1000``), else None."""
    m = _STEP.match(dirname)
    return int(m.group(1)) if m else step_in_name(dirname)


class OrbaxFormat(FormatPlugin):
    format = Format.ORBAX
    metadata_names = frozenset({_META, "metrics"})
    anchor_names = frozenset({_META, _SUCCESS})
    adopts_subdirs = True
    why_factory = "an Orbax checkpoint holds arrays only; give a torch model whose state dict keys are its tree paths"

    def anchor(self, key: str, slash: int, up: int) -> str | None:
        if slash <= 0:
            return None
        at = _tmp_at(key)
        if at >= 0:
            end = key.find("/", at)
            return key[:end] if end > 0 else None
        if key.endswith(("/" + _META, "/" + _SUCCESS)):
            return key[:slash]
        return None

    def recognise(self, group: Group, scan: Scan) -> None:
        prefix, dirname = group.prefix, group.dirname
        job, files = scan.job_of(prefix), group.files
        at = _tmp_at(dirname)
        step = orbax_step(dirname[:at] if at >= 0 else dirname)
        if step is None:
            scan.refuse(prefix + "/", f"Orbax checkpoint {dirname!r} not recognised: no step in the path")
            return
        if at >= 0:
            scan.emit(job=job, step=step, fmt=self.format, prefix=prefix, files=files, committed=False,
                      reason=f"Orbax save in flight ({dirname[at + 1:]}): renamed to its step directory at the commit")
            return
        top = group.top()
        loss = None
        numbers: dict[str, float] = {}
        committed, reason = False, f"no {_META} or {_SUCCESS}: save in flight or torn"
        meta = top.get(_META)
        if meta is not None:
            data, problem = scan.read_json(meta, _META)
            if problem is None and not isinstance(data, dict):
                problem = f"{_META}: expected a JSON object, found {type(data).__name__}"
            if problem is not None:
                reason = problem
            else:
                assert isinstance(data, dict)
                metrics = data.get("metrics")
                if isinstance(metrics, dict):
                    loss, numbers = as_loss(metrics.get("loss")), clean_metrics(metrics)
                if data.get("commit_timestamp_nsecs") is not None:
                    committed, reason = True, f"committed: {_META} records its commit time"
        if not committed and _SUCCESS in top and (meta is None or reason.startswith("no ")):
            committed, reason = True, f"committed: {_SUCCESS} present"
        metrics_file = next((f for f in files if group.relpath(f) == _METRICS), None)
        if committed and not numbers and metrics_file is not None:  # CheckpointManager's metrics item
            metrics, _ = scan.read_json(metrics_file, _METRICS)
            if isinstance(metrics, dict):
                loss, numbers = as_loss(metrics.get("loss")) if loss is None else loss, clean_metrics(metrics)
        scan.emit(job=job, step=step, fmt=self.format, prefix=prefix, files=files, committed=committed,
                  reason=reason, loss=loss, metrics=numbers)

    def load(self, path: Path, allow: Sequence[Any]) -> LoadedCheckpoint:
        from ckptier.formats.safe_load import CheckpointLoadError, LoadedCheckpoint

        try:
            import numpy as np
            import orbax.checkpoint as ocp  # type: ignore[import-not-found]
            import torch
        except ImportError:
            raise CheckpointLoadError(f"{path}: {_NEEDS_JAX}") from None
        items = sorted(p for p in path.iterdir() if p.is_dir() and (p / "_METADATA").is_file())
        optim_items = [p for p in items if p.name in _OPTIMIZER_ITEMS]
        model_items = [p for p in items if p not in optim_items]
        if len(model_items) != 1 or len(optim_items) > 1:
            raise CheckpointLoadError(f"{path}: expected one Orbax item directory (and at most one optimizer item: "
                                      f"{', '.join(_OPTIMIZER_ITEMS)}), found {', '.join(p.name for p in items) or 'none'}")

        def restore(item: Path) -> Any:
            try:
                return ocp.StandardCheckpointer().restore(item.resolve())
            except Exception as exc:  # noqa: BLE001 - Orbax/tensorstore errors of every kind: one line
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise CheckpointLoadError(f"{item}: Orbax restore failed: {first}; re-fetch or re-verify it") from None

        tree = restore(model_items[0])
        opt_tree = restore(optim_items[0]) if optim_items else None
        if opt_tree is None and isinstance(tree, Mapping):
            found = [k for k in tree if k in _OPTIMIZER_ITEMS]
            if found:  # one item holding {"model" or "params": ..., "optimizer": ...}
                opt_tree = tree[found[0]]
                rest = {k: v for k, v in tree.items() if k not in _OPTIMIZER_ITEMS and k != "step"}
                tree = next(iter(rest.values())) if len(rest) == 1 else rest

        def tensors(t: Any) -> dict[str, Any]:
            return {k: torch.from_numpy(np.array(v)) for k, v in _flatten(t).items()}

        model = tensors(tree)
        optimizer = {f"state.{k}": v for k, v in tensors(opt_tree).items()} if opt_tree is not None else None
        extra: dict[str, Any] = {"orbax_item": model_items[0].name}
        return LoadedCheckpoint(model, optimizer, extra, "fqn-flat", orbax_step(path.name), None)


PLUGIN = OrbaxFormat()


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            out.update(_flatten(value, f"{prefix}{i}."))
    elif tree is not None:
        out[prefix[:-1]] = tree
    return out
