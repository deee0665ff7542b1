"""Store URLs: a plain path, ``file:///path`` or ``s3://bucket/prefix``.

Parsing is pure (:func:`parse_url`, :func:`canonical_url`);
only :func:`open_store` builds a store (and, for S3, a boto3 client, which
reads credentials and ``AWS_ENDPOINT_URL`` the standard way). Every bad URL
raises :class:`~.errors.ConfigError` with a one-line message.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from .base import Store, key_problem
from .errors import ConfigError

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


@dataclass(frozen=True, slots=True)
class StoreURL:
    """A parsed store URL.

    ``scheme`` is ``"file"`` or ``"s3"``. For ``file``, ``path`` is the
    absolute directory and ``bucket``/``prefix`` are empty. For ``s3``,
    ``prefix`` has no leading or trailing ``/`` (``""`` for the whole bucket).
    """

    scheme: str
    path: str = ""
    bucket: str = ""
    prefix: str = ""

    @property
    def url(self) -> str:
        """The canonical form, equal to the ``url`` of the store it opens."""
        if self.scheme == "file":
            return Path(self.path).as_uri()
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def bucket_problem(name: str) -> str | None:
    """Why ``name`` is not a valid S3 bucket name, or ``None``."""
    if not _BUCKET_RE.match(name):
        return "must be 3-63 characters of lowercase letters, digits, '.' and '-', starting and ending with a letter or digit"
    if ".." in name or ".-" in name or "-." in name:
        return "must not contain '..', '.-' or '-.'"
    try:
        ipaddress.IPv4Address(name)
    except ValueError:
        pass
    else:
        return "must not look like an IP address"
    if name.startswith(("xn--", "sthree-")) or name.endswith(("-s3alias", "--ol-s3", "--x-s3")):
        return "uses a prefix or suffix reserved by S3"
    return None


def parse_url(url: str) -> StoreURL:
    """Parse ``url`` without touching any store; raise ``ConfigError`` if bad."""
    if not url or not url.strip():
        raise ConfigError("store URL is empty; give a path, file:///path or s3://bucket/prefix")
    match = _SCHEME_RE.match(url)
    if match is None:
        if "://" in url or url.startswith("s3:"):
            raise ConfigError(f"store URL {url!r} is malformed; use a path, file:///path or s3://bucket/prefix")
        return StoreURL("file", path=os.path.abspath(os.path.expanduser(url)))
    scheme = match.group(1).lower()
    parts = urlsplit(url)
    if parts.query or parts.fragment or url.rstrip("?#") != url:
        raise ConfigError(f"store URL {url!r} has a query or fragment ('?' or '#'); remove it")
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(
                f"file URL {url!r} names host {parts.netloc!r}; only local paths work: use file:///path"
            )
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise ConfigError(f"file URL {url!r} has no absolute path; use file:///path")
        return StoreURL("file", path=os.path.normpath(path))
    if scheme == "s3":
        bucket = parts.netloc
        if not bucket:
            raise ConfigError(f"S3 URL {url!r} has no bucket; use s3://bucket/prefix")
        problem = bucket_problem(bucket)
        if problem is not None:
            raise ConfigError(f"S3 bucket name {bucket!r} in {url!r} is invalid: it {problem}")
        prefix = unquote(parts.path).strip("/")
        if prefix:
            problem = key_problem(prefix)
            if problem is not None:
                raise ConfigError(f"S3 URL {url!r} has an unsafe prefix: {problem}; use s3://bucket/dir/subdir")
        return StoreURL("s3", bucket=bucket, prefix=prefix)
    raise ConfigError(f"store URL {url!r} has unsupported scheme {scheme!r}; use a path, file:///path or s3://bucket/prefix")


def parse_location(location: str, roots: Iterable[str] = ()) -> StoreURL:
    """What a catalog location denotes: the directory or file as a :class:`StoreURL`.

    A location is written as a store's canonical URL, ``/``, then a key as
    the store lists it, *not* escaped: a key may hold ``%``, ``#``, ``?``,
    tabs or newlines, which :func:`parse_url` would decode, refuse or drop.
    So a location is split, never URL-decoded past its store's URL:

    * ``s3://bucket/KEY``: the bucket, and everything after it as the raw key;
    * ``file://...``: the longest of ``roots`` (store URLs, e.g. the ones
      scans recorded; any that is not canonical is passed over) that the
      location equals or lies below, then the raw key; with none, the text
      after ``file://`` is the path itself when it holds no ``%`` (a
      canonical file URL of a path of ordinary characters is that path), and
      is decoded as a URL otherwise (ambiguous only for a key holding ``%``
      below a root holding characters a URL escapes);
    * anything else (a plain path) as :func:`parse_url` reads it.

    Pure; raises :class:`ConfigError` for what is not a location.
    """
    if location.startswith("s3://"):
        bucket, _, key = location[len("s3://"):].partition("/")
        problem = bucket_problem(bucket)
        if problem is not None:
            raise ConfigError(f"S3 bucket name {bucket!r} in location {location!r} is invalid: it {problem}")
        return StoreURL("s3", bucket=bucket, prefix=key.strip("/"))
    if not location.startswith("file://"):
        return parse_url(location)
    for root in sorted(roots, key=len, reverse=True):
        base = root.rstrip("/")
        if not base.startswith("file://") or (location != base and not location.startswith(base + "/")):
            continue
        try:
            parsed = parse_url(root)
        except ConfigError:
            continue
        if parsed.url != base:
            continue  # not a store's canonical URL: its own tail may be raw
        rest = location[len(base):].strip("/")
        return StoreURL("file", path=f"{parsed.path.rstrip('/')}/{rest}" if rest else parsed.path)
    path = location[len("file://"):]
    if "%" not in path and path.startswith("/"):
        return StoreURL("file", path=path.rstrip("/") or "/")
    return parse_url(location)


def canonical_url(url: str) -> str:
    """The canonical form of ``url`` (the ``url`` attribute its store will have).

    Two spellings of one location (``/data/ckpt``, ``file:///data/ckpt/``;
    ``s3://b/p/``, ``s3://b/p``) give the same string.
    """
    return parse_url(url).url


def open_store(url: str, **s3_options: Any) -> Store:
    """Build the store for ``url``.

    ``s3_options`` are passed to :class:`~.s3.S3Store` for S3 URLs (``client``,
    ``endpoint_url``, ``multipart_threshold``, ...) and must be empty for
    local ones. Opening does no I/O for local stores and no request for S3;
    a missing directory or bucket shows on first use as ``NotFound``.
    """
    parsed = parse_url(url)
    if parsed.scheme == "file":
        if s3_options:
            raise ConfigError(f"options {sorted(s3_options)} only apply to s3:// URLs, not {url!r}")
        from .local import LocalStore

        return LocalStore(parsed.path)
    from .s3 import S3Store

    return S3Store(parsed.bucket, parsed.prefix, **s3_options)
