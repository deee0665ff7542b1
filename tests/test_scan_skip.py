"""Local rescans skip checkpoint directories whose tree is unchanged since the
last scan (directory stamps), and list them again whenever the stamp cannot
vouch for them."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from ckptier.storage.base import Store
from ckptier.storage.catalog.api import Catalog
from ckptier.storage.local import LocalStore
from ckptier.tasks.scan import FULL_LISTING_EVERY, ScanReport, scan_url

RANKS = 3
STEPS = (100, 200, 300)


def write_step(root: Path, step: int) -> Path:
    d = root / "job" / f"step-{step:08d}"
    for r in range(RANKS):
        (d / f"rank-{r:04d}").mkdir(parents=True)
        (d / f"rank-{r:04d}" / "model.pt").write_bytes(b"w" * (r + 1))
        (d / f"rank-{r:04d}" / "optimizer.pt").write_bytes(b"o")
    (d / "metadata.json").write_text(json.dumps({"step": step, "loss": 1.0 / step}))
    return d


def settle(root: Path, age: float = 60.0) -> None:
    """Date every directory (and file) ``age`` seconds back, as a tree written a while ago."""
    t = time.time() - age
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            os.utime(os.path.join(dirpath, name), (t, t))
        os.utime(dirpath, (t, t))


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    for step in STEPS:
        write_step(root, step)
    settle(root)
    return root


@pytest.fixture
def catalog(tmp_path: Path) -> Iterator[Catalog]:
    cat = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}")
    yield cat
    cat.close()


def scan(root: Path, cat: Catalog, *, now: datetime | None = None, full: bool = False) -> ScanReport:
    return scan_url(str(root), cat, now=now or datetime.now(UTC), full=full)


def state(cat: Catalog) -> list[tuple[int, str, int, datetime | None, list[tuple[str, int, str | None]]]]:
    return [
        (c.step, c.state.value, c.bytes, c.missing_since, sorted((f.relpath, f.size, f.status) for f in c.files))
        for c in cat.checkpoints(job="job")
    ]


def test_unchanged_rescan_lists_nothing_and_changes_nothing(tree: Path, catalog: Catalog) -> None:
    first = scan(tree, catalog)
    assert first.unchanged_dirs == 0 and first.listed == first.objects == len(STEPS) * (2 * RANKS + 1)
    before = state(catalog)
    again = scan(tree, catalog)
    assert again.unchanged_dirs == len(STEPS)
    assert again.listed == 0
    assert (again.objects, again.checkpoints, again.committed) == (first.objects, first.checkpoints, first.committed)
    assert again.rows_written == 0 and again.summary is not None and again.summary.vanished == 0
    assert state(catalog) == before


@pytest.mark.parametrize("wrap", ["resuming", "dry-run(resuming)"])
def test_a_wrapped_store_still_skips_unchanged_directories(tree: Path, catalog: Catalog, wrap: str) -> None:
    """Runs use the store through ``resuming`` (and ``--dry-run`` through a DryRunStore):
    the wrappers forward directory stamps, so the skipping survives them."""
    from ckptier.storage.wrappers import DryRunStore, resuming

    def store() -> Store:
        wrapped = resuming(LocalStore(tree))
        return DryRunStore(wrapped) if wrap.startswith("dry-run") else wrapped

    now = datetime.now(UTC)
    first = scan_url(str(tree), catalog, now=now, store=store())
    assert first.listed == first.objects and len(catalog.dir_stamps(LocalStore(tree).url + "/")) == len(STEPS)
    before = state(catalog)
    again = scan_url(str(tree), catalog, now=now + timedelta(minutes=1), store=store())
    assert (again.unchanged_dirs, again.listed, again.objects) == (len(STEPS), 0, first.objects)
    assert state(catalog) == before
    (tree / "job" / "step-00000200" / "rank-0001" / "extra.pt").write_bytes(b"new")
    third = scan_url(str(tree), catalog, now=now + timedelta(minutes=2), store=store())
    assert third.unchanged_dirs == len(STEPS) - 1 and third.listed == 2 * RANKS + 2


def test_a_file_added_in_a_rank_subdirectory_is_seen(tree: Path, catalog: Catalog) -> None:
    """Only rank-0001's mtime changes: a skip that looked at the step directory alone would miss it."""
    scan(tree, catalog)
    step_dir = tree / "job" / "step-00000200"
    step_mtime = step_dir.stat().st_mtime_ns
    (step_dir / "rank-0001" / "extra.pt").write_bytes(b"new")
    assert step_dir.stat().st_mtime_ns == step_mtime
    again = scan(tree, catalog)
    assert again.unchanged_dirs == len(STEPS) - 1
    assert again.listed == 2 * RANKS + 2
    (ck,) = [c for c in catalog.checkpoints(job="job") if c.step == 200]
    assert "rank-0001/extra.pt" in {f.relpath for f in ck.files}


