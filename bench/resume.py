"""How long ``ckptier resume`` takes for a small checkpoint, quick and full, against ``ckptier latest``.

Builds (in a new temporary directory) the demo run's 84 KiB checkpoints and
one 64 MiB guide checkpoint on local disk, scans and verifies them, then
times real processes, interpreter start and imports included, best of
``--repeat``, interleaved so that every contender sees the same load:
``ckptier latest --job J --json`` (the baseline: what a launcher calls
today), ``ckptier resume --job J --quick --json`` (a stat of each file) and
``ckptier resume --job J --json`` (every byte read now), plus
``ckptier verify --job J --deep`` for the full read's reference. Prints the
seconds, the ratio to ``latest``, and the time spent inside the call as
``resume --json`` reports it (``seconds``).

Run: ``python bench/resume.py [--repeat 5] [--mib 64]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--mib", type=int, default=64, help="size of the larger checkpoint")
    args = p.parse_args()
    import torch

    from ckptier.tasks.demo import train_demo_run, write_guide_checkpoint

    root = Path(tempfile.mkdtemp(prefix="ckptier-bench-resume-"))
    try:
        train_demo_run(root / "hot", steps=75, every=25, leave_last_in_flight=False)
        write_guide_checkpoint(root / "hot" / "big-run" / "step-00000001",
                               {"rank-0000/model.pt": {"w": torch.randn(args.mib << 18)}}, step=1, loss=1.0)
        cli = [sys.executable, "-c", "import sys; from ckptier.flows.cli import main; sys.exit(main())"]
        env = {**os.environ, "CKPTIER_CATALOG_URL": f"sqlite:///{root / 'catalog.db'}",
               "CKPTIER_CONFIG": str(root / "ckptier.toml")}
        (root / "ckptier.toml").write_text("")
        subprocess.run([*cli, "scan", str(root / "hot")], env=env, check=True, capture_output=True)
        subprocess.run([*cli, "verify"], env=env, check=True, capture_output=True)
        contenders = {}
        for job in ("demo-run", "big-run"):
            contenders[job, "latest"] = ["latest", "--job", job, "--json"]
            contenders[job, "resume --quick"] = ["resume", "--job", job, "--quick", "--json"]
            contenders[job, "resume (full)"] = ["resume", "--job", job, "--json"]
            contenders[job, "verify --deep"] = ["verify", "--job", job, "--deep", "--json"]
        best = dict.fromkeys(contenders, float("inf"))
        inside = dict.fromkeys(contenders, float("inf"))
        for _ in range(args.repeat):
            for key, argv in contenders.items():
                t = time.perf_counter()
                out = subprocess.run([*cli, *argv], env=env, check=True, capture_output=True, text=True).stdout
                best[key] = min(best[key], time.perf_counter() - t)
                if key[1].startswith("resume"):
                    inside[key] = min(inside[key], json.loads(out)["seconds"])
        for (job, name), seconds in best.items():
            ratio = seconds / best[job, "latest"]
            call = f"   in the call {inside[job, name]:.3f} s" if inside[job, name] != float("inf") else ""
            print(f"{job:9s} {name:15s} {seconds:6.3f} s  {ratio:4.2f}x latest{call}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
