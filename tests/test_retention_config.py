"""``[[policy]]`` keys of the retention rules, and the one duration parser every key and option uses.

Each refusal is one line naming the key, the value and the fix; a bare ``m``
names both of its readings. A table that sets any rule gets exactly its own
rules (no hidden ``keep_last``); one that sets none previews the documented
defaults and never deletes.
"""

from __future__ import annotations

from datetime import datetime, timedelta, UTC

import pytest

from ckptier.flows.cli import main
from ckptier.storage.errors import ConfigError
from ckptier.tasks.config import DEFAULT_RULES, parse_config
from ckptier.tasks.durations import Span, duration_problem, format_duration, parse_duration, parse_span
from ckptier.tasks.retention import (
    KeepBest,
    KeepDaily,
    KeepHourly,
    KeepLast,
    KeepMonthly,
    KeepWithin,
    KeepYearly,
    Milestones,
)

H = timedelta(hours=1)
D = timedelta(days=1)


# ------------------------------------------------------------------ durations


@pytest.mark.parametrize(("text", "expected"), [
    ("36h", 36 * H), ("1d12h", 36 * H), ("90s", timedelta(seconds=90)), ("30min", timedelta(minutes=30)),
    ("2w", 14 * D), ("1h30min", timedelta(minutes=90)), ("0s", timedelta(0)), (" 7D ", 7 * D),
])
def test_fixed_durations(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected
    assert parse_duration(format_duration(expected)) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("6mo", Span(6)), ("1y", Span(12)), ("1y6mo", Span(18)), ("1y2mo3d4h", Span(14, 3 * D + 4 * H)), ("36h", Span(0, 36 * H)),
])
def test_calendar_durations(text: str, expected: Span) -> None:
    assert parse_span(text) == expected
    assert parse_span(format_duration(expected)) == expected


def test_a_bare_m_is_refused_naming_both_readings() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_span("6m", what="keep_within = '6m'")
    assert str(exc.value) == "keep_within = '6m': minutes or months? write \"6min\" or \"6mo\""
    assert duration_problem("1h30m", calendar_units=True) == 'minutes or months? write "1h30min" or "1h30mo"'
    # where months cannot be meant (a fixed length), the fix says so
    assert duration_problem("2m") == 'minutes or months? write "2min" for minutes (months have no fixed length here)'


@pytest.mark.parametrize("text", ["", "7", "d", "7 days", "-1h", "1.5h", "1x", "m", "h1"])
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="not a duration"):
        parse_span(text)


def test_months_and_years_have_no_fixed_length() -> None:
    with pytest.raises(ConfigError, match="months and years have no fixed length here"):
        parse_duration("1y")
    with pytest.raises(ConfigError, match="months and years have no fixed length here"):
        parse_duration("6mo")
    assert format_duration(timedelta(minutes=90)) == "1h30min"
    assert format_duration(Span(25, 2 * H)) == "2y1mo2h"


# ------------------------------------------------------------------ [[policy]] keys


def _policy(body: str):  # type: ignore[no-untyped-def]
    cfg = parse_config("[[policy]]\n" + body, where="ckptier.toml")
    return cfg, cfg.policies[0]


def test_new_rule_keys() -> None:
    _, p = _policy(
        'keep_best = [{ metric = "eval_loss", mode = "min", n = 3 }, { metric = "acc", mode = "max", n = 1, '
        'keep_without_metric = false }]\nkeep_hourly = 24\nkeep_monthly = 12\nkeep_yearly = 3\n'
        'keep_within = "6mo"\ntimezone = "Europe/Berlin"\n'
    )
    assert p.rules == (
        KeepBest("eval_loss", "min", 3), KeepBest("acc", "max", 1, keep_without_metric=False),
        KeepWithin(Span(6), timezone="Europe/Berlin"), KeepHourly(24, timezone="Europe/Berlin"),
        KeepMonthly(12, timezone="Europe/Berlin"), KeepYearly(3, timezone="Europe/Berlin"),
    )
    assert p.timezone == "Europe/Berlin"
    _, one = _policy('keep_best = { metric = "val_loss", n = 2 }\n')
    assert one.rules == (KeepBest("val_loss", "min", 2),)
    _, m = _policy('milestones = { every_n_steps = 1000, max_to_keep = 5 }\n')
    assert m.rules == (Milestones(every=1000, max_to_keep=5),)
    _, t = _policy('milestones = { every = "6h" }\ntimezone = "Asia/Tokyo"\n')
    assert t.rules == (Milestones(interval=6 * H, timezone="Asia/Tokyo"),)
    _, w = _policy('keep_within = "36h"\narchive = "/arch"\narchive_after = "1y"\n')
    assert w.rules == (KeepWithin(36 * H),) and w.archive_after == Span(12)


