"""``ckptier.toml``: retention policies, restore drills and the catalog URL.

Where the file is: the ``path`` argument, else ``$CKPTIER_CONFIG``, else
``./ckptier.toml``. An explicit path (argument or environment) that does not
exist is an error; an absent ``./ckptier.toml`` means the built-in defaults
(one policy for every job with the defaults below, no drills, no catalog URL).

Shape (every key optional unless said)::

    [catalog]
    url = "sqlite:////var/lib/ckptier/catalog.db"

    [[policy]]                    # tables are tried in order; first match wins
    jobs = "llama-*"              # fnmatch glob on the job name (default "*")
    keep_last = 3                 # newest N verified checkpoints
    keep_best = { metric = "eval_loss", mode = "min", n = 3 }   # or a list of such tables
    milestones = "log"            # 1, 2, 5, 10, 20, 50, ... steps, or
    # milestones = [1000, 5000]   #   an explicit list of steps, or
    # milestones = { every_n_steps = 10000, max_to_keep = 10 }   # (max_to_keep optional), or
    # milestones = { every = "6h" }   # the first save of each 6 hours of save time
    milestone_match = "at_or_after"   # a milestone is held by the first verified save at or
                                  # after it (default), or "exact": only a save on that step
    keep_within = "36h"           # verified ones saved within this of now (also "6mo", "1y")
    keep_hourly = 24              # newest verified of each of the last N hours
    keep_daily = 7                # newest verified of each of the last N days
    keep_weekly = 4               # newest verified of each of the last N weeks
    keep_monthly = 12             # newest verified of each of the last N months
    keep_yearly = 5               # newest verified of each of the last N years
    timezone = "UTC"              # whose calendar hours, days, weeks, months count in
    pinned = [12000]              # steps kept whatever happens
                                  # a table that sets none of these rules previews the
                                  # built-in DEFAULT_RULES (keep_last 3) and never deletes
    min_verified = 2              # floor of verified checkpoints in hot storage
    min_drilled = 1               # the newest N drill-passed checkpoints keep their hot copy (default 0)
    grace = "2h"                  # how long an incomplete save is "in flight"
    delete_stale_incomplete = false
    archive = "s3://bucket/archive"   # or a local path; milestones go there
    storage_class = "GLACIER_IR"      # needs an s3:// archive: the S3 class of every archived object
                                      # (GLACIER and DEEP_ARCHIVE need a restore before a fetch)
    hot_after_archive = "delete"      # or "keep"
    archive_after = "14d"             # needs archive: promote milestones once older than this
    archive_when = "leaving_hot"      # needs archive: promote a milestone only once no other rule
                                      # keeps it hot (never stored twice); default "immediately"
    max_missing_fraction = 0.5        # shrink guard, 0..1
    archive_tiers = [{ after = "30d", storage_class = "STANDARD_IA" }]   # by age, colder only

    [[pattern]]                   # checkpoints of a layout ckptier does not know; tried in order
    glob = "megatron/*/iter_*/**" # keys (relative to the scanned URL) the rule claims: * within a
                                  # path segment, ** across; must also match the commit marker
    step_regex = 'iter_(?P<step>\\d+)'   # searched in each key; the named group "step" is the step
                                  # (the checkpoint is the directory holding it; the job the one above)
    commit_marker = "COMMITTED"   # committed when this file exists in the checkpoint directory
    settle = "2min"               # and/or: committed once no file changed for this long
                                  # (at least one of the two; with both, both must hold)

    [[inventory]]                 # scans of url read this S3 Inventory report instead of listing
    url = "s3://ckpts/runs"
    report = "s3://inventory/ckpts/daily/"   # a manifest.json, or the configuration's folder (newest report)

    [[drill]]
    jobs = "*"
    model = "mypkg.models:build"  # "module:function" returning the model
    steps = 10
    device = "auto"               # "auto", "cpu" or "cuda"
    timeout = "15min"
    loss_tolerance = 0.05         # optional
    trajectory_rtol = 0.02        # optional; 0 for bit-exact
    allow_globals = ["mypkg.config.TrainConfig"]  # classes the safe loader may unpickle

    [runner]                      # where verify, promote and drill fetches fan out
    kind = "threads"              # threads in this process (default), or "dask":
    # workers = 4                 #   a local Dask cluster of N worker processes, or
    # address = "tcp://scheduler:8786"   # an existing Dask cluster (one of the two)
    claim_rows = false            # true: several ckptier processes share the catalog's work,
                                  # each claiming rows under a lease (PostgreSQL: SKIP LOCKED)
    lease = "2min"                # how long a claim holds without a heartbeat

    [prices]                      # $ per GB-month (GB = 2^30 bytes) per storage class
    source = "our rates, 2026-10" # printed next to figures that use these prices
    hot = 0.08                    # shorthand: the storage price only
    [prices.GLACIER_IR]           # or a table: storage, put, get, retrieval, restore, min_days
    storage = 0.004

Durations are a number and a unit (s, min, h, d, w; keep_within and
archive_after also mo and y), parts combinable: "1d12h"; a bare "m" is refused
(minutes or months?). See :mod:`ckptier.tasks.durations`.
Errors are one-line :class:`ConfigError` naming the file, the table (tables
are counted from 0: the first ``[[policy]]`` is ``policy[0]``), the key, the
value and the fix.
"""

from __future__ import annotations

import difflib
import fnmatch
import math
import os
import re
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, NoReturn, TypeVar

