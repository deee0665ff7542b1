"""The constructors a listing and recognition use once per file build exactly
the records the dataclasses' own constructors build."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, dataclass, fields

import pytest
from ckptier.storage.base import ObjectInfo, listed_file
from ckptier.storage.records import FileRef, file_ref, slot_setters


@pytest.mark.parametrize(("key", "size", "mtime"), [("a/b/model.pt", 12, 1.5e9), ("x", 0, 0.0), ("odd-\udcff", 2**40, -1.0)])
def test_listed_file_is_the_object_info_of_a_file(key: str, size: int, mtime: float) -> None:
    made = listed_file(key, size, mtime)
    assert made == ObjectInfo(key, size, mtime) and hash(made) == hash(ObjectInfo(key, size, mtime))
    assert [getattr(made, f.name) for f in fields(ObjectInfo)] == [key, size, mtime, None, None, None, None, None]
    with pytest.raises(FrozenInstanceError):
        made.size = 1  # type: ignore[misc]


@pytest.mark.parametrize("values", [
    ("j/s/rank-0/model.pt", "rank-0/model.pt", 7, 1.5e9, "etag", "crc64nvme:AAAAAAAAAAA=", None),
    ("m.safetensors", "m.safetensors", 0, None, None, None, None),
    ("j/s/rank-0/optimizer.pt", "rank-0/optimizer.pt", 9, 1.5e9, None, None, "j/r/rank-0/optimizer.pt"),
])
def test_file_ref_is_the_file_ref(values: tuple) -> None:  # type: ignore[type-arg]
    made = file_ref(*values)
    assert made == FileRef(*values) and repr(made) == repr(FileRef(*values))
    assert tuple(getattr(made, f.name) for f in fields(FileRef)) == values


def test_a_fast_constructor_must_name_every_field_in_order() -> None:
    @dataclass(frozen=True, slots=True)
    class Grown:
        key: str
        size: int
        added_later: int = 0

    with pytest.raises(TypeError, match=r"Grown has the fields \('key', 'size', 'added_later'\), not \('key', 'size'\)"):
        slot_setters(Grown, ("key", "size"))
    assert len(slot_setters(Grown, ("key", "size", "added_later"))) == 3
