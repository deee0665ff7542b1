"""Fan-out: ``[runner]``, verification on threads or a real local Dask cluster, and row claims.

Row claims run on SQLite and PostgreSQL (the ``catalog_url`` fixture); the
many-process PostgreSQL test is in ``tests/test_fanout_pg.py``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from ckptier.storage.catalog.api import Catalog, LeaseLost, UnknownCheckpoint, ReadBack
from ckptier.storage.errors import ConfigError, Unavailable
from ckptier.storage.records import FileCheck, State
from ckptier.tasks.config import RunnerSettings, parse_config
from ckptier.tasks.fanout import (
    batches,
    open_fanout,
    retrying,
    runner_settings,
)
from ckptier.tasks.pipeline import VerifyOptions, recording_batches, run_scan, run_verify
from ckptier.tasks.run import CLAIM_SHARE, MIN_CLAIM, RowClaims, Run, row_claims

T0 = datetime(2026, 3, 1, tzinfo=UTC)


def make_tree(root: Path, n: int, *, job: str = "fan", size: int = 512) -> Path:
    """``n`` committed checkpoints in the storage guide's layout, a few small files each."""
    for step in range(1, n + 1):
        d = root / job / f"step-{step:08d}"
        (d / "rank-0000").mkdir(parents=True)
        (d / "rank-0000" / "model.pt").write_bytes(os.urandom(size))
        (d / "metadata.json").write_text(json.dumps({"step": step}))
    return root


def scanned(root: Path, url: str) -> Catalog:
    cat = Catalog.open(url)
    run_scan(Run.of(cat), [str(root)])
    return cat


# ---------------------------------------------------------------- [runner]


@pytest.mark.parametrize(("text", "expected"), [
    ("", RunnerSettings()),
    ('[runner]\nkind = "dask"\nworkers = 2\n', RunnerSettings(kind="dask", workers=2)),
    ('[runner]\nkind = "dask"\naddress = "tcp://10.0.0.5:8786"\n', RunnerSettings(kind="dask", address="tcp://10.0.0.5:8786")),
    ('[runner]\nclaim_rows = true\nlease = "30s"\n', RunnerSettings(claim_rows=True, lease=timedelta(seconds=30))),
])
def test_runner_table_parses(text: str, expected: RunnerSettings) -> None:
    assert parse_config(text).runner == expected


