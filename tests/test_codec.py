"""The ckz1 archive codec: exact round trips, damage detection, safety, bounded memory."""

from __future__ import annotations

import io
import os
import random
import pickle
import struct
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


@pytest.mark.parametrize("header", [b'{"a":' * 30_000 + b"1" + b"}" * 30_000, b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                                    b'{"w": {"dtype": "F32", "data_offsets": [0, ' + b"9" * 5000 + b"]}}"],
                         ids=["nested-objects", "nested-arrays", "5000-digit-offset"])
def test_a_safetensors_look_alike_with_a_hostile_header_is_coded_as_plain_bytes(header: bytes) -> None:
    # A deeply nested header raised RecursionError out of encode: promote crashed with a traceback.
    data = struct.pack("<Q", len(header)) + header + os.urandom(1000)
    _, stats = roundtrip(data)
    assert stats.payload == PAYLOAD_SAFETENSORS and stats.segments.get("planes", 0) == 0


@pytest.mark.parametrize("data", [b"", b"x", b"PK\x03\x04", b"\x05" + bytes(8), random.Random(134).randbytes(100)])
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


# --- the fast paths: pooled buffers, scratch reuse, ordered writer, chunked loops ---


def test_pooled_buffers_are_never_reused_before_they_are_written() -> None:
    # raw generic segments are written straight from pooled input buffers and raw planes from
    # pooled plane buffers: reusing one too early would corrupt the archive, not crash
    g = torch.Generator().manual_seed(6)
    parts: dict[str, object] = {}
    for i in range(6):
        parts[f"noise{i}"] = torch.randint(0, 256, (70_000,), dtype=torch.uint8, generator=g)
        parts[f"w{i}"] = torch.randn(40_000, generator=g) * (i + 1)
        parts[f"h{i}"] = torch.randn(30_000, generator=g).to(torch.bfloat16)
    data = torch_bytes(parts)
    archives = set()
    for threads in (1, 2, 3):
        archive, stats = roundtrip(data, block_size=1 << 16, threads=threads)
        archives.add(archive)
        assert stats.segments["generic"] > 6 and stats.segments["planes"] > 20
        for decode_threads in (1, 3):
            out = io.BytesIO()
            codec.decode(io.BytesIO(archive), out, threads=decode_threads)
            assert out.getvalue() == data
    assert len(archives) == 1


def _float_like(n: int, width: int, seed: int, noise: bool) -> bytes:
    rng = np.random.default_rng(seed)
    if noise:
        return rng.bytes(n * width)
    dtype = {2: np.float16, 4: np.float32, 8: np.float64}[width]
    return (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 3)).astype(dtype).tobytes()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3000), width=st.sampled_from([2, 4, 8]), transform=st.sampled_from([0, 1]),
       seed=st.integers(0, 2**32 - 1), noise=st.booleans())
