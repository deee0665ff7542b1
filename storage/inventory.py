"""Reading an S3 Inventory report instead of listing a bucket.

S3 Inventory writes, daily or weekly, every object of a bucket into data
files (gzip'd CSV, Parquet or ORC) and a ``manifest.json`` naming them::

    {"sourceBucket": "ckpts", "destinationBucket": "arn:aws:s3:::inv",
     "version": "2016-11-30", "creationTimestamp": "1514944800000",
     "fileFormat": "CSV", "fileSchema": "Bucket, Key, Size, LastModifiedDate, ETag, StorageClass",
     "files": [{"key": "inv/ckpts/cfg/data/0f2c.csv.gz", "size": 2147, "MD5checksum": "f111..."}]}

at ``DEST-PREFIX/SOURCE-BUCKET/CONFIG-ID/YYYY-MM-DDTHH-MMZ/manifest.json``
(with ``manifest.checksum``, the MD5 of ``manifest.json``, beside it).
:func:`open_report` takes that manifest's URL, or the configuration's folder
(``s3://inv/DEST-PREFIX/SOURCE-BUCKET/CONFIG-ID/``, whose newest dated
manifest is used). :meth:`InventoryReport.objects` yields the current
versions of the objects under a prefix, as a listing would (size, last
modified, ETag, storage class). Inventory reports carry no checksum values,
only the algorithm's name, so ``ObjectInfo.checksum`` stays ``None``.

Parsing is pure (:func:`parse_manifest`, :func:`csv_rows`); data files are
read from the destination bucket, each checked against the manifest's MD5
before use. CSV keys are URL-encoded by S3 and decoded here. Parquet and ORC
files are read with pyarrow (``pip install 'ckptier[inventory]'``).

An inventory is a *past* listing: ``created_at`` is when S3 started taking
it, and anything may have changed since. See :mod:`ckptier.tasks.scan` for
what a scan from an inventory does and never does.
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import IO, Any
from urllib.parse import unquote_plus

from .base import ObjectInfo, Store, key_problem, read_bytes, whole_seconds
from .errors import ConfigError, IntegrityError, NotFound
from .url import parse_url

#: A manifest larger than this is refused (real ones list a few thousand files at most).
MANIFEST_LIMIT = 64 << 20
#: The fields a listing gives, as named in a CSV ``fileSchema`` and as Parquet/ORC columns.
CSV_FIELDS = {"Bucket": "bucket", "Key": "key", "VersionId": "version_id", "IsLatest": "is_latest",
              "IsDeleteMarker": "is_delete_marker", "Size": "size", "LastModifiedDate": "last_modified_date",
              "ETag": "e_tag", "StorageClass": "storage_class"}
FORMATS = ("CSV", "Parquet", "ORC")
_DATED = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}-\d{2}Z$")


@dataclass(frozen=True)
class DataFile:
    """One data file of a report: its key in the destination bucket, size and MD5 (hex)."""

    key: str
    size: int | None
    md5: str | None


@dataclass(frozen=True)
class Manifest:
    """A parsed ``manifest.json``."""

    source_bucket: str
    destination_bucket: str
    created_at: datetime
    file_format: str
    schema: tuple[str, ...]  # CSV column names, in order (empty for Parquet/ORC)
    files: tuple[DataFile, ...]


def parse_manifest(data: bytes, *, where: str) -> Manifest:
    """Parse a manifest; ``ConfigError`` naming ``where`` and the problem when it is not one."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"inventory manifest {where} is not JSON ({exc}); point --inventory at a manifest.json") from exc
    if not isinstance(doc, dict):
        raise ConfigError(f"inventory manifest {where} is not a JSON object; point --inventory at a manifest.json")

    def field(name: str) -> Any:
        if name not in doc:
            raise ConfigError(f"inventory manifest {where} has no {name!r}; is it an S3 Inventory manifest.json?")
        return doc[name]

    fmt = str(field("fileFormat"))
    fmt = next((f for f in FORMATS if f.lower() == fmt.lower()), fmt)
    if fmt not in FORMATS:
        raise ConfigError(f"inventory manifest {where}: fileFormat {fmt!r} is not one of {', '.join(FORMATS)}")
    try:
        created = datetime.fromtimestamp(int(field("creationTimestamp")) / 1000, UTC)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"inventory manifest {where}: creationTimestamp {doc['creationTimestamp']!r} "
                          "is not milliseconds since the epoch") from exc
    schema: tuple[str, ...] = ()
    if fmt == "CSV":
        schema = tuple(s.strip() for s in str(field("fileSchema")).split(","))
        if "Key" not in schema or "Bucket" not in schema:
            raise ConfigError(f"inventory manifest {where}: fileSchema {doc['fileSchema']!r} has no Bucket or Key column")
    files = []
    for f in field("files"):
        if not isinstance(f, dict) or not isinstance(f.get("key"), str):
            raise ConfigError(f"inventory manifest {where}: a files entry has no key: {f!r}")
        files.append(DataFile(f["key"], int(f["size"]) if f.get("size") is not None else None, f.get("MD5checksum")))
    dest = str(field("destinationBucket"))
    return Manifest(
        source_bucket=str(field("sourceBucket")),
        destination_bucket=dest.rsplit(":", 1)[-1] if dest.startswith("arn:") else dest,
        created_at=created,
        file_format=fmt,
        schema=schema,
        files=tuple(files),
    )


