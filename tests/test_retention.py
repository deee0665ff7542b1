"""Retention planning: golden table over one fixed catalog, and invariants.

The table runs many policies against ONE fixed catalog and compares each plan
with ``tests/golden/retention/<name>.json`` (restic's approach). After a
deliberate change of behaviour, regenerate with::

    CKPTIER_REGEN_GOLDEN=1 python -m pytest tests/test_retention.py

and review the diff of the golden files before committing them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, UTC
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptier.storage.errors import ConfigError
from ckptier.storage.records import CheckpointRecord, CopyRecord, Format, State, Tier
from ckptier.tasks.durations import Span, format_duration, parse_duration
from ckptier.tasks.retention import (
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
    Plan,
    PlanItem,
    Policy,
    drill_passed,
    hot_present,
    is_log_milestone,
    newest_drilled,
    plan_retention,
    render_plan_table,
    shrink_guard,
    stages,
    zone,
)

GOLDEN = Path(__file__).parent / "golden" / "retention"
REGEN = os.environ.get("CKPTIER_REGEN_GOLDEN", "") not in ("", "0")
NOW = datetime(2024, 5, 21, 12, 0, tzinfo=UTC)
H = timedelta(hours=1)
D = timedelta(days=1)


def ckpt(
    id: int,
    job: str,
    step: int,
    saved: datetime,
    state: State = State.VERIFIED,
    *,
    missing: bool = False,
    archive: str | None = None,  # None, "verified", "unverified"
    hot_gone: bool = False,
    size: int = 1_000,
    metrics: dict[str, float] | None = None,
) -> CheckpointRecord:
    copies: list[CopyRecord] = []
    if hot_gone:
        copies.append(CopyRecord(Tier.HOT, f"file:///hot/{job}/{step}", "deleted", size, None))
    if archive is not None:
        copies.append(
            CopyRecord(
                Tier.ARCHIVE,
                f"s3://arch/{job}/{step}",
                "present",
                size * 4 // 5,
                saved + H if archive == "verified" else None,
                "zstd",
            )
        )
    return CheckpointRecord(
        id=id,
        job=job,
        step=step,
        format=Format.GUIDE,
        state=state,
        location=f"file:///hot/{job}/step-{step:08d}",
        bytes=size,
        saved_at=saved,
        first_seen=saved,
        last_seen=NOW,
        missing_since=saved + D if missing else None,
        verified_at=saved + H if state == State.VERIFIED else None,
        state_reason="rank-0000/model.pt: sha256 mismatch" if state == State.CORRUPT else None,
        copies=tuple(copies),
        metrics=tuple(sorted((metrics or {}).items())),
    )


#: llama's eval_loss, every 2,000 steps: 28000 and 32000 tie at 0.412, 36000 recorded NaN (no
#: value), 39000 (committed, not yet verified) and 40000 (in flight) the lowest but not ranked.
LLAMA_EVAL_LOSS = {
    2000: 2.9, 4000: 2.41, 6000: 1.97, 8000: 1.55, 10000: 1.2, 12000: 0.98, 14000: 0.87, 16000: 0.73,
    18000: 0.66, 20000: 0.61, 22000: 0.58, 24000: 0.55, 26000: 0.519, 28000: 0.412, 30000: 0.47,
    32000: 0.412, 34000: 0.43, 36000: float("nan"), 38000: 0.405, 39000: 0.3, 40000: 0.29,
}
#: bert's accuracy (higher is better) on most saves: 9500 and 10000 tie at 0.76; the archived
#: 5000 is the best; 1000 (missing from hot storage) second best; 2500 and 7500 recorded none.
BERT_ACCURACY = {
    **{500 * (i + 1): round(0.5 + 0.012 * i, 3) for i in range(20) if 500 * (i + 1) not in (2500, 7500)},
    1000: 0.79, 5000: 0.8, 9500: 0.76, 10000: 0.76,
}


def fixed_catalog() -> list[CheckpointRecord]:
    """60 checkpoints of 2 jobs, mixed states, tiers and ages (the golden input)."""
    out: list[CheckpointRecord] = []
    # llama: 40 checkpoints, steps 1000..40000, one every 12 h; newest in flight.
    start = NOW - 39 * 12 * H - H
    special: dict[int, dict[str, object]] = {
        3000: {"state": State.DELETED},
        5000: {"archive": "unverified"},
        7000: {"missing": True},
        10000: {"archive": "verified"},
        13000: {"state": State.INCOMPLETE},
        20000: {"archive": "verified"},
        25000: {"state": State.CORRUPT},
        30000: {"archive": "verified"},  # archived under an older policy
        39000: {"state": State.COMMITTED},
    }
    for i in range(40):
        step = 1000 * (i + 1)
        saved = start + i * 12 * H
        kw = dict(special.get(step, {}))
        if step == 40000:
            kw = {"state": State.INCOMPLETE}
            saved = NOW - 30 * timedelta(minutes=1)
        if step in LLAMA_EVAL_LOSS:
            kw["metrics"] = {"eval_loss": LLAMA_EVAL_LOSS[step], "loss": LLAMA_EVAL_LOSS[step] + 0.1}
        out.append(ckpt(len(out) + 1, "llama", step, saved, size=2_000 + step // 1000, **kw))  # type: ignore[arg-type]
    # bert: 20 checkpoints, steps 500..10000, one every 6 h; 8 missing (40%).
    start = NOW - 20 * 6 * H
    for i in range(20):
        step = 500 * (i + 1)
        kw = {}
        if step in (500, 1000, 1500, 2500, 3000, 3500, 4500, 6000):
            kw["missing"] = True
        if step == 2000:
            kw = {"archive": "verified", "hot_gone": True}
        if step == 5000:
            kw = {"archive": "verified"}
        if step in BERT_ACCURACY:
            kw["metrics"] = {"accuracy": BERT_ACCURACY[step]}
        out.append(ckpt(len(out) + 1, "bert", step, start + i * 6 * H, size=500 + step // 500, **kw))  # type: ignore[arg-type]
    # gpt: 15 checkpoints saved every 1,200 steps (never on a round number), one every 20 h.
    start = NOW - 15 * 20 * H
    special_gpt: dict[int, dict[str, object]] = {
        2400: {"archive": "verified", "hot_gone": True},  # holds milestone 2000; hot copy deleted
        6000: {"state": State.CORRUPT},  # would hold 5000: passed over
        10800: {"state": State.COMMITTED},  # will hold 10000 once verified
    }
    for i in range(15):
        step = 1200 * (i + 1)
        kw = dict(special_gpt.get(step, {}))
        out.append(ckpt(len(out) + 1, "gpt", step, start + i * 20 * H, size=3_000 + step // 1200, **kw))  # type: ignore[arg-type]
    return out


def _id_of(catalog: Sequence[CheckpointRecord], job: str, step: int) -> int:
    return next(c.id for c in catalog if c.job == job and c.step == step)


def fixed_drills(catalog: Sequence[CheckpointRecord]) -> dict[int, datetime]:
    """Checkpoints whose most recent restore drill passed (the golden drill input)."""
    passed = {("llama", 33000): NOW - 2 * D, ("bert", 9000): NOW - 10 * H, ("gpt", 8400): NOW - 3 * D}
    return {_id_of(catalog, job, step): t for (job, step), t in passed.items()}


ARCH = "s3://arch/ckpt"

POLICIES: dict[str, Policy] = {
    "last1": Policy((KeepLast(1),)),
    "last3": Policy((KeepLast(3),)),
    "last10": Policy((KeepLast(10),)),
    "last100": Policy((KeepLast(100),)),
    "log-no-archive": Policy((Milestones(log=True),)),
    "log-archive": Policy((Milestones(log=True),), archive=ARCH),
    "log-archive-hot-keep": Policy((Milestones(log=True),), archive=ARCH, hot_after_archive="keep"),
    "last3-log-archive": Policy((KeepLast(3), Milestones(log=True)), archive=ARCH),
    "every5000-archive": Policy((Milestones(every=5000),), archive=ARCH),
    "every1000-last3-archive": Policy((KeepLast(3), Milestones(every=1000)), archive=ARCH),
    "steps-4000-8000": Policy((Milestones(steps=(4000, 8000)),)),
    "within36h": Policy((KeepWithin(timedelta(hours=36)),)),
    "within7d": Policy((KeepWithin(7 * D),)),
    "daily3": Policy((KeepDaily(3),)),
    "daily30": Policy((KeepDaily(30),)),
    "weekly2": Policy((KeepWeekly(2),)),
    "daily7-weekly4": Policy((KeepDaily(7), KeepWeekly(4))),
    "pinned": Policy((Pinned((6000, 13000, 25000)),)),
    "last1-min0": Policy((KeepLast(1),), min_verified=0),
    "last1-min5": Policy((KeepLast(1),), min_verified=5),
    "last2-delete-stale": Policy((KeepLast(2),), delete_stale_incomplete=True),
    "last2-grace0-delete-stale": Policy((KeepLast(2),), grace=timedelta(0), delete_stale_incomplete=True),
    "last2-grace1w": Policy((KeepLast(2),), grace=7 * D),
    "last2-missing30": Policy((KeepLast(2),), max_missing_fraction=0.3),
    "last2-missing0": Policy((KeepLast(2),), max_missing_fraction=0.0),
    "combo": Policy(
        (KeepLast(2), KeepWithin(D), Milestones(log=True), Pinned((17000,))),
        archive=ARCH,
        delete_stale_incomplete=True,
    ),
    "combo-hot-keep": Policy(
        (KeepLast(2), KeepDaily(5), Milestones(log=True)), archive=ARCH, hot_after_archive="keep"
    ),
    # milestone matching: the first save at or after a milestone (default) against exact steps
    "log-exact": Policy((Milestones(log=True, match="exact"),)),
    "last3-log-exact-archive": Policy((KeepLast(3), Milestones(log=True, match="exact")), archive=ARCH),
    "every1000-exact-archive": Policy((Milestones(every=1000, match="exact"),), archive=ARCH),
    "steps-2500-6000": Policy((Milestones(steps=(2500, 6000)),)),
    "every300-archive": Policy((KeepLast(1), Milestones(every=300)), archive=ARCH),
    # tiering by age and by leaving the hot window
    "last3-log-archive-leaving-hot": Policy((KeepLast(3), Milestones(log=True)), archive=ARCH, archive_when="leaving_hot"),
    "last3-log-archive-after14d": Policy((KeepLast(3), Milestones(log=True)), archive=ARCH, archive_after=14 * D),
    "daily3-log-archive-after2d-leaving-hot": Policy(
        (KeepDaily(3), Milestones(log=True)), archive=ARCH, archive_after=2 * D, archive_when="leaving_hot"
    ),
    # the drilled recovery point as a floor
    "last1-min0-drilled1": Policy((KeepLast(1),), min_verified=0, min_drilled=1),
    "last2-drilled2": Policy((KeepLast(2),), min_drilled=2),
    "log-archive-drilled1": Policy((Milestones(log=True),), archive=ARCH, min_drilled=1),
    # best by a metric: alone (checkpoints without it kept, as Orbax does), ties, missing metrics,
    # both modes, combined with keep_last and log milestones
    "best3-eval-loss": Policy((KeepBest("eval_loss", "min", 3),)),
    "best2-eval-loss-only-ranked": Policy((KeepBest("eval_loss", "min", 2, keep_without_metric=False),)),
    "best2-accuracy-max-only-ranked": Policy((KeepBest("accuracy", "max", 2, keep_without_metric=False),)),
    "last2-best3-log-archive": Policy(
        (KeepLast(2), KeepBest("eval_loss", "min", 3, keep_without_metric=False), Milestones(log=True)), archive=ARCH
    ),
    "best-two-metrics-last1": Policy(
        (KeepBest("eval_loss", "min", 1, keep_without_metric=False),
         KeepBest("accuracy", "max", 1, keep_without_metric=False), KeepLast(1)),
    ),
    # calendar buckets (restic's semantics), a time zone, one per day with no hidden keep_last
    "hourly6": Policy((KeepHourly(6),)),
    "monthly2": Policy((KeepMonthly(2),)),
    "yearly3": Policy((KeepYearly(3),)),
    "daily1": Policy((KeepDaily(1),)),
    "daily3-new-york": Policy((KeepDaily(3, timezone="America/New_York"),), timezone="America/New_York"),
    # milestones: capped, and one per interval of save time
    "every5000-max2-archive": Policy((Milestones(every=5000, max_to_keep=2),), archive=ARCH),
    "every1d-archive": Policy((Milestones(interval=D),), archive=ARCH),
    "last1-every12h-max3": Policy((KeepLast(1), Milestones(interval=12 * H, max_to_keep=3))),
}


def _golden_doc(name: str, policy: Policy, plan: Plan) -> dict[str, object]:
    catalog = fixed_catalog()
    drilled = fixed_drills(catalog)
    return {
        "policy": str(policy),
        "now": NOW.isoformat(),
        "drill_passed": [[c.job, c.step] for c in catalog if c.id in drilled],
        "refused": plan.refused,
        "warnings": list(plan.warnings),
        "summary": plan.summary(),
        "excluded": list(plan.excluded),
        "missing": list(plan.missing),
        "stale": list(plan.stale),
        "items": render_plan_table(plan),
    }


def test_table_has_enough_rows() -> None:
    assert len(POLICIES) >= 20
    assert len(fixed_catalog()) == 75


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_golden_plans(name: str) -> None:
    policy = POLICIES[name]
    catalog = fixed_catalog()
    plan = plan_retention(catalog, policy, now=NOW, drill_passed=fixed_drills(catalog))
    live = {c.id for c in catalog if c.state != State.DELETED}
    # keep + promote + delete == input, on every row.
    ids = [i.checkpoint_id for i in plan.items]
    assert len(ids) == len(set(ids))
    assert set(ids) == live
    assert sum(len(plan.by_action(a)) for a in ("keep", "promote", "delete")) == len(live)
    doc = json.loads(json.dumps(_golden_doc(name, policy, plan)))
    path = GOLDEN / f"{name}.json"
    if REGEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    assert path.exists(), f"{path} missing: run with CKPTIER_REGEN_GOLDEN=1 and review it"
    assert doc == json.loads(path.read_text(encoding="utf-8"))


def test_no_stale_golden_files() -> None:
    names = {p.stem for p in GOLDEN.glob("*.json")}
    assert names == set(POLICIES)


def _item(plan: Plan, job: str, step: int):  # type: ignore[no-untyped-def]
    return next(i for i in plan.items if i.job == job and i.step == step)


def test_spot_checks_on_fixed_catalog() -> None:
    cat = fixed_catalog()
    plan = plan_retention(cat, POLICIES["last3-log-archive"], now=NOW)
    # in-flight save kept, not counted: keep_last 3 takes 38000, 37000, 36000 (39000 is committed)
    assert _item(plan, "llama", 40000).reasons[0].startswith("in flight")
    for s in (38000, 37000, 36000):
        assert any(r.startswith("keep_last 3") for r in _item(plan, "llama", s).reasons)
    assert _item(plan, "llama", 35000).action == "delete"
    assert _item(plan, "llama", 35000).scope == "checkpoint"
    # milestone without archive copy is promoted; with a verified one its hot copy goes
    assert _item(plan, "llama", 1000).action == "promote"
    assert _item(plan, "llama", 5000).action == "promote"  # archive copy not verified
    ten = _item(plan, "llama", 10000)
    assert (ten.action, ten.scope) == ("delete", "hot-copy")
    assert "hot copy not needed" in ten.reasons[-1]
    # non-milestone with an archive copy: only its hot copy is deleted
    assert (_item(plan, "llama", 30000).action, _item(plan, "llama", 30000).scope) == ("delete", "hot-copy")
    assert _item(plan, "llama", 25000).action == "keep"  # corrupt
    assert _item(plan, "llama", 13000).reasons[0].startswith("stale incomplete")
    assert _item(plan, "llama", 7000).action == "keep"  # missing
    assert 7000 in {c.step for c in cat if c.id in plan.missing}
    assert all(i.step != 3000 for i in plan.items if i.job == "llama")
    assert plan.refused is None


def _saves(
    job: str, every: int, n: int, *, first_id: int = 1, gap: timedelta = H, special: dict[int, dict[str, object]] | None = None
) -> list[CheckpointRecord]:
    """``n`` verified saves of ``job`` every ``every`` steps, ``gap`` apart, the newest 3 hours old."""
    special = special or {}
    return [
        ckpt(first_id + i, job, every * (i + 1), NOW - 3 * H - (n - 1 - i) * gap, **special.get(every * (i + 1), {}))  # type: ignore[arg-type]
        for i in range(n)
    ]


def _series(upto: int) -> list[int]:
    return sorted(d * 10**e for e in range(19) for d in (1, 2, 5) if d * 10**e <= upto)


def _holding(plan: Plan) -> set[int]:
    return {i.step for i in plan.items if any(r.startswith("milestones") for r in i.reasons)}


@pytest.mark.parametrize("cadence", [1200, 800, 300, 750])
def test_log_milestones_are_held_by_the_first_save_at_or_after_them(cadence: int) -> None:
    """Saves every 1,200 (800, 300, 750) steps never land on 1, 2, 5, 10, ... × 10^k: by
    default each milestone is held by the first verified save at or after it."""
    cs = _saves("run", cadence, 60)
    top = 60 * cadence
    plan = plan_retention(cs, Policy((KeepLast(2), Milestones(log=True)), archive=ARCH), now=NOW)
    expected = {-(-m // cadence) * cadence for m in _series(top)}
    assert _holding(plan) == expected
    assert {i.step for i in plan.by_action("promote")} == expected
    assert not plan.warnings


def test_the_reason_names_the_milestone_and_the_save_holding_it() -> None:
    plan = plan_retention(_saves("run", 1200, 20), Policy((Milestones(log=True),), archive=ARCH), now=NOW)
    first = _item(plan, "run", 1200).reasons[0]
    assert "holds milestone 1000: first save at or after it, step 1200" in first
    assert "also holds 9 smaller milestones" in first
    assert "holds milestone 5000: first save at or after it, step 6000" in _item(plan, "run", 6000).reasons[0]
    assert _item(plan, "run", 3600).action == "delete"


@pytest.mark.parametrize("cadence", [1200, 300, 750])
def test_exact_match_keeps_no_milestone_at_such_cadences_and_warns(cadence: int) -> None:
    cs = _saves("run", cadence, 60)
    plan = plan_retention(cs, Policy((KeepLast(2), Milestones(log=True, match="exact")), archive=ARCH), now=NOW)
    assert not _holding(plan) and not plan.by_action("promote")
    (warning,) = plan.warnings
    assert f"job 'run': milestones log (1-2-5 series) (exact match): saves come every {cadence} steps" in warning
    assert "no milestone is ever kept" in warning and 'milestone_match = "at_or_after"' in warning
    assert "\n" not in warning


def test_exact_match_warns_when_the_first_milestone_on_a_save_is_beyond_the_run() -> None:
    plan = plan_retention(_saves("run", 800, 60), Policy((Milestones(log=True, match="exact"),)), now=NOW)
    (warning,) = plan.warnings
    assert "4 of the 5 milestones from step 800 to 48000 can never be kept (only step 20000 falls on a save)" in warning
    short = plan_retention(_saves("run", 800, 20), Policy((Milestones(log=True, match="exact"),)), now=NOW)
    assert "can never be kept (the first that can is step 20000)" in short.warnings[0]
    assert not plan_retention(_saves("run", 1000, 20), Policy((Milestones(log=True, match="exact"),)), now=NOW).warnings
    every = plan_retention(_saves("run", 1200, 10), Policy((Milestones(every=1000, match="exact"),)), now=NOW)
    assert "only one milestone in 6 (every 6000 steps) can be kept" in every.warnings[0]
    steps = plan_retention(_saves("run", 1200, 10), Policy((Milestones(steps=(2500, 3600, 7000), match="exact"),)), now=NOW)
    assert "milestone steps 2500, 7000 never fall on a save" in steps.warnings[0]
    assert _holding(steps) == {3600}


FIX = 'use milestone_match = "at_or_after" (the default) to keep the first save at or after each'
LOG_EXACT = Milestones(log=True, match="exact")


@pytest.mark.parametrize(
    ("rule", "steps", "warning"),
    [
        pytest.param(Milestones(every=1000), [1200], None, id="one-save"),
        pytest.param(Milestones(every=1000), [1200, 2400],
                     "milestones every 1000 steps: saves come every 1200 steps, so every save holds a milestone and "
                     "none is ever deleted; set every_n_steps above 1200", id="two-saves"),
        pytest.param(Milestones(every=1000), [1000, 2200],
                     "milestones every 1000 steps: saves come every 1200 steps (at step 1000 mod 1200), so every "
                     "save holds a milestone and none is ever deleted; set every_n_steps above 1200",
                     id="cadence-from-the-gaps"),
        pytest.param(Milestones(every=1), [5, 6, 7], None, id="every-step-is-no-cadence"),
        pytest.param(Milestones(every=1), [5, 6, 8], None, id="irregular"),
        # the first step of the 1-2-5 series on a save is looked for up to the largest step (2^63 - 1)
        pytest.param(LOG_EXACT, [4, 47, 90],
                     "milestones log (1-2-5 series) (exact match): saves come every 43 steps (at step 4 mod 43), so "
                     "4 of the 4 milestones from step 4 to 90 can never be kept (the first that can is step "
                     f"{10**18}); {FIX}", id="log-first-at-10^18"),
        pytest.param(LOG_EXACT, [44, 93, 142],
                     "milestones log (1-2-5 series) (exact match): saves come every 49 steps (at step 44 mod 49), so "
                     "2 of the 2 milestones from step 44 to 142 can never be kept (the first that can is step "
                     f"{2 * 10**18}); {FIX}", id="log-first-past-10^18"),
        # 1, 2 and 5 times a power of ten: never a multiple of 3
        pytest.param(LOG_EXACT, [3, 6, 9],
                     "milestones log (1-2-5 series) (exact match): saves come every 3 steps and "
                     f"no step of the 1-2-5 series falls on a save, so no milestone is ever kept; {FIX}",
                     id="log-never-on-a-multiple-of-3"),
        pytest.param(LOG_EXACT, list(range(800, 20001, 800)),
                     "milestones log (1-2-5 series) (exact match): saves come every 800 steps, so 4 of the 5 milestones "
                     f"from step 800 to 20000 can never be kept (only step 20000 falls on a save); {FIX}",
                     id="log-the-last-save-on-a-milestone"),
        # explicit steps: the first five named, the rest counted
        pytest.param(Milestones(steps=(2500, 3600), match="exact"), [1200, 2400, 3600],
                     "milestones at steps 2500, 3600 (exact match): saves come every 1200 steps, so milestone step "
                     f"2500 never falls on a save; {FIX}", id="steps-one-never"),
        pytest.param(Milestones(steps=(100, 200, 300, 400, 500), match="exact"), [1200, 2400, 3600],
                     "milestones at steps 100, 200, 300, 400, 500 (exact match): saves come every 1200 steps, so "
                     f"milestone steps 100, 200, 300, 400, 500 never fall on a save; {FIX}", id="steps-five-never"),
        pytest.param(Milestones(steps=(100, 200, 300, 400, 500, 600), match="exact"), [1200, 2400, 3600],
                     "milestones at steps 100, 200, 300, 400, 500, 600 (exact match): saves come every 1200 steps, so "
                     f"milestone steps 100, 200, 300, 400, 500 (+1 more) never fall on a save; {FIX}",
                     id="steps-six-never"),
        pytest.param(Milestones(steps=(1200, 3600), match="exact"), [1200, 2400, 3600], None, id="steps-all-on-saves"),
    ],
)
def test_cadence_warnings(rule: Milestones, steps: list[int], warning: str | None) -> None:
    cs = [ckpt(i + 1, "run", step, NOW - H) for i, step in enumerate(steps)]
    assert rule.cadence_warning(cs) == warning


def test_milestones_denser_than_the_saves_warn_that_everything_is_kept() -> None:
    plan = plan_retention(_saves("run", 1200, 10), Policy((KeepLast(1), Milestones(every=1000)), archive=ARCH), now=NOW)
    assert _holding(plan) == {1200 * i for i in range(1, 11)}
    assert "every save holds a milestone and none is ever deleted; set every_n_steps above 1200" in plan.warnings[0]


def test_a_milestone_stays_with_its_holder_after_the_hot_copy_is_deleted() -> None:
    """The holder's hot copy went after archiving: the milestone must not slide to the next save."""
    policy = Policy((KeepLast(2), Milestones(steps=(1000,))), archive=ARCH)
    cs = _saves("run", 1200, 10, special={1200: {"archive": "verified", "hot_gone": True}})
    plan = plan_retention(cs, policy, now=NOW)
    held = _item(plan, "run", 1200)
    assert held.action == "keep" and "holds milestone 1000" in held.reasons[0]
    assert _item(plan, "run", 2400).action == "delete" and _holding(plan) == {1200}
    assert not plan.by_action("promote")
    # nor when a listing did not show it: the missing flag is no proof that it is gone
    plan = plan_retention(_saves("run", 1200, 10, special={1200: {"missing": True}}), policy, now=NOW)
    assert _item(plan, "run", 1200).action == "keep" and _holding(plan) == {1200}
    assert _item(plan, "run", 2400).action == "delete"


