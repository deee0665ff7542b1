"""Structural checks of checkpoint files, at streaming speed, in the hashing pass.

Formats that record no hashes of their own still carry enough structure to
tell a whole file from a torn one. A :class:`Checker` is fed the same
chunks the verifier hashes (:func:`ckptier.storage.hashing.hash_file`'s
``observe``), never seeks and never re-reads, and at the end says what is
wrong (one line) and which other files the checkpoint must hold. Pure: no
I/O, no clock; nothing here imports torch, and nothing a file holds is ever
executed.

Checked here, by file name (:func:`data_checker`), whatever the format:

* torch zip files (``.pt``, ``.pth``, ``.bin``, ``.ckpt`` that start with a
  zip local header; torch.save, Lightning): every local header, every
  member's CRC-32 against its data descriptor or header, the central
  directory against the members seen (name, offset, CRC-32, size), and the
  (zip64) end of central directory record against the central directory;
  the file must end right after it. Torch writes members without sizes in
  their local headers (data descriptors follow the data): a member's length
  comes from ``data.pkl`` (parsed by the inert unpickler of
  :mod:`.codec_layout`: storage element counts) or, for small members, from
  its data descriptor. A deflated member is inflated as it streams past,
  through one ``decompressobj`` with an output cap per call
  (``decompress(data, max_length)``), never more than the size its headers
  declare nor :data:`MAX_INFLATED` in all: a zip bomb (1 MB holding 1 GiB)
  costs time, never memory. A ``.pt`` that is not a zip (the legacy
  format) is not checked.
* safetensors: the 8-byte header length (at most 100 MB), the JSON header,
  each tensor's dtype, shape and offsets (``end - begin`` = elements × dtype
  size, tensors contiguous from 0) against the file size.
* manifests, through :func:`manifest_checker`: each format's plug-in
  (:mod:`ckptier.formats`) parses its own and names the files the checkpoint
  must hold (:class:`Need`); manifests are buffered whole, up to
  :data:`MAX_MANIFEST` bytes, and JSON is parsed only within
  :data:`MAX_JSON_DEPTH` levels and :data:`MAX_JSON_VALUES` values
  (:func:`parse_json`).

Memory stays within a fixed bound whatever a file holds: the read buffer,
one inflate window, and the largest header or manifest read whole.

CRC-32 runs at memory speed only with a CLMUL implementation: zlib-ng's
(~35 GB/s per core here) is used when installed, else zlib's (~3-4 GB/s;
awscrt's ``crc32`` measured 2-3 GB/s on this machine's x86 CPU, so it is not
used).
"""

from __future__ import annotations

import json
import math
import re
import struct
import zlib
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .records import Shortfall

try:  # CLMUL CRC-32: ~10x zlib's (see the module docstring)
    from zlib_ng.zlib_ng import crc32 as _crc32
except ImportError:  # pragma: no cover - depends on the install
    from zlib import crc32 as _crc32

__all__ = [
    "MAX_INFLATED",
    "MAX_JSON_DEPTH",
    "MAX_JSON_VALUES",
    "MAX_MANIFEST",
    "Checker",
    "Need",
    "Structure",
    "StructureError",
    "crc32",
    "data_checker",
    "manifest_checker",
    "parse_json",
    "shortfalls",
]

#: Largest manifest (bytes) buffered and parsed; larger ones are noted, not parsed.
MAX_MANIFEST = 64 << 20
#: Largest safetensors JSON header (the format's own limit).
MAX_SAFETENSORS_HEADER = 100_000_000
#: Data descriptors of members of unknown length are looked for this far at most.
MAX_DESCRIPTOR_SEARCH = 64 << 20
#: A torch zip's ``data.pkl`` is parsed (for the storages' lengths) only up to this size.
MAX_PICKLE = 16 << 20
#: Bytes inflated in all, per file, to check deflated members' CRC-32s; members past it are noted.
MAX_INFLATED = 4 << 30
#: Bytes one inflate call may produce (the output cap of ``decompressobj().decompress``).
INFLATE_CHUNK = 1 << 20
#: Deepest nesting of arrays and objects a JSON manifest may have.
MAX_JSON_DEPTH = 64
#: Most values (array items, object members) a JSON manifest may hold.
MAX_JSON_VALUES = 1_000_000

crc32: Callable[..., int] = _crc32

_ZIP_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


class StructureError(ValueError):
    """A file's structure is broken; the message says how, in one line."""


