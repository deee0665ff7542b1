"""Prove checkpoints intact: decide what to verify, read and hash, judge.

Pure decisions: :func:`needs_verification` (why a checkpoint must be read
again, or ``None``) and :func:`select_sample` / :func:`parse_sample` (the K-th
of N disjoint slices of the catalog, for a nightly schedule that re-reads
every byte every N nights, like restic's ``check --read-data-subset``). What
the results mean for the checkpoint's state is decided in one place,
:func:`ckptier.storage.transitions.on_verification` (the catalog applies it
when :meth:`~ckptier.storage.catalog.api.Catalog.record_verification` stores
the results).

I/O: :func:`verify_checkpoint` checks one checkpoint's files against a store,
:func:`verify_many` checks many with a bounded thread pool and a fixed pool of
reusable read buffers (memory stays at ``workers`` × buffer size whatever
the checkpoint sizes).

What is compared, per file (see :func:`verify_checkpoint`): existence, size,
CRC64NVME against the baseline recorded by the first verification, and
SHA-256 against the hash the checkpoint's own metadata expects. A store that
keeps a full-object CRC64NVME (S3) is compared without downloading unless
``deep`` is asked for.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import date

from ckptier.storage.base import ObjectInfo, Store
from ckptier.storage.base import file_key, is_single_file
from ckptier.storage.errors import CkptierError, ConfigError, IntegrityError, NotFollowed, NotFound, StoreError
from ckptier.storage.hashing import DEFAULT_CHUNK, Digests, hash_stream, store_crc64nvme
from ckptier.storage.records import CheckpointRecord, FileCheck, FileRecord, FileStatus, Format, State
from ckptier.formats import checker_for
from ckptier.storage.structure import Need, shortfalls
from ckptier.storage.transitions import MTIME_TOLERANCE as MTIME_TOLERANCE  # mtimes this close are equal
from ckptier.storage.transitions import file_change

from .fanout import Fanout, batches, worker_stores

#: Reads a file gets when the store's checksum rejects the bytes it returned.
_INTEGRITY_ATTEMPTS = 2

#: Most file problems spelled out in one reason; the rest are counted.
_REASON_EXAMPLES = 3

#: Threads each verify work item of a fan-out reads files with.
BATCH_THREADS = 2


@dataclass
class VerifyOutcome:
    """Everything one checkpoint's verification found.

    ``results`` has one entry per recorded file, in the record's order,
    then a ``missing`` entry (with its ``shortfall``) for each file a
    manifest of the checkpoint requires that is neither recorded nor found.
    ``bytes_read`` counts bytes downloaded and hashed; ``bytes_skipped``
    counts bytes proven by the store's own full-object checksum without
    reading. ``extra`` lists relpaths found under the checkpoint's prefix
    that the record does not know (not corruption of the recorded files, but
    worth a look), sorted. ``notes`` holds problems that concern no single
    file (e.g. the listing for extra files failed).
    """

    results: list[FileCheck]
    bytes_read: int = 0
    bytes_skipped: int = 0
    extra: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every recorded file is ``ok``."""
        return all(r.status == "ok" for r in self.results)

    def count(self, status: FileStatus) -> int:
        return sum(1 for r in self.results if r.status == status)


class BufferPool:
    """A fixed number of reusable read buffers, shared by threads.

    Buffers are allocated on first use, at most ``count`` of ``size`` bytes
    each, so memory is bounded by ``count × size``; :meth:`buffer` blocks
    while all are in use.
    """

    def __init__(self, count: int, size: int = DEFAULT_CHUNK) -> None:
        if count < 1:
            raise ValueError(f"buffer pool count {count!r} must be at least 1")
        if size < 4096:
            raise ValueError(f"buffer size {size!r} bytes is too small; use at least 4096 (1 MiB is best)")
        self.count = count
        self.size = size
        self._free: list[bytearray] = []
        self._allocated = 0
        self._cond = threading.Condition()

    @contextmanager
    def buffer(self) -> Iterator[bytearray]:
        """Lend one buffer for the duration of the ``with`` block."""
        with self._cond:
            while not self._free and self._allocated >= self.count:
                self._cond.wait()
            if self._free:
                buf = self._free.pop()
            else:
                buf = bytearray(self.size)
                self._allocated += 1
        try:
            yield buf
        finally:
            with self._cond:
                self._free.append(buf)
                self._cond.notify()


