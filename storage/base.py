"""The one small protocol every object store implements, and the optional capabilities.

Why this small: every backend (a POSIX directory, any S3-compatible endpoint)
and every wrapper (retry, dry-run, fault injection in tests) has to
implement all of it, and one contract test suite has to cover it. Anything a
caller can build from these calls (recursive copy, read-to-bytes, ...) lives
in helper functions, not in the protocol.

What only some stores can do is a capability: a small ``@runtime_checkable``
protocol of its own (:data:`CAPABILITIES`), which a caller tests with
``isinstance(store, Capability)`` and never by probing attributes or the
store's class. A wrapper has a capability exactly when the store it wraps
has it (:mod:`.wrappers`). ``tests/test_store_contract.py`` checks, for every
store, which capabilities it has and that each one keeps its contract.

Keys are ``/``-separated, relative to the store's root URL, never start with
``/`` and never contain an empty, ``.`` or ``..`` segment.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO, Literal, NamedTuple, Protocol, runtime_checkable

from .errors import InvalidKey
from .records import DeleteResult as DeleteResult  # the result of Store.delete_many, held by DeleteInterrupted too
from .records import CheckpointRecord, slot_setters

#: S3's limit on keys in one DeleteObjects call; stores batch to this size.
MAX_DELETE_BATCH = 1000


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What a listing or stat knows about one object.

    ``mtime`` is seconds since the epoch (UTC). ``etag`` is the backend's
    change token (S3 ETag; ``None`` on POSIX). ``checksum`` is a full-object
    checksum the store itself keeps, as ``"crc64nvme:<base64>"``, or ``None``
    when the store keeps none (or only a composite one, which is useless for
    comparing whole objects). ``storage_class`` is the object's S3 storage
    class (``"STANDARD"``, ``"GLACIER_IR"``...) where the store has classes,
    else ``None``; a write's result leaves it ``None`` (``stat`` tells).

    ``link`` is set for a symlink in a directory tree: the key, inside the
    store's root, of the regular file it points at (``size`` and ``mtime``
    are then that file's). A store never follows a link to read it: it reads
    the file at ``link`` by that key, and deleting ``key`` removes the link
    only. ``identity`` is an opaque token of this very object as ``stat``
    saw it (a local file's device, inode, size and mtime in nanoseconds; an
    S3 object's size, ETag and version), what
    :meth:`ProvenDeletes.delete_proven` compares before deleting; a listing
    may leave it ``None``.
    """

    key: str
    size: int
    mtime: float | None = None
    etag: str | None = None
    checksum: str | None = None
    storage_class: str | None = None
    link: str | None = None
    identity: str | None = None


_INFO_KEY, _INFO_SIZE, _INFO_MTIME, _INFO_ETAG, _INFO_CHECKSUM, _INFO_CLASS, _INFO_LINK, _INFO_IDENTITY = slot_setters(
    ObjectInfo, ("key", "size", "mtime", "etag", "checksum", "storage_class", "link", "identity"))
_new = object.__new__


def listed_file(key: str, size: int, mtime: float) -> ObjectInfo:
    """``ObjectInfo(key, size, mtime)``, built without the dataclass
    ``__init__`` (:func:`~.records.slot_setters`): a local listing makes one
    per file."""
    info = _new(ObjectInfo)
    _INFO_KEY(info, key)
    _INFO_SIZE(info, size)
    _INFO_MTIME(info, mtime)
    _INFO_ETAG(info, None)
    _INFO_CHECKSUM(info, None)
    _INFO_CLASS(info, None)
    _INFO_LINK(info, None)
    _INFO_IDENTITY(info, None)
    return info


