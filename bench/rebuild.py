#!/usr/bin/env python3
"""``ckptier rebuild`` of a lost catalog against a first ``ckptier scan`` of the same trees.

usage: python bench/rebuild.py [--checkpoints 100000] [--jobs 10] [--archive-every 10]
                               [--tombstone-every 50] [--workdir DIR] [--keep]

Builds its own world under ``--workdir`` (default: a new temporary directory):

* a hot tree of ``--checkpoints`` guide-layout checkpoints in ``--jobs`` jobs
  (``job-JJ/step-SSSSSSSS/rank-0000/{model,optimizer}.pt``, small real
  ``torch.save`` files, and ``metadata.json`` last, listing each file's size
  and sha256);
* the catalog of a tiered run: the tree scanned and verified;
  every ``--archive-every``-th checkpoint of a job archived with the real
  promotion (encode, upload, read back, manifest last) into a local archive,
  its hot copy then deleted and recorded so (as ``apply`` leaves a milestone);
  every ``--tombstone-every``-th one deleted and tombstoned (a rolling
  checkpoint); each job's catalog backup written to the archive.

Then the catalog is lost, and timed, each a real process into an empty SQLite
catalog, interleaved round by round (best of ``--repeat`` rounds):

* the baseline: ``ckptier scan`` of the tree as it was first scanned (written
  twice from the same seed: the same directories and bytes);
* ``ckptier rebuild`` (restores the backups, scans the hot tree, reads and
  proves every archive copy: decoded, the archive being local);
* ``ckptier rebuild`` with the backups moved aside (hot tree and manifests only);
* ``ckptier scan`` of the hot tree as it is now (a first scan of what is left).

Printed: each time, and the ratios rebuild / first scan of the same trees (the
``--checkpoints``-checkpoint tree the catalog was first made from). The machine
is shared: note ``/proc/loadavg`` (printed) and run it on a quiet one for final
figures (``--repeat 3``). A small run: ``python bench/rebuild.py --checkpoints 2000 --jobs 4``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def torch_files(rnd: random.Random, n: int) -> list[bytes]:
    """``n`` distinct small ``torch.save`` files (a few dozen floats each): real torch zips, which
    verification checks member by member."""
    import io

    import torch

    out = []
    for _ in range(n):
        buf = io.BytesIO()
        torch.save({"w": torch.tensor([rnd.random() for _ in range(rnd.randrange(16, 96))])}, buf)
        out.append(buf.getvalue())
    return out


def build_tree(hot: Path, checkpoints: int, jobs: int, seed: int) -> None:
    """The hot tree: guide checkpoints of small real torch files and a metadata.json each."""
    rnd = random.Random(seed)
    pool = torch_files(rnd, 64)
    digests = {id(b): hashlib.sha256(b).hexdigest() for b in pool}
    per_job = -(-checkpoints // jobs)
    for c in range(checkpoints):
        job, step = f"job-{c // per_job:02d}", (c % per_job + 1) * 100
        d = hot / job / f"step-{step:08d}"
        (d / "rank-0000").mkdir(parents=True)
        listed = {}
        for rel in ("rank-0000/model.pt", "rank-0000/optimizer.pt"):
            data = rnd.choice(pool)
            (d / rel).write_bytes(data)
            listed[rel] = {"size": len(data), "sha256": digests[id(data)]}
        (d / "metadata.json").write_text(json.dumps({"step": step, "loss": 1.0 / step, "files": listed}))


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, str]:
    """Wall seconds of one ``ckptier`` process (interpreter start and imports included), and its stdout."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ckptier.flows.cli", *argv], env=env, capture_output=True, text=True,
                          check=False)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"bench/rebuild: ckptier {' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return seconds, proc.stdout


