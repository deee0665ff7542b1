"""The pure parts of multi-rank drills: which rank reads what (each format's
rank_files), the device and backend, the verdict per rank, each rank's
scratch. No process group is started here."""

from __future__ import annotations

import json
import pickle
import socket
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptier.formats.base import RankFiles
from ckptier.formats.dcp import dcp_layout, shard_rows
from ckptier.formats.guide import guide_sharding
from ckptier.formats.registry import plugin
from ckptier.storage.errors import ConfigError
from ckptier.tasks.drill import WorkerResult, judge
from ckptier.tasks.drill_launch import (
    Fetched,
    _listen_loopback,
    choose_backend,
    drill_backends,
    prepare_ranks,
    rank_env,
    visible_cuda_devices,
)

# --- the device and the backend ----------------------------------------------------


@pytest.mark.parametrize(
    "device, world, gpus, expected",
    [
        ("cpu", 4, 8, ("cpu", "gloo")),
        ("auto", 4, 4, ("cuda", "nccl")),
        ("auto", 4, 8, ("cuda", "nccl")),
        ("auto", 4, 2, ("cpu", "gloo")),  # fewer GPUs than ranks: CPU, not a silent oversubscription
        ("auto", 1, 0, ("cpu", "gloo")),
        ("cuda", 2, 2, ("cuda", "nccl")),
        ("cuda:0", 2, 4, ("cuda", "nccl")),
        ("cuda", 4, 2, "needs 4 CUDA devices, found 2"),
        ("cuda", 1, 0, "needs 1 CUDA devices, found 0"),
        ("cpu", 0, 0, "world size 0 must be at least 1"),
        ("tpu", 2, 0, "'tpu' is unknown"),
    ],
)
def test_choose_backend(device: str, world: int, gpus: int, expected: tuple[str, str] | str) -> None:
    if isinstance(expected, str):
        with pytest.raises(ConfigError, match=expected):
            choose_backend(device, world, gpus)
    else:
        assert choose_backend(device, world, gpus) == expected


CPU, GPU = ("cpu", "gloo"), ("cuda", "nccl")


@pytest.mark.parametrize(
    "device, world, saved, gpus, expected",
    [
        ("auto", 4, 4, 0, (CPU, None)),  # no GPU: gloo, whatever the ranks
        ("auto", 4, 4, 4, (GPU, None)),  # a GPU per rank: NCCL
        ("auto", 4, 4, 3, (CPU, None)),  # one GPU short: gloo, never two ranks on one GPU
        ("auto", 2, 4, 2, (GPU, CPU)),  # resharding 4 -> 2 on 2 GPUs: the 4-rank reference on CPU
        ("auto", 2, 4, 4, (GPU, GPU)),
        ("auto", 1, 2, 0, (CPU, CPU)),
        ("cpu", 2, 4, 8, (CPU, CPU)),  # --device cpu: gloo even with GPUs
        ("cuda", 2, 4, 2, (GPU, CPU)),
        ("cuda", 2, 4, 4, (GPU, GPU)),
        ("cuda", 4, 2, 2, "needs 4 CUDA devices, found 2"),
    ],
)
def test_drill_backends_nccl_only_with_a_gpu_per_rank(device: str, world: int, saved: int, gpus: int,
                                                       expected: object) -> None:
    if isinstance(expected, str):
        with pytest.raises(ConfigError, match=expected):
            drill_backends(device, world, saved, gpus)
    else:
        assert drill_backends(device, world, saved, gpus) == expected


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, 2),
        ({"CUDA_VISIBLE_DEVICES": "0"}, 1),
        ({"CUDA_VISIBLE_DEVICES": ""}, 0),
        ({"CUDA_VISIBLE_DEVICES": "1,0"}, 2),
        ({"CUDA_VISIBLE_DEVICES": "0,-1,1"}, 1),  # CUDA stops at the first invalid entry
        ({"CUDA_VISIBLE_DEVICES": "GPU-8f2a"}, 1),
        ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 2),  # never more than the machine has
    ],
)
def test_visible_cuda_devices(env: dict[str, str], expected: int) -> None:
    nodes = ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-caps", "null"]
    assert visible_cuda_devices(env, nodes) == expected
    assert visible_cuda_devices({}, ["null", "tty"]) == 0


