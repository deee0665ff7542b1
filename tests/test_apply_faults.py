"""Applying a plan against a real moto_server when S3 misbehaves.

Faults are injected with botocore event hooks on the hot S3Store's own
client, so botocore's real retry loop and the store's real error handling
run: per-key DeleteObjects errors, a SlowDown (503) storm, a versioned
bucket that only adds delete markers, and a store failing the start-up
canary. Every test ends with a clean re-run that finishes the work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ckptier.storage.catalog.api import Catalog, FileCheck
from ckptier.storage.hashing import hash_bytes
from ckptier.storage.local import LocalStore
from ckptier.storage.records import FileRef, Format, Found, Recognition, State
from ckptier.storage.s3 import S3Store
from tests.test_apply import DELETED_STEPS, JOB, STEPS, T0, Clock, World, files_for
from ckptier.tasks.retention import KeepLast, Milestones, Policy

pytestmark = pytest.mark.s3


class _Raw:
    def __init__(self, body: bytes) -> None:
        self.body = body

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self.body


def fake_response(request: Any, status: int, code: str, message: str) -> Any:
    from botocore.awsrequest import AWSResponse

    body = f"<Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()
    return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, _Raw(body))


class S3World(World):
    """The world of tests/test_apply.py with the hot tier in an S3 bucket."""

    def on_disk(self, step: int) -> bool:
        return any(True for _ in self.hot.list(f"{JOB}/step-{step:08d}/"))

    def key_exists(self, key: str) -> bool:
        try:
            self.hot.stat(key)
        except Exception:  # noqa: BLE001
            return False
        return True


@pytest.fixture
def s3_world(s3_env: str, s3_bucket: Any, tmp_path: Path) -> Iterator[S3World]:
    hot = S3Store(s3_bucket.name, "hot", endpoint_url=s3_env, max_attempts=3)
    found = []
    for step in STEPS:
        prefix = f"{JOB}/step-{step:08d}"
        refs = []
        for rel, data in sorted(files_for(step).items()):
            hot.write(f"{prefix}/{rel}", data)
            refs.append(FileRef(key=f"{prefix}/{rel}", relpath=rel, size=len(data)))
        found.append(Found(job=JOB, step=step, format=Format.GUIDE, prefix=prefix, files=tuple(refs),
                           committed=True, reason="metadata.json present"))
    catalog = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}")
    catalog.record_scan(hot.url, Recognition(tuple(found), (), 30), now=T0)
    for rec in catalog.checkpoints():
        checks = [FileCheck(rel, "ok", len(d), hash_bytes(d).crc64nvme) for rel, d in files_for(rec.step).items()]
        assert catalog.record_verification(rec.id, checks, now=T0) == State.VERIFIED
    policy = Policy(rules=(KeepLast(2), Milestones(steps=(100, 500))), archive=str(tmp_path / "archive"))
    world = S3World(hot, LocalStore(tmp_path / "archive"), catalog, "", Clock(T0 + timedelta(days=1)), policy)  # type: ignore[arg-type]
    yield world
    catalog.close()


def hook(store: S3Store, event: str, handler: Callable[..., Any]) -> Callable[[], None]:
    store.client.meta.events.register(event, handler)
    return lambda: store.client.meta.events.unregister(event, handler)


def finish(world: S3World) -> None:
    """A clean re-run finishes the work: the plan's deletions are all tombstoned and gone."""
    world.clock.advance(timedelta(hours=1))
    rerun = world.apply(owner="run-2")
    assert rerun.ok, rerun.summary()
    for step in DELETED_STEPS:
        assert world.state(step) == State.DELETED and not world.on_disk(step)
    for step in set(STEPS) - set(DELETED_STEPS):
        assert world.state(step) == State.VERIFIED
    assert world.on_disk(900) and world.on_disk(1000)


