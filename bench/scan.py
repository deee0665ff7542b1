"""``ckptier scan`` against the plain listing tools, on S3 and on a local tree.

Issue "Catalog every checkpoint", item 8. Two parts, each timed as real
processes (interpreter start and imports included), best of ``--repeat``:

* **S3**: 100,000 objects (1,000 guide-layout checkpoints x 100 files:
  ``job-J/step-XXXXXXXX/rank-RRRR/model.pt`` x 98, ``rank-0000/optimizer.pt``
  and ``metadata.json``) in a fresh moto server on 127.0.0.1 (see serve_moto).
  Baseline: ``aws s3 ls --recursive s3://BUCKET/PREFIX/ > /dev/null``.
  Contender: ``ckptier scan s3://BUCKET/PREFIX --json`` into a fresh SQLite
  catalog each time (a first scan). ``--s3-server rgw`` runs the same part on
  a one-node Ceph RGW started as the tests start it (``tests/fixtures/rgw.py``;
  needs ``radosgw ceph-mon ceph-osd ceph-common``), filled with parallel PUTs.
* **local**: 1,000,000 files (1,000 guide-layout checkpoints x 1,000 files:
  500 ranks x ``model.pt`` + ``optimizer.pt``, plus ``metadata.json``; with
  ``--layout small-dirs`` 110,000 files: 10,000 checkpoints x 5 ranks x 2
  files, plus ``metadata.json``, 60,000 directories), built
  once under ``/tmp/ckptier-bench-scan/tree`` and reused (``--clean``
  removes it at the end). Page cache warm. Baseline:
  ``find DIR -type f > /dev/null``. Contender: ``ckptier scan DIR --json``
  into a fresh SQLite catalog each time.

After each first scan, an unchanged rescan into the same catalog is timed and
the ``rows_written`` it reports is printed (target: 0). Targets (the issue):
first scan <= 1.2x the baseline, rescan writes zero rows.

ckptier's modules are byte-compiled first, as an install leaves them
(``bench/process.py``), so that no run times the compiler.

Run: ``python bench/scan.py`` (both parts, a few minutes on 2 cores; the first
run spends ~2.5 minutes building the local tree). ``--s3-objects N`` shrinks the
S3 part (default 100,000); ``--only s3|local`` runs one part.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import process  # bench/process.py: the executable, and ckptier's modules byte-compiled

TREE_ROOT = Path("/tmp/ckptier-bench-scan")
FILES_PER_RANK = ("model.pt", "optimizer.pt")


# --------------------------------------------------------------- layouts


def s3_keys(checkpoints: int, files_per_checkpoint: int, jobs: int) -> Iterator[tuple[str, bytes]]:
    """Guide-layout keys and tiny bodies: ``files_per_checkpoint - 2`` ranks of
    ``model.pt``, one ``rank-0000/optimizer.pt`` and a ``metadata.json`` each."""
    ranks = max(1, files_per_checkpoint - 2)
    per_job = -(-checkpoints // jobs)
    for c in range(checkpoints):
        job, step = f"job-{c // per_job:02d}", (c % per_job + 1) * 100
        base = f"{job}/step-{step:08d}"
        for r in range(ranks):
            yield f"{base}/rank-{r:04d}/model.pt", b"w"
        yield f"{base}/rank-0000/optimizer.pt", b"o"
        yield f"{base}/metadata.json", json.dumps({"step": step, "loss": 1.0 / step}).encode()


def build_tree(root: Path, checkpoints: int, ranks: int, jobs: int) -> int:
    """Write the local tree unless a complete build with these figures exists;
    return the number of files. Files hold one byte (empty data files would
    make checkpoints incomplete)."""
    marker = root / f"built-{checkpoints}x{ranks}x{jobs}"
    tree = root / "tree"
    files = checkpoints * (ranks * len(FILES_PER_RANK) + 1)
    if marker.exists():
        return files
    free = os.statvfs(root.parent if not root.exists() else root).f_favail
    needed = files + checkpoints * (ranks + 1) + 100
    if free < needed:
        sys.exit(f"bench/scan: {free:,} free inodes under {root.parent}, need ~{needed:,}; "
                 "free some or pass a smaller --local-checkpoints")
    shutil.rmtree(root, ignore_errors=True)
    tree.mkdir(parents=True)
    print(f"building {files:,} files under {tree} (once; reused by later runs) ...", flush=True)
    t0 = time.perf_counter()
    per_job = -(-checkpoints // jobs)
    flags = os.O_CREAT | os.O_WRONLY | os.O_TRUNC
    for c in range(checkpoints):
        step = (c % per_job + 1) * 100
        step_dir = tree / f"job-{c // per_job:02d}" / f"step-{step:08d}"
        step_dir.mkdir(parents=True)
        sd = str(step_dir)
        for r in range(ranks):
            rank_dir = f"{sd}/rank-{r:04d}"
            os.mkdir(rank_dir)
            for name in FILES_PER_RANK:
                fd = os.open(f"{rank_dir}/{name}", flags, 0o644)
                os.write(fd, b"x")
                os.close(fd)
        (step_dir / "metadata.json").write_text(json.dumps({"step": step, "loss": 1.0 / step}))
    marker.write_text("")
    print(f"  built in {time.perf_counter() - t0:.0f} s", flush=True)
    return files


# --------------------------------------------------------------- timing


def timed(cmd: str | Sequence[str], env: dict[str, str], *, shell: bool = False) -> tuple[float, str]:
    """Run a command to completion; (wall seconds, stdout). Fails loudly."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, shell=shell, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"bench/scan: {cmd!r} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return elapsed, proc.stdout


