"""``ckptier advise``: the storage guide's table, the interval formulas, the
night-by-night simulation with the real planner, measured jobs, the command."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from ckptier.flows.cli import main
from ckptier.storage.records import (
    CheckpointRecord,
    CopyRecord,
    FileRecord,
    Format,
    State,
    Tier,
)
from ckptier.tasks.advise import (
    DEFAULTS,
    SIM_START,
    Request,
    advise,
    bytes_per_param,
    daly_interval,
    observe_job,
    overhead,
    recovery_gaps,
    simulate_storage,
    young_interval,
)
from ckptier.tasks.prices import DEFAULT_PRICES, LIST_PRICE_NOTE, requests_for
from ckptier.tasks.retention import (
    KeepLast,
    Milestones,
    Plan,
    PlanItem,
    Policy,
    plan_retention,
)
from ckptier.tasks.tiers import ArchiveTier

GB = 10**9
D = timedelta(days=1)
POLICY = Policy((KeepLast(5), Milestones(log=True)), archive="s3://cold/ckpt", storage_class="GLACIER_IR")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------ the storage guide's table


@pytest.mark.parametrize("params, guide_bandwidth", [(7e9, 190e6), (70e9, 1.9e9), (700e9, 19e9)])
def test_defaults_reproduce_the_storage_guides_table(params: float, guide_bandwidth: float) -> None:
    """About 8-10 bytes per parameter for weights plus optimizer state, and the
    bandwidth to save within five minutes: ~190 MB/s (7B), 1.9 GB/s (70B), 19 GB/s (700B)."""
    a = advise(Request(params=params), POLICY, DEFAULT_PRICES)
    assert 8 <= a.sizing.bytes_per_param <= 10  # type: ignore[operator]
    assert a.sizing.total_bytes == pytest.approx(params * a.sizing.bytes_per_param)  # type: ignore[operator]
    assert a.bandwidth.window_s == 300
    assert a.bandwidth.bytes_per_s == pytest.approx(guide_bandwidth, rel=0.15)


def test_cli_7b_in_five_minutes_prints_the_guides_bandwidth(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no ./ckptier.toml: built-in config and prices
    monkeypatch.delenv("CKPTIER_CONFIG", raising=False)
    code, out, err = run(capsys, "advise", "--params", "7e9", "--write-window", "5min")
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("bandwidth"))
    match = re.search(r"([0-9.]+) MB/s to save within 5min", line)
    assert match, line
    assert float(match.group(1)) == pytest.approx(190, rel=0.15)
    # every cost at default prices says so
    assert "list-price assumption" in out
    for cost_line in (x for x in out.splitlines() if "$" in x):
        assert "*" in cost_line


@pytest.mark.parametrize(
    "dtype, optimizer, state, master, expected",
    [
        ("bf16", "adamw", "bf16", True, 8.0),  # the default: fp32 master + bf16 moments
        ("bf16", "adamw", "fp32", True, 12.0),  # fp32 master + fp32 moments
        ("bf16", "adamw", "fp32", False, 10.0),  # bf16 weights + fp32 moments
        ("fp32", "adamw", "fp32", True, 12.0),  # plain fp32 training (master is the weights)
        ("fp32", "adam", "fp32", False, 12.0),
        ("bf16", "sgd", "bf16", False, 2.0),
        ("bf16", "sgd", "bf16", True, 4.0),
        ("fp32", "sgd-momentum", "fp32", False, 8.0),
        ("bf16", "sgd-momentum", "bf16", True, 6.0),
        ("bf16", "adafactor", "fp32", True, 4.0),  # factored second moments, ~0 per parameter
        ("fp16", "adam", "fp16", False, 6.0),
        ("fp8", "adamw", "bf16", True, 8.0),
    ],
)
def test_bytes_per_param_by_dtype_and_optimizer(dtype: str, optimizer: str, state: str, master: bool, expected: float) -> None:
    assert sum(c.bytes_per_param for c in bytes_per_param(dtype, optimizer, state, master)) == expected


def test_sizing_components_and_per_rank() -> None:
    a = advise(Request(params=70e9, ranks=512), POLICY, DEFAULT_PRICES)
    assert [c.bytes for c in a.sizing.components] == [280 * GB, 280 * GB]
    assert "fp32 master" in a.sizing.components[0].name and "2 x bf16" in a.sizing.components[1].name
    assert a.sizing.per_rank_bytes == 560 * GB // 512
    assert a.bandwidth.per_rank_bytes_per_s == pytest.approx(560 * GB / 300 / 512)
    fp32 = advise(Request(params=1e9, dtype="fp32"), POLICY, DEFAULT_PRICES)
    assert fp32.sizing.bytes_per_param == 12  # fp32 training defaults to fp32 moments


# ------------------------------------------------------------------ Young and Daly


def test_young_and_daly_formulas() -> None:
    assert young_interval(300, 28800) == pytest.approx(4156.92, abs=0.01)  # sqrt(2·300·28800)
    x = 300 / 57600
    assert daly_interval(300, 28800) == pytest.approx((2 * 300 * 28800) ** 0.5 * (1 + x**0.5 / 3 + x / 9) - 300)
    assert daly_interval(300, 28800) < young_interval(300, 28800)
    assert daly_interval(20_000, 8_000) == 8_000  # δ ≥ 2M: the MTBF itself


@pytest.mark.parametrize("write_s, mtbf_s", [(30, 28800), (300, 28800), (300, 3 * 3600), (1800, 8 * 3600), (60, 86400)])
def test_daly_interval_minimises_the_overhead(write_s: float, mtbf_s: float) -> None:
    """Daly's estimate sits at the numeric minimum of the expected overhead (to 0.1%)."""
    best = min(overhead(t, write_s, mtbf_s) for t in range(10, 5 * int(mtbf_s), 5))
    assert overhead(daly_interval(write_s, mtbf_s), write_s, mtbf_s) <= best * 1.001 + 1e-9
    assert overhead(young_interval(write_s, mtbf_s), write_s, mtbf_s) >= best - 1e-12


