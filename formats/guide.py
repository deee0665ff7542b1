"""``guide``: the storage guide's layout, N ranks and a manifest written last.

``{job}/step-{N}/rank-{R}/model.pt``, ``optimizer.pt`` and
``{job}/step-{N}/metadata.json``, written last. Committed when
``metadata.json`` is a JSON object whose ``step`` (if present) equals N.
Accepted schema, every field optional::

    {"step": 1000,                       # int or digit string; must equal N
     "loss": 2.31,                       # number -> Found.recorded_loss
                                         #   ("train_loss" is read too)
     "files": {"rank-0000/model.pt": {"size": 123, "sha256": "<hex>"},
               "rank-0000/optimizer.pt": "<hex>"}}     # bare digest is fine
    # or "files": [{"path": "rank-0000/model.pt", "size": 123,
    #              "sha256": "sha256:<hex>"}, ...]
    # or "sha256": {"rank-0000/model.pt": "<hex>"}

Entry paths may be relative to the step directory or start with the step
directory's name; ``name``/``relpath``/``file`` stand in for ``path``,
``bytes`` for ``size``, ``hash`` for ``sha256``. Listed digests go to
``Found.expected_sha256``. A listed file that is missing or has another
size, and a ``rank-XXXX/`` directory missing below ``"world_size": N``,
are ``Found.shortfalls`` (the checkpoint is committed but not complete:
:func:`ckptier.storage.transitions.completeness` decides incomplete or
corrupt), named in ``reason`` too. Unusable entries (unsafe path,
malformed digest) are ignored and named in ``reason``. A ``step`` that
differs from N makes the directory :class:`Unrecognised` (ckptier does
not guess which one is right).

The job is the directory above ``step-{N}``. A drill loads ``rank-0000``
(``model.pt``, ``optimizer.pt``) with the safe torch loader; a checkpoint of
several ranks is refused until multi-rank drills (each rank's files:
:meth:`GuideFormat.rank_files`). A factory is always needed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptier.formats.base import FormatPlugin, Group, Scan, as_loss, as_step, names
from ckptier.storage.base import key_problem
from ckptier.storage.model import Format
from ckptier.storage.structure import Checker, Need, StructureError, manifest_checker, parse_json, shortfalls

if TYPE_CHECKING:
    from ckptier.formats.safe_load import LoadedCheckpoint

__all__ = ["PLUGIN", "guide_listed_files", "guide_needs"]

_GUIDE_META = "metadata.json"
_HEX = frozenset("0123456789abcdef")
_RANK_DIR = re.compile(r"^rank-(\d+)$")


def guide_listed_files(meta: dict[str, Any], dirname: str) -> tuple[dict[str, tuple[int | None, str | None]], list[str]]:
    """Files the guide's ``metadata.json`` lists: relpath -> (size, sha256 hex), plus notes on unusable entries.

    Accepted forms (every field optional): ``"files": {path: {"size", "sha256"}}``,
    ``"files": {path: "<hex>"}``, ``"files": [{"path", "size", "sha256"}, ...]``
    (``name``/``relpath``/``file`` for ``path``, ``bytes``/``size_bytes`` for
    ``size``, ``hash`` for ``sha256``), ``"sha256": {path: "<hex>"}``. Paths
    may start with the step directory's name (``dirname``).
    """
    entries: list[tuple[Any, Any, Any]] = []  # (path, size, digest)
    files = meta.get("files")
    if isinstance(files, dict):
        for path, entry in files.items():
            if isinstance(entry, dict):
                entries.append((path, _first(entry, "size", "bytes", "size_bytes"), _first(entry, "sha256", "hash")))
            else:
                entries.append((path, None, entry))
    elif isinstance(files, list):
        for entry in files:
            if isinstance(entry, dict):
                entries.append(
                    (
                        _first(entry, "path", "relpath", "name", "file"),
                        _first(entry, "size", "bytes", "size_bytes"),
                        _first(entry, "sha256", "hash"),
                    )
                )
    hashes = meta.get("sha256")
    if isinstance(hashes, dict):
        entries.extend((path, None, digest) for path, digest in hashes.items())
    listed: dict[str, tuple[int | None, str | None]] = {}
    bad_paths: list[str] = []
    bad_digests: list[str] = []
    for path, size, digest_value in entries:
        if not isinstance(path, str):
            bad_paths.append(repr(path))
            continue
        rel = path[2:] if path.startswith("./") else path
        if rel.startswith(dirname + "/"):
            rel = rel[len(dirname) + 1 :]
        if key_problem(rel) is not None:
            bad_paths.append(repr(path))
            continue
        digest = _digest(digest_value)
        if digest_value is not None and digest is None:
            bad_digests.append(rel)
        want = size if isinstance(size, int) and not isinstance(size, bool) and size >= 0 else None
        old_size, old_digest = listed.get(rel, (None, None))
        listed[rel] = (want if want is not None else old_size, digest or old_digest)
    notes = []
    if bad_paths:
        notes.append("metadata.json: unusable file path(s) ignored: " + names(bad_paths))
    if bad_digests:
        notes.append("metadata.json: malformed sha256 ignored for " + names(bad_digests))
    return listed, notes


def guide_needs(meta: dict[str, Any], dirname: str) -> tuple[list[Need], list[str]]:
    """What the guide's ``metadata.json`` requires: every listed file (with
    its exact size when recorded) and, for ``world_size`` N, the directories
    ``rank-0000/`` .. ``rank-{N-1:04d}/``. Plus notes on unusable entries."""
    listed, notes = guide_listed_files(meta, dirname)
    needs = [Need(rel, _GUIDE_META, size, size is not None) for rel, (size, _) in listed.items()]
    world = meta.get("world_size")
    if isinstance(world, int) and not isinstance(world, bool) and world > 0:
        if world > 1 << 16:
            notes.append(f"metadata.json: world_size {world} is implausible; ranks not checked")
        else:
            needs.extend(Need(f"rank-{r:04d}/", _GUIDE_META) for r in range(world))
    elif world is not None:
        notes.append(f"metadata.json: world_size {world!r} is not a positive integer; ranks not checked")
    return needs, notes


class GuideFormat(FormatPlugin):
    format = Format.GUIDE
    metadata_names = frozenset({_GUIDE_META})
    why_factory = "a guide checkpoint holds tensors only and the model's code is needed"

    def anchor(self, key: str, slash: int, up: int) -> str | None:
        if slash <= 0:
            return None
        if key.startswith("step-", up + 1):
            return key[:slash]
        if up > 0 and key.startswith("rank-", up + 1) and key.startswith("step-", key.rfind("/", 0, up) + 1):
            return key[:up]
        return None

    def recognise(self, group: Group, scan: Scan) -> None:
        prefix, dirname = group.prefix, group.dirname
        top = group.top()
        ranks = len(group.files) - len(top)
        if not ranks and _GUIDE_META not in top:
            for f in group.files:
                scan.unclaimed(f)
            return
        text = dirname[5:]
        if not (text.isascii() and text.isdigit()):
            scan.refuse(prefix + "/", f"{dirname!r}: {text!r} is not a step number; expected step-<digits>")
            return
        step, job, files = int(text), scan.job_of(prefix), group.files
        meta_info = top.get(_GUIDE_META)
        if meta_info is None:
            scan.emit(
                job=job, step=step, fmt=Format.GUIDE, prefix=prefix, files=files, committed=False,
                reason="no metadata.json: save in flight or torn",
            )
            return
        meta, problem = scan.read_json(meta_info, _GUIDE_META)
        if problem is None and not isinstance(meta, dict):
            problem = f"metadata.json: expected a JSON object, found {type(meta).__name__}"
        if problem is not None:
            scan.emit(job=job, step=step, fmt=Format.GUIDE, prefix=prefix, files=files, committed=False, reason=problem)
            return
        assert isinstance(meta, dict)
        if "step" in meta:
            claimed = as_step(meta["step"])
            if claimed is None:
                scan.refuse(prefix + "/", f"metadata.json: step {meta['step']!r} is not an integer")
                return
            if claimed != step:
                scan.refuse(
                    prefix + "/",
                    f"metadata.json says step {claimed} but the directory is {dirname!r}; "
                    "ckptier does not guess which is right",
                )
                return
        listed, _ = guide_listed_files(meta, dirname)
        needs, notes = guide_needs(meta, dirname)
        short = shortfalls(needs, group.sizes()) if needs else []
        reason = "committed: metadata.json present"
        if short:
            reason += "; metadata.json requires missing or short file(s): " + names([str(x) for x in short])
        if notes:
            reason += "; " + "; ".join(notes)
        expected = {rel: digest for rel, (_, digest) in listed.items() if digest is not None}
        loss = as_loss(meta.get("loss", meta.get("train_loss")))
        scan.emit(
            job=job, step=step, fmt=Format.GUIDE, prefix=prefix, files=files, committed=True, reason=reason,
            expected=expected, loss=loss, short=short,
        )

    def checker(self, relpath: str, name: str, base: str) -> Checker | None:
        return manifest_checker(relpath, _guide_manifest) if relpath == _GUIDE_META else None

    def rank_files(self, path: Path) -> dict[int, list[Path]]:
        out: dict[int, list[Path]] = {}
        for sub in sorted(path.glob("rank-*")):
            m = _RANK_DIR.match(sub.name)
            if m and sub.is_dir():
                out[int(m.group(1))] = sorted(p for p in sub.rglob("*") if p.is_file())
        return out

    def load(self, path: Path, allow: Sequence[Any]) -> LoadedCheckpoint:
        return _load_guide(path, allow)


PLUGIN = GuideFormat()


def _guide_manifest(c: Checker, data: bytes) -> None:
    meta = parse_json(data, _GUIDE_META)
    if not isinstance(meta, dict):
        raise StructureError(f"{_GUIDE_META}: expected a JSON object, found {type(meta).__name__}")
    needs, notes = guide_needs(meta, "")
    c.need(needs)
    for n in notes:
        c.note(n)


# -- loading (torch, lazily) ----------------------------------------------------


def _load_guide(path: Path, allow: Sequence[Any]) -> LoadedCheckpoint:
    from ckptier.formats.safe_load import (
        CheckpointLoadError,
        LoadedCheckpoint,
        float_or_none,
        read_json,
        safe_torch_load,
        step_from_name,
        unwrap_state,
    )

    ranks = sorted(p for p in path.glob("rank-*") if p.is_dir())
    if not ranks:
        raise CheckpointLoadError(f"{path}: no rank-NNNN directory; expected {{job}}/step-NNNNNNNN/rank-0000/model.pt")
    if len(ranks) > 1:
        raise CheckpointLoadError(
            f"{path}: not supported yet: {len(ranks)} ranks ({ranks[0].name}..{ranks[-1].name}); "
            "drills restore single-rank guide checkpoints; use a DCP checkpoint for sharded models"
        )
    rank = ranks[0]
    model = unwrap_state(safe_torch_load(rank / "model.pt", extra_allowlist=allow), rank / "model.pt", ("model", "state_dict", "model_state_dict"))
    optimizer = None
    if (rank / "optimizer.pt").is_file():
        optimizer = safe_torch_load(rank / "optimizer.pt", extra_allowlist=allow)
        if isinstance(optimizer, Mapping) and "state" not in optimizer and isinstance(optimizer.get("optimizer"), Mapping):
            optimizer = optimizer["optimizer"]
    extra = read_json(path / "metadata.json") if (path / "metadata.json").is_file() else {}
    step = extra.get("step") if isinstance(extra.get("step"), int) else step_from_name(path)
    return LoadedCheckpoint(model, optimizer, extra, "torch", step, float_or_none(extra.get("loss")))




# -- helpers -------------------------------------------------------------------


def _digest(value: Any) -> str | None:
    if not isinstance(value, str):
        return None
    text = value.strip().lower()
    if text.startswith("sha256:"):
        text = text[7:]
    return text if len(text) == 64 and set(text) <= _HEX else None


def _first(entry: dict[str, Any], *names: str) -> Any:
    for name in names:
        if name in entry:
            return entry[name]
    return None
