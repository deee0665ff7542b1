"""A store over any S3-compatible endpoint (AWS, MinIO, Ceph, R2, moto).

Credentials and the endpoint come the standard boto3 way: ``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE`` or a named
profile, the region from the profile or ``AWS_DEFAULT_REGION`` (``us-east-1``
when none is set). botocore retries throttling, 5xx and connection errors in
its ``standard`` mode; whatever still fails leaves this module as one of the
exceptions of :mod:`.errors`, with the botocore error kept as ``__cause__``.

Checksums: by default every write asks S3 to keep a full-object CRC64NVME
checksum (single PUTs and multipart uploads alike), which ``stat`` reports as
``ObjectInfo.checksum``. Some S3-compatible stores reject the newer checksum
headers that boto3 sends by default; for those set
``CKPTIER_S3_CHECKSUMS=when_required`` (or pass ``checksum=None``): boto3 then
sends checksums only where the API requires them and no object checksum is
requested. :meth:`S3Store.canary` detects such stores.

Storage classes: an ``S3Store`` built with ``storage_class`` (or obtained
with :meth:`S3Store.in_class`) sends it on every write, single PutObject and
multipart alike; ``stat`` and ``list`` report each object's class. Reading
an object in a class that needs a restore (``GLACIER``, ``DEEP_ARCHIVE``)
raises :class:`~.errors.NeedsRestore`; :meth:`S3Store.restore` asks for one.
"""

from __future__ import annotations

import builtins
import copy
import functools
import io
import logging
import os
import queue
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any, BinaryIO

from .base import (
    MAX_DELETE_BATCH,
    DeleteResult,
    ObjectInfo,
    ReaderOver,
    RestoreState,
    as_stream,
    key_problem,
    tags_problem,
    validate_key,
    whole_seconds,
)
from .errors import (
    AccessDenied,
    AlreadyExists,
    ConfigError,
    DeleteInterrupted,
    IntegrityError,
    NeedsRestore,
    NotFound,
    ObjectChanged,
    StoreError,
    Unavailable,
)

log = logging.getLogger(__name__)

#: S3's smallest allowed part (all parts but the last), bytes.
MIN_PART_SIZE = 5 << 20
#: S3's largest number of parts in one multipart upload.
MAX_PARTS = 10_000
#: Key prefix (below the store's prefix) used by :meth:`S3Store.canary`.
CANARY_PREFIX = ".ckptier-canary/"
#: A canary object this old was left by a run killed mid-canary (a canary lives for
#: seconds): the next successful canary deletes it. Only canaries write that prefix.
STALE_CANARY_AGE_S = 3600.0
#: Environment variable choosing the checksum behaviour per endpoint.
CHECKSUMS_ENV = "CKPTIER_S3_CHECKSUMS"
#: The storage classes S3 accepts on a write (``OUTPOSTS`` and ``SNOW`` need their own hardware).
STORAGE_CLASSES = (
    "STANDARD", "REDUCED_REDUNDANCY", "STANDARD_IA", "ONEZONE_IA", "INTELLIGENT_TIERING",
    "GLACIER", "DEEP_ARCHIVE", "GLACIER_IR", "EXPRESS_ONEZONE", "OUTPOSTS", "SNOW",
)
#: Classes whose objects must be restored (RestoreObject) before a GET can read them.
#: Threads that list key ranges of one long listing concurrently (``S3Store(list_workers=)``).
LIST_WORKERS = 8
#: Key ranges a long listing is cut into, per listing thread: enough that
#: ranges of unequal size still keep every thread busy to the end.
LIST_RANGES_PER_WORKER = 4
RESTORE_CLASSES = frozenset({"GLACIER", "DEEP_ARCHIVE"})
#: How long a restore usually takes, in hours, by class and retrieval tier (AWS's published
#: upper bounds; a restore started now is usually readable by then).
RESTORE_HOURS: dict[str, dict[str, float]] = {
    "GLACIER": {"Expedited": 0.1, "Standard": 5, "Bulk": 12},
    "DEEP_ARCHIVE": {"Standard": 12, "Bulk": 48},
}


def storage_class_problem(name: object) -> str | None:
    """Why ``name`` is not an S3 storage class ckptier can write to, or None (pure)."""
    if isinstance(name, str) and name in STORAGE_CLASSES:
        return None
    def squash(text: str) -> str:
        return "".join(ch for ch in text.upper() if ch.isalnum())

    close = [c for c in STORAGE_CLASSES if isinstance(name, str) and squash(c) == squash(name)]
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{hint}must be one of {', '.join(STORAGE_CLASSES)}"

def fast_timestamp(value: Any) -> datetime:
    """botocore's timestamp parser, with fast paths for the ``2026-11-30T15:03:29.000Z``
    form S3 uses in listings and the ``Mon, 30 Nov 2026 15:03:29 GMT`` form of its
    ``Last-Modified`` headers (the same instant, an aware UTC datetime, that
    botocore's dateutil-based parser gives: 5 µs instead of 65 µs for a header)."""
    if isinstance(value, str):
        if len(value) >= 20 and value[10] == "T" and value[-1] == "Z":
            try:
                return datetime.fromisoformat(value[:-1] + "+00:00")  # noqa: FURB162 - py3.10 form, explicit
            except ValueError:
                pass
        elif len(value) == 29 and value.endswith(" GMT") and value[3] == ",":
            try:
                return parsedate_to_datetime(value)
            except (TypeError, ValueError):
                pass
    from botocore.utils import parse_timestamp

    return parse_timestamp(value)  # type: ignore[no-any-return]


#: The members of a listed object the fast path of :func:`listing_parser_factory`
#: parses; an object with any other element goes through botocore's own parser.
_OBJECT_TEXT = frozenset({"Key", "ETag", "StorageClass", "ChecksumType"})


