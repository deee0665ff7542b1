#!/usr/bin/env python3
"""Archive codec benchmark: ckz1 vs ZipNN, plain zstandard and the zstd command line.

usage: python bench/archive.py [--data DIR] [--inputs ref,trained] [--reps N] [--threads T]

Inputs (``bench/refdata.py``, generated when missing): ``ref`` is DIR/ckpt.pt,
the 252 MB bf16 + fp32-Adam reference checkpoint; ``trained`` is
DIR/trained.pt, a 114 MB fp32 checkpoint of a model really trained for 300
AdamW steps. Everything is file to file, input hot in the page cache; MB =
10^6 bytes; throughput counted on uncompressed bytes. The repetitions are
interleaved (ours, ZipNN, python, CLI, ours, ...) so that every scheme sees
the same machine load, and each figure is the best of N. CPU s/GB is user +
system time of all threads (the process's own, or the CLI child's) per 10^9
uncompressed bytes: less sensitive to other load than wall time.

Baselines: ZipNN (``pip install 'ckptier[bench]'``, i.e. zipnn 0.5.4; left out
with a note when not installed), run as ZipNN's own file scripts run it (the
whole file in memory, ``is_streaming=True``, the file's dominant float dtype,
T threads); and the ``zstd -1 -T2`` command line (``zstd -d``).
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import zstandard
from ckptier.storage import codec

sys.path.insert(0, str(Path(__file__).resolve().parent))
import refdata

OURS = "ckz1 (ours)"
ZIPNN = "ZipNN 0.5.4"
INPUTS: dict[str, Callable[[str], Path]] = {"ref": refdata.ensure, "trained": refdata.ensure_trained}


def _cpu() -> float:
    """CPU seconds (user + system) used so far by this process and its waited-for children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class Best:
    """Best wall and CPU seconds over repeated runs of one step."""

    def __init__(self) -> None:
        self.wall = float("inf")
        self.cpu = float("inf")

    def run(self, fn: Callable[[], object]) -> None:
        c, t = _cpu(), time.perf_counter()
        fn()
        self.wall = min(self.wall, time.perf_counter() - t)
        self.cpu = min(self.cpu, _cpu() - c)