@pytest.mark.parametrize("state", [State.CORRUPT, State.INCOMPLETE, State.DELETED])
def test_a_corrupt_or_torn_first_save_passes_the_milestone_on_saying_so(state: State) -> None:
    cs = _saves("run", 1200, 10, special={1200: {"state": state}})
    plan = plan_retention(cs, Policy((KeepLast(2), Milestones(steps=(1000,))), archive=ARCH), now=NOW)
    two = _item(plan, "run", 2400)
    assert two.action == "promote"
    assert f"holds milestone 1000: first save at or after it, step 2400 (step 1200 is {state.value})" in two.reasons[0]


def test_a_committed_first_save_holds_the_milestone_pending_verification() -> None:
    cs = _saves("run", 1200, 10, special={1200: {"state": State.COMMITTED}})
    plan = plan_retention(cs, Policy((KeepLast(2), Milestones(steps=(1000,))), archive=ARCH), now=NOW)
    one = _item(plan, "run", 1200)
    assert one.action == "keep" and any("will hold milestone 1000 once verified" in r for r in one.reasons)
    assert _item(plan, "run", 2400).action == "delete"
    assert not plan.by_action("promote")


def test_archive_after_promotes_milestones_once_they_are_old_enough() -> None:
    cs = _saves("run", 1000, 20, gap=D)  # ages 19 days 3 h ... 3 h
    plan = plan_retention(cs, Policy((KeepLast(2), Milestones(every=5000)), archive=ARCH, archive_after=14 * D), now=NOW)
    assert {i.step for i in plan.by_action("promote")} == {5000}
    ten = _item(plan, "run", 10000)
    assert ten.action == "keep"
    assert "no verified archive copy yet: archive_after 2w: promoted once older (saved 1w3d3h ago)" in ten.reasons


