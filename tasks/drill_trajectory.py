"""The run's own losses after a checkpoint, and the drill's ``trajectory`` check.

A drill restores step S and trains steps S+1 .. S+K. When the run recorded
its losses for those steps, the drill's K losses must retrace them: the same
weights, optimizer state and batches give the same losses (bit for bit on
the same hardware, within float rounding of a different reduction order
elsewhere; random draws such as dropout are the run's own only where the
checkpoint saved its random-number states, Hugging Face's ``rng_state.pth``
or a legacy Megatron ``model_optim_rng.pt``'s ``rng_state``, and otherwise start from the drill's seed, within the tolerance). A drill on the wrong steps, a shard restored into the wrong
rows or an optimizer state that did not take moves them by far more.

Where a run records its losses (first found wins, in this order):

* ``losses.jsonl`` beside the checkpoints (the job directory), one
  ``{"step": N, "loss": x}`` per line, written by any trainer (every format);
* the guide layout: a later checkpoint's ``metadata.json``
  ``"loss_history": {"<step>": loss}``;
* Hugging Face Trainer: a later checkpoint's ``trainer_state.json``
  ``log_history`` (each ``loss`` is the mean over the ``logging_steps``
  steps ending at its ``step``: the drill's losses are averaged over the
  same windows, like with like);
* Lightning: ``CSVLogger``'s ``metrics.csv`` (``step`` and ``train_loss``
  or ``train_loss_step``), beside the checkpoints or one directory up.

Lightning's ``step`` column is the global step when the row was logged,
after that training step's optimizer step: the loss of training step N is
logged at ``step`` N - 1 (``log_every_n_steps`` 1) - which :func:`parse_metrics_csv`
accounts for.

Everything here is pure: parsers over bytes, the comparison over numbers;
:func:`trajectory_sources` says which files to read, the caller reads them.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ckptier.formats.base import as_step
from ckptier.storage.records import CheckpointRecord, Format

DEFAULT_TRAJECTORY_RTOL = 0.02
"""Relative distance allowed between a drill's loss and the run's recorded
loss at the same step. The same weights and batches give the same loss up to
float rounding (measured at < 1e-6 relative for FSDP2 restores on 1, 2 and 4
ranks, and 0 on one rank); logged losses are often rounded (HF Trainer logs
4 decimals) and a GPU run restored on CPU rounds differently: a few 1e-4.
Training on the wrong steps, the failure this catches first, moves the loss
by 2-4x on the test models; 2% is two orders of magnitude below that and
one above the rounding."""


@dataclass(frozen=True)
class RecordedLoss:
    """The run's loss at ``step``: the mean over the ``window`` steps ending there (1: that step's own)."""

    step: int
    loss: float
    window: int = 1


@dataclass(frozen=True)
class Trajectory:
    """The losses a run recorded, and where (``source``: a file name, for the report)."""

    source: str
    points: tuple[RecordedLoss, ...]


# --- parsers (bytes -> points; a malformed source gives none) -------------------------------


def _finite(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def parse_losses_jsonl(data: bytes) -> list[RecordedLoss]:
    """``{"step": N, "loss": x}`` per line; other lines and keys are ignored."""
    points = []
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and (step := as_step(row.get("step"))) is not None and (
                loss := _finite(row.get("loss"))) is not None:
            points.append(RecordedLoss(step, loss))
    return points


def parse_loss_history(data: bytes) -> list[RecordedLoss]:
    """A guide ``metadata.json``'s ``"loss_history": {"<step>": loss}``."""
    try:
        meta = json.loads(data)
    except ValueError:
        return []
    history = meta.get("loss_history") if isinstance(meta, dict) else None
    if not isinstance(history, dict):
        return []
    return [RecordedLoss(s, v) for k, x in history.items()
            if (s := as_step(k)) is not None and (v := _finite(x)) is not None]


def parse_trainer_state(data: bytes) -> list[RecordedLoss]:
    """HF ``trainer_state.json``'s training losses: each ``log_history``
    entry with ``loss`` and ``step``, a mean over the steps since the
    previous logged loss (``logging_steps`` for the first)."""
    try:
        state = json.loads(data)
    except ValueError:
        return []
    if not isinstance(state, dict) or not isinstance(state.get("log_history"), list):
        return []
    every = as_step(state.get("logging_steps")) or 1
    points: list[RecordedLoss] = []
    previous: int | None = None
    for entry in state["log_history"]:
        if not isinstance(entry, dict) or "eval_loss" in entry:
            continue
        step, loss = as_step(entry.get("step")), _finite(entry.get("loss"))
        if step is None or loss is None:
            continue
        window = step - previous if previous is not None and step > previous else min(every, max(step, 1))
        points.append(RecordedLoss(step, loss, window))
        previous = step
    return points


def parse_metrics_csv(data: bytes) -> list[RecordedLoss]:
    """Lightning ``CSVLogger``'s ``metrics.csv``: ``train_loss`` (or
    ``train_loss_step``) rows; training step N is logged at ``step`` N - 1."""
    try:
        rows = list(csv.DictReader(io.StringIO(data.decode("utf-8", errors="replace"))))
    except csv.Error:
        return []
    points = []
    for row in rows:
        logged = as_step(row.get("step"))
        text = row.get("train_loss") or row.get("train_loss_step") or ""
        try:
            loss = _finite(float(text)) if text.strip() else None
        except ValueError:
            loss = None
        if logged is not None and loss is not None:
            points.append(RecordedLoss(logged + 1, loss))
    return points


PARSERS: Mapping[str, Callable[[bytes], list[RecordedLoss]]] = {
    "losses.jsonl": parse_losses_jsonl,
    "metadata.json": parse_loss_history,
    "trainer_state.json": parse_trainer_state,
    "metrics.csv": parse_metrics_csv,
}
"""The parser of each source, by file name."""