@dataclass(frozen=True, slots=True)
class Need:
    """A file a manifest requires: ``relpath`` relative to the checkpoint (a
    trailing ``/``: a directory holding at least one file), ``size`` in
    bytes (``None``: presence only), ``exact`` (the manifest records the
    exact size, else ``size`` is a minimum), and the manifest's name."""

    relpath: str
    manifest: str
    size: int | None = None
    exact: bool = False


@dataclass(frozen=True)
class Structure:
    """What a :class:`Checker` found: ``problem`` (``None`` when the file is
    whole), ``needs`` (files the checkpoint must hold, from a manifest) and
    ``notes`` (what could not be checked, and why)."""

    kind: str
    problem: str | None = None
    needs: tuple[Need, ...] = ()
    notes: tuple[str, ...] = ()


def shortfalls(needs: Iterable[Need], present: Mapping[str, int], *, also_present: Iterable[str] = ()) -> list[Shortfall]:
    """The ``needs`` that ``present`` (relpath -> size in bytes) does not meet,
    sorted by relpath. ``also_present`` are relpaths known to exist with no
    size known (they satisfy any need). Several needs of one file combine
    (the largest size counts)."""
    merged: dict[str, Need] = {}
    for n in needs:
        old = merged.get(n.relpath)
        if old is None or (n.size or 0) > (old.size or 0):
            merged[n.relpath] = n
    others = set(also_present)
    dirs: set[str] = set()
    for rel in (*present, *others):
        cut = rel.find("/")
        while cut >= 0:
            dirs.add(rel[: cut + 1])
            cut = rel.find("/", cut + 1)
    out: list[Shortfall] = []
    for rel, n in sorted(merged.items()):
        if rel.endswith("/"):
            if rel not in dirs:
                out.append(Shortfall(rel, n.manifest))
            continue
        if rel in others:
            continue
        have = present.get(rel)
        if have is None:
            out.append(Shortfall(rel, n.manifest, None, n.size, n.exact))
        elif n.size is not None and (have != n.size if n.exact else have < n.size):
            out.append(Shortfall(rel, n.manifest, have, n.size, n.exact))
    return out


# -- manifests (pure functions of their parsed content) --------------------------------


# -- checkers ---------------------------------------------------------------------------


