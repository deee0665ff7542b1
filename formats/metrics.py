"""Metrics a run recorded about its checkpoints (for ``keep_best``), read at scan time.

Each format reads what its own library writes, from files the scan already
reads (bounded by the scan's metadata limit) or from names alone:

* Hugging Face Trainer: the ``log_history`` entries of ``trainer_state.json``
  at the checkpoint's ``global_step`` (``eval_loss``, ``eval_accuracy``,
  ``loss``...). ``best_metric`` is not taken: it is the best value *so far*,
  belonging to ``best_model_checkpoint`` (another checkpoint, often), and the
  file does not name the metric it measures.
* Lightning: the ``name=value`` parts of the file name that
  ``ModelCheckpoint(filename="{epoch}-{step}-{val_loss:.4f}")`` writes
  (``epoch=2-step=300-val_loss=0.2300.ckpt``). The ``callbacks`` state
  inside the ``.ckpt`` (``best_k_models``, ``current_score``) is not read: it
  lives in the checkpoint's pickle, whose tensors would have to be rebuilt
  to be read, and the scan runs with the store's credentials, where ckptier
  unpickles nothing but DCP metadata with a loader that constructs nothing.
  A name costs no read at all, on a listing of a million files. Put the
  monitored metric in the file name (as ``save_top_k`` users do) or write
  the job's ``metrics.jsonl``.
* Orbax: ``metrics`` of ``_CHECKPOINT_METADATA``, else the JSON of the
  ``metrics`` item ``CheckpointManager.save(step, metrics=...)`` writes.
* The guide's layout: ``"metrics": {"eval_loss": 0.41}`` in ``metadata.json``.
* Any format: the job's ``metrics.jsonl`` beside its checkpoint directories,
  one JSON object per line, ``{"step": 1000, "eval_loss": 0.41}``; a later
  line for the same step and name wins (a resumed run logs a step again).
  Where a checkpoint's own files name the same metric, they win.

Only names with finite numbers are kept (at most
:data:`~ckptier.storage.records.MAX_METRICS` per checkpoint); ``step`` and
non-numbers are dropped. Pure: bytes and names in, numbers out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ckptier.formats.base import as_step
from ckptier.storage.records import clean_metrics

__all__ = ["JOB_METRICS", "metrics_in_name", "parse_metrics_jsonl", "step_metrics"]

#: The job-level file of metrics any format's job may carry.
JOB_METRICS = "metrics.jsonl"

# name=value with a number, as Lightning's ModelCheckpoint formats "{val_loss:.2f}" (its
# names may hold "/" replaced by "_", dots and letters; parts are joined by "-" or "_").
_NAME_METRIC = re.compile(r"(?:^|[-_ ])([A-Za-z][\w./]*?)=(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)(?=$|[-_ ]|\.ckpt$)")
_STRUCTURAL = frozenset({"step", "epoch", "global_step"})


def metrics_in_name(name: str) -> dict[str, float]:
    """The ``metric=value`` parts of a checkpoint's file or directory name
    (``step`` and ``epoch`` excluded: they are where, not how well)."""
    stem = name[: -len(".ckpt")] if name.endswith(".ckpt") else name
    found = {m.group(1): float(m.group(2)) for m in _NAME_METRIC.finditer(stem) if m.group(1) not in _STRUCTURAL}
    return clean_metrics(found)


def step_metrics(entries: Any, step: int) -> dict[str, float]:
    """The numbers of every ``log_history``-style entry (a list of objects)
    whose ``step`` is ``step``, later entries winning (``step`` and ``epoch``
    dropped)."""
    out: dict[str, Any] = {}
    if isinstance(entries, list):
        for entry in entries:
            if isinstance(entry, dict) and as_step(entry.get("step")) == step:
                out.update({k: v for k, v in entry.items() if k not in _STRUCTURAL})
    return clean_metrics(out)


def parse_metrics_jsonl(data: bytes, label: str = JOB_METRICS) -> tuple[dict[int, dict[str, float]], str | None]:
    """Step -> metrics from a ``metrics.jsonl``, and a one-line note on the lines
    skipped (not JSON, not an object, no whole ``step`` ≥ 0), or None."""
    by_step: dict[int, dict[str, Any]] = {}
    bad: list[int] = []
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):
            bad.append(number)
            continue
        step = as_step(entry.get("step")) if isinstance(entry, dict) else None
        if step is None:
            bad.append(number)
            continue
        by_step.setdefault(step, {}).update({k: v for k, v in entry.items() if k not in _STRUCTURAL})
    out = {step: m for step, values in by_step.items() if (m := clean_metrics(values))}
    note = None
    if bad:
        note = (f"{label}: {len(bad)} line(s) skipped (line {bad[0]}: not a JSON object with a whole step, "
                f"e.g. {{\"step\": 1000, \"eval_loss\": 0.41}})")
    return out, note


def merged(own: Mapping[str, float], from_job: Mapping[str, float]) -> dict[str, float]:
    """A checkpoint's metrics: the job's ``metrics.jsonl`` values, its own files' winning."""
    return clean_metrics({**from_job, **own})
