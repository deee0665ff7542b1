"""Durations, spelled one way everywhere: ``ckptier.toml`` keys and command-line options.

A duration is one or more parts, each a whole number and a unit, largest
first or not: ``"36h"``, ``"1d12h"``, ``"90s"``, ``"30min"``, ``"6mo"``,
``"1y6mo"``.

====  =======================================
unit  means
====  =======================================
s     seconds
min   minutes
h     hours
d     days (24 hours)
w     weeks (7 days)
mo    calendar months
y     calendar years (12 months)
====  =======================================

A bare ``m`` is refused: restic reads it as months, most other tools as
minutes, and a retention window read the wrong way deletes or keeps the
wrong checkpoints. The refusal names both readings
(``"6m": minutes or months? write "6min" or "6mo"``).

Months and years have no fixed length, so they are only accepted where a
duration is measured back from a moment on the calendar (a :class:`Span`,
e.g. ``keep_within`` and ``archive_after``); everywhere else a duration is
a fixed :class:`~datetime.timedelta` and ``mo`` / ``y`` are refused with the
fix (``write days, e.g. "30d"``). Pure: no clock, no I/O.
"""

from __future__ import annotations

import calendar
import re
from dataclasses import dataclass
from datetime import datetime, timedelta, tzinfo

from ckptier.storage.errors import ConfigError

__all__ = [
    "FIXED_UNITS", "DurationTooLong", "Span", "UNITS", "duration_problem", "format_duration", "parse_duration", "parse_span",
]

#: Seconds in each fixed unit, largest first (the order :func:`format_duration` writes them in).
_SECONDS = {"w": 604800, "d": 86400, "h": 3600, "min": 60, "s": 1}
#: Months in each calendar unit, largest first.
_MONTHS = {"y": 12, "mo": 1}
#: The units, as written in messages.
FIXED_UNITS = "s, min, h, d, w"
UNITS = "s, min, h, d, w, mo, y"

# Longest unit first, so that "min" and "mo" are never read as "m" followed by more.
_PART = re.compile(r"(\d+)(min|mo|s|h|d|w|y|m)")


@dataclass(frozen=True)
class Span:
    """A duration that may hold calendar months: ``months`` (a year is 12)
    plus a fixed part. :meth:`before` is the moment that long before a given
    one: months are counted back on the calendar of that moment's time zone
    (the day of the month clamped to the month's length: a month before
    31 March is 28 or 29 February), then the fixed part is subtracted."""

    months: int = 0
    fixed: timedelta = timedelta(0)

    @staticmethod
    def of(value: Span | timedelta) -> Span:
        """``value`` as a span (a timedelta is its fixed part)."""
        return value if isinstance(value, Span) else Span(0, value)

    def is_positive(self) -> bool:
        """Longer than zero (months are never negative when parsed)."""
        return self.months > 0 or (self.months == 0 and self.fixed > timedelta(0))

    def before(self, t: datetime, tz: tzinfo | None = None) -> datetime:
        """The moment this span before ``t``; months counted in ``tz`` (default: ``t``'s own zone)."""
        local = t.astimezone(tz) if tz is not None else t
        if self.months:
            month0 = local.year * 12 + (local.month - 1) - self.months
            year, month = divmod(month0, 12)
            day = min(local.day, calendar.monthrange(year, month + 1)[1])
            local = local.replace(year=year, month=month + 1, day=day)
        return (local - self.fixed).astimezone(t.tzinfo)

    def __str__(self) -> str:
        return format_duration(self)


