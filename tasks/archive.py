"""The archive tier: promote a checkpoint, fetch it back, clean up after crashes.

Archive layout (relative to the archive store's root)::

    {job}/step-{step:08d}/.ckptier/upload.json     the upload marker, written FIRST
    {job}/step-{step:08d}/{relpath}.ckz     one codec stream per checkpoint file
    {job}/step-{step:08d}/ckptier-manifest.json     the commit marker, written LAST

A step directory counts as an archive copy only when its ``ckptier-manifest.json``
exists: the manifest is created with a conditional create (``if_absent``)
after every data object was read back, decoded and found bit-identical to
the hot file. Before uploading anything, a promotion writes the upload
marker naming the objects it is about to write; that marker is what proves
an uncommitted object is ckptier's own. :func:`janitor` removes only those
objects (and aborts only those multipart uploads) once they are old enough,
never anything else: a file ckptier did not write is reported, not removed.
The manifest lists every file's original size and CRC64NVME, so a lost
catalog can be rebuilt from the archive alone.

Nothing here deletes or modifies a hot copy, and nothing here reads the
clock: times are passed in.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import platform
import re
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from ckptier.storage.archive_copies import BACKUP_PREFIX, copy_dir, stored_key
from ckptier.storage.base import file_key as hot_file_key
from ckptier.storage.archive_copies import DATA_SUFFIX as _DATA_SUFFIX
from ckptier.storage.archive_copies import UPLOAD_MARKER as _UPLOAD_MARKER
from ckptier.storage.base import (
    MultipartUploads,
    ObjectInfo,
    Restorable,
    StorageClasses,
    Store,
    TempFiles,
    join_key,
    key_problem,
    read_bytes,
)
from ckptier.storage.errors import (
    AlreadyExists,
    CkptierError,
    ConfigError,
    IntegrityError,
    NeedsRestore,
    NotFound,
    StoreError,
    environment_fault,
)
from ckptier.storage.hashing import Digests, Hasher, store_crc64nvme
from ckptier.storage.local import file_mode
from ckptier.storage.manifest import MANIFEST_NAME as _MANIFEST_NAME
from ckptier.storage.manifest import Manifest, ManifestFile, StoredObject
from ckptier.storage.records import HELD_COPY_STATES, CheckpointRecord, FileRecord, State, Tier
from ckptier.storage.s3 import RESTORE_CLASSES, RESTORE_HOURS

from .fanout import Fanout, batches, worker_stores
from .reports import JanitorReport


if TYPE_CHECKING:
    from ckptier.storage import codec as _codec
else:
    class _Codec:
        """:mod:`ckptier.storage.codec`, imported on first use: its numpy and zstandard cost every
        command that imports this module (``verify`` through the pipeline) ~0.1 s of start-up."""

        def __getattr__(self, name: str) -> Any:
            from ckptier.storage import codec  # lazy: only when bytes are encoded or decoded

            return getattr(codec, name)

    _codec = _Codec()

#: Name of the commit marker in an archive step directory (format recognition
#: knows it as ckptier's own file, so scanning an archive never mistakes it).
MANIFEST_NAME = _MANIFEST_NAME
#: Suffix of archived (encoded) data objects (the layout is :mod:`ckptier.storage.archive_copies`').
DATA_SUFFIX = _DATA_SUFFIX
#: Largest manifest we will read (bytes); a manifest of 100k files is ~15 MB.
MANIFEST_LIMIT = 64 << 20
#: Read size for streaming copies, bytes.
CHUNK = 8 << 20
#: Codec block size of archived objects, bytes. Smaller than the codec's default (2 MiB): a
#: promotion holds one encoder's and one decoder's buffers at once, and the encoder's pool and
#: scratch arrays scale with the block. Measured on bench/refdata.py's reference checkpoint
#: (2 threads): 512 KiB blocks halve the promotion's memory over the idle process (about 67 ->
#: 31 MiB) for a ratio 0.016% lower (1.24862 -> 1.24842), coding as fast.
BLOCK_SIZE = 512 << 10
#: The upload marker, relative to a step directory (under ``.ckptier/``, which
#: format recognition skips as ckptier's own).
UPLOAD_MARKER = _UPLOAD_MARKER
#: Largest upload marker we will read (bytes).
UPLOAD_MARKER_LIMIT = 16 << 20

_STEP_DIR_RE = re.compile(r"^(?P<dir>(?:.+/)?step-\d{8})/(?P<rest>.+)$")


#: glibc's ``mallopt`` parameter for the most malloc arenas (``M_ARENA_MAX`` in malloc.h).
_M_ARENA_MAX = -8
#: Environment variable through which glibc takes the same limit at start-up.
MALLOC_ARENA_ENV = "MALLOC_ARENA_MAX"


def limit_malloc_arenas(arenas: int = 1) -> bool:
    """Cap glibc's malloc arenas for the rest of this process (``mallopt(M_ARENA_MAX, arenas)``);
    True when the limit was set.

    For a process whose work is :func:`promote` (the ``apply`` command): a
    promotion runs seven or so threads at once (the encoder's reader, workers
    and writer, started anew for each file, the store's writes, the
    read-back), and glibc gives each thread that allocates an arena of its
    own, up to 8 per core, each keeping its own high-water of large blocks
    (zstd output, pieces handed to the store). One arena cut the peak RSS of
    bench/promote.py by about 6-10 MiB, with no wall-time cost visible
    beyond the benchmark's noise (the codec pools its big buffers, so malloc
    is not its hot path; see docs/benchmarks.md). Process-wide and permanent, so it is never
    called by :func:`promote` itself; arenas that already exist stay.

    Does nothing and returns False off glibc (musl, macOS), when ``mallopt``
    refuses, or when :data:`MALLOC_ARENA_ENV` is set (the operator's choice
    stands). Raises :class:`ValueError` for ``arenas < 1``.
    """
    if arenas < 1:
        raise ValueError(f"arenas={arenas}: malloc needs at least 1 arena; pass 1 or more")
    if os.environ.get(MALLOC_ARENA_ENV) or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_ARENA_MAX, arenas))


class ArchiveConflict(CkptierError):
    """The archive already holds a committed copy of this step with different content."""


class HotCopyMismatch(IntegrityError):
    """A hot file read for promotion is not the file the catalog verified: ``relpath``,
    and the ``size`` and ``crc64nvme`` of the bytes just read (the evidence)."""

    def __init__(self, message: str, *, key: str, relpath: str, size: int, crc64nvme: str) -> None:
        super().__init__(message, key=key)
        self.relpath, self.size, self.crc64nvme = relpath, size, crc64nvme


# ----------------------------------------------------------------------------- layout


#: The archive key prefix of one checkpoint: ``{job}/step-{step:08d}``.
archive_dir = copy_dir


def archive_root(copy_url: str, record: CheckpointRecord) -> str:
    """The archive store URL from a copy URL ending in ``{job}/step-{step:08d}[/...]``."""
    marker = "/" + archive_dir(record.job, record.step)
    head, sep, _ = copy_url.partition(marker)
    return head if sep else copy_url


def data_key(job: str, step: int, relpath: str) -> str:
    """Key of the archived (encoded) copy of one checkpoint file."""
    return join_key(archive_dir(job, step), relpath + DATA_SUFFIX)


def manifest_key(job: str, step: int) -> str:
    """Key of the commit marker of one archived checkpoint."""
    return join_key(archive_dir(job, step), MANIFEST_NAME)


def upload_marker_key(job: str, step: int) -> str:
    """Key of the upload marker of one checkpoint's archive directory."""
    return join_key(archive_dir(job, step), UPLOAD_MARKER)


@dataclass(frozen=True)
class UploadMarker:
    """What a promotion is about to write into a step directory: ``keys``
    relative to the directory, by ``owner`` at ``started_at``. Written
    before the first upload; proof for :func:`janitor` that those objects,
    if left uncommitted, are ckptier's own debris."""

    job: str
    step: int
    owner: str
    started_at: datetime
    keys: tuple[str, ...]

    def to_json(self) -> bytes:
        return json.dumps({
            "ckptier": "upload", "job": self.job, "step": self.step, "owner": self.owner,
            "started_at": self.started_at.isoformat(), "keys": list(self.keys),
        }, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> UploadMarker:
        """Parse a marker; ``ValueError`` naming ``where`` when it is not one ckptier wrote."""
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict) or doc.get("ckptier") != "upload":
                raise ValueError("not a ckptier upload marker")
            keys = doc["keys"]
            if not isinstance(keys, list) or not all(isinstance(k, str) and key_problem(k) is None for k in keys):
                raise ValueError("its keys are not a list of safe relative keys")
            return cls(job=str(doc["job"]), step=int(doc["step"]), owner=str(doc["owner"]),
                       started_at=datetime.fromisoformat(doc["started_at"]), keys=tuple(keys))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{where}: unreadable upload marker ({exc})") from exc
        except RecursionError:
            raise ValueError(f"{where}: unreadable upload marker (JSON nested too deeply)") from None


