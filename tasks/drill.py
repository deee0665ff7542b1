"""Restore drills: which checkpoint to try, what a worker is asked and answers, the verdict.

One drill engine for 1..N ranks: a single-rank drill is a drill of world
size 1. The pieces here are pure, with no Prefect and no torch:

* :func:`choose_candidates` - the checkpoints worth drilling, best first.
* :class:`DrillRequest` / :class:`WorkerResult` - what the parent asks one
  worker (``ckptier.tasks.drill_worker``, one per rank) and what it
  measured; JSON across the process boundary.
* :func:`judge` - a :class:`Verdict` from the ranks' measured numbers.
* :func:`worker_env` - the credential-free environment of a worker.

Fetching, launching the workers (:mod:`ckptier.tasks.drill_launch`) and
recording the verdict in the catalog are the callers' job.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any, Self, cast

from ckptier.formats.registry import DRILLABLE_FORMATS as DRILLABLE
from ckptier.formats.registry import plugin
from ckptier.storage.errors import ConfigError
from ckptier.storage.records import CheckpointRecord, Format, State
from ckptier.tasks.drill_trajectory import DEFAULT_TRAJECTORY_RTOL, Trajectory, compare_trajectory
from ckptier.tasks.reports import Check

DEFAULT_LOSS_TOLERANCE = 0.5
"""Relative distance allowed between the first restored loss and the loss the
checkpoint recorded. Generous on purpose: the restored step trains on the next
batch with updated weights (and logged losses are often window averages), so
they never match exactly; weights that did not restore (random init, wrong
layer) miss by far more."""

DEFAULT_CUDA_RTOL = 1e-4
"""Relative tolerance between the two repeated runs on CUDA, and between
the ranks' losses (CPU must be bit-exact)."""

DEFAULT_RESHARD_RTOL = 1e-4
"""Relative tolerance between the losses of a resharded restore (M ranks)
and of a same-size restore (N ranks), step by step, on CPU. The first loss
is computed from the restored weights alone and matches bit for bit when
the shards were restored right; later steps differ only by the order in
which the data-parallel gradient reduction adds (M vs N terms): measured at
0 for 4->2, 4->1 and 2->1 on the test models and a few float32 ulps
(< 1e-6 relative) where the world size is not a power of two. A shard
restored into the wrong rows, or not at all, moves the first loss by
percents (measured 3e-2 to 1e0 on the same models), two orders of magnitude
above this."""

DEFAULT_RESHARD_RTOL_CUDA = 1e-3
"""The same on CUDA, where the same-size restore may run on CPU (fewer GPUs
than saved ranks) and GPU kernels round differently (not exercised in CI)."""

STAGES = ("start", "rendezvous", "build", "load", "restore", "train", "done")
"""The stages a worker reports in its progress file, in order."""

DRILLABLE_FORMATS = DRILLABLE
"""Formats a drill can load (each plug-in says: :attr:`ckptier.formats.base.FormatPlugin.drillable`)."""


# --- choosing ---------------------------------------------------------------

_STATE_RANK = {State.VERIFIED: 0, State.COMMITTED: 1}


def _restorable(record: CheckpointRecord) -> bool:
    if record.copies:
        return bool(record.tiers)
    return record.missing_since is None  # copies not tracked: the hot location, unless it vanished


def choose_candidates(
    records: Sequence[CheckpointRecord], *, job: str | None = None, step: int | None = None
) -> list[CheckpointRecord]:
    """Checkpoints to drill, best first; pure.

    Only ``verified`` and ``committed`` checkpoints of a drillable format with
    a present copy qualify (never corrupt, incomplete or deleted ones, never a
    save in flight). Order: all verified before any committed (the fallback),
    then newest first (``saved_at``, then step), then job name. ``job`` and
    ``step`` filter exactly; an ineligible requested step gives an empty list.
    """

    def newest_first(r: CheckpointRecord) -> tuple[int, float, int, str]:
        saved = r.saved_at.timestamp() if isinstance(r.saved_at, datetime) else float("-inf")
        return (_STATE_RANK[r.state], -saved, -r.step, r.job)

    chosen = [
        r
        for r in records
        if r.state in _STATE_RANK
        and r.format in DRILLABLE_FORMATS
        and (job is None or r.job == job)
        and (step is None or r.step == step)
        and _restorable(r)
    ]
    return sorted(chosen, key=newest_first)