class Checker:
    """Feed a file's bytes in order with :meth:`feed`, then call :meth:`finish` once.

    ``feed`` accepts any buffer and keeps no reference to it (the caller
    reuses its read buffer); memory stays bounded by the largest header or
    manifest read whole. Never raises for bad content: :meth:`finish` reports it.
    """

    def __init__(self, kind: str, parser: Callable[[Checker], Generator[tuple[Any, ...], Any, None]]) -> None:
        self.kind = kind
        self._gen = parser(self)
        self._buf = bytearray()  # bytes received and not yet consumed
        self._problem: str | None = None
        self._notes: list[str] = []
        self._needs: list[Need] = []
        self._done = False
        self._left = 0  # bytes still to consume for a crc/skip request
        self._crc = 0
        self._req: tuple[Any, ...] = ("end",)
        self._inflate: Any = None  # the decompressobj of an "inflate" request
        self._inflated = 0  # bytes it produced so far
        self._advance(None)

    # The parser (a generator) yields requests and is sent their answers:
    #   ("read", n, where) -> n bytes, consumed
    #   ("peek", n, where) -> up to n bytes (fewer only at the end), not consumed
    #   ("crc", n, where)  -> CRC-32 of the next n bytes, consumed
    #   ("skip", n, where) -> None, n bytes consumed
    #   ("inflate", n, where, cap, name) -> (CRC-32, size) of what the next n
    #                         bytes (raw deflate) inflate to, consumed; more than
    #                         cap inflated bytes, or a damaged stream, fails the
    #                         file (the message starts with ``name``)
    #   ("end",)           -> the file must end here
    # ``where`` completes "the file ends ..." when the bytes run out. The
    # parser raises StructureError for a broken file.

    def _advance(self, answer: Any) -> None:
        try:
            self._req = self._gen.send(answer)
        except StopIteration:
            self._req = ("end",)
        except StructureError as exc:
            self._fail(str(exc))
            return
        if self._req[0] in ("crc", "skip", "inflate"):
            self._left = self._req[1]
            self._crc = 0
        if self._req[0] == "inflate":
            self._inflate = zlib.decompressobj(-15)
            self._inflated = 0

    def _inflate_some(self, data: bytes | bytearray | memoryview) -> None:
        """Inflate ``data`` (part of an "inflate" request) with a bounded output per call."""
        d = self._inflate
        cap = self._req[3]
        chunk: Any = data
        while chunk:
            try:
                out = d.decompress(chunk, INFLATE_CHUNK)
            except zlib.error as exc:
                raise StructureError(f"{self._req[4]}: deflate data is damaged ({exc})") from None
            self._inflated += len(out)
            if self._inflated > cap:
                raise StructureError(f"{self._req[4]}: inflates past the {cap} bytes its headers declare "
                                     "(a zip bomb, or damaged data)")
            self._crc = crc32(out, self._crc)
            chunk = d.unconsumed_tail
            if d.eof:
                if chunk or d.unused_data:
                    raise StructureError(f"{self._req[4]}: deflate stream ends before the member does")
                return

    def _inflate_done(self) -> tuple[int, int]:
        d = self._inflate
        self._inflate = None
        if not d.eof:
            raise StructureError(f"{self._req[4]}: deflate stream is cut short")
        return self._crc, self._inflated

    def _fail(self, problem: str) -> None:
        self._problem = problem
        self._done = True
        self._buf = bytearray()

    def note(self, text: str) -> None:
        self._notes.append(text)

    def need(self, needs: Iterable[Need]) -> None:
        self._needs.extend(needs)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        view = data if isinstance(data, memoryview) else memoryview(data)
        pos, end = 0, len(view)
        while not self._done:
            kind = self._req[0]
            if kind in ("crc", "skip", "inflate"):
                if self._left == 0:
                    if kind == "inflate":
                        try:
                            answer: Any = self._inflate_done()
                        except StructureError as exc:
                            self._fail(str(exc))
                            return
                    else:
                        answer = self._crc if kind == "crc" else None
                    self._advance(answer)
                    continue
                if self._buf:
                    take = min(self._left, len(self._buf))
                    part: Any = self._buf[:take]
                    del self._buf[:take]
                else:
                    if pos >= end:
                        return
                    take = min(self._left, end - pos)
                    part = view[pos : pos + take]
                    pos += take
                if kind == "crc":
                    self._crc = crc32(part, self._crc)
                elif kind == "inflate":
                    try:
                        self._inflate_some(part)
                    except StructureError as exc:
                        self._fail(str(exc))
                        return
                self._left -= take
            elif kind in ("read", "peek"):
                n = self._req[1]
                if len(self._buf) < n:
                    if pos >= end:
                        return
                    take = min(n - len(self._buf), end - pos)
                    self._buf += view[pos : pos + take]
                    pos += take
                    continue
                out = bytes(self._buf[:n])
                if kind == "read":
                    del self._buf[:n]
                self._advance(out)
            elif kind == "rest":
                self._buf = bytearray()
                return
            else:  # "end"
                if self._buf or pos < end:
                    extra = len(self._buf) + end - pos
                    self._fail(f"{extra}+ bytes after where the file should end (trailing data, or two files in one)")
                return

    def finish(self) -> Structure:
        """The verdict, once every byte was fed. Idempotent."""
        answered_short = -1
        while not self._done:
            self.feed(b"")  # whatever the buffered bytes can still answer
            if self._done:
                break
            kind = self._req[0]
            if kind in ("end", "rest"):
                self._done = True
            elif kind == "peek" and answered_short != len(self._buf):
                answered_short = len(self._buf)
                self._advance(bytes(self._buf))  # a short answer: the file ends here
            else:
                self._fail(f"truncated: the file ends {self._req[2]}")
        return Structure(self.kind, self._problem, tuple(self._needs), tuple(self._notes))


def data_checker(relpath: str) -> Checker | None:
    """A checker for a data file with a structure of its own (torch zip,
    safetensors), judged by its name, or ``None``. Manifests are checked by
    their format's plug-in (:meth:`ckptier.formats.base.FormatPlugin.checker`)."""
    name = relpath[relpath.rfind("/") + 1 :]
    if name.endswith(".safetensors"):
        return Checker("safetensors", _safetensors)
    if name.endswith(_ZIP_SUFFIXES):
        return Checker("torch zip", _zip)
    return None


# -- manifest parsers ---------------------------------------------------------------------


