"""Which model a restore drill trains, and the built-in demo model.

The model factory contract
--------------------------
A drill needs the code of the model; the checkpoint holds only its tensors.
Name a factory as ``"package.module:function"`` (importable in the drill's
Python environment) or ``"/path/to/file.py:function"``.

* The factory is called **inside the drill's subprocess** (no storage
  credentials, working directory = scratch), either with no arguments or, if
  it takes exactly one positional parameter, with the checkpoint's parsed
  metadata as a ``dict`` (the guide's ``metadata.json``, Hugging Face's
  ``trainer_state.json``, Lightning's top-level scalars and
  ``hyper_parameters``), whose ``step`` is always the checkpoint's step as
  the catalog knows it (the step the drill resumes from).
* It returns either a ``torch.nn.Module`` or a :class:`DrillSpec`
  ``(model, optimizer, batch, loss)``. Build everything on CPU; the drill
  moves the model to the drill device and loads the checkpoint into it.
* ``model.state_dict()`` keys and shapes must match the checkpoint exactly
  (strict loading; tied weights may be stored once).
* ``optimizer``: built over ``model.parameters()`` *before* the drill moves the
  model. Required when the checkpoint holds optimizer state (the drill loads
  that state into it and checks that its step counters continue). When the
  checkpoint has no optimizer state and none is given, a fresh
  ``SGD(lr=1e-4)`` is used.
* ``batch(step, device)`` returns the inputs of training step ``step``
  (deterministic: the same step gives the same batch); the drill uses steps
  ``S + 1 ... S + K`` where S is the checkpoint's step in the catalog, on
  every rank (a learning-rate schedule or data position keyed by the step
  sees the steps the run would have trained next). ``loss(model, batch)``
  returns a scalar tensor. Both are required for any model other than a
  Hugging Face ``transformers`` model (built from the checkpoint's
  ``config.json`` when no factory is given, with a synthetic token batch).

Without a factory
-----------------
Only Hugging Face Trainer checkpoints with a ``config.json`` can be drilled
without a factory (and only where ``transformers`` is installed): the model
comes from transformers' auto classes (:func:`hf_spec`) and, when the
checkpoint holds ``optimizer.pt``, the optimizer is rebuilt the way
``transformers.Trainer`` builds its default one (:func:`trainer_optimizer`).
Lightning, guide and DCP checkpoints hold tensors only; their drills need a
factory (``--model module:function`` or ``model`` in the job's ``[[drill]]``).

The demo model (``ckptier.tasks.drill_models:demo_model``) is the single source of
the architecture that ``ckptier demo`` trains and checkpoints.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ckptier.storage.errors import ConfigError
from ckptier.tasks.config import parse_factory_spec

BatchFn = Callable[[int, torch.device], Any]
LossFn = Callable[[nn.Module, Any], Tensor]


@dataclass
class DrillSpec:
    """What a factory gives a drill; see the module docstring for the contract.

    ``trajectory_rtol``: how close the drill's losses must retrace the
    run's recorded ones (``0.0``: bit-exact, for a factory that trains
    deterministically as the run did); None: the job's ``[[drill]]
    trajectory_rtol``. ``synthetic_batches``: ``batch`` is not the run's
    data (a Hugging Face model built without a factory), so the drill's
    losses cannot retrace the run's."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    batch: BatchFn | None = None
    loss: LossFn | None = None
    trajectory_rtol: float | None = None
    synthetic_batches: bool = False


def resolve_factory(spec: str) -> Callable[..., Any]:
    """Import and return the factory named by ``spec`` (runs the module's code)."""
    module_name, func = parse_factory_spec(spec)
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ConfigError(f"drill model {spec!r}: file {module_name} does not exist; fix the path")
            name = f"_ckptier_drill_factory_{abs(hash(str(path.resolve())))}"
            loader_spec = importlib.util.spec_from_file_location(name, path)
            assert loader_spec is not None and loader_spec.loader is not None
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[name] = module
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ConfigError:
        raise
    except ImportError as exc:
        raise ConfigError(
            f"drill model {spec!r}: cannot import {module_name!r} ({exc}); install the package that defines "
            "the model in the drill's environment or fix the name"
        ) from None
    factory: object = getattr(module, func, None)
    if not callable(factory):
        raise ConfigError(f"drill model {spec!r}: {module_name!r} has no callable {func!r}; fix the function name")
    return factory


