"""The ``ckptier`` command line (the contract docs/commands.md documents).

The parser is built from a lazy command table: each command names its
handler (in :mod:`ckptier.flows.commands` unless said otherwise), imported
only once the command is chosen, so ``--version``, ``--help`` and a usage
error load the standard library and the argument rules only. A command line
that names a command builds the top level and that command alone
(:func:`parser_for`), which reads it as the whole parser would. Commands that
only read the catalog (``ls``, ``latest``, ``plan``) never import Prefect or
torch (``ls`` and ``latest`` not even the formats, the archive codec or
SQLAlchemy's ORM), so they answer at once, and they never create a
catalog: pointed at one that does not exist they say which one they looked
for. Commands that act (``scan``, ``verify``, ``apply``, ``drill``) run the
same task code directly, or as a Prefect flow run when ``PREFECT_API_URL``
is set (so the run shows in the UI); only ``scan`` and ``rebuild`` create a catalog.

The catalog is chosen by one precedence (``--catalog``, ``CKPTIER_CATALOG_URL``,
``[catalog] url`` in ``ckptier.toml``, the default), and every command that
reads it names it (password masked) in the first line of its human output,
never in ``--json``. Every user error exits non-zero with one line on
stderr, never a traceback; input is checked before anything slow starts.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import re
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta

from ckptier import __version__
from ckptier.storage.errors import CkptierError, EnvironmentFault

from .arguments import (
    STEP,
    WORKERS,
    Parser,
    add_globals,
    apply_verbosity,
    check_globals,
    duration,
    finish,
    number,
    subparsers,
    verbosity,
    whole,
)
from .exits import (  # re-exported: the command line's exit statuses (docs/cli.md)
    EXIT_BUSY as EXIT_BUSY,
    EXIT_CODES as EXIT_CODES,
    EXIT_ENVIRONMENT as EXIT_ENVIRONMENT,
    EXIT_INTERNAL as EXIT_INTERNAL,
    EXIT_INTERRUPTED as EXIT_INTERRUPTED,
    EXIT_NOT_FOUND as EXIT_NOT_FOUND,
    EXIT_USER_ERROR as EXIT_USER_ERROR,
)
from .exits import one_line as _one_line

#: The module that holds the handlers named by a string in the command table.
HANDLERS = "ckptier.flows.commands"


class Handler:
    """A command's handler named ``module:function``, imported when the command runs (the lazy
    command table): building the parser imports no handler module, so ``--version``, ``--help``
    and a usage error answer without the catalog's, the formats' or Prefect's imports.

    With ``paused_gc`` (the short read-only commands a launcher runs at every start: ``ls``,
    ``latest``) the import and the handler run with Python's cyclic garbage collector paused
    (:func:`ckptier.storage.gc_pause.paused_gc`), then restored: they build many objects and no
    cycles to speak of, and each full collection the allocations trigger walks every object
    SQLAlchemy and ckptier's modules created at import, for nothing. Reference counting frees
    everything as usual. :func:`main` run as the program also freezes what is left once such a
    command returned (see there)."""

    def __init__(self, target: str, *, paused_gc: bool = False) -> None:
        self.target = target
        self.paused_gc = paused_gc

    def __call__(self, args: argparse.Namespace) -> int:
        if not self.paused_gc:
            return self._run(args)
        from ckptier.storage.gc_pause import paused_gc  # lazy: a few lines, only for these commands

        with paused_gc():
            return self._run(args)

    def _run(self, args: argparse.Namespace) -> int:
        module, _, name = self.target.partition(":")
        return int(getattr(importlib.import_module(module), name)(args))

    def __repr__(self) -> str:
        return f"Handler({self.target!r}, paused_gc=True)" if self.paused_gc else f"Handler({self.target!r})"


#: Set to print the traceback of an unexpected error (for a bug report).
TRACEBACK_ENV = "CKPTIER_TRACEBACK"
#: ``--runner`` choices (``ckptier.tasks.config.RUNNER_KINDS``, not imported: help answers at once).
RUNNERS = ("threads", "dask")


def cmd_completion(args: argparse.Namespace) -> int:
    from .completion import script  # lazy: only when asked

    print(script(build_parser(), args.shell), end="")
    return 0


# ------------------------------------------------------------------ parser


#: ``--timeout`` of a drill: seconds, up to 30 days.
_SECONDS = number(0, 30 * 86400, what="a number of seconds")


class _Unbuilt:
    """A command of a parser built for another command (:func:`build_parser`'s ``only``):
    registered nowhere, it takes the calls that would add its arguments and keeps none."""

    def add_argument(self, *args: object, **kwargs: object) -> None:
        return None

    def set_defaults(self, **kwargs: object) -> None:
        return None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``only``, the top level and that one command alone
    (none when it is ``""``): what parsing a command line that names it needs, at a
    fraction of the cost (argparse looks up a translation for every parser it makes).
    :func:`parser_for` chooses."""
    p = Parser(prog="ckptier", description="Keep training checkpoints safe and cheap.",
               epilog="Global options (--catalog, --config, -v, -q, --json) go before or after the command. "
                      "Exit codes: docs/cli.md.")
    p.add_argument("--version", action="version", version=f"ckptier {__version__}")
    add_globals(p, before_command=True)
    common = Parser(add_help=False)
    add_globals(common, before_command=False)
    flowopts = Parser(add_help=False)
    flowopts.add_argument("--no-prefect", action="store_true", help="run directly even when PREFECT_API_URL is set")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)

    def add(name: str, func: Callable[[argparse.Namespace], int] | str, help: str, *parents: Parser,
            paused_gc: bool = False) -> argparse.ArgumentParser:
        """Register command ``name``; ``func`` is its handler, or the name of one in :data:`HANDLERS`
        (or ``module:function``), imported only when the command runs (with ``paused_gc``, as
        :class:`Handler` says)."""
        if only is not None and name != only:
            return _Unbuilt()  # type: ignore[return-value]
        sp = sub.add_parser(name, help=help, description=help, parents=[common, *parents])
        if isinstance(func, str):
            func = Handler(func if ":" in func else f"{HANDLERS}:{func}", paused_gc=paused_gc)
        sp.set_defaults(func=func)
        return sp

    sp = add("scan", "cmd_scan", "catalog every checkpoint under URL (a path, file:///path or s3://bucket/prefix)", flowopts)
    sp.add_argument("urls", nargs="+", metavar="URL")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--inventory", metavar="MANIFEST",
                    help="read this S3 Inventory report (s3://.../manifest.json, or the inventory configuration's "
                         "folder for its newest report) instead of listing the bucket")
    sp.add_argument("--full", action="store_true",
                    help="list every local directory, even those unchanged since the last scan")

    sp = add("ls", "cmd_ls", "list cataloged checkpoints", paused_gc=True)
    sp.add_argument("--job")
    sp.add_argument("--all", action="store_true", help="include deleted checkpoints (tombstones)")
    sp.add_argument("--json", action="store_true")

    sp = add("verify", "cmd_verify", "prove checkpoint bytes intact (CRC64NVME, plus sha256 where the format records one)", flowopts)
    sp.add_argument("--job")
    sp.add_argument("--deep", action="store_true", help="read every byte even when the store keeps a checksum")
    sp.add_argument("--sample", metavar="K/N", help="verify only the K-th of N disjoint slices of the catalog (auto/N: today's slice)")
    sp.add_argument("--workers", type=WORKERS, default=4, help="files read in parallel (default 4)")
    sp.add_argument("--runner", choices=RUNNERS, help="where files are read: threads here, or dask "
                    "(default: [runner] kind in ckptier.toml, else threads)")
    sp.add_argument("--claim-rows", action="store_true", help="share the work with other ckptier processes on "
                    "this catalog: claim rows under a lease (default: [runner] claim_rows)")
    sp.add_argument("--since", metavar="TIME", help="with --claim-rows: ISO 8601 start of the sweep the processes "
                    "share; rows checked since are done (default: now)")
    sp.add_argument("--json", action="store_true")

    sp = add("latest", "cmd_latest", "newest verified checkpoint of a job whose last drill did not fail (exit 1 if none)",
             paused_gc=True)
    sp.add_argument("--job", required=True)
    sp.add_argument("--drilled", action="store_true", help="only a checkpoint whose most recent restore drill passed")
    sp.add_argument("--json", action="store_true")

    sp = add("resume", "cmd_resume", "newest checkpoint of a job proven now, fetched into --dest when only archived: "
             "the path to load from and the step (exit 1 if none can be proven)")
    sp.add_argument("--job", required=True)
    sp.add_argument("--dest", metavar="DIR", help="where a checkpoint with no hot copy is fetched "
                    "(into DIR/JOB/step-NNNNNNNN)")
    sp.add_argument("--drilled", action="store_true", help="only a checkpoint whose most recent restore drill passed")
    sp.add_argument("--quick", action="store_true", help="prove by a stat (or HEAD) of each file, not a full read")
    sp.add_argument("--stats", action="store_true", help="the job's recovery rate: resumes succeeded / attempted and "
                    "drills passed / judged, over 7 and 30 days and all time")
    sp.add_argument("--json", action="store_true")

    sp = add("plan", "cmd_plan", "dry run of retention: keep / promote / delete, with reasons")
    sp.add_argument("--job")
    sp.add_argument("--json", action="store_true")

    sp = add("apply", "cmd_apply", "carry out the retention plan: promote milestones, then delete what the policy lets go", flowopts)
    sp.add_argument("--job")
    sp.add_argument("--dry-run", action="store_true", help="say what would happen, change nothing")
    sp.add_argument("--runner", choices=RUNNERS, help="where archive copies are made: threads here, or dask "
                    "(default: [runner] kind in ckptier.toml, else threads)")
    sp.add_argument("--json", action="store_true")

    sp = add("fetch", "cmd_fetch", "restore a checkpoint's original files from any tier, verified, into a new directory DEST")
    sp.add_argument("--job", required=True)
    sp.add_argument("--step", type=STEP, required=True)
    sp.add_argument("dest", metavar="DEST")
    sp.add_argument("--json", action="store_true")

    sp = add("drill", "cmd_drill", "restore a checkpoint, train a few steps, record whether recovery works", flowopts)
    sp.add_argument("--job")
    sp.add_argument("--step", type=STEP)
    sp.add_argument("--steps", type=whole(1, 1_000_000, what="a number of training steps"), default=None, help="training steps (default 10, or the job's [[drill]] steps)")
    sp.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None)
    sp.add_argument("--model", metavar="MODULE:FUNCTION", help="model factory (see docs/restore-drills.md)")
    sp.add_argument("--timeout", type=_SECONDS, default=None, help="seconds before the drill is killed")
    sp.add_argument("--allow-global", action="append", metavar="MODULE.NAME",
                    help="a class the safe loader may unpickle from this checkpoint (repeatable; adds to [[drill]] allow_globals)")
    sp.add_argument("--world-size", type=whole(1, 65_536, what="a number of ranks"), default=None, metavar="M",
                    help="restore into M ranks (default: as many as saved the checkpoint) and say whether the run resumes on M")
    sp.add_argument("--runner", choices=RUNNERS, help="where the checkpoint's files are fetched: threads here, or dask "
                    "(default: [runner] kind in ckptier.toml, else threads)")
    sp.add_argument("--json", action="store_true")

    sp = add("janitor", "cmd_janitor", "abort abandoned multipart uploads and remove what interrupted promotions left (only ckptier's own files)")
    sp.add_argument("--older-than", metavar="D", default="24h",
                    type=duration(why="uploads still being written would be removed"),
                    help="only uploads and leftovers older than D (default 24h)")
    sp.add_argument("--json", action="store_true")

    sp = add("forget", "cmd_forget", "tombstone checkpoints a scan found missing once storage confirms them gone from every tier")
    sp.add_argument("--job", required=True)
    sp.add_argument("--missing", action="store_true", help="forget rows missing from hot storage (e.g. rotated away by the trainer)")
    sp.add_argument("--older-than", metavar="D", type=duration(timedelta(0)),
                    help="only checkpoints saved more than D ago (e.g. 7d)")
    sp.add_argument("--dry-run", action="store_true", help="look, but tombstone nothing")
    sp.add_argument("--json", action="store_true")

    sp = add("demo", "cmd_demo", "the whole pipeline end to end on embedded defaults")
    sp.add_argument("--dir", help="where the demo's hot and archive tiers and catalog live (default: a new temp dir)")
    sp.add_argument("--steps", type=whole(0, 100_000, what="a number of training steps"), default=300,
                    help="training steps of the demo run")
    sp.add_argument("--no-prefect", action="store_true", help="run the demo's steps directly, without Prefect flow runs")

    add("serve", "cmd_serve", "serve every deployment with its schedule from this process (single host)")
    from .planning import add_commands  # here: planning registers its commands with add(), defined just above
    from .recovery import add_commands as add_recovery_commands  # likewise

    add_commands(add)
    add_recovery_commands(add)
    sp = add("deploy", "cmd_deploy", "register every deployment to its work pool")
    sp.add_argument("--work-pool", default="ckptier-process")
    sp.add_argument("--gpu-pool", default="ckptier-gpu")

    sp = add("dashboard", "cmd_dashboard", "serve the web dashboard over the catalog (http://127.0.0.1:8765/)")
    sp.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; any other needs a token)")
    sp.add_argument("--port", type=whole(1, 65_535, what="a TCP port"), default=8765)
    sp.add_argument("--token", help="access token every request must present (default: $CKPTIER_DASHBOARD_TOKEN)")

    sp = add("completion", cmd_completion, "print a shell completion script made from this command line "
             "(e.g. ckptier completion bash > ~/.local/share/bash-completion/completions/ckptier)")
    sp.add_argument("shell", choices=("bash", "zsh", "fish"))

    sp = add("report", "cmd_report", "print the dashboard's tables: jobs and alerts, or one job's with --job")
    sp.add_argument("--job")
    sp.add_argument("--step", type=STEP, help="with --job: one checkpoint's tables")
    sp.add_argument("--costs", action="store_true", help="bytes and monthly cost per tier and class, savings "
                    "against keep-all, recovery point, expected restore time")
    sp.add_argument("--format", choices=("table", "csv", "json"), default="table")
    sp.add_argument("--table", action="append", metavar="NAME", help="a table to print (repeatable): jobs, alerts, "
                    "checkpoints, plan, drills, verifications, events, storage, files, copies, costs, cost_tiers")
    return finish(p)