def test_interval_advice_compares_the_planned_interval() -> None:
    a = advise(Request(params=7e9), POLICY, DEFAULT_PRICES)
    i = a.interval
    assert (i.write_s, i.mtbf_s, i.planned_s) == (300, 8 * 3600, 1800)
    assert i.recommended == "daly" and i.recommended_s == i.daly_s
    assert i.overhead_recommended < i.overhead_planned  # type: ignore[operator]
    slow = advise(Request(params=7e9, write_bandwidth=50e6), POLICY, DEFAULT_PRICES).interval
    assert slow.write_s == pytest.approx(56 * GB / 50e6)  # δ from the storage's real bandwidth
    overlap = advise(Request(params=7e9, interval=timedelta(minutes=4)), POLICY, DEFAULT_PRICES).interval
    assert overlap.overhead_planned is None and "overlap" in overlap.notes[0]


# ------------------------------------------------------------------ the simulation


def test_simulation_runs_the_real_planner_every_night() -> None:
    calls: list[datetime] = []

    def spy(records: list[CheckpointRecord], policy: Policy, *, now: datetime) -> Plan:
        calls.append(now)
        return plan_retention(records, policy, now=now)

    nights = simulate_storage(POLICY, size=20 * GB, interval=timedelta(minutes=30), steps_per_save=1000,
                              run_length=21 * D, codec_ratio=1.24, hot_class="hot", prices=DEFAULT_PRICES, plan=spy)
    assert len(nights) == 21
    assert [n.day for n in nights] == list(range(1, 22))
    # every night plans at 00:00 UTC, once per apply pass plus apply's fresh re-check before deleting
    assert sorted(set(calls)) == [SIM_START + d * D for d in range(1, 22)]
    assert all(t.hour == 0 and t.minute == 0 for t in calls)
    assert [n.saves for n in nights] == [48 * d for d in range(1, 22)]
    assert all(n.keep_all_bytes == n.saves * 20 * GB for n in nights)
    final = nights[-1]
    hot = [s for s in final.stored if s.tier == "hot"]
    archive = [s for s in final.stored if s.tier == "archive"]
    # keep_last 5 + the save of 23:30 (not verified yet) + the one of 00:00 (in flight)
    assert hot[0].storage_class == "hot" and hot[0].checkpoints == 7
    # milestones 1k, 2k, 5k, ... 1M steps (1,008 saves of 1,000 steps) are archived, compressed
    assert archive[0].storage_class == "GLACIER_IR" and archive[0].checkpoints == 10
    assert archive[0].bytes == 10 * round(20 * GB / 1.24)
    assert final.stored_bytes / final.keep_all_bytes < 0.02
    assert simulate_storage.__kwdefaults__["plan"] is plan_retention  # the real planner unless told otherwise


