"""Planning advice before and during a run: how big, how fast, how often, what it costs.

Pure: no I/O and no clock. :func:`advise` takes what the user asked
(:class:`Request`, every field optional but the parameter count), a
retention :class:`~.retention.Policy`, :class:`~.prices.Prices` and,
when the catalog knows the job, a :class:`JobObservation` (from
:func:`observe_job`), and returns an :class:`Advice`. Every input it used is
listed in :attr:`Advice.assumptions` with its value and where it came from:
``given`` (asked), ``measured`` (the catalog) or ``default`` (with the
default's source).

The figures:

* **size**: parameters x bytes per parameter, by component: the weights (the
  fp32 master copy under mixed precision, the bf16/fp16 weights being a cast
  of it; the weights in ``dtype`` otherwise) and the optimizer's per-parameter
  state (``adamw``/``adam``: two moments; ``sgd-momentum``: one; ``sgd``:
  none; ``adafactor``: factored second moments, O(rows + cols) per matrix,
  counted as 0). The defaults (bf16 with fp32 master weights, AdamW moments
  in bf16) give 8 bytes per parameter, the storage guide's figure; with
  ``--state-dtype fp32`` (torch's AdamW over fp32 parameters) it is 12.
  Sharded saves split it evenly over ``ranks``.
* **bandwidth** to save within the write window: size / window.
* **interval** minimising lost work plus checkpoint overhead, from the write
  time δ and the MTBF M: Young's first-order sqrt(2·δ·M) and Daly's
  higher-order estimate (J. T. Daly, "A higher order estimate of the optimum
  checkpoint interval for restart dumps", FGCS 22(3), 2006), which is the one
  recommended; expected overhead from Daly's model of wall time
  ``M·e^(R/M)·(e^((τ+δ)/M) − 1)/τ`` per unit of work (τ: compute time between
  saves, R: restart time). Both assume blocking saves.
* **storage over the run**: the real planner (:func:`~.retention.plan_retention`)
  run night by night over a synthetic run (one save per interval, every
  save verified within the hour, plan carried out every night at 00:00 UTC),
  with hot and archive bytes per storage class, against keeping everything.
* **cost**: stored bytes at the configured prices, plus the PUT requests of
  saves into an S3 hot class and of archive uploads.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from ckptier.storage.errors import ConfigError
from ckptier.storage.records import HELD_COPY_STATES, CheckpointRecord, CopyRecord, CopyState, Format, State, Tier

from .prices import MONTH_SECONDS, Prices, requests_for
from .durations import format_duration
from .retention import (
    KeepLast,
    Milestones,
    Plan,
    PlanItem,
    Policy,
    hot_present,
    plan_retention,
)
from .tiers import ALL_CLASSES, HOT, class_at, class_rank
from .units import DTYPE_BYTES, MAX_RUN_LENGTH, OPTIMIZER_STATES

_STATE_NAMES = {"adamw": "moments", "adam": "moments", "sgd-momentum": "momentum buffer"}
#: ckptier's own multipart part size for archive uploads (S3Store's default).
ARCHIVE_PART_SIZE = 16 << 20
#: When the synthetic run starts (a Monday, 00:00 UTC): fixed, so advice is reproducible.
SIM_START = datetime(2024, 1, 1, tzinfo=UTC)
#: The most saves the synthetic run simulates. A run with more (saves every
#: second, or a job whose copied tree has saves 0.2 ms apart) is simulated
#: with one save standing for ``k`` (:func:`simulation_scale`): the three-week
#: run the storage guide describes (1,008 saves) is simulated save by save.
MAX_SIM_SAVES = 1_100
#: The most nights the synthetic run plans; a longer run plans every ``j`` nights.
MAX_SIM_NIGHTS = 100
#: The most simulated saves times planned nights: what a policy that keeps every
#: save costs the planner (about 0.3 s here at this bound; a policy that keeps a few costs far less).
MAX_SIM_WORK = 40_000

Origin = Literal["given", "measured", "default"]


@dataclass(frozen=True)
class Request:
    """What the user asked; ``None`` means "the measured value, else the default".

    Units: durations as timedelta, ``write_bandwidth`` in bytes per second,
    ``part_size`` in bytes.
    """

    params: float | None = None
    dtype: str | None = None
    optimizer: str | None = None
    state_dtype: str | None = None
    master_weights: bool | None = None
    ranks: int | None = None
    write_window: timedelta | None = None
    write_bandwidth: float | None = None
    interval: timedelta | None = None
    mtbf: timedelta | None = None
    restart: timedelta | None = None
    run_length: timedelta | None = None
    steps_per_save: int | None = None
    codec_ratio: float | None = None
    hot_class: str | None = None
    part_size: int | None = None


#: Every default with its source (what a default is worth is in the source).
DEFAULTS: Mapping[str, tuple[Any, str]] = {
    "dtype": ("bf16", "bf16 mixed precision, the usual choice for training on current GPUs"),
    "optimizer": ("adamw", "the usual optimizer for training transformers"),
    "state_dtype": (
        "bf16",
        (
            "optimizer moments in bf16 next to fp32 master weights (as in DeepSeek-V3, arXiv:2412.19437 §3.3.3): "
            "8 bytes per parameter, the storage guide's figure; torch's AdamW over fp32 parameters keeps fp32 "
            "moments (--state-dtype fp32: 12 bytes per parameter)"
        ),
    ),
    "master_weights": (None, "mixed precision keeps an fp32 master copy of the weights, and the checkpoint saves it"),
    "ranks": (1, "one writer; give --ranks for the share of each rank of a sharded save"),
    "write_window": (timedelta(minutes=5), "the storage guide's target: a save takes at most five minutes"),
    "write_bandwidth": (None, "storage delivers exactly the bandwidth needed, so a save takes the whole window"),
    "interval": (timedelta(minutes=30), "the storage guide's usual cadence (every 30 minutes to a few hours)"),
    "mtbf": (
        timedelta(hours=8),
        (
            "an assumption; at scale it is shorter: Llama 3 pre-training had an unexpected interruption "
            "every ~3 h on 16,384 GPUs (arXiv:2407.21783 §3.3.4)"
        ),
    ),
    "restart": (timedelta(0), "restart time not counted (it scales the overhead, not the best interval)"),
    "run_length": (timedelta(days=21), "a three-week run, the storage guide's retention scenario"),
    "steps_per_save": (1000, "an assumption; it decides which saves are milestones"),
    "codec_ratio": (1.24, "the archive codec's target compression ratio on checkpoint tensors (bench/archive.py)"),
    "hot_class": (HOT, "hot checkpoints on local/POSIX storage (a training filesystem)"),
    "part_size": (8 << 20, "boto3's default multipart chunk size (matters only for an S3 hot class)"),
}


@dataclass(frozen=True)
class Assumption:
    """One input of the advice: ``name`` (the Request field), its ``value`` as
    shown, its ``origin`` and, for defaults and measurements, its ``source``."""

    name: str
    value: str
    origin: Origin
    source: str


@dataclass(frozen=True)
class JobObservation:
    """What the catalog says about one job (see :func:`observe_job`); None where unknown.

    ``size_bytes``: median checkpoint size. ``interval``: median time between
    consecutive saves (by step). ``steps_per_save``: median step gap.
    ``ranks``: distinct ``rank-NNNN`` directories (guide layout) or ``.distcp``
    shards (DCP) of the newest checkpoint. ``codec_ratio``: original over
    stored bytes of its archive copies. ``hot_class``: ``STANDARD`` when its
    checkpoints live on S3, else ``hot``.
    """

    job: str
    checkpoints: int
    size_bytes: int | None = None
    interval: timedelta | None = None
    steps_per_save: int | None = None
    ranks: int | None = None
    codec_ratio: float | None = None
    hot_class: str | None = None


@dataclass(frozen=True)
class Component:
    """One part of a checkpoint: what it is, bytes per parameter, bytes."""

    name: str
    bytes_per_param: float
    bytes: int


@dataclass(frozen=True)
class Sizing:
    """Checkpoint size. ``total_bytes`` is the measured size when the catalog
    has the job, else ``estimated_bytes`` (params x bytes per parameter)."""

    params: int | None
    components: tuple[Component, ...]
    bytes_per_param: float | None
    estimated_bytes: int | None
    total_bytes: int
    measured: bool
    ranks: int
    per_rank_bytes: int


@dataclass(frozen=True)
class Bandwidth:
    """Write bandwidth (bytes/s) needed to save ``total_bytes`` within ``window_s``."""

    window_s: float
    bytes_per_s: float
    per_rank_bytes_per_s: float


@dataclass(frozen=True)
class IntervalAdvice:
    """The checkpoint interval (seconds of compute between saves) that minimises
    lost work plus checkpoint overhead, from ``write_s`` (δ) and ``mtbf_s`` (M).

    ``recommended_s`` is Daly's; ``young_s`` is shown for comparison.
    ``overhead_*``: expected fraction of extra wall time (saves plus rework
    plus restarts) per unit of work, at the planned interval (``planned_s``,
    save to save) and at the recommended one; None when the planned interval
    is not longer than a save.
    """

    write_s: float
    mtbf_s: float
    restart_s: float
    young_s: float
    daly_s: float
    recommended: str
    recommended_s: float
    planned_s: float
    overhead_planned: float | None
    overhead_recommended: float
    notes: tuple[str, ...]


@dataclass(frozen=True)
class ClassBytes:
    """Bytes (and checkpoints) in one tier and storage class, and their monthly cost."""

    tier: str
    storage_class: str
    checkpoints: int
    bytes: int
    monthly_cost: float


@dataclass(frozen=True)
class Night:
    """The stored state after one night's plan was carried out (day 1 = the first night).

    ``recovery_points``: how many checkpoints that night had to be held (see
    :func:`recovery_gaps`); ``recovery_gaps``: one line per required
    checkpoint not held after the night's apply (empty: all held).
    """

    day: int
    saves: int
    stored: tuple[ClassBytes, ...]
    stored_bytes: int
    monthly_cost: float
    keep_all_bytes: int
    keep_all_monthly_cost: float
    recovery_points: int = 0
    recovery_gaps: tuple[str, ...] = ()
    #: Days this state is held (what storage is billed for): 1, or ``j`` when only every ``j``-th night is planned.
    days: int = 1

    def tier_bytes(self, tier: str) -> int:
        """Bytes stored in ``tier`` (``"hot"`` or ``"archive"``), all classes together."""
        return sum(s.bytes for s in self.stored if s.tier == tier)

    def tier_checkpoints(self, tier: str) -> int:
        """Checkpoints with a copy in ``tier``."""
        return sum(s.checkpoints for s in self.stored if s.tier == tier)


@dataclass(frozen=True)
class StorageForecast:
    """Stored bytes and cost over the synthetic run under ``policy``.

    ``final`` is the last night; ``peak_bytes`` the most stored on any
    night. ``run_cost``/``keep_all_run_cost``: storage billed over the run
    (each night's state held for one day) plus ``requests_cost``.
    ``monthly_cost``: the final state's storage per month plus the run's
    requests per month; ``keep_all_monthly_cost``: keeping every save in
    the hot class per month plus the saves' own PUT requests per month (an
    S3 hot class; the policy pays them too). ``price_note`` says where the prices come from;
    ``prices_assumed`` is True when any is a list-price assumption.
    """

    policy: str
    saves: int
    nights: tuple[Night, ...]
    final: Night
    peak_bytes: int
    stored_fraction: float
    monthly_cost: float
    keep_all_monthly_cost: float
    cost_fraction: float
    requests_cost: float
    run_cost: float
    keep_all_run_cost: float
    restore_cost: float | None
    price_note: str
    prices_assumed: bool
    currency: str
    #: How the simulation was coarsened to stay bounded (:func:`simulation_scale`), or None when it is exact.
    approximation: str | None = None


@dataclass(frozen=True)
class Advice:
    """Everything ``ckptier advise`` says (see the module docstring)."""

    job: str | None
    sizing: Sizing
    bandwidth: Bandwidth
    interval: IntervalAdvice
    storage: StorageForecast
    assumptions: tuple[Assumption, ...]

    def measured(self) -> tuple[str, ...]:
        """Names of the inputs taken from the catalog."""
        return tuple(a.name for a in self.assumptions if a.origin == "measured")


# ------------------------------------------------------------------ sizing


def bytes_per_param(dtype: str, optimizer: str, state_dtype: str, master_weights: bool) -> tuple[Component, ...]:
    """The components of a checkpoint per parameter (``bytes`` left 0)."""
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype {dtype!r} is not known: use one of {', '.join(DTYPE_BYTES)}")
    if state_dtype not in DTYPE_BYTES:
        raise ConfigError(f"optimizer state dtype {state_dtype!r} is not known: use one of {', '.join(DTYPE_BYTES)}")
    if optimizer not in OPTIMIZER_STATES:
        raise ConfigError(f"optimizer {optimizer!r} is not known: use one of {', '.join(OPTIMIZER_STATES)}")
    if master_weights and dtype != "fp32":
        weights = Component(f"weights (fp32 master copy; the {dtype} weights are a cast of it)", 4.0, 0)
    else:
        weights = Component(f"weights ({dtype})", float(DTYPE_BYTES[dtype]), 0)
    n = OPTIMIZER_STATES[optimizer]
    if n:
        what = _STATE_NAMES[optimizer]
        state = Component(f"{optimizer} {what} ({n} x {state_dtype})", float(n * DTYPE_BYTES[state_dtype]), 0)
    elif optimizer == "adafactor":
        state = Component("adafactor factored second moments (O(rows + cols) per matrix, ~0)", 0.0, 0)
    else:
        state = Component(f"{optimizer} (no per-parameter state)", 0.0, 0)
    return (weights, state)


def young_interval(write_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum compute time between saves: sqrt(2·δ·M)."""
    return math.sqrt(2.0 * write_s * mtbf_s)


