"""A local scan writes the same catalog whichever way its walk ran: stamps
checked by the walk itself (here or in the helper processes) and metadata
files read as they are listed, against the listing asking ``skip_dir`` for
every stamped directory and recognition reading each metadata file after
the listing (what a scan did before the walk took those over), on a tree
edited between scans."""

from __future__ import annotations

import os
import shutil
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from dataclasses import replace
from typing import Any

import pytest
from ckptier.storage.catalog.api import Catalog
from ckptier.storage.records import CheckpointRecord, FileRecord
from ckptier.storage.local import LocalStore
from ckptier.tasks import scan as scan_module
from ckptier.tasks.scan import scan_url
from tests.test_scan_skip import write_step

HERE = 10**9  # handoff_files that keeps every walk in the listing process


def settle(root: Path, age: float) -> None:
    """Date every directory and file ``age`` seconds back (older than a scan's settling time)."""
    t = time.time() - age
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            os.utime(os.path.join(dirpath, name), (t, t))
        os.utime(dirpath, (t, t))


def rows(cat: Catalog) -> list[CheckpointRecord]:
    """Every checkpoint record, whole (its files and copies with it), but for its row id."""
    return [replace(c, id=0, files=tuple(sorted(c.files, key=lambda f: f.relpath)),
                    copies=tuple(sorted(c.copies, key=lambda p: (p.tier.value, p.url))))
            for c in cat.checkpoints(include_deleted=True)]


def files_of(records: list[CheckpointRecord], step: int) -> dict[str, FileRecord]:
    (record,) = [r for r in records if r.step == step]
    return {f.relpath: f for f in record.files}


def stamps(cat: Catalog, root: Path) -> dict[str, tuple[str, tuple[str, ...]]]:
    return {loc: (s.stamp, s.dirs) for loc, s in cat.dir_stamps(root.as_uri() + "/").items()}


def walk_asks_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scans as before the walk checked stamps and read metadata itself: the
    listing's ``skip_dir`` is the skipper (or the enter-all) as it is."""
    monkeypatch.setattr(scan_module, "_ReadingAhead", lambda skip_dir, fetcher: skip_dir or scan_module._enter)


@pytest.mark.parametrize("handoff", [0, HERE], ids=["helpers", "here"])
def test_the_walk_writes_the_catalog_the_listing_did(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      handoff: int) -> None:
    root = tmp_path / "tree"
    for step in (100, 200, 300):
        write_step(root, step)
    settle(root, 120)
    monkeypatch.setattr(LocalStore, "handoff_files", handoff)
    new = Catalog.open(f"sqlite:///{tmp_path / 'new.db'}")
    old = Catalog.open(f"sqlite:///{tmp_path / 'old.db'}")
    t0 = datetime(2026, 12, 1, 12, tzinfo=UTC)
    try:
        def both(now: datetime) -> tuple[Any, Any]:
            got = scan_url(str(root), new, now=now)
            with monkeypatch.context() as m:
                walk_asks_everything(m)
                was = scan_url(str(root), old, now=now)
            return got, was

        first, first_old = both(t0)
        assert first.checkpoints == first_old.checkpoints == 3 and first.rows_written == first_old.rows_written > 0
        first_rows = rows(new)
        assert first_rows == rows(old)
        assert stamps(new, root) == stamps(old, root) and len(stamps(new, root)) == 3
        assert all(r.recorded_loss is not None for r in first_rows)  # the loss each metadata.json gave

        again, again_old = both(t0 + timedelta(minutes=5))
        assert again.unchanged_dirs == again_old.unchanged_dirs == 3
        assert again.listed == again_old.listed == 0 and again.rows_written == again_old.rows_written == 0
        assert rows(new) == rows(old) == first_rows

        # Edits: a file rewritten in place (same size, new bytes), a file added to a rank
        # directory, a rank directory removed, a new checkpoint.
        rewritten = root / "job/step-00000100/rank-0000/model.pt"
        rewritten.write_bytes(b"W")
        (root / "job/step-00000200/rank-0001/extra.pt").write_bytes(b"e")
        shutil.rmtree(root / "job/step-00000300/rank-0002")
        write_step(root, 400)
        for step in (200, 300, 400):  # step 100's directories keep their times: nothing was added or removed there
            settle(root / f"job/step-{step:08d}", 30)
        edited, edited_old = both(t0 + timedelta(minutes=10))
        assert edited.checkpoints == edited_old.checkpoints == 4
        assert edited.unchanged_dirs == edited_old.unchanged_dirs == 1  # step 100: its directories did not change
        assert (edited.listed, edited.rows_written) == (edited_old.listed, edited_old.rows_written)
        after = rows(new)
        assert after == rows(old)
        assert stamps(new, root) == stamps(old, root)
        assert "rank-0001/extra.pt" in files_of(after, 200)
        assert {k: f.status for k, f in files_of(after, 300).items() if k.startswith("rank-0002/")} == {
            "rank-0002/model.pt": "missing", "rank-0002/optimizer.pt": "missing"}
        assert {r.step: r.state.value for r in after}[400] == "committed"
        # The rewrite in place waits for a full listing, in both (the stamps' documented limit) ...
        old_mtime = files_of(first_rows, 100)["rank-0000/model.pt"].mtime
        assert files_of(after, 100)["rank-0000/model.pt"].mtime == old_mtime
        # ... which sees it, again the same in both.
        full = scan_url(str(root), new, now=t0 + timedelta(minutes=15), full=True)
        with monkeypatch.context() as m:
            walk_asks_everything(m)
            full_old = scan_url(str(root), old, now=t0 + timedelta(minutes=15), full=True)
        assert full.listed == full_old.listed and full.rows_written == full_old.rows_written > 0
        assert rows(new) == rows(old)
        assert files_of(rows(new), 100)["rank-0000/model.pt"].mtime == pytest.approx(rewritten.stat().st_mtime)
    finally:
        new.close()
        old.close()


