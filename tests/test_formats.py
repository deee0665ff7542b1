"""Format recognition over checkpoints written by the real libraries, torn ones,
odd names, user patterns, and listings of 100,000 objects."""

from __future__ import annotations

import gc
import json
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptier.storage.base import ObjectInfo, read_bytes
from ckptier.storage.errors import ConfigError, Unavailable
from ckptier.formats import PatternRule, is_own_file, recognise
from ckptier.storage.local import LocalStore
from ckptier.storage.model import FileRef, Format, Recognition, Shortfall
from tests.fixtures.listing import LATER, dcp_meta, infos, only, reader, reasons, scan, set_json_fields
from tests.fixtures.checkpoints import LR, CheckpointRun, copy_run, tiny_batch, tiny_gpt2_config, tiny_loss, tiny_mlp

# --------------------------------------------------------------------------
# Checkpoints written by the real libraries


RUNS = ["guide_run", "dcp_run", "hf_run", "lightning_run"]


@pytest.mark.parametrize("fixture", RUNS)
def test_real_library_checkpoints_are_recognised(fixture: str, request: pytest.FixtureRequest) -> None:
    run: CheckpointRun = request.getfixturevalue(fixture)
    rec = scan(run.root)

    assert rec.unrecognised == ()
    assert [(c.job, c.step, c.format, c.prefix) for c in rec.checkpoints] == [
        (run.job, s, run.format, run.steps[s].prefix) for s in sorted(run.steps)
    ]
    for c in rec.checkpoints:
        want = run.steps[c.step]
        assert c.committed, c.reason
        assert tuple(f.relpath for f in c.files) == want.files
        assert all(f.key == (want.prefix if len(want.files) == 1 and run.format is Format.LIGHTNING
                             else f"{want.prefix}/{f.relpath}") for f in c.files)
        assert c.bytes == sum((run.root / f.key).stat().st_size for f in c.files)
        if want.recorded_loss is None:
            assert c.recorded_loss is None
        else:
            assert c.recorded_loss == pytest.approx(want.recorded_loss, rel=1e-6)
    # last.ckpt is an alias: neither a checkpoint nor unrecognised, but counted.
    assert rec.objects == sum(len(s.files) for s in run.steps.values()) + len(run.aliases)


def test_guide_metadata_hashes_become_expected_sha256(guide_run: CheckpointRun) -> None:
    rec = scan(guide_run.root)
    for c in rec.checkpoints:
        want = guide_run.steps[c.step].sha256
        assert dict(c.expected_sha256) == {k: v for k, v in want.items() if k.startswith("rank-")}
        assert c.reason == "committed: metadata.json present"


def test_guide_metadata_is_read_once_per_step_and_nothing_else_is_read(guide_run: CheckpointRun) -> None:
    store = LocalStore(guide_run.root)
    read: list[str] = []

    def read_small(key: str) -> bytes:
        read.append(key)
        return read_bytes(store, key)

    recognise(store.list(), read_small, root_name="x", now=LATER)
    assert sorted(read) == sorted(f"{s.prefix}/metadata.json" for s in guide_run.steps.values())


def test_lightning_checkpoint_within_settle_time_is_incomplete(lightning_run: CheckpointRun) -> None:
    newest = max((lightning_run.root / s.prefix).stat().st_mtime for s in lightning_run.steps.values())
    rec = scan(lightning_run.root, now=newest + 10)
    assert len(rec.checkpoints) == 3
    assert not any(c.committed for c in rec.checkpoints)
    assert "within the 60 s settle time" in rec.checkpoints[-1].reason
    rec = scan(lightning_run.root, now=newest + 10, lightning_settle_seconds=5)
    assert all(c.committed for c in rec.checkpoints)


