"""Verification: the pure decisions and the streaming checks (tasks/verify.py)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
import tracemalloc
from collections.abc import Iterator, Sequence
from dataclasses import replace
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from ckptier.storage.base import DeleteResult, ObjectInfo, Store
from ckptier.storage.catalog.api import Catalog
from ckptier.storage.errors import AccessDenied, ConfigError, IntegrityError
from ckptier.storage.hashing import hash_bytes
from ckptier.storage.local import LocalStore
from ckptier.storage.records import CheckpointRecord, FileRecord, Format, State
from ckptier.storage.transitions import Row, Verification, on_verification
from ckptier.tasks.config import load_config
from ckptier.tasks.drill import choose_candidates
from ckptier.tasks.pipeline import VerifyOptions, make_plan, run_scan, run_verify
from ckptier.tasks.run import Run, StoreCache
from ckptier.tasks.scan import scan_url
from ckptier.tasks.verify import (
    BufferPool,
    FileCheck,
    VerifyOutcome,
    needs_verification,
    parse_sample,
    rotating_slice,
    sample_slice,
    select_sample,
    verify_checkpoint,
    verify_many,
)
from tests.fixtures.checkpoints import CheckpointRun, copy_run

NOW = datetime(2025, 6, 1, 3, 0, tzinfo=UTC)
PREFIX = "llama/step-00000100"


def _content(name: str, size: int) -> bytes:
    block = hashlib.sha256(name.encode()).digest()
    return (block * (size // len(block) + 1))[:size]


FILES = {
    "rank-0000/model.pt": _content("model0", 300_000),
    "rank-0001/model.pt": _content("model1", 300_000),
    "rank-0000/optimizer.pt": _content("opt0", 500_000),
    "metadata.json": b'{"step": 100}',
}


def _write_tree(root: Path, prefix: str = PREFIX, files: dict[str, bytes] = FILES) -> LocalStore:
    for rel, data in files.items():
        path = root / prefix / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return LocalStore(root)


def _record(store: Store, prefix: str = PREFIX, *, sha256: dict[str, str] | None = None, step: int = 100,
            job: str = "llama", state: State = State.COMMITTED, relpaths: Sequence[str] | None = None) -> CheckpointRecord:
    """A freshly scanned, never verified record of what is under ``prefix`` now."""
    sha256 = sha256 or {}
    infos = {i.key[len(prefix) + 1:]: i for i in store.list(prefix + "/")}
    rels = sorted(infos) if relpaths is None else list(relpaths)
    files = tuple(
        FileRecord(rel, infos[rel].size, infos[rel].mtime, infos[rel].etag, None, sha256.get(rel), None, None) for rel in rels
    )
    return CheckpointRecord(
        id=step, job=job, step=step, format=Format.GUIDE, state=state, location=f"{store.url}/{prefix}",
        bytes=sum(f.size for f in files), saved_at=NOW, first_seen=NOW, last_seen=NOW, missing_since=None,
        verified_at=None, state_reason=None, files=files,
    )


def _judge(record: CheckpointRecord, results: Sequence[FileCheck]) -> Verification:
    """What the catalog makes of ``results`` (the one verdict, storage.transitions)."""
    row = Row(record.state, record.state_reason, record.first_seen, record.saved_at, record.verified_at)
    return on_verification(row, record.files, results, label=f"step {record.step}", now=NOW, grace=timedelta(hours=2))


def _verdict(record: CheckpointRecord, results: Sequence[FileCheck]) -> tuple[State, str | None]:
    t = _judge(record, results).transition
    return t.state, t.reason


def _recorded(record: CheckpointRecord, outcome: VerifyOutcome) -> CheckpointRecord:
    """What a catalog makes of an outcome: ok files keep their digests as the baseline."""
    by = {r.relpath: r for r in outcome.results}
    files = []
    for f in record.files:
        r = by[f.relpath]
        crc = f.crc64nvme if f.crc64nvme is not None else (r.crc64nvme if r.status == "ok" else None)
        files.append(replace(f, crc64nvme=crc, status=r.status, detail=r.detail))
    state, reason = _verdict(record, outcome.results)
    return replace(record, files=tuple(files), state=state, state_reason=reason, verified_at=NOW)


def _by(outcome: VerifyOutcome) -> dict[str, FileCheck]:
    return {r.relpath: r for r in outcome.results}


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return _write_tree(tmp_path)


# -- first verification, then comparisons -------------------------------------------


def test_first_verification_records_baseline_then_compares(store: LocalStore) -> None:
    rec = _record(store)
    first = verify_checkpoint(store, PREFIX, rec, deep=False, buffer_pool=BufferPool(1, 64 << 10))
    assert [r.status for r in first.results] == ["ok"] * 4
    for r in first.results:
        assert r.crc64nvme == hash_bytes(FILES[r.relpath]).crc64nvme
        assert r.size == len(FILES[r.relpath])
        assert r.sha256 is None  # nothing expected it: not computed
    assert first.bytes_read == sum(map(len, FILES.values())) and first.bytes_skipped == 0
    assert first.extra == [] and first.notes == []
    assert _verdict(rec, first.results)[0] == State.VERIFIED

    rec = _recorded(rec, first)
    assert needs_verification(rec, {i.key[len(PREFIX) + 1:]: i for i in store.list(PREFIX + "/")}) is None
    again = verify_checkpoint(store, PREFIX, rec, deep=False, buffer_pool=BufferPool(1))
    assert again.ok and again.bytes_read == first.bytes_read
    assert all(r.detail is None for r in again.results)


def test_flipped_byte_is_corrupt(store: LocalStore) -> None:
    rec = _recorded(_record(store), verify_checkpoint(store, PREFIX, _record(store), deep=False))
    path = store.root / PREFIX / "rank-0000/optimizer.pt"
    data = bytearray(path.read_bytes())
    data[123_457] ^= 0x01
    path.write_bytes(bytes(data))
    out = verify_checkpoint(store, PREFIX, rec, deep=False)
    bad = _by(out)["rank-0000/optimizer.pt"]
    assert bad.status == "corrupt" and "crc64nvme" in (bad.detail or "")
    assert bad.crc64nvme == hash_bytes(bytes(data)).crc64nvme  # the evidence, not the baseline
    assert out.count("ok") == 3  # the other files are still checked
    state, reason = _verdict(rec, out.results)
    assert state == State.CORRUPT and (reason or "").startswith("rank-0000/optimizer.pt: crc64nvme")


def test_truncated_file_is_corrupt_without_reading(store: LocalStore) -> None:
    rec = _recorded(_record(store), verify_checkpoint(store, PREFIX, _record(store), deep=False))
    path = store.root / PREFIX / "rank-0001/model.pt"
    path.write_bytes(FILES["rank-0001/model.pt"][:1000])
    out = verify_checkpoint(store, PREFIX, rec, deep=False)
    bad = _by(out)["rank-0001/model.pt"]
    assert bad.status == "corrupt" and bad.size == 1000
    assert "expected 300000" in (bad.detail or "") and "truncated" in (bad.detail or "")
    assert out.bytes_read == sum(map(len, FILES.values())) - 300_000
    path.write_bytes(FILES["rank-0001/model.pt"] + b"x")
    assert "extended" in (_by(verify_checkpoint(store, PREFIX, rec, deep=False))["rank-0001/model.pt"].detail or "")


def test_missing_shard(store: LocalStore) -> None:
    rec = _record(store)
    (store.root / PREFIX / "rank-0001/model.pt").unlink()
    out = verify_checkpoint(store, PREFIX, rec, deep=False)
    assert _by(out)["rank-0001/model.pt"].status == "missing"
    assert out.count("ok") == 3
    state, reason = _verdict(rec, out.results)
    assert state == State.CORRUPT and (reason or "").startswith("rank-0001/model.pt: not found at")


def test_extra_file_is_reported_not_corruption(store: LocalStore) -> None:
    rec = _record(store)
    (store.root / PREFIX / "rank-0002").mkdir()
    (store.root / PREFIX / "rank-0002/model.pt").write_bytes(b"surprise")
    (store.root / "llama/step-00000200").mkdir()
    (store.root / "llama/step-00000200/model.pt").write_bytes(b"neighbour, not ours")
    out = verify_checkpoint(store, PREFIX, rec, deep=False)
    assert out.ok and out.extra == ["rank-0002/model.pt"]
    assert _verdict(rec, out.results)[0] == State.VERIFIED
    # A caller's listing (relpath -> info) spares the extra list call.
    listing = {"metadata.json": ObjectInfo("x", 1), "stray.tmp": ObjectInfo("y", 1)}
    assert verify_checkpoint(store, PREFIX, rec, deep=False, listing=listing).extra == ["stray.tmp"]


def test_object_replaced_after_verification_is_reverified_and_caught(store: LocalStore) -> None:
    rec = _recorded(_record(store), verify_checkpoint(store, PREFIX, _record(store), deep=False))
    path = store.root / PREFIX / "rank-0000/model.pt"
    replaced = _content("someone else's weights", 300_000)
    path.write_bytes(replaced)  # same size
    st = path.stat()
    os.utime(path, (st.st_atime, st.st_mtime + 60))
    listing = {i.key[len(PREFIX) + 1:]: i for i in store.list(PREFIX + "/")}
    why = needs_verification(rec, listing)
    assert why is not None and "rank-0000/model.pt" in why and "mtime" in why
    out = verify_checkpoint(store, PREFIX, rec, deep=False)
    assert _by(out)["rank-0000/model.pt"].status == "corrupt"
    # An ETag change alone (S3 overwrite within the same second) is a reason too.
    etagged = replace(rec, files=tuple(replace(f, etag='"a"') for f in rec.files))
    moved = {k: replace(v, etag='"b"', mtime=next(f.mtime for f in rec.files if f.relpath == k)) for k, v in listing.items()}
    assert "etag" in (needs_verification(etagged, moved) or "")


def test_expected_sha256_from_metadata(store: LocalStore) -> None:
    good = hashlib.sha256(FILES["rank-0000/model.pt"]).hexdigest()
    wrong = hashlib.sha256(b"what metadata.json claims").hexdigest()
    out = verify_checkpoint(store, PREFIX, _record(store, sha256={"rank-0000/model.pt": good, "rank-0001/model.pt": wrong}), deep=False)
    r = _by(out)
    assert r["rank-0000/model.pt"].status == "ok" and r["rank-0000/model.pt"].sha256 == good
    assert r["rank-0001/model.pt"].status == "corrupt"
    assert "sha256" in (r["rank-0001/model.pt"].detail or "") and wrong in (r["rank-0001/model.pt"].detail or "")
    assert r["metadata.json"].sha256 is None  # only hashed where expected


class FaultyStore:
    """Wraps a store; reading the keys in ``deny`` fails (tests run as root, so chmod cannot)."""

    def __init__(self, inner: Store, deny: dict[str, BaseException], *, mid_read: dict[str, BaseException] | None = None,
                 checksums: dict[str, str] | None = None) -> None:
        self.inner, self.deny, self.mid_read, self.checksums = inner, deny, mid_read or {}, checksums or {}
        self.url = inner.url
        self.opened: list[str] = []

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def stat(self, key: str) -> ObjectInfo:
        info = self.inner.stat(key)
        return replace(info, checksum=self.checksums.get(key, info.checksum))

    def open_read(self, key: str) -> BinaryIO:
        self.opened.append(key)
        if key in self.deny:
            raise self.deny[key]
        stream = self.inner.open_read(key)
        if key in self.mid_read:
            return _FailsMidway(stream, self.mid_read[key])  # type: ignore[return-value]
        return stream

    def write(self, key: str, data: bytes | BinaryIO, *, if_absent: bool = False) -> ObjectInfo:
        return self.inner.write(key, data, if_absent=if_absent)

    def delete_many(self, keys: Sequence[str]) -> DeleteResult:
        return self.inner.delete_many(keys)


class _FailsMidway(io.RawIOBase):
    def __init__(self, inner: BinaryIO, exc: BaseException) -> None:
        self.inner, self.exc, self.reads = inner, exc, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        self.reads += 1
        if self.reads > 1:
            raise self.exc
        return self.inner.readinto(b)  # type: ignore[attr-defined]

    def close(self) -> None:
        self.inner.close()
        super().close()


def test_unreadable_files_are_errors_not_corruption(store: LocalStore) -> None:
    rec = _recorded(_record(store), verify_checkpoint(store, PREFIX, _record(store), deep=False))
    denied = f"{PREFIX}/rank-0000/model.pt"
    flaky = f"{PREFIX}/rank-0000/optimizer.pt"
    faulty = FaultyStore(
        store,
        {denied: AccessDenied("permission denied; check the file's owner and mode", url=store.url, key=denied)},
        mid_read={flaky: OSError(5, "Input/output error")},
    )
    out = verify_checkpoint(faulty, PREFIX, rec, deep=False, buffer_pool=BufferPool(1, 64 << 10))
    r = _by(out)
    assert r["rank-0000/model.pt"].status == "error" and "AccessDenied" in (r["rank-0000/model.pt"].detail or "")
    assert r["rank-0000/optimizer.pt"].status == "error" and "Input/output error" in (r["rank-0000/optimizer.pt"].detail or "")
    assert r["rank-0001/model.pt"].status == "ok" and r["metadata.json"].status == "ok"  # the rest still checked
    v = _judge(rec, out.results)
    assert v.transition.state == State.VERIFIED  # unchanged: unreadable proves nothing either way
    assert v.errors == ("rank-0000/model.pt", "rank-0000/optimizer.pt")
    assert needs_verification(_recorded(rec, out)) == "could not be read last time: rank-0000/model.pt, rank-0000/optimizer.pt"


def test_store_checksum_rejection_is_retried_once_then_corrupt(store: LocalStore) -> None:
    rec = _record(store)
    key = f"{PREFIX}/metadata.json"
    faulty = FaultyStore(store, {key: IntegrityError("bytes read do not match the object's checksum", key=key)})
    out = verify_checkpoint(faulty, PREFIX, rec, deep=False)
    assert _by(out)["metadata.json"].status == "corrupt"
    assert faulty.opened.count(key) == 2


def test_large_file_streamed_in_small_memory(tmp_path: Path) -> None:
    size = 40 << 20
    big = _content("big", size)
    store = _write_tree(tmp_path, files={"model.pt": big})
    rec = _record(store)
    expected = hash_bytes(big).crc64nvme
    del big
    for s in (store, FaultyStore(store, {})):  # the local fast path and the generic stream path
        pool = BufferPool(1, 256 << 10)
        tracemalloc.start()
        try:
            out = verify_checkpoint(s, PREFIX, rec, deep=True, buffer_pool=pool)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert out.ok and out.results[0].crc64nvme == expected and out.bytes_read == size
        assert peak < 2 << 20, f"{type(s).__name__}: peak {peak} bytes for a {size}-byte file"


def test_single_file_checkpoint(tmp_path: Path) -> None:
    data = _content("lightning", 10_000)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs/epoch=1-step=10.ckpt").write_bytes(data)
    (tmp_path / "runs/epoch=2-step=20.ckpt").write_bytes(b"another checkpoint, not an extra file")
    store = LocalStore(tmp_path)
    info = store.stat("runs/epoch=1-step=10.ckpt")
    rec = replace(_record(store, "runs", relpaths=[]), format=Format.LIGHTNING,
                  files=(FileRecord("epoch=1-step=10.ckpt", info.size, info.mtime, None, None, None, None, None),))
    out = verify_checkpoint(store, "runs/epoch=1-step=10.ckpt", rec, deep=False)
    assert out.ok and out.results[0].crc64nvme == hash_bytes(data).crc64nvme and out.extra == []


# -- store-kept checksums (no download) -------------------------------------------------


def test_store_checksum_spares_the_read_after_the_first_verification_unless_deep(store: LocalStore) -> None:
    rec = _record(store)
    checksums = {f"{PREFIX}/{rel}": "crc64nvme:" + hash_bytes(data).crc64nvme for rel, data in FILES.items()}
    checksums[f"{PREFIX}/notes.txt"] = "crc64nvme:" + hash_bytes(b"no structure").crc64nvme
    (store.root / PREFIX / "notes.txt").write_bytes(b"no structure")
    rec = _record(store)
    faulty = FaultyStore(store, {}, checksums=checksums)
    first = verify_checkpoint(faulty, PREFIX, rec, deep=False)
    # The first verification reads the files that have a structure to check (.pt, the manifest)...
    assert first.ok and first.bytes_read == sum(map(len, FILES.values())) and first.bytes_skipped == 12
    assert "baseline taken from the store's checksum" in (_by(first)["notes.txt"].detail or "")
    assert sorted(faulty.opened) == sorted(f"{PREFIX}/{rel}" for rel in FILES)
    rec = _recorded(rec, first)
    # ... and later ones compare the store's checksum with the baseline, reading nothing.
    faulty.opened.clear()
    again = verify_checkpoint(faulty, PREFIX, rec, deep=False)
    assert again.ok and again.bytes_read == 0 and faulty.opened == []
    # The store's checksum changes (object replaced, same size): corrupt without a read.
    key = f"{PREFIX}/rank-0000/model.pt"
    faulty.checksums[key] = "crc64nvme:" + hash_bytes(b"other").crc64nvme
    out = verify_checkpoint(faulty, PREFIX, rec, deep=False)
    assert _by(out)["rank-0000/model.pt"].status == "corrupt" and out.bytes_read == 0
    # deep reads every byte, and the bytes disagree with the store's own checksum.
    deep = verify_checkpoint(faulty, PREFIX, rec, deep=True)
    assert deep.bytes_read == sum(map(len, FILES.values())) + 12 and deep.bytes_skipped == 0
    assert _by(deep)["rank-0000/model.pt"].status == "corrupt"
    assert "store's checksum" in (_by(deep)["rank-0000/model.pt"].detail or "")


def test_expected_sha256_forces_a_read_even_with_store_checksum(store: LocalStore) -> None:
    sha = hashlib.sha256(FILES["metadata.json"]).hexdigest()
    rec = _record(store, sha256={"metadata.json": hashlib.sha256(b"lie").hexdigest()})
    # The weights were verified before (baselines recorded); the manifest's sha256 was never proven.
    rec = replace(rec, files=tuple(f if f.relpath == "metadata.json" else
                                   replace(f, crc64nvme=hash_bytes(FILES[f.relpath]).crc64nvme, status="ok")
                                   for f in rec.files))
    checksums = {f"{PREFIX}/{rel}": "crc64nvme:" + hash_bytes(data).crc64nvme for rel, data in FILES.items()}
    out = verify_checkpoint(FaultyStore(store, {}, checksums=checksums), PREFIX, rec, deep=False)
    assert _by(out)["metadata.json"].status == "corrupt"
    assert out.bytes_read == len(FILES["metadata.json"])
    rec = _record(store, sha256={"metadata.json": sha})
    assert _by(verify_checkpoint(FaultyStore(store, {}, checksums=checksums), PREFIX, rec, deep=False))["metadata.json"].sha256 == sha


# -- pure decisions --------------------------------------------------------------------


def _fr(rel: str, *, status: str | None = "ok", crc: str | None = "AAAAAAAAAAA=", size: int = 10,
        mtime: float | None = 100.0, etag: str | None = None) -> FileRecord:
    return FileRecord(rel, size, mtime, etag, crc, None, status, None)


def _rec(*files: FileRecord, state: State = State.VERIFIED, verified: bool = True, job: str = "j", step: int = 1) -> CheckpointRecord:
    return CheckpointRecord(
        id=step, job=job, step=step, format=Format.GUIDE, state=state, location="file:///x", bytes=sum(f.size for f in files),
        saved_at=NOW, first_seen=NOW, last_seen=NOW, missing_since=None, verified_at=NOW if verified else None,
        state_reason=None, files=files,
    )


@pytest.mark.parametrize(
    ("record", "listing", "deep", "expected"),
    [
        (_rec(_fr("a"), _fr("b")), None, False, None),
        (_rec(_fr("a"), _fr("b")), None, True, "deep verification requested"),
        (_rec(_fr("a", status=None), _fr("b", status=None), state=State.COMMITTED, verified=False), None, False, "never verified"),
        (_rec(_fr("a"), _fr("b", status=None)), None, False, "never verified: b"),
        (_rec(_fr("a", status="error")), None, False, "could not be read last time: a"),
        (_rec(_fr("a", crc=None)), None, False, "no recorded crc64nvme baseline: a"),
        (_rec(_fr("a"), state=State.INCOMPLETE, verified=False), None, True, None),
        (_rec(_fr("a"), state=State.DELETED), None, True, None),
        (_rec(_fr("a")), {"a": ObjectInfo("k", 10, 100.0)}, False, None),
        (_rec(_fr("a")), {"a": ObjectInfo("k", 10, 100.0004)}, False, None),
        (_rec(_fr("a")), {"a": ObjectInfo("k", 11, 100.0)}, False, "changed since verification: a size 10 -> 11 bytes"),
        (_rec(_fr("a")), {}, False, "changed since verification: a is gone"),
        (_rec(_fr("a", status="missing", crc=None), state=State.CORRUPT), {}, False, None),
        (_rec(_fr("a", status="missing", crc=None), state=State.CORRUPT), {"a": ObjectInfo("k", 10)}, False,
         "changed since verification: a is back"),
        (_rec(_fr("a", status="corrupt"), state=State.CORRUPT), {"a": ObjectInfo("k", 10, 100.0)}, False, None),
        (_rec(_fr("a")), {"a": ObjectInfo("k", 10, 100.0), "new": ObjectInfo("n", 1)}, False, None),
    ],
)
def test_needs_verification(record: CheckpointRecord, listing: dict[str, ObjectInfo] | None, deep: bool,
                            expected: str | None) -> None:
    assert needs_verification(record, listing, deep=deep) == expected


def test_sample_slices_are_disjoint_covering_and_stable() -> None:
    records = [_rec(_fr("a"), job=f"job{j}", step=s) for j in range(5) for s in range(0, 2000, 20)]
    n = 7
    slices = [select_sample(records, k, n) for k in range(1, n + 1)]
    ids = [{(r.job, r.step) for r in s} for s in slices]
    assert sum(map(len, ids)) == len(records)  # disjoint ...
    assert set().union(*ids) == {(r.job, r.step) for r in records}  # ... and covering
    assert all(len(s) > len(records) / n / 2 for s in slices)  # and not lopsided
    # Stable: the same checkpoint stays in its slice when the catalog grows or is reordered.
    grown = list(reversed(records)) + [_rec(_fr("a"), job="job9", step=s) for s in range(50)]
    assert {(r.job, r.step) for r in select_sample(grown, 3, n)} >= ids[2]
    assert [(r.job, r.step) for r in select_sample(records, 3, n)] == [(r.job, r.step) for r in slices[2]]  # input order
    assert sample_slice("llama", 100, 7) == sample_slice("llama", 100, 7)
    assert select_sample(records, 1, 1) == records
    with pytest.raises(ValueError):
        select_sample(records, 0, 7)


def test_rotating_slice_covers_all_in_n_nights() -> None:
    start = date(2025, 1, 30)
    assert {rotating_slice(start + timedelta(days=d), 7) for d in range(7)} == set(range(1, 8))


@pytest.mark.parametrize(("text", "expected"), [("1/7", (1, 7)), (" 7 / 7 ", (7, 7)), ("1/1", (1, 1))])
def test_parse_sample(text: str, expected: tuple[int, int]) -> None:
    assert parse_sample(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [("0/7", "K must be between 1 and N"), ("8/7", "K must be between 1 and N"), ("1/0", "N must be at least 1"),
     ("1-7", "is not K/N"), ("", "is not K/N"), ("a/b", "is not K/N"), ("-1/7", "is not K/N")],
)
def test_parse_sample_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse_sample(text)
    assert "\n" not in str(info.value) and repr(text) in str(info.value)


# -- many checkpoints in parallel ---------------------------------------------------------


def test_verify_many_in_order_with_progress(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    records = []
    for step in range(6):
        prefix = f"llama/step-{step:08d}"
        _write_tree(tmp_path, prefix, {f"rank-{r:04d}/model.pt": _content(f"{step}-{r}", 50_000 + step * 1000) for r in range(3)})
        records.append(_record(store, prefix, step=step))
    (tmp_path / "llama/step-00000003/rank-0001/model.pt").write_bytes(b"short")
    broken = replace(records[4], id=99, location="s3://nowhere/x")

    def store_for(rec: CheckpointRecord) -> tuple[Store, str]:
        if rec.id == 99:
            raise ConfigError("s3://nowhere: no credentials; set AWS_PROFILE")
        return store, f"llama/step-{rec.step:08d}"

    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def progress(done: int, total: int) -> None:
        with lock:
            seen.append((done, total))

    inputs = [*records, broken]
    got = list(verify_many(store_for, inputs, deep=False, workers=2, progress=progress, buffer_size=16 << 10))
    assert [r.id for r, _ in got] == [r.id for r in inputs]
    outcomes = [o for _, o in got]
    assert [o.ok for o in outcomes] == [True, True, True, False, True, True, False]
    assert _by(outcomes[3])["rank-0001/model.pt"].status == "corrupt"
    assert {r.status for r in outcomes[6].results} == {"error"} and "no credentials" in (outcomes[6].results[0].detail or "")
    total = sum(r.bytes for r in inputs)
    assert seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    for (_rec, out), direct in zip(got[:6], [verify_checkpoint(store, f"llama/step-{r.step:08d}", r, deep=False) for r in records]):
        assert out.results == direct.results  # same checks as one at a time


def test_verify_many_can_stop_early(store: LocalStore) -> None:
    recs = [replace(_record(store), id=i) for i in range(20)]
    it = verify_many(lambda r: (store, PREFIX), recs, deep=False, workers=2)
    first = next(it)
    assert first[0].id == 0 and first[1].ok
    it.close()  # must not hang or leak running threads
    assert not [t for t in threading.enumerate() if t.name.startswith("ckptier-verify")]


def test_buffer_pool_is_bounded() -> None:
    pool = BufferPool(2, 4096)
    got: list[bytearray] = []
    with pool.buffer() as a, pool.buffer() as b:
        got += [a, b]
        blocked = threading.Event()

        def third() -> None:
            with pool.buffer() as c:
                got.append(c)
            blocked.set()

        t = threading.Thread(target=third)
        t.start()
        assert not blocked.wait(0.2)  # waits while both are lent
    t.join(5)
    assert blocked.is_set() and any(got[2] is x for x in got[:2])  # a reused buffer, not a third one


# -- S3 (moto_server over HTTP) -----------------------------------------------------------------


@pytest.mark.s3
@pytest.mark.s3_servers("moto", "rgw")
def test_s3_stored_checksum_verifies_without_download(s3_bucket, s3_server) -> None:
    """Where the server keeps full-object checksums, a shallow verify reads nothing; where it
    discards them (RGW), verify falls back to reading every byte and still finds the damage."""
    from ckptier.storage.s3 import S3Store

    client, bucket = s3_bucket.client, s3_bucket.name
    data = {rel: blob for rel, blob in FILES.items()}
    for rel, blob in data.items():
        client.put_object(Bucket=bucket, Key=f"{PREFIX}/{rel}", Body=blob, ChecksumAlgorithm="CRC64NVME")
    store = S3Store(bucket, client=client)
    rec = _recorded(_record(store), verify_checkpoint(store, PREFIX, _record(store), deep=False))  # structure read once
    total = sum(map(len, data.values()))
    stored = s3_server.capabilities.stored_checksums
    first = verify_checkpoint(store, PREFIX, rec, deep=False)
    assert first.ok
    assert (first.bytes_read, first.bytes_skipped) == ((0, total) if stored else (total, 0))
    assert {r.relpath: r.crc64nvme for r in first.results} == {rel: hash_bytes(b).crc64nvme for rel, b in data.items()}
    # Replaced with different bytes of the same size: caught from the checksum alone (or from the bytes read).
    client.put_object(Bucket=bucket, Key=f"{PREFIX}/metadata.json", Body=b'{"step": 999}', ChecksumAlgorithm="CRC64NVME")
    out = verify_checkpoint(store, PREFIX, rec, deep=False)
    assert _by(out)["metadata.json"].status == "corrupt" and (out.bytes_read == 0) is stored
    deep = verify_checkpoint(store, PREFIX, rec, deep=True)
    assert deep.bytes_read == sum(map(len, data.values())) and _by(deep)["metadata.json"].status == "corrupt"


@pytest.mark.s3
def test_s3_without_stored_checksum_reads_fully(s3_bucket) -> None:
    from ckptier.storage.s3 import S3Store

    client, bucket = s3_bucket.client, s3_bucket.name
    for rel, blob in FILES.items():
        client.put_object(Bucket=bucket, Key=f"{PREFIX}/{rel}", Body=blob)  # boto3's default CRC32, no CRC64NVME
    store = S3Store(bucket, client=client)
    assert store.stat(f"{PREFIX}/metadata.json").checksum is None
    out = verify_checkpoint(store, PREFIX, _record(store), deep=False)
    assert out.ok and out.bytes_read == sum(map(len, FILES.values())) and out.bytes_skipped == 0
    assert {r.relpath: r.crc64nvme for r in out.results} == {rel: hash_bytes(b).crc64nvme for rel, b in FILES.items()}


# -- complete means complete, intact means intact: end to end -------------------------


def test_a_manifest_requiring_an_absent_file_is_named_at_verification(store: LocalStore) -> None:
    """Verification reads the manifest it hashes: what it requires must be there, whatever the scan saw."""
    (store.root / PREFIX / "metadata.json").write_bytes(b'{"step": 100, "world_size": 3}')
    rec = _record(store)
    out = verify_checkpoint(store, PREFIX, rec, deep=False)
    absent = _by(out)["rank-0002/"]
    assert absent.status == "missing" and absent.shortfall is not None
    assert absent.detail == "rank-0002/ (absent, listed in metadata.json)"
    assert not out.ok and [r.relpath for r in out.results][:4] == [f.relpath for f in rec.files]
    state, reason = _verdict(replace(rec, saved_at=NOW - timedelta(days=1)), out.results)  # past the grace
    assert state == State.CORRUPT and "rank-0002/ (absent, listed in metadata.json)" in (reason or "")
    young = replace(rec, saved_at=NOW - timedelta(minutes=5))
    assert _verdict(young, out.results)[0] == State.INCOMPLETE


def _catalog(tmp_path: Path) -> Catalog:
    return Catalog.open(f"sqlite:///{tmp_path}/catalog.db")


def _guide_with_absent_rank(guide_run: CheckpointRun, tmp_path: Path) -> tuple[CheckpointRun, int]:
    """The repro: the newest step's metadata.json lists rank-0001/optimizer.pt (world_size 2), which never arrived."""
    run = copy_run(guide_run, tmp_path / "run")
    newest = max(run.steps)
    meta_path = run.path(newest) / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["world_size"] = 2
    meta["files"]["rank-0001/optimizer.pt"] = {"size": 5439}
    meta_path.write_text(json.dumps(meta))
    return run, newest


