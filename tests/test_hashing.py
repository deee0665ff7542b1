"""Streaming checksums (storage/hashing.py) and the manifest (storage/manifest.py)."""

from __future__ import annotations

import hashlib
import io
import json
import tracemalloc
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptier.storage.hashing import (
    Digests,
    combine,
    decode_crc64nvme,
    encode_crc64nvme,
    hash_bytes,
    hash_file,
    hash_stream,
    is_crc64nvme,
    store_crc64nvme,
)
from ckptier.storage.manifest import (
    MANIFEST_VERSION,
    VERSION_KEY,
    Manifest,
    ManifestError,
    ManifestFile,
    StoredObject,
)
from ckptier.storage.records import CheckpointRecord, FileRecord, Format, State

# The published check value of CRC-64/NVME over b"123456789".
CHECK_VALUE = 0xAE8B14860A799888


# -- hashing ------------------------------------------------------------------


def test_known_vector_and_s3_text_form() -> None:
    d = hash_bytes(b"123456789", sha256=True)
    assert decode_crc64nvme(d.crc64nvme) == CHECK_VALUE
    assert d.crc64nvme == "rosUhgp5mIg="  # base64 of the 8 big-endian bytes, as S3 writes it
    assert d.sha256 == hashlib.sha256(b"123456789").hexdigest()
    assert d.size == 9
    assert hash_bytes(b"").crc64nvme == "AAAAAAAAAAA="


def test_sha256_only_when_asked() -> None:
    assert hash_bytes(b"abc").sha256 is None
    assert hash_stream(io.BytesIO(b"abc")).sha256 is None
    assert hash_stream(io.BytesIO(b"abc"), sha256=True).sha256 == hashlib.sha256(b"abc").hexdigest()


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=5000), bufsize=st.integers(min_value=1, max_value=700))
def test_chunked_stream_equals_one_shot(data: bytes, bufsize: int) -> None:
    """Chunk boundaries never change the digests, whatever the buffer size."""
    whole = hash_bytes(data, sha256=True)
    assert hash_stream(io.BytesIO(data), sha256=True, buffer=bytearray(bufsize)) == whole
    assert whole.sha256 == hashlib.sha256(data).hexdigest()


@settings(max_examples=40, deadline=None)
@given(a=st.binary(max_size=3000), b=st.binary(max_size=3000))
def test_combine_matches_concatenation(a: bytes, b: bytes) -> None:
    """What S3 does with multipart parts: CRC(A) and CRC(B) give CRC(A+B)."""
    assert combine(hash_bytes(a).crc64nvme, hash_bytes(b).crc64nvme, len(b)) == hash_bytes(a + b).crc64nvme


class _ReadOnly:
    """A stream with ``read`` but no ``readinto`` (some HTTP bodies)."""

    def __init__(self, data: bytes) -> None:
        self._inner = io.BytesIO(data)
        self.calls = 0

    def read(self, size: int = -1) -> bytes:
        self.calls += 1
        return self._inner.read(size)


def test_stream_without_readinto() -> None:
    data = bytes(range(256)) * 100
    stream = _ReadOnly(data)
    assert hash_stream(stream, buffer=bytearray(1000)) == hash_bytes(data)
    assert stream.calls == 27  # bounded reads of len(buffer), not one read-all


class _Generated(io.RawIOBase):
    """A raw stream of ``size`` pseudo-random bytes produced on the fly."""

    def __init__(self, size: int) -> None:
        self.left = size
        self.block = hashlib.sha512(b"seed").digest() * 2048  # 128 KiB pattern

    def readable(self) -> bool:
        return True

    def readinto(self, b: memoryview) -> int:  # type: ignore[override]
        n = min(len(b), self.left, len(self.block))
        b[:n] = self.block[:n]
        self.left -= n
        return n


