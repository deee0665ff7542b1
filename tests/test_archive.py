"""Promote to the archive tier, read back, commit marker, fetch, janitor.

Local-directory tests run everywhere; the S3 tests talk HTTP to a real
``moto_server`` process (``tests/fixtures/s3.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from ckptier.storage.base import DeleteResult, ObjectInfo, Store, as_stream
from ckptier.storage.errors import IntegrityError, NotFound, Unavailable
from ckptier.storage.hashing import hash_bytes
from ckptier.storage.local import LocalStore
from ckptier.storage.manifest import Manifest
from ckptier.storage.records import CheckpointRecord, CopyRecord, FileRecord, Format, State, Tier
from ckptier.storage.wrappers import RetryingStore
from ckptier.tasks.archive import (
    ArchiveConflict,
    UploadMarker,
    data_key,
    fetch,
    janitor,
    manifest_key,
    promote,
    upload_marker_key,
)

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


# ------------------------------------------------------------------------ helpers


def payloads(seed: int = 0) -> dict[str, bytes]:
    """A small guide-layout checkpoint: incompressible, compressible and empty files."""
    rnd = __import__("random").Random(seed)
    return {
        "rank-0000/model.pt": rnd.randbytes(300_000),
        "rank-0000/optimizer.pt": bytes(range(256)) * 2000 + rnd.randbytes(1000),
        "metadata.json": json.dumps({"step": 100, "seed": seed}).encode(),
        "empty.bin": b"",
    }


def write_hot(root: Path, prefix: str, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        p = root / prefix / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


def make_record(
    files: dict[str, bytes],
    *,
    job: str = "llm",
    step: int = 100,
    location: str = "file:///hot/llm/step-00000100",
    state: State = State.VERIFIED,
    record_crc: bool = True,
    copies: Sequence[CopyRecord] | None = None,
    cid: int = 1,
) -> CheckpointRecord:
    recs = tuple(
        FileRecord(
            relpath=rel,
            size=len(data),
            mtime=None,
            etag=None,
            crc64nvme=hash_bytes(data).crc64nvme if record_crc else None,
            sha256_expected=None,
            status="ok",
            detail=None,
        )
        for rel, data in sorted(files.items())
    )
    return CheckpointRecord(
        id=cid,
        job=job,
        step=step,
        format=Format.GUIDE,
        state=state,
        location=location,
        bytes=sum(len(d) for d in files.values()),
        saved_at=NOW,
        first_seen=NOW,
        last_seen=NOW,
        missing_since=None,
        verified_at=NOW,
        state_reason=None,
        files=recs,
        copies=tuple(copies) if copies is not None else (CopyRecord(Tier.HOT, location, "present", None, NOW),),
    )


def with_archive(record: CheckpointRecord, url: str) -> CheckpointRecord:
    from dataclasses import replace

    return replace(record, copies=record.copies + (CopyRecord(Tier.ARCHIVE, url, "present", 1, NOW, "ckz1"),))


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under root with its bytes and mtime (ns), to prove nothing changed."""
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def setup(tmp_path: Path) -> tuple[LocalStore, str, CheckpointRecord, LocalStore, dict[str, bytes]]:
    files = payloads()
    hot_root = tmp_path / "hot"
    prefix = "llm/step-00000100"
    write_hot(hot_root, prefix, files)
    hot = LocalStore(hot_root)
    record = make_record(files, location=f"{hot.url}/{prefix}")
    archive = LocalStore(tmp_path / "archive")
    return hot, prefix, record, archive, files