def _takes_one_argument(factory: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) == 1 or any(p.kind is p.VAR_POSITIONAL for p in params)


def build_spec(factory: Callable[..., Any], metadata: Mapping[str, Any], *, name: str = "factory") -> DrillSpec:
    """Call ``factory`` per the contract and normalise its result to a DrillSpec."""
    result = factory(dict(metadata)) if _takes_one_argument(factory) else factory()
    if isinstance(result, DrillSpec):
        spec = result
    elif isinstance(result, nn.Module):
        spec = DrillSpec(model=result)
    else:
        raise ConfigError(f"drill model {name!r} returned a {type(result).__name__}; return a torch.nn.Module or a DrillSpec")
    if not isinstance(spec.model, nn.Module):
        raise ConfigError(f"drill model {name!r}: DrillSpec.model is a {type(spec.model).__name__}, not a torch.nn.Module")
    return spec


_HF_HEADS = (
    # (suffix of config.architectures[0], auto class, labels of the synthetic batch)
    ("ForSequenceClassification", "AutoModelForSequenceClassification", "classes"),
    ("ForMaskedLM", "AutoModelForMaskedLM", "tokens"),
    ("ForCausalLM", "AutoModelForCausalLM", "tokens"),
    ("LMHeadModel", "AutoModelForCausalLM", "tokens"),
)


def hf_head(architectures: Sequence[str] | None) -> tuple[str, str]:
    """The transformers auto class and the kind of labels (``tokens`` or
    ``classes``) for a checkpoint whose ``config.json`` lists
    ``architectures``; pure. The first architecture decides; an unknown or
    missing one gets a causal-LM head (the most common Trainer run)."""
    first = architectures[0] if architectures else ""
    for suffix, auto, labels in _HF_HEADS:
        if first.endswith(suffix):
            return auto, labels
    return "AutoModelForCausalLM", "tokens"


def hf_spec(config_dir: str | Path, *, seq_len: int = 32, batch_size: int = 2) -> DrillSpec:
    """A DrillSpec for a ``transformers`` model built from ``config.json`` (no downloads).

    The head follows ``config.architectures`` (:func:`hf_head`: causal LM,
    masked LM or sequence classification, through transformers' auto
    classes). The batch is random token ids seeded by the step, at most
    ``seq_len`` long and never longer than the model's positions, with
    ``labels = input_ids`` (or random class ids for a classifier); the loss is
    the model's own. The optimizer is left to the caller (the checkpoint's
    state decides; see :func:`trainer_optimizer`).
    """
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            f"{config_dir}: a Hugging Face checkpoint needs the 'transformers' package in the drill environment "
            "(pip install transformers), or a drill model factory (--model module:function)"
        ) from None
    config = transformers.AutoConfig.from_pretrained(str(config_dir), local_files_only=True)
    auto, labels_kind = hf_head(getattr(config, "architectures", None))
    try:
        model = getattr(transformers, auto).from_config(config)
    except ValueError:
        raise ConfigError(
            f"{config_dir}: {type(config).__name__} has no {auto[len('AutoModelFor'):]} head to train; "
            "give a drill model factory (--model module:function) with batch and loss"
        ) from None
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab <= 0:
        raise ConfigError(f"{config_dir}: config.json has no vocab_size; give a drill model factory with batch and loss")
    positions = int(getattr(config, "max_position_embeddings", 0) or 0)
    length = min(seq_len, positions) if positions > 0 else seq_len
    classes = int(getattr(config, "num_labels", 2) or 2)

    def batch(step: int, device: torch.device) -> dict[str, Tensor]:
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, vocab, (batch_size, length), generator=gen)
        labels = ids if labels_kind == "tokens" else torch.randint(0, classes, (batch_size,), generator=gen)
        return {"input_ids": ids.to(device), "labels": labels.to(device)}

    def loss(m: nn.Module, b: Any) -> Tensor:
        value: Tensor = m(**b).loss
        return value

    return DrillSpec(model=model, optimizer=None, batch=batch, loss=loss, synthetic_batches=True)


# --- the optimizer transformers.Trainer builds by default -------------------------

TRAINER_NO_DECAY_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
"""Parameter-name patterns (searched in the lowercased full name) that
``Trainer.get_decay_parameter_names`` excludes from weight decay, besides
every parameter inside an ``nn.LayerNorm`` (as in transformers 5.x)."""

