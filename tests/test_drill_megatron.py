"""Drills of Megatron-LM ``torch_dist`` checkpoints written by megatron-core itself.

* A tiny GPT trained on 2 tensor-parallel ranks and saved by
  ``dist_checkpointing.save`` (``megatron_tp_run``) restores whole on one
  rank (the DCP metadata's global shapes join the shards; the layers'
  stack and the fused layer-norm names become the one-rank model's), trains
  the catalog's steps with a fresh (stateless) optimizer and retraces the
  run's ``losses.jsonl``: ``passed``; the run's batches fed from the first
  fail ``trajectory`` alone.
* A save over 2 pipeline stages restores whole: every stage's weights,
  the second stage's layers renumbered after the first's.
* A save in flight (newer than the tracker) or a torn one (a shard gone)
  is not committed, so it is never drilled.
* :func:`torch_dist_modules`, table-tested (always runs).

Slow where megatron-core is installed: the run takes two processes, drills start workers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from ckptier.formats.megatron import TRACKER, torch_dist_modules

from tests.fixtures.listing import scan
from tests.test_drill_steps import batches_from_one, cli  # noqa: F401 - cli: the command line in a fresh catalog

FACTORY = "tests.fixtures.megatron_gpt:megatron_gpt_drill_spec"
BATCHES_FROM_ONE = batches_from_one("tests.fixtures.megatron_gpt", "megatron_gpt_drill_spec", "gpt_batch")


@pytest.mark.parametrize(("tensors", "want"), [
    ({"embedding.word_embeddings.weight": (64, 16)}, {"embedding.word_embeddings.weight": (64, 16)}),
    ({"decoder.layers.mlp.linear_fc1.weight": (2, 64, 16)},
     {"decoder.layers.0.mlp.linear_fc1.weight": (64, 16), "decoder.layers.1.mlp.linear_fc1.weight": (64, 16)}),
    ({"decoder.layers.self_attention.linear_qkv.layer_norm_weight": (2, 16),
      "decoder.layers.mlp.linear_fc1.layer_norm_bias": (2, 16)},
     {"decoder.layers.0.input_layernorm.weight": (16,), "decoder.layers.1.input_layernorm.weight": (16,),
      "decoder.layers.0.pre_mlp_layernorm.bias": (16,), "decoder.layers.1.pre_mlp_layernorm.bias": (16,)}),
    ({"decoder.layers.3.mlp.linear_fc2.bias": (16,)}, {"decoder.layers.3.mlp.linear_fc2.bias": (16,)}),  # per layer already
    ({"decoder.final_layernorm.weight": (16,)}, {"decoder.final_layernorm.weight": (16,)}),
])
def test_torch_dist_layers_unstack_into_the_one_rank_models_names(tensors: dict, want: dict) -> None:  # type: ignore[type-arg]
    got = torch_dist_modules({k: torch.zeros(s) for k, s in tensors.items()})
    assert {k: tuple(v.shape) for k, v in got.items()} == want


def test_torch_dist_layers_of_disagreeing_depth_are_refused() -> None:
    stacked = {"decoder.layers.mlp.linear_fc1.bias": torch.arange(2.0)[:, None].expand(2, 4),
               "decoder.layers.mlp.linear_fc2.bias": torch.zeros(3, 4)}
    with pytest.raises(ValueError, match=r"decoder\.layers\.mlp\.linear_fc2\.bias: shape \(3, 4\) is not a stack of the 2 layers"):
        torch_dist_modules(stacked)
    one = torch_dist_modules({"decoder.layers.mlp.linear_fc1.bias": stacked["decoder.layers.mlp.linear_fc1.bias"]})
    assert one["decoder.layers.1.mlp.linear_fc1.bias"].tolist() == [1.0] * 4  # layer i is row i of the stack


@pytest.mark.slow
def test_megatron_tp2_run_drills_on_one_rank_and_retraces_and_wrong_steps_fail(
    megatron_tp_run: Path, tmp_path: Path, cli  # type: ignore[no-untyped-def]  # noqa: F811
) -> None:
    hot = tmp_path / "hot"
    shutil.copytree(megatron_tp_run, hot)
    assert cli("scan", str(hot))[0] == 0 and cli("verify")[0] == 0
    code, out, err = cli("drill", "--job", "mega/tp2", "--device", "cpu", "--steps", "3", "--model", FACTORY,
                         "--json", "--no-prefect")
    (report,) = json.loads(out)
    assert code == 0 and report["verdict"] == "passed", (report["summary"], err)
    assert report["step"] == 6 and report["trained_steps"] == [7, 9]
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["optimizer_continues"]["detail"] == "skipped: the checkpoint has no optimizer state", checks
    assert checks["trajectory"]["ok"] and checks["trajectory"]["detail"].startswith("3 recorded losses of steps 7..9"), checks
    rows = {r["step"]: r["loss"] for r in map(json.loads, (hot / "mega/tp2/losses.jsonl").read_text().splitlines())}
    assert report["losses"] == pytest.approx([rows[7], rows[8], rows[9]], rel=1e-5)  # TP=2 shards joined: the run's own

    factories = tmp_path / "batches_from_one.py"
    factories.write_text(BATCHES_FROM_ONE)
    code, out, _ = cli("drill", "--job", "mega/tp2", "--device", "cpu", "--steps", "3", "--model",
                       f"{factories}:batches_from_one", "--json", "--no-prefect")
    (wrong,) = json.loads(out)
    assert code == 1 and wrong["verdict"] == "failed" and wrong["trained_steps"] == [7, 9]
    assert [c["name"] for c in wrong["checks"] if not c["ok"]] == ["trajectory"], wrong["checks"]


@pytest.mark.slow
def test_megatron_pp2_save_restores_every_stages_weights_whole(megatron_pp_save: Path) -> None:
    from ckptier.formats.megatron import PLUGIN

    loaded = PLUGIN.load(megatron_pp_save / "mega/pp2/iter_0000001", [])
    want = {**torch.load(megatron_pp_save / "reference/stage0.pt"), **torch.load(megatron_pp_save / "reference/stage1.pt")}
    assert "decoder.layers.1.input_layernorm.weight" in want and "output_layer.weight" in want  # layer 1 is stage 1's
    assert sorted(loaded.model_state) == sorted(want)
    assert all(torch.equal(loaded.model_state[k], v) for k, v in want.items())
    assert loaded.optimizer_state is None and loaded.step == 1


@pytest.mark.slow
def test_megatron_saves_in_flight_or_torn_are_not_drilled(
    megatron_tp_run: Path, tmp_path: Path, cli  # type: ignore[no-untyped-def]  # noqa: F811
) -> None:
    hot = tmp_path / "hot"
    shutil.copytree(megatron_tp_run, hot)
    job = hot / "mega" / "tp2"
    assert [(c.step, c.committed, c.shortfalls) for c in scan(hot).checkpoints] == [(3, True, ()), (6, True, ())]
    (job / TRACKER).write_text("3")  # killed after iter 6's shards, before the tracker
    (job / "iter_0000003" / "__1_0.distcp").unlink()  # and iter 3 torn: a rank's shard gone
    rec = scan(hot)
    assert [(c.step, c.committed, len(c.shortfalls)) for c in rec.checkpoints] == [(3, True, 1), (6, False, 0)]
    assert "newer than latest_checkpointed_iteration.txt (3)" in rec.checkpoints[1].reason
    assert "__1_0.distcp (absent, listed in .metadata)" in rec.checkpoints[0].reason
    assert cli("scan", str(hot))[0] == 0
    cli("verify")  # iter 3 fails its shortfall, iter 6 was never committed
    code, out, err = cli("drill", "--job", "mega/tp2", "--device", "cpu", "--steps", "3", "--model", FACTORY,
                         "--json", "--no-prefect")
    assert code == 2 and "no verified or committed checkpoint of job 'mega/tp2' to drill" in err + out, (out, err)
