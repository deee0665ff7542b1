"""The fast path for listed objects (``storage/s3.py``,
:func:`listing_parser_factory`) parses every ListObjectsV2 page exactly as
botocore's own parser does: compared on real responses of the test server
and on hand-written pages with the elements the fast path leaves to botocore."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

import pytest
from ckptier.storage.s3 import S3Store, fast_timestamp, listing_parser_factory

from tests.fixtures.s3 import S3Bucket, S3Server, make_client

KEYS = [
    "job/step-00000001/model.pt",
    "job/step-00000001/metadata.json",
    "job/step-00000002/a&b <c> \"d\" 'e'.pt",
    "job/step-00000002/ünï cödé/ß.bin",
    "job/step-00000002/space name.pt",
    "job/empty.bin",
    "top-level.txt",
]


def _parsers() -> tuple[Any, Any]:
    from botocore.parsers import RestXMLParser

    return RestXMLParser(timestamp_parser=fast_timestamp), listing_parser_factory().create_parser("rest-xml")


def _output_shape() -> Any:
    import botocore.session

    model = botocore.session.get_session().get_service_model("s3")
    return model.operation_model("ListObjectsV2").output_shape


def _both(body: bytes, status: int = 200) -> tuple[Any, Any]:
    stock, fast = _parsers()
    shape = _output_shape()
    response = {"status_code": status, "headers": {"x-amz-request-id": "r1"}, "body": body}
    return stock.parse(dict(response), shape), fast.parse(dict(response), shape)


@pytest.fixture
def filled(s3_bucket: S3Bucket) -> S3Bucket:
    client = s3_bucket.client
    for i, key in enumerate(KEYS):
        extra: dict[str, Any] = {"ChecksumAlgorithm": "CRC32"} if i % 2 else {}
        client.put_object(Bucket=s3_bucket.name, Key=key, Body=b"x" * (i * 7), **extra)
    return s3_bucket


def test_real_listing_pages_parse_as_botocore_parses_them(filled: S3Bucket, s3_server: S3Server) -> None:
    client = make_client(filled.endpoint)
    bodies: list[bytes] = []

    def keep(response_dict: dict[str, Any], **_: Any) -> None:
        bodies.append(response_dict["body"])

    client.meta.events.register("before-parse.s3.ListObjectsV2", keep)
    asks: list[dict[str, Any]] = [
        {},
        {"MaxKeys": 2},
        {"Delimiter": "/"},
        {"Prefix": "job/", "Delimiter": "/"},
        {"EncodingType": "url"},
        {"FetchOwner": True},  # Owner elements: botocore's parser
        {"Prefix": "nothing/"},
        {"StartAfter": "job/step-00000002/"},
    ]
    for ask in asks:
        client.list_objects_v2(Bucket=filled.name, **ask)
    assert len(bodies) == len(asks)
    for ask, body in zip(asks, bodies, strict=True):
        stock, fast = _both(body)
        assert fast == stock, ask
    listed = _both(bodies[0])[1]["Contents"]
    assert [unquote(o["Key"]) for o in listed] == sorted(KEYS)  # boto3 asks for URL-encoded keys, then decodes
    # a server that keeps checksums lists their algorithm (one more element for the fast path)
    assert any("ChecksumAlgorithm" in o for o in listed) == s3_server.capabilities.stored_checksums


@pytest.mark.parametrize(
    "obj",
    [
        "<Key>a</Key><LastModified>2026-11-30T15:03:29.000Z</LastModified><ETag>\"e\"</ETag><Size>7</Size>"
        "<StorageClass>GLACIER_IR</StorageClass><ChecksumAlgorithm>CRC32</ChecksumAlgorithm>"
        "<ChecksumAlgorithm>CRC64NVME</ChecksumAlgorithm><ChecksumType>FULL_OBJECT</ChecksumType>",
        "<Key>a</Key><ETag></ETag><Size>0</Size>",  # an empty element is "", not None
        "<Key>a</Key><Size>1</Size><Owner><ID>x</ID><DisplayName>y</DisplayName></Owner>",  # nested: botocore
        "<Key>a</Key><RestoreStatus><IsRestoreInProgress>true</IsRestoreInProgress></RestoreStatus>",
        "<Key>a</Key><Size>1</Size><SomethingNew>z</SomethingNew>",  # unknown: botocore
        "<Key>a&amp;b</Key><LastModified>2026-01-02T03:04:05+00:00</LastModified>",
    ],
)
def test_each_kind_of_listed_object_parses_as_botocore_parses_it(obj: str) -> None:
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>'
        '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        "<Name>b</Name><Prefix></Prefix><KeyCount>2</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>"
        f"<Contents>{obj}</Contents><Contents><Key>z</Key><Size>3</Size></Contents>"
        "</ListBucketResult>"
    ).encode()
    stock, fast = _both(body)
    assert fast == stock
    assert fast["Contents"][1] == {"Key": "z", "Size": 3}


def test_a_repeated_element_is_left_to_botocore() -> None:
    body = (b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><IsTruncated>false</IsTruncated>'
            b"<Contents><Key>a</Key><Key>b</Key><Size>1</Size></Contents></ListBucketResult>")
    stock, fast = _both(body)
    (s_obj,), (f_obj,) = stock["Contents"], fast["Contents"]
    assert f_obj["Size"] == s_obj["Size"] == 1
    assert [e.text for e in f_obj["Key"]] == [e.text for e in s_obj["Key"]] == ["a", "b"]  # botocore's own odd result


def test_an_error_page_is_botocores_error() -> None:
    body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NoSuchBucket</Code>'
            b"<Message>The specified bucket does not exist</Message></Error>")
    stock, fast = _both(body, status=404)
    assert fast == stock and fast["Error"]["Code"] == "NoSuchBucket"


def test_a_store_lists_through_the_fast_path(filled: S3Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    store = S3Store(filled.name, endpoint_url=filled.endpoint)
    factory = store.client._endpoint._response_parser_factory
    assert factory is listing_parser_factory()
    fast = {i.key: (i.size, i.mtime, i.etag, i.storage_class) for i in store.list("")}
    plain = S3Store(filled.name, client=filled.client)  # a client built by boto3 alone
    assert fast == {i.key: (i.size, i.mtime, i.etag, i.storage_class) for i in plain.list("")}
    assert sorted(fast) == sorted(KEYS)
