"""One rank of a multi-rank restore drill, inside its isolated subprocess.

``python -m ckptier.tasks.drill_dist_worker --request rank-request.json``
reads a :class:`~ckptier.tasks.drill_dist.RankRequest`, joins the drill's
process group (rank 0 serves the rendezvous store on the socket the parent
bound to 127.0.0.1), builds the model from the factory, restores its part
of the checkpoint with the safe loaders only, trains K steps on the same
batches as every other rank, and writes a
:class:`~ckptier.tasks.drill_dist.RankResult` as JSON to the request's
``result_path``. It exits 0 whenever it could write a result, including a
failed drill; the verdict is the parent's (``judge_ranks``).

How the model is distributed follows the checkpoint:

* replicated (DDP saved the whole state on every rank): the rank loads its
  replica exactly as a single-rank drill does, strictly, then wraps the
  model in ``DistributedDataParallel`` without the initial broadcast from
  rank 0 (``init_sync=False``), so that each rank trains what it restored.
* sharded (FSDP2, DCP shards, the guide's ``sharded`` ranks): the model is
  sharded with FSDP2 (``fully_shard`` on each block of its outermost
  ``ModuleList``, then the root) over a device mesh of the drill's ranks,
  the optimizer is rebuilt over the sharded parameters with the factory's
  hyperparameters, and ``torch.distributed.checkpoint.load`` with DCP's own
  planner reads the parts each rank needs (resharding when the drill has
  another world size than the save), through a reader that admits only
  DCP's metadata classes, loads tensors with ``weights_only=True`` and
  refuses bytes that were not fetched.

Run only through ``launch_ranks``: no credentials, writes confined to its
work directory where the kernel offers Landlock, killed with its parent.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckptier.formats.safe_load import CheckpointLoadError, LoadedCheckpoint, UnsafeCheckpoint, float_or_none
from ckptier.storage.errors import CkptierError, ConfigError
from ckptier.tasks.drill import DrillRequest
from ckptier.tasks.drill_dist import RankRequest, RankResult
from ckptier.tasks.drill_worker import (
    DrillFailure,
    _optimizer_steps,
    _peak_memory,
    _seed,
    read_request,
    restore,
    write_result,
)
from ckptier.tasks.drill_models import DrillSpec, build_spec, resolve_factory, train_step

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

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.stage = "start"

    def __call__(self, stage: str) -> None:
        self.stage = stage
        try:
            self.path.write_text(stage)
        except OSError:
            pass


def _rendezvous(request: RankRequest, device: torch.device) -> None:
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


def _build(request: RankRequest, metadata: Mapping[str, Any]) -> DrillSpec:
    if request.factory is None:
        from ckptier.tasks.drill_worker import no_factory_message

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


def restore_replica(request: RankRequest, device: torch.device, progress: _Progress) -> tuple[DrillSpec, LoadedCheckpoint, str, dict[str, float]]:
    """Load this rank's replica as a single-rank drill does, strictly; then
    wrap the model in DDP (no initial broadcast) when there are other ranks."""
    single = DrillRequest(request.checkpoint, request.format, request.factory, request.steps, str(device),
                          request.result_path, request.seed, tuple(request.allow_globals))
    loader = None
    if request.format == "dcp":
        from ckptier.formats.dcp import load_dcp

        available = {k: (None if v is None else [tuple(r) for r in v]) for k, v in request.available.items()}
        loader = lambda: load_dcp(Path(request.checkpoint), available)  # noqa: E731
    restored = restore(single, device, loader, progress)
    spec = restored.spec
    digest = _digest(spec.model)
    if request.world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

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


def _shape(size: Any) -> str:
    return "[" + ", ".join(str(d) for d in size) + "]"


def _check_keys(model_sd: Mapping[str, Any], saved: Mapping[str, Any]) -> None:
    """Strict: the checkpoint's model tensors are the model's, with their whole shapes."""
    problems = [f"missing key {k} (model expects {_shape(v.shape)})" for k, v in model_sd.items() if k not in saved]
    problems += [f"shape mismatch for {k}: checkpoint {_shape(saved[k])}, model {_shape(v.shape)}"
                 for k, v in model_sd.items() if k in saved and tuple(saved[k]) != tuple(v.shape)]
    problems += [f"unexpected key {k} {_shape(saved[k])} in the checkpoint" for k in saved if k not in model_sd]
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise DrillFailure("restore", f"checkpoint does not fit the model: {problems[0]}{more}")


def restore_shards(request: RankRequest, device: torch.device, progress: _Progress) -> tuple[DrillSpec, dict[str, Any], dict[str, float]]:
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
    spec = _build(request, extra)
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
            raise DrillFailure("restore", f"optimizer state does not match the factory's optimizer: {first} "
                                          f"({len(missing)} missing, {len(unexpected)} unexpected)")
        for key in wanted:
            have = optim_sd[key]
            if isinstance(have, torch.Tensor) and tuple(have.shape) != tuple(saved_opt[key]):
                raise DrillFailure("restore", f"optimizer state shape mismatch for {key}: checkpoint {_shape(saved_opt[key])}, "
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


# --- training --------------------------------------------------------------------------


def _inner(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def train_ranked(spec: DrillSpec, request: RankRequest, device: torch.device, start: int, progress: _Progress) -> tuple[list[float], dict[str, Any]]:
    """K steps on the same batches as every other rank; per-step losses and
    measurements. A trainable parameter is a problem on this rank when its
    gradient is missing at every step or non-finite at some step; on every
    rank when it was zero everywhere (reduced over the ranks once, at the end)."""
    import torch.distributed as dist

    progress("train")
    _seed(request.seed)
    params = [(n, p) for n, p in _inner(spec.model).named_parameters() if p.requires_grad]
    present = torch.zeros(len(params), dtype=torch.bool)
    nonzero = torch.zeros(len(params), dtype=torch.float32)
    nonfinite = torch.zeros(len(params), dtype=torch.bool)
    losses: list[float] = []
    info: dict[str, Any] = {"optimizer_step_before": _optimizer_steps(spec.optimizer) if spec.optimizer else None}
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
    anywhere = nonzero.to(device)
    if dist.is_initialized() and request.world_size > 1:
        dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
    anywhere = anywhere.to("cpu")
    problems = [f"{n}: no gradient" for j, (n, _) in enumerate(params) if not present[j]]
    problems += [f"{n}: non-finite gradient" for j, (n, _) in enumerate(params) if nonfinite[j]]
    problems += [f"{n}: zero gradient on every rank" for j, (n, _) in enumerate(params)
                 if present[j] and not nonfinite[j] and not anywhere[j]]
    info["grad_problems"] = problems
    every = list(_inner(spec.model).named_parameters())
    info["trainable_params"] = len(params)
    info["frozen_params"] = len(every) - len(params)
    return losses, info


# --- the whole rank ------------------------------------------------------------------------


def run_rank(request: RankRequest) -> RankResult:
    """The drill of one rank; never raises (failures become the result's error)."""
    started = time.perf_counter()
    progress = _Progress(request.progress_path)
    base: dict[str, Any] = {
        "rank": request.rank, "world_size": request.world_size, "checkpoint": request.checkpoint,
        "format": request.format, "steps": request.steps, "backend": request.backend,
        "env_keys": tuple(sorted(os.environ)), "torch_version": torch.__version__,
    }
    try:
        if request.device == "cuda":
            if not torch.cuda.is_available() or torch.cuda.device_count() <= request.rank:
                raise DrillFailure("setup", f"rank {request.rank} needs CUDA device {request.rank}, found "
                                            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}; use --device cpu")
            device = torch.device("cuda", request.rank)
            torch.cuda.set_device(device)
            torch.cuda.reset_peak_memory_stats(device)
        else:
            device = torch.device("cpu")
        base["device"] = str(device)
        torch.use_deterministic_algorithms(True, warn_only=True)
        progress("rendezvous")
        t0 = time.perf_counter()
        _rendezvous(request, device)
        rendezvous_s = time.perf_counter() - t0
        progress("load")
        digest = None
        if request.layout == "sharded":
            base["parallel"] = "fsdp2"
            spec, notes, times = restore_shards(request, device, progress)
            base.update(notes)
        else:
            base["parallel"] = "ddp" if request.world_size > 1 else "none"
            spec, loaded, digest, times = restore_replica(request, device, progress)
            base.update(recorded_loss=loaded.recorded_loss, checkpoint_step=loaded.step,
                        optimizer_loaded=loaded.optimizer_state is not None)
        try:
            losses, info = train_ranked(spec, request, device, base.get("checkpoint_step") or 0, progress)
        except CkptierError:
            raise
        except Exception as exc:  # the user's model failing in forward/backward
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise DrillFailure("train", f"training step failed: {type(exc).__name__}: {first}") from None
        peak, kind = _peak_memory(device)
        progress("done")
        return RankResult(
            **base, losses=tuple(losses), restored_digest=digest,
            optimizer_step_before=info["optimizer_step_before"], optimizer_step_after=info["optimizer_step_after"],
            trainable_params=info["trainable_params"], frozen_params=info["frozen_params"],
            grad_problems=tuple(info["grad_problems"]),
            timings={**times, "rendezvous_s": rendezvous_s, "first_step_s": info["first_step_s"],
                     "first_step_done_at": info["first_step_done_at"], "steps_s": info["steps_s"],
                     "total_s": time.perf_counter() - started},
            peak_memory_bytes=peak, memory_kind=kind,
        )
    except DrillFailure as exc:
        return RankResult(**base, error=str(exc), error_stage=exc.stage, unsafe=exc.unsafe)
    except (CheckpointLoadError, ConfigError) as exc:
        return RankResult(**base, error=str(exc), error_stage=progress.stage, unsafe=isinstance(exc, UnsafeCheckpoint))
    except Exception:
        last = traceback.format_exc().strip().splitlines()[-1]
        return RankResult(**base, error=f"unexpected error in {progress.stage}: {last}", error_stage="crash")


def main(argv: list[str] | None = None) -> int:
    request = read_request(argv, "ckptier.tasks.drill_dist_worker", __doc__ or "", "launch_ranks",
                           RankRequest.from_dict)
    if request is None:
        return 2
    _die_with_parent(request.parent_pid)
    result = run_rank(request)
    write_result(request.result_path, json.dumps(result.to_dict()))
    sys.stdout.flush()
    sys.stderr.flush()
    if result.error is None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        return 0
    os._exit(0)  # other ranks may wait in a collective: never block on the process group's teardown


if __name__ == "__main__":
    sys.exit(main())
