"""``dcp``: PyTorch Distributed Checkpoint directories, wherever they are.

Layout: a directory holding ``*.distcp`` shards and ``.metadata``, as
torchtitan (``{job}/step-{N}/``), torchtune and Megatron's ``torch_dist``
write it. Commit evidence: ``.metadata`` (written last, by the coordinator,
after every rank wrote its shards), non-empty, with at least one shard, and
every ``.distcp`` it references present with at least the largest
``offset + length`` it references (:func:`dcp_needs`; otherwise the
checkpoint is committed but short: incomplete within the job's grace,
corrupt after). ``.metadata`` is a pickle: it is read by a restricted
unpickler that constructs nothing executable. A ``metadata.json`` beside the
shards is read only for its ``loss``.

The step comes from the directory's own name: ``step-N``, ``step_N``,
``iter_NNNNNNN``, ``global_stepN``, ``checkpoint-N``, ``epoch=E-step=S``...
(:func:`ckptier.formats.base.step_in_name`); a directory whose name holds no
step is reported as not recognised ("no step in the path"). A ``step-*``
directory mixing shards with ``rank-*`` directories is refused (guide or
DCP? ckptier does not guess).

Drills load every tensor entry through a reader whose ``.metadata``
unpickler admits only DCP's own classes, and never the non-tensor entries
(DCP unpickles those with ``weights_only=False``): keys ``model.*`` (or a
model-only state dict) and the flattened ``optimizer.state.*`` of
torchtitan's ``{"model": ..., "optimizer": ...}`` (:func:`loaded_key`). A
factory is needed.

Ranks: the shards are ``__{R}_{K}.distcp``, written by rank R
(:meth:`DcpFormat.saved_ranks`). :meth:`DcpFormat.rank_files` reads
``.metadata`` (inertly) and gives each drill rank the byte ranges it reads:
a tensor saved in several chunks (FSDP2, torchtitan) is sharded again over
the drill's ranks along dim 0 as FSDP2 shards it, so a drill rank reads the
saved chunks that overlap its rows; a tensor saved whole (DDP, or a scalar
such as Adam's ``step``) is read whole by every rank. DCP's own planner
does the reading (and the resharding); the reader checks that every range it
is asked for was fetched (:func:`safe_dcp_reader`).
"""

from __future__ import annotations

import io
import math
import pickle
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptier.formats.base import (
    REPLICATED,
    SHARDED,
    FormatPlugin,
    Group,
    Range,
    RankFiles,
    Scan,
    as_loss,
    names,
    step_in_name,
)
from ckptier.formats.loaded import (
    CheckpointLoadError,
    LoadedCheckpoint,
    UnsafeCheckpoint,
    float_or_none,
    read_json,
    step_from_name,
)
from ckptier.storage.base import ObjectInfo, key_problem
from ckptier.storage.errors import CkptierError
from ckptier.storage.records import Format, Shortfall
from ckptier.storage.structure import Checker, Need, StructureError, manifest_checker, shortfalls

if TYPE_CHECKING:
    import torch

__all__ = [
    "PLUGIN", "DcpLayout", "dcp_layout", "dcp_needs", "dcp_rank_files", "dcp_shortfalls", "load_dcp_tensors",
    "loaded_key", "read_dcp_metadata", "safe_dcp_reader", "shard_rows",
]

