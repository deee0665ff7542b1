"""Every format ckptier knows, in the order their anchors claim keys.

Adding a format is its module (recognition, manifests, loading, drill needs;
see :mod:`ckptier.formats.base`), one line below, and its name in
:class:`ckptier.storage.records.Format` (the catalog stores it). Order matters
only where layouts nest: a Hugging Face ``checkpoint-N`` claims the DCP or
DeepSpeed folders inside it, Megatron's ``iter_N`` claims its ``torch_dist``
DCP files, DCP claims ``.distcp`` and ``.metadata`` before DeepSpeed claims
a ``global_stepN`` or the guide a ``step-N``.
Importing this module never imports torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from ckptier.formats.base import FormatPlugin
from ckptier.storage.records import Format
from ckptier.storage.structure import Checker, data_checker

_MODULES = (
    "hf_trainer",
    "megatron",
    "dcp",
    "deepspeed",
    "guide",
    "hf_weights",
    "orbax",
    "lightning",
    "pattern",
)

PLUGINS: tuple[FormatPlugin, ...] = tuple(
    importlib.import_module(f"ckptier.formats.{name}").PLUGIN for name in _MODULES
)
"""The plug-ins, in anchoring order."""

_BY_FORMAT: dict[Format, FormatPlugin] = {p.format: p for p in PLUGINS}
assert set(_BY_FORMAT) == set(Format), "every Format needs a plug-in and every plug-in its Format"

ANCHORING: tuple[tuple[Format, Callable[[str, int, int], str | None]], ...] = tuple(
    (p.format, p.anchor) for p in PLUGINS if type(p).anchor is not FormatPlugin.anchor
)
"""``(format, anchor)`` of the formats that claim keys themselves, in order."""

ANCHOR_NAMES: frozenset[str] = frozenset().union(*(p.anchor_names for p in PLUGINS))
ANCHOR_SUFFIXES: tuple[str, ...] = tuple(sorted({s for p in PLUGINS for s in p.anchor_suffixes}))
"""File names and name endings some anchor may claim by the name itself; for
every other file the anchors' verdict is its directory's (see
:attr:`~ckptier.formats.base.FormatPlugin.anchor_names`)."""

METADATA_NAMES: frozenset[str] = frozenset().union(*(p.metadata_names for p in PLUGINS))
"""File names recognition may read, so a scan can fetch them ahead of time."""

SIDECAR_NAMES: frozenset[str] = frozenset().union(*(p.sidecar_names for p in PLUGINS))
SIDECAR_OWNERS: dict[str, tuple[Format, ...]] = {
    name: tuple(p.format for p in PLUGINS if name in p.sidecar_names) for name in SIDECAR_NAMES
}
"""Job-level file name -> the formats that own it: beside a checkpoint of one
of those formats it is never reported as stray."""

DRILLABLE_FORMATS: frozenset[Format] = frozenset(p.format for p in PLUGINS if p.drillable)


def plugin(fmt: Format | str) -> FormatPlugin:
    """The plug-in of ``fmt``; ``KeyError`` for a name no format has."""
    return _BY_FORMAT[Format(fmt)]


def checker_for(relpath: str, fmt: Format | str | None = None, *, manifests_only: bool = False) -> Checker | None:
    """A structural checker for the file ``relpath`` (relative to its
    checkpoint) of a checkpoint of format ``fmt``, or ``None`` when it has no
    checkable structure. Data files (torch zip, safetensors) are checked in
    every format, unless ``manifests_only``; manifests only by their own
    format's plug-in."""
    name = relpath[relpath.rfind("/") + 1 :]
    if manifests_only and name.endswith((".safetensors", ".pt", ".pth", ".bin", ".ckpt")):
        return None
    found = data_checker(relpath)
    if found is not None or fmt is None:
        return found
    return plugin(fmt).checker(relpath, name, relpath[: len(relpath) - len(name)])
