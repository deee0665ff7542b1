"""Load checkpoint files without running code hidden in them.

A checkpoint is untrusted input (DESIGN.md, principle 5). Everything here goes
through one of three safe paths and never falls back to full unpickling:

* ``torch.load(weights_only=True)`` with an explicit, documented allowlist
  (:data:`DEFAULT_ALLOWLIST`) plus whatever the user allowlisted by name;
* ``safetensors`` (no code at all);
* PyTorch Distributed Checkpoint (DCP) directories, read through a reader whose
  ``.metadata`` unpickler admits only DCP's own metadata classes (torch's
  ``FileSystemReader`` calls plain ``pickle.load`` on it), and loading only
  tensor entries (DCP unpickles non-tensor entries with ``weights_only=False``).

``.pt2`` (torch.export) archives are refused outright: loading one can run
code and there is no safe mode for them (CVE-2026-4538).

Requires torch >= 2.10 (CVE-2025-32434 and CVE-2026-24747 bypass the
``weights_only`` unpickler in older releases).
"""

from __future__ import annotations

import importlib
import json
import pickle
import re
import warnings
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptier.storage.errors import CkptierError, ConfigError
from ckptier.storage.model import Format
from ckptier.tasks.config import allow_global_problem

MIN_TORCH = (2, 10)


def _torch_release(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        return (0, 0)
    return (int(match.group(1)), int(match.group(2)))


if _torch_release(torch.__version__) < MIN_TORCH:  # pragma: no cover - depends on install
    raise ImportError(
        f"ckptier drills need torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} (safe weights-only loading), "
        f"found torch {torch.__version__}; upgrade with: pip install 'torch>=2.10'"
    )


class UnsafeCheckpoint(CkptierError):
    """A checkpoint needs something the safe loader will not do.

    ``global_name`` is the ``module.Name`` the unpickler refused, when known.
    """

    def __init__(self, message: str, *, global_name: str | None = None) -> None:
        super().__init__(message)
        self.global_name = global_name


class CheckpointLoadError(CkptierError):
    """A checkpoint's files are missing, malformed or in a layout not supported."""


def _numpy_dtype_classes() -> list[type]:
    # Plain numeric and bool dtypes only: object/str/void dtypes can carry
    # arbitrary Python objects or are never needed by real checkpoints.
    kinds = [
        np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
        np.uint32, np.uint64, np.float16, np.float32, np.float64, np.complex64,
        np.complex128,
    ]
    return [type(np.dtype(k)) for k in kinds]


def _default_allowlist() -> list[Any]:
    reconstruct = np._core.multiarray._reconstruct  # type: ignore[attr-defined]  # numpy >= 2
    scalar = np._core.multiarray.scalar  # type: ignore[attr-defined]
    return [
        # numpy arrays: Hugging Face Trainer's rng_state*.pth holds
        # np.random.get_state() (a uint32 ndarray); arrays also appear in
        # Lightning callback states. ndarray pickles as _reconstruct(ndarray,
        # shape, dtype) + BUILD with raw bytes (no code).
        (reconstruct, "numpy._core.multiarray._reconstruct"),
        # The same function as files written under numpy 1.x name it.
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
        # numpy scalars (np.float64 metrics in Lightning callback states):
        # scalar(dtype, raw bytes).
        (scalar, "numpy._core.multiarray.scalar"),
        (scalar, "numpy.core.multiarray.scalar"),
        # BUILD on a dtype checks the dtype's class (numpy.dtypes.UInt32DType
        # for the RNG state): numeric and bool dtype classes only.
        *_numpy_dtype_classes(),
        # pathlib paths in Lightning hyper_parameters / callback state
        # (dirpath): constructed from strings, no side effects.
        __import__("pathlib").PosixPath,
        __import__("pathlib").PurePosixPath,
    ]
    # Not needed: codecs.encode (bytes under pickle protocol 2) and
    # collections.OrderedDict are handled by torch's weights-only unpickler.


DEFAULT_ALLOWLIST: list[Any] = _default_allowlist()
"""Globals every drill may unpickle, each documented above. Extend per
checkpoint with ``extra_allowlist`` (``--allow-global module.Name``)."""


def resolve_global(name: str) -> type:
    """Import ``module.Name`` (a user's ``--allow-global``) and return the class.

    Raises :class:`ConfigError` naming the value when it is malformed, in a
    module that can run commands or touch files
    (:func:`~ckptier.tasks.config.allow_global_problem`), cannot be
    imported, or is not a class (a function a pickle calls is code it runs).
    """
    problem = allow_global_problem(name)
    if problem is not None:
        raise ConfigError(f"allow-global {name!r}: {problem}")
    module_name, _, attr = name.rpartition(".")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"allow-global {name!r}: cannot import module {module_name!r} ({exc}); install it or fix the name") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"allow-global {name!r}: module {module_name!r} has no attribute {part!r}; fix the name")
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise ConfigError(
            f"allow-global {name!r} is a {type(obj).__name__}, not a class; only classes can be allowlisted "
            "(a function named by a pickle is called while loading); allowlist the class the checkpoint stores"
        )
    return obj


