"""Tables too slow to build on every request, built in the background.

Tonight's plan (a retention plan of every job, which reads every
checkpoint, tombstones included) and the cost over time (every copy and
storage event of the catalog) take seconds on a catalog of 100,000
checkpoints, while the overview must answer in a fraction of that. So the
overview draws them from :class:`Background`: one thread builds them from a
fresh :class:`~.tables.Snapshot`, at most once per ``ttl`` seconds, and the
page says when they were built. A request waits a moment for a build in
progress (on a small catalog it finishes within that moment, so the tables
are there on the first load), never longer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import pandas as pd

from ckptier.storage.errors import CkptierError

from .source import Source
from .tables import Snapshot

log = logging.getLogger("ckptier.dashboard")

#: The tables the overview draws from the background.
TABLE_NAMES = ("tonight", "cost_history")
#: Seconds a build is reused before the next request starts another.
TTL_S = 300.0
#: Seconds a request waits for a build in progress.
WAIT_S = 1.0


@dataclass(frozen=True)
class Built:
    """One build: when (``at``, the snapshot's now), how long it took, its tables, and the error
    (one line) of each table that could not be built."""

    at: datetime
    seconds: float
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


class Background:
    """Builds :data:`TABLE_NAMES` of ``source`` in one thread, at most once per ``ttl`` seconds. Thread-safe."""

    def __init__(self, source: Source, clock: Callable[[], datetime], *, names: Sequence[str] = TABLE_NAMES,
                 ttl: float = TTL_S) -> None:
        self.source = source
        self.clock = clock
        self.names = tuple(names)
        self.ttl = ttl
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._built: Built | None = None
        self._built_mono = 0.0
        self._running = False

    def get(self, wait: float = WAIT_S) -> Built | None:
        """The newest build (None before the first one ends). Starts a build when there is
        none or the newest is older than ``ttl``, and waits up to ``wait`` seconds for it."""
        with self._lock:
            stale = self._built is None or time.monotonic() - self._built_mono > self.ttl
            if stale and not self._running:
                self._running = True
                self._done.clear()
                threading.Thread(target=self._build, name="ckptier-dashboard-background", daemon=True).start()
            running = self._running
        if running and wait > 0:
            self._done.wait(wait)
        with self._lock:
            return self._built

    def _build(self) -> None:
        started = time.monotonic()
        built: Built | None = None
        try:
            snap = Snapshot(self.source, now=self.clock())
            tables, errors = {}, {}
            for name in self.names:
                try:
                    tables[name] = snap.table(name)
                except CkptierError as exc:
                    errors[name] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            built = Built(at=snap.now, seconds=time.monotonic() - started, tables=tables, errors=errors)
        except Exception:  # noqa: BLE001 - a background thread: to the log, and the page says it failed
            log.exception("dashboard background tables failed")
            built = Built(at=self.clock(), seconds=time.monotonic() - started,
                          errors={name: "could not be built: see the dashboard's log" for name in self.names})
        finally:
            with self._lock:
                if built is not None:
                    self._built = built
                    self._built_mono = time.monotonic()
                self._running = False
                self._done.set()
