"""The catalog backup object: a compact, versioned, checksummed export of one job's catalog rows.

What storage cannot tell is kept here: tombstones, the files' verification
history (CRC64NVME baselines, statuses), every copy's state, restore drills
and events. One object per job and backup, written to the archive tier by
:mod:`ckptier.tasks.backup` after each ``apply`` and on ``ckptier catalog
backup``; read back by ``ckptier rebuild`` (:mod:`ckptier.tasks.rebuild`).

Layout of one object (bytes)::

    {"ckptier_catalog_backup": 1, "job": ..., "created_at": ..., "sha256": ..., "bytes": N, "counts": {...}}\\n
    <N bytes: gzip of the canonical JSON body>

The header is one line of JSON (readable with ``head -1``); ``sha256`` is
the digest of the ``N`` body bytes that follow, so a torn, truncated or
flipped object is caught before anything in it is used. The body is
canonical (sorted keys, fixed separators, gzip without a timestamp): equal
catalog contents give identical bytes, so a backup equal to the newest one
need not be written again (:attr:`BackupHeader.sha256`). Tables are stored
column-wise (``{"columns": [...], "rows": [[...], ...]}``), rows keyed by
step, never by catalog ids (a restore assigns new ones).

Pure: encoding and decoding only, no I/O.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from .errors import CkptierError

#: The version this code writes and the only one it reads.
BACKUP_VERSION = 1
#: The header's distinctive key (holds the version).
HEADER_KEY = "ckptier_catalog_backup"
#: Largest header line read (bytes).
MAX_HEADER = 64 << 10
#: Largest body accepted (bytes, compressed and uncompressed): far above a job of a million files.
MAX_BODY = 2 << 30


class BackupCorrupt(CkptierError, ValueError):
    """A backup object that is not a whole, intact backup this ckptier can read (one line: which and why)."""


@dataclass(frozen=True)
class BackupHeader:
    """The first line of a backup object: the job, when it was taken (aware UTC), the body's
    sha256 and size in bytes, and row counts by table."""

    job: str
    created_at: datetime
    sha256: str
    bytes: int
    counts: Mapping[str, int]
    version: int = BACKUP_VERSION


def encode_backup(job: str, created_at: datetime, body: Mapping[str, Any]) -> bytes:
    """The backup object of ``job``'s ``body`` (JSON-ready values only), taken at ``created_at``."""
    if created_at.tzinfo is None:
        raise ValueError("created_at must be timezone-aware")
    payload = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    compressed = gzip.compress(payload.encode("utf-8"), compresslevel=6, mtime=0)
    counts = {name: len(t["rows"]) for name, t in sorted(body.items()) if isinstance(t, Mapping) and "rows" in t}
    header = {HEADER_KEY: BACKUP_VERSION, "job": job, "created_at": created_at.astimezone(UTC).isoformat(),
              "sha256": hashlib.sha256(compressed).hexdigest(), "bytes": len(compressed), "counts": counts}
    return json.dumps(header, sort_keys=True, ensure_ascii=False).encode("utf-8") + b"\n" + compressed


def decode_header(data: bytes, *, where: str) -> BackupHeader:
    """The header of a backup object (``data`` may be just its start); :class:`BackupCorrupt` otherwise."""
    line, nl, _ = data[:MAX_HEADER].partition(b"\n")
    if not nl:
        raise BackupCorrupt(f"{where}: not a ckptier catalog backup (no header line)")
    try:
        head = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise BackupCorrupt(f"{where}: not a ckptier catalog backup (its header is not JSON)") from None
    if not isinstance(head, dict) or HEADER_KEY not in head:
        raise BackupCorrupt(f"{where}: not a ckptier catalog backup (no {HEADER_KEY!r} in its header)")
    version = head[HEADER_KEY]
    if version != BACKUP_VERSION or isinstance(version, bool):
        raise BackupCorrupt(f"{where}: catalog backup version {version!r} is not {BACKUP_VERSION}; "
                            f"read it with the ckptier that wrote it")
    try:
        job, sha, size, counts = head["job"], head["sha256"], head["bytes"], head["counts"]
        created = datetime.fromisoformat(head["created_at"])
    except (KeyError, TypeError, ValueError):
        raise BackupCorrupt(f"{where}: catalog backup header lacks job, created_at, sha256, bytes or counts") from None
    if (not isinstance(job, str) or not isinstance(sha, str) or isinstance(size, bool) or not isinstance(size, int)
            or not 0 <= size <= MAX_BODY or created.tzinfo is None or not isinstance(counts, dict)):
        raise BackupCorrupt(f"{where}: catalog backup header is malformed")
    return BackupHeader(job=job, created_at=created.astimezone(UTC), sha256=sha, bytes=size,
                        counts={str(k): int(v) for k, v in counts.items()})


def decode_backup(data: bytes, *, where: str) -> tuple[BackupHeader, dict[str, Any]]:
    """Header and body of a whole backup object, checked: the body's size and sha256 must be
    the header's, and it must decompress to a JSON object. :class:`BackupCorrupt` otherwise."""
    header = decode_header(data, where=where)
    start = data.index(b"\n") + 1
    compressed = data[start:]
    if len(compressed) != header.bytes:
        raise BackupCorrupt(f"{where}: catalog backup body is {len(compressed)} bytes, its header says "
                            f"{header.bytes} (truncated or extended)")
    if hashlib.sha256(compressed).hexdigest() != header.sha256:
        raise BackupCorrupt(f"{where}: catalog backup body does not match its sha256 {header.sha256[:16]}… "
                            f"(damaged)")
    try:
        raw = zlib.decompressobj(wbits=31).decompress(compressed, MAX_BODY)
        body = json.loads(raw.decode("utf-8"))
    except (zlib.error, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BackupCorrupt(f"{where}: catalog backup body does not decode ({exc})") from None
    if not isinstance(body, dict):
        raise BackupCorrupt(f"{where}: catalog backup body is not a JSON object")
    return header, body