def manifest_checker(relpath: str, parse: Callable[[Checker, bytes], None]) -> Checker:
    """A checker that buffers a manifest whole (up to :data:`MAX_MANIFEST`
    bytes) and hands it to ``parse``, which notes, requires (``c.need``) or
    raises :class:`StructureError`."""

    def parser(c: Checker) -> Generator[tuple[Any, ...], Any, None]:
        data = yield ("peek", MAX_MANIFEST + 1, "")
        if len(data) > MAX_MANIFEST:
            c.note(f"{c.kind}: over {MAX_MANIFEST} bytes, not parsed")
            yield ("rest",)
            return
        parse(c, data)
        yield ("skip", len(data), "")
        yield ("end",)

    return Checker(relpath[relpath.rfind("/") + 1 :], parser)


#: A JSON string (with its escapes), to take strings out before counting structure.
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
#: Every byte but the four that open and close arrays and objects (for ``bytes.translate``).
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_problem(data: bytes, *, max_depth: int = MAX_JSON_DEPTH, max_values: int = MAX_JSON_VALUES) -> str | None:
    """Why ``data`` must not be parsed as JSON here, or None: nested deeper than
    ``max_depth`` or holding more than ``max_values`` values (a parse would
    cost memory out of proportion to any manifest). Counted on the bytes
    with strings taken out, at C speed but for one step per bracket."""
    bare = _JSON_STRING.sub(b'""', data) if b'"' in data else data
    if bare.count(b",") + bare.count(b":") > max_values:
        return f"holds more than {max_values} values (a manifest never does)"
    depth = deepest = 0
    for b in bare.translate(None, _NOT_BRACKETS):
        if b in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > max_depth:
                    return f"nested deeper than {max_depth} levels"
        else:
            depth -= 1
    return None


def parse_json(data: bytes, label: str) -> Any:
    """``data`` as JSON, within :func:`json_problem`'s bounds; :class:`StructureError`
    naming ``label`` and the position (or the bound) otherwise."""
    problem = json_problem(data)
    if problem is not None:
        raise StructureError(f"{label}: JSON {problem}; not parsed")
    try:
        return json.loads(data)
    except json.JSONDecodeError as exc:
        raise StructureError(f"{label}: not valid JSON (line {exc.lineno} col {exc.colno})") from None
    except UnicodeDecodeError:
        raise StructureError(f"{label}: not valid UTF-8 text") from None
    except RecursionError:
        raise StructureError(f"{label}: JSON nested too deeply") from None
    except ValueError as exc:  # an integer of more digits than Python converts (4,300)
        raise StructureError(f"{label}: not valid JSON ({str(exc).split(':')[0].lower()})") from None


# -- safetensors ----------------------------------------------------------------------------

#: Bytes per element of each safetensors dtype (sub-byte dtypes: size not checked).
SAFETENSORS_WIDTHS = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}


def _safetensors(c: Checker) -> Generator[tuple[Any, ...], Any, None]:
    head = yield ("read", 8, "inside the 8-byte header length")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_SAFETENSORS_HEADER:
        raise StructureError(f"header length {n} bytes is over safetensors' {MAX_SAFETENSORS_HEADER}-byte limit")
    raw = yield ("read", n, f"inside the {n}-byte JSON header")
    header = parse_json(raw, "header")
    if not isinstance(header, dict):
        raise StructureError(f"header is a JSON {type(header).__name__}, not an object")
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise StructureError(f"tensor {name!r}: entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not (isinstance(shape, list) and all(_count(d) for d in shape)):
            raise StructureError(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)
                and offsets[0] <= offsets[1]):
            raise StructureError(f"tensor {name!r}: data_offsets {offsets!r} are not [begin, end]")
        width = SAFETENSORS_WIDTHS.get(dtype) if isinstance(dtype, str) else None
        if width is None:
            c.note(f"tensor {name!r}: dtype {dtype!r} unknown here; its size is not checked")
        elif offsets[1] - offsets[0] != math.prod(shape) * width:
            raise StructureError(
                f"tensor {name!r}: {dtype} {shape} needs {math.prod(shape) * width} bytes, "
                f"data_offsets span {offsets[1] - offsets[0]}"
            )
        spans.append((offsets[0], offsets[1], name))
    cursor = 0
    for begin, end, name in sorted(spans):
        if begin != cursor:
            raise StructureError(f"tensor {name!r} starts at data byte {begin}, expected {cursor} (gap or overlap)")
        cursor = end
    yield ("skip", cursor, f"inside the tensor data (the header says {cursor} bytes)")
    yield ("end",)


