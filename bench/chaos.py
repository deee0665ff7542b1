#!/usr/bin/env python3
"""Chaos: SIGKILLed and concurrent applies, and generated hostile input, checked after every trial.

usage: python bench/chaos.py [--trials 210] [--concurrent 12] [--swaps 60] [--fuzz 10000] [--rebuild 12]
                             [--seed N] [--workdir DIR] [--no-pg] [--keep]

Starts its own ``moto_server`` and PostgreSQL (as tests/fixtures do) on
127.0.0.1, then runs, from one printed seed (the same seed replays the same
worlds, kill points and fuzz inputs; kill *delays* land where the machine's
speed puts them):

* **kill trials** (at least ``--trials`` SIGKILLs): a world of guide-layout
  checkpoints (real ``torch.save`` files with a ``metadata.json``), scanned
  and verified, then ``ckptier apply`` in a child process killed with SIGKILL
  — after a random delay, or at a named point (``bench/chaos_child.py``:
  between upload and manifest, between delete intent and delete, half-way
  through a delete batch, after a multipart part...), once to three times in
  a row. Kinds: ``local`` (local hot and archive), ``s3-archive`` (an S3
  archive, with files above the 5 MiB multipart threshold the children use),
  ``s3-hot`` (checkpoints in S3, archive local or S3). A quarter of the
  worlds use PostgreSQL as the catalog; some have a keeper's byte flipped
  before the apply.
* **concurrent trials** (``--concurrent`` per catalog): two applies at once
  on PostgreSQL and on SQLite, each killed at a random delay or not.
* **swap trials** (``--swaps``): a local world, scanned and verified, whose
  hot tree is changed under ``ckptier apply`` at a random point between the
  scan and the delete (before the apply; or, in the child, right after a
  lease, a live listing, a stat, a keeper's proof or the delete intent): a
  rolling checkpoint's step directory, its rank directory or the job
  directory swapped for a symlink to the newest checkpoint or to a tree
  outside the root laid out like it, a file swapped for a symlink to a
  root-only file outside or to a keeper's file. Then: nothing outside the
  root changed (a snapshot of it, bytes, directories and links), every kept
  checkpoint's files are intact, no traceback; the swap is undone, and a
  rescan, a verify and the after-trial checks below pass.
* **rebuild trials** (``--rebuild``, :func:`rebuild_trial`): a tiered world's catalog is lost
  (its backup kept, removed, or the newest corrupted) and ``ckptier rebuild`` children are
  SIGKILLed one to three times (at a crash point: a backup restored, a hot location scanned, a
  job's archive copies recorded; or after a random delay), then run to the end: the catalog must
  be identical to an uninterrupted rebuild's, agree with storage and fetch bit-exactly.
* **fuzz** (``--fuzz`` cases, ``bench/chaos_fuzz.py``): generated trees,
  archive manifests and S3 keys (hostile names, broken metadata.json, steps
  at the edges, empty files, duplicate steps, odd unicode, symlinks, FIFOs,
  files swapped after the scan...) through scan, verify, plan, apply and
  fetch.

After every trial: the re-run of ``apply`` exits 0 with no lease held and no
delete intent left; a rescan and another apply change nothing the catalog
disagrees with (every hot file, tombstone and archive copy matches storage);
no archive object is left that neither a committed manifest nor an upload
marker accounts for, and no manifest without all its data; the janitor leaves
every committed copy intact; every checkpoint the plan keeps (and every one
an independent oracle of the policy keeps) fetches bit-exactly; no command
printed a traceback or died of anything but our SIGKILL. Targets: 0
violations, 0 crashes, 0 stuck. The baseline of the last table is an
uninterrupted apply of the same kind of world, measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CHILD = HERE / "chaos_child.py"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import chaos_child  # noqa: E402

KINDS = ("local", "s3-archive", "s3-hot")
#: What a swap trial puts a symlink in place of, and to what (see the module docstring).
SWAPS = ("step-to-newest", "step-to-outside", "rank-to-outside", "job-to-outside", "file-to-outside",
         "file-to-keeper")
#: When: before the apply, or at a point of the child apply (``bench/chaos_child.py``).
SWAP_AT = ("before", "lease", "list", "stat", "proof", "intent")
BUCKET = "chaos"
KILL_POINTS = tuple(p for p in chaos_child.POINTS)
#: Exit status of a run that skipped work another live run holds.
EXIT_BUSY = 75


# ------------------------------------------------------------------------------ results


@dataclass
class Tally:
    """Figures of one kind of trial."""

    trials: int = 0
    kills: int = 0
    hook_kills: int = 0
    delay_kills: int = 0
    finished: int = 0  # children that finished before the kill came
    violations: int = 0
    crashes: int = 0
    stuck: int = 0
    points: Counter[str] = field(default_factory=Counter)


def count_kill(t: Tally, died: bool, point: str, delay: float | None) -> bool:
    """Count one child's end in ``t``: killed by us (at ``point``, or after ``delay``), or finished."""
    if not died:
        t.finished += 1
        return False
    t.kills += 1
    t.points[point if delay is None else "delay"] += 1
    if delay is None:
        t.hook_kills += 1
    else:
        t.delay_kills += 1
    return True


@dataclass
class Findings:
    """Everything a run found: figures per kind and one line per problem."""

    tallies: dict[str, Tally] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    baseline: dict[str, list[float]] = field(default_factory=dict)
    recovery: dict[str, list[float]] = field(default_factory=dict)
    fuzz: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, tuple[int, str]] = field(default_factory=dict)  # signature -> (count, first example)
    seconds: Counter[str] = field(default_factory=Counter)  # wall time by phase
    hits: dict[str, Counter[str]] = field(default_factory=dict)  # kind -> crash points an apply reached

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.seconds[phase] += time.monotonic() - t0

    def tally(self, kind: str) -> Tally:
        return self.tallies.setdefault(kind, Tally())

    def add(self, kind: str, what: str, line: str) -> None:
        """Record one problem: ``what`` is ``violation``, ``crash`` or ``stuck``."""
        t = self.tally(kind)
        attr = {"violation": "violations", "crash": "crashes", "stuck": "stuck"}[what]
        setattr(t, attr, getattr(t, attr) + 1)
        self.problems.append(f"[{kind}] {what}: {line}")
        sig = f"[{kind}] {what}: {signature(line)}"
        count, example = self.kinds.get(sig, (0, line))
        self.kinds[sig] = (count + 1, example)

    @property
    def totals(self) -> tuple[int, int, int]:
        ts = self.tallies.values()
        return (sum(t.violations for t in ts), sum(t.crashes for t in ts), sum(t.stuck for t in ts))


def signature(line: str) -> str:
    """What kind of problem ``line`` is: the message without trial names, quoted values, paths and numbers."""
    head = line.split("\n", 1)[0]
    head = head.split(": ", 1)[1] if head[:1].isalpha() and ": " in head and "(" in head.split(": ", 1)[0] else head
    last = line.strip().splitlines()[-1] if "Traceback" in line else ""
    text = f"{head} | {last}" if last else head
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", text)
    text = re.sub(r"(file|s3)://\S+|/\S+", "PATH", text)
    text = re.sub(r"\d+", "N", text)
    return text[:160]


# ------------------------------------------------------------------------------ services


@dataclass
class Services:
    """The servers the trials use: a moto_server endpoint and, optionally, PostgreSQL."""

    moto: str
    pg: Any = None  # tests.fixtures.pg.PgServer
    stop: Callable[[], None] = lambda: None


def start_services(with_pg: bool) -> Services:
    """Start ``moto_server`` and (``with_pg``) PostgreSQL as the test fixtures do."""
    from tests.fixtures.s3 import _server_command, _wait_until_up
    from tests.fixtures.services import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(_server_command(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "MOTO_ALLOW_NONEXISTENT_REGION": "true"})
    problem = _wait_until_up(url, proc)
    if problem is not None:
        proc.kill()
        raise SystemExit(f"chaos: {problem}")
    pg = None
    if with_pg:
        from tests.fixtures import pg as pgfix

        try:
            pg = pgfix._start()
        except BaseException as exc:  # pytest's skip/fail outcomes carry the reason
            proc.kill()
            raise SystemExit(f"chaos: PostgreSQL did not start ({exc}); use --no-pg to run without it") from None

    def stop() -> None:
        if pg is not None:
            pgfix._stop(pg)
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()

    return Services(url, pg, stop)