def test_leaving_hot_promotes_a_milestone_only_when_no_other_rule_keeps_it_hot() -> None:
    """Nothing is stored twice: a milestone in the newest-N window waits for its archive copy."""
    policy = Policy((KeepLast(3), Milestones(every=5000)), archive=ARCH, archive_when="leaving_hot")
    cs = _saves("run", 1000, 20)
    plan = plan_retention(cs, policy, now=NOW)
    assert {i.step for i in plan.by_action("promote")} == {5000, 10000, 15000}
    newest = _item(plan, "run", 20000)
    assert newest.action == "keep"
    assert any("archive_when leaving_hot: promoted when no other rule keeps it in hot storage" in r for r in newest.reasons)
    # the default promotes at once: an early second copy
    early = plan_retention(cs, dataclasses.replace(policy, archive_when="immediately"), now=NOW)
    assert {i.step for i in early.by_action("promote")} == {5000, 10000, 15000, 20000}


def test_min_drilled_keeps_the_newest_drill_passed_checkpoint_until_a_newer_one_passes() -> None:
    cs = _saves("run", 100, 10)
    policy = Policy((KeepLast(2),), min_verified=0, min_drilled=1)
    passed = {cs[4].id: NOW - D}  # step 500
    plan = plan_retention(cs, policy, now=NOW, drill_passed=passed)
    five = _item(plan, "run", 500)
    assert five.action == "keep"
    assert five.reasons[0].startswith("min_drilled 1: newest drill-passed recovery point (drill passed ")
    assert {i.step for i in plan.by_action("delete")} == {100, 200, 300, 400, 600, 700, 800}
    # once a newer checkpoint passes a drill, the older one may go
    plan = plan_retention(cs, policy, now=NOW, drill_passed={**passed, cs[6].id: NOW - H})
    assert _item(plan, "run", 500).action == "delete" and _item(plan, "run", 700).action == "keep"
    # without the floor it would have gone
    assert _item(plan_retention(cs, dataclasses.replace(policy, min_drilled=0), now=NOW, drill_passed=passed),
                 "run", 500).action == "delete"
    # its hot copy stays even when an archive copy would allow deleting it
    archived = _saves("run", 100, 10, special={500: {"archive": "verified"}})
    plan = plan_retention(archived, Policy((KeepLast(2), Milestones(steps=(500,))), archive=ARCH, min_drilled=1),
                          now=NOW, drill_passed={archived[4].id: NOW - D})
    assert _item(plan, "run", 500).action == "keep"


@dataclasses.dataclass(frozen=True)
class _Drill:
    checkpoint_id: int | None
    ok: bool
    started_at: datetime
    finished_at: datetime | None
    judged: bool = True


def test_drill_passed_reads_each_checkpoints_most_recent_drill() -> None:
    t = NOW - D
    drills = [
        _Drill(1, True, t, t + H), _Drill(1, False, t + 2 * H, t + 3 * H),  # passed, then failed
        _Drill(2, False, t, t + H), _Drill(2, True, t + 2 * H, t + 3 * H),  # failed, then passed
        _Drill(3, True, t, None),  # passed, no finish time recorded
        _Drill(None, True, t, t),  # its checkpoint is gone
    ]
    assert drill_passed(drills) == {2: t + 3 * H, 3: t}
    assert drill_passed(reversed(drills)) == drill_passed(drills)


def test_shrink_guard_refuses_only_the_job_that_shrank() -> None:
    plan = plan_retention(fixed_catalog(), POLICIES["last2-missing30"], now=NOW)
    assert plan.refused is not None and "'bert'" in plan.refused and "8 of 20" in plan.refused
    assert set(plan.refused_jobs) == {"bert"}
    assert not [i for i in plan.items if i.job == "bert" and i.action == "delete"]
    assert [i for i in plan.items if i.job == "llama" and i.action == "delete"]
    suspended = [i for i in plan.items if i.reasons[0].startswith("deletion suspended")]
    assert suspended and all(i.job == "bert" for i in suspended)


def test_all_missing_is_refused_even_at_fraction_one() -> None:
    cs = [ckpt(i, "j", i * 10, NOW - i * H, missing=True) for i in range(1, 5)]
    plan = plan_retention(cs, Policy((KeepLast(1),), max_missing_fraction=1.0), now=NOW)
    assert plan.refused is not None
    assert not plan.by_action("delete")


def test_empty_policy_is_refused() -> None:
    with pytest.raises(ConfigError, match="keeps nothing"):
        Policy(())
    with pytest.raises(ValueError, match="keeps nothing"):
        Policy((KeepLast(0), Pinned(())))


def test_naive_now_is_refused() -> None:
    with pytest.raises(ConfigError, match="timezone"):
        plan_retention([], POLICIES["last1"], now=datetime(2024, 1, 1))


def test_rule_strings_are_readable() -> None:
    assert str(KeepLast(3)) == "keep_last 3"
    assert str(Milestones(log=True)) == "milestones log (1-2-5 series)"
    assert str(Milestones(every=500)) == "milestones every 500 steps"
    assert str(Milestones(steps=(50, 10))) == "milestones at steps 10, 50"
    assert str(KeepWithin(timedelta(hours=36))) == "keep_within 1d12h"
    assert str(KeepDaily(7)) == "keep_daily 7" and str(KeepWeekly(2)) == "keep_weekly 2"
    assert str(Pinned((9, 3))) == "pinned 3, 9"


def test_log_series() -> None:
    assert [s for s in range(0, 1001) if is_log_milestone(s)] == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]


