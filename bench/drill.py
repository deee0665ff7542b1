"""Time to the first training step of a restore drill vs a plain script.

Generates a guide-layout checkpoint (an MLP of 4 x 2048x2048 fp32 layers and
its AdamW state: ~200 MB) in a "hot" directory, then measures, alternating,
best of --reps:

* ours: copy the step directory into a scratch dir (the fetch), then
  ``run_drill_subprocess`` (subprocess start, credential-free env, safe
  weights-only load, strict key/shape check, optimizer restore with checks,
  first step); time to the moment the first step finished;
* baseline "plain script": one subprocess that copies the two files into a
  scratch dir, ``torch.load``s them, ``load_state_dict``s model and
  optimizer, and runs one step.

Both pay interpreter start and ``import torch``. Prints the ratio (target
<= 1.3x).

    python bench/drill.py [--dir /tmp/ckbench_drill] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

FACTORY = textwrap.dedent(
    '''
    import torch
    from torch import nn
    from ckptier.tasks.drill_models import DrillSpec

    WIDTH, DEPTH = 2048, 4


    def batch(step, device):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(64, WIDTH, generator=g)
        return x.to(device), torch.randn(64, WIDTH, generator=g).to(device)


    def loss(model, b):
        return nn.functional.mse_loss(model(b[0]), b[1])


    def build():
        torch.manual_seed(0)
        layers = []
        for _ in range(DEPTH):
            layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
        model = nn.Sequential(*layers[:-1])
        return DrillSpec(model, torch.optim.AdamW(model.parameters(), lr=1e-4), batch, loss)
    '''
)

BASELINE = textwrap.dedent(
    '''
    import shutil, sys, time, importlib.util
    from pathlib import Path
    import torch
    src, scratch, factory = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    (scratch / "rank-0000").mkdir(parents=True, exist_ok=True)
    for name in ("model.pt", "optimizer.pt"):
        shutil.copy(src / "rank-0000" / name, scratch / "rank-0000" / name)
    spec_ = importlib.util.spec_from_file_location("f", factory)
    mod = importlib.util.module_from_spec(spec_); spec_.loader.exec_module(mod)
    spec = mod.build()
    spec.model.load_state_dict(torch.load(scratch / "rank-0000" / "model.pt"))
    spec.optimizer.load_state_dict(torch.load(scratch / "rank-0000" / "optimizer.pt"))
    spec.optimizer.zero_grad()
    spec.loss(spec.model, spec.batch(2, torch.device("cpu"))).backward()
    spec.optimizer.step()
    print(time.time())
    '''
)


def make_checkpoint(root: Path, factory: Path) -> Path:
    step_dir = root / "hot" / "job" / "step-00000001"
    if (step_dir / "metadata.json").is_file():
        return step_dir
    import importlib.util

    spec_ = importlib.util.spec_from_file_location("bench_factory", factory)
    assert spec_ is not None and spec_.loader is not None
    module = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(module)
    spec = module.build()
    spec.optimizer.zero_grad()
    value = spec.loss(spec.model, spec.batch(1, torch.device("cpu")))
    value.backward()
    spec.optimizer.step()
    (step_dir / "rank-0000").mkdir(parents=True, exist_ok=True)
    torch.save(spec.model.state_dict(), step_dir / "rank-0000" / "model.pt")
    torch.save(spec.optimizer.state_dict(), step_dir / "rank-0000" / "optimizer.pt")
    (step_dir / "metadata.json").write_text(json.dumps({"step": 1, "loss": value.item()}))
    return step_dir


def ours(step_dir: Path, factory: Path, work: Path) -> tuple[float, str]:
    from ckptier.tasks.drill import judge, run_drill_subprocess

    scratch = Path(tempfile.mkdtemp(dir=work))
    start = time.time()
    local = scratch / "ckpt"
    shutil.copytree(step_dir, local)
    result = run_drill_subprocess(local, "guide", factory=f"{factory}:build", scratch=scratch, steps=1, timeout=600, device="cpu")
    verdict = judge(result)
    if result.error:
        raise SystemExit(f"drill failed: {result.error}")
    shutil.rmtree(scratch)
    return result.timings["first_step_done_at"] - start, verdict.summary


def baseline(step_dir: Path, factory: Path, work: Path) -> float:
    scratch = Path(tempfile.mkdtemp(dir=work))
    start = time.time()
    out = subprocess.run(
        [sys.executable, "-c", BASELINE, str(step_dir), str(scratch), str(factory)],
        check=True, capture_output=True, text=True,
    )
    done = float(out.stdout.strip().splitlines()[-1])
    shutil.rmtree(scratch)
    return done - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/ckbench_drill"))
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    factory = args.dir / "bench_factory.py"
    factory.write_text(FACTORY)
    step_dir = make_checkpoint(args.dir, factory)
    size = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
    print(f"checkpoint: {step_dir} ({size / 1e6:.0f} MB, guide layout)")
    work = args.dir / "work"
    work.mkdir(exist_ok=True)
    ours_times, base_times, summary = [], [], ""
    for _ in range(args.reps):
        base_times.append(baseline(step_dir, factory, work))
        t, summary = ours(step_dir, factory, work)
        ours_times.append(t)
    best_ours, best_base = min(ours_times), min(base_times)
    print(f"plain script (copy + torch.load + 1 step), best of {args.reps}: {best_base:.2f} s  {[round(t, 2) for t in base_times]}")
    print(f"ckptier drill (copy + isolated safe restore + 1 step), best of {args.reps}: {best_ours:.2f} s  {[round(t, 2) for t in ours_times]}")
    print(f"last drill verdict: {summary}")
    print(f"time to first step, drill vs plain script: {best_ours / best_base:.2f}x (target <= 1.3x)")


if __name__ == "__main__":
    main()