@pytest.mark.parametrize(("text", "says"), [
    ('[runner]\nkind = "ray"\n', 'runner.kind = "ray": must be "threads" or "dask"'),
    ('[runner]\nkind = "dask"\nworkers = 0\n', "runner.workers = 0: must be ≥ 1"),
    ('[runner]\nkind = "dask"\nworkers = 2\naddress = "tcp://h:8786"\n', "give workers (a local Dask cluster) or address"),
    ('[runner]\nkind = "dask"\naddress = "h:8786"\n', "must be a Dask scheduler address"),
    ('[runner]\naddress = "tcp://h:8786"\n', 'needs kind = "dask"'),
    ('[runner]\nworker = 2\n', "unknown key; did you mean workers?"),
    ('[runner]\nlease = "0s"\n', "runner.lease"),
    ('runner = "dask"\n', "runner must be a table"),
])
def test_bad_runner_tables_are_one_line_errors(text: str, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(text)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_the_command_line_runner_overrides_the_file() -> None:
    dask = RunnerSettings(kind="dask", address="tcp://h:8786", claim_rows=True)
    assert runner_settings(dask, None) == dask
    assert runner_settings(dask, "threads") == RunnerSettings(kind="threads", claim_rows=True)
    assert runner_settings(RunnerSettings(workers=3), "dask") == RunnerSettings(kind="dask", workers=3)
    assert row_claims(RunnerSettings(), None, owner="w") is None
    with pytest.raises(ConfigError, match="--since"):
        row_claims(RunnerSettings(), "2026-01-01", owner="w")
    claims = row_claims(RunnerSettings(claim_rows=True), "2026-03-01T00:00:00", owner="w")
    assert claims is not None and claims.since == T0 and claims.owner == "w"


def test_batches_even_out_over_the_workers() -> None:
    items: list[Any] = list(range(100))
    cut = batches(items, 2)
    assert [len(b) for b in cut] == [13] * 7 + [9] and [x for b in cut for x in b] == items
    assert [len(b) for b in batches(items[:3], 8)] == [1, 1, 1] and batches([], 4) == []
    assert max(len(b) for b in batches(list(range(10_000)), 2)) == 16


def test_work_items_retry_only_transient_errors() -> None:
    calls: list[int] = []

    def flaky(x: int) -> int:
        calls.append(x)
        if len(calls) < 3:
            raise Unavailable("s3://b: 503 Slow Down")
        return x * 2

    assert retrying(flaky, 21, delay=0) == 42 and len(calls) == 3

    def broken(x: int) -> int:
        calls.append(x)
        raise ValueError("not transient")

    calls.clear()
    with pytest.raises(ValueError):
        retrying(broken, 1, delay=0)
    assert len(calls) == 1


# ------------------------------------------------------------ row claims


def test_row_claims_are_disjoint_and_leased_like_any_lease(catalog_url: str, tmp_path: Path) -> None:
    with scanned(make_tree(tmp_path / "hot", 6), catalog_url) as cat:
        ids = [c.id for c in cat.checkpoints()]
        a = cat.claim_rows(ids, "a", now=T0, ttl=timedelta(seconds=30), since=T0, limit=4)
        b = cat.claim_rows(ids, "b", now=T0, ttl=timedelta(seconds=30), since=T0, limit=4)
        assert len(a) == 4 and len(b) == 2 and not {i for i, _ in a} & {i for i, _ in b}
        assert cat.claim_rows(ids, "c", now=T0, ttl=timedelta(seconds=30), since=T0, limit=4) == []
        # A claim is the ordinary lease: apply's claim of the same row waits for it.
        held, gen = a[0]
        assert cat.claim(held, "apply", now=T0, ttl=timedelta(minutes=2)) is None
        assert cat.lease_holder(held, now=T0).owner == "a"  # type: ignore[union-attr]
        # Recording under a claim releases it and marks the row checked: nobody claims it again.
        rec = cat.get_by_id(held)
        assert rec is not None
        ok = [FileCheck(f.relpath, "ok", f.size, None, None, None) for f in rec.files]
        assert cat.record_verification(held, ok, now=T0, claim=("a", gen)) == State.VERIFIED
        assert cat.lease_holder(held, now=T0) is None
        # Once the leases run out, the rows not checked since the sweep began come free again.
        later = T0 + timedelta(seconds=31)
        again = cat.claim_rows(ids, "c", now=later, ttl=timedelta(seconds=30), since=T0, limit=10)
        assert {i for i, _ in again} == set(ids) - {held}
        assert cat.unchecked(ids, since=T0) == 5
        # The expired holder is fenced out: its late result is not recorded.
        late, late_gen = a[1]
        with pytest.raises(LeaseLost):
            cat.record_verification(late, ok[:0], now=later, claim=("a", late_gen))
        assert cat.get_by_id(late).state == State.COMMITTED  # type: ignore[union-attr]
        # A new sweep (a later ``since``) claims the checked row again.
        assert [i for i, _ in cat.claim_rows([held], "d", now=later, ttl=timedelta(seconds=30),
                                             since=later, limit=1)] == [held]


def test_a_batch_of_verifications_is_recorded_together_and_fenced_item_by_item(catalog_url: str,
                                                                               tmp_path: Path) -> None:
    with scanned(make_tree(tmp_path / "hot", 5), catalog_url) as cat:
        recs = cat.checkpoints()
        ids = [c.id for c in recs]
        ok = {c.id: tuple(FileCheck(f.relpath, "ok", f.size, None, None, None) for f in c.files) for c in recs}
        bad = tuple(FileCheck(f.relpath, "corrupt", f.size, None, None, "sha256 mismatch") for f in recs[2].files)
        claimed = dict(cat.claim_rows(ids[:2], "a", now=T0, ttl=timedelta(seconds=30), since=T0, limit=2))
        stale = claimed[ids[1]] - 1  # a generation the row no longer has: that holder was fenced out
        got = cat.record_verifications([
            ReadBack(ids[0], ok[ids[0]], claim=("a", claimed[ids[0]])),
            ReadBack(ids[1], ok[ids[1]], claim=("a", stale)),
            ReadBack(ids[2], bad),
            ReadBack(ids[3], ok[ids[3]]),
        ], now=T0)
        assert got[0] == State.VERIFIED and got[2] == State.CORRUPT and got[3] == State.VERIFIED
        assert isinstance(got[1], LeaseLost) and "ran out or was taken over" in str(got[1])
        states = {c.id: c.state for c in cat.checkpoints()}
        assert [states[i] for i in ids] == [State.VERIFIED, State.COMMITTED, State.CORRUPT, State.VERIFIED,
                                             State.COMMITTED]
        assert cat.lease_holder(ids[0], now=T0) is None  # released with its result
        assert cat.lease_holder(ids[1], now=T0).owner == "a"  # type: ignore[union-attr]  # untouched
        assert cat.unchecked(ids, since=T0) == 2
        # A batch naming an unknown checkpoint records none of it.
        with pytest.raises(UnknownCheckpoint):
            cat.record_verifications([ReadBack(ids[4], ok[ids[4]]), ReadBack(10**9, ())], now=T0)
        assert cat.get_by_id(ids[4]).state == State.COMMITTED  # type: ignore[union-attr]


def test_results_are_recorded_in_batches_cut_by_count_and_by_bytes(tmp_path: Path) -> None:
    with scanned(make_tree(tmp_path / "hot", 7, size=1000), f"sqlite:///{tmp_path / 'c.db'}") as cat:
        recs = cat.checkpoints()
    size = sum(f.size for f in recs[0].files)
    triples = [(r, None, None) for r in recs]
    assert [len(b) for b in recording_batches(triples, most=3, max_bytes=10**9)] == [3, 3, 1]
    assert [len(b) for b in recording_batches(triples, most=16, max_bytes=2 * size)] == [2, 2, 2, 1]
    assert [b[0][0].step for b in recording_batches(triples, most=1, max_bytes=10**9)] == [1, 2, 3, 4, 5, 6, 7]
    assert list(recording_batches([], most=3)) == []


def test_several_claiming_runs_verify_each_row_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    with scanned(make_tree(tmp_path / "hot", 12), url) as cat:
        since = datetime.now(UTC)
        first = run_verify(Run.of(cat), VerifyOptions(deep=True, claims=RowClaims(owner="w1", since=since, batch=5)))
        second = run_verify(Run.of(cat), VerifyOptions(deep=True, claims=RowClaims(owner="w2", since=since, batch=5)))
        assert first.totals.verified == 12 and second.totals.checked == 0
        assert all(c.state == State.VERIFIED for c in cat.checkpoints())


def test_a_claiming_run_takes_a_quarter_of_what_is_left_within_its_bounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with scanned(make_tree(tmp_path / "hot", 40), f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
        asked: list[tuple[int, int]] = []  # (rows still unchecked, limit of the claim that followed)
        real_unchecked, real_claim = cat.unchecked, cat.claim_rows
        left: list[int] = []

        def unchecked(ids: Any, *, since: datetime) -> int:
            left.append(real_unchecked(ids, since=since))
            return left[-1]

        def claim_rows(ids: Any, owner: str, **kw: Any) -> Any:
            asked.append((left[-1], kw["limit"]))
            return real_claim(ids, owner, **kw)

        monkeypatch.setattr(cat, "unchecked", unchecked)
        monkeypatch.setattr(cat, "claim_rows", claim_rows)
        report = run_verify(Run.of(cat), VerifyOptions(deep=True,
                                                       claims=RowClaims(owner="w1", since=datetime.now(UTC), batch=8)))
        assert report.totals.verified == 40
    assert asked[0] == (40, 8)  # a quarter of 40 is 10: held to ``batch``
    for rows, limit in asked:
        assert limit == min(8, max(MIN_CLAIM, -(-rows // CLAIM_SHARE))), (rows, limit)
    assert any(limit < 8 for _, limit in asked)  # smaller batches towards the end


def test_a_run_waiting_on_rows_others_hold_ends_soon_after_they_are_done(tmp_path: Path) -> None:
    with scanned(make_tree(tmp_path / "hot", 3), f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
        since = datetime.now(UTC)
        ids = [c.id for c in cat.checkpoints()]
        (held,) = cat.claim_rows(ids[:1], "other", now=datetime.now(UTC), ttl=timedelta(minutes=5), since=since,
                                 limit=1)
        ended: list[float] = []

        def other_finishes() -> None:
            time.sleep(0.3)
            assert cat.finish_claim(held[0], "other", held[1], now=datetime.now(UTC))
            ended.append(time.monotonic())

        helper = threading.Thread(target=other_finishes)
        helper.start()
        report = run_verify(Run.of(cat), VerifyOptions(deep=True, claims=RowClaims(owner="me", since=since, poll=30.0)))
        done = time.monotonic()
        helper.join()
    assert report.totals.verified == 2  # the third was the other run's
    assert done - ended[0] < 5.0  # looked again within a few growing intervals, not after ``poll``


# --------------------------------------------------------------- Dask


@pytest.fixture(scope="module")
def dask_cluster() -> Iterator[Any]:
    """A real local Dask cluster: 2 worker processes on 127.0.0.1."""
    from ckptier.tasks.fanout import DaskFanout

    fan = DaskFanout(workers=2)
    try:
        yield fan
    finally:
        fan.close()


@pytest.mark.slow
def test_verify_on_a_local_dask_cluster_matches_threads(dask_cluster: Any, tmp_path: Path) -> None:
    hot = make_tree(tmp_path / "hot", 20)
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    with scanned(hot, url) as cat:
        threads = run_verify(Run.of(cat), VerifyOptions(deep=True))
        assert threads.totals.verified == 20
        bad = hot / "fan" / "step-00000007" / "rank-0000" / "model.pt"
        data = bytearray(bad.read_bytes())
        data[10] ^= 0xFF
        bad.write_bytes(bytes(data))
        seen: list[tuple[int, int]] = []
        dask = run_verify(Run.of(cat), VerifyOptions(deep=True), fanout=dask_cluster,
                          progress=lambda done, total: seen.append((done, total)))
    assert dask_cluster.parallelism == 2
    assert [(r.step, r.state) for r in dask.checkpoints] == \
        [(s, "corrupt" if s == 7 else "verified") for s in range(1, 21)]
    assert dask.totals.bytes_read == threads.totals.bytes_read
    assert "rank-0000/model.pt" in (dask.checkpoints[6].detail or "")
    assert seen[-1][0] == seen[-1][1] > 0


@pytest.mark.slow
def test_dask_claims_and_threads_agree_on_the_same_catalog(dask_cluster: Any, tmp_path: Path) -> None:
    with scanned(make_tree(tmp_path / "hot", 10), f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
        report = run_verify(Run.of(cat), VerifyOptions(claims=RowClaims(owner="dask-worker", batch=3)),
                            fanout=dask_cluster)
        assert report.totals.verified == 10
        assert all(cat.lease_holder(c.id, now=datetime.now(UTC)) is None for c in cat.checkpoints())


def test_the_threads_runner_reads_here_and_keeps_order(tmp_path: Path) -> None:
    """``kind = "threads"`` opens no executor: verification reads on this process's
    pool of ``workers`` threads, and its rows come in the candidates' order."""
    assert open_fanout(RunnerSettings()) is None
    assert open_fanout(runner_settings(RunnerSettings(kind="dask", workers=2), "threads")) is None
    with scanned(make_tree(tmp_path / "hot", 20), f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
        report = run_verify(Run.of(cat), VerifyOptions(deep=True, workers=3))
    assert [(r.step, r.state) for r in report.checkpoints] == [(s, "verified") for s in range(1, 21)]


@pytest.mark.slow
@pytest.mark.prefect_server
def test_the_verify_flow_fans_out_as_prefect_tasks_on_dask(dask_cluster: Any, prefect_api: Any, tmp_path: Path) -> None:
    """The ``verify`` flow with ``runner="dask"``: its checkpoints are read by
    ``verify-checkpoints`` task runs on a DaskTaskRunner (here the cluster at
    ``[runner] address``: the module's 2 local workers), and the flow records them."""
    from ckptier.flows.scan_verify import verify_flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    hot = make_tree(tmp_path / "hot", 8)
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    scanned(hot, url).close()
    config = tmp_path / "ckptier.toml"
    config.write_text(f'[runner]\nkind = "dask"\naddress = "{dask_cluster.address}"\n')
    state = verify_flow(deep=True, catalog_url=url, config_path=str(config), runner="dask", return_state=True)
    assert state.is_completed(), state
    assert state.result().totals.verified == 8
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    fanned = [r for r in runs if r.name.startswith("verify ") and "@" in r.name]  # "verify j@3 and 1 more"
    assert len(fanned) >= 2 and all(r.state is not None and r.state.is_completed() for r in fanned)


@pytest.mark.slow
def test_promotions_fan_out_on_dask_and_the_run_records_them(dask_cluster: Any, tmp_path: Path) -> None:
    from ckptier.tasks.pipeline import run_apply

    hot = make_tree(tmp_path / "hot", 6, size=4096)
    archive = tmp_path / "archive"
    archive.mkdir()
    config = parse_config(f'[[policy]]\njobs = "*"\nkeep_last = 1\nmilestones = [2, 4, 5]\narchive = "{archive}"\n'
                          'hot_after_archive = "keep"\n')
    with scanned(hot, f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
        run_verify(Run.of(cat))
        report = run_apply(Run.of(cat, config=config, owner="fan-test"), fanout=dask_cluster)
        promoted = sorted(i.step for i in report.items if i.action == "promote" and i.outcome == "done")
        assert promoted == [2, 4, 5], report.lines
        for step in promoted:
            rec = cat.get("fan", step)
            assert rec is not None and rec.has_verified_archive()
        assert sum(e.kind == "promote.done" for e in cat.events(job="fan")) == 3
        # A second run finds them archived: nothing is copied twice.
        again = run_apply(Run.of(cat, config=config, owner="fan-test-2"), fanout=dask_cluster)
        assert not [i for i in again.items if i.action == "promote" and i.outcome == "done"]