def _allowlist(extra: Iterable[Any]) -> list[Any]:
    items = list(DEFAULT_ALLOWLIST)
    for item in extra:
        items.append((resolve_global(item), item) if isinstance(item, str) else item)
    return items


_GLOBAL_PATTERNS = (
    re.compile(r"GLOBAL ([\w.]+) was not an allowed global"),
    re.compile(r"Unsupported global: GLOBAL ([\w.]+)"),
    re.compile(r"unrecognized function ([\w.]+)"),
    re.compile(r"Unsupported class ([\w.]+)"),
    re.compile(r"unsupported GLOBAL ([\w.]+)", re.IGNORECASE),
)


def refused_global(message: str) -> str | None:
    """The ``module.Name`` torch's weights-only unpickler refused, parsed from
    its error message; None when the message names none."""
    for pattern in _GLOBAL_PATTERNS:
        match = pattern.search(message)
        if match:
            return match.group(1)
    return None


def _unpickler_reason(message: str) -> str:
    for line in message.splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].strip()
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    specific = [ln for ln in lines[1:] if not ln.startswith("Check the documentation")]
    return (specific or lines or ["unknown reason"])[0]


def _refuse_pt2(path: Path) -> None:
    if path.suffix == ".pt2":
        raise UnsafeCheckpoint(
            f"{path}: refused: .pt2 (torch.export) archives can run code when loaded and have no safe mode; "
            "save weights with torch.save(model.state_dict()) or safetensors instead"
        )
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
        if any(n.endswith("/archive_format") or "serialized_exported_program" in n for n in names):
            raise UnsafeCheckpoint(
                f"{path}: refused: the file is a torch.export (.pt2) archive under another name; "
                "save weights with torch.save(model.state_dict()) or safetensors instead"
            )