def s3_environment(endpoint: str, home: Path) -> dict[str, str]:
    """AWS_* variables pointing boto3 at ``endpoint`` with dummy credentials and no shared config."""
    empty = home / "aws-none"
    empty.write_text("")
    return {
        "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": str(empty), "AWS_SHARED_CREDENTIALS_FILE": str(empty),
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def share_botocore_data() -> Callable[[], None]:
    """Parse botocore's JSON data files once per process instead of once per client;
    returns what undoes it.

    A speed-up of this harness only (each boto3 session otherwise re-reads the S3
    service model and endpoint files: ~0.4 s per client, and the in-process
    commands open several per trial). The data are the same; ckptier's code is
    unchanged, and the child processes run unpatched.
    """
    from botocore import loaders

    shared: dict[Any, Any] = {}
    init = loaders.Loader.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._cache = shared

    loaders.Loader.__init__ = __init__  # type: ignore[method-assign]

    def undo() -> None:
        loaders.Loader.__init__ = init  # type: ignore[method-assign]

    return undo


def s3_client(endpoint: str) -> Any:
    from tests.fixtures.s3 import make_client

    return make_client(endpoint)


# ------------------------------------------------------------------------------ commands


@dataclass
class Run:
    """One command: its arguments, exit status (None: raised), output and error text."""

    argv: list[str]
    rc: int | None
    out: str
    err: str

    def line(self) -> str:
        text = (self.err.strip() or self.out.strip()).splitlines()
        return f"ckptier {' '.join(self.argv[:1])} exited {self.rc}: {text[-1][:1000] if text else ''}"


class Stopped(BaseException):
    """SIGTERM: stop the run, never counted as a command's crash."""


def cli(*argv: str) -> Run:
    """Run ``ckptier ARGV`` in this process, capturing stdout and stderr; an exception is a crash."""
    from ckptier.flows.cli import main

    out, err = io.StringIO(), io.StringIO()
    rc: int | None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(list(argv))
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 2
    except Exception:  # noqa: BLE001 - exactly what this bench counts
        # (a SIGTERM, Ctrl-C or a test's timeout is no crash of this command: it stops the run)
        rc = None
        err.write(traceback.format_exc())
    return Run(list(argv), rc, out.getvalue(), err.getvalue())


def traceback_in(run: Run) -> bool:
    return run.rc is None or "Traceback (most recent call last)" in run.out + run.err


# ------------------------------------------------------------------------------ data


def tensor_file(rnd: random.Random, nbytes: int, *, compressible: bool) -> bytes:
    """A real ``torch.save`` file of about ``nbytes`` bytes (float32 noise, or small integers)."""
    import numpy as np
    import torch

    gen = np.random.default_rng(rnd.getrandbits(64))
    n = max(1, nbytes // 4)
    if compressible:
        arr = gen.integers(0, 4, size=n, dtype=np.int32)
    else:
        arr = gen.standard_normal(n, dtype=np.float32)
    buf = io.BytesIO()
    torch.save({"w": torch.from_numpy(arr)}, buf)
    return buf.getvalue()


def guide_checkpoint(rnd: random.Random, step: int, *, big: int = 0, ranks: int = 1) -> dict[str, bytes]:
    """The files of one guide-layout checkpoint (relpath -> bytes), ``metadata.json`` listing
    every file's size and sha256. ``big``: size of an extra large, incompressible model file."""
    files: dict[str, bytes] = {}
    for r in range(ranks):
        files[f"rank-{r:04d}/model.pt"] = tensor_file(rnd, big or rnd.randrange(2000, 12000), compressible=False)
        files[f"rank-{r:04d}/optimizer.pt"] = tensor_file(rnd, rnd.randrange(2000, 20000), compressible=True)
    meta = {"step": step, "loss": round(rnd.uniform(0.5, 3.0), 4),
            "files": {rel: {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for rel, b in files.items()}}
    files["metadata.json"] = json.dumps(meta).encode()
    return files


# ------------------------------------------------------------------------------ worlds


@dataclass
class World:
    """One trial's checkpoints, stores, catalog and policy, and what the bench wrote."""

    kind: str
    root: Path
    job: str
    hot_url: str
    archive_url: str
    catalog_url: str
    config: Path
    steps: list[int]
    files: dict[int, dict[str, bytes]]
    keep_last: int
    milestones: list[int]
    min_verified: int
    hot_after_archive: str
    corrupted: set[int] = field(default_factory=set)
    drop: Callable[[], None] = lambda: None

    def args(self, command: str, *more: str) -> list[str]:
        return [command, "--catalog", self.catalog_url, "--config", str(self.config), *more]

    def expected(self) -> tuple[set[int], set[int]]:
        """The policy worked out independently: (steps kept whole, milestone holders whose hot copy goes)."""
        last = set(self.steps[-self.keep_last:])
        holders = {next(s for s in self.steps if s >= m) for m in self.milestones if any(s >= m for s in self.steps)}
        hot_gone = set() if self.hot_after_archive == "keep" else holders - last
        return (last | holders) - hot_gone, hot_gone


class Worlds:
    """Builds worlds of each kind under ``root``."""

    def __init__(self, root: Path, services: Services) -> None:
        self.root = root
        self.services = services
        self._s3: Any = None
        self.n = 0

    @property
    def s3(self) -> Any:
        if self._s3 is None:
            self._s3 = s3_client(self.services.moto)
            with contextlib.suppress(Exception):
                self._s3.create_bucket(Bucket=BUCKET)
        return self._s3

    def catalog(self, rnd: random.Random, name: str, root: Path, *, pg: bool) -> tuple[str, Callable[[], None]]:
        if pg and self.services.pg is not None:
            db = f"chaos_{name.replace('-', '_')}_{uuid.uuid4().hex[:8]}"
            url = self.services.pg.create_database(db)
            return url, lambda: self.services.pg.drop_database(db)
        return f"sqlite:///{root / 'catalog.db'}", lambda: None

    def build(self, kind: str, rnd: random.Random, *, pg: bool = False) -> World:
        self.n += 1
        name = f"{kind}-{self.n:04d}"
        root = self.root / name
        root.mkdir(parents=True)
        job = rnd.choice(["llm", "runs/llama-7b", "exp/ünïcode run"])
        cadence = rnd.choice([100, 150, 250])
        steps = [cadence * (i + 1) for i in range(rnd.randrange(8, 12))]
        keep_last = rnd.choice([1, 2, 3])
        milestones = sorted(rnd.sample([s + rnd.choice([0, 1, cadence // 2]) for s in steps[:-3]], 2))
        min_verified = rnd.randrange(1, keep_last + 1)
        hot_after = rnd.choice(["delete", "keep"])
        holders = {next(s for s in steps if s >= m) for m in milestones}
        big_step = rnd.choice(sorted(holders)) if kind != "local" else None
        files = {s: guide_checkpoint(rnd, s, big=rnd.randrange(6 << 20, 9 << 20) if s == big_step else 0,
                                     ranks=rnd.choice([1, 1, 2])) for s in steps}
        tag = uuid.uuid4().hex[:10]
        if kind == "s3-hot":
            hot_url = f"s3://{BUCKET}/{tag}/hot"
            for s, fs in files.items():
                for rel, data in fs.items():
                    extra = {"ChecksumAlgorithm": "CRC64NVME"} if rnd.random() < 0.5 else {}
                    self.s3.put_object(Bucket=BUCKET, Key=f"{tag}/hot/{job}/step-{s:08d}/{rel}", Body=data, **extra)
        else:
            hot = root / "hot"
            hot_url = str(hot)
            for s, fs in files.items():
                for rel, data in fs.items():
                    p = hot / job / f"step-{s:08d}" / rel
                    p.parent.mkdir(parents=True, exist_ok=True)
                    p.write_bytes(data)
        s3_archive = kind == "s3-archive" or (kind == "s3-hot" and rnd.random() < 0.5)
        archive_url = f"s3://{BUCKET}/{tag}/archive" if s3_archive else str(root / "archive")
        if s3_archive:
            self.s3  # noqa: B018 - the bucket exists
        catalog_url, drop = self.catalog(rnd, name, root, pg=pg)
        config = root / "ckptier.toml"
        config.write_text(
            "[[policy]]\n"
            'jobs = "*"\n'
            f"keep_last = {keep_last}\n"
            f"milestones = {milestones}\n"
            f"min_verified = {min_verified}\n"
            f'hot_after_archive = "{hot_after}"\n'
            f'archive = "{archive_url}"\n'
        )
        world = World(kind, root, job, hot_url, archive_url, catalog_url, config, steps, files, keep_last,
                      milestones, min_verified, hot_after, drop=drop)

        def cleanup() -> None:
            drop()
            if hot_url.startswith("s3://") or archive_url.startswith("s3://"):
                empty_prefix(self.s3, tag + "/")

        world.drop = cleanup
        return world

    def prepare(self, world: World, rnd: random.Random, findings: Findings, *, corrupt: bool) -> bool:
        """Scan and verify the world (in this process); optionally flip a byte of one checkpoint
        afterwards, keeping its size and mtime. False when the set-up itself failed."""
        for argv in (world.args("scan", "--no-prefect", world.hot_url), world.args("verify", "--no-prefect")):
            run = cli(*argv)
            if run.rc != 0 or traceback_in(run):
                findings.add(world.kind, "crash" if traceback_in(run) else "violation",
                             f"set-up {run.line()}\n{run.err[-2000:]}")
                return False
        if corrupt:
            step = rnd.choice(world.steps)
            rel = rnd.choice(sorted(r for r in world.files[step] if r.endswith(".pt")))
            flip(world, step, rel, rnd, self.s3)
            world.corrupted.add(step)
        return True


def flip(world: World, step: int, rel: str, rnd: random.Random, s3: Any) -> None:
    """Flip one byte of a hot file in place, keeping its size (and, locally, its mtime)."""
    data = bytearray(world.files[step][rel])
    i = rnd.randrange(len(data))
    data[i] ^= 0xFF
    if world.hot_url.startswith("s3://"):
        bucket, _, prefix = world.hot_url[5:].partition("/")
        s3.put_object(
            Bucket=bucket, Key=f"{prefix}/{world.job}/step-{step:08d}/{rel}", Body=bytes(data))
        return
    p = Path(world.hot_url) / world.job / f"step-{step:08d}" / rel
    st = p.stat()
    p.write_bytes(bytes(data))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))


def canary_debris(s3: Any) -> int:
    """Canary objects (``.ckptier-canary/``) left at the chaos bucket's root: a run killed between
    a store's canary put and its delete leaves one, and nothing removes it."""
    from ckptier.storage.s3 import CANARY_PREFIX

    return int(s3.list_objects_v2(Bucket=BUCKET, Prefix=CANARY_PREFIX).get("KeyCount", 0))


def empty_prefix(s3: Any, prefix: str) -> None:
    """Delete every object and abort every multipart upload under ``prefix`` of the chaos bucket."""
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        keys = [o["Key"] for o in page.get("Contents", [])]
        plain = [{"Key": k} for k in keys if k.isprintable()]
        if plain:
            s3.delete_objects(Bucket=BUCKET, Delete={"Objects": plain, "Quiet": True})
        for k in keys:
            if not k.isprintable():  # DeleteObjects' XML cannot carry it
                s3.delete_object(Bucket=BUCKET, Key=k)
    for up in s3.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", []):
        with contextlib.suppress(Exception):
            s3.abort_multipart_upload(Bucket=BUCKET, Key=up["Key"], UploadId=up["UploadId"])


# ------------------------------------------------------------------------------ children


class Child:
    """``ckptier apply`` in a child process (``bench/chaos_child.py``), started ahead of time:
    :meth:`ChildPool.take` hands out one that has already imported everything."""

    def __init__(self, env: dict[str, str]) -> None:
        self.point, self.n = "none", 0
        self.proc = subprocess.Popen([sys.executable, str(CHILD)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.started: float | None = None
        self.killed_by_us = False
        self.out = self.err = ""
        self.orders: dict[str, Any] = {}

    def aim(self, world: World, point: str, n: int) -> Child:
        """What this child will do on :meth:`go`: apply ``world``, killing itself at ``point`` #``n``."""
        self.point, self.n = point, n
        self.orders = {"point": point, "n": n, "argv": world.args("apply", "--no-prefect"), "cwd": str(world.root)}
        return self

    def wait_ready(self) -> bool:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip() == "ready"

    def go(self) -> None:
        assert self.proc.stdin is not None and self.orders
        self.started = time.monotonic()
        self.proc.stdin.write(json.dumps(self.orders) + "\n")
        self.proc.stdin.flush()

    def kill_after(self, delay: float) -> None:
        """SIGKILL the child ``delay`` seconds after ``go`` unless it finished first."""
        assert self.started is not None
        deadline = self.started + delay
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return
            time.sleep(min(0.005, max(0.0, deadline - time.monotonic())))
        if self.proc.poll() is None:
            self.killed_by_us = True
            self.proc.kill()

    def finish(self, timeout: float = 600) -> int:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            err += f"\nchaos: child still running after {timeout:.0f} s; killed"
        self.out, self.err = out, err
        return int(self.proc.returncode)

    def report(self) -> tuple[float, dict[str, int]] | None:
        """(seconds, hit counts) when the child ran ckptier to its end."""
        for line in reversed(self.out.splitlines()):
            if line.startswith("chaos-child: "):
                secs, _, counts = line[len("chaos-child: "):].partition(" ")
                return float(secs), json.loads(counts)
        return None


class ChildPool:
    """Keeps ``size`` children importing in the background so that a trial never waits for one."""

    def __init__(self, env: dict[str, str], size: int = 1) -> None:
        self.env = env
        self.spare = [Child(env) for _ in range(size)]

    def take(self, world: World, point: str, n: int) -> Child:
        child = self.spare.pop(0)
        self.spare.append(Child(self.env))
        return child.aim(world, point, n)

    def close(self) -> None:
        for c in self.spare:
            with contextlib.suppress(Exception):
                c.proc.communicate(input="\n", timeout=30)
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()


# ------------------------------------------------------------------------------ checks


def check(world: World, findings: Findings, label: str, *, s3: Any, since: float) -> None:
    """The after-trial checks (see the module docstring); each failure is recorded in ``findings``.

    ``s3``: a boto3 client for the bench's own looks at S3; ``since``: when the last child ended
    (``time.monotonic()``)."""
    kind = world.kind

    def bad(what: str, line: str) -> None:
        findings.add(kind, what, f"{label}: {line}")

    def command(*argv: str, ok: tuple[int, ...] = (0,)) -> Run:
        run = cli(*argv)
        if traceback_in(run):
            bad("crash", f"{run.line()}\n{(run.err or run.out)[-3000:]}")
        elif run.rc not in ok:
            bad("stuck" if run.rc == EXIT_BUSY else "violation", f"{run.line()}\n{run.out[-1500:]}")
        return run

    started = time.monotonic()
    # A checkpoint whose bytes rotted fails the run that finds it (it is recorded corrupt);
    # the next run must plan without it and succeed, with no verify by hand in between.
    command(*world.args("apply", "--no-prefect"), ok=(0, 1) if world.corrupted else (0,))
    findings.recovery.setdefault(kind, []).append(time.monotonic() - started)
    if world.corrupted:
        command(*world.args("apply", "--no-prefect"))
    stuck_state(world, bad, findings, now=datetime.now(UTC))
    command(*world.args("scan", "--no-prefect", world.hot_url))
    command(*world.args("apply", "--no-prefect"))
    # The janitor only takes objects older than its threshold: the killed child's are.
    time.sleep(max(0.0, 1.05 - (time.monotonic() - since)))
    command(*world.args("janitor", "--older-than", "1s"))
    stuck_state(world, bad, findings, now=datetime.now(UTC))
    agreement(world, bad, s3)
    plan = command(*world.args("plan", "--json"))
    if plan.rc == 0:
        fetches(world, bad, json.loads(plan.out) if plan.out.strip() else [])


def stuck_state(world: World, bad: Callable[[str, str], None], findings: Findings, *, now: datetime) -> None:
    """No lease that would hold up another run, and no delete intent, is left.

    A lease whose holder's process is provably gone (a killed child's, on a
    row no later work needed) blocks nobody: the next claimant takes it over
    at once. Those are only counted (``Findings.fuzz["dead_leases"]``); a
    lease held by a live process or one that cannot be proven gone is stuck.
    """
    from ckptier.storage.catalog.api import Catalog
    from ckptier.tasks.leases import holder_is_gone

    with Catalog.open(world.catalog_url) as cat:
        for rec in cat.checkpoints(include_deleted=True, with_files=False):
            holder = cat.lease_holder(rec.id, now=now)
            if holder is None:
                continue
            if holder_is_gone(holder):
                findings.fuzz["dead_leases"] = findings.fuzz.get("dead_leases", 0) + 1
            else:
                bad("stuck", f"step {rec.step}: lease held by {holder.describe()}, whose process is not provably "
                             f"gone, after the re-run")
        for intent in cat.delete_intents():
            bad("stuck", f"step {intent.step}: delete intent ({intent.scope}) left after the re-run")


def _keys(store: Any, prefix: str) -> dict[str, int]:
    from ckptier.storage.errors import NotFound

    try:
        return {i.key: i.size for i in store.list(prefix)}
    except NotFound:
        return {}


def open_bench_store(url: str, s3: Any) -> Any:
    """The store of ``url`` for the bench's own looks (S3 through the bench's client)."""
    from ckptier.storage.url import open_store

    return open_store(url, client=s3) if url.startswith("s3://") else open_store(url)


def agreement(world: World, bad: Callable[[str, str], None], s3: Any) -> None:
    """Catalog against storage: hot files, tombstones, archive copies, debris and in-flight uploads."""
    from ckptier.storage.catalog.api import Catalog
    from ckptier.storage.manifest import Manifest
    from ckptier.tasks.archive import (
        DATA_SUFFIX,
        MANIFEST_NAME,
        UPLOAD_MARKER,
        UploadMarker,
        archive_dir,
        prefix_from_location,
    )

    hot = open_bench_store(world.hot_url, s3)
    archive = open_bench_store(world.archive_url, s3)
    with Catalog.open(world.catalog_url) as cat:
        records = cat.checkpoints(include_deleted=True)
    expected_keep, expected_hot_gone = world.expected()
    recorded_copies: dict[str, Any] = {}
    for r in records:
        where = f"step {r.step} ({r.state.value}, tiers {','.join(r.tiers) or '-'})"
        present = _keys(hot, prefix_from_location(hot, r.location) + "/")
        hot_copy = next((c for c in r.copies if c.tier.value == "hot"), None)
        if r.state.value == "deleted" or (hot_copy is not None and hot_copy.state == "deleted"):
            if present:
                bad("violation", f"{where}: recorded deleted but {len(present)} hot files remain")
        elif "hot" in r.tiers:
            for f in r.files:
                key = f"{prefix_from_location(hot, r.location)}/{f.relpath}"
                if present.get(key) != f.size:
                    bad("violation", f"{where}: catalog lists {f.relpath} ({f.size} bytes), the hot store has "
                                     f"{present.get(key)}")
            if r.missing_since is not None:
                bad("violation", f"{where}: missing since {r.missing_since} after a rescan of a present copy")
        elif present:
            bad("violation", f"{where}: no hot copy recorded but {len(present)} hot files exist")
        copy = r.archive_copy()
        if copy is not None:
            recorded_copies[archive_dir(r.job, r.step)] = (r, copy)
            if copy.state != "present":
                bad("violation", f"{where}: archive copy is {copy.state}")
        # Safety against an oracle of the policy: kept checkpoints are never deleted.
        if r.step in expected_keep and r.state.value == "deleted":
            bad("violation", f"{where}: deleted, but the policy keeps it")
        if r.step in expected_hot_gone and r.state.value == "deleted":
            bad("violation", f"{where}: deleted, but the policy keeps its archive copy")
        if not world.corrupted:
            if r.step not in expected_keep | expected_hot_gone and r.state.value != "deleted":
                bad("violation", f"{where}: the policy deletes it, still {r.state.value} after the re-runs")
            if r.step in expected_hot_gone and "hot" in r.tiers:
                bad("violation", f"{where}: the policy deletes its hot copy, still there after the re-runs")
    # The archive: committed copies complete and cataloged, nothing else but marked debris.
    from ckptier.storage.archive_copies import BACKUP_PREFIX

    objects = {k: v for k, v in _keys(archive, "").items() if not k.startswith(BACKUP_PREFIX)}  # catalog backups
    dirs: dict[str, dict[str, int]] = {}
    for key, size in objects.items():
        head, sep, _ = key.partition("/step-")
        d = head + sep + key[len(head) + len(sep):].split("/", 1)[0] if sep else ""
        dirs.setdefault(d, {})[key] = size
    uploads = []
    if hasattr(archive, "list_multipart_uploads"):
        uploads = [k for k, _, _ in archive.list_multipart_uploads("")]
    marked_keys: set[str] = set()
    for d, keys in sorted(dirs.items()):
        marker = f"{d}/{UPLOAD_MARKER}"
        if marker in keys:
            try:
                with archive.open_read(marker) as fh:
                    m = UploadMarker.from_json(fh.read(), where=marker)
                marked_keys |= {f"{d}/{k}" for k in m.keys} | {marker}
            except Exception as exc:  # noqa: BLE001
                bad("violation", f"{marker}: unreadable upload marker ({exc})")
        mkey = f"{d}/{MANIFEST_NAME}"
        if mkey not in keys:
            stray = sorted(k for k in keys if k not in marked_keys)
            if stray:
                bad("violation", f"archive objects no manifest or marker accounts for: {stray[:3]}")
            if d in recorded_copies:
                bad("violation", f"{d}: the catalog records this archive copy but it has no manifest")
            continue
        try:
            with archive.open_read(mkey) as fh:
                manifest = Manifest.from_json(fh.read())
        except Exception as exc:  # noqa: BLE001
            bad("violation", f"{mkey}: committed manifest unreadable ({exc})")
            continue
        listed = {f"{d}/{m.stored.key if m.stored else m.relpath + DATA_SUFFIX}": m for m in manifest.files}
        for key, m in listed.items():
            if key not in keys:
                bad("violation", f"{mkey}: lists {key}, which is missing: a manifest without all its data")
            elif m.stored is not None and keys[key] != m.stored.size:
                bad("violation", f"{key}: {keys[key]} bytes, the manifest says {m.stored.size}")
        stray = sorted(k for k in keys if k not in listed and k != mkey and k not in marked_keys)
        if stray:
            bad("violation", f"{d}: objects beside a committed copy nothing accounts for: {stray[:3]}")
        if d not in recorded_copies:
            bad("violation", f"{d}: a committed archive copy the catalog does not record")
    for key in uploads:
        if key not in marked_keys:
            bad("violation", f"multipart upload of {key} in flight that no upload marker names")
    for d, (r, _copy) in recorded_copies.items():
        if d not in dirs:
            bad("violation", f"step {r.step}: the catalog records an archive copy at {d}, storage has nothing")


def fetches(world: World, bad: Callable[[str, str], None], plan: list[dict[str, Any]]) -> None:
    """Every checkpoint the plan keeps (and the oracle keeps) restores bit-exactly; corrupt ones refuse."""
    expected_keep, expected_hot_gone = world.expected()
    kept = {int(r["step"]) for r in plan if r["action"] in ("keep", "promote")
            or (r["action"] == "delete" and r.get("scope") == "hot-copy")}
    if not world.corrupted:
        kept |= expected_keep | expected_hot_gone
    for row in plan:
        if row["action"] in ("promote",) or (row["action"] == "delete" and row.get("scope") != "hot-copy"):
            if not world.corrupted:
                bad("violation", f"step {row['step']}: the plan still says {row['action']} after the re-runs")
    dest_root = Path(tempfile.mkdtemp(prefix="fetch-", dir=world.root))
    for step in sorted(kept):
        dest = dest_root / str(step)
        run = cli(*world.args("fetch", "--job", world.job, "--step", str(step), str(dest)))
        if traceback_in(run):
            bad("crash", f"fetch step {step}: {run.line()}\n{run.err[-3000:]}")
            continue
        if step in world.corrupted:
            if run.rc == 0 and any(fetched_bytes(dest, rel) != data for rel, data in world.files[step].items()):
                bad("violation", f"fetch step {step} (corrupted) returned bytes that are not the originals")
            continue
        if run.rc != 0:
            bad("violation", f"fetch step {step}, which the plan keeps: {run.line()}")
            continue
        for rel, data in world.files[step].items():
            got = fetched_bytes(dest, rel)
            if got != data:
                bad("violation", f"fetch step {step}: {rel} is not bit-exact ({None if got is None else len(got)} "
                                 f"bytes, wrote {len(data)})")
    shutil.rmtree(dest_root, ignore_errors=True)


def fetched_bytes(dest: Path, rel: str) -> bytes | None:
    try:
        return (dest / rel).read_bytes()
    except OSError:
        return None


# ------------------------------------------------------------------------------ trials


class KillTrials:
    """Kill trials of every kind, learning durations and crash-point counts as they go."""

    def __init__(self, worlds: Worlds, findings: Findings, env: dict[str, str], rnd: random.Random,
                 log: Callable[[str], None]) -> None:
        self.worlds, self.findings, self.env, self.rnd, self.log = worlds, findings, env, rnd, log
        self.pool = ChildPool(env, size=2)
        self.durations: dict[str, list[float]] = {}
        self.hits = findings.hits

    def learn(self, kind: str, child: Child) -> None:
        rep = child.report()
        if rep is None:
            return
        secs, counts = rep
        self.durations.setdefault(kind, []).append(secs)
        seen = self.hits.setdefault(kind, Counter())
        for point, n in counts.items():
            seen[point] = max(seen[point], n)

    def choose(self, kind: str) -> tuple[str, int, float | None]:
        """A kill: (point, n, None) for a crash point, or ("none", 0, delay) for a random delay."""
        seen = self.hits.get(kind, Counter())
        points = [p for p in KILL_POINTS if seen[p] > 0]
        if points and self.rnd.random() < 0.6:
            point = self.rnd.choice(points)
            return point, self.rnd.randint(1, seen[point]), None
        span = statistics.median(self.durations.get(kind, [1.0])[-20:])
        return "none", 0, self.rnd.uniform(0.0, span)

    def calibrate(self, kind: str, pg: bool) -> None:
        """One uninterrupted apply of a world of ``kind``: the baseline time and the crash points' counts."""
        world = self.worlds.build(kind, self.rnd, pg=pg)
        before = len(self.findings.problems)
        try:
            if not self.worlds.prepare(world, self.rnd, self.findings, corrupt=False):
                return
            child = self.pool.take(world, "none", 0)
            if not child.wait_ready():
                child.finish()
                self.findings.add(kind, "crash", f"{world.root.name}: child did not start: {child.err[-1500:]}")
                return
            child.go()
            rc = child.finish()
            self.learn(kind, child)
            rep = child.report()
            if rep is not None:
                self.findings.baseline.setdefault(kind, []).append(rep[0])
            self.child_outcome(world, child, rc, label=f"{world.root.name} baseline")
            check(world, self.findings, f"{world.root.name} baseline", s3=self.worlds.s3, since=time.monotonic() - 2)
        finally:
            self.dispose(world, before)

    def dispose(self, world: World, problems_before: int) -> None:
        """Remove a world, unless this trial found a problem in it: then it stays for a post-mortem
        (its directory, catalog database and S3 prefix), named in a last problem line."""
        if len(self.findings.problems) == problems_before:
            world.drop()
            shutil.rmtree(world.root, ignore_errors=True)
            return
        self.findings.problems.append(f"[{world.kind}] kept for a post-mortem: {world.root} (catalog "
                                      f"{world.catalog_url}, hot {world.hot_url}, archive {world.archive_url})")

    def child_outcome(self, world: World, child: Child, rc: int, *, label: str, ok: tuple[int, ...] = (0,)) -> None:
        text = child.out + child.err
        if "Traceback (most recent call last)" in text:
            self.findings.add(world.kind, "crash", f"{label}: child apply ({child.point} {child.n}) printed a "
                                                   f"traceback\n{child.err[-3000:]}")
        elif rc == -signal.SIGKILL:
            pass
        elif rc < 0:
            self.findings.add(world.kind, "crash", f"{label}: child apply died of signal {-rc}\n{child.err[-1500:]}")
        elif rc not in ok:
            line = (child.err.strip() or child.out.strip()).splitlines()[-1:] or [""]
            self.findings.add(world.kind, "stuck" if rc == EXIT_BUSY else "violation",
                              f"{label}: child apply exited {rc}: {line[0][:300]}\n{child.out[-1500:]}")

    def trial(self, kind: str, *, pg: bool) -> int:
        """One world, killed one to three times in a row, then checked. Returns the kills."""
        t = self.findings.tally(kind)
        t.trials += 1
        corrupt = self.rnd.random() < 0.15
        with self.findings.timed("build"):
            world = self.worlds.build(kind, self.rnd, pg=pg)
        label = f"{world.root.name} (seed-derived; {'pg' if pg else 'sqlite'}{', corrupted' if corrupt else ''})"
        kills = 0
        before = len(self.findings.problems)
        try:
            rounds = self.rnd.choices([1, 2, 3], weights=[2, 4, 4])[0]
            with self.findings.timed("scan+verify"):
                if not self.worlds.prepare(world, self.rnd, self.findings, corrupt=corrupt):
                    return 0
            for i in range(rounds):
                point, n, delay = self.choose(kind)
                child = self.pool.take(world, point, n)
                with self.findings.timed("waiting for a child"):
                    ready = child.wait_ready()
                if not ready:
                    child.finish()
                    self.findings.add(kind, "crash", f"{label}: child did not start: {child.err[-1500:]}")
                    return kills
                with self.findings.timed("killed applies"):
                    child.go()
                    if delay is not None:
                        child.kill_after(delay)
                    rc = child.finish()
                ended = time.monotonic()
                died = rc == -signal.SIGKILL
                what = f"{point}#{n}" if delay is None else f"delay {delay:.2f}s"
                if count_kill(t, died, point, delay):
                    kills += 1
                else:
                    self.learn(kind, child)
                self.child_outcome(world, child, rc, label=f"{label} round {i + 1} ({what})",
                                   ok=(0, 1) if world.corrupted else (0,))
            with self.findings.timed("checks"):
                check(world, self.findings, label, s3=self.worlds.s3, since=ended)
        finally:
            with self.findings.timed("clean-up"):
                self.dispose(world, before)
        return kills

    def concurrent(self, catalog: str) -> None:
        """Two applies at once on one world; each killed at a random delay or left to finish."""
        kind = f"concurrent-{catalog}"
        t = self.findings.tally(kind)
        t.trials += 1
        base = self.rnd.choice(KINDS)
        world = self.worlds.build(base, self.rnd, pg=catalog == "pg")
        world.kind = kind
        label = f"{world.root.name} (two applies, {catalog})"
        before = len(self.findings.problems)
        try:
            if not self.worlds.prepare(world, self.rnd, self.findings, corrupt=False):
                return
            children = [self.pool.take(world, "none", 0) for _ in range(2)]
            if not all(c.wait_ready() for c in children):
                for c in children:
                    c.proc.kill()
                    c.finish()
                self.findings.add(kind, "crash", f"{label}: a child did not start")
                return
            span = max(self.durations.get(base, [1.0])[-20:])
            delays = [self.rnd.uniform(0, 1.3 * span) if self.rnd.random() < 0.35 else None for _ in children]
            for c in children:
                c.go()
            pending = sorted((d, i) for i, d in enumerate(delays) if d is not None)
            for d, i in pending:
                children[i].kill_after(d)
            for c in children:
                rc = c.finish()
                if rc == -signal.SIGKILL:
                    t.kills += 1
                    t.delay_kills += 1
                else:
                    t.finished += 1
                self.child_outcome(world, c, rc, label=label, ok=(0, EXIT_BUSY))
            ended = time.monotonic()
            check(world, self.findings, label, s3=self.worlds.s3, since=ended)
        finally:
            self.dispose(world, before)


def tree_snapshot(root: Path) -> dict[str, bytes | str]:
    """Every entry below ``root``, not following links: a file's bytes, a link's text, a directory."""
    out: dict[str, bytes | str] = {}
    if not root.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = p.read_bytes()
    return out


class SwapTrials:
    """Symlink swaps in the hot tree at random points between scan and delete (module docstring)."""

    def __init__(self, kills: KillTrials) -> None:
        self.k = kills
        self.rnd = kills.rnd

    def trial(self) -> None:
        k, rnd, findings = self.k, self.rnd, self.k.findings
        kind = "swap"
        t = findings.tally(kind)
        t.trials += 1
        world = k.worlds.build("local", rnd)
        world.kind = kind
        how, at = rnd.choice(SWAPS), rnd.choice(SWAP_AT)
        before = len(findings.problems)
        try:
            if not k.worlds.prepare(world, rnd, findings, corrupt=False):
                return
            kept, hot_gone = world.expected()
            rolling = [s for s in world.steps if s not in kept and s not in hot_gone] or world.steps[:-1]
            victim, newest = rnd.choice(rolling), world.steps[-1]
            label = f"{world.root.name} ({how} of step {victim} at {at})"
            job = Path(world.hot_url) / world.job
            outside, aside = world.root / "outside", world.root / "aside"
            aside.mkdir()
            shutil.copytree(job / f"step-{victim:08d}", outside / "step")  # looks like the victim, is not ours
            (outside / "step" / "rank-0000" / "keep-me").mkdir()
            shutil.copytree(job, outside / "job")
            (outside / "secret").write_bytes(b"root only: never read, archived or fetched\n")
            (outside / "secret").chmod(0o600)
            vdir = job / f"step-{victim:08d}"
            moves = {
                "step-to-newest": [[str(vdir), str(aside / "step"), f"step-{newest:08d}"]],
                "step-to-outside": [[str(vdir), str(aside / "step"), str(outside / "step")]],
                "rank-to-outside": [[str(vdir / "rank-0000"), str(aside / "rank"), str(outside / "step" / "rank-0000")]],
                "job-to-outside": [[str(job), str(aside / "job"), str(outside / "job")]],
                "file-to-outside": [[str(vdir / "rank-0000" / "model.pt"), str(aside / "model.pt"),
                                     str(outside / "secret")]],
                "file-to-keeper": [[str(vdir / "rank-0000" / "model.pt"), str(aside / "model.pt"),
                                    str(job / f"step-{newest:08d}" / "rank-0000" / "model.pt")]],
            }[how]
            untouched = tree_snapshot(outside)
            child = k.pool.take(world, "none", 0)
            if at == "before":
                chaos_child.swap(moves)
            else:
                seen = k.hits.get("local", Counter())
                child.orders["swap"] = {"point": at, "n": rnd.randint(1, max(1, seen.get(at, 1))), "moves": moves}
            if not child.wait_ready():
                child.finish()
                findings.add(kind, "crash", f"{label}: child did not start: {child.err[-1500:]}")
                return
            child.go()
            rc = child.finish()
            t.finished += 1
            k.child_outcome(world, child, rc, label=label, ok=(0, 1))
            if tree_snapshot(outside) != untouched:
                findings.add(kind, "violation", f"{label}: something outside the root was changed through the link")
            for step in sorted(kept | {newest}):
                if step == victim:
                    continue
                for rel, data in world.files[step].items():
                    p = job / f"step-{step:08d}" / rel
                    if (aside / "job" / f"step-{step:08d}" / rel).exists() and how == "job-to-outside":
                        p = aside / "job" / f"step-{step:08d}" / rel
                    if not p.is_file() or p.read_bytes() != data:
                        findings.add(kind, "violation", f"{label}: kept step {step}'s {rel} was lost or changed")
            for path, put_aside, _ in reversed(moves):  # undo: the tree as it was, less what apply deleted
                if os.path.islink(path):
                    os.unlink(path)
                if os.path.lexists(put_aside):
                    os.rename(put_aside, path)
            for argv in (world.args("scan", "--no-prefect", world.hot_url), world.args("verify", "--no-prefect")):
                run = cli(*argv)
                if traceback_in(run) or run.rc not in (0, 1):
                    findings.add(kind, "crash" if traceback_in(run) else "violation", f"{label}: {run.line()}")
            # What the interrupted or refused delete left is finished by the checks' re-runs.
            check(world, findings, label, s3=k.worlds.s3, since=time.monotonic())
        finally:
            k.dispose(world, before)


# ------------------------------------------------------------------------------ rebuild trials

#: Catalog columns a comparison of two rebuilds leaves out: ids (each catalog numbers its own rows) and
#: leases, which no rebuild takes. ``scans`` rows are statistics of the scans that wrote something (a
#: killed rebuild's rescan may write nothing), not catalog content.
_UNCOMPARED = {"id", "job_id", "checkpoint_id", "lease_owner", "lease_expires", "lease_host", "lease_pid",
               "lease_started", "generation"}
_ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:\+00:00|Z)?")


def catalog_fingerprint(url: str, since: datetime) -> dict[str, list[tuple[Any, ...]]]:
    """Everything a catalog holds, ids replaced by natural keys (job, step), every time at or after
    ``since`` (what a rebuild wrote itself: proof times, first sightings) replaced by ``T``, in text too;
    the rebuild's own bookkeeping events (``rebuild.*``) left out. Two rebuilds of the same storage
    from ``since`` on give the same fingerprint."""
    from sqlalchemy import select

    from ckptier.storage.catalog import tables as t
    from ckptier.storage.catalog.api import Catalog

    def norm(v: Any) -> Any:
        if isinstance(v, datetime):
            return "T" if v >= since else v.isoformat()
        if isinstance(v, str):
            return _ISO.sub(lambda m: "T" if _parsed(m.group(0)) >= since else m.group(0), v)
        if isinstance(v, dict):
            return json.dumps({k: norm(x) for k, x in v.items()}, sort_keys=True, default=str)
        if isinstance(v, list):
            return json.dumps([norm(x) for x in v], default=str)
        return v

    out: dict[str, list[tuple[Any, ...]]] = {}
    with Catalog.open(url, create=False) as cat, cat._engine.connect() as conn:  # noqa: SLF001 - a bench's look
        jobs = {r.id: r.name for r in conn.execute(select(t.jobs.c.id, t.jobs.c.name))}
        steps = {r.id: (jobs[r.job_id], int(r.step)) for r in conn.execute(
            select(t.checkpoints.c.id, t.checkpoints.c.job_id, t.checkpoints.c.step))}
        for table in (t.jobs, t.checkpoints, t.files, t.copies, t.drills, t.events):
            rows = []
            for r in conn.execute(select(table)).mappings():
                if table is t.events and str(r["kind"]).startswith("rebuild."):
                    continue
                key = (steps.get(r["checkpoint_id"]) if "checkpoint_id" in r else None,
                       jobs.get(r["job_id"]) if "job_id" in r else None)
                rows.append((key, *(norm(v) for c, v in sorted(r.items()) if c not in _UNCOMPARED)))
            out[table.name] = sorted(rows, key=repr)
    return out


def _parsed(text: str) -> datetime:
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return datetime.min.replace(tzinfo=UTC)
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def first_difference(a: dict[str, list[tuple[Any, ...]]], b: dict[str, list[tuple[Any, ...]]]) -> str | None:
    """Where two fingerprints first differ, in one line, or None."""
    for table in sorted(set(a) | set(b)):
        ra, rb = a.get(table, []), b.get(table, [])
        if ra != rb:
            only_a = [r for r in ra if r not in rb][:1]
            only_b = [r for r in rb if r not in ra][:1]
            return f"{table}: {len(ra)} vs {len(rb)} rows; only uninterrupted: {only_a}; only killed: {only_b}"
    return None


def rebuild_trial(worlds: Worlds, findings: Findings, rnd: random.Random, pool: ChildPool, *, pg: bool,
                  hits: Counter[str], durations: list[float]) -> int:
    """A rebuild killed at random points and re-run ends identical to an uninterrupted one.

    One world is tiered by an uninterrupted ``apply`` (so its archive holds milestones and a catalog
    backup), then its storage is left as a lost catalog would leave it: with its backup, without any
    (``ckptier rebuild`` works from the manifests and the hot tree alone), or with the newest backup
    corrupt (the one before is restored). It is rebuilt twice into new catalogs: once uninterrupted,
    once by ``ckptier rebuild`` children SIGKILLed one to three times (at a crash point one
    uninterrupted rebuild reaches, or after a random delay) and then run to the end. The two must be
    identical (:func:`catalog_fingerprint`); the killed-and-resumed one must then agree with storage
    and fetch every kept checkpoint bit-exactly, as after any trial. Returns the kills."""
    base = rnd.choice(["local", "s3-archive"])
    kind = f"rebuild-{base}"
    t = findings.tally(kind)
    t.trials += 1
    world = worlds.build(base, rnd, pg=pg)
    world.kind = kind
    variant = rnd.choice(["backup", "backup", "no-backup", "corrupt-backup"])
    label = f"{world.root.name} ({variant}, {'pg' if pg else 'sqlite'})"
    before = len(findings.problems)
    kills = 0
    extra: list[Callable[[], None]] = []

    def command(world_: World, *argv: str) -> Run | None:
        run = cli(*world_.args(*argv))
        if traceback_in(run) or run.rc not in (0,):
            findings.add(kind, "crash" if traceback_in(run) else "violation",
                         f"{label}: {run.line()}\n{(run.err or run.out)[-2000:]}")
            return None
        return run

    try:
        if not worlds.prepare(world, rnd, findings, corrupt=False) or command(world, "apply", "--no-prefect") is None:
            return 0
        archive = open_bench_store(world.archive_url, worlds.s3)
        from ckptier.storage.archive_copies import BACKUP_PREFIX

        if variant == "corrupt-backup":
            from ckptier.storage.catalog.api import Catalog

            with Catalog.open(world.catalog_url) as cat:
                cat.log_event("note", "a change after the last apply's backup", now=datetime.now(UTC), job=world.job)
            if command(world, "catalog", "backup") is None:
                return 0
        backups = sorted(k for k in _keys(archive, BACKUP_PREFIX))
        if variant == "no-backup":
            archive.delete_many(backups)
        elif variant == "corrupt-backup" and backups:
            with archive.open_read(backups[-1]) as fh:
                data = bytearray(fh.read())
            data[rnd.randrange(len(data) // 2, len(data))] ^= 0xFF
            archive.write(backups[-1], bytes(data))

        def fresh(name: str) -> World:
            url, drop = (worlds.catalog(rnd, name, world.root, pg=True) if pg else
                         (f"sqlite:///{world.root / (name + '.db')}", lambda: None))
            extra.append(drop)
            return dataclasses.replace(world, catalog_url=url)

        since = datetime.now(UTC)
        reference, killed = fresh("uninterrupted"), fresh("killed")
        if command(reference, "rebuild") is None:
            return 0
        if not durations:  # the first trial learns how long a rebuild runs and which points it reaches
            calibration = fresh("calibration")
            child = pool.take(calibration, "none", 0)
            child.orders["argv"] = calibration.args("rebuild")
            if child.wait_ready():
                child.go()
                child.finish()
                rep = child.report()
                if rep is not None:
                    durations.append(rep[0])
                    for p, c in rep[1].items():
                        hits[p] = max(hits[p], c)
        rounds = rnd.choices([1, 2, 3], weights=[3, 4, 3])[0]
        for i in range(rounds):
            points = [p for p in ("restored", "scanned", "rebuilt") if hits[p] > 0]
            if points and rnd.random() < 0.6:
                point = rnd.choice(points)
                n, delay = rnd.randint(1, hits[point]), None
            else:
                point, n = "none", 0
                delay = rnd.uniform(0.0, statistics.median(durations[-20:] or [1.0]))
            child = pool.take(killed, point, n)
            child.orders["argv"] = killed.args("rebuild")
            if not child.wait_ready():
                child.finish()
                findings.add(kind, "crash", f"{label}: child did not start: {child.err[-1500:]}")
                return kills
            child.go()
            if delay is not None:
                child.kill_after(delay)
            rc = child.finish()
            what = f"{point}#{n}" if delay is None else f"delay {delay:.2f}s"
            if count_kill(t, rc == -signal.SIGKILL, point, delay):
                kills += 1
            else:
                rep = child.report()
                if rep is not None:
                    durations.append(rep[0])
                    for p, c in rep[1].items():
                        hits[p] = max(hits[p], c)
                if rc != 0 or "Traceback (most recent call last)" in child.out + child.err:
                    findings.add(kind, "violation" if rc > 0 else "crash",
                                 f"{label} round {i + 1} ({what}): child rebuild exited {rc}\n{child.err[-1500:]}")
        if command(killed, "rebuild") is None:
            return kills
        diff = first_difference(catalog_fingerprint(reference.catalog_url, since),
                                catalog_fingerprint(killed.catalog_url, since))
        if diff is not None:
            findings.add(kind, "violation", f"{label}: a killed and resumed rebuild differs from an uninterrupted "
                                            f"one: {diff[:1500]}")
        if variant == "no-backup" and command(killed, "verify", "--no-prefect") is None:
            return kills

        def bad(what: str, line: str) -> None:
            findings.add(kind, what, f"{label}: {line}")

        agreement(killed, bad, worlds.s3)
        plan = command(killed, "plan", "--json")
        if plan is not None:
            fetches(killed, bad, json.loads(plan.out) if plan.out.strip() else [])
    finally:
        for drop in extra:
            with contextlib.suppress(Exception):
                drop()
        if len(findings.problems) == before:
            world.drop()
            shutil.rmtree(world.root, ignore_errors=True)
        else:
            findings.problems.append(f"[{kind}] kept for a post-mortem: {world.root}")
    return kills


def rebuild_trials(worlds: Worlds, findings: Findings, rnd: random.Random, env: dict[str, str], trials: int, *,
                   pg: bool, log: Callable[[str], None]) -> None:
    """``trials`` of :func:`rebuild_trial` (a quarter on PostgreSQL when ``pg``), learning from the
    uninterrupted child rebuilds which crash points a rebuild reaches and how long it takes."""
    pool = ChildPool(env, size=1)
    hits: Counter[str] = Counter()
    durations: list[float] = []
    try:
        for i in range(trials):
            rebuild_trial(worlds, findings, rnd, pool, pg=pg and rnd.random() < 0.25, hits=hits, durations=durations)
            if (i + 1) % 5 == 0:
                v, c, s = findings.totals
                log(f"chaos: {i + 1} rebuild trials; violations {v}, crashes {c}, stuck {s}")
    finally:
        pool.close()
    log("chaos: crash points one uninterrupted rebuild reaches (most seen): "
        + ", ".join(f"{p} {n}" for p, n in sorted(hits.items())))


# ------------------------------------------------------------------------------ the run


@dataclass
class Options:
    trials: int = 210
    concurrent: int = 12
    swaps: int = 60
    fuzz: int = 10_000
    seed: int = 0
    workdir: Path | None = None
    pg: bool = True
    keep: bool = False
    quiet: bool = False
    skip_open: bool = False
    rebuild: int = 0  # the command line's default is 12


def run(opts: Options, services: Services) -> Findings:
    """Run every trial and the fuzz against ``services``; return the findings (nothing printed
    but progress unless ``opts.quiet``)."""
    findings = Findings()
    rnd = random.Random(opts.seed)
    work = Path(tempfile.mkdtemp(prefix="ckptier-chaos-", dir=opts.workdir))
    env_s3 = s3_environment(services.moto, work)
    saved = {k: os.environ.get(k) for k in (*env_s3, "PREFECT_API_URL", "PREFECT_HOME", "CKPTIER_CONFIG",
                                            "CKPTIER_CATALOG_URL")}
    os.environ.update(env_s3)
    os.environ.pop("PREFECT_API_URL", None)
    os.environ.pop("CKPTIER_CONFIG", None)
    os.environ.pop("CKPTIER_CATALOG_URL", None)
    os.environ["PREFECT_HOME"] = str(work / "prefect-home")
    env = {**os.environ, "CHAOS_SMALL_PARTS": "1", "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}
    undo = [chaos_child.small_parts(),  # the re-runs in this process use the children's thresholds too
            share_botocore_data()]
    log = (lambda s: None) if opts.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    worlds = Worlds(work / "worlds", services)
    trials = KillTrials(worlds, findings, env, rnd, log)
    t0 = time.monotonic()
    try:
        pg_ok = opts.pg and services.pg is not None
        for kind in KINDS if opts.trials or opts.concurrent or opts.swaps else ():
            trials.calibrate(kind, pg=False)
        kills = 0
        attempts = 0
        while kills < opts.trials and attempts < 3 * opts.trials + 10:
            kind = KINDS[attempts] if attempts < len(KINDS) else rnd.choices(KINDS, weights=[4, 3, 3])[0]
            kills += trials.trial(kind, pg=pg_ok and rnd.random() < 0.25)
            attempts += 1
            if attempts % 10 == 0:
                v, c, s = findings.totals
                log(f"chaos: {kills} kills in {attempts} trials, {time.monotonic() - t0:.0f}s; "
                    f"violations {v}, crashes {c}, stuck {s}")
        for _ in range(opts.concurrent):
            trials.concurrent("sqlite")
            if pg_ok:
                trials.concurrent("pg")
        log(f"chaos: concurrent trials done, {time.monotonic() - t0:.0f}s")
        swaps = SwapTrials(trials)
        for i in range(opts.swaps):
            swaps.trial()
            if (i + 1) % 10 == 0:
                v, c, s = findings.totals
                log(f"chaos: {i + 1} swap trials, {time.monotonic() - t0:.0f}s; violations {v}, crashes {c}, stuck {s}")
        rebuild_trials(worlds, findings, rnd, env, opts.rebuild, pg=pg_ok, log=log)
        findings.fuzz["canary_debris"] = canary_debris(worlds.s3)
        if opts.fuzz:
            import chaos_fuzz

            chaos_fuzz.fuzz(opts.fuzz, seed=rnd.getrandbits(32), root=work / "fuzz", findings=findings,
                            bucket=BUCKET, s3=worlds.s3, log=log, skip_open=opts.skip_open)
    finally:
        trials.pool.close()
        for put_back in undo:
            put_back()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if not opts.keep and not findings.problems:
            shutil.rmtree(work, ignore_errors=True)
    findings.fuzz["seconds"] = int(time.monotonic() - t0)
    return findings


def render(findings: Findings, opts: Options, seconds: float) -> str:
    """The figures, as printed at the end of a run."""
    lines = [f"ckptier chaos, seed {opts.seed}: {seconds:.0f} s on {os.cpu_count()} CPUs "
             f"(load {os.getloadavg()[0]:.1f})", ""]
    head = f"{'trials of':<18} {'trials':>6} {'SIGKILLs':>8} {'at hook':>7} {'delay':>6} {'survived':>8} " \
           f"{'violations':>10} {'crashes':>7} {'stuck':>5}"
    lines += [head, "-" * len(head)]
    order = [*KINDS, "concurrent-sqlite", "concurrent-pg"]
    for kind in order + sorted(set(findings.tallies) - set(order) - {"fuzz"}):
        t = findings.tallies.get(kind)
        if t is None:
            continue
        lines.append(f"{kind:<18} {t.trials:>6} {t.kills:>8} {t.hook_kills:>7} {t.delay_kills:>6} {t.finished:>8} "
                     f"{t.violations:>10} {t.crashes:>7} {t.stuck:>5}")
    kill_kinds = [findings.tallies[k] for k in KINDS if k in findings.tallies]
    lines.append(f"{'all kill trials':<18} {sum(t.trials for t in kill_kinds):>6} {sum(t.kills for t in kill_kinds):>8}")
    points: Counter[str] = Counter()
    for t in findings.tallies.values():
        points.update(t.points)
    if points:
        lines.append("kills by point: " + ", ".join(f"{p} {n}" for p, n in sorted(points.items())))
    for kind, seen in sorted(findings.hits.items()):
        lines.append(f"  points one uninterrupted {kind} apply reaches (most seen): "
                     + ", ".join(f"{p} {n}" for p, n in sorted(seen.items())))
    f = findings.tallies.get("fuzz")
    if f is not None:
        fz = findings.fuzz
        lines += ["", f"fuzz: {fz.get('cases', 0)} cases ({fz.get('trees', 0)} trees, {fz.get('manifests', 0)} manifests, "
                      f"{fz.get('keys', 0)} S3 key sets; {fz.get('checkpoints', 0)} checkpoints, "
                      f"{fz.get('fetches', 0)} fetches) in {fz.get('batches', 0)} batches: "
                      f"violations {f.violations}, crashes {f.crashes}, hangs {fz.get('hangs', 0)}"]
    if findings.baseline:
        lines += ["", "recovery (baseline: an uninterrupted apply of the same kind of world, in this run)"]
        for kind in KINDS:
            base = findings.baseline.get(kind)
            rec = findings.recovery.get(kind)
            if base and rec:
                b, r = statistics.median(base), statistics.median(rec)
                lines.append(f"  {kind:<12} re-run after the kills {r:.2f} s median vs uninterrupted apply "
                             f"{b:.2f} s: {r / b:.2f}x")
    v, c, s = findings.totals
    lines += ["", f"TOTAL violations {v}, crashes {c}, stuck after a re-run {s}  (targets 0 / 0 / 0)"]
    if findings.fuzz.get("cases"):
        import chaos_fuzz

        lines.append("fuzz inputs of defects known but not fixed yet: " + (
            "skipped (--skip-open)" if opts.skip_open else "generated: " + ", ".join(chaos_fuzz.OPEN_DEFECTS)))
    if findings.seconds:
        lines.append("kill trials' time by phase: " + ", ".join(
            f"{k} {v:.0f} s" for k, v in sorted(findings.seconds.items(), key=lambda kv: -kv[1])))
    debris = findings.fuzz.get("canary_debris", 0)
    lines.append(f"(S3 canary objects left at the bucket root by killed runs, which nothing removes: {debris})")
    dead = findings.fuzz.get("dead_leases", 0)
    if dead:
        lines.append(f"(leases of killed runs left on rows no later work needed, taken over at once by any "
                     f"claimant: {dead})")
    if findings.kinds:
        lines += ["", f"problems, by kind ({len(findings.problems)} lines; first example of each):"]
        for sig, (count, example) in sorted(findings.kinds.items(), key=lambda kv: -kv[1][0]):
            lines.append(f"  {count:>5} x {sig}")
            lines.append(f"          e.g. {example.splitlines()[0][:400]}")
    kept = [p for p in findings.problems if "kept for a post-mortem" in p]
    if kept:
        lines += ["", "kept for a post-mortem:"] + [f"  {p}" for p in kept[:20]]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=210, help="SIGKILLed applies at least (default 210)")
    ap.add_argument("--concurrent", type=int, default=12, help="trials of two concurrent applies per catalog")
    ap.add_argument("--swaps", type=int, default=60, help="trials of symlink swaps under an apply (default 60)")
    ap.add_argument("--fuzz", type=int, default=10_000, help="generated cases (trees, manifests, S3 key sets)")
    ap.add_argument("--seed", type=int, default=None, help="replay a run (default: a new random seed)")
    ap.add_argument("--workdir", type=Path, default=None, help="where worlds are built (default: $TMPDIR)")
    ap.add_argument("--no-pg", action="store_true", help="without PostgreSQL (no concurrent-pg trials)")
    ap.add_argument("--rebuild", type=int, default=12, help="trials of a rebuild killed and re-run (default 12)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--skip-open", action="store_true",
                    help="do not generate the inputs of defects known and reported but not fixed yet "
                         "(bench/chaos_fuzz.py OPEN_DEFECTS)")
    a = ap.parse_args()
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(2**32)
    opts = Options(trials=a.trials, concurrent=a.concurrent, swaps=a.swaps, fuzz=a.fuzz, seed=seed,
                   workdir=a.workdir, pg=not a.no_pg, keep=a.keep, skip_open=a.skip_open, rebuild=a.rebuild)
    print(f"ckptier chaos: seed {seed} (replay: python bench/chaos.py --trials {a.trials} --concurrent "
          f"{a.concurrent} --swaps {a.swaps} --fuzz {a.fuzz} --rebuild {a.rebuild} --seed {seed}"
          f"{' --skip-open' if a.skip_open else ''})",
          flush=True)
    t0 = time.monotonic()
    services = start_services(opts.pg)
    try:
        findings = run(opts, services)
    finally:
        services.stop()
    print(render(findings, opts, time.monotonic() - t0))
    v, c, s = findings.totals
    return 0 if (v, c, s) == (0, 0, 0) else 1


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    def stop(*_: object) -> None:
        raise Stopped()  # the servers and children are stopped on the way out

    signal.signal(signal.SIGTERM, stop)
    try:
        sys.exit(main())
    except Stopped:
        sys.exit(143)
    except KeyboardInterrupt:
        sys.exit(130)
