"""What real S3 servers answer that moto does not, and that ckptier's errors name the fix.

Against Ceph RGW (``tests.fixtures.rgw``): a storage class the server does not
offer (400 InvalidArgument), HTTPS with a self-signed certificate
(``AWS_CA_BUNDLE``) where boto3's default trailing checksums get 411
MissingContentLength until ``CKPTIER_S3_CHECKSUMS=when_required``. And the
capability probe itself, on both servers.
"""

from __future__ import annotations

import io
from typing import Any

import pytest

from ckptier.storage.errors import StoreError
from ckptier.storage.s3 import S3Store
from tests.fixtures.s3 import S3Bucket, S3Server, make_client

pytestmark = pytest.mark.s3


@pytest.mark.s3_servers("moto", "rgw")
def test_capabilities_are_what_each_server_is_known_to_do(s3_server: S3Server) -> None:
    caps = s3_server.capabilities
    if s3_server.name == "moto":
        assert caps.stored_checksums and caps.conditional_multipart_complete and caps.restore
    else:  # Ceph RGW 16.2
        assert not caps.stored_checksums and not caps.conditional_multipart_complete and not caps.restore


@pytest.mark.s3_servers("rgw")
def test_a_storage_class_the_server_lacks_names_the_class_and_the_policy_key(s3_bucket: S3Bucket) -> None:
    store = S3Store(s3_bucket.name, client=s3_bucket.client, storage_class="ONEZONE_IA")
    with pytest.raises(StoreError) as err:
        store.write("c/obj", b"cold")
    message = str(err.value)
    assert "InvalidArgument" in message and "'ONEZONE_IA'" in message and "storage_class" in message
    assert "\n" not in message
    S3Store(s3_bucket.name, client=s3_bucket.client, storage_class="STANDARD_IA").write("c/obj", b"cold")


@pytest.fixture
def https(rgw_server: Any, s3_env: str, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """(HTTPS endpoint, a fresh bucket) on the session's RGW, trusted through AWS_CA_BUNDLE."""
    if not rgw_server.https_endpoint:
        pytest.skip("RGW has no HTTPS endpoint (openssl missing)")
    monkeypatch.setenv("AWS_CA_BUNDLE", rgw_server.ca_bundle)
    monkeypatch.setenv("AWS_ENDPOINT_URL", rgw_server.https_endpoint)
    bucket = "ckptier-https-" + __import__("uuid").uuid4().hex[:12]
    make_client(rgw_server.endpoint).create_bucket(Bucket=bucket)
    return rgw_server.https_endpoint, bucket


@pytest.mark.s3_servers("rgw")
def test_https_with_default_checksums_names_the_setting_and_works_with_it(
    https: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint, bucket = https
    store = S3Store(bucket, endpoint_url=endpoint, max_attempts=1)
    with pytest.raises(StoreError) as err:
        store.write("big", io.BytesIO(b"x" * (6 << 20)), if_absent=False)
    assert "CKPTIER_S3_CHECKSUMS=when_required" in str(err.value)
    monkeypatch.setenv("CKPTIER_S3_CHECKSUMS", "when_required")
    store = S3Store(bucket, endpoint_url=endpoint, max_attempts=1, multipart_threshold=5 << 20, part_size=5 << 20)
    store.canary()
    payload = bytes(range(256)) * (24 << 12)  # 6 MiB: a multipart upload
    store.write("big", io.BytesIO(payload))
    with store.open_read("big") as fh:
        assert fh.read() == payload
