"""The few exceptions that cross the storage boundary.

Backends translate their native errors (``OSError``, ``botocore`` client
errors, ...) into these classes and keep the original as ``__cause__``. Code
above ``storage/`` catches only these. ``is_transient`` is the single place
that decides what a caller (a Prefect task's retry policy, say) may retry.
"""

from __future__ import annotations

import errno as _errno
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import DeleteResult


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


class NotFollowed(NotFound):
    """A symlink (or a file) stands where a directory on the way to the key
    should be: nothing is followed through it, so the object cannot be told
    apart from absent. Not evidence that the bytes are gone (a directory may
    have been moved and linked back): it proves nothing either way."""


class AlreadyExists(StoreError):
    """A conditional create found the object already there (HTTP 412)."""


class AccessDenied(StoreError):
    """Credentials are missing, wrong or lack permission."""


class EnvironmentFault(StoreError):
    """The machine refused an operation for a reason of its own: no space left,
    a quota, a read-only filesystem, no permission, a missing directory on the
    way, a file-size limit, too many open files, another filesystem. Not bad
    data and not a bug: the message names the path and the fix, and the
    command line exits 1. ``errno`` is the system's code."""

    def __init__(self, message: str, *, errno: int | None = None, url: str | None = None,
                 key: str | None = None) -> None:
        super().__init__(message, url=url, key=key)
        self.errno = errno


class PermissionFault(AccessDenied, EnvironmentFault):
    """A local file or directory this process may not read or write (``EACCES``, ``EPERM``)."""


#: errno -> (what happened, what to do), for :func:`environment_fault`.
_ENVIRONMENT = {
    _errno.ENOSPC: ("no space left on the device", "free space there or use another location"),
    _errno.EDQUOT: ("disk quota exceeded", "free space under your quota or use another location"),
    _errno.EROFS: ("read-only filesystem", "remount it read-write or use another location"),
    _errno.EFBIG: ("file too large for the filesystem or for this process's file-size limit",
                   "raise 'ulimit -f' or use another filesystem"),
    _errno.EXDEV: ("on another filesystem than the directory it was staged in",
                   "use a location on one filesystem"),
    _errno.EMFILE: ("too many open files in this process", "raise 'ulimit -n'"),
    _errno.ENFILE: ("too many open files on this machine", "close files elsewhere or raise fs.file-max"),
    _errno.EACCES: ("permission denied", "check the owner and mode of it and of its directories"),
    _errno.EPERM: ("operation not permitted", "check the owner, mode and mount options"),
    _errno.ENOENT: ("a directory on the way does not exist, or the filesystem cannot hold it",
                    "create the directory first or use another location"),
    _errno.ENOTDIR: ("a component of the path is not a directory", "check the path"),
    _errno.ENAMETOOLONG: ("name too long for the filesystem", "use a shorter path"),
    _errno.EIO: ("input/output error", "check the disk and the mount, then retry"),
    _errno.ENXIO: ("no such device", "use a location on a regular filesystem"),
}


def environment_fault(exc: BaseException, path: str, *, doing: str = "") -> EnvironmentFault | None:
    """``exc`` (an ``OSError``) as the one-line :class:`EnvironmentFault` it
    is — naming ``path``, what the system said and the fix — or None when it
    is not one of the machine's own refusals (:data:`_ENVIRONMENT`)."""
    code = getattr(exc, "errno", None)
    if not isinstance(exc, OSError) or code not in _ENVIRONMENT:
        return None
    what, fix = _ENVIRONMENT[code]
    where = f"cannot {doing} {path}" if doing else path
    cls = PermissionFault if code in (_errno.EACCES, _errno.EPERM) else EnvironmentFault
    return cls(f"{where}: {what} ({exc.strerror or exc}); {fix}", errno=code)


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

    ``result`` (a :class:`~.base.DeleteResult`) holds what the store confirmed
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
