"""A drill's fetch fanned out on a real local Dask cluster: the same files, the
same report and the same errors as the fetch here, and still all or nothing.

The workers are other processes: each work item carries the store URL, the
keys, the expected sizes and hashes and the staging path, and opens the
store itself.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from ckptier.flows.cli import main
from ckptier.storage.catalog.api import Catalog
from ckptier.storage.errors import IntegrityError
from ckptier.storage.url import open_store
from ckptier.tasks.archive import FETCH_STAGE_PREFIX, archive_dir, fetch
from ckptier.tasks.config import Config, parse_config
from ckptier.tasks.demo import train_demo_run
from ckptier.tasks.pipeline import (
    DrillOptions,
    StoreCache,
    fetch_record,
    run_apply,
    run_drill,
    run_scan,
    run_verify,
)
from ckptier.tasks.reports import DrillReport
from ckptier.tasks.settings import Run

from .test_fanout import dask_cluster  # noqa: F401 - the module's real local Dask cluster

pytestmark = pytest.mark.slow
JOB = "demo-run"


def files_of(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(FETCH_STAGE_PREFIX))


def now() -> datetime:
    return datetime.now(UTC)


@pytest.fixture()
def archived(tmp_path: Path) -> Iterator[tuple[Catalog, Config, Path, Path]]:
    """A demo run scanned and verified, step 50 promoted to a local archive (hot copy kept)."""
    hot, archive = tmp_path / "hot", tmp_path / "archive"
    train_demo_run(hot, steps=100, every=25)
    archive.mkdir()
    config = parse_config(f'[[policy]]\njobs = "*"\nkeep_last = 4\nmilestones = [50]\narchive = "{archive}"\n'
                          'hot_after_archive = "keep"\n'
                          '[[drill]]\njobs = "*"\nmodel = "ckptier.tasks.drill_models:demo_model"\nsteps = 2\n')
    with Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
        run_scan([str(hot)], cat, now=now)
        run_verify(cat, now=now)
        report = run_apply(cat, config, now=now, owner="fetch-fanout-test")
        assert [i.step for i in report.items if i.action == "promote" and i.outcome == "done"] == [50]
        yield cat, config, hot, archive


def test_fanned_fetch_is_bit_exact_from_either_tier(dask_cluster: Any, archived: Any, tmp_path: Path) -> None:  # noqa: F811
    cat, config, hot, archive = archived
    record = cat.get(JOB, 50)
    assert record is not None
    original = files_of(hot / JOB / "step-00000050")
    here = fetch_record(record, config, dest=tmp_path / "here", stores=StoreCache())
    there = fetch_record(record, config, dest=tmp_path / "there", stores=StoreCache(), fanout=dask_cluster)
    assert there.tier == "hot" and files_of(tmp_path / "there") == original == files_of(tmp_path / "here")
    assert {k: v for k, v in there.to_json().items() if k not in ("dest", "seconds")} == \
        {k: v for k, v in here.to_json().items() if k not in ("dest", "seconds")}
    # The archive copy, decoded by the workers.
    got = fetch(record, hot=None, archive=open_store(str(archive)), dest=tmp_path / "decoded", fanout=dask_cluster)
    assert got.tier == "archive" and files_of(tmp_path / "decoded") == original
    assert got.bytes == sum(len(b) for b in original.values()) and leftovers(tmp_path) == []


def test_a_corrupt_archived_file_fails_the_fanned_fetch_the_same_way(dask_cluster: Any, archived: Any,  # noqa: F811
                                                                     tmp_path: Path) -> None:
    cat, _, _, archive = archived
    record = cat.get(JOB, 50)
    assert record is not None
    victim = next(p for p in sorted((archive / archive_dir(JOB, 50)).rglob("*"))
                  if p.is_file() and "optimizer" in p.name)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    errors = []
    for name, fan in (("here", None), ("there", dask_cluster)):
        dest = tmp_path / name / "into"
        with pytest.raises(IntegrityError) as e:
            fetch(record, hot=None, archive=open_store(str(archive)), dest=dest, fanout=fan)
        errors.append(str(e.value))
        assert not (tmp_path / name).exists() and leftovers(tmp_path) == []  # not DEST, not its parents, no staging
    assert errors[0] == errors[1] and "optimizer" in errors[0]


def test_a_drill_fetched_on_dask_reports_what_a_drill_here_does(dask_cluster: Any, archived: Any) -> None:  # noqa: F811
    cat, config, _, _ = archived
    run = Run(catalog=cat, config=config, stores=StoreCache(roots=cat.hot_locations), now=now, owner="test")
    (here,) = run_drill(run, DrillOptions(job=JOB, step=50))
    (there,) = run_drill(run, DrillOptions(job=JOB, step=50), fanout=dask_cluster)

    def same(r: DrillReport) -> Any:
        return (r.ok, r.tier, r.stage, r.losses, [(c.name, c.ok) for c in r.checks])

    assert there.ok and same(there) == same(here)
    assert [d.ok for d in cat.drills(job=JOB)][:2] == [True, True]


def _worker_store_urls() -> list[str]:
    """Run on each Dask worker: the stores its fetch and verify work items opened."""
    from ckptier.tasks import fanout

    cache = fanout._stores
    return sorted(cache._stores) if cache is not None else []


def test_the_drill_command_fetches_on_dask(dask_cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
                                           capsys: pytest.CaptureFixture[str]) -> None:
    hot = tmp_path / "cli-hot"
    train_demo_run(hot, steps=50, every=25)
    config = tmp_path / "ckptier.toml"
    config.write_text('[[policy]]\njobs = "*"\nkeep_last = 2\n'
                      '[[drill]]\njobs = "*"\nmodel = "ckptier.tasks.drill_models:demo_model"\nsteps = 2\n'
                      f'[runner]\nkind = "dask"\naddress = "{dask_cluster.address}"\n')
    monkeypatch.setenv("CKPTIER_CATALOG_URL", f"sqlite:///{tmp_path / 'catalog.db'}")
    monkeypatch.setenv("CKPTIER_CONFIG", str(config))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    for argv in (["scan", str(hot)], ["verify", "--runner", "threads"]):
        assert main(argv) == 0
    capsys.readouterr()
    code = main(["drill", "--job", JOB, "--runner", "dask", "--json"])
    out, err = capsys.readouterr()
    (report,) = json.loads(out)
    assert code == 0 and report["ok"] and report["tier"] == "hot", err
    # The files were read by the cluster's workers, which opened the hot store themselves.
    opened = {url for urls in dask_cluster._client.run(_worker_store_urls).values() for url in urls}
    # (rooted at the scanned directory: nothing below it is resolved through a link)
    assert any(url.endswith((os.fspath(hot), os.fspath(hot / JOB))) for url in opened), opened