# -- torch zip --------------------------------------------------------------------------------

_LOCAL = b"PK\x03\x04"
_CENTRAL = b"PK\x01\x02"
_DESCRIPTOR = b"PK\x07\x08"
_EOCD = b"PK\x05\x06"
_ZIP64_EOCD = b"PK\x06\x06"
_ZIP64_LOCATOR = b"PK\x06\x07"
_LOCAL_HEAD = struct.Struct("<4sHHHHHIIIHH")
_CENTRAL_HEAD = struct.Struct("<4sHHHHHHIIIHHHHHII")
_EOCD_HEAD = struct.Struct("<4sHHHHIIH")
_DATA_MEMBER = re.compile(r"(?:^|/)data/([^/]+)$")
_FIRST_WINDOW = 64 << 10

#: Bytes per element of torch's storage classes as data.pkl names them;
#: dtypes without a legacy class are saved as UntypedStorage, counted in bytes.
TORCH_STORAGE_WIDTHS = {
    "torch.storage.UntypedStorage": 1, "torch.UntypedStorage": 1,
    "torch.BoolStorage": 1, "torch.ByteStorage": 1, "torch.CharStorage": 1,
    "torch.QInt8Storage": 1, "torch.QUInt8Storage": 1, "torch.QUInt4x2Storage": 1, "torch.QUInt2x4Storage": 1,
    "torch.ShortStorage": 2, "torch.HalfStorage": 2, "torch.BFloat16Storage": 2,
    "torch.IntStorage": 4, "torch.FloatStorage": 4, "torch.QInt32Storage": 4,
    "torch.LongStorage": 8, "torch.DoubleStorage": 8, "torch.ComplexFloatStorage": 8,
    "torch.ComplexDoubleStorage": 16,
}


@dataclass
class _Member:
    name: str
    crc: int
    length: int
    usize: int


@dataclass
class _ZipState:
    offset: int = 0
    inflated: int = 0
    members: dict[int, _Member] = field(default_factory=dict)
    storages: dict[str, tuple[str, int]] = field(default_factory=dict)


def _zip(c: Checker) -> Generator[tuple[Any, ...], Any, None]:
    s = _ZipState()
    first = yield ("peek", 4, "")
    if first != _LOCAL:
        c.note("not a zip archive (legacy torch format or another file): structure not checked")
        yield ("rest",)
        return
    while True:
        sig = yield ("peek", 4, f"after member {_last(s)}, before the central directory")
        if len(sig) < 4:
            raise StructureError(f"truncated: the file ends after member {_last(s)}, before the central directory")
        if sig != _LOCAL:
            break
        stop = yield from _zip_member(c, s)
        if stop:
            yield ("rest",)
            return
    yield from _zip_central(s, sig)


def _last(s: _ZipState) -> str:
    return repr(s.members[max(s.members)].name) if s.members else "(none)"


