"""PyTorch DCP directories, wherever they are: recognition and .metadata as manifest (ckptier.formats.dcp)."""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import pytest
from ckptier.formats import recognise
from ckptier.formats.dcp import dcp_needs
from ckptier.storage.records import Format
from ckptier.storage.structure import Need

from tests.fixtures.checkpoints import CheckpointRun, copy_run, tiny_mlp
from tests.fixtures.listing import (
    LATER,
    check,
    dcp_meta,
    infos,
    only,
    reader,
    reasons,
    scan,
)


def test_dcp_metadata_needs_every_shard_with_enough_bytes(dcp_run: CheckpointRun, tmp_path: Path) -> None:
    """.metadata is read (restricted unpickler): a referenced .distcp that is gone or short is a shortfall."""
    run = copy_run(dcp_run, tmp_path / "r")
    assert all(only(scan(run.root).checkpoints, s).shortfalls == () for s in run.steps)
    (shard,) = [p for p in run.path(4).iterdir() if p.suffix == ".distcp"]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    (run.path(6) / ".metadata").write_bytes((run.path(2) / ".metadata").read_bytes()[:-20])
    rec = scan(run.root)
    (short,) = only(rec.checkpoints, 4).shortfalls
    assert (short.relpath, short.manifest, short.have, short.exact) == (shard.name, ".metadata", len(data) // 2, False)
    assert short.need is not None and len(data) // 2 < short.need <= len(data)
    torn = only(rec.checkpoints, 6)
    assert not torn.committed and torn.reason.startswith(".metadata: not a readable pickle")


def test_dcp_metadata_referencing_a_second_shard_that_is_gone(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model = tiny_mlp()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(
            str(tmp_path / "job/step-7"), thread_count=2, single_file_per_rank=False))
    shards = sorted(p.name for p in (tmp_path / "job/step-7").glob("*.distcp"))
    assert len(shards) > 1
    assert only(scan(tmp_path).checkpoints, 7).shortfalls == ()
    (tmp_path / "job/step-7" / shards[-1]).unlink()
    (c,) = scan(tmp_path).checkpoints
    assert c.committed and [x.relpath for x in c.shortfalls] == [shards[-1]]


def test_dcp_shards_without_metadata_are_incomplete(dcp_run: CheckpointRun, tmp_path: Path) -> None:
    run = copy_run(dcp_run, tmp_path / "r")
    (run.path(6) / ".metadata").unlink()
    (run.path(2) / "__0_0.distcp").write_bytes(b"")
    rec = scan(run.root)
    assert (only(rec.checkpoints, 6).committed, only(rec.checkpoints, 6).reason) == (
        False,
        "no .metadata: save in flight or torn",
    )
    assert only(rec.checkpoints, 2).reason == "__0_0.distcp is empty (0 bytes): save in flight or torn"
    assert only(rec.checkpoints, 4).committed


def test_dcp_reads_loss_from_a_metadata_json_beside_the_shards() -> None:
    keys = ["j/step-7/__0_0.distcp", "j/step-7/.metadata", "j/step-7/metadata.json"]
    files = {keys[1]: dcp_meta({"__0_0.distcp": 10}), keys[2]: b'{"loss": 0.75}'}
    (c,) = recognise(infos(*keys), reader(files), root_name="r", now=LATER).checkpoints
    assert (c.format, c.committed, c.recorded_loss) == (Format.DCP, True, 0.75)


def test_dcp_at_the_root_takes_the_root_name() -> None:
    meta = {"step-7/.metadata": dcp_meta({"__0_0.distcp": 10})}
    rec = recognise(infos("step-7/__0_0.distcp", "step-7/.metadata"), reader(meta), root_name="titan-out", now=LATER)
    (c,) = rec.checkpoints
    assert (c.job, c.step, c.format, c.prefix, c.committed) == ("titan-out", 7, Format.DCP, "step-7", True)


def test_dcp_metadata_of_a_real_save(dcp_run: CheckpointRun) -> None:
    for step in dcp_run.steps:
        meta = (dcp_run.path(step) / ".metadata").read_bytes()
        got = check(".metadata", meta, chunk=100, fmt=Format.DCP)
        assert got.problem is None
        (need,) = got.needs
        shard = dcp_run.path(step) / need.relpath
        assert need.manifest == ".metadata" and 0 < need.size <= shard.stat().st_size  # type: ignore[operator]
        assert (check(".metadata", meta[:-7], fmt=Format.DCP).problem or "").startswith("DCP .metadata: not a readable")


def test_dcp_metadata_is_never_executed(tmp_path: Path) -> None:
    canary = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple:
            return (os.system, (f"touch {canary}",))

    class Nested:
        def __reduce__(self) -> tuple:
            return (Path.write_text, (canary, "x"))

    for evil in (Payload(), {"storage_data": Nested()}, [Payload()]):
        got = check(".metadata", pickle.dumps(evil), fmt=Format.DCP)
        assert got.problem is not None and "not torch.distributed.checkpoint.metadata.Metadata" in got.problem
    assert not canary.exists()


def test_dcp_needs_from_torch_objects() -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    storage = {MetadataIndex("a"): _StorageInfo("__0_0.distcp", 0, 100),
               MetadataIndex("b"): _StorageInfo("__0_0.distcp", 100, 50),
               MetadataIndex("c"): _StorageInfo("__1_0.distcp", 8, 8)}
    data = pickle.dumps(Metadata(state_dict_metadata={}, storage_data=storage))
    assert dcp_needs(data, "sub/") == [Need("sub/__0_0.distcp", ".metadata", 150), Need("sub/__1_0.distcp", ".metadata", 16)]


# --- DCP in any directory ----------------------------------------------------------------


def _dcp_save(path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from tests.fixtures.checkpoints import tiny_mlp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.save({"model": tiny_mlp().state_dict()}, checkpoint_id=str(path))


@pytest.mark.parametrize(
    ("where", "job", "step"),
    [
        ("tune/out/step_6", "tune/out", 6),  # torchtune-style
        ("lit/epoch=1-step=60", "lit", 60),
        ("zero/global_step7", "zero", 7),  # DCP claims its files before DeepSpeed's anchor
        ("titan/checkpoint/step-600", "titan/checkpoint", 600),  # torchtitan
        ("ft/ckpt-12", "ft", 12),
    ],
)
def test_dcp_is_recognised_in_any_directory_with_a_step_in_its_name(tmp_path: Path, where: str, job: str, step: int) -> None:
    _dcp_save(tmp_path / where)
    rec = scan(tmp_path)
    assert rec.unrecognised == ()
    (c,) = rec.checkpoints
    assert (c.job, c.step, c.format, c.prefix, c.committed) == (job, step, Format.DCP, where, True), c.reason


def test_dcp_without_a_step_in_its_path_is_not_recognised_and_says_why(tmp_path: Path) -> None:
    _dcp_save(tmp_path / "exported" / "final")
    rec = scan(tmp_path)
    assert rec.checkpoints == ()
    why = reasons(rec)["exported/final/"]
    assert "not recognised: no step in the path" in why and "step-N" in why


def test_step_names_are_read_from_the_directory_name_only() -> None:
    from ckptier.formats.base import step_in_name

    table = {"step-100": 100, "step_100": 100, "step100": 100, "iter_0000100": 100, "global_step100": 100,
             "checkpoint-100": 100, "checkpoint_100": 100, "epoch=3-step=100": 100, "ckpt-100": 100,
             "final": None, "epoch_3": None, "step-1-step-2": None, "v2-step-7": 7, "model-v3": None}
    assert {name: step_in_name(name) for name in table} == table


def test_dcp_metadata_with_megatron_cores_save_plans_reads_as_data(tmp_path: Path) -> None:
    """megatron-core's torch_dist writer keeps every rank's SavePlan in the Metadata
    (``all_local_plans``): DCP's own planner records are admitted, nothing else is."""
    from fractions import Fraction

    import torch
    from ckptier.formats.dcp import read_dcp_metadata
    from ckptier.formats.loaded import UnsafeCheckpoint
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([4]))
    item = WriteItem(MetadataIndex("w", torch.Size([0])), WriteItemType.SHARD,
                     TensorWriteData(chunk, TensorProperties(dtype=torch.float32), torch.Size([8])))
    meta = Metadata(state_dict_metadata={})
    meta.all_local_plans = [SavePlan([item])]  # type: ignore[attr-defined]  # as megatron-core sets it
    (tmp_path / ".metadata").write_bytes(pickle.dumps(meta))
    got = read_dcp_metadata(tmp_path)
    assert got.all_local_plans[0].items[0].type is WriteItemType.SHARD
    meta.all_local_plans = [SavePlan([item], planner_data=Fraction(1, 2))]  # type: ignore[attr-defined]
    (tmp_path / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(UnsafeCheckpoint, match="refers to the global fractions.Fraction"):
        read_dcp_metadata(tmp_path)
