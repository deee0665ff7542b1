"""The ckz1 archive codec: exact round trips, damage detection, safety, bounded memory."""

from __future__ import annotations

import io
import os
import pickle
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from ckptier.storage import codec, codec_planes
from ckptier.storage.codec_layout import PAYLOAD_BYTES, PAYLOAD_SAFETENSORS, PAYLOAD_TORCH, torch_storages
from ckptier.storage.errors import IntegrityError


def roundtrip(data: bytes, **kw: object) -> tuple[bytes, codec.CodecStats]:
    archive = io.BytesIO()
    stats = codec.encode(io.BytesIO(data), archive, name="x.pt", **kw)  # type: ignore[arg-type]
    assert stats.raw_bytes == len(data)
    assert stats.stored_bytes == len(archive.getvalue())
    out = io.BytesIO()
    back = codec.decode(io.BytesIO(archive.getvalue()), out)
    assert out.getvalue() == data
    assert back.crc64nvme == stats.crc64nvme
    return archive.getvalue(), stats


def torch_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def training_state(seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(96, 64, generator=g) * 0.02
    return {
        "model": {"w": w.to(torch.bfloat16), "h": torch.randn(64, 64, generator=g).half(), "f": w.clone()},
        "optimizer": {
            "state": {0: {"step": torch.tensor(10.0), "exp_avg": torch.randn(96, 64, generator=g) * 1e-4,
                          "exp_avg_sq": torch.rand(96, 64, generator=g) * 1e-8}},
            "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "params": [0]}],
        },
        "ids": torch.arange(3000, dtype=torch.int64),
        "epoch": 3,
    }


def test_torch_save_round_trip_uses_planes_and_compresses() -> None:
    data = torch_bytes(training_state())
    archive, stats = roundtrip(data)
    assert stats.payload == PAYLOAD_TORCH
    assert stats.segments.get("planes", 0) >= 5  # bf16, fp16, fp32 x3, int64 tensors
    assert stats.segments.get("plane_nibble", 0) >= 3  # exponent planes
    assert len(archive) < len(data)
    loaded = torch.load(io.BytesIO(_decode(archive)), weights_only=True)
    assert torch.equal(loaded["model"]["w"], training_state()["model"]["w"])  # type: ignore[index]


def _decode(archive: bytes) -> bytes:
    out = io.BytesIO()
    codec.decode(io.BytesIO(archive), out)
    return out.getvalue()


def test_planes_beat_plain_zstd_on_float_tensors() -> None:
    import zstandard

    g = torch.Generator().manual_seed(1)
    data = torch_bytes({"w": (torch.randn(256, 256, generator=g) * 0.02).to(torch.bfloat16),
                        "m": torch.randn(256, 256, generator=g) * 1e-4})
    archive, _ = roundtrip(data)
    plain = zstandard.ZstdCompressor(level=1).compress(data)
    assert len(archive) < 0.95 * len(plain)


def test_torch_storages_reads_dtypes_and_counts() -> None:
    data = torch_bytes({"a": torch.zeros(3, dtype=torch.bfloat16), "b": torch.arange(5), "c": torch.ones(2)[1:]})
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    storages, length = torch_storages(pkl)
    assert sorted(storages.values()) == [("torch.BFloat16Storage", 3), ("torch.FloatStorage", 2), ("torch.LongStorage", 5)]
    assert length == len(pkl)


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.path}",)


