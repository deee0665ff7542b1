"""The pure decisions of a rebuild, table by table: what a listing and a manifest make of an archive
copy (:mod:`ckptier.storage.archive_copies`), what that means for the catalog
(:func:`ckptier.tasks.rebuild.link_copy`), and where the hot tree is
(:func:`ckptier.tasks.rebuild.infer_hot_root`, :func:`~ckptier.tasks.rebuild.choose_hot_locations`)."""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta

import pytest

from ckptier.storage.archive_copies import group_listing, judge_copy, parse_copy_dir
from ckptier.storage.base import ObjectInfo
from ckptier.storage.catalog.restore import NewCheckpoint
from ckptier.storage.manifest import Manifest, ManifestFile, StoredObject
from ckptier.storage.records import CheckpointRecord, CopyState, Format, State
from ckptier.tasks.archive import ArchiveCheck
from ckptier.tasks.rebuild import choose_hot_locations, infer_hot_root, link_copy

NOW = datetime(2026, 11, 30, 12, tzinfo=UTC)
DIR = "runs/llm/step-00000100"
URL = "s3://cold/archive/" + DIR


def crc(n: int) -> str:
    return base64.b64encode(n.to_bytes(8, "big")).decode()


def manifest(job: str = "runs/llm", step: int = 100, *, codec: str | None = "ckz1",
             source: str | None = "file:///hot/runs/llm/step-00000100") -> Manifest:
    files = (ManifestFile("metadata.json", 10, crc(1), None, StoredObject("metadata.json.ckz", 30, crc(11))),
             ManifestFile("rank-0000/model.pt", 1000, crc(2), "ab" * 32, StoredObject("rank-0000/model.pt.ckz", 700, crc(12))))
    return Manifest(job=job, step=step, format=Format.GUIDE, created_at=NOW - timedelta(days=3), files=files,
                    codec=codec, codec_params={"level": 1} if codec else {}, source=source, recorded_loss=1.5)


def listing(*, drop: str | None = None, size: dict[str, int] | None = None,
            checksum: dict[str, str] | None = None) -> dict[str, ObjectInfo]:
    sizes = {f"{DIR}/metadata.json.ckz": 30, f"{DIR}/rank-0000/model.pt.ckz": 700, f"{DIR}/ckptier-manifest.json": 900}
    sizes.update(size or {})
    return {k: ObjectInfo(k, v, checksum=(checksum or {}).get(k)) for k, v in sizes.items() if k != drop}


# ------------------------------------------------------------------------------ the listing


def test_a_listing_sorts_into_copies_uncommitted_directories_and_backups() -> None:
    keys = [f"{DIR}/ckptier-manifest.json", f"{DIR}/metadata.json.ckz",
            "runs/llm/step-00000200/.ckptier/upload.json", "runs/llm/step-00000200/metadata.json.ckz",
            "runs/llm/step-00000300/.ckptier/upload.json", "runs/llm/step-00000300/ckptier-manifest.json",
            "step-00000400/ckptier-manifest.json",  # no job: not a copy
            "runs/llm/notastep/ckptier-manifest.json",
            ".ckptier/catalog/llm-0123456789abcdef/20261130T120000000000Z.ckb", "README"]
    got = group_listing(ObjectInfo(k, 1) for k in keys)
    assert got.copies == (DIR, "runs/llm/step-00000300")
    assert got.uncommitted == ("runs/llm/step-00000200",)
    assert got.backups == (".ckptier/catalog/llm-0123456789abcdef/20261130T120000000000Z.ckb",)
    assert set(got.objects) == set(keys)


@pytest.mark.parametrize(("directory", "expected"), [
    ("runs/llm/step-00000100", ("runs/llm", 100)),
    ("a b/ü/step-123456789", ("a b/ü", 123456789)),
    ("step-00000100", None),
    ("runs/llm/step-100", None),
    ("runs/llm/step-0000010x", None),
])
def test_copy_directories_name_their_job_and_step(directory: str, expected: tuple[str, int] | None) -> None:
    assert parse_copy_dir(directory) == expected


# ------------------------------------------------------------------------------ judge_copy