def _resume_and_train(fixture: str, run: CheckpointRun) -> float:
    """Load step 4 of ``run`` the documented way, train steps 5 and 6, return step 6's loss."""
    import torch

    model = tiny_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    path = run.path(4)
    if fixture == "guide_run":
        model.load_state_dict(torch.load(path / "rank-0000/model.pt", weights_only=True))
        optimizer.load_state_dict(torch.load(path / "rank-0000/optimizer.pt", weights_only=True))
    elif fixture == "dcp_run":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:
        ckpt = torch.load(path, weights_only=True)
        model.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer_states"][0])
    loss = 0.0
    for step in (5, 6):
        optimizer.zero_grad()
        out = tiny_loss(model, tiny_batch(step))
        out.backward()
        optimizer.step()
        loss = out.item()
    return loss


@pytest.mark.parametrize("fixture", ["guide_run", "dcp_run", "lightning_run"])
def test_fixture_models_rebuild_and_resume_as_documented(fixture: str, request: pytest.FixtureRequest) -> None:
    run: CheckpointRun = request.getfixturevalue(fixture)
    assert _resume_and_train(fixture, run) == pytest.approx(run.steps[6].loss, rel=1e-5)


def test_hf_fixture_checkpoint_loads_with_from_pretrained(hf_run: CheckpointRun) -> None:
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(hf_run.path(6))
    assert model.config.n_layer == tiny_gpt2_config().n_layer


# --------------------------------------------------------------------------
# Torn and damaged checkpoints (copies of the real ones)


def test_guide_without_metadata_is_incomplete(guide_run: CheckpointRun, tmp_path: Path) -> None:
    run = copy_run(guide_run, tmp_path / "r")
    (run.path(4) / "metadata.json").unlink()
    rec = scan(run.root)
    torn = only(rec.checkpoints, 4)
    assert (torn.committed, torn.reason) == (False, "no metadata.json: save in flight or torn")
    assert only(rec.checkpoints, 2).committed and only(rec.checkpoints, 6).committed


def test_truncated_metadata_json_is_incomplete_with_position(guide_run: CheckpointRun, tmp_path: Path) -> None:
    run = copy_run(guide_run, tmp_path / "r")
    meta = run.path(2) / "metadata.json"
    meta.write_bytes(meta.read_bytes()[:40])
    with pytest.raises(json.JSONDecodeError) as err:
        json.loads(meta.read_bytes())
    rec = scan(run.root)
    torn = only(rec.checkpoints, 2)
    assert not torn.committed
    assert torn.reason == f"metadata.json: not valid JSON (line {err.value.lineno} col {err.value.colno})"


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "metadata.json: empty file (0 bytes)"),
        (b'{"step": 2, "loss": 1.0', "metadata.json: not valid JSON (line 1 col 24)"),
        (b"[1, 2]", "metadata.json: expected a JSON object, found list"),
        (b'{"step": 2}\xff', "metadata.json: not valid UTF-8 text"),
    ],
)
def test_malformed_metadata_never_crashes(content: bytes, reason: str) -> None:
    listing = [*infos("j/step-00000002/rank-0000/model.pt"), ObjectInfo("j/step-00000002/metadata.json", len(content), 1.0)]
    rec = recognise(listing, reader({"j/step-00000002/metadata.json": content}), root_name="r", now=LATER)
    (c,) = rec.checkpoints
    assert (c.committed, c.reason) == (False, reason)


def test_guide_step_mismatch_is_reported_not_guessed(guide_run: CheckpointRun, tmp_path: Path) -> None:
    run = copy_run(guide_run, tmp_path / "r")
    set_json_fields(run.path(4) / "metadata.json", step=5)
    rec = scan(run.root)
    assert [c.step for c in rec.checkpoints] == [2, 6]
    assert "metadata.json says step 5 but the directory is 'step-00000004'" in reasons(rec)["runs/mlp/step-00000004/"]


