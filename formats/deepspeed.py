"""``deepspeed``: DeepSpeed engine checkpoints (``engine.save_checkpoint``).

Layout (DeepSpeed 0.19, ``DeepSpeedEngine.save_checkpoint``)::

    {save_dir}/latest                                  # the tag of the newest save, e.g. "global_step600"
    {save_dir}/zero_to_fp32.py                         # a helper script DeepSpeed copies in
    {save_dir}/global_step{N}/mp_rank_{MP:02d}_model_states.pt
    {save_dir}/global_step{N}/[bf16_]zero_pp_rank_{DP}_mp_rank_{MP:02d}_optim_states.pt   # ZeRO 1-3
    {save_dir}/global_step{N}/zero_pp_rank_{DP}_mp_rank_{MP:02d}_model_states.pt          # ZeRO 3

The job is ``save_dir``. Commit evidence: the ``latest`` tag, which
DeepSpeed writes after the step's files: a ``global_step{N}`` at or before
the step the tag names is committed; a newer one is a save in flight (or one
that never finished), ``incomplete``. Without a ``latest`` file
(``save_latest=False``) a step commits once unchanged for the Lightning
settle time (60 s by default). Its own file names are its manifest: model
states for every model-parallel rank from 0 to the highest seen, and ZeRO
optimizer states for every data-parallel rank from 0 to the highest seen, on
every model-parallel rank (with ZeRO 3, model states for each of those
ranks too); a gap is a shortfall (``incomplete`` within the job's grace,
``corrupt`` after). The highest data-parallel rank missing on every
model-parallel rank cannot be told from names.

Drills restore one model-parallel rank: ``mp_rank_00_model_states.pt`` (its
``module`` is the model's state dict; without ZeRO its ``optimizer`` is the
optimizer's state dict) and, with ZeRO stage 1 or 2, every data-parallel
rank's ``zero_pp_rank_{DP}_mp_rank_00_optim_states.pt``: their flat fp32
partitions are joined in rank order (the padding DeepSpeed adds sits at the
end of the last) and cut back into per-parameter optimizer state by the
``param_shapes`` the model states record, so a checkpoint of N
data-parallel ranks restores on one (and on any number of DDP ranks).

With ZeRO stage 3 the weights are partitioned too and there is no
``mp_rank_00_model_states.pt``: every data-parallel rank's
``zero_pp_rank_{DP}_mp_rank_00_model_states.pt`` records ``param_shapes``
(one ordered mapping a sub-group), the buffers (in ``module``, whose
weights are empty) and ``global_steps``; its ``..._optim_states.pt`` holds
``fp32_flat_groups`` (a sub-group's fp32 master weights, this rank's share)
and ``optimizer_state_dict`` (the torch optimizer's state over those flat
shares: Adam's ``exp_avg``/``exp_avg_sq`` laid out alike, ``step`` the same
on every rank). Each parameter of ``n`` values is cut into one piece of
``ceil(n / DP)`` a rank, the last piece padded, and a rank's share is its
pieces one after the other (:func:`zero3_slices`): a parameter is its
pieces of ranks 0..DP-1 joined and cut to ``n``, for the weights (the fp32
master copy, bit-exactly the model's at the save) and for each
per-parameter optimizer state alike; so ZeRO 3 of N ranks restores on one
too. The ranks must agree (the step, ``param_shapes``, Adam's ``step``):
files of different saves are an error, as is a rank's file missing. Not
restored yet (a drill says so and does not judge the checkpoint): several
model-parallel ranks (ZeRO 3 or not), ZeRO 3 with frozen parameters,
AutoEP expert partitions, or flat shares of another size than
``param_shapes`` gives (alignment padding of other DeepSpeed versions).

All files load with the safe torch loader (weights only); the DeepSpeed
classes they pickle are read as inert records (:mod:`ckptier.formats.stubs`),
never imported, and nothing of DeepSpeed's runs. A factory is needed, with
the optimizer built as training built it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptier.formats.base import PARTITIONED, FormatPlugin, Group, RankFiles, Scan, names, replicated
from ckptier.formats.stubs import stub_allowlist
from ckptier.storage.records import Format, Shortfall

if TYPE_CHECKING:
    from ckptier.formats.safe_load import LoadedCheckpoint

__all__ = ["PLUGIN", "rank_shortfalls"]

_LATEST = "latest"
_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_ZERO3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^((?:bf16_)?zero_pp_rank_)(\d+)(_mp_rank_)(\d+)(_optim_states\.pt)$")
_TAG_STEP = re.compile(r"^global_step(\d+)$")
_NUMBERING = "DeepSpeed's rank numbering"

#: What DeepSpeed 0.19's ZeRO optimizer files pickle beside the tensors (read in
#: the real files the tests write), each read as an inert record.
LIBRARY_GLOBALS = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": "the static loss scale: a number in its __dict__",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": "the dynamic loss scale and its counters: numbers",
    "deepspeed.runtime.zero.config.ZeroStageEnum": "an IntEnum: the ZeRO stage number",
    "deepspeed.utils.tensor_fragment.fragment_address": "a dataclass of two integers (numel, start)",
}


class DeepSpeedFormat(FormatPlugin):
    format = Format.DEEPSPEED
    metadata_names = frozenset({_LATEST})
    sidecar_names = frozenset({_LATEST, "zero_to_fp32.py", "zero_to_torch.py"})
    why_factory = "a DeepSpeed checkpoint holds tensors only and the model's code is needed"
    library_globals = LIBRARY_GLOBALS

    def anchor(self, key: str, slash: int, up: int) -> str | None:
        if slash > 0 and key.startswith("global_step", up + 1):
            return key[:slash]
        return None

    def recognise(self, group: Group, scan: Scan) -> None:
        prefix, dirname = group.prefix, group.dirname
        m = _TAG_STEP.match(dirname)
        if m is None:
            scan.refuse(prefix + "/", f"{dirname!r} is not global_step<digits>; DeepSpeed tags of other names need a [[pattern]] rule")
            return
        step = int(m.group(1))
        top = group.top()
        job, files = scan.job_of(prefix), group.files
        if not any(_MODEL.match(n) or _ZERO3_MODEL.match(n) for n in top):
            scan.emit(job=job, step=step, fmt=self.format, prefix=prefix, files=files, committed=False,
                      reason="no mp_rank_*_model_states.pt: save in flight or torn")
            return
        short = rank_shortfalls(top)
        latest = scan.sidecar(prefix, _LATEST)
        if latest is None:
            committed, reason = scan.settled(files, scan.lightning_settle, "DeepSpeed checkpoints without a latest tag")
        else:
            tag, problem = scan.read_text(latest, "latest")
            tagged = _TAG_STEP.match(tag)
            if problem is not None:
                committed, reason = False, problem
            elif tag == dirname or (tagged is not None and int(tagged.group(1)) >= step):
                committed, reason = True, f"committed: the latest tag ({tag}) was written after it"
            elif tagged is not None:
                committed, reason = False, f"newer than the latest tag ({tag}): save in flight, or never finished"
            else:
                committed, reason = scan.settled(files, scan.lightning_settle, f"DeepSpeed tag {tag!r}")
        if committed and short:
            reason += f"; rank file(s) missing: {names([str(x) for x in short])}"
        scan.emit(job=job, step=step, fmt=self.format, prefix=prefix, files=files, committed=committed,
                  reason=reason, short=short if committed else ())

    def saved_ranks(self, relpaths: Sequence[str]) -> int:
        if _joinable(relpaths):
            return 1  # ZeRO 1/2 partitions of one model-parallel rank: joined into one replica
        return max(len(_ranks(relpaths)), 1)

    def rank_files(self, relpaths: Sequence[str], read: Callable[[str], bytes], world: int | None = None) -> RankFiles:
        """Rank ``r`` of ``mp * dp`` ranks (model-parallel major): its model
        states and its ZeRO optimizer states. More than one rank is
        ``partitioned`` (model parallelism, or ZeRO's flat optimizer
        partitions); one rank is restored by every drill rank whole."""
        ranks = _ranks(relpaths)
        if len(ranks) <= 1 or _joinable(relpaths):
            return replicated(relpaths, world or 1)
        if world not in (None, len(ranks)):
            raise ValueError(f"{len(ranks)} DeepSpeed ranks (model-parallel or ZeRO partitions) cannot be drilled on {world}")
        held = {f for files in ranks for f in files}
        shared = tuple(r for r in relpaths if r not in held)
        return RankFiles(len(ranks), PARTITIONED, shared, tuple(dict.fromkeys(files) for files in ranks))

    def load(self, path: Path, allow: Sequence[Any]) -> LoadedCheckpoint:
        return _load(path, allow)


PLUGIN = DeepSpeedFormat()


def _joinable(relpaths: Sequence[str]) -> bool:
    """One model-parallel rank's model states and its ZeRO 1/2 optimizer
    partitions, or ZeRO 3 model and optimizer partitions: a drill joins the
    partitions into one replica (ZeRO 3 of several model-parallel ranks is
    refused by the loader, on one rank)."""
    if any(_ZERO3_MODEL.match(r) for r in relpaths):
        return not any(_MODEL.match(r) for r in relpaths)
    models = [r for r in relpaths if _MODEL.match(r)]
    return len(models) == 1 and any(_OPTIM.match(r) for r in relpaths)


def _ranks(relpaths: Sequence[str]) -> list[list[str]]:
    """Each rank's files, model-parallel major: model states, then ZeRO optimizer states."""
    models = {int(m.group(1)): r for r in relpaths if (m := _MODEL.match(r))}
    optims = {(int(m.group(4)), int(m.group(2))): r for r in relpaths if (m := _OPTIM.match(r))}
    if not optims:
        return [[f] for _, f in sorted(models.items())]
    return [[models[mp], f] for (mp, _dp), f in sorted(optims.items()) if mp in models]


