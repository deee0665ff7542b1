"""``pattern``: checkpoints of a layout ckptier does not know, described by the user.

User :class:`PatternRule`\\ s (``[[pattern]]`` in ``ckptier.toml``) are tried, in
order, first match wins, on files no built-in format claimed. Committed when
the rule's ``commit_marker`` file exists in the checkpoint, and/or once the
newest file is ``settle_seconds`` old (both must hold when both are set).
The checkpoint is the directory whose name holds the step (or the file, when
the step is in a file name); its job is the path above it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from ckptier.formats.base import FormatPlugin, Group, Scan
from ckptier.storage.base import ObjectInfo, key_problem
from ckptier.storage.errors import ConfigError
from ckptier.storage.model import Format

__all__ = ["PLUGIN", "PatternRule", "recognise_patterns"]


@dataclass(frozen=True)
class PatternRule:
    """A user-configured layout: files matching ``glob`` form checkpoints.

    ``glob`` is matched against the whole key (relative to the scan root):
    ``*`` and ``?`` stay within one path segment, ``**`` spans segments
    (``**/`` also matches nothing), ``[...]`` is a character class.
    ``step_regex`` is searched in the key; its group named ``step`` (else its
    first group) must capture decimal digits. The checkpoint's prefix is the
    key up to the end of the path segment holding that group: a step in a
    directory name groups every matching file below it into one checkpoint;
    a step in the file name makes a single-file checkpoint. Commit evidence:
    the newest file is at least ``settle_seconds`` old, and, when
    ``commit_marker`` is set, the file of that relpath exists in the
    checkpoint directory (a marker the trainer writes last; ``glob`` must
    match it too; a single-file checkpoint has no directory, so it never
    commits under a marker rule). With a marker, ``settle_seconds = 0``
    means the marker alone commits.
    """

    glob: str
    step_regex: str
    settle_seconds: float
    commit_marker: str | None = None
    _glob_re: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _step_re: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _group: int | str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.glob:
            raise ConfigError("pattern glob is empty; give a glob such as 'ckpts/iter_*/**'")
        try:
            step_re = re.compile(self.step_regex)
        except re.error as exc:
            raise ConfigError(
                f"pattern step_regex {self.step_regex!r} does not compile ({exc}); fix the regular expression"
            ) from None
        if "step" in step_re.groupindex:
            group: int | str = "step"
        elif step_re.groups >= 1:
            group = 1
        else:
            raise ConfigError(
                f"pattern step_regex {self.step_regex!r} has no group; capture the step, e.g. r'iter_(\\d+)'"
            )
        if not (isinstance(self.settle_seconds, (int, float)) and math.isfinite(self.settle_seconds)) or (
            self.settle_seconds < 0
        ):
            raise ConfigError(
                f"pattern {self.glob!r}: settle_seconds {self.settle_seconds!r} must be a number >= 0 (seconds)"
            )
        if self.commit_marker is not None and key_problem(self.commit_marker) is not None:
            raise ConfigError(
                f"pattern {self.glob!r}: commit_marker {self.commit_marker!r} is not a relative file path; "
                "name a file inside the checkpoint directory, e.g. 'COMMITTED'"
            )
        object.__setattr__(self, "_glob_re", re.compile(_glob_to_regex(self.glob)))
        object.__setattr__(self, "_step_re", step_re)
        object.__setattr__(self, "_group", group)

    def __str__(self) -> str:
        marker = f" marker {self.commit_marker!r}" if self.commit_marker is not None else ""
        return f"pattern {self.glob!r} step {self.step_regex!r}{marker} settle {self.settle_seconds:g}s"


def _glob_to_regex(glob: str) -> str:
    out: list[str] = []
    i, n = 0, len(glob)
    while i < n:
        c = glob[i]
        if c == "*":
            if glob.startswith("**", i):
                if glob.startswith("**/", i):
                    out.append("(?:.*/)?")
                    i += 3
                else:
                    out.append(".*")
                    i += 2
                continue
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = glob.find("]", i + 2 if glob.startswith("[!", i) or glob.startswith("[]", i) else i + 1)
            if j < 0:
                out.append(re.escape(c))
            else:
                body = glob[i + 1 : j]
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = j
        else:
            out.append(re.escape(c))
        i += 1
    return "(?s:" + "".join(out) + r")\Z"



class PatternFormat(FormatPlugin):
    """Claims nothing by itself: :func:`recognise_patterns` runs the user's rules
    over the files every built-in format left."""

    format = Format.PATTERN
    why_factory = "a checkpoint of a user-configured pattern holds files whose layout only your code knows"
    drillable = False

    def recognise(self, group: Group, scan: Scan) -> None:  # pragma: no cover - never anchored
        for f in group.files:
            scan.unclaimed(f)


PLUGIN = PatternFormat()


def recognise_patterns(
    scan: Scan, patterns: Sequence[PatternRule], files_by_rule: dict[tuple[int, str], list[ObjectInfo]]
) -> None:
    """Emit the checkpoints the rules grouped (``(rule index, prefix) -> files``)."""
    for (index, prefix), files in files_by_rule.items():
        rule = patterns[index]
        single = len(files) == 1 and files[0].key == prefix
        m = rule._step_re.search(files[0].key)
        assert m is not None
        step = int(m.group(rule._group))
        if rule.commit_marker is None:
            committed, reason = scan.settled(files, rule.settle_seconds, str(rule))
        else:
            settled = scan.settled(files, rule.settle_seconds, str(rule)) if rule.settle_seconds else (True, "")
            committed, reason = _marked(files, prefix, single, rule.commit_marker, settled)
        scan.emit(
            job=scan.job_of(prefix), step=step, fmt=Format.PATTERN, prefix=prefix, files=files,
            committed=committed, reason=reason, single=single,
        )


def _marked(
    files: Sequence[ObjectInfo], prefix: str, single: bool, marker: str, settled: tuple[bool, str]
) -> tuple[bool, str]:
    """A pattern checkpoint's commit verdict under a ``commit_marker`` rule (and its settle time)."""
    if single:
        return False, f"commit marker {marker!r} cannot be inside a single-file checkpoint; fix the pattern rule"
    key = f"{prefix}/{marker}"
    if not any(f.key == key for f in files):
        return False, f"no {marker}: save in flight or torn"
    committed, reason = settled
    return (True, f"committed: {marker} present") if committed else (False, f"{marker} present but {reason}")
