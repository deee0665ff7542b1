"""Drill and fetch reports: typed in the code, the same JSON as before at the edges.

``DrillReport.to_json()`` must give, for every kind of outcome, the dict
the drill returned before it was typed (same keys in the same order, same
values) plus its ``verdict`` (``passed``, ``failed``, ``not judged``) and,
where a worker trained, ``trained_steps`` and ``stack``; and ``drill
--json`` / ``fetch --json`` print ``to_json()``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from ckptier.storage.records import CheckpointRecord, Format, State
from ckptier.tasks.drill import Check
from ckptier.tasks.drill import WorkerResult, judge
from ckptier.tasks.drill_launch import Fetched, RankedDrill, RankedRun, RankScratch
from ckptier.tasks.pipeline import _drill_failure, _not_started
from ckptier.tasks.reports import DrillReport, FetchReport

from .test_cli import env, run, trained  # noqa: F401 - the CLI tests' trained run and catalog

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
T1 = T0 + timedelta(seconds=42)

#: The keys of each kind of drill report, in the order the drill wrote them before reports were typed.
WORKER_KEYS = ["job", "step", "ok", "verdict", "summary", "checks", "trained_steps", "device", "tier", "timings",
               "peak_memory_bytes", "losses", "error", "stage", "confined", "confinement", "stack", "started_at",
               "finished_at"]
FAILURE_KEYS = ["job", "step", "ok", "verdict", "stage", "error", "summary", "checks", "timings", "device", "tier",
                "peak_memory_bytes", "losses", "started_at", "finished_at"]
NOT_STARTED_KEYS = ["job", "step", "ok", "verdict", "stage", "error", "summary", "recorded", "checks", "timings",
                    "device", "tier", "peak_memory_bytes", "losses", "started_at", "finished_at"]
RANKED_KEYS = ["job", "step", "ok", "verdict", "summary", "checks", "trained_steps", "world_size", "saved_world_size",
               "layout", "parallel", "backend", "device", "ranks", "timings", "losses", "peak_memory_bytes", "confined",
               "confinement", "tier", "error", "stage", "reshard", "stack", "started_at", "finished_at"]


def _record(job: str = "j", step: int = 5) -> CheckpointRecord:
    return CheckpointRecord(id=1, job=job, step=step, format=Format.GUIDE, state=State.VERIFIED, location="/x",
                            bytes=10, saved_at=T0, first_seen=T0, last_seen=T0, missing_since=None, verified_at=T0,
                            state_reason=None)


def test_a_failed_fetch_reports_as_before() -> None:
    out = _drill_failure(_record(), T0, T1, stage="fetch", error="gone").to_json()
    assert out == {"job": "j", "step": 5, "ok": False, "verdict": "failed", "stage": "fetch", "error": "gone",
                   "summary": "j step 5: drill failed at fetch: gone",
                   "checks": [{"name": "completed", "ok": False, "detail": "fetch: gone"}], "timings": {},
                   "device": None, "tier": None, "peak_memory_bytes": None, "losses": [],
                   "started_at": T0.isoformat(), "finished_at": T1.isoformat()}
    assert list(out) == FAILURE_KEYS


def test_a_drill_that_did_not_start_says_it_was_not_recorded() -> None:
    report = _not_started(_record(), "drill model 'm:f' does not load: boom", T0, T1)
    out = report.to_json()
    assert out == {"job": "j", "step": 5, "ok": False, "verdict": "not judged", "stage": "not-started",
                   "error": "drill model 'm:f' does not load: boom",
                   "summary": "j step 5: drill not started: drill model 'm:f' does not load: boom", "recorded": False,
                   "checks": [{"name": "started", "ok": False, "detail": "drill model 'm:f' does not load: boom"}],
                   "timings": {}, "device": None, "tier": None, "peak_memory_bytes": None, "losses": [],
                   "started_at": T0.isoformat(), "finished_at": T1.isoformat()}
    assert list(out) == NOT_STARTED_KEYS and not report.started
    # Every other kind has no "recorded" key at all.
    assert "recorded" not in _drill_failure(_record(), T0, T1, stage="load", error="x").to_json()


def test_a_single_rank_drill_reports_its_worker_and_confinement() -> None:
    report = DrillReport(job="j", step=5, ok=True, summary="j step 5 (hot tier, cpu): drill ok",
                         checks=(Check("losses_finite", True, "3 finite losses"),), device="cpu", tier="hot",
                         timings={"fetch_s": 0.5, "load_s": 1.0}, peak_memory_bytes=1024, losses=(0.5, None),
                         confined=False, confinement="writes not confined: no Landlock", started_at=T0, finished_at=T1)
    out = report.to_json()
    assert list(out) == WORKER_KEYS
    assert out["checks"] == [{"name": "losses_finite", "ok": True, "detail": "3 finite losses"}]
    assert (out["losses"], out["timings"], out["confined"], out["stage"]) == ([0.5, None], {"fetch_s": 0.5, "load_s": 1.0},
                                                                             False, None)
    assert json.loads(json.dumps(out)) == out  # JSON-ready as it is
    assert report.verdict_json() == {"summary": report.summary, "checks": out["checks"], "losses": [0.5, None],
                                     "confinement": "writes not confined: no Landlock"}


def _ranked(reshard: bool) -> RankedDrill:
    results = [WorkerResult(rank=r, world_size=2, checkpoint="/x", format="dcp", steps=2, device="cpu", backend="gloo",
                          parallel="fsdp2", losses=(0.5, 0.4), recorded_loss=0.45, optimizer_loaded=True,
                          optimizer_step_before=10.0, optimizer_step_after=12.0, trainable_params=4,
                          timings={"load_s": 1.0 + r, "first_step_done_at": 100.0 + r}, peak_memory_bytes=1000 * (r + 1),
                          exit_order=r, confined=True, confinement="writes confined by Landlock")
               for r in range(2)]
    scratches = [RankScratch(rank=r, root=Path("/s"), checkpoint=Path("/s/c"), work=Path("/s/w"), available={},
                             files=[f"__{r}_0.distcp"], held_bytes=64, needed_bytes=60) for r in range(2)]
    ran = RankedRun(world=2, device="cpu", backend="gloo", scratches=scratches, results=results,
                    fetches=[Fetched("hot", 0.25, 10), Fetched("hot", 0.5, 54)], started_at=99.0)
    reference = None
    if reshard:
        reference = replace(ran, world=4, results=[replace(r, world_size=4, losses=(0.5, 0.4)) for r in results])
    verdict = judge(results, steps=2, reference=reference.results if reference else None)
    return RankedDrill("dcp", 4 if reshard else 2, "sharded", ran, verdict, reference)


@pytest.mark.parametrize("reshard", [False, True])
def test_a_multi_rank_drill_reports_its_ranks(reshard: bool) -> None:
    drill = _ranked(reshard)
    report = drill.report(job="j", step=5, device="auto", started_at=T0, finished_at=T1)
    out = report.to_json()
    assert list(out) == [k for k in RANKED_KEYS if reshard or k != "reshard"]
    assert report.ok, report.summary
    assert out["summary"] == (f"j step 5 (hot tier, 2 ranks on cpu/gloo{', saved by 4' if reshard else ''}): "
                              f"{drill.verdict.summary}")
    assert {k: out[k] for k in ("world_size", "saved_world_size", "layout", "parallel", "backend", "device", "tier",
                                "error", "stage", "confined", "confinement", "peak_memory_bytes", "losses")} == {
        "world_size": 2, "saved_world_size": 4 if reshard else 2, "layout": "sharded", "parallel": "fsdp2",
        "backend": "gloo", "device": "cpu", "tier": "hot", "error": None, "stage": None, "confined": True,
        "confinement": "writes confined by Landlock", "peak_memory_bytes": 2000, "losses": [0.5, 0.4]}
    assert out["timings"] == {"fetch_s": 0.75, "load_s": 2.0, "build_s": 0.0, "restore_s": 0.0, "rendezvous_s": 0.0,
                              "first_step_s": 0.0, "steps_s": 0.0, "subprocess_s": 0.0, "time_to_first_step_s": 2.0}
    assert out["ranks"][1] == {"rank": 1, "ok": True, "error": None, "stage": None, "losses": [0.5, 0.4],
                               "files": ["__1_0.distcp"], "held_bytes": 64, "needed_bytes": 60,
                               "first_step_done_at": 101.0, "peak_memory_bytes": 2000, "confined": True}
    verdict = report.verdict_json()
    assert [k for k in verdict] == ["summary", "checks", "losses", "confinement", "world_size", "saved_world_size",
                                    "layout", "parallel", "backend", *(["reshard"] if reshard else [])]
    if reshard:
        resumes = next(c for c in drill.verdict.checks if c.name == "resumes")
        assert out["reshard"] == verdict["reshard"] == {"from": 4, "to": 2, "resumes": resumes.ok,
                                                        "detail": resumes.detail, "reference_losses": [0.5, 0.4]}
    assert json.loads(json.dumps(out)) == out


def test_fetch_report_json_is_what_fetch_returned() -> None:
    report = FetchReport(job="j", step=5, tier="archive", source="file:///a/j/step-00000005", dest="/d", files=3,
                         bytes=100, seconds=0.125, notes=("hot copy failed its hash check",))
    assert report.to_json() == {"job": "j", "step": 5, "tier": "archive", "source": "file:///a/j/step-00000005",
                                "dest": "/d", "files": 3, "bytes": 100, "seconds": 0.125,
                                "notes": ["hot copy failed its hash check"]}


def _without(d: dict[str, object], *keys: str) -> dict[str, object]:
    return {k: v for k, v in d.items() if k not in keys}


def test_fetch_and_drill_json_on_the_command_line_is_to_json(env: dict[str, Path],  # noqa: F811
                                                             capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from ckptier.tasks.pipeline import DrillOptions, run_drill, run_fetch
    from ckptier.tasks.settings import open_run

    assert run(capsys, "scan", str(env["hot"]))[0] == 0 and run(capsys, "verify")[0] == 0
    code, out, err = run(capsys, "fetch", "--job", "demo-run", "--step", "50", str(tmp_path / "cli"), "--json")
    assert code == 0, err
    printed = json.loads(out)
    with open_run(None) as r:
        direct = run_fetch(r.catalog, r.config, job="demo-run", step=50, dest=tmp_path / "direct", stores=r.stores)
    assert isinstance(direct, FetchReport) and list(printed) == list(direct.to_json())
    assert _without(printed, "dest", "seconds") == _without(direct.to_json(), "dest", "seconds")
    assert printed["dest"] == str(tmp_path / "cli") and printed["tier"] == "hot" and printed["files"] == 3

    # A drill whose checkpoint is gone from the hot tier (and never archived) fails at fetch, fast.
    shutil.rmtree(env["job_dir"] / "step-00000150")
    code, out, err = run(capsys, "drill", "--job", "demo-run", "--step", "150", "--json")
    assert code == 1, err
    (printed,) = json.loads(out)
    with open_run(None) as r:
        (direct_drill,) = run_drill(r, DrillOptions(job="demo-run", step=150))
    assert list(printed) == list(direct_drill.to_json()) == FAILURE_KEYS
    assert _without(printed, "started_at", "finished_at") == _without(direct_drill.to_json(), "started_at", "finished_at")
    assert printed["stage"] == "fetch" and not printed["ok"] and "demo-run step 150" in printed["summary"]