# -- pure decisions -----------------------------------------------------------


def needs_verification(
    record: CheckpointRecord,
    listing_info: Mapping[str, ObjectInfo] | None = None,
    *,
    deep: bool = False,
) -> str | None:
    """Why ``record`` must be verified now, or ``None`` when its last result still stands;
    what :func:`ckptier.tasks.pipeline.run_verify` reads (``deep`` for a deep read or a
    sample, which read every candidate again).

    ``listing_info`` maps relpath to what a fresh listing of the checkpoint
    reports; with it, a file whose size, ETag or mtime differs from the
    catalog's (replaced since verification) or that vanished is a reason.
    Without it, a scan has already put a checkpoint whose files changed back
    to ``committed``. Checkpoints that are ``incomplete`` (a save in flight)
    or ``deleted`` are never verified; a ``corrupt`` one is read again only
    when asked (``deep``) or when a listing shows a file changed or back (what
    it lacks does not come back by reading it again). A ``committed`` one is
    read: nothing has proven the bytes a scan last saw. Files in the listing
    that the record does not know are no reason: verifying again would not
    change the record.
    """
    if record.state in (State.INCOMPLETE, State.DELETED):
        return None
    if not record.files:
        return None
    if deep:
        return "deep verification requested"
    if record.state == State.CORRUPT and listing_info is None:
        return None
    never = [f.relpath for f in record.files if f.status is None]
    if record.verified_at is None or never:
        if never and len(never) < len(record.files):
            return f"never verified: {_examples(never)}"
        return "never verified"
    unread = [f.relpath for f in record.files if f.status == "error"]
    if unread:
        return f"could not be read last time: {_examples(unread)}"
    no_baseline = [f.relpath for f in record.files if f.status == "ok" and f.crc64nvme is None]
    if no_baseline:
        return f"no recorded crc64nvme baseline: {_examples(no_baseline)}"
    if record.state == State.COMMITTED:
        return "committed since its last verification (a scan saw its files again)"
    if listing_info is None:
        return None
    for f in record.files:
        why = file_change(f, listing_info.get(f.relpath))
        if why is not None:
            return f"changed since verification: {why}"
    return None


def sample_slice(job: str, step: int, n: int) -> int:
    """The 1-based slice (of ``n``) that checkpoint ``job``/``step`` belongs to.

    A hash of job and step, not a position, so a checkpoint stays in its
    slice as the catalog grows and across runs and machines.
    """
    if n < 1:
        raise ValueError(f"sample slice count {n!r} must be at least 1")
    digest = hashlib.blake2b(f"{job}\x00{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % n + 1


def select_sample(records: Iterable[CheckpointRecord], k: int, n: int) -> list[CheckpointRecord]:
    """The records in slice ``k`` of ``n`` (1-based), in input order.

    The ``n`` slices are disjoint and together hold every record; verifying
    slice ``d % n + 1`` on night ``d`` re-reads every checkpoint every ``n``
    nights. Raises ``ValueError`` unless ``1 <= k <= n``.
    """
    _check_sample(k, n, f"{k}/{n}")
    return [r for r in records if sample_slice(r.job, r.step, n) == k]


def rotating_slice(day: date, n: int) -> int:
    """The slice K (1-based) of ``n`` that a nightly schedule verifies on ``day``.

    Consecutive days give consecutive slices, so any ``n`` consecutive
    nights cover every slice once.
    """
    if n < 1:
        raise ValueError(f"sample slice count {n!r} must be at least 1")
    return day.toordinal() % n + 1


_SAMPLE = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*")


def parse_sample(text: str) -> tuple[int, int]:
    """Parse ``--sample K/N`` (``"1/7"`` -> ``(1, 7)``); ``ConfigError`` with a one-line reason otherwise."""
    m = _SAMPLE.fullmatch(text)
    if m is None:
        raise ConfigError(f"--sample {text!r} is not K/N; write the slice and the slice count, e.g. 1/7")
    k, n = int(m.group(1)), int(m.group(2))
    _check_sample(k, n, text)
    return k, n


def _check_sample(k: int, n: int, text: str) -> None:
    if n < 1:
        raise ConfigError(f"--sample {text!r}: N must be at least 1, e.g. 1/7")
    if not 1 <= k <= n:
        raise ConfigError(f"--sample {text!r}: K must be between 1 and N ({n}), e.g. 1/{n}")


def _examples(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_REASON_EXAMPLES])
    return shown + (f" and {len(items) - _REASON_EXAMPLES} more" if len(items) > _REASON_EXAMPLES else "")