def test_listed_but_absent_file_is_corrupt_not_verified_latest_kept_or_drilled(
    guide_run: CheckpointRun, tmp_path: Path
) -> None:
    run, newest = _guide_with_absent_rank(guide_run, tmp_path)
    previous = max(s for s in run.steps if s != newest)
    now = datetime.now(UTC) + timedelta(hours=3)  # past the 2 h grace
    (tmp_path / "ckptier.toml").write_text('[[policy]]\njobs = "*"\nkeep_last = 1\n')
    config = load_config(tmp_path / "ckptier.toml")
    with _catalog(tmp_path) as cat:
        (scanned,) = run_scan(Run.of(cat, config=config, now=lambda: now), [str(run.root)])
        assert scanned.summary is not None and scanned.summary.corrupt == 1  # found at the scan already: the listing lacks what metadata.json lists
        run_verify(Run.of(cat, config=config, now=lambda: now))
        rec = cat.get(run.job, newest)
        assert rec is not None and rec.state == State.CORRUPT
        assert "rank-0001/optimizer.pt (absent, listed in metadata.json)" in (rec.state_reason or "")
        assert "rank-0001/ (absent" in (rec.state_reason or "")
        latest = cat.latest(run.job)
        assert latest is not None and latest.step == previous
        plan = {i.step: i for i in make_plan(Run.of(cat, config=config, now=lambda: now), job=run.job).items}
        assert "newest verified checkpoint of the job" in plan[previous].reasons
        assert plan[newest].action == "keep" and plan[newest].reasons[0].startswith("corrupt")
        assert [c.step for c in choose_candidates(cat.checkpoints(job=run.job))][0] == previous


