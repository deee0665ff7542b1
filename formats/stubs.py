"""Inert records for the classes a training library pickles beside the tensors.

DeepSpeed's ZeRO optimizer files pickle a ``LossScaler`` object, a
``ZeroStageEnum`` and ``fragment_address`` dataclasses; Megatron's
``args`` can hold its enums. Importing those libraries to unpickle their
classes would run their code (and they may not be installed where the drill
runs), so a format names them (:attr:`ckptier.formats.base.FormatPlugin.library_globals`,
each with why it is harmless) and the safe loader admits each name as an
:class:`InertRecord` subclass of ckptier's own instead: a plain class that
stores what the file gives it (positional arguments, then the state BUILD
sets) and runs nothing else. The real class is never imported; a drill only
needs the tensors beside them.

These records follow the plain-class rules of :mod:`ckptier.formats.allowlist`
in spirit: construction only stores arguments, ``__setstate__`` only stores
the state, nothing else is defined.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["InertRecord", "stub_allowlist", "stub_for"]


class InertRecord:
    """A value of a library class the file named (``qualname``), kept as data.

    ``args`` holds what the file called the class with (an enum's value, a
    NamedTuple's fields), ``state`` what BUILD set (a dataclass's or plain
    object's ``__dict__``).
    """

    qualname = "?"

    def __init__(self, *args: Any) -> None:
        self.args = args
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    @property
    def value(self) -> Any:
        """An enum member's value (its only argument), else ``None``."""
        return self.args[0] if len(self.args) == 1 else None

    def __repr__(self) -> str:
        return f"<{self.qualname} args={self.args!r} state={self.state!r}>"


_STUBS: dict[str, type[InertRecord]] = {}


def stub_for(name: str) -> type[InertRecord]:
    """The (cached) :class:`InertRecord` subclass standing in for ``module.Name``."""
    stub = _STUBS.get(name)
    if stub is None:
        stub = type(name.rsplit(".", 1)[-1], (InertRecord,), {"qualname": name, "__module__": __name__})
        _STUBS[name] = stub
    return stub


def stub_allowlist(names: Iterable[str]) -> list[tuple[type[InertRecord], str]]:
    """``(record class, name)`` pairs for torch's ``safe_globals``: the file
    may name each of ``names`` and gets an inert record instead."""
    return [(stub_for(n), n) for n in names]