_DCP_META = ".metadata"
_GUIDE_META = "metadata.json"


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class DcpFormat(FormatPlugin):
    format = Format.DCP
    metadata_names = frozenset({_DCP_META, _GUIDE_META})
    anchor_names = frozenset({_DCP_META})
    anchor_suffixes = (".distcp",)
    why_factory = "a DCP checkpoint holds tensors only and the model's code is needed"

    def anchor(self, key: str, slash: int, up: int) -> str | None:
        if slash > 0 and (key.endswith(".distcp") or key.endswith("/.metadata")):
            return key[:slash]
        return None

    def recognise(self, group: Group, scan: Scan) -> None:
        prefix, dirname = group.prefix, group.dirname
        top = group.top()
        nested = [f for f in group.files if "/" in group.relpath(f)]
        if nested and dirname.startswith("step-") and any(group.relpath(f).startswith("rank-") for f in nested):
            scan.refuse(
                prefix + "/",
                f"{dirname!r} mixes DCP shards (.distcp/.metadata) with rank-* directories; "
                "ckptier cannot tell which layout it is",
            )
            return
        if dirname.startswith("step-"):
            text = dirname[5:]
            step = int(text) if text.isascii() and text.isdigit() else None
            if step is None:
                scan.refuse(prefix + "/", f"{dirname!r}: {text!r} is not a step number; expected step-<digits>")
                return
        else:
            step = step_in_name(dirname)
            if step is None:
                scan.refuse(
                    prefix + "/",
                    f"DCP checkpoint {dirname!r} not recognised: no step in the path; name its directory "
                    "step-N (or step_N, iter_N, global_stepN, checkpoint-N), or add a [[pattern]] rule",
                )
                return
        committed, reason, short = dcp_commit(group, scan, top)
        loss = None
        extra = top.get(_GUIDE_META)
        if extra is not None and committed:  # a training script's own notes; not commit evidence
            meta, _ = scan.read_json(extra, _GUIDE_META)
            if isinstance(meta, dict):
                loss = as_loss(meta.get("loss", meta.get("train_loss")))
        scan.emit(
            job=scan.job_of(prefix), step=step, fmt=Format.DCP, prefix=prefix, files=group.files,
            committed=committed, reason=reason, loss=loss, short=short,
        )

    def checker(self, relpath: str, name: str, base: str) -> Checker | None:
        return dcp_checker(relpath, name, base)

    def saved_ranks(self, relpaths: Sequence[str]) -> int:
        return saved_dcp_ranks(r for r in relpaths if "/" not in r)

    def rank_files(self, relpaths: Sequence[str], read: Callable[[str], bytes], world: int | None = None) -> RankFiles:
        if _DCP_META not in relpaths:
            raise ValueError("no .metadata: the DCP checkpoint is incomplete")
        layout = dcp_layout(read(_DCP_META))
        shared = tuple(r for r in relpaths if "/" not in r and not r.endswith(".distcp"))
        return dcp_rank_files(layout, world or self.saved_ranks(relpaths), shared=shared,
                              saved_world=self.saved_ranks(relpaths))

    def load(self, path: Path, allow: Sequence[Any]) -> LoadedCheckpoint:
        return load_dcp(path)


PLUGIN = DcpFormat()


def dcp_commit(
    group: Group, scan: Scan, top: dict[str, ObjectInfo], what: str = "committed"
) -> tuple[bool, str, list[Shortfall]]:
    """DCP's commit evidence in ``group`` (its ``.metadata``, shards, and the
    shortfalls ``.metadata`` names): ``(committed, reason, shortfalls)``."""
    shards = sum(1 for name in top if name.endswith(".distcp"))
    meta = top.get(_DCP_META)
    if meta is None:
        return False, "no .metadata: save in flight or torn", []
    if meta.size == 0:
        return False, ".metadata is empty (0 bytes): save in flight or torn", []
    if not shards:
        return False, ".metadata present but no .distcp shards: torn or partly deleted", []
    reason = f"{what}: .metadata present with {shards} .distcp shard(s)"
    data, problem = scan.read_raw(meta, _DCP_META)
    short: list[Shortfall] = []
    if problem is None:
        try:
            short = shortfalls(dcp_needs(data), group.sizes())
        except StructureError as exc:
            problem = f".metadata: {exc}"
    if problem is not None:
        return False, problem, []
    if short:
        reason += f"; .metadata requires missing or short shard(s): {names([str(x) for x in short])}"
    return True, reason, short


def dcp_checker(relpath: str, name: str, base: str) -> Checker | None:
    """The structural check of a DCP ``.metadata`` (any format that holds DCP directories)."""
    if name != _DCP_META:
        return None
    return manifest_checker(relpath, lambda c, data: c.need(_dcp_manifest(data, base)))


