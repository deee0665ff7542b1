"""Catalog leases held by a live run: who holds them, keeping them alive, taking over from the dead.

A lease on a checkpoint row (``Catalog.claim``) is short — :data:`DEFAULT_TTL`
— and a heartbeat thread renews every lease the run holds while the run
lives, so a run killed by SIGKILL blocks other runs for one TTL at most.
A lease records its holder's process (host, pid and process start), so a run
on the same host that finds the holder's process gone (no process with that
pid, or one started at another time: the pid was reused) takes the lease
over at once. A holder on another host, or one that recorded no process, is
never judged gone: its lease simply runs out.

:func:`holder_gone` is the pure decision; :func:`this_process`,
:func:`process_start` and :func:`holder_is_gone` look at the process table.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Self, cast

from ckptier.storage.catalog.protocols import LeaseCatalog, RowClaimCatalog

if TYPE_CHECKING:
    from ckptier.storage.catalog.entries import LeaseHolder, ProcessId

log = logging.getLogger(__name__)

#: How long a lease holds without a heartbeat. Renewed every third of it.
DEFAULT_TTL = timedelta(minutes=2)

#: ``process_start`` of a process that runs but whose start cannot be told.
UNKNOWN_START = ""


# -------------------------------------------------------------------------- processes


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def process_start(pid: int) -> str | None:
    """A token of when process ``pid`` started (the same for the process's whole
    life, different for a later process reusing the pid), :data:`UNKNOWN_START`
    when it runs but the platform cannot tell when it started, or ``None``
    when no process ``pid`` runs.

    Linux: boot id and the start time in clock ticks from ``/proc/PID/stat``.
    Elsewhere: whether the pid exists only.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read().decode("ascii", "replace")
    except FileNotFoundError:
        return None
    except OSError:
        raw = ""
    if raw:
        # Field 22 (starttime) counts from 1; the command name (field 2) is in
        # parentheses and may hold spaces, so split after its closing one.
        fields = raw[raw.rfind(")") + 2 :].split()
        if fields and fields[0] in ("Z", "X"):  # exited; a zombie only awaits reaping
            return None
        if len(fields) > 19:
            return f"{_boot_id()}:{fields[19]}"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # it exists, owned by someone else
    return UNKNOWN_START


def this_process() -> ProcessId:
    """This process as a lease records it."""
    from ckptier.storage.catalog.entries import ProcessId  # lazy: `ckptier latest` imports DEFAULT_TTL only

    start = process_start(os.getpid())
    return ProcessId(host=socket.gethostname(), pid=os.getpid(), started=start or None)


def holder_gone(holder: LeaseHolder, *, host: str, start_now: str | None) -> bool:
    """True only when the holder's process is provably gone. Pure.

    ``host`` is this machine's name; ``start_now`` what :func:`process_start`
    says of the holder's pid here and now. Gone means: the holder recorded a
    process on this host, and no process runs under its pid, or one runs
    that started at another time than the holder recorded. A holder on
    another host, one without a recorded process, or a start that cannot be
    compared, is alive (its lease runs out instead).
    """
    proc = holder.process
    if proc is None or proc.host != host:
        return False
    if start_now is None:
        return True
    return bool(proc.started) and bool(start_now) and start_now != proc.started


def holder_is_gone(holder: LeaseHolder) -> bool:
    """:func:`holder_gone` for this host and the live process table."""
    if holder.process is None:
        return False
    return holder_gone(holder, host=socket.gethostname(), start_now=process_start(holder.process.pid))


# ----------------------------------------------------------------------------- leases


@dataclass
class Lease:
    """One lease this run holds: the checkpoint, the generation it claimed,
    when it runs out (moved on by each heartbeat) and whether a heartbeat
    found it lost (expired or taken over)."""

    checkpoint_id: int
    generation: int
    expires: datetime
    lost: bool = False