def test_metadata_read_by_the_walk_is_what_recognition_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Metadata the walk reads ahead is handed over, and only regular files: a symlinked
    metadata.json is left to recognition, which reads it through the store by the key it points at."""
    root = tmp_path / "tree"
    write_step(root, 100)
    write_step(root, 200)
    os.unlink(root / "job/step-00000200/metadata.json")
    os.symlink("../step-00000100/metadata.json", root / "job/step-00000200/metadata.json")
    settle(root, 120)
    given: list[str] = []
    real_give = scan_module.Prefetcher.give

    def give(self: scan_module.Prefetcher, key: str, data: bytes) -> None:
        given.append(key)
        real_give(self, key, data)

    monkeypatch.setattr(scan_module.Prefetcher, "give", give)
    new = Catalog.open(f"sqlite:///{tmp_path / 'new.db'}")
    old = Catalog.open(f"sqlite:///{tmp_path / 'old.db'}")
    try:
        now = datetime(2026, 12, 1, 12, tzinfo=UTC)
        scan_url(str(root), new, now=now)
        with monkeypatch.context() as m:
            walk_asks_everything(m)
            scan_url(str(root), old, now=now)
        assert given == ["job/step-00000100/metadata.json"]
        assert rows(new) == rows(old)
    finally:
        new.close()
        old.close()


@pytest.mark.parametrize("handoff", [0, HERE], ids=["helpers", "here"])
def test_a_stamped_directory_swapped_for_a_link_to_its_copy_is_not_followed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handoff: int) -> None:
    """The walk checks a stamp relative to the parent it has open, with O_NOFOLLOW: a checkpoint
    directory replaced by a symlink to an exact copy outside the root (the same names, mtimes and
    link counts, so the same stamp if it were followed) is neither skipped nor entered."""
    root = tmp_path / "tree"
    for step in (100, 200):
        write_step(root, step)
    settle(root, 120)
    monkeypatch.setattr(LocalStore, "handoff_files", handoff)
    cat = Catalog.open(f"sqlite:///{tmp_path / 'c.db'}")
    try:
        t0 = datetime(2026, 12, 1, 12, tzinfo=UTC)
        scan_url(str(root), cat, now=t0)
        step = root / "job/step-00000100"
        outside = tmp_path / "outside" / "step-00000100"
        shutil.copytree(step, outside, symlinks=True)  # copystat: the directories' mtimes to the nanosecond
        assert os.stat(outside).st_mtime_ns == os.stat(step).st_mtime_ns
        shutil.rmtree(step)
        os.symlink(outside, step)
        report = scan_url(str(root), cat, now=t0 + timedelta(minutes=5))
        assert report.unchanged_dirs == 1  # step 200 only
        assert any(u.key == "job/step-00000100" and "not followed" in u.reason for u in report.unrecognised)
        (gone,) = [r for r in rows(cat) if r.step == 100]
        assert gone.missing_since is not None
    finally:
        cat.close()