_NO_DECAY_RULES: dict[str, tuple[tuple[re.Pattern[str], ...], bool]] = {
    # rule: (patterns, search the lowercased name?)
    "current": (tuple(re.compile(p) for p in TRAINER_NO_DECAY_PATTERNS), True),
    # older transformers releases: LayerNorm modules and names containing "bias" (case-sensitive).
    "legacy": ((re.compile("bias"),), False),
}


def trainer_decay_parameter_names(model: nn.Module, *, rule: str = "current") -> list[str]:
    """Names of ``model``'s parameters (``named_parameters()`` order, tied
    weights once) that ``transformers.Trainer`` puts in its weight-decay
    group; pure over the module tree.

    A parameter decays unless it lives inside an ``nn.LayerNorm`` (at any
    depth below ``model``) or its lowercased name matches one of the rule's
    patterns: ``current`` is :data:`TRAINER_NO_DECAY_PATTERNS` (bias, any
    layernorm/rmsnorm, a ``norm`` or ``*_norm`` component, on the lowercased
    name); ``legacy`` is ``bias`` only, as older transformers releases did.
    """
    try:
        patterns, lower = _NO_DECAY_RULES[rule]
    except KeyError:
        raise ConfigError(f"decay rule {rule!r} is unknown; use one of {', '.join(_NO_DECAY_RULES)}") from None
    names: list[str] = []
    for name, _ in model.named_parameters():
        searched = name.lower() if lower else name
        if any(p.search(searched) for p in patterns):
            continue
        module: nn.Module = model
        in_layer_norm = False
        for part in name.split(".")[:-1]:
            module = module.get_submodule(part)
            if isinstance(module, nn.LayerNorm):
                in_layer_norm = True
                break
        if not in_layer_norm:
            names.append(name)
    return names


def _group_sizes_fit(groups: Sequence[Sequence[nn.Parameter]], saved: Mapping[str, Any]) -> bool:
    saved_groups = saved["param_groups"]
    if [len(g) for g in groups] != [len(g.get("params", ())) for g in saved_groups]:
        return False
    params = [p for g in groups for p in g]
    state = saved.get("state") or {}
    for pid, pstate in state.items():
        if not isinstance(pid, int) or not 0 <= pid < len(params) or not isinstance(pstate, Mapping):
            return False
        avg = pstate.get("exp_avg")
        if isinstance(avg, Tensor) and tuple(avg.shape) != tuple(params[pid].shape):
            return False
    return True


def trainer_optimizer(model: nn.Module, saved: Mapping[str, Any]) -> torch.optim.AdamW:
    """The optimizer ``transformers.Trainer`` builds by default (``adamw_torch``
    / ``adamw_torch_fused``), over ``model``, ready for
    ``load_state_dict(saved)`` where ``saved`` is the checkpoint's
    ``optimizer.pt``.

    Two param groups in Trainer's order: the weight-decay parameters
    (:func:`trainer_decay_parameter_names`), then all other trainable ones,
    each in ``named_parameters()`` order. ``lr``, ``betas``, ``eps`` and each
    group's ``weight_decay`` come from ``saved["param_groups"]``. The current
    no-decay rule is tried first, then the legacy one; the first whose group
    sizes (and ``exp_avg`` shapes) fit ``saved`` wins. Raises
    :class:`ConfigError` (one line, saying to give a factory) when ``saved``
    is not a two-group Adam state or no rule fits.
    """
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if not isinstance(groups, Sequence) or not all(isinstance(g, Mapping) for g in groups):
        raise ConfigError("optimizer.pt is not an Optimizer.state_dict() (no param_groups); give a drill model factory (--model module:function)")
    if len(groups) != 2:
        raise ConfigError(
            f"optimizer.pt has {len(groups)} param groups, Trainer's default AdamW has 2 (decay, no decay): "
            "the run used its own optimizer; give a drill model factory (--model module:function) that builds it"
        )
    lacking = sorted({"lr", "betas", "eps", "weight_decay"} - set.intersection(*(set(g) for g in groups)))
    if lacking:
        raise ConfigError(
            f"optimizer.pt param groups lack {', '.join(lacking)}: not Trainer's default AdamW; "
            "give a drill model factory (--model module:function) that builds the run's optimizer"
        )
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    tried: list[str] = []
    for rule in _NO_DECAY_RULES:
        decay_names = set(trainer_decay_parameter_names(model, rule=rule))
        decay = [p for n, p in trainable if n in decay_names]
        rest = [p for n, p in trainable if n not in decay_names]
        if _group_sizes_fit((decay, rest), saved):
            return torch.optim.AdamW(
                [
                    {"params": decay, "weight_decay": float(groups[0]["weight_decay"])},
                    {"params": rest, "weight_decay": float(groups[1]["weight_decay"])},
                ],
                lr=float(groups[0]["lr"]),
                betas=(float(groups[0]["betas"][0]), float(groups[0]["betas"][1])),
                eps=float(groups[0]["eps"]),
            )
        tried.append(f"{rule} {len(decay)}+{len(rest)}")
    sizes = "+".join(str(len(g.get("params", ()))) for g in groups)
    raise ConfigError(
        f"optimizer.pt groups hold {sizes} parameters (decay+no decay) but Trainer's grouping of the model gives "
        f"{', '.join(tried)}; the run used another optimizer setup: give a drill model factory (--model module:function)"
    )