def ckptier_cmd() -> list[str]:
    exe = process.executable()
    return [exe] if exe else [sys.executable, "-m", "ckptier.flows.cli"]


def compare(
    label: str,
    baseline_name: str,
    baseline: Callable[[], float],
    url: str,
    env: dict[str, str],
    repeat: int,
    expect_objects: int,
) -> dict[str, Any]:
    """Interleave baseline and first scans (fresh catalog each), then time rescans."""
    base_times: list[float] = []
    scan_times: list[float] = []
    rescan_times: list[float] = []
    rows_first: int | None = None
    rows_rescan: list[int] = []
    work = Path(tempfile.mkdtemp(prefix="ckptier-bench-scan-"))
    try:
        for i in range(repeat):
            base_times.append(baseline())
            db = work / f"catalog-{i}.db"
            e = dict(env, CKPTIER_CATALOG_URL=f"sqlite:///{db}")
            elapsed, out = timed([*ckptier_cmd(), "scan", url, "--json"], e)
            (report,) = json.loads(out)
            if report["objects"] != expect_objects:
                sys.exit(f"bench/scan: {label}: ckptier listed {report['objects']:,} objects, expected {expect_objects:,}")
            scan_times.append(elapsed)
            rows_first = report["rows_written"]
            elapsed, out = timed([*ckptier_cmd(), "scan", url, "--json"], e)
            rescan_times.append(elapsed)
            rows_rescan.append(json.loads(out)[0]["rows_written"])
            if i != repeat - 1:
                db.unlink()
        committed = report["committed"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    b, s, r = min(base_times), min(scan_times), min(rescan_times)
    print(f"\n[{label}] {expect_objects:,} objects, {report['checkpoints']:,} checkpoints ({committed:,} committed), "
          f"best of {repeat}")
    print(f"  {baseline_name:<34} {b:7.2f} s   (baseline)")
    print(f"  {'ckptier scan, first (fresh catalog)':<34} {s:7.2f} s   {s / b:5.2f}x baseline   "
          f"({rows_first:,} catalog rows written)")
    print(f"  {'ckptier scan, unchanged rescan':<34} {r:7.2f} s   {r / b:5.2f}x baseline   "
          f"(catalog rows written: {', '.join(str(n) for n in rows_rescan)})")
    verdict_first = "met" if s / b <= 1.2 else f"MISSED by {s / b / 1.2:.2f}x"
    verdict_rows = "met" if all(n == 0 for n in rows_rescan) else "MISSED"
    print(f"  target first scan <= 1.2x: {verdict_first}; rescan <= 1.2x: "
          f"{'met' if r / b <= 1.2 else f'MISSED by {r / b / 1.2:.2f}x'}; zero rescan writes: {verdict_rows}")
    return {"baseline_s": b, "scan_s": s, "rescan_s": r, "rows_rescan": rows_rescan}


# --------------------------------------------------------------- S3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def index_moto_listing() -> None:
    """Make moto's ListObjects(V2) without a delimiter cost O(page), as S3's does.

    moto 5 filters and sorts the whole bucket for every page (O(bucket) per
    page: most of a minute of server time to list 100,000 keys), which buries
    the client-side cost this benchmark compares. This keeps a sorted index
    of the bucket's keys, rebuilt whenever the key count changes (the
    benchmark never changes the bucket after filling it), and answers each
    page from it with the same keys and continuation tokens.
    """
    import bisect

    from moto.s3.models import FakeDeleteMarker, FakeTableStorageBucket, S3Backend

    index: dict[str, tuple[int, list[str], list[Any]]] = {}

    def page(bucket: Any, prefix: str | None, after: str | None, max_keys: int) -> list[Any]:
        entry = index.get(bucket.name)
        if entry is None or entry[0] != len(bucket.keys):
            live = sorted((k, v) for k, v in bucket.keys.items() if not isinstance(v, FakeDeleteMarker))
            entry = index[bucket.name] = (len(bucket.keys), [k for k, _ in live], [v for _, v in live])
        _, names, keys = entry
        prefix = prefix or ""
        i = bisect.bisect_left(names, prefix)
        if after:
            i = max(i, bisect.bisect_right(names, after))
        out: list[Any] = []
        while i < len(names) and len(out) <= max_keys and names[i].startswith(prefix):
            out.append(keys[i])
            i += 1
        return out

    original_v1, original_v2 = S3Backend.list_objects, S3Backend.list_objects_v2

    def list_objects(self: Any, bucket: Any, prefix: Any, delimiter: Any, marker: Any, max_keys: Any) -> Any:
        if delimiter or max_keys is None or isinstance(bucket, FakeTableStorageBucket):
            return original_v1(self, bucket, prefix, delimiter, marker, max_keys)
        after = (self._pagination_tokens.get(marker) or marker) if marker else None
        keys, truncated, next_marker = self._truncate_result(page(bucket, prefix, after, max_keys), max_keys)
        return keys, [], truncated, next_marker

    def list_objects_v2(self: Any, bucket: Any, prefix: Any, delimiter: Any, continuation_token: Any,
                        start_after: Any, max_keys: Any) -> Any:
        if delimiter or isinstance(bucket, FakeTableStorageBucket):
            return original_v2(self, bucket, prefix, delimiter, continuation_token, start_after, max_keys)
        after = self._pagination_tokens.get(continuation_token) if continuation_token else start_after
        return self._truncate_result(page(bucket, prefix, after, max_keys), max_keys)

    S3Backend.list_objects = list_objects  # type: ignore[method-assign]
    S3Backend.list_objects_v2 = list_objects_v2  # type: ignore[method-assign]


def memoise_moto_timestamps() -> None:
    """Memoise the timestamp parse in moto's response serializer.

    moto 5 re-parses every object's LastModified string with dateutil when
    it renders a listing: ~0.2 ms per key, about half of the ~0.45 ms per
    listed key that the server spends (profiled with py-spy), all of it
    shared by every client. The parse is a pure function of the string, so
    memoising it changes no response; it only leaves more of each timed
    listing to the client side being compared.
    """
    import functools

    from moto.core import serialize

    serialize.parse_to_aware_datetime = functools.lru_cache(maxsize=1 << 16)(serialize.parse_to_aware_datetime)


def serve_moto(port: int, bucket: str, prefix: str, checkpoints: int, files: int, jobs: int, fast: bool) -> None:
    """The S3 endpoint: moto's server (what ``moto_server`` runs) in this
    process, with the bucket filled through moto's backend directly.

    Why not PutObject over HTTP: moto spends ~4 ms of CPU per request here,
    so 100,000 uploads take 7+ minutes on 2 cores; the listing, which is what
    is timed, goes through HTTP like any client's. Prints ``ready N`` once
    filled, then serves until killed. ``fast``: see :func:`index_moto_listing`
    and :func:`memoise_moto_timestamps`.
    """
    import logging

    from moto.moto_server.threaded_moto_server import ThreadedMotoServer
    from moto.s3.models import s3_backends

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    if fast:
        index_moto_listing()
        memoise_moto_timestamps()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    backend = s3_backends["123456789012"]["global"]
    backend.create_bucket(bucket, "us-east-1")
    n = 0
    for key, body in s3_keys(checkpoints, files, jobs):
        backend.put_object(bucket, f"{prefix}/{key}", body)
        n += 1
    print(f"ready {n}", flush=True)
    threading.Event().wait()


@contextmanager
def moto(env: dict[str, str], bucket: str, prefix: str, checkpoints: int, files: int, jobs: int,
         fast: bool) -> Iterator[str]:
    """A fresh, filled moto server on a free port of 127.0.0.1; its endpoint URL."""
    port = free_port()
    with serving([sys.executable, __file__, "--serve-moto", str(port), bucket, prefix, str(checkpoints), str(files),
                  str(jobs), "fast" if fast else "as-is"], port, env, "bench/scan") as url:
        yield url


@contextmanager
def serving(cmd: list[str], port: int, env: dict[str, str], name: str) -> Iterator[str]:
    """Run ``cmd``, a filled moto server on ``port`` that prints ``ready N`` once it
    holds N objects; yield its endpoint URL, then stop it and its children."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if not line.startswith("ready "):
            sys.exit(f"{name}: the moto server on port {port} did not start (said {line!r})")
        print(f"  moto server on port {port} holds {int(line.split()[1]):,} objects "
              f"(filled in {time.perf_counter() - t0:.0f} s)", flush=True)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


@contextmanager
def rgw(bucket: str, prefix: str, checkpoints: int, files: int, jobs: int) -> Iterator[str]:
    """A fresh one-node Ceph RGW (the test suite's, ``tests/fixtures/rgw.py``) on
    127.0.0.1, filled over HTTP with parallel PutObjects; its endpoint URL.

    RGW has no in-process backend to fill, so the bucket is filled the way a
    training job would fill it, 32 PUTs at a time.
    """
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.fixtures.rgw import start_rgw
    from tests.fixtures.s3 import make_client

    t0 = time.perf_counter()
    try:
        server = start_rgw()
    except BaseException as exc:  # the fixture skips/fails through pytest's outcome exceptions
        if isinstance(exc, KeyboardInterrupt):
            raise
        sys.exit(f"bench/scan: {exc}")
    try:
        client = make_client(server.endpoint, max_pool_connections=32)
        client.create_bucket(Bucket=bucket)
        started = time.perf_counter() - t0

        def put(item: tuple[str, bytes]) -> None:
            client.put_object(Bucket=bucket, Key=f"{prefix}/{item[0]}", Body=item[1])

        with ThreadPoolExecutor(32) as pool:
            n = sum(1 for _ in pool.map(put, s3_keys(checkpoints, files, jobs)))
        print(f"  Ceph RGW at {server.endpoint} holds {n:,} objects (started in {started:.0f} s, "
              f"filled in {time.perf_counter() - t0 - started:.0f} s)", flush=True)
        yield str(server.endpoint)
    finally:
        server.stop()


def run_s3(args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_DEFAULT_REGION="us-east-1")
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "PREFECT_API_URL"):
        env.pop(k, None)
    files = args.s3_files_per_checkpoint
    checkpoints = max(1, args.s3_objects // files)
    objects = checkpoints * files
    bucket, prefix = "bench", "runs"
    server = "a fresh moto_server" if args.s3_server == "moto" else "a fresh one-node Ceph RGW"
    print(f"\nS3: {objects:,} objects ({checkpoints:,} checkpoints x {files} files) into {server}", flush=True)
    serve = (moto(env, bucket, prefix, checkpoints, files, args.jobs, not args.moto_as_is) if args.s3_server == "moto"
             else rgw(bucket, prefix, checkpoints, files, args.jobs))
    with serve as endpoint:
        env["AWS_ENDPOINT_URL"] = endpoint
        cmd = f"aws s3 ls --recursive s3://{bucket}/{prefix}/ > /dev/null"
        return compare(f"s3 on {args.s3_server}", "aws s3 ls --recursive", lambda: timed(cmd, env, shell=True)[0],
                       f"s3://{bucket}/{prefix}", env, args.repeat, objects)


# --------------------------------------------------------------- local


def run_local(args: argparse.Namespace) -> dict[str, Any]:
    ranks = args.local_files_per_checkpoint // len(FILES_PER_RANK)
    files = build_tree(TREE_ROOT, args.local_checkpoints, ranks, args.jobs)
    tree = TREE_ROOT / "tree"
    env = dict(os.environ)
    env.pop("PREFECT_API_URL", None)
    print(f"\nlocal: {files:,} files ({args.local_checkpoints:,} checkpoints x {ranks * 2 + 1} files) in {tree}",
          flush=True)
    cmd = f"find {tree} -type f > /dev/null"
    timed(cmd, env, shell=True)  # warm the dentry/inode caches
    try:
        result = compare("local", "find -type f", lambda: timed(cmd, env, shell=True)[0], str(tree), env,
                         args.repeat, files)
        # find -type f never stats a file; the catalog needs each size and mtime.
        # A second reference that stats like ckptier must:
        stat_cmd = f"find {tree} -type f -printf '%s %T@ %p\\n' > /dev/null"
        f = min(timed(stat_cmd, env, shell=True)[0] for _ in range(args.repeat))
        print(f"  reference: find -printf size,mtime,path  {f:7.2f} s; ckptier first scan {result['scan_s'] / f:.2f}x, "
              f"rescan {result['rescan_s'] / f:.2f}x of it")
        return result
    finally:
        if args.clean:
            shutil.rmtree(TREE_ROOT, ignore_errors=True)
            print(f"  removed {TREE_ROOT}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=("s3", "local"), help="run one part only")
    p.add_argument("--s3-objects", type=int, default=100_000, help="objects in the S3 part (default 100,000)")
    p.add_argument("--s3-files-per-checkpoint", type=int, default=100)
    p.add_argument("--local-checkpoints", type=int, default=1_000)
    p.add_argument("--local-files-per-checkpoint", type=int, default=1_000)
    p.add_argument("--layout", choices=("large-dirs", "small-dirs"), default="large-dirs",
                   help="the local tree: large-dirs (default: 1,000 checkpoints x 1,000 files) or small-dirs "
                        "(10,000 checkpoints x 11 files: 5 ranks x 2 files + metadata.json); sets the two "
                        "--local-* figures")
    p.add_argument("--jobs", type=int, default=10, help="checkpoints are spread over this many jobs")
    p.add_argument("--repeat", type=int, default=3, help="best of N (default 3)")
    p.add_argument("--s3-server", choices=("moto", "rgw"), default="moto",
                   help="the S3 server of the S3 part: moto (default) or a one-node Ceph RGW (radosgw, as the tests "
                        "start it)")
    p.add_argument("--moto-as-is", action="store_true",
                   help="run moto's listing unchanged (O(bucket) per page; about a minute per listing)")
    p.add_argument("--serve-moto", nargs=7, help=argparse.SUPPRESS)
    p.add_argument("--clean", action="store_true", help=f"remove {TREE_ROOT} at the end")
    args = p.parse_args(argv)
    if args.layout == "small-dirs":
        args.local_checkpoints, args.local_files_per_checkpoint = 10_000, 10
    if args.serve_moto:
        port, bucket, prefix, checkpoints, files, jobs, mode = args.serve_moto
        serve_moto(int(port), bucket, prefix, int(checkpoints), int(files), int(jobs), mode == "fast")
        return 0
    process.byte_compiled()  # as an install leaves them: the runs time the scans, not the compiler
    if args.only in (None, "s3"):
        run_s3(args)
    if args.only in (None, "local"):
        run_local(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