from ckptier.formats.allowlist import allow_global_check, is_library_global
from ckptier.formats.names import (  # noqa: F401 - re-exported: the rule lives with the safe loader
    UNSAFE_GLOBAL_MODULES,
    allow_global_problem,
    python2_alias,
    unsafe_global_reason,
)
from ckptier.storage.base import key_problem
from ckptier.storage.errors import ConfigError
from ckptier.formats.pattern import PatternRule
from ckptier.storage.s3 import storage_class_problem
from ckptier.storage.transitions import DEFAULT_GRACE
from ckptier.storage.url import parse_location, parse_url
from ckptier.tasks.prices import DEFAULT_CLASS_PRICES, DEFAULT_PRICES, FIELDS, ClassPrice, Prices
from ckptier.tasks.durations import Span, duration_problem, parse_duration, parse_span
from ckptier.tasks.retention import (
    ARCHIVE_WHENS,
    BEST_MODES,
    DEFAULT_MAX_MISSING_FRACTION,
    MILESTONE_MATCHES,
    RULE_NAMES,
    KeepBest,
    KeepDaily,
    KeepHourly,
    KeepLast,
    KeepMonthly,
    KeepWeekly,
    KeepWithin,
    KeepYearly,
    Milestones,
    Pinned,
    Policy,
    Rule,
    zone,
)
from ckptier.tasks.tiers import PRICEABLE_CLASSES, S3_CLASSES, ArchiveTier, archive_tiers_problem, class_problem

DEFAULT_FILE = "ckptier.toml"
ENV_VAR = "CKPTIER_CONFIG"

Device = Literal["auto", "cpu", "cuda"]

_POLICY_KEYS = frozenset(
    {
        "jobs", "keep_last", "milestones", "keep_within", "keep_daily", "keep_weekly",
        "pinned", "min_verified", "grace", "archive", "storage_class",
        "hot_after_archive", "max_missing_fraction", "delete_stale_incomplete",
        "milestone_match", "archive_after", "archive_when", "min_drilled",
        "keep_hourly", "keep_monthly", "keep_yearly", "keep_best", "timezone",
    }
)
_DRILL_KEYS = frozenset({"jobs", "model", "steps", "device", "timeout", "loss_tolerance", "trajectory_rtol",
                         "allow_globals", "require_gpu"})
_CATALOG_KEYS = frozenset({"url"})
_RUNNER_KEYS = frozenset({"kind", "workers", "address", "claim_rows", "lease"})
#: The task runners ``[runner] kind`` (and ``--runner``) may name.
RUNNER_KINDS = ("threads", "dask")
_POLICY_KEYS |= {"archive_tiers"}  # parsed by _archive_tiers
_PATTERN_KEYS = frozenset({"glob", "step_regex", "commit_marker", "settle"})
_Choice = TypeVar("_Choice", bound=str)

#: A restore drill's training steps and wall-clock limit when neither the
#: command line nor the job's ``[[drill]]`` sets them.
DEFAULT_DRILL_STEPS = 10
DEFAULT_DRILL_TIMEOUT = timedelta(minutes=15)

_TOP_KEYS = frozenset({"policy", "drill", "catalog", "pattern", "prices", "inventory", "runner"})
_INVENTORY_KEYS = frozenset({"url", "report"})
_MODEL_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
_FILE_MODEL_RE = re.compile(r"^[^:]+\.py:[A-Za-z_]\w*$")

def parse_factory_spec(spec: str) -> tuple[str, str]:
    """Split ``"module:function"`` (or ``"file.py:function"``); pure, and torch-free
    so that the drill's parent process can check a spec before spawning.

    Raises :class:`ConfigError` naming the value when it is malformed.
    """
    module, sep, func = spec.rpartition(":")
    if not sep or not module or not func.isidentifier():
        raise ConfigError(
            f"drill model {spec!r} is not of the form module:function; "
            "give e.g. mypkg.models:build_model or /path/to/models.py:build_model"
        )
    return module, func


@dataclass(frozen=True)
class DrillSettings:
    """One ``[[drill]]`` table: how to restore-drill the jobs matching ``jobs``.

    ``model`` is a ``"module:function"`` factory, ``steps`` the number of
    training steps to run (≥ 1), ``timeout`` the wall-clock limit of one
    drill, ``loss_tolerance`` (optional, > 0) the allowed relative difference
    between the first drill loss and the loss the checkpoint recorded;
    ``trajectory_rtol`` (optional, 0 for bit-exact) the allowed relative
    difference between each drill loss and the loss the run recorded at
    the same step (None: the default of :mod:`ckptier.tasks.drill_trajectory`).
    ``allow_globals`` are ``module.Name`` classes the safe loader may unpickle
    for these jobs (in file order, no duplicates), added to those given on the
    command line: plain data classes only (:mod:`ckptier.formats.allowlist`);
    standard-library, numpy and torch ones are checked when the file is
    loaded, the user's own modules when a drill starts.
    ``require_gpu``: whether a drill on device ``auto`` must find a GPU
    (True: fail without one; False: drill on CPU, saying so loudly; None,
    the default: required on ckptier's GPU work pool, not elsewhere;
    :func:`ckptier.tasks.drill_inputs.decide_device`).
    """

    jobs: str = "*"
    model: str = ""
    steps: int = DEFAULT_DRILL_STEPS
    device: Device = "auto"
    timeout: timedelta = DEFAULT_DRILL_TIMEOUT
    loss_tolerance: float | None = None
    allow_globals: tuple[str, ...] = ()
    trajectory_rtol: float | None = None
    require_gpu: bool | None = None


def drill_values(table: DrillSettings, *, steps: int | None, device: str | None,
                 timeout: float | None) -> tuple[int, str, float]:
    """The steps, device and timeout (seconds) a drill of a job under ``table`` (its
    ``[[drill]]``, or the defaults) runs with. A value asked for (``--steps``, a flow
    parameter) wins, except None and the built-in default itself (10 steps, device
    ``auto``, 15 minutes), which take the table's: the Prefect form shows the built-in
    values, and a run left at them drills each job as its ``[[drill]]`` says, on the
    command line and in a flow run alike."""
    k = steps if steps is not None and steps != DEFAULT_DRILL_STEPS else table.steps
    dev = device if device is not None and device != "auto" else table.device
    limit = (timeout if timeout is not None and timeout != DEFAULT_DRILL_TIMEOUT.total_seconds()
             else table.timeout.total_seconds())
    return k, dev, limit