def test_guide_missing_or_resized_listed_file_is_a_shortfall(guide_run: CheckpointRun, tmp_path: Path) -> None:
    run = copy_run(guide_run, tmp_path / "r")
    listed = (run.path(2) / "rank-0000/optimizer.pt").stat().st_size
    (run.path(2) / "rank-0000/optimizer.pt").unlink()
    with open(run.path(4) / "rank-0000/model.pt", "ab") as fh:
        fh.write(b"x")
    rec = scan(run.root)

    gone = only(rec.checkpoints, 2)
    assert gone.committed  # the commit evidence is there; completeness is the state rules' call
    assert gone.shortfalls == (Shortfall("rank-0000/optimizer.pt", "metadata.json", None, listed, True),)
    assert "rank-0000/optimizer.pt (absent, listed in metadata.json)" in gone.reason
    assert "rank-0000/optimizer.pt" in gone.expected_sha256
    assert [f.relpath for f in gone.files] == ["metadata.json", "rank-0000/model.pt"]

    grown = only(rec.checkpoints, 4)
    size = (run.path(4) / "rank-0000/model.pt").stat().st_size
    assert grown.committed
    assert grown.shortfalls == (Shortfall("rank-0000/model.pt", "metadata.json", size, size - 1, True),)
    assert f"rank-0000/model.pt ({size} bytes, metadata.json says {size - 1})" in grown.reason
    assert only(rec.checkpoints, 6).shortfalls == ()


def test_guide_world_size_needs_every_rank_directory(guide_run: CheckpointRun, tmp_path: Path) -> None:
    """The repro: metadata.json names rank-0001's files (world_size 2) but rank 1 never arrived."""
    run = copy_run(guide_run, tmp_path / "r")
    meta = json.loads((run.path(6) / "metadata.json").read_text())
    meta["world_size"] = 2
    meta["files"]["rank-0001/optimizer.pt"] = {"size": 5439, "sha256": "0" * 64}
    (run.path(6) / "metadata.json").write_text(json.dumps(meta))
    set_json_fields(run.path(4) / "metadata.json", world_size=2)  # no files listed for rank 1 at all
    rec = scan(run.root)
    assert [str(x) for x in only(rec.checkpoints, 6).shortfalls] == [
        "rank-0001/ (absent, listed in metadata.json)",
        "rank-0001/optimizer.pt (absent, listed in metadata.json)",
    ]
    assert [x.relpath for x in only(rec.checkpoints, 4).shortfalls] == ["rank-0001/"]
    assert only(rec.checkpoints, 2).shortfalls == ()


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
    import warnings

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


def test_zero_byte_weights_make_a_checkpoint_incomplete(guide_run: CheckpointRun, tmp_path: Path) -> None:
    run = copy_run(guide_run, tmp_path / "r")
    (run.path(6) / "rank-0000/model.pt").write_bytes(b"")
    c = only(scan(run.root).checkpoints, 6)
    assert (c.committed, c.reason) == (False, "rank-0000/model.pt is empty (0 bytes): save in flight or torn")


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


# --------------------------------------------------------------------------
# Names


def test_unparseable_step_names_are_unrecognised(
    guide_run: CheckpointRun, hf_run: CheckpointRun, lightning_run: CheckpointRun, tmp_path: Path
) -> None:
    guide = copy_run(guide_run, tmp_path / "g")
    os.rename(guide.path(2), guide.path(2).with_name("step-abc"))
    hf = copy_run(hf_run, tmp_path / "h")
    os.rename(hf.path(2), hf.path(2).with_name("checkpoint-best"))
    lit = copy_run(lightning_run, tmp_path / "l")
    os.rename(lit.path(2), lit.path(2).with_name("epoch=0-step=x.ckpt"))

    for run, bad in [(guide, "runs/mlp/step-abc/"), (hf, "hf-out/checkpoint-best/"), (lit, "pl/ckpts/epoch=0-step=x.ckpt")]:
        rec = scan(run.root)
        assert [c.step for c in rec.checkpoints] == [4, 6]
        assert list(reasons(rec)) == [bad]
        assert "is not a step number" in reasons(rec)[bad]


def test_lightning_name_variants() -> None:
    names = {
        "d/epoch=3-step=300.ckpt": 300,
        "d/model-epoch=4-step=400-val_loss=0.25.ckpt": 400,
        "d/step=500.ckpt": 500,
        "d/global_step=600.ckpt": 600,
        "e/epoch=0-step=10.ckpt/checkpoint/mp_rank_00_model_states.pt": 10,  # DeepSpeed directory
    }
    ignored = ["d/last.ckpt", "d/last-v1.ckpt"]
    rec = recognise(infos(*names, *ignored), reader({}), root_name="r", now=LATER)
    assert {c.prefix.split("/checkpoint")[0]: c.step for c in rec.checkpoints} == {
        k.split("/checkpoint")[0]: v for k, v in names.items()
    }
    assert {c.job for c in rec.checkpoints} == {"d", "e"}
    assert rec.unrecognised == ()
    assert rec.objects == len(names) + len(ignored)