def test_large_stream_hashed_in_bounded_memory() -> None:
    size = 48 << 20
    expected = hash_bytes(hashlib.sha512(b"seed").digest() * 2048 * (size // (128 << 10)))
    buf = bytearray(64 << 10)
    tracemalloc.start()
    try:
        got = hash_stream(_Generated(size), buffer=buf)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == expected
    assert peak < 1 << 20, f"peak {peak} bytes while hashing {size} bytes"


def test_hash_file_matches_stream_and_reports_progress(tmp_path) -> None:
    data = hashlib.sha256(b"x").digest() * 40_000  # 1.28 MB
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    seen: list[int] = []
    d = hash_file(path, sha256=True, buffer=bytearray(100_000), progress=seen.append)
    assert d == hash_bytes(data, sha256=True)
    assert sum(seen) == len(data) and max(seen) <= 100_000
    with pytest.raises(FileNotFoundError):
        hash_file(tmp_path / "absent")


def test_text_form_validation() -> None:
    assert encode_crc64nvme(CHECK_VALUE) == "rosUhgp5mIg="
    assert decode_crc64nvme(encode_crc64nvme(0xFFFFFFFFFFFFFFFF)) == 0xFFFFFFFFFFFFFFFF
    for bad in ("", "rosUhgp5mI", "rosUhgp5mIg", "!!!!!!!!!!!=", "AAAAAAAAAAAAAAAA"):
        assert not is_crc64nvme(bad)
        with pytest.raises(ValueError, match="not base64 of 8 bytes"):
            decode_crc64nvme(bad)
    with pytest.raises(ValueError):
        encode_crc64nvme(1 << 64)
    assert store_crc64nvme(None) is None
    assert store_crc64nvme("crc32:AAAAAA==") is None
    assert store_crc64nvme("crc64nvme:rosUhgp5mIg=") == "rosUhgp5mIg="
    with pytest.raises(ValueError):
        store_crc64nvme("crc64nvme:garbage")


@pytest.mark.s3
@pytest.mark.s3_needs("stored_checksums")
def test_s3_full_object_checksum_equals_ours(s3_bucket) -> None:
    """S3's ChecksumCRC64NVME (single PUT and multipart FULL_OBJECT) equals our value on the same bytes."""
    client, bucket = s3_bucket.client, s3_bucket.name
    small = b"checkpoint bytes " * 1000
    client.put_object(Bucket=bucket, Key="small", Body=small, ChecksumAlgorithm="CRC64NVME")
    head = client.head_object(Bucket=bucket, Key="small", ChecksumMode="ENABLED")
    assert head["ChecksumCRC64NVME"] == hash_bytes(small).crc64nvme

    parts = [bytes([i]) * (5 << 20) for i in (1, 2)] + [b"tail"]
    up = client.create_multipart_upload(Bucket=bucket, Key="big", ChecksumAlgorithm="CRC64NVME", ChecksumType="FULL_OBJECT")
    done = []
    for i, part in enumerate(parts, start=1):
        r = client.upload_part(Bucket=bucket, Key="big", UploadId=up["UploadId"], PartNumber=i, Body=part,
                               ChecksumAlgorithm="CRC64NVME")
        done.append({"PartNumber": i, "ETag": r["ETag"], "ChecksumCRC64NVME": r["ChecksumCRC64NVME"]})
    whole = b"".join(parts)
    client.complete_multipart_upload(Bucket=bucket, Key="big", UploadId=up["UploadId"], MultipartUpload={"Parts": done},
                                     ChecksumCRC64NVME=hash_bytes(whole).crc64nvme, ChecksumType="FULL_OBJECT")
    head = client.head_object(Bucket=bucket, Key="big", ChecksumMode="ENABLED")
    assert head["ChecksumCRC64NVME"] == hash_bytes(whole).crc64nvme
    assert head.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT"


# -- manifest -----------------------------------------------------------------

T0 = datetime(2025, 3, 1, 12, 30, 0, 123456, tzinfo=UTC)


def _file(relpath: str, data: bytes, sha: bool = False) -> ManifestFile:
    d = hash_bytes(data, sha256=sha)
    return ManifestFile(relpath, d.size, d.crc64nvme, d.sha256)


def _manifest(**changes) -> Manifest:
    base = Manifest(
        job="llama-7b",
        step=1200,
        format=Format.GUIDE,
        created_at=T0,
        files=(
            _file("rank-0000/model.pt", b"model", sha=True),
            _file("metadata.json", b"{}"),
            ManifestFile("rank-0000/optimizer.pt", 3, hash_bytes(b"opt").crc64nvme,
                         stored=StoredObject("rank-0000/optimizer.pt.zst", 12, hash_bytes(b"x" * 12).crc64nvme)),
        ),
        codec="zstd-planes",
        codec_params={"level": 1, "planes": True},
        source="file:///data/llama-7b/step-00001200",
        recorded_loss=2.5,
    )
    return replace(base, **changes) if changes else base


def test_manifest_round_trip_and_canonical() -> None:
    m = _manifest()
    data = m.to_json()
    back = Manifest.from_json(data)
    assert back == m
    assert back.to_json() == data
    assert [f.relpath for f in back.files] == sorted(f.relpath for f in m.files)
    assert back.bytes == 5 + 2 + 3
    # The same content in another order and time zone serializes identically.
    shuffled = _manifest(files=tuple(reversed(m.files)), created_at=T0.astimezone(timezone(timedelta(hours=-7))),
                         codec_params={"planes": True, "level": 1})
    assert shuffled.to_json() == data
    assert json.loads(data)[VERSION_KEY] == MANIFEST_VERSION
    assert b'"created_at": "2025-03-01T12:30:00.123456Z"' in data


def test_manifest_plain_copy_round_trip() -> None:
    m = _manifest(codec=None, codec_params={}, source=None, recorded_loss=None,
                  files=(_file("epoch=1-step=10.ckpt", b"abc"),), format=Format.LIGHTNING)
    assert Manifest.from_json(m.to_json()) == m


def _mutated(fn) -> bytes:
    obj = json.loads(_manifest().to_json())
    fn(obj)
    return json.dumps(obj).encode()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda o: o.update({VERSION_KEY: 2}), "version 2 is not supported"),
        (lambda o: o.pop(VERSION_KEY), "not a ckptier manifest"),
        (lambda o: o.update({"new_field": 1}), "unknown fields"),
        (lambda o: o.pop("job"), "lacks"),
        (lambda o: o["files"][0].update({"size": "5"}), r"files\[0\].size"),
        (lambda o: o["files"][0].update({"size": -1}), "non-negative"),
        (lambda o: o["files"][0].update({"crc64nvme": "nope"}), "not base64 of 8 bytes"),
        (lambda o: o["files"][0].update({"sha256": "ABC"}), "64 lowercase hex"),
        (lambda o: o["files"][1].update({"relpath": o["files"][0]["relpath"]}), "listed twice"),
        (lambda o: o["files"][0].update({"relpath": "../escape"}), "'..'"),
        (lambda o: o.update({"bytes": 11}), "bytes is 11"),
        (lambda o: o.update({"format": "tensorflow"}), "format 'tensorflow' is unknown"),
        (lambda o: o.update({"created_at": "2025-03-01T12:30:00"}), "with a zone"),
        (lambda o: o.update({"step": True}), "expected an integer"),
        (lambda o: o["codec"].update({"params": {"x": [1]}}), "JSON scalars"),
    ],
)
def test_manifest_parsing_is_strict(mutate, message: str) -> None:
    with pytest.raises(ManifestError, match=message) as info:
        Manifest.from_json(_mutated(mutate), where="s3://arch/llama/manifest.json")
    text = str(info.value)
    assert text.startswith("s3://arch/llama/manifest.json: ") and "\n" not in text


