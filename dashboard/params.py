"""The one place the dashboard reads numbers from a request.

Every numeric query parameter and form field goes through :func:`int_param`
with its bounds, so that no number the catalog cannot hold (a step past
BIGINT, a page past the table's end) ever reaches a query: out of range or
not a number is a :class:`BadParam`, which the app answers with ``400`` and
one line naming the parameter, the value and the range.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The largest step the catalog holds (a signed 64-bit ``BIGINT`` column).
MAX_STEP = 2**63 - 1
#: Rows per page of a paginated table: the default and the bounds of ``?per=``.
PAGE_SIZE = 50
MIN_PAGE_SIZE = 10
MAX_PAGE_SIZE = 500
#: The highest ``?page=`` accepted (far past any table; a page past the end shows the last one).
MAX_PAGE = 10**7
#: Values longer than this are refused before ``int()`` reads them (Python's own limit is 4,300 digits).
_MAX_DIGITS = 25


class BadParam(ValueError):
    """A request parameter that is not a number in its range; the message is one line."""


@dataclass(frozen=True)
class Bounds:
    """The accepted range of one parameter, both ends included."""

    lo: int
    hi: int


STEP = Bounds(0, MAX_STEP)
PAGE = Bounds(1, MAX_PAGE)
PER = Bounds(MIN_PAGE_SIZE, MAX_PAGE_SIZE)


def int_param(name: str, text: str | None, bounds: Bounds, *, default: int | None = None) -> int | None:
    """``text`` (a query parameter or form field named ``name``) as an int within ``bounds``.

    None or blank: ``default``. Anything else that is not a plain decimal
    integer in ``[bounds.lo, bounds.hi]`` raises :class:`BadParam`.
    """
    if text is None or not text.strip():
        return default
    raw = text.strip()
    shown = raw if len(raw) <= 40 else raw[:40] + "…"
    digits = raw[1:] if raw[:1] in "+-" else raw
    if not digits.isascii() or not digits.isdigit():
        raise BadParam(f"{name}={shown} is not a whole number; give one from {bounds.lo:,} to {bounds.hi:,}")
    if len(digits.lstrip("0")) > _MAX_DIGITS or not bounds.lo <= int(raw) <= bounds.hi:
        raise BadParam(f"{name}={shown} is out of range; give one from {bounds.lo:,} to {bounds.hi:,}")
    return int(raw)


def required_int(name: str, text: str | None, bounds: Bounds) -> int:
    """As :func:`int_param`, for a parameter the route cannot do without."""
    value = int_param(name, text, bounds)
    if value is None:
        raise BadParam(f"{name} is missing; give one from {bounds.lo:,} to {bounds.hi:,}")
    return value