# -- I/O ------------------------------------------------------------------------


def _check(f: FileRecord, status: FileStatus, detail: str | None, d: Digests | None = None, size: int | None = None) -> FileCheck:
    return FileCheck(
        relpath=f.relpath,
        status=status,
        size=d.size if d is not None else size,
        crc64nvme=d.crc64nvme if d is not None else None,
        sha256=d.sha256 if d is not None else None,
        detail=detail,
    )


def check_file(
    store: Store,
    key: str,
    f: FileRecord,
    *,
    deep: bool,
    pool: BufferPool,
    on_bytes: Callable[[int], None] | None = None,
    fmt: Format | None = None,
) -> tuple[FileCheck, int, int, tuple[Need, ...]]:
    """Verify one file; returns ``(check, bytes_read, bytes_skipped, needs)``. Never raises a store error.

    When the file has a structure to check (:func:`ckptier.formats.checker_for`
    for a checkpoint of format ``fmt``), it is checked on its first
    verification (no CRC64NVME baseline yet), in the same read pass as the
    hashing: a broken one is ``corrupt``, naming the structure and what is
    wrong. That first verification reads it even when the store keeps a
    checksum (a checksum proves the bytes are what was uploaded, not that a
    whole file was); later ones compare with the baseline, which proves the
    same bytes. Manifests are parsed whenever they are read. ``needs`` are the files a manifest read here
    requires of the checkpoint. ``on_bytes`` is told about progress in bytes
    (read or skipped); the amounts add up to exactly ``f.size`` by the time
    this returns.
    """
    counted = 0

    def tell(n: int) -> None:
        nonlocal counted
        n = min(n, f.size - counted)
        if n > 0 and on_bytes is not None:
            counted += n
            on_bytes(n)

    try:
        return _check_file(store, key, f, deep=deep, pool=pool, tell=tell, fmt=fmt)
    finally:
        tell(f.size - counted)