@pytest.mark.parametrize(
    "text,expected",
    [("36h", timedelta(hours=36)), ("7d", 7 * D), ("2w", 14 * D), ("1d12h", timedelta(hours=36)), ("90s", timedelta(seconds=90))],
)
def test_durations(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected
    assert parse_duration(format_duration(expected)) == expected


@pytest.mark.parametrize("text", ["", "7", "d", "7 days", "-1h", "1.5h", "7y"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ConfigError, match="duration"):
        parse_duration(text)


def test_rule_validation() -> None:
    with pytest.raises(ConfigError):
        Milestones()
    with pytest.raises(ConfigError):
        Milestones(log=True, every=10)
    with pytest.raises(ConfigError):
        Milestones(every=0)
    with pytest.raises(ConfigError):
        KeepLast(-1)
    with pytest.raises(ConfigError):
        KeepWithin(timedelta(0))
    with pytest.raises(ConfigError):
        Policy((KeepLast(1),), max_missing_fraction=1.5)
    with pytest.raises(ConfigError):
        Policy((KeepLast(1),), hot_after_archive="drop")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        pytest.param(lambda: KeepLast(-1), "keep_last = -1: must be ≥ 0, e.g. keep_last = 3", id="keep_last"),
        pytest.param(lambda: KeepHourly(-1), "keep_hourly = -1: must be ≥ 0, e.g. keep_hourly = 24", id="keep_hourly"),
        pytest.param(lambda: KeepDaily(-1), "keep_daily = -1: must be ≥ 0, e.g. keep_daily = 7", id="keep_daily"),
        pytest.param(lambda: KeepWeekly(-1), "keep_weekly = -1: must be ≥ 0, e.g. keep_weekly = 4", id="keep_weekly"),
        pytest.param(lambda: KeepMonthly(-1), "keep_monthly = -1: must be ≥ 0, e.g. keep_monthly = 12",
                     id="keep_monthly"),
        pytest.param(lambda: KeepYearly(-1), "keep_yearly = -1: must be ≥ 0, e.g. keep_yearly = 5", id="keep_yearly"),
        pytest.param(lambda: Milestones(), "give exactly one of log, every_n_steps, every or steps (got 0)",
                     id="milestones-none"),
        pytest.param(lambda: Milestones(log=True, every=10), "(got 2)", id="milestones-two"),
        pytest.param(lambda: Milestones(every=0), "milestones every_n_steps = 0: must be > 0", id="every-zero"),
        pytest.param(lambda: Milestones(interval=timedelta(milliseconds=500)), "must be at least 1s",
                     id="interval-under-a-second"),
        pytest.param(lambda: Milestones(interval=H, match="exact"), "remove milestone_match = \"exact\"",
                     id="interval-exact"),
        pytest.param(lambda: Milestones(every=10, max_to_keep=0), "milestones max_to_keep = 0: must be ≥ 1",
                     id="max_to_keep-zero"),
        pytest.param(lambda: Milestones(every=10, max_to_keep=True), "milestones max_to_keep = True: must be ≥ 1",
                     id="max_to_keep-bool"),
        pytest.param(lambda: Milestones(steps=(5, -1)), "milestones steps [5, -1]: steps must be ≥ 0",
                     id="negative-step"),
        pytest.param(lambda: Milestones(log=True, match="near"), "milestone_match = 'near'", id="match"),  # type: ignore[arg-type]
        pytest.param(lambda: Policy((KeepLast(0),)), "keeps nothing", id="keeps-nothing"),
        pytest.param(lambda: Policy((KeepLast(1),), min_verified=-1), "min_verified = -1: must be ≥ 0", id="min_verified"),
        pytest.param(lambda: Policy((KeepLast(1),), grace=-H), "must be ≥ 0, e.g. '2h'", id="grace"),
        pytest.param(lambda: Policy((KeepLast(1),), max_missing_fraction=-0.1), "must be between 0 and 1",
                     id="fraction-below"),
        pytest.param(lambda: Policy((KeepLast(1),), max_missing_fraction=1.5), "must be between 0 and 1",
                     id="fraction-above"),
        pytest.param(lambda: Policy((KeepLast(1),), min_drilled=-1), "min_drilled = -1: must be ≥ 0", id="min_drilled"),
        pytest.param(lambda: Policy((KeepLast(1),), archive_after=timedelta(0)), "must be longer than zero",
                     id="archive_after"),
        pytest.param(lambda: Policy((KeepLast(1),), archive_when="later"), "archive_when = 'later'",  # type: ignore[arg-type]
                     id="archive_when"),
        pytest.param(lambda: KeepBest(" ", "min", 1), "keep_best metric = ' ': name the metric", id="best-metric"),
        pytest.param(lambda: KeepBest("loss", "low", 1), "keep_best mode = 'low'", id="best-mode"),  # type: ignore[arg-type]
        pytest.param(lambda: KeepBest("loss", "min", 0), "keep_best n = 0: must be a whole number ≥ 1", id="best-n-0"),
        pytest.param(lambda: KeepBest("loss", "min", True), "keep_best n = True", id="best-n-bool"),
        pytest.param(lambda: Policy((Pinned(()),)), "keeps nothing", id="pinned-nothing"),
        pytest.param(lambda: Policy((KeepWithin(Span(1), timezone="Europe/Berlin"),)),
                     "rule keep_within 1mo counts in Europe/Berlin, the policy in timezone UTC", id="within-months-zone"),
        pytest.param(lambda: Policy((Milestones(interval=H, timezone="Europe/Berlin"),)),
                     "counts in Europe/Berlin, the policy in timezone UTC", id="interval-zone"),
    ],
)
def test_rule_validation_messages(make: Callable[[], object], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        make()
    assert message in str(err.value)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: KeepLast(0), id="keep_last-0"),
        pytest.param(lambda: Milestones(interval=timedelta(seconds=1)), id="interval-1s"),
        pytest.param(lambda: Milestones(every=1, max_to_keep=1), id="max_to_keep-1"),
        pytest.param(lambda: Milestones(steps=(0,)), id="step-0"),
        pytest.param(lambda: Milestones(log=True, match="exact"), id="log-exact"),
        pytest.param(lambda: Policy((KeepLast(1),), min_verified=0, grace=timedelta(0), min_drilled=0), id="zeros"),
        pytest.param(lambda: Policy((KeepLast(1),), max_missing_fraction=0.0), id="fraction-0"),
        pytest.param(lambda: Policy((KeepLast(1),), max_missing_fraction=1.0), id="fraction-1"),
        pytest.param(lambda: Policy((KeepLast(1),), archive_when="leaving_hot", archive_after=timedelta(seconds=1)),
                     id="archive-settings"),
        pytest.param(lambda: KeepBest("loss", "max", 1), id="best-1"),
        pytest.param(lambda: Policy((KeepLast(0), Pinned((5,)))), id="pinned-keeps"),
        # a rule whose decisions depend on no calendar may name another zone
        pytest.param(lambda: Policy((KeepWithin(D, timezone="Europe/Berlin"),)), id="within-days-any-zone"),
        pytest.param(lambda: Policy((Milestones(every=10, timezone="Europe/Berlin"),)), id="every-any-zone"),
    ],
)
def test_rule_validation_edges_are_allowed(make: Callable[[], object]) -> None:
    assert make() is not None


@pytest.mark.parametrize(
    ("rule", "lo", "hi", "held"),
    [
        pytest.param(Milestones(every=10), 5, 25, (10, 20, 2), id="every"),
        pytest.param(Milestones(every=10), 10, 20, (20, 20, 1), id="every-lo-excluded-hi-included"),
        pytest.param(Milestones(every=10), 11, 19, None, id="every-none-between"),
        pytest.param(Milestones(every=10), -1, 0, (0, 0, 1), id="every-step-zero"),
        pytest.param(Milestones(every=10), 0, 0, None, id="every-empty-range-at-zero"),
        pytest.param(Milestones(every=10), 5, 0, None, id="every-reversed-to-zero"),
        pytest.param(Milestones(every=10), -20, -5, None, id="every-negative"),
        pytest.param(Milestones(every=10), -1, 10, (10, 10, 1), id="every-from-before-zero"),
        pytest.param(Milestones(log=True), 0, 100, (1, 100, 7), id="log"),
        pytest.param(Milestones(log=True), 2, 4, None, id="log-none-between"),
        pytest.param(Milestones(log=True), 1, 2, (2, 2, 1), id="log-one"),
        pytest.param(Milestones(log=True), 100, 50, None, id="log-reversed"),
        pytest.param(Milestones(steps=(30, 10, 20, 10)), 10, 30, (20, 30, 2), id="steps"),
        pytest.param(Milestones(steps=(30, 10, 20, 10)), -1, 10, (10, 10, 1), id="steps-first"),
        pytest.param(Milestones(interval=H), 0, 100, None, id="interval-has-no-steps"),
    ],
)
def test_milestones_between(rule: Milestones, lo: int, hi: int, held: tuple[int, int, int] | None) -> None:
    """``between(lo, hi)``: the milestone steps M with lo < M <= hi, as (smallest, largest, count)."""
    assert rule.between(lo, hi) == held


def test_new_rule_strings_are_readable() -> None:
    assert str(KeepHourly(24)) == "keep_hourly 24" and str(KeepMonthly(12)) == "keep_monthly 12"
    assert str(KeepYearly(5, timezone="Europe/Berlin")) == "keep_yearly 5"
    assert str(KeepBest("eval_loss", "min", 3)) == "keep_best 3 by eval_loss (min)"
    assert str(KeepWithin(Span(6))) == "keep_within 6mo" and str(KeepWithin(Span(14, 2 * D))) == "keep_within 1y2mo2d"
    assert str(Milestones(every=1000, max_to_keep=5)) == "milestones every 1000 steps, max_to_keep 5"
    assert str(Milestones(interval=6 * H)) == "milestones every 6h of save time"
    assert str(Policy((KeepDaily(1, timezone="Asia/Kolkata"),), timezone="Asia/Kolkata")).startswith(
        "keep_daily 1, timezone Asia/Kolkata, grace 2h")
    assert "timezone" not in str(Policy((KeepLast(3),)))  # no calendar rule: nothing depends on it


# --------------------------------------------------------------- keep_best


def _scored(values: Sequence[float | None], *, job: str = "run", states: dict[int, State] | None = None,
            metric: str = "eval_loss") -> list[CheckpointRecord]:
    """One verified save per value, steps 100, 200, ..., the newest 3 hours old (None: no metric)."""
    states = states or {}
    return [ckpt(i + 1, job, 100 * (i + 1), NOW - 3 * H - (len(values) - i) * H, states.get(100 * (i + 1), State.VERIFIED),
                 metrics=None if v is None else {metric: v}) for i, v in enumerate(values)]


def _kept_steps(rule: object, cs: Sequence[CheckpointRecord]) -> list[int]:
    kept = rule.keeps(cs, NOW)  # type: ignore[attr-defined]
    return sorted(c.step for c in cs if c.id in kept)


@pytest.mark.parametrize(("n", "values", "keep_without", "expected"), [
    # the lowest loss; checkpoints without it are kept (as Orbax keeps them by default)
    (1, [7, None, 4, None, 5], True, [200, 300, 400]),
    (1, [7, None, 4, None, 5], False, [300]),
    # n above the number of scored checkpoints: every scored one, plus the unscored when kept
    (4, [5, None, 4, None, 7], True, [100, 200, 300, 400, 500]),
    (4, [5, None, 4, None, 7], False, [100, 300, 500]),
    # ties rank the newer step first: exactly n are best
    (2, [0.3, 0.2, 0.2, 0.2, 0.9], False, [300, 400]),
    (3, [0.3, 0.2, 0.2, 0.2, 0.9], False, [200, 300, 400]),
    # NaN and infinite values are no score: neither best nor worst
    (2, [float("nan"), 0.5, float("inf"), 0.7, float("-inf")], False, [200, 400]),
    (2, [float("nan"), 0.5, float("inf"), 0.7, float("-inf")], True, [100, 200, 300, 400, 500]),
])
def test_keep_best_min(n: int, values: list[float | None], keep_without: bool, expected: list[int]) -> None:
    assert _kept_steps(KeepBest("eval_loss", "min", n, keep_without_metric=keep_without), _scored(values)) == expected


def test_keep_best_max_keeps_the_highest_and_ranks_ties_newest_first() -> None:
    cs = _scored([0.61, 0.75, 0.70, 0.75, None, 0.4], metric="acc")
    assert _kept_steps(KeepBest("acc", "max", 2, keep_without_metric=False), cs) == [200, 400]
    assert _kept_steps(KeepBest("acc", "max", 1, keep_without_metric=False), cs) == [400]
    kept = KeepBest("acc", "max", 2).keeps(cs, NOW)
    assert kept[cs[3].id] == "keep_best 2 by acc (max): best 1 of 2, acc = 0.75 (tied with step 200: newer steps rank first)"
    assert kept[cs[1].id].startswith("keep_best 2 by acc (max): best 2 of 2, acc = 0.75")
    assert kept[cs[4].id] == ("keep_best 2 by acc (max): no acc recorded, so neither best nor worst: "
                              "kept (keep_without_metric)")


def test_keep_best_ranks_verified_checkpoints_only() -> None:
    """A committed save with the best loss is kept as unverified, and takes no place among the best."""
    cs = _scored([0.5, 0.4, 0.1, 0.3], states={300: State.COMMITTED})
    assert _kept_steps(KeepBest("eval_loss", "min", 2, keep_without_metric=False), cs) == [200, 400]
    plan = plan_retention(cs, Policy((KeepBest("eval_loss", "min", 2, keep_without_metric=False),), min_verified=0), now=NOW)
    assert [i.step for i in plan.by_action("delete")] == [100]
    assert _item(plan, "run", 300).reasons[0].startswith("committed, not yet verified")


def test_best_and_latest_from_one_policy() -> None:
    """The best K by a metric and the newest N together (what one Orbax manager could not do)."""
    cs = _scored([0.9, 0.2, 0.5, 0.1, 0.8, 0.7, 0.6, 0.95])
    policy = Policy((KeepLast(2), KeepBest("eval_loss", "min", 2, keep_without_metric=False)), min_verified=0)
    plan = plan_retention(cs, policy, now=NOW)
    assert sorted(i.step for i in plan.items if i.action == "keep") == [200, 400, 700, 800]
    assert [r for r in _item(plan, "run", 400).reasons] == ["keep_best 2 by eval_loss (min): best 1 of 2, eval_loss = 0.1"]
    assert "not kept by any rule (keep_last 2; keep_best 2 by eval_loss (min))" in _item(plan, "run", 300).reasons


def test_keep_best_warns_when_the_metric_is_missing() -> None:
    unscored = _scored([None, None, None, 0.3])
    plan = plan_retention(unscored, Policy((KeepBest("eval_loss", "min", 1),)), now=NOW)
    assert plan.warnings == (
        "job 'run': keep_best 1 by eval_loss (min): 3 of 4 verified checkpoints record no eval_loss, and "
        "keep_without_metric keeps every one of them; record it (the job's metrics.jsonl, or the format's own "
        "metadata) or set keep_without_metric = false",)
    plan = plan_retention(_scored([None, None]), Policy((KeepLast(1), KeepBest("eval_los", "min", 1, False))), now=NOW)
    assert "no verified checkpoint records eval_los, so this rule keeps nothing" in plan.warnings[0]
    assert not plan_retention(_scored([0.3, 0.2]), Policy((KeepBest("eval_loss", "min", 1),)), now=NOW).warnings


