"""The local listing's helper process: a big tree is walked by
``storage/walker.py`` in helper processes of their own, with the same
entries (in no particular order, as the Store contract says), the same
skipped symlinks and links, and the same errors as a walk in the listing
process."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from ckptier.storage.base import ObjectInfo, WalkedDirs
from ckptier.storage.catalog.api import Catalog
from ckptier.storage.errors import NotFound, StoreError
from ckptier.storage.local import TEMP_PREFIX, LocalStore
from ckptier.tasks.scan import recognise_store, scan_url

HERE = 10**9  # handoff_files that keeps every walk in the listing process


def build(root: Path) -> Path:
    """Two jobs of guide checkpoints, plus every kind of entry the walk treats apart."""
    for job in ("job-a", "job-b"):
        for step in (100, 200):
            d = root / job / f"step-{step:08d}"
            for r in range(3):
                (d / f"rank-{r:04d}").mkdir(parents=True)
                (d / f"rank-{r:04d}" / "model.pt").write_bytes(b"w" * (r + 1))
                (d / f"rank-{r:04d}" / "optimizer.pt").write_bytes(b"o")
            (d / "metadata.json").write_text(json.dumps({"step": step, "loss": 1.0 / step}))
    (root / "job-a" / "empty").mkdir()
    (root / "job-a" / f"{TEMP_PREFIX}half").write_bytes(b"t")
    (root / "job-b" / "loose.bin").write_bytes(b"l")
    os.symlink(root / "job-b" / "loose.bin", root / "job-a" / "link.bin")
    os.symlink(root / "nowhere", root / "job-a" / "dangling")
    os.symlink(root / "job-b", root / "job-a" / "to-dir")
    os.symlink("loop", root / "job-b" / "loop")
    (root / "odd-\udcff-name").write_bytes(b"s")  # an undecodable byte in a name
    return root


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return build(tmp_path / "tree")


def listing(store: LocalStore, prefix: str = "", **kw: Any) -> tuple[list[ObjectInfo], list[tuple[str, str]], list[str]]:
    skipped: list[tuple[str, str]] = []
    links: list[str] = []
    objects = list(store.list(prefix, on_skip=lambda k, why: skipped.append((k, why)), on_link=links.append, **kw))
    assert len({o.key for o in objects}) == len(objects)  # each once
    return sorted(objects, key=lambda o: o.key), sorted(skipped), sorted(links)


def store_at(root: Path, handoff: int) -> LocalStore:
    store = LocalStore(root)
    store.handoff_files = handoff
    return store


@pytest.mark.parametrize("prefix", ["", "job-a/", "job-a/step-00000100/rank-0001", "job-b/lo", "nothing/"])
def test_the_helper_lists_what_the_listing_process_lists(tree: Path, prefix: str) -> None:
    here = listing(store_at(tree, HERE), prefix)
    helped = listing(store_at(tree, 0), prefix)
    assert helped == here
    if prefix == "":
        keys = [o.key for o in here[0]]
        assert len(keys) == 2 * 2 * 7 + 3 and "job-a/link.bin" in keys and "odd-\udcff-name" in keys
        assert not any(TEMP_PREFIX in k for k in keys)
        assert sorted(k for k, _ in here[1]) == ["job-a/dangling", "job-a/to-dir", "job-b/loop"]
        assert here[2] == ["job-a/link.bin"]


def test_a_handoff_part_way_lists_the_same(tree: Path) -> None:
    here = listing(store_at(tree, HERE))
    for handoff in (1, 5, 13):
        assert listing(store_at(tree, handoff)) == here


class Candidates:
    """A skip_dir that names the only directories it may skip."""

    def __init__(self, skip: set[str], candidates: set[str]) -> None:
        self.skip = skip
        self.candidates = frozenset(candidates)
        self.asked: list[str] = []

    def __call__(self, key: str) -> bool:
        self.asked.append(key)
        return key in self.skip


def test_the_helper_hands_back_the_directories_skip_dir_may_skip(tree: Path) -> None:
    skipped = {"job-a/step-00000100", "job-b/step-00000200"}
    candidates = skipped | {"job-a/step-00000200"}  # asked, then entered after all
    here_skip = Candidates(skipped, candidates)
    here = listing(store_at(tree, HERE), skip_dir=here_skip)
    helped_skip = Candidates(skipped, candidates)
    helped = listing(store_at(tree, 0), skip_dir=helped_skip)
    assert helped == here
    keys = [o.key for o in helped[0]]
    assert not any(k.startswith(tuple(s + "/" for s in skipped)) for k in keys)
    assert any(k.startswith("job-a/step-00000200/") for k in keys)
    assert candidates <= set(helped_skip.asked)
    # What the helper walked (job-b/step-00000100, not a candidate) was never asked about.
    assert not any(k.startswith("job-b/step-00000100") for k in helped_skip.asked)
    assert any(k.startswith("job-b/step-00000100") for k in here_skip.asked)


def test_a_skip_dir_without_candidates_keeps_the_walk_here(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")  # a helper start would fail loudly below
    asked: list[str] = []

    def skip_dir(key: str) -> bool:
        asked.append(key)
        return False

    assert listing(store_at(tree, 0), skip_dir=skip_dir) == listing(store_at(tree, HERE))
    assert "job-a/step-00000100/rank-0000" in asked  # asked about every directory, here


def test_no_helper_process_means_walking_here(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    here = listing(store_at(tree, HERE))
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    assert listing(store_at(tree, 0)) == here


def test_a_helper_that_dies_fails_the_listing(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with pytest.raises(StoreError, match=r"helper process .* exited 1 before the end of the walk.*run the scan again"):
        listing(store_at(tree, 0))


def children() -> set[int]:
    """This process's child processes (zombies included), from /proc."""
    me = str(os.getpid())
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me:
                found.add(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_a_listing_closed_early_ends_its_helper(tree: Path) -> None:
    before = children()
    walk = store_at(tree, 1).list("")
    while not children() - before:  # until the hand-off (StopIteration: there was none)
        next(walk)
    assert children() - before  # the helpers (running, or done and not yet reaped)
    walk.close()
    assert not children() - before  # killed if need be, and reaped


def test_an_unreadable_directory_is_the_same_error_both_ways(tree: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads any directory")
    locked = tree / "job-b" / "step-00000100" / "rank-0001"
    locked.chmod(0)
    try:
        errors = []
        for handoff in (HERE, 0):
            with pytest.raises(StoreError) as raised:
                listing(store_at(tree, handoff))
            errors.append((type(raised.value), str(raised.value)))
        assert errors[0] == errors[1]
        assert "job-b/step-00000100/rank-0001: permission denied" in errors[0][1]
    finally:
        locked.chmod(0o755)


def test_a_missing_root_is_not_found_both_ways(tmp_path: Path) -> None:
    for handoff in (HERE, 0):
        with pytest.raises(NotFound):
            listing(store_at(tmp_path / "absent", handoff))


def catalog_rows(cat: Catalog) -> list[tuple[Any, ...]]:
    return [
        (c.job, c.step, c.state.value, c.state_reason, c.bytes, c.format, c.location,
         sorted((f.relpath, f.size, f.mtime, f.status) for f in c.files),
         sorted((p.tier.value, p.url, p.state, p.stored_bytes) for p in c.copies))
        for c in cat.checkpoints(include_deleted=True)
    ]


def scan_with(root: Path, db: Path, handoff: int, monkeypatch: pytest.MonkeyPatch,
              now: datetime) -> tuple[dict[str, Any], list[tuple[Any, ...]], Callable[[], Any]]:
    monkeypatch.setattr(LocalStore, "handoff_files", handoff)
    cat = Catalog.open(f"sqlite:///{db}")
    try:
        report = scan_url(str(root), cat, now=now)
        summary = report.summary
        assert summary is not None
        out = {"objects": report.objects, "checkpoints": report.checkpoints, "committed": report.committed,
               "incomplete": report.incomplete, "unrecognised": report.unrecognised,
               "rows_written": report.rows_written, "new": summary.new}
        rows = catalog_rows(cat)
        again = scan_url(str(root), cat, now=now)
        return out, rows, lambda: (again.unchanged_dirs, again.listed, again.rows_written)
    finally:
        cat.close()


def test_a_scan_through_the_helper_writes_the_same_catalog(tree: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    now = datetime(2026, 11, 30, 12, tzinfo=UTC)
    here = scan_with(tree, tmp_path / "here.db", HERE, monkeypatch, now)
    helped = scan_with(tree, tmp_path / "helped.db", 0, monkeypatch, now)
    assert helped[0] == here[0] and helped[1] == here[1]
    assert here[0]["checkpoints"] == 4 and here[0]["rows_written"] > 0
    assert helped[2]() == here[2]()


@pytest.mark.parametrize("prefetch", [0, 4])
def test_a_scan_ticks_its_progress_as_objects_are_listed(tmp_path: Path, prefetch: int) -> None:
    root = tmp_path / "many"
    (root / "loose").mkdir(parents=True)
    for i in range(2500):
        (root / "loose" / f"f{i:05d}.bin").write_bytes(b"x")
    ticks: list[int] = []
    found = recognise_store(LocalStore(root), now=0.0, name="many", tick=ticks.append, prefetch=prefetch)
    assert found.objects == 2500
    assert ticks == [1000, 2000, 2500]


# -- what the walk saw of each directory: the stamps of a first scan ------------------------------


def walked_by(store: LocalStore, **kw: Any) -> WalkedDirs:
    walked = WalkedDirs()
    listing(store, walked=walked, **kw)
    return walked


def test_the_helper_notes_each_directory_as_the_listing_process_does(tree: Path) -> None:
    here = walked_by(store_at(tree, HERE))
    assert walked_by(store_at(tree, 0)) == here
    assert walked_by(store_at(tree, 5)) == here
    rel = "job-a/step-00000100/"
    st = os.stat(tree / rel)
    assert here[rel][:2] == (st.st_mtime_ns, 4)  # 3 ranks and metadata.json
    assert here[rel][3] == f"{rel}\0{st.st_mtime_ns}\0{st.st_nlink}"
    assert sorted(here[rel][2]) == ["rank-0000", "rank-0001", "rank-0002"]
    # job-a holds two steps, an empty directory, a temporary file and three symlinks: every entry is counted,
    # and only real directories are subdirectories.
    assert here["job-a/"][1] == len(os.listdir(tree / "job-a")) == 7
    assert sorted(here["job-a/"][2]) == ["empty", "step-00000100", "step-00000200"]
    assert "job-a/empty/" in here and "job-a/to-dir/" not in here
    assert len(here) == 1 + 2 + 1 + 4 * 4  # root, jobs, empty, 4 steps of 1 + 3 directories


def test_a_stamp_made_of_the_walk_is_the_stamp_read_from_the_tree(tree: Path) -> None:
    (tree / "job-b" / "step-00000100" / "rank-0001" / "empty-sub").mkdir()  # found by its link count only
    # Names that sort one way as directories ("a" < "a-b" < "a/b") and another with a "/" after each.
    (tree / "job-b" / "step-00000100" / "rank-0001-b").mkdir()
    (tree / "job-b" / "step-00000100" / "rank-0001-b" / "extra.pt").write_bytes(b"e")
    store = store_at(tree, 0)
    walked = walked_by(store)
    later = datetime.now(UTC).timestamp() + 60
    for key in ("job-a/step-00000100", "job-b/step-00000100", "job-b", ""):
        relpaths = [o.key[len(key) + 1 if key else 0:] for o in listing(store, key + "/" if key else "")[0]]
        read = store.take_stamp(key, relpaths, changed_before=later)
        made = store.take_stamp(key, relpaths, changed_before=later, walked=walked)
        assert made == read is not None, key
        assert store.check_stamp(key, made[1]) == made[0]
    assert "rank-0001/empty-sub" in store.take_stamp("job-b/step-00000100", [], changed_before=later,
                                                     walked=walked)[1]  # type: ignore[index]
    assert store.take_stamp("job-a/step-00000100", [], changed_before=0.0, walked=walked) is None  # modified since


def test_a_stamp_is_read_from_the_tree_where_the_walk_did_not_enter(tree: Path) -> None:
    store = store_at(tree, HERE)
    walked = walked_by(store, skip_dir=lambda key: key == "job-a/step-00000100/rank-0001")
    key = "job-a/step-00000100"
    assert walked.tree(key) is None and walked.tree("job-a/step-00000200") is not None
    later = datetime.now(UTC).timestamp() + 60
    relpaths = ["metadata.json", *(f"rank-{r:04d}/{n}" for r in range(3) for n in ("model.pt", "optimizer.pt"))]
    assert store.take_stamp(key, relpaths, changed_before=later, walked=walked) == store.take_stamp(
        key, relpaths, changed_before=later)


def test_a_stamp_made_of_a_walk_before_a_change_does_not_match_the_changed_tree(tree: Path) -> None:
    store = store_at(tree, 0)
    walked = walked_by(store)
    key = "job-a/step-00000200"
    old = os.stat(tree / key / "rank-0002").st_mtime_ns
    (tree / key / "rank-0002" / "late.pt").write_bytes(b"written after the walk")
    os.utime(tree / key / "rank-0002", ns=(old + 10**9, old + 10**9))  # a clock tick later, however coarse
    made = store.take_stamp(key, [], changed_before=datetime.now(UTC).timestamp() + 60, walked=walked)
    assert made is not None
    assert store.check_stamp(key, made[1]) not in (made[0], None)


def test_a_first_scan_stamps_from_the_walk_and_a_rescan_skips_what_it_stamped(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read_again: list[str] = []
    real = os.lstat

    def counting(path: Any, *a: Any, **kw: Any) -> Any:
        if kw.get("dir_fd") is not None:
            read_again.append(str(path))
        return real(path, *a, **kw)

    when = datetime.now(UTC).timestamp() - 60  # a tree written a minute ago
    for dirpath, _dirs, files in os.walk(tree):
        for name in (*files, ""):
            os.utime(os.path.join(dirpath, name), (when, when), follow_symlinks=False)
    store = store_at(tree, 0)
    with Catalog.open(f"sqlite:///{tmp_path / 'c.db'}") as cat:
        monkeypatch.setattr(os, "lstat", counting)
        scan_url(str(tree), cat, now=datetime.now(UTC), store=store)
        assert read_again == []  # every stamp made of what the walk saw
        monkeypatch.undo()
        stamped = cat.dir_stamps(store.url + "/")
        assert len(stamped) == 4
        again = scan_url(str(tree), cat, now=datetime.now(UTC), store=store)
    assert again.unchanged_dirs == 4 and again.summary.rows_written == 0
