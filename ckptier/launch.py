"""What a training script or a launcher calls to resume: :func:`resume` and
:func:`resume_distributed` (exported from :mod:`ckptier` itself).

Both answer with a :class:`~ckptier.tasks.resume.Resume` (the path to load
from, the step, how it was proven, what was passed over) or raise
:class:`~ckptier.tasks.resume.ResumeError`; see :mod:`ckptier.tasks.resume`
for how the checkpoint is chosen and proven. Neither imports torch or
Prefect: :func:`resume_distributed` uses ``torch.distributed`` only when the
training script has already initialized a process group, and otherwise
meets the other ranks through files in a shared directory.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptier.tasks.config import Config
    from ckptier.tasks.resume import Resume, VerifyMode

__all__ = ["RENDEZVOUS_ENV", "ATTEMPT_ENV", "resume", "resume_distributed"]

#: The shared directory of the file rendezvous when no argument names one.
RENDEZVOUS_ENV = "CKPTIER_RESUME_RENDEZVOUS"
#: What tells one launch of a job from the next in the file rendezvous (default: the launcher's own ids).
ATTEMPT_ENV = "CKPTIER_RESUME_ATTEMPT"
#: Seconds the file rendezvous waits for rank 0's answer and for every rank at the barrier.
DEFAULT_TIMEOUT = 600.0


def resume(job: str, *, catalog: str | None = None, config: str | os.PathLike[str] | Config | None = None,
           dest: str | os.PathLike[str] | None = None, verify: VerifyMode = "full", drilled: bool = False) -> Resume:
    """The newest checkpoint of ``job`` proven now, and the path to load it from.

    ``catalog``: the catalog URL (default: ``$CKPTIER_CATALOG_URL``, else
    ``[catalog] url`` in ``ckptier.toml``, else the user's default, as every
    command); ``config``: a ``ckptier.toml`` path or a loaded config;
    ``dest``: where a checkpoint without a hot copy is fetched (into
    ``dest/{job}/step-{step:08d}``); ``verify``: ``"full"`` reads it now (or
    checks the store's checksums), ``"quick"`` stats each file;
    ``drilled``: only one whose most recent restore drill passed. Recorded in
    the catalog as a recovery event. Raises
    :class:`~ckptier.tasks.resume.ResumeError` when nothing can be proven
    (a first launch: start from scratch), another
    :class:`~ckptier.storage.errors.CkptierError` (one line) for a catalog
    or config that cannot be used, and ``ValueError`` for a bad ``verify``.
    """
    from ckptier.tasks.resume import ResumeOptions, run_resume
    from ckptier.tasks.run import open_run
    from ckptier.tasks.settings import Settings

    options = ResumeOptions(job=job, dest=Path(dest) if dest is not None else None, verify=verify, drilled=drilled)
    if isinstance(config, str | os.PathLike):
        settings = Settings(catalog, os.fspath(config))
    else:  # None (the default file) or a Config already read
        settings = Settings(catalog, None, config=config)
    if options.needs_config:
        settings.config  # noqa: B018 - read now: a broken file is reported before the catalog is touched
    # A quick resume that fetches nothing never reads the config (nor imports its parser), as `ckptier resume --quick`.
    with open_run(settings, owner="ckptier-resume", config_on_use=True) as run:
        return run_resume(run, options)


def resume_distributed(job: str, *, catalog: str | None = None,
                       config: str | os.PathLike[str] | Config | None = None, dest: str | os.PathLike[str] | None = None,
                       verify: VerifyMode = "full", drilled: bool = False,
                       rendezvous: str | os.PathLike[str] | None = None, rank: int | None = None,
                       world_size: int | None = None, attempt: str | None = None,
                       timeout: float = DEFAULT_TIMEOUT) -> Resume:
    """:func:`resume` for every rank of a job: rank 0 resolves (and fetches),
    every rank gets the same answer, or the same :class:`~ckptier.tasks.resume.ResumeError`,
    and all meet at a barrier before it returns.

    With an initialized ``torch.distributed`` process group the answer is
    broadcast over it (``broadcast_object_list`` from rank 0, then
    ``barrier``); ``rank``, ``world_size`` and ``rendezvous`` are then not
    used. Without one, ranks meet through files in ``rendezvous`` (default
    ``$CKPTIER_RESUME_RENDEZVOUS``), a directory every rank sees: rank 0
    writes the answer (atomically: a temporary file renamed), the others wait
    up to ``timeout`` seconds for it, then each marks the barrier.
    ``rank``/``world_size`` default to ``$RANK``/``$WORLD_SIZE`` (torchrun),
    else ``$SLURM_PROCID``/``$SLURM_NTASKS``, else 0/1 (a single process
    needs no rendezvous). ``attempt`` names this launch, so that a later
    launch never reads an earlier answer (default ``$CKPTIER_RESUME_ATTEMPT``,
    else torchelastic's run id and restart count, else SLURM's job id and
    restart count); without any, use a new directory per launch.
    """
    if timeout <= 0:
        raise ValueError(f"timeout={timeout!r}: must be a positive number of seconds, e.g. 600")

    def answer() -> dict[str, Any]:
        return _answer(lambda: resume(job, catalog=catalog, config=config, dest=dest, verify=verify, drilled=drilled))

    dist = _process_group()
    if dist is not None:
        box: list[Any] = [answer() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        dist.barrier()
        return _unpack(box[0], job)
    rank, world = _rank_world(rank, world_size)
    if world == 1:
        return _unpack(answer(), job)
    where = rendezvous if rendezvous is not None else os.environ.get(RENDEZVOUS_ENV)
    if not where:
        raise ValueError(f"rank {rank} of {world}: no torch.distributed process group and no rendezvous directory; "
                         f"pass rendezvous=DIR (or set {RENDEZVOUS_ENV}) on a filesystem every rank sees")
    meeting = _Meeting(Path(where), job, attempt if attempt is not None else _attempt_id(), rank, world, timeout)
    payload = meeting.publish(answer()) if rank == 0 else meeting.receive()
    meeting.barrier()
    return _unpack(payload, job)


# ------------------------------------------------------------------ helpers


def _process_group() -> Any:
    """``torch.distributed`` when the script initialized a process group, else None
    (torch is never imported here: a script that uses it has imported it)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def _rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    env = os.environ
    if rank is None:
        rank = int(env.get("RANK") or env.get("SLURM_PROCID") or 0)
    if world_size is None:
        world_size = int(env.get("WORLD_SIZE") or env.get("SLURM_NTASKS") or 1)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world size {world_size}: a rank is 0 .. world size - 1")
    return rank, world_size


def _attempt_id() -> str:
    env = os.environ
    if env.get(ATTEMPT_ENV):
        return env[ATTEMPT_ENV]
    if env.get("TORCHELASTIC_RUN_ID"):
        return f"{env['TORCHELASTIC_RUN_ID']}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if env.get("SLURM_JOB_ID"):
        return f"{env['SLURM_JOB_ID']}.{env.get('SLURM_RESTART_COUNT', '0')}"
    return "0"


def _answer(call: Any) -> dict[str, Any]:
    """Rank 0's answer as plain data: the resume, or the error every rank raises."""
    from ckptier.storage.errors import CkptierError

    try:
        return {"ok": True, "resume": call().to_json()}
    except CkptierError as exc:
        return {"ok": False, "error": " ".join(str(exc).split()),
                "passed_over": [{"step": s, "reason": r} for s, r in getattr(exc, "passed_over", ())]}
    except Exception as exc:  # noqa: BLE001 - the other ranks must hear of it, not hang
        return {"ok": False, "error": f"rank 0 failed: {type(exc).__name__}: {' '.join(str(exc).split())}",
                "passed_over": []}


def _unpack(payload: dict[str, Any], job: str) -> Resume:
    from ckptier.tasks.resume import Resume, ResumeError

    if payload.get("ok"):
        return Resume.from_json(payload["resume"])
    raise ResumeError(payload["error"], job=job,
                      passed_over=[(int(p["step"]), str(p["reason"])) for p in payload.get("passed_over", [])])


class _Meeting:
    """The file rendezvous of one launch: ``resume-{job}-{attempt}.json`` written by
    rank 0, and one ``.done-{rank}`` file per rank at the barrier."""

    def __init__(self, root: Path, job: str, attempt: str, rank: int, world: int, timeout: float) -> None:
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{job}-{attempt}")
        self.root, self.job, self.rank, self.world, self.timeout = root, job, rank, world, timeout
        self.answer = root / f"resume-{safe}.json"

    def publish(self, payload: dict[str, Any]) -> dict[str, Any]:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{self.answer.name}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as out:
            json.dump(payload, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.answer)
        return payload

    def receive(self) -> dict[str, Any]:
        if not self._wait(lambda: self.answer.exists()):
            raise _timeout(self.job, f"rank {self.rank}: no answer from rank 0 within {self.timeout:g} s ({self.answer} "
                           "not written); check that rank 0 runs with the same rendezvous directory and attempt")
        with open(self.answer, encoding="utf-8") as src:
            data: dict[str, Any] = json.load(src)
        return data

    def barrier(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / f"{self.answer.name}.done-{self.rank}").touch()
        done = [self.root / f"{self.answer.name}.done-{r}" for r in range(self.world)]
        if not self._wait(lambda: all(p.exists() for p in done)):
            missing = [r for r, p in enumerate(done) if not p.exists()]
            raise _timeout(self.job, f"rank {self.rank}: ranks {missing} did not reach the barrier in {self.root} within "
                           f"{self.timeout:g} s; check that every rank calls resume_distributed")

    def _wait(self, ready: Any) -> bool:
        deadline, delay = time.monotonic() + self.timeout, 0.005
        while not ready():
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.25)
        return True


def _timeout(job: str, message: str) -> Exception:
    from ckptier.tasks.resume import ResumeError

    return ResumeError(message, job=job)
