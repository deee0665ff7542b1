"""``hf-trainer``: checkpoints of the Hugging Face ``Trainer``.

``{output_dir}/checkpoint-{N}/`` with weights (safetensors,
``.bin``, sharded variants with an index, FSDP/DeepSpeed sub-folders),
``optimizer.pt``, ``scheduler.pt``, ``rng_state*.pth`` and
``trainer_state.json``. Committed when ``trainer_state.json`` parses, its
``global_step`` equals N and some weights exist; a shard a
``*.index.json`` names that is absent is a shortfall (an index without a
``weight_map`` makes it incomplete). ``global_step`` != N makes it Unrecognised. The
``loss`` of the last ``log_history`` entry that has one is the recorded
loss; the numbers of the entries at step N (``eval_loss``...) are the
checkpoint's metrics (:mod:`ckptier.formats.metrics`). The job is ``output_dir``.

A drill loads the weights (``model.safetensors``, its shards, or
``pytorch_model.bin``) and ``optimizer.pt``, and also loads ``scheduler.pt``
and ``rng_state*.pth`` to prove they restore. With a ``config.json`` it needs
no factory: the model comes from ``transformers``' auto classes and the
optimizer is rebuilt as the Trainer builds it (:mod:`ckptier.tasks.drill_models`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptier.formats.base import FormatPlugin, Group, Scan, as_loss, as_step, names
from ckptier.formats.dcp import dcp_checker
from ckptier.formats.metrics import step_metrics
from ckptier.storage.base import ObjectInfo, key_problem
from ckptier.storage.records import Format
from ckptier.storage.structure import Checker, Need, StructureError, manifest_checker, parse_json, shortfalls

if TYPE_CHECKING:
    from ckptier.formats.safe_load import LoadedCheckpoint

__all__ = ["HF_INDEXES", "PLUGIN", "hf_index_checker", "hf_index_needs", "load_safetensors_weights"]

_HF_STATE = "trainer_state.json"
HF_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_HF_NOT_WEIGHTS = frozenset({"optimizer.pt", "scheduler.pt", "scaler.pt", "training_args.bin"})


def hf_index_needs(index: Any, manifest: str, base: str = "") -> list[Need] | None:
    """Every shard a Hugging Face ``*.index.json`` names in ``weight_map``
    (relative to ``base``, the index's directory), or ``None`` when it has
    no ``weight_map`` object."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        return None
    shards = {v for v in weight_map.values() if isinstance(v, str) and key_problem(v) is None}
    return [Need(base + s, manifest) for s in sorted(shards)]


def hf_index_checker(relpath: str, name: str, base: str) -> Checker | None:
    """The structural check of a weight index (every shard it names must be there)."""
    if name not in HF_INDEXES:
        return None
    return manifest_checker(relpath, lambda c, data: c.need(_hf_manifest(data, name, base)))


def _hf_manifest(data: bytes, name: str, base: str) -> list[Need]:
    needs = hf_index_needs(parse_json(data, name), name, base)
    if needs is None:
        raise StructureError(f"{name}: no weight_map object")
    return needs


class HfTrainerFormat(FormatPlugin):
    format = Format.HF
    metadata_names = frozenset({_HF_STATE, *HF_INDEXES})
    why_factory = "the Hugging Face checkpoint has no config.json to build the model from"

    def anchor(self, key: str, slash: int, up: int) -> str | None:
        if "checkpoint-" not in key:
            return None
        end = slash
        while end > 0:
            start = key.rfind("/", 0, end) + 1
            if key.startswith("checkpoint-", start):
                return key[:end]
            end = start - 1
        return None

    def recognise(self, group: Group, scan: Scan) -> None:
        prefix = group.prefix
        dirname = prefix[prefix.rfind("/") + 1 :]
        cut = len(prefix) + 1
        top: dict[str, ObjectInfo] = {}
        weights: list[str] = []
        for f in group.files:
            rel = f.key[cut:]
            if "/" in rel:
                weights.append(rel)  # FSDP / DeepSpeed sub-folders hold weights
                continue
            top[rel] = f
            if rel not in _HF_NOT_WEIGHTS and (
                rel.endswith((".safetensors", ".bin", ".distcp")) or rel in ("model.pt", "pytorch_model.pt")
            ):
                weights.append(rel)
        text = dirname[len("checkpoint-") :]
        if not (text.isascii() and text.isdigit()):
            if _HF_STATE in top or weights:
                scan.refuse(prefix + "/", f"{dirname!r}: {text!r} is not a step number; expected checkpoint-<digits>")
            else:
                for f in group.files:
                    scan.unclaimed(f)
            return
        step = int(text)
        job = scan.job_of(prefix)
        state_info = top.get(_HF_STATE)
        if state_info is None:
            if not weights and "optimizer.pt" not in top:
                for f in group.files:
                    scan.unclaimed(f)
                return
            scan.emit(
                job=job, step=step, fmt=Format.HF, prefix=prefix, files=group.files, committed=False,
                reason="no trainer_state.json: save in flight or torn",
            )
            return
        state, problem = scan.read_json(state_info, _HF_STATE)
        if problem is None and not isinstance(state, dict):
            problem = f"trainer_state.json: expected a JSON object, found {type(state).__name__}"
        if problem is None:
            assert isinstance(state, dict)
            global_step = as_step(state.get("global_step"))
            if global_step is None:
                problem = f"trainer_state.json: global_step {state.get('global_step')!r} is not an integer"
            elif global_step != step:
                scan.refuse(
                    prefix + "/",
                    f"trainer_state.json says global_step {global_step} but the directory is {dirname!r}; "
                    "ckptier does not guess which is right",
                )
                return
        if problem is not None:
            scan.emit(job=job, step=step, fmt=Format.HF, prefix=prefix, files=group.files, committed=False,
                      reason=problem)
            return
        assert isinstance(state, dict)
        loss = _hf_last_loss(state.get("log_history"))
        committed, reason = True, "committed: trainer_state.json global_step matches"
        if not weights:
            committed, reason = False, "no model weights (model.safetensors, pytorch_model.bin or shards) beside trainer_state.json"
        needs: list[Need] = []
        for index_name in HF_INDEXES:
            index_info = top.get(index_name)
            if index_info is None or not committed:
                continue
            index, problem = scan.read_json(index_info, index_name)
            if problem is None:
                named = hf_index_needs(index, index_name)
                if named is None:
                    problem = f"{index_name}: no weight_map object"
                else:
                    needs.extend(named)
            if problem is not None:
                committed, reason = False, problem
        short = shortfalls(needs, {rel: f.size for rel, f in top.items()}) if committed and needs else []
        if short:
            reason += f"; the weight index requires missing shard(s): {names([str(x) for x in short])}"
        scan.emit(
            job=job, step=step, fmt=Format.HF, prefix=prefix, files=group.files, committed=committed, reason=reason,
            loss=loss, short=short, metrics=step_metrics(state.get("log_history"), step),
        )


    def checker(self, relpath: str, name: str, base: str) -> Checker | None:
        return dcp_checker(relpath, name, base) or hf_index_checker(relpath, name, base)

    def load(self, path: Path, allow: Sequence[Any]) -> LoadedCheckpoint:
        return _load_hf(path, allow)


PLUGIN = HfTrainerFormat()


def _hf_last_loss(history: Any) -> float | None:
    if not isinstance(history, list):
        return None
    for entry in reversed(history):
        if isinstance(entry, dict):
            loss = as_loss(entry.get("loss"))
            if loss is not None:
                return loss
    return None


# -- loading (torch, lazily) ----------------------------------------------------


def load_safetensors_weights(path: Path) -> dict[str, Any]:
    """The weights of a directory holding ``model.safetensors`` or the shards
    ``model.safetensors.index.json`` names (plain file names only)."""
    from ckptier.formats.safe_load import UnsafeCheckpoint, load_safetensors, read_json  # lazy: torch, for drills only

    if (path / "model.safetensors").is_file():
        return load_safetensors(path / "model.safetensors")
    index = read_json(path / "model.safetensors.index.json")
    model: dict[str, Any] = {}
    for shard in sorted(set((index.get("weight_map") or {}).values())):
        if Path(shard).name != shard:
            raise UnsafeCheckpoint(f"{path}: shard name {shard!r} in model.safetensors.index.json is not a plain file name")
        model.update(load_safetensors(path / shard))
    return model


def _hf_recorded_loss(state: Mapping[str, Any]) -> float | None:
    history = state.get("log_history") or []
    step = state.get("global_step")
    losses = [
        h for h in history
        if isinstance(h, Mapping) and "loss" in h and (step is None or not isinstance(h.get("step"), int) or h["step"] <= step)
    ]
    return as_loss(losses[-1]["loss"]) if losses else None


def _load_hf(path: Path, allow: Sequence[Any]) -> LoadedCheckpoint:
    from ckptier.formats.safe_load import (  # lazy: torch, for drills only
        CheckpointLoadError,
        LoadedCheckpoint,
        read_json,
        safe_torch_load,
        step_from_name,
        unwrap_state,
    )

    model: dict[str, Any]
    if (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file():
        model = load_safetensors_weights(path)
    elif (path / "pytorch_model.bin").is_file():
        model = unwrap_state(safe_torch_load(path / "pytorch_model.bin", extra_allowlist=allow), path / "pytorch_model.bin", ("state_dict",))
    else:
        raise CheckpointLoadError(f"{path}: no model.safetensors or pytorch_model.bin; the Hugging Face checkpoint has no weights")
    optimizer = safe_torch_load(path / "optimizer.pt", extra_allowlist=allow) if (path / "optimizer.pt").is_file() else None
    state = read_json(path / "trainer_state.json") if (path / "trainer_state.json").is_file() else {}
    also: list[str] = []
    rng_state = None
    for side in sorted([*path.glob("rng_state*.pth"), path / "scheduler.pt"]):
        if side.is_file():
            value = safe_torch_load(side, extra_allowlist=allow)
            also.append(side.name)
            if side.name == "rng_state.pth" and isinstance(value, dict):  # one process's (rng_state_<rank>.pth: ranks')
                rng_state = value
    extra = dict(state)
    if (path / "config.json").is_file():
        extra["hf_config_dir"] = str(path)
    step = state.get("global_step") if isinstance(state.get("global_step"), int) else step_from_name(path)
    return LoadedCheckpoint(model, optimizer, extra, "torch", step, _hf_recorded_loss(state), also, rng_state)