class PassThroughStore:
    """Hands every call to ``inner``; the fakes below override what they break."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.url = inner.url

    def list(self, prefix: str = "") -> Any:
        return self.inner.list(prefix)

    def stat(self, key: str) -> ObjectInfo:
        return self.inner.stat(key)

    def open_read(self, key: str) -> BinaryIO:
        return self.inner.open_read(key)

    def write(self, key: str, data: bytes | BinaryIO, *, if_absent: bool = False) -> ObjectInfo:
        return self.inner.write(key, data, if_absent=if_absent)

    def delete_many(self, keys: Sequence[str]) -> DeleteResult:
        return self.inner.delete_many(keys)


class CorruptingStore(PassThroughStore):
    """Breaks the ``read()`` contract on the way in: stores only the first bytes of each data object.

    Like a stream wrapper that turned a 64 MiB stream into a 2 MiB object
    without an error: the write "succeeds".
    """

    def __init__(self, inner: Store, *, keep: int | None = 64, flip: bool = False) -> None:
        super().__init__(inner)
        self.keep = keep
        self.flip = flip

    def write(self, key: str, data: bytes | BinaryIO, *, if_absent: bool = False) -> ObjectInfo:
        if key.endswith(".ckz"):
            raw = as_stream(data).read()
            if self.flip:
                mid = len(raw) // 2
                raw = raw[:mid] + bytes([raw[mid] ^ 0x01]) + raw[mid + 1 :]
            else:
                raw = raw[: self.keep]
            return self.inner.write(key, raw, if_absent=if_absent)
        return self.inner.write(key, data, if_absent=if_absent)


class LostAckStore(PassThroughStore):
    """The first manifest write lands but its acknowledgement is lost (raises Unavailable)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.lost = 0

    def write(self, key: str, data: bytes | BinaryIO, *, if_absent: bool = False) -> ObjectInfo:
        info = self.inner.write(key, data, if_absent=if_absent)
        if key.endswith("ckptier-manifest.json") and self.lost == 0:
            self.lost += 1
            raise Unavailable(f"{self.url}/{key}: connection reset before the response (injected)")
        return info


# ------------------------------------------------------------------ promote, local


def test_promote_writes_data_then_manifest_and_fetch_returns_original_bytes(setup: Any, tmp_path: Path) -> None:
    hot, prefix, record, archive, files = setup
    before = snapshot(hot.root)
    copy = promote(hot, prefix, record, archive, now=NOW, owner="run-1")

    assert copy.url == f"{archive.url}/llm/step-00000100"
    assert copy.manifest_key == "llm/step-00000100/ckptier-manifest.json"
    assert copy.verified_at == NOW and not copy.already_archived
    assert copy.raw_bytes == sum(len(d) for d in files.values())
    keys = {i.key for i in archive.list()}
    assert keys == {data_key("llm", 100, r) for r in files} | {manifest_key("llm", 100), upload_marker_key("llm", 100)}
    assert copy.stored_bytes == sum(archive.stat(data_key("llm", 100, r)).size for r in files)
    # The compressible file really got smaller; the manifest describes the originals.
    assert archive.stat(data_key("llm", 100, "rank-0000/optimizer.pt")).size < len(files["rank-0000/optimizer.pt"]) // 2
    m = Manifest.from_json((archive.root / copy.manifest_key).read_bytes())
    assert (m.job, m.step, m.format) == ("llm", 100, Format.GUIDE)
    assert {f.relpath: (f.size, f.crc64nvme) for f in m.files} == {
        r: (len(d), hash_bytes(d).crc64nvme) for r, d in files.items()
    }
    assert m.codec == copy.codec
    # The hot copy is untouched, byte for byte and by mtime.
    assert snapshot(hot.root) == before

    dest = tmp_path / "restored"
    res = fetch(with_archive(record, copy.url), hot=None, archive=archive, dest=dest)
    assert res.tier == "archive"
    for rel, data in files.items():
        assert (dest / rel).read_bytes() == data
    assert not [p for p in dest.rglob(".ckptier-fetch-*")]


def test_promote_again_is_idempotent_and_uploads_nothing(setup: Any) -> None:
    hot, prefix, record, archive, _ = setup
    first = promote(hot, prefix, record, archive, now=NOW, owner="run-1")
    stamps = {i.key: archive.stat(i.key).mtime for i in archive.list()}
    again = promote(hot, prefix, record, archive, now=NOW + timedelta(hours=1), owner="run-2")
    assert again.already_archived
    assert (again.url, again.stored_bytes, again.manifest_key) == (first.url, first.stored_bytes, first.manifest_key)
    assert {i.key: archive.stat(i.key).mtime for i in archive.list()} == stamps


def test_lost_acknowledgement_of_the_manifest_counts_as_archived(setup: Any) -> None:
    hot, prefix, record, archive, _ = setup
    flaky = LostAckStore(archive)
    retrying = RetryingStore(flaky, attempts=3, base_delay=0.0, sleep=lambda s: None)
    copy = promote(hot, prefix, record, retrying, now=NOW, owner="run-1")
    assert flaky.lost == 1  # the first manifest write landed, its answer was lost, the retry got "exists"
    assert copy.already_archived
    assert archive.stat(copy.manifest_key).size > 0


