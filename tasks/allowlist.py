"""Checking a drill's allow list before anything is fetched.

The rules themselves (which classes may be allowed) are pure and live with
the safe loader in :mod:`ckptier.formats.allowlist`; this module runs them,
importing the user's own modules only in a separate, confined,
credential-free process (``python -m ckptier.tasks.allowlist NAME...``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from ckptier.formats.allowlist import *  # noqa: F403 - the rules, re-exported for callers of this module
from ckptier.formats.allowlist import ALREADY_ALLOWED, allow_global_check, is_library_global
from ckptier.formats.names import allow_global_problem
from ckptier.storage.errors import ConfigError


# --- checking a drill's allow list before anything is fetched ------------------


def check_allow_globals(names: Iterable[str], *, workdir: Path | None = None, timeout: float = 120.0) -> dict[str, str | None]:
    """``{name: why not, or None}`` for every name.

    Standard-library, numpy and torch names are inspected here; the user's
    own modules are imported only in a child process with the drill worker's
    credential-free environment, its writes confined to a temporary
    directory (:mod:`ckptier.tasks.confine`), as the drill will import them.
    """
    verdicts: dict[str, str | None] = {}
    isolated: list[str] = []
    for name in dict.fromkeys(names):
        problem = allow_global_problem(name)
        if problem is not None or name in ALREADY_ALLOWED:
            verdicts[name] = problem
        elif is_library_global(name):
            verdicts[name] = allow_global_check(name)
        else:
            isolated.append(name)
    if isolated:
        verdicts.update(_check_isolated(isolated, workdir=workdir, timeout=timeout))
    return verdicts


def _check_isolated(names: Sequence[str], *, workdir: Path | None, timeout: float) -> dict[str, str | None]:
    from ckptier.tasks.drill import worker_env  # lazy: the confined child that runs this module stays light

    with tempfile.TemporaryDirectory(prefix="ckptier-allow-", dir=workdir) as tmp:
        scratch = Path(tmp).resolve()
        (scratch / "tmp").mkdir()
        command = [sys.executable, "-m", "ckptier.tasks.confine", "--write", str(scratch), "--",
                   sys.executable, "-m", "ckptier.tasks.allowlist", *names]
        try:
            done = subprocess.run(command, cwd=scratch, env=worker_env(os.environ, scratch), stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return {n: f"importing it to inspect the class took more than {timeout:g} s; fix the module" for n in names}
    try:
        verdicts = json.loads(done.stdout.strip().splitlines()[-1])
        return {n: verdicts[n] for n in names}
    except (ValueError, IndexError, KeyError, TypeError):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {n: f"checking it in a separate process failed (exit {done.returncode}: {last})" for n in names}


def refuse_unsafe(verdicts: Mapping[str, str | None], where: Mapping[str, str]) -> None:
    """Raise :class:`ConfigError` for the first name with a problem, naming
    where it was allowed (``where[name]``, e.g. ``--allow-global``)."""
    for name, problem in verdicts.items():
        if problem is not None:
            raise ConfigError(f"{where.get(name, 'allow-global')} {name!r}: {problem}")


def main(argv: list[str] | None = None) -> int:
    """``python -m ckptier.tasks.allowlist NAME...``: print ``{name: problem}`` as JSON."""
    names = list(sys.argv[1:] if argv is None else argv)
    print(json.dumps({n: allow_global_check(n) for n in names}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
