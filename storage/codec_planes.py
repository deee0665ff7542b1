"""Byte-plane transforms and per-plane coding for the archive codec.

Pure functions over in-memory buffers; no I/O. A tensor block of ``m``
elements of ``width`` bytes becomes ``width`` planes of ``m`` bytes each
(plane ``k`` holds byte ``k`` of every little-endian element). For floating
point data the element is first rotated left by one bit, so the top byte holds
the whole exponent and the sign bit moves to the bottom byte, next to the
least significant mantissa bits.

Each plane is then coded in one of three modes, chosen per plane:

* ``PLANE_RAW``: stored as is (random mantissa bytes: zstd would save < 3%).
* ``PLANE_ZSTD``: one zstd frame with a content checksum.
* ``PLANE_NIBBLE``: for skewed planes (exponents) where 15 consecutive byte
  values ``base .. base+14`` cover almost every byte: each byte becomes a
  4-bit code (``value - base``, or 15 = "escape"), two codes are packed per
  byte, and the packed stream plus the escaped bytes (in order) are zstd
  frames. Huffman on code pairs gets closer to the entropy than zstd's
  byte-wise Huffman on the exponents themselves, and decoding is plain
  integer arithmetic (no table look-ups).

Every mode is lossless; :func:`decode_plane` raises ``ValueError`` on any
inconsistency (the caller turns it into an ``IntegrityError`` naming the file).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import zstandard
from awscrt import checksums

PLANE_RAW = 0
PLANE_ZSTD = 1
PLANE_NIBBLE = 2

TRANSFORM_NONE = 0
TRANSFORM_ROTL1 = 1

#: little-endian unsigned views used for the bit rotation, by element width.
UINT_DTYPES: dict[int, str] = {2: "<u2", 4: "<u4", 8: "<u8"}

#: a plane whose estimated saving is below this fraction is stored raw.
MIN_SAVING = 0.03
#: nibble mode is used when the best window of 15 values covers this share.
NIBBLE_COVERAGE = 0.96
_SAMPLE_STEP = 61
_NIBBLE_HEAD = struct.Struct("<BII")  # base, packed frame length, escape count
_MAX_BASE = 240  # base + 15 must fit in a byte: decoding adds base without carries


def plane_params() -> zstandard.ZstdCompressionParameters:
    """zstd parameters for tensor planes: level 1, but few and short matches.

    Planes are nearly match-free; a long minimum match and a small window keep
    zstd from spending bits on accidental matches, which both speeds it up and
    leaves more to the (better) literal Huffman coder. Measured on the
    reference checkpoint's exponent planes (bench/refdata.py): 2.67 -> 2.84 ratio for bf16.
    """
    return zstandard.ZstdCompressionParameters.from_level(
        1, min_match=7, hash_log=10, window_log=17, write_checksum=True, write_content_size=True
    )


class Scratch:
    """Reusable work arrays for one thread: named, grown on demand, never shrunk.

    Fresh large arrays cost page faults on first touch (about 1.6 GB/s against
    12 GB/s for a reused buffer on the benchmark machine of docs/benchmarks.md), so every hot step
    takes its temporaries from here. A ``Scratch`` must not be shared by two
    threads, and an array it hands out is valid only until the same name is
    asked for again.
    """

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    @property
    def nbytes(self) -> int:
        """Bytes held by all the arrays."""
        return sum(a.nbytes for a in self._arrays.values())

    def get(self, name: str, n: int, dtype: npt.DTypeLike = np.uint8) -> np.ndarray:
        """A writable 1-D array of ``n`` elements of ``dtype`` (contents undefined)."""
        need = n * np.dtype(dtype).itemsize
        buf = self._arrays.get(name)
        if buf is None or buf.nbytes < need:
            buf = self._arrays[name] = np.empty(max(need, 1), dtype=np.uint8)
        return buf[:need].view(dtype)


#: bytes per chunk of the multi-pass loops: cache-sized, yet large enough that the
#: Python overhead and GIL hand-offs between numpy calls stay small (measured:
#: 256 KiB .. 2 MiB run at the same speed on one thread; fewer calls help two).
_CHUNK_BYTES = 1 << 20
#: bytes of output per chunk of the merging loop: a chunk's slices of the planes, its
#: temporaries and its output stay in a core's L2 cache (2 MiB here) between passes and
#: for its CRC64NVME (measured: 512 KiB needs less CPU than 128 KiB, 1 MiB or 2 MiB).
_DECODE_CHUNK_BYTES = 512 << 10


def split_planes(
    data: bytes | bytearray | memoryview | np.ndarray,
    width: int,
    transform: int,
    out: np.ndarray | None = None,
    scratch: Scratch | None = None,
) -> np.ndarray:
    """Return the ``(width, len(data) // width)`` uint8 array of byte planes.

    ``len(data)`` must be a multiple of ``width`` (2, 4 or 8); ``data`` is
    not modified. ``out`` (a C-contiguous uint8 array of at least
    ``len(data)`` bytes) receives the planes when given, else a new array
    does. With ``TRANSFORM_ROTL1`` each element is first rotated left by one
    bit. Works in cache-sized chunks, with temporaries from ``scratch``.
    """
    nbytes = data.nbytes if isinstance(data, np.ndarray) else memoryview(data).nbytes
    if nbytes % width:
        raise ValueError(f"block of {nbytes} bytes is not a multiple of element width {width}")
    if width not in UINT_DTYPES:
        raise ValueError(f"element width {width} is not one of {sorted(UINT_DTYPES)}")
    m = nbytes // width
    if out is None:
        out = np.empty(nbytes, dtype=np.uint8)
    split = out[:nbytes].reshape(width, m)
    if m == 0:
        return split
    scratch = scratch or Scratch()
    elements = np.frombuffer(data, dtype=UINT_DTYPES[width], count=m)
    step = _CHUNK_BYTES // width
    wide = scratch.get("split.wide", min(step, m), UINT_DTYPES[width])
    rot = scratch.get("split.rot", min(step, m), UINT_DTYPES[width])
    bits = 8 * width
    for s in range(0, m, step):
        e = min(s + step, m)
        x = elements[s:e]
        t = wide[: e - s]
        if transform == TRANSFORM_ROTL1:
            r = rot[: e - s]
            np.right_shift(x, bits - 1, out=t)
            np.left_shift(x, 1, out=r)
            np.bitwise_or(r, t, out=r)
            x = r
        np.copyto(split[0, s:e], x, casting="unsafe")
        for k in range(1, width):
            np.right_shift(x, 8 * k, out=t)
            np.copyto(split[k, s:e], t, casting="unsafe")
    return split


def merge_planes(
    planes: Sequence[np.ndarray], width: int, transform: int, out: np.ndarray, scratch: Scratch | None = None
) -> None:
    """Inverse of :func:`split_planes`: write the interleaved bytes into ``out`` (uint8).

    ``planes`` are ``width`` uint8 arrays of equal length ``m``; ``out`` holds
    exactly ``m * width`` bytes and must be C-contiguous. Works in
    cache-sized chunks, with temporaries from ``scratch``.
    """
    m = out.size // width
    scratch = scratch or Scratch()
    step = _decode_step(width)
    for s in range(0, m, step):
        e = min(s + step, m)
        _merge_chunk([p[s:e] for p in planes], width, transform, out[s * width : e * width], scratch)


#: merges of at most this many bytes copy each plane into its byte column (one strided copy a
#: plane) instead of widening: 2 us against 14 us for a 4 KiB fp32 block (a norm's weights).
_SMALL_MERGE_BYTES = 16 << 10


def _decode_step(width: int) -> int:
    """Elements per chunk of the merging loop: even, at least 2."""
    return max(2, (_DECODE_CHUNK_BYTES // width) & ~1)


def _merge_chunk(planes: Sequence[np.ndarray], width: int, transform: int, out: np.ndarray, scratch: Scratch) -> None:
    """Interleave one chunk of ``width`` planes into ``out`` (``len(planes[0]) * width`` bytes).

    Small chunks copy each plane into its byte column (few calls). For larger
    ones numpy's fastest passes here are multiplications and ors that widen as
    they go (each near the cache's bandwidth), while a shift of 16-bit lanes
    runs at half their speed and a byte-strided scatter at a fifth: so bytes
    are paired into 16-bit lanes by a multiplication by 256 and an or, pairs
    into 32-bit ones the same way, and the rotation back (right by one bit)
    is a multiplication (the bit that wraps), a shift and an or on whole
    elements.
    """
    n = out.size // width
    if n == 0:
        return
    x = out.view(UINT_DTYPES[width])
    if out.size <= _SMALL_MERGE_BYTES:  # a few calls beat a few fast passes
        columns = out.reshape(n, width)
        for k, plane in enumerate(planes):
            columns[:, k] = plane
    else:
        _assemble(planes, x, scratch)
    if transform == TRANSFORM_ROTL1:
        t = scratch.get("merge.rot", n, x.dtype)
        np.multiply(x, x.dtype.type(1 << (8 * width - 1)), out=t)
        np.right_shift(x, 1, out=x)
        np.bitwise_or(x, t, out=x)


def _assemble(planes: Sequence[np.ndarray], out: np.ndarray, scratch: Scratch) -> None:
    """``out`` = the little-endian unsigned integers whose bytes are ``planes`` (2, 4 or 8 uint8 arrays).

    Two bytes make a 16-bit lane, two lanes a lane twice as wide, and so on:
    ``out = high << bits | low``, as a multiplication of ``high`` by
    ``2**bits`` and an or with ``low``, both widening as they go.
    """
    n = out.size
    k = len(planes)
    if k == 2:
        high, low = planes[1], planes[0]
    else:
        low = scratch.get(f"merge.lo{k}", n, UINT_DTYPES[k // 2])
        high = scratch.get(f"merge.hi{k}", n, UINT_DTYPES[k // 2])
        _assemble(planes[: k // 2], low, scratch)
        _assemble(planes[k // 2 :], high, scratch)
    # widening inside the ufunc (numpy casts cache-sized pieces in its buffers): half the calls, and one
    # pass less over ``out``, than a widening copy first
    np.multiply(high, out.dtype.type(1 << (4 * k)), out=out, dtype=out.dtype, casting="unsafe")
    np.bitwise_or(out, low, out=out, dtype=out.dtype, casting="unsafe")


def _probe(plane: np.ndarray) -> tuple[float, np.ndarray]:
    """Estimated order-0 entropy (bits/byte) of a sample, and the sample's byte counts."""
    sample = plane[::_SAMPLE_STEP] if plane.size > 64 * _SAMPLE_STEP else plane
    counts = np.bincount(sample, minlength=256)
    p = counts[counts > 0] / sample.size
    return float(-(p * np.log2(p)).sum()), counts


def encode_plane(
    plane: np.ndarray, cctx: zstandard.ZstdCompressor, scratch: Scratch | None = None
) -> tuple[int, bytes | memoryview]:
    """Code one C-contiguous uint8 plane; return ``(mode, payload)``. Never larger than the plane itself.

    A ``PLANE_RAW`` payload is a view of ``plane`` itself (no copy): it is
    valid only while ``plane``'s buffer is.
    """
    n = plane.size
    if n == 0:
        return PLANE_RAW, b""
    entropy, counts = _probe(plane)
    if entropy > 8 * (1 - MIN_SAVING):
        return PLANE_RAW, plane.data
    windows = np.convolve(counts, np.ones(15, dtype=np.int64), mode="valid")[: _MAX_BASE + 1]
    base = int(np.argmax(windows))
    best: tuple[int, bytes]
    if windows[base] >= NIBBLE_COVERAGE * counts.sum() and n >= 64:
        best = PLANE_NIBBLE, _encode_nibbles(plane, base, cctx, scratch)
    else:
        best = PLANE_ZSTD, cctx.compress(plane.data)
    if len(best[1]) > n * (1 - MIN_SAVING):
        return PLANE_RAW, plane.data
    return best


def _encode_nibbles(
    plane: np.ndarray, base: int, cctx: zstandard.ZstdCompressor, scratch: Scratch | None = None
) -> bytes:
    scratch = scratch or Scratch()
    n = plane.size
    half = (n + 1) // 2
    packed = scratch.get("nib.packed", half)
    step = min(_CHUNK_BYTES, n + n % 2)  # even, so chunks pair up
    codes = scratch.get("nib.codes", step)
    hi = scratch.get("nib.hi", step // 2, np.uint16)
    fifteen = scratch.get("nib.fifteen", step)
    fifteen.fill(15)  # np.minimum against an array vectorises; against a scalar it runs 10x slower
    escapes: list[np.ndarray] = []
    for s in range(0, n, step):
        e = min(s + step, n)
        c = codes[: e - s]
        np.subtract(plane[s:e], np.uint8(base), out=c)  # wraps: values below base become >= 241
        np.minimum(c, fifteen[: e - s], out=c)
        at = _positions_of(c, 15, scratch, "nib")
        if at.size:
            escapes.append(plane[s:e][at])
        if (e - s) % 2:
            c = codes[: e - s + 1]
            c[-1] = 0
        pairs = c.view("<u2")  # low byte: even code, high byte: odd code
        h = hi[: pairs.size]
        np.left_shift(pairs, 4, out=h)
        np.right_shift(pairs, 8, out=pairs)
        np.bitwise_or(h, pairs, out=h)
        np.copyto(packed[s // 2 : s // 2 + pairs.size], h, casting="unsafe")
    escaped = np.concatenate(escapes) if escapes else np.empty(0, dtype=np.uint8)
    packed_frame = cctx.compress(packed.data)
    escape_frame = cctx.compress(escaped.data)
    return b"".join((_NIBBLE_HEAD.pack(base, len(packed_frame), escaped.size), packed_frame, escape_frame))


def _decompress_into(
    dctx: zstandard.ZstdDecompressor, frame: bytes | memoryview, out: np.ndarray, what: str = "plane"
) -> None:
    """Decode one zstd frame into ``out`` (uint8), which it must fill exactly; ``what`` names it in errors.

    Reading on to the end of the frame makes zstd check the content checksum.
    A frame that declares its content size (every frame ckz1 writes does) is
    decoded in one pass straight into ``out``, with no window buffer; a
    damaged one that does not is refused once its window exceeds the
    decompressor's ``max_window_size``.
    """
    size = out.size
    view = out.data
    got = 0
    try:
        with dctx.stream_reader(frame, read_across_frames=False) as reader:
            while got < size:
                n = reader.readinto(view[got:])
                if not n:
                    break
                got += n
            extra = len(reader.read(1))
    except zstandard.ZstdError as exc:
        raise ValueError(f"{what}: zstd frame is corrupt ({exc})") from exc
    if got != size or extra:
        raise ValueError(f"{what}: zstd frame decoded to {got + extra}{'+' if extra else ''} bytes, expected {size}")


def _positions_of(values: np.ndarray, value: int, scratch: Scratch, name: str) -> np.ndarray:
    """Ascending indices of the bytes of ``values`` (uint8) equal to ``value``: the mask
    (from ``scratch`` under ``name``) padded with False to whole 8-byte lanes, then
    :func:`_true_positions`."""
    n = values.size
    lanes = -(-n // 8) * 8
    mask = scratch.get(f"{name}.mask", lanes, np.bool_)
    np.equal(values, value, out=mask[:n])
    mask[n:] = False
    return _true_positions(mask, scratch, name)


def _true_positions(mask: np.ndarray, scratch: Scratch, name: str) -> np.ndarray:
    """Ascending indices of the True entries of the bool array ``mask``, whose size is a multiple of 8.

    Escapes are rare (0.2% of an exponent plane on the reference checkpoints,
    4% at most), and ``np.flatnonzero`` pays a mispredicted branch for each
    one. So the scan runs over 8-byte lanes first (one compare with 0 per
    lane, an eighth of the elements) and looks only inside the lanes that
    hold any: 2-2.5x faster than ``np.flatnonzero(mask)`` on an exponent plane.
    """
    lanes = mask.view(np.uint64)
    busy = scratch.get(f"{name}.lanes", lanes.size, np.bool_)
    np.not_equal(lanes, 0, out=busy)
    hit = np.flatnonzero(busy)
    inside = np.flatnonzero(lanes[hit].view(np.bool_))
    at: np.ndarray = hit[inside >> 3] * 8 + (inside & 7)
    return at


def _decode_nibbles(
    dctx: zstandard.ZstdDecompressor, payload: memoryview, size: int, scratch: Scratch, name: str
) -> np.ndarray:
    """A nibble-coded plane of ``size`` bytes (see the module docstring), in an array from ``scratch``."""
    if len(payload) < _NIBBLE_HEAD.size:
        raise ValueError(f"{name}: nibble plane header is truncated")
    base, packed_len, n_escapes = _NIBBLE_HEAD.unpack_from(payload)
    start = _NIBBLE_HEAD.size
    if base > _MAX_BASE or start + packed_len > len(payload) or n_escapes > size:
        raise ValueError(f"{name}: nibble plane header is inconsistent")
    half = (size + 1) // 2
    packed = scratch.get(f"{name}.packed", half)
    _decompress_into(dctx, payload[start : start + packed_len], packed, f"{name}: codes")
    escapes = scratch.get(f"{name}.escapes", n_escapes)
    _decompress_into(dctx, payload[start + packed_len :], escapes, f"{name}: escapes")
    # a packed byte is (even code) << 4 | odd code; times 0x1001 it also holds the odd code in bits
    # 12-15, so shifted right by 4 it is the little-endian pair (even, odd), and adding the base to
    # both bytes cannot carry (codes <= 15, base <= 240)
    pairs = scratch.get(f"{name}.pairs", half, np.uint16)
    np.multiply(packed, np.uint16(0x1001), out=pairs, dtype=np.uint16, casting="unsafe")
    np.right_shift(pairs, 4, out=pairs)
    np.add(pairs, np.uint16(base * 0x0101), out=pairs)
    out = pairs.view(np.uint8)[:size]
    at = _positions_of(out, base + 15, scratch, name)
    if at.size != n_escapes:
        raise ValueError(f"{name}: nibble plane has {at.size} escapes, its header says {n_escapes}")
    out[at] = escapes
    return out


def decode_plane(
    mode: int,
    payload: memoryview,
    size: int,
    dctx: zstandard.ZstdDecompressor,
    scratch: Scratch | None = None,
    name: str = "plane",
) -> np.ndarray:
    """Decode one plane of ``size`` bytes; raise ``ValueError`` when it cannot be exact.

    The result is a view of ``payload`` (raw planes) or an array from
    ``scratch`` under names starting with ``name``: valid until either is
    reused. Each zstd frame is decoded in one pass straight into its array.
    """
    payload = memoryview(payload)
    if mode == PLANE_RAW:
        if len(payload) != size:
            raise ValueError(f"{name}: raw plane holds {len(payload)} bytes, expected {size}")
        return np.frombuffer(payload, dtype=np.uint8)
    scratch = scratch or Scratch()
    if mode == PLANE_ZSTD:
        out = scratch.get(f"{name}.zstd", size)
        _decompress_into(dctx, payload, out, name)
        return out
    if mode == PLANE_NIBBLE:
        return _decode_nibbles(dctx, payload, size, scratch, name)
    raise ValueError(f"{name}: unknown plane mode {mode}")


def decode_planes(
    modes: Sequence[int],
    payloads: Sequence[memoryview],
    width: int,
    transform: int,
    out: np.ndarray,
    dctx: zstandard.ZstdDecompressor,
    scratch: Scratch,
) -> int:
    """Decode the ``width`` coded planes of one block into ``out`` (uint8); return the bytes' CRC64NVME.

    ``out`` receives exactly ``width * m`` bytes, ``m`` being each plane's
    size. Each coded plane is decoded whole, in one zstd call straight into
    a scratch array (raw planes are read where they lie, in ``payloads``);
    then the planes are merged and the result checksummed a cache-sized
    chunk at a time, so that each chunk is checksummed while still in cache.
    Raises ``ValueError`` on any inconsistency, after which ``out`` holds
    garbage.
    """
    if width not in UINT_DTYPES or len(modes) != width or len(payloads) != width:
        raise ValueError(f"{len(modes)} planes of width {width} are not a valid block")
    m = out.size // width
    decoded = [decode_plane(modes[k], payloads[k], m, dctx, scratch, f"plane{k}") for k in range(width)]
    step = _decode_step(width)
    crc = 0
    for s in range(0, m, step):
        e = min(s + step, m)
        merged = out[s * width : e * width]
        _merge_chunk([p[s:e] for p in decoded], width, transform, merged, scratch)
        crc = checksums.crc64nvme(merged.data, crc)
    return crc