def _dcp_manifest(data: bytes, base: str) -> list[Need]:
    try:
        return dcp_needs(data, base)
    except StructureError as exc:
        raise StructureError(f"DCP .metadata: {exc}") from None


def dcp_shortfalls(data: bytes, present: dict[str, int]) -> list[Shortfall]:
    """The shards ``.metadata`` bytes ``data`` reference that ``present`` lacks."""
    return shortfalls(dcp_needs(data), present)


# -- ranks ----------------------------------------------------------------------

_SHARD_NAME = re.compile(r"^__(\d+)_(\d+)\.distcp$")


def saved_dcp_ranks(names_: Iterable[str]) -> int:
    """How many ranks wrote these ``.distcp`` files: the distinct R of DCP's
    ``__{R}_{K}.distcp`` names (the count of shards when named otherwise; at least 1)."""
    shards = [n for n in names_ if n.endswith(".distcp")]
    ranks = {m.group(1) for n in shards if (m := _SHARD_NAME.match(n))}
    return max(len(ranks) if ranks else len(shards), 1)


def loaded_key(key: str, model_prefixed: bool) -> bool:
    """Whether a drill loads the DCP entry ``key``: ``model.*`` and
    ``optimizer.state.*``, or, in a model-only state dict (no ``model.``
    keys: ``model_prefixed`` False), everything but ``optimizer.*``."""
    if key.startswith("optimizer."):
        return key.startswith("optimizer.state.")
    return key.startswith("model.") or not model_prefixed


@dataclass(frozen=True)
class DcpLayout:
    """What ``.metadata`` says about where each tensor lies; pure data.

    ``tensors``: key -> (global size, chunks as ``(offsets, sizes)``);
    ``items``: ``(key, chunk offsets)`` -> ``(relpath, offset, length)`` in
    the shard files; ``byte_keys``: the non-tensor entries (never loaded).
    """

    tensors: Mapping[str, tuple[tuple[int, ...], tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]]]
    items: Mapping[tuple[str, tuple[int, ...]], tuple[str, int, int]]
    byte_keys: frozenset[str]

    @property
    def model_prefixed(self) -> bool:
        return any(k.startswith("model.") for k in self.tensors)

    def loaded(self) -> list[str]:
        """The tensor keys a drill loads (:func:`loaded_key`), in order."""
        prefixed = self.model_prefixed
        return [k for k in self.tensors if loaded_key(k, prefixed)]

    @property
    def sharded(self) -> bool:
        """Some loaded tensor was saved in more than one chunk."""
        return any(len(self.tensors[k][1]) > 1 for k in self.loaded())


def _size(value: Any) -> tuple[int, ...]:
    """A ``torch.Size`` as the inert unpickler leaves it (or a plain sequence)."""
    if isinstance(value, _Inert):
        value = value.args[0] if getattr(value, "args", None) else ()
    if not isinstance(value, (tuple, list)) or not all(_count(v) for v in value):
        raise StructureError(f"size {value!r} is not a sequence of counts")
    return tuple(int(v) for v in value)


