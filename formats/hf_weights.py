"""``hf-weights``: Hugging Face sharded weights outside a Trainer checkpoint.

Layout (``transformers`` ``PreTrainedModel.save_pretrained`` with a
``max_shard_size``)::

    {job}/{dir with a step in its name}/model-00001-of-00003.safetensors
                                       model-00002-of-00003.safetensors ...
                                       model.safetensors.index.json   # weight_map: tensor -> shard
                                       config.json, generation_config.json, tokenizer files...

(also ``pytorch_model-0000k-of-0000n.bin`` with ``pytorch_model.bin.index.json``).
Inside a Trainer's ``checkpoint-N`` the Trainer format claims them. The step
comes from the directory's own name (``step-N``, ``step_N``, ``iter_N``,
``global_stepN``, ``epoch=E-step=S``...); a directory whose name holds none
is reported as not recognised ("no step in the path").

Commit evidence: the index, which ``save_pretrained`` writes after every
shard; every shard its ``weight_map`` names must be there (a missing one is
a shortfall: ``incomplete`` within the job's grace, ``corrupt`` after).
Shards without an index are a save in flight or torn. Verification checks
every shard's safetensors header and the index.

A drill loads every shard safely (safetensors). With a ``config.json`` it
needs no factory (the model comes from ``transformers``' auto classes);
there is no optimizer state to restore, so a fresh optimizer is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptier.formats.base import FormatPlugin, Group, Scan, names, step_in_name
from ckptier.formats.hf_trainer import HF_INDEXES, hf_index_checker, hf_index_needs, load_safetensors_weights
from ckptier.storage.records import Format
from ckptier.storage.structure import Checker, shortfalls

if TYPE_CHECKING:
    from ckptier.formats.safe_load import LoadedCheckpoint

__all__ = ["PLUGIN"]


def _is_shard(name: str) -> bool:
    return (
        (name.startswith("model-") and name.endswith(".safetensors"))
        or (name.startswith("pytorch_model-") and name.endswith(".bin"))
    ) and "-of-" in name


class HfWeightsFormat(FormatPlugin):
    format = Format.HF_WEIGHTS
    metadata_names = frozenset(HF_INDEXES)
    anchor_names = frozenset(HF_INDEXES)
    anchor_suffixes = (".safetensors", ".bin")
    why_factory = "the saved model directory has no config.json to build the model from"

    def anchor(self, key: str, slash: int, up: int) -> str | None:
        if slash <= 0:
            return None
        name = key[slash + 1 :]
        if name in HF_INDEXES or _is_shard(name):
            return key[:slash]
        return None

    def recognise(self, group: Group, scan: Scan) -> None:
        prefix, dirname = group.prefix, group.dirname
        step = step_in_name(dirname)
        if step is None:
            scan.refuse(prefix + "/", f"sharded Hugging Face weights in {dirname!r} not recognised: no step in the path; "
                        "name the directory with its step (e.g. step-1000) or add a [[pattern]] rule")
            return
        top = group.top()
        index_name = next((n for n in HF_INDEXES if n in top), None)
        job, files = scan.job_of(prefix), group.files
        if index_name is None:
            scan.emit(job=job, step=step, fmt=self.format, prefix=prefix, files=files, committed=False,
                      reason=f"shards without {HF_INDEXES[0]} (written after them): save in flight or torn")
            return
        index, problem = scan.read_json(top[index_name], index_name)
        needs = hf_index_needs(index, index_name) if problem is None else None
        if problem is None and needs is None:
            problem = f"{index_name}: no weight_map object"
        if problem is not None:
            scan.emit(job=job, step=step, fmt=self.format, prefix=prefix, files=files, committed=False, reason=problem)
            return
        assert needs is not None
        short = shortfalls(needs, group.sizes())
        reason = f"committed: {index_name} present with {len(needs)} shard(s)"
        if short:
            reason += f"; the weight index requires missing shard(s): {names([str(x) for x in short])}"
        scan.emit(job=job, step=step, fmt=self.format, prefix=prefix, files=files, committed=True, reason=reason,
                  short=short)

    def checker(self, relpath: str, name: str, base: str) -> Checker | None:
        return hf_index_checker(relpath, name, base)

    def load(self, path: Path, allow: Sequence[Any]) -> LoadedCheckpoint:
        from ckptier.formats.safe_load import (  # lazy: torch, for drills only
            CheckpointLoadError, LoadedCheckpoint, read_json, safe_torch_load, unwrap_state)

        if (path / "model.safetensors.index.json").is_file():
            model = load_safetensors_weights(path)
        elif (path / "pytorch_model.bin.index.json").is_file():
            model = {}
            for shard in sorted(set((read_json(path / "pytorch_model.bin.index.json").get("weight_map") or {}).values())):
                if Path(shard).name != shard:
                    raise CheckpointLoadError(f"{path}: shard name {shard!r} in pytorch_model.bin.index.json is not a plain file name")
                model.update(unwrap_state(safe_torch_load(path / shard, extra_allowlist=allow), path / shard, ("state_dict",)))
        else:
            raise CheckpointLoadError(f"{path}: no {HF_INDEXES[0]}; the sharded weights are incomplete")
        extra: dict[str, Any] = {"hf_config_dir": str(path)} if (path / "config.json").is_file() else {}
        return LoadedCheckpoint(model, None, extra, "torch", step_in_name(path.name), None)


PLUGIN = HfWeightsFormat()