def test_ranks_rendezvous_on_loopback_only(tmp_path: Path) -> None:
    sock = _listen_loopback()
    try:
        assert sock.getsockname()[0] == "127.0.0.1" and sock.getsockname()[1] > 0
        with socket.create_connection(("127.0.0.1", sock.getsockname()[1]), timeout=5):
            pass
    finally:
        sock.close()
    env = rank_env({"PATH": "/bin", "AWS_SECRET_ACCESS_KEY": "x", "PREFECT_API_KEY": "y"}, tmp_path, 2, 4, 12345)
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"], env["MASTER_PORT"]) == ("2", "4", "127.0.0.1", "12345")
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"
    assert env["OMP_NUM_THREADS"] == "1" and env["HOME"] == str(tmp_path)
    assert "AWS_SECRET_ACCESS_KEY" not in env and "PREFECT_API_KEY" not in env
    assert rank_env({"OMP_NUM_THREADS": "8"}, tmp_path, 0, 2, 1)["OMP_NUM_THREADS"] == "8"


# --- which rank reads what -------------------------------------------------------------


@pytest.mark.parametrize(
    "rows, world, spans",
    [
        (16, 4, [(0, 4), (4, 8), (8, 12), (12, 16)]),
        (10, 4, [(0, 3), (3, 6), (6, 9), (9, 10)]),
        (1, 4, [(0, 1), (1, 1), (1, 1), (1, 1)]),  # one row: ranks 1-3 hold nothing
        (5, 2, [(0, 3), (3, 5)]),
        (0, 2, [(0, 0), (0, 0)]),
        (7, 1, [(0, 7)]),
    ],
)
def test_shard_rows_follow_fsdp2(rows: int, world: int, spans: list[tuple[int, int]]) -> None:
    assert [shard_rows(rows, world, r) for r in range(world)] == spans
    from torch.distributed.tensor.placement_types import Shard

    for r, (start, stop) in enumerate(spans):  # DTensor's own Shard(0) rule
        size, offset = Shard(0).local_shard_size_and_offset(rows, world, r)
        assert (size, offset if size else start) == (stop - start, start)


def _dcp_metadata(tensors: dict[str, tuple[list[int], list[tuple[list[int], list[int], str, int, int]]]],
                  byte_keys: dict[str, tuple[str, int, int]] | None = None) -> bytes:
    """DCP ``.metadata`` bytes as ``dcp.save`` writes them: key -> (size,
    [(offsets, sizes, file, byte offset, length)])."""
    entries: dict[str, object] = {}
    storage: dict[object, object] = {}
    for key, (size, chunks) in tensors.items():
        entries[key] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size), [
            ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s, *_ in chunks])
        for offsets, _, path, start, length in chunks:
            storage[MetadataIndex(key, torch.Size(offsets))] = _StorageInfo(path, start, length)
    for key, (path, start, length) in (byte_keys or {}).items():
        entries[key] = BytesStorageMetadata()
        storage[MetadataIndex(key)] = _StorageInfo(path, start, length)
    return pickle.dumps(Metadata(entries, storage_data=storage))


# An FSDP2 save of 2 ranks: weight [4, 3] in two chunks, bias [4] in two, the
# optimizer's step once (rank 1's file), param groups as bytes, a train state.
FSDP_TWO = _dcp_metadata(
    {
        "model.w": ([4, 3], [([0, 0], [2, 3], "__0_0.distcp", 0, 100), ([2, 0], [2, 3], "__1_0.distcp", 0, 100)]),
        "model.b": ([4], [([0], [2], "__0_0.distcp", 100, 50), ([2], [2], "__1_0.distcp", 100, 50)]),
        "optimizer.state.w.exp_avg": ([4, 3], [([0, 0], [2, 3], "__0_0.distcp", 150, 100),
                                                ([2, 0], [2, 3], "__1_0.distcp", 150, 100)]),
        "optimizer.state.w.step": ([], [([], [], "__1_0.distcp", 250, 30)]),
        "train_state.seen": ([], [([], [], "__0_0.distcp", 250, 30)]),
    },
    {"optimizer.param_groups.w.lr": ("__0_0.distcp", 280, 20)},
)