def _dominant_float(path: Path) -> str:
    """The floating-point dtype holding most of the checkpoint's tensor bytes, in ZipNN's spelling."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    totals: dict[str, int] = {}

    def walk(obj: object) -> None:
        if isinstance(obj, torch.Tensor) and obj.is_floating_point():
            name = str(obj.dtype).removeprefix("torch.")
            totals[name] = totals.get(name, 0) + obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    walk(state)
    return max(totals, key=lambda k: totals[k]) if totals else "float32"


_ZIPNN_WIDTH = {"float32": 4, "bfloat16": 2, "float16": 2}


class _Discard:
    """A sink that counts and drops what is written (decoding in memory, without a file's write cost)."""

    def __init__(self) -> None:
        self.n = 0

    def write(self, data: bytes | memoryview) -> int:
        n = memoryview(data).nbytes
        self.n += n
        return n


def _zipnn_schemes(src: Path, work: Path, t: int) -> tuple[Callable[[], object], Callable[[], object], Path, str]:
    """ZipNN's file round trip, as its own scripts do it (whole file in memory, streaming chunks).

    ZipNN 0.5.4 corrupts its heap on a buffer whose length is not a multiple
    of the element size, and reorders its input in place: the bench hands it
    a copy of the aligned part and stores the few tail bytes as they are.
    """
    from zipnn import ZipNN

    dtype = _dominant_float(src)
    width = _ZIPNN_WIDTH.get(dtype, 4)
    out, back = work / "zipnn.znn", work / "zipnn.out"

    def enc() -> None:
        data = bytearray(src.read_bytes())
        aligned = len(data) - len(data) % width
        tail = bytes(data[aligned:])
        del data[aligned:]
        comp = ZipNN(bytearray_dtype=dtype, threads=t, is_streaming=True).compress(data)
        with open(out, "wb") as d:
            d.write(struct.pack("<Q", len(comp)))
            d.write(comp)
            d.write(tail)

    def dec() -> None:
        blob = memoryview(out.read_bytes())
        (n,) = struct.unpack_from("<Q", blob)
        raw = ZipNN(bytearray_dtype=dtype, threads=t, is_streaming=True).decompress(blob[8 : 8 + n])
        with open(back, "wb") as d:
            d.write(raw)
            d.write(blob[8 + n :])

    return enc, dec, out, dtype


def _in_memory(name: str, archive: bytes, t: int, dtype: str) -> Callable[[], object]:
    """Decoding only: from the archive's bytes in memory to a discarding sink (ZipNN: to its output buffer)."""
    if name == OURS:
        return lambda: codec.decode(io.BytesIO(archive), _Discard(), threads=t)  # type: ignore[arg-type]
    if name == ZIPNN:
        from zipnn import ZipNN

        (n,) = struct.unpack_from("<Q", archive)
        body = memoryview(archive)[8 : 8 + n]
        return lambda: ZipNN(bytearray_dtype=dtype, threads=t, is_streaming=True).decompress(body)
    return lambda: zstandard.ZstdDecompressor().copy_stream(io.BytesIO(archive), _Discard())


def bench_one(label: str, src: Path, reps: int, t: int) -> None:
    raw = src.stat().st_size
    original = src.read_bytes()  # also brings the input into the page cache
    work = Path(tempfile.mkdtemp(prefix="ckbench-archive-"))
    cli_name = f"zstd -1 -T{t} (CLI)"
    ours, back = work / "ours.ckz", work / "ours.out"
    plain, pback = work / "plain.zst", work / "pback.out"
    cli, cback = work / "cli.zst", work / "cli.out"

    def enc_ours() -> None:
        with open(src, "rb") as s, open(ours, "wb") as d:
            codec.encode(s, d, name=src.name, threads=t)

    def dec_ours() -> None:
        with open(ours, "rb") as s, open(back, "wb") as d:
            codec.decode(s, d, threads=t)

    def enc_plain() -> None:
        cctx = zstandard.ZstdCompressor(level=1, threads=t, write_checksum=True)
        with open(src, "rb") as s, open(plain, "wb") as d:
            cctx.copy_stream(s, d)

    def dec_plain() -> None:
        with open(plain, "rb") as s, open(pback, "wb") as d:
            zstandard.ZstdDecompressor().copy_stream(s, d)

    schemes: dict[str, tuple[Callable[[], object], Callable[[], object], Path, Path]] = {
        OURS: (enc_ours, dec_ours, ours, back),
    }
    note, dtype = "", ""
    try:
        enc_z, dec_z, zout, dtype = _zipnn_schemes(src, work, t)
        schemes[ZIPNN] = (enc_z, dec_z, zout, work / "zipnn.out")
        note = f"ZipNN with bytearray_dtype={dtype}, is_streaming=True, threads={t}"
    except ImportError:
        note = "ZipNN not installed (pip install 'ckptier[bench]'): its row is left out"
    schemes["zstandard -1 (python)"] = (enc_plain, dec_plain, plain, pback)
    if shutil.which("zstd"):
        schemes[cli_name] = (
            lambda: subprocess.run(["zstd", "-q", "-f", "-1", f"-T{t}", str(src), "-o", str(cli)], check=True),
            lambda: subprocess.run(["zstd", "-q", "-f", "-d", str(cli), "-o", str(cback)], check=True),
            cli,
            cback,
        )
    timings = {name: (Best(), Best()) for name in schemes}
    memory = {name: Best() for name in schemes if name != cli_name}
    try:
        for _ in range(reps):
            for name, (enc, dec, _, _) in schemes.items():
                timings[name][0].run(enc)
                timings[name][1].run(dec)
        for name, (_, _, _, restored) in schemes.items():
            assert restored.read_bytes() == original, f"{name}: round trip is not exact"
        sizes = {name: out.stat().st_size for name, (_, _, out, _) in schemes.items()}
        in_memory = {name: _in_memory(name, schemes[name][2].read_bytes(), t, dtype) for name in memory}
        for _ in range(reps):
            for name, fn in in_memory.items():
                memory[name].run(fn)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rows = {
        name: (raw / sizes[name], raw / c.wall / 1e6, raw / d.wall / 1e6, c.cpu / raw * 1e9, d.cpu / raw * 1e9)
        for name, (c, d) in timings.items()
    }
    print(f"[{label}] input {src} ({raw / 1e6:.1f} MB), best of {reps} interleaved, {t} threads, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    print(f"  {note}")
    print(f"  {'scheme':<24}{'ratio':>8}{'comp MB/s':>11}{'decomp MB/s':>13}{'comp CPU s/GB':>15}{'decomp CPU s/GB':>17}")
    for name, (ratio, c, d, cc, dc) in rows.items():
        print(f"  {name:<24}{ratio:>8.4f}{c:>11.0f}{d:>13.0f}{cc:>15.2f}{dc:>17.2f}")
    print(f"  decoding in memory (archive bytes to a discarding sink), best of {reps}:")
    for name, b in memory.items():
        print(f"  {name:<24}{'':>8}{'':>11}{raw / b.wall / 1e6:>13.0f}{'':>15}{b.cpu / raw * 1e9:>17.2f}")
    if ZIPNN in memory:
        o_m, z_m = memory[OURS], memory[ZIPNN]
        print(f"  ours vs {ZIPNN} in memory: decompress speed x{z_m.wall / o_m.wall:.2f}, "
              f"decompress CPU x{o_m.cpu / z_m.cpu:.2f}")
    o = rows[OURS]
    for base in (ZIPNN, cli_name):
        if base in rows:
            b = rows[base]
            print(f"  ours vs {base}: size ratio x{o[0] / b[0]:.4f} ({(o[0] / b[0] - 1) * 100:+.2f}%), "
                  f"decompress speed x{o[2] / b[2]:.2f}, decompress CPU x{o[4] / b[4]:.2f}, "
                  f"compress speed x{o[1] / b[1]:.2f}, compress CPU x{o[3] / b[3]:.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="/tmp/ckbench_data")
    ap.add_argument("--inputs", default="ref,trained", help="comma-separated: ref, trained")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    labels = [s for s in args.inputs.split(",") if s]
    unknown = [s for s in labels if s not in INPUTS]
    if unknown or not labels:
        print(f"--inputs {args.inputs!r}: choose among {', '.join(INPUTS)}", file=sys.stderr)
        return 2
    for label in labels:
        bench_one(label, INPUTS[label](args.data), args.reps, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
