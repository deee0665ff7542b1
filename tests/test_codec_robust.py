"""The ckz1 decoder on random tensors and on damaged archives.

Property: any tensor ``torch.save`` or safetensors can hold (every dtype the
codec treats as planes and some it does not, any shape including empty and
odd sizes, values from zeros to noise, infinities and NaNs) round-trips
exactly, whatever the block size and thread counts, with the decoder's chunk
size shrunk so that its merging loop ends on partial chunks.

Fuzz: a truncated, bit-flipped, overwritten, cut or spliced archive makes
``decode`` raise ``IntegrityError`` with one line naming the archive (or, if
the damage happened to leave the archive intact, decode it exactly); never
another exception, never a hang, and never more memory than a bound (checked
in a child process by its peak RSS).

Relay: segments whose decoding finishes out of turn are still written in
order; a failed segment leaves exactly the segments before it; reading runs
ahead of a stalled segment only as far as the decoder's window. Nibble
planes: escape positions match ``np.flatnonzero`` at every density, and a
header claiming one escape more or less than the codes hold is refused.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save as save_safetensors

from ckptier.storage import codec, codec_planes
from ckptier.storage.errors import IntegrityError
from tests.fixtures.codec_damage import fixture_archives, mutations

_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.uint8, torch.int8, torch.bool]
_KINDS = ["normal", "scaled", "uniform", "zeros", "constant", "special", "noise", "ints"]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(_DTYPES))
    dims = draw(st.lists(st.integers(0, 70), min_size=0, max_size=3))
    if draw(st.booleans()):  # often one long odd-sized vector: several blocks and a partial one
        dims = [draw(st.integers(0, 90_001))]
    n = int(np.prod(dims)) if dims else 1
    kind = draw(st.sampled_from(_KINDS))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    width = torch.tensor([], dtype=dtype).element_size()
    if n == 0:
        return torch.empty(dims, dtype=dtype)
    if kind == "noise":  # any bit pattern, NaN payloads included
        flat = torch.from_numpy(rng.integers(0, 256, n * width, dtype=np.uint8)).view(dtype)
    elif dtype == torch.bool:
        flat = torch.from_numpy(rng.integers(0, 2, n).astype(bool))
    elif not dtype.is_floating_point:
        values = np.zeros(n, np.int64) if kind == "zeros" else rng.integers(0, 100, n) if kind == "ints" \
            else np.arange(n, dtype=np.int64)
        flat = torch.from_numpy(values).to(dtype)
    else:
        scale = 10.0 ** draw(st.integers(-30, 30))
        values = {
            "normal": lambda: rng.standard_normal(n) * 0.02,
            "scaled": lambda: rng.standard_normal(n) * scale,
            "uniform": lambda: rng.uniform(0, 1, n),
            "zeros": lambda: np.zeros(n),
            "constant": lambda: np.full(n, 1.5),
            "special": lambda: rng.choice([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, 5e-324, 65504.0, 1e38], n),
            "ints": lambda: rng.integers(-1000, 1000, n).astype(np.float64),
        }[kind]()
        flat = torch.from_numpy(values).to(dtype)
    return flat.reshape(dims)


def _roundtrip(data: bytes, block: int, enc_threads: int, dec_threads: int) -> codec.CodecStats:
    archive = io.BytesIO()
    stats = codec.encode(io.BytesIO(data), archive, name="prop.pt", block_size=block, threads=enc_threads)
    out = io.BytesIO()
    back = codec.decode(io.BytesIO(archive.getvalue()), out, threads=dec_threads)
    assert out.getvalue() == data
    assert back.crc64nvme == stats.crc64nvme and back.raw_bytes == len(data)
    return stats


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    parts=st.lists(tensors(), min_size=1, max_size=5),
    container=st.sampled_from(["torch", "safetensors"]),
    block=st.sampled_from([1 << 16, 3 << 16, 1 << 20]),
    enc_threads=st.integers(1, 3),
    dec_threads=st.integers(1, 3),
    chunk=st.sampled_from([2, 64, 1000, 4096, 512 << 10]),
)
def test_random_tensors_round_trip_exactly(
    parts: list[torch.Tensor], container: str, block: int, enc_threads: int, dec_threads: int, chunk: int
) -> None:
    named = {f"t{i}": t.contiguous() for i, t in enumerate(parts)}
    if container == "torch":
        buf = io.BytesIO()
        torch.save({"model": named, "step": 7}, buf)
        data = buf.getvalue()
    else:
        data = save_safetensors({k: v for k, v in named.items() if v.dtype != torch.bool or v.numel()})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(codec_planes, "_DECODE_CHUNK_BYTES", chunk)
        _roundtrip(data, block, enc_threads, dec_threads)


def test_a_plane_block_of_every_width_and_mode_round_trips_with_tiny_chunks() -> None:
    # chunk boundaries inside nibble pairs' runs of escapes, odd element counts, one-element chunks
    rng = np.random.default_rng(11)
    exponents = (rng.standard_normal(50_001) * 10.0 ** rng.uniform(-1, 1, 50_001)).astype(np.float32)
    spread = (rng.standard_normal(20_003) * 10.0 ** rng.uniform(-20, 20, 20_003)).astype(np.float64)
    data = _torch({"f": torch.from_numpy(exponents), "d": torch.from_numpy(spread),
                   "h": torch.from_numpy(exponents[:30_001]).half(), "b": torch.from_numpy(exponents).bfloat16()})
    for chunk in (2, 6, 1 << 10):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(codec_planes, "_DECODE_CHUNK_BYTES", chunk)
            stats = _roundtrip(data, 1 << 16, 2, 2)
    assert stats.segments.get("plane_nibble", 0) >= 4 and stats.segments.get("plane_zstd", 0) >= 1


def _torch(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# --- damaged archives ---------------------------------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(fixture_archives()))
def test_damaged_archives_fail_with_one_clear_line(name: str) -> None:
    import hashlib

    archive, meta = fixture_archives()[name]
    rng = np.random.default_rng(sum(name.encode()))
    label = name.removesuffix(".ckz")
    for what, damaged in mutations(archive, rng, 150):
        out = io.BytesIO()
        try:
            codec.decode(io.BytesIO(damaged), out, threads=int(rng.integers(1, 4)))
        except IntegrityError as exc:
            message = str(exc)
            assert "\n" not in message and message, what
            assert label in message or "archive" in message, (what, message)
        else:
            assert hashlib.sha256(out.getvalue()).hexdigest() == meta["sha256"], f"{what}: decoded wrong bytes"


_CHILD = r"""
import io, json, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from tests.fixtures.codec_damage import fixture_archives, mutations
from ckptier.storage import codec
from ckptier.storage.errors import IntegrityError
def status(field):  # kiB, from the kernel's own accounting of this process
    line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
    return int(line.split()[1])
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
rng = np.random.default_rng(7)
cases = errors = 0
slowest = 0.0
for name, (archive, _) in fixture_archives().items():
    for what, damaged in mutations(archive, rng, 120):
        started = time.monotonic()
        try:
            codec.decode(io.BytesIO(damaged), io.BytesIO(), threads=2)
        except IntegrityError:
            errors += 1
        slowest = max(slowest, time.monotonic() - started)
        cases += 1
