"""``ckptier resume`` and ``ckptier.resume()``: the newest checkpoint proven now.

Pure decisions as tables (what to do with a candidate, the passed-over list,
recovery rates), then the command on a real demo run (3 committed saves):
the happy path, a torn newest checkpoint passed over and recorded, an
archive-only checkpoint fetched bit-exact into ``--dest``, nothing provable
(exit 1, one line) and usage errors (exit 2), each call a recovery event.
The distributed answer is in ``tests/test_resume_dist.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from ckptier.flows.cli import main
from ckptier.storage.catalog.api import Catalog, DrillRecord, RecoveryRecord
from ckptier.tasks.demo import train_demo_run
from ckptier.tasks.resume import RecoveryRate, Resume, merged_passed_over, next_step, recovery_rates

JOB = "demo-run"
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------ pure decisions


@pytest.mark.parametrize(
    ("hot", "archived", "have_dest", "local", "action", "why"),
    [
        ("intact", False, False, True, "use-hot", None),
        ("intact", True, True, True, "use-hot", None),  # a local hot copy is loaded in place, never copied
        ("intact", False, False, False, "use-hot", None),  # remote, no dest: its URL
        ("intact", False, True, False, "fetch-hot", None),  # remote with a dest: fetched, every byte checked
        ("changed", True, True, True, "pass", "verify it again"),  # a stale verdict is never fetched around
        ("changed", False, False, False, "pass", "verify it again"),
        (None, True, True, False, "fetch-archive", None),
        (None, True, False, False, "pass", "no hot copy; its archive copy needs --dest DIR (dest=) to be fetched into"),
        (None, False, True, False, "pass", "no hot copy and no archive copy"),
        ("vanished", True, True, False, "fetch-archive", None),
        ("vanished", False, True, False, "pass", "its hot copy is gone (a rescan settles it) and no archive copy"),
        ("unknown", True, True, False, "fetch-archive", None),
        ("unknown", True, False, False, "pass",
         "its hot copy cannot be looked at now; its archive copy needs --dest DIR (dest=) to be fetched into"),
    ],
)
def test_next_step_table(hot: str | None, archived: bool, have_dest: bool, local: bool, action: str,
                         why: str | None) -> None:
    assert next_step(hot, archived=archived, have_dest=have_dest, local=local) == (action, why)  # type: ignore[arg-type]


def test_passed_over_merges_proofs_and_failed_drills_newest_first_once_per_step() -> None:
    mine = [(300, "failed its proof now"), (200, "verify it again")]
    picked = [(250, "its drill failed"), (200, "its drill failed")]
    assert merged_passed_over(mine, picked) == ((300, "failed its proof now"), (250, "its drill failed"),
                                                (200, "verify it again"))
    assert merged_passed_over([], []) == ()


def _event(job: str, days_ago: float, outcome: str) -> RecoveryRecord:
    return RecoveryRecord(job=job, started_at=T0 - timedelta(days=days_ago), seconds=0.1, outcome=outcome,
                          verify="full")


def _drill(job: str, days_ago: float, ok: bool, outcome: str | None = None) -> DrillRecord:
    return DrillRecord(job=job, step=1, checkpoint_id=None, started_at=T0 - timedelta(days=days_ago),
                       finished_at=None, ok=ok, device="cpu", source_tier="hot", outcome=outcome)


def test_recovery_rates_table_per_job_and_window() -> None:
    events = [_event("a", 1, "resumed"), _event("a", 3, "failed"), _event("a", 7, "resumed"),  # 7 d: inclusive
              _event("a", 8, "failed"), _event("a", 40, "resumed"), _event("b", 20, "failed")]
    drills = [_drill("a", 2, True), _drill("a", 10, False), _drill("a", 1, False, "not judged"),  # never counted
              _drill("c", 50, True)]
    rates = {(r.job, r.days): r for r in recovery_rates(events, drills, now=T0)}
    assert list(rates) == [(j, d) for j in "abc" for d in (7, 30, None)]  # jobs sorted, windows in order
    assert rates["a", 7] == RecoveryRate("a", 7, attempted=3, resumed=2, drills=1, drills_passed=1)
    assert rates["a", 30] == RecoveryRate("a", 30, attempted=4, resumed=2, drills=2, drills_passed=1)
    assert rates["a", None] == RecoveryRate("a", None, attempted=5, resumed=3, drills=2, drills_passed=1)
    assert rates["a", 7].rate == pytest.approx(2 / 3) and rates["a", 30].drill_rate == 0.5
    assert rates["b", 7].rate is None and rates["b", 30].rate == 0.0  # nothing attempted is not 0 %
    assert rates["c", None].attempted == 0 and rates["c", None].drills_passed == 1
    assert recovery_rates([], [], now=T0) == []


def test_resume_round_trips_through_json() -> None:
    r = Resume(job="j", step=7, path="/p", proof="verified", verify="quick", source="hot",
               passed_over=((9, "why"),), seconds=0.25)
    assert Resume.from_json(json.loads(json.dumps(r.to_json()))) == r


# ------------------------------------------------------------------ the command


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One demo run for the session: saves at steps 25, 50 and 75, all committed."""
    hot = tmp_path_factory.mktemp("resume-trained") / "hot"
    train_demo_run(hot, steps=75, every=25, leave_last_in_flight=False)
    return hot