#: The ``[[policy]]`` keys that state a retention rule; a table without any of
#: them (``jobs`` alone, say) is not a policy the user wrote (see ``Config.unwritten``).
RULE_KEYS = frozenset(RULE_NAMES)

#: The rules of a ``[[policy]]`` table that sets none of :data:`RULE_KEYS` (and of the
#: built-in policy when there is no table): ``plan`` previews them, saying so, and
#: ``apply`` never deletes under them. A table that sets any rule gets exactly its own
#: rules: no default is added (``keep_daily = 1`` alone keeps one per day, nothing more).
DEFAULT_RULES: tuple[Rule, ...] = (KeepLast(3),)


@dataclass(frozen=True)
class RunnerSettings:
    """``[runner]``: where the per-checkpoint work (verify, promote, drill fetch) runs.

    ``kind`` ``threads``: in this process (the default; verification reads
    on a pool of threads, promotions and drill fetches run one by one).
    ``dask``: a Dask cluster, either a local one of ``workers`` worker
    processes started for the run, or the existing one at ``address``
    (``tcp://host:8786``). ``claim_rows``: claim catalog rows under a lease
    of ``lease`` (kept alive by a heartbeat) so that several ckptier
    processes sharing one catalog each verify a disjoint part of it.
    """

    kind: str = "threads"
    workers: int | None = None
    address: str | None = None
    claim_rows: bool = False
    lease: timedelta = timedelta(minutes=2)


@dataclass(frozen=True)
class Config:
    """The parsed file. ``source`` is the file read, or None for built-in defaults.
    ``patterns``: the ``[[pattern]]`` rules every scan uses, in file order.

    ``unwritten`` holds the indexes (into ``policies``) of policies made of
    built-in defaults rather than rules the user wrote: the default policy
    when the file has no ``[[policy]]`` (or there is no file), and tables
    that set none of :data:`RULE_KEYS`. ``plan`` may preview with them;
    ``apply`` never deletes under them.
    """

    policies: tuple[Policy, ...] = ()
    drills: tuple[DrillSettings, ...] = ()
    catalog_url: str | None = None
    source: Path | None = None
    prices: Prices = DEFAULT_PRICES
    patterns: tuple[PatternRule, ...] = ()
    #: ``[[inventory]]``: scanned s3:// URL (canonical) -> its S3 Inventory report
    #: (a manifest.json URL or the inventory configuration's folder).
    inventories: tuple[tuple[str, str], ...] = ()
    unwritten: frozenset[int] = frozenset()
    runner: RunnerSettings = RunnerSettings()

    def policy_for(self, job: str) -> Policy | None:
        """The first ``[[policy]]`` (in file order) whose ``jobs`` glob matches ``job``.

        None when no table matches: the caller must then delete nothing.
        Matching is case-sensitive ``fnmatch``.
        """
        for p in self.policies:
            if fnmatch.fnmatchcase(job, p.jobs):
                return p
        return None

    def drill_for(self, job: str) -> DrillSettings | None:
        """The first ``[[drill]]`` whose ``jobs`` glob matches ``job``, or None."""
        for d in self.drills:
            if fnmatch.fnmatchcase(job, d.jobs):
                return d
        return None


def policy_grace(config: Config | None) -> Callable[[str], timedelta]:
    """A job's ``grace`` (how long a save may be in flight): its ``[[policy]]``'s, else 2 h."""
    def grace_for(job: str) -> timedelta:
        policy = config.policy_for(job) if config is not None else None
        return policy.grace if policy is not None else DEFAULT_GRACE

    return grace_for


def default_policy() -> Policy:
    """The built-in policy: :data:`DEFAULT_RULES` (keep the 3 newest verified), every other setting default."""
    return Policy(rules=DEFAULT_RULES)


def default_config() -> Config:
    return Config(policies=(default_policy(),), unwritten=frozenset({0}))


# ------------------------------------------------------------------ validation