def test_duplicate_steps_keep_the_newest_and_report_the_rest() -> None:
    listing = [
        ObjectInfo("d/epoch=0-step=2.ckpt", 10, 100.0),
        ObjectInfo("d/epoch=0-step=2-v1.ckpt", 10, 200.0),
    ]
    rec = recognise(listing, reader({}), root_name="r", now=LATER)
    assert [c.prefix for c in rec.checkpoints] == ["d/epoch=0-step=2-v1.ckpt"]
    assert "also at 'd/epoch=0-step=2-v1.ckpt'" in reasons(rec)["d/epoch=0-step=2.ckpt"]


def test_dotdot_keys_are_unrecognised_and_never_part_of_a_checkpoint() -> None:
    listing = infos("job/step-1/__0_0.distcp", "job/step-1/.metadata", "job/../step-1/__1_0.distcp", "job/step-1/./x.distcp")
    rec = recognise(listing, reader({"job/step-1/.metadata": dcp_meta({"__0_0.distcp": 10})}), root_name="r", now=LATER)
    (c,) = rec.checkpoints
    assert [f.relpath for f in c.files] == [".metadata", "__0_0.distcp"]
    got = reasons(rec)
    assert set(got) == {"job/../step-1/__1_0.distcp", "job/step-1/./x.distcp"}
    assert all("'..' segment" in r for r in got.values())


def test_non_utf8_file_names_are_unrecognised(dcp_run: CheckpointRun, tmp_path: Path) -> None:
    run = copy_run(dcp_run, tmp_path / "r")
    bad = os.fsencode(run.path(4)) + b"/__1_0\xff.distcp"
    with open(bad, "wb") as fh:
        fh.write(b"shard")
    rec = scan(run.root)
    assert [c.step for c in rec.checkpoints] == [2, 4, 6]
    assert all(c.committed for c in rec.checkpoints)
    ((key, reason),) = reasons(rec).items()
    assert key == "titan/mlp/step-4/__1_0\\xff.distcp"  # printable, storable
    assert "not valid UTF-8" in reason
    key.encode("utf-8")


def test_own_files_are_skipped_quietly() -> None:
    keys = ["j/step-1/.ckptier-tmp-abc", "j/ckptier-manifest.json", "j/x.ckptier-manifest.json", ".ckptier/state.json"]
    assert all(is_own_file(k) for k in keys)
    assert not is_own_file("j/step-1/metadata.json")
    rec = recognise(infos(*keys), reader({}), root_name="r", now=LATER)
    assert (rec.checkpoints, rec.unrecognised, rec.objects) == ((), (), 4)


def test_stray_files_give_one_row_per_directory() -> None:
    listing = infos(*(f"data/a/f{i:05d}.bin" for i in range(5000)), *(f"logs/{i}.txt" for i in range(7)), "README")
    rec = recognise(listing, reader({}), root_name="r", now=LATER)
    got = reasons(rec)
    assert list(got) == ["", "data/a/", "logs/"]
    assert got["data/a/"].startswith("5000 file(s) in no known checkpoint format (e.g. 'f00000.bin')")
    assert got["logs/"].startswith("7 file(s)")
    assert got[""].startswith("1 file(s)")


def test_step_dir_of_unknown_content_is_stray_not_a_checkpoint() -> None:
    rec = recognise(infos("notes/step-by-step/readme.md"), reader({}), root_name="r", now=LATER)
    assert rec.checkpoints == ()
    assert list(reasons(rec)) == ["notes/step-by-step/"]


# --------------------------------------------------------------------------
# Metadata schema, reads and limits


