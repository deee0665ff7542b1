"""A restore drill's worker: one rank, inside its isolated subprocess.

``python -m ckptier.tasks.drill_worker --request request.json`` reads a
:class:`~ckptier.tasks.drill.DrillRequest`, restores its part of the
checkpoint into the model from the factory with the safe loaders only,
trains K steps (on the same batches as every other rank), and writes a
:class:`~ckptier.tasks.drill.WorkerResult` as JSON to the request's
``result_path`` (written whole, then renamed). It exits 0 whenever it could
write a result, including a failed drill; the verdict is the parent's
(:func:`~ckptier.tasks.drill.judge`). A single-rank drill is the same
worker at world size 1.

How the model is restored follows the checkpoint's layout:

* replicated (one saved rank, or DDP, which saved the whole state on every
  rank): the rank loads its replica with its format's loader, strictly;
  when there are several ranks it then wraps the model in
  ``DistributedDataParallel`` without the initial broadcast from rank 0
  (``init_sync=False``), so that each rank trains what it restored. A
  single rank of a single-rank checkpoint trains twice from a fresh restore
  (the ``deterministic`` check).
* sharded (FSDP2, DCP shards, the guide's ``sharded`` ranks): the model is
  sharded with FSDP2 (``fully_shard`` on each block of its outermost
  ``ModuleList``, then the root) over a device mesh of the drill's ranks,
  the optimizer is rebuilt over the sharded parameters with the factory's
  hyperparameters, and ``torch.distributed.checkpoint.load`` with DCP's own
  planner reads the parts each rank needs (resharding when the drill has
  another world size than the save), through a reader that admits only
  DCP's metadata classes, loads tensors with ``weights_only=True`` and
  refuses bytes that were not fetched.

A worker joins a process group (rank 0 serving the rendezvous store on the
socket the parent bound to 127.0.0.1) only when there are several ranks or
the layout is sharded. Run only through the launcher
(:mod:`ckptier.tasks.drill_launch`): no credentials, writes confined to its
work directory where the kernel offers Landlock, killed with its parent.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import resource
import signal
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from ckptier.formats.registry import plugin
from ckptier.formats.safe_load import (
    CheckpointLoadError,
    LoadedCheckpoint,
    UnsafeCheckpoint,
    UnsupportedCheckpoint,
    float_or_none,
    load_checkpoint_dir,
)
from ckptier.storage.errors import CkptierError, ConfigError
from ckptier.tasks.drill import DrillRequest, WorkerResult
from ckptier.tasks.drill_models import DrillSpec, build_spec, hf_spec, resolve_factory, train_step, trainer_optimizer


class DrillFailure(CkptierError):
    """A drill stage failed in a way the verdict should report (not a crash)."""

    def __init__(self, stage: str, message: str, *, unsafe: bool = False) -> None:
        super().__init__(message)
        self.stage = stage
        self.unsafe = unsafe


def resolve_device(name: str, rank: int = 0) -> torch.device:
    """``auto`` -> cuda when available, else cpu; ``cuda`` -> CUDA device
    ``rank`` (each rank its own); ``cuda:N`` as given. A CUDA device that is
    not there fails (stage ``setup``)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if not name.startswith("cuda"):
        return torch.device(name)
    if not torch.cuda.is_available():
        raise DrillFailure("setup", f"drill device {name!r} asked for, but no CUDA device is available here; use --device cpu or auto")
    device = torch.device("cuda", rank) if name == "cuda" else torch.device(name)
    if device.index is not None and torch.cuda.device_count() <= device.index:
        raise DrillFailure("setup", f"rank {rank} needs CUDA device {device.index}, found {torch.cuda.device_count()}; "
                                    "use --device cpu")
    return device


def no_factory_message(checkpoint: str, fmt: str) -> str:
    """The one-line error for a drill with no model factory where one is
    needed (every format but Hugging Face weights with a config.json); the
    reason is the format's own (:attr:`ckptier.formats.base.FormatPlugin.why_factory`); pure."""
    try:
        why = plugin(fmt).why_factory
    except (KeyError, ValueError):
        why = f"a {fmt} checkpoint holds tensors only and the model's code is needed"
    return (
        f"{checkpoint}: no drill model given: {why}; pass --model module:function "
        "(or set model = \"module:function\" in the job's [[drill]] table of ckptier.toml), "
        "a function returning DrillSpec(model, optimizer, batch, loss) built as in training"
    )


