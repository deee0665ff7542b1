"""Job and directory names that URL syntax would misread ('%', '#', '?', a tab, a space).

A catalog location is a store's URL followed by the key as the store lists
it, unescaped. Reading it back as a URL refused '#' and '?', dropped tabs and
decoded '%41': verify found such checkpoints corrupt (files "not found"), and
apply and the janitor stopped with "has a query or fragment" for every job.
"""

from __future__ import annotations

import filecmp
import shutil
from pathlib import Path

import pytest

from ckptier.flows.cli import main
from ckptier.storage.catalog.api import Catalog
from ckptier.storage.records import State
from ckptier.tasks.demo import train_demo_run

JOBS = ["a#b", "p%41x", "q?r", "t\tab", "run 1"]


def _same_tree(a: Path, b: Path) -> bool:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return files_a == files_b and all(filecmp.cmp(a / f, b / f, shallow=False) for f in files_a)


@pytest.mark.slow
def test_jobs_named_with_url_characters_verify_archive_delete_and_fetch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    hot = tmp_path / "hot 1"  # a root the file URL escapes, below which keys are not escaped
    first = train_demo_run(hot, job=JOBS[0], steps=75, every=25, leave_last_in_flight=False)
    pristine = tmp_path / "pristine"
    shutil.copytree(hot / JOBS[0], pristine)
    for job in JOBS[1:]:
        shutil.copytree(hot / JOBS[0], hot / job)
    config = tmp_path / "ckptier.toml"
    config.write_text(f'[[policy]]\njobs = "*"\nkeep_last = 1\nmilestones = [50]\nhot_after_archive = "delete"\n'
                      f'archive = "{tmp_path / "archive"}"\n')
    catalog = f"sqlite:///{tmp_path / 'catalog.db'}"
    monkeypatch.setenv("CKPTIER_CATALOG_URL", catalog)
    monkeypatch.setenv("CKPTIER_CONFIG", str(config))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    for argv in (["scan", str(hot)], ["verify"], ["apply"], ["janitor", "--older-than", "1s"]):
        code = main(argv)
        _, err = capsys.readouterr()
        assert code == 0, f"{argv}: {err}"
    assert sorted(first.steps) == [25, 50, 75]
    with Catalog.open(catalog) as cat:
        for job in JOBS:
            by_step = {c.step: c for c in cat.checkpoints(job=job, include_deleted=True)}
            assert by_step[25].state == State.DELETED, job  # neither kept nor a milestone: deleted
            assert not (hot / job / "step-00000025").exists()
            assert by_step[50].state == by_step[75].state == State.VERIFIED, job
            assert by_step[50].archive_copy() is not None, job  # the milestone went to the archive
    for job in JOBS:
        for step in (50, 75):  # from the archive, from the hot tier
            dest = tmp_path / "out" / f"{JOBS.index(job)}-{step}"
            assert main(["fetch", "--job", job, "--step", str(step), str(dest)]) == 0, capsys.readouterr().err
            assert _same_tree(dest, pristine / f"step-{step:08d}"), (job, step)
