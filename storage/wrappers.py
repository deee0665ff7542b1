"""Stores that wrap a store: retry, dry-run.

Each implements the :class:`~.base.Store` protocol itself and, of the
optional capabilities (:data:`~.base.CAPABILITIES`), exactly those the
wrapped store has: ``isinstance(wrapper, Capability)`` is true when and only
when ``isinstance(wrapper.inner, Capability)`` is. Each capability is
forwarded by a method written out for it (retried by :class:`RetryingStore`,
recorded instead of done by :class:`DryRunStore` where it would change
something); nothing else of the wrapped store shows through.

How: a wrapper class maps each capability to a subclass of itself that adds
that capability's methods (:attr:`_Wrapper.FORWARDS`); constructing a
wrapper picks the subclasses for the capabilities ``inner`` has and makes an
instance of their combination (one class per combination, cached).
"""

from __future__ import annotations

import contextlib
import io
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO, ClassVar, Self, TypeVar, cast

from .base import (
    BucketLocation,
    Canary,
    DeleteResult,
    DirectoryStamps,
    ListingSkips,
    LocalPaths,
    MultipartUploads,
    ObjectInfo,
    ProvenDeletes,
    ReaderOver,
    Restorable,
    RestoreState,
    ResumableReads,
    StorageClasses,
    Store,
    Taggable,
    TempFiles,
    WalkedDirs,
    key_problem,
    validate_key,
)
from .errors import AlreadyExists, DeleteInterrupted, NotFound, StoreError, is_transient

T = TypeVar("T")


class _Wrapper:
    """A store around ``inner``, with exactly the capabilities ``inner`` has.

    Subclasses set :attr:`FORWARDS` (capability protocol -> the subclass of
    themselves that forwards it) and :meth:`rewrap` (the same wrapper, same
    settings, around another store: what ``in_class`` returns).
    """

    #: Capability protocol -> subclass adding its methods; filled in after the subclasses exist.
    FORWARDS: ClassVar[Mapping[type, type[_Wrapper]]] = {}
    #: On a combined class: the wrapper class it was made from (else None).
    _origin: ClassVar[type[_Wrapper] | None] = None

    inner: Store

    def __new__(cls, inner: Store, *args: Any, **kwargs: Any) -> Self:
        if cls._origin is not None:
            raise TypeError(f"construct {cls._origin.__name__}, not one of its combined classes")
        forwards = tuple(sub for cap, sub in cls.FORWARDS.items() if isinstance(inner, cap))
        combined: type[_Wrapper] = _combined(cast(type[_Wrapper], cls), forwards)
        return cast(Self, super().__new__(combined))

    @classmethod
    def origin(cls) -> type[Self]:
        """The wrapper class to construct for another store (``type(self)`` is a combination)."""
        return cast(type[Self], cls._origin or cls)

    @property
    def url(self) -> str:
        return self.inner.url

    def rewrap(self, inner: Store) -> Self:  # pragma: no cover - every wrapper overrides it
        """This wrapper, with the same settings, around ``inner``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"


#: (wrapper class, forwarding classes) -> their combination, made once.
_COMBINED: dict[tuple[type[_Wrapper], tuple[type[_Wrapper], ...]], type[_Wrapper]] = {}


def _combined(cls: type[_Wrapper], forwards: tuple[type[_Wrapper], ...]) -> type[_Wrapper]:
    """``cls`` with the methods of each class in ``forwards``, named like ``cls``.

    The classes in ``forwards`` subclass the wrapper class whose ``FORWARDS``
    they come from: ``cls`` itself, or a class ``cls`` derives from (then
    ``cls`` goes first, so that its own methods win)."""
    if not forwards:
        return cls
    made = _COMBINED.get((cls, forwards))
    if made is None:
        bases = forwards if all(issubclass(f, cls) for f in forwards) else (cls, *forwards)
        made = type(cls.__name__, bases, {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                          "__doc__": cls.__doc__, "_origin": cls})
        made = _COMBINED.setdefault((cls, forwards), made)  # two threads at once: one class wins
    return made


class _ForwardBucketLocation(_Wrapper):
    """:class:`BucketLocation` through any wrapper: read-only facts of the
    inner store, and ``in_bucket`` wrapped again with the same settings.
    Placed after the wrapper class in a forwarding class's bases, so that the
    wrapper's own :meth:`rewrap` is the one called."""

    @property
    def bucket(self) -> str:
        return cast(BucketLocation, self.inner).bucket

    @property
    def prefix(self) -> str:
        return cast(BucketLocation, self.inner).prefix

    def in_bucket(self, bucket: str) -> Store:
        return cast(Store, self.rewrap(cast(BucketLocation, self.inner).in_bucket(bucket)))  # a wrapper is a Store


