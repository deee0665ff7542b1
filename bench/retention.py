"""Storage kept by retention over a simulated 3-week training run.

Baseline: **keep-all** (every checkpoint stays in hot storage), computed in the
same run. Simulated: one checkpoint every ``--steps-per-ckpt`` steps (1,000)
every ``--interval-min`` minutes (30), ``--gb`` GB each (2 GB = 2*10^9 bytes,
a ~0.5B-parameter model with fp32 Adam state), for ``--days`` days (21):
about 1,000 checkpoints. Each night at 00:00 UTC the plan is computed with
:func:`plan_retention` on the whole catalog and carried out, as the nightly
tiering flow would: deletions become tombstones (scope ``checkpoint``) or drop
the hot copy (scope ``hot-copy``); promotions write an archive copy of
``bytes / codec_ratio`` bytes that counts as verified. Saves younger than one
hour at planning time are still ``committed`` (not yet verified); the one
younger than 10 minutes is ``incomplete`` (in flight).

Two policies, both "keep_last 5 + log milestones" (1, 2, 5, 10, 20, 50, ...):

* **retention**: no archive; milestones stay in hot storage.
* **retention + archive**: milestones promoted to an archive compressed at
  ``--codec-ratio`` (default 1.24, the byte-plane codec's ratio on the
  reference checkpoint in PERF.md; an assumption, not measured here), hot
  copy deleted once the archive copy is verified.

Targets: stored bytes ≤ 10% of keep-all after retention, ≤ 8% with archive
compression. Run: ``python bench/retention.py`` (a few seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from datetime import datetime, timedelta, timezone

from ckptier.storage.model import CheckpointRecord, CopyRecord, Format, State, Tier
from ckptier.tasks.retention import KeepLast, Milestones, Policy, hot_present, plan_retention

START = datetime(2024, 6, 1, tzinfo=timezone.utc)
GB = 10**9


def simulate(policy: Policy, *, days: int, interval: timedelta, steps_per_ckpt: int,
             size: int, codec_ratio: float) -> dict[str, float]:
    """Run ``days`` nights of plan-and-apply; return byte counts at the end and peaks."""
    catalog: dict[int, CheckpointRecord] = {}
    n_total = int(timedelta(days=days) / interval)
    next_id = 1
    peak_hot = peak_total = 0
    plan_seconds = 0.0
    plans = 0
    for day in range(1, days + 1):
        now = START + timedelta(days=day)
        # the day's saves
        while next_id <= n_total and START + next_id * interval <= now:
            saved = START + next_id * interval
            catalog[next_id] = CheckpointRecord(
                id=next_id, job="run", step=next_id * steps_per_ckpt, format=Format.GUIDE,
                state=State.VERIFIED, location=f"file:///hot/run/step-{next_id * steps_per_ckpt:08d}",
                bytes=size, saved_at=saved, first_seen=saved, last_seen=now, missing_since=None,
                verified_at=saved + timedelta(hours=1), state_reason=None,
            )
            next_id += 1
        # the freshest saves are not verified yet at planning time
        view = []
        for c in catalog.values():
            age = now - (c.saved_at or c.first_seen)
            if c.state == State.VERIFIED and age < timedelta(minutes=10):
                c = dataclasses.replace(c, state=State.INCOMPLETE, verified_at=None)
            elif c.state == State.VERIFIED and age < timedelta(hours=1):
                c = dataclasses.replace(c, state=State.COMMITTED, verified_at=None)
            view.append(c)
        hot, arch = _bytes(catalog.values())
        peak_hot, peak_total = max(peak_hot, hot), max(peak_total, hot + arch)
        t0 = time.perf_counter()
        plan = plan_retention(view, policy, now=now)
        plan_seconds += time.perf_counter() - t0
        plans += 1
        for item in plan.items:
            c = catalog[item.checkpoint_id]
            if item.action == "delete" and item.scope == "checkpoint":
                catalog[c.id] = dataclasses.replace(c, state=State.DELETED)
            elif item.action == "delete":
                hot_gone = CopyRecord(Tier.HOT, c.location, "deleted", None, None)
                catalog[c.id] = dataclasses.replace(c, copies=c.copies + (hot_gone,))
            elif item.action == "promote":
                stored = round(c.bytes / codec_ratio)
                copy = CopyRecord(Tier.ARCHIVE, f"s3://archive/run/{c.step}", "present", stored, now, "ckz1")
                catalog[c.id] = dataclasses.replace(c, copies=c.copies + (copy,))
    hot, arch = _bytes(catalog.values())
    return {
        "checkpoints": n_total, "hot": hot, "archive": arch, "peak_hot": peak_hot,
        "peak_total": peak_total, "plan_ms": 1000 * plan_seconds / max(plans, 1),
        "hot_count": sum(1 for c in catalog.values() if c.state != State.DELETED and hot_present(c)),
        "archive_count": sum(1 for c in catalog.values() if c.has_verified_archive()),
    }


def _bytes(cs: object) -> tuple[int, int]:
    hot = arch = 0
    for c in cs:  # type: ignore[attr-defined]
        if c.state == State.DELETED:
            continue
        if hot_present(c):
            hot += c.bytes
        arch += sum(x.stored_bytes or 0 for x in c.copies if x.tier == Tier.ARCHIVE and x.state == "present")
    return hot, arch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--days", type=int, default=21)
    ap.add_argument("--interval-min", type=float, default=30.0)
    ap.add_argument("--steps-per-ckpt", type=int, default=1000)
    ap.add_argument("--gb", type=float, default=2.0, help="checkpoint size in GB (10^9 bytes)")
    ap.add_argument("--codec-ratio", type=float, default=1.24,
                    help="archive compression ratio (assumed; PERF.md byte planes: 1.235)")
    ap.add_argument("--keep-last", type=int, default=5)
    a = ap.parse_args()
    size = int(a.gb * GB)
    interval = timedelta(minutes=a.interval_min)
    rules = (KeepLast(a.keep_last), Milestones(log=True))
    runs = {
        "retention (hot only)": Policy(rules),
        "retention + archive": Policy(rules, archive="s3://archive/run"),
    }
    n = int(timedelta(days=a.days) / interval)
    keep_all = n * size
    print(f"simulated run: {a.days} days, {n} checkpoints of {a.gb:g} GB every {a.interval_min:g} min "
          f"({a.steps_per_ckpt} steps each), nightly plan-and-apply")
    print(f"policy: keep_last {a.keep_last} + milestones log (1-2-5 series)")
    print(f"archive codec ratio: {a.codec_ratio} (assumed parameter, not measured here)")
    print(f"baseline keep-all: {keep_all / GB:,.0f} GB in hot storage")
    targets = {"retention (hot only)": 0.10, "retention + archive": 0.08}
    for name, policy in runs.items():
        r = simulate(policy, days=a.days, interval=interval, steps_per_ckpt=a.steps_per_ckpt,
                     size=size, codec_ratio=a.codec_ratio)
        stored = r["hot"] + r["archive"]
        ratio = stored / keep_all
        ok = "meets" if ratio <= targets[name] else "MISSES"
        print(f"{name:22s} hot {r['hot'] / GB:8,.1f} GB ({r['hot_count']:.0f} ckpts) + archive "
              f"{r['archive'] / GB:6,.1f} GB ({r['archive_count']:.0f} ckpts) = {stored / GB:8,.1f} GB "
              f"-> {ratio:6.2%} of keep-all ({1 / ratio:5.1f}x less; {ok} target ≤ {targets[name]:.0%}); "
              f"peak {r['peak_total'] / keep_all:6.2%} of final keep-all; plan {r['plan_ms']:.1f} ms/night")


if __name__ == "__main__":
    main()