@pytest.mark.parametrize(("case", "m", "objects", "state", "needle"), [
    ("every object as the manifest says", manifest(), listing(), "intact", None),
    ("an object missing", manifest(), listing(drop=f"{DIR}/rank-0000/model.pt.ckz"), "damaged", "is missing"),
    ("an object of another size", manifest(), listing(size={f"{DIR}/metadata.json.ckz": 31}), "damaged",
     "is 31 bytes, the manifest says 30"),
    ("the store's checksum disagrees", manifest(),
     listing(checksum={f"{DIR}/metadata.json.ckz": f"crc64nvme:{crc(99)}"}), "damaged", "has checksum"),
    ("the store's checksum agrees", manifest(),
     listing(checksum={f"{DIR}/metadata.json.ckz": f"crc64nvme:{crc(11)}"}), "intact", None),
    ("the manifest names another step", manifest(step=200), listing(), "damaged", "names job 'runs/llm' step 200"),
    ("an unknown codec", manifest(codec="zz9"), listing(), "damaged", "codec 'zz9'"),
    ("a manifest that does not read back", "not a manifest, invalid JSON (line 1); was it truncated?", listing(),
     "unreadable", "ckptier-manifest.json: not a manifest"),
])
def test_what_a_manifest_and_the_listing_make_of_a_copy(case: str, m: Manifest | str, objects: dict[str, ObjectInfo],
                                                        state: str, needle: str | None) -> None:
    v = judge_copy(DIR, m, objects)
    assert v.state == state, case
    assert (v.job, v.step) == ("runs/llm", 100)
    if needle is None:
        assert v.problems == () and v.stored_bytes == 730
    else:
        assert any(needle in p for p in v.problems), v.problems
    if state == "unreadable":
        assert v.manifest is None  # nothing of it is kept, let alone trusted


def test_judging_a_directory_that_is_no_copy_is_an_error() -> None:
    with pytest.raises(ValueError, match="not an archive copy directory"):
        judge_copy("step-00000100", manifest(), listing())


# ------------------------------------------------------------------------------ link_copy


def record(state: State = State.VERIFIED) -> CheckpointRecord:
    return CheckpointRecord(id=7, job="runs/llm", step=100, format=Format.GUIDE, state=state,
                            location="file:///hot/runs/llm/step-00000100", bytes=1010, saved_at=NOW, first_seen=NOW,
                            last_seen=NOW, missing_since=None, verified_at=NOW, state_reason=None)


GOOD = ArchiveCheck(URL, True, 730)
BAD = ArchiveCheck(URL, False, 730, ("rank-0000/model.pt: decoded 1000 bytes crc64nvme X, expected Y",),
                   bad_files=("rank-0000/model.pt",))
INTACT = judge_copy(DIR, manifest(), listing())
DAMAGED = judge_copy(DIR, manifest(), listing(drop=f"{DIR}/metadata.json.ckz"))
ELSEWHERE = judge_copy(DIR, manifest(step=200), listing())
UNREADABLE = judge_copy(DIR, "not valid JSON", listing())


@pytest.mark.parametrize(("case", "verdict", "rec", "proof", "outcome", "copy_state", "new_state"), [
    ("unreadable, no checkpoint", UNREADABLE, None, None, "not recovered", None, None),
    ("unreadable, cataloged", UNREADABLE, record(), None, "degraded", CopyState.DEGRADED, None),
    ("damaged, no checkpoint", DAMAGED, None, None, "degraded", CopyState.DEGRADED, State.CORRUPT),
    ("damaged, names another step", ELSEWHERE, None, None, "not recovered", None, None),
    ("damaged, cataloged", DAMAGED, record(), None, "degraded", CopyState.DEGRADED, None),
    ("intact, store did not answer", INTACT, record(), "Unavailable: s3://cold: timed out", "unchecked", None, None),
    ("intact, no checkpoint, proven", INTACT, None, GOOD, "present", CopyState.PRESENT, State.VERIFIED),
    ("intact, no checkpoint, proof failed", INTACT, None, BAD, "degraded", CopyState.DEGRADED, State.CORRUPT),
    ("intact, cataloged, proven", INTACT, record(), GOOD, "present", CopyState.PRESENT, None),
    ("intact, tombstone, proven", INTACT, record(State.DELETED), GOOD, "present", CopyState.PRESENT, None),
    ("intact, cataloged, proof failed", INTACT, record(), BAD, "degraded", CopyState.DEGRADED, None),
])
def test_what_a_copy_means_for_the_catalog(case: str, verdict, rec, proof, outcome: str,  # type: ignore[no-untyped-def]
                                           copy_state: CopyState | None, new_state: State | None) -> None:
    got = link_copy(verdict, rec, proof, url=URL, now=NOW)
    assert got.outcome == outcome, case
    if copy_state is None:
        assert got.copy is None and got.line
        return
    assert got.copy is not None and got.copy.state == copy_state
    assert got.copy.url == URL and got.copy.manifest_key == f"{DIR}/ckptier-manifest.json"
    # Present only when proven now; a proof time never comes without a proof.
    assert (got.copy.verified_at == NOW) == (copy_state == CopyState.PRESENT)
    if new_state is None:
        assert got.copy.new is None
        return
    new = got.copy.new
    assert isinstance(new, NewCheckpoint) and new.state == new_state
    assert new.location == "file:///hot/runs/llm/step-00000100" and new.format == "guide"
    assert [(f.relpath, f.size, f.crc64nvme) for f in new.files] == [
        ("metadata.json", 10, crc(1)), ("rank-0000/model.pt", 1000, crc(2))]
    assert new.files[1].sha256_expected == "ab" * 32 and new.recorded_loss == 1.5
    if new_state == State.VERIFIED:
        assert all(f.status == "ok" for f in new.files) and new.verified_at == NOW
    else:
        assert new.verified_at is None and new.state_reason and "only copy" in new.state_reason
        assert "ok" not in {f.status for f in new.files}


