"""The planning commands: ``ckptier advise`` and ``ckptier lifecycle``.

Imported by every command (their parsers are built with the others'), so
only the standard library and light modules load here; each handler imports
what it needs. Thin: parse the arguments, read the config and (for ``--job``) the catalog,
call the pure cores (:mod:`ckptier.tasks.advise`,
:mod:`ckptier.tasks.lifecycle`), print. Neither starts Prefect or imports
torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import textwrap
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from ckptier.storage.errors import ConfigError
from ckptier.tasks.tiers import ALL_CLASSES
from ckptier.tasks.units import DTYPE_BYTES, MAX_RUN_LENGTH, OPTIMIZER_STATES, human_bytes

from .arguments import duration, number, whole
from .command import open_existing, settings_of

_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_COUNT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*$", re.IGNORECASE)
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgtp]?)(i?)b?\s*(/s)?\s*$", re.IGNORECASE)
_UNITS = "kmgtp"


def parse_count(text: str) -> float:
    """``"7e9"``, ``"7B"``, ``"1.5T"``, ``"350M"`` → a number (B = billion)."""
    m = _COUNT_RE.match(text)
    if not m:
        raise ConfigError(f"--params {text!r}: not a number of parameters; write e.g. 7e9, 7B or 1.5T")
    return float(m.group(1)) * _SUFFIX[m.group(2).lower()]


def parse_bytes(text: str, *, what: str, per_second: bool = False) -> float:
    """``"2GB/s"``, ``"500 MB/s"``, ``"1.5GiB/s"``, ``"8MiB"`` → bytes (per second).
    Decimal units (kB, MB, GB…) are powers of 1000, binary ones (KiB, MiB…) of 1024."""
    m = _BYTES_RE.match(text)
    if not m or (m.group(4) is not None) != per_second:
        example = "2GB/s or 500MB/s" if per_second else "8MiB or 16MB"
        raise ConfigError(f"{what} {text!r}: not understood; write e.g. {example}")
    unit = m.group(2).lower()
    base = 1024 if m.group(3) else 1000
    return float(m.group(1)) * (base ** (_UNITS.index(unit) + 1) if unit else 1)


def as_json(value: Any) -> Any:
    """A typed result (dataclasses, tuples, timedeltas, datetimes) as JSON-ready data;
    durations become seconds."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: as_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): as_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_json(v) for v in value]
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, datetime):
        return value.isoformat()
    return value