def dcp_layout(data: bytes) -> DcpLayout:
    """Read ``.metadata`` bytes inertly (nothing in them runs, torch is not
    imported) into a :class:`DcpLayout`. Raises :class:`StructureError` when
    ``data`` is not DCP metadata or an entry is malformed."""
    try:
        root = _InertUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - any malformed pickle: named in one line
        raise StructureError(f"not a readable pickle ({type(exc).__name__}: {str(exc)[:120]})") from None
    if not isinstance(root, _Inert) or root.qualname != _DCP_ROOT:
        raise StructureError(f"holds {root.qualname if isinstance(root, _Inert) else type(root).__name__}, not {_DCP_ROOT}")
    entries = root.fields.get("state_dict_metadata") or {}
    storage = root.fields.get("storage_data") or {}
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise StructureError("state_dict_metadata or storage_data is not a dict")
    tensors: dict[str, tuple[tuple[int, ...], tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]]] = {}
    byte_keys = set()
    for key, entry in entries.items():
        if not isinstance(key, str) or not isinstance(entry, _Inert):
            raise StructureError(f"state_dict_metadata entry {key!r} is malformed")
        if not entry.qualname.endswith("TensorStorageMetadata"):
            byte_keys.add(key)
            continue
        chunks = entry.fields.get("chunks") or []
        try:
            tensors[key] = (_size(entry.fields.get("size")), tuple(
                (_size(c.fields.get("offsets")), _size(c.fields.get("sizes"))) for c in chunks))
        except (StructureError, AttributeError) as exc:
            raise StructureError(f"{key}: {exc}") from None
    items: dict[tuple[str, tuple[int, ...]], tuple[str, int, int]] = {}
    for index, info in storage.items():
        fields = index.fields if isinstance(index, _Inert) else {}
        st = info.fields if isinstance(info, _Inert) else {}
        fqn, offset = fields.get("fqn"), fields.get("offset")
        path, start, length = st.get("relative_path"), st.get("offset"), st.get("length")
        if not isinstance(fqn, str) or not isinstance(path, str) or key_problem(path) is not None:
            raise StructureError(f"storage entry {fqn!r} -> {path!r} is malformed")
        if not (_count(start) and _count(length)):
            raise StructureError(f"{path}: offset {start!r} / length {length!r} are not byte counts")
        assert start is not None and length is not None  # _count refused None
        items[(fqn, _size(offset) if offset is not None else ())] = (path, int(start), int(length))
    return DcpLayout(tensors, items, frozenset(byte_keys))


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of the dim-0 rows rank ``rank`` of ``world`` holds
    when ``rows`` rows are sharded as FSDP2 (``Shard(0)``) shards them:
    chunks of ``ceil(rows / world)``, the last ones short or empty; pure."""
    chunk = math.ceil(rows / world) if rows else 0
    start = min(rows, chunk * rank)
    return start, min(rows, start + chunk)


def _overlaps(a: tuple[tuple[int, ...], tuple[int, ...]], b: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
    (ao, asz), (bo, bsz) = a, b
    if any(n == 0 for n in (*asz, *bsz)) and (asz or bsz):
        return False
    return all(max(x, y) < min(x + n, y + m) for x, n, y, m in zip(ao, asz, bo, bsz, strict=True))


def dcp_rank_files(layout: DcpLayout, world: int, *, shared: Sequence[str] = (), saved_world: int = 1) -> RankFiles:
    """What each of ``world`` drill ranks reads of a DCP checkpoint; pure.

    In a sharded checkpoint (:attr:`DcpLayout.sharded`) a tensor saved in
    several chunks is restored sharded along dim 0 over the drill's ranks
    (:func:`shard_rows`, as FSDP2 shards it), and each rank reads the saved
    chunks that overlap its rows; every other tensor is read whole by every
    rank. In a replicated one (every tensor saved whole), every rank reads
    every loaded tensor. Only the entries a drill loads count
    (:func:`loaded_key`). A chunk lies in a file at a byte range; the ranges
    of one file are merged.
    """
    if world < 1:
        raise ValueError(f"world size {world} must be at least 1")
    sharded = layout.sharded
    needs: list[dict[str, tuple[Range, ...] | None]] = []
    for rank in range(world):
        ranges: dict[str, list[Range]] = {}
        for key in layout.loaded():
            size, chunks = layout.tensors[key]
            if sharded and len(chunks) > 1 and size:
                start, stop = shard_rows(size[0], world, rank)
                mine = ((start, *(0 for _ in size[1:])), (stop - start, *size[1:]))
                wanted = [c for c in chunks if _overlaps(c, mine)]
            else:
                wanted = [c for c in chunks if not any(n == 0 for n in c[1]) or not c[1]]
            for offsets, _ in wanted:
                item = layout.items.get((key, offsets))
                if item is None:
                    raise ValueError(f"{key}: chunk at {list(offsets)} has no storage entry in .metadata; the checkpoint is malformed")
                path, start_byte, length = item
                ranges.setdefault(path, []).append((start_byte, length))
        needs.append({path: _merge(spans) for path, spans in sorted(ranges.items())})
    return RankFiles(saved_world, SHARDED if sharded else REPLICATED, tuple(shared), tuple(needs))


def _merge(spans: list[Range]) -> tuple[Range, ...]:
    out: list[list[int]] = []
    for start, length in sorted(spans):
        if out and start <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], start + length - out[-1][0])
        else:
            out.append([start, length])
    return tuple((a, b) for a, b in out)


# -- reading .metadata without running it ----------------------------------------


class _Inert:
    """Stand-in for every global a pickle names: records what it is given, does nothing.

    Each one made counts against its unpickler's budget (``_budget``), so a
    small pickle that builds millions of them (a pickle bomb: a few bytes of
    opcodes per object) fails instead of filling memory."""

    __slots__ = ("_fields", "args")
    qualname = "?"
    _budget: list[int] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        budget = self._budget
        if budget is not None:
            budget[0] -= 1
            if budget[0] < 0:
                raise pickle.UnpicklingError("builds more objects than its size allows (a pickle bomb?)")
        self.args = args

    @property
    def fields(self) -> dict[str, Any]:
        """The state the pickle gave this object (``{}`` when none)."""
        try:
            return self._fields
        except AttributeError:
            self._fields: dict[str, Any] = {}
            return self._fields

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
            for part in state:
                if isinstance(part, dict):
                    self.fields.update(part)
        elif isinstance(state, dict):
            self.fields.update(state)

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass


#: Objects an inert unpickling may build per byte of pickle (real DCP metadata
#: spends some 20 bytes per object), and globals it may name at most.
_OBJECTS_PER_BYTE = 1 / 8
_MAX_GLOBALS = 4096


class _InertUnpickler(pickle.Unpickler):
    """Every global becomes an :class:`_Inert` subclass (one per name): no module
    is imported and no real callable is reached, so nothing in the pickle runs.
    What it builds is bounded by the pickle's size (:data:`_OBJECTS_PER_BYTE`):
    memory stays in proportion to the file whatever it holds."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self._budget = [int(len(file.getbuffer()) * _OBJECTS_PER_BYTE) + 65536]
        self._types: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> type:
        made = self._types.get((module, name))
        if made is None:
            if len(self._types) >= _MAX_GLOBALS:
                raise pickle.UnpicklingError(f"names more than {_MAX_GLOBALS} globals (not DCP metadata)")
            made = self._types[(module, name)] = type("Inert", (_Inert,), {
                "__slots__": (), "qualname": f"{module}.{name}", "_budget": self._budget})
        return made

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not part of DCP metadata")


