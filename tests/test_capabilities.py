"""Wrappers have an optional capability exactly when the store they wrap has
it, and forward each one explicitly: retried by ``RetryingStore``, passed
through or recorded (never done) by ``DryRunStore``.

Pure: the stores here are a local directory, an ``S3Store`` whose client is
never used (building one sends no request), a store with no capability, and
one with every capability whose calls are counted and can be made to fail.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import pytest
from ckptier.storage.base import (
    CAPABILITIES,
    BucketLocation,
    Canary,
    DeleteResult,
    DirectoryStamps,
    LocalPaths,
    MultipartUploads,
    ObjectInfo,
    RestoreState,
    StorageClasses,
    Store,
    TempFiles,
    WalkedDirs,
)
from ckptier.storage.errors import NotFound, StoreError, Unavailable
from ckptier.storage.local import LocalStore
from ckptier.storage.s3 import S3Store
from ckptier.storage.wrappers import DryRunStore, RetryingStore


class Bare:
    """The Store protocol and nothing else."""

    def __init__(self, inner: LocalStore) -> None:
        self.inner, self.url = inner, inner.url

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def stat(self, key: str) -> ObjectInfo:
        return self.inner.stat(key)

    def open_read(self, key: str) -> BinaryIO:
        return self.inner.open_read(key)

    def write(self, key: str, data: Any, *, if_absent: bool = False) -> ObjectInfo:
        return self.inner.write(key, data, if_absent=if_absent)

    def delete_many(self, keys: Sequence[str]) -> DeleteResult:
        return self.inner.delete_many(keys)


class Everything(Bare):
    """Every optional capability. ``calls`` counts each capability call;
    ``fail[name] = (n, error)`` makes the next ``n`` calls of ``name`` raise ``error``."""

    def __init__(self, inner: LocalStore, storage_class: str | None = None, bucket: str = "b",
                 prefix: str = "runs/") -> None:
        super().__init__(inner)
        self.storage_class = storage_class
        self.bucket, self.prefix = bucket, prefix
        self.calls: dict[str, int] = {}
        self.fail: dict[str, tuple[int, Exception]] = {}
        self.tags: dict[str, dict[str, str]] = {}

    def _call(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        n, error = self.fail.get(name, (0, None))
        if n > 0 and error is not None:
            self.fail[name] = (n - 1, error)
            raise error

    def canary(self) -> None:
        self._call("canary")

    def list_multipart_uploads(self, prefix: str = "") -> list[tuple[str, str, datetime]]:
        self._call("list_multipart_uploads")
        return [("k", "u1", datetime(2026, 1, 1, tzinfo=UTC))]

    def abort_multipart(self, key: str, upload_id: str) -> None:
        self._call("abort_multipart")

    def stale_temp_files(self, older_than: float) -> list[str]:
        self._call("stale_temp_files")
        return [".ckptier-tmp-x"]

    def remove_temp_file(self, key: str) -> None:
        self._call("remove_temp_file")

    def local_path(self, key: str) -> Path:
        self._call("local_path")
        return self.inner.local_path(key)

    def list_with_skips(self, prefix: str, on_skip: Callable[[str, str], None]) -> Iterator[ObjectInfo]:
        self._call("list_with_skips")
        on_skip("dangling", "dangling symlink")
        return self.inner.list(prefix)

    def take_stamp(self, key: str, relpaths: Iterable[str], *, changed_before: float,
                   walked: WalkedDirs | None = None) -> tuple[str, tuple[str, ...]] | None:
        self._call("take_stamp")
        return f"stamp of {key}: {sorted(relpaths)}", ("",)

    def check_stamp(self, key: str, dirs: Sequence[str]) -> str | None:
        self._call("check_stamp")
        return f"stamp of {key}"

    def list_pruned(self, prefix: str, skip_dir: Callable[[str], bool], on_skip: Callable[[str, str], None],
                    on_link: Callable[[str], None], walked: WalkedDirs | None = None) -> Iterator[ObjectInfo]:
        self._call("list_pruned")
        on_skip("dangling", "dangling symlink")
        return self.inner.list_pruned(prefix, skip_dir, on_skip, on_link, walked)

    def open_versioned(self, key: str) -> tuple[BinaryIO, str]:
        self._call("open_versioned")
        return self.inner.open_read(key), "v1"

    def open_from(self, key: str, offset: int, version: str) -> BinaryIO:
        self._call("open_from")
        stream = self.inner.open_read(key)
        stream.seek(offset)
        return stream

    def in_class(self, storage_class: str | None) -> Store:
        self._call("in_class")
        other = Everything(self.inner, storage_class, self.bucket, self.prefix)
        other.calls, other.fail, other.tags = self.calls, self.fail, self.tags
        return other

    def in_bucket(self, bucket: str) -> Store:
        self._call("in_bucket")
        other = Everything(self.inner, self.storage_class, bucket, "")
        other.calls, other.fail, other.tags = self.calls, self.fail, self.tags
        return other

    def restore(self, key: str, *, days: int = 1, tier: str = "Standard") -> RestoreState:
        self._call("restore")
        return "in-progress"

    def put_object_tagging(self, key: str, tags: Mapping[str, str]) -> None:
        self._call("put_object_tagging")
        self.tags.setdefault(key, {}).update(tags)

    def get_object_tagging(self, key: str) -> dict[str, str]:
        self._call("get_object_tagging")
        return dict(self.tags.get(key, {}))

    def delete_proven(self, proven: Sequence[ObjectInfo]) -> DeleteResult:
        self._call("delete_proven")
        return self.inner.delete_proven(proven)


@pytest.fixture
def local(tmp_path: Path) -> LocalStore:
    (tmp_path / "root").mkdir()
    return LocalStore(tmp_path / "root")


def s3_store() -> S3Store:
    import boto3

    client = boto3.client("s3", endpoint_url="http://127.0.0.1:9", region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    return S3Store("never-contacted", "runs", client=client)


def retrying(inner: Store) -> Store:
    return RetryingStore(inner, sleep=lambda _s: None)


WRAPPERS: dict[str, Callable[[Store], Store]] = {
    "retrying": retrying,
    "dry-run": DryRunStore,
    "dry-run(retrying)": lambda s: DryRunStore(retrying(s)),
    "retrying(dry-run)": lambda s: retrying(DryRunStore(s)),
}


def test_the_stores_here_cover_every_capability_both_ways(local: LocalStore) -> None:
    """Guard: each capability is had by some store below and lacked by another."""
    stores = [local, s3_store(), Bare(local), Everything(local)]
    for cap in CAPABILITIES:
        assert any(isinstance(s, cap) for s in stores) and not all(isinstance(s, cap) for s in stores), cap
    assert all(isinstance(s, Store) for s in stores)
    assert {c for c in CAPABILITIES if isinstance(Everything(local), c)} == set(CAPABILITIES)


@pytest.mark.parametrize("cap", CAPABILITIES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("wrapper", WRAPPERS, ids=str)
def test_a_wrapper_has_a_capability_exactly_when_the_wrapped_store_has_it(
    local: LocalStore, wrapper: str, cap: type
) -> None:
    wrap = WRAPPERS[wrapper]
    for inner in (local, s3_store(), Bare(local), Everything(local)):
        wrapped = wrap(inner)
        assert isinstance(wrapped, Store) and wrapped.url == inner.url
        assert isinstance(wrapped, cap) == isinstance(inner, cap), (wrapped, cap)
        if isinstance(wrapped, StorageClasses):  # another class: the same capabilities
            other = wrapped.in_class("GLACIER")
            assert other.storage_class == "GLACIER" and isinstance(other, cap) == isinstance(inner, cap)
        if isinstance(wrapped, BucketLocation):  # another bucket: the same capabilities
            elsewhere = wrapped.in_bucket("inventories")
            assert elsewhere.bucket == "inventories" and elsewhere.prefix == ""  # type: ignore[attr-defined]
            assert isinstance(elsewhere, cap) == isinstance(inner, cap)
            assert type(elsewhere) is type(wrapped)


# -- RetryingStore: every capability retried like any call ---------------------------------

#: (capability method, a call of it through a store); local_path does no I/O and is not retried.
CALLS: list[tuple[str, Callable[[Any], Any]]] = [
    ("canary", lambda s: s.canary()),
    ("list_multipart_uploads", lambda s: s.list_multipart_uploads("")),
    ("abort_multipart", lambda s: s.abort_multipart("k", "u1")),
    ("stale_temp_files", lambda s: s.stale_temp_files(0.0)),
    ("remove_temp_file", lambda s: s.remove_temp_file(".ckptier-tmp-x")),
    ("list_with_skips", lambda s: list(s.list_with_skips("", lambda k, why: None))),
    ("take_stamp", lambda s: s.take_stamp("j/s", iter(["b", "a"]), changed_before=1.0)),
    ("check_stamp", lambda s: s.check_stamp("j/s", [""])),
    ("list_pruned", lambda s: list(s.list_pruned("", lambda d: False, lambda k, why: None, lambda k: None))),
    ("open_versioned", lambda s: s.open_versioned("f")[0].read()),
    ("open_from", lambda s: s.open_from("f", 2, "v1").read()),
    ("restore", lambda s: s.restore("k", days=2, tier="Bulk")),
    ("put_object_tagging", lambda s: s.put_object_tagging("k", {"a": "b"})),
    ("get_object_tagging", lambda s: s.get_object_tagging("k")),
]


@pytest.mark.parametrize(("name", "call"), CALLS, ids=[n for n, _ in CALLS])
def test_retrying_retries_each_capability_and_only_transient_errors(
    local: LocalStore, name: str, call: Callable[[Any], Any]
) -> None:
    local.write("f", b"0123456789")
    inner = Everything(local)
    expected = call(Everything(local))
    inner.fail[name] = (2, Unavailable("SlowDown"))
    assert call(retrying(inner)) == expected
    assert inner.calls[name] == 3
    inner.fail[name] = (1, NotFound("gone"))
    with pytest.raises(NotFound):
        call(retrying(inner))
    assert inner.calls[name] == 4  # a permanent error is not tried again


def test_retrying_tells_each_skipped_entry_once_across_a_restarted_listing(local: LocalStore) -> None:
    for key in ("a", "b", "c"):
        local.write(key, b"x")

    class BreaksOnce(Everything):
        def list_with_skips(self, prefix: str, on_skip: Callable[[str, str], None]) -> Iterator[ObjectInfo]:
            on_skip("dangling", "dangling symlink")
            for n, info in enumerate(self.inner.list(prefix)):
                if n == 1 and self.calls.setdefault("broken", 0) == 0:
                    self.calls["broken"] = 1
                    raise Unavailable("EIO")
                yield info

    told: list[str] = []
    listed = [i.key for i in retrying(BreaksOnce(local)).list_with_skips("", lambda k, why: told.append(k))]
    assert sorted(listed) == ["a", "b", "c"] and told == ["dangling"]


def test_retrying_list_pruned_restarts_and_tells_each_skip_and_link_once(local: LocalStore) -> None:
    for key in ("a", "b", "c"):
        local.write(key, b"x")

    class BreaksOnce(Everything):
        def list_pruned(self, prefix: str, skip_dir: Callable[[str], bool], on_skip: Callable[[str, str], None],
                        on_link: Callable[[str], None], walked: WalkedDirs | None = None) -> Iterator[ObjectInfo]:
            on_skip("dangling", "dangling symlink")
            for n, info in enumerate(self.inner.list(prefix)):
                on_link(info.key)
                if n == 1 and self.calls.setdefault("broken", 0) == 0:
                    self.calls["broken"] = 1
                    raise Unavailable("EIO")
                yield info

    told: list[str] = []
    links: list[str] = []
    store = retrying(BreaksOnce(local))
    assert isinstance(store, DirectoryStamps)
    listed = [i.key for i in store.list_pruned("", lambda d: False, lambda k, why: told.append(k), links.append)]
    assert sorted(listed) == ["a", "b", "c"] and told == ["dangling"] and sorted(links) == ["a", "b", "c"]


def test_retrying_in_bucket_keeps_the_settings(local: LocalStore) -> None:
    sleeps: list[float] = []
    store = RetryingStore(Everything(local), attempts=2, base_delay=1.0, sleep=sleeps.append, rng=lambda: 0.5)
    assert isinstance(store, BucketLocation) and (store.bucket, store.prefix) == ("b", "runs/")
    other = store.in_bucket("inventories")
    assert isinstance(other, RetryingStore) and isinstance(other, BucketLocation) and other.bucket == "inventories"
    inner = other.inner
    assert isinstance(inner, Everything)
    inner.fail["restore"] = (5, Unavailable("SlowDown"))
    with pytest.raises(Unavailable):
        other.restore("k")  # type: ignore[attr-defined]
    assert inner.calls["restore"] == 2 and sleeps == [0.5]


def test_retrying_in_class_keeps_the_settings(local: LocalStore) -> None:
    sleeps: list[float] = []
    store = RetryingStore(Everything(local), attempts=2, base_delay=1.0, sleep=sleeps.append, rng=lambda: 0.5)
    cold = store.in_class("GLACIER")
    assert isinstance(cold, RetryingStore) and cold.storage_class == "GLACIER"
    inner = cold.inner
    assert isinstance(inner, Everything)
    inner.fail["restore"] = (5, Unavailable("SlowDown"))
    with pytest.raises(Unavailable):
        cold.restore("k")  # type: ignore[attr-defined]
    assert inner.calls["restore"] == 2 and sleeps == [0.5]


def test_local_path_passes_through_without_io(local: LocalStore) -> None:
    inner = Everything(local)
    for wrap in WRAPPERS.values():
        store = wrap(inner)
        assert isinstance(store, LocalPaths)
        assert store.local_path("a/b") == local.root / "a" / "b"


# -- DryRunStore: reads pass through, changes are recorded and not done ----------------------


def test_dry_run_passes_reads_through_and_records_every_change(local: LocalStore) -> None:
    inner = Everything(local)
    dry = DryRunStore(inner)
    assert isinstance(dry, Canary) and isinstance(dry, MultipartUploads) and isinstance(dry, TempFiles)
    dry.canary()
    dry.abort_multipart("k", "u1")
    dry.remove_temp_file(".ckptier-tmp-x")
    assert dry.restore("k", days=3, tier="Bulk") == "requested"
    dry.put_object_tagging("k", {"ckptier:retention": "delete"})
    assert not {"canary", "abort_multipart", "remove_temp_file", "restore", "put_object_tagging"} & set(inner.calls)
    assert dry.intended_aborts == [("k", "u1")]
    assert dry.intended_removals == [".ckptier-tmp-x"]
    assert dry.intended_restores == [("k", 3, "Bulk")]
    assert dry.intended_tags == [("k", {"ckptier:retention": "delete"})]
    # What only reads reaches the store.
    assert dry.list_multipart_uploads("") == inner.list_multipart_uploads("")
    assert dry.stale_temp_files(0.0) == [".ckptier-tmp-x"]
    assert dry.get_object_tagging("k") == {}  # nothing was tagged
    told: list[str] = []
    assert list(dry.list_with_skips("", lambda k, why: told.append(k))) == [] and told == ["dangling"]
    assert dry.take_stamp("j", ["f"], changed_before=1.0) == ("stamp of j: ['f']", ("",))
    assert dry.check_stamp("j", [""]) == "stamp of j"
    told.clear()
    assert list(dry.list_pruned("", lambda d: False, lambda k, why: told.append(k), lambda k: None)) == []
    assert told == ["dangling"]
    # Another bucket of the same dry run records into the same lists.
    elsewhere = dry.in_bucket("inventories")
    assert isinstance(elsewhere, DryRunStore) and elsewhere.bucket == "inventories"  # type: ignore[attr-defined]
    elsewhere.delete_many(["x"])
    assert dry.intended_deletes == ["x"]
    # Another class of the same dry run records into the same lists.
    cold = dry.in_class("GLACIER")
    assert isinstance(cold, DryRunStore) and cold.storage_class == "GLACIER"
    cold.write("c", b"12")
    cold.abort_multipart("c", "u2")  # type: ignore[attr-defined]
    assert [w.key for w in dry.intended_writes] == ["c"] and dry.intended_aborts[-1] == ("c", "u2")
    assert list(local.list()) == []


def test_retrying_delete_proven_resends_only_what_was_not_reported(local: LocalStore) -> None:
    for key in ("a", "b", "c"):
        local.write(key, b"x")
    proven = [local.stat(k) for k in ("a", "b", "c")]
    local.write("c", b"another")

    class CutOff(Everything):
        def delete_proven(self, proven: Sequence[ObjectInfo]) -> DeleteResult:
            self._call("delete_proven")
            if self.calls["delete_proven"] == 1:
                from ckptier.storage.errors import DeleteInterrupted

                raise DeleteInterrupted(Unavailable("SlowDown"), self.inner.delete_proven(proven[:1]))
            sent.append([i.key for i in proven])
            return self.inner.delete_proven(proven)

    sent: list[list[str]] = []
    result = RetryingStore(CutOff(local), sleep=lambda _s: None, resume_only=True).delete_proven(proven)  # type: ignore[attr-defined]
    assert sent == [["b", "c"]]
    assert sorted(result.deleted) == ["a", "b"] and list(result.changed) == ["c"]


def test_dry_run_delete_proven_records_only_what_is_still_the_object_proven(local: LocalStore) -> None:
    for key in ("a", "b"):
        local.write(key, b"x")
    proven = [local.stat(k) for k in ("a", "b")]
    local.write("b", b"replaced")
    dry = DryRunStore(local)
    result = dry.delete_proven(proven)  # type: ignore[attr-defined]
    assert result.deleted == ["a"] and list(result.changed) == ["b"] and dry.intended_deletes == ["a"]
    assert sorted(i.key for i in local.list()) == ["a", "b"]


def test_dry_run_refuses_unsafe_keys_in_what_it_records(local: LocalStore) -> None:
    dry = DryRunStore(Everything(local))
    for call in (lambda: dry.remove_temp_file("../x"), lambda: dry.restore("/abs"),  # type: ignore[attr-defined]
                 lambda: dry.put_object_tagging("a//b", {"a": "b"})):  # type: ignore[attr-defined]
        with pytest.raises(StoreError):
            call()
