"""Load checkpoint files without running code hidden in them.

A checkpoint is untrusted input (docs/failure-scenarios.md, hostile pickles). Everything here goes
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

import copyreg
import pickle
import pickletools
import re
import threading
import zipfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch

from ckptier.formats.allowlist import allowed_class, check_if_loaded, is_library_global
from ckptier.formats.loaded import (  # noqa: F401 - the plug-ins' loaders import these from here too
    CheckpointLoadError,
    LoadedCheckpoint,
    UnsafeCheckpoint,
    UnsupportedCheckpoint,
    float_or_none,
    read_json,
    step_from_name,
)
from ckptier.formats.names import allow_global_problem, unsafe_global_reason
from ckptier.formats.registry import plugin
from ckptier.storage.errors import ConfigError
from ckptier.storage.records import Format

MIN_TORCH = (2, 10)

# The Python 2 names torch's unpickler maps before looking a global up.
TORCH_IMPORT_MAPPING: dict[str, str] = getattr(torch._utils, "IMPORT_MAPPING", {})
TORCH_NAME_MAPPING: dict[tuple[str, str], tuple[str, str]] = getattr(torch._utils, "NAME_MAPPING", {})


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
    module that can run commands or touch files, cannot be imported, or is
    not a plain data class (:func:`ckptier.formats.allowlist.allow_global_check`).
    """
    return allowed_class(name)


def _allowlist(extra: Iterable[Any]) -> list[Any]:
    items = list(DEFAULT_ALLOWLIST)
    for item in extra:
        items.append((resolve_global(item), item) if isinstance(item, str) else item)
    return items


def _allowed_names(allow: Sequence[Any]) -> set[str] | None:
    """Names torch's weights-only unpickler admits with ``allow``, or None when
    torch's own list cannot be read (then only torch decides)."""
    builtin = getattr(torch._weights_only_unpickler, "_get_allowed_globals", None)
    if builtin is None:  # pragma: no cover - depends on the torch release
        return None
    names = set(builtin())
    for item in allow:
        if isinstance(item, tuple):
            names.add(item[1])
        else:
            names.add(f"{item.__module__}.{item.__qualname__}")
    return names


def _torch_own(item: Any) -> bool:
    """Whether a process-wide safe global is one torch registered for its own types."""
    obj = item[0] if isinstance(item, tuple) else item
    module = getattr(obj, "__module__", None) or ""
    return module == "torch" or module.startswith("torch.")


#: Held while a load narrows torch's process-wide list of safe globals (one list per process).
_GLOBALS_LOCK = threading.Lock()


@contextmanager
def exactly_these_globals(allow: Sequence[Any]) -> Iterator[None]:
    """Torch's weights-only unpickler admits exactly ``allow`` (besides its built-in
    tensor types and what torch itself registers, such as nested tensors) while this
    runs: the globals any other library added process-wide
    (``torch.serialization.add_safe_globals``; megatron-core adds its configs and
    ``argparse.Namespace`` on import) are set aside and put back afterwards, so what a
    checkpoint may name does not depend on what the process imported. Loads in
    other threads wait (the list is the process's)."""
    with _GLOBALS_LOCK:
        before = torch.serialization.get_safe_globals()
        torch.serialization.clear_safe_globals()
        try:
            torch.serialization.add_safe_globals([*(g for g in before if _torch_own(g)), *allow])
            yield
        finally:
            torch.serialization.clear_safe_globals()
            torch.serialization.add_safe_globals(before)


# --- what a pickle names, without running it ------------------------------------

_TORCH_OPCODES = frozenset(
    {
        "GLOBAL", "NEWOBJ", "REDUCE", "BUILD", "APPEND", "APPENDS", "SETITEM", "SETITEMS", "MARK", "TUPLE", "TUPLE1",
        "TUPLE2", "TUPLE3", "NONE", "NEWFALSE", "NEWTRUE", "EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET",
        "BININT", "BININT1", "BININT2", "BINFLOAT", "BINUNICODE", "SHORT_BINSTRING", "BINPERSID", "BINGET",
        "LONG_BINGET", "BINPUT", "LONG_BINPUT", "LONG1", "PROTO", "STOP",
    }
)
"""Opcodes torch's weights-only unpickler executes; it refuses every other one."""