@pytest.fixture()
def env(trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
        ) -> dict[str, Path]:
    """A copy of the run, scanned and verified; a policy that archives the log milestones."""
    hot = tmp_path / "hot"
    shutil.copytree(trained, hot)
    catalog, archive, config = tmp_path / "catalog.db", tmp_path / "archive", tmp_path / "ckptier.toml"
    config.write_text(f'[[policy]]\njobs = "*"\nkeep_last = 1\nmin_verified = 1\nmilestones = "log"\n'
                      f'archive = "{archive.as_uri()}"\n')
    monkeypatch.setenv("CKPTIER_CATALOG_URL", f"sqlite:///{catalog}")
    monkeypatch.setenv("CKPTIER_CONFIG", str(config))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    assert run(capsys, "scan", str(hot))[0] == 0
    assert run(capsys, "verify")[0] == 0
    return {"hot": hot, "job_dir": hot / JOB, "catalog": catalog, "archive": archive, "tmp": tmp_path}


def _recoveries(env: dict[str, Path]) -> list[RecoveryRecord]:
    with Catalog.open(f"sqlite:///{env['catalog']}", create=False) as cat:
        return cat.recoveries(job=JOB)


def _state(env: dict[str, Path], step: int) -> str:
    with Catalog.open(f"sqlite:///{env['catalog']}", create=False) as cat:
        record = cat.get(JOB, step)
        assert record is not None
        return record.state.value


def test_resume_answers_the_newest_in_place_and_records_it(env: dict[str, Path],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "resume", "--job", JOB)
    lines = out.splitlines()
    assert code == 0, err
    assert lines[0].startswith("catalog: ")
    assert lines[1] == f"{JOB} step 75: {env['job_dir'] / 'step-00000075'}"
    assert "every byte read now" in lines[2] and "hot copy" in lines[2]

    code, out, _ = run(capsys, "resume", "--job", JOB, "--quick", "--json")
    answer = json.loads(out)
    assert code == 0 and answer["step"] == 75 and answer["verify"] == "quick" and answer["source"] == "hot"
    assert Path(answer["path"]) == env["job_dir"] / "step-00000075" and answer["passed_over"] == []

    (quick, full) = _recoveries(env)
    assert (quick.outcome, quick.step, quick.verify, full.verify) == ("resumed", 75, "quick", "full")
    assert quick.path == answer["path"] and quick.source == "hot" and quick.checkpoint_id is not None
    code, out, _ = run(capsys, "resume", "--job", JOB, "--stats", "--json")
    assert code == 0 and {(r["days"], r["attempted"], r["resumed"]) for r in json.loads(out)} == {
        (7, 2, 2), (30, 2, 2), (None, 2, 2)}


def test_a_torn_newest_is_passed_over_recorded_corrupt_and_the_previous_answered(
        env: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    # Torn after its verification: same size and mtime, so only a read can tell.
    victim = env["job_dir"] / "step-00000075" / "rank-0000" / "model.pt"
    st = victim.stat()
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))

    code, out, _ = run(capsys, "resume", "--job", JOB, "--quick", "--json")
    assert code == 0 and json.loads(out)["step"] == 75  # a stat cannot see it: what --quick gives up
    code, out, err = run(capsys, "resume", "--job", JOB, "--json")
    answer = json.loads(out)
    assert code == 0, err
    assert answer["step"] == 50 and Path(answer["path"]) == env["job_dir"] / "step-00000050"
    ((step, why),) = [(p["step"], p["reason"]) for p in answer["passed_over"]]
    assert step == 75 and "failed its proof now" in why and "rank-0000/model.pt" in why and "corrupt" in why
    assert _state(env, 75) == "corrupt"  # recorded as verify records it: latest agrees from now on
    code, out, _ = run(capsys, "latest", "--job", JOB, "--json")
    assert json.loads(out)["step"] == 50
    assert _recoveries(env)[0].passed_over == ((75, why),)


