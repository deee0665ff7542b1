"""The per-checkpoint manifest: what a copy of a checkpoint must contain.

A manifest lists every file of a checkpoint (relative path, size, CRC64NVME,
SHA-256 when known) plus what identifies the checkpoint (job, step, format)
and, for archive copies, how each file is stored (codec, stored object key,
size and checksum). It is written *last* next to an archive copy and is that
copy's commit marker; because storage is the truth, a lost catalog can be
rebuilt by scanning for manifests.

Serialization is canonical: the same content always gives the same bytes
(sorted keys, files sorted by relpath, fixed separators, UTC timestamps with
microseconds), so two writers of one checkpoint produce identical markers and
a byte comparison of manifests is meaningful. Parsing is strict: an unknown
version, a missing or unknown field, a wrong type or a malformed hash is a
:class:`ManifestError` naming the field and the value.
"""

from __future__ import annotations

import builtins
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from .base import key_problem
from .errors import CkptierError
from .hashing import is_crc64nvme, is_sha256_hex
from .records import CheckpointRecord, Format

#: The manifest format this code writes and the only one it reads.
MANIFEST_VERSION = 1

#: The JSON key that holds the version; distinctive, so a scan can tell a
#: manifest from any other JSON file.
VERSION_KEY = "ckptier_manifest"

#: Suggested file name of a manifest inside a copy's directory.
MANIFEST_NAME = "ckptier-manifest.json"

#: Manifests larger than this are refused when reading (bytes).
MAX_MANIFEST_BYTES = 64 << 20

Scalar = str | int | float | bool | None


class ManifestError(CkptierError, ValueError):
    """A manifest is malformed, of an unknown version, or inconsistent."""


@dataclass(frozen=True, slots=True)
class StoredObject:
    """How one file is stored in an archive copy.

    ``key`` is relative to the copy's prefix (the directory of the manifest);
    ``size`` (bytes) and ``crc64nvme`` describe the stored (encoded) bytes, so
    the copy can be checked without decoding it.
    """

    key: str
    size: int
    crc64nvme: str


@dataclass(frozen=True, slots=True)
class ManifestFile:
    """One file of the checkpoint as the training job wrote it.

    ``size`` (bytes), ``crc64nvme`` (S3's base64 form) and ``sha256`` (hex,
    when known) describe the original bytes; ``stored`` is set for archive
    copies whose bytes are encoded by the manifest's codec.
    """

    relpath: str
    size: int
    crc64nvme: str
    sha256: str | None = None
    stored: StoredObject | None = None