def test_listed_but_absent_file_in_a_young_save_is_incomplete_until_grace(guide_run: CheckpointRun, tmp_path: Path) -> None:
    run, newest = _guide_with_absent_rank(guide_run, tmp_path)
    soon = datetime.now(UTC) + timedelta(minutes=5)
    with _catalog(tmp_path) as cat:
        run_scan(Run.of(cat, now=lambda: soon), [str(run.root)])
        run_verify(Run.of(cat, now=lambda: soon))
        rec = cat.get(run.job, newest)
        assert rec is not None and rec.state == State.INCOMPLETE
        assert "not present yet: rank-0001/" in (rec.state_reason or "") and "corrupt if still so at" in (rec.state_reason or "")
        assert cat.latest(run.job).step != newest  # type: ignore[union-attr]
        # The grace runs out with the files still absent: corrupt, naming them.
        later = soon + timedelta(hours=3)
        run_scan(Run.of(cat, now=lambda: later), [str(run.root)])
        rec = cat.get(run.job, newest)
        assert rec is not None and rec.state == State.CORRUPT and "rank-0001/optimizer.pt" in (rec.state_reason or "")
        assert [e.kind for e in cat.events(job=run.job, kinds=["corrupt"])] == ["corrupt"]


def test_dcp_shard_shorter_than_its_metadata_needs_is_corrupt(dcp_run: CheckpointRun, tmp_path: Path) -> None:
    run = copy_run(dcp_run, tmp_path / "run")
    (shard,) = run.path(4).glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:100])
    now = datetime.now(UTC) + timedelta(hours=3)
    with _catalog(tmp_path) as cat:
        run_scan(Run.of(cat, now=lambda: now), [str(run.root)])
        run_verify(Run.of(cat, now=lambda: now))
        states = {c.step: c.state for c in cat.checkpoints(job=run.job)}
        assert states == {2: State.VERIFIED, 4: State.CORRUPT, 6: State.VERIFIED}
        assert f"{shard.name} (100 bytes, .metadata needs at least" in (cat.get(run.job, 4).state_reason or "")  # type: ignore[union-attr]