_DCP_ROOT = "torch.distributed.checkpoint.metadata.Metadata"


def dcp_needs(data: bytes, base: str = "") -> list[Need]:
    """The ``.distcp`` files a DCP ``.metadata`` references, each needing at
    least the largest ``offset + length`` it references (relative to
    ``base``, the ``.metadata``'s directory), sorted.

    Read by a restricted unpickler that constructs nothing executable (every
    global is an inert placeholder). Raises :class:`StructureError` when
    ``data`` is not DCP metadata (truncated, not a pickle, another object).
    """
    try:
        root = _InertUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - any malformed pickle: named in one line
        raise StructureError(f"not a readable pickle ({type(exc).__name__}: {str(exc)[:120]})") from None
    if not isinstance(root, _Inert) or root.qualname != _DCP_ROOT:
        what = root.qualname if isinstance(root, _Inert) else type(root).__name__
        raise StructureError(f"holds {what}, not {_DCP_ROOT}")
    storage = root.fields.get("storage_data")
    if storage is None:
        return []
    if not isinstance(storage, dict):
        raise StructureError(f"storage_data is a {type(storage).__name__}, not a dict")
    sizes: dict[str, int] = {}
    for info in storage.values():
        st = info.fields if isinstance(info, _Inert) else {}
        path, offset, length = st.get("relative_path"), st.get("offset"), st.get("length")
        if not isinstance(path, str) or key_problem(path) is not None:
            raise StructureError(f"storage entry with unusable relative_path {path!r}")
        if not (isinstance(offset, int) and isinstance(length, int) and _count(offset) and _count(length)):
            raise StructureError(f"{path}: offset {offset!r} / length {length!r} are not byte counts")
        sizes[path] = max(sizes.get(path, 0), offset + length)
    return [Need(base + p, _DCP_META, n) for p, n in sorted(sizes.items())]



