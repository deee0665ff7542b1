"""The few exceptions that cross the storage boundary.

Backends translate their native errors (``OSError``, ``botocore`` client
errors, ...) into these classes and keep the original as ``__cause__``. Code
above ``storage/`` catches only these. ``is_transient`` is the single place
that decides what a caller (a Prefect task's retry policy, say) may retry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .records import DeleteResult


class CkptierError(Exception):
    """Base of every error ckptier raises on purpose.

    The message is one line meant for a person: it names the thing, the
    value and what to do. The command line prints it without a traceback.
    """


class ConfigError(CkptierError, ValueError):
    """A setting, URL or file the user gave is wrong."""


class StoreError(CkptierError):
    """An object store could not do what was asked."""

    def __init__(self, message: str, *, url: str | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.key = key


class NotFound(StoreError):
    """The object, bucket or directory does not exist."""


class AlreadyExists(StoreError):
    """A conditional create found the object already there (HTTP 412)."""


class AccessDenied(StoreError):
    """Credentials are missing, wrong or lack permission."""


class Unavailable(StoreError):
    """The store is unreachable, throttling (SlowDown) or failing with 5xx.

    The only storage error that is worth retrying.
    """


class InvalidKey(StoreError):
    """A key is unsafe or malformed: not UTF-8, absolute, or contains ``..``."""


class IntegrityError(StoreError):
    """Bytes read back do not match what was expected (size or checksum)."""


class ObjectChanged(StoreError):
    """An object was replaced while it was being read, so a read that broke off
    cannot go on where it stopped (the bytes would mix two versions); read it
    again from the start. Not transient in the retry sense: resuming again
    fails the same way."""


class NeedsRestore(StoreError):
    """The object sits in a storage class that must be restored before it can be read
    (S3 ``GLACIER``, ``DEEP_ARCHIVE``). ``storage_class`` names it when the store said.

    Not transient in the retry sense: reading again fails the same way until a
    restore (:meth:`~.base.Restorable.restore`) has finished, hours later.
    """

    def __init__(
        self, message: str, *, url: str | None = None, key: str | None = None, storage_class: str | None = None
    ) -> None:
        super().__init__(message, url=url, key=key)
        self.storage_class = storage_class


class DeleteInterrupted(StoreError):
    """A batch delete (:meth:`~.base.Store.delete_many`) stopped part-way: a whole batch failed.

    ``result`` (a :class:`~.records.DeleteResult`) holds what the store confirmed
    before it stopped: keys deleted, keys it refused one by one; no key of
    the failed batch or of a later one is in it. ``error`` (also the
    ``__cause__``) is the :class:`StoreError` that stopped it
    (:class:`Unavailable` when the store was throttling or unreachable); the
    message is ``error``'s. Deletes are idempotent: deleting the keys that are
    not in ``result`` again finishes the work.
    """

    def __init__(self, error: StoreError, result: DeleteResult) -> None:
        super().__init__(str(error), url=error.url, key=error.key)
        self.error = error
        self.result = result

    def __reduce__(self) -> tuple[type[DeleteInterrupted], tuple[StoreError, DeleteResult]]:
        return type(self), (self.error, self.result)


def is_transient(exc: BaseException) -> bool:
    """Return True when retrying the operation that raised ``exc`` may succeed.

    Only :class:`Unavailable` is transient, and a :class:`DeleteInterrupted`
    whose ``error`` is. Everything else (a missing object, wrong credentials,
    a failed precondition, corrupt bytes) will fail the same way again and
    must not be retried blindly.
    """
    if isinstance(exc, DeleteInterrupted):
        return is_transient(exc.error)
    return isinstance(exc, Unavailable)
