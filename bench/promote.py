#!/usr/bin/env python3
"""Promotion into a local archive tier against ``zstd -1 -T2`` per file + sync + ``zstd -dc | cmp``.

usage: python bench/promote.py [--dir DIR] [--ranks 8] [--width 512] [--threads 2] [--repeat 3] [--rebuild]

Data (built once under DIR, default /tmp/ckptier-bench-promote, and reused):
a checkpoint in the storage guide's layout, ``hot/bench/step-00000001/
rank-000R/model.pt`` for R < ranks plus ``metadata.json``; each rank a
``torch.save`` of the kind ``bench/refdata.py`` makes (bf16 weights with
heavy tails, fp32 Adam state; seed 1234 + R). At the default width 512 that is
252 MB a rank, 2.01 GB for 8 ranks; ``--width 128`` makes 31 MB ranks for a
quick check. The page cache is warmed before every timed run.

Contenders, interleaved (baseline, ours, baseline, ...), best of ``--repeat``:

* **baseline**: one shell script under ``/usr/bin/time``: ``zstd -q -1 -T2``
  each file into a fresh directory, ``sync``, then ``zstd -dc FILE.zst | cmp``
  each against its original (compress, write durably, read back, compare);
* **ckptier**: ``ckptier.tasks.archive.promote`` of the verified checkpoint
  into a ``LocalStore`` archive (encode, write each object by temporary file,
  fsync and rename, read back, decode, compare with the hot bytes' CRC64NVME,
  commit the manifest), in a child process under ``/usr/bin/time`` with
  ``--threads`` codec threads and malloc set up as the ``apply`` command
  sets it (``limit_malloc_arenas``: one glibc arena).

Printed: wall seconds, CPU seconds (user + system) and peak RSS of each, the
ratios, and for ckptier also its peak RSS over the child's own RSS just
before it started promoting (interpreter and imports excluded). Targets:
wall <= 1.1x the baseline's, peak <= 64 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import refdata

PREFIX = "bench/step-00000001"
TIME = "/usr/bin/time"


def build(root: Path, ranks: int, width: int) -> dict[str, object]:
    """Write the checkpoint unless an identical build is there; return its description (files, sizes, CRCs)."""
    from ckptier.storage.hashing import hash_file

    described = root / f"built-{ranks}x{width}.json"
    if described.exists():
        doc: dict[str, object] = json.loads(described.read_text())
        if all((root / "hot" / PREFIX / rel).exists() for rel in doc["files"]):  # type: ignore[union-attr]
            return doc
    shutil.rmtree(root, ignore_errors=True)
    step = root / "hot" / PREFIX
    files: dict[str, dict[str, object]] = {}
    for r in range(ranks):
        path = step / f"rank-{r:04d}" / "model.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        refdata.write(path, seed=refdata.SEED + r, width=width)
        print(f"  built {path} ({path.stat().st_size / 1e6:.0f} MB)", flush=True)
    (step / "metadata.json").write_text(json.dumps({"step": 1, "world_size": ranks}))  # the guide's commit evidence
    for path in sorted(p for p in step.rglob("*") if p.is_file()):
        digests = hash_file(path)
        files[str(path.relative_to(step))] = {"size": digests.size, "crc64nvme": digests.crc64nvme}
    doc = {"ranks": ranks, "width": width, "files": files}
    described.write_text(json.dumps(doc, indent=1))
    return doc


def _timed(cmd: list[str]) -> tuple[float, float, int, str]:
    """Run ``cmd`` under GNU time: wall s, CPU s (user + system), peak RSS KiB, and its stdout."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as report:
        proc = subprocess.run([TIME, "-o", report.name, "-f", "%e %U %S %M", *cmd],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd[:3])}...: exit {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        wall, user, system, rss = report.read().split()[-4:]
    return float(wall), float(user) + float(system), int(rss), proc.stdout


def baseline(root: Path, rels: list[str], threads: int) -> tuple[float, float, int]:
    hot = root / "hot" / PREFIX
    out = root / "baseline"
    shutil.rmtree(out, ignore_errors=True)
    lines = ["set -e"]
    for rel in rels:
        src, dst = hot / rel, out / (rel + ".zst")
        lines.append(f"mkdir -p '{dst.parent}' && zstd -q -f -1 -T{threads} '{src}' -o '{dst}'")
    lines.append("sync")
    lines += [f"zstd -q -dc '{out / (rel + '.zst')}' | cmp -s - '{hot / rel}'" for rel in rels]
    wall, cpu, rss, _ = _timed(["sh", "-c", "\n".join(lines)])
    shutil.rmtree(out, ignore_errors=True)
    return wall, cpu, rss


def ours(root: Path, threads: int) -> tuple[float, float, int, dict[str, object]]:
    archive = root / "archive"
    shutil.rmtree(archive, ignore_errors=True)
    archive.mkdir()
    wall, cpu, rss, out = _timed([sys.executable, __file__, "--child", str(root), "--threads", str(threads)])
    shutil.rmtree(archive, ignore_errors=True)
    return wall, cpu, rss, json.loads(out.strip().splitlines()[-1])


def _status_kib(field: str) -> int:
    line = next(line for line in open("/proc/self/status") if line.startswith(field + ":"))
    return int(line.split()[1])


def child(root: Path, threads: int) -> int:
    """Promote the built checkpoint into ROOT/archive; print what it measured of itself as JSON."""
    from ckptier.storage.local import LocalStore
    from ckptier.storage.records import CheckpointRecord, CopyRecord, FileRecord, Format, State, Tier
    from ckptier.tasks.archive import limit_malloc_arenas, promote

    doc = json.loads(next(root.glob("built-*.json")).read_text())
    hot = LocalStore(root / "hot")
    archive = LocalStore(root / "archive")
    now = datetime.now(UTC)
    files = tuple(FileRecord(rel, f["size"], None, None, f["crc64nvme"], None, "ok", None)
                  for rel, f in sorted(doc["files"].items()))
    location = f"{hot.url}/{PREFIX}"
    record = CheckpointRecord(
        id=1, job="bench", step=1, format=Format.GUIDE, state=State.VERIFIED, location=location,
        bytes=sum(f.size for f in files), saved_at=now, first_seen=now, last_seen=now, missing_since=None,
        verified_at=now, state_reason=None, files=files, copies=(CopyRecord(Tier.HOT, location, "present", None, now),),
    )
    limit_malloc_arenas()  # as the apply command does before it promotes
    before = _status_kib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # peak RSS (VmHWM) from here on
    except OSError:
        pass
    usage = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    copy = promote(hot, PREFIX, record, archive, now=now, owner="bench", threads=threads)
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime
    print(json.dumps({"seconds": seconds, "cpu": cpu, "rss_before_kib": before, "peak_kib": _status_kib("VmHWM"),
                      "stored": copy.stored_bytes, "raw": copy.raw_bytes}))
    return 0


def _warm(root: Path) -> None:
    for path in (root / "hot").rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(8 << 20):
                    pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/ckptier-bench-promote")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--width", type=int, default=refdata.WIDTH)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rebuild", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(Path(args.child), args.threads)
    for tool in ("zstd", "cmp", TIME):
        if shutil.which(tool) is None:
            print(f"bench/promote.py needs {tool} on PATH (Debian: apt-get install zstd diffutils time)", file=sys.stderr)
            return 2
    root = Path(args.dir)
    if args.rebuild:
        shutil.rmtree(root, ignore_errors=True)
    doc = build(root, args.ranks, args.width)
    for stale in root.glob("built-*.json"):
        if stale.name != f"built-{args.ranks}x{args.width}.json":
            stale.unlink()
    rels = sorted(doc["files"])  # type: ignore[arg-type]
    raw = sum(f["size"] for f in doc["files"].values())  # type: ignore[union-attr]
    best_base = [float("inf")] * 3
    best_ours = [float("inf")] * 6
    stored = 0
    for _ in range(args.repeat):
        _warm(root)
        b = baseline(root, rels, args.threads)
        best_base = [min(x, y) for x, y in zip(best_base, b)]
        _warm(root)
        wall, cpu, rss, me = ours(root, args.threads)
        over = me["peak_kib"] - me["rss_before_kib"]  # type: ignore[operator]
        best_ours = [min(x, y) for x, y in zip(best_ours, (wall, cpu, rss, over, me["seconds"], me["cpu"]))]
        stored = me["stored"]  # type: ignore[assignment]
    bw, bc, brss = best_base
    ow, oc, orss, oover, cw, cc = best_ours
    print(f"checkpoint: {args.ranks} ranks, {len(rels)} files, {raw / 1e9:.2f} GB; best of {args.repeat}, "
          f"{args.threads} threads, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    print(f"baseline zstd -1 -T{args.threads} + sync + zstd -dc | cmp: {bw:6.2f} s wall {bc:6.2f} s CPU "
          f"peak {brss / 1024:6.1f} MiB")
    print(f"ckptier promote() call (ckz1 {raw / stored:.3f}):    {cw:6.2f} s wall {cc:6.2f} s CPU "
          f"peak {orss / 1024:6.1f} MiB ({oover / 1024:.1f} MiB over the idle process)")
    print(f"  as a process (interpreter start and imports too): {ow:6.2f} s wall {oc:6.2f} s CPU")
    print(f"ratio: wall x{cw / bw:.2f} (target <= 1.1; process x{ow / bw:.2f}), CPU x{cc / bc:.2f} "
          f"(process x{oc / bc:.2f}), peak {orss / 1024:.1f} MiB (target <= 64)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
