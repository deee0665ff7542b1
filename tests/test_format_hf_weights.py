"""Hugging Face sharded weights outside a Trainer checkpoint (ckptier.formats.hf_weights).

``hf_weights_run`` is written by ``transformers``' ``save_pretrained`` with a
small ``max_shard_size`` (shards ``model-0000k-of-0000n.safetensors`` plus
``model.safetensors.index.json`` and ``config.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ckptier.formats import checker_for
from ckptier.storage.hashing import hash_file
from ckptier.storage.records import Format
from ckptier.tasks.drill import DrillRequest, judge
from ckptier.tasks.drill_worker import run_request

from tests.fixtures.checkpoints import CheckpointRun, copy_run
from tests.fixtures.listing import only, reasons, recognise_listing, scan

INDEX = json.dumps({"metadata": {"total_size": 20}, "weight_map": {
    "a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}}).encode()


def test_shards_with_their_index_in_a_dir_with_a_step() -> None:
    keys: dict[str, bytes | int] = {"exp/step_3000/model-00001-of-00002.safetensors": 10,
                                    "exp/step_3000/model-00002-of-00002.safetensors": 10,
                                    "exp/step_3000/model.safetensors.index.json": INDEX, "exp/step_3000/config.json": 5}
    (c,) = recognise_listing(keys).checkpoints
    assert (c.job, c.step, c.format, c.committed, len(c.files)) == ("exp", 3000, Format.HF_WEIGHTS, True, 4)
    del keys["exp/step_3000/model-00002-of-00002.safetensors"]
    (c,) = recognise_listing(keys).checkpoints
    assert c.committed and [s.relpath for s in c.shortfalls] == ["model-00002-of-00002.safetensors"]
    del keys["exp/step_3000/model.safetensors.index.json"]
    (c,) = recognise_listing(keys).checkpoints
    assert not c.committed and "save in flight or torn" in c.reason


def test_sharded_weights_in_a_dir_without_a_step_are_not_guessed() -> None:
    rec = recognise_listing({"models/final/model-00001-of-00001.safetensors": 10,
                             "models/final/model.safetensors.index.json": INDEX})
    assert rec.checkpoints == () and "no step in the path" in reasons(rec)["models/final/"]


def test_inside_a_trainer_checkpoint_the_trainer_format_claims_them() -> None:
    rec = recognise_listing({"out/checkpoint-5/model-00001-of-00001.safetensors": 10,
                             "out/checkpoint-5/model.safetensors.index.json": INDEX})
    assert [c.format for c in rec.checkpoints] == [Format.HF]


def test_real_sharded_weights_are_recognised_and_verified(hf_weights_run: CheckpointRun) -> None:
    rec = scan(hf_weights_run.root)
    assert rec.unrecognised == ()
    assert [(c.job, c.step, c.format, c.committed) for c in rec.checkpoints] == [
        (hf_weights_run.job, s, Format.HF_WEIGHTS, True) for s in sorted(hf_weights_run.steps)]
    c = only(rec.checkpoints, 6)
    shards = [f.relpath for f in c.files if f.relpath.startswith("model-")]
    assert len(shards) > 1
    checker = checker_for("model.safetensors.index.json", Format.HF_WEIGHTS)
    assert checker is not None
    hash_file(hf_weights_run.path(6) / "model.safetensors.index.json", observe=checker.feed)
    assert sorted(n.relpath for n in checker.finish().needs) == sorted(shards)
    for rel in shards:
        checker = checker_for(rel, Format.HF_WEIGHTS)
        assert checker is not None and checker.kind == "safetensors"
        hash_file(hf_weights_run.path(6) / rel, observe=checker.feed)
        assert checker.finish().problem is None


def test_real_sharded_weights_with_a_shard_gone(hf_weights_run: CheckpointRun, tmp_path: Path) -> None:
    run = copy_run(hf_weights_run, tmp_path / "copy")
    gone = sorted(p for p in run.path(4).iterdir() if p.name.startswith("model-"))[0]
    gone.unlink()
    c = only(scan(run.root).checkpoints, 4)
    assert [s.relpath for s in c.shortfalls] == [gone.name]


def test_real_sharded_weights_drill_without_a_factory(hf_weights_run: CheckpointRun, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    result = run_request(DrillRequest(str(hf_weights_run.path(6)), "hf-weights", None, 2, "cpu", str(tmp_path / "r.json")))
    verdict = judge([result])
    assert verdict.ok, verdict.summary
    assert not result.optimizer_loaded