def test_guide_metadata_list_form_with_prefixed_paths_and_bad_entries() -> None:
    digest = "ab" * 32
    meta = {
        "step": "12",
        "train_loss": 0.5,
        "files": [
            {"path": "step-00000012/rank-0000/model.pt", "sha256": f"sha256:{digest.upper()}", "bytes": 10},
            {"name": "./rank-0001/model.pt", "hash": "not-a-digest"},
            {"path": "../escape.pt", "sha256": digest},
        ],
    }
    files = {"j/step-00000012/metadata.json": json.dumps(meta).encode()}
    listing = [*infos("j/step-00000012/rank-0000/model.pt", "j/step-00000012/rank-0001/model.pt"),
               ObjectInfo("j/step-00000012/metadata.json", 200, 1.0)]
    (c,) = recognise(listing, reader(files), root_name="r", now=LATER).checkpoints
    assert c.committed and c.step == 12 and c.recorded_loss == 0.5
    assert dict(c.expected_sha256) == {"rank-0000/model.pt": digest}
    assert "unusable file path(s) ignored: '../escape.pt'" in c.reason
    assert "malformed sha256 ignored for rank-0001/model.pt" in c.reason


def test_transient_read_errors_propagate_and_others_become_reasons() -> None:
    listing = [*infos("j/step-00000001/rank-0000/model.pt"), ObjectInfo("j/step-00000001/metadata.json", 10, 1.0)]

    def flaky(key: str) -> bytes:
        raise Unavailable(f"{key}: SlowDown", key=key)

    with pytest.raises(Unavailable):
        recognise(listing, flaky, root_name="r", now=LATER)
    (c,) = recognise(listing, reader({}), root_name="r", now=LATER).checkpoints
    assert not c.committed and c.reason.startswith("metadata.json: could not be read (")


def test_oversized_metadata_is_not_read() -> None:
    listing = [*infos("j/step-00000001/rank-0000/model.pt"), ObjectInfo("j/step-00000001/metadata.json", 1 << 30, 1.0)]

    def boom(key: str) -> bytes:
        raise AssertionError("must not read an oversized metadata file")

    (c,) = recognise(listing, boom, root_name="r", now=LATER).checkpoints
    assert not c.committed and "over the 16777216-byte limit" in c.reason


# --------------------------------------------------------------------------
# User patterns


def test_pattern_rules_group_by_step_directory_or_file() -> None:
    rules = [
        PatternRule("mylib/save_*/**", r"save_(?P<step>\d+)", 30),
        PatternRule("snaps/*.tar", r"snap-(\d+)\.tar", 30),
    ]
    listing = [
        *infos("mylib/save_0000100/part_00/model_optim_rng.pt", "mylib/save_0000100/part_01/model_optim_rng.pt", mtime=1000),
        *infos("mylib/save_0000200/part_00/model_optim_rng.pt", mtime=1990),
        *infos("snaps/snap-5.tar", "snaps/other.tar", mtime=1000),
    ]
    rec = recognise(listing, reader({}), root_name="r", now=2000.0, patterns=rules)
    assert [(c.job, c.step, c.prefix, c.committed, len(c.files)) for c in rec.checkpoints] == [
        ("mylib", 100, "mylib/save_0000100", True, 2),
        ("mylib", 200, "mylib/save_0000200", False, 1),
        ("snaps", 5, "snaps/snap-5.tar", True, 1),
    ]
    assert all(c.format is Format.PATTERN for c in rec.checkpoints)
    assert "within the 30 s settle time" in rec.checkpoints[1].reason
    assert "match glob 'snaps/*.tar' but step_regex" in reasons(rec)["snaps/"]