peak = status("VmHWM")
print(json.dumps({"cases": cases, "errors": errors, "base_kib": base, "peak_kib": peak, "slowest_s": slowest}))
"""


@pytest.mark.timeout(300)
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak-RSS reset")
def test_damaged_archives_never_crash_hang_or_exhaust_memory(tmp_path: Path) -> None:
    # a child process: a crash (segfault, abort) shows as its exit status, and its peak RSS is its own
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(Path(__file__).resolve().parents[1])],
        capture_output=True, text=True, timeout=280, env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["cases"] == 360 and report["errors"] >= 340
    assert report["slowest_s"] < 10, report
    # archives of 64 KiB blocks: block buffers, scratch sets and zstd windows stay far below this
    assert report["peak_kib"] - report["base_kib"] < 48 * 1024, report


# --- the decoder's relay: segments finishing out of turn ------------------------------------------


class _Instrumented:
    """Wraps the decoder's reading and decoding of segments: numbers segments in reading order, holds
    back the decoding of some, fails one as a damaged segment fails, and records the order in which
    they finish decoding and how far reading ran ahead of writing."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, hold: dict[int, float], fail: int | None = None) -> None:
        import threading

        self.hold, self.fail = hold, fail
        self.lock = threading.Lock()
        self.numbers: dict[int, int] = {}
        self.reads = 0
        self.writes = 0
        self.ahead = 0
        self.done: list[int] = []
        self._read, self._decode = codec._read_segment, codec._decode
        monkeypatch.setattr(codec, "_read_segment", self.read_segment)
        monkeypatch.setattr(codec, "_decode", self.decode)

    def read_segment(self, reader, buffers, stats, expected_offset):  # type: ignore[no-untyped-def]
        seg = self._read(reader, buffers, stats, expected_offset)  # called under the relay's read lock
        if seg is not None:
            with self.lock:
                self.numbers[id(seg)] = self.reads
                self.reads += 1
                self.ahead = max(self.ahead, self.reads - self.writes)
        return seg

    def decode(self, workers, buffers, label, seg):  # type: ignore[no-untyped-def]
        import time

        with self.lock:
            index = self.numbers.pop(id(seg))
        time.sleep(self.hold.get(index, 0.0))
        if index == self.fail:
            buffers.give(seg.inbuf)
            raise IntegrityError(f"{label}: segment checksum mismatch; the archive is damaged", key=label)
        out = self._decode(workers, buffers, label, seg)
        with self.lock:
            self.done.append(index)
        return out

    def sink(self) -> io.BytesIO:
        outer = self

        class Sink(io.BytesIO):
            def write(self, b):  # type: ignore[no-untyped-def, override]
                with outer.lock:
                    outer.writes += 1
                return super().write(b)

        return Sink()