def test_a_truncated_newest_is_passed_over_by_a_stat_and_settled(env: dict[str, Path],
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    victim = env["job_dir"] / "step-00000075" / "rank-0000" / "optimizer.pt"
    with open(victim, "r+b") as fh:
        fh.truncate(victim.stat().st_size // 2)
    code, out, _ = run(capsys, "resume", "--job", JOB, "--quick")
    assert code == 0 and f"{JOB} step 50: " in out
    assert "passed over step 75: changed since its verdict" in out and "verify it again" in out
    assert _state(env, 75) == "committed"


def test_an_archive_only_checkpoint_is_fetched_into_dest_bit_exact(env: dict[str, Path], tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "apply")
    assert code == 0, out + err
    assert not (env["job_dir"] / "step-00000050").exists()  # a milestone: archive only now
    victim = env["job_dir"] / "step-00000075" / "rank-0000" / "model.pt"
    victim.write_bytes(victim.read_bytes()[:-1] + b"\0")  # 75 torn: 50 is the newest provable

    code, out, err = run(capsys, "resume", "--job", JOB, "--json")
    assert code == 1 and json.loads(out)["resume"] is None
    assert "step 50: no hot copy; its archive copy needs --dest DIR" in err and len(err.splitlines()) == 1

    dest = tmp_path / "resume-cache"
    code, out, err = run(capsys, "resume", "--job", JOB, "--dest", str(dest), "--json")
    answer = json.loads(out)
    assert code == 0, err
    assert answer["step"] == 50 and answer["source"] == "archive"
    fetched = Path(answer["path"])
    assert fetched == dest / JOB / "step-00000050"
    meta = json.loads((fetched / "metadata.json").read_text())
    for rel, expected in meta["files"].items():
        assert hashlib.sha256((fetched / rel).read_bytes()).hexdigest() == expected["sha256"]
    # A relaunch finds its earlier fetch, checks it and answers it again; a tampered one is refused.
    code, out, _ = run(capsys, "resume", "--job", JOB, "--dest", str(dest), "--json")
    assert code == 0 and json.loads(out)["path"] == str(fetched)
    (fetched / "rank-0000" / "model.pt").write_bytes(b"not it")
    code, _, err = run(capsys, "resume", "--job", JOB, "--dest", str(dest), "--quick")
    assert code == 2 and "holds an earlier fetch" in err and "remove it" in err
    assert [e.outcome for e in _recoveries(env)] == ["failed", "resumed", "resumed", "failed"]


def test_nothing_provable_is_exit_1_in_one_line(env: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    for step in (25, 50, 75):
        victim = env["job_dir"] / f"step-{step:08d}" / "metadata.json"
        victim.write_text(victim.read_text() + " ")
    code, out, err = run(capsys, "resume", "--job", JOB)
    assert code == 1 and len(err.splitlines()) == 1
    assert err.startswith(f"ckptier: job {JOB!r}: no checkpoint can be proven now")
    assert "step 75: changed since its verdict" in err and "step 25:" in err
    code, _, err = run(capsys, "resume", "--job", JOB)
    assert code == 1 and "passed over" not in err  # settled: no longer verified, no longer candidates
    code, _, err = run(capsys, "resume", "--job", "never-trained")
    assert code == 1 and "no checkpoints in the catalog (start from scratch" in err
    assert [(e.outcome, e.step) for e in _recoveries(env)] == [("failed", None)] * 2
    code, out, _ = run(capsys, "resume", "--job", JOB, "--stats")
    assert code == 0 and "0/2" in out and "0%" in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["resume"], "--job"),
        (["resume", "--job", JOB, "--stats", "--quick"], "--stats counts recorded resumes; it takes no --quick"),
        (["resume", "--job", JOB, "--verify", "deep"], "unrecognized arguments"),
    ],
)
def test_usage_is_exit_2(env: dict[str, Path], capsys: pytest.CaptureFixture[str], argv: list[str],
                         needle: str) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2 and needle in err and len(err.splitlines()) == 1 and "Traceback" not in err
    a_file = env["tmp"] / "a-file"
    a_file.write_text("x")
    code, _, err = run(capsys, "resume", "--job", JOB, "--dest", str(a_file))
    assert code == 2 and "is a file" in err


# ------------------------------------------------------------------ the Python API


