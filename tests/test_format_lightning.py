"""Lightning .ckpt files (ckptier.formats.lightning)."""

from __future__ import annotations

from ckptier.formats import recognise

from tests.fixtures.checkpoints import CheckpointRun
from tests.fixtures.listing import LATER, infos, reader, scan


def test_lightning_checkpoint_within_settle_time_is_incomplete(lightning_run: CheckpointRun) -> None:
    newest = max((lightning_run.root / s.prefix).stat().st_mtime for s in lightning_run.steps.values())
    rec = scan(lightning_run.root, now=newest + 10)
    assert len(rec.checkpoints) == 3
    assert not any(c.committed for c in rec.checkpoints)
    assert "within the 60 s settle time" in rec.checkpoints[-1].reason
    rec = scan(lightning_run.root, now=newest + 10, lightning_settle_seconds=5)
    assert all(c.committed for c in rec.checkpoints)


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
