"""``megatron``: Megatron-LM checkpoints, legacy per-rank files and ``torch_dist``.

Layout (Megatron-LM ``megatron/training/checkpointing.py``:
``get_checkpoint_name``, ``save_checkpoint``, ``generate_state_dict``, read
at commit 0032978f of NVIDIA/Megatron-LM)::

    {save}/latest_checkpointed_iteration.txt            # the tracker: "600" (or "release")
    {save}/iter_{N:07d}/mp_rank_{TP:02d}/model_optim_rng.pt            # legacy, no pipeline parallelism
    {save}/iter_{N:07d}/mp_rank_{TP:02d}_{PP:03d}/model_optim_rng.pt   # legacy, with pipeline ranks
    {save}/iter_{N:07d}/mp_rank_{TP:02d}_{PP:03d}_{EP:03d}/...         # legacy, with expert ranks
    {save}/iter_{N:07d}/mp_rank_.../distrib_optim.pt                   # legacy, distributed optimizer
    {save}/iter_{N:07d}/.metadata, __{R}_{K}.distcp, common.pt, metadata.json   # torch_dist (DCP)

The job is ``save``. Commit evidence: the tracker, which rank 0 writes after
every rank saved (a barrier first): an iteration at or before the one it
names is committed, a newer one is a save in flight (``incomplete``).
Without a tracker an iteration commits once unchanged for the Lightning
settle time (60 s by default). A ``torch_dist`` iteration also needs DCP's
evidence (:func:`ckptier.formats.dcp.dcp_commit`: ``.metadata`` and every
shard it references) and Megatron's ``metadata.json`` (written last, by
``save_config``). A legacy iteration's rank directories are its manifest:
every tensor rank from 0 to the highest seen, times every pipeline (and
expert) rank likewise, each with ``model_optim_rng.pt`` (and
``distrib_optim.pt`` when any has one); a gap is a shortfall.

Drills restore one rank of a legacy checkpoint: ``model_optim_rng.pt`` holds
``args`` (an ``argparse.Namespace``, allowed as the reviewed plain class it
is), ``iteration``, ``model`` (its state dict, flattened when nested as in
the legacy ``language_model`` models; non-tensor entries such as
``_extra_state`` are left out), ``optimizer`` (``Optimizer.state_dict()``,
or wrapped under ``optimizer`` by the fp16/bf16 optimizer), ``rng_state``
(the drill continues its Python, numpy and CPU streams: :func:`megatron_rng`).
Megatron enums that ``args`` may hold are read as inert records. A
``torch_dist`` iteration restores its model tensors through the safe DCP
reader, whole (DCP's metadata has the global shapes, so tensor- and
pipeline-parallel shards come back as one tensor each), and in the module
names of a model built on one rank (:func:`torch_dist_modules`); no
optimizer state (Megatron shards it its own way): the drill's optimizer
starts fresh and says so. A factory is needed, with the optimizer's
parameter groups built as Megatron built them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptier.formats.base import PARTITIONED, FormatPlugin, Group, RankFiles, Scan, names
from ckptier.formats.dcp import dcp_checker, dcp_commit, load_dcp_tensors
from ckptier.formats.stubs import stub_allowlist
from ckptier.storage.records import Format, Shortfall
from ckptier.storage.structure import Checker

if TYPE_CHECKING:
    from ckptier.formats.safe_load import LoadedCheckpoint

__all__ = ["PLUGIN", "legacy_shortfalls", "megatron_rng", "torch_dist_modules"]

TRACKER = "latest_checkpointed_iteration.txt"
_ITER = re.compile(r"^iter_(\d+)$")
_RANK_DIR = re.compile(r"^mp_rank_(\d+)(?:_(\d+))?(?:_(\d+))?$")
_FILE = "model_optim_rng.pt"
_DIST_OPTIM = "distrib_optim.pt"
_NUMBERING = "Megatron's rank directories"

#: Megatron enums ``args`` may hold (argparse converts the option to the enum).
LIBRARY_GLOBALS = {
    "megatron.core.transformer.enums.AttnBackend": "an Enum: the attention backend's name",
    "megatron.core.transformer.enums.AttnMaskType": "an Enum: the attention mask kind",
    "megatron.core.enums.ModelType": "an Enum: encoder/decoder kind",
}


class MegatronFormat(FormatPlugin):
    format = Format.MEGATRON
    metadata_names = frozenset({".metadata", TRACKER})
    sidecar_names = frozenset({TRACKER, "progress.txt"})
    why_factory = "a Megatron checkpoint holds tensors only and the model's code is needed"
    library_globals = LIBRARY_GLOBALS

    def anchor(self, key: str, slash: int, up: int) -> str | None:
        if slash <= 0:
            return None
        if key.startswith("iter_", up + 1):
            return key[:slash]
        if up > 0 and key.startswith("mp_rank_", up + 1) and key.startswith("iter_", key.rfind("/", 0, up) + 1):
            return key[:up]
        return None

    def recognise(self, group: Group, scan: Scan) -> None:
        prefix, dirname = group.prefix, group.dirname
        m = _ITER.match(dirname)
        if m is None:
            scan.refuse(prefix + "/", f"{dirname!r}: expected iter_<digits> (Megatron's iter_{{N:07d}})")
            return
        step = int(m.group(1))
        top = group.top()
        job, files = scan.job_of(prefix), group.files
        short: list[Shortfall] = []
        if ".metadata" in top or any(n.endswith(".distcp") for n in top):
            committed, reason, short = dcp_commit(group, scan, top, "committed (torch_dist)")
            if committed and "metadata.json" not in top:
                committed, reason = False, "torch_dist shards without Megatron's metadata.json (written last): save in flight or torn"
        else:
            rel = [group.relpath(f) for f in files]
            if not any(r.endswith("/" + _FILE) for r in rel):
                if not any(r.startswith("mp_rank_") for r in rel):
                    for f in files:
                        scan.unclaimed(f)
                    return
                scan.emit(job=job, step=step, fmt=self.format, prefix=prefix, files=files, committed=False,
                          reason=f"no mp_rank_*/{_FILE}: save in flight or torn")
                return
            committed, reason = True, "committed"
            short = legacy_shortfalls(rel)
        if committed:
            committed, reason = self._tracked(group, scan, step, reason)
        if committed and short:
            reason += f"; rank file(s) missing: {names([str(x) for x in short])}"
        scan.emit(job=job, step=step, fmt=self.format, prefix=prefix, files=files, committed=committed,
                  reason=reason, short=short if committed else ())

    @staticmethod
    def _tracked(group: Group, scan: Scan, step: int, evidence: str) -> tuple[bool, str]:
        tracker = scan.sidecar(group.prefix, TRACKER)
        if tracker is None:
            ok, why = scan.settled(group.files, scan.lightning_settle, f"Megatron checkpoints without {TRACKER}")
            return ok, why if not ok else f"{evidence}; {why.removeprefix('committed: ')}"
        text, problem = scan.read_text(tracker, TRACKER)
        if problem is not None:
            return False, problem
        if text == "release" or not (text.isascii() and text.isdigit()):
            return False, f"{TRACKER} says {text[:40]!r}, not an iteration; ckptier does not guess which save is whole"
        if int(text) >= step:
            return True, f"{evidence}: {TRACKER} ({int(text)}) was written after it"
        return False, f"newer than {TRACKER} ({int(text)}): save in flight, or never finished"

    def checker(self, relpath: str, name: str, base: str) -> Checker | None:
        return dcp_checker(relpath, name, base)

    def saved_ranks(self, relpaths: Sequence[str]) -> int:
        return max(len(_rank_dirs(relpaths)), 1)

    def rank_files(self, relpaths: Sequence[str], read: Callable[[str], bytes], world: int | None = None) -> RankFiles:
        """Rank ``r`` of a legacy checkpoint: its rank directory's files, in
        (tensor, pipeline, expert) order; more than one is ``partitioned``.
        A torch_dist one, or one rank, is restored by every drill rank whole."""
        dirs = _rank_dirs(relpaths)
        if len(dirs) <= 1:
            return super().rank_files(relpaths, read, world)
        if world not in (None, len(dirs)):
            raise ValueError(f"{len(dirs)} Megatron tensor/pipeline ranks cannot be drilled on {world}")
        shared = tuple(r for r in relpaths if "/" not in r)
        return RankFiles(len(dirs), PARTITIONED, shared, tuple(dict.fromkeys(files) for files in dirs))

    def load(self, path: Path, allow: Sequence[Any]) -> LoadedCheckpoint:
        return _load(path, allow)


PLUGIN = MegatronFormat()


def _rank_dirs(relpaths: Sequence[str]) -> list[list[str]]:
    """The files of each legacy rank directory, in (tensor, pipeline, expert) order."""
    dirs: dict[str, list[str]] = {}
    for rel in relpaths:
        head, sep, _ = rel.partition("/")
        if sep and _RANK_DIR.match(head):
            dirs.setdefault(head, []).append(rel)
    return [sorted(dirs[d]) for d in sorted(dirs, key=_rank_key)]


def _rank_key(name: str) -> tuple[int, int, int]:
    m = _RANK_DIR.match(name)
    assert m is not None
    return (int(m.group(1)), int(m.group(2) or 0), int(m.group(3) or 0))


def legacy_shortfalls(relpaths: Sequence[str]) -> list[Shortfall]:
    """The rank files a legacy ``iter_N`` directory (its files' relpaths)
    lacks by Megatron's own numbering; pure."""
    dirs: dict[str, set[str]] = {}
    for rel in relpaths:
        head, _, rest = rel.partition("/")
        if rest and _RANK_DIR.match(head):
            dirs.setdefault(head, set()).add(rest)
    if not dirs:
        return []
    ranks = {_rank_key(d): d for d in dirs}
    sample = next(iter(dirs))
    m = _RANK_DIR.match(sample)
    assert m is not None
    parts = 1 + (m.group(2) is not None) + (m.group(3) is not None)
    tops = [max(k[i] for k in ranks) for i in range(3)]
    out: list[Shortfall] = []
    wanted = {_FILE} | ({_DIST_OPTIM} if any(_DIST_OPTIM in files for files in dirs.values()) else set())
    for tp in range(tops[0] + 1):
        for pp in range(tops[1] + 1):
            for ep in range(tops[2] + 1):
                name = f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if parts > 1 else "") + (f"_{ep:03d}" if parts > 2 else "")
                have = dirs.get(name, set())
                out += [Shortfall(f"{name}/{f}", _NUMBERING) for f in sorted(wanted - have)]
    return out