API_SCRIPT = """
import json, sys
import ckptier
assert not {"torch", "prefect"} & set(sys.modules), "import ckptier pulled in torch or prefect"
from ckptier import Resume, ResumeError, resume
r = resume(sys.argv[1], verify=sys.argv[2])
try:
    resume("never-trained")
    missing = None
except ResumeError as exc:
    missing = str(exc)
print(json.dumps({"resume": r.to_json(), "missing": missing, "type": type(r).__name__,
                  "loaded": sorted({"torch", "prefect"} & set(sys.modules))}))
"""


def test_the_api_answers_as_the_command_without_torch_or_prefect(env: dict[str, Path]) -> None:
    proc = subprocess.run([sys.executable, "-c", API_SCRIPT, JOB, "quick"], capture_output=True, text=True,
                          timeout=60, env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["loaded"] == [] and got["type"] == "Resume"
    assert got["resume"]["step"] == 75 and Path(got["resume"]["path"]) == env["job_dir"] / "step-00000075"
    assert "never-trained" in got["missing"]


def test_the_api_refuses_a_bad_verify_mode(env: dict[str, Path]) -> None:
    from ckptier import resume

    with pytest.raises(ValueError, match="verify='deep'"):
        resume(JOB, verify="deep")  # type: ignore[arg-type]


# ------------------------------------------------------------------ the catalog's recovery events


def test_recovery_events_round_trip_newest_first(catalog_url: str) -> None:
    """On SQLite and PostgreSQL: stored as given, listed newest first, by job and since a time."""
    with Catalog.open(catalog_url) as cat:
        first = cat.record_recovery(RecoveryRecord(job="a", started_at=T0, seconds=0.5, outcome="failed",
                                                   verify="quick", passed_over=((9, "torn"), (8, "changed")),
                                                   error="nothing provable"))
        second = cat.record_recovery(RecoveryRecord(job="a", started_at=T0 + timedelta(hours=1), seconds=1.25,
                                                    outcome="resumed", verify="full", step=7, checkpoint_id=12345,
                                                    source="archive", path="/cache/a/step-00000007"))
        cat.record_recovery(RecoveryRecord(job="b", started_at=T0, seconds=0.1, outcome="resumed", verify="full"))
        got = cat.recoveries(job="a")
        assert [r.id for r in got] == [second, first]
        assert got[1].passed_over == ((9, "torn"), (8, "changed")) and got[1].error == "nothing provable"
        assert got[1].started_at == T0 and got[1].verify == "quick"
        assert (got[0].step, got[0].source, got[0].path, got[0].seconds) == (7, "archive", "/cache/a/step-00000007", 1.25)
        assert got[0].checkpoint_id is None  # no such checkpoint: not a dangling reference
        assert [r.outcome for r in cat.recoveries(job="a", since=T0 + timedelta(minutes=1))] == ["resumed"]
        assert len(cat.recoveries()) == 3 and len(cat.recoveries(limit=1)) == 1


# ------------------------------------------------------------------ every rank: resume_distributed

RANK_SCRIPT = """
import json, sys
from ckptier import ResumeError, resume_distributed
job, rank, where = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    r = resume_distributed(job, rendezvous=where, rank=rank, world_size=2, attempt="launch-1", timeout=60)
    out = {"step": r.step, "path": r.path}
except ResumeError as exc:
    out = {"error": str(exc)}
print(json.dumps({**out, "rank": rank, "torch": "torch" in sys.modules}))
"""


def _ranks(argv_of: list[list[str]], env: dict[str, str]) -> list[dict[str, object]]:
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for argv in argv_of]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


@pytest.mark.slow  # 2 launches of 2 processes, each importing the catalog's libraries: 4-10 s on 2 shared cores
def test_file_rendezvous_gives_both_ranks_the_same_answer_or_the_same_error(env: dict[str, Path],
                                                                            tmp_path: Path) -> None:
    where = tmp_path / "rendezvous"
    for job in (JOB, "never-trained"):
        got = _ranks([[sys.executable, "-c", RANK_SCRIPT, job, str(rank), str(where / job)] for rank in (1, 0)],
                     os.environ.copy())
        one, zero = sorted(got, key=lambda g: int(g["rank"]))  # type: ignore[call-overload]
        assert {k: v for k, v in one.items() if k != "rank"} == {k: v for k, v in zero.items() if k != "rank"}
        assert one["torch"] is False  # no process group: torch is never imported
        if job == JOB:
            assert one["step"] == 75 and Path(str(one["path"])) == env["job_dir"] / "step-00000075"
        else:
            assert "never-trained" in str(one["error"]) and "no checkpoints in the catalog" in str(one["error"])
    assert [e.outcome for e in _recoveries(env)] == ["resumed"]  # rank 0 resolved once; the other rank asked nobody


