"""Multi-rank drills of checkpoints written by real torch.distributed runs
(``dist_runs``: DDP and FSDP2 on 2 and 4 gloo ranks): one confined worker
per rank, each holding only its rank's files, resharding 4 -> 2 and 2 -> 1,
a rank that dies or hangs, and the command line of the "done when".

Every test here starts several Python processes that import torch: slow."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
import time
from pathlib import Path

import pytest
import torch

from ckptier.formats.dcp import dcp_layout
from ckptier.formats.safe_load import load_checkpoint_dir, safe_torch_load
from ckptier.tasks.drill_launch import Fetched, RankedDrill, cuda_device_count, run_ranked_drill
from tests.fixtures.checkpoints import CheckpointRun, tiny_batch, tiny_loss, tiny_mlp
from tests.fixtures.dist_checkpoints import DIST_STEPS, DIST_TIMEOUT_S, DistRuns

pytestmark = [pytest.mark.slow, pytest.mark.timeout(DIST_TIMEOUT_S)]  # the runs may be written twice

REPO = Path(__file__).resolve().parents[1]
FACTORY = "tests.fixtures.checkpoints:tiny_mlp_drill_spec"

# Factories the workers import by file path; RANK is set by the drill before a factory runs.
MISBEHAVING = textwrap.dedent(
    '''
    import os, subprocess, time
    from pathlib import Path
    from tests.fixtures.checkpoints import tiny_mlp_drill_spec


    def dies_on_rank_1():
        Path("pid").write_text(str(os.getpid()))
        if os.environ["RANK"] == "1":
            os._exit(3)
        return tiny_mlp_drill_spec()


    def hangs_on_rank_1():
        Path("pid").write_text(str(os.getpid()))
        if os.environ["RANK"] == "1":
            child = subprocess.Popen(["sleep", "300"])
            Path("child").write_text(str(child.pid))
            time.sleep(300)
        return tiny_mlp_drill_spec()
    '''
)


@pytest.fixture(autouse=True)
def _worker_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the workers import the factories from tests/
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "never-seen-by-a-rank")


def _files(src: Path) -> tuple[list[str], dict[str, int]]:
    rels = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())
    return rels, {r: (src / r).stat().st_size for r in rels}


def drill(src: Path, fmt: str, scratch: Path, *, world: int | None = None, factory: str = FACTORY,
          timeout: float = 180, steps: int = 2, device: str = "cpu") -> tuple[RankedDrill, list[list[str]]]:
    """``run_ranked_drill`` on a local copy; also returns what each fetch was asked for."""
    rels, sizes = _files(src)
    asked: list[list[str]] = []

    def fetch(relpaths: list[str], dest: Path) -> Fetched:
        asked.append(sorted(relpaths))
        dest.mkdir(parents=True)
        for rel in relpaths:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, dest / rel)
        return Fetched("hot", 0.0, sum(sizes[r] for r in relpaths))

    return run_ranked_drill(fmt, rels, sizes, fetch=fetch, scratch=scratch, factory=factory, steps=steps, device=device,
                            timeout=timeout, world_size=world), asked


def _landlock() -> bool:
    from ckptier.tasks.confine import landlock_abi

    return landlock_abi()[0] is not None


def _first_loss(state: dict[str, torch.Tensor]) -> float:
    """The loss of the first drill step computed by hand from a whole state dict."""
    model = tiny_mlp()
    model.load_state_dict(state)
    with torch.no_grad():
        return float(tiny_loss(model, tiny_batch(DIST_STEPS + 1)))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_fsdp2_dcp_of_4_ranks_each_rank_holds_its_shard_and_it_resumes_on_2(dist_runs: DistRuns, tmp_path: Path) -> None:
    src = dist_runs.step_dir("fsdp4", "dcp")
    result, asked = drill(src, "dcp", tmp_path, world=2)
    assert result.verdict.ok, result.verdict.summary
    assert "resumes on 2 ranks (first losses match the 4-rank restore)" in result.verdict.summary
    same, two = result.reference, result.run
    assert same is not None and (same.world, two.world, result.layout, result.saved_world) == (4, 2, "sharded", 4)
    # every shard crossed the network once per run, never twice: each file in one fetch
    shards = [f"__{r}_0.distcp" for r in range(4)]
    assert asked[0] == [".metadata", "metadata.json"]  # the manifests first, to plan
    for run_fetches in (asked[1:5], asked[5:]):  # a fetch per rank that owns something
        assert sorted(f for fetch in run_fetches for f in fetch if f.endswith(".distcp")) == shards
    sizes = _files(src)[1]
    layout = dcp_layout((src / ".metadata").read_bytes())
    scalars: dict[str, int] = {}  # bytes of the replicated scalars (Adam's step) DCP wrote into each file
    for (key, _), (path, _, length) in layout.items.items():
        if key in layout.tensors and layout.tensors[key][0] == ():
            scalars[path] = scalars.get(path, 0) + length
    for scratch in same.scratches:  # same size: a rank holds its own shard whole, others only as the ranges it reads
        own = f"__{scratch.rank}_0.distcp"
        assert scratch.available[own] is None
        others = {rel: ranges for rel, ranges in scratch.available.items() if rel != own}
        assert all(ranges is not None for ranges in others.values()), others
        for rel, ranges in others.items():  # of another rank's file, only the scalars every rank needs
            assert sum(n for _, n in ranges) == scalars[rel], (scratch.rank, rel)
        blocks = sum((n // 4096 + 2) * 4096 for r in others.values() for _, n in r)  # a range may straddle two blocks
        assert scratch.held_bytes <= sizes[own] + blocks  # sparse copies: holes take no disk
        assert sorted(p.name for p in scratch.checkpoint.iterdir()) == sorted([".metadata", "metadata.json", own, *others])
    for scratch in two.scratches:  # 2 ranks: each holds the two saved ranks whose rows it took
        whole = sorted(rel for rel, ranges in scratch.available.items() if ranges is None)
        assert whole == shards[2 * scratch.rank: 2 * scratch.rank + 2]
    for results in (same.results, two.results):
        for r in results:
            assert r.parallel == "fsdp2" and r.backend == "gloo" and r.optimizer_step_before == DIST_STEPS
            assert "AWS_SECRET_ACCESS_KEY" not in r.env_keys and r.env_keys  # credential-free
            assert r.confined == _landlock(), r.confinement
            if r.confined:
                assert r.confinement and r.confinement.endswith(str(Path(r.checkpoint).parent / "work"))
    whole = load_checkpoint_dir(src, "dcp").model_state  # one process, every shard: an independent path
    assert two.results[0].losses[0] == pytest.approx(_first_loss(whole), rel=1e-6)
    assert two.results[0].losses == same.results[0].losses


def test_sharded_guide_of_2_ranks_resumes_on_1(dist_runs: DistRuns, tmp_path: Path) -> None:
    src = dist_runs.step_dir("fsdp2", "guide")
    result, _ = drill(src, "guide", tmp_path, world=1)
    assert result.verdict.ok, result.verdict.summary
    assert (result.layout, result.saved_world, result.world) == ("sharded", 2, 1)
    assert [s.files for s in result.reference.scratches] == [  # type: ignore[union-attr]
        ["rank-0000/model.pt", "rank-0000/optimizer.pt"], ["rank-0001/model.pt", "rank-0001/optimizer.pt"]]
    parts = [safe_torch_load(src / f"rank-{r:04d}" / "model.pt") for r in range(2)]
    whole = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}  # the rule: dim-0 rows in rank order
    assert result.run.results[0].losses[0] == pytest.approx(_first_loss(whole), rel=1e-6)
    assert result.run.results[0].parallel == "fsdp2" and result.run.results[0].optimizer_loaded


def test_ddp_replicas_agree_and_a_rank_with_another_replica_is_named(dist_runs: DistRuns, tmp_path: Path) -> None:
    result, _ = drill(dist_runs.step_dir("ddp4", "dcp"), "dcp", tmp_path / "dcp")
    assert result.verdict.ok, result.verdict.summary
    assert {r.parallel for r in result.run.results} == {"ddp"} and result.layout == "replicated"
    assert len({r.restored_digest for r in result.run.results}) == 1
    src = tmp_path / "guide"
    shutil.copytree(dist_runs.step_dir("ddp2", "guide"), src)
    state = safe_torch_load(src / "rank-0001" / "model.pt", mmap=False)  # not a map of the file rewritten below
    state["net.0.bias"] = state["net.0.bias"] + 0.01  # rank 1 saved another replica (a desynchronised run)
    torch.save(state, src / "rank-0001" / "model.pt")
    result, _ = drill(src, "guide", tmp_path / "work")
    assert not result.verdict.ok
    assert result.verdict.summary == "drill failed: replicas_agree: rank 1 restored other weights than rank 0 (its replica of the checkpoint differs)"


@pytest.mark.parametrize("factory, seconds", [("dies_on_rank_1", 60.0), ("hangs_on_rank_1", 40.0)])
def test_a_rank_that_dies_or_hangs_fails_the_drill_within_the_timeout_leaving_no_process(
    dist_runs: DistRuns, tmp_path: Path, factory: str, seconds: float
) -> None:
    factories = tmp_path / "misbehaving.py"
    factories.write_text(MISBEHAVING)
    started = time.monotonic()
    result, _ = drill(dist_runs.step_dir("ddp2", "guide"), "guide", tmp_path / "scratch", factory=f"{factories}:{factory}",
                      timeout=seconds)
    elapsed = time.monotonic() - started
    verdict = result.verdict
    assert not verdict.ok and [c.name for c in verdict.checks] == ["completed"]
    if factory == "dies_on_rank_1":
        assert verdict.summary.startswith("drill failed: rank 1: crash: exited with code 3 without a result (last stage: build)")
        assert elapsed < seconds  # the other rank was stopped, not waited for
    else:
        assert verdict.summary.startswith("drill failed: timeout: ranks 0, 1 were killed at the time limit of 40 s; "
                                          "rank 1 was still in build while the others had reached train"), verdict.summary
        assert elapsed < seconds + 30
    pids = [int((s.work / "pid").read_text()) for s in result.run.scratches]
    if factory == "hangs_on_rank_1":
        pids.append(int((result.run.scratches[1].work / "child").read_text()))  # what the rank started dies with it
    assert len(pids) == len(set(pids)) >= 2
    assert [p for p in pids if _alive(p)] == []


@pytest.mark.skipif(cuda_device_count() < 1, reason="needs a CUDA GPU: the NCCL path runs on GPU machines only")
def test_nccl_on_the_gpus_there_are_resumes_like_the_gloo_restore(dist_runs: DistRuns, tmp_path: Path) -> None:
    """On a GPU machine: the FSDP2 checkpoint of 2 ranks restored on
    ``min(GPUs, 2)`` ranks over NCCL; on 1 GPU that is resharding 2 -> 1,
    checked against the same-size restore on CPU/gloo."""
    world = min(cuda_device_count(), 2)
    result, _ = drill(dist_runs.step_dir("fsdp2", "dcp"), "dcp", tmp_path, world=world, device="cuda")
    assert result.verdict.ok, result.verdict.summary
    assert (result.run.backend, result.run.device) == ("nccl", "cuda")
    assert [r.device for r in result.run.results] == [f"cuda:{r}" for r in range(world)]
    assert {r.parallel for r in result.run.results} == {"fsdp2"}
    if world == 1:
        assert result.reference is not None and result.reference.backend == "gloo"
        assert "resumes on 1 rank (first losses match the 2-rank restore)" in result.verdict.summary


@pytest.mark.parametrize("job", ["deepspeed", "megatron"])
def test_partitioned_ranks_say_not_supported_yet(job: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    run: CheckpointRun = request.getfixturevalue(f"{job}_run")
    src = tmp_path / "ckpt"
    shutil.copytree(run.path(max(run.steps)), src)
    if job == "deepspeed":  # two model-parallel ranks (ZeRO 1/2 partitions of one rank are joined, not refused)
        for name in list(os.listdir(src)):
            if "mp_rank_00" in name:
                shutil.copy(src / name, src / name.replace("mp_rank_00", "mp_rank_01"))
    else:
        shutil.copytree(src / "mp_rank_00", src / "mp_rank_01")
    with pytest.raises(Exception, match="not supported yet: its ranks hold model-parallel slices or optimizer partitions"):
        drill(src, job, tmp_path / "scratch")


def test_cli_drills_the_done_when_checkpoints(
    dist_runs: DistRuns, megatron_run: CheckpointRun, request: pytest.FixtureRequest, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """``ckptier drill --job J --device cpu`` passes on a 2-rank guide
    checkpoint, a 4-rank FSDP2 DCP one, a DeepSpeed and a Megatron one;
    ``--world-size 2`` passes on the 4-rank one and says it resumes."""
    from ckptier.flows.cli import main

    hot = tmp_path / "hot"
    for run, layout in (("ddp2", "guide"), ("fsdp4", "dcp")):
        shutil.copytree(dist_runs.job(run, layout), hot / run / layout)
    shutil.copytree(megatron_run.root / megatron_run.job, hot / megatron_run.job)
    jobs = {"ddp2/guide": "guide", "fsdp4/dcp": "dcp", megatron_run.job: "megatron"}
    try:
        ds: CheckpointRun = request.getfixturevalue("deepspeed_run")
    except pytest.skip.Exception:
        ds = None  # type: ignore[assignment]
    if ds is not None:
        shutil.copytree(ds.root / ds.job, hot / ds.job)
        jobs[ds.job] = "deepspeed"
    monkeypatch.setenv("CKPTIER_CATALOG_URL", f"sqlite:///{tmp_path / 'catalog.db'}")
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["scan", str(hot)]) == 0 and main(["verify"]) == 0
    capsys.readouterr()
    assert main(["ls", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    newest = {j: max(r["step"] for r in rows if r["job"] == j) for j in jobs}
    assert {(r["job"], r["format"], r["state"]) for r in rows if r["step"] == newest[r["job"]]} == {
        (j, f, "verified") for j, f in jobs.items()}
    # a model whose module does not import on the ranks: the operator's error, not the checkpoint's; nothing recorded
    broken = tmp_path / "broken_model.py"
    broken.write_text("import no_such_module_for_ckptier\n\n\ndef build():\n    return None\n")
    code = main(["drill", "--job", "ddp2/guide", "--device", "cpu", "--steps", "2", "--model", f"{broken}:build",
                 "--json", "--no-prefect"])
    (bad,) = json.loads(capsys.readouterr().out)
    assert code != 0 and (bad["ok"], bad["stage"], bad["recorded"]) == (False, "not-started", False), bad
    assert f"drill not started: drill model '{broken}:build' does not load" in bad["summary"], bad
    assert "no_such_module_for_ckptier" in bad["summary"], bad
    from ckptier.storage.catalog.api import Catalog

    with Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
        assert cat.drills() == []
    reports = {}
    for job in jobs:
        code = main(["drill", "--job", job, "--device", "cpu", "--steps", "2", "--model", FACTORY, "--json", "--no-prefect"])
        (reports[job],) = json.loads(capsys.readouterr().out)
        assert code == 0 and reports[job]["ok"], reports[job]["summary"]
    assert (reports["ddp2/guide"]["world_size"], reports["ddp2/guide"]["parallel"]) == (2, "ddp")
    four = reports["fsdp4/dcp"]
    assert (four["world_size"], four["layout"], four["parallel"], four["backend"]) == (4, "sharded", "fsdp2", "gloo")
    assert [sorted(r["files"]) != [] for r in four["ranks"]] == [True] * 4
    assert "world_size" not in reports[megatron_run.job]  # one rank: the single-rank drill as before
    assert main(["drill", "--job", "fsdp4/dcp", "--device", "cpu", "--steps", "2", "--model", FACTORY,
                 "--world-size", "2", "--no-prefect"]) == 0
    out = capsys.readouterr().out
    assert "(hot tier, 2 ranks on cpu/gloo, saved by 4): drill ok: 2 ranks (fsdp2, gloo)" in out
    assert "[ok] resumes: the run can resume on 2 ranks: losses match the 4-rank restore" in out
    assert main(["latest", "--job", "fsdp4/dcp", "--drilled", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["proof"] == "drilled"
