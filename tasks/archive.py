"""The archive tier: promote a checkpoint, fetch it back, clean up after crashes.

Archive layout (relative to the archive store's root)::

    {job}/step-{step:08d}/{relpath}.ckz     one codec stream per checkpoint file
    {job}/step-{step:08d}/ckptier-manifest.json     the commit marker, written LAST

A step directory counts as an archive copy only when its ``ckptier-manifest.json``
exists: the manifest is created with a conditional create (``if_absent``)
after every data object was read back, decoded and found bit-identical to
the hot file. Anything in a step directory without a manifest is debris of
an interrupted promotion, which :func:`janitor` removes once it is old
enough. The manifest lists every file's original size and CRC64NVME, so a
lost catalog can be rebuilt from the archive alone.

Nothing here deletes or modifies a hot copy, and nothing here reads the
clock: times are passed in.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO

from ckptier.storage import codec as _codec
from ckptier.storage.base import Store, join_key, read_bytes
from ckptier.storage.errors import (
    AlreadyExists,
    CkptierError,
    ConfigError,
    IntegrityError,
    NotFound,
    StoreError,
)
from ckptier.storage.hashing import Digests, Hasher
from ckptier.storage.local import file_mode
from ckptier.storage.manifest import MANIFEST_NAME as _MANIFEST_NAME
from ckptier.storage.manifest import Manifest, ManifestFile, StoredObject
from ckptier.storage.model import CheckpointRecord, FileRecord, State, Tier
from ckptier.tasks.verify import (
    file_key as hot_file_key,  # the single-file rule lives there
)

#: Name of the commit marker in an archive step directory (format recognition
#: knows it as ckptier's own file, so scanning an archive never mistakes it).
MANIFEST_NAME = _MANIFEST_NAME
#: Suffix of archived (encoded) data objects.
DATA_SUFFIX = ".ckz"
#: Largest manifest we will read (bytes); a manifest of 100k files is ~15 MB.
MANIFEST_LIMIT = 64 << 20
#: Read size for streaming copies, bytes.
CHUNK = 8 << 20

_STEP_DIR_RE = re.compile(r"^(?P<dir>(?:.+/)?step-\d{8})/(?P<rest>.+)$")


class ArchiveConflict(CkptierError):
    """The archive already holds a committed copy of this step with different content."""


# ----------------------------------------------------------------------------- layout


def archive_dir(job: str, step: int) -> str:
    """The archive key prefix of one checkpoint: ``{job}/step-{step:08d}``."""
    return join_key(job, f"step-{step:08d}")


def data_key(job: str, step: int, relpath: str) -> str:
    """Key of the archived (encoded) copy of one checkpoint file."""
    return join_key(archive_dir(job, step), relpath + DATA_SUFFIX)


def manifest_key(job: str, step: int) -> str:
    """Key of the commit marker of one archived checkpoint."""
    return join_key(archive_dir(job, step), MANIFEST_NAME)


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
    """

    url: str
    stored_bytes: int
    raw_bytes: int
    codec: str
    manifest_key: str
    verified_at: datetime
    already_archived: bool = False
    seconds: float = 0.0