@runtime_checkable
class Store(Protocol):
    """An object store rooted at ``url``.

    Contract (checked by ``tests/test_store_contract.py`` for every store):

    * ``list(prefix)`` yields every object whose key starts with ``prefix``,
      recursively, each exactly once, in no particular order. A prefix that
      matches nothing yields nothing; a root that does not exist at all
      (missing bucket or directory) raises :class:`~.errors.NotFound`.
    * ``stat(key)`` returns the object's info or raises ``NotFound``.
    * ``open_read(key)`` returns a binary stream positioned at byte 0 that
      reads the object with bounded memory; raises ``NotFound``.
    * ``write(key, data)`` stores ``data`` (bytes or a readable binary
      stream, read to EOF) atomically: readers see the old object or the whole
      new one, never a part. With ``if_absent=True`` it raises
      :class:`~.errors.AlreadyExists` when the key exists, and that check and
      the write are one atomic step.
    * ``delete_many(keys)`` deletes in batches of at most
      :data:`MAX_DELETE_BATCH` and reports per key; it never raises for a
      single key's failure. When a whole batch fails it raises
      :class:`~.errors.DeleteInterrupted`, which carries what was confirmed
      before (its ``result``) and the batch's error.
    """

    @property
    def url(self) -> str:
        """The store's root URL (``file:///path``, ``s3://bucket/prefix``); keys are relative to it."""
        ...

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]: ...

    def stat(self, key: str) -> ObjectInfo: ...

    def open_read(self, key: str) -> BinaryIO: ...

    def write(self, key: str, data: bytes | BinaryIO, *, if_absent: bool = False) -> ObjectInfo: ...

    def delete_many(self, keys: Sequence[str]) -> DeleteResult: ...


# -- optional capabilities ---------------------------------------------------------


@runtime_checkable
class Canary(Protocol):
    """A store that can prove it keeps bytes unchanged before anything is deleted
    from it (S3-compatible endpoints, some of which reject or mangle the newer
    checksum headers).

    Contract (checked by ``tests/test_store_contract.py`` for every store that has it):

    * ``canary()`` writes a small object under a key of its own, reads it
      back, compares and deletes it. It returns ``None`` when all of that
      worked and raises :class:`~.errors.StoreError` (naming the fix)
      otherwise; either way it leaves no object behind (the delete is best
      effort after a failure) and touches no other key. Safe to repeat and
      to run concurrently.
    """

    def canary(self) -> None: ...


@runtime_checkable
class MultipartUploads(Protocol):
    """A store whose large writes go in multipart uploads, which a killed
    process leaves unfinished and billed until they are aborted (S3).

    Contract (checked by ``tests/test_store_contract.py`` for every store that has it):

    * ``list_multipart_uploads(prefix)`` returns every unfinished upload whose
      key starts with ``prefix`` as ``(key, upload_id, initiated)``: ``key``
      relative to the store's root, ``initiated`` an aware datetime;
      ordered by key, then by initiation. Finished and aborted uploads are
      never listed, and no upload is ever visible to ``list``.
    * ``abort_multipart(key, upload_id)`` aborts one unfinished upload and
      frees its parts. Idempotent: an unknown or already aborted upload is
      fine. It never touches a completed object.
    """

    def list_multipart_uploads(self, prefix: str = "") -> list[tuple[str, str, datetime]]: ...

    def abort_multipart(self, key: str, upload_id: str) -> None: ...


@runtime_checkable
class TempFiles(Protocol):
    """A store whose writes go through temporary files of its own beside their
    target (a POSIX directory: write, fsync, rename), which a killed process
    leaves behind.

    Contract (checked by ``tests/test_store_contract.py`` for every store that has it):

    * ``stale_temp_files(older_than)`` returns this store's own temporary
      files last modified before ``older_than`` (seconds since the epoch),
      as keys relative to the root, sorted. Never anything else; ``list``
      never shows them.
    * ``remove_temp_file(key)`` removes one of them. Idempotent; refuses
      (:class:`~.errors.InvalidKey`) a key that is not one of this store's
      temporary files, so nothing else can be removed through it.
    """

    def stale_temp_files(self, older_than: float) -> list[str]: ...

    def remove_temp_file(self, key: str) -> None: ...