def tier(catalog_url: str, hot: Path, archive: Path, *, archive_every: int, tombstone_every: int) -> tuple[int, int]:
    """Archive every ``archive_every``-th checkpoint of each job (real promotions) and delete its hot copy;
    delete and tombstone every ``tombstone_every``-th other one; back every job up. Returns (archived, tombstoned)."""
    from ckptier.storage.catalog.api import Catalog
    from ckptier.storage.local import LocalStore
    from ckptier.storage.records import CopyState, State, Tier
    from ckptier.tasks.archive import promote
    from ckptier.tasks.backup import backup_catalog

    owner = "bench-rebuild"
    hot_store, arch = LocalStore(hot), LocalStore(archive)
    now = datetime.now(UTC)
    with Catalog.open(catalog_url) as cat:
        records = [r for r in cat.checkpoints() if r.state == State.VERIFIED]
        assert records, "nothing verified: the set-up's verify failed"
        milestones = [r for r in records if (r.step // 100) % archive_every == 1]
        rolling = [r for r in records if (r.step // 100) % tombstone_every == 2 and (r.step // 100) % archive_every != 1]

        def one(r):  # type: ignore[no-untyped-def]
            return r, promote(hot_store, f"{r.job}/step-{r.step:08d}", r, arch, now=now, owner=owner)

        with ThreadPoolExecutor(4) as pool:
            for r, copy in pool.map(one, milestones):
                cat.add_copy(r.id, tier=Tier.ARCHIVE, url=copy.url, state=CopyState.PRESENT,
                             stored_bytes=copy.stored_bytes, codec=copy.codec, manifest_key=copy.manifest_key,
                             verified_at=copy.verified_at, now=now)
        for r in milestones + rolling:
            shutil.rmtree(hot / r.job / f"step-{r.step:08d}")
            generation = cat.claim(r.id, owner, now=now, ttl=timedelta(minutes=5))
            assert generation is not None
            mark = cat.mark_hot_copy_deleted if r in milestones else cat.mark_deleted
            assert mark(r.id, owner=owner, generation=generation, now=now, reasons=["bench"])
        report = backup_catalog(cat, lambda job: arch, now=datetime.now(UTC))
        assert report.ok and len(report.backups) == len(cat.jobs()), report
    return len(milestones), len(rolling)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", type=int, default=100_000)
    ap.add_argument("--jobs", type=int, default=10)
    ap.add_argument("--archive-every", type=int, default=10, help="one checkpoint in N of each job is archive-only")
    ap.add_argument("--tombstone-every", type=int, default=50, help="one in N is a tombstone")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of the timed commands, interleaved (best kept)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ckptier-bench-rebuild-", dir=a.workdir))
    hot, archive = work / "hot", work / "archive"
    config = work / "ckptier.toml"
    config.write_text(f'[[policy]]\njobs = "*"\nkeep_last = 3\narchive = "{archive.as_uri()}"\n')
    env = {**os.environ, "PYTHONPATH": str(REPO), "CKPTIER_CONFIG": str(config), "PREFECT_HOME": str(work / "prefect")}
    env.pop("PREFECT_API_URL", None)
    env.pop("CKPTIER_CATALOG_URL", None)

    def catalog(name: str) -> str:
        return f"sqlite:///{work / name}"

    try:
        t0 = time.monotonic()
        build_tree(hot, a.checkpoints, a.jobs, seed=20261201)
        print(f"bench/rebuild: {a.checkpoints:,} checkpoints in {a.jobs} jobs written in {time.monotonic() - t0:.0f} s",
              file=sys.stderr)
        # The tree as it was first scanned, written again (same seed, same bytes, files of their own) for the
        # baseline's runs: hard links would make every file a link, which scans treat apart.
        first = work / "first"
        build_tree(first, a.checkpoints, a.jobs, seed=20261201)
        timed(["scan", "--catalog", catalog("tiered.db"), "--json", str(hot)], env)
        timed(["verify", "--catalog", catalog("tiered.db")], env)
        archived, tombstones = tier(catalog("tiered.db"), hot, archive, archive_every=a.archive_every,
                                    tombstone_every=a.tombstone_every)
        moved, aside = archive / ".ckptier", work / "backups-aside"
        runs = (
            ("first scan of the same trees (baseline)", ["scan", "--json", str(first)]),
            ("rebuild (with backups)", ["rebuild", "--json"]),
            ("rebuild (no backup)", ["rebuild", "--json"]),
            ("first scan of the hot tree left", ["scan", "--json", str(hot)]),
        )
        results: dict[str, float] = {}
        for i in range(a.repeat):  # interleaved: each round sees the same load
            for n, (name, argv) in enumerate(runs):
                if name == "rebuild (no backup)":
                    moved.rename(aside)
                try:
                    secs, out = timed([argv[0], "--catalog", catalog(f"run-{i}-{n}.db"), *argv[1:]], env)
                finally:
                    if name == "rebuild (no backup)":
                        aside.rename(moved)
                results[name] = min(secs, results.get(name, float("inf")))
                if argv[0] == "rebuild":
                    rep = json.loads(out)
                    assert rep["ok"] and sum(x["copies"] for x in rep["archives"]) == archived, rep["problems"][:3]
        first_scan = results.pop(runs[0][0])
        load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else ["?"]
        print(f"ckptier rebuild vs a first scan: {a.checkpoints:,} checkpoints ({a.checkpoints - archived - tombstones:,} "
              f"hot, {archived:,} archive-only, {tombstones:,} tombstones), {a.jobs} jobs, 3 files each; "
              f"{os.cpu_count()} CPUs, load {' '.join(load)}")
        print(f"  first scan of the {a.checkpoints:,}-checkpoint tree (baseline)  {first_scan:8.2f} s")
        for name, secs in results.items():
            print(f"  {name:<44} {secs:8.2f} s  {secs / first_scan:5.2f}x the first scan")
    finally:
        if a.keep:
            print(f"bench/rebuild: kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