@pytest.mark.parametrize(
    ("values", "keep_without", "warns"),
    [
        pytest.param([None, None, 0.3, 0.2], True, False, id="half-unscored"),
        pytest.param([None, None, None, 0.2], True, True, id="most-unscored"),
        pytest.param([None, 0.2], False, False, id="some-unscored-left-to-other-rules"),
        pytest.param([None, None], False, True, id="none-scored"),
        pytest.param([0.3, 0.2], True, False, id="all-scored"),
        pytest.param([], True, False, id="no-checkpoints"),
    ],
)
def test_keep_best_warnings(values: list[float | None], keep_without: bool, warns: bool) -> None:
    rule = KeepBest("eval_loss", "min", 1, keep_without_metric=keep_without)
    assert (rule.warning(_scored(values)) is not None) is warns


def test_keep_best_names_every_tie() -> None:
    kept = KeepBest("eval_loss", "min", 1, keep_without_metric=False).keeps(_scored([0.5, 0.5, 0.5, 0.9]), NOW)
    assert list(kept.values()) == [
        "keep_best 1 by eval_loss (min): best 1 of 1, eval_loss = 0.5 (tied with step 200 and 1 more: newer steps "
        "rank first)"]


def test_keep_best_validation() -> None:
    with pytest.raises(ConfigError, match="mode"):
        KeepBest("eval_loss", "lowest", 3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="n = 0"):
        KeepBest("eval_loss", "min", 0)
    with pytest.raises(ConfigError, match="metric"):
        KeepBest(" ", "min", 1)


# --------------------------------------------------------------- calendar buckets


def _at(*times: datetime) -> list[CheckpointRecord]:
    return [ckpt(i + 1, "run", 100 * (i + 1), t) for i, t in enumerate(sorted(times))]


def test_buckets_keep_the_newest_of_each_and_the_oldest_while_counts_are_left() -> None:
    """restic's rule: when fewer buckets than the count have a save, the oldest save is kept too."""
    t = datetime(2024, 3, 10, 9, tzinfo=UTC)
    cs = _at(t, t + H, t + 2 * D, t + 2 * D + H, t + 40 * D)  # 2024-03-10 (2), 03-12 (2), 04-19
    assert _kept_steps(KeepDaily(2), cs) == [400, 500]
    assert _kept_steps(KeepDaily(3), cs) == [200, 400, 500]
    four = KeepDaily(4).keeps(cs, NOW)
    assert sorted(c.step for c in cs if c.id in four) == [100, 200, 400, 500]
    assert four[cs[0].id] == ("keep_daily 4: oldest verified, of 2024-03-10 (UTC): kept while only 3 of 4 days "
                              "have a checkpoint")
    assert _kept_steps(KeepMonthly(2), cs) == [400, 500]
    assert _kept_steps(KeepMonthly(3), cs) == [100, 400, 500]
    assert _kept_steps(KeepYearly(1), cs) == [500]
    assert _kept_steps(KeepHourly(2), cs) == [400, 500]


def test_buckets_count_in_the_policys_time_zone() -> None:
    """23:30 UTC on 1 March is 00:30 on 2 March in Berlin: one day in UTC, two there."""
    cs = _at(datetime(2024, 3, 1, 12, tzinfo=UTC), datetime(2024, 3, 1, 23, 30, tzinfo=UTC))
    assert _kept_steps(KeepDaily(2), cs) == [100, 200]  # the oldest, as counts are left
    assert _kept_steps(KeepDaily(1), cs) == [200]
    berlin = KeepDaily(1, timezone="Europe/Berlin").keeps(cs, NOW)
    assert berlin == {cs[1].id: "keep_daily 1: newest of 2024-03-02 (Europe/Berlin)"}
    # months too: 31 January 23:30 UTC is February in Tokyo
    jan = _at(datetime(2024, 1, 31, 23, 30, tzinfo=UTC))
    assert KeepMonthly(1, timezone="Asia/Tokyo").keeps(jan, NOW) == {jan[0].id: "keep_monthly 1: newest of 2024-02 (Asia/Tokyo)"}
    with pytest.raises(ConfigError, match="Europe/Berln"):
        KeepDaily(1, timezone="Europe/Berln")
    with pytest.raises(ConfigError, match="counts in Europe/Berlin, the policy in timezone UTC"):
        Policy((KeepDaily(1, timezone="Europe/Berlin"),))


def _first_scanned_today(*saved: datetime | None) -> list[CheckpointRecord]:
    """Saves made at ``saved`` (None: no save time known, first seen 2 days ago) that the catalog first saw now."""
    out = []
    for i, t in enumerate(saved):
        c = ckpt(i + 1, "run", 100 * (i + 1), t or NOW - 2 * D)
        out.append(dataclasses.replace(c, saved_at=t, first_seen=NOW if t else NOW - 2 * D))
    return out


@pytest.mark.parametrize(
    ("rule", "saved", "expected"),
    [
        # a bucket old enough to be scanned for the first time today still holds its days
        pytest.param(KeepDaily(3), (NOW - 5 * D, NOW - 4 * D, NOW - 3 * D), [100, 200, 300], id="daily-old-bucket"),
        pytest.param(KeepDaily(1), (NOW - 5 * D, NOW - 4 * D, NOW - 3 * D), [300], id="daily-newest-day"),
        pytest.param(KeepHourly(2), (NOW - 5 * H, NOW - 4 * H, NOW - 3 * H), [200, 300], id="hourly"),
        pytest.param(KeepWithin(4 * D + H), (NOW - 5 * D, NOW - 4 * D, NOW - 3 * D), [200, 300], id="within"),
        # without a save time, when the catalog first saw it (2 days ago)
        pytest.param(KeepWithin(D), (NOW - 5 * D, None), [], id="within-first-seen"),
        pytest.param(KeepWithin(3 * D), (NOW - 5 * D, None), [200], id="within-first-seen-inside"),
        pytest.param(KeepDaily(3), (NOW - 5 * D, None, NOW - 3 * D), [100, 200, 300], id="daily-first-seen"),
    ],
)
def test_rules_count_a_save_at_its_save_time_not_when_first_seen(
    rule: object, saved: tuple[datetime | None, ...], expected: list[int]
) -> None:
    """``saved_at`` (the newest file's mtime) dates a checkpoint, else ``first_seen``: a first scan of old saves
    must not put them all in today."""
    assert _kept_steps(rule, _first_scanned_today(*saved)) == expected


def test_keep_within_months_counts_back_on_the_calendar() -> None:
    now = datetime(2024, 3, 31, 12, tzinfo=UTC)
    cs = _at(datetime(2024, 2, 29, 11, tzinfo=UTC), datetime(2024, 2, 29, 12, tzinfo=UTC), datetime(2023, 3, 31, 12, tzinfo=UTC))
    # a month before 31 March is 29 February (clamped), at the same time of day
    kept = KeepWithin(Span(1)).keeps(cs, now)
    assert sorted(c.step for c in cs if c.id in kept) == [300]
    assert kept[cs[2].id] == "keep_within 1mo: saved 2024-02-29T12:00:00+00:00"
    assert len(KeepWithin(Span(12)).keeps(cs, now)) == 3  # a year back: 31 March 2023, 12:00
    assert Span(1).before(datetime(2024, 3, 31, 12, tzinfo=UTC)) == datetime(2024, 2, 29, 12, tzinfo=UTC)
    assert Span(13, H).before(datetime(2024, 1, 15, tzinfo=UTC)) == datetime(2022, 12, 14, 23, tzinfo=UTC)


# --------------------------------------------------------------- milestones: step 0, caps, time


def test_step_zero_is_an_every_n_steps_milestone_held_only_by_a_save_at_step_zero() -> None:
    zero = [ckpt(1, "run", 0, NOW - 5 * H)] + _saves("run", 1200, 4, first_id=2)
    assert _kept_steps(Milestones(every=3000), zero) == [0, 3600]
    assert _kept_steps(Milestones(every=3000, match="exact"), zero) == [0]
    assert Milestones(every=3000).keeps(zero, NOW)[1] == "milestones every 3000 steps: step 0 is a milestone"
    # a run whose first save is at step 1200 did not save its initial state: 1200 holds nothing
    assert _kept_steps(Milestones(every=3000), _saves("run", 1200, 4)) == [3600]
    # a corrupt step 0 passes nothing on
    bad = [ckpt(1, "run", 0, NOW - 5 * H, State.CORRUPT)] + _saves("run", 1200, 4, first_id=2)
    assert _kept_steps(Milestones(every=3000), bad) == [3600]
    assert Milestones(every=3000).is_milestone(0) and not Milestones(log=True).is_milestone(0)


def test_policy_asks_every_step_at_once_as_it_asks_each() -> None:
    steps = [0, 1, 2, 3, 5, 7, 10, 20, 50, 3000, 6000, 7000, 10_000, 12_000]
    for rules in [(KeepLast(1),), (Milestones(log=True),), (KeepLast(2), Milestones(every=3000)),
                  (Milestones(log=True), Milestones(steps=(7, 7000)))]:
        policy = Policy(rules)
        assert policy.are_milestones(steps) == [policy.is_milestone(s) for s in steps], rules
    assert Policy((Milestones(log=True), Milestones(steps=(7,)))).are_milestones([7, 8, 10]) == [True, False, True]


def test_max_to_keep_holds_the_newest_milestones_only() -> None:
    cs = [ckpt(i + 1, "run", s, NOW - (10 - i) * H) for i, s in enumerate([0, 1, 2, 3, 4])]
    assert _kept_steps(Milestones(every=1, max_to_keep=3), cs) == [2, 3, 4]
    assert _kept_steps(Milestones(every=3, match="exact"), cs[:3] + cs[4:]) == [0]
    irregular = [ckpt(i + 1, "run", s, NOW - (20 - i) * H) for i, s in enumerate([0, 1, 2, 4, 5, 8, 9, 13, 14, 25])]
    # the first save at or after 3, 6, 9, 12 and 15..24 holds each
    assert _kept_steps(Milestones(every=3), irregular) == [0, 4, 8, 9, 13, 25]
    capped = Milestones(every=3, max_to_keep=3).keeps(irregular, NOW)
    assert sorted(c.step for c in irregular if c.id in capped) == [9, 13, 25]
    assert capped[irregular[-1].id].endswith("(also holds 3 smaller milestones) (#1 of the newest 3 held)")
    # a milestone dropped by the cap loses its hot copy (its archive copy stays)
    plan = plan_retention(_saves("run", 1000, 6, special={1000: {"archive": "verified"}}),
                          Policy((Milestones(every=1000, max_to_keep=2),), archive=ARCH, min_verified=0), now=NOW)
    one = _item(plan, "run", 1000)
    assert (one.action, one.scope) == ("delete", "hot-copy")
    assert {i.step for i in plan.by_action("promote")} == {5000, 6000}


def _passed_over(n: int) -> list[CheckpointRecord]:
    """``n`` corrupt saves at steps 1000, 1001, ... (a minute apart from 00:10), then a verified one."""
    t = datetime(2024, 5, 20, 0, 10, tzinfo=UTC)
    return [ckpt(i + 1, "run", 1000 + i, t + i * timedelta(minutes=1), State.CORRUPT if i < n else State.VERIFIED)
            for i in range(n + 1)]


def _three(n: int) -> str:
    return "; ".join(f"step {1000 + i} is corrupt" for i in range(min(n, 3)))


