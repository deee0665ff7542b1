"""The command line's one validation layer: the parser every command is built
with, the value types its options use, and the global options.

Every ``ckptier`` parser is a :class:`Parser`: a prefix of a long option is
not accepted (``--al`` is not ``--all``); a word that starts with a minus and
a digit (``-1``, ``-1h``, ``-7e9``) is a value to check, never an unknown
option; a usage error is one line naming the command and ``--help``.

Values are checked as they are parsed, each refusal naming the option, the
value and the allowed range: bounded whole numbers (:func:`whole`, e.g.
:data:`STEP`), bounded numbers (:func:`number`), durations within a range
(:func:`duration`) and non-empty names (:func:`name`). Nothing here imports
more than the standard library and :mod:`ckptier.tasks.durations` (lazily):
``ckptier --version`` and ``--help`` stay light.

:func:`finish` runs once over the whole parser after every command is
registered (a command module's ``add_commands`` included), so a command added
later gets the same rules: the options of :data:`GLOBAL_DESTS` are accepted
before or after the command (as git, aws and restic accept theirs), every
``--job`` is a non-empty name, and no parser accepts abbreviations.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

from ckptier.storage.errors import CkptierError

#: The largest whole number the catalog stores (a signed 64-bit integer): steps, counts.
INT64_MAX = 2**63 - 1
#: The longest duration an option takes: a century (far past any retention or
#: run, well inside the calendar arithmetic that measures back from now).
MAX_DURATION = timedelta(days=36500)
#: Options accepted before or after the command: ``ckptier --catalog URL ls``
#: is ``ckptier ls --catalog URL``. ``json`` is global where the command has
#: ``--json``; before a command without it, it is refused.
GLOBAL_DESTS = ("catalog", "config", "verbose", "quiet", "json")


class UsageError(CkptierError):
    """The command line itself is wrong (a missing or malformed argument)."""


class Parser(argparse.ArgumentParser):
    """argparse, with the rules of the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        # argparse takes "-1" for a value but "-1h" or "-7e9" for an unknown option ("expected
        # one argument"); a minus and a digit is a value here (as Python 3.13's argparse reads it),
        # so the option's type says what is wrong with it.
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> NoReturn:
        command = self.prog.partition(" ")[2]
        raise UsageError(f"{command + ': ' if command else ''}{message} (see '{self.prog} --help')")


def _figure(n: float) -> str:
    return f"{n:,}" if isinstance(n, int) else f"{n:g}"