def factory_needed(record: CheckpointRecord) -> str | None:
    """Why a drill of ``record`` needs a model factory (``--model``), or None
    when it can build the model itself (Hugging Face checkpoints with a
    ``config.json``); pure."""
    if record.format in (Format.HF, Format.HF_WEIGHTS) and any(f.relpath == "config.json" for f in record.files):
        return None
    return plugin(record.format).why_factory


def drill_path(record: CheckpointRecord, fetched: Path) -> Path:
    """What the worker loads from ``fetched`` (the checkpoint's copy, its
    files at their relpaths): the directory, or the one file of a
    single-file checkpoint, as its format says; pure."""
    relpaths = [f.relpath for f in record.files]
    single = len(relpaths) == 1 and record.location.rstrip("/").rsplit("/", 1)[-1] == relpaths[0]
    return plugin(record.format).drill_path(Path(fetched), relpaths, single)


# --- what the parent asks, what a worker answers -----------------------------------


def _finite_or_none(value: Any) -> float | None:
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


class JsonRecord:
    """Base of the frozen dataclasses that cross a process boundary as JSON
    (a worker's request and result): :meth:`to_dict` gives its fields,
    :meth:`from_dict` builds one back, ignoring unknown keys (a newer
    peer's) and turning JSON lists into tuples."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(cast(Any, self))  # every subclass is a dataclass

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        names = {f.name for f in fields(cast(Any, cls))}
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items() if k in names})


@dataclass(frozen=True)
class DrillRequest(JsonRecord):
    """What the parent asks worker ``rank`` of ``world_size`` (JSON in its scratch).

    ``checkpoint`` is the rank's own copy (only the files it reads; a step
    directory, or a Lightning ``.ckpt``). ``factory`` is a
    ``module:function`` spec (see :mod:`ckptier.tasks.drill_models`) or None
    to build a Hugging Face model from its config.json. ``device`` is
    ``auto``, ``cpu``, ``cuda`` (device ``rank`` when there are several
    ranks) or ``cuda:N``; ``steps`` is K >= 1. ``available`` says which of
    its files are whole (None) and which are sparse copies holding only the
    listed byte ranges. ``layout`` is the checkpoint's (``replicated``: load
    one replica, and wrap the model in DDP when there are several ranks;
    ``sharded``: shard the model with FSDP2 and let DCP's planner read the
    parts). A worker joins a process group when there are several ranks or
    the layout is sharded: rank 0 serves the rendezvous store on the socket
    the parent bound to 127.0.0.1 (``store_fd``, inherited), the others
    connect to ``store_port``. ``repeat``: train K steps a second time from
    a fresh restore (the ``deterministic`` check; a single rank of a
    single-rank checkpoint). ``progress_path``: where the worker writes the
    stage it is in (None: nowhere); ``parent_pid``: the worker dies with
    that process (None: it does not watch). ``step``: the checkpoint's step
    as the catalog knows it, which the drill trains on from (steps
    ``step + 1 .. step + K``) and hands every factory call (``metadata["step"]``);
    None: the step the checkpoint's own metadata says, else 0.
    """

    checkpoint: str
    format: str
    factory: str | None
    steps: int
    device: str
    result_path: str
    seed: int = 0
    allow_globals: tuple[str, ...] = ()
    rank: int = 0
    world_size: int = 1
    saved_world: int = 1
    layout: str = "replicated"
    backend: str = "gloo"
    store_port: int = 0
    store_fd: int | None = None
    progress_path: str | None = None
    parent_pid: int | None = None
    timeout: float = 0.0
    available: Mapping[str, Any] = field(default_factory=dict)
    repeat: bool = True
    step: int | None = None

    @property
    def distributed(self) -> bool:
        """Whether the worker joins a process group (several ranks, or FSDP2's device mesh)."""
        return self.world_size > 1 or self.layout == "sharded"


@dataclass(frozen=True)
class WorkerResult(JsonRecord):
    """What one worker (one rank) measured (JSON-serialisable; times in
    seconds, memory in bytes), plus what the parent saw.

    ``error``/``error_stage`` are set when the drill could not finish; stage
    is one of ``setup``, ``rendezvous``, ``factory`` (the model factory does
    not import), ``load``, ``build``, ``restore``, ``train``, ``timeout``,
    ``crash``. ``unsafe`` marks a refused load. Losses are per step; ``None``
    stands for a non-finite loss. ``losses_repeat`` is the second run from a
    fresh restore (empty unless asked: :attr:`DrillRequest.repeat`).
    ``optimizer_step_before``/``after`` are the optimizer's step counter
    right after restoring and after the K steps. ``grad_problems`` lists
    trainable parameters whose gradient was missing, non-finite at some
    step, or zero at every step (on every rank). ``parallel`` is how the
    model was distributed (``ddp``, ``fsdp2``, or ``none`` on one rank);
    ``restored_digest`` the sha256 of the restored state of a replica when
    there are several (None otherwise). ``timings`` holds ``load_s``,
    ``build_s``, ``restore_s``, ``rendezvous_s``, ``first_step_s``,
    ``steps_s`` (all K steps), ``total_s``, the epoch time
    ``first_step_done_at``, and the parent's ``subprocess_s`` and
    ``spawned_at`` (``limit_s`` at a timeout). ``env_keys`` are the names
    (not values) of the worker's environment.

    Set by the parent: ``returncode``, ``stderr_tail``, ``timed_out``
    (killed at the time limit), ``stopped`` (killed because another rank
    had failed), ``exit_order`` (0 for the first rank to exit),
    ``last_stage`` (the worker's progress when it ended), ``confined``
    (whether the operating system confined the worker's writes to its
    scratch directory) and ``confinement`` (how, or why not; measured
    before the worker started; None when run in-process).

    ``first_step``: the step the drill restored (it trained ``first_step +
    1 .. first_step + K``). ``stack``: the versions it ran on (``python``,
    ``torch``, ``cuda``, the format's libraries). ``trajectory_rtol``: the
    tolerance the factory asked for (0: bit-exact; None: the policy's).
    ``synthetic_batches``: the drill trained on batches of its own (a
    Hugging Face model built without a factory), not the run's.
    ``optimizer_left``: optimizer state the checkpoint holds that was not
    restored, and why (:attr:`LoadedCheckpoint.optimizer_left`);
    ``optimizer_keeps_state``: whether the drill's optimizer kept state of its
    own while training (momentum, Adam's moments: a fresh one then departs
    from the run's). ``rng_saved``: the random streams the checkpoint saved
    (``python``, ``numpy``, ``cpu``, ``cuda``...); ``rng_resumed``: those the
    drill continued (:func:`~ckptier.tasks.drill_worker.resume_rng`).
    """

    checkpoint: str
    format: str
    steps: int
    rank: int = 0
    world_size: int = 1
    device: str | None = None
    backend: str | None = None
    parallel: str | None = None
    error: str | None = None
    error_stage: str | None = None
    unsafe: bool = False
    timed_out: bool = False
    stopped: bool = False
    losses: tuple[float | None, ...] = ()
    losses_repeat: tuple[float | None, ...] = ()
    recorded_loss: float | None = None
    checkpoint_step: int | None = None
    optimizer_loaded: bool = False
    optimizer_step_before: float | None = None
    optimizer_step_after: float | None = None
    trainable_params: int = 0
    frozen_params: int = 0
    grad_problems: tuple[str, ...] = ()
    restored_digest: str | None = None
    timings: Mapping[str, float] = field(default_factory=dict)
    peak_memory_bytes: int | None = None
    memory_kind: str | None = None
    also_loaded: tuple[str, ...] = ()
    env_keys: tuple[str, ...] = ()
    torch_version: str | None = None
    returncode: int | None = None
    stderr_tail: str | None = None
    exit_order: int | None = None
    last_stage: str | None = None
    confined: bool = False
    confinement: str | None = None
    first_step: int | None = None
    stack: Mapping[str, str | None] = field(default_factory=dict)
    trajectory_rtol: float | None = None
    synthetic_batches: bool = False
    optimizer_left: str | None = None
    optimizer_keeps_state: bool = False
    rng_saved: tuple[str, ...] = ()
    rng_resumed: tuple[str, ...] = ()

    @property
    def trained_steps(self) -> tuple[int, int] | None:
        """``(first, last)`` step trained, or None when it trained none."""
        if self.first_step is None or not self.losses:
            return None
        return (self.first_step + 1, self.first_step + len(self.losses))

    @property
    def failed(self) -> bool:
        return self.timed_out or self.stopped or self.error is not None

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["losses"] = [_finite_or_none(v) for v in self.losses]
        data["losses_repeat"] = [_finite_or_none(v) for v in self.losses_repeat]
        data["timings"] = dict(self.timings)
        return data


# --- the verdict ------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """``ok`` only when every check passed; ``summary`` is one line."""

    ok: bool
    checks: list[Check]
    summary: str

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "summary": self.summary, "checks": [asdict(c) for c in self.checks]}