def test_committed_manifest_with_other_content_is_a_conflict_and_nothing_is_written(setup: Any) -> None:
    hot, prefix, record, archive, files = setup
    other = dict(files, **{"rank-0000/model.pt": b"different bytes"})
    other_root = hot.root.parent / "other"
    write_hot(other_root, prefix, other)
    promote(LocalStore(other_root), prefix, make_record(other), archive, now=NOW, owner="run-0")
    stamps = snapshot(archive.root)
    with pytest.raises(ArchiveConflict, match="different content"):
        promote(hot, prefix, record, archive, now=NOW, owner="run-1")
    assert snapshot(archive.root) == stamps


def test_manifest_appearing_during_upload_with_other_content_is_a_conflict(setup: Any) -> None:
    hot, prefix, record, archive, files = setup
    rival = make_record(dict(files, **{"metadata.json": b"{}"}))

    class RacingStore(PassThroughStore):
        def write(self, key: str, data: bytes | BinaryIO, *, if_absent: bool = False) -> ObjectInfo:
            if key.endswith("ckptier-manifest.json"):  # another run commits first
                theirs = Manifest.for_record(rival, created_at=NOW, codec="ckz1")
                self.inner.write(key, theirs.to_json(), if_absent=True)
            return self.inner.write(key, data, if_absent=if_absent)

    with pytest.raises(ArchiveConflict):
        promote(hot, prefix, record, RacingStore(archive), now=NOW, owner="run-1")
    m = Manifest.from_json((archive.root / manifest_key("llm", 100)).read_bytes())
    assert m.file("metadata.json").size == 2  # theirs stays


@pytest.mark.parametrize("mode", ["short", "flip"])
def test_upload_that_stored_other_bytes_is_caught_by_read_back(setup: Any, mode: str) -> None:
    hot, prefix, record, archive, _ = setup
    before = snapshot(hot.root)
    bad = CorruptingStore(archive, keep=64) if mode == "short" else CorruptingStore(archive, flip=True)
    with pytest.raises(IntegrityError, match="not committed|does not decode|read-back"):
        promote(hot, prefix, record, bad, now=NOW, owner="run-1")
    with pytest.raises(NotFound):
        archive.stat(manifest_key("llm", 100))
    assert snapshot(hot.root) == before


def test_hot_bytes_that_differ_from_the_catalog_are_not_archived(setup: Any) -> None:
    hot, prefix, record, archive, files = setup
    p = hot.root / prefix / "rank-0000/model.pt"
    raw = bytearray(p.read_bytes())
    raw[1000] ^= 0xFF
    p.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="differs from the catalog"):
        promote(hot, prefix, record, archive, now=NOW, owner="run-1")
    with pytest.raises(NotFound):
        archive.stat(manifest_key("llm", 100))


def test_only_verified_checkpoints_are_promoted(setup: Any) -> None:
    hot, prefix, record, archive, _ = setup
    from dataclasses import replace

    with pytest.raises(IntegrityError, match="only verified"):
        promote(hot, prefix, replace(record, state=State.COMMITTED), archive, now=NOW, owner="run-1")
    assert not archive.root.exists()


# -------------------------------------------------------------------------- fetch


def test_fetch_prefers_the_verified_hot_copy(setup: Any, tmp_path: Path) -> None:
    hot, prefix, record, archive, files = setup
    res = fetch(record, hot=hot, archive=None, dest=tmp_path / "d")
    assert res.tier == "hot" and res.bytes == sum(len(d) for d in files.values())
    assert all((tmp_path / "d" / r).read_bytes() == d for r, d in files.items())


def test_fetch_falls_back_to_the_archive_when_the_hot_copy_is_damaged(setup: Any, tmp_path: Path) -> None:
    hot, prefix, record, archive, files = setup
    copy = promote(hot, prefix, record, archive, now=NOW, owner="run-1")
    (hot.root / prefix / "metadata.json").write_bytes(b"{\"tampered\": 1}")
    res = fetch(with_archive(record, copy.url), hot=hot, archive=archive, dest=tmp_path / "d")
    assert res.tier == "archive"
    assert any("hot copy failed" in n for n in res.notes)
    assert all((tmp_path / "d" / r).read_bytes() == d for r, d in files.items())