#: megatron-core's local layer spec saves its layer norms under Transformer
#: Engine's names (the spec's ``sharded_state_dict_keys_map``): checkpoint
#: name prefix -> the module's own, within one transformer layer.
TE_LAYER_NORMS = {
    "self_attention.linear_qkv.layer_norm_": "input_layernorm.",
    "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm.",
}
_STACKED = re.compile(r"^((?:.*\.)?(?:decoder|encoder)\.layers\.)(?!\d+\.)(.+)$")


def torch_dist_modules(tensors: Mapping[str, Any], layer_norms: Mapping[str, str] = TE_LAYER_NORMS) -> dict[str, Any]:
    """A torch_dist checkpoint's model tensors under the state-dict names of
    the same model built on one rank; pure (any value with ``shape`` and
    ``value[i]``).

    megatron-core saves a transformer block's layers as one tensor per
    parameter with the layer as its first dimension, over every pipeline
    stage (``decoder.layers.mlp.linear_fc1.weight`` of shape ``(L, ...)``):
    layer ``i`` becomes ``decoder.layers.{i}.mlp.linear_fc1.weight``; the
    layer norms saved under Transformer Engine's fused names
    (:data:`TE_LAYER_NORMS`) get the local modules' names. Everything else
    keeps its name. Raises ValueError naming a stacked key whose first
    dimension disagrees with the others' (not one stack of layers)."""
    out: dict[str, Any] = {}
    layers: int | None = None
    for key, value in tensors.items():
        m = _STACKED.match(key)
        if m is None:
            out[key] = value
            continue
        head, rest = m.groups()
        count = int(value.shape[0]) if len(value.shape) else 0
        if layers is None:
            layers = count
        if count != layers or count == 0:
            raise ValueError(f"{key}: shape {tuple(value.shape)} is not a stack of the {layers} layers the other "
                             "decoder.layers.* tensors have; not a torch_dist layout ckptier knows")
        for old, new in layer_norms.items():
            if rest.startswith(old):
                rest = new + rest[len(old):]
                break
        for i in range(count):
            out[f"{head}{i}.{rest}"] = value[i]
    return out