def environment_error(exc: BaseException) -> EnvironmentFault | None:
    """The machine's own refusal behind ``exc`` (it, or an exception it was raised
    from): an :class:`EnvironmentFault` a layer already named, an ``OSError``
    such as ENOSPC, EROFS, EACCES or ENOENT on a parent (named by its path),
    or a database's "disk is full"; None when ``exc`` is none of those (a bug)."""
    from ckptier.storage.errors import environment_fault

    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, EnvironmentFault):
            return cause
        if isinstance(cause, OSError):
            path = cause.filename if cause.filename is not None else "a file"
            fault = environment_fault(cause, os.fsdecode(path) if not isinstance(path, str) else path)
            if fault is not None:
                return fault
        if type(cause).__module__.startswith("sqlalchemy"):
            from ckptier.storage.catalog.db import catalog_fault

            fault = catalog_fault("(this command's catalog)", cause)
            if fault is not None:
                return fault
        cause = cause.__cause__ or cause.__context__
    return None


#: The global options that take a value (``--catalog URL``, ``--config PATH``), and those that do not.
_GLOBAL_VALUED = ("--catalog", "--config")
_GLOBAL_FLAG = re.compile(r"-[vq]+|--verbose|--quiet|--json")


def command_word(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names: its first word that is neither a global option
    nor a global option's value; ``""`` when ``--version`` comes first (no command
    is needed); None when another option (``--help``, a typo) or ``--`` comes first,
    or no word at all. Pure."""
    words = iter(argv)
    for word in words:
        if word in _GLOBAL_VALUED:
            next(words, None)
        elif word.startswith(tuple(f"{o}=" for o in _GLOBAL_VALUED)) or _GLOBAL_FLAG.fullmatch(word):
            continue
        elif word == "--version":
            return ""
        elif word.startswith("-"):
            return None
        else:
            return word
    return None


def parser_for(argv: Sequence[str]) -> argparse.ArgumentParser:
    """A parser that reads ``argv`` exactly as :func:`build_parser`'s whole one does:
    built for the one command ``argv`` names (:func:`command_word`) when that is a
    command, else whole (so help, ``invalid choice`` and every other refusal list
    every command)."""
    word = command_word(argv)
    if word is not None:
        parser = build_parser(only=word)
        if word == "" or word in subparsers(parser):
            return parser
    return build_parser()


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status. Bad input and what ckptier refuses are one
    line and 2 (1, 75 as each command documents); what the machine refused (a full
    disk, a read-only filesystem, no permission...) is one line naming the path
    and the fix, and 1; anything else is a bug: one line, 70.

    ``argv`` None means ``sys.argv[1:]``, as the console script calls it: then the
    process is about to exit, and after a command registered with ``paused_gc``
    (``ls``, ``latest``) everything still alive is moved out of the cyclic
    collector's reach (:func:`gc.freeze`), so that the interpreter's exit does not
    walk it once more for cycles; the command's own results are already freed."""
    try:
        words = sys.argv[1:] if argv is None else list(argv)
        args = parser_for(words).parse_args(words)
        check_globals(args)
        undo = apply_verbosity(verbosity(args))
        try:
            rc = int(args.func(args))
        finally:
            undo()
        if argv is None and getattr(args.func, "paused_gc", False):
            # The process ends now (the console script): its exit's last collection need not walk
            # every object SQLAlchemy and ckptier imported (~40 ms of a 250 ms `ckptier latest`).
            # Only the program does this: a caller of main(ARGV) keeps its collector as it was.
            gc.freeze()
        return rc
    except EnvironmentFault as exc:
        print(f"ckptier: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    except CkptierError as exc:  # already one line, said on purpose (whatever it was raised from)
        print(f"ckptier: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("ckptier: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (``ckptier ls | head``): not an error of ours.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except Exception as exc:  # noqa: BLE001 - the last line of defence: never a traceback
        fault = environment_error(exc)
        if fault is not None:
            print(f"ckptier: {_one_line(str(fault))}", file=sys.stderr)
            return EXIT_ENVIRONMENT
        if os.environ.get(TRACEBACK_ENV):
            raise
        print(f"ckptier: unexpected error {type(exc).__name__}: {_one_line(str(exc))[:300]} "
              f"(a bug: please report it with the output of {TRACEBACK_ENV}=1 ckptier ...)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