def hms(seconds: float) -> str:
    """``3959`` → ``'1h06min'``; under two minutes in seconds (units as ``ckptier.toml`` spells them)."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    days, rest = divmod(minutes, 1440)
    h, m = divmod(rest, 60)
    if days:
        return f"{days}d{h:02d}h" if h else f"{days}d"
    if h:
        return f"{h}h{m:02d}min" if m else f"{h}h"
    return f"{m}min"


def money(x: float, currency: str) -> str:
    figure = f"{x:,.2f}"
    return f"${figure}" if currency == "USD" else f"{figure} {currency}"


def count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:,.0f}"


# ------------------------------------------------------------------ advise


def cmd_advise(args: argparse.Namespace) -> int:
    from ckptier.tasks.advise import Request, advise, observe_job  # lazy: every command builds this parser
    from ckptier.tasks.config import default_policy, load_config  # lazy: --version and --help stay light

    from .output import print_json  # lazy: likewise

    config = load_config(args.policy or args.config)
    observed = None
    if args.job:
        from ckptier.tasks.run import unknown_job  # lazy: --version and --help stay light
        from ckptier.tasks.settings import Settings  # lazy: likewise

        settings = Settings(args.catalog, args.config, config=None if args.policy else config)
        with open_existing(args, settings) as cat:
            records = cat.checkpoints(job=args.job, include_deleted=True, with_files=True)
        if not records:
            raise unknown_job(args.job)
        observed = observe_job(records)
    if args.job:
        policy, name = config.policy_for(args.job), None
        if policy is None:
            raise ConfigError(f"job {args.job!r}: no [[policy]] of {config.source or 'the built-in config'} matches it; add one")
    elif config.policies:
        policy, name = config.policies[0], None
    else:  # pragma: no cover - parse_config always supplies one
        policy, name = default_policy(), None
    request = Request(
        params=parse_count(args.params) if args.params is not None else None,
        dtype=args.dtype, optimizer=args.optimizer, state_dtype=args.state_dtype,
        master_weights={"fp32": True, "none": False, None: None}[args.master_weights],
        ranks=args.ranks,
        write_window=args.write_window,
        write_bandwidth=parse_bytes(args.write_bandwidth, what="--write-bandwidth", per_second=True) if args.write_bandwidth else None,
        interval=args.interval,
        mtbf=args.mtbf,
        restart=args.restart,
        run_length=args.run_length,
        steps_per_save=args.steps_per_save,
        codec_ratio=args.codec_ratio,
        hot_class=args.hot_class,
        part_size=int(parse_bytes(args.part_size, what="--part-size")) if args.part_size else None,
    )
    advice = advise(request, policy, config.prices, observed=observed, policy_name=name)
    if args.json:
        print_json(as_json(advice) | {"measured": list(advice.measured())})
    else:
        for line in render_advice(advice):
            print(line)
    return 0


def render_advice(a: Any) -> list[str]:
    """The short human report of an :class:`~ckptier.tasks.advise.Advice`."""
    s, b, i, st = a.sizing, a.bandwidth, a.interval, a.storage
    star = "*" if st.prices_assumed else ""
    by = {x.name: x for x in a.assumptions}
    measured = a.measured()
    what = f"job {a.job}" if a.job else f"a {count(s.params)}-parameter model" if s.params else "this run"
    head = f"ckptier advise: {what} ({by['dtype'].value}, {by['optimizer'].value})"
    lines = [head]
    if measured:
        lines.append(f"measured from the catalog: {', '.join(measured)} (the rest are assumptions, listed below)")
    parts = " + ".join(f"{c.bytes_per_param:g} B {c.name}" for c in s.components)
    if s.measured:
        est = f"; {human_bytes(s.estimated_bytes)} estimated from {s.bytes_per_param:g} B/param" if s.estimated_bytes else ""
        lines.append(f"size        {human_bytes(s.total_bytes)} per checkpoint (measured{est})")
    else:
        lines.append(f"size        {human_bytes(s.total_bytes)} per checkpoint = {s.bytes_per_param:g} bytes/param: {parts}")
    if s.ranks > 1:
        lines.append(f"            {human_bytes(s.per_rank_bytes)} per rank ({s.ranks} ranks, sharded evenly)")
    rank_bw = f" ({human_bytes(round(b.per_rank_bytes_per_s))}/s per rank)" if s.ranks > 1 else ""
    lines.append(f"bandwidth   {human_bytes(round(b.bytes_per_s))}/s to save within {hms(b.window_s)}{rank_bw}")
    lines.append(
        f"interval    save every {hms(i.recommended_s)} of compute (Daly's optimum; Young's: {hms(i.young_s)}), "
        f"for {hms(i.write_s)} saves and an MTBF of {hms(i.mtbf_s)}"
    )
    planned = f"{i.overhead_planned:.1%} at the planned {hms(i.planned_s)}" if i.overhead_planned is not None else f"the planned {hms(i.planned_s)} is too short"
    lines.append(f"            lost to saves and rework: {i.overhead_recommended:.1%} at the optimum, {planned}")
    for note in i.notes:
        lines.append(f"            ({note})")
    f = st.final
    lines.append(f"storage     {hms(_seconds(by['run_length']))} run, {st.saves:,} saves every {hms(i.planned_s)}, policy: {st.policy}")
    held = " + ".join(f"{x.tier} {human_bytes(x.bytes)} ({x.checkpoints} checkpoints, {x.storage_class})" for x in f.stored)
    lines.append(f"            at the end: {held} = {human_bytes(f.stored_bytes)}, {st.stored_fraction:.1%} of keep-all "
                 f"({human_bytes(f.keep_all_bytes)}); peak {human_bytes(st.peak_bytes)}")
    c = st.currency
    lines.append(f"cost        {money(st.monthly_cost, c)}/month{star} against {money(st.keep_all_monthly_cost, c)}/month{star} "
                 f"keep-all ({st.cost_fraction:.1%}); over the run {money(st.run_cost, c)}{star} against "
                 f"{money(st.keep_all_run_cost, c)}{star}")
    if st.requests_cost:
        lines.append(f"            (includes {money(st.requests_cost, c)}{star} of PUT requests over the run)")
    if st.restore_cost is not None:
        coldest = [x for x in f.stored if x.tier == "archive"][-1]
        lines.append(f"            reading one archived checkpoint back from {coldest.storage_class}: {money(st.restore_cost, c)}{star}")
    if st.approximation:
        lines.extend(textwrap.wrap(f"({st.approximation})", 110, initial_indent=" " * 12, subsequent_indent=" " * 13))
    if star:
        lines.append(f"            * {st.price_note}")
    else:
        lines.append(f"            prices: {st.price_note}")
    for origin, label in (("measured", "measured"), ("given", "given"), ("default", "assumed")):
        shown = [f"{x.name} {x.value}" for x in a.assumptions if x.origin == origin and x.name != "params"]
        if shown:
            tail = " (defaults; each one's source: --json, or docs/planning-and-pricing.md)" if origin == "default" else ""
            text = ", ".join(shown) + tail
            lines.extend(textwrap.wrap(text, 110, initial_indent=f"{label:<12}", subsequent_indent=" " * 12))
    return lines


def _seconds(a: Any) -> float:
    from ckptier.tasks.durations import parse_duration  # lazy: every command builds this parser

    return parse_duration(a.value).total_seconds()


# ------------------------------------------------------------------ lifecycle


def cmd_lifecycle(args: argparse.Namespace) -> int:
    from ckptier.tasks.lifecycle import job_prefix_url, lifecycle_for_job  # lazy: --version and --help stay light
    from ckptier.tasks.run import unknown_job  # lazy: likewise

    from .output import print_json  # lazy: likewise

    settings = settings_of(args, config=True)
    config = settings.config
    with open_existing(args, settings) as cat:
        records = cat.checkpoints(job=args.job, include_deleted=True, with_files=False)
    if not records:
        raise unknown_job(args.job)
    policy = config.policy_for(args.job)
    if policy is None:
        raise ConfigError(f"job {args.job!r}: no [[policy]] of {config.source or 'the built-in config'} matches it; add one")
    result = lifecycle_for_job(args.job, hot_url=job_prefix_url(records), policy=policy, bucket=args.bucket)
    if args.json:
        print_json(result.document())
        return 0
    print(f"# S3 lifecycle rules for job {result.job} in bucket {result.bucket}"
          f" (hot prefix: {result.hot_prefix if result.hot_prefix is not None else '-'},"
          f" archive prefix: {result.archive_prefix if result.archive_prefix is not None else '-'})")
    for note in result.notes:
        print(f"# {note}")
    print(f"# apply: ckptier lifecycle --job {args.job} --bucket {result.bucket} --json > rules.json && "
          f"aws s3api put-bucket-lifecycle-configuration --bucket {result.bucket} --lifecycle-configuration file://rules.json")
    print_json(result.document())
    return 0


# ------------------------------------------------------------------ parsers


def add_commands(add: Callable[..., argparse.ArgumentParser]) -> None:
    """Register ``advise`` and ``lifecycle`` with the CLI's ``add`` helper."""
    sp = add("advise", cmd_advise, "size, bandwidth, checkpoint interval, stored bytes and cost of a run, before or during it")
    sp.add_argument("--params", metavar="N", help="parameters: 7e9, 7B, 1.5T (needed unless --job has measured sizes)")
    sp.add_argument("--dtype", choices=tuple(DTYPE_BYTES), help="training dtype of the weights (default bf16)")
    sp.add_argument("--optimizer", choices=tuple(OPTIMIZER_STATES), help="default adamw")
    sp.add_argument("--state-dtype", choices=tuple(DTYPE_BYTES), help="dtype of the optimizer's moments (default bf16)")
    sp.add_argument("--master-weights", choices=("fp32", "none"),
                    help="fp32: mixed precision saves an fp32 master copy of the weights (default unless --dtype fp32)")
    sp.add_argument("--ranks", type=whole(1, 1_000_000, what="a number of ranks"), help="ranks sharing a save (default 1)")
    sp.add_argument("--write-window", metavar="D", type=duration(), help="time a save may take (default 5min)")
    sp.add_argument("--write-bandwidth", metavar="RATE", help="what storage really delivers, e.g. 2GB/s (default: exactly what the window needs)")
    sp.add_argument("--interval", metavar="D", type=duration(), help="planned time between saves (default 30min)")
    sp.add_argument("--mtbf", metavar="D", type=duration(), help="mean time between failures of the job (default 8h)")
    sp.add_argument("--restart", metavar="D", type=duration(timedelta(0)), help="time to restart after a failure (default 0)")
    sp.add_argument("--run-length", metavar="D", type=duration(timedelta(hours=1), MAX_RUN_LENGTH), help="length of the run (default 21d)")
    sp.add_argument("--steps-per-save", type=whole(1, 10**12, what="a number of steps"), metavar="N", help="training steps between saves (default 1000)")
    sp.add_argument("--codec-ratio", type=number(0, 1000, what="a compression ratio"), metavar="R", help="archive compression ratio (default 1.24)")
    sp.add_argument("--hot-class", choices=ALL_CLASSES, help="where hot checkpoints are billed (default hot: local storage)")
    sp.add_argument("--part-size", metavar="SIZE", help="multipart part size of saves to S3 (default 8MiB)")
    sp.add_argument("--policy", metavar="PATH", help="ckptier.toml whose policy and prices to use (default: --config)")
    sp.add_argument("--job", help="take size, interval, steps, ranks and codec ratio from this job in the catalog")
    sp.add_argument("--json", action="store_true")

    sp = add("lifecycle", cmd_lifecycle, "the job's policy as S3 bucket lifecycle rules (a backstop S3 enforces itself)")
    sp.add_argument("--job", required=True)
    sp.add_argument("--bucket", help="the bucket to write rules for, when hot and archive live in different ones")
    sp.add_argument("--json", action="store_true", help="print only the LifecycleConfiguration document")