def _tiny(archive_when: str) -> tuple:
    """Saves every 5 h (steps 1, 2, ...) for 2 days: 4 saves before night 1, 9 before night 2."""
    policy = Policy((KeepLast(3), Milestones(log=True)), archive="s3://cold/ckpt", storage_class="GLACIER_IR",
                    archive_when=archive_when)  # type: ignore[arg-type]
    return simulate_storage(policy, size=1000, interval=timedelta(hours=5), steps_per_save=1, run_length=2 * D,
                            codec_ratio=2.0, hot_class="hot", prices=DEFAULT_PRICES)


def test_simulation_of_a_tiny_run_matches_the_hand_computed_bytes() -> None:
    """keep_last 3 + milestones log (1, 2, 5), 1,000-byte saves, archive at ratio 2 (500 bytes).

    Night 1 (steps 1-4): keep_last holds 2, 3, 4; milestone 1 leaves hot storage: promoted, and
    its hot copy goes in apply's second pass the same night: hot {2, 3, 4}, archive {1}.
    Night 2 (steps 5-9): keep_last holds 7, 8, 9; milestones 2 and 5 promoted, their hot copies
    deleted, 3, 4 and 6 deleted: hot {7, 8, 9}, archive {1, 2, 5}.
    """
    n1, n2 = _tiny("leaving_hot")
    assert (n1.saves, n2.saves) == (4, 9)
    assert (n1.tier_bytes("hot"), n1.tier_checkpoints("hot")) == (3000, 3)
    assert (n1.tier_bytes("archive"), n1.tier_checkpoints("archive")) == (500, 1)
    assert (n2.tier_bytes("hot"), n2.tier_bytes("archive")) == (3000, 1500)
    assert (n1.stored_bytes, n1.keep_all_bytes, n2.stored_bytes, n2.keep_all_bytes) == (3500, 4000, 4500, 9000)
    # required: night 1 steps 4, 3, 2 hot and milestones at 1, 2; night 2 steps 9, 8, 7 hot and milestones 1, 2, 5
    assert (n1.recovery_points, n2.recovery_points) == (4, 6)
    assert n1.recovery_gaps == n2.recovery_gaps == ()
    # "immediately" also archives milestone 2 on night 1 while keep_last holds it hot: stored twice
    i1, i2 = _tiny("immediately")
    assert (i1.tier_bytes("hot"), i1.tier_bytes("archive"), i2.stored_bytes) == (3000, 1000, 4500)


def test_settle_adds_the_night_after_a_save_that_lands_on_the_last_plan() -> None:
    """A 21-day run with 100 saves spread evenly: the 100th lands at 00:00 of the 21st night, in flight."""
    policy = dataclasses.replace(POLICY, archive_when="leaving_hot")
    args: dict[str, Any] = {"size": 20 * GB, "interval": 21 * D / 100, "steps_per_save": 500, "run_length": 21 * D,
                            "codec_ratio": 1.24, "hot_class": "hot", "prices": DEFAULT_PRICES}
    plain = simulate_storage(policy, **args)
    settled = simulate_storage(policy, settle=True, **args)
    assert len(plain) == 21 and len(settled) == 22 and settled[-1].saves == plain[-1].saves == 100
    assert plain[-1].tier_checkpoints("hot") == 6  # keep_last 5 + the save in flight
    assert settled[-1].tier_checkpoints("hot") == 5
    # a run whose last save is verified before the last night needs no extra night
    assert len(simulate_storage(policy, settle=True, **(args | {"interval": timedelta(hours=5)}))) == 21