def test_chunked_split_merge_and_nibbles_with_one_reused_scratch(
    n: int, width: int, transform: int, seed: int, noise: bool
) -> None:
    import zstandard

    data = _float_like(n, width, seed, noise)
    # tiny chunks: every loop runs many times and ends on a partial chunk
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(codec_planes, "_CHUNK_BYTES", 64)
        mp.setattr(codec_planes, "_DECODE_CHUNK_BYTES", 64)
        scratch = codec_planes.Scratch()
        cctx = zstandard.ZstdCompressor(compression_params=codec_planes.plane_params())
        dctx = zstandard.ZstdDecompressor()
        for piece in (data, data[: len(data) // 3], data * 2):  # shrink and grow the scratch arrays
            piece = piece[: len(piece) - len(piece) % width]
            split = codec_planes.split_planes(piece, width, transform, scratch=scratch)
            assert np.array_equal(split, _reference_split(piece, width, transform))
            decoded = []
            for k in range(width):
                mode, payload = codec_planes.encode_plane(split[k], cctx, scratch)
                plane = codec_planes.decode_plane(mode, memoryview(payload), split[k].size, dctx, scratch, f"p{k}")
                assert np.array_equal(plane, split[k])
                decoded.append(plane)
            out = np.frombuffer(piece, dtype=np.uint8) ^ np.uint8(0xFF)  # every byte wrong until merged
            codec_planes.merge_planes(decoded, width, transform, out, scratch)
            assert out.tobytes() == piece
            base = int(split[-1][0]) if split.size else 0
            plane = split[-1] if split.size else np.zeros(0, np.uint8)
            if plane.size >= 1 and base <= 240:
                payload = codec_planes._encode_nibbles(plane, base, cctx, scratch)
                back = codec_planes.decode_plane(
                    codec_planes.PLANE_NIBBLE, memoryview(payload), plane.size, dctx, scratch
                )
                assert np.array_equal(back, plane)


def _reference_split(data: bytes, width: int, transform: int) -> np.ndarray:
    """The byte planes computed the slow, obvious way (Python integers)."""
    bits = 8 * width
    rows = []
    for i in range(0, len(data), width):
        x = int.from_bytes(data[i : i + width], "little")
        if transform == codec_planes.TRANSFORM_ROTL1:
            x = ((x << 1) | (x >> (bits - 1))) & ((1 << bits) - 1)
        rows.append(list(x.to_bytes(width, "little")))
    return np.array(rows, dtype=np.uint8).reshape(-1, width).T


def test_the_same_archive_without_crc64_combine(monkeypatch: pytest.MonkeyPatch) -> None:
    # older awscrt releases lack combine_crc64nvme: the reading and writing threads checksum instead
    data = torch_bytes(training_state(7))
    with_combine, s1 = roundtrip(data, block_size=1 << 16)
    monkeypatch.setattr(codec, "_combine_crc64", None)
    without, s2 = roundtrip(data, block_size=1 << 16)
    assert with_combine == without and s1.crc64nvme == s2.crc64nvme


def test_data_pkl_larger_than_the_first_look_ahead_still_gives_hints() -> None:
    # torch.save streams members without sizes, so the planner must find where data.pkl ends
    obj = {"w": torch.randn(5000), "big": list(range(30_000)), "h": torch.randn(3000).half()}
    data = torch_bytes(obj)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    assert len(pkl) > 64 << 10
    _, stats = roundtrip(data)
    assert stats.segments.get("planes", 0) == 2


class _ReadOnly(io.RawIOBase):
    """A stream with ``read`` but no ``readinto`` (as some wrappers are)."""

    def __init__(self, data: bytes) -> None:
        self._src = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        return self._src.read(min(n, 1000) if n > 0 else n)

    readinto = None  # type: ignore[assignment]


def test_streams_without_readinto_and_with_short_reads() -> None:
    data = torch_bytes(training_state(8))
    archive = io.BytesIO()
    codec.encode(_ReadOnly(data), archive, block_size=1 << 16)  # type: ignore[arg-type]
    out = io.BytesIO()
    codec.decode(_ReadOnly(archive.getvalue()), out)  # type: ignore[arg-type]
    assert out.getvalue() == data


def test_damage_mid_stream_leaves_only_a_verified_prefix() -> None:
    rng = np.random.default_rng(9)
    data = torch_bytes({"w": torch.from_numpy(rng.standard_normal(400_000).astype(np.float32))})
    archive, stats = roundtrip(data, block_size=1 << 16)
    assert stats.segments["planes"] >= 20
    damaged = bytearray(archive)
    damaged[len(archive) * 2 // 3] ^= 0x10
    for threads in (1, 2):
        out = io.BytesIO()
        with pytest.raises(IntegrityError, match="damaged"):
            codec.decode(io.BytesIO(bytes(damaged)), out, threads=threads)
        written = out.getvalue()
        assert 0 < len(written) < len(data) and written == data[: len(written)]


class _FailingSink(io.RawIOBase):
    def __init__(self, after: int) -> None:
        self.left = after

    def writable(self) -> bool:
        return True

    def write(self, data: object) -> int:
        n = memoryview(data).nbytes  # type: ignore[arg-type]
        if n > self.left:
            raise OSError(28, "No space left on device")
        self.left -= n
        return n


class _FailingSource(_Generated):
    def readinto(self, view: memoryview) -> int:  # type: ignore[override]
        if self.left < (3 << 20):
            raise OSError(5, "Input/output error")
        return super().readinto(view)


@pytest.mark.timeout(60)
def test_write_and_read_errors_propagate_without_hanging() -> None:
    data = torch_bytes({"w": torch.randn(300_000)})
    archive, _ = roundtrip(data, block_size=1 << 16)
    with pytest.raises(OSError, match="No space"):
        codec.encode(io.BytesIO(data), _FailingSink(len(archive) // 2), block_size=1 << 16)
    with pytest.raises(OSError, match="No space"):
        codec.decode(io.BytesIO(archive), _FailingSink(len(data) // 2))
    with pytest.raises(OSError, match="Input/output"):
        codec.encode(_FailingSource(8 << 20), _Sink(), block_size=1 << 16)


def test_concurrent_calls_share_spare_buffers_safely() -> None:
    # buffers and scratch sets outlive a call and go to the next one, in any thread
    from concurrent.futures import ThreadPoolExecutor

    inputs = [torch_bytes(training_state(seed)) + os.urandom(seed * 999) for seed in range(6)]
    expected = [roundtrip(data, block_size=1 << 16)[0] for data in inputs]

    def both(i: int) -> tuple[bytes, bytes]:
        archive = io.BytesIO()
        codec.encode(io.BytesIO(inputs[i]), archive, name="x.pt", block_size=1 << 16)
        out = io.BytesIO()
        codec.decode(io.BytesIO(archive.getvalue()), out)
        return archive.getvalue(), out.getvalue()

    with ThreadPoolExecutor(3) as pool:
        for _ in range(2):
            for i, (archive, back) in enumerate(pool.map(both, range(len(inputs)))):
                assert archive == expected[i] and back == inputs[i]


def test_other_format_versions_are_refused_by_name() -> None:
    archive = bytearray(roundtrip(torch_bytes({"w": torch.ones(10)}))[0])
    archive[len(codec.MAGIC) : len(codec.MAGIC) + 2] = (codec.CODEC_VERSION - 1).to_bytes(2, "little")
    message = _decode_error(bytes(archive))
    assert f"version {codec.CODEC_VERSION - 1} is not supported" in message and "upgrade" in message


def test_streams_that_end_inside_a_planned_tensor_round_trip() -> None:
    # the layout planner promises regions the stream may not hold (a torn or truncated save)
    data = torch_bytes(training_state(10))
    for cut in (len(data) // 5, len(data) // 2, len(data) - 30, 200):
        for block in (1 << 16, 1 << 20):
            roundtrip(data[:cut], block_size=block)