def train_step(spec: DrillSpec, step: int, device: torch.device) -> Tensor:
    """One training step (zero grads, forward, backward, optimizer step).

    Returns the loss (detached) computed before the update. Gradients are
    left in place for inspection. Requires batch, loss and optimizer.
    """
    if spec.batch is None or spec.loss is None or spec.optimizer is None:
        raise ConfigError("train_step needs a DrillSpec with batch, loss and optimizer")
    spec.optimizer.zero_grad(set_to_none=True)
    value = spec.loss(spec.model, spec.batch(step, device))
    value.backward()
    spec.optimizer.step()
    return value.detach()


# --- the demo model -----------------------------------------------------------

DEMO_INPUTS = 16
DEMO_HIDDEN = 64
DEMO_BATCH = 512
DEMO_LR = 1e-3
DEMO_SEED = 1234


class DemoMLP(nn.Module):
    """A small MLP regressor: 16 inputs -> 64 -> 64 -> 1 (GELU)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(DEMO_INPUTS, DEMO_HIDDEN),
            nn.GELU(),
            nn.Linear(DEMO_HIDDEN, DEMO_HIDDEN),
            nn.GELU(),
            nn.Linear(DEMO_HIDDEN, 1),
        )

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.net(x)
        return out.squeeze(-1)


def demo_batch(step: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The batch of training step ``step``: (x[512, 16], y[512]); deterministic.

    The target is a fixed smooth function of x plus a little noise, so the
    loss falls steadily during the demo's training.
    """
    gen = torch.Generator().manual_seed(DEMO_SEED * 1_000_003 + step)
    x = torch.randn(DEMO_BATCH, DEMO_INPUTS, generator=gen)
    weights = torch.linspace(-1.0, 1.0, DEMO_INPUTS) / DEMO_INPUTS**0.5
    y = torch.sin(x @ weights) + 0.5 * x[:, 0] * x[:, 1] + 0.01 * torch.randn(DEMO_BATCH, generator=gen)
    return x.to(device), y.to(device)


def demo_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """Mean squared error of the demo regressor."""
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def demo_model(metadata: Mapping[str, Any] | None = None) -> DrillSpec:
    """The demo's DrillSpec: :class:`DemoMLP` (same initial weights every call),
    AdamW(lr=1e-3), :func:`demo_batch`, :func:`demo_loss`. ``metadata`` is
    accepted per the factory contract and not needed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(DEMO_SEED)
        model = DemoMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=DEMO_LR)
    return DrillSpec(model=model, optimizer=optimizer, batch=demo_batch, loss=demo_loss)


def demo_train(spec: DrillSpec, steps: range, device: torch.device | str = "cpu") -> list[float]:
    """Train the demo for the given step numbers; returns per-step losses.

    The loss of the last step is what a checkpoint's ``metadata.json``
    should record as ``loss``.
    """
    dev = torch.device(device)
    spec.model.to(dev)
    spec.model.train()
    losses = [float(train_step(spec, step, dev)) for step in steps]
    if not all(math.isfinite(v) for v in losses):
        raise RuntimeError(f"demo training diverged: losses {losses[-3:]}")
    return losses