#: ``get_rng_state``'s entries that a CPU drill continues, by ckptier's stream name.
RNG_STREAMS = {"python": "random_rng_state", "numpy": "np_rng_state", "cpu": "torch_rng_state"}


def megatron_rng(saved: Any, data_parallel_rank: int = 0) -> dict[str, Any] | None:
    """The random streams a drill continues from a legacy checkpoint's
    ``rng_state``; pure.

    Megatron-LM's ``get_rng_state`` saves a list, one entry per
    data-parallel rank (all-gathered), each with ``random_rng_state``,
    ``np_rng_state``, ``torch_rng_state``, ``cuda_rng_state`` and
    ``rng_tracker_states``; its loader takes entry 0 (the data-parallel
    rank's own only with ``--data-parallel-random-init``), and so does a
    drill of one rank by default. Python's, numpy's and torch's CPU streams
    are continued (:data:`RNG_STREAMS`); the CUDA generator and the
    model-parallel CUDA tracker's forks (dropout inside tensor-parallel
    regions) are not: a CPU drill has no CUDA generator, and on a GPU they
    are the states of that rank's device. None when there is nothing to
    continue (no list, no such rank, no known entry)."""
    if isinstance(saved, Mapping):  # one rank's, unwrapped
        saved = [saved]
    if not isinstance(saved, Sequence) or isinstance(saved, (str, bytes)) or not 0 <= data_parallel_rank < len(saved):
        return None
    entry = saved[data_parallel_rank]
    if not isinstance(entry, Mapping):
        return None
    out = {name: entry[key] for name, key in RNG_STREAMS.items() if key in entry}
    return out or None


