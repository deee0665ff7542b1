"""Retention planning: golden table over one fixed catalog, and invariants.

The table runs many policies against ONE fixed catalog and compares each plan
with ``tests/golden/retention/<name>.json`` (restic's approach). After a
deliberate change of behaviour, regenerate with::

    CKPTIER_REGEN_GOLDEN=1 python -m pytest tests/test_retention.py

and review the diff of the golden files before committing them.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptier.storage.errors import ConfigError
from ckptier.storage.model import CheckpointRecord, CopyRecord, Format, State, Tier
from ckptier.tasks.retention import (
    KeepDaily,
    KeepLast,
    KeepWeekly,
    KeepWithin,
    Milestones,
    Pinned,
    Plan,
    Policy,
    format_duration,
    hot_present,
    is_log_milestone,
    parse_duration,
    plan_retention,
    render_plan_table,
)

GOLDEN = Path(__file__).parent / "golden" / "retention"
REGEN = os.environ.get("CKPTIER_REGEN_GOLDEN", "") not in ("", "0")
NOW = datetime(2024, 5, 21, 12, 0, tzinfo=timezone.utc)
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
    )


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
        out.append(ckpt(len(out) + 1, "bert", step, start + i * 6 * H, size=500 + step // 500, **kw))  # type: ignore[arg-type]
    return out


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
}


def _golden_doc(name: str, policy: Policy, plan: Plan) -> dict[str, object]:
    return {
        "policy": str(policy),
        "now": NOW.isoformat(),
        "refused": plan.refused,
        "summary": plan.summary(),
        "excluded": list(plan.excluded),
        "missing": list(plan.missing),
        "stale": list(plan.stale),
        "items": render_plan_table(plan),
    }


def test_table_has_enough_rows() -> None:
    assert len(POLICIES) >= 20
    assert len(fixed_catalog()) == 60


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_golden_plans(name: str) -> None:
    policy = POLICIES[name]
    catalog = fixed_catalog()
    plan = plan_retention(catalog, policy, now=NOW)
    live = {c.id for c in catalog if c.state != State.DELETED}
    # keep + promote + delete == input, on every row.
    ids = [i.checkpoint_id for i in plan.items]
    assert len(ids) == len(set(ids))
    assert set(ids) == live
    assert sum(len(plan.by_action(a)) for a in ("keep", "promote", "delete")) == len(live)  # type: ignore[arg-type]
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


# ------------------------------------------------------------------ properties

JOBS = ("a", "b")


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
            age = timedelta(minutes=draw(st.integers(0, 60 * 24 * 30)))
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
                )
            )
    return out


rules_st = st.one_of(
    st.integers(0, 6).map(KeepLast),
    st.just(Milestones(log=True)),
    st.integers(1, 20).map(lambda n: Milestones(every=n * 10)),
    st.lists(st.integers(0, 60).map(lambda s: s * 10), min_size=1, max_size=5).map(lambda s: Milestones(steps=tuple(s))),
    st.integers(1, 24 * 20).map(lambda h: KeepWithin(timedelta(hours=h))),
    st.integers(0, 10).map(KeepDaily),
    st.integers(0, 4).map(KeepWeekly),
    st.lists(st.integers(0, 60).map(lambda s: s * 10), max_size=4).map(lambda s: Pinned(tuple(s))),
)


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    rules = draw(st.lists(rules_st, min_size=1, max_size=4))
    if all((getattr(r, "n", 1) == 0) or (isinstance(r, Pinned) and not r.steps) for r in rules):
        rules.append(KeepLast(1))
    return Policy(
        tuple(rules),
        grace=timedelta(minutes=draw(st.sampled_from([0, 30, 120, 60 * 24 * 3]))),
        min_verified=draw(st.integers(0, 4)),
        archive=draw(st.sampled_from([None, ARCH])),
        hot_after_archive=draw(st.sampled_from(["delete", "keep"])),
        max_missing_fraction=draw(st.sampled_from([0.0, 0.2, 0.5, 1.0])),
        delete_stale_incomplete=draw(st.booleans()),
    )


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
@given(catalogs(), policies())
def test_invariants(cs: list[CheckpointRecord], policy: Policy) -> None:
    plan = plan_retention(cs, policy, now=NOW)
    by_id = {c.id: c for c in cs}
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
            assert hot_present(c) and policy.is_milestone(c.step)
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
        if c.state == State.VERIFIED and policy.is_milestone(c.step):
            assert c.has_verified_archive() and policy.archive and items[cid].scope == "hot-copy"
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
    assert not deleted & _rule_kept(policy, cs, (KeepLast, KeepWithin, KeepDaily, KeepWeekly, Pinned))
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
@given(catalogs(), policies(), st.randoms(use_true_random=False))
def test_pure_and_order_independent(cs: list[CheckpointRecord], policy: Policy, rnd: random.Random) -> None:
    first = plan_retention(cs, policy, now=NOW)
    shuffled = list(cs)
    rnd.shuffle(shuffled)
    assert plan_retention(shuffled, policy, now=NOW) == first


@PROP
@given(catalogs(), policies())
def test_in_flight_never_counts_toward_keep_last(cs: list[CheckpointRecord], policy: Policy) -> None:
    """Adding in-flight saves above every step changes no other decision."""
    base = plan_retention(cs, policy, now=NOW)
    top = max((c.step for c in cs), default=0)
    extra = [
        ckpt(10_000 + k, job, top + 10 * (k + 1), NOW - timedelta(seconds=1), State.INCOMPLETE)
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