_STRING_OPS = frozenset({"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"})
_UNKNOWN = object()


@dataclass(frozen=True)
class PickleGlobal:
    """A global a pickle names: ``name`` as written (``module.Name``), the
    opcode that names it, and the opcode's byte offset."""

    name: str
    opcode: str
    position: int


@dataclass
class PickleScan:
    """What :func:`scan_pickle` found: every global in order, the opcodes
    torch's unpickler does not execute (``(opcode, byte, offset, global)``),
    and why scanning stopped early (``None`` when it read to STOP)."""

    globals: list[PickleGlobal] = field(default_factory=list)
    foreign_opcodes: list[tuple[str, int, int, PickleGlobal | None]] = field(default_factory=list)
    error: str | None = None


def scan_pickle(data: bytes | Any, scan: PickleScan | None = None) -> PickleScan:
    """Read pickle opcodes (never executing them) and collect the globals they
    name, including those named by STACK_GLOBAL (strings tracked through the
    stack and memo), INST, OBJ and EXT1/2/4 (resolved in ``copyreg``'s
    extension registry). ``data`` is bytes or a binary file positioned at the
    pickle; reading stops after its STOP. Never raises: a malformed pickle
    ends the scan with ``error`` set."""
    scan = scan if scan is not None else PickleScan()
    stack: list[Any] = []
    metastack: list[list[Any]] = []
    memo: dict[int, Any] = {}
    try:
        for op, arg, pos in pickletools.genops(data):
            position = pos if pos is not None else -1
            found: PickleGlobal | None = None
            name = op.name
            before = op.stack_before
            if pickletools.markobject in before:
                above = stack
                stack = metastack.pop()
                below = before.index(pickletools.markobject)
                if below:
                    del stack[-below:]
                if name == "OBJ" and above and isinstance(above[0], PickleGlobal):
                    found = PickleGlobal(above[0].name, name, position)
                if name == "INST":
                    found = PickleGlobal(".".join(str(arg).split(" ", 1)), name, position)
                    scan.globals.append(found)
                stack.extend([found if found is not None else _UNKNOWN] * len(op.stack_after))
            elif name == "MARK":
                metastack.append(stack)
                stack = []
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[int(arg or 0)] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo.get(int(arg or 0), _UNKNOWN))
            elif name == "DUP":
                stack.append(stack[-1])
            elif name == "GLOBAL":
                found = PickleGlobal(".".join(str(arg).split(" ", 1)), name, position)
                scan.globals.append(found)
                stack.append(found)
            elif name == "STACK_GLOBAL":
                attr, module = stack.pop(), stack.pop()
                shown = f"{module}.{attr}" if isinstance(module, str) and isinstance(attr, str) else "<a name computed by the pickle>"
                found = PickleGlobal(shown, name, position)
                scan.globals.append(found)
                stack.append(found)
            elif name in ("EXT1", "EXT2", "EXT4"):
                key = copyreg._inverted_registry.get(int(arg or 0))  # type: ignore[attr-defined]
                found = PickleGlobal(".".join(key) if key else f"<extension code {arg}, not registered>", name, position)
                scan.globals.append(found)
                stack.append(found)
            else:
                for _ in before:
                    stack.pop()
                value = arg if name in _STRING_OPS and isinstance(arg, str) else _UNKNOWN
                stack.extend([value] * len(op.stack_after))
            if name not in _TORCH_OPCODES:
                scan.foreign_opcodes.append((name, ord(op.code), position, found))
            if name == "STOP":
                break
    except (ValueError, IndexError, KeyError, EOFError, TypeError) as exc:
        scan.error = f"{type(exc).__name__}: {exc}"
    return scan