@dataclass(frozen=True)
class Manifest:
    """Everything a copy of one checkpoint must contain.

    ``files`` is kept sorted by relpath (the constructor sorts it).
    ``created_at`` is timezone-aware UTC (converted when given in another
    zone; naive datetimes are refused). ``codec`` names the archive encoding
    (``None`` for a plain copy) and ``codec_params`` its settings.
    ``source`` is the URL the copy was made from.
    """

    job: str
    step: int
    format: Format
    created_at: datetime
    files: tuple[ManifestFile, ...]
    codec: str | None = None
    codec_params: Mapping[str, Scalar] = field(default_factory=dict)
    source: str | None = None
    recorded_loss: float | None = None
    version: int = MANIFEST_VERSION

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise ManifestError(f"invalid manifest for {self.job!r} step {self.step!r}: {problems[0]}")
        object.__setattr__(self, "format", Format(self.format))
        object.__setattr__(self, "created_at", self.created_at.astimezone(UTC))
        object.__setattr__(self, "files", tuple(sorted(self.files, key=lambda f: f.relpath)))
        object.__setattr__(self, "codec_params", MappingProxyType(dict(self.codec_params)))

    @property
    def bytes(self) -> int:
        """Total size of the original files, bytes."""
        return sum(f.size for f in self.files)

    def file(self, relpath: str) -> ManifestFile:
        """The entry for ``relpath``; ``KeyError`` when the manifest has none."""
        for f in self.files:
            if f.relpath == relpath:
                return f
        raise KeyError(relpath)

    # -- serialization -------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The JSON object this manifest serializes to (every key present)."""
        return {
            VERSION_KEY: self.version,
            "job": self.job,
            "step": self.step,
            "format": self.format.value,
            "created_at": _format_time(self.created_at),
            "source": self.source,
            "recorded_loss": self.recorded_loss,
            "codec": None if self.codec is None else {"name": self.codec, "params": dict(self.codec_params)},
            "bytes": self.bytes,
            "files": [
                {
                    "relpath": f.relpath,
                    "size": f.size,
                    "crc64nvme": f.crc64nvme,
                    "sha256": f.sha256,
                    "stored": None
                    if f.stored is None
                    else {"key": f.stored.key, "size": f.stored.size, "crc64nvme": f.stored.crc64nvme},
                }
                for f in self.files
            ],
        }

    def to_json(self) -> builtins.bytes:
        """Canonical UTF-8 JSON: equal manifests give identical bytes (ends with a newline)."""
        text = json.dumps(self.to_dict(), sort_keys=True, indent=1, ensure_ascii=False, allow_nan=False)
        return text.encode("utf-8") + b"\n"

    @classmethod
    def from_json(cls, data: builtins.bytes, *, where: str = "manifest") -> Manifest:
        """Parse bytes written by :meth:`to_json`; strict.

        ``where`` (a URL or key) names the manifest in error messages. Raises
        :class:`ManifestError` for anything but a valid version-1 manifest.
        """
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{where}: {len(data)} bytes is too large for a manifest (limit {MAX_MANIFEST_BYTES})")
        try:
            obj = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
        except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
            raise ManifestError(f"{where}: not a manifest, invalid JSON ({exc}); was it truncated?") from exc
        except RecursionError:
            raise ManifestError(f"{where}: not a manifest, its JSON is nested too deeply") from None
        return cls.from_dict(obj, where=where)

    @classmethod
    def from_dict(cls, obj: object, *, where: str = "manifest") -> Manifest:
        """Build a manifest from its JSON object; strict (see :meth:`from_json`)."""
        r = _Reader(where)
        top = r.obj(obj, "manifest")
        if VERSION_KEY not in top:
            raise ManifestError(f"{where}: no {VERSION_KEY!r} key; this JSON is not a ckptier manifest")
        version = top[VERSION_KEY]
        if version != MANIFEST_VERSION or isinstance(version, bool):
            raise ManifestError(
                f"{where}: manifest version {version!r} is not supported (this ckptier reads version "
                f"{MANIFEST_VERSION}); upgrade ckptier to read it"
            )
        r.keys(top, "manifest", {VERSION_KEY, "job", "step", "format", "created_at", "source",
                                 "recorded_loss", "codec", "bytes", "files"})
        fmt = r.text(top["format"], "format")
        try:
            format_ = Format(fmt)
        except ValueError:
            raise ManifestError(
                f"{where}: format {fmt!r} is unknown; expected one of {', '.join(f.value for f in Format)}"
            ) from None
        created_text = r.text(top["created_at"], "created_at")
        try:
            created_at = datetime.fromisoformat(created_text)
        except ValueError:
            created_at = None
        if created_at is None or created_at.tzinfo is None:
            raise ManifestError(f"{where}: created_at {created_text!r} is not an ISO 8601 time with a zone")
        codec: str | None = None
        params: dict[str, Scalar] = {}
        if top["codec"] is not None:
            c = r.obj(top["codec"], "codec")
            r.keys(c, "codec", {"name", "params"})
            codec = r.text(c["name"], "codec.name")
            for k, v in r.obj(c["params"], "codec.params").items():
                if not isinstance(v, (str, int, float, bool)) and v is not None:
                    raise ManifestError(f"{where}: codec.params.{k} is {v!r}; parameters must be JSON scalars")
                params[k] = v
        files = []
        raw_files = top["files"]
        if not isinstance(raw_files, list):
            raise ManifestError(f"{where}: files is {type(raw_files).__name__}, expected a list")
        for i, raw in enumerate(raw_files):
            name = f"files[{i}]"
            fo = r.obj(raw, name)
            r.keys(fo, name, {"relpath", "size", "crc64nvme", "sha256", "stored"})
            stored = None
            if fo["stored"] is not None:
                so = r.obj(fo["stored"], f"{name}.stored")
                r.keys(so, f"{name}.stored", {"key", "size", "crc64nvme"})
                stored = StoredObject(
                    key=r.text(so["key"], f"{name}.stored.key"),
                    size=r.integer(so["size"], f"{name}.stored.size"),
                    crc64nvme=r.text(so["crc64nvme"], f"{name}.stored.crc64nvme"),
                )
            files.append(
                ManifestFile(
                    relpath=r.text(fo["relpath"], f"{name}.relpath"),
                    size=r.integer(fo["size"], f"{name}.size"),
                    crc64nvme=r.text(fo["crc64nvme"], f"{name}.crc64nvme"),
                    sha256=r.opt_text(fo["sha256"], f"{name}.sha256"),
                    stored=stored,
                )
            )
        loss = top["recorded_loss"]
        if loss is not None and (isinstance(loss, bool) or not isinstance(loss, (int, float))):
            raise ManifestError(f"{where}: recorded_loss is {loss!r}, expected a number or null")
        try:
            manifest = cls(
                job=r.text(top["job"], "job"),
                step=r.integer(top["step"], "step"),
                format=format_,
                created_at=created_at,
                files=tuple(files),
                codec=codec,
                codec_params=params,
                source=r.opt_text(top["source"], "source"),
                recorded_loss=None if loss is None else float(loss),
            )
        except ManifestError as exc:
            raise ManifestError(f"{where}: {exc}") from None
        total = r.integer(top["bytes"], "bytes")
        if total != manifest.bytes:
            raise ManifestError(f"{where}: bytes is {total} but the files add up to {manifest.bytes}; the manifest is inconsistent")
        return manifest

    @classmethod
    def for_record(
        cls,
        record: CheckpointRecord,
        *,
        created_at: datetime,
        codec: str | None = None,
        codec_params: Mapping[str, Scalar] | None = None,
        stored: Mapping[str, StoredObject] | None = None,
        source: str | None = None,
    ) -> Manifest:
        """The manifest of a cataloged checkpoint whose files all have a CRC64NVME.

        ``stored`` maps relpath to how that file is stored in the copy
        (archive copies). ``source`` defaults to ``record.location``. Raises
        ``ManifestError`` naming the first file without a recorded checksum
        (verify the checkpoint first).
        """
        stored = stored or {}
        files = []
        for f in record.files:
            if f.crc64nvme is None:
                raise ManifestError(
                    f"{record.job} step {record.step}: file {f.relpath!r} has no recorded crc64nvme; "
                    "verify the checkpoint before writing its manifest"
                )
            files.append(ManifestFile(f.relpath, f.size, f.crc64nvme, f.sha256_expected, stored.get(f.relpath)))
        unknown = set(stored) - {f.relpath for f in record.files}
        if unknown:
            raise ManifestError(f"{record.job} step {record.step}: stored objects for unknown files {sorted(unknown)!r}")
        return cls(
            job=record.job,
            step=record.step,
            format=record.format,
            created_at=created_at,
            files=tuple(files),
            codec=codec,
            codec_params=codec_params or {},
            source=record.location if source is None else source,
            recorded_loss=record.recorded_loss,
        )


