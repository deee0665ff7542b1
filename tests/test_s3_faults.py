"""S3Store where moto is not S3: faults injected with botocore event hooks.

Every test talks HTTP to a real moto_server. A ``before-send`` hook that
returns a response short-circuits the HTTP call, so botocore's real retry
loop, parsers and error classes run on the injected answer.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from typing import Any
from xml.sax.saxutils import escape

import pytest

from ckptier.storage.base import MAX_DELETE_BATCH, DeleteResult
from ckptier.storage.errors import (
    AccessDenied,
    AlreadyExists,
    DeleteInterrupted,
    IntegrityError,
    NotFound,
    StoreError,
    Unavailable,
    is_transient,
)
from ckptier.storage.hashing import hash_bytes
from ckptier.storage.s3 import CANARY_PREFIX, S3Store
from ckptier.storage.wrappers import RetryingStore
from tests.fixtures.s3 import S3Bucket, S3Server, make_client
from tests.fixtures.services import free_port

pytestmark = pytest.mark.s3

MiB = 1 << 20


class _Raw:
    """The ``raw`` of a fake HTTP response: what botocore reads the body from."""

    def __init__(self, body: bytes) -> None:
        self._body = io.BytesIO(body)

    def stream(self, **_: Any) -> Any:
        yield self._body.read()

    def read(self, amt: int | None = None, **_: Any) -> bytes:
        return self._body.read(amt)

    def close(self) -> None:
        pass


def fake_response(request: Any, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> Any:
    from botocore.awsrequest import AWSResponse

    hdrs = {"Content-Length": str(len(body)), "Content-Type": "application/xml", **(headers or {})}
    return AWSResponse(request.url, status, hdrs, _Raw(body))


def error_xml(code: str, message: str) -> bytes:
    return f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()


def crc(data: bytes) -> str:
    return hash_bytes(data).crc64nvme


@pytest.fixture
def client(s3_bucket: S3Bucket) -> Any:
    """A private client (hooks registered on it stay in this test)."""
    return make_client(s3_bucket.endpoint, retries={"mode": "standard", "total_max_attempts": 3})


@pytest.fixture
def store(s3_bucket: S3Bucket, client: Any) -> S3Store:
    return S3Store(s3_bucket.name, client=client, multipart_threshold=5 * MiB, part_size=5 * MiB)


def hook(client: Any, operation: str, handler: Callable[..., Any]) -> Callable[[], None]:
    """Register ``handler`` on ``before-send.s3.<operation>``; return the remover."""
    event = f"before-send.s3.{operation}"
    client.meta.events.register(event, handler)
    return lambda: client.meta.events.unregister(event, handler)


def keys_in(request: Any) -> list[str]:
    body = request.body if isinstance(request.body, bytes) else request.body.read()
    return re.findall(r"<Key>(.*?)</Key>", body.decode())


# -- throttling ------------------------------------------------------------------


def test_slowdown_storm_is_retried_then_unavailable_then_recovers(store: S3Store, client: Any) -> None:
    store.write("a", b"1")
    sent: list[str] = []

    def slowdown(request: Any, **_: Any) -> Any:
        sent.append(request.url)
        return fake_response(request, 503, error_xml("SlowDown", "Please reduce your request rate."))

    remove = hook(client, "HeadObject", slowdown)
    with pytest.raises(Unavailable) as info:
        store.stat("a")
    assert len(sent) == 3  # botocore's standard mode retried up to max_attempts
    assert is_transient(info.value)
    assert "AWS_ENDPOINT_URL" in str(info.value) and "\n" not in str(info.value)
    assert info.value.__cause__ is not None
    remove()
    assert store.stat("a").size == 1


def test_slowdown_on_delete_batch_reports_nothing_of_that_batch(store: S3Store, client: Any) -> None:
    keys = [f"k/{i:05d}" for i in range(MAX_DELETE_BATCH + 10)]
    store.write(keys[0], b"first batch")
    store.write(keys[-1], b"second batch")
    batches: list[int] = []

    def second_batch_throttled(request: Any, **_: Any) -> Any:
        batches.append(len(keys_in(request)))
        if len(batches) >= 2:
            return fake_response(request, 503, error_xml("SlowDown", "Reduce your request rate."))
        return None

    remove = hook(client, "DeleteObjects", second_batch_throttled)
    with pytest.raises(DeleteInterrupted) as info:
        store.delete_many(keys)
    assert isinstance(info.value.error, Unavailable) and is_transient(info.value)
    assert info.value.__cause__ is info.value.error and str(info.value) == str(info.value.error)
    partial: DeleteResult = info.value.result
    assert sorted(partial.deleted) == keys[:MAX_DELETE_BATCH]  # only the confirmed first batch
    assert store.stat(keys[-1]).size == len(b"second batch")  # the second batch really did not happen
    remove()
    # The next run resumes: deletes are idempotent.
    result = store.delete_many(keys)
    assert sorted(result.deleted) == keys
    with pytest.raises(NotFound):
        store.stat(keys[-1])


def test_retrying_store_resumes_only_unconfirmed_keys(s3_bucket: S3Bucket) -> None:
    """botocore gives up at once here; RetryingStore resends only the unconfirmed batch."""
    once = make_client(s3_bucket.endpoint, retries={"mode": "standard", "total_max_attempts": 1})
    inner = S3Store(s3_bucket.name, client=once)
    keys = [f"r/{i:05d}" for i in range(MAX_DELETE_BATCH + 3)]
    inner.write(keys[-1], b"x")
    seen: list[list[str]] = []

    def throttle_once(request: Any, **_: Any) -> Any:
        seen.append(keys_in(request))
        if len(seen) == 2:
            return fake_response(request, 503, error_xml("SlowDown", "Reduce your request rate."))
        return None

    hook(once, "DeleteObjects", throttle_once)
    sleeps: list[float] = []
    result = RetryingStore(inner, sleep=sleeps.append).delete_many(keys)
    assert sorted(result.deleted) == keys and len(result.deleted) == len(keys)
    assert [len(s) for s in seen] == [MAX_DELETE_BATCH, 3, 3]
    assert seen[2] == keys[MAX_DELETE_BATCH:]
    assert len(sleeps) == 1
    with pytest.raises(NotFound):
        inner.stat(keys[-1])


# -- listing -----------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 4])
def test_listing_is_paginated_and_lazy(s3_bucket: S3Bucket, client: Any, workers: int) -> None:
    store = S3Store(s3_bucket.name, "p", client=client, list_page_size=2, list_workers=workers)
    for i in range(5):
        store.write(f"k{i}", b"x")
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key="p/folder/", Body=b"")  # a console "folder"
    requests: list[str] = []
    hook(client, "ListObjectsV2", lambda request, **_: requests.append(request.url))
    listing = store.list()
    first = next(listing)
    assert len(requests) == 1  # the first key came before the second page was asked for
    rest = list(listing)
    assert sorted(i.key for i in [first, *rest]) == [f"k{i}" for i in range(5)]
    if workers == 1:
        assert len(requests) == 3  # a flat listing: one request per page


# -- DeleteObjects ---------------------------------------------------------------


def test_delete_objects_per_key_errors_only_confirmed_keys_deleted(
    store: S3Store, client: Any, s3_bucket: S3Bucket
) -> None:
    keys = [f"d/{i}" for i in range(6)]
    for k in keys:
        store.write(k, b"x")
    refused = {"d/1", "d/4"}
    real = make_client(s3_bucket.endpoint)

    def partial_failure(request: Any, **_: Any) -> Any:
        asked = keys_in(request)
        allowed = [k for k in asked if k not in refused]
        done = real.delete_objects(Bucket=s3_bucket.name, Delete={"Objects": [{"Key": k} for k in allowed]})
        body = "".join(f"<Deleted><Key>{escape(d['Key'])}</Key></Deleted>" for d in done.get("Deleted", []))
        body += "".join(
            f"<Error><Key>{escape(k)}</Key><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
            for k in asked
            if k in refused
        )
        xml = f'<?xml version="1.0" encoding="UTF-8"?><DeleteResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">{body}</DeleteResult>'
        return fake_response(request, 200, xml.encode())

    hook(client, "DeleteObjects", partial_failure)
    result = store.delete_many(keys)
    assert sorted(result.deleted) == sorted(set(keys) - refused)
    assert set(result.failed) == refused
    assert all("AccessDenied" in reason for reason in result.failed.values())
    assert result.markers_only == []
    assert sorted(i.key for i in store.list()) == sorted(refused)


def test_delete_objects_batches_never_exceed_1000(store: S3Store, client: Any) -> None:
    """moto accepts more than 1,000 keys per request; S3 does not. We batch ourselves."""
    keys = [f"b/{i:05d}" for i in range(2 * MAX_DELETE_BATCH + 1)]
    store.write(keys[1500], b"x")
    sizes: list[int] = []
    hook(client, "DeleteObjects", lambda request, **_: sizes.append(len(keys_in(request))))
    result = store.delete_many(keys)
    assert sizes == [MAX_DELETE_BATCH, MAX_DELETE_BATCH, 1]
    assert sorted(result.deleted) == keys
    assert list(store.list()) == []


def test_versioned_bucket_delete_reports_markers_only(store: S3Store, s3_bucket: S3Bucket) -> None:
    # A delete's own answer says whether it only added a marker (no bucket-wide
    # GetBucketVersioning): unversioned, the object is gone, no marker...
    store.write("v/0", b"unversioned")
    before = store.delete_many(["v/0"])
    assert before.deleted == ["v/0"] and before.markers_only == []
    # ...versioned, the delete only adds a marker.
    s3_bucket.client.put_bucket_versioning(Bucket=s3_bucket.name, VersioningConfiguration={"Status": "Enabled"})
    store.write("v/a", b"version 1")
    store.write("v/a", b"version 2")
    result = store.delete_many(["v/a"])
    assert result.deleted == ["v/a"]
    assert result.markers_only == ["v/a"]  # no space was freed
    assert list(store.list()) == []
    versions = s3_bucket.client.list_object_versions(Bucket=s3_bucket.name)
    assert len(versions.get("Versions", [])) == 2


# -- conditional create ----------------------------------------------------------


@pytest.mark.s3_needs("conditional_multipart_complete")  # elsewhere the HEAD-check is not atomic (documented)
def test_conditional_create_race_loser_gets_already_exists(store: S3Store, client: Any, s3_bucket: S3Bucket) -> None:
    """Another writer completes the same key while our multipart upload is in flight.

    Ours must finish with If-None-Match, get 412 -> AlreadyExists, abort its
    upload and leave the winner's object alone. (The race is sequenced with
    a hook: moto's own conditional check is not atomic under concurrency.)
    """
    rival = S3Store(s3_bucket.name, client=make_client(s3_bucket.endpoint))
    completes: list[str | None] = []

    def rival_wins_first(request: Any, **_: Any) -> None:
        value = request.headers.get("If-None-Match")
        completes.append(value.decode() if isinstance(value, bytes) else value)
        if len(completes) == 1:
            rival.write("marker", b"rival", if_absent=True)

    hook(client, "CompleteMultipartUpload", rival_wins_first)
    with pytest.raises(AlreadyExists):
        store.write("marker", io.BytesIO(b"A" * (6 * MiB)), if_absent=True)
    assert completes == ["*"]
    with store.open_read("marker") as fh:
        assert fh.read() == b"rival"
    assert store.list_multipart_uploads() == []  # the loser's upload was aborted
    with pytest.raises(AlreadyExists):  # and a plain PUT loses the same way
        store.write("marker", b"late", if_absent=True)


def test_lost_ack_retry_gets_already_exists(store: S3Store, client: Any) -> None:
    """The write landed, the answer was lost: the retry's 412 is AlreadyExists, not success.

    The caller must then compare the object (docs/failure-scenarios.md, lost acknowledgements); nothing
    here may report the retried write as done.
    """
    answers: list[int] = []

    def drop_first_answer(**_: Any) -> None:
        answers.append(1)
        if len(answers) == 1:
            raise ConnectionResetError("connection reset after the write landed")

    client.meta.events.register("after-call.s3.PutObject", drop_first_answer)
    with pytest.raises(AlreadyExists):
        RetryingStore(store, sleep=lambda _s: None).write("ack", b"ours", if_absent=True)
    assert len(answers) == 2  # the first answer was lost, the retry met the landed write
    with store.open_read("ack") as fh:
        assert fh.read() == b"ours"


# -- credentials, bucket, endpoint -------------------------------------------------


def test_wrong_credentials_are_access_denied(store: S3Store, client: Any) -> None:
    hook(
        client,
        "ListObjectsV2",
        lambda request, **_: fake_response(
            request, 403, error_xml("InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist.")
        ),
    )
    with pytest.raises(AccessDenied) as info:
        list(store.list())
    message = str(info.value)
    assert "AWS_ACCESS_KEY_ID" in message and "AWS_PROFILE" in message and "\n" not in message
    assert not is_transient(info.value)
    assert info.value.__cause__ is not None


def test_signature_mismatch_is_access_denied(store: S3Store, client: Any) -> None:
    hook(
        client,
        "HeadObject",
        lambda request, **_: fake_response(request, 403, error_xml("SignatureDoesNotMatch", "bad signature")),
    )
    with pytest.raises(AccessDenied):
        store.stat("x")


def test_missing_credentials_are_access_denied(
    s3_env: str, monkeypatch: pytest.MonkeyPatch, s3_bucket: S3Bucket
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    store = S3Store(s3_bucket.name, max_attempts=1)
    with pytest.raises(AccessDenied) as info:
        list(store.list())
    assert "AWS_ACCESS_KEY_ID" in str(info.value) and "\n" not in str(info.value)


def test_missing_bucket_is_not_found(s3_env: str) -> None:
    store = S3Store("ckptier-bucket-that-is-not-there")
    with pytest.raises(NotFound) as info:
        list(store.list())
    assert str(info.value) == "s3://ckptier-bucket-that-is-not-there: bucket does not exist; check the URL"
    assert info.value.__cause__ is not None
    with pytest.raises(NotFound):
        store.write("k", b"x")


def test_unreachable_endpoint_is_unavailable(monkeypatch: pytest.MonkeyPatch, s3_env: str) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", closed)
    store = S3Store("some-bucket", max_attempts=2, connect_timeout=2)
    with pytest.raises(Unavailable) as info:
        store.stat("k")
    message = str(info.value)
    assert closed in message and "AWS_ENDPOINT_URL" in message and "\n" not in message
    assert is_transient(info.value)


def test_environment_picks_endpoint_and_credentials(s3_env: str, s3_bucket: S3Bucket) -> None:
    store = S3Store(s3_bucket.name, "p")
    assert store.endpoint == s3_env
    store.write("k", b"via env")
    assert s3_bucket.client.get_object(Bucket=s3_bucket.name, Key="p/k")["Body"].read() == b"via env"


# -- checksums ---------------------------------------------------------------------


def test_put_stores_full_object_crc64nvme(store: S3Store, s3_server: S3Server) -> None:
    data = b"checkpoint bytes" * 1000
    info = store.write("c/small", data)
    # a server that keeps no checksums (RGW 16.2) reports none: never a value it did not compute
    expected = f"crc64nvme:{crc(data)}" if s3_server.capabilities.stored_checksums else None
    assert info.checksum == expected
    assert store.stat("c/small").checksum == expected


def test_object_without_checksum_has_none(store: S3Store, s3_bucket: S3Bucket) -> None:
    plain = make_client(
        s3_bucket.endpoint, request_checksum_calculation="when_required", response_checksum_validation="when_required"
    )
    plain.put_object(Bucket=s3_bucket.name, Key="c/plain", Body=b"no checksum")
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key="c/crc32", Body=b"boto3 default: CRC32")
    assert store.stat("c/plain").checksum is None
    assert store.stat("c/crc32").checksum is None  # not a CRC64NVME: never reported


def test_etag_is_never_taken_for_a_checksum(store: S3Store, client: Any) -> None:
    store.write("c/e", b"x")

    def composite(request: Any, **_: Any) -> Any:
        return fake_response(
            request,
            200,
            b"",
            {"ETag": '"0123456789abcdef0123456789abcdef-3"', "x-amz-checksum-crc64nvme": "AAAAAAAAAAA=-3",
             "x-amz-checksum-type": "COMPOSITE", "Content-Length": "15"},
        )

    hook(client, "HeadObject", composite)
    info = store.stat("c/e")
    assert info.checksum is None
    assert info.etag is not None


def test_multipart_stream_round_trips_with_full_object_checksum(store: S3Store, client: Any,
                                                                 s3_server: S3Server) -> None:
    data = bytes(range(256)) * (13 * MiB // 256) + b"tail"
    parts: list[int] = []
    hook(client, "UploadPart", lambda request, **_: parts.append(1))
    info = store.write("m/big", io.BytesIO(data))
    assert len(parts) == 3  # 5 + 5 + 3 MiB: really multipart
    assert info.size == len(data)
    stat = store.stat("m/big")
    assert stat.size == len(data)
    assert stat.etag is not None and stat.etag.strip('"').endswith("-3")
    assert stat.checksum == (f"crc64nvme:{crc(data)}" if s3_server.capabilities.stored_checksums else None)
    with store.open_read("m/big") as fh:
        assert fh.read() == data
    assert store.list_multipart_uploads() == []


def test_multipart_if_absent_on_existing_key_aborts_upload(store: S3Store) -> None:
    store.write("m/exists", b"original")
    with pytest.raises(AlreadyExists):
        store.write("m/exists", io.BytesIO(b"z" * (6 * MiB)), if_absent=True)
    with store.open_read("m/exists") as fh:
        assert fh.read() == b"original"
    assert store.list_multipart_uploads() == []


def test_when_required_mode_sends_no_checksum(monkeypatch: pytest.MonkeyPatch, s3_env: str, s3_bucket: S3Bucket) -> None:
    monkeypatch.setenv("CKPTIER_S3_CHECKSUMS", "when_required")
    store = S3Store(s3_bucket.name)
    headers: list[dict[str, str]] = []
    hook(store.client, "PutObject", lambda request, **_: headers.append(dict(request.headers)))
    store.write("w", b"plain")
    assert not any(h.lower().startswith("x-amz-checksum") for h in headers[0])
    assert store.stat("w").checksum is None
    store.canary()


def test_bad_checksum_setting_is_config_error(monkeypatch: pytest.MonkeyPatch, s3_env: str) -> None:
    from ckptier.storage.errors import ConfigError

    monkeypatch.setenv("CKPTIER_S3_CHECKSUMS", "sometimes")
    with pytest.raises(ConfigError, match="CKPTIER_S3_CHECKSUMS"):
        S3Store("some-bucket")


def test_integrity_error_when_body_does_not_match_checksum(store: S3Store, client: Any) -> None:
    store.write("i/obj", b"good bytes")

    def corrupt(request: Any, **_: Any) -> Any:
        return fake_response(
            request,
            200,
            b"evil bytes",
            {"Content-Type": "binary/octet-stream", "x-amz-checksum-crc64nvme": crc(b"good bytes"),
             "x-amz-checksum-type": "FULL_OBJECT"},
        )

    hook(client, "GetObject", corrupt)
    with pytest.raises(IntegrityError):
        with store.open_read("i/obj") as fh:
            fh.read()


# -- multipart janitor & canary ------------------------------------------------------


def test_abandoned_upload_listed_and_aborted(store: S3Store, s3_bucket: S3Bucket) -> None:
    up = s3_bucket.client.create_multipart_upload(Bucket=s3_bucket.name, Key="j/abandoned")
    s3_bucket.client.upload_part(
        Bucket=s3_bucket.name, Key="j/abandoned", UploadId=up["UploadId"], PartNumber=1, Body=b"p" * (5 * MiB)
    )
    uploads = store.list_multipart_uploads()
    assert [(k, u) for k, u, _ in uploads] == [("j/abandoned", up["UploadId"])]
    assert uploads[0][2].tzinfo is not None
    assert store.list_multipart_uploads("other/") == []
    store.abort_multipart("j/abandoned", up["UploadId"])
    assert store.list_multipart_uploads() == []
    store.abort_multipart("j/abandoned", up["UploadId"])  # idempotent
    with pytest.raises(NotFound):
        store.stat("j/abandoned")


def test_failed_source_mid_multipart_aborts_upload(store: S3Store) -> None:
    class Dies(io.RawIOBase):
        def __init__(self) -> None:
            self.sent = 0

        def readable(self) -> bool:
            return True

        def read(self, size: int = -1) -> bytes:
            if self.sent >= 11 * MiB:
                raise OSError("disk read error")
            n = min(size if size >= 0 else MiB, MiB)
            self.sent += n
            return b"d" * n

    with pytest.raises(OSError):
        store.write("m/dies", Dies())  # type: ignore[arg-type]
    assert store.list_multipart_uploads() == []
    with pytest.raises(NotFound):
        store.stat("m/dies")


def test_canary_passes_and_cleans_up(store: S3Store) -> None:
    store.canary()
    assert list(store.list(CANARY_PREFIX)) == []


def test_canary_deletes_canaries_left_by_killed_runs_but_not_a_live_one(store: S3Store) -> None:
    store.write(CANARY_PREFIX + "left-by-a-killed-run", b"ckptier canary\n")
    store.canary()  # the default age keeps a canary seconds old: it may be another run's, live
    assert [i.key for i in store.list(CANARY_PREFIX)] == [CANARY_PREFIX + "left-by-a-killed-run"]
    store.write("data/keep", b"not a canary")
    store.canary(stale_after_s=0)  # as if an hour had passed
    assert list(store.list(CANARY_PREFIX)) == []
    assert store.stat("data/keep").size == len(b"not a canary")


def test_canary_catches_mangled_bytes(store: S3Store, client: Any) -> None:
    def mangled(request: Any, **_: Any) -> Any:
        return fake_response(request, 200, b"aws-chunked framing garbage", {"Content-Type": "binary/octet-stream"})

    hook(client, "GetObject", mangled)
    with pytest.raises(StoreError) as info:
        store.canary()
    assert "CKPTIER_S3_CHECKSUMS=when_required" in str(info.value)
    assert list(store.list(CANARY_PREFIX)) == []


def test_canary_catches_rejected_checksum_headers(store: S3Store, client: Any) -> None:
    def reject(request: Any, **_: Any) -> Any:
        if any(h.lower().startswith("x-amz-checksum") or h.lower() == "x-amz-sdk-checksum-algorithm" for h in request.headers):
            return fake_response(request, 501, error_xml("NotImplemented", "A header you provided implies functionality that is not implemented"))
        return None

    hook(client, "PutObject", reject)
    with pytest.raises(StoreError) as info:
        store.canary()
    assert "CKPTIER_S3_CHECKSUMS=when_required" in str(info.value)
    assert not isinstance(info.value, Unavailable)
