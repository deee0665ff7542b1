#!/usr/bin/env python3
"""The reference checkpoint the benchmarks compress and verify, generated here.

usage: python bench/refdata.py [OUT_DIR]   -> OUT_DIR/ckpt.pt (about 252 MB), OUT_DIR/trained.pt (about 114 MB)

A synthetic but realistic training checkpoint, saved with ``torch.save`` and
identical on every run (seed 1234), so that figures from different runs and
machines compare:

* a small transformer (width 512, 4 blocks, vocabulary 8,192: 25.2 M
  parameters) in bf16 (about 51 MB). Weights have heavier tails than a
  Gaussian (Student-t, 5 degrees of freedom), a log-normal scale per row and
  a standard deviation per tensor between 0.006 and 0.05; norm weights are
  close to 1. Compression gains on real weights come from their exponent
  bytes, which this reproduces; it adds no artificial zeros, which would
  flatter any codec.
* fp32 Adam state: ``exp_avg`` (about 102 MB) around 1e-4 and
  ``exp_avg_sq`` (about 102 MB) around 1e-8, with per-tensor, per-row and
  per-element log-normal spread.

``ensure(out_dir)`` returns the path, generating the file only when absent.

``trained.pt`` is the other kind: weights and optimizer state that really
were trained. A residual MLP (width 1024, 8 blocks with LayerNorm and a head: 9.5 M
fp32 parameters) is trained for 300 AdamW steps (seed 1234) to imitate a
fixed random teacher network, and saved as a plain training loop saves it:
``{"model": state_dict, "optimizer": state_dict, "step": 300}`` (fp32
weights, ``exp_avg`` and ``exp_avg_sq``). Its bytes are what a trainer's
arithmetic leaves (mantissas with no structure a generator put there), so
codecs are compared on real statistics. The training runs on one CPU thread
(about a minute) so that the file is the same on every run of one machine;
BLAS kernels may differ across machines in the last bits, which leaves
ratios and speeds unchanged. ``ensure_trained(out_dir)`` generates it when
absent.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

SEED = 1234
WIDTH, BLOCKS, VOCAB, FFN = 512, 4, 8192, 2048
FILE_NAME = "ckpt.pt"
TRAINED_NAME = "trained.pt"
TRAINED_WIDTH, TRAINED_BLOCKS, TRAINED_STEPS, TRAINED_BATCH = 1024, 8, 300, 128


def _layers(rng: np.random.Generator, width: int = WIDTH) -> list[tuple[str, tuple[int, ...], float | None]]:
    """(name, shape, weight std or None for a norm weight), in save order."""
    d, ff = width, FFN * width // WIDTH
    out: list[tuple[str, tuple[int, ...], float | None]] = [("embed.weight", (VOCAB, d), 0.02)]
    for i in range(BLOCKS):
        p = f"layers.{i}."
        out += [
            (p + "attn_norm.weight", (d,), None),
            (p + "attn.q.weight", (d, d), 0.02 * rng.uniform(0.8, 2.0)),
            (p + "attn.k.weight", (d, d), 0.02 * rng.uniform(0.8, 2.0)),
            (p + "attn.v.weight", (d, d), 0.02 * rng.uniform(0.5, 1.2)),
            (p + "attn.o.weight", (d, d), 0.02 / np.sqrt(2 * BLOCKS) * rng.uniform(1.0, 3.0)),
            (p + "mlp_norm.weight", (d,), None),
            (p + "mlp.gate.weight", (ff, d), 0.02 * rng.uniform(0.6, 1.5)),
            (p + "mlp.up.weight", (ff, d), 0.02 * rng.uniform(0.6, 1.5)),
            (p + "mlp.down.weight", (d, ff), 0.02 / np.sqrt(2 * BLOCKS) * rng.uniform(1.0, 3.0)),
        ]
    out += [("final_norm.weight", (d,), None), ("lm_head.weight", (VOCAB, d), 0.02)]
    return out


def _heavy_tailed(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Student-t (5 degrees of freedom) samples scaled to unit variance.

    Drawn as float32, then scaled in float64 (the arithmetic, and so the
    bytes, of every earlier run of this generator)."""
    df = 5.0
    return rng.standard_t(df, size=shape).astype(np.float32) / np.sqrt(df / (df - 2))