def prefix_from_location(store: Store, location: str) -> str:
    """The key prefix of ``location`` (a URL) relative to ``store``'s root URL.

    Raises :class:`~ckptier.storage.errors.StoreError` when ``location`` is
    not below the store's URL.
    """
    root = store.url.rstrip("/")
    if location.rstrip("/") == root:
        return ""
    if not location.startswith(root + "/"):
        raise StoreError(
            f"{location}: not inside store {root}; pass the store that holds this checkpoint",
            url=store.url,
        )
    return location[len(root) + 1 :].strip("/")


# ------------------------------------------------------------------------- streams


class _HashingReader:
    """A read-only stream that hashes (CRC64NVME) exactly the bytes it hands out."""

    def __init__(self, inner: BinaryIO) -> None:
        self._inner = inner
        self.hasher = Hasher()

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        data = self._inner.read(n)
        if data:
            self.hasher.update(data)
        return data

    def readinto(self, buf: Any) -> int:
        inner_readinto = getattr(self._inner, "readinto", None)
        view = memoryview(buf).cast("B")
        if inner_readinto is None:
            data = self._inner.read(len(view))
            n = len(data)
            view[:n] = data
        else:
            n = inner_readinto(view) or 0
        if n:
            self.hasher.update(view[:n])
        return n

    def close(self) -> None:
        self._inner.close()


class _HashingSink:
    """A write-only stream that hashes what is written and optionally forwards it."""

    def __init__(self, inner: BinaryIO | None = None) -> None:
        self._inner = inner
        self.hasher = Hasher()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.hasher.update(view)
        if self._inner is not None:
            self._inner.write(view)
        return view.nbytes

    def flush(self) -> None:
        if self._inner is not None:
            self._inner.flush()


# ------------------------------------------------------------------------- promote


@dataclass(frozen=True)
class ArchiveCopy:
    """What :func:`promote` made: the catalog's archive copy row.

    ``url`` is the archive step directory's URL; ``stored_bytes`` the total
    size of the encoded data objects (bytes, excluding the manifest);
    ``raw_bytes`` the original size; ``verified_at`` the ``now`` of the
    read-back. ``already_archived`` is True when a manifest with the same
    content was already committed (a lost acknowledgement or an earlier run).
    ``storage_class``: the class the data objects were confirmed in (S3), or
    ``None`` where the store has no classes.
    """

    url: str
    stored_bytes: int
    raw_bytes: int
    codec: str
    manifest_key: str
    verified_at: datetime
    already_archived: bool = False
    seconds: float = 0.0
    storage_class: str | None = None


def _check_hot_digest(record: CheckpointRecord, f: FileRecord, got: Digests, where: str) -> None:
    """Raise :class:`HotCopyMismatch` unless the hot bytes just read are the verified ones."""
    if got.size != f.size:
        raise HotCopyMismatch(
            f"{where}: hot file is {got.size} bytes but the catalog recorded {f.size} "
            f"(job {record.job} step {record.step}); rescan and verify before promoting",
            key=where, relpath=f.relpath, size=got.size, crc64nvme=got.crc64nvme,
        )
    if f.crc64nvme is not None and got.crc64nvme != f.crc64nvme:
        raise HotCopyMismatch(
            f"{where}: hot file CRC64NVME {got.crc64nvme} differs from the catalog's {f.crc64nvme} "
            f"(job {record.job} step {record.step}); run verify before promoting",
            key=where, relpath=f.relpath, size=got.size, crc64nvme=got.crc64nvme,
        )


def _content(m: Manifest) -> tuple[str, int, tuple[tuple[str, int, str], ...]]:
    """What identifies an archived checkpoint's content: job, step, files' sizes and hashes."""
    return (
        m.job,
        m.step,
        tuple(sorted((f.relpath, f.size, f.crc64nvme) for f in m.files)),
    )


def _read_manifest(store: Store, key: str) -> Manifest:
    return Manifest.from_json(read_bytes(store, key, limit=MANIFEST_LIMIT))


def _store_url(store: Store, key: str) -> str:
    return f"{store.url.rstrip('/')}/{key}"


#: Key of a manifest entry's archived object in the copy at a directory (its ``stored.key``, else the default name).
_stored_key = stored_key


def _decode_check(archive: Store, key: str, *, threads: int = 2) -> tuple[Digests, Digests]:
    """Stream ``key`` from ``archive`` through the codec; return digests of the decoded and the stored bytes.

    Transient and access errors propagate unchanged; anything else that goes
    wrong while decoding (a truncated or mangled object) is an
    :class:`IntegrityError` naming the object.
    """
    out = _HashingSink()
    with archive.open_read(key) as raw:
        counted = _HashingReader(raw)
        try:
            _codec.decode(counted, out, threads=threads)  # type: ignore[arg-type]
        except StoreError as exc:
            if isinstance(exc, IntegrityError):
                raise IntegrityError(
                    f"{_store_url(archive, key)}: read-back failed ({exc}); not committed",
                    url=archive.url,
                    key=key,
                ) from exc
            raise
        except Exception as exc:  # noqa: BLE001 - any decoder failure means bad bytes
            raise IntegrityError(
                f"{_store_url(archive, key)}: read-back failed, the object does not decode ({exc}); "
                f"not committed",
                url=archive.url,
                key=key,
            ) from exc
    return out.hasher.digests(), counted.hasher.digests()


def promote(
    hot: Store,
    hot_prefix: str,
    record: CheckpointRecord,
    archive: Store,
    *,
    now: datetime,
    owner: str,
    level: int = 1,
    threads: int = 2,
    block_size: int = BLOCK_SIZE,
) -> ArchiveCopy:
    """Copy one checkpoint into the archive tier, proven bit-exact, and commit it.

    For each file (in relpath order): stream it from ``hot`` through the
    codec straight into the archive store's ``write`` (no spool: the store
    consumes the encoder's output as it is produced, through
    :class:`~ckptier.storage.codec_stream.EncodingReader`), hashing the raw
    bytes on the way; the store sees the end of the stream only once the
    size and CRC64NVME of those bytes matched the catalog record (when
    recorded), so a file that fails (hot bytes changed, a read error, the
    encoder, another file's failure) is never committed as an object: a
    local store removes its temporary file, S3 aborts the multipart upload
    (S3 stores switch to multipart above their threshold). Each object is
    then read back from the store, decoded and compared (size and
    CRC64NVME) with the hot bytes. Files overlap (:func:`_stream_and_prove`):
    the next file is encoded while the last one's write finishes (fsync,
    multipart completion) and while earlier ones are read back, each stage
    with ``threads`` codec threads; memory stays bounded whatever the file
    sizes (one encoder's and one decoder's buffers, see
    :mod:`ckptier.storage.codec`). Only when every file matches is
    ``ckptier-manifest.json`` created with ``if_absent=True``.

    Storage classes: when ``archive`` writes to a storage class
    (:class:`~ckptier.storage.base.StorageClasses`, e.g. an S3 archive
    configured with ``storage_class``), the data objects go there and the
    read-back also confirms each object's class by HEAD; the manifest goes
    to the bucket's default class so that it stays readable. In a class that
    cannot be read without a restore (``GLACIER``, ``DEEP_ARCHIVE``) the
    read-back cannot GET: the encoded stream is also decoded locally as the
    store reads it, and the store sees its end (and commits the object) only
    once it decoded to the hot bytes; the HEAD must then show the size and the
    full-object CRC64NVME of the bytes sent (the store's own checksum, so
    ``CKPTIER_S3_CHECKSUMS=when_required`` cannot archive to those classes).

    Before the first upload, the upload marker (:data:`UPLOAD_MARKER`)
    names every object about to be written; it stays, so the janitor can
    tell ckptier's own objects from anything else.

    Idempotent: when the manifest already exists with the same job, step and
    file hashes (the acknowledgement of an earlier commit was lost, or an
    earlier run finished), the data objects are proven again (the store's
    full-object checksum against the manifest, else decoded) and the
    existing copy is returned with ``already_archived=True``; a damaged one
    raises :class:`IntegrityError` and nothing is recorded. A manifest with
    different content raises :class:`ArchiveConflict` before anything is
    uploaded (when seen up front) or instead of committing.

    Raises :class:`IntegrityError` when the hot bytes do not match the
    catalog or the read-back does not match the hot bytes (nothing is
    committed), and store errors unchanged. The hot copy is only read.
    ``owner`` names the promoting run in error messages. ``level``,
    ``threads`` and ``block_size`` are the codec's (:func:`ckptier.storage.codec.encode`);
    ``threads`` is also the read-back's decoder threads (one while an
    encoder runs beside it).
    """
    t0 = time.monotonic()
    if record.state != State.VERIFIED:
        raise IntegrityError(
            f"job {record.job} step {record.step}: state is {record.state.value}, only verified "
            f"checkpoints are promoted; run verify first"
        )
    if not record.files:
        raise IntegrityError(f"job {record.job} step {record.step}: the catalog lists no files; rescan it")
    mkey = manifest_key(record.job, record.step)
    adir = archive_dir(record.job, record.step)
    copy_url = _store_url(archive, adir)
    data_class = archive.storage_class if isinstance(archive, StorageClasses) else None
    sealed = data_class in RESTORE_CLASSES  # no GET until restored: prove by local decode + HEAD
    # Bookkeeping objects (the upload marker, the manifest) stay in the bucket's
    # default class, so that the janitor and every reader can always read them.
    plain = archive.in_class(None) if isinstance(archive, StorageClasses) and data_class is not None else archive

    # 1. Already committed? Then compare instead of uploading over it.
    try:
        existing = _read_manifest(archive, mkey)
    except NotFound:
        existing = None
    if existing is not None:
        return _existing_copy(archive, record, existing, mkey, copy_url, now=now, t0=t0, owner=owner)

    # 2. Say what we are about to write (the janitor's proof that it is ours), then
    #    encode + upload each file, hashing the raw bytes as they stream by, and
    # 3. read every object back: each must decode to the hot bytes.
    marker = UploadMarker(record.job, record.step, owner, now,
                          tuple(sorted(f.relpath + DATA_SUFFIX for f in record.files)))
    plain.write(upload_marker_key(record.job, record.step), marker.to_json())
    files = sorted(record.files, key=lambda f: f.relpath)
    hot_digests, stored = _stream_and_prove(hot, hot_prefix, record, archive, files, data_class, level=level,
                                            threads=threads, block_size=block_size, sealed=sealed)

    # 4. Commit: the manifest, last, created only if absent.
    # The manifest lists the CRCs the hot bytes just proved; a sha256 from the format's
    # metadata goes in only when a recorded CRC vouched for those bytes.
    proven = tuple(
        replace(f, crc64nvme=hot_digests[f.relpath].crc64nvme,
                sha256_expected=f.sha256_expected if f.crc64nvme is not None else None)
        for f in record.files
    )
    manifest = Manifest.for_record(
        replace(record, files=proven), created_at=now, codec=_codec.CODEC_ID,
        codec_params={"level": level}, stored=stored,
    )
    try:
        plain.write(mkey, manifest.to_json(), if_absent=True)
    except AlreadyExists:
        existing = _read_manifest(archive, mkey)
        return _existing_copy(archive, record, existing, mkey, copy_url, now=now, t0=t0, owner=owner, ours=manifest)
    return ArchiveCopy(
        url=copy_url,
        stored_bytes=sum(s.size for s in stored.values()),
        raw_bytes=sum(d.size for d in hot_digests.values()),
        codec=_codec.CODEC_ID,
        manifest_key=mkey,
        verified_at=now,
        seconds=time.monotonic() - t0,
        storage_class=data_class,
    )