def _check_file(
    store: Store, key: str, f: FileRecord, *, deep: bool, pool: BufferPool, tell: Callable[[int], None],
    fmt: Format | None,
) -> tuple[FileCheck, int, int, tuple[Need, ...]]:
    where = f"{store.url}/{key}"
    try:
        info = store.stat(key)
    except NotFollowed as exc:  # a directory on the way is a link now: proves nothing either way
        return _check(f, "error", f"cannot reach it: {_one_line(exc)}"), 0, 0, ()
    except NotFound:
        return _check(f, "missing", f"not found at {where}"), 0, 0, ()
    except (StoreError, OSError) as exc:
        return _check(f, "error", f"cannot stat: {_one_line(exc)}"), 0, 0, ()
    if info.size != f.size:
        how = "truncated" if info.size < f.size else "extended"
        return _check(f, "corrupt", f"size {info.size} bytes, expected {f.size} ({how})", size=info.size), 0, 0, ()
    if info.link != f.link:
        now = f"a symlink to {info.link}" if info.link else "a plain file"
        was = f"a symlink to {f.link}" if f.link else "a plain file"
        return _check(f, "corrupt", f"now {now}, cataloged as {was} (changed since the scan; rescan it)",
                      size=info.size), 0, 0, ()

    try:
        stored = store_crc64nvme(info.checksum)
        bad_store_checksum = None
    except ValueError as exc:
        stored, bad_store_checksum = None, str(exc)

    baseline = f.crc64nvme
    sha_proven = f.sha256_expected is None or f.status == "ok"
    structured = checker_for(f.relpath, fmt) is not None
    if (not deep and stored is not None and sha_proven and (baseline is not None or f.sha256_expected is None)
            and (baseline is not None or not structured)):
        tell(info.size)
        if baseline is None:
            return FileCheck(f.relpath, "ok", info.size, stored, None, "baseline taken from the store's checksum"), 0, info.size, ()
        if stored == baseline:
            return FileCheck(f.relpath, "ok", info.size, stored, None, None), 0, info.size, ()
        return (
            FileCheck(f.relpath, "corrupt", info.size, stored, None,
                      f"store checksum crc64nvme {stored}, recorded {baseline} (object replaced or damaged)"),
            0,
            info.size,
            (),
        )

    want_sha = f.sha256_expected is not None
    for attempt in range(_INTEGRITY_ATTEMPTS):
        # A data file's structure is checked on its first verification; later reads that match
        # the CRC64NVME baseline are the same bytes. Manifests are parsed on every read (cheap):
        # what they require must be there now.
        checker = checker_for(f.relpath, fmt, manifests_only=baseline is not None)
        observe = checker.feed if checker is not None else None
        try:
            with pool.buffer() as buf, store.open_read(key) as stream:
                # A local file is read from its open descriptor (never by a path, which a
                # symlink could redirect), its status taken before and after: bytes that
                # changed while they were read prove nothing.
                before = _fstat(stream)
                d = hash_stream(stream, sha256=want_sha, buffer=buf, progress=tell, observe=observe)
                after = _fstat(stream)
            if before is not None and after is not None and before != after:
                return _check(f, "error", f"changed while it was read ({before[0]} -> {after[0]} bytes); "
                                          "verify it again"), 0, 0, ()
            break
        except (FileNotFoundError, NotFound):
            return _check(f, "missing", f"vanished while reading {where}"), 0, 0, ()
        except IntegrityError as exc:
            # The store's own checksum rejected the bytes; once may be the
            # network, twice in a row is the object.
            if attempt + 1 == _INTEGRITY_ATTEMPTS:
                why = f"the store's checksum rejected the bytes {attempt + 1} times: {_one_line(exc)}"
                return _check(f, "corrupt", why, size=info.size), 0, 0, ()
        except (StoreError, OSError) as exc:
            return _check(f, "error", f"cannot read: {_one_line(exc)}"), 0, 0, ()
    structure = checker.finish() if checker is not None else None

    problems = []
    if d.size != f.size:
        problems.append(f"read {d.size} bytes, expected {f.size}")
    if baseline is not None and d.crc64nvme != baseline:
        problems.append(f"crc64nvme {d.crc64nvme}, recorded {baseline}")
    if f.sha256_expected is not None and d.sha256 != f.sha256_expected.lower():
        problems.append(f"sha256 {d.sha256}, expected {f.sha256_expected} (from the checkpoint's metadata)")
    if stored is not None and d.crc64nvme != stored:
        problems.append(f"crc64nvme {d.crc64nvme}, the store's checksum is {stored}")
    if structure is not None and structure.problem is not None and d.size == f.size:
        problems.append(f"{structure.kind}: {structure.problem}")
    if problems:
        return _check(f, "corrupt", "; ".join(problems), d), d.size, 0, ()
    detail = None if baseline is not None else "first verification: baseline recorded"
    if detail and structure is not None and structure.notes:
        detail += "; " + "; ".join(structure.notes)
    if bad_store_checksum:
        detail = f"store checksum ignored: {bad_store_checksum}"
    return _check(f, "ok", detail, d), d.size, 0, structure.needs if structure is not None else ()


def _fstat(stream: object) -> tuple[int, int, int] | None:
    """Size, mtime (ns) and inode of the file ``stream`` reads, when it reads a local file."""
    try:
        st = os.fstat(stream.fileno())  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def find_extra(
    store: Store, prefix: str, record: CheckpointRecord, listing: Mapping[str, ObjectInfo] | None = None
) -> tuple[list[str], list[str]]:
    """Relpaths under the checkpoint's prefix that the record does not know, sorted, and notes.

    Uses ``listing`` (relpath -> info) when given, else lists the store.
    A single-file checkpoint has no extras. A failed listing is a note, not
    an exception.
    """
    if is_single_file(prefix, record):
        return [], []
    known = {f.relpath for f in record.files}
    if listing is not None:
        return sorted(set(listing) - known), []
    base = prefix.strip("/")
    start = base + "/" if base else ""
    try:
        found = [info.key[len(start):] for info in store.list(start)]
    except (StoreError, OSError) as exc:
        return [], [f"could not list {store.url}/{start} for extra files: {_one_line(exc)}"]
    return sorted(set(found) - known), []