# --- where to look ------------------------------------------------------------------------


#: Per format, the files of a later checkpoint of the job that record losses after their own step.
LATER_CHECKPOINT_FILES: Mapping[Format, tuple[str, ...]] = {
    Format.GUIDE: ("metadata.json",),
    Format.HF: ("trainer_state.json",),
}

#: Per format, job-level logs besides ``losses.jsonl``: paths relative to the job directory.
JOB_FILES: Mapping[Format, tuple[str, ...]] = {
    Format.LIGHTNING: ("metrics.csv", "../metrics.csv"),
}


def _job_dir(location: str) -> str:
    return location.rstrip("/").rsplit("/", 1)[0]


def trajectory_sources(record: CheckpointRecord, later: Sequence[CheckpointRecord]) -> list[tuple[str, str]]:
    """The locations to read, in order, as ``(name, location)``: the
    job-level ``losses.jsonl``, the format's job logs, then its later
    checkpoints' files (oldest later one first: the nearest records the
    steps right after ``record``); pure."""
    job = _job_dir(record.location)
    out = [("losses.jsonl", f"{job}/losses.jsonl")]
    for rel in JOB_FILES.get(record.format, ()):
        base = job
        while rel.startswith("../"):
            base, rel = _job_dir(base), rel[3:]
        out.append((rel.rsplit("/", 1)[-1], f"{base}/{rel}"))
    names = LATER_CHECKPOINT_FILES.get(record.format, ())
    for other in sorted((r for r in later if r.job == record.job and r.step > record.step), key=lambda r: r.step):
        have = {f.relpath for f in other.files}
        out.extend((name, f"{other.location.rstrip('/')}/{name}") for name in names if name in have)
    return out


def recorded_trajectory(record: CheckpointRecord, later: Sequence[CheckpointRecord],
                        read: Callable[[str], bytes | None], *, steps: int) -> Trajectory | None:
    """The first source (:func:`trajectory_sources`) that records a loss for
    some step in ``record.step + 1 .. record.step + steps``; ``read``
    gives a location's bytes, or None when it is not there. None when no
    source does."""
    wanted = range(record.step + 1, record.step + steps + 1)
    merged: dict[int, RecordedLoss] = {}
    source = None
    for name, location in trajectory_sources(record, later):
        data = read(location)
        if not data:
            continue
        points = [p for p in PARSERS[name](data) if p.step in wanted]
        if not points:
            continue
        if source is None:
            source = location
        elif name not in ("metadata.json", "trainer_state.json"):
            continue  # job-level logs: the first that covers the drill is the run's
        for p in points:
            merged.setdefault(p.step, p)
        if all(s in merged for s in wanted):
            break
    if source is None:
        return None
    return Trajectory(source, tuple(merged[s] for s in sorted(merged)))


# --- the check ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TrajectoryOutcome:
    """The ``trajectory`` check: ``status`` ``ok``, ``failed`` or
    ``skipped``; ``detail`` in words; ``compared`` the steps compared;
    ``worst``/``at``: the largest relative deviation and its step."""

    status: str
    detail: str
    compared: int = 0
    worst: float = 0.0
    at: int | None = None


def compare_trajectory(losses: Sequence[float | None], first_step: int, trajectory: Trajectory | None, *,
                       rtol: float = DEFAULT_TRAJECTORY_RTOL, skip_reason: str | None = None) -> TrajectoryOutcome:
    """Compare the drill's ``losses`` (of steps ``first_step``,
    ``first_step + 1``...) with the run's recorded ones; pure.

    A recorded loss over a window of steps is compared with the mean of the
    drill's losses over the same steps, only when the drill trained them
    all. ``rtol`` 0 asks for bit-exact equality. ``skipped`` (with the
    reason) when there is nothing to compare: ``skip_reason`` (the drill
    does not train on the run's data), no recorded losses, or none for the
    steps the drill trained."""
    last = first_step + len(losses) - 1
    if skip_reason is not None:
        return TrajectoryOutcome("skipped", f"skipped: {skip_reason}")
    if trajectory is None:
        return TrajectoryOutcome("skipped", f"skipped: the run recorded no loss for steps {first_step}..{last} "
                                            "(no losses.jsonl beside the checkpoints, nor a log of the format's own)")
    worst, at, compared = 0.0, None, 0
    mine_at, theirs_at = 0.0, 0.0
    for point in trajectory.points:
        start = point.step - point.window + 1
        if start < first_step or point.step > last:
            continue
        window = losses[start - first_step: point.step - first_step + 1]
        if any(v is None for v in window):
            continue
        mine = sum(v for v in window if v is not None) / len(window)
        compared += 1
        rel = abs(mine - point.loss) / max(abs(point.loss), 1e-30)
        if rel > worst or at is None:
            worst, at, mine_at, theirs_at = rel, point.step, mine, point.loss
    if not compared:
        return TrajectoryOutcome("skipped", f"skipped: {trajectory.source} records no loss for steps {first_step}..{last}")
    rule = "bit-exact" if rtol == 0 else f"rtol {rtol:g}"
    if worst > rtol:
        return TrajectoryOutcome("failed", f"the drill does not retrace the run: at step {at} the loss is {mine_at:.6g}, "
                                           f"the run recorded {theirs_at:.6g} (relative {worst:.2g}, {rule}; "
                                           f"{trajectory.source})", compared, worst, at)
    return TrajectoryOutcome("ok", f"{compared} recorded loss{'es' if compared > 1 else ''} of steps {first_step}..{last} "
                                   f"retraced ({rule}, largest deviation {worst:.2g}; {trajectory.source})",
                             compared, worst, at)
