"""Structural checks (storage/structure.py) on files written by the real libraries."""

from __future__ import annotations

import io
import os
import struct
import zipfile

import pytest
from ckptier.formats import checker_for
from ckptier.storage.records import Format, Shortfall
from ckptier.storage.structure import (
    MAX_MANIFEST,
    Need,
    Structure,
    crc32,
    shortfalls,
)

from tests.fixtures.checkpoints import CheckpointRun
from tests.fixtures.listing import check


def torch_file() -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(
        {
            "w": torch.randn(300, 17),
            "steps": torch.arange(5, dtype=torch.int64),
            "f8": torch.zeros(5, dtype=torch.float8_e4m3fn),  # saved as an UntypedStorage
            "empty": torch.zeros(0),
            "meta": {"lr": 0.1, "name": "x"},
        },
        buf,
    )
    return buf.getvalue()


# -- torch zip ----------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_a_whole_torch_file_passes_in_any_chunking(chunk: int) -> None:
    assert check("model.pt", torch_file(), chunk=chunk) == Structure("torch zip")


def test_every_truncation_of_a_torch_file_is_caught() -> None:
    data = torch_file()
    for cut in list(range(0, len(data), max(1, len(data) // 97))) + [len(data) - 1]:
        if cut == 0:
            continue
        got = check("model.pt", data[:cut], chunk=333)
        assert got.problem is not None and got.problem.startswith("truncated"), (cut, got)


def test_a_flipped_byte_in_any_member_names_the_member() -> None:
    data = torch_file()
    names = {i.header_offset: i for i in zipfile.ZipFile(io.BytesIO(data)).infolist()}
    for info in names.values():
        if info.file_size == 0:
            continue
        nlen, elen = struct.unpack_from("<HH", data, info.header_offset + 26)  # the local header's own lengths
        start = info.header_offset + 30 + nlen + elen
        bad = bytearray(data)
        bad[start + info.file_size // 2] ^= 0x10
        problem = check("model.pt", bytes(bad)).problem or ""
        assert info.filename in problem and ("CRC-32" in problem or "data descriptor" in problem), (info.filename, problem)


def test_trailing_bytes_and_a_damaged_central_directory() -> None:
    data = torch_file()
    assert "after where the file should end" in (check("model.pt", data + b"\0\0").problem or "")
    eocd = data.rindex(b"PK\x05\x06")
    bad = bytearray(data)
    bad[eocd + 10] += 1  # total entries
    assert "end of central directory says" in (check("model.pt", bytes(bad)).problem or "")
    cd = data.index(b"PK\x01\x02")
    bad = bytearray(data)
    bad[cd + 16] ^= 0xFF  # the first entry's CRC-32
    assert "central directory says CRC-32" in (check("model.pt", bytes(bad)).problem or "")


@pytest.mark.parametrize(
    ("seekable", "method", "zip64"),
    [(True, zipfile.ZIP_STORED, False), (False, zipfile.ZIP_STORED, False), (False, zipfile.ZIP_STORED, True),
     (True, zipfile.ZIP_DEFLATED, False), (True, zipfile.ZIP_STORED, True)],
)
def test_other_zip_writers_are_understood(seekable: bool, method: int, zip64: bool) -> None:
    """Python's zipfile: sizes in the local header (seekable), or data descriptors (a pipe); zip64 records."""

    class Pipe(io.RawIOBase):
        def __init__(self) -> None:
            self.out = bytearray()

        def writable(self) -> bool:
            return True

        def write(self, b: bytes) -> int:  # type: ignore[override]
            self.out += b
            return len(b)

    sink: io.BytesIO | Pipe = io.BytesIO() if seekable else Pipe()
    with zipfile.ZipFile(sink, "w", compression=method) as zf:
        for i in range(3):
            with zf.open(f"m/member{i}.bin", "w", force_zip64=zip64) as fh:
                fh.write(os.urandom(1000) * (i + 1))
    data = sink.getvalue() if isinstance(sink, io.BytesIO) else bytes(sink.out)
    assert check("x.bin", data, chunk=100) == Structure("torch zip")
    assert (check("x.bin", data[:-30]).problem or "").startswith("truncated")


def test_a_legacy_torch_file_is_not_checked() -> None:
    import torch

    buf = io.BytesIO()
    torch.save({"w": torch.ones(3)}, buf, _use_new_zipfile_serialization=False)
    got = check("legacy.pt", buf.getvalue())
    assert got.problem is None and "not a zip archive" in got.notes[0]


def test_the_lightning_fixture_passes_and_its_truncation_fails(lightning_run: CheckpointRun) -> None:
    for step in lightning_run.steps:
        data = lightning_run.path(step).read_bytes()
        assert check(lightning_run.path(step).name, data).problem is None
    data = lightning_run.path(max(lightning_run.steps)).read_bytes()
    assert (check("epoch=0-step=6.ckpt", data[: len(data) * 2 // 3]).problem or "").startswith("truncated")


# -- safetensors ----------------------------------------------------------------------------


def safetensors_file() -> bytes:
    import torch
    from safetensors.torch import save

    return save({"a": torch.randn(10, 3), "b": torch.ones(4, dtype=torch.bfloat16), "c": torch.zeros(0)},
                metadata={"format": "pt"})


def sf_with_header(header: dict, data_len: int) -> bytes:
    import json

    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"\0" * data_len


def test_safetensors_whole_truncated_and_padded() -> None:
    data = safetensors_file()
    assert check("model.safetensors", data, chunk=5) == Structure("safetensors")
    assert "truncated" in (check("model.safetensors", data[:-1]).problem or "")
    assert "truncated" in (check("model.safetensors", data[:20]).problem or "")
    assert "after where the file should end" in (check("model.safetensors", data + b"\0").problem or "")


@pytest.mark.parametrize(
    ("header", "data_len", "problem"),
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, 4, "needs 8 bytes, data_offsets span 4"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, 8, "starts at data byte 4, expected 0"),
        ({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
          "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, 6, "starts at data byte 2, expected 4"),
        ({"a": {"dtype": "F32", "shape": "x", "data_offsets": [0, 4]}}, 4, "shape 'x' is not a list"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, 4, "are not [begin, end]"),
        ({"a": [1, 2]}, 0, "entry is not an object"),
    ],
)
def test_safetensors_headers_that_do_not_add_up(header: dict, data_len: int, problem: str) -> None:
    assert problem in (check("m.safetensors", sf_with_header(header, data_len)).problem or "")


def test_safetensors_garbage_header() -> None:
    assert "over safetensors'" in (check("m.safetensors", struct.pack("<Q", 1 << 40) + b"{}").problem or "")
    assert "not valid JSON" in (check("m.safetensors", struct.pack("<Q", 3) + b"{{{").problem or "")
    unknown = check("m.safetensors", sf_with_header({"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, 1))
    assert unknown.problem is None and "dtype 'F4' unknown" in unknown.notes[0]


# -- manifests --------------------------------------------------------------------------------


def test_manifests_are_checked_only_in_their_own_format() -> None:
    assert checker_for("metadata.json", Format.GUIDE) is not None
    assert checker_for("metadata.json", Format.DCP) is None  # a training script's notes beside DCP shards
    assert checker_for(".metadata", Format.DCP) is not None
    assert checker_for("model.safetensors.index.json", Format.HF) is not None
    assert checker_for("trainer_state.json", Format.HF) is None
    assert checker_for("notes.txt", Format.GUIDE) is None


def test_guide_and_hf_manifests_name_what_they_require() -> None:
    meta = b'{"step": 1, "world_size": 2, "files": {"rank-0000/model.pt": {"size": 10}}}'
    got = check("metadata.json", meta, chunk=3, fmt=Format.GUIDE)
    assert got.needs == (Need("rank-0000/model.pt", "metadata.json", 10, True), Need("rank-0000/", "metadata.json"),
                         Need("rank-0001/", "metadata.json"))
    assert (check("metadata.json", b"[1]", fmt=Format.GUIDE).problem or "").startswith("metadata.json: expected a JSON object")
    huge = check("metadata.json", b'{"world_size": ' + b"9" * 5000 + b"}", fmt=Format.GUIDE).problem or ""
    assert huge.startswith("metadata.json: not valid JSON (exceeds the limit")  # verification stopped on a ValueError
    index = b'{"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors", "c": "model-1.safetensors"}}'
    got = check("model.safetensors.index.json", index, fmt=Format.HF)
    assert [n.relpath for n in got.needs] == ["model-1.safetensors", "model-2.safetensors"]
    assert "no weight_map" in (check("model.safetensors.index.json", b"{}", fmt=Format.HF).problem or "")


def test_oversized_manifests_are_noted_not_parsed() -> None:
    c = checker_for("metadata.json", Format.GUIDE)
    assert c is not None
    block = b" " * (1 << 20)
    for _ in range(MAX_MANIFEST // len(block) + 1):
        c.feed(block)
    got = c.finish()
    assert got.problem is None and got.needs == () and "not parsed" in got.notes[0]


@pytest.mark.parametrize(
    ("needs", "present", "also", "expected"),
    [
        ([Need("a", "m", 10, True)], {"a": 10}, [], []),
        ([Need("a", "m", 10, True)], {"a": 11}, [], [Shortfall("a", "m", 11, 10, True)]),
        ([Need("a", "m", 10)], {"a": 11}, [], []),  # at least
        ([Need("a", "m", 10), Need("a", "m", 20)], {"a": 15}, [], [Shortfall("a", "m", 15, 20)]),
        ([Need("a", "m")], {}, [], [Shortfall("a", "m")]),
        ([Need("a", "m")], {}, ["a"], []),  # present, size unknown
        ([Need("rank-0001/", "m")], {"rank-0001/model.pt": 1}, [], []),
        ([Need("rank-0001/", "m")], {"rank-0000/model.pt": 1}, [], [Shortfall("rank-0001/", "m")]),
        ([Need("x/", "m")], {}, ["x/y/z"], []),
    ],
)
def test_shortfalls(needs: list[Need], present: dict[str, int], also: list[str], expected: list[Shortfall]) -> None:
    assert shortfalls(needs, present, also_present=also) == expected


def test_crc32_is_the_zip_crc() -> None:
    import zlib

    data = os.urandom(100_000)
    assert crc32(data) == zlib.crc32(data) and crc32(data[50:], crc32(data[:50])) == zlib.crc32(data)


# -- hostile archives and manifests: bounded decoding ----------------------------------------


def deflated_zip(payload: bytes, *, seekable: bool = True) -> bytes:
    """One deflated member holding ``payload`` (sizes in the local header, or a data descriptor after it)."""

    class Pipe(io.RawIOBase):
        def __init__(self) -> None:
            self.out = bytearray()

        def writable(self) -> bool:
            return True

        def write(self, b: bytes) -> int:  # type: ignore[override]
            self.out += b
            return len(b)

    sink: io.BytesIO | Pipe = io.BytesIO() if seekable else Pipe()
    with zipfile.ZipFile(sink, "w", compression=zipfile.ZIP_DEFLATED) as zf, zf.open("archive/data/0", "w") as fh:
        fh.write(payload)
    return sink.getvalue() if isinstance(sink, io.BytesIO) else bytes(sink.out)


@pytest.mark.parametrize("seekable", [True, False])
@pytest.mark.parametrize("chunk", [4096, 1 << 20])
def test_a_deflated_member_is_inflated_as_it_streams(seekable: bool, chunk: int) -> None:
    data = deflated_zip(bytes(16 << 20), seekable=seekable)  # 16 MiB of zeros in some 16 KB
    assert len(data) < 64 << 10
    assert check("model.pt", data, chunk=chunk) == Structure("torch zip")


def test_a_member_that_inflates_past_its_declared_size_is_a_bomb() -> None:
    data = bytearray(deflated_zip(bytes(8 << 20)))
    struct.pack_into("<I", data, 22, 1000)  # the local header's uncompressed size: a lie
    cd = data.rfind(b"PK\x01\x02")
    struct.pack_into("<I", data, cd + 24, 1000)  # and the central directory's, consistently
    got = check("model.pt", bytes(data))
    assert got.problem is not None and "inflates past the 1000 bytes its headers declare" in got.problem, got


def test_damaged_or_cut_deflate_data_is_named() -> None:
    data = bytearray(deflated_zip(os.urandom(1000) * 64))
    start = 30 + len("archive/data/0")
    data[start + 5] ^= 0xFF
    got = check("model.pt", bytes(data))
    assert got.problem is not None and ("deflate" in got.problem or "CRC-32" in got.problem), got


def test_json_manifests_are_parsed_within_bounds() -> None:
    from ckptier.storage.structure import MAX_JSON_DEPTH, StructureError, json_problem, parse_json

    deepest = parse_json(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH, "m")  # at the bound: parsed
    for _ in range(MAX_JSON_DEPTH - 1):
        deepest = deepest[0]
    assert deepest == []
    with pytest.raises(StructureError, match=f"nested deeper than {MAX_JSON_DEPTH} levels"):
        parse_json(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), "metadata.json")
    assert json_problem(b'{"a": "[[[[[[[[[[ {{{{ \\" [[[[[ ,,,,,"}', max_depth=2, max_values=2) is None  # in strings
    assert json_problem(b"[" + b"0," * 1000 + b"0]", max_values=100) == "holds more than 100 values (a manifest never does)"
    guide = check("metadata.json", b'{"step": 1, "files": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", fmt=Format.GUIDE)
    assert guide.problem is not None and "nested deeper" in guide.problem


def test_a_pickle_bomb_in_dcp_metadata_is_refused_not_built() -> None:
    from ckptier.formats.dcp import dcp_needs
    from ckptier.storage.structure import StructureError

    n = 1_000_000  # four bytes of opcodes per object built
    body = b"\x80\x02cdcp.bomb\nX\nq\x00" + b"]q\x01(" + b"h\x00)R" * n + b"e."
    with pytest.raises(StructureError, match="pickle bomb"):
        dcp_needs(body)
