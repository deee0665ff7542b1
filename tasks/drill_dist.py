"""Multi-rank restore drills: N workers that restore a checkpoint together.

A checkpoint written by N ranks is drilled by N worker processes (or M, to
check that it resumes on M GPUs), one per rank, that rendezvous on
127.0.0.1 and restore with ``torch.distributed`` (gloo on CPU, NCCL when
there is a CUDA device per rank), each from its own scratch directory
holding only what its rank reads. Pieces, no torch here:

* :func:`choose_backend`, :func:`drill_backends` - pure: the device kind
  and backend for a world size, and for a resharding drill's reference.
* :func:`prepare_ranks` - fetches each rank's files (the format's
  :meth:`~ckptier.formats.base.FormatPlugin.rank_files`) into its scratch
  directory: each file crosses the network once, to the rank that reads it
  whole (or most of it); another rank needing only some byte ranges of it
  gets those ranges copied from that verified copy into a sparse file.
* :func:`launch_ranks` - starts the workers (``ckptier.tasks.drill_dist_worker``),
  each confined to its own work directory and credential-free like a
  single-rank drill, and stops all of them (whole process groups) as soon
  as one fails, or at the time limit.
* :func:`judge_ranks` - pure: the verdict, naming the rank and the check
  that failed.
* :func:`run_ranked_drill` - all of it for one checkpoint, plus the
  resharding comparison (``world_size`` M against a same-size restore).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from ckptier.formats.base import PARTITIONED, RankFiles
from ckptier.formats.registry import plugin
from ckptier.storage.errors import ConfigError
from ckptier.tasks.drill import (
    DEFAULT_CUDA_RTOL,
    DEFAULT_LOSS_TOLERANCE,
    Verdict,
    _finite_or_none,
    _fmt,
    JsonRecord,
    _last_line,
    _read_confinement,
    _tail,
    worker_env,
)
from ckptier.tasks.reports import Check, DrillRank, DrillReport, Reshard

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

STOP_GRACE_S = 3.0
"""Seconds the other ranks get, once one rank has failed, to report their
own errors before the drill stops them."""

_STAGES = ("start", "rendezvous", "build", "load", "restore", "train", "done")
"""The stages a worker reports in its progress file, in order."""


class UnsupportedDrill(ConfigError):
    """The checkpoint's ranks cannot be drilled yet (partitioned: model
    parallelism, ZeRO partitions); nothing is wrong with the checkpoint."""


# --- the device and backend ---------------------------------------------------


def choose_backend(device: str, world: int, cuda_devices: int) -> tuple[str, str]:
    """``(device kind, backend)`` for a drill of ``world`` ranks: ``("cuda",
    "nccl")`` when there is a CUDA device per rank, else ``("cpu", "gloo")``;
    pure.

    ``device`` ``auto`` falls back to CPU when there are fewer CUDA devices
    than ranks; ``cuda`` (or ``cuda:N``) then raises :class:`ConfigError`
    naming both counts; ``cpu`` is always gloo.
    """
    if world < 1:
        raise ConfigError(f"drill world size {world} must be at least 1; use --world-size 2 for example")
    if device == "cpu":
        return "cpu", "gloo"
    if device == "auto":
        return ("cuda", "nccl") if cuda_devices >= world else ("cpu", "gloo")
    if device == "cuda" or device.startswith("cuda:"):
        if cuda_devices < world:
            raise ConfigError(
                f"drill device {device} for {world} ranks needs {world} CUDA devices, found {cuda_devices}; "
                f"use --device cpu (gloo), or --world-size {max(cuda_devices, 1)}"
            )
        return "cuda", "nccl"
    raise ConfigError(f"drill device {device!r} is unknown; use auto, cpu or cuda")


def drill_backends(device: str, world: int, saved_world: int, cuda_devices: int
                   ) -> tuple[tuple[str, str], tuple[str, str] | None]:
    """``(device kind, backend)`` of a drill of ``world`` ranks of a checkpoint
    saved by ``saved_world``, and of its same-size reference restore (None
    when ``world`` is the saved size); pure.

    The drill follows :func:`choose_backend`. The reference runs where the
    drill does when there are CUDA devices for all ``saved_world`` ranks,
    else on CPU/gloo (resharding 8 -> 2 on a 2-GPU machine still compares
    against an 8-rank restore), whatever ``device`` says.
    """
    run = choose_backend(device, world, cuda_devices)
    if world == saved_world:
        return run, None
    ref_device = device if device == "cpu" or cuda_devices >= saved_world else "cpu"
    return run, choose_backend(ref_device, saved_world, cuda_devices)


def visible_cuda_devices(environ: Mapping[str, str], device_nodes: Sequence[str]) -> int:
    """How many CUDA devices a drill's workers can use; pure.

    ``device_nodes`` are the names in ``/dev`` (``nvidia0``, ``nvidia1``...);
    ``CUDA_VISIBLE_DEVICES``, when set, limits them as CUDA does (the list
    ends at its first entry that is not a device index or UUID; empty means
    none)."""
    present = sum(1 for n in device_nodes if re.fullmatch(r"nvidia\d+", n))
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    count = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        count += 1
    return min(count, present)


def cuda_device_count() -> int:
    """The CUDA devices of this machine a drill can use (no torch imported):
    none when torch has no CUDA build or no driver is loaded."""
    from .drill_inputs import cuda_problem

    if cuda_problem() is not None:
        return 0
    try:
        nodes = os.listdir("/dev")
    except OSError:
        return 0
    return visible_cuda_devices(os.environ, nodes)


# --- what the parent asks, what a rank answers -----------------------------------


@dataclass(frozen=True)
class RankRequest(JsonRecord):
    """What the parent asks worker ``rank`` of ``world_size`` (JSON in its scratch).

    ``checkpoint`` is the rank's own copy (only the files it reads);
    ``available`` says which of its files are whole (None) and which are
    sparse copies holding only the listed byte ranges. ``layout`` is the
    checkpoint's (``replicated``: load one replica and wrap the model in DDP;
    ``sharded``: shard the model with FSDP2 and let DCP's planner read the
    parts). Rank 0 serves the rendezvous store on the socket the parent
    bound to 127.0.0.1 (``store_fd``, inherited); the others connect to
    ``store_port``.
    """

    checkpoint: str
    format: str
    factory: str | None
    steps: int
    rank: int
    world_size: int
    saved_world: int
    layout: str
    device: str
    backend: str
    store_port: int
    result_path: str
    progress_path: str
    parent_pid: int
    timeout: float
    available: Mapping[str, Any] = field(default_factory=dict)
    store_fd: int | None = None
    seed: int = 0
    allow_globals: tuple[str, ...] = ()


@dataclass(frozen=True)
class RankResult(JsonRecord):
    """What one rank measured (JSON; seconds, bytes), plus what the parent saw.

    As :class:`~ckptier.tasks.drill.WorkerResult`, per rank. ``parallel`` is
    how the model was distributed (``ddp``, ``fsdp2``, or ``none`` on one
    rank); ``restored_digest`` the sha256 of the restored state of a replica
    (None when the ranks hold shards); ``grad_problems`` this rank's, plus
    parameters whose gradient was zero on every rank. Set by the parent:
    ``returncode``, ``timed_out`` (killed at the time limit), ``stopped``
    (killed because another rank had failed), ``exit_order`` (0 for the
    first rank to exit), ``last_stage`` (the worker's progress when it
    ended), ``confined``/``confinement``.
    """

    rank: int
    world_size: int
    checkpoint: str
    format: str
    steps: int
    device: str | None = None
    backend: str | None = None
    parallel: str | None = None
    error: str | None = None
    error_stage: str | None = None
    unsafe: bool = False
    timed_out: bool = False
    stopped: bool = False
    losses: tuple[float | None, ...] = ()
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
    env_keys: tuple[str, ...] = ()
    torch_version: str | None = None
    returncode: int | None = None
    stderr_tail: str | None = None
    exit_order: int | None = None
    last_stage: str | None = None
    confined: bool = False
    confinement: str | None = None

    @property
    def failed(self) -> bool:
        return self.timed_out or self.stopped or self.error is not None

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["losses"] = [_finite_or_none(v) for v in self.losses]
        data["timings"] = dict(self.timings)
        return data


# --- the verdict ----------------------------------------------------------------


def _stage_index(stage: str | None) -> int:
    return _STAGES.index(stage) if stage in _STAGES else -1


def _ranks_text(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _completion(results: Sequence[RankResult]) -> Check:
    """The ``completed`` check: every rank finished; else the root cause."""
    failed = [r for r in results if r.failed]
    if not failed:
        return Check("completed", True, "")
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


def judge_ranks(
    results: Sequence[RankResult],
    *,
    steps: int,
    loss_tolerance: float = DEFAULT_LOSS_TOLERANCE,
    cuda_rtol: float = DEFAULT_CUDA_RTOL,
    reference: Sequence[RankResult] | None = None,
    reshard_rtol: float | None = None,
) -> Verdict:
    """The verdict of a multi-rank drill; pure over the ranks' numbers.

    Checks, in order, each failure naming the rank: ``completed`` (every
    rank finished; else the rank that failed first, or, at the time limit,
    the one that lagged; no other check is judged), ``losses_finite`` (K
    finite losses on every rank), ``replicas_agree`` (every rank restored
    the same replica, when they hold replicas, and every rank's loss equals
    rank 0's at every step: bit-exact on CPU, ``cuda_rtol`` on CUDA; every
    rank trains the same batch), ``gradients`` (every trainable parameter
    got a finite gradient on every rank, non-zero on some rank),
    ``optimizer_continues`` (every rank's step counter advanced by exactly
    K), ``recorded_loss`` (rank 0's first loss against the recorded one).
    With ``reference`` (a same-size restore of the same checkpoint),
    ``resumes``: rank 0's losses match the reference's step by step within
    ``reshard_rtol`` (default :data:`DEFAULT_RESHARD_RTOL`, or
    :data:`DEFAULT_RESHARD_RTOL_CUDA` on CUDA).
    """
    ordered = sorted(results, key=lambda r: r.rank)
    world = len(ordered)
    done = _completion(ordered)
    if not done.ok:
        return Verdict(False, [done], f"drill failed: {done.detail}")
    zero = ordered[0]
    on_cuda = bool(zero.device and zero.device.startswith("cuda"))
    checks = [Check("completed", True, f"{world} rank{'s' if world > 1 else ''} x {steps} steps "
                                       f"({zero.parallel}, {zero.backend}) on {zero.device}")]

    bad = None
    for r in ordered:
        if len(r.losses) != steps:
            bad = f"rank {r.rank}: expected {steps} losses, got {len(r.losses)}"
        elif nonfinite := [i + 1 for i, v in enumerate(r.losses) if v is None or not math.isfinite(v)]:
            bad = f"rank {r.rank}: non-finite loss at drill step(s) {nonfinite[:5]}"
        if bad:
            break
    checks.append(Check("losses_finite", bad is None, bad or f"losses {_fmt(zero.losses[0])} .. {_fmt(zero.losses[-1])} on every rank"))

    rule = "bit-exact" if not on_cuda else f"rtol {cuda_rtol:g}"
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
                    disagree = f"rank {r.rank}'s loss at drill step {i + 1} is {_fmt(b)}, rank 0's {_fmt(a)} ({rule}; every rank trains the same batch)"
                    break
            if disagree:
                break
    what = "restored identical replicas and agree" if replicas and len(replicas) == world else "agree"
    checks.append(Check("replicas_agree", disagree is None, disagree or f"{world} ranks {what} on every loss ({rule})"))

    grad = None
    if any(r.trainable_params == 0 for r in ordered):
        grad = f"rank {next(r.rank for r in ordered if r.trainable_params == 0)}: the model has no trainable parameters"
    else:
        shown: list[str] = []
        for r in ordered:
            for grad_problem in r.grad_problems:
                text = grad_problem if grad_problem.endswith("on every rank") else f"rank {r.rank}: {grad_problem}"
                if text not in shown:
                    shown.append(text)
        if shown:
            grad = "; ".join(shown[:3]) + (f" (+{len(shown) - 3} more)" if len(shown) > 3 else "")
    checks.append(Check("gradients", grad is None, grad or f"{zero.trainable_params} trainable parameters got finite gradients on every rank"))

    if not zero.optimizer_loaded:
        checks.append(Check("optimizer_continues", True, "skipped: the checkpoint has no optimizer state"))
    else:
        problem: str | None = None
        for r in ordered:
            before, after = r.optimizer_step_before, r.optimizer_step_after
            if before is None or after is None:
                continue
            if before <= 0:
                problem = f"rank {r.rank}: restored optimizer step counter is {before:g}; the state did not restore"
            elif after != before + steps:
                problem = f"rank {r.rank}: step counter went {before:g} -> {after:g}, expected {before + steps:g}"
            if problem:
                break
        counters = {(r.optimizer_step_before, r.optimizer_step_after) for r in ordered}
        if problem is None and len(counters) > 1:
            problem = "ranks restored different step counters: " + ", ".join(
                f"rank {r.rank} {_fmt(r.optimizer_step_before)}" for r in ordered)
        before = zero.optimizer_step_before
        ok_text = (f"step counter {before:g} -> {zero.optimizer_step_after:g} on every rank" if before is not None
                   and zero.optimizer_step_after is not None else "skipped: the optimizer keeps no step counter")
        checks.append(Check("optimizer_continues", problem is None, problem or ok_text))

    recorded, first = zero.recorded_loss, (zero.losses[0] if zero.losses else None)
    if recorded is None:
        checks.append(Check("recorded_loss", True, "skipped: the checkpoint recorded no loss"))
    elif first is None:
        checks.append(Check("recorded_loss", False, f"rank 0's first loss is non-finite, recorded {_fmt(recorded)}"))
    elif abs(first - recorded) <= loss_tolerance * abs(recorded):
        checks.append(Check("recorded_loss", True, f"first loss {_fmt(first)} vs recorded {_fmt(recorded)} (tolerance {loss_tolerance:g})"))
    else:
        checks.append(Check("recorded_loss", False, f"first loss {_fmt(first)} vs recorded {_fmt(recorded)}: off by more than {loss_tolerance:g} relative"))

    if reference is not None:
        checks.append(_resumes(ordered, reference, on_cuda, reshard_rtol))

    failed = [c for c in checks if not c.ok]
    if failed:
        return Verdict(False, checks, f"drill failed: {failed[0].name}: {failed[0].detail}")
    first_step = max((r.timings.get("first_step_s", float("nan")) for r in ordered), default=float("nan"))
    summary = (f"drill ok: {world} rank{'s' if world > 1 else ''} ({zero.parallel}, {zero.backend}) x {steps} steps "
               f"on {zero.device}, first loss {_fmt(first)}"
               + (f" (recorded {_fmt(recorded)})" if recorded is not None else "")
               + f", ranks agree, first step {first_step:.3f} s")
    if reference is not None:
        summary += f"; resumes on {world} rank{'s' if world > 1 else ''} (first losses match the {len(reference)}-rank restore)"
    return Verdict(True, checks, summary)


def _resumes(results: Sequence[RankResult], reference: Sequence[RankResult], on_cuda: bool, rtol: float | None) -> Check:
    world, saved = len(results), len(reference)
    tol = rtol if rtol is not None else (DEFAULT_RESHARD_RTOL_CUDA if on_cuda else DEFAULT_RESHARD_RTOL)
    ref = sorted(reference, key=lambda r: r.rank)
    verdict = judge_ranks(ref, steps=len(results[0].losses))
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


# --- preparing each rank's scratch --------------------------------------------------


@dataclass(frozen=True)
class Fetched:
    """What one fetch brought: the tier it came from, its seconds and bytes."""

    tier: str
    seconds: float
    bytes: int


FetchFn = Callable[[Sequence[str], Path], Fetched]
"""``fetch(relpaths, dest)``: the named files of the checkpoint, verified,
into the new directory ``dest`` (all or nothing)."""


@dataclass
class RankScratch:
    """One rank's scratch: ``checkpoint`` (what it reads: never written by
    the worker) and ``work`` (its writable working directory); ``available``
    as in :class:`RankRequest`; ``held_bytes`` the disk its shards take
    (shared metadata excepted; sparse files count only the ranges written)."""

    rank: int
    root: Path
    checkpoint: Path
    work: Path
    available: dict[str, Any]
    files: list[str]
    held_bytes: int = 0
    needed_bytes: int = 0


def _allocated(path: Path) -> int:
    st = path.stat()
    return min(st.st_size, st.st_blocks * 512) if hasattr(st, "st_blocks") else st.st_size


def prepare_ranks(plan: RankFiles, sizes: Mapping[str, int], fetch: FetchFn, root: Path,
                  *, shared_dir: Path) -> tuple[list[RankScratch], list[Fetched]]:
    """Fetch each drill rank's files into ``root/rank-R/checkpoint``.

    Each file the ranks read is fetched once, into the rank that owns it
    (:meth:`RankFiles.owners`); every other rank reading it gets, from that
    verified copy, the whole file or a sparse file holding only the byte
    ranges it reads (holes elsewhere: the worker's reader refuses to read
    them). The shared metadata, fetched beforehand into ``shared_dir``, is
    copied to every rank. So a rank's scratch holds its own shards (plus the
    small ranges of others it reads), never another rank's. Returns the
    scratches, and the fetches made.
    """
    owners = plan.owners()
    fetches: list[Fetched] = []
    scratches: list[RankScratch] = []
    for rank, need in enumerate(plan.needs):
        base = root / f"rank-{rank}"
        checkpoint, work = base / "checkpoint", base / "work"
        owned = sorted(rel for rel, owner in owners.items() if owner == rank)
        if owned:
            fetches.append(fetch(owned, checkpoint))
        checkpoint.mkdir(parents=True, exist_ok=True)
        work.mkdir(parents=True, exist_ok=True)
        for rel in plan.shared:
            dest = checkpoint / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shared_dir / rel, dest)
        available: dict[str, Any] = {rel: None for rel in owned}
        scratches.append(RankScratch(rank, base, checkpoint, work, available, sorted(need)))
    for scratch, need in zip(scratches, plan.needs, strict=True):
        for rel, ranges in need.items():
            owner = owners[rel]
            if owner == scratch.rank:
                continue
            src, dest = scratches[owner].checkpoint / rel, scratch.checkpoint / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            if ranges is None:
                shutil.copyfile(src, dest)
                scratch.available[rel] = None
            else:
                _copy_ranges(src, dest, ranges, sizes.get(rel, src.stat().st_size))
                scratch.available[rel] = [list(r) for r in ranges]
    for scratch in scratches:
        scratch.held_bytes = sum(_allocated(scratch.checkpoint / rel) for rel in scratch.available)
        scratch.needed_bytes = plan.needed_bytes(scratch.rank, sizes)
    return scratches, fetches


def _copy_ranges(src: Path, dest: Path, ranges: Sequence[tuple[int, int]], size: int) -> None:
    """``dest``: a file of ``size`` bytes holding ``src``'s bytes at ``ranges`` and holes elsewhere."""
    with src.open("rb") as fin, dest.open("wb") as fout:
        fout.truncate(size)
        for start, length in ranges:
            fin.seek(start)
            fout.seek(start)
            left = length
            while left:
                chunk = fin.read(min(left, 1 << 22))
                if not chunk:
                    raise OSError(f"{src}: ends before byte {start + length}; the fetched copy is short")
                fout.write(chunk)
                left -= len(chunk)


