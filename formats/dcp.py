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
torchtitan's ``{"model": ..., "optimizer": ...}``. A factory is needed.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptier.formats.base import FormatPlugin, Group, Scan, as_loss, names, step_in_name
from ckptier.storage.base import ObjectInfo, key_problem
from ckptier.storage.errors import CkptierError
from ckptier.storage.model import Format, Shortfall
from ckptier.storage.structure import Checker, Need, StructureError, manifest_checker, shortfalls

if TYPE_CHECKING:
    import torch

    from ckptier.formats.safe_load import LoadedCheckpoint

__all__ = ["PLUGIN", "dcp_needs", "dcp_shortfalls", "load_dcp_tensors", "read_dcp_metadata"]

_DCP_META = ".metadata"
_GUIDE_META = "metadata.json"


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class DcpFormat(FormatPlugin):
    format = Format.DCP
    metadata_names = frozenset({_DCP_META, _GUIDE_META})
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

    def load(self, path: Path, allow: Sequence[Any]) -> LoadedCheckpoint:
        from ckptier.formats.safe_load import LoadedCheckpoint, float_or_none, read_json, step_from_name

        tensors = load_dcp_tensors(path)
        model = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
        if not model:  # a model-only export: the state dict at the top level
            model = {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}
        optimizer = {k[len("optimizer."):]: v for k, v in tensors.items() if k.startswith("optimizer.state.")}
        extra = read_json(path / "metadata.json") if (path / "metadata.json").is_file() else {}
        step = extra.get("step") if isinstance(extra.get("step"), int) else step_from_name(path)
        return LoadedCheckpoint(model, optimizer or None, extra, "fqn-flat", step, float_or_none(extra.get("loss")))


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


# -- reading .metadata without running it ----------------------------------------


class _Inert:
    """Stand-in for every global a pickle names: records what it is given, does nothing."""

    qualname = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    @property
    def fields(self) -> dict[str, Any]:
        """The state the pickle gave this object (``{}`` when none)."""
        return self.__dict__.setdefault("_fields", {})

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


class _InertUnpickler(pickle.Unpickler):
    """Every global becomes a fresh :class:`_Inert` subclass: no module is
    imported and no real callable is reached, so nothing in the pickle runs."""

    def find_class(self, module: str, name: str) -> type:
        return type("Inert", (_Inert,), {"qualname": f"{module}.{name}"})

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
        import torch

        from ckptier.formats.safe_load import UnsafeCheckpoint

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
    from torch.distributed.checkpoint.metadata import Metadata

    from ckptier.formats.safe_load import CheckpointLoadError, UnsafeCheckpoint

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


def load_dcp_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor entry of a DCP directory, by flattened key (``model.fc.weight``).

    Non-tensor entries (bytes: param groups, train state) are skipped: DCP
    unpickles them with ``weights_only=False``. Works without a process group.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ckptier.formats.safe_load import CheckpointLoadError

    metadata = read_dcp_metadata(path)

    class _SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:
                raise CheckpointLoadError(f"{path}: per-rank DCP metadata is not supported; save with a single .metadata")
            return metadata

    template: dict[str, torch.Tensor] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            template[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(template, storage_reader=_SafeReader(str(path)))
    except CkptierError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointLoadError(f"{path}: DCP load failed: {first}; re-fetch or re-verify the checkpoint") from None
    return template
