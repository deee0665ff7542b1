"""Promotion streams each file from the encoder into the archive store (no spool) and overlaps
files: a failure mid-stream commits nothing, memory stays bounded, overlapped files all prove out.

Local-directory tests run everywhere; the S3 tests talk HTTP to a real ``moto_server`` process
(``tests/fixtures/s3.py``).
"""

from __future__ import annotations

import io
import os
import random
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any, BinaryIO

import pytest
import torch

from ckptier.storage import codec
from ckptier.storage.base import ObjectInfo, Store
from ckptier.storage.errors import IntegrityError, NotFound, Unavailable
from ckptier.storage.hashing import hash_bytes
from ckptier.storage.local import TEMP_PREFIX, LocalStore
from ckptier.storage.manifest import Manifest
from ckptier.tasks.archive import BLOCK_SIZE, data_key, manifest_key, promote

from tests.test_archive import NOW, PassThroughStore, make_record, s3_store, write_hot

PREFIX = "llm/step-00000100"


def tensor_file(n: int, seed: int) -> bytes:
    """A ``torch.save`` of fp32 and bf16 tensors (``n`` fp32 elements): the codec's byte-plane path."""
    g = torch.Generator().manual_seed(seed)
    buf = io.BytesIO()
    torch.save({"w": torch.randn(n, generator=g) * 0.02, "h": torch.randn(n // 4, generator=g).bfloat16()}, buf)
    return buf.getvalue()


def several_files() -> dict[str, bytes]:
    rnd = random.Random(7)
    return {
        "rank-0000/model.pt": tensor_file(600_000, 1),
        "rank-0001/model.pt": tensor_file(500_000, 2),
        "rank-0002/model.pt": tensor_file(700_000, 3),
        "noise.bin": rnd.randbytes(3 << 20),
        "zeros.bin": bytes(2 << 20),
        "metadata.json": b'{"step": 100}',
        "empty.bin": b"",
    }


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(TEMP_PREFIX)]


class _BreaksAfter(io.RawIOBase):
    """A hot file's stream whose connection drops after ``after`` bytes."""

    def __init__(self, inner: BinaryIO, after: int) -> None:
        super().__init__()
        self._inner, self._left = inner, after

    def readable(self) -> bool:
        return True

    def readinto(self, view: Any) -> int:
        if self._left <= 0:
            time.sleep(0.3)  # what was read by now is encoded and written on meanwhile: the store is mid-object
            raise Unavailable("hot read: connection reset (injected)")
        n = self._inner.readinto(memoryview(view)[: min(len(view), self._left)])  # type: ignore[attr-defined]
        self._left -= n or 0
        return n or 0

    def close(self) -> None:
        self._inner.close()
        super().close()


class BreakingHot(PassThroughStore):
    """A hot store whose read of ``key`` breaks off after ``after`` bytes."""

    def __init__(self, inner: Store, key: str, after: int) -> None:
        super().__init__(inner)
        self.key, self.after = key, after

    def open_read(self, key: str) -> BinaryIO:
        stream = self.inner.open_read(key)
        if key == self.key:
            return _BreaksAfter(stream, self.after)  # type: ignore[return-value]
        return stream


class CountingArchive(PassThroughStore):
    """Counts the bytes each write pulled from its stream (and records when writes and reads ran)."""

    def __init__(self, inner: Store, read_delay: float = 0.0) -> None:
        super().__init__(inner)
        self.pulled: dict[str, int] = {}
        self.events: list[tuple[str, str, float]] = []
        self.read_delay = read_delay
        self._lock = threading.Lock()

    def _log(self, what: str, key: str) -> None:
        with self._lock:
            self.events.append((what, key, time.monotonic()))

    def write(self, key: str, data: bytes | BinaryIO, *, if_absent: bool = False) -> ObjectInfo:
        if isinstance(data, (bytes, bytearray, memoryview)):
            return self.inner.write(key, data, if_absent=if_absent)
        archive = self
        stream = data

        class Counted(io.RawIOBase):
            def readable(self) -> bool:
                return True

            def read(self, size: int | None = -1) -> bytes:
                chunk = stream.read(-1 if size is None else size)
                with archive._lock:
                    archive.pulled[key] = archive.pulled.get(key, 0) + len(chunk)
                return chunk

        self._log("write-start", key)
        try:
            return self.inner.write(key, Counted(), if_absent=if_absent)  # type: ignore[arg-type]
        finally:
            self._log("write-end", key)

    def open_read(self, key: str) -> BinaryIO:
        self._log("read-start", key)
        if key.endswith(".ckz") and self.read_delay:
            time.sleep(self.read_delay)  # a slow read-back: the next files go on meanwhile
        data = self.inner.open_read(key).read()
        self._log("read-end", key)
        return io.BytesIO(data)


# ------------------------------------------------------------------ a failure mid-stream


def test_a_hot_read_error_mid_encoding_leaves_no_object_and_no_temp_file(tmp_path: Path) -> None:
    files = several_files()
    write_hot(tmp_path / "hot", PREFIX, files)
    hot = LocalStore(tmp_path / "hot")
    record = make_record(files, location=f"{hot.url}/{PREFIX}")
    archive = LocalStore(tmp_path / "archive")
    victim = "rank-0001/model.pt"
    broken = BreakingHot(hot, f"{PREFIX}/{victim}", after=len(files[victim]) * 3 // 4)
    counting = CountingArchive(archive)
    with pytest.raises(Unavailable, match="connection reset"):
        promote(broken, PREFIX, record, counting, now=NOW, owner="run-1", threads=2)
    dkey = data_key("llm", 100, victim)
    assert counting.pulled[dkey] > BLOCK_SIZE // 4  # the store had written part of it: a failure mid-stream
    assert not (archive.root / dkey).exists()
    assert temp_files(archive.root) == []
    with pytest.raises(NotFound):
        archive.stat(manifest_key("llm", 100))

    # a re-run finishes the work: every object proven, the manifest committed, nothing left over
    copy = promote(hot, PREFIX, record, archive, now=NOW, owner="run-2", threads=2)
    assert not copy.already_archived
    assert temp_files(archive.root) == []
    for rel, data in files.items():
        out = io.BytesIO()
        with archive.open_read(data_key("llm", 100, rel)) as src:
            codec.decode(src, out)
        assert out.getvalue() == data, rel


def test_hot_bytes_that_changed_leave_no_object_of_that_file(tmp_path: Path) -> None:
    files = several_files()
    write_hot(tmp_path / "hot", PREFIX, files)
    hot = LocalStore(tmp_path / "hot")
    record = make_record(files, location=f"{hot.url}/{PREFIX}")
    changed = tmp_path / "hot" / PREFIX / "rank-0002/model.pt"
    raw = bytearray(changed.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    changed.write_bytes(bytes(raw))
    archive = LocalStore(tmp_path / "archive")
    with pytest.raises(IntegrityError, match="differs from the catalog"):
        promote(hot, PREFIX, record, archive, now=NOW, owner="run-1")
    assert not (archive.root / data_key("llm", 100, "rank-0002/model.pt")).exists()
    assert temp_files(archive.root) == []
    assert not (archive.root / manifest_key("llm", 100)).exists()


@pytest.mark.s3
def test_a_hot_read_error_mid_multipart_upload_leaves_no_object_and_no_upload(s3_bucket: Any, tmp_path: Path) -> None:
    files = {"model.pt": os.urandom(12 << 20), "config.json": b'{"a": 1}'}
    write_hot(tmp_path / "hot", PREFIX, files)
    hot = LocalStore(tmp_path / "hot")
    record = make_record(files, location=f"{hot.url}/{PREFIX}")
    archive = s3_store(s3_bucket, multipart_threshold=5 << 20, part_size=5 << 20)
    broken = BreakingHot(hot, f"{PREFIX}/model.pt", after=11 << 20)  # two parts are uploaded by then
    parts_sent: list[int] = []

    def count(**_: Any) -> None:
        parts_sent.append(1)

    s3_bucket.client.meta.events.register("before-send.s3.UploadPart", count)
    try:
        with pytest.raises(Unavailable, match="connection reset"):
            promote(broken, PREFIX, record, archive, now=NOW, owner="run-1")
    finally:
        s3_bucket.client.meta.events.unregister("before-send.s3.UploadPart", count)
    assert len(parts_sent) >= 2  # it failed mid-upload, not before
    assert archive.list_multipart_uploads() == []  # aborted
    with pytest.raises(NotFound):
        archive.stat(data_key("llm", 100, "model.pt"))
    with pytest.raises(NotFound):
        archive.stat(manifest_key("llm", 100))

    copy = promote(hot, PREFIX, record, archive, now=NOW, owner="run-2")
    assert not copy.already_archived and archive.list_multipart_uploads() == []
    out = io.BytesIO()
    with archive.open_read(data_key("llm", 100, "model.pt")) as src:
        codec.decode(src, out)
    assert out.getvalue() == files["model.pt"]


# ------------------------------------------------------------------ bounded memory


def test_memory_stays_bounded_on_a_file_much_larger_than_the_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    big = tensor_file(16_000_000, 4)  # about 72 MB
    files = {"rank-0000/model.pt": big, "rank-0001/model.pt": tensor_file(2_000_000, 5), "metadata.json": b"{}"}
    write_hot(tmp_path / "hot", PREFIX, files)
    hot = LocalStore(tmp_path / "hot")
    record = make_record(files, location=f"{hot.url}/{PREFIX}")
    archive = LocalStore(tmp_path / "archive")
    # no buffers kept from earlier codec calls: every buffer this promotion uses is allocated (and traced) here
    monkeypatch.setattr(codec, "_SPARES", codec._Spares())
    tracemalloc.start()
    try:
        promote(hot, PREFIX, record, archive, now=NOW, owner="run-1", threads=2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # one encoder (blocks in flight, two workers' scratch) and one decoder at a time, whatever the size
    bound = 40 * BLOCK_SIZE + (8 << 20)
    assert peak < bound < len(big) // 2, f"traced peak {peak / 2**20:.1f} MiB"


# ------------------------------------------------------------------ overlap


def test_overlapped_files_are_each_written_before_read_back_and_all_prove_out(tmp_path: Path) -> None:
    files = several_files()
    write_hot(tmp_path / "hot", PREFIX, files)
    hot = LocalStore(tmp_path / "hot")
    record = make_record(files, location=f"{hot.url}/{PREFIX}")
    archive = LocalStore(tmp_path / "archive")
    recording = CountingArchive(archive, read_delay=0.3)
    copy = promote(hot, PREFIX, record, recording, now=NOW, owner="run-1", threads=2)

    at = {(what, key): t for what, key, t in recording.events}
    keys = [data_key("llm", 100, rel) for rel in sorted(files)]
    for key in keys:  # every object was read back from the store, after it was written
        assert at[("write-end", key)] <= at[("read-start", key)]
    # the files overlapped: a later file was being written while an earlier one was read back
    assert any(at[("write-start", later)] < at[("read-end", earlier)]
               for i, earlier in enumerate(keys) for later in keys[i + 1 :])
    m = Manifest.from_json((archive.root / copy.manifest_key).read_bytes())
    assert {f.relpath: (f.size, f.crc64nvme) for f in m.files} == {
        r: (len(d), hash_bytes(d).crc64nvme) for r, d in files.items()}
    for rel, data in files.items():
        out = io.BytesIO()
        with archive.open_read(data_key("llm", 100, rel)) as src:
            codec.decode(src, out)
        assert out.getvalue() == data, rel
    assert copy.stored_bytes == sum(archive.stat(k).size for k in keys)
    assert temp_files(archive.root) == []


class ShortOnce(PassThroughStore):
    """Stores only the first 64 bytes of one data object (a write that "succeeds" with other bytes)."""

    def __init__(self, inner: Store, victim: str) -> None:
        super().__init__(inner)
        self.victim = victim

    def write(self, key: str, data: bytes | BinaryIO, *, if_absent: bool = False) -> ObjectInfo:
        if key == self.victim and not isinstance(data, (bytes, bytearray, memoryview)):
            return self.inner.write(key, data.read()[:64], if_absent=if_absent)
        return self.inner.write(key, data, if_absent=if_absent)


def test_a_read_back_failure_stops_the_pipeline_and_commits_nothing(tmp_path: Path) -> None:
    files = several_files()
    write_hot(tmp_path / "hot", PREFIX, files)
    hot = LocalStore(tmp_path / "hot")
    record = make_record(files, location=f"{hot.url}/{PREFIX}")
    archive = LocalStore(tmp_path / "archive")
    first = sorted(files)[0]
    with pytest.raises(IntegrityError, match="read-back failed|not committed"):
        promote(hot, PREFIX, record, ShortOnce(archive, data_key("llm", 100, first)), now=NOW, owner="run-1")
    assert not (archive.root / manifest_key("llm", 100)).exists()
    assert temp_files(archive.root) == []
    # the re-run overwrites the bad object and commits
    copy = promote(hot, PREFIX, record, archive, now=NOW, owner="run-2")
    out = io.BytesIO()
    with archive.open_read(data_key("llm", 100, first)) as src:
        codec.decode(src, out)
    assert out.getvalue() == files[first] and not copy.already_archived


def test_at_most_one_encoder_and_one_decoder_run_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = several_files()
    write_hot(tmp_path / "hot", PREFIX, files)
    hot = LocalStore(tmp_path / "hot")
    record = make_record(files, location=f"{hot.url}/{PREFIX}")
    lock = threading.Lock()
    running = {"encode": 0, "decode": 0}
    most = {"encode": 0, "decode": 0}
    both = []

    def counted(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            with lock:
                running[name] += 1
                most[name] = max(most[name], running[name])
                both.append(running["encode"] and running["decode"])
            try:
                time.sleep(0.05)  # long enough for the stages to meet
                return fn(*args, **kwargs)
            finally:
                with lock:
                    running[name] -= 1

        return call

    monkeypatch.setattr(codec, "encode", counted("encode", codec.encode))
    monkeypatch.setattr(codec, "decode", counted("decode", codec.decode))
    promote(hot, PREFIX, record, LocalStore(tmp_path / "archive"), now=NOW, owner="run-1", threads=2)
    assert most == {"encode": 1, "decode": 1}  # bounded: one encoder's and one decoder's buffers at most
    assert any(both)  # and the two stages did overlap


# ------------------------------------------------------------------ classes that cannot be read back


@pytest.mark.s3_needs("restore")
def test_a_glacier_promotion_is_proven_as_it_streams_multipart(s3_bucket: Any, tmp_path: Path) -> None:
    files = {"model.pt": tensor_file(3_000_000, 6), "noise.bin": os.urandom(7 << 20), "metadata.json": b"{}"}
    write_hot(tmp_path / "hot", PREFIX, files)
    hot = LocalStore(tmp_path / "hot")
    record = make_record(files, location=f"{hot.url}/{PREFIX}")
    archive = s3_store(s3_bucket, multipart_threshold=5 << 20, part_size=5 << 20, storage_class="GLACIER")
    copy = promote(hot, PREFIX, record, archive, now=NOW, owner="run-1")
    assert copy.storage_class == "GLACIER" and archive.list_multipart_uploads() == []
    m = Manifest.from_json(archive.in_class(None).open_read(manifest_key("llm", 100)).read())
    for f in m.files:
        info = archive.stat(data_key("llm", 100, f.relpath))
        assert f.stored is not None and info.storage_class == "GLACIER"
        assert (info.size, info.checksum) == (f.stored.size, f"crc64nvme:{f.stored.crc64nvme}")


@pytest.mark.s3_needs("restore")
def test_a_glacier_upload_that_does_not_decode_to_the_hot_bytes_is_never_committed(
    s3_bucket: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = {"model.pt": os.urandom(12 << 20), "metadata.json": b"{}"}
    write_hot(tmp_path / "hot", PREFIX, files)
    hot = LocalStore(tmp_path / "hot")
    record = make_record(files, location=f"{hot.url}/{PREFIX}")
    archive = s3_store(s3_bucket, multipart_threshold=5 << 20, part_size=5 << 20, storage_class="GLACIER")
    real = codec.decode

    def decodes_one_byte_more(src: BinaryIO, dst: BinaryIO, **kw: Any) -> Any:  # an encoder/decoder that disagree
        stats = real(src, dst, **kw)
        dst.write(b"\0")
        return stats

    monkeypatch.setattr(codec, "decode", decodes_one_byte_more)
    with pytest.raises(IntegrityError, match="decodes to .* not uploaded"):
        promote(hot, PREFIX, record, archive, now=NOW, owner="run-1")
    assert archive.list_multipart_uploads() == []
    listed = {i.key for i in archive.list()}
    assert data_key("llm", 100, "model.pt") not in listed and manifest_key("llm", 100) not in listed


class SlowDurable(PassThroughStore):
    """Each write takes a while after its stream's end (an fsync, an upload's acknowledgement);
    counts how many writes were in flight at once."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.running = self.most = 0
        self._lock = threading.Lock()

    def write(self, key: str, data: bytes | BinaryIO, *, if_absent: bool = False) -> ObjectInfo:
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            info = self.inner.write(key, data, if_absent=if_absent)
            time.sleep(0.2)
            return info
        finally:
            with self._lock:
                self.running -= 1


class SlowMultipart(SlowDurable):
    """The same, for a store with multipart uploads (as S3 is)."""

    def list_multipart_uploads(self, prefix: str = "") -> list[tuple[str, str, Any]]:
        return []

    def abort_multipart(self, key: str, upload_id: str) -> None:
        pass


@pytest.mark.parametrize(("store", "in_flight"), [(SlowDurable, 2), (SlowMultipart, 1)])
def test_writes_in_flight_are_bounded(tmp_path: Path, store: type[SlowDurable], in_flight: int) -> None:
    # a local write's fsync overlaps the next file's encoding; an S3 write, which buffers up to a part
    # of its own until acknowledged, does not
    files = several_files()
    write_hot(tmp_path / "hot", PREFIX, files)
    hot = LocalStore(tmp_path / "hot")
    record = make_record(files, location=f"{hot.url}/{PREFIX}")
    archive = store(LocalStore(tmp_path / "archive"))
    promote(hot, PREFIX, record, archive, now=NOW, owner="run-1")
    assert archive.most == in_flight