# --- running the workers ------------------------------------------------------------


def _listen_loopback() -> socket.socket:
    """A TCP socket listening on 127.0.0.1 at a free port, for rank 0's
    rendezvous store (bound here, so that the port cannot be taken meanwhile
    and the store is never reachable from another machine)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def rank_env(parent: Mapping[str, str], work: Path, rank: int, world: int, port: int,
             *, passthrough: Sequence[str] = ()) -> dict[str, str]:
    """A rank's environment: :func:`~ckptier.tasks.drill.worker_env` (no
    credentials, home in ``work``), the usual ``torch.distributed``
    variables, gloo and NCCL bound to the loopback interface, and one
    OpenMP thread per rank unless the parent chose (as torchrun does)."""
    env = worker_env(parent, work, passthrough=passthrough)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo",
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _stage_of(path: Path) -> str | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return text or None


def launch_ranks(
    requests: Sequence[RankRequest],
    scratches: Sequence[RankScratch],
    *,
    timeout: float,
    grace: float = STOP_GRACE_S,
    env_passthrough: Sequence[str] = (),
    python: str = sys.executable,
    poll: float = 0.05,
) -> list[RankResult]:
    """Run one worker per request, all at once; return one result per rank.

    Each worker is started as a single-rank drill is (:func:`~ckptier.tasks.drill.run_drill_subprocess`):
    the confinement launcher first (writes only beneath its ``work``
    directory), its own process group, no credentials, stdin closed. It
    dies with this process (parent-death signal). When a worker exits with
    an error (or without a result), the others get ``grace`` seconds to
    report theirs and are then killed; at ``timeout`` seconds all are
    killed. Killing is by process group, so nothing a worker started
    survives it. Never raises for what happens inside the workers.
    """
    store = _listen_loopback()
    port = store.getsockname()[1]
    procs: list[subprocess.Popen[bytes]] = []
    status_fds: list[int] = []
    started = time.perf_counter()
    spawned_at = time.time()
    try:
        for req, scratch in zip(requests, scratches, strict=True):
            req = RankRequest.from_dict({**req.to_dict(), "store_port": port,
                                         "store_fd": store.fileno() if req.rank == 0 else None})
            request_path = scratch.work / "rank-request.json"
            request_path.write_text(json.dumps(req.to_dict()))
            Path(req.result_path).unlink(missing_ok=True)
            read_fd, write_fd = os.pipe()
            status_fds.append(read_fd)
            keep = (write_fd, store.fileno()) if req.rank == 0 else (write_fd,)
            env = rank_env(os.environ, scratch.work, req.rank, req.world_size, port, passthrough=env_passthrough)
            try:
                with (scratch.work / "worker.out").open("wb") as out, (scratch.work / "worker.err").open("wb") as err:
                    procs.append(subprocess.Popen(
                        [python, "-m", "ckptier.tasks.confine", "--write", str(scratch.work), "--status-fd", str(write_fd), "--",
                         python, "-m", "ckptier.tasks.drill_dist_worker", "--request", str(request_path)],
                        cwd=scratch.work, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                        start_new_session=True, pass_fds=keep,
                    ))
            finally:
                os.close(write_fd)
        store.close()
        codes: list[int | None] = [None] * len(procs)
        order: list[int] = []
        killed_at: dict[int, str] = {}
        deadline = started + timeout
        stop_at: float | None = None
        while any(c is None for c in codes):
            now = time.perf_counter()
            for i, proc in enumerate(procs):
                if codes[i] is None and (code := proc.poll()) is not None:
                    codes[i] = code
                    order.append(i)
                    if stop_at is None and not _succeeded(code, Path(requests[i].result_path)):
                        stop_at = now + grace
            if now >= deadline or (stop_at is not None and now >= stop_at):
                why = "timeout" if now >= deadline else "stopped"
                for i, proc in enumerate(procs):
                    if codes[i] is None:
                        killed_at[i] = why
                        _kill_group(proc.pid)
                for i, proc in enumerate(procs):
                    if codes[i] is None:
                        codes[i] = proc.wait()
                        order.append(i)
                break
            time.sleep(poll)
        for proc in procs:  # anything a worker left in its group goes with it
            _kill_group(proc.pid)
    finally:
        store.close()
        for proc in procs:
            if proc.poll() is None:
                _kill_group(proc.pid)
                proc.wait()
    elapsed = time.perf_counter() - started
    results = []
    for i, (req, scratch, proc) in enumerate(zip(requests, scratches, procs, strict=True)):
        confined, confinement = _read_confinement(status_fds[i])
        os.close(status_fds[i])
        results.append(_rank_result(req, scratch, proc.returncode, killed_at.get(i), order.index(i), timeout,
                                    confined, confinement, {"subprocess_s": elapsed, "spawned_at": spawned_at}))
    return results


def _succeeded(code: int, result_path: Path) -> bool:
    if code != 0 or not result_path.is_file():
        return False
    try:
        return json.loads(result_path.read_text()).get("error") is None
    except (OSError, ValueError):
        return False


def _rank_result(req: RankRequest, scratch: RankScratch, code: int | None, killed: str | None, exit_order: int,
                 timeout: float, confined: bool, confinement: str, timings: Mapping[str, float]) -> RankResult:
    stderr_tail = _tail(scratch.work / "worker.err") or None
    stage = _stage_of(Path(req.progress_path))
    base: dict[str, Any] = {
        "rank": req.rank, "world_size": req.world_size, "checkpoint": req.checkpoint, "format": req.format,
        "steps": req.steps, "returncode": code, "stderr_tail": stderr_tail, "exit_order": exit_order,
        "last_stage": stage, "confined": confined, "confinement": confinement, "timings": dict(timings),
    }
    path = Path(req.result_path)
    if killed and path.is_file():  # it finished, and was killed in its teardown while another rank had failed
        try:
            data = json.loads(path.read_text())
        except ValueError:
            data = None
        if isinstance(data, dict) and data.get("error") is None and data.get("losses"):
            data.update({k: v for k, v in base.items() if k != "timings"})
            data["timings"] = {**(data.get("timings") or {}), **timings}
            return RankResult.from_dict(data)
    if killed == "timeout":
        return RankResult(**{**base, "timings": {**timings, "limit_s": timeout}}, timed_out=True, error_stage="timeout",
                          error=f"ran past the time limit of {timeout:g} s and was killed; raise the drill timeout or lower the steps")
    if killed == "stopped":
        return RankResult(**base, stopped=True, error_stage=stage or "start",
                          error="stopped by the drill after another rank failed")
    if not path.is_file():
        return RankResult(**base, error_stage="crash",
                          error=f"exited with code {code} without a result (last stage: {stage or 'start'}): {_last_line(stderr_tail or '')}")
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        return RankResult(**base, error_stage="crash", error=f"wrote an unreadable result ({exc})")
    data.update({k: v for k, v in base.items() if k != "timings"})
    data["timings"] = {**(data.get("timings") or {}), **timings}
    return RankResult.from_dict(data)


# --- one checkpoint, end to end ---------------------------------------------------------


@dataclass
class RankedRun:
    """One launch of a multi-rank drill: its ranks' scratches and results."""

    world: int
    device: str
    backend: str
    scratches: list[RankScratch]
    results: list[RankResult]
    fetches: list[Fetched]
    started_at: float