def test_dcp_layout_reads_metadata_without_running_it() -> None:
    layout = dcp_layout(FSDP_TWO)
    assert layout.sharded and layout.model_prefixed
    assert layout.loaded() == ["model.w", "model.b", "optimizer.state.w.exp_avg", "optimizer.state.w.step"]
    assert layout.tensors["model.w"] == ((4, 3), (((0, 0), (2, 3)), ((2, 0), (2, 3))))
    assert layout.items[("optimizer.state.w.step", ())] == ("__1_0.distcp", 250, 30)
    assert layout.byte_keys == {"optimizer.param_groups.w.lr"}
    hostile = pickle.dumps(Metadata({}, storage_data={})).replace(b"Metadata", b"Popen\x00\x00\x00")
    with pytest.raises(Exception, match="not a readable pickle|not torch"):
        dcp_layout(hostile)


def test_dcp_rank_files_same_size_each_rank_reads_its_own_shard_and_the_shared_scalars() -> None:
    rels = [".metadata", "__0_0.distcp", "__1_0.distcp", "metadata.json"]
    plan = plugin("dcp").rank_files(rels, lambda rel: FSDP_TWO)
    assert (plan.saved_world, plan.layout, plan.world, plan.shared) == (2, "sharded", 2, (".metadata", "metadata.json"))
    assert plan.needs[0] == {"__0_0.distcp": ((0, 250),), "__1_0.distcp": ((250, 30),)}  # the step scalar is in rank 1's file
    assert plan.needs[1] == {"__1_0.distcp": ((0, 280),)}  # never the train state or the param-group bytes
    assert plan.owners() == {"__0_0.distcp": 0, "__1_0.distcp": 1}
    sizes = {"__0_0.distcp": 300, "__1_0.distcp": 280}
    assert plan.needed_bytes(0, sizes) == 280 and plan.needed_bytes(1, sizes) == 280


def test_dcp_rank_files_reshard_read_the_overlapping_chunks() -> None:
    rels = [".metadata", "__0_0.distcp", "__1_0.distcp"]
    one = plugin("dcp").rank_files(rels, lambda rel: FSDP_TWO, 1)
    assert one.needs == ({"__0_0.distcp": ((0, 250),), "__1_0.distcp": ((0, 280),)},)
    four = plugin("dcp").rank_files(rels, lambda rel: FSDP_TWO, 4)  # one row each: rows 0, 1 were rank 0's
    assert four.needs[0] == four.needs[1] == {"__0_0.distcp": ((0, 250),), "__1_0.distcp": ((250, 30),)}
    assert four.needs[2] == four.needs[3] == {"__1_0.distcp": ((0, 280),)}
    assert four.owners() == {"__0_0.distcp": 0, "__1_0.distcp": 2}


def test_dcp_rank_files_replicated_ddp_save_every_rank_reads_everything() -> None:
    ddp = _dcp_metadata({  # DCP writes each replicated tensor once, spread over the ranks' files
        "model.w": ([4, 3], [([0, 0], [4, 3], "__0_0.distcp", 0, 120)]),
        "model.b": ([4], [([0], [4], "__1_0.distcp", 0, 40)]),
    })
    plan = plugin("dcp").rank_files([".metadata", "__0_0.distcp", "__1_0.distcp"], lambda rel: ddp)
    assert plan.layout == "replicated"
    assert plan.needs == ({"__0_0.distcp": ((0, 120),), "__1_0.distcp": ((0, 40),)},) * 2
    assert plan.owners() == {"__0_0.distcp": 0, "__1_0.distcp": 0}


def _guide_rels(world: int) -> list[str]:
    return ["metadata.json", *[f"rank-{r:04d}/{n}" for r in range(world) for n in ("model.pt", "optimizer.pt")]]