# -- loading (torch, lazily) ----------------------------------------------------


_DCP_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    # the save plans megatron-core's torch_dist writer keeps in the metadata (``all_local_plans``): plain records
    ("torch.distributed.checkpoint.planner", n) for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _DcpMetadataUnpickler(pickle.Unpickler):
    """Admits DCP's own metadata classes and torch dtypes only."""

    def find_class(self, module: str, name: str) -> Any:
        import torch  # lazy: torch, for drills only

        if (module, name) in _DCP_METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(
            f"DCP .metadata refers to the global {module}.{name}, which is not DCP metadata; "
            "refusing to unpickle it (the checkpoint is malformed or hostile)",
            global_name=f"{module}.{name}",
        )


def read_dcp_metadata(path: str | Path) -> Any:
    """The ``Metadata`` of a DCP directory, unpickled with DCP classes only.

    Also checks that every shard path it names stays inside the directory.
    """
    from torch.distributed.checkpoint.metadata import Metadata  # lazy: torch, for drills only

    meta_path = Path(path) / ".metadata"
    if not meta_path.is_file():
        raise CheckpointLoadError(f"{path}: no .metadata file, so this DCP checkpoint is incomplete; pick a committed checkpoint")
    with meta_path.open("rb") as fh:
        try:
            metadata = _DcpMetadataUnpickler(fh).load()
        except UnsafeCheckpoint as exc:
            raise UnsafeCheckpoint(f"{meta_path}: {exc}", global_name=exc.global_name) from None
        except Exception as exc:
            raise CheckpointLoadError(f"{meta_path}: unreadable DCP metadata ({exc}); re-fetch or re-verify the checkpoint") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointLoadError(f"{meta_path}: holds a {type(metadata).__name__}, not DCP Metadata; the checkpoint is malformed")
    for info in (metadata.storage_data or {}).values():
        rel = Path(str(getattr(info, "relative_path", "")))
        if rel.is_absolute() or ".." in rel.parts:
            raise UnsafeCheckpoint(f"{meta_path}: shard path {str(rel)!r} points outside the checkpoint directory; refusing it")
    return metadata


def safe_dcp_reader(path: str | Path, available: Mapping[str, Sequence[Range] | None] | None = None) -> Any:
    """A ``torch.distributed.checkpoint`` reader of the DCP directory at
    ``path`` whose ``.metadata`` is unpickled with DCP's classes only
    (:func:`read_dcp_metadata`).

    ``available`` (relpath -> None for a whole file, or the byte ranges
    fetched of it; None: every file is whole) says what a drill rank's copy
    holds: the other bytes of a partly fetched file are holes that read as
    zeros, so a read outside them raises :class:`CheckpointLoadError`
    instead of restoring zeros. Tensor entries are read by DCP with
    ``weights_only=True``; a caller never asks for the non-tensor ones.
    """
    return _reader_class()(str(path), read_dcp_metadata(path), available)


_READER: list[type] = []


