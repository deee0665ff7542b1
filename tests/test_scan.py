"""Scanning a store: the metadata prefetcher changes speed, never results."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest

from ckptier.storage.errors import AccessDenied, Unavailable
from ckptier.storage.local import LocalStore
from ckptier.storage.wrappers import MeteredStore
from ckptier.tasks.scan import Prefetcher, recognise_store
from tests.fixtures.checkpoints import CheckpointRun

NOW = 4_000_000_000.0  # far after the fixtures were written: everything has settled


class FailingReads(MeteredStore):
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
    one_by_one = MeteredStore(store)
    serial = recognise_store(one_by_one, now=NOW, name="root", prefetch=0)
    metered = FailingReads(store, "", None)
    parallel = recognise_store(metered, now=NOW, name="root", prefetch=16)
    assert parallel == serial
    assert len(serial.checkpoints) == len(run.steps) and all(c.committed for c in serial.checkpoints)
    reads = one_by_one.calls.get("open_read", 0)
    assert metered.calls.get("open_read", 0) == reads  # each marker read once, none wasted
    # Each step's manifest (metadata.json, trainer_state.json, DCP's .metadata) is read by the prefetch threads.
    assert any(t.startswith("ckptier-prefetch") for t in metered.threads)
    assert reads == len(run.steps)


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
