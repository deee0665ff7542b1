"""Where the tensors are: a streaming layout planner for the archive codec.

The planner walks a byte stream once, front to back, and yields *regions*
``(width, transform, length)``: ``width`` is the element size in bytes of a
tensor payload (1 = anything else), ``transform`` is a ``TRANSFORM_*`` of
:mod:`.codec_planes`, ``length`` is a byte count or ``None`` for "to the end
of the stream". Regions are hints only: the encoder stores every byte exactly
whatever they say, so a wrong guess costs compression, never correctness.

Recognised payloads:

* ``torch.save`` zip archives. Members are stored uncompressed and, from a
  streaming writer, carry no sizes in their local headers, so ``data.pkl``
  (the first member) is read *without executing it* to learn each storage's
  dtype and element count, which give each ``data/<key>`` member's length.
* safetensors: the JSON header gives dtype and offsets per tensor.
* anything else (DCP ``.distcp`` shards, unknown binaries): one generic region.

The pickle is loaded by :class:`_InertUnpickler`, whose ``find_class`` returns
an inert placeholder class for every global: no module is imported and no
real callable is ever reached, so a malicious ``__reduce__`` does nothing.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import struct
from collections.abc import Generator, Iterator
from typing import Any, BinaryIO

from .codec_planes import TRANSFORM_NONE, TRANSFORM_ROTL1

Region = tuple[int, int, int | None]

#: the largest data.pkl or safetensors header the planner reads into memory.
MAX_METADATA = 64 << 20

PAYLOAD_TORCH = "torch-zip"
PAYLOAD_SAFETENSORS = "safetensors"
PAYLOAD_BYTES = "bytes"

_LOCAL = b"PK\x03\x04"
_CENTRAL = b"PK\x01\x02"
_LOCAL_HEAD = struct.Struct("<4sHHHHHIIIHH")
_RESYNC_WINDOW = 64 << 10
_FIRST_PEEK = 64 << 10
_DATA_MEMBER = re.compile(rb"(?:^|/)data/([^/]+)$")

#: legacy torch storage class -> (element width, transform).
TORCH_STORAGES: dict[str, tuple[int, int]] = {
    "torch.FloatStorage": (4, TRANSFORM_ROTL1),
    "torch.DoubleStorage": (8, TRANSFORM_ROTL1),
    "torch.HalfStorage": (2, TRANSFORM_ROTL1),
    "torch.BFloat16Storage": (2, TRANSFORM_ROTL1),
    "torch.ComplexFloatStorage": (4, TRANSFORM_ROTL1),
    "torch.ComplexDoubleStorage": (8, TRANSFORM_ROTL1),
    "torch.LongStorage": (8, TRANSFORM_NONE),
    "torch.IntStorage": (4, TRANSFORM_NONE),
    "torch.ShortStorage": (2, TRANSFORM_NONE),
}

#: safetensors dtype -> (element width, transform).
SAFETENSORS_DTYPES: dict[str, tuple[int, int]] = {
    "F64": (8, TRANSFORM_ROTL1),
    "F32": (4, TRANSFORM_ROTL1),
    "F16": (2, TRANSFORM_ROTL1),
    "BF16": (2, TRANSFORM_ROTL1),
    "I64": (8, TRANSFORM_NONE),
    "U64": (8, TRANSFORM_NONE),
    "I32": (4, TRANSFORM_NONE),
    "U32": (4, TRANSFORM_NONE),
    "I16": (2, TRANSFORM_NONE),
    "U16": (2, TRANSFORM_NONE),
}


class PeekReader:
    """A forward-only reader over ``src`` that can look ahead without consuming.

    Look-ahead is buffered, so a caller must keep peeks small (bounded by
    :data:`MAX_METADATA`).
    """

    def __init__(self, src: BinaryIO) -> None:
        self._src = src
        self._buf = bytearray()

    def peek(self, n: int) -> bytes:
        """Up to ``n`` bytes from the current position (fewer only at EOF)."""
        while len(self._buf) < n:
            chunk = self._src.read(max(n - len(self._buf), 1 << 16))
            if not chunk:
                break
            self._buf += chunk
        return bytes(self._buf[:n])

    def readinto(self, view: memoryview) -> int:
        """Fill ``view`` as far as the stream allows; return the byte count (0 = EOF)."""
        filled = 0
        if self._buf:
            filled = min(len(self._buf), len(view))
            view[:filled] = self._buf[:filled]
            del self._buf[:filled]
        readinto = getattr(self._src, "readinto", None)
        while filled < len(view):
            if readinto is not None:
                got = readinto(view[filled:])
            else:
                chunk = self._src.read(len(view) - filled)
                got = len(chunk)
                view[filled : filled + got] = chunk
            if not got:
                break
            filled += got
        return filled


class _Inert:
    """Stand-in for every global a pickle names; accepts and ignores everything."""

    qualname = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass


class _InertUnpickler(pickle.Unpickler):
    """Loads a torch ``data.pkl`` for its storage records only; executes nothing."""

    def __init__(self, stream: io.BytesIO) -> None:
        super().__init__(stream)
        self.storages: dict[str, tuple[str, int]] = {}

    def find_class(self, module: str, name: str) -> type:
        return type("Inert", (_Inert,), {"qualname": f"{module}.{name}"})

    def persistent_load(self, pid: Any) -> _Inert:
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage":
            _, storage_type, key, _location, numel = pid
            type_name = getattr(storage_type, "qualname", "")
            if isinstance(key, str) and isinstance(numel, int) and numel >= 0:
                self.storages[key] = (type_name, numel)
        return _Inert()


def torch_storages(data_pkl: bytes) -> tuple[dict[str, tuple[str, int]], int]:
    """Parse a torch ``data.pkl`` without executing it.

    Returns ``({storage key: (storage class name, element count)}, pickle
    length in bytes)``. Raises whatever a malformed pickle raises
    (``pickle.UnpicklingError``, ``EOFError``, ...); callers treat any
    exception as "no hints".
    """
    stream = io.BytesIO(data_pkl)
    unpickler = _InertUnpickler(stream)
    unpickler.load()
    return unpickler.storages, stream.tell()


def detect(head: bytes) -> str:
    """Name the payload kind from the first bytes of a stream."""
    if head.startswith(_LOCAL):
        return PAYLOAD_TORCH
    if len(head) >= 9:
        (n,) = struct.unpack_from("<Q", head)
        if 2 <= n <= MAX_METADATA and head[8:9] == b"{":
            return PAYLOAD_SAFETENSORS
    return PAYLOAD_BYTES


def plan_regions(reader: PeekReader, payload: str) -> Iterator[Region]:
    """Yield the regions of the stream behind ``reader``, in order.

    The consumer must consume exactly each region's length from ``reader``
    (or up to EOF) before asking for the next one.
    """
    if payload == PAYLOAD_TORCH:
        yield from _torch_regions(reader)
    elif payload == PAYLOAD_SAFETENSORS:
        yield from _safetensors_regions(reader)
    else:
        yield 1, TRANSFORM_NONE, None


def _safetensors_regions(reader: PeekReader) -> Iterator[Region]:
    head = reader.peek(8)
    (n,) = struct.unpack("<Q", head)
    try:
        header = json.loads(reader.peek(8 + n)[8:])
        tensors = sorted(
            (int(v["data_offsets"][0]), int(v["data_offsets"][1]), str(v["dtype"]))
            for k, v in header.items()
            if k != "__metadata__"
        )
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError):
        yield 1, TRANSFORM_NONE, None
        return
    cursor = 0  # relative to the start of the data section
    yield 1, TRANSFORM_NONE, 8 + n
    for begin, end, dtype in tensors:
        if begin < cursor or end < begin:
            break  # overlapping or odd offsets: leave the rest to the generic coder
        if begin > cursor:
            yield 1, TRANSFORM_NONE, begin - cursor
        width, transform = SAFETENSORS_DTYPES.get(dtype, (1, TRANSFORM_NONE))
        yield width, transform, end - begin
        cursor = end
    yield 1, TRANSFORM_NONE, None


def _torch_regions(reader: PeekReader) -> Iterator[Region]:
    storages: dict[str, tuple[str, int]] = {}
    while True:
        head = reader.peek(_LOCAL_HEAD.size)
        if len(head) < _LOCAL_HEAD.size or head[:4] != _LOCAL:
            break
        _sig, _ver, flags, method, _t, _d, _crc, csize, _usize, nlen, elen = _LOCAL_HEAD.unpack(head)
        header_len = _LOCAL_HEAD.size + nlen + elen
        name = reader.peek(header_len)[_LOCAL_HEAD.size : _LOCAL_HEAD.size + nlen]
        yield 1, TRANSFORM_NONE, header_len
        size: int | None = None
        if not flags & 0x08 and csize != 0xFFFFFFFF:
            size = csize
        width, transform = 1, TRANSFORM_NONE
        if name == b"data.pkl" or name.endswith(b"/data.pkl"):
            storages, pickle_len = _peek_storages(reader, size)
            if size is None and pickle_len:
                size = pickle_len
        elif method == 0 and (match := _DATA_MEMBER.search(name)) is not None:
            record = storages.get(match.group(1).decode("utf-8", "replace"))
            if record is not None and record[0] in TORCH_STORAGES:
                width, transform = TORCH_STORAGES[record[0]]
                if size is None:
                    size = record[1] * width
        if size is not None:
            yield width, transform, size
        if not (yield from _resync(reader)):
            break
    yield 1, TRANSFORM_NONE, None


def _peek_storages(reader: PeekReader, size: int | None) -> tuple[dict[str, tuple[str, int]], int]:
    """Parse the ``data.pkl`` ahead of ``reader`` without consuming it; ``({}, 0)`` when it cannot be read.

    With an unknown member size (a streaming writer), look ahead in growing
    steps (64 KiB, x4 each time, up to :data:`MAX_METADATA`) rather than
    buffering the largest possible pickle: a truncated pickle always fails to
    parse, so the first step that parses holds all of it.
    """
    want = min(size, MAX_METADATA) if size is not None else min(_FIRST_PEEK, MAX_METADATA)
    while True:
        body = reader.peek(want)
        try:
            return torch_storages(body)
        except Exception:  # any malformed or truncated pickle: keep the bytes, lose the hints
            if size is not None or len(body) < want or want >= MAX_METADATA:
                return {}, 0
        want = min(want * 4, MAX_METADATA)


def _resync(reader: PeekReader) -> Generator[Region, None, bool]:
    """Yield generic regions up to the next local header; return False if none follows."""
    while True:
        window = reader.peek(_RESYNC_WINDOW)
        at = window.find(_LOCAL)
        central = window.find(_CENTRAL)
        if at >= 0 and (central < 0 or at < central):
            if at:
                yield 1, TRANSFORM_NONE, at
            return True
        if central >= 0 or len(window) < _RESYNC_WINDOW:
            return False
        yield 1, TRANSFORM_NONE, len(window) - 3