def rank_shortfalls(top: Mapping[str, Any]) -> list[Shortfall]:
    """The rank files a ``global_stepN`` directory (file name -> anything)
    lacks by DeepSpeed's own numbering; pure. With ZeRO stage 3 every
    data-parallel rank of every model-parallel rank has model states and
    optimizer states: one without the other is a shortfall."""
    mps = {int(m.group(1)) for n in top if (m := _MODEL.match(n))}
    z3 = {(int(m.group(2)), int(m.group(1))) for n in top if (m := _ZERO3_MODEL.match(n))}
    out: list[Shortfall] = []
    if mps:
        out += [Shortfall(f"mp_rank_{mp:02d}_model_states.pt", _NUMBERING) for mp in range(max(mps) + 1) if mp not in mps]
    if z3:
        ranks = z3 | {(int(m.group(4)), int(m.group(2))) for n in top if (m := _OPTIM.match(n))}
        out += [Shortfall(f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt", _NUMBERING)
                for mp in range(max(mp for mp, _ in ranks) + 1) for dp in range(max(dp for _, dp in ranks) + 1)
                if (mp, dp) not in z3]
    optim: dict[str, set[tuple[int, int]]] = {}
    spelling: dict[str, tuple[str, str, str]] = {}
    for n in top:
        if m := _OPTIM.match(n):
            optim.setdefault(m.group(1), set()).add((int(m.group(4)), int(m.group(2))))
            spelling[m.group(1)] = (m.group(1), m.group(3), m.group(5))
    for kind, seen in optim.items():
        head, mid, tail = spelling[kind]
        width = max(len(m.group(4)) for n in top if (m := _OPTIM.match(n)) and m.group(1) == kind)
        all_mp = range(max(max(mp for mp, _ in seen), max(mps, default=0), max((mp for mp, _ in z3), default=0)) + 1)
        all_dp = range(max(max(dp for _, dp in seen), max((dp for _, dp in z3), default=0)) + 1)
        out += [Shortfall(f"{head}{dp}{mid}{mp:0{width}d}{tail}", _NUMBERING)
                for mp in all_mp for dp in all_dp if (mp, dp) not in seen]
    return sorted(out, key=lambda s: s.relpath)


# -- loading (torch, lazily) ----------------------------------------------------


def _load(path: Path, allow: Sequence[Any]) -> LoadedCheckpoint:
    import torch  # lazy: torch, for drills only

    from ckptier.formats.safe_load import (  # lazy: torch, for drills only
        CheckpointLoadError,
        LoadedCheckpoint,
        UnsupportedCheckpoint,
        float_or_none,
        safe_torch_load,
        unwrap_state,
    )

    ranks = sorted(p.name for p in path.iterdir() if _MODEL.match(p.name))
    if not ranks:
        if any(_ZERO3_MODEL.match(p.name) for p in path.iterdir()):
            return _load_zero3(path, allow)
        raise CheckpointLoadError(f"{path}: no mp_rank_00_model_states.pt; not a DeepSpeed checkpoint")
    if len(ranks) > 1:
        raise UnsupportedCheckpoint(f"{path}: not supported yet: {len(ranks)} model-parallel ranks "
                                    f"({ranks[0]}..{ranks[-1]}); drills restore one rank")
    found = {int(m.group(2)): p for p in path.iterdir() if (m := _OPTIM.match(p.name))}
    optim_files = [found[dp] for dp in sorted(found)]
    if sorted(found) != list(range(len(found))):
        raise CheckpointLoadError(f"{path}: ZeRO optimizer states of data-parallel ranks {sorted(found)}: "
                                  "some rank's file is missing; re-fetch or re-verify the checkpoint")
    full_allow = [*allow, *stub_allowlist(LIBRARY_GLOBALS)]
    states = safe_torch_load(path / ranks[0], extra_allowlist=full_allow)
    if not isinstance(states, Mapping):
        raise CheckpointLoadError(f"{path / ranks[0]}: not DeepSpeed model states (a {type(states).__name__})")
    model = unwrap_state(states, path / ranks[0], ("module",))
    optimizer: Any = states.get("optimizer")
    if optim_files:
        zeros = [safe_torch_load(f, extra_allowlist=full_allow) for f in optim_files]
        zero = zeros[0] if len(zeros) == 1 else _join_partitions(zeros, optim_files, torch, CheckpointLoadError,
                                                                  UnsupportedCheckpoint)
        optimizer = _zero_to_torch(zero, states, optim_files[0], torch, CheckpointLoadError)
    elif optimizer is not None and not (isinstance(optimizer, Mapping) and "state" in optimizer):
        raise CheckpointLoadError(f"{path / ranks[0]}: its optimizer entry is not an Optimizer.state_dict(); "
                                  "fp16 optimizer wrappers are not supported yet")
    extra: dict[str, Any] = {k: v for k, v in states.items() if isinstance(v, (int, float, str, bool))}
    if isinstance(states.get("ds_config"), Mapping):
        extra["ds_config"] = dict(states["ds_config"])
    step = states.get("global_steps") if isinstance(states.get("global_steps"), int) else None
    return LoadedCheckpoint(model, optimizer, extra, "torch", step, float_or_none(states.get("loss")))


def _join_partitions(zeros: Sequence[Any], files: Sequence[Path], torch: Any, error: type[Exception],
                     unsupported: type[Exception]) -> dict[str, Any]:
    """The ZeRO 1/2 optimizer files of N data-parallel ranks (in rank order)
    as one rank's: each group's flat state tensors joined in rank order
    (their ``step`` must agree), ``partition_count`` 1."""
    osds = [z.get("optimizer_state_dict") if isinstance(z, Mapping) else None for z in zeros]
    if not all(isinstance(o, Mapping) and isinstance(o.get("base_optimizer_state"), Mapping) for o in osds):
        raise error(f"{files[0].parent}: a ZeRO optimizer file holds no optimizer_state_dict with base_optimizer_state")
    for o, f in zip(osds, files, strict=True):
        assert isinstance(o, Mapping)
        counts = o.get("partition_count")
        if not isinstance(counts, list) or any(n != len(files) for n in counts):
            raise error(f"{f}: partitioned over {counts} data-parallel ranks, but {len(files)} optimizer files are here")
        if any(any(int(x) for x in (p if isinstance(p, list) else [p])) for p in o.get("param_alignment_paddings") or []):
            raise unsupported(f"{f}: not supported yet: ZeRO partitions with padding between parameters")
    bases = [o["base_optimizer_state"] for o in osds if isinstance(o, Mapping)]
    merged: dict[Any, dict[str, Any]] = {}
    for g, first in bases[0]["state"].items():
        parts = [b["state"].get(g, {}) for b in bases]
        group: dict[str, Any] = {}
        for key, value in first.items():
            if isinstance(value, torch.Tensor) and value.dim() == 1:
                group[key] = torch.cat([p[key] for p in parts])
            else:
                if any(not _same(p.get(key), value, torch) for p in parts):
                    raise error(f"{files[0].parent}: the data-parallel ranks' optimizer states disagree on {key} "
                                f"of group {g}: the ranks saved different steps")
                group[key] = value
        merged[g] = group
    first_osd = osds[0]
    assert isinstance(first_osd, Mapping)
    return {"optimizer_state_dict": {**first_osd, "partition_count": [1] * len(bases[0]["param_groups"]),
                                     "base_optimizer_state": {"state": merged,
                                                              "param_groups": bases[0]["param_groups"]}}}


def _same(a: Any, b: Any, torch: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return bool(a.shape == b.shape and torch.equal(a, b))
    return bool(a == b)


def _zero_to_torch(zero: Any, states: Mapping[str, Any], where: Path, torch: Any, error: type[Exception]) -> dict[str, Any]:
    """A ZeRO stage 1/2 optimizer file of one data-parallel rank as
    ``Optimizer.state_dict()``: each group's flat state cut into its
    parameters by ``param_shapes`` (parameters in group order, padding after)."""
    osd = zero.get("optimizer_state_dict") if isinstance(zero, Mapping) else None
    base = osd.get("base_optimizer_state") if isinstance(osd, Mapping) else None
    shapes = states.get("param_shapes")
    if not (isinstance(base, Mapping) and isinstance(base.get("state"), Mapping) and isinstance(base.get("param_groups"), list)):
        raise error(f"{where}: no base_optimizer_state with state and param_groups; not a ZeRO stage 1/2 optimizer file")
    partitions = osd.get("partition_count") if isinstance(osd, Mapping) else None
    if isinstance(partitions, list) and any(isinstance(n, int) and n > 1 for n in partitions):
        raise error(f"{where}: not supported yet: partitioned over {max(partitions)} data-parallel ranks; drills restore one rank")
    if not isinstance(shapes, list) or len(shapes) != len(base["param_groups"]):
        raise error(f"{where}: the model states record no param_shapes for its {len(base['param_groups'])} group(s); "
                    "cannot cut the flat optimizer state into parameters")
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    pid = 0
    for g, (group, group_shapes) in enumerate(zip(base["param_groups"], shapes, strict=True)):
        flat = base["state"].get(g, {})
        total = sum(int(torch.Size(s).numel()) for s in group_shapes.values())
        ids: list[int] = []
        offset = 0
        for shape in group_shapes.values():
            n = int(torch.Size(shape).numel())
            per: dict[str, Any] = {}
            for key, value in flat.items():
                if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() >= total:
                    per[key] = value[offset : offset + n].view(tuple(shape)).clone()
                else:
                    per[key] = value.clone() if isinstance(value, torch.Tensor) else value
            if per:
                state[pid] = per
            ids.append(pid)
            pid += 1
            offset += n
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


# -- ZeRO stage 3 ----------------------------------------------------------------


def zero3_slices(shapes: Sequence[Sequence[int]], world: int) -> tuple[list[tuple[int, int, int]], int]:
    """Where each parameter sits in one data-parallel rank's ZeRO-3 flat
    partition of a sub-group, for parameters of ``shapes`` (in the order
    ``param_shapes`` lists them) over ``world`` ranks; pure.

    DeepSpeed ZeRO-3 cuts every parameter of ``n`` values into ``world``
    equal pieces of ``ceil(n / world)`` (the last padded at its end) and
    rank ``r`` holds piece ``r`` of each, one after the other. Returns
    ``([(offset, piece, n), ...], per_rank_length)``: the full parameter is
    the pieces at ``offset`` of ranks 0..world-1, joined, cut to ``n``.
    """
    out: list[tuple[int, int, int]] = []
    offset = 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= int(d)
        piece = -(-n // world)
        out.append((offset, piece, n))
        offset += piece
    return out, offset


def _value(x: Any) -> Any:
    """An enum stub's value (``ZeroStageEnum``), else ``x``."""
    return getattr(x, "value", x)


def _load_zero3(path: Path, allow: Sequence[Any]) -> LoadedCheckpoint:
    """A ZeRO stage 3 checkpoint of one model-parallel rank, restored on one:
    every data-parallel rank's ``zero_pp_rank_{DP}_mp_rank_00_model_states.pt``
    (``param_shapes`` per sub-group, buffers in ``module``, the weights there
    empty) and ``..._optim_states.pt`` (``fp32_flat_groups``: the rank's fp32
    pieces of each sub-group's parameters; ``optimizer_state_dict``: the
    torch optimizer's state over those flat pieces, one sub-group a
    parameter). Weights and per-parameter optimizer state are reassembled
    by :func:`zero3_slices`.

    Raises :class:`UnsupportedCheckpoint` for what this reader does not
    understand (several model-parallel ranks, frozen parameters, AutoEP
    expert partitions, flat partitions of other sizes than ``param_shapes``
    gives); :class:`CheckpointLoadError` for files that cannot restore (a
    rank's file missing, ranks of different saves, not ZeRO-3 files)."""
    import torch  # lazy: torch, for drills only

    from ckptier.formats.safe_load import (  # lazy: torch, for drills only
        CheckpointLoadError,
        LoadedCheckpoint,
        UnsupportedCheckpoint,
        float_or_none,
    )

    models = {(int(m.group(2)), int(m.group(1))): p for p in path.iterdir() if (m := _ZERO3_MODEL.match(p.name))}
    optims = {(int(m.group(4)), int(m.group(2))): p for p in path.iterdir() if (m := _OPTIM.match(p.name))}
    mps = sorted({mp for mp, _ in [*models, *optims]})
    if mps != [0]:
        raise UnsupportedCheckpoint(f"{path}: not supported yet: ZeRO stage 3 over {len(mps)} model-parallel ranks "
                                    f"(mp_rank {', '.join(f'{mp:02d}' for mp in mps)}); drills restore one")
    world = max(dp for _, dp in [*models, *optims]) + 1
    missing = [f"zero_pp_rank_{dp}_mp_rank_00_{kind}_states.pt" for dp in range(world)
               for kind, have in (("model", models), ("optim", optims)) if (0, dp) not in have]
    if missing:
        raise CheckpointLoadError(f"{path}: ZeRO stage 3 of {world} data-parallel ranks lacks {names(missing)}; every rank's "
                                  "model and optimizer states are needed: re-fetch or re-verify the checkpoint")
    full_allow = [*allow, *stub_allowlist(LIBRARY_GLOBALS)]
    model_files = [models[(0, dp)] for dp in range(world)]
    optim_files = [optims[(0, dp)] for dp in range(world)]
    first, shapes = _zero3_model_states(model_files, world, full_allow)
    layout = [zero3_slices([shape for _, shape in group], world) for group in shapes]
    flats, bases = _zero3_optim_states(optim_files, world, layout, full_allow)

    def whole(pieces: Sequence[Any], s: int) -> list[Any]:
        """Sub-group ``s``'s parameters, each joined from the ranks' ``pieces``."""
        return [torch.cat([p[off : off + piece] for p in pieces])[:n].reshape(shape).clone()
                for (off, piece, n), (_, shape) in zip(layout[s][0], shapes[s], strict=True)]

    params = {name: t for s in range(len(layout)) for (name, _), t in zip(shapes[s], whole([f[s] for f in flats], s),
                                                                            strict=True)}
    module, buffers = first["module"], set(first.get("buffer_names") or ())
    shared = {str(k): str(v) for k, v in (first.get("shared_params") or {}).items()}
    model: dict[str, Any] = {}
    for key, value in module.items():
        if key in params:
            model[key] = params[key]
        elif key in buffers and isinstance(value, torch.Tensor):
            model[key] = value
        elif shared.get(key) in params:
            model[key] = params[shared[key]]
        else:
            raise UnsupportedCheckpoint(f"{model_files[0]}: not supported yet: module entry {key!r} is neither in "
                                        "param_shapes, a buffer nor a shared parameter")
    model.update((k, v) for k, v in params.items() if k not in model)
    optimizer = _zero3_optimizer(bases, optim_files, layout, whole, torch, CheckpointLoadError, UnsupportedCheckpoint)
    extra: dict[str, Any] = {k: v for k, v in first.items() if isinstance(v, (int, float, str, bool))}
    if isinstance(first.get("ds_config"), Mapping):
        extra["ds_config"] = dict(first["ds_config"])
    step = first.get("global_steps") if isinstance(first.get("global_steps"), int) else None
    return LoadedCheckpoint(model, optimizer, extra, "torch", step, float_or_none(first.get("loss")))


_Shapes = list[list[tuple[str, tuple[int, ...]]]]


def _zero3_model_states(files: Sequence[Path], world: int, allow: Sequence[Any]) -> tuple[Mapping[str, Any], _Shapes]:
    """Rank 0's ZeRO-3 model states and their ``param_shapes`` (per
    sub-group: ``(name, shape)`` in order), once every rank's agree."""
    from ckptier.formats.safe_load import CheckpointLoadError, UnsupportedCheckpoint, safe_torch_load  # lazy: torch

    states: list[Mapping[str, Any]] = []
    shapes: list[_Shapes] = []
    for f in files:
        st = safe_torch_load(f, extra_allowlist=allow)
        if not (isinstance(st, Mapping) and isinstance(st.get("param_shapes"), list) and isinstance(st.get("module"), Mapping)):
            raise CheckpointLoadError(f"{f}: not ZeRO stage 3 model states (no module and param_shapes)")
        if st.get("frozen_param_shapes") or st.get("ds_autoep_layers") or st.get("autoep_layers"):
            what = "frozen parameters" if st.get("frozen_param_shapes") else "AutoEP expert partitions"
            raise UnsupportedCheckpoint(f"{f}: not supported yet: ZeRO stage 3 with {what}")
        if st.get("mp_world_size", 1) != 1:
            raise UnsupportedCheckpoint(f"{f}: not supported yet: ZeRO stage 3 over {st['mp_world_size']} model-parallel "
                                        "ranks; drills restore one")
        if st.get("dp_world_size", world) != world:
            raise CheckpointLoadError(f"{f}: saved by {st['dp_world_size']} data-parallel ranks, but {world} ranks' files "
                                      "are here: re-fetch or re-verify the checkpoint")
        try:
            shapes.append([[(str(k), tuple(int(d) for d in v)) for k, v in g.items()] for g in st["param_shapes"]])
        except (AttributeError, TypeError, ValueError):
            raise UnsupportedCheckpoint(f"{f}: not supported yet: param_shapes is not a list of name -> shape "
                                        "mappings") from None
        if states and st.get("global_steps") != states[0].get("global_steps"):
            raise CheckpointLoadError(f"{f}: of step {st.get('global_steps')}, but {files[0].name} of step "
                                      f"{states[0].get('global_steps')}: the ranks' files are of different saves")
        if shapes[-1] != shapes[0]:
            raise CheckpointLoadError(f"{f}: its param_shapes differ from {files[0].name}'s: the ranks' files "
                                      "are of different models or saves")
        states.append(st)
    return states[0], shapes[0]


def _zero3_optim_states(files: Sequence[Path], world: int, layout: Sequence[tuple[list[Any], int]],
                        allow: Sequence[Any]) -> tuple[list[list[Any]], list[Mapping[str, Any]]]:
    """Each rank's ``fp32_flat_groups`` and torch optimizer state, once each
    file is a ZeRO-3 optimizer file of ``world`` ranks whose flat shares have
    the sizes ``layout`` (:func:`zero3_slices` per sub-group) gives."""
    import torch  # lazy: torch, for drills only

    from ckptier.formats.safe_load import CheckpointLoadError, UnsupportedCheckpoint, safe_torch_load  # lazy: torch

    flats: list[list[Any]] = []
    bases: list[Mapping[str, Any]] = []
    for f in files:
        zero = safe_torch_load(f, extra_allowlist=allow)
        osd = zero.get("optimizer_state_dict") if isinstance(zero, Mapping) else None
        if not (isinstance(osd, Mapping) and _value(osd.get("zero_stage")) == 3 and isinstance(osd.get("fp32_flat_groups"), list)):
            raise CheckpointLoadError(f"{f}: not a ZeRO stage 3 optimizer file (no zero_stage 3 with fp32_flat_groups)")
        counts = osd.get("partition_count")
        if any(n != world for n in (counts if isinstance(counts, list) else [counts])):
            raise CheckpointLoadError(f"{f}: partitioned over {counts} data-parallel ranks, but {world} ranks' files are here")
        if osd.get("ds_zero_partition_groups"):
            raise UnsupportedCheckpoint(f"{f}: not supported yet: ZeRO stage 3 with sub-groups partitioned over other "
                                        "process groups (ds_zero_partition_groups)")
        group_flats = osd["fp32_flat_groups"]
        if len(group_flats) != len(layout):
            raise UnsupportedCheckpoint(f"{f}: not supported yet: {len(group_flats)} fp32 flat group(s) for the "
                                        f"{len(layout)} sub-group(s) of param_shapes")
        for s, (flat, (_, length)) in enumerate(zip(group_flats, layout, strict=True)):
            if not (isinstance(flat, torch.Tensor) and flat.dim() == 1 and flat.numel() == length):
                found = f"{flat.numel()} values" if isinstance(flat, torch.Tensor) else f"a {type(flat).__name__}"
                raise UnsupportedCheckpoint(f"{f}: not supported yet: fp32 flat group {s} holds {found}, where "
                                            f"param_shapes' pieces over {world} ranks take {length}")
        base = osd.get("optimizer_state_dict")
        if not (isinstance(base, Mapping) and isinstance(base.get("state"), Mapping)
                and isinstance(base.get("param_groups"), list)):
            raise CheckpointLoadError(f"{f}: its optimizer_state_dict has no state and param_groups")
        flats.append(group_flats)
        bases.append(base)
    return flats, bases


def _zero3_optimizer(bases: Sequence[Mapping[str, Any]], files: Sequence[Path], layout: Sequence[tuple[list[Any], int]],
                     whole: Callable[[Sequence[Any], int], list[Any]], torch: Any, error: type[Exception],
                     unsupported: type[Exception]) -> dict[str, Any]:
    """The ranks' ZeRO-3 optimizer states (one entry a sub-group, over the
    rank's flat pieces) as one ``Optimizer.state_dict()`` of whole
    parameters: a flat tensor of the rank's sub-group length is joined by
    ``whole``; anything else (Adam's ``step``) must agree over the ranks."""
    groups = bases[0]["param_groups"]
    for base, f in zip(bases[1:], files[1:], strict=False):
        if [g.get("params") for g in base["param_groups"]] != [g.get("params") for g in groups]:
            raise error(f"{f}: its optimizer's param_groups differ from {files[0].name}'s: the ranks' files are of "
                        "different saves")
    ids = [s for g in groups for s in g.get("params", [])]
    if sorted(ids) != list(range(len(layout))):
        raise unsupported(f"{files[0]}: not supported yet: the optimizer's param_groups hold sub-groups {ids}, "
                          f"param_shapes {len(layout)}")
    state: dict[int, dict[str, Any]] = {}
    out_groups: list[dict[str, Any]] = []
    pid = 0
    for group in groups:
        pids: list[int] = []
        for s in group["params"]:
            parts = [b["state"].get(s, {}) for b in bases]
            per: list[dict[str, Any]] = [{} for _ in layout[s][0]]
            for key, value in parts[0].items():
                if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == layout[s][1]:
                    if any(not (isinstance(p.get(key), torch.Tensor) and p[key].shape == value.shape) for p in parts):
                        raise error(f"{files[0].parent}: the data-parallel ranks' {key} of sub-group {s} differ in size")
                    for d, t in zip(per, whole([p[key] for p in parts], s), strict=True):
                        d[key] = t
                elif isinstance(value, torch.Tensor) and value.dim() > 0:
                    raise unsupported(f"{files[0]}: not supported yet: optimizer state {key} of sub-group {s} holds "
                                      f"{value.numel()} values, where its flat piece holds {layout[s][1]}")
                else:
                    if any(not _same(p.get(key), value, torch) for p in parts):
                        raise error(f"{files[0].parent}: the data-parallel ranks' optimizer states disagree on {key} "
                                    f"of sub-group {s}: the ranks saved different steps")
                    for d in per:
                        d[key] = value.clone() if isinstance(value, torch.Tensor) else value
            for d in per:
                if d:
                    state[pid] = d
                pids.append(pid)
                pid += 1
        out_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": pids})
    return {"state": state, "param_groups": out_groups}