def _shape(value: Any) -> str:
    """A tensor's shape (or a size) as ``[2, 3]``."""
    return "[" + ", ".join(str(d) for d in getattr(value, "shape", value)) + "]"


def state_dict_problems(expected: Mapping[str, torch.Tensor], loaded: Mapping[str, torch.Tensor]) -> list[str]:
    """Why ``loaded`` cannot be loaded strictly into a model whose state dict
    is ``expected``; empty when it can.

    A missing key is forgiven when it is tied to (shares storage with) a
    present key, since tied weights are often stored once. Entries of
    ``expected`` that are no tensors (a module's ``_extra_state``, such as
    megatron-core's, None) are no weights and are not asked of ``loaded``.
    """
    problems: list[str] = []
    expected = {k: v for k, v in expected.items() if isinstance(v, torch.Tensor)}
    present_ptrs = {expected[k].data_ptr() for k in expected if k in loaded and expected[k].numel()}
    for key, tensor in expected.items():
        if key not in loaded:
            if tensor.numel() and tensor.data_ptr() in present_ptrs:
                continue
            problems.append(f"missing key {key} (model expects {_shape(tensor)})")
        elif tuple(loaded[key].shape) != tuple(tensor.shape):
            problems.append(f"shape mismatch for {key}: checkpoint {_shape(loaded[key])}, model {_shape(tensor)}")
    problems.extend(f"unexpected key {key} {_shape(loaded[key])} in the checkpoint" for key in loaded if key not in expected)
    return problems


def _optimizer_steps(optimizer: torch.optim.Optimizer) -> float | None:
    values = [float(s["step"]) for s in optimizer.state.values() if isinstance(s, Mapping) and "step" in s]
    return max(values) if values else None