@pytest.mark.parametrize("archive_when, archived, fraction", [("leaving_hot", 6, 0.0984), ("immediately", 7, 0.1065)])
def test_the_21_day_scenario_holds_every_recovery_point_every_night(archive_when: str, archived: int,
                                                                    fraction: float) -> None:
    """100 saves of 20 GB every 500 steps over 21 days, keep_last 5 + milestones log, archive in
    GLACIER_IR: at the end hot holds steps 48,000-50,000 and the archive the holders of milestones
    500 (1 to 500), 1,000, 2,000, 5,000, 10,000, 20,000 and, unless leaving_hot, 50,000 a second time."""
    policy = dataclasses.replace(POLICY, archive_when=archive_when)
    nights = simulate_storage(policy, size=20 * GB, interval=21 * D / 100, steps_per_save=500, run_length=21 * D,
                              codec_ratio=1.24, hot_class="hot", prices=DEFAULT_PRICES, settle=True)
    assert all(n.recovery_points > 0 and n.recovery_gaps == () for n in nights)
    final = nights[-1]
    assert final.recovery_points == 11  # 5 hot + 7 milestone holders, 50,000 in both
    assert final.tier_bytes("hot") == 5 * 20 * GB
    assert final.tier_bytes("archive") == archived * round(20 * GB / 1.24)
    assert {s.storage_class for s in final.stored if s.tier == "archive"} == {"GLACIER_IR"}
    assert final.stored_bytes / final.keep_all_bytes == pytest.approx(fraction, abs=5e-5)
    assert final.monthly_cost / final.keep_all_monthly_cost < 0.06


def test_recovery_gaps_name_what_a_faulty_planner_dropped() -> None:
    """The check does not trust the planner: a planner that deletes everything it is shown is caught."""

    def reckless(records: list[CheckpointRecord], policy: Policy, *, now: datetime) -> Plan:
        return Plan(items=[PlanItem(c.job, c.step, c.id, "delete", ("reckless",), c.bytes) for c in records
                           if c.state.value == "verified"])

    nights = simulate_storage(POLICY, size=GB, interval=timedelta(hours=5), steps_per_save=1, run_length=2 * D,
                              codec_ratio=1.0, hot_class="hot", prices=DEFAULT_PRICES, plan=reckless)
    gaps = nights[0].recovery_gaps
    assert any("step 4 (newest verified checkpoint): deleted" in g for g in gaps)
    assert any("step 1 (holds a milestone of milestones log" in g for g in gaps)
    assert any(g.startswith("min_verified 2: only 0") for g in gaps)


def _rec(step: int, *, hot: bool = True, archived: bool = False) -> CheckpointRecord:
    t = SIM_START + step * timedelta(hours=1)
    copies: tuple[CopyRecord, ...] = ()
    if archived:
        copies += (CopyRecord(Tier.ARCHIVE, f"s3://cold/j/{step}", "present", 1, t, "ckz1"),)
    if not hot:
        copies += (CopyRecord(Tier.HOT, f"file:///hot/j/{step}", "deleted", None, None),)
    return CheckpointRecord(
        id=step, job="j", step=step, format=Format.GUIDE, state=State.VERIFIED, location=f"file:///hot/j/{step}",
        bytes=1, saved_at=t, first_seen=t, last_seen=t, missing_since=None, verified_at=t, state_reason=None,
        copies=copies,
    )


@pytest.mark.parametrize("after, expected", [
    ([_rec(1, hot=False, archived=True), _rec(3), _rec(4), _rec(6), _rec(7)], ()),
    ([_rec(3), _rec(4), _rec(6), _rec(7)],
     ("step 1 (holds a milestone of milestones log (1-2-5 series)): held neither in hot storage nor in the archive",)),
    ([_rec(1, archived=True), _rec(3), _rec(4), _rec(6), _rec(7, hot=False, archived=True)],
     ("step 7 (newest verified checkpoint): hot copy gone, needed in hot storage",)),
    ([_rec(1, archived=True), _rec(3), _rec(6), _rec(7)], ()),  # step 4 holds no milestone and no rule keeps it
    ([_rec(1, archived=True), _rec(3), _rec(4), _rec(7)],
     ("step 6 (keep_last 2 (#2 newest verified)): deleted, needed in hot storage",
      "step 6 (holds a milestone of milestones log (1-2-5 series)): held neither in hot storage nor in the archive")),
    ([_rec(1, archived=True), _rec(3, hot=False, archived=True), _rec(6), _rec(7)], ()),
])
def test_recovery_gaps_table(after: list[CheckpointRecord], expected: tuple[str, ...]) -> None:
    """Saves at steps 1, 3, 4, 6, 7: log milestones 1, 2 and 5 are held (at or after) by 1, 3 and 6."""
    before = [_rec(s) for s in (1, 3, 4, 6, 7)]
    policy = Policy((KeepLast(2), Milestones(log=True)), archive="s3://cold/ckpt")
    required, gaps = recovery_gaps(before, after, [1, 3, 4, 6, 7], policy, now=SIM_START + 10 * D)
    assert required == 4  # 7 and 6 hot; 1, 3 and 6 hold milestones 1, 2 and 5
    assert gaps == expected


