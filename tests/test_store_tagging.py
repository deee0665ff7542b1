"""The Taggable capability (``put_object_tagging`` / ``get_object_tagging``),
run against every taggable store and wrapper over moto and Ceph RGW; and the
stores that cannot tag say so through the protocol."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from ckptier.storage.base import MAX_TAGS, Store, Taggable
from ckptier.storage.errors import ConfigError, InvalidKey, NotFound
from ckptier.storage.local import LocalStore
from ckptier.storage.s3 import S3Store
from ckptier.storage.wrappers import DryRunStore, RetryingStore

from tests.fixtures.s3 import S3Bucket


class TaggableContract:
    """Tests every taggable store must pass. Subclasses provide ``store`` and
    ``raw_tags(key)``: the tags as the backend itself reports them."""

    @pytest.fixture
    def store(self) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    def raw_tags(self, key: str) -> dict[str, str]:  # pragma: no cover - overridden
        raise NotImplementedError

    def test_is_taggable(self, store: Any) -> None:
        assert isinstance(store, Taggable) and isinstance(store, Store)

    def test_untagged_object_has_no_tags(self, store: Any) -> None:
        store.write("job/step-1/model.pt", b"m")
        assert store.get_object_tagging("job/step-1/model.pt") == {}

    def test_put_adds_and_reads_back(self, store: Any) -> None:
        store.write("job/step-1/model.pt", b"m")
        store.put_object_tagging("job/step-1/model.pt", {"ckptier:retention": "delete"})
        assert store.get_object_tagging("job/step-1/model.pt") == {"ckptier:retention": "delete"}
        assert self.raw_tags("job/step-1/model.pt") == {"ckptier:retention": "delete"}

    def test_put_keeps_other_tags_and_overwrites_same_keys(self, store: Any) -> None:
        store.write("k", b"x")
        store.put_object_tagging("k", {"team": "llm", "ckptier:retention": "keep"})
        store.put_object_tagging("k", {"ckptier:retention": "delete"})
        assert self.raw_tags("k") == {"team": "llm", "ckptier:retention": "delete"}

    def test_put_is_idempotent(self, store: Any) -> None:
        store.write("k", b"x")
        for _ in range(2):
            store.put_object_tagging("k", {"ckptier:retention": "delete"})
        assert store.get_object_tagging("k") == {"ckptier:retention": "delete"}

    def test_tagging_leaves_the_bytes_alone(self, store: Any) -> None:
        from ckptier.storage.base import read_bytes

        store.write("k", b"payload")
        store.put_object_tagging("k", {"a": "b"})
        assert read_bytes(store, "k") == b"payload"

    def test_missing_object_raises_not_found(self, store: Any) -> None:
        with pytest.raises(NotFound):
            store.put_object_tagging("no/such/key", {"a": "b"})
        with pytest.raises(NotFound):
            store.get_object_tagging("no/such/key")

    def test_unsafe_key_is_refused(self, store: Any) -> None:
        with pytest.raises(InvalidKey):
            store.put_object_tagging("../escape", {"a": "b"})

    def test_limits_are_checked_before_any_request(self, store: Any) -> None:
        store.write("k", b"x")
        store.put_object_tagging("k", {f"t{i}": "v" for i in range(MAX_TAGS - 1)})
        with pytest.raises(ConfigError, match="at most 10"):
            store.put_object_tagging("k", {"one": "more", "and": "another"})
        with pytest.raises(ConfigError, match="reserved"):
            store.put_object_tagging("k", {"aws:x": "y"})
        with pytest.raises(ConfigError, match="1-128 characters"):
            store.put_object_tagging("k", {"x" * 129: "y"})
        assert len(self.raw_tags("k")) == MAX_TAGS - 1  # nothing half-written


def _s3(bucket: S3Bucket, prefix: str = "") -> S3Store:
    return S3Store(bucket.name, prefix, client=bucket.client)


@pytest.mark.s3
class TestS3StoreTagging(TaggableContract):
    @pytest.fixture
    def store(self, s3_bucket: S3Bucket) -> Any:
        self.bucket, self.prefix = s3_bucket, ""
        return _s3(s3_bucket)

    def raw_tags(self, key: str) -> dict[str, str]:
        answer = self.bucket.client.get_object_tagging(Bucket=self.bucket.name, Key=self.prefix + key)
        return {t["Key"]: t["Value"] for t in answer["TagSet"]}


@pytest.mark.s3
class TestS3StoreWithPrefixTagging(TestS3StoreTagging):
    @pytest.fixture
    def store(self, s3_bucket: S3Bucket) -> Any:
        self.bucket, self.prefix = s3_bucket, "runs/a/"
        return _s3(s3_bucket, "runs/a")


@pytest.mark.s3
class TestRetryingS3StoreTagging(TestS3StoreTagging):
    @pytest.fixture
    def store(self, s3_bucket: S3Bucket) -> Any:
        self.bucket, self.prefix = s3_bucket, ""
        return RetryingStore(_s3(s3_bucket), sleep=lambda _s: None)


@pytest.mark.s3
def test_a_tagged_object_is_still_the_object_proven(s3_bucket: S3Bucket) -> None:
    """Tagging is metadata: after ckptier's own tag the object is the one it looked at before,
    on every server (RGW moves Last-Modified on PutObjectTagging; S3 and moto do not)."""
    from ckptier.storage.records import FileRecord
    from ckptier.storage.transitions import file_change

    store = _s3(s3_bucket)
    store.write("step-00000001/model.pt", b"weights")
    (before,) = list(store.list("step-00000001/"))
    catalogued = FileRecord("model.pt", before.size, before.mtime, before.etag, None, None, "ok", None)
    time.sleep(1.1)  # Last-Modified has whole seconds: a moved one shows
    store.put_object_tagging("step-00000001/model.pt", {"ckptier:retention": "delete"})
    (listed,) = list(store.list("step-00000001/"))
    assert file_change(catalogued, listed) is None
    assert file_change(catalogued, store.stat("step-00000001/model.pt")) is None
    store.write("step-00000001/model.pt", b"WEIGHTS")  # same size, other bytes: a replacement shows
    assert file_change(catalogued, store.stat("step-00000001/model.pt")) == (
        f"model.pt etag {before.etag} -> {store.stat('step-00000001/model.pt').etag}")


@pytest.mark.s3
def test_versioned_bucket_tags_the_current_version(s3_bucket: S3Bucket) -> None:
    c = s3_bucket.client
    c.put_bucket_versioning(Bucket=s3_bucket.name, VersioningConfiguration={"Status": "Enabled"})
    store = _s3(s3_bucket)
    store.write("k", b"v1")
    store.write("k", b"v2")
    store.put_object_tagging("k", {"ckptier:retention": "delete"})
    versions = c.list_object_versions(Bucket=s3_bucket.name, Prefix="k")["Versions"]
    tags = {
        v["IsLatest"]: c.get_object_tagging(Bucket=s3_bucket.name, Key="k", VersionId=v["VersionId"])["TagSet"]
        for v in versions
    }
    assert tags == {True: [{"Key": "ckptier:retention", "Value": "delete"}], False: []}


@pytest.mark.s3
def test_dry_run_records_tags_and_changes_nothing(s3_bucket: S3Bucket) -> None:
    inner = _s3(s3_bucket)
    inner.write("k", b"x")
    dry = DryRunStore(inner)
    assert isinstance(dry, Taggable)
    dry.put_object_tagging("k", {"ckptier:retention": "delete"})
    assert dry.intended_tags == [("k", {"ckptier:retention": "delete"})]
    assert dry.get_object_tagging("k") == {}  # reads pass through; nothing was tagged
    with pytest.raises(InvalidKey):
        dry.put_object_tagging("a//b", {"a": "b"})


def test_stores_that_cannot_tag_are_not_taggable(tmp_path: Path) -> None:
    local = LocalStore(tmp_path)
    for store in (local, RetryingStore(local), DryRunStore(local)):
        assert isinstance(store, Store) and not isinstance(store, Taggable)