def _load_optimizer(spec: DrillSpec, loaded: LoadedCheckpoint) -> None:
    assert spec.optimizer is not None and loaded.optimizer_state is not None
    if loaded.optimizer_layout == "fqn-flat":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(flatten_optimizer_state_dict=True)
        template = get_optimizer_state_dict(spec.model, spec.optimizer, options=options)
        wanted = {k for k in template if k.startswith("state.")}
        missing = sorted(wanted - set(loaded.optimizer_state))
        unexpected = sorted(set(loaded.optimizer_state) - wanted)
        if missing or unexpected:
            first = f"missing key {missing[0]}" if missing else f"unexpected key {unexpected[0]}"
            raise DrillFailure("fit", f"optimizer state does not match the factory's optimizer: {first} ({len(missing)} missing, {len(unexpected)} unexpected)")
        for key in wanted:
            src, dst = loaded.optimizer_state[key], template[key]
            if isinstance(dst, torch.Tensor) and tuple(src.shape) != tuple(dst.shape):
                raise DrillFailure("fit", f"optimizer state shape mismatch for {key}: checkpoint {_shape(src)}, optimizer {_shape(dst)}")
            template[key] = src
        set_optimizer_state_dict(spec.model, spec.optimizer, template, options=options)
        return
    state = loaded.optimizer_state
    if not isinstance(state, Mapping) or "state" not in state or "param_groups" not in state:
        raise DrillFailure("restore", "optimizer state is not an Optimizer.state_dict() (needs 'state' and 'param_groups')")
    own = spec.optimizer.state_dict()
    if len(own["param_groups"]) != len(state["param_groups"]):
        raise DrillFailure("fit", f"optimizer has {len(own['param_groups'])} param groups, checkpoint {len(state['param_groups'])}; build the optimizer as training did")
    for i, (mine, theirs) in enumerate(zip(own["param_groups"], state["param_groups"], strict=True)):
        if len(mine["params"]) != len(theirs["params"]):
            raise DrillFailure("fit", f"optimizer param group {i} has {len(mine['params'])} parameters, checkpoint {len(theirs['params'])}; build the optimizer as training did")
    params = [p for group in spec.optimizer.param_groups for p in group["params"]]
    for pid, pstate in state["state"].items():
        if not isinstance(pid, int) or not 0 <= pid < len(params):
            raise DrillFailure("restore", f"optimizer state refers to parameter {pid!r}, the optimizer has {len(params)}")
        for name, value in pstate.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != tuple(params[pid].shape):
                raise DrillFailure("restore", f"optimizer state {name} of parameter {pid} has shape {_shape(value)}, the parameter {_shape(params[pid])}")
    _check_per_parameter_state(spec, state["state"], params)
    try:
        spec.optimizer.load_state_dict(state)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise DrillFailure("restore", f"optimizer state does not load: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None


def _check_per_parameter_state(spec: DrillSpec, state: Mapping[Any, Any], params: list[torch.nn.Parameter]) -> None:
    """Every trainable parameter has state, with the keys its peers of the
    same rank have (an optimizer state with entries torn out is refused,
    since load_state_dict would quietly start those parameters afresh)."""
    if not state:
        return
    names = {id(p): n for n, p in spec.model.named_parameters()}
    keys_by_rank: dict[int, set[str]] = {}
    for pid, pstate in state.items():
        if isinstance(pstate, Mapping):
            keys_by_rank.setdefault(params[pid].dim(), set()).update(pstate)
    for i, param in enumerate(params):
        if not param.requires_grad:
            continue
        name = names.get(id(param), f"#{i}")
        if i not in state:
            raise DrillFailure("restore", f"optimizer state has no entry for parameter {name} (index {i}) while {len(state)} others do; the optimizer state is incomplete")
        lacking = keys_by_rank.get(param.dim(), set()) - set(state[i])
        if lacking:
            raise DrillFailure("restore", f"optimizer state of parameter {name} lacks {', '.join(sorted(lacking))}; the optimizer state is incomplete")


R = TypeVar("R")


def _metadata(extra: Mapping[str, Any], request: DrillRequest, saved_step: int | None) -> dict[str, Any]:
    """What a factory is called with: the checkpoint's metadata, its ``step`` the catalog's."""
    step = request.step if request.step is not None else saved_step
    return {**extra, **({"step": step} if step is not None else {})}


#: Per format, the distributions whose versions a drill records besides python, torch and CUDA.
FORMAT_LIBRARIES: Mapping[str, tuple[str, ...]] = {
    "hf-trainer": ("transformers", "safetensors"), "hf-weights": ("transformers", "safetensors"),
    "lightning": ("lightning",), "deepspeed": ("deepspeed",), "orbax": ("orbax-checkpoint", "jax"),
    "megatron": ("megatron-core",), "dcp": (), "guide": (),
}


def drill_stack(fmt: str) -> dict[str, str | None]:
    """The versions this drill runs on: python, torch, CUDA (None on a
    CPU-only build), numpy and the format's libraries (None when not
    installed); read from the installed distributions, nothing imported."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    stack: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__,
                                    "cuda": torch.version.cuda}
    for name in ("numpy", *FORMAT_LIBRARIES.get(fmt, ())):
        try:
            stack[name] = version(name)
        except PackageNotFoundError:
            stack[name] = None
    return stack


class _Restored:
    def __init__(self, spec: DrillSpec, loaded: LoadedCheckpoint, load_s: float, build_s: float, restore_s: float) -> None:
        self.spec, self.loaded = spec, loaded
        self.load_s, self.build_s, self.restore_s = load_s, build_s, restore_s


def restore(
    request: DrillRequest,
    device: torch.device,
    load: Callable[[], LoadedCheckpoint] | None = None,
    progress: Callable[[str], None] = lambda stage: None,
) -> _Restored:
    """Load the checkpoint safely (with ``load`` when given, else by its
    format's loader), build the model and restore strictly; ``progress`` is
    told each stage (``build``, ``restore``) as it starts (``load`` is the caller's)."""
    t0 = time.perf_counter()
    try:
        if load is not None:
            loaded = load()
        else:
            loaded = load_checkpoint_dir(request.checkpoint, request.format, extra_allowlist=request.allow_globals)
    except UnsupportedCheckpoint as exc:  # a variant not restored yet: nothing known to be wrong with it
        raise DrillFailure("unsupported", str(exc)) from None
    except CkptierError as exc:
        raise DrillFailure("load", str(exc), unsafe=isinstance(exc, UnsafeCheckpoint)) from None
    t1 = time.perf_counter()
    progress("build")
    try:
        factory = resolve_factory(request.factory) if request.factory is not None else None
    except CkptierError as exc:  # the operator's model does not import: nothing to do with the checkpoint
        raise DrillFailure("factory", str(exc)) from None
    try:
        if factory is not None:
            spec = build_spec(factory, _metadata(loaded.extra, request, loaded.step), name=request.factory or "factory")
        elif "hf_config_dir" in loaded.extra:
            spec = hf_spec(loaded.extra["hf_config_dir"])
            if loaded.optimizer_state is not None:
                spec.optimizer = trainer_optimizer(spec.model, loaded.optimizer_state)
        else:
            raise ConfigError(no_factory_message(request.checkpoint, request.format))
    except CkptierError as exc:
        raise DrillFailure("build", str(exc)) from None
    if spec.batch is None or spec.loss is None:
        raise DrillFailure("build", f"drill model {request.factory!r} gives no batch/loss; return a DrillSpec(model, optimizer, batch, loss)")
    if loaded.optimizer_state is not None and spec.optimizer is None:
        raise DrillFailure("build", f"the checkpoint has optimizer state but drill model {request.factory!r} builds no optimizer; return DrillSpec(model, optimizer=..., ...) built as in training")
    if spec.optimizer is None:
        spec.optimizer = torch.optim.SGD(spec.model.parameters(), lr=1e-4)
    t2 = time.perf_counter()
    progress("restore")
    problems = state_dict_problems(spec.model.state_dict(), loaded.model_state)
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise DrillFailure("fit", f"checkpoint does not fit the model: {problems[0]}{more}")
    spec.model.load_state_dict(loaded.model_state, strict=False)  # strictness checked above (tied weights)
    spec.model.to(device)
    spec.model.train()
    if loaded.optimizer_state is not None:
        _load_optimizer(spec, loaded)
    t3 = time.perf_counter()
    return _Restored(spec, loaded, t1 - t0, t2 - t1, t3 - t2)


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def resume_rng(states: Mapping[str, Any] | None) -> list[str]:
    """Continue the run's random streams where its checkpoint saved them
    (:attr:`~ckptier.formats.loaded.LoadedCheckpoint.rng_state`: ``python``,
    ``numpy``, ``cpu``), over the drill's own seed: dropout draws the run's
    masks, so a model with dropout retraces the run's losses exactly. CUDA
    generators are left at the seed. Returns the generators resumed; a state
    that does not fit its generator is skipped (the seed stays)."""
    import random

    resumed: list[str] = []
    if not states:
        return resumed

    def set_numpy(state: Any) -> None:
        import numpy

        numpy.random.set_state(state)

    for name, apply in (("python", random.setstate), ("numpy", set_numpy), ("cpu", torch.set_rng_state)):
        if name not in states:
            continue
        try:
            apply(states[name])
        except (TypeError, ValueError, RuntimeError, ImportError):
            continue
        resumed.append(name)
    return resumed


def _peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "rss"


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """Be killed when the drill that started this process dies (Linux), so
    that a killed drill leaves no rank waiting in a collective; exit now if
    it is already gone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return
    if os.getppid() != parent_pid:
        os._exit(3)


class _Progress:
    """The stage this rank is in, written where the parent reads it after a
    timeout or a crash (a few bytes per stage)."""

    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None
        self.stage = "start"

    def __call__(self, stage: str) -> None:
        self.stage = stage
        if self.path is None:
            return
        try:
            self.path.write_text(stage)
        except OSError:
            pass


def _rendezvous(request: DrillRequest, device: torch.device) -> None:
    import torch.distributed as dist

    limit = timedelta(seconds=max(request.timeout, 1.0))
    if request.rank == 0:
        store = dist.TCPStore("127.0.0.1", request.store_port, request.world_size, True, timeout=limit,
                              master_listen_fd=request.store_fd)
    else:
        store = dist.TCPStore("127.0.0.1", request.store_port, request.world_size, False, timeout=limit)
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(request.backend, store=store, rank=request.rank, world_size=request.world_size,
                            timeout=limit, **kwargs)


def _build(request: DrillRequest, metadata: Mapping[str, Any]) -> DrillSpec:
    if request.factory is None:
        raise DrillFailure("build", no_factory_message(request.checkpoint, request.format))
    try:
        factory = resolve_factory(request.factory)
    except CkptierError as exc:  # the operator's factory does not load: says nothing about the checkpoint
        raise DrillFailure("factory", str(exc)) from None
    try:
        spec = build_spec(factory, metadata, name=request.factory)
    except CkptierError as exc:
        raise DrillFailure("build", str(exc)) from None
    if spec.batch is None or spec.loss is None:
        raise DrillFailure("build", f"drill model {request.factory!r} gives no batch/loss; return a DrillSpec(model, optimizer, batch, loss)")
    return spec


def _digest(model: nn.Module) -> str:
    """sha256 of the model's restored state, key by key (replicas must match)."""
    h = hashlib.sha256()
    for key, value in sorted(model.state_dict().items()):
        h.update(key.encode())
        if isinstance(value, torch.Tensor):
            t = value.detach().to("cpu").contiguous()
            h.update(str(t.dtype).encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# --- replicated: every rank loads one replica -----------------------------------------


def restore_replica(request: DrillRequest, device: torch.device, progress: _Progress) -> tuple[DrillSpec, LoadedCheckpoint, str | None, dict[str, float]]:
    """Load this rank's replica with its format's loader, strictly; then
    wrap the model in DDP (no initial broadcast) when there are other ranks.
    Returns the spec, what was loaded, the digest of the restored state
    (several ranks only: replicas must match) and the timings."""
    loader = None
    if request.format == "dcp" and request.available:
        from ckptier.formats.dcp import load_dcp

        available = {k: (None if v is None else [tuple(r) for r in v]) for k, v in request.available.items()}
        loader = lambda: load_dcp(Path(request.checkpoint), available)  # noqa: E731
    restored = restore(request, device, loader, progress)
    spec = restored.spec
    digest = None
    if request.world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        digest = _digest(spec.model)
        ids = [device.index] if device.type == "cuda" else None
        spec.model = DistributedDataParallel(spec.model, device_ids=ids, init_sync=False)
    return spec, restored.loaded, digest, {"load_s": restored.load_s, "build_s": restored.build_s, "restore_s": restored.restore_s}


# --- sharded: FSDP2 and DCP's planner ----------------------------------------------------


def shard_model(model: nn.Module, mesh: Any) -> None:
    """FSDP2 over ``mesh``: each block of the model's outermost
    ``ModuleList`` (a transformer's layers) that has parameters, then the
    root (all remaining parameters)."""
    from torch.distributed.fsdp import fully_shard

    taken: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(t + ".") for t in taken):
            continue
        if isinstance(module, nn.ModuleList):
            taken.append(name)
            for child in module:
                if any(True for _ in child.parameters()):
                    fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)


def rebuild_optimizer(old: torch.optim.Optimizer, names: Mapping[int, str], model: nn.Module) -> torch.optim.Optimizer:
    """The factory's optimizer, built again over ``model``'s (now sharded)
    parameters: the same class, parameter groups (by parameter name) and
    hyperparameters. ``names``: id of each original parameter -> its name."""
    import inspect

    by_name = dict(model.named_parameters())
    groups = []
    for group in old.param_groups:
        try:
            params = [by_name[names[id(p)]] for p in group["params"]]
        except KeyError as exc:
            raise DrillFailure("build", f"the factory's optimizer holds a parameter that is not the model's ({exc}); "
                                        "build the optimizer over model.parameters()") from None
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    accepted = inspect.signature(type(old)).parameters
    defaults = {k: v for k, v in old.defaults.items() if k in accepted}
    try:
        return type(old)(groups, **defaults)
    except (TypeError, ValueError) as exc:
        raise DrillFailure("build", f"cannot build {type(old).__name__} again over the sharded parameters ({exc}); "
                                    "use a torch.optim optimizer") from None


def _check_keys(model_sd: Mapping[str, Any], saved: Mapping[str, Any]) -> None:
    """Strict: the checkpoint's model tensors are the model's, with their whole shapes."""
    problems = [f"missing key {k} (model expects {_shape(v.shape)})" for k, v in model_sd.items() if k not in saved]
    problems += [f"shape mismatch for {k}: checkpoint {_shape(saved[k])}, model {_shape(v.shape)}"
                 for k, v in model_sd.items() if k in saved and tuple(saved[k]) != tuple(v.shape)]
    problems += [f"unexpected key {k} {_shape(saved[k])} in the checkpoint" for k in saved if k not in model_sd]
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise DrillFailure("fit", f"checkpoint does not fit the model: {problems[0]}{more}")


def restore_shards(request: DrillRequest, device: torch.device, progress: _Progress) -> tuple[DrillSpec, dict[str, Any], dict[str, float]]:
    """Shard the model with FSDP2 and load this rank's parts through DCP's planner."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from ckptier.formats.dcp import checkpoint_notes, dcp_failure, safe_dcp_reader
    from ckptier.formats.guide import guide_shard_reader

    path = Path(request.checkpoint)
    t0 = time.perf_counter()
    try:
        extra, step, loss = checkpoint_notes(path)
        if request.format == "guide":
            reader = guide_shard_reader(path, request.allow_globals)
        else:
            available = {k: (None if v is None else [tuple(r) for r in v]) for k, v in request.available.items()}
            reader = safe_dcp_reader(path, available)
        metadata = reader.read_metadata()
    except CkptierError as exc:
        raise DrillFailure("load", str(exc), unsafe=isinstance(exc, UnsafeCheckpoint)) from None
    saved = {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    prefixed = any(k.startswith("model.") for k in saved)
    t1 = time.perf_counter()
    progress("build")
    spec = _build(request, _metadata(extra, request, step))
    progress("restore")
    names = {id(p): n for n, p in spec.model.named_parameters()}
    spec.model.to(device)
    mesh = init_device_mesh(device.type, (request.world_size,))
    shard_model(spec.model, mesh)
    saved_opt = {k[len("optimizer."):]: v for k, v in saved.items() if k.startswith("optimizer.state.")}
    if saved_opt and spec.optimizer is None:
        raise DrillFailure("build", f"the checkpoint has optimizer state but drill model {request.factory!r} builds no optimizer; "
                                    "return DrillSpec(model, optimizer=..., ...) built as in training")
    if spec.optimizer is None:
        spec.optimizer = torch.optim.SGD(spec.model.parameters(), lr=1e-4)
    else:
        spec.optimizer = rebuild_optimizer(spec.optimizer, names, spec.model)
    spec.model.train()
    t2 = time.perf_counter()
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model_sd, optim_sd = get_state_dict(spec.model, spec.optimizer, options=options)
    saved_model = {k[len("model."):]: v for k, v in saved.items() if k.startswith("model.")} if prefixed else {
        k: v for k, v in saved.items() if not k.startswith("optimizer.")}
    _check_keys(model_sd, saved_model)
    template: dict[str, Any] = {"model": model_sd} if prefixed else dict(model_sd)
    if saved_opt:
        wanted = {k for k in optim_sd if k.startswith("state.")}
        missing, unexpected = sorted(wanted - set(saved_opt)), sorted(set(saved_opt) - wanted)
        if missing or unexpected:
            first = f"missing key {missing[0]}" if missing else f"unexpected key {unexpected[0]}"
            raise DrillFailure("fit", f"optimizer state does not match the factory's optimizer: {first} "
                                      f"({len(missing)} missing, {len(unexpected)} unexpected)")
        for key in wanted:
            have = optim_sd[key]
            if isinstance(have, torch.Tensor) and tuple(have.shape) != tuple(saved_opt[key]):
                raise DrillFailure("fit", f"optimizer state shape mismatch for {key}: checkpoint {_shape(saved_opt[key])}, "
                                          f"optimizer {_shape(have.shape)}")
        template["optimizer"] = {k: optim_sd[k] for k in wanted}
    try:
        dcp.load(template, storage_reader=reader)
    except Exception as exc:
        raise DrillFailure("load", f"{path}: DCP load failed: {dcp_failure(exc)}") from None
    loaded_model = template["model"] if prefixed else {k: template[k] for k in model_sd}
    optim_state = {**optim_sd, **template["optimizer"]} if saved_opt else None
    set_state_dict(spec.model, spec.optimizer, model_state_dict=loaded_model,
                   optim_state_dict=optim_state if optim_state is not None else optim_sd, options=options)
    t3 = time.perf_counter()
    notes = {"checkpoint_step": step, "recorded_loss": float_or_none(loss), "optimizer_loaded": bool(saved_opt)}
    return spec, notes, {"load_s": t1 - t0, "build_s": t2 - t1, "restore_s": t3 - t2}


def _inner(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def train(spec: DrillSpec, request: DrillRequest, device: torch.device, start: int, progress: _Progress,
          rng: Mapping[str, Any] | None = None) -> tuple[list[float], dict[str, Any]]:
    """K steps from the restored state, steps ``start + 1 .. start + K``, on
    the same batches as every other rank; per-step losses and measurements.
    The random streams start from the request's seed, then from the run's
    saved states where the checkpoint has them (``rng``, :func:`resume_rng`).
    A trainable parameter is a problem on this rank when its gradient is
    missing at every step or non-finite at some step; on every rank when it
    was zero everywhere (reduced over the ranks once, at the end)."""
    import torch.distributed as dist

    progress("train")
    _seed(request.seed)
    resumed = resume_rng(rng)
    params = [(n, p) for n, p in _inner(spec.model).named_parameters() if p.requires_grad]
    present = torch.zeros(len(params), dtype=torch.bool)
    nonzero = torch.zeros(len(params), dtype=torch.float32)
    nonfinite = torch.zeros(len(params), dtype=torch.bool)
    losses: list[float] = []
    info: dict[str, Any] = {"optimizer_step_before": _optimizer_steps(spec.optimizer) if spec.optimizer else None,
                            "rng_saved": tuple(sorted(rng)) if rng else (), "rng_resumed": tuple(resumed)}
    t0 = time.perf_counter()
    for i in range(request.steps):
        value = train_step(spec, start + i + 1, device)
        losses.append(float(value))
        if i == 0:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            info["first_step_s"] = time.perf_counter() - t0
            info["first_step_done_at"] = time.time()
        for j, (_, p) in enumerate(params):
            if p.grad is None:
                continue
            present[j] = True
            g = _local(p.grad)
            if g.numel():
                if not bool(torch.isfinite(g).all()):
                    nonfinite[j] = True
                if bool((g != 0).any()):
                    nonzero[j] = 1.0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    info["steps_s"] = time.perf_counter() - t0
    info["optimizer_step_after"] = _optimizer_steps(spec.optimizer) if spec.optimizer else None
    info["optimizer_keeps_state"] = spec.optimizer is not None and any(
        isinstance(v, torch.Tensor) for s in spec.optimizer.state.values() for v in s.values())
    anywhere = nonzero.to(device)
    if dist.is_initialized() and request.world_size > 1:
        dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
    anywhere = anywhere.to("cpu")
    problems = [f"{n}: no gradient" for j, (n, _) in enumerate(params) if not present[j]]
    problems += [f"{n}: non-finite gradient" for j, (n, _) in enumerate(params) if nonfinite[j]]
    zero = "zero gradient on every rank" if request.world_size > 1 else "no gradient"
    problems += [f"{n}: {zero}" for j, (n, _) in enumerate(params) if present[j] and not nonfinite[j] and not anywhere[j]]
    info["grad_problems"] = problems
    every = list(_inner(spec.model).named_parameters())
    info["trainable_params"] = len(params)
    info["frozen_params"] = len(every) - len(params)
    return losses, info


def _guarded_train(spec: DrillSpec, request: DrillRequest, device: torch.device, start: int,
                   progress: _Progress, rng: Mapping[str, Any] | None = None) -> tuple[list[float], dict[str, Any]]:
    try:
        return train(spec, request, device, start, progress, rng)
    except CkptierError:
        raise
    except Exception as exc:  # the user's model failing in forward/backward
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise DrillFailure("train", f"training step failed: {type(exc).__name__}: {first}") from None


# --- the whole rank ------------------------------------------------------------------------


def run_request(request: DrillRequest) -> WorkerResult:
    """The drill of one rank; never raises (failures become the result's error)."""
    started = time.perf_counter()
    progress = _Progress(request.progress_path)
    base: dict[str, Any] = {
        "rank": request.rank, "world_size": request.world_size, "checkpoint": request.checkpoint,
        "format": request.format, "steps": request.steps, "backend": request.backend if request.distributed else None,
        "env_keys": tuple(sorted(os.environ)), "torch_version": torch.__version__,
        "stack": drill_stack(request.format),
    }
    try:
        device = resolve_device(request.device, request.rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            torch.cuda.reset_peak_memory_stats(device)
        base["device"] = str(device)
        torch.use_deterministic_algorithms(True, warn_only=True)
        rendezvous_s = 0.0
        if request.distributed:
            progress("rendezvous")
            t0 = time.perf_counter()
            _rendezvous(request, device)
            rendezvous_s = time.perf_counter() - t0
        progress("load")
        digest = None
        rng: dict[str, Any] | None = None
        if request.layout == "sharded":
            base["parallel"] = "fsdp2"
            spec, notes, times = restore_shards(request, device, progress)
            base.update(notes)
        else:
            base["parallel"] = "ddp" if request.world_size > 1 else "none"
            spec, loaded, digest, times = restore_replica(request, device, progress)
            base.update(recorded_loss=loaded.recorded_loss, checkpoint_step=loaded.step,
                        optimizer_loaded=loaded.optimizer_state is not None, also_loaded=tuple(loaded.also_loaded),
                        optimizer_left=loaded.optimizer_left)
            rng = loaded.rng_state
        start = request.step if request.step is not None else (base.get("checkpoint_step") or 0)
        base.update(first_step=start, trajectory_rtol=spec.trajectory_rtol,
                    synthetic_batches=spec.synthetic_batches)
        losses, info = _guarded_train(spec, request, device, start, progress, rng)
        repeat: list[float] = []
        if request.repeat:  # a fresh restore, trained again: the two runs must agree
            del spec
            progress("load")
            spec, loaded, _, times = restore_replica(request, device, progress)
            repeat, _ = _guarded_train(spec, request, device, start, progress, loaded.rng_state)
        peak, kind = _peak_memory(device)
        progress("done")
        return WorkerResult(
            **base, losses=tuple(losses), losses_repeat=tuple(repeat), restored_digest=digest,
            optimizer_step_before=info["optimizer_step_before"], optimizer_step_after=info["optimizer_step_after"],
            trainable_params=info["trainable_params"], frozen_params=info["frozen_params"],
            optimizer_keeps_state=info["optimizer_keeps_state"],
            rng_saved=info["rng_saved"], rng_resumed=info["rng_resumed"],
            grad_problems=tuple(info["grad_problems"]),
            timings={**times, "rendezvous_s": rendezvous_s, "first_step_s": info["first_step_s"],
                     "first_step_done_at": info["first_step_done_at"], "steps_s": info["steps_s"],
                     "total_s": time.perf_counter() - started},
            peak_memory_bytes=peak, memory_kind=kind,
        )
    except DrillFailure as exc:
        return WorkerResult(**base, error=str(exc), error_stage=exc.stage, unsafe=exc.unsafe)
    except (CheckpointLoadError, ConfigError) as exc:
        return WorkerResult(**base, error=str(exc), error_stage=progress.stage, unsafe=isinstance(exc, UnsafeCheckpoint))
    except Exception:
        last = traceback.format_exc().strip().splitlines()[-1]
        return WorkerResult(**base, error=f"unexpected error in {progress.stage}: {last}", error_stage="crash")


def read_request(argv: list[str] | None, prog: str, doc: str, written_by: str,
                 load: Callable[[dict[str, Any]], R]) -> R | None:
    """The request named by ``--request`` in ``argv``, built by ``load``; None
    (after one line on stderr) when it cannot be read."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    parser.add_argument("--request", required=True, type=Path, help=f"request JSON written by {written_by}")
    args = parser.parse_args(argv)
    try:
        return load(json.loads(args.request.read_text()))
    except (OSError, ValueError, TypeError) as exc:
        print(f"drill worker: cannot read request {args.request}: {exc}", file=sys.stderr)
        return None


def write_result(result_path: str, text: str) -> None:
    """Write ``text`` to ``result_path`` all at once (a temporary file renamed into place)."""
    out = Path(result_path)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, out)


def main(argv: list[str] | None = None) -> int:
    request = read_request(argv, "ckptier.tasks.drill_worker", __doc__ or "", "the drill launcher",
                           DrillRequest.from_dict)
    if request is None:
        return 2
    if request.parent_pid is not None:
        _die_with_parent(request.parent_pid)
    result = run_request(request)
    write_result(request.result_path, json.dumps(result.to_dict()))
    sys.stdout.flush()
    sys.stderr.flush()
    if not request.distributed:
        return 0
    if result.error is None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        return 0
    os._exit(0)  # other ranks may wait in a collective: never block on the process group's teardown


if __name__ == "__main__":
    sys.exit(main())
