"""``ckptier completion bash|zsh|fish``: a shell completion script generated from the parser.

The script is made from the argparse parser itself (commands, their options
and the choices of options that have them), so it cannot drift from the
command line. Install it the usual way for the shell, e.g.
``ckptier completion bash > ~/.local/share/bash-completion/completions/ckptier``,
``ckptier completion zsh > "${fpath[1]}/_ckptier"`` or
``ckptier completion fish > ~/.config/fish/completions/ckptier.fish``.
"""

from __future__ import annotations

import argparse
import shlex

from .arguments import subparsers

SHELLS = ("bash", "zsh", "fish")


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS]


def _words(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in _options(parser) for s in a.option_strings]


def _choices(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    return {s: [str(c) for c in a.choices] for a in _options(parser) if a.choices for s in a.option_strings}


def bash(parser: argparse.ArgumentParser) -> str:
    """A bash script defining ``_ckptier`` and registering it with ``complete``."""
    commands = subparsers(parser)
    cases = []
    for name, sp in commands.items():
        choice_cases = "".join(f"            {opt}) COMPREPLY=($(compgen -W {shlex.quote(' '.join(ch))} -- \"$cur\")); return;;\n"
                               for opt, ch in _choices(sp).items())
        cases.append(f"        {name})\n          case \"$prev\" in\n{choice_cases}          esac\n"
                     f"          COMPREPLY=($(compgen -W {shlex.quote(' '.join(_words(sp)))} -- \"$cur\"))\n"
                     "          [[ $cur != -* ]] && COMPREPLY+=($(compgen -f -- \"$cur\"))\n          return;;\n")
    return f"""# bash completion for ckptier (ckptier completion bash)
_ckptier() {{
    local cur prev cmd w
    cur="${{COMP_WORDS[COMP_CWORD]}}"
    prev="${{COMP_WORDS[COMP_CWORD-1]}}"
    cmd=""
    for w in "${{COMP_WORDS[@]:1:COMP_CWORD-1}}"; do
        case "$w" in -*) ;; *) if [[ " {' '.join(commands)} " == *" $w "* ]]; then cmd="$w"; break; fi;; esac
    done
    case "$cmd" in
{''.join(cases)}    esac
    COMPREPLY=($(compgen -W {shlex.quote(' '.join([*commands, *_words(parser)]))} -- "$cur"))
}}
complete -F _ckptier ckptier
"""


def zsh(parser: argparse.ArgumentParser) -> str:
    """A zsh script (``#compdef ckptier``) defining ``_ckptier``."""
    commands = subparsers(parser)
    described = "\n".join(f"    {shlex.quote(name + ':' + (sp.description or '').replace(':', ' ')[:70])}"
                          for name, sp in commands.items())
    cases = "\n".join(f"    {name}) compadd -- {' '.join(shlex.quote(w) for w in _words(sp))}; _files;;"
                      for name, sp in commands.items())
    return f"""#compdef ckptier
# zsh completion for ckptier (ckptier completion zsh)
_ckptier() {{
  local -a commands
  commands=(
{described}
  )
  local cmd w
  for w in ${{words[2,CURRENT-1]}}; do
    if (( ${{commands[(I)$w:*]}} )); then cmd=$w; break; fi
  done
  if [[ -z $cmd ]]; then
    _describe 'command' commands
    compadd -- {' '.join(shlex.quote(w) for w in _words(parser))}
    return
  fi
  case $cmd in
{cases}
  esac
}}
compdef _ckptier ckptier
"""


def fish(parser: argparse.ArgumentParser) -> str:
    """A fish script of ``complete -c ckptier`` lines."""
    commands = subparsers(parser)
    lines = ["# fish completion for ckptier (ckptier completion fish)", "complete -c ckptier -f"]
    for name, sp in commands.items():
        lines.append(f"complete -c ckptier -n __fish_use_subcommand -a {name} -d {shlex.quote((sp.description or '')[:70])}")
        for a in _options(sp):
            longs = [s[2:] for s in a.option_strings if s.startswith("--")]
            shorts = [s[1:] for s in a.option_strings if not s.startswith("--")]
            spec = "".join(f" -l {x}" for x in longs) + "".join(f" -s {x}" for x in shorts)
            extra = f" -xa {shlex.quote(' '.join(str(c) for c in a.choices))}" if a.choices else ""
            lines.append(f"complete -c ckptier -n '__fish_seen_subcommand_from {name}'{spec}{extra}")
    for a in _options(parser):
        longs = [s[2:] for s in a.option_strings if s.startswith("--")]
        if longs:
            lines.append(f"complete -c ckptier -n __fish_use_subcommand -l {longs[0]}")
    return "\n".join(lines) + "\n"


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    """The completion script of ``parser`` for ``shell`` (one of :data:`SHELLS`)."""
    return {"bash": bash, "zsh": zsh, "fish": fish}[shell](parser)
