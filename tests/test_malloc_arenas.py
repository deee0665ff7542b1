"""limit_malloc_arenas: the apply command's process-wide malloc setting."""

from __future__ import annotations

import platform

import pytest

from ckptier.tasks.archive import MALLOC_ARENA_ENV, limit_malloc_arenas


def test_sets_the_limit_on_glibc_and_only_there(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MALLOC_ARENA_ENV, raising=False)
    assert limit_malloc_arenas(8) is (platform.libc_ver()[0] == "glibc")


def test_an_operators_environment_setting_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MALLOC_ARENA_ENV, "4")
    assert limit_malloc_arenas() is False


def test_refuses_zero_arenas() -> None:
    with pytest.raises(ValueError, match="arenas=0"):
        limit_malloc_arenas(0)
