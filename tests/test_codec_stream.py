"""The encoder as a readable stream: a store writes the archive as it is encoded, and commits only a whole one."""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptier.storage import codec
from ckptier.storage.codec_stream import EncodingReader
from ckptier.storage.local import TEMP_PREFIX, LocalStore


def _checkpoint(n: int = 300_000, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    buf = io.BytesIO()
    torch.save({"w": torch.randn(n, generator=g) * 0.02, "h": torch.randn(n // 3, generator=g).bfloat16(),
                "noise": torch.randint(0, 256, (50_000,), dtype=torch.uint8, generator=g)}, buf)
    return buf.getvalue()


def _decode(archive: bytes) -> bytes:
    out = io.BytesIO()
    codec.decode(io.BytesIO(archive), out)
    return out.getvalue()


@pytest.mark.parametrize("read_size", [1, 777, 1 << 16, 8 << 20, -1])
def test_the_stream_is_the_archive_encode_writes(read_size: int) -> None:
    data = _checkpoint()
    expected = io.BytesIO()
    codec.encode(io.BytesIO(data), expected, name="w.pt", block_size=1 << 16)
    with EncodingReader(io.BytesIO(data), name="w.pt", block_size=1 << 16) as reader:
        parts = []
        while chunk := reader.read(read_size):
            parts.append(chunk)
            if read_size < 0:
                break
        assert reader.read(10) == b""
        assert reader.stats is not None and reader.stats.raw_bytes == len(data)
    assert b"".join(parts) == expected.getvalue()


def test_readinto_and_a_local_store_write(tmp_path: Path) -> None:
    data = _checkpoint(seed=1)
    store = LocalStore(tmp_path)
    with EncodingReader(io.BytesIO(data), name="w.pt", block_size=1 << 16) as reader:
        info = store.write("a/w.pt.ckz", reader)  # type: ignore[arg-type]
    archive = (tmp_path / "a" / "w.pt.ckz").read_bytes()
    assert info.size == len(archive) and _decode(archive) == data


def test_a_refusal_before_eof_leaves_nothing_in_the_store(tmp_path: Path) -> None:
    data = _checkpoint(seed=2)
    store = LocalStore(tmp_path)
    seen = []

    def refuse(stats: codec.CodecStats) -> None:
        seen.append(stats.raw_bytes)
        raise RuntimeError("hot file changed while it was read")

    with EncodingReader(io.BytesIO(data), block_size=1 << 16, before_eof=refuse) as reader:
        with pytest.raises(RuntimeError, match="hot file changed"):
            store.write("a/w.pt.ckz", reader)  # type: ignore[arg-type]
    assert seen == [len(data)]
    assert not (tmp_path / "a" / "w.pt.ckz").exists()
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(TEMP_PREFIX)]


class _Failing(io.RawIOBase):
    def __init__(self, data: bytes, after: int) -> None:
        self._src, self._left = io.BytesIO(data), after

    def readable(self) -> bool:
        return True

    def readinto(self, view: memoryview) -> int:  # type: ignore[override]
        if self._left <= 0:
            raise OSError(5, "Input/output error")
        n = self._src.readinto(view[: min(len(view), self._left)])  # type: ignore[arg-type]
        self._left -= n
        return n


def test_an_encoder_error_reaches_the_store_as_its_read_error(tmp_path: Path) -> None:
    data = _checkpoint(seed=3)
    store = LocalStore(tmp_path)
    with EncodingReader(_Failing(data, len(data) // 2), block_size=1 << 16) as reader:  # type: ignore[arg-type]
        with pytest.raises(OSError, match="Input/output error"):
            store.write("a/w.pt.ckz", reader)  # type: ignore[arg-type]
    assert not (tmp_path / "a" / "w.pt.ckz").exists()


@pytest.mark.timeout(60)
def test_closing_early_stops_the_encoder() -> None:
    data = os.urandom(1 << 20) + _checkpoint(seed=4)
    before = threading.active_count()
    reader = EncodingReader(io.BytesIO(data), block_size=1 << 16, threads=2)
    assert reader.read(1000)
    reader.close()
    assert threading.active_count() <= before
    with pytest.raises(ValueError):
        reader.read(1)


def test_an_empty_source_is_a_valid_archive() -> None:
    with EncodingReader(io.BytesIO(b"")) as reader:
        archive = reader.read()
    assert _decode(archive) == b""


def test_the_handover_copies_nothing_the_encoder_reuses() -> None:
    # raw segments are handed over as views of pooled buffers: a reader that holds the pieces it
    # read (bytes) must still see the right bytes after the encoder has reused those buffers
    rng = np.random.default_rng(5)
    data = rng.bytes(3 << 20) + _checkpoint(seed=5)
    with EncodingReader(io.BytesIO(data), block_size=1 << 16, threads=3) as reader:
        pieces = []
        while piece := reader.read(1 << 20):
            pieces.append(piece)
    assert _decode(b"".join(pieces)) == data