@runtime_checkable
class LocalPaths(Protocol):
    """A store whose objects are plain files on this machine (a POSIX
    directory): what tells local files apart (no prefetching threads for
    them) and names them in messages.

    A path is resolved by the kernel through every symlink on it, so ckptier
    never opens one to read an object: ``open_read`` reads relative to the
    store's root without following any link, at the same speed.

    Contract (checked by ``tests/test_store_contract.py`` for every store that has it):

    * ``local_path(key)`` returns the absolute path of the file that holds
      object ``key`` (a regular file's bytes are ``open_read(key)``'s).
      Validates the key (:class:`~.errors.InvalidKey`) and does no I/O: a
      missing object shows as ``FileNotFoundError`` when the path is opened.
    """

    def local_path(self, key: str) -> Path: ...


@runtime_checkable
class ListingSkips(Protocol):
    """A store whose listing leaves out entries the user should hear about (a
    POSIX directory: symlink loops, dangling symlinks, symlinks to
    directories).

    Contract (checked by ``tests/test_store_contract.py`` for every store that has it):

    * ``list_with_skips(prefix, on_skip)`` yields exactly what
      ``list(prefix)`` yields and calls ``on_skip(key, reason)`` (``reason``
      one line) once for every entry under ``prefix`` that it leaves out,
      except the store's own temporary files.
    """

    def list_with_skips(self, prefix: str, on_skip: Callable[[str, str], None]) -> Iterator[ObjectInfo]: ...


class WalkedTree(NamedTuple):
    """A directory and every directory below it, as a listing saw them
    (:meth:`WalkedDirs.tree`)."""

    #: Entries of the top directory (every one, as ``os.listdir`` counts them).
    entries: int
    #: The latest mtime among the directories, in nanoseconds.
    newest_ns: int
    #: The directories, relative to the top one (``""``), no trailing ``/``; sorted.
    dirs: tuple[str, ...]
    #: Each directory's stamp token (see ``storage/walker.py``), in no particular order.
    tokens: tuple[str, ...]


class WalkedDirs(dict[str, tuple[int, int, list[str], str]]):
    """What a listing saw of each directory it read, read as it listed it:
    ``walked[rel] = (mtime_ns, entries, subdirectory names, token)``, ``rel``
    the directory's key and a trailing ``/`` (``""`` for the root), ``token``
    its part of a stamp (its key, mtime and link count).

    Filled by :meth:`DirectoryStamps.list_pruned` (``walked=``) and read by
    :meth:`DirectoryStamps.take_stamp` (``walked=``), so that stamping the
    checkpoints a first scan found needs no second pass over their
    directories. Only facts of this scan's own listing belong here: each was
    taken after the scan started, which is what lets ``take_stamp`` compare
    it with ``changed_before``. A plain ``dict`` underneath: the listing
    stores one entry per directory, half a million in a first scan of a
    million files, without a call for each.
    """

    __slots__ = ()

    def tree(self, key: str) -> WalkedTree | None:
        """The directory ``key`` (no trailing ``/``; ``""`` for the root) and
        every directory below it, or None unless the listing read every one
        of them."""
        top = key + "/" if key else ""
        get = self.get
        facts = get(top)
        if facts is None:
            return None
        entries = facts[1]
        cut = len(top)
        dirs: list[str] = []
        tokens: list[str] = []
        newest = 0
        pending = [top]
        while pending:
            rel = pending.pop()
            facts = get(rel)
            if facts is None:
                return None  # not entered (pruned, outside the prefix) or gone
            if facts[0] > newest:
                newest = facts[0]
            dirs.append(rel[cut:-1])
            tokens.append(facts[3])
            for name in facts[2]:
                pending.append(f"{rel}{name}/")
        dirs.sort()
        return WalkedTree(entries, newest, tuple(dirs), tuple(tokens))