@pytest.mark.parametrize(
    "data",
    [b"", b"{", b"[]", b"\xff\xfe", b'{"ckptier_manifest": 1, "ckptier_manifest": 1}', b'{"ckptier_manifest": NaN}',
     pytest.param(b"[" * 100_000, id="nested-arrays"),
     pytest.param(b'{"a":' * 50_000 + b"1" + b"}" * 50_000, id="nested-objects"),
     pytest.param(b'{"ckptier_manifest": ' + b"1" * 5000 + b"}", id="5000-digit-integer")],
)
def test_manifest_rejects_non_manifests(data: bytes) -> None:
    with pytest.raises(ManifestError):
        Manifest.from_json(data)


def test_manifest_truncated_is_refused() -> None:
    data = _manifest().to_json()
    with pytest.raises(ManifestError, match="truncated"):
        Manifest.from_json(data[: len(data) // 2])


def test_manifest_constructor_validates() -> None:
    with pytest.raises(ManifestError, match="timezone-aware"):
        _manifest(created_at=datetime(2025, 1, 1))
    with pytest.raises(ManifestError, match="listed twice"):
        _manifest(files=(_file("a", b"1"), _file("a", b"2")))
    with pytest.raises(ManifestError, match="codec_params given without a codec"):
        _manifest(codec=None)


def _record(files: tuple[FileRecord, ...]) -> CheckpointRecord:
    return CheckpointRecord(
        id=1, job="j", step=5, format=Format.GUIDE, state=State.VERIFIED, location="file:///hot/j/step-00000005",
        bytes=sum(f.size for f in files), saved_at=T0, first_seen=T0, last_seen=T0, missing_since=None,
        verified_at=T0, state_reason=None, files=files,
    )


def test_manifest_for_record() -> None:
    a = hash_bytes(b"aaaa", sha256=True)
    rec = _record((FileRecord("a.pt", 4, None, None, a.crc64nvme, a.sha256, "ok", None),))
    m = Manifest.for_record(rec, created_at=T0)
    assert m.files == (ManifestFile("a.pt", 4, a.crc64nvme, a.sha256),)
    assert (m.job, m.step, m.format, m.source) == ("j", 5, Format.GUIDE, rec.location)
    unverified = _record((FileRecord("a.pt", 4, None, None, None, None, None, None),))
    with pytest.raises(ManifestError, match="'a.pt' has no recorded crc64nvme"):
        Manifest.for_record(unverified, created_at=T0)
    with pytest.raises(ManifestError, match="unknown files"):
        Manifest.for_record(rec, created_at=T0, codec="zstd", stored={"b.pt": StoredObject("b", 1, a.crc64nvme)})


def test_digests_is_a_value() -> None:
    assert Digests(1, "AAAAAAAAAAA=") == Digests(1, "AAAAAAAAAAA=", None)