class _Table:
    """Typed access to one TOML table, producing one-line errors."""

    def __init__(self, where: str, name: str, data: dict[str, Any], allowed: frozenset[str]) -> None:
        self.where = where  # file name, for messages
        self.name = name  # e.g. "policy[1]"
        self.data = data
        for key in data:
            if key not in allowed:
                close = difflib.get_close_matches(key, sorted(allowed), n=1)
                hint = f"did you mean {close[0]}? " if close else ""
                self.fail(key, data[key], f"unknown key; {hint}known keys: {', '.join(sorted(allowed))}")

    def fail(self, key: str, value: Any, fix: str) -> NoReturn:
        raise ConfigError(f"{self.where}: {self.name}.{key} = {_show(value)}: {fix}")

    def has(self, key: str) -> bool:
        return key in self.data

    def get_int(self, key: str, default: int, *, minimum: int = 0, example: int = 3) -> int:
        v = self.data.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(key, v, f"must be a whole number, e.g. {key} = {example}")
        if v < minimum:
            self.fail(key, v, f"must be ≥ {minimum}, e.g. {key} = {example}")
        return int(v)

    def get_float(self, key: str, default: float | None, *, lo: float, hi: float | None, example: float) -> float | None:
        v = self.data.get(key, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.fail(key, v, f"must be a number, e.g. {key} = {example}")
        rng = f"between {lo} and {hi}" if hi is not None else f"> {lo}"
        if v != v or v < lo or (hi is not None and v > hi) or (hi is None and v <= lo):
            self.fail(key, v, f"must be {rng}, e.g. {key} = {example}")
        return float(v)

    def get_bool(self, key: str, default: bool) -> bool:
        v = self.data.get(key, default)
        if not isinstance(v, bool):
            self.fail(key, v, f"must be true or false, e.g. {key} = true")
        return bool(v)

    def get_str(self, key: str, default: str | None, *, example: str) -> str | None:
        v = self.data.get(key, default)
        if v is None:
            return None
        if not isinstance(v, str) or not v.strip():
            self.fail(key, v, f"must be a non-empty string, e.g. {key} = {example!r}")
        return str(v)

    def get_duration(self, key: str, default: str | None, *, positive: bool, example: str) -> timedelta | None:
        """A fixed duration (units s, min, h, d, w: see :mod:`ckptier.tasks.durations`)."""
        v = self.data.get(key, default)
        if v is None:
            return None
        if (problem := duration_problem(v, example=example)) is not None:
            self.fail(key, v, problem)
        d = parse_duration(str(v))
        if positive and d <= timedelta(0):
            self.fail(key, v, f"must be longer than zero, e.g. {example!r}")
        return d

    def get_span(self, key: str, *, example: str) -> Span | None:
        """A duration measured back on the calendar: the fixed units plus mo and y; > 0."""
        v = self.data.get(key)
        if v is None:
            return None
        if (problem := duration_problem(v, calendar_units=True, example=example)) is not None:
            self.fail(key, v, problem)
        span = parse_span(str(v))
        if not span.is_positive():
            self.fail(key, v, f"must be longer than zero, e.g. {example!r}")
        return span

    def get_choice(self, key: str, default: _Choice, choices: tuple[_Choice, ...]) -> _Choice:
        v = self.data.get(key, default)
        for choice in choices:
            if v == choice:
                return choice
        self.fail(key, v, "must be " + " or ".join(f'"{c}"' for c in choices))

    def get_glob(self, key: str = "jobs") -> str:
        v = self.data.get(key, "*")
        if not isinstance(v, str) or not v.strip():
            self.fail(key, v, f"must be a non-empty glob of job names, e.g. {key} = 'llama-*'")
        problem = _glob_problem(v)
        if problem:
            self.fail(key, v, f"{problem}, e.g. {key} = 'llama-*'")
        return str(v)

    def get_steps(self, key: str) -> tuple[int, ...] | None:
        v = self.data.get(key)
        if v is None:
            return None
        if not isinstance(v, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in v):
            self.fail(key, v, f"must be a list of whole step numbers, e.g. {key} = [1000, 5000]")
        if any(s < 0 for s in v):
            self.fail(key, v, f"step numbers must be ≥ 0, e.g. {key} = [1000, 5000]")
        return tuple(v)


def _show(value: Any) -> str:
    """A value as it would look in TOML (close enough for a message)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _glob_problem(pattern: str) -> str | None:
    """Why ``pattern`` is not a usable job glob, or None (fnmatch would silently
    read an unclosed ``[`` as a literal, which is almost never what was meant)."""
    if pattern != pattern.strip():
        return "has leading or trailing spaces"
    i = 0
    while i < len(pattern):
        if pattern[i] == "[":
            j = i + 1
            if j < len(pattern) and pattern[j] == "!":
                j += 1
            if j < len(pattern) and pattern[j] == "]":
                j += 1
            end = pattern.find("]", j)
            if end == -1:
                return "has a '[' with no closing ']' (write '[[]' for a literal '[')"
            i = end
        i += 1
    return None


def _archive_problem(url: str) -> str | None:
    """Why ``url`` cannot be opened as the archive store, or None (no I/O)."""
    try:
        parse_url(url)
    except ConfigError as exc:
        return str(exc)
    return None


_MILESTONE_SHAPES = ('use "log", a list of steps like [1000, 5000], { every_n_steps = 10000 } '
                     '(optionally with max_to_keep = 10), or { every = "6h" } (one per interval of save time)')


def _milestones(t: _Table, tz: str) -> Milestones | None:
    match = t.get_choice("milestone_match", "at_or_after", MILESTONE_MATCHES)
    if not t.has("milestones"):
        if t.has("milestone_match"):
            t.fail("milestone_match", match, "has no effect without milestones: set milestones or remove it")
        return None
    v = t.data["milestones"]
    if isinstance(v, str):
        if v != "log":
            t.fail("milestones", v, _MILESTONE_SHAPES)
        return Milestones(log=True, match=match)
    if isinstance(v, list):
        steps = t.get_steps("milestones")
        if not steps:
            t.fail("milestones", v, "an empty list keeps nothing; omit the key for no milestones")
        return Milestones(steps=steps or (), match=match)
    if not isinstance(v, dict):
        t.fail("milestones", v, _MILESTONE_SHAPES)
    cap = v.get("max_to_keep")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        t.fail("milestones", v, "max_to_keep must be a whole number ≥ 1, e.g. { every_n_steps = 10000, max_to_keep = 10 }")
    if set(v) in ({"every_n_steps"}, {"every_n_steps", "max_to_keep"}):
        n = v["every_n_steps"]
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            t.fail("milestones", v, "every_n_steps must be a whole number > 0, e.g. { every_n_steps = 10000 }")
        return Milestones(every=int(n), match=match, max_to_keep=cap)
    if set(v) in ({"every"}, {"every", "max_to_keep"}):
        every = v["every"]
        problem = duration_problem(every, example="6h")
        if problem is not None:
            t.fail("milestones", v, f"every = {_show(every)}: {problem} (one milestone per interval of save "
                                    f"time); for steps write {{ every_n_steps = {_show(every)} }}")
        interval = parse_duration(str(every))
        if interval < timedelta(seconds=1):
            t.fail("milestones", v, 'every must be at least 1s, e.g. { every = "6h" }')
        if t.has("milestone_match") and match != "at_or_after":
            t.fail("milestone_match", match, 'milestones every holds the first save of each interval: remove milestone_match')
        return Milestones(interval=interval, timezone=tz, max_to_keep=cap)
    t.fail("milestones", v, _MILESTONE_SHAPES)


_BEST_KEYS = frozenset({"metric", "mode", "n", "keep_without_metric"})
_BEST_EXAMPLE = 'keep_best = { metric = "eval_loss", mode = "min", n = 3 }'


def _keep_best(t: _Table) -> list[KeepBest]:
    """``keep_best``: one table, or a list of tables for several metrics."""
    if not t.has("keep_best"):
        return []
    v = t.data["keep_best"]
    tables = v if isinstance(v, list) else [v]
    if not tables or not all(isinstance(e, dict) for e in tables):
        t.fail("keep_best", v, f"must be a table or a list of tables, e.g. {_BEST_EXAMPLE}")
    out: list[KeepBest] = []
    for i, e in enumerate(tables):
        where = f"entry {i}: " if isinstance(v, list) else ""
        unknown = sorted(set(e) - _BEST_KEYS)
        if unknown:
            t.fail("keep_best", v, f"{where}unknown key {unknown[0]}; known keys: {', '.join(sorted(_BEST_KEYS))}")
        metric, mode, n = e.get("metric"), e.get("mode", "min"), e.get("n")
        if not isinstance(metric, str) or not metric.strip():
            t.fail("keep_best", v, f"{where}metric must name the metric, e.g. {_BEST_EXAMPLE}")
        if mode not in BEST_MODES:
            t.fail("keep_best", v, f"{where}mode must be \"min\" (a loss) or \"max\" (an accuracy), e.g. {_BEST_EXAMPLE}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            t.fail("keep_best", v, f"{where}n must be a whole number ≥ 1, e.g. {_BEST_EXAMPLE}")
        keep = e.get("keep_without_metric", True)
        if not isinstance(keep, bool):
            t.fail("keep_best", v, f"{where}keep_without_metric must be true or false")
        out.append(KeepBest(metric=str(metric), mode=mode, n=int(n), keep_without_metric=keep))
    return out


def _policy(where: str, index: int, data: Any) -> Policy:
    name = f"policy[{index}]"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {name} must be a table ([[policy]]), got {_show(data)}")
    t = _Table(where, name, data, _POLICY_KEYS)
    jobs = t.get_glob()
    tz = t.get_str("timezone", "UTC", example="Europe/Berlin") or "UTC"
    try:
        zone(tz)
    except ConfigError:
        t.fail("timezone", tz, 'not a time zone the system knows; write an IANA name such as "UTC" or "Europe/Berlin"')
    rules: list[Rule] = []
    keep_last = t.get_int("keep_last", 0, example=3)
    if keep_last:
        rules.append(KeepLast(keep_last))
    rules.extend(_keep_best(t))
    m = _milestones(t, tz)
    if m is not None:
        rules.append(m)
    within = t.get_span("keep_within", example="36h")
    if within is not None:
        rules.append(KeepWithin(within if within.months else within.fixed, timezone=tz))
    for key, cls, example in (("keep_hourly", KeepHourly, 24), ("keep_daily", KeepDaily, 7),
                              ("keep_weekly", KeepWeekly, 4), ("keep_monthly", KeepMonthly, 12),
                              ("keep_yearly", KeepYearly, 5)):
        n = t.get_int(key, 0, example=example)
        if n:
            rules.append(cls(n, timezone=tz))
    pinned = t.get_steps("pinned")
    if pinned:
        rules.append(Pinned(pinned))
    if not RULE_KEYS & set(data):
        rules = list(DEFAULT_RULES)  # a table with no rule: previewed only (Config.unwritten)
    elif not rules:
        raise ConfigError(
            f"{where}: {name} (jobs = {_show(jobs)}) keeps nothing: set keep_last ≥ 1, or one of "
            f"{', '.join(k for k in RULE_NAMES if k != 'keep_last')}"
        )
    archive = t.get_str("archive", None, example="s3://bucket/archive")
    if archive is not None and (problem := _archive_problem(archive)):
        t.fail("archive", archive, problem)
    storage_class = t.get_str("storage_class", None, example="GLACIER_IR")
    if storage_class is not None and archive is None:
        t.fail("storage_class", storage_class, "has no effect without archive: set archive or remove storage_class")
    if storage_class is not None and (problem := storage_class_problem(storage_class)) is not None:
        t.fail("storage_class", storage_class, problem)
    if storage_class is not None and archive is not None and parse_url(archive).scheme != "s3":
        t.fail("storage_class", storage_class, f"applies to s3:// archives only, and archive = {_show(archive)} is local")
    hot = t.data.get("hot_after_archive", "delete")
    if hot not in ("delete", "keep"):
        t.fail("hot_after_archive", hot, "must be \"delete\" or \"keep\"")
    archive_after = t.get_span("archive_after", example="14d")
    archive_when = t.get_choice("archive_when", "immediately", ARCHIVE_WHENS)
    for key in ("archive_after", "archive_when"):
        if t.has(key) and archive is None:
            t.fail(key, t.data[key], "has no effect without archive: set archive or remove " + key)
    grace = t.get_duration("grace", "2h", positive=False, example="2h")
    fraction = t.get_float("max_missing_fraction", None, lo=0.0, hi=1.0, example=0.5)
    archive_tiers = _archive_tiers(t, archive, storage_class)
    return Policy(
        rules=tuple(rules),
        jobs=jobs,
        grace=grace if grace is not None else timedelta(hours=2),
        min_verified=t.get_int("min_verified", 2, example=2),
        archive=archive,
        storage_class=storage_class,
        hot_after_archive=hot,
        max_missing_fraction=fraction if fraction is not None else DEFAULT_MAX_MISSING_FRACTION,
        delete_stale_incomplete=t.get_bool("delete_stale_incomplete", False),
        archive_tiers=archive_tiers,
        archive_after=None if archive_after is None else archive_after if archive_after.months else archive_after.fixed,
        archive_when=archive_when,
        min_drilled=t.get_int("min_drilled", 0, example=1),
        timezone=tz,
    )


def _drill(where: str, index: int, data: Any) -> DrillSettings:
    name = f"drill[{index}]"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {name} must be a table ([[drill]]), got {_show(data)}")
    t = _Table(where, name, data, _DRILL_KEYS)
    jobs = t.get_glob()
    # No model: Hugging Face checkpoints are built from their config.json; other
    # formats then fail their drill asking for one.
    model = (t.get_str("model", None, example="mypkg.models:build") if t.has("model") else None) or ""
    if model and not (_MODEL_RE.match(model) or _FILE_MODEL_RE.match(model)):
        t.fail("model", model, "must be \"module:function\" or \"/path/to/file.py:function\", e.g. model = \"mypkg.models:build\"")
    device = t.data.get("device", "auto")
    if device not in ("auto", "cpu", "cuda"):
        t.fail("device", device, "must be \"auto\", \"cpu\" or \"cuda\"")
    timeout = t.get_duration("timeout", None, positive=True, example="15min")
    allow = t.data.get("allow_globals", [])
    if not isinstance(allow, list):
        t.fail("allow_globals", allow, "must be a list of module.Name strings, e.g. allow_globals = [\"mypkg.config.TrainConfig\"]")
    for entry in allow:
        if (problem := allow_global_problem(entry)) is None and isinstance(entry, str):
            # Standard-library, numpy and torch classes are judged now; the user's own
            # modules are imported only by the drill, in its isolated processes.
            problem = allow_global_check(entry) if is_library_global(entry) else None
        if problem is not None:
            t.fail("allow_globals", allow, f"entry {_show(entry)}: {problem}")
    return DrillSettings(
        jobs=jobs,
        model=model,
        steps=t.get_int("steps", DEFAULT_DRILL_STEPS, minimum=1, example=10),
        device=device,
        timeout=timeout if timeout is not None else DEFAULT_DRILL_TIMEOUT,
        loss_tolerance=t.get_float("loss_tolerance", None, lo=0.0, hi=None, example=0.05),
        allow_globals=tuple(dict.fromkeys(allow)),
        trajectory_rtol=t.get_float("trajectory_rtol", None, lo=0.0, hi=10.0, example=0.02),
        require_gpu=t.get_bool("require_gpu", False) if t.has("require_gpu") else None,
    )


def _pattern(where: str, index: int, data: Any) -> PatternRule:
    name = f"pattern[{index}]"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {name} must be a table ([[pattern]]), got {_show(data)}")
    t = _Table(where, name, data, _PATTERN_KEYS)
    for key, example in (("glob", "megatron/*/iter_*/**"), ("step_regex", "iter_(?P<step>\\d+)")):
        if not t.has(key):
            raise ConfigError(f"{where}: {name}.{key} is missing: add it, e.g. {key} = '{example}'")
    glob = t.get_str("glob", None, example="megatron/*/iter_*/**") or ""
    if (problem := _glob_problem(glob)) is not None:
        t.fail("glob", glob, f"{problem}, e.g. glob = 'megatron/*/iter_*/**'")
    step_regex = t.get_str("step_regex", None, example="iter_(?P<step>\\d+)") or ""
    try:
        named = "step" in re.compile(step_regex).groupindex
    except re.error as exc:
        t.fail("step_regex", step_regex, f"not a regular expression ({exc}); e.g. step_regex = 'iter_(?P<step>\\d+)'")
        raise  # unreachable: fail raises
    if not named:
        t.fail("step_regex", step_regex, "capture the step in a group named step, e.g. step_regex = 'iter_(?P<step>\\d+)'")
    marker = t.get_str("commit_marker", None, example="COMMITTED")
    if marker is not None and (problem := key_problem(marker)) is not None:
        t.fail("commit_marker", marker, f"{problem}; name a file inside the checkpoint directory, e.g. 'COMMITTED'")
    settle = t.get_duration("settle", None, positive=True, example="2min")
    if marker is None and settle is None:
        raise ConfigError(
            f"{where}: {name} (glob = {_show(glob)}) has no commit evidence: set commit_marker (a file the "
            f"trainer writes last), settle (e.g. settle = '2min') or both"
        )
    try:
        return PatternRule(glob, step_regex, settle.total_seconds() if settle else 0.0, commit_marker=marker)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {name}: {exc}") from None


def _array_of_tables(where: str, doc: dict[str, Any], key: str) -> list[Any]:
    v = doc.get(key, [])
    if not isinstance(v, list):
        raise ConfigError(f"{where}: {key} must be an array of tables: write [[{key}]], not [{key}]")
    return v


def parse_config(text: str, *, where: str = DEFAULT_FILE) -> Config:
    """Parse and validate the text of a ``ckptier.toml``. ``where`` names it in errors.

    A file with no ``[[policy]]`` table gets the built-in default policy; a leading UTF-8
    byte order mark is ignored.
    """
    text = text.removeprefix("\ufeff")  # a UTF-8 byte order mark, as Windows editors write one
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: not valid TOML ({exc}); fix the syntax") from exc
    for key in doc:
        if key not in _TOP_KEYS:
            raise ConfigError(
                f"{where}: unknown top-level key {key!r} = {_show(doc[key])}: "
                f"use [[policy]], [[drill]], [[pattern]], [catalog], [runner] or [prices]"
            )
    policies = tuple(_policy(where, i, d) for i, d in enumerate(_array_of_tables(where, doc, "policy")))
    drills = tuple(_drill(where, i, d) for i, d in enumerate(_array_of_tables(where, doc, "drill")))
    patterns = tuple(_pattern(where, i, d) for i, d in enumerate(_array_of_tables(where, doc, "pattern")))
    inventories = tuple(_inventory(where, i, d) for i, d in enumerate(_array_of_tables(where, doc, "inventory")))
    catalog_url = None
    if "catalog" in doc:
        cat = doc["catalog"]
        if not isinstance(cat, dict):
            raise ConfigError(f"{where}: catalog must be a table: write [catalog] then url = \"...\"")
        catalog_url = _Table(where, "catalog", cat, _CATALOG_KEYS).get_str(
            "url", None, example="sqlite:////var/lib/ckptier/catalog.db"
        )
    runner = parse_runner(doc.get("runner"), where=where)
    tables = _array_of_tables(where, doc, "policy")
    unwritten = {i for i, d in enumerate(tables) if not RULE_KEYS & set(d)} if policies else {0}
    return Config(
        policies=policies or (default_policy(),),
        drills=drills,
        catalog_url=catalog_url,
        prices=parse_prices(doc.get("prices"), where=where),
        patterns=patterns,
        inventories=inventories,
        unwritten=frozenset(unwritten),
        runner=runner,
    )


def _inventory(where: str, index: int, data: Any) -> tuple[str, str]:
    """One ``[[inventory]]`` table: scans of ``url`` read the S3 Inventory ``report``."""
    name = f"inventory[{index}]"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {name} must be a table with url and report")
    t = _Table(where, name, data, _INVENTORY_KEYS)
    url = t.get_str("url", None, example="s3://ckpts/runs")
    report = t.get_str("report", None, example="s3://inventory/ckpts/daily/")
    if url is None or report is None:
        t.fail("url" if url is None else "report", None,
               "both url (the s3:// URL scanned) and report (its S3 Inventory manifest.json or the "
               "inventory configuration's folder) are required")
    assert url is not None and report is not None
    for key, value in (("url", url), ("report", report)):
        try:
            parsed = parse_url(value)
        except ConfigError as exc:
            t.fail(key, value, str(exc))
        if parsed.scheme != "s3":
            t.fail(key, value, "must be an s3:// URL (only S3 buckets have inventory reports)")
    return parse_url(url).url, report


def parse_runner(data: Any, *, where: str = DEFAULT_FILE) -> RunnerSettings:
    """The ``[runner]`` table (None: the defaults, threads in this process)."""
    if data is None:
        return RunnerSettings()
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: runner must be a table: write [runner] then kind = \"dask\"")
    t = _Table(where, "runner", data, _RUNNER_KEYS)
    kind = t.get_choice("kind", "threads", RUNNER_KINDS)
    workers = t.get_int("workers", 1, minimum=1, example=4) if t.has("workers") else None
    address = t.get_str("address", None, example="tcp://scheduler:8786")
    if address is not None and not re.match(r"^(tcp|tls|inproc|ucx)://\S+$", address):
        t.fail("address", address, "must be a Dask scheduler address, e.g. address = 'tcp://scheduler:8786'")
    if kind == "threads" and address is not None:
        t.fail("address", address, 'needs kind = "dask" (threads run in this process)')
    if workers is not None and address is not None:
        t.fail("workers", workers, "give workers (a local Dask cluster) or address (an existing one), not both")
    lease = t.get_duration("lease", "2min", positive=True, example="2min")
    assert lease is not None  # has a default
    if lease < timedelta(seconds=1):
        t.fail("lease", data.get("lease"), "must be at least 1s, e.g. lease = '2min'")
    return RunnerSettings(kind=kind, workers=workers, address=address,
                          claim_rows=t.get_bool("claim_rows", False), lease=lease)


def location_overlap(archive: str, hot: str) -> str | None:
    """How the archive location ``archive`` overlaps the hot location ``hot``:
    ``"equals"``, ``"contains"``, ``"lies inside"``, or None when they are
    apart. Pure: the URLs are parsed (:func:`parse_url`; ``hot`` may be a
    catalog location, :func:`parse_location`), never opened;
    paths are compared component by component (``/a/b`` is not inside
    ``/a/bc``), S3 locations only within one bucket. Raises
    :class:`ConfigError` for a malformed URL.
    """
    a, h = parse_url(archive), parse_location(hot)
    if a.scheme != h.scheme or a.bucket != h.bucket:
        return None
    sep = "/"
    ap = [p for p in (a.path if a.scheme == "file" else a.prefix).split(sep) if p]
    hp = [p for p in (h.path if h.scheme == "file" else h.prefix).split(sep) if p]
    if ap == hp:
        return "equals"
    if hp[: len(ap)] == ap:
        return "contains"
    if ap[: len(hp)] == hp:
        return "lies inside"
    return None


def check_archive_locations(config: Config, hot_locations: Iterable[str]) -> None:
    """Refuse a ``[[policy]]`` archive that equals, contains or lies inside a
    hot location (a URL scanned for checkpoints), with one line naming both.

    Local paths are compared after resolving symlinks, so two spellings of
    one directory are caught. An archive there would be scanned as hot
    checkpoints (and deleted by retention), or hold hot checkpoints the
    janitor and the archive tier would treat as their own.
    """
    where = str(config.source) if config.source is not None else DEFAULT_FILE
    hots = sorted(set(hot_locations))
    for index, policy in enumerate(config.policies):
        if not policy.archive:
            continue
        archive = _resolved(policy.archive)
        for hot in hots:
            how = location_overlap(archive, _resolved(hot, hots))
            if how is not None:
                raise ConfigError(
                    f"{where}: policy[{index}].archive = {_show(policy.archive)} {how} the hot location {hot} "
                    f"(scanned for checkpoints); put the archive outside every scanned location, "
                    f"e.g. a sibling directory or another bucket"
                )


def _resolved(url: str, roots: Iterable[str] = ()) -> str:
    """``url`` with a local path's symlinks resolved (S3 URLs unchanged); a catalog location
    below one of ``roots`` is split there, its key never URL-decoded (:func:`parse_location`)."""
    parsed = parse_location(url, roots)
    return os.path.realpath(parsed.path) if parsed.scheme == "file" else url


def load_config(path: str | Path | None = None) -> Config:
    """Read ``ckptier.toml`` (see the module docstring for where it is looked for).

    Raises :class:`ConfigError` when an explicit path is missing or unreadable
    or the file is invalid. Reading is the only I/O; the result is immutable.
    """
    explicit = path if path is not None else os.environ.get(ENV_VAR) or None
    file = Path(explicit) if explicit is not None else Path(DEFAULT_FILE)
    if file.is_dir():
        origin = "" if path is not None or explicit is None else f" (from ${ENV_VAR})"
        raise ConfigError(f"config file {str(file)!r}{origin} is a directory; give the file itself, "
                          f"e.g. {str(file / DEFAULT_FILE)!r}")
    if not file.is_file():
        if explicit is None:
            return default_config()
        origin = "" if path is not None else f" (from ${ENV_VAR})"
        raise ConfigError(f"config file {str(file)!r}{origin} does not exist: fix the path or create it")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {str(file)!r} cannot be read ({exc}): check its permissions and encoding") from exc
    cfg = parse_config(text, where=str(file))
    return replace(cfg, source=file)


# ------------------------------------------------------------ tiers and prices


def _archive_tiers(t: _Table, archive: str | None, storage_class: str | None) -> tuple[ArchiveTier, ...]:
    """``archive_tiers = [{ after = "30d", storage_class = "STANDARD_IA" }, ...]``: the
    classes archive copies move to by age (whole days, later and colder each time)."""
    if not t.has("archive_tiers"):
        return ()
    v = t.data["archive_tiers"]
    example = 'archive_tiers = [{ after = "30d", storage_class = "STANDARD_IA" }, { after = "90d", storage_class = "GLACIER_IR" }]'
    if archive is None:
        t.fail("archive_tiers", v, "has no effect without archive: set archive or remove archive_tiers")
    if archive is not None and not archive.startswith("s3://"):
        t.fail("archive_tiers", v, f"storage classes need an S3 archive, and archive = {_show(archive)} is local; remove archive_tiers")
    if not isinstance(v, list) or not v or not all(isinstance(e, dict) for e in v):
        t.fail("archive_tiers", v, f"must be a non-empty list of {{ after, storage_class }} tables, e.g. {example}")
    tiers: list[ArchiveTier] = []
    for i, entry in enumerate(v):
        if set(entry) != {"after", "storage_class"}:
            t.fail("archive_tiers", v, f"entry {i} must have exactly the keys after and storage_class, e.g. {example}")
        after, cls = entry["after"], entry["storage_class"]
        try:
            d = parse_duration(after) if isinstance(after, str) else None
        except ConfigError:
            d = None
        if d is None or d <= timedelta(0) or d % timedelta(days=1):
            t.fail("archive_tiers", v, f"entry {i}: after = {_show(after)} must be a whole number of days > 0, e.g. \"30d\"")
        if (problem := class_problem(cls, allowed=S3_CLASSES[1:])) is not None:
            t.fail("archive_tiers", v, f"entry {i}: storage_class = {_show(cls)} {problem}")
        tiers.append(ArchiveTier(after=d, storage_class=cls))
    if (problem := archive_tiers_problem(tiers, storage_class)) is not None:
        t.fail("archive_tiers", v, problem)
    return tuple(tiers)


def parse_prices(data: Any, *, where: str = DEFAULT_FILE) -> Prices:
    """The ``[prices]`` table: per storage class, either a number (the storage
    price, $ per GB-month) or a table of :data:`~ckptier.tasks.prices.FIELDS`.
    Classes and fields not given keep ckptier's list-price defaults; ``source``
    (default: the file's name) labels the figures computed from given ones.
    None (no table) gives the defaults. Errors are one-line :class:`ConfigError`.
    """
    if data is None:
        return DEFAULT_PRICES
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: prices must be a table: write [prices] then e.g. GLACIER_IR = 0.004")
    t = _Table(where, "prices", data, frozenset({"currency", "source", *PRICEABLE_CLASSES}))
    source = t.get_str("source", f"{where} [prices]", example="our negotiated rates, 2026-10") or where
    currency = t.get_str("currency", "USD", example="USD") or "USD"
    classes = dict(DEFAULT_CLASS_PRICES)
    for cls in PRICEABLE_CLASSES:
        if not t.has(cls):
            continue
        v = t.data[cls]
        given = {"storage": v} if not isinstance(v, dict) else dict(v)
        sub = _Table(where, f"prices.{cls}", given, frozenset(FIELDS))
        base = DEFAULT_CLASS_PRICES.get(cls)
        if base is None and "storage" not in given:
            raise ConfigError(f"{where}: prices.{cls} has no built-in price: give its storage price ($ per GB-month), e.g. {cls} = 0.01")
        values: dict[str, Any] = {}
        for name in FIELDS:
            if name not in given:
                continue
            x = given[name]
            label = f"{cls}.{name}" if isinstance(v, dict) else cls
            if name == "min_days":
                values[name] = sub.get_int(name, 0, example=30)
            elif isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
                t.fail(label, x, f"must be a price ≥ 0 in {currency} (storage per GB-month, put/get/restore per 1,000 requests, retrieval per GB), e.g. 0.004")
            else:
                values[name] = float(x)
        unset = tuple(n for n in FIELDS if n not in given and base is not None and getattr(base, n))
        start = base if base is not None else ClassPrice(storage=0.0)
        classes[cls] = replace(start, **values, source=source, defaulted=unset)
    return Prices(classes=classes, currency=currency)