def test_fetch_of_a_corrupt_archive_object_writes_nothing_and_says_why(setup: Any, tmp_path: Path) -> None:
    hot, prefix, record, archive, _ = setup
    copy = promote(hot, prefix, record, archive, now=NOW, owner="run-1")
    obj = archive.root / data_key("llm", 100, "rank-0000/model.pt")
    raw = bytearray(obj.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    obj.write_bytes(bytes(raw))
    from dataclasses import replace

    gone_hot = replace(with_archive(record, copy.url), copies=(CopyRecord(Tier.ARCHIVE, copy.url, "present", 1, NOW),))
    dest = tmp_path / "d"
    with pytest.raises(IntegrityError, match="job llm step 100: no tier gave verified bytes"):
        fetch(gone_hot, hot=hot, archive=archive, dest=dest)
    assert not (dest / "rank-0000/model.pt").exists()
    assert not list(dest.rglob(".ckptier-fetch-*"))


def test_fetch_with_no_tier_is_a_one_line_not_found(setup: Any, tmp_path: Path) -> None:
    _, _, record, _, _ = setup
    with pytest.raises(NotFound) as err:
        fetch(record, hot=None, archive=None, dest=tmp_path / "d")
    assert "\n" not in str(err.value) and "job llm step 100" in str(err.value)


# ------------------------------------------------------------------------ janitor


def _age(path: Path, seconds: float) -> None:
    t = NOW.timestamp() - seconds
    os.utime(path, (t, t))


def mark_upload(store: Store, job: str, step: int, *relpaths: str) -> None:
    """Write the upload marker an interrupted promotion of job/step would have left."""
    marker = UploadMarker(job, step, "run-0", NOW, tuple(r + ".ckz" for r in relpaths))
    store.write(upload_marker_key(job, step), marker.to_json())


def test_janitor_removes_only_old_uncommitted_step_dirs(setup: Any) -> None:
    hot, prefix, record, archive, _ = setup
    promote(hot, prefix, record, archive, now=NOW, owner="run-1")
    root = archive.root
    # Debris of an interrupted promotion, old, and of one still running, young.
    (root / "llm/step-00000200").mkdir(parents=True)
    (root / "llm/step-00000200/model.pt.ckz").write_bytes(b"x" * 10)
    mark_upload(archive, "llm", 200, "model.pt")
    (root / "llm/step-00000300").mkdir(parents=True)
    (root / "llm/step-00000300/model.pt.ckz").write_bytes(b"y" * 10)
    mark_upload(archive, "llm", 300, "model.pt")
    # An old stray file inside the committed directory must survive too.
    (root / "llm/step-00000100/stray.ckz").write_bytes(b"z")
    for p in root.rglob("*"):
        if p.is_file():
            _age(p, 3 * 86400)
    _age(root / "llm/step-00000300/model.pt.ckz", 60)

    rep = janitor(archive, now=NOW, older_than=timedelta(days=1))
    assert rep.removed_dirs == ["llm/step-00000200"]
    assert rep.young_dirs == ["llm/step-00000300"]
    assert rep.committed_dirs == 1
    assert not (root / "llm/step-00000200").exists()
    assert (root / "llm/step-00000300/model.pt.ckz").exists()
    assert (root / "llm/step-00000100/stray.ckz").exists()
    assert (root / manifest_key("llm", 100)).exists()
    # Idempotent.
    again = janitor(archive, now=NOW, older_than=timedelta(days=1))
    assert again.removed_dirs == [] and again.young_dirs == ["llm/step-00000300"]


@pytest.mark.parametrize("marker", [b"[" * 100_000, b'{"ckptier": "upload", "step": ' + b"9" * 5000 + b"}"],
                         ids=["nested", "5000-digit-integer"])
def test_janitor_leaves_a_dir_whose_upload_marker_is_hostile(setup: Any, marker: bytes) -> None:
    # Deeply nested JSON raised RecursionError (a traceback, the janitor stopped) instead of
    # "not a marker ckptier wrote".
    _, _, _, archive, _ = setup
    archive.write(upload_marker_key("llm", 200), marker)
    archive.write("llm/step-00000200/model.pt.ckz", b"x")
    for p in archive.root.rglob("*"):
        if p.is_file():
            _age(p, 3 * 86400)
    rep = janitor(archive, now=NOW, older_than=timedelta(days=1))
    assert rep.removed_keys == [] and "llm/step-00000200/model.pt.ckz" in rep.not_ours
    with pytest.raises(ValueError, match="unreadable upload marker"):
        UploadMarker.from_json(marker, where="m")


def test_janitor_never_removes_a_file_ckptier_did_not_write(setup: Any) -> None:
    hot, prefix, record, archive, _ = setup
    promote(hot, prefix, record, archive, now=NOW, owner="run-1")
    root = archive.root
    # Checkpoints copied in by hand (or a hot tier mistaken for the archive): no upload marker.
    for step in (200, 300):
        for rel in ("rank-0000/model.pt", "metadata.json"):
            (root / f"llm/step-{step:08d}/{rel}").parent.mkdir(parents=True, exist_ok=True)
            (root / f"llm/step-{step:08d}/{rel}").write_bytes(b"precious")
    (root / "notes.txt").write_bytes(b"mine")
    # An interrupted promotion's debris next to a file it did not write: only the debris goes.
    (root / "llm/step-00000400").mkdir(parents=True)
    (root / "llm/step-00000400/model.pt.ckz").write_bytes(b"debris")
    (root / "llm/step-00000400/README").write_bytes(b"someone else's")
    mark_upload(archive, "llm", 400, "model.pt")
    for p in root.rglob("*"):
        if p.is_file():
            _age(p, 30 * 86400)

    rep = janitor(archive, now=NOW, older_than=timedelta(hours=1))
    assert rep.removed_dirs == [] and rep.removed_temp_files == []
    assert sorted(rep.removed_keys) == ["llm/step-00000400/.ckptier/upload.json", "llm/step-00000400/model.pt.ckz"]
    for step in (200, 300):
        assert (root / f"llm/step-{step:08d}/rank-0000/model.pt").read_bytes() == b"precious"
    assert (root / "notes.txt").read_bytes() == b"mine"
    assert (root / "llm/step-00000400/README").exists()
    assert set(rep.not_ours) == {"notes.txt", "llm/step-00000200/metadata.json", "llm/step-00000200/rank-0000/model.pt",
                                 "llm/step-00000300/metadata.json", "llm/step-00000300/rank-0000/model.pt",
                                 "llm/step-00000400/README"}


class UploadsStore(LocalStore):
    """A local store that also has unfinished multipart uploads, like S3."""

    def __init__(self, root: Path, uploads: list[tuple[str, str, datetime]]) -> None:
        super().__init__(root)
        self.uploads = uploads
        self.aborted: list[tuple[str, str]] = []

    def list_multipart_uploads(self, prefix: str = "") -> list[tuple[str, str, datetime]]:
        return [u for u in self.uploads if u[0].startswith(prefix)]

    def abort_multipart(self, key: str, upload_id: str) -> None:
        self.aborted.append((key, upload_id))


def test_janitor_aborts_only_our_uploads_older_than_the_threshold(tmp_path: Path) -> None:
    store = UploadsStore(
        tmp_path,
        [("a/step-00000001/x.ckz", "old", NOW - timedelta(hours=5)), ("a/step-00000002/x.ckz", "new", NOW - timedelta(minutes=5)),
         ("a/step-00000003/x.ckz", "foreign", NOW - timedelta(days=5))],
    )
    mark_upload(store, "a", 1, "x")
    mark_upload(store, "a", 2, "x")
    rep = janitor(store, now=NOW, older_than=timedelta(hours=1))
    assert rep.aborted_uploads == [("a/step-00000001/x.ckz", "old")] == store.aborted
    assert rep.not_ours == ["a/step-00000003/x.ckz (multipart upload foreign)"]


# ----------------------------------------------------------------------------- S3


def s3_store(bucket: Any, prefix: str = "archive", **kw: Any) -> Any:
    from ckptier.storage.s3 import S3Store

    kw.setdefault("multipart_threshold", 1 << 20)
    kw.setdefault("part_size", 5 << 20)
    return S3Store(bucket.name, prefix, client=bucket.client, **kw)


@pytest.mark.s3
def test_promote_to_s3_multipart_reads_back_and_fetches(s3_bucket: Any, tmp_path: Path) -> None:
    files = {"model.pt": os.urandom(6 << 20), "config.json": b'{"a": 1}'}
    write_hot(tmp_path / "hot", "llm/step-00000100", files)
    hot = LocalStore(tmp_path / "hot")
    record = make_record(files, location=f"{hot.url}/llm/step-00000100")
    archive = s3_store(s3_bucket)
    copy = promote(hot, "llm/step-00000100", record, archive, now=NOW, owner="run-1")
    assert copy.url == f"s3://{s3_bucket.name}/archive/llm/step-00000100"
    listed = s3_bucket.client.list_objects_v2(Bucket=s3_bucket.name, Prefix="archive/")
    assert sorted(o["Key"] for o in listed["Contents"]) == [
        "archive/llm/step-00000100/.ckptier/upload.json",
        "archive/llm/step-00000100/ckptier-manifest.json",
        "archive/llm/step-00000100/config.json.ckz",
        "archive/llm/step-00000100/model.pt.ckz",
    ]
    # The big file went multipart (its ETag says so: "<md5>-<parts>"), and was still verified.
    head = s3_bucket.client.head_object(Bucket=s3_bucket.name, Key="archive/llm/step-00000100/model.pt.ckz")
    assert head["ETag"].strip('"').endswith("-2")
    # Committed only once: a second conditional create of the marker is refused.
    again = promote(hot, "llm/step-00000100", record, archive, now=NOW, owner="run-2")
    assert again.already_archived
    res = fetch(with_archive(record, copy.url), hot=None, archive=archive, dest=tmp_path / "out")
    assert res.tier == "archive"
    assert (tmp_path / "out/model.pt").read_bytes() == files["model.pt"]


_KILL_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from datetime import datetime, timezone
    from ckptier.storage.local import LocalStore
    from ckptier.storage.records import *
    from ckptier.storage.s3 import S3Store
    from ckptier.tasks.archive import promote
    from tests.fixtures.s3 import make_client
    from tests.test_archive import make_record, payloads

    endpoint, bucket, hot_root, prefix = sys.argv[1:5]
    client = make_client(endpoint)
    def slow(request, **kw):
        if "partNumber=2" in request.url:
            time.sleep(60)   # the network stalls on the second part: we get killed here
    client.meta.events.register("before-send.s3.UploadPart", slow)
    archive = S3Store(bucket, "archive", client=client, multipart_threshold=5 << 20, part_size=5 << 20)
    hot = LocalStore(hot_root)
    data = open(hot_root + "/" + prefix + "/model.pt", "rb").read()
    record = make_record({"model.pt": data}, location=hot.url + "/" + prefix)
    promote(hot, prefix, record, archive, now=datetime.now(timezone.utc), owner="doomed")
    print("finished?!")
    """
)


@pytest.mark.s3
def test_sigkill_mid_multipart_leaves_no_archive_copy_and_janitor_aborts_it(s3_bucket: Any, tmp_path: Path) -> None:
    prefix = "llm/step-00000100"
    files = {"model.pt": os.urandom(12 << 20)}
    write_hot(tmp_path / "hot", prefix, files)
    before = snapshot(tmp_path / "hot")
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILL_SCRIPT, s3_bucket.endpoint, s3_bucket.name, str(tmp_path / "hot"), prefix],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    client = s3_bucket.client
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            uploads = client.list_multipart_uploads(Bucket=s3_bucket.name).get("Uploads", [])
            if uploads:
                parts = client.list_parts(Bucket=s3_bucket.name, Key=uploads[0]["Key"], UploadId=uploads[0]["UploadId"])
                if parts.get("Parts"):
                    break
            time.sleep(0.05)
        else:
            pytest.fail("the first part never appeared")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None and proc.returncode is None:
            proc.kill()  # never leave the uploader behind, whatever failed above
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    # No archive object and no manifest are visible, only the upload marker; the hot copy is intact.
    visible = [o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket.name).get("Contents", [])]
    assert visible == ["archive/llm/step-00000100/.ckptier/upload.json"]
    assert snapshot(tmp_path / "hot") == before
    archive = s3_store(s3_bucket)
    stuck = archive.list_multipart_uploads()
    assert [k for k, _, _ in stuck] == ["llm/step-00000100/model.pt.ckz"]

    # An hour after the kill the upload is stale on every server (moto reports a fixed 2010 "Initiated"
    # time, RGW the real one); the age rule itself is tested below with a fake.
    rep = janitor(archive, now=datetime.now(UTC) + timedelta(hours=2), older_than=timedelta(hours=1))
    assert [k for k, _ in rep.aborted_uploads] == ["llm/step-00000100/model.pt.ckz"]
    assert archive.list_multipart_uploads() == []


@pytest.mark.s3
def test_janitor_on_s3_removes_uncommitted_dirs_but_never_committed_ones(s3_bucket: Any, tmp_path: Path) -> None:
    files = payloads(1)
    write_hot(tmp_path / "hot", "llm/step-00000100", files)
    hot = LocalStore(tmp_path / "hot")
    archive = s3_store(s3_bucket)
    promote(hot, "llm/step-00000100", make_record(files), archive, now=NOW, owner="run-1")
    archive.write("llm/step-00000200/model.pt.ckz", b"partial")
    mark_upload(archive, "llm", 200, "model.pt")
    archive.write("llm/step-00000300/model.pt", b"copied in by hand")
    later = datetime.now(UTC) + timedelta(days=2)
    rep = janitor(archive, now=later, older_than=timedelta(days=1))
    assert rep.removed_dirs == ["llm/step-00000200"] and rep.committed_dirs == 1
    assert rep.not_ours == ["llm/step-00000300/model.pt"]
    left = {i.key for i in archive.list()}
    assert manifest_key("llm", 100) in left and not any(k.startswith("llm/step-00000200") for k in left)
    assert "llm/step-00000300/model.pt" in left


# ---------------------------------------------------------------- an archive must never overlap a hot tier


@pytest.mark.parametrize(
    ("archive", "hot", "how"),
    [
        ("/data/ckpt", "/data/ckpt", "equals"),
        ("/data/ckpt/", "file:///data/ckpt", "equals"),
        ("/data", "/data/ckpt", "contains"),
        ("/data/ckpt/archive", "/data/ckpt", "lies inside"),
        ("/data/ckpt-archive", "/data/ckpt", None),  # a sibling whose name starts alike is apart
        ("/archive", "/data/ckpt", None),
        ("s3://bkt/archive", "s3://bkt/hot", None),
        ("s3://bkt", "s3://bkt/hot", "contains"),
        ("s3://bkt/hot/cold", "s3://bkt/hot/", "lies inside"),
        ("s3://other/hot", "s3://bkt/hot", None),
        ("s3://bkt/hot", "/bkt/hot", None),
    ],
)
def test_location_overlap(archive: str, hot: str, how: str | None) -> None:
    from ckptier.tasks.config import location_overlap

    assert location_overlap(archive, hot) == how


@pytest.mark.parametrize("where", ["equal", "inside", "symlink"])
def test_janitor_and_apply_refuse_an_archive_overlapping_a_scanned_hot_location(
    tmp_path: Path, where: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptier.flows.cli import main
    from ckptier.storage.errors import ConfigError
    from ckptier.tasks.config import Config
    from ckptier.tasks.pipeline import run_apply, run_janitor
    from ckptier.tasks.retention import KeepLast, Policy
    from ckptier.tasks.run import Run

    from tests.test_apply import build_world

    world = build_world(tmp_path, f"sqlite:///{tmp_path / 'catalog.db'}", steps=(100, 200, 300, 400, 500))
    hot = world.hot.root
    archive = {"equal": hot, "inside": hot / "llm" / "archive", "symlink": tmp_path / "alias"}[where]
    if where == "symlink":
        os.symlink(hot, archive)  # another spelling of the hot directory
    before = snapshot(hot)
    config = Config(policies=(Policy(rules=(KeepLast(2),), archive=str(archive)),))
    later = datetime.now(UTC) + timedelta(days=2)  # everything looks old enough to clean
    with pytest.raises(ConfigError) as err:
        run_janitor(Run.of(world.catalog, config=config, now=lambda: later), older_than=timedelta(hours=1))
    message = str(err.value)
    assert "\n" not in message and f'archive = "{archive}"' in message and world.hot.url in message
    with pytest.raises(ConfigError, match="outside every scanned location"):
        run_apply(Run.of(world.catalog, config=config, now=lambda: later, owner="run-1"))
    assert snapshot(hot) == before  # nothing touched
    # The command line says it in one line and exits 2.
    toml = tmp_path / "ckptier.toml"
    toml.write_text(f'[[policy]]\nkeep_last = 2\narchive = "{archive}"\n')
    monkeypatch.setenv("CKPTIER_CATALOG_URL", world.url)
    monkeypatch.setenv("CKPTIER_CONFIG", str(toml))
    assert main(["janitor", "--older-than", "1s"]) == 2
    _, stderr = capsys.readouterr()
    assert stderr.count("\n") == 1 and "hot location" in stderr and str(toml) in stderr
    assert snapshot(hot) == before
    world.catalog.close()
