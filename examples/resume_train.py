"""Resume a training job on every rank from the newest checkpoint ckptier proves now.

Run it as torchrun would (2 ranks on CPU, gloo):

    torchrun --nproc-per-node 2 examples/resume_train.py --job demo-run --dest /scratch/resume

Rank 0 asks the catalog (``$CKPTIER_CATALOG_URL``) for the newest checkpoint
of the job, proves it now (falling back past a torn one) and fetches it into
``--dest`` when only the archive holds it; every rank gets the same path and
step over the process group, loads it, and trains on. When nothing can be
proven (a first launch), every rank gets the same error and starts from step 0.
The job here is ckptier's demo model (``ckptier demo`` or ``train_demo_run``
writes its checkpoints); a real script loads its own model the same way.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ckptier import ResumeError, demo_model, resume_distributed, train_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", required=True)
    p.add_argument("--dest", help="where a checkpoint only the archive holds is fetched")
    p.add_argument("--quick", action="store_true", help="prove by a stat of each file, not a full read")
    p.add_argument("--steps", type=int, default=2, help="training steps after resuming")
    args = p.parse_args()

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")  # torchrun's env:// rendezvous (RANK, WORLD_SIZE, MASTER_ADDR/PORT)
    rank = dist.get_rank() if dist.is_initialized() else 0

    spec = demo_model()
    try:
        answer = resume_distributed(args.job, dest=args.dest, verify="quick" if args.quick else "full")
        # The guide layout: each rank's shard under rank-NNNN/ (this job saved one, shared by every rank).
        shard = Path(answer.path) / "rank-0000"
        spec.model.load_state_dict(torch.load(shard / "model.pt", weights_only=True))
        assert spec.optimizer is not None
        spec.optimizer.load_state_dict(torch.load(shard / "optimizer.pt", weights_only=True))
        start, outcome = answer.step, {"path": answer.path, "passed_over": [s for s, _ in answer.passed_over]}
    except ResumeError as exc:
        start, outcome = 0, {"error": str(exc)}  # nothing to resume from: start from scratch
    losses = [float(train_step(spec, step, torch.device("cpu"))) for step in range(start + 1, start + 1 + args.steps)]
    print(json.dumps({"rank": rank, "step": start, **outcome, "losses": losses}), flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