def test_guide_rank_files_replicas_and_shards() -> None:
    replicas = plugin("guide").rank_files(_guide_rels(2), lambda rel: b'{"step": 6, "world_size": 2}')
    assert (replicas.layout, replicas.saved_world, replicas.shared) == ("replicated", 2, ("metadata.json",))
    assert [list(n) for n in replicas.needs] == [["rank-0000/model.pt", "rank-0000/optimizer.pt"],
                                                 ["rank-0001/model.pt", "rank-0001/optimizer.pt"]]
    four = plugin("guide").rank_files(_guide_rels(2), lambda rel: b'{"world_size": 2}', 4)
    assert [sorted(n)[0] for n in four.needs] == ["rank-0000/model.pt", "rank-0001/model.pt"] * 2
    assert four.owners() == {f"rank-000{r}/{n}": r for r in (0, 1) for n in ("model.pt", "optimizer.pt")}

    meta = json.dumps({"world_size": 4, "sharded": {"model.pt": {"w": [16, 8], "b": [16]}, "optimizer.pt": {"state.w.exp_avg": [16, 8]}}})
    shards = plugin("guide").rank_files(_guide_rels(4), lambda rel: meta.encode())
    assert shards.layout == "sharded" and [sorted({p.split("/")[0] for p in n}) for n in shards.needs] == [
        [f"rank-000{r}"] for r in range(4)]
    two = plugin("guide").rank_files(_guide_rels(4), lambda rel: meta.encode(), 2)
    assert [sorted({p.split("/")[0] for p in n}) for n in two.needs] == [["rank-0000", "rank-0001"], ["rank-0002", "rank-0003"]]
    three = plugin("guide").rank_files(_guide_rels(4), lambda rel: meta.encode(), 3)  # rows 0-5, 6-11, 12-15
    assert [sorted({p.split("/")[0] for p in n}) for n in three.needs] == [
        ["rank-0000", "rank-0001"], ["rank-0001", "rank-0002"], ["rank-0003"]]
    with pytest.raises(ValueError, match="rank-0002/ is missing"):
        plugin("guide").rank_files(_guide_rels(2), lambda rel: meta.encode())


@pytest.mark.parametrize(
    "sharded, problem",
    [
        ({"model.pt": {"w": [4, 2]}}, None),
        ([1, 2], "sharded must be an object"),
        ({"weights.bin": {"w": [4]}}, "sharded.weights.bin"),
        ({"model.pt": {"w": []}}, "a scalar cannot be sharded"),
        ({"model.pt": {"w": [4, -1]}}, "sharded.model.pt.w"),
        ({"model.pt": {"w": "4x2"}}, "not a list of dimensions"),
    ],
)
def test_guide_sharding_is_checked(sharded: object, problem: str | None) -> None:
    if problem is None:
        assert guide_sharding({"sharded": sharded}) == {"model.pt": {"w": (4, 2)}}
    else:
        with pytest.raises(ValueError, match=problem.replace(".", r"\.")):
            guide_sharding({"sharded": sharded})
    assert guide_sharding({"step": 3}) is None


def test_partitioned_ranks_are_named_not_restored() -> None:
    # two model-parallel ranks, each with its ZeRO optimizer partition: each drill rank restores its own
    ds = ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
          "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"]
    plan = plugin("deepspeed").rank_files(ds, lambda rel: b"")
    assert (plan.saved_world, plan.layout) == (2, "partitioned")
    assert plan.needs[1] == {"mp_rank_01_model_states.pt": None, "zero_pp_rank_0_mp_rank_01_optim_states.pt": None}
    # one model-parallel rank with ZeRO-1/2 partitions: the drill joins them, every drill rank restores it whole
    zero2 = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    joined = plugin("deepspeed").rank_files(zero2, lambda rel: b"", 2)
    assert (joined.saved_world, joined.layout, joined.world) == (1, "replicated", 2)
    one = plugin("deepspeed").rank_files(zero2[:2], lambda rel: b"", 2)  # one rank: every drill rank restores it whole
    assert (one.saved_world, one.layout, one.world) == (1, "replicated", 2)
    # ZeRO-3 of 2 data-parallel ranks (weights partitioned too): joined into one replica as well
    zero3 = [f"zero_pp_rank_{dp}_mp_rank_00_{kind}_states.pt" for dp in range(2) for kind in ("model", "optim")]
    z3 = plugin("deepspeed").rank_files(zero3, lambda rel: b"", 2)
    assert (z3.saved_world, z3.layout, z3.world, plugin("deepspeed").saved_ranks(zero3)) == (1, "replicated", 2, 1)
    mega = ["mp_rank_00/model_optim_rng.pt", "mp_rank_01/model_optim_rng.pt"]
    assert plugin("megatron").rank_files(mega, lambda rel: b"").layout == "partitioned"
    assert plugin("megatron").saved_ranks(mega) == 2 and plugin("lightning").saved_ranks(["a.ckpt"]) == 1


