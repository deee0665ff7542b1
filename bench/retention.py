#!/usr/bin/env python3
"""Stored bytes and monthly cost of retention, night by night, against keep-all.

Baseline: **keep-all** (every checkpoint kept, full size, in the hot tier),
computed in the same run. Two simulated training runs, each carried out
with the retention planner ckptier uses (``plan_retention``) through
``ckptier.tasks.advise.simulate_storage``, the simulation behind
``ckptier advise``: at 00:00 UTC every night the whole catalog is planned
and the plan carried out as ``ckptier apply`` does it (promotions, then
deletions re-checked against a fresh plan, then a second pass when the first
promoted something). Saves are verified an hour after they are written; the
last night is the first at which every save of the run is verified.

1. **The 21-day run**: 100 checkpoints of 20 GB, one every 500 steps, spread
   evenly over 21 days (one every 5 h 2 min 24 s: the 100th lands at the
   very instant of the 21st night's plan, so a 22nd night, after the run,
   sees it verified). Keep-all: 2 TB.
2. **The storage guide's run**: a three-week run that would keep 2 TB under
   keep-all, at the guide's usual cadence: one save every 30 minutes for 21
   days (1,008 saves, 1,000 steps each) of 2 TB / 1,008 = 1.98 GB each
   (about a 250M-parameter model at 8 bytes per parameter).

Policy (built in; ``--policy ckptier.toml`` runs yours): ``keep_last 5`` +
``milestones log`` (1, 2, 5, 10, 20, 50, ... held by the first save at or
after each), archive on S3 in ``GLACIER_IR``, ``archive_when =
"leaving_hot"`` (a milestone is promoted only when it leaves the newest-5
window, so it is never stored twice). Archive copies are compressed at
``--codec-ratio`` (1.24, the archive codec's target ratio on checkpoint
tensors: an assumption here; ``bench/archive.py`` measures it). Prices: the
configured ones (the built-in defaults, which are list-price assumptions,
unless the file given to ``--policy`` has ``[prices]``); the hot tier is
priced as the default hot tier (``hot``).

Every night it checks that every required recovery point is held (the
newest verified checkpoint and the ``keep_last`` window in hot storage, the
holder of every milestone reached in hot storage or the archive, the
``min_verified`` floor), computed from the policy's settings rather than
from the plan (``ckptier.tasks.advise.recovery_gaps``).

Targets (at the end of the run): run 1 stored bytes ≤ 10% of keep-all and
monthly cost ≤ 6% of keep-all's; run 2 stored bytes ≤ 2% of keep-all; every
recovery point held on every night of both. Run: ``python bench/retention.py``
(about a second).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from ckptier.storage.errors import CkptierError
from ckptier.storage.records import CheckpointRecord
from ckptier.tasks.advise import (
    DEFAULTS,
    Night,
    StorageForecast,
    forecast,
    simulate_storage,
)
from ckptier.tasks.config import Config, load_config, parse_config
from ckptier.tasks.prices import BILLING_GB, LIST_PRICE_NOTE, Prices
from ckptier.tasks.durations import format_duration
from ckptier.tasks.retention import (
    ArchiveWhen,
    Plan,
    Policy,
    plan_retention,
)
from ckptier.tasks.tiers import ALL_CLASSES, HOT

GB = 10**9
TB = 10**12
D = timedelta(days=1)

#: The policy of the issue, as a user would write it.
BUILT_IN = """\
[[policy]]
jobs = "*"
keep_last = 5
milestones = "log"
archive = "s3://ckpt-archive/runs"
storage_class = "GLACIER_IR"
archive_when = "leaving_hot"
"""


@dataclass(frozen=True)
class Scenario:
    """A synthetic run: ``saves`` over ``run_length``, one per ``interval``, ``size`` bytes each."""

    name: str
    title: str
    size: int
    interval: timedelta
    steps_per_save: int
    run_length: timedelta
    max_bytes_fraction: float
    max_cost_fraction: float | None


SCENARIOS = (
    Scenario("21-day", "100 saves of 20 GB, one every 500 steps, spread evenly over 21 days",
             size=20 * GB, interval=21 * D / 100, steps_per_save=500, run_length=21 * D,
             max_bytes_fraction=0.10, max_cost_fraction=0.06),
    Scenario("guide", "the storage guide's three-week run that would keep 2 TB: a save every 30 min "
             "(1,000 steps each) of 2 TB / 1,008 = 1.98 GB",
             size=round(2 * TB / 1008), interval=timedelta(minutes=30), steps_per_save=1000, run_length=21 * D,
             max_bytes_fraction=0.02, max_cost_fraction=None),
)


@dataclass
class PlanTimer:
    """Wraps the planner to count and time its calls."""

    calls: int = 0
    seconds: float = 0.0

    def __call__(self, records: Sequence[CheckpointRecord], policy: Policy, *, now: datetime) -> Plan:
        t0 = time.perf_counter()
        try:
            return plan_retention(records, policy, now=now)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


@dataclass(frozen=True)
class Result:
    nights: tuple[Night, ...]
    forecast: StorageForecast
    timer: PlanTimer


def run(scenario: Scenario, policy: Policy, prices: Prices, *, codec_ratio: float, hot_class: str) -> Result:
    timer = PlanTimer()
    nights = simulate_storage(policy, size=scenario.size, interval=scenario.interval,
                              steps_per_save=scenario.steps_per_save, run_length=scenario.run_length,
                              codec_ratio=codec_ratio, hot_class=hot_class, prices=prices, plan=timer, settle=True)
    fc = forecast(nights, policy, None, prices, size=scenario.size, ratio=codec_ratio, ranks=1, hot_class=hot_class,
                  part=DEFAULTS["part_size"][0], run_length=scenario.run_length)
    return Result(nights, fc, timer)


def gb(n: float) -> str:
    return f"{n / GB:,.1f}"


def money(x: float, star: str) -> str:
    return f"${x:,.2f}{star}"


def archive_classes(n: Night) -> str:
    return "+".join(s.storage_class for s in n.stored if s.tier == "archive") or "-"


def night_table(s: Scenario, r: Result, star: str) -> list[str]:
    lines = [
        (f"{'night':>5} {'saves':>5} {'keep-all GB':>11} {'hot GB (ckpts)':>15} {'archive GB (ckpts)':>19} "
         f"{'stored GB':>9} {'of k-a':>7} {'$/month':>10} {'k-a $/month':>12} {'of k-a':>7}  recovery points"),
    ]
    end = math.ceil(s.run_length / D)
    for n in r.nights:
        hot = f"{gb(n.tier_bytes('hot'))} ({n.tier_checkpoints('hot')})"
        arch = f"{gb(n.tier_bytes('archive'))} ({n.tier_checkpoints('archive')})"
        held = f"{n.recovery_points} held" if not n.recovery_gaps else f"MISSING {len(n.recovery_gaps)}: {n.recovery_gaps[0]}"
        after = "  (after the run)" if n.day > end else ""
        lines.append(
            f"{n.day:>5} {n.saves:>5} {gb(n.keep_all_bytes):>11} {hot:>15} {arch:>19} {gb(n.stored_bytes):>9} "
            f"{n.stored_bytes / n.keep_all_bytes:>7.2%} {money(n.monthly_cost, star):>10} "
            f"{money(n.keep_all_monthly_cost, star):>12} {n.monthly_cost / n.keep_all_monthly_cost:>7.2%}  {held}{after}"
        )
    return lines


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def variants(policy: Policy) -> list[tuple[str, Policy]]:
    """The same policy with what archive_when and the archive each buy taken away."""
    out: list[tuple[str, Policy]] = []
    if policy.archive:
        other: ArchiveWhen = "immediately" if policy.archive_when == "leaving_hot" else "leaving_hot"
        label = 'archive_when = "immediately" (the default: an early second copy)' if other == "immediately" \
            else 'archive_when = "leaving_hot"'
        out.append((label, dataclasses.replace(policy, archive_when=other)))
        out.append(("no archive (milestones stay in hot storage)",
                    dataclasses.replace(policy, archive=None, storage_class=None, archive_tiers=(),
                                        archive_when="immediately", archive_after=None)))
    return out


def report(s: Scenario, index: int, policy: Policy, prices: Prices, *, codec_ratio: float, hot_class: str,
           show_nights: bool) -> list[bool]:
    """Print one scenario; return the verdicts of its targets."""
    r = run(s, policy, prices, codec_ratio=codec_ratio, hot_class=hot_class)
    fc, final = r.forecast, r.nights[-1]
    star = "*" if fc.prices_assumed else ""
    print()
    print(f"== run {index}: {s.title}")
    print(f"   {final.saves:,} saves of {s.size / GB:,.3g} GB every {format_duration(s.interval)} over "
          f"{s.run_length / D:g} days ({s.steps_per_save:,} steps each, steps {s.steps_per_save:,} to "
          f"{final.saves * s.steps_per_save:,}); keep-all at the end: {final.keep_all_bytes / TB:,.3f} TB "
          f"({final.keep_all_bytes:,} bytes)")
    if show_nights:
        for line in night_table(s, r, star):
            print("   " + line)
    end = math.ceil(s.run_length / D)
    if final.day > end:
        print(f"   night {final.day} is the first after the run at which every save is verified "
              f"(the last save came within the hour before night {end}'s plan: not verified yet then)")
    hot, arch = final.tier_bytes("hot"), final.tier_bytes("archive")
    frac = final.stored_bytes / final.keep_all_bytes
    print(f"   end of the run: hot {gb(hot)} GB ({final.tier_checkpoints('hot')} checkpoints) + archive {gb(arch)} GB "
          f"({final.tier_checkpoints('archive')} checkpoints, {archive_classes(final)}, compressed {codec_ratio:g}:1) = "
          f"{gb(final.stored_bytes)} GB, {frac:.2%} of keep-all ({final.keep_all_bytes / final.stored_bytes:.1f}x less)")
    peak = max(r.nights, key=lambda n: n.stored_bytes)
    print(f"   peak stored: {gb(peak.stored_bytes)} GB on night {peak.day}")
    req_month = fc.monthly_cost - final.monthly_cost
    what = "archive uploads" + (", saves into S3" if hot_class != HOT else "")
    print(f"   monthly cost: {money(final.monthly_cost, star)} storage + {money(req_month, star)} PUT requests "
          f"({what}, per month of the run) = {money(fc.monthly_cost, star)}, against keep-all's "
          f"{money(fc.keep_all_monthly_cost, star)}: {fc.cost_fraction:.2%}")
    gaps = [n for n in r.nights if n.recovery_gaps]
    print(f"   planner: {r.timer.calls} plans over {len(r.nights)} nights, {1000 * r.timer.seconds / r.timer.calls:.2f} ms each")
    verdicts = []
    print("   targets:")
    ok = frac <= s.max_bytes_fraction
    verdicts.append(ok)
    print(f"     stored bytes ≤ {s.max_bytes_fraction:.0%} of keep-all: {frac:.2%}  {verdict(ok)}")
    if s.max_cost_fraction is not None:
        ok = fc.cost_fraction <= s.max_cost_fraction
        verdicts.append(ok)
        print(f"     monthly cost ≤ {s.max_cost_fraction:.0%} of keep-all's: {fc.cost_fraction:.2%}  {verdict(ok)}")
    ok = not gaps
    verdicts.append(ok)
    held = f"{len(r.nights) - len(gaps)} of {len(r.nights)} nights"
    print(f"     every required recovery point held every night: {held}  {verdict(ok)}")
    for n in gaps[:3]:
        for g in n.recovery_gaps[:5]:
            print(f"       night {n.day}: {g}")
    for label, other in variants(policy):
        v = run(s, other, prices, codec_ratio=codec_ratio, hot_class=hot_class)
        vf = v.nights[-1]
        vgaps = sum(1 for n in v.nights if n.recovery_gaps)
        print(f"   variant, {label}: {gb(vf.stored_bytes)} GB, {vf.stored_bytes / vf.keep_all_bytes:.2%} of keep-all "
              f"bytes, {v.forecast.cost_fraction:.2%} of its cost; nights with a recovery point missing: {vgaps}")
    return verdicts


def load(path: str | None, job: str | None) -> tuple[Policy, Prices, str]:
    if path is None:
        config: Config = parse_config(BUILT_IN, where="bench/retention.py")
        return config.policies[0], config.prices, "built in (the issue's)"
    config = load_config(path)
    policy = config.policy_for(job) if job else config.policies[0]
    if policy is None:
        raise CkptierError(f"{path}: no [[policy]] matches job {job!r}: add one or give another --job")
    return policy, config.prices, f"from {path}" + (f" (job {job})" if job else " (its first [[policy]])")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--policy", metavar="CKPTIER_TOML", help="run this file's policy and [prices] instead of the built-in one")
    ap.add_argument("--job", help="with --policy: use the [[policy]] that matches this job name (default: the first)")
    ap.add_argument("--codec-ratio", type=float, default=DEFAULTS["codec_ratio"][0],
                    help="archive compression ratio (default %(default)s: an assumption, see bench/archive.py)")
    ap.add_argument("--hot-class", default=HOT, choices=ALL_CLASSES,
                    help="storage class the hot tier is priced as (default %(default)s: a training filesystem)")
    ap.add_argument("--only", choices=[s.name for s in SCENARIOS], help="run one scenario")
    ap.add_argument("--no-nights", action="store_true", help="print the end of each run only")
    a = ap.parse_args(argv)
    try:
        policy, prices, origin = load(a.policy, a.job)
        if not a.codec_ratio > 0:
            raise CkptierError(f"--codec-ratio {a.codec_ratio}: must be > 0, e.g. 1.24")
        used = {a.hot_class} | ({policy.storage_class or "STANDARD"} if policy.archive and policy.archive.startswith("s3://") else set())
        used |= {t.storage_class for t in policy.archive_tiers}
        price_line = ", ".join(f"{c} ${prices.of(c).storage:g}" for c in sorted(used))
    except CkptierError as exc:
        print(f"bench/retention.py: {exc}", file=sys.stderr)
        return 2
    print("Retention night by night against keep-all (ckptier.tasks.advise.simulate_storage: the real planner, "
          "carried out as ckptier apply does)")
    print(f"policy {origin}: {policy}")
    if policy.archive:
        on_s3 = policy.archive.startswith("s3://")
        where = f"in {policy.storage_class or 'STANDARD'}" if on_s3 else "on local storage (priced as 'hot')"
        tiers = "".join(f", {t.storage_class} after {format_duration(t.after)}" for t in policy.archive_tiers) if on_s3 else ""
        print(f"archive copies {where}{tiers}, compressed {a.codec_ratio:g}:1 "
              f"(an assumed ratio: {DEFAULTS['codec_ratio'][1]})")
    else:
        print("no archive: milestones stay in hot storage")
    print(f"hot tier priced as {a.hot_class!r}; keep-all: every checkpoint, full size, in the hot tier")
    assumed = prices.assumed(used)
    print(f"prices per GB-month as billed ({BILLING_GB:,} bytes, 730-hour month): {price_line}"
          + (f"\n  * {prices.note(used)}" if assumed else f" ({prices.note(used)})"))
    if assumed and prices.note(used).startswith(LIST_PRICE_NOTE):
        print("  (every $ figure marked * uses these list-price assumptions)")
    print("sizes in GB of 10^9 bytes; k-a = keep-all")
    t0 = time.perf_counter()
    verdicts: list[bool] = []
    for i, s in enumerate(SCENARIOS, 1):
        if a.only and s.name != a.only:
            continue
        verdicts += report(s, i, policy, prices, codec_ratio=a.codec_ratio, hot_class=a.hot_class,
                           show_nights=not a.no_nights)
    print()
    print(f"targets met: {sum(verdicts)} of {len(verdicts)}; simulated in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