class _Stopped(StoreError):
    """Another file of the same promotion failed: this file's unfinished write is abandoned."""


class _Release:
    """Releases a semaphore exactly once, from whichever thread gets there first."""

    def __init__(self, gate: threading.Semaphore) -> None:
        self._gate = gate
        self._lock = threading.Lock()
        self._done = False

    def __call__(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._gate.release()


class _ChunkedStream(io.RawIOBase):
    """A readable stream whose ``readall`` reads in :data:`CHUNK`-sized reads (not
    io's 8 KiB default), so a store that reads a whole small object pays few calls."""

    def readall(self) -> bytes:
        parts = []
        while chunk := self.read(CHUNK):
            parts.append(chunk)
        return b"".join(parts)


class _UploadStream(_ChunkedStream):
    """The encoded stream of one file as the archive store reads it.

    Reads go to ``inner`` (an :class:`~ckptier.storage.codec_stream.EncodingReader`);
    ``encoded()`` is called once the encoder is finished, whichever way (EOF,
    an error raised by a read, or :meth:`close`), so that the next file's
    encoder may start while the store is still making this object durable.
    A read after ``stop`` is set raises :class:`_Stopped`, so that the store
    discards what it wrote (another file failed: finishing this one is wasted).
    """

    def __init__(self, inner: io.RawIOBase, stop: threading.Event, encoded: Callable[[], None], where: str) -> None:
        super().__init__()
        self._inner = inner
        self._stop = stop
        self._encoded = encoded
        self._where = where

    def readable(self) -> bool:
        return True

    def _check(self) -> None:
        if self._stop.is_set():
            self._encoded()
            raise _Stopped(f"{self._where}: upload abandoned, another file of the same promotion failed; "
                           f"not committed")

    def read(self, size: int | None = -1) -> bytes:
        self._check()
        try:
            data = self._inner.read(-1 if size is None else size) or b""
        except BaseException:
            self._encoded()
            raise
        if not data:
            self._encoded()
        return data

    def readinto(self, buf: Any) -> int:
        self._check()
        try:
            n = self._inner.readinto(buf)
        except BaseException:
            self._encoded()
            raise
        if not n:
            self._encoded()
        return n or 0

    def close(self) -> None:
        if not self.closed:
            try:
                self._inner.close()
            finally:
                self._encoded()
                super().close()


class _DecoderGone(Exception):
    """The decoder reading a :class:`_Pipe` stopped (it failed); nothing more can be fed to it."""


class _Pipe:
    """A bounded in-memory pipe between one writer thread and one reader thread.

    :meth:`write` blocks while ``limit`` bytes wait unread (one write larger
    than ``limit`` is let in when the pipe is empty) and raises
    :class:`_DecoderGone` once the reader has left (:meth:`leave`);
    :meth:`read` blocks until there are bytes or the writer has closed the
    pipe (then ``b""``). Memory is bounded by about ``limit`` plus one write.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._cond = threading.Condition()
        self._chunks: list[bytes] = []
        self._held = 0
        self._closed = False
        self._gone = False

    def write(self, data: bytes) -> None:
        with self._cond:
            while self._held and self._held + len(data) > self._limit and not self._gone:
                self._cond.wait()
            if self._gone:
                raise _DecoderGone("the decoder stopped")
            self._chunks.append(data)
            self._held += len(data)
            self._cond.notify_all()

    def close(self) -> None:
        """No more writes: the reader sees EOF once it has read what is held."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def leave(self) -> None:
        """The reader is done (or failed): drop what is held and refuse further writes."""
        with self._cond:
            self._gone = True
            self._chunks, self._held = [], 0
            self._cond.notify_all()

    def read(self, size: int = -1) -> bytes:
        with self._cond:
            while not self._chunks and not self._closed:
                self._cond.wait()
            if not self._chunks:
                return b""
            head = self._chunks[0]
            if 0 <= size < len(head):
                self._chunks[0] = head[size:]
                head = head[:size]
            else:
                self._chunks.pop(0)
            self._held -= len(head)
            self._cond.notify_all()
            return head


class _ProvingTee(_ChunkedStream):
    """What the store reads of an object it cannot give back until restored (``GLACIER``...):
    the encoded stream, decoded on the way by a thread of its own (fed through a
    bounded :class:`_Pipe`, one decoder worker); the store sees EOF only once the
    decoded bytes matched ``want()`` (the hot bytes' digests, known by then), so
    bytes that do not decode to the hot file are never uploaded whole.
    :attr:`hasher` hashes the encoded bytes (what the store's checksum must show).
    """

    def __init__(self, inner: io.RawIOBase, want: Callable[[], Digests], where: str, limit: int = 4 << 20) -> None:
        super().__init__()
        self._inner = inner
        self._want = want
        self._where = where
        self._pipe = _Pipe(limit)
        self._out = _HashingSink()
        self._error: BaseException | None = None
        self.hasher = Hasher()
        self._thread = threading.Thread(target=self._decode, name="ckptier-prove-upload", daemon=True)
        self._thread.start()

    def _decode(self) -> None:
        try:
            _codec.decode(self._pipe, self._out, threads=1)  # type: ignore[arg-type]
        except BaseException as exc:  # noqa: BLE001 - raised by the store's read, see _finish
            self._error = exc
        finally:
            self._pipe.leave()

    def _finish(self) -> None:
        """At the encoded stream's end: wait for the decoder; raise unless it gave the hot bytes."""
        self._pipe.close()
        self._thread.join()
        if self._error is not None:
            raise IntegrityError(f"{self._where}: the encoded copy does not decode ({self._error}); "
                                 f"not uploaded, hot copy kept") from self._error
        back, want = self._out.hasher.digests(), self._want()
        if back.size != want.size or back.crc64nvme != want.crc64nvme:
            raise IntegrityError(
                f"{self._where}: the encoded copy decodes to {back.size} bytes crc64nvme {back.crc64nvme}, the hot "
                f"file has {want.size} bytes crc64nvme {want.crc64nvme}; not uploaded, hot copy kept"
            )

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            return self.readall()
        data = self._inner.read(size) or b""
        if not data:
            self._finish()
            return b""
        self.hasher.update(data)
        try:
            self._pipe.write(data)
        except _DecoderGone:
            self._finish()  # raises the decoder's error, if it failed
            raise IntegrityError(f"{self._where}: bytes follow the end of the encoded archive; not uploaded, "
                                 f"hot copy kept") from None
        return data

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        data = self.read(view.nbytes)
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            try:
                self._pipe.close()  # an unfinished stream: the decoder sees a truncated archive and stops
                self._thread.join()
                self._inner.close()
            finally:
                super().close()


def _stream_and_prove(
    hot: Store,
    hot_prefix: str,
    record: CheckpointRecord,
    archive: Store,
    files: Sequence[FileRecord],
    data_class: str | None,
    *,
    level: int,
    threads: int,
    block_size: int,
    sealed: bool = False,
) -> tuple[dict[str, Digests], dict[str, StoredObject]]:
    """Encode each of ``files`` from ``hot`` straight into ``archive`` and prove each object by
    reading it back; the hot bytes' digests and the stored objects, by relpath.

    A pipeline of three overlapping stages, each bounded:

    * one encoder at a time (``threads`` codec workers): file *i + 1* is
      read and encoded as soon as file *i*'s encoder has finished, while the
      store still makes file *i* durable (a local store's fsync and rename):
      at most two writes are in flight, and only one of them holds codec
      buffers. A store with multipart uploads (S3) writes one file at a time:
      each write holds up to its ``multipart_threshold`` plus one part in
      memory until it is acknowledged, and two would hold twice that;
    * the store's ``write`` consumes the encoder's output as it comes
      (:class:`~ckptier.storage.codec_stream.EncodingReader`, a rendezvous:
      no spool, no buffer beyond the encoder's own); it reaches EOF only
      after the hot bytes' size and CRC64NVME matched the catalog, so a
      mismatch leaves no object;
    * one read-back at a time (one decoder worker beside a running encoder,
      ``threads`` for the last file): each object, once written, is read back from the store, decoded and compared with the hot
      bytes (and its storage class confirmed, when ``data_class`` is set)
      while later files are still encoded.

    ``sealed``: ``data_class`` cannot be read without a restore (``GLACIER``,
    ``DEEP_ARCHIVE``). Then the proof moves before the commit of each object:
    the encoded stream is decoded as the store reads it (:class:`_ProvingTee`)
    and the store sees EOF only once it gave the hot bytes; the read-back
    stage HEADs the object, which must be in ``data_class`` and show the size
    and full-object CRC64NVME of the bytes sent (:func:`_confirm_class`).

    The first failure stops the pipeline: no further file is started, writes
    in flight are abandoned (their next read raises :class:`_Stopped`, so the
    store discards them) and that first error is raised once every stage has
    stopped. Objects already written stay uncommitted (no manifest) for a
    re-run to overwrite or :func:`janitor` to remove, as the upload marker allows.
    """
    from ckptier.storage.codec_stream import EncodingReader  # lazy: the codec is imported on first use

    hot_digests: dict[str, Digests] = {}
    sent: dict[str, Digests] = {}  # the encoded bytes handed to the store (sealed classes)
    stored: dict[str, StoredObject] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()
    stop = threading.Event()
    encoder_free = threading.Semaphore(1)

    def fail(exc: BaseException) -> None:
        with lock:
            if not stop.is_set():
                errors.append(exc)
            stop.set()

    last = files[-1].relpath if files else None

    def read_back(f: FileRecord) -> None:
        if stop.is_set():
            return
        dkey = data_key(record.job, record.step, f.relpath)
        # Beside a running encoder, one decoder thread (the encoder has ``threads`` of its own and
        # decoding is the lighter half); the last file's read-back has the machine to itself.
        workers = threads if f.relpath == last else max(1, threads // 2)
        try:
            if sealed:
                assert data_class is not None
                info = _confirm_class(archive, dkey, data_class, sent[f.relpath])
                with lock:
                    stored[f.relpath] = StoredObject(key=f.relpath + DATA_SUFFIX, size=info.size,
                                                     crc64nvme=sent[f.relpath].crc64nvme)
                return
            if data_class is not None:
                _confirm_class(archive, dkey, data_class, None)
            back, enc = _decode_check(archive, dkey, threads=workers)
            want = hot_digests[f.relpath]
            if back.size != want.size or back.crc64nvme != want.crc64nvme:
                raise IntegrityError(
                    f"{_store_url(archive, dkey)}: read-back decodes to {back.size} bytes crc64nvme "
                    f"{back.crc64nvme}, the hot file has {want.size} bytes crc64nvme {want.crc64nvme}; "
                    f"archive copy not committed, hot copy kept",
                    url=archive.url,
                    key=dkey,
                )
            with lock:
                stored[f.relpath] = StoredObject(key=f.relpath + DATA_SUFFIX, size=enc.size, crc64nvme=enc.crc64nvme)
        except BaseException as exc:  # noqa: BLE001 - handed to the calling thread, which raises it
            fail(exc)

    def write(f: FileRecord, encoded: _Release, readers: ThreadPoolExecutor) -> None:
        hkey = hot_file_key(hot_prefix, record, f.relpath)
        dkey = data_key(record.job, record.step, f.relpath)
        try:
            if stop.is_set():
                return
            with hot.open_read(hkey) as src:
                reader = _HashingReader(src)

                def accept(_: Any) -> None:  # on the encoder's thread, before the store may see EOF
                    got = reader.hasher.digests()
                    _check_hot_digest(record, f, got, _store_url(hot, hkey))
                    with lock:
                        hot_digests[f.relpath] = got

                encoding = EncodingReader(reader, name=f.relpath, level=level, threads=threads,  # type: ignore[arg-type]
                                          block_size=block_size, before_eof=accept)
                stream: io.RawIOBase = _UploadStream(encoding, stop, encoded, _store_url(archive, dkey))
                if sealed:
                    stream = _ProvingTee(stream, lambda: hot_digests[f.relpath], _store_url(archive, dkey))
                with stream:
                    archive.write(dkey, stream)  # type: ignore[arg-type]
                if isinstance(stream, _ProvingTee):
                    with lock:
                        sent[f.relpath] = stream.hasher.digests()
            readers.submit(read_back, f)
        except BaseException as exc:  # noqa: BLE001 - handed to the calling thread, which raises it
            fail(exc)
        finally:
            encoded()

    readers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptier-read-back")
    in_flight = 1 if isinstance(archive, MultipartUploads) else 2  # S3 buffers a part per write, see above
    writers = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="ckptier-upload")
    try:
        for f in files:
            encoder_free.acquire()
            if stop.is_set():
                encoder_free.release()
                break
            writers.submit(write, f, _Release(encoder_free), readers)
    except BaseException as exc:  # interrupted while waiting: stop the stages, then re-raise
        fail(exc)
        raise
    finally:
        writers.shutdown(wait=True)
        readers.shutdown(wait=True)
    if errors:
        raise errors[0]
    return hot_digests, stored


def _confirm_class(archive: Store, key: str, storage_class: str, sent: Digests | None) -> ObjectInfo:
    """HEAD ``key``: it must be in ``storage_class`` and, when ``sent`` is given (a class that
    cannot be read back), hold exactly those bytes by the store's own full-object checksum."""
    info = archive.stat(key)
    where = _store_url(archive, key)
    if info.storage_class != storage_class:
        raise IntegrityError(
            f"{where}: stored in {info.storage_class or 'no storage class'}, not {storage_class} as configured; "
            f"this store ignores the storage class (fix storage_class or the bucket): not committed, hot copy kept",
            url=archive.url, key=key,
        )
    if sent is None:
        return info
    if info.checksum is None:
        raise IntegrityError(
            f"{where}: {storage_class} objects cannot be read back, and the store reports no full-object "
            f"CRC64NVME to prove the upload; unset CKPTIER_S3_CHECKSUMS=when_required for this endpoint or "
            f"use storage_class = \"GLACIER_IR\": not committed, hot copy kept",
            url=archive.url, key=key,
        )
    if info.size != sent.size or info.checksum != f"crc64nvme:{sent.crc64nvme}":
        raise IntegrityError(
            f"{where}: the store holds {info.size} bytes {info.checksum}, {sent.size} bytes "
            f"crc64nvme:{sent.crc64nvme} were sent; not committed, hot copy kept",
            url=archive.url, key=key,
        )
    return info


def _record_content(record: CheckpointRecord) -> tuple[str, int, tuple[tuple[str, int, str], ...]]:
    """The content tuple the catalog record implies (comparable only when every CRC is recorded)."""
    return (
        record.job,
        record.step,
        tuple(sorted((f.relpath, f.size, f.crc64nvme or "") for f in record.files)),
    )


def _existing_copy(
    archive: Store,
    record: CheckpointRecord,
    existing: Manifest,
    mkey: str,
    copy_url: str,
    *,
    now: datetime,
    t0: float,
    owner: str,
    ours: Manifest | None = None,
) -> ArchiveCopy:
    """Judge a committed manifest found in the archive: same content and intact objects → reuse
    it; different content → conflict; damaged objects → :class:`IntegrityError`."""
    if ours is not None:
        same = _content(existing) == _content(ours)
    elif all(f.crc64nvme for f in record.files):
        same = _content(existing) == _record_content(record)
    else:
        same = False
    if not same:
        raise ArchiveConflict(
            f"{_store_url(archive, mkey)}: a committed archive copy of job {record.job} step "
            f"{record.step} holds different content ({owner} changed and deleted nothing); "
            f"inspect it and remove it by hand if it is stale"
        )
    stored_total = 0
    classes: set[str | None] = set()
    adir = archive_dir(record.job, record.step)
    for f in existing.files:
        dkey = _stored_key(adir, f)
        damaged = (f"the committed archive copy {copy_url} is damaged; the hot copy is kept: inspect the copy, "
                   f"remove it if it is bad, then apply again to promote anew")
        try:
            info = archive.stat(dkey)
            classes.add(info.storage_class)
        except NotFound:
            raise IntegrityError(
                f"{_store_url(archive, dkey)}: listed in the committed manifest but missing; {damaged}",
                url=archive.url,
                key=dkey,
            ) from None
        if f.stored is not None and info.size != f.stored.size:
            raise IntegrityError(
                f"{_store_url(archive, dkey)}: {info.size} bytes but the committed manifest says "
                f"{f.stored.size}; {damaged}",
                url=archive.url,
                key=dkey,
            )
        if not _checksum_matches(archive, dkey, f):
            back, _ = _decode_check(archive, dkey)
            if back.size != f.size or back.crc64nvme != f.crc64nvme:
                raise IntegrityError(
                    f"{_store_url(archive, dkey)}: decodes to {back.size} bytes crc64nvme {back.crc64nvme}, the "
                    f"committed manifest says {f.size} bytes crc64nvme {f.crc64nvme}; {damaged}",
                    url=archive.url,
                    key=dkey,
                )
        stored_total += info.size
    return ArchiveCopy(
        url=copy_url,
        stored_bytes=stored_total,
        raw_bytes=sum(f.size for f in existing.files),
        codec=_codec.CODEC_ID,
        manifest_key=mkey,
        verified_at=now,
        already_archived=True,
        seconds=time.monotonic() - t0,
        storage_class=classes.pop() if len(classes) == 1 else None,
    )


# --------------------------------------------------------------------------- fetch


@dataclass(frozen=True)
class FetchResult:
    """Where a fetched checkpoint came from and what was written.

    ``tier`` is ``"hot"`` or ``"archive"``; ``paths`` the written files in
    relpath order; ``bytes`` their total size; ``notes`` why a preferred
    tier was skipped (e.g. the hot copy failed its hash check).
    """

    tier: str
    source: str
    dest: Path
    paths: tuple[Path, ...]
    bytes: int
    seconds: float
    notes: tuple[str, ...] = ()


def _dest_path(dest: Path, relpath: str) -> Path:
    path = (dest / relpath).resolve()
    root = dest.resolve()
    if root != path and root not in path.parents:
        raise IntegrityError(f"{relpath!r}: file path escapes the destination {dest}; refusing to write it")
    return path


def _fetch_files(
    record: CheckpointRecord,
    dest: Path,
    expected: Mapping[str, tuple[int, str | None]],
    fill_for: Any,
    where: Any,
) -> tuple[list[Path], int]:
    """Write every file via temp + rename, checking size and CRC64NVME before each rename."""
    paths: list[Path] = []
    total = 0
    for f in sorted(record.files, key=lambda f: f.relpath):
        path = _dest_path(dest, f.relpath)
        size, crc = expected[f.relpath]
        total += _write_checked(path, lambda sink, r=f.relpath: fill_for(r, sink), size, crc, where(f.relpath), f.relpath)
        paths.append(path)
    return paths, total


def _write_checked(path: Path, fill: Any, size: int, crc: str | None, where: str, relpath: str) -> int:
    """``fill(sink)`` into a temporary file beside ``path``, renamed to ``path`` only when its
    size and CRC64NVME (when known) match; the bytes written. Nothing is left on failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".ckptier-fetch-", dir=path.parent)
    os.fchmod(fd, file_mode())
    try:
        with os.fdopen(fd, "wb") as out:
            sink = _HashingSink(out)
            fill(sink)
            out.flush()
            os.fsync(out.fileno())
        got = sink.hasher.digests()
        if got.size != size or (crc is not None and got.crc64nvme != crc):
            raise IntegrityError(
                f"{where}: fetched {got.size} bytes crc64nvme {got.crc64nvme}, "
                f"expected {size} bytes crc64nvme {crc}; file not written",
                key=relpath,
            )
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return got.size


def _fill(store: Store, key: str, sink: _HashingSink, *, decode: bool) -> None:
    """Stream ``key`` of ``store`` into ``sink``, through the codec when ``decode``
    (an archived object that does not decode raises :class:`IntegrityError`)."""
    with store.open_read(key) as src:
        if not decode:
            while chunk := src.read(CHUNK):
                sink.write(chunk)
            return
        try:
            _codec.decode(src, sink)  # type: ignore[arg-type]
        except StoreError:
            raise
        except Exception as exc:  # noqa: BLE001 - a decoder failure means bad bytes
            raise IntegrityError(f"{_store_url(store, key)}: archived object does not decode ({exc})",
                                 key=key) from exc


@dataclass(frozen=True)
class FetchFile:
    """One file to fetch: its path in the checkpoint, its key in the store, the size
    and CRC64NVME it must have (None: size only)."""

    relpath: str
    key: str
    size: int
    crc64nvme: str | None


@dataclass(frozen=True)
class FetchBatch:
    """A fan-out work item of :func:`fetch`: write ``files`` of the store at
    ``store_url`` (decoded when ``decode``: an archive copy) into the staging
    directory ``stage``, each verified before it is renamed into place. Plain
    data: a worker in another process opens the store itself. ``label``
    names the checkpoint (``job@step``) for the task run that fetches it."""

    store_url: str
    stage: str
    files: tuple[FetchFile, ...]
    decode: bool
    label: str = ""


@dataclass(frozen=True)
class FetchedFile:
    """A file a :class:`FetchBatch` wrote, verified: its relpath and its size in bytes."""

    relpath: str
    bytes: int


def fetch_batch(store: Store, batch: FetchBatch) -> list[FetchedFile]:
    """Write ``batch``'s files into its staging directory, in order, each checked
    (:class:`IntegrityError` at the first that does not match; files already
    written stay for the caller to clear). Idempotent: a retry rewrites the same
    files. Raises :class:`ConfigError` when the staging directory is not there
    (a worker that does not share this filesystem, or a fetch already given up):
    it never creates it."""
    stage = Path(batch.stage)
    if not stage.is_dir():
        raise ConfigError(f"{stage}: fetch staging directory is not there on this worker; fetch with a runner "
                          "whose workers share this filesystem (a local Dask cluster, or threads)")
    done = []
    for f in batch.files:
        size = _write_checked(_dest_path(stage, f.relpath),
                              lambda sink, k=f.key: _fill(store, k, sink, decode=batch.decode),
                              f.size, f.crc64nvme, _store_url(store, f.key), f.relpath)
        done.append(FetchedFile(f.relpath, size))
    return done


def _fetch_fanned(fanout: Fanout, store: Store, stage: Path, files: list[FetchFile], *,
                  decode: bool, label: str = "") -> tuple[list[Path], int]:
    """:func:`_fetch_files` as :class:`FetchBatch` work items on ``fanout``
    (:class:`ckptier.tasks.fanout.Fanout`), in relpath order. Every item has
    finished before anything is raised (nothing writes into ``stage`` once the
    caller clears it); the first failure in relpath order is raised."""
    ordered = sorted(files, key=lambda f: f.relpath)
    work = [FetchBatch(store.url, str(stage), b, decode, label) for b in batches(ordered, fanout.parallelism, most=8)]
    results = list(fanout.map(fetch_work, work, errors=True))
    for r in results:
        if isinstance(r, BaseException):
            raise r
    written = [f for r in results for f in r]
    return [_dest_path(stage, f.relpath) for f in written], sum(f.bytes for f in written)


def _present(record: CheckpointRecord, tier: Tier) -> bool:
    return any(c.tier == tier and c.state in HELD_COPY_STATES for c in record.copies)


def _archive_copy_url(record: CheckpointRecord) -> str | None:
    copy = record.archive_copy()
    return copy.url if copy is not None else None


@dataclass(frozen=True)
class ArchiveCheck:
    """The proof of one archive copy: ``ok`` when every stored object
    decoded (zstd frame and segment checksums) to the size and CRC64NVME the
    manifest and the catalog record, or, where allowed, its full-object
    checksum kept by the store equals the manifest's. ``bytes_read`` counts
    stored bytes read; ``bytes_skipped`` those proven by the store's
    checksum; ``problems`` has one line per bad file (or the manifest);
    ``bad_files`` the relpaths of the bad files (every file of the record
    when the manifest itself is bad)."""

    url: str
    ok: bool
    bytes_read: int
    problems: tuple[str, ...] = ()
    bytes_skipped: int = 0
    bad_files: tuple[str, ...] = ()


def _checksum_matches(archive: Store, key: str, m: ManifestFile) -> bool:
    """True when the store keeps a full-object CRC64NVME of ``key`` equal to
    the one the manifest recorded for the stored object (and the sizes agree)."""
    if m.stored is None:
        return False
    info = archive.stat(key)
    try:
        kept = store_crc64nvme(info.checksum)
    except ValueError:
        return False
    return kept is not None and kept == m.stored.crc64nvme and info.size == m.stored.size


def check_archive_copy(record: CheckpointRecord, archive: Store, *, store_checksums: bool = False) -> ArchiveCheck:
    """Read back ``record``'s archive copy in ``archive`` and compare every file.

    Never writes. Transient and access errors propagate (nothing is proven
    either way); a missing or unreadable manifest, a manifest entry whose
    size or CRC64NVME differs from the catalog, a missing object, an object
    that does not decode, or decoded bytes whose size or CRC64NVME differ
    from the manifest or the catalog make the copy not ``ok``. With
    ``store_checksums``, an object whose full-object CRC64NVME kept by the
    store equals the one the manifest recorded at commit (when the object
    was read back and decoded bit-exact) counts as proven without reading
    it; other objects are decoded. An object in a class that cannot be read
    without a restore (GLACIER) is checked by HEAD only: present, with the
    size and full-object CRC64NVME the manifest recorded. Raises
    :class:`NotFound` when the catalog records no archive copy.
    """
    copy_url = _archive_copy_url(record)
    if copy_url is None:
        raise NotFound(f"job {record.job} step {record.step}: the catalog records no archive copy")
    adir = prefix_from_location(archive, copy_url)
    everything = tuple(sorted(f.relpath for f in record.files))
    try:
        manifest = _read_manifest(archive, join_key(adir, MANIFEST_NAME))
    except (NotFound, IntegrityError, ValueError) as exc:
        return ArchiveCheck(copy_url, False, 0, (f"{MANIFEST_NAME}: {exc}",), bad_files=everything)
    catalog_files = {f.relpath: f for f in record.files}
    problems: list[str] = []
    bad: list[str] = []
    read = skipped = 0
    for m in manifest.files:
        key = _stored_key(adir, m)
        want = catalog_files.get(m.relpath)
        if want is not None and (m.size != want.size or (want.crc64nvme and m.crc64nvme != want.crc64nvme)):
            problems.append(f"{m.relpath}: the manifest says {m.size} bytes crc64nvme {m.crc64nvme}, the catalog "
                            f"{want.size} bytes crc64nvme {want.crc64nvme}")
            bad.append(m.relpath)
            continue
        try:
            if store_checksums and _checksum_matches(archive, key, m):
                skipped += m.stored.size if m.stored is not None else 0
                continue
            raw, stored = _decode_check(archive, key)
        except NeedsRestore:  # unreadable until restored: the store's checksum against the manifest's
            head_problems = _head_check(archive, key, m)
            problems.extend(head_problems)
            if head_problems:
                bad.append(m.relpath)
            continue
        except (NotFound, IntegrityError) as exc:
            problems.append(f"{m.relpath}: {exc}")
            bad.append(m.relpath)
            continue
        read += stored.size
        if raw.size != m.size or raw.crc64nvme != m.crc64nvme:
            problems.append(
                f"{m.relpath}: decoded {raw.size} bytes crc64nvme {raw.crc64nvme}, "
                f"expected {m.size} bytes crc64nvme {m.crc64nvme}"
            )
            bad.append(m.relpath)
    missing = sorted(set(catalog_files) - {m.relpath for m in manifest.files})
    problems.extend(f"{rel}: not in the archive manifest" for rel in missing)
    bad.extend(missing)
    return ArchiveCheck(copy_url, not problems, read, tuple(problems), bytes_skipped=skipped,
                        bad_files=tuple(sorted(set(bad) & set(catalog_files))))


def _head_check(archive: Store, key: str, m: ManifestFile) -> list[str]:
    """Problems of an object that cannot be read without a restore, judged by HEAD alone:
    present, and the size and full-object CRC64NVME the manifest recorded for it."""
    try:
        info = archive.stat(key)
    except NotFound as exc:
        return [f"{m.relpath}: {exc}"]
    if m.stored is None:
        return []
    if info.size != m.stored.size or (info.checksum is not None and info.checksum != f"crc64nvme:{m.stored.crc64nvme}"):
        return [f"{m.relpath}: the store holds {info.size} bytes {info.checksum} in {info.storage_class}, the manifest "
                f"says {m.stored.size} bytes crc64nvme:{m.stored.crc64nvme}"]
    return []


#: Name prefix of the staging directory a fetch fills beside its destination.
FETCH_STAGE_PREFIX = ".ckptier-fetch-"


class UnfetchableLayout(CkptierError):
    """A checkpoint whose file names no filesystem can hold at once (a key that is
    also the "directory" of other keys, as S3 allows; a name longer than
    :data:`NAME_MAX` bytes)."""


#: Bytes a file or directory name may take on the filesystems fetch writes to (ext4, XFS,
#: btrfs, tmpfs: 255); an S3 key's segments may be longer.
NAME_MAX = 255


def check_fetch_dest(dest: str | os.PathLike[str]) -> None:
    """Raise :class:`ConfigError` (one line) unless ``dest`` can receive a fetch:
    it must not exist, or be an empty directory, and its nearest existing
    ancestor must be a writable directory. Reads only; a fetch never
    overwrites anything."""
    out = Path(dest)
    if out.is_symlink():
        raise ConfigError(f"fetch destination {out} is a symbolic link; give a new or empty directory")
    if out.exists():
        if not out.is_dir():
            raise ConfigError(f"fetch destination {out} is a file; give a new or empty directory (fetch never overwrites)")
        try:
            entries = sorted(p.name for p in out.iterdir())
        except OSError as exc:
            raise ConfigError(f"fetch destination {out} cannot be read: {exc.strerror or exc}") from None
        if entries:
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise ConfigError(f"fetch destination {out} is not empty ({shown}); give a new or empty directory "
                              "(fetch never overwrites)")
        parent = out.parent
    else:
        parent = out.absolute().parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            raise ConfigError(f"fetch destination {out}: {parent} is a file, not a directory; give another DEST")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"fetch destination {out}: directory {parent} is not writable; give another DEST")


def path_conflicts(relpaths: Collection[str]) -> list[tuple[str, str]]:
    """``(name, other)`` pairs where file ``name`` is also a directory holding
    ``other`` (``rank-0000`` and ``rank-0000/model.pt``): S3 keys allow it, a
    filesystem does not. Sorted; pure."""
    names = set(relpaths)
    out: list[tuple[str, str]] = []
    for rel in sorted(names):
        parts = rel.split("/")
        for i in range(1, len(parts)):
            head = "/".join(parts[:i])
            if head in names:
                out.append((head, rel))
                break
    return out


def overlong_names(relpaths: Collection[str]) -> list[str]:
    """The ``relpaths`` holding a name (a ``/``-separated segment) of more than
    :data:`NAME_MAX` bytes in UTF-8, which no common filesystem can create.
    Sorted; pure."""
    return sorted(r for r in relpaths if any(len(part.encode("utf-8", "surrogateescape")) > NAME_MAX
                                             for part in r.split("/")))


def check_layout(record: CheckpointRecord) -> None:
    """Raise :class:`UnfetchableLayout` when ``record``'s relative paths cannot
    all be written to one directory tree (a name over :data:`NAME_MAX` bytes, a
    file that is also a directory); pure. Checked before anything is written,
    by a fetch and by a drill (whose ranks fetch parts of the record)."""
    overlong = overlong_names([f.relpath for f in record.files])
    if overlong:
        more = f" (and {len(overlong) - 1} more)" if len(overlong) > 1 else ""
        raise UnfetchableLayout(
            f"job {record.job} step {record.step}: {overlong[0][:60]!r}... holds a name over {NAME_MAX} bytes{more}, "
            "which no filesystem can hold; nothing was written. Rename the object in the store and rescan"
        )
    conflicts = path_conflicts([f.relpath for f in record.files])
    if conflicts:
        head, other = conflicts[0]
        more = f" (and {len(conflicts) - 1} more)" if len(conflicts) > 1 else ""
        raise UnfetchableLayout(
            f"job {record.job} step {record.step}: {head!r} is both a file and the directory of {other!r}{more}, "
            "which no filesystem can hold; nothing was written. Remove or rename the stray object in the store "
            "and rescan"
        )


def _dir_mode() -> int:
    mode = file_mode()
    return mode | ((mode & 0o444) >> 2)


def _stage_dir(out: Path) -> Path:
    """A new staging directory beside ``out``; stale ones of dead fetches to the same DEST go first."""
    host = socket.gethostname().replace("/", "_")
    prefix = f"{FETCH_STAGE_PREFIX}{out.name}.{host}."
    try:
        siblings = list(out.parent.iterdir())
    except OSError:
        siblings = []
    for sib in siblings:
        if sib.name.startswith(prefix) and sib.is_dir() and not sib.is_symlink():
            pid = sib.name[len(prefix):].split(".", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(sib, ignore_errors=True)
    stage = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}.", dir=out.parent))
    os.chmod(stage, _dir_mode())
    return stage


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clear(stage: Path) -> None:
    for child in list(stage.iterdir()):
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def _make_parents(directory: Path) -> list[Path]:
    """Create ``directory`` and its missing parents; returns those created, deepest last."""
    missing: list[Path] = []
    d = directory
    while not d.exists():
        missing.append(d)
        d = d.parent
    for m in reversed(missing):
        m.mkdir(mode=_dir_mode(), exist_ok=True)
    return list(reversed(missing))


def _move_into_place(stage: Path, out: Path) -> None:
    """Rename the complete ``stage`` to ``out`` (absent or an empty directory), then sync the parent."""
    try:
        os.rename(stage, out)
    except OSError as exc:
        raise ConfigError(f"fetch destination {out} appeared or filled up while fetching ({exc.strerror or exc}); "
                          "nothing was written there") from None
    try:
        fd = os.open(out.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fetch(
    record: CheckpointRecord,
    *,
    hot: Store | None,
    archive: Store | None,
    dest: str | os.PathLike[str],
    hot_prefix: str | None = None,
    fanout: Any = None,
) -> FetchResult:
    """Restore a checkpoint's original files into ``dest``, verified, from the best tier.

    The hot copy is used first when the catalog has it present, the
    checkpoint is verified and ``hot`` is given (``hot_prefix`` defaults to
    the record's location relative to ``hot.url``); every file's size and
    CRC64NVME must match the catalog. Otherwise, or when the hot copy fails,
    the archive copy is decoded; every file must match the archive manifest
    and the catalog's recorded hash.

    All or nothing: ``dest`` must not exist or be an empty directory
    (:func:`check_fetch_dest`; :class:`ConfigError` otherwise, before
    anything is read). The files are written into a staging directory
    beside ``dest`` (``.ckptier-fetch-NAME.HOST.PID.*``), each checked before
    it is kept, and the directory is renamed to ``dest`` only when every
    file is complete and verified. A failed fetch removes the staging
    directory and any parents of ``dest`` it created; one killed outright
    leaves its staging directory, which the next fetch to the same ``dest``
    removes once its process is gone. A checkpoint whose names clash (a
    file that is also a directory) raises :class:`UnfetchableLayout` before
    anything is written. When the archive copy is in a storage class that
    must be restored first, its restore is requested and
    :class:`RestoreRequested` says when to try again. Raises
    :class:`NotFound` when no tier can provide the checkpoint,
    :class:`IntegrityError` when the only available copies fail their
    hashes; the message names every tier tried and why it failed.

    With ``fanout`` (a :class:`ckptier.tasks.fanout.Fanout`) the files are
    read, decoded, checked and written into the staging directory by
    :class:`FetchBatch` work items on it (a transient failure is tried
    again); choosing the tier, the staging directory and the rename stay
    here, and the result and errors are the same as without it. Its workers
    must see this filesystem.
    """
    t0 = time.monotonic()
    out = Path(dest)
    check_fetch_dest(out)
    check_layout(record)
    created: list[Path] = []
    stage: Path | None = None
    done = False
    try:
        created = _make_parents(out.absolute().parent)
        stage = _stage_dir(out.absolute())
        result = _fetch_into(record, hot=hot, archive=archive, stage=stage, hot_prefix=hot_prefix, t0=t0,
                             fanout=fanout)
        _move_into_place(stage, out)
        done = True
    except OSError as exc:
        # Writing the destination failed for a reason of the machine's (a full disk, a
        # read-only or pseudo filesystem): one line naming DEST, nothing left behind.
        fault = environment_fault(exc, str(out.absolute()), doing="fetch into")
        if fault is None:
            raise
        raise fault from exc
    finally:
        if not done:
            if stage is not None:
                shutil.rmtree(stage, ignore_errors=True)
            for d in reversed(created):
                try:
                    d.rmdir()
                except OSError:
                    break
    assert stage is not None
    paths = tuple(out / p.relative_to(stage) for p in result.paths)
    return replace(result, dest=out, paths=paths, seconds=time.monotonic() - t0)


def _fetch_into(
    record: CheckpointRecord,
    *,
    hot: Store | None,
    archive: Store | None,
    stage: Path,
    hot_prefix: str | None,
    t0: float,
    fanout: Any = None,
) -> FetchResult:
    """:func:`fetch`'s tiers, writing into ``stage`` (emptied before each tier is tried)."""
    out = stage
    notes: list[str] = []
    name = f"job {record.job} step {record.step}"
    last_exc: CkptierError | None = None

    if hot is not None and _present(record, Tier.HOT) and record.missing_since is None:
        if record.state != State.VERIFIED:
            why = f": {record.state_reason}" if record.state_reason else ""
            notes.append(f"hot copy skipped: state is {record.state.value}, not verified{why}")
        elif not all(f.crc64nvme for f in record.files):
            notes.append("hot copy skipped: the catalog has no recorded hash for every file")
        else:
            try:
                prefix = hot_prefix if hot_prefix is not None else prefix_from_location(hot, record.location)
                expected = {f.relpath: (f.size, f.crc64nvme) for f in record.files}

                def fill_hot(relpath: str, sink: _HashingSink) -> None:
                    _fill(hot, hot_file_key(prefix, record, relpath), sink, decode=False)

                if fanout is not None:
                    paths, total = _fetch_fanned(fanout, hot, out, [
                        FetchFile(f.relpath, hot_file_key(prefix, record, f.relpath), f.size, f.crc64nvme)
                        for f in record.files], decode=False, label=f"{record.job}@{record.step}")
                else:
                    paths, total = _fetch_files(
                        record, out, expected, fill_hot, lambda r: _store_url(hot, hot_file_key(prefix, record, r))
                    )
                return FetchResult("hot", record.location, out, tuple(paths), total, time.monotonic() - t0, tuple(notes))
            except CkptierError as exc:
                last_exc = exc
                notes.append(f"hot copy failed: {exc}")
    elif hot is None:
        notes.append("hot copy skipped: no hot store given")
    else:
        notes.append("hot copy skipped: not present in hot storage")

    copy_url = _archive_copy_url(record)
    if archive is not None and copy_url is not None:
        manifest: Manifest | None = None
        try:
            _clear(out)  # nothing the failed hot attempt wrote is kept
            adir = prefix_from_location(archive, copy_url)
            manifest = _read_manifest(archive, join_key(adir, MANIFEST_NAME))
            listed = {m.relpath: m for m in manifest.files}
            for f in record.files:
                m = listed.get(f.relpath)
                if m is None or m.size != f.size or (f.crc64nvme and m.crc64nvme != f.crc64nvme):
                    raise IntegrityError(
                        f"{copy_url}: manifest entry for {f.relpath} "
                        f"({'absent' if m is None else f'{m.size} bytes {m.crc64nvme}'}) does not match "
                        f"the catalog ({f.size} bytes {f.crc64nvme}); archive copy unusable"
                    )
            expected = {r: (m.size, m.crc64nvme) for r, m in listed.items()}

            def fill_archive(relpath: str, sink: _HashingSink) -> None:
                _fill(archive, _stored_key(adir, listed[relpath]), sink, decode=True)

            if fanout is not None:
                paths, total = _fetch_fanned(fanout, archive, out, [
                    FetchFile(f.relpath, _stored_key(adir, listed[f.relpath]), *expected[f.relpath])
                    for f in record.files], decode=True, label=f"{record.job}@{record.step}")
            else:
                paths, total = _fetch_files(
                    record, out, expected, fill_archive, lambda r: _store_url(archive, _stored_key(adir, listed[r]))
                )
            return FetchResult("archive", copy_url, out, tuple(paths), total, time.monotonic() - t0, tuple(notes))
        except NeedsRestore as exc:
            raise request_restore(record, archive, adir, manifest, exc) from exc
        except CkptierError as exc:
            last_exc = exc
            notes.append(f"archive copy failed: {exc}")
    elif copy_url is None:
        notes.append("archive copy skipped: the catalog records none")
    else:
        notes.append("archive copy skipped: no archive store given")

    summary = "; ".join(notes)
    if isinstance(last_exc, IntegrityError):
        raise IntegrityError(f"{name}: no tier gave verified bytes ({summary})") from last_exc
    raise NotFound(f"{name}: no tier could provide it ({summary})") from last_exc


class RestoreRequested(CkptierError):
    """An archive copy is in a storage class that must be restored before it can be
    read; a restore was requested (or is running). The message says when to try again."""


def request_restore(
    record: CheckpointRecord,
    archive: Store,
    adir: str,
    manifest: Manifest | None,
    exc: NeedsRestore,
    *,
    days: int = 1,
    tier: str = "Standard",
) -> CkptierError:
    """Ask ``archive`` to restore every object of ``record``'s copy at ``adir``; the one-line
    error to raise instead of ``exc``.

    Every stored object of the manifest is asked for (or, when the manifest
    itself could not be read, the object ``exc`` names), so that the next
    fetch finds all of them readable. ``days``: how long the restored copies
    stay readable; ``tier``: the retrieval tier (its usual duration, from
    :data:`~ckptier.storage.s3.RESTORE_HOURS`, is what the message promises).
    """
    name = f"job {record.job} step {record.step}"
    cls = exc.storage_class or "an archival storage class"
    if not isinstance(archive, Restorable):
        return RestoreRequested(f"{name}: the archive copy is in {cls} and {archive.url} cannot restore it: {exc}")
    keys = [_stored_key(adir, m) for m in manifest.files] if manifest is not None else [exc.key or ""]
    states = [archive.restore(k, days=days, tier=tier) for k in keys if k]
    if states and all(s == "ready" for s in states):
        return RestoreRequested(f"{name}: the archive copy in {cls} is restored now; run the fetch again")
    hours = RESTORE_HOURS.get(exc.storage_class or "", {}).get(tier)
    when = f"in about {_hours(hours)}" if hours else "once the restore has finished"
    running = states.count("in-progress")
    what = (f"restore requested for {states.count('requested')} of {len(states)} objects"
            + (f" ({running} already being restored)" if running else "")
            + f" ({tier} retrieval, readable for {days} day{'s' if days > 1 else ''})")
    return RestoreRequested(
        f"{name}: the archive copy is in {cls}, which must be restored before it can be read; "
        f"{what}; run 'ckptier fetch --job {record.job} --step {record.step}' again {when}"
    )


def _hours(hours: float) -> str:
    return f"{round(hours * 60)} minutes" if hours < 1 else f"{hours:g} hours"


# ------------------------------------------------------------------------- janitor


def _step_dir(key: str) -> str | None:
    m = _STEP_DIR_RE.match(key)
    return m.group("dir") if m else None


def _group_step_dirs(archive: Store) -> tuple[list[tuple[str, list[Any]]], list[str]]:
    """Objects grouped by step directory (sorted), and the keys in no step directory."""
    groups: dict[str, list[Any]] = {}
    loose: list[str] = []
    for info in archive.list(""):
        d = _step_dir(info.key)
        if d is None:
            loose.append(info.key)
        else:
            groups.setdefault(d, []).append(info)
    return sorted(groups.items()), sorted(loose)


def _our_keys(archive: Store, d: str) -> set[str] | None:
    """The keys in step directory ``d`` that its upload marker says ckptier
    wrote (the marker included), or None when there is no readable marker."""
    key = f"{d}/{UPLOAD_MARKER}"
    try:
        marker = UploadMarker.from_json(read_bytes(archive, key, limit=UPLOAD_MARKER_LIMIT), where=key)
    except (NotFound, ValueError):
        return None
    return {f"{d}/{k}" for k in marker.keys} | {key}


def janitor(archive: Store, *, now: datetime, older_than: timedelta,
            cataloged: Collection[str] = ()) -> JanitorReport:
    """Remove what interrupted promotions left in ``archive``; never touch a
    committed copy, and never anything ckptier did not write.

    * Only ckptier's own objects are ever removed: those an upload marker
      (written by :func:`promote` before its first upload) names, the marker
      itself, and a local store's own temporary files (``.ckptier-tmp-*``).
      Everything else without a commit marker is listed in ``not_ours`` and
      left alone, however old; catalog backups (``.ckptier/catalog/``,
      :mod:`ckptier.tasks.backup`) are ckptier's own and never touched.
    * Multipart uploads started more than ``older_than`` before ``now`` are
      aborted when an upload marker names their key (only on stores that
      have ``list_multipart_uploads``); a local store's own temporary files
      that old are removed.
    * A step directory (``…/step-NNNNNNNN/``) without ``ckptier-manifest.json``
      whose marked objects are all older than ``older_than`` (by object
      mtime) loses them, the marker last (so a janitor killed half-way
      finishes next time). Directories holding a manifest are never touched,
      whatever else they contain. Objects without an mtime count as new.
    * A step directory in ``cataloged`` (keys relative to ``archive``, as
      :func:`archive_dir` gives them) is a copy the catalog holds as
      present: its missing manifest is damage to report, never something to
      clean up. It is left alone and listed in ``unexpected``.

    Idempotent. ``older_than`` must exceed the longest promotion, or a
    running promotion's objects could be removed (the promotion then fails
    its commit check and nothing is lost but time).
    """
    if older_than <= timedelta(0):
        raise ValueError(f"janitor older_than = {older_than}: must be > 0, e.g. timedelta(hours=24)")
    report = JanitorReport()
    cutoff = now - older_than
    groups, loose = _group_step_dirs(archive)
    report.not_ours.extend(k for k in loose if not k.startswith(BACKUP_PREFIX))  # catalog backups are ckptier's own
    ours = {d: _our_keys(archive, d) for d, _ in groups}

    if isinstance(archive, MultipartUploads):
        marked = set().union(*(k for k in ours.values() if k))
        for key, upload_id, initiated in archive.list_multipart_uploads(""):
            if key not in marked:
                report.not_ours.append(f"{key} (multipart upload {upload_id})")
            elif initiated is not None and initiated < cutoff:
                archive.abort_multipart(key, upload_id)
                report.aborted_uploads.append((key, upload_id))

    cutoff_ts = cutoff.timestamp()
    if isinstance(archive, TempFiles):
        for rel in archive.stale_temp_files(cutoff_ts):
            archive.remove_temp_file(rel)
            report.removed_temp_files.append(rel)
    protected = set(cataloged)
    for d, infos in groups:
        if any(i.key == f"{d}/{MANIFEST_NAME}" for i in infos):
            report.committed_dirs += 1
            continue
        if d in protected:
            report.unexpected.append(d)
            continue
        mine = ours[d] or set()
        report.not_ours.extend(sorted(i.key for i in infos if i.key not in mine))
        victims = [i for i in infos if i.key in mine]
        if not victims:
            continue
        if any(i.mtime is None or i.mtime >= cutoff_ts for i in victims):
            report.young_dirs.append(d)
            continue
        marker = f"{d}/{UPLOAD_MARKER}"
        # Re-check the commit marker right before deleting: a promotion may just have committed.
        try:
            archive.stat(f"{d}/{MANIFEST_NAME}")
        except NotFound:
            pass
        else:
            report.committed_dirs += 1
            continue
        data = sorted(i.key for i in victims if i.key != marker)
        res = archive.delete_many(data) if data else None
        if res is not None:
            report.removed_keys.extend(res.deleted)
            report.failed.update(res.failed)
        if res is None or not res.failed:
            last = archive.delete_many([marker])
            report.removed_keys.extend(last.deleted)
            report.failed.update(last.failed)
            if not last.failed and len(victims) == len(infos):
                report.removed_dirs.append(d)
    report.not_ours.sort()
    return report


# ------------------------------------------------------------------ fanned out


@dataclass(frozen=True)
class PromoteWork:
    """Copy one checkpoint's hot copy into the archive tier at ``archive_url``
    (in ``storage_class`` when set), proven bit-exact (:func:`promote`): one work item of a fan-out."""

    record: CheckpointRecord
    archive_url: str
    storage_class: str | None
    now: datetime
    owner: str


def promoter(fanout: Fanout, *, archive_url: str, storage_class: str | None, now: Callable[[], datetime],
             owner: str) -> Callable[[Sequence[CheckpointRecord]], Iterator[Any]]:
    """``promote_many`` for :func:`ckptier.tasks.apply.apply_plan`: one :class:`PromoteWork`
    per record on ``fanout`` (:class:`ckptier.tasks.fanout.Fanout`), each outcome (copy or
    exception) in order."""

    def promote_many(records: Sequence[CheckpointRecord]) -> Iterator[Any]:
        work = [PromoteWork(r, archive_url, storage_class, now(), owner) for r in records]
        return fanout.map(promote_work, work, errors=True)

    return promote_many


def promote_work(work: PromoteWork) -> ArchiveCopy:
    """The :class:`ArchiveCopy` made, through the worker's own stores; raises the
    :class:`~ckptier.storage.errors.CkptierError` that stopped it."""
    stores = worker_stores()
    hot, prefix = stores.for_record(work.record)
    archive = stores.store(work.archive_url)
    if work.storage_class is not None:
        if not isinstance(archive, StorageClasses):
            raise ConfigError(f"storage_class {work.storage_class!r}: archive {work.archive_url} has no storage "
                              "classes; they apply to s3:// archives only")
        archive = archive.in_class(work.storage_class)
    return promote(hot, prefix, work.record, archive, now=work.now, owner=work.owner)


def fetch_work(work: FetchBatch) -> list[FetchedFile]:
    """The :class:`FetchedFile` list of one :class:`FetchBatch` (a drill's or a fetch's
    files, written verified into its staging directory); opens the store itself and
    raises the :class:`~ckptier.storage.errors.CkptierError` that stopped it."""
    return fetch_batch(worker_stores().store(work.store_url), work)