def _check_hot_digest(record: CheckpointRecord, f: FileRecord, got: Digests, where: str) -> None:
    if got.size != f.size:
        raise IntegrityError(
            f"{where}: hot file is {got.size} bytes but the catalog recorded {f.size} "
            f"(job {record.job} step {record.step}); rescan and verify before promoting",
            key=where,
        )
    if f.crc64nvme is not None and got.crc64nvme != f.crc64nvme:
        raise IntegrityError(
            f"{where}: hot file CRC64NVME {got.crc64nvme} differs from the catalog's {f.crc64nvme} "
            f"(job {record.job} step {record.step}); run verify before promoting",
            key=where,
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


def _stored_key(adir: str, m: ManifestFile) -> str:
    """Key of ``m``'s archived object in the copy at ``adir`` (its manifest entry, else the default name)."""
    return join_key(adir, m.stored.key if m.stored is not None else m.relpath + DATA_SUFFIX)


def _decode_check(archive: Store, key: str) -> tuple[Digests, Digests]:
    """Stream ``key`` from ``archive`` through the codec; return digests of the decoded and the stored bytes.

    Transient and access errors propagate unchanged; anything else that goes
    wrong while decoding (a truncated or mangled object) is an
    :class:`IntegrityError` naming the object.
    """
    out = _HashingSink()
    with archive.open_read(key) as raw:
        counted = _HashingReader(raw)
        try:
            _codec.decode(counted, out)  # type: ignore[arg-type]
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
    spool_dir: str | os.PathLike[str] | None = None,
) -> ArchiveCopy:
    """Copy one checkpoint into the archive tier, proven bit-exact, and commit it.

    For each file (in relpath order): stream it from ``hot`` through the
    codec into a temporary spool file (memory stays bounded whatever the
    file size; disk use is one encoded file at a time, in ``spool_dir``),
    hashing the raw bytes on the way; check size and CRC64NVME against the
    catalog record (when recorded); upload it to :func:`data_key` (S3 stores
    switch to multipart above their threshold). Then read every object back,
    decode it and compare size and CRC64NVME with the hot bytes. Only when
    every file matches is ``ckptier-manifest.json`` created with ``if_absent=True``.

    Idempotent: when the manifest already exists with the same job, step and
    file hashes (the acknowledgement of an earlier commit was lost, or an
    earlier run finished), the data objects are checked for presence and the
    existing copy is returned with ``already_archived=True``. A manifest with
    different content raises :class:`ArchiveConflict` before anything is
    uploaded (when seen up front) or instead of committing.

    Raises :class:`IntegrityError` when the hot bytes do not match the
    catalog or the read-back does not match the hot bytes (nothing is
    committed), and store errors unchanged. The hot copy is only read.
    ``owner`` names the promoting run in error messages.
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

    # 1. Already committed? Then compare instead of uploading over it.
    try:
        existing = _read_manifest(archive, mkey)
    except NotFound:
        existing = None
    if existing is not None:
        return _existing_copy(archive, record, existing, mkey, copy_url, now=now, t0=t0, owner=owner)

    # 2. Encode + upload each file, hashing the raw bytes as they stream by.
    hot_digests: dict[str, Digests] = {}
    for f in sorted(record.files, key=lambda f: f.relpath):
        hkey = hot_file_key(hot_prefix, record, f.relpath)
        dkey = data_key(record.job, record.step, f.relpath)
        with tempfile.TemporaryFile(dir=spool_dir) as spool:
            with hot.open_read(hkey) as src:
                reader = _HashingReader(src)
                _codec.encode(reader, spool, name=f.relpath, level=level, threads=threads)  # type: ignore[arg-type]
            got = reader.hasher.digests()
            _check_hot_digest(record, f, got, _store_url(hot, hkey))
            hot_digests[f.relpath] = got
            spool.seek(0)
            archive.write(dkey, spool)  # type: ignore[arg-type]

    # 3. Read back: every archived object must decode to the hot bytes.
    stored: dict[str, StoredObject] = {}
    for f in sorted(record.files, key=lambda f: f.relpath):
        dkey = data_key(record.job, record.step, f.relpath)
        back, enc = _decode_check(archive, dkey)
        want = hot_digests[f.relpath]
        if back.size != want.size or back.crc64nvme != want.crc64nvme:
            raise IntegrityError(
                f"{_store_url(archive, dkey)}: read-back decodes to {back.size} bytes crc64nvme "
                f"{back.crc64nvme}, the hot file has {want.size} bytes crc64nvme {want.crc64nvme}; "
                f"archive copy not committed, hot copy kept",
                url=archive.url,
                key=dkey,
            )
        stored[f.relpath] = StoredObject(key=f.relpath + DATA_SUFFIX, size=enc.size, crc64nvme=enc.crc64nvme)

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
        archive.write(mkey, manifest.to_json(), if_absent=True)
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
    )


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
    """Judge a committed manifest found in the archive: same content → reuse it, else conflict."""
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
    adir = archive_dir(record.job, record.step)
    for f in existing.files:
        dkey = _stored_key(adir, f)
        try:
            info = archive.stat(dkey)
        except NotFound:
            raise IntegrityError(
                f"{_store_url(archive, dkey)}: listed in the committed manifest but missing; "
                f"the archive copy is damaged, run a deep archive check",
                url=archive.url,
                key=dkey,
            ) from None
        if f.stored is not None and info.size != f.stored.size:
            raise IntegrityError(
                f"{_store_url(archive, dkey)}: {info.size} bytes but the committed manifest says "
                f"{f.stored.size}; the archive copy is damaged, run a deep archive check",
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
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".ckptier-fetch-", dir=path.parent)
        os.fchmod(fd, file_mode())
        try:
            with os.fdopen(fd, "wb") as out:
                sink = _HashingSink(out)  # type: ignore[arg-type]
                fill_for(f.relpath, sink)
                out.flush()
                os.fsync(out.fileno())
            got = sink.hasher.digests()
            size, crc = expected[f.relpath]
            if got.size != size or (crc is not None and got.crc64nvme != crc):
                raise IntegrityError(
                    f"{where(f.relpath)}: fetched {got.size} bytes crc64nvme {got.crc64nvme}, "
                    f"expected {size} bytes crc64nvme {crc}; file not written",
                    key=f.relpath,
                )
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        paths.append(path)
        total += got.size
    return paths, total


def _present(record: CheckpointRecord, tier: Tier) -> bool:
    return any(c.tier == tier and c.state in ("present", "degraded") for c in record.copies)


def _archive_copy_url(record: CheckpointRecord) -> str | None:
    copy = record.archive_copy()
    return copy.url if copy is not None else None


@dataclass(frozen=True)
class ArchiveCheck:
    """The deep read of one archive copy: ``ok`` when every stored object
    decoded (zstd frame and segment checksums) to the size and CRC64NVME the
    manifest and the catalog record. ``bytes_read`` counts stored bytes;
    ``problems`` has one line per bad file (or the manifest)."""

    url: str
    ok: bool
    bytes_read: int
    problems: tuple[str, ...] = ()


def check_archive_copy(record: CheckpointRecord, archive: Store) -> ArchiveCheck:
    """Read back ``record``'s archive copy in ``archive`` and compare every file.

    Never writes. Transient and access errors propagate (nothing is proven
    either way); a missing or unreadable manifest, a missing object, an
    object that does not decode, or decoded bytes whose size or CRC64NVME
    differ from the manifest or the catalog make the copy not ``ok``.
    Raises :class:`NotFound` when the catalog records no archive copy.
    """
    copy_url = _archive_copy_url(record)
    if copy_url is None:
        raise NotFound(f"job {record.job} step {record.step}: the catalog records no archive copy")
    adir = prefix_from_location(archive, copy_url)
    try:
        manifest = _read_manifest(archive, join_key(adir, MANIFEST_NAME))
    except (NotFound, IntegrityError, ValueError) as exc:
        return ArchiveCheck(copy_url, False, 0, (f"{MANIFEST_NAME}: {exc}",))
    catalog_crc = {f.relpath: f.crc64nvme for f in record.files}
    problems: list[str] = []
    read = 0
    for m in manifest.files:
        key = _stored_key(adir, m)
        try:
            raw, stored = _decode_check(archive, key)
        except (NotFound, IntegrityError) as exc:
            problems.append(f"{m.relpath}: {exc}")
            continue
        read += stored.size
        expected = catalog_crc.get(m.relpath)
        if raw.size != m.size or raw.crc64nvme != m.crc64nvme or (expected and raw.crc64nvme != expected):
            problems.append(
                f"{m.relpath}: decoded {raw.size} bytes crc64nvme {raw.crc64nvme}, "
                f"expected {m.size} bytes crc64nvme {m.crc64nvme}"
            )
    missing = sorted(set(catalog_crc) - {m.relpath for m in manifest.files})
    problems.extend(f"{rel}: not in the archive manifest" for rel in missing)
    return ArchiveCheck(copy_url, not problems, read, tuple(problems))


#: Name prefix of the staging directory a fetch fills beside its destination.
FETCH_STAGE_PREFIX = ".ckptier-fetch-"


class UnfetchableLayout(CkptierError):
    """A checkpoint whose file names no filesystem can hold at once (a key that is
    also the "directory" of other keys, as S3 allows)."""


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


def _check_layout(record: CheckpointRecord) -> None:
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
    anything is written. Raises :class:`NotFound` when no tier can provide
    the checkpoint, :class:`IntegrityError` when the only available copies
    fail their hashes; the message names every tier tried and why it failed.
    """
    t0 = time.monotonic()
    out = Path(dest)
    check_fetch_dest(out)
    _check_layout(record)
    created = _make_parents(out.absolute().parent)
    stage = _stage_dir(out.absolute())
    done = False
    try:
        result = _fetch_into(record, hot=hot, archive=archive, stage=stage, hot_prefix=hot_prefix, t0=t0)
        _move_into_place(stage, out)
        done = True
    finally:
        if not done:
            shutil.rmtree(stage, ignore_errors=True)
            for d in reversed(created):
                try:
                    d.rmdir()
                except OSError:
                    break
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
) -> FetchResult:
    """:func:`fetch`'s tiers, writing into ``stage`` (emptied before each tier is tried)."""
    out = stage
    notes: list[str] = []
    name = f"job {record.job} step {record.step}"
    last_exc: CkptierError | None = None

    if hot is not None and _present(record, Tier.HOT) and record.missing_since is None:
        if record.state != State.VERIFIED:
            notes.append(f"hot copy skipped: state is {record.state.value}, not verified")
        elif not all(f.crc64nvme for f in record.files):
            notes.append("hot copy skipped: the catalog has no recorded hash for every file")
        else:
            try:
                prefix = hot_prefix if hot_prefix is not None else prefix_from_location(hot, record.location)
                expected = {f.relpath: (f.size, f.crc64nvme) for f in record.files}

                def fill_hot(relpath: str, sink: _HashingSink) -> None:
                    with hot.open_read(hot_file_key(prefix, record, relpath)) as src:  # type: ignore[union-attr]
                        while chunk := src.read(CHUNK):
                            sink.write(chunk)

                paths, total = _fetch_files(
                    record, out, expected, fill_hot, lambda r: _store_url(hot, hot_file_key(prefix, record, r))  # type: ignore[arg-type]
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
                key = _stored_key(adir, listed[relpath])
                with archive.open_read(key) as src:  # type: ignore[union-attr]
                    try:
                        _codec.decode(src, sink)  # type: ignore[arg-type]
                    except StoreError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - a decoder failure means bad bytes
                        raise IntegrityError(
                            f"{_store_url(archive, key)}: archived object does not decode ({exc})",  # type: ignore[arg-type]
                            key=key,
                        ) from exc

            paths, total = _fetch_files(
                record, out, expected, fill_archive, lambda r: _store_url(archive, _stored_key(adir, listed[r]))  # type: ignore[arg-type]
            )
            return FetchResult("archive", copy_url, out, tuple(paths), total, time.monotonic() - t0, tuple(notes))
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


# ------------------------------------------------------------------------- janitor


@dataclass
class JanitorReport:
    """What :func:`janitor` did.

    ``aborted_uploads``: (key, upload id) of multipart uploads aborted;
    ``removed_dirs``: step directories without a manifest that were removed;
    ``removed_keys``: their objects; ``young_dirs``: uncommitted directories
    left alone because they are newer than the threshold (a promotion may be
    running); ``failed``: key → reason for objects that could not be removed;
    ``unexpected``: directories the catalog records as archive copies that
    have lost their manifest (left alone: damage to look at, not debris);
    ``removed_temp_files``: a local store's own ``.ckptier-tmp-*`` files left
    by interrupted writes.
    """

    aborted_uploads: list[tuple[str, str]] = field(default_factory=list)
    removed_dirs: list[str] = field(default_factory=list)
    removed_keys: list[str] = field(default_factory=list)
    young_dirs: list[str] = field(default_factory=list)
    committed_dirs: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    removed_temp_files: list[str] = field(default_factory=list)


def _step_dir(key: str) -> str | None:
    m = _STEP_DIR_RE.match(key)
    return m.group("dir") if m else None


def _group_step_dirs(archive: Store) -> Iterator[tuple[str, list[Any]]]:
    groups: dict[str, list[Any]] = {}
    for info in archive.list(""):
        d = _step_dir(info.key)
        if d is not None:
            groups.setdefault(d, []).append(info)
    yield from sorted(groups.items())


def janitor(archive: Store, *, now: datetime, older_than: timedelta,
            cataloged: Collection[str] = ()) -> JanitorReport:
    """Remove what interrupted promotions left in ``archive``; never touch a committed copy.

    * Multipart uploads started more than ``older_than`` before ``now`` are
      aborted (only on stores that have ``list_multipart_uploads``); a local
      store's own temporary files (``.ckptier-tmp-*``) that old are removed.
      Nothing else without a commit marker is ever treated as temporary.
    * A step directory (``…/step-NNNNNNNN/``) without ``ckptier-manifest.json`` whose
      newest object is older than ``older_than`` (by object mtime) is
      removed. Directories holding a manifest are never touched, whatever
      else they contain. Objects without an mtime count as new (kept).

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
    list_uploads = getattr(archive, "list_multipart_uploads", None)
    if list_uploads is not None:
        for key, upload_id, initiated in list_uploads(""):
            if initiated is not None and initiated < cutoff:
                archive.abort_multipart(key, upload_id)  # type: ignore[attr-defined]
                report.aborted_uploads.append((key, upload_id))

    cutoff_ts = cutoff.timestamp()
    stale_temps = getattr(archive, "stale_temp_files", None)
    if stale_temps is not None:
        for rel in stale_temps(cutoff_ts):
            archive.remove_temp_file(rel)  # type: ignore[attr-defined]
            report.removed_temp_files.append(rel)
    protected = set(cataloged)
    for d, infos in _group_step_dirs(archive):
        if any(i.key == f"{d}/{MANIFEST_NAME}" for i in infos):
            report.committed_dirs += 1
            continue
        if d in protected:
            report.unexpected.append(d)
            continue
        if any(i.mtime is None or i.mtime >= cutoff_ts for i in infos):
            report.young_dirs.append(d)
            continue
        keys = sorted(i.key for i in infos)
        # Re-check the commit marker right before deleting: a promotion may just have committed.
        try:
            archive.stat(f"{d}/{MANIFEST_NAME}")
        except NotFound:
            pass
        else:
            report.committed_dirs += 1
            continue
        res = archive.delete_many(keys)
        report.removed_keys.extend(res.deleted)
        report.failed.update(res.failed)
        if not res.failed:
            report.removed_dirs.append(d)
    return report