@dataclass
class RankedDrill:
    """A multi-rank drill of one checkpoint: the plan, the run (and the
    same-size reference run when resharding), the verdict."""

    format: str
    saved_world: int
    layout: str
    run: RankedRun
    verdict: Verdict
    reference: RankedRun | None = None

    @property
    def world(self) -> int:
        return self.run.world

    def report(self, *, job: str, step: int, device: str, started_at: datetime, finished_at: datetime) -> DrillReport:
        """The drill report of checkpoint ``job`` step ``step`` (``device``: the
        device asked for, named when the ranks did not say theirs). Its
        ``stage`` is ``factory`` when the model factory did not load in the
        workers (the caller says so instead: nothing about the checkpoint)."""
        run = self.run
        ranks = []
        for scratch, result in zip(run.scratches, run.results, strict=True):
            ranks.append(DrillRank(
                rank=result.rank, ok=not result.failed, error=result.error, stage=result.error_stage,
                losses=tuple(_finite_or_none(v) for v in result.losses), files=tuple(scratch.files),
                held_bytes=scratch.held_bytes, needed_bytes=scratch.needed_bytes,
                first_step_done_at=result.timings.get("first_step_done_at"),
                peak_memory_bytes=result.peak_memory_bytes, confined=result.confined))
        done = [r.timings["first_step_done_at"] for r in run.results if "first_step_done_at" in r.timings]
        timings: dict[str, float] = {
            "fetch_s": sum(f.seconds for f in run.fetches),
            **{k: max(r.timings.get(k, 0.0) for r in run.results) for k in ("load_s", "build_s", "restore_s", "rendezvous_s",
                                                                              "first_step_s", "steps_s", "subprocess_s")},
        }
        if len(done) == len(run.results):
            timings["time_to_first_step_s"] = max(done) - run.started_at
        zero = min(run.results, key=lambda r: r.rank)
        failed = next((c for c in self.verdict.checks if not c.ok), None)
        if failed is not None and failed.name == "completed":
            first = min((r for r in run.results if r.failed), key=lambda r: (r.stopped, r.exit_order or 0))
            error, stage = first.error, first.error_stage
        else:
            error, stage = (None, None) if failed is None else (failed.detail, "judge")
        reshard = None
        if self.reference is not None:
            resumes = next((c for c in self.verdict.checks if c.name == "resumes"), None)
            reshard = Reshard(
                from_world=self.saved_world, to_world=run.world, resumes=bool(resumes and resumes.ok),
                detail=resumes.detail if resumes else None,
                reference_losses=tuple(_finite_or_none(v)
                                       for v in min(self.reference.results, key=lambda r: r.rank).losses))
        tier = ",".join(sorted({f.tier for f in run.fetches})) or None
        ran_on = zero.device or run.device
        confined = all(r.confined for r in run.results)
        confinement = next((r.confinement for r in run.results if not r.confined), zero.confinement)
        where = (f"{tier} tier, {run.world} rank{'s' if run.world > 1 else ''} on {ran_on or device}/{run.backend}"
                 + (f", saved by {self.saved_world}" if reshard is not None else ""))
        unconfined = "" if confined else f"; {confinement}"
        return DrillReport(
            job=job, step=step, ok=self.verdict.ok,
            summary=f"{job} step {step} ({where}): {self.verdict.summary}{unconfined}",
            checks=tuple(self.verdict.checks), world_size=run.world, saved_world_size=self.saved_world,
            layout=self.layout, parallel=zero.parallel, backend=run.backend, device=ran_on, ranks=tuple(ranks),
            timings=timings, losses=tuple(_finite_or_none(v) for v in zero.losses),
            peak_memory_bytes=max((r.peak_memory_bytes or 0 for r in run.results), default=0) or None,
            confined=confined, confinement=confinement, tier=tier, error=error, stage=stage, reshard=reshard,
            started_at=started_at, finished_at=finished_at)