def verify_checkpoint(
    store: Store,
    prefix: str,
    record: CheckpointRecord,
    *,
    deep: bool,
    buffer_pool: BufferPool | None = None,
    listing: Mapping[str, ObjectInfo] | None = None,
    progress: Callable[[int], None] | None = None,
) -> VerifyOutcome:
    """Verify every recorded file of ``record`` under ``prefix`` in ``store``, one after another.

    Per file: absent -> ``missing``; size differs -> ``corrupt`` (no read).
    Without ``deep``, when the store keeps a full-object CRC64NVME and the
    record has a baseline (and any expected SHA-256 was proven before), the
    two are compared without reading (``bytes_skipped``); with no baseline
    and no expected SHA-256, the store's checksum becomes the baseline.
    Otherwise the file is streamed through one pooled buffer and its
    CRC64NVME (and SHA-256, only when expected) compared with the baseline,
    the expected hash and the store's checksum; with no expectation at all it
    is ``ok`` and its digests are the baseline to record. Unreadable files
    are ``error`` and the rest are still checked. ``listing`` (relpath ->
    info) only spares the listing used to find extra files; sizes and
    checksums always come from a fresh ``stat``. Read-only and idempotent.
    ``progress`` is called with byte counts (read or skipped).

    Each file read is also checked for its structure in the same pass (see
    :func:`check_file`); the files the checkpoint's manifests require are
    then checked against the results (:func:`with_shortfalls`).
    """
    pool = buffer_pool or BufferPool(1)
    outcome = VerifyOutcome(results=[])
    needs: list[Need] = []
    for f in record.files:
        check, read, skipped, wants = check_file(store, file_key(prefix, record, f.relpath), f, deep=deep, pool=pool,
                                                 on_bytes=progress, fmt=record.format)
        outcome.results.append(check)
        outcome.bytes_read += read
        outcome.bytes_skipped += skipped
        needs.extend(wants)
    outcome.extra, outcome.notes = find_extra(store, prefix, record, listing)
    outcome.results = with_shortfalls(outcome.results, needs, outcome.extra)
    return outcome


def with_shortfalls(results: Sequence[FileCheck], needs: Sequence[Need], extra: Sequence[str] = ()) -> list[FileCheck]:
    """``results`` with the manifests' ``needs`` applied; pure.

    A required file the results show with too few bytes becomes ``corrupt``
    and a required file (or ``rank-*`` directory) that is neither among the
    results nor among the ``extra`` files found gets a ``missing`` result
    appended, each carrying its :class:`~ckptier.storage.records.Shortfall`
    (the verdict waits for the job's grace: a save may be in flight). Files
    already ``missing`` or unreadable are left as they are.
    """
    if not needs:
        return list(results)
    present = {r.relpath: r.size for r in results if r.status in ("ok", "corrupt") and r.size is not None}
    unknown = [r.relpath for r in results if r.status == "error"]
    out = list(results)
    index = {r.relpath: i for i, r in enumerate(out)}
    for sf in shortfalls(needs, present, also_present=[*extra, *unknown]):
        i = index.get(sf.relpath)
        if i is None:
            out.append(FileCheck(sf.relpath, "missing", None, None, None, str(sf), sf))
        elif out[i].status == "ok":
            r = out[i]
            out[i] = FileCheck(r.relpath, "corrupt", r.size, r.crc64nvme, r.sha256, str(sf), sf)
    return out


class _Meter:
    """Thread-safe running total of verified bytes, reported to a callback."""

    def __init__(self, total: int, progress: Callable[[int, int], None] | None) -> None:
        self.total = total
        self.done = 0
        self._progress = progress
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        if self._progress is None:
            return
        with self._lock:
            self.done += n
            self._progress(self.done, self.total)


@dataclass
class _InFlight:
    """A record whose files are submitted to the pool (or that failed to open)."""

    record: CheckpointRecord
    files: list[Future[tuple[FileCheck, int, int, tuple[Need, ...]]]]
    extras: Future[tuple[list[str], list[str]]] | None
    failure: str | None