def _missing(value: Any) -> bool:
    """None, NaN, NaT or an empty CSV field."""
    import pandas as pd

    return value is None or (not isinstance(value, str) and bool(pd.isna(value))) or value == ""


def _etag(value: Any) -> str | None:
    """The ETag as ListObjectsV2 gives it (quoted), so a listing and an inventory agree."""
    if _missing(value):
        return None
    text = str(value)
    return text if text.startswith('"') else f'"{text}"'


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() == "true" if isinstance(value, str) else bool(value)


def _to_info(key: str, prefix: str, size: Any, modified: Any, etag: Any, storage_class: Any) -> ObjectInfo | None:
    rel = key[len(prefix):]
    if not rel or rel.endswith("/") or key_problem(rel) is not None:
        return None
    mtime: float | None
    if _missing(modified):
        mtime = None
    elif isinstance(modified, datetime):
        mtime = (modified if modified.tzinfo else modified.replace(tzinfo=UTC)).timestamp()
    elif hasattr(modified, "timestamp"):
        mtime = float(modified.timestamp())
    else:
        mtime = datetime.fromisoformat(str(modified).replace("Z", "+00:00")).timestamp()  # noqa: FURB162
    cls = None if _missing(storage_class) else str(storage_class)
    return ObjectInfo(key=rel, size=0 if _missing(size) else int(size),
                      mtime=None if mtime is None else whole_seconds(mtime), etag=_etag(etag), storage_class=cls)


def csv_rows(stream: IO[bytes], schema: tuple[str, ...], *, bucket: str, prefix: str) -> Iterator[ObjectInfo]:
    """The current objects of ``bucket`` under ``prefix`` in a gzip'd CSV data file
    (no header; columns as ``schema`` names them; keys URL-encoded), read with
    pandas in chunks. Keys are yielded relative to ``prefix``."""
    import pandas as pd

    names = [CSV_FIELDS.get(s, s) for s in schema]
    wanted = [n for n in names if n in CSV_FIELDS.values()]
    reader = pd.read_csv(stream, compression="gzip", header=None, names=names, usecols=wanted, dtype=str,
                         keep_default_na=False, chunksize=200_000)
    for chunk in reader:
        yield from _frame_rows(chunk, bucket=bucket, prefix=prefix, encoded=True)


def _frame_rows(frame: Any, *, bucket: str, prefix: str, encoded: bool) -> Iterator[ObjectInfo]:
    cols = set(frame.columns)
    if "bucket" in cols:
        frame = frame[frame["bucket"] == bucket]
    keys = frame["key"].map(unquote_plus) if encoded else frame["key"]
    keep = keys.str.startswith(prefix) if prefix else keys.notna()
    if "is_delete_marker" in cols:
        keep &= ~frame["is_delete_marker"].map(_truthy).astype(bool)
    if "is_latest" in cols:
        keep &= frame["is_latest"].map(lambda v: _missing(v) or _truthy(v)).astype(bool)
    frame, keys = frame[keep], keys[keep]
    n = len(frame)
    none = [None] * n

    def column(name: str) -> list[Any]:
        return frame[name].tolist() if name in cols else none

    for key, size, modified, etag, cls in zip(keys.tolist(), column("size"), column("last_modified_date"),
                                              column("e_tag"), column("storage_class"), strict=True):
        info = _to_info(key, prefix, size, modified, etag, cls)
        if info is not None:
            yield info


def columnar_rows(path: str, file_format: str, *, bucket: str, prefix: str) -> Iterator[ObjectInfo]:
    """The current objects of ``bucket`` under ``prefix`` in a Parquet or ORC data
    file at ``path``, read with pyarrow batch by batch into pandas."""
    try:
        import pyarrow  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"reading a {file_format} inventory needs pyarrow: pip install 'ckptier[inventory]'") from exc
    columns = list(CSV_FIELDS.values())
    if file_format == "Parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        present = [c for c in columns if c in pf.schema_arrow.names]
        batches: Iterator[Any] = pf.iter_batches(batch_size=200_000, columns=present)
    else:
        from pyarrow import orc

        of = orc.ORCFile(path)
        present = [c for c in columns if c in of.schema.names]
        batches = (of.read_stripe(i, columns=present) for i in range(of.nstripes))
    if "key" not in present:
        raise ConfigError(f"inventory data file {path}: no 'key' column; is it an S3 Inventory {file_format} file?")
    for batch in batches:
        yield from _frame_rows(batch.to_pandas(), bucket=bucket, prefix=prefix, encoded=False)