def _planes_archive(n_blocks: int = 12) -> tuple[bytes, bytes, list[int]]:
    """A checkpoint of one fp32 tensor of ``n_blocks`` 64 KiB blocks, its archive, and its segments' raw sizes."""
    rng = np.random.default_rng(5)
    data = _torch({"w": torch.from_numpy(rng.standard_normal(n_blocks * (1 << 14)).astype(np.float32))})
    archive = io.BytesIO()
    codec.encode(io.BytesIO(data), archive, block_size=1 << 16, threads=2)
    reader = codec._ArchiveReader(io.BytesIO(archive.getvalue()), "a")
    codec._read_header(reader)
    sizes: list[int] = []
    pool = codec._Pool(1 << 16)
    while (seg := codec._read_segment(reader, pool, codec.CodecStats("a", ""), sum(sizes))) is not None:
        sizes.append(seg.raw_len)
    return data, archive.getvalue(), sizes


@pytest.mark.timeout(60)
@pytest.mark.parametrize("threads", [2, 3])
def test_segments_decoded_out_of_turn_are_written_in_order(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    data, archive, _ = _planes_archive()
    probe = _Instrumented(monkeypatch, hold={1: 0.05, 4: 0.05})
    out = probe.sink()
    stats = codec.decode(io.BytesIO(archive), out, threads=threads)
    assert out.getvalue() == data and stats.raw_bytes == len(data)
    assert probe.done.index(3) < probe.done.index(1)  # a worker went on past segment 1 instead of waiting


@pytest.mark.timeout(60)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_failed_segment_leaves_exactly_the_segments_before_it(
    monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    data, archive, sizes = _planes_archive()
    fail = 6
    # the segments before the failure are slow, so the ones after it are decoded (and parked) first
    probe = _Instrumented(monkeypatch, hold={3: 0.05, 5: 0.05}, fail=fail)
    out = probe.sink()
    with pytest.raises(IntegrityError, match="segment checksum mismatch"):
        codec.decode(io.BytesIO(archive), out, threads=threads)
    assert out.getvalue() == data[: sum(sizes[:fail])]


@pytest.mark.timeout(60)
def test_the_relay_reads_ahead_of_a_stalled_segment_only_as_far_as_its_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data, archive, sizes = _planes_archive(40)
    assert sizes[1] == 1 << 16  # segment 0: the zip's first header and data.pkl; then the tensor's blocks
    probe = _Instrumented(monkeypatch, hold={1: 0.3})
    out = probe.sink()
    codec.decode(io.BytesIO(archive), out, threads=2)
    assert out.getvalue() == data
    # segment 1 stalls: the other worker reads and decodes on, up to 2 x 2 threads blocks of raw bytes
    assert 3 <= probe.ahead <= 5, probe.ahead


# --- nibble planes: escape positions ----------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 5000), density=st.sampled_from([0.0, 0.001, 0.02, 0.3, 1.0]), seed=st.integers(0, 2**32 - 1))
def test_escape_positions_are_those_of_flatnonzero(n: int, density: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    padded = -(-n // 8) * 8
    mask = np.zeros(padded, np.bool_)
    mask[:n] = rng.random(n) < density
    assert np.array_equal(codec_planes._true_positions(mask, codec_planes.Scratch(), "t"), np.flatnonzero(mask))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 20_000), escapes=st.sampled_from([0.0, 0.003, 0.04]), seed=st.integers(0, 2**32 - 1),
       drop=st.booleans())
def test_nibble_planes_decode_exactly_and_refuse_a_wrong_escape_count(
    n: int, escapes: float, seed: int, drop: bool
) -> None:
    import struct

    import zstandard

    rng = np.random.default_rng(seed)
    plane = (100 + rng.integers(0, 15, n)).astype(np.uint8)
    odd = rng.random(n) < escapes
    plane[odd] = rng.choice([3, 115, 200, 255], int(odd.sum())).astype(np.uint8)
    cctx = zstandard.ZstdCompressor(compression_params=codec_planes.plane_params())
    payload = codec_planes._encode_nibbles(plane, 100, cctx)
    dctx = zstandard.ZstdDecompressor()
    back = codec_planes.decode_plane(codec_planes.PLANE_NIBBLE, memoryview(payload), n, dctx)
    assert np.array_equal(back, plane)
    # the same codes with a header claiming one escape more or less than they hold
    base, packed_len, count = struct.unpack_from("<BII", payload)
    if drop and count == 0:
        return
    lied = struct.pack("<BII", base, packed_len, count - 1 if drop else count + 1)
    with pytest.raises(ValueError, match="escape|zstd frame"):
        codec_planes.decode_plane(codec_planes.PLANE_NIBBLE, memoryview(lied + payload[9:]), n, dctx)