@pytest.mark.parametrize(
    ("rule", "n", "ending"),
    [
        pytest.param(Milestones(every=1000), 1, "step 1001 (step 1000 is corrupt)", id="every-one"),
        pytest.param(Milestones(every=1000), 3, f"step 1003 ({_three(3)})", id="every-three"),
        pytest.param(Milestones(every=1000), 4, f"step 1004 ({_three(4)} (+1 more))", id="every-four"),
        pytest.param(Milestones(every=1000), 6, f"step 1006 ({_three(6)} (+3 more))", id="every-six"),
        pytest.param(Milestones(interval=6 * H), 1, "step 1001 (step 1000 is corrupt)", id="interval-one"),
        pytest.param(Milestones(interval=6 * H), 3, f"step 1003 ({_three(3)})", id="interval-three"),
        pytest.param(Milestones(interval=6 * H), 4, f"step 1004 ({_three(4)} (+1 more))", id="interval-four"),
        pytest.param(Milestones(interval=6 * H), 6, f"step 1006 ({_three(6)} (+3 more))", id="interval-six"),
    ],
)
def test_a_holder_names_three_saves_passed_over_and_counts_the_rest(rule: Milestones, n: int, ending: str) -> None:
    cs = _passed_over(n)
    kept = rule.keeps(cs, NOW)
    assert list(kept) == [cs[-1].id] and kept[cs[-1].id].endswith(ending)


def test_interval_milestones_keep_the_first_save_of_each_interval() -> None:
    t = datetime(2024, 5, 20, 0, 10, tzinfo=UTC)
    cs = _at(t, t + H, t + 5 * H, t + 6 * H, t + 13 * H)  # 00:10 01:10 05:10 | 06:10 | 13:10
    rule = Milestones(interval=6 * H)
    kept = rule.keeps(cs, NOW)
    assert sorted(c.step for c in cs if c.id in kept) == [100, 400, 500]
    assert kept[cs[0].id] == "milestones every 6h of save time: holds the interval from 2024-05-20 00:00 (UTC): its first save, step 100"
    # sticky: later saves never move a holder
    later = cs + [ckpt(6, "run", 600, t + 14 * H), ckpt(7, "run", 700, t + 19 * H)]
    assert sorted(c.step for c in later if c.id in rule.keeps(later, NOW)) == [100, 400, 500, 700]
    # a corrupt first save passes the interval to the next save in it, naming it
    bad = [dataclasses.replace(cs[0], state=State.CORRUPT)] + cs[1:]
    assert rule.keeps(bad, NOW)[cs[1].id].endswith("its first save, step 200 (step 100 is corrupt)")
    # intervals are aligned to the policy's time zone: 6h in Kolkata (UTC+05:30) start at 00:30 UTC etc.
    kolkata = Milestones(interval=6 * H, timezone="Asia/Kolkata").keeps(cs, NOW)
    assert sorted(c.step for c in cs if c.id in kolkata) == [100, 200, 500]
    with pytest.raises(ConfigError, match="exact"):
        Milestones(interval=6 * H, match="exact")


def test_stages_apply_in_order_and_name_every_floor() -> None:
    policy = Policy((KeepLast(2), KeepBest("eval_loss", "min", 1)), min_drilled=1, min_verified=3)
    assert [type(s).__name__ for s in stages(policy)] == [
        "RulesVote", "DrilledFloor", "NewestVerifiedFloor", "InFlightFloor", "EvidenceFloor", "UnverifiedFloor",
        "VerifiedDecision", "ArchiveCopyFloor", "AbsentFloor", "MinVerifiedFloor", "ShrinkGuard"]
    shown = [str(s) for s in stages(policy)]
    assert shown[0] == "rules: keep_last 2; keep_best 1 by eval_loss (min)"
    assert "min_drilled 1: the 1 newest drill-passed checkpoints keep their hot copy" in shown
    assert "min_verified 3: at least 3 verified checkpoints keep a hot copy" in shown
    assert "DrilledFloor" not in [type(s).__name__ for s in stages(Policy((KeepLast(2),)))]


# ------------------------------------------------------------------ properties

JOBS = ("a", "b")


METRIC_VALUES = st.one_of(st.sampled_from([0.25, 0.5, 0.5, 1.0, float("nan"), float("inf")]),
                          st.floats(0, 4, allow_nan=False))


@st.composite
def catalogs(draw: st.DrawFn) -> list[CheckpointRecord]:
    out: list[CheckpointRecord] = []
    for job in draw(st.sampled_from([("a",), ("a", "b")])):
        steps = draw(st.lists(st.integers(0, 60), min_size=0, max_size=25, unique=True))
        for step in steps:
            state = draw(
                st.sampled_from(
                    [State.VERIFIED] * 5 + [State.COMMITTED, State.INCOMPLETE, State.CORRUPT, State.DELETED]
                )
            )
            age = timedelta(minutes=draw(st.integers(0, 60 * 24 * 400)))
            metrics = draw(st.dictionaries(st.sampled_from(["eval_loss", "acc"]), METRIC_VALUES, max_size=2))
            out.append(
                ckpt(
                    len(out) + 1,
                    job,
                    step * 10,
                    NOW - age,
                    state,
                    missing=draw(st.integers(0, 9)) == 0,
                    archive=draw(st.sampled_from([None, None, "verified", "unverified"])),
                    hot_gone=draw(st.integers(0, 14)) == 0,
                    size=draw(st.integers(1, 10_000)),
                    metrics=metrics,
                )
            )
    return out


matches = st.sampled_from(["at_or_after", "exact"])
caps = st.sampled_from([None, None, 1, 3])
ZONES = ("UTC", "Europe/Berlin", "America/New_York", "Asia/Kolkata")


def rules_in(tz: str) -> st.SearchStrategy[object]:
    """Every kind of rule, the calendar ones counting in ``tz``."""
    return st.one_of(
        st.integers(0, 6).map(KeepLast),
        matches.map(lambda m: Milestones(log=True, match=m)),
        st.tuples(st.integers(1, 20), matches, caps).map(lambda a: Milestones(every=a[0] * 10, match=a[1], max_to_keep=a[2])),
        st.tuples(st.lists(st.integers(0, 60).map(lambda s: s * 10), min_size=1, max_size=5), matches).map(
            lambda a: Milestones(steps=tuple(a[0]), match=a[1])
        ),
        st.tuples(st.sampled_from([H, 6 * H, D, 7 * D, 30 * D]), caps).map(
            lambda a: Milestones(interval=a[0], timezone=tz, max_to_keep=a[1])
        ),
        st.integers(1, 24 * 20).map(lambda h: KeepWithin(timedelta(hours=h), timezone=tz)),
        st.integers(1, 14).map(lambda m: KeepWithin(Span(m), timezone=tz)),
        st.integers(0, 30).map(lambda n: KeepHourly(n, timezone=tz)),
        st.integers(0, 10).map(lambda n: KeepDaily(n, timezone=tz)),
        st.integers(0, 4).map(lambda n: KeepWeekly(n, timezone=tz)),
        st.integers(0, 14).map(lambda n: KeepMonthly(n, timezone=tz)),
        st.integers(0, 3).map(lambda n: KeepYearly(n, timezone=tz)),
        st.tuples(st.sampled_from(["eval_loss", "acc"]), st.sampled_from(["min", "max"]), st.integers(1, 4),
                  st.booleans()).map(lambda a: KeepBest(a[0], a[1], a[2], keep_without_metric=a[3])),
        st.lists(st.integers(0, 60).map(lambda s: s * 10), max_size=4).map(lambda s: Pinned(tuple(s))),
    )


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    tz = draw(st.sampled_from(ZONES))
    rules = draw(st.lists(rules_in(tz), min_size=1, max_size=4))
    if all((getattr(r, "n", 1) == 0) or (isinstance(r, Pinned) and not r.steps) for r in rules):
        rules.append(KeepLast(1))
    return Policy(
        tuple(rules),  # type: ignore[arg-type]
        grace=timedelta(minutes=draw(st.sampled_from([0, 30, 120, 60 * 24 * 3]))),
        min_verified=draw(st.integers(0, 4)),
        archive=draw(st.sampled_from([None, ARCH])),
        hot_after_archive=draw(st.sampled_from(["delete", "keep"])),
        max_missing_fraction=draw(st.sampled_from([0.0, 0.2, 0.5, 1.0])),
        delete_stale_incomplete=draw(st.booleans()),
        archive_after=draw(st.sampled_from([None, None, timedelta(hours=12), 7 * D, Span(1)])),
        archive_when=draw(st.sampled_from(["immediately", "leaving_hot"])),
        min_drilled=draw(st.sampled_from([0, 0, 1, 2])),
        timezone=tz,
    )


@st.composite
def drills_of(draw: st.DrawFn, cs: list[CheckpointRecord]) -> dict[int, datetime]:
    """A drill-passed map over some of ``cs`` (tombstones included: a drill may predate a deletion)."""
    chosen = draw(st.lists(st.sampled_from([c.id for c in cs]), unique=True, max_size=6)) if cs else []
    return {cid: NOW - timedelta(hours=draw(st.integers(1, 500))) for cid in chosen}


@st.composite
def planning_inputs(draw: st.DrawFn) -> tuple[list[CheckpointRecord], Policy, dict[int, datetime]]:
    cs = draw(catalogs())
    return cs, draw(policies()), draw(drills_of(cs))


#: The rules that keep a checkpoint in hot storage (every rule but milestones).
HOT_RULES = (KeepLast, KeepBest, KeepWithin, KeepHourly, KeepDaily, KeepWeekly, KeepMonthly, KeepYearly, Pinned)


def _held_hot(policy: Policy, cs: Sequence[CheckpointRecord], drilled: dict[int, datetime]) -> set[int]:
    """Ids that something other than a milestone keeps in hot storage (the leaving_hot window)."""
    out = _rule_kept(policy, cs, HOT_RULES)
    for job in {c.job for c in cs}:
        live = [c for c in cs if c.job == job and c.state != State.DELETED]
        ver = [c for c in live if c.state == State.VERIFIED]
        if ver:
            out.add(max(ver, key=lambda c: (c.step, c.saved_at, c.id)).id)
        out |= {c.id for c in newest_drilled(live, drilled, policy.min_drilled)}
    return out


def _holders(policy: Policy, cs: Sequence[CheckpointRecord]) -> set[int]:
    """Ids that hold (or, committed, will hold) a milestone: each milestone rule's
    :meth:`Milestones.keeps` over each job's live checkpoints (planning's own question)."""
    return _rule_kept(policy, cs, (Milestones,))


def _rule_kept(policy: Policy, cs: Sequence[CheckpointRecord], kinds: tuple[type, ...]) -> set[int]:
    kept: set[int] = set()
    for job in {c.job for c in cs}:
        live = [c for c in cs if c.job == job and c.state != State.DELETED]
        for r in policy.rules:
            if isinstance(r, kinds):
                kept |= set(r.keeps(live, NOW))
    return kept