def daly_interval(write_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (2006): for δ < 2M,
    sqrt(2δM)·[1 + ⅓·sqrt(δ/2M) + ⅑·(δ/2M)] − δ; else M."""
    if write_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = write_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * write_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - write_s


def overhead(compute_s: float, write_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Expected extra wall time per unit of work with ``compute_s`` of work
    between saves (Daly's model, exponential failures): M·e^(R/M)·(e^((τ+δ)/M) − 1)/τ − 1."""
    m = mtbf_s
    return m * math.exp(restart_s / m) * math.expm1((compute_s + write_s) / m) / compute_s - 1.0


# ------------------------------------------------------------------ the catalog


def observe_job(records: Sequence[CheckpointRecord]) -> JobObservation:
    """Measure a job from its catalog records (tombstones included: they were
    saved too). Raises :class:`ConfigError` when ``records`` is empty or
    holds several jobs."""
    jobs = sorted({r.job for r in records})
    if len(jobs) != 1:
        raise ConfigError(f"observe_job needs the records of exactly one job, got {len(jobs)} ({', '.join(jobs[:3])})")
    saved = sorted((r for r in records if r.state != State.INCOMPLETE), key=lambda r: (r.step, r.id))
    sizes = [r.bytes for r in saved if r.bytes > 0]
    times = [r.saved_at or r.first_seen for r in saved]
    gaps = [b - a for a, b in itertools.pairwise(times) if b > a]
    steps = [b.step - a.step for a, b in itertools.pairwise(saved) if b.step > a.step]
    archived = [(r.bytes, c.stored_bytes) for r in saved for c in r.copies
                if c.tier == Tier.ARCHIVE and c.state in HELD_COPY_STATES and c.stored_bytes]
    newest = saved[-1] if saved else None
    return JobObservation(
        job=jobs[0],
        checkpoints=len(saved),
        size_bytes=int(statistics.median(sizes)) if sizes else None,
        interval=timedelta(seconds=statistics.median(g.total_seconds() for g in gaps)) if gaps else None,
        steps_per_save=int(statistics.median(steps)) if steps else None,
        ranks=_ranks(newest) if newest is not None else None,
        codec_ratio=(sum(a for a, _ in archived) / sum(b for _, b in archived)) if archived else None,
        hot_class=("STANDARD" if newest.location.startswith("s3://") else HOT) if newest is not None else None,
    )


def _ranks(record: CheckpointRecord) -> int | None:
    if record.format == Format.DCP:
        shards = sum(1 for f in record.files if f.relpath.endswith(".distcp"))
        return shards or None
    ranks = {part for f in record.files for part in f.relpath.split("/")[:-1] if part.startswith("rank-")}
    return len(ranks) or None


# ------------------------------------------------------------------ the simulation


@dataclass(frozen=True)
class SimulationScale:
    """How :func:`simulate_storage` bounds its work: ``saves`` real saves over the run,
    each simulated save standing for ``per_save`` of them (1: every save simulated),
    and the plan carried out every ``every_nights`` nights (1: every night)."""

    saves: int
    per_save: int
    every_nights: int

    @property
    def exact(self) -> bool:
        return self.per_save == 1 and self.every_nights == 1

    def note(self, interval: timedelta) -> str | None:
        """The approximation in one line, or None when the simulation is exact."""
        if self.exact:
            return None
        parts = []
        if self.per_save > 1:
            parts.append(
                f"{self.saves:,} saves are simulated as one save every {format_duration(interval * self.per_save)} "
                f"standing for {self.per_save:,} (sizes, keep-all and requests count every save; what keep_within "
                f"and milestones finer than that keep is underestimated up to {self.per_save:,}x)"
            )
        if self.every_nights > 1:
            parts.append(f"the plan is carried out every {self.every_nights} nights instead of every night "
                         "(hot bytes between runs overestimated)")
        return "approximation: " + "; ".join(parts)


def simulation_scale(run_length: timedelta, interval: timedelta, nights: int) -> SimulationScale:
    """The coarsening that keeps a simulation of ``nights`` nights with a save every
    ``interval`` over ``run_length`` within :data:`MAX_SIM_NIGHTS` planned nights,
    :data:`MAX_SIM_SAVES` simulated saves and :data:`MAX_SIM_WORK` simulated saves
    times planned nights, so that any input is simulated in under a second (the
    planner runs a few times a night over the live checkpoints). Pure."""
    saves = int(run_length / interval)
    every = max(1, math.ceil(nights / MAX_SIM_NIGHTS))
    planned = math.ceil(nights / every)
    most = max(1, min(MAX_SIM_SAVES, MAX_SIM_WORK // max(1, planned)))
    return SimulationScale(saves, max(1, math.ceil(saves / most)), every)


def simulate_storage(
    policy: Policy,
    *,
    size: int,
    interval: timedelta,
    steps_per_save: int,
    run_length: timedelta,
    codec_ratio: float,
    hot_class: str,
    prices: Prices,
    plan: Callable[..., Plan] = plan_retention,
    start: datetime = SIM_START,
    settle: bool = False,
) -> tuple[Night, ...]:
    """Carry out ``policy`` night by night over a synthetic run; one :class:`Night` per night.

    Save ``i`` (1, 2, ...) happens at ``start + i·interval`` with step
    ``i·steps_per_save`` and ``size`` bytes, until ``run_length``. At 00:00
    UTC every night the whole catalog is planned with ``plan`` and carried
    out as ``ckptier apply`` does (:func:`apply_night`): promotions first,
    then deletions, each re-checked against a fresh plan; and a second pass,
    planned anew, when the first promoted something, so that the hot copy of
    a milestone promoted that night goes the same night. A deletion drops
    the checkpoint or its hot copy; a promotion adds an archive copy of
    ``size / codec_ratio`` bytes that counts as verified at once. Saves
    younger than an hour at planning time are not verified yet
    (``committed``), younger than ten minutes still in flight
    (``incomplete``). The last night is the first at or after the end of the
    run; with ``settle``, the first at or after it at which every save is
    verified (the state the run leaves behind: a night after the run when
    the last save came less than an hour before). Archive copies are priced in the class the policy's
    ``storage_class`` and ``archive_tiers`` give them at their age (``hot``
    for a local archive). Every night records which recovery points had to
    be held and any that were not (:func:`recovery_gaps`). No restore drill
    is simulated, so ``min_drilled`` holds nothing here.

    Bounded (:func:`simulation_scale`): a run of more than
    :data:`MAX_SIM_SAVES` saves simulates one save every ``k`` intervals
    with ``k`` times the steps, each standing for ``k`` saves (a night's
    ``saves`` and keep-all bytes still count every real save); a run of
    more than :data:`MAX_SIM_NIGHTS` nights is planned every ``j`` nights,
    each :class:`Night` holding its state for ``days = j``.
    """
    if size <= 0 or interval <= timedelta(0) or steps_per_save <= 0 or run_length <= timedelta(0) or codec_ratio <= 0:
        raise ConfigError(
            f"simulation needs size, interval, steps per save, run length and codec ratio > 0 "
            f"(got {size}, {interval}, {steps_per_save}, {run_length}, {codec_ratio})"
        )
    total = int(run_length / interval)
    if total < 1:
        raise ConfigError(f"run length {format_duration(run_length)} holds no save every {format_duration(interval)}: lengthen the run")
    nights = math.ceil(run_length / timedelta(days=1))
    if settle:
        last_verified = start + total * interval + timedelta(hours=1)
        nights = max(nights, math.ceil((last_verified - start) / timedelta(days=1)))
    scale = simulation_scale(run_length, interval, nights)
    real_interval, real_total = interval, total
    interval, steps_per_save, total = interval * scale.per_save, steps_per_save * scale.per_save, total // scale.per_save
    planned_days = list(range(scale.every_nights, nights + 1, scale.every_nights))
    if not planned_days or planned_days[-1] != nights:
        planned_days.append(nights)
    s3_archive = bool(policy.archive and policy.archive.startswith("s3://"))
    live: dict[int, CheckpointRecord] = {}
    steps: list[int] = []  # every save's step, deleted ones included, ascending
    promoted_at: dict[int, datetime] = {}
    out: list[Night] = []
    saved = 0
    previous = 0
    for day in planned_days:
        now = start + timedelta(days=day)
        while saved < total and start + (saved + 1) * interval <= now:
            saved += 1
            t = start + saved * interval
            step = saved * steps_per_save
            steps.append(step)
            live[saved] = CheckpointRecord(
                id=saved, job="advise", step=step, format=Format.GUIDE, state=State.VERIFIED,
                location=f"file:///advise/step-{step:08d}", bytes=size, saved_at=t, first_seen=t,
                last_seen=t, missing_since=None, verified_at=t + timedelta(hours=1), state_reason=None,
            )
        before = sim_view(live.values(), now)
        for cid in apply_night(live, policy, now=now, codec_ratio=codec_ratio, plan=plan):
            promoted_at[cid] = now
        required, gaps = recovery_gaps(before, live.values(), steps, policy, now=now)
        real_saves = min(real_total, int((now - start) / real_interval))
        out.append(dataclasses.replace(
            _night(day, real_saves, size, live.values(), promoted_at, now, policy, s3_archive, hot_class, prices,
                   required, gaps), days=day - previous))
        previous = day
    return tuple(out)


def sim_view(live: Iterable[CheckpointRecord], now: datetime) -> list[CheckpointRecord]:
    """The simulated catalog as the planner sees it at ``now``: saves younger than
    ten minutes still in flight (``incomplete``), younger than an hour not yet
    verified (``committed``), older ones verified."""
    view = []
    for c in live:
        age = now - (c.saved_at or c.first_seen)
        if c.state == State.VERIFIED and age < timedelta(minutes=10):
            c = dataclasses.replace(c, state=State.INCOMPLETE, verified_at=None)
        elif c.state == State.VERIFIED and age < timedelta(hours=1):
            c = dataclasses.replace(c, state=State.COMMITTED, verified_at=None)
        view.append(c)
    return view


#: Passes ``ckptier apply`` makes in one run (a second only when the first promoted something).
APPLY_PASSES = 2


def apply_night(
    live: dict[int, CheckpointRecord],
    policy: Policy,
    *,
    now: datetime,
    codec_ratio: float,
    plan: Callable[..., Plan] = plan_retention,
) -> list[int]:
    """Plan and carry out retention on the simulated catalog ``live`` (id ->
    record, changed in place) as one ``ckptier apply`` run does; return the ids
    promoted, in order.

    Each pass plans the whole catalog (as :func:`sim_view` shows it at
    ``now``), adds a verified archive copy of ``bytes / codec_ratio`` bytes
    for every ``promote`` of a checkpoint without one, then carries out each
    ``delete`` that a fresh plan of the catalog after the promotions still
    makes with the same scope (apply's re-check): ``checkpoint`` removes the
    record, ``hot-copy`` marks its hot copy deleted. A second pass runs only
    when the first promoted something, and acts only when its plan deletes
    something (as ``run_apply``).
    """
    promoted: list[int] = []
    for n in range(APPLY_PASSES):
        p = plan(sim_view(live.values(), now), policy, now=now)
        if n > 0 and not p.by_action("delete"):
            break
        this_pass = False
        for item in p.by_action("promote"):
            c = live[item.checkpoint_id]
            if c.has_verified_archive():
                continue  # already archived: promotion is idempotent
            copy = CopyRecord(Tier.ARCHIVE, f"{policy.archive}/{c.job}/step-{c.step:08d}", CopyState.PRESENT,
                              round(c.bytes / codec_ratio), now, "ckz1")
            live[c.id] = dataclasses.replace(c, copies=c.copies + (copy,))
            promoted.append(c.id)
            this_pass = True
        fresh: dict[int, PlanItem] | None = None
        for item in p.by_action("delete"):
            if fresh is None:
                fresh = {i.checkpoint_id: i for i in plan(sim_view(live.values(), now), policy, now=now).items}
            again = fresh.get(item.checkpoint_id)
            if again is None or again.action != "delete" or again.scope != item.scope:
                continue  # a fresh plan keeps it: apply skips the delete
            c = live[item.checkpoint_id]
            if item.scope == "checkpoint":
                del live[c.id]
            else:
                live[c.id] = dataclasses.replace(
                    c, copies=c.copies + (CopyRecord(Tier.HOT, c.location, CopyState.DELETED, None, None),))
        if not this_pass:
            break
    return promoted


def recovery_gaps(
    before: Sequence[CheckpointRecord],
    after: Iterable[CheckpointRecord],
    saved_steps: Sequence[int],
    policy: Policy,
    *,
    now: datetime,
) -> tuple[int, tuple[str, ...]]:
    """The recovery points one job needs after a night's apply, and those missing.

    ``before``: its live records as planned that night (with their states);
    ``after``: its live records once the plan was carried out;
    ``saved_steps``: the steps of every save so far, deleted ones included.
    Required, computed from the policy's settings rather than from a plan:

    * in hot storage: the newest verified checkpoint; the ``n`` newest
      verified of every ``keep_last n``; what every other non-milestone
      rule keeps (``keep_within``, ``keep_daily``, ``keep_weekly``,
      ``pinned``, as the rule says); at least ``min_verified`` verified
      checkpoints (as many as there are);
    * in hot storage or the archive: for every milestone step M reached
      (M at most the newest verified or committed step), the save that
      holds it: the first save at or after M (``milestone_match =
      "exact"``: the save at M, if any). Every save up to that step is
      assumed verified or committed (true of the simulation, where saves
      are verified in order).

    Returns ``(required, gaps)``: how many distinct checkpoints were
    required, and one line per required checkpoint not held (empty when
    every one is). Pure.
    """
    verified = sorted((c for c in before if c.state == State.VERIFIED), key=lambda c: (c.step, c.id), reverse=True)
    held = {c.step: c for c in after if c.state != State.DELETED}
    hot: dict[int, str] = {}
    anywhere: dict[int, str] = {}
    if verified:
        hot[verified[0].step] = "newest verified checkpoint"
    for rule in policy.rules:
        if isinstance(rule, KeepLast):
            for i, c in enumerate(verified[: rule.n]):
                hot.setdefault(c.step, f"keep_last {rule.n} (#{i + 1} newest verified)")
        elif not isinstance(rule, Milestones):
            by_id = {c.id: c.step for c in before}
            for cid in rule.keeps(before, now):
                hot.setdefault(by_id[cid], str(rule))
    reached = max((c.step for c in before if c.state in (State.VERIFIED, State.COMMITTED)), default=-1)
    for m in policy.milestones:
        prev = -1
        for s in saved_steps:
            if s > reached:
                break
            holds = m.is_milestone(s) if m.match == "exact" else m.between(prev, s) is not None
            if holds:
                anywhere.setdefault(s, f"holds a milestone of {m}")
            prev = s
    gaps = []
    for s, why in sorted(hot.items()):
        h = held.get(s)
        if h is None or not hot_present(h):
            gaps.append(f"step {s} ({why}): {'deleted' if h is None else 'hot copy gone'}, needed in hot storage")
    for s, why in sorted(anywhere.items()):
        h = held.get(s)
        if h is None or not (hot_present(h) or h.has_verified_archive()):
            gaps.append(f"step {s} ({why}): held neither in hot storage nor in the archive")
    hot_verified = sum(1 for c in verified if c.step in held and hot_present(held[c.step]))
    floor = min(policy.min_verified, len(verified))
    if hot_verified < floor:
        gaps.append(f"min_verified {policy.min_verified}: only {hot_verified} verified checkpoints in hot storage")
    return len(set(hot) | set(anywhere)), tuple(gaps)


def _night(day: int, saves: int, size: int, live: Any, promoted_at: Mapping[int, datetime], now: datetime,
           policy: Policy, s3_archive: bool, hot_class: str, prices: Prices, required: int = 0,
           gaps: tuple[str, ...] = ()) -> Night:
    counts: dict[tuple[str, str], list[int]] = {}
    for c in live:
        if hot_present(c):
            counts.setdefault(("hot", hot_class), [0, 0])
            counts[("hot", hot_class)][0] += 1
            counts[("hot", hot_class)][1] += c.bytes
        for x in c.copies:
            if x.tier == Tier.ARCHIVE and x.state == CopyState.PRESENT:
                cls = class_at(now - promoted_at[c.id], policy.storage_class, policy.archive_tiers) if s3_archive else HOT
                entry = counts.setdefault(("archive", cls), [0, 0])
                entry[0] += 1
                entry[1] += x.stored_bytes or c.bytes
    stored = tuple(
        ClassBytes(tier, cls, n, b, prices.monthly(b, cls))
        for (tier, cls), (n, b) in sorted(counts.items(), key=lambda kv: (kv[0][0] != "hot", class_rank(kv[0][1])))
    )
    keep_all = saves * size
    return Night(
        day=day, saves=saves, stored=stored, stored_bytes=sum(s.bytes for s in stored),
        monthly_cost=sum(s.monthly_cost for s in stored), keep_all_bytes=keep_all,
        keep_all_monthly_cost=prices.monthly(keep_all, hot_class),
        recovery_points=required, recovery_gaps=gaps,
    )


# ------------------------------------------------------------------ advice


def advise(
    request: Request,
    policy: Policy,
    prices: Prices,
    *,
    observed: JobObservation | None = None,
    policy_name: str | None = None,
) -> Advice:
    """The advice for ``request`` (see the module docstring).

    Precedence for every input: given (a what-if) over measured
    (``observed``, when the catalog has the job) over default; the measured
    checkpoint size replaces the estimate from ``params`` (which is still
    reported). :attr:`Advice.assumptions` records which. Raises
    :class:`ConfigError` (one line) for impossible inputs.
    """
    assumptions: list[Assumption] = []

    def pick(name: str, shown: Callable[[Any], str] = str, measured: Any = None, how: str = "") -> Any:
        given = getattr(request, name)
        origin: Origin
        if given is not None:
            value, origin, source = given, "given", ""
        elif measured is not None:
            value, origin, source = measured, "measured", how
        else:
            value, source = DEFAULTS[name]
            origin = "default"
        assumptions.append(Assumption(name, shown(value) if value is not None else "as needed", origin, source))
        return value

    obs = observed
    where = f"job {obs.job}, {obs.checkpoints} checkpoints" if obs else ""

    def dur(d: timedelta) -> str:
        return f"{d.days}d" if d >= timedelta(days=1) and not d % timedelta(days=1) else format_duration(d)

    if request.params is None and (obs is None or obs.size_bytes is None):
        raise ConfigError("advise needs --params N (e.g. --params 7e9), or --job J of a job the catalog has sizes for")
    if request.params is not None and not request.params > 0:
        raise ConfigError(f"--params {request.params}: must be a number of parameters > 0, e.g. 7e9")
    params = int(request.params) if request.params is not None else None
    if params is not None:
        assumptions.append(Assumption("params", f"{params:,}", "given", ""))
    dtype = pick("dtype")
    optimizer = pick("optimizer")
    if dtype == "fp32" and request.state_dtype is None:
        state_dtype = "fp32"
        assumptions.append(Assumption("state_dtype", "fp32", "default", "fp32 training keeps fp32 optimizer state"))
    else:
        state_dtype = pick("state_dtype")
    master = request.master_weights if request.master_weights is not None else dtype != "fp32"
    assumptions.append(Assumption(
        "master_weights", "fp32" if master and dtype != "fp32" else "no", "given" if request.master_weights is not None else "default",
        "" if request.master_weights is not None else DEFAULTS["master_weights"][1]))
    components = bytes_per_param(dtype, optimizer, state_dtype, master)
    per_param = sum(c.bytes_per_param for c in components)
    estimated = round(params * per_param) if params is not None else None
    if params is not None:
        components = tuple(dataclasses.replace(c, bytes=round(params * c.bytes_per_param)) for c in components)
    else:
        components = ()
    measured_size = obs.size_bytes if obs else None
    total = measured_size if measured_size is not None else estimated
    assert total is not None
    if measured_size is not None:
        assumptions.append(Assumption("size", _decimal_bytes(measured_size), "measured", f"median of {where}"))
    if total <= 0:
        raise ConfigError("checkpoint size is 0 bytes: give --params > 0 with an optimizer or dtype that stores something")
    ranks = pick("ranks", measured=obs.ranks if obs else None, how=f"rank shards of the newest checkpoint of job {obs.job}" if obs else "")
    if not isinstance(ranks, int) or ranks < 1:
        raise ConfigError(f"--ranks {ranks}: must be a whole number ≥ 1")
    sizing = Sizing(params, components, per_param if params is not None else None, estimated, total,
                    measured_size is not None, ranks, total // ranks)

    window = pick("write_window", dur)
    if window <= timedelta(0):
        raise ConfigError(f"--write-window {dur(window)}: must be longer than zero, e.g. 5m")
    bw = Bandwidth(window.total_seconds(), total / window.total_seconds(), total / window.total_seconds() / ranks)

    write_bw = pick("write_bandwidth", lambda b: f"{b / 1e6:,.1f} MB/s")
    if write_bw is not None and write_bw <= 0:
        raise ConfigError(f"--write-bandwidth {write_bw}: must be > 0, e.g. 2GB/s")
    write_s = total / write_bw if write_bw else window.total_seconds()
    mtbf = pick("mtbf", dur)
    restart = pick("restart", dur)
    planned = pick("interval", dur, measured=obs.interval if obs else None, how=f"median time between saves of {where}")
    if mtbf <= timedelta(0) or planned <= timedelta(0) or restart < timedelta(0):
        raise ConfigError(f"--mtbf {dur(mtbf)}, --interval {dur(planned)} must be > 0 and --restart ≥ 0")
    m = mtbf.total_seconds()
    young, daly = young_interval(write_s, m), daly_interval(write_s, m)
    notes = []
    compute = planned.total_seconds() - write_s
    if compute <= 0:
        notes.append(f"the planned interval {dur(planned)} is not longer than a save ({write_s:,.0f} s): saves would overlap")
    if write_s >= 2 * m:
        notes.append("a save takes longer than twice the MTBF: Daly's optimum is the MTBF itself")
    notes.append("Young and Daly assume blocking saves; asynchronous saves hide most of the write time")
    interval_advice = IntervalAdvice(
        write_s=write_s, mtbf_s=m, restart_s=restart.total_seconds(), young_s=young, daly_s=daly,
        recommended="daly", recommended_s=daly, planned_s=planned.total_seconds(),
        overhead_planned=overhead(compute, write_s, m, restart.total_seconds()) if compute > 0 else None,
        overhead_recommended=overhead(daly, write_s, m, restart.total_seconds()), notes=tuple(notes),
    )

    run_length = pick("run_length", dur)
    if not timedelta(0) < run_length <= MAX_RUN_LENGTH:
        raise ConfigError(f"--run-length {dur(run_length)}: must be longer than zero and at most "
                          f"{dur(MAX_RUN_LENGTH)}, e.g. 21d")
    steps = pick("steps_per_save", measured=obs.steps_per_save if obs else None, how=f"median step gap of {where}")
    ratio = pick("codec_ratio", lambda r: f"{r:.3g}", measured=obs.codec_ratio if obs else None,
                 how=f"original over stored bytes of the archive copies of job {obs.job}" if obs else "")
    hot_class = pick("hot_class", measured=obs.hot_class if obs else None, how=f"where job {obs.job}'s checkpoints live" if obs else "")
    if hot_class not in ALL_CLASSES:
        raise ConfigError(f"--hot-class {hot_class!r}: must be one of {', '.join(ALL_CLASSES)}")
    part = pick("part_size", lambda p: f"{p / (1 << 20):g} MiB")
    nights = simulate_storage(policy, size=total, interval=planned, steps_per_save=steps, run_length=run_length,
                              codec_ratio=ratio, hot_class=hot_class, prices=prices)
    scale = simulation_scale(run_length, planned, nights[-1].day)
    storage = forecast(nights, policy, policy_name, prices, size=total, ratio=ratio, ranks=ranks,
                        hot_class=hot_class, part=part, run_length=run_length, approximation=scale.note(planned))
    return Advice(obs.job if obs else None, sizing, bw, interval_advice, storage, tuple(assumptions))


def _decimal_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


def forecast(nights: Sequence[Night], policy: Policy, policy_name: str | None, prices: Prices, *, size: int,
             ratio: float, ranks: int, hot_class: str, part: int, run_length: timedelta,
             approximation: str | None = None) -> StorageForecast:
    """The :class:`StorageForecast` of ``nights`` (from :func:`simulate_storage` with the same
    ``policy``, ``size``, ``ratio`` as codec ratio and ``hot_class``): the last night's state and
    cost, requests for ``ranks`` objects per checkpoint uploaded in parts of ``part`` bytes, and
    costs over ``run_length``."""
    final = nights[-1]
    used = {hot_class} | {s.storage_class for n in nights for s in n.stored}
    # Requests: every save into an S3 hot class, every archive upload (new archive
    # checkpoints between nights) into its first class.
    saves_requests = final.saves * prices.puts(requests_for(size, ranks, part), hot_class) if hot_class != HOT else 0.0
    requests = saves_requests
    archived = [sum(s.checkpoints for s in n.stored if s.tier == "archive") for n in nights]
    s3_archive = bool(policy.archive and policy.archive.startswith("s3://"))
    first_class = (policy.storage_class or "STANDARD") if s3_archive else HOT
    if first_class != HOT and archived:
        requests += archived[-1] * prices.puts(requests_for(round(size / ratio), ranks, ARCHIVE_PART_SIZE), first_class)
        used.add(first_class)
    day_fraction = 86400 / MONTH_SECONDS
    months = run_length.total_seconds() / MONTH_SECONDS
    run_cost = sum(n.monthly_cost * n.days for n in nights) * day_fraction + requests
    keep_all_run = sum(n.keep_all_monthly_cost * n.days for n in nights) * day_fraction + saves_requests
    archive = [s for s in final.stored if s.tier == "archive"]
    restore = None
    if archive:
        coldest = archive[-1]
        restore = prices.read_back(coldest.bytes / coldest.checkpoints, ranks, coldest.storage_class)
    monthly = final.monthly_cost + (requests / months if months else 0.0)
    # Keep-all writes the same saves: their PUTs count on both sides of the comparison.
    keep_all_monthly = final.keep_all_monthly_cost + (saves_requests / months if months else 0.0)
    return StorageForecast(
        policy=policy_name or str(policy),
        saves=final.saves,
        nights=tuple(nights),
        final=final,
        peak_bytes=max(n.stored_bytes for n in nights),
        stored_fraction=final.stored_bytes / final.keep_all_bytes if final.keep_all_bytes else 0.0,
        monthly_cost=monthly,
        keep_all_monthly_cost=keep_all_monthly,
        cost_fraction=monthly / keep_all_monthly if keep_all_monthly else 0.0,
        requests_cost=requests,
        run_cost=run_cost,
        keep_all_run_cost=keep_all_run,
        restore_cost=restore,
        price_note=prices.note(used),
        prices_assumed=prices.assumed(used),
        currency=prices.currency,
        approximation=approximation,
    )