def test_malicious_pickle_is_never_executed(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    buf = io.BytesIO()
    torch.save({"w": torch.randn(2048), "evil": _Evil(str(canary))}, buf, pickle_module=pickle)
    data = buf.getvalue()
    assert b"system" in data
    roundtrip(data)
    assert not canary.exists()


def test_safetensors_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    g = torch.Generator().manual_seed(2)
    save_file({"w": torch.randn(128, 64, generator=g).to(torch.bfloat16), "b": torch.randn(64, generator=g),
               "i": torch.arange(2048, dtype=torch.int32), "u": torch.zeros(5000, dtype=torch.uint8)}, str(path))
    data = path.read_bytes()
    _, stats = roundtrip(data)
    assert stats.payload == PAYLOAD_SAFETENSORS
    assert stats.segments.get("planes", 0) >= 2


@pytest.mark.parametrize("data", [b"", b"x", b"PK\x03\x04", b"\x05" + bytes(8), os.urandom(100)])
def test_empty_and_tiny_inputs(data: bytes) -> None:
    roundtrip(data)


def test_random_data_is_stored_not_expanded() -> None:
    data = os.urandom(300_000)
    archive, stats = roundtrip(data)
    assert stats.payload == PAYLOAD_BYTES
    assert len(archive) < len(data) + 400  # header, one segment header, trailer


def test_file_larger_than_a_block_and_any_thread_count() -> None:
    rng = np.random.default_rng(3)
    w = torch.from_numpy((rng.standard_normal(300_000) * 0.02).astype(np.float32))
    data = torch_bytes({"w": w, "x": torch.from_numpy(rng.integers(0, 9, 200_000))})
    block = 1 << 16
    one, s1 = roundtrip(data, block_size=block, threads=1)
    two, s2 = roundtrip(data, block_size=block, threads=2)
    assert one == two  # deterministic whatever the thread count
    assert s1.segments["planes"] > len(data) // block // 2


def test_describe_reports_header() -> None:
    archive, _ = roundtrip(torch_bytes({"w": torch.ones(10)}))
    info = codec.describe(io.BytesIO(archive))
    assert info["codec"] == codec.CODEC_ID and info["version"] == codec.CODEC_VERSION
    assert info["name"] == "x.pt" and info["payload"] == PAYLOAD_TORCH
    assert info["size"] is not None and info["level"] == 1


def _decode_error(archive: bytes) -> str:
    with pytest.raises(IntegrityError) as err:
        _decode(archive)
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.fixture(scope="module")
def archive() -> bytes:
    g = torch.Generator().manual_seed(4)
    return roundtrip(torch_bytes({"w": torch.randn(20_000, generator=g), "n": torch.arange(5000)}))[0]


def test_flipped_byte_in_a_frame_is_detected(archive: bytes) -> None:
    for at in range(len(archive) // 3, len(archive) - 40, len(archive) // 7):
        damaged = bytearray(archive)
        damaged[at] ^= 0x40
        assert "x.pt" in _decode_error(bytes(damaged))


def test_flipped_byte_in_the_header_is_detected(archive: bytes) -> None:
    damaged = bytearray(archive)
    damaged[len(codec.MAGIC) + 10] ^= 1
    assert "header" in _decode_error(bytes(damaged))


def test_truncated_archive_is_detected(archive: bytes) -> None:
    for cut in (len(archive) - 1, len(archive) - 20, len(archive) // 2, 12):
        assert "truncated" in _decode_error(archive[:cut])


def test_trailing_garbage_is_detected(archive: bytes) -> None:
    assert "after the trailer" in _decode_error(archive + b"\0")


def test_non_archive_is_refused() -> None:
    message = _decode_error(torch_bytes({"w": torch.ones(3)}))
    assert "not a ckz1 archive" in message
    with pytest.raises(IntegrityError):
        codec.describe(io.BytesIO(b"hello"))


def test_raw_plane_damage_is_caught_by_segment_checksum() -> None:
    # uniformly random float32 mantissas are stored raw, where zstd checksums cannot help
    data = torch_bytes({"w": torch.rand(50_000)})
    archive, stats = roundtrip(data)
    assert stats.segments.get("plane_raw", 0) >= 2
    damaged = bytearray(archive)
    damaged[len(archive) // 2] ^= 1
    assert "damaged" in _decode_error(bytes(damaged))


class _Generated(io.RawIOBase):
    """A non-seekable stream of ``total`` pseudo-float bytes, produced on the fly."""

    def __init__(self, total: int) -> None:
        self.left = total
        self.rng = np.random.default_rng(5)

    def readable(self) -> bool:
        return True

    def readinto(self, view: memoryview) -> int:  # type: ignore[override]
        n = min(len(view), self.left, 1 << 20)
        view[:n] = (self.rng.standard_normal(n // 4 + 1).astype(np.float32)).tobytes()[:n]
        self.left -= n
        return n


class _Sink(io.RawIOBase):
    def __init__(self) -> None:
        self.n = 0

    def writable(self) -> bool:
        return True

    def write(self, data: object) -> int:
        n = memoryview(data).nbytes  # type: ignore[arg-type]
        self.n += n
        return n


def test_memory_stays_bounded_for_a_large_stream() -> None:
    block = 1 << 20
    total = 48 << 20
    tracemalloc.start()
    try:
        stats = codec.encode(_Generated(total), _Sink(), block_size=block, threads=2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert stats.raw_bytes == total
    assert peak < 16 * block, f"peak {peak} bytes for a {total}-byte stream"


@settings(max_examples=40, deadline=None)
@given(data=st.binary(max_size=6000), width=st.sampled_from([2, 4, 8]), transform=st.sampled_from([0, 1]))
def test_planes_round_trip_property(data: bytes, width: int, transform: int) -> None:
    import zstandard

    data = data[: len(data) - len(data) % width]
    split = codec_planes.split_planes(data, width, transform)
    cctx = zstandard.ZstdCompressor(compression_params=codec_planes.plane_params())
    dctx = zstandard.ZstdDecompressor()
    decoded = []
    for k in range(width):
        mode, payload = codec_planes.encode_plane(split[k], cctx)
        assert len(payload) <= split[k].size
        decoded.append(codec_planes.decode_plane(mode, memoryview(payload), split[k].size, dctx))
    out = np.empty(len(data), dtype=np.uint8)
    codec_planes.merge_planes(decoded, width, transform, out)
    assert out.tobytes() == data


@settings(max_examples=30, deadline=None)
@given(values=st.lists(st.integers(0, 255), min_size=64, max_size=4000), base=st.integers(0, 240))
def test_nibble_plane_round_trip_property(values: list[int], base: int) -> None:
    import zstandard

    # mostly inside [base, base+14] with escapes outside: the exponent-plane shape
    plane = np.array([base + v % 15 if v % 9 else v for v in values], dtype=np.uint8)
    cctx = zstandard.ZstdCompressor(compression_params=codec_planes.plane_params())
    payload = codec_planes._encode_nibbles(plane, base, cctx)
    back = codec_planes.decode_plane(codec_planes.PLANE_NIBBLE, memoryview(payload), plane.size,
                                     zstandard.ZstdDecompressor())
    assert np.array_equal(back, plane)


@given(data=st.binary(max_size=3000))
@settings(max_examples=30, deadline=None)
def test_codec_round_trip_property(data: bytes) -> None:
    roundtrip(data, block_size=1 << 16)
