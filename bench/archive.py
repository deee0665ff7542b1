#!/usr/bin/env python3
"""Archive codec benchmark: ckz1 vs plain zstandard vs the zstd command line.

usage: python bench/archive.py [--data DIR] [--reps N] [--threads T]

Uses DIR/ckpt.pt from ../shared/bench-data/make_checkpoint.py (generated when
missing). All three are file to file, input hot in the page cache, best of N
repetitions; MB = 10^6 bytes; throughput counted on uncompressed bytes.
Baseline: the ``zstd -1 -T2`` command line (and ``zstd -d``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import zstandard

from ckptier.storage import codec

MAKER = Path(__file__).resolve().parents[1].parent / "shared" / "bench-data" / "make_checkpoint.py"


def best_of(reps: int, fn: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="/tmp/ckbench_data")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    src = Path(args.data) / "ckpt.pt"
    if not src.exists():
        maker = Path(os.environ.get("CKPTIER_BENCH_MAKER", MAKER))
        subprocess.run([sys.executable, str(maker), args.data], check=True)
    raw = src.stat().st_size
    src.read_bytes()  # into the page cache
    work = Path(tempfile.mkdtemp(prefix="ckbench-archive-"))
    rows: dict[str, tuple[float, float, float]] = {}
    try:
        ours, back = work / "ours.ckz", work / "ours.out"

        def enc_ours() -> None:
            with open(src, "rb") as s, open(ours, "wb") as d:
                codec.encode(s, d, name=src.name, threads=args.threads)

        def dec_ours() -> None:
            with open(ours, "rb") as s, open(back, "wb") as d:
                codec.decode(s, d, threads=args.threads)

        tc, td = best_of(args.reps, enc_ours), best_of(args.reps, dec_ours)
        assert back.read_bytes() == src.read_bytes(), "ckz1 round trip is not exact"
        rows["ckz1 (ours)"] = (raw / ours.stat().st_size, raw / tc / 1e6, raw / td / 1e6)

        plain, pback = work / "plain.zst", work / "plain.out"

        def enc_plain() -> None:
            cctx = zstandard.ZstdCompressor(level=1, threads=args.threads, write_checksum=True)
            with open(src, "rb") as s, open(plain, "wb") as d:
                cctx.copy_stream(s, d)

        def dec_plain() -> None:
            with open(plain, "rb") as s, open(pback, "wb") as d:
                zstandard.ZstdDecompressor().copy_stream(s, d)

        tc, td = best_of(args.reps, enc_plain), best_of(args.reps, dec_plain)
        rows["zstandard -1 (python)"] = (raw / plain.stat().st_size, raw / tc / 1e6, raw / td / 1e6)

        if shutil.which("zstd"):
            cli, cback = work / "cli.zst", work / "cli.out"
            tc = best_of(args.reps, lambda: subprocess.run(
                ["zstd", "-q", "-f", "-1", f"-T{args.threads}", str(src), "-o", str(cli)], check=True))
            td = best_of(args.reps, lambda: subprocess.run(
                ["zstd", "-q", "-f", "-d", str(cli), "-o", str(cback)], check=True))
            rows[f"zstd -1 -T{args.threads} (CLI)"] = (raw / cli.stat().st_size, raw / tc / 1e6, raw / td / 1e6)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"input {src} ({raw / 1e6:.1f} MB), best of {args.reps}, {args.threads} threads")
    print(f"{'scheme':<26}{'ratio':>8}{'comp MB/s':>12}{'decomp MB/s':>13}")
    for name, (ratio, c, d) in rows.items():
        print(f"{name:<26}{ratio:>8.3f}{c:>12.0f}{d:>13.0f}")
    base = next((k for k in rows if "CLI" in k), None)
    if base:
        o, b = rows["ckz1 (ours)"], rows[base]
        print(f"ours vs {base}: size ratio x{o[0] / b[0]:.3f}, compress speed x{o[1] / b[1]:.2f}, "
              f"decompress speed x{o[2] / b[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