def _scan_file(path: Path) -> PickleScan:
    """The globals of a torch file: ``data.pkl`` of a zip checkpoint, or the
    leading pickles of a legacy (torch < 1.6) file."""
    scan = PickleScan()
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
                top = names[0].split("/", 1)[0] if names else ""
                if f"{top}/data.pkl" in names:
                    scan_pickle(archive.read(f"{top}/data.pkl"), scan)
        except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError, RuntimeError, EOFError) as exc:
            raise CheckpointLoadError(f"{path}: cannot read the archive's data.pkl ({exc}); re-fetch or re-verify the checkpoint") from None
        return scan
    with path.open("rb") as fh:
        for _ in range(5):  # magic number, protocol, sys info, the object, storage keys
            scan_pickle(fh, scan)
            if scan.error is not None:
                scan.error = None  # raw storage bytes follow the last pickle
                break
    return scan


def _python2_or_torch_name(name: str) -> str:
    """The name torch's unpickler looks up for ``name`` (its Python 2 mappings)."""
    module, _, attr = name.rpartition(".")
    if (module, attr) in TORCH_NAME_MAPPING:
        return ".".join(TORCH_NAME_MAPPING[(module, attr)])
    if module in TORCH_IMPORT_MAPPING:
        return f"{TORCH_IMPORT_MAPPING[module]}.{attr}"
    return name


# --- refusals that always name the global ---------------------------------------

_HOSTILE = "the file is hostile: do not load it, restore another checkpoint"
_NOT_PLAIN = "the file is not a plain weights checkpoint: restore another checkpoint"
_HINTS = {"numpy.dtypes.ObjectDType": "a numpy array of Python objects"}


def refusal(name: str, *, opcode: str | None = None) -> tuple[str, bool]:
    """Why loading stops at the global ``name``: ``(one line, hostile)``.

    Never imports anything (``name`` comes from the file). Suggests
    ``--allow-global`` only for a name that may be the user's own plain data
    class; a class known to fail the rule is never suggested.
    """
    via = f" (pickle opcode {opcode}, which torch.save never writes)" if opcode and opcode != "GLOBAL" else ""
    hint = f" ({_HINTS[name]})" if name in _HINTS else ""
    if name.startswith("<"):
        return f"it names a global by {name.strip('<>')}{via}; {_HOSTILE}", True
    if allow_global_problem(name) is not None:
        reason = unsafe_global_reason(name) if _GLOBAL_NAME.match(name) else None
        if reason is None:
            return f"it names the global {name!r}{via}, which is not the module.Name of any class; {_HOSTILE}", True
        return f"it calls {name}{via}: {reason}; {_HOSTILE}", True
    if via:
        return f"it names the global {name}{hint}{via}, an opcode torch's safe loader refuses; {_NOT_PLAIN}", False
    decided, problem = check_if_loaded(name)
    if decided and problem is not None:
        return f"it needs {name}{hint}, which can never be allowed: {problem}; {_NOT_PLAIN}", False
    if not decided and is_library_global(name):
        return f"it needs {name}{hint}, which is not allowlisted; {_NOT_PLAIN}", False
    return (
        f"it needs the global {name}, which is not allowlisted; if it is your own plain data class "
        f"(a dataclass, NamedTuple or Enum) and you trust this file, allow it with --allow-global {name} "
        "(or allow_globals in the drill config)"
    ), False


_GLOBAL_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")

_GLOBAL_PATTERNS = (
    re.compile(r"GLOBAL (.+?) was not an allowed global"),
    re.compile(r"unsupported GLOBAL (.+?) whose module", re.IGNORECASE),
    re.compile(r"but got <class '([^']+)'>"),
    re.compile(r"unrecognized function <class '([^']+)'>"),
    re.compile(r"unrecognized function <(?:built-in )?function ([\w.<>]+)"),
    re.compile(r"unrecognized function ([\w.]+)"),
    re.compile(r"Unsupported class ([\w.]+)"),
)


def refused_global(message: str) -> str | None:
    """The ``module.Name`` torch's weights-only unpickler refused, parsed from
    its error message (a bare builtin name becomes ``builtins.name``); None
    when the message names none."""
    for pattern in _GLOBAL_PATTERNS:
        match = pattern.search(message)
        if match:
            name = match.group(1).strip()
            return name if "." in name else f"builtins.{name}"
    return None


