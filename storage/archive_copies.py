"""What an archive location holds, judged from its listing and its committed manifests: pure.

The archive layout (written by :mod:`ckptier.tasks.archive`)::

    {job}/step-{step:08d}/.ckptier/upload.json     upload marker, written first
    {job}/step-{step:08d}/{relpath}.ckz            one encoded object per file
    {job}/step-{step:08d}/ckptier-manifest.json    the commit marker, written last
    .ckptier/catalog/...                           catalog backups (:mod:`ckptier.storage.catalog_backup`)

A step directory is an archive copy only once its manifest exists. What a
copy *is* follows from two things and nothing else: the manifest's bytes
(parsed strictly by :class:`~ckptier.storage.manifest.Manifest`; a manifest
that cannot be read back is never trusted) and the listing of the
objects it names. :func:`group_listing` sorts a listing into copies,
uncommitted directories and backups; :func:`judge_copy` says whether a copy's
objects are all there as its manifest describes them. Proving the bytes
(decoding, or the store's full-object checksums) is the verifier's job
(:func:`ckptier.tasks.archive.check_archive_copy`); a copy judged damaged
here is never proven and never ``present``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from .base import ObjectInfo, join_key
from .manifest import MANIFEST_NAME, Manifest, ManifestFile

#: Suffix of an archived (encoded) data object.
DATA_SUFFIX = ".ckz"
#: The upload marker, relative to a copy's directory.
UPLOAD_MARKER = ".ckptier/upload.json"
#: Where catalog backups live, relative to the archive's root.
BACKUP_PREFIX = ".ckptier/catalog/"

_COPY_DIR = re.compile(r"^(?:(?P<job>.+)/)?step-(?P<step>\d{8,})$")


def copy_dir(job: str, step: int) -> str:
    """The key prefix of one checkpoint's archive copy: ``{job}/step-{step:08d}``."""
    return join_key(job, f"step-{step:08d}")


def parse_copy_dir(directory: str) -> tuple[str, int] | None:
    """``(job, step)`` of a copy directory ``{job}/step-NNNNNNNN``, or None when it is not one.
    A job is always named: a step directory at the archive's root is no copy."""
    m = _COPY_DIR.match(directory)
    if m is None or m.group("job") is None:
        return None
    return m.group("job"), int(m.group("step"))


@dataclass(frozen=True)
class ArchiveListing:
    """One listing of an archive location, sorted out (:func:`group_listing`).

    ``objects``: every listed object by key; ``copies``: directories holding a
    commit marker, sorted; ``uncommitted``: directories with an upload marker
    and no commit marker (a promotion that never finished: the janitor's),
    sorted; ``backups``: catalog backup objects' keys, sorted."""

    objects: Mapping[str, ObjectInfo]
    copies: tuple[str, ...]
    uncommitted: tuple[str, ...] = ()
    backups: tuple[str, ...] = ()


def group_listing(listing: Iterable[ObjectInfo]) -> ArchiveListing:
    """Sort an archive listing (keys relative to the archive's root) into copies, uncommitted
    directories and backups. Pure; linear in the listing."""
    objects: dict[str, ObjectInfo] = {}
    copies: set[str] = set()
    marked: set[str] = set()
    backups: list[str] = []
    marker_tail = "/" + UPLOAD_MARKER
    for info in listing:
        key = info.key
        objects[key] = info
        if key.startswith(BACKUP_PREFIX):
            backups.append(key)
            continue
        head, _, name = key.rpartition("/")
        if name == MANIFEST_NAME and parse_copy_dir(head) is not None:
            copies.add(head)
        elif key.endswith(marker_tail) and parse_copy_dir(key[: -len(marker_tail)]) is not None:
            marked.add(key[: -len(marker_tail)])
    return ArchiveListing(objects=objects, copies=tuple(sorted(copies)), uncommitted=tuple(sorted(marked - copies)),
                          backups=tuple(sorted(backups)))


