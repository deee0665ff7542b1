"""One definition of "the most recent drill of a checkpoint" (``transitions.latest_drill``).

The catalog's last drill of a checkpoint (its proof, ``latest --drilled``), the
retention floor ``min_drilled``, the dashboard and the recovery point of the
cost tables all read it: a checkpoint that ``latest --drilled`` names as the
resume point is the one ``min_drilled`` keeps, ties included.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from ckptier.storage.catalog.api import Catalog, DrillRecord
from ckptier.storage.transitions import drill_order, latest_drill, latest_drills
from ckptier.tasks.config import parse_config
from ckptier.tasks.pipeline import make_plan, run_scan, run_verify
from ckptier.tasks.retention import drill_passed
from ckptier.tasks.run import Run

from .test_fanout import make_tree

T = datetime(2026, 3, 1, 12, tzinfo=UTC)
M = timedelta(minutes=1)


@dataclass(frozen=True)
class D:
    """A drill as the rules read it (the catalog's DrillRecord fits)."""

    checkpoint_id: int | None
    ok: bool
    started_at: datetime
    finished_at: datetime | None
    id: int | None = None
    judged: bool = True


# ------------------------------------------------------------------ the rule, as a table


@pytest.mark.parametrize(("drills", "latest", "why"), [
    ([], None, "no drill"),
    ([D(1, True, T, T + M, 1), D(1, False, T + M, T + 2 * M, 2)], 2, "the later start"),
    ([D(1, False, T + M, T + 2 * M, 1), D(1, True, T, T + 9 * M, 2)], 1, "the later start, whatever the finish"),
    ([D(1, True, T, T + 2 * M, 1), D(1, False, T, T + M, 2)], 1, "same start: the later finish"),
    ([D(1, True, T, None, 1), D(1, False, T, T + M, 2)], 2, "an unfinished drill counts at its start"),
    ([D(1, False, T, T + M, 1), D(1, True, T, T + M, 2)], 1, "same instant: the failure (never trust the tie)"),
    ([D(1, True, T, T + M, 1), D(1, False, T, T + M, 2)], 2, "same instant, the other recording order"),
])
def test_the_most_recent_drill(drills: list[D], latest: int | None, why: str) -> None:
    got = latest_drill(drills)
    assert (got.id if got is not None else None) == latest, why
    for _ in range(5):
        shuffled = random.sample(drills, len(drills))
        assert latest_drill(shuffled) == got, f"{why}: order-independent"


def test_drill_order_puts_a_failure_after_a_pass_at_the_same_instant() -> None:
    passed, failed = D(1, True, T, T + M, 7), D(1, False, T, T + M, 3)
    assert drill_order(failed) > drill_order(passed)
    assert drill_order(D(1, False, T, T + M, 3)) < drill_order(D(1, True, T, T + 2 * M, 1))
    twins = [D(1, True, T, T + M, 1), D(1, True, T, T + M, 2)]  # the same verdict at the same instant
    assert latest_drill(twins) is twins[0] and latest_drill(twins[::-1]) is twins[1]  # the first given


def test_latest_drills_per_checkpoint() -> None:
    drills = [D(1, True, T, T + M, 1), D(2, False, T, T + M, 2), D(1, False, T + M, None, 3), D(None, True, T, T, 4)]
    assert {cid: d.id for cid, d in latest_drills(drills).items()} == {1: 3, 2: 2}
    assert drill_passed(drills) == {}
    assert drill_passed([*drills, D(2, True, T + M, T + 2 * M, 5)]) == {2: T + 2 * M}


# ------------------------------------------------------------------ the catalog and retention agree


def _drill(cat: Catalog, checkpoint_id: int, step: int, ok: bool, started: datetime, finished: datetime) -> None:
    cat.record_drill(DrillRecord(job="fan", step=step, checkpoint_id=checkpoint_id, started_at=started,
                                 finished_at=finished, ok=ok, device="cpu", source_tier="hot",
                                 error=None if ok else "restore: shapes differ"))


@pytest.mark.parametrize("first", ["failure", "pass"])
def test_min_drilled_keeps_exactly_the_checkpoint_latest_drilled_names(tmp_path: Path, first: str) -> None:
    """A pass and a failure of step 3 at the very same start and finish (recorded in
    either order), an older pass of step 2, step 4 never drilled: ``latest --drilled``
    and ``min_drilled`` must name the same recovery point, and it is not deleted."""
    make_tree(tmp_path / "hot", 4)
    config = parse_config('[[policy]]\njobs = "*"\nkeep_last = 1\nmin_drilled = 1\n')
    with Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
        run = Run.of(cat, config=config)
        run_scan(run, [str(tmp_path / "hot")])
        run_verify(run)
        ids = {c.step: c.id for c in cat.checkpoints(job="fan")}
        old, tie = T - timedelta(days=2), T - timedelta(days=1)
        _drill(cat, ids[2], 2, True, old, old + 5 * M)
        for ok in ((False, True) if first == "failure" else (True, False)):
            _drill(cat, ids[3], 3, ok, tie, tie + 5 * M)
        resume = cat.choose_latest("fan", drilled=True).record
        plan = make_plan(run, job="fan")
    assert resume is not None
    floor = [i.step for i in plan.items if any(r.startswith("min_drilled") for r in i.reasons)]
    assert floor == [resume.step]
    assert {i.step: i.action for i in plan.items}[resume.step] == "keep"
