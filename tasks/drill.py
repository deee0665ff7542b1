"""Restore drills: which checkpoint to try, how to run it isolated, the verdict.

Three pieces, no Prefect and no torch here:

* :func:`choose_candidates` - pure: the checkpoints worth drilling, best first.
* :func:`run_drill_subprocess` - runs ``ckptier.tasks.drill_worker`` in a
  child process with a time limit, the scratch directory as its working
  directory and home, an environment that carries no credentials, and its
  writes confined to the scratch directory where the kernel allows.
* :func:`judge` - pure: a :class:`Verdict` from the worker's measured numbers.

Fetching the checkpoint into the scratch directory and recording the verdict
in the catalog are the caller's job.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any, Self, cast

from ckptier.formats.registry import DRILLABLE_FORMATS as DRILLABLE
from ckptier.formats.registry import plugin
from ckptier.storage.errors import ConfigError
from ckptier.storage.records import CheckpointRecord, Format, State
from ckptier.tasks.config import DEFAULT_DRILL_STEPS, DEFAULT_DRILL_TIMEOUT, parse_factory_spec
from ckptier.tasks.reports import Check

DEFAULT_LOSS_TOLERANCE = 0.5
"""Relative distance allowed between the first restored loss and the loss the
checkpoint recorded. Generous on purpose: the restored step trains on the next
batch with updated weights (and logged losses are often window averages), so
they never match exactly; weights that did not restore (random init, wrong
layer) miss by far more."""

DEFAULT_CUDA_RTOL = 1e-4
"""Relative tolerance between the two repeated runs on CUDA (CPU must be bit-exact)."""

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


def drill_path(record: CheckpointRecord, fetched: Path) -> Path:
    """What the worker loads from ``fetched`` (the checkpoint's copy, its
    files at their relpaths): the directory, or the one file of a
    single-file checkpoint, as its format says; pure."""
    relpaths = [f.relpath for f in record.files]
    single = len(relpaths) == 1 and record.location.rstrip("/").rsplit("/", 1)[-1] == relpaths[0]
    return plugin(record.format).drill_path(Path(fetched), relpaths, single)


# --- the worker's result ----------------------------------------------------


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
class WorkerResult(JsonRecord):
    """What the drill worker measured (JSON-serialisable; times in seconds,
    memory in bytes).

    ``error``/``error_stage`` are set when the drill could not finish; stage
    is one of ``setup``, ``factory`` (the model factory does not import),
    ``load``, ``build``, ``restore``, ``train``, ``timeout``, ``crash``.
    ``unsafe`` marks a refused load. Losses are per step; ``None`` stands
    for a non-finite loss. ``losses_repeat`` is the second run from a fresh
    restore. ``optimizer_step_before``/``after`` are
    the optimizer's step counter right after restoring and after the K steps.
    ``grad_problems`` lists trainable parameters whose gradient was missing,
    zero at every step, or non-finite at some step. ``timings`` holds
    ``load_s``, ``build_s``, ``restore_s``, ``first_step_s``, ``steps_s``
    (all K steps), ``total_s``, and the epoch time ``first_step_done_at``.
    ``env_keys`` are the names (not values) of the worker's environment.
    ``confined`` says whether the operating system confined the worker's
    writes to its scratch directory, and ``confinement`` how, or why not
    (measured before the worker started; None when run in-process).
    """

    checkpoint: str
    format: str
    steps: int
    device: str | None = None
    error: str | None = None
    error_stage: str | None = None
    unsafe: bool = False
    timed_out: bool = False
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
    timings: Mapping[str, float] = field(default_factory=dict)
    peak_memory_bytes: int | None = None
    memory_kind: str | None = None
    also_loaded: tuple[str, ...] = ()
    env_keys: tuple[str, ...] = ()
    torch_version: str | None = None
    returncode: int | None = None
    stderr_tail: str | None = None
    confined: bool = False
    confinement: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["losses"] = [_finite_or_none(v) for v in self.losses]
        data["losses_repeat"] = [_finite_or_none(v) for v in self.losses_repeat]
        data["timings"] = dict(self.timings)
        return data


@dataclass(frozen=True)
class DrillRequest(JsonRecord):
    """What the parent asks the worker to do (written as JSON to scratch).

    ``factory`` is a ``module:function`` spec (see ckptier.tasks.drill_models) or
    None to build a Hugging Face model from its config.json. ``device`` is
    ``auto``, ``cpu`` or ``cuda``; ``steps`` is K >= 1.
    """

    checkpoint: str
    format: str
    factory: str | None
    steps: int
    device: str
    result_path: str
    seed: int = 0
    allow_globals: tuple[str, ...] = ()


# --- the verdict ------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """``ok`` only when every check passed; ``summary`` is one line."""

    ok: bool
    checks: list[Check]
    summary: str

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "summary": self.summary, "checks": [asdict(c) for c in self.checks]}


def _fmt(value: float | None) -> str:
    return "non-finite" if value is None else f"{value:.6g}"


def judge(
    result: WorkerResult,
    *,
    loss_tolerance: float = DEFAULT_LOSS_TOLERANCE,
    cuda_rtol: float = DEFAULT_CUDA_RTOL,
) -> Verdict:
    """The drill's verdict; pure over the worker's numbers.

    Checks, in order: ``completed`` (no timeout, no load/build/train error;
    when it fails no other check is judged), ``losses_finite``,
    ``gradients`` (every trainable parameter got a finite, non-zero gradient),
    ``optimizer_continues`` (the restored step counter advanced by exactly K;
    passes when the checkpoint had no optimizer state), ``deterministic``
    (two runs from a fresh restore agree: bit-exact on CPU, ``cuda_rtol`` on
    CUDA), ``recorded_loss`` (``|first - recorded| <= loss_tolerance *
    |recorded|``; passes when nothing was recorded).
    """
    if result.timed_out or result.error is not None:
        detail = result.error or "the worker stopped without an error message"
        check = Check("completed", False, f"{result.error_stage or 'crash'}: {detail}")
        return Verdict(False, [check], f"drill failed: {check.detail}")
    checks = [Check("completed", True, f"{result.steps} steps on {result.device}")]

    losses = list(result.losses)
    bad = [i + 1 for i, v in enumerate(losses) if v is None or not math.isfinite(v)]
    if len(losses) != result.steps:
        checks.append(Check("losses_finite", False, f"expected {result.steps} losses, got {len(losses)}"))
    elif bad:
        checks.append(Check("losses_finite", False, f"non-finite loss at drill step(s) {bad[:5]}"))
    else:
        checks.append(Check("losses_finite", True, f"losses {_fmt(losses[0])} .. {_fmt(losses[-1])}"))

    if result.trainable_params == 0:
        checks.append(Check("gradients", False, "the model has no trainable parameters"))
    elif result.grad_problems:
        shown = "; ".join(result.grad_problems[:3])
        more = f" (+{len(result.grad_problems) - 3} more)" if len(result.grad_problems) > 3 else ""
        checks.append(Check("gradients", False, shown + more))
    else:
        frozen = f", {result.frozen_params} frozen skipped" if result.frozen_params else ""
        checks.append(Check("gradients", True, f"{result.trainable_params} trainable parameters got finite non-zero gradients{frozen}"))

    if not result.optimizer_loaded:
        checks.append(Check("optimizer_continues", True, "skipped: the checkpoint has no optimizer state"))
    else:
        before, after = result.optimizer_step_before, result.optimizer_step_after
        if before is None or after is None:
            checks.append(Check("optimizer_continues", True, "skipped: the optimizer keeps no step counter"))
        elif before <= 0:
            checks.append(Check("optimizer_continues", False, f"restored optimizer step counter is {before:g}; the state did not restore"))
        elif after != before + result.steps:
            checks.append(Check("optimizer_continues", False, f"step counter went {before:g} -> {after:g}, expected {before + result.steps:g}"))
        else:
            checks.append(Check("optimizer_continues", True, f"step counter {before:g} -> {after:g}"))

    repeat = list(result.losses_repeat)
    if len(repeat) != len(losses):
        checks.append(Check("deterministic", False, f"repeat run gave {len(repeat)} losses, first run {len(losses)}"))
    else:
        exact = result.device is None or not result.device.startswith("cuda")
        diffs = [
            i + 1
            for i, (a, b) in enumerate(zip(losses, repeat, strict=True))
            if (a is None) != (b is None)
            or (a is not None and b is not None and (a != b if exact else abs(a - b) > cuda_rtol * max(abs(a), abs(b))))
        ]
        rule = "bit-exact" if exact else f"rtol {cuda_rtol:g}"
        if diffs:
            i = diffs[0] - 1
            checks.append(Check("deterministic", False, f"runs differ ({rule}) at step {diffs[0]}: {_fmt(losses[i])} vs {_fmt(repeat[i])}"))
        else:
            checks.append(Check("deterministic", True, f"two restored runs agree ({rule})"))

    recorded = result.recorded_loss
    first = losses[0] if losses else None
    if recorded is None:
        checks.append(Check("recorded_loss", True, "skipped: the checkpoint recorded no loss"))
    elif first is None:
        checks.append(Check("recorded_loss", False, f"first loss is non-finite, recorded {_fmt(recorded)}"))
    elif abs(first - recorded) <= loss_tolerance * abs(recorded):
        checks.append(Check("recorded_loss", True, f"first loss {_fmt(first)} vs recorded {_fmt(recorded)} (tolerance {loss_tolerance:g})"))
    else:
        checks.append(Check("recorded_loss", False, f"first loss {_fmt(first)} vs recorded {_fmt(recorded)}: off by more than {loss_tolerance:g} relative"))

    failed = [c for c in checks if not c.ok]
    if failed:
        return Verdict(False, checks, f"drill failed: {failed[0].name}: {failed[0].detail}")
    t = result.timings
    summary = (
        f"drill ok: {result.steps} steps on {result.device}, first loss {_fmt(first)}"
        + (f" (recorded {_fmt(recorded)})" if recorded is not None else "")
        + f", load {t.get('load_s', float('nan')):.2f} s, first step {t.get('first_step_s', float('nan')):.3f} s"
    )
    return Verdict(True, checks, summary)


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


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-limit:]


def _read_confinement(fd: int) -> tuple[bool, str]:
    """What the confinement launcher reported on ``fd`` (written before the
    worker started, so the worker cannot forge it)."""
    from ckptier.tasks.confine import Confinement

    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    try:
        status = Confinement.from_json(b"".join(chunks).decode())
    except (ValueError, KeyError, TypeError):
        return False, "writes not confined: the confinement launcher reported nothing (it did not start)"
    return status.confined, status.detail


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "no output"


def run_drill_subprocess(
    checkpoint: Path,
    fmt: Format | str,
    *,
    factory: str | None,
    scratch: Path,
    steps: int = DEFAULT_DRILL_STEPS,
    timeout: float = DEFAULT_DRILL_TIMEOUT.total_seconds(),
    device: str = "auto",
    seed: int = 0,
    allow_globals: Sequence[str] = (),
    env_passthrough: Sequence[str] = (),
    python: str = sys.executable,
) -> WorkerResult:
    """Run one drill in a child process and return what it measured.

    ``checkpoint`` is the local copy (a step directory, or a Lightning
    ``.ckpt``), normally already fetched into ``scratch``. The child runs with
    ``scratch`` as working directory and home, the environment of
    :func:`worker_env`, and its own process group; after ``timeout`` seconds
    the whole group is killed (SIGKILL) and the result says ``timed_out``.
    Where the kernel offers Landlock the child can change the filesystem
    only beneath ``scratch`` (:mod:`ckptier.tasks.confine`); it can still
    read torch, the model's module and the checkpoint. The result's
    ``confined``/``confinement`` say whether that held, and why not.
    Never raises for what happens inside the child; raises
    :class:`ConfigError` for bad arguments. ``timings["subprocess_s"]`` is the
    child's wall time and ``timings["spawned_at"]`` the epoch time of spawning.
    """
    if steps < 1:
        raise ConfigError(f"drill steps {steps} must be at least 1; use --steps 5 for example")
    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise ConfigError(f"drill device {device!r} is unknown; use auto, cpu or cuda")
    if timeout <= 0:
        raise ConfigError(f"drill timeout {timeout} must be positive seconds")
    if factory is not None:
        parse_factory_spec(factory)
    fmt_value = Format(fmt).value
    scratch = Path(scratch).resolve()
    (scratch / "tmp").mkdir(parents=True, exist_ok=True)
    result_path = scratch / "drill-result.json"
    result_path.unlink(missing_ok=True)
    request = DrillRequest(
        checkpoint=str(Path(checkpoint).resolve()),
        format=fmt_value,
        factory=factory,
        steps=steps,
        device=device,
        result_path=str(result_path),
        seed=seed,
        allow_globals=tuple(allow_globals),
    )
    request_path = scratch / "drill-request.json"
    request_path.write_text(json.dumps(request.to_dict()))
    env = worker_env(os.environ, scratch, passthrough=env_passthrough)
    status_read, status_write = os.pipe()
    spawned_at = time.time()
    started = time.perf_counter()
    try:
        with (scratch / "worker.out").open("wb") as out, (scratch / "worker.err").open("wb") as err:
            proc = subprocess.Popen(
                [python, "-m", "ckptier.tasks.confine", "--write", str(scratch), "--status-fd", str(status_write), "--",
                 python, "-m", "ckptier.tasks.drill_worker", "--request", str(request_path)],
                cwd=scratch,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                pass_fds=(status_write,),
            )
            os.close(status_write)
            status_write = -1
            try:
                returncode = proc.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                returncode = proc.wait()
                timed_out = True
        confined, confinement = _read_confinement(status_read)
    finally:
        os.close(status_read)
        if status_write >= 0:
            os.close(status_write)
    elapsed = time.perf_counter() - started
    timings = {"subprocess_s": elapsed, "spawned_at": spawned_at}
    stderr_tail = _tail(scratch / "worker.err")
    base: dict[str, Any] = {"checkpoint": request.checkpoint, "format": fmt_value, "steps": steps, "returncode": returncode,
            "stderr_tail": stderr_tail or None, "confined": confined, "confinement": confinement}
    if timed_out:
        return WorkerResult(
            **base,
            timed_out=True,
            error_stage="timeout",
            error=f"the drill worker ran past the time limit of {timeout:g} s and was killed; raise the drill timeout or lower the steps",
            timings=timings,
        )
    if not result_path.is_file():
        return WorkerResult(
            **base,
            error_stage="crash",
            error=f"the drill worker exited with code {returncode} without a result: {_last_line(stderr_tail)}",
            timings=timings,
        )
    try:
        data = json.loads(result_path.read_text())
    except ValueError as exc:
        return WorkerResult(**base, error_stage="crash", error=f"the drill worker wrote an unreadable result ({exc})", timings=timings)
    data.update(returncode=returncode, stderr_tail=stderr_tail or None, confined=confined, confinement=confinement)
    data["timings"] = {**(data.get("timings") or {}), **timings}
    return WorkerResult.from_dict(data)