CopyState = Literal["intact", "damaged", "unreadable"]


@dataclass(frozen=True)
class CopyVerdict:
    """What one committed archive copy is, as far as its manifest and the listing tell.

    ``state``: ``intact`` (every object the manifest names is listed, with the
    stored size it records, and no checksum the listing shows contradicts
    it: the bytes still need proving), ``damaged`` (the manifest reads, but an
    object is missing, of another size or checksum, the manifest names another
    job or step than its directory, or it was written by an unknown codec), or
    ``unreadable`` (the manifest itself cannot be read back: nothing it says is
    trusted). ``job`` and ``step`` are the directory's (an intact copy's
    manifest names the same). ``problems``: one line each, naming the object.
    ``stored_bytes``: the listed objects' total size; ``storage_class``: their
    class when the listing shows exactly one.
    """

    directory: str
    job: str
    step: int
    state: CopyState
    manifest: Manifest | None = None
    problems: tuple[str, ...] = ()
    stored_bytes: int = 0
    storage_class: str | None = None
    bad_files: tuple[str, ...] = field(default=())

    @property
    def intact(self) -> bool:
        return self.state == "intact"


def stored_key(directory: str, f: ManifestFile) -> str:
    """The key of a manifest file entry's stored object in the copy at ``directory``: its
    ``stored.key``, else the default name ``relpath + .ckz``."""
    return join_key(directory, f.stored.key if f.stored is not None else f.relpath + DATA_SUFFIX)


def judge_copy(directory: str, manifest: Manifest | str, objects: Mapping[str, ObjectInfo]) -> CopyVerdict:
    """Judge the copy at ``directory`` from its manifest (a parsed :class:`Manifest`, or why it
    could not be read back) and ``objects`` (the archive's listing by key). Pure.

    Raises ``ValueError`` when ``directory`` is not a copy directory (``{job}/step-N``)."""
    from .codec import CODEC_ID  # here: the codec brings numpy, which recognition (importing the layout) never needs

    where = parse_copy_dir(directory)
    if where is None:
        raise ValueError(f"{directory!r} is not an archive copy directory ({{job}}/step-NNNNNNNN)")
    job, step = where
    if isinstance(manifest, str):
        return CopyVerdict(directory, job, step, "unreadable", problems=(f"{MANIFEST_NAME}: {manifest}",))
    problems: list[str] = []
    bad: list[str] = []
    if copy_dir(manifest.job, manifest.step) != directory:
        problems.append(f"{MANIFEST_NAME}: names job {manifest.job!r} step {manifest.step}, but lies in {directory!r}")
        bad.extend(f.relpath for f in manifest.files)
    if manifest.codec is not None and manifest.codec != CODEC_ID:
        problems.append(f"{MANIFEST_NAME}: codec {manifest.codec!r} is not one this ckptier decodes ({CODEC_ID})")
        bad.extend(f.relpath for f in manifest.files)
    stored = 0
    classes: set[str | None] = set()
    for f in manifest.files:
        key = stored_key(directory, f)
        info = objects.get(key)
        if info is None:
            problems.append(f"{f.relpath}: its stored object {key} is missing")
            bad.append(f.relpath)
            continue
        stored += info.size
        classes.add(info.storage_class)
        want = f.stored
        if want is not None and info.size != want.size:
            problems.append(f"{f.relpath}: {key} is {info.size} bytes, the manifest says {want.size}")
            bad.append(f.relpath)
        elif want is not None and info.checksum is not None and info.checksum != f"crc64nvme:{want.crc64nvme}":
            problems.append(f"{f.relpath}: {key} has checksum {info.checksum}, the manifest says "
                            f"crc64nvme:{want.crc64nvme}")
            bad.append(f.relpath)
    return CopyVerdict(
        directory, job, step, "damaged" if problems else "intact", manifest, tuple(problems), stored,
        next(iter(classes)) if len(classes) == 1 else None, tuple(sorted(set(bad))),
    )