def test_recovery_gaps_count_a_milestone_held_pending_verification() -> None:
    """A committed save at step 10 holds milestone 10 pending verification: it must not vanish either."""
    before = [_rec(s) for s in (1, 3, 4, 6)] + [dataclasses.replace(_rec(10), state=State.COMMITTED, verified_at=None)]
    policy = Policy((KeepLast(2), Milestones(log=True)), archive="s3://cold/ckpt")
    required, gaps = recovery_gaps(before, before[:4], [1, 3, 4, 6, 10], policy, now=SIM_START + 10 * D)
    assert required == 5  # 6 and 4 hot; 1, 3, 6 and 10 hold milestones 1, 2, 5 and 10
    assert gaps == ("step 10 (holds a milestone of milestones log (1-2-5 series)): held neither in hot storage nor in the archive",)


def test_simulation_prices_archive_copies_by_age_with_archive_tiers() -> None:
    policy = Policy((KeepLast(2), Milestones(log=True)), archive="s3://cold/ckpt",
                    archive_tiers=(ArchiveTier(30 * D, "STANDARD_IA"), ArchiveTier(60 * D, "GLACIER_IR")))
    nights = simulate_storage(policy, size=GB, interval=timedelta(hours=6), steps_per_save=1,
                              run_length=70 * D, codec_ratio=1.0, hot_class="STANDARD", prices=DEFAULT_PRICES)

    def classes(n: int) -> set[str]:
        return {s.storage_class for s in nights[n - 1].stored if s.tier == "archive"}

    assert classes(29) == {"STANDARD"}
    assert "STANDARD_IA" in classes(31)
    assert "GLACIER_IR" in classes(62) and "STANDARD" in classes(62)  # the newest milestones are young
    assert {s.storage_class for s in nights[0].stored if s.tier == "hot"} == {"STANDARD"}


def test_simulation_refuses_an_empty_run() -> None:
    from ckptier.storage.errors import ConfigError

    with pytest.raises(ConfigError, match="holds no save"):
        simulate_storage(POLICY, size=GB, interval=timedelta(days=2), steps_per_save=1, run_length=D,
                         codec_ratio=1.2, hot_class="hot", prices=DEFAULT_PRICES)


def test_forecast_costs_and_labels() -> None:
    a = advise(Request(params=7e9), POLICY, DEFAULT_PRICES)
    st = a.storage
    assert st.saves == 1008 and st.final.day == 21
    assert st.stored_fraction < 0.02 and st.cost_fraction < 0.02
    assert st.keep_all_monthly_cost == pytest.approx(DEFAULT_PRICES.monthly(1008 * 56 * GB, "hot"))
    assert st.prices_assumed and st.price_note.startswith(LIST_PRICE_NOTE)
    assert st.restore_cost is not None and st.restore_cost > 0  # reading back from GLACIER_IR costs
    assert st.requests_cost > 0  # archive uploads into GLACIER_IR
    on_s3 = advise(Request(params=7e9, hot_class="STANDARD"), POLICY, DEFAULT_PRICES).storage
    assert on_s3.requests_cost > st.requests_cost  # every save's parts are PUTs
    # ... and keep-all writes the same saves: their PUTs count on both sides of the comparison
    months = 21 * 24 / 730
    save_puts = 1008 * DEFAULT_PRICES.puts(requests_for(56 * GB, 1, 8 << 20), "STANDARD")
    assert on_s3.keep_all_monthly_cost == pytest.approx(DEFAULT_PRICES.monthly(1008 * 56 * GB, "STANDARD") + save_puts / months)
    assert on_s3.cost_fraction == pytest.approx(on_s3.monthly_cost / on_s3.keep_all_monthly_cost)


# ------------------------------------------------------------------ measured jobs


