"""The ckz1 decoder on random tensors and on damaged archives.

Property: any tensor ``torch.save`` or safetensors can hold (every dtype the
codec treats as planes and some it does not, any shape including empty and
odd sizes, values from zeros to noise, infinities and NaNs) round-trips
exactly, whatever the block size and thread counts, with the decoder's chunk
size shrunk so that its chunk loops, nibble pairs and escapes cross chunk
boundaries.

Fuzz: a truncated, bit-flipped, overwritten, cut or spliced archive makes
``decode`` raise ``IntegrityError`` with one line naming the archive (or, if
the damage happened to leave the archive intact, decode it exactly); never
another exception, never a hang, and never more memory than a bound (checked
in a child process by its peak RSS).
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