def run_ranked_drill(
    fmt: str,
    relpaths: Sequence[str],
    sizes: Mapping[str, int],
    *,
    fetch: FetchFn,
    scratch: Path,
    factory: str | None,
    steps: int,
    device: str,
    timeout: float,
    world_size: int | None = None,
    allow_globals: Sequence[str] = (),
    loss_tolerance: float = DEFAULT_LOSS_TOLERANCE,
    cuda_devices: int | None = None,
    env_passthrough: Sequence[str] = (),
    python: str = sys.executable,
    seed: int = 0,
    single: bool = False,
) -> RankedDrill:
    """Drill a checkpoint (format ``fmt``, files ``relpaths`` of ``sizes``)
    on as many ranks as saved it, or on ``world_size`` ranks.

    The format's manifests are fetched first (``fetch``), to plan which rank
    reads what (:meth:`~ckptier.formats.base.FormatPlugin.rank_files`); then
    each rank's files (:func:`prepare_ranks`), the workers
    (:func:`launch_ranks`), the verdict (:func:`judge_ranks`). With a
    ``world_size`` other than the saved one, a same-size restore runs first
    and the verdict says whether the run resumes on ``world_size`` ranks.
    Everything goes under ``scratch`` (the caller removes it). Raises
    :class:`ConfigError` when the checkpoint cannot be drilled on that many
    ranks (:class:`UnsupportedDrill` for partitioned ranks: not supported
    yet; ``--device cuda`` without a GPU per rank), before any shard is
    fetched.
    """
    handler = plugin(fmt)
    saved = handler.saved_ranks(relpaths)
    shared_dir = scratch / "shared"
    wanted = sorted(r for r in relpaths if "/" not in r and r in handler.metadata_names)
    fetches = [fetch(wanted, shared_dir)] if wanted else []
    shared_dir.mkdir(parents=True, exist_ok=True)

    def read(rel: str) -> bytes:
        return (shared_dir / rel).read_bytes()

    def plan_for(world: int) -> RankFiles:
        try:
            plan = handler.rank_files(relpaths, read, world)
        except ValueError as exc:
            raise ConfigError(f"{fmt} checkpoint of {saved} rank{'s' if saved > 1 else ''}: cannot drill it on {world}: {exc}") from None
        if plan.layout == PARTITIONED:
            raise UnsupportedDrill(
                f"{fmt} checkpoint of {plan.saved_world} ranks: not supported yet: its ranks hold model-parallel slices "
                "or optimizer partitions of their own; multi-rank drills restore replicated (DDP) and sharded "
                "(FSDP2, DCP) checkpoints")
        return plan

    cuda = cuda_device_count() if cuda_devices is None else cuda_devices
    world = world_size or saved
    plan = plan_for(world)
    (kind, backend), ref_choice = drill_backends(device, world, plan.saved_world, cuda)
    reference = None
    if ref_choice is not None:
        ref_plan = plan_for(plan.saved_world)
        ref_kind, ref_backend = ref_choice
        reference = _run_once(fmt, ref_plan, sizes, fetch, scratch / f"same-{plan.saved_world}", shared_dir, ref_kind,
                              ref_backend, factory=factory, steps=steps, timeout=timeout, allow_globals=allow_globals,
                              env_passthrough=env_passthrough, python=python, seed=seed, single=single)
    run = _run_once(fmt, plan, sizes, fetch, scratch / f"ranks-{world}", shared_dir, kind, backend, factory=factory,
                    steps=steps, timeout=timeout, allow_globals=allow_globals, env_passthrough=env_passthrough,
                    python=python, seed=seed, single=single)
    run.fetches[:0] = fetches
    verdict = judge_ranks(run.results, steps=steps, loss_tolerance=loss_tolerance,
                          reference=reference.results if reference is not None else None)
    return RankedDrill(fmt, plan.saved_world, plan.layout, run, verdict, reference)


