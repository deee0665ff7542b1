"""The parser built for the one command a command line names reads it as the whole parser does.

``ckptier`` builds only the top level and the chosen command (:func:`ckptier.flows.cli.parser_for`);
these tests hold that parser to the whole one: the same options with the same rules for every
command, the same namespace for the same words, the same refusals.
"""

from __future__ import annotations

import argparse

import pytest

from ckptier.flows.arguments import UsageError, subparsers
from ckptier.flows.cli import build_parser, command_word, parser_for

WHOLE = build_parser()
COMMANDS = sorted(subparsers(WHOLE))


@pytest.mark.parametrize(("argv", "word"), [
    (["ls"], "ls"),
    (["ls", "--job", "j"], "ls"),
    (["--catalog", "ls", "latest", "--job", "j"], "latest"),   # "ls" is --catalog's value
    (["--catalog=sqlite:///x.db", "-vv", "--json", "plan"], "plan"),
    (["--config", "c.toml", "-q", "--quiet", "--verbose", "verify"], "verify"),
    (["--version"], ""),
    (["-v", "--version", "ls"], ""),
    (["--help"], None),
    (["-h", "ls"], None),
    (["--bogus", "ls"], None),
    (["--", "ls"], None),
    (["--catalog"], None),
    ([], None),
    (["nosuchcommand"], "nosuchcommand"),
])
def test_command_word(argv: list[str], word: str | None) -> None:
    assert command_word(argv) == word


def _rule(kind: object) -> object:
    """An option's type, comparable across builds: a rule made by a factory (``whole(1, 10)``)
    is a new closure each time, named by its factory and the values it closed over."""
    cells = getattr(kind, "__closure__", None)
    if not cells:
        return kind
    return (getattr(kind, "__qualname__", ""), tuple(_rule(c.cell_contents) for c in cells))


def _shape(parser: argparse.ArgumentParser) -> list[tuple[object, ...]]:
    return [(tuple(a.option_strings), a.dest, a.default, _rule(a.type), a.choices, a.required, a.nargs, a.help,
             type(a).__name__) for a in parser._actions if not isinstance(a, argparse._SubParsersAction)]


@pytest.mark.parametrize("name", COMMANDS)
def test_each_command_built_alone_is_the_whole_parsers_command(name: str) -> None:
    alone = build_parser(only=name)
    assert list(subparsers(alone)) == [name]
    mine, theirs = subparsers(alone)[name], subparsers(WHOLE)[name]
    assert _shape(mine) == _shape(theirs)
    assert mine.format_help() == theirs.format_help()
    assert mine.get_default("func").__repr__() == theirs.get_default("func").__repr__()
    assert _shape(alone) == _shape(WHOLE)  # the top level's own options too


@pytest.mark.parametrize("argv", [
    ["ls", "--job", "j", "--json"],
    ["--catalog", "sqlite:///a.db", "ls", "--catalog", "sqlite:///b.db"],
    ["--json", "latest", "--job", "j"],
    ["-vv", "verify", "--deep", "--workers", "3", "-q"],
    ["drill", "--job", "j", "--steps", "5", "--device", "cpu", "--allow-global", "a.b", "--allow-global", "c.d"],
    ["fetch", "--job", "j", "--step", "12", "/tmp/x"],
    ["--config=c.toml", "janitor", "--older-than", "2h", "--json"],
])
def test_the_same_words_give_the_same_namespace(argv: list[str]) -> None:
    lazy = parser_for(argv)
    assert lazy is not WHOLE and len(subparsers(lazy)) == 1
    assert vars(lazy.parse_args(argv)).keys() == vars(WHOLE.parse_args(argv)).keys()
    got, want = vars(lazy.parse_args(argv)), vars(WHOLE.parse_args(argv))
    assert {k: repr(v) for k, v in got.items()} == {k: repr(v) for k, v in want.items()}


@pytest.mark.parametrize("argv", [
    ["nosuchcommand"],               # not a command: the whole parser lists every command
    ["ls", "--bogus"],
    ["latest"],                      # --job is required
    ["fetch", "--job", "j", "--step", "-1", "/tmp/x"],
    ["--catalog"],
])
def test_the_same_refusals(argv: list[str]) -> None:
    with pytest.raises(UsageError) as lazy:
        parser_for(argv).parse_args(argv)
    with pytest.raises(UsageError) as whole:
        WHOLE.parse_args(argv)
    assert str(lazy.value) == str(whole.value)
    if argv == ["nosuchcommand"]:
        assert all(name in str(lazy.value) for name in COMMANDS)


def test_version_builds_no_command(capsys: pytest.CaptureFixture[str]) -> None:
    parser = parser_for(["--version"])
    assert subparsers(parser) == {}
    with pytest.raises(SystemExit) as done:
        parser.parse_args(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("ckptier ")