class LeaseKeeper:
    """Claims, renews (a heartbeat thread) and releases the leases of one run.

    ``catalog`` is a :class:`~ckptier.storage.catalog.api.Catalog` (or
    anything with its ``claim``/``renew``/``release``/``lease_holder``:
    :class:`LeaseCatalog`);
    ``now()`` the clock (aware UTC), also used by the heartbeat; ``ttl`` the
    lease length. The heartbeat renews every held lease each ``ttl / 3``
    seconds of real time (``heartbeat`` overrides the interval) and marks a
    lease it cannot renew as lost. ``take_over`` decides whether a live
    lease's holder is gone (default :func:`holder_is_gone`). Use as a
    context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        catalog: LeaseCatalog,
        owner: str,
        *,
        now: Callable[[], datetime],
        ttl: timedelta = DEFAULT_TTL,
        process: ProcessId | None = None,
        take_over: Callable[[LeaseHolder], bool] | None = holder_is_gone,
        heartbeat: float | None = None,
    ) -> None:
        if ttl <= timedelta(0):
            raise ValueError(f"lease ttl={ttl} must be positive")
        self.catalog = catalog
        self.owner = owner
        self.now = now
        self.ttl = ttl
        self.process = process
        self.take_over = take_over
        self.interval = heartbeat if heartbeat is not None else ttl.total_seconds() / 3
        self._held: dict[int, Lease] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def claim(self, checkpoint_id: int) -> Lease | None:
        """The lease on ``checkpoint_id``, or None when another live run holds it."""
        t = self.now()
        gen = self.catalog.claim(checkpoint_id, self.owner, now=t, ttl=self.ttl, process=self.process,
                                 take_over=self.take_over)
        if gen is None:
            return None
        lease = Lease(checkpoint_id, gen, t + self.ttl)
        with self._lock:
            self._held[checkpoint_id] = lease
            if self._thread is None:
                self._thread = threading.Thread(target=self._beat, name="ckptier-lease-heartbeat", daemon=True)
                self._thread.start()
        return lease

    def claim_rows(self, ids: list[int], *, since: datetime, limit: int) -> list[Lease]:
        """Leases on up to ``limit`` of ``ids`` that are free and not checked since ``since``
        (``Catalog.claim_rows``), kept alive by the heartbeat like :meth:`claim`'s."""
        t = self.now()
        got = cast(RowClaimCatalog, self.catalog).claim_rows(ids, self.owner, now=t, ttl=self.ttl, since=since, limit=limit,
                                      process=self.process)
        leases = [Lease(cid, gen, t + self.ttl) for cid, gen in got]
        with self._lock:
            for lease in leases:
                self._held[lease.checkpoint_id] = lease
            if leases and self._thread is None:
                self._thread = threading.Thread(target=self._beat, name="ckptier-lease-heartbeat", daemon=True)
                self._thread.start()
        return leases

    def settled(self, lease: Lease) -> None:
        """Stop renewing ``lease``: the catalog released it itself (a fenced write that ends the claim)."""
        with self._lock:
            self._held.pop(lease.checkpoint_id, None)

    def holder(self, checkpoint_id: int) -> LeaseHolder | None:
        """Who holds ``checkpoint_id`` now (to say who a skipped item waits for)."""
        result: LeaseHolder | None = self.catalog.lease_holder(checkpoint_id, now=self.now())
        return result

    def valid(self, lease: Lease) -> bool:
        """True while the lease is ours: not found lost and not run out."""
        return not lease.lost and self.now() < lease.expires

    def release(self, lease: Lease) -> bool:
        """Give the lease back; False when it was no longer ours."""
        with self._lock:
            self._held.pop(lease.checkpoint_id, None)
        released: bool = self.catalog.release(lease.checkpoint_id, self.owner, lease.generation)
        return released

    def renew_all(self) -> None:
        """One heartbeat: renew every held lease now (the thread calls this)."""
        with self._lock:
            held = list(self._held.values())
        for lease in held:
            if lease.lost:
                continue
            try:
                expires = self.catalog.renew(lease.checkpoint_id, self.owner, lease.generation, now=self.now(),
                                             ttl=self.ttl)
            except Exception as exc:  # noqa: BLE001 - a missed beat is survivable; expiry still fences
                log.warning("lease heartbeat for checkpoint %s failed: %s", lease.checkpoint_id, exc)
                continue
            if expires is None:
                lease.lost = True
                log.warning("lease on checkpoint %s was lost (expired or taken over)", lease.checkpoint_id)
            else:
                lease.expires = expires

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            self.renew_all()

    def close(self) -> None:
        """Stop the heartbeat (held leases are not released: callers release them)."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=max(self.interval, 1.0) + 5.0)