def _unpickler_reason(message: str) -> str:
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    for i, line in enumerate(lines):
        if "WeightsUnpickler error:" in line:
            rest = line.split("WeightsUnpickler error:", 1)[1].strip()
            following = [ln for ln in lines[i + 1:] if not ln.startswith("Check the documentation")]
            return rest or (following[0] if following else "refused by torch's weights-only unpickler")
    specific = [ln for ln in lines[1:] if not ln.startswith("Check the documentation")]
    return (specific or lines or ["unknown reason"])[0]


def _refuse_archive(path: Path) -> None:
    """Refuse zip archives that are not plain torch checkpoints: member names
    escaping the archive, torch.export (.pt2) and TorchScript archives."""
    if path.suffix == ".pt2":
        raise UnsafeCheckpoint(
            f"{path}: refused: .pt2 (torch.export) archives can run code when loaded and have no safe mode; "
            "save weights with torch.save(model.state_dict()) or safetensors instead"
        )
    if not zipfile.is_zipfile(path):
        return
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError) as exc:
        raise CheckpointLoadError(f"{path}: unreadable zip archive ({exc}); re-fetch or re-verify the checkpoint") from None
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise UnsafeCheckpoint(f"{path}: refused to load: archive member {twice!r} appears twice (readers disagree on which one counts); {_HOSTILE}")
    for name in names:
        parts = PurePosixPath(name.replace("\\", "/")).parts
        if name.startswith(("/", "\\")) or ".." in parts or "\x00" in name or re.match(r"^[A-Za-z]:", name):
            raise UnsafeCheckpoint(f"{path}: refused to load: archive member {name!r} points outside the archive; {_HOSTILE}")
    if any(n.endswith("/archive_format") or "serialized_exported_program" in n for n in names):
        raise UnsafeCheckpoint(
            f"{path}: refused: the file is a torch.export (.pt2) archive under another name; "
            "save weights with torch.save(model.state_dict()) or safetensors instead"
        )
    if any(n.endswith("/constants.pkl") or "/code/" in n for n in names):
        raise UnsafeCheckpoint(
            f"{path}: refused: the file is a TorchScript archive (it holds code to run); "
            "save weights with torch.save(model.state_dict()) or safetensors instead"
        )


def _refuse_named_globals(path: Path, scan: PickleScan, allowed: set[str] | None) -> None:
    for found in scan.globals:
        looked_up = _python2_or_torch_name(found.name)
        if allowed is not None and looked_up in allowed:
            continue
        if allowed is None and allow_global_problem(found.name) is None:
            continue  # torch decides; its refusal is explained after
        text, _ = refusal(found.name, opcode=found.opcode)
        raise UnsafeCheckpoint(f"{path}: refused to load: {text}", global_name=found.name)


def _explain_torch_refusal(path: Path, message: str, scan: PickleScan) -> UnsafeCheckpoint:
    operand = re.search(r"Unsupported operand (\d+)", message)
    if operand is not None:
        code = int(operand.group(1))
        hits = [f for f in scan.foreign_opcodes if f[1] == code] or scan.foreign_opcodes
        if hits:
            opname, _, position, found = hits[0]
            if found is not None:
                text, _ = refusal(found.name, opcode=opname)
                return UnsafeCheckpoint(f"{path}: refused to load: {text}", global_name=found.name)
            return UnsafeCheckpoint(
                f"{path}: refused to load: pickle opcode {opname} at byte {position}, which torch's safe loader does not "
                f"run (torch.save never writes it); {_NOT_PLAIN}"
            )
    name = refused_global(message)
    if name is not None:
        text, _ = refusal(name)
        return UnsafeCheckpoint(f"{path}: refused to load: {text}", global_name=name)
    return UnsafeCheckpoint(f"{path}: refused to load: {_unpickler_reason(message)}; {_NOT_PLAIN}")


