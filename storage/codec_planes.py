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

import numpy as np
import zstandard

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
    PERF.md checkpoint's exponent planes: 2.67 -> 2.84 ratio for bf16.
    """
    return zstandard.ZstdCompressionParameters.from_level(
        1, min_match=7, hash_log=10, window_log=17, write_checksum=True, write_content_size=True
    )


def rotate(elements: np.ndarray, width: int, *, inverse: bool) -> None:
    """Rotate every element of the unsigned array ``elements`` by one bit, in place.

    Left (sign bit to bit 0) when ``inverse`` is False, right when True.
    """
    bits = width * 8
    tmp = np.empty_like(elements)
    if inverse:
        np.left_shift(elements, bits - 1, out=tmp)
        np.right_shift(elements, 1, out=elements)
    else:
        np.right_shift(elements, bits - 1, out=tmp)
        np.left_shift(elements, 1, out=elements)
    np.bitwise_or(elements, tmp, out=elements)


def split_planes(data: bytes | bytearray | memoryview, width: int, transform: int) -> np.ndarray:
    """Return a new ``(width, len(data) // width)`` uint8 array of byte planes.

    ``len(data)`` must be a multiple of ``width``; ``data`` is not modified.
    The one-bit rotation is done plane-wise after the split (byte ``k`` of
    the rotated element is ``b[k] << 1 | b[k-1] >> 7``), which avoids a
    full-size copy of the block.
    """
    if len(data) % width:
        raise ValueError(f"block of {len(data)} bytes is not a multiple of element width {width}")
    view = np.frombuffer(data, dtype=np.uint8).reshape(-1, width)
    split = np.empty((width, view.shape[0]), dtype=np.uint8)
    for k in range(width):  # one long strided pass per plane beats a 2-D transpose
        split[k] = view[:, k]
    if transform != TRANSFORM_ROTL1:
        return split
    out = np.empty_like(split)
    for k in range(width):
        np.left_shift(split[k], 1, out=out[k])
        out[k] |= split[k - 1] >> 7
    return out


def merge_planes(planes: list[np.ndarray], width: int, transform: int, out: np.ndarray) -> None:
    """Inverse of :func:`split_planes`: write the interleaved bytes into ``out`` (uint8)."""
    view = out.reshape(-1, width)
    if transform == TRANSFORM_ROTL1:
        for k in range(width):
            plane = planes[k] >> 1
            plane |= planes[(k + 1) % width] << 7
            view[:, k] = plane
    else:
        for k in range(width):
            view[:, k] = planes[k]


def _probe(plane: np.ndarray) -> tuple[float, np.ndarray]:
    """Estimated order-0 entropy (bits/byte) of a sample, and the sample's byte counts."""
    sample = plane[::_SAMPLE_STEP] if plane.size > 64 * _SAMPLE_STEP else plane
    counts = np.bincount(sample, minlength=256)
    p = counts[counts > 0] / sample.size
    return float(-(p * np.log2(p)).sum()), counts


def encode_plane(plane: np.ndarray, cctx: zstandard.ZstdCompressor) -> tuple[int, bytes]:
    """Code one plane; return ``(mode, payload)``. Never larger than the plane itself."""
    n = plane.size
    if n == 0:
        return PLANE_RAW, b""
    entropy, counts = _probe(plane)
    if entropy > 8 * (1 - MIN_SAVING):
        return PLANE_RAW, plane.tobytes()
    windows = np.convolve(counts, np.ones(15, dtype=np.int64), mode="valid")[: _MAX_BASE + 1]
    base = int(np.argmax(windows))
    best: tuple[int, bytes]
    if windows[base] >= NIBBLE_COVERAGE * counts.sum() and n >= 64:
        best = PLANE_NIBBLE, _encode_nibbles(plane, base, cctx)
    else:
        best = PLANE_ZSTD, cctx.compress(plane.data)
    if len(best[1]) > n * (1 - MIN_SAVING):
        return PLANE_RAW, plane.tobytes()
    return best


def _encode_nibbles(plane: np.ndarray, base: int, cctx: zstandard.ZstdCompressor) -> bytes:
    codes = plane - np.uint8(base)  # wraps: values below base become >= 241
    np.minimum(codes, 15, out=codes)
    escapes = plane[codes == 15]
    if codes.size % 2:
        codes = np.append(codes, np.uint8(0))
    pairs = codes.view("<u2")  # low byte: even code, high byte: odd code
    packed = ((pairs << 4) | (pairs >> 8)).astype(np.uint8)
    packed_frame = cctx.compress(packed.data)
    escape_frame = cctx.compress(escapes.data)
    return _NIBBLE_HEAD.pack(base, len(packed_frame), escapes.size) + packed_frame + escape_frame


def _decompress_exact(dctx: zstandard.ZstdDecompressor, frame: bytes | memoryview, size: int) -> bytes:
    try:
        out = dctx.decompress(frame, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise ValueError(f"zstd frame is corrupt ({exc})") from exc
    if len(out) != size:
        raise ValueError(f"zstd frame decoded to {len(out)} bytes, expected {size}")
    return out


def decode_plane(mode: int, payload: memoryview, size: int, dctx: zstandard.ZstdDecompressor) -> np.ndarray:
    """Decode one plane of ``size`` bytes; raise ``ValueError`` when it cannot be exact."""
    if mode == PLANE_RAW:
        if len(payload) != size:
            raise ValueError(f"raw plane holds {len(payload)} bytes, expected {size}")
        return np.frombuffer(payload, dtype=np.uint8)
    if mode == PLANE_ZSTD:
        return np.frombuffer(_decompress_exact(dctx, payload, size), dtype=np.uint8)
    if mode == PLANE_NIBBLE:
        if len(payload) < _NIBBLE_HEAD.size:
            raise ValueError("nibble plane header is truncated")
        base, packed_len, n_escapes = _NIBBLE_HEAD.unpack_from(payload)
        start = _NIBBLE_HEAD.size
        if base > _MAX_BASE or start + packed_len > len(payload) or n_escapes > size:
            raise ValueError("nibble plane header is inconsistent")
        packed = np.frombuffer(
            _decompress_exact(dctx, payload[start : start + packed_len], (size + 1) // 2), dtype=np.uint8
        )
        escapes = np.frombuffer(
            _decompress_exact(dctx, payload[start + packed_len :], n_escapes), dtype=np.uint8
        )
        pairs = packed.astype("<u2")
        low = pairs >> 4
        np.bitwise_and(pairs, 15, out=pairs)
        np.left_shift(pairs, 8, out=pairs)
        pairs |= low
        pairs += np.uint16(base * 0x0101)  # codes <= 15 and base <= 240: no carries
        out = pairs.view(np.uint8)[:size]
        where = np.flatnonzero(out == base + 15)
        if where.size != n_escapes:
            raise ValueError(f"nibble plane has {where.size} escapes, header says {n_escapes}")
        out[where] = escapes
        return out
    raise ValueError(f"unknown plane mode {mode}")
