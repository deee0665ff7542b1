"""The ckz1 archive codec: dtype-aware, streaming, self-verifying compression.

Container layout (all integers little-endian)::

    MAGIC (8) | version u16 | header length u32 | JSON header | crc32c u32
    segment*  | trailer

    segment = "SG" | kind u8 | width u8 | transform u8 | pad u8
              | raw offset u64 | raw length u32 | CRC64NVME of raw bytes u64
              | (plane mode u8, stored length u32) * planes | crc32c of all that u32
              | plane payloads, in plane order
    trailer = "EN" | pad u16 | raw size u64 | segment count u64
              | CRC64NVME of the raw stream u64 | crc32c of those fields u32 | END_MAGIC (8)

A segment is either ``generic`` (one plane: a zstd frame or raw bytes) or
``planes`` (a tensor block split into ``width`` byte planes, see
:mod:`.codec_planes`). Every zstd frame carries a content checksum, every
segment a CRC64NVME of its raw bytes that is checked *before* its bytes are
written out, and the trailer a CRC64NVME of the whole original stream.
Decoding needs only this module and the archive.

Encoding is split three ways: the calling thread reads (and plans the
layout), ``threads`` workers code whole segments in parallel, and one writer
thread writes segments in order and chains their CRC64NVMEs; memory is
bounded by about ``block size x (5 x threads + 3)`` whatever the input size
(input is read in blocks of at most :data:`BLOCK_SIZE` bytes into pooled
buffers, at most ``2 x threads`` segments wait for the writer). Decoding
needs no reader or writer thread: each of ``threads`` workers (the calling
thread among them) reads the next segment, decodes and checks it and parks
it; whoever parks the segment whose turn it is writes it and the parked ones
that follow it in order (:class:`_Relay`), so no worker waits behind a
slower one's segment. A worker reads no further while ``8 x threads``
segments or ``2 x threads`` blocks of raw bytes are read and not yet
written, so buffers stay within about ``block size x 3 x threads``. Each
worker keeps one set of scratch arrays (decoding: a block's planes, decoded
whole, and the merge's temporaries, which are sized by the merging loop's
chunk, not the block: measured on the reference checkpoint, about 2.5 block
sizes at 2 MiB blocks, 4 at 512 KiB). Up to :data:`SPARE_BYTES` of buffers,
and a few scratch sets within it, are kept for the next call (scratch sets
for the next call of the same kind, encoding or decoding).
"""

from __future__ import annotations

import json
import os
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Generic, TypeVar

import numpy as np
import zstandard
from awscrt import checksums

from . import codec_planes as planes
from .codec_layout import PeekReader, detect, plan_regions
from .errors import IntegrityError

CODEC_ID = "ckz1"
CODEC_VERSION = 2
MAGIC = b"\x89CKZ\r\n\x1a\n"
END_MAGIC = b"CKZ1-END"

#: largest raw block per segment (bytes); also the unit of parallel work. 2 MiB keeps a
#: block and its planes in a core's cache while it is coded, and memory small; on the
#: reference checkpoint 8 MiB blocks compress 0.01% better and code no faster.
BLOCK_SIZE = 2 << 20
#: tensor regions shorter than this are folded into generic segments.
MIN_TENSOR_BYTES = 4096
#: the decoder refuses segments claiming more raw bytes than this.
MAX_SEGMENT = 64 << 20
MAX_HEADER = 1 << 20
#: largest zstd window the decoder allocates for a frame it decodes in chunks. Plane
#: frames have 128 KiB windows (``codec_planes.plane_params``); every other frame is
#: decoded in one pass into its output, which needs no window buffer. So a damaged
#: frame header cannot make the decoder allocate more than this per stream.
MAX_WINDOW = 1 << 20

KIND_GENERIC = 0
KIND_PLANES = 1

_FILE_HEAD = struct.Struct("<HI")
_SEG_HEAD = struct.Struct("<2sBBBxQIQ")
_PLANE_ENTRY = struct.Struct("<BI")
_TRAILER = struct.Struct("<2s2xQQQ")
_U32 = struct.Struct("<I")

_T = TypeVar("_T")
#: ``combine_crc64nvme`` appeared in later awscrt releases; without it the reading thread checksums.
_combine_crc64 = getattr(checksums, "combine_crc64nvme", None)

_MODE_NAMES = {planes.PLANE_RAW: "raw", planes.PLANE_ZSTD: "zstd", planes.PLANE_NIBBLE: "nibble"}