@functools.cache
def listing_parser_factory() -> Any:
    """botocore's response parser factory for S3 (``rest-xml``), with a fast path
    for the objects of a listing page, and :func:`fast_timestamp` for timestamps.

    botocore parses each ``<Contents>`` element of a ListObjectsV2 page through
    its generic shape walker (a regex per child tag, a dispatch per member):
    most of a listing's client CPU once timestamps are fast. The fast path
    reads the elements S3 sends for an object (``Key``, ``LastModified``,
    ``ETag``, ``Size``, ``StorageClass``, ``ChecksumAlgorithm``,
    ``ChecksumType``) and builds exactly the dict botocore builds (the same
    types, ``""`` for an empty element, ``ChecksumAlgorithm`` a list); any
    other element (``Owner``, ``RestoreStatus``, one not known yet), a
    repeated one or a nested one sends the object to botocore's parser.
    ``tests/test_s3_listing_parser.py`` compares both on real responses.
    """
    from botocore.parsers import ResponseParserFactory, RestXMLParser

    class ListingParser(RestXMLParser):  # type: ignore[misc]
        def _handle_structure(self, shape: Any, node: Any) -> Any:
            if shape.name == "Object" and not isinstance(node, list):
                parsed = self._listed_object(node)
                if parsed is not None:
                    return parsed
            return super()._handle_structure(shape, node)

        def _listed_object(self, node: Any) -> dict[str, Any] | None:
            out: dict[str, Any] = {}
            for child in node:
                if len(child):
                    return None
                tag = child.tag
                tag = tag[tag.rfind("}") + 1 :]
                text = child.text if child.text is not None else ""
                if tag == "ChecksumAlgorithm":
                    out.setdefault(tag, []).append(text)
                    continue
                if tag in out:
                    return None
                if tag in _OBJECT_TEXT:
                    out[tag] = text
                elif tag == "Size":
                    out[tag] = int(text)
                elif tag == "LastModified":
                    out[tag] = self._timestamp_parser(text)
                else:
                    return None
            return out

    class Factory(ResponseParserFactory):  # type: ignore[misc]
        def create_parser(self, protocol_name: str) -> Any:
            if protocol_name == "rest-xml":
                return ListingParser(**self._defaults)
            return super().create_parser(protocol_name)

    factory = Factory()
    factory.set_parser_defaults(timestamp_parser=fast_timestamp)
    return factory


def _seconds(modified: Any) -> float | None:
    """``LastModified`` (a datetime) as :func:`~.base.whole_seconds`; ``None`` when the server sent none."""
    return whole_seconds(modified.timestamp()) if modified is not None else None