def safe_torch_load(
    path: str | Path,
    *,
    map_location: str | torch.device = "cpu",
    extra_allowlist: Sequence[Any] = (),
    mmap: bool = True,
) -> Any:
    """``torch.load(path, weights_only=True)`` with :data:`DEFAULT_ALLOWLIST`.

    ``extra_allowlist`` adds globals: ``"module.Name"`` strings (checked and
    imported here, :func:`resolve_global`) or the objects themselves. Before
    torch runs, the archive's member names and every global its pickle names
    are checked (:func:`scan_pickle`), so a refusal names the global however
    the pickle spells it. With ``mmap`` the tensors map the file
    copy-on-write (the file is never modified); legacy non-zip files are read
    normally. Never retries with ``weights_only=False``.

    Raises :class:`UnsafeCheckpoint` (one line naming the refused global, and
    saying when the file is hostile) when the file needs something the safe
    loader will not do, including any ``.pt2`` or TorchScript archive;
    :class:`CheckpointLoadError` when the file is missing or unreadable.
    """
    p = Path(path)
    if not p.is_file():
        raise CheckpointLoadError(f"{p}: checkpoint file not found; fetch the checkpoint first or fix the path")
    _refuse_archive(p)
    allow = _allowlist(extra_allowlist)
    scan = _scan_file(p)
    _refuse_named_globals(p, scan, _allowed_names(allow))
    use_mmap = mmap and zipfile.is_zipfile(p)
    try:
        with exactly_these_globals(allow):
            return torch.load(p, map_location=map_location, weights_only=True, mmap=use_mmap)
    except pickle.UnpicklingError as exc:
        raise _explain_torch_refusal(p, str(exc), scan) from None
    except Exception as exc:  # torch's zip reader and rebuild functions raise RuntimeError, ValueError...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointLoadError(f"{p}: not a readable torch checkpoint ({type(exc).__name__}: {first}); re-fetch or re-verify it") from None


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of a ``.safetensors`` file, on CPU."""
    from safetensors.torch import load_file  # lazy: only a .safetensors file needs it

    p = Path(path)
    if not p.is_file():
        raise CheckpointLoadError(f"{p}: safetensors file not found; fetch the checkpoint first or fix the path")
    try:
        return load_file(str(p), device="cpu")
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise CheckpointLoadError(f"{p}: not a readable safetensors file ({exc}); re-fetch or re-verify it") from None


# --- Whole checkpoints --------------------------------------------------------


def is_tensor_dict(obj: Any) -> bool:
    return isinstance(obj, Mapping) and bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def unwrap_state(obj: Any, path: Path, keys: Sequence[str]) -> dict[str, torch.Tensor]:
    if is_tensor_dict(obj):
        return dict(obj)
    if isinstance(obj, Mapping):
        for key in keys:
            if is_tensor_dict(obj.get(key)):
                return dict(obj[key])
    raise CheckpointLoadError(
        f"{path}: not a model state dict (expected a mapping of names to tensors, or one under {'/'.join(keys)}); "
        "save model.state_dict()"
    )


def load_checkpoint_dir(path: str | Path, fmt: Format | str, *, extra_allowlist: Sequence[Any] = ()) -> LoadedCheckpoint:
    """Load a whole checkpoint (a step directory, or a single-file checkpoint) safely, on CPU.

    How is each format's own (:meth:`ckptier.formats.base.FormatPlugin.load`):
    guide (``rank-0000``; several ranks are refused for now), DCP, Hugging
    Face Trainer and sharded weights, Lightning, DeepSpeed and Megatron (one
    rank), Orbax (only where JAX is installed). Reads only; never writes.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointLoadError(f"{p}: checkpoint not found; fetch it first or fix the path")
    try:
        kind = Format(fmt)
    except ValueError:
        raise ConfigError(f"checkpoint format {fmt!r} is unknown; use one of {', '.join(f.value for f in Format)}") from None
    handler = plugin(kind)
    if not handler.drillable:
        raise CheckpointLoadError(f"{p}: format {kind.value!r} has no known loader; drills support "
                                  + ", ".join(sorted(f.value for f in Format if f is not kind and _drillable(f))))
    return handler.load(p, extra_allowlist)


def _drillable(fmt: Format) -> bool:
    return plugin(fmt).drillable


from ckptier.formats.dcp import load_dcp_tensors, read_dcp_metadata  # noqa: E402,F401 - DCP's safe reader, re-exported