PROP = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROP
@given(planning_inputs())
def test_invariants(inputs: tuple[list[CheckpointRecord], Policy, dict[int, datetime]]) -> None:
    cs, policy, drilled = inputs
    plan = plan_retention(cs, policy, now=NOW, drill_passed=drilled)
    by_id = {c.id: c for c in cs}
    holders = _holders(policy, cs)
    held_hot = _held_hot(policy, cs, drilled)
    items = {i.checkpoint_id: i for i in plan.items}
    # disjoint and covering: one item per live checkpoint; tombstones excluded
    assert len(items) == len(plan.items)
    assert set(items) == {c.id for c in cs if c.state != State.DELETED}
    assert set(plan.excluded) == {c.id for c in cs if c.state == State.DELETED}
    assert [(i.job, i.step, i.checkpoint_id) for i in plan.items] == sorted(
        (i.job, i.step, i.checkpoint_id) for i in plan.items
    )
    deleted = {cid for cid, i in items.items() if i.action == "delete"}
    for cid, item in items.items():
        c = by_id[cid]
        assert item.reasons and all(isinstance(r, str) and r for r in item.reasons)
        assert item.action in ("keep", "promote", "delete")
        assert item.bytes == c.bytes
        if item.action != "delete":
            assert item.scope == "checkpoint"
        if item.action == "promote":
            assert policy.archive and c.state == State.VERIFIED and not c.has_verified_archive()
            assert hot_present(c) and cid in holders
            if policy.archive_after is not None:
                assert c.saved_at <= Span.of(policy.archive_after).before(NOW, zone(policy.timezone))  # type: ignore[operator]
            if policy.archive_when == "leaving_hot":
                assert cid not in held_hot, "stored twice: promoted while another rule keeps it hot"
    for cid in deleted:
        c = by_id[cid]
        assert hot_present(c), "nothing to delete when the hot copy is missing"
        assert c.state in (State.VERIFIED, State.INCOMPLETE)
        if c.state == State.INCOMPLETE:
            assert policy.delete_stale_incomplete and NOW - c.saved_at >= policy.grace  # type: ignore[operator]
        if items[cid].scope == "hot-copy":
            assert any(x.tier == Tier.ARCHIVE for x in c.copies)
        else:
            assert not any(x.tier == Tier.ARCHIVE and x.state == "present" for x in c.copies)
        if c.state == State.VERIFIED and cid in holders:
            assert c.has_verified_archive() and policy.archive and items[cid].scope == "hot-copy"
    # every verified checkpoint on a milestone step holds it, whichever the matching (uncapped)
    uncapped = [m for m in policy.milestones if m.max_to_keep is None]
    assert {c.id for c in cs if c.state == State.VERIFIED and any(m.is_milestone(c.step) for m in uncapped)} <= holders
    for m in policy.milestones:
        for job in {c.job for c in cs}:
            live = [c for c in cs if c.job == job and c.state != State.DELETED]
            kept = m.keeps(live, NOW)
            if m.match == "exact":
                assert all(m.is_milestone(by_id[cid].step) for cid in kept)
            # a holder is verified, or committed and pending its verification
            assert all(by_id[cid].state in (State.VERIFIED, State.COMMITTED) for cid in kept)
            if m.max_to_keep is not None:
                assert len(kept) <= m.max_to_keep
            if m.interval is not None:  # at most one holder per interval
                starts = [r.split("interval from ")[1].split(")")[0] for r in kept.values()]
                assert len(starts) == len(set(starts))
    # the newest drill-passed recovery points are never deleted, not even their hot copy
    for job in {c.job for c in cs}:
        live = [c for c in cs if c.job == job and c.state != State.DELETED]
        for c in newest_drilled(live, drilled, policy.min_drilled):
            assert items[c.id].action != "delete"
            assert any("drill-passed recovery point" in r for r in items[c.id].reasons)
    # the newest verified checkpoint of each job is never deleted
    for job in {c.job for c in cs}:
        ver = [c for c in cs if c.job == job and c.state == State.VERIFIED]
        if ver:
            newest = max(ver, key=lambda c: (c.step, c.saved_at, c.id))
            assert items[newest.id].action != "delete"
            # floor: min_verified verified checkpoints keep a hot copy when there are enough
            hot = [c for c in ver if hot_present(c)]
            kept_hot = [c for c in hot if items[c.id].action != "delete"]
            assert len(kept_hot) >= min(policy.min_verified, len(hot))
    # what a non-milestone rule keeps is never deleted
    assert not deleted & _rule_kept(policy, cs, HOT_RULES)
    # a best-K checkpoint is never deleted (not even its hot copy) while it is among the K best
    for job in {c.job for c in cs}:
        live = [c for c in cs if c.job == job and c.state != State.DELETED]
        for r in policy.rules:
            if isinstance(r, KeepBest):
                best = r.best(live)
                assert len(best) == min(r.n, len(r.ranked(live)))
                for c, value in best:
                    assert c.state == State.VERIFIED and math.isfinite(value)
                    assert items[c.id].action != "delete", f"{c.step} is among the {r.n} best by {r.metric}"
                    assert any(x.startswith(f"{r}: best ") for x in items[c.id].reasons)
                # nothing outside the K best is ranked better than the K-th
                if len(best) == r.n:
                    kth = best[-1][1]
                    for _c, value in r.ranked(live)[r.n:]:
                        assert (value >= kth) if r.mode == "min" else (value <= kth)
    # shrink guard
    for job in {c.job for c in cs}:
        live = [c for c in cs if c.job == job and c.state != State.DELETED]
        gone = sum(c.missing_since is not None for c in live)
        should = bool(live) and (gone == len(live) or gone / len(live) > policy.max_missing_fraction)
        assert (job in plan.refused_jobs) == should
        if should:
            assert not [c for c in live if items[c.id].action == "delete"]
    assert (plan.refused is None) == (not plan.refused_jobs)
    assert plan.bytes_kept + plan.bytes_promoted + plan.bytes_deleted == sum(
        by_id[i].bytes for i in items
    )


@PROP
@given(planning_inputs(), st.randoms(use_true_random=False))
def test_pure_and_order_independent(
    inputs: tuple[list[CheckpointRecord], Policy, dict[int, datetime]], rnd: random.Random
) -> None:
    cs, policy, drilled = inputs
    first = plan_retention(cs, policy, now=NOW, drill_passed=drilled)
    shuffled = list(cs)
    rnd.shuffle(shuffled)
    assert plan_retention(shuffled, policy, now=NOW, drill_passed=dict(reversed(list(drilled.items())))) == first


@PROP
@given(catalogs(), policies(), st.data())
def test_milestones_never_slide_when_a_holder_loses_its_hot_copy(
    cs: list[CheckpointRecord], policy: Policy, data: st.DataObject
) -> None:
    """Deleting a holder's hot copy (archive kept), or a scan missing it, moves no milestone."""
    holders = _holders(policy, cs)
    verified_holders = sorted(cid for cid in holders if next(c for c in cs if c.id == cid).state == State.VERIFIED)
    if not verified_holders:
        return
    victim = data.draw(st.sampled_from(verified_holders))
    how = data.draw(st.sampled_from(["hot-copy-deleted", "missing"]))
    changed = []
    for c in cs:
        if c.id == victim:
            hot = CopyRecord(Tier.HOT, c.location, "deleted" if how == "hot-copy-deleted" else "missing", c.bytes, None)
            arch = CopyRecord(Tier.ARCHIVE, f"s3://arch/{c.job}/{c.step}", "present", c.bytes, NOW - H, "zstd")
            extra = (hot, arch) if how == "hot-copy-deleted" else (hot,)
            c = dataclasses.replace(
                c, copies=tuple(x for x in c.copies if x.tier != Tier.HOT) + extra,
                missing_since=NOW - H if how == "missing" else c.missing_since,
            )
        changed.append(c)
    assert _holders(policy, changed) == holders


@PROP
@given(catalogs(), policies())
def test_in_flight_never_counts_toward_keep_last(cs: list[CheckpointRecord], policy: Policy) -> None:
    """Adding in-flight saves above every step (and after every save: the newest save in time
    too, as a save above every step is) changes no other decision."""
    base = plan_retention(cs, policy, now=NOW)
    top = max((c.step for c in cs), default=0)
    newest = max([NOW - timedelta(seconds=1)] + [(c.saved_at or c.first_seen) + timedelta(seconds=1) for c in cs])
    extra = [
        ckpt(10_000 + k, job, top + 10 * (k + 1), newest, State.INCOMPLETE)
        for k, job in enumerate(sorted({c.job for c in cs}))
    ]
    if any(policy.is_milestone(c.step) or any(isinstance(r, Pinned) and c.step in r.steps for r in policy.rules) for c in extra):
        return
    plan = plan_retention(cs + extra, policy, now=NOW)
    if base.refused_jobs or plan.refused_jobs:
        return  # the extra live checkpoints change the shrink guard's fraction
    grace_positive = policy.grace > timedelta(seconds=1)
    new_items = {i.checkpoint_id: i for i in plan.items}
    for c in extra:
        if grace_positive:
            assert new_items[c.id].action == "keep" and new_items[c.id].reasons[0].startswith("in flight")
    for i in base.items:
        assert new_items[i.checkpoint_id] == i


def test_the_best_ranked_are_proven_before_a_worse_one_is_deleted() -> None:
    """apply proves again what a deletion rests on: a worse checkpoint goes because the K best exist."""
    from ckptier.tasks.retention import keepers

    cs = _scored([0.9, 0.2, 0.5, 0.1, 0.8, 0.7])
    policy = Policy((KeepLast(1), KeepBest("eval_loss", "min", 2, keep_without_metric=False)), min_verified=0)
    plan = plan_retention(cs, policy, now=NOW)
    assert [k.step for k in keepers(cs, policy, plan.items)] == [600, 400, 200]


# --------------------------------------------------------------- the pure helpers, as tables


def _live(n: int, missing: int = 0, deleted: int = 0) -> list[CheckpointRecord]:
    """``n`` checkpoints of job "run" (the first ``missing`` missing from hot storage), plus ``deleted`` tombstones
    that are missing too."""
    out = [ckpt(i + 1, "run", 100 * (i + 1), NOW - D, missing=i < missing) for i in range(n)]
    return out + [ckpt(n + i + 1, "run", 100 * (n + i + 1), NOW - D, State.DELETED, missing=True) for i in range(deleted)]


@pytest.mark.parametrize(
    ("cs", "fraction", "suspended"),
    [
        pytest.param(_live(4, 2), 0.5, None, id="half-is-not-more-than-half"),
        pytest.param(_live(4, 3), 0.5, "3 of 4 checkpoints missing from hot storage (75% > max_missing_fraction 50%)",
                     id="more-than-half"),
        pytest.param(_live(2, 2), 1.0, "2 of 2 checkpoints missing from hot storage (100% > max_missing_fraction 100%)",
                     id="all-missing-even-at-1"),
        pytest.param(_live(4, 0), 0.0, None, id="none-missing-at-0"),
        pytest.param(_live(4, 1), 0.0, "1 of 4 checkpoints", id="one-missing-at-0"),
        pytest.param(_live(2, 0, deleted=5), 0.5, None, id="tombstones-do-not-count"),
        pytest.param(_live(0, 0, deleted=2), 0.5, None, id="only-tombstones"),
        pytest.param([], 0.5, None, id="nothing"),
    ],
)
def test_shrink_guard(cs: list[CheckpointRecord], fraction: float, suspended: str | None) -> None:
    got = shrink_guard(cs, fraction)
    if suspended is None:
        assert got is None
    else:
        assert got is not None and got.startswith("deletion suspended for job 'run': ") and suspended in got
        assert got.endswith("'ckptier forget --job run --missing' tombstones those gone from every tier")


@pytest.mark.parametrize(
    ("c", "present"),
    [
        pytest.param(ckpt(1, "run", 100, NOW), True, id="no-copies-recorded"),
        pytest.param(ckpt(1, "run", 100, NOW, missing=True), False, id="missing"),
        pytest.param(ckpt(1, "run", 100, NOW, hot_gone=True), False, id="hot-copy-deleted"),
        pytest.param(dataclasses.replace(ckpt(1, "run", 100, NOW), copies=(
            CopyRecord(Tier.HOT, "file:///hot/run/100", "missing", 1, None),)), False, id="hot-copy-missing"),
        pytest.param(dataclasses.replace(ckpt(1, "run", 100, NOW), copies=(
            CopyRecord(Tier.ARCHIVE, "s3://arch/run/100", "missing", 1, None),)), True, id="archive-copy-missing"),
        pytest.param(dataclasses.replace(ckpt(1, "run", 100, NOW), copies=(
            CopyRecord(Tier.HOT, "file:///hot/run/100", "degraded", 1, None),)), True, id="hot-copy-degraded"),
    ],
)
def test_hot_present(c: CheckpointRecord, present: bool) -> None:
    assert hot_present(c) is present


def test_newest_drilled_counts_live_checkpoints_newest_first() -> None:
    cs = _live(5) + [ckpt(9, "run", 900, NOW - D, State.DELETED)]
    passed = {c.id: NOW for c in cs if c.id != 4}
    assert [c.step for c in newest_drilled(cs, passed, 2)] == [500, 300]
    assert [c.step for c in newest_drilled(cs, passed, 9)] == [500, 300, 200, 100]
    assert newest_drilled(cs, passed, 0) == [] and newest_drilled(cs, {}, 3) == []