class RetryingStore(_Wrapper):
    """Retries calls that fail with a transient error (:func:`is_transient`)
    and resumes work that a transient error cut off part-way.

    Up to ``attempts`` tries per call, sleeping ``uniform(0, min(max_delay,
    base_delay * 2**n))`` seconds (full jitter) between them; the last error
    is raised unchanged. Non-transient errors (missing object, denied,
    ``AlreadyExists``) are raised at once.

    * ``list`` restarts a listing that failed part-way and skips keys already
      yielded, so each key is still yielded once.
    * ``open_read`` retries the open. Where the wrapped store has
      :class:`~.base.ResumableReads`, a read of the returned stream that
      fails goes on from the byte where it stopped, on the same version of
      the object (:class:`~.errors.ObjectChanged` when it was replaced).
    * ``write`` retries only when ``data`` is bytes or a seekable stream (it
      seeks back to where it started); a one-shot stream is tried once. A
      retried ``if_absent`` write whose first try landed unacknowledged
      raises ``AlreadyExists``: the caller must compare the object.
    * ``delete_many`` retries only the keys a failed call did not confirm
      (those not in the ``result`` of its :class:`DeleteInterrupted`);
      deletes are idempotent. When it gives up it raises
      ``DeleteInterrupted`` with everything confirmed over all tries.

    With ``resume_only`` (what :func:`resuming` builds, for stores whose
    backend already retries each request: botocore does), a call that fails
    before it made any progress is not tried again, so retries never
    multiply: only work cut off part-way goes on, each time after new
    progress — a listing that had yielded new keys, a stream that had
    returned new bytes, a batch delete that had confirmed a batch.

    Capabilities of the wrapped store are retried like single calls (all of
    them are idempotent), ``list_with_skips`` and ``list_pruned`` like
    ``list`` (each skipped entry and each link is told once), and
    ``in_class`` and ``in_bucket`` give a ``RetryingStore`` with the same
    settings; ``local_path``, ``bucket`` and ``prefix`` do no I/O and are
    passed on.
    """

    def __init__(
        self,
        inner: Store,
        *,
        attempts: int = 5,
        base_delay: float = 0.2,
        max_delay: float = 5.0,
        sleep: Callable[[float], None] = time.sleep,
        rng: Callable[[], float] = random.random,
        resume_only: bool = False,
    ) -> None:
        if attempts < 1:
            raise ValueError(f"attempts={attempts} must be at least 1")
        self.inner = inner
        self.attempts = attempts
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.resume_only = resume_only
        self._sleep = sleep
        self._rng = rng

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (0-based)."""
        return self._rng() * min(self.max_delay, self.base_delay * (1 << retry))

    def rewrap(self, inner: Store) -> Self:
        return self.origin()(inner, attempts=self.attempts, base_delay=self.base_delay, max_delay=self.max_delay,
                             sleep=self._sleep, rng=self._rng, resume_only=self.resume_only)

    def again(self, exc: BaseException, failures: int, *, progressed: bool) -> bool:
        """Whether to try again after failure number ``failures`` (1-based) raised ``exc``,
        having made progress since the previous try or not; sleeps first when so."""
        if not is_transient(exc) or failures >= self.attempts or (self.resume_only and not progressed):
            return False
        self._sleep(self.delay(failures - 1))
        return True

    def _run(self, fn: Callable[[], T], *, retryable: bool = True) -> T:
        failures = 0
        while True:
            try:
                return fn()
            except Exception as exc:
                failures += 1
                if not retryable or not self.again(exc, failures, progressed=False):
                    raise

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self._listing(lambda: self.inner.list(prefix))

    def _listing(self, start: Callable[[], Iterator[ObjectInfo]]) -> Iterator[ObjectInfo]:
        """The listing ``start()`` begins, started again after a transient failure, each key yielded once.

        The first try only appends each key to a list (a first scan passes a
        million through here); the set that filters a restarted listing is
        made from that list once a try has failed.
        """
        given: list[str] = []  # the keys yielded by the first try
        seen: set[str] | None = None  # every key yielded, once a try has failed
        failures = 0
        while True:
            progressed = False
            try:
                if seen is None:
                    for info in start():
                        given.append(info.key)
                        yield info
                else:
                    for info in start():
                        if info.key not in seen:
                            seen.add(info.key)
                            progressed = True
                            yield info
                return
            except Exception as exc:
                failures += 1
                if seen is None:
                    progressed = bool(given)
                    seen = set(given)
                    given = []
                if not self.again(exc, failures, progressed=progressed):
                    raise

    def stat(self, key: str) -> ObjectInfo:
        return self._run(lambda: self.inner.stat(key))

    def open_read(self, key: str) -> BinaryIO:
        inner = self.inner
        if isinstance(inner, ResumableReads):
            stream, version = self._run(lambda: inner.open_versioned(key))
            return _ResumingReader(self, inner, key, stream, version)  # type: ignore[return-value]
        return self._run(lambda: inner.open_read(key))

    def write(self, key: str, data: bytes | BinaryIO, *, if_absent: bool = False) -> ObjectInfo:
        if isinstance(data, (bytes, bytearray, memoryview)):
            return self._run(lambda: self.inner.write(key, data, if_absent=if_absent))
        seekable = False
        start = 0
        try:
            seekable = bool(data.seekable())
            start = data.tell() if seekable else 0
        except (AttributeError, OSError, ValueError):
            seekable = False

        def attempt() -> ObjectInfo:
            if seekable:
                data.seek(start)
            return self.inner.write(key, data, if_absent=if_absent)

        return self._run(attempt, retryable=seekable)

    def delete_many(self, keys: Sequence[str]) -> DeleteResult:
        return self._deletes(self.inner.delete_many, keys, str)

    def _deletes(self, call: Callable[[Sequence[T]], DeleteResult], items: Sequence[T],
                 key_of: Callable[[T], str]) -> DeleteResult:
        """``call(items)``, resent after a transient interruption with only the
        items the store did not report on (see :meth:`delete_many`)."""
        result = DeleteResult()
        remaining = items
        failures = 0
        while True:
            try:
                result.merge(call(remaining))
                return result
            except DeleteInterrupted as exc:
                result.merge(exc.result)
                done = set(exc.result.deleted) | set(exc.result.failed) | set(exc.result.changed)
                remaining = [i for i in remaining if key_of(i) not in done]
                error, progressed = exc.error, bool(done)
            except StoreError as exc:  # a store that stopped without saying what it confirmed
                error, progressed = exc, False
            failures += 1
            if not self.again(error, failures, progressed=progressed):
                raise DeleteInterrupted(error, result) from error


def resuming(store: Store) -> Store:
    """``store`` as every operation of a run uses it: a :class:`RetryingStore` with ``resume_only``.

    Each request is already retried where it is made (botocore's standard
    mode, 5 attempts, for S3), so single calls are not tried again here:
    that would multiply the attempts against a store that is down or
    throttling. What this adds is going on with work a failure cut off
    part-way, which no request-level retry does: a listing that failed
    mid-pagination is started again (yielding only keys not yet yielded), a
    read whose connection broke goes on from the byte where it stopped (same
    version of the object), a batch delete resends only what was not
    confirmed.
    """
    return RetryingStore(store, resume_only=True)


class _ResumingReader(ReaderOver):
    """A stream of ``key`` that, when a read fails with a transient error, opens
    the same version of the object again from the byte where it stopped
    (:meth:`~.base.ResumableReads.open_from`) and goes on; ``retrying``
    decides whether (:meth:`RetryingStore.again`) and how long to wait."""

    def __init__(self, retrying: RetryingStore, store: ResumableReads, key: str, stream: BinaryIO,
                 version: str) -> None:
        super().__init__(stream)
        self._retrying, self._store, self._key, self._version = retrying, store, key, version
        self._pos = 0

    def read(self, size: int | None = -1) -> bytes:
        failures = 0
        progressed = True  # the open itself
        while True:
            try:
                data = self._inner.read(-1 if size is None else size)
            except Exception as exc:
                failures += 1
                if not self._retrying.again(exc, failures, progressed=progressed):
                    raise
                self._reopen()
                progressed = False
                continue
            self._pos += len(data)
            return bytes(data)

    def _reopen(self) -> None:
        with contextlib.suppress(Exception):  # the broken stream's close may fail too; it is discarded
            self._inner.close()
        self._inner = self._retrying._run(lambda: self._store.open_from(self._key, self._pos, self._version))


class _RetryingCanary(RetryingStore):
    def canary(self) -> None:
        self._run(cast(Canary, self.inner).canary)


class _RetryingMultipartUploads(RetryingStore):
    def list_multipart_uploads(self, prefix: str = "") -> list[tuple[str, str, datetime]]:
        inner = cast(MultipartUploads, self.inner)
        return self._run(lambda: inner.list_multipart_uploads(prefix))

    def abort_multipart(self, key: str, upload_id: str) -> None:
        inner = cast(MultipartUploads, self.inner)
        self._run(lambda: inner.abort_multipart(key, upload_id))


class _RetryingTempFiles(RetryingStore):
    def stale_temp_files(self, older_than: float) -> list[str]:
        inner = cast(TempFiles, self.inner)
        return self._run(lambda: inner.stale_temp_files(older_than))

    def remove_temp_file(self, key: str) -> None:
        inner = cast(TempFiles, self.inner)
        self._run(lambda: inner.remove_temp_file(key))


class _RetryingLocalPaths(RetryingStore):
    def local_path(self, key: str) -> Path:
        return cast(LocalPaths, self.inner).local_path(key)


class _RetryingListingSkips(RetryingStore):
    def list_with_skips(self, prefix: str, on_skip: Callable[[str, str], None]) -> Iterator[ObjectInfo]:
        inner = cast(ListingSkips, self.inner)
        told: set[str] = set()

        def once(key: str, why: str) -> None:
            if key not in told:
                told.add(key)
                on_skip(key, why)

        return self._listing(lambda: inner.list_with_skips(prefix, once))


class _RetryingDirectoryStamps(RetryingStore):
    def take_stamp(self, key: str, relpaths: Iterable[str], *, changed_before: float,
                   walked: WalkedDirs | None = None) -> tuple[str, tuple[str, ...]] | None:
        inner = cast(DirectoryStamps, self.inner)
        paths = tuple(relpaths)  # read again by a retry
        return self._run(lambda: inner.take_stamp(key, paths, changed_before=changed_before, walked=walked))

    def check_stamp(self, key: str, dirs: Sequence[str]) -> str | None:
        inner = cast(DirectoryStamps, self.inner)
        return self._run(lambda: inner.check_stamp(key, dirs))

    def list_pruned(self, prefix: str, skip_dir: Callable[[str], bool], on_skip: Callable[[str, str], None],
                    on_link: Callable[[str], None], walked: WalkedDirs | None = None) -> Iterator[ObjectInfo]:
        inner = cast(DirectoryStamps, self.inner)
        told: set[str] = set()
        linked: set[str] = set()

        def skip_once(key: str, why: str) -> None:
            if key not in told:
                told.add(key)
                on_skip(key, why)

        def link_once(key: str) -> None:
            if key not in linked:
                linked.add(key)
                on_link(key)

        # A listing started again notes each directory again, over the facts of the first try.
        return self._listing(lambda: inner.list_pruned(prefix, skip_dir, skip_once, link_once, walked))


class _RetryingResumableReads(RetryingStore):
    def open_versioned(self, key: str) -> tuple[BinaryIO, str]:
        inner = cast(ResumableReads, self.inner)
        return self._run(lambda: inner.open_versioned(key))

    def open_from(self, key: str, offset: int, version: str) -> BinaryIO:
        inner = cast(ResumableReads, self.inner)
        return self._run(lambda: inner.open_from(key, offset, version))


class _RetryingStorageClasses(RetryingStore):
    @property
    def storage_class(self) -> str | None:
        return cast(StorageClasses, self.inner).storage_class

    def in_class(self, storage_class: str | None) -> Store:
        return self.rewrap(cast(StorageClasses, self.inner).in_class(storage_class))


class _RetryingRestorable(RetryingStore):
    def restore(self, key: str, *, days: int = 1, tier: str = "Standard") -> RestoreState:
        inner = cast(Restorable, self.inner)
        return self._run(lambda: inner.restore(key, days=days, tier=tier))


class _RetryingTaggable(RetryingStore):
    def put_object_tagging(self, key: str, tags: Mapping[str, str]) -> None:
        inner = cast(Taggable, self.inner)
        self._run(lambda: inner.put_object_tagging(key, tags))

    def get_object_tagging(self, key: str) -> dict[str, str]:
        inner = cast(Taggable, self.inner)
        return self._run(lambda: inner.get_object_tagging(key))


class _RetryingProvenDeletes(RetryingStore):
    def delete_proven(self, proven: Sequence[ObjectInfo]) -> DeleteResult:
        inner = cast(ProvenDeletes, self.inner)

        def key_of(info: ObjectInfo) -> str:
            return info.key

        return self._deletes(inner.delete_proven, proven, key_of)


class _RetryingBucketLocation(RetryingStore, _ForwardBucketLocation):
    pass


RetryingStore.FORWARDS = {
    Canary: _RetryingCanary,
    MultipartUploads: _RetryingMultipartUploads,
    TempFiles: _RetryingTempFiles,
    LocalPaths: _RetryingLocalPaths,
    ListingSkips: _RetryingListingSkips,
    DirectoryStamps: _RetryingDirectoryStamps,
    ResumableReads: _RetryingResumableReads,
    StorageClasses: _RetryingStorageClasses,
    Restorable: _RetryingRestorable,
    Taggable: _RetryingTaggable,
    BucketLocation: _RetryingBucketLocation,
    ProvenDeletes: _RetryingProvenDeletes,
}


@dataclass(frozen=True, slots=True)
class IntendedWrite:
    """A write a :class:`DryRunStore` did not do: key, size in bytes, if_absent."""

    key: str
    size: int
    if_absent: bool


class DryRunStore(_Wrapper):
    """Reads pass through; writes, deletes and every other change are only recorded.

    ``write`` validates the key, measures the data (reading a stream to EOF
    unless it is seekable), checks ``if_absent`` against the real store, and
    returns the :class:`ObjectInfo` a real write would (without ``mtime``,
    ``etag`` or ``checksum``). ``delete_many`` reports every safe key as
    deleted (``markers_only`` stays empty: a dry run cannot know) and unsafe
    keys as failed.

    Capabilities of the wrapped store: those that only read pass through
    (``list_multipart_uploads``, ``stale_temp_files``, ``local_path``,
    ``list_with_skips``, ``take_stamp``, ``check_stamp``, ``list_pruned``,
    ``open_versioned``, ``open_from``, ``storage_class``, ``bucket``,
    ``prefix``, ``get_object_tagging``); those
    that would change something are recorded and not done
    (``delete_proven`` into ``intended_deletes``, for keys still the object proven):
    ``abort_multipart`` in ``intended_aborts``, ``remove_temp_file`` in
    ``intended_removals``, ``restore`` in ``intended_restores`` (answering
    ``"requested"``), ``put_object_tagging`` in ``intended_tags``; ``canary``
    does nothing (a dry run writes nothing it would have to prove);
    ``in_class`` and ``in_bucket`` give a dry run of the other class or
    bucket that records into the same lists.
    """

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.intended_writes: list[IntendedWrite] = []
        self.intended_deletes: list[str] = []
        self.intended_aborts: list[tuple[str, str]] = []
        self.intended_removals: list[str] = []
        self.intended_restores: list[tuple[str, int, str]] = []
        self.intended_tags: list[tuple[str, dict[str, str]]] = []

    def rewrap(self, inner: Store) -> Self:
        other = self.origin()(inner)
        other.intended_writes, other.intended_deletes = self.intended_writes, self.intended_deletes
        other.intended_aborts, other.intended_removals = self.intended_aborts, self.intended_removals
        other.intended_restores, other.intended_tags = self.intended_restores, self.intended_tags
        return other

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def stat(self, key: str) -> ObjectInfo:
        return self.inner.stat(key)

    def open_read(self, key: str) -> BinaryIO:
        return self.inner.open_read(key)

    def write(self, key: str, data: bytes | BinaryIO, *, if_absent: bool = False) -> ObjectInfo:
        validate_key(key)
        if if_absent:
            try:
                self.inner.stat(key)
            except NotFound:
                pass
            else:
                raise AlreadyExists(f"{self.url}/{key}: already exists (dry run)", url=self.url, key=key)
        size = _measure(data)
        self.intended_writes.append(IntendedWrite(key, size, if_absent))
        return ObjectInfo(key=key, size=size)

    def delete_many(self, keys: Sequence[str]) -> DeleteResult:
        result = DeleteResult()
        for key in keys:
            problem = key_problem(key)
            if problem is not None:
                result.failed[key] = problem
            else:
                result.deleted.append(key)
                self.intended_deletes.append(key)
        return result


class _DryCanary(DryRunStore):
    def canary(self) -> None:
        """Nothing to prove: a dry run never writes or deletes."""


class _DryMultipartUploads(DryRunStore):
    def list_multipart_uploads(self, prefix: str = "") -> list[tuple[str, str, datetime]]:
        return cast(MultipartUploads, self.inner).list_multipart_uploads(prefix)

    def abort_multipart(self, key: str, upload_id: str) -> None:
        self.intended_aborts.append((key, upload_id))


class _DryTempFiles(DryRunStore):
    def stale_temp_files(self, older_than: float) -> list[str]:
        return cast(TempFiles, self.inner).stale_temp_files(older_than)

    def remove_temp_file(self, key: str) -> None:
        self.intended_removals.append(validate_key(key))


class _DryLocalPaths(DryRunStore):
    def local_path(self, key: str) -> Path:
        return cast(LocalPaths, self.inner).local_path(key)


class _DryListingSkips(DryRunStore):
    def list_with_skips(self, prefix: str, on_skip: Callable[[str, str], None]) -> Iterator[ObjectInfo]:
        return cast(ListingSkips, self.inner).list_with_skips(prefix, on_skip)


class _DryDirectoryStamps(DryRunStore):
    def take_stamp(self, key: str, relpaths: Iterable[str], *, changed_before: float,
                   walked: WalkedDirs | None = None) -> tuple[str, tuple[str, ...]] | None:
        return cast(DirectoryStamps, self.inner).take_stamp(key, relpaths, changed_before=changed_before,
                                                            walked=walked)

    def check_stamp(self, key: str, dirs: Sequence[str]) -> str | None:
        return cast(DirectoryStamps, self.inner).check_stamp(key, dirs)

    def list_pruned(self, prefix: str, skip_dir: Callable[[str], bool], on_skip: Callable[[str, str], None],
                    on_link: Callable[[str], None], walked: WalkedDirs | None = None) -> Iterator[ObjectInfo]:
        return cast(DirectoryStamps, self.inner).list_pruned(prefix, skip_dir, on_skip, on_link, walked)


class _DryResumableReads(DryRunStore):
    def open_versioned(self, key: str) -> tuple[BinaryIO, str]:
        return cast(ResumableReads, self.inner).open_versioned(key)

    def open_from(self, key: str, offset: int, version: str) -> BinaryIO:
        return cast(ResumableReads, self.inner).open_from(key, offset, version)


class _DryStorageClasses(DryRunStore):
    @property
    def storage_class(self) -> str | None:
        return cast(StorageClasses, self.inner).storage_class

    def in_class(self, storage_class: str | None) -> Store:
        return self.rewrap(cast(StorageClasses, self.inner).in_class(storage_class))


class _DryRestorable(DryRunStore):
    def restore(self, key: str, *, days: int = 1, tier: str = "Standard") -> RestoreState:
        self.intended_restores.append((validate_key(key), days, tier))
        return "requested"


class _DryTaggable(DryRunStore):
    def put_object_tagging(self, key: str, tags: Mapping[str, str]) -> None:
        validate_key(key)
        self.intended_tags.append((key, dict(tags)))

    def get_object_tagging(self, key: str) -> dict[str, str]:
        return cast(Taggable, self.inner).get_object_tagging(key)


class _DryProvenDeletes(DryRunStore):
    def delete_proven(self, proven: Sequence[ObjectInfo]) -> DeleteResult:
        """What a real run would delete: each key whose object is still the one
        proven (a ``stat`` now), recorded in ``intended_deletes``; the others in
        ``changed``."""
        result = DeleteResult()
        for info in proven:
            if info.identity is None:
                result.failed[info.key] = "no identity proven (stat it first); not deleted"
                continue
            try:
                now = self.inner.stat(info.key)
            except NotFound:
                result.deleted.append(info.key)
                continue
            if now.identity != info.identity:
                result.changed[info.key] = "not the object proven (dry run)"
                continue
            result.deleted.append(info.key)
            self.intended_deletes.append(info.key)
        return result


class _DryBucketLocation(DryRunStore, _ForwardBucketLocation):
    pass


DryRunStore.FORWARDS = {
    Canary: _DryCanary,
    MultipartUploads: _DryMultipartUploads,
    TempFiles: _DryTempFiles,
    LocalPaths: _DryLocalPaths,
    ListingSkips: _DryListingSkips,
    DirectoryStamps: _DryDirectoryStamps,
    ResumableReads: _DryResumableReads,
    StorageClasses: _DryStorageClasses,
    Restorable: _DryRestorable,
    Taggable: _DryTaggable,
    BucketLocation: _DryBucketLocation,
    ProvenDeletes: _DryProvenDeletes,
}


def _measure(data: bytes | BinaryIO) -> int:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return len(data)
    try:
        if data.seekable():
            here = data.tell()
            end = data.seek(0, io.SEEK_END)
            data.seek(here)
            return end - here
    except (AttributeError, OSError, ValueError):
        pass
    size = 0
    while chunk := data.read(8 << 20):
        size += len(chunk)
    return size