def _format_time(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _problems(m: Manifest) -> list[str]:
    """Everything wrong with a manifest's content, first problem first."""
    out: list[str] = []
    if m.version != MANIFEST_VERSION:
        out.append(f"version {m.version!r} is not {MANIFEST_VERSION}")
    if not isinstance(m.job, str) or not m.job:
        out.append(f"job {m.job!r} must be a non-empty string")
    if isinstance(m.step, bool) or not isinstance(m.step, int) or m.step < 0:
        out.append(f"step {m.step!r} must be a non-negative integer")
    try:
        Format(m.format)
    except ValueError:
        out.append(f"format {m.format!r} is unknown")
    if not isinstance(m.created_at, datetime) or m.created_at.tzinfo is None:
        out.append(f"created_at {m.created_at!r} must be a timezone-aware datetime")
    if m.codec is not None and (not isinstance(m.codec, str) or not m.codec):
        out.append(f"codec {m.codec!r} must be a non-empty string or None")
    if m.codec is None and m.codec_params:
        out.append("codec_params given without a codec")
    if m.recorded_loss is not None and not math.isfinite(m.recorded_loss):
        out.append(f"recorded_loss {m.recorded_loss!r} must be finite")
    seen: set[str] = set()
    stored_keys: set[str] = set()
    for f in m.files:
        if not isinstance(f, ManifestFile):
            out.append(f"file entry {f!r} is not a ManifestFile")
            continue
        problem = key_problem(f.relpath) if isinstance(f.relpath, str) else "relpath is not a string"
        if problem:
            out.append(f"file {f.relpath!r}: {problem}")
        if f.relpath in seen:
            out.append(f"file {f.relpath!r} is listed twice")
        seen.add(f.relpath)
        if isinstance(f.size, bool) or not isinstance(f.size, int) or f.size < 0:
            out.append(f"file {f.relpath!r}: size {f.size!r} must be a non-negative integer")
        if not is_crc64nvme(f.crc64nvme):
            out.append(f"file {f.relpath!r}: crc64nvme {f.crc64nvme!r} is not base64 of 8 bytes")
        if f.sha256 is not None and not is_sha256_hex(f.sha256):
            out.append(f"file {f.relpath!r}: sha256 {f.sha256!r} is not 64 lowercase hex digits")
        if f.stored is not None:
            s = f.stored
            problem = key_problem(s.key) if isinstance(s.key, str) else "key is not a string"
            if problem:
                out.append(f"file {f.relpath!r}: stored {problem}")
            if s.key in stored_keys:
                out.append(f"file {f.relpath!r}: stored key {s.key!r} is used twice")
            stored_keys.add(s.key)
            if isinstance(s.size, bool) or not isinstance(s.size, int) or s.size < 0:
                out.append(f"file {f.relpath!r}: stored size {s.size!r} must be a non-negative integer")
            if not is_crc64nvme(s.crc64nvme):
                out.append(f"file {f.relpath!r}: stored crc64nvme {s.crc64nvme!r} is not base64 of 8 bytes")
    return out


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice")
        out[k] = v
    return out


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed")


class _Reader:
    """Type checks for parsed JSON, raising one-line ``ManifestError``s."""

    def __init__(self, where: str) -> None:
        self.where = where

    def obj(self, v: object, name: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise ManifestError(f"{self.where}: {name} is {type(v).__name__}, expected an object")
        return v

    def keys(self, v: dict[str, Any], name: str, expected: set[str]) -> None:
        missing = expected - v.keys()
        if missing:
            raise ManifestError(f"{self.where}: {name} lacks {sorted(missing)!r}; the manifest is incomplete")
        unknown = v.keys() - expected
        if unknown:
            raise ManifestError(
                f"{self.where}: {name} has unknown fields {sorted(unknown)!r}; written by a newer ckptier?"
            )

    def text(self, v: object, name: str) -> str:
        if not isinstance(v, str):
            raise ManifestError(f"{self.where}: {name} is {v!r}, expected a string")
        return v

    def opt_text(self, v: object, name: str) -> str | None:
        return None if v is None else self.text(v, name)

    def integer(self, v: object, name: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ManifestError(f"{self.where}: {name} is {v!r}, expected an integer")
        return v