@dataclass(frozen=True)
class Expected:
    """What the run recorded after the drilled checkpoint (``recorded``: None
    when it recorded nothing) and the policy's tolerance (``rtol``; 0: bit-exact)."""

    recorded: Trajectory | None
    rtol: float = DEFAULT_TRAJECTORY_RTOL


def _fmt(value: float | None) -> str:
    return "non-finite" if value is None else f"{value:.6g}"


def _stage_index(stage: str | None) -> int:
    return STAGES.index(stage) if stage in STAGES else -1


def _ranks_text(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _completion(results: Sequence[WorkerResult]) -> Check:
    """The ``completed`` check: every rank finished; else the root cause
    (a single rank: its stage and error)."""
    failed = [r for r in results if r.failed]
    if not failed:
        return Check("completed", True, "")
    if len(results) == 1:
        (only,) = results
        return Check("completed", False, f"{only.error_stage or 'crash'}: "
                                         f"{only.error or 'the worker stopped without an error message'}")
    timed = [r for r in results if r.timed_out]
    if timed:
        laggard = min(timed, key=lambda r: (_stage_index(r.last_stage), r.rank))
        ahead = sorted({r.last_stage for r in timed if r.last_stage != laggard.last_stage and r.last_stage}, key=_stage_index)
        where = f"; rank {laggard.rank} was still in {laggard.last_stage or 'start'}"
        if ahead:
            where += f" while the others had reached {', '.join(ahead)}"
        limit = timed[0].timings.get("limit_s")
        killed = f"{'was' if len(timed) == 1 else 'were'} killed at the time limit" + (f" of {limit:g} s" if limit else "")
        return Check("completed", False, f"timeout: {_ranks_text([r.rank for r in timed])} {killed}{where}; "
                                         "raise the drill timeout or lower the steps")
    own = [r for r in failed if not r.stopped]
    # A rank that died without a result (killed, os._exit, a segfault) explains the errors its peers then
    # report from a collective (a closed connection), whichever exit the drill happened to see first.
    crashed = [r for r in own if r.error_stage == "crash"]
    first = min(crashed or own or failed, key=lambda r: (r.exit_order if r.exit_order is not None else 1 << 30, r.rank))
    detail = f"rank {first.rank}: {first.error_stage or 'crash'}: {first.error or 'stopped'}"
    stopped = sorted(r.rank for r in failed if r.stopped)
    also = sorted(r.rank for r in own if r is not first)
    if also:
        detail += f" (then {_ranks_text(also)} failed too)"
    if stopped:
        detail += f"; {_ranks_text(stopped)} stopped by the drill"
    return Check("completed", False, detail)


def _agree(a: float | None, b: float | None, exact: bool, rtol: float) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a == b if exact else abs(a - b) <= rtol * max(abs(a), abs(b))


def random_streams_text(saved: Sequence[str], resumed: Sequence[str]) -> str:
    """What a drill did with the random streams its checkpoint saved; pure. Informative
    only: a stream not continued is no fault of the checkpoint (dropout then draws
    other masks, which the ``trajectory`` tolerance allows)."""
    if not saved:
        return "skipped: the checkpoint saved no random state; dropout draws the drill's own masks"
    left = [name for name in saved if name not in resumed]
    if not resumed:
        return f"skipped: none of the saved streams ({', '.join(saved)}) fits this drill's generators"
    text = f"continued the run's {', '.join(resumed)} random streams"
    return text + (f"; not {', '.join(left)} (left at the drill's seed)" if left else "")


def judge(
    results: Sequence[WorkerResult],
    *,
    steps: int | None = None,
    loss_tolerance: float = DEFAULT_LOSS_TOLERANCE,
    cuda_rtol: float = DEFAULT_CUDA_RTOL,
    reference: Sequence[WorkerResult] | None = None,
    reshard_rtol: float | None = None,
    trajectory: Expected | None = None,
) -> Verdict:
    """The verdict of a drill of one or more ranks; pure over their numbers.

    ``steps`` is K (default: what rank 0 was asked). Checks, in order, each
    failure naming the rank when there are several: ``completed`` (every
    rank finished; else the rank that failed first, or, at the time limit,
    the one that lagged; no other check is judged), ``losses_finite`` (K
    finite losses on every rank), ``replicas_agree`` (several ranks only:
    every rank restored the same replica, when they hold replicas, and
    every rank's loss equals rank 0's at every step: bit-exact on CPU,
    ``cuda_rtol`` on CUDA; every rank trains the same batch), ``gradients``
    (every trainable parameter got a finite gradient on every rank,
    non-zero on some rank), ``optimizer_continues`` (every rank's step
    counter advanced by exactly K; passes when the checkpoint had no
    optimizer state), ``deterministic`` (when a rank trained twice from a
    fresh restore: the runs agree, bit-exact on CPU, ``cuda_rtol`` on
    CUDA), ``recorded_loss`` (rank 0's first loss within ``loss_tolerance``
    relative of the recorded one; passes when nothing was recorded). With
    ``reference`` (a same-size restore of the same checkpoint), ``resumes``:
    rank 0's losses match the reference's step by step within
    ``reshard_rtol`` (default :data:`DEFAULT_RESHARD_RTOL`, or
    :data:`DEFAULT_RESHARD_RTOL_CUDA` on CUDA). With ``trajectory`` (what
    the run recorded after the checkpoint's step), ``trajectory``: rank 0's
    losses retrace the recorded ones (:func:`~ckptier.tasks.drill_trajectory.compare_trajectory`;
    the factory's ``trajectory_rtol`` wins over the policy's); skipped, with
    the reason, when there is nothing to compare.
    """
    ordered = sorted(results, key=lambda r: r.rank)
    world = len(ordered)
    many = world > 1
    zero = ordered[0]
    steps = zero.steps if steps is None else steps
    done = _completion(ordered)
    if not done.ok:
        return Verdict(False, [done], f"drill failed: {done.detail}")
    on_cuda = bool(zero.device and zero.device.startswith("cuda"))
    rule = "bit-exact" if not on_cuda else f"rtol {cuda_rtol:g}"

    def who(r: WorkerResult) -> str:
        return f"rank {r.rank}: " if many else ""

    every = " on every rank" if many else ""
    if many:
        checks = [Check("completed", True, f"{world} ranks x {steps} steps ({zero.parallel}, {zero.backend}) on {zero.device}")]
    else:
        checks = [Check("completed", True, f"{steps} steps on {zero.device}")]

    bad = None
    for r in ordered:
        if len(r.losses) != steps:
            bad = f"{who(r)}expected {steps} losses, got {len(r.losses)}"
        elif nonfinite := [i + 1 for i, v in enumerate(r.losses) if v is None or not math.isfinite(v)]:
            bad = f"{who(r)}non-finite loss at drill step(s) {nonfinite[:5]}"
        if bad:
            break
    checks.append(Check("losses_finite", bad is None, bad or f"losses {_fmt(zero.losses[0])} .. {_fmt(zero.losses[-1])}{every}"))

    if many:
        disagree = None
        replicas = [r for r in ordered if r.restored_digest is not None]
        if replicas and len(replicas) == world:
            odd = next((r for r in ordered if r.restored_digest != zero.restored_digest), None)
            if odd is not None:
                disagree = f"rank {odd.rank} restored other weights than rank 0 (its replica of the checkpoint differs)"
        if disagree is None:
            for r in ordered[1:]:
                for i, (a, b) in enumerate(zip(zero.losses, r.losses, strict=False)):
                    if not _agree(a, b, not on_cuda, cuda_rtol):
                        disagree = (f"rank {r.rank}'s loss at drill step {i + 1} is {_fmt(b)}, rank 0's {_fmt(a)} "
                                    f"({rule}; every rank trains the same batch)")
                        break
                if disagree:
                    break
        what = "restored identical replicas and agree" if replicas and len(replicas) == world else "agree"
        checks.append(Check("replicas_agree", disagree is None, disagree or f"{world} ranks {what} on every loss ({rule})"))

    grad = None
    if any(r.trainable_params == 0 for r in ordered):
        grad = f"{who(next(r for r in ordered if r.trainable_params == 0))}the model has no trainable parameters"
    else:
        shown: list[str] = []
        for r in ordered:
            for grad_problem in r.grad_problems:
                text = grad_problem if grad_problem.endswith("on every rank") else f"{who(r)}{grad_problem}"
                if text not in shown:
                    shown.append(text)
        if shown:
            grad = "; ".join(shown[:3]) + (f" (+{len(shown) - 3} more)" if len(shown) > 3 else "")
    if grad is None:
        frozen = f", {zero.frozen_params} frozen skipped" if zero.frozen_params else ""
        grad_ok = (f"{zero.trainable_params} trainable parameters got finite gradients on every rank" if many
                   else f"{zero.trainable_params} trainable parameters got finite non-zero gradients{frozen}")
    checks.append(Check("gradients", grad is None, grad or grad_ok))

    if not zero.optimizer_loaded:
        checks.append(Check("optimizer_continues", True, f"skipped: {zero.optimizer_left}; the drill's optimizer starts fresh"
                            if zero.optimizer_left else "skipped: the checkpoint has no optimizer state"))
    else:
        problem: str | None = None
        for r in ordered:
            before, after = r.optimizer_step_before, r.optimizer_step_after
            if before is None or after is None:
                continue
            if before <= 0:
                problem = f"{who(r)}restored optimizer step counter is {before:g}; the state did not restore"
            elif after != before + steps:
                problem = f"{who(r)}step counter went {before:g} -> {after:g}, expected {before + steps:g}"
            if problem:
                break
        counters = {(r.optimizer_step_before, r.optimizer_step_after) for r in ordered}
        if problem is None and len(counters) > 1:
            problem = "ranks restored different step counters: " + ", ".join(
                f"rank {r.rank} {_fmt(r.optimizer_step_before)}" for r in ordered)
        before = zero.optimizer_step_before
        ok_text = (f"step counter {before:g} -> {zero.optimizer_step_after:g}{every}" if before is not None
                   and zero.optimizer_step_after is not None else "skipped: the optimizer keeps no step counter")
        checks.append(Check("optimizer_continues", problem is None, problem or ok_text))

    repeated = [r for r in ordered if r.losses_repeat]
    if repeated:
        differ = None
        for r in repeated:
            mine, again = list(r.losses), list(r.losses_repeat)
            if len(again) != len(mine):
                differ = f"{who(r)}repeat run gave {len(again)} losses, first run {len(mine)}"
            else:
                at = next((i for i, (a, b) in enumerate(zip(mine, again, strict=True))
                           if not _agree(a, b, not on_cuda, cuda_rtol)), None)
                if at is not None:
                    differ = f"{who(r)}runs differ ({rule}) at step {at + 1}: {_fmt(mine[at])} vs {_fmt(again[at])}"
            if differ:
                break
        checks.append(Check("deterministic", differ is None, differ or f"two restored runs agree ({rule})"))

    recorded, first = zero.recorded_loss, (zero.losses[0] if zero.losses else None)
    whose = "rank 0's first loss" if many else "first loss"
    if recorded is None:
        checks.append(Check("recorded_loss", True, "skipped: the checkpoint recorded no loss"))
    elif first is None:
        checks.append(Check("recorded_loss", False, f"{whose} is non-finite, recorded {_fmt(recorded)}"))
    elif abs(first - recorded) <= loss_tolerance * abs(recorded):
        checks.append(Check("recorded_loss", True, f"first loss {_fmt(first)} vs recorded {_fmt(recorded)} (tolerance {loss_tolerance:g})"))
    else:
        checks.append(Check("recorded_loss", False, f"first loss {_fmt(first)} vs recorded {_fmt(recorded)}: off by more than {loss_tolerance:g} relative"))

    checks.append(Check("random_streams", True, random_streams_text(zero.rng_saved, zero.rng_resumed)))

    if reference is not None:
        checks.append(_resumes(ordered, reference, on_cuda, reshard_rtol))

    if trajectory is not None:
        rtol = zero.trajectory_rtol if zero.trajectory_rtol is not None else trajectory.rtol
        skip = ("the drill trained on batches of its own (a Hugging Face model built without a factory), "
                "not the run's; give a factory whose batch(step) is the run's" if zero.synthetic_batches else
                f"{zero.optimizer_left}, and the drill's fresh optimizer keeps state of its own, so its losses "
                "cannot retrace the run's" if zero.optimizer_left and zero.optimizer_keeps_state else None)
        outcome = compare_trajectory(list(zero.losses), (zero.first_step or 0) + 1, trajectory.recorded,
                                     rtol=rtol, skip_reason=skip)
        checks.append(Check("trajectory", outcome.status != "failed", outcome.detail))

    failed = [c for c in checks if not c.ok]
    if failed:
        return Verdict(False, checks, f"drill failed: {failed[0].name}: {failed[0].detail}")
    recorded_text = f" (recorded {_fmt(recorded)})" if recorded is not None else ""
    if many:
        first_step = max((r.timings.get("first_step_s", float("nan")) for r in ordered), default=float("nan"))
        summary = (f"drill ok: {world} ranks ({zero.parallel}, {zero.backend}) x {steps} steps on {zero.device}, "
                   f"first loss {_fmt(first)}{recorded_text}, ranks agree, first step {first_step:.3f} s")
    else:
        t = zero.timings
        summary = (f"drill ok: {steps} steps on {zero.device}, first loss {_fmt(first)}{recorded_text}, "
                   f"load {t.get('load_s', float('nan')):.2f} s, first step {t.get('first_step_s', float('nan')):.3f} s")
    if reference is not None:
        summary += f"; resumes on {world} rank{'s' if many else ''} (first losses match the {len(reference)}-rank restore)"
    return Verdict(True, checks, summary)


def _resumes(results: Sequence[WorkerResult], reference: Sequence[WorkerResult], on_cuda: bool, rtol: float | None) -> Check:
    world, saved = len(results), len(reference)
    tol = rtol if rtol is not None else (DEFAULT_RESHARD_RTOL_CUDA if on_cuda else DEFAULT_RESHARD_RTOL)
    ref = sorted(reference, key=lambda r: r.rank)
    verdict = judge(ref, steps=len(results[0].losses))
    if not verdict.checks[0].ok or not all(c.ok for c in verdict.checks if c.name in ("losses_finite", "replicas_agree")):
        return Check("resumes", False, f"cannot tell whether it resumes on {world} ranks: the {saved}-rank restore failed: {verdict.summary}")
    mine, theirs = list(results[0].losses), list(ref[0].losses)
    worst, at = 0.0, 0
    for i, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        if a is None or b is None:
            continue
        rel = abs(a - b) / max(abs(a), abs(b), 1e-30)
        if rel > worst:
            worst, at = rel, i + 1
    if worst > tol:
        return Check("resumes", False, f"the run does not resume the same on {world} ranks: at drill step {at} the loss is "
                                       f"{_fmt(mine[at - 1])} on {world} ranks, {_fmt(theirs[at - 1])} on {saved} "
                                       f"(relative {worst:.2g} > {tol:g})")
    return Check("resumes", True, f"the run can resume on {world} ranks: losses match the {saved}-rank restore "
                                  f"within rtol {tol:g} (largest difference {worst:.2g})")


# --- running isolated ---------------------------------------------------------

_ENV_KEEP = {
    "PATH", "PYTHONPATH", "PYTHONHASHSEED", "LANG", "LANGUAGE", "TZ", "TERM", "USER", "LOGNAME",
    "VIRTUAL_ENV", "CONDA_PREFIX", "LD_LIBRARY_PATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "CUDA_PATH", "CUBLAS_WORKSPACE_CONFIG", "SSL_CERT_FILE",
}
_ENV_KEEP_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "PYTORCH_", "NCCL_")
_ENV_SECRET_MARKERS = ("SECRET", "TOKEN", "PASSWORD", "PASSWD", "CREDENTIAL", "API_KEY", "ACCESS_KEY", "PRIVATE_KEY", "SESSION")
_ENV_SECRET_PREFIXES = ("AWS_", "AZURE_", "GOOGLE_", "GCP_", "PREFECT_", "CKPTIER_")


