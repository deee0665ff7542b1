"""``guide``: the storage guide's layout, N ranks and a manifest written last.

``{job}/step-{N}/rank-{R}/model.pt``, ``optimizer.pt`` and
``{job}/step-{N}/metadata.json``, written last. Committed when
``metadata.json`` is a JSON object whose ``step`` (if present) equals N.
Accepted schema, every field optional::

    {"step": 1000,                       # int or digit string; must equal N
     "loss": 2.31,                       # number -> Found.recorded_loss
                                         #   ("train_loss" is read too)
     "metrics": {"eval_loss": 0.41},     # name -> number: Found.metrics (keep_best)
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

The job is the directory above ``step-{N}``. A drill loads a rank
directory (``model.pt``, ``optimizer.pt``) with the safe torch loader; a
checkpoint of N ranks is drilled by N workers, each fetching and loading
only its own rank's files (:meth:`GuideFormat.rank_files`). A factory is
always needed.

Replicated or sharded. By default every rank directory holds the whole
state (DDP: each rank saves ``model.state_dict()`` and
``optimizer.state_dict()``), and any one of them restores the run. A
checkpoint whose ranks each hold a part of the state (FSDP2) says so in
``metadata.json`` with a DCP-style description of the shards::

    {"step": 1000, "world_size": 4,
     "sharded": {"model.pt":     {"layers.0.weight": [4096, 1024], ...},
                 "optimizer.pt": {"state.layers.0.weight.exp_avg": [4096, 1024], ...}}}

Each listed tensor is split along dim 0 over ``world_size`` ranks as FSDP2
(``fully_shard``, ``Shard(0)``) splits it: rank r holds rows
``[r*c, min(n, (r+1)*c))``, ``c = ceil(n / world_size)``
(:func:`ckptier.formats.dcp.shard_rows`); the value is the whole tensor's
shape. Tensors not listed are the same on every rank. ``model.pt`` is the
model's state dict with each sharded tensor's local part
(``{k: v.to_local() for k, v in model.state_dict().items()}``),
``optimizer.pt`` the flattened optimizer state, local parts likewise
(``get_optimizer_state_dict(model, optimizer,
options=StateDictOptions(flatten_optimizer_state_dict=True))``: keys
``state.<param>.<name>`` and ``param_groups.<param>.<name>``). A drill
reads such a checkpoint through a DCP storage reader over the rank files
(:func:`guide_shard_reader`), so DCP's own planner restores it into any
number of ranks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptier.formats.base import REPLICATED, SHARDED, FormatPlugin, Group, RankFiles, Scan, as_loss, as_step, names
from ckptier.formats.dcp import shard_rows
from ckptier.storage.base import key_problem
from ckptier.storage.records import Format, clean_metrics
from ckptier.storage.structure import Checker, Need, StructureError, manifest_checker, parse_json, shortfalls

if TYPE_CHECKING:
    from ckptier.formats.safe_load import LoadedCheckpoint

__all__ = ["PLUGIN", "guide_listed_files", "guide_needs", "guide_shard_reader", "guide_sharding"]

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


_SHARD_FILES = ("model.pt", "optimizer.pt")


def guide_sharding(meta: Mapping[str, Any]) -> dict[str, dict[str, tuple[int, ...]]] | None:
    """The ``sharded`` description of a guide ``metadata.json`` (file name ->
    tensor key -> whole shape), or None when the ranks are replicas. Raises
    ``ValueError`` (one line naming the entry) when it is malformed; pure."""
    block = meta.get("sharded")
    if block is None:
        return None
    if not isinstance(block, Mapping):
        raise ValueError(f"metadata.json: sharded must be an object of file name -> {{key: shape}}, found {type(block).__name__}")
    out: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shapes in block.items():
        if name not in _SHARD_FILES or not isinstance(shapes, Mapping):
            raise ValueError(f"metadata.json: sharded.{name}: expected one of {', '.join(_SHARD_FILES)} mapping keys to shapes")
        for key, shape in shapes.items():
            if not (isinstance(shape, list) and shape and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)):
                raise ValueError(f"metadata.json: sharded.{name}.{key}: shape {shape!r} is not a list of dimensions (a scalar cannot be sharded)")
        out[name] = {str(k): tuple(v) for k, v in shapes.items()}
    return out


def _rank_dirs(relpaths: Sequence[str]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for rel in relpaths:
        head, sep, _ = rel.partition("/")
        m = _RANK_DIR.match(head) if sep else None
        if m:
            out.setdefault(int(m.group(1)), []).append(rel)
    return {r: sorted(files) for r, files in sorted(out.items())}


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
        metrics = meta.get("metrics")
        scan.emit(
            job=job, step=step, fmt=Format.GUIDE, prefix=prefix, files=files, committed=True, reason=reason,
            expected=expected, loss=loss, short=short, metrics=clean_metrics(metrics) if isinstance(metrics, dict) else None,
        )

    def checker(self, relpath: str, name: str, base: str) -> Checker | None:
        return manifest_checker(relpath, _guide_manifest) if relpath == _GUIDE_META else None

    def saved_ranks(self, relpaths: Sequence[str]) -> int:
        return max(len(_rank_dirs(relpaths)), 1)

    def rank_files(self, relpaths: Sequence[str], read: Callable[[str], bytes], world: int | None = None) -> RankFiles:
        """Replicas: drill rank r loads saved rank ``r mod N`` (its whole
        directory). Shards (``sharded`` in ``metadata.json``): drill rank r
        loads every saved rank whose rows of some sharded tensor overlap its
        own rows when the tensor is sharded again over the drill's ranks.
        ``metadata.json`` and any other top-level file is shared."""
        ranks = _rank_dirs(relpaths)
        if not ranks:
            raise ValueError("no rank-NNNN directory; expected step-NNNNNNNN/rank-0000/model.pt")
        meta: Mapping[str, Any] = {}
        if _GUIDE_META in relpaths:
            try:
                loaded = json.loads(read(_GUIDE_META))
            except (ValueError, UnicodeDecodeError) as exc:
                raise ValueError(f"metadata.json: not valid JSON ({exc})") from None
            meta = loaded if isinstance(loaded, Mapping) else {}
        saved = meta.get("world_size") if isinstance(meta.get("world_size"), int) else None
        saved = saved if saved and saved > 0 else max(ranks) + 1
        missing = [r for r in range(saved) if r not in ranks]
        if missing:
            raise ValueError(f"rank-{missing[0]:04d}/ is missing ({len(missing)} of {saved} ranks); the checkpoint is incomplete")
        shared = tuple(r for r in relpaths if "/" not in r)
        sharding = guide_sharding(meta)
        drill = world or saved
        if sharding is None:
            return RankFiles(saved, REPLICATED, shared, tuple(dict.fromkeys(ranks[r % saved]) for r in range(drill)))
        rows = {shape[0] for shapes in sharding.values() for shape in shapes.values()}
        needs = []
        for r in range(drill):
            mine = [shard_rows(n, drill, r) for n in sorted(rows)]
            theirs = {s for s in range(saved) for n, (a, b) in zip(sorted(rows), mine, strict=True)
                      if max(a, shard_rows(n, saved, s)[0]) < min(b, shard_rows(n, saved, s)[1])}
            chosen = sorted(theirs) or [r % saved]
            needs.append(dict.fromkeys(f for s in chosen for f in ranks[s]))
        return RankFiles(saved, SHARDED, shared, tuple(needs))

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
    from ckptier.formats.safe_load import (  # lazy: torch, for drills only
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
    extra = read_json(path / "metadata.json") if (path / "metadata.json").is_file() else {}
    try:
        sharded = guide_sharding(extra) is not None
    except ValueError as exc:
        raise CheckpointLoadError(f"{path}: {exc}") from None
    if len(ranks) > 1:
        raise CheckpointLoadError(
            f"{path}: {len(ranks)} ranks ({ranks[0].name}..{ranks[-1].name}) in one directory; "
            "load them one rank at a time, as a multi-rank drill does (ckptier drill fetches one rank per worker)"
        )
    rank = ranks[0]
    model = unwrap_state(safe_torch_load(rank / "model.pt", extra_allowlist=allow), rank / "model.pt", ("model", "state_dict", "model_state_dict"))
    optimizer = None
    if (rank / "optimizer.pt").is_file():
        optimizer = safe_torch_load(rank / "optimizer.pt", extra_allowlist=allow)
        if isinstance(optimizer, Mapping) and "state" not in optimizer and isinstance(optimizer.get("optimizer"), Mapping):
            optimizer = optimizer["optimizer"]
    layout = "torch"
    if sharded and isinstance(optimizer, Mapping):  # flattened like DCP's: tensors under state.<param>.<name>
        optimizer = {k: v for k, v in optimizer.items() if isinstance(k, str) and k.startswith("state.")}
        layout = "fqn-flat"
    step = extra.get("step") if isinstance(extra.get("step"), int) else step_from_name(path)
    return LoadedCheckpoint(model, optimizer, extra, layout, step, float_or_none(extra.get("loss")))


# -- sharded ranks through DCP's planner (torch, lazily) ------------------------


def guide_shard_reader(path: Path, allow: Sequence[Any] = ()) -> Any:
    """A ``torch.distributed.checkpoint`` storage reader over the rank
    directories of a sharded guide checkpoint fetched at ``path`` (some or
    all of ``rank-NNNN/``, and ``metadata.json``).

    Its metadata presents every tensor of ``model.pt`` as ``model.<key>`` and
    every tensor of ``optimizer.pt`` under ``state.`` as
    ``optimizer.state.<...>``, each in one chunk per saved rank (the
    ``sharded`` rule) or, when not sharded, in one whole chunk; so
    ``dcp.load`` with DCP's own planner restores them into any sharding.
    Rank files are loaded with the safe torch loader (``allow`` extends its
    allowlist), each once. Raises :class:`CheckpointLoadError` when a rank
    file's parts do not have the shapes the rule gives, and, while reading,
    when asked for a rank that was not fetched.
    """
    return _reader_class()(Path(path), allow)


_READER: list[type] = []


def _reader_class() -> type:
    if _READER:
        return _READER[0]
    import torch  # lazy: torch, for drills only
    from torch.distributed.checkpoint import StorageReader  # lazy: torch, for drills only
    from torch.distributed.checkpoint.metadata import (  # lazy: torch, for drills only
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import LoadPlan  # lazy: torch, for drills only
    from torch.futures import Future  # lazy: torch, for drills only

    from ckptier.formats.safe_load import CheckpointLoadError, read_json, safe_torch_load  # lazy: torch, for drills only

    class GuideShardReader(StorageReader):
        def __init__(self, path: Path, allow: Sequence[Any]) -> None:
            super().__init__()
            self.path = path
            meta = read_json(path / _GUIDE_META) if (path / _GUIDE_META).is_file() else {}
            try:
                self.sharding = guide_sharding(meta) or {}
            except ValueError as exc:
                raise CheckpointLoadError(f"{path}: {exc}") from None
            world = meta.get("world_size")
            self.present = {int(m.group(1)): p for p in sorted(path.iterdir()) if (m := _RANK_DIR.match(p.name)) and p.is_dir()}
            if not self.present:
                raise CheckpointLoadError(f"{path}: no rank-NNNN directory was fetched")
            self.world = world if isinstance(world, int) and world > 0 else max(self.present) + 1
            self.tensors: dict[int, dict[str, dict[str, Any]]] = {}
            for rank, rdir in self.present.items():
                self.tensors[rank] = {}
                for name in _SHARD_FILES:
                    if (rdir / name).is_file():
                        obj = safe_torch_load(rdir / name, extra_allowlist=allow)
                        if not isinstance(obj, Mapping):
                            raise CheckpointLoadError(f"{rdir / name}: not a state dict (a {type(obj).__name__})")
                        self.tensors[rank][name] = {k: v for k, v in obj.items()
                                                    if isinstance(v, torch.Tensor) and (name == "model.pt" or str(k).startswith("state."))}
            self.storage: dict[Any, tuple[int, str, str]] = {}

        def _key(self, name: str, key: str) -> str:
            return f"model.{key}" if name == "model.pt" else f"optimizer.{key}"

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:
                raise CheckpointLoadError(f"{self.path}: per-rank metadata is not part of the guide layout")
            first = self.tensors[min(self.present)]
            entries: dict[str, Any] = {}
            self.storage = {}
            for name, local in first.items():
                for key, tensor in local.items():
                    for rank in self.present:
                        if key not in self.tensors[rank].get(name, {}):
                            raise CheckpointLoadError(f"{self.path}/rank-{rank:04d}/{name}: has no {key}, which rank-{min(self.present):04d} has")
                    whole = self.sharding.get(name, {}).get(key)
                    props = TensorProperties(dtype=tensor.dtype)
                    if whole is None:
                        chunks = [ChunkStorageMetadata(offsets=torch.Size([0] * tensor.dim()), sizes=tensor.size())]
                        self.storage[MetadataIndex(self._key(name, key), chunks[0].offsets)] = (min(self.present), name, key)
                        entries[self._key(name, key)] = TensorStorageMetadata(props, tensor.size(), chunks)
                        continue
                    chunks = []
                    for rank in range(self.world):
                        start, stop = shard_rows(whole[0], self.world, rank)
                        sizes = torch.Size([stop - start, *whole[1:]])
                        have = self.tensors.get(rank, {}).get(name, {}).get(key)
                        if have is not None and tuple(have.shape) != tuple(sizes):
                            raise CheckpointLoadError(
                                f"{self.path}/rank-{rank:04d}/{name}: {key} has shape {list(have.shape)}, but "
                                f"{whole[0]} rows over {self.world} ranks give rank {rank} rows {start}..{stop} "
                                f"(shape {list(sizes)}); the sharded entry of metadata.json does not fit")
                        if stop > start:
                            offsets = torch.Size([start, *([0] * (len(whole) - 1))])
                            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
                            self.storage[MetadataIndex(self._key(name, key), offsets)] = (rank, name, key)
                    entries[self._key(name, key)] = TensorStorageMetadata(props, torch.Size(whole), chunks)
            return Metadata(state_dict_metadata=entries, storage_data=self.storage)

        def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            self.storage = metadata.storage_data

        def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
            return plan

        def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
            return plans

        def read_data(self, plan: LoadPlan, planner: Any) -> Future[None]:
            for req in plan.items:
                rank, name, key = self.storage[req.storage_index]
                if rank not in self.tensors:
                    raise CheckpointLoadError(
                        f"{self.path}: {req.storage_index.fqn} needs rank-{rank:04d}/{name}, which was not fetched "
                        "for this drill rank; the drill's rank plan missed it (report this as a ckptier bug)")
                part = self.tensors[rank][name][key]
                for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                    part = part.narrow(dim, start, length)
                target = planner.resolve_tensor(req).detach()
                if target.size() != part.size():
                    raise CheckpointLoadError(f"{self.path}: {req.storage_index.fqn}: read {list(part.shape)}, expected {list(target.shape)}")
                target.copy_(part)
                planner.commit_tensor(req, target)
            fut: Future[None] = Future()
            fut.set_result(None)
            return fut

        def reset(self, checkpoint_id: Any = None) -> None:
            pass

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return False

    _READER.append(GuideShardReader)
    return GuideShardReader




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