def test_a_file_in_an_empty_subdirectory_is_seen(tree: Path, catalog: Catalog) -> None:
    """An empty directory holds none of the checkpoint's files, yet its stamp covers it (its
    parent's link count gives it away)."""
    step_dir = tree / "job" / "step-00000300"
    (step_dir / "rank-0000" / "later").mkdir()
    settle(tree)
    scan(tree, catalog)
    assert scan(tree, catalog).unchanged_dirs == len(STEPS)
    (step_dir / "rank-0000" / "later" / "shard.pt").write_bytes(b"s")
    again = scan(tree, catalog)
    assert again.unchanged_dirs == len(STEPS) - 1
    (ck,) = [c for c in catalog.checkpoints(job="job") if c.step == 300]
    seen = {f.relpath for f in ck.files} | {u.key.removeprefix("job/step-00000300/") for u in again.unrecognised}
    assert any(k.startswith("rank-0000/later/") for k in seen)


def test_removed_and_renamed_files_are_seen(tree: Path, catalog: Catalog) -> None:
    scan(tree, catalog)
    step_dir = tree / "job" / "step-00000100"
    (step_dir / "rank-0002" / "optimizer.pt").unlink()
    os.rename(step_dir / "rank-0000" / "model.pt", step_dir / "rank-0000" / "model.bak")
    again = scan(tree, catalog)
    assert again.unchanged_dirs == len(STEPS) - 1
    (ck,) = [c for c in catalog.checkpoints(job="job") if c.step == 100]
    names = {f.relpath: f.status for f in ck.files}
    assert names["rank-0002/optimizer.pt"] == "missing" and "rank-0000/model.bak" in names


def test_a_file_rewritten_in_place_waits_for_a_full_listing(tree: Path, catalog: Catalog) -> None:
    """What the skip trusts: rewriting a file in place changes no directory, so only a full
    listing (--full, or the periodic one once the stamp is older than FULL_LISTING_EVERY) sees it."""
    t0 = datetime.now(UTC)
    scan(tree, catalog, now=t0)
    target = tree / "job" / "step-00000100" / "rank-0000" / "model.pt"
    with open(target, "r+b") as fh:  # same inode, same directory entries
        fh.write(b"changed!")
    assert scan(tree, catalog, now=t0 + timedelta(hours=1)).unchanged_dirs == len(STEPS)
    (ck,) = [c for c in catalog.checkpoints(job="job") if c.step == 100]
    assert {f.relpath: f.size for f in ck.files}["rank-0000/model.pt"] == 1  # not seen yet

    later = t0 + FULL_LISTING_EVERY + timedelta(minutes=1)
    periodic = scan(tree, catalog, now=later)
    assert periodic.unchanged_dirs == 0 and periodic.listed == periodic.objects
    (ck,) = [c for c in catalog.checkpoints(job="job") if c.step == 100]
    assert {f.relpath: f.size for f in ck.files}["rank-0000/model.pt"] == 8
    # Stamped anew by that listing: the next rescan skips again.
    assert scan(tree, catalog, now=later + timedelta(hours=1)).unchanged_dirs == len(STEPS)
    assert scan(tree, catalog, now=later + timedelta(hours=2), full=True).unchanged_dirs == 0