def _zip_member(c: Checker, s: _ZipState) -> Generator[tuple[Any, ...], Any, bool]:
    """One local header, its data and descriptor. Returns True when checking must stop (noted)."""
    at = s.offset
    head = yield ("read", _LOCAL_HEAD.size, f"inside the local header at offset {at}")
    _sig, _ver, flags, method, _t, _d, crc, csize, usize, nlen, elen = _LOCAL_HEAD.unpack(head)
    raw_name = yield ("read", nlen, f"inside the local header at offset {at}")
    extra = yield ("read", elen, f"inside the local header at offset {at}")
    name = raw_name.decode("utf-8", "replace")
    s.offset += _LOCAL_HEAD.size + nlen + elen
    where = f"inside member {name!r} (offset {at})"
    z64 = _zip64_fields(extra, [usize == 0xFFFFFFFF, csize == 0xFFFFFFFF])
    z64_local = _has_zip64(extra)
    if usize == 0xFFFFFFFF:
        usize = z64.pop(0) if z64 else usize
    if csize == 0xFFFFFFFF:
        csize = z64.pop(0) if z64 else csize
    if flags & 0x01:
        c.note(f"member {name!r} is encrypted: not checked")
        return True
    streamed = bool(flags & 0x08)
    length: int | None = None if streamed else csize
    if length is None:
        match = _DATA_MEMBER.search(name)
        record = s.storages.get(match.group(1)) if match else None
        width = TORCH_STORAGE_WIDTHS.get(record[0]) if record else None
        if record is not None and width is not None and method == 0:
            length = record[1] * width
        else:
            length = yield from _find_descriptor(s, name, method)
            if length is None:
                c.note(f"member {name!r}: no data descriptor within {MAX_DESCRIPTOR_SEARCH} bytes; "
                       "the rest of the archive is not checked")
                return True
    if name.endswith(".pkl") and method == 0 and length <= MAX_PICKLE:
        body = yield ("peek", length, where)
        from .codec_layout import torch_storages  # lazy: the codec's imports (numpy, zstandard) only for a torch zip

        try:
            s.storages, _ = torch_storages(body)
        except Exception:  # noqa: BLE001 - not torch's data.pkl: lengths come from descriptors
            s.storages = {}
    if method == 0:
        got = yield ("crc", length, where)
        plain = length
    elif method == 8 and (streamed or usize != 0xFFFFFFFF) and s.inflated + usize <= MAX_INFLATED:
        # Streamed members declare their size in the descriptor that follows: the cap is then
        # what is left of the file's allowance, and the descriptor is compared afterwards.
        cap = MAX_INFLATED - s.inflated if streamed else usize
        got, plain = yield ("inflate", length, where, cap, f"member {name!r}")
        s.inflated += plain
    else:
        c.note(f"member {name!r}: compression method {method} (or a large compressed member): CRC-32 not checked")
        yield ("skip", length, where)
        got, plain = None, usize
    s.offset += length
    if streamed:
        d = yield ("peek", 28, f"inside the data descriptor of member {name!r}")
        skip = 4 if d[:4] == _DESCRIPTOR else 0
        found: tuple[int, int, int] | None = None
        # zip64 members (a zip64 extra field in the local header) have 8-byte sizes here.
        for width in ((8, 4) if z64_local else (4, 8)):
            fmt_ = "<IQQ" if width == 8 else "<III"
            if len(d) >= skip + struct.calcsize(fmt_):
                stored_crc, csize_d, usize_d = struct.unpack_from(fmt_, d, skip)
                if csize_d == length:
                    found = (stored_crc, usize_d, skip + struct.calcsize(fmt_))
                    break
        if found is None:
            if len(d) < skip + 12:
                raise StructureError(f"truncated: the file ends inside the data descriptor of member {name!r}")
            raise StructureError(f"member {name!r}: data descriptor at offset {s.offset} does not match "
                                 f"its {length}-byte length")
        crc, usize, size = found
        yield ("read", size, f"inside the data descriptor of member {name!r}")
        s.offset += size
    if got is not None and got != crc:
        raise StructureError(f"member {name!r}: CRC-32 {got:08x}, stored {crc:08x} (its bytes are damaged)")
    if got is not None and plain != usize:
        raise StructureError(f"member {name!r}: {plain} bytes, its header says {usize}")
    s.members[at] = _Member(name, crc, length, usize)
    return False


def _find_descriptor(s: _ZipState, name: str, method: int) -> Generator[tuple[Any, ...], Any, int | None]:
    """The length of a streamed member, from the data descriptor that follows it (peeked, not consumed)."""
    window = _FIRST_WINDOW
    while True:
        buf: bytes = yield ("peek", window, f"inside member {name!r} (offset {s.offset})")
        at = buf.find(_DESCRIPTOR)
        while at >= 0:
            if at + 16 <= len(buf):
                csize32, usize32 = struct.unpack_from("<II", buf, at + 8)
                if csize32 == at and (method != 0 or usize32 == at):
                    return at
            if at + 24 <= len(buf):
                (csize64,) = struct.unpack_from("<Q", buf, at + 8)
                if csize64 == at:
                    return at
            at = buf.find(_DESCRIPTOR, at + 1)
        if len(buf) < window:
            raise StructureError(f"truncated: the file ends inside member {name!r} (offset {s.offset})")
        if window >= MAX_DESCRIPTOR_SEARCH:
            return None
        window = min(window * 4, MAX_DESCRIPTOR_SEARCH)


