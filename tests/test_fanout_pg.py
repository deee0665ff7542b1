"""Many workers, one PostgreSQL catalog: worker processes claim rows under leases.

Every checkpoint is verified (read for real, from small local files) and
recorded by exactly one worker; a worker killed with SIGKILL while holding
claims loses them when its lease runs out, and the others finish its rows.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from ckptier.storage.catalog.api import Catalog
from ckptier.storage.records import State

from tests.fixtures.pg import fresh_database
from tests.test_fanout import make_tree, scanned

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

#: One worker: verify (deep) every row it can claim, then write the (job, step) it recorded.
WORKER = """
import json, sys, time
from datetime import UTC, datetime, timedelta
from ckptier.storage.catalog.api import Catalog
from ckptier.tasks.pipeline import VerifyOptions, run_verify
from ckptier.tasks.run import RowClaims, Run, StoreCache

url, since, owner, out, lease_s, slow = sys.argv[1:7]

class SlowStores(StoreCache):
    # A store that takes a minute to open: the worker is killed while it holds its claims.
    def for_record(self, record):
        time.sleep(60)
        return super().for_record(record)

with Catalog.open(url, create=False) as cat:
    report = run_verify(Run.of(cat, stores=SlowStores() if slow == "1" else None),
                        VerifyOptions(deep=True, claims=RowClaims(owner=owner, since=datetime.fromisoformat(since),
                                                                  ttl=timedelta(seconds=float(lease_s)), batch=10,
                                                                  poll=0.2)))
with open(out, "w") as fh:
    json.dump([[r.job, r.step, r.state] for r in report.checkpoints], fh)
"""


@pytest.fixture
def pg_url(pg_server: Any) -> Iterator[str]:
    with fresh_database(pg_server, "ckptier_fanout") as url:
        yield url


def start(url: str, since: datetime, owner: str, out: Path, *, lease_s: float, slow: bool = False) -> subprocess.Popen[bytes]:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-c", WORKER, url, since.isoformat(), owner, str(out), str(lease_s),
                             "1" if slow else "0"], env=env, stderr=subprocess.PIPE)


def finish(procs: list[subprocess.Popen[bytes]], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        assert p.returncode == 0, err.decode(errors="replace")[-3000:]


def recorded(outs: list[Path]) -> Counter[tuple[str, int]]:
    return Counter((job, step) for out in outs for job, step, _ in json.loads(out.read_text()))


def test_four_workers_verify_a_thousand_checkpoints_each_exactly_once(pg_url: str, tmp_path: Path) -> None:
    with scanned(make_tree(tmp_path / "hot", 1000, size=64), pg_url) as cat:
        assert len(cat.checkpoints()) == 1000
    since = datetime.now(UTC)
    outs = [tmp_path / f"w{i}.json" for i in range(4)]
    finish([start(pg_url, since, f"w{i}", outs[i], lease_s=30) for i in range(4)])
    counts = recorded(outs)
    assert len(counts) == 1000 and set(counts.values()) == {1}  # none lost, none twice
    per_worker = [len(json.loads(o.read_text())) for o in outs]
    assert sum(per_worker) == 1000 and sum(n > 0 for n in per_worker) >= 2, per_worker  # the work was shared
    with Catalog.open(pg_url, create=False) as cat:
        rows = cat.checkpoints()
        assert all(c.state == State.VERIFIED for c in rows)
        assert cat.unchecked([c.id for c in rows], since=since) == 0
        assert all(cat.lease_holder(c.id, now=datetime.now(UTC)) is None for c in rows)


def test_a_killed_workers_claims_are_finished_by_the_others_after_its_lease(pg_url: str, tmp_path: Path) -> None:
    with scanned(make_tree(tmp_path / "hot", 60, size=64), pg_url) as cat:
        ids = [c.id for c in cat.checkpoints()]
        since = datetime.now(UTC)
        victim = start(pg_url, since, "victim", tmp_path / "victim.json", lease_s=3, slow=True)
        deadline = time.monotonic() + 60
        # Wait until the victim holds its whole first batch of 10 (and not just some of it, on a loaded machine).
        while len(held := [i for i in ids if (h := cat.lease_holder(i, now=datetime.now(UTC))) and h.owner == "victim"]) < 10:
            assert time.monotonic() < deadline and victim.poll() is None, f"the victim holds {len(held)} of 10 rows"
            time.sleep(0.1)
        os.kill(victim.pid, signal.SIGKILL)  # mid-claim: its batch is leased, nothing recorded
        victim.wait(timeout=30)
        killed_at = datetime.now(UTC)
        outs = [tmp_path / f"w{i}.json" for i in range(2)]
        finish([start(pg_url, since, f"w{i}", outs[i], lease_s=3) for i in range(2)])
        counts = recorded(outs)
        assert len(counts) == 60 and set(counts.values()) == {1}
        steps_held = {c.step for c in cat.get_many(held)}
        assert steps_held <= {step for _, step in counts} and len(steps_held) >= 10
        # Its rows were verified only once its lease had run out.
        for c in cat.get_many(held):
            assert c.state == State.VERIFIED and c.verified_at is not None and c.verified_at > killed_at
        assert not (tmp_path / "victim.json").exists()
