#!/usr/bin/env python3
"""Archive codec benchmark: ckz1 vs plain zstandard vs the zstd command line.

usage: python bench/archive.py [--data DIR] [--reps N] [--threads T]

Uses DIR/ckpt.pt, the reference checkpoint of ``bench/refdata.py`` (generated
when missing). Everything is file to file, input hot in the page cache; MB = 10^6
bytes; throughput counted on uncompressed bytes. The repetitions are
interleaved (ours, python, CLI, ours, ...) so that every scheme sees the same
machine load, and each figure is the best of N. CPU s/GB is user + system
time of all threads (the process's own, or the CLI child's) per 10^9
uncompressed bytes: less sensitive to other load than wall time.
Baseline: the ``zstd -1 -T2`` command line (and ``zstd -d``).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="/tmp/ckbench_data")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    src = refdata.ensure(args.data)
    raw = src.stat().st_size
    original = src.read_bytes()  # also brings the input into the page cache
    work = Path(tempfile.mkdtemp(prefix="ckbench-archive-"))
    t = args.threads
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

    schemes: dict[str, tuple[Callable[[], object], Callable[[], object], Path]] = {
        "ckz1 (ours)": (enc_ours, dec_ours, ours),
        "zstandard -1 (python)": (enc_plain, dec_plain, plain),
    }
    if shutil.which("zstd"):
        schemes[cli_name] = (
            lambda: subprocess.run(["zstd", "-q", "-f", "-1", f"-T{t}", str(src), "-o", str(cli)], check=True),
            lambda: subprocess.run(["zstd", "-q", "-f", "-d", str(cli), "-o", str(cback)], check=True),
            cli,
        )
    timings = {name: (Best(), Best()) for name in schemes}
    try:
        for _ in range(args.reps):
            for name, (enc, dec, _) in schemes.items():
                timings[name][0].run(enc)
                timings[name][1].run(dec)
        assert back.read_bytes() == original, "ckz1 round trip is not exact"
        sizes = {name: out.stat().st_size for name, (_, _, out) in schemes.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rows = {
        name: (raw / sizes[name], raw / c.wall / 1e6, raw / d.wall / 1e6, c.cpu / raw * 1e9, d.cpu / raw * 1e9)
        for name, (c, d) in timings.items()
    }
    print(f"input {src} ({raw / 1e6:.1f} MB), best of {args.reps} interleaved, {t} threads, {os.cpu_count()} CPUs")
    print(f"{'scheme':<26}{'ratio':>8}{'comp MB/s':>11}{'decomp MB/s':>13}{'comp CPU s/GB':>15}{'decomp CPU s/GB':>17}")
    for name, (ratio, c, d, cc, dc) in rows.items():
        print(f"{name:<26}{ratio:>8.3f}{c:>11.0f}{d:>13.0f}{cc:>15.2f}{dc:>17.2f}")
    if cli_name in rows:
        o, b = rows["ckz1 (ours)"], rows[cli_name]
        print(f"ours vs {cli_name}: size ratio x{o[0] / b[0]:.3f}, compress speed x{o[1] / b[1]:.2f}, "
              f"decompress speed x{o[2] / b[2]:.2f}, compress CPU x{o[3] / b[3]:.2f}, "
              f"decompress CPU x{o[4] / b[4]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