def _zip_central(s: _ZipState, sig: bytes) -> Generator[tuple[Any, ...], Any, None]:
    cd_start = s.offset
    entries = 0
    while sig == _CENTRAL:
        where = f"inside central directory entry {entries + 1} (offset {s.offset})"
        head = yield ("read", _CENTRAL_HEAD.size, where)
        (_s, _vm, _vn, _fl, _m, _t, _d, crc, csize, usize, nlen, elen, clen, _disk, _ia, _ea,
         local) = _CENTRAL_HEAD.unpack(head)
        raw_name = yield ("read", nlen, where)
        extra = yield ("read", elen, where)
        yield ("read", clen, where)
        s.offset += _CENTRAL_HEAD.size + nlen + elen + clen
        z64 = _zip64_fields(extra, [usize == 0xFFFFFFFF, csize == 0xFFFFFFFF, local == 0xFFFFFFFF])
        if usize == 0xFFFFFFFF and z64:
            usize = z64.pop(0)
        if csize == 0xFFFFFFFF and z64:
            csize = z64.pop(0)
        if local == 0xFFFFFFFF and z64:
            local = z64.pop(0)
        name = raw_name.decode("utf-8", "replace")
        member = s.members.get(local)
        if member is None:
            raise StructureError(f"central directory entry {name!r} points at offset {local}, where no member starts")
        if member.name != name:
            raise StructureError(f"central directory names {name!r} at offset {local}, the local header {member.name!r}")
        if (member.crc, member.length, member.usize) != (crc, csize, usize):
            raise StructureError(
                f"member {name!r}: central directory says CRC-32 {crc:08x}, {csize} bytes; "
                f"the archive holds {member.crc:08x}, {member.length} bytes"
            )
        entries += 1
        sig = yield ("peek", 4, "inside the central directory")
    cd_size = s.offset - cd_start
    if entries != len(s.members):
        raise StructureError(f"the central directory lists {entries} members, the archive holds {len(s.members)}")
    want: tuple[int, int, int] | None = None
    if sig == _ZIP64_EOCD:
        head = yield ("read", 12, "inside the zip64 end of central directory record")
        (size,) = struct.unpack_from("<Q", head, 4)
        if size < 44 or size > MAX_MANIFEST:
            raise StructureError(f"zip64 end of central directory record claims {size} bytes")
        rest = yield ("read", size, "inside the zip64 end of central directory record")
        total, cdsz, cdoff = struct.unpack_from("<QQQ", rest, 20)
        want = (total, cdsz, cdoff)
        eocd64_at = s.offset
        s.offset += 12 + size
        sig = yield ("peek", 4, "before the zip64 end of central directory locator")
        if sig != _ZIP64_LOCATOR:
            raise StructureError("no zip64 end of central directory locator after its record")
        loc = yield ("read", 20, "inside the zip64 end of central directory locator")
        (where64,) = struct.unpack_from("<Q", loc, 8)
        if where64 != eocd64_at:
            raise StructureError(f"the zip64 locator points at offset {where64}, the record is at {eocd64_at}")
        s.offset += 20
        sig = yield ("peek", 4, "before the end of central directory record")
    if len(sig) < 4:
        raise StructureError("truncated: the file ends before the end of central directory record")
    if sig != _EOCD:
        raise StructureError(f"no end of central directory record at offset {s.offset} (found {sig!r})")
    head = yield ("read", _EOCD_HEAD.size, "inside the end of central directory record")
    _sig, _disk, _cd_disk, _n_disk, total16, cdsz32, cdoff32, clen = _EOCD_HEAD.unpack(head)
    total = want[0] if want and total16 == 0xFFFF else total16
    cdsz = want[1] if want and cdsz32 == 0xFFFFFFFF else cdsz32
    cdoff = want[2] if want and cdoff32 == 0xFFFFFFFF else cdoff32
    if (total, cdsz, cdoff) != (entries, cd_size, cd_start):
        raise StructureError(
            f"end of central directory says {total} entries, {cdsz} bytes at offset {cdoff}; "
            f"the central directory has {entries} entries, {cd_size} bytes at offset {cd_start}"
        )
    yield ("read", clen, "inside the archive comment")
    yield ("end",)


def _has_zip64(extra: bytes) -> bool:
    i = 0
    while i + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, i)
        if tag == 1:
            return True
        i += 4 + size
    return False


def _zip64_fields(extra: bytes, wanted: list[bool]) -> list[int]:
    """The 8-byte values of the zip64 extra field (id 1), as many as ``wanted`` flags are set."""
    i = 0
    while i + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, i)
        if tag == 1:
            body = extra[i + 4 : i + 4 + size]
            return [struct.unpack_from("<Q", body, 8 * k)[0] for k in range(min(sum(wanted), len(body) // 8))]
        i += 4 + size
    return []


# -- helpers -------------------------------------------------------------------------------------


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
