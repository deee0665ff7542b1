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
    keep_last = 3                 # newest N verified checkpoints (default 3)
    milestones = "log"            # 1, 2, 5, 10, 20, 50, ... steps, or
    # milestones = [1000, 5000]   #   an explicit list of steps, or
    # milestones = { every_n_steps = 10000 }
    keep_within = "36h"           # verified ones saved within this of now
    keep_daily = 7                # newest verified of each of the last N days
    keep_weekly = 4               # newest verified of each of the last N weeks
    pinned = [12000]              # steps kept whatever happens
    min_verified = 2              # floor of verified checkpoints in hot storage
    grace = "2h"                  # how long an incomplete save is "in flight"
    delete_stale_incomplete = false
    archive = "s3://bucket/archive"   # or a local path; milestones go there
    storage_class = "GLACIER_IR"      # needs archive
    hot_after_archive = "delete"      # or "keep"
    max_missing_fraction = 0.5        # shrink guard, 0..1

    [[drill]]
    jobs = "*"
    model = "mypkg.models:build"  # "module:function" returning the model
    steps = 10
    device = "auto"               # "auto", "cpu" or "cuda"
    timeout = "15m"
    loss_tolerance = 0.05         # optional
    allow_globals = ["mypkg.config.TrainConfig"]  # classes the safe loader may unpickle

Durations are a number and a unit (s, m, h, d, w), parts combinable: "1d12h".
Errors are one-line :class:`ConfigError` naming the file, the table (tables
are counted from 0: the first ``[[policy]]`` is ``policy[0]``), the key, the
value and the fix.
"""

from __future__ import annotations

import difflib
import fnmatch
import os
import re
import tomllib
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from ckptier.storage.errors import ConfigError
from ckptier.storage.url import parse_url
from ckptier.tasks.retention import (
    KeepDaily,
    KeepLast,
    KeepWeekly,
    KeepWithin,
    Milestones,
    Pinned,
    Policy,
    Rule,
    parse_duration,
)

DEFAULT_FILE = "ckptier.toml"
ENV_VAR = "CKPTIER_CONFIG"

Device = Literal["auto", "cpu", "cuda"]

_POLICY_KEYS = frozenset(
    {
        "jobs", "keep_last", "milestones", "keep_within", "keep_daily", "keep_weekly",
        "pinned", "min_verified", "grace", "archive", "storage_class",
        "hot_after_archive", "max_missing_fraction", "delete_stale_incomplete",
    }
)
_DRILL_KEYS = frozenset({"jobs", "model", "steps", "device", "timeout", "loss_tolerance", "allow_globals"})
_CATALOG_KEYS = frozenset({"url"})
_TOP_KEYS = frozenset({"policy", "drill", "catalog"})
_MODEL_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
_FILE_MODEL_RE = re.compile(r"^[^:]+\.py:[A-Za-z_]\w*$")
_GLOBAL_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")

UNSAFE_GLOBAL_MODULES = frozenset(
    {
        "builtins", "os", "posix", "nt", "sys", "subprocess", "io", "_io", "shutil", "socket", "ctypes",
        "importlib", "runpy", "pickle", "_pickle", "marshal", "code", "codeop", "pty", "signal", "operator",
        "functools", "types", "tempfile", "zipfile", "tarfile", "gzip", "bz2", "lzma", "logging", "sqlite3",
        "multiprocessing", "threading", "webbrowser", "pdb", "inspect",
    }
)
"""Top-level modules whose objects can run commands, import code or open
files when a pickle calls them: never allowlisted for unpickling."""


def allow_global_problem(name: object) -> str | None:
    """Why ``name`` cannot be an allowlisted global (``--allow-global`` /
    ``allow_globals``), or None; pure (nothing is imported).

    It must be a dotted ``module.Name`` and its top-level module must not be
    one of :data:`UNSAFE_GLOBAL_MODULES`. Whether it imports, and is a class,
    is checked where checkpoints are loaded.
    """
    if not isinstance(name, str) or not _GLOBAL_RE.match(name):
        return "must be a dotted module.Name, e.g. \"mypkg.config.TrainConfig\""
    top = name.split(".", 1)[0]
    if top in UNSAFE_GLOBAL_MODULES:
        return (
            f"module {top!r} can run commands or touch files when a pickle calls it; "
            "allowlist only your own plain classes, e.g. \"mypkg.config.TrainConfig\""
        )
    return None


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
    between the first drill loss and the loss the checkpoint recorded.
    ``allow_globals`` are ``module.Name`` classes the safe loader may unpickle
    for these jobs (in file order, no duplicates; see
    :func:`allow_global_problem`), added to those given on the command line.
    """

    jobs: str = "*"
    model: str = ""
    steps: int = 10
    device: Device = "auto"
    timeout: timedelta = timedelta(minutes=15)
    loss_tolerance: float | None = None
    allow_globals: tuple[str, ...] = ()


