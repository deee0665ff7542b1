"""Scanning a store: the metadata prefetcher changes speed, never results."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from ckptier.storage.base import DeleteResult, LocalPaths, ObjectInfo, Store
from ckptier.storage.errors import AccessDenied, Unavailable
from ckptier.storage.local import LocalStore
from ckptier.tasks.scan import Prefetcher, recognise_store
from tests.fixtures.checkpoints import CheckpointRun

NOW = 4_000_000_000.0  # far after the fixtures were written: everything has settled


class CountingReads:
    """A store over ``inner`` that counts ``open_read`` calls, from any thread."""

    def __init__(self, inner: LocalStore) -> None:
        self.inner, self.url = inner, inner.url
        self.reads = 0
        self._lock = threading.Lock()

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def stat(self, key: str) -> ObjectInfo:
        return self.inner.stat(key)

    def open_read(self, key: str) -> BinaryIO:
        with self._lock:
            self.reads += 1
        return self.inner.open_read(key)

    def write(self, key: str, data: Any, *, if_absent: bool = False) -> ObjectInfo:
        return self.inner.write(key, data, if_absent=if_absent)

    def delete_many(self, keys: Any) -> DeleteResult:
        return self.inner.delete_many(keys)


class FailingReads(CountingReads):
    """Reads of keys ending in ``suffix`` raise ``exc``; counts which thread read what."""

    def __init__(self, inner: LocalStore, suffix: str, exc: Exception | None) -> None:
        super().__init__(inner)
        self.suffix, self.exc = suffix, exc
        self.threads: set[str] = set()

    def open_read(self, key: str) -> BinaryIO:
        self.threads.add(threading.current_thread().name)
        if self.exc is not None and key.endswith(self.suffix):
            raise self.exc
        return super().open_read(key)


@pytest.mark.parametrize("run_name", ["guide_run", "dcp_run", "hf_run"])
def test_prefetching_gives_the_same_recognition(run_name: str, request: pytest.FixtureRequest) -> None:
    run: CheckpointRun = request.getfixturevalue(run_name)
    store = LocalStore(run.root)
    one_by_one = CountingReads(store)
    serial = recognise_store(one_by_one, now=NOW, name="root", prefetch=0)
    metered = FailingReads(store, "", None)
    parallel = recognise_store(metered, now=NOW, name="root", prefetch=16)
    assert parallel == serial
    assert len(serial.checkpoints) == len(run.steps) and all(c.committed for c in serial.checkpoints)
    reads = one_by_one.reads
    assert metered.reads == reads  # each marker read once, none wasted
    # Each step's manifest (metadata.json, trainer_state.json, DCP's .metadata) is read by the prefetch threads.
    assert any(t.startswith("ckptier-prefetch") for t in metered.threads)
    assert reads == len(run.steps)


def test_by_default_local_files_are_read_on_demand_and_remote_ones_ahead(guide_run: CheckpointRun) -> None:
    class ThreadsOfLocalReads(LocalStore):
        threads: set[str] = set()

        def open_read(self, key: str) -> BinaryIO:
            self.threads.add(threading.current_thread().name)
            return super().open_read(key)

    local = ThreadsOfLocalReads(guide_run.root)
    assert isinstance(local, LocalPaths)
    remote = FailingReads(LocalStore(guide_run.root), "", None)  # no local paths: as S3
    assert not isinstance(remote, LocalPaths)
    assert recognise_store(local, now=NOW, name="root") == recognise_store(remote, now=NOW, name="root")
    assert local.threads == {threading.current_thread().name}
    assert remote.threads and all(t.startswith("ckptier-prefetch") for t in remote.threads)


@pytest.mark.parametrize("prefetch", [0, 16])
def test_a_transient_read_error_reaches_the_caller(guide_run: CheckpointRun, prefetch: int) -> None:
    store = FailingReads(LocalStore(guide_run.root), "metadata.json", Unavailable("SlowDown"))
    with pytest.raises(Unavailable, match="SlowDown"):
        recognise_store(store, now=NOW, name="root", prefetch=prefetch)


@pytest.mark.parametrize("prefetch", [0, 16])
def test_an_unreadable_marker_leaves_the_checkpoint_incomplete(guide_run: CheckpointRun, prefetch: int) -> None:
    store = FailingReads(LocalStore(guide_run.root), "metadata.json", AccessDenied("metadata.json: permission denied"))
    found = recognise_store(store, now=NOW, name="root", prefetch=prefetch)
    assert found.checkpoints and not any(c.committed for c in found.checkpoints)
    assert all("permission denied" in c.reason for c in found.checkpoints)


def test_prefetch_holds_at_most_its_byte_budget(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    for i in range(10):
        store.write(f"job/step-{i:08d}/metadata.json", b"x" * 1000)
    with Prefetcher(store, workers=2, limit=1 << 20, max_bytes=3500) as pre:
        listed: Iterator[object] = pre.watch(store.list(""))
        assert len(list(listed)) == 10
        assert len(pre._pending) == 3  # 3 × 1000 bytes fit the budget, the rest is read on demand
        assert all(pre.read(f"job/step-{i:08d}/metadata.json") == b"x" * 1000 for i in range(10))


# -------------------------------------------------------------- bad input never aborts a scan


def _guide_step(store: Store, job: str, step_text: str) -> None:
    prefix = f"{job}/step-{step_text}"
    store.write(f"{prefix}/rank-0000/model.pt", b"w" * 64)
    store.write(f"{prefix}/metadata.json", b'{"step": %d}' % int(step_text))


def _scan_out_of_range_steps(store: Store, tmp_path: Path) -> None:
    from datetime import UTC, datetime

    from ckptier.storage.catalog.api import Catalog
    from ckptier.tasks.scan import scan_url

    for text in ("00000100", "00000200", "9223372036854775807", "9223372036854775808", "99999999999999999999"):
        _guide_step(store, "llm", text)
    with Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
        report = scan_url(store.url, cat, now=datetime(2026, 3, 1, tzinfo=UTC), store=store)
        assert [c.step for c in cat.checkpoints(job="llm")] == [100, 200, 2**63 - 1]
    skipped = {u.key: u.reason for u in report.unrecognised}
    assert set(skipped) == {"llm/step-9223372036854775808/", "llm/step-99999999999999999999/"}
    assert all("out of range" in why and "2^63" in why for why in skipped.values())


def test_steps_past_2_63_are_not_recognised_and_the_rest_is_cataloged(tmp_path: Path) -> None:
    _scan_out_of_range_steps(LocalStore(tmp_path / "hot"), tmp_path)


@pytest.mark.s3
def test_steps_past_2_63_on_s3(s3_bucket: Any, tmp_path: Path) -> None:
    from ckptier.storage.s3 import S3Store

    _scan_out_of_range_steps(S3Store(s3_bucket.name, "hot", client=s3_bucket.client), tmp_path)


def test_symlink_loops_are_skipped_and_reported_never_abort_the_scan(tmp_path: Path) -> None:
    root = tmp_path / "hot"
    store = LocalStore(root)
    _guide_step(store, "llm", "00000100")
    _guide_step(store, "llm", "00000200")
    os.symlink("self", root / "llm" / "self")  # a loop of one
    os.symlink("b", root / "llm/step-00000100/rank-0000/a")  # a loop of two, inside a checkpoint
    os.symlink("a", root / "llm/step-00000100/rank-0000/b")
    os.symlink(root, root / "llm/up")  # a directory symlink back to the root: never followed
    os.symlink("nowhere", root / "llm/dangling")
    os.symlink("metadata.json", root / "llm/step-00000200/meta-link.json")  # a symlink to a file is listed

    found = recognise_store(store, now=NOW, name="root", prefetch=0)
    assert [(c.step, c.committed) for c in found.checkpoints] == [(100, True), (200, True)]
    assert "meta-link.json" in {f.relpath for f in found.checkpoints[1].files}
    skipped = {u.key: u.reason for u in found.unrecognised}
    for key in ("llm/self", "llm/step-00000100/rank-0000/a", "llm/step-00000100/rank-0000/b", "llm/up", "llm/dangling"):
        assert key in skipped, skipped
        assert "symlink" in skipped[key] and "not followed" in skipped[key]
    assert "loop" in skipped["llm/self"]
    # A listing of the store alone skips them too, telling whoever asks.
    seen: list[tuple[str, str]] = []
    assert len(list(store.list("", on_skip=lambda key, why: seen.append((key, why))))) == 5
    assert sorted(k for k, _ in seen) == sorted(skipped)