@runtime_checkable
class DirectoryStamps(Protocol):
    """A store whose objects are files in a directory tree whose directories
    change (mtime, link count, number of entries) whenever an entry below
    them is added, removed or renamed (a POSIX directory), so that a rescan
    can leave out a directory unchanged since it was last listed.

    Contract (checked by ``tests/test_store_contract.py`` for every store that has it):

    * ``take_stamp(key, relpaths, changed_before=, walked=None)`` returns
      ``(stamp, dirs)`` for the directory ``key`` holding the files
      ``relpaths`` (relative to it): an opaque string, and the
      subdirectories the stamp covers, sorted (``""`` is ``key`` itself;
      every directory holding one of the files is among them). ``None`` when
      the tree cannot be trusted: a directory of it is missing, is not a
      directory, or was modified at or after ``changed_before`` (seconds
      since the epoch). With ``walked`` (filled by this scan's
      ``list_pruned``) and every directory of the tree in it, the stamp is
      made of those facts, the same stamp as reading the tree again would
      give while it is unchanged.
    * ``check_stamp(key, dirs)`` returns the stamp the tree has now: the one
      taken as long as no entry was added, removed or renamed in any of
      ``dirs`` (no subdirectory added either); another one, or ``None`` when
      a directory is gone, once one was. A file rewritten in place changes
      no directory and may keep the stamp.
    * ``list_pruned(prefix, skip_dir, on_skip, on_link, walked=None)``
      yields what ``list(prefix)`` yields, except below each directory for
      whose key (no trailing ``/``) ``skip_dir`` returns True, which it does
      not enter. It calls ``on_skip(key, reason)`` (one line) once for each
      entry under ``prefix`` that it leaves out for what it is (a dangling
      symlink, a symlink to a directory...), and ``on_link(key)`` once for
      each object it yields that is a link to a file elsewhere, whose bytes
      can change without its directory changing. It notes in ``walked``
      each directory it reads (:class:`WalkedDirs`).
    """

    def take_stamp(self, key: str, relpaths: Iterable[str], *, changed_before: float,
                   walked: WalkedDirs | None = None) -> tuple[str, tuple[str, ...]] | None: ...

    def check_stamp(self, key: str, dirs: Sequence[str]) -> str | None: ...

    def list_pruned(self, prefix: str, skip_dir: Callable[[str], bool], on_skip: Callable[[str, str], None],
                    on_link: Callable[[str], None], walked: WalkedDirs | None = None) -> Iterator[ObjectInfo]: ...


@runtime_checkable
class ProvenDeletes(Protocol):
    """A store that deletes an object only while it is the very object a caller
    proved (a POSIX directory: device, inode, size and mtime of the name, never
    through a symlink; S3: size, ETag and version), so that nothing replaced
    between a proof and its delete is deleted.

    Contract (checked by ``tests/test_store_contract.py`` for every store that has it):

    * ``delete_proven(proven)`` takes :class:`ObjectInfo` values from this
      store's ``stat`` (their ``identity`` set) and, for each, deletes its key
      only if ``stat`` would give the same ``identity`` right now; otherwise
      the key is left alone and reported in ``changed`` with what is there
      now. A key already absent counts as deleted. It never follows a
      symlink, neither on the way to the key nor at it (a link there is the
      link, deleted as itself when it was the object proven), and never
      touches anything outside the store's root. Reports per key as
      ``delete_many`` does (``shared`` for names whose bytes another name
      still holds); an info without ``identity`` is ``failed``.
    """

    def delete_proven(self, proven: Sequence[ObjectInfo]) -> DeleteResult: ...


@runtime_checkable
class BucketLocation(Protocol):
    """A store rooted at a key prefix of a bucket that can reach the other
    buckets of its endpoint with the same connection (S3): what reading the
    bucket's S3 Inventory reports, which S3 writes to another bucket, takes.

    Contract (checked by ``tests/test_store_contract.py`` for every store that has it):

    * ``bucket`` is the bucket's name and ``prefix`` the raw key prefix of
      the store's root (``""``, or ending in ``/``): object ``k`` is the
      bucket's key ``prefix + k``.
    * ``in_bucket(bucket)`` is a store rooted at the top of ``bucket``, over
      the same endpoint, credentials and settings, with the same wrappers
      and capabilities. It sends no request.
    """

    @property
    def bucket(self) -> str: ...

    @property
    def prefix(self) -> str: ...

    def in_bucket(self, bucket: str) -> Store: ...


