"""Archives written by earlier ckz1 encoders still decode, byte for byte.

The fixtures under ``tests/fixtures/codec/`` were written once by the
format-2 encoder (``make_v2_fixture.py`` says how) and are committed; their
original bytes are known only by size, SHA-256 and CRC64NVME. Together they
hold every kind of segment the format has: generic segments stored raw and
zstd-coded, and byte planes of widths 2, 4 and 8, with and without the
exponent rotation, in raw, zstd and nibble modes, whole and partial blocks.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest

from ckptier.storage import codec, codec_planes
from tests.fixtures.codec_damage import fixture_archives

ARCHIVES = fixture_archives()
MANIFEST = {name: meta for name, (_, meta) in ARCHIVES.items()}


def _segment_kinds(archive: bytes) -> set[tuple[int, int, int, tuple[int, ...]]]:
    """(kind, width, transform, plane modes) of every segment, read from the segment table."""
    reader = codec._ArchiveReader(io.BytesIO(archive), "fixture")
    codec._read_header(reader)
    kinds = set()
    while (tag := reader.exact(2, "tag")) != b"EN":
        head = tag + reader.exact(codec._SEG_HEAD.size - 2, "segment header")
        _, kind, width, transform, _, _, _ = codec._SEG_HEAD.unpack(head)
        planes = 1 if kind == codec.KIND_GENERIC else width
        table = reader.exact(codec._PLANE_ENTRY.size * planes, "plane table")
        reader.exact(4, "crc")
        entries = [codec._PLANE_ENTRY.unpack_from(table, i * codec._PLANE_ENTRY.size) for i in range(planes)]
        reader.exact(sum(stored for _, stored in entries), "payload")
        kinds.add((kind, width, transform, tuple(mode for mode, _ in entries)))
    return kinds


def test_the_fixtures_cover_every_segment_and_plane_kind() -> None:
    kinds = set().union(*(_segment_kinds(archive) for archive, _ in ARCHIVES.values()))
    assert {(k, w, t) for k, w, t, _ in kinds} >= {
        (codec.KIND_GENERIC, 1, 0), (codec.KIND_PLANES, 2, 0), (codec.KIND_PLANES, 2, 1),
        (codec.KIND_PLANES, 4, 0), (codec.KIND_PLANES, 4, 1), (codec.KIND_PLANES, 8, 0), (codec.KIND_PLANES, 8, 1),
    }
    generic_modes = {modes[0] for k, _, _, modes in kinds if k == codec.KIND_GENERIC}
    plane_modes = {m for k, _, _, modes in kinds if k == codec.KIND_PLANES for m in modes}
    assert generic_modes == {0, 1} and plane_modes == {0, 1, 2}
    # a zstd-coded plane in each position a nibble plane usually takes, and the other way round
    assert any(k == codec.KIND_PLANES and modes[-1] == 1 for k, _, _, modes in kinds)
    assert any(k == codec.KIND_PLANES and modes[0] == 2 for k, _, _, modes in kinds)


@pytest.mark.parametrize("name", sorted(MANIFEST))
@pytest.mark.parametrize(("threads", "chunk"), [(1, 512 << 10), (2, 512 << 10), (3, 512 << 10), (2, 2), (1, 998)])
def test_format_2_archives_decode_to_their_original_bytes(
    name: str, threads: int, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # small decoding chunks: every chunk loop runs many times and ends on a partial chunk
    monkeypatch.setattr(codec_planes, "_DECODE_CHUNK_BYTES", chunk)
    expected = MANIFEST[name]
    out = io.BytesIO()
    stats = codec.decode(io.BytesIO(ARCHIVES[name][0]), out, threads=threads)
    data = out.getvalue()
    assert len(data) == expected["size"] == stats.raw_bytes
    assert hashlib.sha256(data).hexdigest() == expected["sha256"]
    assert stats.crc64nvme == expected["crc64nvme"]
    assert stats.segments == expected["segments"]


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_format_2_archives_decode_from_a_file_without_readinto(name: str, tmp_path: Path) -> None:
    class ReadOnly(io.RawIOBase):
        def __init__(self, data: bytes) -> None:
            self._src = io.BytesIO(data)

        def readable(self) -> bool:
            return True

        def read(self, n: int = -1) -> bytes:
            return self._src.read(min(n, 777) if n > 0 else n)

        readinto = None  # type: ignore[assignment]

    out = tmp_path / "out"
    with open(out, "wb") as dst:
        codec.decode(ReadOnly(ARCHIVES[name][0]), dst)  # type: ignore[arg-type]
    assert hashlib.sha256(out.read_bytes()).hexdigest() == MANIFEST[name]["sha256"]
