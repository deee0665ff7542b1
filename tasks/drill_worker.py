"""The restore drill, inside its isolated subprocess.

``python -m ckptier.tasks.drill_worker --request request.json`` reads a
:class:`~ckptier.tasks.drill.DrillRequest`, restores the checkpoint into the
model from the factory, trains K steps twice from a fresh restore each time,
and writes a :class:`~ckptier.tasks.drill.WorkerResult` as JSON to the
request's ``result_path`` (written whole, then renamed) and to stdout. It
exits 0 whenever it could write a result, including a failed drill; the
verdict is the parent's (``judge``).

Run only through ``run_drill_subprocess``: it gives this process no
credentials, a scratch directory of its own, and, where the kernel offers
Landlock, starts it already unable to change any file outside that directory
(``ckptier.tasks.confine``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from ckptier.storage.errors import CkptierError, ConfigError
from ckptier.tasks.drill import DrillRequest, WorkerResult
from ckptier.tasks.drill_models import DrillSpec, build_spec, hf_spec, resolve_factory, train_step, trainer_optimizer
from ckptier.formats.registry import plugin
from ckptier.formats.safe_load import LoadedCheckpoint, UnsafeCheckpoint, load_checkpoint_dir


class DrillFailure(CkptierError):
    """A drill stage failed in a way the verdict should report (not a crash)."""

    def __init__(self, stage: str, message: str, *, unsafe: bool = False) -> None:
        super().__init__(message)
        self.stage = stage
        self.unsafe = unsafe


R = TypeVar("R")


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; ``cuda`` without a GPU fails."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DrillFailure("setup", f"drill device {name!r} asked for, but no CUDA device is available here; use --device cpu or auto")
    return torch.device(name)


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


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(d) for d in t.shape) + "]"


def state_dict_problems(expected: Mapping[str, torch.Tensor], loaded: Mapping[str, torch.Tensor]) -> list[str]:
    """Why ``loaded`` cannot be loaded strictly into a model whose state dict
    is ``expected``; empty when it can.

    A missing key is forgiven when it is tied to (shares storage with) a
    present key, since tied weights are often stored once.
    """
    problems: list[str] = []
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
            raise DrillFailure("restore", f"optimizer state does not match the factory's optimizer: {first} ({len(missing)} missing, {len(unexpected)} unexpected)")
        for key in wanted:
            src, dst = loaded.optimizer_state[key], template[key]
            if isinstance(dst, torch.Tensor) and tuple(src.shape) != tuple(dst.shape):
                raise DrillFailure("restore", f"optimizer state shape mismatch for {key}: checkpoint {_shape(src)}, optimizer {_shape(dst)}")
            template[key] = src
        set_optimizer_state_dict(spec.model, spec.optimizer, template, options=options)
        return
    state = loaded.optimizer_state
    if not isinstance(state, Mapping) or "state" not in state or "param_groups" not in state:
        raise DrillFailure("restore", "optimizer state is not an Optimizer.state_dict() (needs 'state' and 'param_groups')")
    own = spec.optimizer.state_dict()
    if len(own["param_groups"]) != len(state["param_groups"]):
        raise DrillFailure("restore", f"optimizer has {len(own['param_groups'])} param groups, checkpoint {len(state['param_groups'])}; build the optimizer as training did")
    for i, (mine, theirs) in enumerate(zip(own["param_groups"], state["param_groups"], strict=True)):
        if len(mine["params"]) != len(theirs["params"]):
            raise DrillFailure("restore", f"optimizer param group {i} has {len(mine['params'])} parameters, checkpoint {len(theirs['params'])}; build the optimizer as training did")
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
    told each stage (``load``, ``build``, ``restore``) as it starts."""
    progress("load")
    t0 = time.perf_counter()
    try:
        if load is not None:
            loaded = load()
        else:
            loaded = load_checkpoint_dir(request.checkpoint, request.format, extra_allowlist=request.allow_globals)
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
            spec = build_spec(factory, loaded.extra, name=request.factory or "factory")
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
        raise DrillFailure("restore", f"checkpoint does not fit the model: {problems[0]}{more}")
    spec.model.load_state_dict(loaded.model_state, strict=False)  # strictness checked above (tied weights)
    spec.model.to(device)
    spec.model.train()
    if loaded.optimizer_state is not None:
        _load_optimizer(spec, loaded)
    t3 = time.perf_counter()
    return _Restored(spec, loaded, t1 - t0, t2 - t1, t3 - t2)


