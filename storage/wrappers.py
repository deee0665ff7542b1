"""Stores that wrap a store: retry, dry-run.

Each implements the :class:`~.base.Store` protocol itself and passes other
attributes (``list_multipart_uploads``, ``bucket``, ...) through to the
wrapped store, except :class:`DryRunStore`, which passes through only what
cannot change anything.
"""

from __future__ import annotations

import io
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from .base import DeleteResult, ObjectInfo, Store, key_problem, validate_key
from .errors import AlreadyExists, DeleteInterrupted, NotFound, StoreError, is_transient


class _Delegating:
    """Passes unknown attributes through to ``inner``."""

    inner: Store

    @property
    def url(self) -> str:
        return self.inner.url

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"


class RetryingStore(_Delegating):
    """Retries calls that fail with a transient error (:func:`is_transient`).

    Up to ``attempts`` tries per call, sleeping ``uniform(0, min(max_delay,
    base_delay * 2**n))`` seconds (full jitter) between them; the last error
    is raised unchanged. Non-transient errors (missing object, denied,
    ``AlreadyExists``) are raised at once.

    * ``list`` restarts a listing that failed part-way and skips keys already
      yielded, so each key is still yielded once.
    * ``open_read`` retries the open, not reads of the returned stream.
    * ``write`` retries only when ``data`` is bytes or a seekable stream (it
      seeks back to where it started); a one-shot stream is tried once. A
      retried ``if_absent`` write whose first try landed unacknowledged
      raises ``AlreadyExists``: the caller must compare the object.
    * ``delete_many`` retries only the keys a failed call did not confirm
      (those not in the ``result`` of its :class:`DeleteInterrupted`);
      deletes are idempotent. When it gives up it raises
      ``DeleteInterrupted`` with everything confirmed over all tries.
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
    ) -> None:
        if attempts < 1:
            raise ValueError(f"attempts={attempts} must be at least 1")
        self.inner = inner
        self.attempts = attempts
        self.base_delay = base_delay
        self.max_delay = max_delay
        self._sleep = sleep
        self._rng = rng

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (0-based)."""
        return self._rng() * min(self.max_delay, self.base_delay * (1 << retry))

    def _run(self, fn: Callable[[], Any], *, retryable: bool = True) -> Any:
        for attempt in range(self.attempts):
            try:
                return fn()
            except Exception as exc:
                if not retryable or not is_transient(exc) or attempt + 1 >= self.attempts:
                    raise
                self._sleep(self.delay(attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        seen: set[str] = set()
        for attempt in range(self.attempts):
            try:
                for info in self.inner.list(prefix):
                    if info.key not in seen:
                        seen.add(info.key)
                        yield info
                return
            except Exception as exc:
                if not is_transient(exc) or attempt + 1 >= self.attempts:
                    raise
                self._sleep(self.delay(attempt))

    def stat(self, key: str) -> ObjectInfo:
        return self._run(lambda: self.inner.stat(key))  # type: ignore[no-any-return]

    def open_read(self, key: str) -> BinaryIO:
        return self._run(lambda: self.inner.open_read(key))  # type: ignore[no-any-return]

    def write(self, key: str, data: bytes | BinaryIO, *, if_absent: bool = False) -> ObjectInfo:
        if isinstance(data, (bytes, bytearray, memoryview)):
            return self._run(lambda: self.inner.write(key, data, if_absent=if_absent))  # type: ignore[no-any-return]
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

        return self._run(attempt, retryable=seekable)  # type: ignore[no-any-return]

    def delete_many(self, keys: Sequence[str]) -> DeleteResult:
        result = DeleteResult()
        remaining = list(keys)
        for attempt in range(self.attempts):
            try:
                result.merge(self.inner.delete_many(remaining))
                return result
            except DeleteInterrupted as exc:
                result.merge(exc.result)
                done = set(exc.result.deleted) | set(exc.result.failed)
                remaining = [k for k in remaining if k not in done]
                error = exc.error
            except StoreError as exc:  # a store that stopped without saying what it confirmed
                error = exc
            if not is_transient(error) or attempt + 1 >= self.attempts:
                raise DeleteInterrupted(error, result) from error
            self._sleep(self.delay(attempt))
        raise AssertionError("unreachable")  # pragma: no cover


@dataclass(frozen=True, slots=True)
class IntendedWrite:
    """A write a :class:`DryRunStore` did not do: key, size in bytes, if_absent."""

    key: str
    size: int
    if_absent: bool


class DryRunStore(_Delegating):
    """Reads pass through; writes and deletes are only recorded.

    ``write`` validates the key, measures the data (reading a stream to EOF
    unless it is seekable), checks ``if_absent`` against the real store, and
    returns the :class:`ObjectInfo` a real write would (without ``mtime``,
    ``etag`` or ``checksum``). ``delete_many`` reports every safe key as
    deleted (``markers_only`` stays empty: a dry run cannot know) and unsafe
    keys as failed. ``abort_multipart`` is recorded in ``intended_aborts``, and
    ``put_object_tagging`` (when the wrapped store can tag) in ``intended_tags``;
    ``canary`` does nothing. Of other attributes only the read-only ones in
    :attr:`PASS_THROUGH` reach the wrapped store.
    """

    PASS_THROUGH = frozenset(
        {"list_multipart_uploads", "versioning_enabled", "get_object_tagging", "bucket", "prefix", "root", "endpoint"}
    )

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.intended_writes: list[IntendedWrite] = []
        self.intended_deletes: list[str] = []
        self.intended_aborts: list[tuple[str, str]] = []
        self.intended_tags: list[tuple[str, dict[str, str]]] = []

    def __getattr__(self, name: str) -> Any:
        if name in DryRunStore.PASS_THROUGH:
            return getattr(self.inner, name)
        if name == "put_object_tagging":
            getattr(self.inner, name)  # AttributeError when the wrapped store cannot tag
            return self._record_tagging
        raise AttributeError(f"DryRunStore does not pass {name!r} through: it might change the store")

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

    def abort_multipart(self, key: str, upload_id: str) -> None:
        self.intended_aborts.append((key, upload_id))

    def canary(self) -> None:
        """Nothing to prove: a dry run never writes or deletes."""

    def _record_tagging(self, key: str, tags: Any) -> None:
        """``put_object_tagging`` of a taggable wrapped store: recorded in ``intended_tags``."""
        validate_key(key)
        self.intended_tags.append((key, dict(tags)))


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