def test_a_table_with_rules_gets_exactly_its_own_rules() -> None:
    """No hidden keep_last 3: 'one per day' is one per day (plus the documented floors)."""
    cfg, p = _policy("keep_daily = 1\n")
    assert p.rules == (KeepDaily(1),) and not cfg.unwritten
    cfg, p = _policy('jobs = "x-*"\n')  # no rule at all: the documented defaults, preview only
    assert p.rules == DEFAULT_RULES == (KeepLast(3),) and cfg.unwritten == {0}
    with pytest.raises(ConfigError, match=r"policy\[0\] \(jobs = \"\*\"\) keeps nothing: set keep_last ≥ 1, or one of"):
        _policy("keep_last = 0\n")


@pytest.mark.parametrize(("body", "parts"), [
    ('keep_within = "6m"\n', ('policy[0].keep_within = "6m"', 'minutes or months? write "6min" or "6mo"')),
    ('keep_last = 1\ngrace = "90m"\n', ('policy[0].grace = "90m"', 'write "90min" for minutes')),
    ('keep_last = 1\ngrace = "1mo"\n', ('policy[0].grace = "1mo"', "no fixed length here", "'30d'")),
    ('keep_last = 1\narchive = "/a"\narchive_after = "2m"\n', ("policy[0].archive_after", '"2min" or "2mo"')),
    ('milestones = { every = "6m" }\n', ("policy[0].milestones", 'every = "6m"', "minutes or months?")),
    ('milestones = { every = 600 }\n', ("policy[0].milestones", "{ every_n_steps = 600 }")),
    ('milestones = { every = "6h" }\nmilestone_match = "exact"\n', ("policy[0].milestone_match", "first save of each interval")),
    ('milestones = { every_n_steps = 100, max_to_keep = 0 }\n', ("policy[0].milestones", "max_to_keep must be a whole number ≥ 1")),
    ('keep_best = { metric = "eval_loss", mode = "lowest", n = 3 }\n', ("policy[0].keep_best", 'mode must be "min"')),
    ('keep_best = { metric = "eval_loss" }\n', ("policy[0].keep_best", "n must be a whole number ≥ 1")),
    ('keep_best = { metric = "eval_loss", n = 1, top = 3 }\n', ("policy[0].keep_best", "unknown key top")),
    ('keep_best = [{ metric = "a", n = 1 }, { n = 1 }]\n', ("policy[0].keep_best", "entry 1: metric must name the metric")),
    ('keep_best = "eval_loss"\n', ("policy[0].keep_best", "must be a table or a list of tables")),
    ('keep_daily = 1\ntimezone = "Mars/Olympus"\n', ('policy[0].timezone = "Mars/Olympus"', "IANA name")),
    ('keep_hourly = -1\n', ("policy[0].keep_hourly = -1", "must be ≥ 0")),
])
def test_bad_keys_are_one_line_naming_key_value_and_fix(body: str, parts: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as exc:
        _policy(body)
    message = str(exc.value)
    assert "\n" not in message and message.startswith("ckptier.toml: ")
    for part in parts:
        assert part in message, message


def test_every_duration_key_and_option_uses_the_one_parser(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """[runner] lease, [[drill]] timeout, [[pattern]] settle and the command line's durations all refuse a bare m."""
    for text, key in (('[runner]\nlease = "2m"\n', "runner.lease"), ('[[drill]]\ntimeout = "15m"\n', "drill[0].timeout"),
                      ('[[pattern]]\nglob = "a/**"\nstep_regex = "s(?P<step>\\\\d+)"\nsettle = "2m"\n', "pattern[0].settle")):
        with pytest.raises(ConfigError) as exc:
            parse_config(text)
        assert f'{key} = "' in str(exc.value) and 'm": minutes or months?' in str(exc.value), str(exc.value)
    assert parse_config('[runner]\nlease = "2min"\n').runner.lease == timedelta(minutes=2)
    for argv in (["janitor", "--older-than", "24m"], ["advise", "--params", "7B", "--interval", "30m"]):
        code = main([argv[0], "--catalog", f"sqlite:///{tmp_path}/none.db", *argv[1:]] if argv[0] == "janitor" else argv)
        err = capsys.readouterr().err.strip()
        assert code == 2 and "minutes or months?" in err and err.count("\n") == 0, err
        assert f"{argv[-2]}: '{argv[-1]}'" in err


def test_plan_day_buckets_follow_the_timezone_key() -> None:
    from ckptier.storage.records import CheckpointRecord, Format, State
    from ckptier.tasks.retention import plan_retention

    t = datetime(2024, 3, 2, 3, tzinfo=UTC)  # 22:00 on 1 March in New York; saves at 22:00, 23:30, 00:30 there
    cs = [CheckpointRecord(id=i + 1, job="j", step=s, format=Format.GUIDE, state=State.VERIFIED, location=f"file:///j/{s}",
                           bytes=1, saved_at=t + dt, first_seen=t, last_seen=t, missing_since=None, verified_at=t,
                           state_reason=None) for i, (s, dt) in enumerate(((100, 0 * H), (200, 1.5 * H), (300, 2.5 * H)))]
    _, ny = _policy('keep_daily = 2\ntimezone = "America/New_York"\nmin_verified = 0\n')
    plan = plan_retention(cs, ny, now=t + D)
    assert [(i.step, i.action) for i in plan.items] == [(100, "delete"), (200, "keep"), (300, "keep")]
    assert plan.items[1].reasons == ("keep_daily 2: newest of 2024-03-01 (America/New_York)",)
    # the same saves are all on 2 March in UTC: one day, so restic's rule keeps the oldest too
    _, utc = _policy("keep_daily = 2\nmin_verified = 0\n")
    plan = plan_retention(cs, utc, now=t + D)
    assert [(i.step, i.action) for i in plan.items] == [(100, "keep"), (200, "delete"), (300, "keep")]


def test_plan_prints_the_floors_and_no_hidden_rule(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """'One per day' plans as one per day: the policy line has no keep_last, and the floors are printed."""
    import json
    import os
    import time

    hot = tmp_path / "hot"
    for step in (100, 200, 300):
        d = hot / "job" / f"step-{step:08d}"
        (d / "rank-0000").mkdir(parents=True)
        (d / "rank-0000" / "model.pt").write_bytes(b"w")
        (d / "metadata.json").write_text(json.dumps({"step": step}))
    t = time.time() - 3600
    for dirpath, _dirs, files in os.walk(hot):
        for name in files:
            os.utime(os.path.join(dirpath, name), (t, t))
    config = tmp_path / "ckptier.toml"
    config.write_text('[[policy]]\nkeep_daily = 1\ntimezone = "Asia/Tokyo"\nmin_verified = 0\n')
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    assert main(["scan", "--catalog", url, str(hot)]) == 0
    assert main(["verify", "--catalog", url, "--no-prefect"]) == 0
    capsys.readouterr()
    assert main(["plan", "--catalog", url, "--config", str(config)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == f"policy: policy[0] (jobs = '*') in {config}: keep_daily 1, timezone Asia/Tokyo, grace 2h, min_verified 0"
    assert out[2].startswith("  floors: the newest verified checkpoint is never deleted; incomplete saves in flight")
    assert "min_verified 0: at least 0 verified checkpoints keep a hot copy" in out[2]
    rows = [line for line in out if line.startswith("job ")]
    assert [r.split()[1] for r in rows if " delete " in r] == ["100", "200"]
    assert any("keep_daily 1: newest of " in r and "(Asia/Tokyo)" in r for r in rows)