def test_a_rank_without_rank_0_times_out_naming_the_rendezvous(tmp_path: Path) -> None:
    from ckptier import ResumeError, resume_distributed

    with pytest.raises(ResumeError, match=r"rank 1: no answer from rank 0 within 0\.05 s .*resume-j-x\.json"):
        resume_distributed("j", rendezvous=tmp_path, rank=1, world_size=2, attempt="x", timeout=0.05)
    with pytest.raises(ValueError, match="rendezvous=DIR"):
        resume_distributed("j", rank=1, world_size=2, attempt="x")
    with pytest.raises(ValueError, match="rank 2 of world size 2"):
        resume_distributed("j", rendezvous=tmp_path, rank=2, world_size=2)


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "resume_train.py"


@pytest.mark.slow  # 2 launches of 2 ranks, each importing torch and starting a gloo group: 15-60 s on 2 shared cores
def test_two_gloo_ranks_resume_together_from_the_example(env: dict[str, Path]) -> None:
    from tests.fixtures.services import free_port

    for job in (JOB, "never-trained"):
        base = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        procs = [subprocess.Popen([sys.executable, str(EXAMPLE), "--job", job, "--steps", "1"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}) for rank in (0, 1)]
        outs = [p.communicate(timeout=120) for p in procs]
        for p, (_, err) in zip(procs, outs):
            assert p.returncode == 0, err[-2000:]
        zero, one = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
        assert (zero["rank"], one["rank"]) == (0, 1)
        for key in ("step", "path", "passed_over", "error", "losses"):
            assert zero.get(key) == one.get(key), key  # the same answer, the same load, the same training
        if job == JOB:
            assert zero["step"] == 75 and Path(zero["path"]) == env["job_dir"] / "step-00000075"
        else:
            assert zero["step"] == 0 and "no checkpoints in the catalog" in zero["error"]
    assert [e.outcome for e in _recoveries(env)] == ["resumed"]


@pytest.mark.slow  # torchrun itself starting 2 gloo ranks: 15-60 s on 2 shared cores
def test_torchrun_runs_the_example_on_two_gloo_ranks(env: dict[str, Path]) -> None:
    """The docstring's command as written (torchrun's own launcher and rendezvous), ranks agreeing."""
    logs = env["tmp"] / "torchrun-logs"  # each rank's stdout in its own file (on one stream they interleave)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--redirects", "1", "--log-dir", str(logs),
                           str(EXAMPLE), "--job", JOB, "--steps", "1", "--quick"],
                          capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    outs = sorted(logs.rglob("stdout.log"))
    by_rank = {line["rank"]: line for line in (json.loads(p.read_text().strip().splitlines()[-1]) for p in outs)}
    assert sorted(by_rank) == [0, 1], [p.read_text()[-500:] for p in outs]
    assert by_rank[0]["step"] == by_rank[1]["step"] == 75 and by_rank[0]["losses"] == by_rank[1]["losses"]
    assert Path(by_rank[0]["path"]) == env["job_dir"] / "step-00000075" == Path(by_rank[1]["path"])
    assert [(e.outcome, e.verify) for e in _recoveries(env)] == [("resumed", "quick")]  # rank 0 asked, once


def test_drilled_answers_only_a_checkpoint_whose_last_drill_passed(env: dict[str, Path],
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "resume", "--job", JOB, "--drilled", "--quick")
    assert code == 1 and "no verified checkpoint whose most recent drill passed" in err
    with Catalog.open(f"sqlite:///{env['catalog']}", create=False) as cat:
        for step, ok in ((75, False), (50, True)):
            record = cat.get(JOB, step)
            assert record is not None
            cat.record_drill(DrillRecord(job=JOB, step=step, checkpoint_id=record.id, started_at=datetime.now(UTC),
                                         finished_at=datetime.now(UTC), ok=ok, device="cpu", source_tier="hot",
                                         error=None if ok else "loss was NaN", outcome="passed" if ok else "failed"))
    code, out, _ = run(capsys, "resume", "--job", JOB, "--drilled", "--quick", "--json")
    answer = json.loads(out)
    assert code == 0 and answer["step"] == 50 and answer["proof"] == "drilled"
    ((step, why),) = [(p["step"], p["reason"]) for p in answer["passed_over"]]
    assert step == 75 and "its drill failed" in why and "loss was NaN" in why
