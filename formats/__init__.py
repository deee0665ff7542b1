"""Checkpoint formats: one plug-in module per format, and one registry.

Each format's module says everything ckptier knows about it, and its own
docstring documents the layout and its commit evidence:

============================  =================================================
module                        format
============================  =================================================
:mod:`.guide`                 the storage guide: ``step-N/rank-R/*.pt`` + ``metadata.json``
:mod:`.dcp`                   PyTorch Distributed Checkpoint (``.metadata`` + ``*.distcp``), any directory
:mod:`.hf_trainer`            Hugging Face Trainer ``checkpoint-N/``
:mod:`.hf_weights`            Hugging Face sharded weights outside a Trainer checkpoint
:mod:`.lightning`             Lightning ``*.ckpt``
:mod:`.deepspeed`             DeepSpeed ``global_stepN/`` + the ``latest`` tag
:mod:`.megatron`              Megatron-LM ``iter_NNNNNNN/`` (legacy and ``torch_dist``) + the tracker
:mod:`.orbax`                 Orbax (JAX) step directories, saves in flight as ``*.orbax-checkpoint-tmp-*``
:mod:`.pattern`               the user's ``[[pattern]]`` rules
============================  =================================================

A plug-in (:class:`~.base.FormatPlugin`) tells how its checkpoints are
recognised and when they are complete (:meth:`~.base.FormatPlugin.anchor`,
:meth:`~.base.FormatPlugin.recognise`), which structural checks its
manifests get in verification (:meth:`~.base.FormatPlugin.checker`), how a
drill loads it safely (:meth:`~.base.FormatPlugin.load`), what the drill
needs from the user (:attr:`~.base.FormatPlugin.why_factory`), and how each
rank's files are found (:meth:`~.base.FormatPlugin.rank_files`). The
registry (:mod:`.registry`) lists them; :mod:`.recognise` is the pass over a
listing that every format shares.

Layers, one direction only::

    ckptier.storage   stores, catalog, model types, generic file checks (zip, safetensors)
          ^
    ckptier.formats   recognition and manifests (pure, torch-free at import),
          ^           the safe loader (torch, imported only when a drill loads)
    ckptier.tasks     scan, verify, drill... (the I/O around them)

``ckptier.formats`` imports ``ckptier.storage`` and nothing above it;
``ckptier.storage`` never imports ``ckptier.formats``. Importing this
package, the registry or any plug-in never imports torch: only
:mod:`.safe_load` (with :mod:`.allowlist` and :mod:`.stubs`) does, and the
plug-ins import it inside their ``load`` methods.
"""

from __future__ import annotations

from ckptier.formats.pattern import PatternRule
from ckptier.formats.recognise import is_own_file, recognise
from ckptier.formats.registry import DRILLABLE_FORMATS, METADATA_NAMES, PLUGINS, checker_for, plugin

__all__ = [
    "DRILLABLE_FORMATS",
    "METADATA_NAMES",
    "PLUGINS",
    "PatternRule",
    "checker_for",
    "is_own_file",
    "plugin",
    "recognise",
]