# -- loading (torch, lazily) ----------------------------------------------------


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    import torch  # lazy: torch, for drills only

    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif isinstance(value, Mapping):
            out.update(_flatten(value, name + "."))
    return out


def _load(path: Path, allow: Sequence[Any]) -> LoadedCheckpoint:
    from ckptier.formats.safe_load import (  # lazy: torch, for drills only
        CheckpointLoadError, LoadedCheckpoint, UnsupportedCheckpoint, safe_torch_load)

    m = _ITER.match(path.name)
    step = int(m.group(1)) if m else None
    if (path / ".metadata").is_file():
        tensors = load_dcp_tensors(path)
        try:
            model = torch_dist_modules({k: v for k, v in tensors.items() if not k.startswith("optimizer.")})
        except ValueError as exc:
            raise UnsupportedCheckpoint(f"{path}: not supported yet: {exc}") from None
        left = sum(1 for k in tensors if k.startswith("optimizer."))
        return LoadedCheckpoint(model, None, {"iteration": step, "ckpt_format": "torch_dist"}, "torch", step, None,
                                optimizer_left=(f"its torch_dist optimizer state ({left} tensors) is not restored yet"
                                                if left else None))
    ranks = sorted((p for p in path.iterdir() if p.is_dir() and _RANK_DIR.match(p.name)), key=lambda p: _rank_key(p.name))
    if not ranks:
        raise CheckpointLoadError(f"{path}: no mp_rank_* directory; expected iter_NNNNNNN/mp_rank_00/{_FILE}")
    if len(ranks) > 1:
        raise UnsupportedCheckpoint(f"{path}: not supported yet: {len(ranks)} model-parallel ranks "
                                    f"({ranks[0].name}..{ranks[-1].name}); drills restore one rank")
    if (ranks[0] / _DIST_OPTIM).is_file():
        raise UnsupportedCheckpoint(f"{ranks[0]}: not supported yet: the distributed optimizer's {_DIST_OPTIM}; "
                                  "drills restore the plain optimizer state of model_optim_rng.pt")
    file = ranks[0] / _FILE
    state = safe_torch_load(file, extra_allowlist=[*allow, "argparse.Namespace", *stub_allowlist(LIBRARY_GLOBALS)])
    if not isinstance(state, Mapping):
        raise CheckpointLoadError(f"{file}: not a Megatron checkpoint (a {type(state).__name__})")
    chunks = [k for k in state if k == "model" or re.fullmatch(r"model\d+", str(k))]
    if chunks != ["model"] or not isinstance(state["model"], Mapping):
        raise CheckpointLoadError(f"{file}: not supported yet: {len(chunks)} model chunks (virtual pipeline stages); "
                                  "drills restore one")
    model = _flatten(state["model"])
    optimizer: Any = state.get("optimizer")
    if isinstance(optimizer, Mapping) and "state" not in optimizer and isinstance(optimizer.get("optimizer"), Mapping):
        optimizer = optimizer["optimizer"]  # Float16OptimizerWithFloat16Params wraps the torch optimizer's state
    args = state.get("args")
    settings = dict(vars(args)) if hasattr(args, "__dict__") else {}
    extra = {"iteration": state.get("iteration"), "checkpoint_version": state.get("checkpoint_version"),
             "args": {k: v for k, v in settings.items() if isinstance(v, (int, float, str, bool, type(None)))}}
    iteration = state.get("iteration")
    return LoadedCheckpoint(model, optimizer, extra, "torch", iteration if isinstance(iteration, int) else step, None,
                            rng_state=megatron_rng(state.get("rng_state")))