@runtime_checkable
class ResumableReads(Protocol):
    """A store whose reads can go on part-way through an object after the
    connection broke, as long as the object has not changed (S3: a ranged GET
    pinned to the ETag; botocore retries requests, never a body that breaks
    off).

    Contract (checked by ``tests/test_store_contract.py`` for every store that has it):

    * ``open_versioned(key)`` returns ``(stream, version)``: the stream
      ``open_read(key)`` would return and the version of the object it reads
      (an opaque change token: S3's ETag). Raises as ``open_read`` does.
    * ``open_from(key, offset, version)`` returns a stream of the object's
      bytes from ``offset`` on (empty at or past the end), provided the
      object is still ``version``; raises :class:`~.errors.ObjectChanged`
      when it was replaced since, :class:`~.errors.NotFound` when it is gone.
    """

    def open_versioned(self, key: str) -> tuple[BinaryIO, str]: ...

    def open_from(self, key: str, offset: int, version: str) -> BinaryIO: ...


#: What :meth:`Restorable.restore` answers: a restore was started now, one is
#: already running, or the object is readable (restored, or never archived).
RestoreState = Literal["requested", "in-progress", "ready"]


@runtime_checkable
class StorageClasses(Protocol):
    """A store whose objects live in storage classes (S3).

    Contract (checked by ``tests/test_store_contract.py`` and
    ``tests/test_storage_class.py`` for every store that has it):

    * ``storage_class`` is the class this store's writes go to (``None``:
      the bucket's default); ``stat`` reports each object's class.
    * ``in_class(name)`` is the same store (same root, same connection, the
      same capabilities) writing to ``name`` instead; ``in_class(None)``
      writes to the default. Reads never depend on it.
    """

    storage_class: str | None

    def in_class(self, storage_class: str | None) -> Store: ...


@runtime_checkable
class Restorable(Protocol):
    """A store with storage classes whose objects must be restored before they
    can be read (S3 ``GLACIER``, ``DEEP_ARCHIVE``); reading such an object
    raises :class:`~.errors.NeedsRestore`.

    Contract (checked by ``tests/test_store_contract.py`` and
    ``tests/test_storage_class.py`` for every store that has it):

    * ``restore(key, days=, tier=)`` asks for a temporary readable copy for
      ``days`` days at retrieval ``tier`` (``"Standard"``, ``"Bulk"``,
      ``"Expedited"``) and says where that stands (:data:`RestoreState`);
      an object that needs no restore is ``"ready"``. Idempotent. Raises
      :class:`~.errors.NotFound` for a missing object.
    """

    def restore(self, key: str, *, days: int = 1, tier: str = "Standard") -> RestoreState: ...


#: S3's limits on object tags (per object, key and value lengths).
MAX_TAGS = 10
MAX_TAG_KEY = 128
MAX_TAG_VALUE = 256


@runtime_checkable
class Taggable(Protocol):
    """A store that can tag objects (S3), so that the store's own lifecycle
    rules can act on exactly the objects ckptier marked.

    Contract (checked by ``tests/test_store_tagging.py`` for every taggable
    store and wrapper):

    * ``put_object_tagging(key, tags)`` adds ``tags`` to the object's tag
      set: tags with other keys stay, a key already there takes the new
      value. Idempotent. Raises :class:`~.errors.NotFound` for a missing
      object, :class:`~.errors.InvalidKey` for an unsafe key, and
      :class:`~.errors.ConfigError` (before any request) when the result
      would break S3's limits (:func:`tags_problem`).
    * ``get_object_tagging(key)`` returns the object's tags as a dict
      (empty when it has none); raises ``NotFound`` for a missing object.
    """

    def put_object_tagging(self, key: str, tags: Mapping[str, str]) -> None: ...

    def get_object_tagging(self, key: str) -> dict[str, str]: ...


#: Every optional capability a store may have, beyond :class:`Store`.
CAPABILITIES: tuple[type, ...] = (
    Canary, MultipartUploads, TempFiles, LocalPaths, ListingSkips, DirectoryStamps, ResumableReads, StorageClasses,
    Restorable, Taggable, BucketLocation, ProvenDeletes,
)


