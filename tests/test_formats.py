"""Format recognition over checkpoints written by the real libraries, torn ones,
odd names, user patterns, and listings of 100,000 objects."""

from __future__ import annotations

import gc
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from ckptier.formats import PatternRule, is_own_file, recognise
from ckptier.storage.base import ObjectInfo
from ckptier.storage.errors import ConfigError, Unavailable
from ckptier.storage.model import FileRef, Format, Recognition
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fixtures.checkpoints import (
    LR,
    CheckpointRun,
    copy_run,
    tiny_batch,
    tiny_loss,
    tiny_mlp,
)
from tests.fixtures.listing import LATER, dcp_meta, infos, reader, reasons, scan

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
        from torch.distributed.checkpoint.state_dict import (
            get_state_dict,
            set_state_dict,
        )

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


# --------------------------------------------------------------------------
# Torn and damaged checkpoints (copies of the real ones)


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


# --------------------------------------------------------------------------
# The plug-ins and their layers


def test_every_format_has_one_plugin_module_and_the_registry_lists_them() -> None:
    from ckptier.formats.registry import PLUGINS, plugin

    assert sorted(p.format for p in PLUGINS) == sorted(Format)
    for fmt in Format:
        module = type(plugin(fmt)).__module__
        assert module.startswith("ckptier.formats.") and plugin(fmt.value) is plugin(fmt)
        assert plugin(fmt).why_factory and (plugin(fmt).anchor is not None)


def test_recognition_and_the_registry_never_import_torch_and_storage_never_imports_formats() -> None:
    import ast
    import subprocess
    import sys

    code = ("import sys\nimport ckptier.formats, ckptier.formats.registry, ckptier.formats.recognise\n"
            "from ckptier.formats.registry import PLUGINS\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'ckptier.tasks'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    storage = Path(__file__).resolve().parents[1] / "storage"
    for path in storage.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith(("ckptier.formats", "ckptier.tasks")), (path, node.module)
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith(("ckptier.formats", "ckptier.tasks")) for a in node.names), path
    formats = Path(__file__).resolve().parents[1] / "formats"
    for path in formats.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            assert not any(n.startswith(("ckptier.tasks", "ckptier.flows", "prefect")) for n in names), (path, names)