def safe_torch_load(
    path: str | Path,
    *,
    map_location: str | torch.device = "cpu",
    extra_allowlist: Sequence[Any] = (),
    mmap: bool = True,
) -> Any:
    """``torch.load(path, weights_only=True)`` with :data:`DEFAULT_ALLOWLIST`.

    ``extra_allowlist`` adds globals: ``"module.Name"`` strings (imported
    here) or the objects themselves. With ``mmap`` the tensors map the file
    copy-on-write (the file is never modified); legacy non-zip files are read
    normally. Never retries with ``weights_only=False``.

    Raises :class:`UnsafeCheckpoint` (one line naming the refused global and
    how to allow it) when the unpickler refuses something, including any
    ``.pt2`` archive; :class:`CheckpointLoadError` when the file is missing.
    """
    p = Path(path)
    if not p.is_file():
        raise CheckpointLoadError(f"{p}: checkpoint file not found; fetch the checkpoint first or fix the path")
    _refuse_pt2(p)
    allow = _allowlist(extra_allowlist)
    use_mmap = mmap and zipfile.is_zipfile(p)
    try:
        with torch.serialization.safe_globals(allow):
            return torch.load(p, map_location=map_location, weights_only=True, mmap=use_mmap)
    except pickle.UnpicklingError as exc:
        message = str(exc)
        name = refused_global(message)
        if name is not None and "blocked" in message:
            raise UnsafeCheckpoint(
                f"{p}: refused to load: it calls {name}, which torch never allows (its module is blocked); "
                "the file is hostile or broken: do not load it, restore another checkpoint",
                global_name=name,
            ) from None
        if name is not None and allow_global_problem(name if "." in name else f"builtins.{name}") is not None:
            raise UnsafeCheckpoint(
                f"{p}: refused to load: it calls {name}, which can run code or touch files and is never allowlisted; "
                "the file is hostile or broken: do not load it, restore another checkpoint",
                global_name=name,
            ) from None
        if name is not None:
            raise UnsafeCheckpoint(
                f"{p}: refused to load: it needs the global {name}, which is not allowlisted; "
                f"if you trust this file, allow it with --allow-global {name} (or allow_globals in the drill config)",
                global_name=name,
            ) from None
        raise UnsafeCheckpoint(
            f"{p}: refused to load: {_unpickler_reason(message)}; the file is not a plain weights checkpoint"
        ) from None


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of a ``.safetensors`` file, on CPU."""
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_file():
        raise CheckpointLoadError(f"{p}: safetensors file not found; fetch the checkpoint first or fix the path")
    try:
        return load_file(str(p), device="cpu")
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise CheckpointLoadError(f"{p}: not a readable safetensors file ({exc}); re-fetch or re-verify it") from None


# --- Distributed Checkpoint -------------------------------------------------

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
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

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


# --- Whole checkpoints --------------------------------------------------------


@dataclass
class LoadedCheckpoint:
    """What a drill restores from one checkpoint, on CPU.

    ``model_state`` maps parameter/buffer names to tensors. ``optimizer_state``
    is ``None`` when the checkpoint has none; its layout is
    ``optimizer_layout``: ``"torch"`` (``Optimizer.state_dict()``, integer
    param ids) or ``"fqn-flat"`` (DCP/torchtitan: flattened keys
    ``state.<param fqn>.<name>``, tensors only). ``extra`` is the parsed
    metadata of the format (metadata.json, trainer_state.json, Lightning's
    top-level scalars and hyper_parameters); ``step`` and ``recorded_loss`` are
    taken from it when present. ``also_loaded`` lists side files that were
    safely loaded to prove they restore (scheduler, RNG states).
    """

    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any] | None
    extra: dict[str, Any] = field(default_factory=dict)
    optimizer_layout: str = "torch"
    step: int | None = None
    recorded_loss: float | None = None
    also_loaded: list[str] = field(default_factory=list)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointLoadError(f"{path}: unreadable JSON ({exc}); re-fetch or re-verify the checkpoint") from None
    if not isinstance(data, dict):
        raise CheckpointLoadError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _is_tensor_dict(obj: Any) -> bool:
    return isinstance(obj, Mapping) and bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def _unwrap_state(obj: Any, path: Path, keys: Sequence[str]) -> dict[str, torch.Tensor]:
    if _is_tensor_dict(obj):
        return dict(obj)
    if isinstance(obj, Mapping):
        for key in keys:
            if _is_tensor_dict(obj.get(key)):
                return dict(obj[key])
    raise CheckpointLoadError(
        f"{path}: not a model state dict (expected a mapping of names to tensors, or one under {'/'.join(keys)}); "
        "save model.state_dict()"
    )


def _step_from_name(path: Path) -> int | None:
    match = re.search(r"(?:step|checkpoint)[-=_]?(\d+)", path.name)
    return int(match.group(1)) if match else None


def _float_or_none(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _load_guide(path: Path, allow: Sequence[Any]) -> LoadedCheckpoint:
    ranks = sorted(p for p in path.glob("rank-*") if p.is_dir())
    if not ranks:
        raise CheckpointLoadError(f"{path}: no rank-NNNN directory; expected {{job}}/step-NNNNNNNN/rank-0000/model.pt")
    if len(ranks) > 1:
        raise CheckpointLoadError(
            f"{path}: not supported yet: {len(ranks)} ranks ({ranks[0].name}..{ranks[-1].name}); "
            "drills restore single-rank guide checkpoints; use a DCP checkpoint for sharded models"
        )
    rank = ranks[0]
    model = _unwrap_state(safe_torch_load(rank / "model.pt", extra_allowlist=allow), rank / "model.pt", ("model", "state_dict", "model_state_dict"))
    optimizer = None
    if (rank / "optimizer.pt").is_file():
        optimizer = safe_torch_load(rank / "optimizer.pt", extra_allowlist=allow)
        if isinstance(optimizer, Mapping) and "state" not in optimizer and isinstance(optimizer.get("optimizer"), Mapping):
            optimizer = optimizer["optimizer"]
    extra = _read_json(path / "metadata.json") if (path / "metadata.json").is_file() else {}
    step = extra.get("step") if isinstance(extra.get("step"), int) else _step_from_name(path)
    return LoadedCheckpoint(model, optimizer, extra, "torch", step, _float_or_none(extra.get("loss")))


def _hf_recorded_loss(state: Mapping[str, Any]) -> float | None:
    history = state.get("log_history") or []
    step = state.get("global_step")
    losses = [
        h for h in history
        if isinstance(h, Mapping) and "loss" in h and (step is None or not isinstance(h.get("step"), int) or h["step"] <= step)
    ]
    return _float_or_none(losses[-1]["loss"]) if losses else None


def _load_hf(path: Path, allow: Sequence[Any]) -> LoadedCheckpoint:
    model: dict[str, torch.Tensor] = {}
    if (path / "model.safetensors").is_file():
        model = load_safetensors(path / "model.safetensors")
    elif (path / "model.safetensors.index.json").is_file():
        index = _read_json(path / "model.safetensors.index.json")
        for shard in sorted(set((index.get("weight_map") or {}).values())):
            if Path(shard).name != shard:
                raise UnsafeCheckpoint(f"{path}: shard name {shard!r} in model.safetensors.index.json is not a plain file name")
            model.update(load_safetensors(path / shard))
    elif (path / "pytorch_model.bin").is_file():
        model = _unwrap_state(safe_torch_load(path / "pytorch_model.bin", extra_allowlist=allow), path / "pytorch_model.bin", ("state_dict",))
    else:
        raise CheckpointLoadError(f"{path}: no model.safetensors or pytorch_model.bin; the Hugging Face checkpoint has no weights")
    optimizer = safe_torch_load(path / "optimizer.pt", extra_allowlist=allow) if (path / "optimizer.pt").is_file() else None
    state = _read_json(path / "trainer_state.json") if (path / "trainer_state.json").is_file() else {}
    also: list[str] = []
    for side in sorted([*path.glob("rng_state*.pth"), path / "scheduler.pt"]):
        if side.is_file():
            safe_torch_load(side, extra_allowlist=allow)
            also.append(side.name)
    extra = dict(state)
    if (path / "config.json").is_file():
        extra["hf_config_dir"] = str(path)
    step = state.get("global_step") if isinstance(state.get("global_step"), int) else _step_from_name(path)
    return LoadedCheckpoint(model, optimizer, extra, "torch", step, _hf_recorded_loss(state), also)


def _load_lightning(path: Path, allow: Sequence[Any]) -> LoadedCheckpoint:
    if path.is_dir():
        files = sorted(path.glob("*.ckpt"))
        if len(files) != 1:
            raise CheckpointLoadError(f"{path}: expected one .ckpt file, found {len(files)}; pass the .ckpt file itself")
        path = files[0]
    obj = safe_torch_load(path, extra_allowlist=allow)
    if not isinstance(obj, Mapping) or not isinstance(obj.get("state_dict"), Mapping):
        raise CheckpointLoadError(f"{path}: no 'state_dict' entry; not a Lightning checkpoint")
    states = obj.get("optimizer_states") or []
    if len(states) > 1:
        raise CheckpointLoadError(f"{path}: not supported yet: {len(states)} optimizers; drills restore one optimizer")
    extra = {k: v for k, v in obj.items() if isinstance(v, (int, float, str, bool)) or k == "hyper_parameters"}
    step = obj.get("global_step") if isinstance(obj.get("global_step"), int) else _step_from_name(path)
    return LoadedCheckpoint(dict(obj["state_dict"]), states[0] if states else None, extra, "torch", step, None)


def _load_dcp(path: Path) -> LoadedCheckpoint:
    tensors = load_dcp_tensors(path)
    model = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    if not model:  # a model-only export: the state dict at the top level
        model = {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}
    optimizer = {k[len("optimizer."):]: v for k, v in tensors.items() if k.startswith("optimizer.state.")}
    extra = _read_json(path / "metadata.json") if (path / "metadata.json").is_file() else {}
    step = extra.get("step") if isinstance(extra.get("step"), int) else _step_from_name(path)
    return LoadedCheckpoint(model, optimizer or None, extra, "fqn-flat", step, _float_or_none(extra.get("loss")))


def load_checkpoint_dir(path: str | Path, fmt: Format | str, *, extra_allowlist: Sequence[Any] = ()) -> LoadedCheckpoint:
    """Load a whole checkpoint (a step directory, or a Lightning ``.ckpt``) safely, on CPU.

    Layouts: guide (``rank-0000/model.pt`` + optional ``optimizer.pt`` +
    ``metadata.json``; several ranks are refused for now), DCP (torchtitan's
    ``{"model": ..., "optimizer": ...}`` or a model-only state dict), Hugging
    Face Trainer (``model.safetensors`` / sharded / ``pytorch_model.bin`` +
    ``optimizer.pt`` + ``trainer_state.json``; ``scheduler.pt`` and
    ``rng_state*.pth`` are loaded too, to prove they restore), Lightning (one
    ``.ckpt`` with ``state_dict`` and at most one of ``optimizer_states``).
    Reads only; never writes.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointLoadError(f"{p}: checkpoint not found; fetch it first or fix the path")
    try:
        kind = Format(fmt)
    except ValueError:
        raise ConfigError(f"checkpoint format {fmt!r} is unknown; use one of {', '.join(f.value for f in Format)}") from None
    if kind is Format.GUIDE:
        return _load_guide(p, extra_allowlist)
    if kind is Format.DCP:
        return _load_dcp(p)
    if kind is Format.HF:
        return _load_hf(p, extra_allowlist)
    if kind is Format.LIGHTNING:
        return _load_lightning(p, extra_allowlist)
    raise CheckpointLoadError(f"{p}: format {kind.value!r} has no known loader; drills support guide, dcp, hf-trainer and lightning")