def _truncated_lightning(lightning_run: CheckpointRun, tmp_path: Path) -> tuple[CheckpointRun, int]:
    run = copy_run(lightning_run, tmp_path / "run")
    newest = max(run.steps)
    path = run.path(newest)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])  # what a crash mid-write (or a short copy) leaves
    return run, newest


def test_truncated_lightning_checkpoint_is_corrupt_and_never_latest(lightning_run: CheckpointRun, tmp_path: Path) -> None:
    run, newest = _truncated_lightning(lightning_run, tmp_path)
    now = datetime.now(UTC) + timedelta(hours=3)
    with _catalog(tmp_path) as cat:
        run_scan(Run.of(cat, now=lambda: now), [str(run.root)])
        report = run_verify(Run.of(cat, now=lambda: now))
        rec = cat.get(run.job, newest)
        assert rec is not None and rec.state == State.CORRUPT
        assert (rec.state_reason or "").startswith(f"{rec.files[0].relpath}: torch zip: truncated: the file ends")
        assert report.totals.corrupt == 1 and report.totals.verified == len(run.steps) - 1
        assert cat.latest(run.job).step == max(s for s in run.steps if s != newest)  # type: ignore[union-attr]


@pytest.mark.s3
def test_truncated_lightning_checkpoint_on_s3_is_read_once_and_corrupt(
    lightning_run: CheckpointRun, tmp_path: Path, s3_bucket
) -> None:
    """The store's CRC64NVME proves the bytes are what was uploaded, not that a whole file was."""
    from ckptier.storage.s3 import S3Store

    run, newest = _truncated_lightning(lightning_run, tmp_path)
    for path in run.root.rglob("*"):
        if path.is_file():
            s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=path.relative_to(run.root).as_posix(),
                                        Body=path.read_bytes(), ChecksumAlgorithm="CRC64NVME")
    store = S3Store(s3_bucket.name, client=s3_bucket.client)
    stores = StoreCache(opener=lambda url: store)
    now = datetime.now(UTC) + timedelta(hours=3)
    with _catalog(tmp_path) as cat:
        scan_url(store.url, cat, now=now, store=store)
        first = run_verify(Run.of(cat, now=lambda: now, stores=stores))
        rec = cat.get(run.job, newest)
        assert rec is not None and rec.state == State.CORRUPT and "torch zip: truncated" in (rec.state_reason or "")
        assert first.totals.bytes_read == sum(c.bytes for c in cat.checkpoints(job=run.job))
        assert cat.latest(run.job).step == max(s for s in run.steps if s != newest)  # type: ignore[union-attr]
        # Once structure and baseline are recorded, a deep-less re-verification reads nothing.
        again = run_verify(Run.of(cat, now=lambda: now, stores=stores), VerifyOptions(sample=(1, 1)))
        assert again.totals.bytes_read > 0  # a sample is a deep read
        assert run_verify(Run.of(cat, now=lambda: now, stores=stores)).totals.bytes_read == 0