_NOT_FOUND = {"NoSuchKey", "404", "NotFound", "NoSuchVersion"}
_DENIED = {
    "AccessDenied",
    "403",
    "Forbidden",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AllAccessDisabled",
    "InvalidToken",
    "ExpiredToken",
    "TokenRefreshRequired",
}
_UNAVAILABLE = {
    "SlowDown",
    "503",
    "500",
    "502",
    "504",
    "InternalError",
    "ServiceUnavailable",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
}
_PRECONDITION = {"PreconditionFailed", "412", "ConditionalRequestConflict"}
#: Characters a DeleteObjects request (XML 1.0) cannot carry as they are: those XML does not
#: allow (most control characters, U+FFFE, U+FFFF) and the carriage return, which XML parsers
#: turn into a newline. Keys holding one are deleted one by one (the key travels in the URL).
_NOT_XML_SAFE = re.compile("[^\t\n\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _error_code(exc: BaseException) -> tuple[str, int | None]:
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", "") or "")
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code, status


def _read_full(stream: BinaryIO, size: int) -> bytes:
    """Read exactly ``size`` bytes, or fewer only at EOF.

    A short read is not EOF: some stream wrappers return less than asked
    before the end; only an empty read ends the stream.
    """
    first = stream.read(size)
    if not first or len(first) == size:
        return bytes(first or b"")
    chunks = [first]
    got = len(first)
    while got < size:
        chunk = stream.read(size - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class _S3Reader(ReaderOver):
    """A read-only stream over a GetObject body that translates errors.

    Memory stays bounded by the sizes the caller asks for. A checksum
    mismatch found by botocore at the end of the body becomes
    :class:`IntegrityError`; a dropped connection becomes ``Unavailable``.
    """

    def __init__(self, body: Any, store: S3Store, key: str) -> None:
        super().__init__(body)
        self._store = store
        self._key = key

    def read(self, size: int | None = -1) -> bytes:
        if self.closed:
            raise ValueError(f"{self._store.url}/{self._key}: read from a closed stream")
        try:
            if size is None or size < 0:
                return bytes(self._inner.read())
            return bytes(self._inner.read(size))
        except Exception as exc:
            raise self._store._translate(exc, self._key) from exc


class S3Store:
    """Objects under ``s3://bucket/prefix``; keys are relative to ``prefix``.

    ``write`` is atomic per object (S3 makes an object visible only when its
    PUT or CompleteMultipartUpload succeeds). Payloads up to
    ``multipart_threshold`` bytes go in one PutObject; larger or unknown-size
    streams go in a multipart upload whose parts are ``part_size`` bytes
    (doubling every 2,000 parts so that even huge streams fit S3's 10,000
    part limit). Memory use of a write is bounded by about
    ``multipart_threshold`` plus one part. A failed multipart upload is
    aborted (best effort); one left by a killed process is found by
    :meth:`list_multipart_uploads` and removed by :meth:`abort_multipart`.

    Capabilities (:mod:`.base`): :class:`~.base.Canary`,
    :class:`~.base.MultipartUploads`, :class:`~.base.ResumableReads`,
    :class:`~.base.StorageClasses`, :class:`~.base.Restorable`,
    :class:`~.base.Taggable`, :class:`~.base.BucketLocation`,
    :class:`~.base.ProvenDeletes`.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: Any = None,
        profile: str | None = None,
        endpoint_url: str | None = None,
        multipart_threshold: int = 64 << 20,
        part_size: int = 16 << 20,
        checksum: str | None = "CRC64NVME",
        max_attempts: int = 5,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        list_page_size: int = 1000,
        storage_class: str | None = None,
        list_workers: int = LIST_WORKERS,
    ) -> None:
        if storage_class is not None and (problem := storage_class_problem(storage_class)) is not None:
            raise ConfigError(f"storage_class {storage_class!r}: {problem}")
        self.storage_class = storage_class
        if not bucket:
            raise ConfigError("S3 bucket name is empty; use s3://BUCKET/prefix")
        if part_size < MIN_PART_SIZE:
            raise ConfigError(f"part_size={part_size} is below S3's minimum of {MIN_PART_SIZE} bytes; raise it")
        if multipart_threshold < 1:
            raise ConfigError(f"multipart_threshold={multipart_threshold} must be positive")
        mode = os.environ.get(CHECKSUMS_ENV, "").strip().lower()
        if mode not in ("", "when_supported", "when_required"):
            raise ConfigError(f"{CHECKSUMS_ENV}={mode!r} is not valid; use when_supported or when_required")
        if checksum is not None and checksum.upper() != "CRC64NVME":
            raise ConfigError(f"checksum={checksum!r} is not supported; use 'CRC64NVME' or None")
        self.checksums_mode = mode or "when_supported"
        self.checksum: str | None = None if self.checksums_mode == "when_required" else checksum and "CRC64NVME"
        clean = prefix.strip("/")
        if clean:
            problem = key_problem(clean)
            if problem is not None:
                raise ConfigError(f"S3 prefix {prefix!r} is unsafe: {problem}; use a plain path like runs/job1")
        self.bucket = bucket
        self.prefix = clean + "/" if clean else ""
        self.url = f"s3://{bucket}/{clean}" if clean else f"s3://{bucket}"
        self.multipart_threshold = multipart_threshold
        self.list_page_size = list_page_size
        self.list_workers = max(1, list_workers)
        self.part_size = part_size
        #: Whether CompleteMultipartUpload honours ``If-None-Match: *`` here (None: not probed yet; the
        #: canary probes it). Unless True, a multipart ``write(if_absent=True)`` HEAD-checks the key.
        self.conditional_multipart_complete: bool | None = None
        self.client = client if client is not None else self._make_client(
            profile, endpoint_url, max_attempts, connect_timeout, read_timeout
        )
        self.endpoint = str(getattr(getattr(self.client, "meta", None), "endpoint_url", None) or endpoint_url or "AWS")

    def __repr__(self) -> str:
        cls = f", storage_class={self.storage_class!r}" if self.storage_class else ""
        return f"S3Store({self.url!r}, endpoint={self.endpoint!r}{cls})"

    def in_class(self, storage_class: str | None) -> S3Store:
        """This store (same root, same client) with writes going to ``storage_class``
        (``None``: the bucket's default class). Raises ``ConfigError`` for an unknown class."""
        if storage_class is not None and (problem := storage_class_problem(storage_class)) is not None:
            raise ConfigError(f"storage_class {storage_class!r}: {problem}")
        view = copy.copy(self)
        view.storage_class = storage_class
        return view

    def in_bucket(self, bucket: str) -> S3Store:
        """A store at the top of ``bucket`` with this one's client and settings
        (:class:`~.base.BucketLocation`); sends no request."""
        if not bucket:
            raise ConfigError("S3 bucket name is empty; use s3://BUCKET/prefix")
        view = copy.copy(self)
        view.bucket, view.prefix, view.url = bucket, "", f"s3://{bucket}"
        return view

    def _make_client(
        self,
        profile: str | None,
        endpoint_url: str | None,
        max_attempts: int,
        connect_timeout: float,
        read_timeout: float,
    ) -> Any:
        import boto3
        import botocore.exceptions
        import botocore.session
        from botocore.config import Config

        core = botocore.session.get_session()
        # Listing pages carry a LastModified per key; botocore parses each with
        # dateutil (~0.3 ms: most of a listing's client CPU). ISO-8601 in UTC,
        # as S3 writes it, goes through datetime.fromisoformat instead, and
        # each listed object through a fast path (listing_parser_factory).
        core.register_component("response_parser_factory", listing_parser_factory())
        try:
            session = boto3.session.Session(profile_name=profile, botocore_session=core)
        except botocore.exceptions.ProfileNotFound as exc:
            raise ConfigError(
                f"AWS profile {profile or os.environ.get('AWS_PROFILE')!r} not found; "
                "check AWS_PROFILE or ~/.aws/config"
            ) from exc
        custom_endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        options: dict[str, Any] = {
            "retries": {"mode": "standard", "total_max_attempts": max_attempts},
            "connect_timeout": connect_timeout,
            "read_timeout": read_timeout,
            "request_checksum_calculation": self.checksums_mode,
            "response_checksum_validation": self.checksums_mode,
            # Listing threads and the scan's metadata readers share this client.
            "max_pool_connections": 32,
        }
        if custom_endpoint:
            # MinIO, Ceph and most S3-compatible stores need path-style URLs.
            options["s3"] = {"addressing_style": "path"}
        try:
            return session.client(
                "s3",
                endpoint_url=endpoint_url,
                region_name=session.region_name or "us-east-1",
                config=Config(**options),
            )
        except ValueError as exc:  # botocore: "Invalid endpoint: ..."
            source = "endpoint_url" if endpoint_url else (
                "AWS_ENDPOINT_URL_S3" if os.environ.get("AWS_ENDPOINT_URL_S3") else "AWS_ENDPOINT_URL")
            raise ConfigError(
                f"{source}={custom_endpoint!r} is not a valid S3 endpoint URL ({exc}); "
                "write it like http://127.0.0.1:9000 or https://s3.example.com, or unset it for AWS"
            ) from None

    # -- error translation -------------------------------------------------

    def _translate(self, exc: BaseException, key: str | None = None) -> StoreError:
        """Map a botocore exception to one of :mod:`.errors` (caller chains it)."""
        import botocore.exceptions as bex

        if isinstance(exc, StoreError):
            return exc
        where = f"{self.url}/{key}" if key else self.url
        if isinstance(exc, (bex.NoCredentialsError, bex.PartialCredentialsError)):
            return AccessDenied(
                f"{self.url}: no usable S3 credentials ({exc}); set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE",
                url=self.url,
                key=key,
            )
        if isinstance(exc, bex.FlexibleChecksumError):
            return IntegrityError(
                f"{where}: bytes read do not match the object's checksum; retry the read, "
                f"or set {CHECKSUMS_ENV}=when_required if this store mangles checksums",
                url=self.url,
                key=key,
            )
        if isinstance(
            exc,
            (
                bex.EndpointConnectionError,
                bex.ConnectTimeoutError,
                bex.ReadTimeoutError,
                bex.ConnectionClosedError,
                bex.ResponseStreamingError,
                bex.HTTPClientError,
            ),
        ):
            return Unavailable(
                f"{where}: endpoint {self.endpoint} unreachable or timing out ({type(exc).__name__}); "
                "check AWS_ENDPOINT_URL and the network, then retry",
                url=self.url,
                key=key,
            )
        if isinstance(exc, bex.ClientError):
            code, status = _error_code(exc)
            if code == "NoSuchBucket":
                return NotFound(
                    f"s3://{self.bucket}: bucket does not exist; check the URL", url=self.url, key=key
                )
            if code in _NOT_FOUND or (status == 404 and code not in _UNAVAILABLE):
                return NotFound(f"{where}: no such object", url=self.url, key=key)
            if code in _PRECONDITION or status == 412:
                return AlreadyExists(f"{where}: already exists", url=self.url, key=key)
            if code == "InvalidObjectState":
                cls = str(exc.response.get("Error", {}).get("StorageClass") or "") or None
                return NeedsRestore(
                    f"{where}: stored in {cls or 'an archival storage class'} and not restored; "
                    "request a restore (ckptier fetch does) and read it once it has finished",
                    url=self.url,
                    key=key,
                    storage_class=cls,
                )
            if code in _DENIED or status == 403:
                return AccessDenied(
                    f"{where}: access denied ({code or status}); check AWS_ACCESS_KEY_ID/"
                    "AWS_SECRET_ACCESS_KEY or AWS_PROFILE and the bucket policy",
                    url=self.url,
                    key=key,
                )
            if code in _UNAVAILABLE or (status is not None and status >= 500 and status != 501):
                return Unavailable(
                    f"{where}: endpoint {self.endpoint} is throttling or failing ({code or status}) "
                    "after retries; retry later, or check AWS_ENDPOINT_URL",
                    url=self.url,
                    key=key,
                )
            message = exc.response.get("Error", {}).get("Message", "") if hasattr(exc, "response") else ""
            detail = f" ({message})" if message else ""
            if code == "InvalidArgument" and self.storage_class:
                return StoreError(
                    f"{where}: S3 error InvalidArgument{detail} writing storage class {self.storage_class!r}: "
                    "this server may not offer that class; set the policy's storage_class to one it has "
                    "(STANDARD is always there) or configure the class on the server",
                    url=self.url, key=key)
            if code == "MissingContentLength" or status == 411:
                return StoreError(
                    f"{where}: S3 error {code or status}{detail}: the server refuses streamed uploads with "
                    f"trailing checksums; set {CHECKSUMS_ENV}=when_required for this endpoint ({self.endpoint})",
                    url=self.url, key=key)
            return StoreError(
                f"{where}: S3 error {code or status}: {message or exc}".rstrip(": "), url=self.url, key=key
            )
        if isinstance(exc, bex.BotoCoreError):
            return StoreError(f"{where}: {exc}", url=self.url, key=key)
        if isinstance(exc, OSError):
            return Unavailable(
                f"{where}: connection to {self.endpoint} failed ({exc}); check AWS_ENDPOINT_URL and retry",
                url=self.url,
                key=key,
            )
        return StoreError(f"{where}: {type(exc).__name__}: {exc}", url=self.url, key=key)

    def _call(self, method: str, key: str | None = None, **kwargs: Any) -> Any:
        import botocore.exceptions as bex

        try:
            return getattr(self.client, method)(**kwargs)
        except (bex.BotoCoreError, bex.ClientError, OSError) as exc:
            raise self._translate(exc, key) from exc

    def _full_key(self, key: str) -> str:
        return self.prefix + validate_key(key)

    def _checksum_of(self, response: dict[str, Any]) -> str | None:
        """``"crc64nvme:<b64>"`` when ``response`` carries a full-object CRC64NVME."""
        value = response.get("ChecksumCRC64NVME")
        if not value or "-" in value or response.get("ChecksumType", "FULL_OBJECT") != "FULL_OBJECT":
            return None
        return f"crc64nvme:{value}"

    # -- the Store protocol --------------------------------------------------

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Yield every object under ``prefix`` (the :class:`~.base.Store` contract).

        Raises ``NotFound`` when the bucket does not exist. Zero-byte "folder"
        markers (keys ending in ``/``) are skipped; so are keys that are not
        safe store keys (``a//b``, ``../x``), with a warning.

        A listing that fits one page costs one ListObjectsV2 request, as a
        flat listing does. A longer one is listed in parallel by
        ``list_workers`` threads (:meth:`_parallel_ranges`): the rest of the
        key space is cut into contiguous key ranges at the job and step
        prefixes a delimiter listing finds, and the ranges are listed
        concurrently, each page by page. Every key lies in exactly one range,
        so the objects yielded are exactly those of a flat listing, each
        once; the order is a flat listing's within each page and otherwise
        not defined. Each request is retried by botocore's standard retry
        mode (``max_attempts``); a range that still fails fails the listing
        (a :class:`~.wrappers.RetryingStore` restarts it). At most about
        ``2 * list_workers`` pages are held at once, so memory stays bounded
        whatever the bucket's size; closing the iterator early stops the
        threads. ``list_workers=1`` lists flat, one page after another.
        """
        full = self.prefix + prefix
        first = self._list_page(Prefix=full)
        yield from self._infos(first.get("Contents", ()))
        if not first.get("IsTruncated"):
            return
        contents = first.get("Contents") or ()
        after = str(contents[-1]["Key"]) if contents else ""
        token = first.get("NextContinuationToken")
        if self.list_workers <= 1 or not after:
            yield from self._list_flat(full, token=token)
            return
        yield from self._list_parallel(full, after)

    def _list_page(self, **kwargs: Any) -> dict[str, Any]:
        """One ListObjectsV2 request of up to ``list_page_size`` keys (errors translated)."""
        import botocore.exceptions as bex

        try:
            return self.client.list_objects_v2(Bucket=self.bucket, MaxKeys=self.list_page_size, **kwargs)  # type: ignore[no-any-return]
        except (bex.BotoCoreError, bex.ClientError, OSError) as exc:
            raise self._translate(exc) from exc

    def _infos(self, contents: Iterable[dict[str, Any]], lo: str = "", hi: str | None = None) -> builtins.list[ObjectInfo]:
        """The listed objects of one page with full keys in ``[lo, hi)``, as store objects."""
        out: builtins.list[ObjectInfo] = []
        cut = len(self.prefix)
        for obj in contents:
            full = obj["Key"]
            if full < lo or (hi is not None and full >= hi):
                continue
            key = full[cut:]
            if key.endswith("/"):
                continue
            if key_problem(key) is not None:
                log.warning("%s: skipping unsafe key %r in listing", self.url, key)
                continue
            modified = obj.get("LastModified")
            out.append(
                ObjectInfo(
                    key=key,
                    size=int(obj.get("Size", 0)),
                    mtime=_seconds(modified),
                    etag=obj.get("ETag"),
                    storage_class=obj.get("StorageClass"),
                )
            )
        return out

    def _list_flat(self, full: str, *, token: str | None = None) -> Iterator[ObjectInfo]:
        """The flat listing of ``full`` (a raw key prefix), page after page from ``token``."""
        while True:
            kwargs: dict[str, Any] = {"Prefix": full}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._list_page(**kwargs)
            yield from self._infos(page.get("Contents", ()))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    def _common_prefixes(self, full: str, after: str = "") -> builtins.list[str]:
        """The "directories" directly under ``full`` holding keys past ``after``
        (a delimiter listing, all its pages), sorted."""
        prefixes: builtins.list[str] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Prefix": full, "Delimiter": "/"}
            if token:
                kwargs["ContinuationToken"] = token
            elif after:
                kwargs["StartAfter"] = after
            page = self._list_page(**kwargs)
            prefixes.extend(str(p["Prefix"]) for p in page.get("CommonPrefixes", ()))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return sorted(prefixes)

    def _parallel_ranges(self, full: str, after: str, pool: ThreadPoolExecutor) -> builtins.list[tuple[str, str | None]]:
        """Cut the keys under ``full`` that sort after ``after`` into contiguous ranges ``[lo, hi)``.

        The boundaries are "directory" prefixes: those directly under
        ``full`` (the jobs) and, when they are fewer than
        :data:`LIST_RANGES_PER_WORKER` per worker, those one level down (the
        steps), found by delimiter listings run on ``pool``. The first range
        starts after ``after``, the last one is open; together they cover
        every key past ``after`` exactly once, whatever the boundaries.
        """
        want = self.list_workers * LIST_RANGES_PER_WORKER
        level = self._common_prefixes(full, after)
        prefixes = level
        if 0 < len(level) < want:
            below = builtins.list(pool.map(self._common_prefixes, level))
            prefixes = sorted({*level, *(q for sub in below for q in sub)})
        prefixes = [p for p in prefixes if p > after]
        step = max(1, -(-len(prefixes) // want))
        bounds = prefixes[step::step] if len(prefixes) > step else []
        edges: builtins.list[str] = [after, *bounds]
        return [(edges[i], edges[i + 1] if i + 1 < len(edges) else None) for i in range(len(edges))]

    def _list_range(self, full: str, lo: str, hi: str | None, first: bool, put: Callable[[Any], bool]) -> None:
        """List the keys under ``full`` in ``(lo, hi)`` (``first``) or ``[lo, hi)``, page by page,
        handing each page to ``put``; stops early when ``put`` returns False."""
        # StartAfter is exclusive: start just before lo (lo minus its last character
        # sorts before lo; keys in between are below lo and filtered out here).
        start = lo if first else lo[:-1]
        floor = lo + "\x00" if first else lo
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Prefix": full}
            if token:
                kwargs["ContinuationToken"] = token
            elif start:
                kwargs["StartAfter"] = start
            page = self._list_page(**kwargs)
            contents = page.get("Contents") or ()
            if not put(self._infos(contents, floor, hi)):
                return
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return
            if hi is not None and contents and str(contents[-1]["Key"]) >= hi:
                return

    def _list_parallel(self, full: str, after: str) -> Iterator[ObjectInfo]:
        """Every key under ``full`` past ``after``, listed range by range on a thread pool."""
        workers = self.list_workers
        pages: queue.Queue[Any] = queue.Queue(maxsize=2 * workers)
        stop = threading.Event()
        done = object()

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    pages.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def run(lo: str, hi: str | None, first: bool) -> None:
            try:
                self._list_range(full, lo, hi, first, put)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
                put(exc)
            finally:
                put(done)

        with ThreadPoolExecutor(workers, thread_name_prefix="ckptier-s3-list") as pool:
            try:
                ranges = self._parallel_ranges(full, after, pool)
                for i, (lo, hi) in enumerate(ranges):
                    pool.submit(run, lo, hi, i == 0)
                running = len(ranges)
                while running:
                    item = pages.get()
                    if item is done:
                        running -= 1
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        yield from item
            finally:
                stop.set()
                while True:  # unblock workers waiting to put
                    try:
                        pages.get_nowait()
                    except queue.Empty:
                        break

    def stat(self, key: str) -> ObjectInfo:
        """HeadObject; ``checksum`` is set only for a full-object CRC64NVME; ``storage_class``
        is the object's class (S3 omits the header for ``STANDARD``)."""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self._full_key(key)}
        if self.checksums_mode != "when_required":
            kwargs["ChecksumMode"] = "ENABLED"
        head = self._call("head_object", key, **kwargs)
        modified = head.get("LastModified")
        size = int(head.get("ContentLength", 0))
        return ObjectInfo(
            key=key,
            size=size,
            mtime=_seconds(modified),
            etag=head.get("ETag"),
            checksum=self._checksum_of(head),
            storage_class=head.get("StorageClass") or "STANDARD",
            identity=f"{size}:{head.get('ETag') or ''}:{head.get('VersionId') or ''}",
        )

    def open_read(self, key: str) -> BinaryIO:
        """A streaming reader (use it as a context manager); raises ``NotFound``."""
        response = self._call("get_object", key, Bucket=self.bucket, Key=self._full_key(key))
        return _S3Reader(response["Body"], self, key)  # type: ignore[return-value]

    def write(self, key: str, data: bytes | BinaryIO, *, if_absent: bool = False) -> ObjectInfo:
        """Store ``data`` atomically; see the class docstring for the strategy.

        Returns the object's size, ETag and the full-object checksum the store
        confirmed (``None`` when it confirmed none); ``mtime`` is ``None``
        (call ``stat`` when it matters). ``if_absent`` sends
        ``If-None-Match: *``; a 412 becomes ``AlreadyExists``.

        A multipart write with ``if_absent`` also sends ``If-None-Match: *``
        on CompleteMultipartUpload, but some servers ignore it there (Ceph
        RGW 16.2 overwrites silently). Unless :meth:`canary` has found the
        condition honoured (:attr:`conditional_multipart_complete`), such a
        write HEADs the key before the upload starts and again just before
        it completes, and raises ``AlreadyExists`` if the object is there:
        an existing object is never overwritten; two writers racing for the
        same absent key may both succeed (the last one wins), as with any
        store whose ``if_absent`` is not atomic.
        """
        full = self._full_key(key)
        if isinstance(data, (bytes, bytearray, memoryview)) and len(data) <= self.multipart_threshold:
            return self._put(key, full, bytes(data), if_absent)
        stream = as_stream(data)
        head = _read_full(stream, self.multipart_threshold)
        if len(head) < self.multipart_threshold:
            return self._put(key, full, head, if_absent)
        return self._multipart(key, full, head, stream, if_absent)

    def _put(self, key: str, full: str, body: bytes, if_absent: bool) -> ObjectInfo:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": full, "Body": body}
        if self.storage_class:
            kwargs["StorageClass"] = self.storage_class
        if self.checksum:
            kwargs["ChecksumAlgorithm"] = self.checksum
        if if_absent:
            kwargs["IfNoneMatch"] = "*"
        response = self._call("put_object", key, **kwargs)
        return ObjectInfo(key=key, size=len(body), etag=response.get("ETag"), checksum=self._checksum_of(response))

    def _refuse_if_present(self, key: str) -> None:
        """Raise ``AlreadyExists`` if ``key`` exists (for stores that ignore a conditional multipart complete)."""
        try:
            self.stat(key)
        except NotFound:
            return
        raise AlreadyExists(f"{self.url}/{key}: already exists", url=self.url, key=key)

    def _multipart(self, key: str, full: str, head: bytes, stream: BinaryIO, if_absent: bool) -> ObjectInfo:
        check_first = if_absent and self.conditional_multipart_complete is not True
        if check_first:
            self._refuse_if_present(key)
        create: dict[str, Any] = {"Bucket": self.bucket, "Key": full}
        if self.storage_class:
            create["StorageClass"] = self.storage_class
        if self.checksum:
            create["ChecksumAlgorithm"] = self.checksum
            create["ChecksumType"] = "FULL_OBJECT"
        # Imported here: hashing loads awscrt, which only multipart writes need.
        from .hashing import Hasher

        upload_id = self._call("create_multipart_upload", key, **create)["UploadId"]
        try:
            parts: builtins.list[dict[str, Any]] = []
            hasher = Hasher()
            pending = memoryview(head)
            while True:
                number = len(parts) + 1
                if number > MAX_PARTS:
                    raise StoreError(
                        f"{self.url}/{key}: stream needs more than {MAX_PARTS} parts; raise part_size",
                        url=self.url,
                        key=key,
                    )
                want = self.part_size << ((number - 1) // 2000)
                if len(pending) >= want:
                    body, pending = bytes(pending[:want]), pending[want:]
                else:
                    body = bytes(pending) + _read_full(stream, want - len(pending))
                    pending = memoryview(b"")
                if not body and parts:
                    break
                hasher.update(body)
                part: dict[str, Any] = {
                    "Bucket": self.bucket,
                    "Key": full,
                    "UploadId": upload_id,
                    "PartNumber": number,
                    "Body": body,
                }
                if self.checksum:
                    part["ChecksumAlgorithm"] = self.checksum
                answer = self._call("upload_part", key, **part)
                entry = {"PartNumber": number, "ETag": answer["ETag"]}
                if answer.get("ChecksumCRC64NVME"):
                    entry["ChecksumCRC64NVME"] = answer["ChecksumCRC64NVME"]
                parts.append(entry)
                if len(body) < want:
                    break
            complete: dict[str, Any] = {
                "Bucket": self.bucket,
                "Key": full,
                "UploadId": upload_id,
                "MultipartUpload": {"Parts": parts},
            }
            expected = hasher.digests().crc64nvme
            if self.checksum:
                complete["ChecksumCRC64NVME"] = expected
                complete["ChecksumType"] = "FULL_OBJECT"
            if if_absent:
                complete["IfNoneMatch"] = "*"
                if check_first:
                    self._refuse_if_present(key)
            response = self._call("complete_multipart_upload", key, **complete)
        except BaseException:
            self._abort_quietly(full, upload_id)
            raise
        confirmed = self._checksum_of(response)
        if self.checksum and confirmed is not None and confirmed != f"crc64nvme:{expected}":
            raise IntegrityError(
                f"{self.url}/{key}: store reports checksum {confirmed} but the bytes sent have "
                f"crc64nvme:{expected}; the object is corrupt, rewrite it",
                url=self.url,
                key=key,
            )
        return ObjectInfo(key=key, size=hasher.size, etag=response.get("ETag"), checksum=confirmed)

    def _abort_quietly(self, full: str, upload_id: str) -> None:
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
        except Exception as exc:  # best effort: the janitor finds it later
            log.warning("%s: could not abort multipart upload %s of %s: %s", self.url, upload_id, full, exc)

    def delete_many(self, keys: Sequence[str]) -> DeleteResult:
        """Delete ``keys`` in DeleteObjects batches of at most 1,000.

        Per-key refusals go to ``failed``; a key already absent counts as
        deleted; on a versioned bucket, keys that only got a delete marker are
        also listed in ``markers_only``. Unsafe keys are reported in
        ``failed`` and never sent.

        When a whole batch fails (SlowDown or 5xx after botocore's retries,
        access denied, unreachable endpoint) this raises
        :class:`~.errors.DeleteInterrupted`: its ``error`` is that failure,
        its ``result`` the confirmed outcome of earlier batches; nothing of
        the failed batch or later ones is reported as deleted. Deletes are
        idempotent, so the caller may simply run the remaining keys again.
        Keys an XML request cannot carry (control characters, a carriage
        return) go in single DeleteObject requests after the batches.
        """
        result = DeleteResult()
        valid: list[str] = []
        single: list[str] = []
        for key in keys:
            problem = key_problem(key)
            if problem is not None:
                result.failed[key] = problem
            else:
                (single if _NOT_XML_SAFE.search(key) else valid).append(key)
        try:
            for start in range(0, len(valid), MAX_DELETE_BATCH):
                self._delete_batch(valid[start : start + MAX_DELETE_BATCH], result)
            for key in single:
                self._delete_one(key, result)
        except StoreError as exc:
            raise DeleteInterrupted(exc, result) from exc
        return result

    def delete_proven(self, proven: Sequence[ObjectInfo]) -> DeleteResult:
        """:meth:`delete_many` of each info's key, only while the object there has
        the size, ETag and version (``VersionId``, on a versioned bucket) that
        :meth:`stat` proved (:class:`~.base.ProvenDeletes`): each is looked at
        again (HeadObject, a few at once) right before its batch is sent, and
        one replaced since is left alone, in ``changed``.

        What stays open is the time between that look and the batch request,
        which S3 cannot make conditional for every server; on a versioned
        bucket an object written in it survives as a noncurrent version (the
        delete adds only a marker).
        """
        result = DeleteResult()
        todo: list[ObjectInfo] = []
        for info in proven:
            problem = key_problem(info.key)
            if problem is not None:
                result.failed[info.key] = problem
            elif info.identity is None:
                result.failed[info.key] = "no identity proven (stat it first); not deleted"
            else:
                todo.append(info)

        def look(info: ObjectInfo) -> str | None:
            try:
                return self.stat(info.key).identity
            except NotFound:
                return None

        for start in range(0, len(todo), MAX_DELETE_BATCH):
            batch = todo[start : start + MAX_DELETE_BATCH]
            try:
                with ThreadPoolExecutor(max_workers=min(8, len(batch))) as pool:
                    now = list(pool.map(look, batch))
            except StoreError as exc:
                raise DeleteInterrupted(exc, result) from exc
            keys: list[str] = []
            for info, identity in zip(batch, now, strict=True):
                if identity is None:
                    result.deleted.append(info.key)  # already absent: deleted all the same
                elif identity != info.identity:
                    result.changed[info.key] = f"not the object proven: now {identity} (size:ETag:version), " \
                                               f"proven {info.identity}"
                else:
                    keys.append(info.key)
            try:
                result.merge(self.delete_many(keys))
            except DeleteInterrupted as exc:
                result.merge(exc.result)
                raise DeleteInterrupted(exc.error, result) from exc.error
        return result

    def _delete_one(self, key: str, result: DeleteResult) -> None:
        """DeleteObject for one key: a refusal of that key goes to ``result.failed``; a store
        failing as a whole (unavailable) raises."""
        try:
            answer = self._call("delete_object", key, Bucket=self.bucket, Key=self._full_key(key))
        except NotFound:
            answer = {}  # some stores answer 404 for a key already gone: deleted all the same
        except AccessDenied as exc:
            result.failed[key] = str(exc)
            return
        result.deleted.append(key)
        if answer.get("DeleteMarker"):
            result.markers_only.append(key)

    def _delete_batch(self, batch: Sequence[str], result: DeleteResult) -> None:
        by_full = {self.prefix + k: k for k in batch}
        response = self._call(
            "delete_objects",
            None,
            Bucket=self.bucket,
            Delete={"Objects": [{"Key": full} for full in by_full], "Quiet": False},
        )
        for error in response.get("Errors", ()):
            full = error.get("Key", "")
            key = by_full.get(full)
            if key is None:
                continue
            result.failed[key] = f"{error.get('Code', 'Error')}: {error.get('Message', '')}".rstrip(": ")
        for entry in response.get("Deleted", ()):
            key = by_full.get(entry.get("Key", ""))
            if key is None or key in result.failed:
                continue
            result.deleted.append(key)
            if entry.get("DeleteMarker"):
                result.markers_only.append(key)

    # -- tagging (the Taggable capability) ------------------------------------

    def get_object_tagging(self, key: str) -> dict[str, str]:
        """The object's tags (of its current version); ``NotFound`` if it is missing."""
        answer = self._call("get_object_tagging", key, Bucket=self.bucket, Key=self._full_key(key))
        return {t["Key"]: t["Value"] for t in answer.get("TagSet", ())}

    def put_object_tagging(self, key: str, tags: Mapping[str, str]) -> None:
        """Add ``tags`` to the object's tag set, keeping its other tags (see
        :class:`~.base.Taggable`). S3 replaces a whole tag set at once, so this
        reads the set, merges and writes it back: a concurrent writer of the
        same object's tags can lose its change (ckptier is the only one that
        tags the keys it deletes)."""
        merged = {**self.get_object_tagging(key), **tags}
        if (problem := tags_problem(merged)) is not None:
            raise ConfigError(f"{self.url}/{key}: cannot tag: {problem}")
        self._call(
            "put_object_tagging", key, Bucket=self.bucket, Key=self._full_key(key),
            Tagging={"TagSet": [{"Key": k, "Value": v} for k, v in merged.items()]},
        )

    # -- the MultipartUploads, ResumableReads, Restorable and Canary capabilities

    def list_multipart_uploads(self, prefix: str = "") -> builtins.list[tuple[str, str, datetime]]:
        """Unfinished multipart uploads under ``prefix``: ``(key, upload_id, initiated)``.

        ``initiated`` is a timezone-aware UTC datetime. Ordered by key, then
        by initiation time (as S3 lists them).
        """
        import botocore.exceptions as bex

        found: builtins.list[tuple[str, str, datetime]] = []
        paginator = self.client.get_paginator("list_multipart_uploads")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                for upload in page.get("Uploads", ()):
                    found.append((upload["Key"][len(self.prefix) :], upload["UploadId"], upload["Initiated"]))
        except (bex.BotoCoreError, bex.ClientError, OSError) as exc:
            raise self._translate(exc) from exc
        return found

    def abort_multipart(self, key: str, upload_id: str) -> None:
        """Abort one unfinished upload; idempotent (an unknown upload is fine)."""
        import botocore.exceptions as bex

        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=self._full_key(key), UploadId=upload_id)
        except bex.ClientError as exc:
            if _error_code(exc)[0] in ("NoSuchUpload", "404"):
                return
            raise self._translate(exc, key) from exc
        except (bex.BotoCoreError, OSError) as exc:
            raise self._translate(exc, key) from exc

    def open_versioned(self, key: str) -> tuple[BinaryIO, str]:
        """:meth:`open_read` and the object's ETag, which :meth:`open_from` resumes against
        (:class:`~.base.ResumableReads`)."""
        response = self._call("get_object", key, Bucket=self.bucket, Key=self._full_key(key))
        return _S3Reader(response["Body"], self, key), str(response.get("ETag") or "")  # type: ignore[return-value]

    def open_from(self, key: str, offset: int, version: str) -> BinaryIO:
        """The object's bytes from ``offset`` on (a ranged GET), only while its ETag is still
        ``version`` (``If-Match``); :class:`ObjectChanged` when it was replaced since."""
        import botocore.exceptions as bex

        full = self._full_key(key)
        changed = ObjectChanged(f"{self.url}/{key}: replaced while it was being read (its ETag is no longer "
                                f"{version or 'known'}); read it again from the start", url=self.url, key=key)
        if not version:
            raise changed
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=full, Range=f"bytes={offset}-", IfMatch=version)
        except bex.ClientError as exc:
            code, status = _error_code(exc)
            if code in _PRECONDITION or status == 412:
                raise changed from exc
            if code != "InvalidRange" and status != 416:
                raise self._translate(exc, key) from exc
            # Nothing left past ``offset``; still the same object?
            try:
                self.client.head_object(Bucket=self.bucket, Key=full, IfMatch=version)
            except bex.ClientError as head_exc:
                code, status = _error_code(head_exc)
                if code in _PRECONDITION or status == 412:
                    raise changed from head_exc
                raise self._translate(head_exc, key) from head_exc
            except (bex.BotoCoreError, OSError) as head_exc:
                raise self._translate(head_exc, key) from head_exc
            return io.BytesIO(b"")
        except (bex.BotoCoreError, OSError) as exc:
            raise self._translate(exc, key) from exc
        return _S3Reader(response["Body"], self, key)  # type: ignore[return-value]

    def restore(self, key: str, *, days: int = 1, tier: str = "Standard") -> RestoreState:
        """Ask S3 for a readable copy of an archived object (RestoreObject) for ``days`` days.

        ``"requested"``: a restore started now (202); ``"in-progress"``: one
        is already running (409 RestoreAlreadyInProgress); ``"ready"``: the
        object is readable (already restored, or in a class that needs no
        restore). Idempotent. See :data:`RESTORE_HOURS` for how long it takes.

        A server without RestoreObject (501 NotImplemented, e.g. Ceph RGW
        16.2) has no object to restore: the object's class is read with a
        HEAD and ``"ready"`` returned unless that class is one of
        :data:`RESTORE_CLASSES` (then a :class:`StoreError` says so).
        """
        import botocore.exceptions as bex

        if days < 1:
            raise ConfigError(f"restore days={days}: must be ≥ 1")
        request = {"Days": days, "GlacierJobParameters": {"Tier": tier}}
        try:
            answer = self.client.restore_object(Bucket=self.bucket, Key=self._full_key(key), RestoreRequest=request)
        except bex.ClientError as exc:
            code, _ = _error_code(exc)
            if code == "RestoreAlreadyInProgress":
                return "in-progress"
            if code == "NotImplemented":
                cls = self.stat(key).storage_class  # NotFound when absent
                if cls in RESTORE_CLASSES:
                    raise StoreError(f"{self.url}/{key}: object is in {cls} but this S3 server does not implement "
                                     "RestoreObject; restore it with the server's own tools",
                                     url=self.url, key=key) from exc
                return "ready"
            if code == "InvalidObjectState":  # not in an archival class: readable as it is
                return "ready"
            raise self._translate(exc, key) from exc
        except (bex.BotoCoreError, OSError) as exc:
            raise self._translate(exc, key) from exc
        return "requested" if answer.get("ResponseMetadata", {}).get("HTTPStatusCode") == 202 else "ready"

    def canary(self, *, stale_after_s: float = STALE_CANARY_AGE_S) -> None:
        """Prove the endpoint stores and returns bytes unchanged; raise if not.

        Writes a small object under ``.ckptier-canary/``, reads it back,
        compares, and deletes it. Must pass before anything is deleted. After
        it passed, canary objects older than ``stale_after_s`` (left by runs
        killed mid-canary; nothing else writes that prefix) are deleted too,
        best effort; a live run's canary is seconds old and stays.
        Raises :class:`StoreError` (``AccessDenied``/``NotFound``/
        ``Unavailable`` as usual for those causes) naming
        ``CKPTIER_S3_CHECKSUMS=when_required`` when the store rejects checksum
        headers or mangles the bytes.

        It also probes whether CompleteMultipartUpload honours
        ``If-None-Match: *`` (a one-part upload completed over the canary
        object) and records the answer in
        :attr:`conditional_multipart_complete`; a store that ignores it
        passes the canary (``write(if_absent=True)`` then HEAD-checks) and a
        warning is logged.
        """
        key = f"{CANARY_PREFIX}{uuid.uuid4().hex}"
        payload = b"ckptier canary\n" + os.urandom(48) + bytes(range(256))
        hint = f"set {CHECKSUMS_ENV}=when_required for this endpoint ({self.endpoint})"
        try:
            try:
                self.write(key, payload)
                with self.open_read(key) as fh:
                    back = fh.read()
                if back == payload:
                    self._probe_conditional_complete(key, payload)
            except (AccessDenied, NotFound, Unavailable):
                raise
            except StoreError as exc:
                raise StoreError(
                    f"{self.url}: canary write/read failed ({exc}); the store may reject checksum headers: {hint}",
                    url=self.url,
                    key=key,
                ) from exc
            if back != payload:
                raise StoreError(
                    f"{self.url}: canary object came back changed ({len(payload)} bytes written, "
                    f"{len(back)} read); the store mangles uploads: {hint}",
                    url=self.url,
                    key=key,
                )
        finally:
            try:
                self.client.delete_object(Bucket=self.bucket, Key=self.prefix + key)
            except Exception as exc:  # the original error matters more
                log.warning("%s: could not delete canary object %s: %s", self.url, key, exc)
        self._sweep_stale_canaries(stale_after_s)

    def _probe_conditional_complete(self, key: str, existing: bytes) -> None:
        """Complete a one-part upload over the existing canary ``key`` with ``If-None-Match: *``;
        set :attr:`conditional_multipart_complete` from whether the store refused it."""
        full = self._full_key(key)
        upload_id = self._call("create_multipart_upload", key, Bucket=self.bucket, Key=full)["UploadId"]
        try:
            part = self._call("upload_part", key, Bucket=self.bucket, Key=full, UploadId=upload_id,
                              PartNumber=1, Body=b"ckptier canary: must not replace the object\n")
            self._call("complete_multipart_upload", key, Bucket=self.bucket, Key=full, UploadId=upload_id,
                       IfNoneMatch="*", MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]})
        except AlreadyExists:
            self.conditional_multipart_complete = True
            self._abort_quietly(full, upload_id)
            return
        except BaseException:
            self._abort_quietly(full, upload_id)
            raise
        self.conditional_multipart_complete = False
        log.warning("%s: the store ignores If-None-Match on CompleteMultipartUpload; large if_absent writes "
                    "HEAD-check the key first", self.url)

    def _sweep_stale_canaries(self, stale_after_s: float) -> None:
        """Delete canary objects older than ``stale_after_s`` (best effort: a warning, never an error)."""
        try:
            cutoff = time.time() - stale_after_s
            stale = [i.key for i in self.list(CANARY_PREFIX) if i.mtime is not None and i.mtime <= cutoff]
            if stale:
                self.delete_many(stale)
                log.info("%s: deleted %d canary object(s) left by killed runs", self.url, len(stale))
        except StoreError as exc:
            log.warning("%s: could not delete old canary objects: %s", self.url, exc)