# ------------------------------------------------------------------------------ hot locations


@pytest.mark.parametrize(("source", "job", "root"), [
    ("file:///data/hot/llm/step-00000100", "llm", "file:///data/hot"),
    ("file:///data/hot/runs/llama-7b/step-00000100", "runs/llama-7b", "file:///data/hot"),
    ("s3://bucket/prefix/llm/step-00000100", "llm", "s3://bucket/prefix"),
    ("s3://bucket/llm/step-00000100", "llm", "s3://bucket"),
    ("file:///data/pl/ckpts/epoch=0-step=2.ckpt", "pl/ckpts", "file:///data"),
    ("file:///data/llm/step-00000100", "other", None),
])
def test_a_manifests_source_names_the_hot_root_it_was_scanned_under(source: str, job: str, root: str | None) -> None:
    assert infer_hot_root(source, job) == root


def test_hot_locations_given_win_and_an_archive_is_never_scanned_as_hot() -> None:
    ms = [manifest(source="file:///data/hot/runs/llm/step-00000100"),
          manifest(source="file:///data/archive/x/runs/llm/step-00000100")]
    hot, left = choose_hot_locations([], ["file:///data/hot"], ms, ["file:///data/archive"])
    assert [(h.url, h.origin) for h in hot] == [("file:///data/hot", "backup")]
    assert len(left) == 1 and "file:///data/archive/x" in left[0] and "never scanned as hot" in left[0]
    hot, left = choose_hot_locations(["s3://b/hot"], ["file:///data/hot"], ms, ["file:///data/archive"])
    assert [(h.url, h.origin) for h in hot] == [("s3://b/hot", "given")] and not left
    hot, _ = choose_hot_locations([], [], ms[:1], [])
    assert [(h.url, h.origin) for h in hot] == [("file:///data/hot", "manifest")]


def test_recognition_never_claims_an_archive_copys_objects() -> None:
    """The archive's layout looks like the guide's (``job/step-N/...``): its ``.ckz`` objects are never a
    checkpoint's files, whatever else is beside them; they are counted, so that scan can say what it saw."""
    from ckptier.formats import recognise

    keys = {f"{DIR}/ckptier-manifest.json": b"{}", f"{DIR}/.ckptier/upload.json": b"{}",
            f"{DIR}/metadata.json.ckz": b"x", f"{DIR}/rank-0000/model.pt.ckz": b"x",
            "runs/llm/step-00000200/metadata.json.ckz": b"x"}  # objects of a copy whose markers were lost
    rec = recognise((ObjectInfo(k, len(v), 1.0) for k, v in keys.items()), keys.__getitem__, root_name="archive",
                    now=NOW.timestamp())
    assert rec.checkpoints == () and rec.unrecognised == ()
    assert rec.archive_objects == 3 and rec.archive_example is not None and rec.archive_example.endswith(".ckz")


def test_a_backup_names_the_hot_url_its_job_was_scanned_under() -> None:
    """Of the scanned URLs a backup records, only the one the job's name is the path below: scanning
    another (an outer directory) would catalog the same checkpoints under another job name."""
    from ckptier.storage.catalog_backup import BackupHeader
    from ckptier.tasks.backup import ReadBackup
    from ckptier.tasks.rebuild import _backup_roots

    def backup(job: str, hot: str, scanned: list[str]) -> ReadBackup:
        return ReadBackup("x", BackupHeader(job, NOW, "0" * 64, 0, {}), {"job": {"hot_url": hot}, "scanned": scanned})

    got = _backup_roots({
        "runs/llm": backup("runs/llm", "file:///data/hot/runs/llm", ["file:///data", "file:///data/hot"]),
        "exp": backup("exp", "s3://b/p/exp", []),  # no scan recorded: the rule alone
        "top": backup("top", "file:///top", ["file:///top"]),  # checkpoints right at the scanned root
    })
    assert got == ["file:///data/hot", "file:///top", "s3://b/p"]