def duration_problem(text: object, *, calendar_units: bool = False, example: str = "36h") -> str | None:
    """Why ``text`` is not a duration, as the fix to print after ``key = value:``, or None.

    ``calendar_units``: whether months and years (``mo``, ``y``) are allowed;
    ``example``: a good value for the key, shown in the fix.
    """
    units = UNITS if calendar_units else FIXED_UNITS
    if not isinstance(text, str):
        return f"must be a duration string: a number and a unit ({units}), e.g. {example!r}"
    s = text.strip().lower()
    parts = _PART.findall(s)
    if not s or "".join(n + u for n, u in parts) != s:
        return f"not a duration: write a number and a unit ({units}), e.g. {example!r} or '1d12h'"
    if any(u == "m" for _, u in parts):
        as_min = "".join(n + ("min" if u == "m" else u) for n, u in parts)
        as_mo = "".join(n + ("mo" if u == "m" else u) for n, u in parts)
        if calendar_units:
            return f"minutes or months? write \"{as_min}\" or \"{as_mo}\""
        return f"minutes or months? write \"{as_min}\" for minutes (months have no fixed length here)"
    if not calendar_units and any(u in _MONTHS for _, u in parts):
        return "months and years have no fixed length here: write days or weeks, e.g. '30d' or '52w'"
    return None


def _parts(text: str, what: str | None, calendar_units: bool) -> list[tuple[str, str]]:
    problem = duration_problem(text, calendar_units=calendar_units)
    if problem is not None:
        raise ConfigError(f"{what or f'duration {text!r}'}: {problem}")
    return _PART.findall(text.strip().lower())


def parse_duration(text: str, *, what: str | None = None) -> timedelta:
    """A fixed duration (``s``, ``min``, ``h``, ``d``, ``w``) as a timedelta.

    Raises :class:`ConfigError` (a ``ValueError``) on anything else: a bare
    ``m`` (minutes or months?), ``mo`` or ``y`` (no fixed length), no unit, a
    sign or a fraction; its one line starts with ``what`` (how the caller
    names the value, e.g. ``--older-than '6m'``; default ``duration '6m'``).
    """
    return _fixed(sum(int(n) * _SECONDS[u] for n, u in _parts(text, what, False)), text, what)


class DurationTooLong(ConfigError):
    """A duration longer than any :class:`~datetime.timedelta` (``99999999999d``)."""


#: The longest fixed duration there is (``timedelta.max``), in whole seconds.
_MAX_SECONDS = int(timedelta.max.total_seconds())


def _fixed(seconds: int, text: str, what: str | None) -> timedelta:
    """``seconds`` as a timedelta; one-line :class:`ConfigError` when no timedelta is that long."""
    if seconds > _MAX_SECONDS:
        raise DurationTooLong(f"{what or f'duration {text!r}'}: too long; a duration is at most "
                          f"{timedelta.max.days:,}d, e.g. '36h' or '30d'")
    return timedelta(seconds=seconds)


def parse_span(text: str, *, what: str | None = None) -> Span:
    """A duration that may hold calendar months and years (``mo``, ``y``) as a :class:`Span`.

    Raises :class:`ConfigError` as :func:`parse_duration` does.
    """
    parts = _parts(text, what, True)
    months = sum(int(n) * _MONTHS[u] for n, u in parts if u in _MONTHS)
    seconds = sum(int(n) * _SECONDS[u] for n, u in parts if u in _SECONDS)
    if months > 12 * 9000:
        raise DurationTooLong(f"{what or f'duration {text!r}'}: too long; months and years count at most 9000y, e.g. '6mo'")
    return Span(months, _fixed(seconds, text, what))


def format_duration(delta: timedelta | Span) -> str:
    """The shortest exact spelling of ``delta`` that :func:`parse_duration`
    (:func:`parse_span` for months) reads back; ``"0s"`` for zero. Fractions
    of a second are dropped."""
    span = Span.of(delta)
    parts = []
    years, months = divmod(span.months, 12)
    if years:
        parts.append(f"{years}y")
    if months:
        parts.append(f"{months}mo")
    total = int(span.fixed.total_seconds())
    sign = "-" if total < 0 else ""
    total = abs(total)
    for unit, size in _SECONDS.items():
        n, total = divmod(total, size)
        if n:
            parts.append(f"{n}{unit}")
    return sign + "".join(parts) if parts else "0s"