def _job(n: int = 6, *, s3: bool = False) -> list[CheckpointRecord]:
    t0 = datetime(2026, 3, 1, tzinfo=UTC)
    out = []
    for i in range(n):
        step = 500 * (i + 1)
        files = tuple(FileRecord(f"rank-{r:04d}/model.pt", 10 * GB, None, None, None, None, "ok", None) for r in range(4))
        copies: tuple[CopyRecord, ...] = ()
        if i == 1:
            copies = (CopyRecord(Tier.ARCHIVE, f"s3://cold/j/step-{step:08d}", "present", 32 * GB, t0, "ckz1"),)
        base = "s3://hot/runs/j" if s3 else "file:///hot/j"
        out.append(CheckpointRecord(
            id=i + 1, job="j", step=step, format=Format.GUIDE, state=State.DELETED if i < 2 else State.VERIFIED,
            location=f"{base}/step-{step:08d}", bytes=40 * GB, saved_at=t0 + i * timedelta(minutes=45),
            first_seen=t0, last_seen=t0, missing_since=None, verified_at=t0, state_reason=None,
            files=files, copies=copies,
        ))
    return out


def test_observe_job_measures_size_interval_steps_ranks_and_ratio() -> None:
    obs = observe_job(_job())
    assert (obs.job, obs.checkpoints, obs.size_bytes) == ("j", 6, 40 * GB)
    assert obs.interval == timedelta(minutes=45) and obs.steps_per_save == 500 and obs.ranks == 4
    assert obs.codec_ratio == pytest.approx(1.25) and obs.hot_class == "hot"
    assert observe_job(_job(s3=True)).hot_class == "STANDARD"


def test_measured_values_replace_the_assumptions() -> None:
    a = advise(Request(), POLICY, DEFAULT_PRICES, observed=observe_job(_job()))  # no --params needed
    assert a.sizing.measured and a.sizing.total_bytes == 40 * GB and a.sizing.components == ()
    assert set(a.measured()) == {"size", "ranks", "interval", "steps_per_save", "codec_ratio", "hot_class"}
    by = {x.name: x for x in a.assumptions}
    assert by["interval"].value == "45min" and "job j, 6 checkpoints" in by["interval"].source
    assert by["mtbf"].origin == "default" and by["mtbf"].source == DEFAULTS["mtbf"][1]
    assert a.interval.planned_s == 45 * 60
    what_if = advise(Request(params=5e9, ranks=8, interval=timedelta(hours=1)), POLICY, DEFAULT_PRICES,
                     observed=observe_job(_job()))
    assert what_if.sizing.total_bytes == 40 * GB and what_if.sizing.estimated_bytes == 40 * GB  # measured size wins
    assert what_if.sizing.ranks == 8 and what_if.interval.planned_s == 3600  # given values are what-ifs
    assert set(what_if.measured()) == {"size", "steps_per_save", "codec_ratio", "hot_class"}


@pytest.mark.parametrize(
    "request_, message",
    [
        (Request(), "advise needs --params"),
        (Request(params=-1), "must be a number of parameters > 0"),
        (Request(params=7e9, ranks=0), "--ranks 0"),
        (Request(params=7e9, write_window=timedelta(0)), "--write-window"),
        (Request(params=7e9, dtype="int3"), "dtype 'int3' is not known"),
        (Request(params=7e9, hot_class="TAPE"), "--hot-class 'TAPE'"),
    ],
)
def test_bad_requests_are_one_line_errors(request_: Request, message: str) -> None:
    from ckptier.storage.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        advise(request_, POLICY, DEFAULT_PRICES)


# ------------------------------------------------------------------ the command