def _per_row(rng: np.random.Generator, shape: tuple[int, ...], sigma: float) -> np.ndarray:
    """A log-normal factor per row (1 for vectors)."""
    if len(shape) == 1:
        return np.ones((1,), dtype=np.float32)
    return np.exp(rng.normal(0.0, sigma, size=(shape[0], 1))).astype(np.float32)


def write(path: Path, *, seed: int = SEED, width: int = WIDTH) -> Path:
    """Generate the reference checkpoint at ``path`` (overwrites); returns ``path``.

    Other ``seed``s give other checkpoints of the same kind (the ranks of a
    sharded save); ``width`` scales the model (512: 25.2 M parameters, 252
    MB; about ``16,384 w + 64 w**2`` parameters of 10 bytes each)."""
    import torch

    rng = np.random.default_rng(seed)
    model: dict[str, torch.Tensor] = {}
    state: dict[int, dict[str, torch.Tensor]] = {}
    layers = _layers(rng, width)
    for index, (name, shape, std) in enumerate(layers):
        if std is None:
            w = 1.0 + rng.normal(0.0, 0.05, size=shape).astype(np.float32)
        else:
            w = _heavy_tailed(rng, shape) * _per_row(rng, shape, 0.3) * np.float32(std)
        model[name] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(torch.bfloat16)
        tensor_scale = np.float32(10 ** rng.uniform(np.log10(3e-5), np.log10(3e-4)))
        grad_std = _per_row(rng, shape, 0.7) * tensor_scale
        grad_std = grad_std * np.exp(rng.normal(0.0, 0.5, size=shape)).astype(np.float32)
        exp_avg_sq = (grad_std.astype(np.float64) ** 2).astype(np.float32)
        exp_avg = (_heavy_tailed(rng, shape) * grad_std * np.float32(0.3)).astype(np.float32)
        state[index] = {
            "step": torch.tensor(10000.0),
            "exp_avg": torch.from_numpy(np.ascontiguousarray(exp_avg)),
            "exp_avg_sq": torch.from_numpy(np.ascontiguousarray(exp_avg_sq)),
        }
    checkpoint = {
        "model": model,
        "optimizer": {
            "state": state,
            "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
                              "params": list(range(len(layers)))}],
        },
    }
    return _save(checkpoint, path)


def _save(checkpoint: object, path: Path) -> Path:
    """``torch.save`` to ``path`` so that a killed run leaves no partial file.

    Saved under its final name (torch.save records the name inside the zip)
    in a sibling directory, then moved."""
    import torch

    partial = path.parent / f".{path.name}.partial"
    partial.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, partial / path.name)
    (partial / path.name).replace(path)
    partial.rmdir()
    return path


def write_trained(path: Path) -> Path:
    """Train the residual MLP of ``trained.pt`` and save it at ``path`` (overwrites); returns ``path``."""
    import torch
    from torch import nn

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(SEED)
        d = TRAINED_WIDTH

        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.norm = nn.LayerNorm(d)
                self.fc = nn.Linear(d, d)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x + torch.nn.functional.gelu(self.fc(self.norm(x)))

        model = nn.Sequential(*[Block() for _ in range(TRAINED_BLOCKS)], nn.LayerNorm(d), nn.Linear(d, d))
        teacher = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d))
        for p in teacher.parameters():
            p.requires_grad_(False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30))
        for _ in range(TRAINED_STEPS):
            x = torch.randn(TRAINED_BATCH, d)
            loss = torch.nn.functional.mse_loss(model(x), teacher(x))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            schedule.step()
    finally:
        torch.set_num_threads(threads)
    return _save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": TRAINED_STEPS}, path)


def ensure(out_dir: str | Path) -> Path:
    """``out_dir/ckpt.pt``, generated first when it does not exist yet."""
    path = Path(out_dir) / FILE_NAME
    return path if path.exists() else write(path)


def ensure_trained(out_dir: str | Path) -> Path:
    """``out_dir/trained.pt``, trained and saved first when it does not exist yet."""
    path = Path(out_dir) / TRAINED_NAME
    return path if path.exists() else write_trained(path)


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else Path(tempfile.gettempdir()) / "ckbench_data"
    for path in (ensure(out), ensure_trained(out)):
        print(f"{path}: {path.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
