"""What a verify run reads is :func:`ckptier.tasks.verify.needs_verification`, the
documented rule (``run_verify`` used to decide inline, by state alone).

A file that could not be read proves nothing either way: the checkpoint stays
verified, and the next run reads it again instead of waiting for the next
deep read or sample of its slice.
"""

from __future__ import annotations

from pathlib import Path

from ckptier.storage.catalog.api import Catalog
from ckptier.storage.records import State
from ckptier.storage.url import open_store
from ckptier.tasks.pipeline import VerifyOptions, run_scan, run_verify
from ckptier.tasks.run import Run, StoreCache

from .test_fanout import make_tree
from .test_verify import FaultyStore

KEY = "fan/step-00000001/rank-0000/model.pt"


def test_a_file_unreadable_in_a_deep_read_is_read_again_by_the_next_run(tmp_path: Path) -> None:
    make_tree(tmp_path / "hot", 2)
    with Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
        run_scan(Run.of(cat), [str(tmp_path / "hot")])
        assert run_verify(Run.of(cat)).totals.verified == 2
        faulty = StoreCache(lambda url: FaultyStore(open_store(url), {KEY: OSError(5, "Input/output error")}),
                            roots=cat.hot_locations)
        deep = run_verify(Run.of(cat, stores=faulty), VerifyOptions(deep=True))
        assert deep.totals.errors == 1
        one = cat.get("fan", 1)
        assert one is not None and one.state == State.VERIFIED  # unreadable: nothing proven either way
        assert {f.relpath: f.status for f in one.files}["rank-0000/model.pt"] == "error"

        again = run_verify(Run.of(cat))
        assert [(r.step, r.state, r.errors) for r in again.checkpoints] == [(1, "verified", 0)]
        one = cat.get("fan", 1)
        assert one is not None and all(f.status == "ok" for f in one.files)
        assert run_verify(Run.of(cat)).checkpoints == ()  # nothing left to read