def _grad_status(model: nn.Module, seen_nonzero: dict[str, bool], nonfinite: dict[str, bool]) -> None:
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        grad = param.grad
        if grad is None:
            seen_nonzero.setdefault(name, False)
            continue
        if not bool(torch.isfinite(grad).all()):
            nonfinite[name] = True
        seen_nonzero[name] = seen_nonzero.get(name, False) or bool((grad != 0).any())


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def train(restored: _Restored, request: DrillRequest, device: torch.device) -> tuple[list[float], dict[str, Any]]:
    """K steps from the restored state; per-step losses and measurements."""
    spec, start = restored.spec, restored.loaded.step or 0
    _seed(request.seed)
    seen_nonzero: dict[str, bool] = {}
    nonfinite: dict[str, bool] = {}
    losses: list[float] = []
    info: dict[str, Any] = {"optimizer_step_before": _optimizer_steps(spec.optimizer) if spec.optimizer else None}
    t0 = time.perf_counter()
    for i in range(request.steps):
        loss = train_step(spec, start + i + 1, device)
        losses.append(float(loss))
        if i == 0:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            info["first_step_s"] = time.perf_counter() - t0
            info["first_step_done_at"] = time.time()
        _grad_status(spec.model, seen_nonzero, nonfinite)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    info["steps_s"] = time.perf_counter() - t0
    info["optimizer_step_after"] = _optimizer_steps(spec.optimizer) if spec.optimizer else None
    problems = [f"{n}: no gradient" for n, ok in seen_nonzero.items() if not ok and n not in nonfinite]
    problems += [f"{n}: non-finite gradient" for n in nonfinite]
    info["grad_problems"] = problems
    params = list(spec.model.named_parameters())
    info["trainable_params"] = sum(1 for _, p in params if p.requires_grad)
    info["frozen_params"] = len(params) - info["trainable_params"]
    return losses, info


def _guarded_train(restored: _Restored, request: DrillRequest, device: torch.device) -> tuple[list[float], dict[str, Any]]:
    try:
        return train(restored, request, device)
    except CkptierError:
        raise
    except Exception as exc:  # the user's model failing in forward/backward
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise DrillFailure("train", f"training step failed: {type(exc).__name__}: {first}") from None


def _peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "rss"


def run_request(request: DrillRequest) -> WorkerResult:
    """The whole drill; never raises (failures become the result's error)."""
    started = time.perf_counter()
    base: dict[str, Any] = {
        "checkpoint": request.checkpoint,
        "format": request.format,
        "steps": request.steps,
        "env_keys": tuple(sorted(os.environ)),
        "torch_version": torch.__version__,
    }
    device: torch.device | None = None
    try:
        device = resolve_device(request.device)
        base["device"] = str(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        torch.use_deterministic_algorithms(True, warn_only=True)
        first = restore(request, device)
        base.update(
            recorded_loss=first.loaded.recorded_loss,
            checkpoint_step=first.loaded.step,
            optimizer_loaded=first.loaded.optimizer_state is not None,
            also_loaded=tuple(first.loaded.also_loaded),
        )
        losses, info = _guarded_train(first, request, device)
        del first
        again = restore(request, device)
        losses_repeat, _ = _guarded_train(again, request, device)
        peak, kind = _peak_memory(device)
        timings = {
            "load_s": again.load_s,
            "build_s": again.build_s,
            "restore_s": again.restore_s,
            "first_step_s": info["first_step_s"],
            "first_step_done_at": info["first_step_done_at"],
            "steps_s": info["steps_s"],
            "total_s": time.perf_counter() - started,
        }
        return WorkerResult(
            **base,
            losses=tuple(losses),
            losses_repeat=tuple(losses_repeat),
            optimizer_step_before=info["optimizer_step_before"],
            optimizer_step_after=info["optimizer_step_after"],
            trainable_params=info["trainable_params"],
            frozen_params=info["frozen_params"],
            grad_problems=tuple(info["grad_problems"]),
            timings=timings,
            peak_memory_bytes=peak,
            memory_kind=kind,
        )
    except DrillFailure as exc:
        return WorkerResult(**base, error=str(exc), error_stage=exc.stage, unsafe=exc.unsafe)
    except Exception:
        last = traceback.format_exc().strip().splitlines()[-1]
        return WorkerResult(**base, error=f"unexpected error: {last}", error_stage="crash")


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
    request = read_request(argv, "ckptier.tasks.drill_worker", __doc__ or "", "run_drill_subprocess",
                           DrillRequest.from_dict)
    if request is None:
        return 2
    result = run_request(request)
    text = json.dumps(result.to_dict())
    write_result(request.result_path, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