def test_a_vanished_directory_is_marked_missing(tree: Path, catalog: Catalog) -> None:
    import shutil

    scan(tree, catalog)
    shutil.rmtree(tree / "job" / "step-00000200")
    again = scan(tree, catalog)
    assert again.summary is not None and again.summary.vanished == 1
    assert again.unchanged_dirs == len(STEPS) - 1
    missing = {c.step for c in catalog.checkpoints(job="job") if c.missing_since is not None}
    assert missing == {200}


def test_directories_that_hold_anything_else_are_always_listed(tree: Path, catalog: Catalog) -> None:
    """A stray file (reported as not recognised), a save in flight and a directory changed
    during the scan get no stamp: each rescan lists them and reports what it finds."""
    (tree / "job" / "step-00000100" / "notes").mkdir()
    (tree / "job" / "step-00000100" / "notes" / "todo.txt").write_text("x")
    in_flight = write_step(tree, 400)
    (in_flight / "metadata.json").unlink()
    settle(tree)
    fresh = write_step(tree, 500)  # modified just now: too fresh to stamp
    first = scan(tree, catalog)
    assert first.incomplete == 1
    again = scan(tree, catalog)
    assert again.unchanged_dirs == 2  # steps 200 and 300
    assert {u.key for u in again.unrecognised} == {u.key for u in first.unrecognised}
    assert again.incomplete == 1 and again.rows_written == 0
    settle(fresh)
    scan(tree, catalog)
    assert scan(tree, catalog).unchanged_dirs == 3


def test_a_symlinked_file_gets_no_stamp(tree: Path, catalog: Catalog, tmp_path: Path) -> None:
    """A symlink's target can change without any directory of the checkpoint changing."""
    outside = tmp_path / "outside.pt"
    outside.write_bytes(b"x")
    os.symlink(outside, tree / "job" / "step-00000300" / "rank-0000" / "linked.pt")
    settle(tree)
    scan(tree, catalog)
    assert scan(tree, catalog).unchanged_dirs == len(STEPS) - 1


def test_a_pending_delete_or_a_tombstone_is_listed(tree: Path, catalog: Catalog) -> None:
    """Stamps vouch only for rows in a skippable state: a checkpoint with a delete intent
    (a delete killed half-way) is listed, so the scan can settle it; so is a tombstone."""
    scan(tree, catalog)
    by_step = {c.step: c for c in catalog.checkpoints(job="job")}
    now = datetime.now(UTC)
    gen = catalog.claim(by_step[300].id, "test", now=now, ttl=timedelta(minutes=5))
    assert gen is not None
    assert catalog.record_delete_intent(by_step[300].id, owner="test", generation=gen, scope="checkpoint",
                                        files=2 * RANKS + 1, now=now)
    gen2 = catalog.claim(by_step[200].id, "test", now=now, ttl=timedelta(minutes=5))
    assert gen2 is not None
    assert catalog.mark_deleted(by_step[200].id, owner="test", generation=gen2, now=now, reasons=["test"])
    again = scan(tree, catalog)
    assert again.unchanged_dirs == 1
    assert again.listed == 2 * (2 * RANKS + 1)


def test_store_stamps_move_with_the_tree(tmp_path: Path) -> None:
    """LocalStore.take_stamp / check_stamp on their own: equal while nothing changes."""
    root = tmp_path / "t"
    d = write_step(root, 7)
    settle(root)
    store = LocalStore(root)
    rel = "job/step-00000007"
    files = [str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()]
    taken = store.take_stamp(rel, files, changed_before=time.time())
    assert taken is not None
    digest, dirs = taken
    assert dirs == ("", *(f"rank-{r:04d}" for r in range(RANKS)))
    assert store.check_stamp(rel, dirs) == digest
    assert store.take_stamp(rel, files, changed_before=time.time() - 3600) is None  # too fresh
    (d / "rank-0002" / "x").write_bytes(b"1")
    assert store.check_stamp(rel, dirs) != digest
    assert store.check_stamp("job/nope", dirs) is None