# --- each rank's scratch ---------------------------------------------------------------------


def test_prepare_ranks_fetches_each_file_once_and_gives_other_ranks_sparse_ranges(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    hot.mkdir()
    files = {".metadata": b"m" * 10, "__0_0.distcp": bytes(range(256)) * 64, "__1_0.distcp": bytes(reversed(range(256))) * 64}
    for name, data in files.items():
        (hot / name).write_bytes(data)
    plan = RankFiles(2, "sharded", (".metadata",), (
        {"__0_0.distcp": ((0, 16384),), "__1_0.distcp": ((8000, 100),)},
        {"__1_0.distcp": ((0, 16384),)},
    ))
    fetched: list[tuple[str, ...]] = []

    def fetch(rels: list[str], dest: Path) -> Fetched:
        fetched.append(tuple(rels))
        dest.mkdir(parents=True)
        for rel in rels:
            (dest / rel).write_bytes(files[rel])
        return Fetched("hot", 0.0, sum(len(files[r]) for r in rels))

    shared = tmp_path / "shared"
    fetch([".metadata"], shared)
    scratches, fetches = prepare_ranks(plan, {k: len(v) for k, v in files.items()}, fetch, tmp_path / "ranks", shared_dir=shared)
    assert fetched == [(".metadata",), ("__0_0.distcp",), ("__1_0.distcp",)]  # every file crosses once
    zero, one = scratches
    assert zero.available == {"__0_0.distcp": None, "__1_0.distcp": [[8000, 100]]}
    assert one.available == {"__1_0.distcp": None}
    assert (zero.checkpoint / ".metadata").read_bytes() == (one.checkpoint / ".metadata").read_bytes() == b"m" * 10
    sparse = (zero.checkpoint / "__1_0.distcp").read_bytes()
    assert len(sparse) == len(files["__1_0.distcp"]) and sparse[8000:8100] == files["__1_0.distcp"][8000:8100]
    assert sparse[:8000] == bytes(8000)  # holes, never another rank's bytes
    assert zero.held_bytes < len(files["__0_0.distcp"]) + 8192  # its shard and one block of the other's
    assert one.held_bytes == len(files["__1_0.distcp"]) and not (one.checkpoint / "__0_0.distcp").exists()
    assert (zero.needed_bytes, one.needed_bytes) == (16484, 16384)
    assert zero.work.is_dir() and not any(zero.work.iterdir())


# --- the verdict ---------------------------------------------------------------------------


def _rank(rank: int, **changes: object) -> WorkerResult:
    base = WorkerResult(
        rank=rank, world_size=2, checkpoint="/x", format="dcp", steps=3, device="cpu", backend="gloo",
        parallel="fsdp2", losses=(0.5, 0.4, 0.3), recorded_loss=0.45, optimizer_loaded=True,
        optimizer_step_before=100.0, optimizer_step_after=103.0, trainable_params=4,
        timings={"first_step_s": 0.01}, exit_order=rank,
    )
    return replace(base, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "zero, one, failing, words",
    [
        ({}, {}, [], "drill ok: 2 ranks (fsdp2, gloo) x 3 steps"),
        ({"stopped": True, "error": "stopped by the drill after another rank failed", "exit_order": 1},
         {"error": "exited with code 3 without a result (last stage: build): boom", "error_stage": "crash", "exit_order": 0},
         ["completed"], "rank 1: crash: exited with code 3 without a result (last stage: build): boom; rank 0 stopped by the drill"),
        # The peer's collective error was seen first, but the rank that died without a result is the cause.
        ({"error": "training step failed: RuntimeError: gloo: Connection closed by peer", "error_stage": "train",
          "exit_order": 0},
         {"error": "exited with code 3 without a result (last stage: build)", "error_stage": "crash", "exit_order": 1},
         ["completed"], "rank 1: crash: exited with code 3 without a result (last stage: build) (then rank 0 failed too)"),
        ({"error": "rank 1: Connection closed by peer", "error_stage": "load", "exit_order": 1},
         {"error": "refused to load: it calls os.system", "error_stage": "load", "unsafe": True, "exit_order": 0},
         ["completed"], "rank 1: load: refused to load: it calls os.system (then rank 0 failed too)"),
        ({"timed_out": True, "error": "ran past", "last_stage": "restore", "timings": {"limit_s": 30.0}},
         {"timed_out": True, "error": "ran past", "last_stage": "build", "timings": {"limit_s": 30.0}},
         ["completed"], "timeout: ranks 0, 1 were killed at the time limit of 30 s; rank 1 was still in build while the others had reached restore"),
        ({}, {"losses": (0.5, float("nan"), 0.3)}, ["losses_finite", "replicas_agree"], "rank 1: non-finite loss at drill step(s) [2]"),
        ({}, {"losses": (0.5, 0.4)}, ["losses_finite"], "rank 1: expected 3 losses, got 2"),
        ({}, {"losses": (0.5, 0.4, 0.30000001)}, ["replicas_agree"], "rank 1's loss at drill step 3 is 0.3, rank 0's 0.3 (bit-exact"),
        ({"device": "cuda:0"}, {"device": "cuda:1", "losses": (0.5, 0.4, 0.30000001)}, [], "drill ok"),
        ({"restored_digest": "aa"}, {"restored_digest": "bb"}, ["replicas_agree"], "rank 1 restored other weights than rank 0"),
        ({"restored_digest": "aa"}, {"restored_digest": "aa"}, [], "ranks agree"),
        ({"grad_problems": ("w: zero gradient on every rank",)},
         {"grad_problems": ("w: zero gradient on every rank", "b: no gradient")}, ["gradients"],
         "w: zero gradient on every rank; rank 1: b: no gradient"),
        ({}, {"trainable_params": 0}, ["gradients"], "rank 1: the model has no trainable parameters"),
        ({}, {"optimizer_step_before": 0.0, "optimizer_step_after": 3.0}, ["optimizer_continues"],
         "rank 1: restored optimizer step counter is 0"),
        ({}, {"optimizer_step_after": 102.0}, ["optimizer_continues"], "rank 1: step counter went 100 -> 102, expected 103"),
        ({}, {"optimizer_step_before": 50.0, "optimizer_step_after": 53.0}, ["optimizer_continues"],
         "ranks restored different step counters: rank 0 100, rank 1 50"),
        ({"recorded_loss": 5.0}, {}, ["recorded_loss"], "first loss 0.5 vs recorded 5"),
    ],
)
def test_judge_ranks_table(zero: dict[str, object], one: dict[str, object], failing: list[str], words: str) -> None:
    verdict = judge([_rank(1, **one), _rank(0, **zero)], steps=3)  # any order
    assert [c.name for c in verdict.checks if not c.ok] == failing
    assert verdict.ok == (not failing)
    assert words in verdict.summary and "\n" not in verdict.summary
    if failing:
        assert verdict.summary.startswith(f"drill failed: {'' if failing == ['completed'] else failing[0] + ': '}")


def test_judge_ranks_resumes_against_the_same_size_restore() -> None:
    four = [_rank(r, world_size=4) for r in range(4)]
    ok = judge([_rank(0), _rank(1)], steps=3, reference=four)
    assert ok.ok and "resumes on 2 ranks (first losses match the 4-rank restore)" in ok.summary
    assert ok.checks[-1].name == "resumes" and "within rtol 0.0001 (largest difference 0)" in ok.checks[-1].detail
    near = [_rank(r, losses=(0.5, 0.4, 0.3 * (1 + 2e-6))) for r in range(2)]  # reduction order: ulps
    assert judge(near, steps=3, reference=four).ok
    off = [_rank(r, losses=(0.52, 0.4, 0.3)) for r in range(2)]
    verdict = judge(off, steps=3, reference=four)
    assert not verdict.ok and verdict.summary.startswith("drill failed: resumes: the run does not resume the same on 2 ranks")
    assert "at drill step 1 the loss is 0.52 on 2 ranks, 0.5 on 4" in verdict.summary
    assert judge(off, steps=3, reference=four, reshard_rtol=0.05).ok
    broken = [_rank(r, world_size=4, error="boom", error_stage="load", exit_order=r) for r in range(4)]
    verdict = judge([_rank(0), _rank(1)], steps=3, reference=broken)
    assert not verdict.ok and "cannot tell whether it resumes on 2 ranks: the 4-rank restore failed: drill failed: rank 0: load: boom" in verdict.summary
    cuda = [_rank(r, device=f"cuda:{r}", losses=(0.5, 0.4, 0.3 * (1 + 5e-4))) for r in range(2)]
    assert judge(cuda, steps=3, reference=four).ok  # CUDA vs the CPU restore: rtol 1e-3


def test_rank_result_round_trips_through_json() -> None:
    result = _rank(1, losses=(0.5, float("inf"), 0.3), grad_problems=("w: no gradient",))
    back = WorkerResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert back.losses == (0.5, None, 0.3) and back.grad_problems == ("w: no gradient",) and back.rank == 1


def test_the_drill_report_artifact_has_a_row_per_rank_and_the_resharding_outcome() -> None:
    from dataclasses import replace
    from datetime import UTC, datetime

    from ckptier.flows.drill import render_report
    from ckptier.tasks.reports import DrillRank, DrillReport, Reshard

    at = datetime(2025, 1, 1, tzinfo=UTC)
    base = DrillReport(job="j", step=6, ok=False, summary="j step 6: drill failed: resumes: ...", checks=(),
                       device="cpu", tier="hot", peak_memory_bytes=1, timings={}, started_at=at, finished_at=at)

    def rank(n: int, ok: bool, losses: tuple[float, ...], files: tuple[str, ...], held: int, stage: str | None,
             error: str | None) -> DrillRank:
        return DrillRank(rank=n, ok=ok, error=error, stage=stage, losses=losses, files=files, held_bytes=held,
                         needed_bytes=held, first_step_done_at=None, peak_memory_bytes=None, confined=True)

    ranks = (rank(0, True, (0.5, 0.4), ("a", "b"), 2048, None, None), rank(1, False, (), ("c",), 0, "load", "boom"))
    text = render_report([replace(base, world_size=2, saved_world_size=4, ranks=ranks,
                                  reshard=Reshard(from_world=4, to_world=2, resumes=False, detail="off by 3%",
                                                  reference_losses=()))])
    assert "Resharding 4 -> 2 ranks: **does not resume** (off by 3%)" in text
    assert "| 0 | ok | 2 | 2,048 | 0.5 |" in text and "| 1 | **FAIL** (load: boom) | 1 | 0 | - |" in text
    assert "| rank |" not in render_report([base])  # a single-rank drill: no rank table


def test_the_drill_report_artifact_names_the_verdict_steps_and_an_unmeasured_peak() -> None:
    from datetime import UTC, datetime

    from ckptier.flows.drill import render_report
    from ckptier.tasks.reports import DrillReport

    at = datetime(2025, 1, 1, tzinfo=UTC)
    failed = DrillReport(job="j", step=6, ok=False, summary="j step 6: drill failed at fetch: gone", checks=(),
                         stage="fetch", error="gone", started_at=at, finished_at=at)
    text = render_report([failed])
    assert "## j step 6: FAILED" in text and "peak memory not measured" in text and "0 bytes" not in text
    passed = DrillReport(job="j", step=20, ok=True, summary="j step 20: drill ok", checks=(), peak_memory_bytes=2048,
                         trained_steps=(21, 30), started_at=at, finished_at=at)
    assert "peak memory 2,048 bytes, trained steps 21..30" in render_report([passed])
    unfit = DrillReport(job="j", step=6, ok=False, summary="j step 6: not judged: ...", checks=(), stage="fit",
                        error="shape mismatch", started_at=at, finished_at=at)
    assert "## j step 6: NOT JUDGED" in render_report([unfit])
