"""Hugging Face Trainer checkpoint-N directories (ckptier.formats.hf_trainer)."""

from __future__ import annotations

import json
from pathlib import Path

from ckptier.formats import recognise
from ckptier.storage.base import ObjectInfo
from ckptier.storage.model import Shortfall

from tests.fixtures.checkpoints import CheckpointRun, copy_run, tiny_gpt2_config
from tests.fixtures.listing import (
    LATER,
    infos,
    only,
    reader,
    reasons,
    scan,
    set_json_fields,
)


def test_hf_fixture_checkpoint_loads_with_from_pretrained(hf_run: CheckpointRun) -> None:
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(hf_run.path(6))
    assert model.config.n_layer == tiny_gpt2_config().n_layer


def test_hf_global_step_mismatch_is_unrecognised(hf_run: CheckpointRun, tmp_path: Path) -> None:
    run = copy_run(hf_run, tmp_path / "r")
    set_json_fields(run.path(4) / "trainer_state.json", global_step=6)
    rec = scan(run.root)
    assert [c.step for c in rec.checkpoints] == [2, 6]
    assert "global_step 6 but the directory is 'checkpoint-4'" in reasons(rec)["hf-out/checkpoint-4/"]


def test_hf_torn_checkpoints(hf_run: CheckpointRun, tmp_path: Path) -> None:
    run = copy_run(hf_run, tmp_path / "r")
    (run.path(2) / "trainer_state.json").unlink()
    state = run.path(4) / "trainer_state.json"
    state.write_bytes(state.read_bytes()[:100])
    (run.path(6) / "model.safetensors").unlink()
    rec = scan(run.root)
    assert only(rec.checkpoints, 2).reason == "no trainer_state.json: save in flight or torn"
    assert only(rec.checkpoints, 4).reason.startswith("trainer_state.json: not valid JSON (line ")
    assert only(rec.checkpoints, 6).reason.startswith("no model weights")
    assert not any(c.committed for c in rec.checkpoints)


def test_hf_sharded_weights_need_every_indexed_shard() -> None:
    base = "out/checkpoint-10/"
    index = json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    state = json.dumps({"global_step": 10, "log_history": [{"loss": 2.5, "step": 5}, {"loss": 2.0, "step": 10}, {"train_loss": 2.2}]})
    files = {base + "trainer_state.json": state.encode(), base + "model.safetensors.index.json": index.encode()}
    listing = [ObjectInfo(k, len(v), 1.0) for k, v in files.items()]
    shard1 = infos(base + "model-00001-of-00002.safetensors")
    rec = recognise([*listing, *shard1], reader(files), root_name="r", now=LATER)
    (c,) = rec.checkpoints
    assert c.committed
    assert c.shortfalls == (Shortfall("model-00002-of-00002.safetensors", "model.safetensors.index.json"),)
    assert c.reason.endswith("the weight index requires missing shard(s): model-00002-of-00002.safetensors "
                             "(absent, listed in model.safetensors.index.json)")
    shard2 = infos(base + "model-00002-of-00002.safetensors")
    (c,) = recognise([*listing, *shard1, *shard2], reader(files), root_name="r", now=LATER).checkpoints
    assert (c.committed, c.recorded_loss, c.job, c.shortfalls) == (True, 2.0, "out", ())