def test_per_key_delete_errors_tombstone_only_fully_confirmed_checkpoints(s3_world: S3World) -> None:
    w = s3_world
    refused_key = f"hot/{JOB}/step-00000300/rank-0000/model.pt"
    dropped: list[str] = []

    def drop(params: dict[str, Any], **_: Any) -> None:
        objects = params["Delete"]["Objects"]
        keep = [o for o in objects if o["Key"] != refused_key]
        if len(keep) != len(objects):
            dropped.append(refused_key)  # the server never deletes it ...
        params["Delete"]["Objects"] = keep

    def report_error(parsed: dict[str, Any], **_: Any) -> None:
        if dropped:  # ... and answers with a per-key error for it
            parsed.setdefault("Errors", []).append({"Key": dropped.pop(), "Code": "AccessDenied", "Message": "injected"})

    remove = [hook(w.hot, "before-parameter-build.s3.DeleteObjects", drop),  # type: ignore[arg-type]
              hook(w.hot, "after-call.s3.DeleteObjects", lambda parsed, **kw: report_error(parsed))]  # type: ignore[arg-type]
    try:
        report = w.apply()
    finally:
        for r in remove:
            r()
    by_step = {r.step: r for r in report.items if r.action == "delete"}
    assert by_step[300].outcome == "partial"
    assert {s for s, r in by_step.items() if r.outcome == "done"} == set(DELETED_STEPS) - {300}
    assert w.state(300) == State.VERIFIED  # not tombstoned: one file still exists
    assert w.key_exists(f"{JOB}/step-00000300/rank-0000/model.pt")
    assert not w.key_exists(f"{JOB}/step-00000300/metadata.json")  # what was confirmed is gone
    assert any(e.kind == "delete.partial" for e in w.catalog.events(job=JOB))
    assert not report.ok
    finish(w)


def test_slowdown_storm_is_retried_then_fails_cleanly_and_the_next_run_resumes(s3_world: S3World) -> None:
    w = s3_world
    attempts: list[int] = []

    def slowdown(request: Any, **_: Any) -> Any:
        attempts.append(1)
        return fake_response(request, 503, "SlowDown", "Please reduce your request rate.")

    remove = hook(w.hot, "before-send.s3.DeleteObjects", slowdown)  # type: ignore[arg-type]
    try:
        report = w.apply()
    finally:
        remove()
    assert len(attempts) == 3  # botocore's standard retry mode tried max_attempts times, for one item only
    assert not report.ok
    deletes = [r for r in report.items if r.action == "delete"]
    assert deletes[0].outcome == "failed" and "unavailable" in deletes[0].detail
    assert {r.outcome for r in deletes[1:]} == {"deferred"}  # the store is throttling: stop asking
    assert all(w.state(s) == State.VERIFIED for s in STEPS)  # no batch assumed done
    assert all(w.on_disk(s) for s in STEPS)
    assert [r.step for r in report.promoted] == [100, 500]  # promotions are not held up by hot deletes
    finish(w)


def test_versioned_bucket_reports_space_not_freed(s3_world: S3World, s3_bucket: Any) -> None:
    w = s3_world
    s3_bucket.client.put_bucket_versioning(Bucket=s3_bucket.name, VersioningConfiguration={"Status": "Enabled"})
    report = w.apply()
    assert report.ok, report.summary()
    assert [r.step for r in report.deleted] == DELETED_STEPS
    assert report.bytes_freed == 0  # delete markers only
    notes = [e for e in w.catalog.events(job=JOB, limit=1000) if e.kind == "delete.space_not_freed"]
    assert len(notes) == len(DELETED_STEPS)
    assert all("space not freed: versioned bucket" in e.message for e in notes)
    assert all(w.state(s) == State.DELETED for s in DELETED_STEPS)


def test_failing_canary_blocks_every_delete_from_that_store(s3_world: S3World) -> None:
    w = s3_world

    def reject_checksums(request: Any, **_: Any) -> Any:
        if ".ckptier-canary/" in request.url:
            return fake_response(request, 501, "NotImplemented", "x-amz-checksum-crc64nvme is not supported")
        return None

    remove = hook(w.hot, "before-send.s3.PutObject", reject_checksums)  # type: ignore[arg-type]
    try:
        report = w.apply()
    finally:
        remove()
    assert list(report.canary_failures) == [w.hot.url]
    assert "CKPTIER_S3_CHECKSUMS=when_required" in report.canary_failures[w.hot.url]
    assert {r.outcome for r in report.items if r.action == "delete"} == {"deferred"}
    assert all(w.on_disk(s) for s in STEPS)
    assert not report.ok
    finish(w)