def test_the_scan_verify_flow_alerts_on_corruption_a_scan_found() -> None:
    """A checkpoint found corrupt by the scan (files missing past the grace) alerts like one found by verification."""
    from ckptier.flows.scan_verify import Damage, corruption_in
    from ckptier.storage.catalog.api import ScanSummary
    from ckptier.tasks.reports import VerifyReport, VerifyRow, VerifyTotals
    from ckptier.tasks.scan import ScanReport

    def scanned(*found: tuple[str, int, str]) -> ScanReport:
        summary = ScanSummary("file:///x", "", 1, 1, 0, ("j",), 1, corrupt=len(found), corrupt_found=found)
        return ScanReport("file:///x", 1, 1, 0, 0, summary=summary)

    def report(*rows: VerifyRow) -> VerifyReport:
        return VerifyReport(rows, VerifyTotals.of(rows))

    verified = VerifyRow("j", 1, "hot", "corrupt", 0, 0, 0, (), "x", ())
    intact = VerifyRow("j", 2, "hot", "verified", 0, 0, 0, (), None, ())
    assert corruption_in(report(), [scanned()]) == []
    assert corruption_in(report(verified, intact), [scanned(("j", 3, "incomplete: ..."))]) == [
        Damage("j", 1, "hot", "x", verified), Damage("j", 3, "hot", "incomplete: ...")]
    assert [d.state for d in corruption_in(report(verified), [scanned(("j", 3, "incomplete: ..."))])] == ["corrupt"] * 2