def _run_once(fmt: str, plan: RankFiles, sizes: Mapping[str, int], fetch: FetchFn, root: Path, shared_dir: Path,
              kind: str, backend: str, *, factory: str | None, steps: int, timeout: float, allow_globals: Sequence[str],
              env_passthrough: Sequence[str], python: str, seed: int, single: bool) -> RankedRun:
    started = time.time()
    root.mkdir(parents=True, exist_ok=True)
    missing = [r for r in plan.shared if not (shared_dir / r).is_file()]
    fetches: list[Fetched] = []
    if missing:
        extra = root / "shared-more"
        fetches.append(fetch(missing, extra))
        for rel in missing:
            (shared_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(extra / rel), shared_dir / rel)
        shutil.rmtree(extra, ignore_errors=True)
    scratches, more = prepare_ranks(plan, sizes, fetch, root, shared_dir=shared_dir)
    fetches += more
    handler = plugin(fmt)
    requests = []
    for scratch in scratches:
        checkpoint = handler.drill_path(scratch.checkpoint, list(plan.needs[scratch.rank]), single)
        requests.append(RankRequest(
            checkpoint=str(checkpoint.resolve()), format=fmt, factory=factory, steps=steps, rank=scratch.rank,
            world_size=plan.world, saved_world=plan.saved_world, layout=plan.layout, device=kind, backend=backend,
            store_port=0, result_path=str(scratch.work / "rank-result.json"),
            progress_path=str(scratch.work / "progress"), parent_pid=os.getpid(), timeout=timeout,
            available=scratch.available, seed=seed, allow_globals=tuple(allow_globals),
        ))
    results = launch_ranks(requests, scratches, timeout=timeout, env_passthrough=env_passthrough, python=python)
    return RankedRun(plan.world, kind, backend, scratches, results, fetches, started)