@dataclass(slots=True)
class CodecStats:
    """What one :func:`encode` or :func:`decode` call did.

    ``raw_bytes`` is the size of the original stream, ``stored_bytes`` the size
    of the archive (both in bytes, container overhead included in the latter);
    ``crc64nvme`` is the CRC64NVME of the original bytes as 16 hex digits;
    ``seconds`` is wall time; ``segments`` counts segments by kind
    (``generic``, ``planes``) and planes by coding (``plane_raw``,
    ``plane_zstd``, ``plane_nibble``).
    """

    name: str
    payload: str
    raw_bytes: int = 0
    stored_bytes: int = 0
    crc64nvme: str = ""
    seconds: float = 0.0
    segments: dict[str, int] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """``raw_bytes / stored_bytes`` (1.0 for an empty stream)."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes and self.raw_bytes else 1.0

    def _count(self, key: str, n: int = 1) -> None:
        self.segments[key] = self.segments.get(key, 0) + n


class _Workers:
    """Per-thread zstd contexts and scratch arrays (none of them may be shared between threads).

    ``kind`` (``"encode"`` or ``"decode"``) names whose spare scratch sets the workers take and
    give back: encoding and decoding fill a set with different arrays, so a set passed from one
    to the other would come to hold both (see :class:`_Spares`).
    """

    def __init__(self, level: int, kind: str) -> None:
        self._local = threading.local()
        self._level = level
        self.kind = kind
        self._lock = threading.Lock()
        self._scratch: list[planes.Scratch] = []

    def generic(self) -> zstandard.ZstdCompressor:
        cctx = getattr(self._local, "generic", None)
        if cctx is None:
            cctx = self._local.generic = zstandard.ZstdCompressor(
                level=self._level, write_checksum=True, write_content_size=True
            )
        return cctx

    def plane(self) -> zstandard.ZstdCompressor:
        cctx = getattr(self._local, "plane", None)
        if cctx is None:
            cctx = self._local.plane = zstandard.ZstdCompressor(compression_params=planes.plane_params())
        return cctx

    def decompressor(self) -> zstandard.ZstdDecompressor:
        """This thread's decompression context (planes are decoded one after the other, each in one call)."""
        dctx = getattr(self._local, "dctx", None)
        if dctx is None:
            dctx = self._local.dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)
        return dctx

    def scratch(self) -> planes.Scratch:
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = _SPARES.scratch(self.kind)
            with self._lock:
                self._scratch.append(scratch)
        return scratch

    def scratch_sets(self) -> list[planes.Scratch]:
        """Every scratch set handed out (call only when no worker runs any more)."""
        with self._lock:
            return list(self._scratch)


#: bytes of block buffers kept between calls: a fresh buffer costs page faults on
#: first touch (~0.5 ms per MB here), on every file of a multi-file checkpoint.
SPARE_BYTES = 32 << 20
_SPARE_SCRATCH = 4