def test_plan_sums_bytes_by_action() -> None:
    plan = Plan(items=[PlanItem("run", s, s, a, ("r",), b) for s, a, b in
                       ((1, "keep", 10), (2, "keep", 5), (3, "promote", 7), (4, "delete", 3), (5, "delete", 1))])
    assert plan.summary() == {"keep": 2, "promote": 1, "delete": 2, "bytes_kept": 15, "bytes_promoted": 7,
                              "bytes_deleted": 4}
    assert [i.step for i in plan.by_action("delete")] == [4, 5]


def _incomplete(age: timedelta, **kw: object) -> list[CheckpointRecord]:
    """Two verified saves, then an incomplete one saved ``age`` ago (step 300)."""
    return [ckpt(1, "run", 100, NOW - D), ckpt(2, "run", 200, NOW - D), ckpt(3, "run", 300, NOW - age, State.INCOMPLETE,
                                                                            **kw)]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("cs", "policy", "action", "reason"),
    [
        pytest.param(_incomplete(2 * H - timedelta(seconds=1)), Policy((KeepLast(2),)), "keep",
                     "in flight: incomplete for 1h59min59s < grace 2h", id="in-flight"),
        pytest.param(_incomplete(2 * H), Policy((KeepLast(2),)), "keep",
                     "stale incomplete: past grace 2h: candidate for review", id="stale-at-grace"),
        pytest.param(_incomplete(2 * H), Policy((KeepLast(2),), delete_stale_incomplete=True), "delete",
                     "stale incomplete: past grace 2h; delete_stale_incomplete is set", id="stale-deleted"),
        pytest.param(_incomplete(2 * H, missing=True), Policy((KeepLast(2),), delete_stale_incomplete=True), "keep",
                     "stale incomplete: past grace 2h: candidate for review", id="stale-missing-kept"),
        pytest.param(_incomplete(2 * H), Policy((KeepLast(2), Pinned((300,))), delete_stale_incomplete=True), "keep",
                     "stale incomplete: past grace 2h: candidate for review", id="stale-pinned-kept"),
    ],
)
def test_incomplete_saves_in_flight_and_stale(cs: list[CheckpointRecord], policy: Policy, action: str,
                                              reason: str) -> None:
    item = _item(plan_retention(cs, policy, now=NOW), "run", 300)
    assert (item.action, item.reasons[0]) == (action, reason)


def test_min_drilled_ranks_its_recovery_points() -> None:
    cs = _live(4)
    passed = {c.id: NOW - H for c in cs}
    plan = plan_retention(cs, Policy((KeepLast(1),), min_drilled=2, min_verified=0), now=NOW, drill_passed=passed)
    assert [r for r in _item(plan, "run", 300).reasons] == [
        f"min_drilled 2: #2 newest drill-passed recovery point (drill passed {(NOW - H).isoformat()})"]
    assert _item(plan, "run", 400).reasons[-1].startswith("min_drilled 2: newest drill-passed recovery point")
    assert _item(plan, "run", 200).action == "delete"


def test_policy_and_rule_defaults_are_the_documented_ones() -> None:
    """docs/retention.md's table of settings; keep_best as Orbax's BestN keeps checkpoints without the metric."""
    p = Policy((KeepLast(1),))
    assert (p.min_verified, p.min_drilled, p.grace, p.delete_stale_incomplete, p.max_missing_fraction,
            p.hot_after_archive, p.archive_when) == (2, 0, 2 * H, False, 0.5, "delete", "immediately")
    best = KeepBest("eval_loss")
    assert (best.mode, best.n, best.keep_without_metric) == ("min", 1, True)


@pytest.mark.parametrize(
    ("policy", "shown"),
    [
        pytest.param(Policy((KeepLast(3),)), "keep_last 3, grace 2h, min_verified 2", id="plain"),
        pytest.param(Policy((KeepDaily(1),)), "keep_daily 1, timezone UTC, grace 2h, min_verified 2",
                     id="calendar-rule-names-its-zone"),
        pytest.param(Policy((KeepLast(1), Pinned((300, 100))), min_drilled=1), "keep_last 1, pinned 100, 300, grace 2h, "
                     "min_verified 2, min_drilled 1", id="pinned-sorted-min_drilled"),
        pytest.param(Policy((KeepLast(1),), archive=ARCH, archive_after=14 * D, archive_when="leaving_hot"),
                     f"keep_last 1, grace 2h, min_verified 2, archive {ARCH} (hot after archive: delete), "
                     "archive_after 2w, archive_when leaving_hot", id="archive-settings"),
        pytest.param(Policy((KeepLast(1),), archive=ARCH), f"keep_last 1, grace 2h, min_verified 2, archive {ARCH} "
                     "(hot after archive: delete)", id="archive-defaults"),
    ],
)
def test_policy_strings(policy: Policy, shown: str) -> None:
    assert str(policy) == shown


def test_interval_milestones_are_aligned_to_1_january_1970() -> None:
    """7-day intervals start on Thursdays, as 1 January 1970 was one (6-hour ones at 00:00, 06:00...)."""
    monday = datetime(2024, 5, 20, 9, tzinfo=UTC)
    cs = _at(monday, monday + 2 * D, monday + 3 * D)  # Monday, Wednesday | Thursday
    kept = Milestones(interval=7 * D).keeps(cs, NOW)
    assert sorted(c.step for c in cs if c.id in kept) == [100, 300]
    assert kept[cs[0].id].startswith("milestones every 1w of save time: holds the interval from 2024-05-16 00:00 (UTC)")
    assert kept[cs[2].id].startswith("milestones every 1w of save time: holds the interval from 2024-05-23 00:00 (UTC)")


def test_the_log_series_reaches_every_signed_64_bit_step() -> None:
    assert Milestones(log=True).between(4 * 10**18, 2**63 - 1) == (5 * 10**18, 5 * 10**18, 1)
    assert Milestones(log=True).between(0, 1) == (1, 1, 1)


def test_milestone_holders_leave_tombstones_out() -> None:
    """Planning hands a milestone rule the job's tombstones too: a tombstone never holds one."""
    cs = [ckpt(1, "run", 100, NOW - D), ckpt(2, "run", 200, NOW - D, State.DELETED)]
    assert set(Milestones(steps=(100, 200)).keeps(cs, NOW)) == {1}
    plan = plan_retention(cs, Policy((Milestones(steps=(100, 200)),)), now=NOW)
    assert [(i.step, i.action) for i in plan.items] == [(100, "keep")]  # the tombstone: no item, held by nothing


def _archived(*copies: tuple[str, datetime | None]) -> CheckpointRecord:
    """A verified milestone (step 100) whose archive copies are ``(state, verified_at)``."""
    c = ckpt(1, "run", 100, NOW - 10 * D)
    return dataclasses.replace(c, copies=tuple(CopyRecord(Tier.ARCHIVE, f"s3://arch/run/100/{i}", state, 8, at)
                                               for i, (state, at) in enumerate(copies)))


@pytest.mark.parametrize(
    ("milestone", "reason"),
    [
        pytest.param(_archived(("present", NOW - 3 * D)), f"archived copy verified at {(NOW - 3 * D).isoformat()}; "
                     "hot copy not needed", id="one"),
        pytest.param(_archived(("present", NOW - 3 * D), ("present", NOW - 2 * D), ("missing", NOW - D)),
                     f"archived copy verified at {(NOW - 2 * D).isoformat()}; hot copy not needed",
                     id="the-newest-present-verified"),
    ],
)
def test_a_milestone_hot_copy_goes_once_archived_naming_when(milestone: CheckpointRecord, reason: str) -> None:
    cs = [milestone, ckpt(2, "run", 200, NOW - D), ckpt(3, "run", 300, NOW - H)]
    plan = plan_retention(cs, Policy((KeepLast(2), Milestones(steps=(100,))), archive=ARCH), now=NOW)
    item = _item(plan, "run", 100)
    assert (item.action, item.scope, item.reasons[-1]) == ("delete", "hot-copy", reason)


@pytest.mark.parametrize(
    ("age", "policy", "action", "reason"),
    [
        pytest.param(3 * D, Policy((KeepLast(1), Milestones(steps=(100,))), archive=ARCH, archive_after=14 * D),
                     "keep", "no verified archive copy yet: archive_after 2w: promoted once older (saved 3d ago)",
                     id="too-young"),
        pytest.param(timedelta(milliseconds=400), Policy((KeepLast(1), Milestones(steps=(100,))), archive=ARCH,
                                                         archive_after=14 * D),
                     "keep", "no verified archive copy yet: archive_after 2w: promoted once older (saved 0s ago)",
                     id="saved-under-a-second-ago"),
        pytest.param(-H, Policy((KeepLast(1), Milestones(steps=(100,))), archive=ARCH, archive_after=14 * D),
                     "keep", "no verified archive copy yet: archive_after 2w: promoted once older (saved 0s ago)",
                     id="saved-ahead-of-the-clock"),
        pytest.param(14 * D, Policy((KeepLast(1), Milestones(steps=(100,))), archive=ARCH, archive_after=14 * D),
                     "promote", f"no verified archive copy yet: promote to {ARCH}", id="exactly-archive_after-old"),
        pytest.param(3 * D, Policy((KeepLast(2), Milestones(steps=(100,))), archive=ARCH, archive_when="leaving_hot"),
                     "keep", "no verified archive copy yet: archive_when leaving_hot: promoted when no other rule keeps "
                     "it in hot storage", id="leaving-hot-held"),
        pytest.param(3 * D, Policy((KeepLast(1), Milestones(steps=(100,))), archive=ARCH, archive_when="leaving_hot"),
                     "promote", f"no verified archive copy yet: promote to {ARCH}", id="leaving-hot-left"),
        pytest.param(3 * D, Policy((KeepLast(2), Milestones(steps=(100,))), archive=ARCH), "promote",
                     f"no verified archive copy yet: promote to {ARCH}", id="immediately-while-held"),
    ],
)
def test_when_a_milestone_is_promoted(age: timedelta, policy: Policy, action: str, reason: str) -> None:
    cs = [ckpt(1, "run", 100, NOW - age), ckpt(2, "run", 200, NOW - H)]
    item = _item(plan_retention(cs, policy, now=NOW), "run", 100)
    assert (item.action, item.reasons[-1]) == (action, reason)


def test_the_newest_verified_reason_comes_first() -> None:
    plan = plan_retention(_live(3), Policy((KeepLast(2),)), now=NOW)
    assert _item(plan, "run", 300).reasons == ("newest verified checkpoint of the job", "keep_last 2: #1 newest verified")


def test_stale_incomplete_saves_are_kept_for_review_unless_told() -> None:
    from ckptier.tasks.retention import InFlightFloor

    assert str(InFlightFloor(2 * H)) == "incomplete saves in flight for up to grace 2h; stale ones kept for review"
    assert str(InFlightFloor(2 * H, True)).endswith("stale ones deleted (delete_stale_incomplete)")


def _keepers_case() -> tuple[list[CheckpointRecord], list[PlanItem]]:
    cs = _live(5) + [ckpt(6, "run", 600, NOW - H, State.COMMITTED)]
    items = [PlanItem("run", c.step, c.id, "delete" if c.id in (1, 2, 4) else "keep", ("r",), 1) for c in cs]
    return cs, items


@pytest.mark.parametrize(
    ("policy", "steps"),
    [
        pytest.param(Policy((KeepLast(1),), min_verified=1), [500], id="newest"),
        pytest.param(Policy((KeepLast(1),), min_verified=2), [500, 300], id="the-floor-of-what-is-not-deleted"),
        pytest.param(Policy((KeepLast(2),), min_verified=0), [500, 400], id="keep_last"),
        pytest.param(None, [500, 300], id="no-policy-every-verified-not-deleted"),
    ],
)
def test_keepers(policy: Policy | None, steps: list[int]) -> None:
    from ckptier.tasks.retention import keepers

    cs, items = _keepers_case()
    assert [c.step for c in keepers(cs, policy, items)] == steps
