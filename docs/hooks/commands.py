"""MkDocs hook: the build fails when the committed command reference is stale.

``docs/reference/commands.md`` is generated from ckptier's own argparse
parser (``python -m ckptier.flows.reference > docs/reference/commands.md``)
and committed, so that it reads on any Git host too; building the site
regenerates it in memory and refuses a page that differs from the parser.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError


def on_pre_build(config: Any) -> None:
    from ckptier.flows.cli import build_parser
    from ckptier.flows.reference import PAGE, markdown

    page = Path(config["docs_dir"]) / PAGE
    if not page.is_file() or page.read_text(encoding="utf-8") != markdown(build_parser()):
        raise PluginError(f"{page} is stale against the command line: regenerate it with "
                          "'python -m ckptier.flows.reference > docs/reference/commands.md'")