class _Spares:
    """Block buffers and scratch sets left over from earlier calls, shared by all threads.

    Scratch sets are kept apart by the kind of call that filled them (encoding's split and
    nibble arrays, decoding's merge and plane arrays): handed to the other kind, a set would
    grow by that kind's arrays and keep both, about twice the memory per worker while an
    encoder and a decoder run side by side (as in a promotion's pipeline).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers: list[np.ndarray] = []
        self._scratch: dict[str, list[planes.Scratch]] = {}

    def buffers(self, size: int) -> list[np.ndarray]:
        """Take every spare buffer of at least ``size`` bytes."""
        with self._lock:
            fit = [b for b in self._buffers if b.size >= size]
            self._buffers = [b for b in self._buffers if b.size < size]
        return fit

    def scratch(self, kind: str) -> planes.Scratch:
        """A spare scratch set last used by a call of ``kind``, or a new one."""
        with self._lock:
            sets = self._scratch.get(kind)
            return sets.pop() if sets else planes.Scratch()

    def keep(self, buffers: list[np.ndarray], scratch: list[planes.Scratch], kind: str) -> None:
        """Keep as many ``buffers`` as fit under :data:`SPARE_BYTES`, and the last few scratch sets
        of ``kind`` that fit under it too (a decoder's scratch grows with the block size)."""
        with self._lock:
            held = sum(b.size for b in self._buffers)
            for b in buffers:
                if held + b.size <= SPARE_BYTES:
                    self._buffers.append(b)
                    held += b.size
            kept: list[planes.Scratch] = []
            held = 0
            for sc in reversed(self._scratch.get(kind, []) + scratch):
                if len(kept) < _SPARE_SCRATCH and held + sc.nbytes <= SPARE_BYTES:
                    kept.append(sc)
                    held += sc.nbytes
            self._scratch[kind] = kept[::-1]


_SPARES = _Spares()


class _Pool:
    """Free uint8 buffers handed between the I/O thread and the workers, reused to avoid page faults.

    :meth:`take` returns a buffer of at least ``need`` bytes (``size`` when
    that is more, unless ``need`` is under a quarter of ``size``: then a
    fresh buffer of ``need`` bytes, which :meth:`give` drops); :meth:`give`
    returns it for reuse. The pool never holds
    more buffers than were in use at once, so it is bounded by the window of
    segments in flight. It starts with the spares of earlier calls and hands
    its free buffers back to them on :meth:`close`.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[np.ndarray] = _SPARES.buffers(size)
        self._lock = threading.Lock()

    def take(self, need: int) -> np.ndarray:
        if need < self.size // 4:  # small segments (a zip header, a pickle): the heap has room, no page faults
            return np.empty(need, dtype=np.uint8)
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):
                if self._free[i].size >= need:
                    return self._free.pop(i)
        return np.empty(max(need, self.size), dtype=np.uint8)

    def give(self, *bufs: np.ndarray) -> None:
        with self._lock:
            self._free.extend(b for b in bufs if b.size >= self.size)

    def close(self, workers: _Workers) -> None:
        """Hand the free buffers and the workers' scratch sets to later calls (only once every user is done)."""
        with self._lock:
            free, self._free = self._free, []
        _SPARES.keep(free, workers.scratch_sets(), workers.kind)


class _InOrder(Generic[_T]):
    """Hands the results of futures to ``handle`` on a thread of its own, in submission order.

    This takes the ordered output work (writing, the running checksum) off
    the thread that reads, so reading, coding and writing overlap. At most
    ``depth`` futures wait; :meth:`put` blocks beyond that. The first
    exception (from a future or from ``handle``) stops all further handling
    and is re-raised by :meth:`put` or :meth:`close`. As a context manager it
    closes on a clean exit and abandons when the block raises.
    """

    def __init__(self, handle: Callable[[_T], None], depth: int, name: str) -> None:
        self._handle = handle
        self._queue: queue.Queue[Future[_T] | None] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (future := self._queue.get()) is not None:
            if self._error is None and not self._stopped:
                try:
                    self._handle(future.result())
                except BaseException as exc:  # re-raised on the submitting thread
                    self._error = exc

    def put(self, future: Future[_T]) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(future)

    def close(self) -> None:
        """Wait until every result is handled; re-raise the first failure."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error

    def abandon(self) -> None:
        """Stop handling (after the result in hand) and wait for the thread to end."""
        self._stopped = True
        self._queue.put(None)
        self._thread.join()

    def __enter__(self) -> _InOrder[_T]:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abandon()


def _source_size(src: BinaryIO) -> int | None:
    try:
        return os.fstat(src.fileno()).st_size - src.tell()
    except (AttributeError, OSError, ValueError):
        pass
    try:
        if src.seekable():
            here = src.tell()
            end = src.seek(0, os.SEEK_END)
            src.seek(here)
            return end - here
    except (AttributeError, OSError, ValueError):
        pass
    return None


#: one block of input: (element width, transform, pooled buffer, byte count).
_Block = tuple[int, int, np.ndarray, int]


def _blocks(reader: PeekReader, payload: str, block: int, pool: _Pool) -> Iterator[_Block]:
    """Cut the stream into blocks read into pooled buffers, in stream order.

    The consumer owns each yielded buffer (and gives it back to ``pool``);
    the generator itself holds at most two buffers at a time.
    """
    pending: np.ndarray | None = None  # generic bytes waiting to fill a block
    filled = 0
    for width, transform, length in plan_regions(reader, payload):
        tensor = width > 1 and length is not None and length >= MIN_TENSOR_BYTES
        if not tensor:
            remaining = length if length is not None else -1
            while remaining:
                if pending is None:
                    pending, filled = pool.take(block), 0
                want = block - filled if remaining < 0 else min(block - filled, remaining)
                got = reader.readinto(pending.data[filled : filled + want])
                filled += got
                if filled >= block:
                    yield 1, planes.TRANSFORM_NONE, pending, filled
                    pending = None
                if got < want:
                    break  # end of stream
                remaining = remaining - got if remaining > 0 else remaining
            if length is None:
                break
            continue
        if pending is not None and filled:
            yield 1, planes.TRANSFORM_NONE, pending, filled
            pending = None
        assert length is not None
        step = block - block % width
        remaining = length
        while remaining:
            want = min(step, remaining)
            buf = pool.take(block)
            got = reader.readinto(buf.data[:want])
            whole = got - got % width
            if whole >= MIN_TENSOR_BYTES:
                tail = got - whole
                if tail:
                    pending, filled = pool.take(block), tail
                    pending[:tail] = buf[whole:got]
                yield width, transform, buf, whole
            else:
                pending, filled = buf, got  # nothing pending here: tails only come last
            remaining -= got
            if got < want:
                break  # end of stream, or a region longer than the stream
    if pending is not None and filled:
        yield 1, planes.TRANSFORM_NONE, pending, filled
    elif pending is not None:
        pool.give(pending)


@dataclass(slots=True)
class _Coded:
    """One coded segment: its header, payloads in order (raw ones are views of ``used``), plane modes,
    the pooled buffers to give back once written, and the CRC64NVME of its raw bytes."""

    head: bytes
    payloads: list[bytes | memoryview]
    modes: list[int]
    used: list[np.ndarray]
    kind: int
    raw_len: int
    crc64: int


def _encode_segment(
    workers: _Workers, pool: _Pool, offset: int, width: int, transform: int, buf: np.ndarray, n: int,
) -> _Coded:
    """Code one block; raw payloads are views of the returned buffers, valid until they are given back."""
    raw = buf[:n]
    raw_crc = checksums.crc64nvme(raw)
    coded: list[tuple[int, bytes | memoryview]]
    if width == 1:
        payload = workers.generic().compress(raw.data)
        if len(payload) >= n:
            coded = [(planes.PLANE_RAW, raw.data)]
        else:
            coded = [(planes.PLANE_ZSTD, payload)]
        kind = KIND_GENERIC
        keep = buf
    else:
        scratch = workers.scratch()
        keep = pool.take(n)
        split = planes.split_planes(raw, width, transform, out=keep, scratch=scratch)
        pool.give(buf)
        cctx = workers.plane()
        coded = [planes.encode_plane(split[k], cctx, scratch) for k in range(width)]
        kind = KIND_PLANES
    head = bytearray(_SEG_HEAD.pack(b"SG", kind, width, transform, offset, n, raw_crc))
    for mode, coded_payload in coded:
        head += _PLANE_ENTRY.pack(mode, len(coded_payload))
    head += _U32.pack(checksums.crc32c(head))
    return _Coded(bytes(head), [p for _, p in coded], [m for m, _ in coded], [keep], kind, n, raw_crc)


def encode(
    src: BinaryIO, dst: BinaryIO, *, name: str = "", level: int = 1, threads: int = 2, block_size: int = BLOCK_SIZE
) -> CodecStats:
    """Compress the stream ``src`` (read to EOF) into a ckz1 archive written to ``dst``.

    ``name`` (the original file name) is recorded in the header. ``level`` is
    the zstd level of generic segments; tensor planes always use the fast
    plane parameters of :func:`.codec_planes.plane_params`. ``threads`` (>= 1)
    worker threads code blocks in parallel; output is identical for any
    thread count. ``block_size`` (bytes, 64 KiB..64 MiB) bounds memory.
    ``src`` is read strictly forward and need not be seekable; ``dst`` is
    only appended to. Deterministic: the same input and arguments give the
    same archive bytes.
    """
    if threads < 1:
        raise ValueError(f"threads={threads}: need at least 1 worker thread")
    if not (1 << 16) <= block_size <= MAX_SEGMENT:
        raise ValueError(f"block_size={block_size}: must be between 64 KiB and {MAX_SEGMENT} bytes")
    started = time.perf_counter()
    size = _source_size(src)
    reader = PeekReader(src)
    payload = detect(reader.peek(16))
    header = {
        "codec": CODEC_ID,
        "version": CODEC_VERSION,
        "name": name,
        "size": size,
        "payload": payload,
        "level": level,
        "block_size": block_size,
        "checksum": "crc64nvme",
    }
    stats = CodecStats(name=name, payload=payload)
    header_json = json.dumps(header, sort_keys=True).encode("utf-8")
    head = _FILE_HEAD.pack(CODEC_VERSION, len(header_json)) + header_json
    written = _write(dst, MAGIC + head + _U32.pack(checksums.crc32c(head)))
    workers = _Workers(level, "encode")
    buffers = _Pool(block_size)
    crc = 0  # of the raw bytes read so far, or (with combine) of those written so far
    offset = 0
    count = 0

    def emit(coded: _Coded) -> None:
        nonlocal written, crc
        n = _write(dst, coded.head)
        for p in coded.payloads:
            n += _write(dst, p)
        written += n
        buffers.give(*coded.used)
        if _combine_crc64 is not None:
            crc = _combine_crc64(crc, coded.crc64, coded.raw_len)
        stats._count("generic" if coded.kind == KIND_GENERIC else "planes")
        for m in coded.modes:
            stats._count("plane_" + _MODE_NAMES[m])

    try:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckz-encode") as pool:
            with _InOrder(emit, 2 * threads, "ckz-encode-write") as out:
                for width, transform, buf, n in _blocks(reader, payload, block_size, buffers):
                    if _combine_crc64 is None:
                        crc = checksums.crc64nvme(buf.data[:n], crc)
                    out.put(pool.submit(
                        _encode_segment, workers, buffers, offset, width, transform, buf, n
                    ))
                    offset += n
                    count += 1
    finally:
        buffers.close(workers)  # every worker and the writer are done with them
    if size is not None and size != offset:
        raise IntegrityError(
            f"{name or 'stream'}: read {offset} bytes but the source said {size}; it changed while being archived, archive it again",
            key=name or None,
        )
    fields = _TRAILER.pack(b"EN", offset, count, crc)
    written += _write(dst, fields + _U32.pack(checksums.crc32c(fields)) + END_MAGIC)
    stats.raw_bytes, stats.stored_bytes, stats.crc64nvme = offset, written, f"{crc:016x}"
    stats.seconds = time.perf_counter() - started
    return stats


def _write(dst: BinaryIO, data: bytes | bytearray | memoryview) -> int:
    view = memoryview(data)
    total = 0
    while total < len(view):
        n = dst.write(view[total:])
        total += len(view) - total if n is None else n
    return total


class _ArchiveReader:
    """Reads exact byte counts from an archive and names it in every error."""

    def __init__(self, src: BinaryIO, label: str) -> None:
        self.src = src
        self.label = label
        self.consumed = 0

    def fail(self, what: str) -> IntegrityError:
        return IntegrityError(
            f"{self.label}: {what} (at archive byte {self.consumed}); the archive is damaged, restore from another copy",
            key=self.label,
        )

    def exact(self, n: int, what: str) -> bytes:
        data = self.src.read(n)
        while data is not None and len(data) < n:
            more = self.src.read(n - len(data))
            if not more:
                break
            data += more
        if data is None or len(data) < n:
            raise self.fail(f"truncated in the {what}")
        self.consumed += n
        return data

    def exact_into(self, view: memoryview, what: str) -> None:
        """Fill ``view`` from the archive (without an intermediate copy where ``src`` has ``readinto``)."""
        readinto = getattr(self.src, "readinto", None)
        filled = 0
        while filled < len(view):
            if readinto is not None:
                got = readinto(view[filled:]) or 0
            else:
                chunk = self.src.read(len(view) - filled) or b""
                got = len(chunk)
                view[filled : filled + got] = chunk
            if not got:
                raise self.fail(f"truncated in the {what}")
            filled += got
        self.consumed += filled


def _read_header(reader: _ArchiveReader) -> dict[str, Any]:
    magic = reader.src.read(len(MAGIC))
    if magic != MAGIC:
        raise IntegrityError(
            f"{reader.label}: not a {CODEC_ID} archive (starts with {magic[:8]!r}); decode only files written by ckptier's archive codec",
            key=reader.label,
        )
    reader.consumed = len(MAGIC)
    head = reader.exact(_FILE_HEAD.size, "file header")
    version, n = _FILE_HEAD.unpack(head)
    if version != CODEC_VERSION:
        raise IntegrityError(
            f"{reader.label}: {CODEC_ID} format version {version} is not supported (this ckptier reads {CODEC_VERSION}); upgrade ckptier",
            key=reader.label,
        )
    if n > MAX_HEADER:
        raise reader.fail(f"header length {n} is implausible")
    body = reader.exact(n, "file header")
    (crc,) = _U32.unpack(reader.exact(4, "file header"))
    if crc != checksums.crc32c(head + body):
        raise reader.fail("file header checksum mismatch")
    try:
        header: dict[str, Any] = json.loads(body)
    except ValueError as exc:
        raise reader.fail("file header is not JSON") from exc
    if header.get("codec") != CODEC_ID:
        raise reader.fail(f"header names codec {header.get('codec')!r}, expected {CODEC_ID!r}")
    return header


def describe(src: BinaryIO) -> dict[str, Any]:
    """Read and verify an archive's header; return it as a dict.

    Keys: ``codec``, ``version``, ``name``, ``size`` (original bytes, or None
    when the source size was unknown at encode time), ``payload``, ``level``,
    ``block_size``, ``checksum``. Reads only the header (a few hundred bytes);
    raises :class:`IntegrityError` on a non-archive or damaged header.
    """
    return _read_header(_ArchiveReader(src, getattr(src, "name", None) or "archive"))


@dataclass(slots=True)
class _Decoded:
    """One decoded, verified segment: its bytes (a view of ``used``), the pooled buffers to give back
    once written, and the CRC64NVME of the bytes."""

    data: memoryview
    used: list[np.ndarray]
    crc64: int


def _decode_segment(
    workers: _Workers, buffers: _Pool, label: str, kind: int, width: int, transform: int, raw_len: int,
    raw_crc: int, modes: list[int], payloads: list[memoryview], inbuf: np.ndarray,
) -> _Decoded:
    """Decode and verify one segment; return its bytes and the pooled buffers that hold them."""
    dctx = workers.decompressor()
    scratch = workers.scratch()
    used = [inbuf]
    in_place = kind == KIND_GENERIC and modes[0] == planes.PLANE_RAW
    crc: int | None = None  # computed while decoding, when the decoder does
    try:
        if in_place:
            if len(payloads[0]) != raw_len:
                raise ValueError(f"raw segment holds {len(payloads[0])} bytes, expected {raw_len}")
            out = payloads[0]
        else:
            outbuf = buffers.take(raw_len)
            used.append(outbuf)
            target = outbuf[:raw_len]
            if kind == KIND_GENERIC and modes[0] == planes.PLANE_ZSTD:
                planes._decompress_into(dctx, payloads[0], target, "segment data")
            elif kind == KIND_GENERIC:
                np.copyto(target, planes.decode_plane(modes[0], payloads[0], raw_len, dctx, scratch))
            else:
                crc = planes.decode_planes(modes, payloads, width, transform, target, dctx, scratch)
            out = target.data
    except ValueError as exc:
        buffers.give(*used)
        raise IntegrityError(f"{label}: {exc}; the archive is damaged, restore from another copy", key=label) from exc
    if (checksums.crc64nvme(out) if crc is None else crc) != raw_crc:
        buffers.give(*used)
        raise IntegrityError(
            f"{label}: segment checksum mismatch; the archive is damaged, restore from another copy", key=label
        )
    if not in_place:
        buffers.give(inbuf)  # every plane is decoded: the stored bytes are no longer needed
        used.remove(inbuf)
    return _Decoded(out, used, raw_crc)


@dataclass(slots=True)
class _Segment:
    """One segment as read from an archive: its header fields, plane modes and payloads (views of ``inbuf``)."""

    kind: int
    width: int
    transform: int
    raw_len: int
    raw_crc: int
    modes: list[int]
    payloads: list[memoryview]
    inbuf: np.ndarray


def _read_segment(reader: _ArchiveReader, buffers: _Pool, stats: CodecStats, expected_offset: int) -> _Segment | None:
    """Read and check the next segment header and its payloads; None at the trailer tag ``EN``
    (the rest of the trailer is left to the caller)."""
    tag = reader.exact(2, "segment table")
    if tag == b"EN":
        return None
    if tag != b"SG":
        raise reader.fail(f"unexpected segment tag {tag!r}")
    head = tag + reader.exact(_SEG_HEAD.size - 2, "segment header")
    _, kind, width, transform, seg_offset, raw_len, raw_crc = _SEG_HEAD.unpack(head)
    nplanes = 1 if kind == KIND_GENERIC else width
    if kind not in (KIND_GENERIC, KIND_PLANES) or (kind == KIND_PLANES and width not in planes.UINT_DTYPES):
        raise reader.fail(f"segment kind {kind} width {width} is invalid")
    table = reader.exact(_PLANE_ENTRY.size * nplanes, "segment header")
    (head_crc,) = _U32.unpack(reader.exact(4, "segment header"))
    if head_crc != checksums.crc32c(head + table):
        raise reader.fail("segment header checksum mismatch")
    if seg_offset != expected_offset or raw_len > MAX_SEGMENT or raw_len % (width if nplanes > 1 else 1):
        raise reader.fail(f"segment at raw offset {seg_offset} (length {raw_len}) does not follow {expected_offset}")
    entries = [_PLANE_ENTRY.unpack_from(table, i * _PLANE_ENTRY.size) for i in range(nplanes)]
    plane_size = raw_len // nplanes
    for mode, stored in entries:
        if stored > plane_size + 64:
            raise reader.fail(f"plane of {stored} stored bytes is larger than its {plane_size} raw bytes")
        stats._count("plane_" + _MODE_NAMES.get(mode, "unknown"))
    stats._count("generic" if kind == KIND_GENERIC else "planes")
    total = sum(stored for _, stored in entries)
    inbuf = buffers.take(total)
    data = inbuf.data[:total]
    try:
        reader.exact_into(data, "segment data")
    except IntegrityError:
        buffers.give(inbuf)
        raise
    payloads = []
    at = 0
    for _, stored in entries:
        payloads.append(data[at : at + stored])
        at += stored
    return _Segment(kind, width, transform, raw_len, raw_crc, [m for m, _ in entries], payloads, inbuf)


def _decode(workers: _Workers, buffers: _Pool, label: str, seg: _Segment) -> _Decoded:
    return _decode_segment(workers, buffers, label, seg.kind, seg.width, seg.transform, seg.raw_len, seg.raw_crc,
                           seg.modes, seg.payloads, seg.inbuf)


class _Relay:
    """Decoding without reader and writer threads: each of ``threads`` workers (the calling thread is one)
    takes the next segment from the archive, decodes and checks it, and hands it on to be written in order.

    Reading is serialised by one lock, so the archive is read strictly
    forward. A decoded segment whose turn has not come is parked and its
    worker goes on with the next one, instead of waiting: segments differ
    widely in cost (a small generic segment between two 2 MiB tensor blocks),
    and a worker that waited behind each one would leave the others' cores
    idle. Whoever parks the segment whose turn it is writes it, and every
    parked one that follows in order, one writer at a time, so each segment
    is written only after every one before it. A worker reads no further
    while ``window`` segments, or ``window_bytes`` raw bytes of them, are
    read and not yet written (some always may be: the one whose turn it is). The first
    failure (by segment number) stops every worker at its next step and is
    the one raised; the segments before it are still written (the longest
    verified prefix), those after it are dropped.
    """

    def __init__(self, reader: _ArchiveReader, dst: BinaryIO, workers: _Workers, buffers: _Pool,
                 stats: CodecStats, label: str, window: int, window_bytes: int) -> None:
        self.reader, self.dst, self.workers, self.buffers, self.stats, self.label = (
            reader, dst, workers, buffers, stats, label)
        self.window, self.window_bytes = window, window_bytes
        self.pending_bytes = 0  # raw bytes of the segments read and not yet written
        self.read_lock = threading.Lock()
        self.state = threading.Condition()  # guards everything below but the reading fields
        self.next_read = 0  # segment number the next read gets (under read_lock)
        self.expected_offset = 0  # (under read_lock)
        self.ended = False  # the trailer tag was read (under read_lock)
        self.next_write = 0  # segment number whose turn it is to be written
        self.parked: dict[int, _Decoded] = {}
        self.writing = False  # a worker is writing parked segments
        self.error: tuple[int, BaseException] | None = None
        self.crc = 0
        self.offset = 0

    def fail(self, index: int, exc: BaseException) -> None:
        with self.state:
            if self.error is None or index < self.error[0]:
                self.error = (index, exc)
            self.state.notify_all()

    def _read(self) -> tuple[int, _Segment] | None:
        """The next segment and its number, or None at the end, after a failure, or on a read failure."""
        with self.read_lock:
            with self.state:
                while self.error is None and self.next_read > self.next_write and (
                        self.next_read - self.next_write >= self.window or self.pending_bytes >= self.window_bytes):
                    self.state.wait()
                if self.error is not None:
                    return None
            if self.ended:
                return None
            index = self.next_read
            try:
                seg = _read_segment(self.reader, self.buffers, self.stats, self.expected_offset)
            except BaseException as exc:
                self.fail(index, exc)
                return None
            if seg is None:
                self.ended = True
                return None
            self.next_read += 1
            self.expected_offset += seg.raw_len
            with self.state:
                self.pending_bytes += seg.raw_len
            return index, seg

    def run(self) -> None:
        while (item := self._read()) is not None:
            index, seg = item
            try:
                decoded = _decode(self.workers, self.buffers, self.label, seg)
            except BaseException as exc:
                self.fail(index, exc)
                return
            self._park(index, decoded)

    def _park(self, index: int, decoded: _Decoded) -> None:
        """Hand a decoded segment on; write it and those parked after it if its turn has come."""
        with self.state:
            if self.error is not None and self.error[0] < index:
                self.buffers.give(*decoded.used)  # never to be written
                return
            self.parked[index] = decoded
            if self.writing:
                return  # the worker writing now will reach it, or the one that parks its predecessor
            self.writing = True
        while True:
            with self.state:
                turn = self.next_write
                item = self.parked.pop(turn, None)
                if item is None or (self.error is not None and self.error[0] <= turn):
                    if item is not None:
                        self.buffers.give(*item.used)
                    self.writing = False
                    return
            try:
                _write(self.dst, item.data)
            except BaseException as exc:
                self.buffers.give(*item.used)
                with self.state:
                    self.writing = False
                self.fail(turn, exc)
                return
            self.buffers.give(*item.used)
            with self.state:
                if _combine_crc64 is not None:
                    self.crc = _combine_crc64(self.crc, item.crc64, len(item.data))
                else:
                    self.crc = checksums.crc64nvme(item.data, self.crc)
                self.offset += len(item.data)
                self.pending_bytes -= len(item.data)
                self.next_write += 1
                self.state.notify_all()

    def go(self, threads: int) -> int:
        """Run ``threads`` workers to the end of the segments; return the segment count or raise the first error."""
        helpers = [threading.Thread(target=self.run, name=f"ckz-decode_{i}", daemon=True) for i in range(threads - 1)]
        for t in helpers:
            t.start()
        try:
            self.run()
        finally:
            for t in helpers:
                t.join()
            with self.state:
                left, self.parked = list(self.parked.values()), {}
            for item in left:  # after a failure: segments that came after it
                self.buffers.give(*item.used)
        if self.error is not None:
            raise self.error[1]
        return self.next_read


def decode(src: BinaryIO, dst: BinaryIO, *, threads: int = 2) -> CodecStats:
    """Decompress a ckz1 archive from ``src`` and write the original bytes to ``dst``.

    Every segment is verified (zstd content checksums, CRC64NVME) before its bytes
    are written; at the end the CRC64NVME and size in the trailer are checked
    and nothing may follow the trailer. On any failure :class:`IntegrityError`
    names the archive and what is wrong; ``dst`` then holds at most a verified
    prefix of the original and must be discarded. ``src`` is read strictly
    forward.
    """
    if threads < 1:
        raise ValueError(f"threads={threads}: need at least 1 worker thread")
    started = time.perf_counter()
    reader = _ArchiveReader(src, getattr(src, "name", None) or "archive")
    header = _read_header(reader)
    label = str(header.get("name") or reader.label)
    reader.label = label
    stats = CodecStats(name=label, payload=str(header.get("payload", "")))
    workers = _Workers(1, "decode")
    block = header.get("block_size")
    buffers = _Pool(block if isinstance(block, int) and 0 < block <= MAX_SEGMENT else BLOCK_SIZE)
    relay = _Relay(reader, dst, workers, buffers, stats, label, window=8 * threads,
                   window_bytes=2 * threads * buffers.size)
    try:
        count = relay.go(threads)
    finally:
        buffers.close(workers)  # every worker is done with them
    crc, offset = relay.crc, relay.offset
    fields = b"EN" + reader.exact(_TRAILER.size - 2, "trailer")
    _, raw_size, n_segments, trailer_crc = _TRAILER.unpack(fields)
    (fields_crc,) = _U32.unpack(reader.exact(4, "trailer"))
    end = reader.exact(len(END_MAGIC), "trailer")
    if fields_crc != checksums.crc32c(fields) or end != END_MAGIC:
        raise reader.fail("trailer checksum mismatch")
    if raw_size != offset or n_segments != count:
        raise reader.fail(f"trailer says {raw_size} bytes in {n_segments} segments, found {offset} in {count}")
    if header.get("size") is not None and header["size"] != offset:
        raise reader.fail(f"header says {header['size']} bytes, decoded {offset}")
    if trailer_crc != crc:
        raise reader.fail(f"CRC64NVME of the decoded bytes is {crc:016x}, the archive recorded {trailer_crc:016x}")
    if src.read(1):
        raise reader.fail("unexpected bytes after the trailer")
    stats.raw_bytes, stats.stored_bytes, stats.crc64nvme = offset, reader.consumed, f"{crc:016x}"
    stats.seconds = time.perf_counter() - started
    return stats
