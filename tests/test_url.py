"""Store URL parsing and ``open_store`` (pure, no server needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptier.storage.errors import ConfigError
from ckptier.storage.local import LocalStore
from ckptier.storage.s3 import S3Store
from ckptier.storage.url import (
    StoreURL,
    bucket_problem,
    canonical_url,
    open_store,
    parse_location,
    parse_url,
)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("/data/ckpt", StoreURL("file", path="/data/ckpt")),
        ("/data/ckpt/", StoreURL("file", path="/data/ckpt")),
        ("/data/./x/../ckpt", StoreURL("file", path="/data/ckpt")),
        ("file:///data/ckpt", StoreURL("file", path="/data/ckpt")),
        ("file:///data/ckpt/", StoreURL("file", path="/data/ckpt")),
        ("file://localhost/data/ckpt", StoreURL("file", path="/data/ckpt")),
        ("file:///data/with%20space", StoreURL("file", path="/data/with space")),
        ("FILE:///data", StoreURL("file", path="/data")),
        ("s3://my-bucket", StoreURL("s3", bucket="my-bucket")),
        ("s3://my-bucket/", StoreURL("s3", bucket="my-bucket")),
        ("s3://my-bucket/runs/job1", StoreURL("s3", bucket="my-bucket", prefix="runs/job1")),
        ("s3://my-bucket/runs/job1/", StoreURL("s3", bucket="my-bucket", prefix="runs/job1")),
        ("s3://my.bucket.01/a%20b", StoreURL("s3", bucket="my.bucket.01", prefix="a b")),
    ],
)
def test_parse(url: str, expected: StoreURL) -> None:
    assert parse_url(url) == expected


def test_relative_path_becomes_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_url("ckpts/run1") == StoreURL("file", path=str(tmp_path / "ckpts" / "run1"))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert parse_url("~/x").path == str(tmp_path / "x")


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("gs://bucket/x", "unsupported scheme 'gs'"),
        ("http://example.com/x", "unsupported scheme 'http'"),
        ("s3://", "no bucket"),
        ("s3:///prefix", "no bucket"),
        ("s3:bucket/x", "malformed"),
        ("s3://UpperCase/x", "invalid"),
        ("s3://ab/x", "invalid"),
        ("s3://under_score", "invalid"),
        ("s3://-leading", "invalid"),
        ("s3://a..b", "invalid"),
        ("s3://192.168.1.10/x", "IP address"),
        ("s3://" + "a" * 64, "invalid"),
        ("s3://bucket/a/../b", "unsafe prefix"),
        ("s3://bucket/a//b", "unsafe prefix"),
        ("s3://bucket/x?versionId=3", "query or fragment"),
        ("s3://bucket/x#frag", "query or fragment"),
        ("file://server/share/ckpt", "names host 'server'"),
    ],
)
def test_bad_urls_are_one_line_config_errors(url: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_url(url)
    message = str(info.value)
    assert needle in message
    assert "\n" not in message
    if url.strip():
        assert repr(url) in message or repr(url.split("://")[1].split("/")[0]) in message


def test_bucket_rules() -> None:
    assert bucket_problem("valid-bucket.name1") is None
    assert bucket_problem("abc") is None
    assert bucket_problem("a" * 63) is None
    assert bucket_problem("a" * 64) is not None
    assert bucket_problem("xn--bucket") is not None
    assert bucket_problem("bucket-s3alias") is not None
    assert bucket_problem("bucket-") is not None


def test_canonical_url_unifies_spellings(tmp_path: Path) -> None:
    assert canonical_url(str(tmp_path)) == canonical_url(tmp_path.as_uri() + "/") == tmp_path.as_uri()
    assert canonical_url("s3://b-1/p/q/") == canonical_url("s3://b-1/p/q") == "s3://b-1/p/q"
    assert canonical_url("s3://b-1/") == "s3://b-1"


def test_open_store_local(tmp_path: Path) -> None:
    store = open_store(tmp_path.as_uri())
    assert isinstance(store, LocalStore)
    assert store.root == tmp_path
    assert store.url == canonical_url(str(tmp_path))
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    with pytest.raises(ConfigError, match="only apply to s3://"):
        open_store(str(tmp_path), multipart_threshold=1)


def test_open_store_s3_builds_no_request(monkeypatch: pytest.MonkeyPatch) -> None:
    # A closed port: building the store must not contact it.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("CKPTIER_S3_CHECKSUMS", raising=False)
    store = open_store("s3://bkt-1/runs/a/", multipart_threshold=8 << 20)
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix, store.url) == ("bkt-1", "runs/a/", "s3://bkt-1/runs/a")
    assert store.multipart_threshold == 8 << 20
    assert store.endpoint == "http://127.0.0.1:9"
    assert store.url == canonical_url("s3://bkt-1/runs/a/")


def test_open_store_s3_unknown_profile_is_config_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="profile 'nope' not found"):
        open_store("s3://bkt-1", profile="nope")


def test_s3_store_rejects_bad_settings() -> None:
    with pytest.raises(ConfigError, match="part_size"):
        S3Store("bkt-1", client=object(), part_size=1 << 20)
    with pytest.raises(ConfigError, match="checksum"):
        S3Store("bkt-1", client=object(), checksum="MD5")
    with pytest.raises(ConfigError, match="unsafe"):
        S3Store("bkt-1", "a/../b", client=object())


ROOT = "file:///data/run%201"  # the canonical URL of /data/run 1


@pytest.mark.parametrize(
    ("location", "roots", "expected"),
    [
        # keys are raw after the store's URL: '%', '#', '?', tab and newline are names, not URL syntax
        ("file:///data/ckpt/a#b/step-1", (), StoreURL("file", path="/data/ckpt/a#b/step-1")),
        ("file:///data/ckpt/q?r/step-1", (), StoreURL("file", path="/data/ckpt/q?r/step-1")),
        ("file:///data/ckpt/t\tab/n\nl", (), StoreURL("file", path="/data/ckpt/t\tab/n\nl")),
        ("file:///data/ckpt/p%41x/step-1", ("file:///data/ckpt",), StoreURL("file", path="/data/ckpt/p%41x/step-1")),
        (f"{ROOT}/p%41x/step-1", (ROOT, "file:///data"), StoreURL("file", path="/data/run 1/p%41x/step-1")),
        (ROOT, (ROOT,), StoreURL("file", path="/data/run 1")),
        # a root that is not a store's canonical URL (a job's raw directory) is passed over
        (f"{ROOT}/p%41x/step-1", (f"{ROOT}/p%41x", ROOT), StoreURL("file", path="/data/run 1/p%41x/step-1")),
        # no root known: a location holding '%' is read as a URL, as before
        (f"{ROOT}/llm/step-1", (), StoreURL("file", path="/data/run 1/llm/step-1")),
        ("s3://bkt/runs/a#b/p%41x/t\tq?r", (), StoreURL("s3", bucket="bkt", prefix="runs/a#b/p%41x/t\tq?r")),
        ("s3://bkt", (), StoreURL("s3", bucket="bkt")),
        ("/data/ckpt", (), StoreURL("file", path="/data/ckpt")),
    ],
)
def test_parse_location_never_decodes_a_key(location: str, roots: tuple[str, ...], expected: StoreURL) -> None:
    # parse_url refused '#' and '?', dropped tabs and decoded '%41': verify found such checkpoints
    # corrupt (files "not found"), and apply and the janitor stopped for every job.
    assert parse_location(location, roots) == expected


def test_parse_location_refuses_a_bad_bucket() -> None:
    with pytest.raises(ConfigError, match="bucket name 'B_ad'"):
        parse_location("s3://B_ad/x")
