"""The exit statuses of the ``ckptier`` command line (docs/cli.md's table, which a test keeps equal to :data:`EXIT_CODES`).

Standard library only: the command line and its handler modules share them.
"""

from __future__ import annotations

EXIT_USER_ERROR = 2
EXIT_NOT_FOUND = 1
#: The machine refused (no space, a read-only filesystem, permissions...): one line with the path and the fix.
EXIT_ENVIRONMENT = 1
#: ``apply`` skipped work because another live run holds it (sysexits' EX_TEMPFAIL: try again later).
EXIT_BUSY = 75
#: Exit status of an error ckptier did not expect (a bug): one line, no traceback.
EXIT_INTERNAL = 70
#: Ctrl-C.
EXIT_INTERRUPTED = 130
#: Every exit status and what it means: docs/cli.md's table, which a test keeps equal to this.
EXIT_CODES: dict[int, str] = {
    0: "success",
    EXIT_NOT_FOUND: "the command ran and has a finding: no checkpoint to answer with (`latest`), damage found "
                    "(`verify`), a failed drill or apply step; or the machine refused (a full disk, a read-only "
                    "filesystem, no permission), said in one line with the path and the fix",
    EXIT_USER_ERROR: "bad input, refused before anything changed: a usage error, a value out of range, a broken "
                     "`ckptier.toml`, a catalog that does not exist or is in memory, an unknown job",
    EXIT_INTERNAL: "a bug (sysexits' EX_SOFTWARE): an error ckptier did not expect, in one line; rerun with "
                   "`CKPTIER_TRACEBACK=1` for the traceback and report it",
    EXIT_BUSY: "try again later (sysexits' EX_TEMPFAIL): `apply` skipped work another live run holds",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines included) made one space: an error's one line."""
    return " ".join(str(text).split())