def _reader_class() -> type:
    if _READER:
        return _READER[0]
    from torch.distributed.checkpoint import FileSystemReader  # lazy: torch, for drills only

    class SafeDcpReader(FileSystemReader):
        def __init__(self, path: str, metadata: Any, available: Mapping[str, Sequence[Range] | None] | None) -> None:
            super().__init__(path)
            self._metadata = metadata
            self._available = available

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:
                raise CheckpointLoadError(f"{self.path}: per-rank DCP metadata is not supported; save with a single .metadata")
            return self._metadata

        def read_data(self, plan: Any, planner: Any) -> Any:
            if self._available is not None:
                for item in plan.items:
                    info = self.storage_data[item.storage_index]
                    path, start, length = str(info.relative_path), int(info.offset), int(info.length)
                    have = self._available.get(path, ())
                    if have is not None and not any(a <= start and start + length <= a + n for a, n in have):
                        raise CheckpointLoadError(
                            f"{self.path}: {item.storage_index.fqn} is at bytes {start}..{start + length} of {path}, which "
                            "were not fetched for this drill rank; the drill's rank plan missed them (report this as a ckptier bug)")
            return super().read_data(plan, planner)

    _READER.append(SafeDcpReader)
    return SafeDcpReader


def load_dcp_tensors(
    path: str | Path, *, available: Mapping[str, Sequence[Range] | None] | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor entry a drill loads (:func:`loaded_key`) of a DCP
    directory, whole, by flattened key (``model.fc.weight``).

    Non-tensor entries (bytes: param groups, train state) are skipped: DCP
    unpickles them with ``weights_only=False``. Works without a process
    group, and reads in this process alone even when there is one (each
    drill rank of a replicated checkpoint loads its own whole copy).
    ``available``: see :func:`safe_dcp_reader`.
    """
    import torch  # lazy: torch, for drills only
    import torch.distributed.checkpoint as dcp  # lazy: torch, for drills only
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # lazy: torch, for drills only

    reader = safe_dcp_reader(path, available)
    metadata = reader.read_metadata()
    entries = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    prefixed = any(k.startswith("model.") for k in entries)
    template: dict[str, torch.Tensor] = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in entries.items() if loaded_key(key, prefixed)
    }
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(template, storage_reader=reader, no_dist=True)
    except CkptierError:
        raise
    except Exception as exc:
        raise CheckpointLoadError(f"{path}: DCP load failed: {dcp_failure(exc)}; re-fetch or re-verify the checkpoint") from None
    return template


def load_dcp(path: Path, available: Mapping[str, Sequence[Range] | None] | None = None) -> LoadedCheckpoint:
    """A whole DCP checkpoint for a drill (:func:`load_dcp_tensors`; ``available``
    as there): ``model.*`` (or a model-only state dict) as the model state,
    ``optimizer.state.*`` as the flattened optimizer state, ``metadata.json``
    beside the shards for the step and the recorded loss."""
    tensors = load_dcp_tensors(path, available=available)
    model = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    if not model:  # a model-only export: the state dict at the top level
        model = {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}
    optimizer = {k[len("optimizer."):]: v for k, v in tensors.items() if k.startswith("optimizer.state.")}
    extra, step, loss = checkpoint_notes(Path(path))
    return LoadedCheckpoint(model, optimizer or None, extra, "fqn-flat", step, float_or_none(loss))


def checkpoint_notes(path: Path) -> tuple[dict[str, Any], int | None, Any]:
    """``(metadata.json, step, recorded loss)`` of a checkpoint directory: the
    JSON beside the shards when there is one, the step from it or from the
    directory's name."""
    extra = read_json(path / "metadata.json") if (path / "metadata.json").is_file() else {}
    step = extra.get("step") if isinstance(extra.get("step"), int) and not isinstance(extra.get("step"), bool) else None
    if step is None:
        step = step_from_name(path)
    return extra, step, extra.get("loss", extra.get("train_loss"))


def dcp_failure(exc: BaseException) -> str:
    """The first line of the first cause of a failed ``dcp.load`` (which
    gathers every rank's exception into one ``CheckpointException``)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = sorted(failures.items())[0]
        inner = getattr(inner, "exc", inner)
        text = str(inner).strip().splitlines()[0] if str(inner).strip() else type(inner).__name__
        return f"rank {rank}: {text}"
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
