"""The storage guide layout: recognition, N ranks, metadata.json as manifest (ckptier.formats.guide)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ckptier.formats import recognise
from ckptier.storage.base import ObjectInfo, read_bytes
from ckptier.storage.local import LocalStore
from ckptier.storage.records import Shortfall

from tests.fixtures.checkpoints import CheckpointRun, copy_run
from tests.fixtures.listing import (
    LATER,
    infos,
    only,
    reader,
    reasons,
    scan,
    set_json_fields,
)


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
        pytest.param(b'{"step": 2, "loss": ' + b"1" * 5000 + b"}",
                     "metadata.json: not valid JSON (exceeds the limit (4300 digits) for integer string conversion)",
                     id="5000-digit-integer"),
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


def test_zero_byte_weights_make_a_checkpoint_incomplete(guide_run: CheckpointRun, tmp_path: Path) -> None:
    run = copy_run(guide_run, tmp_path / "r")
    (run.path(6) / "rank-0000/model.pt").write_bytes(b"")
    c = only(scan(run.root).checkpoints, 6)
    assert (c.committed, c.reason) == (False, "rank-0000/model.pt is empty (0 bytes): save in flight or torn")


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


def test_guide_checkpoint_of_n_ranks_needs_every_rank(tmp_path: Path) -> None:
    import torch
    from ckptier.tasks.demo import write_guide_checkpoint

    from tests.fixtures.checkpoints import LR, tiny_mlp

    model = tiny_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    files = {f"rank-{r:04d}/{n}": (model.state_dict() if n == "model.pt" else optimizer.state_dict())
             for r in range(4) for n in ("model.pt", "optimizer.pt")}
    step_dir = tmp_path / "runs" / "big" / "step-00000100"
    write_guide_checkpoint(step_dir, files, step=100, loss=1.0, extra={"world_size": 4})
    (c,) = scan(tmp_path).checkpoints
    assert c.committed and c.shortfalls == () and len(c.files) == 9
    from ckptier.formats.registry import plugin

    rels = [f.relpath for f in c.files]
    plan = plugin("guide").rank_files(rels, lambda rel: (step_dir / rel).read_bytes())
    assert (plan.saved_world, plan.layout, plan.shared) == (4, "replicated", ("metadata.json",))
    assert [list(n) for n in plan.needs] == [[f"rank-{r:04d}/model.pt", f"rank-{r:04d}/optimizer.pt"] for r in range(4)]
    for name in ("model.pt", "optimizer.pt"):
        (step_dir / "rank-0003" / name).unlink()
    (c,) = scan(tmp_path).checkpoints
    assert c.committed and {s.relpath for s in c.shortfalls} == {
        "rank-0003/", "rank-0003/model.pt", "rank-0003/optimizer.pt"}
