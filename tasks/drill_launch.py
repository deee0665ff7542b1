"""Launching restore drills: the workers of one checkpoint, 1..N ranks.

A checkpoint written by N ranks is drilled by N worker processes (or M, to
check that it resumes on M GPUs), one per rank; a single-rank checkpoint by
one. Each worker (``ckptier.tasks.drill_worker``) runs from its own scratch
directory holding only what its rank reads; several ranks rendezvous on
127.0.0.1 and restore with ``torch.distributed`` (gloo on CPU, NCCL when
there is a CUDA device per rank). Pieces, no torch here:

* :func:`choose_backend`, :func:`drill_backends` - pure: the device kind
  and backend for a world size, and for a resharding drill's reference.
* :func:`prepare_ranks` - fetches each rank's files (the format's
  :meth:`~ckptier.formats.base.FormatPlugin.rank_files`) into its scratch
  directory: each file crosses the network once, to the rank that reads it
  whole (or most of it); another rank needing only some byte ranges of it
  gets those ranges copied from that verified copy into a sparse file.
* :func:`launch_ranks` - starts the workers, each confined to its own work
  directory (Landlock, where the kernel has it) with a credential-free
  environment, a time limit and its own process group, and stops all of
  them (whole process groups) as soon as one fails, or at the time limit.
  :func:`run_drill_subprocess` is one worker on a local copy.
* :func:`run_ranked_drill` - all of it for one checkpoint, the verdict
  (:func:`~ckptier.tasks.drill.judge`), plus the resharding comparison
  (``world_size`` M against a same-size restore).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from ckptier.formats.base import PARTITIONED, RankFiles
from ckptier.formats.registry import plugin
from ckptier.storage.errors import ConfigError
from ckptier.tasks.config import DEFAULT_DRILL_STEPS, DEFAULT_DRILL_TIMEOUT, parse_factory_spec
from ckptier.tasks.drill import (
    DEFAULT_LOSS_TOLERANCE,
    DrillRequest,
    Expected,
    Verdict,
    WorkerResult,
    _finite_or_none,
    judge,
    worker_env,
)
from ckptier.tasks.reports import DrillRank, DrillReport, Reshard

STOP_GRACE_S = 3.0
"""Seconds the other ranks get, once one rank has failed, to report their
own errors before the drill stops them."""


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
    as in :class:`DrillRequest`; ``held_bytes`` the disk its shards take
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
    variables, gloo and NCCL bound to the loopback interface, and, when
    there are several ranks, one OpenMP thread per rank unless the parent
    chose (as torchrun does)."""
    env = worker_env(parent, work, passthrough=passthrough)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo",
    )
    if world > 1:  # ranks share the cores
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
    requests: Sequence[DrillRequest],
    scratches: Sequence[RankScratch],
    *,
    timeout: float,
    grace: float = STOP_GRACE_S,
    env_passthrough: Sequence[str] = (),
    python: str = sys.executable,
    poll: float = 0.05,
) -> list[WorkerResult]:
    """Run one worker per request, all at once; return one result per rank.

    Each worker is started the same way: the confinement launcher first (writes only beneath its ``work``
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
            req = DrillRequest.from_dict({**req.to_dict(), "store_port": port,
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
                         python, "-m", "ckptier.tasks.drill_worker", "--request", str(request_path)],
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


def _rank_result(req: DrillRequest, scratch: RankScratch, code: int | None, killed: str | None, exit_order: int,
                 timeout: float, confined: bool, confinement: str, timings: Mapping[str, float]) -> WorkerResult:
    stderr_tail = _tail(scratch.work / "worker.err") or None
    stage = _stage_of(Path(req.progress_path)) if req.progress_path else None
    worker = "the drill worker " if req.world_size == 1 else ""
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
            return WorkerResult.from_dict(data)
    if killed == "timeout":
        return WorkerResult(**{**base, "timings": {**timings, "limit_s": timeout}}, timed_out=True, error_stage="timeout",
                          error=f"{worker}ran past the time limit of {timeout:g} s and was killed; raise the drill timeout or lower the steps")
    if killed == "stopped":
        return WorkerResult(**base, stopped=True, error_stage=stage or "start",
                          error="stopped by the drill after another rank failed")
    if not path.is_file():
        return WorkerResult(**base, error_stage="crash",
                          error=f"{worker}exited with code {code} without a result (last stage: {stage or 'start'}): {_last_line(stderr_tail or '')}")
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        return WorkerResult(**base, error_stage="crash", error=f"{worker}wrote an unreadable result ({exc})")
    data.update({k: v for k, v in base.items() if k != "timings"})
    data["timings"] = {**(data.get("timings") or {}), **timings}
    return WorkerResult.from_dict(data)


def run_drill_subprocess(
    checkpoint: Path,
    fmt: str,
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
    """One worker (world size 1) on a local copy of a checkpoint; what it measured.

    ``checkpoint`` is the local copy (a step directory, or a Lightning
    ``.ckpt``), normally already fetched into ``scratch``, which becomes
    the worker's working directory and home (:func:`launch_ranks`: its own
    process group, killed whole after ``timeout`` seconds, writes confined
    beneath ``scratch`` where the kernel offers Landlock). It trains twice
    from a fresh restore (the ``deterministic`` check). Never raises for
    what happens inside the worker; raises :class:`ConfigError` for bad
    arguments.
    """
    if steps < 1:
        raise ConfigError(f"drill steps {steps} must be at least 1; use --steps 5 for example")
    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise ConfigError(f"drill device {device!r} is unknown; use auto, cpu or cuda")
    if timeout <= 0:
        raise ConfigError(f"drill timeout {timeout} must be positive seconds")
    if factory is not None:
        parse_factory_spec(factory)
    work = Path(scratch).resolve()
    (work / "tmp").mkdir(parents=True, exist_ok=True)
    request = DrillRequest(
        checkpoint=str(Path(checkpoint).resolve()), format=str(getattr(fmt, "value", fmt)), factory=factory,
        steps=steps, device=device, result_path=str(work / "drill-result.json"), seed=seed,
        allow_globals=tuple(allow_globals), progress_path=str(work / "progress"), parent_pid=os.getpid(),
        timeout=timeout, repeat=True,
    )
    place = RankScratch(0, work, Path(request.checkpoint), work, {}, [])
    (result,) = launch_ranks([request], [place], timeout=timeout, env_passthrough=env_passthrough, python=python)
    return result


# --- one checkpoint, end to end ---------------------------------------------------------


@dataclass
class RankedRun:
    """One launch of a drill's workers: its ranks' scratches and results."""

    world: int
    device: str
    backend: str
    scratches: list[RankScratch]
    results: list[WorkerResult]
    fetches: list[Fetched]
    started_at: float


@dataclass
class RankedDrill:
    """A drill of one checkpoint on 1..N ranks: the plan, the run (and the
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

    @property
    def single(self) -> bool:
        """One rank of a single-rank checkpoint: reported as a single-rank drill (no rank fields)."""
        return self.run.world == 1 and self.saved_world == 1 and self.reference is None

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
        if self.single:
            return DrillReport(
                job=job, step=step, ok=self.verdict.ok,
                summary=f"{job} step {step} ({tier} tier, {ran_on or device}): {self.verdict.summary}{unconfined}",
                checks=tuple(self.verdict.checks), device=zero.device, tier=tier,
                timings={"fetch_s": timings["fetch_s"], **{k: float(v) for k, v in zero.timings.items()}},
                peak_memory_bytes=zero.peak_memory_bytes, losses=tuple(_finite_or_none(v) for v in zero.losses),
                error=zero.error, stage=zero.error_stage, confined=zero.confined, confinement=zero.confinement,
                trained_steps=zero.trained_steps, stack=dict(zero.stack), started_at=started_at, finished_at=finished_at)
        return DrillReport(
            job=job, step=step, ok=self.verdict.ok,
            summary=f"{job} step {step} ({where}): {self.verdict.summary}{unconfined}",
            checks=tuple(self.verdict.checks), world_size=run.world, saved_world_size=self.saved_world,
            layout=self.layout, parallel=zero.parallel, backend=run.backend, device=ran_on, ranks=tuple(ranks),
            timings=timings, losses=tuple(_finite_or_none(v) for v in zero.losses),
            peak_memory_bytes=max((r.peak_memory_bytes or 0 for r in run.results), default=0) or None,
            confined=confined, confinement=confinement, tier=tier, error=error, stage=stage, reshard=reshard,
            trained_steps=zero.trained_steps, stack=dict(zero.stack), started_at=started_at, finished_at=finished_at)


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
    step: int | None = None,
    trajectory: Expected | None = None,
) -> RankedDrill:
    """Drill a checkpoint (format ``fmt``, files ``relpaths`` of ``sizes``)
    on as many ranks as saved it, or on ``world_size`` ranks.

    The format's manifests are fetched first (``fetch``), to plan which rank
    reads what (:meth:`~ckptier.formats.base.FormatPlugin.rank_files`); then
    each rank's files (:func:`prepare_ranks`), the workers
    (:func:`launch_ranks`), the verdict (:func:`~ckptier.tasks.drill.judge`). With a
    ``world_size`` other than the saved one, a same-size restore runs first
    and the verdict says whether the run resumes on ``world_size`` ranks.
    ``step`` (the catalog's) is what every rank trains on from and every
    factory is told; ``trajectory`` what the run recorded after it, for the
    verdict's ``trajectory`` check.
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
                              env_passthrough=env_passthrough, python=python, seed=seed, single=single, step=step)
    run = _run_once(fmt, plan, sizes, fetch, scratch / f"ranks-{world}", shared_dir, kind, backend, factory=factory,
                    steps=steps, timeout=timeout, allow_globals=allow_globals, env_passthrough=env_passthrough,
                    python=python, seed=seed, single=single, step=step)
    run.fetches[:0] = fetches
    verdict = judge(run.results, steps=steps, loss_tolerance=loss_tolerance,
                    reference=reference.results if reference is not None else None, trajectory=trajectory)
    return RankedDrill(fmt, plan.saved_world, plan.layout, run, verdict, reference)


def _run_once(fmt: str, plan: RankFiles, sizes: Mapping[str, int], fetch: FetchFn, root: Path, shared_dir: Path,
              kind: str, backend: str, *, factory: str | None, steps: int, timeout: float, allow_globals: Sequence[str],
              env_passthrough: Sequence[str], python: str, seed: int, single: bool, step: int | None) -> RankedRun:
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
        requests.append(DrillRequest(
            checkpoint=str(checkpoint.resolve()), format=fmt, factory=factory, steps=steps, rank=scratch.rank,
            world_size=plan.world, saved_world=plan.saved_world, layout=plan.layout, device=kind, backend=backend,
            store_port=0, result_path=str(scratch.work / "rank-result.json"),
            progress_path=str(scratch.work / "progress"), parent_pid=os.getpid(), timeout=timeout,
            available=scratch.available, seed=seed, allow_globals=tuple(allow_globals),
            repeat=plan.world == 1 and plan.saved_world == 1, step=step,
        ))
    results = launch_ranks(requests, scratches, timeout=timeout, env_passthrough=env_passthrough, python=python)
    return RankedRun(plan.world, kind, backend, scratches, results, fetches, started)