#: The ``[[policy]]`` keys that state a retention rule; a table without any of
#: them (``jobs`` alone, say) is not a policy the user wrote (see ``Config.unwritten``).
RULE_KEYS = frozenset({"keep_last", "milestones", "keep_within", "keep_daily", "keep_weekly", "pinned"})


@dataclass(frozen=True)
class Config:
    """The parsed file. ``source`` is the file read, or None for built-in defaults.

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
    unwritten: frozenset[int] = frozenset()

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


def default_policy() -> Policy:
    """The built-in policy: keep the 3 newest verified, every other setting default."""
    return Policy(rules=(KeepLast(3),))


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

    def fail(self, key: str, value: Any, fix: str) -> None:
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
        v = self.data.get(key, default)
        if v is None:
            return None
        if not isinstance(v, str):
            self.fail(key, v, f"must be a duration string like {example!r} (units s, m, h, d, w)")
        try:
            d = parse_duration(v)
        except ConfigError:
            self.fail(key, v, f"not a duration: write a number and a unit (s, m, h, d, w), e.g. {example!r}")
            raise  # unreachable: fail raises
        if positive and d <= timedelta(0):
            self.fail(key, v, f"must be longer than zero, e.g. {example!r}")
        return d

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


def _milestones(t: _Table) -> Milestones | None:
    if not t.has("milestones"):
        return None
    v = t.data["milestones"]
    shapes = "use \"log\", a list of steps like [1000, 5000], or { every_n_steps = 10000 }"
    if isinstance(v, str):
        if v != "log":
            t.fail("milestones", v, shapes)
        return Milestones(log=True)
    if isinstance(v, list):
        steps = t.get_steps("milestones")
        if not steps:
            t.fail("milestones", v, "an empty list keeps nothing; omit the key for no milestones")
        return Milestones(steps=steps or ())
    if isinstance(v, dict):
        if set(v) != {"every_n_steps"}:
            t.fail("milestones", v, shapes)
        n = v["every_n_steps"]
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            t.fail("milestones", v, "every_n_steps must be a whole number > 0, e.g. { every_n_steps = 10000 }")
        return Milestones(every=int(n))
    t.fail("milestones", v, shapes)
    return None


def _policy(where: str, index: int, data: Any) -> Policy:
    name = f"policy[{index}]"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {name} must be a table ([[policy]]), got {_show(data)}")
    t = _Table(where, name, data, _POLICY_KEYS)
    jobs = t.get_glob()
    rules: list[Rule] = []
    keep_last = t.get_int("keep_last", 3, example=3)
    if keep_last:
        rules.append(KeepLast(keep_last))
    m = _milestones(t)
    if m is not None:
        rules.append(m)
    within = t.get_duration("keep_within", None, positive=True, example="36h")
    if within is not None:
        rules.append(KeepWithin(within))
    daily = t.get_int("keep_daily", 0, example=7)
    if daily:
        rules.append(KeepDaily(daily))
    weekly = t.get_int("keep_weekly", 0, example=4)
    if weekly:
        rules.append(KeepWeekly(weekly))
    pinned = t.get_steps("pinned")
    if pinned:
        rules.append(Pinned(pinned))
    if not rules:
        raise ConfigError(
            f"{where}: {name} (jobs = {_show(jobs)}) keeps nothing: set keep_last ≥ 1, milestones, "
            f"keep_within, keep_daily, keep_weekly or pinned"
        )
    archive = t.get_str("archive", None, example="s3://bucket/archive")
    if archive is not None and (problem := _archive_problem(archive)):
        t.fail("archive", archive, problem)
    storage_class = t.get_str("storage_class", None, example="GLACIER_IR")
    if storage_class is not None and archive is None:
        t.fail("storage_class", storage_class, "has no effect without archive: set archive or remove storage_class")
    hot = t.data.get("hot_after_archive", "delete")
    if hot not in ("delete", "keep"):
        t.fail("hot_after_archive", hot, "must be \"delete\" or \"keep\"")
    grace = t.get_duration("grace", "2h", positive=False, example="2h")
    fraction = t.get_float("max_missing_fraction", 0.5, lo=0.0, hi=1.0, example=0.5)
    return Policy(
        rules=tuple(rules),
        jobs=jobs,
        grace=grace if grace is not None else timedelta(hours=2),
        min_verified=t.get_int("min_verified", 2, example=2),
        archive=archive,
        storage_class=storage_class,
        hot_after_archive=hot,
        max_missing_fraction=fraction if fraction is not None else 0.5,
        delete_stale_incomplete=t.get_bool("delete_stale_incomplete", False),
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
    timeout = t.get_duration("timeout", "15m", positive=True, example="15m")
    allow = t.data.get("allow_globals", [])
    if not isinstance(allow, list):
        t.fail("allow_globals", allow, "must be a list of module.Name strings, e.g. allow_globals = [\"mypkg.config.TrainConfig\"]")
    for entry in allow:
        if (problem := allow_global_problem(entry)) is not None:
            t.fail("allow_globals", allow, f"entry {_show(entry)}: {problem}")
    return DrillSettings(
        jobs=jobs,
        model=model,
        steps=t.get_int("steps", 10, minimum=1, example=10),
        device=device,
        timeout=timeout if timeout is not None else timedelta(minutes=15),
        loss_tolerance=t.get_float("loss_tolerance", None, lo=0.0, hi=None, example=0.05),
        allow_globals=tuple(dict.fromkeys(allow)),
    )


def _array_of_tables(where: str, doc: dict[str, Any], key: str) -> list[Any]:
    v = doc.get(key, [])
    if not isinstance(v, list):
        raise ConfigError(f"{where}: {key} must be an array of tables: write [[{key}]], not [{key}]")
    return v


def parse_config(text: str, *, where: str = DEFAULT_FILE) -> Config:
    """Parse and validate the text of a ``ckptier.toml``. ``where`` names it in errors.

    A file with no ``[[policy]]`` table gets the built-in default policy.
    """
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: not valid TOML ({exc}); fix the syntax") from exc
    for key in doc:
        if key not in _TOP_KEYS:
            raise ConfigError(
                f"{where}: unknown top-level key {key!r} = {_show(doc[key])}: "
                f"use [[policy]], [[drill]] or [catalog]"
            )
    policies = tuple(_policy(where, i, d) for i, d in enumerate(_array_of_tables(where, doc, "policy")))
    drills = tuple(_drill(where, i, d) for i, d in enumerate(_array_of_tables(where, doc, "drill")))
    catalog_url = None
    if "catalog" in doc:
        cat = doc["catalog"]
        if not isinstance(cat, dict):
            raise ConfigError(f"{where}: catalog must be a table: write [catalog] then url = \"...\"")
        catalog_url = _Table(where, "catalog", cat, _CATALOG_KEYS).get_str(
            "url", None, example="sqlite:////var/lib/ckptier/catalog.db"
        )
    tables = _array_of_tables(where, doc, "policy")
    unwritten = {i for i, d in enumerate(tables) if not RULE_KEYS & set(d)} if policies else {0}
    return Config(
        policies=policies or (default_policy(),),
        drills=drills,
        catalog_url=catalog_url,
        unwritten=frozenset(unwritten),
    )


def load_config(path: str | Path | None = None) -> Config:
    """Read ``ckptier.toml`` (see the module docstring for where it is looked for).

    Raises :class:`ConfigError` when an explicit path is missing or unreadable
    or the file is invalid. Reading is the only I/O; the result is immutable.
    """
    explicit = path if path is not None else os.environ.get(ENV_VAR) or None
    file = Path(explicit) if explicit is not None else Path(DEFAULT_FILE)
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
    return Config(cfg.policies, cfg.drills, cfg.catalog_url, source=file, unwritten=cfg.unwritten)