def verify_many(
    store_for: Callable[[CheckpointRecord], tuple[Store, str]],
    records: Iterable[CheckpointRecord],
    *,
    deep: bool,
    workers: int = 4,
    progress: Callable[[int, int], None] | None = None,
    buffer_size: int = DEFAULT_CHUNK,
) -> Iterator[tuple[CheckpointRecord, VerifyOutcome]]:
    """Verify many checkpoints, several files at a time; yields in input order.

    ``store_for(record)`` returns the store and key prefix of the record's
    hot copy; when it raises a :class:`~ckptier.storage.errors.CkptierError`
    or ``OSError`` every file of that record is ``error``. Files of all
    records share one pool of ``workers`` threads and ``workers`` read
    buffers of ``buffer_size`` bytes (memory is bounded by their product);
    only a few records are in flight ahead of the one being yielded.
    ``progress(done_bytes, total_bytes)`` is called from worker threads,
    serialized, as bytes are read or proven without reading; ``total_bytes``
    is the recorded size of all records, and ``done_bytes`` reaches it.
    Each file is checked as by :func:`verify_checkpoint` (structure, then
    the manifests' shortfalls). Leaving the
    iteration early cancels files not yet started.
    """
    if workers < 1:
        raise ValueError(f"workers {workers!r} must be at least 1")
    recs = list(records)
    meter = _Meter(sum(f.size for r in recs for f in r.files), progress)
    pool = BufferPool(workers, buffer_size)
    window_files = workers * 4
    window: deque[_InFlight] = deque()
    in_window = 0
    it = iter(recs)
    ex = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptier-verify")
    try:
        exhausted = False
        while True:
            while not exhausted and (in_window < window_files or not window):
                rec = next(it, None)
                if rec is None:
                    exhausted = True
                    break
                try:
                    store, prefix = store_for(rec)
                except (CkptierError, OSError) as exc:
                    window.append(_InFlight(rec, [], None, f"cannot open the store: {_one_line(exc)}"))
                    continue
                futs = [
                    ex.submit(check_file, store, file_key(prefix, rec, f.relpath), f, deep=deep, pool=pool,
                              on_bytes=meter.add, fmt=rec.format)
                    for f in rec.files
                ]
                extras = ex.submit(find_extra, store, prefix, rec)
                window.append(_InFlight(rec, futs, extras, None))
                in_window += len(futs)
            if not window:
                return
            head = window.popleft()
            in_window -= len(head.files)
            outcome = VerifyOutcome(results=[])
            if head.failure is not None or head.extras is None:
                outcome.results = [_check(f, "error", head.failure or "not checked") for f in head.record.files]
                meter.add(sum(f.size for f in head.record.files))
            else:
                needs: list[Need] = []
                for fut in head.files:
                    check, read, skipped, wants = fut.result()
                    outcome.results.append(check)
                    outcome.bytes_read += read
                    outcome.bytes_skipped += skipped
                    needs.extend(wants)
                outcome.extra, outcome.notes = head.extras.result()
                outcome.results = with_shortfalls(outcome.results, needs, outcome.extra)
            yield head.record, outcome
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


# ------------------------------------------------------------------ fanned out


@dataclass(frozen=True)
class VerifyWork:
    """Verify these checkpoints' hot copies (``deep``: read every byte): one work item of a fan-out."""

    records: tuple[CheckpointRecord, ...]
    deep: bool
    threads: int = BATCH_THREADS


def verify_work(work: VerifyWork) -> list[VerifyOutcome]:
    """One outcome per record of ``work``, in order; reads storage only (see
    :func:`verify_many`), through the worker's own stores."""
    stores = worker_stores()
    return [outcome for _, outcome in verify_many(stores.for_record, work.records, deep=work.deep,
                                                  workers=work.threads)]


def verify_fanned(fanout: Fanout, records: Sequence[CheckpointRecord], *, deep: bool,
                  progress: Callable[[int, int], None] | None = None
                  ) -> Iterator[tuple[CheckpointRecord, VerifyOutcome]]:
    """:func:`verify_many` on ``fanout`` (:class:`ckptier.tasks.fanout.Fanout`): yields each record
    with its outcome, in input order; ``progress(done_bytes, total_bytes)`` after each batch."""
    work = [VerifyWork(b, deep) for b in batches(records, fanout.parallelism)]
    total = sum(f.size for r in records for f in r.files)
    done = 0
    for w, outcomes in zip(work, fanout.map(verify_work, work), strict=True):
        yield from zip(w.records, outcomes, strict=True)
        done += sum(f.size for r in w.records for f in r.files)
        if progress is not None:
            progress(done, total)