def test_patterns_never_take_files_a_builtin_format_claims() -> None:
    rule = PatternRule("**", r"(\d+)", 0)
    rec = recognise(infos("j/step-3/__0_0.distcp", "j/step-3/.metadata"), reader({}), root_name="r", now=LATER, patterns=[rule])
    assert [c.format for c in rec.checkpoints] == [Format.DCP]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("a/*", r"(\d+", 1), "does not compile"),
        (("a/*", r"\d+", 1), "has no group"),
        (("a/*", r"(\d+)", -1), "settle_seconds -1"),
        (("", r"(\d+)", 1), "glob is empty"),
    ],
)
def test_pattern_rule_config_errors_name_the_field(args: tuple[str, str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PatternRule(*args)


def test_empty_root_name_is_refused() -> None:
    with pytest.raises(ValueError, match="root_name"):
        recognise([], reader({}), root_name="", now=0.0)


# --------------------------------------------------------------------------
# Properties and speed

SEGMENTS = st.sampled_from(
    ["step-1", "step-00000002", "step-x", "rank-0000", "checkpoint-3", "checkpoint-b", "j", "..", ".", "",
     "model.pt", "metadata.json", ".metadata", "a.distcp", "trainer_state.json", "model.safetensors",
     "epoch=0-step=4.ckpt", "last.ckpt", "step=y.ckpt", "\udcff", ".ckptier-tmp-1"]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(SEGMENTS, min_size=1, max_size=5).map("/".join), max_size=30, unique=True), st.data())
def test_recognise_never_crashes_and_never_shares_a_file(keys: list[str], data: st.DataObject) -> None:
    contents = {k: data.draw(st.sampled_from([b"{}", b'{"step": 1}', b'{"global_step": 3}', b"{", b""])) for k in keys}
    listing = [ObjectInfo(k, len(contents[k]) + 1, 1.0) for k in keys]
    rec = recognise(listing, reader(contents), root_name="r", now=LATER)
    claimed = [f.key for c in rec.checkpoints for f in c.files]
    assert len(claimed) == len(set(claimed))
    assert set(claimed) <= set(keys)
    assert rec.objects == len(keys)
    for c in rec.checkpoints:
        assert c.job and c.step >= 0 and c.reason
        assert all(f.key.startswith(c.prefix) for f in c.files)
    for u in rec.unrecognised:
        u.key.encode("utf-8")


def _guide_listing(n: int) -> list[ObjectInfo]:
    out: list[ObjectInfo] = []
    step = 0
    while len(out) < n:
        prefix = f"runs/job{step % 7}/step-{step:08d}"
        for rank in range(4):
            out.append(ObjectInfo(f"{prefix}/rank-{rank:04d}/model.pt", 100, 1.0))
            out.append(ObjectInfo(f"{prefix}/rank-{rank:04d}/optimizer.pt", 200, 1.0))
        out.append(ObjectInfo(f"{prefix}/metadata.json", 20, 1.0))
        step += 1
    return out[:n]


def _best_of(runs: int, fn: Callable[[], object]) -> tuple[float, object]:
    times, result = [], None
    for _ in range(runs):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def _baseline(listing: list[ObjectInfo]) -> dict[str, list[FileRef]]:
    """The least any recognition must do: one FileRef per object, grouped by
    directory (with the garbage collector paused, as recognise pauses it)."""
    groups: dict[str, list[FileRef]] = {}
    gc.disable()
    try:
        for info in listing:
            head, _, name = info.key.rpartition("/")
            groups.setdefault(head, []).append(FileRef(info.key, name, info.size, info.mtime, info.etag, info.checksum))
    finally:
        gc.enable()
    return groups


def test_100k_objects_fast_and_linear() -> None:
    meta = b'{"loss": 1.0}'
    big, small = _guide_listing(100_000), _guide_listing(25_000)
    t_base, _ = _best_of(2, lambda: _baseline(big))
    t_big, rec = _best_of(2, lambda: recognise(big, lambda k: meta, root_name="r", now=LATER))
    t_small, _ = _best_of(2, lambda: recognise(small, lambda k: meta, root_name="r", now=LATER))
    assert isinstance(rec, Recognition)
    assert len(rec.checkpoints) == 100_000 // 9 + 1
    assert sum(not c.committed for c in rec.checkpoints) == 1  # the last step is cut short: no metadata.json
    # Ratios against work measured in the same run, so a loaded machine slows both.
    # Linear: 4x the objects must not cost 16x (quadratic).
    assert t_big < 8 * t_small, (t_big, t_small)
    # About 3-4x the bare minimum here (0.3-0.5 s for 100k objects on an idle core).
    assert t_big < 8 * t_base, f"100,000 objects: {t_big:.2f} s vs baseline {t_base:.2f} s"
