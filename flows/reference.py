"""The command reference page, generated from the argparse parser.

:func:`markdown` walks the real parser (every command, its usage, its
arguments with their help, defaults and choices), so the reference in the
documentation site cannot drift from the command line: the MkDocs hook
``docs/hooks/commands.py`` renders it into ``reference/commands.md`` at
build time, and a test checks that every command and option appears.
"""

from __future__ import annotations

import argparse
import html

from .arguments import subparsers

#: Where the page lands in the documentation site.
PAGE = "reference/commands.md"


def _cell(text: str) -> str:
    """Text made safe for a Markdown table cell."""
    return html.escape(" ".join(text.split()), quote=False).replace("|", "&#124;")


def _names(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    names = ", ".join(action.option_strings)
    if action.nargs != 0 and not isinstance(action, argparse._VersionAction):
        metavar = action.metavar or action.dest.upper()
        names += " " + (metavar if isinstance(metavar, str) else " ".join(metavar))
    return f"`{names}`"


def _default(action: argparse.Action) -> str:
    if action.option_strings and action.nargs == 0:
        return ""  # a switch: off unless given
    if action.default in (None, argparse.SUPPRESS, [], ""):
        return ""
    return f"`{action.default}`"


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """``action``'s help as ``--help`` prints it (``%(default)s`` and the like filled in)."""
    if not action.help:
        return ""
    return parser._get_formatter()._expand_help(action)


def _table(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| argument | meaning | default | choices |", "| --- | --- | --- | --- |"]
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        choices = ", ".join(f"`{c}`" for c in action.choices) if action.choices else ""
        rows.append(f"| {_names(action)} | {_cell(_help(parser, action))} | {_default(action)} | {choices} |")
    return rows


def _commands(parser: argparse.ArgumentParser, prefix: str = "") -> list[tuple[str, argparse.ArgumentParser]]:
    """Every command under ``parser``, nested ones (``catalog backup``) after their parent."""
    out: list[tuple[str, argparse.ArgumentParser]] = []
    for name, sp in subparsers(parser).items():
        out.append((prefix + name, sp))
        out += _commands(sp, f"{prefix}{name} ")
    return out


def _anchor(name: str) -> str:
    return name.replace(" ", "-")


def markdown(parser: argparse.ArgumentParser) -> str:
    """The whole reference page for ``parser`` (the ``ckptier`` parser), as Markdown."""
    commands = _commands(parser)
    out = [
        "# Command reference",
        "",
        "Generated from the command line itself (`python -m ckptier.flows.reference > docs/reference/commands.md`;",
        "a test and the site build fail when it is stale); `ckptier COMMAND --help` prints the same.",
        "Exit codes and the options every command shares: [the command line](../cli.md).",
        "",
        "## ckptier",
        "",
        "```text",
        parser.format_usage().strip(),
        "```",
        "",
        *_table(parser),
        "",
        "| command | what it does |",
        "| --- | --- |",
        *(f"| [`{name}`](#{_anchor(name)}) | {_cell(sp.description or '')} |" for name, sp in commands),
    ]
    for name, sp in commands:
        out += ["", f"## {name} {{#{_anchor(name)}}}" if " " in name else f"## {name}", "",
                _cell(sp.description or ""), "", "```text", sp.format_usage().strip(), "```", "", *_table(sp)]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    from .cli import build_parser

    print(markdown(build_parser()), end="")
