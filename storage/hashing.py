"""Streaming checksums of checkpoint bytes: CRC64NVME always, SHA-256 on demand.

CRC64NVME is ckptier's identity of a file's bytes. It is what S3 keeps as a
*full-object* checksum (``ChecksumCRC64NVME``, also for multipart uploads),
so a value computed here on the same bytes equals the one S3 reports; a store
that keeps it lets a shallow verification compare without downloading. The
text form is S3's: the 8-byte big-endian CRC, base64-encoded (12 characters,
e.g. ``"rosUhgp5mIg="`` for ``b"123456789"``).

SHA-256 is computed only when someone expects it (a format's metadata lists
expected hashes): it runs at ~1.8 GB/s per core against ~24 GB/s for
CRC64NVME. Both hashes release the GIL, so threads hash files in parallel.

Reading reuses one caller-supplied buffer (``readinto``): a fresh allocation
per chunk costs page faults and caps throughput (see docs/benchmarks.md).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from awscrt.checksums import combine_crc64nvme, crc64nvme

#: Default size of a read buffer, bytes. 1 MiB stays in a core's L2 cache
#: between the read that fills it and the CRC that consumes it: from the page
#: cache that was 1.1–1.25x faster than 8 MiB here (bench/verify.py); memory stays
#: bounded at one buffer per concurrent file.
DEFAULT_CHUNK = 1 << 20

#: Prefix of :attr:`ObjectInfo.checksum <ckptier.storage.base.ObjectInfo>` values holding a CRC64NVME.
CRC64NVME_PREFIX = "crc64nvme:"


@dataclass(frozen=True, slots=True)
class Digests:
    """What one pass over a file's bytes proved.

    ``size`` is the number of bytes hashed; ``crc64nvme`` is S3's base64 text
    form; ``sha256`` is lowercase hex, or ``None`` when it was not asked for.
    """

    size: int
    crc64nvme: str
    sha256: str | None = None


def encode_crc64nvme(value: int) -> str:
    """Encode a CRC64NVME integer the way S3 writes ``ChecksumCRC64NVME``."""
    if not 0 <= value < 1 << 64:
        raise ValueError(f"CRC64NVME value {value!r} is out of range; it must fit in 64 unsigned bits")
    return base64.b64encode(value.to_bytes(8, "big")).decode("ascii")


def decode_crc64nvme(text: str) -> int:
    """Decode S3's base64 text form of a CRC64NVME into its integer.

    Raises ``ValueError`` naming the value when it is not base64 of exactly 8 bytes.
    """
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, AttributeError):
        raw = b""
    if len(raw) != 8:
        raise ValueError(f"CRC64NVME {text!r} is not base64 of 8 bytes; expected S3's form such as 'rosUhgp5mIg='")
    return int.from_bytes(raw, "big")


def is_crc64nvme(text: object) -> bool:
    """True when ``text`` is a well-formed base64 CRC64NVME."""
    if not isinstance(text, str):
        return False
    try:
        decode_crc64nvme(text)
    except ValueError:
        return False
    return True


def is_sha256_hex(text: object) -> bool:
    """True when ``text`` is a 64-character lowercase hex SHA-256."""
    return isinstance(text, str) and len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def store_crc64nvme(checksum: str | None) -> str | None:
    """The base64 CRC64NVME inside an ``ObjectInfo.checksum``, or ``None``.

    Returns ``None`` for no checksum or one of another algorithm; raises
    ``ValueError`` when it claims to be CRC64NVME but is malformed (a store
    bug that must not pass silently as "no checksum").
    """
    if checksum is None or not checksum.startswith(CRC64NVME_PREFIX):
        return None
    value = checksum[len(CRC64NVME_PREFIX) :]
    decode_crc64nvme(value)
    return value


def combine(first: str, second: str, second_size: int) -> str:
    """CRC64NVME of ``A + B`` from the CRCs of ``A`` and ``B`` (``second_size`` = len(B), bytes).

    This is how S3 derives a multipart upload's full-object checksum from its parts.
    """
    return encode_crc64nvme(combine_crc64nvme(decode_crc64nvme(first), decode_crc64nvme(second), second_size))


class Hasher:
    """Incremental CRC64NVME (and optionally SHA-256) of a byte sequence.

    ``update`` accepts any buffer (bytes, bytearray, memoryview) and does not
    keep a reference to it, so the caller may reuse the buffer at once.
    """

    __slots__ = ("_crc", "_sha", "size")

    def __init__(self, *, sha256: bool = False) -> None:
        self._crc = 0
        self._sha = hashlib.sha256() if sha256 else None
        self.size = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._crc = crc64nvme(data, self._crc)  # any buffer works, not only bytes
        if self._sha is not None:
            self._sha.update(data)
        self.size += len(data) if not isinstance(data, memoryview) else data.nbytes

    def digests(self) -> Digests:
        """The digests of everything passed to ``update`` so far."""
        return Digests(
            size=self.size,
            crc64nvme=encode_crc64nvme(self._crc),
            sha256=self._sha.hexdigest() if self._sha is not None else None,
        )


def hash_bytes(data: bytes | bytearray | memoryview, *, sha256: bool = False) -> Digests:
    """Digests of an in-memory byte string."""
    h = Hasher(sha256=sha256)
    h.update(data)
    return h.digests()


class _Readable(Protocol):
    def read(self, size: int = ..., /) -> bytes: ...


def _buffer(buffer: bytearray | None) -> bytearray:
    if buffer is None:
        return bytearray(DEFAULT_CHUNK)
    if len(buffer) == 0:
        raise ValueError("hash buffer is empty; pass a bytearray of at least 64 KiB (1 MiB is best)")
    return buffer


def hash_stream(
    stream: _Readable,
    *,
    sha256: bool = False,
    buffer: bytearray | None = None,
    progress: Callable[[int], None] | None = None,
    observe: Callable[[memoryview], None] | None = None,
) -> Digests:
    """Hash ``stream`` from its current position to EOF with bounded memory.

    Reads with ``readinto`` into ``buffer`` (reused; allocated once when
    ``None``), falling back to ``read(len(buffer))`` for streams without
    ``readinto``. Memory use is ``len(buffer)`` whatever the stream's size.
    ``progress`` is called with the byte count of each chunk after it is hashed.
    ``observe`` is given each chunk too, in order, in the same pass (a
    structural check): it must not keep the view, whose buffer is reused.
    The stream is not closed.
    """
    buf = _buffer(buffer)
    view = memoryview(buf)
    h = Hasher(sha256=sha256)
    readinto = getattr(stream, "readinto", None)
    try:
        while True:
            if readinto is not None:
                n = readinto(view)
                if n is None:
                    raise ValueError(f"{stream!r} is non-blocking and had no data; hash only blocking streams")
                if n == 0:
                    break
                h.update(view[:n])
                if observe is not None:
                    observe(view[:n])
            else:
                chunk = stream.read(len(buf))
                if not chunk:
                    break
                n = len(chunk)
                h.update(chunk)
                if observe is not None:
                    observe(memoryview(chunk))
            if progress is not None:
                progress(n)
    finally:
        view.release()
    return h.digests()


def hash_file(
    path: str | os.PathLike[str],
    *,
    sha256: bool = False,
    buffer: bytearray | None = None,
    progress: Callable[[int], None] | None = None,
    observe: Callable[[memoryview], None] | None = None,
) -> Digests:
    """Hash a local file, the fast path: unbuffered reads straight into ``buffer``.

    Tells the kernel the access is sequential (``posix_fadvise``) so readahead
    is aggressive on a cold cache. Raises ``OSError`` like ``open``.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except OSError:
                pass  # advice only; some filesystems refuse it
        with io.FileIO(fd, "rb", closefd=False) as raw:
            return hash_stream(raw, sha256=sha256, buffer=buffer, progress=progress, observe=observe)
    finally:
        os.close(fd)
