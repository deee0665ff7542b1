"""Recognition anchors a directory's ordinary files once: every plug-in's
anchor must give one verdict for all files of a directory except the names
and name endings it declares (``anchor_names``/``anchor_suffixes``), and the
by-directory pass must equal anchoring every file."""

from __future__ import annotations

import itertools
import random

import pytest
from ckptier.formats import recognise
from ckptier.formats.base import FormatPlugin
from ckptier.formats.registry import METADATA_NAMES, PLUGINS, SIDECAR_NAMES
from ckptier.storage.base import ObjectInfo
from hypothesis import given, settings
from hypothesis import strategies as st

SEGMENTS = (
    "job", "checkpoint-5", "checkpoint-x", "iter_0000005", "mp_rank_00", "mp_rank_00_001", "global_step5",
    "step-5", "step-x", "rank-0", "rank-0001", "torch_dist", "x.ckpt", "epoch=1-step=5.ckpt",
    "5.orbax-checkpoint-tmp-17", "default", "metrics", "state", ".hidden", "model.safetensors",
    ".ckptier", "my checkpoint-5", "step_5", "last.ckpt",
)
"""Directory names that some anchor looks at, and some none does."""


def _names() -> list[str]:
    names = {
        "model.pt", "optimizer.pt", "metadata.json", "latest", "notes.txt", "", "a.distcp", "__0_0.distcp",
        ".metadata", "model-00001-of-00002.safetensors", "pytorch_model-00001-of-00002.bin", "model.safetensors",
        "pytorch_model.bin", "x.ckpt", "epoch=1-step=5.ckpt", "checkpoint-5", "iter_0000005", "step-5",
        "global_step5", "rank-0", "x.orbax-checkpoint-tmp-1", "_CHECKPOINT_METADATA", "commit_success.txt",
        "model.safetensors.index.json", "pytorch_model.bin.index.json", "ckptier-manifest.json",
        ".ckptier-tmp-1", "trainer_state.json", "zero_to_fp32.py", "latest_checkpointed_iteration.txt",
        "model_optim_rng.pt", "mp_rank_00_model_states.pt", ".hidden", "a\\b", "é.pt",
    }
    names |= METADATA_NAMES | SIDECAR_NAMES
    for p in PLUGINS:
        names |= p.anchor_names
        names |= {"x" + s for s in p.anchor_suffixes} | {s.lstrip(".") for s in p.anchor_suffixes}
    return sorted(names)


NAMES = _names()
DIRS = sorted(
    {"/".join(c) for depth in (1, 2, 3) for c in itertools.product(SEGMENTS, repeat=depth)
     if depth < 3 or c[0] == "job"}
)
ANCHORING = [p for p in PLUGINS if type(p).anchor is not FormatPlugin.anchor]


def _anchor(p: FormatPlugin, key: str) -> str | None:
    slash = key.rfind("/")
    up = key.rfind("/", 0, slash) if slash > 0 else -1
    return p.anchor(key, slash, up)


@pytest.mark.parametrize("plugin", ANCHORING, ids=lambda p: p.format.value)
def test_each_anchor_gives_one_verdict_per_directory_outside_its_declared_names(plugin: FormatPlugin) -> None:
    ordinary = [n for n in NAMES if n not in plugin.anchor_names and not n.endswith(plugin.anchor_suffixes)]
    declared = [n for n in NAMES if n not in ordinary]
    assert declared or not (plugin.anchor_names or plugin.anchor_suffixes)
    for d in DIRS:
        verdicts = {_anchor(plugin, f"{d}/{n}") for n in ordinary}
        assert len(verdicts) == 1, (
            f"{plugin.format.value}'s anchor claims files of {d!r} by name ({sorted(map(str, verdicts))}); "
            "declare those names in anchor_names or anchor_suffixes"
        )
        (verdict,) = verdicts
        assert verdict is None or not verdict.startswith(f"{d}/"), (d, verdict)


def test_the_anchors_claim_something_in_the_varied_set() -> None:
    """The set above exercises every anchor, by directory and by name."""
    for p in ANCHORING:
        assert any(_anchor(p, f"{d}/{n}") is not None for d in DIRS[:200] for n in NAMES), p.format


def _listing(keys: list[str]) -> list[ObjectInfo]:
    return [ObjectInfo(k, (i % 3) + 1 if i % 17 else 0, 1_000.0 + i % 7) for i, k in enumerate(keys)]


def _read(key: str) -> bytes:
    if key.endswith(".json") or key.endswith("_CHECKPOINT_METADATA"):
        return b'{"step": 5, "loss": 0.5, "commit_timestamp_nsecs": 1}'
    return b"5"


def _both(keys: list[str]) -> None:
    fast = recognise(_listing(keys), _read, root_name="root", now=10_000.0)
    slow = recognise(_listing(keys), _read, root_name="root", now=10_000.0, by_directory=False)
    assert fast == slow


def test_by_directory_equals_anchoring_every_file_on_a_varied_listing() -> None:
    rng = random.Random(13)
    dirs = rng.sample(DIRS, 400)
    keys = [f"{d}/{n}" for d in dirs for n in rng.sample(NAMES, 6)] + rng.sample(NAMES, 10)
    keys += ["a//b/model.pt", "a//b/optimizer.pt", "/abs/model.pt", "step-5/./x", "step-5/../x", "x/.ckptier/y"]
    keys = sorted(set(keys))
    _both(keys)
    rng.shuffle(keys)
    _both(keys)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DIRS[:300] + ["step-5", "job/step-5/rank-0"]), st.sampled_from(NAMES)),
                max_size=40, unique=True))
def test_by_directory_equals_anchoring_every_file(pairs: list[tuple[str, str]]) -> None:
    _both([f"{d}/{n}" for d, n in pairs])
