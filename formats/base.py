"""What a format plug-in is, and the pass API it recognises checkpoints with.

A plug-in (:class:`FormatPlugin`, one instance per format module, named
``PLUGIN``) answers, for its own layout:

* :meth:`~FormatPlugin.anchor`: which checkpoint directory (or single file) a
  listed key belongs to, from the key alone (plain string tests: it runs for
  every directory of a listing, and for every file whose name it declares
  in :attr:`~FormatPlugin.anchor_names` or ``anchor_suffixes``; for other
  names its verdict must be the directory's);
* :meth:`~FormatPlugin.recognise`: given every file of one such directory,
  the checkpoint it is (job, step, commit evidence, what its own manifests
  require), through the :class:`Scan` it is handed;
* :meth:`~FormatPlugin.checker`: the structural check of its manifests when
  verification reads them (data files - torch zip, safetensors - are
  checked whatever the format);
* :meth:`~FormatPlugin.load`: how a drill loads it safely (torch is imported
  there, lazily, never at module level);
* :attr:`~FormatPlugin.why_factory`: what a drill needs from the user;
* :meth:`~FormatPlugin.rank_files`: what each rank of a drill needs (a
  :class:`RankFiles`: whole files, or byte ranges of files), from the
  checkpoint's relpaths and its small shared metadata, before anything else
  is fetched.

Everything here is pure: no clock, no I/O but the injected ``read_small``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptier.storage.base import ObjectInfo
from ckptier.storage.errors import StoreError, is_transient
from ckptier.storage.records import FileRef, Format, Found, Shortfall, Unrecognised, file_ref
from ckptier.storage.structure import Checker, StructureError, parse_json

if TYPE_CHECKING:  # torch-free at import time: loading types are for annotations only
    from ckptier.formats.safe_load import LoadedCheckpoint

__all__ = [
    "MAX_STEP", "FormatPlugin", "Group", "Range", "RankFiles", "Scan", "as_loss", "as_step", "names", "step_in_name",
]

#: Largest step number the catalog stores (a signed 64-bit integer).
MAX_STEP = 2**63 - 1
#: How many files a reason names before "(+N more)".
MAX_NAMED = 3

DATA_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".distcp", ".ckpt", ".pkl", ".npy", ".npz", ".h5", ".msgpack")

_by_key = attrgetter("key")


@dataclass(slots=True)
class Group:
    """Files below one candidate checkpoint directory (``prefix``), or the one
    file of a single-file checkpoint (``single``: ``prefix`` is its key).
    ``claimants`` are the formats whose anchors claimed some of its files."""

    prefix: str
    files: list[ObjectInfo]
    claimants: list[Format] = field(default_factory=list)
    single: bool = False

    @property
    def dirname(self) -> str:
        return self.prefix[self.prefix.rfind("/") + 1 :]

    def relpath(self, info: ObjectInfo) -> str:
        return info.key[len(self.prefix) + 1 :]

    def top(self) -> dict[str, ObjectInfo]:
        """Files directly in the directory, by name."""
        cut = len(self.prefix) + 1
        return {f.key[cut:]: f for f in self.files if "/" not in f.key[cut:]}

    def sizes(self) -> dict[str, int]:
        cut = len(self.prefix) + 1
        return {f.key[cut:]: f.size for f in self.files}


Range = tuple[int, int]
"""A byte range of a file: ``(offset, length)``."""

#: Layouts of :attr:`RankFiles.layout`.
REPLICATED, SHARDED, PARTITIONED = "replicated", "sharded", "partitioned"


@dataclass(frozen=True)
class RankFiles:
    """What each rank of a drill needs from one checkpoint; pure data.

    ``saved_world`` is how many ranks wrote the checkpoint. ``needs[r]`` is
    what drill rank ``r`` reads (one entry per drill rank: ``len(needs)`` is
    the drill's world size), relpath -> ``None`` for the whole file, or the
    byte ranges ``(offset, length)`` it reads from that file. ``shared``:
    small metadata every rank gets whole (the manifests; not shards).
    ``layout``: ``replicated`` (every saved rank holds the whole state, as
    DDP saves it: a drill rank loads one replica), ``sharded`` (each saved
    rank holds its part, as FSDP2 or DCP saves it: a drill rank reads the
    parts that overlap its own), or ``partitioned`` (ranks hold tensor
    slices, layers or flat optimizer partitions of their own: Megatron's
    tensor and pipeline parallelism, DeepSpeed's model parallelism and ZeRO;
    multi-rank drills do not restore these yet, and ``needs`` lists each
    saved rank's files).
    """

    saved_world: int
    layout: str
    shared: tuple[str, ...]
    needs: tuple[Mapping[str, tuple[Range, ...] | None], ...]

    @property
    def world(self) -> int:
        """The drill's world size."""
        return len(self.needs)

    def owners(self) -> dict[str, int]:
        """relpath -> the drill rank that fetches it whole (every other rank
        needing it gets its copy, whole or the ranges it reads, from that
        one's verified bytes): the first rank needing it whole, else the one
        reading most of it (the lowest on a tie). Shared files are not listed."""
        whole: dict[str, int] = {}
        most: dict[str, tuple[int, int]] = {}
        for rank, need in enumerate(self.needs):
            for rel, ranges in need.items():
                if ranges is None:
                    whole.setdefault(rel, rank)
                else:
                    size = sum(n for _, n in ranges)
                    if rel not in most or size > most[rel][0]:
                        most[rel] = (size, rank)
        return {**{rel: r for rel, (_, r) in most.items()}, **whole}

    def needed_bytes(self, rank: int, sizes: Mapping[str, int]) -> int:
        """Bytes of shards (``shared`` excluded) drill rank ``rank`` holds:
        whole files at their ``sizes``, ranges at their lengths."""
        return sum(sizes.get(rel, 0) if ranges is None else sum(n for _, n in ranges)
                   for rel, ranges in self.needs[rank].items())


def replicated(relpaths: Sequence[str], world: int, *, shared: Sequence[str] = ()) -> RankFiles:
    """One saved rank whose files every one of ``world`` drill ranks loads whole."""
    skip = set(shared)
    need: dict[str, tuple[Range, ...] | None] = {r: None for r in relpaths if r not in skip}
    return RankFiles(1, REPLICATED, tuple(shared), tuple(dict(need) for _ in range(world)))


class FormatPlugin:
    """One checkpoint format; see the module docstring. Subclasses set the
    class attributes and override what their layout needs."""

    format: Format
    #: Files :meth:`recognise` may read through ``read_small`` (prefetched by scans),
    #: job-level ones among them.
    metadata_names: frozenset[str] = frozenset()
    #: Job-level files the format owns (trackers, tags, helper scripts): never stray.
    sidecar_names: frozenset[str] = frozenset()
    #: File names, and name endings, that :meth:`anchor` may claim by the name
    #: itself. For every other file the anchor's verdict must depend on the
    #: file's directory alone (the same for every such file in it): a scan
    #: anchors the first of them and reuses the verdict for its siblings.
    anchor_names: frozenset[str] = frozenset()
    anchor_suffixes: tuple[str, ...] = ()
    #: Unclaimed files in subdirectories of a checkpoint join it (not only those beside it).
    adopts_subdirs: bool = False
    #: Whether restore drills can load it at all.
    drillable: bool = True
    #: Why a drill needs a model factory (``--model``) for this format.
    why_factory: str = "the checkpoint holds tensors only and the model's code is needed"
    #: Globals the format's own library pickles, with why each is harmless,
    #: loaded as inert records (:mod:`ckptier.formats.stubs`), never imported.
    library_globals: Mapping[str, str] = {}

    def anchor(self, key: str, slash: int, up: int) -> str | None:
        """The prefix of the checkpoint ``key`` belongs to, or None when this
        format does not claim it. ``slash`` is the index of the key's last
        ``/`` (-1: none) and ``up`` of the one before (-1: none). A prefix
        equal to ``key`` makes a single-file checkpoint."""
        return None

    def recognise(self, group: Group, scan: Scan) -> None:  # pragma: no cover - every plug-in overrides it
        raise NotImplementedError

    def checker(self, relpath: str, name: str, base: str) -> Checker | None:
        """A structural checker of the manifest ``relpath`` (file ``name`` in
        directory ``base``, relative to the checkpoint), or None."""
        return None

    def load(self, path: Path, allow: Sequence[Any]) -> LoadedCheckpoint:
        """The checkpoint at the local ``path`` loaded safely, on CPU, for a drill."""
        from ckptier.formats.safe_load import CheckpointLoadError

        raise CheckpointLoadError(f"{path}: {self.format.value} checkpoints cannot be drilled")

    def saved_ranks(self, relpaths: Sequence[str]) -> int:
        """How many ranks wrote a checkpoint of these files (relpaths below
        its directory), from the names alone; 1 for a format with no ranks of
        its own."""
        return 1

    def rank_files(self, relpaths: Sequence[str], read: Callable[[str], bytes], world: int | None = None) -> RankFiles:
        """What each of ``world`` drill ranks (default: as many as saved the
        checkpoint) needs of the checkpoint whose files are ``relpaths``;
        ``read(relpath)`` gives the bytes of a small metadata file (the
        format's manifests only). Pure. A format with no ranks of its own is
        one saved rank holding every file, which each drill rank loads whole
        (a data-parallel restore). Raises ``ValueError`` (one line) when the
        files cannot be split into ranks."""
        return replicated(relpaths, world or 1)

    def drill_path(self, fetched: Path, relpaths: Sequence[str], single: bool) -> Path:
        """What the drill worker is given: the fetched directory, or its one
        file for a single-file checkpoint."""
        return fetched / relpaths[0] if single else fetched


# --------------------------------------------------------------------------
# The pass over one listing, as plug-ins see it


@dataclass(slots=True)
class Tally:
    count: int
    example: str


class Scan:
    """State of one recognition pass: what was found, what was not, and the
    helpers every plug-in uses. ``now`` is epoch seconds."""

    def __init__(
        self,
        read_small: Callable[[str], bytes],
        root_name: str,
        now: float,
        metadata_limit: int,
        lightning_settle: float,
        unclaimed: Callable[[ObjectInfo], None],
    ) -> None:
        self.read_small = read_small
        self.root_name = root_name
        self.now = now
        self.metadata_limit = metadata_limit
        self.lightning_settle = lightning_settle
        self.unclaimed = unclaimed
        self.found: list[Found] = []
        self.unrecognised: list[Unrecognised] = []
        self.sidecars: dict[str, ObjectInfo] = {}
        self.used_sidecars: set[str] = set()

    def job_of(self, prefix: str) -> str:
        """The directory above ``prefix`` (a checkpoint dir or file key)."""
        cut = prefix.rfind("/")
        return prefix[:cut] if cut > 0 else self.root_name

    def refuse(self, key: str, reason: str) -> None:
        self.unrecognised.append(Unrecognised(key, reason))

    def sidecar(self, prefix: str, name: str) -> ObjectInfo | None:
        """The job-level file ``name`` beside the checkpoint directory ``prefix``
        (a tracker or tag file), if listed; it is then not reported as stray."""
        cut = prefix.rfind("/")
        key = f"{prefix[:cut]}/{name}" if cut > 0 else name
        info = self.sidecars.get(key)
        if info is not None:
            self.used_sidecars.add(key)
        return info

    def read_json(self, info: ObjectInfo, label: str) -> tuple[Any, str | None]:
        """Parse a small JSON file; return (value, None) or (None, reason)."""
        data, problem = self.read_raw(info, label)
        if problem is not None:
            return None, problem
        try:
            return parse_json(data, label), None
        except StructureError as exc:  # not JSON, or past the bounds a manifest stays within
            return None, str(exc)

    def read_raw(self, info: ObjectInfo, label: str) -> tuple[bytes, str | None]:
        """A small file's bytes; return (bytes, None) or (b"", reason)."""
        if info.size > self.metadata_limit:
            return b"", (
                f"{label}: {info.size} bytes, over the {self.metadata_limit}-byte limit for metadata files; "
                "raise metadata_limit if it is genuine"
            )
        if info.size == 0:
            return b"", f"{label}: empty file (0 bytes)"
        try:
            data = self.read_small(info.key)
        except StoreError as exc:
            if is_transient(exc):
                raise
            return b"", f"{label}: could not be read ({exc})"
        except ValueError as exc:  # e.g. read_bytes' size limit
            return b"", f"{label}: could not be read ({exc})"
        if not data:
            return b"", f"{label}: empty file (0 bytes)"
        return data, None

    def read_text(self, info: ObjectInfo, label: str) -> tuple[str, str | None]:
        data, problem = self.read_raw(info, label)
        if problem is not None:
            return "", problem
        try:
            return data.decode("utf-8").strip(), None
        except UnicodeDecodeError:
            return "", f"{label}: not valid UTF-8 text"

    def emit(
        self,
        *,
        job: str,
        step: int,
        fmt: Format,
        prefix: str,
        files: list[ObjectInfo],
        committed: bool,
        reason: str,
        expected: dict[str, str] | None = None,
        loss: float | None = None,
        single: bool = False,
        short: Sequence[Shortfall] = (),
        metrics: Mapping[str, float] | None = None,
    ) -> None:
        if step > MAX_STEP:
            self.refuse(
                prefix if single else prefix + "/",
                f"step {step} is out of range: ckptier catalogs steps up to 2^63-1 ({MAX_STEP})",
            )
            return
        files.sort(key=_by_key)  # one common prefix: key order is relpath order
        if single:
            refs = [file_ref(f.key, f.key[f.key.rfind("/") + 1 :], f.size, f.mtime, f.etag, f.checksum, f.link)
                    for f in files]
        else:
            cut = len(prefix) + 1
            refs = [file_ref(f.key, f.key[cut:], f.size, f.mtime, f.etag, f.checksum, f.link) for f in files]
        if committed:
            empty = _empty_data_file(refs)
            if empty is not None:
                committed = False
                reason = f"{empty} is empty (0 bytes): save in flight or torn"
        self.found.append(
            Found(
                job=job,
                step=step,
                format=fmt,
                prefix=prefix,
                files=tuple(refs),
                committed=committed,
                reason=reason,
                expected_sha256=dict(expected or {}),
                recorded_loss=loss,
                shortfalls=tuple(short),
                metrics=dict(metrics or {}),
            )
        )

    def settled(self, files: list[ObjectInfo], settle: float, what: str) -> tuple[bool, str]:
        """Commit evidence by age: the newest file at least ``settle`` seconds old."""
        if not any(f.size for f in files):
            shown = [f.key[f.key.rfind("/") + 1 :] for f in files]
            return False, f"{names(sorted(shown))}: empty (0 bytes): save in flight or torn"
        times = [f.mtime for f in files]
        if any(t is None for t in times):
            return False, "the store gives no modification time, so the save cannot be known to have finished"
        age = self.now - max(t for t in times if t is not None)
        if age < settle:
            return False, f"modified {max(age, 0.0):.0f} s ago, within the {settle:g} s settle time of {what}"
        return True, f"committed: unchanged for {settle:g} s ({what} settle time)"


# --------------------------------------------------------------------------
# Small pure helpers shared by the plug-ins


def names(items: Sequence[str]) -> str:
    shown = ", ".join(items[:MAX_NAMED])
    return shown + (f" (+{len(items) - MAX_NAMED} more)" if len(items) > MAX_NAMED else "")


def _empty_data_file(refs: Sequence[FileRef]) -> str | None:
    for ref in refs:
        if ref.size == 0 and ref.relpath.endswith(DATA_SUFFIXES):
            return ref.relpath
    return None


def as_step(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return None


def as_loss(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


_STEP_NAMES = re.compile(
    r"""(?:^|[^0-9A-Za-z])(?:
        (?:global_)?step[-_=]?(?P<a>\d+)          # step-N step_N stepN step=N global_stepN global_step_N
      | iter(?:ation)?[-_]?(?P<b>\d+)              # iter_0000100 iter-N iteration_N
      | checkpoint[-_](?P<c>\d+)                   # checkpoint-N checkpoint_N
      | ckpt[-_](?P<d>\d+)                         # ckpt-N
    )(?=$|[^0-9A-Za-z])""",
    re.VERBOSE | re.IGNORECASE,
)


def step_in_name(name: str) -> int | None:
    """The step a directory name holds (``step-100``, ``step_100``,
    ``iter_0000100``, ``global_step100``, ``checkpoint-100``,
    ``epoch=3-step=100``...), or None when it holds none or several
    different ones; pure."""
    found = {int(next(g for g in m.groups() if g is not None)) for m in _STEP_NAMES.finditer(name)}
    return found.pop() if len(found) == 1 else None