def whole(lo: int, hi: int = INT64_MAX, *, what: str = "a whole number") -> Callable[[str], int]:
    """An option type: a whole number from ``lo`` to ``hi``; ``what`` names it in the refusal."""

    def parse(text: str) -> int:
        allowed = f"{what} from {_figure(lo)} to {_figure(hi)}"
        try:
            value = int(text.strip().replace("_", ""), 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {allowed}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{text!r} is out of range: {allowed}")
        return value

    parse.__name__ = "whole number"
    return parse


def number(lo: float, hi: float, *, what: str = "a number", lo_open: bool = True) -> Callable[[str], float]:
    """An option type: a finite number above ``lo`` (from ``lo`` with ``lo_open=False``) up to ``hi``."""

    def parse(text: str) -> float:
        allowed = f"{what} {'above' if lo_open else 'from'} {_figure(lo)} up to {_figure(hi)}"
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {allowed}") from None
        if not math.isfinite(value) or not (lo < value if lo_open else lo <= value) or value > hi:
            raise argparse.ArgumentTypeError(f"{text!r} is out of range: {allowed}")
        return value

    parse.__name__ = "number"
    return parse


def duration(lo: timedelta = timedelta(seconds=1), hi: timedelta = MAX_DURATION, *,
             why: str = "") -> Callable[[str], timedelta]:
    """An option type: a fixed duration (``90s``, ``30min``, ``36h``, ``7d``, ``2w``) from
    ``lo`` to ``hi``; ``why`` (optional) says in the refusal what a shorter one would do."""

    def parse(text: str) -> timedelta:
        from ckptier.tasks.durations import (  # lazy: --help stays light
            DurationTooLong,
            format_duration,
            parse_duration,
        )

        def show(d: timedelta) -> str:  # 36500d, not 5214w2d
            return f"{d.days}d" if d >= timedelta(days=1) and not d % timedelta(days=1) else format_duration(d)

        allowed = f"a duration from {show(lo)} to {show(hi)}, e.g. {show(max(lo, min(hi, timedelta(days=1))))}"
        if text.strip().startswith("-"):
            raise argparse.ArgumentTypeError(f"{text!r} is negative: {allowed}")
        try:
            value = parse_duration(text, what=repr(text))
        except DurationTooLong:
            raise argparse.ArgumentTypeError(f"{text!r} is out of range: {allowed}") from None
        except CkptierError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if not lo <= value <= hi:
            because = f" ({why})" if why and value < lo else ""
            raise argparse.ArgumentTypeError(f"{text!r} is out of range{because}: {allowed}")
        return value

    parse.__name__ = "duration"
    return parse


def name(what: str = "a job name") -> Callable[[str], str]:
    """An option type: a non-empty name (an empty ``--job ''`` is a mistake, never "every job")."""

    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{text!r} is empty: give {what}; 'ckptier ls' lists them")
        return text

    parse.__name__ = "name"
    return parse


#: A checkpoint's step: what the catalog can hold.
STEP = whole(0, INT64_MAX, what="a step number")
#: Whatever the command does in parallel.
WORKERS = whole(1, 1024, what="a number of workers")
JOB = name()


def add_globals(parser: argparse.ArgumentParser, *, before_command: bool) -> None:
    """The global options (:data:`GLOBAL_DESTS` but ``json``) on ``parser``: the top-level
    parser (``before_command``, with their defaults) or every command's (no default, so a
    value given before the command stands unless the option is given again after it)."""
    d: dict[str, Any] = {} if before_command else {"default": argparse.SUPPRESS}
    parser.add_argument("--catalog", metavar="URL", **d,
                        help="catalog SQLAlchemy URL (default: $CKPTIER_CATALOG_URL, else [catalog] url in "
                             "ckptier.toml, else SQLite in the user data dir)")
    parser.add_argument("--config", metavar="PATH", **d,
                        help="ckptier.toml with [[policy]] and [[drill]] tables (default: $CKPTIER_CONFIG or ./ckptier.toml)")
    parser.add_argument("-v", "--verbose", action="count", **({"default": 0} if before_command else d),
                        help="say more: ckptier's and Prefect's INFO logs (-vv: DEBUG)")
    parser.add_argument("-q", "--quiet", action="count", **({"default": 0} if before_command else d),
                        help="say less: only errors from ckptier's and Prefect's logs")
    if before_command:
        parser.add_argument("--json", action="store_true", default=False,
                            help="machine-readable output, for the commands that have it")


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """``parser``'s commands by name (one level)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def finish(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Apply the module docstring's rules to every command of ``parser`` once all are added."""
    for command in _walk(parser):
        command.allow_abbrev = False
        has_json = False
        for action in command._actions:
            if action.dest == "json" and command is not parser:
                action.default = argparse.SUPPRESS  # a --json given before the command stands
                has_json = True
            if action.dest == "job" and action.type is None and action.option_strings:
                action.type = JOB
        if command is not parser and not subparsers(command):
            command.set_defaults(json_output=has_json)
    return parser


def _walk(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    out = [parser]
    for sp in subparsers(parser).values():
        out.extend(_walk(sp))
    return out


def check_globals(args: argparse.Namespace) -> None:
    """Refuse a global option the command cannot honour (``--json`` before ``demo``)."""
    if getattr(args, "json", False) and not getattr(args, "json_output", True):
        raise UsageError(f"--json: '{args.command}' has no JSON output; drop --json")


def verbosity(args: argparse.Namespace) -> int:
    """``-v`` count minus ``-q`` count (0: the default)."""
    return int(getattr(args, "verbose", 0) or 0) - int(getattr(args, "quiet", 0) or 0)


def apply_verbosity(level: int) -> Callable[[], None]:
    """Make ckptier's loggers and Prefect's follow ``-v``/``-q`` (``level``: :func:`verbosity`);
    the undo, to call when the command ends. Level 0 changes nothing; 1 shows INFO, 2 or more
    DEBUG, -1 only errors, -2 or less only critical ones. Prefect reads its level
    (``PREFECT_LOGGING_LEVEL``; its server's, ``PREFECT_SERVER_LOGGING_LEVEL``, when quieter)
    when it is first imported: later, by the commands that start it."""
    import logging  # lazy: most commands never log
    import os
    import sys

    if level == 0:
        return lambda: None
    chosen = "DEBUG" if level >= 2 else "INFO" if level == 1 else "ERROR" if level == -1 else "CRITICAL"
    env = {"PREFECT_LOGGING_LEVEL": chosen, **({"PREFECT_SERVER_LOGGING_LEVEL": chosen} if level < 0 else {})}
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    logger = logging.getLogger("ckptier")
    saved = (logger.level, logger.propagate)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("ckptier: %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(chosen)
    logger.propagate = False  # said once, not again by a handler Prefect puts on the root logger

    def undo() -> None:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    return undo