@dataclass(frozen=True)
class InventoryReport:
    """An S3 Inventory report: its manifest, where it was read, and the store of
    the destination bucket holding its data files."""

    url: str  # the manifest's s3:// URL
    manifest: Manifest
    store: Store  # the destination bucket (root)

    @property
    def created_at(self) -> datetime:
        return self.manifest.created_at

    def objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every current object of the source bucket whose key starts with
        ``prefix`` (a raw key prefix), with keys relative to it; delete markers
        and noncurrent versions are left out, as are folder markers and keys
        that are not safe store keys. Data files are read one at a time into
        a temporary file and checked against the manifest's MD5 first
        (``IntegrityError`` when one does not match)."""
        m = self.manifest
        for f in m.files:
            with tempfile.TemporaryFile(prefix="ckptier-inventory-") as tmp:
                md5 = hashlib.md5(usedforsecurity=False)
                try:
                    with self.store.open_read(f.key) as src:
                        while chunk := src.read(8 << 20):
                            md5.update(chunk)
                            tmp.write(chunk)
                except NotFound as exc:
                    raise NotFound(f"inventory {self.url}: data file s3://{m.destination_bucket}/{f.key} is gone; "
                                   "use a newer report") from exc
                if f.md5 and md5.hexdigest() != f.md5.lower():
                    raise IntegrityError(f"inventory {self.url}: data file s3://{m.destination_bucket}/{f.key} does "
                                         f"not match its MD5 in the manifest ({md5.hexdigest()} != {f.md5}); "
                                         "it is damaged or was replaced: use another report")
                tmp.seek(0)
                if m.file_format == "CSV":
                    yield from csv_rows(tmp, m.schema, bucket=m.source_bucket, prefix=prefix)
                else:
                    yield from columnar_rows(_path_of(tmp), m.file_format, bucket=m.source_bucket, prefix=prefix)


def _path_of(tmp: Any) -> str:
    """A path to read an open temporary file by (pyarrow wants a seekable source)."""
    return f"/proc/self/fd/{tmp.fileno()}" if isinstance(tmp.name, int) else str(tmp.name)


def open_report(url: str, *, open_store: Any = None, s3_options: Mapping[str, Any] | None = None) -> InventoryReport:
    """Read the inventory manifest at ``url`` (``s3://bucket/.../manifest.json``), or
    the newest dated manifest (``YYYY-MM-DDTHH-MMZ/manifest.json``) in the
    inventory configuration's folder ``url``. Checks ``manifest.checksum``
    when present. ``open_store(url)`` builds stores (default:
    :func:`ckptier.storage.url.open_store` with ``s3_options``)."""
    from .url import open_store as default_open

    def opener(u: str) -> Store:
        return open_store(u) if open_store is not None else default_open(u, **dict(s3_options or {}))

    parsed = parse_url(url)
    if parsed.scheme != "s3":
        raise ConfigError(f"inventory {url!r} is not an s3:// URL; give s3://bucket/path/manifest.json")
    bucket_store = opener(f"s3://{parsed.bucket}")
    key = parsed.prefix
    if not key.endswith("manifest.json"):
        folder = key + "/" if key else ""
        dated = sorted(
            {i.key[len(folder):].split("/", 1)[0] for i in bucket_store.list(folder)
             if i.key.endswith("/manifest.json") and _DATED.match(i.key[len(folder):].split("/", 1)[0])}
        )
        if not dated:
            raise ConfigError(f"inventory {url!r}: no YYYY-MM-DDTHH-MMZ/manifest.json under it; "
                              "give the manifest's URL or the inventory configuration's folder")
        key = f"{folder}{dated[-1]}/manifest.json"
    where = f"s3://{parsed.bucket}/{key}"
    try:
        data = read_bytes(bucket_store, key, limit=MANIFEST_LIMIT)
    except NotFound as exc:
        raise ConfigError(f"inventory manifest {where} does not exist; check the --inventory URL") from exc
    except ValueError as exc:
        raise ConfigError(f"inventory manifest {where} is larger than {MANIFEST_LIMIT} bytes; not a manifest") from exc
    try:
        expected = read_bytes(bucket_store, key[: -len(".json")] + ".checksum", limit=1024).decode().strip()
    except (NotFound, ValueError, UnicodeDecodeError):
        expected = ""
    if expected and hashlib.md5(data, usedforsecurity=False).hexdigest() != expected.lower():
        raise IntegrityError(f"inventory manifest {where} does not match manifest.checksum; "
                             "it is damaged or being replaced: retry, or use another report")
    manifest = parse_manifest(data, where=where)
    dest = manifest.destination_bucket or parsed.bucket
    return InventoryReport(url=where, manifest=manifest,
                           store=bucket_store if dest == parsed.bucket else opener(f"s3://{dest}"))