def test_cli_json_is_the_typed_result(capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "ckptier.toml"
    config.write_text('[[policy]]\nkeep_last = 5\nmilestones = "log"\narchive = "s3://cold/a"\nstorage_class = "GLACIER_IR"\n'
                      '[prices]\nsource = "test rates"\nhot = 0.1\n'
                      '[prices.GLACIER_IR]\nstorage = 0.005\nput = 0.01\nget = 0.01\nretrieval = 0.02\nmin_days = 90\n')
    code, out, err = run(capsys, "advise", "--params", "70B", "--ranks", "512", "--mtbf", "3h", "--policy", str(config), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["sizing"]["total_bytes"] == 560 * GB and doc["sizing"]["per_rank_bytes"] == 560 * GB // 512
    assert doc["interval"]["mtbf_s"] == 3 * 3600 and doc["interval"]["recommended"] == "daly"
    assert doc["storage"]["prices_assumed"] is False and doc["storage"]["price_note"] == "test rates"
    assert len(doc["storage"]["nights"]) == 21 and doc["measured"] == []
    assert {"name": "mtbf", "value": "3h", "origin": "given", "source": ""} in doc["assumptions"]
    human = run(capsys, "advise", "--params", "70B", "--policy", str(config))[1]
    assert "list-price assumption" not in human and "prices: test rates" in human


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--params", "lots"], "--params 'lots': not a number of parameters"),
        (["--params", "7e9", "--interval", "often"], "--interval: 'often': not a duration"),
        (["--params", "7e9", "--write-bandwidth", "fast"], "--write-bandwidth 'fast': not understood"),
        (["--params", "7e9", "--write-bandwidth", "2GB"], "--write-bandwidth '2GB': not understood"),
    ],
)
def test_cli_bad_input_is_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, out, err = run(capsys, "advise", *argv)
    assert code == 2 and out == ""
    assert err.startswith("ckptier: ") and message in err and err.count("\n") == 1


def test_cli_job_uses_measured_sizes_and_save_times(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptier.tasks.demo import write_guide_checkpoint

    hot = tmp_path / "hot"
    t0 = time.time() - 10 * 3600
    for i, step in enumerate((500, 1000, 1500, 2000)):
        step_dir = hot / "llm" / f"step-{step:08d}"
        write_guide_checkpoint(step_dir, {"rank-0000/model.pt": {"w": list(range(100))},
                                          "rank-0001/model.pt": {"w": list(range(100))}}, step=step, loss=1.0)
        for f in step_dir.rglob("*"):
            os.utime(f, (t0 + i * 1200, t0 + i * 1200))  # one save every 20 minutes
    monkeypatch.setenv("CKPTIER_CATALOG_URL", f"sqlite:///{tmp_path / 'catalog.db'}")
    monkeypatch.chdir(tmp_path)
    assert run(capsys, "scan", str(hot), "--json")[0] == 0
    code, out, err = run(capsys, "advise", "--job", "llm", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert set(doc["measured"]) >= {"size", "interval", "steps_per_save", "ranks"}
    assert doc["interval"]["planned_s"] == 1200 and doc["sizing"]["ranks"] == 2 and doc["sizing"]["measured"]
    human = run(capsys, "advise", "--job", "llm")[1]
    assert "measured from the catalog: size, ranks, interval, steps_per_save" in human
    assert "(measured" in human
    code, _, err = run(capsys, "advise", "--job", "nope")
    assert code == 2 and "job 'nope'" in err


def test_the_simulation_is_bounded_and_says_how_it_approximated() -> None:
    """Saves 0.2 ms apart (a copied tree) once meant 9 billion simulated saves; now at most
    MAX_SIM_SAVES, each standing for many, with the real saves still counted."""
    from ckptier.tasks.advise import MAX_SIM_SAVES, simulation_scale

    exact = advise(Request(params=7e9), POLICY, DEFAULT_PRICES)
    assert exact.storage.approximation is None and exact.storage.saves == 1008  # the guide's run: save by save
    fast = advise(Request(params=7e9, interval=timedelta(microseconds=200)), POLICY, DEFAULT_PRICES)
    st = fast.storage
    assert st.saves == 21 * 86400 * 5000 and st.final.keep_all_bytes == st.saves * fast.sizing.total_bytes
    assert st.approximation is not None and "standing for 8,247,273" in st.approximation
    scale = simulation_scale(timedelta(days=21), timedelta(microseconds=200), 21)
    assert scale.saves // scale.per_save <= MAX_SIM_SAVES and scale.every_nights == 1
    long = simulation_scale(timedelta(days=3650), timedelta(minutes=30), 3650)
    assert long.every_nights == 37 and (long.saves // long.per_save) * math.ceil(3650 / 37) <= 40_000
    nights = simulate_storage(POLICY, size=GB, interval=timedelta(hours=1), steps_per_save=100,
                              run_length=timedelta(days=365), codec_ratio=1.2, hot_class="hot", prices=DEFAULT_PRICES)
    assert len(nights) == math.ceil(365 / 4) and sum(n.days for n in nights) == 365 and nights[-1].saves == 365 * 24