def tags_problem(tags: Mapping[str, str]) -> str | None:
    """Why ``tags`` cannot be an S3 object's tag set, or None: at most
    :data:`MAX_TAGS` tags, keys of 1-128 and values of 0-256 characters,
    none starting with the reserved ``aws:``."""
    if len(tags) > MAX_TAGS:
        return f"{len(tags)} tags: S3 allows at most {MAX_TAGS} per object"
    for k, v in tags.items():
        if not isinstance(k, str) or not isinstance(v, str):
            return f"tag {k!r}={v!r}: keys and values must be strings"
        if not 1 <= len(k) <= MAX_TAG_KEY or len(v) > MAX_TAG_VALUE:
            return f"tag {k!r}: keys must be 1-{MAX_TAG_KEY} characters and values at most {MAX_TAG_VALUE}"
        if k.lower().startswith("aws:"):
            return f"tag {k!r}: the aws: prefix is reserved by AWS"
    return None


class ReaderOver(io.RawIOBase):
    """A read-only binary stream over another stream (``inner``) whose
    subclasses implement only ``read``; ``readinto``/``readall`` go through
    it and ``close`` closes ``inner`` too.
    """

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self._inner = inner

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:  # pragma: no cover - abstract
        raise NotImplementedError

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            try:
                self._inner.close()
            finally:
                super().close()


def key_problem(key: str) -> str | None:
    """Return why ``key`` is unsafe as a store key, or ``None`` when it is fine."""
    if not key:
        return "key is empty"
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return f"key {key.encode('utf-8', 'surrogateescape')!r} is not valid UTF-8"
    if "\x00" in key:
        return f"key {key!r} contains a NUL byte"
    if key.startswith("/"):
        return f"key {key!r} is absolute"
    if "\\" in key:
        return f"key {key!r} contains a backslash"
    if key.endswith("/"):
        return f"key {key!r} ends with '/' (a directory marker, not an object)"
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return f"key {key!r} has an empty, '.' or '..' segment"
    return None


def validate_key(key: str) -> str:
    """Return ``key`` unchanged or raise :class:`InvalidKey` saying why."""
    problem = key_problem(key)
    if problem is not None:
        raise InvalidKey(f"{problem}; store keys are relative, '/'-separated UTF-8 paths", key=key)
    return key


def join_key(*parts: str) -> str:
    """Join key parts with ``/``, ignoring empty parts and stray slashes."""
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


def is_single_file(prefix: str, record: CheckpointRecord) -> bool:
    """True when ``prefix`` is the key of the checkpoint's only file (Lightning-style)."""
    return len(record.files) == 1 and prefix.rsplit("/", 1)[-1] == record.files[0].relpath


def file_key(prefix: str, record: CheckpointRecord, relpath: str) -> str:
    """The store key of ``relpath``: ``prefix/relpath``, or ``prefix`` itself for a single-file checkpoint."""
    return prefix if is_single_file(prefix, record) else join_key(prefix, relpath)


def read_bytes(store: Store, key: str, *, limit: int | None = None) -> bytes:
    """Read a whole (small) object. With ``limit``, refuse objects larger than it.

    Used for marker and metadata files; raises ``ValueError`` naming the key
    when the object exceeds ``limit`` bytes, so a huge file mistaken for
    metadata cannot exhaust memory.
    """
    with store.open_read(key) as fh:
        if limit is None:
            return fh.read()
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{key}: larger than {limit} bytes, too large for a metadata file")
    return data


def as_stream(data: bytes | BinaryIO) -> BinaryIO:
    """Wrap ``bytes`` in a stream; return streams unchanged."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return io.BytesIO(bytes(data))
    return data


def whole_seconds(mtime: float) -> float:
    """An S3 object's mtime as ckptier records it: truncated to whole seconds.

    HEAD's ``Last-Modified`` header (an HTTP date) has whole seconds while a
    listing's or an inventory report's ``LastModified`` may carry
    milliseconds (Ceph RGW sends them; AWS lists ``.000``). Truncated in every
    path, a listing, an inventory and a HEAD of the same object agree, so a
    scan's mtime never looks changed to a later stat.
    """
    return float(int(mtime))
