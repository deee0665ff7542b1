"""Resume a Hugging Face ``Trainer`` run from the newest checkpoint ckptier proves now.

The one line a training script needs::

    trainer.train(resume_from_checkpoint=resume(job).path)

``resume`` asks the catalog (``$CKPTIER_CATALOG_URL``) for the job's newest
checkpoint, proves it now (every byte read, or ``verify="quick"``), falls back
past one that fails, fetches it into ``dest`` when only the archive holds it,
and records the attempt (``ckptier resume --job J --stats``). The job of a
Trainer run is its ``output_dir`` as scanned (``ckptier scan /data/ckpt``
catalogs ``/data/ckpt/hf-out/checkpoint-N`` as job ``hf-out``). On a first
launch there is nothing to resume: :class:`ckptier.ResumeError`, and the run
starts from step 0.

This script trains a tiny GPT-2 on random tokens on CPU, so that it runs
anywhere in seconds::

    python examples/hf_trainer_resume.py --job hf-out --output-dir /data/ckpt/hf-out --max-steps 2
    ckptier scan /data/ckpt && ckptier verify
    python examples/hf_trainer_resume.py --job hf-out --output-dir /data/ckpt/hf-out --max-steps 4

The second run resumes from ``checkpoint-2`` and trains steps 3 and 4. It
prints one JSON line: the checkpoint resumed from (null: none), the steps it
trained and the final step.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import transformers
from torch.utils.data import Dataset

from ckptier import ResumeError, resume


class RandomTokens(Dataset):  # type: ignore[type-arg]
    """Deterministic random token sequences (item i is always the same)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class TrainedSteps(transformers.TrainerCallback):
    """The steps this process trained (a resumed run starts after the checkpoint's)."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps.append(int(state.global_step))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", required=True, help="the run's name in the catalog")
    p.add_argument("--output-dir", required=True, help="the Trainer's output_dir (where checkpoint-N are saved)")
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--dest", help="where a checkpoint only the archive holds is fetched")
    args = p.parse_args()

    transformers.set_seed(0)
    transformers.logging.set_verbosity_error()
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16,
                                                                 n_layer=2, n_head=2))
    training = transformers.TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, save_steps=args.save_steps, logging_steps=1,
        per_device_train_batch_size=4, learning_rate=1e-3, report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
        dataloader_num_workers=0)
    trained = TrainedSteps()
    trainer = transformers.Trainer(model=model, args=training, train_dataset=RandomTokens(), callbacks=[trained])

    try:
        checkpoint: str | None = resume(args.job, dest=args.dest).path  # proven now, fetched if archived
    except ResumeError as exc:  # a first launch (or nothing provable): train from step 0
        print(f"nothing to resume: {exc}", flush=True)
        checkpoint = None
    trainer.train(resume_from_checkpoint=checkpoint)
    print(json.dumps({"resumed_from": checkpoint, "trained_steps": trained.steps,
                      "global_step": trainer.state.global_step}), flush=True)


if __name__ == "__main__":
    main()