def looks_secret(name: str) -> bool:
    """True for environment names that may carry credentials or service
    addresses (``AWS_*``, ``*SECRET*``, ``*TOKEN*``, ``PREFECT_*``,
    ``CKPTIER_*`` (the catalog URL can hold a password), ...)."""
    upper = name.upper()
    return upper.startswith(_ENV_SECRET_PREFIXES) or any(m in upper for m in _ENV_SECRET_MARKERS)


def worker_env(parent: Mapping[str, str], scratch: Path, *, passthrough: Sequence[str] = ()) -> dict[str, str]:
    """The drill worker's environment; pure.

    An allowlist, not a denylist: PATH, PYTHONPATH, locale, CUDA/PyTorch
    thread and device settings are kept; everything else is dropped. ``HOME``
    and ``TMPDIR`` point into ``scratch``; Hugging Face is forced offline.
    ``passthrough`` names extra variables to keep; naming one that looks like
    a credential raises :class:`ConfigError`.
    """
    for name in passthrough:
        if looks_secret(name):
            raise ConfigError(f"drill env passthrough {name!r} looks like a credential; drills never get storage credentials")
    env = {
        k: v
        for k, v in parent.items()
        if (k in _ENV_KEEP or k.startswith(_ENV_KEEP_PREFIXES) or k in passthrough) and not (looks_secret(k) and k not in passthrough)
    }
    env.update(
        HOME=str(scratch),
        TMPDIR=str(scratch / "tmp"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONDONTWRITEBYTECODE="1",
        CUBLAS_WORKSPACE_CONFIG=parent.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),
    )
    return env
